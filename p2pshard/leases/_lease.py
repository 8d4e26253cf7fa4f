"""Leases with fencing tokens: one owner at a time per name, kept alive in the background.

Theory of operation. A :class:`Lease` is one owner's handle on a lease name in a
:class:`LeaseBackend` (SQLite, etcd, or in memory). :meth:`Lease.acquire` asks the backend for the
name; a grant carries a fencing token that is larger than every token granted for that name
before, so a store that remembers the largest token it has seen can refuse a write from a holder
that lost the lease without knowing it (a paused process, a partitioned node). Akka's lease has
no such token.

After a grant a task renews the lease every ``renew_interval``. The holder's *deadline* is
computed on this process's clock: the time the last successful request was **sent**, plus
``ttl``, minus ``safety_margin``. The backend counts ``ttl`` from the moment it handles the
request, which is later, so the holder stops believing it holds the lease before the backend lets
anyone else take it, by at least ``safety_margin`` (room for clocks that run at slightly
different rates). :meth:`Lease.check` never blocks: it compares the clock with that deadline, so a
process that was paused past it sees False at once when it wakes, before its keep-alive task runs.
The holder's clock is a :class:`LeaseClock`: trio's by default; the simulated cluster gives each
node one that runs faster or slower, to test that ``safety_margin`` covers clocks that disagree.

The lease is *lost* when a renewal is refused (someone else holds it, or it expired), or when the
deadline passes because the backend did not answer in time; :meth:`Lease.wait_lost` returns then.
A failed renewal is retried every quarter ``renew_interval`` until the deadline. An answer that
could not be had within ``operation_timeout`` raises :class:`LeaseUnavailable`: the outcome is
unknown, which is not the same as a refusal (``acquire`` returns None for that).

A shard of an entity type started with ``ShardingSettings(use_lease=True)`` holds the lease
``<cluster>-shard-<type>-<shard>`` while its entities run (see ``p2pshard.sharding._shard``); the
coordinator singleton and the lease-majority downing strategy can hold one too. With a backend
that offers node leases (all bundled ones do), a shard's lease is not renewed on its own: it is
attached to one lease per node, kept alive by the same rule, and lost with it (see
``p2pshard.leases._node_lease``); ``Leases.shard_lease`` (``p2pshard.leases._leases``) makes
those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import trio

from membership import ConfigurationError, HeldLease, HistogramSnapshot, LatencyHistogram
from membership.internal import in_range

from .._errors import LeaseUnavailable
from .._ids import ShardId

logger = logging.getLogger("p2pshard.lease")

RETRY_FRACTION = 0.25
"""A failed renewal is retried after this fraction of ``renew_interval``."""


def _invalid(instance: Any, attribute: attrs.Attribute[Any], value: Any, allowed: str) -> None:
    raise ConfigurationError(
        f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be {allowed}"
    )


def _check_backend(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in (None, "sqlite", "etcd"):
        _invalid(instance, attribute, value, "'sqlite', 'etcd' or None")


def _check_path(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, Path) or not str(value)):
        _invalid(instance, attribute, value, "a path or None")


def _check_endpoints(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(url, str) and url.startswith(("http://", "https://")) for url in value
    ):
        _invalid(instance, attribute, value, "a tuple of http:// or https:// URLs")


@attrs.frozen(kw_only=True)
class LeaseSettings:
    """Where a node's leases live and how they are kept alive (the ``[lease]`` table).

    ``backend`` None (default) means the node has no lease backend: entity types with
    ``use_lease``, singletons with a lease and the lease-majority strategy are then refused at
    start. ``"sqlite"`` keeps leases in the file ``path``, shared by every node on one host;
    ``"etcd"`` keeps them in an etcd cluster reached at ``endpoints`` (multi-host).
    """

    backend: Literal["sqlite", "etcd"] | None = attrs.field(default=None, validator=_check_backend)
    """``"sqlite"``, ``"etcd"`` or None (default: no leases)."""

    path: Path | None = attrs.field(default=None, validator=_check_path)
    """sqlite: the database file every node on the host shares."""

    endpoints: tuple[str, ...] = attrs.field(default=(), validator=_check_endpoints)
    """etcd: client URLs such as ``http://127.0.0.1:2379``; tried in order."""

    ttl: float = attrs.field(default=15.0, validator=in_range(0.1, 3600.0))
    """Seconds a grant or renewal is valid in the backend (default 15; Akka's heartbeat-timeout).
    etcd counts whole seconds: it is rounded up there."""

    renew_interval: float = attrs.field(default=3.0, validator=in_range(0.01, 1800.0))
    """Seconds between renewals (default 3); must be under ``ttl / 2``, and
    ``renew_interval + operation_timeout`` under ``ttl - safety_margin`` (room for one retry)."""

    operation_timeout: float = attrs.field(default=5.0, validator=in_range(0.01, 3600.0))
    """Seconds an acquire, renewal or release may take before it counts as failed (default 5);
    must be under ``ttl - safety_margin``."""

    safety_margin: float = attrs.field(default=1.0, validator=in_range(0.0, 1800.0))
    """Seconds the holder stops believing it holds the lease before the backend could grant it
    to another owner (default 1): room for clock rate differences."""

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.renew_interval >= self.ttl / 2:
            raise ConfigurationError(
                f"{name}.renew_interval = {self.renew_interval!r} is invalid: must be under "
                f"ttl / 2 = {self.ttl / 2:g}, so that a lost renewal can be retried in time"
            )
        if self.safety_margin >= self.ttl / 2:
            raise ConfigurationError(
                f"{name}.safety_margin = {self.safety_margin!r} is invalid: must be under "
                f"ttl / 2 = {self.ttl / 2:g}"
            )
        if self.operation_timeout >= self.ttl - self.safety_margin:
            raise ConfigurationError(
                f"{name}.operation_timeout = {self.operation_timeout!r} is invalid: must be "
                f"under ttl - safety_margin = {self.ttl - self.safety_margin:g}, or a grant "
                "could arrive already expired"
            )
        room = self.ttl - self.safety_margin - self.operation_timeout
        if self.renew_interval >= room:
            raise ConfigurationError(
                f"{name}.renew_interval = {self.renew_interval!r} is invalid with "
                f"operation_timeout = {self.operation_timeout!r}: renew_interval + "
                f"operation_timeout must be under ttl - safety_margin = "
                f"{self.ttl - self.safety_margin:g}, so that a renewal that timed out is tried "
                "again before the holder's deadline (else one slow answer of the backend stops "
                "every shard holding a lease); shorten either, or lengthen ttl"
            )
        if self.backend == "sqlite" and self.path is None:
            raise ConfigurationError(
                f"{name}.path is missing: backend 'sqlite' needs the database file every node "
                "on the host shares"
            )
        if self.backend == "etcd" and not self.endpoints:
            raise ConfigurationError(
                f"{name}.endpoints is empty: backend 'etcd' needs at least one client URL "
                "such as 'http://127.0.0.1:2379'"
            )


