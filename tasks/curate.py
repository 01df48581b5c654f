"""curate: build the iteration's training prompts (and, once per run, the held-out split). Training never asks
a question of the promotion gate's set (<run_dir>/data/gate.jsonl, tasks/gate.py)."""
from __future__ import annotations

from pathlib import Path

from grpo_core.config import GRPOConfig
from grpo_core.data import arithmetic
from grpo_core.data import iteration as data_iteration
from grpo_core.io import grpo_home
from grpo_core.task import read_tasks, write_tasks
from tasks.data_logging import log_curation, parent_questions_path
from tasks.layout import cfg_of, eval_split_path, gate_set_path, iter_dir
from tasks.run_state import mlflow_run_id
from tasks.stage import stage


def say(message: str) -> None:
    """To the Prefect log (which the console shows) inside a flow, else to the console."""
    try:
        from prefect import get_run_logger
        get_run_logger().info(message)
    except Exception:  # noqa: BLE001 - outside a flow/task run there is no run logger
        print(message, flush=True)


def curated_cache() -> Path:
    """Where users' own data files are curated once, by content hash, for every run."""
    return grpo_home() / "data" / "curated"


def ensure_eval_split(cfg: GRPOConfig, run_dir: str | Path) -> Path:
    """The run's held-out tasks, written once; every later stage reads the same file."""
    path = eval_split_path(run_dir)
    if not path.exists():
        d = cfg.data
        if d.curated:  # curated data: its own held-out split (grpo_core.data.iteration)
            write_tasks(path, data_iteration.eval_tasks(d.curated, run_dir, d.eval_size, curated_cache()))
            say(data_iteration.describe_rejections(
                d.curated, data_iteration.resolve_curated(d.curated, run_dir, curated_cache())))
        else:
            write_tasks(path, held_out_preview(cfg, run_dir))
    return path


def held_out_preview(cfg: GRPOConfig, run_dir: str | Path) -> list | None:
    """The run's held-out tasks as ensure_eval_split will write them, found without writing under `run_dir`; None
    for a curation YAML the run has not built yet."""
    d = cfg.data
    if not d.curated:
        return arithmetic.eval_tasks(d.eval_size, d.min_digits, d.max_digits, d.operations)
    path = data_iteration.peek_curated(d.curated, run_dir, curated_cache())
    return None if path is None else data_iteration.held_out_of(path, d.eval_size, d.curated)


@stage("curate", key=lambda cfg, config, iteration, **_: {"data": config["data"], "seed": cfg.seed,
                                                          "iteration": iteration})
def curate(config: dict, run_dir: str, iteration: int) -> dict:
    cfg = cfg_of(config)
    eval_path = ensure_eval_split(cfg, run_dir)
    d = cfg.data
    gate = read_tasks(gate_set_path(run_dir)) if gate_set_path(run_dir).is_file() else []
    if d.curated:  # sources + weights + pass-rate band, recalibrated from earlier iterations' scores
        parent = parent_questions_path(run_dir)
        record = data_iteration.curate_iteration(
            d.curated, run_dir, iteration, d.prompts_per_iteration, d.weights, tuple(d.pass_rate_band),
            d.recalibrate, cfg.seed, iter_dir(run_dir, iteration), curated_cache(), gate,
            set(parent.read_text().split()) if parent.is_file() else None, d.pass_rate_max_age)
    else:
        prompts = arithmetic.train_tasks(d.prompts_per_iteration, d.min_digits, d.max_digits, d.operations,
                                         seed=cfg.seed * 100_003 + iteration, exclude=read_tasks(eval_path) + gate)
        out = write_tasks(iter_dir(run_dir, iteration) / "prompts.jsonl", prompts)
        record = {"prompts": str(out), "num_prompts": len(prompts), "sources": {"arithmetic": len(prompts)}}
    record["eval"] = str(eval_path)
    if (run_id := mlflow_run_id(run_dir)):
        log_curation(cfg, run_id, record, iteration, run_dir)
    return record
