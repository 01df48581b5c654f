"""Reward functions and task sources as plugins: "package.module:function", entry points, async
functions, the score stage's per-function metrics, and every error a user can make, by its message."""
from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time

import pytest
from pydantic import ValidationError

from grpo_core.config import ConfigError, GRPOConfig, load_config
from grpo_core.plugins import PluginError, metric_names
from grpo_core.rewards.rewards import RewardOutputError, compute_rewards, resolve_reward
from grpo_core.task import Task

MODULE = "gp_test_plugin"
PLUGIN_SOURCE = '''
import asyncio


def shout(prompts, completions, **kwargs):
    """Share of upper-case letters."""
    return [sum(ch.isupper() for ch in c) / max(1, len(c)) for c in completions]


def picky(prompts, completions, answer, unit=None):
    """Only the columns it names: `answer`, and the meta key `unit` when the tasks have it."""
    units = unit if unit is not None else [None] * len(answer)
    return [1.0 if (a, u) == ("7", "km") else 0.0 for a, u in zip(answer, units)]


async def slow_a(prompts, completions, **kwargs):
    await asyncio.sleep(0.4)
    return [1.0] * len(completions)


async def slow_b(prompts, completions, **kwargs):
    await asyncio.sleep(0.4)
    return [None] + [0.5] * (len(completions) - 1)


def short(prompts, completions, **kwargs):
    return [1.0]


def boom(prompts, completions, **kwargs):
    raise RuntimeError("boom")


def one(completions):
    return [0.0] * len(completions)


def needs(prompts, completions, foo):
    return [0.0] * len(completions)


CONST = 3


def rows(n=3):
    """A few arithmetic rows as plain dicts."""
    for i in range(n):
        yield {"id": f"row-{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)}
    yield {"id": "row-bad", "question": "Say something nice."}           # no answer: not verifiable


rows.group = "community"


def bad_rows(**options):
    yield 42
'''
DIST = "fakedist-0.1.dist-info"
ENTRY_POINTS = f"""
[grpo_pipeline.rewards]
shout = {MODULE}:shout
broken = gp_missing_module:fn

[grpo_pipeline.sources]
fake_rows = {MODULE}:rows
fake_broken = gp_missing_module:rows
"""
T7 = Task(id="a", kind="math", source="s", prompt="How far?", answer="7", meta={"unit": "km"})
T8 = Task(id="b", kind="math", source="s", prompt="How far?", answer="7", meta={"unit": "m"})


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    """A plugin module on sys.path, and a fake installed distribution registering entry points."""
    (tmp_path / f"{MODULE}.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / DIST
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


# -- rewards: the three ways to name one ---------------------------------------------------------------


def test_module_function_form_gets_its_short_metric_name(plugin):
    scores = compute_rewards(["ABcd", "abcd"], [T7, T8], ["format", f"{plugin}:shout"], [1.0, 2.0])
    assert scores.per_func["shout"] == [0.5, 0.0] and scores.totals == [1.0, 0.0]
    assert set(scores.seconds) == {"format", "shout"}


def test_entry_point_form_and_its_origin(plugin):
    func = resolve_reward("shout", "reward_funcs[0]")
    assert func.origin == f"fakedist 0.1 ({plugin}:shout)" and func.accepts is None
    assert compute_rewards(["AB"], [T7], ["shout"], [1.0]).per_func["shout"] == [1.0]
    assert GRPOConfig(reward_funcs=["accuracy", "shout"]).reward_weights == [1.0, 1.0]


def test_a_function_without_kwargs_gets_only_the_columns_it_names(plugin):
    assert resolve_reward(f"{plugin}:picky", "f").accepts == frozenset({"answer", "unit"})
    assert compute_rewards(["x", "x"], [T7, T8], [f"{plugin}:picky"], [1.0]).per_func["picky"] == [1.0, 0.0]
    no_meta = Task(id="c", kind="math", source="s", prompt="p", answer="7")
    assert compute_rewards(["x"], [no_meta], [f"{plugin}:picky"], [1.0]).per_func["picky"] == [0.0]   # default


def test_metric_names_are_short_and_unique():
    assert metric_names(["accuracy", "pkg.rewards:lenpen", "other.mod:accuracy", "a.b:f", "c.d:f", "format"]) == [
        "accuracy", "lenpen", "other.mod.accuracy", "a.b.f", "c.d.f", "format"]
    assert metric_names(["format", "format"]) == ["format", "format_2"]


# -- async functions ----------------------------------------------------------------------------------------


def test_async_functions_run_concurrently_and_none_drops_the_sample(plugin):
    funcs = [f"{plugin}:slow_a", f"{plugin}:slow_b", "format"]
    t0 = time.perf_counter()
    scores = compute_rewards(["<answer>7</answer>"] * 3, [T7] * 3, funcs, [1.0, 1.0, 1.0])
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.75, f"two 0.4 s async rewards took {elapsed:.2f} s: not concurrent"
    assert scores.seconds["slow_a"] >= 0.4 and scores.seconds["slow_b"] >= 0.4
    assert scores.totals == [None, 2.5, 2.5]


def test_async_functions_work_inside_a_running_event_loop(plugin):
    async def inside():
        return compute_rewards(["x"], [T7], [f"{plugin}:slow_a"], [1.0])
    assert asyncio.run(inside()).per_func["slow_a"] == [1.0]


# -- errors, each naming the entry and the fix ----------------------------------------------------------------


def _config_error(entries: list[str]) -> str:
    with pytest.raises(ValidationError) as e:
        GRPOConfig(reward_funcs=entries)
    return str(e.value)


def test_unknown_name_lists_the_known_and_installed_ones(plugin):
    msg = _config_error(["accuracy", "lenpen"])
    assert 'reward_funcs[1] = "lenpen": unknown name; known: accuracy, format, overlong (built in)' in msg
    assert "installed plugins: " in msg and "broken" in msg and "shout" in msg and '"grpo_pipeline.rewards"' in msg
    assert "pip install" in msg


def test_missing_module_says_how_to_install(plugin):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["reward_funcs=[accuracy, gp_nowhere.rewards:lenpen]"])
    msg = str(e.value)
    assert 'reward_funcs[1] = "gp_nowhere.rewards:lenpen": cannot import module \'gp_nowhere.rewards\'' in msg
    assert "ModuleNotFoundError" in msg and "pip install -e PATH" in msg and "Prefect worker" in msg


