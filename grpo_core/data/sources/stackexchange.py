"""Stack Exchange data dump importer (`Posts.xml`, CC BY-SA): questions with wanted tags, accepted answers
as references.

The rule for what becomes a checkable task (GRPO needs a rule-based reward, so open-ended Q&A is out):
1. the question carries a wanted tag (others are skipped, not reported) and has score >= min_score
   (else `low_score`);
2. it has an accepted answer present in the dump (else `no_accepted_answer`);
3. its language is one the sandbox runs: the `rust` or `python` tag (else `not_verifiable`);
4. the accepted answer contains code (else `not_verifiable`: prose answers cannot be checked);
5. that code contains executable checks -- Rust `#[test]` fns or `assert*!` in `fn main`, Python
   top-level `assert`s calling one function the answer defines (else `not_verifiable`: nothing to
   check a solution against);
6. what remains after removing the checks is the reference solution; it must define the items the
   checks use. The checks become hidden tests; the validator then runs the reference against them.
"""
from __future__ import annotations

import ast
import html
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task

SOURCE = "stackexchange"
LANG_TAGS = {"rust": "rust", "python": "python", "python-3.x": "python"}
RUST_INSTRUCTION = ("Answer with complete Rust code in one ```rust code block; make the functions and types "
                    "it defines `pub`. Hidden tests will call them.")
PY_INSTRUCTION = "Answer with complete Python code in one ```python code block defining `{name}`. Hidden tests will call it."
CODE_RE = re.compile(r"<pre[^>]*>\s*<code[^>]*>(.*?)</code>\s*</pre>", re.S)


def parse_tags(raw: str | None) -> list[str]:
    """'<rust><lifetimes>' (classic dumps) or '|rust|lifetimes|' (newer dumps) -> ['rust', 'lifetimes']."""
    raw = raw or ""
    return [t for t in re.split(r"[<>|]+", raw) if t]


def html_to_text(body: str) -> str:
    """Question HTML -> plain text with code blocks fenced."""
    text = CODE_RE.sub(lambda m: "\n```\n" + html.unescape(m.group(1)).strip("\n") + "\n```\n", body)
    text = re.sub(r"<br\s*/?>|</p>|</li>", "\n", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"\n{3,}", "\n\n", html.unescape(text)).strip()


def code_blocks(body: str) -> list[str]:
    return [html.unescape(b) for b in CODE_RE.findall(body)]


