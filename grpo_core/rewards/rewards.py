"""Rewards: the built-in reward functions and `compute_rewards`, which runs any configured set of them.

Every reward function, built-in or plugin (grpo_core.plugins), has TRL's signature

    f(prompts, completions, **columns) -> list[float | None]

`prompts` are the tasks' questions (the user turn, no chat template), `completions` the model's answers,
and `columns` one equal-length list per Task field other than the prompt (id, kind, source, answer, tests,
entry_point, meta, ...), one per key of the tasks' `meta` that clashes with nothing (None where a task lacks
it), plus the run context (CONTEXT_KEYS: token ids and counts, the length limits, the sandbox settings). A
function without **kwargs gets only the columns it names. None means "cannot score this one" (e.g. the
sandbox failed): that sample's total is None and the caller leaves it out of its group rather than
pretending it earned 0. `async def` functions run concurrently with each other (and with the plain ones).
Not here: GRPO advantages (grpo_core.update.loss) and where the scores are written or logged (tasks/score.py).
"""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

from grpo_core.rewards.answers import extract_answer, math_answers_match, reasoning_gym_score
from grpo_core.plugins import REWARD_GROUP, check_reward_signature, load_plugin, metric_names
from grpo_core.task import Task

# The whole completion: optional reasoning, then exactly one non-empty answer block, nothing after it. The block's
# first non-space character may not start a tag or fence either (else '<answer></answer></answer>' passed), and it is
# found after white space only, so the match takes linear time (an unclosed block took quadratic: 10 s at 32 kB).
FORMAT_RE = re.compile(r"^(?:(?!<answer>|</answer>).)*<answer>\s*(?!<answer>|</answer>)\S(?:(?!<answer>|</answer>).)*"
                       r"</answer>\s*$", re.DOTALL)
CODE_BLOCK_RE = {lang: re.compile(rf"^(?:(?!```).)*```{lang}[ \t]*\n\s*(?!```)\S(?:(?!```).)*```\s*$", re.DOTALL)
                 for lang in ("python", "rust")}

TASK_COLUMNS = tuple(f.name for f in fields(Task) if f.name != "prompt")
CONTEXT_KEYS = ("completion_ids", "completion_lengths", "max_completion_length", "overlong_buffer_length",
                "sandbox_backend", "code_reward_mode", "sandbox_images")
KNOWN_COLUMNS = frozenset(TASK_COLUMNS + CONTEXT_KEYS)


class RewardOutputError(ValueError):
    """A reward function returned something that is not one finite number (or None) per completion."""


# -- built-in reward functions --------------------------------------------------------------------------


def is_well_formatted(completion: str, kind: str) -> bool:
    """The shape a task kind asks for: math, exactly one non-empty <answer>...</answer> block at the end;
    code, exactly one non-empty ```python / ```rust block at the end."""
    return bool((FORMAT_RE if kind == "math" else CODE_BLOCK_RE[kind]).match(completion))


def format_reward(prompts: Sequence[str], completions: Sequence[str], kind: Sequence[str], **_) -> list[float]:
    """1 if the completion has the shape its task kind asks for (is_well_formatted), else 0."""
    return [1.0 if is_well_formatted(c, k) else 0.0 for c, k in zip(completions, kind)]


def math_accuracy(completion: str, task: Task) -> float:
    """Correctness of the tagged answer, 1 or 0: `math_answers_match`, or for reasoning-gym tasks
    `reasoning_gym_score` (the same numeric check where the gold answer is a number, else the dataset's
    own checker at full credit only)."""
    answer = extract_answer(completion)
    if task.meta.get("checker") == "reasoning_gym":
        return reasoning_gym_score(task.meta, answer)
    return 1.0 if math_answers_match(answer, str(task.answer)) else 0.0


def tasks_from_columns(prompts: Sequence[str], columns: dict[str, Any]) -> list[Task]:
    """The Task objects back from the prompts and the Task-field columns (for the built-ins)."""
    present = [f for f in TASK_COLUMNS if f in columns]
    return [Task(prompt=p, **{f: columns[f][i] for f in present}) for i, p in enumerate(prompts)]


