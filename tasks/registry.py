"""The MLflow Model Registry side of a training run: registered adapters and exports, the aliases `champion`
and `run-<run name>`, and loading an adapter back (by alias, version, run artifact or local dir).
Run metrics, params and artifacts are tasks/tracking.py's."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from grpo_core.config import GRPOConfig
from grpo_core.evaluation.task_identity import registered_model_name
from tasks.tracking import client, default_tracking_uri, log_artifacts, require_store, set_tags

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


def not_found(e) -> bool:
    """Whether an MlflowException says the registered model (RESOURCE_DOES_NOT_EXIST) or the alias
    (INVALID_PARAMETER_VALUE) does not exist. Any other (the server out of reach, refusing, failing) must not
    read as "none": `champion` would pass to the new adapter as to a task's first."""
    return e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def read_or_none(read: Callable[[], Any], what: str) -> Any:
    """read(), or None where MLflow says the model or alias does not exist (`not_found`); any other MLflow error is
    raised with a note naming `what` and saying to resume once MLflow answers."""
    from mlflow.exceptions import MlflowException
    try:
        return read()
    except MlflowException as e:
        if not not_found(e):
            e.add_note(f"reading {what}: cannot tell whether it exists; resume the run (`grpo resume`) once MLflow "
                       f"answers")
            raise
        return None


def champion_version(c, name: str):
    """The version `name`@champion, None when the model or the alias does not exist (read_or_none)."""
    return read_or_none(lambda: c.get_model_version_by_alias(name, CHAMPION), f"{name}@{CHAMPION}")


def _beats_champion(c, name: str, metric: str, value: float | None) -> bool:
    """The rule with the gate off (gate.enabled: false): a new version with `value` of `metric` takes the
    champion alias when there is no champion yet, the champion has no value, or the new one is at least as
    good (higher is better) on its own held-out split."""
    champion = champion_version(c, name)
    held = champion.tags.get(metric) if champion is not None else None
    return held is None or (value is not None and float(value) >= float(held))


def registered_version(c, name: str, run_id: str, iteration: int, run_name: str | None):
    """The version of `name` that run `run_id` (named `run_name`) already registered for `iteration`'s adapter, else
    None: a registration cut off (killed, MLflow gone) after it created its version is finished, not repeated."""
    versions = read_or_none(lambda: c.search_model_versions(f"name='{name}' and run_id='{run_id}'"),
                            f"the versions of {name} run {run_id} registered") or []
    return next((v for v in versions if v.source.endswith(f"/adapters/iter-{iteration}")
                 and v.tags.get("run_name") == (run_name or "")), None)


REGISTERED_MODEL_DESCRIPTION = ("LoRA adapters trained by grpo-pipeline. Load one with tasks.registry."
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
    mv = registered_version(c, name, run_id, iteration, cfg.run_name) or \
        c.create_model_version(name, source, run_id=run_id, tags=version_tags)
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
    if tracking:
        require_store(tracking, f"no adapter {uri}")      # reading would create an empty store
    import mlflow.artifacts
    dst = Path(dst)
    made = not dst.exists()
    dst.mkdir(parents=True, exist_ok=True)
    if tracking:
        import mlflow
        mlflow.set_tracking_uri(tracking)
        mlflow.set_registry_uri(tracking)
    from mlflow.exceptions import MlflowException
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except MlflowException as e:
        if not not_found(e):
            raise
        if made and not any(dst.iterdir()):         # nothing fetched: leave no empty directory behind
            dst.rmdir()
        from grpo_core.model.loading import ModelError
        raise ModelError(f"{uri}: no such adapter in MLflow at {tracking or 'the default tracking URI'} ({e.message}). "
                         f"Fix: name an existing registered version (models:/NAME/VERSION or models:/NAME@ALIAS) or "
                         f"run artifact (runs:/ID/PATH), or pass the right tracking URI") from None
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
    recent FINISHED run in the experiment that recorded one for this task (its registered model) and this base
    model: the experiment is shared by every task (tracking.experiment_name defaults to grpo-pipeline)."""
    c = client(cfg)
    name = registered_model_name(cfg)
    if cfg.gate.enabled and name and (mv := champion_version(c, name)) is not None:
        if mv.run_id and mv.tags.get("iteration") and mv.run_id != exclude_run_id:
            return f"runs:/{mv.run_id}/adapters/iter-{mv.tags['iteration']}"
    exp = c.get_experiment_by_name(cfg.tracking.experiment_name)
    if exp is None or not name:
        return None
    prefix = f"models:/{name}/"
    runs = c.search_runs([exp.experiment_id], f"attributes.status = 'FINISHED' and tags.registered_model LIKE "
                                              f"'{prefix}%'", order_by=["attributes.end_time DESC"], max_results=50)
    for r in runs:
        tags = r.data.tags
        if (r.info.run_id != exclude_run_id and tags.get("best_adapter_uri") and tags.get("base_model") == cfg.model
                and tags.get("registered_model", "").startswith(prefix)):
            return tags["best_adapter_uri"]
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

        from tasks.registry import load_adapter
        model, tok = load_adapter("models:/grpo-arithmetic-1d-add-sub@champion", tracking="sqlite:///runs/mlflow.db")

    `model_uri`: models:/NAME@ALIAS (champion, run-<run name>), models:/NAME/VERSION, runs:/ID/PATH or a
    local adapter dir. The base model comes from the model version's (or run's) `base_model` tag unless
    given."""
    import tempfile
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from grpo_core.model.loading import load_base_model, load_tokenizer, resolve_model, select_device, select_dtype
    tracking = tracking or default_tracking_uri()
    if ":/" in model_uri:                                   # an MLflow URI, not a local directory
        require_store(tracking, f"no adapter {model_uri}")
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
