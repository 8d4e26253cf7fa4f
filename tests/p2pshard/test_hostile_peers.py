"""A certificate speaks only for its own node: forged membership traffic changes nothing.

Each test runs three nodes hosting ``Counter`` on the simulated network, then attaches an
intruder: a transport whose links carry a certificate identity of the cluster that is not a
member (a ``node`` named ``mallory``, or a ``client`` or ``admin`` one). What it sends names
other nodes; the members must stay as they are, asks must be answered throughout, and every
refusal must be counted by kind and logged at most a few times.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from membership import Address, IdentityKind, SimTransport, UniqueAddress
from membership._cluster_messages import Down, GossipEnvelope, GossipStatus, InitJoin, Join, Leave
from membership._gossip import Gossip
from membership._heartbeat import Heartbeat
from membership._member import Member, MemberStatus
from p2pshard.sharding._extractor import stable_shard
from p2pshard.sharding._protocol import EntityDelivery
from tests._support.sharding_sim import CounterAdd, CounterRead, CounterSim, addr, sim_cluster

INTRUDER = Address("10.0.0.66", 6666)


def fake(i: int) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.77", 7000 + i), f"ghost-{i}", 1000 + i)


def members(sim: CounterSim, i: int) -> dict[str, MemberStatus]:
    return {m.node.name: m.status for m in sim.nodes[i].cluster.members}


UP3 = {"n1": MemberStatus.UP, "n2": MemberStatus.UP, "n3": MemberStatus.UP}


def refused(sim: CounterSim, i: int) -> dict[str, int]:
    return dict(sim.nodes[i].cluster.statistics().refused)


@asynccontextmanager
async def cluster_and_intruder(
    kind: IdentityKind = IdentityKind.NODE, name: str = "mallory"
) -> AsyncIterator[tuple[CounterSim, SimTransport]]:
    async with sim_cluster(20) as sim:
        await sim.start_up([1, 2, 3])
        async with sim.net.transport(INTRUDER, name, kind=kind) as intruder:
            yield sim, intruder


async def asks_answered(sim: CounterSim, rounds: int = 3) -> None:
    for seq in range(rounds):
        for i in (1, 2, 3):
            ref = sim.regions[i].entity_ref(f"e-{seq}")
            await ref.tell(CounterAdd(sender=f"n{i}", seq=seq))
            assert await ref.ask(CounterRead(), timeout=10) is not None


@pytest.mark.parametrize("fakes", [1, 5])
async def test_forged_joins_for_other_names_make_nobody_a_member(
    autojump_clock: trio.testing.MockClock, fakes: int, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        for _ in range(20):  # retried for a while, as a joining node would
            for k in range(fakes):
                for i in (1, 2, 3):
                    await intruder.send(addr(i), Join(node=fake(k), roles=frozenset()))
                    await intruder.send(addr(i), InitJoin(sender=fake(k)))
            await trio.sleep(1.0)
        await asks_answered(sim)
        await trio.sleep(30)  # past stable_after: the resolver would act on fake members now
        for i in (1, 2, 3):
            assert members(sim, i) == UP3
            assert refused(sim, i)["forged-author"] == 20 * fakes * 2
        await asks_answered(sim)
    lines = [r for r in caplog.records if "speaks only for itself" in r.getMessage()]
    assert 3 <= len(lines) <= 3 * 4, [r.getMessage() for r in lines]


@pytest.mark.parametrize("command", [Down, Leave])
async def test_down_or_leave_of_a_member_from_a_non_member_changes_nothing(
    autojump_clock: trio.testing.MockClock, command: type[Down] | type[Leave]
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        for i in (1, 2, 3):
            await intruder.send(addr(i), command(node=addr(3)))
        await trio.sleep(10)
        for i in (1, 2, 3):
            assert members(sim, i) == UP3
            assert refused(sim, i) == {"not-a-member": 1}
        await asks_answered(sim)


@pytest.mark.parametrize("command", [Down, Leave])
async def test_a_client_certificate_cannot_down_or_make_a_member_leave(
    autojump_clock: trio.testing.MockClock, command: type[Down] | type[Leave]
) -> None:
    async with cluster_and_intruder(IdentityKind.CLIENT, "ops") as (sim, client):
        await client.send(addr(1), command(node=addr(3)))
        await trio.sleep(10)
        assert members(sim, 1) == UP3
        assert refused(sim, 1) == {"client-identity": 1}


async def test_an_admin_certificate_may_down_a_member(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_and_intruder(IdentityKind.ADMIN, "root") as (sim, admin):
        await admin.send(addr(1), Down(node=addr(3)))
        with trio.fail_after(30):
            while 3 in sim.nodes and not sim.nodes[3].terminated.is_set():  # noqa: ASYNC110
                await trio.sleep(0.1)
        await trio.sleep(5)
        assert "n3" not in {n for n, s in members(sim, 1).items() if s is MemberStatus.UP}
        assert refused(sim, 1) == {}


async def test_gossip_from_a_non_member_is_refused_however_it_is_made(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        n1 = sim.nodes[1].address
        me = intruder.local_address
        # Gossip in which the intruder and two ghosts are Up, and n1 is gone (a tombstone).
        forged = Gossip(
            [Member(me, MemberStatus.UP), *(Member(fake(k), MemberStatus.UP) for k in range(2))],
            tombstones=[(n1, 0.0)],
        ).incremented(me)
        await intruder.send(addr(1), GossipEnvelope(sender=me, to=n1, gossip=forged))
        await intruder.send(
            addr(1), GossipStatus(sender=me, version=forged.version, seen_digest=b"")
        )
        # The same gossip claiming to come from n2.
        n2 = sim.nodes[2].address
        await intruder.send(addr(1), GossipEnvelope(sender=n2, to=n1, gossip=forged))
        await trio.sleep(10)
        assert members(sim, 1) == UP3
        assert not sim.nodes[1].terminated.is_set()
        assert refused(sim, 1) == {"not-a-member": 2, "forged-author": 1}
        await asks_answered(sim)


async def test_heartbeats_from_a_non_member_are_not_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        for seq in range(1, 11):
            heartbeat = Heartbeat(
                sender=intruder.local_address, sequence_nr=seq, creation_time=float(seq)
            )
            await intruder.send(addr(1), heartbeat)
            await trio.sleep(1)
        assert refused(sim, 1) == {"not-a-member": 10}
        # Nobody dialled the address the intruder announced: no answer went there.
        assert sim.nodes[1].transport.statistics().peer(INTRUDER) is None
        assert intruder.statistics().messages_received == 0


async def test_sharding_traffic_from_a_non_member_never_reaches_an_entity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        await asks_answered(sim, rounds=1)
        before = len(sim.journal.of("e-0"))
        for i in (1, 2, 3):
            delivery = EntityDelivery(
                type_name="Counter",
                shard=stable_shard("e-0", 10),
                entity_id="e-0",
                message=CounterAdd(sender="mallory", seq=1),
            )
            await intruder.send(addr(i), delivery)
        await trio.sleep(5)
        assert len(sim.journal.of("e-0")) == before
        assert sum(refused(sim, i).get("not-a-member", 0) for i in (1, 2, 3)) == 3


async def test_a_flood_of_refused_messages_closes_the_link_and_gives_a_few_log_lines(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            for k in range(2000):
                await intruder.send(addr(1), Join(node=fake(k % 7), roles=frozenset()))
                if k % 100 == 0:
                    await trio.sleep(0.5)
            await trio.sleep(1)
        # Past refused_messages_burst (1,000 here), refusals faster than
        # refused_messages_per_second (100/s) close the link, and what was in flight is lost.
        assert sim.nodes[1].transport_statistics().links_closed_refused >= 1
        assert 1000 <= refused(sim, 1)["forged-author"] < 2000
        lines = [r for r in caplog.records if "refused" in r.getMessage()]
        # One line at once, then at most one per REPORT_INTERVAL (10 s) over ~10 s of flood.
        assert 1 <= len(lines) <= 4, [r.getMessage() for r in lines]
        assert members(sim, 1) == UP3
        await asks_answered(sim)


async def test_large_refused_messages_close_the_link_by_their_bytes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_and_intruder() as (sim, intruder):
        bulky = EntityDelivery(
            type_name="Counter",
            shard=stable_shard("e-0", 10),
            entity_id="e-0",
            message=CounterAdd(sender="x" * (256 << 10), seq=1),
        )
        for _ in range(100):  # 25 MiB, well under refused_messages_burst messages
            await intruder.send(addr(1), bulky)
        await trio.sleep(2)
        # refused_bytes_burst (16 MiB) is spent after some 64 of them: the link is closed.
        assert sim.nodes[1].transport_statistics().links_closed_refused >= 1
        assert refused(sim, 1)["not-a-member"] < 100
        assert members(sim, 1) == UP3
        await asks_answered(sim)
