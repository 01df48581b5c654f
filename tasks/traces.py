"""Rollouts as MLflow traces: each traced rollout, and each evaluation answer, reads as a conversation on the run's
Traces tab, where a completion table's cell shows only its first characters.

One trace per rollout (the first `tracking.trace_rollouts` of an iteration, whole groups first) and per evaluation
answer (all of them). The root span (AGENT) holds the question and the whole conversation; under it, in order, one
CHAT_MODEL span per model turn (the messages before it; the turn as an OpenAI-style choice, its tool calls parsed)
and one TOOL span per tool call (its arguments; its result, or its error with status ERROR; the seconds it took).
The rewards are feedback on the trace; tags say the iteration, group, sample and advantage; the metadata
`mlflow.trace.session` makes a group's rollouts (a question's answers) one session.

The traces are built after the fact from the rows the stages wrote, so they carry the recorded timings only: a tool
span lasts the seconds its call took; a model turn, sampled in a batch with other rows, has no time of its own and
is drawn as an instant. Building (`rollout_trace`, `eval_trace`) is plain Python; `log_traces` makes the MLflow
calls. Tracing is observability: a failure to log is warned about once and the stage goes on."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field

from grpo_core.config import GRPOConfig
from grpo_core.rollout.tools import parse_tool_calls
from tasks import tracking
from tasks.run_state import mlflow_run_id

log = logging.getLogger(__name__)

SCORE_SOURCE = "grpo.score"           # the feedback's source id (AssessmentSourceType.CODE)
RUN_METADATA = "mlflow.sourceRun"     # what a run's Traces tab filters on
SESSION_METADATA = "mlflow.trace.session"


@dataclass
class Step:
    """One child span: a model turn ("turn") or a tool call ("tool")."""
    kind: str
    name: str
    inputs: dict
    outputs: dict
    error: bool = False
    seconds: float = 0.0


@dataclass
class Trace:
    """One rollout or answer, ready to log: the root span's inputs and outputs, its steps, tags, session, feedback."""
    name: str
    inputs: dict
    outputs: dict
    steps: list[Step]
    tags: dict[str, str]
    session: str                      # within the run (log_traces puts the run in front)
    feedback: dict[str, float | bool] = field(default_factory=dict)


# -- conversations -> steps ---------------------------------------------------------------------------------------

def _openai_call(call_id: str, call) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def conversation_steps(question: str, conversation: list[dict]) -> tuple[list[Step], list[dict]]:
    """A rollout's conversation (assistant and tool messages, as `Episode.conversation` records them) -> its steps
    and its messages in OpenAI chat format, the question first. A tool message answers the next unanswered call
    that the assistant message before it wrote (`<tool_call>` blocks, parsed as the rollout parsed them)."""
    messages: list[dict] = [{"role": "user", "content": question}]
    steps: list[Step] = []
    waiting: list[tuple[str, object]] = []              # (call id, ToolCall) of the last model turn, not yet answered
    turn = 0
    for m in conversation:
        if m["role"] == "assistant":
            turn += 1
            calls = parse_tool_calls(m["content"])
            waiting = [(f"call_{turn}_{c}", call) for c, call in enumerate(calls)]
            message = {"role": "assistant", "content": m["content"],
                       **({"tool_calls": [_openai_call(i, call) for i, call in waiting]} if calls else {})}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
            steps.append(Step("turn", f"model turn {turn}", {"messages": list(messages)}, {"choices": [choice]}))
            messages.append(message)
        elif m["role"] == "tool":
            call_id, call = waiting.pop(0) if waiting else (None, None)
            steps.append(_tool_step(m, call))
            messages.append({"role": "tool", "tool_call_id": call_id, "name": m.get("name") or "",
                             "content": m["content"]})
        else:                                               # a user's (or an environment's) turn
            messages.append({"role": m["role"], "content": m["content"]})
    return steps, messages


def _tool_step(message: dict, call) -> Step:
    """A tool message's span: the call's arguments; the result, or the error (a call that could not be read
    is an error too). `error`/`seconds` are recorded by the rollout (grpo_core/rollout/multiturn.py)."""
    failed = bool(message.get("error")) or bool(call is not None and call.error)
    arguments = call.arguments if call is not None else {}
    outputs = {"error": message["content"]} if failed else {"result": message["content"]}
    return Step("tool", message.get("name") or (call.name if call is not None else "") or "unreadable",
                dict(arguments), outputs, failed, float(message.get("seconds") or 0.0))


# -- rows -> traces -----------------------------------------------------------------------------------------------

def _feedback(rewards: dict, total, correct) -> dict[str, float | bool]:
    out = {f"reward_{k}": float(v) for k, v in (rewards or {}).items() if v is not None}
    if total is not None:
        out["reward"] = float(total)
    if correct is not None:
        out["correct"] = bool(correct >= 1.0)             # a score (training) or a verdict (evaluation: a bool)
    return out


