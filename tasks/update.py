"""update: one GRPO update on the scored rollouts (samples.jsonl, scores.jsonl: read once, here) on one process or
several (tasks/distributed.py); the first checkpoints adapter + optimizer state atomically; the stage logs the
steps, the completion table (tasks/completions.py), the adapter to MLflow, and which kernels the update took."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from grpo_core.io import read_jsonl
from grpo_core.kernels.fused_decode import update_linears
from grpo_core.model.policy import load_policy
from grpo_core.parallel import DataParallel
from grpo_core.update.checkpoint import ADAPTER_DIR, STATE_FILE, load_trainer_state, save_checkpoint
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler
from tasks import completions, distributed, tracking
from tasks.layout import cfg_of, iter_dir
from tasks.run_state import init_adapter_path, mlflow_run_id
from tasks.stage import stage


def scored_batch(samples: list[dict], scores: list[dict]) -> list[ScoredSample | None]:
    """The rollout rows joined with their rewards; None where a completion could not be scored."""
    return [None if sc["reward"] is None else
            ScoredSample(group=r["group"], prompt_ids=r["prompt_ids"], completion_ids=r["completion_ids"],
                         reward=sc["reward"], truncated=r["truncated"], sampler_logprobs=r.get("sampler_logprobs"),
                         completion_mask=r.get("completion_mask"), rewards_per_func=sc.get("rewards"))
            for r, sc in zip(samples, scores)]


def train_on_batch(data_parallel: DataParallel, config: dict, run_dir: str, iteration: int, samples: list[dict],
                   scores: list[dict], checkpoint: str | None, state: str | None) -> dict:
    """This process's part of the update on the rows of samples.jsonl and scores.jsonl (all of it when alone);
    the first process writes the checkpoint and returns the steps' metrics, the batch statistics, each row's
    advantage and prompt text (for the completion tables), the global step and the checkpoint directory."""
    cfg = cfg_of(config)
    # 1) the policy and optimizer where the previous iteration left them
    torch.manual_seed(cfg.seed * 31 + iteration)              # a fresh adapter's initial weights
    policy = load_policy(cfg, checkpoint, init_adapter=init_adapter_path(run_dir))
    torch.manual_seed(cfg.seed * 37 + iteration)              # the update's draws, however the policy was loaded
    optimizer = make_optimizer(policy, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    global_step = load_trainer_state(state, optimizer, scheduler)
    # 2) the update itself
    n_steps = cfg.steps_per_iteration * cfg.num_iterations
    with tqdm(total=n_steps, desc=f"update iter {iteration}", unit="step", disable=data_parallel.rank != 0) as bar:
        steps, batch_stats, advantages = grpo_update(policy, optimizer, scheduler, scored_batch(samples, scores),
                                                     cfg, seed=cfg.seed + iteration, progress=bar,
                                                     data_parallel=data_parallel)
    # 3) the checkpoint, written once
    if data_parallel.rank != 0:
        return {}
    out_dir = save_checkpoint(policy, optimizer, scheduler, global_step + len(steps),
                              iter_dir(run_dir, iteration) / "update")
    return {"steps": steps, "batch_stats": batch_stats, "global_step": global_step + len(steps),
            "out_dir": str(out_dir), "num_processes": data_parallel.world_size, "advantages": advantages,
            "prompts": completions.prompt_texts(samples, policy.tokenizer), "linears": update_linears(policy.model)}


@stage("update", key=lambda config, samples, scores, checkpoint, state, **_: {
    "config": config, "samples": samples, "scores": scores, "checkpoint": checkpoint, "state": state})
def update(config: dict, run_dir: str, iteration: int, samples: str, scores: str, checkpoint: str | None,
           state: str | None) -> dict:
    cfg = cfg_of(config)
    rows, scored = list(read_jsonl(samples)), list(read_jsonl(scores))
    trained = distributed.run_on_processes(
        train_on_batch, dict(config=config, run_dir=run_dir, iteration=iteration, samples=rows, scores=scored,
                             checkpoint=checkpoint, state=state),
        cfg.stages.update.num_processes, cfg.device, iter_dir(run_dir, iteration) / "update.processes")
    # per-step metrics (steps a killed attempt logged are skipped), the batch's statistics with the first
    steps, out_dir, global_step = trained["steps"], Path(trained["out_dir"]), trained["global_step"]
    batch_metrics = {f"train/{k}": v for k, v in trained["batch_stats"].items()}
    run_id, last = mlflow_run_id(run_dir), steps[-1] if steps else {}
    tracking.log_update_steps(cfg, run_id, steps, global_step - len(steps) + 1, batch_metrics)
    completions.log_completions(cfg, run_id, iteration, rows, scored, trained["advantages"], trained["prompts"])
    tracking.log_artifacts(cfg, run_id, out_dir / ADAPTER_DIR, f"adapters/iter-{iteration}")
    return {"checkpoint": str(out_dir / ADAPTER_DIR), "state": str(out_dir / STATE_FILE), "global_step": global_step,
            "num_processes": trained["num_processes"], "linears": trained["linears"],
            "metrics": {**{f"train/{k}": v for k, v in last.items()}, **batch_metrics}}
