"""Math questions a small model answers right only with a tool: products, word problems, two-step problems.

Kinds (the `kinds` option), each a few families of computations:
  product       "What is 214 * 375?": `digits`-digit by `digits`-digit products (calculator)
  word_problem  the operands sit in a sentence: a product, an exact division, a difference, a sum of
                three prices ("A warehouse has 148 shelves, each with 267 boxes. How many boxes ...?")
  two_step      one result feeds the next: (a * b) + c, (a * b) - c, (a + b) * c, as stories and in words
  python        what the `python` tool answers and a calculator cannot: digit sums of powers, primes below
                n, Fibonacci numbers, divisor counts, Collatz steps (answers computed here, exactly)

As in `arith`, a task is worded by a training template, and a second wording from a disjoint set of eval
templates waits in meta["eval_prompt"]; the build asks a held-out task in that wording
(`curation.use_eval_wording`), so evaluation uses words training never saw. The build splits by
`canonical_question` of the training wording. That key ignores the wording of a product ('Compute 3 * 5.'
is '3 * 5'), not of a story, so this source keeps content apart itself: no two tasks of one call share a
computation (a step such as 148 * 267, in either order, with whatever nouns) nor two operands, so a
held-out question's operands never meet in a training question. Two separate `tool_problems` entries
in one build are not kept apart that way: put every kind in one entry. The stories are templates over a
small set of scenes, not a word-problem corpus; answers are integers. meta["call"] is the tool call that
computes the answer (the warm start's reference demonstrations replay it: warmstart.demonstrations).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from grpo_core.data.curation import stable_hash
from grpo_core.data.records import Rejection
from grpo_core.task import Task

KINDS = ("product", "word_problem", "two_step", "python")
DEFAULT_KINDS = ("product", "word_problem", "two_step")


@dataclass(frozen=True)
class Problem:
    """One computation before it is worded."""
    family: str
    operands: tuple[int, ...]
    expression: str                  # what the tool is given: a calculator expression, or a Python program
    answer: int
    steps: tuple[tuple, ...]         # every computation it asks, normalised: ("*", 148, 267); unique per call
    fields: dict[str, Any]           # what the templates are filled with: numbers, nouns


@dataclass(frozen=True)
class Family:
    kind: str
    tool: str                                        # "calculator" | "python"
    draw: Callable[[random.Random, int], Problem]    # (rng, digits) -> a problem
    templates: tuple[str, ...]                       # training wordings
    eval_templates: tuple[str, ...]                  # held-out wordings, none of them a training one


# -- numbers and nouns -------------------------------------------------------------------------------------


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(max(2, 10 ** (digits - 1)), 10 ** digits - 1)


def _step(op: str, *operands: int) -> tuple:
    """A computation as one key: the operands of + and * in order, so 267 * 148 is 148 * 267."""
    return (op, *sorted(operands)) if op in "+*" else (op, *operands)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _with_article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


@dataclass(frozen=True)
class Scene:
    """Where the counted things are: 'a warehouse' with 'shelves' of 'boxes', some 'shipped'."""
    place: str
    container: str
    containers: str
    items: str
    removed: str         # past participle, also the simple past: 'sold', 'lent out'

    def fields(self) -> dict[str, str]:
        return {"a_place": _with_article(self.place), "the_place": f"the {self.place}", "container": self.container,
                "containers": self.containers, "items": self.items, "removed": self.removed}


SCENES = (
    Scene("warehouse", "shelf", "shelves", "boxes", "shipped"),
    Scene("library", "shelf", "shelves", "books", "lent out"),
    Scene("farm", "crate", "crates", "melons", "sold"),
    Scene("stadium", "block", "blocks", "seats", "reserved"),
    Scene("factory", "pallet", "pallets", "cartons", "shipped"),
    Scene("orchard", "row", "rows", "apple trees", "cut down"),
    Scene("print shop", "ream", "reams", "sheets of paper", "used"),
    Scene("bakery", "tray", "trays", "cookies", "sold"),
    Scene("shipping depot", "container", "containers", "parcels", "delivered"),
    Scene("greenhouse", "tray", "trays", "seedlings", "planted out"),
    Scene("toy store", "jar", "jars", "marbles", "sold"),
    Scene("supermarket", "pallet", "pallets", "cans of soup", "sold"),
    Scene("post office", "sack", "sacks", "letters", "delivered"),
    Scene("poultry farm", "tray", "trays", "eggs", "sold"),
    Scene("school", "box", "boxes", "pencils", "handed out"),
    Scene("hardware store", "bin", "bins", "screws", "sold"),
)
GOODS = ("laptop", "bicycle", "sofa", "television", "refrigerator", "camera", "washing machine", "guitar", "desk",
         "armchair", "tent", "printer", "microwave", "treadmill", "espresso machine", "wardrobe", "lawn mower",
         "electric scooter")
NAMES = ("Sam", "Maria", "Priya", "Tom", "Aisha", "Lena", "Carlos", "Mei", "Omar", "Jonas", "Ana", "Kofi")


# -- the computations ---------------------------------------------------------------------------------------


def _product(family: str) -> Callable[[random.Random, int], Problem]:
    """a * b; a story's nouns come from a scene (the bare `product` family has none)."""
    def draw(rng: random.Random, digits: int) -> Problem:
        a, b = _operand(rng, digits), _operand(rng, digits)
        scene = {} if family == "product" else rng.choice(SCENES).fields()
        return Problem(family, (a, b), f"{a} * {b}", a * b, (_step("*", a, b),), {"a": a, "b": b, **scene})
    return draw


