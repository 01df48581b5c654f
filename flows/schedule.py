"""Recurring training runs: a cron-scheduled deployment of `training_run`.

Two ways to run the schedule (both need a Prefect server: `prefect server start`, or `infra/`):
  serve   `grpo schedule --cron "0 3 * * *" --config X.yaml` keeps a process alive that both holds the
          schedule and runs the flows (simplest; one machine).
  deploy  `grpo schedule ... --work-pool gpu-pool` registers the deployment with the server; any
          worker of that pool (`prefect worker start --pool gpu-pool`) runs the flows.
Every scheduled run gets its own run name (from its flow run), hence its own run directory and its own
MLflow run in the same experiment; `--init-from-previous` starts each run from the best adapter of
the last finished run in that experiment.
"""
from __future__ import annotations

from pathlib import Path

from grpo_core.config import GRPOConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = "flows/train.py:training_run"


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


def to_deployment(cfg: GRPOConfig, cron: str, name: str = "nightly", init_from_previous: bool = False,
                  timezone: str | None = None):
    """A RunnerDeployment of training_run on a cron schedule (not yet registered anywhere)."""
    from prefect.schedules import Cron
    from flows.train import training_run
    return training_run.to_deployment(
        name=name, schedule=Cron(cron, timezone=timezone or "UTC"),
        parameters=scheduled_config(cfg, init_from_previous),
        tags=["grpo", "scheduled"], description=f"GRPO training run on cron {cron!r}",
        concurrency_limit=1)   # a run still going when the next is due: the next waits


def serve(cfg: GRPOConfig, cron: str, name: str = "nightly", init_from_previous: bool = False,
          timezone: str | None = None) -> None:
    """Hold the schedule and run the flows in this process (blocks until interrupted)."""
    check_server()
    from prefect import serve as prefect_serve
    prefect_serve(to_deployment(cfg, cron, name, init_from_previous, timezone))


def deploy(cfg: GRPOConfig, work_pool: str, cron: str | None = None, name: str = "nightly",
           init_from_previous: bool = False, timezone: str | None = None, source: str | Path = REPO_ROOT,
           image: str | None = None) -> str:
    """Register a deployment whose runs go to `work_pool` (process: the worker runs the code from
    `source`, a path the worker can read; docker/kubernetes: pass the worker image). Returns its id."""
    check_server()
    from prefect import flow as prefect_flow
    from prefect.schedules import Cron
    kwargs = dict(name=name, work_pool_name=work_pool, parameters=scheduled_config(cfg, init_from_previous),
                  tags=["grpo"] + (["scheduled"] if cron else []), build=False, push=False,
                  concurrency_limit=1, print_next_steps=False)
    if cron:
        kwargs["schedule"] = Cron(cron, timezone=timezone or "UTC")
    if image:
        kwargs["image"] = image
    remote = prefect_flow.from_source(source=str(source), entrypoint=ENTRYPOINT)
    return str(remote.deploy(**kwargs))
