"""The promotion gate's statistics: does a new adapter beat the champion by more than noise?

Both adapters answer the same frozen gate questions with the same seeds and sampling, so the evidence is
paired: one score per question and adapter (`per_question_scores`, from the evaluation rows, for the
metric `tracking.best_metric` names; its mean is that metric, except that the means over completions
(accuracy, strict_pass_at_1, reward/*) weigh each completion alike and the gate each question alike, so they
part where questions have different numbers of scored samples, e.g. sampled answers the sandbox could not
score). The test is one-sided, H0 "the new adapter
is no better", and `gate.test` picks it (`resolve_test`; the default `auto` takes the first two):
  - mcnemar, the exact sign test (0/1 scores): of the questions the two answer differently, the new one
    wins b and loses c; under H0 b ~ Binomial(b + c, 1/2) and p = P(X >= b);
  - permutation, the paired sign-flip test (any scores): under H0 each question's gain is as likely
    negated, so p = share of sign-flipped mean gains >= the observed one (exact, or Monte Carlo);
  - bootstrap (any scores): resample the questions; p = share of resampled mean gains of the centred gains
    (the null made true) >= the observed mean gain; the interval's low end is reported too. It is
    asymptotic: with few questions or few that differ it errs towards promoting.
The new adapter is promoted when its mean gain is > 0 and p < 1 - confidence; a tie is never promoted.
`gate_power` and `detectable_gain` say how large a gain the default gate can see. Pure Python + numpy: the
MLflow side (which adapter is the champion, where the gate set lives) is tasks/gate.py's.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from functools import lru_cache
from statistics import mean
from typing import Callable, Iterable, Sequence

from grpo_core.evaluation.passk import pass_at_k

TESTS = ("auto", "mcnemar", "permutation", "bootstrap")
ZERO_ONE_NAMES = ("pass_at_1", "accuracy", "strict_pass_at_1", "format_rate")   # 0/1 for one answer a question
EXACT_PERMUTATION_MAX = 16      # enumerate all 2^m sign patterns up to this many differing questions


# -- per-question scores --------------------------------------------------------------------------------

def _row_value(row: dict, name: str) -> float | None:
    """One completion's value for the metric `name` (pass_at_1/accuracy, strict_pass_at_1, format_rate,
    reward/<func>); None: the completion does not count (unscored)."""
    if name in ("pass_at_1", "accuracy"):
        return None if row["correct"] is None else float(row["correct"])
    if name == "strict_pass_at_1":
        return None if row["correct"] is None else float(row["correct"] and row.get("formatted", False))
    if name == "format_rate":
        return float(row.get("formatted", False))
    if name == "reward/total":
        return row.get("reward_total")
    if name.startswith("reward/"):
        return row["rewards"].get(name[len("reward/"):])
    raise ValueError(name)


def _question_value(rows: list[dict], name: str) -> float | None:
    """One question's score from its completions: pass@k by the unbiased estimator, else the mean."""
    if (k := re.fullmatch(r"pass_at_(\d+)", name)) and int(k[1]) > 1:
        scored = [r["correct"] for r in rows if r["correct"] is not None]
        return pass_at_k(len(scored), sum(scored), int(k[1])) if len(scored) >= int(k[1]) else None
    values = [v for v in (_row_value(r, name) for r in rows) if v is not None]
    return mean(values) if values else None


def metric_parts(metric: str) -> tuple[str | None, str, str]:
    """'eval/greedy/pass_at_1' -> (None, 'greedy', 'pass_at_1'); 'eval/<source>/sampled/reward/f' -> (source,
    'sampled', 'reward/f'). ValueError naming tracking.best_metric when it is no per-question eval metric."""
    m = re.fullmatch(r"eval/(?:([^/]+)/)?(greedy|sampled)/(pass_at_\d+|accuracy|strict_pass_at_1|format_rate|"
                     r"reward/[^/]+)", metric)
    if not m:
        raise ValueError(f"tracking.best_metric {metric!r} cannot be compared question by question; the gate "
                         "needs eval/[<source>/]<greedy|sampled>/<pass_at_k|accuracy|strict_pass_at_1|format_rate|"
                         "reward/<func>>: set tracking.best_metric to one, or gate.enabled: false")
    return m[1], m[2], m[3]