def _draw_division(rng: random.Random, digits: int) -> Problem:
    """t / a with an exact quotient b: t is drawn as a * b."""
    a, b = _operand(rng, digits), _operand(rng, digits)
    t = a * b
    return Problem("divide", (t, a), f"{t} / {a}", b, (_step("/", t, a), _step("*", a, b)),
                   {"t": t, "a": a, **rng.choice(SCENES).fields()})


def _draw_difference(rng: random.Random, digits: int) -> Problem:
    """a - b, a with one digit more than b."""
    a, b = _operand(rng, digits + 1), _operand(rng, digits)
    return Problem("subtract", (a, b), f"{a} - {b}", a - b, (_step("-", a, b),),
                   {"a": a, "b": b, **rng.choice(SCENES).fields()})


def _draw_price_sum(rng: random.Random, digits: int) -> Problem:
    """p + q + r: three prices of `digits` or `digits` + 1 digits."""
    p, q, r = (rng.randint(max(2, 10 ** (digits - 1)), 10 ** (digits + 1) - 1) for _ in range(3))
    x, y, z = (_with_article(g) for g in rng.sample(GOODS, 3))
    return Problem("price_sum", (p, q, r), f"{p} + {q} + {r}", p + q + r, (_step("+", p, q, r),),
                   {"p": p, "q": q, "r": r, "x": x, "y": y, "z": z, "name": rng.choice(NAMES)})


def _two_step(family: str) -> Callable[[random.Random, int], Problem]:
    """(a * b) + c, (a * b) - c or (a + b) * c; c has one digit more than a and b, except in (a + b) * c."""
    def draw(rng: random.Random, digits: int) -> Problem:
        a, b = _operand(rng, digits), _operand(rng, digits)
        if family.startswith("add_mul"):
            c = _operand(rng, digits)
            steps, expression, answer = (_step("+", a, b), _step("*", a + b, c)), f"({a} + {b}) * {c}", (a + b) * c
        elif family.startswith("mul_add"):
            c = _operand(rng, digits + 1)
            steps, expression, answer = (_step("*", a, b), _step("+", a * b, c)), f"({a} * {b}) + {c}", a * b + c
        else:   # mul_sub: what is taken away is less than what there was
            c = rng.randint(1, min(a * b - 1, 10 ** (digits + 1) - 1))
            steps, expression, answer = (_step("*", a, b), _step("-", a * b, c)), f"({a} * {b}) - {c}", a * b - c
        scene = rng.choice(SCENES).fields() if not family.endswith("_words") else {}
        return Problem(family, (a, b, c), expression, answer, steps, {"a": a, "b": b, "c": c, **scene})
    return draw


