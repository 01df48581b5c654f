"""The GRPO objective as pure functions on tensors, read top to bottom: group-relative advantages, the
k3 KL to the reference, the importance ratio, the per-token policy loss of each published variant, the
masks and weights that decide which tokens count, and how each variant reduces per-token losses to the
one number a micro-batch backpropagates. Where the log-probs come from is `grpo_core.update.logprobs`; when
and on which samples this runs is `grpo_core.update.step`. Option names follow TRL's `GRPOConfig`.

Notation: B = sequences in a micro-batch, G = group size, L = completion length (padded), A_i = the
advantage of sequence i, rho = exp(logp - old_logp) the per-token ratio to the rollout policy,
sg[.] = stop-gradient. With the defaults (token ratio, loss_type grpo, no masks) the loss is

    pg_loss1 = -A_i * rho
    pg_loss2 = -A_i * clip(rho, 1 - eps_low, 1 + eps_high)
    loss     = max(pg_loss1, pg_loss2) + beta * rho * KL_k3(pi || ref)    per token, [B, L]

then reduced over tokens as `loss_type` says (see `aggregate`), scaled so that the micro-batches of one
optimizer step add up to that step's loss. The KL is weighted by the ratio (`use_bias_correction_kl`,
DeepSeek-V3.2, TRL's default) so that its gradient is the unbiased reverse-KL gradient; rho's value is 1
on-policy, its gradient is not. `grpo_loss` lists, in order, what each option changes.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# -- advantages -------------------------------------------------------------------------------------

def _group_sizes(rewards: torch.Tensor, group_size: int | Sequence[int]) -> list[int]:
    if isinstance(group_size, int):
        return [group_size] * (rewards.size(0) // group_size)
    return list(group_size)


def group_advantages(rewards: torch.Tensor, group_size: int | Sequence[int], scale_rewards: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (std + eps), with the std of the group, of the batch, or none (Dr. GRPO).

    rewards: [B] with groups laid out contiguously. `group_size` is G (every group has G members) or
    the size of each group in order (groups that lost members; each needs >= 2 for a std). Returns [B].
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    groups = torch.split(rewards, _group_sizes(rewards, group_size))      # each [G_i]
    if not groups:
        return rewards.clone()
    centred = torch.cat([g - g.mean() for g in groups])                   # [B]
    if scale_rewards == "group":
        std = torch.cat([g.std().expand(len(g)) for g in groups])         # [B] unbiased std, as TRL
        return centred / (std + eps)
    return centred / (rewards.std() + eps) if scale_rewards == "batch" else centred


def _nanstd(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Unbiased (n - 1) standard deviation along `dim`, skipping NaNs; NaN where fewer than 2 values remain.
    [..., n, ...] -> [..., 1, ...] (dim kept)."""
    n = (~x.isnan()).sum(dim, keepdim=True)
    sq = (x - x.nanmean(dim, keepdim=True)) ** 2
    var = sq.nansum(dim, keepdim=True) / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.full_like(var, float("nan")))


def decoupled_advantages(rewards: torch.Tensor, weights: torch.Tensor, group_size: int | Sequence[int],
                         eps: float = 1e-4) -> torch.Tensor:
    """GDPO (TRL's `multi_objective_aggregation: normalize_then_sum`): each reward function's scores are
    normalised within their group first, then weighted and summed, then the sum is normalised over the batch:

        z_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps)       group g of i, function k (unbiased std)
        s_i  = sum_k w_k z_ik
        A_i  = (s_i - mean_i(s)) / (std_i(s) + eps)             over the whole batch

    NaN is a score a function did not give: means and stds skip it, a function with fewer than two scores in a
    group adds nothing to that group's sums, and a row with no score at all gets advantage 0 (as TRL).
    rewards: [B, K] in contiguous groups (`group_size` as in `group_advantages`); weights: [K]. -> [B]"""
    groups = torch.split(rewards, _group_sizes(rewards, group_size))      # each [G_i, K]
    if not groups:
        return rewards.new_zeros(0)
    z = torch.cat([(g - g.nanmean(0, keepdim=True)) / (_nanstd(g, 0) + eps) for g in groups])      # [B, K]
    summed = (z * weights.to(z.dtype)).nansum(-1)                         # [B]
    summed = summed.masked_fill(rewards.isnan().all(-1), float("nan"))    # unscorable rows: no part in the stats
    return ((summed - summed.nanmean()) / (_nanstd(summed, 0) + eps)).nan_to_num(nan=0.0)


