"""Multi-turn rollouts (grpo_core.rollout.multiturn): the turn loop, the tool turn's tokens and mask, environments,
the environment's reward, the metrics; the loss never trains a tool token (every loss type, both ratio levels,
mu > 1); and a rollout with nothing to call is bit for bit today's one-turn path, update included.

The turn loop is driven by a scripted sampler (a random tiny model never writes a tool call): it answers
from the conversation it is given, so the test sees exactly what the loop feeds the model."""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from grpo_core.config import GRPOConfig
from grpo_core.update.loss import LossSettings, grpo_loss
from grpo_core.model.loading import load_tokenizer
from grpo_core.rollout.multiturn import Toolbox, tool_metrics, tool_turn_ids
from grpo_core.rollout.samplers import KVCacheSampler, rollout
from grpo_core.rollout.sampling import Completion, SamplingParams, readable_conversation
from grpo_core.rewards.scoring import score_rows
from grpo_core.task import Task
from grpo_core.rollout.tools import resolve_tools
from grpo_core.update.step import ScoredSample, grpo_update, make_optimizer, make_scheduler

CPU = torch.device("cpu")


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class ScriptedSampler:
    """A RolloutBackend that answers with `reply(conversation_text, turn)`; records every prompt it gets."""

    def __init__(self, tokenizer, reply):
        self.tok, self.reply, self.prompts = tokenizer, reply, []

    def generate(self, prompts, n, params):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            text = self.tok.decode(p)
            group = []
            for j in range(n):
                ids = self.tok(self.reply(text, j), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                ids = ids[:params.max_new_tokens]
                group.append(Completion(ids, [-0.5] * len(ids)) if params.logprobs else ids)
            out.append(group)
        return out


def math_task(i: int = 0, **meta) -> Task:
    return Task(id=f"t{i}", kind="math", source="test", prompt=f"What is 12*{i + 7}?", answer=str(12 * (i + 7)),
                meta=meta)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def responses(text: str) -> list[str]:
    """The tool responses in the conversation after the question (the system prompt names the tag too)."""
    tail = text.split("What is ")[-1]
    return [part.split("</tool_response>")[0].strip() for part in tail.split("<tool_response>")[1:]]


def calculator_then_answer(text: str, j: int) -> str:
    if not responses(text):
        expr = text.split("What is ")[-1].split("?")[0]
        return "let me compute " + call("calculator", expression=expr)
    return f"Answer: {responses(text)[-1]}"


def test_a_tool_call_is_run_and_its_response_is_context_only(tok):
    box = Toolbox(resolve_tools(["calculator"]))
    backend = ScriptedSampler(tok, calculator_then_answer)
    params = SamplingParams(max_new_tokens=200, logprobs=True)
    samples = rollout(backend, tok, [math_task(0), math_task(1)], 2, params, "", 4096, toolbox=box)
    assert len(samples) == 4 and [s.group for s in samples] == [0, 0, 1, 1]
    for s in samples:
        assert s.completion == f"Answer: {12 * (7 + s.group)}"                 # rewards judge the last turn
        assert s.extra["turns"] == 2 and s.extra["tool_calls"] == 1 and s.extra["tool_errors"] == 0
        mask = s.completion_mask
        first = mask.index(0)
        last = len(mask) - mask[::-1].index(0)
        assert set(mask[first:last]) == {0} and len(mask) == len(s.completion_ids)   # one contiguous tool turn
        tool_text = tok.decode(s.completion_ids[first:last])
        assert "<tool_response>" in tool_text and str(12 * (7 + s.group)) in tool_text
        assert s.completion_ids[first - 1] == tok.eos_token_id                 # the model ended its turn itself
        assert all(lp == 0.0 for lp, m in zip(s.sampler_logprobs, mask) if not m)
        assert all(lp == -0.5 for lp, m in zip(s.sampler_logprobs, mask) if m)
        assert s.extra["tool_usage"]["calculator"]["calls"] == 1
        assert "[tool calculator]" in readable_conversation(s.extra)
    # each second turn continues exactly from prompt + the model's turn + the tool turn
    for s in samples:
        tool_end = len(s.completion_mask) - s.completion_mask[::-1].index(0)
        assert s.prompt_ids + s.completion_ids[:tool_end] in backend.prompts[2:]
    m = tool_metrics([x.to_dict() for x in samples])
    assert m["tools/calls_per_rollout"] == 1 and m["tools/error_rate"] == 0 and m["turns/mean"] == 2
    assert m["tools/calculator/calls"] == 4 and m["turns/max_reached_frac"] == 0


def test_the_tools_are_in_the_prompt_in_the_fallback_format(tok):
    box = Toolbox(resolve_tools(["calculator"]))
    backend = ScriptedSampler(tok, lambda text, j: "42")
    rollout(backend, tok, [math_task()], 1, SamplingParams(max_new_tokens=20), "Be brief.", 4096, toolbox=box)
    prompt = tok.decode(backend.prompts[0])
    assert "Be brief." in prompt and '"name": "calculator"' in prompt and "<tool_call>" in prompt


@pytest.mark.parametrize("bad,expected", [
    (call("nope", x=1), "unknown tool"),
    ("<tool_call>{not json}</tool_call>", "invalid tool call"),
    (call("calculator", expression="1/0"), "error"),
    (call("calculator", wrong="1"), "error"),
])
def test_a_bad_call_answers_with_an_error_text_and_the_rollout_goes_on(tok, bad, expected):
    box = Toolbox(resolve_tools(["calculator"]))

    def reply(text, j):
        return bad if not responses(text) else "Answer: ?"
    samples = rollout(ScriptedSampler(tok, reply), tok, [math_task()], 2, SamplingParams(max_new_tokens=200),
                      "", 4096, toolbox=box)
    for s in samples:
        assert s.extra["tool_calls"] == 1 and s.extra["tool_errors"] == 1 and s.extra["turns"] == 2
        tool_msg = [m for m in s.extra["conversation"] if m["role"] == "tool"][0]["content"]
        assert expected in tool_msg
    metrics = tool_metrics([s.to_dict() for s in samples])
    assert metrics["tools/error_rate"] == 1.0
    assert all(re.fullmatch(r"[\w./\-]+", k) for k in metrics), metrics          # valid MLflow names


@pytest.mark.parametrize("made_up", [".", "..", "calc" * 70])
def test_a_made_up_tool_name_is_tallied_as_unknown_and_every_metric_name_is_valid_for_mlflow(made_up, tmp_path):
    """A name the model makes up ('.', '..', 280 characters) became a metric name MLflow refuses: the score stage
    failed on every resume. Unknown names are tallied as _unknown; the conversation keeps what the model wrote."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric
    from grpo_core.rollout.multiturn import Episode
    from grpo_core.rollout.tools import parse_tool_calls, run_tool_calls
    box = {t.name: t for t in resolve_tools(["calculator"])}
    ep = Episode()
    for text in (call(made_up), call("calculator", expression="2*3"), "<tool_call>{oops}</tool_call>"):
        [results] = run_tool_calls([parse_tool_calls(text)], [box], timeout=5)
        ep.add_tool_turn(results, [])
    assert [m["name"] for m in ep.conversation] == [made_up, "calculator", ""]       # the conversation keeps it
    metrics = tool_metrics([{"extra": ep.record()}])
    assert {k for k in metrics if k.count("/") == 2} == {f"tools/{n}/{s}" for n in ("_unknown", "calculator",
                                                                                   "_unreadable")
                                                          for s in ("calls", "seconds")}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri)
    run = c.create_run(c.create_experiment("tools"))
    c.log_batch(run.info.run_id, metrics=[Metric(k, float(v), 0, 1) for k, v in metrics.items()])
    assert set(c.get_run(run.info.run_id).data.metrics) == set(metrics)


def test_rounds_stop_at_max_tool_calling_iterations_and_at_the_token_budget(tok):
    always = lambda text, j: call("calculator", expression="1+1")          # noqa: E731
    box = Toolbox(resolve_tools(["calculator"]), max_iterations=2)
    [s] = rollout(ScriptedSampler(tok, always), tok, [math_task()], 1, SamplingParams(max_new_tokens=500), "", 4096,
                  toolbox=box)
    assert s.extra["turns"] == 3 and s.extra["tool_calls"] == 2 and s.extra["max_turns_reached"]
    assert tool_metrics([s.to_dict()])["turns/max_reached_frac"] == 1.0
    # the budget counts the model's tokens only, and a turn cut by it is truncated
    turn = len(tok(always("", 0))["input_ids"]) + 1
    box = Toolbox(resolve_tools(["calculator"]))
    [s] = rollout(ScriptedSampler(tok, always), tok, [math_task()], 1, SamplingParams(max_new_tokens=2 * turn + 3),
                  "", 4096, toolbox=box)
    assert sum(s.completion_mask) == 2 * turn + 3 and s.truncated and s.extra["turns"] == 3
    assert len(s.completion_ids) > sum(s.completion_mask)


class Counter:
    """An environment in TRL's shape: reset, a tool method, get_reward from its own state."""
    made = 0

    def __init__(self):
        Counter.made += 1
        self.total = 0

    def reset(self, **task) -> str:
        self.total = 0
        return f" (start from {len(task['prompt'])})"

    def add(self, amount: int) -> str:
        """Add to the counter.

        Args:
            amount: how much to add.
        """
        self.total += amount
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)


