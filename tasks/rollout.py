"""rollout: sample a group of num_generations completions per prompt from the current policy, on one process or
several (stages.rollout.num_processes, tasks/distributed.py: each samples its share of the prompts). The stage
logs its throughput (sys/rollout_seconds, sys/rollout_tokens_per_second) to the run's MLflow run, at the step of
the iteration's first update step (tasks/tracking.py: log_iteration_metrics)."""
from __future__ import annotations

import contextlib
import time

from grpo_core.io import write_jsonl
from grpo_core.rollout.multiturn import Toolbox
from grpo_core.model.policy import load_policy
from grpo_core.rollout.samplers import make_backend, rollout as sample_groups
from grpo_core.rollout.sampling import SamplingParams, sampling_options
from grpo_core.rewards.scoring import GroupScorer, early_scores_path, scores_during_rollout, write_early_scores
from grpo_core.task import read_tasks
from grpo_core.parallel import DataParallel, interleave
from tasks import distributed, tracking
from tasks.layout import cfg_of, iter_dir
from tasks.stage import stage


def sample_share(data_parallel: DataParallel, config: dict, run_dir: str, iteration: int, prompts: str,
                 checkpoint: str | None) -> dict:
    """This process's share of the prompts, sampled (group = the prompt's position in the batch; scored as each
    group is done where the score stage runs here); the first process gathers every group, in prompt order, writes
    samples.jsonl (and early_scores.json) and returns the stage's record (the others return {})."""
    cfg, batch = cfg_of(config), read_tasks(prompts)
    tasks, group_ids = data_parallel.shard(batch), data_parallel.shard(range(len(batch)))
    policy = load_policy(cfg, checkpoint, need_reference=False)
    first = data_parallel.rank == 0
    backend = make_backend(cfg, policy, progress=first)       # cfg.rollout_backend: auto (default) | fused | torch | vllm
    params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                            **sampling_options(cfg),          # top_p, top_k, min_p, ... and generation_kwargs
                            seed=data_parallel.shard_seed(cfg.seed * 7919 + iteration),
                            logprobs=cfg.needs_sampler_logprobs)
    scorer = GroupScorer(cfg, tasks) if scores_during_rollout(cfg) else None
    on_group = (lambda group: scorer.add(group[0].group, [s.to_dict() for s in group])) if scorer else None
    t0 = time.perf_counter()
    with scorer or contextlib.nullcontext():
        samples = sample_groups(backend, policy.tokenizer, tasks, cfg.num_generations, params,
                                cfg.data.prompt_format_at(iteration), cfg.max_prompt_length, on_group,
                                Toolbox.from_config(cfg), group_ids) if tasks else []
    sampled = time.perf_counter() - t0
    early = scorer.finish() if scorer else None            # the groups sampled last are still being scored
    by_group = {g: [] for g in group_ids}
    for s in samples:
        by_group[s.group].append(s.to_dict())
    groups = list(by_group.values())
    scored = [early[0].get(g) for g in group_ids] if early else None
    scored = None if scored is None or None in scored else scored        # every group scored, or none adopted
    shards = data_parallel.gather((groups, scored, early[1] if early else None))
    seconds = time.perf_counter() - t0
    if not first:
        return {}
    rows = [row for group in interleave([g for g, _, _ in shards]) for row in group]
    tokens = sum(len(r["completion_ids"]) for r in rows)
    out = write_jsonl(iter_dir(run_dir, iteration) / "samples.jsonl", rows)
    early_scores_path(out).unlink(missing_ok=True)
    if rows and all(s is not None for _, s, _ in shards):          # every process scored all its groups
        reward_seconds = {f: sum(sec.get(f, 0.0) for _, _, sec in shards)
                          for f in dict.fromkeys(f for _, _, sec in shards for f in sec)}
        write_early_scores(cfg, out, [r for group in interleave([s for _, s, _ in shards]) for r in group],
                           reward_seconds)
    return {"samples": str(out), "num_samples": len(rows), "seconds": seconds, "sampling_seconds": sampled,
            "completion_tokens": tokens, "tokens_per_second": tokens / max(sampled, 1e-9),
            "sampler": getattr(backend, "path", cfg.rollout_backend), "num_processes": data_parallel.world_size,
            "scored_during_rollout": early_scores_path(out).exists()}


@stage("rollout", key=lambda config, prompts, checkpoint, **_: {"config": config, "prompts": prompts,
                                                                "checkpoint": checkpoint})
def rollout(config: dict, run_dir: str, iteration: int, prompts: str, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    record = distributed.run_on_processes(
        sample_share, dict(config=config, run_dir=run_dir, iteration=iteration, prompts=prompts, checkpoint=checkpoint),
        cfg.stages.rollout.num_processes, cfg.device, iter_dir(run_dir, iteration) / "rollout.processes", "rollout")
    tracking.log_iteration_metrics(cfg, run_dir, iteration, {                 # once, by the first process's record
        "sys/rollout_tokens_per_second": record["tokens_per_second"], "sys/rollout_seconds": record["seconds"]})
    return record
