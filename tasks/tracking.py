"""MLflow bookkeeping: one MLflow run per training run, logged by explicit run id (thread-safe)."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.io import read_json, read_jsonl, write_json
from grpo_core.rollout.sampling import model_token_count, readable_conversation
from grpo_core.evaluation.task_identity import registered_model_name
from tasks.retry import CUT_OFF_MESSAGES


def tracking_uri(cfg: GRPOConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(cfg.output_dir).resolve() / 'mlflow.db'}"


def store_exists(cfg: GRPOConfig) -> bool:
    """Whether the tracking store is there to read: a SQLite file that does not exist yet is not (reading it
    would create it); a server is."""
    uri = tracking_uri(cfg)
    return not uri.startswith("sqlite:///") or Path(uri[len("sqlite:///"):]).is_file()


def check_reachable(cfg: GRPOConfig, timeout: float = 3.0) -> None:
    """Before a run: an http(s) tracking server accepts a connection within `timeout` seconds, so that a
    server that is down fails now, not after MLflow's minutes of retries. Raises ConfigError."""
    import socket
    from urllib.parse import urlsplit
    uri = tracking_uri(cfg)
    if not uri.startswith(("http://", "https://")):
        return
    field = "tracking.tracking_uri" if cfg.tracking.tracking_uri else "MLFLOW_TRACKING_URI"
    try:
        u = urlsplit(uri)
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        why = f"no answer within {timeout:g} s" if isinstance(e, TimeoutError) else \
            getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ConfigError(f"{field}: the MLflow server {uri} does not answer ({why}). Fix: start it (e.g. `mlflow "
                          f"server --host {u.hostname} --port {u.port}`), point {field} at a running server, or unset "
                          f"it to log to a local SQLite store under output_dir") from e


def _again_if_cut_off(read: Callable, attempts: int = 3, wait_s: float = 1.0) -> Callable:
    """`read`, made again (after `wait_s`) when its answer was cut off (CUT_OFF_MESSAGES); reads only, which are
    safe to repeat. MLflow itself retries a connection that is refused or times out, not one that breaks mid-answer."""
    @functools.wraps(read)
    def call(*args, **kwargs):
        for attempt in range(attempts):
            try:
                return read(*args, **kwargs)
            except Exception as e:
                if attempt == attempts - 1 or not any(m in str(e).lower() for m in CUT_OFF_MESSAGES):
                    raise
                time.sleep(wait_s)
    return call


@functools.cache
def _client_class():
    from mlflow.tracking import MlflowClient

    class Client(MlflowClient):
        """MlflowClient whose reads (get_*, search_*) are made again when the answer was cut off."""
        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            return _again_if_cut_off(attr) if name.startswith(("get_", "search_")) and callable(attr) else attr
    return Client


def client(cfg: GRPOConfig):
    """A client for this run's store; the registry lives in the same store (never the process-global
    registry URI that an earlier `load_adapter` in this process may have set)."""
    uri = tracking_uri(cfg)
    return _client_class()(tracking_uri=uri, registry_uri=uri)


# The MLflow 3 UI shows an experiment in its "GenAI" or its "Model training" view. Which one is not read from
# the experiment: the URL's workflowType parameter decides, else the browser's last choice (GenAI at first).
# A link to this run's experiment therefore carries it.
TRAINING_VIEW = "workflowType=machine_learning"


def experiment_url(base_url: str, experiment_id: str) -> str:
    """The experiment's runs in the UI's Model training view: base_url/#/experiments/<id>?workflowType=..."""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}?{TRAINING_VIEW}"


def ui_command(cfg: GRPOConfig) -> str:
    """How to see this run: the `mlflow ui` command for a SQLite store, then the experiment's URL."""
    uri = tracking_uri(cfg)
    exp = client(cfg).get_experiment_by_name(cfg.tracking.experiment_name)
    exp_id = exp.experiment_id if exp is not None else "0"
    if uri.startswith("sqlite:"):
        mlflow = Path(sys.executable).parent / "mlflow"       # the venv's own, even when it is not on PATH
        return (f"{mlflow if mlflow.exists() else 'mlflow'} ui --backend-store-uri {uri}   then open "
                f"{experiment_url('http://127.0.0.1:5000', exp_id)}")
    return f"open {experiment_url(uri, exp_id)} in a browser"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@contextlib.contextmanager
