"""The GRPO variants through grpo_update on a real tiny LoRA model: each optimizer step's gradient equals
the gradient of the published objective computed sequence by sequence (unpadded forward passes,
`published_objective`), with hand-computed advantages; groups that lost members train on their
survivors; the sampler/trainer importance correction from a sampler that really differs from the
trainer; the moving reference (sync_ref_model); the entropy bonus's gradient."""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from grpo_core.config import GRPOConfig
from grpo_core.update.logprobs import completion_logprobs, head_logprobs, token_entropy
from grpo_core.update.loss import sampler_correction_weight
from grpo_core.model.policy import REFERENCE_ADAPTER, load_policy
from grpo_core.rollout.samplers import KVCacheSampler
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.update.step import (ScoredSample, grpo_update, make_micro_batch, make_optimizer, make_scheduler, plan_steps,
                              surviving_groups)
from published_objective import Options, Sequence, micro_batch_loss, quantile
from test_update import RecordingSGD, tiny_policy


def make_samples(n_groups: int, G: int, seed: int) -> list[ScoredSample]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(10, 90) for _ in range(rng.randint(3, 6))]
        for _ in range(G):
            comp = [rng.randrange(10, 90) for _ in range(rng.randint(1, 7))]
            out.append(ScoredSample(g, prompt, comp, float(rng.randint(0, 3)), rng.random() < 0.2))
    return out


def seq_forward(model, s: ScoredSample, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(token | prefix), entropy) for one sequence's completion, unpadded. -> [len], [len]"""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
    return logp, token_entropy(logits)


def hand_advantages(rewards_by_group: list[list[float]]) -> list[float]:
    """(r - mean) / (unbiased std + 1e-4) within each group, Python floats."""
    out = []
    for r in rewards_by_group:
        m = sum(r) / len(r)
        sd = math.sqrt(sum((x - m) ** 2 for x in r) / (len(r) - 1))
        out += [(x - m) / (sd + 1e-4) for x in r]
    return out


def options_of(cfg: GRPOConfig) -> Options:
    return Options(loss_type=cfg.loss_type, beta=cfg.beta, eps_low=cfg.epsilon, eps_high=cfg.epsilon_high,
                   level=cfg.importance_sampling_level, delta=cfg.delta, tau_pos=cfg.sapo_temperature_pos,
                   tau_neg=cfg.sapo_temperature_neg, top_entropy_quantile=cfg.top_entropy_quantile,
                   entropy_coef=cfg.entropy_coef, bias_correction_kl=cfg.use_bias_correction_kl,
                   off_policy_threshold=cfg.off_policy_mask_threshold,
                   sampler_mode=cfg.vllm_importance_sampling_mode if cfg.vllm_importance_sampling_correction else None,
                   sampler_cap=cfg.vllm_importance_sampling_cap, sampler_min=cfg.vllm_importance_sampling_clip_min,
                   vespo=(cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg))


