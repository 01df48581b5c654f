"""grpo_core.update.loss against hand-computed values and against a line-by-line implementation of the published
objective (DeepSeekMath GRPO with the DAPO / Dr. GRPO aggregation fixes, TRL 1.16 semantics), including
how the micro-batches of one optimizer step add up; and each variant (GSPO and GSPO-token, INTELLECT-2's
delta, CISPO, SAPO, entropy masking and bonus, off-policy sequence masking, the sampler/trainer
importance correction, ragged groups) by hand and against `published_objective`."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from grpo_core.update.logprobs import token_entropy, token_logprobs
from grpo_core.update.loss import (LOSS_TYPES, LossSettings, aggregate, applied_entropy_coef, clipped_surrogate,
                            decoupled_advantages, grpo_loss, group_advantages, high_entropy_mask, importance_ratio, kl_k3,
                            next_entropy_coef, off_policy_sequence_mask, sampler_correction_weight, sapo_loss,
                            zero_std_groups)
from published_objective import Options, Sequence, micro_batch_loss


# -- advantages ------------------------------------------------------------------------------------

def test_group_advantages_by_hand():
    r = torch.tensor([1., 0., 0., 0., 1., 1., 0., 0.])
    # group 1: mean .25, unbiased std .5; group 2: mean .5, std sqrt(1/3)
    g = group_advantages(r, 4, "group")
    s2 = math.sqrt(1 / 3)
    expect = [.75 / (.5 + 1e-4), -.25 / (.5 + 1e-4), -.25 / (.5 + 1e-4), -.25 / (.5 + 1e-4),
              .5 / (s2 + 1e-4), .5 / (s2 + 1e-4), -.5 / (s2 + 1e-4), -.5 / (s2 + 1e-4)]
    assert torch.allclose(g, torch.tensor(expect), atol=1e-6)
    # batch: group means, one std over all 8 rewards (mean .375, var 1.875 / 7)
    b = group_advantages(r, 4, "batch")
    sb = math.sqrt(1.875 / 7)
    assert torch.allclose(b, torch.tensor([.75, -.25, -.25, -.25, .5, .5, -.5, -.5]) / (sb + 1e-4), atol=1e-6)
    # none (Dr. GRPO): centred only
    n = group_advantages(r, 4, "none")
    assert torch.allclose(n, torch.tensor([.75, -.25, -.25, -.25, .5, .5, -.5, -.5]))
    with pytest.raises(ValueError):
        group_advantages(r, 4, "zscore")


def test_decoupled_advantages_gdpo_by_hand():
    """normalize_then_sum (GDPO, TRL): each function normalised within its group, the weighted sum, then the sum
    normalised over the batch. Two groups of 3, two functions, weights 1 and 0.5."""
    r = torch.tensor([[1., 0.], [0., 0.], [0., 3.],           # group 1
                      [2., 1.], [2., 1.], [5., 4.]], dtype=torch.float64)          # group 2
    w = torch.tensor([1.0, 0.5])
    e = 1e-4
    # group 1: col 0 mean 1/3, std sqrt(1/3); col 1 mean 1, std sqrt(3). group 2: col 0 mean 3, std sqrt(3); col 1
    # mean 2, std sqrt(3)
    s3, s13 = math.sqrt(3), math.sqrt(1 / 3)
    z = [[(2 / 3) / (s13 + e), -1 / (s3 + e)], [(-1 / 3) / (s13 + e), -1 / (s3 + e)],
         [(-1 / 3) / (s13 + e), 2 / (s3 + e)], [-1 / (s3 + e), -1 / (s3 + e)], [-1 / (s3 + e), -1 / (s3 + e)],
         [2 / (s3 + e), 2 / (s3 + e)]]
    summed = [a + 0.5 * b for a, b in z]
    m = sum(summed) / 6
    sd = math.sqrt(sum((x - m) ** 2 for x in summed) / 5)
    expect = [(x - m) / (sd + e) for x in summed]
    got = decoupled_advantages(r, w, 3)
    assert got.tolist() == pytest.approx(expect, rel=1e-9, abs=1e-12)
    # not what summing first gives (sum_then_normalize): a reward on a big scale no longer drowns the other
    assert not torch.allclose(got, group_advantages((r * w).sum(-1), 3), atol=1e-2)
    # ragged groups (group 1 lost its first member): [0, 0], [0, 3] -> column 0 all equal (z = 0), column 1
    # mean 1.5, std sqrt(4.5); group 2 as above
    s45 = math.sqrt(4.5)
    summed = [0.5 * -1.5 / (s45 + e), 0.5 * 1.5 / (s45 + e)] + summed[3:]
    m = sum(summed) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in summed) / 4)
    assert decoupled_advantages(r[1:], w, [2, 3]).tolist() == pytest.approx([(x - m) / (sd + e) for x in summed],
                                                                             rel=1e-9, abs=1e-12)


def test_decoupled_advantages_skip_missing_scores_as_trl():
    """NaN = a function gave no score: skipped by the group stats; a function with < 2 scores in a group adds
    nothing there; a row with no score at all gets 0 and takes no part in the batch stats."""
    nan, e = float("nan"), 1e-4
    r = torch.tensor([[1., nan], [0., nan], [nan, nan], [0., 2.],   # group 1: column 1 has one score only
                      [1., 1.], [0., 3.], [1., 2.], [0., 2.]], dtype=torch.float64)      # group 2: complete
    w = torch.tensor([1.0, 1.0])
    got = decoupled_advantages(r, w, 4)
    sd_g1 = math.sqrt(1 / 3)        # column 0 of group 1: 1, 0, 0 -> mean 1/3
    sd_c0, sd_c1 = math.sqrt(1 / 3), math.sqrt(2 / 3)   # group 2: column 0 mean .5, column 1 mean 2
    summed = [(2 / 3) / (sd_g1 + e), (-1 / 3) / (sd_g1 + e), (-1 / 3) / (sd_g1 + e),
              .5 / (sd_c0 + e) - 1 / (sd_c1 + e), -.5 / (sd_c0 + e) + 1 / (sd_c1 + e), .5 / (sd_c0 + e),
              -.5 / (sd_c0 + e)]
    m = sum(summed) / 7
    sd = math.sqrt(sum((x - m) ** 2 for x in summed) / 6)
    expect = [(x - m) / (sd + e) for x in summed]
    assert got[2].item() == 0.0                                     # no score at all: no advantage
    assert torch.cat([got[:2], got[3:]]).tolist() == pytest.approx(expect, rel=1e-9, abs=1e-12)


def test_zero_std_groups_and_zero_advantage():
    r = torch.tensor([1., 1., 1., 0., 0., 0., 2., 3., 2.])
    assert zero_std_groups(r, 3).tolist() == [True, True, False]
    assert group_advantages(r, 3)[:6].abs().max() == 0


# -- aggregation, by hand --------------------------------------------------------------------------

def test_aggregate_by_hand():
    per_token = torch.tensor([[1., 2., 3., 9.], [4., 9., 9., 9.]])
    mask = torch.tensor([[1., 1., 1., 0.], [1., 0., 0., 0.]])
    assert aggregate(per_token, mask, "grpo", 5).item() == pytest.approx((6 / 3 + 4 / 1) / 2)   # 3.0
    assert aggregate(per_token, mask, "bnpo", 5).item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "dr_grpo", 5).item() == pytest.approx(10 / (2 * 5))       # B * L_max
    assert aggregate(per_token, mask, "dapo", 5, num_tokens_in_batch=8).item() == pytest.approx(10 / 8)
    assert aggregate(per_token, mask, "dapo", 5).item() == pytest.approx(10 / 4)
    # one of 2 micro-batches: a share of the step's loss
    assert aggregate(per_token, mask, "grpo", 5, num_micro_batches=2).item() == pytest.approx(3.0 / 2)
    assert aggregate(per_token, mask, "bnpo", 5, num_micro_batches=2).item() == pytest.approx(10 / 4 / 2)
    assert aggregate(per_token, mask, "dr_grpo", 5, num_micro_batches=2).item() == pytest.approx(10 / 10 / 2)
    assert aggregate(per_token, mask, "dapo", 5, num_micro_batches=2, num_tokens_in_batch=8).item() \
        == pytest.approx(10 / 8)                                    # the normaliser already counts the step
    with pytest.raises(ValueError, match="num_tokens_in_batch"):
        aggregate(per_token, mask, "dapo", 5, num_micro_batches=2)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "ppo", 5)


def test_clipped_surrogate_and_kl_by_hand():
    # one sequence, 4 tokens; advantage +1 on row 0, -1 on row 1
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.25, 1.0, 0.5], [0.5, 0.25, 1.0, 0.5]]))   # ratios 1, 2, .5, 1
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    adv = torch.tensor([1., -1.])
    mask = torch.ones(2, 4)
    loss, st = grpo_loss(logp, old, ref, adv, mask, LossSettings(beta=0.0, epsilon_low=0.2, epsilon_high=0.28,
                                                                 loss_type="bnpo", max_completion_length=4))
    # A=+1: -min(r, clip(r)) = -[1, 1.28, .5, 1];  A=-1: -min(-r, -clip(r)) = [1, 2, .8, 1]
    expect = (-(1 + 1.28 + .5 + 1) + (1 + 2 + .8 + 1)) / 8
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert st["clip_ratio/high_mean"] == pytest.approx(1 / 8)       # r=2 with A>0
    assert st["clip_ratio/low_mean"] == pytest.approx(1 / 8)        # r=.5 with A<0
    assert st["clip_ratio/region_mean"] == pytest.approx(2 / 8)
    # k3 KL: d = ref - logp = log(.5) at token 0 of row 0, else 0 -> exp(d) - d - 1
    d = math.log(0.5)
    k3 = math.exp(d) - d - 1
    assert kl_k3(logp, ref)[0, 0].item() == pytest.approx(k3, abs=1e-6)
    assert kl_k3(logp, ref)[1].abs().max() == 0
    loss_b, st_b = grpo_loss(logp, old, ref, adv, mask, LossSettings(beta=0.1, epsilon_low=0.2, epsilon_high=0.28,
                                                                     loss_type="bnpo", max_completion_length=4))
    assert loss_b.item() == pytest.approx(expect + 0.1 * k3 / 8, abs=1e-6)
    assert st_b["kl"] == pytest.approx(k3 / 8, abs=1e-6)
    with pytest.raises(ValueError):
        grpo_loss(logp, old, None, adv, mask, LossSettings(beta=0.1, epsilon_low=.2, epsilon_high=.2, loss_type="grpo",
                                                           max_completion_length=4))


# -- gradient == gradient of the published objective, written out line by line ---------------------

def reference_objective(logp, old, ref, adv, mask, beta, eps_low, eps_high, loss_type, L_max, n_tokens, bias_kl):
    """The published per-token objective, summed with Python loops over sequences and tokens.

    J_i,t = min(rho A_i, clip(rho, 1-eps_low, 1+eps_high) A_i) - beta * w * (pi_ref/pi - log(pi_ref/pi) - 1)
    with w = rho (DeepSeek-V3.2's bias-corrected KL, `bias_kl`) or 1
    grpo (DeepSeekMath), sapo: 1/B sum_i 1/|o_i| sum_t J;  bnpo: sum J / sum |o_i| (this batch);
    dr_grpo: sum J / (B * L_max);  dapo, cispo, vespo: sum J / (tokens in the whole generation batch);
    luspo: 1/B sum_i sum_t J. Loss = -J.
    CISPO (TRL): J = sg[min(rho, eps_high)] A log pi;  SAPO: J = sigmoid(tau (rho - 1)) 4 / tau A;
    VESPO (default k, lambda): J = sg[w^k e^(-lambda (w - 1))] A log pi, w = prod_t rho_t.
    """
    B, L = logp.shape
    total = 0.0
    seq_means = []
    for i in range(B):
        s, n = 0.0, 0
        w = math.exp(sum((logp[i, t] - old[i, t]).item() for t in range(L) if mask[i, t] == 1))
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        for t in range(L):
            if mask[i, t] == 0:
                continue
            rho = torch.exp(logp[i, t] - old[i, t])
            if loss_type == "cispo":                # REINFORCE with a stop-gradient weight capped at eps_high
                surrogate = torch.clamp(rho, max=eps_high).detach() * adv[i] * logp[i, t]
            elif loss_type == "vespo":              # a gamma weight of the sequence's IS weight, no gradient
                surrogate = w ** k * math.exp(-lam * (w - 1)) * adv[i] * logp[i, t]
            elif loss_type == "sapo":               # soft gate, default temperatures 1.0 / 1.05
                tau = 1.0 if adv[i] > 0 else 1.05
                surrogate = torch.sigmoid(tau * (rho - 1)) * 4 / tau * adv[i]
            else:
                surrogate = torch.minimum(rho * adv[i], torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv[i])
            kl = torch.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1 if beta else 0.0
            s = s + surrogate - beta * (rho if bias_kl else 1.0) * kl
            n += 1
        total = total + s
        seq_means.append(s / max(n, 1))
    if loss_type in ("grpo", "sapo"):
        return -sum(seq_means) / B
    if loss_type == "bnpo":
        return -total / mask.sum()
    if loss_type == "dr_grpo":
        return -total / (B * L_max)
    if loss_type == "luspo":
        return -total / B
    return -total / n_tokens


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mu", [1, 3])
@pytest.mark.parametrize("beta, bias_kl", [(0.0, True), (0.04, True), (0.04, False)])
def test_gradient_matches_published_objective(loss_type, mu, beta, bias_kl):
    g = torch.Generator().manual_seed(hash((loss_type, mu, beta)) % 1000)
    B, L, L_max = 6, 7, 9
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    logits = torch.randn(B, L, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (B, L), generator=g)
    adv = torch.randn(B, generator=g)
    ref = token_logprobs(torch.randn(B, L, 11, generator=g), ids)
    # mu = 1: the rollout policy is the current one (ratio exactly 1, old = logp.detach()).
    # mu > 1: a later pass over the same rollout; old log-probs differ, so both clip sides are active.
    logp = token_logprobs(logits, ids)
    old = logp.detach() if mu == 1 else logp.detach() + 0.4 * torch.randn(B, L, generator=g)
    n_tokens = mask.sum().item() + 5          # dapo: the generation batch holds more than this micro-batch
    settings = LossSettings(beta=beta, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type,
                            max_completion_length=L_max, use_bias_correction_kl=bias_kl)
    loss, _ = grpo_loss(logp, old, ref, adv, mask, settings, num_tokens_in_batch=n_tokens)
    (grad,) = torch.autograd.grad(loss, logits)
    logp2 = token_logprobs(logits, ids)
    expect = reference_objective(logp2, old, ref, adv, mask, beta, 0.2, 0.28, loss_type, L_max, n_tokens, bias_kl)
    (grad_ref,) = torch.autograd.grad(expect, logits)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, grad_ref, atol=1e-6, rtol=1e-4)
    if mu > 1:
        assert (torch.exp(logp - old) * mask).max() > 1.28    # clipping was really exercised


def test_beta0_ratio1_is_advantage_weighted_logprob_gradient():
    """beta = 0, ratio 1: grad of the loss == -grad of sum_i A_i/|o_i| sum_t log pi / B (grpo)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 13, generator=g, requires_grad=True)
    ids = torch.randint(0, 13, (4, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).float()
    adv = torch.tensor([1.5, -0.5, 0.2, -1.2])
    logp = token_logprobs(logits, ids)
    loss, _ = grpo_loss(logp, logp.detach(), None, adv, mask, LossSettings(beta=0.0, epsilon_low=.2, epsilon_high=.2,
                                                                           loss_type="grpo", max_completion_length=5))
    (grad,) = torch.autograd.grad(loss, logits)
    logp = token_logprobs(logits, ids)
    pg = -(adv[:, None] * logp * mask / mask.sum(-1, keepdim=True)).sum() / 4        # REINFORCE with baseline
    (grad_pg,) = torch.autograd.grad(pg, logits)
    assert torch.allclose(grad, grad_pg, atol=1e-7)


# -- micro-batches of one optimizer step add up to the step's loss ------------------------------------

@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_shares_add_up_to_the_step_loss(loss_type):
    """Backward on each micro-batch's share, accumulated, == backward on the step's loss.

    grpo, dr_grpo, dapo: the step's loss is that of the whole batch at once (equal-sized halves);
    bnpo: the mean of the micro-batches' token means (TRL divides by gradient-accumulation steps),
    which differs from the whole batch's token mean when the halves hold different token counts.
    """
    g = torch.Generator().manual_seed(7)
    B, L, L_max = 6, 7, 9
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    mask[:3, -2:] = 1                                             # halves with different token counts
    mask[3:, -2:] = 0
    logits = torch.randn(B, L, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (B, L), generator=g)
    adv = torch.randn(B, generator=g)
    ref = token_logprobs(torch.randn(B, L, 11, generator=g), ids)
    old = token_logprobs(logits, ids).detach() + 0.4 * torch.randn(B, L, generator=g)   # both clip sides
    settings = LossSettings(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type,
                            max_completion_length=L_max)
    step_tokens = mask.sum().item()

    def loss_of(rows, **extra):
        logp = token_logprobs(logits, ids)
        return grpo_loss(logp[rows], old[rows], ref[rows], adv[rows], mask[rows], settings, **extra)[0]

    halves = [slice(0, 3), slice(3, 6)]
    shares = [loss_of(rows, num_micro_batches=2, num_tokens_in_batch=step_tokens) for rows in halves]
    accumulated = torch.autograd.grad(shares[0], logits)[0] + torch.autograd.grad(shares[1], logits)[0]
    if loss_type == "bnpo":
        step_loss = sum(loss_of(rows) for rows in halves) / 2
        whole = loss_of(slice(None))
        assert abs(step_loss.item() - whole.item()) > 1e-4           # the setup tells the two apart
    else:
        step_loss = loss_of(slice(None), num_tokens_in_batch=step_tokens)
    (expected,) = torch.autograd.grad(step_loss, logits)
    assert sum(s.item() for s in shares) == pytest.approx(step_loss.item(), rel=1e-6)
    assert torch.allclose(accumulated, expected, atol=1e-7, rtol=1e-5)


# -- groups that lost members --------------------------------------------------------------------------

def test_ragged_group_advantages_by_hand():
    """Groups of 3 and 4 survivors: each normalised by its own mean and unbiased std."""
    r = torch.tensor([1., 0., 0., 1., 1., 0., 0.])
    g = group_advantages(r, [3, 4], "group")
    m1, s1 = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    m2, s2 = 0.5, math.sqrt(1 / 3)
    expect = [(x - m1) / (s1 + 1e-4) for x in (1, 0, 0)] + [(x - m2) / (s2 + 1e-4) for x in (1, 1, 0, 0)]
    assert torch.allclose(g, torch.tensor(expect), atol=1e-6)
    n = group_advantages(r, [3, 4], "none")
    assert torch.allclose(n, torch.tensor([2 / 3, -1 / 3, -1 / 3, .5, .5, -.5, -.5]), atol=1e-6)
    sb = r.std().item()
    assert torch.allclose(group_advantages(r, [3, 4], "batch"), n / (sb + 1e-4), atol=1e-6)
    assert zero_std_groups(torch.tensor([1., 1., 1., 0., 2.]), [3, 2]).tolist() == [True, False]
    equal = torch.tensor([1., 0., 0., 0., 1., 1., 0., 0.])         # equal sizes as a list: the G path
    assert torch.equal(group_advantages(equal, [4, 4]), group_advantages(equal, 4))


# -- the variants, by hand -------------------------------------------------------------------------------

def test_importance_ratio_levels_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.4, 0.4, 0.4]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.2, 0.8, 0.4]]))   # ratios 2, .5, (pad) | 2, .5, 1
    mask = torch.tensor([[1., 1., 0.], [1., 1., 1.]])
    assert torch.allclose(importance_ratio(logp, old, mask, "token"), torch.exp(logp - old))
    seq = importance_ratio(logp, old, mask, "sequence")
    assert seq.shape == (2, 1)
    # geometric means of the real tokens' ratios: (2 * .5)^(1/2) = 1 and (2 * .5 * 1)^(1/3) = 1
    assert torch.allclose(seq, torch.ones(2, 1), atol=1e-6)
    old2 = old.clone()
    old2[1, 2] = math.log(0.1)                                        # third token's ratio 4: (4)^(1/3)
    assert importance_ratio(logp, old2, mask, "sequence")[1, 0].item() == pytest.approx(4 ** (1 / 3), rel=1e-6)
    st = importance_ratio(logp, old2, mask, "sequence_token")
    assert st.shape == (2, 3) and torch.allclose(st[1], torch.full((3,), 4 ** (1 / 3)), atol=1e-6)
    with pytest.raises(ValueError):
        importance_ratio(logp, old, mask, "group")


