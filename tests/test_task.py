"""grpo_core/task.py: the task record as the sandbox gets it (the Rust entry point's signature pinned)."""
from __future__ import annotations

from grpo_core.data import formats
from grpo_core.task import Task, rust_signature

REFERENCE = ("use std::collections::HashMap;\n// counts\npub fn count(words: &[&str], min: usize)\n"
             "    -> HashMap<String, usize> {\n    let mut m = HashMap::new();\n    m\n}\n"
             "fn helper(x: i32) -> i32 { x }\n")
TESTS = formats.rust_tests("#[test]\nfn t() { assert!(count(&[], 1).is_empty()); }")


def _rust(**over) -> Task:
    fields = dict(id="r", kind="rust", source="t", prompt="p", tests=TESTS, entry_point="count",
                  reference_solution=REFERENCE)
    return Task(**{**fields, **over})


def test_a_rust_task_goes_to_the_sandbox_with_its_reference_s_signature_pinned():
    """The entry point's header from the reference solution, after its std `use` lines, for scoring and reference
    checks alike (sandbox/rust_harness.py pins the return type); the task's own tests are not changed."""
    task = _rust()
    got = task.sandbox_tests()
    assert got["signature"] == ("use std::collections::HashMap;\n"
                                "pub fn count(words: &[&str], min: usize) -> HashMap<String, usize>")
    assert "signature" not in task.tests
    from sandbox.rust_harness import signature_pin
    assert "let _: fn(_, _) -> HashMap<String, usize> = super::count;" in signature_pin(got["signature"])


def test_nothing_is_pinned_without_a_reference_entry_point_or_where_the_tests_state_one():
    assert _rust(entry_point="missing").sandbox_tests() == TESTS
    assert _rust(reference_solution=None).sandbox_tests() == TESTS
    stated = {**TESTS, "signature": "pub fn count(w: &[&str], m: usize) -> Vec<String>"}
    assert _rust(tests=stated).sandbox_tests() == stated
    python = Task(id="p", kind="python", source="t", prompt="p", tests={"format": "io", "cases": []},
                  entry_point="count", reference_solution="def count():\n    pass\n")
    assert python.sandbox_tests() == {"format": "io", "cases": []}
    assert rust_signature("// pub fn count(x: i32) -> i32 {\n", "count") is None       # a comment is no header
    assert rust_signature("pub(crate) fn f<T: Ord>(v: Vec<T>) -> T where T: Copy { v[0] }", "f") == \
        "pub(crate) fn f<T: Ord>(v: Vec<T>) -> T where T: Copy"