def test_an_environment_per_rollout_its_tools_and_its_reward(tok):
    Counter.made = 0
    box = Toolbox([], environments={None: Counter})

    def reply(text, j):
        return call("add", amount=j + 1) if len(responses(text)) < 2 else "done"
    samples = rollout(ScriptedSampler(tok, reply), tok, [math_task()], 3, SamplingParams(max_new_tokens=300), "",
                      4096, toolbox=box)
    assert Counter.made == 3                                                  # one instance per rollout
    # first turn: rows 0, 1, 2 of the group add 1, 2, 3; later turns are sampled row by row (j = 0): add 1
    assert [s.extra["environment_reward"] for s in samples] == [{"Counter": 2.0}, {"Counter": 3.0},
                                                                {"Counter": 4.0}]
    prompt = tok.decode(samples[0].prompt_ids)
    assert "What is 12*7? (start from 13)" in prompt and '"name": "add"' in prompt
    # the score stage adds the environment's reward as a source of its own, weight 1
    cfg = GRPOConfig(model="tiny-random", reward_funcs=["format"])
    scored, seconds = score_rows(cfg, [s.to_dict() for s in samples], {"t0": math_task()})
    assert [r["rewards"]["Counter"] for r in scored] == [2.0, 3.0, 4.0]
    assert [r["reward"] for r in scored] == [2.0, 3.0, 4.0]                   # format: 0 ("done")
    assert "Counter" in seconds


