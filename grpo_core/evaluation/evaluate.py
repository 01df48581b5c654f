"""Held-out evaluation, shared by the `evaluate` stage and the standalone `grpo eval` command.

For every held-out task: one greedy answer (pass@1) and `eval.num_samples` sampled answers (unbiased
pass@k for every k in `eval.ks`). Each completion is scored as the score stage scores it
(grpo_core.rewards.scoring: the run's reward functions, built-in or plugin, plus the correctness function,
always). Metrics, per mode (greedy /
sampled), overall and per source (and per task kind when the set mixes kinds):

    eval/<mode>/pass_at_<k>          greedy: k=1; sampled: every k in eval.ks
    eval/<mode>/reward/<func>        mean reward of each reward function (unscored samples left out)
    eval/<mode>/reward/total         mean weighted total reward
    eval/<mode>/completion_length    mean completion tokens (the model's own: tool responses left out)
    eval/<mode>/tokens_per_turn      the same per model turn (a tool call ends one)
    eval/<mode>/truncated_frac       fraction that hit the token limit
    eval/<mode>/unscored_frac        fraction the reward functions could not score (sandbox failures)
    eval/<mode>/accuracy             fraction of completions fully correct (older name; greedy: = pass_at_1)
    eval/<mode>/format_rate          fraction of completions in the shape their task kind asks for (the
                                     built-in `format` rule), whether or not `format` is a reward function
    eval/<mode>/strict_pass_at_1     fraction of completions both fully correct and well formatted (unscored
                                     ones left out): correct answers the format reward would not pay for
                                     show up as the gap between accuracy and this
    eval/<source>/<mode>/...         the same per source;  eval/kind_<kind>/<mode>/... per kind
    eval/<mode>/exported/..., eval/<mode>/foreign/...   the math questions as asked of an exported model, and in
                                     wordings training never used (and per source where there are several)
    eval/num_questions, eval/<source>/num_questions
    eval/monitor/...                 reward-hacking monitors (see grpo_core.evaluation.monitors)

Deterministic given the seed: generation is seeded per mode, tasks keep their file order.
`cfg` is the run's GRPOConfig (grpo_core/config.py), read by field: the config sits above this room."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections import defaultdict
from statistics import mean
from typing import Sequence

from grpo_core.task import Task
from grpo_core.evaluation.monitors import answers_shown, completion_flags, monitored_fractions
from grpo_core.evaluation.passk import mean_pass_at_k
from grpo_core.model.policy import Policy
from grpo_core.rollout.multiturn import Toolbox
from grpo_core.rewards.rewards import is_well_formatted, model_token_count
from grpo_core.rewards.scoring import GroupScorer, score_rows
from grpo_core.rollout.sampling import PromptFormat, Sample, SamplingParams, readable_conversation, sampling_options
from grpo_core.rollout.samplers import make_backend, rollout

MODES = ("greedy", "sampled")
FOREIGN = "foreign"           # rows of the math questions put in the config's foreign wordings (eval.foreign_*)
EXPORTED = "exported"         # rows of the math questions put as to an exported model (eval.exported_shape)
WORDINGS = ("", EXPORTED, FOREIGN)      # the order rows are written in


def eval_seed(cfg) -> int:
    """The generation seed of every evaluation of a run (the same each iteration: comparable numbers)."""
    return cfg.eval.seed if cfg.eval.seed is not None else cfg.seed + 12_345


def metric_name(part: str) -> str:
    """A source or kind name made safe for an MLflow metric key (one path segment)."""
    name = re.sub(r"[^\w.\- ]", "_", part) or "_"
    return f"src_{name}" if name in _RESERVED or name.startswith("kind_") else name


_RESERVED = {*MODES, FOREIGN, EXPORTED, "monitor", "num_questions"}


def eval_modes(cfg, seed: int) -> list[tuple[str, int, SamplingParams]]:
    """(mode, answers per question, params): greedy is the model's plain argmax (no repetition penalty, no
    generation_kwargs; the stop strings end it as in training); sampled draws with the training rollout's
    options (top_p, top_k, min_p, repetition_penalty, stop_strings, generation_kwargs), at eval.temperature or
    the training temperature."""
    e = cfg.eval
    max_new = e.max_completion_length or cfg.max_completion_length
    modes = []
    if e.greedy:
        modes.append(("greedy", 1, SamplingParams(max_new_tokens=max_new, greedy=True, seed=seed,
                                                      stop_strings=tuple(cfg.stop_strings))))
    if e.num_samples > 0:
        modes.append(("sampled", e.num_samples, SamplingParams(
            max_new_tokens=max_new, temperature=e.temperature or cfg.temperature, **sampling_options(cfg),
            seed=seed + 1)))
    return modes


def _verdict(acc: float | None) -> str:
    if acc is None:
        return "unscored"
    return "correct" if acc >= 1.0 else ("partial" if acc > 0 else "wrong")


def prompt_texts(cfg) -> list[str]:
    """Every text a prompt of the run may show around a question: system prompts, worked examples, instructions,
    in training's wordings and evaluation's."""
    d, e = cfg.data, cfg.eval
    return [d.system_prompt, *d.system_prompts, *(text for pair in d.few_shot for text in pair), *d.instructions,
            *e.foreign_system_prompts, *e.foreign_instructions, e.without_tools_system_prompt,
            *(text for pair in e.without_tools_few_shot for text in pair)]


def scoring_row(sample) -> dict:
    """What the score stage's reward chain reads of a sample (`grpo_core.rewards.scoring.score_rows`)."""
    return {"task_id": sample.task_id, "completion": sample.completion, "completion_ids": sample.completion_ids,
            "completion_mask": getattr(sample, "completion_mask", None), "extra": getattr(sample, "extra", None)}


