"""The simulated network: a whole cluster in one trio run, with seeded fault injection.

Theory of operation: a :class:`SimNetwork` stands for the wires between nodes. Each node attaches
with :meth:`SimNetwork.transport` and gets a :class:`SimTransport`, a :class:`Transport` with the
same interface, queues, statistics and codec as the TCP one; only what carries frames differs.
For every direction (source node, destination address) a link takes frames from the source's
send queue, decides their fate and hands each surviving frame, after its delay, to the
destination's ``_deliver_frames``: the code TCP links use, so decoding, the incarnation check and
the counters are the same.

Faults, all per frame and per direction (:class:`LinkConditions`, a default for every link plus
overrides with :meth:`SimNetwork.set_link`):

- delay: uniform in ``[delay_min, delay_max]`` or any distribution (``delay_sampler``). Delivery
  stays first-in first-out per link however the delays vary, as over one TCP connection: a frame
  is never due before the one sent ahead of it.
- reorder: with this probability a frame keeps its own sampled due time, so it may overtake
  frames sent earlier (what a network without TCP's ordering would do).
- drop and duplicate: a frame is lost, or delivered twice (each copy with its own delay).
- partitions (:meth:`~SimNetwork.partition`, :meth:`~SimNetwork.isolate`, one way or both): a
  blocked link drops frames when they are sent and when they are due, so a partition that starts
  while a frame is in flight cuts it. :meth:`~SimNetwork.heal` lifts every partition.
- crash (:meth:`~SimNetwork.crash`): the node's transport closes at once, every frame in flight to
  or from it is lost, its queues are discarded. A node attached later at the same address is a
  restart, with a new uid, so frames addressed to the old :class:`UniqueAddress` are dropped.

What TCP gives that is kept: a frame for an address where no node lives waits in the sender's
queue, as behind a link that is reconnecting, and flows once a node attaches there; a receiver
that does not read fills its inbox, its links stop delivering, at most ``send_queue_capacity``
frames stay in flight per link, and then the sender's queue fills (``send`` waits,
``send_nowait`` raises :class:`SendQueueFull`). A bad frame closes the link: frames in flight on
it are lost and it reconnects. Leaving a transport's ``async with`` block is a graceful close that
delivers what was queued for connected peers, for at most ``shutdown_flush_timeout`` seconds.

Determinism: every random choice comes from generators seeded from the network's seed. Node uids
are drawn from :attr:`SimNetwork.random`; each link has its own generator, seeded from the
network seed, the source incarnation and the destination address, so the faults on one link do
not depend on how traffic on other links interleaves. Time is ``trio.current_time()`` and every
wait is a trio sleep, so under ``trio.testing.MockClock(autojump_threshold=0)`` a run takes no
real time and its timeline depends on nothing outside the run. What is left is trio's scheduler,
which shuffles tasks that become runnable together: :func:`deterministic_scheduling` seeds it.
Nothing iterates a set (string hashes change with PYTHONHASHSEED): dicts keep insertion order.
The :attr:`~SimNetwork.trace` records only mock times, event kinds, addresses, names, seeded
uids and short hashes of frame bytes; :meth:`~SimNetwork.trace_hash` sums it up, so the same seed
and workload give the same hash, run after run.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import importlib
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Literal

import attrs
import trio

from ._address import Address, UniqueAddress, check_name
from ._errors import (
    ConfigurationError,
    FrameDecodeError,
    FrameTooLarge,
    HandshakeError,
    TooManyRefused,
    TransportError,
)
from ._framing import HEADER_SIZE, encode_frame
from ._identity import IdentityKind, PeerIdentity
from ._settings import TransportSettings, in_range
from ._transport import Outbox, Transport
from ._trioutil import single_error
from ._versions import CURRENT_PROTOCOL, ProtocolRange

logger = logging.getLogger("membership.transport")

__all__ = [
    "LinkConditions",
    "SimNetwork",
    "SimNetworkStatistics",
    "SimTransport",
    "TraceEvent",
    "TraceKind",
    "deterministic_scheduling",
]


def _check_sampler(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigurationError(
            f"LinkConditions.delay_sampler = {value!r} is invalid: must be None or a callable "
            "that takes a random.Random and returns a delay in seconds"
        )


@attrs.frozen(kw_only=True)
class LinkConditions:
    """How one direction of a simulated link treats frames.

    Probabilities apply to each frame independently; a duplicated frame's copies get their own
    delays. Conditions are read when a frame is sent, so a change applies to frames sent after it.

    Example:
        >>> lossy = LinkConditions(drop=0.05, duplicate=0.01, reorder=0.1)
        >>> slow = LinkConditions(delay_min=0.050, delay_max=0.250)
        >>> heavy_tail = LinkConditions(delay_sampler=lambda rng: rng.expovariate(1 / 0.01))

    Raises:
        ConfigurationError: a value is out of range; the message names field, value and range.
    """

    drop: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    """Probability that a frame is lost (default 0)."""

    duplicate: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    """Probability that a frame is delivered twice (default 0)."""

    reorder: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    """Probability that a frame may overtake frames sent before it (default 0: FIFO, like TCP)."""

    delay_min: float = attrs.field(default=0.0005, validator=in_range(0.0, 3600.0))
    """Shortest delay in seconds (default 0.5 ms)."""

    delay_max: float = attrs.field(default=0.0015, validator=in_range(0.0, 3600.0))
    """Longest delay in seconds (default 1.5 ms); delays are uniform in [delay_min, delay_max]."""

    delay_sampler: Callable[[random.Random], float] | None = attrs.field(
        default=None, validator=_check_sampler
    )
    """A custom delay distribution: called with the link's seeded generator, returns seconds
    (>= 0). Overrides delay_min and delay_max. Default None."""

    def __attrs_post_init__(self) -> None:
        if self.delay_max < self.delay_min:
            raise ConfigurationError(
                f"LinkConditions.delay_max = {self.delay_max!r} is invalid: must be at least "
                f"delay_min ({self.delay_min!r})"
            )

    def sample_delay(self, rng: random.Random) -> float:
        """Draw one delay from ``rng``.

        Raises:
            ConfigurationError: ``delay_sampler`` returned something that is not a finite
                number >= 0.
        """
        sampler = self.delay_sampler
        if sampler is None:
            if self.delay_max == self.delay_min:
                return self.delay_min
            return rng.uniform(self.delay_min, self.delay_max)
        delay = sampler(rng)
        if (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not math.isfinite(delay)
            or delay < 0
        ):
            raise ConfigurationError(
                f"LinkConditions.delay_sampler returned {delay!r}: must be a finite number of "
                "seconds >= 0"
            )
        return float(delay)

    def describe(self) -> str:
        """A short deterministic description (a custom sampler shows as ``custom``)."""
        delay = (
            "custom"
            if self.delay_sampler is not None
            else f"{self.delay_min!r}..{self.delay_max!r}"
        )
        return (
            f"drop={self.drop!r} duplicate={self.duplicate!r} reorder={self.reorder!r} "
            f"delay={delay}"
        )


TraceKind = Literal[
    "attach",
    "close",
    "crash",
    "conditions",
    "link",
    "partition",
    "isolate",
    "heal",
    "inject",
    "send",
    "drop-partition",
    "drop-random",
    "duplicate",
    "reorder",
    "deliver",
    "lost",
    "bad-frame",
    "refused",
]
"""What a :class:`TraceEvent` records: node lifecycle (attach, close, crash), fault settings
(conditions, link, partition, isolate, heal), and the fate of frames: ``send`` (a link took it
from the queue), ``drop-partition``, ``drop-random``, ``duplicate``, ``reorder`` (it will
overtake), ``deliver``, ``lost`` (in flight when a node went away or a link broke), ``bad-frame``
(the receiver closed the link on it), ``inject`` (a raw frame queued by a test), ``refused`` (two
nodes whose wire protocol versions do not meet: their link never comes up, as over TCP)."""


@attrs.frozen
class TraceEvent:
    """One recorded event of a simulated network; only deterministic values.

    ``time`` is the trio clock (None outside a trio run), ``src`` and ``dst`` are addresses or
    node incarnations as text, ``detail`` a short hash of the frame bytes or a description.
    """

    time: float | None
    kind: TraceKind
    src: str = ""
    dst: str = ""
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.time!r} {self.kind} {self.src} -> {self.dst} {self.detail}"


@attrs.frozen(kw_only=True)
class SimNetworkStatistics:
    """A snapshot of a simulated network's counters (see ``SimNetwork.statistics``)."""

    nodes: int
    """Nodes attached now."""
    attaches: int
    """Transports attached so far (starts and restarts)."""
    crashes: int
    frames_sent: int
    """Frames links took from send queues (injected ones included)."""
    frames_delivered: int
    """Frames handed to a destination transport (duplicates count twice)."""
    frames_dropped_partition: int
    """Frames dropped because their link was blocked, at send or at delivery time."""
    frames_dropped_random: int
    """Frames lost to ``LinkConditions.drop``."""
    frames_duplicated: int
    frames_reordered: int
    """Frames scheduled to arrive before a frame sent ahead of them on the same link."""
    frames_lost_in_flight: int
    """Frames in flight when their sender or receiver crashed or closed, or their link broke."""
    frames_rejected: int
    """Frames that made the receiver close the link (bad envelope or too large)."""
    frames_injected: int