@attrs.frozen
class LeaseGrant:
    """A granted lease: the name, its owner, the fencing token and the holder's deadline."""

    name: str
    owner: str
    token: int
    """Larger than every token granted for ``name`` before: fences the holder's writes."""
    deadline: float
    """Time on the holder's :class:`LeaseClock` (trio's by default) after which the holder must
    not act on this grant any more."""


class LeaseBackend(Protocol):
    """Where leases live. Every method raises :class:`LeaseUnavailable` when it cannot tell.

    A backend counts ``ttl`` from a moment no earlier than the call began, on a clock that runs
    at the rate of the callers' clocks; the holder's deadline relies on that.
    """

    async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """Grant ``name`` to ``owner`` for ``ttl`` seconds: a new token larger than all before.

        Returns None when another owner holds an unexpired grant. ``owner`` itself holding it
        (an earlier grant it lost track of) gets a new grant and token.
        """
        ...

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        """Extend the grant ``token`` by ``ttl`` from now: False if it is no longer held."""
        ...

    async def release(self, name: str, owner: str, token: int) -> bool:
        """End the grant ``token`` so that others may acquire: False if it was not held."""
        ...

    async def holder(self, name: str) -> tuple[str, int] | None:
        """The owner and token of the unexpired grant of ``name``, if any (for inspection)."""
        ...

    async def aclose(self) -> None:
        """Close connections; leases held stay in the backend until they expire."""
        ...


