"""A calibration policy backed by a real model: sample k answers per task and score them with the
pipeline's own correctness reward (math answers in-process, code in the sandbox)."""
from __future__ import annotations

from typing import Sequence

from grpo_core.data.curation import PolicyFn
from grpo_core.task import Task

def model_policy(model: str, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
                 prompt_format=None, device: str = "auto",
                 max_prompt_length: int = 512, batch_size: int = 32) -> PolicyFn:
    """`policy(tasks, k)` for `curation.calibrate`, sampling from `model` (a built-in name or a local dir).

    `prompt_format` (a rollout.PromptFormat) defaults to the training default, so calibration sees the
    prompts training will use."""
    import torch

    from grpo_core.model.loading import load_base_model, load_tokenizer, resolve_model, select_device
    from grpo_core.rewards.rewards import CORRECTNESS_FUNC, compute_rewards
    from grpo_core.rollout.samplers import KVCacheSampler, rollout
    from grpo_core.rollout.sampling import SamplingParams

    from grpo_core.config import DataConfig
    fmt = prompt_format if prompt_format is not None else DataConfig().prompt_format
    path = resolve_model(model)
    dev = select_device(device)
    tok = load_tokenizer(path)
    net = load_base_model(path, dev, torch.float32).eval()
    backend = KVCacheSampler(net, tok, dev, batch_size, progress=False)      # rollout_backend auto's engine
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def policy(tasks: Sequence[Task], k: int) -> list[list[float]]:
        samples = rollout(backend, tok, tasks, k, params, fmt, max_prompt_length)
        scores = compute_rewards([s.completion for s in samples], [tasks[s.group] for s in samples],
                                 [CORRECTNESS_FUNC], [1.0]).per_func[CORRECTNESS_FUNC]
        out: list[list[float]] = [[] for _ in tasks]
        for s, r in zip(samples, scores):
            if r is not None:          # unscorable (sandbox failure): left out, not counted as wrong
                out[s.group].append(float(r))
        return out
    return policy
