"""Docker backend for real: container settings, verdicts, throughput path, hygiene."""
from __future__ import annotations

import pytest

from sandbox.types import Job
from sandbox.api import score_batch
from sandbox_support import docker_backend, need_docker, py_job  # noqa: F401 - fixtures

pytestmark = pytest.mark.docker

ADD = "def f(a, b):\n    return a + b\n"
CASES = [((1, 2), 3), ((2, 2), 4)]


def _our_containers(be):
    from sandbox.docker_backend import LABEL, OWNER_LABEL, _OWNER
    return be.client.containers.list(all=True, filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={_OWNER}"]})


def test_container_is_locked_down(docker_backend):
    assert docker_backend.score_batch([py_job(ADD, CASES)])[0].status == "pass"
    (ct,) = [c for c in _our_containers(docker_backend) if c.labels.get("grpo.sandbox.language") == "python"][:1]
    hc, cfg = ct.attrs["HostConfig"], ct.attrs["Config"]
    assert hc["NetworkMode"] == "none"
    assert hc["ReadonlyRootfs"] is True
    assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd")
    assert "no-new-privileges" in hc["SecurityOpt"]
    assert hc["Memory"] > 0 and hc["Memory"] == hc["MemorySwap"]
    assert 0 < hc["PidsLimit"] <= 1024
    assert hc["NanoCpus"] > 0
    assert hc["Init"] is True
    assert "size=" in hc["Tmpfs"]["/tmp"] and "noexec" in hc["Tmpfs"]["/tmp"]
    assert cfg["User"] == "65534:65534"
    assert set(cfg["Env"]) <= {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                               "LANG=C.UTF-8", "HOME=/tmp/home", "SBX_ISOLATED=1"}
    assert all(m["RW"] is False for m in ct.attrs["Mounts"])


def test_code_runs_as_nobody_without_capabilities(docker_backend):
    code = ("import os\ndef f():\n    caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
            "    return [os.getuid(), int(caps, 16)]\n")
    v = docker_backend.score_batch([Job("python", code, {"format": "io", "cases": [{"args": [], "expected": [65534, 0]}]}, "f")])[0]
    assert v.status == "pass", v


def test_batch_verdicts_in_order(docker_backend):
    jobs = [py_job(ADD if i % 2 == 0 else "def f(a, b):\n    return a - b\n", CASES) for i in range(24)]
    vs = docker_backend.score_batch(jobs, workers=3)
    assert [v.status for v in vs] == ["pass", "fail"] * 12
    assert all(v.backend == "docker" for v in vs)


def test_supervisor_killed_by_code_is_error_and_box_is_replaced(docker_backend):
    code = "import os, signal\ndef f(a, b):\n    os.kill(-1, signal.SIGKILL)\n"
    v = docker_backend.score_batch([py_job(code, CASES)], workers=1)[0]
    assert v.status in ("error", "fail") and v.passed == 0, v
    assert docker_backend.score_batch([py_job(ADD, CASES)], workers=1)[0].status == "pass"


def test_missing_image_is_infra_error_not_reward():
    need_docker()
    from sandbox.docker_backend import DockerBackend
    with DockerBackend(images={"python": "grpo-sandbox-does-not-exist:0", "rust": "x:0"}) as be:
        v = be.score_batch([py_job(ADD, CASES)])[0]
    assert v.status == "infra_error" and "build" in v.detail


def test_nothing_survives_close_and_leftovers_are_reaped():
    need_docker()
    from sandbox.docker_backend import LABEL, OWNER_LABEL, DockerBackend, reap_leftovers
    be = DockerBackend()
    assert be.score_batch([py_job(ADD, CASES)] * 4, workers=2)[0].status == "pass"
    assert _our_containers(be)
    be.close()
    assert not [c for c in _our_containers(be) if c.labels.get("grpo.sandbox.instance") == be.instance]
    # a container left by a process that no longer exists is reaped
    import docker
    client = docker.from_env()
    orphan = client.containers.create("grpo-sandbox-python:1", ["sleep", "60"], network_mode="none",
                                      labels={LABEL: "1", OWNER_LABEL: f"{__import__('socket').gethostname()}:999999"})
    assert reap_leftovers(client) >= 1
    import docker.errors
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(orphan.id)


def test_score_batch_auto_uses_docker():
    need_docker()
    v = score_batch([py_job(ADD, CASES)], backend="auto")[0]
    assert v.status == "pass" and v.backend == "docker"


def test_require_docker_turns_skip_into_failure(monkeypatch):
    import sandbox.docker_backend as db
    import sandbox_support
    monkeypatch.setattr(db, "docker_available", lambda: False)
    monkeypatch.setenv("REQUIRE_DOCKER", "1")
    with pytest.raises(pytest.fail.Exception):
        sandbox_support.need_docker()
    monkeypatch.setenv("REQUIRE_DOCKER", "0")
    with pytest.raises(pytest.skip.Exception):
        sandbox_support.need_docker()


def test_humaneval_canonical_solutions_pass_in_docker(docker_backend):
    from sandbox_support import humaneval_jobs
    vs = docker_backend.score_batch(humaneval_jobs())
    assert [v.job_id for v in vs if v.status != "pass"] == []
