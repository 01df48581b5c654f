"""`grpo`: the command line. Subcommands compose flows and library calls; no training logic here."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Offline, quiet, robust defaults; set before Prefect / transformers are imported. Users may override.
for _k, _v in {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
               "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}.items():
    os.environ.setdefault(_k, _v)

from grpo_core.config import ConfigError, field_help, load_config  # noqa: E402
from grpo_core.models import ModelError  # noqa: E402

TRAIN_EPILOG = """\
Configuration fields (set in the YAML file or with --set key=value; dotted keys for sections):
{fields}

Examples:
  grpo train                                   # the default: SmolLM2-135M-Instruct on 1-digit addition
  grpo train --config configs/default.yaml --set learning_rate=1e-4 --set data.max_digits=2
  grpo train --set model=tiny-random --set pipeline_iterations=1   # a quick smoke run
Re-running with the same --run-name resumes that run: completed stages are skipped.
"""


def default_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


def _load(args) -> "GRPOConfig":  # noqa: F821
    overrides = list(args.set or [])
    if getattr(args, "run_name", None):
        overrides.append(f"run_name={args.run_name}")
    if getattr(args, "output_dir", None):
        overrides.append(f"output_dir={args.output_dir}")
    return load_config(args.config, overrides)


def format_eval_table(evals: dict) -> str:
    """Before/after table of held-out metrics, iteration 0 = base model."""
    if not evals:
        return "(evaluation disabled)"
    keys = sorted({k for m in evals.values() for k in m if k.count("/") == 2})
    iters = sorted(evals, key=int)
    head = f"{'metric':<34}" + "".join(f"{'iter ' + str(i):>10}" for i in iters)
    lines = [head, "-" * len(head)]
    for k in keys:
        lines.append(f"{k:<34}" + "".join(f"{evals[i].get(k, float('nan')):>10.3f}" for i in iters))
    return "\n".join(lines)


def cmd_train(args) -> int:
    cfg = _load(args)
    if cfg.run_name is None:
        cfg.run_name = default_run_name()
    from flows.train import training_run
    from tasks.tracking import ui_command
    t0 = time.time()
    summary = training_run(config=cfg.model_dump(mode="json"))
    minutes = (time.time() - t0) / 60
    print("\n" + "=" * 72)
    print(f"Run {cfg.run_name} finished in {minutes:.1f} min. Held-out accuracy (iteration 0 = base model):\n")
    print(format_eval_table(summary["evals"]))
    print(f"\nRun directory:   {summary['run_dir']}")
    print(f"Final adapter:   {summary['final_checkpoint']}")
    print(f"MLflow run id:   {summary['mlflow_run_id']}")
    print(f"Open the UI:     {ui_command(cfg)}")
    return 0


def cmd_config(args) -> int:
    cfg = _load(args)
    sys.stdout.write(cfg.to_yaml())
    return 0


def cmd_model_fetch(args) -> int:
    from grpo_core.models import resolve_model
    path = resolve_model(args.model)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="grpo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="GRPO training pipeline for small language models: Prefect flows (curate, rollout, "
                    "score, update, evaluate), rewards checked by programs, everything tracked in MLflow.",
        epilog="Run `grpo <command> --help` for the options of a command.")
    sub = p.add_subparsers(dest="command", metavar="<command>", required=True)

    def with_config(sp):
        sp.add_argument("--config", "-c", metavar="YAML", help="config file (YAML); defaults apply to missing fields")
        sp.add_argument("--set", "-s", action="append", metavar="KEY=VALUE",
                        help="override a field, e.g. --set beta=0.0 --set data.max_digits=2 (repeatable)")
        return sp

    t = with_config(sub.add_parser(
        "train", help="run a GRPO training run (the main job)",
        description="Train a model with GRPO. Evaluates the base model, then runs pipeline_iterations iterations "
                    "of curate -> rollout -> score -> update -> evaluate as a Prefect flow, logging to MLflow.",
        epilog=TRAIN_EPILOG.format(fields=field_help()), formatter_class=argparse.RawDescriptionHelpFormatter))
    t.add_argument("--run-name", help="name of the run directory (default: run-<date>-<time>); reuse to resume")
    t.add_argument("--output-dir", help="where run directories and the local MLflow store live (default: runs)")
    t.set_defaults(func=cmd_train)

    c = with_config(sub.add_parser("config", help="print the validated config as YAML (defaults + file + overrides)"))
    c.set_defaults(func=cmd_config)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", metavar="<action>", required=True)
    f = msub.add_parser("fetch", help="fetch and convert a built-in model into $GRPO_HOME (done on first use anyway)")
    f.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    f.set_defaults(func=cmd_model_fetch)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ModelError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; re-run the same command with --run-name to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
