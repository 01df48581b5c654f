"""The calculator task of configs/tools.yaml as an OpenEnv server (openenv 0.4.1's create_app).

    environment: "openenv:calculator_env:app"      # with examples/openenv on PYTHONPATH (configs/openenv.yaml)

`reset(prompt=..., answer=...)` takes the task's question and gold answer (the pipeline passes each task's fields;
the server keeps those its reset accepts) and observes the question. Each step's action is the model's turn:
a `<tool_call>` of the calculator is answered with the result in `<tool_response>` tags (reward 0, not done);
any other turn is the final answer, judged as the run's accuracy reward judges it (reward 1 or 0, done).
"""
from __future__ import annotations

import os
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from grpo_core.rewards.rewards import math_accuracy
from grpo_core.rollout.tools import calculate, parse_tool_calls
from grpo_core.task import Task

SYSTEM = ("Use the calculator tool for the arithmetic, then reply with only the final number inside "
          "<answer></answer> tags.")


class Reply(Action):
    reply: str = Field(..., description="the model's turn: a calculator call or the final answer")


class Text(Observation):
    text: str = ""


class CalculatorEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self._task = State(episode_id=str(uuid4()), step_count=0), None

    def reset(self, seed=None, episode_id=None, prompt: str = "", answer: str = "", **_) -> Text:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._task = Task(id=self._state.episode_id, kind="math", source="openenv", prompt=prompt, answer=answer)
        return Text(text=prompt, done=False, reward=0.0)

    def step(self, action: Reply, timeout_s=None, **_) -> Text:
        self._state.step_count += 1
        calls = parse_tool_calls(action.reply)
        if calls:
            call = calls[0]
            try:
                result = calculate(call.arguments["expression"]) if call.name == "calculator" and not call.error \
                    else f"error: {call.error or 'no tool named ' + repr(call.name)}"
            except Exception as e:  # noqa: BLE001 - the model reads what went wrong, as a tool's error
                result = f"error: {e}"
            return Text(text=f"<tool_response>\n{result}\n</tool_response>", done=False, reward=0.0)
        return Text(text="", done=True, reward=math_accuracy(action.reply, self._task))

    @property
    def state(self) -> State:
        return self._state


# sessions at once (one per episode the stage runs together); CALCULATOR_ENV_SESSIONS lowers it (tests)
app = create_app(CalculatorEnvironment, Reply, Text, env_name="calculator",
                 max_concurrent_envs=int(os.environ.get("CALCULATOR_ENV_SESSIONS", "16")))