class LeaseClock(Protocol):
    """The clock a lease holder measures its deadline on.

    ``now`` reads it; ``trio_time`` converts one of its readings into the trio time at which it
    will read that, for sleeping until it. Trio's own clock (:data:`TRIO_CLOCK`) is the
    default; a test may give a node one that runs at another rate.
    """

    def now(self) -> float:
        """The current reading."""
        ...

    def trio_time(self, reading: float) -> float:
        """When, on the trio clock, this clock will read ``reading`` (at its current rate)."""
        ...


class _TrioClock:
    """Trio's clock as a :class:`LeaseClock`."""

    def now(self) -> float:
        return trio.current_time()

    def trio_time(self, reading: float) -> float:
        return reading


TRIO_CLOCK: LeaseClock = _TrioClock()
"""The default :class:`LeaseClock`: ``trio.current_time()``."""


@attrs.frozen(kw_only=True)
class LeaseStatistics:
    """What a node's leases counted (see ``Leases.statistics``).

    Attributes:
        acquisitions: ``acquire`` calls by outcome: ``granted``, ``refused`` (another owner
            holds it), ``unavailable`` (the backend did not answer or failed).
        renewals: renewals by outcome: ``renewed``, ``refused`` (expired or taken over: the
            lease is lost), ``failed`` (no answer in time, or an error; tried again).
        renewal_seconds: seconds each successful renewal took, from sending it to the answer.
        lost: grants lost while held (a refused renewal, or the deadline passed); a release or
            a crash is not a loss.
    """

    acquisitions: dict[str, int]
    renewals: dict[str, int]
    renewal_seconds: HistogramSnapshot
    lost: int


class LeaseCounters:
    """Counters the leases of one node share, bumped as they acquire, renew and lose."""

    __slots__ = ("acquisitions", "lost", "renewal_seconds", "renewals")

    def __init__(self) -> None:
        self.acquisitions = dict.fromkeys(("granted", "refused", "unavailable"), 0)
        self.renewals = dict.fromkeys(("renewed", "refused", "failed"), 0)
        self.renewal_seconds = LatencyHistogram()
        self.lost = 0

    def statistics(self) -> LeaseStatistics:
        """A frozen snapshot."""
        return LeaseStatistics(
            acquisitions=dict(self.acquisitions),
            renewals=dict(self.renewals),
            renewal_seconds=self.renewal_seconds.snapshot(),
            lost=self.lost,
        )


Action = Literal["renew", "lost"]


class KeepAliveCore:
    """The renewal and expiry decisions of one lease (no I/O; times are holder clock readings).

    Made when the grant request sent at ``sent`` succeeded; then at each :meth:`wake_at` the
    driver asks :meth:`due`: ``"lost"`` when the deadline has passed, else ``"renew"``; it
    reports the renewal as :meth:`renewed` (with the time it was sent), :meth:`failed` (no
    answer: tried again after a quarter of ``renew_interval``, until the deadline) or
    :meth:`refused` (the lease has ended).
    """

    __slots__ = ("deadline", "lost", "renew_at", "settings")

    def __init__(self, settings: LeaseSettings, sent: float) -> None:
        self.settings = settings
        self.deadline = -math.inf
        """Holder time from which the holder must not act under the lease any more."""
        self.renew_at = sent
        self.lost = False
        self.renewed(sent)

    def holds(self, now: float) -> bool:
        """Whether the lease is held at ``now``."""
        return not self.lost and now < self.deadline

    def wake_at(self) -> float:
        """When the driver should next call :meth:`due`."""
        return min(self.renew_at, self.deadline)

    def due(self, now: float) -> Action:
        """What to do at ``now``: renew, or give up because the deadline passed."""
        if self.lost or now >= self.deadline:
            self.lost = True
            return "lost"
        return "renew"

    def give_up_at(self, sent: float) -> float:
        """The latest a renewal sent at ``sent`` may take: the timeout, or the deadline."""
        return min(sent + self.settings.operation_timeout, self.deadline)

    def renewed(self, sent: float) -> None:
        """A renewal (or the grant) sent at ``sent`` succeeded: the deadline moves on."""
        settings = self.settings
        self.deadline = max(self.deadline, sent + settings.ttl - settings.safety_margin)
        self.renew_at = sent + settings.renew_interval

    def failed(self, now: float) -> None:
        """A renewal had no answer at ``now``: try again soon."""
        self.renew_at = now + self.settings.renew_interval * RETRY_FRACTION

    def refused(self) -> None:
        """The lease has ended (the backend said so, or the holder gave it up)."""
        self.lost = True


