"""Parity with TRL 1.16 itself: `GRPOTrainer._compute_loss`, TRL's own code, run on the same log-probs,
entropies, advantages and masks as `grpo_core.update.loss.grpo_loss`, for every loss type (luspo and vespo
included), token and sequence ratios, the bias-corrected KL and plain k3, `delta`, the entropy mask and the
entropy bonus, the sampler correction (folded into VESPO's weight), over several micro-batches: the same loss,
the same gradients and the same logged KL, clip ratios and VESPO weight; adaptive entropy control (TRL's
controller inside `_compute_loss`, step after step). TRL's `_generate_and_score_completions` (its generation
stubbed out) gives the advantages (multi_objective_aggregation, scale_rewards, unscored rewards) and the
sampler correction's weights (every mode, with and without vllm_importance_sampling_clip_min) that ours must
equal. TRL is a test dependency for this alone; the trainer object is a stand-in that carries only the
attributes the TRL method reads, with one process (vLLM only as far as the sampler correction's weights go)."""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer          # the test extra pins TRL 1.16

from grpo_core.config import GRPOConfig
from grpo_core.update.loss import LossSettings, grpo_loss, sampler_correction_weight
from grpo_core.update.step import EntropyControl, ScoredSample, batch_advantages, controlled_entropy


class OneProcess:
    """accelerate's Accelerator as `_compute_loss` and `_generate_and_score_completions` use it, one process."""
    num_processes = 1
    process_index = 0
    sync_gradients = True
    device = torch.device("cpu")

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
    trainer = trl_trainer(o, n_micro_batches, is_ratio is not None)
    loss = trl_micro_batch(trainer, logp, entropy, old, ref, adv, mask, n_tokens, is_ratio)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def trl_micro_batch(trainer, logp, entropy, old, ref, adv, mask, n_tokens: float, is_ratio=None):
    """`_compute_loss` of the stand-in `trainer` on one micro-batch."""
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    B, L = logp.shape
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, L, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(n_tokens), "importance_sampling_ratio": is_ratio}
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def trl_trainer(o: dict, n_micro_batches: int, vllm: bool):
    """A stand-in GRPOTrainer with the options `o` (`o.get("adaptive")`: TRL's adaptive entropy arguments)."""
    adaptive = o.get("adaptive") or {}
    trainer = SimpleNamespace(
        args=SimpleNamespace(delta=o["delta"], sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                             use_bias_correction_kl=o["use_bias_correction_kl"], steps_per_generation=n_micro_batches,
                             vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5, **adaptive),
        beta=o["beta"], loss_type=o["loss_type"], epsilon_low=0.2, epsilon_high=o["epsilon_high"],
        importance_sampling_level=o["importance_sampling_level"], top_entropy_quantile=o["top_entropy_quantile"],
        off_policy_mask_threshold=None, use_vllm=vllm, vllm_importance_sampling_correction=vllm,
        entropy_coef=o["entropy_coef"], use_adaptive_entropy=bool(adaptive),
        _entropy_bonus_enabled=o["entropy_coef"] != 0 or bool(adaptive),
        _last_world_entropy=float("inf"), _entropy_window_stats=None,
        aux_loss_enabled=False, current_gradient_accumulation_steps=n_micro_batches, accelerator=OneProcess(),
        max_completion_length=o["max_completion_length"], model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)})
    trainer.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trainer, *a)
    trainer.get_gamma_weights = GRPOTrainer.get_gamma_weights                  # a staticmethod
    return trainer


CASES = [dict(loss_type=lt, importance_sampling_level=level, use_bias_correction_kl=bias, beta=0.04,
              epsilon_high=1.5 if lt == "cispo" else 0.28, delta=None, top_entropy_quantile=1.0, entropy_coef=0.0,
              sampler=None, clip_min=None)
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
          dict(CASES[0], entropy_coef=0.02, top_entropy_quantile=0.6, loss_type="dr_grpo", beta=0.0),
          dict(CASES[0], sampler="token_truncate", clip_min=0.9),
          dict(CASES[0], sampler="token_mask", clip_min=0.9, loss_type="dapo"),
          dict(CASES[0], sampler="sequence_truncate", clip_min=0.8, loss_type="bnpo"),
          dict(CASES[0], sampler="token_mask", clip_min=0.9, loss_type="vespo")]


