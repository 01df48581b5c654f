"""Orchestration cost: what Prefect + the stage records + MLflow bookkeeping add per iteration, and how
long a resume takes to skip completed work.

    GRPO_HOME=/tmp/grpohome python bench/ops_overhead.py [--iterations 3] [--model tiny-random]

1. plain:   the same five stages called as plain functions (`task.fn`), no Prefect, same work;
2. prefect: `training_run` (flow + subflow per iteration + 5 tasks, each with retry options);
3. skip:    `training_run` again on the finished run: every stage is found complete and skipped.
Per-iteration overhead = prefect iteration time - plain iteration time (medians). The numbers are noisy
on a shared CPU: run it on a quiet machine for figures to quote.

    python bench/ops_overhead.py --reuse-ab --config configs/default.yaml --iterations 7

measures what reloading the model in every stage costs instead: two runs of a real config (its model,
evaluation off, the plain stages) in lockstep, one reloading the model in every stage (kernels.reuse_model: false),
one reusing it; same seeds and checkpoints, so the same work; the median time saved per iteration.

    python bench/ops_overhead.py --pooled-load-ab 10 --config configs/default.yaml

times one stage's `load_policy` when the model comes from the pool, keeping the pooled tokenizer or reading
it again (as before it travelled with the model), taking turns.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def iteration(config: dict, run_dir: Path, k: int, ckpt: str | None, state: str | None,
              evaluate_too: bool) -> tuple[str, str]:
    """One iteration's five stages called as plain functions -> (checkpoint, state)."""
    from tasks.curate import curate
    from tasks.evaluate import evaluate
    from tasks.rollout import rollout
    from tasks.score import score
    from tasks.update import update
    curated = curate.fn(config, str(run_dir), k)
    rolled_out = rollout.fn(config, str(run_dir), k, curated["prompts"], ckpt)
    scored = score.fn(config, str(run_dir), k, curated["prompts"], rolled_out["samples"])
    updated = update.fn(config, str(run_dir), k, rolled_out["samples"], scored["scores"], ckpt, state)
    if evaluate_too:
        evaluate.fn(config, str(run_dir), k, updated["checkpoint"])
    return updated["checkpoint"], updated["state"]


def start(cfg, run_dir: Path) -> dict:
    from tasks import tracking
    from tasks.evaluate import evaluate
    config = cfg.model_dump(mode="json")
    run_dir.mkdir(parents=True, exist_ok=True)
    tracking.start_or_resume_run(cfg, run_dir, None)
    if cfg.eval.enabled:
        evaluate.fn(config, str(run_dir), 0, None)
    return config


def plain_run(cfg, run_dir: Path) -> list[float]:
    """Seconds per iteration of the five stages called as plain functions."""
    config = start(cfg, run_dir)
    ckpt = state = None
    times = []
    for k in range(1, cfg.pipeline_iterations + 1):
        t0 = time.perf_counter()
        ckpt, state = iteration(config, run_dir, k, ckpt, state, cfg.eval.enabled)
        times.append(time.perf_counter() - t0)
    return times


def reuse_ab(config_path: str, iterations: int, out: Path, json_out: str | None) -> None:
    """Two runs of one config in lockstep, one with kernels.reuse_model false and one with true (taking turns at
    going first): the same seeds and checkpoints, so the same work; their iteration times are paired."""
    from grpo_core.config import GRPOConfig
    from grpo_core.io import load_yaml
    sys.path.insert(0, str(Path(__file__).parent))
    from learning import machine
    raw = load_yaml(Path(config_path).read_text())
    raw.update(output_dir=str(out), pipeline_iterations=iterations, eval={**raw.get("eval", {}), "enabled": False},
               tracking={"register_adapter": "none"})
    runs = {reuse: (GRPOConfig.model_validate({**raw, "run_name": f"reuse-{reuse}", "kernels": {
        **raw.get("kernels", {}), "reuse_model": reuse == "1"}}), out / f"reuse-{reuse}") for reuse in ("0", "1")}
    configs = {reuse: start(cfg, run_dir) for reuse, (cfg, run_dir) in runs.items()}
    at = {reuse: (None, None) for reuse in runs}
    seconds = {reuse: [] for reuse in runs}
    for k in range(1, iterations + 1):
        for reuse in (("0", "1") if k % 2 else ("1", "0")):
            t0 = time.perf_counter()
            at[reuse] = iteration(configs[reuse], runs[reuse][1], k, *at[reuse], False)
            seconds[reuse].append(time.perf_counter() - t0)
    fresh, reused = seconds["0"][1:], seconds["1"][1:]     # iteration 1 has no checkpoint to reuse a model for
    med = statistics.median
    ratio = [r / f for r, f in zip(reused, fresh)]
    result = json.dumps({"machine": machine(), "config": config_path, "iterations": iterations,
                         "seconds_reload": seconds["0"], "seconds_reuse": seconds["1"],
                         "median_reload": med(fresh), "median_reuse": med(reused),
                         "median_saved_fraction": 1 - med(ratio)}, indent=1)
    print(result)
    if json_out:
        Path(json_out).write_text(result)