def per_question_scores(rows: Iterable[dict], metric: str,
                        source_name: Callable[[str], str] = str) -> dict[str, float]:
    """{task id: score} of `metric` (an eval/... name, see metric_parts) from evaluation rows
    (grpo_core.evaluation.evaluate; `source_name` makes a row's source the metric's segment: evaluation.metric_name);
    the mean over questions is the metric (for pass@k; for a mean over completions only where every question has
    as many scored completions, see the module docstring). Rows in a foreign wording and questions with nothing to
    score are left out."""
    source, mode, name = metric_parts(metric)
    by_question: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["mode"] != mode or r.get("wording") or (source and source_name(r["source"]) != source):
            continue
        by_question[r["task_id"]].append(r)
    with_tools = any(r.get("tools") for rs in by_question.values() for r in rs)
    scores = {}
    for task_id, rs in by_question.items():
        value = _question_value([r for r in rs if r.get("tools") or not with_tools], name)
        if value is not None:
            scores[task_id] = value
    return scores


def paired(new: dict[str, float], champion: dict[str, float]) -> tuple[list[float], list[float]]:
    """The two score lists on the questions both have scores for, in one order."""
    common = sorted(new.keys() & champion.keys())
    if not common:
        raise ValueError("the new adapter and the champion have no gate question scored in common")
    if (bad := [q for q in common if not (math.isfinite(new[q]) and math.isfinite(champion[q]))]):
        raise ValueError(f"{len(bad)} gate question(s) have a score that is not a finite number (first: {bad[0]!r}); "
                         f"the gate cannot compare them: fix the reward or metric that produced it")
    return [new[q] for q in common], [champion[q] for q in common]


# -- which test -------------------------------------------------------------------------------------------

def metric_is_binary(metric: str, num_samples: int) -> bool:
    """Whether `metric` (an eval/... name, see metric_parts) scores each question 0 or 1: pass_at_1, accuracy,
    strict_pass_at_1 and format_rate of one answer a question (greedy, or sampled with eval.num_samples 1).
    pass_at_k with k > 1, means over several samples and reward/* are continuous."""
    _, mode, name = metric_parts(metric)
    if name not in ZERO_ONE_NAMES:
        return False
    return mode == "greedy" or num_samples == 1


def resolve_test(test: str, metric: str, num_samples: int) -> str:
    """The concrete test `gate.test` means for `metric`: auto -> mcnemar (0/1 scores) or permutation.
    ValueError naming gate.test and the fix when the test does not fit the metric's scores."""
    if test not in TESTS:
        raise ValueError(f"gate.test {test!r} is not one of {', '.join(TESTS)}; set gate.test: auto")
    binary = metric_is_binary(metric, num_samples)
    if test == "auto":
        return "mcnemar" if binary else "permutation"
    scores = (f"tracking.best_metric {metric!r} (eval.num_samples {num_samples}) scores each question "
              + ("0 or 1" if binary else "with fractions"))
    if test == "mcnemar" and not binary:
        raise ValueError(f"gate.test mcnemar is an exact test for 0/1 scores, and {scores}; set gate.test: auto "
                         f"(the paired permutation test) or permutation")
    if test != "mcnemar" and binary:
        why = {"bootstrap": "the bootstrap promotes too easily when few questions differ",
               "permutation": "on 0/1 scores the permutation test is the sign test, sampled when many differ"}[test]
        raise ValueError(f"gate.test {test} does not fit: {scores}, and there the exact sign test (gate.test: "
                         f"mcnemar) is the right test ({why}); set gate.test: auto or mcnemar")
    return test


