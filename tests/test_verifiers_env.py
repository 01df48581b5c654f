"""verifiers environments as rollouts (grpo_core/rollout/verifiers_env.py, config environment "verifiers:..."):
verifiers' own loader loads the example taskset (examples/verifiers: 3-digit products, a calculator MCP toolset),
its episodes run through the policy endpoint with verifiers' train client (prompts rendered as the pipeline renders
them, turns bridged), and the sample trains on exactly the tokens verifiers' trace holds; bad entries are named;
the `verifiers` task source yields the taskset's rows; a run trains end to end."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.data.sources import load_source
from grpo_core.data.validate import check_static
from grpo_core.model.loading import load_tokenizer
from grpo_core.plugins import PluginError
from grpo_core.rollout import verifiers_env
from grpo_core.rollout.agents import AgentLoop, agent_metrics, agent_rollout
from grpo_core.rollout.endpoint import PolicyEndpoint
from grpo_core.rollout.samplers import KVCacheSampler
from grpo_core.rollout.sampling import SamplingParams
from tests.conftest import on_sys_path
from tests.test_endpoint import ScriptedEngine

pytest.importorskip("verifiers")
openai = pytest.importorskip("openai")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "verifiers"
ENTRY = "verifiers:calc_taskset"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "214 * 37"}}</tool_call>'
SINGLE_TURN = {"taskset": {"n": 4, "tools": False, "few_shot": False}}
WITH_TOOLS = {"taskset": {"n": 4}, "agent": {"max_turns": 3}}


@pytest.fixture(scope="module", autouse=True)
def examples_on_path():
    with on_sys_path(EXAMPLES):
        yield


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def tasks(options: dict, n: int = 4):
    return load_source("verifiers", taskset={"id": "calc_taskset", **options["taskset"]}, limit=n)


def episode_through(endpoint: PolicyEndpoint, loop: AgentLoop, task, session: str):
    client = openai.OpenAI(base_url=endpoint.session_url(session) + "/v1", api_key="local", max_retries=0)
    return loop.run.__self__.episode(client, task)


# -- checked before anything runs -------------------------------------------------------------------------

BROKEN = '''import verifiers.v1 as vf
class BrokenTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def __init__(self, config):
        raise RuntimeError("the data file is missing")
    def load(self):
        return []
__all__ = ["BrokenTaskset"]
'''


@pytest.mark.parametrize("entry,options,says", [
    ("verifiers:no_such_taskset", {}, r"no_such_taskset.*not found.*put the directory of its module on PYTHONPATH"),
    (ENTRY, {"taskset": {"n_questions": 3}}, r"calc_taskset.*taskset.n_questions.*Extra inputs are not permitted"),
    (ENTRY, {"agent": {"max_turns": "many"}}, r"calc_taskset.*agent.max_turns"),
    (ENTRY, {"taskset": {"id": "other"}}, r"environment_config.taskset.*its id is 'calc_taskset'"),
    (ENTRY, {"agent": {"harness": {"id": "bash"}}}, r"environment_config.agent.harness.id: 'bash' fetches programs"),
    ("verifiers:broken_taskset", {}, r"broken_taskset.*RuntimeError: the data file is missing"),
])
def test_what_cannot_be_loaded_is_one_clear_error(entry, options, says, tmp_path, monkeypatch):
    (tmp_path / "broken_taskset.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=says):
        AgentLoop.resolve(entry, options=options)


def test_without_verifiers_installed_the_fix_is_named(monkeypatch):
    monkeypatch.setattr(verifiers_env, "find_spec", lambda name: None)
    with pytest.raises(PluginError, match=r"'verifiers:x' needs the verifiers package.*pip install"):
        AgentLoop.resolve("verifiers:x", options={"taskset": {"n": 1}})


def test_the_config_checks_the_environment_when_it_is_read():
    curated = {"curated": "configs/data/verifiers.yaml"}
    cfg = GRPOConfig(environment=ENTRY, environment_config=SINGLE_TURN, data=curated)
    assert cfg.environment == ENTRY
    with pytest.raises((ConfigError, ValueError), match="calc_taskset.*taskset.bogus"):
        GRPOConfig(environment=ENTRY, environment_config={"taskset": {"bogus": 1}}, data=curated)
    with pytest.raises((ConfigError, ValueError), match="plays the tasks of its taskset: set data.curated"):
        GRPOConfig(environment=ENTRY, environment_config=SINGLE_TURN)


def test_the_source_yields_the_tasksets_rows_as_tasks():
    rows = tasks(WITH_TOOLS, 3)
    assert [t.id for t in rows] == [f"verifiers/calc_taskset/product-{i}" for i in range(3)]
    first = rows[0]
    a, b = map(int, first.prompt.removeprefix("What is ").removesuffix("?").split(" * "))
    assert first.kind == "math" and first.answer == str(a * b) and 100 <= a <= 999
    data = first.meta["verifiers_task"]
    assert data["answer"] == first.answer and data["prompt"][-1]["content"] == first.prompt   # the examples before
    assert first.source == "verifiers" and first.meta["checker"] == "verifiers"     # one source in curation reports
    spec = dataclasses.replace(first, answer="a lipogram: no letter e")             # an answer that is no number
    assert check_static(spec) is None                                               # the environment judges it
    with pytest.raises(PluginError, match="taskset 'calc_taskset' cannot be loaded.*bogus"):
        load_source("verifiers", taskset={"id": "calc_taskset", "bogus": 1})
    with pytest.raises(PluginError, match="`taskset` must be a mapping with the taskset's `id`"):
        load_source("verifiers", taskset="calc_taskset")


# -- episodes through the policy endpoint --------------------------------------------------------------------

def test_single_turn_rollouts_train_on_verifiers_own_tokens(tiny_model_dir, tok):
    """The real tiny model through the real endpoint, two tasks, two rollouts each: every sample is its episode's
    one branch, token for token, the model's tokens marked as verifiers marks them, with their log-probs; the
    reward and metrics are the episode's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    loop = AgentLoop.resolve(ENTRY, 4, options=SINGLE_TURN)
    runner, episodes = loop.run.__self__, {}

    def run(client, task):                 # Runner.run, keeping each episode to compare
        episodes[str(client.base_url).split("/s/")[1].split("/")[0]] = episode = runner.episode(client, task)
        return verifiers_env.outcome(episode, ENTRY)
    loop.run = run
    groups = agent_rollout(KVCacheSampler(model, tok, "cpu", progress=False), tok, tasks(SINGLE_TURN, 2), 2,
                           SamplingParams(max_new_tokens=8, seed=1), loop, group_ids=[4, 5])
    samples = [s for g in groups for s in g]
    assert [s.group for s in samples] == [4, 4, 5, 5] and len(episodes) == 4
    for s, session in zip(samples, ("g4-r0", "g4-r1", "g5-r0", "g5-r1")):
        (trace,) = episodes[session].traces
        (branch,) = trace.branches
        assert trace.num_turns == 1 and s.extra["branches"] == 1 and "agent_error" not in s.extra
        assert branch.token_ids == s.prompt_ids + s.completion_ids
        assert [int(m) for m in branch.sampled_mask] == [0] * len(s.prompt_ids) + s.completion_mask
        sampled = [lp for lp, m in zip(branch.logprobs, branch.sampled_mask) if m]
        assert sampled == pytest.approx([lp for lp, m in zip(s.sampler_logprobs, s.completion_mask) if m])
        assert s.extra["environment_reward"] == {"verifiers_reward": trace.reward}
        assert s.extra["agent_metrics"] == {"tool_calls": 0.0, "reward/accuracy": trace.rewards["accuracy"].score}
    assert tok.decode(samples[0].prompt_ids).count(tasks(SINGLE_TURN, 1)[0].prompt) == 1
    metrics = agent_metrics([s.to_dict() for s in samples])
    assert metrics["agent/failed_frac"] == 0.0 and metrics["agent/tool_calls"] == 0.0
    assert "agent/reward/accuracy" in metrics


