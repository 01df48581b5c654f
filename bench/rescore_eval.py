"""Score saved evaluation answers again with today's math answer check: for a run evaluated before a change to
`grpo_core.rewards.answers`, e.g. the check that an answer restating the question ('5 - 6' for "What is 5 - 6?", which
math-verify evaluated and counted right) is wrong. Prints strict pass@1 (right and in the tags the model wrote)
per mode and wording, then and now. Every math row is judged again by `math_answers_match`. Reasoning-gym
rows carry their gold answer but not the meta that rebuilds their dataset entry: a numeric gold answer is
judged as `reasoning_gym_score` judges it today (by `math_answers_match` too); any other keeps its recorded
verdict, which counted only the dataset checker's full credit, today's rule as well.

    python bench/rescore_eval.py RUN_DIR/iter-0/eval_samples.jsonl RUN_DIR/iter-144/eval_samples.jsonl [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_core.rewards.answers import extract_answer, math_answers_match, reasoning_gym_gold_is_number  # noqa: E402
from grpo_core.io import read_jsonl  # noqa: E402


def judged_right_now(row: dict) -> bool:
    """Today's verdict on one math row (see the module docstring for reasoning-gym rows)."""
    gold = str(row["answer"])
    if row["source"].startswith("reasoning_gym/") and not reasoning_gym_gold_is_number(gold):
        return bool(row["correct"])
    return math_answers_match(extract_answer(row["completion"]), gold)


def rescore(samples: Path) -> dict[str, dict]:
    """{"<mode>/<in|foreign>": {"answers", "strict_then", "strict_now"}} for one eval_samples.jsonl."""
    out = defaultdict(lambda: {"answers": 0, "strict_then": 0, "strict_now": 0})
    for r in read_jsonl(samples):
        if r["kind"] != "math":
            continue
        right_now = judged_right_now(r)
        cell = out[f"{r['mode']}/{'foreign' if r.get('wording') == 'foreign' else 'in'}"]
        cell["answers"] += 1
        cell["strict_then"] += bool(r["correct"] and r["formatted"])
        cell["strict_now"] += bool(right_now and r["formatted"])
    return {k: {**v, "strict_then": round(v["strict_then"] / v["answers"], 3),
                "strict_now": round(v["strict_now"] / v["answers"], 3)} for k, v in sorted(out.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", nargs="+", type=Path, help="eval_samples.jsonl files (iter-<k>/ of a run)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    results = {str(p): rescore(p) for p in args.samples}
    for path, cells in results.items():
        print(path)
        for key, c in cells.items():
            print(f"  {key:<18} {c['answers']:>4} answers  "
                  f"strict pass@1 {c['strict_then']:.3f} -> now {c['strict_now']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
