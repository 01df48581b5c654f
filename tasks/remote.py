"""Stages on their own workers: a stage with `stages.<name>.work_pool` runs as a flow run on that pool.

Without a work pool a stage is the plain Prefect task, called in the training run's process (nothing here
runs). With one, the flow starts a flow run of the deployment `grpo-stage/<pool>` (`stage_flow` below,
deployed from this repository's directory on first use, like flows/schedule.py's deployments) and waits
for it; a worker of that pool runs the very same stage task with the same retries and tags, so the GPU
concurrency tag (`prefect concurrency-limit create gpu 1`) is enforced by the server across every run and
worker. Only the stage's arguments travel (the config, paths, small records); the stage writes its outputs
and its record under the run directory, so the workers must share that filesystem, and the caller reads
the record back from there. A stage already complete is skipped before anything is sent.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from prefect import flow

from grpo_core import stages
from grpo_core.config import ConfigError, GRPOConfig
from tasks import tracking
from tasks.layout import cfg_of
from tasks.stage import registered_task, with_policy

REPO_ROOT = Path(__file__).resolve().parent.parent
STAGE_FLOW = "grpo-stage"
STAGE_ENTRYPOINT = "tasks/remote.py:stage_flow"
POLL_SECONDS = 1.0              # how often the caller asks the server whether the stage's flow run ended

_deployed: set[str] = set()     # pools whose stage deployment this process has registered


class StageRunFailed(RuntimeError):
    """A stage's flow run on a work pool ended without completing (its own retries already spent)."""


def prefect_server_url(needed_by: str) -> str:
    """The Prefect API URL; `needed_by` (e.g. "schedules") needs a real server, the temporary local one dies
    with its process. Raises ConfigError with the fix."""
    from prefect.settings import PREFECT_API_URL
    url = PREFECT_API_URL.value()
    if not url:
        raise ConfigError(f"{needed_by} need a Prefect server: run `prefect server start` (or `docker compose -f "
                          "infra/docker-compose.yml up -d`) and set PREFECT_API_URL=http://127.0.0.1:4200/api")
    return url


def stage_pools(cfg: GRPOConfig) -> dict[str, str]:
    """{stage: work pool} for the stages sent to a work pool."""
    return {name: pool for name in stages.names() if (pool := cfg.stages.of(name).work_pool)}


def check_work_pools(cfg: GRPOConfig) -> None:
    """Before a run whose stages go to work pools: a Prefect server is configured and answers, and every
    pool exists on it. Raises ConfigError naming the field and the fix. No pools: does nothing."""
    pools = stage_pools(cfg)
    if not pools:
        return
    fields = ", ".join(f"stages.{name}.work_pool={pool}" for name, pool in pools.items())
    url = prefect_server_url(f"stages on work pools ({fields})")
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        missing = [pool for pool in sorted(set(pools.values())) if not _work_pool_exists(client, pool, url)]
    if missing:
        fields = ", ".join(f"stages.{name}.work_pool" for name, pool in pools.items() if pool in missing)
        create = "; ".join(f"`prefect work-pool create {pool} --type process`" for pool in missing)
        raise ConfigError(f"{fields}: no work pool {', '.join(map(repr, missing))} on the Prefect server {url}. Fix: "
                          f"{create}, and start a worker for each where the run directory is shared (`prefect worker "
                          f"start --pool {missing[0]}`); or unset the field to run the stage in this process")


def _work_pool_exists(client, pool: str, url: str) -> bool:
    from prefect.exceptions import ObjectNotFound
    try:
        client.read_work_pool(pool)
        return True
    except ObjectNotFound:
        return False
    except Exception as e:  # noqa: BLE001 - httpx/OS errors: the server is down or unreachable
        raise ConfigError(f"PREFECT_API_URL: the Prefect server {url} does not answer ({type(e).__name__}: {e}). "
                          f"Fix: start it (`prefect server start`) or point PREFECT_API_URL at a running one") from e


