"""The assertion the conformance kits need without a test framework: "this block raises that"."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import attrs


@attrs.define
class Raised:
    """What a block under :func:`expect_raises` raised, once it has."""

    value: BaseException | None = None


@contextmanager
def expect_raises(
    kind: type[BaseException] | tuple[type[BaseException], ...], match: str = ""
) -> Iterator[Raised]:
    """Assert that the block raises ``kind``, its message matching ``match`` (``re.search``)."""
    raised = Raised()
    try:
        yield raised
    except kind as exc:
        if not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__}({exc}) does not match {match!r}") from exc
        raised.value = exc
    else:
        raise AssertionError(f"expected {kind} matching {match!r}; nothing was raised")
