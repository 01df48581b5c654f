"""Host side of Rust jobs: the harness-owned crate and the judging of test results.

The crate is ``solution`` (lib, the completion's source only) + ``harness`` (bin, generated),
compiled by calling ``rustc`` / ``clippy-driver`` directly with fixed flags. The harness owns the
whole build: there is no ``Cargo.toml`` the completion could influence, so no build script, no
dependencies, no proc macros and no ``.cargo/config``; nothing is fetched (offline by
construction). Calling rustc directly is also faster than three cargo runs (docs/speed.md).

* ``lib.rs`` = ``#![forbid(unsafe_code)]`` + the completion (on its first line, so the compiler's line
  numbers are the completion's own). ``forbid`` cannot be lifted by
  the completion's own ``#![allow(unsafe_code)]``; clippy runs with ``-F clippy::all -F
  forbidden_lint_groups`` so ``#![allow(clippy::all)]`` cannot silence the lint gate either.
* ``main.rs`` holds the hidden ``#[test]`` functions turned into plain ``pub fn``s, with std's
  assert macros imported explicitly (a glob-imported ``#[macro_export] macro_rules! assert_eq``
  from the completion cannot shadow them), and a ``main`` that runs each test under
  ``catch_unwind`` and prints ``<nonce> <name> ok|FAILED``. The nonce is generated in the box
  per run and given on stdin; libtest's exit code and summary are never used. Every test must
  report; missing tests count as failed.
* ``main.rs`` is written only after the library has been built and linted, and the whole build
  tree is deleted before the binary runs, so the completion cannot ``include_str!`` the tests.
* ``tests['signature']`` (optional): the entry point's header as the task states it (``pub fn f(a: i32)
  -> Option<i32>``, after any ``use`` lines its types need). ``main.rs`` then requires the completion's
  ``f`` to take as many arguments and return that type (``let _: fn(_) -> Option<i32> = f;``): a type of
  the completion's own standing in for the answer (its inherent ``is_some`` always true) does not compile.

Not defended: a completion that deliberately reads its own process memory (``/proc/self/mem``)
to find the nonce could forge its Rust test lines (Python is immune: outputs are compared on
the host).
"""
from __future__ import annotations

import re
from typing import Any

from sandbox.types import StageResult, TaskFormatError, TestResult

LIB_HEADER = "#![forbid(unsafe_code)] "   # on the code's first line: compiler line numbers stay the code's own

STD_MACROS = ("assert", "assert_eq", "assert_ne", "debug_assert", "debug_assert_eq",
              "debug_assert_ne", "panic", "vec", "format", "print", "println", "eprint",
              "eprintln", "matches", "unreachable", "unimplemented", "todo", "write", "writeln")

# The hidden tests see the completion through `use solution::*`; a glob import shadows the prelude, so
# these are imported by name (explicit imports beat globs): `Some(2)` or `String::from(..)` in a test
# always mean std's, whatever the completion exports.
PRELUDE = ("Copy", "Send", "Sized", "Sync", "Unpin", "Drop", "Fn", "FnMut", "FnOnce", "drop", "Box",
           "ToOwned", "Clone", "PartialEq", "PartialOrd", "Eq", "Ord", "AsRef", "AsMut", "Into", "From",
           "Default", "Iterator", "Extend", "IntoIterator", "DoubleEndedIterator", "ExactSizeIterator",
           "Option", "Some", "None", "Result", "Ok", "Err", "String", "ToString", "Vec", "TryFrom",
           "TryInto", "FromIterator", "Debug", "Hash")
PRIMITIVES = ("bool", "char", "f32", "f64", "i8", "i16", "i32", "i64", "i128", "isize", "str", "u8",
              "u16", "u32", "u64", "u128", "usize")

