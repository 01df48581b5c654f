"""The base model answering in its own way: each held-out question alone as the user turn (no system prompt, no
examples, no format asked), greedy, read three ways, from strict to lenient:
  first  the first number it writes that is not one of the question's own ("6 - 4 equals 2." reads as 2)
  last   the last number it writes ("... so the answer is 9." reads as 9)
  any    right when any number it writes is the gold: an upper bound that credits lists and hedges
The bar a trained, exported model asked in a user's words must clear (issue #48) is the most lenient, `any`:
training that puts the answer in tags but makes the model worse at the sum is no gain to a user.

    python bench/prose_baseline.py RUN_DIR [--max-new-tokens 128] [--limit N] [--json OUT]
    python bench/prose_baseline.py --rescore OUT.json      # the readings again from saved answers, no model

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
from grpo_core.io import atomic_write_text  # noqa: E402
from grpo_core.task import read_tasks  # noqa: E402

NUMBER_RE = re.compile(r"[-\u2212]?\d[\d,]*(?:\.\d+)?")


def prose_answer(completion: str, question: str) -> str | None:
    """The first number of `completion` that the question does not itself hold: where prose states its result
    ('6 - 4 equals 2.' -> '2'); None when there is none."""
    asked = {parse_number(n) for n in NUMBER_RE.findall(question)}
    return next((n for n in NUMBER_RE.findall(completion) if parse_number(n) not in asked), None)


def lenient_right(completion: str, question: str, gold: str) -> bool:
    return math_answers_match(prose_answer(completion, question), gold)


def readings(completion: str, question: str, gold: str) -> dict[str, bool]:
    """Right or not under each reading (module docstring): {"first": .., "last": .., "any": ..}."""
    numbers = NUMBER_RE.findall(completion)
    return {"first": lenient_right(completion, question, gold),
            "last": bool(numbers) and math_answers_match(numbers[-1], gold),
            "any": any(math_answers_match(n, gold) for n in numbers)}


def report(model: str, rows: list[dict], where: str) -> dict:
    """Print the readings of `rows` (each with "completion", "prompt", "answer") and a few answers; -> the JSON record,
    each row with its readings."""
    rows = [{**r, **readings(r["completion"], r["prompt"], str(r["answer"]))} for r in rows]
    score = {k: sum(r[k] for r in rows) / len(rows) for k in ("first", "last", "any")}
    print(f"{model}: greedy pass@1 on {len(rows)} held-out questions asked alone ({where}), read as the first new "
          f"number {score['first']:.3f}, the last number {score['last']:.3f}, any number {score['any']:.3f} "
          f"(the bar)")
    for r in rows[:5]:
        print(f"  {r['prompt']!r} -> {r['completion'][:100]!r}")
    return {"model": model, "questions": len(rows), "lenient_pass_at_1": score["any"], "readings": score,
            "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, nargs="?", help="a run directory (data/eval.jsonl, config.yaml)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--json", type=Path, help="write the record here (with every answer)")
    ap.add_argument("--rescore", type=Path, help="read a saved record's answers again (rewritten in place)")
    args = ap.parse_args()
    if args.rescore:
        saved = json.loads(args.rescore.read_text())
        record = report(saved["model"], saved["rows"], str(args.rescore))
        atomic_write_text(args.rescore, json.dumps(record, indent=1) + "\n")
        return 0
    if args.run is None:
        ap.error("give a RUN_DIR, or --rescore a saved record")
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import make_backend, rollout
    from grpo_core.rollout.sampling import PromptFormat, SamplingParams
    cfg = load_config(args.run / "config.yaml")
    tasks = [t for t in read_tasks(args.run / "data" / "eval.jsonl") if t.kind == "math"][:args.limit]
    policy = load_policy(cfg, None, need_reference=False)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, greedy=True, seed=0)
    samples = rollout(make_backend(cfg, policy, progress=True), policy.tokenizer, tasks, 1, params, PromptFormat(),
                      cfg.max_prompt_length)
    rows = [{"task_id": t.id, "prompt": t.prompt, "answer": t.answer, "completion": s.completion}
            for t, s in zip(tasks, samples)]
    record = report(cfg.model, rows, str(args.run / "data" / "eval.jsonl"))
    if args.json:
        atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
