"""The promotion gate's statistics against issue #47: tests chosen by the metric, p-values that hold their
level, and the power of the default gate (grpo_core/evaluation/gate.py).

The simulations model gates as the pipeline makes them. Per-question right-probabilities are drawn from
Beta(0.35, 0.65): mean 0.35, U-shaped (about 29% of questions below 0.05 and 6% above 0.95), because a
small model solves most questions nearly always or never, with a minority in between; it is the model
gate_power assumes (concentration 1). Given those probabilities every adapter's answers are independent. A
run evaluates 4 iterations on its eval split (40 questions of their own) and registers the best; the gate
then compares it with the champion on 40 other questions. Everything is vectorised: the file runs in a few
seconds. `python -m tests.test_gate_stats` prints the figures docs/operations.md quotes."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from grpo_core.evaluation import gate
from grpo_core.config import ConfigError, load_config

ALPHA = 0.05                     # the default gate.confidence 0.95
GATE_QUESTIONS = 40
EVAL_QUESTIONS = 40
ITERATIONS = 4                   # evaluated iterations a run picks its registered one from
DIFFICULTY = (0.35, 0.65)        # Beta(a, b) of the per-question right-probabilities: mean 0.35, a + b = 1
GATES = 4000                     # simulated gates per figure
OLD_BOOTSTRAP_RESAMPLES = 2000


def _scores(values):
    return {f"q{i}": float(v) for i, v in enumerate(values)}


# -- the tests on cases worked by hand -------------------------------------------------------------------------

def test_three_wins_and_no_loss_out_of_20_is_not_enough():
    """Issue #47: the old bootstrap gave p ~ 0.04 and promoted; the sign test gives (1/2)^3."""
    d = gate.decide(_scores([1, 1, 1] + [0] * 17), _scores([0] * 20))
    assert d.test == "mcnemar" and d.p_value == 0.125 and not d.promote


def test_one_won_question_of_one_gives_p_one_half():
    """The old bootstrap gave p = 0 here: every resample of one winning question wins."""
    d = gate.decide({"q": 1.0}, {"q": 0.0})
    assert d.p_value == 0.5 and not d.promote


@pytest.mark.parametrize("wins, losses", [(0, 0), (3, 0), (5, 2), (9, 1), (2, 7)])
def test_the_permutation_test_on_0_1_scores_is_the_sign_test(wins, losses):
    new = [1] * wins + [0] * losses + [1, 0, 0]
    champion = [0] * wins + [1] * losses + [1, 0, 0]
    assert gate.sign_flip_permutation(new, champion) == pytest.approx(gate.sign_test_p(wins, losses))


def test_the_permutation_test_enumerates_every_sign_pattern():
    """Gains 1/2, 1/4, -1/8 and a tie: the 8 patterns of +-1/2 +-1/4 +-1/8 sum to +-7/8, +-5/8, +-3/8, +-1/8;
    the observed 5/8 is reached by 5/8 and 7/8: p = 2/8. Gains all positive: only the observed pattern, 1/8."""
    assert gate.sign_flip_permutation([0.5, 0.25, 0.0, 0.5], [0, 0, 0.125, 0.5]) == 2 / 8
    assert gate.sign_flip_permutation([0.5, 0.25, 0.125], [0, 0, 0]) == 1 / 8
    assert gate.sign_flip_permutation([0.3, 0.3], [0.3, 0.3]) == 1.0                  # nothing differs


def test_the_permutation_test_by_monte_carlo_agrees_with_the_exact_one(monkeypatch):
    """20 differing questions: 2^20 patterns is past the exact limit; the Monte Carlo p is within its error."""
    rng = np.random.default_rng(5)
    new, champion = rng.uniform(0.2, 1.0, 20), rng.uniform(0.0, 0.8, 20)
    sampled = gate.sign_flip_permutation(new, champion, resamples=20_000, seed=1)
    assert gate.sign_flip_permutation([1.0] * 20, [0.0] * 20, resamples=999, seed=0) == 1 / 1000   # (1 + 0) / (1 + B)
    monkeypatch.setattr(gate, "EXACT_PERMUTATION_MAX", 20)
    exact = gate.sign_flip_permutation(new, champion)
    assert 0 < exact < 0.5 and sampled == pytest.approx(exact, abs=3 * math.sqrt(exact / 20_000) + 1e-4)