def _store_creation_lock(cfg: GRPOConfig):
    """Runs that start at once against one new SQLite store would each create its tables (and one would
    fail): the first MLflow calls of a run hold an exclusive lock on `<db>.lock` beside the store."""
    uri = tracking_uri(cfg)
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock_path = Path(uri[len("sqlite:///"):] + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def start_or_resume_run(cfg: GRPOConfig, run_dir: Path, flow_run_id: str | None) -> str:
    """Create the MLflow run for this training run, or reopen the one recorded in run.json."""
    with _store_creation_lock(cfg):
        return _start_or_resume_run(cfg, run_dir, flow_run_id)


def _start_or_resume_run(cfg: GRPOConfig, run_dir: Path, flow_run_id: str | None) -> str:
    c = client(cfg)
    state_path = run_dir / "run.json"
    state = read_json(state_path) if state_path.exists() else {}
    if state.get("mlflow_run_id"):
        run_id = state["mlflow_run_id"]
        c.update_run(run_id, status="RUNNING")
    else:
        from grpo_core.kernels import cpu_features          # imports torch: only where a run starts
        exp_id = experiment_id(cfg)
        run = c.create_run(exp_id, run_name=run_dir.name, tags={
            "git_commit": git_commit(), "config_hash": cfg.config_hash(), "run_dir": str(run_dir.resolve()),
            "base_model": cfg.model, "cpu": cpu_features.detect().summary(), **source_tags()})
        run_id = run.info.run_id
        log_params(c, run_id, cfg.flat())
        c.log_text(run_id, cfg.to_yaml(), "config.yaml")
        state["mlflow_run_id"] = run_id
        write_json(state_path, state)
    if flow_run_id:
        c.set_tag(run_id, "prefect_flow_run_id", flow_run_id)
    return run_id


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"


def source_tags(argv: list[str] | None = None) -> dict[str, str]:
    """MLflow's source tags: the entry point (`grpo train`), the git commit of the code, and the whole command
    line as the tag `command`. The UI shows a source name after its last '/', so the name holds no path:
    `grpo train --config configs/x.yaml` would read "x.yaml" in the runs table."""
    import shlex
    argv = list(sys.argv if argv is None else argv) or ["python"]
    program = Path(argv[0]).name
    subcommand = argv[1:2] if argv[1:2] and argv[1].isidentifier() else []
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": " ".join([program, *subcommand]),
            "command": shlex.join([program, *argv[1:]])[:5000]}
    commit = git_commit()
    if commit and commit != "unknown":
        tags["mlflow.source.git.commit"] = commit
    return tags


def experiment_id(cfg: GRPOConfig) -> str:
    c = client(cfg)
    exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
    if exp is not None:
        return exp.experiment_id
    artifacts = None
    if tracking_uri(cfg).startswith("sqlite:"):
        artifacts = (Path(cfg.output_dir).resolve() / "mlartifacts").as_uri()
    try:        # a model-training experiment (MLflow 3.17's UI still needs TRAINING_VIEW in the link to show it so)
        return c.create_experiment(cfg.tracking.experiment_name, artifact_location=artifacts,
                                   tags={EXPERIMENT_KIND_TAG: "custom_model_development"})
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


# The curves a user opens a run for, copied into one chart section that the UI shows first. MLflow's run page
# and Chart view order sections by name (the key up to its last '/'), alphabetically, and charts within a
# section by key, so "data/..." and "eval/<source>/..." came before the pass@1, reward, KL and loss charts.
# A leading digit sorts before every letter in both of the UI's orders (code-unit and localeCompare);
# the copies keep the original's step, so they read exactly like it.
KEY_CURVES_SECTION = "0_key_curves"
KEY_CURVES = {
    "eval/greedy/pass_at_1": "heldout_greedy_pass_at_1",
    "eval/sampled/pass_at_1": "heldout_sampled_pass_at_1",
    "reward/mean": "reward_mean",
    "train/kl": "train_kl",
    "train/loss": "train_loss",
}


