"""MLflow bookkeeping: one MLflow run per training run, logged by explicit run id (thread-safe): the store and
the run, params, metrics (each stage logs its own, at the step this module says), tables and artifacts.
Registered models and the champion: tasks/registry.py; completion tables: tasks/completions.py."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.io import read_json, write_json
from tasks.layout import record_path
from tasks.retry import CUT_OFF_MESSAGES
from tasks.run_state import mlflow_run_id


def tracking_uri(cfg: GRPOConfig) -> str:
    return cfg.tracking.tracking_uri or default_tracking_uri(cfg.output_dir)


def default_tracking_uri(output_dir: str | Path = "runs") -> str:
    """Where runs under `output_dir` log when their config names no store: $MLFLOW_TRACKING_URI, else SQLite
    `<output_dir>/mlflow.db`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def store_exists(cfg: GRPOConfig) -> bool:
    """Whether the run's tracking store is there to read (store_exists_at)."""
    return store_exists_at(tracking_uri(cfg))


def store_exists_at(uri: str) -> bool:
    """Whether the tracking store at `uri` is there to read: a SQLite file that does not exist yet is not (reading
    it would create it); a server is."""
    return not uri.startswith("sqlite:///") or Path(uri[len("sqlite:///"):]).is_file()


def require_store(uri: str, looking_for: str) -> None:
    """For a command that only reads: refuse, naming `looking_for` and the fix, where the store at `uri` does not
    exist (MLflow would create an empty one only to answer "not found"). Raises ConfigError."""
    if not store_exists_at(uri):
        raise ConfigError(f"{looking_for}: there is no MLflow tracking store at {uri} (nothing has logged there yet). "
                          f"Fix: `grpo runs --output-dir DIR` lists the runs of a directory; pass the store that "
                          f"holds it with --tracking-uri (or MLFLOW_TRACKING_URI)")


def check_run_in_store(cfg: GRPOConfig, run_dir: Path) -> None:
    """Before a resume or an export of a run that logged to MLflow: its MLflow run (run.json) is in the store this
    config points at (another store is an allowed change of tracking.*, a store may move). ConfigError naming the
    run, the store and the fix; a SQLite store that is not there is not created."""
    run_id = mlflow_run_id(run_dir)
    if not run_id:
        return
    uri = tracking_uri(cfg)
    if store_exists_at(uri):
        from mlflow.exceptions import MlflowException
        try:
            client(cfg).get_run(run_id)
            return
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
    raise ConfigError(f"run {Path(run_dir).name!r} logged to MLflow run {run_id}, which is not in {uri} (the store "
                      f"moved, or tracking.tracking_uri / MLFLOW_TRACKING_URI now name another). Fix: point them at "
                      f"the store the run logged to")


def check_reachable(cfg: GRPOConfig, timeout: float = 3.0) -> None:
    """Before a run: an http(s) tracking server accepts a connection within `timeout` seconds, so that a
    server that is down fails now, not after MLflow's minutes of retries (ConfigError); a SQLite store's folder
    can be written (InputError: a file in the way, a read-only filesystem), before the run starts."""
    import socket
    from urllib.parse import urlsplit
    from grpo_core.io import check_writable
    uri = tracking_uri(cfg)
    field = "tracking.tracking_uri" if cfg.tracking.tracking_uri else \
        "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "output_dir"
    if uri.startswith("sqlite:///"):
        check_writable(Path(uri[len("sqlite:///"):]).parent, f"{field} ({uri})")
    if not uri.startswith(("http://", "https://")):
        return
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
        state["mlflow_run_id"] = run_id
        write_json(state_path, state)          # at once: a run killed from here on reopens this MLflow run
    if not state.get("mlflow_inputs_logged"):  # the config as params and as config.yaml, once (a kill may cut it)
        logged = c.get_run(run_id).data.params
        log_params(c, run_id, {k: v for k, v in cfg.flat().items() if k not in logged})
        if not any(f.path == "config.yaml" for f in c.list_artifacts(run_id)):
            c.log_text(run_id, cfg.to_yaml(), "config.yaml")
        state["mlflow_inputs_logged"] = True
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
    `with_first` (the batch's statistics) rides on the first step. Resume-aware: steps already logged (an
    update killed after logging, before its record) are skipped."""
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


def first_update_step(run_dir: str | Path, iteration: int) -> int:
    """The global step of iteration `iteration`'s first optimizer step: the previous iteration's update record's
    `global_step` (what its trainer state saved, and what this iteration's update resumes from) + 1; 1 in the
    first iteration. The x-axis of the metrics that describe the iteration's batch before it is trained on
    (the rollout's throughput, the rewards), so they line up with the update's first step."""
    previous = record_path(run_dir, iteration - 1, "update")
    return (read_json(previous)["global_step"] if iteration > 1 and previous.exists() else 0) + 1


def log_iteration_metrics(cfg: GRPOConfig, run_dir: str | Path, iteration: int, metrics: dict[str, float]) -> bool:
    """A stage's metrics of iteration `iteration`, logged by the stage to the training run's MLflow run at
    `first_update_step` (idempotent: log_metrics). Nothing where `run_dir` has no MLflow run: an iteration flow
    run on its own, or a dynamic-sampling round, whose stages run in iter-<k>/dynamic-<r>/ (the update trains on
    the merged rounds; the metrics logged are the first round's). Returns whether it logged."""
    run_id = mlflow_run_id(run_dir)
    return bool(run_id) and log_metrics(cfg, run_id, metrics, first_update_step(run_dir, iteration))


def log_artifacts(cfg: GRPOConfig, run_id: str, local_dir: str | Path, artifact_path: str) -> None:
    client(cfg).log_artifacts(run_id, str(local_dir), artifact_path)


def end_run(cfg: GRPOConfig, run_id: str, status: str = "FINISHED") -> None:
    client(cfg).set_terminated(run_id, status=status)


# -- tables and artifacts -------------------------------------------------------------------------
# Completion tables (tasks/completions.py) are logged under this folder; the table index drops them first.
COMPLETIONS_DIR = "completions"


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


def console(message: str) -> None:
    """To the Prefect run log inside a flow (the CLI shows it on stdout), else to stdout; never stderr."""
    try:
        from prefect import get_run_logger
        get_run_logger().info(message)
    except Exception:  # noqa: BLE001 - outside a flow/task run there is no run logger
        print(message, file=sys.stdout, flush=True)

