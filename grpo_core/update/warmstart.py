"""Warm start (the "cold start" of DeepSeek-R1): before GRPO, put into the weights what the worked examples show.

A small model does what its prompt's worked examples show (call the calculator, write the tags) and nothing of it
without them, so GRPO on the full prompt teaches a habit that lives in the prompt. Here the policy first answers
training questions in the full prompt, as GRPO's rollouts do; the answers the run's own rewards judge correct
and well formed become demonstrations of the same questions asked *without* the examples (the shape an exported
model's chat template gives: the system prompt, the question plain or in one of the training instructions, the
run's tools); a few epochs of supervised fine-tuning (next-token loss on the model's own tokens; tool turns are
context) move the behaviour into the LoRA adapter. The demonstrations are the model's own answers, checked by the
reward; or, where a model writes none right (a program for the `python` tool), the exchange each question's
reference call makes (`meta["call"]`, e.g. the program a generated question was computed with): the call, the tool's
real result, that result as the answer, judged by the same rewards before it is kept (warmstart.demonstrations).
Torch and the project's sampler and scorer; no Prefect, no MLflow.
`cfg` is the run's GRPOConfig (grpo_core/config.py), read by field: the config sits above this room."""
from __future__ import annotations

import logging
import random
from collections import defaultdict
from typing import Sequence

import torch

from grpo_core.update.logprobs import completion_logprobs
from grpo_core.rollout.multiturn import Episode, Toolbox, tool_prompt_ids, tool_turn_ids
from grpo_core.rollout.tools import call_text, run_tool_calls
from grpo_core.model.policy import Policy
from grpo_core.rewards.rewards import is_well_formatted
from grpo_core.rollout.samplers import make_backend, rollout
from grpo_core.rollout.sampling import PromptFormat, Sample, SamplingParams, chat_prompt_ids, sampling_options
from grpo_core.rewards.scoring import score_rows
from grpo_core.task import Task
from grpo_core.update.step import ScoredSample, pad_batch

log = logging.getLogger(__name__)


def demonstration_format(cfg) -> PromptFormat:
    """The prompt the demonstrations are trained under: the system prompt without the worked examples, the
    question plain or in one of data.instructions (drawn per question)."""
    d = cfg.data
    return PromptFormat(d.system_prompt, (), d.prompt_format.response_prefix, instructions=tuple(d.instructions),
                        system_alone_prob=1.0, template_kwargs=d.template_kwargs)


def _prompt_ids(tokenizer, task: Task, fmt: PromptFormat, cfg, toolbox: Toolbox | None) -> list[int]:
    if toolbox is None:
        return chat_prompt_ids(tokenizer, task, fmt, cfg.max_prompt_length)
    return tool_prompt_ids(tokenizer, task, fmt, cfg.max_prompt_length, list(toolbox.toolset(None).values()))


def correct_answers(samples: Sequence[Sample], tasks: Sequence[Task], cfg, per_question: int) -> list[int]:
    """Indices of the samples the run's rewards judge correct (correctness 1) and well formed, at most
    `per_question` of each question (the first ones: the variety of many questions over copies of a few)."""
    by_id = {t.id: t for t in tasks}
    scored, _ = score_rows(cfg, [s.to_dict() for s in samples], by_id)
    kept, per_task = [], defaultdict(int)
    for i, (s, sc) in enumerate(zip(samples, scored)):
        task = by_id[s.task_id]
        if sc["correct"] == 1 and is_well_formatted(s.completion, task.kind) and per_task[task.id] < per_question:
            kept.append(i)
            per_task[task.id] += 1
    return kept


def as_demonstrations(tokenizer, kept: Sequence[Sample], tasks: Sequence[Task], cfg,
                      toolbox: Toolbox | None) -> list[ScoredSample]:
    """Each kept answer (its tokens as sampled, tool turns masked) re-attached to its question's prompt in
    demonstration_format: the training pairs of the warm start."""
    by_id, fmt = {t.id: t for t in tasks}, demonstration_format(cfg)
    return [ScoredSample(group=i, prompt_ids=_prompt_ids(tokenizer, by_id[s.task_id], fmt, cfg, toolbox),
                         completion_ids=s.completion_ids, reward=1.0, truncated=s.truncated,
                         completion_mask=s.completion_mask) for i, s in enumerate(kept)]


REFERENCE_CALLS_AT_ONCE = 16   # a rollout's batch of calls runs at once; 128 at once (each a sandbox box) timed out


def reference_call(task: Task, tool_names) -> dict | None:
    """The task's reference call ({"name", "arguments"}: a call of one of the run's tools, `tool_names`, that computes
    the answer), or None where it has none or names a tool the run does not have."""
    call = (task.meta or {}).get("call")
    if isinstance(call, dict) and call.get("name") in tool_names and isinstance(call.get("arguments"), dict):
        return call
    return None


