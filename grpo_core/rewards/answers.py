"""Final answers: pull the tagged answer out of a completion and decide whether it equals the gold one.

Where the gold answer is a number the check is an allow-list: the answer is right only if it *is* one value
equal to the gold, written in a form a reader accepts (`read_number`); an operation, a function call, a
second number or a word makes it wrong, whatever its spelling. Other gold answers (sets, intervals,
expressions, equations) are left to math-verify. Reasoning-gym tasks get the same rule for numeric gold
answers and their dataset's own checker, full credit only, for the rest. `restates_question` is a separate
detector of an answer that repeats the question's numbers and operator, for monitors.

Pure string and number work (plus reasoning-gym's checkers); rewards, curation and evaluation all use it,
so it sits below them.
"""
from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

VERIFY_TIMEOUT_S = 5.0     # math-verify wall-clock limit per comparison
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# -- characters that mean the same thing --
# Unicode minus and the dashes a writer uses for it; inside an answer they can only stand for a minus.
MINUS_LOOKALIKES = str.maketrans({c: "-" for c in "\u2212\u2010\u2011\u2012\u2013\u2014\ufe63\uff0d"})
# No-break, thin, narrow, figure and hair spaces, and LaTeX's thin and medium spaces.
ODD_SPACE_RE = re.compile(r"[\u00a0\u2007\u2008\u2009\u200a\u202f]|\\[,;:]|\\ ")
LATEX_TEXT_RE = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{([^{}]*)\}")

# -- what may wrap one number (each removes itself and returns the rest) --
WRAPPER_RES = (
    re.compile(r"\\boxed\s*\{(.*)\}", re.DOTALL),
    re.compile(r"\$(.*)\$", re.DOTALL),                    # $...$ (and $$...$$, one layer at a time)
    re.compile(r"\\\((.*)\\\)", re.DOTALL),
    re.compile(r"\\\[(.*)\\\]", re.DOTALL),
    re.compile(r"\{(.*)\}", re.DOTALL),
    re.compile(r"\((.*)\)", re.DOTALL),                    # '(-53)'
    re.compile(r"[A-Za-z][A-Za-z0-9_]*\s*=\s*(.+)", re.DOTALL),   # x = 5: one variable name, then the value
    re.compile(r"(.*?)\.+", re.DOTALL),                     # the sentence's final period
)
PERCENT_RE = re.compile(r"(.*?)\s*(?:\\?%|percent|per\s+cent)", re.DOTALL)
DEGREES_RE = re.compile(r"(.*?)\s*(?:°\s*[CF]?|\^\s*\\circ|\^\s*\{\s*\\circ\s*\})", re.DOTALL)
# One or two unit words after the number ('10 apples', '12 cm', '5 km/h', '3 square meters').
UNIT_RE = re.compile(r"(.*?[\d}.])\s+([A-Za-z]{2,}(?:/[A-Za-z]+)?(?:\s+[A-Za-z]{2,}(?:/[A-Za-z]+)?)?)", re.DOTALL)
# Words after a number that change its value or continue a calculation: never a unit.
NOT_UNITS = frozenset({
    "percent", "percentage", "hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion",
    "billions", "trillion", "dozen", "dozens", "half", "halves", "thirds", "quarters", "tenths", "hundredths",
    "thousandths", "squared", "cubed", "factorial", "plus", "minus", "times", "over", "mod", "modulo", "divided",
    "pi",
    # Words that join a second answer or bound the first ('6 or seven', '5 to six', '5 at most'), or change
    # the value ('5 root two', '5 inverse').
    "or", "and", "to", "nor", "not", "than", "versus", "vs", "through", "least", "most", "root", "roots", "sqrt",
    "inverse", "reciprocal", "negative", "recurring", "repeating",
})
# A number word is never a unit: '6 or seven' is two answers, '5 sevenths' and '5 lakh' other values.
NUMBER_WORD_RE = re.compile(
    r"(?:zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen"
    r"|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand"
    r"|[a-z]*illion|lakh|crore|dozen|half|halve|third|quarter|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
    r"|eleventh|twelfth|[a-z]+teenth|[a-z]+tieth)(?:s|th|ths)?")
