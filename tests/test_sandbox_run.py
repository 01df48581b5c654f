"""Run jobs (`sandbox.api.run_programs`, the path a tool call takes) for real, on both backends: the
program's output comes back, and the attack classes that scoring survives (tests/test_sandbox_attacks.py,
tests/test_sandbox_rust_harness.py) are survived here too: no network, no host file read or written, the
limits hold, nothing outlives its run, and the containers are reaped.
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from sandbox.api import run_program, run_programs
from sandbox.types import Limits, Program
from sandbox_support import backend, listening_socket, need_docker  # noqa: F401 - fixtures

pytestmark = pytest.mark.docker

SECRET = "hunter2-run"


def run(be, program: Program):
    return be.run_batch([program], workers=1)[0]


def py(code: str, stdin: str = "", **limits) -> Program:
    return Program("python", code, stdin, Limits(**limits) if limits else None)


def rs(code: str, **limits) -> Program:
    lim = Limits.for_language("rust")
    for k, v in limits.items():
        setattr(lim, k, v)
    return Program("rust", code, limits=lim)


def assert_healthy(be):
    """A plain program still runs afterwards (nothing broke, no state leaked)."""
    out = run(be, py("print(input()[::-1])", stdin="olleh\n"))
    assert (out.status, out.stdout) == ("ok", "hello\n"), out


# ------------------------------------------------------------------ what a run returns
def test_outputs_come_back_in_order_with_stdin_and_exit_status(backend):
    outs = backend.run_batch([
        py("import sys\nprint(__name__, sys.stdin.read().upper())", stdin="abc"),
        py("import sys\nprint('partial')\nsys.exit(3)"),
        py("raise KeyError('k')"),
        py(""),
        Program("cobol", "DISPLAY 'HI'."),
        py("print('x' * 100_000)", output_bytes=1000),
    ], workers=2)
    assert [(o.status, o.exit_code) for o in outs] == [("ok", 0), ("error", 3), ("error", 1), ("error", None),
                                                       ("infra_error", None), ("error", None)]
    assert outs[0].stdout == "__main__ ABC\n" and outs[1].stdout == "partial\n" and "exit status 3" in outs[1].detail
    assert outs[2].stderr.rstrip().endswith("KeyError: 'k'") and "empty program" in outs[3].detail
    assert "cobol" in outs[4].detail
    assert outs[5].stdout.endswith("\n...[truncated]") and len(outs[5].stdout) < 1100
    assert "output limit" in outs[5].detail
    assert all(o.backend == backend.name and o.duration_s > 0 for o in outs)


def test_rust_builds_runs_and_reports_compile_errors(backend):
    ok, bad, unsafe = _rust_basics(backend)
    assert (ok.status, ok.stdout) == ("ok", "solution 42\n"), ok
    assert (bad.status, bad.exit_code, bad.detail) == ("error", None, "compile error")
    assert "src/main.rs:2:" in bad.stderr and "overflow" in bad.stderr.lower()
    assert unsafe.status == "error" and "unsafe" in unsafe.stderr and unsafe.stdout == ""


def _rust_basics(be):
    reads_stdin = ('use std::io::Read;\nfn main() {\n    let mut s = String::new();\n'
                   '    std::io::stdin().read_to_string(&mut s).unwrap();\n'
                   '    println!("{} {}", env!("CARGO_PKG_NAME"), s.trim().parse::<i64>().unwrap() * 2);\n}\n')
    programs = [Program("rust", reads_stdin, "21\n"), rs("fn main() {\n    let x: u8 = 300;\n}\n"),
                rs('#![allow(unsafe_code)]\nfn main() {\n    let x = 5;\n    println!("{}", unsafe { *(&x as *const i32) });\n}\n')]
    return be.run_batch(programs, workers=2)


# ------------------------------------------------------------------ Python attacks, as whole programs
def test_fork_bomb(backend):
    t0 = time.monotonic()
    out = run(backend, py("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                          timeout_s=3))
    assert out.status in ("timeout", "error"), out
    assert time.monotonic() - t0 < 30
    assert_healthy(backend)


def test_memory_bomb(backend):
    out = run(backend, py("x = []\nwhile True:\n    x.append(bytearray(50 << 20))\n", memory_mb=256))
    assert out.status == "error" and ("MemoryError" in out.stderr or "out of memory" in out.detail), out
    assert_healthy(backend)


def test_disk_bomb(backend):
    out = run(backend, py("with open('/tmp/fill', 'wb') as fh:\n    while True:\n        fh.write(b'x' * (1 << 20))\n",
                          tmpfs_mb=16))
    assert out.status == "error", out
    assert_healthy(backend)


def test_output_bomb(backend):
    t0 = time.monotonic()
    out = run(backend, py("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", timeout_s=20))
    assert out.status == "error" and "output limit" in out.detail, out
    assert len(out.stdout) < 20_000 and out.stdout.endswith("...[truncated]")
    assert time.monotonic() - t0 < 15


def test_sleeping_past_the_deadline(backend):
    t0 = time.monotonic()
    out = run(backend, py("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(3600)\n",
                          timeout_s=1.5))
    assert out.status == "timeout" and out.exit_code is None, out
    assert time.monotonic() - t0 < 10


PLANT = '''
import ctypes, os, time
open("/tmp/planted", "w").write("x")
try:
    open("/dev/shm/planted", "w").write("x")
except OSError:
    pass
ctypes.CDLL(None).shmget(0x5B5C, 4096, 0o1000 | 0o600)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1)
        open("/tmp/daemon-was-here", "w").write("x")
        time.sleep(3600)
    os._exit(0)
print("planted")
'''
PROBE = '''
import ctypes, os
mine = {1, os.getpid(), os.getppid()}
others = []
for p in os.listdir("/proc"):
    if p.isdigit() and int(p) not in mine:
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read()
        except OSError:
            continue
        if b"sleep" in cmd or b"planted" in cmd or b"main.py" in cmd:
            others.append(p)
left = [p for p in ("/tmp/planted", "/dev/shm/planted", "/tmp/daemon-was-here") if os.path.exists(p)]
if ctypes.CDLL(None).shmget(0x5B5C, 0, 0) != -1:
    left.append("sysv-shm")
print(left, others)
'''


def test_detached_daemon_does_not_survive_and_state_is_fresh(backend):
    # Limits of their own: both programs run in the same (only) box of that pool.
    assert run(backend, py(PLANT, pids=63)).stdout == "planted\n"
    time.sleep(1.5)
    out = run(backend, py(PROBE, pids=63))
    assert (out.status, out.stdout) == ("ok", "[] []\n"), out


def test_host_files_and_environment_are_out_of_reach(backend, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    os.environ["GRPO_TEST_SECRET"] = SECRET
    target = tmp_path / "written-from-the-box"
    code = f'''
import os
found = []
for p in ({str(secret)!r}, "/root/.ssh/id_rsa", "/etc/shadow", "/proc/1/environ"):
    try:
        found.append(open(p).read()[:100])
    except OSError:
        pass
found.append(os.environ.get("GRPO_TEST_SECRET", ""))
print({SECRET!r} in "".join(found))
for p in ({str(target)!r}, "/etc/grpo-probe", "/usr/grpo-probe", "/grpo-probe"):
    try:
        open(p, "w").write("x")
        print("wrote", p)
    except OSError:
        pass
'''
    out = run(backend, py(code))
    assert (out.status, out.stdout) == ("ok", "False\n"), out
    assert not target.exists()


def test_no_network_egress(backend):
    srv, hits = listening_socket()
    port = srv.getsockname()[1]
    code = f'''
import socket
for host, port in (("127.0.0.1", {port}), ("172.17.0.1", {port}), ("1.1.1.1", 80), ("deb.debian.org", 80)):
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("reached", host)
    except OSError:
        pass
'''
    out = run(backend, py(code))
    srv.close()
    assert (out.status, out.stdout) == ("ok", ""), out
    assert not hits


def test_supervisor_memory_and_fds_are_out_of_reach(backend):
    code = '''
import os
reached = []
for p in os.listdir("/proc"):
    if not p.isdigit() or int(p) in (1, os.getpid()):
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
print(reached)
'''
    out = run(backend, py(code))
    assert (out.status, out.stdout) == ("ok", "[]\n"), out


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="needs root (to run the zygote as another user) and the system's python3")
def test_the_zygote_is_non_dumpable_before_untrusted_code_can_run():
    """The supervisor starts untrusted code as soon as `Zygote.ensure` returns; by then the zygote must be
    non-dumpable (its /proc files root's), or same-uid code could write to its stdout and forge replies.
    Checked right after `ensure` returns, as an unprivileged user, without the sandbox around it."""
    import shutil
    import tempfile

    from sandbox.backends import RUNNER_PATH
    check = ("import os, sys; sys.path.insert(0, sys.argv[1]); import python_runner as r\n"
             "owners = []\n"
             "for _ in range(5):\n"
             "    z = r.Zygote(); p = z.ensure(); owners.append(os.stat('/proc/%d/environ' % p.pid).st_uid); z.kill()\n"
             "print(owners)\n")

    def drop():
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)

    with tempfile.TemporaryDirectory(dir="/tmp") as d:     # pytest's tmp_path is closed to other users
        os.chmod(d, 0o755)
        shutil.copy(RUNNER_PATH, os.path.join(d, "python_runner.py"))
        os.chmod(os.path.join(d, "python_runner.py"), 0o644)
        out = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", check, d], capture_output=True, text=True,
                             cwd="/", preexec_fn=drop, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 0, 0, 0, 0]", out.stdout


def test_injected_jobs_and_junk_on_the_supervisor_stdin_change_nothing(backend):
    code = r'''
import json
fake = {"kind": "run", "language": "python", "code": "print('forged')", "stdin": "", "limits": {}}
try:
    with open("/proc/1/fd/0", "w") as fh:
        fh.write(json.dumps(fake) + "\n" + "0" * 32 + " 2 " + json.dumps(fake) + "\njunk-without-newline")
except OSError:
    pass
print("injected")
'''
    outs = backend.run_batch([py(code), py("print('second')"), py("print('third')")], workers=1)
    assert [o.stdout for o in outs] == ["injected\n", "second\n", "third\n"], outs


def test_killing_the_supervisor_is_an_error_and_the_box_is_replaced(backend):
    out = run(backend, py("import os, signal\nprint('bye', flush=True)\nos.kill(-1, signal.SIGKILL)\n"))
    assert out.status in ("error", "ok"), out
    assert_healthy(backend)


# ------------------------------------------------------------------ Rust attacks, as whole programs
RUST_ATTACKS = {
    # name: (program, limits)
    "include_host_file": ('const S: &str = include_str!("/etc/shadow");\nfn main() { println!("{}", S.len()); }', {}),
    "unsafe_allowed": ('#![allow(unsafe_code)]\n'
                       'fn main() { let x = 1; println!("{}", unsafe { *(&x as *const i32) }); }', {}),
    "extern_exit": ('extern "C" { fn _exit(c: i32) -> !; }\nfn main() { unsafe { _exit(0) } }', {}),
    "proc_macro": ('#![crate_type = "proc-macro"]\nextern crate proc_macro;\n#[proc_macro]\n'
                   'pub fn m(i: proc_macro::TokenStream) -> proc_macro::TokenStream { i }\nfn main() {}', {}),
    "macro_bomb": ('macro_rules! boom { ($($t:tt)*) => { boom!($($t)* $($t)*); } }\nboom!(x);\nfn main() {}',
                   {"build_timeout_s": 15, "memory_mb": 768}),
    "secrets": ('fn main() {\n'
                '    println!("compile-time {}", option_env!("GRPO_TEST_SECRET").unwrap_or("none"));\n'
                '    println!("run-time {}", std::env::var("GRPO_TEST_SECRET").unwrap_or_default());\n'
                '    for p in ["SECRET_PATH", "/etc/shadow", "/proc/1/environ"] {\n'
                '        if std::fs::read_to_string(p).unwrap_or_default().contains("SECRET_VALUE") {\n'
                '            println!("leaked {}", p);\n        }\n'
                '    }\n'
                '    for p in ["TARGET_PATH", "/etc/grpo-probe", "/grpo-probe"] {\n'
                '        if std::fs::write(p, "x").is_ok() { println!("wrote {}", p); }\n    }\n}\n', {}),
    "network": ('use std::net::TcpStream;\nuse std::time::Duration;\nfn main() {\n'
                '    for a in ["127.0.0.1:PORT", "172.17.0.1:PORT", "1.1.1.1:80"] {\n'
                '        let addr = a.parse().unwrap();\n'
                '        if TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok() {\n'
                '            println!("reached {}", a);\n        }\n'
                '    }\n    println!("done");\n}\n', {}),
    "process_flood": ('fn main() {\n    loop {\n        let _ = std::process::Command::new("/bin/sh").arg("-c").arg("sleep 100").spawn();\n'
                      '    }\n}\n', {"timeout_s": 3}),
    "memory_bomb": ('fn main() {\n    let mut v: Vec<Vec<u8>> = Vec::new();\n    loop { v.push(vec![1u8; 50 << 20]); }\n}\n',
                    {"memory_mb": 512}),
    "output_bomb": ('fn main() {\n    let s = "x".repeat(65536);\n    loop { print!("{}", s); }\n}\n', {"timeout_s": 20}),
    "sleeper": ('fn main() { std::thread::sleep(std::time::Duration::from_secs(3600)); }', {"timeout_s": 2}),
}
RUST_DAEMON = ('fn main() {\n    std::process::Command::new("python3").arg("-c")\n'
               '        .arg("import os, time; os.setsid(); open(\'/tmp/planted\', \'w\').write(\'x\'); time.sleep(3600)")\n'
               '        .spawn().unwrap();\n    std::thread::sleep(std::time::Duration::from_millis(500));\n'
               '    println!("planted");\n}\n')
RUST_PROBE = ('fn main() {\n    let mut found = Vec::new();\n'
              '    for e in std::fs::read_dir("/proc").unwrap().flatten() {\n'
              '        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {\n'
              '            let s = String::from_utf8_lossy(&c).to_string();\n'
              '            if s.contains("3600") || s.contains("sleep") { found.push(s); }\n        }\n    }\n'
              '    println!("{:?} {}", found, std::path::Path::new("/tmp/planted").exists());\n}\n')


@pytest.fixture(scope="module")
def rust_outputs(backend, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rust-run")
    secret, target = tmp / "secret.txt", tmp / "written-from-the-box"
    secret.write_text(SECRET)
    os.environ["GRPO_TEST_SECRET"] = SECRET
    srv, hits = listening_socket()
    replace = {"SECRET_VALUE": SECRET, "SECRET_PATH": str(secret), "TARGET_PATH": str(target),
               "PORT": str(srv.getsockname()[1])}
    programs = []
    for code, limits in RUST_ATTACKS.values():
        for key, value in replace.items():
            code = code.replace(key, value)
        programs.append(rs(code, **limits))
    t0 = time.monotonic()
    outs = backend.run_batch(programs, workers=2)
    elapsed = time.monotonic() - t0
    srv.close()
    daemon, probe = (run(backend, rs(code, pids=255)) for code in (RUST_DAEMON, RUST_PROBE))
    return dict(zip(RUST_ATTACKS, outs), daemon=daemon, probe=probe, hits=hits, target=target, elapsed=elapsed)


@pytest.mark.parametrize("name", ["include_host_file", "unsafe_allowed", "extern_exit", "proc_macro"])
def test_rust_compile_time_attacks_do_not_build(rust_outputs, name):
    out = rust_outputs[name]
    assert out.status == "error" and out.detail == "compile error" and out.stdout == "", out


def test_rust_macro_bomb_is_bounded(rust_outputs):
    out = rust_outputs["macro_bomb"]
    assert out.status in ("error", "timeout") and out.exit_code is None, out


def test_rust_program_reads_and_writes_nothing_of_the_host(rust_outputs):
    out = rust_outputs["secrets"]
    assert (out.status, out.stdout) == ("ok", "compile-time none\nrun-time \n"), out
    assert not rust_outputs["target"].exists()


def test_rust_program_has_no_network(rust_outputs):
    out = rust_outputs["network"]
    assert (out.status, out.stdout) == ("ok", "done\n"), out
    assert not rust_outputs["hits"]


def test_rust_resource_bombs_are_contained(rust_outputs):
    assert rust_outputs["process_flood"].status in ("timeout", "error"), rust_outputs["process_flood"]
    memory = rust_outputs["memory_bomb"]
    assert memory.status == "error" and memory.exit_code != 0, memory
    output = rust_outputs["output_bomb"]
    assert output.status == "error" and "output limit" in output.detail and output.stdout.endswith("...[truncated]")
    assert rust_outputs["sleeper"].status == "timeout"
    assert rust_outputs["elapsed"] < 120


def test_rust_daemon_does_not_survive(rust_outputs):
    assert rust_outputs["daemon"].stdout == "planted\n", rust_outputs["daemon"]
    assert (rust_outputs["probe"].status, rust_outputs["probe"].stdout) == ("ok", "[] false\n"), rust_outputs["probe"]


# ------------------------------------------------------------------ Docker: the same boxes, reaped
def test_run_boxes_are_locked_down_and_reaped():
    need_docker()
    from sandbox.docker_backend import LABEL, DockerBackend
    be = DockerBackend()
    outs = be.run_batch([py("print(1)"), rs('fn main() { println!("1"); }')], workers=2)
    assert [(o.status, o.stdout) for o in outs] == [("ok", "1\n"), ("ok", "1\n")], outs
    ours = {"label": [f"{LABEL}=1", f"grpo.sandbox.instance={be.instance}"]}
    mine = be.client.containers.list(all=True, filters=ours)
    assert {c.labels["grpo.sandbox.language"] for c in mine} == {"python", "rust"}
    for ct in mine:
        hc = ct.attrs["HostConfig"]
        assert hc["NetworkMode"] == "none" and hc["ReadonlyRootfs"] is True and hc["CapDrop"] == ["ALL"]
        assert hc["Memory"] == hc["MemorySwap"] > 0 and hc["PidsLimit"] > 0
    be.close()
    assert not be.client.containers.list(all=True, filters=ours)


def test_run_program_auto_picks_a_backend():
    need_docker()
    out = run_program(py("print('auto')"))
    assert (out.status, out.stdout, out.backend) == ("ok", "auto\n", "docker")
    assert run_programs([]) == []
