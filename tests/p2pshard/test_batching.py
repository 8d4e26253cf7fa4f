"""Messages a region gathers into ``EntityDeliveries`` while the link to their node is busy.

A burst of tells to another node goes out in batches; a lone message goes alone. Either way each
sender's messages arrive in the order sent, asks are answered, and a bad entry in a received
batch costs that entry only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial

import pytest
import trio
import trio.testing

from membership import (
    Envelope,
    SendQueueFull,
    SerializationError,
    TransportClosed,
    UniqueAddress,
)
from membership.transport import _wire
from p2pshard import HashExtractor, Node, ShardingError, ShardRegion
from p2pshard.sharding._allocation import EntityId
from p2pshard.sharding._extractor import stable_shard
from p2pshard.sharding._protocol import (
    BeginHandOffAck,
    EntityDeliveries,
    EntityDelivery,
    EntityReply,
)
from p2pshard.sharding._region import BATCH_BYTES, BATCH_MESSAGES
from tests._support.sharding_sim import (
    CounterAdd,
    CounterRead,
    CounterSim,
    addr,
    counter_factory,
    sim_cluster,
)


async def entity_on(sim: CounterSim, node: int, *, asker: int) -> str:
    """An entity id whose incarnation runs on ``node`` (asked from ``asker``)."""
    for k in range(200):
        answer = await sim.regions[asker].entity_ref(f"e-{k}").ask(CounterRead(), timeout=30)
        assert isinstance(answer, tuple)
        if answer[0] == f"n{node}":
            return f"e-{k}"
    raise AssertionError(f"no entity among 200 runs on n{node}")


@contextlib.asynccontextmanager
async def cluster_with_entity_on_n2(seed: int) -> AsyncIterator[tuple[CounterSim, str]]:
    """Two nodes, and an entity whose incarnation runs on n2: n1's messages to it are remote."""
    async with sim_cluster(seed) as sim:
        await sim.start_up([1, 2])
        yield sim, await entity_on(sim, 2, asker=1)


def record_replies(sim: CounterSim, node: int) -> list[tuple[UniqueAddress, EntityReply]]:
    """The answers to asks that node ``node`` sends from now on (they still go out)."""
    asks = sim.nodes[node].sharding._asks
    reply = asks.reply
    replies: list[tuple[UniqueAddress, EntityReply]] = []

    def record(to: UniqueAddress, answer: EntityReply) -> None:
        replies.append((to, answer))
        reply(to, answer)

    asks.reply = record  # type: ignore[method-assign,assignment]
    return replies


def batches_sent(region: ShardRegion) -> int:
    return region.statistics().batches_sent


async def test_a_burst_goes_in_batches_in_order_and_a_lone_ask_goes_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_with_entity_on_n2(1) as (sim, target):
        region = sim.regions[1]
        before, sent_before = batches_sent(region), region.statistics().sent_remote
        burst = 3 * BATCH_MESSAGES + 7
        for seq in range(1, burst + 1):  # no yield between them: the link stays busy
            await region.entity_ref(target).tell(CounterAdd(sender="n1", seq=seq))
        answer = await region.entity_ref(target).ask(CounterRead(), timeout=30)
        assert answer == ("n2", burst)  # the ask went after every tell before it
        sim.journal.check_per_sender_order(target, {"n1": burst})
        stats = region.statistics()
        assert stats.sent_remote - sent_before == burst + 1
        # Whole batches of BATCH_MESSAGES, the rest when the sending task yielded.
        assert 3 <= stats.batches_sent - before <= burst // 2
        assert stats.dropped == 0
        lone = batches_sent(region)
        for _ in range(5):  # one at a time: the link is idle each time
            await region.entity_ref(target).ask(CounterRead(), timeout=30)
        assert batches_sent(region) == lone
        async with trio.open_nursery() as nursery:  # asks in flight at once start no batch
            for _ in range(16):
                nursery.start_soon(
                    partial(region.entity_ref(target).ask, CounterRead(), timeout=30)
                )
        assert batches_sent(region) == lone


async def test_a_message_too_large_to_gather_goes_alone_after_those_before_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_with_entity_on_n2(2) as (sim, target):
        big = "b" * (BATCH_BYTES + 100)  # as a sender name: the entity records it
        sent: list[tuple[str, int]] = []
        for seq in range(1, 301):
            sender = big if seq % 50 == 0 else "n1"
            await sim.regions[1].entity_ref(target).tell(CounterAdd(sender=sender, seq=seq))
            sent.append((sender, seq))
        await sim.regions[1].entity_ref(target).ask(CounterRead(), timeout=30)
        assert sim.journal.handled(target) == sent  # one sending task: its order exactly
        assert batches_sent(sim.regions[1]) > 0


async def test_an_unserializable_message_in_a_burst_fails_at_tell_and_the_rest_arrive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_with_entity_on_n2(3) as (sim, target):
        ref = sim.regions[1].entity_ref(target)
        seq = 0
        for n in range(200):
            if n == 100:
                with pytest.raises(SerializationError, match="not serializable"):
                    await ref.tell(object())
            seq += 1
            await ref.tell(CounterAdd(sender="n1", seq=seq))
        assert await ref.ask(CounterRead(), timeout=30) == ("n2", seq)
        sim.journal.check_per_sender_order(target, {"n1": seq})
        assert batches_sent(sim.regions[1]) > 0


