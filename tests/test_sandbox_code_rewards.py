"""GRPO side of code rewards: extraction, job building, verdict -> reward, and end to end."""
from __future__ import annotations

import pytest

from grpo_core.rewards.code_rewards import build_job, code_accuracy, extract_code, score_code, verdict_reward
from grpo_core.task import Task
from sandbox.types import StageResult, TestResult, Verdict
from sandbox_support import TRUSTED_LOCAL, need_bwrap, need_docker


def test_extract_code_prefers_last_tagged_block():
    text = "Idea:\n```python\ndef f(): return 1\n```\nBetter:\n```python\ndef f(): return 2\n```\nDone."
    assert extract_code(text, "python") == "def f(): return 2"
    assert extract_code("```rust\nfn a() {}\n```\n```python\nx=1\n```", "rust") == "fn a() {}"
    assert extract_code("```\ndef g(): pass\n```", "python") == "def g(): pass"
    assert extract_code("def g():\n    return 3\n", "python").startswith("def g()")
    assert extract_code("pub fn g() {}", "rust") == "pub fn g() {}"
    assert extract_code("```py\nx = 1", "python") == "x = 1"          # unterminated block
    assert extract_code("I don't know.", "python") == ""
    assert extract_code("", "rust") == ""
    assert extract_code("```python\nprint(1)\n```", "rust") == ""      # wrong language only


@pytest.mark.parametrize("text", ["x" + "\n" * 100_000 + "x", "```" * 33_000, "``` " * 25_000 + "\n```py" * 3,
                                  "<answer>" * 12_500])
def test_extract_code_and_answer_take_linear_time(text):
    """Blank-line runs, a line of fences, repeated open tags: quadratic before (12-20 s at 100 kB)."""
    import time
    from grpo_core.rewards.answers import extract_answer
    t0 = time.perf_counter()
    extract_code(text, "python"), extract_code(text, "rust"), extract_answer(text)
    assert time.perf_counter() - t0 < 1


def _v(status, passed, total, stages=None):
    tests = [TestResult(str(i), i < passed) for i in range(total)]
    return Verdict(status, tests=tests, stages=stages or {})


def _stages(build, clippy, test="pass"):
    return {"build": StageResult("build", build), "clippy": StageResult("clippy", clippy),
            "test": StageResult("test", test)}


def test_verdict_reward_python_modes():
    assert verdict_reward(_v("fail", 3, 4)) == 0.75
    assert verdict_reward(_v("fail", 3, 4), mode="binary") == 0.0
    assert verdict_reward(_v("pass", 4, 4), mode="binary") == 1.0
    assert verdict_reward(_v("timeout", 1, 4)) == 0.25
    assert verdict_reward(_v("error", 0, 4)) == 0.0


def test_infra_error_is_none_not_zero():
    assert verdict_reward(Verdict("infra_error")) is None
    assert verdict_reward(Verdict("infra_error"), mode="binary") is None


def test_verdict_reward_rust_staged_weights():
    assert verdict_reward(_v("pass", 2, 2, _stages("pass", "pass"))) == 1.0
    assert verdict_reward(_v("fail", 2, 2, _stages("pass", "fail"))) == 0.75
    assert verdict_reward(_v("fail", 1, 2, _stages("pass", "pass"))) == 0.75
    assert verdict_reward(_v("error", 0, 2, _stages("fail", "skipped", "skipped"))) == 0.0
    assert verdict_reward(_v("fail", 1, 2, _stages("pass", "fail")), rust_weights=(0, 0, 1)) == 0.5
    with pytest.raises(ValueError):
        verdict_reward(_v("fail", 1, 2), mode="nope")

    # The tests did not build against the code ('// todo', an unrelated fn): no build or lint credit.
    assert verdict_reward(_v("error", 0, 2, _stages("pass", "pass", "error"))) == 0.0
    assert verdict_reward(_v("error", 1, 2, _stages("pass", "pass", "pass"))) == 0.75  # tests ran, output limit hit


