"""Cluster singletons across leaving, crashing and restarting nodes, on the simulated network.

Every instance records when it ran; the check is that no two intervals ever overlap (at most one
instance at any moment) and that one runs again within a bound after each disruption.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
import trio.testing

from membership.sbr._settings import SplitBrainResolverSettings
from membership.singleton import SingletonContext, SingletonRequest, SingletonUnavailable
from p2pshard import LeaseSettings, MemoryLeaseBackend, Node, testing

BOUND = 60.0  # seconds until a singleton runs again after a disruption (mock clock)
addr = testing.node_address


def counter(history: testing.History, i: int) -> Callable[[SingletonContext], Awaitable[None]]:
    """The singleton under test: records its instances, answers (node, message)."""

    async def run(ctx: SingletonContext) -> None:
        span = history.singleton_started(f"n{i}", ctx.name)
        try:
            async for request in ctx:
                request.reply((f"n{i}", request.message))
        finally:
            span.end = trio.current_time()

    return run


@attrs.define(eq=False)
class Harness(testing.SimCluster):
    """The package's simulated cluster, each node running the singleton ``counter``."""

    leases: MemoryLeaseBackend = attrs.field(factory=MemoryLeaseBackend)

    @property
    def runs(self) -> list[testing.Span]:
        return self.history.singletons.get("counter", [])

    def running(self) -> list[testing.Span]:
        return [r for r in self.runs if r.end is None]

    async def wait_running(self, exclude: frozenset[str] = frozenset()) -> testing.Span:
        with trio.fail_after(BOUND):
            while True:
                live = [r for r in self.running() if r.node not in exclude]
                if live:
                    return live[0]
                await trio.sleep(0.1)


async def _start_counter(i: int, node: Node, sim: testing.SimCluster) -> None:
    await node.singletons.start("counter", counter(sim.history, i))


@asynccontextmanager
async def harness(
    seed: int, sbr: SplitBrainResolverSettings | None = None
) -> AsyncIterator[Harness]:
    async with testing.simulated_cluster_of(
        Harness,
        seed,
        _start_counter,
        split_brain_resolver=sbr or SplitBrainResolverSettings(stable_after=5.0),
        lease_settings=LeaseSettings(),
    ) as h:
        h.lease_backend = h.leases
        yield h
        assert testing.check_single_singleton(h.history) == []


async def all_up(h: Harness, nodes: list[int]) -> None:
    await h.all_up(nodes, bound=BOUND)


async def start_up(h: Harness, nodes: list[int]) -> None:
    await h.start_up(nodes, bound=BOUND)


async def test_singleton_runs_on_the_oldest_and_proxies_reach_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness(1) as h:
        await start_up(h, [1, 2, 3])
        running = await h.wait_running()
        assert running.node == "n1"
        for i in (1, 2, 3):
            proxy = h.nodes[i].singletons.proxy("counter")
            assert await proxy.ask(f"hello from n{i}", timeout=10) == ("n1", f"hello from n{i}")
        assert len(h.runs) == 1


