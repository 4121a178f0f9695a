"""The package's layout: no module of `proxy/` imports a module that imports it back, directly or
around a longer loop; imports inside functions and for type checking count too (a lazy import
hides a cycle, it does not remove it). Between sub-packages: none imports one that builds on it
(`FORBIDDEN`), and the package cycles left are the listed ones, a list that only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "proxy"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each module's imports of other modules of the package, wherever they are in it."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {dep for dep in found if dep in modules and dep != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node], path[len(path):] = "open", [node]
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_package_has_no_import_cycles() -> None:
    assert cycles(imports()) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# Sub-packages that build on others must not be imported back by them: the record is below the
# request path, the testbed below the benchmarks, the ops pages below the features that push their
# status sections and collectors to them.
FORBIDDEN = {
    ("proxy.record", "proxy.request"),
    ("proxy.testbed", "proxy.bench"),
    ("proxy.ops", "proxy.warm"),
    ("proxy.ops", "proxy.keep"),
    ("proxy.ops", "proxy.prefill"),
}

# Package cycles still there (each a set of sub-packages that import one another around a loop). The
# list may only shrink: a new cycle fails, and so does a listed one that is gone (take it off).
# Today one tangle: prefill <-> warm and prefill <-> keep (the scheduler's feature builds the warmer
# and the keeper, which use its hooks; its policy reads the warm queue's values), and warm -> cluster
# (`render_error`), cluster -> prefill (the estimator).
KNOWN_PACKAGE_CYCLES: set[frozenset[str]] = {
    frozenset({"proxy.cluster", "proxy.keep", "proxy.prefill", "proxy.warm"}),
}


def package(module: str) -> str:
    """`proxy.record.flight` → `proxy.record`; a top-level module is a package of its own."""
    return ".".join(module.split(".")[:2])


def package_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {package(name): set() for name in graph}
    for name, deps in graph.items():
        found[package(name)].update(package(dep) for dep in deps if package(dep) != package(name))
    return found


def crossings(graph: dict[str, set[str]], lines: set[tuple[str, str]]) -> list[str]:
    """Each import of a module of one package from another that `lines` forbids, named."""
    return [f"{name} imports {dep} ({package(name)} must not import {package(dep)})"
            for name, deps in sorted(graph.items()) for dep in sorted(deps)
            if (package(name), package(dep)) in lines]


def tangles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected parts of more than one node: every node in one reaches every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            part = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(part) > 1:
                found.add(frozenset(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_package_imports_one_it_must_not() -> None:
    assert crossings(imports(), FORBIDDEN) == []


def test_package_cycles_are_only_the_known_ones_and_they_only_shrink() -> None:
    graph = package_imports(imports())
    found = tangles(graph)
    new = [sorted(part) for part in found - KNOWN_PACKAGE_CYCLES]
    gone = [sorted(part) for part in KNOWN_PACKAGE_CYCLES - found]
    loops = cycles({name: deps for name, deps in graph.items()})
    assert (new, gone) == ([], []), f"package cycles now: {loops}"


def test_a_forbidden_import_is_named() -> None:
    graph = {"proxy.record.flight": {"proxy.request.endpoints"}, "proxy.request.endpoints": set()}
    assert crossings(graph, FORBIDDEN) == [
        "proxy.record.flight imports proxy.request.endpoints (proxy.record must not import proxy.request)"]


def test_a_package_cycle_is_found_through_its_modules() -> None:
    graph = {"proxy.a.x": {"proxy.b.y"}, "proxy.b.y": set(), "proxy.b.z": {"proxy.a.x"}, "proxy.c": set()}
    assert package_imports(graph) == {"proxy.a": {"proxy.b"}, "proxy.b": {"proxy.a"}, "proxy.c": set()}
    assert tangles(package_imports(graph)) == {frozenset({"proxy.a", "proxy.b"})}