@pytest.mark.slow
def test_rust_code_that_defines_nothing_the_tests_call_earns_nothing_docker():
    need_docker()
    scores = score_code(["```rust\n// I could not solve this.\n```", "```rust\npub fn unrelated() {}\n```"],
                        [RS_TASK, RS_TASK], backend="docker")
    assert [s.reward for s in scores] == [0.0, 0.0]
    assert all(s.verdict.stages["build"].status == "pass" for s in scores)


PY_TASK = Task(id="t-add", kind="python", source="test", prompt="Write add(a, b).", entry_point="add",
               tests={"format": "io", "cases": [{"args": [1, 2], "expected": 3}, {"args": [5, 5], "expected": 10}]})
RS_TASK = Task(id="t-rs", kind="rust", source="test", prompt="Write add.",
               tests={"format": "rust", "tests": "#[test]\nfn t() { assert_eq!(add(2, 3), 5); }"})


def test_build_job_from_task():
    job = build_job(PY_TASK, "Sure:\n```python\ndef add(a, b):\n    return a + b\n```")
    assert job.language == "python" and job.entry_point == "add" and job.code.startswith("def add")
    with pytest.raises(ValueError, match="kind"):
        build_job(Task(id="m", kind="math", source="s", prompt="1+1", answer="2"), "2")


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_code_accuracy_end_to_end(backend):
    need_docker() if backend == "docker" else need_bwrap()
    completions = ["```python\ndef add(a, b):\n    return a + b\n```",
                   "```python\ndef add(a, b):\n    return 3\n```",
                   "no code at all",
                   "```python\ndef add(a, b)\n```"]
    rewards = code_accuracy(completions, [PY_TASK] * 4, backend=backend)
    assert rewards == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.slow
def test_rust_reward_end_to_end_docker():
    need_docker()
    scores = score_code(["```rust\npub fn add(a: i32, b: i32) -> i32 { a + b }\n```",
                         "```rust\npub fn add(a: i32, b: i32) -> i32 { return a + b; }\n```"],
                        [RS_TASK, RS_TASK], backend="docker")
    assert [s.reward for s in scores] == [1.0, 0.75]
    assert scores[1].verdict.stages["clippy"].status == "fail"


def test_malformed_task_gives_none():
    bad = Task(id="bad", kind="python", source="t", prompt="p", entry_point="f", tests={"format": "io", "cases": []})
    assert code_accuracy(["def f(): pass"], [bad], backend=TRUSTED_LOCAL, retries=0) == [None]


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_accuracy_reward_runs_code_tasks_through_the_same_columns(backend):
    """The built-in `accuracy`, called the TRL way (prompts, completions, **columns), mixes math and code:
    code is judged in the sandbox named by the run context, math in-process; a malformed code task is None
    and so is its total (the sample is left out, never scored 0)."""
    need_docker() if backend == "docker" else need_bwrap()
    from grpo_core.rewards.rewards import compute_rewards
    math_task = Task(id="m", kind="math", source="s", prompt="What is 1 + 1?", answer="2")
    bad = Task(id="bad", kind="python", source="t", prompt="p", entry_point="f", tests={"format": "io", "cases": []})
    completions = ["```python\ndef add(a, b):\n    return a + b\n```", "<answer>2</answer>",
                   "```python\ndef add(a, b):\n    return 3\n```", "def f(): pass"]
    scores = compute_rewards(completions, [PY_TASK, math_task, PY_TASK, bad], ["accuracy", "format"], [1.0, 0.5],
                             context={"sandbox_backend": backend, "code_reward_mode": "fraction"})
    assert scores.per_func["accuracy"] == [1.0, 1.0, 0.5, None]
    assert scores.totals == [1.5, 1.5, 1.0, None]
    binary = compute_rewards(completions[2:3], [PY_TASK], ["accuracy"], [1.0],
                             context={"sandbox_backend": backend, "code_reward_mode": "binary"})
    assert binary.per_func["accuracy"] == [0.0]
