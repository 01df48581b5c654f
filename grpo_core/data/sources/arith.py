"""The default arithmetic curriculum (`grpo_core.data.arithmetic`, owned by the pipeline) as a source.

`templates` words the training questions; `eval_templates` (optional) gives each task a second wording
in `meta["eval_prompt"]`, which the build uses for the tasks that land in the eval split, so evaluation
asks in words training never saw. The split itself goes by `canonical_question`, which ignores wording.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from grpo_core.data import arithmetic
from grpo_core.data.curation import canonical_question, stable_hash
from grpo_core.data.records import Rejection
from grpo_core.task import Task


def _pick(templates: Sequence[str], salt: str, question: str) -> str:
    """One template per question, fixed by what it asks (the same in every build)."""
    return templates[stable_hash(salt, question) % len(templates)]


def _check_curriculum(n: int, min_digits: int, max_digits: int, operations: list[str]) -> None:
    """The source's options describe questions that exist, named as the curation config spells them."""
    if unknown := [op for op in operations if op not in arithmetic.OPS]:
        raise ValueError(f"arithmetic source: operations {unknown} are unknown; use some of {list(arithmetic.OPS)}")
    if not 1 <= min_digits <= max_digits <= 9:
        raise ValueError(f"arithmetic source: min_digits={min_digits}, max_digits={max_digits}; use "
                         f"1 <= min_digits <= max_digits <= 9")
    if n > (space := arithmetic.question_space(min_digits, max_digits, operations)):
        raise ValueError(f"arithmetic source: n={n} exceeds the {space} distinct questions of these digits and "
                         f"operations; lower n or widen max_digits/operations")


def load(n: int = 200, min_digits: int = 1, max_digits: int = 2, operations: list[str] | tuple[str, ...] = ("+",),
         seed: int = 0, templates: Sequence[str] = (arithmetic.DEFAULT_TEMPLATE,),
         eval_templates: Sequence[str] | None = None, **_: Any) -> Iterable[Task | Rejection]:
    templates = [arithmetic.check_template(t) for t in templates]
    eval_templates = [arithmetic.check_template(t) for t in eval_templates or ()]
    if set(templates) & set(eval_templates):
        raise ValueError(f"arithmetic: eval_templates {sorted(set(templates) & set(eval_templates))} are also "
                         "training templates; eval wordings must be ones training never uses")
    _check_curriculum(n, min_digits, max_digits, list(operations))
    tasks = arithmetic.train_tasks(n, min_digits, max_digits, list(operations), seed=seed)
    for t in tasks:
        a, op, b = t.meta["a"], t.meta["op"], t.meta["b"]
        key = canonical_question(t.prompt)
        t.prompt = _pick(templates, "train", key).format(a=a, op=op, b=b)
        if eval_templates:
            t.meta["eval_prompt"] = _pick(eval_templates, "eval", key).format(a=a, op=op, b=b)
    return tasks
