"""The base model answering in its own way: each held-out question alone as the user turn (no system prompt, no
examples, no format asked), greedy, judged leniently: right when the first number it writes that is not one of
the question's own numbers is the gold answer ("3 + 8 = 11. In mathematics, 3 + 8 is ..." reads as 11).
The bar a trained, exported model asked in a user's words must clear (issue #48): training that puts the answer
in tags but makes the model worse at the sum is no gain to a user.

    python bench/prose_baseline.py RUN_DIR [--max-new-tokens 128] [--limit N] [--json OUT]

RUN_DIR is a run whose data/eval.jsonl holds the held-out questions and whose config.yaml names the model.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_core.rewards.answers import math_answers_match, parse_number  # noqa: E402
from grpo_core.config import load_config  # noqa: E402
from grpo_core.task import read_tasks  # noqa: E402

NUMBER_RE = re.compile(r"[-\u2212]?\d[\d,]*(?:\.\d+)?")


def prose_answer(completion: str, question: str) -> str | None:
    """The first number of `completion` that the question does not itself hold: where prose states its result
    ('6 - 4 equals 2.' -> '2'); None when there is none."""
    asked = {parse_number(n) for n in NUMBER_RE.findall(question)}
    return next((n for n in NUMBER_RE.findall(completion) if parse_number(n) not in asked), None)


def lenient_right(completion: str, question: str, gold: str) -> bool:
    return math_answers_match(prose_answer(completion, question), gold)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import make_backend, rollout
    from grpo_core.rollout.sampling import PromptFormat, SamplingParams
    cfg = load_config(args.run / "config.yaml")
    tasks = [t for t in read_tasks(args.run / "data" / "eval.jsonl") if t.kind == "math"][:args.limit]
    policy = load_policy(cfg, None, need_reference=False)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, greedy=True, seed=0)
    samples = rollout(make_backend(cfg, policy, progress=True), policy.tokenizer, tasks, 1, params, PromptFormat(),
                      cfg.max_prompt_length)
    rows = [{"task_id": t.id, "prompt": t.prompt, "answer": t.answer, "completion": s.completion,
             "lenient_right": lenient_right(s.completion, t.prompt, str(t.answer))} for t, s in zip(tasks, samples)]
    score = sum(r["lenient_right"] for r in rows) / len(rows)
    print(f"{cfg.model}: greedy lenient pass@1 {score:.3f} on {len(rows)} held-out questions asked alone "
          f"({args.run / 'data' / 'eval.jsonl'})")
    for r in rows[:5]:
        print(f"  {r['prompt']!r} -> {r['completion'][:100]!r} ({'right' if r['lenient_right'] else 'wrong'})")
    if args.json:
        args.json.write_text(json.dumps({"model": cfg.model, "questions": len(rows), "lenient_pass_at_1": score,
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
