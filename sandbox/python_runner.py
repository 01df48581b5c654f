#!/usr/bin/env python3
"""The in-box runner. Standard library only; runs inside the container (or bubblewrap).

It never decides whether a test passed. It only runs things and reports *outputs*:

* ``serve``  (trusted supervisor, one per warm container): reads a nonce line, then one JSON job
  per line on stdin; for each job it runs the untrusted code in a separate process, collects its
  results, kills every other process in the box, wipes the scratch dirs and writes one reply line
  ``<nonce> <json>`` on stdout. It marks itself non-dumpable, so the untrusted code (same uid)
  cannot read its memory, environment or file descriptors through /proc.
* ``once``   the same for exactly one job (local backend).
* ``child``  (untrusted side, Python jobs): executes the completion, calls the entry point on
  each input, and writes strictly typed records ``{"i", "ok", "v"|"exc"}`` to a pipe. The host
  compares the values with the expected ones, which never enter the box.

Rust jobs are built and tested with rustc by the supervisor; the test binary prints one
``<run-nonce> <test> ok|FAILED`` line per test and the supervisor keeps only lines carrying the
nonce it generated for that run (and passed to the binary on stdin).

``run`` jobs (a tool call) run a whole program, Python as a script, Rust built as a binary first, in a
fresh process group and directory with the same rlimits, and return what it printed (capped).
"""
import base64
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time

SCRATCH_DIRS = ("/tmp", "/dev/shm", "/dev/mqueue")   # mqueue: POSIX message queues
MAX_ENCODED = 1 << 20        # bytes of one encoded value
MAX_DEPTH = 64


# --------------------------------------------------------------------------- strict value codec
class Unencodable(Exception):
    pass


def encode(x, depth=0):
    """Encode a plain value as a tagged JSON tree. Exact builtin types only (no subclasses),
    so objects with a forged ``__eq__`` cannot pass for a right answer."""
    if depth > MAX_DEPTH:
        raise Unencodable("value nested too deeply")
    t = type(x)
    if x is None:
        return ["n"]
    if t is bool:
        return ["b", bool.__bool__(x)]
    if t is int:
        return ["i", int.__repr__(x)]
    if t is float:
        return ["f", float.__repr__(x)]
    if t is str:
        return ["s", str.__str__(x)]
    if t is bytes:
        return ["y", base64.b64encode(x).decode()]
    if t is complex:
        return ["c", [float.__repr__(x.real), float.__repr__(x.imag)]]
    if t is list:
        return ["l", [encode(v, depth + 1) for v in list.__iter__(x)]]
    if t is tuple:
        return ["t", [encode(v, depth + 1) for v in tuple.__iter__(x)]]
    if t is set:
        return ["S", [encode(v, depth + 1) for v in set.__iter__(x)]]
    if t is frozenset:
        return ["F", [encode(v, depth + 1) for v in frozenset.__iter__(x)]]
    if t is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(x)]]
    raise Unencodable("unsupported type %s (return plain builtin values)" % t.__name__)


def decode(e):
    """Inverse of :func:`encode`; raises ValueError on anything malformed."""
    if not isinstance(e, list) or not e or not isinstance(e[0], str):
        raise ValueError("malformed encoded value")
    tag = e[0]
    if tag == "n":
        return None
    v = e[1]
    if tag == "b" and isinstance(v, bool):
        return v
    if tag == "i" and isinstance(v, str):
        return int(v)
    if tag == "f" and isinstance(v, str):
        return float(v)
    if tag == "s" and isinstance(v, str):
        return v
    if tag == "y" and isinstance(v, str):
        return base64.b64decode(v)
    if tag == "c" and isinstance(v, list):
        return complex(float(v[0]), float(v[1]))
    if tag == "l" and isinstance(v, list):
        return [decode(i) for i in v]
    if tag == "t" and isinstance(v, list):
        return tuple(decode(i) for i in v)
    if tag == "S" and isinstance(v, list):
        return set(decode(i) for i in v)
    if tag == "F" and isinstance(v, list):
        return frozenset(decode(i) for i in v)
    if tag == "d" and isinstance(v, list):
        return {decode(k): decode(val) for k, val in v}
    raise ValueError("malformed encoded value with tag %r" % tag)


