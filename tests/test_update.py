"""grpo_update on a real tiny LoRA model: each optimizer step's gradient equals the gradient of the
published objective computed sequence by sequence (unpadded forward passes, Python loops), for every
loss type, mu = 1 and mu > 1, several steps per rollout and gradient accumulation; plus the knobs
(beta = 0 skips the reference, truncation masking, grad clipping, LR warmup, metrics)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from grpo_core.config import GRPOConfig
from grpo_core.model.policy import load_policy
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler, plan_steps

G = 4


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that records, at every step, the parameters it starts from and the gradient it applies."""

    def __init__(self, params, lr):
        params = list(params)
        super().__init__(params, lr=lr)
        self.plist, self.before, self.grads = params, [], []

    def step(self, closure=None):
        self.before.append([p.detach().clone() for p in self.plist])
        self.grads.append([p.grad.detach().clone() for p in self.plist])
        return super().step(closure)


def make_samples(n_groups: int, seed: int, truncated_frac: float = 0.25, tool_turns: bool = False) -> list[ScoredSample]:
    """Random groups; with `tool_turns`, most completions are multi-turn: model tokens, a tool turn (mask 0),
    model tokens again."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(10, 90) for _ in range(rng.randint(3, 6))]
        for _ in range(G):
            comp = [rng.randrange(10, 90) for _ in range(rng.randint(1, 7))]
            mask = None
            if tool_turns and rng.random() < 0.75:
                tool, after = rng.randint(1, 4), rng.randint(1, 3)
                comp += [rng.randrange(10, 90) for _ in range(tool + after)]
                mask = [1] * (len(comp) - tool - after) + [0] * tool + [1] * after
            out.append(ScoredSample(group=g, prompt_ids=prompt, completion_ids=comp, reward=float(rng.randint(0, 2)),
                                    truncated=rng.random() < truncated_frac, completion_mask=mask))
    return out


def tiny_policy(num_generations: int = G, **over):
    """The tiny model with a random (non-zero) adapter, so the policy differs from the reference."""
    cfg = GRPOConfig(**{**dict(model="tiny-random", device="cpu", dtype="float32", num_generations=num_generations,
                               max_completion_length=8, lora_r=4, lora_alpha=8, max_grad_norm=0.0), **over})
    policy = load_policy(cfg)
    torch.manual_seed(0)
    for name, p in policy.model.named_parameters():      # a non-zero adapter: policy != reference from the start
        if "lora_A.default" in name:                      # PEFT's init, seeded here: the same adapter in any test order
            torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
        if "lora_B.default" in name:
            torch.nn.init.normal_(p, std=0.2)
    return cfg, policy


def seq_logprobs(model, s: ScoredSample) -> torch.Tensor:
    """log pi(completion token | prefix) for one sequence, unpadded. -> [len(completion)]"""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]


def hand_advantages(rewards: list[float], scale: str) -> list[float]:
    out = []
    for g in range(0, len(rewards), G):
        r = rewards[g:g + G]
        m = sum(r) / G
        sd = math.sqrt(sum((x - m) ** 2 for x in r) / (G - 1))
        out += [(x - m) / (sd + 1e-4) if scale == "group" else x - m for x in r]
    if scale == "batch":
        mu = sum(rewards) / len(rewards)
        sd = math.sqrt(sum((x - mu) ** 2 for x in rewards) / (len(rewards) - 1))
        out = [a / (sd + 1e-4) for a in out]
    return out


def reference_step_loss(policy, cfg, samples, idx_mbs, adv, old_lp, dapo_norm):
    """The published objective for one optimizer step over its micro-batches, written out per token."""
    total = 0.0
    for idx in idx_mbs:
        per_seq, tok_sum, n_tok = [], 0.0, 0
        for i in idx:
            s = samples[i]
            lp = seq_logprobs(policy.model, s)
            with torch.no_grad(), policy.reference() as ref_model:
                ref = seq_logprobs(ref_model, s)
            masked = cfg.mask_truncated_completions and s.truncated
            acc, n = 0.0, 0
            for t in range(len(s.completion_ids)):
                if masked or (s.completion_mask is not None and not s.completion_mask[t]):   # a tool turn's token
                    continue
                rho = torch.exp(lp[t] - old_lp[i][t])
                j = torch.minimum(rho * adv[i], torch.clamp(rho, 1 - cfg.epsilon, 1 + cfg.epsilon_high) * adv[i])
                d = ref[t] - lp[t]
                kl_weight = rho if cfg.use_bias_correction_kl else 1.0          # DeepSeek-V3.2's correction
                j = j - cfg.beta * kl_weight * (torch.exp(d) - d - 1)
                acc, n = acc + j, n + 1
            per_seq.append(acc / max(n, 1))
            tok_sum, n_tok = tok_sum + acc, n_tok + n
        if cfg.loss_type == "grpo":
            mb = -sum(per_seq) / len(idx) / len(idx_mbs)
        elif cfg.loss_type == "bnpo":
            mb = -tok_sum / max(n_tok, 1) / len(idx_mbs)
        elif cfg.loss_type == "dr_grpo":
            mb = -tok_sum / (len(idx) * cfg.max_completion_length) / len(idx_mbs)
        else:
            mb = -tok_sum / dapo_norm
        total = total + mb
    return total


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("mu,steps,accum,tool_turns", [(1, 1, 1, False), (2, 1, 2, False), (1, 2, 1, False),
                                                       (2, 1, 2, True)])
def test_update_gradients_match_published_objective(grpo_home, loss_type, mu, steps, accum, tool_turns):
    """With `tool_turns`: multi-turn completions, whose tool tokens are context only (the objective sums over
    the model's own tokens)."""
    cfg, policy = tiny_policy(loss_type=loss_type, num_iterations=mu, steps_per_iteration=steps,
                              gradient_accumulation_steps=accum, beta=0.1, epsilon=0.2, epsilon_high=0.28,
                              use_bias_correction_kl=loss_type != "bnpo",
                              mask_truncated_completions=loss_type in ("bnpo", "dapo"),
                              scale_rewards={"grpo": "group", "bnpo": "batch", "dr_grpo": "none"}.get(loss_type, "group"))
    samples = make_samples(4, seed=hash((loss_type, mu, steps)) % 97, tool_turns=tool_turns)
    with torch.no_grad():
        old_lp = [seq_logprobs(policy.model, s) for s in samples]           # the rollout policy
    opt = RecordingSGD(policy.trainable_parameters(), lr=2.0)                # big steps: ratios leave the clip range
    sched = make_scheduler(opt, cfg)
    metrics, batch, _ = grpo_update(policy, opt, sched, samples, cfg, seed=5)
    plan = plan_steps(samples, G, steps, accum, seed=5)
    assert len(metrics) == mu * len(plan) == len(opt.grads)
    adv = hand_advantages([s.reward for s in samples], cfg.scale_rewards)
    counted = sum(s.model_tokens for s in samples if not (cfg.mask_truncated_completions and s.truncated))
    dapo_norm = counted / len(plan)
    for k in range(len(opt.grads)):
        with torch.no_grad():
            for p, v in zip(opt.plist, opt.before[k]):
                p.copy_(v)
        policy.model.zero_grad(set_to_none=True)
        loss = reference_step_loss(policy, cfg, samples, plan[k % len(plan)], adv, old_lp, dapo_norm)
        grads = torch.autograd.grad(loss, opt.plist)
        for g_ref, g in zip(grads, opt.grads[k]):
            assert torch.allclose(g, g_ref, atol=2e-5, rtol=1e-3), (k, (g - g_ref).abs().max())
    if len(opt.grads) > 1:       # later steps really were off-policy (ratio != 1), so old log-probs mattered
        assert max((a - b).abs().max() for a, b in zip(opt.before[1], opt.before[0])) > 1e-3
    assert metrics[0]["kl"] > 0


def test_beta0_never_runs_reference(grpo_home):
    cfg, policy = tiny_policy(beta=0.0)
    calls = []
    real = type(policy).reference

    def counting(self):
        calls.append(1)
        return real(self)
    policy.reference = counting.__get__(policy)
    opt = make_optimizer(policy, cfg)
    metrics, _, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, 1), cfg, seed=0)
    assert calls == [] and metrics[0]["kl"] == 0.0
    cfg2, policy2 = tiny_policy(beta=0.04)
    policy2.reference = counting.__get__(policy2)
    opt2 = make_optimizer(policy2, cfg2)
    grpo_update(policy2, opt2, make_scheduler(opt2, cfg2), make_samples(2, 1), cfg2, seed=0)
    assert len(calls) == 1                                   # one no-grad pass per micro-batch


