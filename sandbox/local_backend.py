"""Local backend: no Docker. WEAKER than the Docker backend; use it only where Docker is absent.

With bubblewrap, a few warm ``bwrap --unshare-all ... python_runner.py serve`` boxes run one job
at a time each (no network, private PID/IPC namespaces, a size-capped tmpfs ``/tmp`` wiped and
every other process killed between jobs, a read-only root holding read-only binds of only /usr,
/etc/alternatives, the runner and the host Rust toolchain); as root with cgroup v1 each box also gets
its own pids + memory cgroup. Without usable bubblewrap the backend refuses (:class:`NoIsolation`, saying
how to fix it) unless it was asked to run unisolated (``LocalBackend(use_bwrap=False)``, the backend name
``unisolated``): then each job is one ``python_runner.py once`` process in its own session with rlimits (and
cgroups as root), the code sees the host filesystem and network, and a loud warning is logged. The verdict
protocol is the same as Docker's (outputs compared on the host).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from sandbox.types import Limits
from sandbox.backends import RUNNER_PATH, Backend, BoxDied, InfraError, NoIsolation, NonceChannel

log = logging.getLogger("sandbox.local")

SYSTEM_PYTHON = "/usr/bin/python3"
CGROUP_ROOT = "/sys/fs/cgroup"
BOX_RUST = "/opt/rust"       # where the host Rust sysroot appears inside bubblewrap
_warned = False


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot isolate code here (None: it is installed and can create its namespaces)."""
    exe = shutil.which("bwrap")
    if not exe:
        return "bubblewrap (bwrap) is not installed"
    r = subprocess.run([exe, "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return None if r.returncode == 0 else f"bwrap cannot create its namespaces here ({r.stderr.strip()[:200]})"


def bwrap_works() -> bool:
    """True when bubblewrap is installed and can create its namespaces here."""
    return bwrap_problem() is None


NO_ISOLATION_FIX = ("Fix: install bubblewrap (apt-get install bubblewrap; infra/setup_docker.sh installs it with "
                    "Docker), or start Docker and its images for sandbox.backend: docker; only for code you trust, "
                    "sandbox.backend: unisolated runs it on this host, with its files and network")


class LocalBackend(Backend):
    name = "local"

    def __init__(self, use_bwrap: bool | None = None):
        """use_bwrap: None (checked) or True, bubblewrap (NoIsolation where it is not usable); False, unisolated."""
        global _warned
        if use_bwrap is None:
            problem = bwrap_problem()
            if problem is not None:
                raise NoIsolation(f"the local sandbox isolates code with bubblewrap, and {problem}: model-written "
                                  f"code would run on this host as this user. {NO_ISOLATION_FIX}")
        self.bwrap = use_bwrap is not False
        self.name = "local" if self.bwrap else "unisolated"
        self.python = SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable
        self._runner_dir = tempfile.mkdtemp(prefix="grpo-sbx-local-")
        shutil.copy(RUNNER_PATH, os.path.join(self._runner_dir, "python_runner.py"))
        os.chmod(self._runner_dir, 0o755)
        atexit.register(shutil.rmtree, self._runner_dir, True)
        self._toolchain = _host_rust_toolchain()
        self._lock = threading.Lock()
        self._pools: dict[tuple, list[_LocalBox]] = {}
        self._all: set[_LocalBox] = set()
        atexit.register(self.close)
        if not _warned:
            _warned = True
            log.warning(
                "SANDBOX: using the LOCAL backend (%s). It is WEAKER than Docker: untrusted code "
                "runs on this kernel as this user%s. Use the docker backend for training runs.",
                "bubblewrap: no network, private PID namespace, read-only system dirs"
                if self.bwrap else "UNISOLATED, asked for: no bubblewrap, host filesystem and network are visible",
                "" if self.bwrap else ", with only rlimits and a process group")

    def default_workers(self) -> int:
        return os.cpu_count() or 2

    def _limits_dict(self, lim: Limits) -> dict[str, Any]:
        d = super()._limits_dict(lim)
        d["rlimit_as"] = False if self._cgroup_ok() else True
        d["nproc"] = None if os.geteuid() == 0 else lim.pids + len(os.listdir("/proc"))
        return d

    def _rust_toolchain(self) -> dict[str, Any]:
        if not self._toolchain:
            raise InfraError("no host Rust toolchain with clippy found for the local backend; install "
                             "rustup + `rustup component add clippy`, or use the docker backend")
        tc = self._toolchain
        if self.bwrap:  # the sysroot is bound at BOX_RUST inside the box
            return {"toolchain_bin": BOX_RUST + "/bin",
                    "rust_libdir": BOX_RUST + tc["libdir"][len(tc["sysroot"]):]}
        return {"toolchain_bin": tc["bin"], "rust_libdir": tc["libdir"]}

    # ------------------------------------------------------------------ warm boxes (bubblewrap)
    def _exchange(self, message: dict, limits: Limits, deadline_s: float) -> dict:
        if not self.bwrap:
            return self._exchange_once(message, limits, deadline_s)
        key = (limits.memory_mb, limits.pids, limits.tmpfs_mb)
        for attempt in range(2):
            box, reused = self._acquire(key, limits, fresh=attempt > 0)
            try:
                reply = box.exchange(message, deadline_s)
            except BoxDied as e:
                self._forget(box)
                if reused and not e.timed_out and attempt == 0:
                    continue  # may have died while idle: retry once on a fresh box
                raise
            self._release(key, box)
            return reply
        raise AssertionError("unreachable")

    def _acquire(self, key, limits: Limits, fresh: bool = False) -> tuple["_LocalBox", bool]:
        while not fresh:
            with self._lock:
                idle = self._pools.setdefault(key, [])
                box = idle.pop() if idle else None
            if box is None:
                break
            if box.p.poll() is None:
                return box, True
            self._forget(box)  # died while idle
        cg = _Cgroup.create(limits) if self._cgroup_ok() else None
        box = _LocalBox(self._argv(limits, "serve"), self._env(), self._runner_dir, cg)
        with self._lock:
            self._all.add(box)
        return box, False

    def _forget(self, box: "_LocalBox") -> None:
        with self._lock:
            self._all.discard(box)
        box.destroy()

    def _release(self, key, box: "_LocalBox") -> None:
        with self._lock:
            if box in self._all:
                self._pools.setdefault(key, []).append(box)
                return
        box.destroy()  # the backend was closed meanwhile

    def close(self) -> None:
        """Stop every warm box (their whole PID namespaces die with them)."""
        with self._lock:
            boxes, self._all, self._pools = list(self._all), set(), {}
        for b in boxes:
            b.destroy()

    def _env(self) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "SBX_ISOLATED": "1" if self.bwrap else "0"}

    # ------------------------------------------------------------------ one job = one process
    def _exchange_once(self, message: dict, limits: Limits, deadline_s: float) -> dict:
        """Without bubblewrap: a fresh process (group) per job, killed afterwards."""
        nonce = secrets.token_hex(16)
        argv = self._argv(limits, "once")
        cg = _Cgroup.create(limits) if self._cgroup_ok() else None
        try:
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=self._env(), start_new_session=True,
                                 cwd=self._runner_dir, preexec_fn=cg.enter if cg else None)
        except OSError as e:
            raise InfraError(f"could not start the local sandbox ({argv[0]}): {e}") from e
        try:
            p.stdin.write(f"{nonce}\n{nonce} 1 {json.dumps(message)}\n".encode())
            p.stdin.close()
            return _read_reply(p, nonce, deadline_s)
        finally:
            _kill_group(p)
            if cg:
                cg.destroy()

    def _argv(self, lim: Limits, mode: str) -> list[str]:
        runner = ["/sbx/python_runner.py" if self.bwrap else RUNNER_PATH, mode]
        if not self.bwrap:
            return [self.python, "-I", "-S"] + runner
        a = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--ro-bind", "/usr", "/usr", "--ro-bind", self._runner_dir, "/sbx",
             "--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
             "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache",
             "--proc", "/proc", "--dev", "/dev", "--mqueue", "/dev/mqueue",
             "--size", str(lim.tmpfs_mb << 20), "--tmpfs", "/tmp",
             "--uid", "65534", "--gid", "65534", "--chdir", "/tmp"]
        for d in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{d}"):
                a += ["--symlink", os.readlink(f"/{d}"), f"/{d}"]
            elif os.path.isdir(f"/{d}"):
                a += ["--ro-bind", f"/{d}", f"/{d}"]
        if not self.python.startswith("/usr/"):  # e.g. a pyenv interpreter: bind its prefix
            prefix = os.path.realpath(sys.base_prefix)
            a += ["--ro-bind", prefix, prefix]
        if self._toolchain:  # at a neutral path: the host's home layout stays invisible
            a += ["--ro-bind", self._toolchain["sysroot"], BOX_RUST]
        # the root bwrap builds is a tmpfs: read-only once everything is mounted, so no job leaves a file there
        a += ["--remount-ro", "/", "--setenv", "SBX_ISOLATED", "1", self.python, "-I", "-S"] + runner
        return a

    def _cgroup_ok(self) -> bool:
        return os.geteuid() == 0 and os.access(os.path.join(CGROUP_ROOT, "pids"), os.W_OK)


