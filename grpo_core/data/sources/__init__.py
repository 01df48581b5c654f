"""Task sources. Each loader takes keyword options and yields `Task` or `Rejection` records.

`SOURCES[name]` gives (loader, group); group is "synthetic", "community" or "user" and is what mix
weights such as {"synthetic": 0.7, "community": 0.3} refer to.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

from grpo_core.data.records import Rejection
from grpo_core.task import Task

Loader = Callable[..., Iterable["Task | Rejection"]]

# name -> (module, function, group)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "arithmetic": ("grpo_core.data.sources.arith", "load", "synthetic"),
    "reasoning_gym": ("grpo_core.data.sources.rgym", "load", "synthetic"),
    "gen_python": ("grpo_core.data.sources.gen_python", "load", "synthetic"),
    "gen_rust": ("grpo_core.data.sources.gen_rust", "load", "synthetic"),
    "humaneval": ("grpo_core.data.sources.humaneval", "load", "community"),
    "humaneval_rust": ("grpo_core.data.sources.humaneval_rust", "load", "community"),
    "pythonlings": ("grpo_core.data.sources.pythonlings_src", "load", "community"),
    "rustc_explain": ("grpo_core.data.sources.rust_explain", "load_rustc", "community"),
    "clippy_explain": ("grpo_core.data.sources.rust_explain", "load_clippy", "community"),
    "jsonl": ("grpo_core.data.sources.files", "load_jsonl", "user"),
    "csv": ("grpo_core.data.sources.files", "load_csv", "user"),
    "parquet": ("grpo_core.data.sources.files", "load_parquet", "user"),
    "hf_disk": ("grpo_core.data.sources.files", "load_hf_disk", "user"),
    "stackexchange": ("grpo_core.data.sources.stackexchange", "load", "user"),
}
SOURCE_NAMES = tuple(_REGISTRY)


def get_loader(name: str) -> tuple[Loader, str]:
    """(loader, group) for a source name; the error lists the known names."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown data source {name!r}; known: {', '.join(SOURCE_NAMES)}")
    module, fn, group = _REGISTRY[name]
    return getattr(importlib.import_module(module), fn), group


def load_source(name: str, **options: Any) -> list["Task | Rejection"]:
    loader, _ = get_loader(name)
    return list(loader(**options))
