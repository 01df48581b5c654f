"""Foreign-wording results split by the kind of wording: each held-out math question draws one foreign wording
(a user turn alone with an instruction, or an unseen system prompt without examples, with an instruction or the
plain question); this prints, per kind, the foreign strict sampled pass@1, its format rate, the in-wording
pass@1 on the same questions, and their ratio.

    python bench/wording_breakdown.py --config configs/math.yaml RUN_DIR/iter-144/eval_samples.jsonl ...
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_core.config import load_config  # noqa: E402
from grpo_core.io import read_jsonl  # noqa: E402
from grpo_core.task import Task  # noqa: E402


def breakdown(samples: Path, foreign_format) -> dict[str, dict]:
    rows = [r for r in read_jsonl(samples) if r["mode"] == "sampled" and r["kind"] == "math"]
    in_wording = defaultdict(list)
    for r in rows:
        if r.get("wording") is None:       # the training prompt; "exported" and "foreign" are other shapes
            in_wording[r["task_id"]].append(r["correct"])
    kinds = defaultdict(lambda: {"answers": 0, "correct": 0, "formatted": 0, "in_wording_correct": 0.0})
    for r in rows:
        if r.get("wording") != "foreign" or not in_wording[r["task_id"]]:
            continue
        task = Task(id=r["task_id"], kind="math", source=r["source"], prompt=r["prompt"], answer=r["answer"])
        drawn = foreign_format.for_task(task)
        kind = f"{drawn.wording}, {'instruction' if drawn.instruction else 'plain question'}"
        for key in (kind, "all"):
            k = kinds[key]
            k["answers"] += 1
            k["correct"] += r["correct"]
            k["formatted"] += r["formatted"]
            k["in_wording_correct"] += sum(in_wording[r["task_id"]]) / len(in_wording[r["task_id"]])
    return {name: {"answers": k["answers"], "foreign_strict_pass_at_1": k["correct"] / k["answers"],
                   "foreign_format_rate": k["formatted"] / k["answers"],
                   "in_wording_pass_at_1": k["in_wording_correct"] / k["answers"],
                   "ratio": k["correct"] / k["in_wording_correct"] if k["in_wording_correct"] else None}
            for name, k in sorted(kinds.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/math.yaml", help="the config whose eval.foreign_* the runs used")
    ap.add_argument("samples", nargs="+", type=Path, help="eval_samples.jsonl of an evaluated iteration")
    args = ap.parse_args()
    foreign = load_config(args.config).eval.foreign_format
    if foreign is None:
        ap.error(f"{args.config} sets no eval.foreign_system_prompts / eval.foreign_instructions")
    for path in args.samples:
        print(path)
        for name, k in breakdown(path, foreign).items():
            ratio = f"{k['ratio']:.2f}" if k["ratio"] is not None else "-"
            print(f"  {name:40s} answers {k['answers']:4d}  foreign {k['foreign_strict_pass_at_1']:.3f}  format "
                  f"{k['foreign_format_rate']:.3f}  in-wording {k['in_wording_pass_at_1']:.3f}  ratio {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
