"""``p2pshard node --app MODULE:FUNCTION``: find the application's setup function.

Theory of operation: the app is loaded before the node starts, so that a typo costs nothing but
a one-line error (exit status 2): the module is imported as ``python -m`` would find it (the
current directory first, then ``PYTHONPATH``, then the installed packages), the attribute path
is followed, and the function must be ``async def`` and take one argument, the running
:class:`~p2pshard.Node`. A sync function is refused: everything a setup does on a node (starting
entity types, singletons, replicators) is awaited. Running it is ``_main._serve_node``'s job.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs

from membership import ConfigurationError

from .._config import app_spec_problem

if TYPE_CHECKING:
    from .._node import Node


@attrs.frozen
class App:
    """An application's setup function, found and checked."""

    spec: str
    """``MODULE:FUNCTION``, as given."""

    setup: Callable[[Node], Awaitable[object]]
    """``async def setup(node)``: starts the app's entity types and singletons on ``node``."""


def load_app(spec: str, source: str) -> App:
    """Import ``spec``'s module and return its setup function, checked.

    Args:
        spec: ``MODULE:FUNCTION``, e.g. ``"shop.app:setup"``.
        source: where ``spec`` came from, for the messages (``"--app"``, ``"P2PSHARD_APP"``).

    Raises:
        ConfigurationError: ``spec`` is malformed; the module is not found or raises while it is
            imported (its traceback is printed to stderr first); the function is not there, not
            callable, not ``async def``, or cannot take one argument.
    """
    what = f"{source} {spec!r}"
    problem = app_spec_problem(spec)
    if problem is not None:
        raise ConfigurationError(f"{what} is invalid: {problem}")
    module_name, _, path = spec.partition(":")
    module = _import(module_name, what)
    found: Any = module
    for depth, name in enumerate(path.split(".")):
        try:
            found = getattr(found, name)
        except AttributeError:
            where = f"module {module_name!r} ({getattr(module, '__file__', None) or 'no file'})"
            if depth:
                where = f"{'.'.join(path.split('.')[:depth])!r} of {where}"
            names = [n for n in dir(found) if not n.startswith("_")]
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigurationError(f"{what}: {where} has no attribute {name!r}{hint}") from None
    if inspect.isclass(found):
        raise ConfigurationError(
            f"{what}: {path!r} is a class, not a function: expected async def setup(node)"
        )
    if not callable(found):
        raise ConfigurationError(
            f"{what}: {path!r} is not callable but {type(found).__name__} {found!r:.60}: "
            "expected async def setup(node)"
        )
    if not (
        inspect.iscoroutinefunction(found)
        or inspect.iscoroutinefunction(type(found).__call__)  # an object with async __call__
    ):
        raise ConfigurationError(
            f"{what}: {path!r} is not an async function: write it as async def {path}(node), "
            "which p2pshard node awaits with the running node (starting entity types and "
            "singletons is awaited too)"
        )
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # pragma: no cover - a callable without a signature
        signature = None
    if signature is not None:
        try:
            signature.bind(None)
        except TypeError:
            raise ConfigurationError(
                f"{what}: {path}{signature} cannot be called with one argument, the running "
                f"node: expected async def {path}(node)"
            ) from None
    return App(spec, found)


def _import(module_name: str, what: str) -> Any:
    """The module, imported as ``python -m`` finds it: the current directory comes first."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            searched = ", ".join(p or "." for p in sys.path)
            raise ConfigurationError(
                f"{what}: no module named {missing!r} on the module search path: run p2pshard "
                f"node in the directory that holds it (now {here}), or add that directory to "
                f"PYTHONPATH (searched: {searched})"
            ) from None
        traceback.print_exception(exc)
        raise ConfigurationError(
            f"{what}: importing module {module_name!r} failed: {exc} (a module it imports; is "
            "it installed?)"
        ) from None
    except Exception as exc:
        traceback.print_exception(exc)
        raise ConfigurationError(
            f"{what}: importing module {module_name!r} raised {type(exc).__name__}: {exc} (the "
            "traceback is above)"
        ) from None
