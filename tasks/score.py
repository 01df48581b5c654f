"""score: rewards for every completion (rule rewards in-process; code runs only in the sandbox).

The reward functions are resolved by name here, in the process that runs the stage (a Prefect worker
included), so a plugin only has to be installed where the stage runs. Metrics: `reward/mean`,
`reward/unscorable_frac`, and per function `reward/<name>` and `sys/reward_seconds/<name>`.

Where the score stage runs where the rollout does (`stages.score.during_rollout`, same work pool), the rollout
scores each group on a helper thread as soon as it is sampled (grpo_core/scoring.py: GroupScorer) and leaves
the result beside its samples (`early_scores.json`, keyed by the samples' content and the reward settings);
this stage then only checks and adopts it. Anything else (no such file, another key, a failed helper) and it scores every sample."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from grpo_core.config import GRPOConfig
from grpo_core.io import read_json, read_jsonl, write_json, write_jsonl
from grpo_core.scoring import score_metrics, score_rows
from grpo_core.task import read_tasks
from tasks.layout import cfg_of, iter_dir
from tasks.stage import stage


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
