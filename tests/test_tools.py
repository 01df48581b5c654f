"""Tools and environments (grpo_core/rollout/tools.py): schemas from TRL-style functions, resolution by name, tool calls
parsed from model text, a batch of calls run at once without ever raising, and the exact calculator."""
from __future__ import annotations

import asyncio
import builtins
import json
import random
import sys
import textwrap
import threading
import time

import pytest

from grpo_core.rollout import tools
from grpo_core.plugins import PluginError
from grpo_core.rollout.tools import (BUILTIN_TOOLS, FALLBACK_INSTRUCTIONS, Tool, ToolCall, ToolError, calculate,
                             calculator_tool, check_environment, environment_tools, fallback_system_prompt,
                             parse_tool_calls, resolve_environments, resolve_tools, run_tool_calls, tool_of)

MODULE = "gp_test_tool_plugin"
PLUGIN_SOURCE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def calculator(expression: str) -> str:
    """A second tool named calculator.

    Args:
        expression: anything
    """
    return expression


def undocumented(x: int) -> int:
    return x


class Counter:
    def reset(self, **task):
        self.n = 0
        return "count"

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: how much
        """
        self.n += by
        return self.n

    def get_reward(self) -> float:
        return float(self.n)


class NoReset:
    def step(self, x: int) -> int:
        """Step.

        Args:
            x: anything
        """
        return x
'''
DIST = "gptoolsdist-0.1.dist-info"
ENTRY_POINTS = f"""
[grpo_pipeline.tools]
adder = {MODULE}:add

[grpo_pipeline.environments]
counting = {MODULE}:Counter
"""


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    """A tool module on sys.path, and a fake installed distribution registering it under entry points."""
    (tmp_path / f"{MODULE}.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / DIST
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gptoolsdist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


def lookup(key: str, default: int = 0) -> str:
    """Look a key up.

    Args:
        key: the key to look up
        default: returned when the key is missing
    """
    return f"{key}={default}"


class Shop:
    """An environment in TRL's shape: reset, public tools, private helpers, a reward."""

    def reset(self, **task) -> str | None:
        self.basket: list[str] = []
        return None

    def add(self, item: str) -> str:
        """Put an item in the basket.

        Args:
            item: what to add
        """
        self.basket.append(item)
        return f"{len(self.basket)} items"

    async def price(self, item: str) -> float:
        """The price of an item.

        Args:
            item: what to price
        """
        return 1.5

    def _secret(self) -> None:
        """Not a tool."""

    def get_reward(self) -> float:
        return float(len(self.basket))

    @property
    def size(self) -> int:
        raise AssertionError("listing the tools must not evaluate properties")


# -- schemas ------------------------------------------------------------------------------------------------


def test_schema_from_a_typed_documented_function():
    tool = tool_of(lookup, "test")
    fn = tool.schema["function"]
    assert tool.name == "lookup" and tool.origin == "test" and not tool.is_async
    assert tool.schema["type"] == "function" and fn["description"] == "Look a key up."
    assert fn["parameters"]["properties"]["key"] == {"type": "string", "description": "the key to look up"}
    assert fn["parameters"]["required"] == ["key"]


def test_schema_from_a_bound_method_leaves_self_out():
    shop = Shop()
    add, price = tool_of(shop.add), tool_of(shop.price)
    assert list(add.schema["function"]["parameters"]["properties"]) == ["item"]
    assert price.is_async and not add.is_async


@pytest.mark.parametrize("source", [
    "def f(x: int) -> int:\n    return x\n",                                   # no docstring
    'def f(x) -> int:\n    """Doc.\n\n    Args:\n        x: a number\n    """\n',  # no type hint
    'def f(x: int) -> int:\n    """Doc without Args."""\n',                    # argument undocumented
])
def test_a_function_without_hints_or_docstring_is_a_config_error_naming_the_fix(source):
    scope: dict = {}
    exec(source, scope)  # noqa: S102 - builds the test's function
    with pytest.raises(ToolError) as err:
        tool_of(scope["f"], "mod:f")
    assert isinstance(err.value, PluginError) and isinstance(err.value, ValueError)
    assert "'f'" in str(err.value) and "type hints and a Google-style docstring with an Args: section" in str(
        err.value)


