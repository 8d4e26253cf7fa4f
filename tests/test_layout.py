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
