"""One lease per node, to which all of that node's shard leases are attached.

Theory of operation. With a lease per shard, a node renews each of its shard leases on its own:
a node holding 10,000 shards sends 10,000 renewals every ``renew_interval``, and one etcd keeps
only a few hundred shards alive per node. Here a node holds one *node lease* in the backend (in
etcd an etcd lease, in SQLite a heartbeat row of the owner) and keeps it alive with one request
per ``renew_interval``; each shard lease is a name *attached* to it (in etcd a key put with the
node's etcd lease, in SQLite a row that points at the heartbeat row). A shard lease is taken
name by name, with a put-if-absent that attaches the name to the node lease (a transaction), and
gets a fencing token as before (in etcd the key's ``create_revision``); it lives in the backend
exactly as long as the node lease, so it needs no renewal of its own.

The node lease is kept by the same rule as a lease of its own (:class:`~p2pshard.Lease`), decided
by the same ``KeepAliveCore`` (``p2pshard.leases._lease``; no I/O, so that tests drive it with a
clock of their own): its deadline is the time the last successful grant or keep-alive was *sent*,
plus ``ttl``, minus ``safety_margin``; the backend counts ``ttl`` from the moment it handles the
request, which is later. Every shard lease attached to it has that deadline:
:meth:`AttachedLease.check` is false from then on, so every shard stops acting at least
``safety_margin`` before the backend lets another owner take any of its names. When the node lease
is lost (a keep-alive refused, or the deadline passed without one), every attached shard lease is
lost at once; the next acquire of a shard opens a new node lease.

A name this node takes again while it still holds it (a second handle on the same shard) gets a
new token, and the handle that held it before is lost at once: it no longer renews by itself,
so it would not otherwise notice.

A backend offers node leases by implementing :class:`NodeLeaseBackend` as well as
:class:`~p2pshard.LeaseBackend` (the memory, SQLite and etcd backends do); with any other
backend each shard keeps a lease of its own, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import trio

from .._errors import LeaseUnavailable, NodeLeaseGone
from ._lease import KeepAliveCore, LeaseClock, LeaseCounters, LeaseGrant, LeaseSettings

if TYPE_CHECKING:
    from ._lease import LeaseBackend

logger = logging.getLogger("p2pshard.lease")


@runtime_checkable
class NodeLeaseBackend(Protocol):
    """A lease backend that can also attach names to one lease per owner (a node lease).

    Every method raises :class:`~p2pshard.LeaseUnavailable` when it cannot tell. A node lease
    ends (and every name attached to it is free again) when it is revoked or when ``ttl`` has
    passed since the grant or the last keep-alive, counted from a moment no earlier than the call
    began. Tokens of attached names come from the same sequence as :meth:`LeaseBackend.try_acquire`
    gives for the name: larger than every token granted for it before, either way.
    """

    async def grant_node_lease(self, owner: str, ttl: float) -> int:
        """A new node lease of ``owner`` for ``ttl`` seconds: its id."""
        ...

    async def keep_node_lease(self, owner: str, lease_id: int, ttl: float) -> bool:
        """Extend the node lease by ``ttl`` from now: False if it has ended."""
        ...

    async def revoke_node_lease(self, owner: str, lease_id: int) -> bool:
        """End the node lease and free every name attached to it: False if it had ended."""
        ...

    async def try_acquire_attached(self, name: str, owner: str, lease_id: int) -> int | None:
        """Grant ``name`` to ``owner`` for as long as its node lease lives: the new token.

        Returns None when another owner holds ``name``. ``owner`` itself holding it gets a new
        grant and token.

        Raises:
            NodeLeaseGone: the node lease has ended.
        """
        ...

    async def release_attached(self, name: str, owner: str, lease_id: int, token: int) -> bool:
        """Free ``name`` (the grant ``token`` attached to ``lease_id``): False if not held."""
        ...


class _Attachment:
    """One attached grant: its token, the node lease it lives in, and whether it is over."""

    __slots__ = ("lost", "session", "token")

    def __init__(self, session: _Session, token: int) -> None:
        self.session = session
        self.token = token
        self.lost = trio.Event()


class _Session:
    """One node lease while its keep-alive task runs, and the names attached to it."""

    def __init__(self, lease_id: int, core: KeepAliveCore) -> None:
        self.lease_id = lease_id
        self.core = core
        self.lost = trio.Event()
        self.scope = trio.CancelScope()
        self.attached: dict[str, AttachedLease] = {}


class NodeLease:
    """The node lease of one owner, and the shard leases attached to it (see the module).

    Args:
        backend: where the node lease and the names live.
        owner: the node's incarnation, as :class:`~p2pshard.Leases` names it.
        settings: ``ttl``, ``renew_interval``, ``operation_timeout`` and ``safety_margin``.
        nursery: where the keep-alive task runs.
        clock: the holder's clock.
        counters: the node's lease counters: acquisitions count per attached name, renewals per
            keep-alive of the node lease, losses per attached grant lost.
    """

    def __init__(
        self,
        backend: NodeLeaseBackend,
        owner: str,
        settings: LeaseSettings,
        *,
        nursery: trio.Nursery,
        clock: LeaseClock,
        counters: LeaseCounters,
    ) -> None:
        self.backend = backend
        self.owner = owner
        self.settings = settings
        self.clock = clock
        self.counters = counters
        self._nursery = nursery
        self._session: _Session | None = None
        self._opening = trio.Lock()
        self.grants = 0
        """Node leases granted so far (a new one after each loss)."""

    @property
    def lease_id(self) -> int | None:
        """The backend's id of the node lease held now, or None."""
        session = self._live()
        return None if session is None else session.lease_id

    def check(self) -> bool:
        """Whether the node lease is held now. Never blocks."""
        return self._live() is not None

    def attached(self) -> list[AttachedLease]:
        """The shard leases attached to the node lease held now."""
        session = self._live()
        return [] if session is None else list(session.attached.values())

    def handle(self, name: str) -> AttachedLease:
        """A handle on the lease ``name``, to be attached to this node lease when acquired."""
        return AttachedLease(self, name)

    def _live(self) -> _Session | None:
        session = self._session
        if session is None or not session.core.holds(self.clock.now()):
            return None
        return session

    async def _current(self) -> _Session:
        """The node lease held now, granted first if there is none."""
        async with self._opening:
            session = self._live()
            if session is not None:
                return session
            if self._session is not None:
                self._lose(self._session, "its deadline passed without a successful renewal")
            settings = self.settings
            sent = self.clock.now()
            with trio.move_on_after(settings.operation_timeout) as scope:
                lease_id = await self.backend.grant_node_lease(self.owner, settings.ttl)
            if scope.cancelled_caught:
                raise LeaseUnavailable(
                    f"node lease of {self.owner}: the backend did not answer a grant within "
                    f"operation_timeout ({settings.operation_timeout:g} s)"
                )
            session = self._session = _Session(lease_id, KeepAliveCore(settings, sent))
            self.grants += 1
            self._nursery.start_soon(self._keep_alive, session)
            logger.debug("node lease %d granted to %s", lease_id, self.owner)
            return session

    async def attach(self, handle: AttachedLease) -> tuple[_Attachment, LeaseGrant] | None:
        """Acquire ``handle``'s name attached to the node lease; None if another owner holds it.

        Raises:
            LeaseUnavailable: the backend did not answer in time, or failed.
        """
        settings, name = self.settings, handle.name
        session = await self._current()
        token: int | None = None
        with trio.move_on_after(settings.operation_timeout) as scope:
            try:
                token = await self.backend.try_acquire_attached(name, self.owner, session.lease_id)
            except NodeLeaseGone:
                # Ended in the backend before this holder's deadline passed: only if the backend
                # lost it (an etcd restored from a backup, a file removed). Once more, with a
                # new node lease.
                self._lose(session, "the backend no longer has it")
                session = await self._current()
                token = await self.backend.try_acquire_attached(name, self.owner, session.lease_id)
        if scope.cancelled_caught:
            raise LeaseUnavailable(
                f"lease {name!r}: the backend did not answer an acquire within "
                f"operation_timeout ({settings.operation_timeout:g} s)"
            )
        if token is None:
            return None
        if session.lost.is_set() or not session.core.holds(self.clock.now()):
            raise LeaseUnavailable(
                f"lease {name!r}: the node lease was lost while the name was acquired"
            )
        previous = session.attached.get(name)
        if previous is not None and previous is not handle:
            previous._end(lost=True)  # its grant was replaced by this newer one
            self.counters.lost += 1
        session.attached[name] = handle
        return _Attachment(session, token), LeaseGrant(
            name, self.owner, token, session.core.deadline
        )

    async def detach(self, handle: AttachedLease, attachment: _Attachment) -> bool:
        """Free ``handle``'s name in the backend: True if the backend confirmed it.

        Raises:
            LeaseUnavailable: the backend did not answer in time; the name is freed when the
                node lease ends.
        """
        session = attachment.session
        if attachment.lost.is_set() or not session.core.holds(self.clock.now()):
            return False
        timeout = self.settings.operation_timeout
        with trio.move_on_after(timeout) as scope:
            released = await self.backend.release_attached(
                handle.name, self.owner, session.lease_id, attachment.token
            )
        if scope.cancelled_caught:
            raise LeaseUnavailable(
                f"lease {handle.name!r}: the backend did not answer a release within "
                f"operation_timeout ({timeout:g} s); it is freed when the node lease ends"
            )
        return released

    async def release(self) -> int:
        """Revoke the node lease, which frees every name attached to it: how many were freed.

        For a node that stops, once nothing it ran under a lease runs any more.

        Raises:
            LeaseUnavailable: the backend did not answer in time; the names are freed when the
                node lease expires.
        """
        async with self._opening:
            session, self._session = self._session, None
            if session is None:
                return 0
            session.scope.cancel()
            held = list(session.attached.values())
            alive = not session.lost.is_set()
            for handle in held:
                handle._end(lost=False)
            session.attached.clear()
            session.core.refused()
            session.lost.set()
            if not alive:
                return 0
            timeout = self.settings.operation_timeout
            with trio.move_on_after(timeout) as scope:
                revoked = await self.backend.revoke_node_lease(self.owner, session.lease_id)
            if scope.cancelled_caught:
                raise LeaseUnavailable(
                    f"node lease of {self.owner}: the backend did not answer a revoke within "
                    f"operation_timeout ({timeout:g} s); its {len(held)} names are freed when "
                    "it expires"
                )
            return len(held) if revoked else 0

    def abandon(self) -> None:
        """Forget the node lease without revoking it (the process died): it expires by itself."""
        session, self._session = self._session, None
        if session is not None:
            session.scope.cancel()
            for handle in list(session.attached.values()):
                handle._end(lost=True)
            session.attached.clear()
            session.core.refused()
            session.lost.set()

    def _lose(self, session: _Session, reason: str) -> None:
        if session.lost.is_set():
            return
        session.core.refused()
        session.scope.cancel()
        handles = list(session.attached.values())
        session.attached.clear()
        for handle in handles:
            handle._end(lost=True)
        self.counters.lost += len(handles)
        session.lost.set()
        if self._session is session:
            self._session = None
        logger.warning(
            "node lease %d of %s lost with the %d shard leases attached to it: %s",
            session.lease_id,
            self.owner,
            len(handles),
            reason,
        )

    async def _keep_alive(self, session: _Session) -> None:
        settings, clock, counters, core = self.settings, self.clock, self.counters, session.core
        reason = "its deadline passed without a successful renewal"
        with session.scope:
            while True:
                # As in Lease: readings become trio times only to sleep, and both readings
                # decide whether the deadline passed (a skewed clock's conversion rounds).
                await trio.sleep_until(clock.trio_time(core.wake_at()))
                sent = clock.now()
                if core.due(sent) == "lost" or trio.current_time() >= clock.trio_time(
                    core.deadline
                ):
                    break
                renewed: bool | None = None
                with trio.move_on_at(clock.trio_time(core.give_up_at(sent))):
                    try:
                        renewed = await self.backend.keep_node_lease(
                            self.owner, session.lease_id, settings.ttl
                        )
                    except LeaseUnavailable as exc:
                        logger.warning("node lease of %s: renewal failed: %s", self.owner, exc)
                    except Exception:  # a backend bug must not take the node down
                        logger.exception("node lease of %s: renewal failed", self.owner)
                if renewed is None:
                    counters.renewals["failed"] += 1
                    core.failed(clock.now())
                    continue
                if not renewed:
                    counters.renewals["refused"] += 1
                    reason = "the backend refused the renewal (it expired)"
                    break
                counters.renewals["renewed"] += 1
                counters.renewal_seconds.observe(clock.now() - sent)
                core.renewed(sent)
        # Cancelled only by whoever ended the session already (a release, a loss, a crash).
        self._lose(session, reason)