def router_balance_loss(model, seqs: list[ScoredSample]) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, as TRL takes it from the model: E * sum_e f_e * P_e over every
    token of the sequences and every layer (f_e: the share of top-k choices that go to expert e, P_e: its mean
    router probability), each sequence run unpadded."""
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    logits = torch.cat([torch.cat(model(input_ids=torch.tensor([s.prompt_ids + s.completion_ids]),
                                        output_router_logits=True).router_logits) for s in seqs])   # [layers*T, E]
    probs = torch.softmax(logits.float(), -1)
    chosen = torch.nn.functional.one_hot(probs.topk(k, -1).indices, E).float()                     # [N, k, E]
    return E * (chosen.mean(0) * probs.mean(0)).sum()


def reference_step_loss(policy, cfg, kept, idx_mbs, adv, old_lp, dapo_norm, router_coef: float = 0.0):
    """The published objective of one optimizer step over its micro-batches, sequence by sequence (plus, with
    `router_coef`, that times each micro-batch's load-balancing loss over the number of micro-batches)."""
    o = options_of(cfg)
    total = 0.0
    for idx in idx_mbs:
        if router_coef:
            total = total + router_coef * router_balance_loss(policy.model, [kept[i] for i in idx]) / len(idx_mbs)
        seqs = []
        for i in idx:
            s = kept[i]
            lp, ent = seq_forward(policy.model, s)
            with torch.no_grad(), policy.reference() as ref_model:
                ref = seq_forward(ref_model, s)[0]
            n = 0 if cfg.mask_truncated_completions and s.truncated else len(s.completion_ids)
            seqs.append(Sequence(logp=list(lp[:n]), old=old_lp[i][:n].tolist(), advantage=adv[i],
                                 ref=ref[:n].tolist(), sampler=(s.sampler_logprobs or [])[:n], entropy=list(ent[:n])))
        if o.top_entropy_quantile < 1.0:
            assert_entropy_threshold_clear([h.item() for q in seqs for h in q.entropy], o.top_entropy_quantile)
        total = total + micro_batch_loss(seqs, o, len(idx_mbs), cfg.max_completion_length, dapo_norm)
    return total


def assert_entropy_threshold_clear(entropies: list[float], top_quantile: float, margin: float = 1e-5) -> None:
    """No token's entropy within float noise of the high-entropy threshold (but the one it is, when the quantile
    falls on a token): there the packed update and this sequence-by-sequence reference may round it to different
    sides, and keep different tokens. The answers of a group share their first token's entropy, so ties occur."""
    threshold = quantile(entropies, 1.0 - top_quantile)
    distances = sorted(abs(h - threshold) for h in entropies)
    if ((len(entropies) - 1) * (1.0 - top_quantile)).is_integer():
        distances = distances[1:]
    assert distances[0] > margin, f"an entropy {distances[0]:.1e} from the threshold: pick a quantile clear of ties"


def check_steps_match_published_objective(policy, cfg, samples, kept, group_sizes, adv, seed=5, entropy_coefs=None,
                                          router_coef: float = 0.0):
    """Run grpo_update with recording SGD; every step's gradient == the published objective's (with the
    entropy coefficient `entropy_coefs[k]` at step k, when given: adaptive entropy control; with the router's
    load-balancing loss weighted `router_coef`)."""
    with torch.no_grad():
        old_lp = [seq_forward(policy.model, s)[0] for s in kept]            # the rollout policy
    opt = RecordingSGD(policy.trainable_parameters(), lr=2.0)                # big steps: ratios leave the clip range
    metrics, batch, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), samples, cfg, seed=seed)
    plan = plan_steps(kept, group_sizes, cfg.steps_per_iteration, cfg.gradient_accumulation_steps, seed)
    assert len(opt.grads) == len(metrics) == cfg.num_iterations * len(plan)
    counted = sum(len(s.completion_ids) for s in kept if not (cfg.mask_truncated_completions and s.truncated))
    for k in range(len(opt.grads)):
        with torch.no_grad():
            for p, v in zip(opt.plist, opt.before[k]):
                p.copy_(v)
        step_cfg = cfg if entropy_coefs is None else cfg.model_copy(update={"entropy_coef": entropy_coefs[k]})
        loss = reference_step_loss(policy, step_cfg, kept, plan[k % len(plan)], adv, old_lp, counted / len(plan),
                                   router_coef)
        grads = torch.autograd.grad(loss, opt.plist)
        for g_ref, g in zip(grads, opt.grads[k]):
            assert torch.allclose(g, g_ref, atol=2e-5, rtol=1e-3), (k, (g - g_ref).abs().max())
    return metrics, batch


# -- groups that lost members ----------------------------------------------------------------------------

def test_group_that_lost_two_of_eight_trains_on_its_six_survivors(grpo_home):
    G = 8
    cfg, policy = tiny_policy(G, beta=0.04, num_iterations=2, gradient_accumulation_steps=2, loss_type="bnpo")
    samples = make_samples(4, G, seed=3)
    for i in (1, 5):
        samples[i] = None                                                   # group 0: 6 of 8 survive
    samples[9] = ScoredSample(1, samples[9].prompt_ids, samples[9].completion_ids, None, False)  # group 1: 7 of 8
    for i in range(24, 31):
        samples[i] = None                                                   # group 3: 1 of 8, dropped
    kept, sizes = surviving_groups(samples)
    assert sizes == [6, 7, 8]
    assert kept[:6] == [samples[i] for i in (0, 2, 3, 4, 6, 7)]
    rewards = [[s.reward for s in kept[:6]], [s.reward for s in kept[6:13]], [s.reward for s in kept[13:]]]
    adv = hand_advantages(rewards)
    group0 = [s.reward for s in kept[:6]]
    mean0 = sum(group0) / 6
    std0 = math.sqrt(sum((r - mean0) ** 2 for r in group0) / 5)
    assert adv[:6] == pytest.approx([(r - mean0) / (std0 + 1e-4) for r in group0])
    assert len(set(group0)) > 1                                             # the survivors carry a signal
    metrics, batch = check_steps_match_published_objective(policy, cfg, samples, kept, sizes, adv)
    assert batch["groups_unscorable"] == 1 and batch["groups_incomplete"] == 2
    assert batch["samples_unscorable"] == 10