# --------------------------------------------------------------------------- untrusted child
def child_main():
    """Entry point of a freshly exec'd child: job on stdin, records to fd ``argv[2]``."""
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    child_run(job, int(sys.argv[2]))


def child_run(job, fd):
    """Run the completion and emit one record per call on ``fd``. Untrusted territory:
    everything here may be tampered with by the code, which is why nothing here judges."""
    out = os.fdopen(fd, "w", buffering=1)
    dumps, write = json.dumps, out.write

    def emit(rec):
        write(dumps(rec) + "\n")

    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["code"], "solution.py", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - report anything, including SystemExit
        emit({"load_error": "%s: %s" % (type(e).__name__, str(e)[:500])})
        return
    fn = ns.get(job["entry_point"])
    if not callable(fn):
        emit({"load_error": "entry point %r is not defined by the code" % job["entry_point"]})
        return
    for i, (args, kwargs) in enumerate(job["calls"]):
        t0 = time.perf_counter()
        try:
            value = fn(*decode(args), **decode(kwargs))
            rec = {"i": i, "ok": True, "v": encode(value)}
        except BaseException as e:  # noqa: BLE001
            rec = {"i": i, "ok": False, "exc": "%s: %s" % (type(e).__name__, str(e)[:300])}
        rec["dt"] = time.perf_counter() - t0
        line = dumps(rec)
        if len(line) > MAX_ENCODED:
            line = dumps({"i": i, "ok": False, "exc": "return value too large", "dt": rec["dt"]})
        write(line + "\n")


def _child_limits(limits):
    """preexec_fn for untrusted processes: own session + rlimits (the container adds cgroups)."""
    import resource

    def apply():
        os.setsid()
        mem = int(limits.get("memory_mb", 512)) << 20
        cpu = int(math.ceil(float(limits.get("cpu_s", 30)))) + 1
        for res, val in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, int(limits.get("tmpfs_mb", 64)) << 20),
                         (resource.RLIMIT_AS, mem if limits.get("rlimit_as") else None),
                         (resource.RLIMIT_NPROC, limits.get("nproc"))):
            if val is not None:
                try:
                    resource.setrlimit(res, (val, val))
                except (ValueError, OSError):
                    pass
    return apply


# --------------------------------------------------------------------------- supervisor helpers
def set_nondumpable():
    """prctl(PR_SET_DUMPABLE, 0): same-uid code can no longer ptrace us or open /proc/<us>/*."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort; the container is the real boundary
        pass


def sweep(isolated, keep=()):
    """Kill every process in the box except pid 1, ourselves and ``keep`` (only when we own a
    private PID namespace), then wipe the scratch dirs and SysV IPC. Returns #processes killed.
    Everything is frozen first (SIGSTOP to -1), so a fork bomb cannot outrun the killing."""
    if not isolated:
        return 0
    spare = {1, os.getpid(), *keep}
    killed = 0
    for _ in range(200):
        others = _live_pids(spare)
        if not others:
            break
        try:
            os.kill(-1, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        for pid in _live_pids(spare):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in keep:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        killed += len(others)
        time.sleep(0.001)
    for d in SCRATCH_DIRS:
        _wipe(d)
    if os.path.isdir("/proc/sysvipc") and any(_sysvipc_in_use()):
        subprocess.run(["ipcrm", "-a"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return killed


def _live_pids(spare):
    """Pids in /proc that are not zombies and not in ``spare``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in spare:
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z" or _threads_left(name):
            pids.append(int(name))
    return pids


def _threads_left(pid):
    """A 'Z' leader may have live threads (its main thread called SYS_exit): the process still runs."""
    try:
        return len(os.listdir("/proc/%s/task" % pid)) > 1
    except OSError:
        return False


def _sysvipc_in_use():
    for name in ("shm", "sem", "msg"):
        try:
            with open("/proc/sysvipc/" + name) as f:
                yield len(f.readlines()) > 1
        except OSError:
            yield False


def _wipe(d):
    try:
        entries = os.listdir(d)
    except OSError:
        return
    for name in entries:
        p = os.path.join(d, name)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                _rmtree(p)
            else:
                os.unlink(p)
        except OSError:
            pass


