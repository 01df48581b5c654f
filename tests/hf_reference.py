"""transformers' `generate`, called directly as the reference our engines are compared with (the `hf` rollout
backend that wrapped it was removed, issue #49): left padding, the rows of each prompt contiguous, a completion
cut after EOS (pad stripped), with `logprobs` each token's log-prob under generate's processed scores."""
from __future__ import annotations

import torch

from grpo_core.rollout.samplers import left_pad
from grpo_core.rollout.sampling import Completion, SamplingParams, StopStrings


@torch.no_grad()
def generate_reference(model, tok, prompts, n: int, params: SamplingParams, batch_size: int = 64):
    """n completions of every prompt by `model.generate`, grouped by prompt (the old HFGenerateSampler's output;
    rows in prompt order, in batches of `batch_size`, the global generator seeded with params.seed)."""
    torch.manual_seed(params.seed)
    rows = [p for p in prompts for _ in range(n)]
    pad, eos = tok.pad_token_id, tok.eos_token_id
    stops = StopStrings(tok, params.stop_strings)
    out = []
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    made = [None] * len(rows)
    for start in range(0, len(rows), batch_size):
        idx = order[start:start + batch_size]
        input_ids, attn = left_pad([rows[i] for i in idx], pad, torch.device("cpu"))
        kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                      repetition_penalty=params.repetition_penalty)
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or None, min_p=params.min_p)
        res = model.generate(input_ids=input_ids, attention_mask=attn, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
        gen = res.sequences[:, input_ids.size(1):]
        logprobs = torch.log_softmax(torch.stack(res.scores, 1).float(), -1).gather(-1, gen[:, :, None])[..., 0]
        for r, (i, ids) in enumerate(zip(idx, gen.tolist())):
            if eos in ids:
                ids = ids[:ids.index(eos) + 1]
            else:
                while ids and ids[-1] == pad:
                    ids.pop()
            ids = stops.cut(ids)
            made[i] = Completion(ids, logprobs[r, :len(ids)].tolist()) if params.logprobs else ids
    out = [made[k * n:(k + 1) * n] for k in range(len(prompts))]
    return out


class GenerateReference:
    """`generate_reference` with a sampler's `generate(prompts, n, params)` signature."""

    def __init__(self, model, tok, batch_size: int = 64):
        self.model, self.tok, self.batch_size = model, tok, batch_size

    def generate(self, prompts, n, params):
        return generate_reference(self.model, self.tok, prompts, n, params, self.batch_size)
