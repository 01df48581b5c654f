"""verifiers environments as rollouts: the config's `environment: "verifiers:<taskset id>"` with `environment_config`.

`environment_config` is the EnvConfig mapping verifiers' `load_environment` takes (`taskset`: the taskset's own
options; `agent`, or the env's own seats: max_turns, sampling, ...); the taskset's id is the part after
"verifiers:" (a module importable by a top-level name, exporting its Taskset in `__all__`). Each rollout is one
verifiers episode of the task the run drew (rebuilt from its `meta["verifiers_task"]`, which the `verifiers` task
source writes), played by the pipeline's in-process harness (grpo_core.rollout.verifiers_plugins) against the
policy endpoint through verifiers' train client: prompts rendered here as the pipeline renders them, sampled at
`/inference/v1/generate` with the run's settings. The model's turns are trained on, every other token is
context; the reward is the trace's (its rewards' weighted sum), the metrics are its metrics and its named
rewards (`reward/<name>`). Agents default to the in-process harness, the `subprocess` runtime (MCP toolsets run
as local processes) and 8 turns. The policy's tokenizer is the directory the endpoint names as its model's
`root` (GET /v1/models, as vLLM does).

verifiers is imported only here and on first use (it takes seconds); `serving()` runs the episodes on the process's
one event loop thread with `env.serving()` (shared toolsets, the interception server) entered around a stage's
rollouts.
"""
from __future__ import annotations

import asyncio
import json
import os
from contextlib import AsyncExitStack, contextmanager
from functools import lru_cache
from importlib.util import find_spec
from typing import Any, Iterator

from grpo_core.plugins import PluginError
from grpo_core.task import VERIFIERS_TASK as TASK_META, Task

REWARD_NAME = "verifiers_reward"
NO_KEY_VAR = "GRPO_VERIFIERS_NO_API_KEY"    # an unset variable: verifiers sends no API key to the endpoint
DEFAULT_MAX_TURNS = 8
# Harnesses that fetch programs (uv, npm, ...) at run time: not with the pipeline, which runs offline.
FETCHING_HARNESSES = "bash, null and the other harnesses verifiers ships"


def agent_loop(target: str, options: dict, concurrency: int, template_kwargs: dict):
    """The AgentLoop that plays episodes of the verifiers taskset `target` (checked now, served by `serving`)."""
    from grpo_core.rollout.agents import AgentLoop
    entry = f"verifiers:{target}"
    env = _environment(entry, json.dumps(options, sort_keys=True, default=str))
    runner = Runner(env, entry, template_kwargs)
    return AgentLoop(runner.run, REWARD_NAME, concurrency, template_kwargs, serving=runner.serving,
                     label=f"environment {entry!r}")


# -- loading -------------------------------------------------------------------------------------------------

def _vf(entry: str):
    if find_spec("verifiers") is None:
        raise PluginError(f"environment {entry!r} needs the verifiers package, which is not installed. Fix: pip "
                          "install 'verifiers==0.4.0' (or pip install -e '.[envs]')")
    import verifiers.v1 as vf
    from grpo_core.rollout.verifiers_plugins import register
    register()
    return vf


@lru_cache(maxsize=8)
def _environment(entry: str, options_json: str):
    """The loaded env for an entry and its options (one per process: stages resolve the loop again)."""
    vf = _vf(entry)
    options = json.loads(options_json)
    raw = env_config_data(entry, options)
    try:
        return vf.load_environment(vf.resolve_env_config(raw))
    except Exception as e:  # noqa: BLE001 - verifiers raises ModuleNotFoundError, ValidationError, ValueError, ...
        raise PluginError(f"environment {entry!r}: verifiers cannot load it with this environment_config: "
                          f"{type(e).__name__}: {_first_lines(e)}. Fix: {_fix(e)}") from e