def run_capped(argv, *, stdin_bytes=b"", timeout, cap, env, cwd, limits, pass_fds=(),
               extra_fd=None):
    """Run ``argv`` in its own session with rlimits; kill its whole process group at the
    deadline. Returns dict(rc, timed_out, stdout, stderr, extra, truncated, dt). ``extra_fd`` is
    the read end of a pipe whose write end the child inherited (collected with its own cap)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=cwd, env=env, pass_fds=pass_fds,
                         preexec_fn=_child_limits(limits), close_fds=True)
    for fd in pass_fds:
        os.close(fd)
    try:
        p.stdin.write(stdin_bytes)
        p.stdin.close()
    except OSError:
        pass
    return _collect(p, p.stdout.fileno(), p.stderr.fileno(), extra_fd, timeout, cap, t0)


class _Forked:
    """Minimal Popen look-alike for a child made with os.fork()."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(st)
        return self.returncode

    def wait(self, timeout=None):
        end = time.monotonic() + (timeout or 1e9)
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired("forked child", timeout)
            time.sleep(0.001)
        return self.returncode

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)


def fork_capped(job, *, timeout, cap, env, cwd, limits):
    """Like :func:`run_capped` for a Python job, but fork this (pristine, pre-imported) process
    instead of starting a new interpreter. Only the zygote calls this: it holds no secrets."""
    t0 = time.monotonic()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_res, w_res = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            nul = os.open(os.devnull, os.O_RDONLY)
            for src, dst in ((nul, 0), (w_out, 1), (w_err, 2), (w_res, 3)):
                os.dup2(src, dst)
            os.closerange(4, 1 << 16)
            _child_limits(limits)()
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            child_run(job, 3)
        finally:
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except BaseException:  # noqa: BLE001
                    pass
            os._exit(0)
    for fd in (w_out, w_err, w_res):
        os.close(fd)
    p = _Forked(pid)
    res = _collect(p, r_out, r_err, r_res, timeout, cap, t0)
    os.close(r_out)
    os.close(r_err)
    return res


