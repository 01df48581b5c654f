"""The monitors in a run (grpo_core/evaluation/monitors.py decides): after every iteration, on the run's own records (the
score and update stages' figures, the evaluations so far), log each monitor's verdict to MLflow (monitor/...,
step = iteration), warn, and act as `monitors.on_trip` says: flag the run suspect (run.json, the MLflow tag
`suspect`; the gate then refuses its adapter), or flag it and stop. It runs outside the stages, so a resume with
other thresholds or another on_trip judges again without recomputing anything; marks already made stay."""
from __future__ import annotations

import sys
from pathlib import Path

from grpo_core.config import GRPOConfig
from grpo_core.io import read_json
from grpo_core.evaluation.monitors import Alert, check_monitors, check_training_monitors
from tasks import tracking
from tasks.layout import record_path
from tasks.run_state import flag_suspect, suspect_reasons


def report_alerts(alerts: list[Alert], where: str) -> None:
    """Print a warning per tripped monitor (and to the Prefect log when inside a flow)."""
    log = None
    try:
        from prefect import get_run_logger
        log = get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow/task run there is no run logger
        pass
    for a in alerts:
        msg = f"monitor '{a.name}' tripped ({where}): {a.message}"
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)
        if log is not None:
            log.warning(msg)


def _stage_metrics(run_dir: Path, k: int, stage: str) -> dict:
    path = record_path(run_dir, k, stage)
    return read_json(path).get("metrics", {}) if path.is_file() else {}


def training_history(run_dir: str | Path, upto: int) -> list[dict]:
    """Per iteration 1..upto, the figures the training monitors read (None where a record lacks one)."""
    history = []
    for k in range(1, upto + 1):
        score, update = _stage_metrics(Path(run_dir), k, "score"), _stage_metrics(Path(run_dir), k, "update")
        history.append({"reward": score.get("reward/mean"), "stalled_frac": score.get("reward/stalled_group_frac"),
                        "zero_std_frac": update.get("train/frac_reward_zero_std"),
                        "lora_change": update.get("train/lora_change")})
    return history


def reward_rise(history: list[dict], previous: int, current: int) -> float | None:
    """How much the mean training reward of iterations previous+1..current rose over the same number of
    iterations before (over iteration 1's when there are none before); None without rewards."""
    def mean_of(ks) -> float | None:
        values = [history[k - 1]["reward"] for k in ks if 1 <= k <= len(history)]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None
    span = current - previous
    now = mean_of(range(previous + 1, current + 1) if previous > 0 else range(2, current + 1))
    before = mean_of(range(max(1, previous - span + 1), previous + 1) if previous > 0 else [1])
    return None if now is None or before is None else now - before


def check_iteration(cfg: GRPOConfig, run_dir: str | Path, iteration: int,
                    evals: dict[int, dict]) -> tuple[dict[str, float], list[Alert]]:
    """Every monitor after `iteration` (its evaluation's too when it had one; `evals`: {iteration: metrics}, 0 = the
    base model). -> (monitor/... metrics, alerts)."""
    history = training_history(run_dir, iteration)
    metrics, alerts = check_training_monitors(history, cfg.monitors)
    if iteration in evals and iteration > 0:
        previous = max((k for k in evals if k < iteration), default=None)
        rise = reward_rise(history, previous, iteration) if previous is not None else None
        more, more_alerts = check_monitors(evals[iteration], evals.get(previous), evals.get(0), cfg.monitors, rise)
        metrics, alerts = {**metrics, **more}, alerts + more_alerts
    metrics["monitor/tripped_count"] = float(len({a.name for a in alerts}))
    return metrics, alerts


def watch(cfg: GRPOConfig, run_dir: str | Path, run_id: str | None, iteration: int, evals: dict[int, dict]) -> bool:
    """Check, log and act on the monitors after `iteration`; True when the run should stop now."""
    metrics, alerts = check_iteration(cfg, run_dir, iteration, evals)
    if run_id:
        tracking.log_metrics(cfg, run_id, metrics, step=iteration)
    if not alerts:
        return False
    report_alerts(alerts, f"iteration {iteration}")
    tags = {f"monitor.{a.name}": f"iteration {iteration}: {a.message}"[:4000] for a in alerts}
    if cfg.monitors.on_trip != "warn":
        flag_suspect(run_dir, iteration, alerts)
        tags.update(suspect="true", suspect_reasons="; ".join(suspect_reasons(run_dir))[:4000])
    if run_id:
        tracking.set_tags(cfg, run_id, tags)
    return cfg.monitors.on_trip == "stop"
