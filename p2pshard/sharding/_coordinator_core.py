"""The shard coordinator, sans-IO: Akka's ``ShardCoordinator`` in ddata mode.

Theory of operation. One coordinator per entity type runs as a cluster singleton on the oldest
member (of the role). It knows the regions and proxies, decides shard homes with the allocation
strategy and moves shards with rebalance workers. Its state (:class:`CoordinatorState`) lives in
the replicator; the shell reads it with a majority read before the core does anything
(:meth:`ShardCoordinatorCore.state_loaded`) and writes each domain event with a majority write
(:class:`UpdateState` effect, answered by :meth:`ShardCoordinatorCore.state_updated`). An event
is applied, and what depends on it is sent, only once its write succeeded; commands that arrive
meanwhile wait in order (Akka's stash). A failed write is tried again.

::

    LOADING ──state_loaded──▶ ACTIVE ⇄ UPDATING (one write in flight, commands wait)

*Batched writes.* Unlike Akka, which writes one event at a time, a write carries every event
decided since the previous one began (up to :data:`MAX_EVENTS_PER_WRITE`): when a write ends,
the waiting commands are handled in order, and their events go out together in the next write.
A cold start of ten thousand shards takes a few majority writes, not ten thousand in a row.
A waiting command is handled into the batch only if its answer cannot depend on an event of the
batch (a GetShardHome or ShardStopped for a shard no event of the batch touches, a ShardStarted,
a BeginHandOffAck); the first one that could waits, with everything behind it, for the batch's
write. Decisions are made against the state the pending events will make (a
:class:`StateDraft`, kept up to date event by event), so the allocation strategy sees the shards
allocated earlier in the same batch.

*Allocation.* GetShardHome for an unallocated shard allocates it once ``min_nr_of_members``
regions registered, among regions not shutting down; then the owner gets HostShard (resent every
``shard_start_timeout`` until ShardStarted) and the asker ShardHome.

*Rebalance.* Every ``rebalance_interval``, and one second after a new region registered (Akka
waits for the next interval), the strategy names shards to move; for each a worker
sends BeginHandOff to every region and proxy, waits for all acknowledgements (a region that is
gone counts as acknowledged), sends HandOff to the owner and waits for ShardStopped, then
deallocates the shard; whoever has not answered gets its BeginHandOff or HandOff again every
``retry_interval``. GetShardHome for a shard in hand-off waits and is answered when the
hand-off ends. A worker gives up after ``handoff_timeout`` (the shard stays where it was). Unlike
Akka, a worker whose owner region disappears completes at once (akka#29034, #27259): the region's
termination deallocates its shards.

*Catch-up rounds.* Unlike Akka, once every shard a round moved has a new home (or stayed, its
hand-off given up), the next round comes ``CATCH_UP_ROUND_DELAY`` later instead of at the next
interval. A round moves at most the strategy's limit (15 % of the shards by default), so when
ten nodes join ten, half the shards must move and Akka's rhythm takes four intervals; rounds that
follow each other as soon as the previous one has settled keep that limit on what moves at once
and fill the new nodes within one or two. Until the moved shards are asked for again (and so
allocated again) no catch-up round comes: counted without them, the regions they left would look
fuller than they are, and a round could move more than it should.

*Regions leaving.* A region's node that is removed or downed terminates the region: its shards
are deallocated (remembered as unallocated with remember-entities, to start elsewhere at once). A
region in graceful shutdown gets no new shards and all of its shards are handed off.

*Rolling upgrades.* While the regions' members run different ``app_version`` values, new
shards go only to regions of the newest version (the strategy chooses among those) and nothing
is rebalanced, as in Akka: shards handed off by nodes leaving for their upgrade move to
upgraded nodes, and no shard moves back and forth between the old and the new ones.

*Removal margin.* A downed node may still be running its entities: on the far side of a
partition it stops them only once its own split brain resolver decides, which can come a little
after this side's. So a region whose node was downed (rather than leaving, or stopping its
region) is terminated only ``removal_margin`` seconds after the coordinator first saw it gone
(Akka's ``down-removal-margin``). Meanwhile its shards keep their home: asks for them wait, as
during a hand-off, and no shard is allocated or moved to it. With shard leases the margin is
usually zero: a lease keeps a shard from running twice.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import attrs

from membership import HistogramSnapshot, LatencyHistogram, MemberStatus, UniqueAddress
from membership.internal import node_order

from ._allocation import ClusterView, ShardAllocationStrategy, ShardId
from ._coordinator_state import (
    CoordinatorState,
    DomainEvent,
    ShardHomeAllocated,
    ShardHomeDeallocated,
    ShardRegionProxyRegistered,
    ShardRegionProxyTerminated,
    ShardRegionRegistered,
    ShardRegionTerminated,
    StateDraft,
    describe_events,
)
from ._protocol import (
    BeginHandOff,
    BeginHandOffAck,
    CoordinatorCommand,
    CoordinatorMessage,
    GetShardHome,
    GracefulShutdownReq,
    HandOff,
    HostShard,
    RegionStopped,
    Register,
    RegisterAck,
    RegisterProxy,
    RegisterRefused,
    ShardHome,
    ShardStarted,
    ShardStopped,
)
from ._settings import ShardingSettings

logger = logging.getLogger("p2pshard.coordinator")

_GONE = frozenset({MemberStatus.DOWN, MemberStatus.REMOVED})
_DEPARTING = frozenset({MemberStatus.LEAVING, MemberStatus.EXITING})

MAX_EVENTS_PER_WRITE = 1000
"""Most domain events one write of the coordinator's state carries (a bound on its size: about
50 bytes each in the replicated document)."""

NEW_REGION_REBALANCE_DELAY = 1.0
"""Seconds after a new region registered before a rebalance round (if the interval is longer)."""

CATCH_UP_ROUND_DELAY = 1.0
"""Seconds after every shard a round moved has a new home before the next round (if the
interval is longer; see the module docstring)."""


HANDOFF_OUTCOMES: tuple[str, ...] = ("completed", "timed_out", "region_gone")
"""How a hand-off ends: the shard stopped and was deallocated; ``handoff_timeout`` passed (the
shard stays); the owner region was terminated meanwhile (its shards were deallocated with it)."""


@attrs.define(eq=False)
class CoordinatorCounters:
    """What the coordinators of one entity type counted on this node, over every incarnation.

    The coordinator is a singleton that moves: one object per entity type and node outlives its
    incarnations, so that what a node exports only ever grows.
    """

    running: bool = False
    """Whether the coordinator runs on this node now."""
    rebalance_rounds: int = 0
    """Rounds in which the allocation strategy was asked which shards to move."""
    handoffs: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(HANDOFF_OUTCOMES, 0))
    """Hand-offs ended, by outcome (:data:`HANDOFF_OUTCOMES`)."""
    handoff_seconds: LatencyHistogram = attrs.Factory(LatencyHistogram)
    """Seconds from BeginHandOff to the shard's deallocation, of the completed hand-offs."""

    def statistics(self, type_name: str) -> CoordinatorStatistics:
        """A frozen snapshot."""
        return CoordinatorStatistics(
            type_name=type_name,
            running=self.running,
            rebalance_rounds=self.rebalance_rounds,
            handoffs=dict(self.handoffs),
            handoff_seconds=self.handoff_seconds.snapshot(),
        )


