"""Operations commands: `grpo resume`, `grpo runs`, `grpo schedule`, `grpo compare`, `grpo adapter`.

Each handler is also a plain function (`list_runs`, `compare_runs`); the tables they print live in
flows/cli/format.py. Flows and tracking are imported inside the handlers, after main.configure_env().
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from flows.cli.format import format_comparison, format_eval_table, format_registered, format_runs_table
from grpo_core.config import ConfigError, GRPOConfig, load_config

DEFAULT_METRIC_PREFIXES = ("eval/greedy/", "eval/sampled/", "reward/", "train/loss", "train/kl", "train/reward",
                           "data/", "sys/iteration_seconds")


# -- locating runs --------------------------------------------------------------------------------------

def find_run_dir(run: str, output_dir: str | None = None) -> Path:
    """RUN is a run directory, or a run name under --output-dir (default: runs)."""
    p = Path(run).expanduser()
    if (p / "config.yaml").exists():
        return p
    q = Path(output_dir or "runs") / run
    if (q / "config.yaml").exists():
        return q
    raise ConfigError(f"no run {run!r}: neither {p} nor {q} holds a config.yaml; `grpo runs --output-dir DIR` "
                      f"lists the runs of a directory")


def run_config(run_dir: Path, overrides: list[str] | None = None) -> GRPOConfig:
    cfg = load_config(run_dir / "config.yaml", list(overrides or []))
    cfg.run_name = run_dir.name
    cfg.output_dir = str(run_dir.parent)
    return cfg


# -- grpo resume ----------------------------------------------------------------------------------------

def cmd_resume(args) -> int:
    import time
    from flows.cli.logs import run_console
    from flows.train import engine_settings, preflight, training_run
    from tasks.run_state import run_status
    run_dir = find_run_dir(args.run, args.output_dir)
    cfg = run_config(run_dir, args.set)
    preflight(cfg)
    before = run_status(run_dir)
    print(f"Resuming {run_dir} (status {before['status']}, last completed {before['last_completed']}, "
          f"MLflow run {before['mlflow_run_id']})")
    t0 = time.time()
    with run_console(getattr(args, "debug", False)), engine_settings():
        summary = training_run(config=cfg.model_dump(mode="json"))
    print(f"\nRun {cfg.run_name} finished ({(time.time() - t0) / 60:.1f} min this time).\n")
    print(format_eval_table(summary["evals"]))
    print(f"\nFinal adapter:   {summary['final_checkpoint']}\nMLflow run id:   {summary['mlflow_run_id']}")
    if summary.get("registered_model"):
        print(f"Registered as:   {format_registered(summary['registered_model'])}")
    return 0


# -- grpo runs ------------------------------------------------------------------------------------------

def list_runs(output_dir: str | Path) -> list[dict]:
    from tasks.run_state import run_status
    root = Path(output_dir)
    rows = [run_status(d) for d in sorted(root.iterdir()) if (d / "config.yaml").exists()] if root.is_dir() else []
    return sorted(rows, key=lambda r: r["updated"])


def cmd_runs(args) -> int:
    rows = list_runs(args.output_dir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no runs under {args.output_dir}")
        return 0
    print(format_runs_table(rows))
    from tasks.run_state import RESUMABLE
    if any(r["status"] in RESUMABLE for r in rows):
        print("\ncontinue a failed, killed or interrupted run with: grpo resume RUN"
              + (f" --output-dir {args.output_dir}" if args.output_dir != "runs" else ""))
    return 0


# -- grpo schedule --------------------------------------------------------------------------------------

def cmd_schedule(args) -> int:
    from flows import schedule
    cfg = load_config(args.config, list(args.set or []))
    if cfg.run_name:
        print(f"note: run_name {cfg.run_name!r} is ignored; each scheduled run gets its own name", file=sys.stderr)
    schedule.check_server()
    if args.work_pool:
        dep_id = schedule.deploy(cfg, args.work_pool, args.cron, args.name, args.init_from_previous, args.timezone,
                                 image=args.image)
        print(f"deployment grpo-training-run/{args.name} ({dep_id}) on pool {args.work_pool!r}, cron {args.cron!r}.\n"
              f"Start a worker: prefect worker start --pool {args.work_pool}\n"
              f"Run it now:     prefect deployment run grpo-training-run/{args.name}")
        return 0
    print(f"serving grpo-training-run/{args.name} on cron {args.cron!r} (Ctrl-C stops; runs happen in this process)")
    schedule.serve(cfg, args.cron, args.name, args.init_from_previous, args.timezone)
    return 0


# -- grpo compare ---------------------------------------------------------------------------------------

def resolve_runs(runs: list[str], output_dir: str | None, tracking_uri: str | None):
    """(label, tracking uri, mlflow run id) for run dirs / run names / MLflow run ids."""
    import os
    from grpo_core.io import read_json
    from tasks.tracking import tracking_uri as uri_of
    out = []
    for r in runs:
        try:
            d = find_run_dir(r, output_dir)
        except ConfigError:
            d = None
        if d is not None and (d / "run.json").exists() and read_json(d / "run.json").get("mlflow_run_id"):
            cfg = run_config(d)
            out.append((d.name, tracking_uri or uri_of(cfg), read_json(d / "run.json")["mlflow_run_id"]))
            continue
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(Path(output_dir or 'runs')).resolve() / 'mlflow.db'}"
        out.append((r, uri, r))     # an MLflow run id (or a run name, looked up below)
    return out


def _fetch(uri: str, run_ref: str):
    from mlflow.tracking import MlflowClient
    c = MlflowClient(tracking_uri=uri)
    try:
        return c, c.get_run(run_ref)
    except Exception:  # noqa: BLE001 - not a run id: try it as a run name
        found = c.search_runs([e.experiment_id for e in c.search_experiments()],
                              f"attributes.run_name = '{run_ref}'", order_by=["attributes.start_time DESC"],
                              max_results=1)
        if not found:
            raise ConfigError(f"no MLflow run with id or name {run_ref!r} in {uri}") from None
        return c, found[0]


def compare_runs(runs: list[str], output_dir: str | None = None, tracking_uri: str | None = None,
                 png: str | None = None, prefixes: tuple[str, ...] = DEFAULT_METRIC_PREFIXES) -> dict:
    """Side-by-side table of config differences and final metrics; optionally a PNG of the main curves."""
    fetched = []
    for label, uri, ref in resolve_runs(runs, output_dir, tracking_uri):
        c, run = _fetch(uri, ref)
        fetched.append((label if label != ref else (run.info.run_name or ref), c, run))
    labels = [f[0] for f in fetched]
    params = [f[2].data.params for f in fetched]
    skip = {"run_name", "output_dir"}
    diff = {k: [p.get(k, "-") for p in params] for k in sorted(set().union(*params))
            if k not in skip and len({p.get(k, "-") for p in params}) > 1}
    metrics = [f[2].data.metrics for f in fetched]
    keys = sorted(k for k in set().union(*metrics) if k.startswith(tuple(prefixes)))
    final = {k: [m.get(k) for m in metrics] for k in keys}
    table = format_comparison(labels, diff, final, [f[2].info.status for f in fetched])
    result = {"labels": labels, "config_diff": diff, "final_metrics": final, "table": table}
    if png:
        result["png"] = _plot(fetched, png)
    return result


def _plot(fetched, png: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    available = set().union(*(f[2].data.metrics for f in fetched))
    from tasks.tracking import KEY_CURVES          # the run page's key curves, in the same order
    curves = [k for k in KEY_CURVES if k in available] or sorted(available)[:4]
    n = max(1, len(curves))
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, curves):
        for label, c, run in fetched:
            hist = sorted(c.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
            if hist:
                ax.plot([m.step for m in hist], [m.value for m in hist], marker="o", ms=3, label=label)
        ax.set_title(key)
        ax.set_xlabel("step (eval, data: iteration)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(curves):]:
        ax.set_visible(False)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def cmd_compare(args) -> int:
    res = compare_runs(args.runs, args.output_dir, args.tracking_uri, args.png,
                       tuple(args.metrics) if args.metrics else DEFAULT_METRIC_PREFIXES)
    print(res["table"])
    if res.get("png"):
        print(f"\ncurves written to {res['png']}")
    return 0


# -- grpo adapter ---------------------------------------------------------------------------------------

def cmd_adapter_fetch(args) -> int:
    from tasks.tracking import download_adapter
    print(download_adapter(args.uri, args.dest, args.tracking_uri))
    return 0


# -- wiring ---------------------------------------------------------------------------------------------

def register(sub) -> None:
    """Add the operations subcommands to the `grpo` parser's subparsers."""
    fmt = argparse.RawDescriptionHelpFormatter

    def set_opt(sp):
        sp.add_argument("--set", "-s", action="append", metavar="KEY=VALUE", help="override a field (repeatable)")

    r = sub.add_parser("resume", formatter_class=fmt, help="continue a failed or killed run where it stopped",
                       description="Continue a run: completed stages are skipped (their records under iter-<k>/), "
                                   "the first unfinished stage runs, the same MLflow run is reopened.\nOnly operational "
                                   "fields (stages.*, tracking.*) may be changed with --set; anything else is refused.")
    r.add_argument("run", help="run name (under --output-dir) or run directory")
    r.add_argument("--output-dir", default="runs", help="where the run directories live (default: runs)")
    set_opt(r)
    r.set_defaults(func=cmd_resume)

    ls = sub.add_parser("runs", help="list runs: status, last completed stage, MLflow run id")
    ls.add_argument("--output-dir", default="runs", help="where the run directories live (default: runs)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_runs)

    s = sub.add_parser("schedule", formatter_class=fmt, help="run training on a cron schedule (needs a Prefect server)",
                       description="Serve (or, with --work-pool, deploy) training_run on a cron schedule. Needs a "
                                   "Prefect server: `prefect server start` or infra/docker-compose.yml, and "
                                   "PREFECT_API_URL pointing at it. Each run is a new run directory and MLflow run.",
                       epilog='example: grpo schedule --cron "0 3 * * *" --config configs/default.yaml --init-from-previous')
    s.add_argument("--cron", required=True, help='cron expression, e.g. "0 3 * * *" (03:00 every day)')
    s.add_argument("--config", "-c", required=True, metavar="YAML")
    set_opt(s)
    s.add_argument("--name", default="nightly", help="deployment name (default: nightly)")
    s.add_argument("--timezone", default="UTC")
    s.add_argument("--init-from-previous", action="store_true",
                   help="start each run from the best adapter of the last finished run in the experiment")
    s.add_argument("--work-pool", help="deploy to this work pool instead of serving from this process")
    s.add_argument("--image", help="worker image for docker/kubernetes pools")
    s.set_defaults(func=cmd_schedule)

    c = sub.add_parser("compare", help="side-by-side config differences and final metrics of runs; PNG of curves")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run names, run directories or MLflow run ids")
    c.add_argument("--output-dir", default="runs")
    c.add_argument("--tracking-uri", help="MLflow URI (default: the runs' own)")
    c.add_argument("--png", help="write the main curves to this PNG")
    c.add_argument("--metrics", nargs="*", help="metric name prefixes to show (default: main eval/reward/train)")
    c.set_defaults(func=cmd_compare)

    a = sub.add_parser("adapter", help="trained adapters in MLflow")
    asub = a.add_subparsers(dest="adapter_command", metavar="<action>", required=True)
    f = asub.add_parser("fetch", help="download an adapter (models:/NAME@ALIAS, e.g. models:/grpo-adapter@champion "
                        "or @run-<run name>; models:/NAME/VERSION; runs:/ID/PATH) to a directory")
    f.add_argument("uri")
    f.add_argument("--dest", default=".")
    f.add_argument("--tracking-uri")
    f.set_defaults(func=cmd_adapter_fetch)

