"""Run *trusted* reference solutions against their hidden tests on this host, to validate tasks.

This is the fallback validator used when the sandbox API or its engine is not available. It runs
only code that comes from the datasets themselves (reference solutions, never model output), in a
subprocess with a wall-clock limit, inside bubblewrap (no network, private /tmp) when `bwrap` exists and
`$GRPO_DATA_NO_BWRAP` is unset (set it where bwrap is installed but cannot make namespaces, e.g. in an
unprivileged container: docs/operations.md, "Environment variables"). Model-written code must go through
`sandbox/` instead.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PY_TIMEOUT_S = 10.0
RUST_TIMEOUT_S = 60.0


@dataclass
class RunResult:
    ok: bool
    detail: str = ""


def _bwrap_prefix(workdir: Path) -> list[str]:
    if not shutil.which("bwrap") or os.environ.get("GRPO_DATA_NO_BWRAP"):
        return []
    # The fresh /tmp hides an interpreter (e.g. a virtualenv) that lives under /tmp: bind it back, read-only.
    interpreter = [a for p in dict.fromkeys((sys.prefix, sys.base_prefix)) if p.startswith("/tmp/")
                   for a in ("--ro-bind", p, p)]
    return ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *interpreter,
            "--bind", str(workdir), str(workdir), "--unshare-all", "--die-with-parent", "--new-session",
            "--chdir", str(workdir)]


def _run(cmd: list[str], workdir: Path, timeout: float) -> subprocess.CompletedProcess | None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"),
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
           "RUSTUP_HOME": os.environ.get("RUSTUP_HOME", ""), "CARGO_HOME": os.environ.get("CARGO_HOME", "")}
    env = {k: v for k, v in env.items() if v}
    try:
        return subprocess.run(_bwrap_prefix(workdir) + cmd, cwd=workdir, env=env, capture_output=True,
                              text=True, errors="replace", timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return None


_IO_RUNNER = r'''
import json, sys
ns = {"__name__": "__solution__"}
exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
spec = json.load(open("cases.json"))
fn = ns[spec["entry_point"]]
ok = []
for case in spec["cases"]:
    try:
        got = json.loads(json.dumps(fn(*case["args"])))
        ok.append(got == case["expected"] and type(got) is type(case["expected"]))
    except Exception as e:
        ok.append(False)
print("RESULT " + json.dumps(ok))
'''


def run_python(solution: str, tests: dict[str, Any], entry_point: str | None,
               timeout: float = PY_TIMEOUT_S) -> RunResult:
    """Run a Python reference solution against tests in one of the `formats` Python formats."""
    fmt = tests.get("format")
    with tempfile.TemporaryDirectory(prefix="grpo-ref-") as d:
        wd = Path(d)
        if fmt == "io":
            (wd / "solution.py").write_text(solution)
            (wd / "cases.json").write_text(json.dumps({"entry_point": entry_point, "cases": tests["cases"]}))
            (wd / "main.py").write_text(_IO_RUNNER)
        elif fmt == "assert":
            (wd / "main.py").write_text(f"{solution}\n\n{tests['check']}\n\ncheck({entry_point})\n"
                                        "print('RESULT [true]')\n")
        elif fmt == "python_script":
            (wd / "main.py").write_text(f"{solution}\n\n{tests['check']}\nprint('RESULT [true]')\n")
        else:
            return RunResult(False, f"unknown python test format {fmt!r}")
        proc = _run([sys.executable, "main.py"], wd, timeout)
    if proc is None:
        return RunResult(False, f"timeout after {timeout:.0f}s")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return RunResult(False, (proc.stderr or proc.stdout)[-400:].strip() or f"exit {proc.returncode}")
    results = json.loads(lines[-1][7:])
    if not results or not all(results):
        return RunResult(False, f"{results.count(False)} of {len(results)} cases failed")
    return RunResult(True, f"{len(results)} case(s) passed")


def rust_available() -> bool:
    return shutil.which("rustc") is not None


def run_rust_tests(source: str, tests: str, timeout: float = RUST_TIMEOUT_S, edition: str = "2021") -> RunResult:
    """Emulate the sandbox's Rust layout: `source` is crate `solution` (lib, unsafe forbidden); `tests`
    are top-level #[test] fns compiled into a separate test crate that does `use solution::*`."""
    if not rust_available():
        return RunResult(False, "rustc not found on this host")
    with tempfile.TemporaryDirectory(prefix="grpo-ref-rs-") as d:
        wd = Path(d)
        (wd / "lib.rs").write_text(f"#![forbid(unsafe_code)]\n{source}\n")
        (wd / "tests.rs").write_text(f"#[allow(unused_imports)]\nuse solution::*;\n{tests}\n")
        proc = _run(["rustc", "--edition", edition, "--crate-type", "rlib", "--crate-name", "solution",
                     "-O", "lib.rs", "-o", "libsolution.rlib"], wd, timeout)
        if proc is None:
            return RunResult(False, "compile timeout")
        if proc.returncode != 0:
            return RunResult(False, "compile error: " + _first_error(proc.stderr))
        proc = _run(["rustc", "--edition", edition, "--test", "-O", "--crate-name", "hidden_tests", "tests.rs",
                     "--extern", "solution=libsolution.rlib", "-L", ".", "-o", "t"], wd, timeout)
        if proc is None:
            return RunResult(False, "test compile timeout")
        if proc.returncode != 0:
            return RunResult(False, "tests do not compile against the solution: " + _first_error(proc.stderr))
        proc = _run(["./t", "--test-threads=1"], wd, timeout)
    if proc is None:
        return RunResult(False, "test timeout")
    if proc.returncode != 0 or " 0 failed" not in proc.stdout or "test result: ok" not in proc.stdout:
        return RunResult(False, "tests failed: " + proc.stdout[-300:].strip())
    if " 0 passed" in proc.stdout:
        return RunResult(False, "no test ran")
    return RunResult(True, "tests passed")


def check_rust(source: str, crate_type: str = "lib", deny: list[str] | None = None,
               timeout: float = RUST_TIMEOUT_S, edition: str = "2021") -> tuple[bool, str]:
    """Type-check `source` (no codegen); with `deny` (e.g. ["clippy::all"]) run clippy denying those lints.

    Returns (compiles_cleanly, stderr). Used to confirm a broken example is broken and its fix is not.
    """
    tool = "clippy-driver" if deny else "rustc"
    if not shutil.which(tool):
        return False, f"{tool} not found on this host"
    with tempfile.TemporaryDirectory(prefix="grpo-ref-chk-") as d:
        wd = Path(d)
        (wd / "src.rs").write_text(source)
        cmd = [tool, "--edition", edition, "--crate-type", crate_type, "--emit=metadata", "--crate-name", "chk",
               "-o", "out.rmeta", "src.rs"]
        for lint in deny or []:
            cmd += ["-D", lint]
        proc = _run(cmd, wd, timeout)
    if proc is None:
        return False, "timeout"
    return proc.returncode == 0, proc.stderr


def _first_error(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("error"):
            return line[:200]
    return stderr[-200:].strip()
