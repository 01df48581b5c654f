"""The training-run flow: evaluate the base model, then N iterations of
curate -> rollout -> score -> update -> evaluate, each stage a retryable Prefect task."""
from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from grpo_core.config import GRPOConfig
from tasks import tracking
from tasks.common import write_json
from tasks.curate import curate
from tasks.evaluate import evaluate
from tasks.rollout import rollout
from tasks.score import score
from tasks.update import update


def _with_retries(task_fn, cfg: GRPOConfig, stage: str):
    policy = getattr(cfg.stages, stage)
    return task_fn.with_options(retries=policy.retries, retry_delay_seconds=policy.retry_delay_seconds)


def run_dir_of(cfg: GRPOConfig) -> Path:
    return Path(cfg.output_dir) / cfg.run_name


@flow(name="grpo-iteration")
def iteration_flow(config: dict, run_dir: str, iteration: int, checkpoint: str | None, state: str | None) -> dict:
    """One iteration: the five stages in order; returns small records (paths and metrics)."""
    cfg = GRPOConfig.model_validate(config)
    stage = lambda fn, name: _with_retries(fn, cfg, name)
    cur = stage(curate, "curate")(config, run_dir, iteration)
    ro = stage(rollout, "rollout")(config, run_dir, iteration, cur["prompts"], checkpoint)
    sc = stage(score, "score")(config, run_dir, iteration, cur["prompts"], ro["samples"])
    up = stage(update, "update")(config, run_dir, iteration, ro["samples"], sc["scores"], checkpoint, state)
    ev = None
    if cfg.eval.enabled and (iteration % cfg.eval.every == 0 or iteration == cfg.pipeline_iterations):
        ev = stage(evaluate, "evaluate")(config, run_dir, iteration, up["checkpoint"])
    return {"curate": cur, "rollout": ro, "score": sc, "update": up, "evaluate": ev}


@flow(name="grpo-training-run")
def training_run(config: dict) -> dict:
    """A whole training run. `config` is a GRPOConfig as a dict (with run_name set)."""
    cfg = GRPOConfig.model_validate(config)
    if not cfg.run_name:
        raise ValueError("training_run needs config.run_name set")
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    run_id = tracking.start_or_resume_run(cfg, run_dir, flow_run.get_id())
    try:
        evals = {}
        if cfg.eval.enabled:
            evals[0] = _with_retries(evaluate, cfg, "evaluate")(config, str(run_dir), 0, None)["metrics"]
        checkpoint = state = None
        for k in range(1, cfg.pipeline_iterations + 1):
            res = iteration_flow(config, str(run_dir), k, checkpoint, state)
            checkpoint, state = res["update"]["checkpoint"], res["update"]["state"]
            if res["evaluate"]:
                evals[k] = res["evaluate"]["metrics"]
    except BaseException:
        tracking.end_run(cfg, run_id, "FAILED")
        raise
    tracking.end_run(cfg, run_id, "FINISHED")
    summary = {"run_dir": str(run_dir), "mlflow_run_id": run_id, "final_checkpoint": checkpoint,
               "evals": evals, "tracking_uri": tracking.tracking_uri(cfg)}
    write_json(run_dir / "summary.json", summary)
    return summary
