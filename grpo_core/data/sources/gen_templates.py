"""Function-task templates shared by the Python and Rust generators.

Each template has a difficulty knob (`level` 1..3), a Python reference (also used to compute expected
outputs), a Rust reference, a description and an input sampler. Inputs are ints, lists of ints and
strings, so expected values are exact in both languages.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Template:
    name: str
    describe: Callable[[dict], str]                 # params -> sentence
    py_sig: str                                     # e.g. "def f(xs: list[int]) -> int:"
    py_body: Callable[[dict], str]                  # params -> indented body
    rs_sig: str                                     # e.g. "fn f(xs: &[i64]) -> i64"
    rs_body: Callable[[dict], str]                  # params -> body
    params: Callable[[random.Random, int], dict]    # (rng, level) -> params
    sample: Callable[[random.Random, int], list]    # (rng, level) -> argument list
    arg_types: tuple[str, ...]                      # "ints" | "int" | "str" per argument


def _ints(rng: random.Random, level: int) -> list[int]:
    return [rng.randint(-10 * level ** 2, 10 * level ** 2) for _ in range(rng.randint(0, 3 + 3 * level))]


def _word_str(rng: random.Random, level: int) -> str:
    words = ["apple", "Rust", "level", "noon", "grpo", "Data", "kayak", "tree", "sky", "Queue", "io", "a"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(0, 2 + 2 * level)))


TEMPLATES: list[Template] = [
    Template(
        "sum_above", lambda p: f"returns the sum of the elements of `xs` that are strictly greater than {p['k']}",
        "def {name}(xs: list[int]) -> int:", lambda p: f"    return sum(x for x in xs if x > {p['k']})",
        "fn {name}(xs: &[i64]) -> i64", lambda p: f"    xs.iter().filter(|&&x| x > {p['k']}).sum()",
        lambda r, l: {"k": r.randint(-5, 5 * l)}, lambda r, l: [_ints(r, l)], ("ints",)),
    Template(
        "count_multiples", lambda p: f"returns how many elements of `xs` are divisible by {p['k']}",
        "def {name}(xs: list[int]) -> int:", lambda p: f"    return sum(1 for x in xs if x % {p['k']} == 0)",
        "fn {name}(xs: &[i64]) -> i64", lambda p: f"    xs.iter().filter(|&&x| x % {p['k']} == 0).count() as i64",
        lambda r, l: {"k": r.randint(2, 3 + 2 * l)}, lambda r, l: [_ints(r, l)], ("ints",)),
    Template(
        "running_max", lambda p: "returns a list whose i-th element is the largest of the first i + 1 elements of `xs` (empty input gives an empty list)",
        "def {name}(xs: list[int]) -> list[int]:",
        lambda p: "    out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))\n    return out",
        "fn {name}(xs: &[i64]) -> Vec<i64>",
        lambda p: "    let mut out: Vec<i64> = Vec::new();\n    for &x in xs {\n        let m = out.last().map_or(x, |&l| l.max(x));\n        out.push(m);\n    }\n    out",
        lambda r, l: {}, lambda r, l: [_ints(r, l)], ("ints",)),
    Template(
        "rotate_left", lambda p: f"returns `xs` rotated left by {p['k']} positions (modulo its length; empty stays empty)",
        "def {name}(xs: list[int]) -> list[int]:",
        lambda p: f"    if not xs:\n        return []\n    k = {p['k']} % len(xs)\n    return xs[k:] + xs[:k]",
        "fn {name}(xs: &[i64]) -> Vec<i64>",
        lambda p: f"    if xs.is_empty() {{\n        return Vec::new();\n    }}\n    let k = {p['k']} % xs.len();\n    let mut v = xs[k..].to_vec();\n    v.extend_from_slice(&xs[..k]);\n    v",
        lambda r, l: {"k": r.randint(1, 4 * l)}, lambda r, l: [_ints(r, l)], ("ints",)),
    Template(
        "digit_sum_pow", lambda p: f"returns the sum of the decimal digits of `n` (ignore the sign), raised to the power {p['e']}",
        "def {name}(n: int) -> int:", lambda p: f"    return sum(int(c) for c in str(abs(n))) ** {p['e']}",
        "fn {name}(n: i64) -> i64", lambda p: f"    let s: i64 = n.abs().to_string().bytes().map(|b| (b - b'0') as i64).sum();\n    s.pow({p['e']})",
        lambda r, l: {"e": r.randint(1, l)}, lambda r, l: [r.randint(-10 ** (2 + l), 10 ** (2 + l))], ("int",)),
    Template(
        "count_vowels", lambda p: f"returns how many characters of `s` are among {p['set']!r} (case-insensitive)",
        "def {name}(s: str) -> int:", lambda p: f"    return sum(1 for c in s.lower() if c in {p['set']!r})",
        "fn {name}(s: &str) -> i64", lambda p: f"    s.to_lowercase().chars().filter(|c| {p['set']!r}.contains(*c)).count() as i64".replace("'", '"'),
        lambda r, l: {"set": "".join(sorted(r.sample("aeiouy", 2 + l)))}, lambda r, l: [_word_str(r, l)], ("str",)),
    Template(
        "reverse_words", lambda p: "returns the words of `s` (split on single spaces, empty words dropped) in reverse order, joined by single spaces" + (", each word upper-cased" if p["upper"] else ""),
        "def {name}(s: str) -> str:",
        lambda p: "    words = [w for w in s.split(' ') if w]\n    return ' '.join(" + ("w.upper()" if p["upper"] else "w") + " for w in reversed(words))",
        "fn {name}(s: &str) -> String",
        lambda p: "    s.split(' ').filter(|w| !w.is_empty()).rev().map(|w| " + ("w.to_uppercase()" if p["upper"] else "w.to_string()") + ").collect::<Vec<_>>().join(\" \")",
        lambda r, l: {"upper": l >= 2 and r.random() < 0.5}, lambda r, l: [_word_str(r, l)], ("str",)),
    Template(
        "count_palindromes", lambda p: f"returns how many space-separated words of `s` with at least {p['m']} letters read the same backwards (case-insensitive)",
        "def {name}(s: str) -> int:",
        lambda p: f"    return sum(1 for w in s.split(' ') if len(w) >= {p['m']} and w.lower() == w.lower()[::-1])",
        "fn {name}(s: &str) -> i64",
        lambda p: f"    s.split(' ').filter(|w| {{ let l = w.to_lowercase(); w.chars().count() >= {p['m']} && l.chars().rev().collect::<String>() == l }}).count() as i64",
        lambda r, l: {"m": r.randint(1, 2 + l)}, lambda r, l: [_word_str(r, l)], ("str",)),
    Template(
        "fib_mod", lambda p: f"returns the n-th Fibonacci number modulo {p['m']} (fib(0) = 0, fib(1) = 1); n is non-negative",
        "def {name}(n: int) -> int:",
        lambda p: f"    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {p['m']}\n    return a % {p['m']}",
        "fn {name}(n: i64) -> i64",
        lambda p: f"    let (mut a, mut b) = (0i64, 1i64);\n    for _ in 0..n {{\n        let t = (a + b) % {p['m']};\n        a = b;\n        b = t;\n    }}\n    a % {p['m']}",
        lambda r, l: {"m": r.choice([7, 10, 97, 1000, 1_000_007][: 2 + l])}, lambda r, l: [r.randint(0, 20 * l ** 2)], ("int",)),
    Template(
        "pairwise_diff", lambda p: "returns the list of differences `xs[i + 1] - xs[i]`" + (" in absolute value" if p["abs"] else ""),
        "def {name}(xs: list[int]) -> list[int]:",
        lambda p: "    return [" + ("abs(b - a)" if p["abs"] else "b - a") + " for a, b in zip(xs, xs[1:])]",
        "fn {name}(xs: &[i64]) -> Vec<i64>",
        lambda p: "    xs.windows(2).map(|w| " + ("(w[1] - w[0]).abs()" if p["abs"] else "w[1] - w[0]") + ").collect()",
        lambda r, l: {"abs": r.random() < 0.5}, lambda r, l: [_ints(r, l)], ("ints",)),
]

FUNCTION_NAMES = ["solve", "compute", "transform", "answer", "calc"]


def python_reference(t: Template, name: str, p: dict) -> str:
    return t.py_sig.format(name=name) + "\n" + t.py_body(p) + "\n"


def rust_reference(t: Template, name: str, p: dict) -> str:
    return "pub " + t.rs_sig.format(name=name) + " {\n" + t.rs_body(p) + "\n}\n"


def expected_outputs(t: Template, name: str, p: dict, inputs: list[list]) -> list[Any]:
    """Run our own (trusted, generated) Python reference to get expected outputs."""
    ns: dict[str, Any] = {}
    exec(compile(python_reference(t, name, p), f"<template {t.name}>", "exec"), ns)  # noqa: S102 - our code
    return [ns[name](*args) for args in inputs]


def instance(t: Template, seed: int, level: int, n_cases: int) -> tuple[str, dict, list[list], list]:
    """(function name, params, inputs, outputs) for one deterministic instance of a template."""
    rng = random.Random(f"{t.name}:{seed}:{level}")
    name = rng.choice(FUNCTION_NAMES)
    p = t.params(rng, level)
    inputs = [t.sample(rng, level) for _ in range(n_cases)]
    return name, p, inputs, expected_outputs(t, name, p, inputs)
