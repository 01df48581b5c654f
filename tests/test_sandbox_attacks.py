"""The attack classes of BRIEF.md §5, on both backends (docker and local).

Each test runs a hostile completion and checks: the verdict is right (never "pass" for a wrong
answer), the host is unaffected, and nothing is left running or lying around afterwards.
"""
from __future__ import annotations

import os
import time

import pytest

from sandbox.types import Job
from sandbox_support import backend, listening_socket, py_job  # noqa: F401 - fixtures

pytestmark = pytest.mark.docker

CASES = [((1, 2), 3), ((2, 2), 4)]


def run(be, job):
    return be.score_batch([job], workers=1)[0]


def assert_backend_healthy(be):
    """A plain correct job still passes afterwards (nothing broke, no state leaked)."""
    v = run(be, py_job("def f(a, b):\n    return a + b\n", CASES))
    assert v.status == "pass", v


# ------------------------------------------------------------------ exit-code forging
@pytest.mark.parametrize("code", [
    "import sys\nsys.exit(0)\n",
    "import os\ndef f(a, b):\n    os._exit(0)\n",
    "import sys\ndef f(a, b):\n    sys.exit(0)\n",
    "import atexit, os\natexit.register(lambda: os._exit(0))\ndef f(a, b):\n    raise SystemExit(0)\n",
])
def test_exit_code_forging_fails(backend, code):
    v = run(backend, py_job(code, CASES))
    assert v.status in ("fail", "error") and v.passed == 0, v


def test_reexec_under_python_O_does_not_help(backend):
    code = ("import os, sys\n"
            "if sys.flags.optimize == 0:\n"
            "    os.execv(sys.executable, [sys.executable, '-O', '-c', 'print(1)'])\n"
            "def f(a, b):\n    return 0\n")
    v = run(backend, py_job(code, CASES))
    assert v.status != "pass" and v.passed == 0, v


# ------------------------------------------------------------------ always-equal and friends
@pytest.mark.parametrize("code", [
    "class E:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
    "def f(a, b):\n    return E()\n",
    "class I(int):\n    def __eq__(self, o): return True\ndef f(a, b):\n    return I(0)\n",
    "class S(str):\n    def __eq__(self, o): return True\ndef f(a, b):\n    return S('x')\n",
    "import unittest\ndef f(a, b):\n    raise unittest.SkipTest('skip me')\n",
])
def test_always_equal_objects_and_skips_fail(backend, code):
    v = run(backend, py_job(code, CASES))
    assert v.status == "fail" and v.passed == 0, v


def test_stack_peeking_finds_no_expected_values(backend):
    code = '''
import gc, inspect, sys
def f(a, b):
    seen = []
    for fr in inspect.stack():
        seen.append(fr.frame.f_locals)
    for o in gc.get_objects():
        if isinstance(o, dict) and "expected" in o:
            return o["expected"]
    for d in seen:
        for k in ("expected", "exp", "want"):
            if k in d:
                return d[k]
    return None
'''
    v = run(backend, py_job(code, CASES))
    assert v.status == "fail" and v.passed == 0, v


# ------------------------------------------------------------------ runner tampering, forged output
def test_forged_records_and_runner_patching_fail(backend):
    code = r'''
import json, os, sys
# forged records on every fd we can find, on stdout, and a forged reply line on the container stream
fake = json.dumps({"i": 0, "ok": True, "v": ["i", "3"]}) + "\n"
for fd in range(3, 20):
    try: os.write(fd, fake.encode())
    except OSError: pass
print(fake)
for path in ("/proc/1/fd/1", "/proc/self/fd/1"):
    try:
        with open(path, "w") as fh: fh.write("\n" + "0" * 32 + " 1 " + json.dumps({"records": []}) + "\n")
    except OSError: pass
try:
    open(os.environ.get("SBX_RUNNER", "/opt/sbx/python_runner.py"), "a").write("#pwned")
except OSError: pass
json.dumps = lambda *a, **k: '{"i": 1, "ok": true, "v": ["i", "4"]}'
def f(a, b):
    return a * b + 1
'''
    v = run(backend, py_job(code, CASES))
    assert v.status == "fail" and v.passed == 0, v
    assert_backend_healthy(backend)


# ------------------------------------------------------------------ resource bombs
def test_fork_bomb(backend):
    code = "import os\ndef f(a, b):\n    while True:\n        try: os.fork()\n        except OSError: pass\n"
    t0 = time.monotonic()
    v = run(backend, py_job(code, CASES, timeout_s=3))
    assert v.status in ("timeout", "error") and v.passed == 0, v
    assert time.monotonic() - t0 < 30
    assert_backend_healthy(backend)


