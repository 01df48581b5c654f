"""Code tools: the sandbox as something the model calls during a rollout (as grpo_core/rewards/code_rewards.py is
the sandbox as a judge).

* :func:`python_tool` -> ``python(code) -> str``: run a Python program, return what it printed.
* :func:`rust_tool` -> ``rust(code) -> str``: compile and run a Rust program, return the compiler's
  errors or what it printed.
* :func:`rust_fix_environment` -> a factory of :class:`RustFix` (TRL's ``environment_factory``
  contract): ``reset(**task)``, the tool ``check(code)`` that runs the task's *visible* tests, and
  ``get_reward()`` that runs the *hidden* ones on the last code checked.

A tool call runs in the same boxes, with the same isolation and limits, as scoring (see ``sandbox.api``);
a sandbox failure is said as such in the tool's text, never blamed on the code. Not here: the tool
registry, the ``Tool`` type and tool-call parsing (grpo_core.rollout.tools), the rollout loop (grpo_core.rollout.multiturn).

Visible and hidden tests of a Rust task (``tests = {"format": "rust", "tests": ...}``): the task's own
``tests["visible"]`` (Rust source of example tests, or a list of test names) when it has it; else the
first ``ceil(n / 3)`` of its ``n`` ``#[test]`` functions, and none when it has just one (the examples in
the prompt are all it shows). Hidden: the rest (all of them, if nothing is left). Nothing ``reset`` or
``check`` returns comes from running hidden tests: ``check`` runs a job that holds the visible ones only.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from grpo_core.rewards.code_rewards import extract_code, verdict_reward

TOOL_OUTPUT_BYTES = 4096        # per stream: a tool's text goes back into the model's context
BUILD_ONLY_TEST = "#[test]\nfn builds() {}\n"     # a task with no visible test: check only builds the code
REPORT_CHARS = 2000             # panic messages and prints in one check report


# -- the run's sandbox settings ---------------------------------------------------------------------------

def _setting(sandbox: Any, name: str) -> Any:
    """A field of a SandboxConfig (or of the same settings as a dict); None for no settings."""
    if sandbox is None:
        return None
    return sandbox.get(name) if isinstance(sandbox, Mapping) else getattr(sandbox, name, None)


def _backend(sandbox: Any):
    """The shared backend object for these settings (as code_rewards.score_code picks it)."""
    from sandbox.api import get_backend
    return get_backend(_setting(sandbox, "backend"), dict(_setting(sandbox, "images") or {}) or None)


def _tool_limits(language: str):
    """Scoring's limits, with less output (it goes into the context) and, for Rust, a compile time that
    fits a tool call's own time limit (grpo_core.rollout.multiturn.Toolbox.timeout) together with the run."""
    from sandbox.types import Limits
    limits = Limits.for_language(language)
    limits.output_bytes = TOOL_OUTPUT_BYTES
    limits.build_timeout_s = min(limits.build_timeout_s, 20.0)
    return limits


def _once_more_on_infra_error(call: Callable[[], Any]) -> Any:
    result = call()
    return call() if result.status == "infra_error" else result


def _code_argument(code: Any, language: str) -> str:
    """The code a tool was given; a fenced block is unwrapped (models often send one)."""
    code = code if isinstance(code, str) else ""
    return (extract_code(code, language) or code) if "```" in code else code


# -- python and rust: run a program -------------------------------------------------------------------------

def run_code(language: str, code: str, sandbox: Any = None) -> str:
    """Run a whole program in the sandbox and return its output as a tool's text (:func:`output_text`)."""
    from sandbox.api import run_program
    from sandbox.types import Program
    program = Program(language, _code_argument(code, language), limits=_tool_limits(language))
    backend = _backend(sandbox)
    return output_text(_once_more_on_infra_error(lambda: run_program(program, backend=backend)))