def accuracy_reward(prompts: Sequence[str], completions: Sequence[str], *, sandbox_backend: str | None = None,
                    code_reward_mode: str | None = None, sandbox_images: dict[str, str] | None = None,
                    **columns) -> list[float | None]:
    """Correctness: the tagged answer for math tasks; hidden tests in the sandbox for code tasks
    (`sandbox_backend` auto|docker|local, `code_reward_mode` fraction|binary, `sandbox_images` the Docker
    image per language)."""
    tasks = tasks_from_columns(prompts, columns)
    out: list[float | None] = [None] * len(completions)
    code_idx = []
    for i, (c, t) in enumerate(zip(completions, tasks)):
        if t.kind == "math":
            out[i] = math_accuracy(c, t)
        else:
            code_idx.append(i)
    if code_idx:
        from grpo_core.rewards.code_rewards import code_accuracy  # imported only when code tasks are present
        scores = code_accuracy([completions[i] for i in code_idx], [tasks[i] for i in code_idx],
                               backend=sandbox_backend, mode=code_reward_mode, images=sandbox_images)
        for i, s in zip(code_idx, scores):
            out[i] = s
    return out


def overlong_penalty(length: int, max_completion_length: int, buffer_length: int) -> float:
    """DAPO's soft overlong punishment for a completion of `length` tokens (L_max, L_cache = buffer):
    0 up to L_max - L_cache, then linearly down to -1 at L_max, and -1 beyond it."""
    expected = max_completion_length - buffer_length
    if length <= expected:
        return 0.0
    if length <= max_completion_length:
        return (expected - length) / buffer_length
    return -1.0


def overlong_reward(prompts: Sequence[str], completions: Sequence[str], *,
                    completion_lengths: Sequence[int] | None = None, max_completion_length: int | None = None,
                    overlong_buffer_length: int | None = None, **_) -> list[float]:
    """DAPO overlong soft penalty in [-1, 0] from each completion's token count (weight it with
    reward_weights). Needs the token counts (the score stage passes them); without them it is 0."""
    if completion_lengths is None or not max_completion_length:
        return [0.0] * len(completions)
    buf = overlong_buffer_length or max(1, max_completion_length // 4)
    return [overlong_penalty(n, max_completion_length, buf) for n in completion_lengths]


REWARD_FUNCS: dict[str, Callable[..., list]] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "overlong": overlong_reward,
}

# The default reward whose value is raw correctness (pass rates, dynamic sampling; never the shaped total).
# A run may name another one: GRPOConfig.correctness_func.
CORRECTNESS_FUNC = "accuracy"


def model_token_count(completion_ids: Sequence[int], completion_mask: Sequence[int] | None) -> int:
    """The completion tokens the model wrote: all of them, or those its multi-turn mask marks (a tool turn's
    tokens are context, not the model's)."""
    return len(completion_ids) if completion_mask is None else sum(completion_mask)


# -- resolving config entries -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardFunc:
    entry: str                      # as written in reward_funcs
    name: str                       # metric name: reward/<name>, sys/reward_seconds/<name>
    fn: Callable[..., Any]
    accepts: frozenset[str] | None  # keyword columns it takes (None: all, it has **kwargs)
    is_async: bool
    origin: str                     # "built-in", "package.module:function" or the distribution of an entry point


def resolve_reward(entry: str, field: str, name: str | None = None) -> RewardFunc:
    """The reward function a reward_funcs entry names (built-in, "pkg.mod:fn" or entry point), checked."""
    if entry in REWARD_FUNCS:
        fn, origin = REWARD_FUNCS[entry], "built-in"
    else:
        plugin = load_plugin(entry, REWARD_GROUP, field, REWARD_FUNCS)
        fn, origin = plugin.obj, plugin.origin
    accepts = check_reward_signature(fn, entry, field, KNOWN_COLUMNS)
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return RewardFunc(entry, name or entry, fn, accepts, is_async, origin)


def resolve_reward_funcs(entries: Sequence[str]) -> list[RewardFunc]:
    """Every reward_funcs entry resolved, each with its unique metric name; a PluginError names the bad one."""
    return [resolve_reward(e, f"reward_funcs[{i}]", name)
            for i, (e, name) in enumerate(zip(entries, metric_names(entries)))]


