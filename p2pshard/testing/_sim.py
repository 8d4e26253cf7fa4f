"""A whole cluster of real nodes in one trio run, on the simulated network.

Theory of operation: every node is a real :func:`p2pshard.open_node` whose transport is a
:class:`membership.SimNetwork` link instead of TLS over TCP. Run it under
``trio.testing.MockClock(autojump_threshold=0)`` and ``membership.deterministic_scheduling(seed)``
and the run is a function of the seed: the network's delays, drops and faults come from the seeded
network, each node's random choices from a generator seeded by (seed, node, start count), and
time jumps ahead whenever every task waits, so a minute of cluster life takes a fraction of a
second. Node ``i`` listens on ``10.0.0.1:i`` and is named ``n<i>``; ``n1`` and ``n2`` are the seed
nodes.

A node started again after a crash is a new incarnation (new uid, new replicator client id),
as a restarted process is. :meth:`SimCluster.pause` holds every message to and from a node, and
its lease calls, for a while, as a long GC pause or CPU starvation does; the node's own timers
keep running (a limit of the simulation: a real pause stops them too). :meth:`SimCluster.skew`
makes the clock a node's leases read run faster or slower than the others' (and the lease
backend's): clock skew, for the lease's ``safety_margin``.
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio
import trio.testing

from membership import (
    Address,
    LinkConditions,
    MemberStatus,
    SimNetwork,
    SplitBrainResolverSettings,
)
from membership.internal import CURRENT_PROTOCOL, ProtocolRange

from .._config import NodeConfig, TlsFiles
from .._node import Node, open_node
from ..leases._lease import LeaseSettings
from ..leases._memory import MemoryLeaseBackend
from ..sharding._region import ShardRegion
from ._history import History

SIM_LEASES = LeaseSettings(ttl=4.0, renew_interval=1.0, operation_timeout=1.0, safety_margin=0.5)
"""Short leases, so that simulated runs see expiry and take-over within seconds."""

SIM_LINKS = LinkConditions(delay_min=0.001, delay_max=0.005)
"""The default link: 1 to 5 ms, FIFO, nothing lost (as TCP on a LAN)."""

BOUND = 120.0
"""Seconds (simulated) a wait for the cluster may take before it fails."""

_TLS = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))


class SkewedClock:
    """A :class:`~p2pshard.LeaseClock` that runs at ``rate`` times the trio clock's speed.

    It reads the trio clock's time until :meth:`set_rate` changes its rate; from then on it
    moves on from where it was at the new rate, as a drifting hardware clock does.
    """

    def __init__(self) -> None:
        self.rate = 1.0
        self._at_trio = 0.0
        self._at_reading = 0.0

    def now(self) -> float:
        """The current reading."""
        return self._at_reading + (trio.current_time() - self._at_trio) * self.rate

    def trio_time(self, reading: float) -> float:
        """When, on the trio clock, this clock will read ``reading`` at its current rate."""
        return self._at_trio + (reading - self._at_reading) / self.rate

    def set_rate(self, rate: float) -> None:
        """Run at ``rate`` times the trio clock's speed from now on (rate > 0)."""
        if not rate > 0:
            raise ValueError(f"a clock rate must be positive, not {rate!r}")
        self._at_reading, self._at_trio = self.now(), trio.current_time()
        self.rate = rate


Setup = Callable[[int, Node, Any], Awaitable[None]]
"""Called once per node start, inside the node, before it counts as started: start entity types
(store regions in ``sim.regions``), singletons, observers."""


C = TypeVar("C", bound="SimCluster")


def autojump_clock() -> trio.testing.MockClock:
    """A ``MockClock(autojump_threshold=0)`` for a simulated run, whose jumps cost less.

    trio's own jump asks for the whole run statistics (the I/O manager's too) every time the
    tasks all wait: in a simulated cluster thousands of times per simulated minute, a fortieth
    of a chaos run's time. This clock's jump reads the same next deadline straight from the
    runner's deadline heap (private parts of trio, as ``deterministic_scheduling`` uses), so it
    jumps to the same times. Where trio lacks those parts it is a plain one: the same run.
    """
    clock = trio.testing.MockClock(autojump_threshold=0)
    run_module: Any = importlib.import_module("trio._core._run")
    context = getattr(run_module, "GLOBAL_RUN_CONTEXT", None)
    deadlines = getattr(run_module, "Deadlines", None)
    if (
        context is None
        or not callable(getattr(deadlines, "next_deadline", None))
        or not callable(getattr(clock, "_autojump", None))
    ):
        return clock

    def autojump() -> None:
        jump = context.runner.deadlines.next_deadline() - clock.current_time()
        if 0 < jump < math.inf:
            clock.jump(jump)

    clock._autojump = autojump  # type: ignore[method-assign]
    return clock


def node_address(i: int) -> Address:
    """Where simulated node ``i`` listens: ``10.0.0.1:i``."""
    return Address("10.0.0.1", i)