def test_a_tool_episode_is_one_branch_whose_model_tokens_are_the_sampled_ones(tok):
    """A calculator call and the final answer (a scripted engine: the tool-call protocol is under test): verifiers
    runs the call on its MCP toolset, the result comes back as context between the two sampled turns, all one
    branch, and the episode is rewarded by the taskset."""
    task = tasks(WITH_TOOLS, 1)[0]
    a, b = task.prompt.removeprefix("What is ").removesuffix("?").split(" * ")
    call = CALL.replace("214 * 37", f"{a} * {b}")
    loop = AgentLoop.resolve(ENTRY, 2, options=WITH_TOOLS)
    engine = ScriptedEngine(tok, [call, f"<answer>{task.answer}</answer>"])
    with loop.serving(), PolicyEndpoint(engine, tok, SamplingParams(max_new_tokens=64), 2) as ep:
        episode = episode_through(ep, loop, task, "g0-r0")
        record = ep.conversation("g0-r0")
    (trace,) = episode.traces
    (branch,) = trace.branches
    assert trace.num_turns == 2 and record["branches"] == 1 and len(ep.calls) == 2
    assert branch.token_ids == record["prompt_ids"] + record["completion_ids"]
    assert [int(m) for m in branch.sampled_mask] == [0] * len(record["prompt_ids"]) + record["completion_mask"]
    model_tokens = [t for t, m in zip(record["completion_ids"], record["completion_mask"]) if m]
    assert model_tokens == ep.calls[0]["completion_ids"] + ep.calls[1]["completion_ids"]
    context = tok.decode([t for t, m in zip(record["completion_ids"], record["completion_mask"]) if not m])
    assert f"<tool_response>\n{task.answer}\n</tool_response>" in context     # the MCP tool's answer, not trained
    assert trace.last_reply == task.answer          # the tiny tokenizer's <answer> tags are special: decoded away
    assert verifiers_env.outcome(episode, ENTRY) == {"reward": 0.0, "metrics": {"tool_calls": 1.0,
                                                                                "reward/accuracy": 0.0}}


