import pytest

from grpo_core.data import arithmetic


def test_eval_and_train_are_disjoint_and_deterministic():
    ev = arithmetic.eval_tasks(40, 1, 1, ["+"])
    assert len({t.id for t in ev}) == 40
    assert [t.id for t in ev] == [t.id for t in arithmetic.eval_tasks(40, 1, 1, ["+"])]
    exclude = {t.id for t in ev}
    for it in range(5):
        tr = arithmetic.train_tasks(8, 1, 1, ["+"], seed=it, exclude=exclude)
        assert len(tr) == 8 and not exclude & {t.id for t in tr}
    assert [t.id for t in arithmetic.train_tasks(8, 1, 1, ["+"], 3, exclude)] == \
           [t.id for t in arithmetic.train_tasks(8, 1, 1, ["+"], 3, exclude)]


def test_answers_are_right_and_levels_respected():
    for t in arithmetic.train_tasks(50, 2, 3, ["+", "-", "*"], seed=1, exclude=set()):
        a, op, b = t.prompt.removeprefix("What is ").rstrip("?").split(" ")
        assert str(arithmetic.OPS[op](int(a), int(b))) == t.answer
        assert 2 <= len(a) <= 3 and t.kind == "math" and t.validate()


def test_too_large_requests_fail_clearly():
    with pytest.raises(ValueError, match="eval_size"):
        arithmetic.eval_tasks(80, 1, 1, ["+"])
    ev = {t.id for t in arithmetic.eval_tasks(50, 1, 1, ["+"])}
    with pytest.raises(ValueError, match="prompts_per_iteration"):
        arithmetic.train_tasks(51, 1, 1, ["+"], seed=0, exclude=ev)
