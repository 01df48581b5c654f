"""Export a trained policy as a plain Hugging Face model directory that needs neither peft nor this
project: the LoRA adapter merged into the base weights, the tokenizer with its chat template, a
`generation_config.json` with the sampling settings used in training, and a model card (README.md)
that states the prompt format the model was trained behind. The chat template puts the training system
prompt (and, if asked, the worked examples) before a conversation that brings no system message, so
the exported model is prompted as in training by default. For a run with tools, the template also renders
the standard `tools=` argument and tool turns the way training rendered them (`with_tool_turns`), and the
export checks that it does before writing anything.

`--adapter-only` exports the adapter instead (adapter files + tokenizer + the same generation config
and card); it needs the base model and peft to load.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from grpo_core.errors import ConfigError
from grpo_core.io import atomic_dir
from grpo_core.model.loading import ModelError, load_base_model, load_tokenizer
from grpo_core.rollout.multiturn import _render_tool_turn, renders_tools, tool_prompt_ids   # training's own renderings
from grpo_core.rollout.sampling import PromptFormat, chat_template_of
from grpo_core.task import Task
from grpo_core.rollout.tools import FALLBACK_INSTRUCTIONS, Tool, ToolResult, call_text, parse_tool_calls, standard

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass
class ModelCard:
    """What the README of an exported model says about it."""
    base_model: str
    run_name: str
    mlflow_run_id: str | None
    iteration: int
    system_prompt: str = ""
    few_shot: list[tuple[str, str]] = field(default_factory=list)
    response_prefix: str = ""
    default_turns: list[dict] = field(default_factory=list)   # what the chat template adds without a system turn
    template_defaults: dict = field(default_factory=dict)     # the chat_template_kwargs training rendered with
    eval_table: str = ""
    sampling: dict = field(default_factory=dict)
    merged: bool = True           # False: the directory holds the adapter, not merged weights
    tools: list[dict] = field(default_factory=list)           # the schemas of the run's tools (config `tools`)
    environment: str | dict | None = None                     # the run's environment, whose methods are tools too
    tool_exchange: str = ""       # training's text of one tool exchange without worked examples (exported_tokenizer)
    tools_in_template: bool = False   # the exported chat template renders `tools=` (exported_tokenizer)

    def render(self) -> str:
        shots = "".join(f"- user: {q!r}\n  assistant: {a!r}\n" for q, a in self.few_shot) or "(none)\n"
        prefix = (f"The assistant turn was opened with {self.response_prefix!r}: start the reply with it, as "
                  f"training did.\n" if self.response_prefix else
                  "None: the model writes its whole answer, tags included, itself.\n")
        default = ("When the caller's messages bring no system message, the exported chat template puts "
                   + ("the system prompt and the worked examples" if len(self.default_turns) > 1 else
                      "the system prompt")
                   + " before them, so `apply_chat_template([{'role': 'user', ...}])` prompts as training did; a "
                     "system message of your own replaces them.\n" if self.default_turns else
                   "The chat template is the base model's: give the system prompt yourself.\n")
        if self.template_defaults:
            default += (f"Training rendered prompts with the template variables {self.template_defaults!r}; the "
                        f"exported template uses them unless `apply_chat_template` is given others.\n")
        how = ("LoRA merged into the weights; load with `transformers.AutoModelForCausalLM.from_pretrained` "
               "(no peft needed)." if self.merged else
               f"LoRA adapter only; load with `peft.PeftModel.from_pretrained` on `{self.base_model}`.")
        return (f"# {self.run_name} (iteration {self.iteration})\n\n"
                f"GRPO-trained from `{self.base_model}` with grpo-pipeline. {how}\n"
                f"MLflow run: `{self.mlflow_run_id or '-'}`.\n\n"
                f"## Prompt format used in training\n"
                f"Math questions were put through the tokenizer's chat template as below; code tasks were "
                f"given only their own prompt.\n\n"
                f"System prompt: {self.system_prompt!r}\n\nFew-shot exchanges before the question:\n{shots}\n"
                f"Response prefix: {prefix}\n{default}\n"
                + self.render_tools() +
                f"## Sampling settings (generation_config.json)\n"
                f"```json\n{json.dumps(self.sampling, indent=2)}\n```\n"
                + ("Training ended an answer at its first stop string: pass the tokenizer to `generate` "
                   "(`model.generate(..., tokenizer=tokenizer)`), which transformers needs to apply them.\n"
                   if self.sampling.get("stop_strings") else "") + "\n"
                f"## Held-out evaluation\n```\n{self.eval_table or '(not evaluated)'}\n```\n")

    def render_tools(self) -> str:
        """The card's tools section: how to pass them, how to give results back, and training's exact text of one
        exchange without worked examples."""
        if not self.tools and self.environment is None:
            return ""
        schemas = "".join(f"```json\n{json.dumps(s, ensure_ascii=False)}\n```\n" for s in self.tools)
        environment = ("" if self.environment is None else
                       f"The run's environment ({self.environment!r}) talked to the model through chat completions, "
                       f"as an agent loop: prompt it with that environment's turns, as training did.\n\n"
                       if standard(self.environment) else
                       f"The run's environment ({self.environment!r}) adds tools of its own: pass its public methods "
                       f"(all but reset and get_reward) in `tools=` as well, and append the text its `reset()` returns "
                       f"to the question, as training did.\n\n")
        template = ("The exported chat template renders `tools=` and tool turns as training did" +
                    ("; load the tokenizer from this directory, not from the base model.\n" if not self.merged else
                     ".\n") if self.tools_in_template else
                    "This export keeps the base model's chat template, which does not render `tools=` as training "
                    "did: build the prompt below yourself.\n")
        return ("## Tools\n"
                "Pass the tools the standard way, `tokenizer.apply_chat_template(messages, tools=[schema, ...], "
                "add_generation_prompt=True)`, with these schemas (or the Python functions themselves: transformers "
                "builds the same schemas from their type hints and docstrings):\n\n" + schemas + "\n" + environment +
                "The model calls a tool by writing `<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>`; "
                "training ended its turn there (cut the reply after `</tool_call>`, or pass "
                "`stop_strings=[\"</tool_call>\"], tokenizer=tokenizer` to `generate`). Run the call, append the reply "
                "as `{\"role\": \"assistant\", \"content\": reply}` (or in the structured `tool_calls` form) and the "
                "result as `{\"role\": \"tool\", \"content\": result}` (several results: one tool message each), "
                "and render again. "
                + template + "\n"
                "One exchange in the prompt without worked examples, exactly as training rendered it (`{question}`: "
                "the user's message, `{result}`: the tool's answer" + ("" if self.tools else ", `environment_method`: "
                                                                      "the environment's methods") + ")"
                + self._exchange_from() + ":\n\n"
                f"```text\n{self.tool_exchange}\n```\n\n")

    def _exchange_from(self) -> str:
        """Which messages give the card's exchange through the exported template."""
        if not self.tools_in_template:
            return ""
        if len(self.default_turns) == 1:         # the system prompt alone is the default turn
            return "; the template gives it for a user message alone, with `tools=`"
        return ("; the template gives it for the training system prompt as your own system message and a user "
                "message, with `tools=`" + (" (a user message alone also gets the worked examples)"
                                             if self.default_turns else ""))


