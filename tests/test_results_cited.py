"""Every file in bench/results/ backs a figure a doc cites, and every result file a doc cites exists.

The rule:

- **Where citations are read:** README.md, docs/*.md, bench/*.py and bench/*.sh, configs/**/*.yaml (comments
  included). Files under bench/results/ cite nothing themselves.
- **What a citation is:** a path written out from the repository root, starting `bench/results/` (in backticks or
  not). `{a,b}` alternatives expand (`step_speed_{fp32,bf16}_x.json` cites both files); a path with `<...>` is a
  template (`learning_<config>.json`, a script's default output) and cites nothing. Glob patterns (`*`) are refused:
  write the files out, so that a new result file is not cited by accident. A shorthand such as `..._s12.json` or a bare
  file name is not a citation.
- **Folders:** a path ending in `/` (`bench/results/`, `bench/results/answers/`) names a folder: it must exist and
  cites none of its files.
- **Answers:** a file under bench/results/answers/ is cited through its run: a cited result JSON lists it in
  `runs[*].answers` (as bench/learning.py writes them). Each listed answer file must exist; one that no cited result
  file lists is uncited.
- **Result:** every cited path exists, and every file under bench/results/ is cited (directly, or as an answer file
  of a cited run).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "bench/results/"
CITATION = re.compile(r"bench/results/[A-Za-z0-9_./{},*<>-]*")


def citing_files(root: Path) -> list[Path]:
    found = [root / "README.md"]
    for pattern in ("docs/*.md", "bench/*.py", "bench/*.sh", "configs/**/*.yaml"):
        found += sorted(root.glob(pattern))
    return [p for p in found if p.is_file() and RESULTS not in p.relative_to(root).as_posix() + "/"]


def expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in expand(path[: m.start()] + alt + path[m.end():])]


def citations(root: Path) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """(cited file -> where, cited folders, refused globs), each place as `doc:line`."""
    files: dict[str, list[str]] = {}
    folders: list[str] = []
    globs: list[str] = []
    for doc in citing_files(root):
        rel = doc.relative_to(root).as_posix()
        for lineno, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITATION.finditer(line):
                token = m.group(0).rstrip(".,")
                where = f"{rel}:{lineno}"
                if "<" in token:
                    continue
                if "*" in token:
                    globs.append(f"{token} ({where})")
                    continue
                for path in expand(token):
                    if path.endswith("/"):
                        folders.append(f"{path} ({where})")
                    else:
                        files.setdefault(path, []).append(where)
    return files, folders, globs


def listed_answers(root: Path, result: str) -> list[str]:
    """The answer files a result JSON lists in runs[*].answers."""
    if not result.endswith(".json"):
        return []
    try:
        data = json.loads((root / result).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    runs = data.get("runs") if isinstance(data, dict) else None
    return [a for run in runs or [] if isinstance(run, dict) for a in run.get("answers") or []]


def problems(root: Path) -> list[str]:
    """Every broken rule under `root`, one line each (empty: all cited, all present)."""
    files, folders, globs = citations(root)
    out = [f"glob, write the files out: {g}" for g in globs]
    for folder in folders:
        if not (root / folder.split(" (")[0]).is_dir():
            out.append(f"cited folder missing: {folder}")
    cited = set()
    for path, where in sorted(files.items()):
        if not (root / path).is_file():
            out.append(f"cited but missing: {path} ({', '.join(where)})")
            continue
        cited.add(path)
        for answer in listed_answers(root, path):
            if not (root / answer).is_file():
                out.append(f"answer file listed by {path} missing: {answer}")
            cited.add(answer)
    present = sorted(p.relative_to(root).as_posix() for p in (root / RESULTS).rglob("*") if p.is_file())
    out += [f"not cited by any doc: {p}" for p in present if p not in cited]
    return out


def test_every_result_file_is_cited_and_every_citation_exists():
    found = problems(ROOT)
    assert not found, (
        "bench/results/ and the docs disagree (rule: tests/test_results_cited.py's docstring):\n  "
        + "\n  ".join(found))


def test_checker_reports_dangling_citations_uncited_files_and_globs(tmp_path):
    (tmp_path / "docs").mkdir()
    answers = tmp_path / "bench" / "results" / "answers"
    answers.mkdir(parents=True)
    run = {"runs": [{"seed": 0, "answers": ["bench/results/answers/r_s0_iter0.jsonl.gz",
                                              "bench/results/answers/r_s0_iter4.jsonl.gz"]}]}
    (tmp_path / "bench" / "results" / "run.json").write_text(json.dumps(run))
    (answers / "r_s0_iter0.jsonl.gz").write_bytes(b"")
    (answers / "orphan_s0_iter0.jsonl.gz").write_bytes(b"")
    (tmp_path / "bench" / "results" / "a_fp32.json").write_text("{}")
    (tmp_path / "bench" / "results" / "a_bf16.json").write_text("{}")
    (tmp_path / "bench" / "results" / "stray.txt").write_text("")
    (tmp_path / "README.md").write_text(
        "See `bench/results/run.json` and `bench/results/a_{fp32,bf16}.json`; out to `bench/results/x_<cpu>.json`.\n")
    (tmp_path / "docs" / "x.md").write_text(
        "Gone: `bench/results/gone.json`. All: `bench/results/a_*.json`. Folder: `bench/results/answers/`.\n")
    found = problems(tmp_path)
    assert "cited but missing: bench/results/gone.json (docs/x.md:1)" in found
    assert "not cited by any doc: bench/results/stray.txt" in found
    assert "not cited by any doc: bench/results/answers/orphan_s0_iter0.jsonl.gz" in found
    assert ("answer file listed by bench/results/run.json missing: bench/results/answers/r_s0_iter4.jsonl.gz"
            in found)
    assert any(p.startswith("glob, write the files out: bench/results/a_*.json") for p in found)
    assert len(found) == 5, found
    with pytest.raises(AssertionError, match="not cited by any doc: bench/results/stray.txt"):
        assert not found, "\n".join(found)
