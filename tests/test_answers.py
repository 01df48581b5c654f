"""Final-answer extraction and equivalence (grpo_core.rewards.answers)."""
import json
from fractions import Fraction

import pytest

from grpo_core.rewards.answers import (NumberReading, extract_answer, math_answers_match, parse_number, read_number,
                               reasoning_gym_dataset, reasoning_gym_score, restates_question)


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
    ("\\boxed{3}", "3", True),
    ("12%", "0.12", False),      # was right (math-verify): now a percent is right only where the gold is one
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
    # A gold answer in plain text (no '$', no backslash) is math too: math-verify, left undelimited, read it
    # as its last number, and '(7, 2)' or '2' matched '(1, 2)'.
    ("(7, 2)", "(1, 2)", False), ("2", "(1, 2)", False), ("5", "(-1, 5]", False), ("5, 2", "1, 2", False),
    ("(0, 5]", "(-1, 5]", False), ("[0, 1]", "(0, 1)", False), ("(1,2)", "(1, 2)", True),
    ("\\{2, 1\\}", "{1, 2}", True), ("3+2x", "2x+3", True), ("no", "on", False),
]


@pytest.mark.parametrize("pred, gold, same", EQUIVALENCE_TABLE)
def test_equivalence_table(pred, gold, same):
    assert math_answers_match(pred, gold) is same


def test_the_table_is_large_and_balanced():
    assert len(EQUIVALENCE_TABLE) >= 40
    assert sum(s for *_, s in EQUIVALENCE_TABLE) >= 20 and sum(not s for *_, s in EQUIVALENCE_TABLE) >= 10


def test_a_slow_check_is_judged_wrong_not_hung():
    import time
    assert math_answers_match("\\sqrt{2}", "\\sqrt{2}")            # the math-verify worker is up
    # sympy works out 10^(10^10) holding the GIL: a thread's join(timeout) did not return (over 40 s).
    t0 = time.perf_counter()
    assert math_answers_match("\\frac{10^{10^{10}}}{3}", "\\sqrt{2}", timeout_s=0.5) is False
    assert time.perf_counter() - t0 < 3
    assert math_answers_match("2\\sqrt{2}/2", "\\sqrt{2}")         # a fresh worker after the kill


@pytest.mark.parametrize("pred", ["1e999999999", "1e-999999999", "1" * 5000, "1/" + "1" * 5000,
                                  "\\frac{1}{" + "1" * 5000 + "}", "1" + ",000" * 2000, "(" * 5000 + "5" + ")" * 5000,
                                  "5" + "%" * 20000, "5" + " " * 100000 + "x"])
def test_a_huge_or_long_number_is_judged_not_raised_or_hung(pred):
    import time
    t0 = time.perf_counter()
    assert math_answers_match(pred, "5") is False
    assert not restates_question(pred + " - 98", "Work out 45 - 98.")
    assert time.perf_counter() - t0 < 1


