"""bench/source_breakdown.py: evaluation answers counted per prompt shape and task source, from a plain or gzipped
eval_samples file."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import source_breakdown  # noqa: E402


def row(source: str, correct: bool, mode: str = "sampled", calls: int = 1, tools: bool = True, **shape) -> dict:
    return dict(mode=mode, source=f"tool_problems/{source}", correct=correct, tool_calls=calls, tools=tools, **shape)


def test_answers_are_counted_per_shape_and_source_sampled_only_by_default(tmp_path, capsys):
    rows = [row("product", True), row("product", False, calls=0), row("word_problem", True, wording="exported"),
            row("word_problem", False, wording="foreign"), row("product", False, tools=False, calls=0),
            row("product", True, mode="greedy")]
    path = tmp_path / "eval_samples.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    got = source_breakdown.breakdown(source_breakdown.read_rows(path))
    assert got == {("exported", "word_problem"): {"right": 1, "answers": 1, "called": 1},
                   ("foreign", "word_problem"): {"right": 0, "answers": 1, "called": 1},
                   ("training", "product"): {"right": 1, "answers": 2, "called": 1},
                   ("without_tools", "product"): {"right": 0, "answers": 1, "called": 0}}
    assert source_breakdown.breakdown(rows, "greedy") == {("training", "product"): {"right": 1, "answers": 1,
                                                                                    "called": 1}}
    assert source_breakdown.main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert "training       product              right    1 /    2  (0.500)  called a tool 0.500" in printed


def test_a_run_without_tools_is_counted_by_wording():
    """Every row of a run that offered no tools has tools false: that is its training shape, not "without tools"."""
    rows = [row("arithmetic", True, tools=False, calls=0), row("arithmetic", False, tools=False, calls=0,
                                                               wording="foreign")]
    assert source_breakdown.breakdown(rows) == {("foreign", "arithmetic"): {"right": 0, "answers": 1, "called": 0},
                                                ("training", "arithmetic"): {"right": 1, "answers": 1, "called": 0}}