# Python problems: sizes fixed here, each far past what a calculator expression or a head can do. The
# program in `expression` is what a python tool call could run; the answer is computed separately.

def _count_primes_below(n: int) -> int:
    sieve = bytearray([1]) * max(n, 2)
    sieve[0] = sieve[1] = 0
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytes(len(range(i * i, n, i)))
    return sum(sieve[:n])


def _fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _divisor_count(n: int) -> int:
    count, p, rest = 1, 2, n
    while p * p <= rest:
        exponent = 0
        while rest % p == 0:
            rest //= p
            exponent += 1
        count *= exponent + 1
        p += 1
    return count * (2 if rest > 1 else 1)


def _collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _draw_digit_sum(rng: random.Random, _: int) -> Problem:
    a, b = rng.choice([x for x in range(2, 100) if x % 10]), rng.randint(20, 99)
    return Problem("digit_sum_power", (a, b), f"print(sum(int(d) for d in str({a} ** {b})))",
                   sum(map(int, str(a ** b))), (("digit_sum_power", a, b),), {"a": a, "b": b, "b_th": _ordinal(b)})


def _draw_primes(rng: random.Random, _: int) -> Problem:
    n = rng.randint(1000, 50000)
    program = (f"n = {n}\nprimes = [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n"
               "print(len(primes))")
    return Problem("primes_below", (n,), program, _count_primes_below(n), (("primes_below", n),), {"n": n})


def _draw_fibonacci(rng: random.Random, _: int) -> Problem:
    n = rng.randint(20, 90)
    program = f"a, b = 1, 1\nfor _ in range({n} - 1):\n    a, b = b, a + b\nprint(a)"
    return Problem("fibonacci", (n,), program, _fibonacci(n), (("fibonacci", n),), {"n": n, "nth": _ordinal(n)})


def _draw_divisors(rng: random.Random, _: int) -> Problem:
    n = rng.randint(10 ** 5, 10 ** 7)
    program = f"n = {n}\nprint(sum(1 if d * d == n else 2 for d in range(1, int(n ** 0.5) + 1) if n % d == 0))"
    return Problem("divisor_count", (n,), program, _divisor_count(n), (("divisor_count", n),), {"n": n})


def _draw_collatz(rng: random.Random, _: int) -> Problem:
    n = rng.randint(1000, 999_999)
    program = (f"n, steps = {n}, 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    steps += 1\n"
               "print(steps)")
    return Problem("collatz_steps", (n,), program, _collatz_steps(n), (("collatz_steps", n),), {"n": n})


# -- the wordings -----------------------------------------------------------------------------------------
# Training and eval templates never share a wording, and try not to share long phrases (the build drops a
# training prompt whose 8-word runs mostly occur in eval prompts). Product templates use only words that
# `curation.TEMPLATE_WORDS` knows, so every wording of a product has the key '148 * 267'.

