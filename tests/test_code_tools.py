"""The code tools (grpo_core/rollout/code_tools.py) for real: the python and rust tools and the rust_fix environment
run in the sandbox (Docker, and the local backend), with its isolation and limits; the hidden tests of a
rust_fix task never show in what the model is told."""
from __future__ import annotations

import inspect
import time

import pytest

from grpo_core.rollout import code_tools
from grpo_core.rollout.code_tools import (RustFix, TestSplit, check_report, output_text, python_tool, rust_fix_environment,
                                  rust_tool, split_rust_tests)
from grpo_core.config import SandboxConfig
from sandbox.types import Limits, RunOutput
from sandbox_support import listening_socket, need_bwrap, need_docker


@pytest.fixture(scope="module", params=["docker", "local"])
def sandbox(request) -> SandboxConfig:
    """The run's sandbox settings, as a run passes them: each test runs on both backends."""
    need_docker() if request.param == "docker" else need_bwrap()
    return SandboxConfig(backend=request.param)


@pytest.fixture()
def short_limits(monkeypatch):
    """Tool calls with a 2 s time limit (the default is 10 s)."""
    def limits(language: str) -> Limits:
        lim = Limits.for_language(language)
        lim.timeout_s, lim.output_bytes = 2.0, code_tools.TOOL_OUTPUT_BYTES
        return lim
    monkeypatch.setattr(code_tools, "_tool_limits", limits)


# -- the tools' contract (no sandbox needed) ----------------------------------------------------------------

def test_tools_have_the_names_signatures_and_docstrings_the_model_sees():
    py, rs = python_tool(), rust_tool()
    assert py.__name__ == "python" and rs.__name__ == "rust"
    for fn in (py, rs, RustFix().check):
        sig = inspect.signature(fn)
        assert list(sig.parameters) == ["code"] and sig.parameters["code"].annotation in (str, "str")
        assert sig.return_annotation in (str, "str")
        assert "Args:\n" in fn.__doc__ and "code:" in fn.__doc__
    assert py.__doc__.startswith("Run a Python 3 program in an isolated sandbox and return what it printed.")
    assert RustFix.check.__doc__.startswith("Compile the Rust code and run the task's example tests")
    env = rust_fix_environment()()
    assert isinstance(env, RustFix) and env.get_reward() == 0.0    # not reset, nothing checked


def test_output_text_says_what_happened():
    assert output_text(RunOutput("ok", 0, "3\n")) == "3"
    assert output_text(RunOutput("ok", 0)) == "(the program printed nothing)"
    text = output_text(RunOutput("error", 1, "a\n", "Traceback...\nValueError: x\n", "exit status 1"))
    assert text == "a\n[stderr]\nTraceback...\nValueError: x\n[error: exit status 1]"
    assert "not the program" in output_text(RunOutput("infra_error", detail="engine down"))


# -- python ---------------------------------------------------------------------------------------------------

def test_python_tool_prints(sandbox):
    out = python_tool(sandbox)("import sys\nprint(sum(range(10)))\nprint(__name__)\nprint('warn', file=sys.stderr)")
    assert out == "45\n__main__\n[stderr]\nwarn"


def test_python_tool_takes_a_fenced_block_and_shows_errors(sandbox):
    assert python_tool(sandbox)("```python\nprint(6 * 7)\n```") == "42"
    out = python_tool(sandbox)("print('before')\n1 / 0\n")
    assert out.startswith("before\n[stderr]\nTraceback") and "ZeroDivisionError" in out
    assert out.endswith("[error: exit status 1]")


