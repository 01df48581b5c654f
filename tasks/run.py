"""Run-level steps of a training run that are not stages: refusing a resume with a changed config,
resolving the starting adapter, merging DAPO dynamic-sampling rounds, choosing and registering the best
adapter, deleting old trainer states, and the per-iteration run metrics. The flow (flows/train.py) only
composes these with the stage tasks."""
from __future__ import annotations

import shutil
from pathlib import Path

from grpo_core.update import dynamic_sampling as dsamp
from grpo_core.update.checkpoint import STATE_FILE
from grpo_core.config import ConfigError, GRPOConfig, flatten
from grpo_core.io import read_json, write_jsonl
from grpo_core.model.loading import check_adapter, resolve_model
from tasks import gate, registry, tracking
from tasks.data_logging import curation_metrics, dataset_hash  # noqa: F401 - dataset_hash: the flow's tag
from tasks.layout import semantic_config
from tasks.run_state import mlflow_run_id, read_run_state, update_run_state


def semantic_fields(config: dict) -> dict:
    """The fields of a config (a GRPOConfig as a dict) that decide what a run computes, flattened."""
    return flatten(semantic_config(config))


def remember_started_config(config: dict, run_dir: Path) -> None:
    """Keep in run.json the fields that decide what the run computes, as it first started: its config.yaml, which
    `grpo resume` reads, may be edited afterwards (check_same_config)."""
    if "started_config" not in read_run_state(run_dir):
        update_run_state(run_dir, started_config=semantic_fields(config))


def _differences(a: dict, b: dict, keys) -> str:
    diff = sorted(k for k in keys if a.get(k) != b.get(k))
    return (", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in diff[:6]) + (" ..." if len(diff) > 6 else "")
            if diff else "")


def check_same_config(cfg: GRPOConfig, run_dir: Path) -> None:
    """Resuming with a config that changes what is computed would mix two runs in one: refuse, whether the
    change comes with the command or was made in the run's config.yaml since the run started.
    Operational fields (retries, tracking, paths) may change."""
    prev_path = run_dir / "config.yaml"
    if not prev_path.exists():
        return
    import yaml
    from grpo_core.config import yaml_error_message
    from grpo_core.io import load_yaml
    try:
        prev = GRPOConfig.model_validate(load_yaml(prev_path.read_text()) or {}).model_dump(mode="json")
    except yaml.YAMLError as e:          # edited by hand into something that does not load
        raise ConfigError(yaml_error_message(f"the run's config {str(prev_path)!r}", e)) from None
    except ValueError:
        return        # an older, now-invalid config: the stage keys decide what re-runs
    a, ours = semantic_fields(prev), semantic_fields(cfg.model_dump(mode="json"))
    if (changed := _differences(a, ours, a.keys() | ours.keys())):
        raise ConfigError(
            f"run {run_dir.name!r} already exists with a different config ({changed}); resume it unchanged with "
            f"`grpo resume {run_dir.name}` or start a new run with another --run-name")
    started = read_run_state(run_dir).get("started_config") or {}
    if (edited := _differences(started, a, started.keys() & a.keys())):     # the fields both code versions have
        raise ConfigError(
            f"{prev_path} was edited since run {run_dir.name!r} started ({edited}): resuming would compute "
            f"something else under the same run. Fix: put those fields back (the MLflow run keeps the config it "
            f"started with as its artifact config.yaml), or start a new run with another --run-name")