# -- a run --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_verifiers_run_trains_through_the_pipeline(tmp_path, grpo_home, prefect_engine, mlflow_uri, monkeypatch):
    """One iteration on the example taskset through the real Prefect engine: the tasks come from the `verifiers`
    source (a curation YAML), the samples carry the endpoint's tokens, the score stage logs the episodes'
    metrics, the update runs."""
    from tests.conftest import one_iteration, tiny_config
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))
    curation = tmp_path / "verifiers_data.yaml"
    curation.write_text(json.dumps({"name": "calc", "seed": 0, "eval_fraction": 0.2, "sources": [
        {"name": "verifiers", "taskset": {"id": "calc_taskset", "n": 20}}]}))
    config = tiny_config(tmp_path, environment=ENTRY, environment_config=WITH_TOOLS, pipeline_iterations=1,
                         max_completion_length=12, data=dict(curated=str(curation)), eval=dict(enabled=False))
    res, rows = one_iteration(tmp_path, config)
    assert len(rows) == config["data"]["prompts_per_iteration"] * config["num_generations"]
    for r in rows:
        assert len(r["completion_mask"]) == len(r["completion_ids"]) == len(r["sampler_logprobs"])
        assert r["extra"]["branches"] == 1 and "verifiers_reward" in r["extra"]["environment_reward"]
    assert "agent/reward/accuracy" in res["score"]["metrics"] and res["score"]["metrics"]["agent/failed_frac"] == 0.0
    assert Path(res["update"]["checkpoint"]).exists()
