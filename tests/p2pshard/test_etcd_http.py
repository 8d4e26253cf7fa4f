"""The etcd backend's HTTP/1.1 connections (``_etcd_http.PlainChannel``) against a scripted server.

A real etcd exercises the good path (``test_lease_etcd.py``); here a server on 127.0.0.1 answers
as each test scripts it, to check what is done with a connection after each kind of failure:
reused only after a clean exchange, never once the server closed it, idle too long, or the
exchange was cut short.
"""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import pytest
import trio

from p2pshard.leases import _etcd_http
from p2pshard.leases._etcd_http import (
    ChannelConnectError,
    ChannelError,
    ChannelTimeout,
    PlainChannel,
)

HOST = "127.0.0.1"
TEST_LIMIT = 10.0
"""Seconds any one test may take."""

Handler = Callable[["Peer"], Awaitable[None]]


@attrs.define(eq=False)
class Peer:
    """The server's side of one connection."""

    stream: trio.SocketStream
    h11: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.SERVER))
    ended: trio.Event = attrs.field(factory=trio.Event)
    """Set when the handler returned (for :func:`echo`: the client closed the connection)."""

    async def request(self) -> tuple[str, Any] | None:
        """The next request's target and JSON body; None at EOF."""
        body = b""
        target = ""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Request):
                target = event.target.decode()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return target, json.loads(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def answer(self, body: object, *, chunks: int = 1) -> None:
        """Answer 200 with ``body`` as JSON, in ``chunks`` chunks (chunked when more than one)."""
        data = json.dumps(body).encode()
        headers = [("Content-Type", "application/json")]
        if chunks == 1:
            headers.append(("Content-Length", str(len(data))))
        out = self.h11.send(h11.Response(status_code=200, headers=headers)) or b""
        step = -(-len(data) // chunks)
        for start in range(0, len(data), step):
            out += self.h11.send(h11.Data(data=data[start : start + step])) or b""
        out += self.h11.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(out)
        self.h11.start_next_cycle()

    async def eof(self) -> bool:
        """Whether the client closed the connection (reads until EOF or a second's wait)."""
        with trio.move_on_after(1.0):
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    return True
                if not data:
                    return True
        return False


@attrs.define(eq=False)
class Server:
    url: str
    peers: list[Peer]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    """A server on 127.0.0.1 (a free port) running ``handler`` for each connection."""
    server = Server("", [])

    async def accept(stream: trio.SocketStream) -> None:
        peer = Peer(stream)
        server.peers.append(peer)
        async with stream:
            await handler(peer)
        peer.ended.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, accept, 0, host=HOST))
        server.url = f"http://{HOST}:{listeners[0].socket.getsockname()[1]}"
        yield server
        nursery.cancel_scope.cancel()


async def echo(peer: Peer) -> None:
    """Answer every request with its target and body, until the client closes."""
    while (request := await peer.request()) is not None:
        target, body = request
        await peer.answer({"target": target, "body": body})


def channel(url: str, timeout: float = 2.0) -> PlainChannel:
    return PlainChannel(url, timeout=timeout, limit=8)


async def wait_closed_by_server(ch: PlainChannel, server: Server) -> None:
    """Until the idle connection shows the server's close (a loopback FIN comes at once)."""
    await server.peers[0].ended.wait()
    await trio.sleep(0.05)
    assert ch._idle[0].readable()


async def test_answers_come_over_one_kept_connection() -> None:
    with trio.fail_after(TEST_LIMIT):
        async with serving(echo) as server:
            ch = channel(server.url)
            for i in range(3):
                status, content = await ch.post("/v3/kv/range", {"key": str(i)})
                assert status == 200
                assert json.loads(content) == {"target": "/v3/kv/range", "body": {"key": str(i)}}
            assert ch.connections == 1
            assert len(server.peers) == 1
            await ch.aclose()
            await server.peers[0].ended.wait()


