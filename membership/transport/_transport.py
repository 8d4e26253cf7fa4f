"""The transport interface and the parts both implementations share.

Theory of operation: a :class:`Transport` moves messages between nodes, at most once and in
order per direction (Akka's guarantee for remote messages). Sending encodes at once, so a message
that cannot travel fails at the call that sent it, then puts the frame on that peer's bounded send
queue. One outbound link per peer takes frames from the queue, in order, many at a time (write
coalescing); an idle link may instead take a lone frame at once, in the sending task, so that a
request or a reply does not wait for the link's task to be scheduled. Received frames are
decoded and put in one bounded inbox that the node reads with ``receive()`` or ``async for``.

Full queues never drop silently: ``send_nowait`` raises :class:`SendQueueFull` and ``send`` waits
for room; a full inbox makes links stop reading, which pushes back on the senders. A frame that was
already handed to a link that then breaks is lost (counted as ``frames_lost_in_flight``), as in
Akka: delivery is at most once, and the layers above retry what matters.

A frame may name the incarnation (uid) it is meant for; the receiving transport drops it if that
is not its own uid, so a message for a node that has since restarted does not reach the new
process (Akka's quarantine of old incarnations, reduced to what the transport can check).

The TCP implementation is in ``_tcp``, the simulated one in ``_simnet``; ``tests/membership/
test_transport_conformance.py`` runs the same tests over both.
"""

from __future__ import annotations

import abc
import collections
import logging
from collections.abc import AsyncIterator, Callable, Collection
from typing import NamedTuple

import attrs
import trio

from . import _wire
from ._address import Address, UniqueAddress
from ._errors import (
    FrameDecodeError,
    FrameTooLarge,
    MessageDecodeError,
    ProtocolError,
    SendQueueFull,
    TooManyRefused,
    TransportClosed,
    TruncatedFrame,
)
from ._framing import HEADER_SIZE as FRAME_PREFIX_SIZE
from ._identity import IdentityKind, PeerIdentity
from ._refusals import Refusals
from ._settings import TransportSettings

logger = logging.getLogger("membership.transport")

RECEIVE_YIELD_EVERY = 64
"""``receive`` yields to other tasks at least once per this many messages taken."""

_NOWHERE = object()
"""Stands for "no destination yet" where any argument of ``send`` (None too) must not match."""


class Envelope(NamedTuple):
    """A received message, the incarnation that sent it and the identity of its link.

    ``identity`` is what the link's certificate says (kind and name), verified by the TLS
    handshake; ``sender`` is what the link's hello announced, with the same name. Decide what a
    message may do by them, never by what the message itself claims.

    A named tuple rather than an attrs class: one is made per received message, and this is the
    cheapest immutable value with named fields.
    """

    sender: UniqueAddress
    message: object
    identity: PeerIdentity


_new_envelope = tuple.__new__
"""``_new_envelope(Envelope, (sender, message, identity))`` makes an Envelope in half the time
of ``Envelope(sender, message, identity)``, which goes through a generated Python ``__new__``."""


@attrs.frozen(kw_only=True)
class PeerStatistics:
    """The outbound side of one peer, by address."""

    address: Address
    connected: bool
    """Whether the outbound link is established now."""
    peer: UniqueAddress | None
    """The incarnation at the other end of the current (or last) link, if any yet."""
    queued_frames: int
    frames_sent: int
    bytes_sent: int
    connects: int
    """Links established so far (more than one means reconnects)."""
    connect_failures: int
    frames_lost_in_flight: int
    """Frames handed to a link that then broke: maybe delivered, maybe not."""
    send_queue_full: int
    """Times ``send_nowait`` found the queue full."""


