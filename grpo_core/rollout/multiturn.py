"""Multi-turn rollouts: the model's turns alternate with tool (or environment) turns.

A rollout is one conversation. The model answers; when its answer holds tool calls (`<tool_call>{...}
</tool_call>`, parsed by grpo_core.rollout.tools), every call of the batch runs at once, the results are appended as a
tool turn in the chat template's own format, and the model goes on from there. It stops when it answers
without a tool call, after `max_tool_calling_iterations` rounds of calls, or when its token budget
(`max_completion_length`, counted over its own tokens only) runs out.

The completion is every token after the prompt. `Sample.completion_mask` marks the model's own tokens (1)
apart from the tool turns (0): those are context only, with no loss, no KL and no statistic. Rewards judge
the model's last turn (its answer); an environment with `get_reward()` judges the whole episode, and its
score is kept in `Sample.extra["environment_reward"]`.

The turns are driven in one place for every engine (`drive_turns`). With our own loop (the fused and torch
engines, every decode path) the turns are streamed: a row whose turn ends waits in
the KV cache while its calls run on worker threads and the other rows decode; its tool turn is then fed
after its own cache, so no turn re-encodes the conversation. By default the calls of a step run during the
next decode step and the batch then waits for them, so a seed gives the same rollouts bit for bit (a killed
iteration resumes exactly); with `tool_calls_overlap` the other rows keep decoding for as long as the calls
take (faster with slow tools, but the rollouts then depend on timing). `TurnController` steers the sampler's
loop, `KVCacheSampler._interact_batch`. Other engines (`vllm`) run the calls of a round together and
re-encode each conversation for the next turn in one batched prefill, as TRL does. The tools, environments
and their contract (TRL's) are in grpo_core.rollout.tools; the samplers in grpo_core.rollout.samplers.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from grpo_core.rollout.sampling import PromptFormat, Sample, SamplingParams, prompt_messages, prompt_text_ids, render_chat
from grpo_core.task import Task
from grpo_core.rollout.tools import (Tool, ToolResult, check_environment, environment_tools, fallback_system_prompt,
                                     parse_tool_calls, resolve_environments, resolve_tools, run_tool_calls)

log = logging.getLogger(__name__)


@dataclass
class Toolbox:
    """What the model may call in a rollout: standalone tools, and environments (one instance per rollout)."""
    tools: list[Tool]
    environments: dict[str | None, Callable[[], object]] | None = None   # {None: factory} or {name: factory}
    max_iterations: int | None = None          # rounds of tool calls per rollout (None: until the budget ends)
    timeout: float = 30.0                      # seconds per tool call
    overlap: bool = False                      # rows keep decoding while calls run (not reproducible bit for bit)
    agent: str | None = None                   # config rollout_func, or an "openenv:"/"verifiers:" environment:
    agent_options: dict | None = None          # an agent loop drives every turn instead (its environment_config)
    agent_concurrency: int = 32                # agent loops run at once (grpo_core/rollout/agents.py)
    agent_timeout: float | None = None         # seconds one agent rollout may run (None: no limit)

    @classmethod
    def from_config(cls, cfg, tools: Sequence[str] | None = None) -> "Toolbox | None":
        """The run's toolbox (`tools`, `environment`), or None when the model may call nothing. `tools`
        overrides the config's list (evaluation with and without tools)."""
        if tools is None and cfg.agent_loop:
            return cls([], agent=cfg.agent_loop, agent_options=cfg.environment_config,
                       agent_concurrency=cfg.generation_batch_size, agent_timeout=cfg.rollout_timeout)
        entries = list(cfg.tools if tools is None else tools)
        environment = cfg.environment if tools is None else None
        if not entries and environment is None:
            return None
        envs = resolve_environments(environment, cfg.sandbox) if environment is not None else None
        return cls(resolve_tools(entries, cfg.sandbox), envs, cfg.max_tool_calling_iterations, cfg.tool_timeout,
                   cfg.tool_calls_overlap)

    def environment_for(self, task: Task) -> object | None:
        """A fresh environment for one rollout of `task` (a dict of environments: chosen by `meta.environment`)."""
        if self.environments is None:
            return None
        name = None if None in self.environments else (task.meta or {}).get("environment")
        if name not in self.environments:
            raise ValueError(f"task {task.id!r}: meta.environment is {name!r}, which names no environment; use one "
                             f"of {', '.join(map(repr, self.environments))} (config field environment)")
        environment = self.environments[name]()
        check_environment(environment, "environment" if name is None else f"environment.{name}")
        return environment

    def toolset(self, environment: object | None) -> dict[str, Tool]:
        """The tools one rollout may call: the standalone ones and its environment's methods."""
        tools = self.tools + (environment_tools(environment) if environment is not None else [])
        return {t.name: t for t in tools}


