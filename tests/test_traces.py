"""tasks/traces.py: rollouts and evaluation answers as MLflow traces, on real MLflow (SQLite in a temp dir).

The rollouts are real ones (grpo_core.rollout.samplers.rollout with the real calculator), driven by the scripted
sampler of tests/test_multiturn.py, since a random tiny model never writes a tool call; the score stage itself
(`score.fn`) scores them and logs the traces, as in a run. What is checked is what the Traces tab shows: a span per
model turn and per tool call (arguments, result or error, seconds), the rewards as feedback, the tags, one session
per group; `tracking.trace_rollouts` limits the count and 0 turns tracing off; a failure never fails the stage."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import mlflow
import pytest

from grpo_core.config import GRPOConfig
from grpo_core.evaluation.evaluate import score_samples, summarize
from grpo_core.io import read_jsonl, write_jsonl
from grpo_core.model.loading import load_tokenizer
from grpo_core.rollout.multiturn import Toolbox
from grpo_core.rollout.samplers import rollout
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.rollout.tools import resolve_tools
from grpo_core.task import Task, write_tasks
from tasks import traces, tracking
from tasks.eval_logging import log_evaluation
from tasks.score import score
from tests.conftest import isolated_run_env, tiny_config
from tests.test_multiturn import ScriptedSampler, call, responses

QUESTIONS = [("214*37", "7918"), ("12*9", "108"), ("7*8", "56")]


def tasks_for(n_questions: int) -> list[Task]:
    return [Task(id=f"q{i}", kind="math", source="test", prompt=f"What is {expr}?", answer=answer)
            for i, (expr, answer) in enumerate(QUESTIONS[:n_questions])]


def answered(prompts, completions, answer, **_) -> list[float]:
    """A reward plugin: 1 where the completion ends with the right answer (the tiny tokenizer's decode drops the
    <answer> tags that the built-in accuracy reward reads)."""
    return [1.0 if c.split()[-1:] == [str(a)] else 0.0 for c, a in zip(completions, answer)]


REWARDS = ["tests.test_traces:answered", "format"]


def calculator_or_error(text: str, j: int) -> str:
    """Sample 0 of a group asks the calculator and answers with its result; sample 1 divides by zero, then
    guesses wrong."""
    if not responses(text):
        expr = text.split("What is ")[-1].split("?")[0]
        return "let me compute " + call("calculator", expression=expr if j == 0 else "1/0")
    result = responses(text)[-1]
    return "Answer: 5" if "error" in result else f"Answer: {result}"


def one_turn(text: str, j: int) -> str:
    return "Answer: 7918" if j == 0 else "Answer: 5"


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("traces")
    with isolated_run_env(tmp, tiny_model_dir):
        yield tmp, load_tokenizer(tiny_model_dir)


def sampled(tok, reply, n_questions: int, tools: bool) -> list:
    box = Toolbox(resolve_tools(["calculator"])) if tools else None
    return rollout(ScriptedSampler(tok, reply), tok, tasks_for(n_questions), 2, SamplingParams(max_new_tokens=300),
                   "", 4096, toolbox=box)


def scored_run(env, name: str, reply=calculator_or_error, n_questions: int = 1, tools: bool = True,
               **overrides) -> tuple[dict, dict, str]:
    """A run with an MLflow run whose iteration 1 is sampled by `reply` and scored by the score stage.
    -> (config, the stage's record, the MLflow run id)."""
    tmp, tok = env
    config = tiny_config(tmp, run_name=name, num_generations=2, reward_funcs=REWARDS,
                         **({"tools": ["calculator"]} if tools else {}), **overrides)
    run_dir = tmp / "runs" / name
    run_id = tracking.start_or_resume_run(GRPOConfig.model_validate(config), run_dir, None)
    prompts = write_tasks(run_dir / "prompts.jsonl", tasks_for(n_questions))
    samples = write_jsonl(run_dir / "iter-1" / "samples.jsonl",
                          [s.to_dict() for s in sampled(tok, reply, n_questions, tools)])
    return config, score.fn(config, str(run_dir), 1, str(prompts), str(samples)), run_id


def by_run(run_id: str) -> list:
    experiment = mlflow.MlflowClient().get_run(run_id).info.experiment_id
    return mlflow.search_traces(run_id=run_id, locations=[experiment], return_type="list")


def run_traces(run_id: str) -> list:
    """The run's traces, as its Traces tab lists them, in the order they were logged."""
    found = by_run(run_id)
    return sorted(found, key=lambda t: (int(t.info.tags["group"]), int(t.info.tags["sample"])))


def in_order(trace) -> list:
    """The trace's spans in the order the UI shows them (by start)."""
    return sorted(trace.data.spans, key=lambda s: s.start_time_ns)


def spans(trace) -> list[tuple[str, str, str]]:
    return [(s.name, s.span_type, s.status.status_code.value) for s in in_order(trace)]


def feedback(trace) -> dict:
    return {a.name: a.value for a in trace.info.assessments}


def test_a_tool_rollout_is_a_trace_with_a_span_per_model_turn_and_per_tool_call(env):
    config, record, run_id = scored_run(env, "tools")
    found = run_traces(run_id)
    assert len(found) == 2
    right, wrong = found
    root = "rollout", "AGENT", "OK"
    assert spans(right) == [root, ("model turn 1", "CHAT_MODEL", "OK"), ("tool calculator", "TOOL", "OK"),
                            ("model turn 2", "CHAT_MODEL", "OK")]
    assert spans(wrong) == [root, ("model turn 1", "CHAT_MODEL", "OK"), ("tool calculator", "TOOL", "ERROR"),
                            ("model turn 2", "CHAT_MODEL", "OK")]
    # the call: its arguments, the tool's answer (or error), the seconds it took
    tool = in_order(right)[2]
    assert tool.inputs == {"expression": "214*37"} and tool.outputs == {"result": "7918"}
    assert tool.attributes["seconds"] >= 0 and tool.attributes["error"] is False
    failed = in_order(wrong)[2]
    assert failed.inputs == {"expression": "1/0"} and "division by zero" in failed.outputs["error"].lower()
    assert failed.attributes["error"] is True
    # the model's turn as an OpenAI-style choice with its parsed call; the next turn reads the tool's answer
    first, second = in_order(right)[1], in_order(right)[3]
    message = first.outputs["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "214*37"}'}
    assert first.inputs["messages"] == [{"role": "user", "content": "What is 214*37?"}]
    assert second.inputs["messages"][-1]["content"] == "7918"
    assert second.outputs["choices"][0]["message"]["content"] == "Answer: 7918"
    assert in_order(right)[0].outputs["messages"][-1]["content"] == "Answer: 7918"


def test_the_rewards_are_feedback_and_the_tags_say_iteration_group_and_advantage(env):
    config, record, run_id = scored_run(env, "tagged", n_questions=2)
    found = run_traces(run_id)
    scores = list(read_jsonl(record["scores"]))
    assert [(t.info.tags["group"], t.info.tags["sample"]) for t in found] == [("0", "0"), ("0", "1"), ("1", "0"),
                                                                             ("1", "1")]
    for trace, sc in zip(found, scores, strict=True):
        correct = {} if sc["correct"] is None else {"correct": sc["correct"] >= 1.0}
        assert feedback(trace) == {"reward_answered": sc["rewards"]["answered"],
                                   "reward_format": sc["rewards"]["format"], "reward": sc["reward"], **correct}
        assert all(a.source.source_type == "CODE" and a.source.source_id == traces.SCORE_SOURCE
                   for a in trace.info.assessments)
        assert trace.info.tags["iteration"] == "1" and trace.info.tags["kind"] == "rollout"
        assert trace.info.trace_metadata["mlflow.sourceRun"] == run_id
    # group-relative advantages: the right answer above its group's mean, the wrong one below
    advantages = [float(t.info.tags["advantage"]) for t in found]
    assert advantages[0] > 0 > advantages[1] and advantages[2] > 0 > advantages[3]
    assert advantages[0] == pytest.approx(-advantages[1], abs=1e-3)
    # one session per group
    sessions = [t.info.trace_metadata["mlflow.trace.session"] for t in found]
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]
    experiment = found[0].info.experiment_id
    in_session = mlflow.search_traces(locations=[experiment], return_type="list",
                                      filter_string=f"metadata.`mlflow.trace.session` = '{sessions[0]}'")
    assert sorted(t.info.trace_id for t in in_session) == sorted(t.info.trace_id for t in found[:2])


def test_a_one_turn_rollout_is_one_model_turn(env):
    config, record, run_id = scored_run(env, "one-turn", reply=one_turn, tools=False)
    right, wrong = run_traces(run_id)
    assert spans(right) == [("rollout", "AGENT", "OK"), ("model turn 1", "CHAT_MODEL", "OK")]
    choice = in_order(right)[1].outputs["choices"][0]
    assert choice == {"index": 0, "finish_reason": "stop",
                      "message": {"role": "assistant", "content": "Answer: 7918"}}
    assert feedback(right)["reward_answered"] == 1.0 and feedback(wrong)["reward_answered"] == 0.0


def test_trace_rollouts_limits_the_count_whole_groups_first_and_0_turns_tracing_off(env):
    _, _, run_id = scored_run(env, "three", n_questions=3, tracking={"trace_rollouts": 3})
    assert [(t.info.tags["group"], t.info.tags["sample"]) for t in run_traces(run_id)] == [("0", "0"), ("0", "1"),
                                                                                          ("1", "0")]
    _, record, run_id = scored_run(env, "off", n_questions=3, tracking={"trace_rollouts": 0})
    assert record["metrics"]["reward/mean"] > 0 and run_traces(run_id) == []
    description = GRPOConfig.model_fields["tracking"].annotation.model_fields["trace_rollouts"].description
    assert "0: no traces" in description


def test_a_re_run_score_stage_logs_its_traces_once(env):
    config, record, run_id = scored_run(env, "again")
    run_dir = Path(record["scores"]).parent.parent
    (run_dir / "iter-1" / "score.json").unlink(missing_ok=True)          # killed before its record
    score.fn(config, str(run_dir), 1, str(run_dir / "prompts.jsonl"), str(run_dir / "iter-1" / "samples.jsonl"))
    assert len(run_traces(run_id)) == 2


def test_tracing_leaves_the_process_tracking_uri_as_it_was(env):
    before_uri, before_env = mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")
    config = tiny_config(env[0], run_name="elsewhere", tracking={"tracking_uri": f"sqlite:///{env[0]}/other.db"})
    cfg = GRPOConfig.model_validate(config)
    run_dir = env[0] / "runs" / "elsewhere"
    tracking.start_or_resume_run(cfg, run_dir, None)
    rows = [s.to_dict() for s in sampled(env[1], one_turn, 1, tools=False)]
    assert traces.log_rollout_traces(cfg, str(run_dir), 1, rows, [{"reward": 1.0, "rewards": {}}] * 2,
                                     {"q0": "What is 214*37?"}) == 2
    assert (mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI")) == (before_uri, before_env)


def test_a_failure_to_trace_warns_once_and_the_stage_goes_on(env, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ConnectionError("the tracking server went away")
    monkeypatch.setattr(mlflow, "start_span_no_context", broken)
    monkeypatch.setattr(traces, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tasks.traces"):
        _, first, run_id = scored_run(env, "broken-1")
        _, second, _ = scored_run(env, "broken-2")
    assert first["metrics"]["reward/mean"] > 0 and second["metrics"]["reward/mean"] > 0
    warned = [r.getMessage() for r in caplog.records if "traces of the rollouts" in r.getMessage()]
    assert len(warned) == 1 and "the tracking server went away" in warned[0], warned


def test_every_evaluation_answer_is_a_trace_with_its_tool_call_and_reward(env):
    tmp, tok = env
    config = tiny_config(tmp, run_name="eval", tools=["calculator"], reward_funcs=REWARDS,
                         eval=dict(plots=False))
    cfg = GRPOConfig.model_validate(config)
    run_id = tracking.start_or_resume_run(cfg, tmp / "runs" / "eval", None)
    rows = score_samples(sampled(tok, calculator_or_error, 2, tools=True), {t.id: t for t in tasks_for(2)}, cfg,
                         "greedy")
    log_evaluation(cfg, run_id, 0, summarize(rows, cfg.eval.ks), rows, {0: {}}, {0: [r["length"] for r in rows]})
    found = sorted(by_run(run_id),
                   key=lambda t: (t.info.tags["task_id"], int(t.info.tags["sample"])))
    assert len(found) == len(rows) == 4
    for trace, row in zip(found, sorted(rows, key=lambda r: (r["task_id"], r["sample"]))):
        assert trace.info.tags["kind"] == "evaluation" and trace.info.tags["mode"] == "greedy"
        assert trace.info.tags["iteration"] == "0" and trace.info.tags["verdict"] == row["verdict"]
        assert feedback(trace)["reward"] == row["reward_total"] and feedback(trace).get("correct") == row["correct"]
        assert [name for name, _, _ in spans(trace)] == ["evaluation", "model turn 1", "tool calculator",
                                                          "model turn 2"]
    tool = in_order(found[0])[2]
    assert tool.inputs == {"expression": "214*37"} and tool.outputs == {"result": "7918"}
    first = min(rows, key=lambda r: (r["task_id"], r["sample"]))
    recorded = next(m for m in first["messages"] if m["role"] == "tool")            # the rollout's own record
    assert tool.attributes["seconds"] == recorded["seconds"] and tool.attributes["error"] == recorded["error"]
    assert found[0].info.trace_metadata["mlflow.trace.session"] == found[1].info.trace_metadata[
        "mlflow.trace.session"] != found[2].info.trace_metadata["mlflow.trace.session"]


@pytest.fixture()
def small_export_queue(monkeypatch):
    """MLflow's trace writer with a queue of 12 tasks (two traces of 4 spans and more), and as before after."""
    monkeypatch.setenv("MLFLOW_ASYNC_TRACE_LOGGING_MAX_QUEUE_SIZE", "12")
    mlflow.tracing.reset()                                      # the writer and its queue are made again
    yield
    monkeypatch.delenv("MLFLOW_ASYNC_TRACE_LOGGING_MAX_QUEUE_SIZE")
    mlflow.tracing.reset()


def test_more_traces_than_mlflows_export_queue_holds_are_all_stored(env, small_export_queue):
    """MLflow's trace writer queues a task per span and per trace (1000 by default) and drops what does not fit; one
    evaluation logs more (60 questions, 4 prompt shapes, 3 answers: 720 traces of 2-5 spans). Traces go in batches
    the queue holds: here 18 traces of 4 spans through a queue of 12 tasks."""
    tmp, tok = env
    cfg = GRPOConfig.model_validate(tiny_config(tmp, run_name="many", tools=["calculator"], eval=dict(plots=False)))
    run_id = tracking.start_or_resume_run(cfg, tmp / "runs" / "many", None)
    rows = score_samples(sampled(tok, calculator_or_error, 3, tools=True), {t.id: t for t in tasks_for(3)}, cfg,
                         "greedy")
    many = [dict(r, sample=r["sample"] + 2 * k) for k in range(3) for r in rows]                  # 18 answers
    assert traces.log_eval_traces(cfg, run_id, 0, many) == 18
    assert len(by_run(run_id)) == 18
