"""pythonlings (`pythonlings==0.4.4`, MIT): 292 small Python exercises ("fix the ???") with check scripts.

Task: the exercise file is the prompt; the package's reference answer is the reference solution; the
exercise's check script becomes the hidden test. The sandbox scores function calls (format `assert`,
`check(candidate)`), so a check is converted when its asserts call exactly one function the answer
defines; checks that read module-level state (variables, classes, several functions) are rejected as
not automatically verifiable by the sandbox (`keep_scripts=True` keeps them in the curation-only
`python_script` format instead).
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task

INSTRUCTION = ("The Python exercise below is incomplete or wrong (look for ??? placeholders and the goal in "
               "its comments). Fix it. Reply with the complete corrected file in one ```python code block.")


def _root() -> Path:
    import pythonlings  # optional dependency (extra "data")
    return Path(pythonlings.__file__).parent / "curriculum"


def _answers() -> dict[str, str]:
    import pythonlings.curriculum.solutions._answers as answers_mod  # noqa: PLC0415
    return dict(answers_mod.ANSWERS)


def check_to_assert(check_src: str, answer_src: str) -> tuple[str, str] | None:
    """(check(candidate) source, entry point) when every assert calls one answer-defined function."""
    try:
        check, answer = ast.parse(check_src), ast.parse(answer_src)
    except SyntaxError:
        return None
    functions = {n.name for n in answer.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    other_names = {t.id for n in answer.body if isinstance(n, (ast.Assign, ast.AnnAssign, ast.ClassDef))
                   for t in ast.walk(n) if isinstance(t, ast.Name)} | \
                  {n.name for n in answer.body if isinstance(n, ast.ClassDef)}
    if any(isinstance(n, ast.AsyncFunctionDef) for n in answer.body):
        return None
    called = {c.func.id for c in ast.walk(check) if isinstance(c, ast.Call) and getattr(c.func, "id", None) in functions}
    if len(called) != 1:
        return None
    entry = called.pop()
    kept: list[str] = []
    for node in check.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            kept.append(ast.unparse(node))
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) == "print":
            continue
        if not isinstance(node, ast.Assert):
            return None
        names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == entry]
        uses = [n for n in names if n.id == entry]
        if any(n.id in (other_names | functions) - {entry} for n in names):
            return None
        if not calls or len(uses) != len(calls):
            continue  # e.g. `assert callable(f)`: not a call/expected pair; drop this assert
        if any(isinstance(a, ast.Call) and getattr(a.func, "id", None) == entry
               for c in calls for arg in c.args for a in ast.walk(arg)):
            return None  # nested candidate calls cannot be rewritten into pairs
        kept.append(ast.unparse(node).replace(f"{entry}(", "candidate("))
    asserts = [k for k in kept if k.startswith("assert")]
    if not asserts:
        return None
    imports = [k for k in kept if not k.startswith("assert")]
    body = "\n".join("    " + k for k in asserts)
    return "\n".join(imports + [f"def check(candidate):\n{body}\n"]), entry


def load(limit: int | None = None, keep_scripts: bool = False, **_: Any) -> Iterable[Task | Rejection]:
    root = _root()
    info = tomllib.loads((root / "info.toml").read_text(encoding="utf-8"))
    answers = _answers()
    for n, ex in enumerate(info["exercises"]):
        if limit is not None and n >= limit:
            break
        name = ex["name"]
        tid = f"pythonlings/{name}"
        rel = Path(ex["path"]).relative_to("exercises")
        exercise = (root / "exercises" / rel).read_text(encoding="utf-8")
        check_path = root / "checks" / rel
        if not check_path.is_file():
            yield Rejection(tid, "pythonlings", "empty_tests", f"no check file {rel}")
            continue
        if name not in answers:
            yield Rejection(tid, "pythonlings", "reference_missing", f"no answer for {name}")
            continue
        exercise = "\n".join(l for l in exercise.splitlines() if "I AM NOT DONE" not in l) + "\n"
        check_src = check_path.read_text(encoding="utf-8")
        converted = check_to_assert(check_src, answers[name])
        if converted is None and not keep_scripts:
            yield Rejection(tid, "pythonlings", "not_verifiable",
                            "the check reads module-level state, not one function's return values; "
                            "the sandbox scores function calls only")
            continue
        tests, entry = (formats.humaneval(converted[0]), converted[1]) if converted else \
            (formats.python_script(check_src), None)
        yield Task(id=tid, kind="python", source="pythonlings",
                   prompt=f"{INSTRUCTION}\n\n```python\n{exercise}```",
                   tests=tests, entry_point=entry,
                   reference_solution=answers[name], license="MIT",
                   provenance=f"pythonlings==0.4.4 {ex['path']}",
                   meta={"topic": rel.parts[0], "hint": ex.get("hint", "")})
