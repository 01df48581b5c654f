"""Validation: a math answer parses; a code task's reference solution passes its own hidden tests.

Code is run by the sandbox (`sandbox.api`) when it is importable and has an engine, else by the local
reference runner (`localrun`, trusted dataset code only). `backend="sandbox"` insists on the sandbox
and rejects code tasks with `sandbox_unavailable` when it cannot run; `backend="none"` skips running.
"""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Callable, Iterable, Sequence

from grpo_core.data import formats, localrun
from grpo_core.data.records import Rejection
from grpo_core.data.schema import Task, TaskValidationError

BACKENDS = ("auto", "sandbox", "local", "none")
Progress = Callable[[int], None]


def _number(text: str) -> Fraction | None:
    s = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer_parses(answer: str, timeout_s: float = 5.0) -> bool:
    """A plain number, or an expression math-verify can parse (run off the main thread, timed here)."""
    if _number(str(answer)) is not None:
        return True
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
        if task.meta.get("checker") == "reasoning_gym":
            return None  # the gold answer was checked by reasoning-gym's own scorer at load time
        if not math_answer_parses(str(task.answer)):
            return Rejection(task.id, task.source, "answer_unparseable", repr(task.answer)[:80])
        return None
    if not formats.has_nonempty_tests(task.tests):
        return Rejection(task.id, task.source, "empty_tests", f"format {formats.format_of(task.tests)!r}")
    if not task.reference_solution:
        return Rejection(task.id, task.source, "reference_missing")
    return None


# -- running references ------------------------------------------------------------------------------
def _sandbox_runner() -> Callable[[Task], tuple[bool, str]] | None:
    """A per-task reference checker backed by sandbox.api, or None when it is absent or has no engine."""
    try:
        from sandbox import api  # owned by the sandbox package
    except Exception:  # noqa: BLE001 - any import failure means "no sandbox"
        return None
    run = getattr(api, "check_reference", None)
    if run is None:
        return None

    def check(task: Task) -> tuple[bool, str]:
        verdict = run(task.reference_solution, task.tests, kind=task.kind, entry_point=task.entry_point)
        return bool(getattr(verdict, "passed", verdict)), str(getattr(verdict, "detail", ""))
    return check


def _local_check(task: Task) -> tuple[bool, str]:
    tests = task.tests or {}
    if task.kind == "python":
        r = localrun.run_python(task.reference_solution or "", tests, task.entry_point)
    elif tests.get("format") == "rust_tests":
        if not localrun.rust_available():
            raise RuntimeError("rustc not on PATH")
        r = localrun.run_rust_tests(task.reference_solution or "", tests["tests"])
    else:
        return False, f"unknown test format {tests.get('format')!r}"
    return r.ok, r.detail


def pick_runner(backend: str) -> tuple[Callable[[Task], tuple[bool, str]] | None, str]:
    """(checker, name). checker None means code tasks cannot be run with this backend."""
    if backend not in BACKENDS:
        raise ValueError(f"validation backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if backend == "none":
        return None, "none"
    sb = _sandbox_runner() if backend in ("auto", "sandbox") else None
    if sb is not None:
        return sb, "sandbox"
    if backend == "sandbox":
        return None, "sandbox"
    return _local_check, "local"


def validate(tasks: Sequence[Task], backend: str = "auto", workers: int = 2,
             progress: Progress | None = None) -> tuple[list[Task], list[Rejection]]:
    """Keep tasks that pass the static checks and whose reference passes its tests (order preserved)."""
    runner, runner_name = pick_runner(backend)
    verdicts: list[Rejection | None] = [check_static(t) for t in tasks]
    to_run = [i for i, t in enumerate(tasks) if verdicts[i] is None and t.kind != "math"]

    def run_one(i: int) -> Rejection | None:
        t = tasks[i]
        if runner is None:
            if runner_name == "none":
                return None
            return Rejection(t.id, t.source, "sandbox_unavailable", f"backend {backend!r} found no sandbox engine")
        try:
            ok, detail = runner(t)
        except Exception as e:  # noqa: BLE001 - an infrastructure failure is a reason, not a crash
            return Rejection(t.id, t.source, "sandbox_unavailable", f"{type(e).__name__}: {e}"[:300])
        t.meta["validated_by"] = runner_name
        return None if ok else Rejection(t.id, t.source, "reference_failed", detail[:300])

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for i, verdict in zip(to_run, pool.map(run_one, to_run)):
            verdicts[i] = verdict
            if progress:
                progress(1)
    if progress:
        progress(len(tasks) - len(to_run))
    kept = [t for t, v in zip(tasks, verdicts) if v is None]
    return kept, [v for v in verdicts if v is not None]


def split_records(records: Iterable[Task | Rejection]) -> tuple[list[Task], list[Rejection]]:
    tasks, rejected = [], []
    for r in records:
        (rejected if isinstance(r, Rejection) else tasks).append(r)
    return tasks, rejected
