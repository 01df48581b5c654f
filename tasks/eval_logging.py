"""What an evaluation reports beyond its record, on the MLflow side: metrics at step = iteration, a sample table
per iteration, every answer as an MLflow trace (tasks/traces.py), plots, the held-out split as an artifact (the
curate stage logs it as a run input, after the training data). The question counts are the same at every
evaluation of a run: they are tags (eval.num_questions, ...), not flat charts. Shared by the evaluate stage and
`grpo eval --mlflow`; computes nothing itself."""
from __future__ import annotations

import tempfile
from pathlib import Path

from grpo_core.config import GRPOConfig
from tasks import traces, tracking

TABLE_DIR = "eval_samples"
PLOT_DIR = "plots"
CONSTANT_SUFFIX = "/num_questions"       # eval/num_questions, eval/<source>/num_questions


def split_constants(metrics: dict) -> tuple[dict, dict[str, str]]:
    """(the metrics to chart, the constant counts as tags): eval/gsm/num_questions -> tag eval.gsm.num_questions."""
    charted = {k: v for k, v in metrics.items() if not k.endswith(CONSTANT_SUFFIX)}
    tags = {k.replace("/", "."): f"{v:g}" if isinstance(v, float) else str(v)
            for k, v in metrics.items() if k.endswith(CONSTANT_SUFFIX)}
    return charted, tags


def sample_table(rows: list[dict], iteration: int, max_rows: int) -> dict[str, list]:
    """Columns for mlflow's log_table: prompt, completion, each reward, verdict, ..."""
    rows = rows[:max_rows]
    funcs = list(dict.fromkeys(f for r in rows for f in r["rewards"]))
    cols: dict[str, list] = {c: [] for c in ("iteration", "mode", "source", "task_id", "sample", "prompt",
                                             "answer", "completion", *[f"reward_{f}" for f in funcs],
                                             "reward_total", "verdict", "length", "truncated")}
    for r in rows:
        for c in ("source", "task_id", "sample", "prompt", "completion", "reward_total", "verdict", "length",
                  "truncated"):
            cols[c].append(r[c])
        cols["mode"].append(r["mode"] + (f"/{r['wording']}" if r.get("wording") else ""))   # greedy/foreign
        cols["answer"].append(r.get("answer"))
        cols["iteration"].append(iteration)
        for f in funcs:
            cols[f"reward_{f}"].append(r["rewards"].get(f))
    return cols


def log_evaluation(cfg: GRPOConfig, run_id: str, iteration: int, metrics: dict, rows: list[dict],
                   history: dict[int, dict], lengths: dict[int, list[int]], eval_path: str | Path | None = None) -> None:
    """Everything an evaluation puts into MLflow. `history`/`lengths` include this iteration."""
    charted, constants = split_constants(metrics)
    tracking.log_metrics(cfg, run_id, charted, step=iteration)
    if cfg.eval.table_rows:
        tracking.log_table(cfg, run_id, sample_table(rows, iteration, cfg.eval.table_rows),
                           f"{TABLE_DIR}/iter-{iteration:03d}.json")
    if constants:
        tracking.set_tags(cfg, run_id, constants)
    traces.log_eval_traces(cfg, run_id, iteration, rows)
    if eval_path is not None and iteration == min(history):
        tracking.log_artifact(cfg, run_id, eval_path, "data")
    if cfg.eval.plots:
        from grpo_core.evaluation.plots import make_plots
        with tempfile.TemporaryDirectory() as tmp:
            for p in make_plots(history, lengths, Path(tmp), cfg.eval.ks,
                                cfg.eval.max_completion_length or cfg.max_completion_length):
                tracking.log_artifact(cfg, run_id, p, PLOT_DIR)
