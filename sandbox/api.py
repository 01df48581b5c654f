"""Public API of the sandbox: jobs in, verdicts out; programs in, their output out.

The sandbox runs untrusted (model-written) code against hidden tests and returns a verdict, or runs a
whole program (a tool call) and returns what it printed. It knows nothing about GRPO, rewards or datasets.

Calling it
----------
    from sandbox.types import Job
    from sandbox.api import score_batch
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

``run_programs(programs, backend="auto", workers=None, images=None) -> list[RunOutput]`` runs whole
programs (``run_program(program, ...)`` one): ``Program(language, code, stdin="", limits=None)``.
Python runs the code as a script (``__main__``, standard library); Rust compiles it as a binary crate
(``fn main``, std only, no dependencies, offline, ``unsafe`` forbidden) and runs it. The same boxes and
limits as scoring: no network, read-only root, fresh state, ``timeout_s`` for the run (Rust:
``build_timeout_s`` for the compiler), memory, pids, and ``output_bytes`` per stream (a cut stream ends
with ``...[truncated]`` and the program is stopped). ``RunOutput.status``: ``ok`` (exit status 0),
``error`` (non-zero exit, crash, out of memory, output limit, or a Rust compile error whose messages
are in ``stderr``), ``timeout``, ``infra_error`` (the sandbox failed, not the program).

``backend``: ``"docker"`` (containers; needs an engine and the images from
``python -m sandbox.images build``), ``"local"`` (bubblewrap namespaces + rlimits; weaker, warns
loudly; refuses where bubblewrap is not usable), ``"auto"`` (docker when an engine answers and the
images exist, else local), or ``"unisolated"`` (rlimits alone on this host: only for code you trust,
asked for by name, never a fallback). A caller that names none (library use; a run names its config's ``sandbox.backend``)
gets ``$GRPO_SANDBOX_BACKEND``, else ``"auto"``: :func:`default_backend_name`, the one place it is read.

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
   optional for Rust. Optional ``"signature": "pub fn add(a: i32, b: i32) -> i32"`` (after any
   ``use`` lines its types need): the completion's function of that name must take as many arguments
   and return that type, or the test binary does not build (``rust_harness.signature_pin``).

Verdict statuses
----------------
``pass`` every test passed; ``fail`` ran, some test failed or a result was missing;
``timeout`` a wall-clock limit was hit; ``error`` the code could not run (syntax/compile error,
crash, out of memory, output limit, entry point missing); ``infra_error`` the sandbox itself
failed (engine down, image missing, malformed task) — callers must NOT turn it into a reward,
they should retry or drop the sample. While a backend's engine is down (its jobs' error is
``sandbox.backends.EngineUnavailable``), ``get_backend(...).check_engine()`` raises that error: retry
later rather than drop every sample.

Code that exits or crashes before its tests run (``sys.exit(0)`` or a crash while the module
loads, a Rust compile error) is an ``error`` on purpose: no test ran, so nothing passed, whatever
the exit code says. Code that exits inside a test (``os._exit(0)`` in the function,
``std::process::exit`` in Rust) is a ``fail``: that test and the ones after it never reported.
``Verdict.passed`` counts only tests that reported a pass.

Rust code is compiled as the library crate ``solution`` (version 0.1.0) with the environment
Cargo sets for one (``CARGO_PKG_NAME``, ``CARGO_PKG_VERSION*``, ``CARGO_CRATE_NAME``, and
``CARGO_MANIFEST_DIR`` pointing at a read-only directory with a generated ``Cargo.toml`` and
``src/lib.rs``), so ``env!("CARGO_...")`` in code written for Cargo builds here too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from sandbox.types import LANGUAGES, Job, Program, RunOutput, TaskFormatError, Verdict

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


_BACKENDS: dict[str, Any] = {}


def default_backend_name() -> str:
    """The backend of a call that names none: ``$GRPO_SANDBOX_BACKEND`` (auto|docker|local|unisolated), else
    ``"auto"``."""
    return os.environ.get("GRPO_SANDBOX_BACKEND") or "auto"


def resolve_backend(name: str | None = None, images: dict[str, str] | None = None) -> str:
    """The backend a name stands for here: ``"auto"`` is ``"docker"`` when an engine answers and the images exist,
    else ``"local"``; the others are themselves (None: :func:`default_backend_name`). Builds no backend."""
    name = name or default_backend_name()
    if name not in BACKEND_NAMES:
        raise ValueError(f"sandbox backend {name!r} (sandbox.backend, or $GRPO_SANDBOX_BACKEND): use 'auto', "
                         f"'docker', 'local' or 'unisolated'")
    if name == "auto":
        from sandbox.docker_backend import docker_available
        return "docker" if docker_available(images) else "local"
    return name


def get_backend(name: str | None = None, images: dict[str, str] | None = None):
    """Return a backend object: ``"docker"``, ``"local"``, ``"auto"`` or ``"unisolated"`` (None:
    :func:`default_backend_name`); ``"local"``, and ``"auto"`` without Docker, raise ``NoIsolation`` (saying how to
    fix it) where bubblewrap is not usable.
    ``images``: language -> Docker image, overriding ``sandbox.images.IMAGES`` for those languages. Instances
    are shared (their warm containers are reused across calls)."""
    auto = (name or default_backend_name()) == "auto"
    name = resolve_backend(name, images)
    key = (name, tuple(sorted((images or {}).items()))) if name == "docker" and images else name
    cached = _BACKENDS.get(key)
    if cached is None or getattr(cached, "pid", os.getpid()) != os.getpid():  # new after fork
        if name == "docker":
            from sandbox.docker_backend import DockerBackend
            from sandbox.images import IMAGES
            _BACKENDS[key] = DockerBackend({**IMAGES, **(images or {})})
        else:
            from sandbox.local_backend import LocalBackend, NoIsolation
            try:
                _BACKENDS[key] = LocalBackend(use_bwrap=False if name == "unisolated" else None)
            except NoIsolation as e:
                raise NoIsolation(f"sandbox backend auto: no Docker engine with the images answers; {e}"
                                  if auto else f"sandbox backend local: {e}") from None
    return _BACKENDS[key]


BACKEND_NAMES = ("auto", "docker", "local", "unisolated")


def score_batch(jobs: Sequence[Job], backend: Any = "auto", workers: int | None = None,
                images: dict[str, str] | None = None) -> list[Verdict]:
    """Run ``jobs`` concurrently; return one :class:`Verdict` per job, in the same order.

    ``backend``: a name (``"auto"``, ``"docker"``, ``"local"``) or a backend object from
    :func:`get_backend` (reuse one across calls to keep its warm containers).
    ``workers``: concurrent runs (default: CPU count). ``images``: see :func:`get_backend`.
    """
    be = get_backend(backend, images) if isinstance(backend, str) or backend is None else backend
    return be.score_batch(list(jobs), workers=workers)


def score(job: Job, backend: Any = "auto") -> Verdict:
    """Run one job; see :func:`score_batch`."""
    return score_batch([job], backend=backend, workers=1)[0]


def run_programs(programs: Sequence[Program], backend: Any = "auto", workers: int | None = None,
                 images: dict[str, str] | None = None) -> list[RunOutput]:
    """Run whole programs concurrently; return one :class:`RunOutput` per program, in the same order.
    ``backend``, ``workers`` and ``images`` as for :func:`score_batch`."""
    be = get_backend(backend, images) if isinstance(backend, str) or backend is None else backend
    return be.run_batch(list(programs), workers=workers)


def run_program(program: Program, backend: Any = "auto", images: dict[str, str] | None = None) -> RunOutput:
    """Run one program; see :func:`run_programs`."""
    return run_programs([program], backend=backend, workers=1, images=images)[0]


def rust_test_items(tests_src: str) -> list[tuple[str, str]]:
    """The ``#[test]`` functions of a Rust tests source, in order: ``(name as verdicts give it, e.g.
    "tests::small", its source text with the attributes and comment lines right above it)``. Raises
    :class:`TaskFormatError` when the source has none or cannot be cut into them."""
    from sandbox import rust_harness
    rust_harness.validate_tests({"format": "rust", "tests": tests_src})
    return [(path, tests_src[start:end]) for path, start, end in rust_harness.test_spans(tests_src)]


def select_rust_tests(tests_src: str, keep: Sequence[str]) -> str:
    """``tests_src`` without the ``#[test]`` functions not named in ``keep`` (their attributes and the
    comments right above them go too); helpers, ``use`` lines and modules stay. Raises
    :class:`TaskFormatError` when the source cannot be cut so."""
    from sandbox import rust_harness
    return rust_harness.select_tests(tests_src, set(keep))


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