def reference_samples(tokenizer, tasks: Sequence[Task], cfg, toolbox: Toolbox) -> list[Sample]:
    """The exchange each task's reference call makes, as a rollout of it would look: the call as the model's first
    turn, the tool's own result (run as a rollout's calls run, in the sandbox where the tool uses one), then that
    result as the answer in tags. Tasks without a reference call are skipped; the run's rewards judge the rest
    (correct_answers), so a reference that computes something else never becomes a demonstration."""
    fmt, eos, toolset = demonstration_format(cfg), tokenizer.eos_token_id, toolbox.toolset(None)
    chosen = [(t, c) for t in tasks if (c := reference_call(t, toolset)) is not None]

    def turn(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]

    episodes = []
    for task, call in chosen:
        episode = Episode()
        episode.add_model_turn(turn(call_text(call)), None, tokenizer, fmt.for_task(task).response_prefix)
        episodes.append(episode)
    results = []
    for start in range(0, len(episodes), REFERENCE_CALLS_AT_ONCE):
        batch = episodes[start:start + REFERENCE_CALLS_AT_ONCE]
        results += run_tool_calls([e.pending for e in batch], [toolset] * len(batch), toolbox.timeout)
    if failed := [r[0] for r in results if r[0].error]:
        log.warning("%d of %d reference calls failed in the tool (those questions get no demonstration); the first: "
                    "%s", len(failed), len(results), failed[0].content[:300])
    samples = []
    for group, ((task, _), episode, result) in enumerate(zip(chosen, episodes, results)):
        episode.add_tool_turn(result, tool_turn_ids(tokenizer, result, dict(fmt.template_kwargs)))
        answer = "" if result[0].error else result[0].content.strip()
        episode.add_model_turn(turn(f"<answer>{answer}</answer>"), None, tokenizer)
        samples.append(Sample(task_id=task.id, group=group, prompt_ids=[], completion_ids=episode.ids,
                              completion=episode.turns[-1], truncated=episode.truncated,
                              extra={**episode.record(), "reference": True},
                              completion_mask=episode.mask))
    return samples


def collect_demonstrations(policy: Policy, tasks: Sequence[Task], cfg, seed: int,
                           progress: bool = True) -> tuple[list[ScoredSample], list[Sample], dict[str, float]]:
    """The warm start's demonstrations (warmstart.demonstrations): `policy`, num_generations answers sampled per
    task in the full prompt; `reference`, each task's reference exchange (reference_samples); `both`, the two.
    The correct ones are kept (correct_answers) and made demonstrations (as_demonstrations).
    -> (demonstrations, the kept samples as sampled, statistics)."""
    toolbox, source = Toolbox.from_config(cfg), cfg.warmstart.demonstrations
    samples: list[Sample] = []
    if source in ("policy", "both"):
        params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                **sampling_options(cfg), seed=seed)
        samples = rollout(make_backend(cfg, policy, progress=progress), policy.tokenizer, tasks,
                          cfg.num_generations, params, cfg.data.prompt_format, cfg.max_prompt_length, toolbox=toolbox)
    kept = [samples[i] for i in correct_answers(samples, tasks, cfg, cfg.warmstart.max_per_question)]
    references: list[Sample] = []
    if source in ("reference", "both"):
        references = reference_samples(policy.tokenizer, tasks, cfg, toolbox)
        if not references:
            raise ValueError(f"warmstart.demonstrations is {source!r}, but none of the {len(tasks)} warm-start "
                             "questions has a reference call (meta.call: {\"name\": <one of the run's tools>, "
                             "\"arguments\": {...}}, as tool_problems questions carry); use demonstrations: policy")
        kept += [references[i] for i in correct_answers(references, tasks, cfg, 1)]
    demos = as_demonstrations(policy.tokenizer, kept, tasks, cfg, toolbox)
    stats = {"questions": float(len(tasks)), "answers": float(len(samples)), "demonstrations": float(len(demos)),
             "questions_demonstrated": float(len({s.task_id for s in kept})),
             **({"references": float(len(references)),
                 "references_kept": float(sum(s.extra.get("reference", False) for s in kept))}
                if source != "policy" else {})}
    return demos, kept, stats


def sft_loss(policy: Policy, batch: Sequence[ScoredSample], fp32_head: bool = False) -> torch.Tensor:
    """Mean negative log-likelihood of the model's own completion tokens (tool turns masked out) given their
    prompts (`fp32_head`: cast_lm_head_to_fp32)."""
    tok = policy.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    input_ids, attention_mask, completion_mask = pad_batch(batch, pad, policy.device)    # [b, T], [b, T], [b, Lc]
    logp, _ = completion_logprobs(policy.model, input_ids, attention_mask, completion_mask.shape[1],
                                  fp32_head=fp32_head)                                   # [b, Lc]
    return -(logp * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)


def supervised_finetune(policy: Policy, demos: Sequence[ScoredSample], epochs: int, batch_size: int,
                        learning_rate: float, max_grad_norm: float, seed: int, progress=None,
                        fp32_head: bool = False) -> list[float]:
    """`epochs` passes over the demonstrations in shuffled batches, one AdamW step each. -> the loss of every step."""
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=learning_rate, foreach=True)
    order, rng, losses = list(range(len(demos))), random.Random(seed), []
    policy.model.train()
    for _ in range(epochs):
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            loss = sft_loss(policy, [demos[i] for i in order[start:start + batch_size]], fp32_head)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if progress is not None:
                progress.update(1)
    return losses
