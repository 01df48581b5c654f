"""MLflow bookkeeping: one MLflow run per training run, logged by explicit run id (thread-safe)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from grpo_core.config import GRPOConfig
from grpo_core.io import read_json, write_json


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
        mlflow = Path(sys.executable).parent / "mlflow"       # the venv's own, even when it is not on PATH
        return f"{mlflow if mlflow.exists() else 'mlflow'} ui --backend-store-uri {uri}"
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
        exp_id = experiment_id(cfg)
        run = c.create_run(exp_id, run_name=run_dir.name, tags={
            "git_commit": _git_commit(), "config_hash": cfg.config_hash(), "run_dir": str(run_dir.resolve()),
            "base_model": cfg.model})
        run_id = run.info.run_id
        log_params(c, run_id, cfg.flat())
        c.log_text(run_id, cfg.to_yaml(), "config.yaml")
        state["mlflow_run_id"] = run_id
        write_json(state_path, state)
    if flow_run_id:
        c.set_tag(run_id, "prefect_flow_run_id", flow_run_id)
    return run_id


def experiment_id(cfg: GRPOConfig) -> str:
    c = client(cfg)
    exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if tracking_uri(cfg).startswith("sqlite:"):
        artifacts = (Path(cfg.output_dir).resolve() / "mlartifacts").as_uri()
    try:
        return c.create_experiment(cfg.tracking.experiment_name, artifact_location=artifacts)
    except Exception:  # noqa: BLE001 - created concurrently by another run
        exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
        if exp is None:
            raise
        return exp.experiment_id


def set_tags(cfg: GRPOConfig, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag
    client(cfg).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def file_hash(*paths: str | Path, extra: Any = None) -> str:
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:12]


def log_params(c, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param
    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])


def log_metrics(cfg: GRPOConfig, run_id: str, metrics: dict[str, float], step: int) -> bool:
    """One batched call per step, idempotent: a batch whose first metric is already logged at this step
    (a stage re-run after a kill between logging and its record) is not logged again. Returns whether
    it logged."""
    import time
    from mlflow.entities import Metric
    items = [(k, float(v)) for k, v in metrics.items() if v is not None]
    if not items:
        return False
    c = client(cfg)
    if any(m.step == step for m in c.get_metric_history(run_id, items[0][0])):
        return False
    ts = int(time.time() * 1000)
    c.log_batch(run_id, metrics=[Metric(k, v, ts, step) for k, v in items])
    return True


def logged_steps(cfg: GRPOConfig, run_id: str, key: str) -> set[int]:
    return {m.step for m in client(cfg).get_metric_history(run_id, key)}


def log_artifacts(cfg: GRPOConfig, run_id: str, local_dir: str | Path, artifact_path: str) -> None:
    client(cfg).log_artifacts(run_id, str(local_dir), artifact_path)


def end_run(cfg: GRPOConfig, run_id: str, status: str = "FINISHED") -> None:
    client(cfg).set_terminated(run_id, status=status)


# -- Model Registry -----------------------------------------------------------------------------------

def register_adapter(cfg: GRPOConfig, run_id: str, iteration: int, metrics: dict | None = None) -> dict | None:
    """Register the adapter logged at adapters/iter-<iteration> under tracking.registered_model_name.
    Returns {"name", "version", "uri"} or None when registration is off."""
    name = cfg.tracking.registered_model_name
    if not name or cfg.tracking.register_adapter == "none":
        return None
    c = client(cfg)
    from mlflow.exceptions import MlflowException
    try:
        c.create_registered_model(name, description="LoRA adapters trained by grpo-pipeline. Load one with "
                                                     "tasks.tracking.load_adapter('models:/NAME/VERSION').")
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) and "already exists" not in str(e):
            raise
    source = f"{c.get_run(run_id).info.artifact_uri}/adapters/iter-{iteration}"
    tags = {"iteration": str(iteration), "base_model": cfg.model, "run_name": cfg.run_name or "",
            "selected_by": cfg.tracking.register_adapter}
    if metrics and cfg.tracking.best_metric in metrics:
        tags[cfg.tracking.best_metric] = str(metrics[cfg.tracking.best_metric])
    mv = c.create_model_version(name, source, run_id=run_id, tags=tags)
    uri = f"models:/{name}/{mv.version}"
    set_tags(cfg, run_id, {"registered_model": uri, "best_adapter_uri": f"runs:/{run_id}/adapters/iter-{iteration}",
                           "best_iteration": str(iteration)})
    return {"name": name, "version": mv.version, "uri": uri}


def download_adapter(uri: str, dst: str | Path, tracking: str | None = None) -> Path:
    """A local copy of an adapter given a local dir, 'models:/NAME/VERSION|latest|@alias' or 'runs:/ID/PATH'."""
    if "://" not in uri and ":/" not in uri:
        p = Path(uri).expanduser()
        if not (p / "adapter_config.json").exists():
            from grpo_core.models import ModelError
            raise ModelError(f"init_adapter {uri!r} is not a LoRA adapter dir (adapter_config.json missing)")
        return p
    import mlflow.artifacts
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    if tracking:
        import mlflow
        mlflow.set_tracking_uri(tracking)
        mlflow.set_registry_uri(tracking)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    if not (local / "adapter_config.json").exists():       # downloaded as dst/<last path part>/
        found = next(local.rglob("adapter_config.json"), None)
        if found is None:
            from grpo_core.models import ModelError
            raise ModelError(f"{uri} holds no LoRA adapter (adapter_config.json missing)")
        local = found.parent
    return local


def previous_best_adapter(cfg: GRPOConfig, exclude_run_id: str | None = None) -> str | None:
    """'runs:/.../adapters/iter-k' of the most recent FINISHED run in the experiment that recorded one."""
    c = client(cfg)
    exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", order_by=["attributes.end_time DESC"],
                         max_results=50)
    for r in runs:
        if r.info.run_id != exclude_run_id and r.data.tags.get("best_adapter_uri"):
            return r.data.tags["best_adapter_uri"]
    return None


def load_adapter(model_uri: str, tracking: str | None = None, base_model: str | None = None):
    """The one call that loads a trained adapter back: returns (peft_model, tokenizer).

        from tasks.tracking import load_adapter
        model, tok = load_adapter("models:/grpo-adapter/latest", tracking="sqlite:///runs/mlflow.db")

    The base model comes from the model version's (or run's) `base_model` tag unless given."""
    import tempfile
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from grpo_core.models import load_base_model, load_tokenizer, resolve_model, select_device, select_dtype
    tracking = tracking or os.environ.get("MLFLOW_TRACKING_URI")
    c = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    if base_model is None and model_uri.startswith("models:/"):
        name, _, ver = model_uri[len("models:/"):].partition("/")
        if "@" in name and not ver:
            name, ver = name.split("@", 1)[0], "@" + name.split("@", 1)[1]
        if ver in ("", "latest"):
            mv = max(c.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
        elif ver.startswith("@"):
            mv = c.get_model_version_by_alias(name, ver[1:])
        else:
            mv = c.get_model_version(name, ver)
        base_model = mv.tags.get("base_model") or c.get_run(mv.run_id).data.tags.get("base_model")
    elif base_model is None and model_uri.startswith("runs:/"):
        base_model = c.get_run(model_uri[len("runs:/"):].split("/", 1)[0]).data.tags.get("base_model")
    if not base_model:
        raise ValueError(f"cannot tell the base model of {model_uri}; pass base_model=")
    local = download_adapter(model_uri, tempfile.mkdtemp(prefix="grpo-adapter-"), tracking)
    base_dir = resolve_model(base_model)
    device = select_device("auto")
    model = PeftModel.from_pretrained(load_base_model(base_dir, device, select_dtype("auto", device)), str(local))
    return model, load_tokenizer(local if (local / "tokenizer_config.json").exists() else base_dir)


# -- evaluation helpers (issue 7) ---------------------------------------------------------------
def log_table(cfg: GRPOConfig, run_id: str, data: dict[str, list], artifact_file: str) -> bool:
    """`MlflowClient.log_table` (a JSON table the UI shows in its evaluation view). MLflow appends to an
    existing table file, so a retried stage skips a file that is already there. True if logged."""
    c = client(cfg)
    folder, _, name = artifact_file.rpartition("/")
    if any(f.path.rpartition("/")[2] == name for f in c.list_artifacts(run_id, folder or None)):
        return False
    c.log_table(run_id, data=data, artifact_file=artifact_file)
    return True


def log_artifact(cfg: GRPOConfig, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    client(cfg).log_artifact(run_id, str(local_path), artifact_path)


def download_artifacts(cfg: GRPOConfig, run_id: str, path: str, dst: str | Path) -> Path:
    Path(dst).mkdir(parents=True, exist_ok=True)
    return Path(client(cfg).download_artifacts(run_id, path, str(dst)))


def list_artifact_paths(cfg: GRPOConfig, run_id: str, path: str | None = None) -> list[str]:
    return [f.path for f in client(cfg).list_artifacts(run_id, path)]
