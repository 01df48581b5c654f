"""Host-side logic of the sandbox: test formats, strict comparison, value codec, Rust harness text.
No engine needed."""
from __future__ import annotations

import math

import pytest

from sandbox import python_tests, rust_harness
from sandbox.types import Job, TaskFormatError, TestResult, Verdict
from sandbox.api import validate_tests
from sandbox.python_runner import Unencodable, decode, encode


@pytest.mark.parametrize("value", [None, True, False, 0, -7, 10**40, 1.5, float("inf"), "héllo\ud800",
                                   b"\x00\xff", 1 + 2j, [1, [2, (3,)]], (1, "a"), {1, 2}, frozenset({3}),
                                   {"a": [1], (1, 2): {None: 0.5}}])
def test_codec_roundtrip_keeps_exact_types(value):
    back = decode(encode(value))
    assert back == value and type(back) is type(value)


def test_codec_nan_roundtrip():
    assert math.isnan(decode(encode(float("nan"))))


def test_codec_rejects_subclasses_and_objects():
    class AlwaysEqual:
        def __eq__(self, other):
            return True

    class EvilInt(int):
        def __eq__(self, other):
            return True

    for bad in (AlwaysEqual(), EvilInt(3), [EvilInt(1)], {"k": AlwaysEqual()}):
        with pytest.raises(Unencodable):
            encode(bad)


def test_strict_equal_types():
    se = python_tests.strict_equal
    assert se(3, 3) and not se(True, 1) and not se(1, 1.0) and not se("3", 3)
    assert se([1, 2], (1, 2), json_like=True) and not se([1, 2], (1, 2))
    assert se({"a": [1.0]}, {"a": [1.0]}) and not se({"a": 1}, {"a": 1, "b": 2})
    assert se(0.1 + 0.2, 0.3, tol=1e-9) and not se(0.1 + 0.2, 0.3)
    assert se(float("nan"), float("nan"))


def _rec(i, value):
    return {"i": i, "ok": True, "v": encode(value), "dt": 0.001}


def test_io_plan_sends_only_arguments_and_judges_on_host():
    tests = {"format": "io", "cases": [{"args": [1, 2], "expected": 3}, {"args": [2], "kwargs": {"b": 5}, "expected": 7}]}
    plan = python_tests.plan(tests, "add")
    assert plan.n_tests == 2
    assert "3" not in str(plan.calls) and "7" not in str(plan.calls)  # expected values stay here
    res = plan.judge([_rec(0, 3), _rec(1, 7.0)])
    assert [r.passed for r in res] == [True, False]
    assert "got 7.0 (float)" in res[1].detail


def test_io_missing_duplicate_and_foreign_records_fail():
    plan = python_tests.plan({"format": "io", "cases": [{"args": [1], "expected": 1}] * 3}, "f")
    assert [r.passed for r in plan.judge([_rec(0, 1)])] == [True, False, False]
    assert not any(r.passed for r in plan.judge([_rec(0, 1), _rec(0, 1), _rec(1, 1), _rec(2, 1)]))
    assert not any(r.passed for r in plan.judge([_rec(0, 1), _rec(1, 1), _rec(7, 1)]))
    res = plan.judge([{"i": 0, "ok": True, "v": ["x", 1]}, _rec(1, 1), _rec(2, 1)])
    assert [r.passed for r in res] == [False, True, True] and "malformed" in res[0].detail


HUMANEVAL_STYLE = '''
import math
METADATA = {"author": "x"}

def check(candidate):
    assert candidate([1, 2, 3]) == 6
    assert abs(candidate([0.5, 0.25]) - 0.75) < 1e-6, "float"
    for n in range(3):
        assert candidate(list(range(n))) == sum(range(n))
    assert all(candidate([k]) == k for k in (4, 5))
    assert sum_list([9]) == 9          # some checks call the entry point by name
'''


def test_assert_plan_rewrites_asserts_into_calls():
    plan = python_tests.plan({"format": "assert", "check": HUMANEVAL_STYLE}, "sum_list")
    assert plan.n_tests == 7
    args = [decode(c[0]) for c in plan.calls]
    assert ([1, 2, 3],) in args and ([0.5, 0.25],) in args and ([9],) in args and ([5],) in args
    outputs = {repr(decode(c[0])): sum(decode(c[0])[0]) for c in plan.calls}
    records = [_rec(i, outputs[repr(decode(c[0]))]) for i, c in enumerate(plan.calls)]
    assert all(r.passed for r in plan.judge(records))
    records[0] = _rec(0, 0)
    assert sum(not r.passed for r in plan.judge(records)) >= 1


def test_assert_plan_with_setup_helpers_and_random_inputs():
    check = '''
import random
def check(candidate):
    for _ in range(5):
        x = random.randint(0, 100)
        assert candidate(x) == double(x)
'''
    tests = {"format": "assert", "check": check, "setup": "def double(x):\n    return 2 * x\n"}
    plan = python_tests.plan(tests, "f")
    records = [_rec(i, 2 * decode(c[0])[0]) for i, c in enumerate(plan.calls)]
    assert plan.n_tests == 5 and all(r.passed for r in plan.judge(records))



