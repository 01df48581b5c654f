"""rollout: sample a group of num_generations completions per prompt from the current policy."""
from __future__ import annotations

import time

from prefect import task

from grpo_core.task import read_tasks
from grpo_core.io import write_jsonl
from grpo_core.policy import load_policy
from grpo_core.sampling import SamplingParams
from grpo_core.rollout import make_backend, rollout as sample_groups
from tasks.common import cfg_of, completed_record, finish_stage, input_key, iter_dir


@task(name="rollout")
def rollout(config: dict, run_dir: str, iteration: int, prompts: str, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    key = input_key(config=config, prompts=prompts, checkpoint=checkpoint)
    if (done := completed_record(run_dir, iteration, "rollout", key)):
        return done
    tasks = read_tasks(prompts)
    policy = load_policy(cfg, checkpoint, need_reference=False)
    backend = make_backend(cfg, policy)           # cfg.rollout_backend: static (default) | hf | vllm
    params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                            top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed * 7919 + iteration)
    t0 = time.perf_counter()
    samples = sample_groups(backend, policy.tokenizer, tasks, cfg.num_generations, params,
                            cfg.data.prompt_format, cfg.max_prompt_length)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) for s in samples)
    out = write_jsonl(iter_dir(run_dir, iteration) / "samples.jsonl", (s.to_dict() for s in samples))
    return finish_stage(run_dir, iteration, "rollout", key, {
        "samples": str(out), "num_samples": len(samples), "seconds": seconds, "completion_tokens": tokens,
        "tokens_per_second": tokens / max(seconds, 1e-9)})
