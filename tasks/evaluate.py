"""evaluate: held-out pass@k of the current policy (iteration 0 = the base model), monitors, MLflow.

The numbers come from grpo_core.evaluation.evaluate_checkpoint, the same function `grpo eval` calls.
This stage adds the run context: the trend monitors (vs the previous evaluation and iteration 0), and
the MLflow side (metrics at step = iteration, a sample table per iteration, plots, monitor tags).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from prefect import task

from grpo_core.config import GRPOConfig
from grpo_core.io import read_json, read_jsonl, write_jsonl
from grpo_core.task import read_tasks
from grpo_core.evaluation import evaluate_checkpoint
from grpo_core.monitors import Alert, check_monitors
from tasks import tracking
from tasks.common import cfg_of, completed_record, finish_stage, input_key, iter_dir, mlflow_run_id
from tasks.curate import ensure_eval_split

TABLE_DIR = "eval_samples"
PLOT_DIR = "plots"


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


def report_alerts(alerts: list[Alert], where: str) -> None:
    """Print a warning per tripped monitor (and to the Prefect log when inside a flow)."""
    log = None
    try:
        from prefect import get_run_logger
        log = get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow/task run there is no run logger
        pass
    for a in alerts:
        msg = f"reward-hacking monitor '{a.name}' tripped ({where}): {a.message}"
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)
        if log is not None:
            log.warning(msg)


def sample_table(rows: list[dict], iteration: int, max_rows: int) -> dict[str, list]:
    """Columns for mlflow's log_table: prompt, completion, each reward, verdict, ..."""
    rows = rows[:max_rows]
    funcs = list(dict.fromkeys(f for r in rows for f in r["rewards"]))
    cols: dict[str, list] = {c: [] for c in ("iteration", "mode", "source", "task_id", "sample", "prompt",
                                             "answer", "completion", *[f"reward_{f}" for f in funcs],
                                             "reward_total", "verdict", "length", "truncated")}
    for r in rows:
        for c in ("mode", "source", "task_id", "sample", "prompt", "completion", "reward_total", "verdict",
                  "length", "truncated"):
            cols[c].append(r[c])
        cols["answer"].append(r.get("answer"))
        cols["iteration"].append(iteration)
        for f in funcs:
            cols[f"reward_{f}"].append(r["rewards"].get(f))
    return cols


def log_evaluation(cfg: GRPOConfig, run_id: str, iteration: int, metrics: dict, rows: list[dict],
                   history: dict[int, dict], lengths: dict[int, list[int]], alerts: list[Alert],
                   eval_path: str | Path | None = None) -> None:
    """Everything an evaluation puts into MLflow. `history`/`lengths` include this iteration."""
    tracking.log_metrics(cfg, run_id, metrics, step=iteration)
    if cfg.eval.table_rows:
        tracking.log_table(cfg, run_id, sample_table(rows, iteration, cfg.eval.table_rows),
                           f"{TABLE_DIR}/iter-{iteration:03d}.json")
    if alerts:
        tracking.set_tags(cfg, run_id, {f"monitor.{a.name}": f"iteration {iteration}: {a.message}" for a in alerts})
    if eval_path is not None and iteration == min(history):
        tracking.log_artifact(cfg, run_id, eval_path, "data")
    if cfg.eval.plots:
        from grpo_core.eval_plots import make_plots
        with tempfile.TemporaryDirectory() as tmp:
            for p in make_plots(history, lengths, Path(tmp), cfg.eval.ks,
                                cfg.eval.max_completion_length or cfg.max_completion_length):
                tracking.log_artifact(cfg, run_id, p, PLOT_DIR)


@task(name="evaluate")
def evaluate(config: dict, run_dir: str, iteration: int, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    eval_path = ensure_eval_split(cfg, run_dir)
    key = input_key(config=config, eval=str(eval_path), checkpoint=checkpoint)
    if (done := completed_record(run_dir, iteration, "evaluate", key)):
        return done
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
    run_id = mlflow_run_id(run_dir)
    log_evaluation(cfg, run_id, iteration, metrics, rows, history, lengths, alerts, eval_path)
    return finish_stage(run_dir, iteration, "evaluate", key, {
        "metrics": metrics, "samples": str(out), "alerts": [a.name for a in alerts]})
