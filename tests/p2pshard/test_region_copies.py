"""The region's ordering rules (``SendOrder``), and the region's hot-path copies of its decisions.

Each copy spelled out inline for speed is checked against its original, on a live region, with
seeded random cases (the seed is printed; ``REGION_COPIES_SEED=<seed>`` replays it):

- ``ShardRegion._send``'s copy of ``SendOrder.remote_home``: both send the message to the same
  node, or both keep it here;
- ``_send``'s tell delivery (``_delivery`` spelled out): the same ``EntityDelivery`` as
  ``_delivery`` and as the validating constructor, field for field and byte for byte;
- ``_received``'s copy of ``_place_here``'s first step: the same place as ``_route_nowait``
  (the running shard, the same node, the queue behind a flush, or the buffer).
"""

from __future__ import annotations

import collections
import os
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio
import trio.testing

from membership import Address, Envelope, IdentityKind, PeerIdentity, UniqueAddress
from membership.internal import wire
from p2pshard.sharding._allocation import EntityId, ShardId
from p2pshard.sharding._asks import RemoteReply
from p2pshard.sharding._entity import Reply
from p2pshard.sharding._protocol import EntityDelivery
from p2pshard.sharding._region import Delivery, ShardRegion
from p2pshard.sharding._region_core import SendOrder, ShardRegionCore
from p2pshard.sharding._settings import ShardingSettings
from tests._support.sharding_sim import CounterAdd, CounterRead, Fail, sim_cluster


def node(i: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", i), f"n{i}", uid)


SELF, N2, N3 = node(1), node(2), node(3)
A, B = ShardId("a"), ShardId("b")


def order() -> tuple[ShardRegionCore[str], SendOrder[str]]:
    core: ShardRegionCore[str] = ShardRegionCore(
        "counter", SELF, 10, ShardingSettings(), hosting=True, now=0.0
    )
    return core, SendOrder(core)


# -- SendOrder, sans-IO ---------------------------------------------------------------------


def test_a_message_goes_straight_to_a_known_remote_home_only() -> None:
    core, rules = order()
    assert rules.remote_home(A, ()) is None  # no home known: it stays (the core buffers it)
    core.homes[A] = N2
    assert rules.remote_home(A, ()) is N2
    assert rules.remote_home(A, {A}) is None  # running here (the table is behind)
    core.homes[B] = SELF
    assert rules.remote_home(B, ()) is None


def test_newer_messages_wait_behind_a_buffer_on_its_way_to_another_node() -> None:
    core, rules = order()
    core.homes[A] = N2
    rules.flushing[A] = collections.deque(["a1", "a2"])
    assert rules.remote_home(A, ()) is None  # not straight there: it would overtake them
    queue = rules.behind_flush(A)
    assert queue is rules.flushing[A]
    assert rules.behind_flush(B) is None  # nothing on its way: the core buffers it
    del core.homes[A]  # the shard moves again: the core buffers newer ones
    assert rules.behind_flush(A) is None
    core.homes[A] = SELF
    assert rules.behind_flush(A) is None


def test_a_relayed_hand_off_ack_waits_for_every_earlier_send_to_the_owner() -> None:
    _, rules = order()
    assert not rules.ack_waits(A, gathered_for_owner=False)
    assert rules.ack_waits(A, gathered_for_owner=True)
    rules.block(A)
    rules.block(A)
    assert rules.ack_waits(A, gathered_for_owner=False)
    assert not rules.ack_waits(B, gathered_for_owner=False)
    assert not rules.unblock(A)  # one send still waits
    assert rules.ack_waits(A, gathered_for_owner=False)
    assert rules.unblock(A)
    assert not rules.ack_waits(A, gathered_for_owner=False)
    rules.flushing[A] = collections.deque(["a1"])
    assert rules.ack_waits(A, gathered_for_owner=False)


# -- the copy in ShardRegion._send ----------------------------------------------------------


@attrs.define
class RecordingTransport:
    """Stands in for the region's transport: records sends, never busy."""

    settings: object
    sent: list[UniqueAddress] = attrs.Factory(list)
    messages: list[object] = attrs.Factory(list)

    def backlog(self, to: UniqueAddress) -> int:
        return 0

    def send_nowait(self, to: UniqueAddress, message: object) -> None:
        self.sent.append(to)
        self.messages.append(message)


CASES = 300


def copies_seed() -> int:
    seed = int(os.environ.get("REGION_COPIES_SEED", random.randrange(2**32)))
    print(f"REGION_COPIES_SEED={seed}")
    return seed


@asynccontextmanager
async def seeded_region() -> AsyncIterator[tuple[int, random.Random, ShardRegion]]:
    """The region of a one-node simulated cluster, with the run's seed (printed) and generator."""
    seed = copies_seed()
    async with sim_cluster(seed % 1000) as sim:
        await sim.start_up([1])
        yield seed, random.Random(seed), sim.regions[1]


async def test_send_decides_as_send_order_remote_home(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with seeded_region() as (seed, rng, region):
        self_node = region._self_node
        twin = UniqueAddress(self_node.address, self_node.name, self_node.uid)  # equal, not it
        homes_choice: list[UniqueAddress | None] = [None, self_node, twin, N2, N3]
        shards = [ShardId(f"s{i}") for i in range(6)]
        transport = RecordingTransport(region._transport.settings)
        kept: list[ShardId] = []

        def place_here(
            shard_id: ShardId, entity_id: EntityId, message: object, reply: object
        ) -> bool:
            kept.append(shard_id)
            return True

        saved = (region._transport, dict(region._core.homes), region._running)
        region._transport = transport  # type: ignore[assignment]
        region._place_here = place_here  # type: ignore[method-assign]
        try:
            for case in range(CASES):
                region._core.homes.clear()
                region._flushing.clear()
                running = {s for s in shards if rng.random() < 0.3}
                region._running = {s: None for s in running}  # type: ignore[misc]
                for shard in shards:
                    home = rng.choice(homes_choice)
                    if home is not None:
                        region._core.homes[shard] = home
                    if rng.random() < 0.2:
                        region._flushing[shard] = collections.deque[Delivery]()
                shard = rng.choice(shards)
                entity_id = EntityId(f"e-{case}")
                region._shard_cache[entity_id] = shard
                expected = region._order.remote_home(shard, region._running)
                transport.sent.clear()
                kept.clear()

                await region._send(entity_id, CounterAdd(sender="t", seq=case), None)

                state = f"case {case} (seed {seed}): shard {shard}, running {sorted(running)}"
                if expected is None:
                    assert kept == [shard], f"{state}: kept here by the rule, sent by _send"
                    assert transport.sent == []
                else:
                    assert transport.sent == [expected], f"{state}: _send sent elsewhere"
                    assert kept == []
        finally:
            region._flushing.clear()
            region._core.homes.clear()
            region._transport, homes, region._running = saved
            region._core.homes.update(homes)
            del region._place_here


# -- the tell delivery spelled out in ShardRegion._send ---------------------------------------


def random_text(rng: random.Random, prefix: str) -> str:
    alphabet = "abcxyz0189-_/ éü€中"
    return prefix + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 24)))


