"""One lease per node, with every shard lease of the node attached to it (issue 25, item 1).

The keep-alive decisions (:class:`KeepAliveCore`) on a clock of the test's own; then a node's
:class:`~p2pshard.Leases` on the memory backend under trio's mock clock: one keep-alive per
interval however many shards, all shards stop before any of their names can be taken elsewhere
when the node lease is lost, tokens that grow across take-overs; and the SQLite backend's node
leases across processes' view of one file. The real etcd's are in ``test_lease_etcd.py``; the
conformance kit runs on attached leases too (``test_lease_conformance.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from p2pshard import (
    LeaseBackend,
    Leases,
    LeaseSettings,
    MemoryLeaseBackend,
    NodeLeaseGone,
    SqliteLeaseBackend,
)
from p2pshard.leases._lease import KeepAliveCore
from p2pshard.leases._node_lease import AttachedLease
from p2pshard.testing import SkewedClock

SETTINGS = LeaseSettings()  # ttl 15, renew_interval 3, operation_timeout 5, safety_margin 1
OWNER = "n1@127.0.0.1:25520#1"
SHORT = LeaseSettings(ttl=2.0, renew_interval=0.3, operation_timeout=1.0, safety_margin=0.3)


# --- the keep-alive core, on a clock of the test's own ---------------------------------------


def test_the_core_renews_every_interval_and_holds_until_ttl_less_margin_after_a_send() -> None:
    core = KeepAliveCore(SETTINGS, sent=100.0)
    assert core.deadline == 114.0  # sent + ttl - safety_margin
    assert core.wake_at() == 103.0
    assert core.holds(113.99)
    assert not core.holds(114.0)
    assert core.due(103.0) == "renew"
    core.renewed(103.0)  # sent at 103: the deadline counts from the send, not the answer
    assert (core.deadline, core.wake_at()) == (117.0, 106.0)
    assert core.give_up_at(106.0) == 111.0  # operation_timeout
    core.renewed(102.0)  # a late answer to an older renewal never moves the deadline back
    assert core.deadline == 117.0


def test_a_failed_renewal_is_retried_soon_and_the_deadline_ends_it() -> None:
    core = KeepAliveCore(SETTINGS, sent=0.0)
    for now in (3.0, 3.75, 4.5):
        assert core.due(now) == "renew"
        core.failed(now)  # no answer: again a quarter of renew_interval later
        assert core.wake_at() == now + 0.75
    assert core.give_up_at(12.0) == 14.0  # never past the deadline
    core.failed(13.9)
    assert core.wake_at() == 14.0  # woken at the deadline, not after it
    assert core.due(14.0) == "lost"
    assert not core.holds(13.0)  # once lost, lost
    core.renewed(14.5)
    assert not core.holds(14.6)


def test_a_refusal_ends_the_lease_at_once() -> None:
    core = KeepAliveCore(SETTINGS, sent=0.0)
    core.refused()
    assert not core.holds(0.0)
    assert core.due(0.0) == "lost"


# --- a node's leases on the memory backend, under the mock clock ------------------------------


def tokens(handles: list[AttachedLease]) -> list[int]:
    """The tokens of handles that hold a grant."""
    found = [h.token for h in handles]
    assert None not in found, found
    return [t for t in found if t is not None]


async def hold_shards(leases: Leases, count: int) -> list[AttachedLease]:
    handles = []
    for shard in range(count):
        handle = leases.shard_lease("Counter", str(shard))
        assert isinstance(handle, AttachedLease)
        assert await handle.acquire() is not None
        handles.append(handle)
    return handles


async def test_a_thousand_shards_renew_with_one_keep_alive_per_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    async with trio.open_nursery() as nursery:
        leases = Leases(backend, OWNER, SETTINGS, "c", nursery)
        handles = await hold_shards(leases, 1000)
        start = trio.current_time()
        await trio.sleep(10 * SETTINGS.renew_interval + 0.5)
        assert all(h.check() for h in handles)
        assert len(leases.held()) == 1000
        calls = dict(backend.calls)
        assert calls == {
            "grant_node_lease": 1,
            "try_acquire_attached": 1000,
            "keep_node_lease": 10,  # one per interval for the node, none per shard
        }, f"after {trio.current_time() - start:g} s"
        stats = leases.statistics()
        assert stats.renewals == {"renewed": 10, "refused": 0, "failed": 0}
        assert stats.acquisitions["granted"] == 1000
        assert await backend.holder("c-shard-Counter-999") == (OWNER, 1)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("rate", [1.0, 0.95, 1.05])
async def test_losing_the_node_lease_stops_every_shard_before_any_can_be_taken_elsewhere(
    autojump_clock: trio.testing.MockClock, rate: float
) -> None:
    """The node is cut off from the backend: its keep-alives hang. Every shard must see
    ``check()`` false, and ``wait_lost`` return, before another owner can take any of the names;
    with a holder clock 5 % slow or fast (``safety_margin`` covers that over a ttl)."""
    backend = MemoryLeaseBackend()
    clock = SkewedClock()
    clock.set_rate(rate)
    names = [f"c-shard-Counter-{shard}" for shard in range(50)]
    async with trio.open_nursery() as nursery:
        leases = Leases(backend, OWNER, SETTINGS, "c", nursery, clock=clock)
        handles = await hold_shards(leases, len(names))
        before = tokens(handles)
        await trio.sleep(7.0)  # a few keep-alives
        backend.cut_off(OWNER)
        lost: list[float] = []

        async def watch(handle: AttachedLease) -> None:
            await handle.wait_lost()
            lost.append(trio.current_time())

        for handle in handles:
            nursery.start_soon(watch, handle)
        taken: dict[str, float] = {}
        believed_last = 0.0
        with trio.fail_after(3 * SETTINGS.ttl):
            while len(taken) < len(names):
                now = trio.current_time()
                if any(h.check() for h in handles):
                    believed_last = now
                for name in names:
                    if name not in taken and await backend.try_acquire(name, "n2", 15.0):
                        taken[name] = now
                await trio.sleep(0.05)
        assert len(lost) == len(names)
        assert max(lost) < min(taken.values())
        assert believed_last < min(taken.values())
        assert leases.statistics().lost == len(names)
        assert leases.held() == []
        # In touch again: the shards are taken again under a new node lease, larger tokens.
        backend.cut_off(OWNER, False)
        await trio.sleep(SETTINGS.ttl)  # n2's grants expire (nobody renews them)
        again = await hold_shards(leases, len(names))
        assert all(new > old for new, old in zip(tokens(again), before, strict=True))
        assert backend.calls["grant_node_lease"] == 2
        nursery.cancel_scope.cancel()


async def test_tokens_grow_across_crash_expiry_release_and_revoke(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    seen: list[int] = []
    async with trio.open_nursery() as nursery:
        crashed = Leases(backend, "n1#1", SETTINGS, "c", nursery)
        first = tokens(await hold_shards(crashed, 5))
        crashed.abandon_all()  # a crash: nothing given back
        taker = Leases(backend, "n2#1", SETTINGS, "c", nursery)
        polling = taker.shard_lease("Counter", "0")
        with trio.fail_after(SETTINGS.ttl + 1):
            while await polling.acquire() is None:  # noqa: ASYNC110 - polls the backend
                await trio.sleep(0.1)
        assert trio.current_time() >= SETTINGS.ttl  # only once the node lease expired
        second = tokens(await hold_shards(taker, 5))
        assert await taker.release_all() == 5  # one revoke frees them all
        assert backend.calls["revoke_node_lease"] == 1
        third_leases = Leases(backend, "n3#1", SETTINGS, "c", nursery)
        third_handles = await hold_shards(third_leases, 5)
        third = tokens(third_handles)
        assert await third_handles[0].release()  # one shard handed off: its name only
        assert await backend.holder("c-shard-Counter-0") is None
        assert await backend.holder("c-shard-Counter-1") == ("n3#1", third[1])
        fourth = tokens(await hold_shards(taker, 1))
        seen = [first[0], second[0], third[0], fourth[0]]
        nursery.cancel_scope.cancel()
    assert seen == sorted(set(seen)), seen
    assert all(a < b for a, b in zip(first, second, strict=True))
    assert all(a < b for a, b in zip(second, third, strict=True))


async def test_taking_a_name_again_on_the_same_node_ends_the_handle_that_had_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    async with trio.open_nursery() as nursery:
        leases = Leases(backend, OWNER, SETTINGS, "c", nursery)
        old = leases.shard_lease("Counter", "7")
        new = leases.shard_lease("Counter", "7")
        first, second = await old.acquire(), await new.acquire()
        assert first is not None
        assert second is not None
        assert second.token > first.token
        assert not old.check()  # it no longer renews by itself: told at once
        with trio.fail_after(1):
            await old.wait_lost()
        assert new.check()
        assert not await old.release()
        assert await backend.holder("c-shard-Counter-7") == (OWNER, second.token)
        nursery.cancel_scope.cancel()


async def test_a_backend_without_node_leases_gets_a_lease_per_shard(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class PerName:  # only the LeaseBackend methods
        def __init__(self) -> None:
            self.inner = MemoryLeaseBackend()

        async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
            return await self.inner.try_acquire(name, owner, ttl)

        async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
            return await self.inner.renew(name, owner, token, ttl)

        async def release(self, name: str, owner: str, token: int) -> bool:
            return await self.inner.release(name, owner, token)

        async def holder(self, name: str) -> tuple[str, int] | None:
            return await self.inner.holder(name)

        async def aclose(self) -> None:
            await self.inner.aclose()

    backend: LeaseBackend = PerName()
    async with trio.open_nursery() as nursery:
        leases = Leases(backend, OWNER, SETTINGS, "c", nursery)
        assert leases.node_lease is None
        handle = leases.shard_lease("Counter", "1")
        assert not isinstance(handle, AttachedLease)
        assert await handle.acquire() is not None
        nursery.cancel_scope.cancel()


async def test_an_acquire_on_a_node_lease_the_backend_lost_opens_a_new_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    async with trio.open_nursery() as nursery:
        leases = Leases(backend, OWNER, SETTINGS, "c", nursery)
        [first] = await hold_shards(leases, 1)
        node_lease = leases.node_lease
        assert node_lease is not None
        lease_id = node_lease.lease_id
        assert lease_id is not None
        await backend.revoke_node_lease(OWNER, lease_id)  # as if the store forgot it
        with pytest.raises(NodeLeaseGone):
            await backend.try_acquire_attached("x", OWNER, lease_id)
        second = leases.shard_lease("Counter", "2")
        assert await second.acquire() is not None  # a new node lease, at once
        assert node_lease.lease_id not in (None, lease_id)
        assert not first.check()  # the shard of the lost one is lost
        assert leases.statistics().lost == 1
        nursery.cancel_scope.cancel()


# --- SQLite: one heartbeat row per owner ------------------------------------------------------


async def test_sqlite_node_leases_hold_names_as_long_as_the_heartbeat_row(tmp_path: Path) -> None:
    path = tmp_path / "leases.db"
    a, b = SqliteLeaseBackend(path), SqliteLeaseBackend(path)
    try:
        node_a = await a.grant_node_lease("a", 0.5)
        tokens = [await a.try_acquire_attached(f"s{i}", "a", node_a) for i in range(20)]
        assert tokens == [1] * 20
        assert await b.try_acquire("s0", "b", 5.0) is None  # per-name acquire sees it held
        assert await b.holder("s3") == ("a", 1)
        assert await a.keep_node_lease("a", node_a, 0.5)
        assert not await b.keep_node_lease("b", node_a, 0.5)  # not b's
        await trio.sleep(0.6)  # the heartbeat row expires: every name with it
        assert not await a.keep_node_lease("a", node_a, 0.5)
        assert await b.holder("s3") is None
        with pytest.raises(NodeLeaseGone, match=r"node lease .* has ended"):
            await a.try_acquire_attached("s0", "a", node_a)
        node_b = await b.grant_node_lease("b", 5.0)
        assert await b.try_acquire_attached("s0", "b", node_b) == 2
        assert not await a.release_attached("s0", "a", node_a, 1)
        assert await b.release_attached("s0", "b", node_b, 2)
        assert await b.holder("s0") is None
        assert await b.try_acquire_attached("s1", "b", node_b) == 2
        assert await b.revoke_node_lease("b", node_b)
        assert not await b.revoke_node_lease("b", node_b)
        assert await a.holder("s1") is None
        assert await a.try_acquire("s1", "a", 5.0) == 3
    finally:
        await a.aclose()
        await b.aclose()