# A completion's own comparison/operator impls against *another* type make `assert_eq!(f(1), 3)`,
# `assert!(f(1) == 3)`, `assert!(f(1))` or `assert!((f(1) - 2.0).abs() < 1e-9)` hold for a value that
# is not the answer (Rust's always-equal object). Impls for Self (what `#[derive]` makes) stay allowed.
_OPS = r"(?:PartialEq|PartialOrd|Add|Sub|Mul|Div|Rem|BitAnd|BitOr|BitXor|Shl|Shr)"
_FAKE_CMP = (
    # the trait of an impl block (after its own generics: `impl<T: PartialOrd<T>> PartialEq<Self>` is fine, as
    # are bounds such as `T: Add<T, Output = T>` and an argument's `impl PartialEq<i32>`)
    (re.compile(r"(?:^|[;{}\]])\s*(?:unsafe\s+)?impl\b(?:\s*<[^{};]*?>)?\s*(?:[\w:#]*::)?\s*(?:r#)?" + _OPS
                + r"\s*(?:::\s*)?<(?!\s*(?:Output\b|Self\s*>))"), "against another type"),
    (re.compile(r"\b(?:r#)?(?:" + _OPS[3:-1] + r"|Not|Neg)\s+as\b"), "renamed"),
    (re.compile(r"\bNot\s+for\b"), "for `!`"),
)
_WORDS = re.compile(r"\b(?:" + _OPS[3:-1] + r"|Not|Neg)\b")


def fake_comparison(code: str) -> str | None:
    """Why ``code`` may not be judged by the hidden tests (it implements comparison or operator traits
    against other types), or None. Comments and string literals do not count."""
    out, i = [], 0
    while i < len(code):
        j = _skip_literal(code, i)
        if j != i:
            out.append(" ")
            i = j
        else:
            out.append(code[i])
            i += 1
    bare = "".join(out)
    for pattern, what in _FAKE_CMP:
        m = pattern.search(bare)
        if m:
            return f"comparison/operator trait impl {what} (`{m.group(0).strip()}`): not allowed in solutions"
    if "macro_rules" in bare and _WORDS.search(bare):
        return "macro_rules! together with comparison/operator traits: not allowed in solutions"
    return None


