"""The lease conformance kit: what every :class:`p2pshard.LeaseBackend` must give a Lease.

:func:`check_lease_backend` runs the same checks over any backend, so a backend written by a
user is held to the promises the bundled ones keep (memory, SQLite, etcd): one holder at a time
among concurrent acquirers; expiry and take-over with a larger token; renewal past the TTL;
tokens that only grow; release by the holder only; and, given a way to cut a holder off from the
backend, a holder that sees "lost" and never believes it holds the lease at a moment when
another owner could already have acquired it.

The checks run on the real clock with short leases (:data:`KIT_LEASE_SETTINGS`: a 2 s TTL), so
each takes a few seconds. Each check uses a new backend from the factory and lease names no
other check uses, so one storage (an etcd, a database) can serve all of them. With
``attached=True`` the same checks run on shard leases attached to a node lease of each owner
(``p2pshard.leases._node_lease``), for a backend that offers node leases.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextlib import AbstractContextManager

import attrs
import trio

from .._errors import LeaseUnavailable
from ..leases import Lease, LeaseBackend, LeaseSettings
from ..leases._lease import TRIO_CLOCK, LeaseCounters
from ..leases._node_lease import AttachedLease, NodeLease, node_lease_backend
from ._expect import expect_raises

KIT_LEASE_SETTINGS = LeaseSettings(
    ttl=2.0, renew_interval=0.3, operation_timeout=1.0, safety_margin=0.3
)
"""The lease settings of the kit's checks: expiry within seconds (etcd's smallest TTL is 1 s)."""

CutOff = Callable[[LeaseBackend, str], AbstractContextManager[None]]
"""``cut_off(backend, owner)``: inside it, ``backend`` does not answer ``owner``'s calls."""

_names = itertools.count()


@attrs.frozen
class _Run:
    backend: LeaseBackend
    settings: LeaseSettings
    cut_off: CutOff | None
    attached: bool = False
    node_leases: list[tuple[str, trio.Nursery, NodeLease]] = attrs.field(factory=list)

    @staticmethod
    def fresh_name() -> str:
        return f"conformance-{os.getpid()}-{next(_names)}"

    def lease(self, name: str, owner: str, nursery: trio.Nursery) -> Lease | AttachedLease:
        """A lease of its own, or one attached to the node lease of ``owner`` in ``nursery``.

        The node lease's keep-alive runs in ``nursery``, and dies with it.
        """
        if not self.attached:
            return Lease(self.backend, name, owner, self.settings, nursery=nursery)
        for known_owner, known_nursery, node in self.node_leases:
            if known_owner == owner and known_nursery is nursery:
                return node.handle(name)
        backend = node_lease_backend(self.backend)
        assert backend is not None, f"{type(self.backend).__name__} offers no node leases"
        node = NodeLease(
            backend,
            owner,
            self.settings,
            nursery=nursery,
            clock=TRIO_CLOCK,
            counters=LeaseCounters(),
        )
        self.node_leases.append((owner, nursery, node))
        return node.handle(name)


async def _one_of_many_concurrent_acquirers_gets_the_lease(run: _Run) -> None:
    name, backend = run.fresh_name(), run.backend
    grants: dict[str, int | None] = {}
    async with trio.open_nursery() as nursery:
        leases = [run.lease(name, f"owner-{i}", nursery) for i in range(12)]

        async def try_once(lease: Lease | AttachedLease) -> None:
            grant = await lease.acquire()
            grants[lease.owner] = None if grant is None else grant.token

        async with trio.open_nursery() as racers:
            for lease in leases:
                racers.start_soon(try_once, lease)
        winners = [owner for owner, token in grants.items() if token is not None]
        assert len(winners) == 1, grants
        assert [lease.owner for lease in leases if lease.check()] == winners
        assert await backend.holder(name) == (winners[0], grants[winners[0]])
        nursery.cancel_scope.cancel()


async def _an_abandoned_lease_expires_and_is_taken_over_with_a_larger_token(run: _Run) -> None:
    name, settings = run.fresh_name(), run.settings
    async with trio.open_nursery() as nursery:
        taker = run.lease(name, "taker", nursery)
        async with trio.open_nursery() as crashed:  # its keep-alive dies with this nursery
            first = await run.lease(name, "crashed", crashed).acquire()
            assert first is not None
            crashed.cancel_scope.cancel()
        abandoned = time.monotonic()
        assert await taker.acquire() is None  # still held: not yet expired
        with trio.fail_after(settings.ttl * 3 + 2):
            while (second := await taker.acquire()) is None:  # noqa: ASYNC110 - polls
                await trio.sleep(0.05)
        assert time.monotonic() - abandoned >= settings.ttl - 0.5
        assert second.token > first.token
        assert taker.check()
        nursery.cancel_scope.cancel()