def generation_settings(temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                        min_p: float | None = None, repetition_penalty: float = 1.0,
                        stop_strings: Sequence[str] = ()) -> dict:
    """The training sampling settings as `generation_config.json` fields (min_p and stop_strings only where
    set; with stop_strings, transformers' generate needs `tokenizer=` as well)."""
    settings = {"do_sample": temperature > 0, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "max_new_tokens": max_new_tokens, "repetition_penalty": repetition_penalty}
    if min_p is not None:
        settings["min_p"] = min_p
    if stop_strings:
        settings["stop_strings"] = list(stop_strings)
    return settings


def default_turns(system_prompt: str, few_shot=()) -> list[dict]:
    """The turns the exported chat template puts before a conversation that brings no system message: the
    training system prompt, then (optionally) its worked examples."""
    turns = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for q, a in few_shot:
        turns += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return turns


def with_default_turns(chat_template: str, turns: list[dict], variables: dict | None = None) -> str:
    """`chat_template` that renders `turns` before the caller's messages when these bring no system message of
    their own (a caller's system message wins: the template is then unchanged there), and that gives each of
    `variables` (training's chat_template_kwargs) its training value unless the caller passes it."""
    prefix = "".join("{%- if " + name + " is not defined %}{%- set " + name + " = " + _jinja_literal(value)
                     + " %}{%- endif %}" for name, value in (variables or {}).items())
    if turns:               # JSON is a valid Jinja literal for lists of string dicts
        prefix += ("{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = "
                   + json.dumps(turns) + " + messages %}{%- endif %}")
    return prefix + chat_template


