"""Run-level steps outside the stages (tasks/run.py): metric extraction, the dynamic-sampling merge and
the choice of the best iteration, and deleting old trainer states.
Starting adapters and registration are exercised end to end in test_ops_flow.py."""
from __future__ import annotations

import pytest

from grpo_core.io import read_jsonl
from tasks.data_logging import curation_metrics, curation_tags, numeric
from tasks.run import best_iteration, iteration_metrics, merge_dynamic_rounds
from tests.conftest import tiny_config
from tests.test_dynamic_sampling import round_rows


def test_numeric_keeps_numbers_and_prefixes_bare_names():
    rec = {"kept": 3, "frac": 0.5, "ok": True, "name": "x", "data/already": 2.0}
    assert numeric(rec, "data/") == {"data/kept": 3.0, "data/frac": 0.5, "data/already": 2.0}
    assert numeric(None, "p/") == {}


def test_constant_bookkeeping_is_tags_and_what_varies_is_metrics():
    """One source's count and the prompts per iteration never change: tags. The band counts and a mix of
    several sources do: data/* metrics, charted per iteration."""
    builtin = {"prompts": "p.jsonl", "num_prompts": 8, "sources": {"arithmetic": 8}}
    assert iteration_metrics(builtin, 2.5) == {"sys/iteration_seconds": 2.5}
    assert curation_tags(builtin) == {"data.num_prompts": "8", "data.sources": "arithmetic"}
    curated = {"num_prompts": 4, "sources": {"gsm": 3, "arith": 1},
               "metrics": {"pool": 60, "in_band": 40, "out_of_band": 20, "measured": 12}}
    assert curation_metrics(curated) == {"data/in_band": 40.0, "data/out_of_band": 20.0, "data/measured": 12.0,
                                         "data/source/gsm": 3.0, "data/source/arith": 1.0}
    assert curation_tags(curated) == {"data.num_prompts": "4", "data.pool": "60", "data.sources": "arith, gsm"}


def test_merge_dynamic_rounds_writes_the_merged_rows_without_a_tracking_run(tmp_path):
    from grpo_core.config import GRPOConfig
    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, data=dict(prompts_per_iteration=2)))
    run_dir = tmp_path / "run"
    (run_dir / "iter-1").mkdir(parents=True)
    r0 = round_rows("a", [([0, 0], [0, 1]), ([1, 0], [1, 0])])
    r1 = round_rows("b", [([0, 1], [0, 1])])
    samples, scores, stats = merge_dynamic_rounds(cfg, str(run_dir), 1, [r0, r1])
    assert samples.endswith("iter-1/samples.dynamic.jsonl") and scores.endswith("iter-1/scores.dynamic.jsonl")
    assert [s["task_id"] for s in read_jsonl(samples)] == ["a1", "a1", "b0", "b0"]
    assert stats["groups_kept"] == 2 and stats["groups_dropped"] == 1


def test_best_iteration_is_the_highest_metric_after_the_base_model_ties_to_the_later():
    from grpo_core.config import GRPOConfig
    cfg = GRPOConfig(tracking={"best_metric": "eval/greedy/pass_at_1"})
    m = lambda v: {"eval/greedy/pass_at_1": v}
    assert best_iteration(cfg, {0: m(0.9), 1: m(0.5), 2: m(0.7), 3: m(0.7), 4: {}}, default=4) == 3
    assert best_iteration(cfg, {"0": m(0.1), "1": m(0.3), "2": m(0.2)}, default=2) == 1    # summary.json keys
    assert best_iteration(cfg, {0: m(1.0)}, default=5) == 5                                # only the base model


def test_old_trainer_states_are_deleted_and_the_setting_may_change_on_resume(tmp_path):
    """keep_trainer_states: N keeps the newest N optimizer states once an iteration finishes; adapters and
    records stay; None keeps all. The setting changes no result, so a resume may change it."""
    from grpo_core.update.checkpoint import STATE_FILE
    from grpo_core.config import GRPOConfig
    from tasks.run import check_same_config, prune_trainer_states
    run_dir = tmp_path / "run"
    for k in range(1, 6):
        (run_dir / f"iter-{k}" / "update" / "checkpoint").mkdir(parents=True)
        (run_dir / f"iter-{k}" / "update" / STATE_FILE).write_bytes(b"state")

    def states():
        return sorted(int(p.parts[-3].removeprefix("iter-")) for p in run_dir.glob(f"iter-*/update/{STATE_FILE}"))

    cfg = GRPOConfig.model_validate(tiny_config(tmp_path, keep_trainer_states=None))
    prune_trainer_states(cfg, run_dir, 5)
    assert states() == [1, 2, 3, 4, 5]
    cfg.keep_trainer_states = 2
    prune_trainer_states(cfg, run_dir, 4)           # iteration 5 still running: its state and 4's are kept
    assert states() == [3, 4, 5]
    prune_trainer_states(cfg, run_dir, 5)
    assert states() == [4, 5]
    assert len(list(run_dir.glob("iter-*/update/checkpoint"))) == 5

    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    cfg.keep_trainer_states = None
    check_same_config(cfg, run_dir)                  # not refused
    cfg.learning_rate *= 2
    with pytest.raises(ValueError, match="learning_rate"):
        check_same_config(cfg, run_dir)