# -- the chat template's tool format ---------------------------------------------------------------------

_PROBE = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                           "parameters": {"type": "object", "properties": {}}}}


def renders_tools(tokenizer) -> bool:
    """Does the chat template render a tool list and a tool-call conversation itself (Qwen, Llama 3, ...)?
    If not (SmolLM2's), the tools go into the system prompt in the documented fallback format."""
    cached = getattr(tokenizer, "_grpo_renders_tools", None)
    if cached is None:
        cached = False
        if getattr(tokenizer, "chat_template", None):
            try:
                listed = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE],
                                                       tokenize=False, add_generation_prompt=True)
                probe = ToolResult("probe_tool_7f3a", "probe_result_9c2d", False, 0.0)
                answered = _render_tool_turn(tokenizer, [probe], native=True)
                cached = "probe_tool_7f3a" in listed and "probe_result_9c2d" in answered
            except Exception:  # noqa: BLE001 - any template error means: render tools ourselves
                cached = False
        try:
            tokenizer._grpo_renders_tools = cached
        except AttributeError:
            pass
    return cached


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def tool_prompt_ids(tokenizer, task: Task, fmt: PromptFormat, max_prompt_length: int, tools: Sequence[Tool],
                    observation: str | None = None) -> list[int]:
    """The task's prompt with the tools it may call (the template's own format, else the fallback system
    prompt) and an environment's `reset()` text appended to the question."""
    text = render_with_tools(tokenizer, prompt_messages(task, fmt, observation), [t.schema for t in tools],
                             **dict(fmt.for_task(task).template_kwargs))
    ids = prompt_text_ids(tokenizer, text, task, fmt, max_prompt_length + 1)
    if len(ids) > max_prompt_length and not _warned_long:
        _warned_long.append(task.id)
        log.warning("task %s: its prompt with the tool list is longer than max_prompt_length (%d tokens) and loses "
                    "its beginning, where the tools are listed; raise max_prompt_length", task.id, max_prompt_length)
    return ids[-max_prompt_length:]


def render_with_tools(tokenizer, messages: list[dict], schemas: Sequence[dict], **template_kwargs) -> str:
    """Messages and the tools' schemas as the text before the model's turn: the template's own tool format, else
    the fallback system prompt (`renders_tools`)."""
    if not schemas:
        return render_chat(tokenizer, messages, **template_kwargs)
    if renders_tools(tokenizer):
        return render_chat(tokenizer, messages, tools=list(schemas), **template_kwargs)
    return render_chat(tokenizer, _with_system(messages, fallback_system_prompt(schemas)), **template_kwargs)


_warned_long: list[str] = []          # the long-prompt warning is given once per process


def _render_tool_turn(tokenizer, results: Sequence[ToolResult], native: bool, **template_kwargs) -> str:
    """The text between the model's end-of-turn token and its next turn: the tool results, then the opening of
    the model's turn (`template_kwargs`: the run's chat_template_kwargs)."""
    if native:
        turn = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    else:
        turn = [{"role": "user", "content": "\n".join(f"<tool_response>\n{r.content}\n</tool_response>"
                                                      for r in results)}]
    return render_after_model_turn(tokenizer, turn, results[0].name if native else None, **template_kwargs)


