"""A shard region's routing protocol, sans-IO: Akka's ``ShardRegion`` without its entities.

Theory of operation. A region (or a proxy, which hosts nothing) knows, per shard, the region that
hosts it (``homes``). The shell routes every message with that table: to a local shard, or
straight to the owning region, never through the coordinator. A message for a shard without a
known home is buffered here (at most ``buffer_size`` over all shards) and the coordinator is
asked once (GetShardHome), and again every ``retry_interval`` while the buffer waits; ShardHome
or HostShard releases the buffer in order (:class:`Flush`).

Registration: the region sends Register (RegisterProxy for a proxy) until RegisterAck comes,
backing off from ``REGISTER_FIRST_RETRY`` to ``retry_interval``, and again whenever the
coordinator moves (:meth:`ShardRegionCore.coordinator_changed`). Homes already known stay
known meanwhile, so established shards keep working during a coordinator failover.

Hand-off, at every region: BeginHandOff forgets the shard's home (later messages buffer) and
acknowledges *through the shard's owner* (see :class:`BeginHandOffAck`), so everything this
region sent the owner arrives before the owner can be told to stop the shard. At the owner,
HandOff stops the shard (:class:`StopShard`); when its entities are stopped the shell calls
:meth:`ShardRegionCore.shard_stopped` and ShardStopped goes to the coordinator. A HostShard that
arrives for a shard still stopping here starts it again once it stopped (akka#32976).

Per shard at this region::

    unknown ──ShardHome(other)──▶ remote home ──BeginHandOff──▶ unknown
    unknown ──HostShard / ShardHome(self)──▶ RUNNING ──HandOff──▶ STOPPING ──stopped──▶ unknown
                                                     (HostShard while STOPPING: RUNNING again)

Graceful shutdown: GracefulShutdownReq (repeated every ``retry_interval``) makes the coordinator
hand every shard here off; once none is left and nothing is buffered, RegionStopped goes out
and :attr:`ShardRegionCore.stopped` is true.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Container, Iterable, Mapping
from typing import Generic, TypeAlias, TypeVar

import attrs

from membership import LatencyHistogram, MemberStatus, UniqueAddress

from ._allocation import ShardId
from ._protocol import (
    BeginHandOff,
    BeginHandOffAck,
    CoordinatorCommand,
    GetShardHome,
    GracefulShutdownReq,
    HandOff,
    HostShard,
    Register,
    RegisterAck,
    RegisterProxy,
    RegisterRefused,
    ShardHome,
    ShardStarted,
    ShardStopped,
)
from ._protocol import RegionStopped as RegionStoppedMsg
from ._settings import ShardingSettings

logger = logging.getLogger("p2pshard.region")

REGISTER_FIRST_RETRY = 0.1
"""Seconds before the first repeat of Register; each repeat doubles it up to retry_interval."""

D = TypeVar("D")

_GONE = frozenset({MemberStatus.DOWN, MemberStatus.REMOVED})


class LocalShard(enum.Enum):
    """A shard hosted by this region."""

    RUNNING = "running"
    STOPPING = "stopping"


@attrs.frozen
class ToCoordinator:
    """Effect: send ``message`` to the coordinator, wherever it runs."""

    message: CoordinatorCommand


@attrs.frozen
class SendTo:
    """Effect: send ``message`` to the region on node ``to``."""

    to: UniqueAddress
    message: BeginHandOffAck


@attrs.frozen
class StartShard:
    """Effect: start hosting ``shard`` (its entities start on demand)."""

    shard: ShardId


@attrs.frozen
class StopShard:
    """Effect: stop ``shard``'s entities for a hand-off, then call ``shard_stopped``."""

    shard: ShardId


@attrs.frozen
class Flush(Generic[D]):
    """Effect: deliver the buffered ``deliveries`` of ``shard``, in order, to ``home``."""

    shard: ShardId
    home: UniqueAddress
    deliveries: list[D]


class DropReason(enum.StrEnum):
    """Why messages are not delivered: the core's drops and the shell's share these.

    The shell picks the error a dropped ask fails with from this, never from the words
    (see :attr:`overflow`). A member's value is its words when nothing more needs saying.
    """

    STOPPED = "the region has stopped"
    REFUSED = "the coordinator refused the region"
    BUFFER_FULL = "the region's buffer is full"
    """Too many messages wait for shards without a known home (``buffer_size``)."""
    SEND_QUEUE_FULL = "the send queue stayed full"
    """The link to the home stayed full for a whole ``retry_interval``."""
    NOT_SENT = "the message could not be sent"
    """The transport refused it: the link closed, or the message did not encode."""

    @property
    def overflow(self) -> bool:
        """Whether a dropped ask fails with ``BufferOverflow`` (else ``ShardingError``)."""
        return self is DropReason.BUFFER_FULL

    @property
    def label(self) -> str:
        """The reason as a metric label value: ``buffer_full``, ``not_sent``..."""
        return self.name.lower()


