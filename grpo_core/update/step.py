"""The GRPO update over one scored rollout batch: advantages, old/reference log-probs, clipped steps.

Pure torch: takes a Policy, an optimizer, a scheduler and the scored samples; returns per-step metrics.
The objective itself is `grpo_core.update.loss`; this module decides which samples form each optimizer step
and micro-batch, which frozen log-probs are needed, and runs the steps. It does not checkpoint or log.
Groups that lost members (a sample that could not be scored) train on their survivors.
Data parallel (`grpo_core.parallel.DataParallel`): every process plans the same steps from the whole batch, trains on its
share of each micro-batch's groups, and the summed gradients are the gradients of one process.
`cfg` is the run's GRPOConfig (grpo_core/config.py), read by field: the config sits above this room."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from grpo_core.update.logprobs import completion_logprobs, router_loss_logprobs
from grpo_core.update.loss import (LossSettings, applied_entropy_coef, decoupled_advantages, grpo_loss, group_advantages,
                            high_entropy_mask, loss_type_named, next_entropy_coef, zero_std_groups)
from grpo_core.plugins import metric_names
from grpo_core.model.loading import router_aux_coef
from grpo_core.model.policy import Policy
from grpo_core.parallel import DataParallel
from grpo_core.rewards.rewards import model_token_count

@dataclass
class ScoredSample:
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float | None                        # None: could not be scored (the sample is left out)
    truncated: bool
    sampler_logprobs: list[float] | None = None  # log-prob of each completion token under the sampler
    completion_mask: list[int] | None = None    # multi-turn: 1 on the model's tokens, 0 on tool turns (no loss)
    rewards_per_func: dict[str, float | None] | None = None   # each reward function's score (metric name -> score)

    @property
    def model_tokens(self) -> int:
        """The completion tokens the model wrote (a tool turn's are context, not the model's)."""
        return model_token_count(self.completion_ids, self.completion_mask)


@dataclass
class MicroBatch:
    """The padded rows of one micro-batch and what its loss needs besides the current log-probs."""
    input_ids: torch.Tensor                    # [b, T] left-padded prompt | right-padded completion
    attention_mask: torch.Tensor               # [b, T]
    completion_mask: torch.Tensor              # [b, Lc] 1 on completion tokens that get a loss
    advantages: torch.Tensor                   # [b]
    group_size: int = 1                        # rows come in contiguous groups of this size sharing a prompt
    sampler_logp: torch.Tensor | None = None   # [b, Lc] the sampler's log-probs (NaN where it gave none)
    old_logp: torch.Tensor | None = None       # [b, Lc] when the policy moves before the batch is used
    ref_logp: torch.Tensor | None = None       # [b, Lc] when beta > 0
    loss_weight: float = 1.0                   # this process's part of the whole micro-batch's loss (data parallel)
    entropy_weight: float = 1.0                # ... of its loss tokens: the part of the entropy bonus (a token mean)
    stand_in: bool = False                     # rows run only so that every process runs the same steps


def make_optimizer(policy: Policy, cfg) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, multi-tensor (foreach) on every device: on the CPU torch's default
    is a loop per parameter, slower for a LoRA's many small factors. (Not `fused`: its in-place update does not
    bump the parameters' version counters, by which the sampler knows that weights changed.)"""
    return torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), foreach=True)


@torch.no_grad()
def relative_change(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> float:
    """||after - before|| / ||before|| over all the tensors together: how far an update moved the weights."""
    moved = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(after, before))
    size = sum(float(b.double().square().sum()) for b in before)
    return math.sqrt(moved / size) if size > 0 else math.sqrt(moved)


