"""Imports: no import cycle anywhere in rayflux, and the config package below every other module.

The cycle check reads every ``import`` in the package with ``ast``, the ones inside functions too: a function-level
import only postpones loading a module, the dependency (and the tangle it makes of the layers) is the same, and both
cycles this check was written against ran through one (``cli`` imports ``job`` inside ``main_train``;
``s3_objects`` imported ``storage`` inside its read functions). Dynamic imports by name (``__main__``'s command
table) are no edges.

The config package sits below every other module: each of its modules imports alone, and pulls in no other part of
rayflux, so no import cycle can run through it (as one once ran between the config and the datasets)."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rayflux.config

MODULES = sorted(f"rayflux.config.{p.stem}" for p in Path(rayflux.config.__file__).parent.glob("*.py"))
MODULES = [m.removesuffix(".__init__") for m in MODULES]

_LOADED = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "rayflux" or m.startswith("rayflux."))))
"""


def _fresh_import(*names: str) -> list[str]:
    """Import ``names`` in order in a new interpreter; the rayflux modules that ended up loaded."""
    proc = subprocess.run([sys.executable, "-c", _LOADED, *names], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_section_has_its_own_module():
    assert {
        "rayflux.config.data",
        "rayflux.config.model",
        "rayflux.config.cache",
        "rayflux.config.train",
        "rayflux.config.run",
        "rayflux.config.loader",
    } <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_a_config_module_imports_alone_and_only_config(name):
    loaded = _fresh_import(name)
    assert name in loaded
    assert [m for m in loaded if m not in ("rayflux", "rayflux.config") and not m.startswith("rayflux.config.")] == []


def test_loading_and_checking_a_config_uses_only_config():
    """Validation too stays inside the package: no check imports another module on the way (lazily or not)."""
    code = (
        "import json, sys; from rayflux import config; "
        "cfg = config.load(None, ['data.datasets=[{images_dir: /a}, {images_dir: /b}]', 'cache.vae_actors=2', "
        "'train.gradient_checkpointing=off']); config.help_text(); config.from_dict(cfg.to_dict()); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('rayflux.'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [m for m in json.loads(proc.stdout) if not m.startswith("rayflux.config")] == []


@pytest.mark.parametrize(
    "order",
    [
        ("rayflux.datasets", "rayflux.config"),
        ("rayflux.plan", "rayflux.config"),
        ("rayflux.cache.fit", "rayflux.config.loader"),
        ("rayflux.config.checks", "rayflux.datasets", "rayflux.cache.fit", "rayflux.plan"),
    ],
)
def test_modules_that_build_on_the_config_import_in_any_order(order):
    """Each of these once sat on a cycle with the config (its checks imported them inside a function)."""
    loaded = _fresh_import(*order)
    assert set(order) <= set(loaded)


def test_the_cache_stages_driver_imports_no_torch(tiny_model):
    """The driver of a cache build reads model facts and runs Ray Data; only the encoder actors need torch, whose
    import costs the job's start seconds it would wait for on every ``--only cache`` run."""
    code = (
        "import sys, rayflux.job, rayflux.cache.stage, rayflux.models as m, rayflux.config as c; "
        "m.model_facts(c.ModelConfig(path=sys.argv[1])); "
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


PACKAGE = Path(rayflux.config.__file__).parents[1]


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the rayflux modules it imports anywhere in its source (module level and inside functions), for the
    package at ``root``. ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    modules = {name for name, _ in files}

    def known(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for (module, package), path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names if a.name.split(".")[0] == root.name}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module if package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                if base.split(".")[0] == root.name:
                    deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
        graph[module] = deps - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package's depth is far below the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A path from the group's first module back to itself, inside the group (breadth-first: a shortest one)."""
    start = min(group)
    came_from = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & group):
            if w == start:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{group} is no cycle")


def test_rayflux_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    # The graph is the package's: a parser that saw no imports would find no cycle either.
    assert len(graph) > 80 and "rayflux.gpu_memory" in graph["rayflux.train.trainer"]
    assert "rayflux.job" in graph["rayflux.cli"]  # a function-level import is an edge
    assert find_cycles(graph) == []


def test_the_cycle_finder_reports_a_cycle_planted_in_a_copy(tmp_path):
    """The library's memory model importing a command's module, as ``plan`` once imported ``cli`` (through a
    function-level import, so only a parser that reads function bodies sees it)."""
    copy = shutil.copytree(PACKAGE, tmp_path / "rayflux", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "gpu_memory.py", "a") as f:
        f.write("\n\ndef _planted():\n    from rayflux import cli\n")
    cycles = find_cycles(import_graph(copy))
    assert len(cycles) == 1, cycles
    assert {"rayflux.gpu_memory", "rayflux.cli", "rayflux.job"} <= set(cycles[0])  # back through the job's stages
    cycle = cycles[0]
    assert cycle[0] == cycle[-1] and all(b in import_graph(copy)[a] for a, b in zip(cycle, cycle[1:]))


def test_the_cycle_finder_on_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}, "f": {"a"}}
    assert sorted(map(tuple, find_cycles(graph))) == [("a", "b", "c", "a"), ("e", "e2", "e")]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each of rayflux's folders (``rayflux.cache``, ``rayflux.train``, ...) counted as one unit
    and each top-level module as its own: the layers the package is built in."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    units: dict[str, set[str]] = {}
    for module, deps in graph.items():
        units.setdefault(unit(module), set()).update(unit(d) for d in deps)
    return {u: deps - {u} for u, deps in units.items()}


def test_rayflux_packages_and_top_level_modules_have_no_import_cycle():
    """Folders import each other one way only: ``cache`` builds on ``discovery``, ``train`` on ``cache`` and
    ``models``, ``sweep`` on ``train`` and ``job`` (docs/layout.md, "Layers"). A function-level import counts."""
    units = unit_graph(import_graph(PACKAGE))
    assert {"rayflux.cache", "rayflux.discovery", "rayflux.train", "rayflux.sweep", "rayflux.job"} <= set(units)
    assert {"rayflux.cache", "rayflux.models"} <= units["rayflux.train"]
    assert find_cycles(units) == []


def test_the_unit_check_sees_a_cycle_the_module_check_does_not(tmp_path):
    """Discovery's draw importing the cache's manifest lazily makes no module cycle (nothing the manifest imports
    reaches the draw), but it makes discovery and cache import each other, as discovery's sidecar table once did."""
    copy = shutil.copytree(PACKAGE, tmp_path / "rayflux", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "discovery" / "subset.py", "a") as f:
        f.write("\n\ndef _planted():\n    from rayflux.cache import manifest\n")
    graph = import_graph(copy)
    assert find_cycles(graph) == []
    assert find_cycles(unit_graph(graph)) == [["rayflux.cache", "rayflux.discovery", "rayflux.cache"]]


MAX_POSITIONAL = 6
"""The most positional parameters a rayflux function may take (``self`` and ``cls`` not counted): past that a call is
a row of values whose meaning hangs on their order; later ones go keyword-only, or into a record."""


def positional_overruns(root: Path) -> list[str]:
    """``path:line name(n)`` for every function under ``root`` with more than :data:`MAX_POSITIONAL` positional
    parameters."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                n = len(names) - (names[:1] in (["self"], ["cls"]))
                if n > MAX_POSITIONAL:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}({n})")
    return found


def test_no_function_takes_more_than_six_positional_parameters(tmp_path):
    assert positional_overruns(PACKAGE) == []
    planted = tmp_path / "rayflux" / "planted.py"
    planted.parent.mkdir()
    planted.write_text(
        "class A:\n    def f(self, a, b, c, d, e, f, *, g):\n        pass\n\n\ndef g(a, b, c, d, e, f, g=1):\n    pass\n"
    )
    assert positional_overruns(planted.parent) == ["rayflux/planted.py:6 g(7)"]
