"""What the TCP transport refuses, and that refusing never disturbs good peers.

Raw TLS clients here play the hostile or broken peer; the node under test is a real
``open_tcp_transport`` on 127.0.0.1.
"""

from __future__ import annotations

import ssl
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import msgpack
import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from membership import (
    Address,
    IdentityKind,
    PeerIdentity,
    Transport,
    TransportSettings,
    UniqueAddress,
    _wire,
    message,
)
from membership._framing import FrameDecoder, encode_frame
from membership._tcp import Hello, HelloAck, open_tcp_transport
from membership._tls import TlsIdentity

from .conftest import CLUSTER, CertSet, Seq

LOCAL = Address("127.0.0.1", 0)


async def wait_until(predicate: Callable[[], bool], limit: float = 10) -> None:
    """Poll counters (they have no event to wait on) until ``predicate`` holds."""
    with trio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)


async def tls_client(
    address: Address, identity: TlsIdentity | None
) -> trio.SSLStream[trio.SocketStream]:
    """A raw TLS 1.3 client; presents ``identity``'s certificate if given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # a hostile client does not care who the server is
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if identity is not None:
        context.load_cert_chain(identity.cert_file, identity.key_file)
    tcp = await trio.open_tcp_stream(address.host, address.port)
    stream = trio.SSLStream(tcp, context, server_hostname=None)
    await stream.do_handshake()
    return stream


async def sees_end(stream: trio.SSLStream[trio.SocketStream]) -> bool:
    """True when the server closed (EOF or a TLS alert) rather than answering."""
    try:
        with trio.fail_after(10):
            data = await stream.receive_some(1024)
    except trio.BrokenResourceError:
        return True
    finally:
        await trio.aclose_forcefully(stream)
    return data == b""


async def raw_peer(
    address: Address, identity: TlsIdentity, name: str
) -> trio.SSLStream[trio.SocketStream]:
    """An authenticated raw peer: TLS, then a proper Hello; returns after the HelloAck."""
    stream = await tls_client(address, identity)
    hello = Hello(cluster=CLUSTER, sender=UniqueAddress(Address("127.0.0.1", 1), name, 1))
    await stream.send_all(encode_frame(_wire.encode(hello)))
    decoder = FrameDecoder(1 << 20)
    with trio.fail_after(10):
        while True:
            frames, _ = decoder.feed(await stream.receive_some(1024))
            if frames:
                assert isinstance(_wire.decode(frames[0]).message, HelloAck)
                return stream


@asynccontextmanager
async def node(
    certs: CertSet, name: str, settings: TransportSettings | None = None
) -> AsyncIterator[Transport]:
    async with open_tcp_transport(certs.identity(name), name, LOCAL, settings=settings) as t:
        yield t


async def assert_serves(server: Transport, client: Transport, n: int = 1) -> None:
    """The server still takes messages from a good client."""
    for i in range(n):
        await client.send(server.local_address.address, Seq(i))
    with trio.fail_after(10):
        for i in range(n):
            envelope = await server.receive()
            assert envelope.message == Seq(i)
            assert envelope.sender == client.local_address


async def test_client_without_certificate_is_refused(certs: CertSet) -> None:
    async with node(certs, "server") as server, node(certs, "good") as good:
        stream = await tls_client(server.local_address.address, None)
        assert await sees_end(stream)
        await wait_until(lambda: server.statistics().handshakes_refused == 1)
        await assert_serves(server, good)


async def test_certificate_from_another_ca_is_refused_both_ways(
    certs: CertSet, other_certs: CertSet
) -> None:
    async with (
        node(certs, "server") as server,
        node(other_certs, "stranger") as stranger,
        node(certs, "good") as good,
    ):
        await stranger.send(server.local_address.address, Seq(0))
        await wait_until(lambda: server.statistics().handshakes_refused >= 1)
        peer = stranger.statistics().peer(server.local_address.address)
        await wait_until(
            lambda: peer is not None and stranger.statistics().peers[0].connect_failures >= 1
        )
        assert not stranger.statistics().peers[0].connected
        # The other way round: our node does not accept the stranger as a server either.
        await server.send(stranger.local_address.address, Seq(0))
        await wait_until(lambda: server.statistics().peers[0].connect_failures >= 1)
        assert stranger.statistics().messages_received == 0
        assert server.statistics().messages_received == 0
        await assert_serves(server, good)


async def test_certificate_of_same_ca_for_another_cluster_is_refused(certs: CertSet) -> None:
    # The intruder's certificate is genuine, from our CA, but names cluster "other". It claims
    # our cluster in its hello; the server judges the certificate, not the claim.
    intruder_id = certs.identity("intruder", cluster="other")
    async with (
        node(certs, "server") as server,
        open_tcp_transport(intruder_id, "intruder", LOCAL) as intruder,
        node(certs, "good") as good,
    ):
        await intruder.send(server.local_address.address, Seq(0))
        await wait_until(lambda: server.statistics().handshakes_refused >= 1)
        await wait_until(lambda: intruder.statistics().peers[0].connect_failures >= 1)
        # And a node of ours does not link to it: its certificate names the wrong cluster.
        await server.send(intruder.local_address.address, Seq(0))
        await wait_until(lambda: server.statistics().peers[0].connect_failures >= 1)
        assert not server.statistics().peers[0].connected
        assert server.statistics().messages_received == 0
        assert intruder.statistics().messages_received == 0
        await assert_serves(server, good)


async def test_hello_must_name_the_node_of_the_certificate(certs: CertSet) -> None:
    async with node(certs, "server") as server:
        stream = await tls_client(server.local_address.address, certs.identity("mallory"))
        impostor = UniqueAddress(Address("127.0.0.1", 1), "server", 7)
        await stream.send_all(encode_frame(_wire.encode(Hello(cluster=CLUSTER, sender=impostor))))
        assert await sees_end(stream)
        await wait_until(lambda: server.statistics().handshakes_refused == 1)


@pytest.mark.parametrize("kind", list(IdentityKind))
async def test_each_message_carries_the_identity_its_links_certificate_names(
    certs: CertSet, kind: IdentityKind
) -> None:
    async with node(certs, "server") as server:
        identity = certs.identity("visitor", kind=kind)
        async with open_tcp_transport(identity, "visitor", LOCAL, kind=kind) as visitor:
            assert visitor.identity == PeerIdentity(kind, "visitor")
            await visitor.send(server.local_address.address, Seq(1))
            with trio.fail_after(10):
                envelope = await server.receive()
    assert envelope.message == Seq(1)
    assert envelope.sender == visitor.local_address
    assert envelope.identity == PeerIdentity(kind, "visitor")


async def test_a_client_certificate_cannot_pass_for_the_node_of_the_same_name(
    certs: CertSet,
) -> None:
    # The hello must name the certificate's name, whatever its kind, and the identity that
    # reaches the node is the certificate's kind: a client named like a member stays a client.
    async with node(certs, "server") as server:
        stream = await raw_peer(
            server.local_address.address,
            certs.identity("server", kind=IdentityKind.CLIENT),
            "server",
        )
        await stream.send_all(encode_frame(_wire.encode(Seq(5))))
        with trio.fail_after(10):
            envelope = await server.receive()
        await trio.aclose_forcefully(stream)
    assert envelope.sender.name == "server"
    assert envelope.identity == PeerIdentity(IdentityKind.CLIENT, "server")


async def test_wrong_cluster_in_hello_is_refused(certs: CertSet) -> None:
    async with node(certs, "server") as server:
        stream = await tls_client(server.local_address.address, certs.identity("raw"))
        sender = UniqueAddress(Address("127.0.0.1", 1), "raw", 7)
        await stream.send_all(encode_frame(_wire.encode(Hello(cluster="other", sender=sender))))
        assert await sees_end(stream)
        await wait_until(lambda: server.statistics().handshakes_refused == 1)


async def test_oversize_frame_closes_that_link_and_is_counted(certs: CertSet) -> None:
    limits = TransportSettings(max_frame_size=4096)
    async with node(certs, "server", limits) as server, node(certs, "good") as good:
        stream = await raw_peer(server.local_address.address, certs.identity("raw"), "raw")
        first = encode_frame(_wire.encode(Seq(1)))
        # A whole frame, then a header announcing 4097 bytes, in one write: the first is kept.
        await stream.send_all(first + struct.pack(">I", 4097) + b"x" * 100)
        assert await sees_end(stream)
        await wait_until(lambda: server.statistics().links_closed_frame_too_large == 1)
        envelope = await server.receive()
        assert envelope.message == Seq(1)
        assert envelope.sender.name == "raw"
        await assert_serves(server, good)


async def test_truncated_and_undecodable_frames_close_the_link(certs: CertSet) -> None:
    async with node(certs, "server") as server, node(certs, "good") as good:
        address = server.local_address.address
        stream = await raw_peer(address, certs.identity("raw"), "raw")
        await stream.send_all(struct.pack(">I", 100) + b"only part")
        await stream.aclose()
        await wait_until(lambda: server.statistics().links_closed_truncated == 1)

        stream = await raw_peer(address, certs.identity("raw"), "raw")
        await stream.send_all(encode_frame(b"\x09" + bytes(20)))  # wire version 9
        assert await sees_end(stream)
        await wait_until(lambda: server.statistics().links_closed_undecodable == 1)
        await assert_serves(server, good)


@message(name="tests.OnlyOnTheSender")
@attrs.frozen
class OnlyOnTheSender:
    x: int


async def test_unknown_message_type_is_dropped_and_the_link_kept(certs: CertSet) -> None:
    async with node(certs, "server") as server:
        stream = await raw_peer(server.local_address.address, certs.identity("raw"), "raw")
        unknown = bytearray(_wire.encode(OnlyOnTheSender(1)))
        unknown[
            unknown.index(b"tests.OnlyOnTheSender") : unknown.index(b"tests.OnlyOnTheSender") + 6
        ] = b"nobody"
        bad_port = _wire.HEADER.pack(1, 2, 0) + msgpack.packb(["p2pshard.Address", "h", 99999])
        await stream.send_all(
            encode_frame(bytes(unknown))
            + encode_frame(_wire.HEADER.pack(1, 2, 0) + msgpack.packb(["tests.Seq", 1, 2, 3]))
            + encode_frame(bad_port)
            + encode_frame(_wire.encode(Seq(2)))
        )
        envelope = await server.receive()
        assert envelope.message == Seq(2)
        stats = server.statistics()
        assert stats.messages_dropped_undecodable == 3
        assert stats.inbound_links == 1  # still linked
        await stream.aclose()


async def test_a_flood_of_unknown_frames_is_counted_and_logged_a_few_times(
    certs: CertSet, caplog: pytest.LogCaptureFixture
) -> None:
    async with node(certs, "server") as server, node(certs, "good") as good:
        stream = await raw_peer(server.local_address.address, certs.identity("raw"), "raw")
        unknown = _wire.HEADER.pack(1, 2, 0) + msgpack.packb(["tests.NoSuchType", 1])
        caplog.clear()
        await stream.send_all(encode_frame(unknown) * 20_000)
        await wait_until(lambda: server.statistics().messages_dropped_undecodable == 20_000)
        await assert_serves(server, good)
        await stream.aclose()
    lines = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]
    assert "tests.NoSuchType" in lines[0].getMessage()


async def test_a_handshake_timeout_is_logged_with_its_reason(
    certs: CertSet, caplog: pytest.LogCaptureFixture
) -> None:
    settings = TransportSettings(handshake_timeout=0.2)
    async with node(certs, "server", settings) as server:
        address = server.local_address.address
        silent = await trio.open_tcp_stream(address.host, address.port)  # never speaks
        await wait_until(lambda: server.statistics().handshakes_refused == 1)
        await silent.aclose()
    [line] = [r.getMessage() for r in caplog.records if "refused a link" in r.getMessage()]
    assert line.endswith("no hello within handshake_timeout (0.2 s)"), line


async def proxy(
    listener: trio.SocketListener,
    target: Address,
    corrupt: trio.Event,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward TCP both ways; once ``corrupt`` is set, flip one bit in the next upstream chunk.

    Only one chunk is ever altered, so the link that reconnects afterwards is clean.
    """
    flips_left = 1

    async def pipe(src: trio.SocketStream, dst: trio.SocketStream, upstream: bool) -> None:
        nonlocal flips_left
        try:
            while data := await src.receive_some(65536):
                chunk = bytearray(data)
                if upstream and corrupt.is_set() and flips_left:
                    chunk[len(chunk) // 2] ^= 0x01
                    flips_left -= 1
                await dst.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(dst)

    async def handle(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream(target.host, target.port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipe, client, server, True)
            nursery.start_soon(pipe, server, client, False)

    await trio.serve_listeners(handle, [listener], task_status=task_status)


async def test_byte_flipped_in_flight_closes_the_link_and_it_recovers(certs: CertSet) -> None:
    async with (
        node(certs, "server") as server,
        node(certs, "client") as client,
        trio.open_nursery() as nursery,
    ):
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        via = Address("127.0.0.1", listener.socket.getsockname()[1])
        corrupt = trio.Event()
        await nursery.start(proxy, listener, server.local_address.address, corrupt)
        await client.send(via, Seq(0))
        assert (await server.receive()).message == Seq(0)
        corrupt.set()
        await client.send(via, Seq(1, b"payload" * 10))
        await wait_until(lambda: server.statistics().links_closed_tls_error == 1)
        # The client notices and reconnects through the proxy.
        with trio.fail_after(20):
            while True:
                await client.send(via, Seq(2))
                with trio.move_on_after(0.2):
                    envelope = await server.receive()
                    assert envelope.message == Seq(2)  # never Seq(1) altered: TLS caught it
                    break
        assert client.statistics().peers[0].connects >= 2
        nursery.cancel_scope.cancel()


# ---- 1,000 garbage frames from hypothesis -------------------------------------------------

_valid = st.builds(lambda n: encode_frame(_wire.encode(Seq(n))), st.integers(0, 1000))
_garbage = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=64).map(encode_frame),
    st.tuples(
        st.integers(0, 3), st.integers(0, 3), st.integers(0, 2**64 - 1), st.binary(max_size=48)
    ).map(lambda t: encode_frame(_wire.HEADER.pack(*t[:3]) + t[3])),
    st.tuples(
        st.sampled_from([1, 2]),
        st.recursive(
            st.none()
            | st.integers(-(2**63), 2**64 - 1)
            | st.text(max_size=8)
            | st.sampled_from(["tests.Seq", "p2pshard.Address", "p2pshard.transport.Hello"]),
            lambda inner: st.lists(inner, max_size=4),
            max_leaves=8,
        ),
    ).map(lambda t: encode_frame(_wire.HEADER.pack(1, t[0], 0) + msgpack.packb(t[1]))),
    st.integers(4097, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    _valid,
)
_connection = st.lists(_garbage, min_size=1, max_size=3).map(b"".join)


@attrs.define
class Expected:
    closed: int = 0
    delivered: int = 0
    dropped: int = 0


def classify(data: bytes, server_uid: int, expected: Expected) -> None:
    """What the server must do with one connection's bytes: the sans-IO pipeline, replayed."""
    decoder = FrameDecoder(4096)
    frames, error = decoder.feed(data)
    for frame in frames:
        try:
            _kind, _to_uid = _wire.decode_header(frame)
        except Exception:
            expected.closed += 1
            return
        try:
            decoded = _wire.decode(frame)
        except Exception:
            expected.dropped += 1
            continue
        if decoded.to_uid and decoded.to_uid != server_uid:
            expected.dropped += 1
        else:
            expected.delivered += 1
    if error is not None or decoder.buffered:
        expected.closed += 1


async def garbage_round(certs: CertSet, connections: list[bytes]) -> None:
    limits = TransportSettings(max_frame_size=4096)
    async with node(certs, "server", limits) as server, node(certs, "good") as good:
        expected = Expected()
        raw_received = 0
        good_received: list[int] = []
        address = server.local_address.address
        identity = certs.identity("raw")

        async def consume() -> None:
            nonlocal raw_received
            async for envelope in server:
                if envelope.sender.name == "raw":
                    raw_received += 1
                else:
                    assert isinstance(envelope.message, Seq)
                    good_received.append(envelope.message.n)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            for i, data in enumerate(connections):
                classify(data, server.local_address.uid, expected)
                stream = await raw_peer(address, identity, "raw")
                await stream.send_all(data)
                await stream.aclose()
                await good.send(address, Seq(i))
            s = server.statistics
            await wait_until(
                lambda: (
                    s().inbound_links == 1
                    and len(good_received) == len(connections)
                    and raw_received == expected.delivered
                ),
                limit=60,
            )
            stats = s()
            closed = (
                stats.links_closed_frame_too_large
                + stats.links_closed_truncated
                + stats.links_closed_undecodable
            )
            assert closed == expected.closed
            assert (
                stats.messages_dropped_undecodable + stats.messages_dropped_wrong_incarnation
                == expected.dropped
            )
            assert good_received == list(range(len(connections)))
            assert stats.handshakes_refused == 0
            nursery.cancel_scope.cancel()


@settings(
    max_examples=4,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(connections=st.lists(_connection, min_size=250, max_size=250))
def test_a_thousand_garbage_frames_do_not_stop_a_node_serving_a_good_peer(
    certs: CertSet, connections: list[bytes]
) -> None:
    trio.run(garbage_round, certs, connections)


async def test_an_error_in_the_block_comes_out_as_itself(certs: CertSet) -> None:
    with pytest.raises(ZeroDivisionError):
        async with node(certs, "server"):
            1 / 0  # noqa: B018