def _name(o):
    extra = [k for k in ("delta", "entropy_coef", "sampler", "clip_min") if o[k]] + \
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
        is_ratio = sampler_correction_weight(old, sampler, mask.double(), o["sampler"], 1.3, o["clip_min"])

    def leaves():
        return logp0.clone().requires_grad_(), entropy0.clone().requires_grad_()

    logp, entropy = leaves()
    settings = LossSettings(beta=o["beta"], epsilon_low=0.2, epsilon_high=o["epsilon_high"], loss_type=o["loss_type"],
                            max_completion_length=9, importance_sampling_level=o["importance_sampling_level"],
                            delta=o["delta"], top_entropy_quantile=o["top_entropy_quantile"],
                            entropy_coef=o["entropy_coef"], use_bias_correction_kl=o["use_bias_correction_kl"],
                            sampler_correction=o["sampler"], sampler_correction_cap=1.3,
                            sampler_correction_clip_min=o["clip_min"],
                            vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    ours, stats = grpo_loss(logp, old, ref, adv, mask.double(), settings, num_micro_batches=n_mb,
                            num_tokens_in_batch=n_tokens, entropy=entropy, sampler_logp=sampler)
    our_grads = torch.autograd.grad(ours, (logp, entropy), allow_unused=True)
    logp, entropy = leaves()
    theirs, metrics = trl_compute_loss(logp, entropy, old, ref, adv, mask, dict(o, max_completion_length=9), n_mb,
                                       n_tokens, is_ratio)
    trl_grads = torch.autograd.grad(theirs, (logp, entropy), allow_unused=True)
    _same_loss_and_gradients(ours, theirs, our_grads, trl_grads, logp0)
    if o["beta"]:
        assert stats["kl"] == pytest.approx(metrics["kl"], rel=1e-6)          # ours in float32
    if o["loss_type"] == "vespo":
        assert stats["vespo/phi_seq_mean"] == pytest.approx(metrics["vespo/phi_seq_mean"], rel=1e-6)
    # (a sequence ratio's clip fractions: TRL counts sequences, ours tokens, which data-parallel shares sum)
    if o["loss_type"] not in ("cispo", "sapo", "vespo") and o["importance_sampling_level"] == "token":
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert stats[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key


def _same_loss_and_gradients(ours, theirs, our_grads, trl_grads, like):
    """Our loss and gradients equal TRL's to float64 precision (a gradient one side does not have: zeros)."""
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-10, abs=1e-12)
    for a, b in zip(our_grads, trl_grads):
        a = torch.zeros_like(like) if a is None else a
        b = torch.zeros_like(like) if b is None else b
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), (a - b).abs().max()


# -- adaptive entropy control: TRL's controller, step after step -----------------------------------------------

