"""bench/compare_runs.py: two runs of one config compared token by token, record by record, metric by metric."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import compare_runs  # noqa: E402


def test_a_copy_is_the_same_run_and_a_changed_token_or_metric_is_found(tmp_path, grpo_home):
    env = dict(os.environ, GRPO_HOME=str(grpo_home))
    env.pop("MLFLOW_TRACKING_URI", None)                     # the run's own SQLite store under its output dir
    subprocess.run([sys.executable, "-m", "flows.cli", "train", "--config", "configs/tiny.yaml", "--output-dir",
                    str(tmp_path / "a"), "--run-name", "r"], cwd=ROOT, env=env, check=True, capture_output=True)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = tmp_path / "a" / "r", tmp_path / "b" / "r"
    assert compare_runs.differences(a, b) == []
    assert len(compare_runs.metric_points(tmp_path / "a" / "mlflow.db")) > 100

    samples = b / "iter-2" / "samples.jsonl"
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    rows[0]["completion_ids"][0] += 1                        # one sampled token
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with sqlite3.connect(tmp_path / "b" / "mlflow.db") as con:
        con.execute("update metrics set value = value + 1 where key = 'eval/greedy/format_rate'")
    found = compare_runs.differences(a, b)
    assert "iter-2/samples.jsonl" in found
    assert any(line.startswith("MLflow eval/greedy/format_rate") and line.endswith("only in B") for line in found)
    assert not any("rollout" in line or "seconds" in line for line in found)   # timings never compared
