"""Validation: a math answer parses; a code task's reference solution passes its own hidden tests.

Code is run by the sandbox (`sandbox.api`) when it is importable and has an engine, else by the local
reference runner (`localrun`, trusted dataset code only). `backend="sandbox"` insists on the sandbox
and rejects code tasks with `sandbox_unavailable` when it cannot run; `backend="none"` skips running.
"""
from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

from grpo_core.data import formats, localrun
from grpo_core.data.records import Rejection
from grpo_core.task import Task, TaskValidationError
from grpo_core.rewards.answers import parse_number

BACKENDS = ("auto", "sandbox", "local", "none")
Progress = Callable[[int], None]


def math_answer_parses(answer: str, timeout_s: float = 5.0) -> bool:
    """A plain number, or an expression with digits or LaTeX that math-verify can parse (run off the
    main thread, timed here). Free-text answers ("twelve-ish") do not parse."""
    if parse_number(str(answer)) is not None:
        return True
    if not re.search(r"\d|\\[a-zA-Z]+", str(answer)) or re.search(r"[a-zA-Z]{4,}", re.sub(r"\\[a-zA-Z]+", "", str(answer))):
        return False
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        from math_verify import parse  # optional dependency (extra "data")
    except ImportError:
        return bool(re.fullmatch(r"[\s\d\.\-+*/^()a-zA-Z\\{}$,=]+", str(answer)))
    result: list = []
    t = threading.Thread(target=lambda: result.append(parse(f"${answer}$", parsing_timeout=None)), daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(result and result[0])


def check_schema(task: Task) -> Rejection | None:
    try:
        task.validate()
    except TaskValidationError as e:
        return Rejection(task.id or "?", task.source, "invalid_schema", str(e))
    return None


def check_static(task: Task) -> Rejection | None:
    """Checks that need no code execution."""
    bad = check_schema(task)
    if bad:
        return bad
    if task.kind == "math":
        if task.meta.get("checker") in ("reasoning_gym", "verifiers"):
            return None  # reasoning-gym's scorer checked the gold answer at load time; a verifiers task's judges it
        if not math_answer_parses(str(task.answer)):
            return Rejection(task.id, task.source, "answer_unparseable", repr(task.answer)[:80])
        return None
    if not formats.has_nonempty_tests(task.tests):
        return Rejection(task.id, task.source, "empty_tests", f"format {formats.format_of(task.tests)!r}")
    if not task.reference_solution:
        return Rejection(task.id, task.source, "reference_missing")
    return None


# -- running references ------------------------------------------------------------------------------
# A batch checker takes tasks and returns one (passed, detail, clippy_clean, infra_error) per task.
Check = tuple[bool, str, "bool | None", bool]
BatchChecker = Callable[[Sequence[Task]], list[Check]]


def _sandbox_checker(workers: int) -> BatchChecker | None:
    """Reference checks through `sandbox.api.check_references`, or None when the sandbox is absent or cannot
    isolate code here (no Docker, no bubblewrap: the references then go to the local reference runner)."""
    try:
        from sandbox import api  # owned by the sandbox package
        from sandbox.backends import NoIsolation
        check_references = api.check_references
    except Exception:  # noqa: BLE001 - any import failure means "no sandbox"
        return None
    try:
        api.get_backend()
    except NoIsolation:
        return None

    def run(tasks: Sequence[Task]) -> list[Check]:
        items = [(t.reference_solution, t.sandbox_tests(), t.kind, t.entry_point) for t in tasks]
        return [(r.passed, r.detail, r.clippy_clean, r.infra_error)
                for r in check_references(items, workers=workers)]
    return run


def _local_one(task: Task) -> Check:
    tests = task.tests or {}
    if task.kind == "python":
        r = localrun.run_python(task.reference_solution or "", tests, task.entry_point)
        return r.ok, r.detail, None, False
    if tests.get("format") == "rust":
        if not localrun.rust_available():
            return False, "rustc not on PATH", None, True
        r = localrun.run_rust_tests(task.reference_solution or "", tests["tests"])
        clean = localrun.check_rust(task.reference_solution or "", "lib", deny=["clippy::all"])[0] if r.ok else None
        return r.ok, r.detail, clean, False
    return False, f"unknown test format {tests.get('format')!r}", None, False


def _local_checker(workers: int) -> BatchChecker:
    def run(tasks: Sequence[Task]) -> list[Check]:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            return list(pool.map(_local_one, tasks))
    return run


def pick_checker(backend: str, workers: int = 2) -> tuple[BatchChecker | None, str]:
    """(checker, name). checker None means code tasks cannot be run with this backend."""
    if backend not in BACKENDS:
        raise ValueError(f"validation backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if backend == "none":
        return None, "none"
    sb = _sandbox_checker(workers) if backend in ("auto", "sandbox") else None
    if sb is not None:
        return sb, "sandbox"
    if backend == "sandbox":
        return None, "sandbox"
    return _local_checker(workers), "local"


def validate(tasks: Sequence[Task], backend: str = "auto", workers: int = 2,
             progress: Progress | None = None, chunk: int = 32) -> tuple[list[Task], list[Rejection]]:
    """Keep tasks that pass the static checks and whose reference passes its tests (order preserved).

    The curation-only `python_script` format always runs on the local reference runner (the sandbox
    does not score it)."""
    checker, name = pick_checker(backend, workers)
    verdicts: list[Rejection | None] = [check_static(t) for t in tasks]
    if progress:
        progress(sum(1 for t, v in zip(tasks, verdicts) if v is not None or t.kind == "math"))
    code = [i for i, t in enumerate(tasks) if verdicts[i] is None and t.kind != "math"]
    routes: dict[str, tuple[BatchChecker | None, list[int]]] = {
        name: (checker, [i for i in code if (tasks[i].tests or {}).get("format") != "python_script"]),
        "local-script": (_local_checker(workers) if name != "none" else None,
                         [i for i in code if (tasks[i].tests or {}).get("format") == "python_script"])}
    for route, (run, idx) in routes.items():
        _run_route(tasks, verdicts, route, run, idx, name, backend, chunk, progress)
        retry = [i for i in idx if verdicts[i] is not None and verdicts[i].reason == "sandbox_unavailable"]
        if retry and run is not None:   # one more try for infrastructure failures (e.g. engine restarted)
            for i in retry:
                verdicts[i] = None
            _run_route(tasks, verdicts, route, run, retry, name, backend, chunk, None)
    kept = [t for t, v in zip(tasks, verdicts) if v is None]
    return kept, [v for v in verdicts if v is not None]


def _run_route(tasks: Sequence[Task], verdicts: list, route: str, run: BatchChecker | None, idx: list[int],
               name: str, backend: str, chunk: int, progress: Progress | None) -> None:
    """Check the references of tasks[idx] in chunks, writing a Rejection or None into verdicts."""
    for start in range(0, len(idx), chunk):
        part = idx[start:start + chunk]
        if run is None:
            for i in part:
                t = tasks[i]
                if name != "none":
                    verdicts[i] = Rejection(t.id, t.source, "sandbox_unavailable",
                                            f"backend {backend!r} found no sandbox (sandbox.api not importable)")
        else:
            try:
                results = run([tasks[i] for i in part])
            except Exception as e:  # noqa: BLE001 - an infrastructure failure is a reason, not a crash
                results = [(False, f"{type(e).__name__}: {e}"[:300], None, True)] * len(part)
            for i, (ok, detail, clean, infra) in zip(part, results):
                t = tasks[i]
                t.meta["validated_by"] = route.split("-")[0] if route != name else name
                if clean is not None:
                    t.meta["reference_clippy_clean"] = bool(clean)
                if infra and str(detail).startswith("malformed task"):
                    verdicts[i] = Rejection(t.id, t.source, "tests_unsupported", str(detail)[:300])
                elif infra:
                    verdicts[i] = Rejection(t.id, t.source, "sandbox_unavailable", str(detail)[:300])
                elif not ok:
                    verdicts[i] = Rejection(t.id, t.source, "reference_failed", str(detail)[:300])
        if progress:
            progress(len(part))


def split_records(records: Iterable[Task | Rejection]) -> tuple[list[Task], list[Rejection]]:
    tasks, rejected = [], []
    for r in records:
        (rejected if isinstance(r, Rejection) else tasks).append(r)
    return tasks, rejected
