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

from flows.cli.format import format_comparison, format_runs_table, format_schedules
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
    from flows.cli.train import report
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
    return report(cfg, summary, (time.time() - t0) / 60)


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
    if args.action == "list":
        return _print_schedules(schedule.list_schedules(), args.json)
    if args.action in ("pause", "resume", "delete"):
        if not args.target:
            raise ConfigError(f"grpo schedule {args.action} needs the schedule's name (`grpo schedule list` shows "
                              f"them), e.g. grpo schedule {args.action} nightly")
        if args.action == "delete":
            schedule.delete(args.target)
        else:
            schedule.set_paused(args.target, args.action == "pause")
        print(f"schedule {args.target!r}: {args.action}d" if args.action != "pause" else
              f"schedule {args.target!r}: paused (a run in progress finishes; resume with grpo schedule resume "
              f"{args.target})")
        return 0
    if not args.config:
        raise ConfigError("grpo schedule needs --config YAML (the training config each run uses)")
    cfg = load_config(args.config, list(args.set or []) + (["gate.force_promote=true"] if args.force_promote else []))
    when = schedule.make_schedule(args.cron, args.interval, args.timezone)
    name = args.target or args.name
    if cfg.run_name:
        print(f"note: run_name {cfg.run_name!r} is ignored; each scheduled run gets its own name", file=sys.stderr)
    schedule.check_server()
    schedule.check_name_free(cfg, when, name, args.init_from_previous, args.work_pool)
    if args.work_pool:
        dep_id = schedule.deploy(cfg, args.work_pool, when, name, args.init_from_previous, image=args.image)
        print(f"deployment grpo-training-run/{name} ({dep_id}) on pool {args.work_pool!r}, {schedule.describe(when)}.\n"
              f"Start a worker: prefect worker start --pool {args.work_pool}\n"
              f"Run it now:     prefect deployment run grpo-training-run/{name}")
        return 0
    print(f"serving grpo-training-run/{name}, {schedule.describe(when)} (Ctrl-C stops; runs happen in this process)")
    schedule.serve(cfg, when, name, args.init_from_previous)
    return 0


def _print_schedules(rows: list[dict], as_json: bool) -> int:
    if as_json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no schedules on the server; start one with grpo schedule --interval 6h --config X.yaml")
    else:
        print(format_schedules(rows))
    return 0


# -- grpo compare ---------------------------------------------------------------------------------------

def resolve_runs(runs: list[str], output_dir: str | None, tracking_uri: str | None):
    """(label, tracking uri, mlflow run id) for run dirs / run names / MLflow run ids."""
    from tasks.run_state import mlflow_run_id
    from tasks.tracking import default_tracking_uri, tracking_uri as uri_of
    out = []
    for r in runs:
        try:
            d = find_run_dir(r, output_dir)
        except ConfigError:
            d = None
        if d is not None and (run_id := mlflow_run_id(d)):
            out.append((d.name, tracking_uri or uri_of(run_config(d)), run_id))
            continue
        uri = tracking_uri or default_tracking_uri(output_dir or "runs")
        out.append((r, uri, r))     # an MLflow run id (or a run name, looked up below)
    return out


def _fetch(uri: str, run_ref: str):
    """(client, run) of an MLflow run id or run name in the store at `uri`; a store that is not there is not
    created (ConfigError naming the run)."""
    from mlflow.tracking import MlflowClient
    from tasks.tracking import require_store
    require_store(uri, f"no run directory or MLflow run {run_ref!r}")
    c = MlflowClient(tracking_uri=uri)
    try:
        return c, c.get_run(run_ref)
    except Exception:  # noqa: BLE001 - not a run id: try it as a run name
        found = c.search_runs([e.experiment_id for e in c.search_experiments()],
                              f"attributes.run_name = '{run_ref}'", order_by=["attributes.start_time DESC"],
                              max_results=1)
        if not found:
            raise ConfigError(f"no run directory or MLflow run {run_ref!r} (no run with that id or name in {uri}); "
                              f"`grpo runs --output-dir DIR` lists the runs of a directory") from None
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
    statuses = [f[2].info.status for f in fetched]
    table = format_comparison(labels, diff, final, statuses)
    result = {"labels": labels, "statuses": statuses, "config_diff": diff, "final_metrics": final, "table": table}
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
    if args.json:
        print(json.dumps({k: res[k] for k in ("labels", "statuses", "config_diff", "final_metrics")}, indent=2))
    elif args.csv:
        comparison_csv(res, sys.stdout)
    else:
        print(res["table"])
    if res.get("png"):
        print(f"\ncurves written to {res['png']}", file=sys.stderr if args.json or args.csv else sys.stdout)
    return 0


