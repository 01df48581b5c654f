"""docs/trl_parity.md against TRL's own `GRPOConfig`: the table has one row for every field TRL adds to
`transformers.TrainingArguments` (read from the dataclass, so a TRL upgrade that adds or drops a field fails
here until the table says what we do with it), each with one of four statuses, TRL's default as the
dataclass has it, and, for `same` and `renamed`, a field our `GRPOConfig` really has."""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")                     # the test extra pins TRL 1.16

from pydantic import BaseModel                       # noqa: E402
from transformers import TrainingArguments           # noqa: E402
from trl import GRPOConfig as TRLGRPOConfig          # noqa: E402

from grpo_core.config import GRPOConfig              # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "trl_parity.md"
STATUSES = ("same", "renamed", "n/a", "missing")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")
COUNT = re.compile(r"(\d+) (same|renamed|n/a|missing)\b")


def trl_fields() -> dict[str, dataclasses.Field]:
    """The fields TRL's GRPOConfig adds to TrainingArguments, in declaration order."""
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name: f for f in dataclasses.fields(TRLGRPOConfig) if f.name not in base}


def render_default(f: dataclasses.Field) -> str:
    """The TRL default column: the dataclass default's repr in backticks."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return f"`{value!r}`"


def table_rows(text: str) -> list[dict[str, str]]:
    """The table's rows: field (first column, in backticks), default, status, notes."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if not m:
            continue
        cells = [c.strip() for c in m.group(2).split("|")]
        assert len(cells) == 3, f"row for {m.group(1)!r} must have 4 columns, has {len(cells) + 1}: {line!r}"
        rows.append({"field": m.group(1), "default": cells[0], "status": cells[1], "notes": cells[2]})
    return rows


def resolves(path: str) -> bool:
    """Whether the dotted `path` names a field of our GRPOConfig, through its nested section models."""
    model = GRPOConfig
    for part in path.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        model = model.model_fields[part].annotation
    return True


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def rows(doc) -> list[dict[str, str]]:
    return table_rows(doc)


def test_one_row_per_trl_field(rows):
    names = [r["field"] for r in rows]
    doubled = sorted(n for n, k in Counter(names).items() if k > 1)
    assert not doubled, f"{DOC.name}: more than one row for {doubled}"
    expected = set(trl_fields())
    add, remove = sorted(expected - set(names)), sorted(set(names) - expected)
    assert not add and not remove, (f"{DOC.name} is out of date with TRL {trl.__version__}: "
                                    + "; ".join(([f"add a row for {add}"] if add else [])
                                                + ([f"remove {remove}"] if remove else [])))


def test_statuses(rows):
    bad = {r["field"]: r["status"] for r in rows if r["status"] not in STATUSES}
    assert not bad, f"status must be one of {STATUSES}: {bad}"


def test_same_and_renamed_name_our_fields(rows):
    bad = []
    for r in rows:
        if r["status"] == "same" and r["field"] not in GRPOConfig.model_fields:
            bad.append(f"{r['field']}: `same`, but our GRPOConfig has no field of that name")
        if r["status"] == "renamed":
            ours = re.search(r"`([^`]+)`", r["notes"])
            if ours is None:
                bad.append(f"{r['field']}: `renamed` needs our field name in backticks first in the last column")
            elif not resolves(ours.group(1)):
                bad.append(f"{r['field']}: renamed to `{ours.group(1)}`, which is not a field of our GRPOConfig")
    assert not bad, "\n".join(bad)


def test_trl_defaults(rows):
    fields = trl_fields()
    bad = {r["field"]: (r["default"], render_default(fields[r["field"]]))
           for r in rows if r["field"] in fields and r["default"] != render_default(fields[r["field"]])}
    assert not bad, f"TRL default column (table, TRL {trl.__version__}): {bad}"


def test_counts_in_the_intro(doc, rows):
    intro = doc.split("\n|", 1)[0]
    stated = {status: int(n) for n, status in COUNT.findall(intro)}
    actual = Counter(r["status"] for r in rows)
    assert stated == {s: actual.get(s, 0) for s in STATUSES}, \
        f"the intro's counts {stated} differ from the table's {dict(actual)}"