# -- the tests ------------------------------------------------------------------------------------------

def _is_zero_one(values: Iterable[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def _at_least(values, threshold: float):
    """values >= threshold, forgiving float rounding: a resampled sum that equals the observed one in exact
    arithmetic can land an ulp below it."""
    return values >= threshold - 1e-9 * max(1.0, abs(threshold))


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: P(X >= wins), X ~ Binomial(wins + losses, 1/2) (1.0 when nothing differs)."""
    differing = wins + losses
    return sum(math.comb(differing, k) for k in range(wins, differing + 1)) / 2 ** differing


def mcnemar_exact(new: Sequence[float], champion: Sequence[float]) -> float:
    """One-sided exact McNemar p-value for 0/1 scores: the sign test on b, the questions only the new adapter
    gets right, against c, those only the champion does."""
    if not _is_zero_one([*new, *champion]):
        raise ValueError("gate.test mcnemar needs 0/1 scores per question (e.g. tracking.best_metric "
                         "eval/greedy/pass_at_1); use gate.test: auto or permutation for this metric")
    b = sum(1 for x, y in zip(new, champion) if x > y)
    c = sum(1 for x, y in zip(new, champion) if x < y)
    return sign_test_p(b, c)


def _all_sign_patterns(m: int):
    """Every vector of m signs, one a row: (2^m, m) of +-1."""
    import numpy as np
    bits = (np.arange(2 ** m)[:, None] >> np.arange(m)) & 1                           # (2^m, m)
    return 2.0 * bits - 1.0


def sign_flip_permutation(new: Sequence[float], champion: Sequence[float], resamples: int = 10_000,
                          seed: int = 0) -> float:
    """One-sided paired permutation test of the mean gain new - champion. Under H0 each question's gain is as
    likely to be +g as -g; p = share of sign-flipped gains whose sum is >= the observed sum (sums order like
    means: n is fixed). Gains of 0 flip to themselves and are left out. Exact over all 2^m patterns of the m
    non-zero gains when m <= EXACT_PERMUTATION_MAX (on 0/1 scores this is the sign test), else Monte Carlo:
    p = (1 + #{flipped >= observed}) / (1 + resamples)."""
    import numpy as np
    gains = np.asarray(new, dtype=float) - np.asarray(champion, dtype=float)
    gains = gains[gains != 0]                                                           # (m,)
    observed = gains.sum()
    if len(gains) <= EXACT_PERMUTATION_MAX:
        flipped = _all_sign_patterns(len(gains)) @ gains                                # (2^m,)
        return float(_at_least(flipped, observed).mean())
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(resamples, len(gains)))                      # (B, m)
    flipped = signs @ gains                                                             # (B,)
    return float((1 + _at_least(flipped, observed).sum()) / (1 + resamples))


def paired_bootstrap(new: Sequence[float], champion: Sequence[float], confidence: float = 0.95,
                     resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """One-sided paired bootstrap of the mean gain new - champion -> (p-value, low end of the one-sided
    `confidence` interval of the gain). The p-value resamples under the null: the gains minus their mean,
    p = (1 + #{resampled centred mean >= observed mean}) / (1 + resamples)."""
    import numpy as np
    gains = np.asarray(new, dtype=float) - np.asarray(champion, dtype=float)          # (n,)
    observed = gains.mean()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(gains), size=(resamples, len(gains)))                 # (B, n)
    means = gains[picks].mean(axis=1)                                                 # (B,)
    centred_means = means - observed            # the same resamples of gains - mean(gains)
    p = (1 + _at_least(centred_means, observed).sum()) / (1 + resamples)
    return float(p), float(np.quantile(means, 1 - confidence))


# -- the decision ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GateDecision:
    """What the gate decided and why, in the figures the run's last line and the MLflow tags show."""
    promote: bool
    new_score: float | None = None
    champion_score: float | None = None
    p_value: float | None = None
    gain_low: float | None = None          # low end of the one-sided interval of the gain (bootstrap)
    questions: int = 0
    test: str = ""                         # the concrete test: mcnemar | permutation | bootstrap
    reason: str = ""                       # first champion | better | not better | forced | ...

    def as_dict(self) -> dict:
        return asdict(self)


def decide(new: dict[str, float], champion: dict[str, float], confidence: float = 0.95, test: str = "auto",
           resamples: int = 10_000, seed: int = 0) -> GateDecision:
    """Promote when the new adapter's mean gain is > 0 and the paired one-sided `test` rejects "no better" at
    `confidence` (p < 1 - confidence). `auto` picks from the scores: all 0/1 -> mcnemar, else permutation
    (resolve_test picks from the metric's name, as the config does)."""
    a, b = paired(new, champion)
    if test == "auto":
        test = "mcnemar" if _is_zero_one([*a, *b]) else "permutation"
    gain_low = None
    if test == "mcnemar":
        p = mcnemar_exact(a, b)
    elif test == "permutation":
        p = sign_flip_permutation(a, b, resamples, seed)
    elif test == "bootstrap":
        p, gain_low = paired_bootstrap(a, b, confidence, resamples, seed)
    else:
        raise ValueError(f"gate.test {test!r} is not one of {', '.join(TESTS)}; set gate.test: auto")
    promote = mean(a) > mean(b) and p < 1 - confidence
    return GateDecision(promote, mean(a), mean(b), p, gain_low, len(a), test, "better" if promote else "not better")


def summary_line(d: GateDecision, metric: str, confidence: float, version: str) -> str:
    """The one line a run ends with about the gate."""
    if d.reason == "first champion":
        return f"gate: version {version} is the task's first champion (there was none to beat)"
    figures = (f"new {d.new_score:.3f} vs champion {d.champion_score:.3f} on {d.questions} gate questions "
               f"({metric}; {d.test} p={d.p_value:.3f}"
               + (f", {confidence:.0%} low end of the gain {d.gain_low:+.3f}" if d.gain_low is not None else "")
               + ")") if d.p_value is not None else d.reason
    if d.reason == "forced":
        return f"gate: version {version} took `champion` by --force-promote: {figures}"
    if d.promote:
        return f"gate: version {version} promoted to `champion`: {figures}"
    return f"gate: version {version} NOT promoted (kept without `champion`): {figures}"


# -- power: how large a gain can the default gate see? --------------------------------------------------

DIFFICULTY_CONCENTRATION = 1.0      # a + b of the Beta of per-question right-probabilities; 1: U-shaped


def discordant_rates(p_champion: float, gain: float,
                     concentration: float = DIFFICULTY_CONCENTRATION) -> tuple[float, float]:
    """(win, loss): the chance that a gate question is answered right by the new adapter only, and by the
    champion only, under gate_power's model."""
    if not 0 < p_champion < 1 or not 0 <= gain <= 1 - p_champion:
        raise ValueError(f"the champion's accuracy must lie in (0, 1) and the gain in [0, 1 - accuracy]; got "
                         f"{p_champion} and {gain}")
    fixed_share = gain / (1 - p_champion)                                   # r: the champion's misses it fixes
    difficulty_variance = p_champion * (1 - p_champion) / (concentration + 1)         # Var(pi)
    right_then_wrong = p_champion * (1 - p_champion) - difficulty_variance            # E[pi (1 - pi)]
    wrong_twice = (1 - p_champion) ** 2 + difficulty_variance                         # E[(1 - pi)^2]
    win = right_then_wrong + fixed_share * wrong_twice
    loss = (1 - fixed_share) * right_then_wrong
    return win, loss


def _binomial_pmf(k: int, n: int, prob: float) -> float:
    """P(X = k), X ~ Binomial(n, prob), in logs so that large n does not overflow."""
    if prob in (0.0, 1.0):
        return float(k == n * prob)
    return math.exp(math.log(math.comb(n, k)) + k * math.log(prob) + (n - k) * math.log1p(-prob))


@lru_cache(maxsize=None)
def sign_test_critical_wins(differing: int, alpha: float) -> int:
    """The fewest wins out of `differing` questions that the sign test finds significant (p < alpha);
    differing + 1 when no count is."""
    wins = 0
    while wins <= differing and sign_test_p(wins, differing - wins) >= alpha:
        wins += 1
    return wins


def gate_power(n: int, p_champion: float, gain: float, alpha: float = 0.05,
               concentration: float = DIFFICULTY_CONCENTRATION) -> float:
    """The chance that the default gate on 0/1 scores (the exact sign test, p < alpha) promotes a new adapter
    whose true accuracy is p_champion + gain, on n gate questions. The model:
      - the n questions are independent;
      - question i has a difficulty: the champion is right with probability pi_i ~ Beta(p κ, (1 - p) κ), mean
        p = p_champion, κ = concentration (1: U-shaped, most questions nearly always or never solved, like
        real runs' per-question pass rates);
      - the new adapter fixes the same share r = gain / (1 - p) of the champion's misses on every question: it
        is right with probability pi_i + r (1 - pi_i), so its accuracy is p + gain;
      - given pi_i the two answers are independent: they agree more than chance only through the difficulty.
    Each question is then a win with probability q_win = E[pi (1 - pi)] + r E[(1 - pi)^2] and a loss with
    q_loss = (1 - r) E[pi (1 - pi)] (discordant_rates). Exactly: the differing questions D ~ Binomial(n, q_win +
    q_loss), the wins given D ~ Binomial(D, q_win / (q_win + q_loss)), and the power is the sum over D of
    P(D) P(wins >= the sign test's critical count | D)."""
    win, loss = discordant_rates(p_champion, gain, concentration)
    win_share = win / (win + loss)
    power = 0.0
    for differing in range(n + 1):
        needed = sign_test_critical_wins(differing, alpha)
        promoted = sum(_binomial_pmf(w, differing, win_share) for w in range(needed, differing + 1))
        power += _binomial_pmf(differing, n, win + loss) * promoted
    return power


def detectable_gain(n: int, p_champion: float, alpha: float = 0.05, power: float = 0.8,
                    concentration: float = DIFFICULTY_CONCENTRATION) -> float:
    """The smallest true gain in accuracy (a share of questions: 0.1 = 10 points) that the default gate on n
    questions promotes with at least `power` under gate_power's model; math.inf when even a new adapter that
    never misses (gain 1 - p_champion) falls short. By bisection: the power grows with the gain."""
    low, high = 0.0, 1 - p_champion
    if gate_power(n, p_champion, high, alpha, concentration) < power:
        return math.inf
    for _ in range(40):
        middle = (low + high) / 2
        if gate_power(n, p_champion, middle, alpha, concentration) >= power:
            high = middle
        else:
            low = middle
    return high


def power_table(sizes: Sequence[int] = (40, 100, 200), champion_accuracies: Sequence[float] = (0.2, 0.35, 0.5, 0.7),
                gain: float = 0.10, alpha: float = 0.05) -> str:
    """The default gate's power for a true `gain` and its detectable gain at 80% power, one row per gate size and
    champion accuracy (`python -m grpo_core.evaluation.gate` prints it)."""
    lines = [f"sign test, alpha {alpha}, Beta difficulty with concentration {DIFFICULTY_CONCENTRATION}",
             f"{'questions':>9}  {'champion':>8}  {f'power at +{gain * 100:.0f} points':>20}  {'gain seen 80%':>13}"]
    for n in sizes:
        for p in champion_accuracies:
            power = gate_power(n, p, min(gain, 1 - p), alpha)
            seen = detectable_gain(n, p, alpha)
            lines.append(f"{n:>9}  {p:>8.2f}  {power:>20.3f}  {seen * 100:>10.1f} pt")
    return "\n".join(lines)


if __name__ == "__main__":
    print(power_table())