@attrs.frozen(kw_only=True)
class TransportStatistics:
    """A snapshot of a transport's counters (see ``Transport.statistics``)."""

    local: UniqueAddress
    closed: bool
    peers: tuple[PeerStatistics, ...]
    inbound_links: int
    """Inbound links open now."""
    inbox_size: int
    messages_received: int
    frames_received: int
    bytes_received: int
    handshakes_refused: int
    """Links refused during set-up: bad or missing certificate, wrong cluster, bad hello; and
    certificates the deny list names, whichever side connected."""
    links_closed_frame_too_large: int
    links_closed_truncated: int
    links_closed_undecodable: int
    """Links closed for a frame whose envelope was not ours (bad version, kind or length)."""
    links_closed_tls_error: int
    """Links closed by a TLS error after set-up, e.g. a record altered in flight."""
    messages_dropped_undecodable: int
    """Well-framed messages of an unknown type or with rejected fields: dropped, link kept."""
    messages_dropped_wrong_incarnation: int
    """Messages addressed to another incarnation (uid) of this node: dropped."""
    connections_refused_busy: int = 0
    """Connections closed as soon as accepted: too many were waiting for their handshake, from
    all peers or from that host (``max_pending_handshakes``, ``..._per_host``)."""
    accepts_failed: int = 0
    """Accepts that failed for lack of file descriptors or memory (retried after a wait)."""
    links_closed_refused: int = 0
    """Links closed because their messages were refused faster than
    ``refused_messages_per_second`` allows."""
    messages_not_sent_protocol: int = 0
    """Messages not sent: their type needs a later wire protocol version than the peer's link
    agreed on (``@message(since=...)``), or there was no link yet to tell."""

    def peer(self, address: Address) -> PeerStatistics | None:
        """The statistics of one peer, or None if nothing was ever sent to it."""
        for p in self.peers:
            if p.address == address:
                return p
        return None


@attrs.define(eq=False)
class _Counters:
    messages_received: int = 0
    frames_received: int = 0
    bytes_received: int = 0
    handshakes_refused: int = 0
    links_closed_frame_too_large: int = 0
    links_closed_truncated: int = 0
    links_closed_undecodable: int = 0
    links_closed_tls_error: int = 0
    messages_dropped_undecodable: int = 0
    messages_dropped_wrong_incarnation: int = 0
    messages_not_sent_protocol: int = 0
    connections_refused_busy: int = 0
    accepts_failed: int = 0
    links_closed_refused: int = 0


