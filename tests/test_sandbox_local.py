"""Local backend (no Docker): same protocol, weaker isolation, loud warning; without bubblewrap it refuses unless
asked by name to run unisolated."""
from __future__ import annotations

import logging
import os
import subprocess

import pytest

from sandbox.types import Job
from sandbox.backends import NoIsolation
from sandbox.local_backend import LocalBackend
from sandbox_support import TRUSTED_LOCAL, local_backend, need_bwrap, py_job, rust_job  # noqa: F401 - fixtures

ADD = "def f(a, b):\n    return a + b\n"
CASES = [((1, 2), 3), ((2, 2), 4)]


def test_local_warns_loudly(caplog):
    import sandbox.local_backend as lb
    lb._warned = False
    with caplog.at_level(logging.WARNING, logger="sandbox.local"):
        be = LocalBackend(use_bwrap=False)
    be.close()
    assert "WEAKER" in caplog.text and "UNISOLATED, asked for" in caplog.text and be.name == "unisolated"


def test_without_bubblewrap_local_and_auto_refuse_and_say_how_to_fix_it(monkeypatch, tmp_path):
    """Model-written code never runs on the host unisolated by a fallback: the local backend, auto without Docker
    and a run's config check refuse where bubblewrap is not usable, naming the fixes; `unisolated` is asked by
    name."""
    import sandbox.api as api
    import sandbox.docker_backend as docker_backend
    import sandbox.local_backend as lb
    from grpo_core.config import SandboxConfig
    from grpo_core.errors import ConfigError
    monkeypatch.setattr(lb, "bwrap_problem", lambda: "bubblewrap (bwrap) is not installed")
    monkeypatch.setattr(docker_backend, "docker_available", lambda images=None: False)
    monkeypatch.setattr(api, "_BACKENDS", {})
    fixes = r"apt-get install bubblewrap.*sandbox.backend: docker.*sandbox.backend: unisolated"
    with pytest.raises(NoIsolation, match="bubblewrap \(bwrap\) is not installed: model-written code would run on "
                                          "this host as this user. Fix: install bubblewrap"):
        LocalBackend()
    with pytest.raises(NoIsolation, match="^sandbox backend local: .*" + fixes):
        api.get_backend("local")
    with pytest.raises(NoIsolation, match="^sandbox backend auto: no Docker engine with the images answers; the local sandbox "):
        api.get_backend("auto")
    for backend in ("auto", "local"):
        with pytest.raises(ConfigError, match=f"sandbox.backend is '{backend}'.*not installed.*" + fixes):
            SandboxConfig(backend=backend).check_ready({"python"})
    SandboxConfig(backend="local").check_ready(set())                   # no code to run: nothing to isolate
    SandboxConfig(backend="unisolated").check_ready({"python", "rust"})
    be = api.get_backend("unisolated")
    assert be.name == "unisolated" and not be.bwrap
    assert be.score_batch([py_job(ADD, CASES)])[0].backend == "unisolated"


def test_local_python_verdicts(local_backend):
    vs = local_backend.score_batch([py_job(ADD, CASES), py_job("def f(a, b):\n    return str(a + b)\n", CASES),
                                    py_job("def f(a, b):\n    1/0\n", CASES)])
    assert [v.status for v in vs] == ["pass", "fail", "fail"]
    assert "ZeroDivisionError" in vs[2].tests[0].detail
    assert vs[0].backend == TRUSTED_LOCAL


def test_local_runs_in_private_namespaces_without_host_files(local_backend):
    need_bwrap()
    code = ("import os\ndef f():\n    return [os.path.exists('/work'), os.path.exists('/root'), os.path.exists('/home'),"
            " len(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 1]\n")
    v = local_backend.score_batch([Job("python", code, {"format": "io", "cases": [{"args": [], "expected": [False, False, False, 1]}]}, "f")])[0]
    assert v.status == "pass", v


def test_local_leaves_no_process_or_cgroup():
    need_bwrap()
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
