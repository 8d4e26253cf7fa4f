"""POSTs of JSON to etcd's gateway over kept-alive HTTP/1.1 connections: the etcd backend's wire.

Theory of operation. A shard with a lease runs its first message only once one transaction in
etcd has answered, so the cost of each request is on that message's path. Measured on the
benchmark machine (docs/benchmarks.md, "Leases"), a POST through ``httpx.AsyncClient`` took about
1.9 ms of this process's CPU (its client, then httpcore's connection pool over anyio, then
h11), more than etcd took to commit the transaction to its disk; the same POST written here,
with h11's state machine on a trio socket, about 0.5 ms. So an ``http://`` endpoint is spoken
to by :class:`PlainChannel`; an ``https://`` endpoint, or any httpx transport a caller passes in
(tests use ``httpx.MockTransport``), still goes through httpx (:class:`HttpxChannel`), whose
certificate handling is kept as it is.

A :class:`PlainChannel` keeps the connections to one endpoint that ended their last exchange
cleanly (at most ``limit``) and reuses them, the most recently used first. One idle for more
than :data:`KEEPALIVE_EXPIRY`, or that has something to read while idle (the server closed it),
is closed instead of reused: a request sent on it could fail after being sent, and then whether
it took effect is unknown. A connection whose exchange was cut short (an error, a timeout, a
cancellation) is closed at once, since what is left on it is unknown too.

Errors, the same from both channels: :class:`ChannelConnectError` when nothing was sent (no
connection could be made, so trying another endpoint is safe), :class:`ChannelTimeout` when the
request was sent but no whole answer came within ``timeout``, :class:`ChannelError` for anything
else (the connection broke, the answer is not HTTP). After the last two, whether the request took
effect is unknown.
"""

from __future__ import annotations

import json
import select
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

import h11
import httpx
import trio

KEEPALIVE_EXPIRY = 5.0
"""Seconds a connection may stay idle and still be reused (httpx's default, kept)."""

MAX_ANSWER = 4 * 1024 * 1024
"""Bytes an answer's body may have; etcd's answers to the backend's requests are a few hundred."""

_READ_SIZE = 65536


class ChannelError(Exception):
    """The request failed after it may have been sent: whether it took effect is unknown."""


class ChannelConnectError(ChannelError):
    """No connection could be made: the request was not sent."""


class ChannelTimeout(ChannelError):
    """The request was sent but no whole answer came within the channel's timeout."""


class Channel(Protocol):
    """POSTs of JSON to one endpoint."""

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST ``body`` as JSON to ``path``: the answer's status and body.

        Raises:
            ChannelConnectError: nothing was sent.
            ChannelTimeout: no whole answer within the timeout.
            ChannelError: the exchange failed otherwise.
        """
        ...

    async def aclose(self) -> None:
        """Close the connections; a request after this fails with ChannelConnectError."""
        ...


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


class _Connection:
    __slots__ = ("h11", "idle_since", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def close(self) -> None:
        """Close at once, without a checkpoint (also from a cancelled or failed exchange)."""
        self.stream.socket.close()

    def readable(self) -> bool:
        """Whether there is something to read (an idle connection: EOF, or stray bytes)."""
        poller = select.poll()
        poller.register(self.stream.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))


class PlainChannel:
    """POSTs to one ``http://`` endpoint over kept-alive HTTP/1.1 connections (see the module).

    Args:
        url: the endpoint, such as ``http://127.0.0.1:2379``.
        timeout: seconds to connect, and then seconds to send the request and read the answer.
        limit: idle connections kept at most.

    Raises:
        ValueError: ``url`` is not an ``http://`` URL with a host.
    """

    def __init__(self, url: str, *, timeout: float, limit: int) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// URL with a host")
        self.host = parts.hostname
        self.port = parts.port or 80
        self._authority = parts.netloc
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.limit = limit
        self._idle: list[_Connection] = []
        self._closed = False
        self.connections = 0
        """Connections opened so far."""

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """See :meth:`Channel.post`."""
        data = _encode(body)
        conn = self._reuse() or await self._connect()
        answer: tuple[int, bytes] | None = None
        try:
            with trio.move_on_after(self.timeout):
                answer = await self._exchange(conn, path, data)
        finally:
            if answer is None:  # failed, timed out or cancelled: what is left on it is unknown
                conn.close()
        if answer is None:
            raise ChannelTimeout(f"no answer within {self.timeout:g} s")
        self._keep(conn)
        return answer

    async def aclose(self) -> None:
        """See :meth:`Channel.aclose`."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        await trio.lowlevel.checkpoint()

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since <= KEEPALIVE_EXPIRY and not conn.readable():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            raise ChannelConnectError("the channel is closed")
        try:
            with trio.move_on_after(self.timeout) as scope:
                stream = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise ChannelConnectError(_describe(exc)) from exc
        if scope.cancelled_caught:
            raise ChannelConnectError(f"could not connect within {self.timeout:g} s")
        self.connections += 1
        return _Connection(stream)

    async def _exchange(self, conn: _Connection, path: str, data: bytes) -> tuple[int, bytes]:
        machine = conn.h11
        request = h11.Request(
            method="POST",
            target=self._prefix + path,
            headers=[
                ("Host", self._authority),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(data))),
            ],
        )
        closed = False
        try:
            # One write: headers and body leave in one segment.
            await conn.stream.send_all(
                b"".join(
                    (
                        machine.send(request) or b"",
                        machine.send(h11.Data(data=data)) or b"",
                        machine.send(h11.EndOfMessage()) or b"",
                    )
                )
            )
            status = 0
            chunks: list[bytes] = []
            size = 0
            while True:
                event = machine.next_event()
                if event is h11.NEED_DATA:
                    data = await conn.stream.receive_some(_READ_SIZE)
                    closed = not data
                    machine.receive_data(data)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > MAX_ANSWER:
                        raise ChannelError(f"the answer is longer than {MAX_ANSWER} bytes")
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return status, b"".join(chunks)
                elif isinstance(event, h11.ConnectionClosed):
                    raise ChannelError("the server closed the connection before its whole answer")
                # InformationalResponse (100 Continue): read on.
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ChannelError(f"the connection broke: {_describe(exc)}") from exc
        except h11.ProtocolError as exc:
            if closed:
                raise ChannelError(
                    f"the server closed the connection before its whole answer ({exc})"
                ) from exc
            raise ChannelError(f"the answer is not valid HTTP/1.1: {exc}") from exc

    def _keep(self, conn: _Connection) -> None:
        machine = conn.h11
        if (
            self._closed
            or len(self._idle) >= self.limit
            or machine.our_state is not h11.DONE
            or machine.their_state is not h11.DONE
        ):
            conn.close()
            return
        machine.start_next_cycle()
        conn.idle_since = time.monotonic()
        self._idle.append(conn)


class HttpxChannel:
    """POSTs to one endpoint through an ``httpx.AsyncClient`` (shared by the backend's channels).

    For ``https://`` endpoints, and for an httpx transport passed in (tests).
    """

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client = client
        self._url = url

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """See :meth:`Channel.post`."""
        try:
            response = await self._client.post(
                self._url + path,
                content=_encode(body),
                headers={"Content-Type": "application/json"},
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ChannelConnectError(_describe(exc)) from exc
        except httpx.TimeoutException as exc:
            raise ChannelTimeout(_describe(exc)) from exc
        except httpx.HTTPError as exc:
            raise ChannelError(_describe(exc)) from exc
        return response.status_code, response.content

    async def aclose(self) -> None:
        """See :meth:`Channel.aclose`; the shared client is closed by its owner."""
        await trio.lowlevel.checkpoint()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
