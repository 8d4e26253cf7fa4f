"""Small trio helpers shared by the packages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a nursery's group of exactly one error as that error.

    Wrap an ``async with trio.open_nursery()`` that an API owns (``open_node``, a transport), so
    its callers get the one exception that happened, not an ``ExceptionGroup`` around it. A group
    of several errors is left as it is: they all matter.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        if error is group:
            raise
        context = error.__context__
        try:
            raise error
        finally:
            error.__context__ = context