def init_checkpoint(cfg: GRPOConfig, run_dir: Path, run_id: str) -> str | None:
    """Resolve config.init_adapter once per run into run_dir/init_adapter (a stable path = stable stage keys)."""
    if not cfg.init_adapter:
        return None
    state = read_json(run_dir / "run.json")
    if state.get("init_adapter_path") and Path(state["init_adapter_path"]).exists():
        return state["init_adapter_path"]
    uri = cfg.init_adapter
    if uri == "previous":
        uri = registry.previous_best_adapter(cfg, exclude_run_id=run_id)
        if uri is None:
            update_run_state(run_dir, init_adapter_uri=None)
            return None        # first run of a schedule: start from the base model
    local = registry.download_adapter(uri, run_dir / ".init_adapter_download", tracking.tracking_uri(cfg))
    try:
        check_adapter(local, resolve_model(cfg.model), f"init_adapter ({uri})")   # made for this base model?
    except ValueError:
        shutil.rmtree(run_dir / ".init_adapter_download", ignore_errors=True)
        raise
    dst = run_dir / "init_adapter"
    if local.resolve() != dst.resolve():
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(local, dst)
        shutil.rmtree(run_dir / ".init_adapter_download", ignore_errors=True)
    parent = registry.parent_version(cfg, uri)
    update_run_state(run_dir, init_adapter_uri=uri, init_adapter_path=str(dst), parent_version=parent)
    tracking.set_tags(cfg, run_id, {"init_adapter": uri, **({"parent_version": parent} if parent else {})})
    return str(dst)


def prune_trainer_states(cfg: GRPOConfig, run_dir: Path, iteration: int) -> None:
    """Once `iteration` has finished, delete the trainer states (optimizer, scheduler, RNG) of the iterations
    keep_trainer_states or more before it: only the newest is read again (by the next update, or a resume).
    Their adapters and records stay, so the run's history and its completed stages are unchanged."""
    if cfg.keep_trainer_states is None:
        return
    for k in range(1, iteration - cfg.keep_trainer_states + 1):
        (run_dir / f"iter-{k}" / "update" / STATE_FILE).unlink(missing_ok=True)


def iteration_metrics(curated: dict, seconds: float) -> dict[str, float]:
    """The run metrics of one finished iteration (step = iteration): what curation reported that varies, and
    time. The constant counts are tags, logged by the curate stage (tasks/data_logging.py)."""
    return {**curation_metrics(curated), "sys/iteration_seconds": seconds}


def merge_dynamic_rounds(cfg: GRPOConfig, run_dir: str, iteration: int,
                         rounds: list[tuple[list[dict], list[dict]]]) -> tuple[str, str, dict]:
    """Merge the informative groups of the first rollout and its refill rounds into
    iter-<k>/{samples,scores}.dynamic.jsonl; log the dropped/kept counts. -> (samples, scores, stats)."""
    it_dir = Path(run_dir) / f"iter-{iteration}"
    merged_s, merged_c, stats = dsamp.merge_rounds(rounds, cfg.data.prompts_per_iteration)
    samples = write_jsonl(it_dir / "samples.dynamic.jsonl", merged_s)
    scores = write_jsonl(it_dir / "scores.dynamic.jsonl", merged_c)
    if (run_id := mlflow_run_id(run_dir)):    # None when iteration_flow runs on its own; stats still returned
        tracking.log_metrics(cfg, run_id, {f"data/dynamic_sampling/{k}": v for k, v in stats.items()}, iteration)
    return str(samples), str(scores), stats


def best_iteration(cfg: GRPOConfig, evals: dict, default: int) -> int:
    """The iteration (>= 1) with the highest held-out tracking.best_metric, ties to the later one; `default`
    when no trained iteration was evaluated. `evals`: {iteration: metrics} (keys may be strings, as in
    summary.json)."""
    metric = cfg.tracking.best_metric
    scored = {int(k): m[metric] for k, m in evals.items() if int(k) >= 1 and metric in m}
    return max(scored, key=lambda k: (scored[k], k)) if scored else default


def register_best_adapter(cfg: GRPOConfig, run_id: str, evals: dict, run_dir: Path) -> dict | None:
    """Register the best-by-eval (or the final) iteration's adapter in the MLflow Model Registry, with its
    lineage; it takes `champion` when the promotion gate says so (tasks/gate.py)."""
    if cfg.tracking.register_adapter == "none" or not cfg.tracking.registered_model_name:
        return None
    final = cfg.pipeline_iterations
    it = best_iteration(cfg, evals, final) if cfg.tracking.register_adapter == "best" else final
    return gate.register_with_gate(cfg, Path(run_dir), run_id, it, evals.get(it))