def zero_std_groups(rewards: torch.Tensor, group_size: int | Sequence[int]) -> torch.Tensor:
    """[number of groups] bool: groups whose rewards are all equal (they carry no learning signal).
    `group_size` as in `group_advantages`."""
    groups = torch.split(rewards, _group_sizes(rewards, group_size))
    return torch.stack([(g.max() - g.min()).abs() < 1e-8 for g in groups]) if groups else \
        torch.zeros(0, dtype=torch.bool)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0). [B, L]."""
    delta = ref_logp - logp                                               # [B, L]
    return torch.exp(delta) - delta - 1


def kl_term(logp: torch.Tensor, ref_logp: torch.Tensor | None, ratio: torch.Tensor,
            use_bias_correction_kl: bool = True) -> torch.Tensor:
    """The per-token KL the loss adds beta times: `kl_k3`, times the importance ratio (its value before
    `delta` caps it; [B, L] or [B, 1]) when `use_bias_correction_kl` (DeepSeek-V3.2: then its gradient is the
    unbiased reverse-KL gradient, also on-policy). [B, L]."""
    if ref_logp is None:
        raise ValueError("beta > 0 needs reference log-probs")
    kl = kl_k3(logp, ref_logp)                                            # [B, L]
    return kl * ratio if use_bias_correction_kl else kl


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float = 1.0) -> torch.Tensor:
    """The mean per-token entropy over the tokens the policy loss trains on (the high-entropy mask applied
    when `top_entropy_quantile` < 1), whatever the loss type (TRL: the bonus is not reduced like the policy
    loss, so `entropy_coef` means the same for every loss type). entropy/mask: [B, L] -> scalar."""
    if top_entropy_quantile < 1.0:
        mask = mask * high_entropy_mask(entropy, mask, top_entropy_quantile)             # [B, L]
    return (entropy * mask).sum() / mask.sum().clamp(min=1)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """Adaptive entropy control (Skywork-OR1, as TRL's `use_adaptive_entropy`): the bonus of a step uses the
    coefficient only while the entropy measured at the previous step is at or below the target (the first
    step has no measurement, last_entropy = inf, so no bonus); else 0."""
    return coef if last_entropy <= target else 0.0


def next_entropy_coef(coef: float, entropy: float, target: float, delta: float, coef_min: float,
                      coef_max: float) -> float:
    """The coefficient after a step whose measured entropy (the token mean over the tokens the policy loss
    trained on, the whole step across processes) is `entropy`:

        c <- min(c + delta, c_max)  if entropy <= target     (entropy too low: push it up)
        c <- max(c - delta, c_min)  otherwise"""
    return min(coef + delta, coef_max) if entropy <= target else max(coef - delta, coef_min)


# -- the importance ratio to the rollout policy -----------------------------------------------------

def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over each sequence's completion tokens. [B, L] -> [B, 1]."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """The ratio the policy loss clips (`importance_sampling_level`). logp/old_logp/mask: [B, L].

    token:          rho_t = exp(logp_t - old_logp_t)                                       [B, L]
    sequence:       s_i = exp(mean_t (logp_t - old_logp_t)), the geometric mean of the
                    token ratios (GSPO; TRL's `sequence`)                                    [B, 1]
    sequence_token: s_i,t = sg[s_i] * pi_t / sg[pi_t] = exp(sg[log s_i] + logp_t - sg[logp_t])
                    (GSPO-token: the value of s_i, the gradient of one token)                [B, L]
    With one advantage per sequence, sequence and sequence_token give the same loss and gradient
    (GSPO paper, eqs. 11 and 18); sequence_token is there for token-level advantages.
    """
    log_ratio = logp - old_logp                                           # [B, L]
    if level == "token":
        return torch.exp(log_ratio)
    log_s = _sequence_mean(log_ratio, mask)                               # [B, 1]
    if level == "sequence":
        return torch.exp(log_s)
    if level == "sequence_token":
        return torch.exp(log_s.detach() + logp - logp.detach())           # [B, L]
    raise ValueError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, "
                     f"not {level!r}")


# -- per-token policy losses (advantages: [B, 1]; ratio: [B, L] or [B, 1]) ----------------------------

def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                      delta: float | None = None) -> torch.Tensor:
    """PPO's pessimistic clipped surrogate, optionally two-sided (INTELLECT-2):

        pg_loss1 = -A * min(rho, delta)            (min(rho, delta) only when delta is set)
        pg_loss2 = -A * clip(rho, 1 - eps_low, 1 + eps_high)
        loss     = max(pg_loss1, pg_loss2)

    For A > 0 the max already picks the clipped term once rho > 1 + eps_high < delta, so delta only
    bounds negative-advantage tokens, whose ratio is otherwise unbounded (TRL applies it the same way).
    """
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    pg_loss1 = -advantages * capped
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    return torch.max(pg_loss1, pg_loss2)


def cispo_loss(ratio: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor, cap: float) -> torch.Tensor:
    """CISPO (MiniMax-M1), REINFORCE with a clipped, stop-gradient IS weight; no token is ever dropped:

        loss = -sg[min(rho, cap)] * A * logp_t

    The cap is `epsilon_high` itself, as TRL has it (ScaleRL's eps_max, e.g. 5.0; it plays the part of
    MiniMax-M1's 1 + eps_high^IS); there is no lower bound. [B, L]."""
    return -torch.clamp(ratio, max=cap).detach() * advantages * logp


def sapo_loss(ratio: torch.Tensor, advantages: torch.Tensor, temperature_pos: float,
              temperature_neg: float) -> torch.Tensor:
    """SAPO: a soft, temperature-gated trust region instead of the hard clip (TRL's formula):

        tau  = sapo_temperature_pos if A > 0 else sapo_temperature_neg
        loss = -A * sigmoid(tau * (rho - 1)) * 4 / tau

    Its gradient in rho is A * 4 sigma(1 - sigma), 1 at rho = 1 (as the plain surrogate) and fading
    smoothly as rho leaves 1, faster for larger tau."""
    tau = torch.where(advantages > 0, temperature_pos, temperature_neg).to(ratio.dtype)     # [B, 1]
    return -advantages * torch.sigmoid(tau * (ratio - 1)) * 4 / tau


@torch.no_grad()
def vespo_weight(advantages: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                 k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float,
                 sampler_weight: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's gamma weight of each sequence (a coefficient: no gradient flows through it):

        w      = prod_t pi(y_t) / pi_old(y_t)      (times the sampler correction's weights, when given)
        phi(w) = e^lambda * w^k * e^(-lambda w)    (phi(1) = 1; k, lambda by the sign of A)

    in log space, with TRL's clamps (each token's log-ratio to +-20, log w to [log 1e-8, 20]); a weight
    that overflows counts as 0. advantages [B, 1]; logp/old_logp/mask [B, L]; sampler_weight [B, L]
    -> [B, 1]."""
    floor = math.log(1e-8)
    log_w = ((logp - old_logp).clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)              # [B, 1]
    if sampler_weight is not None:
        log_w = log_w + sampler_weight.log().clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, k_pos, k_neg)
    lam = torch.where(positive, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# -- which tokens count, and how much -------------------------------------------------------------------

def off_policy_sequence_mask(advantages: torch.Tensor, logp: torch.Tensor, sampler_logp: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2; TRL's `off_policy_mask_threshold`): a sequence with a
    negative advantage whose sampler drifted too far from the current policy gets no policy loss.

        KL_i = mean_t (sampler_logp_t - sg[logp_t])       (KL(sampler || pi), sampled-token estimate)
        keep_i = A_i >= 0  or  KL_i <= threshold

    advantages: [B, 1]; logp/sampler_logp/mask: [B, L]; NaN sampler log-probs count as no drift.
    Returns [B, 1] (1 keep, 0 drop)."""
    drift = torch.nan_to_num(sampler_logp - logp.detach(), nan=0.0)        # [B, L]
    kl = _sequence_mean(drift, mask)                                      # [B, 1]
    return ((advantages >= 0) | (kl <= threshold)).to(mask.dtype)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """Train only on the highest-entropy tokens (TRL's `top_entropy_quantile`, "80/20" forking tokens):
    keep a completion token when its entropy is >= the (1 - top_quantile) quantile of the entropies of
    this micro-batch's completion tokens (linear interpolation, torch.quantile). 1.0 keeps every token.
    entropy/mask: [B, L] -> [B, L] (1 keep, 0 drop)."""
    real = mask.bool()
    values = entropy.detach()[real].float()                               # [N]
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return ((entropy.detach() >= threshold) & real).to(mask.dtype)


@torch.no_grad()
def sampler_correction_weight(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                              mode: str, cap: float, clip_min: float | None = None) -> torch.Tensor:
    """Importance weight from the sampler to the trainer (TRL's `vllm_importance_sampling_*`): the
    rollout engine samples from pi_sampler, not exactly from the trainer's pi_old (other kernels,
    precision, top-k/top-p), so each token's loss is reweighted by pi_old / pi_sampler:

        token_*:    w_t = exp(old_logp_t - sampler_logp_t)                        [B, L]
        sequence_*: w_i = exp(sum_t (old_logp_t - sampler_logp_t))                [B, 1]
        *_truncate: w <- clip(w, clip_min, cap)             (truncated IS)
        *_mask:     w <- 0 where w > cap or w < clip_min    (masked IS)

    (`clip_min` None: no lower bound.) old_logp/sampler_logp/mask: [B, L]; a NaN sampler log-prob (a token
    the sampler gave none for) counts as ratio 1."""
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(SAMPLER_CORRECTION_MODES)}, "
                         f"not {mode!r}")
    diff = torch.nan_to_num((old_logp - sampler_logp) * mask, nan=0.0)    # [B, L]
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)                                 # [B, 1]
    weight = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(weight, min=clip_min, max=cap)
    outside = weight > cap if clip_min is None else (weight > cap) | (weight < clip_min)
    return weight.masked_fill(outside, 0.0)


# -- reduction ----------------------------------------------------------------------------------------

def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int,
              num_micro_batches: int = 1, num_tokens_in_batch: float | None = None) -> torch.Tensor:
    """Reduce one micro-batch's [B, L] per-token loss to its share of the optimizer step's loss.

    grpo, sapo:         mean over sequences of each sequence's token mean (DeepSeekMath)
    bnpo:               token mean over the micro-batch
    dr_grpo:            token sum / (B * max_completion_length) (constant normaliser, Dr. GRPO)
    luspo:              mean over sequences of each sequence's token sum (LUSPO: a sequence weighs its length)
    dapo, cispo, vespo: token sum / num_tokens_in_batch, the completion tokens the whole step trains on (DAPO)

    grpo, sapo, bnpo, dr_grpo and luspo normalise each micro-batch by itself, so the share is that value
    divided by `num_micro_batches` (as TRL divides by the gradient-accumulation steps); the dapo
    normaliser already counts the whole step's tokens, so its shares add up as they are. Without
    `num_tokens_in_batch`, dapo counts this micro-batch's tokens, which is right only when it is the
    whole step.
    """
    masked = per_token_loss * mask                                        # [B, L]
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_tokens_in_batch is None:
            if num_micro_batches != 1:
                raise ValueError(f"{loss_type} over several micro-batches needs num_tokens_in_batch (tokens per step)")
            return masked.sum() / mask.sum().clamp(min=1)
        return masked.sum() / torch.as_tensor(num_tokens_in_batch).clamp(min=1)
    if loss_type in ("grpo", "sapo"):
        micro_batch_loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        micro_batch_loss = masked.sum() / mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        micro_batch_loss = masked.sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "luspo":
        micro_batch_loss = masked.sum(-1).mean()
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {loss_type!r}")
    return micro_batch_loss / num_micro_batches


