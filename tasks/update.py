"""update: one GRPO update on the scored rollouts; checkpoints adapter + optimizer state atomically."""
from __future__ import annotations

from pathlib import Path

import torch
from prefect import task
from tqdm.auto import tqdm

from grpo_core.checkpoint import ADAPTER_DIR, STATE_FILE, load_trainer_state, save_checkpoint
from grpo_core.io import read_json, read_jsonl
from grpo_core.policy import load_policy
from grpo_core.update import ScoredSample, grpo_update, make_optimizer, make_scheduler
from tasks import tracking
from tasks.common import cfg_of, completed_record, fault_point, finish_stage, input_key, iter_dir, mlflow_run_id


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
    global_step = load_trainer_state(state, optimizer, scheduler)

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

    out_dir = save_checkpoint(policy, optimizer, scheduler, global_step + len(steps),
                              iter_dir(run_dir, iteration) / "update")
    ckpt, state_path = out_dir / ADAPTER_DIR, out_dir / STATE_FILE

    # Per-step metrics, one batched MLflow call per step; skip steps already logged (resume).
    score_metrics = read_json(Path(run_dir) / f"iter-{iteration}" / "score.json")["metrics"]
    rollout_rec = read_json(Path(run_dir) / f"iter-{iteration}" / "rollout.json")
    run_id = mlflow_run_id(run_dir)
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
            metrics.update({"sys/rollout_tokens_per_second": rollout_rec["tokens_per_second"],
                            "sys/rollout_seconds": rollout_rec["seconds"]})
        tracking.log_metrics(cfg, run_id, metrics, step)
    tracking.log_artifacts(cfg, run_id, ckpt, f"adapters/iter-{iteration}")
    fault_point("update:saved", iteration)   # test-only: a kill here leaves outputs + metrics but no record
    last = steps[-1] if steps else {}
    return finish_stage(run_dir, iteration, "update", key, {
        "checkpoint": str(ckpt), "state": str(state_path), "global_step": global_step + len(steps),
        "metrics": {**{f"train/{k}": v for k, v in last.items()}, **{f"train/{k}": v for k, v in batch_stats.items()}}})
