"""The hidden-test formats that code tasks carry in `Task.tests` (a JSON-able dict with a `format` key).

These mirror what the sandbox scores (see `sandbox/api.py`); curation only builds and checks them.

- ``python_io``:   {"format": "python_io", "cases": [{"args": [...], "expected": <json>}, ...]}
                   call ``entry_point(*args)`` and compare with ``expected`` (exact, outside the box).
- ``humaneval``:   {"format": "humaneval", "check": "<source defining check(candidate)>"}
                   HumanEval-style assert script (the sandbox rewrites it into call/expected pairs).
- ``python_script``: {"format": "python_script", "check": "<assert script run after the solution>"}
                   the whole program is solution + check; used for exercise-style tasks (pythonlings).
- ``rust_tests``:  {"format": "rust_tests", "tests": "#[cfg(test)] mod tests { ... }",
                    "clippy": bool}   hidden libtest tests appended to the completion's source.
"""
from __future__ import annotations

from typing import Any

PYTHON_FORMATS = ("python_io", "humaneval", "python_script")
RUST_FORMATS = ("rust_tests",)


def python_io(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Input/expected-output cases; each case is {"args": list, "expected": JSON value}."""
    for i, c in enumerate(cases):
        if not isinstance(c.get("args"), list) or "expected" not in c:
            raise ValueError(f"python_io case {i} needs 'args' (a list) and 'expected'; got {sorted(c)}")
    return {"format": "python_io", "cases": cases}


def humaneval(check: str) -> dict[str, Any]:
    return {"format": "humaneval", "check": check}


def python_script(check: str) -> dict[str, Any]:
    return {"format": "python_script", "check": check}


def rust_tests(tests: str, clippy: bool = False) -> dict[str, Any]:
    return {"format": "rust_tests", "tests": tests, "clippy": bool(clippy)}


def format_of(tests: dict[str, Any] | None) -> str | None:
    return (tests or {}).get("format")


def has_nonempty_tests(tests: dict[str, Any] | None) -> bool:
    """True when the tests would actually check something (not an empty case list or empty module)."""
    fmt = format_of(tests)
    if fmt == "python_io":
        return bool(tests.get("cases"))
    if fmt in ("humaneval", "python_script"):
        return "assert" in (tests.get("check") or "")
    if fmt == "rust_tests":
        src = tests.get("tests") or ""
        return "#[test]" in src and ("assert" in src or "panic" in src or "unwrap" in src or "expect" in src
                                     or "let _" in src)
    return False