FAMILIES: dict[str, Family] = {
    "product": Family("product", "calculator", _product("product"), (
        "What is {a} * {b}?",
        "Compute {a} * {b}.",
        "Calculate {a} times {b}.",
        "What is {a} × {b}?",
    ), (
        "Work out {a} * {b}.",
        "Find the value of {a} times {b}.",
        "Evaluate {a} × {b}.",
    )),
    "multiply": Family("word_problem", "calculator", _product("multiply"), (
        "{a_place} has {a} {containers}, each with {b} {items}. How many {items} are there in all?",
        "There are {a} {containers} at {the_place}, and every {container} has {b} {items}. How many {items} are "
        "there altogether?",
        "Each {container} at {the_place} has {b} {items}. If there are {a} {containers}, how many {items} are there "
        "in total?",
        "If one {container} holds {b} {items}, how many {items} do {a} {containers} hold?",
        "{a_place} keeps {b} {items} in every {container} and has {a} {containers}. How many {items} does it keep?",
    ), (
        "{the_place} has {b} {items} in each of its {a} {containers}. Find the total number of {items}.",
        "{a} {containers}, {b} {items} per {container}: what is the total number of {items} at {the_place}?",
        "Suppose {the_place} owns {a} {containers} with {b} {items} apiece. What total number of {items} does it own?",
    )),
    "divide": Family("word_problem", "calculator", _draw_division, (
        "{a_place} packs {t} {items} equally into {a} {containers}. How many {items} go in each {container}?",
        "{t} {items} at {the_place} are shared equally among {a} {containers}. How many {items} does each "
        "{container} get?",
        "{a_place} has {t} {items} spread evenly over {a} {containers}. How many {items} are in one {container}?",
    ), (
        "Split {t} {items} evenly across {a} {containers} at {the_place}; find how many {items} end up in every "
        "{container}.",
        "If {the_place} divides its {t} {items} into {a} equal groups, one per {container}, how many {items} are in "
        "a single {container}?",
    )),
    "subtract": Family("word_problem", "calculator", _draw_difference, (
        "{a_place} had {a} {items} and {removed} {b} of them. How many {items} are left?",
        "There were {a} {items} at {the_place}. After {b} were {removed}, how many were left?",
        "{a_place} started the week with {a} {items} and has {removed} {b} since. How many {items} does it have now?",
    ), (
        "Of the {a} {items} that {the_place} had, {b} have been {removed}. Find how many are still there.",
        "Starting from {a} {items}, {the_place} {removed} {b}. What number of {items} remains?",
    )),
    "price_sum": Family("word_problem", "calculator", _draw_price_sum, (
        "A shop sells {x} for ${p}, {y} for ${q} and {z} for ${r}. How much do all three cost together?",
        "{name} buys {x} (${p}), {y} (${q}) and {z} (${r}). What is the total cost in dollars?",
        "A receipt lists {x} at ${p}, {y} at ${q} and {z} at ${r}. What is the receipt's total?",
    ), (
        "{name} paid ${p} for {x}, ${q} for {y} and ${r} for {z}. Altogether, how many dollars did {name} spend?",
        "Add up the prices of {x} (${p}), {y} (${q}) and {z} (${r}): what do they come to?",
    )),
    "mul_sub": Family("two_step", "calculator", _two_step("mul_sub"), (
        "{a_place} had {a} {containers} of {b} {items}, then {removed} {c} {items}. How many {items} are left?",
        "There are {a} {containers} at {the_place} with {b} {items} in each. If {c} {items} are {removed}, how many "
        "{items} remain?",
    ), (
        "{the_place} filled {a} {containers} with {b} {items} each and has since {removed} {c} of the {items}. Find "
        "the number of {items} still there.",
        "After {c} of its {items} were {removed}, how many {items} does {the_place} have left, if it started with "
        "{a} {containers} of {b}?",
    )),
    "mul_add": Family("two_step", "calculator", _two_step("mul_add"), (
        "{a_place} has {a} {containers} of {b} {items} and another {c} loose {items}. How many {items} does it have "
        "in all?",
        "Each of the {a} {containers} at {the_place} has {b} {items}, and {c} more {items} arrive. How many {items} "
        "are there now?",
    ), (
        "Count the {items} at {the_place}: {a} full {containers} of {b} each, plus {c} more.",
        "{the_place} received {c} {items} on top of its {a} {containers} with {b} {items} apiece. What is its total "
        "number of {items}?",
    )),
    "add_mul": Family("two_step", "calculator", _two_step("add_mul"), (
        "{a_place} has {a} {containers} in one building and {b} in another, with {c} {items} in every {container}. "
        "How many {items} are there altogether?",
        "Last year {the_place} had {a} {containers}; this year it added {b} more. Each {container} has {c} {items}. "
        "How many {items} are there now?",
    ), (
        "With {c} {items} per {container}, how many {items} are in the {a} old and {b} new {containers} at "
        "{the_place}?",
    )),
    "mul_add_words": Family("two_step", "calculator", _two_step("mul_add_words"), (
        "Multiply {a} by {b}, then add {c} to the result. What do you get?",
        "What is the product of {a} and {b}, increased by {c}?",
    ), (
        "Add {c} to {a} multiplied by {b}. What number results?",
        "Take {a} times {b} and add {c}. Give the result.",
    )),
    "mul_sub_words": Family("two_step", "calculator", _two_step("mul_sub_words"), (
        "Multiply {a} by {b}, then subtract {c} from the result. What do you get?",
        "What is the product of {a} and {b}, decreased by {c}?",
    ), (
        "Subtract {c} from {a} multiplied by {b}. What number results?",
        "Take {a} times {b} and take away {c}. Give the result.",
    )),
    "digit_sum_power": Family("python", "python", _draw_digit_sum, (
        "What is the sum of the digits of {a}**{b}?",
        "Add up the decimal digits of {a} to the power of {b}. What total do you get?",
    ), (
        "If you write out {a} to the {b_th} power in full, what do its digits add up to?",
    )),
    "primes_below": Family("python", "python", _draw_primes, (
        "How many primes are below {n}?",
        "How many prime numbers are less than {n}?",
    ), (
        "Count the prime numbers smaller than {n}.",
        "Find how many primes p satisfy p < {n}.",
    )),
    "fibonacci": Family("python", "python", _draw_fibonacci, (
        "What is the {nth} Fibonacci number, if the first two are 1 and 1?",
        "The Fibonacci sequence starts 1, 1, 2, 3, 5 and goes on. What is its {nth} term?",
    ), (
        "Find F({n}), where F(1) = F(2) = 1 and every later term is the sum of the two before it.",
    )),
    "divisor_count": Family("python", "python", _draw_divisors, (
        "How many positive divisors does {n} have?",
        "Count the positive whole numbers that divide {n} evenly.",
    ), (
        "Find the number of divisors of {n}, counting 1 and {n} itself.",
    )),
    "collatz_steps": Family("python", "python", _draw_collatz, (
        "Starting at {n}, repeatedly halve the number when it is even and replace it with 3 times it plus 1 when "
        "it is odd. How many steps does it take to reach 1?",
    ), (
        "In the Collatz sequence beginning with {n} (n -> n/2 if even, n -> 3n + 1 if odd), how many steps are "
        "needed to get to 1?",
    )),
}