# -- resolution by name ---------------------------------------------------------------------------------


def test_builtin_calculator_resolves_with_the_sandbox_passed_to_its_factory(monkeypatch):
    [calc] = resolve_tools(["calculator"])
    assert calc.name == "calculator" and calc.origin == "built-in" and calc.fn(expression="2+3") == "5"
    seen = []
    monkeypatch.setattr(tools, "calculator_tool", lambda sandbox=None: seen.append(sandbox) or lookup)
    assert resolve_tools(["calculator"], sandbox="SB")[0].name == "lookup" and seen == ["SB"]


def test_builtin_specs_name_factories_lazily():
    assert BUILTIN_TOOLS["python"] == "grpo_core.rollout.code_tools:python_tool"
    assert "grpo_core.rollout.code_tools" not in tools.__dict__            # not imported at import time


def test_a_module_function_spec_and_an_entry_point(plugin):
    [add] = resolve_tools([f"{plugin}:add"])
    assert add.name == "add" and add.origin == f"{plugin}:add" and add.fn(a=2, b=3) == 5
    [adder] = resolve_tools(["adder"])
    assert adder.name == "add" and adder.origin == f"gptoolsdist 0.1 ({plugin}:add)"


def test_an_unknown_name_lists_the_known_ones(plugin):
    with pytest.raises(ToolError) as err:
        resolve_tools(["calculator", "abacus"])
    msg = str(err.value)
    assert 'tools[1] = "abacus"' in msg and "calculator, python, rust (built in)" in msg and "adder" in msg


def test_a_broken_spec_and_an_undocumented_plugin_name_the_entry(plugin):
    with pytest.raises(ToolError, match="cannot import module 'gp_no_such_module'"):
        resolve_tools(["gp_no_such_module:f"])
    with pytest.raises(ToolError, match="'undocumented'.*Args: section"):
        resolve_tools([f"{plugin}:undocumented"])


def test_duplicate_tool_names_name_both_entries(plugin):
    with pytest.raises(ToolError) as err:
        resolve_tools(["calculator", f"{plugin}:calculator"])
    msg = str(err.value)
    assert f'tools[1] = "{plugin}:calculator"' in msg and 'tools[0] = "calculator"' in msg
    with pytest.raises(ToolError, match="already given"):
        resolve_tools(["adder", f"{plugin}:add"])


# -- environments ---------------------------------------------------------------------------------------


def test_environment_normalisation_single_and_named(plugin):
    assert resolve_environments(None) == {}
    single = resolve_environments(f"{plugin}:Counter")
    assert list(single) == [None] and single[None].__name__ == "Counter"     # the class itself is the factory
    named = resolve_environments({"a": f"{plugin}:Counter", "b": "counting"})
    assert list(named) == ["a", "b"] and named["a"] is named["b"]
    env = named["a"]()
    assert env.reset() == "count" and [t.name for t in environment_tools(env)] == ["increment"]


def test_builtin_environment_factory_gets_the_sandbox(monkeypatch):
    import types
    seen = []
    fake = types.ModuleType("gp_fake_code_tools")
    fake.rust_fix_environment = lambda sandbox=None: seen.append(sandbox) or Shop
    monkeypatch.setitem(sys.modules, "gp_fake_code_tools", fake)
    monkeypatch.setitem(tools.BUILTIN_ENVIRONMENTS, "rust_fix", "gp_fake_code_tools:rust_fix_environment")
    assert resolve_environments("rust_fix", sandbox="SB") == {None: Shop} and seen == ["SB"]


