"""pythonlings (`pythonlings==0.4.4`, MIT): 292 small Python exercises ("fix the ???") with check scripts.

Task: the exercise file is the prompt; the hidden test is the exercise's check script, run after the
model's file (format `python_script`); the package's reference answer is the reference solution.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.data.schema import Task

INSTRUCTION = ("The Python exercise below is incomplete or wrong (look for ??? placeholders and the goal in "
               "its comments). Fix it. Reply with the complete corrected file in one ```python code block.")


def _root() -> Path:
    import pythonlings  # optional dependency (extra "data")
    return Path(pythonlings.__file__).parent / "curriculum"


def _answers() -> dict[str, str]:
    import pythonlings.curriculum.solutions._answers as answers_mod  # noqa: PLC0415
    return dict(answers_mod.ANSWERS)


def load(limit: int | None = None, **_: Any) -> Iterable[Task | Rejection]:
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
        yield Task(id=tid, kind="python", source="pythonlings",
                   prompt=f"{INSTRUCTION}\n\n```python\n{exercise}```",
                   tests=formats.python_script(check_path.read_text(encoding="utf-8")),
                   reference_solution=answers[name], license="MIT",
                   provenance=f"pythonlings==0.4.4 {ex['path']}",
                   meta={"topic": rel.parts[0], "hint": ex.get("hint", "")})