def families_of(kind: str) -> list[str]:
    return [name for name, f in FAMILIES.items() if f.kind == kind]


def fill(template: str, fields: dict[str, Any], thousands_separator: bool = False) -> str:
    """The template with its fields in, the first letter capitalised; numbers as '1,250' if asked."""
    shown = {k: f"{v:,}" if thousands_separator and isinstance(v, int) else v for k, v in fields.items()}
    text = template.format_map(shown)
    return text[:1].upper() + text[1:]


def _pick(templates: Sequence[str], salt: str, key: str) -> str:
    """One template per problem, fixed by what it asks (the same in every build)."""
    return templates[stable_hash(salt, key) % len(templates)]


# -- the loader ---------------------------------------------------------------------------------------------


def _counts(kinds: Sequence[str], n: int | dict[str, int]) -> dict[str, int]:
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"tool_problems: kinds {unknown or '[]'} unknown; use some of {', '.join(KINDS)}")
    if isinstance(n, dict):
        extra = sorted(set(n) - set(kinds))
        if extra:
            raise ValueError(f"tool_problems: n names kinds {extra} that are not in kinds {list(kinds)}")
        return {k: int(n.get(k, 0)) for k in kinds}
    return {k: int(n) for k in kinds}


def _claims(problem: Problem) -> set[tuple]:
    """What no other problem may ask again: its computations, and each pair of its operands (so 591 and 853
    held out in 591 * 853 never meet in a training question, not even as (591 + 925) * 853)."""
    pairs = {("pair", *sorted((x, y))) for i, x in enumerate(problem.operands) for y in problem.operands[i + 1:]}
    return set(problem.steps) | pairs


