"""The task: one schema for every training or evaluation item, whatever its source.

A task is a small JSON-able record. Stages exchange tasks as JSONL files (one record a line).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from grpo_core.io import InputError, numbered_jsonl, write_jsonl

KINDS = ("math", "python", "rust")


class TaskValidationError(InputError):
    """A task record is malformed; the message names the field and the fix."""


@dataclass
class Task:
    id: str                      # stable, unique id (e.g. "arith-2d-+-000123" or "humaneval/HumanEval_0")
    kind: str                    # "math" | "python" | "rust"
    source: str                  # generator or dataset name, e.g. "arithmetic", "humaneval", "gsm_symbolic"
    prompt: str                  # the question shown to the model (user turn, no chat template applied)
    answer: str | None = None    # gold final answer for math tasks (compared after normalisation)
    tests: dict[str, Any] | None = None   # hidden tests for code tasks (never shown to the model)
    entry_point: str | None = None        # function name for code tasks
    reference_solution: str | None = None
    difficulty: float | None = None       # generator level or measured 1 - pass rate, in [0, 1] when known
    license: str = "unknown"
    provenance: str = ""                  # where the item came from (package, file, generator + seed)
    meta: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "Task":
        if not self.id or not isinstance(self.id, str):
            raise TaskValidationError("task field 'id' must be a non-empty string")
        if self.kind not in KINDS:
            raise TaskValidationError(
                f"task {self.id!r}: field 'kind' is {self.kind!r}; use one of {', '.join(KINDS)}")
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise TaskValidationError(f"task {self.id!r}: field 'prompt' must be a non-empty string")
        if self.kind == "math" and (self.answer is None or not str(self.answer).strip()):
            raise TaskValidationError(f"task {self.id!r}: math tasks need a non-empty 'answer'")
        if self.kind in ("python", "rust") and not self.tests:
            raise TaskValidationError(f"task {self.id!r}: {self.kind} tasks need hidden 'tests'")
        self._check_types()
        return self

    def _check_types(self) -> None:
        """The structured fields hold what readers of a task expect: objects, and a finite difficulty."""
        for name in ("tests", "meta"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise TaskValidationError(f"task {self.id!r}: field {name!r} must be a JSON object "
                                          f"({{\"key\": value, ...}}), got {type(value).__name__}")
        d = self.difficulty
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d)):
            raise TaskValidationError(f"task {self.id!r}: field 'difficulty' must be a finite number or null, "
                                      f"got {d!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "Task":
        if not isinstance(row, dict):
            raise TaskValidationError(f"a task row must be a JSON object, got {type(row).__name__}")
        unknown = set(row) - set(cls.__dataclass_fields__)
        if unknown:
            raise TaskValidationError(
                f"task row {row.get('id', '?')!r} has unknown field(s) {sorted(unknown)}; "
                f"allowed: {sorted(cls.__dataclass_fields__)}")
        missing = [k for k in ("id", "kind", "source", "prompt") if k not in row]
        if missing:
            raise TaskValidationError(f"task row {row.get('id', '?')!r} lacks required field(s) {missing}")
        return cls(**row).validate()

    def content_hash(self) -> str:
        """Hash of what defines the task (not its id or provenance): stable across runs and machines."""
        core = {"kind": self.kind, "prompt": self.prompt, "answer": self.answer, "tests": self.tests,
                "entry_point": self.entry_point}
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()

    def sandbox_tests(self) -> dict[str, Any]:
        """The tests as the sandbox gets them (scoring and reference checks alike): a Rust task's with its entry
        point's signature pinned (``signature``: its header in the reference solution) unless they state one."""
        tests = dict(self.tests or {})
        if self.kind == "rust" and "signature" not in tests and (
                signature := rust_signature(self.reference_solution, self.entry_point)):
            tests["signature"] = signature
        return tests


VERIFIERS_TASK = "verifiers_task"   # meta key: a verifiers task's own row (grpo_core.data.sources.verifiers_tasks)


def write_tasks(path: str | os.PathLike, tasks: Iterable[Task]) -> Path:
    return write_jsonl(path, (t.to_dict() for t in tasks))


def read_tasks(path: str | os.PathLike) -> list[Task]:
    """The tasks of a JSONL file; a TaskValidationError names the file, the line and the field."""
    try:
        return [_task_at(path, lineno, row) for lineno, row in numbered_jsonl(path)]
    except TaskValidationError:
        raise
    except InputError as e:
        raise TaskValidationError(str(e)) from e


def _task_at(path: str | os.PathLike, lineno: int, row: dict[str, Any]) -> Task:
    try:
        return Task.from_dict(row)
    except TaskValidationError as e:
        raise TaskValidationError(f"{path}:{lineno}: {e}; fix or remove the line") from None


_STD_USE_RE = re.compile(r"^use\s+(?:::)?(?:std|core|alloc)\b[^;]*;", re.M)


def rust_signature(reference: str | None, entry_point: str | None) -> str | None:
    """The header of `entry_point` in a Rust reference solution (``pub fn f(a: i32) -> Option<i32>``), after the
    reference's top-level std ``use`` lines its types may need; None when the reference does not define it."""
    if not reference or not entry_point:
        return None
    m = re.search(rf"^[ \t]*(?:pub(?:\([^)]*\))?\s+)?fn\s+{re.escape(entry_point)}\s*[<(]", reference, re.M)
    if not m:
        return None
    depth, i = 0, m.end() - 1
    while i < len(reference):                   # to the `{` of the body, outside the parameters' brackets
        c = reference[i]
        if c in "([<" and reference[i - 1] != "-":
            depth += 1
        elif c in ")]>" and reference[i - 1] != "-":
            depth -= 1
        elif c in "{;" and depth == 0:
            break
        i += 1
    uses = _STD_USE_RE.findall(reference[:m.start()])
    return "\n".join([*uses, " ".join(reference[m.start():i].split())])