def test_a_dict_of_environments_is_chosen_by_the_task(tok):
    class Other(Counter):
        pass
    box = Toolbox([], environments={"count": Counter, "other": Other})
    samples = rollout(ScriptedSampler(tok, lambda t, j: "x"), tok, [math_task(0, environment="other"),
                      math_task(1, environment="count")], 1, SamplingParams(max_new_tokens=10), "", 4096, toolbox=box)
    assert [list(s.extra["environment_reward"]) for s in samples] == [["Other"], ["Counter"]]
    with pytest.raises(ValueError, match="meta.environment"):
        rollout(ScriptedSampler(tok, lambda t, j: "x"), tok, [math_task(0, environment="nope")], 1,
                SamplingParams(max_new_tokens=10), "", 4096, toolbox=box)


def test_a_native_tool_template_renders_the_tool_turn_itself(tok, tiny_model_dir):
    """A template that renders tools (as Qwen's does): the tool turn is its own rendering, cut at EOS."""
    from grpo_core.rollout.tools import ToolResult
    native = load_tokenizer(tiny_model_dir)
    native.chat_template = (
        "{% if tools %}<|system|>TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<eos>{% endif %}"
        "{% for m in messages %}{% if m.role == 'tool' %}<|user|>RESULT:{{ m.content }}<eos>"
        "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content }}{% if m.tool_calls %}CALL{% endif %}<eos>"
        "{% else %}<|{{ m.role }}|>{{ m.content }}<eos>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ids = tool_turn_ids(native, [ToolResult("calculator", "84", False, 0.0)])
    assert native.decode(ids) == "<|user|>RESULT:84<eos><|assistant|>"
    box = Toolbox(resolve_tools(["calculator"]))
    backend = ScriptedSampler(native, lambda text, j: "x")
    rollout(backend, native, [math_task()], 1, SamplingParams(max_new_tokens=5), "", 4096, toolbox=box)
    assert native.decode(backend.prompts[0]).startswith("<|system|>TOOLS:calculator;<eos>")


# -- the loss: a tool token never gets a gradient ---------------------------------------------------------

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_no_gradient_reaches_a_tool_token(tiny_model_dir, loss_type, level):
    if loss_type == "vespo" and level != "token":
        pytest.skip("vespo is defined on the token level only (the config rejects the others)")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    ids = torch.randint(10, 90, (4, 14))                                      # 4 rows: prompt 4, completion 10
    logits = model(input_ids=ids).logits[:, 3:-1].float()                     # [4, 10, V]
    logits.retain_grad()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 4:, None]).squeeze(-1)     # [4, 10]
    mask = torch.ones(4, 10)
    mask[:, 3:6] = 0                                                          # a tool turn in every row
    mask[1, 8:] = 0                                                           # and padding
    old = (logp.detach() + 0.3 * torch.randn(4, 10))                          # mu > 1: the policy has moved
    ref = logp.detach() + 0.2 * torch.randn(4, 10)
    sampler = old + 0.1 * torch.randn(4, 10)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    settings = LossSettings(beta=0.1, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type, max_completion_length=10,
                            importance_sampling_level=level, entropy_coef=0.01, sampler_correction="token_truncate")
    loss, _ = grpo_loss(logp, old, ref, torch.tensor([1.0, -0.5, 0.7, -1.2]), mask, settings, num_tokens_in_batch=20.0,
                        entropy=entropy, sampler_logp=sampler)
    loss.backward()
    per_token = logits.grad.abs().sum(-1)                                     # [4, 10]
    assert torch.all(per_token[mask == 0] == 0), per_token
    assert torch.all(per_token[mask == 1] > 0)


