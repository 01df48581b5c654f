"""Plugins: reward functions and task sources that live outside this repository, found by name.

A config entry that is not a built-in name is either `"package.module:function"` (imported as written) or
the name of an entry point an installed package registers in its metadata:

    [project.entry-points."grpo_pipeline.rewards"]      unit_match = "grpo_units.rewards:unit_match"
    [project.entry-points."grpo_pipeline.sources"]      units_csv = "grpo_units.sources:units_csv"

Resolution is by name every time, in whatever process runs the work (the `grpo` CLI, a stage on a Prefect
worker), so nothing is pickled; the plugin only has to be installed where it runs. Every failure is a
`PluginError` that names the config entry (`reward_funcs[2] = "mypkg.rewards:lenpen"`) and the fix.
This module knows nothing about what rewards or sources compute: the caller passes its built-in names and
the columns a reward function may ask for. It imports only the standard library.
"""
from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Collection, Iterable

REWARD_GROUP = "grpo_pipeline.rewards"
SOURCE_GROUP = "grpo_pipeline.sources"
TOOL_GROUP = "grpo_pipeline.tools"
ENVIRONMENT_GROUP = "grpo_pipeline.environments"

REWARD_SIGNATURE = "def f(prompts, completions, **kwargs) -> list[float | None]"
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class PluginError(ValueError):
    """A plugin entry cannot be used; the message names the entry and the fix (a ValueError: bad input,
    never retried, and what pydantic reports as a config error)."""


@dataclass(frozen=True)
class Plugin:
    entry: str          # as written in the config
    obj: Any            # the function (or other object) it names
    origin: str         # where it came from: "package.module:function" or "<dist> <version> (entry point)"


def _where(field: str, entry: str) -> str:
    return f'{field} = "{entry}"'


def _import_spec(spec: str, field: str) -> Any:
    """The object `"package.module:attr.attr"` names."""
    module_name, _, attr_path = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure inside the user's module is reported the same way
        raise PluginError(
            f"{_where(field, spec)}: cannot import module {module_name!r} ({type(e).__name__}: {e}). Fix: install "
            f"the package that provides it in this environment (`pip install -e PATH`) or add its folder to "
            f"PYTHONPATH; a Prefect worker needs it installed too") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in vars(obj) if not n.startswith("_") and callable(getattr(obj, n)))
            raise PluginError(f"{_where(field, spec)}: module {module_name!r} has no attribute {attr_path!r}. Fix: "
                              f"name one of its functions after the colon ({', '.join(public[:12]) or 'none'})")
        obj = getattr(obj, part)
    return obj


def entry_points(group: str) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of `group` by name (the first one found wins on a clash)."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        found.setdefault(ep.name, ep)
    return found


def distribution_label(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"


def _load_entry_point(ep: metadata.EntryPoint, entry: str, field: str) -> Any:
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001
        raise PluginError(
            f"{_where(field, entry)}: the entry point {ep.value!r} of {distribution_label(ep)} fails to load "
            f"({type(e).__name__}: {e}). Fix: repair or reinstall that package") from e


def load_plugin(entry: str, group: str, field: str, builtin_names: Iterable[str]) -> Plugin:
    """The object a non-built-in entry names: `"package.module:function"`, else an entry point of `group`."""
    if ":" in entry:
        if not _SPEC.match(entry):
            raise PluginError(f'{_where(field, entry)}: write "package.module:function" (dotted module path, one '
                              f"colon, then the function name)")
        obj = _import_spec(entry, field)
        origin = entry
    else:
        eps = entry_points(group)
        if entry not in eps:
            installed = f"; installed plugins: {', '.join(sorted(eps))}" if eps else ""
            raise PluginError(
                f"{_where(field, entry)}: unknown name; known: {', '.join(builtin_names)} (built in){installed}. "
                f'It is not "package.module:function" either, and no installed package registers it under the '
                f'entry-point group "{group}". Fix: use a known name, write "package.module:function", or install '
                f"the package that provides it (`pip install -e PATH`)")
        obj = _load_entry_point(eps[entry], entry, field)
        origin = f"{distribution_label(eps[entry])} ({eps[entry].value})"
    if not callable(obj):
        raise PluginError(f"{_where(field, entry)}: {origin} is a {type(obj).__name__}, not a function. Fix: point "
                          f"it at a function")
    return Plugin(entry, obj, origin)


def _positional(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in params if p.kind in kinds]


def check_reward_signature(fn: Callable, entry: str, field: str, columns: Collection[str]) -> frozenset[str] | None:
    """Check `fn` can be called as f(prompts, completions, **columns); return the keyword names it accepts
    (None: all, it takes **kwargs). A keyword without a default must be one of `columns`; one with a default
    may name anything (e.g. a key of the tasks' `meta`) and keeps its default where no such column exists."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise PluginError(f"{_where(field, entry)}: its signature cannot be read ({e}). Fix: use a plain Python "
                          f"function: {REWARD_SIGNATURE}") from e
    name = getattr(fn, "__name__", entry)
    positional = _positional(params)
    var_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not var_args:
        raise PluginError(f"{_where(field, entry)}: {name}{inspect.signature(fn)} takes {len(positional)} positional "
                          f"argument(s), but reward functions are called f(prompts, completions, **columns). Fix: "
                          f"{REWARD_SIGNATURE}")
    rest = positional[2:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for p in rest:
        required = p.default is inspect.Parameter.empty
        if required and (p.kind is inspect.Parameter.POSITIONAL_ONLY or p.name not in columns):
            raise PluginError(
                f"{_where(field, entry)}: {name}() requires argument {p.name!r}, which is not a column. Fix: give it a "
                f"default, take **kwargs, or use a column name ({', '.join(sorted(columns))})")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in rest if p.kind is not inspect.Parameter.POSITIONAL_ONLY)


def short_name(entry: str) -> str:
    """The metric name of an entry: a built-in or entry-point name as is, "pkg.mod:fn" -> "fn"."""
    return entry.rpartition(":")[2].rpartition(".")[2] if ":" in entry else entry


def metric_names(entries: Iterable[str]) -> list[str]:
    """One unique metric name per entry: the short name; on a clash the full dotted path, then a suffix."""
    entries = list(entries)
    short = [short_name(e) for e in entries]
    names: list[str] = []
    for e, s in zip(entries, short):
        name = s if short.count(s) == 1 else e.replace(":", ".")
        base, k = name, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names
