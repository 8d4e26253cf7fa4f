"""What the TCP transport refuses, and that refusing never disturbs good peers.

Raw TLS clients here play the hostile or broken peer; the node under test is a real
``open_tcp_transport`` on 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import resource
import ssl
import struct
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import msgpack
import pytest
import trio
import trio.testing
from cryptography import x509
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from membership import (
    Address,
    ConfigurationError,
    IdentityKind,
    PeerIdentity,
    Transport,
    TransportSettings,
    UniqueAddress,
    message,
)
from membership.transport import _wire
from membership.transport._framing import FrameDecoder, encode_frame
from membership.transport._tcp import Hello, HelloAck, TcpTransport, open_tcp_transport
from membership.transport._tls import DenyList, TlsIdentity
from tests._support.polling import wait_until

from .conftest import CLUSTER, CertSet, Seq

LOCAL = Address("127.0.0.1", 0)


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
        # A Seq with a field more than this node knows is a newer peer's: read without it
        # (issue 22; it was dropped as undecodable before).
        assert (await server.receive()).message == Seq(1, 2)  # type: ignore[arg-type]
        envelope = await server.receive()
        assert envelope.message == Seq(2)
        stats = server.statistics()
        assert stats.messages_dropped_undecodable == 2
        assert stats.inbound_links == 1  # still linked
        await stream.aclose()


async def test_an_unknown_type_for_another_incarnation_counts_as_that_not_as_unreadable(
    certs: CertSet,
) -> None:
    # A newer incarnation on this address (a newer build) may have been sent a type this one
    # does not know; the frame names that incarnation, so it is dropped as not for us.
    async with node(certs, "server") as server:
        stream = await raw_peer(server.local_address.address, certs.identity("raw"), "raw")
        other_uid = server.local_address.uid ^ 1
        unknown = msgpack.packb(["tests.NoSuchType", 1])
        await stream.send_all(
            encode_frame(_wire.HEADER.pack(1, 2, other_uid) + unknown)
            + encode_frame(_wire.HEADER.pack(1, 2, server.local_address.uid) + unknown)
            + encode_frame(_wire.encode(Seq(3)))
        )
        assert (await server.receive()).message == Seq(3)
        stats = server.statistics()
        assert stats.messages_dropped_wrong_incarnation == 1
        assert stats.messages_dropped_undecodable == 1  # the one for this incarnation
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


# --- deny lists, reloaded TLS settings and CA rotation ------------------------------------------


def denying(identity: TlsIdentity, *entries: str) -> TlsIdentity:
    return attrs.evolve(identity, deny=DenyList.parse(entries))


def serial_of(identity: TlsIdentity) -> int:
    return x509.load_pem_x509_certificate(identity.cert_file.read_bytes()).serial_number


async def exchange(sender: Transport, receiver: Transport, n: int) -> None:
    """``sender`` sends Seq(n); ``receiver`` gets it (its inbox holds nothing else)."""
    await sender.send(receiver.local_address.address, Seq(n))
    with trio.fail_after(10):
        envelope = await receiver.receive()
    assert (envelope.message, envelope.sender) == (Seq(n), sender.local_address)


def failures_to(transport: Transport, other: Transport) -> int:
    peer = transport.statistics().peer(other.local_address.address)
    return 0 if peer is None else peer.connect_failures


@pytest.mark.parametrize("by", ["identity", "serial"])
async def test_a_denied_peer_is_refused_when_it_connects(certs: CertSet, by: str) -> None:
    mallory_id = certs.identity("mallory")
    entry = "node:mallory" if by == "identity" else f"serial:{serial_of(mallory_id):x}"
    server_id = denying(certs.identity("server"), entry)
    async with (
        open_tcp_transport(server_id, "server", LOCAL) as server,
        open_tcp_transport(mallory_id, "mallory", LOCAL) as mallory,
        node(certs, "good") as good,
    ):
        await mallory.send(server.local_address.address, Seq(0))
        await wait_until(lambda: failures_to(mallory, server) >= 1)
        assert server.statistics().handshakes_refused >= 1
        assert server.statistics().messages_received == 0
        await assert_serves(server, good)


async def test_a_node_does_not_link_to_a_denied_peer_either(certs: CertSet) -> None:
    server_id = denying(certs.identity("server"), "node:target")
    async with (
        open_tcp_transport(server_id, "server", LOCAL) as server,
        node(certs, "target") as target,
    ):
        await server.send(target.local_address.address, Seq(0))
        await wait_until(lambda: failures_to(server, target) >= 1)
        # Refused by the side that connected, after the TLS handshake: counted as refused.
        assert server.statistics().handshakes_refused >= 1
        assert server.connected_peers() == []
        assert target.statistics().messages_received == 0


async def test_reload_closes_the_open_links_of_a_newly_denied_peer_both_ways(
    certs: CertSet,
) -> None:
    server_id = certs.identity("server")
    async with (
        open_tcp_transport(server_id, "server", LOCAL) as server,
        node(certs, "peer") as peer,
        node(certs, "good") as good,
    ):
        for n, other in enumerate((peer, good)):
            await exchange(other, server, n)
            await exchange(server, other, n)
        assert server.statistics().inbound_links == 2
        assert len(server.connected_peers()) == 2

        assert server.reload_tls(denying(server_id, "node:peer")) == 2
        await wait_until(lambda: server.statistics().inbound_links == 1)
        await wait_until(lambda: server.connected_peers() == [good.local_address])
        # Neither way comes back: the peer's new links are refused, and so are the server's.
        await peer.send(server.local_address.address, Seq(10))
        await server.send(peer.local_address.address, Seq(10))
        await wait_until(lambda: failures_to(peer, server) >= 1 and failures_to(server, peer) >= 1)
        assert server.statistics().messages_received == 2
        assert peer.statistics().messages_received == 1
        # The other peer's links were left alone.
        assert good.statistics().peers[0].connects == 1
        await exchange(good, server, 20)
        await exchange(server, good, 20)


async def test_reload_judges_a_link_whose_set_up_began_before_it(certs: CertSet) -> None:
    server_id = certs.identity("server")
    async with open_tcp_transport(server_id, "server", LOCAL) as server:
        address = server.local_address.address
        stream = await tls_client(address, certs.identity("late"))
        # The server has checked the certificate and now waits for the hello.
        await trio.testing.wait_all_tasks_blocked()
        server.reload_tls(denying(server_id, "node:late"))
        hello = Hello(cluster=CLUSTER, sender=UniqueAddress(Address("127.0.0.1", 1), "late", 1))
        await stream.send_all(
            encode_frame(_wire.encode(hello)) + encode_frame(_wire.encode(Seq(0)))
        )
        # The hello was good when it came, so it got its answer; then the registration of the
        # link found the new deny list, and the link ended.
        decoder, frames = FrameDecoder(1 << 20), []
        with trio.fail_after(10):
            try:
                while data := await stream.receive_some(1024):
                    frames += decoder.feed(data)[0]
            except trio.BrokenResourceError:
                pass
        await trio.aclose_forcefully(stream)
        assert [type(_wire.decode(f).message) for f in frames] == [HelloAck]
        await wait_until(lambda: server.statistics().handshakes_refused == 1)
        assert server.statistics().messages_received == 0
        assert server.statistics().inbound_links == 0


async def test_a_bad_reload_is_refused_and_changes_nothing(certs: CertSet, tmp_path: Path) -> None:
    server_id = denying(certs.identity("server"), "node:mallory")
    missing = tmp_path / "missing.pem"
    bad = [
        (attrs.evolve(server_id, ca_files=(missing,), deny=DenyList()), "does not exist"),
        (
            attrs.evolve(certs.identity("someone-else"), deny=DenyList()),
            "is for node:someone-else, but this node is node:server: restart it",
        ),
        (
            attrs.evolve(certs.identity("server", kind=IdentityKind.ADMIN), deny=DenyList()),
            "is for admin:server, but this node is node:server",
        ),
        (attrs.evolve(server_id, cluster="another"), "for cluster 'another', not"),
    ]
    async with (
        open_tcp_transport(server_id, "server", LOCAL) as server,
        node(certs, "good") as good,
        node(certs, "mallory") as mallory,
    ):
        await exchange(good, server, 0)
        await exchange(server, good, 0)
        for identity, reason in bad:
            with pytest.raises(ConfigurationError, match=re.escape(reason)):
                server.reload_tls(identity)
        # The old deny list still holds, and the good links are still up.
        await mallory.send(server.local_address.address, Seq(0))
        await wait_until(lambda: failures_to(mallory, server) >= 1)
        await exchange(good, server, 1)
        await exchange(server, good, 1)
        assert good.statistics().peers[0].connects == 1
        assert server.statistics().peers[0].connects == 1


@pytest.mark.parametrize("form", ["bundle", "ca_files"])
async def test_a_cluster_moves_to_a_new_ca_without_a_gap(
    certs: CertSet, other_certs: CertSet, tmp_path: Path, form: str
) -> None:
    # certs is the old CA, other_certs the new one (same cluster name, another key).
    old_ca, new_ca = certs.root / "ca" / "ca.pem", other_certs.root / "ca" / "ca.pem"

    def trusting(identity: TlsIdentity, *cas: Path) -> TlsIdentity:
        if form == "ca_files":
            return attrs.evolve(identity, ca_file=cas[0], ca_files=cas[1:])
        bundle = tmp_path / f"bundle-{len(cas)}.pem"
        bundle.write_bytes(b"".join(ca.read_bytes() for ca in cas))
        return attrs.evolve(identity, ca_file=bundle)

    async with AsyncExitStack() as stack:

        async def start(identity: TlsIdentity, name: str) -> TcpTransport:
            return await stack.enter_async_context(open_tcp_transport(identity, name, LOCAL))

        # During the change everyone trusts both CAs; "a" and "c" still have old certificates,
        # "b" has a new one already. Every pair links, both ways.
        a = await start(trusting(certs.identity("a"), old_ca, new_ca), "a")
        b = await start(trusting(other_certs.identity("b"), old_ca, new_ca), "b")
        c = await start(trusting(certs.identity("c"), old_ca, new_ca), "c")
        for n, (x, y) in enumerate([(a, b), (b, a), (a, c), (c, a), (b, c), (c, b)]):
            await exchange(x, y, n)

        # "a" gets its new certificate and stops trusting the old CA: its links with "c",
        # whose certificate only the old CA signed, close; those with "b" stay.
        assert a.reload_tls(trusting(other_certs.identity("a"), new_ca)) == 2
        await wait_until(lambda: a.connected_peers() == [b.local_address])
        await wait_until(lambda: a.statistics().inbound_links == 1)
        await exchange(a, b, 10)
        await exchange(b, a, 11)
        # New links with old certificates are refused, both ways.
        refused = a.statistics().handshakes_refused
        await c.send(a.local_address.address, Seq(12))
        await a.send(c.local_address.address, Seq(12))
        await wait_until(lambda: failures_to(a, c) >= 1 and failures_to(c, a) >= 1)
        assert a.statistics().handshakes_refused > refused
        # A node that trusts only the new CA links to "a", which now presents its new certificate.
        d = await start(other_certs.identity("d"), "d")
        await exchange(d, a, 13)
        await exchange(a, d, 14)
        assert c.statistics().messages_received == 2


async def idle_connection(address: Address, source: str) -> trio.socket.SocketType:
    """A TCP connection from ``source`` (a loopback address) that never says a word."""
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect((address.host, address.port))
    return sock


async def test_connections_waiting_for_a_handshake_are_capped_in_all_and_per_host(
    certs: CertSet, caplog: pytest.LogCaptureFixture
) -> None:
    settings = TransportSettings(
        max_pending_handshakes=6, max_pending_handshakes_per_host=4, handshake_timeout=30
    )
    async with node(certs, "server", settings) as server, node(certs, "good") as good:
        address = server.local_address.address
        idle = [await idle_connection(address, "127.0.0.2") for _ in range(10)]
        await wait_until(lambda: server.statistics().connections_refused_busy == 6)
        idle += [await idle_connection(address, "127.0.0.3") for _ in range(3)]
        # Two fit in the budget in all (6): the third is refused although its host has room.
        await wait_until(lambda: server.statistics().connections_refused_busy == 7)
        for sock in idle[:4]:  # the first host's pending ones go: room again
            sock.close()
        await assert_serves(server, good, 3)  # a good peer (127.0.0.1) links and is served
        for sock in idle:
            sock.close()
    lines = [r.getMessage() for r in caplog.records if "wait for their handshake" in r.getMessage()]
    assert 1 <= len(lines) <= 2, lines
    assert "max_pending_handshakes_per_host" in lines[0]


async def test_out_of_file_descriptors_the_accept_loop_waits_and_says_so_once(
    certs: CertSet, caplog: pytest.LogCaptureFixture
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with node(certs, "server") as server, node(certs, "good") as good:
        address = server.local_address.address
        await assert_serves(server, good)
        hogs: list[int] = []
        try:
            while True:  # take every descriptor this process may have
                hogs.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        try:
            clients = []
            for _ in range(3):
                os.close(hogs.pop())  # room for the client's socket only
                clients.append(await idle_connection(address, "127.0.0.4"))
            await wait_until(lambda: server.statistics().accepts_failed >= 3)
            with trio.move_on_after(1.0):
                await trio.sleep_forever()  # the loop waits, it does not spin
            failed = server.statistics().accepts_failed
        finally:
            for fd in hogs:
                os.close(fd)
        for sock in clients:
            sock.close()
        await assert_serves(server, good)  # once descriptors are back, all is as before
    assert failed < 40, failed  # backing off to a second, not every 0.1 s
    lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None  # a line, not a traceback
    assert "Too many open files" in lines[0].getMessage()
    assert (soft, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)