# -- tools: the exported template renders `tools=` as training rendered them ---------------------------------

def with_tool_turns(chat_template: str) -> str:
    """`chat_template` for a model trained with tools that it cannot render itself (SmolLM2's): a preamble rewrites
    the conversation into the turns training wrote (grpo_core.rollout.multiturn), then hands it to the template unchanged:
    - a `tools=` list goes into the system message in the fallback format (`_with_system`: the caller's or the
      default system prompt, a blank line, `fallback_system_prompt`; a system message of its own where none);
    - a run of tool messages becomes one user turn of `<tool_response>` blocks joined by newlines;
    - an assistant message with structured `tool_calls` becomes the text the model wrote:
      `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (json.dumps' spacing; arguments given as a JSON
      string are put in as they are) right after its content, as the model wrote its text before a call (one
      call closed its turn in training; several are put on lines of their own).
    The template itself then sees no `tools`, as in training."""
    head, tail = (_jinja_literal(part.format()) for part in FALLBACK_INSTRUCTIONS.split("{tools}"))
    return (
        "{%- set grpo = namespace(turns=[], results=[]) %}"
        "{%- for m in messages %}"
        "{%- if m['role'] == 'tool' %}"
        "{%- set body = m['content'] if m['content'] is string else m['content'] | tojson %}"
        "{%- set grpo.results = grpo.results + ['<tool_response>\\n' + body + '\\n</tool_response>'] %}"
        "{%- else %}"
        "{%- if grpo.results %}"
        "{%- set grpo.turns = grpo.turns + [{'role': 'user', 'content': grpo.results | join('\\n')}] %}"
        "{%- set grpo.results = [] %}"
        "{%- endif %}"
        "{%- if m['role'] == 'assistant' and m['tool_calls'] %}"
        "{%- set calls = namespace(texts=[]) %}"
        "{%- for c in m['tool_calls'] %}"
        "{%- set f = c['function'] if c['function'] is defined else c %}"
        "{%- set args = f['arguments'] if f['arguments'] is defined else {} %}"
        "{%- if args is string %}"
        "{%- set call = '{\"name\": ' + f['name'] | tojson + ', \"arguments\": ' + args + '}' %}"
        "{%- else %}{%- set call = {'name': f['name'], 'arguments': args} | tojson %}{%- endif %}"
        "{%- set calls.texts = calls.texts + ['<tool_call>' + call + '</tool_call>'] %}"
        "{%- endfor %}"
        "{%- set said = m['content'] or '' %}"
        "{%- set grpo.turns = grpo.turns + [{'role': 'assistant', 'content': said + calls.texts | join('\\n')}] %}"
        "{%- else %}{%- set grpo.turns = grpo.turns + [m] %}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if grpo.results %}"
        "{%- set grpo.turns = grpo.turns + [{'role': 'user', 'content': grpo.results | join('\\n')}] %}"
        "{%- endif %}"
        "{%- if tools %}"
        "{%- set listing = " + head + " + tools | map('tojson') | join('\\n') + " + tail + " %}"
        "{%- if grpo.turns and grpo.turns[0]['role'] == 'system' %}"
        "{%- set grpo.turns = [{'role': 'system', 'content': grpo.turns[0]['content'] + '\\n\\n' + listing}]"
        " + grpo.turns[1:] %}"
        "{%- else %}{%- set grpo.turns = [{'role': 'system', 'content': listing}] + grpo.turns %}{%- endif %}"
        "{%- endif %}"
        "{%- set messages = grpo.turns %}{%- set tools = none %}"
        + chat_template)


