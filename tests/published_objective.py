"""The published objectives written out sequence by sequence and token by token, with Python loops, for
the tests to compare grpo_core.update.loss and grpo_core.update.step against (imported by tests/test_loss.py and
tests/test_update_variants.py). Nothing here shares code with grpo_core.

One micro-batch is a list of sequences; each sequence gives, for its completion tokens that get a loss
(in order): logp (with gradient), old, ref, sampler log-probs and entropy, plus its advantage A_i.

    token ratio      r_t = pi(y_t) / pi_old(y_t)
    GSPO             s_i = (prod_t r_t)^(1/|o_i|), one ratio for the whole sequence
    GSPO-token       s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]
    GRPO/DAPO/...    J_t = min(min(r, delta) A, clip(r, 1-eps_low, 1+eps_high) A)   (delta: INTELLECT-2)
    CISPO            J_t = sg[min(r, eps_high)] A log pi(y_t)                      (TRL / ScaleRL cap)
    SAPO             J_t = sigmoid(tau (r - 1)) 4 / tau A,  tau = tau_pos if A > 0 else tau_neg
    LUSPO            J_t as GRPO's; the loss sums each sequence's tokens (no 1/|o_i|), then averages
    VESPO            J_t = sg[phi(w)] A log pi(y_t),  w = prod_t pi / pi_old (times the sampler weights),
                     phi(w) = w^k exp(-lambda (w - 1)), (k, lambda) = (k_pos, lambda_pos) if A >= 0
    off-policy mask  J_t = 0 for the whole sequence when A < 0 and mean_t(log mu - log pi) > threshold
    entropy mask     J_t = 0 unless H_t >= quantile(H of all the micro-batch's tokens, 1 - q)
    sampler weight   J_t *= w (pi_old / mu per token or per sequence; truncated to [C_min, C] or zeroed outside
                     it; no C_min: no lower bound)
    per token        L_t = -J_t + beta * r * (ref/pi - log(ref/pi) - 1)
                     (r: the ratio J_t uses, before delta; DeepSeek-V3.2's bias-corrected KL; without it r = 1)
    entropy bonus    loss -= entropy_coef * (mean of H_t over the tokens the entropy mask keeps) / micro-batches
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Options:
    loss_type: str = "grpo"
    beta: float = 0.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    level: str = "token"
    delta: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    bias_correction_kl: bool = True
    off_policy_threshold: float | None = None
    sampler_mode: str | None = None
    sampler_cap: float = 3.0
    sampler_min: float | None = None
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)     # k_pos, lambda_pos, k_neg, lambda_neg


@dataclass
class Sequence:
    logp: list                      # tensors with gradient, one per completion token that gets a loss
    old: list[float]
    advantage: float
    ref: list[float] = field(default_factory=list)
    sampler: list[float] = field(default_factory=list)
    entropy: list = field(default_factory=list)   # tensors (with gradient when entropy_coef > 0)


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default, as torch.quantile)."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def sequence_terms(seq: Sequence, o: Options, entropy_threshold: float | None) -> list:
    """The per-token losses L_t of one sequence (tensors)."""
    n, A = len(seq.logp), seq.advantage
    log_s = sum(seq.logp[t] - seq.old[t] for t in range(n)) / max(n, 1)
    dropped = False
    if o.off_policy_threshold is not None:
        behaviour = seq.sampler if seq.sampler else seq.old
        kl = sum(behaviour[t] - seq.logp[t].detach().item() for t in range(n)) / max(n, 1)
        dropped = A < 0 and kl > o.off_policy_threshold
    if o.sampler_mode is not None:
        diffs = [seq.old[t] - seq.sampler[t] for t in range(n)]
        raw = [math.exp(sum(diffs))] * n if o.sampler_mode.startswith("sequence") else [math.exp(d) for d in diffs]
        low = -math.inf if o.sampler_min is None else o.sampler_min
        if o.sampler_mode.endswith("truncate"):
            weights = [min(max(w, low), o.sampler_cap) for w in raw]
        else:
            weights = [0.0 if w > o.sampler_cap or w < low else w for w in raw]
    else:
        weights = [1.0] * n
    if o.loss_type == "vespo":                   # the sampler weights go into the sequence's w, not per token
        w = math.exp(sum(seq.logp[t].item() - seq.old[t] for t in range(n))) * math.prod(weights)
        k, lam = o.vespo[:2] if A >= 0 else o.vespo[2:]
        phi = w ** k * math.exp(-lam * (w - 1))
        weights = [1.0] * n
    terms = []
    for t in range(n):
        if o.level == "token":
            r = torch.exp(seq.logp[t] - seq.old[t])
        elif o.level == "sequence":
            r = torch.exp(log_s)
        else:
            r = torch.exp(log_s.detach() + seq.logp[t] - seq.logp[t].detach())
        if o.loss_type == "cispo":
            j = torch.clamp(r, max=o.eps_high).detach() * A * seq.logp[t]
        elif o.loss_type == "vespo":
            j = phi * A * seq.logp[t]
        elif o.loss_type == "sapo":
            tau = o.tau_pos if A > 0 else o.tau_neg
            j = torch.sigmoid(tau * (r - 1)) * 4 / tau * A
        else:
            unclipped = (r if o.delta is None else torch.clamp(r, max=o.delta)) * A
            j = torch.minimum(unclipped, torch.clamp(r, 1 - o.eps_low, 1 + o.eps_high) * A)
        if dropped or (entropy_threshold is not None and seq.entropy[t].detach().item() < entropy_threshold):
            j = j * 0
        term = -j * weights[t]
        if o.beta:
            d = seq.ref[t] - seq.logp[t]
            term = term + o.beta * (r if o.bias_correction_kl else 1.0) * (torch.exp(d) - d - 1)
        terms.append(term)
    return terms


def kept_entropies(seqs: list[Sequence], threshold: float | None) -> list:
    """The entropies of the tokens the policy loss trains on (all, or those at or above the threshold)."""
    return [h for s in seqs for h in s.entropy if threshold is None or h.detach().item() >= threshold]


def micro_batch_loss(seqs: list[Sequence], o: Options, n_micro_batches: int = 1, max_completion_length: int = 0,
                     dapo_tokens: float | None = None):
    """One micro-batch's share of the step's loss, reduced as the loss type's paper says."""
    threshold = None
    if o.top_entropy_quantile < 1.0:
        threshold = quantile([h.detach().item() for s in seqs for h in s.entropy], 1 - o.top_entropy_quantile)
    per_seq = [sequence_terms(s, o, threshold) for s in seqs]
    sums = [sum(ts) if ts else 0.0 for ts in per_seq]
    n_tokens = sum(len(ts) for ts in per_seq)
    if o.loss_type in ("grpo", "sapo"):
        loss = sum(s / max(len(ts), 1) for s, ts in zip(sums, per_seq)) / len(seqs) / n_micro_batches
    elif o.loss_type == "bnpo":
        loss = sum(sums) / max(n_tokens, 1) / n_micro_batches
    elif o.loss_type == "dr_grpo":
        loss = sum(sums) / (len(seqs) * max_completion_length) / n_micro_batches
    elif o.loss_type == "luspo":
        loss = sum(sums) / len(seqs) / n_micro_batches
    else:                                                                  # dapo, cispo, vespo
        loss = sum(sums) / (dapo_tokens if dapo_tokens is not None else max(n_tokens, 1))
    if o.entropy_coef:
        kept = kept_entropies(seqs, threshold)
        loss = loss - o.entropy_coef * sum(kept) / max(len(kept), 1) / n_micro_batches
    return loss
