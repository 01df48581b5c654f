"""Sampling types: what a rollout asks for (`SamplingParams`, `PromptFormat`), what it returns
(`Sample`), and the one-method interface every rollout backend implements (`RolloutBackend`).

No torch here: the backends (`grpo_core.rollout`, `grpo_core.vllm_backend`) import these types, and
nothing here imports them back.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

from grpo_core.task import Task


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int = 0
    logprobs: bool = False      # also return each sampled token's log-prob under the sampler (`Completion`)


@dataclass
class Sample:
    """One completion. Token ids are kept so the update never re-tokenises (what was sampled is scored)."""
    task_id: str
    group: int                  # index of the prompt in this batch; samples of a group share it
    prompt_ids: list[int]
    completion_ids: list[int]   # including the EOS token when the model stopped by itself
    completion: str             # decoded, special tokens removed
    truncated: bool             # hit max_new_tokens without EOS
    extra: dict = field(default_factory=dict)
    sampler_logprobs: list[float] | None = None   # per completion token, when SamplingParams.logprobs
    completion_mask: list[int] | None = None      # multi-turn: 1 on the model's own tokens, 0 on tool turns

    def to_dict(self) -> dict:
        return asdict(self)


def model_token_count(completion_ids: Sequence[int], completion_mask: Sequence[int] | None) -> int:
    """The completion tokens the model wrote: all of them, or those its multi-turn mask marks (a tool turn's
    tokens are context, not the model's)."""
    return len(completion_ids) if completion_mask is None else sum(completion_mask)


def readable_conversation(extra: dict) -> str:
    """A multi-turn completion (`Sample.extra["conversation"]`) as text for the completion tables: each turn
    under its role."""
    parts = []
    for m in extra.get("conversation", []):
        head = f"[{m['role']}" + (f" {m['name']}]" if m.get("name") else "]")
        parts.append(f"{head}\n{m['content']}")
    return "\n\n".join(parts)


class Completion(list):
    """One sampled completion: its token ids (a plain list of int to every reader) and, when
    SamplingParams.logprobs asked for them, the log-prob of each token under the distribution the
    sampler drew it from (after temperature, top-k and top-p; for greedy decoding, the plain softmax).
    The trainer compares these with its own log-probs (the sampler/trainer importance correction)."""

    def __init__(self, ids=(), logprobs: list[float] | None = None):
        super().__init__(ids)
        self.logprobs = logprobs


class RolloutBackend(Protocol):
    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[list[list[int]]]:
        """For each prompt (token ids), n completions (token ids, EOS included if emitted); with
        params.logprobs each is a `Completion` carrying its sampler log-probs."""


@dataclass(frozen=True)
class PromptFormat:
    """How a math question is put to the model: system prompt, worked examples, and a response prefix
    (e.g. "<answer>") that opens the assistant turn. Code tasks carry their own instructions and get
    only their prompt."""
    system_prompt: str = ""
    few_shot: tuple[tuple[str, str], ...] = ()      # (question, answer) exchanges shown before the question
    response_prefix: str = ""                       # part of the prompt; counted as the completion's start

    @classmethod
    def of(cls, fmt: "PromptFormat | str") -> "PromptFormat":
        return fmt if isinstance(fmt, PromptFormat) else cls(system_prompt=fmt)

    def for_task(self, task: Task) -> "PromptFormat":
        return self if task.kind == "math" else PromptFormat()


def prompt_messages(task: Task, fmt: PromptFormat | str, observation: str | None = None) -> list[dict]:
    """The chat messages that put `task` to the model: system prompt, worked examples, the question (with an
    environment's `observation` appended to it, as TRL's `reset()` text is)."""
    fmt = PromptFormat.of(fmt).for_task(task)
    messages = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
    for q, a in fmt.few_shot:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": task.prompt + (observation or "")})
    return messages


def render_chat(tokenizer, messages: list[dict], **template_kwargs) -> str:
    """Messages as the text the model sees before its turn (plain paragraphs where there is no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return "\n\n".join(m["content"] for m in messages) + "\n"


def chat_prompt_ids(tokenizer, task: Task, fmt: PromptFormat | str, max_prompt_length: int) -> list[int]:
    """The task's prompt in the model's chat format (+ response prefix), as token ids (left-truncated)."""
    return prompt_text_ids(tokenizer, render_chat(tokenizer, prompt_messages(task, fmt)), task, fmt,
                           max_prompt_length)


def prompt_text_ids(tokenizer, text: str, task: Task, fmt: PromptFormat | str, max_prompt_length: int) -> list[int]:
    """Rendered prompt text + the format's response prefix, as token ids (left-truncated)."""
    ids = tokenizer(text + PromptFormat.of(fmt).for_task(task).response_prefix, add_special_tokens=False)["input_ids"]
    return list(ids)[-max_prompt_length:]
