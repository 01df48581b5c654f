"""A verifiers 0.4 taskset's tasks: the rows of `environment: "verifiers:<taskset id>"`'s taskset, as Tasks.

Options: `taskset`, the taskset's options as in the run's environment_config.taskset, with its `id` (a module
importable by a top-level name); `limit`, the first n tasks only. Each row is a Task whose prompt is the row's
prompt text (its last user turn, for a chat prompt), whose answer is the row's `answer` field as text, any text
(the environment's rewards judge an episode, so curation does not parse it, as meta["checker"] = "verifiers" says;
a row without one is rejected as not verifiable; evaluation's correctness_func compares the model's answer with
it, so set correctness_func to a check of your own where that means nothing), and whose meta["verifiers_task"] is
the row itself (its TaskData, dumped), from which grpo_core.rollout.verifiers_env rebuilds the verifiers task.
"""
from __future__ import annotations

import json
from importlib.util import find_spec
from itertools import islice
from typing import Any, Iterator

from grpo_core.data.records import Rejection
from grpo_core.data.sources.files import row_to_task
from grpo_core.plugins import PluginError
from grpo_core.task import VERIFIERS_TASK, Task


def load(taskset: dict[str, Any] | None = None, limit: int | None = None, seed: int = 0) -> Iterator[Task | Rejection]:
    """Tasks of a verifiers taskset (taskset: {id: ..., its options}), in the taskset's order."""
    tasks = _taskset(taskset)
    for i, vf_task in enumerate(islice(tasks, limit)):
        data = vf_task.data
        answer = getattr(data, "answer", None)
        row = {"id": f"verifiers/{tasks.config.id}/{data.id or data.idx}", "prompt": prompt_text(data.prompt),
               "answer": None if answer is None else str(answer),
               "meta": {VERIFIERS_TASK: data.model_dump(mode="json"), "checker": "verifiers"}}
        yield row_to_task(row, "verifiers", f"verifiers taskset {tasks.config.id!r}", i, license="unknown")


def _taskset(options: dict[str, Any] | None):
    if not isinstance(options, dict) or not isinstance(options.get("id"), str):
        raise PluginError("source verifiers: `taskset` must be a mapping with the taskset's `id` (and its options, "
                          "as in environment_config.taskset), e.g. {name: verifiers, taskset: {id: calc_taskset}}")
    if find_spec("verifiers") is None:
        raise PluginError("source verifiers needs the verifiers package, which is not installed. Fix: pip install "
                          "'verifiers==0.4.0' (or pip install -e '.[envs]')")
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
    try:
        return load_taskset(taskset_config_type(options["id"]).model_validate(options))
    except Exception as e:  # noqa: BLE001 - a missing module, a bad option (pydantic), the taskset's own error
        first = " ".join(str(e).strip().splitlines()[:3])
        raise PluginError(f"source verifiers: taskset {options['id']!r} cannot be loaded with "
                          f"{json.dumps(options)}: {type(e).__name__}: {first}") from e


def prompt_text(prompt: Any) -> str:
    """A row's prompt as text: the string, or its last user turn's text (the question after any examples)."""
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    turns = [m for m in prompt if (m.get("role") if isinstance(m, dict) else getattr(m, "role", "")) == "user"]
    content = (turns[-1].get("content") if isinstance(turns[-1], dict) else turns[-1].content) if turns else ""
    return content if isinstance(content, str) else json.dumps(content, default=str)