def test_delta_caps_negative_advantages_only():
    ratio = torch.tensor([[3.0, 0.5, 1.1]])
    for A, expect in ((-1.0, [1.5, 0.8, 1.1]), (1.0, [-1.28, -0.5, -1.1])):
        # A = -1: -A min(r, delta) vs -A clip(r): max(min(r, 1.5), clip(r)) = 1.5, .8, 1.1
        # A = +1: delta never binds (the clipped term is already the smaller one above 1 + eps_high)
        loss = clipped_surrogate(ratio, torch.tensor([[A]]), 0.2, 0.28, delta=1.5)
        assert torch.allclose(loss, torch.tensor([expect])), (A, loss)
    assert clipped_surrogate(ratio, torch.tensor([[-1.0]]), 0.2, 0.28)[0, 0].item() == pytest.approx(3.0)


def test_cispo_by_hand():
    """-sg[min(rho, cap)] A logp: every token keeps a gradient, weighted by its capped ratio."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5, 0.05, 0.25]]))                # ratios 1, 10, 2
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 3)
    loss, st = grpo_loss(logp, old, None, adv, mask, LossSettings(beta=0.0, epsilon_low=0.2, epsilon_high=5.0,
                                                                  loss_type="cispo", max_completion_length=3))
    weights = torch.tensor([1.0, 5.0, 2.0])                           # min(rho, 5)
    assert loss.item() == pytest.approx(-(weights * 2.0 * logp.detach()[0]).sum().item() / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, -(weights * 2.0 / 3)[None], atol=1e-6)
    assert st["clip_ratio/high_mean"] == pytest.approx(1 / 3)          # the ratio of 10 was capped


def test_sapo_by_hand():
    """-A sigmoid(tau (rho - 1)) 4 / tau: at rho = 1 the gradient is the plain surrogate's, away from 1 it fades."""
    ratio = torch.tensor([[1.0, 1.5], [1.0, 0.5]], requires_grad=True)
    adv = torch.tensor([[1.0], [-2.0]])
    loss = sapo_loss(ratio, adv, 1.0, 1.05)
    expect = [[-4 * 0.5, -4 * torch.sigmoid(torch.tensor(0.5)).item()],
              [2 * 4 * 0.5 / 1.05, 2 * 4 * torch.sigmoid(torch.tensor(-0.525)).item() / 1.05]]
    assert torch.allclose(loss, torch.tensor(expect), atol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), ratio)
    s = lambda x: torch.sigmoid(torch.tensor(x)).item()               # noqa: E731
    assert grad[0, 0].item() == pytest.approx(-1.0) and grad[1, 0].item() == pytest.approx(2.0)
    assert grad[0, 1].item() == pytest.approx(-4 * s(0.5) * (1 - s(0.5)))
    assert grad[1, 1].item() == pytest.approx(2 * 4 * s(-0.525) * (1 - s(-0.525)))


