"""Which task a run trains for: a readable name (`task_slug`) and a fingerprint (`task_signature`).

Two runs are of one task when they draw questions from the same source (the arithmetic curriculum, or the
same data.curated), prompt in the same main format, offer the same tools and count the same answers as
correct: then their adapters may compete for one `champion`, judged on one gate set in that one format. The
slug fills `{task}` in tracking.registered_model_name (default "grpo-{task}"), so each task gets its own
registered model, champion and gate set; the signature, kept as a tag, catches two tasks that share a name.
How a run trains (wordings, rewards' weights, learning rate, how many questions it holds out) is not part of
the task; nor is the content of a data.curated folder, which grows between the runs of a schedule (the gate
checks instead that its set stays disjoint from each run's eval split). Pure.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from grpo_core.rollout.tools import standard

TASK_PLACEHOLDER = "{task}"
OPERATION_WORDS = {"+": "add", "-": "sub", "*": "mul"}
SIGNATURE_PARTS = ("source", "prompt", "tools", "check")


def _slug_words(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _environment_names(environment: str | dict[str, str]) -> list[str]:
    entries = environment.values() if isinstance(environment, dict) else [environment]
    return [_environment_name(entry) for entry in entries]


def _environment_name(entry: str) -> str:
    """rust_fix, pkg.mod:Class -> Class; openenv:calc_env.server.app:app -> openenv-calc_env (the module path's
    last part that is not app, server or main: OpenEnv's own layout is <env>/server/app.py); verifiers:calc ->
    verifiers-calc; openenv:http://host:port -> openenv-host."""
    kind = standard(entry)
    if kind is None:
        return re.split(r"[:.]", entry)[-1]
    if "://" in kind[1]:
        return f"{kind[0]}-{kind[1].split('://')[-1].split('/')[0].split(':')[0]}"
    parts = [p for p in kind[1].split(":")[0].split(".") if p not in ("app", "server", "main")]
    return f"{kind[0]}-{parts[-1] if parts else 'server'}"


def task_slug(cfg) -> str:
    """A readable name of the config's task, e.g. arithmetic-1d-add-sub, arithmetic-3d-mul-calculator, math."""
    d = cfg.data
    if cfg.environment:
        parts = _environment_names(cfg.environment)
    elif d.curated:
        parts = [Path(d.curated).stem or "curated"]
    else:
        digits = f"{d.min_digits}d" if d.min_digits == d.max_digits else f"{d.min_digits}-{d.max_digits}d"
        parts = [d.task, digits, *(OPERATION_WORDS[op] for op in d.operations)]
    parts += [re.split(r"[:.]", tool)[-1] for tool in cfg.tools]
    return _slug_words("-".join(parts)) or "task"


def registered_model_name(cfg) -> str | None:
    """tracking.registered_model_name with `{task}` filled in (None: registration is off)."""
    name = cfg.tracking.registered_model_name
    return name.replace(TASK_PLACEHOLDER, task_slug(cfg)) if name else None


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def task_signature(cfg) -> dict[str, str]:
    """One short hash per part of the task (SIGNATURE_PARTS): its question source, its main prompt format, its
    tools, and what counts as correct."""
    d = cfg.data
    source = {"curated": d.curated} if d.curated else {"task": d.task, "min_digits": d.min_digits,
                                                        "max_digits": d.max_digits, "operations": d.operations}
    prompt = {"system_prompt": d.system_prompt, "few_shot": d.few_shot,
              "response_prefix": d.prompt_format.response_prefix, "chat_template_kwargs": d.chat_template_kwargs}
    tools = {"tools": cfg.tools, "environment": cfg.environment,
             "max_tool_calling_iterations": cfg.max_tool_calling_iterations}
    if cfg.environment_config is not None:          # only when set: older runs' signatures stay as they were
        tools["environment_config"] = cfg.environment_config
    return {"source": _digest(source), "prompt": _digest(prompt), "tools": _digest(tools),
            "check": _digest(cfg.correctness_func)}


def signature_tag(signature: dict[str, str]) -> str:
    """The signature as one tag value: 'source=...;held_out=...;...'."""
    return ";".join(f"{part}={signature[part]}" for part in SIGNATURE_PARTS)


def parse_signature_tag(value: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in value.split(";") if "=" in item)


def signature_differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The parts in which two signatures differ (a part one of them lacks counts as different)."""
    return [part for part in SIGNATURE_PARTS if mine.get(part) != theirs.get(part)]
