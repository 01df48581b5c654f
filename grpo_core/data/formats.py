"""The hidden-test formats that code tasks carry in `Task.tests` (a JSON-able dict with a `format` key).

These mirror what the sandbox scores (see `sandbox/api.py`); curation only builds and checks them.

- ``io``:      {"format": "io", "cases": [{"args": [...], "expected": <json>}, ...]}
              call ``entry_point(*args)`` and compare with ``expected`` (exact types, on the host).
- ``assert``:  {"format": "assert", "check": "<source defining check(candidate)>"}
              HumanEval-style assert script (the sandbox rewrites it into call/expected pairs).
- ``rust``:    {"format": "rust", "tests": "#[test]\nfn t() { assert_eq!(f(1), 2); }"}
              top-level ``#[test]`` fns compiled in a separate crate that does ``use solution::*``,
              so the items they use must be ``pub`` in the completion. At scoring (and reference
              checking) ``Task.sandbox_tests`` adds ``"signature"``, the entry point's header from the
              reference solution: the completion's function must return that type.
- ``python_script`` (curation only, the sandbox does not score it): {"check": "<assert script>"}
              run after the solution; used to validate exercise references before conversion.
"""
from __future__ import annotations

import re
import textwrap
from typing import Any

PYTHON_FORMATS = ("io", "assert", "python_script")
RUST_FORMATS = ("rust",)


def python_io(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Input/expected-output cases; each case is {"args": list, "expected": JSON value}."""
    for i, c in enumerate(cases):
        if not isinstance(c.get("args"), list) or "expected" not in c:
            raise ValueError(f"io case {i} needs 'args' (a list) and 'expected'; got {sorted(c)}")
    return {"format": "io", "cases": cases}


def humaneval(check: str) -> dict[str, Any]:
    return {"format": "assert", "check": check}


def python_script(check: str) -> dict[str, Any]:
    return {"format": "python_script", "check": check}


def rust_tests(tests: str) -> dict[str, Any]:
    return {"format": "rust", "tests": tests}


def format_of(tests: dict[str, Any] | None) -> str | None:
    return (tests or {}).get("format")


def has_nonempty_tests(tests: dict[str, Any] | None) -> bool:
    """True when the tests would actually check something (not an empty case list or empty module)."""
    fmt = format_of(tests)
    if fmt == "io":
        return bool(tests.get("cases"))
    if fmt in ("assert", "python_script"):
        return "assert" in (tests.get("check") or "")
    if fmt == "rust":
        src = tests.get("tests") or ""
        return "#[test]" in src and ("assert" in src or "panic" in src or "unwrap" in src or "expect" in src
                                     or "let _" in src)
    return False


_TOP_ITEM_RE = re.compile(r"^(?:(const|async|unsafe|extern)\s+)*(fn|struct|enum|trait|type|const|static|mod)\s", re.M)


def make_pub(source: str) -> str:
    """Prefix unindented, non-pub item declarations with `pub` (tests live in another crate)."""
    return _TOP_ITEM_RE.sub(lambda m: "pub " + m.group(0), source)


def unwrap_test_module(src: str) -> str:
    """`#[cfg(test)] mod tests { use super::*; ... }` -> its body, dedented (top-level #[test] fns)."""
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{(.*)\}\s*$", src, re.S)
    if not m:
        return src
    body = re.sub(r"^\s*use\s+super::\*;\s*$", "", m.group(1), flags=re.M)
    return textwrap.dedent(body).strip() + "\n"