async def test_a_serving_singleton_takes_each_message_as_it_arrives_in_order(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with harness(21) as h:
        await start_up(h, [1, 2])
        gate = trio.Event()
        seen: list[object] = []
        in_own_task: list[bool] = []

        async def served(ctx: SingletonContext) -> None:
            await gate.wait()  # until then, messages wait in the instance's inbox
            instance = trio.lowlevel.current_task()

            def handle(request: SingletonRequest) -> None:
                if request.message == "boom":
                    raise RuntimeError("boom")
                seen.append(request.message)
                in_own_task.append(trio.lowlevel.current_task() is instance)
                request.reply(len(seen))

            await ctx.serve(handle)

        for i in (1, 2):
            await h.nodes[i].singletons.start("served", served)
        proxy = h.nodes[2].singletons.proxy("served")
        for n in range(5):
            proxy.tell_nowait(n)
        await trio.sleep(2)
        assert seen == []
        gate.set()
        assert await proxy.ask("last", timeout=10) == 6
        assert seen == [0, 1, 2, 3, 4, "last"]
        # Those that waited were handled when it began serving; later ones as they arrived.
        assert in_own_task == [True] * 5 + [False]
        with caplog.at_level(logging.ERROR, logger="membership.singleton"):
            proxy.tell_nowait("boom")  # raised in the handler: the instance ends, and restarts
            await trio.sleep(3)  # the restart's back-off is a second
            assert await proxy.ask("again", timeout=10) == 7
        assert "singleton 'served' crashed; restarting" in caplog.text
        assert seen[-1] == "again"


async def test_an_idle_proxy_sends_at_once_and_keeps_order_behind_a_returned_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness(2) as h:
        await start_up(h, [1, 2])
        await h.wait_running()
        proxy = h.nodes[2].singletons.proxy("counter")
        assert await proxy.ask("warm-up", timeout=10) == ("n1", "warm-up")
        await trio.testing.wait_all_tasks_blocked()
        sent = proxy.statistics_sent
        proxy.tell_nowait("now")  # the proxy's task waits: sent in this task, at once
        assert proxy.statistics_sent == sent + 1
        proxy.tell_nowait("next")  # its task has not run since: it goes at once too
        assert proxy.statistics_sent == sent + 2
        # A message that came back (the singleton was not where the proxy sent it) is sent
        # again after a pause, and whatever is told meanwhile queues behind it.
        proxy._returned("returned", 0)
        proxy.tell_nowait("after")
        assert proxy.statistics_sent == sent + 2
        assert [payload for payload, _ in proxy._buffer] == ["returned", "after"]
        await trio.sleep(1)  # the pause is 0.1 s
        assert not proxy._buffer
        assert proxy.statistics_sent == sent + 4
        # To the instance on its own node, a proxy always goes through its task: the instance
        # would otherwise handle the message inside the caller's call.
        local = h.nodes[1].singletons.proxy("counter")
        assert await local.ask("warm-up", timeout=10) == ("n1", "warm-up")
        await trio.testing.wait_all_tasks_blocked()
        local.tell_nowait("queued")
        assert [payload for payload, _ in local._buffer] == ["queued"]
        await trio.testing.wait_all_tasks_blocked()
        assert not local._buffer


async def test_hand_over_when_the_oldest_leaves(autojump_clock: trio.testing.MockClock) -> None:
    async with harness(2) as h:
        await start_up(h, [1, 2, 3])
        await h.wait_running()
        await h.graceful_leave(1)
        running = await h.wait_running(exclude=frozenset({"n1"}))
        assert running.node == "n2"
        assert h.runs[0].end is not None
        proxy = h.nodes[3].singletons.proxy("counter")
        assert await proxy.ask("after", timeout=20) == ("n2", "after")


async def test_take_over_when_the_oldest_crashes(autojump_clock: trio.testing.MockClock) -> None:
    async with harness(3) as h:
        await start_up(h, [1, 2, 3])
        await h.wait_running()
        h.crash(1)
        running = await h.wait_running(exclude=frozenset({"n1"}))
        assert running.node == "n2"
        # Only after n1 was downed and removed: never while it might still run.
        assert all(m.node.name != "n1" for m in h.nodes[2].cluster.members)


async def test_three_oldest_of_six_crash_at_once(autojump_clock: trio.testing.MockClock) -> None:
    # keep-majority and keep-oldest would down the survivors here (3|3 with the lowest address
    # and the oldest gone), and static-quorum downs everyone above 2*quorum-1 members. With
    # lease-majority the side that is alive takes the lease and carries on.
    sbr = SplitBrainResolverSettings(active_strategy="lease-majority", stable_after=5.0)
    async with harness(4, sbr) as h:
        await start_up(h, list(range(1, 7)))
        await h.wait_running()
        for i in (1, 2, 3):
            h.crash(i)
        running = await h.wait_running(exclude=frozenset({"n1", "n2", "n3"}))
        assert running.node == "n4"
        assert await h.nodes[6].singletons.proxy("counter").ask("x", timeout=20) == ("n4", "x")


async def test_quick_restart_on_the_same_host_and_port(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness(5) as h:
        await start_up(h, [1, 2, 3])
        await h.wait_running()
        h.crash(1)
        await h.done[1].wait()
        await h.start(1)  # a new process at n1's host:port, right away
        running = await h.wait_running(exclude=frozenset({"n1"}))
        assert running.node == "n2"
        await all_up(h, [1, 2, 3])  # the new incarnation is in, as the youngest
        assert [r.node for r in h.running()] == ["n2"]


async def test_ask_without_any_eligible_member_times_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness(6) as h:
        node = await h.start(1)
        proxy = node.singletons.proxy("counter", role="nobody-has-this")
        with pytest.raises(SingletonUnavailable, match="did not answer within 2 s"):
            await proxy.ask("x", timeout=2)


async def test_ask_for_a_singleton_started_nowhere_times_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness(7) as h:
        await start_up(h, [1, 2])
        proxy = h.nodes[2].singletons.proxy("never-started")
        with pytest.raises(SingletonUnavailable, match="did not answer within 3 s"):
            await proxy.ask("x", timeout=3)
        assert proxy.statistics_returned >= 1  # the oldest sent it back: nothing runs there


async def test_singleton_with_a_lease_runs_only_while_it_holds_the_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness(8) as h:
        node = await h.start(1)
        owner = str(node.address)  # leases are owned by a node's incarnation
        assert await h.leases.try_acquire("guarded", "someone-else", 30.0) == 1
        runs: list[testing.Span] = []

        async def guarded(ctx: SingletonContext) -> None:
            run = testing.Span("n1", "guarded", trio.current_time())
            runs.append(run)
            try:
                await trio.sleep_forever()
            finally:
                run.end = trio.current_time()

        await node.singletons.start("guarded", guarded, lease=node.leases.lease("guarded"))
        await trio.sleep(25)
        assert not runs  # refused: another owner holds it
        await trio.sleep(10)  # it expired
        assert len(runs) == 1
        assert await h.leases.holder("guarded") == (owner, 2)

        h.leases.cut_off(owner)  # lost: the instance stops before the lease could be taken
        with trio.fail_after(60):
            while await h.leases.try_acquire("guarded", "someone-else", 5.0) is None:  # noqa: ASYNC110
                await trio.sleep(0.1)
        taken_at = trio.current_time()
        assert runs[0].end is not None
        assert runs[0].end < taken_at
        h.leases.cut_off(owner, False)
        await trio.sleep(10)  # the other grant expired: it runs again, under token 4
        assert len(runs) == 2
        assert runs[1].end is None
        assert await h.leases.holder("guarded") == (owner, 4)


async def test_lease_majority_a_two_two_split_leaves_the_side_that_got_the_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sbr = SplitBrainResolverSettings(active_strategy="lease-majority", stable_after=5.0)
    async with harness(9, sbr) as h:
        await start_up(h, [1, 2, 3, 4])
        h.net.partition([addr(1), addr(2)], [addr(3), addr(4)])
        with trio.fail_after(BOUND):
            while not (  # noqa: ASYNC110 - polls cluster state on the mock clock
                all(h.nodes[i].terminated.is_set() for i in (1, 2))
                or all(h.nodes[i].terminated.is_set() for i in (3, 4))
            ):
                await trio.sleep(0.5)
        holder = await h.leases.holder("sim-p2pshard-sbr")
        assert holder is not None
        survivors = [i for i in (1, 2, 3, 4) if not h.nodes[i].terminated.is_set()]
        # Equal halves: the side with the lowest address tries at once and the other waits
        # acquire_lease_delay_for_minority, so n1's side takes the lease and stays.
        assert survivors == [1, 2]
        assert holder[0] in {str(h.nodes[1].address), str(h.nodes[2].address)}
        assert {m.node.name for m in h.nodes[1].cluster.members} == {"n1", "n2"}


async def test_a_singleton_gets_no_message_once_its_lease_deadline_passed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The lease's deadline can pass before the task watching it runs (a process stopped past
    # it): a message that comes then is not handed to the instance.
    class Late:
        held = True
        token = 1

        def check(self) -> bool:
            return self.held

        async def acquire(self) -> Late:
            return self

        async def wait_lost(self) -> None:
            await trio.sleep_forever()  # never noticed in this test

        async def release(self) -> bool:
            return True

    lease = Late()
    got: list[object] = []

    async def guarded(ctx: SingletonContext) -> None:
        async for request in ctx:
            got.append(request.message)
            request.reply("ok")

    async with harness(10) as h:
        node = await h.start(1)
        await node.singletons.start("guarded", guarded, lease=lease)
        proxy = node.singletons.proxy("guarded")
        assert await proxy.ask("first", timeout=10) == "ok"
        lease.held = False
        with pytest.raises(SingletonUnavailable):
            await proxy.ask("second", timeout=5)
        assert got == ["first"]