# -- the loss of one micro-batch ------------------------------------------------------------------------

def policy_loss(ratio: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor, loss_type: str,
                epsilon_low: float, epsilon_high: float, delta: float | None, sapo_temperature_pos: float,
                sapo_temperature_neg: float, vespo_phi: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token policy loss `loss_type` names: `cispo_loss` (cap epsilon_high), `sapo_loss`, VESPO's
    -sg[phi(w)] * A * logp_t (`vespo_weight`, given as `vespo_phi`), or `clipped_surrogate` (grpo, bnpo,
    dr_grpo, dapo, luspo; with `delta`). [B, L] (or [B, 1] for a sequence ratio, except cispo and vespo)."""
    if loss_type == "vespo":
        return -vespo_phi * advantages * logp
    if loss_type == "cispo":
        return cispo_loss(ratio, advantages, logp, epsilon_high)
    if loss_type == "sapo":
        return sapo_loss(ratio, advantages, sapo_temperature_pos, sapo_temperature_neg)
    return clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high, delta)


def token_weights(advantages: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, *,
                  entropy: torch.Tensor | None, top_entropy_quantile: float, sampler_logp: torch.Tensor | None,
                  off_policy_mask_threshold: float | None, sampler_correction: str | None,
                  sampler_correction_cap: float, sampler_correction_clip_min: float | None = None,
                  ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """What multiplies each token's policy loss (no gradient), in TRL's order: `off_policy_sequence_mask`
    (against `sampler_logp`, or old_logp without one), `high_entropy_mask`, then
    `sampler_correction_weight`. Returns it ([B, L]; None when nothing is enabled) and, per enabled
    part, what it did to each token (for the statistics)."""
    weight, touched = None, {}

    def times(w: torch.Tensor) -> torch.Tensor:
        return w if weight is None else weight * w

    if off_policy_mask_threshold is not None:
        behaviour = sampler_logp if sampler_logp is not None else old_logp
        keep = off_policy_sequence_mask(advantages, logp, behaviour, mask, off_policy_mask_threshold)  # [B, 1]
        weight = times(keep.expand_as(mask))
        touched["off_policy_mask/dropped_frac"] = 1 - keep.expand_as(mask)
    if top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
        keep_tokens = high_entropy_mask(entropy, mask, top_entropy_quantile)      # [B, L]
        weight = times(keep_tokens)
        touched["entropy_mask/kept_frac"] = keep_tokens
    is_weight, is_stats = _sampler_weight(old_logp, sampler_logp, mask, sampler_correction, sampler_correction_cap,
                                          sampler_correction_clip_min)
    if is_weight is not None:
        weight = times(is_weight.expand_as(mask))
        touched.update(is_stats)
    return weight, touched


def _sampler_weight(old_logp: torch.Tensor, sampler_logp: torch.Tensor | None, mask: torch.Tensor,
                    mode: str | None, cap: float,
                    clip_min: float | None = None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """`sampler_correction_weight` when `mode` names one ([B, L] or [B, 1]; else None) and its statistics."""
    if mode is None:
        return None, {}
    if sampler_logp is None:
        raise ValueError("vllm_importance_sampling_correction needs the sampler's log-probs (sampler_logp)")
    w = sampler_correction_weight(old_logp, sampler_logp, mask, mode, cap, clip_min)
    return w, {"sampler_is/weight_mean": w.expand_as(mask), "sampler_is/zeroed_frac": (w == 0).expand_as(mask)}


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, epsilon_low: float,
              epsilon_high: float, loss_type: str, max_completion_length: int, num_micro_batches: int = 1,
              num_tokens_in_batch: float | None = None, importance_sampling_level: str = "token",
              delta: float | None = None, sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              entropy: torch.Tensor | None = None, top_entropy_quantile: float = 1.0, entropy_coef: float = 0.0,
              sampler_logp: torch.Tensor | None = None, off_policy_mask_threshold: float | None = None,
              sampler_correction: str | None = None, sampler_correction_cap: float = 3.0,
              sampler_correction_clip_min: float | None = None, use_bias_correction_kl: bool = True,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
              vespo_lambda_neg: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch. logp/old_logp/ref_logp/mask/entropy/sampler_logp: [B, L];
    advantages: [B]. In order (TRL's order):

    1) ratio = `importance_ratio` at `importance_sampling_level`
    2) the per-token `policy_loss` of `loss_type` (vespo: with `vespo_weight` of the sequence, into which
       the sampler correction's weights go instead of 3))
    3) times `token_weights`: the off-policy sequence mask (`off_policy_mask_threshold`), the
       high-entropy mask (`top_entropy_quantile` < 1), the sampler correction (`sampler_correction`
       names a vllm_importance_sampling_mode; bounds: _clip_min, _cap; needs sampler_logp)
    4) + beta * KL_k3(pi || ref), times the ratio of 1) (before `delta` caps it) with
       `use_bias_correction_kl`
    5) `aggregate` as loss_type says
    6) - entropy_coef * `entropy_bonus` / num_micro_batches (`entropy` must carry its gradient)

    Returns this micro-batch's share of the step's loss (call backward on it, and sum it over the
    step's micro-batches for the step's loss) and detached statistics of this micro-batch (masked token
    means)."""
    advantages = advantages.unsqueeze(1)                                  # [B, 1]
    ratio = importance_ratio(logp, old_logp, mask, importance_sampling_level)       # [B, L] or [B, 1]
    phi, folded = None, {}
    if loss_type == "vespo":                        # the sampler correction goes into phi, not per token
        sampler_weight, folded = _sampler_weight(old_logp, sampler_logp, mask, sampler_correction,
                                                 sampler_correction_cap, sampler_correction_clip_min)
        phi = vespo_weight(advantages, logp, old_logp, mask, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                           vespo_lambda_neg, sampler_weight)                                   # [B, 1]
        sampler_correction = None
    per_token_loss = policy_loss(ratio, advantages, logp, loss_type, epsilon_low, epsilon_high, delta,
                                 sapo_temperature_pos, sapo_temperature_neg, phi)
    weight, touched = token_weights(
        advantages, logp, old_logp, mask, entropy=entropy, top_entropy_quantile=top_entropy_quantile,
        sampler_logp=sampler_logp, off_policy_mask_threshold=off_policy_mask_threshold,
        sampler_correction=sampler_correction, sampler_correction_cap=sampler_correction_cap,
        sampler_correction_clip_min=sampler_correction_clip_min)
    touched.update(folded)
    if phi is not None:
        touched["vespo/phi_seq_mean"] = phi                           # [B, 1]: a mean over sequences
    if weight is not None:
        per_token_loss = per_token_loss * weight                          # [B, L]
    kl = None
    if beta != 0.0:
        kl = kl_term(logp, ref_logp, ratio, use_bias_correction_kl)       # [B, L]
        per_token_loss = per_token_loss + beta * kl
    loss = aggregate(per_token_loss, mask, loss_type, max_completion_length, num_micro_batches,
                     num_tokens_in_batch)
    if entropy_coef != 0.0:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs the per-token entropy with its gradient")
        loss = loss - entropy_coef * entropy_bonus(entropy, mask, top_entropy_quantile) / num_micro_batches
    return loss, _statistics(ratio, advantages, mask, kl, touched, loss_type, epsilon_low, epsilon_high)


@torch.no_grad()
def _statistics(ratio, advantages, mask, kl, touched, loss_type, epsilon_low, epsilon_high) -> dict[str, float]:
    """Masked token means (as TRL logs them): how often the ratio was clipped (by the hard clip, or by
    CISPO's cap; SAPO has no hard clip; a sequence ratio counts for each of its tokens), the KL, and the
    fractions each enabled mask or weight touched."""
    num_tokens = mask.sum().clamp(min=1)

    def token_mean(x):                                                    # [B, L], or [B, 1]: one per sequence
        if x.size(1) == 1 < mask.size(1):
            return x.float().mean().item()
        return ((x.float() * mask).sum() / num_tokens).item()

    ratio = ratio.detach().expand_as(mask)      # [B, L]: token-weighted, so data-parallel shares add up
    none = torch.zeros_like(ratio, dtype=torch.bool)
    if loss_type == "cispo":
        is_low_clipped, is_high_clipped = none, (ratio > epsilon_high) & (advantages > 0)
    elif loss_type in ("sapo", "vespo"):
        is_low_clipped = is_high_clipped = none
    else:
        is_low_clipped = (ratio < 1 - epsilon_low) & (advantages < 0)     # [B, L]
        is_high_clipped = (ratio > 1 + epsilon_high) & (advantages > 0)   # [B, L]
    stats = {"clip_ratio/low_mean": token_mean(is_low_clipped),
             "clip_ratio/high_mean": token_mean(is_high_clipped),
             "clip_ratio/region_mean": token_mean(is_low_clipped | is_high_clipped),
             "kl": token_mean(kl) if kl is not None else 0.0}
    stats.update({name: token_mean(value) for name, value in touched.items()})
    return stats