def test_python_tool_times_out(sandbox, short_limits):
    t0 = time.monotonic()
    out = python_tool(sandbox)("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                               "print('started', flush=True)\ntime.sleep(3600)\n")
    assert out.startswith("started") and "[timeout: time limit 2s exceeded" in out
    assert time.monotonic() - t0 < 15


def test_python_tool_has_no_network(sandbox):
    srv, hits = listening_socket()
    port = srv.getsockname()[1]
    out = python_tool(sandbox)(
        "import socket\n"
        f"for host, port in (('127.0.0.1', {port}), ('172.17.0.1', {port}), ('1.1.1.1', 80)):\n"
        "    try:\n        socket.create_connection((host, port), timeout=2).close()\n        print('reached', host)\n"
        "    except OSError as e:\n        print('blocked', host)\n")
    srv.close()
    assert "reached" not in out and out.count("blocked") == 3, out
    assert not hits


def test_python_tool_root_is_read_only(sandbox, tmp_path):
    out = python_tool(sandbox)(
        f"for path in ('/etc/grpo-probe', '/usr/grpo-probe', '/grpo-probe', {str(tmp_path / 'x')!r}):\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('refused', path)\n"
        "open('/tmp/scratch', 'w').write('ok')\nprint('tmp ok')\n")
    assert "wrote" not in out and out.count("refused") == 4 and "tmp ok" in out, out
    assert not (tmp_path / "x").exists()


def test_python_tool_memory_is_capped(sandbox):
    out = python_tool(sandbox)("x = bytearray(2 << 30)\nprint('allocated', len(x))\n")
    assert "allocated" not in out
    assert "MemoryError" in out or "out of memory" in out, out


def test_python_tool_contains_a_fork_bomb(sandbox, short_limits):
    t0 = time.monotonic()
    out = python_tool(sandbox)("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert "[timeout" in out or "[error" in out, out
    assert time.monotonic() - t0 < 30
    assert python_tool(sandbox)("print('still here')") == "still here"


# -- rust -------------------------------------------------------------------------------------------------------

def test_rust_tool_runs_a_program(sandbox):
    out = rust_tool(sandbox)('fn main() {\n    let v: Vec<u64> = (1..=10).collect();\n'
                             '    println!("{}", v.iter().sum::<u64>());\n}\n')
    assert out == "55"


def test_rust_tool_returns_compile_errors_as_text(sandbox):
    out = rust_tool(sandbox)('fn main() {\n    let x: i32 = "text";\n    println!("{}", x);\n}\n')
    assert "error[E0308]" in out and "src/main.rs:2:" in out and "mismatched types" in out
    assert out.endswith("[error: compile error]")
    forbidden = rust_tool(sandbox)('#![allow(unsafe_code)]\n'
                                   'fn main() { let p = &1 as *const i32; println!("{}", unsafe { *p }); }')
    assert "unsafe" in forbidden and forbidden.endswith("[error: compile error]")


# -- rust_fix --------------------------------------------------------------------------------------------------

VISIBLE_TEST = "#[test]\nfn sums_three() { assert_eq!(sum_to(3), 6); }\n"
HIDDEN_TESTS = {
    "hidden_empty_range_q7": "#[test]\nfn hidden_empty_range_q7() { assert_eq!(sum_to(0), 0); }\n",
    "hidden_large_n_z4": "#[test]\nfn hidden_large_n_z4() { assert_eq!(sum_to(1000), 500500); }\n",
}
# A HumanEval-Rust-style task (gen_rust / humaneval_rust write the same format): helpers, a test module.
TASK = dict(id="rust_fix/sum_to", kind="rust", source="test", entry_point="sum_to", license="MIT",
            prompt="Write `pub fn sum_to(n: u64) -> u64`: the sum 1 + 2 + ... + n.",
            tests={"format": "rust", "tests": "#[cfg(test)]\nmod tests {\n    use super::*;\n\n"
                   + VISIBLE_TEST + "\n" + "\n".join(HIDDEN_TESTS.values()) + "}\n"},
            answer=None, reference_solution=None, difficulty=None, provenance="", meta={})

CORRECT = "pub fn sum_to(n: u64) -> u64 {\n    (1..=n).sum()\n}\n"
VISIBLE_ONLY = "pub fn sum_to(n: u64) -> u64 {\n    if n == 3 { 6 } else { 1 }\n}\n"
WRONG = "pub fn sum_to(n: u64) -> u64 {\n    n * n\n}\n"
BROKEN = "pub fn sum_to(n: u64) -> u64 {\n    (1..=n).sum() +\n}\n"
SNOOPING = ('pub fn sum_to(n: u64) -> u64 {\n    for p in ["/tmp", "main.rs", "../main.rs"] {\n'
            '        if let Ok(s) = std::fs::read_to_string(p) { println!("{}", s); }\n'
            '        if let Ok(d) = std::fs::read_dir(p) { for e in d.flatten() { println!("{:?}", e.path()); } }\n'
            '    }\n    n * n\n}\n')


def _no_hidden_test_in(text: str) -> None:
    for name, source in HIDDEN_TESTS.items():
        assert name not in text, text
        assert source.strip() not in text and "500500" not in text and "sum_to(0)" not in text, text


def test_split_is_deterministic_and_keeps_the_hidden_tests_apart():
    split = split_rust_tests(TASK["tests"])
    assert [name for name, _ in split.visible] == ["tests::sums_three"]
    assert "sums_three" in split.visible_src and "mod tests" in split.visible_src
    _no_hidden_test_in(split.visible_src)
    assert all(name in split.hidden_src for name in HIDDEN_TESTS) and "sums_three" not in split.hidden_src
    assert split_rust_tests(TASK["tests"]) == split


@pytest.mark.parametrize("n, shown", [(1, 0), (2, 1), (3, 1), (4, 2), (6, 2), (7, 3)])
def test_split_shows_the_first_third(n, shown):
    src = "".join(f"#[test]\nfn t{i}() {{ assert!(f({i})); }}\n" for i in range(n))
    split = split_rust_tests({"format": "rust", "tests": src})
    assert [name for name, _ in split.visible] == [f"t{i}" for i in range(shown)]
    assert (split.visible_src is None) == (shown == 0)
    assert [f"fn t{i}()" in split.hidden_src for i in range(n)] == [n == 1 or i >= shown for i in range(n)]


def test_split_takes_the_tasks_own_visible_tests():
    src = "#[test]\nfn a() { assert!(f(1)); }\n#[test]\nfn b() { assert!(f(2)); }\n"
    by_name = split_rust_tests({"format": "rust", "tests": src, "visible": ["b"]})
    assert [n for n, _ in by_name.visible] == ["b"] and "fn a()" in by_name.hidden_src and "fn b" not in by_name.hidden_src
    shown = "#[test]\nfn example() { assert!(f(0)); }\n"
    by_source = split_rust_tests({"format": "rust", "tests": src, "visible": shown})
    assert by_source.visible_src == shown and by_source.hidden_src == src


def test_reset_says_how_to_use_check_and_shows_only_the_visible_tests():
    env = rust_fix_environment()()
    text = env.reset(**TASK)
    assert "check tool" in text and "sums_three" in text
    _no_hidden_test_in(text)
    single = env.reset(**{**TASK, "tests": {"format": "rust", "tests": HIDDEN_TESTS["hidden_large_n_z4"]}})
    assert "no example tests" in single
    _no_hidden_test_in(single)


def test_a_report_shows_failing_visible_tests_only():
    from sandbox.types import StageResult, TestResult, Verdict
    stages = {s: StageResult(s, "pass") for s in ("build", "clippy", "test")}
    v = Verdict("fail", tests=[TestResult("tests::sums_three", False, "panicked or returned Err")], stages=stages,
                stderr="thread 'main' panicked at /tmp/job-0a1b/main.rs:3:5:\nassertion failed")
    split = TestSplit([("tests::sums_three", VISIBLE_TEST)], VISIBLE_TEST, "")
    text = check_report(v, split)
    assert text.startswith("example tests: 0 of 1 passed\nFAILED tests::sums_three") and "main.rs:3:5" in text


@pytest.fixture(scope="module")
def episodes(sandbox):
    """For each code: (texts reset and check returned, the reward), one rust_fix episode each."""
    results = {}
    for name, code in [("correct", CORRECT), ("visible_only", VISIBLE_ONLY), ("wrong", WRONG), ("broken", BROKEN),
                       ("snooping", SNOOPING)]:
        env = rust_fix_environment(sandbox)()
        texts = [env.reset(**TASK), env.check(code)]
        results[name] = (texts, env.get_reward())
    return results


def test_rust_fix_rewards_the_hidden_tests(episodes):
    assert episodes["correct"][1] == 1.0
    assert "example tests: 1 of 1 passed" in episodes["correct"][0][1]
    assert "example tests: 1 of 1 passed" in episodes["visible_only"][0][1]
    assert 0.0 < episodes["visible_only"][1] < 1.0          # builds, lints, passes no hidden test
    assert episodes["wrong"][1] < 1.0 and "0 of 1 passed" in episodes["wrong"][0][1]
    assert episodes["broken"][1] == 0.0 and episodes["broken"][0][1].startswith("compile error:")
    assert "src/lib.rs:3:" in episodes["broken"][0][1]        # the code's own line numbers


def test_no_hidden_test_ever_shows_in_what_the_model_is_told(episodes):
    for texts, _ in episodes.values():
        for text in texts:
            _no_hidden_test_in(text)


def test_rust_fix_with_a_single_test_checks_the_build_only(sandbox):
    env = rust_fix_environment(sandbox)()
    env.reset(**{**TASK, "tests": {"format": "rust", "tests": HIDDEN_TESTS["hidden_large_n_z4"]}})
    text = env.check(f"```rust\n{CORRECT}```")
    assert text == "no example tests; compiles cleanly"
    assert env.get_reward() == 1.0
    broken = env.check(BROKEN)
    assert broken.startswith("compile error:") and env.get_reward() == 0.0
    for t in (text, broken):
        _no_hidden_test_in(t)
