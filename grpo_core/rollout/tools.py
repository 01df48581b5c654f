"""Tools and environments the model may call during a rollout, found by name, and the calls themselves.

A tool is a plain Python function with type hints and a Google-style docstring, sync or `async def` (TRL's
`tools` contract): its JSON schema is what the chat template shows the model. An environment is a class with
TRL's `environment_factory` contract: `reset(**task_fields)` returns text appended to the question (or None),
its public methods are tools bound to the instance, and an optional `get_reward()` scores the whole episode;
one instance per rollout. Config entries resolve as reward functions do (grpo_core.plugins): a built-in name,
`"package.module:function"`, or an entry point of `grpo_pipeline.tools` / `grpo_pipeline.environments`.

Calls come out of the model's text in the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format
(Hermes, Qwen2.5/3, SmolLM3; also the fallback format for templates without tool support). `run_tool_calls`
runs a batch of them at once and never raises: a malformed call, an unknown tool, bad arguments, an exception
or a timeout becomes an error text for the model. Not here: the turn loop (grpo_core.rollout.multiturn), the code
tools that run in the sandbox (grpo_core.rollout.code_tools), and any check of argument types against the schema
(the tool gets what the model wrote, as in TRL).
"""
from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import inspect
import json
import operator
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from typing import Any, Callable, Iterator, Sequence

from grpo_core.plugins import ENVIRONMENT_GROUP, TOOL_GROUP, PluginError, load_plugin

# Built-ins are factories f(sandbox) -> tool (or -> environment factory), named by spec so that this module
# imports the sandbox-backed ones only when a run asks for them.
BUILTIN_TOOLS: dict[str, str] = {"calculator": "grpo_core.rollout.tools:calculator_tool",
                                 "python": "grpo_core.rollout.code_tools:python_tool",
                                 "rust": "grpo_core.rollout.code_tools:rust_tool"}
BUILTIN_ENVIRONMENTS: dict[str, str] = {"rust_fix": "grpo_core.rollout.code_tools:rust_fix_environment"}
RESERVED_METHODS = ("reset", "get_reward")
SCHEMA_FIX = "add type hints and a Google-style docstring with an Args: section, as TRL requires"