def test_off_policy_sequence_mask_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.9, 0.9], [0.9, 0.9], [0.55, 0.5]]))
    mask = torch.tensor([[1., 1.], [1., 1.], [1., 0.]])
    adv = torch.tensor([[1.0], [-1.0], [-1.0]])
    # KL per sequence: log(.9/.5) = .588 (rows 0 and 1), log(.55/.5) = .095 (row 2, one real token)
    keep = off_policy_sequence_mask(adv, logp, sampler, mask, threshold=0.3)
    assert keep.flatten().tolist() == [1.0, 0.0, 1.0]       # positive advantage kept; drifted negative dropped
    assert off_policy_sequence_mask(adv, logp, sampler, mask, threshold=0.6).flatten().tolist() == [1.0, 1.0, 1.0]


def test_high_entropy_mask_by_hand():
    entropy = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.3, 0.7, 9.0, 9.0]])
    mask = torch.tensor([[1., 1., 1., 0.], [1., 1., 0., 0.]])
    # real entropies .1 .3 .5 .7 .9; top 40%: threshold = quantile(.6) = .5 + .4 * (.7 - .5) = .58
    keep = high_entropy_mask(entropy, mask, 0.4)
    assert keep.tolist() == [[0., 0., 1., 0.], [0., 1., 0., 0.]]
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask)   # q = 1: every real token


