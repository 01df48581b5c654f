"""The policy behind HTTP, while a rollout runs: what agent code written for other standards calls.

    POST /inference/v1/generate   token ids in (`token_ids`), token ids and log-probs out: vLLM's shape, the one
                                  verifiers' train client (through `renderers`) calls
    POST /v1/chat/completions     OpenAI chat completions with tools (any OpenAI client, ART-style agents), with
                                  vLLM's `prompt_token_ids` / `token_ids` extensions
    GET  /v1/models, /health

`PolicyEndpoint` binds 127.0.0.1 on a free port and lives for its `with` block. Every request is sampled by the
run's engine with the run's sampling settings (a request may lower `max_tokens` and ask for up to the group size in
`n`; other sampling fields it sends are not used, and a warning says so once); requests that arrive together are
sampled in one batch. A chat conversation is a session (the URL prefix `/s/<id>`, or the header X-Session-ID): a
follow-up whose messages extend the last request's by the assistant reply the endpoint gave is the exact tokens
so far + the new turns rendered after them, so the tokens trained on are the tokens sampled (no re-tokenisation
drift). On the token route a session's prompt that starts with its tokens so far continues it (the tokens
between are context); any other prompt starts a new branch. `conversation(id)` is that record: prompt, every later token, which are the model's, their log-probs.
Plain Python + torch; the engine is any `RolloutBackend`.
"""
from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpo_core.rollout.multiturn import Episode, render_after_model_turn, render_with_tools, renders_tools
from grpo_core.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
RUN_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")   # the run's, not a request's
SESSION_PATH = re.compile(r"^/s/([A-Za-z0-9_.\-]{1,128})(/.*)$")


class RequestError(ValueError):
    """A request the endpoint cannot serve; the message names the field and the fix (sent back as HTTP 400)."""


@dataclass
class Conversation:
    """One session's tokens: the prompt of its current branch and everything after it (`Episode`)."""
    prompt_ids: list[int]
    messages: list[dict]                       # the request messages the tokens so far render
    tools: list[dict]
    episode: Episode = field(default_factory=lambda: Episode(logprobs=[]))
    branches: int = 1                          # a request that does not extend the last one starts a new branch
    reply: tuple | None = None                 # the last reply the endpoint gave (reply_key), which a follow-up repeats

    def record(self) -> dict:
        ep = self.episode
        return {"prompt_ids": list(self.prompt_ids), "completion_ids": list(ep.ids), "completion_mask": list(ep.mask),
                "logprobs": list(ep.logprobs or []), "turns": list(ep.turns), "truncated": ep.truncated,
                "branches": self.branches, "conversation": list(ep.conversation)}


CLOSED = "the policy endpoint has closed: its stage's rollouts are over"


class Batcher:
    """Samples the requests that arrive together in one engine call (each request one or `n` rows)."""

    def __init__(self, backend, params: SamplingParams, window_s: float = 0.005, max_rows: int = 256):
        self.backend, self.params, self.window_s, self.max_rows = backend, params, window_s, max_rows
        self.calls = 0                                         # engine calls so far (each gets its own seed)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], n: int, max_new_tokens: int) -> Future:
        """-> a Future of n completions (token id lists with `.logprobs`); after close, one that failed."""
        done: Future = Future()
        with self._lock:
            if self._closed:
                done.set_exception(RuntimeError(CLOSED))
            else:
                self._queue.put((prompt_ids, n, max_new_tokens, done))
        return done

    def close(self) -> None:
        """Sample what was submitted, then stop; a request that comes later (an abandoned agent's) fails at once
        instead of waiting for an engine that is gone."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout=30)

    def _take(self) -> list | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        while sum(b[1] for b in batch) < self.max_rows:
            try:
                item = self._queue.get(timeout=self.window_s)
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            for budget in sorted({b[2] for b in batch}):       # one engine call per token budget
                part = [b for b in batch if b[2] == budget]
                try:
                    made = self._sample([b[0] for b in part for _ in range(b[1])], budget)
                except Exception as e:  # noqa: BLE001 - every waiting request hears of the engine's failure
                    for b in part:
                        b[3].set_exception(e)
                    continue
                for b in part:
                    b[3].set_result(made[:b[1]])
                    made = made[b[1]:]

    def _sample(self, rows: list[list[int]], budget: int) -> list:
        params = replace(self.params, max_new_tokens=budget, seed=self.params.seed + 7919 * self.calls, logprobs=True)
        self.calls += 1
        return [group[0] for group in self.backend.generate(rows, 1, params)]


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"{where}.content: text only (a string or text parts); got {type(content).__name__}")


def _arguments(call: dict, where: str) -> dict:
    args = (call.get("function") or {}).get("arguments", {})
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise RequestError(f"{where}.function.arguments is not JSON") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    return args


def check_tools(tools: Any) -> list[dict]:
    """A request's `tools`: OpenAI function schemas, each with a name."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {'type': 'function', 'function': {'name': ...}}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"].strip()):
            raise RequestError(f"tools[{i}]: unknown tool schema; each tool is {{'type': 'function', 'function': "
                               f"{{'name': <name>, 'description': ..., 'parameters': <JSON schema>}}}}")
    return tools


