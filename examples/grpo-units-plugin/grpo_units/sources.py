"""The `units_csv` task source: word problems with units from a CSV file.

A grpo-pipeline source is a function that takes the options of its entry in the curation YAML as
keyword arguments and yields tasks. Plain dicts are fine: `prompt` (or `question`), `answer`, and
optionally `id`, `kind` (default "math"), `meta`. Its `group` attribute ("synthetic", "community" or
"user") is what curation mix weights refer to.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterator

from grpo_units.units import UNITS, parse_quantity

BUNDLED = Path(__file__).with_name("questions.csv")


def units_csv(path: str | None = None, limit: int | None = None, **options) -> Iterator[dict]:
    """Word problems with units from a CSV with columns question, answer (e.g. "7 km") and optional id."""
    csv_path = Path(path) if path else BUNDLED
    if not csv_path.is_file():
        raise FileNotFoundError(f"units_csv: {str(csv_path)!r} does not exist; set the source's `path` to your CSV")
    with csv_path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    for i, row in enumerate(rows[:limit]):
        quantity = parse_quantity(row.get("answer") or "")
        if quantity is None or quantity[1] is None:
            raise ValueError(f"units_csv: {csv_path} row {i + 2}: answer {row.get('answer')!r} is not a number "
                             f"with a unit ({', '.join(UNITS)})")
        yield {"id": row.get("id") or f"units-{i:03d}", "prompt": row["question"].strip(),
               "answer": row["answer"].strip(), "kind": "math"}


units_csv.group = "user"
