"""The `unit_match` reward: is the tagged answer the right quantity, in whatever unit it is written?

A reward function for grpo-pipeline has TRL's signature, `f(prompts, completions, **columns)`, and
returns one float per completion, or None where it cannot score one (that sample is left out of its
group). `columns` holds the tasks' fields as lists (`answer`, `kind`, `source`, `meta`, ...) and the run
context (`completion_lengths`, `max_completion_length`, ...); take the ones you need by name.
"""
from __future__ import annotations

import re

from grpo_units.units import parse_quantity, same_quantity

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BARE_NUMBER_CREDIT = 0.5    # the right number in the gold answer's unit, but no unit written


def score_answer(completion: str, gold: str) -> float | None:
    """1 for the right quantity in any unit of the same dimension ("7000 m" for "7 km"); 0.5 for the right
    number without a unit; 0 otherwise; None when the gold answer itself is not a quantity."""
    expected = parse_quantity(gold)
    if expected is None or expected[1] is None:
        return None
    tagged = ANSWER.findall(completion)
    got = parse_quantity(tagged[-1]) if tagged else None
    if got is None:
        return 0.0
    if got[1] is None:
        return BARE_NUMBER_CREDIT if same_quantity((got[0], expected[1]), expected) else 0.0
    return 1.0 if same_quantity(got, expected) else 0.0


def unit_match(prompts: list[str], completions: list[str], answer: list[str], **kwargs) -> list[float | None]:
    """Unit-aware correctness of the last <answer>...</answer> block against the task's `answer`."""
    return [score_answer(completion, gold) for completion, gold in zip(completions, answer)]
