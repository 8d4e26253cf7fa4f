"""``cluster_stats`` lists the regions that host a type, as Akka's ``ClusterShardingStats``.

One simulated cluster (mock clock) with an entity type of role ``host``: two hosting regions (one
with every shard, one registered after the entities started, with none), a node of the role
that never started the type, a proxy of a node of the role, and a proxy on a node without the
role (``start`` there makes one). Only the two regions are listed, from wherever the stats are
asked; a region cut off from the asker is listed apart, as failed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import trio
import trio.testing

from p2pshard import (
    ConfigurationError,
    HashExtractor,
    LeastShardAllocationStrategy,
    Node,
    ShardRegion,
    testing,
)
from tests._support.sharding_sim import CounterAdd, CounterSim, counter_factory

TYPE = "Counter"
ROLE = "host"
BOUND = 120.0
ENTITIES = [f"e-{k}" for k in range(12)]
# No rebalance (the legacy algorithm with a threshold above the shard count): the region that
# registers late keeps no shards.
NO_REBALANCE = LeastShardAllocationStrategy(rebalance_absolute_limit=0, rebalance_threshold=1000)
# 1, 2: regions. 3: of the role, never starts the type. 4: of the role, a proxy.
# 5: without the role, `start` makes a proxy there.
ROLES = {1: (ROLE,), 2: (ROLE,), 3: (ROLE,), 4: (ROLE,), 5: ()}


async def setup(i: int, node: Node, sim: CounterSim) -> None:
    extractor = HashExtractor(10)
    if i in (1, 2, 5):
        sim.regions[i] = await node.sharding.start(
            TYPE,
            counter_factory(sim.journal, f"n{i}"),
            extractor=extractor,
            allocation_strategy=NO_REBALANCE,
            role=ROLE,
        )
    elif i == 4:
        sim.regions[i] = await node.sharding.start_proxy(TYPE, extractor=extractor, role=ROLE)


def registered(region: ShardRegion) -> bool:
    return region.statistics().registered


async def eventually(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(BOUND):
        while not predicate():  # noqa: ASYNC110 - polls state on the mock clock
            await trio.sleep(0.05)


async def test_only_the_regions_that_host_the_type_are_listed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with testing.simulated_cluster_of(CounterSim, 23, setup, roles=ROLES) as sim:
        await sim.start_up([1, 3, 4, 5])
        for i in (1, 4, 5):
            await eventually(functools.partial(registered, sim.regions[i]))
        assert sim.regions[4].statistics().proxy
        assert sim.regions[5].statistics().proxy
        for seq, eid in enumerate(ENTITIES, start=1):
            await sim.regions[5].entity_ref(eid).ask(CounterAdd(sender="t", seq=seq), timeout=BOUND)
        hosted = sim.nodes[1].sharding.region_state(TYPE)
        expected_1 = {s.shard_id: len(s.entity_ids) for s in hosted.shards}
        assert sum(expected_1.values()) == len(ENTITIES)

        await sim.start(2)  # registers after every shard has its home on node 1
        await sim.all_up([1, 2, 3, 4, 5])
        await eventually(functools.partial(registered, sim.regions[2]))
        assert sim.regions[2].statistics().shards == 0

        n1, n2 = sim.nodes[1].address, sim.nodes[2].address
        for asker in (1, 2, 4, 5):  # a region, the empty region, a proxy, a mismatched proxy
            stats = await sim.nodes[asker].sharding.cluster_stats(TYPE, timeout=5)
            assert stats.type_name == TYPE
            assert stats.regions == {n1: expected_1, n2: {}}, f"asked on node {asker}"
            assert stats.failed == frozenset(), f"asked on node {asker}"

        # Node 2 cut off from everyone: it is still a region of the type, and does not answer.
        sim.partition(2, [1, 3, 4, 5])
        stats = await sim.nodes[4].sharding.cluster_stats(TYPE, timeout=1)
        assert stats.regions == {n1: expected_1}
        assert stats.failed == frozenset({n2})


async def test_a_node_that_never_started_the_type_cannot_ask_for_its_stats(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with testing.simulated_cluster_of(CounterSim, 24, setup, roles=ROLES) as sim:
        await sim.start_up([1, 3])
        with pytest.raises(ConfigurationError, match="not started on this node"):
            await sim.nodes[3].sharding.cluster_stats(TYPE, timeout=1)
        with pytest.raises(ValueError, match="timeout"):
            await sim.nodes[1].sharding.cluster_stats(TYPE, timeout=0)
