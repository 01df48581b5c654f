"""`grpo`: the command line. Subcommands compose flows and library calls; no training logic here."""
from __future__ import annotations

import argparse
import os
import sys
import time

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


def _load(args):
    overrides = list(args.set or [])
    if getattr(args, "run_name", None):
        overrides.append(f"run_name={args.run_name}")
    if getattr(args, "output_dir", None):
        overrides.append(f"output_dir={args.output_dir}")
    return load_config(args.config, overrides)


def format_eval_table(evals: dict) -> str:
    """Compact before/after table of held-out metrics (iteration 0 = base model): overall metrics,
    pass@1 per source, and the monitors; at most 6 iteration columns (first + last 5) and the change."""
    if not evals:
        return "(evaluation disabled)"
    iters = sorted(evals, key=int)
    shown = iters if len(iters) <= 6 else [iters[0], *iters[-5:]]
    keys = {k for m in evals.values() for k in m}
    modes = ("greedy", "sampled")

    def rank(k: str):
        parts = k.split("/")
        if len(parts) >= 3 and parts[1] in modes:                       # overall: eval/<mode>/<metric>
            metric = "/".join(parts[2:])
            if metric == "accuracy":                                     # older alias of pass_at_1
                return None
            order = ((0, int(metric[8:])) if metric.startswith("pass_at_") and metric[8:].isdigit() else
                     (1, 0) if metric.startswith("reward/") else (2, 0))
            return (0, modes.index(parts[1]), order, metric)
        if len(parts) == 4 and parts[2] in modes and parts[3] == "pass_at_1":   # per source / kind
            return (1, parts[1], modes.index(parts[2]), "")
        if parts[1:2] == ["monitor"] and (parts[-1].endswith("_frac") or parts[-1] in ("length_ratio", "tripped_count")) \
                and len(parts) == 3:
            return (2, 0, 0, parts[2])
        return None

    sources = {k.split("/")[1] for k in keys if rank(k) and rank(k)[0] == 1}
    rows = sorted((k for k in keys if rank(k) is not None and not (rank(k)[0] == 1 and len(sources) < 2)
                   and not (k.endswith("/unscored_frac") and not any(evals[i].get(k) for i in iters))), key=rank)
    if not rows:
        return "(no evaluation metrics)"
    width = max(len(k) for k in rows) + 2
    head = f"{'metric':<{width}}" + "".join(f"{'iter ' + str(i):>10}" for i in shown)
    head += f"{'change':>10}" if len(shown) > 1 else ""
    lines = [head, "-" * len(head)]
    for k in rows:
        vals = [evals[i].get(k) for i in shown]
        cells = "".join(f"{v:>10.3f}" if v is not None else f"{'-':>10}" for v in vals)
        if len(shown) > 1:
            cells += f"{vals[-1] - vals[0]:>+10.3f}" if vals[0] is not None and vals[-1] is not None else f"{'':>10}"
        lines.append(f"{k:<{width}}" + cells)
    return "\n".join(lines)


def cmd_train(args) -> int:
    cfg = _load(args)
    if cfg.run_name is None:
        cfg.run_name = default_run_name()
    from flows.train import preflight, training_run
    from tasks.tracking import ui_command
    preflight(cfg)  # a re-run whose settings contradict the existing run fails here, before the engine starts
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

    # Areas that own their subcommands (each module: register(subparsers)).
    from flows.eval_cli import register as register_eval
    from flows.ops_cli import register as register_ops
    from grpo_core.data.cli import register as register_data
    from sandbox.cli import register as register_sandbox
    for register in (register_eval, register_ops, register_data, register_sandbox):
        register(sub)
    return p


def _quiet_libraries() -> None:
    """Keep the terminal for our progress bars and results: no per-load bars or deprecation chatter."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
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