@pytest.mark.parametrize("mode, expect", [
    ("token_truncate", [[2.0, 0.5, 1.0], [3.0, 1.0, 1.0]]),
    ("token_mask", [[2.0, 0.5, 1.0], [0.0, 1.0, 1.0]]),
    ("sequence_truncate", [[1.0], [3.0]]),
    ("sequence_mask", [[1.0], [0.0]]),
])
def test_sampler_correction_weight_by_hand(mode, expect):
    old = torch.log(torch.tensor([[0.4, 0.1, 0.3], [0.8, 0.3, 0.3]]))
    sampler = torch.log(torch.tensor([[0.2, 0.2, 0.9], [0.1, 0.3, float("nan")]]))
    mask = torch.tensor([[1., 1., 0.], [1., 1., 1.]])
    # token ratios pi_old / mu: 2, .5, (pad) | 8, 1, (NaN: ratio 1); sequence: 2 * .5 = 1 | 8 * 1 * 1 = 8
    w = sampler_correction_weight(old, sampler, mask, mode, cap=3.0)
    assert torch.allclose(w, torch.tensor(expect), atol=1e-6), w


@pytest.mark.parametrize("mode, expect", [
    ("token_truncate", [[2.0, 0.8, 1.0], [3.0, 1.0, 1.0]]),          # .5 raised to C_min = .8
    ("token_mask", [[2.0, 0.0, 1.0], [0.0, 1.0, 1.0]]),              # .5 < C_min: zeroed; 8 > C: zeroed
    ("sequence_truncate", [[1.0], [3.0]]),
    ("sequence_mask", [[1.0], [0.0]]),
])
def test_sampler_correction_clip_min_by_hand(mode, expect):
    """TRL's vllm_importance_sampling_clip_min: the lower bound C_min, truncated up to or masked below."""
    old = torch.log(torch.tensor([[0.4, 0.1, 0.3], [0.8, 0.3, 0.3]]))
    sampler = torch.log(torch.tensor([[0.2, 0.2, 0.9], [0.1, 0.3, float("nan")]]))
    mask = torch.tensor([[1., 1., 0.], [1., 1., 1.]])
    w = sampler_correction_weight(old, sampler, mask, mode, cap=3.0, clip_min=0.8)
    assert torch.allclose(w, torch.tensor(expect), atol=1e-6), w
    # sequence ratios 1 and 8: a C_min above 1 bites the first
    seq = sampler_correction_weight(old, sampler, mask, mode.replace("token", "sequence"), cap=3.0, clip_min=1.5)
    assert seq[0].item() == (1.5 if mode.endswith("truncate") else 0.0)