def test_ragged_group_shares_its_prompt_pass(grpo_home):
    """A micro-batch whose groups all lost members down to one size runs each group's prompt once
    (group_size = 6); its log-probs and gradients equal the row-by-row padded pass."""
    G = 8
    cfg, policy = tiny_policy(G)
    samples = make_samples(2, G, seed=4)
    for i in (1, 5, 8, 15):
        samples[i] = None
    kept, sizes = surviving_groups(samples)
    assert sizes == [6, 6]
    mb = make_micro_batch(kept, torch.zeros(12), policy.tokenizer.pad_token_id, policy.device, False, group_size=6)
    params = policy.trainable_parameters()
    out = []
    for gs in (1, 6):
        lp, _ = completion_logprobs(policy.model, mb.input_ids, mb.attention_mask, mb.completion_mask.size(1),
                                    group_size=gs)
        out.append((lp * mb.completion_mask, torch.autograd.grad((lp * mb.completion_mask).sum(), params)))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    for a, b in zip(out[0][1], out[1][1]):
        assert torch.allclose(a, b, atol=1e-5)


# -- each variant on a real model ---------------------------------------------------------------------------

VARIANTS = {
    "gspo": dict(importance_sampling_level="sequence", loss_type="dapo", num_iterations=2),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3, num_iterations=2, steps_per_iteration=2),
    "sapo": dict(loss_type="sapo", num_iterations=2, sapo_temperature_neg=2.0),
    "delta_entropy": dict(delta=1.5, top_entropy_quantile=0.25, entropy_coef=0.05, num_iterations=2,
                          gradient_accumulation_steps=2, loss_type="dr_grpo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", num_iterations=2),
    "vespo_plain_k3": dict(loss_type="vespo", num_iterations=2, gradient_accumulation_steps=2,
                           use_bias_correction_kl=False, vespo_k_neg=2.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_steps_match_published_objective(grpo_home, name):
    G = 4
    cfg, policy = tiny_policy(G, beta=0.04, **VARIANTS[name])
    # The tiny random model's entropies all lie within 1e-3 of log V; sharper logits spread them, so that the
    # quantile threshold stays clear of float noise (assert_entropy_threshold_clear). x8 is undone exactly.
    sharpen = 8.0 if cfg.top_entropy_quantile < 1 else 1.0
    norm = policy.model.get_base_model().model.norm.weight
    samples = make_samples(4, G, seed=len(name))
    kept, sizes = surviving_groups(samples)
    adv = hand_advantages([[s.reward for s in kept[g * G:(g + 1) * G]] for g in range(4)])
    with torch.no_grad():
        norm.mul_(sharpen)
    try:
        metrics, _ = check_steps_match_published_objective(policy, cfg, samples, kept, sizes, adv)
    finally:
        with torch.no_grad():
            norm.div_(sharpen)                     # the base model is pooled: later tests get it back as it was
    if cfg.top_entropy_quantile < 1:
        assert 0 < metrics[0]["entropy_mask/kept_frac"] < 1


def gdpo_advantages(per_func: list[list[float]], weights: list[float], G: int) -> list[float]:
    """GDPO by hand (Python floats): each function's scores normalised within the group, the weighted sum,
    then normalised over the batch (every score present)."""
    def normalised(xs):
        m = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
        return [(x - m) / (sd + 1e-4) for x in xs]
    summed = [0.0] * len(per_func)
    for k, w in enumerate(weights):
        for start in range(0, len(per_func), G):
            for i, z in enumerate(normalised([row[k] for row in per_func[start:start + G]])):
                summed[start + i] += w * z
    return normalised(summed)


def test_normalize_then_sum_trains_on_gdpo_advantages(grpo_home):
    """multi_objective_aggregation: normalize_then_sum: the update's steps are the published objective's with
    GDPO's advantages, from the scores per reward function the score stage recorded."""
    G = 4
    cfg, policy = tiny_policy(G, beta=0.04, reward_funcs=["accuracy", "format"], reward_weights=[1.0, 0.25],
                              multi_objective_aggregation="normalize_then_sum", steps_per_iteration=2)
    rng = random.Random(9)
    samples = []
    for s in make_samples(4, G, seed=9):
        scores = {"accuracy": float(rng.randint(0, 1)), "format": float(rng.randint(0, 4))}
        total = scores["accuracy"] + 0.25 * scores["format"]
        samples.append(ScoredSample(s.group, s.prompt_ids, s.completion_ids, total, s.truncated, rewards_per_func=scores))
    kept, sizes = surviving_groups(samples)
    adv = gdpo_advantages([[s.rewards_per_func["accuracy"], s.rewards_per_func["format"]] for s in kept],
                          [1.0, 0.25], G)
    assert adv != pytest.approx(hand_advantages([[s.reward for s in kept[g * G:(g + 1) * G]] for g in range(4)]))
    check_steps_match_published_objective(policy, cfg, samples, kept, sizes, adv)


def test_adaptive_entropy_in_the_update(grpo_home):
    """use_adaptive_entropy through grpo_update: each step's gradient is the published objective's with the
    coefficient the controller applied (none at the first step, then entropy_coef_delta more per step below
    the target, up to entropy_coef_max), and the coefficient is logged per step."""
    G = 4
    cfg, policy = tiny_policy(G, beta=0.04, use_adaptive_entropy=True, entropy_coef=0.0, entropy_coef_delta=0.02,
                              entropy_coef_max=0.03, entropy_target=50.0, steps_per_iteration=4)
    samples = make_samples(4, G, seed=4)
    kept, sizes = surviving_groups(samples)
    adv = hand_advantages([[s.reward for s in kept[g * G:(g + 1) * G]] for g in range(4)])
    applied = [0.0, 0.02, 0.03, 0.03]
    norm = policy.model.get_base_model().model.norm.weight
    with torch.no_grad():
        norm.mul_(8.0)                             # sharper logits: the entropy has a gradient worth checking
    try:
        metrics, _ = check_steps_match_published_objective(policy, cfg, samples, kept, sizes, adv,
                                                           entropy_coefs=applied)
    finally:
        with torch.no_grad():
            norm.div_(8.0)                         # the base model is pooled: later tests get it back as it was
    assert [m["entropy_coef_applied"] for m in metrics] == pytest.approx(applied)
    assert [m["entropy_coef"] for m in metrics] == pytest.approx([0.02, 0.03, 0.03, 0.03])
    # above the target the coefficient falls to entropy_coef_min and is never applied
    cfg, policy = tiny_policy(G, use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_min=0.01,
                              entropy_coef_delta=0.03, entropy_target=1e-3, steps_per_iteration=3)
    opt = make_optimizer(policy, cfg)
    metrics, _, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), samples, cfg, seed=0)
    assert [m["entropy_coef"] for m in metrics] == pytest.approx([0.02, 0.01, 0.01])
    assert [m["entropy_coef_applied"] for m in metrics] == [0.0, 0.0, 0.0]