@pytest.mark.parametrize("top_entropy_quantile", [1.0, 0.5])
def test_adaptive_entropy_equals_trls_controller(top_entropy_quantile):
    """Five optimizer steps of three micro-batches: TRL's `_compute_loss` moves its coefficient at each step's
    last micro-batch from the step's token-mean entropy; ours (EntropyControl, the coefficient it applies and
    `controlled_entropy`) must give the same loss, gradients and coefficient at every step."""
    g = torch.Generator().manual_seed(11)
    B, L, n_mb, target = 4, 6, 3, 0.9
    adaptive = dict(entropy_coef_min=0.0, entropy_coef_max=0.035, entropy_coef_delta=0.01, entropy_target=target)
    o = dict(CASES[0], entropy_coef=0.02, top_entropy_quantile=top_entropy_quantile, adaptive=adaptive,
             max_completion_length=9)
    trainer = trl_trainer(o, n_mb, vllm=False)
    cfg = GRPOConfig(use_adaptive_entropy=True, entropy_coef=0.02, **adaptive)
    control = EntropyControl.of(cfg)
    coefs, applied = [], []
    for scale in (0.5, 0.5, 0.5, 1.5, 0.5):                     # the entropy level of each step, around the target
        measured = torch.zeros(2, dtype=torch.float64)
        for k in range(n_mb):
            mask = (torch.rand(B, L, generator=g) > 0.3).float()
            mask[:, 0] = 1
            logp0 = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
            old = logp0 + 0.1 * torch.randn(B, L, generator=g, dtype=torch.float64)
            ref = logp0 + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)
            entropy0 = torch.rand(B, L, generator=g, dtype=torch.float64) * 2 * scale
            adv = torch.randn(B, generator=g, dtype=torch.float64)
            n_tokens = mask.sum().item() * n_mb
            logp, entropy = logp0.clone().requires_grad_(), entropy0.clone().requires_grad_()
            coef = control.applied(cfg)
            settings = LossSettings(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="grpo",
                                    max_completion_length=9, top_entropy_quantile=top_entropy_quantile,
                                    entropy_coef=coef)
            ours, _ = grpo_loss(logp, old, ref, adv, mask.double(), settings, num_micro_batches=n_mb,
                                num_tokens_in_batch=n_tokens, entropy=entropy)
            our_grads = torch.autograd.grad(ours, (logp, entropy), allow_unused=True)
            measured += controlled_entropy(entropy0, mask.double(), top_entropy_quantile)
            logp, entropy = logp0.clone().requires_grad_(), entropy0.clone().requires_grad_()
            trainer.accelerator.sync_gradients = k == n_mb - 1          # the step's last micro-batch
            theirs = trl_micro_batch(trainer, logp, entropy, old, ref, adv, mask, n_tokens)
            trl_grads = torch.autograd.grad(theirs, (logp, entropy), allow_unused=True)
            _same_loss_and_gradients(ours, theirs, our_grads, trl_grads, logp0)
        control.observe((measured[0] / measured[1]).item(), cfg)
        assert control.coef == pytest.approx(trainer.entropy_coef, abs=1e-12)
        assert control.last_entropy == pytest.approx(trainer._last_world_entropy, rel=1e-12)
        coefs.append(control.coef)
        applied.append(coef)
    assert trainer._metrics["train"]["entropy_coef"] == pytest.approx(coefs)     # what TRL logged per step
    # the trajectory went both ways and hit the cap, and the bonus was on for some steps and off for others
    assert max(coefs) == pytest.approx(0.035) and min(coefs) < max(coefs) and 0.0 in applied and max(applied) > 0


# -- TRL's _generate_and_score_completions: advantages and the sampler correction's weights ----------------------

def trl_scored(rewards_per_func, weights, G: int, aggregation: str, scale_rewards: str = "group", old=None,
               sampler=None, lengths=None, mode: str = "token_truncate", clip_min=None, clip_max: float = 3.0) -> dict:
    """TRL's `_generate_and_score_completions` on a stand-in trainer whose generation returns completions of
    `lengths` tokens with the sampler log-probs `sampler` ([B, L], NaN: none), whose old log-probs are `old`
    and whose reward functions give `rewards_per_func` ([B, K], NaN: none). Returns TRL's output dict."""
    B = rewards_per_func.size(0)
    lengths = lengths or [2] * B
    correction = sampler is not None

    def generate(prompts):
        logps = [s[:n].tolist() for s, n in zip(sampler, lengths)] if correction else None
        return [[1, 2]] * B, [[5] * n for n in lengths], None, ["c"] * B, logps, {}, None, []

    trainer = SimpleNamespace(
        accelerator=OneProcess(), model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None, tools=None, environments=None, _generate=generate,
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None, mask_truncated_completions=False,
        args=SimpleNamespace(per_device_train_batch_size=B, gradient_checkpointing_kwargs=None,
                             steps_per_generation=1, gradient_accumulation_steps=1),
        num_iterations=1, use_vllm=correction, vllm_importance_sampling_correction=correction,
        _get_per_token_logps_and_entropies=lambda *a, **k: (old, None, None),
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max, beta=0.0, _calculate_rewards=lambda *a: rewards_per_func,
        num_generations=G, multi_objective_aggregation=aggregation, reward_weights=weights,
        scale_rewards=scale_rewards, reward_funcs=[None] * rewards_per_func.size(1),
        reward_func_names=[f"f{k}" for k in range(rewards_per_func.size(1))], _metrics={"train": defaultdict(list)},
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list), "images": []},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False)
    return GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * B)


