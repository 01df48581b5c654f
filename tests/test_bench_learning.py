"""bench/learning.py's records: the commit a figure was measured on, the kernels its runs took."""
from __future__ import annotations

import json
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


def test_the_kernels_each_iteration_took_are_listed_once_without_the_probes_timings(tmp_path):
    """Two runs of one config can take different kernels (a timing probe per process picks them) and then differ:
    the result says which each took, every distinct choice once, a resumed run's second choice included."""
    said = [("fused bfloat16 decode, native linears (probe: plain 1.8 GB/s, native 2.8 GB/s), native step ops",
             "native (15 of 15 base linears; probe: torch 4.1 ms, native 2.8 ms)"),
            ("fused bfloat16 decode, native linears (probe: plain 2.9 GB/s, native 5.7 GB/s), native step ops",
             "torch (15 of 15 base linears; probe: torch 2.1 ms, native 2.8 ms)")]
    (tmp_path / "iter-0").mkdir()                                     # the base model's evaluation: no rollout
    for k, (sampler, linears) in enumerate(said + said[1:], start=1):
        (tmp_path / f"iter-{k}").mkdir()
        (tmp_path / f"iter-{k}" / "rollout.json").write_text(json.dumps({"sampler": sampler}))
        (tmp_path / f"iter-{k}" / "update.json").write_text(json.dumps({"linears": linears}))
    assert learning.kernels_taken(tmp_path) == {
        "sampler": ["fused bfloat16 decode, native linears, native step ops"],
        "update": ["native (15 of 15 base linears)", "torch (15 of 15 base linears)"]}
