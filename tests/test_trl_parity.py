"""Parity with TRL 1.16 itself: `GRPOTrainer._compute_loss`, TRL's own code, run on the same log-probs,
entropies, advantages and masks as `grpo_core.loss.grpo_loss`, for every loss type (luspo and vespo
included), token and sequence ratios, the bias-corrected KL and plain k3, `delta`, the entropy mask and the
entropy bonus, the sampler correction (folded into VESPO's weight), over several micro-batches: the same loss,
the same gradients and the same logged KL, clip ratios and VESPO weight. TRL is a
test dependency for this alone; the trainer object is a stand-in that carries only the attributes
`_compute_loss` reads, with one process (vLLM only as far as the sampler correction's weights go)."""
from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer          # the test extra pins TRL 1.16

from grpo_core.loss import grpo_loss, sampler_correction_weight


class OneProcess:
    """accelerate's Accelerator as `_compute_loss` uses it, for a single process."""
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def trl_compute_loss(logp, entropy, old, ref, adv, mask, o: dict, n_micro_batches: int, n_tokens: float,
                     is_ratio=None):
    """TRL's loss of one micro-batch on these tensors (`is_ratio`: the sampler correction's weights, as
    TRL computes them when it samples), and the metrics it logged."""
    trainer = SimpleNamespace(
        args=SimpleNamespace(delta=o["delta"], sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                             use_bias_correction_kl=o["use_bias_correction_kl"], steps_per_generation=n_micro_batches,
                             vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
        beta=o["beta"], loss_type=o["loss_type"], epsilon_low=0.2, epsilon_high=o["epsilon_high"],
        importance_sampling_level=o["importance_sampling_level"], top_entropy_quantile=o["top_entropy_quantile"],
        off_policy_mask_threshold=None, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        entropy_coef=o["entropy_coef"], use_adaptive_entropy=False, _entropy_bonus_enabled=o["entropy_coef"] != 0,
        aux_loss_enabled=False, current_gradient_accumulation_steps=n_micro_batches, accelerator=OneProcess(),
        max_completion_length=o["max_completion_length"], model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None))
    trainer.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trainer, *a)
    trainer.get_gamma_weights = GRPOTrainer.get_gamma_weights                  # a staticmethod
    B, L = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, L, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(n_tokens), "importance_sampling_ratio": is_ratio}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


CASES = [dict(loss_type=lt, importance_sampling_level=level, use_bias_correction_kl=bias, beta=0.04,
              epsilon_high=1.5 if lt == "cispo" else 0.28, delta=None, top_entropy_quantile=1.0, entropy_coef=0.0,
              sampler=None)
         for lt, level, bias in itertools.product(("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"),
                                                   ("token", "sequence"), (True, False))
         if not (lt == "vespo" and level == "sequence")]
CASES += [dict(CASES[0], delta=1.6, loss_type="bnpo"),
          dict(CASES[0], delta=1.6, loss_type="luspo", importance_sampling_level="sequence"),
          dict(CASES[0], sampler="token_truncate"),
          dict(CASES[0], sampler="sequence_mask", loss_type="dapo"),
          dict(CASES[0], sampler="token_truncate", loss_type="vespo"),
          dict(CASES[0], sampler="token_mask", loss_type="vespo", use_bias_correction_kl=False),
          dict(CASES[0], entropy_coef=0.05),
          dict(CASES[0], entropy_coef=0.05, top_entropy_quantile=0.4, loss_type="dapo"),
          dict(CASES[0], entropy_coef=0.02, top_entropy_quantile=0.6, loss_type="dr_grpo", beta=0.0)]


def _name(o):
    extra = [k for k in ("delta", "entropy_coef", "sampler") if o[k]] + \
        (["masked"] if o["top_entropy_quantile"] < 1 else [])
    return "-".join([o["loss_type"], o["importance_sampling_level"], "biaskl" if o["use_bias_correction_kl"] else
                     "k3", *extra])


@pytest.mark.parametrize("o", CASES, ids=[_name(o) for o in CASES])
def test_loss_gradient_and_metrics_equal_trls_compute_loss(o):
    g = torch.Generator().manual_seed(len(_name(o)))
    B, L, n_mb = 6, 7, 3
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    mask[:, 0] = 1
    logp0 = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    old = logp0 + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)      # a later pass: clipping happens
    ref = logp0 + 0.5 * torch.randn(B, L, generator=g, dtype=torch.float64)
    entropy0 = torch.rand(B, L, generator=g, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    sampler = old + 0.2 * torch.randn(B, L, generator=g, dtype=torch.float64)   # the sampler's own log-probs
    n_tokens = mask.sum().item() * n_mb                                        # the step's completion tokens
    is_ratio = None
    if o["sampler"]:
        is_ratio = sampler_correction_weight(old, sampler, mask.double(), o["sampler"], 1.3)

    def leaves():
        return logp0.clone().requires_grad_(), entropy0.clone().requires_grad_()

    logp, entropy = leaves()
    ours, stats = grpo_loss(logp, old, ref, adv, mask.double(), beta=o["beta"], epsilon_low=0.2,
                            epsilon_high=o["epsilon_high"], loss_type=o["loss_type"], max_completion_length=9,
                            num_micro_batches=n_mb, num_tokens_in_batch=n_tokens,
                            importance_sampling_level=o["importance_sampling_level"], delta=o["delta"],
                            entropy=entropy, top_entropy_quantile=o["top_entropy_quantile"],
                            entropy_coef=o["entropy_coef"], use_bias_correction_kl=o["use_bias_correction_kl"],
                            sampler_logp=sampler, sampler_correction=o["sampler"], sampler_correction_cap=1.3,
                            vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    our_grads = torch.autograd.grad(ours, (logp, entropy), allow_unused=True)
    logp, entropy = leaves()
    theirs, metrics = trl_compute_loss(logp, entropy, old, ref, adv, mask, dict(o, max_completion_length=9), n_mb,
                                       n_tokens, is_ratio)
    trl_grads = torch.autograd.grad(theirs, (logp, entropy), allow_unused=True)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10, abs=1e-12)
    for a, b in zip(our_grads, trl_grads):
        a = torch.zeros_like(logp0) if a is None else a
        b = torch.zeros_like(logp0) if b is None else b
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), (a - b).abs().max()
    if o["beta"]:
        assert stats["kl"] == pytest.approx(metrics["kl"], rel=1e-6)          # ours in float32
    if o["loss_type"] == "vespo":
        assert stats["vespo/phi_seq_mean"] == pytest.approx(metrics["vespo/phi_seq_mean"], rel=1e-6)
    # (a sequence ratio's clip fractions: TRL counts sequences, ours tokens, which data-parallel shares sum)
    if o["loss_type"] not in ("cispo", "sapo", "vespo") and o["importance_sampling_level"] == "token":
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert stats[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key
