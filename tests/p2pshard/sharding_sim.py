"""A simulated cluster running sharded entities, for the sharding scenario tests.

Each node runs ``open_node`` over one :class:`SimNetwork` with a seeded rng, and starts the
entity type ``Counter`` (or whatever the test passes). :class:`Journal` is the workload's
checker: every ``Counter`` incarnation records the (sender, sequence number) pairs it handled,
so a test can assert that no message was lost and that each sender's numbers arrived in order.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from membership import Address, LinkConditions, SimNetwork
from membership._member import MemberStatus
from membership._sbr import SplitBrainResolverSettings
from p2pshard import (
    EntityContext,
    HashExtractor,
    LeaseSettings,
    MemoryLeaseBackend,
    Node,
    NodeConfig,
    TlsFiles,
    message,
    open_node,
)
from p2pshard._region import ShardRegion

TLS = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))
BOUND = 120.0


def addr(i: int) -> Address:
    return Address("10.0.0.1", i)


@message(name="tests.sharding.Add")
@attrs.frozen(kw_only=True)
class Add:
    sender: str
    seq: int


@message(name="tests.sharding.Read")
@attrs.frozen(kw_only=True)
class Read:
    pass


@message(name="tests.sharding.Fail")
@attrs.frozen(kw_only=True)
class Fail:
    text: str


@message(name="tests.sharding.Sleep")
@attrs.frozen(kw_only=True)
class Sleep:
    seconds: float


@message(name="tests.sharding.Passivate")
@attrs.frozen(kw_only=True)
class PassivateMe:
    pass


@message(name="tests.sharding.Stop")
@attrs.frozen(kw_only=True)
class StopNow:
    pass


SIM_LEASES = LeaseSettings(ttl=4.0, renew_interval=1.0, operation_timeout=1.0, safety_margin=0.5)
"""Short leases, so that simulated runs see expiry and take-over within seconds."""


@attrs.define
class Incarnation:
    node: str
    entity_id: str
    start: float
    end: float | None = None
    handled: list[tuple[str, int]] = attrs.field(factory=list)


@attrs.define
class Journal:
    """Every incarnation of every entity, and what each handled."""

    incarnations: list[Incarnation] = attrs.field(factory=list)
    stop_messages: int = 0

    def of(self, entity_id: str) -> list[Incarnation]:
        return [i for i in self.incarnations if i.entity_id == entity_id]

    def handled(self, entity_id: str) -> list[tuple[str, int]]:
        return [pair for i in self.of(entity_id) for pair in i.handled]

    def check_per_sender_order(self, entity_id: str, sent: dict[str, int]) -> None:
        """Every sender's 1..n arrived, each once, in order (across incarnations)."""
        seen: dict[str, list[int]] = {}
        for sender, seq in self.handled(entity_id):
            seen.setdefault(sender, []).append(seq)
        for sender, n in sent.items():
            assert seen.get(sender, []) == list(range(1, n + 1)), (
                f"{entity_id}: {sender} sent 1..{n}, entity saw {seen.get(sender)}"
            )

    def check_one_at_a_time(self) -> None:
        """No two incarnations of one entity overlapped in time."""
        by_entity: dict[str, list[Incarnation]] = {}
        for inc in self.incarnations:
            by_entity.setdefault(inc.entity_id, []).append(inc)
        for entity_id, incs in by_entity.items():
            incs.sort(key=lambda i: i.start)
            for a, b in itertools.pairwise(incs):
                assert a.end is not None, f"{entity_id}: {a.node}'s incarnation never ended"
                assert a.end <= b.start, f"{entity_id}: incarnations overlap: {a.node}, {b.node}"


@attrs.define
class Span:
    node: str
    entity_id: str
    start: float
    end: float | None = None
    token: int | None = None


@attrs.define
class ActivationChecker:
    """Every entity incarnation on every node; :meth:`violations` finds overlapping ones."""

    spans: dict[str, list[Span]] = attrs.field(factory=dict)
    open: dict[str, dict[str, Span]] = attrs.field(factory=dict)

    def observer(self, node: str) -> Any:
        checker = self

        class Observer:
            def entity_started(self, type_name: str, entity_id: str, token: int | None) -> None:
                checker.started(node, entity_id, token)

            def entity_stopped(self, type_name: str, entity_id: str) -> None:
                checker.stopped(node, entity_id)

        return Observer()

    def started(self, node: str, entity_id: str, token: int | None) -> None:
        span = Span(node, entity_id, trio.current_time(), token=token)
        self.spans.setdefault(entity_id, []).append(span)
        self.open.setdefault(node, {})[entity_id] = span

    def stopped(self, node: str, entity_id: str) -> None:
        span = self.open.get(node, {}).pop(entity_id, None)
        if span is not None:
            span.end = trio.current_time()

    def node_gone(self, node: str) -> None:
        """The node crashed or exited: its incarnations end now."""
        for span in self.open.pop(node, {}).values():
            span.end = trio.current_time()

    def incarnations(self) -> int:
        return sum(len(spans) for spans in self.spans.values())

    def violations(self) -> list[str]:
        """One line per pair of incarnations of one entity alive at the same instant."""
        found = []
        for entity_id, spans in sorted(self.spans.items()):
            ordered = sorted(spans, key=lambda s: s.start)
            for i, a in enumerate(ordered):
                a_end = float("inf") if a.end is None else a.end
                for b in ordered[i + 1 :]:
                    if b.start >= a_end:
                        break
                    found.append(
                        f"{entity_id}: {a.node} [{a.start:.3f}, {a.end}] token {a.token} and "
                        f"{b.node} [{b.start:.3f}, {b.end}] token {b.token} overlap"
                    )
        return found