def test_without_math_verify_falls_back_to_numbers_and_strings(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_math_verify(name, *a, **k):
        if name.startswith("math_verify"):
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    assert math_answers_match("1/2", "0.5") and math_answers_match("Paris", "paris")
    # LaTeX fractions are read by the numeric allow-list now, without math-verify; a set is not a number.
    assert math_answers_match("\\frac12", "1/2")
    assert not math_answers_match("\\{2, 1\\}", "\\{1, 2\\}")


def test_extract_answer_needs_exactly_one_block():
    assert extract_answer("<answer>5</answer><answer>5</answer>") is None
    assert extract_answer("<answer>5") is None
    assert extract_answer("so <answer> 7 </answer>") == "7"


def test_parse_number_is_exact():
    assert parse_number("0.1") + parse_number("0.2") == parse_number("3/10")
    assert parse_number("1/0") is None and parse_number("abc") is None


def test_parse_number_reads_one_plain_number_only():
    assert parse_number("1,000") == parse_number("$1000") == parse_number("1e3") == 1000
    assert parse_number("5.") == 5 and parse_number("\u221253") == -53
    # Once loose (spaces and commas dropped): '45 98' read as 4598, '1,5' as 15.
    assert parse_number("45 98") is None and parse_number("1,5") is None
    assert parse_number("12%") is None            # what a percent is worth depends on the question


def test_read_number_reports_the_form():
    percent = NumberReading(Fraction(12), is_percent=True, is_fraction=False)
    assert read_number("\\boxed{12\\%}") == read_number("12 percent") == percent
    assert read_number("-\\frac{1}{2}") == NumberReading(Fraction(-1, 2), is_percent=False, is_fraction=True)
    assert read_number("x = 0.5 cm") == NumberReading(Fraction(1, 2), is_percent=False, is_fraction=False)
    assert read_number("3 + 4") is None and read_number(None) is None and read_number("") is None


# -- the numeric allow-list: (category, prediction, gold, right?) -------------------------------------------
# Where the gold answer is a number, an answer is right only if it *is* that one value in a form a reader
# accepts; any operation, call, second number or word is wrong, whatever its spelling.
RESTATED, HEDGE, HONEST, WRONG = "restated", "hedge", "honest", "wrong"
ALLOW_LIST_TABLE = [
    # The question restated in many spellings (math-verify evaluated most of these and agreed).
    (RESTATED, "\\tfrac{56}{2}", "28", False), (RESTATED, "{56 \\over 2}", "28", False),
    (RESTATED, "\\frac{56}{2}", "28", False), (RESTATED, "56/2", "28", False),
    (RESTATED, "7 \\times 4", "28", False), (RESTATED, "7 \\cdot 4", "28", False),
    (RESTATED, "7 × 4", "28", False), (RESTATED, "56 ÷ 2", "28", False),
    (RESTATED, "3**2", "9", False), (RESTATED, "3^2", "9", False),
    (RESTATED, "11 \\mod 4", "3", False), (RESTATED, "11 % 4", "3", False),
    (RESTATED, "45 − 98", "-53", False), (RESTATED, "45 minus 98", "-53", False),
    (RESTATED, "45-98=", "-53", False), (RESTATED, "lcm(4, 7)", "28", False),
    (RESTATED, "\\operatorname{lcm}(4, 7)", "28", False), (RESTATED, "\\sqrt{16}", "4", False),
    (RESTATED, "x = 3 + 4", "7", False), (RESTATED, "(2+3)", "5", False),
    # Several numbers, or a range: a hedge, not an answer.
    (HEDGE, "45; -53", "-53", False), (HEDGE, "-53 or -52", "-53", False), (HEDGE, "50-55", "50", False),
    (HEDGE, "50 to 55", "50", False), (HEDGE, "1 -4 2", "-4", False), (HEDGE, "$5$ or $6$", "5", False),
    (HEDGE, "28\\%", "28", False),                  # a percent where the gold answer is not one
    # A second number spelled out is not a unit word, nor is a word that joins two answers.
    (HEDGE, "6 or seven", "6", False), (HEDGE, "5 to six", "5", False), (HEDGE, "\\boxed{6} or seven", "6", False),
    (HEDGE, "\\text{6 or seven}", "6", False), (HEDGE, "0.5 or seventy", "0.5", False), (HEDGE, "5 at most", "5", False),
    # Honest forms of the right value.
    (HONEST, "−53", "-53", True), (HONEST, "–53", "-53", True), (HONEST, "+4", "4", True),
    (HONEST, "1,000", "1000", True), (HONEST, "1 000", "1000", True), (HONEST, "1\u2009000", "1000", True),
    (HONEST, "1\\,000", "1000", True), (HONEST, "$12", "12", True), (HONEST, "€12", "12", True),
    (HONEST, "-$12", "-12", True), (HONEST, "12 dollars", "12", True), (HONEST, "10 apples", "10", True),
    (HONEST, "5 km/h", "5", True), (HONEST, "12\\text{ cm}", "12", True), (HONEST, "30^\\circ", "30", True),
    (HONEST, "\\boxed{-53}", "-53", True), (HONEST, "$-53$", "-53", True), (HONEST, "\\(28\\)", "28", True),
    (HONEST, "$$28$$", "28", True), (HONEST, "x = -53", "-53", True), (HONEST, "\\boxed{x = 7}.", "7", True),
    (HONEST, "(−53)", "-53", True),
    (HONEST, "12%", "12%", True), (HONEST, "12 \\%", "12%", True), (HONEST, "12 percent", "12%", True),
    (HONEST, "12", "12%", True),                    # the percent is the question's unit, like '10' for 10 apples
    (HONEST, "1/2", "0.5", True), (HONEST, "\\frac{1}{2}", "0.5", True), (HONEST, "\\frac12", "1/2", True),
    (HONEST, "\\dfrac{1}{2}", "1/2", True), (HONEST, "0.5", "1/2", True), (HONEST, "-\\frac{1}{2}", "-0.5", True),
    (HONEST, "1e3", "1000", True), (HONEST, "2.5e-3", "0.0025", True), (HONEST, "28.0", "28", True),
    (HONEST, "5 seconds", "5", True), (HONEST, "3 square meters", "3", True), (HONEST, "7 years old", "7", True),
    # Plainly wrong, or not a number at all.
    (WRONG, "-40", "-4", False), (WRONG, "53", "-53", False), (WRONG, "--53", "-53", False),
    (WRONG, "1,5", "15", False), (WRONG, "0.12", "12%", False), (WRONG, "fifty-three", "53", False),
    (WRONG, "The answer is 5", "5", False), (WRONG, "5 thousand", "5", False), (WRONG, "3 squared", "3", False),
    (WRONG, "5 i", "5", False), (WRONG, "", "5", False), (WRONG, "1.5 \\times 10^3", "1500", False),
    (WRONG, "5 sevenths", "5", False), (WRONG, "5 root two", "5", False), (WRONG, "5 lakh", "5", False),
    (WRONG, "5 trillions", "5", False), (WRONG, "5 hundredth", "5", False), (WRONG, "5 inverse", "5", False),
]


@pytest.mark.parametrize("category, pred, gold, right", ALLOW_LIST_TABLE)
def test_allow_list_table(category, pred, gold, right):
    assert math_answers_match(pred, gold) is right, category


def test_the_allow_list_table_covers_each_category():
    counts = {c: sum(row[0] == c for row in ALLOW_LIST_TABLE) for c in (RESTATED, HEDGE, HONEST, WRONG)}
    assert len(ALLOW_LIST_TABLE) >= 40 and min(counts.values()) >= 6, counts
    assert all(not right for category, *_, right in ALLOW_LIST_TABLE if category != HONEST)


# -- restates_question: (answer, question, restated?) ------------------------------------------------------
RESTATEMENT_TABLE = [
    ("45 - 98", "Work out 45 - 98.", True), ("45-98=", "Work out 45 - 98.", True),
    ("\\frac{45}{98}", "Work out 45 - 98.", True), ("{45 \\over 98}", "Work out 45 - 98.", True),
    ("45 minus 98", "Work out 45 - 98.", True), ("45 − 98", "Work out 45 - 98.", True),
    ("(45) - (98)", "Work out 45 - 98.", True), ("98 + 45", "Work out 45 - 98.", True),
    ("7 \\times 4", "What is 7 * 4?", True), ("7 x 4", "What is 7 * 4?", True), ("7×4", "What is 7 * 4?", True),
    ("3**2", "What is 3**2?", True), ("11 \\mod 4", "What is 11 mod 4?", True),
    ("\\operatorname{lcm}(4, 7)", "Find the lcm of 4 and 7.", True), ("0-4-8", "0 - 4 - 8 =", True),
    ("-53", "Work out 45 - 98.", False), ("45", "Work out 45 - 98.", False), ("28", "What is 7 * 4?", False),
    ("45; -53", "Work out 45 - 98.", False), ("45, 98", "Work out 45 - 98.", False),
    ("12 - 3", "Work out 45 - 98.", False), ("145 - 980", "Work out 45 - 98.", False),
    ("", "Work out 45 - 98.", False), (None, "Work out 45 - 98.", False),
]


@pytest.mark.parametrize("answer, question, restated", RESTATEMENT_TABLE)
def test_restates_question(answer, question, restated):
    assert restates_question(answer, question) is restated


# -- reasoning-gym: 1 or 0, never the checker's partial credit ----------------------------------------------
CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}   # as configs/data/math.yaml


