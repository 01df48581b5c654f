"""evaluate: held-out pass@k of the current policy (iteration 0 = the base model), monitors, MLflow.

The numbers come from grpo_core.evaluation.evaluate_checkpoint, the same function `grpo eval` calls.
This stage adds the run context: the trend monitors (vs the previous evaluation and iteration 0); what
goes to MLflow is tasks/eval_logging.py's.
"""
from __future__ import annotations

from pathlib import Path

from grpo_core.io import read_json, read_jsonl, write_jsonl
from grpo_core.task import read_tasks
from grpo_core.evaluation import evaluate_checkpoint
from grpo_core.monitors import check_monitors
from tasks.curate import ensure_eval_split
from tasks.eval_logging import log_evaluation, report_alerts
from tasks.layout import cfg_of, eval_split_path, iter_dir
from tasks.run_state import mlflow_run_id
from tasks.stage import stage


def eval_history(run_dir: str | Path, before: int | None = None) -> dict[int, dict]:
    """{iteration: metrics} of the run's completed evaluations (those before `before`, if given)."""
    out = {}
    for rec in Path(run_dir).glob("iter-*/evaluate.json"):
        k = int(rec.parent.name.split("-", 1)[1])
        if before is None or k < before:
            out[k] = read_json(rec)["metrics"]
    return dict(sorted(out.items()))


def eval_lengths(run_dir: str | Path, iterations) -> dict[int, list[int]]:
    out = {}
    for k in iterations:
        p = Path(run_dir) / f"iter-{k}" / "eval_samples.jsonl"
        if p.exists():
            out[k] = [r["length"] for r in read_jsonl(p) if "length" in r]
    return out


@stage("evaluate", key=lambda config, run_dir, checkpoint, **_: {
    "config": config, "eval": str(eval_split_path(run_dir)), "checkpoint": checkpoint})
def evaluate(config: dict, run_dir: str, iteration: int, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    eval_path = ensure_eval_split(cfg, run_dir)
    metrics, rows = evaluate_checkpoint(cfg, read_tasks(eval_path), checkpoint)
    out = write_jsonl(iter_dir(run_dir, iteration) / "eval_samples.jsonl", rows)

    history = eval_history(run_dir, before=iteration)
    previous = history[max(history)] if history else None
    baseline = history.get(0) if iteration > 0 else None
    monitor_metrics, alerts = check_monitors(metrics, previous, baseline, cfg.eval.monitors)
    metrics.update(monitor_metrics)
    report_alerts(alerts, f"iteration {iteration}")

    history[iteration] = metrics
    lengths = eval_lengths(run_dir, history)
    log_evaluation(cfg, mlflow_run_id(run_dir), iteration, metrics, rows, history, lengths, alerts, eval_path)
    return {"metrics": metrics, "samples": str(out), "alerts": [a.name for a in alerts]}
