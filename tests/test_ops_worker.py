"""The scale-out path for real: a `prefect server start`, a process work pool, a deployment of
training_run made by flows/schedule.py, and a `prefect worker` that runs it (tiny model, 1 iteration)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from grpo_core.io import stop_process_group

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError("prefect server exited")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"prefect server not healthy after {timeout}s")


DEPLOY = """
import sys, asyncio
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments import run_deployment
from grpo_core.config import load_config
from flows.schedule import deploy, make_schedule
with get_client(sync_client=True) as c:
    c.create_work_pool(WorkPoolCreate(name="test-pool", type="process"), overwrite=True)
deploy(load_config(sys.argv[1]), "test-pool", make_schedule(cron="0 3 * * *"), name="worker-test")
fr = run_deployment("grpo-training-run/worker-test", timeout=0)
print("FLOW_RUN", fr.id)
"""

CHECK = """
import sys
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as c:
    fr = c.read_flow_run(sys.argv[1])
    dep = c.read_deployment_by_name("grpo-training-run/worker-test")
    print("STATE", fr.state.type.value, "CRON", dep.schedules[0].schedule.cron)
"""


@pytest.mark.slow
def test_process_work_pool_worker_runs_training(tmp_path, tiny_model_dir):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    home = tmp_path / "grpo_home"
    (home / "models").mkdir(parents=True)
    import shutil
    shutil.copytree(tiny_model_dir, home / "models" / "tiny-random")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "GRPO_HOME": str(home), "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    cfg = {"model": "tiny-random", "output_dir": str(tmp_path / "runs"), "pipeline_iterations": 1,
           "num_generations": 4, "max_completion_length": 8, "data": {"prompts_per_iteration": 2, "eval_size": 4},
           "eval": {"enabled": False}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        t0 = time.time()
        _wait_healthy(api, server, 180)
        t_server = time.time() - t0
        out = subprocess.run([sys.executable, "-c", DEPLOY, str(tmp_path / "cfg.yaml")], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        flow_run_id = out.stdout.split("FLOW_RUN")[-1].strip()
        t1 = time.time()
        w = subprocess.run([PREFECT, "worker", "start", "--pool", "test-pool", "--run-once"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        t_worker = time.time() - t1
        assert w.returncode == 0, (w.stdout + w.stderr)[-3000:]
        chk = subprocess.run([sys.executable, "-c", CHECK, flow_run_id], env=env, capture_output=True, text=True,
                             timeout=120)
        assert "STATE COMPLETED CRON 0 3 * * *" in chk.stdout, chk.stdout + chk.stderr[-2000:]
        runs = [d for d in (tmp_path / "runs").iterdir() if d.is_dir() and (d / "summary.json").exists()]
        assert len(runs) == 1 and runs[0].name.startswith("run-")       # a fresh run name per scheduled run
        from mlflow.tracking import MlflowClient
        c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
        (run,) = c.search_runs([c.get_experiment_by_name("grpo-pipeline").experiment_id])
        assert run.info.status == "FINISHED" and run.data.tags["prefect_flow_run_id"] == flow_run_id
        print(f"\nserver start {t_server:.0f} s, worker run-once (process + 1-iteration run) {t_worker:.0f} s")
    finally:
        stop_process_group(server)