def node_name(i: int) -> str:
    """Simulated node ``i``'s name: ``n<i>``."""
    return f"n{i}"


@attrs.define(eq=False)
class SimCluster:
    """Nodes on one :class:`membership.SimNetwork`, started, crashed and paused by number.

    Get one from :func:`simulated_cluster`. ``nodes`` holds the running nodes by number,
    ``regions`` the region each node's ``setup`` put there, ``history`` what the checkers read.

    Example:
        >>> async def main() -> None:
        ...     async with simulated_cluster(seed=7) as sim:
        ...         for i in (1, 2, 3):
        ...             await sim.start(i)
        ...         await sim.all_up([1, 2, 3])
        ...         sim.crash(3)
    """

    net: SimNetwork
    nursery: trio.Nursery
    setup: Setup | None = None
    history: History = attrs.field(factory=History)
    seeds: tuple[Address, ...] = (node_address(1), node_address(2))
    roles: dict[int, tuple[str, ...]] = attrs.field(factory=dict)
    stable_after: float = 5.0
    split_brain_resolver: SplitBrainResolverSettings | None = None
    """Overrides ``stable_after`` when set."""
    lease_backend: MemoryLeaseBackend | None = None
    lease_settings: LeaseSettings = SIM_LEASES
    links: LinkConditions = SIM_LINKS
    exit_when_terminated: bool = False
    """Let a node that is downed (or removed) exit, as the ``p2pshard node`` command does."""
    on_exit: Callable[[int], None] | None = None
    """Called with the node number whenever a node stops, for whatever reason."""
    configure: Callable[[int, NodeConfig], NodeConfig] | None = None
    """Adjusts each node's configuration before it starts."""
    protocols: dict[int, ProtocolRange] = attrs.field(factory=dict)
    """The wire protocol versions each node speaks from its next start on (a node not named
    here: this release's, ``CURRENT_PROTOCOL``): another build of the node, in a rolling
    upgrade."""
    nodes: dict[int, Node] = attrs.field(factory=dict)
    regions: dict[int, ShardRegion] = attrs.field(factory=dict)
    scopes: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    leave: dict[int, trio.Event] = attrs.field(factory=dict)
    done: dict[int, trio.Event] = attrs.field(factory=dict)
    starts: dict[int, int] = attrs.field(factory=dict)
    paused_until: dict[int, float] = attrs.field(factory=dict)
    lease_clocks: dict[int, SkewedClock] = attrs.field(factory=dict)
    """The clock each node's leases read; a restarted node keeps its host's clock."""

    @property
    def live(self) -> list[int]:
        """The numbers of the running nodes, sorted."""
        return sorted(self.nodes)

    async def start(self, i: int) -> Node:
        """Start node ``i`` (again) and return it once it runs and ``setup`` is done."""
        return await self.nursery.start(self._run, i)  # type: ignore[no-any-return]

    async def _run(self, i: int, *, task_status: trio.TaskStatus[Node]) -> None:
        sbr = self.split_brain_resolver or SplitBrainResolverSettings(
            stable_after=self.stable_after
        )
        config = NodeConfig(
            cluster_name="sim",
            node_name=node_name(i),
            bind_host="10.0.0.1",
            bind_port=i,
            seed_nodes=self.seeds,
            tls=_TLS,
            roles=self.roles.get(i, ()),
            split_brain_resolver=sbr,
            shutdown_timeout=30.0,
            lease=self.lease_settings,
        )
        if self.configure is not None:
            config = self.configure(i, config)
        self.starts[i] = self.starts.get(i, 0) + 1
        rng = random.Random(f"{self.net.seed}/{i}/{self.starts[i]}")
        self.leave[i], self.done[i] = trio.Event(), trio.Event()
        try:
            with trio.CancelScope() as scope:
                self.scopes[i] = scope
                async with (
                    self.net.transport(
                        node_address(i),
                        node_name(i),
                        protocol=self.protocols.get(i, CURRENT_PROTOCOL),
                    ) as transport,
                    open_node(
                        config,
                        transport=transport,
                        rng=rng,
                        lease_backend=self.lease_backend,
                        lease_clock=self.lease_clocks.setdefault(i, SkewedClock()),
                    ) as node,
                ):
                    self.nodes[i] = node
                    if self.setup is not None:
                        await self.setup(i, node, self)
                    task_status.started(node)
                    if self.exit_when_terminated:
                        async with trio.open_nursery() as either:
                            for event in (self.leave[i], node.terminated):
                                either.start_soon(_set_then_cancel, event, either.cancel_scope)
                    else:
                        await self.leave[i].wait()
        finally:
            self.nodes.pop(i, None)
            self.regions.pop(i, None)
            self.history.node_gone(node_name(i))
            self.done[i].set()
            if self.on_exit is not None:
                self.on_exit(i)

    def crash(self, i: int) -> None:
        """Kill node ``i`` at once: its links die, messages in flight are lost.

        Its leases stay with it until they expire, as a killed process's do.
        """
        node = self.nodes.get(i)
        if node is not None and node._leases is not None:
            node._leases.abandon_all()
        self.net.crash(node_address(i))
        self.scopes[i].cancel()

    async def graceful_leave(self, i: int) -> None:
        """Leave the ``open_node`` block of node ``i`` (hand-off, leave, exit) and wait for it."""
        self.leave[i].set()
        await self.done[i].wait()

    def partition(
        self, a: int | Iterable[int], b: int | Iterable[int], *, one_way: bool = False
    ) -> None:
        """Block the links from nodes ``a`` to nodes ``b`` (and back unless ``one_way``)."""
        self.net.partition(_addresses(a), _addresses(b), one_way=one_way)

    def heal(self) -> None:
        """Lift every partition (link conditions set by :meth:`pause` or tests stay)."""
        self.net.heal()

    def set_links(self, i: int, conditions: LinkConditions, *, among: Iterable[int]) -> None:
        """Set the conditions of every link between node ``i`` and the nodes ``among``."""
        for j in among:
            if j != i:
                self.net.set_link(node_address(i), node_address(j), conditions)
                self.net.set_link(node_address(j), node_address(i), conditions)

    async def pause(self, i: int, seconds: float, *, among: Iterable[int]) -> None:
        """Hold every message to and from node ``i`` (and its lease calls) for ``seconds``.

        The messages are delivered afterwards, as after a stop-the-world pause; returns when the
        pause is over and the links are back to :attr:`links`.
        """
        among = list(among)
        until = trio.current_time() + seconds
        self.paused_until[i] = until
        self.set_links(i, LinkConditions(delay_min=seconds, delay_max=seconds), among=among)
        if self.lease_backend is not None and i in self.nodes:
            self.lease_backend.pause(str(self.nodes[i].address), until)
        await trio.sleep(seconds)
        self.set_links(i, self.links, among=among)
        self.paused_until.pop(i, None)

    def skew(self, i: int, rate: float) -> None:
        """Make the clock node ``i``'s leases read run at ``rate`` times everyone else's speed.

        A rate under 1 makes the node believe it holds a lease longer than the backend keeps
        it; ``safety_margin`` covers rates down to ``1 - safety_margin / ttl``. ``rate=1`` ends
        the skew (the clock keeps the offset it gained).
        """
        self.lease_clocks.setdefault(i, SkewedClock()).set_rate(rate)

    async def start_up(self, nodes: list[int], *, bound: float = BOUND) -> None:
        """Start each of ``nodes`` in turn, then wait until they all see one another Up."""
        for i in nodes:
            await self.start(i)
        await self.all_up(nodes, bound=bound)

    async def all_up(self, nodes: list[int], *, bound: float = BOUND) -> None:
        """Wait until each of ``nodes`` sees exactly ``nodes`` as members, all Up."""
        want = {node_name(i): MemberStatus.UP for i in nodes}
        with trio.fail_after(bound):
            while not all(  # noqa: ASYNC110 - polls cluster state on the mock clock
                i in self.nodes
                and {m.node.name: m.status for m in self.nodes[i].cluster.members} == want
                for i in nodes
            ):
                await trio.sleep(0.1)


