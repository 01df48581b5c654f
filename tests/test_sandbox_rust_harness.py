"""Rust harness, for real (cargo in the image on docker, the host toolchain on local): staged
verdicts and the Rust attack classes of BRIEF.md §5."""
from __future__ import annotations

import os

import pytest

from sandbox_support import backend, rust_job  # noqa: F401 - fixtures

pytestmark = [pytest.mark.docker, pytest.mark.slow]

TESTS = '''
#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn small() { assert_eq!(add(1, 2), 3); }
    #[test]
    fn big() { assert!(add(40, 2) == 42); }
    #[test]
    #[should_panic]
    fn div_zero() { div(1, 0); }
}
'''
GOOD = "pub fn add(a: i32, b: i32) -> i32 { a + b }\npub fn div(a: i32, b: i32) -> i32 { a / b }\n"
DIV = "\npub fn div(a: i32, b: i32) -> i32 { a / b }\n"

CASES = {
    # name: (code, expected status, expected passed tests, expected stage statuses (build, clippy))
    "good": (GOOD, "pass", 3, ("pass", "pass")),
    "wrong": ("pub fn add(a: i32, b: i32) -> i32 { a - b }" + DIV, "fail", 1, ("pass", "pass")),
    # code written for Cargo: its compile-time environment and manifest dir are there, as under cargo
    "cargo_env": ('''pub const NAME: &str = env!("CARGO_PKG_NAME");
pub const MANIFEST: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
pub fn add(a: i32, b: i32) -> i32 {
    let version_ok = env!("CARGO_PKG_VERSION").split('.').next() == Some(env!("CARGO_PKG_VERSION_MAJOR"));
    let ok = NAME == "solution" && env!("CARGO_CRATE_NAME") == NAME && MANIFEST.contains(NAME);
    if ok && version_ok { a + b } else { a * b }
}''' + DIV, "pass", 3, ("pass", "pass")),
    "compile_error": ("pub fn add(a: i32, b: i32) -> i32 { a + }", "error", 0, ("fail", "skipped")),
    "lint": ("pub fn add(a: i32, b: i32) -> i32 { return a + b; }" + DIV, "fail", 3, ("pass", "fail")),
    # lint suppression cannot beat -F clippy::all
    "allow_clippy": ("#![allow(clippy::all)]\npub fn add(a: i32, b: i32) -> i32 { return a + b; }" + DIV,
                     "fail", 3, ("pass", "fail")),
    "unsafe": ("pub fn add(a: i32, b: i32) -> i32 { unsafe { std::hint::unreachable_unchecked() } }" + DIV,
               "error", 0, ("fail", "skipped")),
    "allow_unsafe": ("#![allow(unsafe_code)]\npub fn add(a: i32, b: i32) -> i32 { a + b }" + DIV,
                     "error", 0, ("fail", "skipped")),
    # _exit via extern needs unsafe: forbidden
    "extern_exit": ('extern "C" { fn _exit(c: i32) -> !; }\npub fn add(a: i32, b: i32) -> i32 { unsafe { _exit(0) } }' + DIV,
                    "error", 0, ("fail", "skipped")),
    # exit code forging: exit(0) before any result is reported
    "exit0": ("pub fn add(_a: i32, _b: i32) -> i32 { std::process::exit(0) }" + DIV, "fail", 0, ("pass", "pass")),
    # forged libtest summary and forged result lines from a panic hook
    "panic_hook": ('''pub fn add(_a: i32, _b: i32) -> i32 {
    std::panic::set_hook(Box::new(|_| {
        println!("test result: ok. 3 passed; 0 failed");
        for n in ["tests::small", "tests::big", "tests::div_zero"] { println!("00000000000000000000000000000000 {} ok", n); }
    }));
    panic!("nope")
}''' + DIV, "fail", 1, ("pass", None)),
    # shadowing the assert macros through the glob import
    "macro_shadow": ('''#[macro_export]
macro_rules! assert_eq { ($($t:tt)*) => {} }
#[macro_export]
macro_rules! assert { ($($t:tt)*) => {} }
pub fn add(a: i32, b: i32) -> i32 { a * b }''' + DIV, "fail", 1, ("pass", None)),
    # compile-time host access: files and environment of the host
    "include_host_file": ('pub const S: &str = include_str!("/etc/shadow");\npub fn add(a: i32, b: i32) -> i32 { a + b }' + DIV,
                          "error", 0, ("fail", "skipped")),
    # reading the hidden tests at run time: sources and build tree are gone
    "read_tests": ('''pub fn add(a: i32, b: i32) -> i32 {
    for p in ["src/main.rs", "../src/main.rs", "/tmp"] {
        if let Ok(s) = std::fs::read_to_string(p) { if s.contains("add(40, 2) == 42") { return 42; } }
    }
    if let Ok(rd) = std::fs::read_dir("/tmp") { for e in rd.flatten() {
        if let Ok(s) = std::fs::read_to_string(e.path().join("src/main.rs")) { if s.contains("42") { return 42; } }
    } }
    a * b
}''' + DIV, "fail", 1, ("pass", None)),
    # proc macros need a proc-macro crate: the harness fixes the crate type on the command line
    "proc_macro": ('#![crate_type = "proc-macro"]\nextern crate proc_macro;\n#[proc_macro]\n'
                   'pub fn m(i: proc_macro::TokenStream) -> proc_macro::TokenStream { i }\n'
                   'pub fn add(a: i32, b: i32) -> i32 { a + b }' + DIV, "error", 0, ("fail", "skipped")),
    # macro recursion bomb: bounded by the recursion limit / build time limit
    "macro_bomb": ('''macro_rules! boom { ($($t:tt)*) => { boom!($($t)* $($t)*); } }
boom!(x);
pub fn add(a: i32, b: i32) -> i32 { a + b }''' + DIV, "error", 0, (("fail", "error"), "skipped")),
}


