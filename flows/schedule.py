"""Recurring training runs: a deployment of `training_run` on a cron or interval schedule, and the
commands that manage the schedules on the server.

Two ways to run the schedule (both need a Prefect server: `prefect server start`, or `infra/`):
  serve   `grpo schedule --cron "0 3 * * *" --config X.yaml` (or `--interval 6h`) keeps a process alive that
          both holds the schedule and runs the flows (simplest; one machine).
  deploy  `grpo schedule ... --work-pool gpu-pool` registers the deployment with the server; any
          worker of that pool (`prefect worker start --pool gpu-pool`) runs the flows.
Every scheduled run gets its own run name (from its flow run), hence its own run directory and its own
MLflow run in the same experiment, and records the schedule that started it (`grpo runs` shows it);
`--init-from-previous` starts each run from the best adapter of the last finished run in that experiment.
A run still going when the next is due is not started beside it: the deployment's concurrency limit is 1.
`grpo schedule list | pause NAME | resume NAME | delete NAME` manage the schedules on the server.
"""
from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

from grpo_core.config import ConfigError, GRPOConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = "flows/train.py:training_run"
FLOW_NAME = "grpo-training-run"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_interval(text: str) -> timedelta:
    """'90s', '15m', '1h30m', '2d' -> a timedelta of at least one second."""
    parts = re.fullmatch(r"(?:\d+[smhd])+", text.strip().lower() or "-")
    seconds = sum(int(n) * _UNITS[u] for n, u in re.findall(r"(\d+)([smhd])", text.lower())) if parts else 0
    if not 1 <= seconds <= timedelta.max.total_seconds():
        raise ConfigError(f"--interval {text!r} is not a duration; write it as a number with a unit, e.g. 90s, "
                          "15m, 6h, 1d or 1h30m")
    return timedelta(seconds=seconds)


def make_schedule(cron: str | None = None, interval: str | None = None, timezone: str | None = None):
    """A Prefect schedule from exactly one of `cron` and `interval`."""
    from prefect.schedules import Cron, Interval
    if bool(cron) == bool(interval):
        raise ConfigError("give exactly one of --cron (e.g. \"0 3 * * *\") and --interval (e.g. 6h)")
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError
    try:
        ZoneInfo(timezone or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"--timezone {timezone!r} is not a time zone; use an IANA name, e.g. UTC, Europe/Berlin "
                          f"or America/New_York") from None
    if cron:
        try:
            if len(cron.split()) != 5 and not cron.strip().startswith("@"):   # a 6th field is seconds to croniter:
                raise ValueError(cron)                                     # "0 3 * * * *" fires 60 runs at 03:00
            return Cron(cron, timezone=timezone or "UTC")
        except ValueError:
            raise ConfigError(f"--cron {cron!r} is not a cron expression; write five fields, minute hour "
                              f"day-of-month month day-of-week, e.g. \"0 3 * * *\" (03:00 every day)") from None
    return Interval(parse_interval(interval), timezone=timezone or "UTC")


def describe(schedule) -> str:
    """A schedule in words: cron '0 3 * * *', every 6:00:00 (another kind: its type)."""
    if getattr(schedule, "cron", None):
        return f"cron {schedule.cron!r}"
    if getattr(schedule, "interval", None):
        return f"every {schedule.interval}"
    return type(schedule).__name__


def scheduled_config(cfg: GRPOConfig, init_from_previous: bool = False) -> dict:
    """The flow parameters of a scheduled run: no run name (each run makes its own), absolute paths
    (a worker's working directory is not ours)."""
    cfg = cfg.model_copy(deep=True)
    cfg.run_name = None
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    if init_from_previous:
        cfg.init_adapter = "previous"
    return {"config": cfg.model_dump(mode="json")}


def check_server() -> str:
    """The Prefect API URL; schedules need a real server (the temporary local one dies with the process)."""
    from tasks.remote import prefect_server_url
    return prefect_server_url("schedules")


def to_deployment(cfg: GRPOConfig, schedule, name: str = "nightly", init_from_previous: bool = False):
    """A RunnerDeployment of training_run on `schedule` (make_schedule; not yet registered anywhere)."""
    from flows.train import training_run
    return training_run.to_deployment(
        name=name, schedule=schedule, parameters=scheduled_config(cfg, init_from_previous),
        tags=["grpo", "scheduled"], description=f"GRPO training run, {describe(schedule)}",
        concurrency_limit=1)   # a run still going when the next is due: the next waits


def _as_loaded(parameters: dict) -> dict | None:
    """A deployment's parameters as this code loads them (a config stored by an older version gains the fields
    added since, at their defaults), or None where they no longer load."""
    try:
        return {"config": GRPOConfig.model_validate(parameters["config"]).model_dump(mode="json")}
    except (KeyError, TypeError, ValueError):
        return None


