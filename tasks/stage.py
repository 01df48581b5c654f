"""`@stage`: the resume rule every pipeline stage follows, written once.

A stage is a Prefect task `(config, run_dir, iteration, ...inputs) -> record`. The decorator hashes the
inputs its `key` names (tasks/layout.py: input_key); if iter-<k>/<stage>.json already holds a record
with that key the stage is done and the record is returned without running the body; otherwise the
body does the work and returns a small record (paths and metrics), which is written last, atomically.
So a run killed at any point resumes at the first stage without a record, in any process. (Prefect's
own cache_key_fn would need result persistence in a configured store; here the record is both the cache
entry and the resume point.) Retries and tags are added by the flow (`with_options`).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from prefect import task

from tasks.layout import cfg_of, completed_record, finish_stage, input_key


def stage(name: str, key: Callable[..., dict]):
    """Make `work(config, run_dir, iteration, ...)` the Prefect task `name`, skipped when complete.

    `key(cfg=..., **arguments)` gets the validated config and the call's arguments by name and returns
    the inputs that decide whether an existing record still holds (e.g. config, upstream paths)."""
    def decorate(work: Callable[..., dict]):
        signature = inspect.signature(work)

        @functools.wraps(work)
        def run(*args, **kwargs) -> dict:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            run_dir, iteration = arguments["run_dir"], arguments["iteration"]
            inputs_key = input_key(**key(cfg=cfg_of(arguments["config"]), **arguments))
            if (done := completed_record(run_dir, iteration, name, inputs_key)):
                return done
            return finish_stage(run_dir, iteration, name, inputs_key, work(*args, **kwargs))

        return task(name=name)(run)
    return decorate
