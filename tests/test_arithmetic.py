import pytest

from grpo_core.data import arithmetic
from grpo_core.data.curation import canonical_question


def _operands(t):
    a, op, b = t.prompt.removeprefix("What is ").rstrip("?").split(" ")
    return int(a), op, int(b)


def test_eval_and_train_are_disjoint_by_content_and_deterministic():
    ev = arithmetic.eval_tasks(40, 1, 1, ["+", "-"])
    assert len({canonical_question(t.prompt) for t in ev}) == 40
    assert [t.id for t in ev] == [t.id for t in arithmetic.eval_tasks(40, 1, 1, ["+", "-"])]
    # eval questions and their commuted twins: b + a asks what a + b asks
    held_out = {(a, op, b) for a, op, b in map(_operands, ev)}
    held_out |= {(b, op, a) for a, op, b in held_out if op == "+"}
    for it in range(30):
        tr = arithmetic.train_tasks(8, 1, 1, ["+", "-"], seed=it, exclude=ev)
        assert len(tr) == 8 and not held_out & set(map(_operands, tr))
    assert [t.id for t in arithmetic.train_tasks(8, 1, 1, ["+", "-"], 3, ev)] == \
           [t.id for t in arithmetic.train_tasks(8, 1, 1, ["+", "-"], 3, ev)]


def test_subtraction_is_not_commuted():
    ev = [arithmetic.make_task(7, "-", 3, 1, "eval")]
    seen = {_operands(t) for s in range(60) for t in arithmetic.train_tasks(8, 1, 1, ["-"], s, ev)}
    assert (3, "-", 7) in seen and (7, "-", 3) not in seen


def test_answers_are_right_and_levels_respected():
    for t in arithmetic.train_tasks(50, 2, 3, ["+", "-", "*"], seed=1):
        a, op, b = _operands(t)
        assert str(arithmetic.OPS[op](a, b)) == t.answer
        assert 2 <= len(str(a)) <= 3 and t.kind == "math" and t.validate()


def test_too_large_requests_fail_clearly():
    # 1-digit addition has 55 distinct questions once a + b and b + a count once
    with pytest.raises(ValueError, match="eval_size"):
        arithmetic.eval_tasks(28, 1, 1, ["+"])
    ev = arithmetic.eval_tasks(27, 1, 1, ["+"])
    assert len(arithmetic.train_tasks(28, 1, 1, ["+"], seed=0, exclude=ev)) == 28
    with pytest.raises(ValueError, match="prompts_per_iteration"):
        arithmetic.train_tasks(29, 1, 1, ["+"], seed=0, exclude=ev)


def test_default_curriculum_holds_out_40_questions_by_content():
    """The default run (1-digit + and -: 155 questions by content) evaluates on 40 that no training
    iteration asks, in any order of the operands."""
    from grpo_core.config import GRPOConfig
    d = GRPOConfig().data
    assert (d.min_digits, d.max_digits, sorted(d.operations), d.eval_size) == (1, 1, ["+", "-"], 40)
    ev = arithmetic.eval_tasks(d.eval_size, d.min_digits, d.max_digits, d.operations)
    held_out = {canonical_question(t.prompt) for t in ev}
    seen = set()
    for it in range(1, 101):
        tr = arithmetic.train_tasks(d.prompts_per_iteration, d.min_digits, d.max_digits, d.operations, seed=it, exclude=ev)
        seen |= {canonical_question(t.prompt) for t in tr}
    assert not seen & held_out and len(seen) > 100
