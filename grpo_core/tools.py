"""Tools and environments the model may call during a rollout, found by name, and the calls themselves.

A tool is a plain Python function with type hints and a Google-style docstring, sync or `async def` (TRL's
`tools` contract): its JSON schema is what the chat template shows the model. An environment is a class with
TRL's `environment_factory` contract: `reset(**task_fields)` returns text appended to the question (or None),
its public methods are tools bound to the instance, and an optional `get_reward()` scores the whole episode;
one instance per rollout. Config entries resolve as reward functions do (grpo_core.plugins): a built-in name,
`"package.module:function"`, or an entry point of `grpo_pipeline.tools` / `grpo_pipeline.environments`.

Calls come out of the model's text in the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format
(Hermes, Qwen2.5/3, SmolLM3; the fallback format for templates without tool support). `run_tool_calls` runs a
batch of them at once and never raises: a malformed call, an unknown tool, bad arguments, an exception or a
timeout becomes an error text for the model. Not here: the turn loop (grpo_core.multiturn), code tools that
run in the sandbox (grpo_core.code_tools).
"""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Sequence

from grpo_core.plugins import ENVIRONMENT_GROUP, TOOL_GROUP, PluginError, load_plugin

BUILTIN_TOOLS = {"calculator": "grpo_core.tools:calculator_tool", "python": "grpo_core.code_tools:python_tool",
                 "rust": "grpo_core.code_tools:rust_tool"}
BUILTIN_ENVIRONMENTS = {"rust_fix": "grpo_core.code_tools:rust_fix_environment"}
RESERVED_METHODS = ("reset", "get_reward")


class ToolError(PluginError):
    """A tool or environment entry cannot be used; the message names the entry and the fix."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable                # called with keyword arguments; sync or async
    schema: dict                # {"type": "function", "function": {"name", "description", "parameters"}}
    origin: str = ""

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


def tool_of(fn: Callable, origin: str = "") -> Tool:
    """A Tool from a function or bound method; its schema from its type hints and docstring."""
    from transformers.utils import get_json_schema
    name = getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for an undocumented function
        raise ToolError(f"tool {name!r} ({origin or 'given'}): its schema cannot be built ({e}). Fix: give it type "
                        "hints and a Google-style docstring with an Args: section describing every argument, as "
                        "TRL's tools need") from e
    return Tool(name, fn, schema, origin)


# -- resolution by name ------------------------------------------------------------------------------------

def resolve_tools(entries: Sequence[str], sandbox: Any = None, field: str = "tools") -> list[Tool]:
    """The tools `entries` name: built-in (made with the run's `sandbox` settings), "package.module:function",
    or an entry point of grpo_pipeline.tools."""
    tools: list[Tool] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        if entry in BUILTIN_TOOLS:
            factory = load_plugin(BUILTIN_TOOLS[entry], TOOL_GROUP, where, BUILTIN_TOOLS).obj
            tool = tool_of(factory(sandbox), "built-in")
        else:
            plugin = load_plugin(entry, TOOL_GROUP, where, BUILTIN_TOOLS)
            tool = tool_of(plugin.obj, plugin.origin)
        if tool.name in seen:
            raise ToolError(f'{where} = "{entry}": a tool named {tool.name!r} is already given by "{seen[tool.name]}";'
                            " the model calls tools by name, so names must differ. Fix: drop or rename one")
        seen[tool.name] = entry
        tools.append(tool)
    return tools


def _environment_factory(entry: str, sandbox: Any, field: str) -> Callable[[], object]:
    if entry in BUILTIN_ENVIRONMENTS:
        return load_plugin(BUILTIN_ENVIRONMENTS[entry], ENVIRONMENT_GROUP, field, BUILTIN_ENVIRONMENTS).obj(sandbox)
    cls = load_plugin(entry, ENVIRONMENT_GROUP, field, BUILTIN_ENVIRONMENTS).obj
    if inspect.isclass(cls) and not callable(getattr(cls, "reset", None)):
        raise ToolError(f'{field} = "{entry}": {cls.__name__} has no reset() method. Fix: an environment class '
                        "needs reset(self, **task) returning text appended to the question, or None (TRL's contract)")
    return cls


def resolve_environments(entry: str | dict[str, str], sandbox: Any = None,
                         field: str = "environment") -> dict[str | None, Callable[[], object]]:
    """TRL's normalisation: one entry -> {None: factory}; a mapping name -> entry -> {name: factory}."""
    if isinstance(entry, dict):
        return {name: _environment_factory(e, sandbox, f"{field}.{name}") for name, e in entry.items()}
    return {None: _environment_factory(entry, sandbox, field)}


def environment_tools(instance: object) -> list[Tool]:
    """The tools of one environment instance: its class's public methods but reset and get_reward, bound."""
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
             if n not in RESERVED_METHODS and not n.startswith("_")]
    return [tool_of(getattr(instance, n), type(instance).__name__) for n in names]


# -- calls in the model's text -------------------------------------------------------------------------------

CALL_FORMAT = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None        # why the call could not be read (then it is not run)


