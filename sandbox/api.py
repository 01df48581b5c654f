"""Public API of the sandbox: jobs in, verdicts out.

The sandbox runs untrusted (model-written) code against hidden tests and returns a verdict.
It knows nothing about GRPO, rewards or datasets.

Calling it
----------
    from sandbox.api import Job, score_batch
    verdicts = score_batch([Job(language="python", code=src, tests=tests, entry_point="add")])
    verdicts[0].status        # "pass" | "fail" | "timeout" | "error" | "infra_error"
    verdicts[0].pass_fraction # passed / total (0.0 when total == 0)

``score_batch(jobs, backend="auto", workers=None) -> list[Verdict]`` runs the jobs concurrently
and returns one verdict per job, in order. It never raises for a bad completion; a malformed
*task* (bad ``tests`` dict) becomes a verdict with status ``"infra_error"`` and a ``detail`` that
names the field and the fix (call :func:`validate_tests` up front to get an exception instead).

``check_reference(code, tests, kind, entry_point=None, backend="auto") -> ReferenceCheck`` and
``check_references([(code, tests, kind, entry_point), ...])`` are for dataset curation:
``.passed`` is True iff every hidden test passed (Rust: clippy not required, see
``.clippy_clean``); ``.infra_error`` says the sandbox failed (status unknown, retry later).

``backend``: ``"docker"`` (containers; needs an engine and the images from
``python -m sandbox.images build``), ``"local"`` (subprocess + rlimits + bubblewrap when
available; weaker, warns loudly), or ``"auto"`` (docker when an engine answers and the images
exist, else local). The choice can also be forced with env ``GRPO_SANDBOX_BACKEND``.

The ``tests`` formats (the hidden tests of a task; never shown to the model)
----------------------------------------------------------------------------
1. Python input/output cases::

       {"format": "io",
        "cases": [{"args": [1, 2], "kwargs": {}, "expected": 3}, ...],
        "float_tol": 0.0}              # optional: relative/absolute tolerance for floats

   ``entry_point`` names the function. Each case is one test: the box calls
   ``entry_point(*args, **kwargs)`` and returns the value; the *host* compares it with
   ``expected`` using exact types (``True`` is not ``1``, ``1`` is not ``1.0``; lists and tuples
   compare equal because JSON has no tuple). ``kwargs`` is optional. Values are JSON values.

2. Python HumanEval-style checks::

       {"format": "assert",
        "check": "def check(candidate):\\n    assert candidate(1, 2) == 3\\n ..."}

   The source may have module-level imports/constants (like HumanEval's ``METADATA``) and must
   define ``check(candidate)``. Optional ``"setup": "<source>"``: trusted helpers the check
   uses, run on the host first (for HumanEval pass the ``prompt``: some checks call helpers
   defined there, e.g. ``poly``). Inside the check, the entry point's name is also bound to the
   candidate. ``random`` is seeded identically for planning and judging. The host rewrites every ``assert`` that calls ``candidate`` into
   call/expected pairs: it evaluates the call arguments on the host, sends only the arguments
   into the box, then evaluates each assert on the host with the returned (plain, strictly
   decoded) values. Each executed assert is one test. Checks that use ``candidate`` outside an
   ``assert`` (or nest candidate calls) are rejected by :func:`validate_tests`; convert them to
   ``io`` cases. The check source is trusted task code and runs on the host.

3. Rust::

       {"format": "rust",
        "tests": "#[test]\\nfn adds() { assert_eq!(add(1, 2), 3); }\\n..."}

   The completion's source becomes ``src/lib.rs`` of a harness-owned crate (no dependencies, no
   build script, ``#![forbid(unsafe_code)]``); ``tests`` are ``#[test]`` functions that are
   injected into a harness-generated binary that imports the library with ``use solution::*``.
   Helpers (non-test fns, ``use`` lines) may appear in ``tests`` too. Staged: build -> clippy
   (``-F clippy::all``) -> tests; per-stage results are in ``Verdict.stages``. ``entry_point`` is
   optional for Rust.

Verdict statuses
----------------
``pass`` every test passed; ``fail`` ran, some test failed or a result was missing;
``timeout`` a wall-clock limit was hit; ``error`` the code could not run (syntax/compile error,
crash, out of memory, output limit, entry point missing); ``infra_error`` the sandbox itself
failed (engine down, image missing, malformed task) — callers must NOT turn it into a reward,
they should retry or drop the sample.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

STATUSES = ("pass", "fail", "timeout", "error", "infra_error")
LANGUAGES = ("python", "rust")


class TaskFormatError(ValueError):
    """The task's ``tests`` dict is malformed; the message names the field and the fix."""


