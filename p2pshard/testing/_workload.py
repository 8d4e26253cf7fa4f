"""Workloads for chaos runs: a counter with per-sender sequence numbers, and a singleton probe.

The counter entity (:func:`counter_entity`) writes every ``Add(sender, seq)`` it handles to its
log in the :class:`~p2pshard.testing.History` before it answers, so the answer (the
acknowledgement) means "handled and logged". :class:`CounterWorkload` runs clients, each bound to
one node, that send numbered messages to random entities and record what was acknowledged. The
checkers then ask: is every acknowledged message in its entity's log exactly once, and did each
sender's messages arrive in order?

:func:`singleton_probe` is a singleton that records each of its instances, for the at-most-one-
singleton invariant.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import trio

from membership import ClusterError, SingletonContext, message

from ..persistence._event_sourced import EventSourcedEntity
from ..sharding._entity import EntityContext
from ._history import History
from ._sim import SimCluster, node_name


@message(name="p2pshard.testing.Add")
@attrs.frozen(kw_only=True)
class Add:
    """Counter workload: ``sender``'s message number ``seq``; answered with the log length."""

    sender: str
    seq: int


@message(name="p2pshard.testing.Read")
@attrs.frozen(kw_only=True)
class Read:
    """Counter workload: answered with how many messages the entity has logged."""


@message(name="p2pshard.testing.Stall")
@attrs.frozen(kw_only=True)
class Stall:
    """Counter workload: the counter sleeps ``seconds`` before it answers.

    As an entity stuck in a call does; as a stop message it makes every counter ignore being
    stopped.
    """

    seconds: float


@message(name="p2pshard.testing.Probe")
@attrs.frozen(kw_only=True)
class Probe:
    """Failover probes: answered with the name of the node the entity runs on, changing nothing."""


@message(name="p2pshard.testing.Added")
@attrs.frozen(kw_only=True)
class Added:
    """The event-sourced counter's event: it handled ``sender``'s message ``seq``."""

    sender: str
    seq: int


class CountsAdded(EventSourcedEntity[int]):
    """What the event-sourced counters share: the count of their ``Added`` events."""

    def empty_state(self) -> int:
        return 0

    def apply_event(self, state: int, event: object) -> int:
        return state + 1 if isinstance(event, Added) else state


COUNTER = "Counter"
"""The counter workload's entity type name."""


def counter_entity(history: History) -> Callable[[EntityContext], Any]:
    """The counter workload's entity factory: each ``Add`` goes to the entity's log in ``history``.

    The log stands for the entity's durable state: it outlives incarnations, as a journal does,
    so an acknowledged message that is missing from it, or is in it twice, is a real violation.
    """

    class Counter:
        def __init__(self, ctx: EntityContext) -> None:
            self.key = f"{ctx.type_name}/{ctx.entity_id}"

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            match msg:
                case Add(sender=sender, seq=seq):
                    history.logged(self.key, sender, seq)
                    return len(history.logs[self.key])
                case Read():
                    return len(history.logs.get(self.key, ()))
                case Stall(seconds=seconds):
                    await trio.sleep(seconds)
                    return None
            raise ValueError(f"the counter does not understand {msg!r}")

    return Counter


@attrs.define
class CounterWorkload:
    """Clients that send numbered ``Add`` messages to random counters through their own node.

    Each client belongs to one node (``clients_per_node`` per node) and waits for each answer
    (up to ``ask_timeout``) before it sends the next; while its node is down it waits. Sequence
    numbers are per client, so (sender, seq) names one message for the whole run. The
    entities are of type ``type_name`` (another type that logs ``Add`` as the counter does,
    such as the fan-out workload's rooms); a client's name starts with ``prefix``.
    """

    sim: SimCluster
    rng: random.Random
    entities: int = 20
    clients_per_node: int = 1
    interval: float = 0.1
    ask_timeout: float = 2.0
    type_name: str = COUNTER
    prefix: str = "c"

    async def run(self, nodes: list[int]) -> None:
        """Run the clients of ``nodes`` until cancelled."""
        async with trio.open_nursery() as nursery:
            for i in nodes:
                for k in range(self.clients_per_node):
                    rng = random.Random(self.rng.getrandbits(64))
                    nursery.start_soon(self._client, i, f"{self.prefix}{i}.{k}", rng)

    async def _client(self, i: int, sender: str, rng: random.Random) -> None:
        history = self.sim.history
        seq = 0
        while True:
            await trio.sleep(self.interval * rng.uniform(0.5, 1.5))
            node = self.sim.nodes.get(i)
            if node is None or self.type_name not in node.sharding.type_names:
                continue  # down, or still starting
            region = node.sharding.region(self.type_name)
            seq += 1
            entity = f"e{rng.randrange(self.entities)}"
            history.sent(sender, f"{self.type_name}/{entity}", seq)
            with trio.move_on_after(self.ask_timeout):
                try:
                    await region.entity_ref(entity).ask(
                        Add(sender=sender, seq=seq), timeout=self.ask_timeout
                    )
                except ClusterError:  # timed out, region stopping, buffer full: not acknowledged
                    continue
                history.acknowledged(sender, seq)


def singleton_probe(history: History, i: int) -> Callable[[SingletonContext], Any]:
    """A singleton that records each of its instances in ``history`` (it answers pings)."""

    async def probe(ctx: SingletonContext) -> None:
        span = history.singleton_started(node_name(i), ctx.name)
        try:
            async for request in ctx:
                request.reply(node_name(i))
        finally:
            if span.end is None:
                span.end = trio.current_time()

    return probe