class _LocalBox(NonceChannel):
    """A warm ``bwrap ... python_runner.py serve``: private PID namespace, one job at a time; the
    supervisor kills everything else in the namespace and wipes /tmp between jobs."""

    def __init__(self, argv: list[str], env: dict, cwd: str, cg: "_Cgroup | None"):
        self.cg, self.nonce, self.jobs_done = cg, secrets.token_hex(16), 0
        self._pending, self._lines, self.stderr_tail = b"", [], b""
        try:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env, cwd=cwd, bufsize=0,
                                      start_new_session=True, preexec_fn=cg.enter if cg else None)
        except OSError as e:
            if cg:
                cg.destroy()
            raise InfraError(f"could not start bubblewrap: {e}") from e
        self._send((self.nonce + "\n").encode())

    def _send(self, data: bytes) -> None:
        try:
            self.p.stdin.write(data)
        except OSError as e:
            raise BoxDied(f"the sandbox process is gone ({e})") from e

    def _next_line(self, end: float) -> bytes:
        out, err = self.p.stdout.fileno(), self.p.stderr.fileno()
        while not self._lines:
            left = end - time.monotonic()
            if left <= 0:
                raise BoxDied("wall-clock deadline passed; sandbox killed", timed_out=True)
            ready, _, _ = select.select([out, err], [], [], left)
            if err in ready:
                chunk = os.read(err, 1 << 16)
                self.stderr_tail = (self.stderr_tail + chunk)[-4096:]
            if out in ready:
                chunk = os.read(out, 1 << 16)
                if not chunk:
                    tail = self.stderr_tail.decode("utf-8", "replace")
                    if "bwrap:" in tail:
                        raise InfraError(f"bubblewrap failed: {tail.strip()[-300:]}")
                    raise BoxDied("the sandbox runner died mid-job (killed by the code, or out of memory)")
                *complete, self._pending = (self._pending + chunk).split(b"\n")
                self._lines.extend(complete)
                if len(self._pending) > 64 << 20:
                    raise BoxDied("runner reply too large")
        return self._lines.pop(0)

    def destroy(self) -> None:
        try:
            self.p.stdin.close()
        except OSError:
            pass
        _kill_group(self.p)
        if self.cg:
            self.cg.destroy()


