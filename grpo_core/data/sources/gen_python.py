"""Generated Python function tasks with input/output tests (format `io`)."""
from __future__ import annotations

from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task
from grpo_core.data.sources.gen_templates import TEMPLATES, instance, python_reference


def _example_first(name, p, inputs, outputs):
    """Put the most informative case (longest input) first: it is shown as the example, not tested."""
    i = max(range(len(inputs)), key=lambda j: (len(repr(inputs[j])), -j))
    order = [i] + [j for j in range(len(inputs)) if j != i]
    return name, p, [inputs[j] for j in order], [outputs[j] for j in order]


def load(n: int = 60, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3), n_cases: int = 8,
         **_: Any) -> Iterable[Task | Rejection]:
    """`n` tasks cycling over templates and levels; same (n, seed) gives the same tasks."""
    for i in range(n):
        t = TEMPLATES[i % len(TEMPLATES)]
        level = levels[(i // len(TEMPLATES)) % len(levels)]
        name, p, inputs, outputs = _example_first(*instance(t, seed * 100_000 + i, level, n_cases))
        sig = t.py_sig.format(name=name)
        prompt = (f"Write a Python function `{sig}` that {t.describe(p)}.\n"
                  f"For example, `{name}({', '.join(map(repr, inputs[0]))})` returns `{outputs[0]!r}`.\n"
                  "Reply with the function in one ```python code block.")
        yield Task(id=f"gen_python/{t.name}/s{seed}/{i}", kind="python", source="gen_python", prompt=prompt,
                   tests=formats.python_io([{"args": a, "expected": o} for a, o in zip(inputs[1:], outputs[1:])]),
                   entry_point=name, reference_solution=python_reference(t, name, p),
                   difficulty=round(level / 3, 3), license="Apache-2.0",
                   provenance=f"grpo_core.data.sources.gen_python template={t.name} seed={seed} index={i}",
                   meta={"template": t.name, "level": level, "params": p})