def score_samples(samples, tasks_by_id: dict[str, Task], cfg, mode: str) -> list[dict]:
    """One row per completion: what the sample table shows and what the metrics are computed from. Scored as the
    score stage scores (`score_rows`), the correctness function measured among the rewards (weight 0)."""
    scored, _ = score_rows(cfg, [scoring_row(s) for s in samples], tasks_by_id, measure_correctness=True)
    return table_rows(samples, scored, tasks_by_id, cfg, mode)


def table_rows(samples, scored: Sequence[dict], tasks_by_id: dict[str, Task], cfg,
               mode: str) -> list[dict]:
    """The rows of `samples` (one evaluation pass, in its order) from their scored rows (`score_rows`): the
    scores, the verdict and the monitors' flags, length, truncation, and the conversation of a tool answer."""
    rows, seen = [], defaultdict(int)
    shown = answers_shown(prompt_texts(cfg))
    for s, score in zip(samples, scored, strict=True):
        t, acc = tasks_by_id[s.task_id], score["correct"]
        mask, extra = getattr(s, "completion_mask", None), getattr(s, "extra", None) or {}
        flags = completion_flags(s.completion, t.kind, t.prompt, shown, acc is not None and acc >= 1.0,
                                 tool_offered="turns" in extra)
        verdict = _verdict(acc) + (f" [{', '.join(flags)}]" if flags else "")
        rows.append({"mode": mode, "task_id": t.id, "source": t.source, "kind": t.kind, "sample": seen[t.id],
                     "prompt": t.prompt, "answer": t.answer, "completion": s.completion,
                     "rewards": score["rewards"], "reward_total": score["reward"],
                     "correct": None if acc is None else acc >= 1.0,
                     "formatted": is_well_formatted(s.completion, t.kind), "verdict": verdict, "flags": flags,
                     "length": model_token_count(s.completion_ids, mask),
                     "truncated": s.truncated, "tools": "turns" in extra,
                     **({"conversation": readable_conversation(extra), "messages": extra["conversation"],
                         "tool_calls": extra.get("tool_calls", 0)} if "turns" in extra else {})})
        seen[t.id] += 1
    return rows


def rescore_rows(rows: Sequence[dict], tasks_by_id: dict[str, Task], cfg) -> list[dict]:
    """Saved evaluation rows (a run's eval_samples.jsonl) scored again by today's rewards, answer check and
    monitor flags, for answers kept from before a change to any of them. One-turn answers only: a tool
    conversation's turns are not in its row."""
    if any(r.get("tools") for r in rows):
        raise ValueError("rescore_rows: rows answered with tools cannot be scored again from their text alone")
    out = []
    for r in rows:
        sample = Sample(task_id=r["task_id"], group=0, prompt_ids=[], completion_ids=[0] * r["length"],
                        completion=r["completion"], truncated=r["truncated"])
        row = score_samples([sample], tasks_by_id, cfg, r["mode"])[0]
        out.append({**row, "sample": r["sample"], **({"wording": r["wording"]} if r.get("wording") else {})})
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return mean(xs) if xs else None


def _formatted(row: dict) -> bool:
    """Rows written before `formatted` existed are judged from their text."""
    return row["formatted"] if "formatted" in row else is_well_formatted(row["completion"], row["kind"])


