"""The calculator task of configs/tools.yaml as TRL's `environment_factory`: one instance per rollout, `reset` gets
the task's fields, public methods are the tools the model may call, the run's reward functions judge the answer.

    environment: "calculator_environment:CalculatorEnvironment"   # with examples/environments on PYTHONPATH

The same task under the other standards: examples/agents/calculator_agent.py (an OpenAI-client agent loop),
examples/openenv/calculator_env.py (an OpenEnv server); tests/test_four_standards.py runs them side by side.
"""
from __future__ import annotations

from grpo_core.rollout.tools import calculate, calculator_tool


class CalculatorEnvironment:
    def reset(self, **task) -> None:
        """Nothing to add to the question."""
        return None

    def calculator(self, expression: str) -> str:
        return calculate(expression)

    calculator.__doc__ = calculator_tool().__doc__      # the built-in tool's description: the same schema
