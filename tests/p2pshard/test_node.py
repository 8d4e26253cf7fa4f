"""open_node on the simulated network: nodes form a cluster, leave gracefully, get downed."""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from membership import Address, LinkConditions, SimNetwork
from membership._member import MemberStatus
from membership.sbr._settings import SplitBrainResolverSettings
from p2pshard import Node, NodeConfig, TlsFiles, open_node

TLS = TlsFiles(
    ca_file=Path("unused-ca.pem"), cert_file=Path("unused.pem"), key_file=Path("unused.key")
)
SEEDS = (Address("10.0.0.1", 1), Address("10.0.0.1", 2))


def config(i: int) -> NodeConfig:
    return NodeConfig(
        cluster_name="sim",
        node_name=f"n{i}",
        bind_host="10.0.0.1",
        bind_port=i,
        seed_nodes=SEEDS,
        tls=TLS,
        split_brain_resolver=SplitBrainResolverSettings(stable_after=5.0),
    )


@attrs.define
class Nodes:
    net: SimNetwork
    nursery: trio.Nursery
    nodes: dict[int, Node] = attrs.field(factory=dict)
    stops: dict[int, trio.Event] = attrs.field(factory=dict)
    stopped: dict[int, trio.Event] = attrs.field(factory=dict)

    async def start(self, i: int) -> Node:
        return await self.nursery.start(self._run, i)  # type: ignore[no-any-return]

    async def _run(self, i: int, *, task_status: trio.TaskStatus[Node]) -> None:
        self.stops[i], self.stopped[i] = trio.Event(), trio.Event()
        try:
            async with (
                self.net.transport(Address("10.0.0.1", i), f"n{i}") as transport,
                open_node(config(i), transport=transport, rng=random.Random(i)) as node,
            ):
                self.nodes[i] = node
                task_status.started(node)
                await self.stops[i].wait()
        finally:
            self.stopped[i].set()

    async def stop(self, i: int) -> None:
        self.stops[i].set()
        await self.stopped[i].wait()


@asynccontextmanager
async def nodes(seed: int) -> AsyncIterator[Nodes]:
    net = SimNetwork(seed, conditions=LinkConditions(delay_min=0.001, delay_max=0.005))
    async with trio.open_nursery() as nursery:
        yield Nodes(net, nursery)
        nursery.cancel_scope.cancel()


async def eventually(predicate: Callable[[], bool], limit: float = 120) -> None:
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - polls cluster state on the mock clock
            await trio.sleep(0.1)


def view(node: Node) -> dict[str, MemberStatus]:
    return {m.node.name: m.status for m in node.cluster.members}


async def test_nodes_form_a_cluster_and_one_leaves_gracefully(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with nodes(seed=3) as c:
        for i in (1, 2, 3):
            await c.start(i)
        up = {f"n{i}": MemberStatus.UP for i in (1, 2, 3)}
        await eventually(lambda: all(view(c.nodes[i]) == up for i in (1, 2, 3)))
        member = await c.nodes[3].cluster.wait_up()
        assert member.status is MemberStatus.UP
        await c.stop(2)  # leaving the block: Leaving -> Exiting -> Removed
        assert c.nodes[2].terminated.is_set()
        assert c.nodes[2].cluster.termination_reason == "removed from the cluster"
        await eventually(lambda: view(c.nodes[1]) == {"n1": MemberStatus.UP, "n3": MemberStatus.UP})


async def test_a_downed_node_terminates(autojump_clock: trio.testing.MockClock) -> None:
    async with nodes(seed=4) as c:
        for i in (1, 2):
            await c.start(i)
        await eventually(lambda: len(view(c.nodes[1])) == 2 and c.nodes[1].cluster.has_converged())
        c.nodes[1].cluster.down(c.nodes[2].address.address)
        await eventually(lambda: c.nodes[2].terminated.is_set())
        assert c.nodes[2].cluster.termination_reason == "downed"


async def test_an_error_in_the_block_comes_out_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(seed=1)
    with pytest.raises(ValueError, match="boom"):
        async with (
            net.transport(Address("10.0.0.1", 1), "n1") as transport,
            open_node(config(1), transport=transport),
        ):
            raise ValueError("boom")


# -- joining without seed nodes: self_join, and wait_up's warning ---------------------------------


def lone_config(**changes: Any) -> NodeConfig:
    """A node with no seed nodes."""
    return NodeConfig(
        cluster_name="sim", node_name="n1", bind_host="10.0.0.1", bind_port=1, tls=TLS, **changes
    )


class TimedRecords(logging.Handler):
    """Log records of one logger with the (mock) trio time they were emitted at."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((trio.current_time(), record.getMessage()))

    @contextmanager
    def on(self, name: str) -> Iterator[TimedRecords]:
        log = logging.getLogger(name)
        log.addHandler(self)
        try:
            yield self
        finally:
            log.removeHandler(self)


async def test_a_self_join_node_forms_a_cluster_of_its_own_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(seed=5)
    async with (
        net.transport(Address("10.0.0.1", 1), "n1") as transport,
        open_node(lone_config(self_join=True), transport=transport) as node,
    ):
        with trio.fail_after(30):  # a few leader rounds; there is no seed node to wait for
            member = await node.cluster.wait_up()
        assert member.status is MemberStatus.UP
        assert view(node) == {"n1": MemberStatus.UP}


async def test_wait_up_with_nowhere_to_join_warns_at_once_and_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(seed=6)
    with TimedRecords().on("membership.cluster") as log:
        async with (
            net.transport(Address("10.0.0.1", 1), "n1") as transport,
            open_node(lone_config(), transport=transport) as node,
        ):
            started = trio.current_time()
            for _ in range(2):
                with trio.move_on_after(60) as waiting:
                    await node.cluster.wait_up()
                assert waiting.cancelled_caught  # nobody told it to join: it is not Up
            warnings = [(t, m) for t, m in log.records if "wait_up() waits" in m]
            assert warnings == [(started, warnings[0][1])]  # once, before any time passed
            assert "no seed nodes" in warnings[0][1]
            assert "node.cluster.join(address)" in warnings[0][1]
            node.cluster.join(node.address.address)  # the join it waited for: now it gets Up
            with trio.fail_after(30):
                await node.cluster.wait_up()


async def test_wait_up_does_not_warn_while_joining_through_seed_nodes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with TimedRecords().on("membership.cluster") as log:
        async with nodes(seed=7) as c:
            node = await c.start(1)
            with trio.fail_after(60):
                await node.cluster.wait_up()  # the first seed forms the cluster after a while
    assert not [m for _, m in log.records if "wait_up() waits" in m]


async def test_node_statistics_is_a_deprecated_alias_of_transport_statistics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(seed=7)
    async with (
        net.transport(Address("10.0.0.1", 1), "n1") as transport,
        open_node(lone_config(self_join=True), transport=transport) as node,
    ):
        with pytest.warns(DeprecationWarning, match=r"use Node\.transport_statistics\(\)"):
            old = node.statistics()
        assert old.peers == node.transport_statistics().peers
