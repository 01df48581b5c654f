"""Rule-based rewards. Each reward function scores a batch: (completions, tasks) -> list of float | None.

None means "could not be scored" (e.g. the sandbox failed): the caller leaves that sample out of its
group rather than pretending it earned 0.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

from grpo_core.answers import extract_answer, math_answers_match, reasoning_gym_score
from grpo_core.task import Task

RewardFn = Callable[[Sequence[str], Sequence[Task]], list]

# The whole completion: optional reasoning, then exactly one non-empty answer block, nothing after it.
FORMAT_RE = re.compile(r"^(?:(?!<answer>|</answer>).)*<answer>(?:(?!<answer>|</answer>).)*\S(?:(?!<answer>|</answer>).)*</answer>\s*$",
                       re.DOTALL)


CODE_BLOCK_RE = {lang: re.compile(rf"^(?:(?!```).)*```{lang}[ \t]*\n(?:(?!```).)*\S(?:(?!```).)*```\s*$", re.DOTALL)
                 for lang in ("python", "rust")}


def format_reward(completions: Sequence[str], tasks: Sequence[Task]) -> list[float]:
    """1 if the completion has the shape its task asks for, else 0: math, exactly one non-empty
    <answer>...</answer> block at the end; code, exactly one non-empty ```python / ```rust block at the end."""
    return [1.0 if (FORMAT_RE if t.kind == "math" else CODE_BLOCK_RE[t.kind]).match(c) else 0.0
            for c, t in zip(completions, tasks)]


def math_accuracy(completion: str, task: Task) -> float:
    """Correctness of the tagged answer; reasoning-gym tasks use that package's own checker."""
    answer = extract_answer(completion)
    if task.meta.get("checker") == "reasoning_gym":
        return reasoning_gym_score(task.meta, answer)
    return 1.0 if math_answers_match(answer, str(task.answer)) else 0.0


def accuracy_reward(completions: Sequence[str], tasks: Sequence[Task], *, sandbox_backend: str | None = None,
                    code_reward_mode: str | None = None, **_) -> list[float | None]:
    """Correctness: the tagged answer for math tasks; hidden tests in the sandbox for code tasks
    (`sandbox_backend` auto|docker|local, `code_reward_mode` fraction|binary)."""
    out: list[float | None] = [None] * len(completions)
    code_idx = []
    for i, (c, t) in enumerate(zip(completions, tasks)):
        if t.kind == "math":
            out[i] = math_accuracy(c, t)
        else:
            code_idx.append(i)
    if code_idx:
        from grpo_core.code_rewards import code_accuracy  # imported only when code tasks are present
        scores = code_accuracy([completions[i] for i in code_idx], [tasks[i] for i in code_idx],
                               backend=sandbox_backend, mode=code_reward_mode)
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


def overlong_reward(completions: Sequence[str], tasks: Sequence[Task], *,
                    completion_lengths: Sequence[int] | None = None, max_completion_length: int | None = None,
                    overlong_buffer_length: int | None = None, **_) -> list[float]:
    """DAPO overlong soft penalty in [-1, 0] from each completion's token count (weight it with
    reward_weights). Needs the token counts (the score stage passes them); without them it is 0."""
    if completion_lengths is None or not max_completion_length:
        return [0.0] * len(completions)
    buf = overlong_buffer_length or max(1, max_completion_length // 4)
    return [overlong_penalty(n, max_completion_length, buf) for n in completion_lengths]


REWARD_FUNCS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "overlong": overlong_reward,
}

# Reward functions that take keyword context from the caller (token counts, limits, sandbox) besides the text.
CONTEXT_FUNCS = {"accuracy", "overlong"}

# The reward whose value is raw correctness (used for pass rates and dynamic sampling, never the shaped total).
CORRECTNESS_FUNC = "accuracy"


def reward_context(cfg, completion_lengths: Sequence[int]) -> dict:
    """The keyword context reward functions get from a run's config (a GRPOConfig) and the token counts."""
    return {"completion_lengths": list(completion_lengths), "max_completion_length": cfg.max_completion_length,
            "overlong_buffer_length": cfg.overlong_buffer_length, "sandbox_backend": cfg.sandbox.backend,
            "code_reward_mode": cfg.sandbox.reward_mode}


def compute_rewards(completions: Sequence[str], tasks: Sequence[Task], funcs: Sequence[str],
                    weights: Sequence[float], context: dict | None = None
                    ) -> tuple[list[float | None], dict[str, list[float | None]]]:
    """Weighted total per completion (None if any function could not score it) and each function's scores.

    `context` (e.g. completion_lengths, max_completion_length) goes to the functions in CONTEXT_FUNCS."""
    per_func = {name: REWARD_FUNCS[name](completions, tasks, **(context or {})) if name in CONTEXT_FUNCS
                else REWARD_FUNCS[name](completions, tasks) for name in funcs}
    totals: list[float | None] = []
    for i in range(len(completions)):
        vals = [per_func[name][i] for name in funcs]
        totals.append(None if any(v is None for v in vals) else sum(w * v for w, v in zip(weights, vals)))
    return totals, per_func