def test_cast_lm_head_to_fp32_reaches_every_log_prob_pass_of_the_update(grpo_home, monkeypatch):
    """cast_lm_head_to_fp32: the old and reference log-probs and the trained ones all take the float32 head
    (tests/test_logprobs.py checks what fp32_head computes); off, none does."""
    import grpo_core.update.step as update_module
    for flag in (True, False):
        cfg, policy = tiny_policy(beta=0.04, num_iterations=2, cast_lm_head_to_fp32=flag)
        seen = []

        def spy(*args, real=update_module.completion_logprobs, **kwargs):
            seen.append(kwargs.get("fp32_head", False))
            return real(*args, **kwargs)
        monkeypatch.setattr(update_module, "completion_logprobs", spy)
        opt = make_optimizer(policy, cfg)
        grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, 1), cfg, seed=0)
        monkeypatch.undo()
        assert len(seen) == 4 and set(seen) == {flag}         # old, reference, then one per optimizer step


def test_metrics_clipping_and_masking(grpo_home):
    cfg, policy = tiny_policy(max_grad_norm=1e-3, mask_truncated_completions=True)
    samples = make_samples(2, 3, truncated_frac=0.5)
    opt = RecordingSGD(policy.trainable_parameters(), lr=0.1)
    metrics, batch, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), samples, cfg, seed=0)
    m = metrics[0]
    for key in ("loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "grad_norm", "learning_rate", "step_seconds", "step_tokens", "peak_memory_gib"):
        assert key in m and math.isfinite(m[key]), key
    for key in ("frac_reward_zero_std", "completion_length_mean", "completion_length_min", "completion_length_max",
                "truncated_frac", "num_tokens"):
        assert key in batch, key
    assert m["grad_norm"] > 1e-3
    total = math.sqrt(sum(float((g ** 2).sum()) for g in opt.grads[0]))
    assert total == pytest.approx(1e-3, rel=1e-3)                          # clipped to max_grad_norm
    assert batch["num_tokens"] == sum(len(s.completion_ids) for s in samples if not s.truncated)
    assert m["step_tokens"] == batch["num_tokens"]
    assert batch["completion_length_max"] == max(len(s.completion_ids) for s in samples)


def test_a_micro_batch_without_loss_tokens_leaves_the_step_statistics_alone():
    """A micro-batch whose answers are all masked (every one truncated, mask_truncated_completions) measured no
    token: the step's KL, entropy and clip ratios are the means over the micro-batches that have tokens (TRL's
    nanmean), not halved by a zero from the empty one."""
    from grpo_core.parallel import DataParallel
    from grpo_core.update.step import step_statistics
    m = step_statistics([({"kl": 0.5, "entropy": 2.0}, 10.0), ({"kl": 0.0, "entropy": 0.0}, 0.0)], 1.0, DataParallel())
    assert (m["kl"], m["entropy"], m["loss"], m["step_tokens"]) == (0.5, 2.0, 1.0, 10.0)
    assert step_statistics([({"kl": 0.0}, 0.0)], 0.0, DataParallel())["kl"] == 0.0          # no token at all: 0


def test_empty_completions_train_as_a_zero_loss(grpo_home):
    """Completions of no token (an agent loop that never asked the model) in a micro-batch of their own: the
    update runs (log-probs of no token are zeros), their loss is 0 and the other micro-batch trains as usual."""
    cfg, policy = tiny_policy(gradient_accumulation_steps=2)
    empty = [ScoredSample(group=9, prompt_ids=[11, 12, 13], completion_ids=[], reward=float(i % 2), truncated=False)
             for i in range(G)]
    opt = make_optimizer(policy, cfg)
    metrics, batch, advantages = grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(1, 1) + empty, cfg,
                                             seed=0)
    assert len(metrics) == 1 and math.isfinite(metrics[0]["loss"]) and metrics[0]["skipped_nonfinite"] == 0.0
    assert all(a is not None for a in advantages)