def with_key_curves(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` plus a KEY_CURVES_SECTION copy of each key curve among them."""
    return {**metrics, **{f"{KEY_CURVES_SECTION}/{KEY_CURVES[k]}": v for k, v in metrics.items() if k in KEY_CURVES}}


def log_metrics(cfg: GRPOConfig, run_id: str, metrics: dict[str, float], step: int) -> bool:
    """One batched call per step, idempotent: a batch whose first metric is already logged at this step
    (a stage re-run after a kill between logging and its record) is not logged again. The key curves are
    also logged under KEY_CURVES_SECTION. Returns whether it logged."""
    import time
    from mlflow.entities import Metric
    items = [(k, float(v)) for k, v in with_key_curves(metrics).items() if v is not None]
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


def log_update_steps(cfg: GRPOConfig, run_id: str, steps: list[dict], first_step: int,
                     with_first: dict[str, float]) -> None:
    """An update's per-step metrics under train/ at global steps first_step, first_step + 1, ...;
    `with_first` (the iteration's reward and rollout metrics) rides on the first step. Resume-aware: steps
    already logged (an update killed after logging, before its record) are skipped."""
    done = logged_steps(cfg, run_id, "train/loss")
    for i, m in enumerate(steps):
        step = first_step + i
        if step in done:
            continue
        metrics = {f"train/{k}": v for k, v in m.items()}
        metrics["train/tokens_per_second"] = m["step_tokens"] / max(m["step_seconds"], 1e-9)
        if i == 0:
            metrics.update(with_first)
        log_metrics(cfg, run_id, metrics, step)


def log_artifacts(cfg: GRPOConfig, run_id: str, local_dir: str | Path, artifact_path: str) -> None:
    client(cfg).log_artifacts(run_id, str(local_dir), artifact_path)


def end_run(cfg: GRPOConfig, run_id: str, status: str = "FINISHED") -> None:
    client(cfg).set_terminated(run_id, status=status)


# -- Model Registry -----------------------------------------------------------------------------------
# Versions are addressed by alias, never by "latest": `champion` is the best adapter registered so far
# (by tracking.best_metric), `run-<run name>` the one each run registered at its end.
CHAMPION = "champion"


def run_alias(run_name: str) -> str:
    """The alias of a run's registered version: run-<name>, with characters aliases refuse ('.') as '_'."""
    return "run-" + re.sub(r"[^\w-]", "_", run_name)


def ensure_registered_model(c, name: str, description: str) -> None:
    from mlflow.exceptions import MlflowException
    try:
        c.create_registered_model(name, description=description)
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) and "already exists" not in str(e):
            raise


def _beats_champion(c, name: str, metric: str, value: float | None) -> bool:
    """The rule with the gate off (gate.enabled: false): a new version with `value` of `metric` takes the
    champion alias when there is no champion yet, the champion has no value, or the new one is at least as
    good (higher is better) on its own held-out split."""
    from mlflow.exceptions import MlflowException
    try:
        held = c.get_model_version_by_alias(name, CHAMPION).tags.get(metric)
    except MlflowException:
        return True
    return held is None or (value is not None and float(value) >= float(held))


REGISTERED_MODEL_DESCRIPTION = ("LoRA adapters trained by grpo-pipeline. Load one with tasks.tracking."
                                "load_adapter('models:/NAME@champion') or '@run-<run name>'.")


def register_adapter(cfg: GRPOConfig, run_id: str, iteration: int, metrics: dict | None = None,
                     promote: bool | None = None, tags: dict[str, str] | None = None) -> dict | None:
    """Register the adapter logged at adapters/iter-<iteration> under the task's registered model, with
    the alias run-<run name>, and `champion` when `promote` (the gate's decision, tasks/gate.py; None: the
    rule without the gate, _beats_champion). `tags` (lineage, the gate's figures) go on the version.
    Returns {"name", "version", "uri", "aliases"} or None when registration is off."""
    name = registered_model_name(cfg)
    if not name or cfg.tracking.register_adapter == "none":
        return None
    c = client(cfg)
    ensure_registered_model(c, name, REGISTERED_MODEL_DESCRIPTION)
    value = (metrics or {}).get(cfg.tracking.best_metric)
    source = f"{c.get_run(run_id).info.artifact_uri}/adapters/iter-{iteration}"
    version_tags = {"iteration": str(iteration), "base_model": cfg.model, "run_name": cfg.run_name or "",
                    "selected_by": cfg.tracking.register_adapter, **(tags or {})}
    if value is not None:
        version_tags[cfg.tracking.best_metric] = str(value)
    champion = _beats_champion(c, name, cfg.tracking.best_metric, value) if promote is None else promote
    mv = c.create_model_version(name, source, run_id=run_id, tags=version_tags)
    aliases = [run_alias(cfg.run_name or run_id)] + ([CHAMPION] if champion else [])
    for alias in aliases:
        c.set_registered_model_alias(name, alias, mv.version)
    uri = f"models:/{name}/{mv.version}"
    set_tags(cfg, run_id, {"registered_model": uri, "registered_aliases": ",".join(aliases),
                           "best_adapter_uri": f"runs:/{run_id}/adapters/iter-{iteration}",
                           "best_iteration": str(iteration)})
    return {"name": name, "version": mv.version, "uri": uri, "aliases": aliases}


def register_export(cfg: GRPOConfig, run_id: str, local_dir: str | Path, iteration: int, name: str | None,
                    adapter_only: bool = False) -> dict:
    """Log an exported model directory (grpo_core.model.export) as the run's artifacts export/iter-<k>[-adapter]
    and, for a merged export with a `name`, create a registered model version whose source is that
    artifact path, aliased run-<run name>. Returns {"artifact_uri"} and, when registered, "name",
    "version", "uri" and "alias_uri"."""
    artifact_path = f"export/iter-{iteration}" + ("-adapter" if adapter_only else "")
    log_artifacts(cfg, run_id, local_dir, artifact_path)
    out = {"artifact_uri": f"runs:/{run_id}/{artifact_path}"}
    if adapter_only or not name:
        return out
    c = client(cfg)
    ensure_registered_model(c, name, "Plain Hugging Face models exported by `grpo export` (LoRA merged into the "
                                     "weights): transformers.AutoModelForCausalLM.from_pretrained on the files.")
    source = f"{c.get_run(run_id).info.artifact_uri}/{artifact_path}"
    mv = c.create_model_version(name, source, run_id=run_id, tags={
        "iteration": str(iteration), "base_model": cfg.model, "run_name": cfg.run_name or ""})
    alias = run_alias(cfg.run_name or run_id)
    c.set_registered_model_alias(name, alias, mv.version)
    set_tags(cfg, run_id, {"exported_model": f"models:/{name}/{mv.version}"})
    return {**out, "name": name, "version": mv.version, "uri": f"models:/{name}/{mv.version}",
            "alias_uri": f"models:/{name}@{alias}"}


def download_adapter(uri: str, dst: str | Path, tracking: str | None = None) -> Path:
    """A local copy of an adapter given a local dir, 'models:/NAME/VERSION|latest|@alias' or 'runs:/ID/PATH'."""
    if "://" not in uri and ":/" not in uri:
        p = Path(uri).expanduser()
        if not (p / "adapter_config.json").exists():
            from grpo_core.model.loading import ModelError
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
            from grpo_core.model.loading import ModelError
            raise ModelError(f"{uri} holds no LoRA adapter (adapter_config.json missing)")
        local = found.parent
    return local


def previous_best_adapter(cfg: GRPOConfig, exclude_run_id: str | None = None) -> str | None:
    """What `init_adapter: previous` starts from, as 'runs:/.../adapters/iter-k': the champion's adapter when
    the gate is on and there is a champion (the best so far, not merely the latest), else that of the most
    recent FINISHED run in the experiment that recorded one."""
    from mlflow.exceptions import MlflowException
    c = client(cfg)
    name = registered_model_name(cfg)
    if cfg.gate.enabled and name:
        try:
            mv = c.get_model_version_by_alias(name, CHAMPION)
            if mv.run_id and mv.tags.get("iteration") and mv.run_id != exclude_run_id:
                return f"runs:/{mv.run_id}/adapters/iter-{mv.tags['iteration']}"
        except MlflowException:
            pass
    exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", order_by=["attributes.end_time DESC"],
                         max_results=50)
    for r in runs:
        if r.info.run_id != exclude_run_id and r.data.tags.get("best_adapter_uri"):
            return r.data.tags["best_adapter_uri"]
    return None


def parent_version(cfg: GRPOConfig, uri: str) -> str | None:
    """The registered version (of tracking.registered_model_name) an init_adapter URI names: models:/NAME/V or
    @ALIAS, or runs:/ID/adapters/iter-k registered from that run and iteration; None if it names none."""
    from mlflow.exceptions import MlflowException
    c, name = client(cfg), registered_model_name(cfg)
    try:
        if uri.startswith("models:/"):
            return str(model_version(c, uri).version)
        if uri.startswith("runs:/") and name:
            run_id, path = runs_uri(uri)
            for mv in c.search_model_versions(f"name='{name}' and run_id='{run_id}'"):
                if mv.source.endswith("/" + path.strip("/")):
                    return str(mv.version)
    except MlflowException:
        return None
    return None


def runs_uri(uri: str) -> tuple[str, str]:
    """(run id, artifact path) of a runs:/RUN_ID/PATH URI."""
    run_id, _, path = uri[len("runs:/"):].partition("/")
    return run_id, path


def model_version(c, model_uri: str):
    """The registered version a models:/ URI names: NAME@ALIAS, NAME/VERSION or NAME/latest."""
    ref = model_uri[len("models:/"):]
    if "@" in ref:
        name, alias = ref.split("@", 1)
        return c.get_model_version_by_alias(name, alias)
    name, _, version = ref.partition("/")
    if version in ("", "latest"):
        return max(c.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    return c.get_model_version(name, version)


def load_adapter(model_uri: str, tracking: str | None = None, base_model: str | None = None):
    """The one call that loads a trained adapter back: returns (peft_model, tokenizer).

        from tasks.tracking import load_adapter
        model, tok = load_adapter("models:/grpo-arithmetic-1d-add-sub@champion", tracking="sqlite:///runs/mlflow.db")

    `model_uri`: models:/NAME@ALIAS (champion, run-<run name>), models:/NAME/VERSION, runs:/ID/PATH or a
    local adapter dir. The base model comes from the model version's (or run's) `base_model` tag unless
    given."""
    import tempfile
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from grpo_core.model.loading import load_base_model, load_tokenizer, resolve_model, select_device, select_dtype
    tracking = tracking or os.environ.get("MLFLOW_TRACKING_URI")
    c = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    if base_model is None and model_uri.startswith("models:/"):
        mv = model_version(c, model_uri)
        base_model = mv.tags.get("base_model") or c.get_run(mv.run_id).data.tags.get("base_model")
    elif base_model is None and model_uri.startswith("runs:/"):
        base_model = c.get_run(runs_uri(model_uri)[0]).data.tags.get("base_model")
    if not base_model:
        raise ValueError(f"cannot tell the base model of {model_uri}; pass base_model=")
    local = download_adapter(model_uri, tempfile.mkdtemp(prefix="grpo-adapter-"), tracking)
    base_dir = resolve_model(base_model)
    device = select_device("auto")
    model = PeftModel.from_pretrained(load_base_model(base_dir, device, select_dtype("auto", device)), str(local))
    return model, load_tokenizer(local if (local / "tokenizer_config.json").exists() else base_dir)


# -- evaluation helpers -----------------------------------------------------------------------------
def log_table(cfg: GRPOConfig, run_id: str, data: dict[str, list], artifact_file: str) -> bool:
    """`MlflowClient.log_table` (a JSON table the UI shows in its evaluation view). MLflow appends to an
    existing table file, so a retried stage skips a file that is already there. True if logged."""
    c = client(cfg)
    folder, _, name = artifact_file.rpartition("/")
    if any(f.path.rpartition("/")[2] == name for f in c.list_artifacts(run_id, folder or None)):
        return False
    _make_room_in_table_index(c, run_id, artifact_file)
    c.log_table(run_id, data=data, artifact_file=artifact_file)
    return True


TABLE_INDEX_TAG = "mlflow.loggedArtifacts"     # the JSON list of a run's tables that the UI's evaluation view reads


def _make_room_in_table_index(c, run_id: str, artifact_file: str) -> None:
    """MLflow lists a run's tables in one tag, cut at the tag length limit (8000 characters): past ~130 tables
    the list no longer parses and `log_table` fails. Before that, drop the oldest entries (completion tables
    first) from the list so the new one fits; their files stay in the run's artifacts."""
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH
    raw = c.get_run(run_id).data.tags.get(TABLE_INDEX_TAG, "[]")
    try:
        entries = json.loads(raw)
    except ValueError:              # already cut (a run logged before this fix): start the list afresh
        entries = None
    valid = isinstance(entries, list) and all(isinstance(e, dict) for e in entries)
    kept = list(entries) if valid else []
    new = {"path": artifact_file, "type": "table"}
    while kept and len(json.dumps([*kept, new])) > MAX_TAG_VAL_LENGTH:
        oldest_completion = next((e for e in kept if str(e.get("path", "")).startswith(f"{COMPLETIONS_DIR}/")), None)
        kept.remove(oldest_completion if oldest_completion is not None else kept[0])
    if kept != entries:
        c.set_tag(run_id, TABLE_INDEX_TAG, json.dumps(kept))


def log_artifact(cfg: GRPOConfig, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    client(cfg).log_artifact(run_id, str(local_path), artifact_path)


def download_artifacts(cfg: GRPOConfig, run_id: str, path: str, dst: str | Path) -> Path:
    Path(dst).mkdir(parents=True, exist_ok=True)
    return Path(client(cfg).download_artifacts(run_id, path, str(dst)))


def list_artifact_paths(cfg: GRPOConfig, run_id: str, path: str | None = None) -> list[str]:
    return [f.path for f in client(cfg).list_artifacts(run_id, path)]


# -- completion tables during training -------------------------------------------------------------
COMPLETIONS_DIR = "completions"


def completion_advantages(batch: list, cfg: GRPOConfig) -> list[float | None]:
    """Each sample's advantage as the update computed it (grpo_core.update.step.surviving_groups, then
    grpo_core.update.step.batch_advantages: scale_rewards, multi_objective_aggregation); None where a sample did not
    train (unscorable, or its group kept fewer than 2 members). `batch`: tasks.update.scored_batch's list."""
    from grpo_core.update.step import batch_advantages, surviving_groups
    kept, group_sizes = surviving_groups(batch)
    if not kept:
        return [None] * len(batch)
    advantages = batch_advantages(kept, group_sizes, cfg)                                  # [N]
    by_sample = {id(s): float(a) for s, a in zip(kept, advantages)}
    return [None if s is None else by_sample.get(id(s)) for s in batch]


def completion_table(samples: list[dict], scores: list[dict], advantages: list[float | None], iteration: int,
                     max_prompts: int, decode, unique_prompts: bool = False) -> dict[str, list]:
    """Columns for log_table: the first `max_prompts` prompts (as the model saw them, `decode`d), each with
    all its completions, the reward of each reward function, the total, the advantage and whether it was
    sampled after the guide's prompt (data.guided_completions) rather than the one shown. `unique_prompts`
    (TRL's log_unique_prompts): one row per prompt text, its first completion's."""
    groups = set(list(dict.fromkeys(r["group"] for r in samples))[:max_prompts])
    funcs = list(dict.fromkeys(f for sc in scores for f in sc.get("rewards", {})))
    cols: dict[str, list] = {c: [] for c in ("iteration", "group", "task_id", "prompt", "completion",
                                             *[f"reward_{f}" for f in funcs], "reward", "advantage", "correct",
                                             "length", "truncated", "guided")}
    prompts: dict[int, str] = {}
    for r, sc, adv in zip(samples, scores, advantages):
        if r["group"] not in groups:
            continue
        if r["group"] not in prompts:
            prompts[r["group"]] = decode(r["prompt_ids"])
            if unique_prompts and prompts[r["group"]] in cols["prompt"]:
                groups.discard(r["group"])          # the same text as an earlier prompt: its row is there
                continue
        elif unique_prompts:
            continue
        row = {"iteration": iteration, "group": r["group"], "task_id": r["task_id"], "prompt": prompts[r["group"]],
               "completion": readable_conversation(r["extra"]) if "turns" in (r.get("extra") or {})
               else r["completion"],
               "reward": sc["reward"], "advantage": adv, "correct": sc.get("correct"),
               "length": model_token_count(r["completion_ids"], r.get("completion_mask")),
               "truncated": r["truncated"], "guided": bool((r.get("extra") or {}).get("guided")),
               **{f"reward_{f}": sc["rewards"].get(f) for f in funcs}}
        for c in cols:
            cols[c].append(row[c])
    return cols


def printed_completions(samples: list[dict], scores: list[dict], advantages: list[float | None], iteration: int,
                        n: int, decode, seed: int, prompt_chars: int = 300) -> str:
    """TRL's num_completions_to_print as console text: `n` of the iteration's completions drawn at random (a
    stream of its own, seeded by `seed` and the iteration: the run's random streams are untouched), each
    with the end of its prompt (`decode`d; at most `prompt_chars` characters), the completion, the total
    reward and each function's, and the advantage (None: did not train)."""
    import random
    picked = sorted(random.Random(f"{seed}:{iteration}").sample(range(len(samples)), min(n, len(samples))))
    lines = [f"completions of iteration {iteration} ({len(picked)} of {len(samples)}, drawn at random):"]
    for k, i in enumerate(picked, 1):
        r, sc, adv = samples[i], scores[i], advantages[i]
        prompt = decode(r["prompt_ids"])
        prompt = prompt if len(prompt) <= prompt_chars else "..." + prompt[-prompt_chars:]
        per_func = ", ".join(f"{f}={v}" for f, v in (sc.get("rewards") or {}).items())
        completion = readable_conversation(r["extra"]) if "turns" in (r.get("extra") or {}) else r["completion"]
        lines += [f"[{k}] group {r['group']}, task {r['task_id']}: reward {sc['reward']} ({per_func}), advantage "
                  f"{'None' if adv is None else f'{adv:.4f}'}",
                  "  prompt: " + prompt.replace("\n", "\n    "), "  completion: " + completion.replace("\n", "\n    ")]
    return "\n".join(lines)


def console(message: str) -> None:
    """To the Prefect run log inside a flow (the CLI shows it on stdout), else to stdout; never stderr."""
    try:
        from prefect import get_run_logger
        get_run_logger().info(message)
    except Exception:  # noqa: BLE001 - outside a flow/task run there is no run logger
        print(message, file=sys.stdout, flush=True)


def log_completions(cfg: GRPOConfig, run_id: str | None, iteration: int, batch: list, samples: str | Path,
                    scores: str | Path, tokenizer) -> bool:
    """Every tracking.log_completions_steps iterations, the completion table of this iteration's update as
    completions/iter_<kkkk>.json (once: a re-run stage finds it and skips; log_unique_prompts: one row per
    prompt). With num_completions_to_print, after every update, that many completions to the console log
    (`printed_completions`). True if the table was logged."""
    t = cfg.tracking
    table_due = bool(t.log_completions and run_id and iteration % t.log_completions_steps == 0)
    if not (table_due or cfg.num_completions_to_print):
        return False
    rows, scored, advantages = list(read_jsonl(samples)), list(read_jsonl(scores)), completion_advantages(batch, cfg)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    if cfg.num_completions_to_print:
        console(printed_completions(rows, scored, advantages, iteration, cfg.num_completions_to_print, decode,
                                    cfg.seed))
    if not table_due:
        return False
    table = completion_table(rows, scored, advantages, iteration, t.log_completions_prompts, decode,
                             cfg.log_unique_prompts)
    return log_table(cfg, run_id, table, f"{COMPLETIONS_DIR}/iter_{iteration:04d}.json")
