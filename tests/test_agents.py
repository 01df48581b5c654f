"""Any agent loop as a rollout (grpo_core/rollout/agents.py, config rollout_func): the agent talks to the real tiny
policy through the real openai client; the sample it leaves is the tokens the endpoint sampled; its outcome is read
strictly; a run with one trains end to end through the real Prefect engine."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.model.loading import load_tokenizer
from grpo_core.rollout.agents import AgentLoop, agent_metrics, agent_rollout, read_outcome, run_with_deadlines
from grpo_core.rollout.samplers import KVCacheSampler
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.task import Task

pytest.importorskip("openai")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
TASKS = [Task(id=f"t{i}", kind="math", source="test", prompt=f"What is {i} + 2?", answer=str(i + 2)) for i in range(2)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("value,expected", [
    (1, (1.0, {}, True)), (0.25, (0.25, {}, True)), (None, (None, {}, False)),
    ({"reward": 0.5, "metrics": {"calls": 2}}, (0.5, {"calls": 2.0}, True)),
    ({"metrics": {"calls": 1}}, (None, {"calls": 1.0}, False)),
])
def test_an_agent_returns_a_number_a_dict_or_nothing(value, expected):
    assert read_outcome(value, "rollout_func 'a'") == expected


@pytest.mark.parametrize("value,says", [("1.0", "returned str"), ({"score": 1}, "returned dict"),
                                        (float("nan"), "finite"), ({"metrics": {"x": "high"}}, "metric 'x'"),
                                        (True, "returned bool")])
def test_what_an_agent_may_not_return_is_named(value, says):
    with pytest.raises(TypeError, match=says):
        read_outcome(value, "rollout_func 'a'")


def test_the_config_resolves_the_agent_and_refuses_a_second_turn_driver(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    assert GRPOConfig(rollout_func="calculator_agent:run").rollout_func == "calculator_agent:run"
    with pytest.raises((ConfigError, ValueError), match="rollout_func.*no_such_agent_module"):
        GRPOConfig(rollout_func="no_such_agent_module:run")
    with pytest.raises((ConfigError, ValueError), match="tools cannot be set"):
        GRPOConfig(rollout_func="calculator_agent:run", tools=["calculator"])
    assert GRPOConfig(rollout_func="calculator_agent:run").rollout_timeout == 3600
    assert GRPOConfig(rollout_func="calculator_agent:run", rollout_timeout=None).rollout_timeout is None
    with pytest.raises((ConfigError, ValueError), match="rollout_timeout"):
        GRPOConfig(rollout_func="calculator_agent:run", rollout_timeout=0)


def test_each_rollout_trains_on_the_tokens_its_agent_was_sent(tiny):
    """A two-turn agent that keeps what the client handed it: the sample's model tokens are exactly the tokens of
    its two replies (in order, with their log-probs), its prompt the first request's, its group the given id; a
    rollout whose agent raises is unscorable, the others are not."""
    model, tok = tiny
    seen: dict[str, list] = {}

    def agent(client, task):
        messages = [{"role": "user", "content": task.prompt}]
        got = []
        for follow_up in ("Check it.", None):
            r = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
            got.append((r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"],
                        [c.logprob for c in r.choices[0].logprobs.content]))
            if follow_up:
                messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                             {"role": "user", "content": follow_up}]
        key = f"{task.id}-{len([k for k in seen if k.startswith(task.id)])}"
        seen[key] = got
        if task.id == "t1" and key.endswith("-0"):
            raise RuntimeError("the agent's own bug")
        return {"reward": 1.0, "metrics": {"turns": 2}}

    agent.__name__ = "two_turns"
    params = SamplingParams(max_new_tokens=6, seed=5)
    groups = agent_rollout(KVCacheSampler(model, tok, "cpu", progress=False), tok, TASKS, 2, params,
                           AgentLoop(agent, "two_turns", concurrency=4), group_ids=[7, 9])
    assert [[s.group for s in g] for g in groups] == [[7, 7], [9, 9]]
    samples = [s for g in groups for s in g]
    assert len(seen) == 4
    prompts = {tuple(got[0][0]) for got in seen.values()}
    for s in samples:
        model_tokens = [t for t, m in zip(s.completion_ids, s.completion_mask) if m]
        matches = [got for got in seen.values() if got[0][0] == s.prompt_ids and got[0][1] + got[1][1] == model_tokens]
        assert matches, "the sample's tokens are the ones its agent was sent"
        assert tuple(s.prompt_ids) in prompts
        lps = [lp for lp, m in zip(s.sampler_logprobs, s.completion_mask) if m]
        assert lps == pytest.approx(matches[0][0][2] + matches[0][1][2])
    failed = [s for s in samples if "agent_error" in s.extra]
    assert len(failed) == 1 and failed[0].extra["environment_reward"] == {"two_turns": None}
    assert all(s.extra["environment_reward"] == {"two_turns": 1.0} for s in samples if s not in failed)
    metrics = agent_metrics([s.to_dict() for s in samples])
    assert metrics["agent/failed_frac"] == 0.25 and metrics["agent/turns"] == 2.0
    assert metrics["agent/prompts_per_group"] == 1.0                     # each group: one question
    mixed = [{"group": 0, "prompt_ids": [1, 2], "extra": s.to_dict()["extra"]} for s in samples[:2]]
    mixed[1]["prompt_ids"] = [3]
    assert agent_metrics(mixed)["agent/prompts_per_group"] == 2.0


def test_when_every_rollout_fails_the_stage_says_why(tiny):
    model, tok = tiny

    def broken(client, task):
        raise KeyError("no such field")

    with pytest.raises(RuntimeError, match="every rollout failed.*KeyError"):
        agent_rollout(KVCacheSampler(model, tok, "cpu", progress=False), tok, TASKS[:1], 2,
                      SamplingParams(max_new_tokens=4), AgentLoop(broken, "broken"), group_ids=[0])


def test_a_stuck_rollout_times_out_and_the_others_finish():
    """Two slots, four jobs, one stuck forever: it is a TimeoutError after its own deadline, its slot is taken by a
    fresh thread, and the others finish with their values."""
    import threading
    import time
    stuck = threading.Event()

    def job(k):
        if k == 1:
            stuck.wait()                       # never set: a loop that never returns
        time.sleep(0.05)
        return k * 10, None

    t0 = time.monotonic()
    outcomes = run_with_deadlines(job, 4, 2, timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert [o[0] for o in outcomes] == [0, None, 20, 30]
    assert outcomes[1][1].startswith("TimeoutError") and "rollout_timeout (0.5 s)" in outcomes[1][1]
    stuck.set()
    assert run_with_deadlines(job, 3, 8, timeout=None) == [(0, None), (10, None), (20, None)]   # no limit: all wait

    def exits(k):
        raise SystemExit(3)                    # an agent calling sys.exit: that job fails, the loop does not wait on
    assert run_with_deadlines(exits, 2, 2, timeout=None) == [(None, "SystemExit: 3")] * 2


def test_an_agent_that_never_returns_is_left_out_of_its_group(tiny):
    """A real agent loop through the real endpoint: one rollout hangs after its first request; with
    rollout_timeout it is unscorable, the group's other rollout keeps its reward, and the stage returns."""
    import threading
    model, tok = tiny
    hang = threading.Event()
    calls = []

    def agent(client, task):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
        calls.append(task.id)
        if len(calls) == 1:
            hang.wait()
        return 1.0

    agent.__name__ = "sometimes_stuck"
    sampler = KVCacheSampler(model, tok, "cpu", progress=False)
    sampler.generate([tok("warm up").input_ids], 1, SamplingParams(max_new_tokens=2))  # first use compiles kernels
    loop = AgentLoop(agent, "sometimes_stuck", concurrency=2)
    groups = agent_rollout(sampler, tok, TASKS[:1], 2, SamplingParams(max_new_tokens=4, seed=1), loop, group_ids=[0],
                           timeout=10.0)
    hang.set()
    errors = [s.extra.get("agent_error") for s in groups[0]]
    assert sorted(map(bool, errors)) == [False, True]
    assert "rollout_timeout (10 s)" in next(e for e in errors if e)
    assert [s.extra["environment_reward"] for s in groups[0] if "agent_error" not in s.extra] == [{"sometimes_stuck": 1.0}]


@pytest.mark.slow
def test_an_agent_run_trains_through_the_pipeline(tmp_path, grpo_home, prefect_engine, mlflow_uri, monkeypatch):
    """One iteration with rollout_func = the calculator agent (examples/agents), through the real Prefect engine:
    samples carry the endpoint's tokens and mask, the score stage logs the agent's metrics, the update runs."""
    from tests.conftest import one_iteration, tiny_config
    monkeypatch.syspath_prepend(str(EXAMPLES))
    config = tiny_config(tmp_path, rollout_func="calculator_agent:run", pipeline_iterations=1, max_completion_length=12,
                         eval=dict(enabled=False))
    res, rows = one_iteration(tmp_path, config)
    assert len(rows) == 2 * config["num_generations"]
    for r in rows:
        assert len(r["completion_mask"]) == len(r["completion_ids"]) == len(r["sampler_logprobs"])
        assert sum(r["completion_mask"]) >= 1 and "agent_metrics" in r["extra"]
    assert "agent/tool_calls" in res["score"]["metrics"] and res["score"]["metrics"]["agent/failed_frac"] == 0.0
    assert Path(res["update"]["checkpoint"]).exists()
