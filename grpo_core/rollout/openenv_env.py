"""OpenEnv environments as rollouts: the config's `environment: "openenv:<target>"` with `environment_config`.

The target is an OpenEnv server: `"package.module:app"` (an ASGI app, usually `create_app(...)`'s, that the stage
starts with uvicorn on 127.0.0.1 and a free port, waits for on /health, and stops when the rollouts are done) or
`"http://host:port"` (a server that runs already). Each rollout is one episode over its own WebSocket session (the
`/ws` channel: one environment instance per connection; the HTTP /reset and /step routes are stateless):

    reset(**task fields, **environment_config.reset)  -> the observation: the first user turn
    the model's turn (chat completions through the policy endpoint)  -> the action
    step(action)  -> reward, done, observation: the next user turn, until done or max_turns

The episode's reward is the sum of its step rewards; metrics: turns, done, invalid_actions (a turn the server
refused as an action; the episode ends there). The model's turns are trained on, the observations are context.

environment_config (all optional):
    reset: {field: value}       more reset arguments (the server passes on those its reset() accepts)
    max_turns: 4                steps per episode
    action_field: name          the action is {name: the model's text}; default: the action schema's only
                                required field, else the model's text parsed as a JSON object
    observation_field: name     the observation's text; default: its only text field, else its fields as JSON
    observation_template: text  the observation's text from several fields, e.g. "{context}\n\nQuestion: {question}"
    system_prompt: text         a system turn before the first observation
    tools: [name, ...]          tools the server answers (the action is a call in <tool_call> tags), shown to the
                                model as the run's `tools` would be (their schemas, through the chat template):
                                built-in names or "package.module:function", as in the config's tools
    max_sessions: n             episodes at once (a server admits max_concurrent_envs sessions)
    start_timeout: 60           seconds the server may take to answer /health
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from importlib.util import find_spec
from typing import Any, Iterator

from grpo_core.plugins import PluginError
from grpo_core.rollout.tools import resolve_tools
from grpo_core.task import Task

OPTIONS = {"reset": dict, "max_turns": int, "action_field": str, "observation_field": str,
           "observation_template": str, "system_prompt": str,
           "tools": list, "max_sessions": int, "start_timeout": (int, float)}
NOT_TEXT = {"metadata", "done", "reward"}
CAPACITY_WAIT_S = 0.2


def agent_loop(target: str, options: dict, concurrency: int, template_kwargs: dict):
    """The AgentLoop that runs episodes of the OpenEnv server `target` (checked here, started by `serving`)."""
    from grpo_core.rollout.agents import AgentLoop
    entry = f"openenv:{target}"
    check_options(options, entry)
    if find_spec("openenv") is None:
        raise PluginError(f"environment {entry!r} needs the openenv package, which is not installed. Fix: pip install "
                          "'openenv==0.4.1' (or pip install -e '.[envs]')")
    if not target.startswith(("http://", "https://")):
        module, colon, attr = target.partition(":")
        if not colon or not module or not attr.isidentifier():
            raise PluginError(f"environment {entry!r}: the target is \"package.module:app\" (an OpenEnv server's ASGI "
                              "app) or \"http://host:port\" (a running server)")
        if _spec(module) is None:
            raise PluginError(f"environment {entry!r}: no module named {module!r} is importable; install the "
                              "environment's package, put its folder on PYTHONPATH, or fix the name")
    schemas = [t.schema for t in resolve_tools(options.get("tools", []), None, "environment_config.tools")]
    server = Server(target, entry, float(options.get("start_timeout", 60)))
    episodes = threading.BoundedSemaphore(max(1, min(concurrency, options.get("max_sessions", concurrency))))

    def run(client, task: Task) -> dict:
        with episodes:
            return episode(client, task, server, options, schemas)

    return AgentLoop(run, "openenv_reward", concurrency, template_kwargs, serving=server.serving,
                     label=f"environment {entry!r}")


def _spec(module: str):
    try:
        return find_spec(module)
    except (ImportError, ValueError):
        return None


def check_options(options: dict, entry: str) -> None:
    for key, value in options.items():
        if key not in OPTIONS:
            raise PluginError(f"environment_config.{key}: not an option of {entry!r}; use {', '.join(OPTIONS)}")
        if not isinstance(value, OPTIONS[key]) or isinstance(value, bool):
            kind = {dict: "a mapping", int: "an integer", str: "a string", list: "a list"}.get(OPTIONS[key], "a number")
            raise PluginError(f"environment_config.{key} must be {kind}, got {value!r}")
    for key in ("max_turns", "max_sessions", "start_timeout"):
        if key in options and options[key] <= 0:
            raise PluginError(f"environment_config.{key} must be positive, got {options[key]!r}")


class Server:
    """One OpenEnv server for a stage: started from its app (or found at its URL), its action schema read once."""

    def __init__(self, target: str, entry: str, start_timeout: float):
        self.target, self.entry, self.start_timeout = target, entry, start_timeout
        self.url: str | None = None
        self.action_schema: dict = {}

    @contextmanager
    def serving(self) -> Iterator["Server"]:
        if self.target.startswith(("http://", "https://")):
            self.url = self.target.rstrip("/")
            self._wait_healthy(None, None)
            self._read_schema()
            yield self
            return
        with tempfile.TemporaryFile("w+") as log_file:
            port = _free_port()
            proc = subprocess.Popen([sys.executable, "-m", "uvicorn", self.target, "--host", "127.0.0.1", "--port",
                                     str(port), "--log-level", "warning"], stdout=log_file, stderr=subprocess.STDOUT,
                                    env=child_env(), preexec_fn=_die_with_parent if sys.platform == "linux" else None)
            try:
                self.url = f"http://127.0.0.1:{port}"
                self._wait_healthy(proc, log_file)
                self._read_schema()
                yield self
            finally:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _read_schema(self) -> None:
        self.action_schema = (_get_json(self.url + "/schema") or {}).get("action") or {}

    def _wait_healthy(self, proc: subprocess.Popen | None, log_file) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if proc is not None and proc.poll() is not None:
                log_file.seek(0)
                tail = "\n".join(log_file.read().strip().splitlines()[-15:])
                raise PluginError(f"environment {self.entry!r}: the server exited (code {proc.returncode}) before it "
                                  f"answered /health; its output:\n{tail or '(none)'}")
            try:
                if _get_json(self.url + "/health", timeout=2) is not None:
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"environment {self.entry!r}: no answer on {self.url}/health within "
                                   f"{self.start_timeout:g} s (environment_config.start_timeout)")
            time.sleep(0.2)

    def action(self, text: str, field: str | None) -> dict:
        """The model's turn as an action: {field: text}, or the JSON object it wrote."""
        field = field or _only_required(self.action_schema)
        if field is not None:
            return {field: text.strip()}
        match = re.search(r"\{.*\}", text, re.S)
        try:
            value = json.loads(match.group(0)) if match else None
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise InvalidAction("the reply is not a JSON object of the action's fields")
        return value


