"""`grpo train`, `grpo config`, `grpo model fetch`: start a training run, show the config it would use,
fetch a built-in model. The run itself is flows.train.training_run; this module only turns arguments
into a validated config and prints the summary."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flows.cli.format import format_eval_table, format_registered
from grpo_core.config import field_help, load_config
from grpo_core.model.loading import BUILTIN_MODELS, DEFAULT_MODEL

TRAIN_EPILOG = """\
Configuration fields (set in the YAML file or with --set key=value; dotted keys for sections):
{fields}

Examples:
  grpo train                                   # the default: SmolLM2-135M-Instruct on 1-digit addition
  grpo train --config configs/default.yaml --set learning_rate=1e-4 --set data.max_digits=2
  grpo train --set model=tiny-random --set pipeline_iterations=1   # a quick smoke run
  grpo train --data my_questions.csv           # your own questions (rows without a checkable answer are rejected)
Re-running with the same --run-name resumes that run: completed stages are skipped.
"""


def default_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


def _load(args):
    """The run's config: the file, then --set, then the options that stand for a field (a bad value given with one
    of those is named by its option: `fix the value given with --run-name`)."""
    overrides, flags = list(args.set or []), {}
    options = (("run_name", "--run-name", getattr(args, "run_name", None)),
               ("output_dir", "--output-dir", getattr(args, "output_dir", None)),
               ("gate.force_promote", "--force-promote", True if getattr(args, "force_promote", False) else None),
               ("data.curated", "--data", json.dumps(str(Path(args.data).resolve())) if getattr(args, "data", None)
                else None))                  # --data FILE: the shortcut for --set data.curated=FILE
    for key, option, value in options:
        if value is not None and value != "":
            overrides.append(f"{key}={'true' if value is True else value}")
            flags[key] = option
    return load_config(args.config, overrides, flags=flags)


def cmd_train(args) -> int:
    cfg = _load(args)
    if cfg.run_name is None:
        cfg.run_name = default_run_name()
    args.run_name, args.output_dir = cfg.run_name, cfg.output_dir     # for the resume hint if it is stopped
    # Imported here, not at the top: Prefect must see the environment main.configure_env() sets.
    from flows.cli.logs import run_console
    from flows.train import engine_settings, preflight, training_run
    preflight(cfg)  # bad model, data, adapter, tracking server, ... fail here, before the engine starts
    from grpo_core.kernels import cpu_features, settings
    from grpo_core.model.loading import describe_precision, describe_prompting, resolve_model, select_device, select_dtype
    settings.apply(cfg.kernels)          # the header says what this run's kernel choices give
    device = select_device(cfg.device)
    print(describe_precision(cfg.dtype, device, cfg.use_peft), flush=True)
    if (prompting := describe_prompting(resolve_model(cfg.model), cfg.stop_strings)):
        print(prompting, flush=True)
    if device.type == "cpu":             # what the fast paths use here, and why any is left out
        print(cpu_features.describe(cpu_features.detect(), select_dtype(cfg.dtype, device, cfg.use_peft)),
              flush=True)
    t0 = time.time()
    with run_console(getattr(args, "debug", False)), engine_settings():
        summary = training_run(config=cfg.model_dump(mode="json"))
    return report(cfg, summary, (time.time() - t0) / 60)


def report(cfg, summary: dict, minutes: float) -> int:
    """The end of `grpo train` / `grpo resume`: the held-out table, where things are, the gate's one line. Exit
    status 3 when a monitor stopped the run (monitors.on_trip: stop), else 0."""
    from tasks.tracking import ui_command
    stopped = summary.get("stopped")
    print("\n" + "=" * 72)
    print(f"Run {cfg.run_name} {'STOPPED by a monitor after' if stopped else 'finished in'} {minutes:.1f} min. "
          f"Held-out evaluation (iteration 0 = base model):\n")
    print(format_eval_table(summary["evals"]))
    print(f"\nRun directory:   {summary['run_dir']}")
    print(f"Final adapter:   {summary['final_checkpoint']}")
    print(f"MLflow run id:   {summary['mlflow_run_id']}")
    if summary.get("registered_model"):
        print(f"Registered as:   {format_registered(summary['registered_model'], summary.get('tracking_uri'))}")
    print(f"Open the UI:     {ui_command(cfg)}")
    if (summary.get("registered_model") or {}).get("gate_summary"):
        print(summary["registered_model"]["gate_summary"])        # the run ends with the gate's one line
    if stopped:
        print("\n".join(f"suspect: {reason}" for reason in stopped))
        print(f"The run is flagged suspect and stopped (monitors.on_trip: stop); read its sample tables. To go on "
              f"anyway: grpo resume {cfg.run_name} --set monitors.on_trip=warn")
        return 3
    return 0


def cmd_config(args) -> int:
    cfg = _load(args)
    sys.stdout.write(cfg.to_yaml())
    return 0


def cmd_model_fetch(args) -> int:
    from grpo_core.model.loading import resolve_model
    path = resolve_model(args.model)
    print(path)
    return 0


def cmd_model_kernels(args) -> int:
    import torch
    from grpo_core.kernels import cpu_features
    features = cpu_features.detect()
    if args.as_isa:
        features = features.with_cap(args.as_isa)
    print(f"cpu: {features.summary()}")
    print(f"compiler: {features.compiler or 'none'}; oneDNN packed linears: fp32 {'yes' if features.onednn else 'no'}, "
          f"bf16 {'yes' if features.onednn_bf16 else 'no'}")
    for dtype in (torch.float32, torch.bfloat16):
        rows = cpu_features.plan(features, dtype)
        if dtype == torch.float32:
            print(f"dtype auto (LoRA): {rows['precision']}")
        print(f"\n{str(dtype).removeprefix('torch.')}:")
        for path, choice in rows.items():
            if path != "precision":
                print(f"  {path:<15} {choice}")
    return 0


def _with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sp.add_argument("--config", "-c", metavar="YAML", help="config file (YAML); defaults apply to missing fields")
    sp.add_argument("--set", "-s", action="append", metavar="KEY=VALUE",
                    help="override a field, e.g. --set beta=0.0 --set data.max_digits=2 (repeatable)")
    return sp


def register(subparsers) -> None:
    """Add `train`, `config`, `model fetch` and `model kernels` to the `grpo` parser's subparsers."""
    t = _with_config(subparsers.add_parser(
        "train", help="run a GRPO training run (the main job)",
        description="Train a model with GRPO. Evaluates the base model, then runs pipeline_iterations iterations "
                    "of curate -> rollout -> score -> update -> evaluate as a Prefect flow, logging to MLflow.",
        epilog=TRAIN_EPILOG.format(fields=field_help()), formatter_class=argparse.RawDescriptionHelpFormatter))
    t.add_argument("--run-name", help="name of the run directory (default: run-<date>-<time>); reuse to resume")
    t.add_argument("--output-dir", help="where run directories and the local MLflow store live (default: runs)")
    t.add_argument("--data", metavar="FILE", help="train on your own questions: a JSONL/CSV/Parquet file or a "
                   "`datasets` directory (columns prompt|question|problem, answer or tests), a dataset from "
                   "`grpo data build`, or a curation YAML; same as --set data.curated=FILE")
    t.add_argument("--force-promote", action="store_true", help="give the new adapter the `champion` alias "
                   "whatever the promotion gate says (tagged gate_reason=forced); same as --set gate.force_promote=true")
    t.set_defaults(func=cmd_train)

    c = _with_config(subparsers.add_parser("config",
                                           help="print the validated config as YAML (defaults + file + overrides)"))
    c.set_defaults(func=cmd_config)

    m = subparsers.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", metavar="<action>", required=True)
    f = msub.add_parser("fetch", help="fetch and convert a built-in model into $GRPO_HOME (done on first use anyway)")
    f.add_argument("model", nargs="?", default=DEFAULT_MODEL, choices=list(BUILTIN_MODELS),
                   help="; ".join(f"{name}: {m.label}, {m.megabytes} MB" for name, m in BUILTIN_MODELS.items()))
    f.set_defaults(func=cmd_model_fetch)
    k = msub.add_parser("kernels", help="what this CPU speeds up: its features and the kernel each fast path takes "
                        "in float32 and bfloat16, with the reason for every one left out")
    k.add_argument("--as", dest="as_isa", choices=("avx2", "avx512", "avx512_bf16", "amx"),
                   help="as a CPU of at most this level would (what kernels.max_cpu_isa does to a run)")
    k.set_defaults(func=cmd_model_kernels)
