"""The TCP transport: mutual TLS 1.3 links between nodes.

Theory of operation: each node listens on its bind address. The first message to a peer starts
an outbound link task for that peer's address, which connects, runs the TLS handshake, checks the
peer certificate's ``p2pshard://<cluster>/<node>`` URI, sends a :class:`Hello` naming our
incarnation and waits for a :class:`HelloAck` naming theirs. Then it writes queued frames in
batches until the link breaks (a lone frame sent while the link is idle is written by the task
that sends it, see ``_tlslink``), and reconnects with capped exponential backoff (with jitter,
so a restarted cluster does not reconnect in lockstep). The link carries frames one way only;
the peer sends to us over its own outbound link, as Akka's Artery TCP does, which keeps
per-direction order simple. The accepting side checks the same certificate URI, then that the
hello names the same cluster and node as the certificate, replies, and feeds the frames it reads
to the shared inbox.

What goes wrong on one link stays on that link: a refused handshake, an oversize, truncated or
undecodable frame, or a TLS record altered in flight closes it, is counted in ``statistics()`` and
logged; the node and its other links carry on.

Both sides judge the peer's certificate after the handshake by the same rules: a trusted CA
signed it (the TLS layer checks that), it names an identity of this cluster, and the deny list
does not name it or its serial. The transport keeps a registry of its open links, inbound and
outbound, with each one's identity and certificate, so that :meth:`TcpTransport.reload_tls` can
apply new TLS settings to them too: a link the new deny list names, or whose certificate no CA
of the new settings signed, is closed. A link whose handshake began before a reload is judged by
the new settings again as it is registered, so none slips through in between.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import secrets
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import attrs
import trio
from cryptography import x509

from . import _wire
from ._address import Address, UniqueAddress
from ._errors import ConfigurationError, HandshakeError, ProtocolError
from ._framing import FrameDecoder, encode_frame
from ._identity import IdentityKind, PeerIdentity
from ._memory import TRIM_INTERVAL, give_memory_back
from ._settings import TransportSettings
from ._tls import (
    DenyList,
    TlsIdentity,
    identity_text,
    issued_by_any,
    peer_identity,
    peer_serial,
)
from ._tlslink import TlsLink
from ._transport import Outbox, Transport
from ._trioutil import single_error
from ._versions import CURRENT_PROTOCOL, ProtocolRange

logger = logging.getLogger("membership.transport")

_SHORT_READ = 4096
"""A read of fewer bytes than this means the peer is not streaming: latency matters more."""
_YIELDS_AFTER_SHORT_READ = 1
"""Checkpoints a link's reader makes after handing over what a short read brought, before it
reads again (on top of the one every delivery makes). The tasks those messages woke (an entity
that answers, an asker that sends its next request) then write to their idle links before this
reader spends a read that finds nothing and a re-arm of its wait on the socket. More than one
bought nothing measurable once replies stopped going through a link writer task.
A streaming peer fills every read, so its link pays none of this."""


ACCEPT_RETRY_MIN = 0.05
"""First wait after an accept failed for lack of file descriptors or memory (doubling)."""
ACCEPT_RETRY_MAX = 1.0
"""The longest such wait."""
TRIM_AFTER_BURST = 32
"""Once this many handshakes were pending at once and all are over, free heap memory goes back
to the operating system (see ``_memory``)."""
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

RETRY_HINT_INTERVAL = 0.5
"""Seconds between two "a link came up: retry the others now" hints (see ``_retry_others``)."""
STALE_CONNECT_ATTEMPT = 1.0
"""A connect attempt unanswered for this long is started afresh on such a hint."""
HURRIED_CONNECT_ATTEMPT = 0.5
"""``hurry`` starts afresh a connect attempt unanswered for this long: a SYN lost to a
partition that has healed since is retransmitted by the kernel only seconds later."""

_LINK_FAILURES = (
    HandshakeError,
    ProtocolError,
    trio.BrokenResourceError,
    trio.TooSlowError,
    OSError,
)
"""What ends a handshake or a connect attempt (counted and logged, never raised further)."""


@_wire.message(name="p2pshard.transport.Hello")
@attrs.frozen(kw_only=True)
class Hello:
    """First frame on a new link: who is connecting, and which protocol versions it speaks."""

    cluster: str
    sender: UniqueAddress
    protocol_low: int = 1
    protocol_high: int = 1
    app_version: str = ""


@_wire.message(name="p2pshard.transport.HelloAck")
@attrs.frozen(kw_only=True)
class HelloAck:
    """The accepting node's answer: who accepted, and the protocol version the link speaks."""

    sender: UniqueAddress
    protocol: int = 1
    app_version: str = ""


