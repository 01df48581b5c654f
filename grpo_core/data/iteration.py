"""What the `curate` stage does with curated data each iteration (pure Python; `tasks/curate.py` calls it).

Once per run: resolve `data.curated` (a built dataset directory, a .parquet/.jsonl task file, or a
curation YAML built into the run directory) and write the held-out split. Every iteration: re-measure
each task's pass rate from the previous iterations' scores (later iterations win), drop tasks outside
`data.pass_rate_band` (groups that are all right or all wrong teach nothing), and draw
`data.prompts_per_iteration` prompts with the configured per-source/group weights.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from grpo_core.data import curation
from grpo_core.data.build import build, load_build_config, read_any, read_dataset
from grpo_core.task import Task, write_tasks
from grpo_core.io import atomic_write_text

FILE_EVAL_FRACTION = 0.1  # held-out share when data.curated is a single task file


def resolve_curated(spec: str, run_dir: str | Path) -> Path:
    """The dataset `data.curated` names; a curation YAML is built once into <run_dir>/data/built."""
    p = Path(spec)
    if p.suffix not in (".yaml", ".yml"):
        if not p.exists():
            raise FileNotFoundError(f"data.curated: {spec!r} does not exist; give a dataset directory from "
                                    "`grpo data build`, a .parquet/.jsonl task file, or a curation YAML")
        return p
    marker = Path(run_dir) / "data" / "curated.json"
    if marker.is_file():
        return Path(json.loads(marker.read_text())["path"])
    result = build(load_build_config(p, {"out_dir": str(Path(run_dir) / "data" / "built")}))
    atomic_write_text(marker, json.dumps({"path": str(result.path), "hash": result.report["dataset_hash"]}))
    return result.path


def splits_of(path: Path) -> tuple[list[Task], list[Task]]:
    """(train, eval) of a built dataset directory, or a hash split of a single task file."""
    if path.is_dir():
        return read_dataset(path, "train"), read_dataset(path, "eval")
    return curation.split(read_any(path), FILE_EVAL_FRACTION)


def eval_tasks(spec: str, run_dir: str | Path, n: int) -> list[Task]:
    """Up to n held-out tasks, in a stable order."""
    _, ev = splits_of(resolve_curated(spec, run_dir))
    if not ev:
        raise ValueError(f"data.curated {spec!r} has no eval split; build it with eval_fraction > 0")
    return sorted(ev, key=lambda t: t.content_hash())[:n]


def previous_pass_rates(run_dir: str | Path, iteration: int) -> dict[str, tuple[float, int]]:
    """{task id: (pass rate, samples)} from iter-1..iter-(k-1)/scores.jsonl, the latest measurement winning."""
    rates: dict[str, tuple[float, int]] = {}
    for k in range(1, iteration):
        path = Path(run_dir) / f"iter-{k}" / "scores.jsonl"
        if path.is_file():
            rates.update(curation.pass_rates_from_rollouts(path))
    return rates


def draw_prompts(pool: list[Task], n: int, weights: dict[str, float], seed: int, band: tuple[float, float],
                 rates: dict[str, tuple[float, int]], min_samples: int = 2) -> tuple[list[Task], dict[str, Any]]:
    """n prompts inside the band (untried tasks count as inside), topped up with the nearest outside."""
    inside, outside = curation.recalibrate(pool, rates, band, min_samples)
    chosen, _ = curation.mix(inside, weights, n, seed)
    if len(chosen) < n and outside:
        by_id = {t.id: t for t in pool}
        lo, hi = band
        nearest = sorted((by_id[r.id] for r in outside),
                         key=lambda t: (min(abs(t.meta["pass_rate"] - lo), abs(t.meta["pass_rate"] - hi)), t.content_hash()))
        chosen += nearest[:n - len(chosen)]
    info = {
        "pool": len(pool), "in_band": len(inside), "out_of_band": len(outside),
        "measured": sum(1 for t in pool if t.id in rates), "prompts": len(chosen),
        "sources": dict(Counter(curation.source_key(t) for t in chosen)),
        "kinds": dict(Counter(t.kind for t in chosen)),
        "pass_rate_histogram": curation.pass_rate_histogram(t for t in pool if t.id in rates),
    }
    return chosen, info


def curate_iteration(spec: str, run_dir: str | Path, iteration: int, n: int, weights: dict[str, float],
                     band: tuple[float, float], recalibrate: bool, seed: int, out_dir: str | Path) -> dict[str, Any]:
    """Write <out_dir>/prompts.jsonl and curation.json; return the stage record fields."""
    path = resolve_curated(spec, run_dir)
    train, _ = splits_of(path)
    if not train:
        raise ValueError(f"data.curated {spec!r} has no training tasks")
    rates = previous_pass_rates(run_dir, iteration) if recalibrate else {}
    prompts, info = draw_prompts(train, n, weights, seed * 100_003 + iteration, band, rates)
    out = write_tasks(Path(out_dir) / "prompts.jsonl", prompts)
    report = {"dataset": str(path), "iteration": iteration, "band": list(band), "weights": weights, **info}
    report_path = atomic_write_text(Path(out_dir) / "curation.json", json.dumps(report, indent=2))
    return {"prompts": str(out), "num_prompts": len(prompts), "sources": info["sources"],
            "report": str(report_path), "dataset": str(path),
            "metrics": {"pool": info["pool"], "in_band": info["in_band"], "out_of_band": info["out_of_band"],
                        "measured": info["measured"]}}
