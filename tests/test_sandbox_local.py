"""Local backend (no Docker): same protocol, weaker isolation, loud warning."""
from __future__ import annotations

import logging
import os
import subprocess

import pytest

from sandbox.types import Job
from sandbox.local_backend import LocalBackend, bwrap_works
from sandbox_support import local_backend, py_job, rust_job  # noqa: F401 - fixtures

ADD = "def f(a, b):\n    return a + b\n"
CASES = [((1, 2), 3), ((2, 2), 4)]


def test_local_warns_loudly(caplog):
    import sandbox.local_backend as lb
    lb._warned = False
    with caplog.at_level(logging.WARNING, logger="sandbox.local"):
        LocalBackend()
    assert "WEAKER" in caplog.text


def test_local_python_verdicts(local_backend):
    vs = local_backend.score_batch([py_job(ADD, CASES), py_job("def f(a, b):\n    return str(a + b)\n", CASES),
                                    py_job("def f(a, b):\n    1/0\n", CASES)])
    assert [v.status for v in vs] == ["pass", "fail", "fail"]
    assert "ZeroDivisionError" in vs[2].tests[0].detail
    assert vs[0].backend == "local"


@pytest.mark.skipif(not bwrap_works(), reason="bubblewrap not usable here")
def test_local_runs_in_private_namespaces_without_host_files(local_backend):
    code = ("import os\ndef f():\n    return [os.path.exists('/work'), os.path.exists('/root'), os.path.exists('/home'),"
            " len(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 1]\n")
    v = local_backend.score_batch([Job("python", code, {"format": "io", "cases": [{"args": [], "expected": [False, False, False, 1]}]}, "f")])[0]
    assert v.status == "pass", v


def test_local_leaves_no_process_or_cgroup():
    be = LocalBackend()
    code = "import os, time\ndef f(a, b):\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(3600)\n    return a + b\n"
    assert be.score_batch([py_job(code, CASES)] * 3, workers=2)[0].status == "pass"
    cgroups = [d for b in be._all if b.cg for d in b.cg.dirs]
    be.close()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert be._runner_dir not in ps  # every bwrap box of this backend (and its namespace) is gone
    assert not [d for d in cgroups if os.path.exists(d)]


@pytest.mark.slow
def test_local_rust(local_backend):
    v = local_backend.score_batch([rust_job("pub fn add(a: i32, b: i32) -> i32 { a + b }",
                                            "#[test]\nfn t() { assert_eq!(add(2, 3), 5); }")])[0]
    assert v.status == "pass", (v.detail, v.stages)


def test_humaneval_canonical_solutions_pass_and_stubs_fail(local_backend):
    from sandbox_support import humaneval_jobs
    good = local_backend.score_batch(humaneval_jobs())
    assert [v.job_id for v in good if v.status != "pass"] == []
    bad = local_backend.score_batch(humaneval_jobs("    return None\n"))
    assert [v.job_id for v in bad if v.status == "pass"] == []