class ToolError(PluginError):
    """A tool or environment entry cannot be used; the message names the entry and the fix."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable                # called with keyword arguments; sync or async
    schema: dict                # {"type": "function", "function": {"name", "description", "parameters"}}
    origin: str = ""            # "built-in", "package.module:function", an entry point, or "environment Cls"

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))


def _schema(fn: Callable, origin: str) -> dict:
    from transformers.utils import get_json_schema     # heavy; only runs that use tools pay for it
    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for an undocumented function
        name = getattr(fn, "__name__", repr(fn))
        raise ToolError(f"tool {name!r} ({origin or 'given'}): no schema can be built from it ({e}). Fix: "
                        f"{SCHEMA_FIX}") from e


def tool_of(fn: Callable, origin: str = "", schema: dict | None = None) -> Tool:
    """A Tool from a function or bound method; its schema from its type hints and docstring (or `schema`)."""
    schema = schema if schema is not None else _schema(fn, origin)
    return Tool(schema["function"]["name"], fn, schema, origin)


# -- resolution by name ------------------------------------------------------------------------------------

@contextmanager
def _tool_errors() -> Iterator[None]:
    """A plugin error raised while resolving a tool or an environment reads as a ToolError (still a PluginError)."""
    try:
        yield
    except ToolError:
        raise
    except PluginError as e:
        raise ToolError(str(e)) from e


@_tool_errors()
def _one_tool(entry: str, sandbox: Any, where: str) -> Tool:
    if entry in BUILTIN_TOOLS:
        factory = load_plugin(BUILTIN_TOOLS[entry], TOOL_GROUP, where, BUILTIN_TOOLS).obj
        return tool_of(factory(sandbox), "built-in")
    plugin = load_plugin(entry, TOOL_GROUP, where, BUILTIN_TOOLS)
    return tool_of(plugin.obj, plugin.origin)


def resolve_tools(entries: Sequence[str], sandbox: Any = None, field: str = "tools") -> list[Tool]:
    """The tools `entries` name: built-in (made with the run's `sandbox` settings), "package.module:function",
    or an entry point of grpo_pipeline.tools."""
    tools: list[Tool] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"{field}[{i}]"
        tool = _one_tool(entry, sandbox, where)
        if tool.name in seen:
            raise ToolError(f'{where} = "{entry}": a tool named {tool.name!r} is already given by {seen[tool.name]}; '
                            "the model calls tools by name, so names must differ. Fix: drop or rename one")
        seen[tool.name] = f'{where} = "{entry}"'
        tools.append(tool)
    return tools


def _no_reset(what: str, entry: str) -> ToolError:
    return ToolError(f'environment "{entry}": {what} has no callable reset(). Fix: give the class '
                     "reset(self, **task_fields) returning text appended to the question, or None (TRL's contract)")


@_tool_errors()
def _environment_factory(entry: str, sandbox: Any, field: str) -> Callable[[], object]:
    if entry in BUILTIN_ENVIRONMENTS:
        return load_plugin(BUILTIN_ENVIRONMENTS[entry], ENVIRONMENT_GROUP, field, BUILTIN_ENVIRONMENTS).obj(sandbox)
    factory = load_plugin(entry, ENVIRONMENT_GROUP, field, BUILTIN_ENVIRONMENTS).obj
    if inspect.isclass(factory) and not callable(getattr(factory, "reset", None)):
        raise _no_reset(f"class {factory.__name__}", entry)
    return factory          # TRL's contract: the class itself, called with no argument once per rollout


# Environments of other standards run as agent loops (grpo_core.rollout.agents), built by these modules.
STANDARDS = {"openenv": "grpo_core.rollout.openenv_env", "verifiers": "grpo_core.rollout.verifiers_env"}


def standard(entry: Any) -> tuple[str, str] | None:
    """("openenv" | "verifiers", target) for an environment entry of another standard ("openenv:...",
    "verifiers:..."), else None (a TRL environment_factory entry)."""
    kind, colon, target = entry.partition(":") if isinstance(entry, str) else ("", "", "")
    return (kind, target) if colon and kind in STANDARDS else None


def resolve_environments(entry: str | dict[str, str] | None, sandbox: Any = None,
                         field: str = "environment") -> dict[str | None, Callable[[], object]]:
    """TRL's normalisation: one entry -> {None: factory}; a mapping name -> entry -> {name: factory}; None -> {}."""
    if entry is None:
        return {}
    if isinstance(entry, dict):
        return {name: _environment_factory(e, sandbox, f"{field}.{name}") for name, e in entry.items()}
    return {None: _environment_factory(entry, sandbox, field)}


def check_environment(instance: object, entry: str) -> None:
    """An environment instance must have a callable reset() (what a factory function returned is checked here)."""
    if not callable(getattr(instance, "reset", None)):
        raise _no_reset(f"its instance of {type(instance).__name__}", entry)


_METHOD_SCHEMAS: dict[tuple[type, str], dict] = {}      # building a schema parses a docstring: once per method


def environment_tools(instance: object) -> list[Tool]:
    """The tools of one environment instance: its class's public methods but reset and get_reward, bound
    (listed on the class, as TRL does: listing the instance would evaluate its properties)."""
    cls = type(instance)
    names = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
             if n not in RESERVED_METHODS and not n.startswith("_")]
    tools = []
    for name in names:
        method, origin = getattr(instance, name), f"environment {cls.__name__}"
        if (cls, name) not in _METHOD_SCHEMAS:
            _METHOD_SCHEMAS[(cls, name)] = _schema(method, origin)
        tools.append(tool_of(method, origin, _METHOD_SCHEMAS[(cls, name)]))
    return tools


# -- calls in the model's text -------------------------------------------------------------------------------