@pytest.mark.parametrize("entry, expected", [
    (f"{MODULE}:lenpen", f"module '{MODULE}' has no attribute 'lenpen'. Fix: name one of its functions"),
    (f"{MODULE}:CONST", "is a int, not a function"),
    (f"{MODULE}:one", "takes 1 positional argument(s), but reward functions are called f(prompts, completions, "
                      "**columns). Fix: def f(prompts, completions, **kwargs) -> list[float | None]"),
    (f"{MODULE}:needs", "needs() requires argument 'foo', which is not a column. Fix: give it a default"),
    (f"{MODULE}:", 'write "package.module:function"'),
    ("a:b:c", 'write "package.module:function"'),
    ("broken", "the entry point 'gp_missing_module:fn' of fakedist 0.1 fails to load (ModuleNotFoundError"),
])
def test_each_bad_entry_has_its_own_message(plugin, entry, expected):
    msg = _config_error(["format", entry])
    assert f'reward_funcs[1] = "{entry}"' in msg and expected in msg


def test_a_bad_return_value_names_the_function(plugin):
    with pytest.raises(RewardOutputError, match="reward function 'short' returned 1 scores for 2 completions"):
        compute_rewards(["a", "b"], [T7, T8], [f"{plugin}:short"], [1.0])


def test_an_exception_inside_a_function_keeps_its_type_and_names_it(plugin):
    with pytest.raises(RuntimeError, match="boom") as e:
        compute_rewards(["a"], [T7], [f"{plugin}:boom"], [1.0])
    assert any("in reward function 'boom'" in note for note in e.value.__notes__)


def test_plugin_errors_are_permanent_not_retried():
    from tasks.retry import is_transient
    assert not is_transient(PluginError("x")) and not is_transient(RewardOutputError("x"))


# -- the score stage -----------------------------------------------------------------------------------------------


def test_score_stage_logs_each_function_and_its_time(plugin, tmp_path):
    pytest.importorskip("prefect")
    from grpo_core.task import write_tasks
    from grpo_core.io import write_jsonl, read_jsonl
    from tasks.score import score
    prompts = write_tasks(tmp_path / "prompts.jsonl", [T7])
    samples = write_jsonl(tmp_path / "samples.jsonl", [
        {"task_id": "a", "group": 0, "completion": c, "completion_ids": [1, 2, 3]}
        for c in ("<answer>7</answer>", "NO")])
    config = GRPOConfig(reward_funcs=["format", f"{plugin}:shout", f"{plugin}:slow_a"],
                        output_dir=str(tmp_path)).model_dump(mode="json")
    rec = score.fn(config, str(tmp_path / "run"), 1, str(prompts), str(samples))
    m = rec["metrics"]
    assert m["reward/format"] == 0.5 and m["reward/shout"] == 0.5 and m["reward/slow_a"] == 1.0
    assert m["sys/reward_seconds/slow_a"] >= 0.4 and {"sys/reward_seconds/format", "sys/reward_seconds/shout"} <= set(m)
    rows = list(read_jsonl(rec["scores"]))
    assert rows[0]["rewards"] == {"format": 1.0, "shout": 0.0, "slow_a": 1.0} and rows[0]["correct"] == 1.0
    assert json.dumps(rows)          # plain JSON: nothing pickled