# -- running them -------------------------------------------------------------------------------------------


def reward_context(cfg, completion_ids: Sequence[Sequence[int]],
                   completion_masks: Sequence[Sequence[int] | None] | None = None) -> dict:
    """The run context reward functions get: token ids and counts (of the model's own tokens, where a
    multi-turn completion's mask sets tool turns apart), and settings from the run's GRPOConfig."""
    masks = completion_masks or [None] * len(completion_ids)
    return {"completion_ids": [list(ids) for ids in completion_ids],
            "completion_lengths": [model_token_count(ids, m) for ids, m in zip(completion_ids, masks)],
            "max_completion_length": cfg.max_completion_length, "overlong_buffer_length": cfg.overlong_buffer_length,
            "sandbox_backend": cfg.sandbox.backend, "code_reward_mode": cfg.sandbox.reward_mode,
            "sandbox_images": dict(cfg.sandbox.images)}


def reward_columns(tasks: Sequence[Task], context: dict | None = None) -> dict[str, Any]:
    """The keyword columns for a batch: Task fields, non-clashing meta keys, then the run context."""
    columns: dict[str, Any] = {f: [getattr(t, f) for t in tasks] for f in TASK_COLUMNS}
    reserved = KNOWN_COLUMNS | {"prompt", "prompts", "completions"}
    meta_keys = dict.fromkeys(k for t in tasks for k in (t.meta or {}) if isinstance(k, str) and k not in reserved)
    columns.update({k: [(t.meta or {}).get(k) for t in tasks] for k in meta_keys})
    columns.update(context or {})
    return columns


def check_scores(name: str, values: Any, n: int, entry: str | None = None) -> list[float | None]:
    """`values` as one float (or None) per completion; anything else is a RewardOutputError naming `name`
    (and the reward_funcs `entry` it came from, when that says more)."""
    src = f' (reward_funcs entry "{entry}")' if entry and entry != name else ""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise RewardOutputError(f"reward function {name!r} returned a {type(values).__name__}; return a list with "
                                f"one float (or None: cannot score) per completion{src}")
    values = list(values)
    if len(values) != n:
        raise RewardOutputError(f"reward function {name!r} returned {len(values)} scores for {n} completions; "
                                f"return exactly one per completion (None where it cannot score){src}")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is not None and not isinstance(v, numbers.Real):
            raise RewardOutputError(f"reward function {name!r} returned a {type(v).__name__} ({v!r:.40}) for "
                                    f"completion {i}; return a float, or None for 'cannot score this one'{src}")
        if v is not None and not math.isfinite(float(v)):
            raise RewardOutputError(f"reward function {name!r} returned {float(v)} for completion {i}; return a "
                                    f"finite float, or None for 'cannot score this one'{src}")
        out.append(None if v is None else float(v))
    return out


def _blame(e: Exception, func: RewardFunc) -> None:
    """Name the function an exception came from: a note for the traceback and, on a plugin's exception,
    `reward_func` = its reward_funcs entry, so that `plugin_failure` can report it as the user's error."""
    e.add_note(f"in reward function {func.name!r} ({func.origin})")
    if func.origin != "built-in":
        try:
            e.reward_func = func.entry
        except AttributeError:     # an exception type without a __dict__
            pass


def plugin_failure(exc: BaseException) -> str | None:
    """One line for an exception raised inside a plugin reward function (None when it was not one)."""
    entry = getattr(exc, "reward_func", None)
    if entry is None:
        return None
    return (f'reward function "{entry}" (reward_funcs) raised {type(exc).__name__}: {exc}. Fix the function or '
            f"remove it from reward_funcs (`grpo --debug ...` shows its traceback)")


def _kwargs_for(func: RewardFunc, columns: dict[str, Any]) -> dict[str, Any]:
    return dict(columns) if func.accepts is None else {k: v for k, v in columns.items() if k in func.accepts}