def read_posts(path: str | Path, tags: set[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(questions with a wanted tag, answers by id), streaming the XML."""
    questions, answers = {}, {}
    for _, elem in ET.iterparse(str(path), events=("end",)):
        if elem.tag != "row":
            continue
        a = dict(elem.attrib)
        elem.clear()
        if a.get("PostTypeId") == "1" and tags & set(parse_tags(a.get("Tags"))):
            questions[a["Id"]] = a
        elif a.get("PostTypeId") == "2":
            answers[a["Id"]] = a
    return questions, answers


# -- splitting answer code into solution + checks -------------------------------------------------------
_MAIN_RE = re.compile(r"^fn\s+main\s*\(\s*\)\s*\{(.*?)^\}", re.S | re.M)
_TEST_MOD_RE = re.compile(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{.*\}\s*$", re.S)
_TEST_FN_RE = re.compile(r"#\[test\]\s*fn\s+\w+\s*\(\s*\)\s*\{.*?^\}", re.S | re.M)


def split_rust(code: str) -> tuple[str, str] | None:
    """(reference, tests) from a Rust answer, or None when it has no checks."""
    tests: list[str] = []
    m = _TEST_MOD_RE.search(code)
    if m:
        tests.append(formats.unwrap_test_module(m.group(0)))
        code = code[:m.start()] + code[m.end():]
    for t in _TEST_FN_RE.findall(code):
        tests.append(t)
        code = code.replace(t, "")
    m = _MAIN_RE.search(code)
    if m and re.search(r"\bassert(_eq|_ne)?!", m.group(1)):
        tests.append("#[test]\nfn answer_checks() {" + m.group(1) + "}\n")
        code = code[:m.start()] + code[m.end():]
    code = code.strip()
    if not tests or not re.search(r"^(pub\s+)?(fn|struct|enum|trait|impl)\b", code, re.M):
        return None
    return formats.make_pub(code) + "\n", "\n".join(tests)


def split_python(code: str) -> tuple[str, str, str] | None:
    """(reference, check source, entry point) from a Python answer, or None when it has no usable checks."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    asserts = [n for n in tree.body if isinstance(n, ast.Assert)]
    called = {c.func.id for a in asserts for c in ast.walk(a)
              if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in defined}
    if not asserts or len(called) != 1:
        return None
    entry = called.pop()

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name):
            return ast.copy_location(ast.Name("candidate", node.ctx), node) if node.id == entry else node

    check_body = "\n".join("    " + ast.unparse(Rename().visit(a)) for a in asserts)
    rest = ast.Module(body=[n for n in tree.body if not isinstance(n, ast.Assert)], type_ignores=[])
    return ast.unparse(rest) + "\n", f"def check(candidate):\n{check_body}\n", entry


def question_to_task(q: dict, answer: dict | None, site: str, min_score: int) -> Task | Rejection:
    tid = f"{SOURCE}/{site}/{q['Id']}"
    if int(q.get("Score") or 0) < min_score:
        return Rejection(tid, SOURCE, "low_score", f"score {q.get('Score')} < {min_score}")
    if answer is None:
        return Rejection(tid, SOURCE, "no_accepted_answer", "no AcceptedAnswerId, or the answer is not in the dump")
    tags = parse_tags(q.get("Tags"))
    kind = next((LANG_TAGS[t] for t in tags if t in LANG_TAGS), None)
    if kind is None:
        return Rejection(tid, SOURCE, "not_verifiable", f"tags {tags}: no language the sandbox can run (rust, python)")
    blocks = code_blocks(answer.get("Body", ""))
    if not blocks:
        return Rejection(tid, SOURCE, "not_verifiable", "the accepted answer is prose only; no code to check")
    code = "\n\n".join(blocks)
    question = f"{html.unescape(q.get('Title', '')).strip()}\n\n{html_to_text(q.get('Body', ''))}"
    common = dict(source=SOURCE, license="CC BY-SA 4.0",
                  provenance=f"{site} Posts.xml question {q['Id']}, accepted answer {answer['Id']}",
                  meta={"tags": tags, "score": int(q.get("Score") or 0), "answer_id": answer["Id"], "site": site})
    if kind == "rust":
        split = split_rust(code)
        if split is None:
            return Rejection(tid, SOURCE, "not_verifiable",
                             "the accepted answer's code has no #[test] or assert! in fn main to check a solution")
        reference, tests = split
        return Task(id=tid, kind="rust", prompt=f"{question}\n\n{RUST_INSTRUCTION}", tests=formats.rust_tests(tests),
                    reference_solution=reference, **common)
    split_py = split_python(code)
    if split_py is None:
        return Rejection(tid, SOURCE, "not_verifiable",
                         "the accepted answer's code has no top-level asserts calling one function it defines")
    reference, check, entry = split_py
    return Task(id=tid, kind="python", prompt=f"{question}\n\n{PY_INSTRUCTION.format(name=entry)}",
                tests=formats.humaneval(check), entry_point=entry, reference_solution=reference, **common)


def load(path: str, tags: list[str] | tuple[str, ...] = ("rust",), min_score: int = 0, site: str | None = None,
         **_: Any) -> Iterable[Task | Rejection]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"stackexchange: Posts.xml {str(p)!r} does not exist; fix the source's 'path'")
    site = site or p.parent.name or "stackexchange"
    questions, answers = read_posts(p, set(tags))
    for qid in sorted(questions, key=int):
        q = questions[qid]
        yield question_to_task(q, answers.get(q.get("AcceptedAnswerId", "")), site, min_score)
