"""A simulated cluster running sharded entities, for the sharding scenario tests.

Each node runs ``open_node`` over one :class:`SimNetwork` (``p2pshard.testing.SimCluster``), and
starts the entity type ``Counter`` (or whatever the test passes). :class:`IncarnationLog` is the
workload's checker: every ``Counter`` incarnation records the (sender, sequence number) pairs it
handled, so a test can assert that no message was lost and that each sender's numbers arrived
in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import trio

from membership import LinkConditions
from p2pshard import EntityContext, HashExtractor, Node, message, testing


@message(name="tests.sharding.Add")
@attrs.frozen(kw_only=True)
class CounterAdd:
    sender: str
    seq: int


@message(name="tests.sharding.Read")
@attrs.frozen(kw_only=True)
class CounterRead:
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


addr = testing.node_address


@attrs.define
class Incarnation:
    node: str
    entity_id: str
    start: float
    end: float | None = None
    handled: list[tuple[str, int]] = attrs.field(factory=list)


@attrs.define
class IncarnationLog:
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


def counter_factory(journal: IncarnationLog, node: str) -> Callable[[EntityContext], Any]:
    class Counter:
        def __init__(self, ctx: EntityContext) -> None:
            self.inc = Incarnation(node, ctx.entity_id, trio.current_time())
            journal.incarnations.append(self.inc)

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            match msg:
                case CounterAdd(sender=sender, seq=seq):
                    self.inc.handled.append((sender, seq))
                    return len(self.inc.handled)
                case CounterRead():
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


@attrs.define(eq=False)
class CounterSim(testing.SimCluster):
    """The package's simulated cluster, plus the journal of the test counter below."""

    journal: IncarnationLog = attrs.field(factory=IncarnationLog)


def standard_setup(
    number_of_shards: int = 10, **kwargs: Any
) -> Callable[[int, Node, CounterSim], Awaitable[None]]:
    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        sim.regions[i] = await node.sharding.start(
            "Counter",
            counter_factory(sim.journal, f"n{i}"),
            extractor=HashExtractor(number_of_shards),
            **kwargs,
        )

    return setup


def sim_cluster(
    seed: int,
    setup: Callable[[int, Node, CounterSim], Awaitable[None]] | None = None,
    *,
    conditions: LinkConditions | None = None,
) -> AbstractAsyncContextManager[CounterSim]:
    return testing.simulated_cluster_of(
        CounterSim, seed, setup or standard_setup(), links=conditions
    )
