"""The parts both transports share: a peer's send queue, and delivery to a handler.

The queue's waiting is tested directly (one link task takes frames; senders wait for room; a
flush waits for the queue to empty); delivery runs over both implementations, like the
conformance kit.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import trio
import trio.testing

from membership import Address, ConfigurationError, Envelope, TransportSettings, UniqueAddress
from membership.transport._address import MAX_UID
from membership.transport._tlslink import TlsLink
from membership.transport._transport import Outbox
from tests._support.transport import receive_n

from .conftest import CertSet, Harness, Seq, TcpHarness

PEER = Address("127.0.0.1", 1)


async def test_a_queued_frame_wakes_the_task_waiting_for_frames() -> None:
    outbox = Outbox(PEER, 4)
    taken: list[bytes] = []

    async def link() -> None:
        await outbox.wait_for_frames()
        taken.extend(outbox.take(1 << 10))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link)
        await trio.testing.wait_all_tasks_blocked()
        assert not taken
        outbox.put_nowait(b"a")
    assert taken == [b"a"]


async def test_a_second_task_waiting_for_the_same_frames_is_refused() -> None:
    outbox = Outbox(PEER, 4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.wait_for_frames)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="another task already waits for frames"):
            await outbox.wait_for_frames()
        outbox.put_nowait(b"a")


async def test_an_idle_link_takes_a_lone_frame_in_the_sending_task() -> None:
    outbox = Outbox(PEER, 8)
    written: list[bytes] = []
    woken = 0

    async def link() -> None:
        nonlocal woken
        await outbox.wait_for_frames(written.append)
        woken += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link)
        await trio.testing.wait_all_tasks_blocked()
        outbox.put_nowait(b"a")
        assert written == [b"a"]  # already written, before any other task ran
        assert not outbox.frames
        # The rest of the burst queues for the link task, to go out together.
        outbox.put_nowait(b"b")
        outbox.put_nowait(b"c")
        assert written == [b"a"]
        assert list(outbox.frames) == [b"b", b"c"]
    assert woken == 1


async def test_a_link_that_stopped_waiting_takes_no_frame_directly() -> None:
    outbox = Outbox(PEER, 8)
    written: list[bytes] = []
    with trio.move_on_after(0.01):
        await outbox.wait_for_frames(written.append)
    outbox.put_nowait(b"a")
    assert not written
    assert list(outbox.frames) == [b"a"]


async def test_a_cancelled_wait_for_frames_lets_the_next_one_wait() -> None:
    outbox = Outbox(PEER, 4)
    with trio.move_on_after(0.01):
        await outbox.wait_for_frames()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.wait_for_frames)
        await trio.testing.wait_all_tasks_blocked()
        outbox.put_nowait(b"a")
    assert list(outbox.frames) == [b"a"]


async def test_closing_wakes_the_task_waiting_for_frames() -> None:
    outbox = Outbox(PEER, 4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.wait_for_frames)
        await trio.testing.wait_all_tasks_blocked()
        outbox.close()
    assert outbox.closed


async def test_taking_frames_wakes_a_sender_waiting_for_room_then_a_flush() -> None:
    outbox = Outbox(PEER, 2)
    outbox.put_nowait(b"a")
    outbox.put_nowait(b"b")
    flushed = trio.Event()

    async def flush() -> None:
        await outbox.wait_empty()
        flushed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.put, b"c")
        await trio.testing.wait_all_tasks_blocked()
        assert list(outbox.frames) == [b"a", b"b"]
        assert outbox.take(1) == [b"a"]
        await trio.testing.wait_all_tasks_blocked()
        assert list(outbox.frames) == [b"b", b"c"]
        nursery.start_soon(flush)
        await trio.testing.wait_all_tasks_blocked()
        assert not flushed.is_set()
        assert outbox.take(1 << 10) == [b"b", b"c"]
    assert flushed.is_set()


async def test_a_handler_gets_every_message_in_order_even_after_it_raised(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    got: list[Envelope] = []
    all_in = trio.Event()

    def handle(envelope: Envelope) -> None:
        got.append(envelope)
        if len(got) == 20:
            all_in.set()
        if envelope.message == Seq(3):
            raise RuntimeError("handler bug")

    b.set_handler(handle)
    for i in range(20):
        await a.send(b.local_address, Seq(i))
    with trio.fail_after(20):
        await all_in.wait()
    assert [e.message for e in got] == [Seq(i) for i in range(20)]
    assert {e.sender for e in got} == {a.local_address}
    assert b.statistics().messages_received == 20
    assert "handler failed on Seq" in caplog.text
    b.set_handler(None)
    await a.send(b.local_address.address, Seq(20))
    with trio.fail_after(20):
        assert (await b.receive()).message == Seq(20)


async def test_each_send_takes_its_own_destinations_route(harness: Harness) -> None:
    # The transport remembers the route of the destination it sent to last (by identity): a
    # send to another destination, or to another incarnation at the same address, must not
    # take it.
    a = await harness.start("node-a")
    b = await harness.start("node-b")
    c = await harness.start("node-c")
    node_b = b.local_address
    other_b = UniqueAddress(node_b.address, node_b.name, node_b.uid % MAX_UID + 1)
    for i in range(3):
        await a.send(node_b, Seq(i))
        await a.send(c.local_address.address, Seq(i))
        await a.send(other_b, Seq(100 + i))  # for an incarnation that is not there: dropped
        a.send_nowait(a.local_address, Seq(200 + i))  # to itself
    await a.send(node_b, Seq(3))  # after the dropped ones on the same link
    assert [e.message for e in await receive_n(b, 4)] == [Seq(0), Seq(1), Seq(2), Seq(3)]
    assert b.statistics().messages_dropped_wrong_incarnation == 3
    assert [e.message for e in await receive_n(c, 3)] == [Seq(0), Seq(1), Seq(2)]
    assert [e.message for e in await receive_n(a, 3)] == [Seq(200), Seq(201), Seq(202)]
    for nowhere in (None, "node-b", node_b.address.host):
        with pytest.raises(TypeError, match="send needs an Address or UniqueAddress"):
            a.send_nowait(nowhere, Seq(0))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="send needs an Address or UniqueAddress"):
            await a.send(nowhere, Seq(0))  # type: ignore[arg-type]


async def test_a_tcp_link_dials_a_peer_through_its_dial_via_address(certs: CertSet) -> None:
    # A relay stands where dial_via points: the link to B goes through it, and when it stops
    # forwarding (closes what it accepts) nothing reaches B, though B itself is up.
    accepted: list[int] = []
    forwarding = True

    async with trio.open_nursery() as nursery:
        harness = TcpHarness(nursery, certs)
        b = await harness.start("node-b")
        target = b.local_address.address

        async def relay(client: trio.SocketStream) -> None:
            accepted.append(1)
            if not forwarding:
                await client.aclose()
                return
            upstream = await trio.open_tcp_stream(target.host, target.port)
            async with client, upstream, trio.open_nursery() as pumps:

                async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        while data := await src.receive_some(1 << 16):
                            await dst.send_all(data)
                    pumps.cancel_scope.cancel()

                pumps.start_soon(pump, client, upstream)
                pumps.start_soon(pump, upstream, client)

        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), relay, 0
        )
        via = Address("127.0.0.1", listener.socket.getsockname()[1])
        settings = TransportSettings(
            dial_via=((str(target), via),), reconnect_backoff_min=0.05, reconnect_backoff_max=0.05
        )
        a = await harness.start("node-a", settings=settings)
        await a.send(target, Seq(1))
        with trio.fail_after(10):
            assert (await b.receive()).message == Seq(1)
        assert accepted == [1]
        assert [p.name for p in a.connected_peers()] == ["node-b"]

        forwarding = False
        await harness.stop(a)
        a = await harness.start("node-a", settings=settings)
        await a.send(target, Seq(2))
        with trio.move_on_after(1):
            await b.receive()
            pytest.fail("a message went around the relay")
        assert len(accepted) > 2  # it kept trying, through the relay only
        assert a.statistics().peer(target).connect_failures > 0  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "dial_via",
    [
        (("node-b", Address("127.0.0.1", 2)),),  # not host:port
        (("127.0.0.1:1", "127.0.0.1:2"),),  # not an Address
        (("127.0.0.1:1", Address("127.0.0.1", 2), "extra"),),
        [("127.0.0.1:1", Address("127.0.0.1", 2))],  # not a tuple
    ],
)
def test_dial_via_takes_only_pairs_of_an_address_and_where_to_dial_it(dial_via: object) -> None:
    with pytest.raises(ConfigurationError, match=r"TransportSettings.dial_via = .* is invalid"):
        TransportSettings(dial_via=dial_via)  # type: ignore[arg-type]


async def test_a_lone_frame_that_meets_a_broken_link_is_lost_and_the_link_redialled(
    certs: CertSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The socket fails just as a lone frame is written in the sending task: that frame is
    # counted lost in flight (at most once, as a frame in a batch would be), the link task
    # gives the link up, and the next frames go over a new one.
    settings = TransportSettings(reconnect_backoff_min=0.01, reconnect_backoff_max=0.01)
    async with trio.open_nursery() as nursery:
        harness = TcpHarness(nursery, certs)
        a = await harness.start("node-a", settings=settings)
        b = await harness.start("node-b", settings=settings)
        to = b.local_address.address
        a.send_nowait(to, Seq(1))
        assert (await receive_n(b, 1))[0].message == Seq(1)
        await trio.testing.wait_all_tasks_blocked()  # the link task waits: the link is idle

        def fail(self: TlsLink, data: bytes) -> None:
            raise trio.BrokenResourceError("injected") from ConnectionResetError()

        with monkeypatch.context() as patch:
            patch.setattr(TlsLink, "write_nowait", fail)
            a.send_nowait(to, Seq(2))  # written (and lost) in this task: no exception here
        peer = a.statistics().peer(to)
        assert peer is not None
        assert (peer.frames_lost_in_flight, peer.queued_frames) == (1, 0)
        a.send_nowait(to, Seq(3))
        assert (await receive_n(b, 1))[0].message == Seq(3)
        peer = a.statistics().peer(to)
        assert peer is not None
        assert (peer.connects, peer.frames_sent, peer.frames_lost_in_flight) == (2, 2, 1)
        nursery.cancel_scope.cancel()
