"""Two clusters of one name after a partition, with whole nodes on the simulated network: they
merge whatever the seed layout, and ``p2pshard status`` shows the other one meanwhile."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio
import trio.testing

from membership._member import MemberStatus
from p2pshard import NodeConfig
from p2pshard._status import reply_json, reply_text
from p2pshard.testing import SimCluster, node_address, simulated_cluster
from tests._support.polling import wait_until


def up(sim: SimCluster, i: int) -> list[str]:
    return sorted(m.node.name for m in sim.nodes[i].cluster.members if m.status is MemberStatus.UP)


async def wait_for(predicate: Callable[[], bool], limit: float = 120.0) -> None:
    await wait_until(predicate, limit, interval=0.1)  # cluster state, on the mock clock


def with_seeds(sim: SimCluster, layout: dict[int, tuple[int, ...]]) -> None:
    def configure(i: int, config: NodeConfig) -> NodeConfig:
        return attrs.evolve(config, seed_nodes=tuple(node_address(s) for s in layout[i]))

    sim.configure = configure


async def test_status_shows_another_cluster_of_the_same_name_until_one_gives_way(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with simulated_cluster(41) as sim:
        # n3 is the first seed of {n3, n4} and knows n1's address as a second seed: cut off
        # from n1 at its start, it forms a cluster of its own.
        with_seeds(sim, {1: (1,), 2: (1,), 3: (3, 1), 4: (3,)})
        await sim.start_up([1, 2])
        sim.partition([1, 2], [3, 4])
        await sim.start(3)
        await sim.start(4)
        await wait_for(lambda: up(sim, 3) == ["n3", "n4"])
        sim.heal()
        status = sim.nodes[1]._status
        assert status is not None
        await wait_for(lambda: bool(sim.nodes[1].cluster.other_clusters()))
        reply = await status.status(1, 1.0)
        [other] = reply.other_clusters
        assert other.oldest == sim.nodes[3].address
        assert other.verdict in ("undecided", "ours wins")
        text = reply_text(reply)
        assert f"another cluster of this name: oldest {sim.nodes[3].address}, 2 members" in text
        assert reply_json(reply)["other_clusters"][0]["size"] == 2
        # Equal sizes: the cluster whose oldest member sorts first (n1) wins; n3 and n4 give way.
        await wait_for(lambda: all(sim.nodes[i].terminated.is_set() for i in (3, 4)))
        assert [sim.nodes[i].cluster.termination_reason for i in (3, 4)] == ["downed"] * 2
        assert up(sim, 1) == ["n1", "n2"]


async def test_when_every_seed_was_on_the_losing_side_the_restarted_nodes_join_the_winner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Seeds n1 and n2, cut off from n3 to n5, are downed; restarted while still cut off, n1
    forms a cluster and n2 joins it. After the heal, {n1, n2} gives way, and its nodes, started
    again by a supervisor with the same seed nodes, join {n3, n4, n5}."""
    async with simulated_cluster(42) as sim:
        with_seeds(sim, dict.fromkeys(range(1, 6), (1, 2)))
        sim.exit_when_terminated = True
        await sim.start_up([1, 2, 3, 4, 5])
        sim.partition([1, 2], [3, 4, 5])
        await wait_for(lambda: 1 not in sim.nodes and 2 not in sim.nodes)
        await sim.start(1)
        await sim.start(2)
        await wait_for(lambda: up(sim, 1) == ["n1", "n2"] and up(sim, 3) == ["n3", "n4", "n5"])
        winner = sim.nodes[3].cluster.oldest()
        sim.heal()
        restarts = 0

        async def supervise() -> None:
            nonlocal restarts
            while True:
                for i in (1, 2):
                    if i not in sim.nodes:
                        restarts += 1
                        await sim.start(i)
                await trio.sleep(1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervise)
            await wait_for(
                lambda: (
                    all(
                        up(sim, i) == [f"n{j}" for j in range(1, 6)]
                        for i in range(1, 6)
                        if i in sim.nodes
                    )
                    and len(sim.nodes) == 5
                ),
                limit=180,
            )
            nursery.cancel_scope.cancel()
        assert restarts == 2  # each loser once: nobody formed a cluster of its own again
        assert {sim.nodes[i].cluster.oldest() for i in range(1, 6)} == {winner}