async def _a_held_lease_is_renewed_past_its_ttl(run: _Run) -> None:
    name, settings = run.fresh_name(), run.settings
    async with trio.open_nursery() as nursery:
        holder = run.lease(name, "holder", nursery)
        other = run.lease(name, "other", nursery)
        grant = await holder.acquire()
        assert grant is not None
        await trio.sleep(settings.ttl * 2)
        assert holder.check()
        assert await other.acquire() is None
        assert holder.grant is not None
        assert holder.grant.token == grant.token
        assert holder.grant.deadline > grant.deadline  # moved with the renewals
        nursery.cancel_scope.cancel()


async def _tokens_only_grow_across_grants_and_releases(run: _Run) -> None:
    name = run.fresh_name()
    tokens = []
    async with trio.open_nursery() as nursery:
        owners = [run.lease(name, f"o{i}", nursery) for i in range(3)]
        for lease in owners * 3:
            grant = await lease.acquire()
            assert grant is not None
            tokens.append(grant.token)
            assert await lease.release()
        again = await owners[0].acquire()  # the same owner twice in a row: a new token too
        assert again is not None
        assert await owners[0].release()
        last = await owners[0].acquire()
        assert last is not None
        assert last.token > again.token
        nursery.cancel_scope.cancel()
    assert tokens == sorted(set(tokens))


async def _release_frees_the_lease_at_once_and_only_for_its_holder(run: _Run) -> None:
    name, backend = run.fresh_name(), run.backend
    async with trio.open_nursery() as nursery:
        a = run.lease(name, "a", nursery)
        b = run.lease(name, "b", nursery)
        grant = await a.acquire()
        assert grant is not None
        assert not await b.release()  # b holds nothing
        assert not await backend.release(name, "b", grant.token)  # not b's to release
        assert await backend.holder(name) == ("a", grant.token)
        assert await a.release()
        assert not a.check()
        assert not await a.release()  # twice: nothing held any more
        assert await backend.holder(name) is None
        taken = await b.acquire()
        assert taken is not None
        assert taken.token > grant.token
        nursery.cancel_scope.cancel()


async def _a_holder_cut_off_from_the_backend_sees_lost_before_anyone_else_can_acquire(
    run: _Run,
) -> None:
    name, backend, settings = run.fresh_name(), run.backend, run.settings
    assert run.cut_off is not None
    async with trio.open_nursery() as nursery:
        holder = run.lease(name, "holder", nursery)
        grant = await holder.acquire()
        assert grant is not None
        with run.cut_off(backend, "holder"):
            with trio.fail_after(settings.ttl + 2):
                await holder.wait_lost()
            lost_at = time.monotonic()
            assert not holder.check()
            with expect_raises(LeaseUnavailable):
                await holder.acquire()
        # Back in touch: another owner gets it only after the holder had let go.
        other = run.lease(name, "other", nursery)
        with trio.fail_after(settings.ttl * 3 + 2):
            while True:
                sent = time.monotonic()
                taken = await other.acquire()
                if taken is not None:
                    break
                await trio.sleep(0.02)
        assert lost_at <= sent
        assert taken.token > grant.token
        nursery.cancel_scope.cancel()


async def _a_holder_never_believes_it_holds_after_another_could_acquire(run: _Run) -> None:
    # Renewals get slower and then stop; a rival polls all the while. Every moment the holder's
    # check() said True must come before the send time of the rival's successful acquire.
    name, backend, settings = run.fresh_name(), run.backend, run.settings
    assert run.cut_off is not None
    believed: list[float] = []
    rival_sent: list[float] = []
    async with trio.open_nursery() as nursery:
        holder = run.lease(name, "holder", nursery)
        rival = run.lease(name, "rival", nursery)
        assert await holder.acquire() is not None

        async def watch_holder() -> None:
            while True:
                if holder.check():
                    believed.append(time.monotonic())
                await trio.sleep(0.005)

        async def poll_rival() -> None:
            while True:
                sent = time.monotonic()
                try:
                    if await rival.acquire() is not None:
                        rival_sent.append(sent)
                        return
                except LeaseUnavailable:
                    pass
                await trio.sleep(0.01)

        nursery.start_soon(watch_holder)
        await trio.sleep(settings.renew_interval * 3)
        with trio.fail_after(settings.ttl * 4 + 5):
            with run.cut_off(backend, "holder"):
                await holder.wait_lost()
            await poll_rival()
        nursery.cancel_scope.cancel()
    assert believed
    assert max(believed) < rival_sent[0]


