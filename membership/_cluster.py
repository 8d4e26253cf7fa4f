"""``node.cluster``: the trio shell around the membership cores.

Theory of operation: :class:`Cluster` owns four sans-IO cores, the membership protocol
(:class:`ClusterCore`), the heartbeat sender and failure detectors
(:class:`HeartbeatSenderState`) and the split brain resolver (:class:`SplitBrainResolverCore`),
and does for them what they cannot: it reads the clock, receives protocol messages from the node's
dispatcher (:meth:`handle`), and carries out their effects (send, publish, run exiting tasks, try
the downing lease, stop). One task runs all timers: it sleeps until the earliest deadline of any
core, or until a message made something due sooner.

The cores are fed in one direction only: every gossip change goes to the heartbeat ring (who to
monitor) and to the resolver (what the cluster looks like); every reaper round turns what the
failure detectors say into this node's reachability observations in the gossip; every resolver
decision becomes ``down`` calls on the membership core. Sending never blocks: membership traffic
is periodic, so a full send queue only delays it by a round.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from ._authorization import Refused, Standing, authorize_membership
from ._cluster_core import ClusterCore, Effect, Phase, Publish, Send, Shutdown, StartExiting
from ._cluster_messages import CLUSTER_MESSAGES, InitJoin, InitJoinAck, InitJoinNack
from ._cluster_settings import ClusterSettings
from ._events import ClusterEvent, diff
from ._failure_detector import FailureDetectorSettings
from ._gossip import (
    Gossip,
    convergence,
    leader,
    oldest,
    reachability_excluding_downed,
    singleton_host,
)
from ._heartbeat import Heartbeat, HeartbeatRsp, HeartbeatSenderState, heartbeat_response
from ._islands import Sighting
from ._lease import HeldLease
from ._member import Member, MemberStatus
from ._timer import NEVER, CoreTimer
from .sbr._resolver import (
    AcquireLease,
    DownNodes,
    ReleaseLease,
    SplitBrainResolverCore,
    SplitBrainResolverEffect,
)
from .sbr._settings import SplitBrainResolverSettings
from .transport._address import Address, UniqueAddress
from .transport._errors import ClusterError, SendQueueFull, TransportClosed
from .transport._refusals import Refusals
from .transport._transport import Envelope, Transport

logger = logging.getLogger("membership.cluster")

SUBSCRIBER_BUFFER = 10_000
"""Events buffered per subscriber; one that falls further behind is dropped with an error."""

_MEMBERSHIP_MESSAGES = (Heartbeat, HeartbeatRsp, *CLUSTER_MESSAGES)

PRUNE_INTERVAL = 5.0
"""Seconds between two sweeps of the transport's links: a link to an address that is neither a
member's nor a seed's (nor otherwise in use) is forgotten after a sweep that found it idle."""

SBR_TICK = 1.0
"""Seconds between split brain resolver ticks (Akka: 1 s)."""


DowningLease = HeldLease
"""What the lease-majority strategy needs from a lease (see :class:`HeldLease`)."""


@attrs.frozen
class ClusterStatistics:
    """A snapshot of this node's view of the cluster."""

    phase: str
    members: int
    unreachable: int
    convergence: bool
    leader: UniqueAddress | None
    gossip_version_entries: int
    subscribers: int
    refused: tuple[tuple[str, int], ...] = ()
    """Messages refused for who sent them, by kind (``forged-author``, ``not-a-member``,
    ``client-identity`` ...), since start."""


class Subscription:
    """Cluster events for one subscriber; iterate with ``async for``."""

    def __init__(self, receive: trio.MemoryReceiveChannel[ClusterEvent]) -> None:
        self._receive = receive

    def __aiter__(self) -> AsyncIterator[ClusterEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ClusterEvent]:
        try:
            async for event in self._receive:
                yield event
        except trio.BrokenResourceError:
            raise ClusterError(
                f"this subscriber fell more than {SUBSCRIBER_BUFFER} events behind and was "
                "dropped; subscribe again"
            ) from None


