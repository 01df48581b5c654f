"""Scoring sample rows with the run's reward functions: one scored row per sample (total, per function,
correctness) and the stage's metrics; `GroupScorer` does it on a helper thread group by group while the sampler
produces the next groups (grpo_core/rewards/overlap.py), and its result is kept beside the samples (`early_scores.json`)
for the score stage to adopt while it matches them, the reward settings and the reward functions' code.
`cfg` is the run's GRPOConfig (grpo_core/config.py), read by field: the config sits above this room."""
from __future__ import annotations

import hashlib
import inspect
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Hashable, Sequence

from grpo_core.io import read_json, write_json
from grpo_core.rewards.overlap import Overlapped
from grpo_core.rewards.rewards import (add_environment_rewards, compute_rewards, correctness_scores, resolve_reward_funcs,
                               reward_context)
from grpo_core.task import Task


def scored_funcs(cfg, measure_correctness: bool = False) -> tuple[list[str], list[float]]:
    """The reward functions a score runs and their weights: the config's, and with `measure_correctness` (as
    evaluation scores) the correctness function too, weight 0 when it is not one of them: measured, never
    weighted in, and a sample it cannot score is unscored."""
    funcs, weights = list(cfg.reward_funcs), list(cfg.reward_weights)
    if measure_correctness and cfg.correctness_func not in funcs:
        funcs.append(cfg.correctness_func)
        weights.append(0.0)
    return funcs, weights


def score_rows(cfg, rows: list[dict], tasks: dict[str, Task],
               measure_correctness: bool = False) -> tuple[list[dict], dict[str, float]]:
    """Sample rows (task_id, completion, completion_ids; completion_mask, extra when there) -> one scored row
    each (task_id, its group where the row has one, reward, rewards per function, correct), and the seconds each
    reward function took. The one reward chain: the reward functions (`scored_funcs`), the environments' own
    rewards, the raw correctness."""
    funcs, weights = scored_funcs(cfg, measure_correctness)
    completions = [r["completion"] for r in rows]
    row_tasks = [tasks[r["task_id"]] for r in rows]
    context = reward_context(cfg, [r["completion_ids"] for r in rows], [r.get("completion_mask") for r in rows])
    scores = add_environment_rewards(compute_rewards(completions, row_tasks, funcs, weights, context),
                                     [(r.get("extra") or {}).get("environment_reward") for r in rows])
    correctness = correctness_scores(scores, funcs, completions, row_tasks, context, cfg.correctness_func)
    scored = [{"task_id": r["task_id"], **({"group": r["group"]} if "group" in r else {}), "reward": total, "rewards": {f: values[i] for f, values in scores.per_func.items()},
               "correct": correctness[i]} for i, (r, total) in enumerate(zip(rows, scores.totals))]
    return scored, scores.seconds


def stalled_group_frac(scored: list[dict]) -> float:
    """The share of groups without signal for the update: every scored answer earns the same reward, and not
    every one is right (a group all right is a solved question, not a stalled one)."""
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in scored:
        if r["reward"] is not None:
            groups[r["group"]].append(r)
    stalled = sum(1 for rows in groups.values()
                  if len({r["reward"] for r in rows}) == 1 and not all(r["correct"] == 1 for r in rows))
    return stalled / max(1, len(groups))


def score_metrics(scored: list[dict], seconds: dict[str, float]) -> dict[str, float]:
    """reward/mean, reward/unscorable_frac, reward/stalled_group_frac, and per function reward/<f> and the
    seconds it took. `scored` rows carry their group."""
    ok = [r["reward"] for r in scored if r["reward"] is not None]
    metrics = {"reward/mean": mean(ok) if ok else 0.0, "reward/unscorable_frac": 1 - len(ok) / max(1, len(scored)),
               "reward/stalled_group_frac": stalled_group_frac(scored)}
    for f, took in seconds.items():
        values = [r["rewards"][f] for r in scored if r["rewards"][f] is not None]
        metrics[f"reward/{f}"] = mean(values) if values else 0.0
        metrics[f"sys/reward_seconds/{f}"] = took
    return metrics


def wording_metrics(scored: list[dict], wordings: dict[str, str]) -> dict[str, float]:
    """Mean reward (and per function) of the answers to each kind of training wording (`wordings`: task id ->
    PromptFormat.wording), and its share of the answers: `wording/<kind>/{share,reward_mean,reward/<f>}`."""
    metrics = {}
    for kind in sorted(set(wordings.values())):
        rows = [r for r in scored if wordings.get(r["task_id"]) == kind]
        metrics[f"wording/{kind}/share"] = len(rows) / max(1, len(scored))
        rows = [r for r in rows if r["reward"] is not None]
        if rows:
            metrics[f"wording/{kind}/reward_mean"] = mean(r["reward"] for r in rows)
            for f in rows[0]["rewards"]:
                values = [r["rewards"][f] for r in rows if r["rewards"][f] is not None]
                if values:
                    metrics[f"wording/{kind}/reward/{f}"] = mean(values)
    return metrics