def _trace(name: str, question: str, conversation: list[dict], tags: dict, session: str, feedback: dict) -> Trace:
    steps, messages = conversation_steps(question, conversation)
    return Trace(name, {"messages": messages[:1]}, {"messages": messages}, steps,
                 {k: str(v) for k, v in tags.items()}, session, feedback)


def rollout_trace(row: dict, score: dict, advantage: float | None, iteration: int, question: str,
                  sample: int) -> Trace:
    """A training rollout (a row of samples.jsonl, its row of scores.jsonl, its advantage) as a trace."""
    extra = row.get("extra") or {}
    conversation = extra["conversation"] if "turns" in extra else [{"role": "assistant", "content": row["completion"]}]
    tags = {"kind": "rollout", "iteration": iteration, "group": row["group"], "sample": sample,
            "task_id": row["task_id"], "advantage": "none" if advantage is None else f"{advantage:.4f}",
            "truncated": row["truncated"], "tool_calls": extra.get("tool_calls", 0)}
    return _trace("rollout", question, conversation, tags, f"iter-{iteration}-group-{row['group']}",
                  _feedback(score.get("rewards"), score.get("reward"), score.get("correct")))


def eval_trace(row: dict, iteration: int) -> Trace:
    """An evaluation answer (a row of eval_samples.jsonl) as a trace; a question's answers in one mode are a session."""
    conversation = row.get("messages") or [{"role": "assistant", "content": row["completion"]}]
    mode = row["mode"] + (f"/{row['wording']}" if row.get("wording") else "")
    tags = {"kind": "evaluation", "iteration": iteration, "mode": mode, "task_id": row["task_id"],
            "sample": row["sample"], "verdict": row["verdict"], "truncated": row["truncated"],
            "tool_calls": row.get("tool_calls", 0)}
    return _trace("evaluation", row["prompt"], conversation, tags, f"eval-{iteration}-{mode}-{row['task_id']}",
                  _feedback(row.get("rewards"), row.get("reward_total"), row.get("correct")))


def traced_rows(rows: list[dict], limit: int) -> list[int]:
    """The indices of the first `limit` rows, taken group by group (groups in order of first appearance)."""
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_group.setdefault(r["group"], []).append(i)
    return [i for members in by_group.values() for i in members][:limit]


def numbers_in_group(rows: list[dict]) -> list[int]:
    """Each row's number within its group (0, 1, ...), in row order."""
    counts: dict[int, int] = {}
    out = []
    for r in rows:
        out.append(counts.get(r["group"], 0))
        counts[r["group"]] = out[-1] + 1
    return out


def row_advantages(cfg: GRPOConfig, rows: list[dict], scored: list[dict]) -> list[float | None]:
    """Each row's advantage as the update computes it from this batch (None: the row would not train)."""
    from grpo_core.update.step import batch_advantages, surviving_groups
    from tasks.update import scored_batch
    batch = scored_batch(rows, scored)
    kept, group_sizes = surviving_groups(batch)
    if not kept:
        return [None] * len(rows)
    by_sample = {id(s): a for s, a in zip(kept, batch_advantages(kept, group_sizes, cfg).tolist())}
    return [None if s is None else by_sample.get(id(s)) for s in batch]


# -- logging ------------------------------------------------------------------------------------------------------

_warned: set[str] = set()
_global_uri = threading.Lock()        # MLflow's tracer exports to the process's global tracking URI


def _warn_once(what: str, error: Exception) -> None:
    """A warning to the Prefect run log (else this module's logger), the first time `what` fails in this process."""
    if what in _warned:
        return
    _warned.add(what)
    message = f"MLflow traces of the {what} were not logged ({type(error).__name__}: {error}); the stage goes on"
    try:
        from prefect import get_run_logger
        get_run_logger().warning(message)
    except Exception:  # noqa: BLE001 - outside a flow/task run there is no run logger
        log.warning(message)


def never_fails(what: str):
    """Run the logging function; on any error warn once per process (per `what`) and return 0 traces logged."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs) -> int:
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - observability must never fail a stage
                _warn_once(what, e)
                return 0
        return call
    return wrap


@contextlib.contextmanager
def _tracing_to(uri: str):
    """MLflow's tracer and `log_feedback` write to the global tracking URI: this run's store for the block, then
    the process's URI and $MLFLOW_TRACKING_URI as they were (set_tracking_uri changes both)."""
    import mlflow
    from mlflow.tracking._tracking_service import utils
    with _global_uri:
        before, env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(before)
            if env is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = env


def _already_logged(cfg: GRPOConfig, experiment_id: str, run_id: str, kind: str, iteration: int) -> bool:
    """A re-run stage (killed after logging, before its record) finds its traces there and logs none again."""
    found = tracking.client(cfg).search_traces(
        locations=[experiment_id], max_results=1, include_spans=False,
        filter_string=f"metadata.`{RUN_METADATA}` = '{run_id}' AND tags.kind = '{kind}' "
                      f"AND tags.iteration = '{iteration}'")
    return len(found) > 0


