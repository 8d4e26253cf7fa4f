"""Leases in this process's memory, on the trio clock: for tests and the simulated cluster.

Every :class:`Lease` of one :class:`MemoryLeaseBackend` shares its table, so the nodes of a
simulated cluster in one ``trio.run`` compete for the same names, and under
``trio.testing.MockClock`` expiry follows the mock clock. Faults for the simulation: an owner cut
off from the backend (:meth:`MemoryLeaseBackend.cut_off`) has its calls hang, as a partition from
a real lease server does; a paused one (:meth:`MemoryLeaseBackend.pause`) has them wait until it
resumes; and ``latency`` delays each request on its way there and its answer on
its way back, so a grant can arrive after part of its time-to-live has passed.

Node leases (:class:`p2pshard.leases._node_lease.NodeLeaseBackend`): a row attached to a node
lease is held while that node lease lives; ``calls`` counts the requests of each kind, so a test
can see how many renewals a node sends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import attrs
import trio

from .._errors import LeaseUnavailable, NodeLeaseGone


@attrs.define
class _Row:
    owner: str | None
    token: int
    expires: float
    node_lease: int | None = None
    """The node lease the row is attached to (its expiry then counts, not ``expires``)."""


@attrs.define
class _NodeLease:
    owner: str
    expires: float


class MemoryLeaseBackend:
    """A lease table in memory. ``latency()`` gives each one-way delay (None: no delay)."""

    def __init__(self, *, latency: Callable[[], float] | None = None) -> None:
        self._rows: dict[str, _Row] = {}
        self._node_leases: dict[int, _NodeLease] = {}
        self._next_node_lease = 0
        self.calls: Counter[str] = Counter()
        """Requests made, by method name."""
        self._cut_off: set[str] = set()
        self._paused: dict[str, float] = {}
        self._latency = latency
        self._closed = False

    def pause(self, owner: str, until: float) -> None:
        """Hold ``owner``'s calls until ``until`` on the trio clock (a paused process)."""
        self._paused[owner] = until

    def cut_off(self, owner: str, cut: bool = True) -> None:
        """Make ``owner``'s calls hang (``cut``) or reach the backend again."""
        if cut:
            self._cut_off.add(owner)
        else:
            self._cut_off.discard(owner)

    async def _travel(self, owner: str) -> None:
        if self._closed:
            raise LeaseUnavailable("the memory lease backend is closed")
        if self._latency is not None:
            await trio.sleep(self._latency())
        paused = self._paused.get(owner)
        if paused is not None:
            await trio.sleep_until(paused)
        if owner in self._cut_off:
            await trio.sleep_forever()

    def _held(self, row: _Row, now: float) -> bool:
        if row.owner is None:
            return False
        if row.node_lease is None:
            return row.expires > now
        node_lease = self._node_leases.get(row.node_lease)
        return node_lease is not None and node_lease.expires > now

    def _grant(
        self, name: str, owner: str, now: float, ttl: float, node_lease: int | None
    ) -> int | None:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = _Row(None, 0, 0.0)
        if row.owner != owner and self._held(row, now):
            return None
        row.owner, row.token, row.expires = owner, row.token + 1, now + ttl
        row.node_lease = node_lease
        return row.token

    async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """See :meth:`p2pshard.LeaseBackend.try_acquire`."""
        self.calls["try_acquire"] += 1
        await self._travel(owner)
        granted = self._grant(name, owner, trio.current_time(), ttl, None)
        await self._travel(owner)
        return granted

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        """See :meth:`p2pshard.LeaseBackend.renew`."""
        self.calls["renew"] += 1
        await self._travel(owner)
        now = trio.current_time()
        row = self._rows.get(name)
        renewed = (
            row is not None
            and (row.owner, row.token, row.node_lease) == (owner, token, None)
            and row.expires > now
        )
        if renewed:
            assert row is not None
            row.expires = now + ttl
        await self._travel(owner)
        return renewed

    async def release(self, name: str, owner: str, token: int) -> bool:
        """See :meth:`p2pshard.LeaseBackend.release`."""
        self.calls["release"] += 1
        await self._travel(owner)
        released = self._free(name, owner, token, None)
        await self._travel(owner)
        return released

    def _free(self, name: str, owner: str, token: int, node_lease: int | None) -> bool:
        row = self._rows.get(name)
        if row is None or (row.owner, row.token) != (owner, token):
            return False
        if node_lease is not None and row.node_lease != node_lease:
            return False
        row.owner, row.expires, row.node_lease = None, 0.0, None
        return True

    async def holder(self, name: str) -> tuple[str, int] | None:
        """See :meth:`p2pshard.LeaseBackend.holder`."""
        row = self._rows.get(name)
        if row is None or row.owner is None or not self._held(row, trio.current_time()):
            return None
        return row.owner, row.token

    async def grant_node_lease(self, owner: str, ttl: float) -> int:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.grant_node_lease`."""
        self.calls["grant_node_lease"] += 1
        await self._travel(owner)
        self._next_node_lease += 1
        lease_id = self._next_node_lease
        self._node_leases[lease_id] = _NodeLease(owner, trio.current_time() + ttl)
        await self._travel(owner)
        return lease_id

    async def keep_node_lease(self, owner: str, lease_id: int, ttl: float) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.keep_node_lease`."""
        self.calls["keep_node_lease"] += 1
        await self._travel(owner)
        now = trio.current_time()
        node_lease = self._node_leases.get(lease_id)
        kept = node_lease is not None and node_lease.owner == owner and node_lease.expires > now
        if kept:
            assert node_lease is not None
            node_lease.expires = now + ttl
        await self._travel(owner)
        return kept

    async def revoke_node_lease(self, owner: str, lease_id: int) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.revoke_node_lease`."""
        self.calls["revoke_node_lease"] += 1
        await self._travel(owner)
        node_lease = self._node_leases.get(lease_id)
        revoked = node_lease is not None and node_lease.owner == owner
        if revoked:
            del self._node_leases[lease_id]
            for row in self._rows.values():
                if row.node_lease == lease_id:
                    row.owner, row.expires, row.node_lease = None, 0.0, None
        await self._travel(owner)
        return revoked

    async def try_acquire_attached(self, name: str, owner: str, lease_id: int) -> int | None:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.try_acquire_attached`."""
        self.calls["try_acquire_attached"] += 1
        await self._travel(owner)
        now = trio.current_time()
        node_lease = self._node_leases.get(lease_id)
        if node_lease is None or node_lease.owner != owner or node_lease.expires <= now:
            raise NodeLeaseGone(f"node lease {lease_id} of {owner} has ended")
        granted = self._grant(name, owner, now, 0.0, lease_id)
        await self._travel(owner)
        return granted

    async def release_attached(self, name: str, owner: str, lease_id: int, token: int) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.release_attached`."""
        self.calls["release_attached"] += 1
        await self._travel(owner)
        released = self._free(name, owner, token, lease_id)
        await self._travel(owner)
        return released

    async def aclose(self) -> None:
        """Refuse further calls."""
        self._closed = True