def test_environment_without_reset_is_an_error(plugin):
    with pytest.raises(ToolError, match=r'environment.*NoReset has no callable reset\(\)'):
        resolve_environments({"x": f"{plugin}:NoReset"})
    with pytest.raises(ToolError, match="no callable reset"):
        check_environment(object(), "some_factory")
    check_environment(Shop(), "shop")


def test_environment_tools_are_the_public_methods_bound_to_the_instance():
    shop = Shop()
    shop.reset()
    found = {t.name: t for t in environment_tools(shop)}
    assert sorted(found) == ["add", "price"]                 # no reset, get_reward, _secret, nor the property
    assert found["add"].fn(item="pear") == "1 items" and shop.basket == ["pear"]
    assert found["price"].is_async and found["add"].origin == "environment Shop"
    other = Shop()
    other.reset()
    again = {t.name: t for t in environment_tools(other)}
    again["add"].fn(item="fig")
    assert other.basket == ["fig"] and shop.basket == ["pear"]           # each instance its own


def test_an_undocumented_environment_method_names_the_class():
    class Bad:
        def reset(self, **task):
            return None

        def poke(self, x):
            return x
    with pytest.raises(ToolError, match="'poke' \\(environment Bad\\)"):
        environment_tools(Bad())


# -- tool calls in model text -----------------------------------------------------------------------------


def test_parse_good_calls_in_order():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "parameters": {"key": "k"}}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"j\\"}"}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call> trailing text')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("lookup", {"key": "k"}),
                                      ToolCall("lookup", {"key": "j"}), ToolCall("now", {})]


def test_no_tags_is_no_call():
    assert parse_tool_calls("") == [] and parse_tool_calls("The answer is 4.") == []
    assert parse_tool_calls('{"name": "calculator"}') == [] and parse_tool_calls("</tool_call>") == []


@pytest.mark.parametrize("body, why", [
    ('{"name": "calculator", "arguments": {"expression": "1" "2"}}', "Expecting ',' delimiter at char"),
    ("{not json}", "Expecting property name"),
    ('{"arguments": {}}', '"name"'),
    ('{"name": "", "arguments": {}}', '"name"'),
    ('{"name": 7}', '"name"'),
    ('["calculator", {}]', "expected one JSON object, got list"),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" must be an object, got list'),
    ('{"name": "calculator", "arguments": null}', '"arguments" must be an object'),
    ('{"name": "calculator", "arguments": "{oops"}', '"arguments" is a string that is not JSON'),
    ("", "Expecting value at char 0"),
    ("[" * 100_000, "unreadable JSON"),
])
def test_malformed_calls_carry_an_error_the_model_can_read(body, why):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error.startswith("invalid tool call: ") and why in call.error
    assert call.error.endswith('write <tool_call>{"name": "...", "arguments": {...}}</tool_call>')
    assert call.arguments == {}


def test_an_unclosed_call_is_an_error_even_before_another_call():
    [call] = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')
    assert "never closed" in call.error
    first, second = parse_tool_calls('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>')
    assert "never closed" in first.error and second == ToolCall("b", {})


def test_garbage_never_raises():
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', ":", ",", '"x"', "1e999",
              "null", "\\", "\n", "<tool_", "call>", "\x00", "é", "9" * 5000]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        for call in parse_tool_calls(text):
            assert isinstance(call, ToolCall) and isinstance(call.arguments, dict)
            assert call.error is not None or call.name.strip()       # a call runs only with a name
    for _ in range(500):
        text = "<tool_call>" + "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 80))) + "</tool_call>"
        [call] = parse_tool_calls(text)
        assert call.error is not None or call.name