@attrs.define(eq=False)
class _Counters:
    attaches: int = 0
    crashes: int = 0
    frames_sent: int = 0
    frames_delivered: int = 0
    frames_dropped_partition: int = 0
    frames_dropped_random: int = 0
    frames_duplicated: int = 0
    frames_reordered: int = 0
    frames_lost_in_flight: int = 0
    frames_rejected: int = 0
    frames_injected: int = 0


_TRACE_BATCH = 256
"""Trace lines gathered before they go into the digest: one update per batch costs less than one
per line, and the hash of the concatenation is the same."""


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=6).hexdigest()


def _now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:
        return None


def _group(value: Address | Iterable[Address], what: str) -> list[Address]:
    members = [value] if isinstance(value, Address) else list(value)
    if not members:
        raise ValueError(f"partition group {what} is empty: name at least one address")
    for member in members:
        if not isinstance(member, Address):
            raise TypeError(
                f"partition group {what} holds {member!r}: expected Address values "
                "(use UniqueAddress.address)"
            )
    return sorted(dict.fromkeys(members))


class SimNetwork:
    """An in-memory network between simulated nodes, with seeded fault injection.

    Run it in one trio run, ideally under ``MockClock(autojump_threshold=0)`` and inside
    :func:`deterministic_scheduling`, so that a seed replays the same run.

    Example:
        >>> import trio.testing
        >>> async def main() -> str:
        ...     net = SimNetwork(seed=7, conditions=LinkConditions(duplicate=0.1))
        ...     a, b = Address("10.0.0.1", 25520), Address("10.0.0.2", 25520)
        ...     async with net.transport(a, "node-a") as ta, net.transport(b, "node-b") as tb:
        ...         await ta.send(b, "hello")
        ...         envelope = await tb.receive()
        ...         net.partition(a, b)  # both ways; net.heal() lifts it
        ...         net.crash(b)         # tb.receive() now raises TransportClosed
        ...     return net.trace_hash()
        >>> with deterministic_scheduling(7):
        ...     digest = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    Args:
        seed: Seeds every random choice of the network.
        settings: Transport settings of the nodes (default ``TransportSettings()``); a node can
            get its own with ``transport(..., settings=...)``.
        conditions: The conditions of every link without an override.
        cluster: The cluster name (what a TCP node would check in certificates).
        keep_trace: Keep every event in :attr:`trace` (default). With False only
            :meth:`trace_hash` covers them, for long runs where the list would grow too big.
    """

    def __init__(
        self,
        seed: int,
        *,
        settings: TransportSettings | None = None,
        conditions: LinkConditions = LinkConditions(),
        cluster: str = "sim",
        keep_trace: bool = True,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, not {type(seed).__name__}")
        if settings is not None and not isinstance(settings, TransportSettings):
            raise TypeError(f"settings must be TransportSettings, not {type(settings).__name__}")
        if not isinstance(conditions, LinkConditions):
            raise TypeError(f"conditions must be LinkConditions, not {type(conditions).__name__}")
        self._seed = seed
        self.random = random.Random(seed)
        """The seeded source of node uids; tests may draw their own choices from it too."""
        self._settings = settings if settings is not None else TransportSettings()
        self._conditions = conditions
        self._cluster = check_name("cluster name", cluster)
        self._link_conditions: dict[tuple[Address, Address], LinkConditions] = {}
        self._blocked: dict[tuple[Address, Address], None] = {}
        self._isolated: dict[Address, None] = {}
        self._mixed = False
        """Whether any node attached with another protocol range than this release's."""
        self._nodes: dict[Address, SimTransport] = {}
        self._counters = _Counters()
        self.trace: list[TraceEvent] = []
        """Every recorded event, in order (see :class:`TraceEvent`); empty without keep_trace."""
        self._keep_trace = keep_trace
        self._trace_digest = hashlib.sha256()
        self._trace_pending: list[str] = []
        """Trace lines not yet hashed: fed to the digest in batches (see ``_flush_trace``)."""

    @property
    def seed(self) -> int:
        """The seed this network was made with."""
        return self._seed

    @property
    def cluster(self) -> str:
        """The cluster name."""
        return self._cluster

    @property
    def settings(self) -> TransportSettings:
        """The default transport settings of nodes."""
        return self._settings

    @property
    def conditions(self) -> LinkConditions:
        """The conditions of links without an override."""
        return self._conditions

    @property
    def nodes(self) -> list[UniqueAddress]:
        """The incarnations attached now, ordered by address."""
        return sorted(node.local_address for node in self._nodes.values())

    def transport(
        self,
        address: Address,
        name: str,
        *,
        settings: TransportSettings | None = None,
        kind: IdentityKind = IdentityKind.NODE,
        protocol: ProtocolRange = CURRENT_PROTOCOL,
    ) -> contextlib.AbstractAsyncContextManager[SimTransport]:
        """Attach a node at ``address``: an async context manager that yields its transport.

        Its links carry the identity ``kind`` named ``name`` (a node's unless told otherwise),
        as a TLS link carries its certificate's. ``protocol`` is the range of wire protocol
        versions it speaks (this release's by default): a link between two nodes whose ranges
        do not meet never comes up, and both nodes log why, as the TCP handshake refuses it.

        Entering draws a new incarnation uid from :attr:`random`; leaving closes the transport
        gracefully (queued frames to connected peers go out first, for a bounded time). After
        :meth:`crash`, or once the block is left, another node may attach at the same address:
        a restart.

        Example:
            >>> async def node(net: SimNetwork) -> None:
            ...     async with net.transport(Address("10.0.0.1", 1), "node-1") as transport:
            ...         async for envelope in transport:
            ...             print(envelope.sender, envelope.message)

        Raises:
            TransportError: (on entering) a live node is already attached at ``address``.
            ConfigurationError: ``name`` is not a valid node name.
        """
        if not isinstance(address, Address):
            raise TypeError(f"address must be an Address, not {type(address).__name__}")
        check_name("node name", name)
        if settings is not None and not isinstance(settings, TransportSettings):
            raise TypeError(f"settings must be TransportSettings, not {type(settings).__name__}")
        if not isinstance(kind, IdentityKind):
            raise TypeError(f"kind must be an IdentityKind, not {type(kind).__name__}")
        if not isinstance(protocol, ProtocolRange):
            raise TypeError(f"protocol must be a ProtocolRange, not {type(protocol).__name__}")
        return self._attach(address, PeerIdentity(kind, name), settings or self._settings, protocol)

    @contextlib.asynccontextmanager
    async def _attach(
        self,
        address: Address,
        identity: PeerIdentity,
        settings: TransportSettings,
        protocol: ProtocolRange,
    ) -> AsyncIterator[SimTransport]:
        name = identity.name
        current = self._nodes.get(address)
        if current is not None:
            raise TransportError(
                f"cannot attach {name!r} at {address}: {current.local_address} is attached "
                "there; crash it or leave its block first"
            )
        uid = self.random.getrandbits(63) or 1
        node = SimTransport(
            self, UniqueAddress(address, name, uid), settings, identity, protocol=protocol
        )
        self._mixed = self._mixed or protocol != CURRENT_PROTOCOL
        self._nodes[address] = node
        self._counters.attaches += 1
        self._record("attach", node.local_address)
        self._refresh()
        try:
            with single_error():
                async with trio.open_nursery() as nursery:
                    await nursery.start(node._serve)
                    try:
                        yield node
                    finally:
                        await node.aclose()
        finally:
            node._shutdown("close")

    def set_conditions(self, conditions: LinkConditions) -> None:
        """Set the conditions of every link without an override (from now on)."""
        if not isinstance(conditions, LinkConditions):
            raise TypeError(f"conditions must be LinkConditions, not {type(conditions).__name__}")
        self._conditions = conditions
        self._record("conditions", detail=conditions.describe())

    def set_link(self, src: Address, dst: Address, conditions: LinkConditions) -> None:
        """Override the conditions of one direction, ``src`` to ``dst`` (from now on)."""
        if not isinstance(src, Address) or not isinstance(dst, Address):
            raise TypeError("set_link needs two Address values (use UniqueAddress.address)")
        if not isinstance(conditions, LinkConditions):
            raise TypeError(f"conditions must be LinkConditions, not {type(conditions).__name__}")
        self._link_conditions[(src, dst)] = conditions
        self._record("link", src, dst, conditions.describe())

    def link_conditions(self, src: Address, dst: Address) -> LinkConditions:
        """The conditions that apply to frames from ``src`` to ``dst`` now."""
        return self._link_conditions.get((src, dst), self._conditions)

    def partition(
        self,
        a: Address | Iterable[Address],
        b: Address | Iterable[Address],
        *,
        one_way: bool = False,
    ) -> None:
        """Block every link from group ``a`` to group ``b``, and back unless ``one_way``.

        Frames on a blocked link are dropped when sent and when due. Partitions add up until
        :meth:`heal`.

        Example:
            >>> net = SimNetwork(seed=1)
            >>> n1, n2, n3 = (Address("10.0.0.1", port) for port in (1, 2, 3))
            >>> net.partition([n1, n2], n3)  # n3 cut off from n1 and n2, both ways
            >>> net.partition(n1, n2, one_way=True)  # n1 can no longer reach n2; n2 reaches n1
            >>> net.is_blocked(n2, n1)
            False
        """
        group_a, group_b = _group(a, "a"), _group(b, "b")
        both = [x for x in group_a if x in group_b]
        if both:
            raise ValueError(f"{both[0]} is in both groups of the partition")
        for x in group_a:
            for y in group_b:
                self._blocked[(x, y)] = None
                if not one_way:
                    self._blocked[(y, x)] = None
        self._record(
            "partition",
            ",".join(map(str, group_a)),
            ",".join(map(str, group_b)),
            "one-way" if one_way else "both-ways",
        )
        self._refresh()

    def isolate(self, node: Address) -> None:
        """Block every link to and from ``node`` (nodes attached later included) until heal."""
        if not isinstance(node, Address):
            raise TypeError(f"isolate needs an Address, not {type(node).__name__}")
        self._isolated[node] = None
        self._record("isolate", node)
        self._refresh()

    def heal(self) -> None:
        """Lift every partition and isolation; link conditions stay."""
        self._blocked.clear()
        self._isolated.clear()
        self._record("heal")
        self._refresh()

    def is_blocked(self, src: Address, dst: Address) -> bool:
        """Whether frames from ``src`` to ``dst`` are dropped by a partition now."""
        if src == dst:
            return False
        return (src, dst) in self._blocked or src in self._isolated or dst in self._isolated

    def crash(self, address: Address) -> None:
        """Crash the node attached at ``address``.

        Its transport closes at once: ``receive`` and the sends raise :class:`TransportClosed`,
        what it had queued or received and not read is gone, and every frame in flight to or from
        it is lost. Attaching again at ``address`` afterwards is a restart with a new uid.

        Raises:
            TransportError: no node is attached at ``address``.
        """
        node = self._nodes.get(address)
        if node is None:
            raise TransportError(f"cannot crash {address}: no node is attached there")
        self._counters.crashes += 1
        node._shutdown("crash")

    def inject_frame(self, src: Address, dst: Address, payload: bytes) -> None:
        """Queue a raw frame payload (without length prefix) from node ``src`` to ``dst``.

        It travels like any frame, through the link's faults, and is decoded by the receiver:
        a way to test how nodes cope with a peer sending garbage.

        Raises:
            TransportError: no node is attached at ``src``.
            SendQueueFull: ``src``'s queue to ``dst`` is full.
        """
        node = self._nodes.get(src)
        if node is None:
            raise TransportError(f"cannot inject a frame from {src}: no node is attached there")
        if src == dst:
            raise ValueError("inject_frame needs two different addresses")
        node._outbox(dst).put_nowait(encode_frame(bytes(payload)))
        self._counters.frames_injected += 1
        self._record("inject", node.local_address, dst, _digest(payload))

    def trace_hash(self) -> str:
        """The sha256 (hex) of every event recorded so far, one ``str(event)`` line each.

        Equal runs give equal hashes. It covers the events as recorded, whether or not they were
        kept in :attr:`trace`.
        """
        self._flush_trace()
        return self._trace_digest.hexdigest()

    def statistics(self) -> SimNetworkStatistics:
        """A snapshot of the network's counters."""
        c = self._counters
        return SimNetworkStatistics(
            nodes=len(self._nodes),
            attaches=c.attaches,
            crashes=c.crashes,
            frames_sent=c.frames_sent,
            frames_delivered=c.frames_delivered,
            frames_dropped_partition=c.frames_dropped_partition,
            frames_dropped_random=c.frames_dropped_random,
            frames_duplicated=c.frames_duplicated,
            frames_reordered=c.frames_reordered,
            frames_lost_in_flight=c.frames_lost_in_flight,
            frames_rejected=c.frames_rejected,
            frames_injected=c.frames_injected,
        )

    def _record(
        self,
        kind: TraceKind,
        src: object = "",
        dst: object = "",
        detail: str = "",
    ) -> None:
        # The line TraceEvent.__str__ gives, made without the event unless it is kept: frames are
        # recorded two to three times each, and this was a twentieth of a simulated run's time.
        at = _now()
        line = f"{at!r} {kind} {src} -> {dst} {detail}\n"
        pending = self._trace_pending
        pending.append(line)
        if len(pending) >= _TRACE_BATCH:
            self._flush_trace()
        if self._keep_trace:
            self.trace.append(TraceEvent(at, kind, str(src), str(dst), detail))

    def _flush_trace(self) -> None:
        """Hash the lines recorded since the last flush (sha256 of their concatenation)."""
        if self._trace_pending:
            self._trace_digest.update("".join(self._trace_pending).encode())
            self._trace_pending.clear()

    def _node(self, address: Address) -> SimTransport | None:
        return self._nodes.get(address)

    def _detach(self, node: SimTransport) -> None:
        address = node.local_address.address
        if self._nodes.get(address) is node:
            del self._nodes[address]
        for other in self._nodes.values():
            link = other._links.get(address)
            if link is not None:
                link.lose_in_flight()
        self._refresh()

    def _refresh(self) -> None:
        """Recompute which links are up after a node or partition change, and wake them."""
        inbound = dict.fromkeys(self._nodes, 0)
        for node in self._nodes.values():
            for address, link in node._links.items():
                if self._update_link(link):
                    inbound[address] += 1
                link.pump_lot.unpark_all()
            node._idle_lot.unpark_all()
        for address, node in self._nodes.items():
            node._inbound_links = inbound[address]

    def _cut(self, src: Address, dst: Address) -> bool:
        """Whether frames from ``src`` to ``dst`` are dropped: a partition, or a link refused."""
        if self.is_blocked(src, dst):
            return True
        if not self._mixed:
            return False  # one protocol range everywhere: nothing to refuse (the common case)
        source, target = self._nodes.get(src), self._nodes.get(dst)
        return source is not None and target is not None and source._agreed(target) is None

    def _update_link(self, link: _Link) -> bool:
        """Set whether ``link`` is up (a node is there, no partition); return that."""
        outbox = link.outbox
        target = self._nodes.get(link.address)
        if target is None or self.is_blocked(link.source.local_address.address, link.address):
            outbox.connected = False
            return False
        if self._mixed and link.source._agreed(target) is None:
            outbox.connected = False
            if link.refused is not target.local_address:
                link.refused = target.local_address  # once per incarnation, as one handshake
                self._refuse(link.source, target)
            return False
        if not outbox.connected or outbox.peer != target.local_address:
            outbox.connects += 1
            outbox.peer = target.local_address
            outbox.connected = True
            link.source._link_up(link.address)
        return True

    def _refuse(self, source: SimTransport, target: SimTransport) -> None:
        """The handshake of a link between nodes whose protocol versions do not meet."""
        reason = "their wire protocol versions do not meet"
        try:
            target._protocol.agree(source._protocol)
        except HandshakeError as exc:
            reason = str(exc)
        self._record("refused", source.local_address, target.local_address)
        source._outbox(target.local_address.address).connect_failures += 1
        source._refuse_link(target, f"{target.local_address} refused the link: {reason}")
        target._refused_link(source, str(reason))


class _Link:
    """One direction from a node to an address: a pump task and a delivery task."""

    def __init__(self, network: SimNetwork, source: SimTransport, outbox: Outbox) -> None:
        self.network = network
        self.source = source
        self.outbox = outbox
        self.refused: UniqueAddress | None = None
        """The incarnation at the address that refused this link (counted once)."""
        self.address = outbox.address
        # How both ends read in the trace, made once: a frame is recorded two to three times.
        self.source_text = str(source.local_address)
        self.address_text = str(outbox.address)
        # A string seed is hashed with sha512, independent of PYTHONHASHSEED.
        self.random = random.Random(f"{network.seed}/{source.local_address}/{outbox.address}")
        self.heap: list[tuple[float, int, bytes, str]] = []
        self.delivering = False
        self.sequence = 0
        self.last_due = -math.inf
        self.pump_lot = trio.lowlevel.ParkingLot()
        self.delivery_lot = trio.lowlevel.ParkingLot()

    @property
    def in_flight(self) -> int:
        return len(self.heap) + self.delivering

    async def pump(self) -> None:
        """Take frames from the send queue while the peer is there and in-flight room remains."""
        outbox = self.outbox
        source = self.source.local_address.address
        capacity = self.source.settings.send_queue_capacity
        while True:
            await outbox.wait_for_frames()
            if outbox.closed:
                return
            if self.network._cut(source, self.address):
                now = trio.current_time()
                while outbox.frames:
                    # take(1) takes exactly one frame: the second never fits in one byte.
                    self._transmit(outbox.take(1)[0], now, blocked=True)
                await trio.lowlevel.checkpoint()
                continue
            if self.network._node(self.address) is None or self.in_flight >= capacity:
                await self.pump_lot.park()
                continue
            now = trio.current_time()
            while outbox.frames and self.in_flight < capacity:
                self._transmit(outbox.take(1)[0], now, blocked=False)
            await trio.lowlevel.checkpoint()

    def _transmit(self, frame: bytes, now: float, *, blocked: bool) -> None:
        network = self.network
        counters = network._counters
        source = self.source.local_address
        self.outbox.sent([frame])
        payload = frame[HEADER_SIZE:]
        digest = _digest(payload)
        counters.frames_sent += 1
        network._record("send", self.source_text, self.address_text, digest)
        if blocked:
            counters.frames_dropped_partition += 1
            network._record("drop-partition", self.source_text, self.address_text, digest)
            return
        conditions = network.link_conditions(source.address, self.address)
        rng = self.random
        if conditions.drop and rng.random() < conditions.drop:
            counters.frames_dropped_random += 1
            network._record("drop-random", self.source_text, self.address_text, digest)
            return
        copies = 1
        if conditions.duplicate and rng.random() < conditions.duplicate:
            copies = 2
            counters.frames_duplicated += 1
            network._record("duplicate", self.source_text, self.address_text, digest)
        for _ in range(copies):
            due = now + conditions.sample_delay(rng)
            if conditions.reorder and rng.random() < conditions.reorder:
                if due < self.last_due:
                    counters.frames_reordered += 1
                    network._record("reorder", self.source_text, self.address_text, digest)
            else:
                due = max(due, self.last_due)
            self.last_due = max(self.last_due, due)
            self.sequence += 1
            heapq.heappush(self.heap, (due, self.sequence, payload, digest))
            if self.heap[0][1] == self.sequence:
                self.delivery_lot.unpark_all()

    async def deliver(self) -> None:
        """Hand each frame to the destination when it is due, earliest first."""
        heap = self.heap
        while True:
            if not heap:
                await self.delivery_lot.park()
                continue
            due = heap[0][0]
            if trio.current_time() < due:
                with trio.move_on_at(due):
                    await self.delivery_lot.park()
                continue
            _, _, payload, digest = heapq.heappop(heap)
            self.delivering = True
            try:
                await self._deliver_one(payload, digest)
            finally:
                self.delivering = False
            self.pump_lot.unpark_all()
            if not self.in_flight:
                self.source._idle_lot.unpark_all()

    async def _deliver_one(self, payload: bytes, digest: str) -> None:
        network = self.network
        counters = network._counters
        source = self.source.local_address
        target = network._node(self.address)
        if target is None:  # pragma: no cover - detaching a node empties the links to it
            self._count_lost(1, digest)
            return
        if network._cut(source.address, self.address):
            counters.frames_dropped_partition += 1
            network._record("drop-partition", self.source_text, target._local_text, digest)
            await trio.lowlevel.checkpoint()
            return
        counters.frames_delivered += 1
        network._record("deliver", self.source_text, target._local_text, digest)
        try:
            if len(payload) + HEADER_SIZE > target.settings.max_frame_size:
                raise FrameTooLarge(
                    f"peer sent a frame of {len(payload)} bytes; max_frame_size is "
                    f"{target.settings.max_frame_size}"
                )
            await target._deliver_frames([payload], source, self.source.identity)
        except (FrameDecodeError, FrameTooLarge, TooManyRefused) as exc:
            # The receiver closes the link, as over TCP: what was in flight behind this frame is
            # lost and the link reconnects.
            target._count_link_error(exc, source)
            counters.frames_rejected += 1
            network._record("bad-frame", self.source_text, target._local_text, digest)
            self.lose_in_flight()
            if self.outbox.connected:
                self.outbox.connects += 1
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # The receiver closed or crashed while this frame waited for room in its inbox.
            self._count_lost(1, digest)

    def lose_in_flight(self) -> None:
        """Drop every frame in flight on this link (its sender or receiver went away)."""
        if not self.heap:
            return
        lost = sorted(self.heap)
        self.heap.clear()
        for *_, digest in lost:
            self.network._record("lost", self.source_text, self.address_text, digest)
        self.outbox.frames_lost_in_flight += len(lost)
        self.network._counters.frames_lost_in_flight += len(lost)
        self.pump_lot.unpark_all()
        self.delivery_lot.unpark_all()
        self.source._idle_lot.unpark_all()

    def _count_lost(self, count: int, digest: str) -> None:
        self.network._record("lost", self.source_text, self.address_text, digest)
        self.outbox.frames_lost_in_flight += count
        self.network._counters.frames_lost_in_flight += count


class SimTransport(Transport):
    """A node's transport on a :class:`SimNetwork`; get one with ``SimNetwork.transport``.

    It behaves as the TCP transport does (same queues, backpressure, codec, statistics); the
    network decides delays and faults.

    Example:
        >>> async def echo(net: SimNetwork) -> None:
        ...     async with net.transport(Address("10.0.0.9", 25520), "echo") as transport:
        ...         async for envelope in transport:
        ...             await transport.send(envelope.sender, envelope.message)
    """

    def __init__(
        self,
        network: SimNetwork,
        local: UniqueAddress,
        settings: TransportSettings,
        identity: PeerIdentity | None = None,
        *,
        protocol: ProtocolRange = CURRENT_PROTOCOL,
    ) -> None:
        super().__init__(local, settings, identity)
        self._local_text = str(local)
        """How this incarnation reads in the network's trace."""
        self._protocol = protocol
        self._network = network
        self._links: dict[Address, _Link] = {}
        self._nursery: trio.Nursery | None = None
        self._idle_lot = trio.lowlevel.ParkingLot()
        """Woken when a link of this node empties or goes down: a graceful close waits on it."""

    @property
    def network(self) -> SimNetwork:
        """The network this transport is attached to."""
        return self._network

    @property
    def protocol(self) -> ProtocolRange:
        """The wire protocol versions this node speaks."""
        return self._protocol

    def peer_protocol(self, address: Address) -> int | None:
        """The protocol version of the link to ``address``: None while there is none."""
        link = self._links.get(address)
        target = self._network._node(address)
        if link is None or target is None or not link.outbox.connected:
            return None
        return self._agreed(target)

    def _agreed(self, other: SimTransport) -> int | None:
        try:
            return self._protocol.agree(other._protocol)
        except HandshakeError:
            return None

    def _refuse_link(self, target: SimTransport, reason: str) -> None:
        logger.warning("%s: cannot link to %s: %s", self._local, target.local_address, reason)

    def _refused_link(self, source: SimTransport, reason: str) -> None:
        self._counters.handshakes_refused += 1
        self._refusals.refuse(
            "refused-link",
            f"{self._local}: refused a link from {source.local_address}: {reason}",
            trio.current_time(),
        )

    def _start_link(self, outbox: Outbox) -> None:
        nursery = self._nursery
        if nursery is None:  # pragma: no cover - a transport is handed out only once running
            raise RuntimeError("SimTransport is not running")
        link = _Link(self._network, self, outbox)
        self._links[outbox.address] = link
        network = self._network
        if network._update_link(link):
            target = network._node(outbox.address)
            if target is not None:
                target._inbound_links += 1
        name = f"simnet link {self._local} -> {outbox.address}"
        nursery.start_soon(link.pump, name=f"{name} (send)")
        nursery.start_soon(link.deliver, name=f"{name} (deliver)")

    async def _serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # Link tasks live in this nursery, not in the one around the user's block, so that a
        # crash can stop them without cancelling the code that uses the transport.
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def aclose(self) -> None:
        """Close gracefully: deliver what is queued for connected peers (bounded), then close.

        Later sends raise :class:`TransportClosed`; so does ``receive`` (unread messages are
        discarded), and ``async for`` ends. Closing again does nothing.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        try:
            with trio.move_on_after(self._settings.shutdown_flush_timeout):
                await self.flush()
                while any(
                    link.in_flight and link.outbox.connected for link in self._links.values()
                ):
                    await self._idle_lot.park()
        finally:
            self._shutdown("close")

    def _shutdown(self, kind: Literal["close", "crash"]) -> None:
        if self._closed:
            return
        self._network._record(kind, self._local)
        self._mark_closed()
        self._inbox_receive.close()
        for link in self._links.values():
            link.outbox.connected = False
            link.lose_in_flight()
        self._network._detach(self)
        self._inbound_links = 0
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


@contextlib.contextmanager
def deterministic_scheduling(seed: int) -> Iterator[None]:
    """Make trio's scheduler pick among runnable tasks with a generator seeded by ``seed``.

    trio shuffles the tasks that become runnable together, with a module-level generator, to
    flush out ordering assumptions; runs then differ even with a mock clock. This turns on trio's
    deterministic mode (the one its hypothesis plugin uses) and seeds that generator, for the
    duration of the block; the previous mode and generator state come back afterwards.

    Example:
        >>> import trio.testing
        >>> with deterministic_scheduling(42):
        ...     trio.run(trio.sleep, 1, clock=trio.testing.MockClock(autojump_threshold=0))

    Raises:
        RuntimeError: this trio version lacks the private hooks relied on.
    """
    try:
        run_module: Any = importlib.import_module("trio._core._run")
    except ImportError:  # pragma: no cover - depends on trio's internals
        run_module = None
    generator = getattr(run_module, "_r", None)
    if not hasattr(run_module, "_ALLOW_DETERMINISTIC_SCHEDULING") or not isinstance(
        generator, random.Random
    ):
        raise RuntimeError(
            f"deterministic_scheduling needs trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING "
            f"and trio._core._run._r, which trio {trio.__version__} does not have: pin a trio "
            "version that has them or update membership.transport._simnet"
        )
    allowed = run_module._ALLOW_DETERMINISTIC_SCHEDULING
    state = generator.getstate()
    run_module._ALLOW_DETERMINISTIC_SCHEDULING = True
    generator.seed(seed)
    try:
        yield
    finally:
        run_module._ALLOW_DETERMINISTIC_SCHEDULING = allowed
        generator.setstate(state)
