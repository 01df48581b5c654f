"""Any agent loop as a rollout (OpenPipe ART's model): the config's `rollout_func: "package.module:run"` is called
once per rollout as `run(client, task)`, with an `openai.OpenAI` client bound to the policy endpoint
(grpo_core/rollout/endpoint.py) and the task (grpo_core.task.Task: id, prompt, answer, meta, ...). It talks to the
model through chat completions (with tools if it likes) in whatever loop it wants, and returns its reward: a
number, `{"reward": number, "metrics": {name: number}}`, or None to leave the judging to the run's reward
functions (they read the model's last turn). The rollouts of every task run concurrently (the endpoint batches
their requests), and each one trains on the tokens the endpoint sampled for it, the model's marked, everything
else context. A rollout whose agent raises is unscorable (left out of its group); when every one raises, the stage
fails with the first error.

Environments written for other standards run the same way: the config's `environment: "openenv:..."` or
`"verifiers:..."` (with `environment_config`) is an agent loop built by grpo_core/rollout/openenv_env.py or
verifiers_env.py, whose `serving()` keeps what its rollouts share (a server process, an event loop) alive around
them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable, ContextManager, Sequence

from grpo_core.plugins import PluginError, load_plugin
from grpo_core.rollout.endpoint import PolicyEndpoint
from grpo_core.rollout.sampling import Sample, SamplingParams
from grpo_core.rollout.tools import STANDARDS, standard
from grpo_core.task import Task

log = logging.getLogger(__name__)

AGENT_GROUP = "grpo_pipeline.agents"
CONTRACT = ("def run(client: openai.OpenAI, task: grpo_core.task.Task) -> float | dict | None  "
            "(dict: {'reward': float, 'metrics': {name: float}})")


@dataclass
class AgentLoop:
    """The run's agent loop: the function, its name (the reward's and metrics' name) and how many run at once."""
    run: Callable[[Any, Task], Any]
    name: str
    concurrency: int = 32
    template_kwargs: dict = field(default_factory=dict)
    serving: Callable[[], ContextManager] = nullcontext     # alive around a stage's rollouts (a server, a loop)
    label: str = ""                                          # how errors name it: the config field and entry

    def __post_init__(self) -> None:
        self.label = self.label or f"rollout_func {self.name!r}"

    @classmethod
    def resolve(cls, entry: str, concurrency: int = 32, template_kwargs: dict | None = None,
                field_name: str = "rollout_func", options: dict | None = None) -> "AgentLoop":
        """The loop for a rollout_func entry, or for an "openenv:" / "verifiers:" environment entry (with its
        environment_config `options`), checked but not started."""
        if kind := standard(entry):
            module = import_module(STANDARDS[kind[0]])
            return module.agent_loop(kind[1], dict(options or {}), concurrency, dict(template_kwargs or {}))
        plugin = load_plugin(entry, AGENT_GROUP, field_name, ())
        name = getattr(plugin.obj, "__name__", "agent")
        return cls(plugin.obj, f"agent_{name}" if name == "run" else name, concurrency, dict(template_kwargs or {}))


def read_outcome(value: Any, where: str) -> tuple[float | None, dict[str, float], bool]:
    """An agent's return value -> (reward, metrics, whether it gave a reward)."""
    if value is None:
        return None, {}, False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(value, where), {}, True
    if isinstance(value, dict) and set(value) <= {"reward", "metrics"}:
        metrics = value.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise TypeError(f"{where}: 'metrics' must be a dict of name -> number")
        reward = value.get("reward")
        return (None if reward is None else _finite(reward, where), {str(k): _finite(v, f"{where} metric {k!r}")
                                                                      for k, v in metrics.items()}, "reward" in value)
    raise TypeError(f"{where} returned {type(value).__name__} {str(value)[:80]!r}; an agent returns {CONTRACT}")