def session_id(run_name: str, run_id: str, session: str) -> str:
    """The run's name and id, then `session`, in characters the UI's session page takes in its URL (no '/')."""
    return re.sub(r"[^\w.\-]", "_", f"{run_name}-{run_id[:8]}-{session}")


STEP_GAP_NS = 1000        # between two steps: spans that start apart are shown in their order


def _write(trace: Trace, experiment_id: str, run_id: str, run_name: str, start_ns: int) -> str:
    """One trace's spans, laid out from `start_ns` (tool spans last their recorded seconds). -> its trace id."""
    import mlflow
    from mlflow.entities import SpanStatusCode, SpanType
    root = mlflow.start_span_no_context(trace.name, span_type=SpanType.AGENT, experiment_id=experiment_id,
                                        start_time_ns=start_ns, inputs=trace.inputs, tags=trace.tags,
                                        metadata={RUN_METADATA: run_id,
                                                  SESSION_METADATA: session_id(run_name, run_id, trace.session)})
    now = start_ns
    for step in trace.steps:
        now += STEP_GAP_NS
        tool = step.kind == "tool"
        span = mlflow.start_span_no_context(
            f"tool {step.name}" if tool else step.name, span_type=SpanType.TOOL if tool else SpanType.CHAT_MODEL,
            parent_span=root, inputs=step.inputs, start_time_ns=now,
            attributes={"seconds": step.seconds, "error": step.error} if tool else None)
        now += int(step.seconds * 1e9)
        span.end(outputs=step.outputs, status=SpanStatusCode.ERROR if step.error else SpanStatusCode.OK,
                 end_time_ns=now)
    root.end(outputs=trace.outputs, end_time_ns=now)
    return root.trace_id


def _queue_room() -> int:
    """How many export tasks to queue before waiting for them: MLflow's background writer discards what its queue
    cannot hold ($MLFLOW_ASYNC_TRACE_LOGGING_MAX_QUEUE_SIZE, 1000 by default; one evaluation answers more), so half
    of it."""
    from mlflow.environment_variables import MLFLOW_ASYNC_TRACE_LOGGING_MAX_QUEUE_SIZE
    return max(1, MLFLOW_ASYNC_TRACE_LOGGING_MAX_QUEUE_SIZE.get() // 2)


def log_traces(cfg: GRPOConfig, run_id: str, traces: list[Trace], kind: str, iteration: int) -> int:
    """Log `traces` (all of one `kind` and iteration) to the run's Traces tab, their feedback after them; none
    when this iteration's are already there. -> how many were logged."""
    import mlflow
    from mlflow.entities import AssessmentSource, AssessmentSourceType
    if not traces:
        return 0
    run = tracking.client(cfg).get_run(run_id).info
    experiment_id = run.experiment_id
    if _already_logged(cfg, experiment_id, run_id, kind, iteration):
        return 0
    source = AssessmentSource(source_type=AssessmentSourceType.CODE, source_id=SCORE_SOURCE)
    with _tracing_to(tracking.tracking_uri(cfg)):
        start, ids, queued, room = time.time_ns(), [], 0, _queue_room()
        for t in traces:
            tasks = len(t.steps) + 2           # the writer gets each span as it ends, then the trace
            if queued and queued + tasks > room:
                mlflow.flush_trace_async_logging()
                queued = 0
            ids.append(_write(t, experiment_id, run_id, run.run_name, start))
            queued += tasks
        mlflow.flush_trace_async_logging()                  # a trace must be stored before feedback can name it
        for trace_id, t in zip(ids, traces):
            for name, value in t.feedback.items():
                mlflow.log_feedback(trace_id=trace_id, name=name, value=value, source=source)
    return len(ids)


@never_fails("rollouts")
def log_rollout_traces(cfg: GRPOConfig, run_dir: str, iteration: int, rows: list[dict], scored: list[dict],
                       questions: dict[str, str]) -> int:
    """The score stage's hook: the first tracking.trace_rollouts rollouts of the iteration as traces (none where
    `run_dir` has no MLflow run). `questions`: task id -> its question. -> how many were logged."""
    run_id, limit = mlflow_run_id(run_dir), cfg.tracking.trace_rollouts
    if not run_id or not limit:
        return 0
    advantages = row_advantages(cfg, rows, scored)
    sample = numbers_in_group(rows)
    traces = [rollout_trace(rows[i], scored[i], advantages[i], iteration, questions[rows[i]["task_id"]], sample[i])
              for i in traced_rows(rows, limit)]
    return log_traces(cfg, run_id, traces, "rollout", iteration)


@never_fails("evaluation answers")
def log_eval_traces(cfg: GRPOConfig, run_id: str | None, iteration: int, rows: list[dict]) -> int:
    """The evaluation's hook: every answer as a trace (none when tracking.trace_rollouts is 0). -> how many."""
    if not run_id or not cfg.tracking.trace_rollouts:
        return 0
    return log_traces(cfg, run_id, [eval_trace(r, iteration) for r in rows], "evaluation", iteration)
