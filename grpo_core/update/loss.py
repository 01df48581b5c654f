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
on-policy, its gradient is not. Every option sits in one `LossSettings` (built from the config by
`LossSettings.of`), every loss type in one table, `LOSS_TYPES` (its per-token objective and its reduction),
and `grpo_loss` applies them in numbered steps, in TRL's order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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


# -- the settings: every knob of the objective, built from the config once ----------------------------

@dataclass(frozen=True)
class LossSettings:
    """What `grpo_loss` computes, named as TRL's `GRPOConfig` and trainer name it (`LossSettings.of(cfg)` builds it
    from a run's config). What changes from one micro-batch to the next (the tensors, the step's token count) is
    passed to `grpo_loss` itself."""
    loss_type: str                                # a name in LOSS_TYPES: the per-token objective and its reduction
    beta: float                                   # KL weight to the reference (0: no reference log-probs needed)
    epsilon_low: float                            # clip range below 1 (the config's `epsilon`)
    epsilon_high: float                           # clip range above 1; cispo's cap of the IS weight
    max_completion_length: int                    # dr_grpo's constant normaliser
    importance_sampling_level: str = "token"      # `importance_ratio`: token, sequence (GSPO), sequence_token
    delta: float | None = None                    # two-sided clipping of the clipped surrogate (INTELLECT-2)
    sapo_temperature_pos: float = 1.0             # `sapo_loss`'s gate temperatures
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0                      # `vespo_weight`'s k and lambda, by the sign of the advantage
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0             # `high_entropy_mask` (1.0: every token)
    entropy_coef: float = 0.0                     # `entropy_bonus` weight (needs the entropy with its gradient)
    off_policy_mask_threshold: float | None = None          # `off_policy_sequence_mask` (None: off)
    sampler_correction: str | None = None         # a vllm_importance_sampling_mode (None: no sampler correction)
    sampler_correction_cap: float = 3.0           # its bounds (`sampler_correction_weight`)
    sampler_correction_clip_min: float | None = None
    use_bias_correction_kl: bool = True           # `kl_term`: the k3 KL times the ratio

    @classmethod
    def of(cls, cfg) -> "LossSettings":
        """The settings a run's `grpo_core.config.GRPOConfig` describes: the one place the config's names become
        the loss's (epsilon -> epsilon_low, vllm_importance_sampling_* -> sampler_correction_*)."""
        return cls(
            loss_type=cfg.loss_type, beta=cfg.beta, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high,
            max_completion_length=cfg.max_completion_length, importance_sampling_level=cfg.importance_sampling_level,
            delta=cfg.delta, sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
            vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
            vespo_lambda_neg=cfg.vespo_lambda_neg, top_entropy_quantile=cfg.top_entropy_quantile,
            entropy_coef=cfg.entropy_coef, off_policy_mask_threshold=cfg.off_policy_mask_threshold,
            sampler_correction=cfg.vllm_importance_sampling_mode if cfg.vllm_importance_sampling_correction else None,
            sampler_correction_cap=cfg.vllm_importance_sampling_cap,
            sampler_correction_clip_min=cfg.vllm_importance_sampling_clip_min,
            use_bias_correction_kl=cfg.use_bias_correction_kl)


@dataclass(frozen=True)
class PolicyInputs:
    """What a loss type's per-token objective sees of one micro-batch."""
    ratio: torch.Tensor                   # [B, L] or [B, 1]: `importance_ratio` at the settings' level
    advantages: torch.Tensor              # [B, 1]
    logp: torch.Tensor                    # [B, L], with its gradient
    old_logp: torch.Tensor                # [B, L]
    mask: torch.Tensor                    # [B, L]
    sampler_weight: torch.Tensor | None   # [B, L] or [B, 1]: the sampler correction, for a type that folds it in


# -- reductions: a micro-batch's masked per-token losses [B, L] -> one number ---------------------------

def sequence_mean(masked: torch.Tensor, mask: torch.Tensor, max_completion_length: int,
                  num_tokens_in_batch: float | None) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean (DeepSeekMath)."""
    return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def token_mean(masked: torch.Tensor, mask: torch.Tensor, max_completion_length: int,
               num_tokens_in_batch: float | None) -> torch.Tensor:
    """Token mean over the micro-batch."""
    return masked.sum() / mask.sum().clamp(min=1)


def fixed_length(masked: torch.Tensor, mask: torch.Tensor, max_completion_length: int,
                 num_tokens_in_batch: float | None) -> torch.Tensor:
    """Token sum / (B * max_completion_length): a constant normaliser (Dr. GRPO)."""
    return masked.sum() / (masked.size(0) * max_completion_length)


def sequence_sum(masked: torch.Tensor, mask: torch.Tensor, max_completion_length: int,
                 num_tokens_in_batch: float | None) -> torch.Tensor:
    """Mean over sequences of each sequence's token sum (LUSPO: a sequence weighs its length)."""
    return masked.sum(-1).mean()


