"""Waiting for state that has no event to wait on: poll it, within a limit."""

from __future__ import annotations

from collections.abc import Callable

import trio


async def wait_until(
    predicate: Callable[[], bool], limit: float = 10.0, *, interval: float = 0.005
) -> None:
    """Poll ``predicate`` every ``interval`` seconds until it holds; fail after ``limit``."""
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - counters and cluster views have no event
            await trio.sleep(interval)
