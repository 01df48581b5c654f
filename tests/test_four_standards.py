"""The calculator task of configs/tools.yaml under every standard the pipeline trains: TRL's environment_factory
(examples/environments), an OpenAI-client agent loop (examples/agents), an OpenEnv server (examples/openenv) and a
verifiers environment (examples/verifiers). Each is a config of its own, dispatched by the rollout exactly as a run
does; with the same seed the first turn is the same prompt, the same sampled tokens and log-probs, and the same
reward under all four.

Why only the first turn: the in-process loop (environment_factory) draws every turn of a batch from one random
stream, in one engine call that continues after each tool result; the other three reach the policy through the
endpoint, where each turn is a request of its own, sampled by a new engine call seeded again. A later turn is
therefore drawn from the same distribution, from other random numbers. The tiny random model never calls the tool,
so here every episode is one turn and the whole rollouts and rewards agree.

Where the verifiers version differs, and why: its calculator is an MCP tool, whose schema MCP builds its own way
(the whole docstring as the description, pydantic's `title` fields, no return type), so the tool list in its
prompt is other text than the schema the other three show (TRL's, from the same function's docstring). Everything
else in its prompt is the same, and its sample is what the endpoint sampled for that prompt
(tests/test_verifiers_env.py); its reward is the same check of its answer."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from grpo_core.config import GRPOConfig
from grpo_core.data.sources import load_source
from grpo_core.model.loading import load_tokenizer
from grpo_core.rollout.multiturn import Toolbox
from grpo_core.rollout.samplers import KVCacheSampler, rollout
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.rewards.rewards import math_accuracy
from tests.conftest import on_sys_path, one_iteration, tiny_config

pytest.importorskip("openenv")
pytest.importorskip("verifiers")
pytest.importorskip("openai")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SYSTEM = ("Use the calculator tool for the arithmetic, then reply with only the final number inside "
          "<answer></answer> tags.")
STANDARDS = {
    "environment_factory": dict(environment="calculator_environment:CalculatorEnvironment"),
    "agent loop": dict(rollout_func="calculator_agent:run"),
    "OpenEnv": dict(environment="openenv:calculator_env:app",
                    environment_config={"system_prompt": SYSTEM, "tools": ["calculator"], "max_turns": 3}),
    "verifiers": dict(environment="verifiers:calc_taskset", data={"curated": "configs/data/verifiers.yaml"},
                      environment_config={"taskset": {"n": 1, "few_shot": False}, "agent": {"max_turns": 3}}),
}


@pytest.fixture(scope="module")
def examples_on_path():
    with on_sys_path(*(EXAMPLES / d for d in ("environments", "agents", "openenv", "verifiers"))):
        yield


def without_tool_list(prompt: str) -> str:
    return re.sub(r"<tools>.*?</tools>", "<tools></tools>", prompt, flags=re.S)


def first_turn(sample) -> list[int]:
    mask = sample.completion_mask or [1] * len(sample.completion_ids)
    end = mask.index(0) if 0 in mask else len(mask)
    return sample.completion_ids[:end]


def test_the_same_seed_gives_the_same_rollout_under_every_standard(examples_on_path, tiny_model_dir):
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, logprobs=True)
    # the verifiers task source's first row (its question, its gold answer, its own row for the verifiers episode)
    [task] = load_source("verifiers", taskset={"id": "calc_taskset", "n": 1, "few_shot": False})
    got = {}
    for name, fields in STANDARDS.items():
        data = {"system_prompt": SYSTEM, "few_shot": [], **fields.pop("data", {})}
        cfg = GRPOConfig(model=str(tiny_model_dir), max_tool_calling_iterations=1, max_prompt_length=4096, data=data,
                         **fields)
        [sample] = rollout(KVCacheSampler(model, tok, "cpu", progress=False), tok, [task], 1, params,
                           cfg.data.prompt_format_at(1), cfg.max_prompt_length, toolbox=Toolbox.from_config(cfg))
        got[name] = sample
    reference = got["environment_factory"]
    assert task.prompt in tok.decode(reference.prompt_ids) and "calculator" in tok.decode(reference.prompt_ids)
    mcp = got.pop("verifiers")
    assert without_tool_list(tok.decode(mcp.prompt_ids)) == without_tool_list(tok.decode(reference.prompt_ids))
    assert '"title": "Expression"' in tok.decode(mcp.prompt_ids)                   # MCP's schema of the tool
    assert mcp.extra["environment_reward"] == {"verifiers_reward": math_accuracy(mcp.completion, task)}
    for name, sample in got.items():
        assert sample.prompt_ids == reference.prompt_ids, f"{name}: another prompt"
        assert first_turn(sample) == first_turn(reference), f"{name}: other tokens"
        lps = sample.sampler_logprobs[:len(first_turn(sample))]
        assert lps == pytest.approx(reference.sampler_logprobs[:len(first_turn(reference))], abs=1e-5), name
        assert sample.completion == reference.completion
    assert got["OpenEnv"].extra["environment_reward"] == {"openenv_reward": math_accuracy(reference.completion, task)}


@pytest.mark.slow
def test_the_environment_factory_version_trains_through_the_pipeline(tmp_path, grpo_home, prefect_engine, mlflow_uri,
                                                                    examples_on_path):
    """One iteration of the environment_factory version through the real Prefect engine (the agent loop, OpenEnv and
    verifiers versions each have theirs: tests/test_agents.py, test_openenv_env.py, test_verifiers_env.py)."""
    config = tiny_config(tmp_path, environment=STANDARDS["environment_factory"]["environment"],
                         max_tool_calling_iterations=1, pipeline_iterations=1, max_completion_length=12,
                         eval=dict(enabled=False))
    res, rows = one_iteration(tmp_path, config)
    assert len(rows) == 2 * config["num_generations"] and all("turns" in r["extra"] for r in rows)
    assert Path(res["update"]["checkpoint"]).exists()
