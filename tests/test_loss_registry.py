"""A loss type is one registration (grpo_core/update/loss.py: LOSS_TYPES). A toy loss type `triple`, added to
the registry here and nowhere else, is accepted by the config, trains through a real `grpo_update` step on the
tiny model with its own per-token objective (three times bnpo's surrogate, bnpo's reduction) and logs the
statistics its objective measured; an unknown loss type is refused, naming the known ones."""
from __future__ import annotations

import pytest
import torch

from grpo_core.config import ConfigError, load_config
from grpo_core.update import loss
from grpo_core.update.step import grpo_update, make_scheduler
from test_update import RecordingSGD, make_samples, tiny_policy


def triple_objective(x: loss.PolicyInputs, s: loss.LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = -3 * A * rho per token, and the share of tokens it saw (1: every one)."""
    return -3.0 * x.advantages * x.ratio, {"triple/seen_frac": torch.ones_like(x.mask)}


TRIPLE = loss.LossType(triple_objective, loss.TOKEN_MEAN)


@pytest.fixture
def triple_registered(monkeypatch):
    monkeypatch.setitem(loss.LOSS_TYPES, "triple", TRIPLE)


def one_step(loss_type: str) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One on-policy optimizer step (beta = 0) of `loss_type` from the same adapter on the same samples:
    (its metrics, the gradient it applied)."""
    cfg, policy = tiny_policy(loss_type=loss_type, beta=0.0)
    opt = RecordingSGD(policy.trainable_parameters(), lr=0.1)
    metrics = grpo_update(policy, opt, make_scheduler(opt, cfg), make_samples(2, seed=4), cfg, seed=0)[0]
    assert len(metrics) == len(opt.grads) == 1
    return metrics[0], opt.grads[0]


def test_a_loss_type_registered_in_a_test_alone_trains_with_its_own_objective(grpo_home, triple_registered):
    assert load_config(None, ["loss_type=triple"]).loss_type == "triple"
    triple, triple_grads = one_step("triple")
    bnpo, bnpo_grads = one_step("bnpo")
    # on-policy rho = 1: bnpo's gradient is that of -A * rho, token-averaged; the toy's is three times it
    assert any(g.abs().sum() > 0 for g in bnpo_grads)
    for ours, theirs in zip(triple_grads, bnpo_grads):
        assert torch.allclose(ours, 3.0 * theirs, rtol=1e-4, atol=1e-7)
    assert triple["loss"] == pytest.approx(3.0 * bnpo["loss"], rel=1e-5, abs=1e-7)
    assert triple["triple/seen_frac"] == 1.0 and "triple/seen_frac" not in bnpo
    assert triple["clip_ratio/region_mean"] == 0.0                       # no clip: the default clip_region


def test_an_unknown_loss_type_is_refused_naming_the_known_ones(triple_registered):
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["loss_type=ppo"])
    assert ("config field 'loss_type': must be 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', "
            "'vespo' or 'triple', got 'ppo'") in str(refused.value)
    with pytest.raises(ValueError, match="loss_type must be one of grpo, .*, vespo, triple, not 'ppo'"):
        loss.loss_type_named("ppo")


def test_without_the_registration_the_toy_is_unknown():
    with pytest.raises(ConfigError, match="got 'triple'"):
        load_config(None, ["loss_type=triple"])
