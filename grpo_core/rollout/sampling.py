"""Sampling types: what a rollout asks for (`SamplingParams`, `PromptFormat`), what it returns
(`Sample`), and the one-method interface every sampling engine implements (`RolloutBackend`; the engines:
`grpo_core.rollout.engines`).

No torch here: the engines (`grpo_core.rollout.samplers`, `grpo_core.rollout.vllm_backend`) import these types, and
nothing here imports them back.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

from grpo_core.rollout.engines import ENGINES, OWN_OPTIONS, engine_name, engine_options
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
    min_p: float | None = None  # keep tokens with p >= min_p * (the top token's p), after top-k/top-p (transformers)
    repetition_penalty: float = 1.0     # tokens in the row's prompt or completion so far: logit / it if > 0, else * it
    stop_strings: tuple[str, ...] = ()  # a completion also ends once its text holds one (`StopStrings`)
    generation_kwargs: dict = field(default_factory=dict)   # engine-only options (vllm: its SamplingParams);
                                                            # `check_generation_kwargs`


# generation_kwargs keys that name one of our sampling fields (every engine takes them, and they override the field,
# as TRL's generation_kwargs override its fields), and what each engine maps: grpo_core.rollout.engines

# keys the pipeline sets itself, whatever the engine -> the fix
_PIPELINE_KEYS = {
    **dict.fromkeys(("temperature",), "set the field temperature instead: the update divides its logits by it too, "
                                      "so a sampling-only temperature would skew the loss"),
    **dict.fromkeys(("max_new_tokens", "max_length", "max_tokens"), "set max_completion_length instead"),
    **dict.fromkeys(("num_return_sequences", "n", "best_of"), "set num_generations instead"),
    **dict.fromkeys(("seed",), "set seed instead"),
    **dict.fromkeys(("do_sample", "num_beams", "num_beam_groups"),
                    "training samples every completion independently (evaluation's greedy answers: eval.greedy)"),
    **dict.fromkeys(("logprobs", "output_scores", "output_logits", "return_dict_in_generate"),
                    "the rollout asks for sampler log-probs itself when vllm_importance_sampling_correction or "
                    "off_policy_mask_threshold needs them"),
    **dict.fromkeys(("stop_strings", "stop"), "set the field stop_strings instead (every engine ends a completion "
                                              "there, and the rollout marks it as ended, not truncated)"),
    **dict.fromkeys(("pad_token_id", "eos_token_id"),
                    "a completion ends at the tokenizer's EOS token here (the rollout takes the ids from the "
                    "tokenizer)"),
}


def backend_options(backend: str) -> set[str]:
    """The generation_kwargs keys beyond OWN_OPTIONS that rollout_backend `backend` maps onto its engine (vllm:
    vLLM's SamplingParams fields; auto, fused, torch: none), less the pipeline's own."""
    return engine_options(backend) - set(_PIPELINE_KEYS) - set(OWN_OPTIONS)


def _generate_config_field(key: str) -> bool:
    """Is `key` a transformers GenerationConfig field (what the removed `hf` backend passed on)?"""
    try:
        from transformers import GenerationConfig
    except ImportError:
        return False
    return key in vars(GenerationConfig()) and not key.startswith("_")


def check_generation_kwargs(kwargs: dict, backend: str) -> None:
    """ValueError naming the first key of `kwargs` (config generation_kwargs) that rollout_backend `backend`
    does not map onto its engine, the engines that do, and the fix; the OWN_OPTIONS keys are checked by the
    caller, as the fields they override."""
    takes = {e: ", ".join(OWN_OPTIONS) + (f" and {ENGINES[e].generation_kwargs}" if backend_options(e) else " only")
             for e in ENGINES}
    name = engine_name(backend)
    for key in kwargs:
        if key in OWN_OPTIONS or key in backend_options(backend):
            continue
        if key in _PIPELINE_KEYS:
            raise ValueError(f"generation_kwargs: {key!r} is set by the pipeline; {_PIPELINE_KEYS[key]}")
        others = [e for e in ENGINES if e != name and key in backend_options(e)]
        if others:
            raise ValueError(f"generation_kwargs: {key!r} is not an option of rollout_backend: {backend} (it takes "
                             f"{takes.get(name, takes['fused'])}); rollout_backend {' or '.join(others)} accepts it: "
                             f"set that rollout_backend or remove the key")
        hint = (" It is a transformers GenerationConfig field: rollout_backend hf, which passed those to generate, "
                "was removed (issue #49)." if _generate_config_field(key) else "")
        raise ValueError(f"generation_kwargs: {key!r} is an option of no rollout engine ("
                         + "; ".join(f"{e} takes {t}" for e, t in takes.items())
                         + f").{hint} Check the spelling or remove it")


def sampling_options(cfg) -> dict:
    """The SamplingParams options a run's config sets (`cfg`: a GRPOConfig): top_p, top_k, min_p,
    repetition_penalty, each overridden by generation_kwargs where it names them (TRL), and the rest of
    generation_kwargs for the backend (with vllm_structured_outputs_regex as its structured_outputs)."""
    extra = dict(cfg.generation_kwargs or {})
    options = {k: extra.pop(k) if k in extra else getattr(cfg, k) for k in OWN_OPTIONS}
    if cfg.vllm_structured_outputs_regex is not None:
        extra["structured_outputs"] = {"regex": cfg.vllm_structured_outputs_regex}   # as vLLM's backend takes it
    return {**options, "stop_strings": tuple(cfg.stop_strings), "generation_kwargs": extra}


class StopStrings:
    """A completion also ends once its text holds one of `strings` (transformers' `stop_strings`): the string
    stays in the completion and no EOS is added. Checked after every token on the decoded tail only."""

    def __init__(self, tokenizer, strings: Sequence[str] = ()):
        self.tokenizer, self.strings = tokenizer, tuple(strings)
        # a token is at least one byte and a character at most four, so this tail holds any stop string the
        # newest token completed (+1: the tail may start inside a character)
        self.window = 4 * max(map(len, self.strings), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.strings)

    def ended(self, ids: Sequence[int]) -> bool:
        """Does the text of `ids` hold a stop string in its last tokens? Asked after each token, the first yes is
        the token that completed it."""
        if not self.strings or not ids:
            return False
        tail = self.tokenizer.decode(list(ids[-self.window:]), skip_special_tokens=False)
        return any(s in tail for s in self.strings)

    def cut(self, ids: Sequence[int]) -> list[int]:
        """`ids` up to and including the token that first completes a stop string (all of them if none does)."""
        if self.strings:
            for end in range(1, len(ids) + 1):
                if self.ended(ids[max(0, end - self.window):end]):
                    return list(ids[:end])
        return list(ids)


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


QUESTION = "{question}"                  # where an instruction template puts the question


@dataclass(frozen=True)
class PromptFormat:
    """How a math question is put to the model: system prompt, worked examples, an instruction template
    around the question (`QUESTION` marks where it goes; empty: the question as is) and a response prefix
    (e.g. "<answer>") that opens the assistant turn. Code tasks carry their own instructions and get only
    their prompt.

    A format with alternatives (`system_prompts`, `instructions`, `bare_prob`) draws one wording per
    question (`for_task`): with probability `bare_prob` a user turn alone, worded by one of the instructions
    (no system prompt, no examples); otherwise one of the system prompts and the examples, where there are
    both one of them dropped (the system prompt with probability `bare_prob`, else the examples with the same
    chance), and the question plain or worded by one of the instructions. With `system_alone_prob` set, the
    shapes are drawn with fixed chances instead: bare `bare_prob`, a system prompt without the examples
    `system_alone_prob`, the full prompt the rest (never the examples alone). The draw depends only on (`salt`,
    task id): the G answers of a group share it, a resumed run draws the same, and another salt (iteration)
    draws afresh."""
    system_prompt: str = ""
    few_shot: tuple[tuple[str, str], ...] = ()      # (question, answer) exchanges shown before the question
    response_prefix: str = ""                       # part of the prompt; counted as the completion's start
    instruction: str = ""                           # the user turn, QUESTION replaced by the question
    system_prompts: tuple[str, ...] = ()            # alternatives to system_prompt
    instructions: tuple[str, ...] = ()              # alternatives to the plain question
    bare_prob: float = 0.0                          # chance of a user turn alone (needs instructions)
    system_alone_prob: float | None = None          # chance of a system prompt without the examples
    salt: int = 0
    guided: int = 0                                 # of a group in a partial wording: answers sampled by `guide`
    always_worded: bool = False                     # every question worded by an instruction (never plain)
    template_kwargs: tuple[tuple[str, object], ...] = ()    # more apply_chat_template keywords (name, value)

    @classmethod
    def of(cls, fmt: "PromptFormat | str") -> "PromptFormat":
        return fmt if isinstance(fmt, PromptFormat) else cls(system_prompt=fmt)

    @property
    def varies(self) -> bool:
        return bool(self.system_prompts or self.instructions or self.bare_prob or self.system_alone_prob)

    def for_task(self, task: Task) -> "PromptFormat":
        """The one wording `task` is put in (code tasks: their prompt alone)."""
        if task.kind != "math":
            return PromptFormat(template_kwargs=self.template_kwargs)
        if not self.varies:
            return self
        draw = random.Random(hashlib.sha256(f"{self.salt}\0{task.id}".encode()).digest())
        systems = [s for s in (self.system_prompt, *self.system_prompts) if s]
        if self.system_alone_prob is None:          # nested draws: bare, else the examples alone, else the system
            shape = None
            bare = self.instructions and (not systems or draw.random() < self.bare_prob)
        else:                                       # one draw, a fixed chance per shape
            shape = draw.random()
            bare = self.instructions and (not systems or shape < self.bare_prob)
        if bare:
            return PromptFormat(response_prefix=self.response_prefix, instruction=draw.choice(self.instructions),
                                template_kwargs=self.template_kwargs)
        system, few_shot = (draw.choice(systems) if systems else ""), self.few_shot
        if shape is not None:
            if shape < self.bare_prob + self.system_alone_prob:
                few_shot = ()   # the shape an exported model's default chat template gives
        elif few_shot and draw.random() < self.bare_prob:
            system = ""         # the examples alone: a step between the full prompt and the bare one
        elif few_shot and system and draw.random() < self.bare_prob:
            few_shot = ()       # the system prompt alone: the format asked in words, not shown
        wordings = list(self.instructions) if self.always_worded and self.instructions else ["", *self.instructions]
        return PromptFormat(system, few_shot, self.response_prefix, draw.choice(wordings),
                            template_kwargs=self.template_kwargs)

    def guide(self, task: Task) -> "PromptFormat | None":
        """The wording `guided` answers of `task`'s group are sampled in, to be trained as answers to the wording
        it drew (`for_task`), where that one lacks the system prompt or the examples: the full prompt
        (system_prompt, the examples) around the drawn instruction. None: no guidance (none asked, a code task,
        or a full wording drawn). A bare wording alone almost never gets an answer in the asked format from a
        small model, so its group would carry no signal; guided answers in the group show it one, off-policy
        (as LUFFY's and Guide-GRPO's guidance)."""
        drawn = self.for_task(task)
        if not self.guided or task.kind != "math" or not (self.system_prompt and self.few_shot):
            return None
        if drawn.system_prompt and drawn.few_shot:
            return None
        return PromptFormat(self.system_prompt, self.few_shot, self.response_prefix, drawn.instruction,
                            template_kwargs=self.template_kwargs)

    def question(self, text: str) -> str:
        return self.instruction.replace(QUESTION, text) if self.instruction else text

    @property
    def wording(self) -> str:
        """Which kind of wording this is: "full" (a system prompt and the examples), "examples" (examples, no
        system prompt), "system" (a system prompt, no examples) or "bare" (the user turn alone)."""
        return {(True, True): "full", (False, True): "examples", (True, False): "system",
                (False, False): "bare"}[(bool(self.system_prompt), bool(self.few_shot))]


def prompt_messages(task: Task, fmt: PromptFormat | str, observation: str | None = None) -> list[dict]:
    """The chat messages that put `task` to the model: system prompt, worked examples, the question in its
    wording (with an environment's `observation` appended to it, as TRL's `reset()` text is)."""
    fmt = PromptFormat.of(fmt).for_task(task)
    messages = [{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []
    for q, a in fmt.few_shot:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": fmt.question(task.prompt) + (observation or "")})
    return messages


# How a model without a chat template (a base model) is prompted: a plain transcript, the system prompt as its
# first paragraph, then "User: ..." / "Assistant: ..." lines, a blank line after each answer, and "Assistant:"
# to open the model's turn. A base model goes on to write the next "User:" line: stop_strings (e.g. ["</answer>"])
# end its answer.
TRANSCRIPT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{%- elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + '\n\n' }}"
    "{%- else %}{{ m['role'] | capitalize + ': ' + m['content'] + '\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ 'Assistant:' }}{%- endif %}")


def chat_template_of(tokenizer) -> str:
    """The tokenizer's chat template, or TRANSCRIPT_TEMPLATE where it has none."""
    return getattr(tokenizer, "chat_template", None) or TRANSCRIPT_TEMPLATE


def render_chat(tokenizer, messages: list[dict], **template_kwargs) -> str:
    """Messages as the text the model sees before its turn (a User/Assistant transcript where the tokenizer has
    no chat template)."""
    own = {} if getattr(tokenizer, "chat_template", None) else {"chat_template": TRANSCRIPT_TEMPLATE}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **own,
                                         **template_kwargs)


def chat_prompt_ids(tokenizer, task: Task, fmt: PromptFormat | str, max_prompt_length: int) -> list[int]:
    """The task's prompt in the model's chat format (+ response prefix), as token ids (left-truncated)."""
    drawn = PromptFormat.of(fmt).for_task(task)
    return prompt_text_ids(tokenizer, render_chat(tokenizer, prompt_messages(task, drawn),
                                                  **dict(drawn.template_kwargs)), task, drawn, max_prompt_length)


def prompt_text_ids(tokenizer, text: str, task: Task, fmt: PromptFormat | str, max_prompt_length: int) -> list[int]:
    """Rendered prompt text + the format's response prefix, as token ids (left-truncated)."""
    ids = tokenizer(text + PromptFormat.of(fmt).for_task(task).response_prefix, add_special_tokens=False)["input_ids"]
    return list(ids)[-max_prompt_length:]