def output_text(out) -> str:
    """What a tool call shows the model: stdout; stderr under a marker; a status line unless it went well."""
    parts = [out.stdout.rstrip("\n")] if out.stdout.strip() else []
    if out.stderr.strip():
        parts.append("[stderr]\n" + out.stderr.rstrip("\n"))
    if out.status == "infra_error":
        parts.append(f"[the sandbox failed, not the program: {out.detail}. Try again.]")
    elif out.status != "ok":
        parts.append(f"[{out.status}: {out.detail}]")
    return "\n".join(parts) if parts else "(the program printed nothing)"


def python_tool(sandbox: Any = None) -> Callable[[str], str]:
    """The ``python`` tool. ``sandbox``: the run's SandboxConfig (backend, images), or None for defaults."""
    def python(code: str) -> str:
        """Run a Python 3 program in an isolated sandbox and return what it printed.

        Args:
            code: the complete program; print the values you want to see.
        """
        return run_code("python", code, sandbox)
    return python


def rust_tool(sandbox: Any = None) -> Callable[[str], str]:
    """The ``rust`` tool. ``sandbox``: the run's SandboxConfig (backend, images), or None for defaults."""
    def rust(code: str) -> str:
        """Compile and run a Rust program (fn main, std only) in a sandbox; return compiler errors or what it printed.

        Args:
            code: the complete program with fn main; print the values you want to see.
        """
        return run_code("rust", code, sandbox)
    return rust


# -- rust_fix: visible tests to check against, hidden tests for the reward ----------------------------------

@dataclass
class TestSplit:
    """A Rust task's tests, cut in two. ``visible_src`` is None when there is no visible test."""
    __test__ = False  # not a pytest class
    visible: list[tuple[str, str]]      # (name, source) of each visible test
    visible_src: str | None             # the tests source the check tool runs
    hidden_src: str                     # the tests source the reward runs


def split_rust_tests(tests: Any) -> TestSplit:
    """Visible and hidden tests of a Rust task (rules in the module docstring). Deterministic."""
    from sandbox.api import rust_test_items, select_rust_tests
    from sandbox.types import TaskFormatError
    if not isinstance(tests, dict) or tests.get("format") != "rust" or not isinstance(tests.get("tests"), str):
        raise ValueError("rust_fix needs a Rust task: tests = {'format': 'rust', 'tests': '<#[test] fns>'}")
    src, given = tests["tests"], tests.get("visible")
    try:
        items = rust_test_items(src)
        if isinstance(given, str) and given.strip():
            shown_items = rust_test_items(given)
            shown = {name for name, _ in shown_items}
            hidden = [name for name, _ in items if name not in shown]
            return TestSplit(shown_items, given, select_rust_tests(src, hidden) if hidden else src)
        names = [name for name, _ in items]
        if isinstance(given, (list, tuple)):
            shown = [n for n in names if n in set(given)]
        else:
            shown = names[:0 if len(names) == 1 else math.ceil(len(names) / 3)]
        hidden = [n for n in names if n not in shown]
        if not shown or not hidden:
            return TestSplit([], None, src)
        return TestSplit([it for it in items if it[0] in shown], select_rust_tests(src, shown),
                         select_rust_tests(src, hidden))
    except TaskFormatError:         # a source we cannot cut: everything stays hidden
        return TestSplit([], None, src)


def usage_text(split: TestSplit) -> str:
    """What ``reset`` appends to the question: how to use the tool, and the example tests it runs."""
    text = "Use the check tool to compile your code and run the example tests before you answer."
    if not split.visible:
        return text + " This task has no example tests: check compiles your code and runs the lint gate."
    shown = "\n\n".join(source.strip("\n") for _, source in split.visible)
    if len(shown) > REPORT_CHARS:
        return text + " Its example tests: " + ", ".join(name for name, _ in split.visible) + "."
    return text + f" It runs these example tests (hidden tests decide your score):\n```rust\n{shown}\n```"


_BOX_PATH = re.compile(r"/tmp/job-[0-9a-f]+/(?:crate/)?")


def _clip(text: str, limit: int = REPORT_CHARS) -> str:
    """``text`` cut to ``limit`` characters, the box's scratch paths shortened (``src/lib.rs:3:5``)."""
    text = _BOX_PATH.sub("", text).strip("\n")
    return text if len(text) <= limit else text[:limit] + "\n...[truncated]"