async def test_a_connection_the_server_closed_is_not_reused() -> None:
    async def once(peer: Peer) -> None:
        request = await peer.request()
        assert request is not None
        await peer.answer({"ok": True})
        # Then closed without a "Connection: close": only the socket says so.

    with trio.fail_after(TEST_LIMIT):
        async with serving(once) as server:
            ch = channel(server.url)
            await ch.post("/a", {})
            await wait_closed_by_server(ch, server)
            status, content = await ch.post("/b", {})
            assert (status, json.loads(content)) == (200, {"ok": True})
            assert ch.connections == 2
            await ch.aclose()


async def test_a_connection_idle_too_long_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(TEST_LIMIT):
        async with serving(echo) as server:
            ch = channel(server.url)
            await ch.post("/a", {})
            monkeypatch.setattr(_etcd_http, "KEEPALIVE_EXPIRY", -1.0)
            await ch.post("/b", {})
            assert ch.connections == 2
            await server.peers[0].ended.wait()  # the expired one was closed
            await ch.aclose()


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ch = channel(f"http://127.0.0.1:{port}")
    with trio.fail_after(TEST_LIMIT), pytest.raises(ChannelConnectError):
        await ch.post("/a", {})


async def test_no_answer_times_out_and_the_connection_is_closed() -> None:
    async def silent(peer: Peer) -> None:
        assert await peer.request() is not None
        assert await peer.eof()  # the client gave up and closed it

    with trio.fail_after(TEST_LIMIT):
        async with serving(silent) as server:
            ch = channel(server.url, timeout=0.2)
            with pytest.raises(ChannelTimeout, match=r"no answer within 0\.2 s"):
                await ch.post("/a", {})
            assert ch._idle == []


async def test_a_cancelled_request_closes_its_connection() -> None:
    answered = trio.Event()

    async def slow(peer: Peer) -> None:
        if await peer.request() is None:
            return
        assert await peer.eof()
        answered.set()

    with trio.fail_after(TEST_LIMIT):
        async with serving(slow) as server:
            ch = channel(server.url)
            with trio.move_on_after(0.1):
                await ch.post("/a", {})
            await answered.wait()  # the server saw the connection closed
            assert ch._idle == []
            assert len(server.peers) == 1


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"nonsense\r\n\r\n", "not valid HTTP/1.1"),
        (b"", "closed the connection before its whole answer"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            "closed the connection before its whole answer",
        ),
    ],
)
async def test_an_answer_that_is_not_http_fails_and_drops_the_connection(
    reply: bytes, error: str
) -> None:
    async def bad(peer: Peer) -> None:
        assert await peer.request() is not None
        await peer.stream.send_all(reply)

    with trio.fail_after(TEST_LIMIT):
        async with serving(bad) as server:
            ch = channel(server.url)
            with pytest.raises(ChannelError, match=error) as failure:
                await ch.post("/a", {})
            assert not isinstance(failure.value, (ChannelTimeout, ChannelConnectError))
            assert ch._idle == []


async def test_a_chunked_answer_is_read_whole() -> None:
    async def chunked(peer: Peer) -> None:
        while await peer.request() is not None:
            await peer.answer({"result": {"TTL": "15"}, "pad": "x" * 100}, chunks=3)

    with trio.fail_after(TEST_LIMIT):
        async with serving(chunked) as server:
            ch = channel(server.url)
            for _ in range(2):
                status, content = await ch.post("/v3/lease/keepalive", {"ID": "1"})
                assert status == 200
                assert json.loads(content) == {"result": {"TTL": "15"}, "pad": "x" * 100}
            assert ch.connections == 1
            await ch.aclose()


async def test_an_answer_too_long_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_etcd_http, "MAX_ANSWER", 10)
    with trio.fail_after(TEST_LIMIT):
        async with serving(echo) as server:
            ch = channel(server.url)
            with pytest.raises(ChannelError, match="longer than 10 bytes"):
                await ch.post("/a", {"key": "x" * 20})
            assert ch._idle == []


async def test_a_closed_channel_sends_nothing() -> None:
    with trio.fail_after(TEST_LIMIT):
        async with serving(echo) as server:
            ch = channel(server.url)
            await ch.post("/a", {})
            await ch.aclose()
            with pytest.raises(ChannelConnectError, match="closed"):
                await ch.post("/b", {})
            assert len(server.peers) == 1


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http:// URL"):
        PlainChannel("https://127.0.0.1:2379", timeout=1.0, limit=1)
