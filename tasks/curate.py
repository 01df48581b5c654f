"""curate: build the iteration's training prompts (and, once per run, the held-out split)."""
from __future__ import annotations

from pathlib import Path

from prefect import task

from grpo_core.config import GRPOConfig
from grpo_core.data import arithmetic
from grpo_core.data import iteration as data_iteration
from grpo_core.task import read_tasks, write_tasks
from tasks.common import cfg_of, completed_record, finish_stage, input_key, iter_dir, mlflow_run_id


def eval_split_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "data" / "eval.jsonl"


def ensure_eval_split(cfg: GRPOConfig, run_dir: str | Path) -> Path:
    """The run's held-out tasks, written once; every later stage reads the same file."""
    path = eval_split_path(run_dir)
    if not path.exists():
        d = cfg.data
        if d.curated:  # curated data: its own held-out split (grpo_core.data.iteration)
            write_tasks(path, data_iteration.eval_tasks(d.curated, run_dir, d.eval_size))
        else:
            write_tasks(path, arithmetic.eval_tasks(d.eval_size, d.min_digits, d.max_digits, d.operations))
    return path


@task(name="curate")
def curate(config: dict, run_dir: str, iteration: int) -> dict:
    cfg = cfg_of(config)
    key = input_key(data=config["data"], seed=cfg.seed, iteration=iteration)
    if (done := completed_record(run_dir, iteration, "curate", key)):
        return done
    eval_path = ensure_eval_split(cfg, run_dir)
    d = cfg.data
    if d.curated:  # sources + weights + pass-rate band, recalibrated from earlier iterations' scores
        record = data_iteration.curate_iteration(
            d.curated, run_dir, iteration, d.prompts_per_iteration, d.weights, tuple(d.pass_rate_band),
            d.recalibrate, cfg.seed, iter_dir(run_dir, iteration))
        from tasks.data_logging import log_curation
        if (run_id := mlflow_run_id(run_dir)):
            log_curation(cfg, run_id, record, iteration)
        return finish_stage(run_dir, iteration, "curate", key, {**record, "eval": str(eval_path)})
    exclude = {t.id for t in read_tasks(eval_path)}
    prompts = arithmetic.train_tasks(d.prompts_per_iteration, d.min_digits, d.max_digits, d.operations,
                                     seed=cfg.seed * 100_003 + iteration, exclude=exclude)
    out = write_tasks(iter_dir(run_dir, iteration) / "prompts.jsonl", prompts)
    return finish_stage(run_dir, iteration, "curate", key, {
        "prompts": str(out), "eval": str(eval_path), "num_prompts": len(prompts),
        "sources": {"arithmetic": len(prompts)}})
