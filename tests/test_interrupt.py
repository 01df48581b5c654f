"""A clean stop: `grpo train` given SIGTERM (or Ctrl-C, SIGINT) in the middle of a stage exits with one line
that says how to resume, marks the run "interrupted" (MLflow: KILLED), and `grpo resume` finishes it."""
from __future__ import annotations

import os
import signal

import pytest
import yaml

from tests import faults
from tests.conftest import tiny_config


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, how", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_stop_signal_mid_stage_says_how_to_resume_and_resume_finishes(prefect_engine, grpo_home, mlflow_uri,
                                                                      tmp_path, sig, code, how):
    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL
    from flows.cli.main import main
    from grpo_core.io import read_json
    from tasks.run_state import run_status
    cfg = tiny_config(tmp_path, run_name="s", output_dir=str(tmp_path / "runs"), pipeline_iterations=1)
    cfg_file = tmp_path / "s.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    marker = tmp_path / "in-rollout"
    proc = faults.spawn_cli(["train", "--config", str(cfg_file)],
                            [{"point": "rollout", "iteration": 1, "action": "hang", "marker": str(marker)}],
                            tmp_path, {"PREFECT_API_URL": PREFECT_API_URL.value()})
    faults.wait_for(marker, proc, 300, tmp_path / "child.log")
    os.kill(proc.pid, sig)
    assert proc.wait(60) == code
    lines = [line for line in (tmp_path / "child.log").read_text().splitlines() if line.strip()]
    assert lines[-1].startswith(f"stopped by {how}; finished stages are kept, resume with `grpo resume s "
                                f"--output-dir {tmp_path / 'runs'}`"), lines[-5:]
    assert not any("Traceback" in line for line in lines)
    run_dir = tmp_path / "runs" / "s"
    st = run_status(run_dir)
    assert st["status"] == "interrupted" and st["error"] == f"stopped by {how}"
    assert st["last_completed"] == "iter-1/curate"
    run_id = read_json(run_dir / "run.json")["mlflow_run_id"]
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "KILLED"
    assert faults.leftovers(run_dir) == []

    assert main(["resume", "s", "--output-dir", str(tmp_path / "runs")]) == 0
    assert run_status(run_dir)["status"] == "finished"
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
