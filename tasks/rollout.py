"""rollout: sample a group of num_generations completions per prompt from the current policy."""
from __future__ import annotations

import time

from grpo_core.task import read_tasks
from grpo_core.io import write_jsonl
from grpo_core.policy import load_policy
from grpo_core.sampling import SamplingParams
from grpo_core.rollout import make_backend, rollout as sample_groups
from tasks.layout import cfg_of, iter_dir
from tasks.stage import stage


@stage("rollout", key=lambda config, prompts, checkpoint, **_: {"config": config, "prompts": prompts,
                                                                "checkpoint": checkpoint})
def rollout(config: dict, run_dir: str, iteration: int, prompts: str, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    tasks = read_tasks(prompts)
    policy = load_policy(cfg, checkpoint, need_reference=False)
    backend = make_backend(cfg, policy)           # cfg.rollout_backend: static (default) | hf | vllm
    params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                            top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed * 7919 + iteration,
                            logprobs=cfg.needs_sampler_logprobs)
    t0 = time.perf_counter()
    samples = sample_groups(backend, policy.tokenizer, tasks, cfg.num_generations, params,
                            cfg.data.prompt_format_at(iteration), cfg.max_prompt_length)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) for s in samples)
    out = write_jsonl(iter_dir(run_dir, iteration) / "samples.jsonl", (s.to_dict() for s in samples))
    return {"samples": str(out), "num_samples": len(samples), "seconds": seconds, "completion_tokens": tokens,
            "tokens_per_second": tokens / max(seconds, 1e-9), "sampler": getattr(backend, "path", cfg.rollout_backend)}
