"""The policy endpoint (grpo_core/rollout/endpoint.py) on a real tiny model: vLLM's generate route, OpenAI chat
completions through the real `openai` client, concurrent requests batched, a conversation's tokens kept as sampled,
and clear errors for what it cannot serve."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from transformers import AutoModelForCausalLM

from grpo_core.model.loading import load_tokenizer
from grpo_core.rollout.endpoint import PolicyEndpoint
from grpo_core.rollout.samplers import KVCacheSampler
from grpo_core.rollout.sampling import Completion, SamplingParams

openai = pytest.importorskip("openai")
CPU = "cpu"
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(tiny_model_dir)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_generate_takes_token_ids_and_gives_token_ids_and_logprobs(tiny):
    model, tok = tiny
    prompt = tok("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    with PolicyEndpoint(KVCacheSampler(model, tok, CPU, progress=False), tok, PARAMS, group_size=4) as ep:
        status, out = post(ep.base_url + "/inference/v1/generate", {
            "model": "policy", "token_ids": prompt, "sampling_params": {
                "temperature": 0.3, "max_tokens": 5, "n": 2, "logprobs": 1, "stop_token_ids": [tok.eos_token_id]}})
    assert status == 200 and out["prompt_token_ids"] == prompt and len(out["choices"]) == 2
    for choice in out["choices"]:
        ids = choice["token_ids"]
        assert 1 <= len(ids) <= 5                                # the request may lower the run's budget
        assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
        assert all(c["logprob"] <= 0 for c in choice["logprobs"]["content"])
        assert choice["finish_reason"] in ("stop", "length")
    assert [c["completion_ids"] for c in ep.calls] == [c["token_ids"] for c in out["choices"]]


def test_a_token_route_session_keeps_every_turn_as_sampled_and_splits_on_a_new_prefix(tiny):
    model, tok = tiny
    prompt = tok("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    after = tok("\n<|im_start|>user\nand 4?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    with PolicyEndpoint(KVCacheSampler(model, tok, CPU, progress=False), tok, PARAMS, group_size=4) as ep:
        url = ep.session_url("t1") + "/inference/v1/generate"
        _, first = post(url, {"token_ids": prompt})
        turn1 = first["choices"][0]["token_ids"]
        _, second = post(url, {"token_ids": prompt + turn1 + after})          # the client's own render of turn 2
        turn2 = second["choices"][0]["token_ids"]
        kept = ep.conversation("t1")
        status, refused = post(url, {"token_ids": prompt, "sampling_params": {"n": 2}})
        post(url, {"token_ids": after})                                       # not a continuation: a new branch
        split = ep.conversation("t1")
    assert kept["prompt_ids"] == prompt and kept["branches"] == 1
    assert kept["completion_ids"] == turn1 + after + turn2
    assert kept["completion_mask"] == [1] * len(turn1) + [0] * len(after) + [1] * len(turn2)
    sampled = [lp for lp, m in zip(kept["logprobs"], kept["completion_mask"]) if m]
    assert sampled == [c["logprob"] for out in (first, second) for c in out["choices"][0]["logprobs"]["content"]]
    assert status == 400 and "n=2" in refused["error"]["message"]
    assert split["branches"] == 2 and split["prompt_ids"] == after


def test_concurrent_requests_are_sampled_together(tiny):
    model, tok = tiny
    backend = KVCacheSampler(model, tok, CPU, progress=False)
    prompts = [tok(f"question {i}", add_special_tokens=False)["input_ids"] for i in range(8)]
    outs = [None] * len(prompts)
    with PolicyEndpoint(backend, tok, PARAMS, group_size=1, window_s=0.2) as ep:
        def ask(i):
            outs[i] = post(ep.base_url + "/inference/v1/generate", {"token_ids": prompts[i]})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        engine_calls = ep._batcher.calls
    assert all(status == 200 for status, _ in outs)
    assert engine_calls < len(prompts)                          # 8 requests, fewer engine calls
    assert sorted(c["prompt_ids"] for c in ep.calls) == sorted(prompts)


def test_a_chat_conversation_trains_on_the_tokens_it_sampled(tiny):
    """Two turns through the real openai client: the second request's prompt is the first prompt + the tokens the
    model sampled + the user's new turn, not a re-rendering of the decoded reply; the session's record holds them,
    the model's tokens marked and with their log-probs."""
    model, tok = tiny
    with PolicyEndpoint(KVCacheSampler(model, tok, CPU, progress=False), tok, PARAMS, group_size=2) as ep:
        client = openai.OpenAI(base_url=ep.session_url("r0") + "/v1", api_key="local", max_retries=0)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        first = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
        reply = first.choices[0]
        messages += [{"role": "assistant", "content": reply.message.content or ""},
                     {"role": "user", "content": "Are you sure?"}]
        second = client.chat.completions.create(model="policy", messages=messages)
        record = ep.conversation("r0")
    p1, t1 = first.model_extra["prompt_token_ids"], reply.model_extra["token_ids"]
    p2, t2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    assert len(reply.logprobs.content) == len(t1)
    assert p2[:len(p1) + len(t1)] == p1 + t1                    # the sampled tokens, as sampled
    assert record["prompt_ids"] == p1 and record["branches"] == 1
    model_tokens = [t for t, m in zip(record["completion_ids"], record["completion_mask"]) if m]
    assert model_tokens == t1 + t2
    assert record["completion_ids"] == p2[len(p1):] + t2       # the reply, the user's turn as context, the reply
    assert len(record["logprobs"]) == len(record["completion_ids"])