# -- nothing to call: today's path, bit for bit ---------------------------------------------------------------

class Silent:
    """An environment with no tools and nothing to add: the prompts are today's."""

    def reset(self, **task):
        return None


def test_a_rollout_with_nothing_to_call_is_the_one_turn_path_bit_for_bit(grpo_home):
    from grpo_core.model.policy import load_policy
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype="float32", num_generations=4,
                     max_completion_length=12, lora_r=4, lora_alpha=8, num_iterations=2, beta=0.1)
    tasks = [math_task(i) for i in range(2)]
    params = SamplingParams(max_new_tokens=12, seed=3, logprobs=True)
    results = []
    for toolbox in (None, Toolbox([], environments={None: Silent})):
        torch.manual_seed(0)                                                 # the same fresh adapter
        policy = load_policy(cfg)
        backend = KVCacheSampler(policy.model, policy.tokenizer, CPU, progress=False)
        samples = rollout(backend, policy.tokenizer, tasks, 4, params, "", 64, toolbox=toolbox)
        scored = [ScoredSample(s.group, s.prompt_ids, s.completion_ids, float(i % 3), s.truncated,
                               s.sampler_logprobs, s.completion_mask) for i, s in enumerate(samples)]
        torch.manual_seed(0)
        opt = make_optimizer(policy, cfg)
        metrics, batch, _ = grpo_update(policy, opt, make_scheduler(opt, cfg), scored, cfg, seed=1)
        results.append((samples, metrics, batch, [p.detach().clone() for p in policy.trainable_parameters()]))
    (a, ma, ba, pa), (b, mb, bb, pb) = results
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.sampler_logprobs for s in a] == [s.sampler_logprobs for s in b]
    assert all(s.completion_mask is None for s in a) and all(set(s.completion_mask) <= {1} for s in b)
    strip = lambda m: {k: v for k, v in m.items() if "seconds" not in k and "memory" not in k}   # noqa: E731
    assert [strip(m) for m in ma] == [strip(m) for m in mb] and strip(ba) == strip(bb)
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not math.isnan(ma[0]["loss"])


# -- a model that acts, through the whole pipeline ---------------------------------------------------------------

