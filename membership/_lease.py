"""What membership needs from a lease: the split brain resolver's and the singletons'.

The lease implementations (SQLite, etcd, in memory) live in ``p2pshard``, a higher layer; this
module only says what shape they have, so that the lease-majority strategy and a singleton that
runs under a lease can use one without importing them.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio


class FencedGrant(Protocol):
    """A granted lease: its fencing token grows with every grant of the same lease name."""

    @property
    def token(self) -> int:
        """The fencing token of this grant."""
        ...


class HeldLease(Protocol):
    """A lease one owner takes, keeps alive in the background, and may lose.

    ``acquire`` returns the grant, or None when another owner holds the lease; it raises a
    :class:`membership.ClusterError` when the outcome is unknown (the backend did not answer).
    ``wait_lost`` returns once the grant is lost (expired, taken over, or its backend unreachable
    for longer than is safe), or at once when no grant is held. ``release`` gives the lease back
    and says whether the backend confirmed it. ``check`` says, without blocking, whether the grant
    is still held now: its deadline may pass before the task watching it runs (a process stopped
    or starved past it), so whoever acts under the lease checks it first.
    """

    def check(self) -> bool:
        """Whether a grant is held now (its deadline has not passed). Never blocks."""
        ...

    async def acquire(self) -> FencedGrant | None:
        """Take the lease: the grant, or None if another owner holds it."""
        ...

    async def wait_lost(self) -> None:
        """Return when the current grant is lost (at once if none is held)."""
        ...

    async def release(self) -> bool:
        """Give the lease back: True if the backend confirmed it."""
        ...


FIRST_RETRY_FRACTION = 1 / 16
"""The first attempt after a refusal comes this fraction of the retry interval later."""


async def acquire_until_granted(
    lease: HeldLease, retry_interval: float, what: str, logger: logging.Logger
) -> FencedGrant:
    """Ask for ``lease`` until it is granted, at most ``retry_interval`` seconds apart.

    The first attempts after a refusal come sooner: ``retry_interval / 16`` later, then twice as
    long each time up to ``retry_interval``. A lease is usually refused during a failover because
    the node that held it is giving it back at that moment (it downed itself a little later than
    the others saw it Down), and waiting a whole interval for a lease freed a second later would
    add that interval to the failover. A lease held on by another owner costs four attempts more
    than asking every ``retry_interval`` would.

    A refusal is logged at info level; a failure of the backend (any exception) is logged as a
    warning and counts as a refusal. ``what`` names the holder in the log ("shard Counter/3").
    """
    delay = retry_interval * FIRST_RETRY_FRACTION
    while True:
        try:
            grant = await lease.acquire()
        except Exception as exc:  # the backend failed: ask again later
            logger.warning("%s: lease not acquired: %s", what, exc)
        else:
            if grant is not None:
                return grant
            logger.info("%s: another owner holds its lease", what)
        await trio.sleep(delay)
        delay = min(retry_interval, delay * 2)
