"""What every backend shares: job -> box message, box reply -> verdict (and program -> message,
reply -> run output), concurrency.

A backend only has to implement ``_exchange(message, limits, deadline_s) -> reply dict`` (send one
job to a fresh-state box, get the runner's reply) and may raise :class:`InfraError` or
:class:`BoxDied` (the box vanished mid-job, which the completion may have caused).
"""
from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from sandbox import programs, python_tests, rust_harness
from sandbox.types import (Job, Limits, Program, RunOutput, StageResult, TaskFormatError, TestResult, Verdict,
                           infra_error)

log = logging.getLogger("sandbox")

RUNNER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_runner.py")


class InfraError(RuntimeError):
    """The sandbox itself failed; the job's verdict becomes infra_error."""


class EngineUnavailable(InfraError):
    """The container engine does not answer (stopped, crashed, its socket gone): no job can run until it is
    back. A job's verdict becomes infra_error; `Backend.check_engine` raises it for the caller to retry later."""


class NoIsolation(InfraError):
    """The local backend cannot isolate code here (no usable bubblewrap) and was not told to run it unisolated."""


class BoxDied(RuntimeError):
    """The box stopped answering mid-job (killed runner, OOM of the supervisor, deadline)."""

    def __init__(self, msg: str, timed_out: bool = False):
        super().__init__(msg)
        self.timed_out = timed_out


class NonceChannel:
    """The request/reply framing both backends' warm boxes share. Each request line starts with the
    box's secret nonce and a sequence number; only a reply line with the same prefix counts, so
    anything else the code prints (noise, stale replies, forgeries) is ignored. Subclasses provide
    `nonce`, `_send(bytes)` and `_next_line(deadline) -> bytes` (raising BoxDied)."""
    nonce: str
    jobs_done: int = 0

    def _send(self, data: bytes) -> None:
        raise NotImplementedError

    def _next_line(self, end: float) -> bytes:
        raise NotImplementedError

    def exchange(self, message: dict, deadline_s: float) -> dict:
        self.jobs_done += 1
        prefix = f"{self.nonce} {self.jobs_done} ".encode()
        self._send(prefix + json.dumps(message).encode() + b"\n")
        end = time.monotonic() + deadline_s
        while True:
            line = self._next_line(end)
            if line.startswith(prefix):
                try:
                    return json.loads(line[len(prefix):])
                except ValueError as e:
                    raise BoxDied(f"garbled reply from the box ({e})") from e


