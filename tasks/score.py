"""score: rewards for every completion (rule rewards in-process; code runs only in the sandbox).

The reward functions are resolved by name here, in the process that runs the stage (a Prefect worker
included), so a plugin only has to be installed where the stage runs. Metrics: `reward/mean`,
`reward/unscorable_frac`, and per function `reward/<name>` and `sys/reward_seconds/<name>`."""
from __future__ import annotations

from statistics import mean

from grpo_core.io import read_jsonl, write_jsonl
from grpo_core.task import read_tasks
from grpo_core.rewards import compute_rewards, correctness_scores, reward_context
from tasks.layout import cfg_of, iter_dir
from tasks.stage import stage


@stage("score", key=lambda cfg, config, prompts, samples, **_: {
    "reward_funcs": cfg.reward_funcs, "weights": cfg.reward_weights, "sandbox": config["sandbox"], "prompts": prompts,
    "samples": samples})
def score(config: dict, run_dir: str, iteration: int, prompts: str, samples: str) -> dict:
    cfg = cfg_of(config)
    tasks = {t.id: t for t in read_tasks(prompts)}
    rows = list(read_jsonl(samples))
    completions = [r["completion"] for r in rows]
    row_tasks = [tasks[r["task_id"]] for r in rows]
    context = reward_context(cfg, [r["completion_ids"] for r in rows])
    scores = compute_rewards(completions, row_tasks, cfg.reward_funcs, cfg.reward_weights, context)
    correctness = correctness_scores(scores, cfg.reward_funcs, completions, row_tasks, context,
                                     cfg.correctness_func)
    scored = [{"task_id": r["task_id"], "group": r["group"], "reward": total,
               "rewards": {f: values[i] for f, values in scores.per_func.items()}, "correct": correctness[i]}
              for i, (r, total) in enumerate(zip(rows, scores.totals))]
    out = write_jsonl(iter_dir(run_dir, iteration) / "scores.jsonl", scored)
    ok = [t for t in scores.totals if t is not None]
    metrics = {"reward/mean": mean(ok) if ok else 0.0,
               "reward/unscorable_frac": 1 - len(ok) / max(1, len(scores.totals))}
    for f, values in scores.per_func.items():
        scored_values = [v for v in values if v is not None]
        metrics[f"reward/{f}"] = mean(scored_values) if scored_values else 0.0
        metrics[f"sys/reward_seconds/{f}"] = scores.seconds[f]
    return {"scores": str(out), "metrics": metrics}