def test_the_centred_bootstrap_gives_about_one_half_without_a_gain():
    gains = np.random.default_rng(2).normal(size=30)
    gains -= gains.mean()                                          # no mean gain at all
    p, low = gate.paired_bootstrap(gains, np.zeros(30), resamples=20_000, seed=3)
    assert p == pytest.approx(0.5, abs=0.03) and low < 0


def test_auto_picks_the_permutation_test_for_fractional_scores():
    d = gate.decide(_scores([0.5, 0.75, 1.0, 0.25]), _scores([0.25, 0.5, 0.5, 0.0]))
    assert d.test == "permutation" and d.p_value == 1 / 16 and not d.promote


@pytest.mark.parametrize("test", ["mcnemar", "permutation", "bootstrap"])
def test_a_loss_is_never_promoted_even_at_a_lax_confidence(test):
    d = gate.decide(_scores([0, 1, 0, 1, 1]), _scores([1, 1, 1, 0, 1]), confidence=0.5, test=test)
    assert d.p_value >= 0.5 and not d.promote


# -- which test fits which metric ---------------------------------------------------------------------------------

@pytest.mark.parametrize("metric, num_samples, binary", [
    ("eval/greedy/pass_at_1", 4, True),
    ("eval/greedy/accuracy", 0, True),
    ("eval/greedy/strict_pass_at_1", 2, True),
    ("eval/arithmetic/greedy/format_rate", 2, True),
    ("eval/sampled/pass_at_1", 1, True),
    ("eval/sampled/format_rate", 1, True),
    ("eval/sampled/pass_at_1", 4, False),             # the mean of 4 answers
    ("eval/sampled/pass_at_4", 4, False),
    ("eval/greedy/reward/total", 1, False),
    ("eval/sampled/reward/accuracy", 1, False),
])
def test_which_metrics_score_0_or_1(metric, num_samples, binary):
    assert gate.metric_is_binary(metric, num_samples) is binary
    assert gate.resolve_test("auto", metric, num_samples) == ("mcnemar" if binary else "permutation")


