"""Host side of Python tests: turn a ``tests`` dict into calls for the box, and judge the
records that come back. Expected values stay here; only call arguments enter the box.

See :mod:`sandbox.api` for the two formats (``io`` and ``assert``).
"""
from __future__ import annotations

import ast
import builtins
import functools
import json
import math
import random
import types
from dataclasses import dataclass
from typing import Any, Callable

from sandbox.types import TaskFormatError, TestResult
from sandbox.python_runner import Unencodable, decode, encode


@dataclass
class Plan:
    """Calls to make in the box and how to judge their outputs."""
    calls: list[list[Any]]                       # [[encoded args tuple, encoded kwargs dict]]
    judge: Callable[[list[dict]], list[TestResult]]
    n_tests: int


def plan(tests: Any, entry_point: str | None) -> Plan:
    """Validate ``tests`` and build a :class:`Plan`; raises :class:`TaskFormatError`."""
    if not isinstance(tests, dict):
        raise TaskFormatError("'tests' must be a dict")
    if not entry_point or not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise TaskFormatError(f"python tasks need 'entry_point' = the function name, got {entry_point!r}")
    fmt = tests.get("format")
    if fmt == "io":
        return _plan_io(tests)
    if fmt == "assert":
        check, setup = tests.get("check"), tests.get("setup", "") or ""
        if not isinstance(check, str) or "def check" not in check:
            raise TaskFormatError("tests['check'] must be Python source defining check(candidate)")
        if not isinstance(setup, str):
            raise TaskFormatError("tests['setup'] must be Python source (helpers the check uses)")
        return _plan_assert(_Check(setup, check, entry_point))
    raise TaskFormatError(f"tests['format'] is {fmt!r}; python tasks use 'io' or 'assert'")


# --------------------------------------------------------------------------- io cases
def _plan_io(tests: dict) -> Plan:
    cases = tests.get("cases")
    if not isinstance(cases, list) or not cases:
        raise TaskFormatError("tests['cases'] must be a non-empty list of {args, kwargs, expected}")
    tol = float(tests.get("float_tol", 0.0) or 0.0)
    calls, expected = [], []
    for k, case in enumerate(cases):
        if not isinstance(case, dict) or "expected" not in case:
            raise TaskFormatError(f"tests['cases'][{k}] must be a dict with 'args' and 'expected'")
        args, kwargs = case.get("args", []), case.get("kwargs", {}) or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TaskFormatError(f"tests['cases'][{k}]: 'args' must be a list, 'kwargs' a dict")
        calls.append(_encode_call(tuple(args), kwargs, f"tests['cases'][{k}]"))
        expected.append(case["expected"])

    def judge(records: list[dict]) -> list[TestResult]:
        by_index, problem = _index_records(records, len(calls))
        out = []
        for i, exp in enumerate(expected):
            ok, detail, dt = _outcome(by_index.get(i), problem)
            if ok:
                got = ok[1]
                if strict_equal(got, exp, tol, json_like=True):
                    out.append(TestResult(f"case {i}", True, "", dt))
                    continue
                detail = f"expected {_show(exp)}, got {_show(got)}"
            out.append(TestResult(f"case {i}", False, detail, dt))
        return out

    return Plan(calls=calls, judge=judge, n_tests=len(calls))


def strict_equal(got: Any, exp: Any, tol: float = 0.0, json_like: bool = False) -> bool:
    """Equality with exact types: bool != int != float; lists == tuples only if ``json_like``."""
    seqs = (list, tuple)
    if json_like and type(got) in seqs and type(exp) in seqs:
        pass
    elif type(got) is not type(exp):
        return False
    if type(exp) is float:
        if math.isnan(exp) or math.isnan(got):
            return math.isnan(exp) and math.isnan(got)
        return got == exp or (tol > 0 and math.isclose(got, exp, rel_tol=tol, abs_tol=tol))
    if type(exp) in seqs:
        return len(got) == len(exp) and all(strict_equal(g, e, tol, json_like) for g, e in zip(got, exp))
    if type(exp) is dict:
        if set(got) != set(exp):
            return False
        return all(strict_equal(got[k], exp[k], tol, json_like) for k in exp)
    return got == exp


