"""The GRPO objective, top to bottom: group-relative advantages, the k3 KL to the reference, the
clipped surrogate, and how each published variant reduces per-token losses to one number.

Notation: B = sequences in the batch (prompts x G), G = group size, L = completion length (padded).
Per-token ratio rho = exp(logp - old_logp); per-token loss
    -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * KL_k3(ref || pi)
aggregated over tokens according to `loss_type` (DeepSeekMath GRPO, BNPO, Dr. GRPO, DAPO).
Pure functions on tensors; where the log-probs come from is `grpo_core.logprobs`.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (std + eps), with the std of the group, of the batch, or none (Dr. GRPO).

    rewards: [B] with groups laid out contiguously (B = num_groups * group_size). Returns [B].
    """
    grouped = rewards.view(-1, group_size)                                # [B/G, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)                 # [B/G, G]
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)      # unbiased std, as TRL
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    return centred.reshape(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B/G] bool: groups whose rewards are all equal (they carry no learning signal)."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values).abs() < 1e-8


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0). [B, L]."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int, num_tokens_in_batch: float | None = None) -> torch.Tensor:
    """Reduce a [B, L] per-token loss to a scalar as each published variant does.

    grpo:    mean over sequences of the per-sequence token mean (DeepSeekMath)
    bnpo:    token mean over this batch
    dr_grpo: token sum / (B * max_completion_length) (constant normaliser, Dr. GRPO)
    dapo:    token sum / number of completion tokens in the whole generation batch (DAPO)
    """
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length)
    if loss_type == "dapo":
        denom = mask.sum() if num_tokens_in_batch is None else torch.as_tensor(num_tokens_in_batch)
        return masked.sum() / denom.clamp(min=1)
    raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, not {loss_type!r}")


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, *, beta: float, epsilon_low: float,
              epsilon_high: float, loss_type: str, max_completion_length: int,
              num_tokens_in_batch: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate + beta * k3 KL. logp/old_logp/ref_logp/mask: [B, L]; advantages: [B].

    Returns the scalar loss and detached statistics (masked token means).
    """
    adv = advantages.unsqueeze(1)                                          # [B, 1]
    ratio = torch.exp(logp - old_logp)                                     # [B, L]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)        # [B, L]
    per_token = -torch.min(ratio * adv, clipped * adv)                     # [B, L]
    kl = None
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + beta * kl
    loss = aggregate(per_token, mask, loss_type, max_completion_length, num_tokens_in_batch)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        mean = lambda x: ((x.float() * mask).sum() / n).item()
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        stats = {"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                 "clip_ratio/region_mean": mean(low | high), "kl": mean(kl) if kl is not None else 0.0}
    return loss, stats
