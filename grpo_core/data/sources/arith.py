"""The default arithmetic curriculum (`grpo_core.data.arithmetic`, owned by the pipeline) as a source."""
from __future__ import annotations

from typing import Any, Iterable

from grpo_core.data import arithmetic
from grpo_core.data.records import Rejection
from grpo_core.task import Task


def load(n: int = 200, min_digits: int = 1, max_digits: int = 2, operations: list[str] | tuple[str, ...] = ("+",),
         seed: int = 0, **_: Any) -> Iterable[Task | Rejection]:
    return arithmetic.train_tasks(n, min_digits, max_digits, list(operations), seed=seed, exclude=set())
