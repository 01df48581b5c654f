"""tasks/score.py and grpo_core/rewards/scoring.py on the tiny model: the score stage's rows and metrics, and groups scored while the rollout samples
them (stages.score.during_rollout): the same scores as the score stage's own, adopted only when they match the
samples and the reward settings, and left to the score stage after any failure."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from grpo_core.data import arithmetic
from grpo_core.io import read_jsonl, write_jsonl
from grpo_core.rewards.scoring import GroupScorer, early_scores_path, score_rows, scores_during_rollout
from grpo_core.task import read_tasks, write_tasks
from tasks.layout import cfg_of
from tasks.rollout import rollout
from tasks.score import score
from tests.conftest import isolated_run_env, tiny_config

REWARDS = dict(reward_funcs=["accuracy", "format", "overlong"], overlong_buffer_length=6)


def fails_on_a_helper_thread(prompts, completions, **_):
    """A plugin reward that works only on the main thread (as one that sets a signal handler does); notes the
    thread of each call in $CALLS_LOG (the plugin is imported by name: a module of its own, not this one)."""
    import os
    import threading
    with open(os.environ["CALLS_LOG"], "a") as f:
        f.write(threading.current_thread().name + "\n")
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("signal only works in main thread of the main interpreter")
    return [float(len(c) % 3) for c in completions]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("score")
    with isolated_run_env(tmp, tiny_model_dir):
        yield tmp, write_tasks(tmp / "prompts.jsonl", arithmetic.eval_tasks(5, 1, 2, ["+", "-"]))


def roll_and_score(tmp: Path, prompts: Path, name: str, **overrides) -> tuple[dict, dict, Path]:
    """rollout then score of iteration 1 in run `name` (3 answers to each of 5 prompts, 4 rows per batch)."""
    config = tiny_config(tmp, run_name=name, num_generations=3, max_completion_length=8, generation_batch_size=4,
                         **{**REWARDS, **overrides})
    run_dir = tmp / "runs" / name
    rolled = rollout.fn(config, str(run_dir), 1, str(prompts), None)
    return rolled, score.fn(config, str(run_dir), 1, str(prompts), rolled["samples"]), run_dir


def without_timings(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("sys/")}


def test_groups_scored_during_the_rollout_are_the_score_stages_own(env):
    tmp, prompts = env
    early_rollout, early_score, early_dir = roll_and_score(tmp, prompts, "early")
    late_rollout, late_score, late_dir = roll_and_score(tmp, prompts, "late", stages=dict(score=dict(
        during_rollout=False)))
    assert early_rollout["scored_during_rollout"] and early_score["scored_during_rollout"]
    assert not late_rollout["scored_during_rollout"] and not late_score["scored_during_rollout"]
    assert early_scores_path(early_rollout["samples"]).exists() and not early_scores_path(late_rollout["samples"]).exists()
    assert list(read_jsonl(early_rollout["samples"])) == list(read_jsonl(late_rollout["samples"]))   # same seed
    early_rows, late_rows = list(read_jsonl(early_score["scores"])), list(read_jsonl(late_score["scores"]))
    assert early_rows == late_rows and len(early_rows) == 15
    assert len({r["rewards"]["overlong"] for r in early_rows}) > 1            # not one constant score
    assert without_timings(early_score["metrics"]) == without_timings(late_score["metrics"])
    assert set(early_score["metrics"]) == set(late_score["metrics"])          # sys/reward_seconds/<f> for each f


def test_early_scores_are_used_only_for_the_samples_and_rewards_they_were_made_for(env):
    tmp, prompts = env
    rolled, _, run_dir = roll_and_score(tmp, prompts, "changed")
    config = tiny_config(tmp, run_name="changed", num_generations=3, max_completion_length=8, **REWARDS)
    reweighted = dict(config, reward_weights=[1.0, 1.0, 2.0])
    again = score.fn(reweighted, str(run_dir), 1, str(prompts), rolled["samples"])
    assert not again["scored_during_rollout"]
    rows = list(read_jsonl(rolled["samples"]))
    rows[0] = dict(rows[0], completion="<answer>7</answer>")                  # the samples edited after the rollout
    write_jsonl(rolled["samples"], rows)
    (run_dir / "iter-1" / "score.json").unlink()                              # so that the stage runs again
    edited = score.fn(config, str(run_dir), 1, str(prompts), rolled["samples"])
    assert not edited["scored_during_rollout"]
    assert next(read_jsonl(edited["scores"]))["rewards"]["format"] == 1.0     # scored from the edited file


def test_early_scores_are_not_used_once_a_reward_functions_source_changed(env, monkeypatch):
    """A plugin edited between the rollout and the score stage (fixed, say, before `grpo resume`): scored again."""
    import os
    import sys
    tmp, prompts = env
    plugins = tmp / "plugins"
    plugins.mkdir(exist_ok=True)
    source = plugins / "gp_half.py"
    source.write_text("def half(prompts, completions, **kw):\n    return [0.5] * len(completions)\n")
    monkeypatch.syspath_prepend(str(plugins))
    try:
        rolled, scored, run_dir = roll_and_score(tmp, prompts, "edited", reward_funcs=["format", "gp_half:half"])
        assert scored["scored_during_rollout"]
        (run_dir / "iter-1" / "score.json").unlink()
        stat = source.stat()
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))          # the file edited
        config = tiny_config(tmp, run_name="edited", num_generations=3, max_completion_length=8,
                             generation_batch_size=4, **{**REWARDS, "reward_funcs": ["format", "gp_half:half"]})
        again = score.fn(config, str(run_dir), 1, str(prompts), rolled["samples"])
        assert not again["scored_during_rollout"]
    finally:
        sys.modules.pop("gp_half", None)


def test_a_reward_that_fails_on_the_helper_thread_is_left_to_the_score_stage(env, caplog, monkeypatch):
    tmp, prompts = env
    monkeypatch.setenv("CALLS_LOG", str(tmp / "calls.log"))
    with caplog.at_level(logging.INFO, logger="grpo_core.rewards.overlap"):
        rolled, scored, run_dir = roll_and_score(tmp, prompts, "main-only", reward_funcs=[
            "format", "tests.test_score:fails_on_a_helper_thread"])
    assert "scoring during the rollout stopped (ValueError: signal only works in main thread" in caplog.text
    assert not rolled["scored_during_rollout"] and not early_scores_path(rolled["samples"]).exists()
    assert (tmp / "calls.log").read_text().split() == ["score-during-rollout", "MainThread"]   # no retry on it
    assert not scored["scored_during_rollout"] and len(list(read_jsonl(scored["scores"]))) == 15


def test_scoring_during_rollout_only_where_the_score_stage_runs_with_the_rollout(tmp_path):
    assert scores_during_rollout(cfg_of(tiny_config(tmp_path)))
    assert not scores_during_rollout(cfg_of(tiny_config(tmp_path, stages=dict(score=dict(during_rollout=False)))))
    assert not scores_during_rollout(cfg_of(tiny_config(tmp_path, stages=dict(score=dict(work_pool="cpu-pool")))))
    assert scores_during_rollout(cfg_of(tiny_config(tmp_path, stages=dict(score=dict(work_pool="gpu"),
                                                                            rollout=dict(work_pool="gpu")))))


def test_the_scorer_scores_whole_groups_as_one_batch_would_and_can_be_abandoned(env):
    tmp, prompts = env
    cfg = cfg_of(tiny_config(tmp, **REWARDS))
    tasks = read_tasks(prompts)
    rows = [{"task_id": t.id, "completion": c, "completion_ids": list(range(n))}
            for t in tasks for c, n in (("<answer>3</answer>", 5), ("12", 8), ("", 1))]
    scorer = GroupScorer(cfg, tasks)
    for g in range(len(tasks)):
        scorer.add(g, rows[3 * g:3 * g + 3])
    by_group, seconds = scorer.finish()
    whole, _ = score_rows(cfg, rows, {t.id: t for t in tasks})
    assert [r for g in range(len(tasks)) for r in by_group[g]] == whole
    assert set(seconds) == {"accuracy", "format", "overlong"}
    stopped = GroupScorer(cfg, tasks)
    stopped.add(0, rows[:3])
    stopped.abandon()
    stopped._work._thread.join(30)
    assert not stopped._work._thread.is_alive()