# --------------------------------------------------------------------------- HumanEval asserts
class _Placeholder:
    """Stands in for outputs while the host plans which calls a check() makes."""
    def _self(self, *a, **k):
        return self
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _self
    __rtruediv__ = __floordiv__ = __mod__ = __pow__ = __neg__ = __abs__ = __getitem__ = _self
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __call__ = __getattr__ = _self
    __round__ = __and__ = __or__ = __xor__ = __rand__ = __ror__ = _self

    def __bool__(self):
        return True

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __hash__(self):
        return id(self)

    def __float__(self):
        return 0.0

    def __int__(self):
        return 0

    __index__ = __int__

    def __contains__(self, item):
        return False


class _AssertRewriter(ast.NodeTransformer):
    """``assert T, M`` -> ``__sbx_assert__(lambda: T, lineno)`` so each assert is one test."""

    def visit_Assert(self, node: ast.Assert):
        call = ast.Call(func=ast.Name("__sbx_assert__", ast.Load()),
                        args=[ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[],
                                                            kw_defaults=[], defaults=[]),
                                         body=node.test),
                              ast.Constant(node.lineno)], keywords=[])
        return ast.copy_location(ast.Expr(call), node)


@dataclass(frozen=True)
class _Check:
    setup: str          # trusted helpers (e.g. HumanEval's prompt), run first
    check: str          # defines check(candidate)
    entry_point: str    # also bound to the candidate: some checks call it by name


@functools.lru_cache(maxsize=4096)
def _compile_check(src: str, field: str):
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise TaskFormatError(f"tests[{field!r}] is not valid Python: {e}") from e
    tree = ast.fix_missing_locations(_AssertRewriter().visit(tree))
    return compile(tree, f"<{field}>", "exec")


# Checks may draw random inputs. Each run gets its own seeded ``random`` module, so planning and
# judging see the same calls even while other threads of this process draw from the global one.
CHECK_SEED = 20261129


def _private_random() -> types.ModuleType:
    """A copy of the ``random`` module whose functions draw from a fresh seeded generator."""
    rng = random.Random(CHECK_SEED)
    mod = types.ModuleType("random")
    mod.__dict__.update({k: v for k, v in vars(random).items() if not k.startswith("__")})
    for name in dir(rng):
        if not name.startswith("_") and callable(getattr(random, name, None)):
            if getattr(getattr(random, name), "__self__", None) is random._inst:
                setattr(mod, name, getattr(rng, name))
    return mod


def _check_builtins() -> dict[str, Any]:
    rand = _private_random()
    real_import = builtins.__import__

    def check_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "random" and level == 0:
            return rand
        return real_import(name, globals, locals, fromlist, level)

    return {**vars(builtins), "__import__": check_import}


def _run_check(chk: _Check, candidate: Callable, on_assert: Callable) -> None:
    ns: dict[str, Any] = {"__name__": "__check__", "__sbx_assert__": on_assert,
                          "__builtins__": _check_builtins()}
    if chk.setup:
        exec(_compile_check(chk.setup, "setup"), ns)  # trusted task code, on the host
    exec(_compile_check(chk.check, "check"), ns)
    ns[chk.entry_point] = candidate
    check = ns.get("check")
    if not callable(check):
        raise TaskFormatError("tests['check'] must define a function check(candidate)")
    check(candidate)


@functools.lru_cache(maxsize=4096)
def _plan_assert_cached(check_src: _Check):
    calls: list[list[Any]] = []
    keys: dict[str, int] = {}
    n_asserts = [0]
    order: list[int] = []       # line of each executed assert: judging must run the same ones

    def recorder(*args, **kwargs):
        enc = _encode_call(args, kwargs, "a candidate(...) call in tests['check']")
        key = json.dumps(enc)
        if key not in keys:
            keys[key] = len(calls)
            calls.append(enc)
        return _Placeholder()

    def on_assert(thunk, lineno):
        n_asserts[0] += 1
        order.append(lineno)
        try:
            thunk()
        except TaskFormatError:
            raise
        except Exception:  # noqa: BLE001 - placeholders make asserts fail; only calls matter
            pass

    try:
        _run_check(check_src, recorder, on_assert)
    except TaskFormatError:
        raise
    except Exception as e:  # noqa: BLE001
        raise TaskFormatError(
            f"tests['check'] raised {type(e).__name__}: {e} while planning (it may use candidate "
            "outputs outside assert statements); convert the task to 'io' cases") from e
    if not n_asserts[0] or not calls:
        raise TaskFormatError("tests['check'] made no assert with a candidate(...) call; "
                              "add asserts or use 'io' cases")
    return calls, keys, n_asserts[0], tuple(order)