def _draw_unique(kind: str, count: int, rng: random.Random, digits: int, taken: set[tuple]) -> list[Problem]:
    """`count` problems of `kind`, cycling over its families; none claims what another has `taken`."""
    names = families_of(kind)
    problems: list[Problem] = []
    tries = 0
    while len(problems) < count:
        tries += 1
        if tries > 100 * count + 1000:
            raise ValueError(f"tool_problems: found only {len(problems)} distinct {kind} problems of {digits} "
                             f"digits out of n={count}; raise `digits` or lower `n`")
        problem = FAMILIES[names[len(problems) % len(names)]].draw(rng, digits)
        claims = _claims(problem)
        if taken.isdisjoint(claims):
            taken.update(claims)
            problems.append(problem)
    return problems


def _shown(step: tuple) -> str:
    """('*', 148, 267) as '148 * 267'; ('fibonacci', 30) as 'fibonacci(30)'."""
    op, *operands = step
    return f" {op} ".join(map(str, operands)) if op in "+-*/" else f"{op}({', '.join(map(str, operands))})"


def _answering_call(tool: str, expression: str) -> dict:
    """The tool call that answers a problem (meta["call"]; the warm start's reference demonstrations replay it)."""
    return {"name": tool, "arguments": {"code" if tool == "python" else "expression": expression}}


def _task(problem: Problem, digits: int, seed: int, thousands_separator: bool) -> Task:
    family = FAMILIES[problem.family]
    key = f"{problem.family}:{','.join(map(str, problem.operands))}"
    commas = thousands_separator and family.kind in ("word_problem", "two_step")
    return Task(
        id=f"tool_problems-{problem.family}-{'-'.join(map(str, problem.operands))}",
        kind="math",
        source=f"tool_problems/{family.kind}",
        prompt=fill(_pick(family.templates, "train", key), problem.fields, commas),
        answer=str(problem.answer),
        license="generated",
        provenance=f"grpo_core.data.sources.tool_problems family={problem.family} digits={digits} seed={seed}",
        meta={"kind": family.kind, "family": problem.family, "tool": family.tool,
              "operands": list(problem.operands),
              "program" if family.tool == "python" else "expression": problem.expression,
              "call": _answering_call(family.tool, problem.expression),
              "steps": [_shown(step) for step in problem.steps], "digits": digits,
              "eval_prompt": fill(_pick(family.eval_templates, "eval", key), problem.fields, commas)},
    )


def draw(kinds: Sequence[str] = DEFAULT_KINDS, n: int | dict[str, int] = 100, digits: int = 3,
         seed: int = 0) -> list[Problem]:
    """The problems `load` words: `n` per kind (or {kind: n}), no computation asked twice."""
    if digits < 1:
        raise ValueError(f"tool_problems: digits must be >= 1, got {digits}")
    taken: set[tuple] = set()
    problems = []
    for kind, count in _counts(kinds, n).items():
        rng = random.Random(f"tool_problems/{seed}/{kind}/{digits}")
        problems += _draw_unique(kind, count, rng, digits, taken)
    return problems


def load(kinds: Sequence[str] = DEFAULT_KINDS, n: int | dict[str, int] = 100, digits: int = 3, seed: int = 0,
         thousands_separator: bool = False, **_: Any) -> Iterable[Task | Rejection]:
    """`n` problems per kind (or {kind: n}), operands of `digits` digits, held-out wordings in
    meta["eval_prompt"]; `thousands_separator` writes the stories' numbers as '1,250' (a calculator
    expression must then drop the commas). The same options give the same tasks."""
    return [_task(p, digits, seed, thousands_separator) for p in draw(kinds, n, digits, seed)]
