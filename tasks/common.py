"""What every stage shares: the run directory layout, stage records, and the config round trip.

Layout:  <output_dir>/<run_name>/
           config.yaml          the validated config of the run
           run.json             MLflow run id and other run-level facts
           data/eval.jsonl      the held-out split (fixed for the run)
           iter-<k>/<stage>.json  the record a stage returns, written last (atomically): its presence
                                means the stage completed with the inputs named in its "key"
           iter-<k>/...         the stage's outputs

Also here: which errors a stage retries (`is_transient`, `retry_transient_only`), the test-only fault
injection switch (`fault_point`), and the run status that `grpo runs` shows.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from grpo_core.config import GRPOConfig
from grpo_core.io import atomic_write_text, read_json, write_json

STAGES = ("curate", "rollout", "score", "update", "evaluate")


def cfg_of(config: dict) -> GRPOConfig:
    return GRPOConfig.model_validate(config)


def iter_dir(run_dir: str | Path, k: int) -> Path:
    d = Path(run_dir) / f"iter-{k}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def record_path(run_dir: str | Path, k: int, stage: str) -> Path:
    return Path(run_dir) / f"iter-{k}" / f"{stage}.json"


# Config parts that change how a run is operated, never what it computes: a resume may change them
# (e.g. more retries) without invalidating completed stages.
OPERATIONAL_FIELDS = ("stages", "tracking", "output_dir", "run_name", "init_adapter")


def semantic_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in OPERATIONAL_FIELDS}


def input_key(**inputs: Any) -> str:
    """Hash of a stage's inputs (JSON-able values, e.g. config dict and upstream paths).

    A `config` input is hashed without its operational fields (retries, tracking, paths): the upstream
    paths and checkpoints already pin where the inputs live."""
    if isinstance(inputs.get("config"), dict):
        inputs = {**inputs, "config": semantic_config(inputs["config"])}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def completed_record(run_dir: str | Path, k: int, stage: str, key: str) -> dict | None:
    """The stage's record if it already completed with the same inputs (resume), else None."""
    p = record_path(run_dir, k, stage)
    if p.exists():
        rec = read_json(p)
        if rec.get("key") == key:
            return rec
    fault_point(stage, k)   # the stage is about to do real work (no-op unless a test armed a fault)
    return None


def finish_stage(run_dir: str | Path, k: int, stage: str, key: str, record: dict) -> dict:
    record = {**record, "key": key, "stage": stage, "iteration": k}
    write_json(record_path(run_dir, k, stage), record)
    return record


# -- retries: transient errors only -------------------------------------------------------------------

class TransientError(RuntimeError):
    """Raise (or wrap with `raise TransientError(...) from e`) for a failure worth retrying."""


# Subclasses of OSError that mean bad input, not a hiccup: retrying cannot make them pass.
_PERMANENT_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
_TRANSIENT_MESSAGES = ("cuda out of memory", "out of memory", "database is locked", "temporarily unavailable",
                       "connection reset", "connection refused", "timed out", "cudnn_status_internal_error",
                       "nccl error", "resource temporarily unavailable")


def _transient_one(exc: BaseException) -> bool | None:
    """True/False when this exception alone decides; None when its cause should decide."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, ValueError):          # ConfigError, TaskValidationError, ModelError, pydantic ...
        return False
    if isinstance(exc, (TypeError, KeyError, IndexError, AttributeError, NotImplementedError, AssertionError)):
        return False
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith("docker"):        # docker.errors.*: engine hiccups yes, a missing image no
        if name in ("ImageNotFound", "NotFound", "InvalidArgument", "BuildError"):
            return False
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is None or status >= 500
    if isinstance(exc, (TimeoutError, ConnectionError, subprocess.TimeoutExpired)):
        return True
    if isinstance(exc, OSError):
        return not isinstance(exc, _PERMANENT_OS_ERRORS)
    if name in ("InfraError", "BoxDied", "OutOfMemoryError", "OperationalError"):  # sandbox, torch.cuda, sqlite
        return True
    msg = str(exc).lower()
    if name in ("MlflowException", "RestException", "RuntimeError") and any(m in msg for m in _TRANSIENT_MESSAGES):
        return True
    return None


def is_transient(exc: BaseException | None) -> bool:
    """Is this failure an engine/container/IO hiccup worth retrying? Bad input never is."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        verdict = _transient_one(exc)
        if verdict is not None:
            return verdict
        exc = exc.__cause__ or exc.__context__
    return False


