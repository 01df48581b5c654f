"""The tree shows the architecture, and these tests keep it so.

- Imports point one way: flows -> tasks -> grpo_core -> sandbox, with no cycle between modules
  (function-level imports count too).
- Inside grpo_core, curation (`grpo_core.data`) sits on top of the algorithm side and reaches it only
  through its named bridge (`grpo_core.data.model_policy`); the algorithm side never imports curation.
- grpo_core imports no Prefect or MLflow; sandbox imports nothing of grpo_core.
- No function over 60 lines outside tests and benchmarks; every stage module in tasks/ stays short; no module
  over ~650 lines except the config.
- grpo_core is rooms a newcomer can name from the pipeline diagram: a few leaf modules everything may use, and
  one subpackage per part of an iteration (rollout, rewards, update, evaluation), the model, curation, kernels.
- No hidden switches: library code reads only the environment variables docs/operations.md lists (its table
  "Environment variables"); every other choice is a config field.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "grpo_core", "sandbox")          # each may import only those after it
# Leaf modules of grpo_core that curation may use directly (value types, file helpers, answer checks,
# the plugin resolver that finds user sources as it finds user rewards).
CORE_FOR_CURATION = ("grpo_core.io", "grpo_core.task", "grpo_core.rewards.answers", "grpo_core.config", "grpo_core.plugins")
CURATION_BRIDGE = "grpo_core.data.model_policy"
FRAMEWORKS = ("prefect", "mlflow")
STAGE_MODULES = ("warmstart", "curate", "rollout", "score", "update", "evaluate")
MAX_FUNCTION_LINES = 60
MAX_STAGE_LINES = 80
MAX_MODULE_LINES = 650
LONG_MODULES_ALLOWED = ("grpo_core/config.py",         # one typed config object: its fields are its length
                        "sandbox/python_runner.py")    # copied alone into the box: standard library, one file
CORE_LEAVES = {"errors", "io", "task", "plugins", "stages", "parallel"}
CORE_ROOMS = {"data", "kernels", "rollout", "rewards", "update", "evaluation", "model"}
# The algorithm side's rooms, bottom up: each may import the leaves and the rooms before it. The config sits
# above them all (it names their choices and checks them); only data/ and the layers above import it.
ROOM_ORDER = ("kernels", "rewards", "rollout", "model", "update", "evaluation")


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


def test_no_module_over_650_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules().values()}
    assert {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES and m not in LONG_MODULES_ALLOWED} == {}


def test_grpo_core_is_named_rooms_over_a_few_leaves():
    """Top level: the leaves and the rooms, nothing else; each room is a package that says what it holds."""
    core = ROOT / "grpo_core"
    leaves = {p.stem for p in core.glob("*.py")}
    rooms = {p.name for p in core.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert leaves == CORE_LEAVES | {"config"} and rooms == CORE_ROOMS
    for room in CORE_ROOMS - {"data"}:                   # data keeps its sources/ beside it
        init = core / room / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{init} says what the room holds"


def _core_part(module: str) -> str:
    """grpo_core.<room>.x -> room; grpo_core.<leaf> -> leaf."""
    return module.split(".")[1]


def _top_level_imports(path: Path) -> set[str]:
    """The modules `path` imports at module level (not inside a function)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_rooms_import_one_way():
    """Rooms import only rooms below them (ROOM_ORDER) and never the config (they read the `cfg` they are given
    by field); the leaves import no room. The config sits above the rooms: it imports them only inside its
    validators (to check a name against a room's registry when a config loads, without loading torch for a
    config that is only read), never at module level."""
    graph, _ = import_graph()
    rank = {room: i for i, room in enumerate(ROOM_ORDER)}
    wrong = []
    for m, deps in graph.items():
        if not m.startswith("grpo_core.") or m.startswith("grpo_core.data"):
            continue
        src = _core_part(m)
        for d in deps:
            if not d.startswith("grpo_core.") or d.startswith("grpo_core.data"):
                continue
            dst = _core_part(d)
            if src == dst or dst in CORE_LEAVES:
                continue
            if dst == "config":
                wrong.append(f"{m} -> {d} (a room imports the config, which sits above it)")
            elif src in CORE_LEAVES:
                wrong.append(f"{m} -> {d} (a leaf imports a room)")
            elif src == "config":
                if d in _top_level_imports(ROOT / "grpo_core" / "config.py"):
                    wrong.append(f"{m} -> {d} (the config imports a room at module level)")
            elif rank[dst] > rank[src]:
                wrong.append(f"{m} -> {d} ({src} sits below {dst})")
    assert wrong == []