def test_fallback_system_prompt_lists_the_tools_one_per_line():
    schemas = [tool_of(lookup).schema, resolve_tools(["calculator"])[0].schema]
    text = fallback_system_prompt(schemas)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == schemas
    assert '<tool_call>{"name": <name>, "arguments": <args-dict>}</tool_call>' in text
    assert "<tool_response></tool_response>" in text and "without a tool call" in text
    assert len(FALLBACK_INSTRUCTIONS) < 400                              # small models read it every prompt


# -- running calls ----------------------------------------------------------------------------------------


def _toolset(*fns) -> dict[str, Tool]:
    return {t.name: t for t in map(tool_of, fns)}


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return f"slept {seconds}"


async def anap(seconds: float) -> dict:
    """Sleep, asynchronously.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return {"slept": seconds}


def divide(a: int, b: int) -> float:
    """Divide.

    Args:
        a: numerator
        b: denominator
    """
    return a / b


def shout(text: str) -> list:
    """Repeat loudly.

    Args:
        text: what to say
    """
    return [text.upper()] * 3


def test_sync_and_async_calls_of_every_row_run_concurrently():
    box = _toolset(nap, anap)
    calls = [[ToolCall("nap", {"seconds": 0.5}), ToolCall("anap", {"seconds": 0.5})],
             [ToolCall("anap", {"seconds": 0.5})], [], [ToolCall("nap", {"seconds": 0.5})]]
    t0 = time.perf_counter()
    results = run_tool_calls(calls, [box] * 4, timeout=5)
    assert time.perf_counter() - t0 < 0.9
    assert [[r.content for r in row] for row in results] == [["slept 0.5", '{"slept": 0.5}'], ['{"slept": 0.5}'],
                                                             [], ["slept 0.5"]]
    assert all(not r.error and 0.4 < r.seconds < 0.9 for row in results for r in row)


def test_errors_come_back_as_text_never_raised():
    box = _toolset(divide, lookup)
    calls = [[ToolCall("divide", {"a": 1, "b": 0}), ToolCall("nope", {}), ToolCall("divide", {"a": 1, "x": 2}),
              ToolCall("", {}, 'invalid tool call: no "name"; write ...'), ToolCall("lookup", {})],
             [ToolCall("divide", {"a": 6, "b": 3})]]
    results = run_tool_calls(calls, [box, box], timeout=5)
    assert [r.content for r in results[0]] == [
        "error: ZeroDivisionError: division by zero",
        "error: unknown tool 'nope'; available: divide, lookup",
        "error: divide() got an unexpected keyword argument 'x'; its arguments: a, b",
        'error: invalid tool call: no "name"; write ...',
        "error: lookup() missing a required argument: 'key'; its arguments: key, default"]
    assert all(r.error for r in results[0]) and results[0][1].name == "nope"
    assert results[1][0].content == "2.0" and not results[1][0].error


def test_a_tool_calling_sys_exit_is_an_error_not_an_exit():
    def quit_now() -> str:
        """Exit."""
        sys.exit(3)

    async def aquit_now() -> str:
        """Exit, asynchronously."""
        sys.exit(4)
    t0 = time.perf_counter()
    [[a, b]] = run_tool_calls([[ToolCall("quit_now", {}), ToolCall("aquit_now", {})]],
                              [_toolset(quit_now, aquit_now)], timeout=5)
    assert (a.content, b.content) == ("error: SystemExit: 3", "error: SystemExit: 4") and a.error and b.error
    assert time.perf_counter() - t0 < 1.0


def test_an_async_tool_raising_cancelled_error_or_keyboard_interrupt_is_an_error_not_a_crash():
    async def gave_up() -> str:
        """Cancel, as a tool that awaits a task it cancelled does."""
        raise asyncio.CancelledError("upstream request cancelled")

    async def interrupted() -> str:
        """Interrupt."""
        raise KeyboardInterrupt("stop")
    t0 = time.perf_counter()
    [[a, b, ok]] = run_tool_calls([[ToolCall("gave_up", {}), ToolCall("interrupted", {}),
                                    ToolCall("anap", {"seconds": 0.01})]], [_toolset(gave_up, interrupted, anap)],
                                  timeout=5)
    assert (a.content, b.content) == ("error: CancelledError: upstream request cancelled",
                                      "error: KeyboardInterrupt: stop") and a.error and b.error
    assert ok.content == '{"slept": 0.01}' and not ok.error and time.perf_counter() - t0 < 1.0


def test_async_errors_and_per_row_toolsets():
    async def boom(x: int) -> str:
        """Fail.

        Args:
            x: anything
        """
        raise RuntimeError(f"bad {x}")
    results = run_tool_calls([[ToolCall("boom", {"x": 3})], [ToolCall("boom", {"x": 3})]],
                             [_toolset(boom), _toolset(lookup)], timeout=5)
    assert results[0][0].content == "error: RuntimeError: bad 3" and results[0][0].error
    assert results[1][0].content == "error: unknown tool 'boom'; available: lookup"


def test_timeouts_abandon_the_call_and_the_rest_finish():
    box = _toolset(nap, anap, lookup)
    calls = [[ToolCall("nap", {"seconds": 3}), ToolCall("anap", {"seconds": 3}), ToolCall("lookup", {"key": "a"})]]
    t0 = time.perf_counter()
    [[slow, aslow, quick]] = run_tool_calls(calls, [box], timeout=0.3)
    assert time.perf_counter() - t0 < 1.0                         # the sleeping thread is not joined
    assert slow.content == aslow.content == "error: timed out after 0.3s" and slow.error and aslow.error
    assert quick.content == "a=0" and not quick.error


def test_an_async_tool_that_blocks_the_loop_times_out_and_the_next_batch_gets_a_fresh_loop():
    async def stuck(seconds: float) -> str:
        """Block the event loop (a bug in a user's tool).

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "late"
    first = tools.tool_event_loop()
    t0 = time.perf_counter()
    [[r]] = run_tool_calls([[ToolCall("stuck", {"seconds": 2.5})]], [_toolset(stuck)], timeout=0.2)
    assert r.content == "error: timed out after 0.2s" and time.perf_counter() - t0 < 2.0
    assert tools.tool_event_loop() is not first
    [[ok]] = run_tool_calls([[ToolCall("anap", {"seconds": 0.01})]], [_toolset(anap)], timeout=2)
    assert ok.content == '{"slept": 0.01}'


def test_async_tools_share_one_loop_across_batches():
    loops = []

    async def which_loop() -> str:
        """The running loop's id."""
        loops.append(asyncio.get_running_loop())
        return "ok"
    box = _toolset(which_loop)
    run_tool_calls([[ToolCall("which_loop", {})], [ToolCall("which_loop", {})]], [box, box], timeout=2)
    run_tool_calls([[ToolCall("which_loop", {})]], [box], timeout=2)
    assert len(loops) == 3 and len(set(map(id, loops))) == 1


def test_callable_from_inside_a_running_event_loop():
    async def caller():
        return run_tool_calls([[ToolCall("anap", {"seconds": 0.01}), ToolCall("nap", {"seconds": 0.01})]],
                              [_toolset(anap, nap)], timeout=2)
    [[a, s]] = asyncio.run(caller())
    assert (a.content, s.content) == ('{"slept": 0.01}', "slept 0.01")


def test_results_are_strings_and_long_ones_are_truncated():
    box = _toolset(shout, lookup)
    [[listed, long]] = run_tool_calls([[ToolCall("shout", {"text": "hi"}), ToolCall("lookup", {"key": "k" * 50})]],
                                      [box], timeout=2, max_chars=20)
    assert listed.content == '["HI", "HI", "HI"]'
    assert long.content == "k" * 20 + "\n[... truncated]"


def test_from_worker_threads_at_once():
    box = _toolset(lookup)
    out = []
    threads = [threading.Thread(target=lambda k=k: out.append(
        run_tool_calls([[ToolCall("lookup", {"key": str(k)})]], [box], timeout=2)[0][0].content)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == sorted(f"{k}=0" for k in range(8))


# -- the calculator ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("0.1+0.2", "3/10 (≈ 0.3)"),
    ("12*(3+4)/5", "84/5 (≈ 16.8)"),
    ("7/3", "7/3 (≈ 2.3333333333)"),
    ("-7/3", "-7/3 (≈ -2.3333333333)"),
    ("2+3*4", "14"),
    ("(2+3)*4", "20"),
    ("2**3**2", "512"),
    ("-2**2", "-4"),
    ("2^10", "1024"),
    ("7//2 + 7%2", "4"),
    ("6/3", "2"),
    ("0.1*3 - 0.3", "0"),
    ("1_000 * 3", "3000"),
    ("1e3 + 1", "1001"),
    ("2**-2", "1/4 (≈ 0.25)"),
    ("10**20/3", "100000000000000000000/3 (≈ 3.3333333333e+19)"),
    ("  1 + +1 ", "2"),
])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "unsupported: __import__('os')"),
    ("x + 1", "unsupported: x"),
    ("(1).__class__", "unsupported"),
    ("'a' * 3", "unsupported: 'a'"),
    ("1 < 2", "unsupported"),
    ("[1, 2]", "unsupported"),
    ("1j", "unsupported"),
    ("True + 1", "unsupported: True"),
    ("9**9**9", "exponent is over 1000"),
    ("10**1000**2", "exponent is over 1000"),
    ("99999**1000", "more than 4000 digits"),
    ("(1/99999)**-1000", "more than 4000 digits"),
    ("(10**999)*(10**999)*(10**999)*(10**999)*(10**999)", "more than 4000 digits"),
    ("4**0.5", "whole number"),
    ("1e99999999", "out of range"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 1001, "too long"),
    ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        calculate(expression)


