"""Task sources. Each loader takes keyword options and yields `Task` or `Rejection` records.

`get_loader(name)` gives (loader, group); group is "synthetic", "community" or "user" and is what mix
weights such as {"synthetic": 0.7, "community": 0.3} refer to. A name that is not built in is a plugin
(grpo_core.plugins): `"package.module:function"`, or an entry point an installed package registers under
the group `grpo_pipeline.sources`. A plugin is called with the source's options from the curation YAML
(plus `seed`, when it takes it) and may yield Task objects, Rejections, or plain dicts, which are mapped
like the rows of a user file (grpo_core.data.sources.files: prompt/question, answer, tests, id, kind,
meta, ...). Its group is "user" unless the function has a `group` attribute.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from grpo_core.data.records import Rejection
from grpo_core.plugins import SOURCE_GROUP, Plugin, PluginError, distribution_label, entry_points, load_plugin
from grpo_core.task import Task

Loader = Callable[..., Iterable["Task | Rejection"]]

# name -> (module, function, group)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "arithmetic": ("grpo_core.data.sources.arith", "load", "synthetic"),
    "reasoning_gym": ("grpo_core.data.sources.rgym", "load", "synthetic"),
    "tool_problems": ("grpo_core.data.sources.tool_problems", "load", "synthetic"),
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
    "folder": ("grpo_core.data.sources.files", "load_folder", "user"),
    "stackexchange": ("grpo_core.data.sources.stackexchange", "load", "user"),
    "verifiers": ("grpo_core.data.sources.verifiers_tasks", "load", "user"),
}
SOURCE_NAMES = tuple(_REGISTRY)   # the built-in names; plugins come on top
GROUPS = tuple(dict.fromkeys(group for _, _, group in _REGISTRY.values()))   # synthetic, community, user


class UnknownSourceError(PluginError, KeyError):
    """A source name that is neither built in nor a usable plugin (a KeyError too, as it always was)."""

    def __str__(self) -> str:           # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _load_source_plugin(name: str, field: str) -> Plugin:
    try:
        return load_plugin(name, SOURCE_GROUP, field, SOURCE_NAMES)
    except PluginError as e:
        raise UnknownSourceError(str(e)) from e


def _group_of(plugin: Plugin) -> str:
    group = getattr(plugin.obj, "group", "user")
    if not isinstance(group, str) or not group:
        raise UnknownSourceError(f"source {plugin.entry!r} ({plugin.origin}): its `group` attribute must be a "
                                 f"non-empty string (synthetic, community or user), got {group!r}")
    return group


def _plugin_loader(plugin: Plugin) -> Loader:
    """The plugin's function with its records made uniform: dicts become Tasks (or Rejections)."""
    from grpo_core.data.sources.files import row_to_task
    params = inspect.signature(plugin.obj).parameters.values()
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    takes_seed = takes_any or any(p.name == "seed" for p in params)

    def load(**options: Any) -> Iterator[Task | Rejection]:
        if not takes_seed:
            options.pop("seed", None)
        for i, rec in enumerate(plugin.obj(**options)):
            if isinstance(rec, (Task, Rejection)):
                yield rec
            elif isinstance(rec, dict):
                yield row_to_task(rec, str(rec.get("source") or plugin.entry), plugin.origin, i)
            else:
                raise TypeError(f"source {plugin.entry!r} ({plugin.origin}) yielded a {type(rec).__name__} as record "
                                f"{i}; yield Task objects or dicts of task fields (prompt, answer, ...)")
    load.__doc__ = plugin.obj.__doc__
    return load


def get_loader(name: str, field: str = "source") -> tuple[Loader, str]:
    """(loader, group) for a built-in source name or a plugin; the error lists the known names and the fix."""
    if name in _REGISTRY:
        module, fn, group = _REGISTRY[name]
        return getattr(importlib.import_module(module), fn), group
    plugin = _load_source_plugin(name, field)
    return _plugin_loader(plugin), _group_of(plugin)


def check_source(name: str, field: str) -> None:
    """Fail now (UnknownSourceError, naming `field`) if `name` is neither built in nor a loadable plugin."""
    if name not in _REGISTRY:
        _group_of(_load_source_plugin(name, field))


def load_source(name: str, **options: Any) -> list["Task | Rejection"]:
    loader, _ = get_loader(name)
    return list(loader(**options))


@dataclass(frozen=True)
class SourceInfo:
    name: str
    group: str
    summary: str        # first line of its docstring
    origin: str         # "built-in", or the plugin's distribution and entry point


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""


def list_sources() -> list[SourceInfo]:
    """Every source: the built-ins, then the installed plugins (one that fails to load says why)."""
    out = []
    for name, (module, _, group) in _REGISTRY.items():
        out.append(SourceInfo(name, group, _first_line(importlib.import_module(module).__doc__), "built-in"))
    for name, ep in sorted(entry_points(SOURCE_GROUP).items()):
        origin = f"{distribution_label(ep)} ({ep.value})"
        if name in _REGISTRY:
            out.append(SourceInfo(name, "-", "shadowed by the built-in of the same name", origin))
            continue
        try:
            plugin = _load_source_plugin(name, "source")
            out.append(SourceInfo(name, _group_of(plugin), _first_line(plugin.obj.__doc__), origin))
        except PluginError as e:
            out.append(SourceInfo(name, "-", f"fails to load: {e}", origin))
    return out
