"""score: rewards for every completion (rule rewards in-process; code runs only in the sandbox).

The reward functions are resolved by name here, in the process that runs the stage (a Prefect worker
included), so a plugin only has to be installed where the stage runs. Metrics: `reward/mean`,
`reward/unscorable_frac`, and per function `reward/<name>` and `sys/reward_seconds/<name>`.

Where the score stage runs where the rollout does (`stages.score.during_rollout`, same work pool), the rollout
scores each group on a helper thread as soon as it is sampled (`GroupScorer`) and leaves the result beside its
samples (`early_scores.json`, keyed by the samples' content and the reward settings); this stage then only
checks and adopts it. Anything else (no such file, another key, a failed helper) and it scores every sample."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from statistics import mean

from grpo_core.config import GRPOConfig
from grpo_core.io import read_json, read_jsonl, write_json, write_jsonl
from grpo_core.overlap import Overlapped
from grpo_core.rewards import compute_rewards, correctness_scores, reward_context
from grpo_core.task import Task, read_tasks
from tasks.layout import cfg_of, iter_dir
from tasks.stage import stage


def score_rows(cfg: GRPOConfig, rows: list[dict], tasks: dict[str, Task]) -> tuple[list[dict], dict[str, float]]:
    """Sample rows (task_id, completion, completion_ids) -> one scored row each (task_id, reward, rewards per
    function, correct), and the seconds each reward function took."""
    completions = [r["completion"] for r in rows]
    row_tasks = [tasks[r["task_id"]] for r in rows]
    context = reward_context(cfg, [r["completion_ids"] for r in rows])
    scores = compute_rewards(completions, row_tasks, cfg.reward_funcs, cfg.reward_weights, context)
    correctness = correctness_scores(scores, cfg.reward_funcs, completions, row_tasks, context, cfg.correctness_func)
    scored = [{"task_id": r["task_id"], "reward": total, "rewards": {f: values[i] for f, values in scores.per_func.items()},
               "correct": correctness[i]} for i, (r, total) in enumerate(zip(rows, scores.totals))]
    return scored, scores.seconds


def score_metrics(scored: list[dict], seconds: dict[str, float]) -> dict[str, float]:
    ok = [r["reward"] for r in scored if r["reward"] is not None]
    metrics = {"reward/mean": mean(ok) if ok else 0.0, "reward/unscorable_frac": 1 - len(ok) / max(1, len(scored))}
    for f, took in seconds.items():
        values = [r["rewards"][f] for r in scored if r["rewards"][f] is not None]
        metrics[f"reward/{f}"] = mean(values) if values else 0.0
        metrics[f"sys/reward_seconds/{f}"] = took
    return metrics


# -- scoring while the rollout samples --------------------------------------------------------------------

def scores_during_rollout(cfg: GRPOConfig) -> bool:
    """Whether the rollout scores groups as they are sampled: asked for, and the score stage runs in the same
    place (the same work pool, or both in the training run's process) so it has the same sandbox and plugins."""
    return cfg.stages.score.during_rollout and cfg.stages.score.work_pool == cfg.stages.rollout.work_pool


def early_scores_path(samples: str | Path) -> Path:
    return Path(samples).with_name("early_scores.json")


def early_key(cfg: GRPOConfig, samples: str | Path) -> str:
    """What early scores must match to stand for this stage's own: the samples' bytes and the reward settings."""
    settings = {"reward_funcs": cfg.reward_funcs, "weights": cfg.reward_weights, "correctness": cfg.correctness_func,
                "sandbox": cfg.sandbox.model_dump(mode="json"), "max_completion_length": cfg.max_completion_length,
                "overlong_buffer_length": cfg.overlong_buffer_length}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(Path(samples).read_bytes())
    return h.hexdigest()[:16]


class GroupScorer:
    """Scores groups on a helper thread while the sampler produces the next ones (grpo_core/overlap.py): `add`
    each group's sample rows as the sampler finishes it, `finish` for ({group: scored rows}, seconds per reward
    function), or None after an error (the score stage then scores everything in its own process). Reward
    functions see the groups finished since their last call, a chunk at a time."""

    def __init__(self, cfg: GRPOConfig, tasks: list[Task]):
        by_id, self.seconds = {t.id: t for t in tasks}, {}

        def score_chunk(rows: list[dict]) -> list[dict]:
            scored, seconds = score_rows(cfg, rows, by_id)
            for f, took in seconds.items():
                self.seconds[f] = self.seconds.get(f, 0.0) + took
            return scored
        self._work = Overlapped(score_chunk, "scoring during the rollout", "score-during-rollout")

    def add(self, group: int, rows: list[dict]) -> None:
        self._work.add(group, rows)

    def finish(self) -> tuple[dict[int, list[dict]], dict[str, float]] | None:
        """Wait for the groups added so far to be scored; their scores, or None after an error."""
        scored = self._work.finish()
        return None if scored is None else (scored, self.seconds)

    def abandon(self) -> None:
        self._work.abandon()


def write_early_scores(cfg: GRPOConfig, samples: str | Path, scored: list[dict], seconds: dict[str, float]) -> Path:
    return write_json(early_scores_path(samples), {"key": early_key(cfg, samples), "rows": scored, "seconds": seconds})


def read_early_scores(cfg: GRPOConfig, samples: str | Path, rows: list[dict]) -> tuple[list[dict], dict] | None:
    """The rollout's scores of these sample rows, if it left ones that match them and the reward settings."""
    path = early_scores_path(samples)
    if not path.exists():
        return None
    early = read_json(path)
    if early.get("key") != early_key(cfg, samples) or len(early.get("rows", ())) != len(rows) or \
            any(e["task_id"] != r["task_id"] for e, r in zip(early["rows"], rows)):
        return None
    return early["rows"], early["seconds"]


@stage("score", key=lambda cfg, config, prompts, samples, **_: {
    "reward_funcs": cfg.reward_funcs, "weights": cfg.reward_weights, "sandbox": config["sandbox"], "prompts": prompts,
    "samples": samples})
def score(config: dict, run_dir: str, iteration: int, prompts: str, samples: str) -> dict:
    cfg = cfg_of(config)
    rows = list(read_jsonl(samples))
    early = read_early_scores(cfg, samples, rows)
    if early is not None:
        scored, seconds = early
    else:
        scored, seconds = score_rows(cfg, rows, {t.id: t for t in read_tasks(prompts)})
    scored = [{**s, "group": r["group"]} for s, r in zip(scored, rows)]
    out = write_jsonl(iter_dir(run_dir, iteration) / "scores.jsonl", scored)
    return {"scores": str(out), "metrics": score_metrics(scored, seconds), "scored_during_rollout": early is not None}