@_wire.message(name="p2pshard.transport.HelloRefused")
@attrs.frozen(kw_only=True)
class HelloRefused:
    """The accepting node's answer to a hello it cannot take: why (then it closes the link)."""

    reason: str


def _peer_range(hello: Hello) -> ProtocolRange:
    try:
        return ProtocolRange(hello.protocol_low, hello.protocol_high)
    except ConfigurationError as exc:
        raise HandshakeError(f"hello with an invalid protocol range: {exc}") from None


def check_hello(message: object, *, cluster: str, certificate_name: str) -> UniqueAddress:
    """Validate the first message on an accepted link; return the peer's incarnation.

    Raises:
        HandshakeError: not a Hello, another cluster, or a node name other than the certificate's.
    """
    if not isinstance(message, Hello):
        raise HandshakeError(f"expected a Hello first, got {type(message).__name__}")
    if message.cluster != cluster:
        raise HandshakeError(f"hello is for cluster {message.cluster!r}, not {cluster!r}")
    if message.sender.name != certificate_name:
        raise HandshakeError(
            f"hello names node {message.sender.name!r} but the certificate is for "
            f"{certificate_name!r}"
        )
    return message.sender


class _Refused(HandshakeError):
    """The peer's certificate is valid, but this node's deny list or trust refuses it."""


@attrs.define(eq=False)
class _OpenLink:
    """An established link, as the registry ``reload_tls`` judges again holds it."""

    link: TlsLink
    peer: UniqueAddress
    identity: PeerIdentity
    serial: int
    certificate: bytes
    """The peer's certificate (DER), to check whether a CA of new settings signed it."""
    inbound: bool

    def __str__(self) -> str:
        way = "from" if self.inbound else "to"
        return f"{way} {self.peer} ({identity_text(self.identity)}, serial {self.serial:x})"


def _peer_host(tcp: trio.SocketStream) -> str:
    """The source address of an accepted connection (what the per-host budget counts)."""
    try:
        return str(tcp.socket.getpeername()[0])
    except OSError:
        return "unknown"


def _is_tls_failure(exc: BaseException) -> bool:
    """A TLS error other than the peer just going away (ragged EOF or reset)."""
    cause = exc.__cause__
    return isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLEOFError)