class Backend:
    name = "base"

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.pid = os.getpid()  # a backend (sockets, containers) belongs to the process that made it
        return obj

    def score_batch(self, jobs: list[Job], workers: int | None = None) -> list[Verdict]:
        return self._concurrently(self.score_one, jobs, workers)

    def run_batch(self, programs: list[Program], workers: int | None = None) -> list[RunOutput]:
        return self._concurrently(self.run_one, programs, workers)

    def _concurrently(self, one, items: list, workers: int | None) -> list:
        workers = max(1, min(workers or self.default_workers(), len(items) or 1))
        if workers == 1 or len(items) <= 1:
            return [one(item) for item in items]
        with ThreadPoolExecutor(workers, thread_name_prefix=f"sbx-{self.name}") as ex:
            return list(ex.map(one, items))

    def default_workers(self) -> int:
        return os.cpu_count() or 2

    def check_engine(self) -> None:
        """Raise :class:`EngineUnavailable` when the engine this backend runs jobs on does not answer now
        (the local backend has none: nothing to check)."""

    def close(self) -> None:
        """Release resources (containers)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ one job
    def score_one(self, job: Job) -> Verdict:
        t0 = time.monotonic()
        v = self._guarded(self._score_one, job, infra_error)
        v.duration_s = time.monotonic() - t0
        v.backend, v.job_id = self.name, job.id
        return v

    def run_one(self, program: Program) -> RunOutput:
        t0 = time.monotonic()
        out = self._guarded(self._run_one, program, programs.infra_failure)
        out.duration_s = time.monotonic() - t0
        out.backend, out.program_id = self.name, program.id
        return out

    def _guarded(self, work, item, failed):
        """``work(item)``; a sandbox failure (or a malformed task) becomes ``failed(detail)``, never an exception."""
        try:
            return work(item)
        except TaskFormatError as e:
            return failed(f"malformed task: {e}")
        except InfraError as e:
            return failed(str(e))
        except Exception as e:  # noqa: BLE001 - never let one job take the batch down
            log.exception("sandbox backend %s failed on job %s", self.name, item.id)
            return failed(f"{type(e).__name__}: {e}")

    def _score_one(self, job: Job) -> Verdict:
        lim = job.effective_limits()
        if job.language == "python":
            return self._score_python(job, lim)
        if job.language == "rust":
            return self._score_rust(job, lim)
        raise TaskFormatError(f"job language {job.language!r} is not 'python' or 'rust'")

    def _score_python(self, job: Job, lim: Limits) -> Verdict:
        plan = python_tests.plan(job.tests, job.entry_point)
        if not job.code.strip():
            return _all_failed(plan.n_tests, "error", "empty completion: no code to run")
        msg = {"kind": "python", "code": job.code, "entry_point": job.entry_point,
               "calls": plan.calls, "limits": self._limits_dict(lim)}
        try:
            reply = self._exchange(msg, lim, lim.timeout_s + 10)
        except BoxDied as e:
            return _all_failed(plan.n_tests, "timeout" if e.timed_out else "error", str(e))
        if "runner_error" in reply:
            raise InfraError(f"in-box runner failed: {reply['runner_error']}")
        tests = plan.judge(reply.get("records", []))
        v = Verdict(status="pass", tests=tests, stdout=reply.get("stdout", ""),
                    stderr=reply.get("stderr", ""))
        load = [r["load_error"] for r in reply.get("records", []) if isinstance(r, dict) and "load_error" in r]
        rc = reply.get("rc")
        if reply.get("box_error"):
            v.status, v.detail = "error", reply["box_error"]
        elif reply.get("timed_out"):
            v.status, v.detail = "timeout", f"time limit {lim.timeout_s}s exceeded"
        elif reply.get("truncated"):
            v.status, v.detail = "error", "output limit exceeded"
        elif load:
            v.status, v.detail = "error", load[0]
        elif all(t.passed for t in tests):
            v.status = "pass"
        elif rc in (-9, 137) and not reply.get("killed_by_runner"):
            v.status, v.detail = "error", "killed by SIGKILL (out of memory?)"
        elif rc not in (0, None) and not reply.get("killed_by_runner") \
                and any("no result" in t.detail for t in tests):
            v.status, v.detail = "error", f"crashed (exit status {rc}) before reporting all results"
        else:
            v.status = "fail"
            v.detail = f"{sum(not t.passed for t in tests)} of {len(tests)} tests failed"
        return v

    def _score_rust(self, job: Job, lim: Limits) -> Verdict:
        fields = rust_harness.build_job_fields(job.code, job.tests)
        names = fields.pop("test_names")
        if not job.code.strip():
            return _all_failed(len(names), "error", "empty completion: no code to build", names)
        why = rust_harness.fake_comparison(job.code)
        if why:
            return Verdict(status="error", detail=why, tests=[TestResult(n, False, why) for n in names],
                           stages={"build": StageResult("build", "fail", 0.0, why),
                                   "clippy": StageResult("clippy", "skipped"), "test": StageResult("test", "skipped")})
        msg = {"kind": "rust", **fields, "limits": self._limits_dict(lim), **self._rust_toolchain()}
        budget = lim.build_timeout_s + lim.clippy_timeout_s + lim.test_timeout_s + 20
        try:
            reply = self._exchange(msg, lim, budget)
        except BoxDied as e:
            return _all_failed(len(names), "timeout" if e.timed_out else "error", str(e), names)
        if "runner_error" in reply:
            raise InfraError(f"in-box runner failed: {reply['runner_error']}")
        status, tests, stages, detail = rust_harness.judge(reply, names)
        return Verdict(status=status, tests=tests, stages=stages, detail=detail,
                       stdout=reply.get("stdout", ""), stderr=reply.get("stderr", ""))

    def _run_one(self, program: Program) -> RunOutput:
        lim = program.effective_limits()
        msg = programs.message(program, self._limits_dict(lim))
        if program.language == "rust":
            msg.update(self._rust_toolchain())
        if not program.code.strip():
            return RunOutput("error", None, "", "", "empty program: no code to run")
        try:
            reply = self._exchange(msg, lim, programs.deadline_s(program, lim))
        except BoxDied as e:
            return programs.box_died(str(e), e.timed_out)
        if "runner_error" in reply:
            raise InfraError(f"in-box runner failed: {reply['runner_error']}")
        return programs.from_reply(reply, lim)

    # ------------------------------------------------------------------ hooks
    def _limits_dict(self, lim: Limits) -> dict[str, Any]:
        return asdict(lim)

    def _rust_toolchain(self) -> dict[str, Any]:
        return {}

    def _exchange(self, message: dict, limits: Limits, deadline_s: float) -> dict:
        raise NotImplementedError


def _all_failed(n: int, status: str, detail: str, names: list[str] | None = None) -> Verdict:
    names = names or [f"test {i}" for i in range(n)]
    return Verdict(status=status, detail=detail,
                   tests=[TestResult(name, False, detail) for name in names])