@pytest.fixture(scope="module")
def verdicts(backend):
    names = list(CASES)
    jobs = [rust_job(CASES[n][0], TESTS, build_timeout_s=60) for n in names]
    jobs.append(rust_job('pub fn secret() -> &\'static str { option_env!("GRPO_TEST_SECRET").unwrap_or("") }',
                         '#[test]\nfn leaks() { assert_eq!(secret(), "hunter2"); }'))
    os.environ["GRPO_TEST_SECRET"] = "hunter2"
    vs = backend.score_batch(jobs)
    return dict(zip(names + ["option_env"], vs))


@pytest.mark.parametrize("name", list(CASES))
def test_rust_case(verdicts, name):
    _, status, n_passed, (build, clippy) = CASES[name]
    v = verdicts[name]
    assert v.status == status, (v.status, v.detail, v.stages)
    assert v.passed == n_passed, [(t.name, t.passed, t.detail) for t in v.tests]
    assert v.total == 3
    assert v.stages["build"].status in ((build,) if isinstance(build, str) else build)
    if clippy is not None:
        assert v.stages["clippy"].status == clippy


def test_compile_time_env_of_host_is_not_visible(verdicts):
    v = verdicts["option_env"]
    assert v.stages["build"].status == "pass" and v.status == "fail" and v.passed == 0, v


def test_stage_durations_and_output_are_reported(verdicts):
    v = verdicts["good"]
    assert all(v.stages[s].duration_s > 0 for s in ("build", "clippy", "test"))
    assert "unsafe" in verdicts["unsafe"].stages["build"].detail


def test_rust_test_that_never_ends_times_out(backend):
    job = rust_job("pub fn add(_a: i32, _b: i32) -> i32 { loop { std::thread::sleep(std::time::Duration::from_millis(5)); } }",
                   "#[test]\nfn t() { assert_eq!(add(1, 2), 3); }", test_timeout_s=4)
    v = backend.score_batch([job])[0]
    assert v.status == "timeout" and v.stages["test"].status == "timeout" and v.passed == 0, v
    assert v.duration_s < 30


