"""What verifiers needs from the pipeline to run its episodes through the policy endpoint (imports verifiers: load
it only for a "verifiers:" environment, through grpo_core.rollout.verifiers_env).

`PipelineRenderer` renders a conversation exactly as the pipeline does (grpo_core.rollout.endpoint's chat route:
the chat template's own tool format, else the fallback `<tool_call>` format of grpo_core.rollout.tools) and
bridges turns: the next prompt is the previous prompt + the tokens the model sampled + the new turns rendered
after them, so an episode is one token sequence whose model tokens are exactly the sampled ones.

`InProcessHarness` is the agent's program: a chat loop in this process (no uv, no subprocess program) that sends
every model call through the rollout's interception endpoint and runs the tool calls on the task's MCP tools.
verifiers finds a harness by a top-level module name, so `register()` makes this module importable as
`HARNESS_ID`.
"""
from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack
from typing import Literal

import openai
import verifiers.v1 as vf
from pydantic import ConfigDict
from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens, ToolCallParseStatus
from renderers.configs import BaseRendererConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult

from grpo_core.rollout.endpoint import template_messages, turns_after_model_ids
from grpo_core.rollout.multiturn import render_with_tools, renders_tools
from grpo_core.rollout.tools import parse_tool_calls

HARNESS_ID = "grpo_pipeline_harness"
RENDERER = f"{__name__}.PipelineRenderer"
STOPPED = (openai.BadRequestError, openai.ConflictError)    # the rollout hit a limit or a stop: the loop ends


class PipelineRendererConfig(BaseRendererConfig):
    """The run's chat_template_kwargs, as extra fields (passed to the chat template as they are)."""
    model_config = ConfigDict(frozen=True, extra="allow")
    name: Literal["grpo-pipeline"] = "grpo-pipeline"
    _internal_fields = frozenset()
    _template_fields = frozenset()
    _allow_opaque_template_kwargs = True


class PipelineRenderer:
    """The `renderers.Renderer` protocol over the pipeline's own rendering of the policy's tokenizer."""
    config_class = PipelineRendererConfig
    is_prefix_stable = False           # an opaque chat template; turns after the first are bridged instead
    supports_tools = True

    def __init__(self, tokenizer, config: PipelineRendererConfig | None = None):
        self.tokenizer = tokenizer
        self.config = config or PipelineRendererConfig()
        self.template_kwargs = dict(self.config.model_extra or {})
        self.native = renders_tools(tokenizer)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages, *, tools=None, add_generation_prompt=True, **_) -> RenderedTokens:
        """The prompt as the endpoint's chat route renders it (always up to the model's turn); its tokens are the
        template's, attributed to no single message."""
        text = render_with_tools(self.tokenizer, template_messages(list(messages), self.native), tools or [],
                                 **self.template_kwargs)
        ids = self._ids(text)
        return RenderedTokens(token_ids=ids, message_indices=[-1] * len(ids),
                              message_roles=[m.get("role") or "" for m in messages])

    def render_ids(self, messages, *, tools=None, add_generation_prompt=True) -> list[int]:
        return self.render(messages, tools=tools).token_ids

    def get_stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def parse_response(self, token_ids, *, tools=None, prompt_ids=None) -> ParsedResponse:
        """The model's turn: its text before the first `<tool_call>`, and the calls (grpo_core.rollout.tools); all
        text where no tools were offered."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text) if tools else []
        if not calls:
            return ParsedResponse(content=text)
        return ParsedResponse(content=text.split("<tool_call>", 1)[0].strip(), tool_calls=[
            ParsedToolCall(raw=json.dumps({"name": c.name, "arguments": c.arguments}), name=c.name,
                           arguments=c.arguments, id=f"call_{i}") if c.error is None else
            ParsedToolCall(raw=c.error, status=ToolCallParseStatus.MALFORMED_STRUCTURE)
            for i, c in enumerate(calls)])

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None, **_):
        """previous prompt + the sampled turn (+ its end-of-turn token, if it was cut off) + the new user or tool
        turns rendered after it, as the endpoint's chat route continues a session."""
        if not new_messages or any(m.get("role") not in ("user", "tool") for m in new_messages):
            return None
        eos = self.tokenizer.eos_token_id
        before = [*previous_prompt_ids, *previous_completion_ids]
        if not previous_completion_ids or previous_completion_ids[-1] != eos:
            before.append(eos)
        after = turns_after_model_ids(self.tokenizer, list(new_messages), self.native, self.template_kwargs)
        return RenderedTokens(token_ids=before + after, message_indices=[-1] * len(before) + [0] * len(after),
                              message_roles=[m.get("role") or "" for m in new_messages])


class InProcessHarnessConfig(vf.HarnessConfig):
    """No options of its own: the turns are capped by the agent's max_turns."""


class InProcessHarness(vf.Harness[InProcessHarnessConfig]):
    """A chat loop with the task's MCP tools, in this process; it ends when the model answers without a tool call
    or the rollout refuses the next turn (max_turns, a stop)."""
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True             # user-driven episodes (OpenEnv, TextArena) relaunch it on the conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        messages = _opening(*self.resolve_prompt(data))
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        async with AsyncExitStack() as stack:
            stack.push_async_callback(client.close)
            servers = {n: {"url": u, "timeout": self.config.tool_timeout} for n, u in mcp_urls.items()}
            schemas, dispatch, live = await connect_mcp({"mcpServers": servers}, stack) if servers else ([], {}, {})
            while True:
                try:
                    reply = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                 **({"tools": schemas} if schemas else {}))
                except STOPPED:
                    break
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": await _call(live, dispatch, call.function)})
        return ProgramResult(exit_code=0, stdout="", stderr="")


def _opening(system: str | None, prompt) -> list[dict]:
    messages = [] if system is None else [{"role": "system", "content": system}]
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [message_to_wire(m) for m in prompt or []]


async def _call(servers, dispatch, function) -> str:
    """A tool's answer, or the error as its answer (the model reads it)."""
    try:
        return str(await call_mcp(servers, dispatch, function.name, json.loads(function.arguments or "{}")))
    except Exception as e:  # noqa: BLE001 - whatever fails goes back to the model as text
        return f"error: {type(e).__name__}: {e}"


def register() -> None:
    """Make this module importable as the top-level `HARNESS_ID` (verifiers imports harnesses by such names)."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])


__all__ = ["InProcessHarness", "PipelineRenderer"]