_TEST_ATTR = re.compile(r"#\s*\[\s*test\s*\]")
_ATTR = re.compile(r"\s*#\s*\[\s*([A-Za-z_]+)[^\]]*\]")
_FN = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(\s*\)\s*(->\s*[^{]+)?\{")
_MOD = re.compile(r"(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*\{")


def validate_tests(tests: Any) -> list[tuple[str, bool]]:
    """Check a rust ``tests`` dict; return [(path, should_panic)] of its test fns."""
    if not isinstance(tests, dict) or tests.get("format") != "rust":
        raise TaskFormatError("rust tasks need tests = {'format': 'rust', 'tests': '<#[test] fns>'}")
    src = tests.get("tests")
    if not isinstance(src, str) or not src.strip():
        raise TaskFormatError("tests['tests'] must be Rust source with #[test] functions")
    _, found = _transform(src)
    if not found:
        raise TaskFormatError("tests['tests'] has no `#[test] fn name() {` functions; add some")
    signature_pin(tests.get("signature"))
    return found


_USE = re.compile(r"\s*use\s+[^;{}]*(?:\{[^;]*\})?[^;]*;")
_HEADER = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+|async\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)\s*([<(])")


def signature_pin(signature: Any) -> str:
    """The module `main.rs` adds for ``tests['signature']``: the completion's entry point must take as many
    arguments and return the stated type. "" when there is none to pin, or it cannot be written as a fn
    pointer (generics or ``impl Trait``, a method, a returned reference or lifetime, no return type)."""
    if signature is None:
        return ""
    if not isinstance(signature, str) or not signature.strip():
        raise TaskFormatError("tests['signature'] must be the entry point's header, e.g. "
                              "'pub fn f(a: i32) -> Option<i32>'")
    uses, i = [], 0
    while (u := _USE.match(signature, i)):
        uses.append(u.group(0).strip())
        i = u.end()
    head = _HEADER.match(signature, i)
    if not head:
        raise TaskFormatError(f"tests['signature'] {signature[i:i + 80]!r} is not a `fn name(...) -> Type` header")
    name = head.group(1)
    if head.group(2) == "<":                    # generic: its types cannot be named outside it
        return ""
    depth, j, arity, any_param = 1, head.end(), 0, False
    while j < len(signature) and depth:
        c = signature[j]
        if c in "([{<" and not (c == "<" and signature[j - 1] == "-"):
            depth += 1
        elif c in ")]}>" and not (c == ">" and signature[j - 1] == "-"):
            depth -= 1
        elif c == "," and depth == 1:
            arity += 1
        if depth and not c.isspace() and not (c == "," and depth == 1):
            any_param = True
        j += 1
    if depth:
        raise TaskFormatError(f"tests['signature'] {signature!r}: unbalanced parentheses")
    params = signature[head.end():j - 1]
    arity += 1 if any_param and not params.rstrip().endswith(",") else 0
    ret = re.match(r"\s*->\s*(.+?)\s*(?:\bwhere\b.*)?\{?\s*$", signature[j:], re.S)
    if not ret or re.search(r"&|'|\bimpl\b|\bSelf\b", ret.group(1)) or re.search(r"\bimpl\b|\bself\b", params):
        return ""
    holes = ", ".join(["_"] * arity)
    return ("pub mod __signature {\n    #![allow(unused_imports, dead_code, clippy::all)]\n    use super::*;\n"
            + "".join(f"    {u}\n" for u in uses)
            + f"    pub fn pin() {{ let _: fn({holes}) -> {ret.group(1)} = super::{name}; }}\n}}\n")


def _transform(src: str) -> tuple[str, list[tuple[str, bool]]]:
    """Turn #[test] fns into pub fns (recording module paths), make mods pub, drop cfg(test)."""
    src = re.sub(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", "", src)
    out, found, i, depth = [], [], 0, 0
    mods: list[tuple[str, int]] = []          # (name, depth inside its braces)
    n = len(src)
    while i < n:
        j = _skip_literal(src, i)
        if j != i:
            out.append(src[i:j]); i = j; continue
        m = _TEST_ATTR.match(src, i)
        if m:
            j, should_panic = m.end(), False
            while True:
                a = _ATTR.match(src, j)
                if not a:
                    break
                should_panic |= a.group(1) == "should_panic"
                j = a.end()
            f = _FN.match(src, j)
            if not f:
                raise TaskFormatError("tests['tests']: a #[test] must be followed by `fn name() {` "
                                      "(optionally `-> Result<..>`)")
            path = "::".join([m_[0] for m_ in mods] + [f.group(1)])
            found.append((path, should_panic))
            ret = f.group(2) or ""
            out.append(f"pub fn {f.group(1)}() {ret}{{")
            depth += 1
            i = f.end(); continue
        mm = _MOD.match(src, i)
        if mm and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            out.append(f"pub mod {mm.group(1)} {{ #[allow(unused_imports)] use super::*;")
            depth += 1
            mods.append((mm.group(1), depth))
            i = mm.end(); continue
        c = src[i]
        if c == "{":
            depth += 1
        elif c == "}":
            if mods and mods[-1][1] == depth:
                mods.pop()
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out), found


def _skip_string(src: str, i: int) -> int:
    j = i + 1
    while j < len(src):
        if src[j] == "\\":
            j += 2
            continue
        if src[j] == '"':
            return j + 1
        j += 1
    return j


_RAW_STRING = re.compile(r'b?r(#*)"')
_CHAR = re.compile(r"'(?:[^\\'\n]|\\(?:[nrt0\\'\"]|x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}))'")


def _skip_literal(src: str, i: int) -> int:
    """The index just after the comment, string or char literal that starts at ``i``; ``i`` if none does
    (a lifetime ``'a`` is not a literal). Braces inside them do not count."""
    if src.startswith("//", i):
        j = src.find("\n", i)
        return len(src) if j < 0 else j
    if src.startswith("/*", i):
        return _block_comment_end(src, i)
    c = src[i]
    if c == '"':
        return _skip_string(src, i)
    if c == "'":
        m = _CHAR.match(src, i)
        return m.end() if m else i
    if c in "br" and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
        m = _RAW_STRING.match(src, i)
        if m:
            end = src.find('"' + m.group(1), m.end())
            return len(src) if end < 0 else end + 1 + len(m.group(1))
    return i


def _block_comment_end(src: str, i: int) -> int:
    """After the (nested) block comment that starts at ``i``."""
    depth, j = 0, i
    while j < len(src):
        if src.startswith("/*", j):
            depth, j = depth + 1, j + 2
        elif src.startswith("*/", j):
            depth, j = depth - 1, j + 2
            if depth == 0:
                return j
        else:
            j += 1
    return len(src)


# --------------------------------------------------------------------------- cutting a tests source
def test_spans(src: str) -> list[tuple[str, int, int]]:
    """``(path, start, end)`` of each ``#[test]`` fn of a tests source, in order (paths as verdicts name
    them). ``src[start:end]`` is the whole item: the attributes and comment lines right above it, its
    signature and its body."""
    _, found = _transform(src)
    spans, i = [], 0
    while i < len(src):
        j = _skip_literal(src, i)
        if j != i:
            i = j
            continue
        m = _TEST_ATTR.match(src, i)
        if not m:
            i += 1
            continue
        j = m.end()
        while (a := _ATTR.match(src, j)) is not None:
            j = a.end()
        f = _FN.match(src, j)
        if f is None:
            raise TaskFormatError("tests['tests']: a #[test] must be followed by `fn name() {`")
        end = _block_end(src, f.end() - 1)
        spans.append((_item_start(src, i), end))
        i = end
    if len(spans) != len(found):
        raise TaskFormatError("tests['tests']: could not delimit every #[test] fn (one inside another?)")
    return [(path, start, end) for (path, _), (start, end) in zip(found, spans)]


def select_tests(src: str, keep: set[str]) -> str:
    """``src`` without the ``#[test]`` fns whose path is not in ``keep``; everything else stays."""
    out, at = [], 0
    for path, start, end in test_spans(src):
        if path not in keep:
            out.append(src[at:start])
            at = end
    out.append(src[at:])
    return "".join(out)


def _block_end(src: str, i: int) -> int:
    """The index after the brace that closes the one at ``src[i]``."""
    depth = 0
    while i < len(src):
        j = _skip_literal(src, i)
        if j != i:
            i = j
            continue
        if src[i] == "{":
            depth += 1
        elif src[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise TaskFormatError("tests['tests']: a #[test] fn has no closing brace")


_ATTRS_AT_END = re.compile(r"(?:#\s*\[[^\]]*\]\s*)*\Z")


def _item_start(src: str, i: int) -> int:
    """Where the test item whose ``#[test]`` is at ``i`` begins: the outer attributes before it on its
    line and, when nothing else is, the lines of attributes and comments right above."""
    line_start = src.rfind("\n", 0, i) + 1
    before = src[line_start:i]
    attrs = _ATTRS_AT_END.search(before)
    if before[:attrs.start()].strip():
        return line_start + attrs.start()
    start = line_start
    while start > 0:
        above = src.rfind("\n", 0, start - 1) + 1
        if not src[above:start].strip().startswith(("#[", "//")):
            break
        start = above
    return start


def build_job_fields(code: str, tests: dict) -> dict[str, Any]:
    """The crate files for one completion: lib_rs, main_rs, and the test list."""
    validate_tests(tests)
    body, found = _transform(tests["tests"])
    macros = ", ".join(STD_MACROS)
    calls = []
    for path, should_panic in found:
        calls.append(f'    report(&nonce, "{path}", run(hidden::{path}, {str(should_panic).lower()}));')
    main_rs = f"""#![forbid(unsafe_code)]
#![allow(unused_imports, dead_code, unused_macros, unused_variables, unused_mut, clippy::all)]
pub mod hidden {{
    #[allow(unused_imports)]
    pub use solution::*;
    #[allow(unused_imports)]
    pub use ::std::{{{macros}}};
    #[allow(unused_imports)]
    pub use ::std::prelude::rust_2021::{{{", ".join(PRELUDE)}}};
    #[allow(unused_imports)]
    pub use ::std::primitive::{{{", ".join(PRIMITIVES)}}};
{body}
{signature_pin(tests.get("signature"))}}}

pub trait Outcome {{ fn passed(self) -> bool; }}
impl Outcome for () {{ fn passed(self) -> bool {{ true }} }}
impl<T, E> Outcome for Result<T, E> {{ fn passed(self) -> bool {{ self.is_ok() }} }}

fn run<T: Outcome>(f: fn() -> T, should_panic: bool) -> bool {{
    match ::std::panic::catch_unwind(f) {{
        Ok(v) => !should_panic && v.passed(),
        Err(_) => should_panic,
    }}
}}

fn report(nonce: &str, name: &str, ok: bool) {{
    use ::std::io::Write;
    let line = format!("{{}} {{}} {{}}\\n", nonce, name, if ok {{ "ok" }} else {{ "FAILED" }});
    let out = ::std::io::stdout();
    let mut lock = out.lock();
    let _ = lock.write_all(line.as_bytes());
    let _ = lock.flush();
}}

fn main() {{
    let mut nonce = String::new();
    let _ = ::std::io::stdin().read_line(&mut nonce);
    let nonce = nonce.trim().to_string();
{chr(10).join(calls)}
}}
"""
    return {"lib_rs": LIB_HEADER + code, "main_rs": main_rs,
            "test_names": [p for p, _ in found]}


def judge(reply: dict, test_names: list[str]) -> tuple[str, list[TestResult], dict[str, StageResult], str]:
    """-> (status, tests, stages, detail) from the box's reply to a rust job."""
    stages = {name: StageResult(name, s["status"], float(s.get("dt", 0.0)), s.get("detail", ""))
              for name, s in reply.get("stages", {}).items()}
    for name in ("build", "clippy", "test"):
        stages.setdefault(name, StageResult(name, "skipped"))
    seen: dict[str, bool] = {}
    dup = False
    for name, ok in reply.get("results", []):
        if name in seen:
            dup = True
        seen[name] = bool(ok) and not dup
    tests = []
    for name in test_names:
        if dup:
            tests.append(TestResult(name, False, "duplicate result lines (tampering?)"))
        elif name not in seen:
            tests.append(TestResult(name, False, "no result (crash, exit or timeout before it ran)"))
        else:
            tests.append(TestResult(name, seen[name], "" if seen[name] else "panicked or returned Err"))
    build, clippy, test = stages["build"], stages["clippy"], stages["test"]
    if "timeout" in (build.status, clippy.status, test.status):
        which = [s.name for s in (build, clippy, test) if s.status == "timeout"]
        return "timeout", tests, stages, f"time limit hit in stage {which[0]}"
    if build.status != "pass":
        return "error", tests, stages, ("compile error" if build.status == "fail"
                                        else "compiler " + build.detail[:200])
    if test.status == "error":
        return "error", tests, stages, "test binary failed to build (tests do not match the code's API?)"
    if reply.get("truncated"):
        return "error", tests, stages, "output limit exceeded"
    if tests and all(t.passed for t in tests):
        if clippy.status == "pass":
            return "pass", tests, stages, ""
        return "fail", tests, stages, "clippy lint gate failed"
    return "fail", tests, stages, f"{sum(not t.passed for t in tests)} of {len(tests)} tests failed"