_CHECKS: Mapping[str, Callable[[_Run], Awaitable[None]]] = {
    "one_of_many_concurrent_acquirers_gets_the_lease": (
        _one_of_many_concurrent_acquirers_gets_the_lease
    ),
    "an_abandoned_lease_expires_and_is_taken_over_with_a_larger_token": (
        _an_abandoned_lease_expires_and_is_taken_over_with_a_larger_token
    ),
    "a_held_lease_is_renewed_past_its_ttl": _a_held_lease_is_renewed_past_its_ttl,
    "tokens_only_grow_across_grants_and_releases": _tokens_only_grow_across_grants_and_releases,
    "release_frees_the_lease_at_once_and_only_for_its_holder": (
        _release_frees_the_lease_at_once_and_only_for_its_holder
    ),
    "a_holder_cut_off_from_the_backend_sees_lost_before_anyone_else_can_acquire": (
        _a_holder_cut_off_from_the_backend_sees_lost_before_anyone_else_can_acquire
    ),
    "a_holder_never_believes_it_holds_after_another_could_acquire": (
        _a_holder_never_believes_it_holds_after_another_could_acquire
    ),
}
_NEED_CUT_OFF = frozenset(
    {
        "a_holder_cut_off_from_the_backend_sees_lost_before_anyone_else_can_acquire",
        "a_holder_never_believes_it_holds_after_another_could_acquire",
    }
)

LEASE_CHECKS: tuple[str, ...] = tuple(_CHECKS)
"""The names of :func:`check_lease_backend`'s checks, in the order it runs them."""


async def check_lease_backend(
    make_backend: Callable[[], LeaseBackend],
    *,
    cut_off: CutOff | None = None,
    checks: Collection[str] | None = None,
    settings: LeaseSettings = KIT_LEASE_SETTINGS,
    attached: bool = False,
) -> None:
    """Check that a lease backend keeps the promises :class:`p2pshard.Lease` relies on.

    Each check gets a new backend from ``make_backend``, drives :class:`~p2pshard.Lease`
    objects against it on the real clock, and closes it at the end. A broken promise raises
    :class:`AssertionError` (or the backend's own error) saying what went wrong.

    Args:
        make_backend: makes a backend; backends it makes share their storage or not, as the
            kit only uses one at a time.
        cut_off: ``cut_off(backend, owner)`` returns a context manager inside which
            ``backend`` does not answer (for the memory backend, ``backend.cut_off(owner)``;
            for a server, pause it). Without it the two checks that need it are left out:
            the most important promise, that a holder cut off never believes it holds the lease
            after another owner could take it, is then not checked.
        checks: the names (from :data:`LEASE_CHECKS`) of the checks to run; all by default.
        settings: the lease settings of the checks; short TTLs keep the kit quick.
        attached: check shard leases attached to a node lease of each owner instead of leases
            of their own (the backend must offer node leases).

    Raises:
        AssertionError: the backend broke a promise.
        ValueError: a name in ``checks`` is unknown, or needs ``cut_off`` and none was given.

    Example:
        >>> import trio
        >>> from p2pshard import MemoryLeaseBackend
        >>> from p2pshard.testing import check_lease_backend
        >>> trio.run(check_lease_backend, MemoryLeaseBackend)  # doctest: +SKIP
    """
    if checks is None:
        names = [n for n in LEASE_CHECKS if cut_off is not None or n not in _NEED_CUT_OFF]
    else:
        names = list(checks)
        unknown = [n for n in names if n not in _CHECKS]
        if unknown:
            raise ValueError(f"unknown lease checks {unknown}: the names are {list(LEASE_CHECKS)}")
        if cut_off is None and (needy := [n for n in names if n in _NEED_CUT_OFF]):
            raise ValueError(f"the lease checks {needy} need cut_off: pass one, or leave them out")
    for name in names:
        backend = make_backend()
        try:
            await _CHECKS[name](_Run(backend, settings, cut_off, attached))
        finally:
            with trio.CancelScope(shield=True):
                await backend.aclose()