QUESTION, RESULT = "{question}", "{result}"           # the placeholders of the card's example exchange
# Where the tools are all an environment's methods (known only once it exists), a stand-in for their schemas.
STAND_IN_SCHEMA = {"type": "function", "function": {
    "name": "environment_method", "description": "Stands in for the schemas of the environment's methods.",
    "parameters": {"type": "object", "properties": {"argument": {"type": "string", "description": "an argument"}},
                   "required": ["argument"]}}}


def example_call(schemas: Sequence[dict], few_shot=()) -> dict:
    """The call of the card's example exchange: the worked examples' first call, else the first tool's, no arguments."""
    for _, answer in few_shot:
        calls = [c for c in parse_tool_calls(answer) if c.error is None]
        if calls:
            return {"name": calls[0].name, "arguments": calls[0].arguments}
    return {"name": (list(schemas) or [STAND_IN_SCHEMA])[0]["function"]["name"], "arguments": {}}


def training_exchange(tokenizer, schemas: Sequence[dict], fmt: PromptFormat, call: dict,
                      result: str = RESULT) -> tuple[list[int], str]:
    """How training put one exchange to the model (grpo_core.rollout.multiturn's own functions): the prompt's token ids
    for the question QUESTION in `fmt` (response prefix left out), and the text after them up to the model's next
    turn (its call, its end-of-turn token, the tool turn)."""
    task = Task(id="export-probe", kind="math", source="export", prompt=QUESTION, answer="")
    tools = [Tool(s["function"]["name"], _never_called, s) for s in schemas]
    prompt_ids = tool_prompt_ids(tokenizer, task, dataclasses.replace(fmt, response_prefix=""), 10**9, tools)
    answered = ToolResult(call["name"], result, False, 0.0)
    turn = _render_tool_turn(tokenizer, [answered], native=renders_tools(tokenizer), **dict(fmt.template_kwargs))
    return prompt_ids, call_text(call) + (tokenizer.eos_token or "") + turn


def _never_called(**_) -> str:          # the tools of a rendering: their schemas only
    raise AssertionError("an export renders tools, it never calls them")


def check_tool_template(exported, trained, schemas: Sequence[dict], fmt: PromptFormat, model: str) -> None:
    """The exported tokenizer renders a user message alone, with `tools=`, as training rendered the question in
    `fmt` (the default turns' format); without native tool support also the next turn (the call in the
    structured `tool_calls` form, its result as a tool message). Else one ConfigError line saying where."""
    schemas = list(schemas) or [STAND_IN_SCHEMA]
    call = example_call(schemas)
    structured = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    kwargs = dict(fmt.template_kwargs)
    try:
        prompt_ids, turn = training_exchange(trained, schemas, fmt, call)
        asked = exported.apply_chat_template([{"role": "user", "content": QUESTION}], tools=schemas,
                                             add_generation_prompt=True, tokenize=False, **kwargs)
        both = exported.apply_chat_template([{"role": "user", "content": QUESTION}, structured,
                                             {"role": "tool", "content": RESULT}], tools=schemas,
                                            add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the answer: it cannot render tool turns
        raise ConfigError(_untemplatable(model, trained, f"the template fails: {e}")) from None
    if list(exported(asked, add_special_tokens=False)["input_ids"]) != prompt_ids:
        why = _first_difference("the prompt", trained.decode(prompt_ids), asked)
        raise ConfigError(_untemplatable(model, trained, why))
    if not renders_tools(trained) and both != asked + turn:
        raise ConfigError(_untemplatable(model, trained, _first_difference("the tool turn", asked + turn, both)))


def _first_difference(what: str, trained: str, exported: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(trained, exported)) if a != b), min(len(trained), len(exported)))
    return f"{what} differs from training's at character {at}: {trained[at:at + 30]!r} in training, " \
           f"{exported[at:at + 30]!r} from the template"