@pytest.mark.slow            # the taught model is made once per session; with the flow, about a minute on 2 cores
def test_grpo_train_with_a_model_that_calls_tools(tmp_path, grpo_home, mlflow_uri, prefect_engine,
                                                  tool_calling_model_dir):
    """2 iterations of the real flow (Prefect, MLflow) on a tiny model taught to call the calculator: the tool
    runs, its turns are logged, the completion table shows the conversation, evaluation runs with and without
    tools, and the update trains on the model's own tokens."""
    from mlflow.tracking import MlflowClient
    from flows.train import training_run
    from tests.conftest import tiny_config
    from grpo_core.io import read_jsonl
    config = tiny_config(tmp_path, model=str(tool_calling_model_dir), tools=["calculator"],
                         max_completion_length=160, max_tool_calling_iterations=2)
    summary = training_run(config=config)
    c = MlflowClient(mlflow_uri)
    run_id = summary["mlflow_run_id"]
    metrics = c.get_run(run_id).data.metrics
    assert metrics["tools/calls_per_rollout"] > 0.5 and metrics["turns/mean"] > 1.5
    assert metrics["tools/calculator/calls"] > 0 and 0 <= metrics["tools/error_rate"] <= 1
    assert "turns/max_reached_frac" in metrics and "tools/calculator/seconds" in metrics
    for key in ("eval/greedy/pass_at_1", "eval/without_tools/greedy/pass_at_1", "eval/sampled/format_rate",
                "eval/without_tools/sampled/format_rate"):
        assert key in metrics, key
    run_dir = Path(summary["run_dir"])
    rows = list(read_jsonl(run_dir / "iter-1" / "samples.jsonl"))
    acted = [r for r in rows if r["extra"]["tool_calls"]]
    assert acted and all(0 in r["completion_mask"] for r in acted)
    table = json.loads(Path(c.download_artifacts(run_id, "completions/iter_0001.json", str(tmp_path))).read_text())
    completions = [row[table["columns"].index("completion")] for row in table["data"]]
    assert any("[tool calculator]" in text for text in completions)


def test_an_environment_that_cannot_score_leaves_its_sample_out():
    from grpo_core.rewards.rewards import RewardScores, add_environment_rewards
    scores = RewardScores([1.0, 1.0, 1.0], {"format": [1.0, 1.0, 1.0]}, {"format": 0.1})
    out = add_environment_rewards(scores, [{"RustFix": 0.5}, {"RustFix": None}, {"Other": 2.0}])
    assert out.totals == [1.5, None, 3.0]
    assert out.per_func["RustFix"] == [0.5, None, None] and out.per_func["Other"] == [None, None, 2.0]


def test_a_response_prefix_opens_the_first_turn(tok):
    """The prompt's response prefix is the start of the model's first turn: a call it opens is a call."""
    from grpo_core.rollout.sampling import PromptFormat
    opener = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    fmt = PromptFormat(response_prefix=opener)

    def reply(text, j):
        return '6*7"}}</tool_call>' if not responses(text) else f"Answer: {responses(text)[-1]}"
    [s] = rollout(ScriptedSampler(tok, reply), tok, [math_task()], 1, SamplingParams(max_new_tokens=200), fmt, 4096,
                  toolbox=Toolbox(resolve_tools(["calculator"])))
    assert s.extra["tool_calls"] == 1 and s.extra["tool_errors"] == 0 and s.completion == "Answer: 42"
    assert s.extra["conversation"][0]["content"].startswith(opener)


@pytest.mark.parametrize("then_eos", [False, True])
def test_a_turn_ends_where_its_tool_call_closes(tok, then_eos):
    """A model that goes on writing after its call: the turn is cut there (a stop sequence), the template's
    end-of-turn token is added as context (mask 0), and the call runs."""
    def reply(text, j):
        if not responses(text):
            return call("calculator", expression="6*7") + " and then some babbling" * (1 if then_eos else 9)
        return "Answer: " + responses(text)[-1]
    [s] = rollout(ScriptedSampler(tok, reply), tok, [math_task()], 1, SamplingParams(max_new_tokens=120,
                  logprobs=True), "", 4096, toolbox=Toolbox(resolve_tools(["calculator"])))
    assert s.extra["tool_calls"] == 1 and s.completion == "Answer: 42" and not s.truncated   # with or without EOS
    first = s.extra["conversation"][0]["content"]
    assert first.endswith("</tool_call>") and "babbling" not in first
    end = s.completion_mask.index(0)
    assert s.completion_ids[end] == tok.eos_token_id and tok.decode(s.completion_ids[:end]).endswith("</tool_call>")
    assert s.sampler_logprobs[end] == 0.0 and len(s.sampler_logprobs) == len(s.completion_ids)


def test_chat_template_kwargs_reach_the_prompt_and_every_tool_turn(tiny_model_dir):
    """data.chat_template_kwargs render the tool rollout's prompt and each tool turn appended after it."""
    from grpo_core.rollout.sampling import PromptFormat
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>"
                         "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                         "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    box = Toolbox(resolve_tools(["calculator"]))
    for kwargs, marked in (((("enable_thinking", False),), True), ((), False)):
        samples = rollout(ScriptedSampler(tok, calculator_then_answer), tok, [math_task(0)], 1,
                          SamplingParams(max_new_tokens=200), PromptFormat(template_kwargs=kwargs), 4096,
                          toolbox=box)
        mask = samples[0].completion_mask
        first, last = mask.index(0), len(mask) - mask[::-1].index(0)
        assert ("NOTHINK" in tok.decode(samples[0].prompt_ids)) == marked
        assert ("NOTHINK <tool_response>" in tok.decode(samples[0].completion_ids[first:last])) == marked
        assert samples[0].completion == "Answer: 84"