def _when(schedule) -> tuple[str, str]:
    """What decides when a schedule fires: its cron or interval, and its time zone."""
    return describe(schedule), str(getattr(schedule, "timezone", None) or "UTC")


def check_name_free(cfg: GRPOConfig, schedule, name: str, init_from_previous: bool = False,
                    work_pool: str | None = None) -> None:
    """A schedule `name` already on the server with another config, schedule or work pool is not replaced in
    silence (a process serving it would run the new config from then on): ConfigError naming it and the fix. The
    same command again is fine."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    with get_client(sync_client=True) as client:
        try:
            there = client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
        except ObjectNotFound:
            return
    theirs = (_as_loaded(there.parameters), [_when(s.schedule) for s in there.schedules], there.work_pool_name or None)
    ours = (scheduled_config(cfg, init_from_previous), [_when(schedule)], work_pool or None)
    if theirs != ours:
        what = [w for w, a, b in zip(("config", "schedule", "work pool"), theirs, ours) if a != b]
        raise ConfigError(f"a schedule named {name!r} is already on the server with another {' and '.join(what)} "
                          f"({', '.join(' '.join(w) for w in theirs[1]) or '-'}, {theirs[2] or '(served)'}); give this "
                          f"one another --name, "
                          f"or replace it: grpo schedule delete {name}, then this command again")


def serve(cfg: GRPOConfig, schedule, name: str = "nightly", init_from_previous: bool = False) -> None:
    """Hold the schedule and run the flows in this process (blocks until interrupted)."""
    check_server()
    from prefect import serve as prefect_serve
    prefect_serve(to_deployment(cfg, schedule, name, init_from_previous))


def deploy(cfg: GRPOConfig, work_pool: str, schedule=None, name: str = "nightly",
           init_from_previous: bool = False, source: str | Path = REPO_ROOT, image: str | None = None) -> str:
    """Register a deployment whose runs go to `work_pool` (process: the worker runs the code from
    `source`, a path the worker can read; docker/kubernetes: pass the worker image). Returns its id."""
    check_server()
    from prefect import flow as prefect_flow
    kwargs = dict(name=name, work_pool_name=work_pool, parameters=scheduled_config(cfg, init_from_previous),
                  tags=["grpo"] + (["scheduled"] if schedule else []), build=False, push=False,
                  concurrency_limit=1, print_next_steps=False)
    if schedule:
        kwargs["schedule"] = schedule
    if image:
        kwargs["image"] = image
    remote = prefect_flow.from_source(source=str(source), entrypoint=ENTRYPOINT)
    return str(remote.deploy(**kwargs))


# -- managing the schedules on the server -------------------------------------------------------------------

def list_schedules() -> list[dict]:
    """Every deployment of training_run on the server: name, schedule, paused, work pool, its runs by state."""
    check_server()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowFilter, FlowFilterName,
                                                FlowRunFilter, FlowRunFilterStartTime, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.sorting import FlowRunSort
    with get_client(sync_client=True) as client:
        deployments = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])))
        rows = []
        for d in sorted(deployments, key=lambda d: d.name):
            of_it = DeploymentFilter(id=DeploymentFilterId(any_=[d.id]))

            def count(*types: str) -> int:
                return client.count_flow_runs(deployment_filter=of_it, flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(types)))))
            started = FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False))
            last = client.read_flow_runs(deployment_filter=of_it, flow_run_filter=started,
                                         sort=FlowRunSort.START_TIME_DESC, limit=1)
            rows.append({"name": d.name, "id": str(d.id),
                         "schedule": ", ".join(describe(s.schedule) for s in d.schedules) or "-",
                         "paused": bool(d.paused), "work_pool": d.work_pool_name or "(served)",
                         "completed": count("COMPLETED"), "running": count("RUNNING", "PENDING"),
                         "failed": count("FAILED", "CRASHED"), "last_run": last[0].name if last else "-"})
    return rows


def _deployment(client, name: str):
    from prefect.exceptions import ObjectNotFound
    try:
        return client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
    except ObjectNotFound:
        known = [d["name"] for d in list_schedules()]
        raise ConfigError(f"no schedule named {name!r} on the server; `grpo schedule list` shows them"
                          + (f" ({', '.join(known)})" if known else " (there are none)")) from None


def set_paused(name: str, paused: bool) -> None:
    """Pause (no new runs are scheduled; a running one finishes) or resume the schedule `name`."""
    check_server()
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        dep = _deployment(client, name)
        (client.pause_deployment if paused else client.resume_deployment)(dep.id)


def delete(name: str) -> None:
    """Remove the schedule `name` from the server (its finished runs and their run directories stay)."""
    check_server()
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        client.delete_deployment(_deployment(client, name).id)
