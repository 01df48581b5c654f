"""evaluate: held-out accuracy of the current policy (iteration 0 = the base model)."""
from __future__ import annotations

from prefect import task

from grpo_core.data.schema import read_tasks, write_jsonl
from grpo_core.evaluation import evaluate_policy
from grpo_core.policy import load_policy
from tasks import tracking
from tasks.common import cfg_of, completed_record, finish_stage, input_key, iter_dir, read_json
from tasks.curate import ensure_eval_split


@task(name="evaluate")
def evaluate(config: dict, run_dir: str, iteration: int, checkpoint: str | None) -> dict:
    cfg = cfg_of(config)
    eval_path = ensure_eval_split(cfg, run_dir)
    key = input_key(config=config, eval=str(eval_path), checkpoint=checkpoint)
    if (done := completed_record(run_dir, iteration, "evaluate", key)):
        return done
    policy = load_policy(cfg, checkpoint, need_reference=False)
    metrics, rows = evaluate_policy(policy, read_tasks(eval_path), cfg, seed=cfg.seed + 12_345)
    out = write_jsonl(iter_dir(run_dir, iteration) / "eval_samples.jsonl", rows)
    run_id = read_json(f"{run_dir}/run.json")["mlflow_run_id"]
    tracking.log_metrics(cfg, run_id, metrics, step=iteration)
    return finish_stage(run_dir, iteration, "evaluate", key, {"metrics": metrics, "samples": str(out)})