class TcpTransport(Transport):
    """TCP with mutual TLS. Open it with :func:`open_tcp_transport`."""

    def __init__(
        self,
        local: UniqueAddress,
        settings: TransportSettings,
        cluster: str,
        contexts: tuple[ssl.SSLContext, ssl.SSLContext],
        nursery: trio.Nursery,
        identity: PeerIdentity | None = None,
        deny: DenyList | None = None,
        *,
        protocol: ProtocolRange = CURRENT_PROTOCOL,
        app_version: str = "",
    ) -> None:
        super().__init__(local, settings, identity)
        self._cluster = cluster
        self._protocol = protocol
        self._app_version = app_version
        self._peer_protocols: dict[Address, tuple[int, str]] = {}
        """Per peer address, the protocol version and app version of our link to it."""
        self._server_context, self._client_context = contexts
        self._deny = deny or DenyList()
        self._trusted: tuple[x509.Certificate, ...] = ()
        """The CAs of the last reload (before any, the TLS contexts alone judge trust)."""
        self._tls_generation = 0
        """Bumped by each reload: a link set up with older contexts is judged again."""
        self._open_links: set[_OpenLink] = set()
        self._nursery = nursery
        self._random = random.Random()
        self._links_running = 0
        self._link_exited = trio.Event()
        self._pending_total = 0
        """Accepted connections whose handshake is not over yet."""
        self._pending_by_host: dict[str, int] = {}
        self._burst = 0
        """The most handshakes pending at once since memory was last given back."""
        self._last_trim = float("-inf")
        self._trimming = False
        self._attempts: dict[Outbox, tuple[trio.CancelScope, float]] = {}
        """Connect attempts under way: their scope and when they started."""
        self._last_retry_hint = float("-inf")
        self._dial_via = {Address.parse(peer): target for peer, target in settings.dial_via}

    @property
    def cluster(self) -> str:
        """The cluster this transport accepts peers of."""
        return self._cluster

    @property
    def protocol(self) -> ProtocolRange:
        """The wire protocol versions this node speaks."""
        return self._protocol

    def peer_protocol(self, address: Address) -> int | None:
        """The protocol version of the link to ``address``: None while there is none.

        A message type or frame kind that a version added goes to a peer only if this is that
        version or later.
        """
        known = self._peer_protocols.get(address)
        return None if known is None else known[0]

    def peer_app_version(self, address: Address) -> str | None:
        """The ``app_version`` the peer at ``address`` gave in the handshake (None: no link)."""
        known = self._peer_protocols.get(address)
        return None if known is None else known[1]

    def reload_tls(self, identity: TlsIdentity) -> int:
        """Take new TLS settings and close the open links they refuse; the number closed.

        New links use the new CAs, certificate, key and deny list at once. Every open link,
        inbound and outbound, is judged again: one whose certificate the new deny list names,
        or that none of the new CAs signed, is closed and logged (an outbound one then tries
        to reconnect, and is refused until the settings allow it again). The certificate may
        change (a renewed one, or one from a new CA) but must name this transport's identity.

        Example:
            >>> new = TlsIdentity(  # doctest: +SKIP
            ...     "shop", "ca.pem", "node.pem", "node-key.pem", deny=DenyList.parse(["admin:eve"])
            ... )
            >>> transport.reload_tls(new)  # doctest: +SKIP
            1

        Raises:
            ConfigurationError: unreadable files, or a certificate naming another identity or
                cluster; nothing changed.
        """
        if identity.cluster != self._cluster:
            raise ConfigurationError(
                f"the new TLS settings are for cluster {identity.cluster!r}, not "
                f"{self._cluster!r}: a node cannot move to another cluster while it runs"
            )
        own = identity.certificate_identity()
        if own != self._identity:
            raise ConfigurationError(
                f"the new certificate {str(identity.cert_file)!r} is for "
                f"{identity_text(own)}, but this node is {identity_text(self._identity)}: "
                "restart it to change its identity"
            )
        contexts = identity.server_context(), identity.client_context()
        trusted = identity.trusted_certificates()
        self._server_context, self._client_context = contexts
        self._deny = identity.deny
        self._trusted = trusted
        self._tls_generation += 1
        closed = 0
        for entry in sorted(self._open_links, key=str):
            reason = self._refusal(entry.identity, entry.serial, entry.certificate, check_ca=True)
            if reason is not None:
                self._open_links.discard(entry)
                entry.link.close()
                closed += 1
                logger.warning("%s: closed the link %s: %s", self._local, entry, reason)
        logger.info(
            "%s: TLS settings reloaded (%d CA certificates, %d deny entries); %d links closed",
            self._local,
            len(trusted),
            len(identity.deny),
            closed,
        )
        return closed

    def _refusal(
        self, identity: PeerIdentity, serial: int, certificate: bytes, *, check_ca: bool
    ) -> str | None:
        """Why the current settings refuse a peer certificate; None if they take it.

        With ``check_ca``, also whether one of the current CAs signed it: needed when the
        handshake ran with the contexts of earlier settings, which trusted other CAs.
        """
        reason = self._deny.reason(identity, serial)
        if reason is None and check_ca and not issued_by_any(certificate, self._trusted):
            reason = (
                f"{identity_text(identity)} (certificate serial {serial:x}) is signed by no CA "
                "the TLS settings trust any more"
            )
        return reason

    def _admit(self, link: TlsLink, generation: int) -> tuple[PeerIdentity, int, bytes]:
        """The identity, serial and certificate of a peer that just finished its handshake.

        Raises:
            HandshakeError: its certificate names no identity of this cluster.
            _Refused: the deny list (or a reload since the handshake began) refuses it.
        """
        certificate = link.peer_certificate()
        identity = peer_identity(certificate, self.cluster)
        serial = peer_serial(certificate)
        der = link.peer_certificate_der()
        reason = self._refusal(identity, serial, der, check_ca=generation != self._tls_generation)
        if reason is not None:
            raise _Refused(reason)
        return identity, serial, der

    def _register(self, entry: _OpenLink, generation: int) -> None:
        """Add an established link to the registry, judging it again if settings changed.

        Raises:
            _Refused: a reload during the rest of its set-up refuses it.
        """
        if generation != self._tls_generation:
            reason = self._refusal(entry.identity, entry.serial, entry.certificate, check_ca=True)
            if reason is not None:
                raise _Refused(reason)
        self._open_links.add(entry)

    def _start_link(self, outbox: Outbox) -> None:
        self._links_running += 1
        self._nursery.start_soon(self._run_link, outbox, name=f"link to {outbox.address}")

    async def _read_frame(self, link: TlsLink, decoder: FrameDecoder) -> list[bytes]:
        """Read until at least one whole frame arrived."""
        while True:
            data = await link.receive_some()
            if not data:
                decoder.eof()
                raise HandshakeError("peer closed the link during the handshake")
            frames, error = decoder.feed(data)
            if frames:
                return frames
            if error is not None:
                raise error

    # ---- accepting side ----

    async def _serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, nursery)
            task_status.started(listeners)

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections, within the budget of pending handshakes.

        When the process is out of file descriptors or memory (``EMFILE``, ``ENFILE``,
        ``ENOBUFS``, ``ENOMEM``), it waits, longer each time up to a second, and says so once
        per interval rather than failing or spinning.
        """
        wait = ACCEPT_RETRY_MIN
        while True:
            try:
                tcp = await listener.accept()
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                self._counters.accepts_failed += 1
                self._refusals.refuse(
                    "accept-failed",
                    f"{self._local}: cannot accept connections: {os.strerror(exc.errno or 0)}; "
                    f"retrying in {wait:g} s (open connections waiting for a handshake: "
                    f"{self._pending_total})",
                    trio.current_time(),
                    level=logging.ERROR,
                )
                await trio.sleep(wait)
                wait = min(wait * 2, ACCEPT_RETRY_MAX)
                continue
            wait = ACCEPT_RETRY_MIN
            host = _peer_host(tcp)
            refusal = self._pending_refusal(host)
            if refusal is not None:
                self._counters.connections_refused_busy += 1
                self._refusals.refuse("busy", f"{self._local}: {refusal}", trio.current_time())
                await trio.aclose_forcefully(tcp)
                continue
            self._handshake_started(host)
            nursery.start_soon(self._accept, tcp, host)

    def _pending_refusal(self, host: str) -> str | None:
        """Why a new connection from ``host`` is closed at once, if it is."""
        settings = self._settings
        if self._pending_total >= settings.max_pending_handshakes:
            return (
                f"closed a connection from {host}: {self._pending_total} connections wait for "
                f"their handshake (max_pending_handshakes)"
            )
        pending = self._pending_by_host.get(host, 0)
        if pending >= settings.max_pending_handshakes_per_host:
            return (
                f"closed a connection from {host}: {pending} of its connections wait for their "
                "handshake (max_pending_handshakes_per_host)"
            )
        return None

    def _handshake_done(self, host: str) -> None:
        self._pending_total -= 1
        left = self._pending_by_host[host] - 1
        if left:
            self._pending_by_host[host] = left
        else:
            del self._pending_by_host[host]
        if self._pending_total == 0 and self._burst >= TRIM_AFTER_BURST and not self._trimming:
            # A burst of handshakes is over: what its connections took, the heap keeps.
            self._trimming = True
            self._nursery.start_soon(self._trim)

    async def _trim(self) -> None:
        """Give the heap back once ``TRIM_INTERVAL`` passed since the last time."""
        try:
            await trio.sleep_until(self._last_trim + TRIM_INTERVAL)
            if self._pending_total == 0:
                self._burst, self._last_trim = 0, trio.current_time()
                give_memory_back()
        finally:
            self._trimming = False

    def _handshake_started(self, host: str) -> None:
        self._pending_total += 1
        self._pending_by_host[host] = self._pending_by_host.get(host, 0) + 1
        self._burst = max(self._burst, self._pending_total)

    async def _accept(self, tcp: trio.SocketStream, host: str) -> None:
        try:
            accepted = await self._handshake_in(tcp)
        finally:
            self._handshake_done(host)
        if accepted is not None:
            await self._read_link(*accepted)

    async def _handshake_in(
        self, tcp: trio.SocketStream
    ) -> tuple[TlsLink, _OpenLink, FrameDecoder, list[bytes], str] | None:
        """TLS, the certificate's identity, the hello: the link, or None if refused (logged)."""
        try:
            where = "{}:{}".format(*tcp.socket.getpeername()[:2])
        except OSError:
            where = "unknown peer"
        link = TlsLink.over(tcp, self._server_context, server_side=True)
        generation = self._tls_generation
        decoder = FrameDecoder(self._settings.max_frame_size)
        try:
            with trio.fail_after(self._settings.handshake_timeout):
                await link.handshake()
                identity, serial, der = self._admit(link, generation)
                first, *rest = await self._read_frame(link, decoder)
                hello = _wire.decode(first).message
                peer = check_hello(hello, cluster=self.cluster, certificate_name=identity.name)
                assert isinstance(hello, Hello)  # check_hello refused anything else
                try:
                    version = self._protocol.agree(_peer_range(hello))
                except HandshakeError as exc:  # told to the peer too, so both logs say why
                    refused = HelloRefused(reason=f"{self._local} refused the link: {exc}")
                    link.write_nowait(encode_frame(_wire.encode(refused)))
                    await link.flush()
                    raise
                ack = HelloAck(sender=self._local, protocol=version, app_version=self._app_version)
                link.write_nowait(encode_frame(_wire.encode(ack)))
                await link.flush()
                entry = _OpenLink(link, peer, identity, serial, der, inbound=True)
                self._register(entry, generation)
        except _LINK_FAILURES as exc:
            self._counters.handshakes_refused += 1
            self._refusals.refuse(
                "refused-link",
                f"{self._local}: refused a link from {where}: {self._handshake_failure(exc)}",
                trio.current_time(),
            )
            link.close(notify=False)
            return None
        except BaseException:
            link.close(notify=False)  # cancelled mid-handshake: leave no socket open
            raise
        return link, entry, decoder, rest, where

    async def _read_link(
        self, link: TlsLink, entry: _OpenLink, decoder: FrameDecoder, rest: list[bytes], where: str
    ) -> None:
        """Deliver what an accepted link carries until it ends or breaks the protocol."""
        peer, identity = entry.peer, entry.identity
        self._inbound_links += 1
        self._drop_stale_link_to(peer)
        self._retry_others()
        logger.debug("%s: accepted a link from %s (%s) at %s", self._local, peer, identity, where)
        try:
            if rest:
                await self._deliver_frames(rest, peer, identity)
            data: bytes | bytearray = (
                b""  # first round: what the handshake read may hold a bad header already
            )
            while True:
                frames, error = decoder.feed(data)
                if frames:
                    await self._deliver_frames(frames, peer, identity)
                    if len(data) < _SHORT_READ:
                        for _ in range(_YIELDS_AFTER_SHORT_READ):
                            await trio.lowlevel.checkpoint()
                if error is not None:
                    raise error
                data = await link.receive_some()
                if not data:
                    decoder.eof()
                    break
        except ProtocolError as exc:
            self._count_link_error(exc, peer)
        except trio.BrokenResourceError as exc:
            if _is_tls_failure(exc):
                self._counters.links_closed_tls_error += 1
                logger.warning("%s: closed the link from %s: %s", self._local, peer, exc.__cause__)
            else:
                logger.debug("%s: link from %s broke: %r", self._local, peer, exc.__cause__)
        except trio.ClosedResourceError:
            pass  # reload_tls closed it, and logged why
        finally:
            self._open_links.discard(entry)
            self._inbound_links -= 1
            link.close(notify=False)

    def _handshake_failure(self, exc: BaseException) -> str:
        """Why a handshake failed, in words (some exceptions have none of their own)."""
        if isinstance(exc, trio.TooSlowError):
            return f"no hello within handshake_timeout ({self._settings.handshake_timeout:g} s)"
        reason = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
        text = str(reason or exc)
        if not text:
            kind = type(reason or exc).__name__
            return f"{kind} (the peer closed or reset the connection)"
        return text

    # ---- connecting side ----

    async def _connect(self, address: Address) -> _OpenLink:
        """Open a link to ``address``; it is in the registry when this returns."""
        dial = self._dial_via.get(address, address)  # a test proxy in between, if configured
        with trio.fail_after(self._settings.connect_timeout):
            tcp = await trio.open_tcp_stream(dial.host, dial.port)
        link = TlsLink.over(tcp, self._client_context, server_side=False)
        generation = self._tls_generation
        try:
            with trio.fail_after(self._settings.handshake_timeout):
                await link.handshake()
                # Any kind: a node dials members and seeds, and answers a client's request at
                # the address its hello announced.
                identity, serial, der = self._admit(link, generation)
                name = identity.name
                hello = Hello(
                    cluster=self.cluster,
                    sender=self._local,
                    protocol_low=self._protocol.low,
                    protocol_high=self._protocol.high,
                    app_version=self._app_version,
                )
                link.write_nowait(encode_frame(_wire.encode(hello)))
                await link.flush()
                decoder = FrameDecoder(self._settings.max_frame_size)
                first, *rest = await self._read_frame(link, decoder)
                ack = _wire.decode(first).message
                if isinstance(ack, HelloRefused):
                    raise HandshakeError(ack.reason)
                if rest or not isinstance(ack, HelloAck) or ack.sender.name != name:
                    raise HandshakeError(
                        f"{address} answered the hello with {ack!r}, not a HelloAck from {name!r}"
                    )
                if ack.protocol not in self._protocol:
                    raise HandshakeError(
                        f"{address} chose wire protocol version {ack.protocol}, and this node "
                        f"speaks {self._protocol}"
                    )
                entry = _OpenLink(link, ack.sender, identity, serial, der, inbound=False)
                self._register(entry, generation)
                self._peer_protocols[address] = (ack.protocol, ack.app_version)
        except BaseException as exc:
            if isinstance(exc, _Refused):
                self._counters.handshakes_refused += 1
            link.close(notify=False)
            raise
        return entry

    async def _run_link(self, outbox: Outbox) -> None:
        try:
            await self._keep_linked(outbox)
        finally:
            self._links_running -= 1
            self._link_exited.set()
            self._link_exited = trio.Event()

    async def _keep_linked(self, outbox: Outbox) -> None:
        settings = self._settings
        backoff = settings.reconnect_backoff_min
        while not outbox.closed:
            try:
                with trio.CancelScope() as attempt:
                    self._attempts[outbox] = (attempt, trio.current_time())
                    entry = await self._connect(outbox.address)
            except _LINK_FAILURES as exc:
                outbox.connect_failures += 1
                reason = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
                log = logger.warning if outbox.connect_failures == 1 else logger.debug
                log("%s: cannot link to %s: %s", self._local, outbox.address, reason or exc)
                await self._back_off(outbox, backoff * self._random.uniform(0.75, 1.25))
                backoff = min(backoff * 2, settings.reconnect_backoff_max)
                continue
            finally:
                self._attempts.pop(outbox, None)
            if attempt.cancelled_caught:
                continue  # cut short by a link that came up elsewhere: try again at once
            link, peer = entry.link, entry.peer
            backoff = settings.reconnect_backoff_min
            outbox.connected, outbox.peer = True, peer
            outbox.connects += 1
            logger.info("%s: linked to %s", self._local, peer)
            self._link_up(outbox.address)
            self._retry_others(outbox)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_link, link, nursery.cancel_scope)
                    await self._write_link(outbox, link)
                    nursery.cancel_scope.cancel()
            finally:
                self._open_links.discard(entry)
                self._peer_protocols.pop(outbox.address, None)
                outbox.connected = False
                link.close()
            if not outbox.closed:
                logger.info("%s: link to %s is down; reconnecting", self._local, peer)
                await self._back_off(outbox, backoff)

    async def _back_off(self, outbox: Outbox, seconds: float) -> None:
        """Wait before reconnecting, unless the outbox closes or is told to retry at once."""
        outbox.retry_now = trio.Event()
        if outbox.closed:
            return
        with trio.move_on_after(seconds):
            await outbox.retry_now.wait()

    def _drop_stale_link_to(self, peer: UniqueAddress) -> None:
        """``peer`` just linked to us: a link of ours to an older incarnation there is dead.

        TCP may not know for many seconds: the old process died while a partition held, so its
        reset never came, and the next retransmission is far off. Close it, and link to the new
        incarnation now.
        """
        outbox = self._outboxes.get(peer.address)
        if outbox is None or not outbox.connected or outbox.peer in (None, peer):
            return
        for entry in list(self._open_links):
            if not entry.inbound and entry.peer == outbox.peer:
                logger.info(
                    "%s: %s linked to us: closing the link to %s, its previous incarnation",
                    self._local,
                    peer,
                    entry.peer,
                )
                self._open_links.discard(entry)
                entry.link.close()
        outbox.retry_now.set()

    def hurry(self, address: Address) -> None:
        """Reconnect the link to ``address`` now if it waits (see ``Transport.hurry``)."""
        super().hurry(address)
        outbox = self._outboxes.get(address)
        if outbox is None or outbox.connected or outbox.closed:
            return
        attempt = self._attempts.get(outbox)
        if attempt is not None and trio.current_time() - attempt[1] >= HURRIED_CONNECT_ATTEMPT:
            attempt[0].cancel()

    def _retry_others(self, linked: Outbox | None = None) -> None:
        """A link just came up (or a peer dialled us): a partition may have healed.

        Links waiting to reconnect try again now rather than after their backoff, and connect
        attempts that have waited a second or more for an answer start afresh, so a heal is
        not followed by seconds of silence on links whose last SYN went into the void.
        """
        now = trio.current_time()
        if now - self._last_retry_hint < RETRY_HINT_INTERVAL:
            return
        self._last_retry_hint = now
        for outbox in self._outboxes.values():
            if outbox is linked or outbox.connected or outbox.closed:
                continue
            outbox.retry_now.set()
            attempt = self._attempts.get(outbox)
            if attempt is not None and now - attempt[1] >= STALE_CONNECT_ATTEMPT:
                attempt[0].cancel()

    async def _write_link(self, outbox: Outbox, link: TlsLink) -> None:
        """Write the outbox's frames to ``link`` until it breaks or the outbox closes.

        While idle it lets a sender write a lone frame itself (``Outbox.wait_for_frames``), so
        a request or a reply reaches the socket without a pass through this task; frames sent
        in a burst queue up and go out in batches of up to ``max_batch_bytes``.
        """
        max_batch = self._settings.max_batch_bytes
        unflushed = unflushed_bytes = 0  # written directly, not all in the kernel yet
        failed = False

        def write_directly(frame: bytes) -> None:
            nonlocal unflushed, unflushed_bytes, failed
            try:
                link.write_nowait(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                outbox.frames_lost_in_flight += 1
                logger.debug("%s: write to %s failed: %r", self._local, outbox.address, exc)
                failed = True  # this task, woken next, gives the link up
                return
            if link.pending:
                unflushed += 1
                unflushed_bytes += len(frame)
            else:
                outbox.frames_sent += 1
                outbox.bytes_sent += len(frame)

        while True:
            batch: list[bytes] = []
            try:
                if link.pending:
                    await link.flush()
                outbox.frames_sent += unflushed
                outbox.bytes_sent += unflushed_bytes
                unflushed = unflushed_bytes = 0
                if outbox.frames:
                    batch = outbox.take(max_batch)
                    link.write_nowait(batch[0] if len(batch) == 1 else b"".join(batch))
                    await link.flush()
                    outbox.sent(batch)
                    # Let senders queue more before the next batch (as a socket write would).
                    await trio.lowlevel.checkpoint()
                    continue
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                outbox.frames_lost_in_flight += len(batch) + unflushed
                logger.debug("%s: write to %s failed: %r", self._local, outbox.address, exc)
                return
            if outbox.closed:
                return
            await outbox.wait_for_frames(write_directly)
            if failed:
                outbox.frames_lost_in_flight += unflushed
                return

    async def _watch_link(self, link: TlsLink, scope: trio.CancelScope) -> None:
        """Nothing is ever sent back on an outbound link: any read result means it ended."""
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await link.receive_some()
        scope.cancel()

    async def aclose(self) -> None:
        """Stop taking messages, let links write what is queued (bounded), close every link."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._mark_closed()  # refuses new sends; the link tasks drain their queues and exit
        with trio.move_on_after(self._settings.shutdown_flush_timeout):
            while self._links_running:
                await self._link_exited.wait()
        self._nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_tcp_transport(
    identity: TlsIdentity,
    node_name: str,
    bind: Address,
    *,
    canonical: Address | None = None,
    settings: TransportSettings | None = None,
    uid: int | None = None,
    kind: IdentityKind = IdentityKind.NODE,
    protocol: ProtocolRange = CURRENT_PROTOCOL,
    app_version: str = "",
) -> AsyncIterator[TcpTransport]:
    """Listen on ``bind`` and yield a transport; leaving the block closes it.

    Args:
        identity: the cluster name, the CAs to trust, this node's certificate and key, and
            the deny list (see :meth:`TcpTransport.reload_tls` to change them later).
        node_name: this node's name; must match the name in its certificate.
        bind: where to listen; port 0 picks a free port.
        canonical: the address peers use to reach us, if not ``bind`` (NAT, containers). Its
            port may be 0 to mean "the bound port".
        settings: transport settings; defaults to ``TransportSettings()``.
        uid: this incarnation's uid; random by default (tests pin it).
        kind: the identity kind of this transport's certificate (a node's by default; a
            command-line client's certificate is a ``client`` or ``admin`` one).
        protocol: the wire protocol versions this node speaks (this release's by default;
            tests of mixed versions give others).
        app_version: the application's version, told to peers in the handshake.

    Example:
        >>> async def main() -> None:
        ...     async with open_tcp_transport(identity, "node-1", Address("127.0.0.1", 0)) as t:
        ...         await t.send(Address("127.0.0.1", 25521), "hello")

    Raises:
        ConfigurationError: unreadable certificate files or invalid names.
        OSError: the bind address is unavailable.
    """
    settings = settings or TransportSettings()
    contexts = identity.server_context(), identity.client_context()  # bad files fail here
    listeners = await trio.open_tcp_listeners(bind.port, host=bind.host)
    if bind.port == 0 and len(listeners) > 1:
        # Port 0 on a name with several addresses binds each to a different port; keep one.
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    port = listeners[0].socket.getsockname()[1]
    advertised = canonical or Address(bind.host, port)
    if advertised.port == 0:
        advertised = Address(advertised.host, port)
    local = UniqueAddress(advertised, node_name, uid or (secrets.randbits(63) or 1))
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                transport = TcpTransport(
                    local,
                    settings,
                    identity.cluster,
                    contexts,
                    nursery,
                    PeerIdentity(kind, node_name),
                    identity.deny,
                    protocol=protocol,
                    app_version=app_version,
                )
                await nursery.start(transport._serve, listeners)
                logger.info("%s: listening on %s", local, Address(bind.host, port))
                try:
                    yield transport
                finally:
                    with trio.CancelScope(shield=True):
                        await transport.aclose()
    finally:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