def comparison_csv(res: dict, out) -> None:
    """The comparison as CSV: a row per config difference and per metric (section, name, one column per run)."""
    import csv
    w = csv.writer(out)
    w.writerow(["section", "name", *res["labels"]])
    w.writerow(["status", "status", *res["statuses"]])
    for section, table in (("config", res["config_diff"]), ("metric", res["final_metrics"])):
        for name, values in table.items():
            w.writerow([section, name, *("" if v is None else v for v in values)])


# -- grpo adapter ---------------------------------------------------------------------------------------

def cmd_adapter_fetch(args) -> int:
    from tasks.registry import download_adapter
    from tasks.tracking import default_tracking_uri
    print(download_adapter(args.uri, args.dest, args.tracking_uri or default_tracking_uri(args.output_dir)))
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
                                   "fields (stages.*, tracking.*, keep_trainer_states) may be changed with --set; "
                                   "anything else is refused.")
    r.add_argument("run", help="run name (under --output-dir) or run directory")
    r.add_argument("--output-dir", default="runs", help="where the run directories live (default: runs)")
    set_opt(r)
    r.set_defaults(func=cmd_resume)

    ls = sub.add_parser("runs", help="list runs: status, last completed stage, MLflow run id")
    ls.add_argument("--output-dir", default="runs", help="where the run directories live (default: runs)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_runs)

    _register_schedule(sub, set_opt)
    _register_gate(sub, set_opt)

    c = sub.add_parser("compare", help="side-by-side config differences and final metrics of runs; PNG of curves")
    c.add_argument("runs", nargs="+", metavar="RUN", help="run names, run directories or MLflow run ids")
    c.add_argument("--output-dir", default="runs", help="where the run directories live (default: runs)")
    c.add_argument("--tracking-uri", help="MLflow URI (default: the runs' own)")
    c.add_argument("--png", help="write the main curves to this PNG")
    c.add_argument("--metrics", nargs="*", help="metric name prefixes to show (default: main eval/reward/train)")
    out = c.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="print CSV: section, name, one column per run")
    out.add_argument("--json", action="store_true", help="print JSON: labels, statuses, config_diff, final_metrics")
    c.set_defaults(func=cmd_compare)

    a = sub.add_parser("adapter", help="trained adapters in MLflow")
    asub = a.add_subparsers(dest="adapter_command", metavar="<action>", required=True)
    f = asub.add_parser("fetch", help="download an adapter (models:/NAME@ALIAS, e.g. "
                        "models:/grpo-arithmetic-1d-add-sub@champion or @run-<run name>; models:/NAME/VERSION; "
                        "runs:/ID/PATH) to a directory")
    f.add_argument("uri", help="models:/NAME@ALIAS, models:/NAME/VERSION or runs:/ID/PATH")
    f.add_argument("--dest", default=".", help="directory to download into (default: the current one)")
    f.add_argument("--tracking-uri", help="MLflow tracking and registry URI (default: $MLFLOW_TRACKING_URI, else "
                   "the SQLite store of --output-dir, where `grpo train` logs)")
    f.add_argument("--output-dir", default="runs", help="where the run directories and their SQLite store live "
                   "(default: runs)")
    f.set_defaults(func=cmd_adapter_fetch)