def random_message(rng: random.Random, case: int) -> object:
    """A registered message or a plain value, as an entity may be sent."""
    choices: list[object] = [
        CounterAdd(sender=random_text(rng, "s"), seq=rng.randrange(-(2**40), 2**40)),
        CounterRead(),
        Fail(text=random_text(rng, "")),
        rng.randrange(-(2**62), 2**62),
        rng.random(),
        random_text(rng, ""),
        random_text(rng, "b").encode(),
        None,
        rng.random() < 0.5,
        [case, random_text(rng, "l"), None],
        (case, 1.5),
        {"k": case, random_text(rng, "d"): [1, 2]},
    ]
    return rng.choice(choices)


async def test_send_builds_a_tell_delivery_as_delivery_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with seeded_region() as (seed, rng, region):
        transport = RecordingTransport(region._transport.settings)
        saved = (region._transport, dict(region._core.homes))
        region._transport = transport  # type: ignore[assignment]
        try:
            for case in range(CASES):
                shard = ShardId(random_text(rng, "shard-"))
                entity_id = EntityId(random_text(rng, f"e{case}-"))
                message = random_message(rng, case)
                region._core.homes[shard] = rng.choice((N2, N3))  # a remote home: sent now
                region._shard_cache[entity_id] = shard
                transport.messages.clear()

                await region._send(entity_id, message, None)

                state = f"case {case} (seed {seed}): {shard!r}/{entity_id!r} {message!r}"
                assert len(transport.messages) == 1, f"{state}: _send sent no single delivery"
                sent = transport.messages[0]
                assert type(sent) is EntityDelivery, f"{state}: _send sent a {type(sent)}"
                original = region._delivery(shard, entity_id, message, None)
                validated = EntityDelivery(
                    type_name=region.type_name, shard=shard, entity_id=entity_id, message=message
                )
                assert sent == original == validated, f"{state}: _send built {sent!r}"
                assert wire.encode(sent) == wire.encode(original) == wire.encode(validated), (
                    f"{state}: the delivery _send built encodes differently"
                )
        finally:
            region._core.homes.clear()
            region._transport, homes = saved
            region._core.homes.update(homes)


# -- the copy in ShardRegion._received --------------------------------------------------------


@attrs.define(eq=False)
class RecordingShard:
    """Stands in for a running shard: records what is delivered to it."""

    shard_id: ShardId
    places: list[tuple[object, ...]]

    def deliver(self, entity_id: EntityId, message: object, reply: Reply | None) -> None:
        self.places.append(("deliver", self.shard_id, entity_id, message, reply_kind(reply)))


def reply_kind(reply: Reply | None) -> tuple[object, ...] | None:
    if reply is None:
        return None
    assert isinstance(reply, RemoteReply)
    return (reply.origin, reply.request_id)