# A currency sign before the number, or after its sign; not the '$' that opens '$...$'.
CURRENCY_RE = re.compile(r"([+-]?)\s*(?:\\\$|\$|€|£|¥|₹)\s*([^$]*)", re.DOTALL)

# -- the number itself --
SIGN_RE = re.compile(r"([+-]?)\s*(.*)", re.DOTALL)
# Digits with an optional decimal part and exponent; thousands grouped by ',' or ' ' in threes ('1,5' is not 15).
DECIMAL_RE = re.compile(r"(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?: \d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?"
                        r"|\.\d+(?:[eE][+-]?\d+)?")
SLASH_FRACTION_RE = re.compile(r"(\d+)\s*/\s*(\d+)")
LATEX_FRACTION_RE = re.compile(r"\\[dt]?frac\s*(?:\{\s*([+-]?\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))")
# Longer text is not one number as a reader writes it; reading it costs time quadratic in its length (the
# wrappers come off one layer at a time) and int() refuses more than 4300 digits. An exponent beyond
# MAX_EXPONENT would build a number of that many digits ('1e999999999' hangs).
MAX_NUMBER_TEXT = 500
MAX_EXPONENT = 1000


def extract_answer(completion: str) -> str | None:
    """The content of the single <answer> block, or None if there is not exactly one."""
    if completion.count("<answer>") != 1:      # first: findall over many open tags is quadratic
        return None
    found = ANSWER_RE.findall(completion)
    if len(found) != 1:
        return None
    return found[0].strip()


# -- reading one number ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NumberReading:
    """One number as written: its exact value and the two facts about its form that decide a match."""
    value: Fraction
    is_percent: bool     # written with '%', '\\%' or 'percent'
    is_fraction: bool    # written as 'a/b' or '\\frac{a}{b}'


def read_number(text: str | None) -> NumberReading | None:
    """`text` read as a single number, or None if it is anything else.

    Wrappers come off first, in any order and nesting: math delimiters ('$...$', '\\(...\\)', '\\[...\\]'),
    '\\boxed{...}', braces, parentheses, 'x = ' (one variable name), a final period, a percent sign or word,
    a degree sign, one or two unit words ('10 apples', '5 km/h'), a currency sign ('$12', '-€3'). What is
    left must be one signed number token: digits with thousands in threes ('1,000', '1 000', '1\\,000'), a
    decimal ('0.5', '5.'), an exponent ('1e3'), or a fraction of two integers ('1/2', '\\frac{1}{2}',
    '\\dfrac12'). Anything else -- an operation, a function call, two numbers, a number word -- is not one.
    """
    if text is None or len(text) > MAX_NUMBER_TEXT:
        return None
    core = _plain_characters(text)
    is_percent = False
    previous = None
    while core != previous:
        previous = core
        core = _without_wrapper(core)
        core, percent_sign = _without_percent(core)
        is_percent = is_percent or percent_sign
        core = _without_unit(core)
        core = _without_currency(core)
    return _single_number(core, is_percent)


def parse_number(text: str) -> Fraction | None:
    """The exact value of `text` when it is one plain number ('1,000', '$12', '0.5', '1/2', '5.', '1e3');
    None for anything else, percentages included (what '12%' is worth depends on the question)."""
    reading = read_number(text)
    if reading is None or reading.is_percent:
        return None
    return reading.value


def _plain_characters(text: str) -> str:
    """Dashes as '-', odd spaces as ' ', LaTeX '{,}' as ',', '\\text{...}' as its words, trimmed."""
    text = text.translate(MINUS_LOOKALIKES)
    text = ODD_SPACE_RE.sub(" ", text).replace("{,}", ",")
    text = LATEX_TEXT_RE.sub(r" \1 ", text)
    return text.strip()


def _without_wrapper(text: str) -> str:
    for wrapper in WRAPPER_RES:
        found = wrapper.fullmatch(text)
        if found:
            return found.group(1).strip()
    return text


def _without_percent(text: str) -> tuple[str, bool]:
    found = PERCENT_RE.fullmatch(text)
    if found:
        return found.group(1).strip(), True
    return text, False


