"""The calculator task of configs/tools.yaml as a verifiers 0.4 taskset: 3-digit products, a calculator tool (an
MCP toolset shared by the episodes, calc_tools.py), the answer in <answer></answer> tags, judged by the pipeline's
own math_accuracy. With this directory on PYTHONPATH its id is `calc_taskset`:

    environment: "verifiers:calc_taskset"          # configs/verifiers.yaml
"""
import random
from collections.abc import Iterator

import verifiers.v1 as vf

from grpo_core.rewards.rewards import math_accuracy
from grpo_core.task import Task

SYSTEM = ("Use the calculator tool for the arithmetic, then reply with only the final number inside "
          "<answer></answer> tags.")
# Worked exchanges with operands outside the 3-digit question space (configs/tools.yaml's few_shot).
FEW_SHOT = [
    ("What is 214 * 37?", '<tool_call>{"name": "calculator", "arguments": {"expression": "214 * 37"}}</tool_call>'),
    ("<tool_response>\n7918\n</tool_response>", "<answer>7918</answer>"),
]


class ProductData(vf.TaskData):
    answer: str


class ProductTask(vf.Task[ProductData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def accuracy(self, task, trace) -> float:
        gold = Task(id=task.id or "", kind="math", source="calc_taskset", prompt="", answer=task.answer)
        return math_accuracy(trace.last_reply or "", gold)

    @vf.metric
    async def tool_calls(self, trace) -> float:
        return float(len(trace.tool_messages))


class ProductConfig(vf.TasksetConfig):
    n: int = 200            # questions
    seed: int = 0
    few_shot: bool = True   # the worked exchanges before the question
    tools: bool = True      # the calculator (false: a single-turn task)


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    @classmethod
    def toolsets(cls, config):
        from calc_tools import CalculatorTools
        return [CalculatorTools(vf.SharedToolsetConfig())] if config.tools else []

    def load(self) -> Iterator[ProductTask]:
        rng = random.Random(self.config.seed)
        shots = [{"role": r, "content": c} for q, a in FEW_SHOT if self.config.few_shot
                 for r, c in (("user", q), ("assistant", a))]
        for i in range(self.config.n):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            question = {"role": "user", "content": f"What is {a} * {b}?"}
            yield ProductTask(ProductData(id=f"product-{i}", prompt=[*shots, question], answer=str(a * b),
                                          system_prompt=SYSTEM), self.config.task)


__all__ = ["ProductTaskset"]
