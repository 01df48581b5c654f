"""score: rewards for every completion (rule rewards in-process; code runs only in the sandbox)."""
from __future__ import annotations

from statistics import mean

from prefect import task

from grpo_core.io import read_jsonl, write_jsonl
from grpo_core.task import read_tasks
from grpo_core.rewards import CORRECTNESS_FUNC, compute_rewards, reward_context
from tasks.common import cfg_of, completed_record, finish_stage, input_key, iter_dir


@task(name="score")
def score(config: dict, run_dir: str, iteration: int, prompts: str, samples: str) -> dict:
    cfg = cfg_of(config)
    key = input_key(reward_funcs=cfg.reward_funcs, weights=cfg.weights, sandbox=config["sandbox"],
                    prompts=prompts, samples=samples)
    if (done := completed_record(run_dir, iteration, "score", key)):
        return done
    tasks = {t.id: t for t in read_tasks(prompts)}
    rows = list(read_jsonl(samples))
    completions = [r["completion"] for r in rows]
    row_tasks = [tasks[r["task_id"]] for r in rows]
    context = reward_context(cfg, [len(r["completion_ids"]) for r in rows])
    totals, per_func = compute_rewards(completions, row_tasks, cfg.reward_funcs, cfg.weights, context)
    funcs = list(per_func)
    correctness = per_func.get(CORRECTNESS_FUNC) or compute_rewards(
        completions, row_tasks, [CORRECTNESS_FUNC], [1.0], context)[1][CORRECTNESS_FUNC]
    scored = [{"task_id": r["task_id"], "group": r["group"], "reward": tot,
               "rewards": {f: per_func[f][i] for f in funcs}, "correct": correctness[i]}
              for i, (r, tot) in enumerate(zip(rows, totals))]
    out = write_jsonl(iter_dir(run_dir, iteration) / "scores.jsonl", scored)
    ok = [t for t in totals if t is not None]
    metrics = {"reward/mean": mean(ok) if ok else 0.0,
               "reward/unscorable_frac": 1 - len(ok) / max(1, len(totals))}
    for f in funcs:
        vals = [v for v in per_func[f] if v is not None]
        metrics[f"reward/{f}"] = mean(vals) if vals else 0.0
    return finish_stage(run_dir, iteration, "score", key, {"scores": str(out), "metrics": metrics})