def test_a_step_with_a_gradient_that_is_not_finite_is_skipped(grpo_home):
    """A NaN in one LoRA gradient (a real hook on the backward pass) would make every weight NaN after the step,
    and the adapter would be saved that way: the step is skipped and says so; the next finite step moves."""
    cfg, policy = tiny_policy()
    params = [p for p in policy.trainable_parameters()]
    before = [p.detach().clone() for p in params]
    hook = params[0].register_hook(lambda g: g * float("nan"))
    opt = make_optimizer(policy, cfg)
    metrics, _, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, 1), cfg, seed=0)
    assert not math.isfinite(metrics[0]["grad_norm"]) and metrics[0]["skipped_nonfinite"] == 1.0
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    hook.remove()
    metrics, _, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, 1), cfg, seed=0)
    assert metrics[0]["skipped_nonfinite"] == 0.0
    assert all(torch.isfinite(p).all() for p in params) and not all(torch.equal(p, b) for p, b in zip(params, before))


def test_unscorable_samples_leave_their_group_to_the_survivors(grpo_home):
    """A sample that could not be scored (None, or no reward) is left out and its group trains on the
    others; a group left with one member (no baseline) is dropped. tests/test_update_variants.py checks
    the survivors' gradients. grpo_update returns each input sample's advantage (None: did not train), in input
    order, for the completion tables."""
    from grpo_core.update.loss import group_advantages
    cfg, policy = tiny_policy()
    samples = make_samples(3, 4)
    samples[1] = None                                                    # group 0 keeps 3 of 4
    for i in (4, 5, 6):                                                  # group 1 keeps 1 of 4: dropped
        samples[i] = None if i != 6 else ScoredSample(1, samples[7].prompt_ids, [11], None, False)
    opt = make_optimizer(policy, cfg)
    metrics, batch, advantages = grpo_update(policy, opt, make_scheduler(opt, cfg), samples, cfg, seed=0)
    kept = [0, 2, 3, 8, 9, 10, 11]                                       # the survivors, in input order
    want = group_advantages(torch.tensor([samples[i].reward for i in kept]), [3, 4], cfg.scale_rewards).tolist()
    assert len(advantages) == len(samples) and [i for i, a in enumerate(advantages) if a is not None] == kept
    assert [advantages[i] for i in kept] == pytest.approx(want)
    assert batch["groups_total"] == 3 and batch["groups_unscorable"] == 1
    assert batch["samples_unscorable"] == 4 and batch["groups_incomplete"] == 1
    counted = sum(len(s.completion_ids) for s in samples[:4] + samples[8:] if s is not None)
    assert metrics[0]["step_tokens"] == counted


