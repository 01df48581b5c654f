"""The run directory layout, and the stage records whose presence marks a stage done.

    <output_dir>/<run_name>/
      config.yaml            the validated config of the run
      run.json               MLflow run id and other run-level facts (tasks/run_state.py)
      data/eval.jsonl        the held-out split (fixed for the run)
      data/gate.jsonl        the task's promotion-gate questions (never trained on, never used for selection)
      iter-<k>/<stage>.json  the record a stage returns, written last (atomically): its presence means
                             the stage completed with the inputs named in its "key"
      iter-<k>/...           the stage's outputs

This module only names paths and reads/writes records; deciding when to skip a stage is
tasks/stage.py's job.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

from grpo_core import stages
from grpo_core.config import GRPOConfig
from grpo_core.io import InputError, read_json_object, write_json

STAGES = stages.names()          # the registered stages' names, in order (grpo_core/stages.py)

# Config parts that change how a run is operated, never what it computes: a resume may change them
# (e.g. more retries) without invalidating completed stages. `kernels` is how the same math runs on this
# machine (which matmul, up to summation order; the precision `dtype: auto` detects), which a resume on
# another machine changes anyway.
OPERATIONAL_FIELDS = ("stages", "tracking", "gate", "monitors", "kernels", "output_dir", "run_name",
                      "init_adapter", "keep_trainer_states")


def cfg_of(config: dict) -> GRPOConfig:
    return GRPOConfig.model_validate(config)


def iter_dir(run_dir: str | Path, k: int) -> Path:
    d = Path(run_dir) / f"iter-{k}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def eval_split_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "data" / "eval.jsonl"


def gate_set_path(run_dir: str | Path) -> Path:
    """The run's copy of its task's promotion-gate questions (tasks/gate.py), kept out of its training."""
    return Path(run_dir) / "data" / "gate.jsonl"


def record_path(run_dir: str | Path, k: int, stage: str) -> Path:
    return Path(run_dir) / f"iter-{k}" / f"{stage}.json"


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
    """The stage's record if it already completed with the same inputs (resume), else None. A record that is not
    a JSON object (cut short or edited by hand; records are written atomically) marks nothing done: the stage runs
    again and writes it afresh."""
    p = record_path(run_dir, k, stage)
    if not p.exists():
        return None
    try:
        rec = read_json_object(p)
    except InputError as e:
        warnings.warn(f"{p}: unreadable stage record ({e}); {stage} of iteration {k} runs again", stacklevel=2)
        return None
    return rec if rec.get("key") == key else None


def finish_stage(run_dir: str | Path, k: int, stage: str, key: str, record: dict) -> dict:
    record = {**record, "key": key, "stage": stage, "iteration": k}
    write_json(record_path(run_dir, k, stage), record)
    return record
