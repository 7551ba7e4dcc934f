"""The project's shape: no import circle between its modules, no oversized file in gemslib/.

Every ``.py`` file of the installed packages and of ``benchmark/`` is parsed with ``ast``; each
import, at module level or inside a function, is an edge from the importing module to the one it
names. ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.
Importing ``a.b`` also runs ``a/__init__``, but that is not an edge here: a package may import
its own submodules, and a submodule that took names from its package's ``__init__`` would then
close a circle. Imports of third-party modules are ignored; so is ``tests/``.

That importing gemslib initialises no CUDA context and compiles nothing is checked in
tests/runtime/test_registry.py.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# repository folder -> the package name it installs as (pyproject's package-dir)
PACKAGE_DIRS = {
    "gemslib": "gemslib",
    "ops": "gemslib.ops",
    "fused": "gemslib.fused",
    "tune_configs": "gemslib.tune_configs",
    "benchmark": "benchmark",
}

MAX_LINES = 700


def project_modules() -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` under the package folders."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _known_prefix(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of a dotted name that is a project module (``name`` if none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The project modules that ``module`` imports, each with the line of its import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    # the package a relative import counts from: the module itself if it is a package
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges += [(_known_prefix(alias.name, modules), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                edges.append((candidate if candidate in modules else base, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            edges.append((node.args[0].value, node.lineno))  # importlib.import_module("a.b")
    return [(name, line) for name, line in edges if name in modules and name != module]


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """The graph ``module -> modules it imports``, and the line of each edge's first import."""
    modules = project_modules()
    graph = {module: set() for module in modules}
    lines = {}
    for module, path in modules.items():
        for name, line in imported_names(module, path, modules):
            graph[module].add(name)
            lines.setdefault((module, name), line)
    return graph, lines


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected component with more than one module
    (Tarjan's algorithm, then a shortest path back to the component's first module)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)

    circles = []
    for component in components:
        start = min(component)
        # breadth-first from start, inside the component, until an edge leads back to it
        previous, frontier, closing = {start: None}, [start], None
        while frontier and closing is None:
            following = []
            for node in frontier:
                if start in graph[node]:
                    closing = node
                    break
                for target in sorted(graph[node] & component):
                    if target not in previous:
                        previous[target] = node
                        following.append(target)
            frontier = following
        path = [closing]
        while previous[path[-1]] is not None:
            path.append(previous[path[-1]])
        circles.append(path[::-1] + [start])
    return sorted(circles)


def _describe(circle: list[str], lines: dict[tuple[str, str], int]) -> str:
    modules = project_modules()
    steps = [f"  {source} ({modules[source].relative_to(ROOT)}:{lines[source, target]}) -> {target}"
             for source, target in zip(circle, circle[1:])]
    return " -> ".join(circle) + "\n" + "\n".join(steps)


def test_the_module_map_covers_the_packages():
    modules = project_modules()
    assert {"gemslib", "gemslib.registry", "gemslib.ops", "gemslib.ops.silu",
            "gemslib.fused.attention", "gemslib.tune_configs", "benchmark",
            "benchmark.harness"} <= set(modules)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Absolute, from-package, from-module, relative and function-level imports are edges;
    third-party imports are not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("import torch\nfrom pkg.b import thing\n")
    (package / "b.py").write_text("def f():\n    from .c import name\n")
    (package / "c.py").write_text("def g():\n    from pkg import a\n    import pkg.b\n")
    (package / "d.py").write_text("from pkg import VERSION\n")  # a name: the package itself
    modules = {"pkg": package / "__init__.py", "pkg.a": package / "a.py",
               "pkg.b": package / "b.py", "pkg.c": package / "c.py", "pkg.d": package / "d.py"}
    edges = {module: {name for name, _ in imported_names(module, path, modules)}
             for module, path in modules.items()}
    assert edges == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"},
                     "pkg.c": {"pkg.a", "pkg.b"}, "pkg.d": {"pkg"}}
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_no_import_circle():
    graph, lines = import_graph()
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(_describe(c, lines) for c in found)


def test_no_file_in_gemslib_over_the_line_limit():
    too_long = {}
    for path in sorted((ROOT / "gemslib").rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        data = path.read_bytes()
        if b"\0" in data:  # a built binary, not source
            continue
        count = data.count(b"\n")
        if count > MAX_LINES:
            too_long[str(path.relative_to(ROOT))] = count
    assert not too_long, f"files over {MAX_LINES} lines: {too_long}"
