"""update: one GRPO update on the scored rollouts; checkpoints adapter + optimizer state atomically."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from statistics import mean

import torch
from prefect import task
from tqdm.auto import tqdm

from grpo_core.data.schema import read_jsonl
from grpo_core.policy import load_policy
from grpo_core.update import ScoredSample, grpo_update, make_optimizer, make_scheduler
from tasks import tracking
from tasks.common import cfg_of, completed_record, finish_stage, input_key, iter_dir, read_json


def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def _save_state(path: Path, optimizer, scheduler, global_step: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": _rng_state(), "global_step": global_step}, tmp)
    os.replace(tmp, path)


def _save_checkpoint(policy, out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    policy.save(tmp)
    os.replace(tmp, out)
    return out


@task(name="update")
def update(config: dict, run_dir: str, iteration: int, samples: str, scores: str,
           checkpoint: str | None, state: str | None) -> dict:
    cfg = cfg_of(config)
    key = input_key(config=config, samples=samples, scores=scores, checkpoint=checkpoint, state=state)
    if (done := completed_record(run_dir, iteration, "update", key)):
        return done
    torch.manual_seed(cfg.seed * 31 + iteration)
    policy = load_policy(cfg, checkpoint)
    optimizer = make_optimizer(policy, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    global_step = 0
    if state:
        saved = torch.load(state, weights_only=False)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        global_step = saved["global_step"]

    rows = list(read_jsonl(samples))
    scored = list(read_jsonl(scores))
    batch = [None if sc["reward"] is None else
             ScoredSample(group=r["group"], prompt_ids=r["prompt_ids"], completion_ids=r["completion_ids"],
                          reward=sc["reward"], truncated=r["truncated"])
             for r, sc in zip(rows, scored)]
    n_steps = cfg.steps_per_iteration * cfg.num_iterations
    with tqdm(total=n_steps, desc=f"update iter {iteration}", unit="step") as bar:
        steps, batch_stats = grpo_update(policy, optimizer, scheduler, batch, cfg, seed=cfg.seed + iteration,
                                         progress=bar)

    out_dir = iter_dir(run_dir, iteration) / "update"
    out_dir.mkdir(exist_ok=True)
    ckpt = _save_checkpoint(policy, out_dir / "checkpoint")
    state_path = out_dir / "trainer_state.pt"
    _save_state(state_path, optimizer, scheduler, global_step + len(steps))

    # Per-step metrics, one batched MLflow call per step; skip steps already logged (resume).
    score_metrics = read_json(Path(run_dir) / f"iter-{iteration}" / "score.json")["metrics"]
    rollout_rec = read_json(Path(run_dir) / f"iter-{iteration}" / "rollout.json")
    lengths = [len(r["completion_ids"]) for r in rows]
    run_id = read_json(Path(run_dir) / "run.json")["mlflow_run_id"]
    done_steps = tracking.logged_steps(cfg, run_id, "train/loss")
    for i, m in enumerate(steps):
        step = global_step + i + 1
        if step in done_steps:
            continue
        metrics = {f"train/{k}": v for k, v in m.items()}
        metrics["train/tokens_per_second"] = m["step_tokens"] / max(m["step_seconds"], 1e-9)
        if i == 0:
            metrics.update(score_metrics)
            metrics.update({f"train/{k}": v for k, v in batch_stats.items()})
            metrics.update({"train/completion_length_mean": mean(lengths), "train/completion_length_max": max(lengths),
                            "train/completion_length_min": min(lengths),
                            "train/truncated_frac": mean(float(r["truncated"]) for r in rows),
                            "sys/rollout_tokens_per_second": rollout_rec["tokens_per_second"],
                            "sys/rollout_seconds": rollout_rec["seconds"]})
        tracking.log_metrics(cfg, run_id, metrics, step)
    tracking.log_artifacts(cfg, run_id, ckpt, f"adapters/iter-{iteration}")
    last = steps[-1] if steps else {}
    return finish_stage(run_dir, iteration, "update", key, {
        "checkpoint": str(ckpt), "state": str(state_path), "global_step": global_step + len(steps),
        "metrics": {**{f"train/{k}": v for k, v in last.items()}, **{f"train/{k}": v for k, v in batch_stats.items()}}})