def step_token_mean(masked: torch.Tensor, mask: torch.Tensor, max_completion_length: int,
                    num_tokens_in_batch: float | None) -> torch.Tensor:
    """Token sum / the completion tokens the whole step trains on (DAPO); this micro-batch's without the count."""
    tokens = mask.sum() if num_tokens_in_batch is None else torch.as_tensor(num_tokens_in_batch)
    return masked.sum() / tokens.clamp(min=1)


@dataclass(frozen=True)
class Reduction:
    """A reduction and what it divides by: this micro-batch's "sequences" or "tokens" (then each micro-batch is
    normalised by itself, and its share of the step is that over the number of micro-batches; a data-parallel
    process's part is reweighed by its fraction of them, `grpo_core.update.step.shard_loss_weight`), or None:
    the step's token count, which every micro-batch and process already shares."""
    reduce: Callable[[torch.Tensor, torch.Tensor, int, float | None], torch.Tensor]
    normaliser: str | None


# -- per-token objectives: (PolicyInputs, LossSettings) -> ([B, L] loss, statistics it measured) ---------------

Objective = Callable[[PolicyInputs, LossSettings], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def clipped_objective(x: PolicyInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """grpo, bnpo, dr_grpo, dapo, luspo: `clipped_surrogate` (two-sided with `delta`)."""
    return clipped_surrogate(x.ratio, x.advantages, s.epsilon_low, s.epsilon_high, s.delta), {}


def cispo_objective(x: PolicyInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`cispo_loss`, the IS weight capped at epsilon_high."""
    return cispo_loss(x.ratio, x.advantages, x.logp, s.epsilon_high), {}


def sapo_objective(x: PolicyInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`sapo_loss` with the settings' temperatures."""
    return sapo_loss(x.ratio, x.advantages, s.sapo_temperature_pos, s.sapo_temperature_neg), {}


def vespo_objective(x: PolicyInputs, s: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg[phi(w)] * A * logp_t, phi the `vespo_weight` of the sequence (the sampler correction folded into w)."""
    phi = vespo_weight(x.advantages, x.logp, x.old_logp, x.mask, s.vespo_k_pos, s.vespo_lambda_pos, s.vespo_k_neg,
                       s.vespo_lambda_neg, x.sampler_weight)                                        # [B, 1]
    return -phi * x.advantages * x.logp, {"vespo/phi_seq_mean": phi}         # phi: a mean over sequences


# -- which tokens a clip statistic counts: (ratio [B, L], advantages [B, 1], settings) -> (low, high) [B, L] ---

def surrogate_clipped(ratio: torch.Tensor, advantages: torch.Tensor, s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens whose clipped term won: below 1 - eps_low with A < 0, above 1 + eps_high with A > 0."""
    return (ratio < 1 - s.epsilon_low) & (advantages < 0), (ratio > 1 + s.epsilon_high) & (advantages > 0)


def cispo_capped(ratio: torch.Tensor, advantages: torch.Tensor, s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's cap (epsilon_high itself), on the positive-advantage tokens; no lower bound."""
    return torch.zeros_like(ratio, dtype=torch.bool), (ratio > s.epsilon_high) & (advantages > 0)


def never_clipped(ratio: torch.Tensor, advantages: torch.Tensor, s: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """No hard clip (SAPO's soft gate, VESPO's smooth weight)."""
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return none, none


# -- the loss types -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LossType:
    """One `loss_type`: its per-token objective, its reduction, what its clip statistics count, and whether the
    sampler correction's weight goes into the objective (VESPO: into the sequence's weight) instead of
    multiplying each token's loss."""
    objective: Objective
    reduction: Reduction
    clip_region: Callable[[torch.Tensor, torch.Tensor, LossSettings], tuple[torch.Tensor, torch.Tensor]] = never_clipped
    folds_sampler_correction: bool = False


SEQUENCE_MEAN = Reduction(sequence_mean, "sequences")
TOKEN_MEAN = Reduction(token_mean, "tokens")
FIXED_LENGTH = Reduction(fixed_length, "sequences")
SEQUENCE_SUM = Reduction(sequence_sum, "sequences")
STEP_TOKEN_MEAN = Reduction(step_token_mean, None)

# Every loss type, by the name `loss_type` takes (the config accepts exactly these). To add one: a per-token
# objective above (its formula in the docstring) and its line here.
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_objective, SEQUENCE_MEAN, surrogate_clipped),
    "bnpo": LossType(clipped_objective, TOKEN_MEAN, surrogate_clipped),
    "dr_grpo": LossType(clipped_objective, FIXED_LENGTH, surrogate_clipped),
    "dapo": LossType(clipped_objective, STEP_TOKEN_MEAN, surrogate_clipped),
    "cispo": LossType(cispo_objective, STEP_TOKEN_MEAN, cispo_capped),
    "sapo": LossType(sapo_objective, SEQUENCE_MEAN),
    "luspo": LossType(clipped_objective, SEQUENCE_SUM, surrogate_clipped),
    "vespo": LossType(vespo_objective, STEP_TOKEN_MEAN, folds_sampler_correction=True),
}


def loss_type_named(name: str) -> LossType:
    """The entry of LOSS_TYPES called `name`; a ValueError naming the known ones otherwise."""
    if name not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {name!r}")
    return LOSS_TYPES[name]


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int,
              num_micro_batches: int = 1, num_tokens_in_batch: float | None = None) -> torch.Tensor:
    """Reduce one micro-batch's [B, L] per-token loss to its share of the optimizer step's loss, by the loss
    type's `Reduction`:

    grpo, sapo:         `sequence_mean`      bnpo:  `token_mean`      dr_grpo: `fixed_length`
    luspo:              `sequence_sum`       dapo, cispo, vespo: `step_token_mean`

    A reduction normalised by the micro-batch itself is divided by `num_micro_batches` (as TRL divides by the
    gradient-accumulation steps); the step-token normaliser already counts the whole step's tokens, so its
    shares add up as they are. Without `num_tokens_in_batch` it counts this micro-batch's tokens, which is
    right only when it is the whole step.
    """
    reduction = loss_type_named(loss_type).reduction
    masked = per_token_loss * mask                                        # [B, L]
    if reduction.normaliser is None:
        if num_tokens_in_batch is None and num_micro_batches != 1:
            raise ValueError(f"{loss_type} over several micro-batches needs num_tokens_in_batch (tokens per step)")
        return reduction.reduce(masked, mask, max_completion_length, num_tokens_in_batch)
    return reduction.reduce(masked, mask, max_completion_length, num_tokens_in_batch) / num_micro_batches


# -- the loss of one micro-batch ------------------------------------------------------------------------

def token_weights(x: PolicyInputs, s: LossSettings, entropy: torch.Tensor | None, sampler_logp: torch.Tensor | None,
                  sampler_weight: torch.Tensor | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """What multiplies each token's policy loss (no gradient), in TRL's order: `off_policy_sequence_mask`
    (against `sampler_logp`, or old_logp without one), `high_entropy_mask`, then the sampler correction's
    `sampler_weight` (given unless the loss type folds it in). Returns it ([B, L]; None when nothing is
    enabled) and, per enabled mask, what it did to each token (for the statistics)."""
    weight, touched = None, {}

    def times(w: torch.Tensor) -> torch.Tensor:
        return w if weight is None else weight * w

    if s.off_policy_mask_threshold is not None:
        behaviour = sampler_logp if sampler_logp is not None else x.old_logp
        keep = off_policy_sequence_mask(x.advantages, x.logp, behaviour, x.mask, s.off_policy_mask_threshold)  # [B, 1]
        weight = times(keep.expand_as(x.mask))
        touched["off_policy_mask/dropped_frac"] = 1 - keep.expand_as(x.mask)
    if s.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
        keep_tokens = high_entropy_mask(entropy, x.mask, s.top_entropy_quantile)      # [B, L]
        weight = times(keep_tokens)
        touched["entropy_mask/kept_frac"] = keep_tokens
    if sampler_weight is not None:
        weight = times(sampler_weight.expand_as(x.mask))
    return weight, touched


def _sampler_weight(old_logp: torch.Tensor, sampler_logp: torch.Tensor | None, mask: torch.Tensor,
                    s: LossSettings) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """`sampler_correction_weight` when the settings name a mode ([B, L] or [B, 1]; else None) and its statistics."""
    if s.sampler_correction is None:
        return None, {}
    if sampler_logp is None:
        raise ValueError("vllm_importance_sampling_correction needs the sampler's log-probs (sampler_logp)")
    w = sampler_correction_weight(old_logp, sampler_logp, mask, s.sampler_correction, s.sampler_correction_cap,
                                  s.sampler_correction_clip_min)
    return w, {"sampler_is/weight_mean": w.expand_as(mask), "sampler_is/zeroed_frac": (w == 0).expand_as(mask)}


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, s: LossSettings, *, num_micro_batches: int = 1,
              num_tokens_in_batch: float | None = None, entropy: torch.Tensor | None = None,
              sampler_logp: torch.Tensor | None = None, loss_weight: float = 1.0,
              entropy_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch. logp/old_logp/ref_logp/mask/entropy/sampler_logp: [B, L]; advantages: [B].
    `num_micro_batches` and `num_tokens_in_batch`: the step's (`aggregate`); `loss_weight` and `entropy_weight`:
    this process's part of the micro-batch's policy loss and entropy bonus (data parallel; 1 for the whole).

    Returns this micro-batch's share of the step's loss (call backward on it, and sum it over the step's
    micro-batches for the step's loss) and detached statistics of this micro-batch (masked token means)."""
    kind = loss_type_named(s.loss_type)
    advantages = advantages.unsqueeze(1)                                                  # [B, 1]
    # 1) the importance ratio to the rollout policy, and the sampler's to the trainer's
    ratio = importance_ratio(logp, old_logp, mask, s.importance_sampling_level)           # [B, L] or [B, 1]
    sampler_weight, touched_by_sampler = _sampler_weight(old_logp, sampler_logp, mask, s)
    folded = sampler_weight if kind.folds_sampler_correction else None
    x = PolicyInputs(ratio, advantages, logp, old_logp, mask, folded)
    # 2) the per-token objective of the loss type
    per_token_loss, measured = kind.objective(x, s)                                       # [B, L]
    # 3) times the masks and weights that decide which tokens count
    weight, touched = token_weights(x, s, entropy, sampler_logp, None if folded is not None else sampler_weight)
    touched.update(touched_by_sampler)
    touched.update(measured)
    if weight is not None:
        per_token_loss = per_token_loss * weight                                          # [B, L]
    # 4) + beta * the KL to the reference, weighted by the ratio of 1) (before delta caps it)
    kl = None
    if s.beta != 0.0:
        kl = kl_term(logp, ref_logp, ratio, s.use_bias_correction_kl)                     # [B, L]
        per_token_loss = per_token_loss + s.beta * kl
    # 5) reduced as the loss type says
    loss = aggregate(per_token_loss, mask, s.loss_type, s.max_completion_length, num_micro_batches,
                     num_tokens_in_batch)
    if loss_weight != 1.0:
        loss = loss * loss_weight
    # 6) - the entropy bonus: a token mean whatever the loss type (TRL), over the step's micro-batches
    if s.entropy_coef != 0.0:
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs the per-token entropy with its gradient")
        bonus = entropy_bonus(entropy, mask, s.top_entropy_quantile) / num_micro_batches
        loss = loss - s.entropy_coef * bonus * entropy_weight
    return loss, _statistics(ratio, advantages, mask, kl, touched, kind, s)


@torch.no_grad()
def _statistics(ratio, advantages, mask, kl, touched, kind: LossType, s: LossSettings) -> dict[str, float]:
    """Masked token means (as TRL logs them): how often the ratio was clipped (the loss type's `clip_region`;
    a sequence ratio counts for each of its tokens), the KL, and the fractions each enabled mask or weight
    touched."""
    num_tokens = mask.sum().clamp(min=1)

    def token_mean(x):                                                    # [B, L], or [B, 1]: one per sequence
        if x.size(1) == 1 < mask.size(1):
            return x.float().mean().item()
        return ((x.float() * mask).sum() / num_tokens).item()

    ratio = ratio.detach().expand_as(mask)      # [B, L]: token-weighted, so data-parallel shares add up
    is_low_clipped, is_high_clipped = kind.clip_region(ratio, advantages, s)                 # [B, L] each
    stats = {"clip_ratio/low_mean": token_mean(is_low_clipped),
             "clip_ratio/high_mean": token_mean(is_high_clipped),
             "clip_ratio/region_mean": token_mean(is_low_clipped | is_high_clipped),
             "kl": token_mean(kl) if kl is not None else 0.0}
    stats.update({name: token_mean(value) for name, value in touched.items()})
    return stats