@pytest.mark.parametrize("test, metric, num_samples, says", [
    ("mcnemar", "eval/sampled/pass_at_1", 4, "gate.test mcnemar is an exact test for 0/1 scores"),
    ("mcnemar", "eval/greedy/reward/total", 1, "set gate.test: auto"),
    ("bootstrap", "eval/greedy/pass_at_1", 1, "gate.test bootstrap does not fit"),
    ("permutation", "eval/sampled/pass_at_1", 1, "the exact sign test (gate.test: mcnemar) is the right test"),
    ("sign", "eval/greedy/pass_at_1", 1, "gate.test 'sign' is not one of auto, mcnemar, permutation, bootstrap"),
])
def test_a_test_that_does_not_fit_the_metric_is_refused(test, metric, num_samples, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        gate.resolve_test(test, metric, num_samples)


@pytest.mark.parametrize("test, metric, fits", [
    ("mcnemar", "eval/greedy/pass_at_1", True),
    ("permutation", "eval/sampled/pass_at_2", True),
    ("bootstrap", "eval/greedy/reward/total", True),
    ("bootstrap", "eval/greedy/pass_at_1", False),
    ("mcnemar", "eval/sampled/pass_at_2", False),
])
def test_the_config_refuses_a_gate_test_that_does_not_fit_at_load(test, metric, fits):
    overrides = [f"gate.test={test}", f"tracking.best_metric={metric}", "eval.num_samples=2"]
    if fits:
        assert load_config(overrides=overrides).gate.test == test
        return
    with pytest.raises(ConfigError, match=r"gate.test .*set gate.test: auto"):
        load_config(overrides=overrides)


def test_the_default_config_uses_the_exact_sign_test():
    cfg = load_config()
    assert cfg.gate.test == "auto"
    assert gate.resolve_test(cfg.gate.test, cfg.tracking.best_metric, cfg.eval.num_samples) == "mcnemar"


# -- power ---------------------------------------------------------------------------------------------------------

def test_the_power_model_by_hand():
    """win - loss is the gain; the rates match the Beta model integrated by sampling; no gain gives the size."""
    win, loss = gate.discordant_rates(0.35, 0.10)
    assert win - loss == pytest.approx(0.10)
    pi = np.random.default_rng(0).beta(*DIFFICULTY, size=2_000_000)
    new_right = pi + 0.10 / 0.65 * (1 - pi)
    assert win == pytest.approx(np.mean(new_right * (1 - pi)), abs=1e-3)
    assert loss == pytest.approx(np.mean(pi * (1 - new_right)), abs=1e-3)
    assert 0 < gate.gate_power(GATE_QUESTIONS, 0.35, 0.0) <= ALPHA
    assert gate.gate_power(40, 0.35, 0.05) < gate.gate_power(40, 0.35, 0.10) < gate.gate_power(100, 0.35, 0.10)


def test_the_detectable_gain_has_the_power_asked_for():
    seen = gate.detectable_gain(GATE_QUESTIONS, 0.35, ALPHA, power=0.8)
    assert 0 < seen < 0.65 and gate.gate_power(GATE_QUESTIONS, 0.35, seen) == pytest.approx(0.8, abs=1e-6)
    assert gate.detectable_gain(5, 0.9, ALPHA) == math.inf           # 5 questions cannot show 10 points at 80%


# -- simulated gates -------------------------------------------------------------------------------------------

def answers(rng, right_probability, copies: int = 1):
    """0/1 answers: (copies, *shape) independent draws, each right with its question's probability."""
    return (rng.random((copies, *right_probability.shape)) < right_probability).astype(float)


def registered_and_champion(rng, gates: int, pick_on: str):
    """Gate answers (gates, GATE_QUESTIONS) of the registered iteration and of the champion, all of equal
    quality (H0): the best of ITERATIONS iterations by their score on the eval split ("eval", as the pipeline
    picks it now) or on the gate questions themselves ("gate", the winner's curse)."""
    gate_pi = rng.beta(*DIFFICULTY, size=(gates, GATE_QUESTIONS))                # (G, n)
    eval_pi = rng.beta(*DIFFICULTY, size=(gates, EVAL_QUESTIONS))                # (G, m)
    champion = answers(rng, gate_pi)[0]                                          # (G, n)
    on_gate = answers(rng, gate_pi, ITERATIONS).transpose(1, 0, 2)               # (G, I, n)
    on_eval = answers(rng, eval_pi, ITERATIONS).transpose(1, 0, 2)               # (G, I, m)
    picked_by = on_eval if pick_on == "eval" else on_gate
    best = picked_by.sum(axis=2).argmax(axis=1)                                  # (G,) first best on a tie
    return on_gate[np.arange(gates), best], champion


def gate_promotion_rate(new, champion) -> float:
    """The share of gates grpo_core.evaluation.gate.decide promotes at the default confidence."""
    promoted = [gate.decide(_scores(a), _scores(b)).promote for a, b in zip(new, champion)]
    return float(np.mean(promoted))


def old_bootstrap_promotion_rate(rng, new, champion) -> float:
    """What the gate did before issue #47: p = share of bootstrap resamples whose mean gain is <= 0. A resample
    of n questions draws w wins, l losses and ties with the sample's shares: w ~ Binomial(n, b/n), then
    l ~ Binomial(n - w, c/(n - b)); its mean gain is <= 0 when w <= l. 1000 gates at a time bound the memory."""
    n = new.shape[1]
    wins, losses = (new > champion).sum(axis=1), (new < champion).sum(axis=1)             # (G,)
    loss_share = np.where(wins < n, losses / np.maximum(n - wins, 1), 0.0)
    p_old = []
    for start in range(0, len(wins), 1000):
        chunk = slice(start, start + 1000)
        draws = (OLD_BOOTSTRAP_RESAMPLES, len(wins[chunk]))
        drawn_wins = rng.binomial(n, wins[chunk] / n, size=draws)                         # (B, g)
        drawn_losses = rng.binomial(n - drawn_wins, loss_share[chunk])                     # (B, g)
        p_old.append((drawn_wins <= drawn_losses).mean(axis=0))                           # (g,)
    return float(np.mean(np.concatenate(p_old) < ALPHA))


def level_bound(gates: int) -> float:
    """alpha plus two Monte Carlo standard errors of a promotion rate that is exactly alpha."""
    return ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / gates)


