"""Schedules seen firing: a real `prefect server start`, `grpo schedule --interval` in serve mode and through a
process work pool with a worker, with configs/tiny.yaml. Runs start on their own (nobody triggers them), each
gets its own run directory and MLflow run, a run still going when the next is due is not started beside it,
and `grpo schedule list/pause/resume/delete` and `grpo runs` show and manage them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from grpo_core.io import read_json, stop_process_group
from tests.test_ops_worker import PREFECT, REPO, _free_port, _wait_healthy

pytestmark = pytest.mark.slow
GRPO = str(Path(sys.executable).parent / "grpo")
INTERVAL_S = 5                 # shorter than one tiny run, so the next run is due while one is going
WAIT_S = 600                   # for two runs on a busy 2-core machine
# one iteration, no evaluation: what is checked is when runs start and end, not what they learn
QUICK = ["--set", "pipeline_iterations=1", "--set", "eval.enabled=false"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    """A Prefect server whose scheduler and runners look every few seconds, and the env that points at it."""
    tmp = tmp_path_factory.mktemp("schedules")
    home = tmp / "grpo_home"
    (home / "models").mkdir(parents=True)
    shutil.copytree(tiny_model_dir, home / "models" / "tiny-random")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
           "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_WORKER_QUERY_SECONDS": "2",
           "GRPO_HOME": str(home), "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=open(tmp / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(env["PREFECT_API_URL"], proc, 180)
        yield env, tmp
    finally:
        stop_process_group(proc)


def grpo(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([GRPO, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"grpo {' '.join(args)}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
    return out


def finished_runs(output_dir: Path) -> list[Path]:
    return sorted(d for d in output_dir.glob("run-*") if (d / "summary.json").exists()) if output_dir.exists() else []


def wait_for_runs(output_dir: Path, n: int, proc: subprocess.Popen, log: Path) -> list[Path]:
    deadline = time.time() + WAIT_S
    while len(finished_runs(output_dir)) < n:
        assert proc.poll() is None, f"the schedule's process exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"{len(finished_runs(output_dir))} of {n} runs after {WAIT_S} s:\n" + \
            log.read_text()[-3000:]
        time.sleep(2)
    return finished_runs(output_dir)


def schedule_row(env: dict, name: str) -> dict:
    rows = json.loads(grpo(env, "schedule", "list", "--json").stdout)
    return next(r for r in rows if r["name"] == name)


def flow_run_spans(env: dict, name: str) -> list[tuple[datetime, datetime]]:
    """(start, end) of every flow run of schedule `name` that started (end: now for one still going)."""
    script = f"""
import json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
with get_client(sync_client=True) as c:
    dep = c.read_deployment_by_name("grpo-training-run/{name}")
    runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
    print(json.dumps([[r.start_time.isoformat(), r.end_time.isoformat() if r.end_time else None]
                      for r in runs if r.start_time]))
"""
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    now = datetime.now(timezone.utc)
    return [(datetime.fromisoformat(s), datetime.fromisoformat(e) if e else now) for s, e in json.loads(out.stdout)]


def check_runs(env: dict, runs: list[Path], name: str) -> None:
    """Each run: its own directory and MLflow run, finished, started by schedule `name`, and shown as such."""
    states = [read_json(r / "run.json") for r in runs]
    assert all(s["status"] == "finished" and s["schedule"] == name for s in states), states
    assert len({s["mlflow_run_id"] for s in states}) == len(runs)
    listed = grpo(env, "runs", "--output-dir", str(runs[0].parent), "--json").stdout
    shown = {r["run"]: r["schedule"] for r in json.loads(listed)}
    assert all(shown[r.name] == name for r in runs), shown
    spans = sorted(flow_run_spans(env, name))
    assert len(spans) >= len(runs)
    assert max(e - s for s, e in spans).total_seconds() > INTERVAL_S     # the next run came due during one ...
    for (_, end), (start, _) in zip(spans, spans[1:]):                   # ... and waited for it to end
        assert start >= end, f"two runs of one schedule overlapped: {spans}"


def test_a_served_interval_schedule_fires_runs_one_at_a_time_and_is_managed(server):
    env, tmp = server
    out_dir = tmp / "served"
    log = tmp / "serve.log"
    serving = subprocess.Popen([GRPO, "schedule", "--interval", f"{INTERVAL_S}s", "--config", "configs/tiny.yaml",
                                "--set", f"output_dir={out_dir}", *QUICK, "--name", "every-5s"], env=env, cwd=REPO, stdout=open(log, "w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        runs = wait_for_runs(out_dir, 2, serving, log)
        row = schedule_row(env, "every-5s")
        assert row["schedule"] == "every 0:00:05" and row["work_pool"] == "(served)" and not row["paused"]
        assert row["completed"] >= 2
        check_runs(env, runs, "every-5s")
        grpo(env, "schedule", "pause", "every-5s")
        assert schedule_row(env, "every-5s")["paused"]
        grpo(env, "schedule", "resume", "every-5s")
        assert not schedule_row(env, "every-5s")["paused"]
    finally:
        stop_process_group(serving)
    grpo(env, "schedule", "delete", "every-5s")
    assert "every-5s" not in grpo(env, "schedule", "list").stdout
    missing = subprocess.run([GRPO, "schedule", "pause", "every-5s"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "no schedule named 'every-5s'" in missing.stderr


def test_an_interval_schedule_on_a_process_work_pool_fires_runs_through_a_worker(server):
    env, tmp = server
    out_dir = tmp / "pooled"
    subprocess.run([PREFECT, "work-pool", "create", "grpo-test-pool", "--type", "process"], env=env, check=True,
                   capture_output=True, timeout=120)
    printed = grpo(env, "schedule", "--interval", f"{INTERVAL_S}s", "--config", "configs/tiny.yaml", "--set",
                   f"output_dir={out_dir}", *QUICK, "--work-pool", "grpo-test-pool",
                   "--name", "pooled").stdout
    assert "prefect worker start --pool grpo-test-pool" in printed
    log = tmp / "worker.log"
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "grpo-test-pool"], env=env, cwd=tmp,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        runs = wait_for_runs(out_dir, 2, worker, log)
        assert schedule_row(env, "pooled")["work_pool"] == "grpo-test-pool"
        check_runs(env, runs, "pooled")
    finally:
        grpo(env, "schedule", "pause", "pooled")
        stop_process_group(worker)
