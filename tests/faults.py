"""Test-only fault injection: break a run on purpose, through the real engine, with the stage code
unmodified. Production code knows nothing of it.

`install()` patches the two seams of the stage decorator (tasks/stage.py):
  "<stage>"        its `completed_record` found no record: the stage is about to do real work;
  "<stage>:saved"  its body returned (outputs and metrics written), `finish_stage` has not yet written
                   the record; e.g. "update:saved".
Once installed, each point consults the JSON list of rules in the file named by $GRPO_FAULT_FILE. A rule:
{"point": "rollout", "iteration": 1, "times": 1, "action": "raise" | "hang",
 "error": "OSError" | "ValueError" | ..., "marker": "/path/touched/on/hit"}.
`times` is decremented in the file, so "fail once" survives Prefect retries and process restarts. For a
run in a child process, start it through tests/fault_runner.py, which installs the patches there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from grpo_core.io import atomic_write_text, read_json, write_json
from tasks import layout, stage as stage_module
from tasks.retry import TransientError

FAULT_ENV = "GRPO_FAULT_FILE"
ERRORS = {"OSError": OSError, "ConnectionError": ConnectionError, "TimeoutError": TimeoutError,
          "ValueError": ValueError, "RuntimeError": RuntimeError, "TransientError": TransientError}


def fault_point(point: str, iteration: int | None = None) -> None:
    """Fire the first armed rule for (point, iteration), if any: raise its error, or hang until killed."""
    path = os.environ.get(FAULT_ENV)
    if not path or not Path(path).exists():
        return
    rules = read_json(path)
    for rule in rules:
        if rule.get("point") != point or rule.get("iteration", iteration) != iteration:
            continue
        if rule.get("times", 1) <= 0:
            continue
        rule["times"] = rule.get("times", 1) - 1
        write_json(path, rules)
        if rule.get("marker"):
            atomic_write_text(rule["marker"], f"{point} {iteration} {os.getpid()}\n")
        if rule.get("action", "raise") == "hang":
            while True:            # wait to be killed (the test sends SIGKILL)
                time.sleep(0.5)
        raise ERRORS[rule.get("error", "OSError")](f"injected fault at {point} (iteration {iteration})")


def _completed_record(run_dir, k: int, stage: str, key: str) -> dict | None:
    done = layout.completed_record(run_dir, k, stage, key)
    if done is None:
        fault_point(stage, k)
    return done


def _finish_stage(run_dir, k: int, stage: str, key: str, record: dict) -> dict:
    fault_point(f"{stage}:saved", k)
    return layout.finish_stage(run_dir, k, stage, key, record)


def install(monkeypatch=None) -> None:
    """Route every stage through the fault points (undone with the test when given `monkeypatch`)."""
    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    setattr_(stage_module, "completed_record", _completed_record)
    setattr_(stage_module, "finish_stage", _finish_stage)
