"""The tree shows the architecture, and these tests keep it so.

- Imports point one way: flows -> tasks -> grpo_core -> sandbox, with no cycle between modules
  (function-level imports count too).
- Inside grpo_core, curation (`grpo_core.data`) sits on top of the algorithm side and reaches it only
  through its named bridge (`grpo_core.data.model_policy`); the algorithm side never imports curation.
- grpo_core imports no Prefect or MLflow; sandbox imports nothing of grpo_core.
- No function over 60 lines outside tests and benchmarks; every stage module in tasks/ stays short.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "grpo_core", "sandbox")          # each may import only those after it
# Leaf modules of grpo_core that curation may use directly (value types, file helpers, answer checks,
# the plugin resolver that finds user sources as it finds user rewards).
CORE_FOR_CURATION = ("grpo_core.io", "grpo_core.task", "grpo_core.answers", "grpo_core.config", "grpo_core.plugins")
CURATION_BRIDGE = "grpo_core.data.model_policy"
FRAMEWORKS = ("prefect", "mlflow")
STAGE_MODULES = ("warmstart", "curate", "rollout", "score", "update", "evaluate")
MAX_FUNCTION_LINES = 60
MAX_STAGE_LINES = 80


def _modules() -> dict[str, Path]:
    mods = {}
    for layer in LAYERS:
        for p in (ROOT / layer).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports(path: Path, module: str, mods: dict[str, Path]) -> list[str]:
    """What each import statement in `path` depends on, at any nesting level: our module (a
    `from pkg import sub` names the submodule, `from mod import name` the module) or a third-party
    top-level package."""
    def ours(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [ours(a.name) or a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(sub if sub in mods else (ours(base) or base.split(".")[0]))
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, third-party top-level packages each module imports)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    external: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        for dep in _imports(path, mod, mods):
            if dep in mods:
                if dep != mod:
                    graph[mod].add(dep)
            else:
                external[mod].add(dep)
    return graph, external


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph, _ = import_graph()
    assert _cycles(graph) == []


def test_imports_follow_the_layer_order():
    graph, _ = import_graph()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    against = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
               if rank[d.split(".")[0]] < rank[m.split(".")[0]]]
    assert against == []


def test_curation_reaches_the_algorithm_only_through_its_bridge():
    graph, _ = import_graph()
    wrong = []
    for m, deps in graph.items():
        for d in deps:
            if not d.startswith("grpo_core.") or not m.startswith("grpo_core."):
                continue
            m_cur, d_cur = m.startswith("grpo_core.data"), d.startswith("grpo_core.data")
            if not m_cur and d_cur:
                wrong.append(f"{m} -> {d} (the algorithm side imports curation)")
            elif m_cur and not d_cur and m != CURATION_BRIDGE and d not in CORE_FOR_CURATION:
                wrong.append(f"{m} -> {d} (curation must go through {CURATION_BRIDGE})")
    assert wrong == []


def test_core_and_sandbox_import_no_orchestration():
    _, external = import_graph()
    bad = [f"{m} imports {pkg}" for m, pkgs in external.items() for pkg in pkgs
           if m.split(".")[0] in ("grpo_core", "sandbox") and pkg in FRAMEWORKS]
    assert bad == []


def _long_functions(limit: int) -> list[str]:
    long = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{mod}.{node.name}: {n} lines")
    return long


def test_no_function_over_60_lines():
    assert _long_functions(MAX_FUNCTION_LINES) == []


def test_stages_are_thin():
    sizes = {s: len((ROOT / "tasks" / f"{s}.py").read_text().splitlines()) for s in STAGE_MODULES}
    assert {s: n for s, n in sizes.items() if n > MAX_STAGE_LINES} == {}


def test_the_checker_sees_a_cycle_and_a_long_function(tmp_path, monkeypatch):
    """The rules above can fail: a planted cycle and a planted long function are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    src = "def f():\n" + "    x = 1\n" * 70
    tree = ast.parse(src)
    fn = tree.body[0]
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
