"""The client side of one WebSocket for the chat load workers: wsproto's state machine, no I/O.

Theory of operation: ``benchmarks/chat_load.py`` needs thousands of connections whose client
costs little CPU, so that the load generator is not what limits the figures. So the workers do
their own I/O (one epoll thread per process, no task or channel per message) and leave the
protocol to wsproto, the sans-IO WebSocket implementation trio-websocket is built on:
:class:`ClientWebSocket` turns bytes received into whole messages, and messages into bytes to
send (masked, as a client's must be). Pings are answered: their pongs wait in
:meth:`ClientWebSocket.outgoing` for the caller to send. No extension is offered, so the server
compresses nothing.
"""

from __future__ import annotations

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

TEXT = "text"
BINARY = "binary"
CLOSE = "close"


class WebSocketProtocolError(Exception):
    """The server refused the WebSocket or broke the protocol."""


class ClientWebSocket:
    """One client WebSocket: the opening request, then messages in and out.

    Example:
        >>> ws = ClientWebSocket("127.0.0.1", 8000, "/ws")
        >>> ws.opening().startswith(b"GET /ws HTTP/1.1\\r\\n")
        True
    """

    def __init__(self, host: str, port: int, path: str) -> None:
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._opening = self._ws.send(Request(host=f"{host}:{port}", target=path))
        self._parts: list[str | bytes] = []
        self._outgoing = bytearray()
        self.accepted = False
        """Whether the server accepted the WebSocket (its 101 answer has been read)."""

    def opening(self) -> bytes:
        """The opening handshake's request, to send first."""
        return self._opening

    def feed(self, data: bytes) -> list[tuple[str, str | bytes]]:
        """Take bytes received; return the messages they complete as ``(kind, payload)``.

        ``kind`` is :data:`TEXT` (payload a ``str``), :data:`BINARY`, or :data:`CLOSE` (payload
        the close code and reason, as text): the server closed the WebSocket, or sent a frame
        against the protocol (code 1002 and what was wrong). Empty ``data`` means the server
        closed the stream.

        Raises:
            WebSocketProtocolError: the server refused the WebSocket, or its handshake answer
                broke the protocol.
        """
        out: list[tuple[str, str | bytes]] = []
        try:
            self._ws.receive_data(data or None)
            for event in self._ws.events():
                if isinstance(event, AcceptConnection):
                    self.accepted = True
                elif isinstance(event, RejectConnection):
                    raise WebSocketProtocolError(
                        f"the server refused the WebSocket with status {event.status_code}"
                    )
                elif isinstance(event, TextMessage | BytesMessage):
                    self._parts.append(
                        event.data if isinstance(event.data, str) else bytes(event.data)
                    )
                    if event.message_finished:
                        parts, self._parts = self._parts, []
                        if isinstance(event, TextMessage):
                            out.append((TEXT, "".join(p for p in parts if isinstance(p, str))))
                        else:
                            out.append((BINARY, b"".join(p for p in parts if isinstance(p, bytes))))
                elif isinstance(event, Ping):
                    self._outgoing += self._ws.send(event.response())
                elif isinstance(event, CloseConnection):
                    out.append((CLOSE, f"{event.code} {event.reason or ''}".strip()))
        except RemoteProtocolError as exc:
            raise WebSocketProtocolError(f"the server broke the WebSocket protocol: {exc}") from exc
        return out

    def text(self, text: str) -> bytes:
        """The bytes of one text message carrying ``text``, to send."""
        return self._ws.send(Message(data=text))

    def outgoing(self) -> bytes:
        """Bytes the protocol itself must send (pongs), taken once."""
        data, self._outgoing = bytes(self._outgoing), bytearray()
        return data
