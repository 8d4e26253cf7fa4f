"""``NodeConfig.app_version`` (issue 22): each node's reaches every member, ``p2pshard status``
shows it per member, and during a rollout singletons move once and new shards go to the newest
version."""

from __future__ import annotations

from typing import Any

import attrs
import trio
import trio.testing

from p2pshard import EntityId, HashExtractor, Node, NodeConfig, ShardingEnvelope
from p2pshard._status import reply_json, reply_text
from p2pshard.testing import simulated_cluster
from tests._support.sharding_sim import CounterAdd, CounterSim, counter_factory, sim_cluster

VERSIONS = {1: "2.4.1", 2: "2.5.0-rc1", 3: ""}


async def test_status_shows_each_members_app_version(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with simulated_cluster(7) as sim:

        def configure(i: int, config: NodeConfig) -> NodeConfig:
            return attrs.evolve(config, app_version=VERSIONS[i])

        sim.configure = configure
        await sim.start_up([1, 2, 3])
        for i in VERSIONS:
            seen = {m.node.name: m.app_version for m in sim.nodes[i].cluster.members}
            assert seen == {f"n{j}": v for j, v in VERSIONS.items()}
        status = sim.nodes[3]._status
        assert status is not None
        reply = await status.status(1, 1.0)
        by_name = {m["name"]: m["app_version"] for m in reply_json(reply)["members"]}
        assert by_name == {"n1": "2.4.1", "n2": "2.5.0-rc1", "n3": None}
        lines = reply_text(reply).splitlines()
        header = next(line for line in lines if line.startswith("MEMBER"))
        assert header.split()[-1] == "VERSION"
        rows = {
            line.split()[0]: line.split()[-1] for line in lines if line[:2] in ("n1", "n2", "n3")
        }
        assert rows == {"n1": "2.4.1", "n2": "2.5.0-rc1", "n3": "-"}


async def test_a_rollout_moves_singletons_once_and_gives_new_shards_to_upgraded_nodes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nodes 2, 1, 3 upgraded in that order, one at a time (leave, start the new version).

    By age alone the singletons would run on n1, then n3 (n1 leaves), then n2 (n3 leaves): two
    moves after the first. By the newest version they move once, to the upgraded n2, and stay.
    """
    extractor = HashExtractor(30)
    versions = {1: "1.0.0", 2: "1.0.0", 3: "1.0.0"}
    instances: list[str] = []

    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        sim.regions[i] = await node.sharding.start(
            "Counter", counter_factory(sim.journal, f"n{i}"), extractor=extractor
        )
        version = versions[i]

        async def probe(ctx: Any) -> None:
            instances.append(f"n{i}@{version}")
            async for _ in ctx:
                pass

        await node.singletons.start("probe", probe)

    def configure(i: int, config: NodeConfig) -> NodeConfig:
        return attrs.evolve(config, app_version=versions[i])

    async def tell(sim: CounterSim, entities: list[str]) -> None:
        for seq, entity in enumerate(entities):
            message = CounterAdd(sender="test", seq=seq)
            await sim.regions[sim.live[0]].tell(ShardingEnvelope(entity_id=entity, message=message))

    async with sim_cluster(22, setup) as sim:
        sim.configure = configure
        await sim.start_up([1, 2, 3])
        await tell(sim, [f"e{k}" for k in range(10)])
        for step, i in enumerate([2, 1, 3]):
            await sim.graceful_leave(i)
            await sim.all_up([j for j in (1, 2, 3) if j != i])
            versions[i] = "1.1.0"
            await sim.start(i)
            await sim.all_up([1, 2, 3])
            if step == 0:  # n2 new, n1 and n3 old: new shards go to n2 only
                await trio.sleep(5.0)
                region = sim.regions[1]
                known = set(region.shard_homes())
                fresh = [
                    e
                    for e in (f"f{k}" for k in range(200))
                    if extractor.shard_id(EntityId(e)) not in known
                ][:8]
                await tell(sim, fresh)
                await trio.sleep(5.0)
                homes = region.shard_homes()
                placed = {homes[extractor.shard_id(EntityId(e))].name for e in fresh}
                assert placed == {"n2"}
        await trio.sleep(10.0)
        assert instances == ["n1@1.0.0", "n2@1.1.0"]
        for i in (1, 2, 3):
            host = sim.nodes[i].cluster.singleton_host()
            assert host is not None
            assert (host.node.name, host.app_version) == ("n2", "1.1.0")
