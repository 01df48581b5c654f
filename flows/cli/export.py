"""`grpo export RUN --out DIR`: a trained run as a plain Hugging Face model directory.

grpo_core.model.export writes the directory (LoRA merged into the weights, tokenizer with chat template,
`generation_config.json` with the training sampling settings, a model card); this module only picks
the iteration (--iteration K, --best by the rule the registry uses, or the last completed one), fills
the card from the run's config and evaluation records, and logs the export to the run's MLflow run
(`export/iter-<k>`) with a registered model version whose source is that artifact path.
Flows and tracking are imported inside the functions, after main.configure_env().
"""
from __future__ import annotations

import argparse
from pathlib import Path

from flows.cli.format import format_eval_table
from flows.cli.ops import find_run_dir, run_config
from grpo_core.config import ConfigError, GRPOConfig

EPILOG = """\
examples:
  grpo export nightly-1 --out exported/nightly-1              # the last completed iteration, merged
  grpo export runs/nightly-1 --best --out exported/best       # the best held-out iteration
  grpo export nightly-1 --iteration 3 --adapter-only --out exported/adapter-3
  grpo export nightly-1 --with-examples --out exported/nightly-1  # default turns: system prompt + examples
Load a merged export with plain transformers: AutoModelForCausalLM.from_pretrained(DIR). Its chat template
prompts as training did when your messages bring no system message of their own; for a run with tools, pass
them as apply_chat_template(messages, tools=[schema]) and give results as {"role": "tool", ...} messages
(README.md in DIR shows the schemas and the exact prompt).
"""


def checkpoint_of(run_dir: Path, iteration: int) -> Path:
    from grpo_core.update.checkpoint import ADAPTER_DIR
    return run_dir / f"iter-{iteration}" / "update" / ADAPTER_DIR


def pick_iteration(cfg: GRPOConfig, run_dir: Path, evals: dict, iteration: int | None, best: bool) -> int:
    """--iteration K, or --best (tasks.run.best_iteration: the registry's rule), or the last completed
    iteration; refused with one line when that iteration left no checkpoint."""
    from tasks.run import best_iteration
    from tasks.run_state import iterations_done
    last = iterations_done(run_dir)
    if iteration is None:
        if not last:
            raise ConfigError(f"run {run_dir.name!r} has no completed iteration yet: nothing to export")
        iteration = best_iteration(cfg, evals, last) if best else last
    if iteration < 1 or not (checkpoint_of(run_dir, iteration) / "adapter_config.json").exists():
        raise ConfigError(f"run {run_dir.name!r} has no checkpoint for iteration {iteration} "
                          f"(completed iterations: {f'1..{last}' if last else 'none'}; 0 is the base model)")
    return iteration