def test_correctness_func_names_the_plugin_that_decides_correct(plugin, tmp_path):
    """`correctness_func` = a plugin: the score stage's raw correctness (dynamic sampling, pass rates) and
    evaluation's pass@1 come from it, whether or not it is also a weighted reward."""
    from grpo_core.evaluation.evaluate import score_samples
    from grpo_core.io import read_jsonl, write_jsonl
    from grpo_core.rollout.sampling import Sample
    from grpo_core.task import write_tasks
    from tasks.score import score
    prompts = write_tasks(tmp_path / "prompts.jsonl", [T7])
    samples = [{"task_id": "a", "group": 0, "completion": c, "completion_ids": [1, 2, 3]}
               for c in ("<answer>7</answer>", "SHOUTED")]
    for funcs in (["format"], ["format", f"{plugin}:shout"]):
        config = GRPOConfig(reward_funcs=funcs, correctness_func=f"{plugin}:shout", output_dir=str(tmp_path))
        rec = score.fn(config.model_dump(mode="json"), str(tmp_path / "run"), 1, str(prompts),
                       str(write_jsonl(tmp_path / "samples.jsonl", samples)))
        assert [r["correct"] for r in read_jsonl(rec["scores"])] == [0.0, 1.0]
        rows = score_samples([Sample("a", 0, [1], s["completion_ids"], s["completion"], False) for s in samples],
                             {"a": T7}, config, "greedy")
        assert [r["correct"] for r in rows] == [False, True]
    with pytest.raises(ValueError, match="correctness_func"):
        GRPOConfig(correctness_func=f"{plugin}:nope")

# -- task sources ----------------------------------------------------------------------------------------------------


def test_source_plugin_rows_become_tasks_and_rejections(plugin):
    from grpo_core.data.records import Rejection
    from grpo_core.data.sources import get_loader
    loader, group = get_loader(f"{plugin}:rows")
    records = list(loader(n=2, seed=5))                   # `seed` (the build passes it) is dropped: rows takes none
    assert group == "community"
    tasks = [r for r in records if isinstance(r, Task)]
    assert [(t.id, t.kind, t.prompt, t.answer, t.source) for t in tasks] == [
        ("row-0", "math", "What is 0 + 1?", "1", f"{plugin}:rows"),
        ("row-1", "math", "What is 1 + 1?", "2", f"{plugin}:rows")]
    assert [r.reason for r in records if isinstance(r, Rejection)] == ["not_verifiable"]


def test_source_entry_point_defaults_to_the_user_group_and_bad_records_fail(plugin):
    from grpo_core.data.sources import get_loader, load_source
    assert get_loader("fake_rows")[1] == "community"
    with pytest.raises(TypeError, match="yielded a int as record 0; yield Task objects or dicts"):
        load_source(f"{plugin}:bad_rows")


def test_unknown_source_is_a_key_error_listing_the_known_names(plugin):
    from grpo_core.data.sources import get_loader
    with pytest.raises(KeyError, match="known:") as e:
        get_loader("nope")
    assert isinstance(e.value, ValueError) and "fake_rows" in str(e.value) and '"grpo_pipeline.sources"' in str(e.value)
    assert not str(e.value).startswith("'")


def test_build_config_accepts_plugin_sources_and_names_a_bad_one(plugin, tmp_path):
    from grpo_core.data.build import load_build_config
    good = tmp_path / "good.yaml"
    good.write_text("sources: [{name: fake_rows, n: 2}, {name: arithmetic, n: 4}]\n")
    assert [s["name"] for s in load_build_config(good).sources] == ["fake_rows", "arithmetic"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources: [{name: arithmetic}, {name: nope}]\n")
    with pytest.raises(ValueError, match=r'sources\[1\]\.name = "nope": unknown name'):
        load_build_config(bad)


def test_data_sources_command_lists_plugins_and_where_they_come_from(plugin, capsys):
    import argparse
    from flows.cli.data import register
    p = argparse.ArgumentParser(prog="grpo")
    register(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["data", "sources"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    plugin_part = out.split("plugin sources")[1]
    assert "arithmetic" in out.split("plugin sources")[0]
    assert "fake_rows" in plugin_part and "community" in plugin_part and f"fakedist 0.1 ({MODULE}:rows)" in plugin_part
    assert "fake_broken" in plugin_part and "fails to load" in plugin_part