# -- streamed turns: each row continues its own KV cache, its calls run while the others decode ------------------

class Recorder:
    """Wraps a sampling forward's methods to count prefills and time-stamp steps."""

    def __init__(self, monkeypatch, cls):
        self.prefills, self.steps, self.extends = 0, [], 0
        prefill, step, extend = cls.prefill, cls.step, cls.extend

        def counted_prefill(fwd, *a, **k):
            self.prefills += 1
            return prefill(fwd, *a, **k)

        def stamped_step(fwd, *a, **k):
            self.steps.append(time.perf_counter())
            return step(fwd, *a, **k)

        def counted_extend(fwd, *a, **k):
            self.extends += 1
            return extend(fwd, *a, **k)
        monkeypatch.setattr(cls, "prefill", counted_prefill)
        monkeypatch.setattr(cls, "step", stamped_step)
        monkeypatch.setattr(cls, "extend", counted_extend)


def make_lookup(calls: list, slow_first: float):
    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        start = time.perf_counter()
        time.sleep(slow_first if not calls else 0.002 * (len(calls) % 5))
        calls.append((start, time.perf_counter()))
        return "the record: blue 42"
    return lookup


def random_model_calls(monkeypatch, closers: str = "aeiouAEIOU0123456789", every: int | None = None):
    """A random model never writes a tool call: make a turn's first character of `closers` (about one in five
    of the tiny tokenizer's characters), or its token number `every`, close a `lookup` call."""
    from grpo_core.rollout import multiturn
    from grpo_core.rollout import tools

    def call_end(ids, tokenizer, opening=""):
        if every is not None:
            return every if len(ids) >= every else None
        return next((k + 1 for k, t in enumerate(ids) if tokenizer.decode([t]) in set(closers)), None)
    monkeypatch.setattr(multiturn, "CALL_END", "")
    monkeypatch.setattr(multiturn, "call_end", call_end)
    monkeypatch.setattr(multiturn, "parse_tool_calls", lambda text: [tools.ToolCall("lookup", {"key": "a"})])