def _run_async(funcs: Sequence[RewardFunc], prompts: list, completions: list, columns: dict) -> list[tuple[Any, float]]:
    """Await every async function concurrently in a fresh event loop (the caller may already be inside one)."""
    async def timed(func: RewardFunc) -> tuple[Any, float]:
        t0 = time.perf_counter()
        try:
            return await func.fn(prompts, completions, **_kwargs_for(func, columns)), time.perf_counter() - t0
        except Exception as e:
            _blame(e, func)
            raise

    async def all_of() -> list[tuple[Any, float]]:
        return list(await asyncio.gather(*(timed(f) for f in funcs)))
    return asyncio.run(all_of())


def _run_sync(func: RewardFunc, prompts: list, completions: list, columns: dict) -> tuple[Any, float]:
    t0 = time.perf_counter()
    try:
        return func.fn(prompts, completions, **_kwargs_for(func, columns)), time.perf_counter() - t0
    except Exception as e:
        _blame(e, func)
        raise


@dataclass
class RewardScores:
    totals: list[float | None]                  # weighted sum per completion; None if any function gave None
    per_func: dict[str, list[float | None]]     # metric name -> one score per completion
    seconds: dict[str, float]                   # metric name -> wall-clock seconds the function took


def compute_rewards(completions: Sequence[str], tasks: Sequence[Task], funcs: Sequence[str],
                    weights: Sequence[float], context: dict | None = None) -> RewardScores:
    """Run the reward functions `funcs` (reward_funcs entries) on (task, completion) pairs and weight them.

    `context`: the run context (reward_context). The async functions run on a helper thread while the plain
    ones run here, in order."""
    resolved = resolve_reward_funcs(funcs)
    prompts, completions = [t.prompt for t in tasks], list(completions)
    columns = reward_columns(tasks, context)
    async_funcs = [f for f in resolved if f.is_async]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-rewards") as pool:
        pending = pool.submit(_run_async, async_funcs, prompts, completions, columns) if async_funcs else None
        outputs = {f.name: _run_sync(f, prompts, completions, columns) for f in resolved if not f.is_async}
        if pending is not None:
            outputs.update({f.name: out for f, out in zip(async_funcs, pending.result())})
    per_func = {f.name: check_scores(f.name, outputs[f.name][0], len(completions), f.entry) for f in resolved}
    totals: list[float | None] = []
    for i in range(len(completions)):
        vals = [per_func[f.name][i] for f in resolved]
        totals.append(None if any(v is None for v in vals) else sum(w * v for w, v in zip(weights, vals)))
    return RewardScores(totals, per_func, {f.name: outputs[f.name][1] for f in resolved})


def add_environment_rewards(scores: RewardScores, environment_rewards: Sequence[dict | None]) -> RewardScores:
    """The environments' own rewards (multi-turn rollouts: `get_reward()`, one {class name: value} per sample
    or None) as extra reward sources with weight 1, as TRL adds them. A sample of another environment gets
    None in that column and nothing added; one whose own environment said None (it could not score, e.g.
    the sandbox failed) gets a None total, and is left out of its group as any unscorable sample is."""
    names = list(dict.fromkeys(k for r in environment_rewards if r for k in r))
    for name in names:
        owns = [bool(r) and name in r for r in environment_rewards]
        values = [r[name] if own else None for r, own in zip(environment_rewards, owns)]
        scores.per_func[name] = values
        scores.seconds.setdefault(name, 0.0)
        scores.totals = [None if t is None or (own and v is None) else t + (v or 0.0)
                         for t, v, own in zip(scores.totals, values, owns)]
    return scores


def correctness_scores(scores: RewardScores, funcs: Sequence[str], completions: Sequence[str],
                       tasks: Sequence[Task], context: dict | None = None,
                       correctness_func: str = CORRECTNESS_FUNC) -> list[float | None]:
    """Raw correctness per completion (`correctness_func`'s value): reused when it is one of `funcs`,
    computed otherwise."""
    if correctness_func in funcs:
        return scores.per_func[metric_names(funcs)[list(funcs).index(correctness_func)]]
    name = metric_names([correctness_func])[0]
    return compute_rewards(completions, tasks, [correctness_func], [1.0], context).per_func[name]