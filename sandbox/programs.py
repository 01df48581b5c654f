"""Host side of run jobs (a tool call): a `Program` becomes a message for the box, the box's reply a
`RunOutput`.

A run job has no tests and no verdict: the program's own output is the result, so nothing here needs
hiding from the code (unlike `python_tests` and `rust_harness`, which keep expected values out of the
box). It goes through the same boxes, limits and reaping as scoring; only the in-box entry point
(`python_runner.run_program`) and this translation differ.
"""
from __future__ import annotations

from typing import Any

from sandbox.types import LANGUAGES, Limits, Program, RunOutput, TaskFormatError

MESSAGE_KIND = "run"


def message(program: Program, limits: dict[str, Any]) -> dict[str, Any]:
    """The job line for the in-box runner (``limits``: the backend's dict of them)."""
    if program.language not in LANGUAGES:
        raise TaskFormatError(f"program language {program.language!r}: use one of {LANGUAGES}")
    if not isinstance(program.code, str) or not isinstance(program.stdin, str):
        raise TaskFormatError("a program's 'code' and 'stdin' must be strings")
    return {"kind": MESSAGE_KIND, "language": program.language, "code": program.code,
            "stdin": program.stdin, "limits": limits}


def deadline_s(program: Program, lim: Limits) -> float:
    """The host's wall-clock limit for the whole job (build and run), with room for the box's own cleanup."""
    return lim.timeout_s + (lim.build_timeout_s if program.language == "rust" else 0.0) + 10.0


def from_reply(reply: dict[str, Any], lim: Limits) -> RunOutput:
    """The program's output and status from the runner's reply."""
    build = reply.get("build")
    if build and build.get("status") != "pass":
        return _build_failed(build, lim)
    out = RunOutput(status="ok", exit_code=reply.get("rc"), stdout=reply.get("stdout", ""),
                    stderr=reply.get("stderr", ""))
    rc = out.exit_code
    if reply.get("timed_out"):
        out.status, out.detail = "timeout", f"time limit {lim.timeout_s:g}s exceeded; the program was killed"
    elif reply.get("truncated"):
        out.status = "error"
        out.detail = f"output limit ({lim.output_bytes} bytes per stream) exceeded; the program was stopped"
    elif rc in (-9, 137) and not reply.get("killed_by_runner"):
        out.status, out.detail = "error", "killed by SIGKILL (out of memory?)"
    elif isinstance(rc, int) and rc < 0:
        out.status, out.detail = "error", f"killed by signal {-rc}"
    elif rc != 0:
        out.status, out.detail = "error", f"exit status {rc}"
    if reply.get("timed_out") or reply.get("truncated"):
        out.exit_code = None        # the sandbox stopped it: it did not end by itself
    return out


def _build_failed(build: dict[str, Any], lim: Limits) -> RunOutput:
    status = build.get("status")
    if status == "timeout":
        return RunOutput("timeout", None, "", build.get("detail", ""),
                         f"compile time limit {lim.build_timeout_s:g}s exceeded")
    why = "compile error" if status == "fail" else "the compiler failed (out of memory?)"
    return RunOutput("error", None, "", build.get("detail", ""), why)


def box_died(why: str, timed_out: bool) -> RunOutput:
    """The box stopped answering mid-job (its deadline passed, or the code killed it or ran it out of memory)."""
    return RunOutput("timeout" if timed_out else "error", None, "", "", why)


def infra_failure(detail: str) -> RunOutput:
    return RunOutput("infra_error", None, "", "", detail)
