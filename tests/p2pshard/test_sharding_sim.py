"""Cluster sharding end to end on the simulated network (mock clock)."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from p2pshard import ShardingSettings
from p2pshard._extractor import stable_shard

from .sharding_sim import Add, Read, SimCluster, StopNow, sim_cluster, standard_setup

Counts = dict[str, dict[str, int]]


async def test_tell_and_ask_reach_one_entity_from_every_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(1) as sim:
        for i in (1, 2, 3):
            await sim.start(i)
        await sim.all_up([1, 2, 3])
        for seq in range(1, 4):
            for i in (1, 2, 3):
                await sim.regions[i].entity_ref("e-1").tell(Add(sender=f"n{i}", seq=seq))
        answers: list[tuple[str, int]] = []
        for i in (1, 2, 3):
            answer = await sim.regions[i].entity_ref("e-1").ask(Read(), timeout=30)
            assert isinstance(answer, tuple)
            answers.append(answer)
        assert len({owner for owner, _ in answers}) == 1
        assert answers[-1][1] == 9
        sim.journal.check_per_sender_order("e-1", {"n1": 3, "n2": 3, "n3": 3})
        assert len(sim.journal.of("e-1")) == 1


def entity_per_shard(number_of_shards: int) -> dict[str, str]:
    """One entity id for every shard (shard id → entity id)."""
    found: dict[str, str] = {}
    k = 0
    while len(found) < number_of_shards:
        found.setdefault(stable_shard(f"e-{k}", number_of_shards), f"e-{k}")
        k += 1
    return found


async def send_forever(
    sim: SimCluster, i: int, entities: list[str], sent: Counts, *, name: str = "", pause: float
) -> None:
    """Node ``i`` sends numbered Adds to ``entities`` round-robin until cancelled."""
    name = name or f"n{i}"
    while True:
        for entity_id in entities:
            seq = sent.setdefault(entity_id, {}).get(name, 0) + 1
            await sim.regions[i].entity_ref(entity_id).tell(Add(sender=name, seq=seq))
            sent[entity_id][name] = seq
        await trio.sleep(pause)


async def settle(sim: SimCluster, nodes: list[int], entities: list[str]) -> None:
    """Every node's earlier messages to ``entities`` have been handled."""
    for i in nodes:
        for entity_id in entities:
            await sim.regions[i].entity_ref(entity_id).ask(Read(), timeout=60)


def shard_counts(sim: SimCluster, nodes: list[int]) -> list[int]:
    return [sim.regions[i].statistics().shards for i in nodes]


async def test_a_joining_node_gets_its_share_without_losing_or_reordering_messages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shards = 300
    settings = ShardingSettings(rebalance_interval=10.0)
    setup = standard_setup(shards, settings=settings, stop_message=StopNow())
    async with sim_cluster(2, setup) as sim:
        for i in (1, 2, 3):
            await sim.start(i)
        await sim.all_up([1, 2, 3])
        ids = entity_per_shard(shards)
        for entity_id in ids.values():  # every shard gets a home
            await sim.regions[1 + int(entity_id[2:]) % 3].entity_ref(entity_id).tell(
                Add(sender="warmup", seq=1)
            )
        await settle(sim, [1, 2, 3], list(ids.values()))
        assert sum(shard_counts(sim, [1, 2, 3])) == shards
        watched = sorted(ids.values())[::10]  # 30 entities that every node keeps writing to
        sent: Counts = {}
        async with trio.open_nursery() as senders:
            for i in (1, 2, 3):
                senders.start_soon(partial(send_forever, sim, i, watched, sent, pause=0.05))
            # Shards are given a home when a message comes: this keeps every shard in use.
            everything = sorted(ids.values())
            senders.start_soon(partial(send_forever, sim, 2, everything, sent, name="t", pause=1))
            await sim.start(4)
            await sim.all_up([1, 2, 3, 4])
            up_at = trio.current_time()
            with trio.fail_after(60):
                while max(counts := shard_counts(sim, [1, 2, 3, 4])) - min(counts) > 1:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            took = trio.current_time() - up_at
            print(f"balanced {counts} after {took:.1f} s")
            assert took <= 2 * settings.rebalance_interval + 5
            await trio.sleep(5)
            senders.cancel_scope.cancel()
        await settle(sim, [1, 2, 3], everything)
        for entity_id in everything:
            sim.journal.check_per_sender_order(entity_id, sent[entity_id])
        moved = [e for e in watched if len(sim.journal.of(e)) > 1]
        assert moved, "some watched entity should have moved to the new node"
        sim.journal.check_one_at_a_time()
        assert all(sim.regions[i].statistics().dropped == 0 for i in (1, 2, 3, 4))
