"""Users' own questions: JSONL, CSV, Parquet files, `datasets` datasets saved with `save_to_disk`, and a
folder of such files (with Stack Exchange `Posts.xml` dumps) read whole each time it is curated.

Each row becomes a Task. Columns are matched by name (first present wins):
  prompt <- prompt | question | problem | instruction;  answer <- answer | final_answer | solution_value
  tests  <- tests (a dict, or a JSON string);  reference_solution <- reference_solution | canonical_solution
  id, kind, entry_point, difficulty, license, meta, and source/provenance are used when present (so a
  file in the task schema itself, e.g. one written by `write_tasks`, keeps its sources).
Rule: a row with neither an `answer` nor `tests` is rejected as not automatically verifiable;
a row whose fields do not fit the schema is rejected as invalid_schema with the field named.
"""
from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from grpo_core.data.records import Rejection
from grpo_core.task import Task, TaskValidationError
from grpo_core.io import numbered_jsonl

ALIASES = {
    "prompt": ("prompt", "question", "problem", "instruction"),
    "answer": ("answer", "final_answer", "solution_value"),
    "reference_solution": ("reference_solution", "canonical_solution"),
}
PASSTHROUGH = ("id", "kind", "tests", "entry_point", "difficulty", "license", "meta", "source", "provenance")


def _first(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for n in names:
        if row.get(n) not in (None, ""):
            return row[n]
    return None


def _maybe_json(v: Any) -> Any:
    if isinstance(v, str) and v.strip()[:1] in ("{", "["):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def row_to_task(row: dict[str, Any], source: str, origin: str, index: int,
                default_kind: str | None = None, license: str = "user-provided", place: str | None = None
                ) -> Task | Rejection:
    """Map one user row onto the schema, or say why it cannot be used (`place`: where a rejection says the row
    is, e.g. 'line 12' of a file; default 'row <index>')."""
    where = place or f"row {index}"
    prompt = _first(row, ALIASES["prompt"])
    tid = str(row.get("id") or f"{source}/{hashlib.sha256(str(prompt).encode()).hexdigest()[:12]}")
    answer = _first(row, ALIASES["answer"])
    tests = _maybe_json(row.get("tests"))
    if tests in ("", None) or tests == {}:
        tests = None
    if not prompt:
        return Rejection(tid, source, "invalid_schema", f"{where}: no prompt column "
                         f"({'/'.join(ALIASES['prompt'])}) among its columns {sorted(row)}")
    if answer is None and tests is None:
        return Rejection(tid, source, "not_verifiable",
                         f"{where}: no answer and no tests, so a reward cannot be computed by rule")
    kind = row.get("kind") or default_kind or ("math" if tests is None else None)
    if kind is None:
        return Rejection(tid, source, "invalid_schema", f"{where}: code row needs a 'kind' column (python|rust)")
    meta = _maybe_json(row.get("meta")) or {}
    try:
        difficulty = None if row.get("difficulty") in (None, "") else float(row["difficulty"])
        task = Task(id=tid, kind=str(kind), source=str(row.get("source") or source), prompt=str(prompt),
                    answer=None if answer is None else str(answer), tests=tests,
                    entry_point=row.get("entry_point") or None,
                    reference_solution=_first(row, ALIASES["reference_solution"]),
                    difficulty=difficulty, license=str(row.get("license") or license),
                    provenance=str(row.get("provenance") or f"{origin} row {index}"), meta=meta if isinstance(meta, dict) else {"meta": meta})
        return task.validate()
    except (TaskValidationError, ValueError, TypeError) as e:
        return Rejection(tid, source, "invalid_schema", f"{where}: {e}")


def _rows_to_tasks(rows: Iterable[dict[str, Any]], source: str, origin: str, lines: Iterable[int] | None = None,
                   **kw: Any) -> Iterator[Task | Rejection]:
    """Each row as a Task or a Rejection; `lines`: each row's line in its file, for the rejections to name."""
    lines = iter(lines) if lines is not None else None
    for i, row in enumerate(rows):
        place = f"{origin}:{next(lines)}" if lines is not None else None
        yield row_to_task(dict(row), source, origin, i, place=place, **kw)


def _check(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {str(p)!r} does not exist; fix the source's 'path'")
    return p


def load_jsonl(path: str, source: str = "jsonl", kind: str | None = None, **_: Any) -> Iterable[Task | Rejection]:
    p = _check(path)
    return (row_to_task(row, source, str(p), i, default_kind=kind, place=f"{p}:{line}")
            for i, (line, row) in enumerate(numbered_jsonl(p)))


def load_csv(path: str, source: str = "csv", kind: str | None = None, **_: Any) -> Iterable[Task | Rejection]:
    p = _check(path)
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:     # -sig: the BOM spreadsheets write is no column name
            reader = csv.DictReader(f)
            rows, lines = [], []
            for row in reader:
                rows.append(row)
                lines.append(reader.line_num)            # the line its record ends on (a quoted field may span lines)
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {str(p)!r} is not UTF-8 text ({e.object[e.start]:#04x} at byte {e.start}); "
                         f"save it as UTF-8 (CSV UTF-8 in a spreadsheet)") from None
    return _rows_to_tasks(rows, source, str(p), lines, default_kind=kind)


def load_parquet(path: str, source: str = "parquet", kind: str | None = None, **_: Any) -> Iterable[Task | Rejection]:
    import pyarrow.parquet as pq
    p = _check(path)
    return _rows_to_tasks(pq.read_table(p).to_pylist(), source, str(p), default_kind=kind)


def load_hf_disk(path: str, split: str | None = None, source: str = "hf_disk", kind: str | None = None,
                 **_: Any) -> Iterable[Task | Rejection]:
    """A `datasets.Dataset` (or one split of a `DatasetDict`) written with `save_to_disk`."""
    import datasets
    p = _check(path)
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ValueError(f"{p} holds splits {list(ds)}; choose one with the source option 'split'")
            split = next(iter(ds))
        ds = ds[split]
    return _rows_to_tasks(iter(ds), source, f"{p}" + (f"[{split}]" if split else ""), default_kind=kind)


FOLDER_LOADERS = {".jsonl": load_jsonl, ".csv": load_csv, ".parquet": load_parquet}
POSTS_XML = "Posts.xml"                 # a Stack Exchange dump (grpo_core.data.sources.stackexchange)


def folder_files(path: str | Path) -> list[Path]:
    """The files of a folder that `load_folder` reads, in a stable order (hidden files and folders skipped)."""
    root = Path(path)
    return sorted(f for f in root.rglob("*") if f.is_file() and not any(
        part.startswith(".") for part in f.relative_to(root).parts)
        and (f.suffix.lower() in FOLDER_LOADERS or f.name == POSTS_XML))


def load_folder(path: str, source: str = "folder", kind: str | None = None,
                tags: list[str] | tuple[str, ...] = ("rust", "python", "python-3.x"), min_score: int = 0,
                **_: Any) -> Iterator[Task | Rejection]:
    """A folder of your files, whatever is in it when it is curated: .jsonl, .csv, .parquet and Posts.xml."""
    from grpo_core.data.sources import stackexchange
    files = folder_files(_check(path))
    if not files:
        raise FileNotFoundError(f"folder {str(path)!r} holds no .jsonl, .csv, .parquet or {POSTS_XML} file; add "
                                "your question files to it or fix the source's 'path'")
    for f in files:
        if f.name == POSTS_XML:
            yield from stackexchange.load(str(f), tags=tags, min_score=min_score)
        else:
            yield from FOLDER_LOADERS[f.suffix.lower()](str(f), source=source, kind=kind)