def where_it_went(
    region: ShardRegion,
    transport: RecordingTransport,
    buffered: list[tuple[object, ...]],
    places: list[tuple[object, ...]],
    queues: dict[ShardId, collections.deque[Delivery]],
) -> list[tuple[object, ...]]:
    """Every place a message went since the last call (and forget it)."""
    went = list(places)
    for to, sent in zip(transport.sent, transport.messages, strict=True):
        assert isinstance(sent, EntityDelivery)
        went.append(("send", to, sent))
    went.extend(buffered)
    for shard, queue in queues.items():
        went.extend(("behind flush", shard, entry[0], entry[1]) for entry in queue)
        queue.clear()
    places.clear()
    buffered.clear()
    transport.sent.clear()
    transport.messages.clear()
    return went


async def test_received_decides_as_route_nowait(autojump_clock: trio.testing.MockClock) -> None:
    async with seeded_region() as (seed, rng, region):
        self_node = region._self_node
        homes_choice: list[UniqueAddress | None] = [None, self_node, N2, N3]
        shards = [ShardId(f"s{i}") for i in range(6)]
        transport = RecordingTransport(region._transport.settings)
        places: list[tuple[object, ...]] = []
        buffered: list[tuple[object, ...]] = []
        queues: dict[ShardId, collections.deque[Delivery]] = {}

        def buffer(shard_id: ShardId, delivery: Delivery) -> None:
            entity_id, message, reply = delivery
            buffered.append(("buffer", shard_id, entity_id, message, reply_kind(reply)))

        saved = (region._transport, dict(region._core.homes), region._running)
        region._transport = transport  # type: ignore[assignment]
        region._buffer = buffer  # type: ignore[method-assign]
        try:
            for case in range(CASES):
                region._core.homes.clear()
                region._flushing.clear()
                queues.clear()
                running = {s for s in shards if rng.random() < 0.3}
                region._running = {
                    s: RecordingShard(s, places)  # type: ignore[misc]
                    for s in running
                }
                for shard in shards:
                    home = rng.choice(homes_choice)
                    if home is not None:
                        region._core.homes[shard] = home
                    if rng.random() < 0.2:
                        queues[shard] = region._flushing[shard] = collections.deque[Delivery]()
                shard = rng.choice(shards)
                entity_id = EntityId(f"e-{case}")
                message = CounterAdd(sender="t", seq=case)
                request_id = rng.choice((0, 0, case + 1))
                origin = rng.choice((None, N3))
                sender = rng.choice((N2, N3))

                region._received(sender, shard, entity_id, message, request_id, origin)
                copy = where_it_went(region, transport, buffered, places, queues)
                reply = (
                    RemoteReply(region._asks, origin or sender, request_id) if request_id else None
                )
                region._route_nowait(shard, entity_id, message, reply)
                original = where_it_went(region, transport, buffered, places, queues)

                state = (
                    f"case {case} (seed {seed}): shard {shard}, running {sorted(running)}, "
                    f"flushing {sorted(queues)}, homes {region._core.homes}"
                )
                assert len(copy) == 1, f"{state}: _received put it in {copy}"
                assert copy == original, f"{state}: _received {copy}, _route_nowait {original}"
        finally:
            region._flushing.clear()
            region._core.homes.clear()
            region._transport, homes, region._running = saved
            region._core.homes.update(homes)
            del region._buffer


async def test_handle_passes_a_delivery_on_as_on_delivery_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Sharding.handle spells out _on_delivery's common case (nearly every message): for a
    # started entity type and one that is not, a tell and an ask, both do the same.
    async with sim_cluster(1) as sim:
        await sim.start_up([1])
        region = sim.regions[1]
        sharding = sim.nodes[1].sharding
        calls: list[tuple[object, ...]] = []

        def to_region(sender: UniqueAddress, delivery: object) -> None:
            calls.append(("region", sender, delivery))

        def not_started(type_name: str, origin: UniqueAddress, request_id: int) -> None:
            calls.append(("not started", type_name, origin, request_id))

        region._on_delivery = to_region  # type: ignore[method-assign]
        sharding._not_started = not_started  # type: ignore[method-assign]
        for type_name in ("Counter", "Nobody"):
            for request_id, origin in ((0, None), (7, None), (8, N3)):
                delivery = EntityDelivery(
                    type_name=type_name,
                    shard="s1",
                    entity_id="e1",
                    message=CounterAdd(sender="t", seq=1),
                    request_id=request_id,
                    origin=origin,
                )
                calls.clear()
                assert sharding.handle(
                    Envelope(N2, delivery, PeerIdentity(IdentityKind.NODE, "n2"))
                )
                by_copy = list(calls)
                calls.clear()
                sharding._on_delivery(N2, delivery)
                assert by_copy == calls, (type_name, request_id, origin)
                assert calls or request_id == 0  # a tell to no region is dropped, silently
