"""Whole clusters on the simulated network, with a mock clock: forming, failures, partitions."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio
import trio.testing

from membership import Address, LinkConditions, SimNetwork, deterministic_scheduling
from membership._cluster import PRUNE_INTERVAL, Cluster
from membership._cluster_messages import InitJoin
from membership._cluster_settings import ClusterSettings
from membership._events import ClusterEvent, MemberEvent, MemberRemoved, UnreachableMember
from membership._failure_detector import FailureDetectorSettings
from membership._member import MemberStatus
from membership.sbr._settings import SplitBrainResolverSettings

S = MemberStatus


def addr(i: int) -> Address:
    return Address("10.0.0.1", 2550 + i)


@attrs.define
class SimCluster:
    net: SimNetwork
    nursery: trio.Nursery
    nodes: dict[int, Cluster] = attrs.field(factory=dict)
    scopes: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    stopped: dict[int, trio.Event] = attrs.field(factory=dict)
    """Per node, set once its task is gone and its address is free for a restart."""
    events: dict[int, list[ClusterEvent]] = attrs.field(factory=dict)
    sbr: SplitBrainResolverSettings | None = attrs.field(
        factory=lambda: SplitBrainResolverSettings(stable_after=7.0)
    )

    async def start(self, i: int, seeds: Sequence[int] = (1, 2, 3)) -> Cluster:
        return await self.nursery.start(self._run, i, seeds)  # type: ignore[no-any-return]

    async def _run(
        self, i: int, seeds: Sequence[int], *, task_status: trio.TaskStatus[Cluster]
    ) -> None:
        stopped = self.stopped[i] = trio.Event()
        try:
            await self._run_node(i, seeds, task_status=task_status)
        finally:
            stopped.set()

    async def _run_node(
        self, i: int, seeds: Sequence[int], *, task_status: trio.TaskStatus[Cluster]
    ) -> None:
        with trio.CancelScope() as scope:
            self.scopes[i] = scope
            async with self.net.transport(addr(i), f"n{i}") as transport:
                cluster = Cluster(
                    transport,
                    settings=ClusterSettings(),
                    failure_detector=FailureDetectorSettings(),
                    split_brain_resolver=self.sbr,
                    seed_nodes=[addr(s) for s in seeds],
                    rng=random.Random(self.net.seed * 100 + i),
                )
                self.nodes[i] = cluster
                self.events[i] = []
                async with trio.open_nursery() as inner:

                    async def dispatch() -> None:
                        async for envelope in transport:
                            cluster.handle(envelope)

                    async def record() -> None:
                        async with cluster.subscribe() as events:
                            async for event in events:
                                self.events[i].append(event)

                    inner.start_soon(dispatch)
                    inner.start_soon(record)
                    await inner.start(cluster.run)
                    task_status.started(cluster)
                    await cluster.terminated.wait()
                    inner.cancel_scope.cancel()

    def crash(self, i: int) -> None:
        self.net.crash(addr(i))
        self.scopes[i].cancel()

    async def restart(self, i: int, seeds: Sequence[int] = (1, 2, 3)) -> Cluster:
        """Start node ``i`` again (a new incarnation) once the previous one is gone."""
        await self.stopped[i].wait()
        return await self.start(i, seeds)

    async def supervise(self, nodes: Sequence[int], restarts: list[int]) -> None:
        """Restart every node of ``nodes`` that left the cluster, as a process supervisor would."""
        while True:
            for i in nodes:
                if self.nodes[i].terminated.is_set():
                    restarts.append(i)
                    await self.restart(i)
            await trio.sleep(1.0)

    def up_view(self, i: int) -> dict[str, S]:
        return {m.node.name: m.status for m in self.nodes[i].members}


@asynccontextmanager
async def sim_cluster(seed: int, **kwargs: object) -> AsyncIterator[SimCluster]:
    print(f"seed={seed}")
    net = SimNetwork(seed, conditions=LinkConditions(delay_min=0.001, delay_max=0.005))
    async with trio.open_nursery() as nursery:
        yield SimCluster(net, nursery, **kwargs)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()


async def wait_until(predicate: Callable[[], bool], limit: float = 120) -> float:
    start = trio.current_time()
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - polls cluster state on the mock clock
            await trio.sleep(0.1)
    return trio.current_time() - start


def all_up(c: SimCluster, nodes: Sequence[int]) -> bool:
    expected = {f"n{j}": S.UP for j in nodes}
    return all(c.up_view(i) == expected and c.nodes[i].has_converged() for i in nodes)


async def test_five_nodes_form_one_cluster(autojump_clock: trio.testing.MockClock) -> None:
    async with sim_cluster(seed=11) as c:
        for i in range(1, 6):
            await c.start(i)
        await wait_until(lambda: all_up(c, range(1, 6)))
        leaders = {c.nodes[i].leader for i in range(1, 6)}
        assert leaders == {c.nodes[1].self_address}
        oldest = {c.nodes[i].oldest() for i in range(1, 6)}
        assert len(oldest) == 1


async def test_crashed_node_is_unreachable_then_downed_and_removed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(seed=12) as c:
        for i in range(1, 6):
            await c.start(i)
        await wait_until(lambda: all_up(c, range(1, 6)))
        crashed = c.nodes[5].self_address
        c.crash(5)
        detected = await wait_until(lambda: any(m.node == crashed for m in c.nodes[1].unreachable))
        assert detected < 10  # phi-accrual with Akka's defaults: about 4.5 s after the last beat
        removed = await wait_until(lambda: all_up(c, range(1, 5)))
        assert removed >= 7.0 - 1  # not before the split brain resolver's stable_after
        for i in range(1, 5):
            kinds = [
                type(e)
                for e in c.events[i]
                if isinstance(e, MemberEvent | UnreachableMember) and e.member.node == crashed
            ]
            assert UnreachableMember in kinds
            assert MemberRemoved in kinds


async def test_majority_side_survives_a_three_two_partition(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(seed=13) as c:
        for i in range(1, 6):
            await c.start(i)
        await wait_until(lambda: all_up(c, range(1, 6)))
        c.net.partition([addr(1), addr(2), addr(3)], [addr(4), addr(5)])
        await wait_until(lambda: c.nodes[4].terminated.is_set() and c.nodes[5].terminated.is_set())
        assert c.nodes[4].termination_reason == "downed"
        await wait_until(lambda: all_up(c, (1, 2, 3)))
        assert not any(c.nodes[i].terminated.is_set() for i in (1, 2, 3))


async def test_the_minority_leaders_decision_stops_its_whole_side_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The leader of the minority downs itself and the others of its side; they learn it from
    the leader before it stops, instead of running on until their own resolver decides."""
    async with sim_cluster(seed=16) as c:
        for i in range(1, 6):
            await c.start(i)
        await wait_until(lambda: all_up(c, range(1, 6)))
        stopped: dict[int, float] = {}

        async def watch(i: int) -> None:
            await c.nodes[i].terminated.wait()
            stopped[i] = trio.current_time()

        async with trio.open_nursery() as watchers:
            for i in (1, 2):
                watchers.start_soon(watch, i)
            c.net.partition([addr(1), addr(2)], [addr(3), addr(4), addr(5)])
        assert c.nodes[1].termination_reason == c.nodes[2].termination_reason == "downed"
        assert abs(stopped[2] - stopped[1]) < 0.1, stopped  # one decision, one moment