def template_messages(messages: Any, native: bool) -> list[dict]:
    """A request's chat messages as the chat template takes them. Without native tool support (SmolLM2's
    template) a call is written as the model writes it (`<tool_call>{json}</tool_call>`) and the tool results
    that follow it are one user turn of `<tool_response>` blocks, the format of grpo_core.rollout.multiturn."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}")
        text = _text(m.get("content"), where)
        if not (isinstance(m.get("tool_calls") or [], list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in m.get("tool_calls") or [])):
            raise RequestError(f"{where}.tool_calls must be a list of {{'type': 'function', 'function': "
                               f"{{'name': <name>, 'arguments': <JSON object>}}}}")
        calls = [((c.get("function") or {}).get("name", ""), _arguments(c, f"{where}.tool_calls[{j}]"))
                 for j, c in enumerate(m.get("tool_calls") or [])]
        if m["role"] == "assistant" and calls and native:
            out.append({"role": "assistant", "content": text, "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]})
        elif m["role"] == "assistant":
            out.append({"role": "assistant", "content": text + "".join(
                f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)})
        elif m["role"] == "tool" and native:
            out.append({"role": "tool", "name": m.get("name", ""), "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": m["role"], "content": text})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def reply_key(message: dict) -> tuple:
    """What an assistant message says (its text and its calls): a follow-up continues a session only where its
    assistant message is the reply the endpoint gave."""
    calls = tuple(((c.get("function") or {}).get("name", ""), json.dumps(_arguments(c, "tool_call"), sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return _text(message.get("content"), "message").strip(), calls


def turns_after_model_ids(tokenizer, new: list[dict], native: bool, template_kwargs: dict) -> list[int]:
    """The user or tool turns that follow a model's turn, as a session continues: rendered after it, in token ids."""
    call = new[0].get("name", "") if native and new[0].get("role") == "tool" else None
    text = render_after_model_turn(tokenizer, template_messages(new, native), call, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _openai_calls(ep: Episode) -> list[dict]:
    return [{"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in enumerate(ep.pending) if c.error is None]


def _token_logprobs(completion) -> list[float]:
    """A completion's sampler log-probs (0.0 each where the engine gave none)."""
    return list(getattr(completion, "logprobs", None) or [0.0] * len(completion))


def _logprobs(ids: list[int], logprobs: list[float]) -> dict:
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(ids, logprobs)]}


class PolicyEndpoint:
    """The run's engine behind the two HTTP dialects (see the module docstring), for a `with` block."""

    def __init__(self, backend, tokenizer, params: SamplingParams, group_size: int, template_kwargs: dict | None = None,
                 model_name: str = "policy", window_s: float = 0.005):
        self.backend, self.tokenizer, self.params, self.group_size = backend, tokenizer, params, group_size
        self.template_kwargs, self.model_name, self.window_s = dict(template_kwargs or {}), model_name, window_s
        self.native_tools = renders_tools(tokenizer)
        model = getattr(backend, "model", None) or getattr(getattr(backend, "policy", None), "model", None)
        self.vocab_size = max(len(tokenizer), getattr(getattr(model, "config", None), "vocab_size", None) or 0)
        self.calls: list[dict] = []               # every request served: session, prompt, completion, log-probs
        self._sessions: dict[str, Conversation] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._server: ThreadingHTTPServer | None = None
        self._batcher: Batcher | None = None

    # -- lifetime -----------------------------------------------------------------------------------------------
    def __enter__(self) -> "PolicyEndpoint":
        self._batcher = Batcher(self.backend, self.params, self.window_s)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="endpoint-http", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._batcher.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def session_url(self, session: str) -> str:
        """The base URL one conversation's client uses (an OpenAI client takes `session_url(...) + "/v1"`)."""
        return f"{self.base_url}/s/{session}"

    def conversation(self, session: str) -> dict | None:
        with self._lock:
            c = self._sessions.get(session)
            return c.record() if c else None

    # -- sampling -------------------------------------------------------------------------------------------------
    def _budget(self, body: dict, *keys: str) -> int:
        for k in keys:
            if body.get(k) is not None:
                if not isinstance(body[k], int) or body[k] < 1:
                    raise RequestError(f"{k} must be a positive integer")
                return min(body[k], self.params.max_new_tokens)
        return self.params.max_new_tokens

    def _n(self, body: dict, session: str | None) -> int:
        n = body.get("n", 1)
        if not isinstance(n, int) or not 1 <= n <= self.group_size:
            raise RequestError(f"n={n!r}: this endpoint serves 1 to {self.group_size} completions per request "
                               f"(the run's num_generations); ask again for more")
        if n > 1 and session is not None:
            raise RequestError(f"n={n}: a session is one conversation; ask for n > 1 without a session")
        return n

    def _ignore_run_settings(self, body: dict) -> None:
        for k in RUN_SETTINGS:
            if body.get(k) is not None and k not in self._warned:
                self._warned.add(k)
                log.warning("endpoint: a request sets %s=%r; the run's own sampling settings are used (set them in "
                            "the run's config)", k, body[k])

    def _sample(self, prompt_ids: list[int], n: int, budget: int) -> list:
        return self._batcher.submit(prompt_ids, n, budget).result()

    def generate(self, body: dict, session: str | None) -> dict:
        """POST /inference/v1/generate."""
        ids = body.get("token_ids", body.get("prompt_token_ids"))
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise RequestError("token_ids must be the prompt as a non-empty list of token ids")
        if bad := next((t for t in ids if t >= self.vocab_size), None):
            raise RequestError(f"token_ids: {bad} is not a token of the policy (its ids are 0 to "
                               f"{self.vocab_size - 1})")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise RequestError("sampling_params must be an object")
        eos = self.tokenizer.eos_token_id
        if set(sp.get("stop_token_ids") or []) - {eos}:
            raise RequestError(f"sampling_params.stop_token_ids: this endpoint stops at the model's EOS ({eos}) only")
        self._ignore_run_settings(sp)
        made = self._sample(ids, self._n(sp, session), self._budget(sp, "max_tokens", "max_new_tokens"))
        choices = []
        for i, c in enumerate(made):
            c_ids, lps = list(c), _token_logprobs(c)
            stopped = bool(c_ids) and c_ids[-1] == eos
            choices.append({"index": i, "token_ids": c_ids, "logprobs": _logprobs(c_ids, lps),
                            "finish_reason": "stop" if stopped else "length"})
            self._log(session, ids, c_ids, lps)
            if session is not None:
                self._extend(session, ids, c_ids, lps, stopped)
        return {"request_id": f"gen-{len(self.calls)}", "prompt_token_ids": ids, "choices": choices}

    def _extend(self, session: str, prompt: list[int], ids: list[int], lps: list[float], stopped: bool) -> None:
        """Record one token-route turn: a prompt that starts with the session's tokens so far continues it (the
        tokens between are context: the client's rendering of the turns after the model's); any other starts a
        new branch (as ART and verifiers split a trace)."""
        with self._lock:
            conv = self._sessions.get(session)
            so_far = conv.prompt_ids + conv.episode.ids if conv else None
            if conv is not None and len(prompt) >= len(so_far) and prompt[:len(so_far)] == so_far:
                conv.episode.add_context(prompt[len(so_far):])
            else:
                conv = Conversation(list(prompt), [], [], branches=conv.branches + 1 if conv else 1)
                self._sessions[session] = conv
            conv.episode.add_sampled(ids, lps, self.tokenizer.decode(ids, skip_special_tokens=True), stopped)

    def chat(self, body: dict, session: str | None) -> dict:
        """POST /v1/chat/completions."""
        if body.get("stream"):
            raise RequestError("stream: this endpoint answers with the whole reply only; call it without stream=True")
        tools = check_tools(body.get("tools"))
        messages = template_messages(body.get("messages"), self.native_tools)
        self._ignore_run_settings(body)
        n, budget = self._n(body, session), self._budget(body, "max_completion_tokens", "max_tokens")
        with self._lock:
            conv = self._continued(session, body["messages"], messages, tools) if session is not None else None
        prompt = conv.prompt_ids + conv.episode.ids if conv else self._render(messages, tools)
        made = self._sample(prompt, n, budget)
        choices = []
        for i, c in enumerate(made):
            ep = conv.episode if conv else Episode(logprobs=[])
            start = len(ep.ids)
            ep.add_model_turn(list(c), _token_logprobs(c), self.tokenizer)
            kept = [(t, lp) for t, m, lp in zip(ep.ids[start:], ep.mask[start:], ep.logprobs[start:]) if m]
            ids, lps = [t for t, _ in kept], [lp for _, lp in kept]
            self._log(session, prompt, ids, lps)
            choices.append(self._choice(i, ep, ids, lps))
            if conv is not None:
                with self._lock:
                    conv.reply = reply_key(choices[-1]["message"])
        return {"id": f"chatcmpl-{len(self.calls)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "prompt_token_ids": prompt, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c["token_ids"]) for c in choices),
                          "total_tokens": len(prompt) + sum(len(c["token_ids"]) for c in choices)}}

    def _render(self, messages: list[dict], tools: list[dict]) -> list[int]:
        text = render_with_tools(self.tokenizer, messages, tools, **self.template_kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _continued(self, session: str, raw: list[dict], messages: list[dict], tools: list[dict]) -> Conversation:
        """The session's conversation, extended by the new turns of `raw` (the tokens so far + those turns rendered
        after them), or a new branch when `raw` does not extend the last request by the endpoint's reply."""
        conv, k = self._sessions.get(session), 0
        if conv is not None:
            k = len(conv.messages)
            new = raw[k + 1:]
            if (raw[:k] == conv.messages and len(raw) > k + 1 and raw[k].get("role") == "assistant"
                    and conv.reply is not None and reply_key(raw[k]) == conv.reply    # the endpoint's own reply
                    and tools == conv.tools and all(m.get("role") in ("user", "tool") for m in new)):
                ep = conv.episode
                if ep.truncated:                         # the model's turn never ended: its end-of-turn as context
                    ep.add_context([self.tokenizer.eos_token_id])
                ep.add_context(turns_after_model_ids(self.tokenizer, new, self.native_tools, self.template_kwargs))
                ep.conversation += [{"role": m["role"], "content": _text(m.get("content"), "message")} for m in new]
                conv.messages = list(raw)
                return conv
        fresh = Conversation(self._render(messages, tools), list(raw), tools, branches=conv.branches + 1 if conv else 1)
        self._sessions[session] = fresh
        return fresh

    def _choice(self, i: int, ep: Episode, ids: list[int], lps: list[float]) -> dict:
        text, calls = ep.turns[-1], _openai_calls(ep)
        content = text.split("<tool_call>", 1)[0].strip() if calls else text
        finish = "tool_calls" if calls else "length" if ep.truncated else "stop"
        message = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
        return {"index": i, "message": message, "finish_reason": finish, "logprobs": _logprobs(ids, lps),
                "token_ids": ids}

    def _log(self, session: str | None, prompt: list[int], ids: list[int], lps: list[float]) -> None:
        with self._lock:
            self.calls.append({"session": session, "prompt_ids": list(prompt), "completion_ids": ids, "logprobs": lps})

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "grpo-pipeline",
                                            "max_model_len": getattr(self.tokenizer, "model_max_length", None),
                                            "root": getattr(self.tokenizer, "name_or_path", None)}]}