def env_config_data(entry: str, options: dict) -> dict:
    """environment_config with the taskset id and the pipeline's defaults for every agent seat filled in."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import builtin_harness_ids, env_config_type
    target = entry.split(":", 1)[1]
    raw = json.loads(json.dumps(options))
    taskset = raw.setdefault("taskset", {})
    if not isinstance(taskset, dict) or taskset.setdefault("id", target) != target:
        raise PluginError(f"environment_config.taskset must be a mapping of the taskset's options; its id is "
                          f"{target!r} (the part after \"verifiers:\"): drop taskset.id or make it {target!r}")
    try:
        seats = [n for n, f in env_config_type(target, raw.get("id") or "").model_fields.items()
                 if isinstance(f.default, AgentConfig)]
    except Exception as e:  # noqa: BLE001 - the taskset (or env) module cannot be imported
        raise PluginError(f"environment {entry!r}: {type(e).__name__}: {_first_lines(e)}. Fix: {_fix(e)}") from e
    for seat in seats:
        spec = raw.setdefault(seat, {})
        harness = spec.setdefault("harness", {})
        if harness.setdefault("id", "grpo_pipeline_harness") in builtin_harness_ids():
            raise PluginError(f"environment_config.{seat}.harness.id: {harness['id']!r} fetches programs at run "
                              f"time ({FETCHING_HARNESSES}); remove it to use the pipeline's in-process harness")
        spec.setdefault("runtime", {"type": "subprocess"})
        spec.setdefault("max_turns", DEFAULT_MAX_TURNS)
    return raw


def _first_lines(e: Exception, n: int = 3) -> str:
    return " ".join(str(e).strip().splitlines()[:n]).rstrip(".")


def _fix(e: Exception) -> str:
    if isinstance(e, ModuleNotFoundError):
        return ("install the taskset's package, or put the directory of its module on PYTHONPATH; the id is the "
                "module's top-level name (verifiers cannot import dotted ids)")
    return "correct the environment_config fields named above (they are verifiers' EnvConfig: taskset, agent)"


# -- episodes ------------------------------------------------------------------------------------------------

class Runner:
    """Plays a loaded env's episodes on a background event loop, one per rollout thread that asks."""

    def __init__(self, env, entry: str, template_kwargs: dict):
        self.env, self.entry, self.template_kwargs = env, entry, dict(template_kwargs)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tokenizers: dict[str, str] = {}

    @contextmanager
    def serving(self) -> Iterator["Runner"]:
        """`env.serving()` entered on the process's one async loop (grpo_core.rollout.tools.tool_event_loop:
        verifiers keeps loop-bound state across stages); MCP tool servers see this process's sys.path."""
        from grpo_core.rollout.openenv_env import child_env
        from grpo_core.rollout.tools import tool_event_loop
        loop, stack, path = tool_event_loop(), AsyncExitStack(), os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
        try:
            asyncio.run_coroutine_threadsafe(stack.enter_async_context(self.env.serving()), loop).result()
            self.loop = loop
            yield self
        finally:
            self.loop = None
            asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=60)
            if path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = path

    def run(self, client, task: Task) -> dict:
        """One episode of `task` through `client`'s session of the policy endpoint -> its reward and metrics."""
        return outcome(self.episode(client, task), self.entry)

    def episode(self, client, task: Task):
        """verifiers' Episode of `task`, played on the serving loop (this thread waits for it)."""
        if self.loop is None:
            raise RuntimeError(f"environment {self.entry!r}: an episode runs inside the agent loop's serving()")
        base_url = str(client.base_url).rstrip("/")
        context = self._context(base_url, self._tokenizer(client, base_url))
        return asyncio.run_coroutine_threadsafe(self.env.run_episode(self._task(task), context), self.loop).result()

    def _task(self, task: Task):
        if TASK_META not in task.meta:
            raise PluginError(f"environment {self.entry!r}: task {task.id!r} is not a verifiers task (its meta has "
                              f"no {TASK_META!r}). Fix: take the run's tasks from the `verifiers` source (data.curated "
                              "a curation YAML with sources: [{name: verifiers, taskset: {...}}])")
        task_cls = type(self.env.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(task.meta[TASK_META]), self.env.config.taskset.task)

    def _tokenizer(self, client, base_url: str) -> str:
        """The policy's tokenizer directory: the endpoint's model card `root` (read once per endpoint)."""
        server = base_url.split("/s/", 1)[0]
        if server not in self._tokenizers:
            card = client.models.list().data[0]
            root = getattr(card, "root", None)
            if not root:
                raise RuntimeError(f"environment {self.entry!r}: the policy endpoint's /v1/models card names no "
                                   "tokenizer directory (`root`); verifiers renders prompts with it")
            self._tokenizers[server] = root
        return self._tokenizers[server]

    def _context(self, base_url: str, tokenizer_dir: str):
        import verifiers.v1 as vf
        from renderers.configs import CustomRendererConfig
        from grpo_core.rollout.verifiers_plugins import RENDERER
        renderer = CustomRendererConfig(import_path=RENDERER, **self.template_kwargs)
        client = vf.TrainClientConfig(base_url=base_url, api_key_var=NO_KEY_VAR, renderer=renderer,
                                      renderer_model_name=tokenizer_dir)
        return vf.ModelContext(model="policy", client=client, sampling=vf.SamplingConfig())


def outcome(episode, entry: str) -> dict[str, Any]:
    """A finished episode -> {"reward", "metrics"}; a failed or unscored one raises (the rollout is left out)."""
    problems = [f"{e.type}: {e.message}" for e in episode.errors] + [
        f"{e.type}: {e.message}" for t in episode.traces for e in t.errors]
    if not episode.ok or problems:
        raise RuntimeError(f"environment {entry!r}: the episode failed: {'; '.join(problems)[:500] or 'not ok'}")
    if len(episode.traces) != 1:
        raise RuntimeError(f"environment {entry!r}: the episode has {len(episode.traces)} traces; the pipeline "
                           "trains single-agent episodes (one trace)")
    trace = episode.traces[0]
    unscored = [name for name, r in trace.rewards.items() if r is None]
    if unscored:
        raise RuntimeError(f"environment {entry!r}: rewards {unscored} were not scored")
    metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
    metrics.update({f"reward/{k}": float(r.score) for k, r in trace.rewards.items()})
    return {"reward": float(trace.reward), "metrics": metrics}