class GroupScorer:
    """Scores groups on a helper thread while the sampler produces the next ones (grpo_core/rewards/overlap.py): `add`
    each group's sample rows as the sampler finishes it, `finish` for ({group: scored rows}, seconds per reward
    function), or None after an error (the score stage then scores everything in its own process). Reward
    functions see the groups finished since their last call, a chunk at a time. A group is any hashable key;
    `measure_correctness` as in `score_rows` (evaluation), `what` and `thread_name` name the work in logs."""

    def __init__(self, cfg, tasks: Sequence[Task], measure_correctness: bool = False,
                 what: str = "scoring during the rollout", thread_name: str = "score-during-rollout"):
        by_id, self.seconds = {t.id: t for t in tasks}, {}

        def score_chunk(rows: list[dict]) -> list[dict]:
            scored, seconds = score_rows(cfg, rows, by_id, measure_correctness)
            for f, took in seconds.items():
                self.seconds[f] = self.seconds.get(f, 0.0) + took
            return scored
        self._work = Overlapped(score_chunk, what, thread_name)

    def add(self, group: Hashable, rows: list[dict]) -> None:
        self._work.add(group, rows)

    def finish(self) -> tuple[dict[Hashable, list[dict]], dict[str, float]] | None:
        """Wait for the groups added so far to be scored; their scores, or None after an error."""
        scored = self._work.finish()
        return None if scored is None else (scored, self.seconds)

    def abandon(self) -> None:
        self._work.abandon()

    def __enter__(self) -> "GroupScorer":
        return self

    def __exit__(self, *exc) -> None:
        self._work.__exit__(*exc)


# -- the scores made while sampling, beside the samples ----------------------------------------------------

def scores_during_rollout(cfg) -> bool:
    """Whether the rollout scores groups as they are sampled: asked for, and the score stage runs in the same
    place (the same work pool, or both in the training run's process) so it has the same sandbox and plugins."""
    return cfg.stages.score.during_rollout and cfg.stages.score.work_pool == cfg.stages.rollout.work_pool


def early_scores_path(samples: str | Path) -> Path:
    return Path(samples).with_name("early_scores.json")


def reward_code_versions(cfg) -> list[tuple]:
    """(file, size, mtime) of the source of each reward function (and the correctness function)."""
    versions = []
    for func in resolve_reward_funcs([*cfg.reward_funcs, cfg.correctness_func]):
        try:
            stat = (path := Path(inspect.getfile(inspect.unwrap(func.fn)))).stat()
            versions.append((str(path), stat.st_size, stat.st_mtime_ns))
        except (TypeError, OSError):          # defined where no file says which version it is
            versions.append((func.entry, None, None))
    return versions


def early_key(cfg, samples: str | Path) -> str:
    """What early scores must match to stand for this stage's own: the samples' bytes, the reward settings and
    the reward functions' source files (a plugin fixed between the rollout and this stage scores again)."""
    settings = {"reward_funcs": cfg.reward_funcs, "weights": cfg.reward_weights, "correctness": cfg.correctness_func,
                "sandbox": cfg.sandbox.model_dump(mode="json"), "max_completion_length": cfg.max_completion_length,
                "overlong_buffer_length": cfg.overlong_buffer_length, "code": reward_code_versions(cfg)}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(Path(samples).read_bytes())
    return h.hexdigest()[:16]


def write_early_scores(cfg, samples: str | Path, scored: list[dict], seconds: dict[str, float]) -> Path:
    return write_json(early_scores_path(samples), {"key": early_key(cfg, samples), "rows": scored, "seconds": seconds})


def read_early_scores(cfg, samples: str | Path, rows: list[dict]) -> tuple[list[dict], dict] | None:
    """The rollout's scores of these sample rows, if it left ones that match them and the reward settings."""
    path = early_scores_path(samples)
    if not path.exists():
        return None
    early = read_json(path)
    if early.get("key") != early_key(cfg, samples) or len(early.get("rows", ())) != len(rows) or \
            any(e["task_id"] != r["task_id"] for e, r in zip(early["rows"], rows)):
        return None
    return early["rows"], early["seconds"]