def power_simulation(rng, gates: int, p_champion: float, gain: float) -> float:
    """The promotion rate of an adapter truly `gain` better, under gate_power's model (picking it among equal
    iterations on the separate eval split would not change its gate answers' law)."""
    concentration = gate.DIFFICULTY_CONCENTRATION
    gate_pi = rng.beta(p_champion * concentration, (1 - p_champion) * concentration, size=(gates, GATE_QUESTIONS))
    new_pi = gate_pi + gain / (1 - p_champion) * (1 - gate_pi)
    return gate_promotion_rate(answers(rng, new_pi)[0], answers(rng, gate_pi)[0])


def test_the_gate_holds_its_level_when_the_iteration_is_picked_on_the_eval_split():
    new, champion = registered_and_champion(np.random.default_rng(47), GATES, pick_on="eval")
    assert gate_promotion_rate(new, champion) <= level_bound(GATES)


def test_the_simulation_catches_a_bad_gate_winners_curse_and_old_bootstrap():
    """The same simulation flags the old gate: the iteration picked on the gate questions and the uncentred
    bootstrap p-value promote an adapter no better than the champion well above alpha."""
    rng = np.random.default_rng(48)
    new, champion = registered_and_champion(rng, GATES, pick_on="gate")
    assert old_bootstrap_promotion_rate(rng, new, champion) > level_bound(GATES)


def test_the_simulated_power_at_ten_points_is_what_gate_power_says():
    simulated = power_simulation(np.random.default_rng(49), GATES, 0.35, 0.10)
    exact = gate.gate_power(GATE_QUESTIONS, 0.35, 0.10, ALPHA)
    assert simulated == pytest.approx(exact, abs=3 * math.sqrt(exact * (1 - exact) / GATES))


def print_figures(gates: int = GATES) -> None:
    """The figures docs/operations.md quotes, from the tests' seeds."""
    se = math.sqrt(ALPHA * (1 - ALPHA) / gates)
    print(f"{gates} simulated gates of {GATE_QUESTIONS} questions, alpha {ALPHA}: Monte Carlo error at alpha "
          f"{se:.4f}, bound {level_bound(gates):.4f}")
    for pick_on, seed in (("eval", 47), ("gate", 48)):
        rng = np.random.default_rng(seed)
        new, champion = registered_and_champion(rng, gates, pick_on)
        sign_test = gate_promotion_rate(new, champion)
        print(f"picked on the {pick_on} questions: the gate (sign test) promotes {sign_test:.4f}, the old "
              f"bootstrap {old_bootstrap_promotion_rate(rng, new, champion):.4f}")
    simulated = power_simulation(np.random.default_rng(49), gates, 0.35, 0.10)
    exact = gate.gate_power(GATE_QUESTIONS, 0.35, 0.10, ALPHA)
    print(f"power at +10 points from 0.35: simulated {simulated:.4f} +- {math.sqrt(exact * (1 - exact) / gates):.4f}, "
          f"gate_power {exact:.4f}")


if __name__ == "__main__":
    import sys
    print_figures(int(sys.argv[1]) if len(sys.argv) > 1 else GATES)