def _rg_meta(name: str, config: dict, index: int, size: int = 20) -> dict:
    return {"checker": "reasoning_gym", "rg_dataset": name, "rg_config": config, "rg_seed": 0, "rg_size": size,
            "rg_index": index}


def _index_of_gold(name: str, config: dict, gold: str, size: int = 20) -> int:
    dataset = reasoning_gym_dataset(name, json.dumps(config, sort_keys=True), 0, size)
    for index in range(size):
        if str(dataset[index]["answer"]) == gold:
            return index
    raise AssertionError(f"no entry of {name} has the gold answer {gold}")


@pytest.mark.parametrize("answer, score", [
    ("-4", 1.0), ("\u22124", 1.0), (" \\boxed{-4} ", 1.0), ("x = -4", 1.0),
    ("-40", 0.0), ("1 -4 2", 0.0), ("4", 0.0), ("5 - 9", 0.0), ("", 0.0), (None, 0.0),
])
def test_reasoning_gym_numeric_gold_gets_no_substring_credit(answer, score):
    pytest.importorskip("reasoning_gym")
    meta = _rg_meta("chain_sum", CHAIN_SUM, _index_of_gold("chain_sum", CHAIN_SUM, "-4"))
    assert reasoning_gym_score(meta, answer) == score


def test_reasoning_gym_checker_gave_partial_credit_that_we_do_not():
    pytest.importorskip("reasoning_gym")
    index = _index_of_gold("chain_sum", CHAIN_SUM, "-4")
    dataset = reasoning_gym_dataset("chain_sum", json.dumps(CHAIN_SUM, sort_keys=True), 0, 20)
    for substring_answer in ("-40", "1 -4 2"):                       # why the rule exists
        assert 0.0 < dataset.score_answer(substring_answer, dataset[index]) < 1.0
    assert dataset.score_answer("\u22124", dataset[index]) == 0.0