def retry_transient_only(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry a failed stage only for a transient error."""
    exc = state.data if isinstance(getattr(state, "data", None), BaseException) else None
    if exc is None:
        try:
            exc = state.result(raise_on_failure=False)
        except Exception as e:  # noqa: BLE001 - the result itself may be the raised error
            exc = e
    ok = is_transient(exc) if isinstance(exc, BaseException) else False
    try:
        from prefect.logging import get_run_logger
        get_run_logger().warning("%s: %s error %r", task.name, "transient, retrying" if ok else "permanent, not retrying",
                                 exc)
    except Exception:  # noqa: BLE001 - logging must not decide retries
        pass
    return ok


# -- test-only fault injection -------------------------------------------------------------------------
# GRPO_FAULT_FILE names a JSON list of rules; each real stage start (and a few named points such as
# "update:saved") consults it. A rule: {"point": "rollout", "iteration": 1, "times": 1,
# "action": "raise" | "hang", "error": "OSError" | "ValueError" | ..., "marker": "/path/touched/on/hit"}.
# `times` is decremented in the file, so "fail once" survives Prefect retries and process restarts.
# Never set it in production: it exists so that tests can break a run honestly, through the real engine.
FAULT_ENV = "GRPO_FAULT_FILE"
_FAULT_ERRORS = {"OSError": OSError, "ConnectionError": ConnectionError, "TimeoutError": TimeoutError,
                 "ValueError": ValueError, "RuntimeError": RuntimeError, "TransientError": TransientError}


def fault_point(point: str, iteration: int | None = None) -> None:
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
        raise _FAULT_ERRORS[rule.get("error", "OSError")](f"injected fault at {point} (iteration {iteration})")


# -- run status (for `grpo runs` / `grpo resume`) ------------------------------------------------------

def mlflow_run_id(run_dir: str | Path) -> str | None:
    """The MLflow run of this training run (recorded in run.json when the flow starts), if any."""
    p = run_state_path(run_dir)
    return read_json(p).get("mlflow_run_id") if p.exists() else None


def run_state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "run.json"


def update_run_state(run_dir: str | Path, **fields: Any) -> dict:
    """Merge fields into run.json (atomic)."""
    p = run_state_path(run_dir)
    state = read_json(p) if p.exists() else {}
    state.update(fields)
    write_json(p, state)
    return state


def mark_running(run_dir: str | Path, flow_run_id: str | None) -> dict:
    p = run_state_path(run_dir)
    state = read_json(p) if p.exists() else {}
    attempts = state.get("attempts", 0) + 1
    return update_run_state(run_dir, status="running", pid=os.getpid(), host=socket.gethostname(),
                            attempts=attempts, flow_run_id=flow_run_id,
                            flow_run_ids=[*state.get("flow_run_ids", []), flow_run_id] if flow_run_id else
                            state.get("flow_run_ids", []),
                            updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def _alive(pid: int | None, host: str | None) -> bool | None:
    if not pid or host != socket.gethostname():
        return None             # unknown (another machine)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def last_completed_stage(run_dir: str | Path) -> tuple[int, str] | None:
    """(iteration, stage) of the latest stage record, in pipeline order; iteration 0 = the base eval."""
    best = None
    for d in Path(run_dir).glob("iter-*"):
        try:
            k = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        for i, st in enumerate(STAGES):
            if (d / f"{st}.json").exists() and (best is None or (k, i) > best[:2]):
                best = (k, i, st)
    return None if best is None else (best[0], best[2])


def iterations_done(run_dir: str | Path) -> int:
    """Iterations whose update completed (the evaluate after it may be pending)."""
    done = [int(p.parent.name.split("-", 1)[1]) for p in Path(run_dir).glob("iter-*/update.json")]
    return max(done, default=0)


def run_status(run_dir: str | Path) -> dict:
    """What `grpo runs` shows for one run directory."""
    run_dir = Path(run_dir)
    state = read_json(run_state_path(run_dir)) if run_state_path(run_dir).exists() else {}
    status = state.get("status", "created")
    if status == "running" and _alive(state.get("pid"), state.get("host")) is False:
        status = "killed"        # the process died without saying so (SIGKILL, OOM, power)
    last = last_completed_stage(run_dir)
    total = None
    if (run_dir / "config.yaml").exists():
        import yaml
        total = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("pipeline_iterations")
    return {"run": run_dir.name, "status": status,
            "last_completed": f"iter-{last[0]}/{last[1]}" if last else "-",
            "iterations": f"{iterations_done(run_dir)}/{total if total is not None else '?'}",
            "mlflow_run_id": state.get("mlflow_run_id", "-"), "updated": state.get("updated", "-"),
            "error": state.get("error")}
