"""The lease a shard holds while its entities run: the hook the lease backends plug into.

Theory of operation. A :class:`ShardLease` is one shard's claim on a name that at most one holder
can have at a time (Akka's ``Lease``, plus the fencing token that Akka's lacks). A shard of an
entity type started with ``shard_lease=`` asks for its lease before any entity starts; messages
wait meanwhile. When the lease is lost the shard stops its entities (they get the stop message),
holds new messages and asks again. A hand-off releases the lease once the entities stopped. The
token reaches entities as ``ctx.lease_token``, so their own writes can be fenced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ._allocation import ShardId


class ShardLease(Protocol):
    """One shard's lease. Backends implement it; see the module docstring."""

    async def acquire(self) -> int | None:
        """Try to take the lease: its fencing token when granted, None when someone has it."""
        ...

    async def wait_lost(self) -> None:
        """Return when the lease is lost.

        Lost means expired, taken over, or its backend unreachable for longer than is safe.
        """
        ...

    async def release(self) -> None:
        """Give the lease up (the shard stopped)."""
        ...


ShardLeaseFactory = Callable[[str, ShardId], ShardLease]
"""Makes the lease of one shard from the entity type name and the shard id."""
