"""Export a trained policy as a plain Hugging Face model directory that needs neither peft nor this
project: the LoRA adapter merged into the base weights, the tokenizer with its chat template, a
`generation_config.json` with the sampling settings used in training, and a model card (README.md)
that states the prompt format the model was trained behind. The chat template puts the training system
prompt (and, if asked, the worked examples) before a conversation that brings no system message, so
the exported model is prompted as in training by default.

`--adapter-only` exports the adapter instead (adapter files + tokenizer + the same generation config
and card); it needs the base model and peft to load.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from grpo_core.io import atomic_dir
from grpo_core.models import ModelError, load_base_model, load_tokenizer
from grpo_core.sampling import chat_template_of

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
                f"## Sampling settings (generation_config.json)\n"
                f"```json\n{json.dumps(self.sampling, indent=2)}\n```\n"
                + ("Training ended an answer at its first stop string: pass the tokenizer to `generate` "
                   "(`model.generate(..., tokenizer=tokenizer)`), which transformers needs to apply them.\n"
                   if self.sampling.get("stop_strings") else "") + "\n"
                f"## Held-out evaluation\n```\n{self.eval_table or '(not evaluated)'}\n```\n")


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


def export_model(base_dir: str | Path, adapter_dir: str | Path, out: str | Path, card: ModelCard,
                 sampling: dict, adapter_only: bool = False, overwrite: bool = False) -> Path:
    """Write the export into `out` (all or nothing: built in a temp dir, then renamed into place)."""
    base_dir, adapter_dir, out = Path(base_dir), Path(adapter_dir), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --overwrite")
    card.sampling, card.merged = sampling, not adapter_only

    def build(tmp: Path) -> None:
        tokenizer = load_tokenizer(adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_dir)
        tokenizer.padding_side = "left"
        # a base model without a chat template was prompted with the transcript one: the export carries it
        tokenizer.chat_template = chat_template_of(tokenizer)
        if card.default_turns or card.template_defaults:
            tokenizer.chat_template = with_default_turns(tokenizer.chat_template, card.default_turns,
                                                         card.template_defaults)
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
