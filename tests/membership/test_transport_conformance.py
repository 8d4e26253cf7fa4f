"""The transport conformance kit: the same behaviour over TCP+TLS and over the simulated network.

Each test gets a ``harness`` for one implementation (see conftest.py) and only uses the
``Transport`` interface. Real time is used for both, so the bounds are generous wall-clock caps,
never assertions about speed.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from membership import (
    MessageTooLarge,
    SendQueueFull,
    SerializationError,
    TransportClosed,
    TransportSettings,
    UniqueAddress,
)
from tests._support.transport import receive_n

from .conftest import Harness, Seq


async def test_per_link_order_and_sender_identity(harness: Harness) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    for i in range(2000):
        await a.send(b.local_address.address, Seq(i))
    got = await receive_n(b, 2000)
    assert [e.message for e in got] == [Seq(i) for i in range(2000)]
    assert {e.sender for e in got} == {a.local_address}


async def test_lone_messages_and_bursts_keep_order_and_all_count_as_sent(
    harness: Harness,
) -> None:
    # A lone message on an idle TCP link is written by the sending task itself, a burst by the
    # link's task in batches: the two ways must interleave in order and both be counted.
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    to = b.local_address.address
    sent = 0
    for round_ in range(20):
        a.send_nowait(to, Seq(sent))  # lone: the peer answers before the next round
        sent += 1
        [lone] = await receive_n(b, 1)
        assert lone.message == Seq(sent - 1)
        burst = [Seq(n) for n in range(sent, sent + round_ * 10)] + [Seq(sent + round_ * 10)]
        for seq in burst:  # a burst behind it, in one go
            a.send_nowait(to, seq)
        sent += len(burst)
        got = await receive_n(b, len(burst))
        assert [e.message for e in got] == burst
    peer = a.statistics().peer(to)
    assert peer is not None
    assert (peer.frames_sent, peer.frames_lost_in_flight, peer.queued_frames) == (sent, 0, 0)
    assert b.statistics().messages_received == sent


async def test_backlog_counts_what_waits_for_the_link(harness: Harness) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    to = b.local_address
    assert a.backlog(to) == a.backlog(to.address) == 0  # no link yet
    for i in range(50):  # a burst without yielding: the link's task has not run
        a.send_nowait(to.address, Seq(i))
    # At most the first went out at once, written by this task while the link was idle.
    assert a.backlog(to) == a.backlog(to.address) >= 49
    assert [e.message for e in await receive_n(b, 50)] == [Seq(i) for i in range(50)]
    assert a.backlog(to) == 0
    with pytest.raises(TypeError, match="Address or UniqueAddress"):
        a.backlog("node-b")  # type: ignore[arg-type]


async def test_order_holds_per_link_with_many_peers_both_ways(harness: Harness) -> None:
    nodes = [await harness.start(f"node-{i}") for i in range(3)]
    for round_ in range(200):
        for src in nodes:
            for dst in nodes:
                if src is not dst:
                    await src.send(
                        dst.local_address.address, Seq(round_, src.local_address.name.encode())
                    )
    for dst in nodes:
        got = await receive_n(dst, 400)
        by_sender: dict[UniqueAddress, list[int]] = {}
        for e in got:
            assert isinstance(e.message, Seq)
            assert e.message.data == e.sender.name.encode()
            by_sender.setdefault(e.sender, []).append(e.message.n)
        assert len(by_sender) == 2
        assert all(ns == list(range(200)) for ns in by_sender.values())


async def test_large_frames_arrive_whole_and_oversize_fails_at_send(harness: Harness) -> None:
    settings = TransportSettings(max_frame_size=256 * 1024)
    a = await harness.start("node-a", settings=settings)
    b = await harness.start("node-b", settings=settings)
    to = b.local_address.address
    big = bytes(range(256)) * 1000  # 256,000 bytes: fits with the envelope
    await a.send(to, Seq(1, big))
    with pytest.raises(MessageTooLarge, match="max_frame_size"):
        await a.send(to, Seq(2, big + bytes(8000)))
    with pytest.raises(MessageTooLarge):
        a.send_nowait(to, Seq(2, big + bytes(8000)))
    await a.send(to, Seq(3))
    got = await receive_n(b, 2)
    assert got[0].message == Seq(1, big)
    assert got[1].message == Seq(3)
    peer = a.statistics().peer(to)
    assert peer is not None
    assert peer.frames_lost_in_flight == 0


@attrs.frozen
class NotRegistered:
    x: int


async def test_unserializable_message_fails_at_send_and_nothing_is_lost(harness: Harness) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    to = b.local_address.address
    await a.send(to, Seq(1))
    with pytest.raises(SerializationError, match="NotRegistered"):
        await a.send(to, NotRegistered(1))
    with pytest.raises(SerializationError, match="NotRegistered"):
        a.send_nowait(to, {"inner": [NotRegistered(2)]})
    await a.send(to, Seq(2))
    await a.send(to, {"plain": [1, 2.5, "x", b"y", None, True], "t": (1, 2), "s": frozenset({3})})
    got = await receive_n(b, 3)
    assert [e.message for e in got] == [
        Seq(1),
        Seq(2),
        {"plain": [1, 2.5, "x", b"y", None, True], "t": (1, 2), "s": frozenset({3})},
    ]


async def test_backpressure_send_waits_and_send_nowait_refuses(harness: Harness) -> None:
    settings = TransportSettings(send_queue_capacity=8, inbox_capacity=8, max_frame_size=128 * 1024)
    a = await harness.start("node-a", settings=settings)
    b = await harness.start("node-b", settings=settings)
    to = b.local_address.address
    payload = bytes(64 * 1024)
    queued = 0
    blocked = trio.Event()

    async def flood() -> None:
        nonlocal queued
        while True:
            with trio.move_on_after(1) as scope:
                await a.send(to, Seq(queued, payload))
            if scope.cancelled_caught:
                blocked.set()
                return
            queued += 1

    # b reads nothing: the inbox, then the link (and for TCP the kernel buffers), then a's queue
    # fill up, and send() has to wait. The cap only bounds a broken implementation.
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            await blocked.wait()
    peer = a.statistics().peer(to)
    assert peer is not None
    assert peer.queued_frames == settings.send_queue_capacity
    with pytest.raises(SendQueueFull, match="full"):
        a.send_nowait(to, Seq(-1))
    assert a.statistics().peer(to).send_queue_full == 1  # type: ignore[union-attr]
    got = await receive_n(b, queued, limit=60)
    assert [e.message.n for e in got] == list(range(queued))  # type: ignore[attr-defined]
    await a.send(to, Seq(queued))  # room again
    assert (await receive_n(b, 1))[0].message == Seq(queued)


async def test_reconnect_after_peer_restart_reaches_the_new_incarnation(harness: Harness) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    address = b.local_address.address
    old = b.local_address
    await a.send(address, Seq(0))
    await receive_n(b, 1)
    await harness.stop(b)

    b2 = await harness.start("node-b", address=address)
    assert b2.local_address.address == address
    assert b2.local_address.uid != old.uid
    # Frames written just before the restart may be lost (at most once); probe until one lands.
    with trio.fail_after(30):
        while True:
            await a.send(address, Seq(-1))
            with trio.move_on_after(0.2):
                if (await b2.receive()).message == Seq(-1):
                    break
    for i in range(100):
        await a.send(address, Seq(i))
    await a.send(old, Seq(999))  # for the old incarnation: must not reach the new one
    await a.send(b2.local_address, Seq(100))
    got: list[object] = []
    with trio.fail_after(20):
        while len(got) < 101:
            m = (await b2.receive()).message
            if m != Seq(-1):  # late probes arrive before Seq(0): order is kept
                got.append(m)
    assert got == [Seq(i) for i in range(101)]
    assert b2.statistics().messages_dropped_wrong_incarnation == 1
    stats = a.statistics().peer(address)
    assert stats is not None
    assert stats.connects >= 2
    assert stats.peer == b2.local_address


async def test_close_flushes_then_refuses_and_ends_iteration(harness: Harness) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    to = b.local_address.address
    await a.send(to, Seq(0))
    await receive_n(b, 1)  # link is up
    for i in range(1, 101):
        a.send_nowait(to, Seq(i))
    await harness.stop(a)  # graceful: queued frames go out first
    assert a.closed
    assert a.statistics().closed
    got = await receive_n(b, 100)
    assert [e.message for e in got] == [Seq(i) for i in range(1, 101)]
    with pytest.raises(TransportClosed):
        await a.send(to, Seq(0))
    with pytest.raises(TransportClosed):
        a.send_nowait(to, Seq(0))
    with pytest.raises(TransportClosed):
        await a.receive()
    await a.aclose()  # idempotent
    received = [e async for e in a]
    assert received == []


async def test_send_to_self_is_delivered_as_a_copy(harness: Harness) -> None:
    a = await harness.start("node-a")
    original = {"list": [1, 2]}
    await a.send(a.local_address, original)
    got = await receive_n(a, 1)
    assert got[0].message == original
    assert got[0].message is not original
    assert got[0].sender == a.local_address


async def test_peer_that_is_down_does_not_block_other_peers(harness: Harness) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    c = await harness.start("node-c")
    gone = c.local_address.address
    await harness.stop(c)
    for i in range(50):
        a.send_nowait(gone, Seq(i))  # queued for a peer that is not there
        await a.send(b.local_address.address, Seq(i))
    got = await receive_n(b, 50)
    assert [e.message for e in got] == [Seq(i) for i in range(50)]
    stats = a.statistics().peer(gone)
    assert stats is not None
    assert not stats.connected
    assert stats.queued_frames > 0


async def test_forget_flushes_then_stops_linking_and_a_later_send_links_again(
    harness: Harness,
) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    target = b.local_address.address
    for i in range(20):
        a.send_nowait(target, Seq(i))
    await a.forget(target, flush_timeout=20)  # what was queued still goes out
    assert a.statistics().peer(target) is None
    got = await receive_n(b, 20)
    assert [e.message for e in got] == [Seq(i) for i in range(20)]
    await a.send(target, Seq(20))
    assert [e.message for e in await receive_n(b, 1)] == [Seq(20)]
    await a.forget(b.local_address.address, flush_timeout=20)
    await a.forget(b.local_address.address, flush_timeout=20)  # twice, or unknown: nothing


async def test_forget_a_peer_that_is_gone_drops_its_queue_after_the_timeout(
    harness: Harness,
) -> None:
    a = await harness.start("node-a")
    c = await harness.start("node-c")
    gone = c.local_address.address
    await harness.stop(c)
    for i in range(5):
        a.send_nowait(gone, Seq(i))
    with trio.fail_after(20):
        await a.forget(gone, flush_timeout=0.5)
    assert a.statistics().peer(gone) is None


async def test_prune_forgets_links_not_kept_once_they_idled_between_two_calls(
    harness: Harness,
) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    c = await harness.start("node-c")
    kept, visitor = b.local_address.address, c.local_address.address
    for to in (kept, visitor):
        await a.send(to, Seq(1))
    await receive_n(b, 1)
    await receive_n(c, 1)
    assert a.prune({kept}) == []  # the first sweep only marks the visitor's link
    await a.send(visitor, Seq(2))  # it was used since: kept another round
    await receive_n(c, 1)
    assert a.prune({kept}) == []
    assert a.prune({kept}) == [visitor]
    assert a.statistics().peer(visitor) is None
    assert a.statistics().peer(kept) is not None
    for _ in range(3):
        assert a.prune({kept}) == []  # a member's link is never pruned, used or not
    await a.send(visitor, Seq(3))  # a later send links again
    assert [e.message for e in await receive_n(c, 1)] == [Seq(3)]


async def test_prune_drops_what_waits_for_a_gone_visitor(harness: Harness) -> None:
    a = await harness.start("node-a")
    c = await harness.start("node-c")
    gone = c.local_address.address
    await harness.stop(c)
    for i in range(5):
        a.send_nowait(gone, Seq(i))
    assert a.prune(set()) == []
    assert a.prune(set()) == [gone]  # nothing left the queue between the sweeps
    assert a.statistics().peer(gone) is None
