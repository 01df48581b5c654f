"""Final-answer extraction and equivalence (grpo_core.answers)."""
import pytest

from grpo_core.answers import extract_answer, math_answers_match, parse_number


@pytest.mark.parametrize("pred, gold, ok", [
    ("5", "5", True), (" 5. ", "5", True), ("5.0", "5", True), ("1,000", "1000", True), ("$12", "12", True),
    ("-3", "-3", True), ("1/2", "0.5", True), ("6", "5", False), ("", "5", False), (None, "5", False),
    ("five", "5", False), ("Paris", "paris", True),
])
def test_math_answers_match(pred, gold, ok):
    assert math_answers_match(pred, gold) is ok


# (prediction, gold, same answer?) as a user judges it; math-verify handles the LaTeX, equations,
# percentages and sets, exact fractions the plain numbers.
EQUIVALENCE_TABLE = [
    ("0.5", "1/2", True), ("1/2", "0.5", True), ("\\frac12", "1/2", True), ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "0.75", True), ("$\\frac{1}{2}$", "1/2", True), ("2/4", "1/2", True), ("0.50", "1/2", True),
    ("x=2", "2", True), ("x = -2", "-2", True), ("2", "x=2", True), ("y = 7", "7", True),
    ("1,000", "1000", True), ("1000", "1,000", True), ("$12", "12", True), ("5.", "5", True), ("3.0", "3", True),
    ("1e3", "1000", True), ("-3", "-3", True), ("+4", "4", True), ("007", "7", True),
    ("\\boxed{3}", "3", True), ("12%", "0.12", True),
    ("\\pi", "\\pi", True), ("(1,2)", "(1, 2)", True), ("Paris", "paris", True), ("10 apples", "10", True),
    ("\\frac{2}{3}", "2/3", True), ("0.3333", "1/3", False),
    ("6", "5", False), ("-5", "5", False), ("1/3", "0.33", False), ("\\frac12", "1/3", False),
    ("x=3", "2", False), ("", "5", False), ("   ", "5", False), (None, "5", False), ("five", "5", False),
    ("London", "paris", False), ("12", "0.12", False), ("2^3", "9", False), ("\\sqrt{2}", "1.41", False),
    # The question restated, not answered: an operation still to do is wrong where the gold answer is a number
    # (math-verify evaluates it and agrees; Gemma 3 270M learned to answer "What is 5 - 6?" with
    # <answer>5 - 6</answer>).
    ("5 - 6", "-1", False), ("5 − 6", "-1", False), ("45 + 7", "52", False), ("7 \\times 4", "28", False),
    ("7 x 4", "28", False), ("56/2", "28", False), ("\\frac{56}{2}", "28", False), ("(2+3)", "5", False),
    ("2^3", "8", False), ("\\sqrt{4}", "2", False), ("x = 3 + 4", "7", False),
]


@pytest.mark.parametrize("pred, gold, same", EQUIVALENCE_TABLE)
def test_equivalence_table(pred, gold, same):
    assert math_answers_match(pred, gold) is same


def test_the_table_is_large_and_balanced():
    assert len(EQUIVALENCE_TABLE) >= 40
    assert sum(s for *_, s in EQUIVALENCE_TABLE) >= 20 and sum(not s for *_, s in EQUIVALENCE_TABLE) >= 10


def test_a_slow_check_is_judged_wrong_not_hung(monkeypatch):
    import time
    import grpo_core.answers as answers
    monkeypatch.setattr(answers, "_parsed_gold", lambda gold: time.sleep(5) or ["x"])
    t0 = time.perf_counter()
    assert answers.math_answers_match("\\frac{1}{2}", "\\frac{2}{4}x", timeout_s=0.2) is False
    assert time.perf_counter() - t0 < 2


def test_without_math_verify_falls_back_to_numbers_and_strings(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_math_verify(name, *a, **k):
        if name.startswith("math_verify"):
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    assert math_answers_match("1/2", "0.5") and math_answers_match("Paris", "paris")
    assert not math_answers_match("\\frac12", "1/2")


def test_extract_answer_needs_exactly_one_block():
    assert extract_answer("<answer>5</answer><answer>5</answer>") is None
    assert extract_answer("<answer>5") is None
    assert extract_answer("so <answer> 7 </answer>") == "7"


def test_parse_number_is_exact():
    assert parse_number("0.1") + parse_number("0.2") == parse_number("3/10")
    assert parse_number("1/0") is None and parse_number("abc") is None