def _without_unit(text: str) -> str:
    """The number without a degree sign or trailing unit words; words that change the value stay."""
    degrees = DEGREES_RE.fullmatch(text)
    if degrees:
        return degrees.group(1).strip()
    found = UNIT_RE.fullmatch(text)
    if found is None:
        return text
    words = re.split(r"[\s/]+", found.group(2).lower())
    if any(word in NOT_UNITS or NUMBER_WORD_RE.fullmatch(word) for word in words):
        return text
    return found.group(1).strip()


def _without_currency(text: str) -> str:
    found = CURRENCY_RE.fullmatch(text)
    if found:
        return found.group(1) + found.group(2).strip()
    return text


def _single_number(text: str, is_percent: bool) -> NumberReading | None:
    """One signed number token, all of `text`: a decimal or a fraction of two integers."""
    sign, body = SIGN_RE.fullmatch(text).groups()
    negative = sign == "-"
    if DECIMAL_RE.fullmatch(body):
        if abs(int(body.lower().partition("e")[2] or 0)) > MAX_EXPONENT:
            return None
        value = Fraction(body.replace(",", "").replace(" ", ""))
        return NumberReading(-value if negative else value, is_percent, is_fraction=False)
    fraction = _fraction_value(body)
    if fraction is None or (sign and re.match(r"\\[dt]?frac\s*\{\s*[+-]", body)):   # one sign, not two
        return None
    return NumberReading(-fraction if negative else fraction, is_percent, is_fraction=True)


def _fraction_value(text: str) -> Fraction | None:
    """'3/4', '\\frac{3}{4}', '\\frac{-3}{4}', '\\tfrac34' -> the value; None for anything else or a zero
    denominator."""
    slash = SLASH_FRACTION_RE.fullmatch(text)
    latex = LATEX_FRACTION_RE.fullmatch(text)
    if slash:
        numerator, denominator = slash.groups()
    elif latex:
        numerator = latex.group(1) or latex.group(2)
        denominator = latex.group(3) or latex.group(4)
    else:
        return None
    if int(denominator) == 0:
        return None
    return Fraction(int(numerator), int(denominator))


# -- the answer check -----------------------------------------------------------------------------------