# -- the sampler/trainer importance correction --------------------------------------------------------------

def perturbed_sampler(policy, std: float = 0.15):
    """A copy of the policy whose LoRA weights differ a little: a sampler that is not the trainer."""
    model = copy.deepcopy(policy.model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.default" in name:
                p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def sampled_batch(policy, sampler_model, G: int, n_groups: int = 3, seed: int = 0) -> list[ScoredSample]:
    tok = policy.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("12+3=", "hello there", "abc")][:n_groups]
    backend = KVCacheSampler(sampler_model, tok, policy.device, progress=False)
    groups = backend.generate(prompts, G, SamplingParams(max_new_tokens=6, seed=seed, logprobs=True))
    rng = random.Random(seed)
    return [ScoredSample(g, prompts[g], list(c), float(rng.randint(0, 2)), len(c) == 6, c.logprobs)
            for g, grp in enumerate(groups) for c in grp]


@pytest.mark.parametrize("mode, clip_min", [("token_truncate", None), ("token_mask", 0.99),
                                            pytest.param("sequence_mask", None, marks=pytest.mark.slow)])
def test_sampler_correction_from_a_perturbed_sampler(grpo_home, mode, clip_min):
    G = 4
    cfg, policy = tiny_policy(G, beta=0.04, vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode=mode, vllm_importance_sampling_cap=1.02,
                              vllm_importance_sampling_clip_min=clip_min, off_policy_mask_threshold=0.01,
                              num_iterations=2)
    sampler_model = perturbed_sampler(policy)
    samples = sampled_batch(policy, sampler_model, G)
    # 1) the sampler recorded its own log-probs: log softmax of the perturbed model, token by token
    with torch.no_grad():
        for s in samples:
            sampler_lp = seq_forward(sampler_model, s)[0]
            assert torch.allclose(torch.tensor(s.sampler_logprobs), sampler_lp, atol=1e-4)
    # 2) the correction weights by hand: pi_trainer / pi_sampler per token (or per sequence), then capped (and
    # bounded below by clip_min)
    with torch.no_grad():
        trainer_lp = [seq_forward(policy.model, s)[0] for s in samples]
    hand = []
    for s, lp in zip(samples, trainer_lp):
        diffs = [a - b for a, b in zip(lp.tolist(), s.sampler_logprobs)]
        if mode == "token_truncate":
            hand.append([min(math.exp(d), 1.02) for d in diffs])
        elif mode == "token_mask":
            hand.append([0.0 if not clip_min <= math.exp(d) <= 1.02 else math.exp(d) for d in diffs])
        else:
            w = math.exp(sum(diffs))
            hand.append([0.0 if w > 1.02 else w] * len(diffs))
    mb = make_micro_batch(samples, torch.zeros(len(samples)), policy.tokenizer.pad_token_id, policy.device, False,
                          group_size=G, with_sampler_logprobs=True)
    old = torch.nn.utils.rnn.pad_sequence(trainer_lp, batch_first=True)
    weights = sampler_correction_weight(old, mb.sampler_logp, mb.completion_mask, mode, 1.02, clip_min)
    for r, w in enumerate(hand):
        got = weights[r, :len(w)] if mode.startswith("token") else weights[r].expand(len(w))
        assert got.tolist() == pytest.approx(w, rel=1e-4, abs=1e-6)
    flat = [w for ws in hand for w in ws]
    assert min(flat) < max(flat) and (max(flat) == pytest.approx(1.02) or min(flat) == 0.0)   # non-trivial
    if clip_min is not None:                   # the lower bound zeroed some tokens the cap alone would keep
        assert any(math.exp(a - b) < clip_min for s, lp in zip(samples, trainer_lp)
                   for a, b in zip(lp.tolist(), s.sampler_logprobs))
    # 3) the update's gradients use exactly these weights (and the off-policy mask against the sampler)
    kept, sizes = surviving_groups(samples)
    adv = hand_advantages([[s.reward for s in kept[g * G:(g + 1) * G]] for g in range(len(sizes))])
    metrics, _ = check_steps_match_published_objective(policy, cfg, samples, kept, sizes, adv)
    assert metrics[0]["sampler_is/weight_mean"] != pytest.approx(1.0)