def render_after_model_turn(tokenizer, turn: list[dict], call_name: str | None = None, **template_kwargs) -> str:
    """The text between the model's end-of-turn token and its next turn: the messages `turn` (tool results or a
    user's reply, as the template takes them), then the opening of the model's turn: the template's rendering of
    one conversation with and without them. `call_name`: the turn answers the model's native call of that tool."""
    if call_name is not None:
        call = {"type": "function", "function": {"name": call_name, "arguments": {}}}
        before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    else:
        before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    if not getattr(tokenizer, "chat_template", None):             # plain text prompts: paragraphs
        return "".join(f"\n\n{m['content']}" for m in turn) + "\n\n"
    prefix = tokenizer.apply_chat_template(before, tokenize=False, **template_kwargs)
    full = tokenizer.apply_chat_template(before + turn, tokenize=False, add_generation_prompt=True, **template_kwargs)
    eos = tokenizer.eos_token or ""
    cut = prefix.rfind(eos) + len(eos) if eos and eos in prefix else len(prefix)   # the model emits EOS itself
    if full[:cut] != prefix[:cut]:
        raise ValueError("the chat template renders a conversation differently once a tool turn follows it; "
                         "tool turns cannot be appended to the model's tokens with this template")
    return full[cut:]


def tool_turn_ids(tokenizer, results: Sequence[ToolResult], template_kwargs: dict | None = None) -> list[int]:
    """The tool turn's token ids (context for the model, never trained on)."""
    text = _render_tool_turn(tokenizer, results, native=renders_tools(tokenizer), **(template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- one rollout's conversation --------------------------------------------------------------------------

CALL_END = "</tool_call>"


def call_end(ids: list[int], tokenizer, opening: str = "") -> int | None:
    """How many of a turn's tokens it takes to close its first tool call (None: no call closes)."""
    if CALL_END not in opening + tokenizer.decode(ids, skip_special_tokens=True):
        return None
    for k in range(1, len(ids) + 1):
        if CALL_END in opening + tokenizer.decode(ids[:k], skip_special_tokens=True):
            return k
    return None


@dataclass
class Episode:
    """One rollout so far: every token after the prompt, which of them are the model's, and what happened."""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)          # 1: the model's token, 0: a tool turn's
    logprobs: list[float] | None = None                     # the sampler's, per token (0.0 on tool tokens)
    turns: list[str] = field(default_factory=list)          # the model's turns, decoded
    conversation: list[dict] = field(default_factory=list)  # assistant and tool messages, for reading
    calls: int = 0
    errors: int = 0
    per_tool: dict[str, list[float]] = field(default_factory=dict)   # name (metric-safe) -> [calls, seconds]
    pending: list = field(default_factory=list)             # the tool calls of the last turn, not yet run
    truncated: bool = False
    capped: bool = False                                    # still calling tools when the rounds ran out

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    @property
    def done(self) -> bool:
        return self.truncated or self.capped or not self.pending

    def add_model_turn(self, ids: list[int], logprobs: list[float] | None, tokenizer, opening: str = "") -> None:
        """Append one model turn. A turn ends at EOS or where its first tool call closes, whichever comes
        first (as an agent's stop sequence ends it: what the sampler drew after the call is dropped, and
        the end-of-turn token the template needs is added as context, not trained, unless the model wrote
        it there itself). `opening`: text the prompt put at the start of this turn (the first turn's
        response prefix)."""
        eos = tokenizer.eos_token_id
        cut = call_end(ids, tokenizer, opening)
        if cut is not None and cut < len(ids) and ids[cut] == eos:
            cut += 1                                             # the model ended its turn right there itself
        if cut is not None:
            ids, logprobs = ids[:cut], (None if logprobs is None else logprobs[:cut])
        stopped = bool(ids) and ids[-1] == eos
        text = opening + tokenizer.decode(ids, skip_special_tokens=True)
        glue = [eos] if cut is not None and not stopped else []
        self.ids += ids + glue
        self.mask += [1] * len(ids) + [0] * len(glue)
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(logprobs) + [0.0] * len(glue)
        self.turns.append(text)
        self.conversation.append({"role": "assistant", "content": text})
        self.truncated = not stopped and not glue
        self.pending = parse_tool_calls(text)

    def add_sampled(self, ids: list[int], logprobs: list[float], text: str, stopped: bool) -> None:
        """Append a model turn as it was sampled, every token trained on (a client that renders and parses turns
        itself: the endpoint's token route), where add_model_turn cuts the turn at its first tool call."""
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs = (self.logprobs or []) + list(logprobs)
        self.turns.append(text)
        self.conversation.append({"role": "assistant", "content": text})
        self.truncated = not stopped

    def add_context(self, ids: list[int]) -> None:
        """Tokens the model reads but did not write (a tool's or a user's turn): never trained on."""
        self.ids += ids
        self.mask += [0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [0.0] * len(ids)

    def add_tool_turn(self, results: Sequence[ToolResult], ids: list[int]) -> None:
        self.add_context(ids)
        for r in results:
            self.calls += 1
            self.errors += r.error
            # a name the model made up is no metric key of its own (MLflow refuses '.', '..' and keys over 250
            # characters, and each new name would be a new curve)
            key = re.sub(r"[^\w.\-]", "_", r.name) if r.known else ("_unknown" if r.name else "_unreadable")
            tally = self.per_tool.setdefault(key or "_unreadable", [0, 0.0])
            tally[0] += 1
            tally[1] += r.seconds
            self.conversation.append({"role": "tool", "name": r.name, "content": r.content, "error": r.error,
                                      "seconds": r.seconds})           # read by the MLflow traces (tasks/traces.py)
        self.pending = []

    def record(self) -> dict:
        """What the metrics and the completion tables read (Sample.extra)."""
        return {"turns": len(self.turns), "tool_calls": self.calls, "tool_errors": self.errors,
                "tool_usage": {k: {"calls": int(v[0]), "seconds": v[1]} for k, v in self.per_tool.items()},
                "max_turns_reached": self.capped, "conversation": self.conversation}


# -- the rollout -------------------------------------------------------------------------------------------

def sample_rows(backend, rows: list[list[int]], n: int, params: SamplingParams,
                on_group: Callable[[int, list], None] | None = None) -> list:
    """One turn for every row (`rows`: n per group, groups contiguous; a guided group's rows may differ) -> the
    completions, row by row, through any engine. A group's rows go in one call per prompt when they share it,
    else one call per row: the same rows, batches and draws either way. `on_group(g, completions)` hears of each
    group as soon as its last row is sampled (the local engines, whose `reports_groups` is true: while they
    sample; the others after the call)."""
    heads = rows[::n]
    shared = all(rows[k * n + j] == heads[k] for k in range(len(heads)) for j in range(n))
    out: list = [None] * len(rows)
    missing = [n] * len(heads)

    def heard(i: int, group: list) -> None:                 # group i of the call: n rows, or row i alone
        for j, c in enumerate(group):
            out[i * len(group) + j] = c
        g = i * len(group) // n
        missing[g] -= len(group)
        if missing[g] == 0 and on_group is not None:
            on_group(g, out[g * n:(g + 1) * n])

    hears = on_group is not None and getattr(backend, "reports_groups", False)
    made = backend.generate(*((heads, n) if shared else (rows, 1)), params, **({"on_group": heard} if hears else {}))
    if not hears:
        for i, group in enumerate(made):
            heard(i, list(group))
    return out


def _continue(backend, prompts: list[list[int]], episodes: list[Episode], rows: list[int], budget: int,
              params: SamplingParams, round_: int, tokenizer) -> None:
    """The model's next turn in each of `rows`, after its tool turn, within its own token budget."""
    left = [budget - episodes[i].model_tokens for i in rows]
    for i, room in zip(rows, left):
        if room <= 0:                                        # the tool turn came with no room for an answer
            episodes[i].truncated = True
    live = [(i, room) for i, room in zip(rows, left) if room > 0]
    if not live:
        return
    turn_params = dataclasses.replace(params, max_new_tokens=max(room for _, room in live),
                                      seed=params.seed + 7919 * round_)
    out = backend.generate([prompts[i] + episodes[i].ids for i, _ in live], 1, turn_params)
    for (i, room), (completion,) in zip(live, out):
        lps = getattr(completion, "logprobs", None)
        episodes[i].add_model_turn(list(completion)[:room], lps[:room] if lps is not None else None, tokenizer)


class TurnController:
    """Steers a streaming sampler through multi-turn rollouts (`KVCacheSampler._interact_batch`): it hears of
    every sampled token (`sampled` -> "go" on, the turn is over and the row "wait"s for its tool turn, or
    the row is "done"), starts the calls of the turns that ended in a step on worker threads (`flush`), and
    hands each row's tool turn back (`ready`: at the next step, or with `overlap` as soon as its calls return):
    the tokens the row must read before its next turn, which are every token of its episode not yet in its KV
    cache."""

    def __init__(self, tokenizer, episodes: list[Episode], toolsets: list[dict[str, Tool]], toolbox: Toolbox,
                 openings: list[str], template_kwargs: dict, budget: int):
        self.tok, self.episodes, self.toolsets, self.toolbox = tokenizer, episodes, toolsets, toolbox
        self.openings, self.template_kwargs, self.budget = openings, template_kwargs, budget
        self.turn: list[list[int]] = [[] for _ in episodes]              # the turn being sampled
        self.turn_logprobs: list[list[float]] = [[] for _ in episodes]
        self.tail = [opening[-len(CALL_END):] for opening in openings]   # its last characters
        self.closing = [False] * len(episodes)      # its last token closed a tool call
        self.cached = [0] * len(episodes)           # how many episode tokens are in the row's KV cache
        self.rounds = [0] * len(episodes)
        self.ended: list[int] = []                  # rows whose turn ended in this step, calls to run
        self.running: dict[concurrent.futures.Future, list[int]] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="tool-calls")

    def __enter__(self) -> "TurnController":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def sampled(self, row: int, token: int, logprob: float | None) -> str:
        ep, turn = self.episodes[row], self.turn[row]
        turn.append(token)
        if logprob is not None:
            self.turn_logprobs[row].append(logprob)
        if token == self.tok.eos_token_id or self.closing[row] or ep.model_tokens + len(turn) >= self.budget:
            return self._end_turn(row)
        self.tail[row] = (self.tail[row] + self.tok.decode([token], skip_special_tokens=True))[-4 * len(CALL_END):]
        if CALL_END in self.tail[row]:              # one more token: the model may end its turn right there
            self.closing[row] = call_end(turn, self.tok, self.openings[row] if not ep.turns else "") == len(turn)
        return "go"

    def _end_turn(self, row: int) -> str:
        ep, turn = self.episodes[row], self.turn[row]
        start = len(ep.ids)
        ep.add_model_turn(turn, self.turn_logprobs[row] if self.turn_logprobs[row] else None, self.tok,
                          self.openings[row] if not ep.turns else "")
        if ep.ids[start:start + len(turn) - 1] != turn[:-1]:   # the cache holds every token but the last
            raise RuntimeError(f"multi-turn sampling: row {row}'s turn was cut before its last token (a bug)")
        self.cached[row] = start + len(turn) - 1
        self.turn[row], self.turn_logprobs[row], self.tail[row], self.closing[row] = [], [], "", False
        if ep.done:
            return "done"
        if self.toolbox.max_iterations is not None and self.rounds[row] >= self.toolbox.max_iterations:
            ep.capped = True
            return "done"
        self.rounds[row] += 1
        self.ended.append(row)
        return "wait"

    def flush(self) -> None:
        """Start the calls of the turns that ended in this step, together (async tools on one loop)."""
        if self.ended:
            rows, self.ended = self.ended, []
            job = self.pool.submit(run_tool_calls, [self.episodes[r].pending for r in rows],
                                   [self.toolsets[r] for r in rows], self.toolbox.timeout)
            self.running[job] = rows

    def ready(self) -> list[tuple[int, list[int] | None]]:
        """(row, the tokens it reads next) for each row whose calls returned; None: no room left, it is done.
        Without `overlap` every call started so far is waited for: a row rejoins at the step after its turn
        ended, whatever its calls took, so the rollouts do not depend on timing."""
        if not self.toolbox.overlap and self.running:
            concurrent.futures.wait(list(self.running))
        out = []
        for job in [j for j in self.running if j.done()]:
            for row, results in zip(self.running.pop(job), job.result()):
                ep = self.episodes[row]
                ep.add_tool_turn(results, tool_turn_ids(self.tok, results, self.template_kwargs))
                if self.budget - ep.model_tokens <= 0:          # the tool turn came with no room for an answer
                    ep.truncated = True
                    out.append((row, None))
                    continue
                out.append((row, ep.ids[self.cached[row]:]))
                self.cached[row] = len(ep.ids)
        return out

    def wait(self) -> None:
        """Until some row's calls return."""
        concurrent.futures.wait(list(self.running), return_when=concurrent.futures.FIRST_COMPLETED)


def _streamed_turns(backend, tokenizer, prompts: list[list[int]], toolsets: list[dict[str, Tool]], n: int,
                    params: SamplingParams, toolbox: Toolbox, openings: list[str],
                    template_kwargs: dict) -> list[Episode]:
    """Every rollout's conversation, streamed by a sampler that continues each row's KV cache (groups that share
    a prompt sample as one-turn rollouts do)."""
    episodes = [Episode() for _ in prompts]
    heads = prompts[::n]
    shared = all(prompts[k * n + j] == heads[k] for k in range(len(heads)) for j in range(n))
    with TurnController(tokenizer, episodes, toolsets, toolbox, openings, template_kwargs,
                        params.max_new_tokens) as turns:
        backend.generate(heads if shared else prompts, n if shared else 1, params, turns=turns)
    return episodes


def drive_turns(backend, tokenizer, prompts: list[list[int]], toolsets: list[dict[str, Tool]], n: int,
                params: SamplingParams, toolbox: Toolbox, openings: list[str],
                template_kwargs: dict) -> list[Episode]:
    """The one place multi-turn rollouts are driven, for every engine: every rollout's conversation, in one
    sampling session (one weight snapshot for all turns). Streamed (`_streamed_turns`: each row's KV cache
    continues) where the engine streams turns (`streams_turns`: the fused and torch engines, `engines.ENGINES`),
    else re-encoded each round (`_turns`: vllm, and the torch engine on a sliding-window model's own forward)."""
    session = backend.session(len(prompts)) if hasattr(backend, "session") else contextlib.nullcontext()
    with session:
        turns = _streamed_turns if getattr(backend, "streams_turns", False) else _turns
        return turns(backend, tokenizer, prompts, toolsets, n, params, toolbox, openings, template_kwargs)


def _environment_reward(environment: object | None) -> dict | None:
    """{environment class name: get_reward()} for an environment that owns its reward."""
    get_reward = getattr(environment, "get_reward", None)
    if get_reward is None:
        return None
    value = get_reward()
    return {type(environment).__name__: None if value is None else float(value)}


def tool_rollout(backend, tokenizer, tasks: Sequence[Task], n: int, params: SamplingParams, fmt: PromptFormat,
                 max_prompt_length: int, toolbox: Toolbox, group_ids: Sequence[int]) -> list[list[Sample]]:
    """n multi-turn rollouts of every task -> one group of Samples per task (in task order), task g's numbered
    group_ids[g]."""
    # 1) one environment per rollout, reset with its task's fields; the tools each rollout may call
    row_tasks = [t for t in tasks for _ in range(n)]
    environments = [toolbox.environment_for(t) for t in row_tasks]
    observations = [env.reset(**t.to_dict()) if env is not None else None for env, t in zip(environments, row_tasks)]
    toolsets = [toolbox.toolset(env) for env in environments]
    # 2) prompts rendered with each rollout's tools: the task's own, and for the first fmt.guided rollouts of a group
    # drawn without the system prompt or the examples, the guide's (PromptFormat.guide), which they are sampled after
    prompts = [tool_prompt_ids(tokenizer, t, fmt, max_prompt_length, list(ts.values()), obs)
               for t, ts, obs in zip(row_tasks, toolsets, observations)]
    guides = [fmt.guide(t) if r % n < fmt.guided else None for r, t in enumerate(row_tasks)]
    sampled_after = [tool_prompt_ids(tokenizer, t, guide, max_prompt_length, list(ts.values()), obs) if guide else own
                     for t, guide, ts, obs, own in zip(row_tasks, guides, toolsets, observations, prompts)]
    episodes = drive_turns(backend, tokenizer, sampled_after, toolsets, n, params, toolbox,
                           [fmt.for_task(t).response_prefix for t in row_tasks], dict(fmt.template_kwargs))
    # 5) the environments' own rewards, and the samples (each with its task's own prompt: what the update trains on)
    rewards = [_environment_reward(env) for env in environments]
    return [[_sample(tasks[g], group_ids[g], prompts[r], episodes[r], rewards[r], guides[r] is not None)
             for r in range(g * n, (g + 1) * n)] for g in range(len(tasks))]


def _turns(backend, tokenizer, prompts: list[list[int]], toolsets: list[dict[str, Tool]], n: int,
           params: SamplingParams, toolbox: Toolbox, openings: list[str], template_kwargs: dict) -> list[Episode]:
    """Every rollout's conversation: 3) the first turn, 4) rounds of tool calls (all of a round at once), each
    followed by the model's next turn (tool turns rendered with the run's chat_template_kwargs)."""
    episodes = [Episode() for _ in prompts]
    for ep, completion, opening in zip(episodes, sample_rows(backend, prompts, n, params), openings):
        ep.add_model_turn(list(completion), getattr(completion, "logprobs", None), tokenizer, opening)
    round_ = 0
    while calling := [i for i, ep in enumerate(episodes) if not ep.done]:
        if toolbox.max_iterations is not None and round_ >= toolbox.max_iterations:
            for i in calling:
                episodes[i].capped = True
            break
        round_ += 1
        results = run_tool_calls([episodes[i].pending for i in calling], [toolsets[i] for i in calling],
                                 toolbox.timeout)
        for i, res in zip(calling, results):
            episodes[i].add_tool_turn(res, tool_turn_ids(tokenizer, res, template_kwargs))
        _continue(backend, prompts, episodes, calling, params.max_new_tokens, params, round_, tokenizer)
    return episodes


def _sample(task: Task, group: int, prompt_ids: list[int], ep: Episode, reward: dict | None,
            guided: bool = False) -> Sample:
    """A rollout as a Sample; a guided one (sampled after another prompt than `prompt_ids`) is marked and carries
    no sampler log-probs, as a guided one-turn rollout's (grpo_core.rollout.samplers.rollout)."""
    extra = ep.record()
    if reward is not None:
        extra["environment_reward"] = reward
    if guided:
        extra["guided"] = True
    return Sample(task_id=task.id, group=group, prompt_ids=prompt_ids, completion_ids=ep.ids,
                  completion=ep.turns[-1], truncated=ep.truncated, extra=extra,
                  sampler_logprobs=None if guided else ep.logprobs, completion_mask=ep.mask)


def tool_metrics(samples: Sequence[dict]) -> dict[str, float]:
    """Per-batch tool and turn metrics from sample rows (their `extra`); {} for one-turn rollouts."""
    rows = [s.get("extra") or {} for s in samples]
    rows = [r for r in rows if "turns" in r]
    if not rows:
        return {}
    calls = sum(r["tool_calls"] for r in rows)
    out = {"tools/calls_per_rollout": calls / len(rows),
           "tools/error_rate": sum(r["tool_errors"] for r in rows) / max(calls, 1),
           "turns/mean": sum(r["turns"] for r in rows) / len(rows),
           "turns/max": float(max(r["turns"] for r in rows)),
           "turns/max_reached_frac": sum(bool(r["max_turns_reached"]) for r in rows) / len(rows)}
    for name in sorted({k for r in rows for k in r["tool_usage"]}):
        out[f"tools/{name}/calls"] = float(sum(r["tool_usage"].get(name, {}).get("calls", 0) for r in rows))
        out[f"tools/{name}/seconds"] = sum(r["tool_usage"].get(name, {}).get("seconds", 0.0) for r in rows)
    return out
