"""DAPO dynamic sampling (filter on raw correctness, refill, counts) and the overlong soft penalty."""
from __future__ import annotations

import pytest

from grpo_core.task import Task

from grpo_core.update.dynamic_sampling import count_informative, is_informative, merge_rounds
from grpo_core.rewards.rewards import compute_rewards, overlong_penalty, overlong_reward


def round_rows(task_prefix, groups):
    """groups: list of (correct list, reward list) -> (samples, scores) rows as the stages write them."""
    samples, scores = [], []
    for g, (correct, reward) in enumerate(groups):
        for c, r in zip(correct, reward):
            samples.append({"task_id": f"{task_prefix}{g}", "group": g, "completion_ids": [1, 2]})
            scores.append({"task_id": f"{task_prefix}{g}", "group": g, "reward": r, "correct": c})
    return samples, scores


def test_filter_uses_raw_correctness_not_shaped_reward():
    # all wrong, but the format bonus differs: the shaped reward varies, correctness does not -> dropped
    assert not is_informative([0.0, 0.0, 0.0])
    assert is_informative([0.0, 1.0, 0.0]) and is_informative([0.25, 0.5, 0.5])   # code pass fractions
    assert not is_informative([1.0, None, 1.0]) and not is_informative([None, None])
    s, c = round_rows("a", [([0, 0, 0], [0, 1, 0.5]), ([1, 0, 1], [2, 0, 2]), ([1, 1, 1], [2, 2, 1])])
    assert count_informative([(s, c)]) == 1


def test_a_task_drawn_again_counts_once_toward_the_refill_target():
    """A refill round may draw a task an earlier round already has; the merge keeps it once, so the refill loop
    (flows/train.py) counts it once and goes on sampling instead of stopping short of the target."""
    r0 = round_rows("a", [([0, 1], [0, 1]), ([1, 1], [1, 1])])
    r1 = round_rows("a", [([1, 0], [1, 0])])                              # task a0 again, informative again
    assert count_informative([r0, r1]) == 1
    assert merge_rounds([r0, r1], target_groups=2)[2]["groups_kept"] == 1
    r2 = round_rows("b", [([1, 0], [1, 0])])
    assert count_informative([r0, r1, r2]) == 2 == merge_rounds([r0, r1, r2], target_groups=2)[2]["groups_kept"]


def test_merge_refills_up_to_target_and_counts_drops():
    r0 = round_rows("a", [([0, 0], [0, 1]), ([1, 0], [1, 0]), ([1, 1], [1, 1])])
    r1 = round_rows("b", [([0, 1], [0, 1]), ([0, 0], [0, 0]), ([1, 0], [1, 0])])
    samples, scores, st = merge_rounds([r0, r1], target_groups=3)
    assert [s["task_id"] for s in samples] == ["a1", "a1", "b0", "b0", "b2", "b2"]
    assert [s["group"] for s in samples] == [0, 0, 1, 1, 2, 2] == [c["group"] for c in scores]
    assert st["groups_dropped"] == 3 and st["groups_kept"] == 3 and st["filled"] == 1.0
    assert st["extra_rounds"] == 1 and st["extra_rollouts"] == 6 and st["groups_sampled"] == 6


def test_merge_stops_at_target_skips_duplicates_and_falls_back():
    r0 = round_rows("a", [([1, 0], [1, 0]), ([0, 1], [0, 1])])
    r1 = round_rows("a", [([1, 0], [1, 0])])                      # same task again
    s, c, st = merge_rounds([r0, r1], target_groups=1)
    assert len({x["group"] for x in s}) == 1 and st["groups_duplicate"] == 1
    dead = round_rows("z", [([0, 0], [0, 0.5])])
    s, c, st = merge_rounds([dead], target_groups=4)
    assert st["fallback"] == 1.0 and len(s) == 2 and st["groups_dropped"] == 1


def test_overlong_penalty_dapo_shape():
    # L_max = 20, L_cache = 4: 0 up to 16, linear to -1 at 20, -1 beyond
    assert overlong_penalty(10, 20, 4) == 0.0 and overlong_penalty(16, 20, 4) == 0.0
    assert overlong_penalty(18, 20, 4) == pytest.approx(-0.5) and overlong_penalty(20, 20, 4) == -1.0
    assert overlong_penalty(25, 20, 4) == -1.0
    assert overlong_reward(["p", "q"], ["a", "b"], completion_lengths=[3, 19], max_completion_length=20,
                           overlong_buffer_length=4) == [0.0, -0.75]
    assert overlong_reward(["p"], ["a"]) == [0.0]                # no token counts: no penalty
    task = Task(id="t", kind="math", source="s", prompt="What is 1 + 1?", answer="2")
    scores = compute_rewards(["x", "y"], [task, task], ["overlong"], [0.5],
                             context={"completion_lengths": [1, 8], "max_completion_length": 8})
    assert scores.per_func["overlong"] == [0.0, -1.0] and scores.totals == [0.0, -0.5]   # default buffer 8 // 4 = 2


@pytest.mark.slow
def test_iteration_flow_refills_and_feeds_update(tmp_path, grpo_home, prefect_engine, mlflow_uri):
    """Through the real Prefect engine: the tiny model answers nothing right, so every group is dropped,
    the flow runs the extra rounds, falls back to the first batch, and the update still runs on it."""
    import json
    from pathlib import Path

    from flows.train import iteration_flow
    from tests.conftest import tiny_config
    config = tiny_config(tmp_path, dynamic_sampling=True, max_extra_rollouts=2, pipeline_iterations=1,
                         eval=dict(enabled=False))
    from grpo_core.config import GRPOConfig
    from tasks import tracking
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    tracking.start_or_resume_run(GRPOConfig.model_validate(config), run_dir, None)     # the update logs to it
    res = iteration_flow(config, str(run_dir), 1, None, None)
    ds = res["dynamic_sampling"]
    assert ds["extra_rounds"] == 2 and ds["groups_sampled"] == 6 and ds["groups_dropped"] == 6
    assert ds["fallback"] == 1.0
    assert (run_dir / "iter-1" / "dynamic-2" / "iter-1" / "scores.jsonl").exists()
    merged = [json.loads(x) for x in Path(run_dir / "iter-1" / "samples.dynamic.jsonl").read_text().splitlines()]
    assert len(merged) == 2 * config["num_generations"]
    assert Path(res["update"]["checkpoint"]).exists()