class ScriptedEngine:
    """Test double for the engine (the HTTP and tool-call protocol is what is under test here): answers every
    row with the next scripted text, tokenised, with log-prob -0.5 per token."""

    reports_groups = False

    def __init__(self, tok, replies: list[str]):
        self.tok, self.replies = tok, list(replies)

    def generate(self, rows, n, params, on_group=None, turns=None):
        out = []
        for _ in rows:
            ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append([Completion(ids, [-0.5] * len(ids))])
        return out


def test_a_tool_call_comes_back_as_openai_tool_calls_and_its_result_continues_the_tokens(tiny):
    _, tok = tiny
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
    engine = ScriptedEngine(tok, ["Let me compute. " + call, "The answer is 5."])
    with PolicyEndpoint(engine, tok, PARAMS, group_size=2) as ep:
        client = openai.OpenAI(base_url=ep.session_url("calc-1") + "/v1", api_key="local", max_retries=0)
        messages = [{"role": "user", "content": "2+3?"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "calculator" and json.loads(tc.function.arguments) == {"expression": "2+3"}
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        record = ep.conversation("calc-1")
    assert second.choices[0].message.content == "The answer is 5." and second.choices[0].finish_reason == "stop"
    context = tok.decode([t for t, m in zip(record["completion_ids"], record["completion_mask"]) if not m])
    assert "<tool_response>\n5\n</tool_response>" in context       # the result is context, never trained on
    assert record["turns"] == ["Let me compute. " + call, "The answer is 5."] and record["branches"] == 1


def test_a_conversation_that_does_not_extend_the_last_request_starts_a_new_branch(tiny):
    _, tok = tiny
    with PolicyEndpoint(ScriptedEngine(tok, ["one", "two"]), tok, PARAMS, group_size=1) as ep:
        client = openai.OpenAI(base_url=ep.session_url("b") + "/v1", api_key="local", max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "something else"}])
        assert ep.conversation("b")["branches"] == 2 and ep.conversation("b")["turns"] == ["two"]


def test_a_conversation_whose_assistant_turn_is_not_the_endpoints_reply_starts_a_new_branch(tiny):
    """An agent that rewrites the model's reply (or writes an assistant turn of its own) is not continuing the
    tokens sampled: the model reads the messages the agent sent, as context, not the reply it had sampled."""
    _, tok = tiny
    with PolicyEndpoint(ScriptedEngine(tok, ["hello there", "second"]), tok, PARAMS, group_size=1) as ep:
        client = openai.OpenAI(base_url=ep.session_url("e") + "/v1", api_key="local", max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        edited = client.chat.completions.create(model="policy", messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "written by the agent"},
            {"role": "user", "content": "next"}])
        record = ep.conversation("e")
    prompt = tok.decode(edited.model_extra["prompt_token_ids"])
    assert "written by the agent" in prompt and "hello there" not in prompt
    assert record["branches"] == 2 and record["turns"] == ["second"] and all(record["completion_mask"])


@pytest.mark.parametrize("route,body,names", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, "n=5"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "calc"}]},
     "tools[0]: unknown tool schema"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": []}, "messages must be"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"stop_token_ids": [7]}}, "stop_token_ids"),
    ("/inference/v1/generate", {"prompt": "text"}, "token_ids"),
    ("/v1/completions", {"prompt": "x"}, "no route"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ("/inference/v1/generate", {"token_ids": [1, 10 ** 6]}, "token_ids: 1000000 is not a token"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                                             "tool_calls": [{"function": "calc"}]}]},
     "messages[1].tool_calls must be"),
])
def test_what_the_endpoint_cannot_serve_is_refused_by_name(tiny, route, body, names):
    _, tok = tiny
    with PolicyEndpoint(ScriptedEngine(tok, ["unused"]), tok, PARAMS, group_size=2) as ep:
        status, out = post(ep.base_url + route, body)
    assert status in (400, 404) and names in out["error"]["message"]


def test_a_request_after_the_endpoint_closed_fails_at_once(tiny):
    """An abandoned agent (past rollout_timeout) asking again on its kept-alive connection after the stage's
    endpoint closed: an error at once, not a request queued behind the batcher's stop, waiting for ever (and
    holding the model) in a handler thread."""
    import time
    model, tok = tiny
    backend = KVCacheSampler(model, tok, CPU, progress=False)
    ask = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with PolicyEndpoint(backend, tok, PARAMS, group_size=1) as ep:
        client = openai.OpenAI(base_url=ep.session_url("late") + "/v1", api_key="x", max_retries=0, timeout=60)
        client.chat.completions.create(**ask)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError):
        client.chat.completions.create(**ask)
    assert time.monotonic() - t0 < 20
