"""A minimal client side of the WebSocket protocol (RFC 6455), sans-IO, for the chat load workers.

Theory of operation: ``benchmarks/chat_load.py`` needs thousands of connections whose client
costs little CPU, so that the load generator is not what limits the figures. A general library
does much per frame (events, state checks, a task and a channel per message); this module does
only what a chat client over 127.0.0.1 needs: the opening handshake (:func:`handshake_request`,
:func:`check_handshake`), text frames out, masked with a fresh key as the protocol requires
(:func:`text_frame`), and frames in, cut from the byte stream (:class:`FrameReader`). No
extensions are offered, so the server compresses nothing. Fragmented messages are joined;
control frames (close, ping, pong) are passed up as they are, for the caller to act on. It has
no I/O and no clock: bytes in, messages out.
"""

from __future__ import annotations

import base64
import hashlib
import os

import attrs

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

_ACCEPT_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_HANDSHAKE = 16 * 1024
"""Bytes of the server's handshake answer read at most before giving up."""


class WebSocketProtocolError(Exception):
    """The server broke the protocol (a bad handshake answer, a masked or malformed frame)."""


def handshake_request(host: str, port: int, path: str) -> tuple[bytes, bytes]:
    """The opening GET request and its ``Sec-WebSocket-Key``.

    Example:
        >>> request, key = handshake_request("127.0.0.1", 8000, "/ws")
        >>> request.startswith(b"GET /ws HTTP/1.1\\r\\n"), len(key)
        (True, 24)
    """
    key = base64.b64encode(os.urandom(16))
    request = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key.decode()}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode("latin-1")
    return request, key


def accept_value(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` value a server must answer ``key`` with."""
    return base64.b64encode(hashlib.sha1(key + _ACCEPT_GUID).digest())


def check_handshake(answer: bytes, key: bytes) -> bytes | None:
    """Check the server's answer to the handshake; return the bytes after its head.

    ``answer`` is what has been read so far. None means the head is not complete yet (read
    more); a refusal or a wrong ``Sec-WebSocket-Accept`` raises :class:`WebSocketProtocolError`.
    """
    head, found, rest = answer.partition(b"\r\n\r\n")
    if not found:
        if len(answer) > MAX_HANDSHAKE:
            raise WebSocketProtocolError(f"no end of the handshake answer in {len(answer)} bytes")
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if len(status) < 2 or status[1] != "101":
        raise WebSocketProtocolError(f"the server refused the WebSocket: {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("sec-websocket-accept", "").encode("latin-1") != accept_value(key):
        raise WebSocketProtocolError("the server's Sec-WebSocket-Accept does not match the key")
    return rest


def text_frame(text: str, mask: bytes | None = None) -> bytes:
    """One final text frame carrying ``text``, masked (with ``mask``, else a random key).

    Example:
        >>> text_frame("Hi", b"\\x00\\x00\\x00\\x00")
        b'\\x81\\x82\\x00\\x00\\x00\\x00Hi'
    """
    payload = text.encode("utf-8")
    key = os.urandom(4) if mask is None else mask
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | OP_TEXT, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | OP_TEXT, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x80 | OP_TEXT, 0x80 | 127)) + n.to_bytes(8, "big")
    repeated = (key * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(n, "big")
    return head + key + masked


@attrs.define(eq=False)
class FrameReader:
    """Cuts the server's frames from the bytes received; joins fragmented messages.

    Example:
        >>> reader = FrameReader()
        >>> reader.feed(b"\\x81\\x02h")
        []
        >>> reader.feed(b"i\\x88\\x00")
        [(1, b'hi'), (8, b'')]
    """

    _buffer: bytearray = attrs.Factory(bytearray)
    _fragments: list[bytes] | None = None
    _fragment_opcode: int = OP_TEXT

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add ``data``; return the complete messages and control frames, ``(opcode, payload)``."""
        buffer = self._buffer
        buffer += data
        out: list[tuple[int, bytes]] = []
        pos, end = 0, len(buffer)
        while end - pos >= 2:
            first, second = buffer[pos], buffer[pos + 1]
            if second & 0x80:
                raise WebSocketProtocolError("the server sent a masked frame")
            if first & 0x70:
                raise WebSocketProtocolError("a frame with reserved bits set (no extension)")
            length, head = second & 0x7F, 2
            if length == 126:
                if end - pos < 4:
                    break
                length, head = int.from_bytes(buffer[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if end - pos < 10:
                    break
                length, head = int.from_bytes(buffer[pos + 2 : pos + 10], "big"), 10
            if end - pos < head + length:
                break
            payload = bytes(buffer[pos + head : pos + head + length])
            pos += head + length
            opcode, final = first & 0x0F, bool(first & 0x80)
            if opcode >= OP_CLOSE:  # control frames are never fragmented
                out.append((opcode, payload))
            elif opcode == OP_CONTINUATION:
                if self._fragments is None:
                    raise WebSocketProtocolError("a continuation frame without a first fragment")
                self._fragments.append(payload)
                if final:
                    out.append((self._fragment_opcode, b"".join(self._fragments)))
                    self._fragments = None
            elif self._fragments is not None:
                raise WebSocketProtocolError("a new message before the last one's final fragment")
            elif final:
                out.append((opcode, payload))
            else:
                self._fragments, self._fragment_opcode = [payload], opcode
        del buffer[:pos]
        return out
