"""``ShardCoordinator``: the trio shell of one entity type's shard coordinator.

Theory of operation. The coordinator runs as the cluster singleton ``sharding/<type>`` on the
oldest member of the role. The decisions are :class:`ShardCoordinatorCore`'s; this shell feeds it
the regions' commands (they come through the singleton proxy, handled as they arrive with no pass
through a task, so a first message to a new shard waits only for its GetShardHome), the
cluster's changes and the time, and carries out its effects: messages go straight to the
regions' nodes, and each batch of domain events is written to the replicator under
``sharding/<type>/coordinator`` in one WriteMajorityPlus, retried until it succeeds (each failure
logged). Before anything else the state is read with a ReadMajorityPlus.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence

import trio

from crdt import (
    GetFailure,
    PendingUpdate,
    ReadMajorityPlus,
    ReplicationError,
    Replicator,
    WriteMajorityPlus,
)
from membership import (
    Cluster,
    SendQueueFull,
    SingletonContext,
    SingletonRequest,
    Transport,
    TransportClosed,
    UniqueAddress,
)
from membership.internal import CoreTimer

from ._allocation import ClusterView, ShardAllocationStrategy, ShardId
from ._coordinator_core import (
    CoordinatorCounters,
    CoordinatorEffect,
    SendTo,
    ShardCoordinatorCore,
    UpdateState,
)
from ._coordinator_state import CoordinatorState, DomainEvent, apply_events, describe_events
from ._protocol import COORDINATOR_COMMANDS
from ._retry import until_done
from ._services import ShardingEvent, ShardingListener, tell_listeners
from ._settings import ShardingSettings

logger = logging.getLogger("p2pshard.sharding")


def coordinator_key(type_name: str) -> str:
    """The replicator key holding ``type_name``'s coordinator state."""
    return f"sharding/{type_name}/coordinator"


