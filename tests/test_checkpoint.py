"""grpo_core.update.checkpoint on a real tiny LoRA policy: a run resumed from a checkpoint takes the same
next step as the run that kept going (adapter, AdamW moments, LR schedule, global step), every random
stream continues where it was saved, and a checkpoint is written whole or not at all."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import grpo_core.update.checkpoint as checkpoint_module
from grpo_core.update.checkpoint import ADAPTER_DIR, STATE_FILE, load_trainer_state, save_checkpoint
from grpo_core.config import GRPOConfig
from grpo_core.model.policy import load_policy
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler

G = 4


def tiny_run(checkpoint=None, **over):
    """Policy, AdamW and a warmup + linear schedule on the tiny model (fresh, or the adapter in `checkpoint`)."""
    cfg = GRPOConfig(**{**dict(model="tiny-random", device="cpu", dtype="float32", num_generations=G,
                               max_completion_length=6, lora_r=4, lora_alpha=8, learning_rate=1e-2,
                               pipeline_iterations=4, warmup_ratio=0.25, lr_scheduler_type="linear"), **over})
    torch.manual_seed(0)
    policy = load_policy(cfg, checkpoint)
    if checkpoint is None:
        for name, p in policy.model.named_parameters():      # a non-zero adapter, so the update moves it
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2)
    optimizer = make_optimizer(policy, cfg)
    return cfg, policy, optimizer, make_scheduler(optimizer, cfg)


def samples(seed: int) -> list[ScoredSample]:
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(10, 90) for _ in range(4)]
        out += [ScoredSample(g, prompt, [rng.randrange(10, 90) for _ in range(rng.randint(1, 6))],
                             float(rng.randint(0, 1)), False) for _ in range(G)]
    return out


def random_draws() -> tuple:
    return random.random(), np.random.rand(), torch.rand(3).tolist()


def test_resumed_run_continues_like_the_uninterrupted_one(grpo_home, tmp_path):
    cfg, policy, optimizer, scheduler = tiny_run()
    grpo_update(policy, optimizer, scheduler, samples(0), cfg, seed=0)
    out = save_checkpoint(policy, optimizer, scheduler, global_step=1, out=tmp_path / "update")
    assert sorted(p.name for p in out.iterdir()) == sorted([ADAPTER_DIR, STATE_FILE])
    # the run that keeps going: its random draws, then its next step
    draws = random_draws()
    next_metrics, _, _ = grpo_update(policy, optimizer, scheduler, samples(1), cfg, seed=1)
    kept_going = [p.detach().clone() for p in policy.trainable_parameters()]

    random_draws()                                           # move every stream on before resuming
    cfg, policy, optimizer, scheduler = tiny_run(out / ADAPTER_DIR)
    assert load_trainer_state(out / STATE_FILE, optimizer, scheduler) == 1
    assert random_draws() == draws
    resumed_metrics, _, _ = grpo_update(policy, optimizer, scheduler, samples(1), cfg, seed=1)
    assert resumed_metrics[0]["learning_rate"] == next_metrics[0]["learning_rate"]
    assert resumed_metrics[0]["loss"] == next_metrics[0]["loss"]
    for a, b in zip(kept_going, policy.trainable_parameters()):
        assert torch.equal(a, b)


def test_adaptive_entropy_coefficient_survives_a_resume(grpo_home, tmp_path):
    """use_adaptive_entropy: the coefficient and the entropy last measured are in trainer_state.pt (with the
    scheduler's state) and come back with it, so the resumed step applies what the uninterrupted one does."""
    over = dict(use_adaptive_entropy=True, entropy_coef=0.0, entropy_coef_delta=0.01, entropy_target=100.0)
    cfg, policy, optimizer, scheduler = tiny_run(**over)
    for k in range(2):                                        # two steps below the target: 0 -> .01 -> .02
        grpo_update(policy, optimizer, scheduler, samples(k), cfg, seed=k)
    out = save_checkpoint(policy, optimizer, scheduler, global_step=2, out=tmp_path / "update")
    saved = torch.load(out / STATE_FILE, weights_only=False)["scheduler"]["entropy"]
    assert saved["coef"] == pytest.approx(0.02) and saved["last_entropy"] < 100.0
    next_metrics, _, _ = grpo_update(policy, optimizer, scheduler, samples(2), cfg, seed=2)
    assert next_metrics[0]["entropy_coef_applied"] == pytest.approx(0.02)
    assert next_metrics[0]["entropy_coef"] == pytest.approx(0.03)

    cfg, policy, optimizer, scheduler = tiny_run(out / ADAPTER_DIR, **over)
    assert scheduler.entropy.coef == 0.0                      # a fresh schedule starts from entropy_coef
    load_trainer_state(out / STATE_FILE, optimizer, scheduler)
    assert scheduler.entropy.state_dict() == saved
    resumed_metrics, _, _ = grpo_update(policy, optimizer, scheduler, samples(2), cfg, seed=2)
    for key in ("entropy_coef_applied", "entropy_coef", "loss"):
        assert resumed_metrics[0][key] == next_metrics[0][key], key


def test_no_state_means_step_zero():
    assert load_trainer_state(None, None, None) == 0


def test_failed_build_leaves_no_directory(grpo_home, tmp_path, monkeypatch):
    """The adapter is written, then the trainer state fails: neither a new nor a temp directory remains,
    and a checkpoint already at `out` survives a failed rewrite."""
    cfg, policy, optimizer, scheduler = tiny_run()
    parent = tmp_path / "iter-0"
    parent.mkdir()

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(checkpoint_module.torch, "save", failing_save)
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(policy, optimizer, scheduler, 0, parent / "update")
    assert list(parent.iterdir()) == []

    out = save_checkpoint(policy, optimizer, scheduler, 3, parent / "update")
    with monkeypatch.context() as m:
        m.setattr(checkpoint_module.torch, "save", failing_save)
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(policy, optimizer, scheduler, 4, out)
    assert [p.name for p in parent.iterdir()] == ["update"]
    assert load_trainer_state(out / STATE_FILE, optimizer, scheduler) == 3
