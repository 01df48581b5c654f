"""The default task: integer arithmetic with difficulty levels (operand digits, operations).

Deterministic given a seed. The held-out eval split is generated first from its own seed, and every
training question that asks the same thing (`canonical_question`: '3 + 5' is '5 + 3') is skipped, so
the two never overlap in content, not only in id. A question can be put in other words (`TEMPLATES`);
`canonical_question` drops the wording, so 'Compute 5 + 3.' still asks what 'What is 3 + 5?' asks.
"""
from __future__ import annotations

import random
from typing import Iterable

from grpo_core.data.curation import canonical_question
from grpo_core.task import Task

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
DEFAULT_TEMPLATE = "What is {a} {op} {b}?"
# Wordings for `sources.arith` (training and evaluation can use different ones). Each must consist of
# words `curation.TEMPLATE_WORDS` knows, so that every wording of a question has one content key.
TEMPLATES = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.")
EVAL_TEMPLATES = ("Work out {a} {op} {b}.", "Find the value of {a} {op} {b}.", "Evaluate {a} {op} {b}.")


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def make_task(a: int, op: str, b: int, digits: int, split: str, template: str = DEFAULT_TEMPLATE) -> Task:
    return Task(
        id=f"arith-{a}{op}{b}",
        kind="math",
        source="arithmetic",
        prompt=template.format(a=a, op=op, b=b),
        answer=str(OPS[op](a, b)),
        difficulty=round(digits / 9, 3),
        license="generated",
        provenance=f"grpo_core.data.arithmetic split={split}",
        meta={"digits": digits, "op": op, "a": a, "b": b},
    )


def _stream(seed: int, min_digits: int, max_digits: int, ops: Iterable[str], split: str):
    rng = random.Random(seed)
    ops = list(ops)
    while True:
        digits = rng.randint(min_digits, max_digits)
        op = rng.choice(ops)
        yield make_task(_operand(rng, digits), op, _operand(rng, digits), digits, split)


def check_template(template: str) -> str:
    """The template, if its words are pure wording (`canonical_question` recognises the question in it)."""
    try:
        probe = template.format(a=7, op="-", b=3)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"arithmetic template {template!r} must use exactly the fields {{a}}, {{op}}, {{b}}") from e
    if canonical_question(probe) != "7 - 3":
        raise ValueError(f"arithmetic template {template!r} has words that are not pure wording, so two wordings "
                         f"of one question would not be recognised as the same; use words from "
                         f"grpo_core.data.curation.TEMPLATE_WORDS")
    return template


def question_space(min_digits: int, max_digits: int, ops: Iterable[str]) -> int:
    """Distinct questions by content: a + b and b + a (likewise *) count once."""
    total = 0
    for d in range(min_digits, max_digits + 1):
        n = 10 ** d - (0 if d == 1 else 10 ** (d - 1))          # operands with d digits
        total += sum(n * (n + 1) // 2 if op in ("+", "*") else n * n for op in ops)
    return total


def _distinct(n: int, seed: int, min_digits: int, max_digits: int, ops: list[str], split: str,
              exclude: Iterable[Task] = ()) -> list[Task]:
    """The first n questions of the seeded stream that are distinct by content and ask nothing `exclude` asks."""
    if n <= 0:
        return []
    held_out = {canonical_question(t.prompt) for t in exclude}
    picked: dict[str, Task] = {}
    for t in _stream(seed, min_digits, max_digits, ops, split):
        key = canonical_question(t.prompt)
        if key not in held_out:
            picked.setdefault(key, t)
        if len(picked) == n:
            return list(picked.values())
    raise AssertionError("unreachable")


def eval_tasks(n: int, min_digits: int, max_digits: int, ops: Iterable[str], seed: int = 10_007) -> list[Task]:
    """n held-out questions, distinct by content (the same for every run with the same settings)."""
    ops = list(ops)
    space = question_space(min_digits, max_digits, ops)
    if n > space // 2:
        raise ValueError(f"data.eval_size={n} is too large for this curriculum ({space} distinct questions); "
                         f"use at most {space // 2} or widen data.max_digits/data.operations")
    return _distinct(n, seed, min_digits, max_digits, ops, "eval")


def gate_tasks(n: int, min_digits: int, max_digits: int, ops: Iterable[str], seed: int,
               exclude: Iterable[Task]) -> list[Task]:
    """The promotion gate's n questions: their own seeded draw, asking nothing a task in `exclude` (the eval
    split) asks, so that no run picks its registered iteration on the questions the gate then judges it on."""
    ops, exclude = list(ops), list(exclude)
    space = question_space(min_digits, max_digits, ops)
    if n + len(exclude) > space * 3 // 4:
        raise ValueError(f"gate.questions={n} with data.eval_size={len(exclude)} leaves too few of this "
                         f"curriculum's {space} distinct questions to train on; lower gate.questions or "
                         f"data.eval_size, or widen data.max_digits/data.operations")
    return _distinct(n, seed, min_digits, max_digits, ops, "gate", exclude)


def train_tasks(n: int, min_digits: int, max_digits: int, ops: Iterable[str], seed: int,
                exclude: Iterable[Task] = ()) -> list[Task]:
    """n training questions, distinct by content, none asking what a task in `exclude` (the eval
    split, the gate set) asks."""
    ops, exclude = list(ops), list(exclude)
    available = question_space(min_digits, max_digits, ops) - len({canonical_question(t.prompt) for t in exclude})
    if n > available:
        raise ValueError(f"data.prompts_per_iteration={n} exceeds the {available} training questions left "
                         f"after the eval split; lower it or widen the curriculum")
    return _distinct(n, seed, min_digits, max_digits, ops, "train", exclude)
