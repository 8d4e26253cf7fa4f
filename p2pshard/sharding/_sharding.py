"""``node.sharding``: start entity types, run their coordinators, inspect and shut them down.

Theory of operation. :meth:`Sharding.start` makes a :class:`ShardRegion` for an entity type and
registers its coordinator as a cluster singleton (``sharding/<type>``) on every node that may
host it, so the coordinator (a :class:`ShardCoordinator`, see ``_coordinator.py``) runs on the
oldest member of the role.

Every sharding message a node receives comes through :meth:`Sharding.handle`, which passes it to
the region of its entity type; asks made here wait in a table keyed by request id, which the
answer (:class:`EntityReply`) finds wherever the entity ran.

Shutdown: leaving ``open_node`` first shuts every region down gracefully (their shards are handed
off), then leaves the cluster. A node that starts leaving some other way (``cluster.leave()``)
starts the same hand-off when it sees itself Leaving, and waits for it (bounded) before it exits.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
from collections.abc import Callable

import attrs
import trio

from crdt import (
    GetFailure,
    ReadLocal,
    ReadMajority,
    Replicator,
)
from membership import (
    Cluster,
    ConfigurationError,
    Envelope,
    SendQueueFull,
    SingletonContext,
    Singletons,
    Transport,
    TransportClosed,
    UniqueAddress,
)

from .._tracing import tracing_for
from ..leases._lease import ShardLease, ShardLeaseFactory
from ..leases._leases import Leases
from ._allocation import (
    LeastShardAllocationStrategy,
    ShardAllocationStrategy,
    ShardId,
)
from ._asks import AskTable
from ._coordinator import ShardCoordinator, coordinator_key
from ._coordinator_core import CoordinatorCounters, CoordinatorStatistics
from ._coordinator_state import CoordinatorState
from ._entity import check_entity_factory
from ._extractor import MessageExtractor
from ._message_check import MessageCheck
from ._protocol import (
    ENTRY_FIELDS,
    BeginHandOff,
    BeginHandOffAck,
    EntityDeliveries,
    EntityDelivery,
    EntityReply,
    GetRegionStats,
    HandOff,
    HostShard,
    RegionStats,
    RegisterAck,
    RegisterRefused,
    ShardHome,
)
from ._region import ShardRegion, ShardRegionState, coordinator_name
from ._services import (
    IncarnationObserver,
    Lifecycle,
    RegionServices,
    ShardingListener,
)
from ._settings import ShardingSettings
from ._shard import EntityFactory

logger = logging.getLogger("p2pshard.sharding")


@attrs.frozen
class ClusterShardingStats:
    """The regions that host an entity type, each with its shards; Akka's ``ClusterShardingStats``.

    What :meth:`Sharding.cluster_stats` returns. The regions are those registered with the
    type's coordinator: nodes that host the type. Proxies host nothing and are not regions, and
    a node that never started the type is not one either; neither is ever listed.
    """

    type_name: str
    """The entity type."""
    regions: dict[UniqueAddress, dict[str, int]]
    """Every region that answered: shard id → number of active entities (``{}``: a region that
    hosts no shard now, a node that joined after the shards were allocated, say)."""
    failed: frozenset[UniqueAddress]
    """The regions that did not answer within the timeout (unreachable, stopping, overloaded):
    hosting regions whose shards are unknown, never in ``regions``."""


class _StatsRequest:
    def __init__(self, waiting: set[UniqueAddress]) -> None:
        self.waiting = waiting
        self.answers: dict[UniqueAddress, dict[str, int]] = {}
        self.done = trio.Event()


class Sharding:
    """``node.sharding``: entity types on this node. See the module docstring.

    Example:
        >>> async def main(node: Node) -> None:
        ...     counters = await node.sharding.start(
        ...         "Counter", Counter, extractor=HashExtractor(100)
        ...     )
        ...     await counters.entity_ref("counter-1").tell(Increment())
    """

    def __init__(
        self,
        transport: Transport,
        cluster: Cluster,
        singletons: Singletons,
        replicator: Replicator,
        nursery: trio.Nursery,
        rng: random.Random,
        leases: Leases | None = None,
        removal_margin: float = 0.0,
        tracer_provider: object | None = None,
    ) -> None:
        self._transport = transport
        self._tracer_provider = tracer_provider
        """None: OpenTelemetry's global one, as it is when each entity type starts."""
        # The default down-removal margin of entity types without shard leases.
        self._removal_margin = removal_margin
        self._leases = leases
        self._cluster = cluster
        self._singletons = singletons
        self._replicator = replicator
        self._nursery = nursery
        self._rng = rng
        self._regions: dict[str, ShardRegion] = {}
        self._coordinator_counters: dict[str, CoordinatorCounters] = {}
        self._asks = AskTable(transport, rng.getrandbits(32) + 1)
        self._stats_ids = itertools.count(1)
        self._stats: dict[int, _StatsRequest] = {}
        self._message_check = MessageCheck(transport)
        self._lifecycle = Lifecycle()
        self._observers: list[IncarnationObserver] = []
        self._listeners: list[ShardingListener] = []
        self._services = RegionServices(
            transport=transport,
            cluster=cluster,
            singletons=singletons,
            replicator=replicator,
            asks=self._asks,
            check_message=self._message_check.check,
            observers=self._observers,
            lifecycle=self._lifecycle,
            listeners=self._listeners,
        )
        cluster.add_exiting_task(self._shutdown_on_exit, first=True)

    def observe(self, observer: IncarnationObserver) -> None:
        """Tell ``observer`` of every entity incarnation that starts or ends on this node.

        For invariant checkers (``p2pshard.testing``): an incarnation starts when the factory
        makes the entity object and ends when it is dropped (stopped, crashed, or its shard
        lost its lease). The calls are synchronous, on the path of the entity: keep them cheap.
        """
        self._observers.append(observer)

    def listen(self, listener: ShardingListener) -> Callable[[], None]:
        """Tell ``listener`` of the hand-offs and rebalance rounds seen on this node.

        A region tells of each shard it stops for a hand-off; the coordinator, where it runs,
        of each round that moves shards and each hand-off it ends. Not called per message; the
        calls are synchronous, so keep them cheap. Returns the function that stops them.
        """
        self._listeners.append(listener)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return stop

    # -- starting ---------------------------------------------------------------------------

    async def start(
        self,
        type_name: str,
        entity_factory: EntityFactory,
        *,
        extractor: MessageExtractor,
        settings: ShardingSettings | None = None,
        allocation_strategy: ShardAllocationStrategy | None = None,
        stop_message: object = None,
        role: str | None = None,
        shard_lease: ShardLeaseFactory | None = None,
    ) -> ShardRegion:
        """Start entity type ``type_name`` on this node and return its region.

        Every node that hosts the type calls ``start`` with the same extractor (number of
        shards) and role; a node without ``role`` gets a proxy instead, as Akka does.
        ``entity_factory`` makes an entity from its :class:`EntityContext` (the class itself,
        usually). ``stop_message`` is what an entity receives before it is stopped for a
        hand-off or passivation (None: stopped without a message). With
        ``settings.use_lease`` each shard holds its lease from the node's lease backend before
        its entities start; ``shard_lease`` makes another lease per shard instead (see
        ``p2pshard.leases._lease``).

        Example:
            >>> async def main(node: Node) -> None:
            ...     rooms = await node.sharding.start(
            ...         "Room", Room, extractor=HashExtractor(100), stop_message=Shutdown()
            ...     )

        Raises:
            ConfigurationError: the type is already started here; an invalid name, factory or
                extractor; an entity class whose ``receive`` is not ``async def`` (when the
                factory is the class, or a function annotated to return it; otherwise the first
                entity made fails so); leases asked for on a node without a lease backend.
        """
        self._check_new(type_name, extractor)
        if not callable(entity_factory):
            raise ConfigurationError(
                f"entity_factory of {type_name!r} must be callable (the entity class, say), "
                f"not {type(entity_factory).__name__}"
            )
        check_entity_factory(type_name, entity_factory)
        if stop_message is not None:
            self._message_check.check(stop_message)
        settings = settings or ShardingSettings()
        if role is not None and role not in self._cluster.self_member.roles:
            logger.info(
                "%s: no role %r here: %r starts as a proxy",
                self._transport.local_address,
                role,
                type_name,
            )
            return await self._start_region(type_name, None, extractor, settings, None, role)
        strategy = allocation_strategy or LeastShardAllocationStrategy()
        number_of_shards = extractor.number_of_shards

        coordinator_lease = None
        if settings.coordinator_use_lease:
            leases = self._need_leases(type_name, "coordinator_use_lease")
            coordinator_lease = leases.lease(
                f"{leases.cluster_name}-singleton-{coordinator_name(type_name)}"
            )
        if shard_lease is None and settings.use_lease:
            leases = self._need_leases(type_name, "use_lease")

            def shard_lease(type_name: str, shard_id: ShardId) -> ShardLease:
                return leases.shard_lease(type_name, shard_id)

        margin = settings.down_removal_margin
        if margin is None:
            margin = 0.0 if shard_lease is not None else self._removal_margin

        self._coordinator_counters.setdefault(type_name, CoordinatorCounters())

        async def coordinator(ctx: SingletonContext) -> None:
            await self._run_coordinator(
                ctx, type_name, number_of_shards, settings, strategy, margin
            )

        await self._singletons.start(
            coordinator_name(type_name), coordinator, role=role, lease=coordinator_lease
        )
        return await self._start_region(
            type_name, entity_factory, extractor, settings, stop_message, role, shard_lease
        )

    async def start_proxy(
        self,
        type_name: str,
        *,
        extractor: MessageExtractor,
        settings: ShardingSettings | None = None,
        role: str | None = None,
    ) -> ShardRegion:
        """Start a proxy of ``type_name``: it sends to the entities and hosts none.

        Raises:
            ConfigurationError: the type is already started here; an invalid extractor.
        """
        self._check_new(type_name, extractor)
        return await self._start_region(
            type_name, None, extractor, settings or ShardingSettings(), None, role
        )

    def _need_leases(self, type_name: str, setting: str) -> Leases:
        if self._leases is None:
            raise ConfigurationError(
                f"entity type {type_name!r} has ShardingSettings.{setting} on, but this node has "
                "no lease backend: set [lease] backend (and path or endpoints) in its config"
            )
        return self._leases

    def _check_new(self, type_name: str, extractor: object) -> None:
        if not isinstance(type_name, str) or not type_name or "/" in type_name:
            raise ConfigurationError(
                f"entity type name {type_name!r} must be a non-empty string without '/'"
            )
        if type_name in self._regions:
            raise ConfigurationError(f"entity type {type_name!r} is already started on this node")
        shards = getattr(extractor, "number_of_shards", None)
        if (
            not all(
                callable(getattr(extractor, name, None))
                for name in ("entity_id", "entity_message", "shard_id")
            )
            or not isinstance(shards, int)
            or shards < 1
        ):
            raise ConfigurationError(
                f"the extractor of {type_name!r} must provide number_of_shards (a positive int), "
                "entity_id, entity_message and shard_id; HashExtractor(n) does"
            )
        if self._lifecycle.closed:
            raise ConfigurationError("sharding on this node has shut down")

    async def _start_region(
        self,
        type_name: str,
        factory: EntityFactory | None,
        extractor: MessageExtractor,
        settings: ShardingSettings,
        stop_message: object,
        role: str | None,
        shard_lease: ShardLeaseFactory | None = None,
    ) -> ShardRegion:
        region = ShardRegion(
            self._services,
            type_name,
            factory,
            extractor,
            settings,
            stop_message,
            role,
            self._nursery,
            shard_lease,
            tracing_for(self._tracer_provider, type_name),
        )
        self._regions[type_name] = region
        await self._nursery.start(region._run)
        return region

    # -- inspection -------------------------------------------------------------------------

    def region(self, type_name: str) -> ShardRegion:
        """The region (or proxy) of ``type_name`` on this node.

        Raises:
            ConfigurationError: the type was not started here.
        """
        region = self._regions.get(type_name)
        if region is None:
            raise ConfigurationError(
                f"entity type {type_name!r} is not started on this node "
                f"(started: {sorted(self._regions) or 'none'})"
            )
        return region

    @property
    def type_names(self) -> frozenset[str]:
        """The entity types started on this node."""
        return frozenset(self._regions)

    def region_state(self, type_name: str) -> ShardRegionState:
        """The shards of ``type_name`` hosted on this node, with their active entity ids."""
        return self.region(type_name).state()

    def coordinator_statistics(self, type_name: str) -> CoordinatorStatistics | None:
        """What ``type_name``'s coordinator counted on this node: rebalance rounds, hand-offs.

        The coordinator runs on one node at a time (the oldest of the role) and moves when that
        node leaves; the counts here are those of every incarnation it had on this node. None
        when this node cannot run it (the type runs here as a proxy).

        Raises:
            ConfigurationError: the type was not started here.
        """
        self.region(type_name)
        counters = self._coordinator_counters.get(type_name)
        return None if counters is None else counters.statistics(type_name)

    async def cluster_stats(
        self,
        type_name: str,
        *,
        timeout: float,  # noqa: ASYNC109 - the API
    ) -> ClusterShardingStats:
        """The shards and active entity counts of every region that hosts ``type_name``.

        As Akka's ``GetClusterShardingStats``: the regions are those registered with the type's
        coordinator, read from its replicated state (from a majority of the replicas within half
        of ``timeout``; this node's copy when no majority answers in time). Each is asked for
        its shards; whichever does not answer within ``timeout`` in all is in ``failed``, not in
        ``regions``. Proxies (``start_proxy``, and ``start`` on a node without the type's role)
        and nodes that never started the type are not regions and are never listed. A region
        that hosts no shard is listed with ``{}``. For tests and monitoring: the answer is a
        moment's picture, as shards move.

        Example:
            >>> async def show(node: Node) -> None:
            ...     stats = await node.sharding.cluster_stats("Counter", timeout=2)
            ...     for region, shards in sorted(stats.regions.items()):
            ...         print(region.name, len(shards), sum(shards.values()))

        Raises:
            ConfigurationError: the type is not started on this node (neither a region nor a
                proxy of it runs here).
            ValueError: ``timeout`` is not a number of seconds above 0.
            ReplicationError: the coordinator's state cannot be read here (this node's
                replicator has stopped: the node is stopping).
        """
        self.region(type_name)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a number of seconds above 0")
        deadline = trio.current_time() + timeout
        regions = await self._coordinator_regions(type_name, timeout / 2)
        rid = next(self._stats_ids)
        request = _StatsRequest(set(regions))
        self._stats[rid] = request
        try:
            for node in sorted(regions):
                with contextlib.suppress(SendQueueFull, TransportClosed):
                    self._transport.send_nowait(
                        node, GetRegionStats(type_name=type_name, request_id=rid)
                    )
            if request.waiting:
                with trio.move_on_at(deadline):
                    await request.done.wait()
            else:
                await trio.lowlevel.checkpoint()
        finally:
            del self._stats[rid]
        return ClusterShardingStats(type_name, dict(request.answers), frozenset(request.waiting))

    async def _coordinator_regions(
        self,
        type_name: str,
        timeout: float,  # noqa: ASYNC109 - the read's own
    ) -> frozenset[UniqueAddress]:
        """The regions registered with the coordinator of ``type_name``, as its state says."""
        key = coordinator_key(type_name)
        try:
            doc = await self._replicator.get(key, ReadMajority(timeout=timeout))
        except GetFailure:  # no majority in time: what this node holds (it merged what came)
            doc = await self._replicator.get(key, ReadLocal())
        if doc is None:
            return frozenset()
        return frozenset(CoordinatorState.from_document(doc).regions)

    # -- shutdown ---------------------------------------------------------------------------

    async def graceful_shutdown(self, type_name: str) -> None:
        """Hand off every shard of ``type_name`` hosted here, then stop its region.

        Returns when the region stopped; bound it with a trio timeout if the coordinator may
        be unreachable.
        """
        await self.region(type_name)._graceful_shutdown()

    async def shutdown(self) -> None:
        """Gracefully shut down every region on this node (concurrently). Unbounded: wrap it."""
        async with trio.open_nursery() as nursery:
            for region in self._regions.values():
                nursery.start_soon(region._graceful_shutdown)

    async def _shutdown_on_exit(self) -> None:
        with trio.move_on_after(10):
            await self.shutdown()

    def close(self) -> None:
        """Stop accepting messages (the node is stopping)."""
        self._lifecycle.closed = True

    def end_incarnations(self) -> None:
        """The node stopped, and none of its tasks runs any more: its entities are gone.

        Observers hear of every incarnation that was still live, before the node gives its
        shard leases back (then another node may start them).
        """
        for region in self._regions.values():
            region._end_incarnations()

    # -- asks and messages ------------------------------------------------------------------

    def handle(self, envelope: Envelope) -> bool:
        """Take a sharding message from the transport; False if it is not one."""
        sender, message, _ = envelope
        if type(message) is EntityDelivery:
            # Nearly every message: _on_delivery's common case spelled out here for speed
            # (test_region_copies.py checks that both do the same).
            region = self._regions.get(message.type_name)
            if region is not None:
                region._on_delivery(sender, message)
            else:
                self._on_delivery(sender, message)
            return True
        match message:
            case EntityDelivery():  # a subclass (messages are never subclassed)
                self._on_delivery(sender, message)
            case EntityReply():
                self._asks.complete(message)
            case EntityDeliveries():
                region = self._regions.get(message.type_name)
                if region is not None:
                    region._on_deliveries(sender, message)
                else:
                    self._no_region_for_batch(sender, message)
            case (
                RegisterAck()
                | RegisterRefused()
                | ShardHome()
                | HostShard()
                | BeginHandOff()
                | BeginHandOffAck()
                | HandOff()
            ):  # from the coordinator, or a relayed acknowledgement
                region = self._regions.get(message.type_name)
                if region is not None:
                    region._on_control(sender, message)
            case GetRegionStats(type_name=type_name, request_id=request_id):
                region = self._regions.get(type_name)
                counts = {} if region is None else region.shard_entity_counts()
                stats = RegionStats(type_name=type_name, request_id=request_id, shards=counts)
                with contextlib.suppress(SendQueueFull, TransportClosed):
                    self._transport.send_nowait(sender, stats)
            case RegionStats(request_id=request_id, shards=shards):
                request = self._stats.get(request_id)
                if request is not None and sender in request.waiting:
                    request.waiting.discard(sender)
                    request.answers[sender] = dict(shards)
                    if not request.waiting:
                        request.done.set()
            case _:
                return False
        return True

    def _on_delivery(self, sender: UniqueAddress, delivery: EntityDelivery) -> None:
        region = self._regions.get(delivery.type_name)
        if region is not None:
            region._on_delivery(sender, delivery)
        elif delivery.request_id:
            self._not_started(delivery.type_name, delivery.origin or sender, delivery.request_id)

    def _no_region_for_batch(self, sender: UniqueAddress, batch: EntityDeliveries) -> None:
        entries = batch.entries
        for i in range(3, len(entries) - 1, ENTRY_FIELDS):  # each entry's request id and origin
            request_id, origin = entries[i], entries[i + 1]
            if type(request_id) is int and request_id:
                to = origin if type(origin) is UniqueAddress else sender
                self._not_started(batch.type_name, to, request_id)

    def _not_started(self, type_name: str, origin: UniqueAddress, request_id: int) -> None:
        """Fail an ask for an entity type this node has not started."""
        self._asks.reply(
            origin,
            EntityReply(
                request_id=request_id,
                error_type="p2pshard.ShardingError",
                error_text=f"entity type {type_name!r} is not started on "
                f"{self._transport.local_address}",
            ),
        )

    # -- the coordinator --------------------------------------------------------------------

    async def _run_coordinator(
        self,
        ctx: SingletonContext,
        type_name: str,
        number_of_shards: int,
        settings: ShardingSettings,
        strategy: ShardAllocationStrategy,
        removal_margin: float,
    ) -> None:
        coordinator = ShardCoordinator(
            type_name=type_name,
            number_of_shards=number_of_shards,
            settings=settings,
            strategy=strategy,
            removal_margin=removal_margin,
            transport=self._transport,
            cluster=self._cluster,
            replicator=self._replicator,
            counters=self._coordinator_counters[type_name],
            listeners=self._listeners,
        )
        await coordinator.run(ctx)
