"""An agent loop as OpenPipe ART trains one: plain OpenAI chat completions with one tool, in a loop of its own.

    rollout_func: "calculator_agent:run"        # with examples/agents on PYTHONPATH (configs/agent.yaml)

The pipeline calls `run(client, task)` once per rollout with a client bound to the policy it is training; the
tokens the policy sampled for these requests are what the update trains on (grpo_core/rollout/agents.py). This
agent leaves the judging to the run's reward functions (they read the model's last turn) and reports how many
calls it made; return {"reward": x} (or a number) to judge the answer yourself.
"""
from __future__ import annotations

import json

from grpo_core.rollout.tools import calculate, resolve_tools

SYSTEM = ("Use the calculator tool for the arithmetic, then reply with only the final number inside "
          "<answer></answer> tags.")
TOOLS = [tool.schema for tool in resolve_tools(["calculator"])]   # the built-in's: the prompt tools.yaml renders
MAX_TURNS = 3


def _result(arguments: str) -> str:
    try:
        return calculate(json.loads(arguments)["expression"])
    except Exception as e:  # noqa: BLE001 - the model reads what went wrong, as a tool's error
        return f"error: {e}"


def run(client, task) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    calls = 0
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            break
        for call in reply.message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _result(call.function.arguments)})
    return {"metrics": {"tool_calls": calls}}
