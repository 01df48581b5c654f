"""Rollout: sample a group of completions per prompt from the current policy.

Generation sits behind a tiny backend interface (`RolloutBackend.generate`); Hugging Face `generate`
is the default backend.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

import torch
from tqdm.auto import tqdm

from grpo_core.data.schema import Task


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int = 0


@dataclass
class Sample:
    """One completion. Token ids are kept so the update never re-tokenises (what was sampled is scored)."""
    task_id: str
    group: int                  # index of the prompt in this batch; samples of a group share it
    prompt_ids: list[int]
    completion_ids: list[int]   # including the EOS token when the model stopped by itself
    completion: str             # decoded, special tokens removed
    truncated: bool             # hit max_new_tokens without EOS
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class RolloutBackend(Protocol):
    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[list[list[int]]]:
        """For each prompt (token ids), n completions (token ids, EOS included if emitted)."""


def chat_prompt_ids(tokenizer, task: Task, system_prompt: str, max_prompt_length: int) -> list[int]:
    """The task's prompt in the model's chat format, as token ids (left-truncated to max_prompt_length)."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
               [{"role": "user", "content": task.prompt}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(f"{system_prompt}\n\n{task.prompt}\n", add_special_tokens=True)["input_ids"]
    return list(ids)[-max_prompt_length:]


class HFBackend:
    """Batched sampling with transformers' `generate` (left padding, stops when every row has ended)."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 64, progress: bool = True):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.batch_size, self.progress = batch_size, progress

    @torch.inference_mode()
    def generate(self, prompts, n, params):
        rows = [p for p in prompts for _ in range(n)]                       # prompt-major: groups contiguous
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))       # bucket by length: less padding
        out: list[list[int] | None] = [None] * len(rows)
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        torch.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        bar = tqdm(total=len(rows), desc="generate", unit="seq", disable=not self.progress, leave=False)
        for start in range(0, len(rows), self.batch_size):
            idx = order[start:start + self.batch_size]
            width = max(len(rows[i]) for i in idx)
            input_ids = torch.full((len(idx), width), pad, dtype=torch.long)
            attn = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                input_ids[r, width - len(rows[i]):] = torch.tensor(rows[i])
                attn[r, width - len(rows[i]):] = 1
            kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad, eos_token_id=eos)
            if params.greedy:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            else:
                kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k or None)
            gen = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                      **kwargs)[:, width:].cpu()
            for r, i in enumerate(idx):
                ids = gen[r].tolist()
                if eos in ids:
                    ids = ids[:ids.index(eos) + 1]
                else:
                    while ids and ids[-1] == pad:
                        ids.pop()
                out[i] = ids
            bar.update(len(idx))
        bar.close()
        self.model.train(was_training)
        return [out[k * n:(k + 1) * n] for k in range(len(prompts))]


def rollout(backend: RolloutBackend, tokenizer, tasks: Sequence[Task], n: int, params: SamplingParams,
            system_prompt: str, max_prompt_length: int) -> list[Sample]:
    """n completions for every task, as Samples (groups contiguous, in task order)."""
    prompt_ids = [chat_prompt_ids(tokenizer, t, system_prompt, max_prompt_length) for t in tasks]
    completions = backend.generate(prompt_ids, n, params)
    eos = tokenizer.eos_token_id
    samples = []
    for g, (task, p_ids, group) in enumerate(zip(tasks, prompt_ids, completions)):
        for c_ids in group:
            samples.append(Sample(task_id=task.id, group=g, prompt_ids=p_ids, completion_ids=c_ids,
                                  completion=tokenizer.decode(c_ids, skip_special_tokens=True),
                                  truncated=not (c_ids and c_ids[-1] == eos)))
    return samples