def total_optimizer_steps(cfg) -> int:
    return cfg.pipeline_iterations * cfg.steps_per_iteration * cfg.num_iterations


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient from step to step: `entropy_coef` throughout, or with
    `use_adaptive_entropy` (Skywork-OR1, as TRL) the coefficient `coef`, moved by `entropy_coef_delta` after
    every optimizer step (`next_entropy_coef`) and applied while the entropy the last step measured is at
    or below `entropy_target` (`applied_entropy_coef`). Its state (coef, last_entropy) goes into
    checkpoints with the scheduler's (`Schedule`), so a resumed run continues where it stopped."""
    coef: float
    adaptive: bool = False
    last_entropy: float = math.inf             # none measured yet: the first step applies no bonus

    @classmethod
    def of(cls, cfg) -> "EntropyControl":
        return cls(cfg.entropy_coef, cfg.use_adaptive_entropy)

    def applied(self, cfg) -> float:
        """The coefficient this step's loss uses."""
        return applied_entropy_coef(self.coef, self.last_entropy, cfg.entropy_target) if self.adaptive else self.coef

    def observe(self, entropy: float, cfg) -> None:
        """After a step that measured `entropy` (adaptive only)."""
        if self.adaptive:
            self.coef = next_entropy_coef(self.coef, entropy, cfg.entropy_target, cfg.entropy_coef_delta,
                                          cfg.entropy_coef_min, cfg.entropy_coef_max)
            self.last_entropy = entropy

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if self.adaptive:                      # a fixed coefficient is the config's, whatever a checkpoint says
            self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """What changes from optimizer step to optimizer step: the learning rate (a LambdaLR) and the entropy
    coefficient (`entropy`, an EntropyControl). Both are in its state_dict, which checkpoints save."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float], entropy: EntropyControl):
        super().__init__(optimizer, factor)
        self.entropy = entropy

    def state_dict(self) -> dict:
        return {**super().state_dict(), "entropy": self.entropy.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        entropy = state.pop("entropy", None)       # absent from checkpoints written before adaptive entropy
        super().load_state_dict(state)
        if entropy is not None:
            self.entropy.load_state_dict(entropy)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg) -> Schedule:
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

    return Schedule(optimizer, factor, EntropyControl.of(cfg))


def surviving_groups(samples: Sequence[ScoredSample | None]) -> tuple[list[ScoredSample], list[int]]:
    """The samples that can train, each group's survivors contiguous, and the size of each group.

    A sample is lost when it is None or has no reward (e.g. an infrastructure error while scoring);
    its group keeps its other members, and a group with fewer than 2 survivors (no baseline) is dropped.
    Groups keep their order of first appearance.
    """
    by_group: dict[int, list[ScoredSample]] = {}
    for s in samples:
        if s is not None and s.reward is not None:
            by_group.setdefault(s.group, []).append(s)
    kept = [members for members in by_group.values() if len(members) >= 2]
    return [s for members in kept for s in members], [len(members) for members in kept]


def batch_advantages(kept: Sequence[ScoredSample], group_sizes: Sequence[int], cfg) -> torch.Tensor:
    """Each kept sample's advantage within its surviving group, aggregated as `multi_objective_aggregation`
    says: sum_then_normalize, `group_advantages` of the weighted total (as scale_rewards says);
    normalize_then_sum, `decoupled_advantages` (GDPO) of the scores per reward function, weighted by
    reward_weights (1 for a reward an environment adds, as TRL). -> [N]"""
    if cfg.multi_objective_aggregation == "sum_then_normalize":
        rewards = torch.tensor([s.reward for s in kept], dtype=torch.float32)                 # [N]
        return group_advantages(rewards, group_sizes, cfg.scale_rewards)
    if any(s.rewards_per_func is None for s in kept):
        raise ValueError("multi_objective_aggregation: normalize_then_sum needs each sample's score per reward "
                         "function (ScoredSample.rewards_per_func: the score stage's 'rewards')")
    weight_of = dict(zip(metric_names(cfg.reward_funcs), cfg.reward_weights))
    names = list(dict.fromkeys(k for s in kept for k in s.rewards_per_func))
    table = torch.tensor([[math.nan if s.rewards_per_func.get(k) is None else float(s.rewards_per_func[k])
                           for k in names] for s in kept], dtype=torch.float32)            # [N, K] NaN: no score
    weights = torch.tensor([weight_of.get(k, 1.0) for k in names], dtype=torch.float32)   # [K]
    return decoupled_advantages(table, weights, group_sizes)


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
            c_mask[r, :len(c)] = 1 if s.completion_mask is None else torch.tensor(s.completion_mask,
                                                                                    dtype=torch.float32)
    return input_ids.to(device), attn.to(device), c_mask.to(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated (CUDA) or peak resident set size of this process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20      # Linux reports KiB


def _group_members(group_sizes: int | Sequence[int], n_samples: int) -> list[list[int]]:
    """Sample indices of each group, for groups laid out contiguously."""
    sizes = [group_sizes] * (n_samples // group_sizes) if isinstance(group_sizes, int) else list(group_sizes)
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def plan_steps(kept: Sequence[ScoredSample], group_sizes: int | Sequence[int], steps_per_iteration: int,
               grad_accum: int, seed: int) -> list[list[list[int]]]:
    """Whole groups -> optimizer steps -> micro-batches of sample indices.

    `group_sizes`: G when every group is complete, else the size of each group in order. Groups are
    shuffled into `steps_per_iteration` steps; inside a step they are sorted by length and cut into
    `grad_accum` contiguous micro-batches (by group count), so each micro-batch pads to similar lengths.
    """
    members = _group_members(group_sizes, len(kept))
    groups = list(range(len(members)))
    random.Random(seed).shuffle(groups)
    steps = [groups[i::steps_per_iteration] for i in range(steps_per_iteration)]
    plan = []
    for step_groups in (s for s in steps if s):
        step_groups = sorted(step_groups, key=lambda g: max(len(kept[i].completion_ids) for i in members[g]))
        n = len(step_groups)
        cuts = [round(i * n / grad_accum) for i in range(grad_accum + 1)]
        chunks = [step_groups[cuts[i]:cuts[i + 1]] for i in range(grad_accum)]
        plan.append([[i for g in chunk for i in members[g]] for chunk in chunks if chunk])
    return plan


def batch_statistics(samples: Sequence[ScoredSample | None], kept: Sequence[ScoredSample],
                     group_sizes: Sequence[int], G: int) -> dict[str, float]:
    """Group counts, and reward and completion-length statistics of the kept samples."""
    n_groups_in = -(-len(samples) // G)
    stats = {"groups_total": float(n_groups_in), "groups_unscorable": float(n_groups_in - len(group_sizes)),
             "samples_unscorable": float(sum(s is None or s.reward is None for s in samples)),
             "groups_incomplete": float(sum(size < G for size in group_sizes))}
    if not kept:
        return stats
    rewards = torch.tensor([s.reward for s in kept], dtype=torch.float32)             # [N]
    lengths = [s.model_tokens for s in kept]
    stats.update({
        "frac_reward_zero_std": zero_std_groups(rewards, group_sizes).float().mean().item(),
        "reward_std": rewards.std().item() if len(kept) > 1 else 0.0,
        "completion_length_mean": sum(lengths) / len(lengths), "completion_length_min": float(min(lengths)),
        "completion_length_max": float(max(lengths)),
        "truncated_frac": sum(s.truncated for s in kept) / len(kept)})
    return stats


def sampler_logprob_rows(rows: Sequence[ScoredSample], completion_len: int, device: torch.device) -> torch.Tensor:
    """The sampler's log-probs of the rows' completion tokens, right-padded. -> [b, Lc] (NaN: none given)."""
    out = torch.full((len(rows), completion_len), float("nan"))
    for r, s in enumerate(rows):
        lp = s.sampler_logprobs[:len(s.completion_ids)]
        if lp:
            out[r, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out.to(device)


def make_micro_batch(rows: Sequence[ScoredSample], advantages: torch.Tensor, pad_id: int, device: torch.device,
                     mask_truncated: bool, group_size: int = 1, with_sampler_logprobs: bool = False) -> MicroBatch:
    """Pad `rows` into one micro-batch; with `mask_truncated`, truncated answers get no loss."""
    input_ids, attention_mask, completion_mask = pad_batch(rows, pad_id, device)
    if mask_truncated:                                       # truncated answers: no loss, no token count
        truncated = torch.tensor([r.truncated for r in rows], device=device)
        completion_mask = completion_mask * (~truncated).float().unsqueeze(1)
    sampler_logp = sampler_logprob_rows(rows, completion_mask.size(1), device) if with_sampler_logprobs else None
    return MicroBatch(input_ids, attention_mask, completion_mask, advantages.to(device), group_size, sampler_logp)


def loss_tokens(sample: ScoredSample, mask_truncated: bool) -> int:
    """The completion tokens of `sample` that get a loss (none of a truncated answer under mask_truncated)."""
    return 0 if mask_truncated and sample.truncated else sample.model_tokens


def shard_rows(rows: Sequence[int], kept: Sequence[ScoredSample],
               data_parallel: DataParallel) -> tuple[list[int], bool]:
    """This process's rows of a micro-batch: every world_size-th of its groups, from the rank-th. A process
    left without a group (fewer groups than processes) gets the first one as a stand-in that weighs
    nothing, so that every process runs the same steps and sums. -> (rows, stand_in)."""
    groups = list(dict.fromkeys(kept[i].group for i in rows))            # in order; each group's rows contiguous
    mine = set(groups[data_parallel.rank::data_parallel.world_size])
    if not mine:
        return [i for i in rows if kept[i].group == groups[0]], True
    return [i for i in rows if kept[i].group in mine], False


def shard_loss_weight(share: Sequence[ScoredSample], whole: Sequence[ScoredSample], cfg) -> float:
    """What the loss of `share` (normalised by itself, as `aggregate` does) is multiplied by to be its part
    of the loss of the micro-batch `whole`: its fraction of the whole's sequences or loss tokens. Summed
    over the processes, the parts are the whole micro-batch's loss. What `aggregate` divides by is the loss
    type's `Reduction.normaliser`: the micro-batch's sequences or tokens, or (None) the step's token count,
    which every process already uses."""
    by = loss_type_named(cfg.loss_type).reduction.normaliser
    if len(share) == len(whole):                                    # one process: the whole micro-batch
        return 1.0
    if by == "sequences":
        return len(share) / len(whole)
    return shard_token_weight(share, whole, cfg) if by == "tokens" else 1.0


def shard_token_weight(share: Sequence[ScoredSample], whole: Sequence[ScoredSample], cfg) -> float:
    """`share`'s fraction of the loss tokens of the micro-batch `whole` (1 for the whole): what a token mean
    over `share` is multiplied by to be its part of the token mean over `whole` (bnpo's loss, and the entropy
    bonus whatever the loss type)."""
    if len(share) == len(whole):
        return 1.0
    tokens = lambda rows: sum(loss_tokens(s, cfg.mask_truncated_completions) for s in rows)  # noqa: E731
    return tokens(share) / max(tokens(whole), 1)


@torch.no_grad()
def _logprobs_no_grad(model, mb: MicroBatch, cfg) -> torch.Tensor:
    return completion_logprobs(model, mb.input_ids, mb.attention_mask, mb.completion_mask.size(1), cfg.temperature,
                               chunk_rows=cfg.logit_chunk_rows, group_size=mb.group_size,
                               fp32_head=cfg.cast_lm_head_to_fp32)[0]


def attach_frozen_logprobs(policy: Policy, micro_batches: Sequence[MicroBatch], cfg,
                           need_old: bool) -> dict[str, float]:
    """Fill in each micro-batch's old log-probs (when `need_old`) and reference log-probs (when
    beta > 0), under the current weights; return the seconds each took."""
    seconds = {"reference_seconds": 0.0, "old_logprob_seconds": 0.0}
    policy.model.eval()
    for mb in micro_batches:
        if need_old:
            t = time.perf_counter()
            mb.old_logp = _logprobs_no_grad(policy.model, mb, cfg)
            seconds["old_logprob_seconds"] += time.perf_counter() - t
        if cfg.beta != 0.0:
            t = time.perf_counter()
            with policy.reference() as ref_model:
                mb.ref_logp = _logprobs_no_grad(ref_model, mb, cfg)
            seconds["reference_seconds"] += time.perf_counter() - t
    return seconds


def micro_batch_loss(logp: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch, cfg, n_mb: int,
                     tokens_per_step: float,
                     entropy_coef: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """This process's part of one micro-batch's loss with the objective the config describes: `grpo_loss`, its
    policy loss times `mb.loss_weight` and its entropy bonus times `mb.entropy_weight`, so that the processes'
    parts add up to the whole micro-batch's loss whatever the loss type. `entropy_coef`: this step's
    coefficient (`EntropyControl.applied`; default the config's)."""
    settings = LossSettings.of(cfg)
    if entropy_coef is not None:
        settings = replace(settings, entropy_coef=entropy_coef)
    old_logp = logp.detach() if mb.old_logp is None else mb.old_logp     # on-policy: ratio exactly 1
    return grpo_loss(logp, old_logp, mb.ref_logp, mb.advantages, mb.completion_mask, settings,
                     num_micro_batches=n_mb, num_tokens_in_batch=tokens_per_step, entropy=entropy,
                     sampler_logp=mb.sampler_logp, loss_weight=mb.loss_weight, entropy_weight=mb.entropy_weight)


def step_statistics(per_micro_batch: Sequence[tuple[dict[str, float], float]], step_loss: float,
                    data_parallel: DataParallel) -> dict[str, float]:
    """A step's metrics over all processes: `loss` (the sum of the processes' parts), `step_tokens`, and each
    statistic as the mean over the micro-batches that have loss tokens of its token mean over the whole micro-batch.
    `per_micro_batch`: (this process's token-mean statistics, the loss tokens they weigh) per micro-batch."""
    names = list(per_micro_batch[0][0])
    table = torch.tensor([[stats[k] * tokens for k in names] + [tokens] for stats, tokens in per_micro_batch],
                         dtype=torch.float64)                                                # [n_mb, K + 1]
    loss = torch.tensor([step_loss], dtype=torch.float64)
    data_parallel.sum_across([table, loss])
    tokens = table[:, -1]                                                                    # [n_mb]
    measured = tokens > 0           # a micro-batch without a loss token (all masked) has no token mean (TRL: nanmean)
    means = ((table[measured, :-1] / tokens[measured].unsqueeze(1)).mean(0) if measured.any()
             else torch.zeros(len(names), dtype=torch.float64))                              # [K]
    return {**dict(zip(names, means.tolist())), "loss": loss.item(), "step_tokens": tokens.sum().item()}


def entropy_control(scheduler, cfg) -> EntropyControl:
    """The run's EntropyControl: the one the scheduler carries (`make_scheduler`'s Schedule), or, for another
    scheduler, a fixed entropy_coef (adaptive control needs a Schedule to keep its coefficient in)."""
    control = getattr(scheduler, "entropy", None)
    if isinstance(control, EntropyControl):
        return control
    if cfg.use_adaptive_entropy:
        raise ValueError("use_adaptive_entropy keeps its coefficient in the scheduler: build it with "
                         "grpo_core.update.step.make_scheduler")
    return EntropyControl.of(cfg)


def controlled_entropy(entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float) -> torch.Tensor:
    """[sum of the entropy, count] over the tokens the policy loss trains on (the high-entropy mask applied
    when top_entropy_quantile < 1), what adaptive entropy control measures (as TRL). entropy/mask: [b, Lc]
    -> [2] float64."""
    if top_entropy_quantile < 1.0:
        mask = mask * high_entropy_mask(entropy, mask, top_entropy_quantile)            # [b, Lc]
    return torch.stack([(entropy * mask).sum(), mask.sum()]).double().cpu()


def optimizer_step(policy: Policy, optimizer, scheduler, micro_batches: Sequence[MicroBatch], cfg,
                   tokens_per_step: float, data_parallel: DataParallel = DataParallel()) -> dict[str, float]:
    """One optimizer step: accumulate the gradients of its micro-batches (summed over the processes),
    clip, step (skipped when the gradient norm is not finite: skipped_nonfinite 1), and move the adaptive entropy
    coefficient (`EntropyControl`) by the entropy it measured; return its metrics (`step_statistics`; entropy_coef: the coefficient after the step, as TRL logs it,
    entropy_coef_applied: the one this step's loss used)."""
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    n_mb = len(micro_batches)
    per_micro_batch, step_loss = [], 0.0
    control = entropy_control(scheduler, cfg)
    entropy_coef, measured = control.applied(cfg), torch.zeros(2, dtype=torch.float64)   # [entropy sum, tokens]
    aux_coef = router_aux_coef(cfg.router_aux_loss_coef, policy.model.config)
    for mb in micro_batches:
        logp, entropy, aux = _policy_logprobs(policy.model, mb, cfg, entropy_coef > 0, aux_coef > 0)  # [b, Lc]
        loss, stats = micro_batch_loss(logp, entropy, mb, cfg, n_mb, tokens_per_step, entropy_coef)
        if aux is not None:
            # TRL: + coef * aux per accumulation step, the processes' gradients averaged (ours are summed)
            if not mb.stand_in:
                loss = loss + aux_coef * aux / (n_mb * data_parallel.world_size)
            stats["aux_loss"] = aux.item()
        loss.backward()
        step_loss += loss.item()
        mask = mb.completion_mask
        stats["entropy"] = ((entropy.detach() * mask).sum() / mask.sum().clamp(min=1)).item()
        per_micro_batch.append((stats, 0.0 if mb.stand_in else mask.sum().item()))
        if control.adaptive and not mb.stand_in:
            measured += controlled_entropy(entropy.detach(), mask, cfg.top_entropy_quantile)
        del logp, entropy, loss
    params = policy.trainable_parameters()
    data_parallel.sum_across([p.grad for p in params if p.grad is not None])
    metrics = step_statistics(per_micro_batch, step_loss, data_parallel)
    if control.adaptive:                   # the step's token mean over every process, then the next coefficient
        data_parallel.sum_across([measured])
        control.observe((measured[0] / measured[1].clamp(min=1)).item(), cfg)
    if control.adaptive or cfg.entropy_coef != 0.0:
        metrics.update({"entropy_coef": control.coef, "entropy_coef_applied": entropy_coef})
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")).item()
    finite = math.isfinite(grad_norm)           # the same on every process: the gradients are summed first
    if finite:
        optimizer.step()
    else:                    # a NaN/inf gradient would write NaN into the adapter for good: skip (GradScaler's rule)
        optimizer.zero_grad(set_to_none=True)
    learning_rate = optimizer.param_groups[0]["lr"]     # the rate this step used (transformers' Trainer logs it)
    scheduler.step()
    metrics.update({"grad_norm": grad_norm, "skipped_nonfinite": float(not finite), "learning_rate": learning_rate,
                    "step_seconds": time.perf_counter() - t0, "peak_memory_gib": peak_memory_gib(policy.device)})
    return metrics


def _policy_logprobs(model, mb: MicroBatch, cfg, entropy_grad: bool, router_loss: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The micro-batch's log-probs and entropy under the policy ([b, Lc] each), and, with `router_loss` (an MoE
    model and router_aux_loss_coef), the router's load-balancing loss from the same forward (else None)."""
    lc = mb.completion_mask.size(1)
    if router_loss:
        return router_loss_logprobs(model, mb.input_ids, mb.attention_mask, lc, cfg.temperature, with_entropy=True,
                                    entropy_grad=entropy_grad)
    logp, entropy = completion_logprobs(model, mb.input_ids, mb.attention_mask, lc, cfg.temperature,
                                        with_entropy=True, chunk_rows=cfg.logit_chunk_rows, group_size=mb.group_size,
                                        entropy_grad=entropy_grad, fp32_head=cfg.cast_lm_head_to_fp32)
    return logp, entropy, None


def plan_micro_batches(policy: Policy, kept: Sequence[ScoredSample], group_sizes: Sequence[int],
                       advantages: torch.Tensor, cfg, seed: int,
                       data_parallel: DataParallel = DataParallel()) -> list[list[MicroBatch]]:
    """The padded micro-batches of each optimizer step, each this process's share (`shard_rows`). A
    micro-batch whose groups all have one size shares each group's prompt pass (`completion_logprobs`'
    group layouts); one that mixes sizes (groups that lost members next to complete ones) runs every
    row on its own."""
    size_of = [size for size in group_sizes for _ in range(size)]                     # [N] size of i's group
    with_sampler_logprobs = all(s.sampler_logprobs is not None for s in kept)
    if cfg.vllm_importance_sampling_correction and not with_sampler_logprobs:
        raise ValueError("vllm_importance_sampling_correction needs the sampler's log-probs on every sample "
                         "(ScoredSample.sampler_logprobs): roll out with SamplingParams(logprobs=True), or set "
                         "vllm_importance_sampling_correction: false")
    plan = []
    for step in plan_steps(kept, group_sizes, cfg.steps_per_iteration, cfg.gradient_accumulation_steps, seed):
        plan.append([])
        for idx in step:
            mine, stand_in = shard_rows(idx, kept, data_parallel)
            sizes = {size_of[i] for i in mine}
            mb = make_micro_batch([kept[i] for i in mine], advantages[mine], policy.tokenizer.pad_token_id,
                                  policy.device, cfg.mask_truncated_completions,
                                  sizes.pop() if len(sizes) == 1 else 1, with_sampler_logprobs)
            mb.stand_in = stand_in
            share, whole = [kept[i] for i in mine], [kept[i] for i in idx]
            mb.loss_weight = 0.0 if stand_in else shard_loss_weight(share, whole, cfg)
            mb.entropy_weight = 0.0 if stand_in else shard_token_weight(share, whole, cfg)
            plan[-1].append(mb)
    return plan


def grpo_update(policy: Policy, optimizer, scheduler, samples: Sequence[ScoredSample | None], cfg,
                seed: int, progress=None, data_parallel: DataParallel = DataParallel(),
                ) -> tuple[list[dict[str, float]], dict[str, float], list[float | None]]:
    """Run steps_per_iteration x num_iterations optimizer steps on one rollout batch.

    `samples` are laid out group-contiguously (cfg.num_generations per group); a None entry or a None
    reward (not scorable) is left out and its group trains on its survivors (`surviving_groups`).
    With sync_ref_model, the reference moves toward the policy every ref_model_sync_steps optimizer
    steps (counted by the scheduler, so across calls and resumes). With `data_parallel` this process
    trains on its share of the batch, and each step is the step one process takes on all of it.
    Returns (per-step metrics, batch-level metrics, advantages): the advantages are one per input sample, in
    input order, as the steps used them; None where a sample did not train (None or unscorable, or its group
    kept fewer than 2 members). Every process returns those of the whole batch.
    """
    G, device = cfg.num_generations, policy.device
    if data_parallel.world_size > 1 and cfg.top_entropy_quantile < 1.0:
        raise ValueError("top_entropy_quantile < 1 takes a quantile over each micro-batch's tokens, which several "
                         "update processes would each take over their own share: set top_entropy_quantile: 1.0, "
                         "or run the update on one process (stages.update.num_processes: 1, no accelerate launch)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # 1) the groups that can train, and their advantages over their surviving members
    kept, group_sizes = surviving_groups(samples)
    batch_stats = batch_statistics(samples, kept, group_sizes, G)
    if not kept:
        return [], batch_stats, [None] * len(samples)
    advantages = batch_advantages(kept, group_sizes, cfg)                              # [N]
    by_sample = {id(s): a for s, a in zip(kept, advantages.tolist())}
    per_sample = [None if s is None else by_sample.get(id(s)) for s in samples]

    # 2) plan optimizer steps and micro-batches (this process's share of each)
    plan = plan_micro_batches(policy, kept, group_sizes, advantages, cfg, seed, data_parallel)
    micro_batches = [mb for step in plan for mb in step]
    total_tokens = float(sum(loss_tokens(s, cfg.mask_truncated_completions) for s in kept))     # every process's
    # DAPO normalises by the completion tokens of the whole generation batch, spread evenly over the
    # optimizer steps it feeds (TRL: num_items_in_batch * grad_accum / steps_per_generation).
    tokens_per_step = max(total_tokens, 1.0) / len(plan)

    # 3) old and reference log-probs: old ones only when the policy moves before a sample is used
    # (mu > 1 or several steps per rollout; otherwise the ratio is exactly 1), reference only when beta > 0
    need_old = cfg.num_iterations > 1 or len(plan) > 1
    batch_stats.update(attach_frozen_logprobs(policy, micro_batches, cfg, need_old))
    batch_stats["num_tokens"] = total_tokens

    # 4) optimizer steps: num_iterations passes over the planned steps; how far they move the adapter
    policy.model.train()
    step_metrics, before = [], [p.detach().clone() for p in policy.trainable_parameters()] if policy.use_peft else None
    for _ in range(cfg.num_iterations):
        for step in plan:
            metrics = optimizer_step(policy, optimizer, scheduler, step, cfg, tokens_per_step, data_parallel)
            if cfg.sync_ref_model and scheduler.last_epoch % cfg.ref_model_sync_steps == 0:
                policy.sync_reference(cfg.ref_model_mixup_alpha)
                metrics["ref_model_synced"] = 1.0
            step_metrics.append(metrics)
            if progress is not None:
                progress.update(1)
    if before is not None:
        batch_stats["lora_change"] = relative_change(before, policy.trainable_parameters())
    return step_metrics, batch_stats, per_sample
