"""Evaluation answers per prompt shape and task source: right answers / answers, and the share that called a tool.

A shape is how the question was put: "training" (the training prompt), "exported" (as to an exported model),
"foreign" (a wording training never used) or "without_tools" (the tool-free prompt). The source is the last part of
the task's source (e.g. `word_problem` of `tool_problems/word_problem`). Sampled answers only, unless --mode says.

    python bench/source_breakdown.py RUN_DIR/iter-0/eval_samples.jsonl RUN_DIR/iter-24/eval_samples.jsonl
    python bench/source_breakdown.py bench/results/answers/tools_mix3_s0_s0_iter24.jsonl.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def shape(row: dict, tools_run: bool = True) -> str:
    """The row's prompt shape; "without_tools" only in a run that offered tools (without any, every row has none)."""
    return "without_tools" if tools_run and row.get("tools") is False else row.get("wording") or "training"


def breakdown(rows, mode: str = "sampled") -> dict[tuple[str, str], dict]:
    """{(shape, source): {"right", "answers", "called"}} over the rows of `mode`, sorted."""
    counts: dict = defaultdict(lambda: {"right": 0, "answers": 0, "called": 0})
    tools_run = any(r.get("tools") for r in rows)
    for r in rows:
        if r["mode"] != mode:
            continue
        c = counts[shape(r, tools_run), r["source"].rsplit("/", 1)[-1]]
        c["right"] += bool(r["correct"])
        c["answers"] += 1
        c["called"] += (r.get("tool_calls") or 0) > 0
    return dict(sorted(counts.items()))


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="+", type=Path, help="eval_samples.jsonl of an evaluated iteration (or .gz)")
    ap.add_argument("--mode", default="sampled", choices=["sampled", "greedy"])
    args = ap.parse_args(argv)
    for path in args.samples:
        print(path)
        for (where, source), c in breakdown(read_rows(path), args.mode).items():
            print(f"  {where:14s} {source:20s} right {c['right']:4d} / {c['answers']:4d}  "
                  f"({c['right'] / c['answers']:.3f})  called a tool {c['called'] / c['answers']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