def _collect(p, out_fd, err_fd, extra_fd, timeout, cap, t0):
    """Read a child's stdout/stderr (and result pipe) with caps until it ends or the deadline;
    then kill its whole process group."""
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    caps = {out_fd: cap, err_fd: cap}
    if extra_fd is not None:
        bufs[extra_fd] = bytearray()
        caps[extra_fd] = MAX_ENCODED * 4
    open_fds, truncated, timed_out = set(bufs), False, False
    deadline = t0 + timeout
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        exited = p.poll() is not None
        ready, _, _ = select.select(list(open_fds), [], [], min(left, 0.05 if exited else 0.5))
        if exited and not ready:
            break  # main process gone; a leftover holding the pipes open gets killed below
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            room = caps[fd] - len(bufs[fd])
            if len(chunk) > room:
                truncated = True
            bufs[fd] += chunk[:max(room, 0)]
        if truncated:
            break  # output bomb: stop now, the process is killed below
    if not open_fds:  # all pipes at EOF: the child is exiting (a dying process closes its files before
        try:          # it can be reaped), e.g. OOM-killed; wait for that, so it is not taken for a kill of ours
            p.wait(min(1.0, max(0.01, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
    killed_by_runner = p.poll() is None
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        rc = p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    out, err = bytes(bufs[out_fd]), bytes(bufs[err_fd])
    extra = bytes(bufs[extra_fd]) if extra_fd is not None else b""
    for f in (getattr(p, "stdout", None), getattr(p, "stderr", None)):
        if f is not None:
            f.close()
    if extra_fd is not None:
        os.close(extra_fd)
    return {"rc": rc, "killed_by_runner": killed_by_runner, "timed_out": timed_out, "truncated": truncated, "out": out, "err": err,
            "extra": extra, "dt": time.monotonic() - t0}


def _text(b, cap):
    s = b.decode("utf-8", "replace")
    return s if len(s) <= cap else s[:cap] + "\n...[truncated]"


def _base_env(extra=None):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp/home", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "TMPDIR": "/tmp"}
    env.update(extra or {})
    return env


def _fresh_dir():
    d = os.path.join("/tmp", "job-" + secrets.token_hex(6))
    os.makedirs(d, mode=0o700)
    os.makedirs("/tmp/home", exist_ok=True)
    return d


# --------------------------------------------------------------------------- python jobs
def run_python(job, zygote=None):
    if zygote is not None:
        return zygote.run(job)
    return run_python_here(job, fork=False)


def run_python_here(job, fork):
    lim = job["limits"]
    cap = int(lim.get("output_bytes", 16384))
    work = _fresh_dir()
    child_job = {"code": job["code"], "entry_point": job["entry_point"], "calls": job["calls"]}
    if fork:
        res = fork_capped(child_job, timeout=float(lim.get("timeout_s", 10)), cap=cap,
                          env=_base_env(), cwd=work, limits=dict(lim, cpu_s=lim.get("timeout_s", 10)))
        return _python_reply(res, cap)
    r_fd, w_fd = os.pipe()
    payload = json.dumps(child_job).encode()
    res = run_capped([sys.executable, "-I", "-S", os.path.abspath(__file__), "child", str(w_fd)],
                     stdin_bytes=payload, timeout=float(lim.get("timeout_s", 10)), cap=cap,
                     env=_base_env(), cwd=work, limits=dict(lim, cpu_s=lim.get("timeout_s", 10)),
                     pass_fds=(w_fd,), extra_fd=r_fd)
    return _python_reply(res, cap)


def _python_reply(res, cap):
    records = []
    for line in res["extra"].decode("utf-8", "replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append({"garbled": line[:200]})
    return {"kind": "python", "rc": res["rc"], "timed_out": res["timed_out"],
            "killed_by_runner": res["killed_by_runner"],
            "truncated": res["truncated"], "records": records, "dt": res["dt"],
            "stdout": _text(res["out"], cap), "stderr": _text(res["err"], cap)}


# --------------------------------------------------------------------------- rust jobs
def run_rust(job):
    """Stages, each with its own time limit: build (rustc: lib), clippy (clippy-driver lint gate),
    test (rustc: harness binary, then run it). rustc is called directly with fixed flags: no
    Cargo.toml, build script, proc macro, dependency or cargo config can take part."""
    lim = job["limits"]
    cap = int(lim.get("output_bytes", 16384))
    bindir = job.get("toolchain_bin") or "/usr/bin"
    work = _fresh_dir()
    out_dir = os.path.join(work, "out")
    os.makedirs(out_dir)
    crate, lib_rs = _write_crate(work, job["lib_rs"])
    env = _rust_env(crate, bindir)
    stages = {}
    lib_args = RUSTC_COMMON + ["--crate-type", "rlib", "--crate-name", CRATE_NAME, lib_rs]

    def stage(name, argv, timeout):
        stages[name] = _compile_stage(argv, timeout, cap, env, work, lim)
        return stages[name]["status"]

    def done(**extra):
        return dict({"kind": "rust", "stages": stages, "results": [], "stdout": "", "stderr": ""}, **extra)

    if stage("build", [os.path.join(bindir, "rustc")] + lib_args + ["--out-dir", out_dir],
             lim["build_timeout_s"]) != "pass":
        return done()
    stage("clippy", [os.path.join(bindir, "clippy-driver")] + lib_args +
          ["--emit=metadata", "-o", os.path.join(work, "check.rmeta"),
           "-F", "clippy::all", "-F", "forbidden_lint_groups"], lim["clippy_timeout_s"])
    # The hidden tests exist on disk only from here on, after the library is compiled.
    main_rs = os.path.join(work, "main.rs")
    _write(main_rs, job["main_rs"])
    t0 = time.monotonic()
    exe = os.path.join(out_dir, "harness")
    env["CARGO_CRATE_NAME"] = "harness"
    st = stage("test_build", [os.path.join(bindir, "rustc")] + RUSTC_COMMON +
               ["--crate-type", "bin", "--crate-name", "harness", main_rs, "--extern",
                "solution=" + os.path.join(out_dir, "libsolution.rlib"), "-L", out_dir,
                "-C", "prefer-dynamic", "-o", exe], lim["test_timeout_s"])
    if st != "pass":
        stages["test"] = dict(stages.pop("test_build"))
        stages["test"]["status"] = "error" if st == "fail" else st
        return done()
    left = max(1.0, lim["test_timeout_s"] - (time.monotonic() - t0))
    r, results, nonce = _run_harness(exe, work, job, left)
    status = "timeout" if r["timed_out"] else "pass"
    stages["test"] = {"status": status, "dt": time.monotonic() - t0 + stages.pop("test_build")["dt"],
                      "rc": r["rc"], "detail": ""}
    out_wo_nonce = r["out"].replace(nonce.encode(), b"<nonce>")
    return done(results=results, truncated=r["truncated"], stdout=_text(out_wo_nonce, cap),
                stderr=_text(r["err"], cap))


RUSTC_COMMON = ["--edition", "2021", "-C", "debuginfo=0", "--color", "never"]


def _rust_env(crate, bindir):
    return _base_env(dict(cargo_env(crate, bindir), CARGO_CRATE_NAME=CRATE_NAME,
                          PATH=bindir + ":" + _base_env()["PATH"]))


def _compile_stage(argv, timeout, cap, env, cwd, lim):
    """Run one compiler (rustc, clippy-driver) -> {status: pass|fail|timeout|error, dt, rc, detail}."""
    rlim = dict(lim, cpu_s=1e6, rlimit_as=False)  # compilers map far more than they use
    r = run_capped(argv, timeout=timeout, cap=cap, env=env, cwd=cwd, limits=rlim)
    status = "timeout" if r["timed_out"] else ("pass" if r["rc"] == 0 else "fail")
    detail = _text(r["err"] + r["out"], cap)
    if r["rc"] in (-9, 137) and not r["killed_by_runner"]:
        status = "error"  # killed from outside: most likely out of memory
        detail = "killed by SIGKILL (out of memory?)\n" + detail
    return {"status": status, "dt": r["dt"], "rc": r["rc"], "detail": detail}


def _run_harness(exe, work, job, left):
    """Run the compiled test harness with `left` seconds. Only the binary survives: the sources and
    build tree (hidden tests) are deleted before it runs. Each test reports `<nonce> <name> ok|FAILED`
    on stdout, with a nonce made for this run and passed on stdin; other lines are ignored.
    Returns (run record, [[name, passed], ...], nonce)."""
    lim = job["limits"]
    run_dir = _fresh_dir()
    shutil.copy(exe, os.path.join(run_dir, "harness"))
    _rmtree(work)
    nonce = secrets.token_hex(16)
    run_env = _base_env({"LD_LIBRARY_PATH": job["rust_libdir"]} if job.get("rust_libdir") else {})
    r = run_capped([os.path.join(run_dir, "harness")], stdin_bytes=(nonce + "\n").encode(),
                   timeout=left, cap=int(lim.get("output_bytes", 16384)), env=run_env, cwd=run_dir,
                   limits=dict(lim, cpu_s=left))
    results, prefix = [], nonce + " "
    for line in r["out"].decode("utf-8", "replace").splitlines():
        if line.startswith(prefix):
            parts = line[len(prefix):].split(" ")
            if len(parts) == 2 and parts[1] in ("ok", "FAILED"):
                results.append([parts[0], parts[1] == "ok"])
    return r, results, nonce


CRATE_NAME, CRATE_VERSION = "solution", "0.1.0"


def cargo_env(manifest_dir, bindir):
    """The variables Cargo sets when it compiles a library crate, so code that uses
    ``env!("CARGO_PKG_NAME")`` and friends builds here as it would under ``cargo build``."""
    major, minor, patch = CRATE_VERSION.split(".")
    env = {"CARGO_PKG_NAME": CRATE_NAME, "CARGO_PKG_VERSION": CRATE_VERSION,
           "CARGO_PKG_VERSION_MAJOR": major, "CARGO_PKG_VERSION_MINOR": minor,
           "CARGO_PKG_VERSION_PATCH": patch, "CARGO_PKG_VERSION_PRE": "",
           "CARGO_MANIFEST_DIR": manifest_dir,
           "CARGO_MANIFEST_PATH": os.path.join(manifest_dir, "Cargo.toml"),
           "CARGO_PRIMARY_PACKAGE": "1", "CARGO": os.path.join(bindir, "cargo")}
    for key in ("AUTHORS", "DESCRIPTION", "HOMEPAGE", "REPOSITORY", "LICENSE", "LICENSE_FILE",
                "RUST_VERSION", "README"):
        env["CARGO_PKG_" + key] = ""
    return env


def _write_crate(work, source, target="lib"):
    """``work/crate/{Cargo.toml,src/lib.rs}`` (``src/main.rs`` for ``target="bin"``), made read-only
    (``CARGO_MANIFEST_DIR``). -> (crate dir, source path)."""
    crate = os.path.join(work, "crate")
    rel = "src/lib.rs" if target == "lib" else "src/main.rs"
    manifest, src_path = os.path.join(crate, "Cargo.toml"), os.path.join(crate, rel)
    section = '[lib]\n' if target == "lib" else '[[bin]]\nname = "%s"\n' % CRATE_NAME
    os.makedirs(os.path.join(crate, "src"))
    _write(manifest, '[package]\nname = "%s"\nversion = "%s"\nedition = "2021"\n\n%spath = "%s"\n'
           % (CRATE_NAME, CRATE_VERSION, section, rel))
    _write(src_path, source)
    for path, mode in ((manifest, 0o444), (src_path, 0o444), (os.path.dirname(src_path), 0o555), (crate, 0o555)):
        os.chmod(path, mode)
    return crate, src_path


def _rmtree(path):
    """Remove a tree, including directories left read-only (the crate dir, or by the code)."""
    try:
        os.chmod(path, 0o700, follow_symlinks=False)   # the top too: a mode-000 dir cannot be listed
    except (OSError, NotImplementedError):
        pass
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(path, ignore_errors=True)


def _write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


# --------------------------------------------------------------------------- programs (tool calls)
def run_program(job):
    """A whole program, as a tool call runs it: Python as a script (``__main__``), Rust first built as
    the binary crate ``solution`` (std only, ``-F unsafe_code``). It reads the job's ``stdin``; what it
    printed comes back, capped. Nothing here is judged: the reply is the program's own output."""
    lim = job["limits"]
    cap = int(lim.get("output_bytes", 16384))
    work = _fresh_dir()
    if job["language"] == "rust":
        build = _build_program(job, work, cap)
        if build["status"] != "pass":
            return {"kind": "run", "build": build, "stdout": "", "stderr": build["detail"]}
        argv = [os.path.join(work, CRATE_NAME)]
    else:
        build, argv = None, [sys.executable, "-I", os.path.join(work, "main.py")]
        _write(argv[-1], job["code"])
    timeout = float(lim.get("timeout_s", 10))
    r = run_capped(argv, stdin_bytes=job.get("stdin", "").encode("utf-8", "replace"), timeout=timeout,
                   cap=cap, env=_base_env(), cwd=work, limits=dict(lim, cpu_s=timeout))
    return {"kind": "run", "build": build, "rc": r["rc"], "timed_out": r["timed_out"],
            "killed_by_runner": r["killed_by_runner"], "truncated": r["truncated"], "dt": r["dt"],
            "stdout": _cut_text(r["out"], cap, r["truncated"]), "stderr": _cut_text(r["err"], cap, r["truncated"])}


def _cut_text(b, cap, truncated):
    """A stream read up to its cap, marked as cut when it filled it."""
    s = _text(b, cap)
    return s + "\n...[truncated]" if truncated and len(b) >= cap and not s.endswith("...[truncated]") else s


def _build_program(job, work, cap):
    """rustc the program into ``work/solution``; run from the crate dir, so messages name ``src/main.rs``.
    ``-F unsafe_code`` on the command line: the code cannot lift it, and its line numbers stay its own."""
    bindir = job.get("toolchain_bin") or "/usr/bin"
    crate, _ = _write_crate(work, job["code"], "bin")
    argv = [os.path.join(bindir, "rustc")] + RUSTC_COMMON + [
        "-F", "unsafe_code", "--crate-type", "bin", "--crate-name", CRATE_NAME, "src/main.rs",
        "-o", os.path.join(work, CRATE_NAME)]
    return _compile_stage(argv, job["limits"]["build_timeout_s"], cap, _rust_env(crate, bindir), crate,
                          job["limits"])


# --------------------------------------------------------------------------- zygote
READY = b"ready\n"
ZYGOTE_START_S = 30


def zygote_main():
    """Pre-imported fork server for Python jobs. It is started by exec (so its memory never held
    the supervisor's nonce), never runs untrusted code itself, and forks one child per job."""
    set_nondumpable()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(READY)                 # only now may the supervisor run untrusted code (Zygote.ensure)
    out.flush()
    for line in inp:
        reply = run_python_here(json.loads(line), fork=True)
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()


def _runner_failed(why: str) -> dict:
    return {"kind": "python", "rc": None, "timed_out": False, "records": [], "box_error": why, "stdout": "",
            "stderr": ""}


class Zygote:
    """Supervisor-side handle; respawned whenever it dies or misbehaves."""

    def __init__(self):
        self.p = None

    def ensure(self):
        """The running zygote, started if needed; None if it did not come up. Returns only once the zygote
        is non-dumpable: until then same-uid code could open its /proc files, its stdin and stdout (our
        channel to it) among them, and forge its replies."""
        if self.p is None or self.p.poll() is not None:
            self.p = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), "zygote"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env=_base_env(), cwd="/", close_fds=True)
            ready, _, _ = select.select([self.p.stdout], [], [], ZYGOTE_START_S)
            if not ready or self.p.stdout.readline() != READY:
                self.kill()
        return self.p

    @property
    def pid(self):
        return self.p.pid if self.p is not None and self.p.poll() is None else None

    def run(self, job):
        p = self.ensure()
        if p is None:
            return _runner_failed("the Python runner did not start")
        grace = float(job["limits"].get("timeout_s", 10)) + 5
        try:
            p.stdin.write((json.dumps(job) + "\n").encode())
            p.stdin.flush()
            ready, _, _ = select.select([p.stdout], [], [], grace)
            line = p.stdout.readline() if ready else b""
            return json.loads(line)
        except (OSError, ValueError):
            self.kill()
            return _runner_failed("the job killed or confused the runner")

    def kill(self):
        if self.p is not None:
            try:
                self.p.kill()
                self.p.wait(5)
            except Exception:  # noqa: BLE001
                pass
            self.p = None


# --------------------------------------------------------------------------- supervisor
def handle(job, isolated, zygote=None):
    t0 = time.monotonic()
    try:
        if job["kind"] == "run":
            reply = run_program(job)
        else:
            reply = run_rust(job) if job["kind"] == "rust" else run_python(job, zygote)
    except Exception as e:  # noqa: BLE001 - a runner bug is an infra problem, say so
        reply = {"runner_error": "%s: %s" % (type(e).__name__, e)}
    keep = {zygote.pid} if zygote is not None and zygote.pid else set()
    reply["killed_leftovers"] = sweep(isolated, keep)
    reply["wall"] = time.monotonic() - t0
    return reply


def serve(once):
    set_nondumpable()
    isolated = os.environ.pop("SBX_ISOLATED", "") == "1" and os.getpid() != 1
    # The zygote is exec'd before we read the nonce, and sweeps spare it.
    zygote = Zygote() if (isolated and not once) else None
    if zygote is not None:
        zygote.ensure()
    stdin = sys.stdin.buffer
    nonce = stdin.readline().decode().strip()
    os.environ.clear()
    out = sys.stdout.buffer
    seq = 0
    while True:
        line = stdin.readline()
        if not line:
            if zygote is not None:
                zygote.kill()
            return
        # Jobs are authenticated: "<nonce> <seq> <json>". Code in the box can write into our
        # stdin pipe through /proc/1/fd/0 (tini's copy), but it does not know the nonce; junk it
        # left in front of the host's next line is skipped.
        prefix = ("%s %d " % (nonce, seq + 1)).encode()
        at = line.find(prefix)
        if at < 0:
            continue
        try:
            job = json.loads(line[at + len(prefix):])
        except ValueError:
            continue
        reply = handle(job, isolated, zygote)
        seq += 1
        # Leading newline: resynchronise if someone wrote a partial line to our stream.
        out.write(("\n%s %d %s\n" % (nonce, seq, json.dumps(reply))).encode())
        out.flush()
        if once:
            return


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "child":
        child_main()
    elif mode == "zygote":
        zygote_main()
    elif mode in ("serve", "once"):
        serve(once=mode == "once")
    else:
        sys.exit("usage: python_runner.py serve|once|child FD")