class _Held:
    """One grant while its keep-alive task runs, and its renewal decisions."""

    def __init__(self, grant: LeaseGrant, core: KeepAliveCore) -> None:
        self.grant = grant
        self.core = core
        self.lost = trio.Event()
        self.scope = trio.CancelScope()


class Lease:
    """One owner's handle on the lease ``name`` in ``backend``; renewals run in ``nursery``.

    Example:
        >>> async def run_fenced(backend: LeaseBackend, nursery: trio.Nursery) -> None:
        ...     lease = Lease(backend, "orders-writer", "node-1", nursery=nursery)
        ...     grant = await lease.acquire()
        ...     if grant is not None:
        ...         while lease.check():
        ...             await write_with_token(grant.token)
        ...         await lease.release()
    """

    def __init__(
        self,
        backend: LeaseBackend,
        name: str,
        owner: str,
        settings: LeaseSettings | None = None,
        *,
        nursery: trio.Nursery,
        clock: LeaseClock = TRIO_CLOCK,
        counters: LeaseCounters | None = None,
    ) -> None:
        for what, value in (("name", name), ("owner", owner)):
            if not isinstance(value, str) or not value or len(value) > 512:
                raise ConfigurationError(
                    f"lease {what} {value!r} is invalid: must be a non-empty string of at most "
                    "512 characters"
                )
        self.backend = backend
        self.name = name
        self.owner = owner
        self.settings = settings if settings is not None else LeaseSettings()
        self.clock = clock
        self._nursery = nursery
        self._held: _Held | None = None
        self._lock = trio.Lock()
        self.counters = LeaseCounters() if counters is None else counters
        """Where this handle counts its acquisitions, renewals and losses (its node's)."""

    @property
    def grant(self) -> LeaseGrant | None:
        """The current grant (its deadline moves with each renewal), or None."""
        return None if self._held is None else self._held.grant

    @property
    def token(self) -> int | None:
        """The fencing token of the current grant, or None."""
        return None if self._held is None else self._held.grant.token

    def check(self) -> bool:
        """Whether the lease is held now: a grant whose deadline has not passed. Never blocks."""
        held = self._held
        return (
            held is not None and not held.lost.is_set() and self.clock.now() < held.grant.deadline
        )

    async def acquire(self) -> LeaseGrant | None:
        """Take the lease and keep it alive: the grant, or None when another owner holds it.

        Returns the current grant if it is still held.

        Raises:
            LeaseUnavailable: the backend did not answer within ``operation_timeout``, or failed.
        """
        async with self._lock:
            if self.check():
                assert self._held is not None
                return self._held.grant
            self._forget()
            settings = self.settings
            sent = self.clock.now()
            counts = self.counters.acquisitions
            with trio.move_on_after(settings.operation_timeout) as scope:
                try:
                    token = await self.backend.try_acquire(self.name, self.owner, settings.ttl)
                except LeaseUnavailable:
                    counts["unavailable"] += 1
                    raise
            if scope.cancelled_caught:
                counts["unavailable"] += 1
                raise LeaseUnavailable(
                    f"lease {self.name!r}: the backend did not answer an acquire within "
                    f"operation_timeout ({settings.operation_timeout:g} s)"
                )
            if token is None:
                counts["refused"] += 1
                return None
            counts["granted"] += 1
            core = KeepAliveCore(settings, sent)
            grant = LeaseGrant(self.name, self.owner, token, core.deadline)
            held = self._held = _Held(grant, core)
            self._nursery.start_soon(self._keep_alive, held)
            logger.debug("lease %s granted to %s with token %d", self.name, self.owner, token)
            return grant

    async def wait_lost(self) -> None:
        """Return when the current grant is lost (at once if none is held)."""
        held = self._held
        if held is not None:
            await held.lost.wait()

    async def release(self) -> bool:
        """Stop renewing and give the lease back: True if the backend confirmed it.

        Raises:
            LeaseUnavailable: the backend did not answer; the lease expires by itself.
        """
        async with self._lock:
            held, self._held = self._held, None
            if held is None:
                return False
            held.scope.cancel()
            if held.lost.is_set():
                return False
            with trio.move_on_after(self.settings.operation_timeout) as scope:
                released = await self.backend.release(self.name, self.owner, held.grant.token)
            if scope.cancelled_caught:
                raise LeaseUnavailable(
                    f"lease {self.name!r}: the backend did not answer a release within "
                    f"operation_timeout ({self.settings.operation_timeout:g} s); it expires "
                    "by itself"
                )
            return released

    def abandon(self) -> None:
        """Stop renewing and forget the grant without giving it back (it expires by itself).

        What a process that dies does; the simulated cluster's crash fault uses it.
        """
        self._forget()

    def _forget(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.scope.cancel()
            held.lost.set()

    async def _keep_alive(self, held: _Held) -> None:
        settings, clock, counters, core = self.settings, self.clock, self.counters, held.core
        reason = "its deadline passed without a successful renewal"
        with held.scope:
            while True:
                # Readings of this lease's clock become trio times only to sleep: a clock whose
                # rate changed meanwhile wakes this early or late, and the loop reads it again.
                await trio.sleep_until(clock.trio_time(core.wake_at()))
                sent = clock.now()
                # Both readings: a skewed clock's conversion rounds, and after sleeping until
                # the trio time of the deadline it may still read a hair below it. Then every
                # renewal below would be cancelled at once, in a loop that never sleeps.
                if core.due(sent) == "lost" or trio.current_time() >= clock.trio_time(
                    core.deadline
                ):
                    break
                renewed: bool | None = None
                with trio.move_on_at(clock.trio_time(core.give_up_at(sent))):
                    try:
                        renewed = await self.backend.renew(
                            self.name, self.owner, held.grant.token, settings.ttl
                        )
                    except LeaseUnavailable as exc:
                        logger.warning("lease %s: renewal failed: %s", self.name, exc)
                    except Exception:  # a backend bug must not take the node down
                        logger.exception("lease %s: renewal failed", self.name)
                if renewed is None:  # unknown: try again soon, until the deadline
                    counters.renewals["failed"] += 1
                    core.failed(clock.now())
                    continue
                if not renewed:
                    counters.renewals["refused"] += 1
                    reason = "the backend refused the renewal (expired or taken over)"
                    break
                counters.renewals["renewed"] += 1
                counters.renewal_seconds.observe(clock.now() - sent)
                core.renewed(sent)
                held.grant = attrs.evolve(held.grant, deadline=core.deadline)
            logger.warning("lease %s of %s lost: %s", self.name, self.owner, reason)
            counters.lost += 1
            held.lost.set()


ShardLease = HeldLease
"""What a shard needs of its lease (membership's :class:`~membership.HeldLease`); :class:`Lease`
is one."""


ShardLeaseFactory = Callable[[str, ShardId], ShardLease]
"""Makes the lease of one shard from the entity type name and the shard id."""
