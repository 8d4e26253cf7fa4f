"""TLS over a connected socket, for transport links: writes that need not wait.

Theory of operation: an :class:`ssl.SSLObject` encrypts into and decrypts from memory buffers,
and this class moves the ciphertext between those buffers and a non-blocking socket. What it
adds over ``trio.SSLStream`` is :meth:`TlsLink.write_nowait`: encrypt now and give the kernel
as much as it takes now, from any task, without a scheduler pass. The transport uses it to put a
message on an idle link in the task that sends it: one-message-at-a-time traffic (a request and
its reply) then skips the hand-over to the link's writer task on each side. Whatever the kernel
did not take waits in :attr:`TlsLink.pending` until the one writer task calls
:meth:`TlsLink.flush`.

It is as much of ``trio.SSLStream`` as a link needs, and no more: one handshake, then bytes each
way; no renegotiation (TLS 1.3 has none), no ``https_compatible`` mode (an EOF without
``close_notify`` is an error, as there). Failures keep ``SSLStream``'s shape: a TLS or socket
error after the handshake started raises ``trio.BrokenResourceError`` whose ``__cause__`` is the
``ssl.SSLError`` or ``OSError``, so callers tell a tampered record (``SSLError``) from a peer
that went away (``SSLEOFError``, ``ConnectionResetError``).

Only one task may wait in :meth:`receive_some` and one in :meth:`flush` (or
:meth:`handshake`) at a time; :meth:`write_nowait` may be called from any task between them.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import Any

import trio

READ_SIZE = 1 << 16
"""Bytes asked of the socket, and of the TLS layer, per read."""


class TlsLink:
    """One TLS connection over a connected non-blocking socket (see the module docstring).

    Make it with :meth:`over`, from a connected ``trio.SocketStream``.
    """

    __slots__ = ("_closed", "_eof", "_incoming", "_outgoing", "_pending", "_sock", "_ssl")

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side, server_hostname=None
        )
        self._pending = bytearray()
        self._eof = False
        """The peer's ``close_notify`` was read: every later read returns b""."""
        self._closed = False

    @classmethod
    def over(cls, tcp: trio.SocketStream, context: ssl.SSLContext, *, server_side: bool) -> TlsLink:
        """Take over ``tcp``'s socket (``tcp`` is unusable afterwards) to run TLS on it."""
        return cls(socket.socket(fileno=tcp.socket.detach()), context, server_side=server_side)

    @property
    def pending(self) -> int:
        """Encrypted bytes written but not yet taken by the kernel; :meth:`flush` sends them."""
        return len(self._pending)

    def peer_certificate(self) -> dict[str, Any] | None:
        """The verified peer certificate (after the handshake), as ``ssl`` decodes it."""
        return self._ssl.getpeercert()

    def peer_certificate_der(self) -> bytes:
        """The verified peer certificate (after the handshake) in DER form; b"" if none."""
        return self._ssl.getpeercert(binary_form=True) or b""

    async def handshake(self) -> None:
        """Run the TLS handshake.

        Raises:
            trio.BrokenResourceError: it failed (``__cause__`` says why: a refused certificate,
                the peer closing the connection, ...).
        """
        while True:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                self._queue_output()
                await self.flush()
                await self._fill()
                continue
            except ssl.SSLError as exc:
                self._send_alert()
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
            self._queue_output()
            await self.flush()
            return

    def write_nowait(self, data: bytes) -> None:
        """Encrypt ``data`` and hand the kernel what it takes now; the rest waits in ``pending``.

        Never waits, so any task may call it. The bytes go out in the order written.

        Raises:
            trio.BrokenResourceError: the connection failed (``__cause__`` says how).
            trio.ClosedResourceError: this link was closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the link is closed")
        try:
            self._ssl.write(data)
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS write failed: {exc}") from exc
        out = self._outgoing.read()
        if self._pending:
            self._pending += out
            self._send_pending()
            return
        try:
            sent = self._sock.send(out)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"link write failed: {exc}") from exc
        if sent < len(out):
            self._pending += memoryview(out)[sent:]

    async def flush(self) -> None:
        """Wait until the kernel has taken every pending byte (no checkpoint if none is pending).

        Raises:
            trio.BrokenResourceError: the connection failed.
            trio.ClosedResourceError: the link was closed meanwhile.
        """
        while self._pending:
            if self._closed:  # closed by another task while this one was not waiting
                raise trio.ClosedResourceError("the link is closed")
            await trio.lowlevel.wait_writable(self._sock)
            self._send_pending()

    async def receive_some(self) -> bytes:
        """Decrypted bytes, at least one; b"" once the peer closed the connection cleanly.

        Returns without a checkpoint when data is already there.

        Raises:
            trio.BrokenResourceError: the connection failed: a record that does not decrypt
                (``__cause__`` an ``ssl.SSLError``), an EOF without ``close_notify``
                (``ssl.SSLEOFError``), a reset (``OSError``).
            trio.ClosedResourceError: the link was closed meanwhile.
        """
        while True:
            plain = self._decrypt()
            if plain is not None:
                return plain
            await self._fill()

    def close(self, *, notify: bool = True) -> None:
        """Close the socket, after a best-effort ``close_notify`` if ``notify``; never waits.

        Tasks waiting on this link get ``trio.ClosedResourceError``.
        """
        if self._closed:
            return
        self._closed = True
        if notify:
            # SSLWantReadError: the peer's close_notify is not awaited.
            with contextlib.suppress(ssl.SSLError, ValueError):
                self._ssl.unwrap()
            self._send_alert()
        trio.lowlevel.notify_closing(self._sock)
        self._sock.close()

    # ---- internals ----

    def _decrypt(self) -> bytes | None:
        """What arrived, decrypted; None if no whole record is in yet."""
        if self._eof:
            return b""
        chunks: list[bytes] = []
        read = self._ssl.read
        while True:
            try:
                chunk = read(READ_SIZE)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self._eof = True
                break
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS read failed: {exc}") from exc
            if not chunk:  # the peer's close_notify (ssl returns b"" for it, or raises above)
                self._eof = True
                break
            chunks.append(chunk)
        if self._outgoing.pending:  # a post-handshake answer, e.g. to a key update
            self._queue_output()
            self._send_pending()
        if chunks:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return b"" if self._eof else None

    async def _fill(self) -> None:
        """Wait for ciphertext (or the end of the stream) and give it to the TLS layer."""
        sock = self._sock
        while True:
            if self._closed:  # closed by another task while this one was not waiting
                raise trio.ClosedResourceError("the link is closed")
            try:
                data = sock.recv(READ_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            except OSError as exc:
                if self._closed:
                    raise trio.ClosedResourceError("the link is closed") from None
                raise trio.BrokenResourceError(f"link read failed: {exc}") from exc
            if data:
                self._incoming.write(data)
            else:
                self._incoming.write_eof()
            return

    def _queue_output(self) -> None:
        if self._outgoing.pending:
            self._pending += self._outgoing.read()

    def _send_pending(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the link is closed")
        try:
            sent = self._sock.send(self._pending)
        except BlockingIOError:
            return
        except OSError as exc:
            raise trio.BrokenResourceError(f"link write failed: {exc}") from exc
        del self._pending[:sent]

    def _send_alert(self) -> None:
        """Send what TLS wrote last (a failed handshake's alert, a ``close_notify``), unwaited.

        Best effort: the peer learns why the connection ends if the kernel takes it now.
        """
        self._queue_output()
        with contextlib.suppress(OSError):
            self._sock.send(self._pending)