def _mode_metrics(rows: list[dict], mode: str, ks: Sequence[int], funcs: Sequence[str]) -> dict[str, float]:
    m: dict[str, float | None] = {}
    per_q: dict[str, list] = defaultdict(list)
    for r in rows:
        per_q[r["task_id"]].append(r["correct"])
    counts = [(sum(c is not None for c in cs), sum(c is True for c in cs)) for cs in per_q.values()]
    for k in ([1] if mode == "greedy" else ks):
        m[f"pass_at_{k}"] = mean_pass_at_k(counts, k)
    for f in funcs:
        m[f"reward/{f}"] = _mean([r["rewards"].get(f) for r in rows])
    m["reward/total"] = _mean([r["reward_total"] for r in rows])
    m["completion_length"] = mean(r["length"] for r in rows)
    m["tokens_per_turn"] = mean(r["length"] / (r.get("tool_calls", 0) + 1) for r in rows)    # a call is a turn
    m["truncated_frac"] = mean(float(r["truncated"]) for r in rows)
    m["unscored_frac"] = mean(float(r["correct"] is None) for r in rows)
    # fraction of completions fully correct (kept for dashboards that predate pass@k; = greedy pass@1)
    m["accuracy"] = _mean([None if r["correct"] is None else float(r["correct"]) for r in rows])
    m["format_rate"] = mean(float(_formatted(r)) for r in rows)
    if any("tool_calls" in r for r in rows):            # answers given with tools: how many called one
        m["tool_call_rate"] = mean(float(r.get("tool_calls", 0) > 0) for r in rows)
    m["strict_pass_at_1"] = _mean([None if r["correct"] is None else float(r["correct"] and _formatted(r))
                                   for r in rows])
    return {k: v for k, v in m.items() if v is not None}


def summarize(rows: Sequence[dict], ks: Sequence[int]) -> dict[str, float]:
    """All eval metrics from the per-completion rows (pure; the rows alone determine the numbers)."""
    if not rows:
        return {}
    funcs = list(dict.fromkeys(f for r in rows for f in r["rewards"]))
    kinds = sorted({r["kind"] for r in rows})
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)      # (prefix, infix) -> rows
    with_tools = any(r.get("tools") for r in rows)
    several_sources = len({r["source"] for r in rows}) > 1
    for r in rows:
        if r.get("wording"):             # the math questions as to an exported model, or in a foreign wording
            groups[("eval", f"{r['wording']}/")].append(r)
            if several_sources:
                groups[(f"eval/{metric_name(r['source'])}", f"{r['wording']}/")].append(r)
            continue
        if with_tools and not r.get("tools"):              # the same questions with no tool to call
            groups[("eval/without_tools", "")].append(r)
            continue
        groups[("eval", "")].append(r)
        groups[(f"eval/{metric_name(r['source'])}", "")].append(r)
        if len(kinds) > 1:
            groups[(f"eval/kind_{metric_name(r['kind'])}", "")].append(r)
    metrics: dict[str, float] = {}
    for (prefix, infix), grows in groups.items():
        metrics[f"{prefix}/{infix}num_questions"] = float(len({r["task_id"] for r in grows}))
        for mode in MODES:
            mrows = [r for r in grows if r["mode"] == mode]
            if mrows:
                metrics.update({f"{prefix}/{mode}/{infix}{k}": v
                                for k, v in _mode_metrics(mrows, mode, ks, funcs).items()})
    metrics.update(monitored_fractions([r for r in rows if not r.get("wording")], with_tools))
    return metrics


def sample_rows(policy: Policy, tasks: Sequence[Task], cfg, seed: int,
                progress: bool = True) -> list[dict]:
    """The per-completion rows of every eval mode on `tasks` (mode by mode, in task order). With
    stages.score.during_rollout each task's answers are scored on a helper thread as soon as they are sampled
    (`GroupScorer`, as the rollout stage scores: code sent to the sandbox while later answers are still being
    sampled); should that fail, and without it, everything is scored here afterwards."""
    backend = make_backend(cfg, policy, progress=progress)      # the sampler the rollout stage uses
    by_id = {t.id: t for t in tasks}
    if len(by_id) != len(tasks):
        raise ValueError("held-out tasks must have unique ids")
    scorer = GroupScorer(cfg, tasks, measure_correctness=True, what="scoring the evaluation while sampling",
                         thread_name="eval-scoring") if cfg.stages.score.during_rollout else None
    handed: dict[tuple, list[Sample]] = {}                      # (mode, tools, wording, group) -> its samples

    def hand_over(key: tuple, group: list[Sample]) -> None:
        handed[(*key, group[0].group)] = group
        scorer.add((*key, group[0].group), [scoring_row(s) for s in group])

    sampled: list[tuple[tuple, int, list[Sample]]] = []
    with scorer or contextlib.nullcontext():
        for mode, n, params, toolbox, wording, fmt in _eval_runs(cfg, seed):
            run_tasks = [t for t in tasks if t.kind == "math"] if wording else tasks
            if run_tasks:
                key = (mode, toolbox is not None, wording)
                samples = rollout(backend, policy.tokenizer, run_tasks, n, params, fmt, cfg.max_prompt_length,
                                  on_group=functools.partial(hand_over, key) if scorer else None, toolbox=toolbox)
                sampled.append((key, len(run_tasks), samples))
    early = scorer.finish() if scorer else None
    parts = []
    for key, n, samples in sampled:
        if early is None:
            parts.append((key, score_samples(samples, by_id, cfg, key[0])))
        else:
            in_order = [s for g in range(n) for s in handed[(*key, g)]]
            scored = [row for g in range(n) for row in early[0][(*key, g)]]
            parts.append((key, table_rows(in_order, scored, by_id, cfg, key[0])))
    return [{**row, "wording": key[2]} if key[2] else row for key, rows in parts for row in rows]