async def test_a_received_batch_loses_only_its_bad_entries(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster_with_entity_on_n2(4) as (sim, target):
        replies = record_replies(sim, 2)
        node1 = sim.nodes[1].address
        shard = stable_shard(target, 10)  # standard_setup's 10 shards
        good = _wire.encode(CounterAdd(sender="inj", seq=1))
        # A registered-object frame of a type nobody registered.
        unknown = (
            _wire.HEADER.pack(_wire.WIRE_VERSION, _wire.KIND_OBJECT, 0) + b"\x92\xa9not.a.msg\x01"
        )
        entries: list[object] = [
            *(shard, target, good, 0, None),
            *(shard, target, "not bytes", 0, None),  # wrong types: dropped
            *(shard, target, b"\x00garbage", 0, None),  # a bad header: dropped
            *(shard, target, unknown, 41, None),  # an ask that cannot be read: answered
            *(shard, target, _wire.encode(CounterAdd(sender="inj", seq=2)), 0, None),
        ]
        batch = EntityDeliveries(type_name="Counter", entries=entries)
        with caplog.at_level(logging.WARNING, logger="p2pshard.region"):
            sim.net.inject_frame(addr(1), addr(2), _wire.encode(batch))
            await sim.regions[1].entity_ref(target).ask(CounterRead(), timeout=30)
        sim.journal.check_per_sender_order(target, {"inj": 2})
        assert [(to, r.request_id, r.error_type) for to, r in replies if r.error_type] == [
            (node1, 41, "p2pshard.ShardingError")
        ]
        assert "unknown message type 'not.a.msg'" in replies[0][1].error_text
        text = caplog.text
        assert "does not hold (shard id, entity id, payload, request id, origin)" in text
        assert "frame of 8 bytes is shorter than the header" in text
        # Not whole entries: the batch is dropped as a whole, and says why.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="p2pshard.region"):
            torn = EntityDeliveries(type_name="Counter", entries=[shard, target, good, 0])
            sim.net.inject_frame(addr(1), addr(2), _wire.encode(torn))
            await sim.regions[1].entity_ref(target).ask(CounterRead(), timeout=30)
        assert "4 values are not whole entries of 5" in caplog.text
        sim.journal.check_per_sender_order(target, {"inj": 2})


async def test_asks_in_a_batch_for_a_type_not_started_there_are_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(5) as sim:
        await sim.start_up([1, 2])
        replies = record_replies(sim, 2)
        other = UniqueAddress(addr(3), "n3", 99)
        payload = _wire.encode(CounterRead())
        batch = EntityDeliveries(
            type_name="Nope",
            entries=[
                "1",
                "a",
                payload,
                7,
                None,
                "1",
                "b",
                payload,
                0,
                None,
                "2",
                "c",
                payload,
                8,
                other,
            ],
        )
        sim.net.inject_frame(addr(1), addr(2), _wire.encode(batch))
        await trio.sleep(1)  # long enough for the frame and both answers
        assert [(to, r.request_id) for to, r in replies] == [
            (sim.nodes[1].address, 7),
            (other, 8),
        ]
        assert all("'Nope' is not started" in (r.error_text or "") for _, r in replies)


async def test_gathered_asks_fail_at_once_when_their_batch_cannot_be_sent(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster_with_entity_on_n2(6) as (sim, target):
        region = sim.regions[1]
        transport = sim.nodes[1]._transport
        send_nowait = transport.send_nowait

        def no_batches(to: object, message: object) -> None:
            if isinstance(message, EntityDeliveries):
                raise TransportClosed("transport is closed")
            send_nowait(to, message)  # type: ignore[arg-type]

        transport.send_nowait = no_batches  # type: ignore[method-assign]
        for seq in range(1, 20):  # no yield: the link stays busy, and most are gathered
            await region.entity_ref(target).tell(CounterAdd(sender="n1", seq=seq))
        with (
            caplog.at_level(logging.WARNING, logger="p2pshard.region"),
            pytest.raises(ShardingError, match="transport is closed"),
        ):
            await region.entity_ref(target).ask(CounterRead(), timeout=30)  # gathered behind them
        assert "message(s) dropped: sending to" in caplog.text
        handled = [seq for _, seq in sim.journal.handled(target) if seq]
        assert handled == list(range(1, len(handled) + 1))  # those not gathered, in order
        assert len(handled) < 19


async def test_a_message_passed_on_goes_behind_those_gathered_for_the_same_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_with_entity_on_n2(7) as (sim, target):
        region = sim.regions[1]
        for seq in range(1, 50):  # gathered: the link is busy
            await region.entity_ref(target).tell(CounterAdd(sender="n1", seq=seq))
        # As a region passes on a message that came for a shard it no longer hosts.
        region._route_nowait(
            stable_shard(target, 10), EntityId(target), CounterAdd(sender="n1", seq=50), None
        )
        await region.entity_ref(target).ask(CounterRead(), timeout=30)
        sim.journal.check_per_sender_order(target, {"n1": 50})
        assert batches_sent(region) > 0


async def test_a_relayed_hand_off_acknowledgement_waits_for_the_gathered_messages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The acknowledgement must reach the owner behind every message sent to it before, or the
    # owner could hand the shard off while some of them are still on their way.
    async with cluster_with_entity_on_n2(8) as (sim, target):
        owner = sim.nodes[2]
        arrived: list[str] = []
        handle = owner.sharding.handle

        def record(envelope: Envelope) -> bool:
            arrived.append(type(envelope.message).__name__)
            return handle(envelope)

        owner.sharding.handle = record  # type: ignore[method-assign]
        region = sim.regions[1]
        for seq in range(1, 50):  # gathered: the link is busy
            await region.entity_ref(target).tell(CounterAdd(sender="n1", seq=seq))
        shard = stable_shard(target, 10)
        region._relay(owner.address, BeginHandOffAck(type_name="Counter", shard=shard))
        await region.entity_ref(target).ask(CounterRead(), timeout=30)
        sim.journal.check_per_sender_order(target, {"n1": 49})
        ack = arrived.index("BeginHandOffAck")
        assert "EntityDeliveries" in arrived[:ack]
        assert "EntityDeliveries" not in arrived[ack:]


def refuse_batches(sim: CounterSim, node: int) -> Callable[[], None]:
    """Node ``node``'s send queues are full for batches from now on; returns the undo."""
    transport = sim.nodes[node]._transport
    send_nowait = transport.send_nowait

    def queue_full(to: object, message: object) -> None:
        if isinstance(message, EntityDeliveries):
            raise SendQueueFull("send queue is full")
        send_nowait(to, message)  # type: ignore[arg-type]

    async def no_room(to: object, message: object) -> None:
        await trio.sleep_forever()

    transport.send_nowait = queue_full  # type: ignore[method-assign]
    transport.send = no_room  # type: ignore[method-assign]

    def undo() -> None:
        del transport.send_nowait, transport.send

    return undo


async def test_a_batch_that_finds_no_room_is_dropped_after_retry_interval_and_says_so(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster_with_entity_on_n2(10) as (sim, target):
        region = sim.regions[1]
        refuse_batches(sim, 1)
        for seq in range(1, 20):  # the link is busy with these: most are gathered
            await region.entity_ref(target).tell(CounterAdd(sender="n1", seq=seq))
        started = trio.current_time()
        with (
            caplog.at_level(logging.WARNING, logger="p2pshard.region"),
            pytest.raises(ShardingError, match="stayed full"),
        ):
            await region.entity_ref(target).ask(CounterRead(), timeout=60)
        assert trio.current_time() - started >= region.settings.retry_interval - 1e-9
        assert "message(s) dropped: the send queue to" in caplog.text
        assert region.statistics().dropped > 0


async def test_a_task_cancelled_while_its_batch_waits_for_room_loses_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster_with_entity_on_n2(9) as (sim, target):
        region = sim.regions[1]
        undo = refuse_batches(sim, 1)
        seq = 0
        with trio.move_on_after(1) as waiting:
            while True:  # until a whole batch waits for room, then this task is cancelled
                seq += 1
                await region.entity_ref(target).tell(CounterAdd(sender="n1", seq=seq))
        assert waiting.cancelled_caught
        assert seq >= BATCH_MESSAGES
        undo()  # room again, for the batcher
        assert await region.entity_ref(target).ask(CounterRead(), timeout=30) == ("n2", seq)
        sim.journal.check_per_sender_order(target, {"n1": seq})


async def test_buffered_messages_flush_at_once_and_the_rest_waits_for_room_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Messages for a shard with no home yet wait in the buffer; when the home comes, what fits
    # in the send queue goes at once, and the rest from a task that waits for room.
    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        if i == 2:
            sim.regions[i] = await node.sharding.start_proxy("Counter", extractor=HashExtractor(10))
        else:
            sim.regions[i] = await node.sharding.start(
                "Counter", counter_factory(sim.journal, f"n{i}"), extractor=HashExtractor(10)
            )

    async with sim_cluster(11, setup) as sim:
        await sim.start_up([1, 2])
        transport = sim.nodes[2]._transport
        send_nowait = transport.send_nowait
        calls = 0

        def full_at_the_tenth(to: object, message: object) -> None:
            nonlocal calls
            if isinstance(message, EntityDelivery) and message.entity_id == "e-1":
                calls += 1
                if calls == 10:
                    raise SendQueueFull("send queue is full")
            send_nowait(to, message)  # type: ignore[arg-type]

        transport.send_nowait = full_at_the_tenth  # type: ignore[method-assign]
        ref = sim.regions[2].entity_ref("e-1")
        for seq in range(1, 31):  # the shard has no home yet: all wait in the buffer
            await ref.tell(CounterAdd(sender="n2", seq=seq))
        assert await ref.ask(CounterRead(), timeout=30) == ("n1", 30)
        assert calls == 10  # the tenth found the queue "full": the rest went from the task
        sim.journal.check_per_sender_order("e-1", {"n2": 30})
