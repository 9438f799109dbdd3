"""The package layout is the design: the import graph between lighthouse_cluster's packages.

Reads every module's imports (module level, inside functions and under ``TYPE_CHECKING`` alike)
with ``ast``; nothing is imported. The rules:

* no import cycle between modules, not even a type-only one;
* packages import only the layers below them (``LAYERS``): ``core`` (the pure rules) imports
  nothing of the project but the generated torchft messages; ``raft`` only ``core``; and so on
  up to ``cli``;
* ``core`` imports only the standard library, msgpack and protobuf;
* pysyncobj is imported by ``raft`` alone.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lighthouse_cluster"
PACKAGE = "lighthouse_cluster"

# What each package may import from the project (itself always allowed). Top-level modules of the
# package (``durable_files``, ``tls``, ``__init__``) and the generated ``proto`` package are shared leaves.
LAYERS: dict[str, set[str]] = {
    "proto": set(),
    "durable_files": set(),  # writing a file so that it survives a power loss (standard library only)
    "tls": {"durable_files"},
    "core": {"proto"},
    "raft": {"core", "durable_files"},
    "client": {"proto", "tls", "core"},
    "server": {"proto", "tls", "core", "raft", "client", "durable_files"},
    "local": {"proto", "tls", "core", "raft", "client", "server", "durable_files"},
    "cli": {"proto", "tls", "core", "raft", "client", "server", "local", "durable_files"},
    "__init__": {"local"},  # the lazy LighthouseServer attribute
    "__main__": {"cli"},
}
CORE_THIRD_PARTY = {"msgpack", "google"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "__pycache__" not in p.parts}


def imports_of(name: str, path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from pkg import mod`` imports the submodule when there is one.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def project_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph[name] = {m for m in imports_of(name, path) if m in mods and m != name}
    return graph


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_graph_is_read() -> None:
    graph = project_graph()
    # A parser that found nothing would pass every rule below.
    assert "lighthouse_cluster.core.quorum" in graph["lighthouse_cluster.core.state_machine"]
    assert "lighthouse_cluster.server.node" in graph["lighthouse_cluster.cli.serve"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    assert find_cycles(project_graph()) == []


def test_every_package_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, targets in project_graph().items():
        here = area(module)
        assert here in LAYERS, f"{module}: package {here!r} has no place in LAYERS"
        for target in targets:
            there = area(target)
            if there != here and there not in LAYERS[here] and target != PACKAGE:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_core_is_pure() -> None:
    stdlib = sys.stdlib_module_names
    wrong = []
    for name, path in modules().items():
        if area(name) != "core":
            continue
        for target in imports_of(name, path):
            top = target.split(".")[0]
            if top in stdlib or top in CORE_THIRD_PARTY or target == "":
                continue
            if top == PACKAGE and area(target) in {"core", "proto"} | ({"__init__"} if target == PACKAGE else set()):
                continue
            wrong.append(f"{name} -> {target}")
    assert wrong == []


@pytest.mark.parametrize("library", ["pysyncobj"])
def test_only_raft_imports_pysyncobj(library: str) -> None:
    wrong = [name for name, path in modules().items()
             if area(name) != "raft" and any(t.split(".")[0] == library for t in imports_of(name, path))]
    assert wrong == []


def test_the_runtime_imports_no_sdk_benchmark_or_training_package() -> None:
    """The service installs and runs without them (``tests/project/test_runtime_imports.py`` runs it so)."""
    banned = {"ftclient", "benchmarks", "jepsen_like", "torch", "torchft", "numpy", "matplotlib", "py_spy"}
    wrong = [f"{name} -> {t}" for name, path in modules().items() for t in imports_of(name, path)
             if t.split(".")[0] in banned]
    assert wrong == []


def test_every_module_says_what_it_owns() -> None:
    missing = [name for name, path in modules().items()
               if area(name) != "proto" and not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


def redefined_functions(source: str) -> list[str]:
    """Names a module defines twice with ``def`` at its top level (the later silently wins: a
    second pytest hook of the same name in a conftest replaces the first)."""
    seen: set[str] = set()
    twice = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in seen and not any(_is_overload(d) for d in node.decorator_list):
                twice.append(f"{node.name} (line {node.lineno})")
            seen.add(node.name)
    return twice


def _is_overload(decorator: ast.expr) -> bool:
    return (isinstance(decorator, ast.Name) and decorator.id == "overload") or (
        isinstance(decorator, ast.Attribute) and decorator.attr in ("overload", "setter", "deleter"))


def test_redefined_functions_are_found() -> None:
    assert redefined_functions("def a(): pass\ndef b(): pass\ndef a(): pass\n") == ["a (line 3)"]


def test_no_module_defines_a_function_twice() -> None:
    repo = ROOT.parent
    found = {str(p.relative_to(repo)): twice
             for top in ("lighthouse_cluster", "ftclient", "jepsen_like", "benchmarks", "tests", "examples", "scripts")
             for p in sorted((repo / top).rglob("*.py")) if ".venvs" not in p.parts
             if (twice := redefined_functions(p.read_text()))}
    assert not found, found
