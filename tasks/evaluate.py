"""evaluate: held-out pass@k of the current policy (iteration 0 = the base model), MLflow.

The numbers come from grpo_core.evaluation.evaluate, as `grpo eval`'s (on several processes, tasks/distributed.py, each
samples its share of the questions), the held-out answers' monitor flags among them; what goes to MLflow is
tasks/eval_logging.py's. The monitors judge them after the iteration (tasks/monitoring.py)."""
from __future__ import annotations

from pathlib import Path

from grpo_core.io import read_json, read_jsonl, write_jsonl
from grpo_core.task import read_tasks
from grpo_core.evaluation.evaluate import eval_seed, merge_rows, sample_rows, summarize
from grpo_core.model.policy import load_policy
from grpo_core.parallel import DataParallel
from tasks import distributed
from tasks.splits import ensure_eval_split
from tasks.eval_logging import log_evaluation
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


def evaluate_share(data_parallel: DataParallel, config: dict, eval_path: str, checkpoint: str | None) -> dict:
    """This process's share of the held-out questions, sampled and scored; the first process returns every
    process's rows, merged, and the metrics on them (the others return {})."""
    cfg = cfg_of(config)
    tasks = read_tasks(eval_path)
    policy = load_policy(cfg, checkpoint, need_reference=False)
    first = data_parallel.rank == 0
    rows = sample_rows(policy, data_parallel.shard(tasks), cfg, data_parallel.shard_seed(eval_seed(cfg)), first)
    parts = data_parallel.gather(rows)
    if not first:
        return {}
    rows = merge_rows(tasks, parts)
    return {"metrics": summarize(rows, cfg.eval.ks), "rows": rows}


@stage("evaluate", key=lambda config, run_dir, checkpoint, **_: {
    "config": config, "eval": str(eval_split_path(run_dir)), "checkpoint": checkpoint})
def evaluate(config: dict, run_dir: str, iteration: int, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    eval_path = ensure_eval_split(cfg, run_dir)
    shared = distributed.run_on_processes(
        evaluate_share, dict(config=config, eval_path=str(eval_path), checkpoint=checkpoint),
        cfg.stages.evaluate.num_processes, cfg.device, iter_dir(run_dir, iteration) / "evaluate.processes", "evaluate")
    metrics, rows = shared["metrics"], shared["rows"]
    out = write_jsonl(iter_dir(run_dir, iteration) / "eval_samples.jsonl", rows)

    history = eval_history(run_dir, before=iteration)
    history[iteration] = metrics
    lengths = eval_lengths(run_dir, history)
    log_evaluation(cfg, mlflow_run_id(run_dir), iteration, metrics, rows, history, lengths, eval_path)
    return {"metrics": metrics, "samples": str(out)}