class InvalidAction(ValueError):
    """A model turn that is no action of the environment (the episode ends with what it earned)."""


def _only_required(schema: dict) -> str | None:
    required = schema.get("required") or []
    props = schema.get("properties") or {}
    fields = required if len(required) == 1 else [k for k in props if k != "metadata"]
    return fields[0] if len(fields) == 1 else None


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM): the server goes when the process that started it is killed outright."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def child_env() -> dict:
    """The server imports what this process can (its sys.path, so a module found here is found there)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}


def _get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def observation_text(observation: dict, field: str | None, template: str | None = None) -> str:
    if template is not None:
        try:
            return template.format_map(observation)
        except (KeyError, IndexError, ValueError) as e:
            raise KeyError(f"environment_config.observation_template: {type(e).__name__} {e}; the observation has "
                           f"{', '.join(observation)}") from None
    if field is not None:
        if field not in observation:
            raise KeyError(f"environment_config.observation_field: the observation has no field {field!r}; it has "
                           f"{', '.join(observation)}")
        return str(observation[field])
    texts = [k for k, v in observation.items() if k not in NOT_TEXT and isinstance(v, str) and v]
    if len(texts) == 1:
        return observation[texts[0]]
    return json.dumps({k: v for k, v in observation.items() if k not in NOT_TEXT}, sort_keys=True)


def episode(client, task: Task, server: Server, options: dict, tools: list[dict] | None = None) -> dict:
    """One episode: reset, then the model's turn as the action and the observation as the next turn (`tools`:
    the schemas the requests offer; a reply's calls go back into its text, in <tool_call> tags)."""
    env, result = _open(server, {**task.to_dict(), **options.get("reset", {})})
    with env:
        messages = [{"role": "system", "content": options["system_prompt"]}] if "system_prompt" in options else []
        messages.append({"role": "user", "content": _observed(result, options)})
        reward, turns, invalid = 0.0, 0, 0
        while not result.done and turns < options.get("max_turns", 4):
            reply = client.chat.completions.create(model="policy", messages=messages, **({"tools": tools} if tools
                                                                                           else {})).choices[0].message
            text = turn_text(reply)
            turns += 1
            messages.append({"role": "assistant", "content": reply.content or "",
                             **({"tool_calls": _calls(reply)} if getattr(reply, "tool_calls", None) else {})})
            try:
                result = env.step(server.action(text, options.get("action_field")))
            except InvalidAction:
                invalid = 1
                break
            except RuntimeError as e:
                if "VALIDATION_ERROR" not in str(e):
                    raise
                invalid = 1
                break
            reward += float(result.reward or 0.0)
            if not result.done:
                messages.append({"role": "user", "content": _observed(result, options)})
    return {"reward": reward, "metrics": {"turns": float(turns), "done": float(bool(result.done)),
                                          "invalid_actions": float(invalid)}}


def _observed(result, options: dict) -> str:
    return observation_text(result.observation, options.get("observation_field"), options.get("observation_template"))


def _calls(reply) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in reply.tool_calls]


def turn_text(reply) -> str:
    """A reply as the text the model wrote: its content, then each tool call in the pipeline's <tool_call> format."""
    calls = [f'<tool_call>{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}'
             f"</tool_call>" for c in (_calls(reply) if getattr(reply, "tool_calls", None) else [])]
    return "".join([reply.content or "", *calls])


def _open(server: Server, reset: dict):
    """A new session and its reset. A server at its max_concurrent_envs closes a new session at once: it is tried
    again until start_timeout (environment_config.max_sessions keeps episodes under the server's limit)."""
    from openenv.core import GenericEnvClient
    from websockets.exceptions import ConnectionClosed
    deadline = time.monotonic() + server.start_timeout
    while True:
        env = GenericEnvClient(base_url=server.url).sync()
        try:
            env.connect()
            return env, env.reset(**reset)
        except (ConnectionClosed, RuntimeError) as e:
            env.close()
            if isinstance(e, RuntimeError) and "CAPACITY_REACHED" not in str(e):
                raise
            if time.monotonic() > deadline:
                raise ConnectionError(f"environment {server.entry!r}: the server kept closing new sessions for "
                                      f"{server.start_timeout:g} s (at its max_concurrent_envs?); lower "
                                      "environment_config.max_sessions") from None
            time.sleep(CAPACITY_WAIT_S)
        except BaseException:
            env.close()
            raise