def test_correction_without_sampler_logprobs_names_the_fix(grpo_home):
    cfg, policy = tiny_policy(4, vllm_importance_sampling_correction=True)
    opt = make_optimizer(policy, cfg)
    with pytest.raises(ValueError, match="SamplingParams\\(logprobs=True\\)"):
        grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, 4, 0), cfg, seed=0)


# -- the moving reference ---------------------------------------------------------------------------------

def reference_tensors(policy) -> list[torch.Tensor]:
    if policy.use_peft:
        return [p.detach().clone() for n, p in policy.model.named_parameters() if f".{REFERENCE_ADAPTER}." in n]
    return [p.detach().clone() for p in policy.ref_model.parameters()]


def live_tensors(policy) -> list[torch.Tensor]:
    if policy.use_peft:
        return [p.detach().clone() for n, p in policy.model.named_parameters() if ".default." in n]
    return [p.detach().clone() for p in policy.model.parameters()]


@pytest.mark.parametrize("use_peft", [True, False])
def test_sync_ref_model_mixes_the_reference_every_n_steps(grpo_home, tmp_path, use_peft):
    G = 4
    cfg, policy = tiny_policy(G, use_peft=use_peft, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2,
                              ref_model_mixup_alpha=0.25, learning_rate=0.05)
    if use_peft:
        assert policy.reference_adapter == REFERENCE_ADAPTER
        ref_b = [p for n, p in policy.model.named_parameters() if f"lora_B.{REFERENCE_ADAPTER}." in n]
        assert ref_b and all(p.abs().max() == 0 for p in ref_b)          # starts as the base: B = 0
    opt = make_optimizer(policy, cfg)
    sched = make_scheduler(opt, cfg)
    start = reference_tensors(policy)
    m1, _, _ = grpo_update(policy, opt, sched, make_samples(2, G, 1), cfg, seed=0)        # global step 1: no sync
    assert "ref_model_synced" not in m1[0]
    for a, b in zip(start, reference_tensors(policy)):
        assert torch.equal(a, b)                                                       # never trained
    m2, _, _ = grpo_update(policy, opt, sched, make_samples(2, G, 2), cfg, seed=1)        # global step 2: sync
    assert m2[0]["ref_model_synced"] == 1.0
    for ref0, live, ref1 in zip(start, live_tensors(policy), reference_tensors(policy)):
        assert torch.allclose(ref1, 0.25 * live + 0.75 * ref0, atol=1e-7)
    assert any((a - b).abs().max() > 0 for a, b in zip(start, reference_tensors(policy)))
    # the moved reference travels with the checkpoint and is the reference of the next iteration
    out = tmp_path / "ckpt"
    policy.save(out)
    assert (out / REFERENCE_ADAPTER).is_dir()
    reloaded = load_policy(cfg, out)
    for a, b in zip(reference_tensors(policy), reference_tensors(reloaded)):
        assert torch.equal(a, b)