class ShardCoordinator:
    """One entity type's coordinator on this node, while this node runs its singleton.

    Args:
        type_name: The entity type.
        number_of_shards: The type's number of shards (regions with another are refused).
        settings: The type's settings (allocation, hand-off, the state's reads and writes).
        strategy: Where shards go, and which move in a rebalance.
        removal_margin: Seconds a downed region's shards wait before they move (see
            :class:`ShardCoordinatorCore`).
        transport: Sends the coordinator's messages to the regions.
        cluster: The membership the coordinator follows.
        replicator: Holds the coordinator's state.
        counters: Where it counts rebalance rounds and hand-offs (a new one by default).
        listeners: Told of each rebalance round that moves shards and each hand-off's end.
    """

    def __init__(
        self,
        *,
        type_name: str,
        number_of_shards: int,
        settings: ShardingSettings,
        strategy: ShardAllocationStrategy,
        removal_margin: float,
        transport: Transport,
        cluster: Cluster,
        replicator: Replicator,
        counters: CoordinatorCounters | None = None,
        listeners: Sequence[ShardingListener] = (),
    ) -> None:
        self.type_name = type_name
        self.core = ShardCoordinatorCore(
            type_name,
            transport.local_address,
            number_of_shards,
            settings,
            strategy,
            trio.current_time(),
            removal_margin,
            counters,
        )
        self._settings = settings
        self._transport = transport
        self._cluster = cluster
        self._replicator = replicator
        self._key = coordinator_key(type_name)
        self._listeners = listeners
        self._moving: dict[ShardId, UniqueAddress] = {}  # hand-offs the listeners were told of
        self._timer = CoreTimer(self.core.next_deadline)
        self._nursery: trio.Nursery | None = None
        self._read = ReadMajorityPlus(
            additional=settings.read_majority_plus,
            min_cap=settings.majority_min_cap,
            timeout=settings.state_timeout,
        )
        self._write = WriteMajorityPlus(
            additional=settings.write_majority_plus,
            min_cap=settings.majority_min_cap,
            timeout=settings.state_timeout,
        )

    async def run(self, ctx: SingletonContext) -> None:
        """Serve as the coordinator until the singleton stops (cancelled then)."""
        counters = self.core.counters
        counters.running = True
        try:
            await self._serve(ctx)
        finally:
            counters.running = False

    async def _serve(self, ctx: SingletonContext) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._follow_cluster)
            nursery.start_soon(self._load)
            nursery.start_soon(self._run_timer)
            logger.info(
                "%s: coordinator of %r started", self._transport.local_address, self.type_name
            )
            await ctx.serve(self._receive)

    # -- inputs -----------------------------------------------------------------------------

    def _receive(self, request: SingletonRequest) -> None:
        message = request.message
        if not isinstance(message, COORDINATOR_COMMANDS) or message.type_name != self.type_name:
            logger.warning(
                "coordinator %s: ignoring %s from %s: not a coordinator command for it",
                self.type_name,
                type(message).__name__,
                request.sender,
            )
            return
        self._apply(self.core.receive(request.sender, message, trio.current_time()))

    def _view(self) -> ClusterView:
        members = self._cluster.members
        return ClusterView(
            members={m.node: m.status for m in members},
            unreachable=frozenset(m.node for m in self._cluster.unreachable),
            app_versions={m.node: m.app_version for m in members},
        )

    async def _follow_cluster(self) -> None:
        async with self._cluster.subscribe() as events:
            self._apply(self.core.set_cluster(self._view(), trio.current_time()))
            async for _ in events:
                self._apply(self.core.set_cluster(self._view(), trio.current_time()))

    async def _load(self) -> None:
        doc = await until_done(
            lambda: self._replicator.get(self._key, self._read),
            f"coordinator {self.type_name}: reading its state",
            logger,
            retry_on=GetFailure,
        )
        remember = self._settings.remember_entities
        state = (
            CoordinatorState(remember_entities=remember)
            if doc is None
            else CoordinatorState.from_document(doc, remember_entities=remember)
        )
        now = trio.current_time()
        self._apply(self.core.set_cluster(self._view(), now))
        self._apply(self.core.state_loaded(state, now))

    async def _run_timer(self) -> None:
        while True:
            now = await self._timer.wait()
            self._apply(self.core.tick(now), cause="rebalance")

    # -- effects ----------------------------------------------------------------------------

    def _apply(self, effects: list[CoordinatorEffect], cause: str = "hand-off") -> None:
        for effect in effects:
            if isinstance(effect, SendTo):
                try:
                    self._transport.send_nowait(effect.to, effect.message)
                except (SendQueueFull, TransportClosed) as exc:
                    logger.warning(
                        "coordinator %s: %s to %s lost: %s",
                        self.type_name,
                        type(effect.message).__name__,
                        effect.to,
                        exc,
                    )
            elif isinstance(effect, UpdateState):
                assert self._nursery is not None
                started = self._start_write(effect.events)
                self._nursery.start_soon(self._write_events, effect.events, started)
        self._timer.poke()  # something may be due sooner than the timer sleeps
        if self._listeners:
            self._note_moves(cause)

    def _note_moves(self, cause: str) -> None:
        """Tell the listeners of hand-offs begun or ended since they were last told.

        Hand-offs begin in a rebalance round (``cause``: the timer's tick) or when a region
        shuts down; one ends when its shard is deallocated or when it is given up.
        """
        moving = self.core.rebalance_in_progress()
        if moving == self._moving.keys():
            return
        shards = self.core.state.shards
        began: dict[UniqueAddress, list[ShardId]] = {}
        for shard in sorted(moving - self._moving.keys()):
            owner = self._moving[shard] = shards[shard]
            began.setdefault(owner, []).append(shard)
        moved: dict[UniqueAddress, list[ShardId]] = {}
        stayed: dict[UniqueAddress, list[ShardId]] = {}
        for shard in sorted(self._moving.keys() - moving):
            owner = self._moving.pop(shard)
            (stayed if shards.get(shard) == owner else moved).setdefault(owner, []).append(shard)
        events = [
            ShardingEvent(
                "rebalance" if cause == "rebalance" else "hand-off",
                self.type_name,
                f"rebalance: moving {_shards(ids)} off {owner.name}"
                if cause == "rebalance"
                else f"handing off {_shards(ids)} of {owner.name}: its region is shutting down",
            )
            for owner, ids in began.items()
        ]
        events += [
            ShardingEvent("hand-off", self.type_name, f"{_shards(ids)} moved off {owner.name}")
            for owner, ids in moved.items()
        ]
        events += [
            ShardingEvent(
                "hand-off",
                self.type_name,
                f"hand-off of {_shards(ids)} from {owner.name} given up: timed out, or the "
                "region is gone",
            )
            for owner, ids in stayed.items()
        ]
        for event in events:
            tell_listeners(self._listeners, event)

    def _start_write(self, events: tuple[DomainEvent, ...]) -> PendingUpdate[None] | None:
        # Begun here, not in _write_events' task: the change leaves without waiting for a
        # scheduler pass (a first message to a new shard waits for this write).
        try:
            return self._replicator.start_update(
                self._key, lambda doc: apply_events(doc, events), self._write
            )
        except ReplicationError:
            return None  # _write_events tries again, as after any failed write

    async def _write_events(
        self, events: tuple[DomainEvent, ...], started: PendingUpdate[None] | None
    ) -> None:
        confirmed = False
        failure: Exception | None = None

        def on_confirmed() -> None:
            # Called by the replicator in the task that took the last acknowledgement: the
            # answers (a new shard's ShardHome) leave without waiting for this task.
            nonlocal confirmed, failure
            confirmed = True
            try:
                self._apply(self.core.state_updated(events, True, trio.current_time()))
            except Exception as exc:  # raised here instead, ending the coordinator
                failure = exc

        def attempt() -> Awaitable[None]:
            nonlocal started
            if started is not None:
                first, started = started, None
                if not first.done:  # only while awaited: a cancelled wait drops it
                    first.on_success(on_confirmed)
                return first.result()
            return self._replicator.update(
                self._key, lambda doc: apply_events(doc, events), self._write
            )

        what = f"coordinator {self.type_name}: writing {describe_events(events)}"
        await until_done(attempt, what, logger)
        if failure is not None:
            raise failure
        if not confirmed:
            self._apply(self.core.state_updated(events, True, trio.current_time()))


def _shards(ids: Sequence[ShardId], most: int = 12) -> str:
    """``shard 3`` or ``shards 1, 2, 5`` (the first ``most``, then how many more)."""
    if len(ids) == 1:
        return f"shard {ids[0]}"
    shown = ", ".join(ids[:most])
    more = f" and {len(ids) - most} more" if len(ids) > most else ""
    return f"{len(ids)} shards {shown}{more}"