def test_the_checker_sees_a_cycle_and_a_long_function(tmp_path, monkeypatch):
    """The rules above can fail: a planted cycle and a planted long function are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    src = "def f():\n" + "    x = 1\n" * 70
    tree = ast.parse(src)
    fn = tree.body[0]
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES


# -- no hidden switches ----------------------------------------------------------------------------------

ENV_DOC = ROOT / "docs" / "operations.md"
ENV_SECTION = "## Environment variables"


def documented_variables() -> set[str]:
    """The names in the first column of the table under "## Environment variables" in docs/operations.md."""
    text = ENV_DOC.read_text()
    assert ENV_SECTION in text, f"{ENV_DOC} has no section {ENV_SECTION!r}"
    section = text.split(ENV_SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("|") and line.count("|") > 2]
    return {name for cell in rows for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)}


def _is_environ(node: ast.AST, aliases: set[str]) -> bool:
    """`os.environ`, or a local name bound to it (`env = os.environ`)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id in aliases


def _constants(tree: ast.Module) -> dict[str, list[str]]:
    """Names whose value is known text: module constants (NAME = "X") and loop variables over literal names
    (`for k in ("A", "B")`, also in comprehensions)."""
    known: dict[str, list[str]] = defaultdict(list)
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    known[target.id].append(node.value.value)
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, (ast.Tuple, ast.List)):
            known[node.target.id] += [e.value for e in node.iter.elts
                                      if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return known


def _reads(scope: ast.AST, aliases: set[str]) -> list[tuple[int, ast.AST]]:
    """(line, the expression naming the variable) of every read of the environment in `scope`."""
    found = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            if (f.attr in ("get", "pop") and _is_environ(f.value, aliases)) or \
                    (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                found.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value, aliases):
            found.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_environ(node.comparators[0], aliases):
            found.append((node.lineno, node.left))
    return found


def environment_reads(path: Path) -> list[tuple[int, str | None]]:
    """(line, variable name) of each read of the environment in `path`; the name is None where the code does
    not say it (a computed name: write it out, or make it a module constant)."""
    tree = ast.parse(path.read_text())
    known = _constants(tree)
    out = set()
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        aliases = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and _is_environ(n.value, set())
                   for t in n.targets if isinstance(t, ast.Name)} if scope is not tree else set()
        for line, name in _reads(scope, aliases):
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                out.add((line, name.value))
            elif isinstance(name, ast.Name) and known.get(name.id):
                out |= {(line, value) for value in known[name.id]}
            else:
                out.add((line, None))
    return sorted(out, key=lambda read: (read[0], read[1] or ""))


def undocumented_reads(documented: set[str], root: Path = ROOT) -> list[str]:
    """`file:line reads NAME` for every read of a variable the library code under `root` makes that is not in
    `documented`."""
    bad = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            for line, name in environment_reads(path):
                if name not in documented:
                    where = f"{path.relative_to(root)}:{line}"
                    bad.append(f"{where} reads {name}" if name else f"{where} reads a variable named by a "
                               f"computed expression (write the name out)")
    return bad


def test_library_code_reads_only_documented_environment_variables():
    """Each variable grpo_core/, tasks/, flows/ and sandbox/ read is listed in docs/operations.md's table, with
    what it does and who it is for; a choice a run makes belongs in the config instead."""
    bad = undocumented_reads(documented_variables())
    assert bad == [], ("library code reads environment variables docs/operations.md does not list (section "
                       f"{ENV_SECTION!r}): make the choice a config field, or add a row to that table:\n"
                       + "\n".join(bad))


def test_the_environment_check_sees_every_way_of_reading(tmp_path):
    """The rule above can fail: each form of read of an unlisted variable is found, with its file and line."""
    planted = tmp_path / "grpo_core" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "import os\n"
        "NAME = 'GRPO_CONST'\n"
        "a = os.environ.get('GRPO_GET')\n"
        "b = os.environ['GRPO_ITEM']\n"
        "c = os.getenv('GRPO_GETENV')\n"
        "d = os.environ.pop('GRPO_POP', '')\n"
        "e = 'GRPO_IN' in os.environ\n"
        "def f():\n"
        "    env = os.environ\n"
        "    return env.get(NAME), any(k in env for k in ('GRPO_LOOP',)), os.environ.get(NAME.lower())\n"
        "os.environ['GRPO_WRITTEN'] = '1'\n"
        "os.environ.setdefault('HF_HUB_OFFLINE', '1')\n")
    assert environment_reads(planted) == [(3, "GRPO_GET"), (4, "GRPO_ITEM"), (5, "GRPO_GETENV"), (6, "GRPO_POP"),
                                          (7, "GRPO_IN"), (10, None), (10, "GRPO_CONST"), (10, "GRPO_LOOP")]
    assert undocumented_reads({"GRPO_GET", "GRPO_ITEM", "GRPO_GETENV", "GRPO_POP", "GRPO_IN", "GRPO_CONST"},
                              tmp_path) == ["grpo_core/planted.py:10 reads a variable named by a computed expression "
                                            "(write the name out)", "grpo_core/planted.py:10 reads GRPO_LOOP"]
    documented = documented_variables()
    assert "GRPO_MAX_CPU_ISA" in documented and "GRPO_HOME" in documented and "GRPO_DECODE_LINEAR" not in documented