def test_random_checks_judge_the_planned_calls_while_other_threads_draw_randoms():
    """Another thread drawing from the global ``random`` (a Prefect or HTTP client's jitter)
    while a check runs must not change the inputs the check draws."""
    import random
    import sys
    import threading
    check = ("from random import randint, choice\nimport random as r\n"
             "def check(candidate):\n    for _ in range(400):\n"
             "        x = randint(0, 10**6) + r.random() + len(choice('abc'))\n"
             "        assert candidate(x) == x\n")
    stop, draws = threading.Event(), [0]

    def noise():
        while not stop.is_set():
            random.random()
            draws[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=noise)
    thread.start()
    try:
        plan = python_tests.plan({"format": "assert", "check": check}, "f")
        results = plan.judge([_rec(i, decode(c[0])[0]) for i, c in enumerate(plan.calls)])
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert draws[0] > 0
    assert plan.n_tests == 400 and all(r.passed for r in results), [r.detail for r in results][:3]

@pytest.mark.parametrize("tests,entry,msg", [
    ({"format": "io", "cases": []}, "f", "cases"),
    ({"format": "io", "cases": [{"args": [1]}]}, "f", "expected"),
    ({"format": "io", "cases": [{"args": [1], "expected": 1}]}, None, "entry_point"),
    ({"format": "assert", "check": "x = 1"}, "f", "defining check"),
    ({"format": "assert", "check": "def check(candidate):\n    pass\n"}, "f", "no assert"),
    ({"format": "assert", "check": "def check(c):\n    assert c(object()) == 1\n"}, "f", "plain builtin"),
    ({"format": "nope"}, "f", "format"),
])
def test_malformed_python_tests_name_the_field(tests, entry, msg):
    with pytest.raises(TaskFormatError, match=msg):
        validate_tests("python", tests, entry)


def test_rust_transform_finds_tests_in_modules():
    src = '''
#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a() { assert_eq!(f(), 1); }
    #[test]
    #[should_panic(expected = "boom")]
    fn b() { g(); }
    fn helper() -> i32 { 1 }   // not a test
}
#[test]
fn top() -> Result<(), String> { Ok(()) }
'''
    found = rust_harness.validate_tests({"format": "rust", "tests": src})
    assert found == [("tests::a", False), ("tests::b", True), ("top", False)]
    fields = rust_harness.build_job_fields("pub fn f() -> i32 { 1 }", {"format": "rust", "tests": src})
    assert fields["lib_rs"].startswith("#![forbid(unsafe_code)]")
    assert set(fields) == {"lib_rs", "main_rs", "test_names"}  # no manifest: rustc is driven directly
    assert "pub use ::std::{assert, assert_eq" in fields["main_rs"]
    assert "#[test]" not in fields["main_rs"]


def test_rust_tests_without_test_fns_are_rejected():
    with pytest.raises(TaskFormatError, match="#\\[test\\]"):
        validate_tests("rust", {"format": "rust", "tests": "fn helper() {}"})


def test_rust_judge_requires_every_test_and_rejects_duplicates():
    reply = {"stages": {"build": {"status": "pass"}, "clippy": {"status": "pass"}, "test": {"status": "pass"}},
             "results": [["a", True]]}
    status, tests, _, _ = rust_harness.judge(reply, ["a", "b"])
    assert status == "fail" and [t.passed for t in tests] == [True, False]
    reply["results"] = [["a", True], ["b", False], ["b", True]]
    status, tests, _, _ = rust_harness.judge(reply, ["a", "b"])
    assert status == "fail" and not any(t.passed for t in tests)


def test_verdict_fractions():
    v = Verdict("fail", tests=[TestResult("a", True), TestResult("b", False)])
    assert (v.passed, v.total, v.pass_fraction) == (1, 2, 0.5)
    assert Verdict("error").pass_fraction == 0.0
    assert v.to_dict()["pass_fraction"] == 0.5


def test_malformed_task_is_infra_error_not_crash():
    from sandbox_support import trusted_local_backend
    v = trusted_local_backend().score_one(Job("python", "def f(): pass", {"format": "io", "cases": "x"}, "f"))
    assert v.status == "infra_error" and "cases" in v.detail


def test_a_call_that_names_no_backend_gets_the_environments_or_auto(monkeypatch):
    """$GRPO_SANDBOX_BACKEND is read in one place (`default_backend_name`), for calls without a config; a name
    given (a run's sandbox.backend) wins."""
    from grpo_core.rollout.code_tools import _backend
    from sandbox.api import default_backend_name, get_backend
    from sandbox.local_backend import LocalBackend
    monkeypatch.delenv("GRPO_SANDBOX_BACKEND", raising=False)
    assert default_backend_name() == "auto"
    from sandbox_support import TRUSTED_LOCAL
    monkeypatch.setenv("GRPO_SANDBOX_BACKEND", TRUSTED_LOCAL)
    assert isinstance(get_backend(), LocalBackend) and isinstance(_backend(None), LocalBackend)
    monkeypatch.setenv("GRPO_SANDBOX_BACKEND", "remote")
    assert isinstance(_backend({"backend": TRUSTED_LOCAL}), LocalBackend)
    with pytest.raises(ValueError, match=r"sandbox backend 'remote' \(sandbox.backend, or \$GRPO_SANDBOX_BACKEND\)"):
        get_backend()
