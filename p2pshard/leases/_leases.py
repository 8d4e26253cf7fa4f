"""A node's leases (``node.leases``): handles on names in its lease backend, and its node lease.

The leases themselves are in ``p2pshard.leases._lease`` (a lease of its own) and
``p2pshard.leases._node_lease`` (shard leases attached to one lease per node).
"""

from __future__ import annotations

import logging
import weakref

import trio

from .._errors import LeaseUnavailable
from ._lease import (
    TRIO_CLOCK,
    Lease,
    LeaseBackend,
    LeaseClock,
    LeaseCounters,
    LeaseSettings,
    LeaseStatistics,
)
from ._node_lease import AttachedLease, NodeLease, node_lease_backend

logger = logging.getLogger("p2pshard.lease")


class Leases:
    """This node's leases (``node.leases``): handles on names in the node's lease backend.

    The owner of every lease taken through it is the node's incarnation (``str`` of its
    :class:`~membership.UniqueAddress`: name, address and uid), not its address: a process
    restarted at the same address is another owner, and waits until its previous incarnation
    gave the lease back or the lease expired, for that one may still run (paused, or cut off
    from the cluster but not from the lease store). Every lease still held when the node stops
    is given back (:meth:`release_all`), after its entities and singletons stopped, so that a
    failover does not wait out the ``ttl`` while the lease store is reachable.

    Example:
        >>> async def exclusive_job(node: Node) -> None:
        ...     lease = node.leases.lease("nightly-report")
        ...     if await lease.acquire() is not None:
        ...         ...
    """

    def __init__(
        self,
        backend: LeaseBackend,
        owner: str,
        settings: LeaseSettings,
        cluster_name: str,
        nursery: trio.Nursery,
        clock: LeaseClock = TRIO_CLOCK,
    ) -> None:
        self.backend = backend
        self.owner = owner
        self.settings = settings
        self.cluster_name = cluster_name
        self.clock = clock
        """The clock this node's leases measure their deadlines on."""
        self._nursery = nursery
        self._handles: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._counters = LeaseCounters()
        attachable = node_lease_backend(backend)
        self.node_lease: NodeLease | None = None
        """The node lease every shard lease is attached to; None when the backend offers none
        (then each shard lease is renewed on its own)."""
        if attachable is not None:
            self.node_lease = NodeLease(
                attachable,
                owner,
                settings,
                nursery=nursery,
                clock=clock,
                counters=self._counters,
            )

    def lease(self, name: str) -> Lease:
        """A handle on the lease ``name``, owned by this node, kept alive in the node's nursery."""
        handle = Lease(
            self.backend,
            name,
            self.owner,
            self.settings,
            nursery=self._nursery,
            clock=self.clock,
            counters=self._counters,
        )
        self._handles.add(handle)
        return handle

    def shard_lease(self, type_name: str, shard_id: str) -> Lease | AttachedLease:
        """The lease of one shard (:meth:`shard_lease_name`), owned by this node.

        Attached to the node lease when the backend offers node leases (one renewal per node,
        not per shard; lost together), else a :class:`Lease` of its own.
        """
        name = self.shard_lease_name(type_name, shard_id)
        if self.node_lease is None:
            return self.lease(name)
        return self.node_lease.handle(name)

    def statistics(self) -> LeaseStatistics:
        """What this node's leases counted: acquisitions, renewals and their time, losses.

        Renewals of the node lease count once per keep-alive, however many shard leases are
        attached to it; losing it counts every attached shard lease lost.
        """
        return self._counters.statistics()

    def held(self) -> list[Lease | AttachedLease]:
        """The handles that hold a grant now (their deadline has not passed), by name.

        The shard leases attached to the node lease among them.
        """
        handles: list[Lease | AttachedLease] = [h for h in self._handles if h.check()]
        if self.node_lease is not None:
            handles += [h for h in self.node_lease.attached() if h.check()]
        return sorted(handles, key=lambda h: h.name)

    def abandon_all(self) -> None:
        """Forget every grant without giving it back: the process died (a simulated crash)."""
        for handle in list(self._handles):
            handle.abandon()
        if self.node_lease is not None:
            self.node_lease.abandon()

    async def release_all(self) -> int:
        """Give back every lease this node holds; returns how many the backend confirmed.

        For a stopping node, once nothing it ran under a lease runs any more. Best effort:
        all at once, each bounded by ``operation_timeout``; one that fails expires by itself.
        The node lease is revoked, which gives back every shard lease attached to it at once.
        """
        released = 0

        async def release(handle: Lease) -> None:
            nonlocal released
            try:
                if await handle.release():
                    released += 1
            except LeaseUnavailable as exc:
                logger.warning("lease %s not given back: %s", handle.name, exc)

        async def revoke(node_lease: NodeLease) -> None:
            nonlocal released
            try:
                released += await node_lease.release()
            except LeaseUnavailable as exc:
                logger.warning("node lease of %s not given back: %s", self.owner, exc)

        async with trio.open_nursery() as nursery:
            for handle in list(self._handles):
                if handle.grant is not None:
                    nursery.start_soon(release, handle)
            if self.node_lease is not None:  # one request frees every shard lease attached
                nursery.start_soon(revoke, self.node_lease)
        if released:
            logger.info("%s: gave back %d leases", self.owner, released)
        return released

    def shard_lease_name(self, type_name: str, shard_id: str) -> str:
        """The lease a shard holds: ``<cluster>-shard-<type>-<shard>`` (as Akka names it)."""
        return f"{self.cluster_name}-shard-{type_name}-{shard_id}"
