"""score: rewards for every completion (rule rewards in-process; code runs only in the sandbox).

The reward functions are resolved by name here, in the process that runs the stage (a Prefect worker
included), so a plugin only has to be installed where the stage runs. Metrics: `reward/mean`,
`reward/unscorable_frac`, and per function `reward/<name>` and `sys/reward_seconds/<name>`; where training draws
math questions' wordings, the same per kind of wording (`wording/<full|examples|system|bare>/...`, and its share).

Where the score stage runs where the rollout does (`stages.score.during_rollout`, same work pool), the rollout
scores each group on a helper thread as soon as it is sampled and leaves the result beside its samples
(grpo_core/rewards/scoring.py: GroupScorer, `early_scores.json`, keyed by the samples' content and the reward settings);
this stage then only checks and adopts it. Anything else (no such file, another key, a failed helper, a reward
function's source file edited since) and it scores every sample.

The stage logs its metrics to the run's MLflow run itself, at the step of the iteration's first update step
(tasks/tracking.py: log_iteration_metrics), as the rollout logs its throughput, and the first
tracking.trace_rollouts rollouts as MLflow traces, each with its rewards and advantage (tasks/traces.py)."""
from __future__ import annotations

from grpo_core.io import read_jsonl, write_jsonl
from grpo_core.rollout.agents import agent_metrics
from grpo_core.rollout.multiturn import tool_metrics
from grpo_core.rewards.scoring import read_early_scores, score_metrics, score_rows, wording_metrics
from grpo_core.task import read_tasks
from tasks import traces, tracking
from tasks.layout import cfg_of, iter_dir
from tasks.stage import stage


@stage("score", key=lambda cfg, config, prompts, samples, **_: {
    "reward_funcs": cfg.reward_funcs, "weights": cfg.reward_weights, "sandbox": config["sandbox"], "prompts": prompts,
    "samples": samples})
def score(config: dict, run_dir: str, iteration: int, prompts: str, samples: str) -> dict:
    cfg = cfg_of(config)
    rows = list(read_jsonl(samples))
    tasks = {t.id: t for t in read_tasks(prompts)}
    early = read_early_scores(cfg, samples, rows)
    scored, seconds = early if early is not None else score_rows(cfg, rows, tasks)
    out = write_jsonl(iter_dir(run_dir, iteration) / "scores.jsonl", scored)
    fmt = cfg.data.prompt_format_at(iteration)
    wordings = {i: fmt.for_task(t).wording for i, t in tasks.items() if t.kind == "math"} if fmt.varies else {}
    metrics = {**score_metrics(scored, seconds), **tool_metrics(rows), **agent_metrics(rows),
               **wording_metrics(scored, wordings)}
    tracking.log_iteration_metrics(cfg, run_dir, iteration, metrics)         # at the iteration's first update step
    traces.log_rollout_traces(cfg, run_dir, iteration, rows, scored, {i: t.prompt for i, t in tasks.items()})
    return {"scores": str(out), "metrics": metrics, "scored_during_rollout": early is not None}