def math_answers_match(predicted: str | None, gold: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
    """Is `predicted` the same answer as `gold`, as a reader would judge it?

    1. Where `gold` reads as a number (`read_number`), `predicted` must read as one number too, equal to it
       (`numbers_match`). Nothing else is consulted: '5 - 6' restates "What is 5 - 6?", it does not answer it.
    2. Otherwise answers equal as strings (ignoring case, white space and a final period) match, and then
       math-verify decides (sets, intervals, expressions, equations) with a wall-clock limit of `timeout_s`:
       a prediction that takes longer is judged wrong. Without math-verify, or where it cannot parse the
       gold answer (e.g. a word), the string test is all there is.
    """
    if predicted is None or not predicted.strip():
        return False
    gold_number = read_number(gold)
    if gold_number is not None:
        return numbers_match(read_number(predicted), gold_number)
    if _normalised(predicted) == _normalised(gold):
        return True
    return bool(_math_verify(predicted, gold, timeout_s))


def numbers_match(answer: NumberReading | None, gold: NumberReading) -> bool:
    """The same value, and in a form the gold answer allows: a percent only where the gold answer is one
    (where it is, a bare number counts in percent: '12' for '12%'), a fraction only where the gold value is
    not an integer ('\\frac{56}{2}' for 28 is a division still to do)."""
    if answer is None:
        return False
    if answer.is_percent and not gold.is_percent:
        return False
    if answer.is_fraction and gold.value.denominator == 1:
        return False
    return answer.value == gold.value


def _normalised(text: str) -> str:
    return re.sub(r"\s+", "", text.lower()).rstrip(".")


# -- a restated question (for monitors) -----------------------------------------------------------------

NUMBER_TOKEN_RE = re.compile(r"\d+(?:\.\d+)?")
# Every spelling of an operator, rewritten to one symbol before the answer is searched.
# Case-blind: 'Minus', 'TIMES'.
OPERATOR_SPELLINGS = tuple((re.compile(pattern, re.IGNORECASE), symbol) for pattern, symbol in (
    (r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)"),
    (r"\\[dt]?frac\s*(\d)(\d)", r"\1/\2"),
    (r"\\operatorname\s*\{\s*([A-Za-z]+)\s*\}", r"\1"),
    (r"\\times|\\cdot|\\ast|[×·⋅∗]|\bmultiplied\s+by\b|\btimes\b", "*"),
    (r"\\div|÷|\\over\b|\bdivided\s+by\b|\bover\b", "/"),
    (r"\\[bp]?mod\b|\bmod(?:ulo)?\b", "%"),
    (r"\bplus\b", "+"),
    (r"\bminus\b", "-"),
    (r"\bto\s+the\s+power\s+of\b", "^"),
    (r"\\([A-Za-z]+)", r"\1"),       # any other LaTeX command reads as its name (\gcd, \max)
))
# Operator signs a writer may use for the ASCII ones: fullwidth forms, division and fraction slashes, crosses.
OPERATOR_LOOKALIKES = str.maketrans({"\uff0b": "+", "\uff0a": "*", "\u2715": "*", "\u2a2f": "*",
                                     "\u2215": "/", "\u2044": "/", "\uff0f": "/"})
# LaTeX spaces _plain_characters leaves: negative thin space and quads.
LATEX_SPACE_RE = re.compile(r"\\(?:!|q?quad\b)")
OPERAND = r"(?<![\d.])(\d+(?:\.\d+)?)"
# Two numbers joined by an operator, or the first two arguments of a function call ('lcm(4, 7)').
JOINED_NUMBERS_RE = re.compile(rf"(?=(?:{OPERAND}\s*(?:\*\*|[-+*/^%xX])\s*{OPERAND}))")
FUNCTION_CALL_RE = re.compile(rf"[A-Za-z]+\s*\(\s*{OPERAND}\s*[,;]\s*{OPERAND}")


def restates_question(answer: str | None, question: str) -> bool:
    """Whether `answer` holds two of `question`'s numbers joined by an operator, in any spelling ('45 - 98',
    '45-98=', '45 minus 98', '\\frac{45}{98}', '7 \\times 4', '3**2', '11 mod 4', 'lcm(4, 7)'): the
    question restated rather than answered. Generic, not per task; signs are ignored ('-53' for
    "45 - 98" is not a restatement, nor is '45' alone)."""
    if not answer:
        return False
    question_numbers = {_token_value(n) for n in NUMBER_TOKEN_RE.findall(question)} - {None}
    text = _operators_as_symbols(answer)
    pairs = FUNCTION_CALL_RE.findall(text)
    pairs += JOINED_NUMBERS_RE.findall(re.sub(r"[(){}\[\]]", "", text))
    return any(_token_value(left) in question_numbers and _token_value(right) in question_numbers
               for left, right in pairs)


def _token_value(token: str) -> Fraction | None:
    """A number token's value; None past MAX_NUMBER_TEXT characters (int() refuses over 4300 digits)."""
    return Fraction(token) if len(token) <= MAX_NUMBER_TEXT else None


def _operators_as_symbols(answer: str) -> str:
    text = LATEX_SPACE_RE.sub(" ", _plain_characters(answer)).translate(OPERATOR_LOOKALIKES)
    for spelling, symbol in OPERATOR_SPELLINGS:
        text = spelling.sub(symbol, text)
    return text


# -- math-verify, for gold answers that are not numbers -------------------------------------------------


def _latex_math(text: str) -> str:
    """math-verify reads LaTeX only between math delimiters: add them to bare math like '\\frac12' or
    '(1, 2)' (as `data.validate` does). Undelimited, it falls back to the last number in the text: '(1, 2)'
    would read as 2, and '(7, 2)' or '2' would match it."""
    text = text.strip()
    return f"${text}$" if "$" not in text and re.search(r"[\d\\]", text) else text


@lru_cache(maxsize=4096)
def _parsed_gold(gold: str):
    from math_verify import parse
    return parse(_latex_math(gold), parsing_timeout=None)


def _verify_in_worker(predicted: str, gold: str) -> bool | None:
    """math-verify's verdict, computed where it may be killed (`_math_verify`)."""
    from math_verify import parse, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)   # it warns that we time it out ourselves
    try:
        gold_parsed = _parsed_gold(gold)
        return bool(verify(gold_parsed, parse(_latex_math(predicted), parsing_timeout=None),
                           timeout_seconds=None)) if gold_parsed else None
    except Exception:  # noqa: BLE001 - math-verify failed on this input: fall back
        return None