def _read_call(body: str) -> ToolCall:
    try:
        call = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"invalid tool call: {e.msg} at char {e.pos}; write {CALL_FORMAT}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall("", {}, f'invalid tool call: no "name"; write {CALL_FORMAT}')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(call["name"], {}, f'invalid tool call: "arguments" must be an object; write {CALL_FORMAT}')
    return ToolCall(call["name"], args)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block in `text`, in order; [] when there is none. An unclosed block is a call
    with an error (the model hears why)."""
    calls = []
    for body, close in _CALL.findall(text):
        calls.append(_read_call(body) if close else ToolCall("", {}, f"invalid tool call: <tool_call> is never "
                                                                         f"closed; write {CALL_FORMAT}"))
    return calls


def fallback_system_prompt(schemas: Sequence[dict]) -> str:
    """The tools in the system prompt, for chat templates that do not render tools themselves."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("You may call these tools:\n<tools>\n" + listed + "\n</tools>\nTo call one, write "
            + CALL_FORMAT.replace('"..."', '<tool name>').replace("{...}", "<arguments as JSON>")
            + " and stop; its result comes back inside <tool_response></tool_response>. Answer without a tool "
              "call when you are done.")


# -- running calls --------------------------------------------------------------------------------------------

@dataclass
class ToolResult:
    name: str
    content: str
    error: bool
    seconds: float


def _content(value: Any, max_chars: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str) \
        if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= max_chars else text[:max_chars] + "\n[... truncated]"


def _error(e: BaseException) -> str:
    return f"error: {e}" if isinstance(e, TypeError) else f"error: {type(e).__name__}: {e}"


def run_tool_calls(calls: Sequence[Sequence[ToolCall]], toolsets: Sequence[dict[str, Tool]], timeout: float,
                   max_chars: int = 4000) -> list[list[ToolResult]]:
    """Run every call of every row at once (sync tools on threads, async ones awaited together), each within
    `timeout` seconds -> one result per call, in order. Never raises."""
    jobs = [(r, c, toolsets[r].get(call.name), call) for r, row in enumerate(calls) for c, call in enumerate(row)]
    out: list[list[ToolResult | None]] = [[None] * len(row) for row in calls]
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(jobs))), thread_name_prefix="tool")
    started, futures = time.perf_counter(), []
    for r, c, tool, call in jobs:
        if call.error is not None or tool is None:
            known = ", ".join(sorted(toolsets[r])) or "none"
            text = call.error or f"error: unknown tool {call.name!r}; available: {known}"
            out[r][c] = ToolResult(call.name, text, True, 0.0)
        else:
            futures.append((r, c, tool, pool.submit(_call_timed, tool, call.arguments, timeout)))
    for r, c, tool, future in futures:
        left = max(0.0, timeout - (time.perf_counter() - started)) + 1.0
        try:
            value, seconds, failed = future.result(timeout=left)
        except FutureTimeout:
            value, seconds, failed = f"error: timed out after {timeout:g}s", timeout, True
        out[r][c] = ToolResult(tool.name, _content(value, max_chars), failed, seconds)
    pool.shutdown(wait=False, cancel_futures=True)          # a timed-out sync tool is abandoned, not joined
    return out


def _call_timed(tool: Tool, arguments: dict, timeout: float) -> tuple[Any, float, bool]:
    """(value or error text, seconds, failed) of one call; async tools in their own event loop."""
    t0 = time.perf_counter()
    try:
        if tool.is_async:
            value = asyncio.run(asyncio.wait_for(tool.fn(**arguments), timeout))
        else:
            value = tool.fn(**arguments)
        return value, time.perf_counter() - t0, False
    except asyncio.TimeoutError:
        return f"error: timed out after {timeout:g}s", time.perf_counter() - t0, True
    except Exception as e:  # noqa: BLE001 - whatever the tool raises goes back to the model as text
        return _error(e), time.perf_counter() - t0, True


# -- the built-in calculator ------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 10_000


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError("only whole-number exponents are exact")
    if abs(exponent) > 1000 or (abs(base) > 1 and abs(exponent) * len(str(abs(base.numerator))) > MAX_DIGITS):
        raise ValueError("the power is too large")
    return base ** int(exponent)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))                     # 0.1 is one tenth, not its binary neighbour
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ZeroDivisionError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        value = Fraction(value)
        if len(str(abs(value.numerator))) > MAX_DIGITS:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"unsupported: {ast.unparse(node) if hasattr(ast, 'unparse') else type(node).__name__!s}; "
                     "use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression: an integer, or a reduced fraction with its decimal value."""
    if len(expression) > 1000:
        raise ValueError("the expression is too long (1000 characters at most)")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None
    value = _evaluate(tree)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} (≈ {float(value):.10g})"


def calculator_tool(sandbox: Any = None) -> Callable[[str], str]:
    """The built-in `calculator` tool (no sandbox needed: nothing is executed)."""
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. '12*(3+4)/5'.
        """
        return calculate(expression)
    return calculator
