"""Run-level state in <run_dir>/run.json (MLflow run id, status, attempts, the process running it) and
the status `grpo runs` / `grpo resume` show, derived from run.json and the stage records present.
Stage records themselves are tasks/layout.py's."""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Any

from grpo_core import stages
from grpo_core.errors import ConfigError
from grpo_core.io import InputError, pid_alive, read_json_object, write_json

LOCK_FILE = ".run.lock"
_claimed: dict[str, Any] = {}          # run dir -> the open lock file of the run this process is running


def mlflow_run_id(run_dir: str | Path) -> str | None:
    """The MLflow run of this training run (recorded in run.json when the flow starts), if any."""
    return _run_fact(run_dir, "mlflow_run_id")


def init_adapter_path(run_dir: str | Path) -> str | None:
    """The adapter the run started from (config `init_adapter`, resolved once into the run dir), if any."""
    return _run_fact(run_dir, "init_adapter_path")


def _run_fact(run_dir: str | Path, name: str):
    return read_run_state(run_dir).get(name)


def read_run_state(run_dir: str | Path) -> dict:
    """run.json as a dict ({} before the run starts); InputError, naming the file and the fix, where it is not a
    JSON object (cut short or edited by hand: it is written atomically)."""
    p = run_state_path(run_dir)
    if not p.exists():
        return {}
    try:
        return read_json_object(p)
    except InputError as e:
        raise InputError(f"{e}. Fix: restore it from a backup, or move it aside to resume under a new MLflow run "
                         f"(the stage records under iter-<k>/ are kept)") from None


def run_state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "run.json"


def update_run_state(run_dir: str | Path, **fields: Any) -> dict:
    """Merge fields into run.json (atomic)."""
    state = read_run_state(run_dir)
    state.update(fields)
    write_json(run_state_path(run_dir), state)
    return state