@attrs.frozen(kw_only=True)
class CoordinatorStatistics:
    """What an entity type's coordinator counted on this node (``Sharding.coordinator_statistics``).

    Attributes:
        type_name: the entity type.
        running: whether its coordinator runs on this node now.
        rebalance_rounds: rounds in which the allocation strategy was asked which shards to move.
        handoffs: hand-offs ended, by outcome: ``completed``, ``timed_out``, ``region_gone``.
        handoff_seconds: seconds from BeginHandOff to the deallocation, of completed hand-offs.
    """

    type_name: str
    running: bool
    rebalance_rounds: int
    handoffs: dict[str, int]
    handoff_seconds: HistogramSnapshot


class CoordinatorPhase(enum.Enum):
    """Where the coordinator is in its life."""

    LOADING = "loading"
    ACTIVE = "active"
    UPDATING = "updating"


@attrs.frozen
class SendTo:
    """Effect: send ``message`` to the region (or proxy) on node ``to``."""

    to: UniqueAddress
    message: CoordinatorMessage


@attrs.frozen
class UpdateState:
    """Effect: write ``events``, in order and in one write, then call ``state_updated``."""

    events: tuple[DomainEvent, ...]


CoordinatorEffect: TypeAlias = SendTo | UpdateState


@attrs.define(eq=False)
class _Worker:
    shard: ShardId
    handoff_id: int
    owner: UniqueAddress
    waiting_acks: set[UniqueAddress]
    deadline: float
    resend_at: float
    handing_off: bool = False
    started: float = 0.0