def test_reasoning_gym_fraction_gold_needs_the_checkers_full_credit():
    pytest.importorskip("reasoning_gym")
    dataset = reasoning_gym_dataset("fraction_simplification", "{}", 0, 5)
    entry = dataset[0]
    reading = read_number(entry["answer"])
    meta = _rg_meta("fraction_simplification", {}, 0, size=5)
    assert reasoning_gym_score(meta, f"{reading.value.numerator}/{reading.value.denominator}") == 1.0
    unsimplified = f"{2 * reading.value.numerator}/{2 * reading.value.denominator}"   # same value, not lowest terms
    assert 0.0 < dataset.score_answer(unsimplified, entry) < 1.0
    assert reasoning_gym_score(meta, unsimplified) == 0.0


def test_the_reward_goes_through_the_same_rule():
    pytest.importorskip("reasoning_gym")
    from grpo_core.rewards.rewards import math_accuracy
    from grpo_core.task import Task
    meta = _rg_meta("chain_sum", CHAIN_SUM, _index_of_gold("chain_sum", CHAIN_SUM, "-4"))
    rg_task = Task(id="rg", kind="math", source="reasoning_gym/chain_sum", prompt="5 - 9 =", answer="-4", meta=meta)
    plain_task = Task(id="a", kind="math", source="arithmetic", prompt="Work out 45 - 98.", answer="-53")
    assert [math_accuracy(f"<answer>{a}</answer>", rg_task) for a in ("-40", "\u22124")] == [0.0, 1.0]
    assert [math_accuracy(f"<answer>{a}</answer>", plain_task) for a in ("45 - 98", "\u221253")] == [0.0, 1.0]