def _finite(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TypeError(f"{where}: a reward or metric must be a finite number, got {v!r}")
    return float(v)


def _client(endpoint: PolicyEndpoint, session: str):
    try:
        import openai
    except ImportError:
        raise PluginError("rollout_func needs the openai package, which is not installed. Fix: pip install openai "
                          "(or pip install -e '.[agents]')") from None
    return openai.OpenAI(base_url=endpoint.session_url(session) + "/v1", api_key="local", max_retries=2, timeout=3600)


def _run_one(agent: AgentLoop, endpoint: PolicyEndpoint, task: Task, session: str) -> tuple[Any, str | None]:
    try:
        return agent.run(_client(endpoint, session), task), None
    except PluginError as e:
        return None, e                   # raised by the caller: a missing package fails the stage, not one rollout
    except Exception as e:  # noqa: BLE001 - one rollout's failure is that rollout's, unless every one fails
        return None, f"{type(e).__name__}: {e}"


def run_with_deadlines(job: Callable[[int], tuple[Any, Any]], count: int, workers: int,
                       timeout: float | None) -> list[tuple[Any, Any]]:
    """job(k) for k in range(count) on `workers` threads at once -> its (value, error) per k. A job still running
    `timeout` seconds after it started is (None, "TimeoutError: ...") and its thread is abandoned (a daemon: it
    cannot be stopped from outside, and it keeps neither the stage nor the process waiting); a fresh thread takes
    its place, so a stuck job costs its own slot only."""
    outcomes: list = [None] * count
    started: dict[int, float] = {}
    todo = iter(range(count))
    changed = threading.Condition()

    def worker() -> None:
        while True:
            with changed:
                k = next(todo, None)
                if k is None:
                    return
                started[k] = time.monotonic()
            try:
                outcome = job(k)
            # SystemExit from an agent fails its job; a thread dying of it would leave the loop waiting forever
            except BaseException as e:  # noqa: BLE001
                outcome = (None, f"{type(e).__name__}: {e}")
            with changed:
                if outcomes[k] is None:            # not already timed out
                    outcomes[k] = outcome
                    started.pop(k, None)
                    changed.notify_all()
                else:
                    return                         # this thread was replaced when its job timed out

    def spawn() -> None:
        threading.Thread(target=worker, name="agent", daemon=True).start()

    for _ in range(max(1, min(count, workers))):
        spawn()
    with changed:
        while any(o is None for o in outcomes):
            now = time.monotonic()
            for k, t0 in list(started.items()) if timeout is not None else ():
                if now - t0 >= timeout:
                    outcomes[k] = (None, f"TimeoutError: the rollout ran past rollout_timeout ({timeout:g} s); "
                                         "it is left unfinished")
                    del started[k]
                    spawn()
            waits = [t0 + timeout - now for t0 in started.values()] if timeout is not None else []
            changed.wait(max(0.01, min(waits, default=1.0)))
    return outcomes


def agent_rollout(backend, tokenizer, tasks: Sequence[Task], n: int, params: SamplingParams, agent: AgentLoop,
                  group_ids: Sequence[int], timeout: float | None = None) -> list[list[Sample]]:
    """n runs of the agent loop per task, concurrently, through one endpoint -> one group of Samples per task;
    a run past `timeout` seconds (config rollout_timeout) is a failed one."""
    jobs = [(g, j) for g in range(len(tasks)) for j in range(n)]
    sessions = [f"g{group_ids[g]}-r{j}" for g, j in jobs]
    with agent.serving(), PolicyEndpoint(backend, tokenizer, params, n, agent.template_kwargs) as endpoint:
        outcomes = run_with_deadlines(lambda k: _run_one(agent, endpoint, tasks[jobs[k][0]], sessions[k]),
                                      len(jobs), agent.concurrency, timeout)
        records = [endpoint.conversation(s) for s in sessions]
    if missing := next((e for _, e in outcomes if isinstance(e, PluginError)), None):
        raise missing
    errors = [e for _, e in outcomes if e is not None]
    if jobs and len(errors) == len(jobs):
        raise RuntimeError(f"{agent.label}: every rollout failed; the first: {errors[0]}")
    for e in dict.fromkeys(errors):
        log.warning("%s: a rollout failed (%s); it is left out of its group", agent.label, e)
    samples = [_sample(tasks[g], group_ids[g], rec, value, error, agent)
               for (g, _), rec, (value, error) in zip(jobs, records, outcomes)]
    groups = [samples[g * n:(g + 1) * n] for g in range(len(tasks))]
    mixed = max((distinct_prompts([s.prompt_ids for s in group]) for group in groups), default=1)
    if mixed > 1:
        log.warning("%s: a group's rollouts began with up to %d different prompts (the environment does not start "
                    "every episode of a task alike, e.g. a reset that ignores the task's fields), so the group's "
                    "baseline compares different questions; agent/prompts_per_group says how often", agent.label, mixed)
    return groups


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> int:
    """How many different first prompts a group's rollouts had (1: one question, as GRPO's baseline assumes)."""
    return len({tuple(p) for p in prompts if p}) or 1


def _sample(task: Task, group: int, record: dict | None, value: Any, error: str | None, agent: AgentLoop) -> Sample:
    """One agent run as a Sample: the endpoint's tokens for its session (its last branch), its reward."""
    if error is None and record is None:
        error = "the agent made no request through the client it was given"
    reward, metrics, rewarded = (None, {}, True) if error else read_outcome(value, agent.label)
    record = record or {"prompt_ids": [], "completion_ids": [], "completion_mask": [], "logprobs": [], "turns": [""],
                        "truncated": False, "branches": 0, "conversation": []}
    extra = {"turns": len(record["turns"]), "tool_calls": 0, "tool_errors": 0, "tool_usage": {},
             "max_turns_reached": False, "conversation": record["conversation"], "branches": record["branches"],
             "agent_metrics": metrics, **({"agent_error": error} if error else {}),
             **({"environment_reward": {agent.name: reward}} if rewarded else {})}
    return Sample(task_id=task.id, group=group, prompt_ids=record["prompt_ids"], completion_ids=record["completion_ids"],
                  completion=record["turns"][-1] if record["turns"] else "", truncated=record["truncated"], extra=extra,
                  sampler_logprobs=record["logprobs"] or None, completion_mask=record["completion_mask"])


def agent_metrics(samples: Sequence[dict]) -> dict[str, float]:
    """agent/<metric> means over the rollouts that reported it, agent/failed_frac, agent/branches_mean and
    agent/prompts_per_group (the mean of distinct_prompts over the groups)."""
    rows = [s.get("extra") or {} for s in samples]
    rows = [r for r in rows if "agent_metrics" in r]
    if not rows:
        return {}
    groups: dict = {}
    for s in samples:
        groups.setdefault(s.get("group"), []).append(s.get("prompt_ids"))
    out = {"agent/failed_frac": sum("agent_error" in r for r in rows) / len(rows),
           "agent/branches_mean": sum(r["branches"] for r in rows) / len(rows),
           "agent/prompts_per_group": sum(map(distinct_prompts, groups.values())) / len(groups)}
    for k in sorted({k for r in rows for k in r["agent_metrics"]}):
        values = [r["agent_metrics"][k] for r in rows if k in r["agent_metrics"]]
        out[f"agent/{k}"] = sum(values) / len(values)
    return out