def plain_logprobs(model, sample) -> list[float]:
    """log p(token | everything before it) of each completion token, from the model's plain forward."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(sample.prompt_ids):, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("path, tasks, n, chunk", [("fused", 2, 4, 256), ("fused", 1, 1, 256), ("lean", 2, 4, 3),
                                                   ("model", 2, 4, 3), ("fixed", 2, 4, 3)])
def test_streamed_turns_continue_each_rows_cache_with_the_plain_forwards_log_probs(grpo_home, monkeypatch, path,
                                                                                   tasks, n, chunk):
    """Every model token of a streamed multi-turn rollout was drawn from the distribution the model's plain
    forward gives after the whole conversation before it (tool turns included), on every decode path; the
    conversation is encoded once (one prefill), tool turns are fed after each row's own cache (one token a
    step beside rows that sample, in chunks when none does), and the cache grows as the turns come."""
    from grpo_core.kernels.fused_decode import FusedDecoder
    from grpo_core.kernels.graph_decode import GraphDecoder
    from grpo_core.kernels.lean_decode import LeanDecoder
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.samplers import ModelForward, TorchEngine
    from grpo_core.rollout.tools import tool_of
    random_model_calls(monkeypatch)
    monkeypatch.setattr(KVCacheSampler, "CHUNK", chunk)
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype="float32", lora_r=4, lora_alpha=8)
    policy = load_policy(cfg, need_reference=False)
    backend = {"fused": lambda *a, **k: KVCacheSampler(*a, **k), "lean": lambda *a, **k: TorchEngine(*a, **k),
               "model": lambda *a, **k: TorchEngine(*a, lean=False, **k),
               "fixed": lambda *a, **k: TorchEngine(*a, fixed_shapes=True, **k)}[path](policy.model, policy.tokenizer,
                                                                                       CPU, progress=False)
    record = Recorder(monkeypatch, {"fused": FusedDecoder, "lean": LeanDecoder, "model": ModelForward,
                                    "fixed": GraphDecoder}[path])
    calls = []
    box = Toolbox([tool_of(make_lookup(calls, 0.0), "test")], max_iterations=3)
    params = SamplingParams(max_new_tokens=48, seed=5, logprobs=True)
    samples = rollout(backend, policy.tokenizer, [math_task(i) for i in range(tasks)], n, params, "", 1024,
                      toolbox=box)
    assert backend.path.startswith(path)
    assert record.prefills == 1                              # one batch, encoded once: no turn re-encodes
    assert sum(s.extra["tool_calls"] for s in samples) == len(calls) > 0
    assert max(s.extra["turns"] for s in samples) >= 3
    for s in samples:
        plain = plain_logprobs(policy.model, s)
        mine = [(a, b) for a, b, m in zip(s.sampler_logprobs, plain, s.completion_mask) if m]
        assert len(mine) == sum(s.completion_mask) <= 48
        assert max(abs(a - b) for a, b in mine) < 2e-4, (path, s.extra["turns"])
    if tasks * n == 1 or chunk == 3:
        assert record.extends >= 1                           # tool turns read as chunks while nobody samples


def test_streamed_turns_match_re_encoded_turns_greedily(grpo_home, monkeypatch):
    """Continuing each row's cache gives the conversations that re-encoding the conversation each turn gives
    (greedy decoding, the same sampler with streaming off)."""
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.tools import tool_of
    random_model_calls(monkeypatch, every=6)          # greedy, a random model repeats itself
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype="float32", lora_r=4, lora_alpha=8)
    policy = load_policy(cfg, need_reference=False)
    box = Toolbox([tool_of(make_lookup([], 0.0), "test")], max_iterations=3)
    params = SamplingParams(max_new_tokens=30, greedy=True)
    tasks = [math_task(i) for i in range(2)]
    out = []
    for stream in (True, False):
        backend = KVCacheSampler(policy.model, policy.tokenizer, CPU, progress=False)
        monkeypatch.setattr(KVCacheSampler, "streams_turns", stream)
        out.append(rollout(backend, policy.tokenizer, tasks, 2, params, "", 1024, toolbox=box))
    streamed, encoded = out
    assert [s.completion_ids for s in streamed] == [s.completion_ids for s in encoded]
    assert [s.completion_mask for s in streamed] == [s.completion_mask for s in encoded]
    assert [s.extra["turns"] for s in streamed] == [s.extra["turns"] for s in encoded]
    assert max(s.extra["turns"] for s in streamed) >= 3


def test_with_overlap_a_slow_tool_call_runs_while_the_other_rows_decode(grpo_home, monkeypatch):
    from grpo_core.kernels.fused_decode import FusedDecoder
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.tools import tool_of
    random_model_calls(monkeypatch)
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype="float32", lora_r=4, lora_alpha=8)
    policy = load_policy(cfg, need_reference=False)
    backend = KVCacheSampler(policy.model, policy.tokenizer, CPU, progress=False)
    record = Recorder(monkeypatch, FusedDecoder)
    calls = []
    box = Toolbox([tool_of(make_lookup(calls, 0.4), "test")], max_iterations=2, overlap=True)
    rollout(backend, policy.tokenizer, [math_task(i) for i in range(2)], 4, SamplingParams(max_new_tokens=48, seed=1),
            "", 1024, toolbox=box)
    (start, end), rest = calls[0], calls[1:]
    assert end - start >= 0.4
    assert sum(start < t < end for t in record.steps) >= 5               # the others decoded meanwhile
    assert any(start < s < end for s, _ in rest)                          # and their calls ran meanwhile too


def test_without_overlap_the_rollouts_do_not_depend_on_how_long_the_calls_take(grpo_home, monkeypatch):
    """The default (tool_calls_overlap off): sampled rollouts with calls of random durations are the rollouts
    with instant calls, token for token, so a killed iteration resumes to the same adapter."""
    import random
    from grpo_core.model.policy import load_policy
    from grpo_core.rollout.tools import tool_of
    random_model_calls(monkeypatch)
    cfg = GRPOConfig(model="tiny-random", device="cpu", dtype="float32", lora_r=4, lora_alpha=8)
    policy = load_policy(cfg, need_reference=False)
    jitter = random.Random(0)

    def lookup(key: str) -> str:
        """Look a key up.

        Args:
            key: the key.
        """
        time.sleep(delay())
        return "the record: blue 42"
    out = []
    for delay in (lambda: 0.0, lambda: jitter.choice([0.0, 0.0, 0.01, 0.05])):
        backend = KVCacheSampler(policy.model, policy.tokenizer, CPU, progress=False)
        box = Toolbox([tool_of(lookup, "test")], max_iterations=3)
        out.append(rollout(backend, policy.tokenizer, [math_task(i) for i in range(3)], 4,
                           SamplingParams(max_new_tokens=48, seed=3, logprobs=True), "", 1024, toolbox=box))
    instant, jittered = out
    assert max(s.extra["turns"] for s in instant) >= 3
    assert [s.completion_ids for s in instant] == [s.completion_ids for s in jittered]
    assert [s.sampler_logprobs for s in instant] == [s.sampler_logprobs for s in jittered]


@pytest.mark.slow            # the taught model is made once per session (shared with the pipeline test)
def test_a_taught_model_calls_its_tool_the_same_streamed_or_re_encoded(tool_calling_model_dir, monkeypatch):
    """The tiny model taught to call the calculator: a real call closes its turn, the tool turn is read, it
    answers; streamed and re-encoded turns give the same conversations (greedy)."""
    from transformers import AutoModelForCausalLM
    tok = load_tokenizer(tool_calling_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tool_calling_model_dir)
    from grpo_core.config import DataConfig
    from grpo_core.data.arithmetic import train_tasks
    box = Toolbox(resolve_tools(["calculator"]))
    tasks = train_tasks(16, 1, 1, ["+", "-"], seed=5)[:4]            # the prompts it was taught on
    out = []
    for stream in (True, False):
        backend = KVCacheSampler(model, tok, CPU, progress=False)
        monkeypatch.setattr(KVCacheSampler, "streams_turns", stream)
        out.append(rollout(backend, tok, tasks, 2, SamplingParams(max_new_tokens=200, greedy=True),
                           DataConfig().prompt_format, 256, toolbox=box))
    streamed, encoded = out
    assert [s.completion_ids for s in streamed] == [s.completion_ids for s in encoded]
    assert all(s.extra["tool_calls"] >= 1 and s.extra["turns"] >= 2 for s in streamed)


def test_guided_rollouts_are_sampled_after_the_full_prompt_and_trained_on_the_drawn_wording(tok):
    """With data.guided_completions and a wording drawn without the worked examples (system_alone_prob), the first
    `guided` rollouts of a group run their whole conversation after the full prompt (the worked exchanges shown):
    the sampler sees it on every turn. The Sample carries the drawn wording's prompt (what the update trains on),
    is marked guided and has no sampler log-probs; the other rollouts are sampled after the drawn wording."""
    from grpo_core.rollout.sampling import PromptFormat
    from grpo_core.rollout.multiturn import tool_prompt_ids
    box = Toolbox(resolve_tools(["calculator"]))
    example = (("What is 2*3?", call("calculator", expression="2*3")), ("<tool_response>\n6\n</tool_response>", "6"))
    fmt = PromptFormat("Use the calculator.", example, system_alone_prob=1.0, guided=2, salt=1)
    sampler = ScriptedSampler(tok, calculator_then_answer)
    tasks = [math_task(i) for i in range(3)]
    params = SamplingParams(max_new_tokens=200, temperature=1.0, seed=0, logprobs=True)
    samples = rollout(sampler, tok, tasks, 4, params, fmt, 2048, toolbox=box)      # the char tokenizer: long
    tools = list(box.toolset(None).values())
    for g, t in enumerate(tasks):
        own = tool_prompt_ids(tok, t, fmt, 2048, tools)
        assert "What is 2*3?" not in tok.decode(own)                        # drawn: the system prompt alone
        group = samples[4 * g:4 * g + 4]
        assert all(s.prompt_ids == own for s in group)
        assert [bool(s.extra.get("guided")) for s in group] == [True, True, False, False]
        assert [s.sampler_logprobs is None for s in group] == [True, True, False, False]
        assert [s.extra["tool_calls"] for s in group] == [1, 1, 1, 1], [s.completion for s in group]
    # the sampler got the worked exchanges in front of the guided rollouts, on their first turn and after the call
    shown = [tok.decode(p).count("What is 2*3?") for p in sampler.prompts]
    assert shown.count(1) == 2 * 2 * len(tasks) and shown.count(0) == 2 * 2 * len(tasks)
