"""Rust "fix this" tasks from the human-written examples of `rustc --explain` and `cargo clippy --explain`.

rustc: the first code block after "Erroneous code example" must fail to compile with its error code;
the first later block that compiles is the reference fix. clippy: the "### Example" block must trigger
the lint; the block after it ("Use instead") must compile without it. The hidden tests pin the items
the broken example defines (its non-generic functions and plain types must still exist), so deleting
the code does not pass; items are made `pub` because the tests live in another crate. Clippy tasks are
kept only for lints in `clippy::all`, which the sandbox's lint gate denies.
Rule: an example with nothing to pin is rejected as not automatically verifiable.
Parsed explanations are cached under $GRPO_HOME because listing them runs rustc hundreds of times.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Iterable

from grpo_core.data import formats, localrun
from grpo_core.data.records import Rejection
from grpo_core.task import Task
from grpo_core.io import atomic_write_text
from grpo_core.data.sources.humaneval_rust import grpo_home

RUSTC_INSTRUCTION = ("This Rust code does not compile (rustc reports error {code}). Fix it so that it compiles, "
                     "keeping its public functions and types. Reply with the complete fixed code in one ```rust code block.")
CLIPPY_INSTRUCTION = ("Clippy flags this Rust code with the lint `clippy::{lint}`: {what} Rewrite it so the lint "
                      "no longer fires, keeping its public functions and types. Reply with the complete code in one "
                      "```rust code block.")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


@lru_cache(maxsize=8)
def _tool_version_cached(tool: tuple[str, ...]) -> str:
    try:
        return subprocess.run(list(tool) + ["--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "missing"


def _tool_version(tool: list[str]) -> str:
    return _tool_version_cached(tuple(tool))


def _cache(name: str, version: str, build) -> dict[str, str]:
    path = grpo_home() / "data" / f"{name}-{re.sub(r'[^A-Za-z0-9.]+', '_', version)}.json"
    if path.is_file():
        return json.loads(path.read_text())
    docs = build()
    atomic_write_text(path, json.dumps(docs))
    return docs


def rustc_explanations() -> dict[str, str]:
    """{"E0384": markdown, ...} for every error code rustc can explain (cached per rustc version)."""
    def build() -> dict[str, str]:
        codes = [f"E{n:04d}" for n in range(1, 1000)]
        def one(code: str) -> tuple[str, str]:
            p = subprocess.run(["rustc", "--explain", code], capture_output=True, text=True)
            return code, p.stdout if p.returncode == 0 else ""
        with ThreadPoolExecutor(4) as pool:
            return {c: t for c, t in pool.map(one, codes) if t.strip()}
    return _cache("rustc-explain", _tool_version(["rustc"]), build)


def clippy_explanations() -> dict[str, str]:
    """{"needless_return": markdown, ...} for every lint in clippy::all (warn/deny by default; the
    sandbox's lint gate checks exactly those), cached per clippy version."""
    def build() -> dict[str, str]:
        out = subprocess.run(["clippy-driver", "rustc", "-W", "help"], capture_output=True, text=True).stdout
        lints = sorted({m.replace("-", "_") for m in re.findall(r"^\s*clippy::([a-z0-9-]+)\s+(?:warn|deny)\s", out, re.M)})
        def one(lint: str) -> tuple[str, str]:
            p = subprocess.run(["cargo", "clippy", "--explain", lint], capture_output=True, text=True)
            return lint, p.stdout if p.returncode == 0 else ""
        with ThreadPoolExecutor(4) as pool:
            return {l: t for l, t in pool.map(one, lints) if t.strip()}
    return _cache("clippy-explain", _tool_version(["cargo", "clippy"]), build)


def code_blocks(markdown: str) -> list[str]:
    return [b for b in FENCE_RE.findall(markdown)]


_FN_RE = re.compile(r"^(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?fn\s+([a-z_][a-z0-9_]*)\s*\(", re.M)
_TYPE_RE = re.compile(r"^(?:pub(?:\([^)]*\))?\s+)?(?:struct|enum)\s+([A-Z][A-Za-z0-9_]*)\s*[{;(]", re.M)


def pinned_items(source: str) -> list[str]:
    """Top-level (unindented) non-generic fns and types of `source`, as test statements."""
    stmts = [f"let _ = {name};" for name in _FN_RE.findall(source)]
    stmts += [f"let _ = core::mem::size_of::<{name}>();" for name in _TYPE_RE.findall(source)]
    return stmts


def pin_tests(stmts: list[str]) -> str:
    """A top-level #[test] (sandbox `rust` format) that fails to compile when a pinned item is gone."""
    body = "\n    ".join(stmts)
    return f"#[test]\nfn items_still_exist() {{\n    {body}\n}}\n"


def _crate_type(src: str) -> str:
    return "bin" if re.search(r"^\s*fn\s+main\s*\(", src, re.M) else "lib"


def _hidden_doc_lines(block: str) -> str:
    """rustdoc hides lines starting with '# ' in examples; they are part of the code."""
    return "\n".join(l[2:] if l.startswith("# ") else ("" if l == "#" else l) for l in block.splitlines()) + "\n"


def _rustc_item(code: str, doc: str) -> Task | Rejection:
    tid = f"rustc_explain/{code}"
    blocks = [_hidden_doc_lines(b) for b in code_blocks(doc)]
    if not blocks:
        return Rejection(tid, "rustc_explain", "not_verifiable", "the explanation has no code example")
    broken, fixes = blocks[0], blocks[1:]
    if "#![feature" in broken:
        return Rejection(tid, "rustc_explain", "needs_nightly", "uses #![feature]")
    ok, err = localrun.check_rust(broken, _crate_type(broken))
    if ok or f"[{code}]" not in err:
        return Rejection(tid, "rustc_explain", "example_not_broken",
                         "compiles" if ok else f"fails without {code}: {localrun._first_error(err)}")
    pins = pinned_items(broken)
    if not pins:
        return Rejection(tid, "rustc_explain", "not_verifiable", "no function or type to pin, so any program would pass")
    for fix in fixes:
        if "#![feature" not in fix and localrun.check_rust(fix, _crate_type(fix))[0] and \
                all(p in pinned_items(fix) for p in pins):
            return Task(id=tid, kind="rust", source="rustc_explain",
                        prompt=RUSTC_INSTRUCTION.format(code=code) + f"\n\n```rust\n{formats.make_pub(broken)}```",
                        tests=formats.rust_tests(pin_tests(pins)), reference_solution=formats.make_pub(fix),
                        license="MIT OR Apache-2.0", provenance=f"{_tool_version(['rustc'])} --explain {code}",
                        meta={"error_code": code, "broken": broken, "check": "compiles; original items kept"})
    return Rejection(tid, "rustc_explain", "no_compiling_fix", f"{len(fixes)} later block(s), none compiles with the same items")


def _clippy_item(lint: str, doc: str) -> Task | Rejection:
    tid = f"clippy_explain/{lint}"
    section = doc.split("### Example", 1)
    if len(section) < 2:
        return Rejection(tid, "clippy_explain", "not_verifiable", "no '### Example' section")
    blocks = [_hidden_doc_lines(b) for b in code_blocks(section[1])]
    if len(blocks) < 2:
        return Rejection(tid, "clippy_explain", "no_compiling_fix", "no 'use instead' block after the example")
    broken, fix = blocks[0], blocks[1]
    if "#![feature" in broken:
        return Rejection(tid, "clippy_explain", "needs_nightly", "uses #![feature]")
    if localrun.check_rust(broken, _crate_type(broken))[0] is False:
        # statement fragments: try them as the body of a function (both the example and its fix)
        broken, fix = _as_fn(broken), _as_fn(fix)
        if localrun.check_rust(broken, "lib")[0] is False:
            return Rejection(tid, "clippy_explain", "not_verifiable",
                             "the example is a fragment that does not compile alone, nor as a function body")
    if localrun.check_rust(broken, _crate_type(broken), deny=[f"clippy::{lint}"])[0]:
        return Rejection(tid, "clippy_explain", "example_not_broken", "the lint does not fire on the example alone")
    pins = pinned_items(broken)
    if not pins:
        return Rejection(tid, "clippy_explain", "not_verifiable", "no function or type to pin, so any program would pass")
    fix = formats.make_pub(fix)
    if not localrun.check_rust(fix, "lib", deny=["clippy::all"])[0] or \
            not all(p in pinned_items(fix) for p in pins):
        return Rejection(tid, "clippy_explain", "no_compiling_fix",
                         "the 'use instead' block is not clean under clippy::all on its own")
    what = doc.split("### What it does", 1)[-1].split("###", 1)[0].strip().replace("\n", " ")
    return Task(id=tid, kind="rust", source="clippy_explain",
                prompt=CLIPPY_INSTRUCTION.format(lint=lint, what=what) + f"\n\n```rust\n{formats.make_pub(broken)}```",
                tests=formats.rust_tests(pin_tests(pins)), reference_solution=fix, license="MIT OR Apache-2.0",
                provenance=f"{_tool_version(['cargo', 'clippy'])} --explain {lint}",
                meta={"lint": lint, "broken": broken, "check": "compiles, lint denied, original items kept"})


def _as_fn(fragment: str) -> str:
    body = "\n".join("    " + l if l.strip() else "" for l in fragment.strip("\n").splitlines())
    return f"pub fn example() {{\n{body}\n}}\n"


def _load(kind: str, docs: dict[str, str], limit: int | None, workers: int) -> Iterable[Task | Rejection]:
    make = _rustc_item if kind == "rustc" else _clippy_item
    names = sorted(docs)[:limit] if limit else sorted(docs)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        yield from pool.map(lambda n: make(n, docs[n]), names)


def _explain(cmd: list[str], names: list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        p = subprocess.run(cmd + [n], capture_output=True, text=True)
        if p.returncode != 0 or not p.stdout.strip():
            raise ValueError(f"{' '.join(cmd)} {n} failed: {p.stderr.strip()[:200]}; check the name")
        out[n] = p.stdout
    return out


def load_rustc(limit: int | None = None, codes: list[str] | None = None, workers: int = 2,
               **_: Any) -> Iterable[Task | Rejection]:
    """Tasks from every explainable error code, or only from `codes` (e.g. ["E0384"])."""
    if not shutil.which("rustc"):
        raise RuntimeError("source rustc_explain needs `rustc` on PATH (install Rust, e.g. rustup)")
    docs = _explain(["rustc", "--explain"], codes) if codes else rustc_explanations()
    return _load("rustc", docs, limit, workers)


def load_clippy(limit: int | None = None, lints: list[str] | None = None, workers: int = 2,
                **_: Any) -> Iterable[Task | Rejection]:
    """Tasks from every lint in clippy::all, or only from `lints` (e.g. ["needless_return"])."""
    if not shutil.which("clippy-driver"):
        raise RuntimeError("source clippy_explain needs clippy (`rustup component add clippy`)")
    docs = _explain(["cargo", "clippy", "--explain"], lints) if lints else clippy_explanations()
    return _load("clippy", docs, limit, workers)
