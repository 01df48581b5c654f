"""A run's held-out split (written once, read by every stage) and where users' curated data is cached; shared by
the curate, evaluate and warmstart stages and the promotion gate."""
from __future__ import annotations

from pathlib import Path

from grpo_core.config import GRPOConfig
from grpo_core.data import arithmetic
from grpo_core.data import iteration as data_iteration
from grpo_core.io import grpo_home
from grpo_core.task import write_tasks
from tasks import tracking
from tasks.layout import eval_split_path


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
            tracking.console(data_iteration.describe_rejections(
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