def pooled_load_ab(config_path: str, rounds: int, out: Path, json_out: str | None) -> None:
    """What a stage's `load_policy` costs when the model comes from the pool, with the pooled tokenizer kept
    (today) or parsed-and-copied again (before): the two take turns, `rounds` times each, same checkpoint."""
    import gc
    from grpo_core.model import policy as policy_module
    from grpo_core.config import load_config
    from grpo_core.model.policy import load_policy
    sys.path.insert(0, str(Path(__file__).parent))
    from learning import machine
    cfg = load_config(config_path, [f"output_dir={out}"])
    first = load_policy(cfg, None, need_reference=False)
    ckpt = first.save(out / "checkpoint")
    del first
    gc.collect()
    seconds: dict[str, list[float]] = {"tokenizer_kept": [], "tokenizer_reloaded": []}
    for r in range(rounds + 1):                            # round 0 warms the pool up, not counted
        for mode in (list(seconds) if r % 2 else list(reversed(seconds))):
            if mode == "tokenizer_reloaded":
                for pooled in policy_module._pool.values():
                    pooled.tokenizer = None
            t0 = time.perf_counter()
            policy = load_policy(cfg, ckpt, need_reference=False)
            took = time.perf_counter() - t0
            del policy
            gc.collect()
            if r:
                seconds[mode].append(took)
    med = {mode: statistics.median(v) for mode, v in seconds.items()}
    result = json.dumps({"machine": machine(), "config": config_path, "rounds": rounds, "seconds": seconds,
                         "median": med}, indent=1)
    print(result)
    print(f"pooled load_policy: {med['tokenizer_reloaded']:.3f} s with the tokenizer parsed-and-copied again, "
          f"{med['tokenizer_kept']:.3f} s with the pooled one kept (median of {rounds})")
    if json_out:
        Path(json_out).write_text(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reuse-ab", action="store_true", help="model reuse across stages on vs off (see above)")
    ap.add_argument("--pooled-load-ab", type=int, metavar="ROUNDS", default=0,
                    help="time a pooled load_policy with its tokenizer kept vs read again, ROUNDS times each")
    ap.add_argument("--config", default="configs/default.yaml", help="with --reuse-ab: the config to run")
    ap.add_argument("--json", help="with --reuse-ab / --pooled-load-ab: also write the figures here")
    args = ap.parse_args()
    if args.pooled_load_ab:
        return pooled_load_ab(args.config, args.pooled_load_ab, Path(args.out or tempfile.mkdtemp(prefix="load-bench-")),
                              args.json)
    if args.reuse_ab:
        return reuse_ab(args.config, args.iterations, Path(args.out or tempfile.mkdtemp(prefix="reuse-bench-")),
                        args.json)
    from flows.train import engine_settings
    with engine_settings():                         # the temporary server's settings, as `grpo train` starts it
        overhead(args)


def overhead(args) -> None:
    """Plain stages vs the flow, skipped iterations, and a resume (the module docstring's 1-3)."""
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
    from flows.train import iteration_flow, subflow_settings
    cfg = GRPOConfig(run_name="prefect", **base)

    @flow(name="ops-bench-skip")
    def skip_iterations(config: dict) -> list[float]:
        ts, ck, st = [], None, None
        for _ in range(3):
            for k in range(1, args.iterations + 1):
                t = time.perf_counter()
                with subflow_settings():                     # as training_run calls it
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
