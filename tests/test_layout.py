"""The package's layout: no module of `proxy/` imports a module that imports it back, directly or
around a longer loop; imports inside functions and for type checking count too (a lazy import
hides a cycle, it does not remove it). Between sub-packages the same, and none imports one that
builds on it (`FORBIDDEN`: each such import is named)."""

from __future__ import annotations

import ast
from itertools import pairwise
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


def test_no_package_imports_one_it_must_not() -> None:
    assert crossings(imports(), FORBIDDEN) == []


def test_the_packages_have_no_import_cycles() -> None:
    graph = imports()
    loops = cycles(package_imports(graph))
    steps = {step for loop in loops for step in pairwise(loop)}
    assert loops == [], crossings(graph, steps)


def test_a_forbidden_import_is_named() -> None:
    graph = {"proxy.record.flight": {"proxy.request.endpoints"}, "proxy.request.endpoints": set()}
    assert crossings(graph, FORBIDDEN) == [
        "proxy.record.flight imports proxy.request.endpoints (proxy.record must not import proxy.request)"]


def test_a_package_cycle_is_found_through_its_modules() -> None:
    graph = {"proxy.a.x": {"proxy.b.y"}, "proxy.b.y": set(), "proxy.b.z": {"proxy.a.x"}, "proxy.c": set()}
    assert package_imports(graph) == {"proxy.a": {"proxy.b"}, "proxy.b": {"proxy.a"}, "proxy.c": set()}
    assert cycles(package_imports(graph)) == [["proxy.a", "proxy.b", "proxy.a"]]