def _eval_runs(cfg, seed: int) -> list[tuple]:
    """(mode, n, params, toolbox, wording, prompt format) for every evaluation pass: each mode with the run's
    tools in its own prompt; when the run has tools and eval.without_tools, each mode again with none, in the
    tool-free prompt (eval.without_tools_*: no tool named, no tool call shown); with eval.exported_shape, each mode
    on the math questions as an exported model gets them (wording EXPORTED: exported_format); when the config holds
    foreign wordings, each mode on the math questions put in those (wording FOREIGN). An agent loop (rollout_func,
    an "openenv:"/"verifiers:" environment) words its own prompts: each mode once, through it."""
    toolbox, e = Toolbox.from_config(cfg), cfg.eval
    runs = [(*m, toolbox, "", cfg.data.prompt_format) for m in eval_modes(cfg, seed)]
    if toolbox is not None and toolbox.agent is not None:
        return runs
    if toolbox is not None and e.without_tools:
        tool_free = PromptFormat(e.without_tools_system_prompt, tuple(map(tuple, e.without_tools_few_shot)),
                                 template_kwargs=cfg.data.template_kwargs)
        runs += [(*m, None, "", tool_free) for m in eval_modes(cfg, seed)]
    if e.exported_shape:
        runs += [(*m, toolbox, EXPORTED, exported_format(cfg)) for m in eval_modes(cfg, seed)]
    if e.foreign_format is not None:
        foreign = dataclasses.replace(e.foreign_format, template_kwargs=cfg.data.template_kwargs)
        runs += [(*m, toolbox, FOREIGN, foreign) for m in eval_modes(cfg, seed)]
    return runs


def exported_format(cfg) -> PromptFormat:
    """A math question as a user asks an exported model (`grpo export`): the training system prompt, which the
    export's chat template adds when the user brings none, no worked examples, and the question in the user's own
    words (one of eval.foreign_instructions per question; the plain question where there are none). With tools,
    the tools are rendered as the export's template renders `tools=` (the rollout's own rendering)."""
    return PromptFormat(cfg.data.system_prompt, instructions=tuple(cfg.eval.foreign_instructions),
                        system_alone_prob=1.0, always_worded=True, template_kwargs=cfg.data.template_kwargs)


def merge_rows(tasks: Sequence[Task], parts: Sequence[Sequence[dict]]) -> list[dict]:
    """Rows that processes sampled for shares of `tasks`, in the order one process writes them."""
    position = {t.id: i for i, t in enumerate(tasks)}
    if len(position) != len(tasks):
        raise ValueError("held-out tasks must have unique ids")
    return sorted((r for part in parts for r in part),
                  key=lambda r: (WORDINGS.index(r.get("wording", "")), not r.get("tools", True),
                                 MODES.index(r["mode"]), position[r["task_id"]], r["sample"]))


def evaluate_policy(policy: Policy, tasks: Sequence[Task], cfg, seed: int | None = None,
                    progress: bool = True) -> tuple[dict, list[dict]]:
    """Metrics (overall, per source, per kind) and per-completion rows. Deterministic given `seed`
    (default: eval_seed(cfg))."""
    rows = sample_rows(policy, tasks, cfg, eval_seed(cfg) if seed is None else seed, progress)
    return summarize(rows, cfg.eval.ks), rows


def evaluate_checkpoint(cfg, tasks: Sequence[Task], checkpoint: str | None,
                        seed: int | None = None, progress: bool = True) -> tuple[dict, list[dict]]:
    """The one implementation behind the stage and `grpo eval`: load the base model (+ adapter) and
    evaluate it. `checkpoint=None` is the base model (iteration 0)."""
    from grpo_core.model.policy import load_policy
    policy = load_policy(cfg, checkpoint, need_reference=False)
    return evaluate_policy(policy, tasks, cfg, seed, progress=progress)
