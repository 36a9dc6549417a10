"""Imports run one way: no circle of natsl modules importing each other, function-level imports included
(a lazy import hides a circle from Python, not from the reader). Imports under `if TYPE_CHECKING:` are annotations
and do not count: the layer modules the registry builds name natsl.config's ModelConfig only there, since
natsl.config asks natsl.models.registry for each layer type's config section. The one circle allowed is the NAtS-L
layer's with the registry: built alone (`NAtSL(config)`), the layer asks the registry for the linear memory that
config.natsl_state names, which the registry's variants build it with."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "natsl"
ALLOWED = {"natsl.models.natsl_layer", "natsl.models.registry"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str, modules: set[str]) -> set[str]:
    """The natsl modules a file imports anywhere in it (the longest module name each import names)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if isinstance(child, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_circles_finds_a_circle_and_only_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_but_the_natsl_layers():
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: imported_modules(path, name, set(files)) for name, path in files.items()}
    assert graph["natsl.miniature.report"] >= {"natsl.miniature.claims", "natsl.miniature.results"}  # it reads them
    assert graph["natsl.config"] >= {"natsl.models.registry"}  # the one lazy import that once closed a circle
    for circle in circles(graph):
        assert circle <= ALLOWED, f"import circle: {sorted(circle)}"