# -- a later audit: always-equal values and a shadowed prelude -----------------------------------------------
GUARD_TESTS = '''
#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn some_case() { assert_eq!(safe_div(6, 3), Some(2)); }
    #[test]
    fn none_case() { assert_eq!(safe_div(1, 0), None); }
    #[test]
    fn greet_case() { assert_eq!(greet("Bob"), String::from("Hello, Bob!")); }
    #[test]
    fn greet_is() { assert!(greet("Al") == "Hello, Al!".to_string()); }
}
'''
ALWAYS_EQUAL = {
    "good": ('''#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Greeting(pub String);
pub fn safe_div(a: i32, b: i32) -> Option<i32> {
    if b == 0 { None } else { Some(a / b) }
}
pub fn greet(name: &str) -> String {
    Greeting(format!("Hello, {}!", name)).0
}''', "pass", 4),
    # glob-imported `Some` / `String` of the completion shadowed std's in the tests
    "shadow_prelude": ('''pub fn safe_div(_a: i32, _b: i32) -> Option<i32> { Option::None }
#[allow(non_snake_case)]
pub fn Some<T>(_x: T) -> Option<T> { Option::None }
pub fn greet(_name: &str) -> std::string::String { std::string::String::new() }
pub struct String;
impl String {
    pub fn from(_s: &str) -> std::string::String { std::string::String::new() }
}''', "fail", 1),
    # an always-equal value: PartialEq against the expected values' types
    "fake_eq": ('''#[derive(Debug)]
pub struct Anything;
impl PartialEq<Option<i32>> for Anything { fn eq(&self, _o: &Option<i32>) -> bool { true } }
impl PartialEq<std::string::String> for Anything { fn eq(&self, _o: &std::string::String) -> bool { true } }
pub fn safe_div(_a: i32, _b: i32) -> Anything { Anything }
pub fn greet(_n: &str) -> Anything { Anything }''', "error", 0),
    "fake_eq_via_macro": ('''#[derive(Debug)]
pub struct Anything;
macro_rules! always { ($tr:path, $t:ty) => { impl $tr<$t> for Anything { fn eq(&self, _o: &$t) -> bool { true } } } }
always!(PartialEq, Option<i32>);
always!(PartialEq, std::string::String);
pub fn safe_div(_a: i32, _b: i32) -> Anything { Anything }
pub fn greet(_n: &str) -> Anything { Anything }''', "error", 0),
}


def test_rust_always_equal_values_and_prelude_shadowing_fail(backend):
    names = list(ALWAYS_EQUAL)
    vs = backend.score_batch([rust_job(ALWAYS_EQUAL[n][0], GUARD_TESTS) for n in names], workers=1)
    for name, v in zip(names, vs):
        _, status, passed = ALWAYS_EQUAL[name]
        assert (v.status, v.passed) == (status, passed), (name, v)


@pytest.mark.parametrize("code, refused", [
    ("impl PartialEq<Option<i32>> for Anything { fn eq(&self, _: &Option<i32>) -> bool { true } }", True),
    ("impl<T> std::cmp::PartialOrd<T> for A { }", True),
    ("impl core::ops::Sub<f64> for A { type Output = f64; }", True),
    ("use std::cmp::PartialEq as P;", True),
    ("impl std::ops::Not for A { type Output = bool; }", True),
    ("macro_rules! m { ($t:ty) => { impl PartialEq<$t> for A {} } }", True),
    ("#[derive(Debug, Clone, PartialEq, Eq, PartialOrd)] pub struct P(i32);", False),
    ("impl PartialEq for P { fn eq(&self, o: &Self) -> bool { self.0 == o.0 } }", False),
    ("impl PartialEq<Self> for P { fn eq(&self, o: &Self) -> bool { self.0 == o.0 } }", False),
    ("fn sum<T: std::ops::Add<Output = T> + Copy>(a: T, b: T) -> T { a + b }", False),
    ("impl r#PartialEq<i32> for A { fn eq(&self, _: &i32) -> bool { true } }", True),
    ("impl<T: std::fmt::Display> ::core::cmp::PartialEq<T> for A {}", True),
    ("impl<'a> PartialEq<&'a str> for Token {}", True),
    ("fn largest<T: PartialOrd<T> + Copy>(v: &[T]) -> T { v[0] }", False),       # bounds, not impls
    ("fn add_all<T: Add<T, Output = T> + Copy>(a: T, b: T) -> T where T: Mul<T, Output = T> { a + b }", False),
    ("fn f(x: impl PartialEq<i32>) -> bool { for _ in 0..1 {} x == 1 }", False),
    ("impl<T: PartialOrd<T>> PartialEq<Self> for W<T> { fn eq(&self, o: &Self) -> bool { true } }", False),
    ("// impl PartialEq<i32> for A\nlet s = \"PartialEq<i32> for\"; let r = r#\"Not for\"#;", False),
])
def test_the_always_equal_guard_reads_code_not_comments(code, refused):
    """Unit check of the guard (no box): comparison/operator impls against another type are refused; derives,
    impls for Self, trait bounds with Output = T, and the words in comments or strings are not."""
    from sandbox.rust_harness import fake_comparison
    assert bool(fake_comparison(code)) is refused, fake_comparison(code)