def stage_runner(stage_task, cfg: GRPOConfig, name: str) -> Callable[..., dict]:
    """The stage as the flow calls it: the Prefect task with its retry policy, in this process; or, with
    `stages.<name>.work_pool` set, a call that runs it on that pool and returns its record."""
    pool = cfg.stages.of(name).work_pool
    if not pool:
        return with_policy(stage_task, cfg, name)

    def on_pool(*args, **kwargs) -> dict:
        return run_on_pool(stage_task, cfg, name, pool, stage_task.fn.arguments_of(*args, **kwargs))
    return on_pool


def registered_runner(name: str, cfg: GRPOConfig) -> Callable[..., dict]:
    """stage_runner for the registered stage `name` (grpo_core/stages.py)."""
    return stage_runner(registered_task(name), cfg, name)


def run_on_pool(stage_task, cfg: GRPOConfig, name: str, pool: str, arguments: dict) -> dict:
    """Run one stage call on `pool` and wait for it: skipped when its record is already there; otherwise a
    flow run of grpo-stage/<pool> (a child of the calling flow run), then its record read back."""
    if (done := stage_task.fn.completed(arguments)):
        return done
    from prefect.deployments import run_deployment
    # The worker logs where this process logs (its environment may differ), and resolves relative paths here.
    config = {**arguments["config"], "tracking": {**arguments["config"]["tracking"],
                                                  "tracking_uri": tracking.tracking_uri(cfg)}}
    label = f"{Path(arguments['run_dir']).name}/iter-{arguments['iteration']}/{name}"
    flow_run = run_deployment(
        _deployment_for(pool), parameters={"stage": name, "arguments": {**arguments, "config": config},
                                           "working_dir": os.getcwd()},
        flow_run_name=label, tags=["grpo", f"stage:{name}"], poll_interval=POLL_SECONDS, timeout=None)
    state = flow_run.state
    if state is None or not state.is_completed():
        raise StageRunFailed(
            f"stage {name} ({label}) ended {state.type.value if state else 'without a state'} on work pool {pool!r} "
            f"(flow run {flow_run.id}): {state.message if state else ''}; its log: `prefect flow-run logs "
            f"{flow_run.id}`; resume the run once fixed (completed stages are skipped)")
    record = stage_task.fn.completed(arguments)
    if record is None:
        raise StageRunFailed(f"stage {name} ({label}) completed on work pool {pool!r} (flow run {flow_run.id}) but its "
                             f"record is not under {arguments['run_dir']} here: the worker must write to the same run "
                             f"directory (shared storage, the same path; set output_dir to an absolute path)")
    return record


def _deployment_for(pool: str) -> str:
    """`grpo-stage/<pool>`, registered (or updated) once per process; says so when no worker is online."""
    deployment = f"{STAGE_FLOW}/{pool}"
    if pool in _deployed:
        return deployment
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:
        status = client.read_work_pool(pool).status
    if status is None or status.value != "READY":
        tracking.console(f"work pool {pool!r} has no worker online ({status.value if status else 'unknown'}): its "
                         f"stages wait until one starts (`prefect worker start --pool {pool}`)")
    remote = flow.from_source(source=str(REPO_ROOT), entrypoint=STAGE_ENTRYPOINT)
    remote.to_deployment(name=pool, tags=["grpo", "stage"],            # what `.deploy` does, without its console
                         description="one GRPO pipeline stage (tasks/remote.py: stage_flow)").apply(work_pool_name=pool)
    _deployed.add(pool)
    return deployment


@flow(name=STAGE_FLOW)
def stage_flow(stage: str, arguments: dict, working_dir: str | None = None) -> dict:
    """Run one registered stage (grpo_core/stages.py) with its config's retry policy and
    tags. `working_dir` is the caller's: relative paths in the config mean the same here when it exists."""
    cfg = cfg_of(arguments["config"])
    if working_dir and Path(working_dir).is_dir():
        os.chdir(working_dir)           # a worker process runs one flow run: changing its directory is safe
    elif not Path(cfg.output_dir).is_absolute():
        raise ConfigError(f"output_dir {cfg.output_dir!r} is relative and the run's working directory {working_dir!r} "
                          f"does not exist on this worker: set output_dir to an absolute path on storage the workers "
                          f"share")
    return with_policy(registered_task(stage), cfg, stage)(**arguments)