def _untemplatable(model: str, tokenizer, why: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        why = ("it has no chat template, and training put tool results in as bare paragraphs between the model's "
               "turns, which no chat template reproduces")
    return (f"the run was trained with tools, but the chat template of {model} cannot render them as training did "
            f"({why}). Fix: export with --no-default-system to keep the base template and build the tool prompt "
            f"yourself as the model card shows")


def _jinja_literal(value) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    return json.dumps(value)


def _write_generation_config(out: Path, tokenizer, settings: dict) -> None:
    from transformers import GenerationConfig
    GenerationConfig(**settings, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)


def _merged_model(base_dir: Path, adapter_dir: Path):
    from peft import PeftModel
    if not (adapter_dir / "adapter_config.json").exists():
        raise ModelError(f"{adapter_dir} holds no LoRA adapter (adapter_config.json missing)")
    base = load_base_model(base_dir, torch.device("cpu"), torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def _format_of(turns: list[dict], template_defaults: dict) -> PromptFormat:
    """The prompt format whose question the default turns go before (training's, in that shape)."""
    system = turns[0]["content"] if turns and turns[0]["role"] == "system" else ""
    shots = turns[1:] if system else turns
    return PromptFormat(system, tuple((q["content"], a["content"]) for q, a in zip(shots[::2], shots[1::2])),
                        template_kwargs=tuple(sorted(template_defaults.items())))


def exported_tokenizer(source: Path, card: ModelCard, tool_template: bool = True):
    """The training tokenizer (from `source`) with the chat template the export carries: the transcript one where
    it has none (what training prompted with), the tool turns of a run with tools (`with_tool_turns`, unless the
    template renders tools itself; checked against training's rendering), the default turns and training's
    template variables. Fills the card's tool fields. `tool_template=False` leaves tools to the caller."""
    trained, tokenizer = load_tokenizer(source), load_tokenizer(source)
    tokenizer.padding_side = "left"
    template = chat_template_of(tokenizer)
    tool_run, native = bool(card.tools) or card.environment is not None, renders_tools(trained)
    card.tools_in_template = tool_run and (tool_template or native)
    if tool_run and tool_template and not native:
        template = with_tool_turns(template)
    if card.default_turns or card.template_defaults:
        template = with_default_turns(template, card.default_turns, card.template_defaults)
    tokenizer.chat_template = template
    if tool_run and tool_template:
        check_tool_template(tokenizer, trained, card.tools, _format_of(card.default_turns, card.template_defaults),
                            card.base_model)
    if tool_run:
        alone = _format_of(default_turns(card.system_prompt), card.template_defaults)
        ids, turn = training_exchange(trained, card.tools or [STAND_IN_SCHEMA], alone,
                                      example_call(card.tools, card.few_shot))
        card.tool_exchange = trained.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) + turn
    return tokenizer


def export_model(base_dir: str | Path, adapter_dir: str | Path, out: str | Path, card: ModelCard,
                 sampling: dict, adapter_only: bool = False, overwrite: bool = False,
                 tool_template: bool = True) -> Path:
    """Write the export into `out` (all or nothing: built in a temp dir, then renamed into place).
    `tool_template=False`: a run with tools keeps the base template, which leaves the tool list to the caller."""
    base_dir, adapter_dir, out = Path(base_dir), Path(adapter_dir), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --overwrite")
    card.sampling, card.merged = sampling, not adapter_only

    def build(tmp: Path) -> None:
        source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_dir
        tokenizer = exported_tokenizer(source, card, tool_template)
        if adapter_only:
            for name in ADAPTER_FILES:
                if (adapter_dir / name).exists():
                    shutil.copy2(adapter_dir / name, tmp / name)
        else:
            model = _merged_model(base_dir, adapter_dir)
            model.save_pretrained(tmp, safe_serialization=True)
            config = json.loads((tmp / "config.json").read_text())
            config.pop("quantization_config", None)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        _write_generation_config(tmp, tokenizer, sampling)
        (tmp / "README.md").write_text(card.render())

    return atomic_dir(out, build, replace=overwrite)
