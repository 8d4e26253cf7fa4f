"""Promises about the code base itself: layering, no pickle, documented public API."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["membership", "crdt", "p2pshard"]  # lowest first
FORBIDDEN = {"membership": {"crdt", "p2pshard"}, "crdt": {"p2pshard"}, "p2pshard": set()}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_a_lower_package_never_imports_a_higher_one(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        imported = imported_modules(path)
        assert not imported & FORBIDDEN[package], f"{path} imports {imported & FORBIDDEN[package]}"
        assert "pickle" not in imported, f"{path} imports pickle"


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_are_documented(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__doc__
    missing = []
    for name in dir(module):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        if inspect.ismodule(value):
            continue
        if not inspect.getdoc(value):
            missing.append(name)
        if inspect.isclass(value) and not issubclass(value, BaseException):
            for attr, member in vars(value).items():
                if attr.startswith("_") or (
                    not callable(member) and not isinstance(member, property)
                ):
                    continue
                if not inspect.getdoc(member):
                    missing.append(f"{name}.{attr}")
    assert not missing, f"undocumented public API in {package}: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_typed(package: str) -> None:
    assert (ROOT / package / "py.typed").exists()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_edges(path: Path) -> list[tuple[str, list[str], int]]:
    """Every import of a module (also inside functions and ``TYPE_CHECKING``), as the absolute
    module it names, the names it takes, and its line."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    edges: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            edges.append((target, [alias.name for alias in node.names], node.lineno))
    return edges


def module_graph(package: str) -> dict[str, set[str]]:
    """Which modules of ``package`` each of its modules imports (``from . import x`` included)."""
    paths = {module_name(path): path for path in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        graph[module] = set()
        for target, names, _ in import_edges(path):
            for candidate in [f"{target}.{name}" for name in names] + [target]:
                if candidate in paths and candidate != module:
                    graph[module].add(candidate)
                    break
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


KNOWN_CYCLES: dict[str, list[set[str]]] = {}
"""Cycles still to be taken apart, each with what will replace it. A new cycle fails the test;
so does a listed one that is gone (then take it off the list)."""


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles_inside_a_package(package: str) -> None:
    found = sorted(sorted(cycle) for cycle in cycles(module_graph(package)))
    known = sorted(sorted(cycle) for cycle in KNOWN_CYCLES.get(package, []))
    assert found == known, f"import cycles in {package}: {found} (known, to be removed: {known})"


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_each_other_only_through_public_or_internal_names(package: str) -> None:
    """What a higher package needs of a lower one is public there, or in its declared
    ``internal`` module: never ``from membership._x import ...``."""
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for target, _, line in import_edges(path):
            top, *rest = target.split(".")
            if top in PACKAGES and top != package and any(p.startswith("_") for p in rest):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "private modules of another package imported:\n" + "\n".join(wrong)