CALL_FORMAT = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
# A block ends at its closing tag; reaching the next opening tag or the end of the text first means unclosed.
_CALL = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)(</tool_call>|(?=<tool_call>)|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None        # why the call could not be read (then it is not run; name may be "")


def _invalid(why: str, name: str = "") -> ToolCall:
    return ToolCall(name, {}, f"invalid tool call: {why}; write {CALL_FORMAT}")


def _json(text: str) -> tuple[Any, str | None]:
    """(value, None), or (None, why) when `text` is not JSON."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"{e.msg} at char {e.pos}"
    except (ValueError, RecursionError) as e:       # too deeply nested, or an integer over Python's digit limit
        return None, f"unreadable JSON ({type(e).__name__})"


def _read_call(body: str) -> ToolCall:
    call, why = _json(body.strip())
    if why is not None:
        return _invalid(why)
    if not isinstance(call, dict):
        return _invalid(f"expected one JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return _invalid('"name" must be the tool\'s name')
    args = call["arguments"] if "arguments" in call else call.get("parameters", {})
    if isinstance(args, str):                        # some templates write the arguments as a JSON string
        args, why = _json(args) if args.strip() else ({}, None)
        if why is not None:
            return _invalid(f'"arguments" is a string that is not JSON ({why})', name)
    if not isinstance(args, dict):
        return _invalid(f'"arguments" must be an object, got {type(args).__name__}', name)
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block in `text`, in order; [] when there is none. A block that cannot be read is a
    call with an error the model can read (and is not run)."""
    if not text or "<tool_call>" not in text:
        return []
    return [_read_call(body) if close else _invalid("<tool_call> is never closed with </tool_call>")
            for body, close in _CALL.findall(text)]


def call_text(call: dict) -> str:
    """A call ({"name", "arguments"}) as the model writes it (the worked examples' format; parse_tool_calls reads it)."""
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


FALLBACK_INSTRUCTIONS = (
    "You may call these tools:\n<tools>\n{tools}\n</tools>\n"
    'To call a tool, write <tool_call>{{"name": <name>, "arguments": <args-dict>}}</tool_call> and stop. '
    "The result comes back inside <tool_response></tool_response>. "
    "Give your final answer without a tool call.")


def fallback_system_prompt(schemas: Sequence[dict]) -> str:
    """The tools in the system prompt, for chat templates that do not render tools themselves."""
    return FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in schemas))


# -- running calls --------------------------------------------------------------------------------------------

TRUNCATED = "\n[... truncated]"
# How long past `timeout` to wait for the async event loop before deciding a tool has blocked it.
LOOP_GRACE_S = 1.0


@dataclass
class ToolResult:
    name: str
    content: str
    error: bool
    seconds: float
    known: bool = True          # `name` is one of the rollout's tools (else the model made it up, or wrote none)


@dataclass
class _Job:
    tool: Tool
    arguments: dict
    result: tuple[str, bool, float] | None = None   # (content, error, seconds) once it finished
    done: threading.Event | None = None
    started: float = 0.0


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return value if isinstance(value, str) else str(value)


