"""Held-out evaluation: greedy accuracy and sampled accuracy at the training temperature, per source."""
from __future__ import annotations

from collections import defaultdict
from statistics import mean
from typing import Sequence

from grpo_core.config import GRPOConfig
from grpo_core.data.schema import Task
from grpo_core.policy import Policy
from grpo_core.rewards import compute_rewards
from grpo_core.rollout import HFBackend, SamplingParams, rollout


def evaluate_policy(policy: Policy, tasks: Sequence[Task], cfg: GRPOConfig, seed: int) -> tuple[dict, list[dict]]:
    """Metrics (overall and per source) and per-completion rows. Deterministic given `seed`."""
    backend = HFBackend(policy.model, policy.tokenizer, policy.device, cfg.generation_batch_size)
    modes = []
    if cfg.eval.greedy:
        modes.append(("greedy", 1, SamplingParams(max_new_tokens=cfg.max_completion_length, greedy=True, seed=seed)))
    if cfg.eval.num_samples > 0:
        modes.append(("sampled", cfg.eval.num_samples, SamplingParams(
            max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, seed=seed)))
    metrics: dict[str, float] = {}
    rows: list[dict] = []
    by_id = {t.id: t for t in tasks}
    for mode, n, params in modes:
        samples = rollout(backend, policy.tokenizer, tasks, n, params, cfg.data.system_prompt, cfg.max_prompt_length)
        sample_tasks = [by_id[s.task_id] for s in samples]
        _, per_func = compute_rewards([s.completion for s in samples], sample_tasks, ["accuracy", "format"], [1, 1])
        groups: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(sample_tasks):
            groups["all"].append(i)
            groups[t.source].append(i)
        for name, idx in groups.items():
            acc = [per_func["accuracy"][i] for i in idx if per_func["accuracy"][i] is not None]
            prefix = f"eval/{mode}" if name == "all" else f"eval/{name}/{mode}"
            metrics[f"{prefix}/accuracy"] = mean(acc) if acc else 0.0
            metrics[f"{prefix}/format"] = mean(per_func["format"][i] for i in idx)
            metrics[f"{prefix}/completion_length"] = mean(len(samples[i].completion_ids) for i in idx)
            metrics[f"{prefix}/truncated_frac"] = mean(float(samples[i].truncated) for i in idx)
        for i, s in enumerate(samples):
            rows.append({"mode": mode, "task_id": s.task_id, "source": sample_tasks[i].source,
                         "prompt": sample_tasks[i].prompt, "completion": s.completion,
                         "accuracy": per_func["accuracy"][i], "format": per_func["format"][i],
                         "truncated": s.truncated})
    return metrics, rows
