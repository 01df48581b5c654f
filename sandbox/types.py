"""The sandbox's value types: a `Job` (code + hidden tests + `Limits`) goes in, a `Verdict` (with
per-test `TestResult`s and per-stage `StageResult`s) comes out; a `Program` (code + stdin) goes in, a
`RunOutput` (what it printed) comes out. Plain dataclasses, no behaviour beyond (de)serialising: every
other sandbox module imports them, and they import nothing back. The meaning of each status is
documented in `sandbox.api`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("pass", "fail", "timeout", "error", "infra_error")
RUN_STATUSES = ("ok", "error", "timeout", "infra_error")
LANGUAGES = ("python", "rust")


class TaskFormatError(ValueError):
    """The task's ``tests`` dict is malformed; the message names the field and the fix."""


@dataclass
class Limits:
    """Resource limits for one job. Defaults fit small function-level tasks.

    ``timeout_s`` bounds the Python run (all cases) and a program's run; Rust scoring uses the three
    stage limits, a Rust program ``build_timeout_s`` to compile it.
    ``memory_mb`` is a hard cap with no swap; ``output_bytes`` caps captured stdout/stderr each.
    """
    timeout_s: float = 10.0
    memory_mb: int = 512
    pids: int = 64
    output_bytes: int = 16_384
    tmpfs_mb: int = 64
    cpus: float = 1.0
    build_timeout_s: float = 60.0
    clippy_timeout_s: float = 60.0
    test_timeout_s: float = 20.0

    @classmethod
    def for_language(cls, language: str) -> "Limits":
        if language == "rust":
            return cls(memory_mb=1536, pids=256, tmpfs_mb=512, output_bytes=16_384)
        return cls()


@dataclass
class Job:
    """One completion to run against hidden tests.

    ``code``: the completion's source only (already extracted from the model's text).
    ``tests``: one of the formats in the module docstring. ``entry_point``: function name (Python).
    """
    language: str
    code: str
    tests: dict[str, Any]
    entry_point: str | None = None
    limits: Limits | None = None
    id: str = ""

    def effective_limits(self) -> Limits:
        return self.limits or Limits.for_language(self.language)


@dataclass
class TestResult:
    """One test: an io case, one executed assert, or one Rust ``#[test]`` fn."""
    __test__ = False  # not a pytest class
    name: str
    passed: bool
    detail: str = ""            # e.g. "expected 3 (int), got '3' (str)" or a panic message
    duration_s: float | None = None


@dataclass
class StageResult:
    """One Rust stage (build, clippy, test) with its own time limit."""
    name: str
    status: str                 # pass | fail | timeout | error | skipped
    duration_s: float = 0.0
    detail: str = ""            # truncated compiler / clippy output


@dataclass
class Verdict:
    status: str
    tests: list[TestResult] = field(default_factory=list)
    stages: dict[str, StageResult] = field(default_factory=dict)
    detail: str = ""            # human-readable reason for non-pass statuses
    stdout: str = ""            # truncated, for debugging only (never parsed for results)
    stderr: str = ""
    duration_s: float = 0.0
    backend: str = ""
    job_id: str = ""

    @property
    def passed(self) -> int:
        return sum(1 for t in self.tests if t.passed)

    @property
    def total(self) -> int:
        return len(self.tests)

    @property
    def pass_fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(passed=self.passed, total=self.total, pass_fraction=self.pass_fraction)
        return d


def infra_error(detail: str, job_id: str = "", backend: str = "") -> Verdict:
    return Verdict(status="infra_error", detail=detail, job_id=job_id, backend=backend)


@dataclass
class Program:
    """A whole program to run (a tool call): Python runs as a script (``__main__``), Rust is compiled
    as a binary crate (``fn main``, std only, ``unsafe`` forbidden) and then run. ``stdin``: its input."""
    language: str
    code: str
    stdin: str = ""
    limits: Limits | None = None
    id: str = ""

    def effective_limits(self) -> Limits:
        return self.limits or Limits.for_language(self.language)


@dataclass
class RunOutput:
    """What a program printed. ``status``: ``ok`` (exit status 0), ``error`` (non-zero exit, crash,
    compile error, out of memory, output limit), ``timeout`` or ``infra_error`` (the sandbox failed, not
    the program). ``stdout`` / ``stderr`` are capped at ``Limits.output_bytes`` each (a cut stream ends
    with ``...[truncated]``); a Rust compile error's messages are in ``stderr``. ``exit_code`` is None
    when the program did not run to its end (compile error, timeout, killed by the sandbox)."""
    status: str
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    detail: str = ""            # why, for every status but ok
    duration_s: float = 0.0
    backend: str = ""
    program_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