def test_memory_bomb(backend):
    code = "def f(a, b):\n    x = []\n    while True:\n        x.append(bytearray(50 << 20))\n"
    v = run(backend, py_job(code, CASES, memory_mb=256, timeout_s=10))
    assert v.status in ("error", "fail") and v.passed == 0, v
    assert_backend_healthy(backend)


def test_disk_bomb(backend):
    code = ("import os\ndef f(a, b):\n    with open('/tmp/fill', 'wb') as fh:\n"
            "        while True:\n            fh.write(b'x' * (1 << 20))\n")
    v = run(backend, py_job(code, CASES, tmpfs_mb=16))
    assert v.status in ("fail", "error") and v.passed == 0, v
    assert_backend_healthy(backend)


def test_output_bomb(backend):
    code = "import sys\ndef f(a, b):\n    while True:\n        sys.stdout.write('x' * 65536)\n"
    t0 = time.monotonic()
    v = run(backend, py_job(code, CASES, timeout_s=20))
    assert v.status == "error" and "output limit" in v.detail, v
    assert len(v.stdout) < 20_000 and time.monotonic() - t0 < 15


def test_sleeping_past_the_deadline(backend):
    code = "import time, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ndef f(a, b):\n    time.sleep(3600)\n"
    t0 = time.monotonic()
    v = run(backend, py_job(code, CASES, timeout_s=1.5))
    assert v.status == "timeout" and v.passed == 0, v
    assert time.monotonic() - t0 < 10


# ------------------------------------------------------------------ daemons and persistence
def test_detached_daemon_does_not_survive_and_state_is_fresh(backend):
    plant = '''
import os, time, subprocess
def f(a, b):
    open("/tmp/planted", "w").write("x")
    try: open("/dev/shm/planted", "w").write("x")
    except OSError: pass
    import ctypes
    ctypes.CDLL(None).shmget(0x5B5B, 4096, 0o1000 | 0o600)  # IPC_CREAT: a SysV segment
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(1)
            open("/tmp/daemon-was-here", "w").write("x")
            time.sleep(3600)
        os._exit(0)
    return a + b
'''
    assert run(backend, py_job(plant, CASES)).status == "pass"
    time.sleep(1.5)
    probe = '''
import os
def f(a, b):
    mine = {1, os.getpid(), os.getppid()}
    others = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) not in mine:
            try:
                cmd = open("/proc/%s/cmdline" % p, "rb").read()
            except OSError:
                continue
            if b"sleep" in cmd or b"solution" in cmd or b"planted" in cmd:
                others.append(p)
    leftovers = [p for p in ("/tmp/planted", "/dev/shm/planted", "/tmp/daemon-was-here") if os.path.exists(p)]
    import ctypes
    if ctypes.CDLL(None).shmget(0x5B5B, 0, 0) != -1:
        leftovers.append("sysv-shm")
    return [leftovers, others]
'''
    v = run(backend, py_job(probe, [((1, 2), [[], []])]))
    assert v.status == "pass", v


