"""The tables the commands print, as plain strings: held-out metrics before/after, the runs of a
directory, runs side by side, the sources of a built dataset. Pure functions of their inputs; no
command logic and no I/O here."""
from __future__ import annotations

import math

EVAL_MODES = ("greedy", "sampled")
WORDING_ROWS = ("pass_at_1", "strict_pass_at_1", "format_rate", "tool_call_rate")   # of exported/, foreign/
WORDINGS = ("exported", "foreign")
RUN_COLUMNS = ("run", "status", "suspect", "iterations", "last_completed", "schedule", "mlflow_run_id", "updated")
SCHEDULE_COLUMNS = ("name", "schedule", "paused", "work_pool", "completed", "running", "failed", "last_run")


# -- held-out metrics -----------------------------------------------------------------------------------

def _eval_row_rank(key: str):
    """Sort key of a metric row of the eval table, or None for a metric the table leaves out."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[1] in EVAL_MODES:                      # overall: eval/<mode>/<metric>
        metric = "/".join(parts[2:])
        if metric == "accuracy":                    # grpo_core.evaluation.evaluate's older alias of greedy pass_at_1
            return None
        wording, _, rest = metric.partition("/")
        if wording in WORDINGS:     # as an exported model is asked; in wordings training never used
            if rest not in WORDING_ROWS:
                return None
            return (0, EVAL_MODES.index(parts[1]), (3, WORDINGS.index(wording)), metric)
        order = ((0, int(metric[8:])) if metric.startswith("pass_at_") and metric[8:].isdigit() else
                 (1, 0) if metric.startswith("reward/") else (2, 0))
        return (0, EVAL_MODES.index(parts[1]), order, metric)
    if len(parts) == 4 and parts[2] in EVAL_MODES and parts[3] == "pass_at_1":   # per source / kind
        return (1, parts[1], EVAL_MODES.index(parts[2]), "")
    if parts[1:2] == ["monitor"] and parts[-1].endswith("_frac") and len(parts) == 3:
        return (2, 0, 0, parts[2])
    return None


def _same_as_length(key: str, evals: dict) -> bool:
    """A tokens_per_turn row that repeats completion_length (answers of one turn each): left out of the table."""
    if not key.endswith("/tokens_per_turn"):
        return False
    twin = key[:-len("tokens_per_turn")] + "completion_length"
    return all(m.get(key) == m.get(twin) for m in evals.values())


def format_eval_table(evals: dict) -> str:
    """Compact before/after table of held-out metrics (iteration 0 = base model): overall metrics,
    pass@1 per source, and the monitors; at most 6 iteration columns (first + last 5) and the change."""
    if not evals:
        return "(evaluation disabled)"
    iters = sorted(evals, key=int)
    shown = iters if len(iters) <= 6 else [iters[0], *iters[-5:]]
    keys = {k for m in evals.values() for k in m}
    ranks = {k: _eval_row_rank(k) for k in keys}
    sources = {k.split("/")[1] for k, r in ranks.items() if r and r[0] == 1}
    rows = sorted((k for k, r in ranks.items() if r is not None and not (r[0] == 1 and len(sources) < 2)
                   and not (k.endswith("/unscored_frac") and not any(evals[i].get(k) for i in iters))
                   and not _same_as_length(k, evals)), key=ranks.__getitem__)
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


# -- runs -----------------------------------------------------------------------------------------------

def format_runs_table(rows: list[dict]) -> str:
    """One line per run (tasks.run_state.run_status), and the error under a failed, killed, interrupted or
    stopped one. SUSPECT names the monitors that flagged a run (the gate refuses its adapter)."""
    from tasks.run_state import RESUMABLE
    head, *lines = _columns(rows, RUN_COLUMNS)
    out = [head]
    for r, line in zip(rows, lines):
        out.append(line)
        if r["status"] in RESUMABLE and r.get("error"):
            out.append(f"    error: {r['error']}")
    return "\n".join(out)


def _columns(rows: list[dict], columns: tuple[str, ...]) -> list[str]:
    """A header line and one line per row, each column as wide as its widest cell."""
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    return ["  ".join(c.upper().ljust(widths[c]) for c in columns)] + \
        ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]


def format_schedules(rows: list[dict]) -> str:
    """One line per schedule on the server (flows.schedule.list_schedules)."""
    return "\n".join(_columns(rows, SCHEDULE_COLUMNS))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def format_comparison(labels: list[str], config_diff: dict, final_metrics: dict, statuses: list[str]) -> str:
    """Runs side by side: status, the config fields that differ, the final value of each metric."""
    name_width = max([28, *(len(k) for k in [*config_diff, *final_metrics])]) + 2
    width = max(14, *(len(label) + 2 for label in labels))
    head = "".ljust(name_width) + "".join(label.rjust(width) for label in labels)
    lines = [head, "status".ljust(name_width) + "".join(s.rjust(width) for s in statuses), "",
             "config differences" + ("" if config_diff else ": none")]
    lines += [k.ljust(name_width) + "".join(_cell(v)[:width - 1].rjust(width) for v in vals)
              for k, vals in config_diff.items()]
    lines += ["", "final metrics"]
    lines += [k.ljust(name_width) + "".join(_cell(v).rjust(width) for v in vals) for k, vals in final_metrics.items()]
    return "\n".join(lines)


# -- datasets -------------------------------------------------------------------------------------------

def format_source_counts(sources: dict) -> str:
    """Per source of a built dataset (its report's `sources`): loaded, valid, split sizes, rejections."""
    lines = [f"  {'source':<16}{'group':<11}{'loaded':>7}{'valid':>7}{'train':>7}{'eval':>6}  rejected"]
    for name, v in sources.items():
        rejected = ", ".join(f"{k}={n}" for k, n in v["rejected"].items())
        lines.append(f"  {name:<16}{v['group']:<11}{v['loaded']:>7}{v['valid']:>7}{v['train']:>7}{v['eval']:>6}"
                     f"  {rejected}")
    return "\n".join(lines)


def format_registered(reg: dict | None, tracking_uri: str | None = None) -> str | None:
    """The registered adapter as the line a user copies: version URI, its aliases, the call that loads it (from
    the run's store `tracking_uri`: the call's default may be another)."""
    if not reg:
        return None
    aliases = reg.get("aliases") or []
    line = reg["uri"] + (f" (aliases: {', '.join(aliases)})" if aliases else "")
    if aliases:
        store = f', tracking="{tracking_uri}"' if tracking_uri else ""
        line += f"\nLoad it with:    load_adapter(\"models:/{reg['name']}@{aliases[-1]}\"{store})"
    return line
