"""DAPO dynamic sampling: keep only groups whose *raw correctness* varies, refill with fresh prompts.

A group whose answers are all right or all wrong has zero advantage everywhere: it costs compute and
carries no signal. DAPO drops such groups and samples more prompts until the batch is full again. The
filter looks at raw correctness (the `correct` field the score stage writes: accuracy, or the pass
fraction for code), never at the shaped total reward: a format bonus that differs inside a group of
all-wrong answers must not make that group count as informative.

Pure Python over the rollout/score rows (dicts as in samples.jsonl / scores.jsonl); the refill loop that
runs extra rollout rounds lives in the flow (flows/train.py, iteration_flow); the merge in tasks/run.py.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def is_informative(correct: Sequence[float | None]) -> bool:
    """A group carries signal iff its scorable raw-correctness values are not all equal."""
    vals = [c for c in correct if c is not None]
    return len(vals) > 1 and max(vals) - min(vals) > 1e-9


def groups_of(samples: Sequence[dict], scores: Sequence[dict]) -> "OrderedDict[int, list[int]]":
    """group id -> row indices, in first-seen order (samples and scores are row-aligned)."""
    if len(samples) != len(scores):
        raise ValueError(f"{len(samples)} samples but {len(scores)} scores: the files are not row-aligned")
    out: OrderedDict[int, list[int]] = OrderedDict()
    for i, (s, sc) in enumerate(zip(samples, scores)):
        if s["group"] != sc["group"] or s["task_id"] != sc["task_id"]:
            raise ValueError(f"row {i}: sample and score disagree on group/task ({s['group']}/{s['task_id']} vs "
                             f"{sc['group']}/{sc['task_id']})")
        out.setdefault(s["group"], []).append(i)
    return out


def count_informative(rounds: Sequence[tuple[Sequence[dict], Sequence[dict]]]) -> int:
    """The informative groups `merge_rounds` would keep of these rounds, before its cap: one per task with an
    informative group (a refill round may draw a task again; the merge keeps each task once)."""
    return len({samples[idx[0]]["task_id"] for samples, scores in rounds
                for idx in groups_of(samples, scores).values()
                if is_informative([scores[i]["correct"] for i in idx])})


def merge_rounds(rounds: Sequence[tuple[Sequence[dict], Sequence[dict]]], target_groups: int
                 ) -> tuple[list[dict], list[dict], dict[str, float]]:
    """Keep up to `target_groups` informative groups, earliest rounds first (each task once).

    rounds: [(sample rows, score rows)] of the first rollout and each refill round. Returns merged
    sample rows and score rows (groups renumbered 0..K-1, rows contiguous per group) and statistics.
    If no group at all is informative, the first round is returned unchanged (the update then only
    moves by the KL term, exactly as without dynamic sampling) and `fallback` is 1.
    """
    kept_s: list[dict] = []
    kept_c: list[dict] = []
    seen_tasks: set[str] = set()
    sampled = dropped = duplicate = 0
    for samples, scores in rounds:
        for idx in groups_of(samples, scores).values():
            sampled += 1
            task = samples[idx[0]]["task_id"]
            if task in seen_tasks:
                duplicate += 1
                continue
            if not is_informative([scores[i]["correct"] for i in idx]):
                dropped += 1
                continue
            if len(kept_s) and len({r["group"] for r in kept_s}) >= target_groups:
                continue
            seen_tasks.add(task)
            g = len({r["group"] for r in kept_s})
            kept_s += [{**samples[i], "group": g} for i in idx]
            kept_c += [{**scores[i], "group": g} for i in idx]
    n_kept = len({r["group"] for r in kept_s})
    stats = {"groups_sampled": float(sampled), "groups_dropped": float(dropped),
             "groups_duplicate": float(duplicate), "groups_kept": float(n_kept),
             "extra_rounds": float(len(rounds) - 1),
             "extra_rollouts": float(sum(len(s) for s, _ in rounds[1:])),
             "filled": float(n_kept >= target_groups), "fallback": 0.0}
    if n_kept == 0:
        samples, scores = rounds[0]
        return list(samples), list(scores), {**stats, "fallback": 1.0}
    return kept_s, kept_c, stats


def extra_round_seed(seed: int, iteration: int, round_: int) -> int:
    """Seed for refill round `round_` (>= 1) of an iteration: fresh prompts and fresh samples."""
    return seed + 1_000_003 * round_ + 7919 * iteration
