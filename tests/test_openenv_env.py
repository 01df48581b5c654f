"""OpenEnv environments as rollouts (grpo_core/rollout/openenv_env.py, config environment "openenv:..."): the
stage starts the server (examples/openenv/calculator_env.py, openenv's own create_app under uvicorn), plays each
episode over its WebSocket session, the model's turns as actions through the policy endpoint, and trains on the
tokens the endpoint sampled; bad entries and servers that do not start are named."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM

from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.model.loading import load_tokenizer
from grpo_core.plugins import PluginError
from grpo_core.rollout.agents import AgentLoop, agent_metrics, agent_rollout
from grpo_core.rollout.openenv_env import Server, observation_text, turn_text
from grpo_core.rollout.samplers import KVCacheSampler
from grpo_core.rollout.tools import parse_tool_calls
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.task import Task
from tests.conftest import on_sys_path, one_iteration, tiny_config

pytest.importorskip("openenv")
pytest.importorskip("openai")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "openenv"
ENTRY = "openenv:calculator_env:app"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "214 * 37"}}</tool_call>'
QUESTION = Task(id="q", kind="math", source="test", prompt="What is 214 * 37?", answer="7918")


@pytest.fixture(scope="module")
def examples_on_path():
    with on_sys_path(EXAMPLES):
        yield


@pytest.fixture(scope="module")
def calculator(examples_on_path):
    """The example server, started once for the module's episodes (as a stage starts it for its rollouts)."""
    loop = AgentLoop.resolve(ENTRY, 4, options={"max_turns": 3})
    with loop.serving():
        yield loop


class Scripted:
    """An OpenAI client's chat.completions that answers from a script and keeps what it was sent."""

    def __init__(self, *replies: str):
        self.replies, self.sent = list(replies), []
        self.chat = self.completions = self

    def create(self, model, messages):
        self.sent.append([dict(m) for m in messages])
        message = type("Message", (), {"content": self.replies.pop(0)})
        return type("Reply", (), {"choices": [type("Choice", (), {"message": message})]})


def test_the_config_checks_an_openenv_entry_without_starting_it(examples_on_path):
    assert GRPOConfig(environment=ENTRY, environment_config={"max_turns": 2}).environment == ENTRY
    for entry, says in [("openenv:no_such_env_module:app", "no module named 'no_such_env_module'"),
                        ("openenv:calculator_env", "the target is"),
                        ("openenv:calculator_env:not an app", "the target is")]:
        with pytest.raises((ConfigError, ValueError), match=says):
            GRPOConfig(environment=entry)
    for options, says in [({"max_turn": 3}, "environment_config.max_turn: not an option"),
                          ({"max_turns": "3"}, "max_turns must be an integer"), ({"max_turns": 0}, "must be positive"),
                          ({"reset": [1]}, "reset must be a mapping")]:
        with pytest.raises((ConfigError, ValueError), match=says):
            GRPOConfig(environment=ENTRY, environment_config=options)
    with pytest.raises((ConfigError, ValueError), match="environment_config is for"):
        GRPOConfig(environment_config={"max_turns": 2})
    with pytest.raises((ConfigError, ValueError), match="brings its own tools"):
        GRPOConfig(environment=ENTRY, tools=["calculator"])


def test_actions_and_observations_are_read_from_the_schema():
    server = Server("http://x", "openenv:http://x", 1)
    server.action_schema = {"properties": {"reply": {"type": "string"}}, "required": ["reply"]}
    assert server.action("  42 ", None) == {"reply": "42"}
    server.action_schema = {"properties": {"row": {}, "col": {}}, "required": ["row", "col"]}
    assert server.action('I play {"row": 1, "col": 2} now', None) == {"row": 1, "col": 2}
    with pytest.raises(ValueError, match="not a JSON object"):
        server.action("the middle square", None)
    assert server.action("b2", "move") == {"move": "b2"}
    assert observation_text({"text": "hi", "metadata": {}, "done": False, "reward": 0.0}, None) == "hi"
    assert json.loads(observation_text({"board": "x..", "legal": "a1 b2"}, None)) == {"board": "x..", "legal": "a1 b2"}
    with pytest.raises(KeyError, match="observation_field.*no field 'prompt'"):
        observation_text({"text": "hi"}, "prompt")
    two = {"context": "A report.", "question": "What does it say?", "metadata": {}}
    assert observation_text(two, None, "{context}\n\nQuestion: {question}") == "A report.\n\nQuestion: What does it say?"
    with pytest.raises(KeyError, match="observation_template: KeyError 'answer'; the observation has context"):
        observation_text(two, None, "{answer}")