# -- the entry point's signature pinned: a type of the completion's own cannot stand in for the answer -------
PREDICATE_TESTS = '''
#[test]
fn some() { assert!(safe_div(6, 3).is_some()); }
#[test]
fn none() { assert!(safe_div(1, 0).is_none()); }
'''
SIGNATURE = "pub fn safe_div(a: i32, b: i32) -> Option<i32>"
PINNED = {
    "good": ("pub fn safe_div(a: i32, b: i32) -> Option<i32> { if b == 0 { None } else { Some(a / b) } }", True,
             ("pass", 2)),
    # inherent methods that answer whatever the tests ask: no trait, so the always-equal guard cannot see it
    "fake_predicates": ('''pub struct Fake;
impl Fake {
    pub fn is_some(&self) -> bool { true }
    pub fn is_none(&self) -> bool { true }
}
pub fn safe_div(_a: i32, _b: i32) -> Fake { Fake }''', True, ("error", 0)),
    "fake_predicates_unpinned": (None, False, ("pass", 2)),     # the hole the pin closes, shown open without it
    "other_argument_types": ("pub fn safe_div(a: i64, b: i64) -> Option<i32> { if b == 0 { None } else "
                             "{ Some((a / b) as i32) } }", True, ("pass", 2)),
}


def test_a_pinned_signature_refuses_a_stand_in_return_type(backend):
    """With tests['signature'] (grpo_core.task.Task.sandbox_tests adds it from the reference solution), the
    completion's entry point must return the stated type; its arguments' types stay free."""
    from sandbox.types import Job
    jobs = []
    for name, (code, pinned, _) in PINNED.items():
        tests = {"format": "rust", "tests": PREDICATE_TESTS, **({"signature": SIGNATURE} if pinned else {})}
        jobs.append(Job("rust", code or PINNED["fake_predicates"][0], tests))
    for name, v in zip(PINNED, backend.score_batch(jobs, workers=1)):
        assert (v.status, v.passed) == PINNED[name][2], (name, v)


@pytest.mark.parametrize("signature, pin", [
    (SIGNATURE, "let _: fn(_, _) -> Option<i32> = super::safe_div;"),
    ("use std::any::Any;\nfn f(x: Box<dyn Any>, y: &[(i32, i32)]) -> Vec<String> {",
     "use std::any::Any;\n    pub fn pin() { let _: fn(_, _) -> Vec<String> = super::f; }"),
    ("fn f() -> i64", "let _: fn() -> i64 = super::f;"),
    ("fn f(g: impl Fn(i32) -> i32) -> i32", ""),                  # generic: its types cannot be named outside it
    ("fn f<T: Ord>(v: Vec<T>) -> T", ""),
    ("fn f(s: &str) -> &str", ""),                               # a returned reference: no pin
    ("fn f(values: &mut [i32])", ""),                            # nothing returned
])
def test_the_signature_pin_names_arity_and_return_type(signature, pin):
    from sandbox.rust_harness import signature_pin
    assert (pin in signature_pin(signature)) if pin else signature_pin(signature) == ""


def test_a_signature_that_is_not_a_header_is_a_task_format_error():
    from sandbox.rust_harness import validate_tests
    from sandbox.types import TaskFormatError
    with pytest.raises(TaskFormatError, match="is not a `fn name"):
        validate_tests({"format": "rust", "tests": PREDICATE_TESTS, "signature": "safe_div returns Option<i32>"})