def check_report(verdict, split: TestSplit) -> str:
    """The check tool's text for the verdict of the visible tests: the build, the lint gate, each test."""
    if verdict.status == "infra_error":
        return f"[the sandbox failed, not your code: {verdict.detail}. Try again.]"
    build, clippy, test = (verdict.stages.get(s) for s in ("build", "clippy", "test"))
    if build is None or build.status != "pass":
        if build is not None and build.status == "timeout":
            return "compile error: the compiler ran out of time"
        return "compile error:\n" + _clip(build.detail if build is not None else verdict.detail)
    lines = []
    if clippy is not None and clippy.status != "pass":
        lines.append("compiles, but the lint gate (clippy, -F clippy::all) fails:\n" + _clip(clippy.detail))
    if not split.visible:
        return "\n".join(lines or ["no example tests; compiles cleanly"])
    if test is not None and test.status == "error":
        lines.append("the example tests do not build against your code (names or signatures differ):\n"
                     + _clip(test.detail))
        return "\n".join(lines)
    lines.append(_tests_report(verdict, test))
    return "\n".join(lines)


def _tests_report(verdict, test) -> str:
    lines = [f"example tests: {verdict.passed} of {verdict.total} passed"]
    if test is not None and test.status == "timeout":
        lines.append("[timeout: the example tests ran out of time]")
    lines += [f"FAILED {t.name}: {t.detail}" for t in verdict.tests if not t.passed]
    printed = "\n".join(line for line in verdict.stdout.splitlines() if not line.startswith("<nonce> "))
    if printed.strip():
        lines.append("[stdout]\n" + _clip(printed))
    if verdict.stderr.strip() and verdict.passed < verdict.total:
        lines.append("[stderr]\n" + _clip(verdict.stderr))
    return "\n".join(lines)


class RustFix:
    """One rollout of a Rust task as an environment (TRL's contract): ``reset`` takes the task's fields,
    ``check`` is the tool, ``get_reward`` scores the episode on the hidden tests. See the module docstring."""

    def __init__(self, sandbox: Any = None):
        self._sandbox = sandbox
        self._split: TestSplit | None = None
        self._last_code: str | None = None

    def reset(self, **task_fields) -> str | None:
        """Start an episode of the task whose fields (grpo_core.task.Task's) are given; -> how to use check."""
        self._split = split_rust_tests(task_fields.get("tests"))
        self._last_code = None
        return usage_text(self._split)

    def check(self, code: str) -> str:
        """Compile the Rust code and run the task's example tests; returns compiler errors and failing asserts.

        Args:
            code: the complete solution: the function(s) the task asks for, made pub, with any use lines.
        """
        if self._split is None:
            return "[no task: the environment was not reset]"
        self._last_code = _code_argument(code, "rust")
        verdict = self._score(self._last_code, self._split.visible_src or BUILD_ONLY_TEST)
        return check_report(verdict, self._split)

    def get_reward(self) -> float | None:
        """The hidden tests' reward for the last code given to ``check`` (0.0 if none; the sandbox's
        ``reward_mode`` and Rust's staged weights, as scoring). None: the sandbox failed, leave it out."""
        if self._split is None or not (self._last_code or "").strip():
            return 0.0
        verdict = self._score(self._last_code, self._split.hidden_src)
        return verdict_reward(verdict, _setting(self._sandbox, "reward_mode") or "fraction")

    def _score(self, code: str, tests_src: str):
        from sandbox.api import score_batch
        from sandbox.types import Job
        job = Job("rust", code, {"format": "rust", "tests": tests_src})      # scoring's own limits
        backend = _backend(self._sandbox)
        return _once_more_on_infra_error(lambda: score_batch([job], backend=backend, workers=1)[0])


def rust_fix_environment(sandbox: Any = None) -> Callable[[], RustFix]:
    """A zero-argument factory of :class:`RustFix` (TRL's ``environment_factory``). ``sandbox``: the run's
    SandboxConfig (backend, images, reward_mode), or None for defaults."""
    def make() -> RustFix:
        return RustFix(sandbox)
    return make
