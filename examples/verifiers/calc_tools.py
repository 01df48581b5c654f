"""The calculator as an MCP toolset shared by every episode (verifiers starts it once per `env.serving()`, as
`python -m calc_tools`: keep this directory on PYTHONPATH)."""
import verifiers.v1 as vf

from grpo_core.rollout.tools import calculate


class CalculatorTools(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    TOOL_PREFIX = None              # the model calls `calculator`, not `calculator_tools_calculator`

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. '12*(3+4)/5'.
        """
        return calculate(expression)


if __name__ == "__main__":
    CalculatorTools.run()