def _handler(endpoint: PolicyEndpoint) -> type[BaseHTTPRequestHandler]:
    routes = {"/inference/v1/generate": endpoint.generate, "/v1/chat/completions": endpoint.chat}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:          # requests are not logged one by one
            pass

        def _route(self) -> tuple[str, str | None]:
            path, session = self.path.split("?", 1)[0], self.headers.get("X-Session-ID")
            if m := SESSION_PATH.match(path):
                session, path = m.group(1), m.group(2)
            return path.rstrip("/"), session

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._reply(status, {"error": {"message": message, "type": "invalid_request_error" if status < 500
                                           else "server_error", "code": status}})

        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            path, _ = self._route()
            if path in ("/v1/models", "/models"):
                self._reply(200, endpoint.models())
            elif path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._error(404, f"no route GET {path}")

        def do_POST(self) -> None:  # noqa: N802
            path, session = self._route()
            if path not in routes:
                return self._error(404, f"no route POST {path}; this endpoint serves {', '.join(routes)}")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                self._reply(200, routes[path](body, session))
            except (RequestError, json.JSONDecodeError) as e:
                self._error(400, f"{path}: {e}")
            except Exception as e:  # noqa: BLE001 - the client hears of it; the rollout decides what it means
                log.exception("endpoint: %s failed", path)
                self._error(500, f"{path}: {type(e).__name__}: {e}")

    return Handler