@attrs.define(eq=False)
class _Pending:
    """An event being written, and what to do once it is."""

    event: DomainEvent
    reply_to: UniqueAddress | None = None


class ShardCoordinatorCore:
    """One entity type's coordinator. See the module docstring."""

    def __init__(
        self,
        type_name: str,
        self_node: UniqueAddress,
        number_of_shards: int,
        settings: ShardingSettings,
        strategy: ShardAllocationStrategy,
        now: float,
        removal_margin: float = 0.0,
        counters: CoordinatorCounters | None = None,
    ) -> None:
        """Build a coordinator that waits for :meth:`state_loaded`.

        ``removal_margin``: seconds between seeing a region's node downed and moving its shards
        (see the module docstring). ``counters``: where it counts rounds and hand-offs (kept by
        the caller across incarnations; a new one by default).
        """
        self.counters = CoordinatorCounters() if counters is None else counters
        self.type_name = type_name
        self.self_node = self_node
        self.number_of_shards = number_of_shards
        self.settings = settings
        self.strategy = strategy
        self.phase = CoordinatorPhase.LOADING
        self.state = CoordinatorState(remember_entities=settings.remember_entities)
        self.cluster = ClusterView()
        self._stash: deque[tuple[UniqueAddress, CoordinatorCommand]] = deque()
        self._pending: list[_Pending] = []  # the events of the write in flight
        # The state once the write in flight and the queued events are written.
        self._projection = StateDraft.of(self.state)
        self._workers: dict[ShardId, _Worker] = {}
        self._deferred: dict[ShardId, list[UniqueAddress]] = {}
        self._unstarted: dict[ShardId, float] = {}  # HostShard sent, ShardStarted awaited
        # The same deadlines as a heap, so that the next one costs no pass over thousands of
        # shards (the shell reads it after every input); an entry no longer in _unstarted, or
        # for an older deadline, is dropped when it comes to the top.
        self._unstarted_heap: list[tuple[float, ShardId]] = []
        self._shutting_down: set[UniqueAddress] = set()
        # Hand-off ids start from the clock, so a late answer to a previous coordinator's
        # hand-off (same shard, maybe the same count) does not match a new one's.
        self._handoffs = int(now * 1_000_000)
        self._next_rebalance = now + settings.rebalance_interval
        self._queue: list[_Pending] = []  # events decided, for the next write
        self._early_round = False  # a new region registered: a round soon, when one may run
        self._round_moving: set[ShardId] = set()  # moved by rounds, not allocated again yet
        self._catching_up = False  # the last round moved shards: the next when they settled
        self.removal_margin = removal_margin
        self._departing: set[UniqueAddress] = set()  # seen Leaving or Exiting: no margin
        self._downed_at: dict[UniqueAddress, float] = {}  # gone by downing, within the margin
        self._removing: set[UniqueAddress] = set()  # margin over, termination being written

    # -- inputs -----------------------------------------------------------------------------

    def state_loaded(self, state: CoordinatorState, now: float) -> list[CoordinatorEffect]:
        """The majority read of the state finished: start serving."""
        if self.phase is not CoordinatorPhase.LOADING:
            return []
        self.state = attrs.evolve(state, remember_entities=self.settings.remember_entities)
        self._projection = StateDraft.of(self.state)
        self.phase = CoordinatorPhase.ACTIVE
        logger.info("coordinator %s: state loaded: %s", self.type_name, self.state.summary())
        effects = self._terminate_gone(now)
        effects += self._allocate_remembered(now)
        effects += self._unstash(now)
        return effects + self._flush()

    def set_cluster(self, cluster: ClusterView, now: float) -> list[CoordinatorEffect]:
        """The cluster changed: regions whose node is down or removed terminate."""
        self.cluster = cluster
        if self.phase is CoordinatorPhase.LOADING:
            return []
        if self._early_round:
            self._bring_round_forward(now)  # the new region's node may be Up now
        return self._terminate_gone(now) + self._flush()

    def _note_departures(self) -> None:
        """Remember which regions' nodes leave gracefully: they need no removal margin."""
        state = self._projection
        for node, status in self.cluster.members.items():
            if status in _DEPARTING and (node in state.regions or node in state.region_proxies):
                self._departing.add(node)

    def _bring_round_forward(self, now: float) -> None:
        """A new region waits for a round: soon, once the cluster lets shards move."""
        if self.cluster.good_time_to_rebalance():
            soon = now + min(NEW_REGION_REBALANCE_DELAY, self.settings.rebalance_interval)
            self._next_rebalance = min(self._next_rebalance, soon)

    def receive(
        self, sender: UniqueAddress, message: CoordinatorCommand, now: float
    ) -> list[CoordinatorEffect]:
        """Handle one command from a region or proxy."""
        if self.phase is not CoordinatorPhase.ACTIVE:
            self._stash.append((sender, message))
            return []
        return self._handle(sender, message, now) + self._flush()

    def state_updated(
        self, events: Sequence[DomainEvent], ok: bool, now: float
    ) -> list[CoordinatorEffect]:
        """The write of an :class:`UpdateState`'s ``events`` ended; a failed one is tried again."""
        batch = self._pending
        written = tuple(events)
        if not batch or tuple(p.event for p in batch) != written:
            return []
        if not ok:
            logger.warning(
                "coordinator %s: writing %s failed; retrying",
                self.type_name,
                describe_events(written),
            )
            return [UpdateState(written)]
        self.state = self.state.updated_all(written)
        self._pending = []
        self.phase = CoordinatorPhase.ACTIVE
        # What the events' answers decide joins the queue behind the events decided meanwhile.
        effects: list[CoordinatorEffect] = []
        for pending in batch:
            effects += self._after(pending.event, pending, now)
        effects += self._allocate_remembered(now)
        effects += self._unstash(now)
        return effects + self._flush()

    def tick(self, now: float) -> list[CoordinatorEffect]:
        """Resend HostShard, time out hand-offs, rebalance when due."""
        if self.phase is CoordinatorPhase.LOADING:
            return []
        effects: list[CoordinatorEffect] = []
        for shard, due in list(self._unstarted.items()):
            region = self.state.shards.get(shard)
            if region is None:
                del self._unstarted[shard]
            elif now >= due:
                self._await_start(shard, now + self.settings.shard_start_timeout)
                effects.append(self._send(region, HostShard(type_name=self.type_name, shard=shard)))
        for worker in self._workers.values():
            if now >= worker.resend_at:
                effects += self._resend(worker, now)
        for shard, worker in list(self._workers.items()):
            if now >= worker.deadline:
                logger.warning(
                    "coordinator %s: hand-off of shard %s from %s timed out; it stays there",
                    self.type_name,
                    shard,
                    worker.owner,
                )
                effects += self._worker_done(shard, ok=False, now=now)
        if self._downed_at and now >= min(self._downed_at.values()) + self.removal_margin:
            effects += self._terminate_gone(now)
        if now >= self._next_rebalance:
            self._next_rebalance = now + self.settings.rebalance_interval
            if self.cluster.good_time_to_rebalance():
                self._early_round = False
            effects += self._rebalance(now)
        effects += self._allocate_remembered(now)
        effects += self._unstash(now)
        return effects + self._flush()

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do next (never, while the state is loading)."""
        if self.phase is CoordinatorPhase.LOADING:
            return float("inf")  # tick does nothing yet: a past deadline would spin the timer
        deadlines = [self._next_rebalance, self._next_unstarted()]
        deadlines += [min(w.deadline, w.resend_at) for w in self._workers.values()]
        if self._downed_at:
            deadlines.append(min(self._downed_at.values()) + self.removal_margin)
        return min(deadlines)

    def _await_start(self, shard: ShardId, due: float) -> None:
        """HostShard went to ``shard``'s region: resend it at ``due`` unless it starts."""
        self._unstarted[shard] = due
        heapq.heappush(self._unstarted_heap, (due, shard))

    def _next_unstarted(self) -> float:
        """When the first HostShard is due again (never, if none is awaited)."""
        heap = self._unstarted_heap
        while heap and self._unstarted.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def rebalance_in_progress(self) -> frozenset[ShardId]:
        """Shards being handed off."""
        return frozenset(self._workers)

    # -- commands ---------------------------------------------------------------------------

    def _handle(
        self, sender: UniqueAddress, message: CoordinatorCommand, now: float
    ) -> list[CoordinatorEffect]:
        match message:
            case Register(number_of_shards=shards) | RegisterProxy(number_of_shards=shards) if (
                shards != self.number_of_shards
            ):
                reason = (
                    f"entity type {self.type_name!r} runs with {self.number_of_shards} shards "
                    f"in this cluster, and {sender} started it with {shards}"
                )
                logger.error("coordinator %s: %s", self.type_name, reason)
                return [
                    self._send(sender, RegisterRefused(type_name=self.type_name, reason=reason))
                ]
            case Register():
                if sender in self.state.regions:
                    return [self._ack(sender)]
                if not self._is_member(sender):
                    return []  # not (or no longer) in the cluster: it will retry if it should
                return self._update(ShardRegionRegistered(sender), reply_to=sender)
            case RegisterProxy():
                if sender in self.state.region_proxies:
                    return [self._ack(sender)]
                if not self._is_member(sender):
                    return []
                return self._update(ShardRegionProxyRegistered(sender), reply_to=sender)
            case GetShardHome(shard=shard):
                return self._get_shard_home(sender, ShardId(shard), now)
            case ShardStarted(shard=shard):
                self._unstarted.pop(ShardId(shard), None)
                return []
            case BeginHandOffAck(shard=shard, handoff_id=handoff_id, acked_by=acked_by):
                worker = self._workers.get(ShardId(shard))
                if worker is not None and worker.handoff_id == handoff_id:
                    worker.waiting_acks.discard(sender if acked_by is None else acked_by)
                    return self._maybe_hand_off(worker)
                return []
            case ShardStopped(shard=shard, handoff_id=handoff_id):
                worker = self._workers.get(ShardId(shard))
                if (
                    worker is not None
                    and worker.owner == sender
                    and worker.handing_off
                    and worker.handoff_id == handoff_id
                ):
                    return self._worker_done(ShardId(shard), ok=True, now=now)
                return []  # a late answer to an earlier hand-off that timed out
            case GracefulShutdownReq():
                if sender not in self.state.regions:
                    return []
                self._shutting_down.add(sender)
                effects: list[CoordinatorEffect] = []
                for shard in self.state.regions[sender]:
                    if shard not in self._workers:
                        effects += self._start_worker(shard, now)
                return effects
            case RegionStopped():
                if sender in self.state.regions:
                    return self._update(ShardRegionTerminated(sender))
                return []

    def _get_shard_home(
        self, sender: UniqueAddress, shard: ShardId, now: float
    ) -> list[CoordinatorEffect]:
        if shard in self._workers:
            self._deferred.setdefault(shard, []).append(sender)  # answered when it ends
            return []
        region = self.state.shards.get(shard)
        if region is not None and self._held(region):
            # Its node was downed and may still run the shard: answered once it is terminated.
            deferred = self._deferred.setdefault(shard, [])
            if sender not in deferred:
                deferred.append(sender)
            return []
        if region is not None:
            return [self._send(sender, self._home(shard, region))]
        candidates = self._allocation_candidates()
        if len(self._projection.regions) < self.settings.min_nr_of_members or not candidates:
            return []  # the region asks again; min_nr_of_members gates the first allocation
        requester = sender if sender in candidates else next(iter(candidates))
        chosen = self.strategy.allocate_shard(requester, shard, candidates, self.cluster)
        if chosen not in candidates:
            logger.error(
                "coordinator %s: the strategy allocated shard %s to %s, which is not an "
                "available region; ignoring",
                self.type_name,
                shard,
                chosen,
            )
            return []
        return self._update(ShardHomeAllocated(shard, chosen), reply_to=sender)

    def _allocate_remembered(self, now: float) -> list[CoordinatorEffect]:
        """With remember-entities, give an unallocated shard a home without waiting to be asked.

        Its entities restart there. One write at a time; the next when it is done.
        """
        if (
            self.phase is not CoordinatorPhase.ACTIVE
            or self._queue
            or not self.state.remember_entities
        ):
            return []
        waiting = sorted(s for s in self.state.unallocated_shards if s not in self._workers)
        candidates = self._allocation_candidates()
        if (
            not waiting
            or not candidates
            or len(self.state.regions) < self.settings.min_nr_of_members
        ):
            return []
        shard = waiting[0]
        requester = next(iter(candidates))
        chosen = self.strategy.allocate_shard(requester, shard, candidates, self.cluster)
        if chosen not in candidates:
            return []
        return self._update(ShardHomeAllocated(shard, chosen))

    # -- rebalance --------------------------------------------------------------------------

    def _rebalance(self, now: float) -> list[CoordinatorEffect]:
        candidates = self._candidates(self.state.regions)
        if not candidates or not self.cluster.one_app_version(candidates):
            return []  # nothing to move, or a rolling upgrade is under way
        self.counters.rebalance_rounds += 1
        chosen = self.strategy.rebalance(candidates, frozenset(self._workers), self.cluster)
        effects: list[CoordinatorEffect] = []
        for shard in sorted(chosen):
            if (
                shard in self.state.shards
                and shard not in self._workers
                and not self._held(self.state.shards[shard])
            ):
                effects += self._start_worker(shard, now)
                self._round_moving.add(shard)
                self._catching_up = True
        return effects

    def _settled(self, shard: ShardId, now: float) -> None:
        """``shard`` has a home after a round moved it (or stayed): maybe a round soon."""
        self._round_moving.discard(shard)
        if self._catching_up and not self._round_moving and not self._workers:
            self._catching_up = False
            soon = now + min(CATCH_UP_ROUND_DELAY, self.settings.rebalance_interval)
            self._next_rebalance = min(self._next_rebalance, soon)

    def _start_worker(self, shard: ShardId, now: float) -> list[CoordinatorEffect]:
        owner = self.state.shards[shard]
        everyone = set(self.state.regions) | set(self.state.region_proxies)
        self._handoffs += 1
        worker = _Worker(
            shard,
            self._handoffs,
            owner,
            everyone,
            now + self.settings.handoff_timeout,
            now + self.settings.retry_interval,
            started=now,
        )
        self._workers[shard] = worker
        logger.info("coordinator %s: moving shard %s off %s", self.type_name, shard, owner)
        effects: list[CoordinatorEffect] = [
            self._send(
                node,
                BeginHandOff(type_name=self.type_name, shard=shard, handoff_id=worker.handoff_id),
            )
            for node in _ordered(everyone)
        ]
        return effects + self._maybe_hand_off(worker)

    def _resend(self, worker: _Worker, now: float) -> list[CoordinatorEffect]:
        """Ask again whoever has not answered yet (every ``retry_interval``).

        A BeginHandOff, a HandOff or its reply may have been lost with a broken connection.
        Regions answer repeats alike, so a resend costs a message, where waiting would hold the
        shard's messages for up to ``handoff_timeout``.
        """
        worker.resend_at = now + self.settings.retry_interval
        if worker.deadline == float("inf"):
            return []  # stopped; its deallocation is being written
        if worker.handing_off:
            hand_off = HandOff(
                type_name=self.type_name, shard=worker.shard, handoff_id=worker.handoff_id
            )
            return [self._send(worker.owner, hand_off)]
        begin = BeginHandOff(
            type_name=self.type_name, shard=worker.shard, handoff_id=worker.handoff_id
        )
        return [self._send(node, begin) for node in _ordered(worker.waiting_acks)]

    def _maybe_hand_off(self, worker: _Worker) -> list[CoordinatorEffect]:
        if worker.waiting_acks or worker.handing_off:
            return []
        worker.handing_off = True
        hand_off = HandOff(
            type_name=self.type_name, shard=worker.shard, handoff_id=worker.handoff_id
        )
        return [self._send(worker.owner, hand_off)]

    def _worker_done(self, shard: ShardId, *, ok: bool, now: float) -> list[CoordinatorEffect]:
        worker = self._workers.get(shard)
        if worker is None:
            return []
        if ok and self.state.shards.get(shard) == worker.owner:
            # It ends when the deallocation is written; nothing to resend meanwhile.
            worker.deadline = worker.resend_at = float("inf")
            return self._update(ShardHomeDeallocated(shard))
        del self._workers[shard]
        # ok: the owner's region was terminated meanwhile, and the shard deallocated with it.
        self.counters.handoffs["region_gone" if ok else "timed_out"] += 1
        if not ok:
            self._settled(shard, now)  # it stays where it was
        return self._answer_deferred(shard, now)

    def _answer_deferred(self, shard: ShardId, now: float) -> list[CoordinatorEffect]:
        """Asks held during a hand-off go back in line (Akka sends them to itself).

        So each is answered from the state as it is once the writes before it are done.
        """
        for asker in self._deferred.pop(shard, []):
            self._stash.append((asker, GetShardHome(type_name=self.type_name, shard=shard)))
        return []  # handled by the caller's unstash, after what it is doing

    # -- events -----------------------------------------------------------------------------

    def _update(
        self, event: DomainEvent, reply_to: UniqueAddress | None = None
    ) -> list[CoordinatorEffect]:
        """Decide ``event``: it goes out with the next write (see :meth:`_flush`)."""
        try:
            self._projection.apply(event)
        except ValueError as error:  # a command that no longer fits: drop it, loudly
            logger.error("coordinator %s: %s", self.type_name, error)
            return []
        self._queue.append(_Pending(event, reply_to))
        return []

    def _flush(self) -> list[CoordinatorEffect]:
        """Write the events decided so far, in one write, unless a write is in flight.

        Every input ends with this, so the events one input decides leave together.
        """
        if self._pending or not self._queue:
            return []
        self._pending = self._queue[:MAX_EVENTS_PER_WRITE]
        del self._queue[:MAX_EVENTS_PER_WRITE]
        self.phase = CoordinatorPhase.UPDATING
        return [UpdateState(tuple(p.event for p in self._pending))]

    def _after(self, event: DomainEvent, pending: _Pending, now: float) -> list[CoordinatorEffect]:
        effects: list[CoordinatorEffect] = []
        match event:
            case ShardRegionRegistered(region=region):
                effects.append(self._ack(region))
                # A new region has nothing: the next round comes soon rather than up to a whole
                # interval later (Akka waits), so a joining node gets its share sooner.
                self._early_round = True
                self._bring_round_forward(now)
            case ShardRegionProxyRegistered(proxy=region):
                effects.append(self._ack(region))
            case ShardHomeAllocated(shard=shard, region=region):
                self._await_start(shard, now + self.settings.shard_start_timeout)
                self._settled(shard, now)
                # The asker's answer first: HostShard to a region on this node is handled in
                # the sending call, and the answer would wait for it.
                if pending.reply_to is not None and pending.reply_to != region:
                    effects.append(self._send(pending.reply_to, self._home(shard, region)))
                effects.append(self._send(region, HostShard(type_name=self.type_name, shard=shard)))
            case ShardHomeDeallocated(shard=shard):
                self._unstarted.pop(shard, None)
                worker = self._workers.pop(shard, None)
                if worker is not None:
                    self.counters.handoffs["completed"] += 1
                    self.counters.handoff_seconds.observe(now - worker.started)
                    effects += self._answer_deferred(shard, now)
            case ShardRegionTerminated(region=region):
                logger.info("coordinator %s: region %s terminated", self.type_name, region)
                self._shutting_down.discard(region)
                self._departing.discard(region)
                self._downed_at.pop(region, None)
                self._removing.discard(region)
                effects += self._forget_region(region, now)
                # Asks held while the region's node was within its removal margin: answered
                # now that its shards have no home.
                for shard in [s for s in self._deferred if s not in self._workers]:
                    effects += self._answer_deferred(shard, now)
            case ShardRegionProxyTerminated(proxy=proxy):
                self._departing.discard(proxy)
                self._downed_at.pop(proxy, None)
                self._removing.discard(proxy)
                effects += self._forget_region(proxy, now)
        return effects

    def _forget_region(self, region: UniqueAddress, now: float) -> list[CoordinatorEffect]:
        """A region or proxy is gone: it acknowledged every hand-off; its own hand-offs end."""
        effects: list[CoordinatorEffect] = []
        for shard, worker in list(self._workers.items()):
            if worker.owner == region:
                self._workers.pop(shard, None)  # its shards were deallocated with it
                self.counters.handoffs["region_gone"] += 1
                effects += self._answer_deferred(shard, now)
            else:
                worker.waiting_acks.discard(region)
                effects += self._maybe_hand_off(worker)
        return effects

    def _terminate_gone(self, now: float) -> list[CoordinatorEffect]:
        self._note_departures()
        effects: list[CoordinatorEffect] = []
        state = self._projection  # not again for a termination already being written
        for region in _ordered(state.regions):
            if self._is_gone(region) and self._margin_over(region, now):
                effects += self._update(ShardRegionTerminated(region))
        for proxy in _ordered(state.region_proxies):
            if self._is_gone(proxy):  # hosts no shards: no margin
                effects += self._update(ShardRegionProxyTerminated(proxy))
        return effects

    def _margin_over(self, node: UniqueAddress, now: float) -> bool:
        """Whether a gone region may be terminated: it left gracefully, or its margin ended."""
        if self.removal_margin <= 0 or node in self._departing or node in self._shutting_down:
            return True
        since = self._downed_at.get(node)
        if since is None:
            since = self._downed_at[node] = now
            logger.info(
                "coordinator %s: region %s was downed; its shards move in %g s (removal margin)",
                self.type_name,
                node,
                self.removal_margin,
            )
        if now < since + self.removal_margin:
            return False
        del self._downed_at[node]
        self._removing.add(node)
        return True

    def _held(self, region: UniqueAddress) -> bool:
        """Whether ``region``'s node was downed and its shards wait for its termination."""
        return region in self._downed_at or region in self._removing

    def _unstash(self, now: float) -> list[CoordinatorEffect]:
        """Handle the waiting commands in order, while their events can join one write."""
        effects: list[CoordinatorEffect] = []
        while self._stash and self.phase is CoordinatorPhase.ACTIVE:
            sender, message = self._stash[0]
            if self._queue and not self._independent(message):
                break  # its answer may depend on the events decided: after their write
            self._stash.popleft()
            effects += self._handle(sender, message, now)
        return effects

    def _independent(self, message: CoordinatorCommand) -> bool:
        """Whether no event waiting to be written can change how ``message`` is handled."""
        match message:
            case GetShardHome(shard=shard) | ShardStopped(shard=shard):
                shard_id = ShardId(shard)
                return self._projection.shards.get(shard_id) == self.state.shards.get(shard_id)
            case ShardStarted() | BeginHandOffAck():
                return True
            case _:
                return False

    # -- helpers ----------------------------------------------------------------------------

    def _is_member(self, node: UniqueAddress) -> bool:
        return self.cluster.members.get(node) not in (None, *_GONE)

    def _is_gone(self, node: UniqueAddress) -> bool:
        return not self._is_member(node)

    def _candidates(
        self, regions: Mapping[UniqueAddress, Sequence[ShardId]]
    ) -> dict[UniqueAddress, Sequence[ShardId]]:
        """Of ``regions``, those that may get shards: not shutting down, not held."""
        if not (self._shutting_down or self._downed_at or self._removing):
            return dict(regions)  # all of them (the usual case, for every allocation)
        return {
            r: shards
            for r, shards in regions.items()
            if r not in self._shutting_down and not self._held(r)
        }

    def _allocation_candidates(self) -> dict[UniqueAddress, Sequence[ShardId]]:
        """Regions a new shard may go to: during a rolling upgrade, those of the newest version.

        The newest among regions that stay and are reachable (a shard allocated to a leaving or
        unreachable region would not start soon), or among all when there are none such.
        """
        candidates = self._candidates(self._projection.regions)  # with the pending allocations
        view = self.cluster
        if view.one_app_version(candidates):
            return candidates
        staying = [r for r in candidates if not view.is_leaving(r) and r not in view.unreachable]
        newest = max(view.app_version(r) for r in staying or candidates)
        return {r: ids for r, ids in candidates.items() if view.app_version(r) == newest}

    def _ack(self, region: UniqueAddress) -> SendTo:
        return self._send(region, RegisterAck(type_name=self.type_name, coordinator=self.self_node))

    def _home(self, shard: ShardId, region: UniqueAddress) -> ShardHome:
        return ShardHome(type_name=self.type_name, shard=shard, region=region)

    def _send(self, to: UniqueAddress, message: CoordinatorMessage) -> SendTo:
        return SendTo(to, message)


def _ordered(nodes: Iterable[UniqueAddress]) -> list[UniqueAddress]:
    return sorted(nodes, key=node_order)
