"""Final answers: pull the tagged answer out of a completion and decide whether it equals the gold one.

Pure string and number work (plus reasoning-gym's own checkers for its tasks); rewards and curation
both use it, so it sits below both.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

VERIFY_TIMEOUT_S = 5.0     # math-verify wall-clock limit per comparison
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# An operation still to be done on numbers: '5 - 6', '7 \\times 4', '3^2', '(2+3)', '\\frac{56}{2}', '\\sqrt{16}'.
OPERATION_RE = re.compile(r"[\d)}]\s*(?:[-+*/^×÷·−]|\\times|\\cdot|\\div|\\pm|x(?=\s*[\d(]))\s*[\d(\\{]"
                          r"|\\d?frac|\\sqrt|√")
FRACTION_RE = re.compile(r"-?\d+\s*/\s*\d+|-?\\d?frac(?:\{\d+\}|\d)(?:\{\d+\}|\d)")


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


def math_answers_match(predicted: str | None, gold: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """Is `predicted` the same answer as `gold`, as a reader would judge it?

    0. Where `gold` is a number, an answer that still shows an operation on numbers is wrong
       (`restates_operation`): '5 - 6' restates the question "What is 5 - 6?", it does not answer it.
    1. Plain numbers on both sides ('1,000', '$12', '0.5', '1/2', '1e3') compare exactly.
    2. Otherwise math-verify decides (LaTeX such as '\\frac12', equations such as 'x=2' against '2',
       percentages, sets), with a wall-clock limit of `timeout_s`: a prediction that takes longer
       is judged wrong.
    Before 2, answers equal as strings (ignoring case, white space and a final period) match; when
    math-verify is not installed or cannot parse the gold answer (e.g. a word), that is the test.
    """
    if predicted is None or not predicted.strip():
        return False
    p, g = parse_number(predicted), parse_number(gold)
    if g is not None and restates_operation(predicted, g):
        return False
    if p is not None and g is not None:
        return p == g
    if _normalised(predicted) == _normalised(gold):
        return True
    verdict = _math_verify(predicted, gold, timeout_s)
    return bool(verdict)


def restates_operation(predicted: str, gold: Fraction) -> bool:
    """Whether an answer to a question whose answer is the number `gold` still shows an operation on numbers
    ('5 - 6' for -1, '7 \\times 4', '56/2', '\\sqrt{16}'): the question restated, not answered. math-verify would
    evaluate it and call it right, which a model learns to exploit. A fraction is a value where `gold` is one."""
    text = predicted.strip().strip("$").replace(",", "")
    if gold.denominator != 1 and FRACTION_RE.fullmatch(text):
        return False
    return bool(OPERATION_RE.search(text))


def _normalised(text: str) -> str:
    return re.sub(r"\s+", "", text.lower()).rstrip(".")


def _latex_math(text: str) -> str:
    """math-verify reads LaTeX only between math delimiters: add them to bare LaTeX like '\\frac12'."""
    text = text.strip()
    return f"${text}$" if "\\" in text and "$" not in text else text


@lru_cache(maxsize=4096)
def _parsed_gold(gold: str):
    from math_verify import parse
    return parse(_latex_math(gold), parsing_timeout=None)


def _math_verify(predicted: str, gold: str, timeout_s: float) -> bool | None:
    """math-verify's verdict; False when it runs past `timeout_s`; None when it cannot judge (not
    installed, the gold answer does not parse, or it raised). Its own timeouts use signals, which work
    only on the main thread, so the check runs in a daemon thread that is abandoned if it overruns."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)   # it warns that we time it out ourselves
    outcome: dict[str, bool | None] = {}

    def check() -> None:
        try:
            gold_parsed = _parsed_gold(gold)
            outcome["match"] = bool(verify(gold_parsed, parse(_latex_math(predicted), parsing_timeout=None),
                                           timeout_seconds=None)) if gold_parsed else None
        except Exception:  # noqa: BLE001 - math-verify failed on this input: fall back
            outcome["match"] = None

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return False if worker.is_alive() else outcome.get("match")


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
