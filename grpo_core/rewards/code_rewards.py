"""Code rewards: completion text -> sandbox job -> verdict -> reward.

The only bridge between GRPO and ``sandbox/`` (which knows nothing about GRPO):

* :func:`extract_code` takes the code out of a completion (last ```python / ```rust block,
  sensible fallbacks; nothing found -> "" which the sandbox scores as a failed run, not a crash).
* :func:`build_job` turns a :class:`~grpo_core.task.Task` + completion into a ``sandbox.Job``.
* :func:`verdict_reward` maps a verdict to a reward in [0, 1]:
  Python: pass fraction (``mode="fraction"``) or all-or-nothing (``mode="binary"``);
  Rust: staged build / clippy / tests with weights (default 1 / 1 / 2, normalised), or binary; code the
  tests do not build against (it defines nothing they call: a comment, an unrelated item) earns 0.
  An ``infra_error`` verdict gives ``None``: the caller drops the sample instead of scoring 0.
* :func:`code_accuracy` does all of it for a batch (the ``accuracy`` reward's code half).

A run passes its config's ``sandbox.reward_mode`` and ``sandbox.backend``; a call without them scores by pass
fraction on the default backend (``sandbox.api.get_backend``).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

from grpo_core.task import Task

log = logging.getLogger(__name__)

RUST_STAGE_WEIGHTS = (1.0, 1.0, 2.0)   # build, clippy, tests (Oxen.ai's 1 / 1 / 2)
MODES = ("fraction", "binary")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_OPENING = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n")   # where _FENCE can start
_LANG_TAGS = {"python": {"python", "py", "python3"}, "rust": {"rust", "rs"}}


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``_FENCE.findall(text)`` in linear time. A fence after the last newline cannot open a block, so the
    search for an opening stops there: findall tried each fence of such a line up to its end (13 s for a
    line of 33 000 fences)."""
    blocks, pos, end = [], 0, text.rfind("\n") + 1
    while (opening := _OPENING.search(text, pos, end)) is not None:
        block = _FENCE.match(text, opening.start())
        blocks.append(block.groups())
        pos = block.end()
    return blocks


def extract_code(completion: str, language: str) -> str:
    """The code in a completion: the last fenced block tagged for ``language``; else the last
    untagged fenced block; else the whole text if it looks like code; else ""."""
    if not completion:
        return ""
    blocks = [(tag.lower(), body) for tag, body in _fenced_blocks(completion)]
    tagged = [b for t, b in blocks if t in _LANG_TAGS.get(language, {language})]
    if tagged:
        return tagged[-1].strip("\n")
    untagged = [b for t, b in blocks if not t]
    if untagged:
        return untagged[-1].strip("\n")
    if blocks:
        return ""  # only blocks in another language: nothing to run
    # Indentation within the line only: `^\s*` from every line start ran over all the blank lines after it
    # (quadratic: 17 s for 40 000 newlines).
    marker = (r"^[^\S\n]*(def|class|import|from)\s" if language == "python"
              else r"^[^\S\n]*(pub\s+)?(fn|struct|enum|impl|use)\s")
    return completion.strip("\n") if re.search(marker, completion, re.M) else ""


def build_job(task: Task, completion: str, limits: Any = None):
    """A sandbox job for one completion of a code task (a Rust task's with its entry point's signature pinned:
    `Task.sandbox_tests`)."""
    from sandbox.types import Job
    if task.kind not in ("python", "rust"):
        raise ValueError(f"task {task.id!r} has kind {task.kind!r}; only python and rust tasks run in the sandbox")
    return Job(language=task.kind, code=extract_code(completion, task.kind), tests=task.sandbox_tests(),
               entry_point=task.entry_point, limits=limits, id=task.id)


def verdict_reward(verdict, mode: str = "fraction",
                   rust_weights: Sequence[float] = RUST_STAGE_WEIGHTS) -> float | None:
    """Reward in [0, 1] for a verdict, or None for ``infra_error`` (drop the sample)."""
    if mode not in MODES:
        raise ValueError(f"code reward mode {mode!r}: use one of {MODES}")
    if verdict.status == "infra_error":
        return None
    if mode == "binary":
        return 1.0 if verdict.status == "pass" else 0.0
    if not verdict.stages:  # Python
        return verdict.pass_fraction
    w_build, w_clippy, w_test = (float(w) for w in rust_weights)
    total = w_build + w_clippy + w_test
    if total <= 0:
        raise ValueError("rust_weights must sum to a positive number")
    if verdict.stages.get("test") is not None and verdict.stages["test"].status == "error":
        return 0.0  # the tests did not build against the code: no build or lint credit for '// todo'
    built = verdict.stages["build"].status == "pass"
    linted = verdict.stages["clippy"].status == "pass"
    return (w_build * built + w_clippy * linted + w_test * (verdict.pass_fraction if built else 0.0)) / total


@dataclass
class CodeScore:
    reward: float | None
    verdict: Any            # sandbox.api.Verdict (status, tests, stages, detail, stdout/stderr)


def score_code(completions: Sequence[str], tasks: Sequence[Task], mode: str | None = None,
               backend: str | None = None, rust_weights: Sequence[float] = RUST_STAGE_WEIGHTS,
               retries: int = 1, workers: int | None = None, images: dict[str, str] | None = None) -> list[CodeScore]:
    """Run every (completion, task) pair in the sandbox; infra errors are retried ``retries``
    times, then their reward is None, unless the sandbox's engine is down: then this raises
    ``sandbox.backends.EngineUnavailable`` (transient: the stage is retried once the engine may be back)
    rather than drop every sample. ``mode``: config sandbox.reward_mode (None: fraction); ``backend``: config
    sandbox.backend (None: ``get_backend``'s default); ``images``: Docker image per language (config
    sandbox.images)."""
    from sandbox.api import get_backend, score_batch
    mode = mode or "fraction"
    backend = get_backend(backend, images or None)
    jobs = [build_job(t, c) for c, t in zip(completions, tasks)]
    verdicts = score_batch(jobs, backend=backend, workers=workers)
    for _ in range(retries):
        again = [i for i, v in enumerate(verdicts) if v.status == "infra_error"]
        if not again:
            break
        log.warning("sandbox infra_error on %d job(s) (%s); retrying", len(again), verdicts[again[0]].detail)
        for i, v in zip(again, score_batch([jobs[i] for i in again], backend=backend, workers=workers)):
            verdicts[i] = v
    if any(v.status == "infra_error" for v in verdicts):
        backend.check_engine()
    return [CodeScore(verdict_reward(v, mode, rust_weights), v) for v in verdicts]


def code_accuracy(completions: Sequence[str], tasks: Sequence[Task], **kw) -> list[float | None]:
    """Rewards for code tasks (None = could not be scored, leave the sample out)."""
    return [s.reward for s in score_code(completions, tasks, **kw)]