def cmd_gate(args) -> int:
    """`grpo gate init` draws the config's task's gate set afresh and stores it; `grpo gate show` prints it, and what
    the gate can detect on it."""
    from grpo_core.evaluation import gate as stats
    from grpo_core.evaluation.task_identity import registered_model_name
    from tasks import gate
    if args.run:
        raise ConfigError("grpo gate init --run is gone: a gate set is no longer a run's held-out split (runs pick "
                          "their registered iteration on that split); `grpo gate init --config YAML` draws the "
                          "task's own")
    cfg = load_config(args.config, list(args.set or []))
    name = registered_model_name(cfg)
    if not name:
        raise ConfigError("tracking.registered_model_name is off (null): there is no champion to gate")
    record = gate.init_gate_set(cfg) if args.action == "init" else gate.current_gate_set(cfg)
    if record is None:
        print(f"{name}: no gate set yet (the task's first run stores one, or: grpo gate init --config YAML)")
        return 0
    print(f"{name} gate set: {record['questions']} questions, hash {record['hash']}, {record['uri']}")
    n, alpha = int(record["questions"]), 1 - cfg.gate.confidence
    held = gate.champion_score(cfg)
    for p, who in ([(held, "the champion")] if held is not None else []) + [(p, "a champion") for p in (0.3, 0.5, 0.7)]:
        gain = stats.detectable_gain(n, min(max(p, 0.01), 0.99), alpha, power=0.8)
        print(f"  {who} at {p:.0%}: " + ("too little room above it for any gain to show" if math.isinf(gain) else
                                        f"the gate detects a gain of {gain * 100:.0f} points with 80% power")
              + f" (alpha {alpha:g}, {cfg.tracking.best_metric})")
    return 0


def _register_gate(sub, set_opt) -> None:
    """`grpo gate init | show`: the frozen questions the promotion gate compares adapters on."""
    g = sub.add_parser("gate", help="the promotion gate's frozen question set of a task: show it, or draw it afresh")
    g.add_argument("action", choices=["init", "show"], help="init: draw the task's gate set (its own questions, "
                   "disjoint from the eval split) and store it, replacing the current one; show: the current gate "
                   "set and the smallest gain the gate detects on it")
    g.add_argument("--run", help=argparse.SUPPRESS)
    g.add_argument("--config", "-c", metavar="YAML", help="the training config (its task and tracking settings)")
    set_opt(g)
    g.set_defaults(func=cmd_gate)


def _register_schedule(sub, set_opt) -> None:
    """`grpo schedule`: start one (serve or deploy), or list, pause, resume, delete them."""
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser("schedule", formatter_class=fmt, help="recurring training runs: start, list, pause, resume, "
                       "delete schedules (needs a Prefect server)",
                       description="Serve (or, with --work-pool, deploy) training_run on a cron or interval schedule, "
                                   "or manage the schedules on the server. Needs a Prefect server: `prefect server "
                                   "start` or `grpo infra up`, and PREFECT_API_URL pointing at it. Each run is a new "
                                   "run directory and MLflow run; `grpo runs` shows which schedule started it. A run "
                                   "still going when the next is due is not started twice (the next waits).",
                       epilog="examples:\n"
                              '  grpo schedule --cron "0 3 * * *" --config configs/default.yaml --init-from-previous\n'
                              "  grpo schedule --interval 6h --config configs/default.yaml --name every-6h\n"
                              "  grpo schedule list\n  grpo schedule pause every-6h\n  grpo schedule resume every-6h\n"
                              "  grpo schedule delete every-6h")
    s.add_argument("action", nargs="?", default="start", choices=["start", "list", "pause", "resume", "delete"],
                   help="start (default) serves or deploys a schedule; list/pause/resume/delete manage them")
    s.add_argument("target", nargs="?", metavar="NAME", help="the schedule to pause, resume or delete")
    when = s.add_mutually_exclusive_group()
    when.add_argument("--cron", help='cron expression, e.g. "0 3 * * *" (03:00 every day)')
    when.add_argument("--interval", help="a run every so long: 90s, 15m, 6h, 1d, 1h30m")
    s.add_argument("--config", "-c", metavar="YAML", help="the training config of each run (start)")
    set_opt(s)
    s.add_argument("--name", default="nightly", help="schedule (deployment) name (default: nightly)")
    s.add_argument("--timezone", default="UTC", help="IANA time zone of --cron and --interval, e.g. Europe/Berlin "
                   "(default: UTC)")
    s.add_argument("--init-from-previous", action="store_true",
                   help="start each run from the champion (else the best adapter of the last finished run in the "
                        "experiment)")
    s.add_argument("--force-promote", action="store_true", help="every run's adapter takes `champion` whatever "
                   "the promotion gate says (tagged forced)")
    s.add_argument("--work-pool", help="deploy to this work pool instead of serving from this process")
    s.add_argument("--image", help="worker image for docker/kubernetes pools")
    s.add_argument("--json", action="store_true", help="list: machine-readable output")
    s.set_defaults(func=cmd_schedule)
