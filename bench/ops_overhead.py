"""Orchestration cost: what Prefect + the stage records + MLflow bookkeeping add per iteration, and how
long a resume takes to skip completed work.

    GRPO_HOME=/tmp/grpohome python bench/ops_overhead.py [--iterations 3] [--model tiny-random]

1. plain:   the same five stages called as plain functions (`task.fn`), no Prefect, same work;
2. prefect: `training_run` (flow + subflow per iteration + 5 tasks, each with retry options);
3. skip:    `training_run` again on the finished run: every stage is found complete and skipped.
Per-iteration overhead = prefect iteration time - plain iteration time (medians). The numbers are noisy
on a shared CPU: run it on a quiet machine for figures to quote.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def plain_run(cfg, run_dir: Path) -> list[float]:
    from tasks import tracking
    from tasks.curate import curate
    from tasks.evaluate import evaluate
    from tasks.rollout import rollout
    from tasks.score import score
    from tasks.update import update
    config = cfg.model_dump(mode="json")
    run_dir.mkdir(parents=True, exist_ok=True)
    tracking.start_or_resume_run(cfg, run_dir, None)
    if cfg.eval.enabled:
        evaluate.fn(config, str(run_dir), 0, None)
    ckpt = state = None
    times = []
    for k in range(1, cfg.pipeline_iterations + 1):
        t0 = time.perf_counter()
        curated = curate.fn(config, str(run_dir), k)
        rolled_out = rollout.fn(config, str(run_dir), k, curated["prompts"], ckpt)
        scored = score.fn(config, str(run_dir), k, curated["prompts"], rolled_out["samples"])
        updated = update.fn(config, str(run_dir), k, rolled_out["samples"], scored["scores"], ckpt, state,
                            scored["metrics"], rolled_out["seconds"], rolled_out["tokens_per_second"])
        if cfg.eval.enabled:
            evaluate.fn(config, str(run_dir), k, updated["checkpoint"])
        ckpt, state = updated["checkpoint"], updated["state"]
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from mlflow.tracking import MlflowClient
    from grpo_core.config import GRPOConfig
    from flows.train import training_run
    out = Path(args.out or tempfile.mkdtemp(prefix="ops-bench-"))
    base = dict(model=args.model, output_dir=str(out), pipeline_iterations=args.iterations, num_generations=4,
                max_completion_length=8, data=dict(prompts_per_iteration=2, eval_size=4), eval=dict(num_samples=1),
                tracking=dict(register_adapter="none"))
    plain = plain_run(GRPOConfig(run_name="plain", **base), out / "plain")

    t0 = time.perf_counter()
    summary = training_run(GRPOConfig(run_name="prefect", **base).model_dump(mode="json"))
    first = time.perf_counter() - t0
    c = MlflowClient(tracking_uri=summary["tracking_uri"])
    pref = [m.value for m in sorted(c.get_metric_history(summary["mlflow_run_id"], "sys/iteration_seconds"),
                                    key=lambda m: m.step)]
    t0 = time.perf_counter()
    training_run(GRPOConfig(run_name="prefect", **base).model_dump(mode="json"))
    skip = time.perf_counter() - t0

    # Pure orchestration of one iteration: the subflow + 5 task runs + key/record checks, no stage work.
    from prefect import flow
    from flows.train import iteration_flow
    cfg = GRPOConfig(run_name="prefect", **base)

    @flow(name="ops-bench-skip")
    def skip_iterations(config: dict) -> list[float]:
        ts, ck, st = [], None, None
        for _ in range(3):
            for k in range(1, args.iterations + 1):
                t = time.perf_counter()
                res = iteration_flow(config, str(out / "prefect"), k, ck, st)
                ts.append(time.perf_counter() - t)
                ck, st = res["update"]["checkpoint"], res["update"]["state"]
            ck = st = None
        return ts

    skipped = skip_iterations(cfg.model_dump(mode="json"))
    med = statistics.median
    print(f"\niterations: {args.iterations}   model: {args.model}   out: {out}")
    print(f"plain stages per iteration (s):   {', '.join(f'{t:.2f}' for t in plain)}   median {med(plain):.2f}")
    print(f"prefect iteration_flow (s):       {', '.join(f'{t:.2f}' for t in pref)}   median {med(pref):.2f}")
    print(f"orchestration overhead/iteration: {med(pref) - med(plain):+.2f} s (median difference)")
    print(f"whole prefect run (after engine start): {first:.1f} s")
    print(f"one skipped iteration (subflow + 5 tasks, no work): median {med(skipped):.2f} s, "
          f"min {min(skipped):.2f} s over {len(skipped)}")
    print(f"resume of the finished run, all {args.iterations * 5 + 1} stages skipped: {skip:.2f} s "
          f"({skip / (args.iterations + 1):.2f} s per iteration incl. the base eval)")


if __name__ == "__main__":
    main()