def claim_run(run_dir: str | Path) -> None:
    """Hold an exclusive lock on <run_dir>/.run.lock while this process runs the run: a second `grpo train` of the
    same run name, or a `grpo resume` while the first is alive, is refused (ConfigError) instead of running the same
    stages beside it. The kernel drops the lock with its process (SIGKILL, OOM, power cut): no stale lock."""
    run_dir = Path(run_dir)
    lock = open(run_dir / LOCK_FILE, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        state = read_run_state(run_dir)
        who = f" (pid {state['pid']} on {state.get('host')})" if state.get("pid") else ""
        raise ConfigError(f"run {run_dir.name!r} is already running{who}: wait for it to end, or stop it and then "
                          f"`grpo resume {run_dir.name}`") from None
    _claimed[str(run_dir.resolve())] = lock


def release_run(run_dir: str | Path) -> None:
    """Let go of the lock claim_run took (the run ended in this process, however)."""
    lock = _claimed.pop(str(Path(run_dir).resolve()), None)
    if lock is not None:
        lock.close()


def check_not_running(run_dir: str | Path) -> None:
    """ConfigError when another process runs this run now (claim_run, then let go at once): said before anything
    starts."""
    if (Path(run_dir) / LOCK_FILE).is_file():          # no such file: no process has ever run it here
        claim_run(run_dir)
        release_run(run_dir)


def mark_running(run_dir: str | Path, flow_run_id: str | None) -> dict:
    state = read_run_state(run_dir)
    attempts = state.get("attempts", 0) + 1
    return update_run_state(run_dir, status="running", pid=os.getpid(), host=socket.gethostname(),
                            attempts=attempts, flow_run_id=flow_run_id,
                            flow_run_ids=[*state.get("flow_run_ids", []), flow_run_id] if flow_run_id else
                            state.get("flow_run_ids", []),
                            updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def _alive(pid: int | None, host: str | None) -> bool | None:
    if not pid or host != socket.gethostname():
        return None             # unknown (another machine)
    return pid_alive(pid)


def last_completed_stage(run_dir: str | Path) -> tuple[int, str] | None:
    """(iteration, stage) of the latest stage record, in pipeline order; iteration 0 = the base eval."""
    best = None
    for d in Path(run_dir).glob("iter-*"):
        try:
            k = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        for i, st in enumerate(stages.names()):
            if (d / f"{st}.json").exists() and (best is None or (k, i) > best[:2]):
                best = (k, i, st)
    return None if best is None else (best[0], best[2])


# Statuses of a run that `grpo resume` continues (and `grpo runs` shows the error of).
RESUMABLE = ("failed", "killed", "interrupted", "stopped")


def flag_suspect(run_dir: str | Path, iteration: int, alerts: list) -> list[dict]:
    """Mark the run suspect for each tripped monitor (grpo_core.evaluation.monitors.Alert) of `iteration`, once each; the
    marks stay for good (a resume with other thresholds does not clear them). -> all the run's marks."""
    marks = read_run_state(run_dir).get("suspect", [])
    for a in alerts:
        if not any(m["monitor"] == a.name and m["iteration"] == iteration for m in marks):
            marks.append({"monitor": a.name, "iteration": iteration, "message": a.message})
    update_run_state(run_dir, suspect=marks)
    return marks


def suspect_reasons(run_dir: str | Path) -> list[str]:
    """One line per monitor that marked the run suspect ([] for a clean run)."""
    return [f"{m['monitor']} at iteration {m['iteration']}: {m['message']}"
            for m in read_run_state(run_dir).get("suspect", [])]


def mark_stopped(run_dir: str | Path, reasons: list[str]) -> None:
    """A monitor with on_trip: stop ended the run after an iteration: `grpo resume` can continue it."""
    update_run_state(run_dir, status="stopped", error="stopped by a monitor: " + "; ".join(reasons)[:480],
                     updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def stop_signal(e: BaseException) -> str | None:
    """"SIGTERM" or "Ctrl-C" when `e` is a request to stop cleanly, else None. Prefect turns SIGTERM inside
    a flow into TerminationSignal; the CLI turns it into KeyboardInterrupt("SIGTERM") elsewhere."""
    import sys
    prefect_exceptions = sys.modules.get("prefect.exceptions")     # never imported just to check
    if prefect_exceptions is not None and isinstance(e, prefect_exceptions.TerminationSignal):
        return "SIGTERM"
    if isinstance(e, KeyboardInterrupt):
        return "SIGTERM" if e.args == ("SIGTERM",) else "Ctrl-C"
    return None


def mark_ended_by(run_dir: str | Path, e: BaseException) -> str:
    """Record in run.json how an exception ended the run: "interrupted" (a stop request; resume it) or
    "failed". -> the matching MLflow run status (KILLED or FAILED)."""
    how = stop_signal(e)
    error = f"stopped by {how}" if how else f"{type(e).__name__}: {e}"[:500]
    update_run_state(run_dir, status="interrupted" if how else "failed", error=error,
                     updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return "KILLED" if how else "FAILED"


def iterations_done(run_dir: str | Path) -> int:
    """Iterations whose update completed (the evaluate after it may be pending)."""
    done = [int(p.parent.name.split("-", 1)[1]) for p in Path(run_dir).glob("iter-*/update.json")]
    return max(done, default=0)


def planned_iterations(run_dir: str | Path):
    """pipeline_iterations of the run's config.yaml; None where it has none or cannot be read (a listing goes on:
    a resume names the problem)."""
    import yaml
    from grpo_core.io import load_yaml
    try:
        config = load_yaml((Path(run_dir) / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return config.get("pipeline_iterations") if isinstance(config, dict) else None


def run_status(run_dir: str | Path) -> dict:
    """What `grpo runs` shows for one run directory."""
    run_dir = Path(run_dir)
    try:
        state = read_run_state(run_dir)
    except InputError as e:                 # one unreadable run.json does not hide the other runs
        state = {"status": "unreadable", "error": str(e)}
    status = state.get("status", "created")
    if status == "running" and _alive(state.get("pid"), state.get("host")) is False:
        status = "killed"        # the process died without saying so (SIGKILL, OOM, power)
    last = last_completed_stage(run_dir)
    total = planned_iterations(run_dir)
    return {"run": run_dir.name, "status": status,
            "last_completed": f"iter-{last[0]}/{last[1]}" if last else "-",
            "iterations": f"{iterations_done(run_dir)}/{total if total is not None else '?'}",
            "schedule": state.get("schedule") or "-",
            "mlflow_run_id": state.get("mlflow_run_id", "-"), "updated": state.get("updated", "-"),
            "suspect": ",".join(dict.fromkeys(m["monitor"] for m in state.get("suspect", []))) or "-",
            "error": state.get("error")}