def export_run(run: str, out: str | Path, iteration: int | None = None, best: bool = False,
               adapter_only: bool = False, overwrite: bool = False, output_dir: str | None = None,
               registered_name: str | None = "grpo-model", default_system: bool = True,
               with_examples: bool = False) -> dict:
    """Export one iteration of a run to `out` and log it to the run's MLflow run. Returns the run name,
    the iteration, the export path and, when the run is tracked, its artifact and registered model URIs.
    `default_system`: the chat template puts the training system prompt (`with_examples`: and the worked
    examples) before a conversation that has no system message, and a run with tools gets a template that
    renders `tools=` as training did (False: the base template, tools and system prompt left to the caller)."""
    from grpo_core.model.export import ModelCard, default_turns, export_model, generation_settings
    from grpo_core.model.loading import resolve_model
    from grpo_core.rollout.sampling import sampling_options
    from grpo_core.rollout.tools import resolve_tools
    from tasks import registry, tracking
    from tasks.evaluate import eval_history
    from tasks.run_state import mlflow_run_id
    # 1) the run, its config and evaluations, and the iteration to export
    run_dir = find_run_dir(run, output_dir)
    cfg = run_config(run_dir)
    evals = eval_history(run_dir)
    k = pick_iteration(cfg, run_dir, evals, iteration, best)
    run_id = mlflow_run_id(run_dir)
    tracking.check_run_in_store(cfg, run_dir)      # before anything is written: the export is logged there

    # 2) the model directory, with the card and sampling settings of training
    card = ModelCard(base_model=cfg.model, run_name=run_dir.name, mlflow_run_id=run_id, iteration=k,
                     system_prompt=cfg.data.system_prompt, few_shot=[tuple(x) for x in cfg.data.few_shot],
                     response_prefix=cfg.data.prompt_format.response_prefix, eval_table=format_eval_table(evals),
                     default_turns=default_turns(cfg.data.system_prompt, cfg.data.few_shot if with_examples else ())
                     if default_system else [], template_defaults=dict(cfg.data.chat_template_kwargs),
                     tools=[t.schema for t in resolve_tools(cfg.tools, cfg.sandbox)], environment=cfg.environment)
    options = sampling_options(cfg)             # generation_kwargs override top_p ... as in training
    sampling = generation_settings(cfg.temperature, options["top_p"], options["top_k"], cfg.max_completion_length,
                                   options["min_p"], options["repetition_penalty"], options["stop_strings"])
    try:
        path = export_model(resolve_model(cfg.model), checkpoint_of(run_dir, k), out, card, sampling,
                            adapter_only=adapter_only, overwrite=overwrite, tool_template=default_system)
    except FileExistsError as e:
        raise ConfigError(str(e)) from None

    # 3) the run's artifacts, and a registered model version pointing at them
    result = {"run": run_dir.name, "iteration": k, "out": str(path), "mlflow_run_id": run_id,
              "eval": evals.get(k, {}).get(cfg.tracking.best_metric)}
    if run_id:
        result.update(registry.register_export(cfg, run_id, path, k, registered_name, adapter_only))
    return result


def cmd_export(args) -> int:
    name = None if args.registered_name.lower() == "none" else args.registered_name
    res = export_run(args.run, args.out, args.iteration, args.best, args.adapter_only, args.overwrite,
                     args.output_dir, name, default_system=not args.no_default_system,
                     with_examples=args.with_examples)
    kind = "adapter" if args.adapter_only else "merged model"
    score = f", held-out {res['eval']:.3f}" if res["eval"] is not None else ""
    print(f"Exported {res['run']} iteration {res['iteration']} ({kind}{score}) to {res['out']}")
    if res.get("artifact_uri"):
        print(f"MLflow artifacts: {res['artifact_uri']}")
    if res.get("uri"):
        print(f"Registered as:    {res['uri']} ({res['alias_uri']})")
    elif not res["mlflow_run_id"]:
        print("(the run has no MLflow run: nothing logged or registered)")
    return 0


def register(sub) -> None:
    """Add `export` to the `grpo` parser's subparsers."""
    e = sub.add_parser(
        "export", help="write a run's model as a plain Hugging Face directory (LoRA merged) and register it",
        description="Export one iteration of a run: LoRA merged into the base weights (or --adapter-only), the "
                    "tokenizer and chat template, generation_config.json with the training sampling settings, and "
                    "a model card (prompt format, eval table, MLflow run id). The export is logged to the run's "
                    "MLflow run as export/iter-<k> and registered as a new version of --registered-name.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("run", metavar="RUN", help="run name (under --output-dir) or run directory")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, metavar="K", help="export iteration K (its iter-K/update/checkpoint)")
    which.add_argument("--best", action="store_true",
                       help="export the iteration with the best held-out tracking.best_metric")
    e.add_argument("--out", required=True, metavar="DIR", help="directory to write (must not exist unless --overwrite)")
    e.add_argument("--adapter-only", action="store_true", help="export the LoRA adapter instead of merged weights")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    turns = e.add_mutually_exclusive_group()
    turns.add_argument("--with-examples", action="store_true",
                       help="the chat template's default turns also hold the training's worked examples (by default "
                            "only its system prompt, put before any conversation that brings no system message)")
    turns.add_argument("--no-default-system", action="store_true",
                       help="keep the base model's chat template: callers give the system prompt (and, for a run "
                            "with tools, the tool list and tool turns) themselves")
    e.add_argument("--output-dir", default="runs", help="where the run directories live (default: runs)")
    e.add_argument("--registered-name", default="grpo-model",
                   help="MLflow registered model for merged exports (default: grpo-model; 'none': do not register)")
    e.set_defaults(func=cmd_export)