def _serve_math_verify() -> None:
    """The worker's loop: one JSON [predicted, gold] a line on stdin, one JSON verdict a line back."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr                      # nothing math-verify or sympy prints can reach the replies
    for line in sys.stdin:
        out.write(json.dumps(_verify_in_worker(*json.loads(line))) + "\n")
        out.flush()


class _VerifyWorker:
    """A Python process that runs math-verify, killed when a check overruns."""

    def __init__(self) -> None:
        self.owner = os.getpid()                 # a forked child starts its own: the pipes are not shareable
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from grpo_core.rewards.answers import _serve_math_verify; _serve_math_verify()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.ask("1", "1", None)                 # start-up and imports: not timed

    def ask(self, predicted: str, gold: str, timeout_s: float | None) -> bool | None:
        self.process.stdin.write(json.dumps([predicted, gold]) + "\n")
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], timeout_s)[0]:
            raise TimeoutError
        line = self.process.stdout.readline()
        if not line:
            raise EOFError("the math-verify worker exited")
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


_VERIFY_WORKER: _VerifyWorker | None = None
_VERIFY_LOCK = threading.Lock()


def _math_verify(predicted: str, gold: str, timeout_s: float) -> bool | None:
    """math-verify's verdict; False when it runs past `timeout_s`; None when it cannot judge (not
    installed, the gold answer does not parse, or it raised). It runs in a worker process, killed if it
    overruns: a thread cannot be stopped, and sympy's big-integer arithmetic ('10**10**10') holds the GIL,
    so not even a thread's join(timeout) returns until it is done."""
    global _VERIFY_WORKER
    try:
        import math_verify  # noqa: F401 - only to know it is installed
    except ImportError:
        return None
    with _VERIFY_LOCK:
        try:
            if _VERIFY_WORKER is None or _VERIFY_WORKER.owner != os.getpid():
                _VERIFY_WORKER = _VerifyWorker()
            return _VERIFY_WORKER.ask(predicted, gold, timeout_s)
        except TimeoutError:
            verdict = False
        except (OSError, EOFError, ValueError):
            verdict = None
        if _VERIFY_WORKER is not None and _VERIFY_WORKER.owner == os.getpid():
            _VERIFY_WORKER.kill()
        _VERIFY_WORKER = None
        return verdict


# -- reasoning-gym --------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def reasoning_gym_dataset(name: str, config_json: str, seed: int, size: int):
    """A reasoning-gym dataset, built once per (name, config, seed, size)."""
    import reasoning_gym  # optional dependency (extra "data")
    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def reasoning_gym_gold_is_number(gold: str) -> bool:
    """Whether a reasoning-gym gold answer is judged by the numeric allow-list (`math_answers_match`) rather
    than its dataset's checker: it reads as one number not written as a fraction. A fraction gold (as in
    fraction_simplification) asks for one form of the value, lowest terms, which only that checker knows."""
    reading = read_number(gold)
    return reading is not None and not reading.is_fraction


def reasoning_gym_score(meta: dict[str, Any], answer: str | None) -> float:
    """1.0 if `answer` is right for the reasoning-gym task whose `meta` says how to rebuild its entry
    (dataset, config, seed, size, index), else 0.0; never partial credit (the datasets' own checkers give
    some to an answer that merely contains the gold one: '-40' for '-4'). A numeric gold answer is judged
    by `math_answers_match`; any other counts only when the dataset's checker gives full credit."""
    if answer is None:
        return 0.0
    dataset = reasoning_gym_dataset(meta["rg_dataset"], json.dumps(meta.get("rg_config") or {}, sort_keys=True),
                                    int(meta["rg_seed"]), int(meta["rg_size"]))
    entry = dataset[int(meta["rg_index"])]
    gold = str(entry["answer"])
    if reasoning_gym_gold_is_number(gold):
        right = math_answers_match(answer, gold)
    else:
        right = float(dataset.score_answer(answer, entry) or 0.0) >= 1.0
    return 1.0 if right else 0.0