# -- the entropy bonus's gradient ----------------------------------------------------------------------------

def test_entropy_gradient_of_the_fused_head_matches_autograd():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 30, bias=False)
    ids = torch.randint(0, 30, (10,), generator=g)
    w = torch.randn(10, generator=g)
    for T in (1.0, 0.7):
        for keep in (None, 0):                                # full logits kept, and chunks recomputed
            lp, ent = head_logprobs(hidden, head, ids, T, chunk=4, with_entropy=True, entropy_grad=True,
                                    keep_logits_bytes=keep)
            got = torch.autograd.grad((ent * w).sum() + lp.sum(), [hidden, head.weight])
            logits = head(hidden) / T
            ref_ent = token_entropy(logits)
            ref_lp = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0]
            expect = torch.autograd.grad((ref_ent * w).sum() + ref_lp.sum(), [hidden, head.weight])
            assert torch.allclose(ent, ref_ent, atol=1e-5)
            for a, b in zip(got, expect):
                assert torch.allclose(a, b, atol=1e-5)
    _, detached = head_logprobs(hidden, head, ids, with_entropy=True)
    assert not detached.requires_grad


# -- Mixture-of-Experts: the router's load-balancing loss -----------------------------------------------------

def tiny_moe_model(out, tokenizer_dir) -> str:
    """A tiny random Qwen2-MoE (4 experts, 2 per token) with the tiny model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                            pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    Qwen2MoeForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("coef", [None, 0.5, 0.0])
def test_a_moe_model_trains_with_its_router_load_balancing_loss(grpo_home, tmp_path, coef):
    """router_aux_loss_coef (TRL): each step's gradient is the published objective's plus the coefficient times
    each micro-batch's load-balancing loss over the number of micro-batches; None takes the model config's own
    coefficient, 0 turns it off; the loss is logged as train/aux_loss."""
    G = 4
    model = tiny_moe_model(tmp_path / "moe", grpo_home / "models" / "tiny-random")
    cfg, policy = tiny_policy(G, model=model, beta=0.04, gradient_accumulation_steps=2, router_aux_loss_coef=coef)
    samples = make_samples(4, G, seed=3)
    kept, sizes = surviving_groups(samples)
    adv = hand_advantages([[s.reward for s in kept[g * G:(g + 1) * G]] for g in range(4)])
    weight = {None: 0.02, 0.5: 0.5, 0.0: 0.0}[coef]
    metrics, _ = check_steps_match_published_objective(policy, cfg, samples, kept, sizes, adv, router_coef=weight)
    assert ("aux_loss" in metrics[0]) == (weight > 0)
    if weight:
        assert metrics[0]["aux_loss"] > 0