@dataclass
class Limits:
    """Resource limits for one job. Defaults fit small function-level tasks.

    ``timeout_s`` bounds the Python run (all cases); Rust uses the three stage limits.
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


def validate_tests(language: str, tests: Any, entry_point: str | None = None) -> None:
    """Raise :class:`TaskFormatError` if ``tests`` is not a valid tests dict for ``language``."""
    from sandbox import python_tests, rust_harness  # local import: keep api import-light
    if language not in LANGUAGES:
        raise TaskFormatError(f"job 'language' is {language!r}; use one of {LANGUAGES}")
    if not isinstance(tests, dict) or "format" not in tests:
        raise TaskFormatError("'tests' must be a dict with a 'format' key ('io', 'assert' or 'rust')")
    if language == "python":
        python_tests.plan(tests, entry_point)   # raises TaskFormatError
    else:
        rust_harness.validate_tests(tests)


def get_backend(name: str | None = None):
    """Return a backend object: ``"docker"``, ``"local"`` or ``"auto"`` (default, or env
    ``GRPO_SANDBOX_BACKEND``)."""
    from sandbox import backends
    return backends.get_backend(name or os.environ.get("GRPO_SANDBOX_BACKEND") or "auto")


def score_batch(jobs: Sequence[Job], backend: Any = "auto", workers: int | None = None) -> list[Verdict]:
    """Run ``jobs`` concurrently; return one :class:`Verdict` per job, in the same order.

    ``backend``: a name (``"auto"``, ``"docker"``, ``"local"``) or a backend object from
    :func:`get_backend` (reuse one across calls to keep its warm containers).
    ``workers``: concurrent runs (default: CPU count).
    """
    be = get_backend(backend) if isinstance(backend, str) or backend is None else backend
    return be.score_batch(list(jobs), workers=workers)


def score(job: Job, backend: Any = "auto") -> Verdict:
    """Run one job; see :func:`score_batch`."""
    return score_batch([job], backend=backend, workers=1)[0]


@dataclass
class ReferenceCheck:
    """Result of running a task's reference solution (dataset curation)."""
    passed: bool                # every hidden test passed (Rust: build ok too; clippy not required)
    detail: str
    clippy_clean: bool | None   # Rust only: the reference passes the -F clippy::all gate
    infra_error: bool           # the sandbox failed: the task's status is unknown, not bad
    verdict: Verdict


def _as_reference_check(v: Verdict) -> ReferenceCheck:
    all_ok = v.total > 0 and v.passed == v.total and v.status in ("pass", "fail")
    clippy = v.stages.get("clippy")
    clippy_clean = None if clippy is None else clippy.status == "pass"
    detail = v.detail
    if not all_ok and not detail:
        detail = "; ".join(f"{t.name}: {t.detail}" for t in v.tests if not t.passed)[:500]
    return ReferenceCheck(passed=all_ok, detail=detail or v.status, clippy_clean=clippy_clean,
                          infra_error=v.status == "infra_error", verdict=v)


def check_references(items: Sequence[tuple[str, dict, str, str | None]], backend: Any = "auto",
                     workers: int | None = None) -> list[ReferenceCheck]:
    """Batch form of :func:`check_reference`: items are (code, tests, kind, entry_point)."""
    jobs = [Job(language=kind, code=code or "", tests=tests or {}, entry_point=ep, id=f"ref{i}")
            for i, (code, tests, kind, ep) in enumerate(items)]
    return [_as_reference_check(v) for v in score_batch(jobs, backend=backend, workers=workers)]


def check_reference(code: str, tests: dict, kind: str, entry_point: str | None = None,
                    backend: Any = "auto") -> ReferenceCheck:
    """Run a reference solution in the sandbox. ``.passed`` is True iff every test passed (a Rust
    reference need not be clippy-clean; see ``.clippy_clean``)."""
    return check_references([(code, tests, kind, entry_point)], backend=backend, workers=1)[0]
