"""Do two runs of one config behave the same? Compares, iteration by iteration, the sampled tokens, rewards,
update and evaluation records and the adapter weights (bit for bit), then every MLflow metric point (key, step,
value), leaving out timings, memory and paths. Used to show a refactor left behaviour unchanged (issue #49):

    grpo train --config configs/default.yaml --set kernels.decode_linear=onednn --output-dir A --run-name r  # before
    grpo train --config configs/default.yaml --set kernels.decode_linear=onednn --output-dir B --run-name r  # after
    python bench/compare_runs.py A/r B/r

Pin the decode matmul (`kernels.decode_linear`): with `auto` a timing probe picks it, and two runs whose probes
disagree sample different tokens (docs/operations.md, "Runs you can reproduce bit for bit"). Exit status 1 when
anything differs.
"""
from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

VARIES = re.compile(r"seconds|per_second|peak_memory|sys/")          # timings and memory: never compared
PATH_FIELDS = {"key", "sampler", "checkpoint", "state", "samples", "scores", "prompts", "eval", "path"}
JSONL = ("prompts.jsonl", "samples.jsonl", "scores.jsonl", "eval_samples.jsonl")
RECORDS = ("curate.json", "score.json", "update.json", "evaluate.json")
ADAPTER = "update/checkpoint/adapter_model.safetensors"


def comparable(value):
    """`value` without timings, memory and paths (which differ between two runs of the same behaviour)."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if not VARIES.search(k) and k not in PATH_FIELDS}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def _read(path: Path):
    if not path.exists():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def _same_adapter(a: Path, b: Path) -> bool:
    if not a.exists() and not b.exists():
        return True
    if not (a.exists() and b.exists()):
        return False
    ta, tb = load_file(a), load_file(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def metric_points(db: Path) -> set[tuple[str, int, float]]:
    """Every MLflow metric point (key, step, value rounded to 1e-6) of the SQLite store, timings left out."""
    with sqlite3.connect(db) as con:
        rows = con.execute("select key, step, value from metrics").fetchall()
    return {(k, s, round(v, 6)) for k, s, v in rows if not VARIES.search(k)}


def differences(a: Path, b: Path) -> list[str]:
    """What differs between run directories `a` and `b` (their MLflow stores are `mlflow.db` beside them)."""
    found = []
    iterations = sorted({p.name for run in (a, b) for p in run.glob("iter-*")}, key=lambda n: int(n.split("-")[1]))
    for it in iterations:
        for name in JSONL + RECORDS:
            if comparable(_read(a / it / name)) != comparable(_read(b / it / name)):
                found.append(f"{it}/{name}")
        if not _same_adapter(a / it / ADAPTER, b / it / ADAPTER):
            found.append(f"{it}/{ADAPTER}")
    ma, mb = metric_points(a.parent / "mlflow.db"), metric_points(b.parent / "mlflow.db")
    found += [f"MLflow {key} step {step}: {value} only in {side}" for side, only in (("A", ma - mb), ("B", mb - ma))
              for key, step, value in sorted(only)]
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", type=Path, help="run directory A (e.g. runs/r)")
    ap.add_argument("run_b", type=Path, help="run directory B")
    args = ap.parse_args()
    found = differences(args.run_a, args.run_b)
    points = len(metric_points(args.run_a.parent / "mlflow.db"))
    for line in found[:40]:
        print("differs:", line)
    print(f"{len(list(args.run_a.glob('iter-*')))} iterations and {points} MLflow metric points compared: "
          f"{len(found)} differences")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