def test_lr_schedule_with_warmup():
    cfg = GRPOConfig(model="tiny-random", learning_rate=1.0, pipeline_iterations=10, steps_per_iteration=1,
                     warmup_ratio=0.2, lr_scheduler_type="linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, cfg)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1 / 3) and lrs[1] == pytest.approx(2 / 3)   # warmup 2 steps
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] < lrs[3] and all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_the_logged_learning_rate_is_the_one_the_step_used(grpo_home):
    """Warmup over 2 of 4 steps: the steps use lr/3, 2lr/3, lr, lr/2 (linear decay), and each step's metrics
    log its own rate (transformers' Trainer reads it before the scheduler moves), not the next step's."""
    cfg, policy = tiny_policy(learning_rate=0.3, pipeline_iterations=1, steps_per_iteration=4, warmup_ratio=0.5,
                              lr_scheduler_type="linear")
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=cfg.learning_rate)
    used = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    metrics, _, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(4, 5), cfg, seed=0)
    assert [m["learning_rate"] for m in metrics] == pytest.approx(used)
    assert used == pytest.approx([0.1, 0.2, 0.3, 0.15])


def test_plan_steps_covers_each_group_once():
    samples = make_samples(5, 0)
    plan = plan_steps(samples, G, 2, 2, seed=1)
    flat = sorted(i for step in plan for mb in step for i in mb)
    assert flat == list(range(len(samples)))
    assert len(plan) == 2 and all(1 <= len(step) <= 2 for step in plan)


def test_an_optimizer_step_moves_the_version_counters_the_sampler_watches(grpo_home):
    """The sampler's fused weight snapshot is rebuilt when a weight's version counter moves
    (grpo_core/kernels/fused_decode.py); an optimizer whose in-place update skips it (torch's fused AdamW)
    would leave sampling on the old weights."""
    cfg, policy = tiny_policy(use_peft=False)
    opt = make_optimizer(policy, cfg)
    params = list(policy.trainable_parameters())
    before = [p._version for p in params]
    grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, 0), cfg, seed=0)
    assert all(p._version > v for p, v in zip(params, before) if p.grad is not None)
    assert any(p.grad is not None for p in params)