class Outbox:
    """The bounded send queue of one peer: frames in order, with room and data waiters."""

    def __init__(self, address: Address, capacity: int) -> None:
        self.address = address
        self.capacity = capacity
        self.frames: collections.deque[bytes] = collections.deque()
        self._room = trio.lowlevel.ParkingLot()
        self._taker: trio.lowlevel.Task | None = None
        """The link task waiting for frames, if it waits. Waking one task by hand costs less
        than half of waking it through a ParkingLot, and every reply's way to the socket wakes
        it."""
        self._empty = trio.lowlevel.ParkingLot()
        self._direct: Callable[[bytes], None] | None = None
        """Set while the link task is idle and can take a frame at once (see wait_for_frames)."""
        self.closing = trio.Event()
        """Set when the transport closes: link tasks stop waiting and wind down."""
        self.retry_now = trio.Event()
        """Set to cut a reconnect wait short (another link just came up: a heal, perhaps)."""
        self.idle_mark: tuple[int, int, int] | None = None
        """What was sent and queued at the last ``Transport.prune`` that did not keep it."""
        self.closed = False
        self.connected = False
        self.peer: UniqueAddress | None = None
        self.frames_sent = 0
        self.bytes_sent = 0
        self.connects = 0
        self.connect_failures = 0
        self.frames_lost_in_flight = 0
        self.send_queue_full = 0

    def put_nowait(self, frame: bytes) -> None:
        if self.closed:
            raise TransportClosed("transport is closed")
        if len(self.frames) >= self.capacity:
            self.send_queue_full += 1
            raise SendQueueFull(
                f"send queue to {self.address} is full ({self.capacity} frames): the peer is "
                "slow or unreachable; use send() to wait for room"
            )
        direct = self._direct
        if direct is not None:
            # The link is idle with nothing queued: it writes this frame now, in this task.
            # Once per wake-up of the link's task: the frames that follow in the same burst
            # queue up and go out together when it runs.
            self._direct = None
            direct(frame)
            self._wake_taker()
            return
        self.frames.append(frame)
        if self._taker is not None:
            self._wake_taker()

    async def put(self, frame: bytes) -> None:
        # A cancel point always, but a schedule point only when it has to wait for room: a task
        # that sends many messages fills the queue first, and the link then writes them in one
        # batch. Yielding per message costs more than encoding it and defeats write coalescing.
        await trio.lowlevel.checkpoint_if_cancelled()
        while len(self.frames) >= self.capacity and not self.closed:
            await self._room.park()
        self.put_nowait(frame)

    async def wait_for_frames(self, direct: Callable[[bytes], None] | None = None) -> None:
        """Wait until a frame is queued (or the outbox closes).

        With ``direct``, the next frame sent while this waits is given to ``direct`` at once, in
        the sending task, instead of being queued, and the wait ends then too (with nothing
        queued). A link that can write without waiting passes it: a lone message then goes out
        without a scheduler pass. ``direct`` must not raise.

        One task takes frames from an outbox (its link's); a second one waiting at the same time
        is an error.
        """
        while not self.frames and not self.closed:
            if self._taker is not None:
                raise RuntimeError(f"another task already waits for frames to {self.address}")
            self._taker = trio.lowlevel.current_task()
            self._direct = direct
            try:
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
            finally:
                self._direct = None
            if direct is not None:
                return

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._taker = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake_taker(self) -> None:
        task, self._taker = self._taker, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def take(self, max_bytes: int) -> list[bytes]:
        """Take queued frames, oldest first, up to ``max_bytes`` (at least one if any)."""
        frames = self.frames
        batch: list[bytes] = []
        size = 0
        while frames and (not batch or size + len(frames[0]) <= max_bytes):
            frame = frames.popleft()
            batch.append(frame)
            size += len(frame)
        if batch and len(self._room):
            self._room.unpark(count=len(batch))
        if not frames and len(self._empty):
            self._empty.unpark_all()
        return batch

    async def wait_empty(self) -> None:
        """Wait until every queued frame was taken (or the outbox closes and drops them)."""
        while self.frames and not self.closed:
            await self._empty.park()

    def sent(self, batch: list[bytes]) -> None:
        self.frames_sent += len(batch)
        self.bytes_sent += sum(map(len, batch))

    def close(self) -> None:
        self.closed = True
        self.closing.set()
        self.retry_now.set()
        self._room.unpark_all()
        self._wake_taker()
        self._empty.unpark_all()

    def statistics(self) -> PeerStatistics:
        return PeerStatistics(
            address=self.address,
            connected=self.connected,
            peer=self.peer,
            queued_frames=len(self.frames),
            frames_sent=self.frames_sent,
            bytes_sent=self.bytes_sent,
            connects=self.connects,
            connect_failures=self.connect_failures,
            frames_lost_in_flight=self.frames_lost_in_flight,
            send_queue_full=self.send_queue_full,
        )


