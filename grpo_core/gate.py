"""The promotion gate's statistics: does a new adapter beat the champion by more than noise?

Both adapters answer the same frozen gate questions with the same seeds and sampling, so the evidence is
paired: one score per question and adapter (`per_question_scores`, from the evaluation rows, for the
metric `tracking.best_metric` names; its mean is that metric). The test is one-sided, H0 "the new adapter
is no better":
  - paired bootstrap (any scores): resample the questions with replacement; the p-value is the share of
    resamples whose mean gain is <= 0, the interval's low end the (1 - confidence) quantile of the gains;
  - exact McNemar (0/1 scores): of the questions the two answer differently, the new one wins b and loses
    c; under H0 b ~ Binomial(b + c, 1/2) and p = P(X >= b).
The new adapter is promoted when p < 1 - confidence; a tie is never promoted. Pure Python + numpy: the
MLflow side (which adapter is the champion, where the gate set lives) is tasks/gate.py's.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from statistics import mean
from typing import Callable, Iterable, Sequence

from grpo_core.passk import pass_at_k

TESTS = ("bootstrap", "mcnemar")


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
    (grpo_core.evaluation; `source_name` makes a row's source the metric's segment: evaluation.metric_name);
    the mean over questions is the metric. Rows in a foreign wording and questions with nothing to score are
    left out."""
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
    return [new[q] for q in common], [champion[q] for q in common]


# -- the tests ------------------------------------------------------------------------------------------

def paired_bootstrap(new: Sequence[float], champion: Sequence[float], confidence: float = 0.95,
                     resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """One-sided paired bootstrap of the mean gain new - champion -> (p-value, low end of the one-sided
    `confidence` interval of the gain). p = share of resampled mean gains <= 0."""
    import numpy as np
    gains = np.asarray(new, dtype=float) - np.asarray(champion, dtype=float)          # (n,)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(gains), size=(resamples, len(gains)))                 # (B, n)
    means = gains[picks].mean(axis=1)                                                 # (B,)
    return float((means <= 0).mean()), float(np.quantile(means, 1 - confidence))


def mcnemar_exact(new: Sequence[float], champion: Sequence[float]) -> float:
    """One-sided exact McNemar p-value for 0/1 scores: P(X >= b), X ~ Binomial(b + c, 1/2), where b counts the
    questions only the new adapter gets right and c those only the champion does (1.0 when none differ)."""
    if any(v not in (0.0, 1.0) for v in [*new, *champion]):
        raise ValueError("gate.test mcnemar needs 0/1 scores per question (e.g. tracking.best_metric "
                         "eval/greedy/pass_at_1); use gate.test: bootstrap for this metric")
    b = sum(1 for x, y in zip(new, champion) if x > y)
    c = sum(1 for x, y in zip(new, champion) if x < y)
    return sum(math.comb(b + c, k) for k in range(b, b + c + 1)) / 2 ** (b + c)


@dataclass(frozen=True)
class GateDecision:
    """What the gate decided and why, in the figures the run's last line and the MLflow tags show."""
    promote: bool
    new_score: float | None = None
    champion_score: float | None = None
    p_value: float | None = None
    gain_low: float | None = None          # low end of the one-sided interval of the gain (bootstrap)
    questions: int = 0
    test: str = ""
    reason: str = ""                       # first champion | better | not better | forced | ...

    def as_dict(self) -> dict:
        return asdict(self)


def decide(new: dict[str, float], champion: dict[str, float], confidence: float = 0.95, test: str = "bootstrap",
           resamples: int = 10_000, seed: int = 0) -> GateDecision:
    """Promote when the paired one-sided `test` rejects "no better" at `confidence` (p < 1 - confidence)."""
    a, b = paired(new, champion)
    gain_low = None
    if test == "mcnemar":
        p = mcnemar_exact(a, b)
    else:
        p, gain_low = paired_bootstrap(a, b, confidence, resamples, seed)
    promote = p < 1 - confidence
    return GateDecision(promote, mean(a), mean(b), p, gain_low, len(a), test, "better" if promote else "not better")


def summary_line(d: GateDecision, metric: str, confidence: float, version: str) -> str:
    """The one line a run ends with about the gate."""
    if d.reason == "first champion":
        return f"gate: version {version} is the first champion; its held-out split is now the gate set"
    figures = (f"new {d.new_score:.3f} vs champion {d.champion_score:.3f} on {d.questions} gate questions "
               f"({metric}; {d.test} p={d.p_value:.3f}"
               + (f", {confidence:.0%} low end of the gain {d.gain_low:+.3f}" if d.gain_low is not None else "")
               + ")") if d.p_value is not None else d.reason
    if d.reason == "forced":
        return f"gate: version {version} took `champion` by --force-promote: {figures}"
    if d.promote:
        return f"gate: version {version} promoted to `champion`: {figures}"
    return f"gate: version {version} NOT promoted (kept without `champion`): {figures}"
