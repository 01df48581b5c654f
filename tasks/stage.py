"""`@stage`: the resume rule every pipeline stage follows, written once.

A stage is a Prefect task `(config, run_dir, iteration, ...inputs) -> record`. The decorator hashes the
inputs its `key` names (tasks/layout.py: input_key); if iter-<k>/<stage>.json already holds a record
with that key the stage is done and the record is returned without running the body; otherwise the
body does the work and returns a small record (paths and metrics), which is written last, atomically.
So a run killed at any point resumes at the first stage without a record, in any process. (Prefect's
own cache_key_fn would need result persistence in a configured store; here the record is both the cache
entry and the resume point.) Retries and tags come from the config (`with_policy`), the same wherever the
stage runs: in the training run's process or on a work pool (tasks/remote.py).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import time
from typing import Callable

from prefect import task

from grpo_core import stages
from grpo_core.config import GRPOConfig
from grpo_core.kernels import settings as kernel_settings
from tasks.layout import cfg_of, completed_record, finish_stage, input_key
from tasks.retry import retry_transient_only

LIMIT_CHECK_SECONDS = 30.0            # how long the answer to "is there a limit for the tag?" is kept
_limit_checks: dict[tuple[str, str], tuple[float, bool]] = {}


def stage(name: str, key: Callable[..., dict]):
    """Make `work(config, run_dir, iteration, ...)` the Prefect task `name`, skipped when complete.

    `key(cfg=..., **arguments)` gets the validated config and the call's arguments by name and returns
    the inputs that decide whether an existing record still holds (e.g. config, upstream paths)."""
    def decorate(work: Callable[..., dict]):
        signature = inspect.signature(work)

        def arguments_of(*args, **kwargs) -> dict:
            """The call's arguments by name (defaults filled in)."""
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return dict(bound.arguments)

        def key_of(arguments: dict, cfg: GRPOConfig | None = None) -> str:
            return input_key(**key(cfg=cfg or cfg_of(arguments["config"]), **arguments))

        def completed(arguments: dict) -> dict | None:
            """The record of this call if the stage already completed with these inputs, else None."""
            return completed_record(arguments["run_dir"], arguments["iteration"], name, key_of(arguments))

        @functools.wraps(work)
        def run(*args, **kwargs) -> dict:
            arguments = arguments_of(*args, **kwargs)
            cfg = cfg_of(arguments["config"])
            run_dir, iteration, inputs_key = arguments["run_dir"], arguments["iteration"], key_of(arguments, cfg)
            if (done := completed_record(run_dir, iteration, name, inputs_key)):
                return done
            kernel_settings.apply(cfg.kernels)          # the run's kernel choices, in whatever process the stage runs
            return finish_stage(run_dir, iteration, name, inputs_key, work(*args, **kwargs))

        run.arguments_of, run.completed = arguments_of, completed    # for tasks/remote.py: skip, then read back
        return task(name=name)(run)
    return decorate


def registered_task(name: str):
    """The Prefect task of the registered stage `name` (grpo_core/stages.py names it as "module:attribute")."""
    module, _, attribute = stages.named(name).task.partition(":")
    return getattr(importlib.import_module(module), attribute)


def tag_is_limited(tag: str) -> bool:
    """Whether the Prefect server has a concurrency limit for `tag` (`prefect concurrency-limit create TAG N`),
    asked at most every LIMIT_CHECK_SECONDS per server. A tagged task run asks the server for a slot of each of
    its tags, limit or not (two round trips per stage; docs/speed.md), so a stage carries
    the tag only where it limits something."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL
    key = (str(PREFECT_API_URL.value()), tag)
    checked_at, limited = _limit_checks.get(key, (float("-inf"), False))
    if time.monotonic() - checked_at < LIMIT_CHECK_SECONDS:
        return limited
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(f"tag:{tag}")
            limited = True
        except ObjectNotFound:
            limited = False
    _limit_checks[key] = (time.monotonic(), limited)
    return limited


def with_policy(stage_task, cfg: GRPOConfig, name: str):
    """The stage task with its configured retries: exponential backoff, transient errors only, and the
    GPU concurrency tag on the stages that use the accelerator when the server limits that tag."""
    policy = cfg.stages.of(name)
    opts = dict(retries=policy.retries, retry_delay_seconds=policy.delays() or 0,
                retry_jitter_factor=policy.retry_jitter_factor, retry_condition_fn=retry_transient_only)
    tag = cfg.stages.gpu_concurrency_tag
    if stages.named(name).accelerator and tag and tag_is_limited(tag):
        opts["tags"] = {tag}
    return stage_task.with_options(**opts)
