"""bench/wording_breakdown.py: foreign-wording answers grouped by the kind of wording each question drew, each
compared with the in-wording answers to the same questions."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import wording_breakdown  # noqa: E402

from grpo_core.config import GRPOConfig  # noqa: E402
from grpo_core.task import Task  # noqa: E402


def test_each_foreign_answer_is_counted_under_the_wording_its_question_drew(tmp_path):
    foreign = GRPOConfig(eval=dict(foreign_system_prompts=["Reply with <answer>N</answer>."],
                                   foreign_instructions=["{question} Format: <answer>N</answer>"])).eval.foreign_format
    rows = []
    for i in range(40):
        base = dict(mode="sampled", task_id=f"q{i}", source="arithmetic", kind="math", prompt=f"What is {i} + 1?",
                    answer=str(i + 1), formatted=True)
        rows += [dict(base, correct=True), dict(base, correct=i % 2 == 0, wording="foreign"),
                 dict(base, correct=False, wording="exported")]        # another shape: not in-wording
    rows.append(dict(rows[0], mode="greedy", correct=False, wording="foreign"))      # greedy rows are not counted
    path = tmp_path / "eval_samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kinds = wording_breakdown.breakdown(path, foreign)
    drawn = [foreign.for_task(Task(id=f"q{i}", kind="math", source="arithmetic", prompt=f"What is {i} + 1?",
                                   answer=str(i + 1))) for i in range(40)]
    assert kinds["all"]["answers"] == 40 and kinds["all"]["foreign_strict_pass_at_1"] == 0.5
    assert kinds["all"]["in_wording_pass_at_1"] == 1.0 and kinds["all"]["ratio"] == 0.5
    bare = [i for i, d in enumerate(drawn) if d.wording == "bare"]
    assert 0 < len(bare) < 40 and kinds["bare, instruction"]["answers"] == len(bare)
    assert kinds["bare, instruction"]["foreign_strict_pass_at_1"] == sum(i % 2 == 0 for i in bare) / len(bare)
    assert sum(k["answers"] for name, k in kinds.items() if name != "all") == 40
