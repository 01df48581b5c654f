"""The GRPO update over one scored rollout batch: advantages, old/reference log-probs, clipped steps.

Pure torch: takes a Policy, an optimizer, a scheduler and the scored samples; returns per-step metrics.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from grpo_core.logprobs import completion_logprobs
from grpo_core.loss import grpo_loss, group_advantages, zero_std_groups
from grpo_core.config import GRPOConfig
from grpo_core.policy import Policy


@dataclass
class ScoredSample:
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    truncated: bool


def make_optimizer(policy: Policy, cfg: GRPOConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                             betas=(cfg.adam_beta1, cfg.adam_beta2))


def total_optimizer_steps(cfg: GRPOConfig) -> int:
    return cfg.pipeline_iterations * cfg.steps_per_iteration * cfg.num_iterations


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: GRPOConfig) -> torch.optim.lr_scheduler.LambdaLR:
    total = total_optimizer_steps(cfg)
    warmup = int(round(cfg.warmup_ratio * total))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def keep_complete_groups(samples: Sequence[ScoredSample | None], group_size: int) -> list[ScoredSample]:
    """Drop groups where a sample could not be scored (None) or that lost members; keep order."""
    by_group: dict[int, list[ScoredSample]] = {}
    bad: set[int] = set()
    for i, s in enumerate(samples):
        if s is None:
            bad.add(i // group_size)
        else:
            by_group.setdefault(s.group, []).append(s)
    return [s for g, members in by_group.items() if len(members) == group_size and g not in bad for s in members]


def pad_batch(samples: Sequence[ScoredSample], pad_id: int, device: torch.device):
    """[left-padded prompt | right-padded completion] rows.

    Returns input_ids [B, T], attention_mask [B, T], completion_mask [B, Lc].
    """
    p_len = max(len(s.prompt_ids) for s in samples)
    c_len = max(max(len(s.completion_ids) for s in samples), 1)
    B = len(samples)
    input_ids = torch.full((B, p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros((B, p_len + c_len), dtype=torch.long)
    c_mask = torch.zeros((B, c_len), dtype=torch.float32)
    for r, s in enumerate(samples):
        p, c = s.prompt_ids, s.completion_ids
        input_ids[r, p_len - len(p):p_len] = torch.tensor(p)
        attn[r, p_len - len(p):p_len] = 1
        if c:
            input_ids[r, p_len:p_len + len(c)] = torch.tensor(c)
            attn[r, p_len:p_len + len(c)] = 1
            c_mask[r, :len(c)] = 1
    return input_ids.to(device), attn.to(device), c_mask.to(device)


@torch.no_grad()
def _logprobs_no_grad(model, batch, temperature: float, chunk_rows: int, group_size: int) -> torch.Tensor:
    input_ids, attn, c_mask = batch
    return completion_logprobs(model, input_ids, attn, c_mask.size(1), temperature, chunk_rows=chunk_rows,
                               group_size=group_size)[0]


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated (CUDA) or peak resident set size of this process (CPU), in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6      # Linux reports KiB


def plan_steps(kept: Sequence[ScoredSample], G: int, steps_per_iteration: int, grad_accum: int,
               seed: int) -> list[list[list[int]]]:
    """Whole groups -> optimizer steps -> micro-batches of sample indices.

    Groups are shuffled into `steps_per_iteration` steps; inside a step they are sorted by length and
    cut into `grad_accum` contiguous micro-batches, so each micro-batch pads to similar lengths.
    """
    groups = list(range(len(kept) // G))
    random.Random(seed).shuffle(groups)
    steps = [groups[i::steps_per_iteration] for i in range(steps_per_iteration)]
    plan = []
    for step_groups in (s for s in steps if s):
        step_groups = sorted(step_groups, key=lambda g: max(len(kept[g * G + j].completion_ids) for j in range(G)))
        n = len(step_groups)
        cuts = [round(i * n / grad_accum) for i in range(grad_accum + 1)]
        chunks = [step_groups[cuts[i]:cuts[i + 1]] for i in range(grad_accum)]
        plan.append([[g * G + j for g in chunk for j in range(G)] for chunk in chunks if chunk])
    return plan


def grpo_update(policy: Policy, optimizer, scheduler, samples: Sequence[ScoredSample | None],
                cfg: GRPOConfig, seed: int, progress=None) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Run steps_per_iteration x num_iterations optimizer steps on one rollout batch.

    `samples` are laid out group-contiguously (G = cfg.num_generations per group); a None entry (not
    scorable) removes its whole group. Returns (per-step metrics, batch-level metrics).
    """
    G = cfg.num_generations
    device = policy.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    kept = keep_complete_groups(samples, G)
    n_groups_in = len(samples) // G
    batch_stats = {"groups_total": float(n_groups_in), "groups_unscorable": float(n_groups_in - len(kept) // G)}
    if not kept:
        return [], batch_stats
    rewards_all = torch.tensor([s.reward for s in kept], dtype=torch.float32)             # [N]
    lengths = [len(s.completion_ids) for s in kept]
    batch_stats.update({
        "frac_reward_zero_std": zero_std_groups(rewards_all, G).float().mean().item(),
        "reward_std": rewards_all.std().item() if len(kept) > 1 else 0.0,
        "completion_length_mean": sum(lengths) / len(lengths), "completion_length_min": float(min(lengths)),
        "completion_length_max": float(max(lengths)),
        "truncated_frac": sum(s.truncated for s in kept) / len(kept)})
    advantages = group_advantages(rewards_all, G, cfg.scale_rewards)                       # [N]
    pad_id = policy.tokenizer.pad_token_id
    model = policy.model
    chunk = cfg.logit_chunk_rows

    def batch_of(idx: list[int]):
        rows = [kept[i] for i in idx]
        batch = pad_batch(rows, pad_id, device)
        if cfg.mask_truncated_completions:                      # truncated answers: no loss, no token count
            trunc = torch.tensor([r.truncated for r in rows], device=device)
            batch = (batch[0], batch[1], batch[2] * (~trunc).float().unsqueeze(1))
        return batch

    plan = plan_steps(kept, G, cfg.steps_per_iteration, cfg.gradient_accumulation_steps, seed)
    # DAPO normalises by the completion tokens of the whole generation batch, spread evenly over the
    # optimizer steps it feeds (TRL: num_items_in_batch * grad_accum / steps_per_generation).
    batches = {tuple(idx): batch_of(idx) for step in plan for idx in step}
    total_tokens = sum(b[2].sum().item() for b in batches.values())
    dapo_norm = max(total_tokens, 1.0) / len(plan)

    # Old log-probs only when the policy moves before a sample is used (mu > 1 or several steps per
    # rollout); otherwise the ratio is exactly 1 and logp.detach() stands in. Reference only when beta > 0.
    need_old = cfg.num_iterations > 1 or len(plan) > 1
    old_lp: dict[tuple, torch.Tensor] = {}
    ref_lp: dict[tuple, torch.Tensor] = {}
    t_old = t_ref = 0.0
    model.eval()
    for key, batch in batches.items():
        if need_old:
            t = time.perf_counter()
            old_lp[key] = _logprobs_no_grad(model, batch, cfg.temperature, chunk, G)
            t_old += time.perf_counter() - t
        if cfg.beta != 0.0:
            t = time.perf_counter()
            with policy.reference() as ref_model:
                ref_lp[key] = _logprobs_no_grad(ref_model, batch, cfg.temperature, chunk, G)
            t_ref += time.perf_counter() - t
    batch_stats.update({"reference_seconds": t_ref, "old_logprob_seconds": t_old, "num_tokens": total_tokens})

    model.train()
    step_metrics = []
    params = policy.trainable_parameters()
    for _ in range(cfg.num_iterations):
        for step_mbs in plan:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            step_tokens = sum(batches[tuple(idx)][2].sum().item() for idx in step_mbs)
            acc: dict[str, float] = {}
            n_mb = len(step_mbs)
            for idx in step_mbs:
                key = tuple(idx)
                input_ids, attn, c_mask = batches[key]
                logp, ent = completion_logprobs(model, input_ids, attn, c_mask.size(1), cfg.temperature,
                                                with_entropy=True, chunk_rows=chunk, group_size=G)  # [b, Lc]
                old = old_lp[key] if need_old else logp.detach()
                loss, stats = grpo_loss(
                    logp, old, ref_lp.get(key), advantages[idx].to(device), c_mask, beta=cfg.beta,
                    epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_upper, loss_type=cfg.loss_type,
                    max_completion_length=cfg.max_completion_length, num_tokens_in_batch=dapo_norm)
                # grpo/bnpo/dr_grpo average over accumulated micro-batches (TRL divides by grad-accum
                # steps); dapo's normaliser already counts the tokens of the whole step.
                (loss if cfg.loss_type == "dapo" else loss / n_mb).backward()
                stats["entropy"] = ((ent * c_mask).sum() / c_mask.sum().clamp(min=1)).item()
                stats["loss"] = loss.item() * (n_mb if cfg.loss_type == "dapo" else 1)  # dapo: sum of parts
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0.0) + v / n_mb
                del logp, loss
            grad_norm = torch.nn.utils.clip_grad_norm_(
                params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")).item()
            optimizer.step()
            scheduler.step()
            dt = time.perf_counter() - t0
            acc.update({"grad_norm": grad_norm, "learning_rate": scheduler.get_last_lr()[0],
                        "step_seconds": dt, "step_tokens": step_tokens,
                        "peak_memory_gb": peak_memory_gb(device)})
            step_metrics.append(acc)
            if progress is not None:
                progress.update(1)
    return step_metrics, batch_stats
