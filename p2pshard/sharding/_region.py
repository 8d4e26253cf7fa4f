"""``ShardRegion``: the trio shell of one entity type's region (or proxy) on one node.

Theory of operation. The routing decisions are :class:`ShardRegionCore`'s; this shell sends
messages on their way and carries out the core's effects. A message to an entity goes, by the
core's table of homes:

* to a shard running here: straight into the entity's mailbox (``Shard.deliver``);
* to a shard hosted elsewhere: one ``EntityDelivery`` to that node, never via the coordinator;
  or, while the link to that node is busy, gathered with others into one ``EntityDeliveries``
  (a batch the region sends when the sending task yields, or when it is full);
* otherwise into the core's buffer, until the coordinator names a home.

Messages a region receives from other regions take the same way (a region that no longer hosts
a shard passes the message on), and an ask's answer goes straight back to the asking node. The
shell also keeps the order a sender sees: a buffer released to another node is sent before any
newer message for that shard; once messages are gathered for a node, every later one for it is
gathered behind them until they are out; and a hand-off acknowledgement relayed through the
owner waits until the sends to that shard that were waiting for room in the send queue, and the
messages gathered for the owner, are out.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Coroutine
from typing import Any

import attrs
import trio

from membership import (
    ClusterError,
    ConfigurationError,
    HistogramSnapshot,
    LatencyHistogram,
    MessageTooLarge,
    ProtocolError,
    SendQueueFull,
    SerializationError,
    TransportClosed,
    UniqueAddress,
)
from membership.internal import HEADER_SIZE as FRAME_PREFIX_SIZE
from membership.internal import CoreTimer
from membership.internal import wire as _wire

from .._errors import (
    AskTimeout,
    BufferOverflow,
    RegionStopped,
    RemoteEntityError,
    ShardingError,
)
from .._tracing import Traced, Tracing, carrier_of
from ..leases._lease import ShardLease, ShardLeaseFactory
from ._allocation import EntityId, ShardId
from ._asks import RemoteReply
from ._entity import EntityContext, EntityRef, EntitySender, EntityState, Reply
from ._extractor import MessageExtractor
from ._outbox import ENTRY_OVERHEAD, Outbox, entry_size
from ._protocol import (
    ENTRY_FIELDS,
    BeginHandOffAck,
    EntityDeliveries,
    EntityDelivery,
    unchecked_delivery,
)
from ._region_core import (
    Drop,
    DropReason,
    Flush,
    RegionEffect,
    SendOrder,
    SendTo,
    ShardRegionCore,
    StartShard,
    StopShard,
    ToCoordinator,
)
from ._region_core import Refused as RefusedEffect
from ._remember import RememberStore
from ._services import RegionServices, ShardingEvent, tell_listeners
from ._settings import ShardingSettings
from ._shard import FORCED_STOP_FRACTION, EntityFactory, EntityWorkers, Shard, ShardHost

logger = logging.getLogger("p2pshard.region")

Delivery = tuple[EntityId, object, "Reply | None"]
"""What a region buffers per message."""

SHARD_CACHE_SIZE = 100_000
"""Entity ids whose shard id a region remembers (the extractor's hash is not free)."""

YIELD_EVERY = 32
"""Local tells between two yields to the scheduler (a tell is always a cancel point)."""

BATCH_MESSAGES = 128
"""Messages a region gathers into one ``EntityDeliveries`` at most (see ``ShardRegion._gather``)."""

BATCH_BYTES = 32 * 1024
"""Bytes (an upper estimate) a region gathers into one ``EntityDeliveries`` at most."""

_SHORT_ID = 256
"""Entity ids up to this many characters, with a small message, surely fit in a frame."""

_DELIVERY_OVERHEAD = 1024
"""Bytes an ``EntityDelivery`` takes besides its ids, type name and payload, at most (the
asker's address included)."""

ASK_FAILURE_REASONS: tuple[str, ...] = (
    "timeout",
    "entity_error",
    "buffer_full",
    "region_stopped",
    "not_delivered",
)
"""Why an ask made here failed (:attr:`RegionStatistics.ask_failures`): no answer in time; the
entity raised; the region's buffer was full; a region stopped; the message could not be
delivered (not sent, not encodable, refused)."""


def _ask_failure(error: BaseException) -> str:
    if isinstance(error, AskTimeout):
        return "timeout"
    if isinstance(error, RemoteEntityError):
        return "entity_error"
    if isinstance(error, BufferOverflow):
        return "buffer_full"
    if isinstance(error, RegionStopped):
        return "region_stopped"
    return "not_delivered"


@attrs.frozen
class RegionStatistics:
    """Counters of one region (see :meth:`ShardRegion.statistics`)."""

    type_name: str
    proxy: bool
    registered: bool
    coordinator: UniqueAddress | None
    shards: int
    entities: int
    known_homes: int
    buffered: int
    dropped: int
    shard_home_requests: int
    delivered_local: int
    sent_remote: int
    batches_sent: int
    """``EntityDeliveries`` sent: messages gathered while the link to their node was busy."""
    received_remote: int
    workers: int
    lost_at_forced_stop: int
    drops: dict[str, int] = attrs.field(factory=dict)
    """``dropped`` by reason (``DropReason`` names in lower case: ``buffer_full``...)."""
    asks: int = 0
    """Asks made from this node to the entity type."""
    ask_seconds: HistogramSnapshot | None = None
    """Seconds from each answered ask (a value or an error) to its answer."""
    ask_failures: dict[str, int] = attrs.field(factory=dict)
    """Asks that did not end with a value, by reason (:data:`ASK_FAILURE_REASONS`)."""
    activations: int = 0
    """Entity incarnations started here."""
    passivations: int = 0
    """Entity incarnations stopped here: passivated, or stopped for a hand-off or lost lease."""
    shard_home_lookups: HistogramSnapshot | None = None
    """Seconds from a shard's first GetShardHome to the coordinator's answer."""


@attrs.frozen
class ShardState:
    """One shard hosted here and its active entity ids (see ``Sharding.region_state``)."""

    shard_id: ShardId
    entity_ids: frozenset[EntityId]


@attrs.frozen
class ShardRegionState:
    """The shards this region hosts now, each with its active entities."""

    type_name: str
    shards: tuple[ShardState, ...]


class ShardRegion:
    """One entity type on this node: a region hosting shards, or a proxy that only routes.

    Get one from ``node.sharding.start(...)`` (or ``start_proxy``); send with
    :meth:`entity_ref`, or :meth:`tell`/:meth:`ask` with messages the extractor understands.

    Example:
        >>> async def main(node: Node) -> None:
        ...     counters = await node.sharding.start(
        ...         "Counter", Counter, extractor=HashExtractor(100)
        ...     )
        ...     await counters.entity_ref("counter-1").tell(Increment())
    """

    def __init__(
        self,
        services: RegionServices,
        type_name: str,
        factory: EntityFactory | None,
        extractor: MessageExtractor,
        settings: ShardingSettings,
        stop_message: object,
        role: str | None,
        nursery: trio.Nursery,
        lease_factory: ShardLeaseFactory | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._services = services
        self._tracing = tracing
        self._asks = services.asks
        self._check_message = services.check_message
        self._lifecycle = services.lifecycle
        self._lease_factory = lease_factory
        self.type_name = type_name
        self._factory: EntityFactory = factory or _no_factory
        self._extractor = extractor
        self.settings = settings
        self._stop_message = stop_message
        self.role = role
        self._transport = services.transport
        self._self_node = self._transport.local_address
        self._core: ShardRegionCore[Delivery] = ShardRegionCore(
            type_name,
            self._self_node,
            extractor.number_of_shards,
            settings,
            hosting=factory is not None,
            now=trio.current_time(),
            oldest=_singleton_host(services.cluster, role),
        )
        self._proxy = services.singletons.proxy(coordinator_name(type_name), role=role)
        self._nursery = nursery
        self._scheduler = EntityWorkers(nursery)
        self._shards: dict[ShardId, Shard] = {}
        self._running: dict[ShardId, Shard] = {}
        self._stop_deadlines: dict[ShardId, float] = {}
        self._order: SendOrder[Delivery] = SendOrder(self._core)
        self._flushing = self._order.flushing  # read on every send: one lookup, not two
        self._unblocked = trio.Event()
        self._lru: collections.OrderedDict[EntityContext, None] | None = (
            collections.OrderedDict() if settings.active_entity_limit is not None else None
        )
        self._timer = CoreTimer(self._next_deadline)
        self._next_idle_scan = trio.current_time() + self._idle_scan_interval()
        self._next_restart = float("inf")
        self._shard_cache: dict[str, ShardId] = {}
        self._unyielded = 0
        self._entities = 0
        self._delivered_local = 0
        self._sent_remote = 0
        self._batches_sent = 0
        self._received_remote = 0
        self._activations = 0
        self._asks_made = 0
        self._ask_seconds = LatencyHistogram()
        self._ask_failures = dict.fromkeys(ASK_FAILURE_REASONS, 0)
        # What trio.current_time() reads, without its two calls and run-context lookup: an ask
        # reads it as it starts and as its answer comes.
        self._now = trio.lowlevel.current_clock().current_time
        self._stopped_event = trio.Event()
        self._outgoing: dict[UniqueAddress, Outbox] = {}
        self._gathered = trio.Event()
        """Set when a node gets its first gathered message: the batcher task sends them."""
        self._batch_bytes = min(
            BATCH_BYTES,
            self._transport.settings.max_frame_size - 4 * len(type_name) - 4 * ENTRY_OVERHEAD,
        )
        """The batch size, in estimated bytes: a message that alone is larger is sent alone."""
        self._recent_home: UniqueAddress | None = None
        self._recent_outgoing: Outbox | None = None
        """The last node gathered for and what :attr:`_outgoing` holds for it."""
        self._sender = (
            EntitySender(type_name, self._tell, self._ask)
            if tracing is None
            else EntitySender(type_name, self._tell_traced, self._ask_traced)
        )
        """What this region's entity refs send with (one, so that equal refs share it). With
        tracing off it sends with the plain methods: not one test per message for tracing."""
        self._host = ShardHost(
            type_name=type_name,
            settings=settings,
            workers=self._scheduler,
            recently_used=self._lru,
            entity_factory=self._factory,
            stop_message=stop_message,
            observers=services.observers,
            sender=self._sender,
            route=self._route_nowait,
            entity_started=self._entity_started,
            entity_stopped=self._entity_stopped,
            restart_due=self._wake_timer,
            tracing=tracing,
        )
        """What this region's shards use of it."""

    # -- public API -------------------------------------------------------------------------

    @property
    def is_proxy(self) -> bool:
        """Whether this region only routes (hosts no shards)."""
        return not self._core.hosting

    @property
    def number_of_shards(self) -> int:
        """Shards of this entity type, the same on every node."""
        return self._extractor.number_of_shards

    def entity_ref(self, entity_id: str) -> EntityRef:
        """A reference to the entity ``entity_id`` (it need not exist yet).

        Raises:
            ValueError: ``entity_id`` is not a non-empty string.
        """
        return EntityRef(self._sender, entity_id)

    async def tell(self, message: object) -> None:
        """Send ``message`` to the entity the extractor names (a ``ShardingEnvelope``, say).

        Raises:
            ValueError: the extractor finds no entity id in ``message``.
        """
        entity_id = self._entity_id_of(message)
        await self._sender.tell(entity_id, self._extractor.entity_message(message))

    async def ask(self, message: object, *, timeout: float) -> object:  # noqa: ASYNC109 - the API
        """Ask the entity the extractor names; see :meth:`EntityRef.ask`."""
        entity_id = self._entity_id_of(message)
        return await self._sender.ask(entity_id, self._extractor.entity_message(message), timeout)

    def state(self) -> ShardRegionState:
        """The shards hosted here now, with their active entity ids."""
        return ShardRegionState(
            self.type_name,
            tuple(
                ShardState(shard_id, frozenset(shard.entities))
                for shard_id, shard in sorted(self._shards.items())
            ),
        )

    def shard_entity_counts(self) -> dict[str, int]:
        """Shard id → active entities, for the shards hosted here."""
        return {shard_id: len(shard.entities) for shard_id, shard in self._shards.items()}

    def shard_homes(self) -> dict[ShardId, UniqueAddress]:
        """The shard homes this region knows now (a copy): shard id → the hosting node.

        Regions learn homes from the coordinator and forget those on nodes that leave; after a
        quiet period every region's table agrees with the coordinator's (``p2pshard.testing``
        checks that).
        """
        return dict(self._core.homes)

    def statistics(self) -> RegionStatistics:
        """Counters for diagnostics: shards, entities, buffered and dropped messages."""
        core = self._core
        return RegionStatistics(
            type_name=self.type_name,
            proxy=not core.hosting,
            registered=core.registered,
            coordinator=core.coordinator,
            shards=len(self._shards),
            entities=self._entities,
            known_homes=len(core.homes),
            buffered=core.buffered + sum(map(len, self._flushing.values())),
            dropped=core.dropped,
            shard_home_requests=core.home_requests,
            delivered_local=self._delivered_local,
            sent_remote=self._sent_remote,
            batches_sent=self._batches_sent,
            received_remote=self._received_remote,
            workers=self._scheduler.workers,
            lost_at_forced_stop=sum(s.lost for s in self._shards.values()),
            drops={reason.label: n for reason, n in core.drops.items()},
            asks=self._asks_made,
            ask_seconds=self._ask_seconds.snapshot(),
            ask_failures=dict(self._ask_failures),
            activations=self._activations,
            # Every incarnation started here is either active or was stopped.
            passivations=self._activations - self._entities,
            shard_home_lookups=core.home_lookups.snapshot(),
        )

    # -- sending ----------------------------------------------------------------------------

    def _entity_id_of(self, message: object) -> EntityId:
        entity_id = self._extractor.entity_id(message)
        if entity_id is None:
            raise ValueError(
                f"the extractor of {self.type_name!r} finds no entity id in a "
                f"{type(message).__name__}; wrap it in a ShardingEnvelope or use entity_ref()"
            )
        return entity_id

    def _check_usable(self, message: object) -> None:
        core = self._core
        if core.refused is not None:
            raise ConfigurationError(
                f"entity type {self.type_name!r} cannot be used on this node: {core.refused}"
            )
        if core.stopped or self._lifecycle.closed:
            raise RegionStopped(f"the region of {self.type_name!r} on this node has stopped")

    def _tell(self, entity_id: EntityId, message: object) -> Coroutine[Any, Any, None]:
        # Not a coroutine function: it hands back _send's coroutine, one coroutine less per tell.
        # Callers await it at once, so a refusal is raised where it was before.
        self._check_usable(message)
        return self._send(entity_id, message, None)

    async def _tell_traced(self, entity_id: EntityId, message: object) -> None:
        """:meth:`_tell` with tracing on: inside a recording span, the message is traced."""
        self._check_usable(message)
        tracing = self._tracing
        assert tracing is not None
        if not tracing.recording():
            await self._send(entity_id, message, None)
            return
        span = tracing.start_send("tell", self._extractor.shard_id(entity_id), entity_id)
        with tracing.sending(span) as parent:
            await self._send(entity_id, message, None, parent)

    async def _ask_traced(self, entity_id: EntityId, message: object, timeout: float) -> object:  # noqa: ASYNC109
        """:meth:`_ask` with tracing on: inside a recording span, the message is traced."""
        tracing = self._tracing
        assert tracing is not None
        if not tracing.recording():
            return await self._ask(entity_id, message, timeout)
        span = tracing.start_send("ask", self._extractor.shard_id(entity_id), entity_id)
        with tracing.sending(span) as parent:
            return await self._ask(entity_id, message, timeout, parent)

    async def _ask(
        self,
        entity_id: EntityId,
        message: object,
        timeout: float,  # noqa: ASYNC109
        trace: object = None,
    ) -> object:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
            raise ValueError(
                f"an ask timeout must be a non-negative number of seconds, not {timeout!r}"
            )
        self._check_usable(message)
        slot = self._asks.new(entity_id)
        self._asks_made += 1
        started = self._now()
        try:
            await self._send(entity_id, message, slot, trace)
            with trio.move_on_after(timeout):
                await slot.done.wait()
            if not slot.done.is_set():
                raise AskTimeout(
                    f"entity {self.type_name}/{entity_id} did not answer within {timeout:g} s"
                )
            self._ask_seconds.observe(self._now() - started)
            if slot.error is not None:
                raise slot.error
            return slot.value
        except ClusterError as exc:  # every failure of an ask is one (never Cancelled)
            self._ask_failures[_ask_failure(exc)] += 1
            raise
        finally:
            self._asks.forget(slot)

    async def _send(
        self, entity_id: EntityId, message: object, reply: Reply | None, trace: object = None
    ) -> None:
        """Send to the entity; ``trace`` is the sender's trace context, when traced."""
        shard_id = self._shard_cache.get(entity_id)
        if shard_id is None:
            shard_id = self._extractor.shard_id(entity_id)
            if len(self._shard_cache) >= SHARD_CACHE_SIZE:
                self._shard_cache.clear()
            self._shard_cache[entity_id] = shard_id
        await trio.lowlevel.checkpoint_if_cancelled()
        # A copy of SendOrder.remote_home, spelled out for speed: the call cost a twentieth of
        # a send. (test_region_copies.py checks that both decide the same.)
        if shard_id in self._running or shard_id in self._flushing:
            home = None
        else:
            home = self._core.homes.get(shard_id)
            if home is self._self_node:
                home = None
        if home is None:
            # Staying here for now; checked, so it would not fail later when it leaves.
            # (A message for another node is checked by encoding it, below.)
            size = self._check_message(message)
            if size or len(entity_id) > _SHORT_ID:  # else small, and so its envelope
                self._check_envelope(shard_id, entity_id, message, reply, size)
            if trace is not None:
                message = Traced(message, trace)
            if not self._place_here(shard_id, entity_id, message, reply):
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            self._delivered_local += 1
            # Like a send on the transport, a local send yields only now and then: a sender
            # that tells many entities fills their mailboxes and the workers take them in batches.
            self._unyielded += 1
            if self._unyielded >= YIELD_EVERY or reply is not None:
                self._unyielded = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        carrier = None if trace is None else carrier_of(trace)
        outgoing = self._gathered_for(home)
        if outgoing is not None or (reply is None and self._transport.backlog(home)):
            # A tell while the link is busy (or a message behind gathered ones): gathered with
            # others into one EntityDeliveries. An ask does not start a batch: a batch waits
            # for the batcher task, one scheduler pass more than a queued frame, and asks in
            # flight at once would each pay it.
            payload = _wire.encode(message)  # fails here, as a send would: nothing is gathered
            size = entry_size(shard_id, entity_id, payload)
            if size <= self._batch_bytes:
                outgoing = self._gather(
                    home, outgoing, shard_id, entity_id, payload, size, reply, carrier
                )
                if len(outgoing.replies) >= BATCH_MESSAGES or outgoing.size >= self._batch_bytes:
                    await self._send_gathered(home)
                return
            await self._send_gathered_all(home)  # too large to gather: alone, behind them
        delivery = (
            unchecked_delivery(self.type_name, shard_id, entity_id, message, 0, None, carrier)
            if reply is None  # a tell: _delivery spelled out (test_region_copies.py checks it)
            else self._delivery(shard_id, entity_id, message, reply, carrier)
        )
        try:
            self._transport.send_nowait(home, delivery)
        except MessageTooLarge as exc:
            raise self._too_large(entity_id, message, exc) from None
        except SendQueueFull:
            self._order.block(shard_id)
            try:
                sent = await self._send_waiting(home, delivery)
            finally:
                self._unblock(shard_id)
            if not sent:
                self._dropped(
                    [(entity_id, message, reply)],
                    DropReason.SEND_QUEUE_FULL,
                    f"the send queue to {home} stayed full for {self.settings.retry_interval:g} s",
                )
                return
        self._sent_remote += 1

    def _check_envelope(
        self,
        shard_id: ShardId,
        entity_id: EntityId,
        message: object,
        reply: Reply | None,
        size: int,
    ) -> None:
        """Raise ``MessageTooLarge`` if the message with its envelope would not fit in a frame.

        ``size`` is the message's encoded size (0: small). The envelope is encoded only when
        an upper estimate of its size comes near ``max_frame_size`` (a long entity id, say).
        """
        limit = self._transport.settings.max_frame_size - FRAME_PREFIX_SIZE
        estimate = (
            size + 4 * (len(entity_id) + len(shard_id) + len(self.type_name)) + _DELIVERY_OVERHEAD
        )
        if estimate <= limit:
            return
        try:
            _wire.encode(self._delivery(shard_id, entity_id, message, reply), max_size=limit)
        except MessageTooLarge as exc:
            raise self._too_large(entity_id, message, exc) from None

    def _too_large(self, entity_id: EntityId, message: object, exc: Exception) -> MessageTooLarge:
        shown = entity_id if len(entity_id) <= 40 else f"{entity_id[:40]}..."
        kind = type(message)
        return MessageTooLarge(
            f"a {kind.__module__}.{kind.__qualname__} to entity {self.type_name}/{shown} "
            f"(an entity id of {len(entity_id.encode())} bytes) does not fit in one frame with "
            f"its envelope: {exc}. Shorten the entity id or the message, or raise "
            "transport.max_frame_size on every node"
        )

    def _gathered_for(self, home: UniqueAddress) -> Outbox | None:
        """What :attr:`_outgoing` holds for ``home``: once per remote send.

        An address hashes in Python, so the dict is not asked when nothing is gathered, nor
        for the last node gathered for.
        """
        if home is self._recent_home:
            return self._recent_outgoing
        return self._outgoing.get(home) if self._outgoing else None

    def _gather(
        self,
        home: UniqueAddress,
        outgoing: Outbox | None,
        shard_id: ShardId,
        entity_id: EntityId,
        payload: bytes,
        size: int,
        reply: Reply | None,
        trace: dict[str, str] | None = None,
    ) -> Outbox:
        """Add a message (encoded, ``size`` from :func:`_entry_size`) to those for ``home``.

        ``trace`` is the message's trace context as the envelope carries it, if it has one.

        ``outgoing`` is what :attr:`_outgoing` holds for ``home``, if anything. The batcher task
        sends the messages when the task gathering them yields; a task that gathers a whole
        batch sends it itself. Every later message for ``home`` is gathered behind them until
        they are out, so that none overtakes them.
        """
        if outgoing is None:
            outgoing = self._outgoing[home] = Outbox()
            self._recent_home, self._recent_outgoing = home, outgoing
        if not outgoing.replies:
            self._gathered.set()
        if reply is None:
            outgoing.entries += (shard_id, entity_id, payload, 0, None)
        else:
            origin = reply.origin if isinstance(reply, RemoteReply) else None
            outgoing.entries += (shard_id, entity_id, payload, reply.request_id, origin)
        outgoing.replies.append(reply)
        outgoing.size += size
        if trace is not None or outgoing.traces is not None:
            outgoing.add_trace(trace)
        return outgoing

    async def _batcher(self) -> None:
        """Send what :meth:`_gather` gathers, as soon as the tasks gathering it yield."""
        while True:
            await self._gathered.wait()
            self._gathered = trio.Event()
            for home in list(self._outgoing):
                await self._send_gathered(home)

    async def _send_gathered_all(self, home: UniqueAddress) -> None:
        """Send everything gathered for ``home``: afterwards a message to it may go alone."""
        while home in self._outgoing:
            await self._send_gathered(home)

    async def _send_gathered(self, home: UniqueAddress) -> None:
        """Send the messages gathered for ``home``, in batches, after any batch on its way."""
        outgoing = self._outgoing.get(home)
        if outgoing is None:
            return
        async with outgoing.lock:
            while outgoing.replies:
                entries, replies, traces = outgoing.take(self._batch_bytes)
                try:
                    await self._send_batch(home, entries, replies, traces)
                except BaseException:
                    # Cancelled while waiting for room: the messages (maybe other tasks') are
                    # not lost with this task; the batcher sends them.
                    outgoing.give_back(entries, replies, traces)
                    self._gathered.set()
                    raise
            if not outgoing.lock.statistics().tasks_waiting:
                del self._outgoing[home]  # nothing left, and nobody else is about to send
                if self._recent_outgoing is outgoing:
                    self._recent_home = self._recent_outgoing = None
        self._unblocked.set()  # a hand-off acknowledgement may wait for this (see _relay)
        self._unblocked = trio.Event()

    async def _send_batch(
        self,
        home: UniqueAddress,
        entries: list[Any],
        replies: list[Reply | None],
        traces: list[object] | None = None,
    ) -> None:
        batch = EntityDeliveries(type_name=self.type_name, entries=entries, traces=traces)
        try:
            try:
                self._transport.send_nowait(home, batch)
            except SendQueueFull:
                with trio.move_on_after(self.settings.retry_interval):
                    await self._transport.send(home, batch)
                    self._sent_remote += len(replies)
                    self._batches_sent += 1
                    return
                self._core.count_dropped(len(replies))
                self._lost(
                    replies,
                    DropReason.SEND_QUEUE_FULL,
                    f"the send queue to {home} stayed full for {self.settings.retry_interval:g} s",
                )
                return
        except (TransportClosed, SerializationError) as exc:
            self._lost(replies, DropReason.NOT_SENT, f"sending to {home} failed: {exc}")
            return
        self._sent_remote += len(replies)
        self._batches_sent += 1

    async def _send_waiting(self, home: UniqueAddress, delivery: EntityDelivery) -> bool:
        """Send, waiting for room in the queue, but not forever: False if it stayed full.

        Waiting is backpressure from a slow peer; a queue that stays full for a whole
        ``retry_interval`` means a peer that is gone, and at-most-once delivery drops.
        """
        with trio.move_on_after(self.settings.retry_interval):
            await self._transport.send(home, delivery)
            return True
        self._core.count_dropped(1)
        return False

    def _delivery(
        self,
        shard_id: ShardId,
        entity_id: EntityId,
        message: object,
        reply: Reply | None,
        trace: dict[str, str] | None = None,
    ) -> EntityDelivery:
        if isinstance(message, Traced):  # it waited here (a buffer, a hand-off) with its context
            trace = message.carrier()
            message = message.message
        if reply is None:
            return unchecked_delivery(self.type_name, shard_id, entity_id, message, 0, None, trace)
        origin = reply.origin if isinstance(reply, RemoteReply) else self._self_node
        return unchecked_delivery(
            self.type_name, shard_id, entity_id, message, reply.request_id, origin, trace
        )

    def _unblock(self, shard_id: ShardId) -> None:
        if self._order.unblock(shard_id):
            self._unblocked.set()
            self._unblocked = trio.Event()

    def _buffer(self, shard_id: ShardId, delivery: Delivery) -> None:
        self._apply(self._core.buffer(shard_id, delivery, trio.current_time()))

    def _remote_home(self, shard_id: ShardId) -> UniqueAddress | None:
        """The node to send ``shard_id``'s message straight to, or None if it stays here."""
        return self._order.remote_home(shard_id, self._running)

    def _place_here(
        self, shard_id: ShardId, entity_id: EntityId, message: object, reply: Reply | None
    ) -> bool:
        """Deliver to the running shard (True), or queue behind a flush, or buffer."""
        shard = self._running.get(shard_id)
        if shard is not None:
            shard.deliver(entity_id, message, reply)
            return True
        queue = self._order.behind_flush(shard_id)
        if queue is not None:
            queue.append((entity_id, message, reply))  # behind the older ones going there
        else:
            self._buffer(shard_id, (entity_id, message, reply))
        return False

    def _route_nowait(
        self, shard_id: ShardId, entity_id: EntityId, message: object, reply: Reply | None
    ) -> None:
        """Route a message that came from another region (no waiting: a link task calls it)."""
        home = self._remote_home(shard_id)
        if home is None:
            self._place_here(shard_id, entity_id, message, reply)
            return
        outgoing = self._gathered_for(home)
        if outgoing is not None:  # behind the messages gathered for it
            trace = None
            if isinstance(message, Traced):
                trace = message.carrier()
                message = message.message
            try:
                payload = _wire.encode(message)
            except SerializationError as exc:
                self._dropped(
                    [(entity_id, message, reply)],
                    DropReason.NOT_SENT,
                    f"passing it on failed: {exc}",
                )
                return
            size = entry_size(shard_id, entity_id, payload)
            self._gather(home, outgoing, shard_id, entity_id, payload, size, reply, trace)
            return
        try:
            self._transport.send_nowait(home, self._delivery(shard_id, entity_id, message, reply))
            self._sent_remote += 1
        except (SendQueueFull, TransportClosed, SerializationError) as exc:
            self._dropped(
                [(entity_id, message, reply)],
                DropReason.NOT_SENT,
                f"passing it on to {home} failed: {exc}",
            )

    # -- from the transport -----------------------------------------------------------------

    def _on_delivery(self, sender: UniqueAddress, delivery: EntityDelivery) -> None:
        # The ids are plain str, which ShardId and EntityId are at run time: no NewType calls
        # on the receive path.
        self._received(
            sender,
            delivery.shard,  # type: ignore[arg-type]
            delivery.entity_id,  # type: ignore[arg-type]
            delivery.message,
            delivery.request_id,
            delivery.origin,
            delivery.trace,
        )

    def _on_deliveries(self, sender: UniqueAddress, batch: EntityDeliveries) -> None:
        entries = batch.entries
        if len(entries) % ENTRY_FIELDS:
            logger.warning(
                "region %s: dropped a batch from %s: %d values are not whole entries of %d",
                self.type_name,
                sender,
                len(entries),
                ENTRY_FIELDS,
            )
            return
        traces: Any = batch.traces
        if traces is None or len(traces) * ENTRY_FIELDS != len(entries):
            if traces is not None:
                logger.warning(
                    "region %s: a batch from %s has %d trace contexts for %d messages: "
                    "its messages go on untraced",
                    self.type_name,
                    sender,
                    len(traces),
                    len(entries) // ENTRY_FIELDS,
                )
            traces = itertools.repeat(None)
        decode = _wire.decode_parts
        received: Any = self._received  # takes the str ids as ShardId and EntityId
        values = iter(entries)
        for shard_id, entity_id, payload, request_id, origin, trace in zip(
            values, values, values, values, values, traces, strict=False
        ):
            if (
                type(shard_id) is not str
                or type(entity_id) is not str
                or type(payload) is not bytes
                or type(request_id) is not int
                or (origin is not None and type(origin) is not UniqueAddress)
            ):
                logger.warning(
                    "region %s: dropped a message from %s: entry %r does not hold "
                    "(shard id, entity id, payload, request id, origin)",
                    self.type_name,
                    sender,
                    [shard_id, entity_id, payload, request_id, origin],
                )
                continue
            try:
                message = decode(payload)[1]
            except ProtocolError as exc:
                logger.warning(
                    "region %s: dropped a message for %s from %s: %s",
                    self.type_name,
                    entity_id,
                    sender,
                    exc,
                )
                if request_id:
                    RemoteReply(self._asks, origin or sender, request_id).fail(
                        "p2pshard.ShardingError", f"the message did not decode: {exc}"
                    )
                continue
            received(
                sender,
                shard_id,
                entity_id,
                message,
                request_id,
                origin,
                trace if type(trace) is dict else None,
            )

    def _received(
        self,
        sender: UniqueAddress,
        shard_id: ShardId,
        entity_id: EntityId,
        message: object,
        request_id: int,
        origin: UniqueAddress | None,
        trace: dict[str, str] | None = None,
    ) -> None:
        self._received_remote += 1
        if trace is not None:  # the sender's trace context goes with the message, wherever
            message = Traced(message, trace)
        reply: Reply | None = None
        if request_id:
            reply = RemoteReply(self._asks, origin or sender, request_id)
        if self._core.refused is not None or self._core.stopped:
            if reply is not None:
                reply.fail("p2pshard.RegionStopped", f"the region on {self._self_node} stopped")
            return
        # A copy of _place_here's first step (_route_nowait's), spelled out for speed: the
        # shard runs here. (test_region_copies.py checks that both decide the same.)
        shard = self._running.get(shard_id)
        if shard is not None:
            shard.deliver(entity_id, message, reply)
            return
        self._route_nowait(shard_id, entity_id, message, reply)

    def _on_control(self, sender: UniqueAddress, message: object) -> None:
        self._apply(self._core.receive(sender, message, trio.current_time()))

    # -- effects ----------------------------------------------------------------------------

    def _apply(self, effects: list[RegionEffect[Delivery]]) -> None:
        for effect in effects:
            match effect:
                case ToCoordinator(message=message):
                    self._to_coordinator(message)
                case SendTo(to=to, message=ack):
                    self._relay(to, ack)
                case StartShard(shard=shard_id):
                    self._start_shard(shard_id)
                case StopShard(shard=shard_id):
                    self._stop_shard(shard_id)
                case Flush(shard=shard_id, home=home, deliveries=deliveries):
                    self._flush(shard_id, home, deliveries)
                case Drop(deliveries=deliveries, reason=reason, cause=cause):
                    self._dropped(deliveries, cause, reason)
                case RefusedEffect(reason=reason):
                    logger.error(
                        "%s: entity type %r refused: %s", self._self_node, self.type_name, reason
                    )
        if self._core.stopped:
            self._stopped_event.set()
        self._timer.poke()

    def _to_coordinator(self, message: object) -> None:
        try:
            self._proxy.tell_nowait(message)
        except ShardingError:  # pragma: no cover - a proxy buffer overflow: retried on tick
            pass
        except Exception as exc:
            logger.warning("region %s: message to the coordinator dropped: %s", self.type_name, exc)

    def _relay(self, owner: UniqueAddress, ack: BeginHandOffAck) -> None:
        shard_id = ShardId(ack.shard)
        if self._sends_pending(shard_id, owner):
            self._nursery.start_soon(self._relay_when_sent, owner, ack)
            return
        self._send_control(owner, ack)

    async def _relay_when_sent(self, owner: UniqueAddress, ack: BeginHandOffAck) -> None:
        shard_id = ShardId(ack.shard)
        while self._sends_pending(shard_id, owner):
            await self._unblocked.wait()
        self._send_control(owner, ack)

    def _sends_pending(self, shard_id: ShardId, owner: UniqueAddress) -> bool:
        """Whether messages for ``shard_id``, or gathered for ``owner``, are not yet sent."""
        return self._order.ack_waits(shard_id, owner in self._outgoing)

    def _send_control(self, to: UniqueAddress, message: object) -> None:
        try:
            self._transport.send_nowait(to, message)
        except (SendQueueFull, TransportClosed) as exc:
            # The coordinator's hand-off times out and is tried again later.
            logger.warning("region %s: %s to %s lost: %s", self.type_name, message, to, exc)

    def _start_shard(self, shard_id: ShardId) -> None:
        shard = self._shards.get(shard_id)
        if shard is None:
            shard = self._shards[shard_id] = Shard(self._host, shard_id)
            logger.debug("region %s: hosting shard %s", self.type_name, shard_id)
            store = None
            if self.settings.remember_entities:
                store = RememberStore(
                    self._services.replicator, self.type_name, shard_id, self.settings
                )
            lease = (
                None
                if self._lease_factory is None
                else self._lease_factory(self.type_name, shard_id)
            )
            if store is not None or lease is not None:
                shard.start(self._nursery, store=store, lease=lease)
        self._running[shard_id] = shard

    def _stop_shard(self, shard_id: ShardId) -> None:
        shard = self._shards.get(shard_id)
        self._running.pop(shard_id, None)
        if shard is None:
            self._apply(self._core.shard_stopped(shard_id, trio.current_time()))
            return
        # Entities that have not stopped are stopped by force a little before the coordinator
        # gives the hand-off up, so that ShardStopped can still reach it in time.
        grace = self.settings.handoff_timeout * FORCED_STOP_FRACTION
        self._stop_deadlines[shard_id] = trio.current_time() + grace
        logger.debug("region %s: handing off shard %s", self.type_name, shard_id)
        if self._services.listeners:
            text = f"shard {shard_id} handed off from this node: stopping its entities"
            event = ShardingEvent("hand-off", self.type_name, text)
            tell_listeners(self._services.listeners, event)
        waiting = shard.take_pending()  # it was still reading its remembered entities
        shard.stop_all(lambda: self._shard_stopped(shard_id))
        for entity_id, message, reply in waiting:
            self._route_nowait(shard_id, entity_id, message, reply)

    def _end_incarnations(self) -> None:
        """The node stopped: every incarnation of this region's shards is gone."""
        for shard in self._shards.values():
            shard.end_incarnations()

    def _shard_stopped(self, shard_id: ShardId) -> None:
        shard = self._shards.pop(shard_id, None)
        if shard is not None:
            shard.close()
        if shard is not None and shard.store is not None:
            shard.store.close()
        if shard is not None and shard.lease is not None:
            self._nursery.start_soon(_release, shard.lease, f"{self.type_name}/{shard_id}")
        self._stop_deadlines.pop(shard_id, None)
        self._apply(self._core.shard_stopped(shard_id, trio.current_time()))

    def _flush(self, shard_id: ShardId, home: UniqueAddress, deliveries: list[Delivery]) -> None:
        if home == self._self_node:
            shard = self._running[shard_id]
            for entity_id, message, reply in deliveries:
                shard.deliver(entity_id, message, reply)
            return
        queue = self._flushing.get(shard_id)
        if queue is not None:
            queue.extend(deliveries)
            return
        # What fits in the send queue goes now, without a pass through a task: a first message
        # to a new shard waits in the buffer for exactly this. The rest, in order, goes from
        # _send_flushed, which waits for room.
        for sent, (entity_id, message, reply) in enumerate(deliveries):
            try:
                self._transport.send_nowait(
                    home, self._delivery(shard_id, entity_id, message, reply)
                )
            except SendQueueFull:
                self._flushing[shard_id] = collections.deque(deliveries[sent:])
                self._nursery.start_soon(self._send_flushed, shard_id, home)
                return
            except (TransportClosed, SerializationError) as exc:
                self._dropped([(entity_id, message, reply)], DropReason.NOT_SENT, str(exc))
                continue
            self._sent_remote += 1

    async def _send_flushed(self, shard_id: ShardId, home: UniqueAddress) -> None:
        queue = self._flushing[shard_id]
        try:
            while queue:
                entity_id, message, reply = queue.popleft()
                delivery = self._delivery(shard_id, entity_id, message, reply)
                try:
                    if await self._send_waiting(home, delivery):
                        self._sent_remote += 1
                    else:
                        self._dropped(
                            [(entity_id, message, reply)],
                            DropReason.SEND_QUEUE_FULL,
                            f"{home} is not taking more",
                        )
                except (TransportClosed, SerializationError) as exc:
                    self._dropped([(entity_id, message, reply)], DropReason.NOT_SENT, str(exc))
                if self._core.homes.get(shard_id) != home:
                    break  # the shard is moving again: what is left waits for its new home
        finally:
            del self._flushing[shard_id]
            for entity_id, message, reply in queue:
                self._route_nowait(shard_id, entity_id, message, reply)
            self._unblocked.set()
            self._unblocked = trio.Event()

    def _dropped(self, deliveries: list[Delivery], cause: DropReason, reason: str) -> None:
        self._lost([reply for _, _, reply in deliveries], cause, reason)

    def _lost(self, replies: list[Reply | None], cause: DropReason, reason: str) -> None:
        """Say that messages were dropped, one per item of ``replies``, and fail their asks.

        ``cause`` picks the error the asks fail with; ``reason`` is what they and the log say.
        """
        if not replies:
            return
        if cause is DropReason.NOT_SENT:
            # The transport refused them: counted here. The core counted its own drops (its
            # Drop effects) and the send queue's as they happened.
            self._core.count_dropped(len(replies), cause)
        logger.warning("region %s: %d message(s) dropped: %s", self.type_name, len(replies), reason)
        error = "p2pshard.BufferOverflow" if cause.overflow else "p2pshard.ShardingError"
        for reply in replies:
            if reply is not None:
                reply.fail(error, reason)

    # -- entities ---------------------------------------------------------------------------

    def _entity_started(self, context: EntityContext) -> None:
        self._entities += 1
        self._activations += 1
        lru = self._lru
        if lru is None:
            return
        lru[context] = None
        limit = self.settings.active_entity_limit
        assert limit is not None
        excess = len(lru) - limit
        if excess > 0:
            for oldest in list(itertools.islice(lru, excess + 8)):
                if excess <= 0:
                    break
                if oldest is not context and oldest.state is EntityState.ACTIVE:
                    oldest.passivate()
                    lru.pop(oldest, None)  # stopping: no longer counts against the limit
                    excess -= 1

    def _entity_stopped(self, context: EntityContext) -> None:
        self._entities -= 1
        if self._lru is not None:
            self._lru.pop(context, None)

    # -- timers and the cluster -------------------------------------------------------------

    def _idle_scan_interval(self) -> float:
        idle = self.settings.passivate_idle_after
        return float("inf") if idle is None else max(idle / 4, 0.01)

    def _next_deadline(self) -> float:
        """When the timer loop wakes next: the core's deadline, or one of the shell's own."""
        deadline = min(self._core.next_deadline(), self._next_idle_scan, self._next_restart)
        if self._stop_deadlines:
            deadline = min(deadline, min(self._stop_deadlines.values()))
        return deadline

    def _wake_timer(self) -> None:
        """An entity waits to restart: the timer loop asks the shards when to wake."""
        self._next_restart = -float("inf")
        # wake(), not poke(): the loop may be in _tick, about to overwrite _next_restart.
        self._timer.wake()

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cluster = self._services.cluster
        async with trio.open_nursery() as nursery, cluster.subscribe() as events:
            self._apply(self._core.tick(trio.current_time()))  # the first Register
            task_status.started()

            async def follow_cluster() -> None:
                async for _ in events:
                    members = {m.node: m.status for m in cluster.members}
                    oldest = _singleton_host(cluster, self.role)
                    self._apply(self._core.cluster_changed(oldest, members, trio.current_time()))
                # The subscription ends when this node is out of the cluster: nothing more to do.
                self._lifecycle.closed = True

            nursery.start_soon(follow_cluster)
            nursery.start_soon(self._batcher)
            while True:
                self._tick(await self._timer.wait())

    def _tick(self, now: float) -> None:
        for shard_id, deadline in list(self._stop_deadlines.items()):
            if now >= deadline:
                shard = self._shards.get(shard_id)
                if shard is not None:
                    shard.force_stop()
                self._stop_deadlines.pop(shard_id, None)
        idle = self.settings.passivate_idle_after
        scan = now >= self._next_idle_scan
        if scan:
            self._next_idle_scan = now + self._idle_scan_interval()
        due = float("inf")
        for shard in list(self._shards.values()):
            due = min(due, shard.tick(now, now - idle if scan and idle is not None else None))
        self._next_restart = due
        self._apply(self._core.tick(now))

    # -- shutdown ---------------------------------------------------------------------------

    async def _graceful_shutdown(self) -> None:
        self._apply(self._core.graceful_shutdown(trio.current_time()))
        await self._stopped_event.wait()


async def _release(lease: ShardLease, what: str) -> None:
    try:
        await lease.release()
    except Exception as exc:  # the lease expires by itself; say so and go on
        logger.warning("shard %s: lease not released: %s", what, exc)


def _singleton_host(cluster: Any, role: str | None) -> UniqueAddress | None:
    member = cluster.singleton_host(role)
    return None if member is None else member.node


def _no_factory(ctx: EntityContext) -> Any:  # pragma: no cover - a proxy hosts no shards
    raise ShardingError(f"a proxy of {ctx.type_name!r} cannot host entities")


def coordinator_name(type_name: str) -> str:
    """The singleton name of ``type_name``'s coordinator."""
    return f"sharding/{type_name}"