def test_a_reply_with_tool_calls_is_acted_as_the_text_the_model_wrote():
    call = SimpleNamespace(id="c1", function=SimpleNamespace(name="calculator", arguments='{"expression": "2 * 3"}'))
    reply = SimpleNamespace(content="Let me compute. ", tool_calls=[call])
    text = turn_text(reply)
    assert text == 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text)] == [("calculator", {"expression": "2 * 3"})]
    assert turn_text(SimpleNamespace(content="<answer>6</answer>", tool_calls=None)) == "<answer>6</answer>"
    with pytest.raises((ConfigError, ValueError), match="environment_config.tools\\[0\\]"):
        GRPOConfig(environment="openenv:http://127.0.0.1:9", environment_config={"tools": ["no_such_tool"]})


def test_an_episode_is_the_servers_turns_and_its_rewards(calculator):
    """Over a real server: a calculator call is answered in <tool_response> tags as the next user turn, the final
    answer is judged; the model's turns are the actions."""
    client = Scripted(CALL, "<answer>7918</answer>")
    assert calculator.run(client, QUESTION) == {"reward": 1.0, "metrics": {"turns": 2.0, "done": 1.0,
                                                                             "invalid_actions": 0.0}}
    assert client.sent[-1] == [{"role": "user", "content": "What is 214 * 37?"}, {"role": "assistant", "content": CALL},
                               {"role": "user", "content": "<tool_response>\n7918\n</tool_response>"}]
    wrong = Scripted("<answer>7900</answer>")
    assert calculator.run(wrong, QUESTION)["reward"] == 0.0
    stubborn = Scripted(CALL, CALL, CALL)                          # max_turns: 3, never answers
    assert calculator.run(stubborn, QUESTION)["metrics"] == {"turns": 3.0, "done": 0.0, "invalid_actions": 0.0}


def test_a_server_at_its_session_limit_is_waited_for(examples_on_path, monkeypatch):
    """A server that admits one session at a time closes the others at once; they are tried again, so three
    episodes run at once all finish."""
    monkeypatch.setenv("CALCULATOR_ENV_SESSIONS", "1")
    loop = AgentLoop.resolve(ENTRY, 3)
    with loop.serving(), ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda _: loop.run(Scripted(CALL, "<answer>7918</answer>"), QUESTION), range(3)))
    assert [o["reward"] for o in outcomes] == [1.0, 1.0, 1.0]


def test_rollouts_train_on_the_tokens_the_endpoint_sampled(calculator, tiny_model_dir):
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    tasks = [Task(id=f"t{i}", kind="math", source="test", prompt=f"What is {i} * 3?", answer=str(3 * i))
             for i in range(2)]
    groups = agent_rollout(KVCacheSampler(model, tok, "cpu", progress=False), tok, tasks, 2,
                           SamplingParams(max_new_tokens=6, seed=1), calculator, group_ids=[4, 5])
    assert [[s.group for s in g] for g in groups] == [[4, 4], [5, 5]]
    for task, group in zip(tasks, groups):
        for s in group:
            assert task.prompt in tok.decode(s.prompt_ids)              # reset's observation is the first user turn
            assert len(s.completion_ids) == len(s.completion_mask) == len(s.sampler_logprobs)
            assert sum(s.completion_mask) >= 1 and s.extra["branches"] == 1
            assert s.extra["environment_reward"]["openenv_reward"] in (0.0, 1.0)
    metrics = agent_metrics([s.to_dict() for g in groups for s in g])
    assert metrics["agent/failed_frac"] == 0.0 and 1.0 <= metrics["agent/turns"] <= 3.0


def test_a_server_that_does_not_start_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("raise RuntimeError('the dataset file is missing')\napp = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loop = AgentLoop.resolve("openenv:broken_env:app", 2)
    with pytest.raises(PluginError, match="(?s)'openenv:broken_env:app': the server exited.*dataset file is missing"):
        with loop.serving():
            pass
    nowhere = AgentLoop.resolve("openenv:http://127.0.0.1:9", 2, options={"start_timeout": 0.5})
    with pytest.raises(TimeoutError, match="no answer on http://127.0.0.1:9/health within 0.5 s"):
        with nowhere.serving():
            pass


@pytest.mark.slow
def test_an_openenv_run_trains_through_the_pipeline(tmp_path, grpo_home, prefect_engine, mlflow_uri, examples_on_path):
    """One iteration with the example server as the environment, through the real Prefect engine: the rollout
    stage starts and stops the server, the score stage adds its reward and logs the episodes' metrics."""
    config = tiny_config(tmp_path, environment=ENTRY, environment_config={"max_turns": 2}, reward_funcs=["format"],
                         pipeline_iterations=1, max_completion_length=12, eval=dict(enabled=False))
    res, rows = one_iteration(tmp_path, config)
    assert len(rows) == 2 * config["num_generations"]
    assert all(sum(r["completion_mask"]) >= 1 and "openenv_reward" in r["extra"]["environment_reward"] for r in rows)
    assert "agent/turns" in res["score"]["metrics"] and res["score"]["metrics"]["agent/failed_frac"] == 0.0
    assert Path(res["update"]["checkpoint"]).exists()
