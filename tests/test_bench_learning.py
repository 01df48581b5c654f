"""bench/learning.py's machine record: the commit a figure was measured on."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import learning  # noqa: E402


def test_the_callers_commit_wins_over_the_trees_git(monkeypatch):
    """A copy of the tree (a snapshot, a device machine) may carry a stale .git: GRPO_COMMIT is the caller's word."""
    monkeypatch.setenv("GRPO_COMMIT", "abc1234 + an edit")
    assert learning.machine()["commit"] == "abc1234 + an edit"


def test_without_grpo_commit_the_record_is_the_checkouts_head(monkeypatch):
    monkeypatch.delenv("GRPO_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rec = learning.machine()
    assert rec["commit"].removesuffix("-dirty") == (head or "unknown")
    assert {"cpu", "cores", "torch", "transformers", "python", "gpu"} <= set(rec)
