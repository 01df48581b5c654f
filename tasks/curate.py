"""curate: build the iteration's training prompts (the held-out split, written once per run: tasks/splits.py).
Training never asks a held-out question or one of the promotion gate's set (<run_dir>/data/gate.jsonl,
tasks/gate.py)."""
from __future__ import annotations

from pathlib import Path

from grpo_core.config import GRPOConfig
from grpo_core.data import arithmetic
from grpo_core.data import iteration as data_iteration
from grpo_core.task import read_tasks, write_tasks
from tasks.data_logging import log_curation, parent_questions_path
from tasks.layout import cfg_of, eval_split_path, gate_set_path, iter_dir
from tasks.run_state import mlflow_run_id
from tasks.splits import curated_cache, ensure_eval_split
from tasks.stage import stage


def training_prompts(cfg: GRPOConfig, run_dir: str | Path, iteration: int, n: int, out_dir: Path, seed: int) -> dict:
    """n training prompts of `iteration` in out_dir/prompts.jsonl (never a held-out or gate question); the record
    curation reports (prompts, num_prompts, sources, ...)."""
    d = cfg.data
    held_out = read_tasks(ensure_eval_split(cfg, run_dir))
    gate = read_tasks(gate_set_path(run_dir)) if gate_set_path(run_dir).is_file() else []
    if d.curated:  # sources + weights + pass-rate band, recalibrated from earlier iterations' scores
        parent = parent_questions_path(run_dir)
        return data_iteration.curate_iteration(
            d.curated, run_dir, iteration, n, d.weights, tuple(d.pass_rate_band), d.recalibrate, seed, out_dir,
            curated_cache(), gate, set(parent.read_text().split()) if parent.is_file() else None, d.pass_rate_max_age)
    prompts = arithmetic.train_tasks(n, d.min_digits, d.max_digits, d.operations, seed=seed * 100_003 + iteration,
                                     exclude=held_out + gate)
    out = write_tasks(out_dir / "prompts.jsonl", prompts)
    return {"prompts": str(out), "num_prompts": len(prompts), "sources": {"arithmetic": len(prompts)}}


@stage("curate", key=lambda cfg, config, iteration, **_: {"data": config["data"], "seed": cfg.seed,
                                                          "iteration": iteration})
def curate(config: dict, run_dir: str, iteration: int) -> dict:
    cfg = cfg_of(config)
    record = training_prompts(cfg, run_dir, iteration, cfg.data.prompts_per_iteration, iter_dir(run_dir, iteration),
                              cfg.seed)
    record["eval"] = str(eval_split_path(run_dir))
    if (run_id := mlflow_run_id(run_dir)):
        log_curation(cfg, run_id, record, iteration, run_dir)
    return record
