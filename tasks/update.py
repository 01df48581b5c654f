"""update: one GRPO update on the scored rollouts; checkpoints adapter + optimizer state atomically."""
from __future__ import annotations

import random
from pathlib import Path

import torch
from prefect import task
from tqdm.auto import tqdm

from grpo_core.data.schema import atomic_dir, read_jsonl
from grpo_core.policy import load_policy
from grpo_core.update import ScoredSample, grpo_update, make_optimizer, make_scheduler
from tasks import tracking
from tasks.common import cfg_of, completed_record, fault_point, finish_stage, input_key, iter_dir, mlflow_run_id, read_json


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    """Continue the random streams exactly where the previous update left them (resume = no resume)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_outputs(policy, optimizer, scheduler, global_step: int, out: Path) -> Path:
    """Adapter (out/checkpoint/) and optimizer + scheduler + RNG (out/trainer_state.pt), all or nothing:
    both are written into a temp dir that is renamed into place; the stage record is written after."""
    def build(tmp: Path) -> None:
        policy.save(tmp / "checkpoint")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": _rng_state(), "global_step": global_step}, tmp / "trainer_state.pt")
    return atomic_dir(out, build, replace=True)   # a re-run after a kill replaces the unrecorded outputs


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
        if "rng" in saved:
            _set_rng_state(saved["rng"])

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

    out_dir = _save_outputs(policy, optimizer, scheduler, global_step + len(steps),
                            iter_dir(run_dir, iteration) / "update")
    ckpt, state_path = out_dir / "checkpoint", out_dir / "trainer_state.pt"

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