def test_calculator_division_by_zero():
    for expression in ("1/0", "1//0", "1%0", "0**-1", "1/(2-2)"):
        with pytest.raises(ZeroDivisionError, match="division by zero"):
            calculate(expression)


def test_calculator_refuses_deep_trees_before_parsing_them(monkeypatch):
    parsed = []
    monkeypatch.setattr(tools.ast, "parse", lambda *a, **k: parsed.append(a) or pytest.fail("parsed"))
    for expression in ("-" * 999 + "1", "1" + "+1" * 400, "2" + "**2" * 301):
        with pytest.raises(ValueError, match="too many operators"):
            calculate(expression)
    assert parsed == []


def test_calculator_calls_on_many_threads_at_once():
    out: list[str] = []
    threads = [threading.Thread(target=lambda: out.extend(calculate(f"({k}+0.5)*2 - 1/3") for k in range(200)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 1600 and out[0] == "2/3 (≈ 0.66666666667)"


def test_calculator_never_evaluates_code(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec called")
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert calculate("2*(3+4)") == "14"
    with pytest.raises(ValueError):
        calculate("eval('1')")


def test_calculator_as_a_tool():
    calc = tool_of(calculator_tool())
    assert calc.name == "calculator" and calc.schema["function"]["description"] == \
        "Evaluate an arithmetic expression exactly."
    assert "'12*(3+4)/5'" in calc.schema["function"]["parameters"]["properties"]["expression"]["description"]
    [[ok, zero, bad]] = run_tool_calls([[ToolCall("calculator", {"expression": "1/3+1/6"}),
                                         ToolCall("calculator", {"expression": "1/0"}),
                                         ToolCall("calculator", {"expression": "os.system('x')"})]],
                                       [{"calculator": calc}], timeout=5)
    assert ok.content == "1/2 (≈ 0.5)" and not ok.error
    assert zero.content == "error: ZeroDivisionError: division by zero"
    assert bad.content.startswith("error: ValueError: unsupported: os.system('x')")