# ------------------------------------------------------------------ secrets and network
def test_secret_reading(backend, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    os.environ["GRPO_TEST_SECRET"] = "hunter2"
    code = f'''
import os
def f():
    found = []
    try: found.append(open({str(secret)!r}).read())
    except OSError: pass
    found.append(os.environ.get("GRPO_TEST_SECRET", ""))
    for p in ("/root/.ssh/id_rsa", "/etc/shadow", "/proc/1/environ"):
        try: found.append(open(p).read()[:100])
        except OSError: pass
    return "hunter2" in "".join(found)
'''
    v = run(backend, Job("python", code, {"format": "io", "cases": [{"args": [], "expected": False}]}, "f"))
    assert v.status == "pass", v  # expected False: the secret was not reachable


def test_no_network_egress(backend):
    srv, hits = listening_socket()
    port = srv.getsockname()[1]
    code = f'''
import socket
def f():
    ok = []
    for host in ("127.0.0.1", "172.17.0.1", "1.1.1.1", "deb.debian.org"):
        try:
            socket.create_connection((host, {port} if host[0].isdigit() and not host.startswith("1.1") else 80), timeout=2).close()
            ok.append(host)
        except OSError:
            pass
    return ok
'''
    v = run(backend, Job("python", code, {"format": "io", "cases": [{"args": [], "expected": []}]}, "f"))
    srv.close()
    assert v.status == "pass", v
    assert not hits


def test_supervisor_memory_and_fds_are_out_of_reach(backend):
    """The runner processes are non-dumpable: same-uid code cannot read their environment,
    memory or file descriptors (where the nonce and the reply channel live)."""
    code = """
import os
def f():
    me = os.getpid()
    reached = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in (1, me):
            continue
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read()
        except OSError:
            continue
        if b"python_runner" not in cmd:
            continue
        for what in ("environ", "mem", "fd/0", "fd/1"):
            try:
                open("/proc/%s/%s" % (p, what), "rb" if what != "fd/1" else "wb").close()
                reached.append(what)
            except OSError:
                pass
    return reached
"""
    v = run(backend, Job("python", code, {"format": "io", "cases": [{"args": [], "expected": []}]}, "f"))
    assert v.status == "pass", v


def test_injected_jobs_and_junk_on_the_supervisor_stdin_change_nothing(backend):
    """Code can open tini's stdin pipe (/proc/1/fd/0) for writing: fake jobs without the nonce,
    and a partial line in front of the host's next job, must not shift or forge any verdict."""
    code = r"""
import json
def f(a, b):
    fake = {"kind": "python", "code": "def f(a, b):\n    return 3\n", "entry_point": "f",
            "calls": [[["t", [["i", "1"], ["i", "2"]]], ["d", []]]], "limits": {}}
    for path in ("/proc/1/fd/0",):
        try:
            with open(path, "w") as fh:
                fh.write(json.dumps(fake) + "\n" + "0" * 32 + " 2 " + json.dumps(fake) + "\njunk-without-newline")
        except OSError:
            pass
    return 0
"""
    vs = backend.score_batch([py_job(code, CASES), py_job("def f(a, b):\n    return a * b\n", CASES),
                              py_job("def f(a, b):\n    return a + b\n", CASES)], workers=1)
    assert [v.status for v in vs] == ["fail", "fail", "pass"], vs
    assert [v.passed for v in vs] == [0, 1, 2]


# ------------------------------------------------------------------ a later audit: verdict forging
def test_junk_records_are_a_failure_not_an_infra_error(backend):
    """A non-object line on the results pipe crashed the host's judge: infra_error, reward None (dropped)."""
    for junk in (b"[]\n", b"0\n", b'"load_error"\n'):
        code = f"import os\nos.write(3, {junk!r})\ndef f(a, b):\n    return a * b + 1\n"
        v = run(backend, py_job(code, CASES))
        assert v.status == "fail" and v.passed == 0, v


def test_outputs_cannot_steer_which_asserts_count(backend):
    """Asserts in a loop over an output ran 0 times when planned, N times when judged: N passing asserts
    filled every slot and the real asserts after them were cut off."""
    check = ("def check(candidate):\n"
             "    for w in candidate('a b'):\n"
             "        assert w in ('a', 'b')\n"
             "    assert candidate('x y z') == ['x', 'y', 'z']\n"
             "    assert candidate('') == []\n")
    bad = "def split_words(s):\n    return ['a'] * 50\n"
    v = run(backend, Job("python", bad, {"format": "assert", "check": check}, "split_words"))
    assert v.status == "fail" and v.passed == 0, v


# ------------------------------------------------------------------ processes and state that outlive a job
def test_thread_only_exit_does_not_survive_the_sweep(backend):
    """The leader of a process whose main thread called SYS_exit shows as 'Z' while its threads run."""
    plant = '''
import os, time, threading, ctypes
def f(a, b):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            def spin():
                while True:
                    open("/tmp/zombie-was-here", "w").write(str(os.getpid()))
                    time.sleep(0.2)
            threading.Thread(target=spin).start()
            ctypes.CDLL(None).syscall(60, 0)
        os._exit(0)
    return a + b
'''
    assert run(backend, py_job(plant, CASES)).status == "pass"
    time.sleep(1.5)
    probe = "import os\ndef f(a, b):\n    return os.path.exists('/tmp/zombie-was-here')\n"
    v = run(backend, py_job(probe, [((1, 2), False)]))
    assert v.status == "pass", v


def test_unreadable_dirs_and_message_queues_are_wiped(backend):
    """A mode-000 directory in /tmp defeated the wipe (state and a full disk for the next completions);
    POSIX message queues were never wiped."""
    plant = '''
import ctypes, os
def f(a, b):
    os.makedirs("/tmp/keep/sub")
    open("/tmp/keep/sub/fill", "wb").write(b"x" * (8 << 20))
    os.chmod("/tmp/keep", 0)
    libc = ctypes.CDLL(None)
    fd = libc.mq_open(b"/leak", os.O_CREAT | os.O_RDWR, 0o600, None)
    return [fd >= 0, libc.mq_send(fd, b"x", 1, 0) == 0 if fd >= 0 else False]
'''
    assert run(backend, py_job(plant, [((1, 2), [True, True])])).status == "pass"
    probe = '''
import ctypes, os, shutil
def f(a, b):
    return [os.path.lexists("/tmp/keep"), shutil.disk_usage("/tmp").used > (4 << 20),
            ctypes.CDLL(None).mq_open(b"/leak", os.O_RDWR, 0, None) >= 0]
'''
    v = run(backend, py_job(probe, [((1, 2), [False, False, False])]))
    assert v.status == "pass", v
