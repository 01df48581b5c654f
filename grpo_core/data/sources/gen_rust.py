"""Generated Rust function tasks with reference libtest tests (format `rust`)."""
from __future__ import annotations

from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task
from grpo_core.data.sources.gen_templates import TEMPLATES, instance, rust_reference


def rust_literal(value: Any, typ: str) -> str:
    """A Rust expression for a Python argument of the given template type."""
    if typ == "ints":
        return "&[" + ", ".join(f"{v}i64" if i == 0 else str(v) for i, v in enumerate(value)) + "][..]" \
            if value else "&[][..] as &[i64]"
    if typ == "int":
        return f"{value}i64"
    if typ == "str":
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise ValueError(f"unknown argument type {typ!r}")


def rust_expected(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value}i64"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "vec![" + ", ".join(f"{v}i64" for v in value) + "] as Vec<i64>"
    raise ValueError(f"cannot express {value!r} in Rust")


def test_module(name: str, arg_types: tuple[str, ...], inputs: list[list], outputs: list) -> str:
    lines = []
    for args, out in zip(inputs, outputs):
        call = f"{name}({', '.join(rust_literal(a, t) for a, t in zip(args, arg_types))})"
        lines.append(f"        assert_eq!({call}, {rust_expected(out)});")
    return "#[test]\nfn hidden_cases() {\n" + "\n".join(l[4:] for l in lines) + "\n}\n"


def _example_first(name, p, inputs, outputs):
    """Put the most informative case (longest input) first: it is shown as the example, not tested."""
    i = max(range(len(inputs)), key=lambda j: (len(repr(inputs[j])), -j))
    order = [i] + [j for j in range(len(inputs)) if j != i]
    return name, p, [inputs[j] for j in order], [outputs[j] for j in order]


def load(n: int = 40, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3), n_cases: int = 8,
         **_: Any) -> Iterable[Task | Rejection]:
    for i in range(n):
        t = TEMPLATES[i % len(TEMPLATES)]
        level = levels[(i // len(TEMPLATES)) % len(levels)]
        name, p, inputs, outputs = _example_first(*instance(t, seed * 100_000 + i + 50_000, level, n_cases))
        sig = t.rs_sig.format(name=name)
        example = f"{name}({', '.join(rust_literal(a, ty) for a, ty in zip(inputs[0], t.arg_types))})"
        prompt = (f"Write a Rust function `pub {sig}` that {t.describe(p)}.\n"
                  f"For example, `{example}` returns `{rust_expected(outputs[0])}`.\n"
                  "Use only the standard library. Reply with the function in one ```rust code block.")
        yield Task(id=f"gen_rust/{t.name}/s{seed}/{i}", kind="rust", source="gen_rust", prompt=prompt,
                   tests=formats.rust_tests(test_module(name, t.arg_types, inputs[1:], outputs[1:])),
                   entry_point=name, reference_solution=rust_reference(t, name, p),
                   difficulty=round(level / 3, 3), license="Apache-2.0",
                   provenance=f"grpo_core.data.sources.gen_rust template={t.name} seed={seed} index={i}",
                   meta={"template": t.name, "level": level, "params": p})