@attrs.frozen
class Drop(Generic[D]):
    """Effect: ``deliveries`` will not be delivered, for ``reason``.

    ``reason`` is the words (the log line and the failed asks say them), ``cause`` the
    typed reason the shell acts on. ``cause`` takes no part in equality: the core words each
    cause differently, so equal words are the same cause, and a test may compare with
    ``Drop(deliveries, words)``.
    """

    deliveries: list[D]
    reason: str
    cause: DropReason = attrs.field(default=DropReason.NOT_SENT, eq=False, kw_only=True)


@attrs.frozen
class Refused:
    """Effect: the coordinator refused this region; ``reason`` says why."""

    reason: str


RegionEffect: TypeAlias = (
    ToCoordinator | SendTo | StartShard | StopShard | Flush[D] | Drop[D] | Refused
)


class ShardRegionCore(Generic[D]):
    """One entity type's routing at one node. See the module docstring.

    ``D`` is whatever the shell buffers per message; the core only counts and orders them.
    """

    def __init__(
        self,
        type_name: str,
        self_node: UniqueAddress,
        number_of_shards: int,
        settings: ShardingSettings,
        *,
        hosting: bool,
        now: float,
        oldest: UniqueAddress | None = None,
    ) -> None:
        """Build a region (``hosting``) or proxy that starts registering at once.

        ``oldest`` is the member the coordinator runs on as the region starts (see
        :meth:`cluster_changed`).
        """
        self.type_name = type_name
        self.self_node = self_node
        self.number_of_shards = number_of_shards
        self.settings = settings
        self.hosting = hosting
        self.homes: dict[ShardId, UniqueAddress] = {}
        self._nodes: dict[UniqueAddress, UniqueAddress] = {}
        """One object per node for ``homes``: see :meth:`_home_is`."""
        self.local: dict[ShardId, LocalShard] = {}
        self.buffers: dict[ShardId, collections.deque[D]] = {}
        self.buffered = 0
        self.drops: dict[DropReason, int] = dict.fromkeys(DropReason, 0)
        """Messages dropped, by reason (the core's drops and those the shell counts here)."""
        self.home_requests = 0
        self.home_lookups = LatencyHistogram()
        """Seconds from a shard's first GetShardHome to the answer (ShardHome or HostShard)."""
        self._home_asked: dict[ShardId, float] = {}
        self.coordinator: UniqueAddress | None = None
        self.refused: str | None = None
        self.graceful = False
        self.stopped = False
        self._oldest = oldest
        self._pending_handoff: dict[ShardId, int] = {}  # shard stopping → its hand-off id
        self._host_after_stop: set[ShardId] = set()
        self._register_backoff = REGISTER_FIRST_RETRY
        self._next_register = now
        self._next_retry = now + settings.retry_interval

    @property
    def registered(self) -> bool:
        """Whether the current coordinator acknowledged this region."""
        return self.coordinator is not None

    @property
    def dropped(self) -> int:
        """Messages dropped, for every reason."""
        return sum(self.drops.values())

    # -- inputs -----------------------------------------------------------------------------

    def buffer(self, shard: ShardId, delivery: D, now: float) -> list[RegionEffect[D]]:
        """Hold ``delivery`` until ``shard``'s home is known; asks for it on the first one."""
        if self.refused is not None or self.stopped:
            cause = DropReason.STOPPED if self.refused is None else DropReason.REFUSED
            self.drops[cause] += 1
            return [Drop([delivery], self.refused or DropReason.STOPPED.value, cause=cause)]
        if self.buffered >= self.settings.buffer_size:
            self.drops[DropReason.BUFFER_FULL] += 1
            return [
                Drop(
                    [delivery],
                    f"{DropReason.BUFFER_FULL} ({self.settings.buffer_size} messages wait "
                    "for shards without a known home)",
                    cause=DropReason.BUFFER_FULL,
                )
            ]
        queue = self.buffers.get(shard)
        first = queue is None
        if queue is None:
            queue = self.buffers[shard] = collections.deque()
        queue.append(delivery)
        self.buffered += 1
        if first and self.registered and shard not in self.local:
            return [self._get_home(shard, now)]
        return []

    def receive(self, sender: UniqueAddress, message: object, now: float) -> list[RegionEffect[D]]:
        """Handle one message from the coordinator (or a relayed hand-off acknowledgement)."""
        if self.stopped or self.refused is not None:
            if isinstance(message, BeginHandOff | HandOff | BeginHandOffAck):
                pass  # still answered: a stopped region hosts nothing and holds up no hand-off
            else:
                return []
        match message:
            case RegisterAck(coordinator=coordinator):
                first = self.coordinator is None
                self.coordinator = coordinator
                self._register_backoff = REGISTER_FIRST_RETRY
                if not first:
                    return []
                logger.debug("region %s: registered with %s", self.type_name, coordinator)
                return [self._get_home(shard, now) for shard in self._waiting_shards()]
            case RegisterRefused(reason=reason):
                if self.refused is not None:
                    return []
                self.refused = reason
                logger.error("region %s: the coordinator refused it: %s", self.type_name, reason)
                deliveries = self._take_all()
                if not deliveries:
                    return [Refused(reason)]
                return [Refused(reason), Drop(deliveries, reason, cause=DropReason.REFUSED)]
            case ShardHome(shard=shard, region=region):
                return self._home_is(ShardId(shard), region, now)
            case HostShard(shard=shard):
                return self._host(ShardId(shard), now)
            case BeginHandOff(shard=shard, handoff_id=handoff_id):
                owner = self.homes.pop(ShardId(shard), None)
                ack = BeginHandOffAck(
                    type_name=self.type_name,
                    shard=shard,
                    handoff_id=handoff_id,
                    acked_by=self.self_node,
                )
                if owner is None or owner == self.self_node:
                    return [ToCoordinator(ack)]
                return [SendTo(owner, ack)]
            case BeginHandOffAck():
                return [ToCoordinator(message)]  # relayed: see the module docstring
            case HandOff(shard=shard, handoff_id=handoff_id):
                shard_id = ShardId(shard)
                self.homes.pop(shard_id, None)
                self._host_after_stop.discard(shard_id)
                state = self.local.get(shard_id)
                if state is None:
                    return [self._stopped_msg(shard_id, handoff_id)]
                self._pending_handoff[shard_id] = handoff_id
                if state is LocalShard.STOPPING:
                    return []  # a repeated HandOff: answered when the stop ends
                self.local[shard_id] = LocalShard.STOPPING
                return [StopShard(shard_id)]
        return []

    def count_dropped(self, count: int, reason: DropReason = DropReason.SEND_QUEUE_FULL) -> None:
        """The shell dropped ``count`` messages on their way out, for ``reason``."""
        self.drops[reason] += count

    def shard_stopped(self, shard: ShardId, now: float) -> list[RegionEffect[D]]:
        """The shell stopped every entity of ``shard`` (a hand-off or a shutdown)."""
        if self.local.pop(shard, None) is None:
            return []
        effects: list[RegionEffect[D]] = []
        handoff_id = self._pending_handoff.pop(shard, None)
        if handoff_id is not None:
            effects.append(self._stopped_msg(shard, handoff_id))
        if shard in self._host_after_stop:
            self._host_after_stop.discard(shard)
            effects += self._host(shard, now)
        elif shard in self.buffers and self.registered:
            effects.append(self._get_home(shard, now))
        return effects + self._maybe_stopped()

    def cluster_changed(
        self,
        oldest: UniqueAddress | None,
        members: Mapping[UniqueAddress, MemberStatus],
        now: float,
    ) -> list[RegionEffect[D]]:
        """The cluster view changed: the ``oldest`` member of the role, and every member's status.

        The oldest runs the coordinator, so a new oldest means registering again; homes on nodes
        that are down, removed or gone are forgotten; this node Leaving starts the graceful
        shutdown.
        """
        effects: list[RegionEffect[D]] = []
        if oldest != self._oldest:
            self._oldest = oldest
            if oldest is not None:
                effects += self.coordinator_changed(now)
        gone = {node for node, status in members.items() if status in _GONE}
        gone |= {home for home in self.homes.values() if home not in members}
        if gone:
            effects += self.regions_gone(gone, now)
        if members.get(self.self_node) is MemberStatus.LEAVING and not self.graceful:
            effects += self.graceful_shutdown(now)
        return effects

    def coordinator_changed(self, now: float) -> list[RegionEffect[D]]:
        """The coordinator moved (the oldest member changed): register again, now."""
        if self.refused is not None or self.stopped:
            return []
        self.coordinator = None
        self._next_register = now + REGISTER_FIRST_RETRY
        self._register_backoff = min(2 * REGISTER_FIRST_RETRY, self.settings.retry_interval)
        return [self._register()]

    def regions_gone(self, nodes: Iterable[UniqueAddress], now: float) -> list[RegionEffect[D]]:
        """Regions on these nodes are gone (downed or removed): forget the homes they had."""
        gone = set(nodes)
        for shard in [s for s, home in self.homes.items() if home in gone]:
            del self.homes[shard]
        for node in gone:
            self._nodes.pop(node, None)
        return []

    def graceful_shutdown(self, now: float) -> list[RegionEffect[D]]:
        """Begin a graceful shutdown: ask the coordinator to hand every shard here off."""
        if self.graceful or self.stopped:
            return []
        self.graceful = True
        effects: list[RegionEffect[D]] = []
        if self.hosting and self.registered:
            effects.append(ToCoordinator(GracefulShutdownReq(type_name=self.type_name)))
        return effects + self._maybe_stopped()

    def tick(self, now: float) -> list[RegionEffect[D]]:
        """Repeat Register, GetShardHome and GracefulShutdownReq when due."""
        effects: list[RegionEffect[D]] = []
        if self.refused is not None or self.stopped:
            return effects
        if not self.registered and now >= self._next_register:
            self._next_register = now + self._register_backoff
            self._register_backoff = min(self._register_backoff * 2, self.settings.retry_interval)
            effects.append(self._register())
        if now >= self._next_retry:
            self._next_retry = now + self.settings.retry_interval
            if self.registered:
                effects += [self._get_home(shard, now) for shard in self._waiting_shards()]
                if self.graceful and self.hosting and self.local:
                    effects.append(ToCoordinator(GracefulShutdownReq(type_name=self.type_name)))
        return effects + self._maybe_stopped()

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do next."""
        if self.refused is not None or self.stopped:
            return float("inf")
        if not self.registered:
            return min(self._next_register, self._next_retry)
        return self._next_retry

    # -- helpers ----------------------------------------------------------------------------

    def _register(self) -> ToCoordinator:
        if self.hosting:
            return ToCoordinator(
                Register(type_name=self.type_name, number_of_shards=self.number_of_shards)
            )
        return ToCoordinator(
            RegisterProxy(type_name=self.type_name, number_of_shards=self.number_of_shards)
        )

    def _get_home(self, shard: ShardId, now: float) -> ToCoordinator:
        self.home_requests += 1
        self._home_asked.setdefault(shard, now)  # a repeat does not restart the lookup's time
        return ToCoordinator(GetShardHome(type_name=self.type_name, shard=shard))

    def _stopped_msg(self, shard: ShardId, handoff_id: int) -> ToCoordinator:
        return ToCoordinator(
            ShardStopped(type_name=self.type_name, shard=shard, handoff_id=handoff_id)
        )

    def _waiting_shards(self) -> list[ShardId]:
        """Buffered shards that need a home (not those stopping here: they wait for the stop)."""
        return sorted(s for s in self.buffers if s not in self.local)

    def _home_is(self, shard: ShardId, region: UniqueAddress, now: float) -> list[RegionEffect[D]]:
        if region == self.self_node:
            return self._host(shard, now, answer=False)
        self._home_known(shard, now)
        if self.local.get(shard) is LocalShard.RUNNING:
            logger.warning(
                "region %s: the coordinator says shard %s lives at %s, but it runs here",
                self.type_name,
                shard,
                region,
            )
        # Every ShardHome brings its own copy of the address: keep one object per node, so
        # that the shell's sends to it find the transport's cached route by identity (by value,
        # the lookup costs a tenth of a send).
        region = self._nodes.setdefault(region, region)
        self.homes[shard] = region
        return self._flush(shard, region)

    def _home_known(self, shard: ShardId, now: float) -> None:
        asked = self._home_asked.pop(shard, None)
        if asked is not None:
            self.home_lookups.observe(now - asked)

    def _host(self, shard: ShardId, now: float, *, answer: bool = True) -> list[RegionEffect[D]]:
        self._home_known(shard, now)
        if not self.hosting:
            logger.error(
                "region %s: asked to host shard %s, but this is a proxy", self.type_name, shard
            )
            return []
        state = self.local.get(shard)
        if state is LocalShard.STOPPING:
            self._host_after_stop.add(shard)  # started again once stopped (akka#32976)
            return []
        effects: list[RegionEffect[D]] = []
        if state is None:
            self.local[shard] = LocalShard.RUNNING
            effects.append(StartShard(shard))
        self.homes[shard] = self.self_node
        if answer:
            effects.append(ToCoordinator(ShardStarted(type_name=self.type_name, shard=shard)))
        return effects + self._flush(shard, self.self_node)

    def _flush(self, shard: ShardId, home: UniqueAddress) -> list[RegionEffect[D]]:
        queue = self.buffers.pop(shard, None)
        if not queue:
            return self._maybe_stopped()
        self.buffered -= len(queue)
        return [Flush(shard, home, list(queue)), *self._maybe_stopped()]

    def _take_all(self) -> list[D]:
        deliveries = [d for queue in self.buffers.values() for d in queue]
        self.buffers.clear()
        self.buffered = 0
        self.drops[DropReason.REFUSED] += len(deliveries)
        self._home_asked.clear()  # refused: no answer comes
        return deliveries

    def _maybe_stopped(self) -> list[RegionEffect[D]]:
        if not self.graceful or self.stopped or self.local or self.buffers:
            return []
        self.stopped = True
        logger.info("region %s: every shard handed off; stopped", self.type_name)
        if self.hosting and self.registered:
            return [ToCoordinator(RegionStoppedMsg(type_name=self.type_name))]
        return []


class SendOrder(Generic[D]):
    """Which of a region's messages must wait behind which: the shell's ordering rules.

    The shell sends; this decides, from its own state and the core's table of homes (read, not
    copied). A sender sees its messages to a shard arrive in the order it sent them:

    * a buffer released to another node (``flushing``) goes before any newer message for that
      shard: while it is on its way, newer ones queue behind it (:meth:`behind_flush`);
    * a hand-off acknowledgement relayed through the owner waits while sends to the shard wait
      for room in the send queue (``blocked``), its buffer is on its way, or messages are
      gathered for the owner (:meth:`ack_waits`).

    (Messages gathered for a node keep later ones behind them: the shell checks that inline
    on every remote send, where a call here would cost a tenth of the send.)
    """

    def __init__(self, core: ShardRegionCore[D]) -> None:
        self._homes = core.homes
        self._self_node = core.self_node
        self.flushing: dict[ShardId, collections.deque[D]] = {}
        """Shards whose released buffer is on its way to another node: what waits behind it."""
        self.blocked: dict[ShardId, int] = {}
        """Sends waiting for room in the send queue, per shard."""

    def remote_home(self, shard: ShardId, running: Container[ShardId]) -> UniqueAddress | None:
        """The node to send ``shard``'s message straight to, or None if it stays here.

        It stays while the shard runs here (``running``), has no known home yet, or older
        messages of it are still on their way. (``ShardRegion._send`` has a copy of this.)
        """
        if shard in running or shard in self.flushing:
            return None
        home = self._homes.get(shard)
        return None if home is None or home is self._self_node else home

    def behind_flush(self, shard: ShardId) -> collections.deque[D] | None:
        """Where a message that stays here waits behind older ones on their way to its home.

        For a shard not running here. None: the message goes to the core's buffer.
        """
        queue = self.flushing.get(shard)
        if queue is None:
            return None
        home = self._homes.get(shard)
        return queue if home is not None and home is not self._self_node else None

    def block(self, shard: ShardId) -> None:
        """A send to ``shard`` waits for room in the send queue."""
        self.blocked[shard] = self.blocked.get(shard, 0) + 1

    def unblock(self, shard: ShardId) -> bool:
        """A send that waited is done; True if it was the shard's last (acks may go now)."""
        left = self.blocked[shard] - 1
        if left:
            self.blocked[shard] = left
            return False
        del self.blocked[shard]
        return True

    def ack_waits(self, shard: ShardId, gathered_for_owner: bool) -> bool:
        """Whether a hand-off acknowledgement for ``shard``, relayed through its owner, waits.

        ``gathered_for_owner``: messages are gathered for the owner and not yet sent.
        """
        return bool(self.blocked.get(shard) or shard in self.flushing or gathered_for_owner)
