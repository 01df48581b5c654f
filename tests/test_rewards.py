"""The built-in rewards in TRL's calling convention, the columns they get, and compute_rewards' checks."""
import math

import pytest

from grpo_core.rewards.rewards import (RewardOutputError, accuracy_reward, check_scores, compute_rewards, format_reward,
                               overlong_reward, reward_columns, tasks_from_columns)
from grpo_core.task import Task

T = Task(id="t", kind="math", source="arithmetic", prompt="What is 2 + 3?", answer="5")


def call(fn, completions, tasks, **context):
    """A reward function called as the pipeline calls it."""
    return fn([t.prompt for t in tasks], completions, **reward_columns(tasks, context))


@pytest.mark.parametrize("completion, fmt", [
    ("2 plus 3 is 5. <answer>5</answer>", 1.0),
    ("<answer>5</answer>\n", 1.0),
    ("multi\nline\nreasoning\n<answer> 5 </answer>", 1.0),          # DOTALL
    ("<answer></answer>", 0.0),                                     # empty tags cannot earn the format reward
    ("<answer>   </answer>", 0.0),
    ("<answer>5</answer><answer>6</answer>", 0.0),                  # tags exactly once
    ("<answer>5</answer> and more text", 0.0),
    ("<answer>5", 0.0),
    ("5", 0.0),
    ("<answer></answer></answer>", 0.0),                            # a duplicated tag is not the answer
    ("<answer><answer></answer>", 0.0),
    ("<answer><answer>5</answer>", 0.0),
    ("<answer>5</answer></answer>", 0.0),
])
def test_format_reward(completion, fmt):
    assert call(format_reward, [completion], [T]) == [fmt]


def test_accuracy_needs_single_answer_block():
    scores = compute_rewards(["<answer>5</answer>", "<answer>4</answer>", "5"], [T] * 3, ["accuracy", "format"],
                             [1.0, 0.5])
    assert scores.per_func["accuracy"] == [1.0, 0.0, 0.0]
    assert scores.per_func["format"] == [1.0, 1.0, 0.0]
    assert scores.totals == [1.5, 0.5, 0.0]
    assert set(scores.seconds) == {"accuracy", "format"} and all(s >= 0 for s in scores.seconds.values())


def test_format_reward_follows_the_task_kind():
    py = Task(id="p", kind="python", source="s", prompt="write f", tests={"format": "io", "cases": []})
    rs = Task(id="r", kind="rust", source="s", prompt="write f", tests={"format": "rust", "tests": "x"})
    assert call(format_reward, ["Here:\n```python\ndef f():\n    return 1\n```"], [py]) == [1.0]
    assert call(format_reward, ["```python\n\n```"], [py]) == [0.0]                      # empty block
    assert call(format_reward, ["```python\na=1\n```\n```python\nb=2\n```"], [py]) == [0.0]   # two blocks
    assert call(format_reward, ["```rust\nfn f() {}\n```"], [py]) == [0.0]               # wrong language
    assert call(format_reward, ["```python\n```\n```"], [py]) == [0.0]                 # empty, a third fence
    assert call(format_reward, ["```python\n````"], [py]) == [0.0]                      # empty, four backticks
    assert call(format_reward, ["```rust\npub fn f() -> i32 { 1 }\n```\n"], [rs]) == [1.0]
    assert call(format_reward, ["<answer>5</answer>"], [rs]) == [0.0]


def test_columns_are_task_fields_meta_keys_and_context():
    a = Task(id="a", kind="math", source="s", prompt="p", answer="1", meta={"unit": "km", "id": "clash", "x": 1})
    b = Task(id="b", kind="math", source="s", prompt="q", answer="2", meta={})
    cols = reward_columns([a, b], {"completion_lengths": [3, 4], "max_completion_length": 8})
    assert "prompt" not in cols and cols["id"] == ["a", "b"] and cols["answer"] == ["1", "2"]
    assert cols["unit"] == ["km", None] and cols["x"] == [1, None]     # meta keys, None where absent
    assert cols["meta"] == [a.meta, b.meta]                             # the clashing meta key stays in meta only
    assert cols["completion_lengths"] == [3, 4] and cols["max_completion_length"] == 8
    assert tasks_from_columns(["p", "q"], cols) == [a, b]              # what the built-ins rebuild


def test_accuracy_reward_rebuilds_tasks_from_columns():
    rg = Task(id="r", kind="math", source="rg", prompt="p", answer="5")
    assert call(accuracy_reward, ["<answer>5</answer>", "<answer>6</answer>"], [T, rg]) == [1.0, 0.0]


def test_overlong_reward_uses_the_context():
    assert call(overlong_reward, ["a", "b"], [T, T], completion_lengths=[3, 19], max_completion_length=20,
                overlong_buffer_length=4) == [0.0, -0.75]
    scores = compute_rewards(["x", "y"], [T, T], ["overlong"], [0.5],
                             context={"completion_lengths": [1, 8], "max_completion_length": 8})
    assert scores.per_func["overlong"] == [0.0, -1.0] and scores.totals == [0.0, -0.5]


def test_none_from_any_function_makes_the_total_none(monkeypatch):
    from grpo_core.rewards import rewards
    monkeypatch.setitem(rewards.REWARD_FUNCS, "half", lambda prompts, completions, **kw: [None, 0.5])
    scores = compute_rewards(["<answer>5</answer>", "<answer>5</answer>"], [T, T], ["accuracy", "half"], [1.0, 1.0])
    assert scores.per_func["half"] == [None, 0.5] and scores.totals == [None, 1.5]


@pytest.mark.parametrize("values, message", [
    ([1.0], "returned 1 scores for 2 completions"),
    ([1.0, float("nan")], "returned nan for completion 1"),
    ([math.inf, 0.0], "returned inf for completion 0"),
    ([1.0, "1.0"], "returned a str ('1.0') for completion 1"),
    (0.5, "returned a float; return a list"),
    ("10", "returned a str; return a list"),
])
def test_bad_scores_are_reported_with_the_function_name(values, message):
    with pytest.raises(RewardOutputError, match="'lenpen'") as e:
        check_scores("lenpen", values, 2)
    assert message in str(e.value)


def test_good_scores_become_floats():
    assert check_scores("f", (1, True, None, 0.25), 4) == [1.0, 1.0, None, 0.25]


@pytest.mark.parametrize("kind, completion", [
    ("math", "Let me think. <answer>" + "The sum is 7, so " * 6000),    # cut off inside the answer block
    ("math", "<answer>" + "a" * 100_000 + "</answer>x"),
    ("python", "```python\n" + "x = 1\n" * 17_000),                       # cut off inside the code block
    ("rust", "```rust\n" + "a" * 100_000 + "```x"),
])
def test_format_takes_linear_time_on_long_completions(kind, completion):
    """An unclosed block was matched in quadratic time (10 s at 32 kB, minutes at 100 kB)."""
    import time
    t0 = time.perf_counter()
    assert call(format_reward, [completion], [Task(id="k", kind=kind, source="s", prompt="p", answer="7",
                                                    tests={"format": "io", "cases": []})]) == [0.0]
    assert time.perf_counter() - t0 < 1
