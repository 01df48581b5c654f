"""What every stage shares: the run directory layout, stage records, and the config round trip.

Layout:  <output_dir>/<run_name>/
           config.yaml          the validated config of the run
           run.json             MLflow run id and other run-level facts
           data/eval.jsonl      the held-out split (fixed for the run)
           iter-<k>/<stage>.json  the record a stage returns, written last (atomically): its presence
                                means the stage completed with the inputs named in its "key"
           iter-<k>/...         the stage's outputs
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from grpo_core.config import GRPOConfig
from grpo_core.data.schema import atomic_write_text

STAGES = ("curate", "rollout", "score", "update", "evaluate")


def cfg_of(config: dict) -> GRPOConfig:
    return GRPOConfig.model_validate(config)


def iter_dir(run_dir: str | Path, k: int) -> Path:
    d = Path(run_dir) / f"iter-{k}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def record_path(run_dir: str | Path, k: int, stage: str) -> Path:
    return Path(run_dir) / f"iter-{k}" / f"{stage}.json"


def input_key(**inputs: Any) -> str:
    """Hash of a stage's inputs (JSON-able values, e.g. config dict and upstream paths)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))


def completed_record(run_dir: str | Path, k: int, stage: str, key: str) -> dict | None:
    """The stage's record if it already completed with the same inputs (resume), else None."""
    p = record_path(run_dir, k, stage)
    if p.exists():
        rec = read_json(p)
        if rec.get("key") == key:
            return rec
    return None


def finish_stage(run_dir: str | Path, k: int, stage: str, key: str, record: dict) -> dict:
    record = {**record, "key": key, "stage": stage, "iteration": k}
    write_json(record_path(run_dir, k, stage), record)
    return record
