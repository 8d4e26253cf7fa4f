"""TlsLink on its own: TLS over a real loopback connection, ends and failures included.

The transport's conformance and security tests run it inside links; these pin what the
transport relies on: how each kind of end looks, and that writes never wait.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from membership.transport._tls import peer_node_name
from membership.transport._tlslink import TlsLink

from .conftest import CertSet


@asynccontextmanager
async def tcp_pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    try:
        client = await trio.open_tcp_stream("127.0.0.1", port)
        server = await listeners[0].accept()
    finally:
        for listener in listeners:
            await listener.aclose()
    yield client, server


@asynccontextmanager
async def link_pair(certs: CertSet) -> AsyncIterator[tuple[TlsLink, TlsLink]]:
    """A connected (client, server) pair, handshake done."""
    async with tcp_pair() as (client_tcp, server_tcp):
        client = TlsLink.over(client_tcp, certs.identity("a").client_context(), server_side=False)
        server = TlsLink.over(server_tcp, certs.identity("b").server_context(), server_side=True)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.handshake)
                nursery.start_soon(server.handshake)
            yield client, server
        finally:
            client.close(notify=False)
            server.close(notify=False)


async def receive_exactly(link: TlsLink, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:  # bounded: each round reads at least one byte or raises
        chunk = await link.receive_some()
        assert chunk, f"end of stream after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def test_bytes_travel_both_ways_after_a_mutual_handshake(certs: CertSet) -> None:
    async with link_pair(certs) as (client, server):
        assert peer_node_name(client.peer_certificate(), certs.cluster) == "b"
        assert peer_node_name(server.peer_certificate(), certs.cluster) == "a"
        client.write_nowait(b"ping")
        assert await receive_exactly(server, 4) == b"ping"
        server.write_nowait(b"pong")
        assert await receive_exactly(client, 4) == b"pong"


async def test_a_clean_close_reads_as_the_end_every_time(certs: CertSet) -> None:
    async with link_pair(certs) as (client, server):
        client.write_nowait(b"last words")
        client.close()  # close_notify
        assert await receive_exactly(server, 10) == b"last words"
        assert await server.receive_some() == b""
        assert await server.receive_some() == b""


async def test_an_end_without_close_notify_is_a_broken_link(certs: CertSet) -> None:
    async with link_pair(certs) as (client, server):
        # The server closes: it has read all the client sent, so the kernel ends with a FIN (a
        # side closing with unread data resets the connection instead: an OSError cause).
        server.close(notify=False)
        with pytest.raises(trio.BrokenResourceError) as caught:
            await client.receive_some()
        assert isinstance(caught.value.__cause__, ssl.SSLEOFError)


async def test_a_record_altered_in_flight_is_a_tls_error(certs: CertSet) -> None:
    async with tcp_pair() as (client_tcp, server_tcp):
        server = TlsLink.over(server_tcp, certs.identity("b").server_context(), server_side=True)
        client = trio.SSLStream(
            client_tcp, certs.identity("a").client_context(), server_hostname=None
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.do_handshake)
            nursery.start_soon(server.handshake)
        # An application-data record with a ciphertext that cannot authenticate.
        await client.transport_stream.send_all(b"\x17\x03\x03\x00\x20" + bytes(32))
        with pytest.raises(trio.BrokenResourceError) as caught:
            await server.receive_some()
        assert isinstance(caught.value.__cause__, ssl.SSLError)
        assert not isinstance(caught.value.__cause__, ssl.SSLEOFError)
        server.close(notify=False)
        await trio.aclose_forcefully(client)


async def test_a_write_never_waits_and_flush_waits_for_the_kernel(certs: CertSet) -> None:
    size = 8 << 20  # far more than loopback socket buffers hold
    data = bytes(range(256)) * (size // 256)
    async with link_pair(certs) as (client, server):
        client.write_nowait(data)  # returns at once, whatever the kernel took
        assert client.pending > 0
        client.write_nowait(b"tail")  # queued behind the pending bytes, in order
        received = b""

        async def read_all() -> None:
            nonlocal received
            received = await receive_exactly(server, size + 4)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await client.flush()
            assert client.pending == 0
        assert received == data + b"tail"


async def test_a_closed_link_refuses_writes_and_wakes_its_reader(certs: CertSet) -> None:
    async with link_pair(certs) as (_, server):
        outcome: list[BaseException] = []

        async def read() -> None:
            try:
                await server.receive_some()
            except trio.ClosedResourceError as exc:
                outcome.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            server.close()
        assert len(outcome) == 1
        with pytest.raises(trio.ClosedResourceError):
            server.write_nowait(b"late")


async def test_a_certificate_from_another_ca_fails_the_handshake(
    certs: CertSet, other_certs: CertSet
) -> None:
    async with tcp_pair() as (client_tcp, server_tcp):
        client = TlsLink.over(
            client_tcp, other_certs.identity("a").client_context(), server_side=False
        )
        server = TlsLink.over(server_tcp, certs.identity("b").server_context(), server_side=True)
        failures: list[BaseException] = []

        async def handshake(link: TlsLink) -> None:
            try:
                await link.handshake()
            except trio.BrokenResourceError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(handshake, client)
            nursery.start_soon(handshake, server)
        # The client rejects the server's certificate (from another CA) at once.
        assert failures
        assert all(isinstance(f.__cause__, ssl.SSLError) for f in failures)
        client.close(notify=False)
        server.close(notify=False)


async def test_a_link_closed_by_another_task_refuses_flush_and_reads_cleanly(
    certs: CertSet,
) -> None:
    # A link closed while its writer was busy elsewhere (a newer incarnation of the peer linked
    # in, say): the writer's next flush or read must fail as closed, not on a closed descriptor.
    async with link_pair(certs) as (client, _server):
        while not client.pending:  # the peer reads nothing: fill the socket buffer
            client.write_nowait(b"x" * 65536)
        client.close(notify=False)
        with pytest.raises(trio.ClosedResourceError):
            await client.flush()
        with pytest.raises(trio.ClosedResourceError):
            await client.receive_some()