def test_adaptive_entropy_coefficient_by_hand():
    """Skywork-OR1 as TRL: +delta when the step's entropy <= target, -delta otherwise, within [min, max]; a step
    applies the coefficient only when the previous step's entropy was <= target (none measured: never)."""
    c, last, applied = 0.0, math.inf, []
    for h in [0.1, 0.1, 0.1, 0.5, 0.5, 0.05]:                 # target 0.2, delta 0.03, [0, 0.05]
        applied.append(applied_entropy_coef(c, last, 0.2))
        c, last = next_entropy_coef(c, h, 0.2, 0.03, 0.0, 0.05), h
    assert applied == pytest.approx([0.0, 0.03, 0.05, 0.05, 0.0, 0.0])
    assert c == pytest.approx(0.03)                             # .05 -> .02 -> 0 (floor) -> .03
    assert applied_entropy_coef(0.3, 0.2, 0.2) == 0.3           # at the target counts as below
    assert next_entropy_coef(0.3, 0.2, 0.2, 0.1, 0.0, 1.0) == pytest.approx(0.4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus_is_the_mean_token_entropy_whatever_the_loss_type(loss_type):
    """TRL's bonus: entropy_coef times the token mean of the entropy (over the tokens the entropy mask keeps),
    divided by the micro-batches of the step, not reduced like the loss (a sequence mean of token means
    would weigh the one-token answer's entropy as much as the four-token one's)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (3, 4), generator=g)
    mask = torch.tensor([[1., 1., 1., 0.], [1., 0., 0., 0.], [1., 1., 1., 1.]])
    adv = torch.tensor([0.5, -1.0, 2.0])
    settings = LossSettings(beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type=loss_type, max_completion_length=4)
    kw = dict(num_micro_batches=2, num_tokens_in_batch=20.0)
    logp = token_logprobs(logits, ids)
    entropy = token_entropy(logits)
    for q in (1.0, 0.5):
        plain, _ = grpo_loss(logp, logp.detach(), None, adv, mask, replace(settings, top_entropy_quantile=q), **kw,
                             entropy=entropy)
        bonus, _ = grpo_loss(logp, logp.detach(), None, adv, mask,
                             replace(settings, top_entropy_quantile=q, entropy_coef=0.1), **kw, entropy=entropy)
        values = sorted(entropy[mask.bool()].tolist())              # 8 tokens
        kept = values if q == 1.0 else [h for h in values if h >= (values[3] + values[4]) / 2 - 1e-7]
        assert len(kept) == (8 if q == 1.0 else 4)
        assert bonus.item() == pytest.approx(plain.item() - 0.1 * sum(kept) / len(kept) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(logp, logp.detach(), None, adv, mask, replace(settings, entropy_coef=0.1), **kw,
                  entropy=entropy.detach())


def test_bias_corrected_kl_gradient_on_policy_is_the_reverse_kl_gradient():
    """On-policy (ratio 1 in value), one token: plain k3's gradient in logp is beta (1 - ref/pi), the
    bias-corrected one's beta (k3 + 1 - ref/pi) = beta (log pi - log ref), the gradient of the reverse KL's
    sample log(pi / ref); the loss value is the same."""
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ref, adv, mask = torch.tensor([[-1.5]]), torch.tensor([0.0]), torch.ones(1, 1)
    settings = LossSettings(beta=0.1, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo", max_completion_length=1)
    k3 = math.exp(-0.5) + 0.5 - 1
    for corrected, grad_want in ((True, 0.1 * 0.5), (False, 0.1 * (1 - math.exp(-0.5)))):
        loss, stats = grpo_loss(logp, logp.detach(), ref, adv, mask,
                                replace(settings, use_bias_correction_kl=corrected))
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6) and stats["kl"] == pytest.approx(k3, rel=1e-6)
        assert grad.item() == pytest.approx(grad_want, rel=1e-6)
    # off-policy the value is weighted too: ratio e^0.3 times k3
    loss, stats = grpo_loss(logp, logp.detach() - 0.3, ref, adv, mask, settings)
    assert stats["kl"] == pytest.approx(math.exp(0.3) * k3, rel=1e-6)


# -- every option against the published objectives, written out token by token ---------------------------

VARIANTS = {
    "gspo": Options(level="sequence", loss_type="grpo"),
    "gspo_token": Options(level="sequence_token", loss_type="dapo"),
    "delta": Options(delta=1.6, loss_type="bnpo", beta=0.04),
    "cispo": Options(loss_type="cispo", eps_high=1.5),
    "cispo_sequence": Options(loss_type="cispo", eps_high=1.2, level="sequence"),
    "sapo": Options(loss_type="sapo", tau_pos=1.0, tau_neg=1.05),
    "sapo_sequence": Options(loss_type="sapo", level="sequence", tau_pos=2.0, tau_neg=0.5),
    "top_entropy": Options(top_entropy_quantile=0.3, loss_type="dr_grpo"),
    "entropy_bonus": Options(entropy_coef=0.05, beta=0.04),
    "luspo": Options(loss_type="luspo", level="sequence", beta=0.04),
    "luspo_token_delta": Options(loss_type="luspo", delta=1.6),
    "vespo": Options(loss_type="vespo"),
    "vespo_sampler_kl": Options(loss_type="vespo", sampler_mode="token_truncate", sampler_cap=1.5, beta=0.04,
                                vespo=(1.5, 2.0, 2.5, 1.0)),
    "entropy_bonus_dapo_masked": Options(entropy_coef=0.05, loss_type="dapo", top_entropy_quantile=0.5),
    "kl_plain_k3": Options(beta=0.04, bias_correction_kl=False, loss_type="bnpo"),
    "kl_sequence_ratio": Options(beta=0.04, level="sequence"),
    "kl_cispo": Options(beta=0.04, loss_type="cispo", eps_high=1.5),
    "off_policy_mask": Options(off_policy_threshold=0.05, loss_type="dapo"),
    "token_truncate": Options(sampler_mode="token_truncate", sampler_cap=1.5),
    "token_mask": Options(sampler_mode="token_mask", sampler_cap=1.5, loss_type="bnpo"),
    "sequence_truncate": Options(sampler_mode="sequence_truncate", sampler_cap=1.5),
    "sequence_mask": Options(sampler_mode="sequence_mask", sampler_cap=1.5, off_policy_threshold=0.05),
    "token_truncate_min": Options(sampler_mode="token_truncate", sampler_cap=1.5, sampler_min=0.8),
    "token_mask_min": Options(sampler_mode="token_mask", sampler_cap=1.5, sampler_min=0.8, loss_type="dapo"),
    "sequence_truncate_min": Options(sampler_mode="sequence_truncate", sampler_cap=1.5, sampler_min=0.7),
    "sequence_mask_min": Options(sampler_mode="sequence_mask", sampler_cap=3.0, sampler_min=0.7, beta=0.04),
    "vespo_sampler_min": Options(loss_type="vespo", sampler_mode="token_mask", sampler_cap=1.5, sampler_min=0.8),
    "everything": Options(level="sequence_token", delta=1.7, top_entropy_quantile=0.6, entropy_coef=0.02,
                          off_policy_threshold=0.02, sampler_mode="token_truncate", sampler_cap=1.3, beta=0.04),
}


def loss_settings(o: Options, max_completion_length: int) -> LossSettings:
    return LossSettings(max_completion_length=max_completion_length, beta=o.beta, epsilon_low=o.eps_low, epsilon_high=o.eps_high, loss_type=o.loss_type,
                importance_sampling_level=o.level, delta=o.delta, sapo_temperature_pos=o.tau_pos,
                sapo_temperature_neg=o.tau_neg, top_entropy_quantile=o.top_entropy_quantile,
                entropy_coef=o.entropy_coef, use_bias_correction_kl=o.bias_correction_kl,
                vespo_k_pos=o.vespo[0], vespo_lambda_pos=o.vespo[1], vespo_k_neg=o.vespo[2],
                vespo_lambda_neg=o.vespo[3],
                off_policy_mask_threshold=o.off_policy_threshold,
                sampler_correction=o.sampler_mode, sampler_correction_cap=o.sampler_cap,
                sampler_correction_clip_min=o.sampler_min)


def as_sequences(logp, old, ref, sampler, entropy, adv, mask) -> list[Sequence]:
    out = []
    for i in range(logp.size(0)):
        ts = [t for t in range(logp.size(1)) if mask[i, t] == 1]
        out.append(Sequence(logp=[logp[i, t] for t in ts], old=[old[i, t].item() for t in ts],
                            advantage=adv[i].item(), ref=[ref[i, t].item() for t in ts],
                            sampler=[sampler[i, t].item() for t in ts], entropy=[entropy[i, t] for t in ts]))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_gradient_matches_published_objective(name):
    o = VARIANTS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    B, L, V, L_max = 6, 7, 11, 9
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    logits = torch.randn(B, L, V, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, L), generator=g)
    adv = torch.randn(B, generator=g)
    ref = token_logprobs(torch.randn(B, L, V, generator=g), ids)
    old = token_logprobs(logits, ids).detach() + 0.3 * torch.randn(B, L, generator=g)      # off-policy step
    sampler = old + 0.3 * torch.randn(B, L, generator=g)                                   # sampler != trainer
    n_tokens = mask.sum().item() + 5

    logp, entropy = token_logprobs(logits, ids), token_entropy(logits)
    loss, stats = grpo_loss(logp, old, ref, adv, mask, loss_settings(o, L_max), num_tokens_in_batch=n_tokens,
                            entropy=entropy, sampler_logp=sampler)
    (grad,) = torch.autograd.grad(loss, logits)
    seqs = as_sequences(token_logprobs(logits, ids), old, ref, sampler, token_entropy(logits), adv, mask)
    expect = micro_batch_loss(seqs, o, max_completion_length=L_max, dapo_tokens=n_tokens)
    (grad_ref,) = torch.autograd.grad(expect, logits)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, grad_ref, atol=1e-6, rtol=1e-4)
    if o.off_policy_threshold is not None:
        assert 0 < stats["off_policy_mask/dropped_frac"] < 1              # the mask really dropped some
    if o.top_entropy_quantile < 1:
        assert 0 < stats["entropy_mask/kept_frac"] < 1
    if o.sampler_mode is not None:
        assert stats["sampler_is/weight_mean"] != pytest.approx(1.0)
    if o.sampler_min is not None:                                         # the lower bound really bit
        raw = torch.exp((old - sampler) * mask)
        raw = raw if o.sampler_mode.startswith("token") else raw.prod(-1, keepdim=True)
        assert ((raw < o.sampler_min) & (mask.bool() if o.sampler_mode.startswith("token") else True)).any()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_token_equals_gspo_with_sequence_advantages(loss_type):
    """GSPO paper, eqs. 11 and 18: with one advantage per sequence the two give the same loss and gradient."""
    g = torch.Generator().manual_seed(11)
    B, L = 5, 6
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    logits = torch.randn(B, L, 9, generator=g, requires_grad=True)
    ids = torch.randint(0, 9, (B, L), generator=g)
    adv = torch.randn(B, generator=g)
    old = token_logprobs(logits, ids).detach() + 0.2 * torch.randn(B, L, generator=g)
    out = []
    for level in ("sequence", "sequence_token"):
        settings = LossSettings(beta=0.0, epsilon_low=0.1, epsilon_high=0.1 if loss_type != "cispo" else 1.1,
                                loss_type=loss_type, max_completion_length=L, importance_sampling_level=level)
        loss, _ = grpo_loss(token_logprobs(logits, ids), old, None, adv, mask, settings)
        out.append((loss.item(), torch.autograd.grad(loss, logits)[0]))
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-6)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-7)


@pytest.mark.parametrize("loss_type", ["vespo", "cispo"])
def test_on_policy_vespo_and_cispo_take_dapos_gradient(loss_type):
    """With one optimizer step per rollout the ratio is 1 (old log-probs are the log-probs, detached): VESPO's
    weight phi(1) = 1 and CISPO's capped weight is 1, so their gradients are DAPO's bit for bit (their loss values
    differ: -A log p against -A ratio). Two runs of them that differ took different kernels, not objectives."""
    g = torch.Generator().manual_seed(0)
    logp = (torch.rand(4, 7, generator=g) * -3).requires_grad_()                           # [B, L]
    mask = (torch.rand(4, 7, generator=g) > 0.2).float()
    advantages = torch.randn(4, generator=g)

    def grad(kind: str, epsilon_high: float) -> torch.Tensor:
        s = LossSettings(loss_type=kind, beta=0.0, epsilon_low=0.2, epsilon_high=epsilon_high, max_completion_length=7)
        loss, _ = grpo_loss(logp, logp.detach(), None, advantages, mask, s, num_tokens_in_batch=mask.sum().item())
        return torch.autograd.grad(loss, logp)[0]

    assert torch.equal(grad(loss_type, 5.0 if loss_type == "cispo" else 0.28), grad("dapo", 0.28))
