"""A simulated cluster of nodes with replicators, for the replicator's whole-cluster tests."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
from pycrdt import Doc, Map

from crdt import ReplicatorSettings
from membership import Address, LinkConditions, SimNetwork
from membership._member import MemberStatus
from membership.sbr._settings import SplitBrainResolverSettings
from p2pshard import Node, NodeConfig, TlsFiles, open_node

TLS = TlsFiles(
    ca_file=Path("unused-ca.pem"), cert_file=Path("unused.pem"), key_file=Path("unused.key")
)
HOST = "10.0.0.1"


def config(
    i: int,
    replicator: ReplicatorSettings,
    sbr: SplitBrainResolverSettings,
    roles: tuple[str, ...] = (),
) -> NodeConfig:
    return NodeConfig(
        cluster_name="sim",
        node_name=f"n{i}",
        bind_host=HOST,
        bind_port=i,
        seed_nodes=(Address(HOST, 1), Address(HOST, 2)),
        tls=TLS,
        split_brain_resolver=sbr,
        replicator=replicator,
        roles=roles,
    )


@attrs.define
class ReplicatorCluster:
    """Nodes n1..nN on one simulated network; ``start``/``stop``/``crash`` by number."""

    net: SimNetwork
    nursery: trio.Nursery
    seed: int
    replicator: ReplicatorSettings
    sbr: SplitBrainResolverSettings
    nodes: dict[int, Node] = attrs.field(factory=dict)
    scopes: dict[int, trio.CancelScope] = attrs.field(factory=dict)
    stops: dict[int, trio.Event] = attrs.field(factory=dict)
    stopped: dict[int, trio.Event] = attrs.field(factory=dict)
    starts: int = 0
    roles: dict[int, tuple[str, ...]] = attrs.field(factory=dict)

    async def start(self, i: int) -> Node:
        node: Node = await self.nursery.start(self._run, i)
        return node

    async def _run(self, i: int, *, task_status: trio.TaskStatus[Node]) -> None:
        self.stops[i], self.stopped[i] = trio.Event(), trio.Event()
        self.starts += 1
        rng = random.Random(f"{self.seed}-{i}-{self.starts}")
        try:
            with trio.CancelScope() as scope:
                self.scopes[i] = scope
                async with (
                    self.net.transport(Address(HOST, i), f"n{i}") as transport,
                    open_node(
                        config(i, self.replicator, self.sbr, self.roles.get(i, ())),
                        transport=transport,
                        rng=rng,
                    ) as node,
                ):
                    self.nodes[i] = node
                    task_status.started(node)
                    await self.stops[i].wait()
        finally:
            self.stopped[i].set()

    async def stop(self, i: int) -> None:
        """Leave gracefully."""
        self.stops[i].set()
        await self.stopped[i].wait()

    async def crash(self, i: int) -> None:
        """Stop at once, as kill -9 would: no leave."""
        self.net.crash(Address(HOST, i))
        self.scopes[i].cancel()
        await self.stopped[i].wait()

    async def start_up(self, *numbers: int) -> None:
        """Start each of ``numbers`` in turn, then wait until they all see one another Up."""
        for i in numbers:
            await self.start(i)
        await self.all_up(*numbers)

    async def all_up(self, *numbers: int) -> None:
        def up() -> bool:
            for i in numbers:
                view = {m.node.name: m.status for m in self.nodes[i].cluster.members}
                if view != {f"n{j}": MemberStatus.UP for j in numbers}:
                    return False
            return True

        try:
            await eventually(up)
        except trio.TooSlowError:
            for i in numbers:  # what each node saw, to tell why
                node = self.nodes[i]
                members = [f"{m.node} {m.status.name}" for m in node.cluster.members]
                unreachable = [str(m.node) for m in node.cluster.unreachable]
                print(f"n{i}: members {members}, unreachable {unreachable}")
            raise


@asynccontextmanager
async def cluster(
    seed: int,
    replicator: ReplicatorSettings | None = None,
    *,
    conditions: LinkConditions | None = None,
    sbr: SplitBrainResolverSettings | None = None,
) -> AsyncIterator[ReplicatorCluster]:
    net = SimNetwork(
        seed, conditions=conditions or LinkConditions(delay_min=0.001, delay_max=0.005)
    )
    async with trio.open_nursery() as nursery:
        yield ReplicatorCluster(
            net,
            nursery,
            seed,
            replicator or ReplicatorSettings(gossip_interval=0.5),
            sbr or SplitBrainResolverSettings(stable_after=3600.0),
        )
        nursery.cancel_scope.cancel()


async def eventually(predicate: Callable[[], bool], limit: float = 120) -> None:
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - polls replicated state on the mock clock
            await trio.sleep(0.05)


def setter(name: str, value: Any) -> Callable[[Doc[Any]], None]:
    """A modify function: ``doc["m"][name] = value``."""

    def modify(doc: Doc[Any]) -> None:
        doc.get("m", type=Map)[name] = value

    return modify


def content(doc: Doc[Any] | None) -> dict[str, Any] | None:
    """The ``m`` map of a document as a dict (None for no document)."""
    return None if doc is None else dict(doc.get("m", type=Map))
