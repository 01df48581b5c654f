"""Final answers: pull the tagged answer out of a completion and decide whether it equals the gold one.

Pure string and number work (plus reasoning-gym's own checkers for its tasks); rewards and curation
both use it, so it sits below both.
"""
from __future__ import annotations

import json
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str | None:
    """The content of the single <answer> block, or None if there is not exactly one."""
    found = ANSWER_RE.findall(completion)
    if len(found) != 1 or completion.count("<answer>") != 1:
        return None
    return found[0].strip()


def parse_number(text: str) -> Fraction | None:
    """'1,000', '$12', '0.5', '1/2', '5.' -> an exact Fraction; None if not a number."""
    s = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_answers_match(predicted: str | None, gold: str) -> bool:
    """Numeric equality when both parse as numbers, else normalised string equality."""
    if predicted is None or not predicted.strip():
        return False
    p, g = parse_number(predicted), parse_number(gold)
    if p is not None and g is not None:
        return p == g
    norm = lambda s: re.sub(r"\s+", " ", s.strip().lower().rstrip("."))
    return norm(predicted) == norm(gold)


@lru_cache(maxsize=64)
def reasoning_gym_dataset(name: str, config_json: str, seed: int, size: int):
    """A reasoning-gym dataset, built once per (name, config, seed, size)."""
    import reasoning_gym  # optional dependency (extra "data")
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def reasoning_gym_score(meta: dict[str, Any], answer: str | None) -> float:
    """The reasoning-gym checker's score in [0, 1] for `answer`, for the task whose `meta` says how to
    rebuild its entry (dataset, config, seed, size, index)."""
    if answer is None:
        return 0.0
    ds = reasoning_gym_dataset(meta["rg_dataset"], json.dumps(meta.get("rg_config") or {}, sort_keys=True),
                               int(meta["rg_seed"]), int(meta["rg_size"]))
    return float(ds.score_answer(answer, ds[int(meta["rg_index"])]) or 0.0)
