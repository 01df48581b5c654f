"""The default task: integer arithmetic with difficulty levels (operand digits, operations).

Deterministic given a seed. The held-out eval split is generated first from its own seed and every
training question that also appears in it is skipped, so the two never overlap.
"""
from __future__ import annotations

import random
from typing import Iterable

from grpo_core.task import Task

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def make_task(a: int, op: str, b: int, digits: int, split: str) -> Task:
    return Task(
        id=f"arith-{a}{op}{b}",
        kind="math",
        source="arithmetic",
        prompt=f"What is {a} {op} {b}?",
        answer=str(OPS[op](a, b)),
        difficulty=round(digits / 9, 3),
        license="generated",
        provenance=f"grpo_core.data.arithmetic split={split}",
        meta={"digits": digits, "op": op},
    )


def _stream(seed: int, min_digits: int, max_digits: int, ops: Iterable[str], split: str):
    rng = random.Random(seed)
    ops = list(ops)
    while True:
        digits = rng.randint(min_digits, max_digits)
        op = rng.choice(ops)
        yield make_task(_operand(rng, digits), op, _operand(rng, digits), digits, split)


def _question_space(min_digits: int, max_digits: int, ops: Iterable[str]) -> int:
    sizes = [(10 ** d - (0 if d == 1 else 10 ** (d - 1))) ** 2 for d in range(min_digits, max_digits + 1)]
    return sum(sizes) * len(list(ops))


def eval_tasks(n: int, min_digits: int, max_digits: int, ops: Iterable[str], seed: int = 10_007) -> list[Task]:
    """n distinct held-out questions (the same for every run with the same settings)."""
    ops = list(ops)
    space = _question_space(min_digits, max_digits, ops)
    if n > space // 2:
        raise ValueError(f"data.eval_size={n} is too large for this curriculum ({space} distinct questions); "
                         f"use at most {space // 2} or widen data.max_digits/data.operations")
    seen: dict[str, Task] = {}
    for t in _stream(seed, min_digits, max_digits, ops, "eval"):
        seen.setdefault(t.id, t)
        if len(seen) == n:
            return list(seen.values())
    raise AssertionError("unreachable")


def train_tasks(n: int, min_digits: int, max_digits: int, ops: Iterable[str], seed: int,
                exclude: set[str]) -> list[Task]:
    """n distinct training questions none of whose ids are in `exclude` (the eval split)."""
    ops = list(ops)
    available = _question_space(min_digits, max_digits, ops) - len(exclude)
    if n > available:
        raise ValueError(f"data.prompts_per_iteration={n} exceeds the {available} training questions left "
                         f"after the eval split; lower it or widen the curriculum")
    picked: dict[str, Task] = {}
    for t in _stream(seed, min_digits, max_digits, ops, "train"):
        if t.id not in exclude:
            picked.setdefault(t.id, t)
        if len(picked) == n:
            return list(picked.values())
    raise AssertionError("unreachable")
