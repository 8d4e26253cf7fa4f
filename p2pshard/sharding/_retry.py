"""Retrying a replicator operation until it succeeds, with capped exponential backoff.

The coordinator's state and the remembered entity sets must not be given up on: a failed
majority read or write (too few replicas in time) is logged and tried again, first after
``RETRY_BACKOFF[0]`` seconds, doubling up to ``RETRY_BACKOFF[1]``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from crdt import ReplicationError

T = TypeVar("T")

RETRY_BACKOFF = (0.2, 5.0)
"""First and longest pause between tries of a failed read or write."""


async def until_done(
    operation: Callable[[], Awaitable[T]],
    what: str,
    logger: logging.Logger,
    *,
    retry_on: type[ReplicationError] = ReplicationError,
    on_failure: Callable[[], None] | None = None,
) -> T:
    """Await ``operation()`` until it does not raise ``retry_on``; log each failure as ``what``."""
    pause = RETRY_BACKOFF[0]
    while True:
        try:
            return await operation()
        except retry_on as exc:
            if on_failure is not None:
                on_failure()
            logger.warning("%s failed (%s); retrying in %g s", what, exc, pause)
            await trio.sleep(pause)
            pause = min(pause * 2, RETRY_BACKOFF[1])
