"""MLflow bookkeeping: one MLflow run per training run, logged by explicit run id (thread-safe)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from grpo_core.config import GRPOConfig
from tasks.common import read_json, write_json


def tracking_uri(cfg: GRPOConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(cfg.output_dir).resolve() / 'mlflow.db'}"


def client(cfg: GRPOConfig):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=tracking_uri(cfg))


def ui_command(cfg: GRPOConfig) -> str:
    uri = tracking_uri(cfg)
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {uri}"
    return f"open {uri} in a browser"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def start_or_resume_run(cfg: GRPOConfig, run_dir: Path, flow_run_id: str | None) -> str:
    """Create the MLflow run for this training run, or reopen the one recorded in run.json."""
    c = client(cfg)
    state_path = run_dir / "run.json"
    state = read_json(state_path) if state_path.exists() else {}
    if state.get("mlflow_run_id"):
        run_id = state["mlflow_run_id"]
        c.update_run(run_id, status="RUNNING")
    else:
        exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
        if exp is None:
            artifacts = None
            if tracking_uri(cfg).startswith("sqlite:"):
                artifacts = (Path(cfg.output_dir).resolve() / "mlartifacts").as_uri()
            exp_id = c.create_experiment(cfg.tracking.experiment_name, artifact_location=artifacts)
        else:
            exp_id = exp.experiment_id
        run = c.create_run(exp_id, run_name=run_dir.name, tags={
            "git_commit": _git_commit(), "config_hash": cfg.config_hash(), "run_dir": str(run_dir.resolve())})
        run_id = run.info.run_id
        log_params(c, run_id, cfg.flat())
        c.log_text(run_id, cfg.to_yaml(), "config.yaml")
        state["mlflow_run_id"] = run_id
        write_json(state_path, state)
    if flow_run_id:
        c.set_tag(run_id, "prefect_flow_run_id", flow_run_id)
    return run_id


def log_params(c, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])


def log_metrics(cfg: GRPOConfig, run_id: str, metrics: dict[str, float], step: int) -> None:
    """One batched call per step."""
    import time
    from mlflow.entities import Metric
    ts = int(time.time() * 1000)
    items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
    client(cfg).log_batch(run_id, metrics=items)


def logged_steps(cfg: GRPOConfig, run_id: str, key: str) -> set[int]:
    return {m.step for m in client(cfg).get_metric_history(run_id, key)}


def log_artifacts(cfg: GRPOConfig, run_id: str, local_dir: str | Path, artifact_path: str) -> None:
    client(cfg).log_artifacts(run_id, str(local_dir), artifact_path)


def end_run(cfg: GRPOConfig, run_id: str, status: str = "FINISHED") -> None:
    client(cfg).set_terminated(run_id, status=status)
