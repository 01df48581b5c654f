"""`grpo eval`: evaluate a base model or an adapter on a held-out set, outside a training run.

The numbers come from grpo_core.evaluation.evaluate.evaluate_checkpoint, the function the `evaluate` stage
calls, with the same seed rule: the same config, adapter and tasks give the same numbers as the run.

    grpo eval --model smollm2-135m-instruct --dataset arithmetic            # the base model
    grpo eval --adapter runs/r1/iter-3/update/checkpoint --config runs/r1/config.yaml \\
              --dataset runs/r1/data/eval.jsonl
    grpo eval --run <MLFLOW_RUN_ID>      # config, held-out split and last adapter from the MLflow run
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from flows.cli.format import format_eval_table

EPILOG = """\
--dataset is a JSONL file of task rows (grpo_core.task.Task: id, kind, source, prompt, answer or
tests, ...) or the name 'arithmetic' (questions from the config's data section, the split runs hold out).
With --run, the run's config.yaml, held-out split (data/eval.jsonl) and adapter (adapters/iter-<k>,
the last one unless --iteration) are read from MLflow; --config/--set/--dataset/--model override them.
Eval settings are config fields (--set eval.num_samples=8 --set eval.pass_k=[1,4,8]).
Exit status: 0, or 3 when a reward-hacking monitor tripped and --fail-on-monitor is given.
"""


def _positive(text: str) -> int:
    """argparse type: an int >= 1 (`--limit 0` would evaluate everything, `--limit -3` all but the last 3)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tasks >= 1")
    return n


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `eval` subcommand to the `grpo` parser's subparsers."""
    e = subparsers.add_parser(
        "eval", help="evaluate a model or adapter on held-out tasks (pass@k, rewards, monitors)",
        description="Held-out evaluation: greedy pass@1, sampled pass@k (unbiased estimator), mean reward per "
                    "reward function, completion length, truncation, per source and overall, plus the "
                    "reward-hacking monitors. The same implementation as the evaluate stage of a run.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--model", help="base model: 'smollm2-135m-instruct', 'gemma3-270m', 'tiny-random' or a local HF "
                                   "model dir (default: the config's model)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--adapter", metavar="PATH", help="LoRA adapter directory (e.g. runs/<run>/iter-3/update/checkpoint)")
    src.add_argument("--run", metavar="RUN_ID", help="MLflow run id of a training run: evaluate its adapter")
    e.add_argument("--iteration", type=int, help="with --run: which iteration's adapter (default: the last; 0 = base)")
    e.add_argument("--dataset", help="JSONL of tasks, or 'arithmetic' (default with --run: the run's held-out split)")
    e.add_argument("--config", "-c", metavar="YAML", help="config file (default with --run: the run's config)")
    e.add_argument("--set", "-s", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    e.add_argument("--tracking-uri", help="MLflow tracking URI for --run (default: config / $MLFLOW_TRACKING_URI)")
    e.add_argument("--tools", metavar="NAMES", help="comma-separated tools the model may call (multi-turn "
                                                   "answers): calculator, python, rust, \"package.module:function\";"
                                                   " 'none' for none (default: the config's tools)")
    e.add_argument("--limit", type=_positive, metavar="N", help="evaluate only the first N tasks (N >= 1)")
    e.add_argument("--output-dir", help="write metrics.json, eval_samples.jsonl and plots there")
    e.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    e.add_argument("--mlflow", action="store_true", help="also log the results (metrics, sample table, plots) as a "
                                                         "new MLflow run in the config's experiment")
    e.add_argument("--fail-on-monitor", action="store_true", help="exit 3 when a monitor trips")
    e.set_defaults(func=cmd_eval)
    return e


def _base_config(args):
    from grpo_core.config import load_config
    overrides = []
    if args.tracking_uri:
        overrides.append(f"tracking.tracking_uri={args.tracking_uri}")
    return load_config(None, overrides)


def _from_run(args, tmp: Path) -> tuple[Path, Path | None, str | None]:
    """(config.yaml, eval.jsonl or None, adapter dir or None) of an MLflow run, downloaded to tmp."""
    from grpo_core.model.loading import ModelError
    from tasks import tracking
    cfg = _base_config(args)
    tracking.require_store(tracking.tracking_uri(cfg), f"no MLflow run {args.run!r}")
    try:
        config_path = tracking.download_artifacts(cfg, args.run, "config.yaml", tmp)
    except Exception as e:  # noqa: BLE001 - MLflow raises several types for a missing run/artifact
        raise ModelError(f"could not read config.yaml of MLflow run {args.run!r} at {tracking.tracking_uri(cfg)} "
                         f"({type(e).__name__}: {e}); check the run id and --tracking-uri") from None
    eval_path = None
    if "data/eval.jsonl" in tracking.list_artifact_paths(cfg, args.run, "data"):
        eval_path = tracking.download_artifacts(cfg, args.run, "data/eval.jsonl", tmp)
    adapters = sorted(int(p.rsplit("-", 1)[1]) for p in tracking.list_artifact_paths(cfg, args.run, "adapters")
                      if p.rsplit("/", 1)[-1].startswith("iter-"))
    k = args.iteration if args.iteration is not None else (adapters[-1] if adapters else 0)
    if k == 0:
        return config_path, eval_path, None
    if k not in adapters:
        raise ModelError(f"MLflow run {args.run} has no adapter for iteration {k} (has: {adapters or 'none'})")
    adapter = tracking.download_artifacts(cfg, args.run, f"adapters/iter-{k}", tmp)
    return config_path, eval_path, str(adapter)


def load_eval_tasks(dataset: str, cfg) -> list:
    from grpo_core.data import arithmetic
    from grpo_core.task import read_tasks
    if dataset == "arithmetic":
        d = cfg.data
        return arithmetic.eval_tasks(d.eval_size, d.min_digits, d.max_digits, d.operations)
    if not Path(dataset).is_file():
        from grpo_core.config import ConfigError
        raise ConfigError(f"--dataset {dataset!r} is neither 'arithmetic' nor an existing JSONL file of tasks")
    return read_tasks(dataset)


def run_eval(args) -> tuple[dict, list[dict], list]:
    """Resolve model/adapter/config/tasks from the arguments and evaluate. Returns (metrics, rows, alerts)."""
    from grpo_core.config import ConfigError, load_config
    from grpo_core.evaluation.evaluate import evaluate_checkpoint
    from grpo_core.evaluation.monitors import check_monitors
    with tempfile.TemporaryDirectory(prefix="grpo-eval-") as tmp:
        config_path, eval_path, adapter = args.config, None, args.adapter
        if args.run:
            run_config, eval_path, adapter = _from_run(args, Path(tmp))
            config_path = args.config or run_config
        overrides = list(args.set or [])
        if args.model:
            overrides.append(f"model={args.model}")
        if args.tracking_uri:
            overrides.append(f"tracking.tracking_uri={args.tracking_uri}")
        if args.tools:
            names = [] if args.tools.strip() == "none" else [t.strip() for t in args.tools.split(",") if t.strip()]
            overrides.append(f"tools={json.dumps(names)}")
        cfg = load_config(config_path, overrides)
        dataset = args.dataset or (str(eval_path) if eval_path else None)
        if dataset is None:
            raise ConfigError("--dataset is required (a JSONL file of tasks or 'arithmetic')")
        tasks = load_eval_tasks(dataset, cfg)
        if args.limit:
            tasks = tasks[:args.limit]
        if not tasks:
            raise ConfigError(f"--dataset {dataset!r} holds no tasks")
        metrics, rows = evaluate_checkpoint(cfg, tasks, adapter)
        monitor_metrics, alerts = check_monitors(metrics, None, None, cfg.monitors)
        metrics.update(monitor_metrics)
        if args.output_dir:
            _write_outputs(Path(args.output_dir), cfg, metrics, rows)
        if getattr(args, "mlflow", False):
            eval_run = _log_to_mlflow(cfg, args, metrics, rows, alerts, adapter, dataset)
            print(f"MLflow eval run: {eval_run}", file=sys.stderr)
    return metrics, rows, alerts


def _log_to_mlflow(cfg, args, metrics: dict, rows: list[dict], alerts: list, adapter: str | None, dataset: str) -> str:
    """A new MLflow run (step 0) holding this evaluation, tagged with what was evaluated."""
    import time
    from tasks import tracking
    from tasks.eval_logging import log_evaluation
    c = tracking.client(cfg)
    run = c.create_run(tracking.experiment_id(cfg), run_name=time.strftime("eval-%Y%m%d-%H%M%S"), tags={
        "grpo.kind": "eval", "base_model": cfg.model, "adapter": adapter or "(base model)",
        "eval_of_run": args.run or "", "dataset": dataset, "config_hash": cfg.config_hash()})
    run_id = run.info.run_id
    tracking.log_params(c, run_id, {k: v for k, v in cfg.flat().items()
                                    if k.startswith(("eval.", "data.")) or k in ("model", "seed", "temperature",
                                                                                 "max_completion_length")})
    log_evaluation(cfg, run_id, 0, metrics, rows, {0: metrics}, {0: [r["length"] for r in rows]},
                   dataset if Path(dataset).is_file() else None)
    if alerts:
        tracking.set_tags(cfg, run_id, {f"monitor.{a.name}": a.message[:4000] for a in alerts})
    tracking.end_run(cfg, run_id)
    return run_id


def _write_outputs(out: Path, cfg, metrics: dict, rows: list[dict]) -> None:
    from grpo_core.io import write_json, write_jsonl
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "metrics.json", metrics)
    write_jsonl(out / "eval_samples.jsonl", rows)
    if cfg.eval.plots:
        from grpo_core.evaluation.plots import make_plots
        make_plots({0: metrics}, {0: [r["length"] for r in rows]}, out, cfg.eval.ks,
                   cfg.eval.max_completion_length or cfg.max_completion_length)


def cmd_eval(args) -> int:
    metrics, rows, alerts = run_eval(args)
    for a in alerts:
        print(f"WARNING: reward-hacking monitor '{a.name}' tripped: {a.message}", file=sys.stderr)
    if args.json:
        print(json.dumps(metrics, indent=2, sort_keys=True))
    else:
        print(format_eval_table({0: metrics}).replace("iter 0", " value", 1))
        if args.output_dir:
            print(f"\nMetrics and samples written to {args.output_dir}")
    return 3 if (alerts and args.fail_on_monitor) else 0