async def test_a_node_that_left_is_never_dialled_again_nor_a_visitor_once_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(seed=17) as c:
        for i in range(1, 4):
            await c.start(i, seeds=(1, 2))
        await wait_until(lambda: all_up(c, (1, 2, 3)))
        gone = addr(3)
        c.nodes[3].leave()
        await wait_until(lambda: all_up(c, (1, 2)))
        await c.stopped[3].wait()
        async with c.net.transport(addr(9), "visitor") as visitor:  # asks once, then goes
            await visitor.send(addr(1), InitJoin(sender=visitor.local_address))
            await wait_until(lambda: visitor.statistics().messages_received == 1)
        await trio.sleep(2 * PRUNE_INTERVAL + 1)
        for i in (1, 2):
            stats = c.nodes[i]._transport.statistics()
            assert stats.peer(gone) is None, i
            assert stats.peer(addr(9)) is None, i
        before = c.net.statistics().frames_sent
        await trio.sleep(60)
        for i in (1, 2):
            stats = c.nodes[i]._transport.statistics()
            assert stats.peer(gone) is None
            assert stats.peer(addr(9)) is None
        assert c.net.statistics().frames_sent > before  # the cluster itself goes on talking


async def test_one_way_partition_is_resolved_without_a_split(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(seed=14) as c:
        for i in range(1, 6):
            await c.start(i)
        await wait_until(lambda: all_up(c, range(1, 6)))
        c.net.partition([addr(4)], [addr(5)], one_way=True)  # 4 cannot reach 5; 5 reaches 4
        survivors = (1, 2, 3)
        await wait_until(
            lambda: all(
                {m.node.name for m in c.nodes[i].members} <= {"n1", "n2", "n3", "n4", "n5"}
                and c.nodes[i].has_converged()
                and not c.nodes[i].unreachable
                and len(c.nodes[i].members) < 5
                for i in survivors
            )
        )
        views = {tuple(sorted(c.up_view(i).items())) for i in survivors}
        assert len(views) == 1  # the survivors agree
        (view,) = views
        assert {"n1", "n2", "n3"} <= {name for name, _ in view}


async def test_pause_shorter_than_acceptable_pause_is_never_unreachable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(seed=15) as c:
        for i in range(1, 4):
            await c.start(i)
        await wait_until(lambda: all_up(c, (1, 2, 3)))
        for _ in range(3):
            c.net.isolate(addr(3))
            await trio.sleep(2.0)  # well under acceptable_heartbeat_pause (3 s)
            c.net.heal()
            await trio.sleep(20)
        for i in (1, 2, 3):
            assert not [e for e in c.events[i] if isinstance(e, UnreachableMember)]
        assert all_up(c, (1, 2, 3))


async def test_island_of_a_restarted_first_seed_merges_after_the_partition_heals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The first seed restarts while cut off from the other seeds: no seed answers, so it forms
    # a second cluster, and a node restarted on its side joins that one. Both sides are Up in
    # their own views; once the partition heals, the smaller one must down itself and rejoin.
    async with sim_cluster(seed=16) as c:
        for i in range(1, 6):
            await c.start(i)
        await wait_until(lambda: all_up(c, range(1, 6)))
        c.net.partition([addr(1)], [addr(i) for i in (2, 3, 4, 5)])
        c.crash(1)
        await c.restart(1)
        await wait_until(lambda: all_up(c, (1,)))  # an island of its own
        # The other side removes the old n1 first: a second failure before the first is
        # resolved would make its split brain resolver down everyone (down_all_when_unstable).
        await wait_until(lambda: all_up(c, (2, 3, 4, 5)))
        c.crash(4)
        c.net.heal()  # and at once a new partition, with n4 on n1's side
        c.net.partition([addr(1), addr(4)], [addr(2), addr(3), addr(5)])
        await c.restart(4)
        await wait_until(lambda: all_up(c, (1, 4)) and all_up(c, (2, 3, 5)))
        island = [c.nodes[1], c.nodes[4]]
        main = [c.nodes[i] for i in (2, 3, 5)]
        assert island[0].oldest() != main[0].oldest()  # two clusters, two sets of singletons

        c.net.heal()
        restarts: list[int] = []
        c.nursery.start_soon(c.supervise, range(1, 6), restarts)
        merged = await wait_until(lambda: all_up(c, range(1, 6)), limit=60)
        print(f"merged {merged:.1f} s after the heal; restarted {restarts}")
        assert sorted(restarts) == [1, 4]  # the island gave way: it was smaller
        assert [n.termination_reason for n in island] == ["downed", "downed"]
        assert [c.nodes[i] for i in (2, 3, 5)] == main  # the bigger cluster was left alone
        assert {c.nodes[i].oldest() for i in range(1, 6)} == {main[0].oldest()}


def run_scenario(seed: int) -> str:
    """Form five nodes, crash one, partition, heal: return the network's trace hash."""

    async def scenario() -> str:
        async with sim_cluster(seed) as c:
            for i in range(1, 6):
                await c.start(i)
            await wait_until(lambda: all_up(c, range(1, 6)))
            c.crash(5)
            await wait_until(lambda: all_up(c, range(1, 5)))
            c.net.partition([addr(1), addr(2), addr(3)], [addr(4)])
            await wait_until(lambda: all_up(c, (1, 2, 3)))
            return c.net.trace_hash()

    clock = trio.testing.MockClock(autojump_threshold=0)
    with deterministic_scheduling(seed):
        return trio.run(scenario, clock=clock)


def test_same_seed_replays_the_same_cluster_run() -> None:
    first = run_scenario(21)
    assert run_scenario(21) == first
    assert run_scenario(22) != first