class AttachedLease:
    """A shard's lease attached to its node's lease (:class:`NodeLease`); a ``ShardLease``.

    Acquired name by name; kept alive by the node lease; lost with it.
    """

    def __init__(self, node: NodeLease, name: str) -> None:
        self.node = node
        self.name = name
        self.owner = node.owner
        self.counters = node.counters
        self._held: _Attachment | None = None
        self._grant: LeaseGrant | None = None
        self._lock = trio.Lock()

    @property
    def grant(self) -> LeaseGrant | None:
        """The current grant, with the node lease's current deadline, or None."""
        held, grant = self._held, self._grant
        if held is None or grant is None:
            return None
        return attrs.evolve(grant, deadline=held.session.core.deadline)

    @property
    def token(self) -> int | None:
        """The fencing token of the current grant, or None."""
        held = self._held
        return None if held is None else held.token

    def check(self) -> bool:
        """Whether the lease is held now: granted, and the node lease held. Never blocks."""
        held = self._held
        return (
            held is not None
            and not held.lost.is_set()
            and held.session.core.holds(self.node.clock.now())
        )

    async def acquire(self) -> LeaseGrant | None:
        """Take the lease attached to the node lease (granted first if needed); see ``Lease``.

        Raises:
            LeaseUnavailable: the backend did not answer within ``operation_timeout``, or failed.
        """
        async with self._lock:
            if self.check():
                return self.grant
            self._end(lost=True)
            counts = self.counters.acquisitions
            try:
                outcome = await self.node.attach(self)
            except LeaseUnavailable:
                counts["unavailable"] += 1
                raise
            if outcome is None:
                counts["refused"] += 1
                return None
            counts["granted"] += 1
            self._held, self._grant = outcome
            logger.debug("lease %s granted to %s with token %d", self.name, self.owner, self.token)
            return self._grant

    async def wait_lost(self) -> None:
        """Return when the current grant is lost (at once if none is held)."""
        held = self._held
        if held is not None:
            await held.lost.wait()

    async def release(self) -> bool:
        """Give the name back (the node lease stays): True if the backend confirmed it.

        Raises:
            LeaseUnavailable: the backend did not answer; the name is freed with the node lease.
        """
        async with self._lock:
            held = self._held
            if held is None:
                return False
            self._end(lost=False)
            return await self.node.detach(self, held)

    def abandon(self) -> None:
        """Forget the grant without giving it back (it ends with the node lease)."""
        self._end(lost=True)

    def _end(self, *, lost: bool) -> None:
        """Forget the grant: ``lost``, or given back.

        A loss wakes whoever waits in :meth:`wait_lost`; a release does not (as with
        ``Lease.release``: the holder gave it up itself).
        """
        held = self._held
        if held is None:
            return
        self._held = self._grant = None
        if held.session.attached.get(self.name) is self:
            del held.session.attached[self.name]
        if lost:
            held.lost.set()


def node_lease_backend(backend: LeaseBackend) -> NodeLeaseBackend | None:
    """``backend`` as a :class:`NodeLeaseBackend`, or None if it offers no node leases."""
    return backend if isinstance(backend, NodeLeaseBackend) else None