def _plan_assert(check_src: _Check) -> Plan:
    calls, keys, n_tests, order = _plan_assert_cached(check_src)

    def judge(records: list[dict]) -> list[TestResult]:
        by_index, problem = _index_records(records, len(calls))
        results: list[TestResult] = []
        ran: list[int] = []

        def lookup(*args, **kwargs):
            key = json.dumps(_encode_call(args, kwargs, "candidate call"))
            i = keys.get(key)
            if i is None:
                raise AssertionError("call not planned (check is not deterministic)")
            ok, detail, _ = _outcome(by_index.get(i), problem)
            if not ok:
                raise AssertionError(detail)
            return decode(ok[2])  # fresh copy for every use

        def on_assert(thunk, lineno):
            name = f"assert line {lineno} #{len(results)}"
            ran.append(lineno)
            try:
                passed = bool(thunk())
                results.append(TestResult(name, passed, "" if passed else "assertion false"))
            except Exception as e:  # noqa: BLE001
                results.append(TestResult(name, False, f"{type(e).__name__}: {str(e)[:200]}"))

        try:
            _run_check(check_src, lookup, on_assert)
        except Exception as e:  # noqa: BLE001 - check aborted: the rest count as failed
            detail = f"check() aborted: {type(e).__name__}: {str(e)[:200]}"
            results.append(TestResult("check", False, detail))
        if tuple(ran) != order[:len(ran)]:  # outputs steered the check (e.g. a loop over them)
            return [TestResult(f"assert #{k}", False, "the check ran other asserts than planned: its control "
                               "flow depends on the outputs; convert the task to 'io' cases") for k in range(n_tests)]
        results = results[:n_tests]
        while len(results) < n_tests:
            results.append(TestResult(f"assert #{len(results)}", False, "not reached"))
        return results

    return Plan(calls=calls, judge=judge, n_tests=n_tests)


# --------------------------------------------------------------------------- shared helpers
def _encode_call(args: tuple, kwargs: dict, where: str) -> list[Any]:
    try:
        return [encode(tuple(args)), encode(dict(kwargs))]
    except Unencodable as e:
        raise TaskFormatError(f"{where}: arguments must be plain builtin values ({e})") from e


def _index_records(records: list[dict], n: int) -> tuple[dict[int, dict], str]:
    """Map call index -> record. Duplicated or foreign records poison the whole run."""
    by_index: dict[int, dict] = {}
    for rec in records:
        if not isinstance(rec, dict):
            return {}, "malformed result records (tampering?)"
        if "load_error" in rec:
            return {}, f"code failed to load: {rec['load_error']}"
        i = rec.get("i")
        if type(i) is not int or not 0 <= i < n or i in by_index:
            return {}, "duplicate or malformed result records (tampering?)"
        by_index[i] = rec
    return by_index, ""


def _outcome(rec: dict | None, problem: str):
    """-> (ok tuple (True, value, encoded) or None, detail, duration)."""
    if problem:
        return None, problem, None
    if rec is None:
        return None, "no result (missing record: crash, exit or timeout before this call)", None
    dt = rec.get("dt") if isinstance(rec.get("dt"), float) else None
    if rec.get("ok") is not True:
        return None, f"raised {str(rec.get('exc', '?'))[:300]}", dt
    try:
        value = decode(rec.get("v"))
    except (ValueError, TypeError, IndexError, KeyError, RecursionError, OverflowError) as e:
        return None, f"malformed value record ({e})", dt
    return (True, value, rec.get("v")), "", dt


def _show(v: Any) -> str:
    s = repr(v)
    return (s if len(s) <= 120 else s[:117] + "...") + f" ({type(v).__name__})"