def _bad_arguments(tool: Tool, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's signature (None: they fit, or the signature cannot be read)."""
    try:
        signature = inspect.signature(tool.fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind_partial(**arguments)          # an unexpected argument first, as Python reports it
        signature.bind(**arguments)
    except TypeError as e:
        return f"error: {tool.name}() {e}; its arguments: {', '.join(signature.parameters) or 'none'}"
    return None


def _failure(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {e}"


def _timed_out(timeout: float) -> tuple[str, bool, float]:
    return f"error: timed out after {timeout:g}s", True, float(timeout)


def _call_sync(job: _Job) -> None:
    try:
        job.result = _text(job.tool.fn(**job.arguments)), False, time.perf_counter() - job.started
    except BaseException as e:  # noqa: BLE001 - whatever the tool raises (sys.exit too) goes back as text
        job.result = _failure(e), True, time.perf_counter() - job.started
    job.done.set()


def _start_sync(job: _Job) -> None:
    # A daemon thread per call, not a ThreadPoolExecutor: the pool's workers are joined at interpreter exit,
    # so one hung tool would hang the process; an abandoned daemon thread does not.
    job.done, job.started = threading.Event(), time.perf_counter()
    threading.Thread(target=_call_sync, args=(job,), name=f"tool-{job.tool.name}", daemon=True).start()


def _wait_sync(job: _Job, timeout: float) -> tuple[str, bool, float]:
    if not job.done.wait(max(0.0, job.started + timeout - time.perf_counter())):
        return _timed_out(timeout)                   # the thread is abandoned, not joined
    return job.result


async def _guarded(job: _Job) -> tuple[str, bool]:
    # Caught inside the task that awaits the tool: a SystemExit or KeyboardInterrupt escaping a task stops the
    # event loop itself, and a CancelledError the tool raises (not a cancellation of this task: wait_for's timeout,
    # or a batch given up) would cancel the whole batch and escape run_tool_calls.
    try:
        return _text(await job.tool.fn(**job.arguments)), False
    except asyncio.CancelledError as e:
        if asyncio.current_task().cancelling():
            raise
        return _failure(e), True
    except BaseException as e:  # noqa: BLE001 - whatever the tool raises goes back as text
        return _failure(e), True


async def _call_async(job: _Job, timeout: float) -> None:
    t0 = time.perf_counter()
    try:
        content, failed = await asyncio.wait_for(_guarded(job), timeout)
        job.result = content, failed, time.perf_counter() - t0
    except asyncio.TimeoutError:
        job.result = _timed_out(timeout)


_loop_lock = threading.Lock()
_loop_state: dict[str, Any] = {}        # {"loop": the event loop, "pid": the process that started it}


def tool_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop async tools run on: one per process on a daemon thread, kept across batches (as TRL's)
    so a tool may hold loop-bound state such as an HTTP session; a fresh one after a fork or a blocked loop."""
    with _loop_lock:
        loop = _loop_state.get("loop")
        if loop is None or loop.is_closed() or _loop_state.get("pid") != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="tool-event-loop", daemon=True).start()
            _loop_state.update(loop=loop, pid=os.getpid())
        return loop


def _run_async(jobs: list[_Job], timeout: float) -> list[tuple[str, bool, float]]:
    """Await every async job together on the tool event loop; a job still unfinished when a tool blocked the
    loop past its timeout is timed out, and that loop is dropped for the next batch."""
    async def together() -> None:
        await asyncio.gather(*(_call_async(job, timeout) for job in jobs))
    loop = tool_event_loop()
    future = asyncio.run_coroutine_threadsafe(together(), loop)
    try:
        future.result(timeout + LOOP_GRACE_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        with _loop_lock:
            if _loop_state.get("loop") is loop:
                _loop_state.clear()
    return [job.result or _timed_out(timeout) for job in jobs]


def _clip(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATED


def _unrunnable(call: ToolCall, toolset: dict[str, Tool]) -> str | None:
    """The error text for a call that cannot be run at all (None: it can)."""
    if call.error is not None:
        return f"error: {call.error}"
    if call.name not in toolset:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(toolset)) or 'none'}"
    return _bad_arguments(toolset[call.name], call.arguments)


def run_tool_calls(calls: Sequence[Sequence[ToolCall]], toolsets: Sequence[dict[str, Tool]], timeout: float,
                   max_chars: int = 4000) -> list[list[ToolResult]]:
    """Run every call of every row at once -> one result per call, in order. Sync tools run on threads and
    async ones are awaited together on one event loop, each within `timeout` seconds. Never raises."""
    # 1) calls that cannot run answer at once; the rest become jobs
    out: list[list[ToolResult | None]] = [[None] * len(row) for row in calls]
    jobs: list[tuple[int, int, _Job]] = []
    for r, (row, toolset) in enumerate(zip(calls, toolsets)):
        for c, call in enumerate(row):
            problem = _unrunnable(call, toolset)
            if problem is not None:
                out[r][c] = ToolResult(call.name, _clip(problem, max_chars), True, 0.0, call.name in toolset)
            else:
                jobs.append((r, c, _Job(toolset[call.name], call.arguments)))
    # 2) sync jobs start on their threads, then the async ones run meanwhile on the loop
    sync_jobs = [job for _, _, job in jobs if not job.tool.is_async]
    for job in sync_jobs:
        _start_sync(job)
    async_jobs = [job for _, _, job in jobs if job.tool.is_async]
    finished = dict(zip(map(id, async_jobs), _run_async(async_jobs, timeout) if async_jobs else []))
    finished.update({id(job): _wait_sync(job, timeout) for job in sync_jobs})
    # 3) results in call order
    for r, c, job in jobs:
        content, failed, seconds = finished[id(job)]
        out[r][c] = ToolResult(job.tool.name, _clip(content, max_chars), failed, seconds)
    return out


# -- the built-in calculator ------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Python refuses to print an integer over 4300 digits, and a tool's answer is cut at 4000 characters anyway.
MAX_DIGITS = 4000
MAX_EXPONENT = 1000
MAX_EXPRESSION_CHARS = 1000
# Bounds the tree's depth, so that neither our walk nor CPython's AST builder runs out of stack: a
# RecursionError inside the builder leaves it broken for every later ast.parse on CPython 3.11.
MAX_OPERATORS = 300
_OPERATOR_CHARS = frozenset("+-*/%^(×÷")
# CPython 3.11's AST builder keeps one recursion count per interpreter, which parses racing on threads
# (concurrent calculator calls) can corrupt.
_PARSE_LOCK = threading.Lock()
_DIGITS_PER_BIT = 0.30103


def _digits(n: int) -> int:
    """About how many decimal digits |n| has, without printing it."""
    return int(abs(n).bit_length() * _DIGITS_PER_BIT) + 1


def _checked(value: Fraction) -> Fraction:
    if max(_digits(value.numerator), _digits(value.denominator)) > MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError("the exponent must be a whole number (exact arithmetic)")
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent is over {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("division by zero")
    if abs(exponent) * max(_digits(base.numerator), _digits(base.denominator)) > MAX_DIGITS + MAX_EXPONENT:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return _checked(base ** int(exponent))


def _literal(node: ast.Constant, source: str) -> Fraction:
    if type(node.value) is int:
        return _checked(Fraction(node.value))
    # A float literal is read from its text: 0.1 is one tenth, not its binary neighbour.
    text = (ast.get_source_segment(source, node) or repr(node.value)).replace("_", "")
    try:
        exact = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"unreadable number {text!r}") from None
    if not exact.is_finite() or abs(exact.adjusted()) > MAX_DIGITS:
        raise ValueError(f"the number {text} is out of range")
    return Fraction(exact)


def _unsupported(node: ast.AST) -> ValueError:
    shown = ast.unparse(node)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return ValueError(f"unsupported: {shown}; use numbers, + - * / // % ** and parentheses")


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, source))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise ZeroDivisionError("division by zero")
        return _checked(Fraction(_BINARY[type(node.op)](left, right)))
    raise _unsupported(node)


def _decimal_text(value: Fraction) -> str:
    with localcontext() as ctx:
        ctx.prec = 11
        return format((Decimal(value.numerator) / Decimal(value.denominator)).normalize(), "g")


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression: an integer, or the reduced fraction and its decimal value.
    A ValueError (or ZeroDivisionError) says what is wrong with it; nothing is ever executed."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is too long ({MAX_EXPRESSION_CHARS} characters at most)")
    if sum(ch in _OPERATOR_CHARS for ch in expression) > MAX_OPERATORS:
        raise ValueError(f"the expression has too many operators ({MAX_OPERATORS} at most)")
    source = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        with _PARSE_LOCK:
            tree = ast.parse(source, mode="eval")
        value = _evaluate(tree.body, source)
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None
    except (RecursionError, MemoryError):
        raise ValueError("the expression is nested too deeply") from None
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} (≈ {_decimal_text(value)})"


def calculator_tool(sandbox: Any = None) -> Callable[[str], str]:
    """The built-in `calculator` tool (the sandbox is not needed: nothing is executed)."""
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. '12*(3+4)/5'.
        """
        return calculate(expression)
    return calculator