class Cluster:
    """This node's membership: who is in the cluster, the leader, the oldest; leave and down.

    Get it as ``node.cluster``.

    Example:
        >>> async def watch(node: Node) -> None:
        ...     async with node.cluster.subscribe() as events:
        ...         async for event in events:
        ...             print(event)
    """

    def __init__(
        self,
        transport: Transport,
        *,
        settings: ClusterSettings,
        failure_detector: FailureDetectorSettings,
        split_brain_resolver: SplitBrainResolverSettings | None,
        seed_nodes: Sequence[Address] = (),
        roles: Sequence[str] = (),
        rng: random.Random | None = None,
        downing_lease: DowningLease | None = None,
        wall_offset: float = 0.0,
        app_version: str = "",
    ) -> None:
        self._transport = transport
        self._node = transport.local_address
        self._random = rng or random.Random()
        self._core = ClusterCore(
            self._node,
            settings,
            self._random,
            tuple(seed_nodes),
            frozenset(roles),
            wall_offset=wall_offset,
            app_version=app_version,
        )
        self._fd_settings = failure_detector
        self._heartbeats = HeartbeatSenderState(self._node, settings=failure_detector)
        self._sbr = (
            None
            if split_brain_resolver is None
            else SplitBrainResolverCore(split_brain_resolver, self._node, now=trio.current_time())
        )
        self._downing_lease = downing_lease
        self._subscribers: list[trio.MemorySendChannel[ClusterEvent]] = []
        self._shell_deadline = NEVER
        """The earliest of the timers this shell keeps itself (heartbeats, reaper, resolver,
        pruning), as the timer loop set them before it went to sleep."""
        self._timer = CoreTimer(self._next_deadline)
        self._ring_input: tuple[frozenset[UniqueAddress], frozenset[UniqueAddress]] | None = None
        self._fed_gossip: Gossip | None = None
        self._fd_unreachable: set[UniqueAddress] = set()
        self._exiting_tasks: list[Callable[[], Awaitable[None]]] = []
        self._nursery: trio.Nursery | None = None
        self.terminated = trio.Event()
        """Set when this node is out of the cluster: downed, removed, or left."""
        self.termination_reason: str | None = None
        """Why the node is out of the cluster, once it is."""
        self._up = trio.Event()
        self._members_of: Gossip | None = None
        self._member_nodes: frozenset[UniqueAddress] = frozenset()
        self._members_changed: list[Callable[[], None]] = []
        self.refusals = Refusals(logger)
        """Messages refused for who sent them: counted by kind, logged once per interval."""
        transport.on_link_up(self._link_up)
        self._warned_nowhere_to_join = False
        self._probe_answer: Callable[[UniqueAddress, bool], None] | None = None

    # ---- public API ----

    @property
    def self_address(self) -> UniqueAddress:
        """This node's incarnation."""
        return self._node

    @property
    def self_member(self) -> Member:
        """This node as a member (Joining before it was welcomed; Removed once out)."""
        member = self._core.self_member
        if member is not None:
            return member
        status = MemberStatus.REMOVED if self.terminated.is_set() else MemberStatus.JOINING
        core = self._core
        return Member(self._node, status, roles=core.roles, app_version=core.app_version)

    @property
    def members(self) -> tuple[Member, ...]:
        """The members this node knows of, in address order (any status but Removed)."""
        return self._core.gossip.members

    @property
    def leader(self) -> UniqueAddress | None:
        """The current leader as this node sees it."""
        if self._core.phase is not Phase.MEMBER:
            return None
        return leader(self._core.gossip, self._node)

    def role_leader(self, role: str) -> UniqueAddress | None:
        """The leader among the members with ``role``."""
        if self._core.phase is not Phase.MEMBER:
            return None
        return leader(self._core.gossip, self._node, role)

    def oldest(self, role: str | None = None) -> Member | None:
        """The oldest Up or Leaving member (with ``role``)."""
        return oldest(self._core.gossip, role)

    def singleton_host(self, role: str | None = None) -> Member | None:
        """Where singletons (of ``role``) run: the oldest member of the newest ``app_version``.

        That is the oldest Up or Leaving member, unless a rolling upgrade is under way.
        """
        return singleton_host(self._core.gossip, role)

    @property
    def unreachable(self) -> frozenset[Member]:
        """Members some (not Down) member cannot reach."""
        gossip = self._core.gossip
        nodes = reachability_excluding_downed(gossip).all_unreachable_or_terminated()
        return frozenset(m for m in gossip.members if m.node in nodes)

    @property
    def gossip(self) -> Gossip:
        """The current gossip (for diagnostics and tests)."""
        return self._core.gossip

    def other_clusters(self) -> list[Sighting]:
        """Other clusters of this cluster's name seen lately: islands left by a partition.

        The smaller one gives way by itself (see ``membership._islands``); each entry says
        which side will (``verdict``) once the facts held long enough.
        """
        return self._core.sightings(trio.current_time())

    def has_converged(self) -> bool:
        """Whether the current gossip version has converged."""
        return convergence(self._core.gossip, self._node, self._core.exiting_confirmed)

    def join(self, address: Address) -> None:
        """Join the cluster through the member at ``address`` (without seed nodes)."""
        self._apply(self._core.join(address, trio.current_time()))

    def join_seed_nodes(self, seed_nodes: Sequence[Address]) -> None:
        """Join through ``seed_nodes`` found after the start: ask each, join the first member.

        For a node opened without seed nodes (a bootstrap found them); this node's own address
        is left out, so it never forms a cluster this way. Ignored once it joins or is a member.
        """
        self._apply(self._core.join_seed_nodes(seed_nodes, trio.current_time()))

    def probe(self, address: Address) -> None:
        """Ask the node at ``address`` whether it is a member of a cluster (an InitJoin).

        Its answer goes to the callback of :meth:`on_probe_answer`. A bootstrap asks its contact
        points so before it decides to join or to form a cluster.
        """
        self._send(address, InitJoin(sender=self._node))

    def on_probe_answer(self, callback: Callable[[UniqueAddress, bool], None] | None) -> None:
        """Call ``callback(sender, is_member)`` for each answer to an InitJoin (None: stop).

        ``is_member`` is true when the sender is a member this node may join through.
        """
        self._probe_answer = callback

    def leave(self, address: Address | None = None) -> None:
        """Ask the cluster to let ``address`` (default: this node) leave gracefully.

        Leaving -> Exiting -> Removed; this node then stops (``terminated`` is set).
        """
        self._apply(self._core.leave(address or self._node.address, trio.current_time()))

    def down(self, address: Address | UniqueAddress) -> None:
        """Mark the member at ``address`` Down: it is removed once unreachable.

        For a member that is surely gone (crashed, its host lost). Downing a member that is
        running makes it stop.
        """
        self._apply(self._core.down(address, trio.current_time()))

    async def wait_up(self) -> Member:
        """Wait until this node is Up (or WeaklyUp); returns its member entry.

        A node with no seed nodes that has not been told to join (:meth:`join`, or the node's
        ``self_join`` setting) never gets Up by itself: then this logs a warning at once (once
        per node) and goes on waiting, for a ``join`` from another task.

        Raises:
            ClusterError: the node left the cluster before it was Up.
        """
        if (
            not self._up.is_set()
            and not self._warned_nowhere_to_join
            and self._core.phase is Phase.IDLE
            and not self._core.seed_nodes
            and self._probe_answer is None  # no bootstrap is looking for a cluster either
        ):
            self._warned_nowhere_to_join = True
            logger.warning(
                "%s: wait_up() waits, but this node has no seed nodes and was not told to join: "
                "it gets Up only once something calls node.cluster.join(address). Give it "
                "seed_nodes, or self_join = true for a cluster of its own",
                self._node,
            )
        async with trio.open_nursery() as nursery:

            async def stop_on_termination() -> None:
                await self.terminated.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_termination)
            await self._up.wait()
            nursery.cancel_scope.cancel()
        if not self._up.is_set():
            raise ClusterError(f"{self._node} is out of the cluster: {self.termination_reason}")
        return self.self_member

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscription]:
        """Cluster events: first the current state as events, then every change.

        Example:
            >>> async def print_events(cluster: Cluster) -> None:
            ...     async with cluster.subscribe() as events:
            ...         async for event in events:
            ...             print(event)
        """
        send, receive = trio.open_memory_channel[ClusterEvent](SUBSCRIBER_BUFFER)
        for event in diff(Gossip(), self._core.gossip, self._node):
            send.send_nowait(event)
        self._subscribers.append(send)
        try:
            yield Subscription(receive)
        finally:
            if send in self._subscribers:
                self._subscribers.remove(send)
            send.close()
            receive.close()

    def add_exiting_task(self, task: Callable[[], Awaitable[None]], *, first: bool = False) -> None:
        """Run ``task`` when this node is Exiting, before it confirms and is removed.

        Singletons use it to hand over; sharding (``first``, before singletons move) to finish
        handing its shards off. Each task is awaited in order.
        """
        if first:
            self._exiting_tasks.insert(0, task)
        else:
            self._exiting_tasks.append(task)

    def statistics(self) -> ClusterStatistics:
        """A snapshot of this node's view of the cluster."""
        gossip = self._core.gossip
        return ClusterStatistics(
            phase=self._core.phase.value,
            members=len(gossip.members),
            unreachable=len(self.unreachable),
            convergence=self.has_converged(),
            leader=self.leader,
            gossip_version_entries=len(gossip.version.entries),
            subscribers=len(self._subscribers),
            refused=tuple(sorted(self.refusals.counts.items())),
        )

    def failure_detector_phi(self) -> dict[UniqueAddress, float]:
        """Phi of each failure detector this node keeps, now: suspicion that the node is gone.

        One per node this node sends heartbeats to and has heard from (its receivers on the
        heartbeat ring, and those it keeps watching until they answer or are removed), in
        address order. A node is marked unreachable once its phi reaches
        ``failure_detector.threshold``. Read-only: for metrics and diagnostics.
        """
        now = trio.current_time()
        registry = self._heartbeats.registry
        return {node: registry.phi(node, now) for node in registry.monitored()}

    # ---- who may send what ----

    def is_member_link(self, envelope: Envelope) -> bool:
        """Whether ``envelope`` came from a member over that member's own (node) link."""
        return envelope.identity.is_node and envelope.sender in self._members()

    def on_members_changed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (which must not block) whenever the set of members changes.

        A dispatcher that remembers which senders are members forgets them then.
        """
        self._members_changed.append(callback)

    def refuse(self, refused: Refused) -> None:
        """Count and log (at most once per interval per kind) a refused message."""
        quiet = refused.kind == "not-a-member"  # also a member-to-be, before gossip reaches us
        level = logging.INFO if quiet else logging.WARNING
        self.refusals.refuse(
            refused.kind, f"{self._node}: {refused.reason}", trio.current_time(), level=level
        )

    def _members(self) -> frozenset[UniqueAddress]:
        gossip = self._core.gossip
        if gossip is not self._members_of:
            self._members_of = gossip
            nodes = frozenset(gossip.nodes())
            if nodes != self._member_nodes:
                self._member_nodes = nodes
                for callback in self._members_changed:
                    callback()
        return self._member_nodes

    def _standing(self, node: UniqueAddress) -> Standing:
        if node in self._members():
            return Standing.MEMBER
        if self._core.gossip.is_tombstoned(node):
            return Standing.REMOVED
        return Standing.STRANGER

    # ---- the node's dispatcher calls this ----

    def handle(self, envelope: Envelope) -> bool:
        """Take a membership message from the transport; False if it is not one."""
        message, sender = envelope.message, envelope.sender
        # The clock is read only for a message of ours: the node may ask about every message it
        # receives, and reading the clock costs more than these checks.
        if not isinstance(message, _MEMBERSHIP_MESSAGES):
            return False
        refused = authorize_membership(message, sender, envelope.identity, self._standing(sender))
        if refused is not None:
            self.refuse(refused)
            return True
        if isinstance(message, Heartbeat):
            if self._core.phase is not Phase.SHUT_DOWN:
                self._send(sender, heartbeat_response(self._node, message))
            return True
        if isinstance(message, HeartbeatRsp):
            self._heartbeats.heartbeat_rsp(sender, trio.current_time())
            return True
        if self._probe_answer is not None and isinstance(message, InitJoinAck | InitJoinNack):
            self._probe_answer(sender, isinstance(message, InitJoinAck))
        if self._core.phase is not Phase.SHUT_DOWN:
            self._apply(self._core.receive(sender, message, trio.current_time()))
            self._timer.poke()
        return True

    def _link_up(self, address: Address) -> None:
        if self._core.phase is Phase.SEEDING:
            self._apply(self._core.peer_linked(address, trio.current_time()))

    # ---- running ----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the timers until this node is out of the cluster."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            now = trio.current_time()
            self._apply(self._core.start(now))
            task_status.started()
            interval = self._fd_settings.heartbeat_interval
            reaper = self._fd_settings.unreachable_nodes_reaper_interval
            next_heartbeat = next_reap = next_sbr = now
            next_prune = now + PRUNE_INTERVAL
            sbr_ticked = -NEVER
            while not self.terminated.is_set():
                decide_at = self._sbr.decision_due() if self._sbr is not None else NEVER
                if decide_at <= sbr_ticked:
                    decide_at = NEVER  # ticked at it already, nothing came of it
                # Fixed while the loop sleeps: only the core's deadline is read again (poke).
                self._shell_deadline = min(
                    next_heartbeat, next_reap, min(next_sbr, decide_at), next_prune
                )
                now = await self._timer.wait()
                if now >= self._core.next_deadline():
                    self._apply(self._core.tick(now))
                if now >= next_prune:
                    next_prune = now + PRUNE_INTERVAL
                    self._transport.prune(self._core.addresses_in_use())
                if self._core.phase is not Phase.MEMBER:
                    next_heartbeat = next_reap = next_sbr = now + interval
                    continue
                if now >= next_heartbeat:
                    next_heartbeat = now + interval
                    self._heartbeat_round(now)
                if now >= next_reap:
                    next_reap = now + reaper
                    self._reap(now)
                if (now >= next_sbr or now >= decide_at) and self._sbr is not None:
                    next_sbr, sbr_ticked = now + SBR_TICK, now
                    self._feed(now)
                    self._apply_sbr(self._sbr.tick(now), now)
            nursery.cancel_scope.cancel()

    def _next_deadline(self) -> float:
        return min(self._core.next_deadline(), self._shell_deadline)

    def _heartbeat_round(self, now: float) -> None:
        round_ = self._heartbeats.tick(now)
        if round_.starved:
            logger.warning(
                "%s: heartbeats are late (scheduling starved?); detection may be inaccurate",
                self._node,
            )
        for receiver in round_.receivers:
            self._send(receiver, round_.heartbeat)

    def _reap(self, now: float) -> None:
        self._fd_unreachable |= self._heartbeats.unreachable(now)
        self._fd_unreachable -= self._heartbeats.reachable(now)
        self._fd_unreachable &= self._core.gossip.nodes()
        self._apply(self._core.update_reachability(self._fd_unreachable, now))

    def _feed(self, now: float) -> None:
        """Give the heartbeat ring and the resolver the current gossip, if it changed."""
        gossip = self._core.gossip
        if gossip is self._fed_gossip:
            return
        self._fed_gossip = gossip
        ring_input = (gossip.nodes(), gossip.reachability.all_unreachable_or_terminated())
        if ring_input != self._ring_input:
            self._ring_input = ring_input
            self._heartbeats.init(ring_input[0], ring_input[1], now)
        if self._sbr is not None:
            self._sbr.update(
                gossip.members,
                gossip.reachability,
                is_leader=self._core.is_leader(),
                now=now,
                seen_by=gossip.seen,
            )

    # ---- effects ----

    def _send(self, to: Address | UniqueAddress, message: object) -> None:
        try:
            self._transport.send_nowait(to, message)
            if isinstance(message, InitJoin) and isinstance(to, Address):
                self._transport.hurry(to)  # a restarting node must hear it before it forms
        except SendQueueFull:
            logger.debug(
                "%s: send queue to %s full; %s skipped", self._node, to, type(message).__name__
            )
        except TransportClosed:
            pass

    def _apply(self, effects: list[Effect]) -> None:
        now = trio.current_time()
        for effect in effects:
            match effect:
                case Send(to=to, message=message):
                    self._send(to, message)
                case Publish(event=event):
                    self._publish(event)
                case StartExiting():
                    self._start_exiting()
                case Shutdown(reason=reason):
                    self._terminate(reason)
        self._feed(now)
        self._members()  # tells the dispatcher if the members changed
        member = self._core.self_member
        if member is not None and member.status in (MemberStatus.UP, MemberStatus.WEAKLY_UP):
            self._up.set()

    def _publish(self, event: ClusterEvent) -> None:
        for channel in list(self._subscribers):
            try:
                channel.send_nowait(event)
            except trio.WouldBlock:
                logger.error("%s: dropping a cluster event subscriber that fell behind", self._node)
                self._subscribers.remove(channel)
                channel.close()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(channel)

    def _apply_sbr(self, effects: list[SplitBrainResolverEffect], now: float) -> None:
        for effect in effects:
            match effect:
                case DownNodes(nodes=nodes, decision=decision):
                    logger.warning(
                        "%s: split brain resolver (%s) downs %s",
                        self._node,
                        decision.value,
                        ", ".join(str(n) for n in nodes),
                    )
                    self._apply(self._core.down_nodes(nodes, now))
                case AcquireLease(delay=delay):
                    self._spawn(self._acquire_lease, delay)
                case ReleaseLease():
                    self._spawn(self._release_lease)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _acquire_lease(self, delay: float) -> None:
        await trio.sleep(delay)
        granted = False
        if self._downing_lease is None:
            logger.error("%s: lease-majority needs a downing lease; none was given", self._node)
        else:
            try:
                granted = await self._downing_lease.acquire() is not None
            except ClusterError as exc:
                logger.warning("%s: downing lease not acquired: %s", self._node, exc)
        assert self._sbr is not None
        self._apply_sbr(self._sbr.lease_acquired(granted, trio.current_time()), trio.current_time())

    async def _release_lease(self) -> None:
        released = False
        if self._downing_lease is not None:
            try:
                released = await self._downing_lease.release()
            except ClusterError as exc:
                logger.warning("%s: downing lease not released: %s", self._node, exc)
        assert self._sbr is not None
        self._sbr.lease_released(released, trio.current_time())

    def _start_exiting(self) -> None:
        async def run_exiting_tasks() -> None:
            for task in self._exiting_tasks:
                await task()
            self._apply(self._core.exiting_completed(trio.current_time()))

        logger.info("%s: exiting: handing over", self._node)
        self._spawn(run_exiting_tasks)

    def _terminate(self, reason: str) -> None:
        if self.terminated.is_set():
            return
        self.termination_reason = reason
        self.terminated.set()
        self._timer.wake()
        for channel in self._subscribers:
            channel.close()
        self._subscribers.clear()