def counter_factory(journal: Journal, node: str) -> Callable[[EntityContext], Any]:
    class Counter:
        def __init__(self, ctx: EntityContext) -> None:
            self.inc = Incarnation(node, ctx.entity_id, trio.current_time())
            journal.incarnations.append(self.inc)

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            match msg:
                case Add(sender=sender, seq=seq):
                    self.inc.handled.append((sender, seq))
                    return len(self.inc.handled)
                case Read():
                    return (node, len(self.inc.handled))
                case Fail(text=text):
                    raise RuntimeError(text)
                case Sleep(seconds=seconds):
                    await trio.sleep(seconds)
                    return "slept"
                case PassivateMe():
                    ctx.passivate()
                    return "passivating"
                case StopNow():
                    journal.stop_messages += 1
                    self.inc.end = trio.current_time()
                    return None
            return None

    return Counter


@attrs.define
class SimCluster:
    net: SimNetwork
    nursery: trio.Nursery
    journal: Journal
    setup: Callable[[int, Node, SimCluster], Awaitable[None]] | None
    nodes: dict[int, Node] = attrs.field(factory=dict)
    regions: dict[int, ShardRegion] = attrs.field(factory=dict)
    scopes: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    leave: dict[int, trio.Event] = attrs.field(factory=dict)
    done: dict[int, trio.Event] = attrs.field(factory=dict)
    seeds: tuple[Address, ...] = (addr(1), addr(2))
    roles: dict[int, tuple[str, ...]] = attrs.field(factory=dict)
    stable_after: float = 5.0
    lease_backend: MemoryLeaseBackend | None = None
    lease_settings: LeaseSettings = SIM_LEASES
    exit_when_terminated: bool = False
    on_exit: Callable[[int], None] | None = None

    async def start(self, i: int) -> Node:
        return await self.nursery.start(self._run, i)  # type: ignore[no-any-return]

    async def _run(self, i: int, *, task_status: trio.TaskStatus[Node]) -> None:
        config = NodeConfig(
            cluster_name="sim",
            node_name=f"n{i}",
            bind_host="10.0.0.1",
            bind_port=i,
            seed_nodes=self.seeds,
            tls=TLS,
            roles=self.roles.get(i, ()),
            split_brain_resolver=SplitBrainResolverSettings(stable_after=self.stable_after),
            shutdown_timeout=30.0,
            lease=self.lease_settings,
        )
        self.leave[i], self.done[i] = trio.Event(), trio.Event()
        try:
            with trio.CancelScope() as scope:
                self.scopes[i] = scope
                async with (
                    self.net.transport(addr(i), f"n{i}") as transport,
                    open_node(
                        config,
                        transport=transport,
                        rng=random.Random(i),
                        lease_backend=self.lease_backend,
                    ) as node,
                ):
                    self.nodes[i] = node
                    if self.setup is not None:
                        await self.setup(i, node, self)
                    task_status.started(node)
                    if self.exit_when_terminated:  # as the node command does
                        async with trio.open_nursery() as either:
                            for event in (self.leave[i], node.terminated):
                                either.start_soon(_set_then_cancel, event, either.cancel_scope)
                    else:
                        await self.leave[i].wait()
        finally:
            self.nodes.pop(i, None)
            self.regions.pop(i, None)
            self.done[i].set()
            if self.on_exit is not None:
                self.on_exit(i)

    def crash(self, i: int) -> None:
        self.net.crash(addr(i))
        self.scopes[i].cancel()

    async def graceful_leave(self, i: int) -> None:
        self.leave[i].set()
        await self.done[i].wait()

    async def all_up(self, nodes: list[int]) -> None:
        want = {f"n{i}": MemberStatus.UP for i in nodes}
        with trio.fail_after(BOUND):
            while not all(  # noqa: ASYNC110 - polls cluster state on the mock clock
                i in self.nodes
                and {m.node.name: m.status for m in self.nodes[i].cluster.members} == want
                for i in nodes
            ):
                await trio.sleep(0.1)


def standard_setup(
    number_of_shards: int = 10, **kwargs: Any
) -> Callable[[int, Node, SimCluster], Awaitable[None]]:
    async def setup(i: int, node: Node, sim: SimCluster) -> None:
        sim.regions[i] = await node.sharding.start(
            "Counter",
            counter_factory(sim.journal, f"n{i}"),
            extractor=HashExtractor(number_of_shards),
            **kwargs,
        )

    return setup


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


@asynccontextmanager
async def sim_cluster(
    seed: int,
    setup: Callable[[int, Node, SimCluster], Awaitable[None]] | None = None,
    *,
    conditions: LinkConditions | None = None,
) -> AsyncIterator[SimCluster]:
    print(f"seed={seed}")
    net = SimNetwork(
        seed, conditions=conditions or LinkConditions(delay_min=0.001, delay_max=0.005)
    )
    async with trio.open_nursery() as nursery:
        sim = SimCluster(net, nursery, Journal(), setup or standard_setup())
        yield sim
        nursery.cancel_scope.cancel()