@pytest.mark.parametrize("aggregation, scale_rewards", [("normalize_then_sum", "group"),
                                                         ("sum_then_normalize", "group"),
                                                         ("sum_then_normalize", "batch"),
                                                         ("sum_then_normalize", "none")])
def test_advantages_equal_trls(aggregation, scale_rewards):
    """grpo_core.update.step.batch_advantages on scored samples (three reward functions with their weights, and an
    environment's reward, weight 1, that only some samples have) against TRL's advantages on the same scores."""
    g = torch.Generator().manual_seed(3)
    G, n_groups = 4, 5
    scores = torch.randint(0, 3, (G * n_groups, 3), generator=g).double() * torch.tensor([1.0, 0.5, 2.0]).double()
    env = torch.rand(G * n_groups, 1, generator=g, dtype=torch.float64)
    env[torch.rand(G * n_groups, generator=g) < 0.4] = float("nan")          # another environment's sample
    env[8:12] = float("nan")                                                   # a group without it
    env[13:16] = float("nan")                                                  # a group where one sample has it
    table = torch.cat([scores, env], 1)                                        # [B, 4]
    cfg = GRPOConfig(reward_funcs=["accuracy", "format", "overlong"], reward_weights=[1.0, 0.5, 2.0],
                     scale_rewards=scale_rewards, multi_objective_aggregation=aggregation, num_generations=G)
    names = ["accuracy", "format", "overlong", "RustFix"]
    kept = [ScoredSample(i // G, [1], [2], sum(w * v for w, v in zip([1.0, 0.5, 2.0, 1.0], row.nan_to_num(0).tolist())),
                         False, rewards_per_func={k: None if math.isnan(v) else v for k, v in zip(names, row.tolist())})
            for i, row in enumerate(table)]
    ours = batch_advantages(kept, [G] * n_groups, cfg)
    theirs = trl_scored(table.float(), torch.tensor([1.0, 0.5, 2.0, 1.0]), G, aggregation, scale_rewards)["advantages"]
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours - theirs).abs().max()
    assert ours.abs().max() > 0.1


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min", [None, 0.85])
def test_sampler_correction_weights_equal_trls(mode, clip_min):
    """sampler_correction_weight against TRL's importance-sampling ratio (with vllm_importance_sampling_clip_min
    and clip_max), on right-padded completions whose sampler left some log-probs out (NaN)."""
    g = torch.Generator().manual_seed(5)
    B, L = 8, 5
    lengths = [5, 3, 1, 4, 5, 2, 5, 4]
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).float()
    old = -torch.rand(B, L, generator=g) * 2
    sampler = old + (0.15 if mode.startswith("sequence") else 0.3) * torch.randn(B, L, generator=g)
    sampler[1, 0] = sampler[6, 3] = float("nan")
    ours = sampler_correction_weight(old, sampler, mask, mode, 1.3, clip_min)
    theirs = trl_scored(torch.zeros(B, 1), torch.ones(1), 4, "sum_then_normalize", old=old, sampler=sampler,
                        lengths=lengths, mode=mode, clip_min=clip_min, clip_max=1.3)["importance_sampling_ratio"]
    real = mask.bool() if mode.startswith("token") else torch.ones(B, 1, dtype=torch.bool)
    assert torch.allclose(ours[real], theirs[real], rtol=1e-6, atol=1e-7), (ours - theirs).abs().max()
    if clip_min is not None:                           # the lower bound bit, as TRL applies it
        raw = torch.exp(torch.nan_to_num((old - sampler) * mask, nan=0.0))
        raw = raw if mode.startswith("token") else raw.prod(-1, keepdim=True)
        assert (raw[real] < clip_min).any()
