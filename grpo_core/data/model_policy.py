"""A calibration policy backed by a real model: sample k answers per task and score them with the
pipeline's own correctness reward (math answers in-process, code in the sandbox)."""
from __future__ import annotations

from typing import Sequence

from grpo_core.data.curation import PolicyFn
from grpo_core.data.schema import Task

DEFAULT_SYSTEM_PROMPT = ("Answer the question. Think briefly, then give only the final answer "
                         "inside <answer></answer> tags.")


def model_policy(model: str, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, device: str = "auto",
                 max_prompt_length: int = 512, batch_size: int = 32) -> PolicyFn:
    """`policy(tasks, k)` for `curation.calibrate`, sampling from `model` (a built-in name or a local dir)."""
    import torch

    from grpo_core.models import load_base_model, load_tokenizer, resolve_model, select_device
    from grpo_core.rewards import accuracy_reward
    from grpo_core.rollout import HFBackend, SamplingParams, rollout

    path = resolve_model(model)
    dev = select_device(device)
    tok = load_tokenizer(path)
    net = load_base_model(path, dev, torch.float32).eval()
    backend = HFBackend(net, tok, dev, batch_size, progress=False)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def policy(tasks: Sequence[Task], k: int) -> list[list[float]]:
        samples = rollout(backend, tok, tasks, k, params, system_prompt, max_prompt_length)
        scores = accuracy_reward([s.completion for s in samples], [tasks[s.group] for s in samples])
        out: list[list[float]] = [[] for _ in tasks]
        for s, r in zip(samples, scores):
            if r is not None:          # unscorable (sandbox failure): left out, not counted as wrong
                out[s.group].append(float(r))
        return out
    return policy
