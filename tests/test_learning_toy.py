"""A tiny random model learns a toy reward with our rollout + GRPO update, in a few dozen CPU steps."""
from __future__ import annotations

import torch

from grpo_core.config import GRPOConfig
from grpo_core.model.policy import load_policy
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.rollout.samplers import make_backend
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler


def test_tiny_model_learns_to_emit_digits(grpo_home):
    """Reward = fraction of the 4 answer tokens that are digits (about 10% of the vocabulary at the start)."""
    # Full fine-tuning (frozen reference copy, beta > 0): on a 2-layer random model a q/k/v/o LoRA barely
    # moves the output distribution, so this checks the learning loop, not LoRA capacity.
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype="float32", num_generations=8, max_completion_length=4,
                     learning_rate=3e-3, use_peft=False, beta=0.01, loss_type="dapo", epsilon_high=0.28,
                     pipeline_iterations=30)
    torch.manual_seed(0)
    policy = load_policy(cfg)
    tok = policy.tokenizer
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    prompts = [tok("add:")["input_ids"], tok("sum?")["input_ids"]]
    backend = make_backend(cfg, policy, progress=False)
    opt = make_optimizer(policy, cfg)
    sched = make_scheduler(opt, cfg)

    def reward(ids):
        return sum(t in digits for t in ids[:4]) / 4

    history = []
    for step in range(30):
        groups = backend.generate(prompts, cfg.num_generations, SamplingParams(max_new_tokens=4, seed=step))
        batch = [ScoredSample(g, prompts[g], c, reward(c), len(c) == 4) for g, grp in enumerate(groups) for c in grp]
        history.append(sum(s.reward for s in batch) / len(batch))
        grpo_update(policy, opt, sched, batch, cfg, seed=step)
    start, end = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert start < 0.3, history
    assert end > 0.6 and end > start + 0.4, history


def _lora_digits_curve(dtype: str, seed: int, steps: int = 24) -> tuple[list[float], object, object]:
    """The same toy reward with LoRA on every linear (the LM head included: on a 2-layer random model the
    head is where a small adapter can move the output distribution)."""
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype=dtype, num_generations=8, max_completion_length=4,
                     learning_rate=3e-2, beta=0.01, loss_type="dapo", epsilon_high=0.28, lora_r=16, lora_alpha=32,
                     lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj", "lm_head"], pipeline_iterations=steps)
    torch.manual_seed(seed)
    policy = load_policy(cfg)
    tok = policy.tokenizer
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    prompts = [tok("add:")["input_ids"], tok("sum?")["input_ids"]]
    backend = make_backend(cfg, policy, progress=False)
    opt, history = make_optimizer(policy, cfg), []
    sched = make_scheduler(opt, cfg)
    for step in range(steps):
        groups = backend.generate(prompts, 8, SamplingParams(max_new_tokens=4, seed=1000 * seed + step))
        batch = [ScoredSample(g, prompts[g], c, sum(t in digits for t in c[:4]) / 4, len(c) == 4)
                 for g, grp in enumerate(groups) for c in grp]
        history.append(sum(s.reward for s in batch) / len(batch))
        grpo_update(policy, opt, sched, batch, cfg, seed=step)
    return history, policy, opt


def test_bf16_base_with_fp32_adapter_learns_as_well_as_fp32(grpo_home):
    """The CPU bf16 path (`dtype: auto` on AMX / AVX512-BF16 machines): bf16 frozen base, fp32 LoRA weights,
    optimizer state and loss; on two seeds it learns the toy reward as fast as the fp32 run does."""
    ends = {}
    for dtype in ("float32", "bfloat16"):
        for seed in (0, 1):
            history, policy, opt = _lora_digits_curve(dtype, seed)
            start, end = sum(history[:4]) / 4, sum(history[-4:]) / 4
            assert start < 0.3 and end > 0.8, (dtype, seed, history)
            ends[dtype, seed] = end
        base = {p.dtype for n, p in policy.model.named_parameters() if "lora_" not in n}
        adapter = {p.dtype for n, p in policy.model.named_parameters() if "lora_" in n}
        moments = {v.dtype for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.ndim}
        assert (base, adapter, moments) == ({getattr(torch, dtype)}, {torch.float32}, {torch.float32})
    for seed in (0, 1):
        assert ends["bfloat16", seed] >= ends["float32", seed] - 0.1, ends