def simulated_cluster(
    seed: int,
    setup: Setup | None = None,
    *,
    links: LinkConditions | None = None,
    history: History | None = None,
) -> AbstractAsyncContextManager[SimCluster]:
    """A :class:`SimCluster` on a network seeded with ``seed``; it prints the seed first.

    Leaving the block cancels every node (as a crash of all of them). Run it under a
    ``MockClock`` and ``deterministic_scheduling(seed)`` for a replayable run.
    """
    return simulated_cluster_of(SimCluster, seed, setup, links=links, history=history)


@asynccontextmanager
async def simulated_cluster_of(
    cluster: Callable[..., C],
    seed: int,
    setup: Setup | None = None,
    *,
    links: LinkConditions | None = None,
    history: History | None = None,
    **fields: Any,
) -> AsyncIterator[C]:
    """As :func:`simulated_cluster`, made by ``cluster`` with ``fields`` as further attributes.

    ``cluster`` is a subclass of :class:`SimCluster`, for a harness of your own.
    """
    print(f"seed={seed}")
    links = links or SIM_LINKS
    net = SimNetwork(seed, conditions=links)
    async with trio.open_nursery() as nursery:
        sim = cluster(net, nursery, setup, history or History(), links=links, **fields)
        yield sim
        nursery.cancel_scope.cancel()


def _addresses(nodes: int | Iterable[int]) -> list[Address]:
    if isinstance(nodes, int):
        return [node_address(nodes)]
    return [node_address(i) for i in nodes]


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
