import pytest

from grpo_core.task import Task
from grpo_core.rewards import compute_rewards, format_reward
from grpo_core.answers import extract_answer, math_answers_match

T = Task(id="t", kind="math", source="arithmetic", prompt="What is 2 + 3?", answer="5")


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
])
def test_format_reward(completion, fmt):
    assert format_reward([completion], [T]) == [fmt]


@pytest.mark.parametrize("pred, gold, ok", [
    ("5", "5", True), (" 5. ", "5", True), ("5.0", "5", True), ("1,000", "1000", True), ("$12", "12", True),
    ("-3", "-3", True), ("1/2", "0.5", True), ("6", "5", False), ("", "5", False), (None, "5", False),
    ("five", "5", False), ("Paris", "paris", True),
])
def test_math_answers_match(pred, gold, ok):
    assert math_answers_match(pred, gold) is ok


def test_accuracy_needs_single_answer_block():
    assert extract_answer("<answer>5</answer><answer>5</answer>") is None
    totals, per = compute_rewards(["<answer>5</answer>", "<answer>4</answer>", "5"], [T] * 3,
                                  ["accuracy", "format"], [1.0, 0.5])
    assert per["accuracy"] == [1.0, 0.0, 0.0]
    assert per["format"] == [1.0, 1.0, 0.0]
    assert totals == [1.5, 0.5, 0.0]


def test_format_reward_follows_the_task_kind():
    py = Task(id="p", kind="python", source="s", prompt="write f", tests={"format": "io", "cases": []})
    rs = Task(id="r", kind="rust", source="s", prompt="write f", tests={"format": "rust", "tests": "x"})
    assert format_reward(["Here:\n```python\ndef f():\n    return 1\n```"], [py]) == [1.0]
    assert format_reward(["```python\n\n```"], [py]) == [0.0]                      # empty block
    assert format_reward(["```python\na=1\n```\n```python\nb=2\n```"], [py]) == [0.0]   # two blocks
    assert format_reward(["```rust\nfn f() {}\n```"], [py]) == [0.0]               # wrong language
    assert format_reward(["```rust\npub fn f() -> i32 { 1 }\n```\n"], [rs]) == [1.0]
    assert format_reward(["<answer>5</answer>"], [rs]) == [0.0]