class Transport(abc.ABC):
    """Moves messages between nodes: at most once, in order per direction.

    Use one of the implementations: ``open_tcp_transport`` (TCP with mutual TLS) or
    ``SimNetwork.transport`` (in memory, with fault injection). Both are async context managers
    that own their background tasks.

    Example:
        >>> async def ping(transport: Transport, peer: Address) -> None:
        ...     await transport.send(peer, "ping")
        ...     async for envelope in transport:
        ...         print(envelope.sender, envelope.message)
    """

    def __init__(
        self,
        local: UniqueAddress,
        settings: TransportSettings,
        identity: PeerIdentity | None = None,
    ) -> None:
        self._local = local
        self._identity = identity or PeerIdentity(IdentityKind.NODE, local.name)
        self._settings = settings
        self._outboxes: dict[Address, Outbox] = {}
        # The destination last sent to (the very object), with its address, uid and outbox: an
        # Address hashes in Python, and that lookup and the type checks cost a sixth of a send.
        self._recent_to: object = _NOWHERE
        self._recent: tuple[Address, int, Outbox | None] = (local.address, 0, None)
        self._inbox_send, self._inbox_receive = trio.open_memory_channel[Envelope](
            settings.inbox_capacity
        )
        self._counters = _Counters()
        self._refusals = Refusals(logger)
        """Refused links and messages, logged at most once per interval per kind."""
        self._closed = False
        self._inbound_links = 0
        self._received_without_yield = 0
        self._handler: Callable[[Envelope], bool | None] | None = None
        self._refused_budgets: dict[UniqueAddress, list[float]] = {}
        """Per sender: refused messages it may still send now, and when that was counted."""
        self._link_listeners: list[Callable[[Address], None]] = []
        self._encoder = _wire.FrameEncoder(settings.max_frame_size)

    @property
    def local_address(self) -> UniqueAddress:
        """This node's incarnation: canonical address, node name and uid."""
        return self._local

    @property
    def identity(self) -> PeerIdentity:
        """The identity this transport's certificate names (a node's, for a cluster member)."""
        return self._identity

    @property
    def settings(self) -> TransportSettings:
        """The settings this transport runs with."""
        return self._settings

    def peer_protocol(self, address: Address) -> int | None:
        """The wire protocol version of the link to ``address``: None while there is none.

        A message type or frame kind that a protocol version added goes to a peer only if its
        link speaks that version or a later one.
        """
        return None

    @property
    def closed(self) -> bool:
        """True once closed (or crashed, for a simulated node)."""
        return self._closed

    @staticmethod
    def _route(to: Address | UniqueAddress) -> tuple[Address, int]:
        if isinstance(to, UniqueAddress):
            return to.address, to.uid
        if isinstance(to, Address):
            return to, 0
        raise TypeError(f"send needs an Address or UniqueAddress, not {type(to).__name__}")

    def send_nowait(self, to: Address | UniqueAddress, message: object) -> None:
        """Queue ``message`` for ``to`` without waiting.

        With a :class:`UniqueAddress`, the message reaches only that incarnation; with an
        :class:`Address`, whichever incarnation is there.

        Raises:
            SerializationError: the message cannot be encoded (names the type); nothing queued.
            MessageTooLarge: the message exceeds ``max_frame_size``; nothing queued.
            SendQueueFull: the peer's queue is full; nothing queued.
            TransportClosed: the transport is closed.
        """
        # Spelled out here and in send rather than shared: the call cost a twentieth of a send.
        if self._closed:
            raise TransportClosed("transport is closed")
        if to is self._recent_to:
            address, uid, outbox = self._recent
        else:
            address, uid = self._route(to)
            outbox = self._outboxes.get(address)
            if outbox is not None:
                self._recent_to, self._recent = to, (address, uid, outbox)
        try:
            frame = self._encoder.frame(message, uid)
        except _wire.NeedsProtocol:
            gated = self._frame_since(message, uid, address)
            if gated is None:
                return
            frame = gated
        if outbox is not None:
            frames = outbox.frames
            if outbox._taker is None and len(frames) < outbox.capacity and not outbox.closed:
                frames.append(frame)  # put_nowait's case with nobody to wake, inlined
            else:
                outbox.put_nowait(frame)
        elif address == self._local.address:
            self._deliver_local(frame)
        else:
            self._outbox(address).put_nowait(frame)

    async def send(self, to: Address | UniqueAddress, message: object) -> None:
        """Queue ``message`` for ``to``, waiting while the peer's send queue is full.

        Returns once the message is queued, not when it is delivered. Raises as
        :meth:`send_nowait`, except that a full queue means waiting instead of SendQueueFull.
        It is always a cancel point but yields to other tasks only when it has to wait: a loop
        that only sends runs until the queue is full, and the link then writes it all at once.
        """
        # Spelled out here and in send_nowait rather than shared: the call cost a twentieth.
        if self._closed:
            raise TransportClosed("transport is closed")
        if to is self._recent_to:
            address, uid, outbox = self._recent
        else:
            address, uid = self._route(to)
            outbox = self._outboxes.get(address)
            if outbox is not None:
                self._recent_to, self._recent = to, (address, uid, outbox)
        try:
            frame = self._encoder.frame(message, uid)
        except _wire.NeedsProtocol:
            gated = self._frame_since(message, uid, address)
            if gated is None:
                await trio.lowlevel.checkpoint()  # a cancel point, whatever becomes of it
                return
            frame = gated
        if outbox is not None:
            # Outbox.put inlined for the common case, a queue with room: one coroutine less;
            # and put_nowait's when its link task is busy (a burst): no call at all.
            await trio.lowlevel.checkpoint_if_cancelled()
            frames = outbox.frames
            if len(frames) < outbox.capacity:
                if outbox._taker is None and not outbox.closed:
                    frames.append(frame)
                else:
                    outbox.put_nowait(frame)
            else:
                await outbox.put(frame)
        elif address == self._local.address:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._deliver_local(frame)
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            await self._outbox(address).put(frame)

    def backlog(self, to: Address | UniqueAddress) -> int:
        """Frames queued for ``to`` that its link has not taken yet (0 when there is no link).

        A sender of many small messages can gather them into fewer while this is above zero:
        the link is busy then, and what is sent next waits in the queue anyway.
        """
        if to is self._recent_to:
            outbox = self._recent[2]
        else:
            outbox = self._outboxes.get(self._route(to)[0])
        return 0 if outbox is None else len(outbox.frames)

    async def forget(self, address: Address, *, flush_timeout: float) -> None:
        """Stop linking to ``address`` once what is queued for it is written.

        After ``flush_timeout`` seconds what is still queued is dropped. For peers that were
        only visiting, such as a command-line client: without it the transport keeps
        reconnecting to an address that is gone. A later send opens a new link.
        """
        outbox = self._outboxes.get(address)
        if outbox is None:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(flush_timeout):
            await outbox.wait_empty()
        if self._outboxes.get(address) is outbox:
            del self._outboxes[address]
            self._recent_to = _NOWHERE
            outbox.close()

    def prune(self, keep: Collection[Address]) -> list[Address]:
        """Close and forget the links to addresses not in ``keep`` that idled since last time.

        Call it periodically with the addresses this node has reason to reach (members, seeds):
        a link to any other address (a visitor that was answered, a member that was removed) is
        closed once nothing was sent to it between two calls, what is still queued for it is
        dropped, and it is never dialled again unless something is sent there anew. Returns
        the addresses forgotten.
        """
        forgotten: list[Address] = []
        for address, outbox in list(self._outboxes.items()):
            if address in keep:
                outbox.idle_mark = None
                continue
            mark = (outbox.frames_sent, outbox.send_queue_full, len(outbox.frames))
            if outbox.idle_mark != mark:
                outbox.idle_mark = mark
                continue
            del self._outboxes[address]
            outbox.close()
            forgotten.append(address)
        if forgotten:
            self._recent_to = _NOWHERE
            logger.debug("%s: forgot the links to %s", self._local, forgotten)
        return forgotten

    def hurry(self, address: Address) -> None:
        """If the link to ``address`` waits to reconnect, try now instead (nothing otherwise).

        For a message that matters more than the backoff saves: membership's probes of a
        restarting node, which must reach it before it forms a cluster of its own.
        """
        outbox = self._outboxes.get(address)
        if outbox is not None and not outbox.connected:
            outbox.retry_now.set()

    def on_link_up(self, callback: Callable[[Address], None]) -> None:
        """Call ``callback(address)`` (which must not block) whenever a link to a peer comes up.

        Membership uses it to tell a partition that just healed from one that holds.
        """
        self._link_listeners.append(callback)

    def _link_up(self, address: Address) -> None:
        for callback in self._link_listeners:
            try:
                callback(address)
            except Exception:
                logger.exception("%s: a link listener failed on %s", self._local, address)

    def set_handler(self, handler: Callable[[Envelope], bool | None] | None) -> None:
        """Deliver received messages by calling ``handler`` instead of queueing them.

        The handler runs in the link's task as each message is decoded, so it must not block;
        it saves the trip through the inbox and another task (the node's dispatcher uses it).
        It returns False for a message it refused (for who sent it): a link whose messages are
        refused faster than ``refused_messages_per_second`` is closed. An exception in it is
        logged and the message counts as delivered. ``None`` goes back to the inbox
        (``receive`` and ``async for``).
        """
        self._handler = handler

    def _hand_over(self, envelope: Envelope) -> bool:
        """Give ``envelope`` to the handler, if there is one; False if the inbox should take it."""
        handler = self._handler
        if handler is None:
            return False
        try:
            handler(envelope)
        except Exception:
            self._log_handler_failure(envelope)
        return True

    def _log_handler_failure(self, envelope: Envelope) -> None:
        logger.exception(
            "%s: handler failed on %s from %s",
            self._local,
            type(envelope.message).__name__,
            envelope.sender,
        )

    def _deliver_local(self, frame: bytes) -> None:
        # A message to ourselves still goes through the codec, so the receiver never shares a
        # mutable object with the sender, exactly as for a remote peer.
        try:
            envelope = self._decode(frame[FRAME_PREFIX_SIZE:], self._local, self._identity)
        except ProtocolError as exc:  # pragma: no cover - we just encoded it
            raise AssertionError(f"own frame did not decode: {exc}") from exc
        if envelope is not None and not self._hand_over(envelope):
            try:
                self._inbox_send.send_nowait(envelope)
            except trio.WouldBlock:
                raise SendQueueFull(
                    f"inbox of {self._local} is full ({self._settings.inbox_capacity}): "
                    "the application reads slower than messages arrive"
                ) from None

    def _outbox(self, address: Address) -> Outbox:
        outbox = self._outboxes.get(address)
        if outbox is None:
            outbox = Outbox(address, self._settings.send_queue_capacity)
            self._outboxes[address] = outbox
            self._start_link(outbox)
        return outbox

    @abc.abstractmethod
    def _start_link(self, outbox: Outbox) -> None:
        """Start whatever carries this outbox's frames to its peer."""

    def _decode(
        self, payload: bytes, sender: UniqueAddress, identity: PeerIdentity
    ) -> Envelope | None:
        """Decode one received frame payload; None if the message is to be dropped.

        Raises:
            FrameDecodeError: the envelope is broken; the caller must close the link.
        """
        counters = self._counters
        counters.frames_received += 1
        counters.bytes_received += len(payload) + FRAME_PREFIX_SIZE
        try:
            to_uid, message = _wire.decode_parts(payload)
        except MessageDecodeError as exc:
            self._drop_undecodable(exc, sender, payload)
            return None
        if to_uid and to_uid != self._local.uid:
            self._drop_for_another_incarnation(to_uid, sender)
            return None
        counters.messages_received += 1
        return Envelope(sender, message, identity)

    def _frame_since(self, message: object, uid: int, address: Address) -> bytes | None:
        """The frame of a message whose type a later protocol added; None: not for this peer.

        Sent only over a link that agreed on that version or later; otherwise dropped, counted
        and logged (at a bounded rate), so that an older peer never gets a type it cannot read.
        """
        need = _wire.needs_protocol(type(message))
        # To itself a node sends anything: it reads what it sends.
        agreed = need if address == self._local.address else self.peer_protocol(address)
        if agreed is not None and agreed >= need:
            return self._encoder.frame_since(message, uid)
        self._counters.messages_not_sent_protocol += 1
        self._refusals.refuse(
            f"not-sent-protocol {address} {agreed}",  # a line per peer and link version
            f"{self._local}: did not send a {type(message).__name__} to {address}: it needs "
            f"wire protocol version {need}, and the link "
            + ("is not up" if agreed is None else f"speaks version {agreed}"),
            trio.current_time(),
            level=logging.INFO,
        )
        return None

    def _drop_undecodable(
        self, exc: MessageDecodeError, sender: UniqueAddress, payload: bytes
    ) -> None:
        # The header was read: a message for another incarnation of this node (a newer build's,
        # say, sent a type this one does not know) is that, not an unreadable one.
        to_uid = _wire.decode_header(payload)[1]
        if to_uid and to_uid != self._local.uid:
            self._drop_for_another_incarnation(to_uid, sender)
            return
        self._counters.messages_dropped_undecodable += 1
        self._refusals.refuse(
            "undecodable-message",
            f"{self._local}: dropped a message from {sender}: {exc}",
            trio.current_time(),
        )

    def _count_refused(self, sender: UniqueAddress, size: int) -> None:
        """A message of ``size`` bytes from ``sender`` was refused: close its link if too many.

        Refused for who sent it, that is; a message of an unknown type is not counted: a newer
        node may send those in numbers. Two token buckets per sender:
        ``refused_messages_burst`` messages and ``refused_bytes_burst`` bytes at once, then
        ``refused_messages_per_second`` and ``refused_bytes_per_second``.

        Raises:
            TooManyRefused: the sender went over; the caller's link closes.
        """
        settings = self._settings
        now = trio.current_time()
        bursts = (float(settings.refused_messages_burst), float(settings.refused_bytes_burst))
        rates = (settings.refused_messages_per_second, float(settings.refused_bytes_per_second))
        budget = self._refused_budgets.get(sender)
        if budget is None:
            if len(self._refused_budgets) >= 1024:  # forget the senders back to a full budget
                self._refused_budgets = {
                    k: v
                    for k, v in self._refused_budgets.items()
                    if v[0] + (now - v[2]) * rates[0] < bursts[0]
                    or v[1] + (now - v[2]) * rates[1] < bursts[1]
                }
            budget = self._refused_budgets[sender] = [*bursts, now]
        elapsed = now - budget[2]
        messages = min(bursts[0], budget[0] + elapsed * rates[0]) - 1.0
        size_left = min(bursts[1], budget[1] + elapsed * rates[1]) - size
        budget[:] = [max(messages, 0.0), max(size_left, 0.0), now]
        if messages < 0.0 or size_left < 0.0:
            raise TooManyRefused(
                f"{sender} sent refused messages faster than refused_messages_per_second "
                f"({settings.refused_messages_per_second:g}/s after a burst of "
                f"{settings.refused_messages_burst}) or refused_bytes_per_second "
                f"({settings.refused_bytes_per_second}/s after a burst of "
                f"{settings.refused_bytes_burst})"
            )

    def _drop_for_another_incarnation(self, to_uid: int, sender: UniqueAddress) -> None:
        self._counters.messages_dropped_wrong_incarnation += 1
        logger.debug(
            "%s: dropped a message from %s meant for incarnation %x", self._local, sender, to_uid
        )

    async def _deliver_frames(
        self, payloads: list[bytes], sender: UniqueAddress, identity: PeerIdentity
    ) -> None:
        """Decode frames from one link and put them in the inbox (waiting for room).

        The receive path of every message, so :meth:`_decode` and :meth:`_hand_over` are
        inlined here: each call cost a twentieth of the time a message takes.

        Raises:
            FrameDecodeError: a frame's envelope is broken; frames before it were delivered.
        """
        counters = self._counters
        # Counted for the whole batch at once (they arrived, whatever becomes of them): two
        # attribute updates per frame cost a twentieth of the time a message takes.
        counters.frames_received += len(payloads)
        counters.bytes_received += sum(map(len, payloads)) + FRAME_PREFIX_SIZE * len(payloads)
        local_uid = self._local.uid
        decode = _wire.decode_parts
        for payload in payloads:
            try:
                to_uid, message = decode(payload)
            except MessageDecodeError as exc:
                self._drop_undecodable(exc, sender, payload)
                continue
            if to_uid and to_uid != local_uid:
                self._drop_for_another_incarnation(to_uid, sender)
                continue
            counters.messages_received += 1
            envelope = _new_envelope(Envelope, (sender, message, identity))
            handler = self._handler
            if handler is not None:
                try:
                    taken = handler(envelope)
                except Exception:
                    self._log_handler_failure(envelope)
                    continue
                if taken is False:
                    self._count_refused(sender, len(payload))
                continue
            try:
                try:
                    self._inbox_send.send_nowait(envelope)
                except trio.WouldBlock:
                    await self._inbox_send.send(envelope)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return  # closing: what was not yet received is discarded
        await trio.lowlevel.checkpoint()

    def _count_link_error(self, exc: ProtocolError, peer: object) -> None:
        if isinstance(exc, FrameTooLarge):
            self._counters.links_closed_frame_too_large += 1
        elif isinstance(exc, TruncatedFrame):
            self._counters.links_closed_truncated += 1
        elif isinstance(exc, FrameDecodeError):
            self._counters.links_closed_undecodable += 1
        elif isinstance(exc, TooManyRefused):
            self._counters.links_closed_refused += 1
        self._refusals.refuse(
            "bad-frame", f"{self._local}: closed the link from {peer}: {exc}", trio.current_time()
        )

    async def receive(self) -> Envelope:
        """The next received message.

        Raises:
            TransportClosed: the transport is closed (messages still in the inbox are discarded).
        """
        # Fast path: take a waiting message without a trip through the scheduler (one trip per
        # message costs more than decoding it), but still yield every so often so that a
        # steady stream cannot starve the node's other tasks.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._received_without_yield += 1
        if self._received_without_yield < RECEIVE_YIELD_EVERY:
            try:
                return self._inbox_receive.receive_nowait()
            except trio.WouldBlock:
                pass
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise TransportClosed("transport is closed") from None
        self._received_without_yield = 0
        try:
            return await self._inbox_receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise TransportClosed("transport is closed") from None

    def receive_nowait(self) -> Envelope:
        """The next received message if one is waiting.

        Raises:
            trio.WouldBlock: the inbox is empty.
            TransportClosed: the transport is closed.
        """
        try:
            return self._inbox_receive.receive_nowait()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise TransportClosed("transport is closed") from None

    def __aiter__(self) -> AsyncIterator[Envelope]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Envelope]:
        while True:
            try:
                yield await self.receive()
            except TransportClosed:
                return

    def statistics(self) -> TransportStatistics:
        """A snapshot of this transport's counters and per-peer state."""
        c = self._counters
        return TransportStatistics(
            local=self._local,
            closed=self._closed,
            peers=tuple(o.statistics() for o in self._outboxes.values()),
            inbound_links=self._inbound_links,
            inbox_size=self._inbox_receive.statistics().current_buffer_used,
            messages_received=c.messages_received,
            frames_received=c.frames_received,
            bytes_received=c.bytes_received,
            handshakes_refused=c.handshakes_refused,
            links_closed_frame_too_large=c.links_closed_frame_too_large,
            links_closed_truncated=c.links_closed_truncated,
            links_closed_undecodable=c.links_closed_undecodable,
            links_closed_tls_error=c.links_closed_tls_error,
            messages_dropped_undecodable=c.messages_dropped_undecodable,
            messages_dropped_wrong_incarnation=c.messages_dropped_wrong_incarnation,
            connections_refused_busy=c.connections_refused_busy,
            accepts_failed=c.accepts_failed,
            links_closed_refused=c.links_closed_refused,
            messages_not_sent_protocol=c.messages_not_sent_protocol,
        )

    def connected_peers(self) -> list[UniqueAddress]:
        """Peers with an established outbound link, ordered by address."""
        return sorted(o.peer for o in self._outboxes.values() if o.connected and o.peer)

    def _mark_closed(self) -> None:
        self._closed = True
        for outbox in self._outboxes.values():
            outbox.close()
        self._inbox_send.close()
        self._inbox_receive.close()

    async def flush(self) -> None:
        """Wait until the queues of all connected peers are empty (handed to their links).

        Callers bound it, e.g. ``with trio.move_on_after(settings.shutdown_flush_timeout)``.
        """
        for outbox in list(self._outboxes.values()):
            if outbox.connected:
                await outbox.wait_empty()
        await trio.lowlevel.checkpoint()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every link; later sends raise TransportClosed and iteration ends."""