def _read_reply(p: subprocess.Popen, nonce: str, deadline_s: float) -> dict:
    end, buf = time.monotonic() + deadline_s, b""
    prefix = f"{nonce} 1 ".encode()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise BoxDied("wall-clock deadline passed; sandbox process group killed", timed_out=True)
        r, _, _ = select.select([p.stdout], [], [], left)
        if not r:
            continue
        chunk = os.read(p.stdout.fileno(), 1 << 16)
        if not chunk:
            err = p.stderr.read(2000).decode("utf-8", "replace") if p.poll() is not None else ""
            if "bwrap" in err and "No such file" not in err:
                raise InfraError(f"bubblewrap failed: {err.strip()[:300]}")
            raise BoxDied("the sandbox runner died mid-job (killed by the code, or out of memory)")
        buf += chunk
        for line in buf.split(b"\n"):
            if line.startswith(prefix):
                try:
                    return json.loads(line[len(prefix):])
                except ValueError:
                    break  # incomplete line: read more
        if len(buf) > 64 << 20:
            raise BoxDied("runner reply too large")


def _kill_group(p: subprocess.Popen) -> None:
    for f in (p.stdout, p.stderr):
        try:
            f.close()
        except OSError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("local sandbox process %d did not die", p.pid)


def _host_rust_toolchain() -> dict[str, str] | None:
    """Resolve the real toolchain dir (not the rustup proxy) so it can be bound read-only."""
    rustc = shutil.which("rustc")
    if not rustc:
        return None
    try:
        sysroot = subprocess.run([rustc, "--print", "sysroot"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    bindir = os.path.join(sysroot, "bin")
    if not (sysroot and os.path.exists(os.path.join(bindir, "clippy-driver"))):
        return None  # clippy is required for the lint stage
    host = subprocess.run([rustc, "-vV"], capture_output=True, text=True).stdout
    triple = next((l.split()[1] for l in host.splitlines() if l.startswith("host:")), "")
    return {"sysroot": sysroot, "bin": bindir,
            "libdir": os.path.join(sysroot, "lib", "rustlib", triple, "lib")}


class _Cgroup:
    """A cgroup v1 pids + memory group for one job (root only); best effort."""

    def __init__(self, dirs: list[str]):
        self.dirs = dirs

    @classmethod
    def create(cls, lim: Limits) -> "_Cgroup | None":
        name = "grpo-sbx-" + uuid.uuid4().hex[:12]
        dirs = []
        try:
            pids = os.path.join(CGROUP_ROOT, "pids", name)
            os.mkdir(pids)
            dirs.append(pids)
            _write(os.path.join(pids, "pids.max"), str(lim.pids))
            mem = os.path.join(CGROUP_ROOT, "memory", name)
            if os.access(os.path.dirname(mem), os.W_OK):
                os.mkdir(mem)
                dirs.append(mem)
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(lim.memory_mb << 20))
                try:
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(lim.memory_mb << 20))
                except OSError:
                    pass  # no swap accounting: the limit still holds RAM
        except OSError as e:
            log.debug("cgroup setup failed (%s); relying on rlimits", e)
        return cls(dirs) if dirs else None

    def enter(self) -> None:
        for d in self.dirs:
            _write(os.path.join(d, "cgroup.procs"), str(os.getpid()))

    def destroy(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        for pid in f.read().split():
                            os.kill(int(pid), signal.SIGKILL)
                    os.rmdir(d)
                    break
                except (OSError, ValueError):
                    time.sleep(0.02)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
