"""Who sends heartbeats to whom, and what the answers mean. Sans-IO.

Theory of operation (Akka's ``ClusterHeartbeatSender`` and ``HeartbeatNodeRing``): every node
sends a :class:`Heartbeat` each ``heartbeat_interval`` to a few other nodes, its *receivers*,
which answer with a :class:`HeartbeatRsp`; each answer feeds that receiver's phi accrual detector
in a :class:`FailureDetectorRegistry`. Every ``unreachable_nodes_reaper_interval`` the cluster
core asks :meth:`HeartbeatSenderState.unreachable` and :meth:`HeartbeatSenderState.reachable`
for what this node now observes differently, and turns that into reachability records.

Receivers come from a ring of all nodes ordered by a hash of each node's address and uid, so
neighbours on the ring are not neighbours on the network (nodes started together on one host get
scattered). A node's receivers are the next ``monitored_by_nr_of_members`` nodes after it on the
ring (all others in a smaller cluster), so with everyone reachable each node is watched by
exactly that many others::

    ring:  a ─► b ─► c ─► d ─► e ─► (a)         N = 2, d unreachable
    receivers(b) = c, d, e      d is kept (it must be seen to come back), e replaces it

When some of the next nodes are unreachable the walk goes on until N reachable ones are found;
unreachable nodes met before N nodes were picked stay receivers, so a node that comes back is
noticed, and the leader can still watch nodes that were shut down together. A receiver that
drops out of the ring's choice while its detector says it is unavailable keeps receiving
heartbeats (``old receivers now unreachable``) until it answers or is removed; one that is
available is simply forgotten.

A receiver that never answers would never get a detector, and a node without a detector counts
as available. So, as Akka's ``ExpectedFirstHeartbeat`` does, the first heartbeat sent to a node
starts a timer of ``expected_response_after``; if the node has not answered when it runs out, a
heartbeat is recorded for it at that moment as if it had answered, and it is detected like a
node that went silent.

Where it differs from Akka, and why:

- Time comes in as an argument and timers are deadlines kept here: a deadline that passed is
  handled at the start of the next call that brings a later time, before that call's own event,
  which is the order Akka's scheduler would have delivered them in. The expected first heartbeat
  is recorded at its deadline, not at the later call.
- The ring hash is BLAKE2b of address and uid (Akka: the JVM's ``hashCode``), so every process,
  whatever its ``PYTHONHASHSEED``, computes the same ring; ties are broken by address.
- Membership changes take ``now``: dropping a receiver asks its detector whether it is available,
  which Akka does with its clock.
- Akka's reaper compares the detectors with this node's own rows in the reachability table; here
  this node's observations are remembered by the state, which reports each change once.
- The registry is keyed by :class:`UniqueAddress`, so a restarted node is watched afresh.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable

import attrs

from ._failure_detector import FailureDetectorRegistry, FailureDetectorSettings
from .transport._address import UniqueAddress
from .transport._settings import in_range
from .transport._wire import message


def _check_sender(
    instance: object, attribute: attrs.Attribute[UniqueAddress], value: object
) -> None:
    if not isinstance(value, UniqueAddress):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name} must be a UniqueAddress, "
            f"not {type(value).__name__}"
        )


def _check_sequence_nr(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be an "
            "integer from 0"
        )


def _check_time(instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be a "
            "finite number of seconds"
        )


@message(name="p2pshard.Heartbeat")
@attrs.frozen(kw_only=True)
class Heartbeat:
    """Sent each ``heartbeat_interval`` to every receiver; answered with :class:`HeartbeatRsp`.

    Example:
        >>> from membership import Address, UniqueAddress
        >>> me = UniqueAddress(Address("10.0.0.1", 25520), "a", 1)
        >>> Heartbeat(sender=me, sequence_nr=1, creation_time=12.5).sequence_nr
        1
    """

    sender: UniqueAddress = attrs.field(validator=_check_sender)
    """The node that sent it."""
    sequence_nr: int = attrs.field(validator=_check_sequence_nr)
    """Counts the sender's heartbeat rounds, from 1."""
    creation_time: float = attrs.field(validator=_check_time)
    """The sender's clock when it was sent (seconds); only meaningful to the sender."""


@message(name="p2pshard.HeartbeatRsp")
@attrs.frozen(kw_only=True)
class HeartbeatRsp:
    """The answer to a :class:`Heartbeat`, echoing its sequence number and creation time."""

    sender: UniqueAddress = attrs.field(validator=_check_sender)
    """The node that answers (the heartbeat's receiver)."""
    sequence_nr: int = attrs.field(validator=_check_sequence_nr)
    """The answered heartbeat's ``sequence_nr``."""
    creation_time: float = attrs.field(validator=_check_time)
    """The answered heartbeat's ``creation_time``: the sender can measure the round trip."""


def heartbeat_response(self_node: UniqueAddress, heartbeat: Heartbeat) -> HeartbeatRsp:
    """What ``self_node`` answers to ``heartbeat`` (Akka's ``ClusterHeartbeatReceiver``).

    Every heartbeat is answered, whoever sent it: the receiving side keeps no state.
    """
    return HeartbeatRsp(
        sender=self_node, sequence_nr=heartbeat.sequence_nr, creation_time=heartbeat.creation_time
    )


def ring_position(node: UniqueAddress) -> int:
    """Where ``node`` sits on the heartbeat ring: a 64-bit hash of its address and uid.

    The same in every process and Python version (never ``hash()``, which is salted per process
    for strings).
    """
    key = f"{node.address.host}\x00{node.address.port}\x00{node.uid}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def _ring_key(node: UniqueAddress) -> tuple[int, UniqueAddress, str]:
    return (ring_position(node), node, node.name)


def _frozen_nodes(nodes: Iterable[UniqueAddress]) -> frozenset[UniqueAddress]:
    return frozenset(nodes)


@attrs.frozen(kw_only=True)
class HeartbeatNodeRing:
    """The nodes on a ring in hash order, and which of them each node sends heartbeats to.

    Immutable: the ``with_*`` methods return new rings. ``self_node`` is always on the ring.

    Example:
        >>> from membership import Address, UniqueAddress
        >>> a, b, c = (UniqueAddress(Address("10.0.0.1", p), "n", 1) for p in (1, 2, 3))
        >>> ring = HeartbeatNodeRing(self_node=a, nodes={a, b, c}, monitored_by_nr_of_members=1)
        >>> len(ring.receivers(a)), a in ring.receivers(a)
        (1, False)
    """

    self_node: UniqueAddress
    """The node this ring is used by."""
    nodes: frozenset[UniqueAddress] = attrs.field(converter=_frozen_nodes)
    """Every node of the cluster, ``self_node`` included."""
    unreachable: frozenset[UniqueAddress] = attrs.field(
        default=frozenset(), converter=_frozen_nodes
    )
    """The nodes the cluster currently sees as unreachable."""
    monitored_by_nr_of_members: int = attrs.field(
        default=9, validator=in_range(1, 10_000, integer=True)
    )
    """How many reachable nodes each node sends heartbeats to."""
    _ring: tuple[UniqueAddress, ...] = attrs.field(init=False, eq=False, repr=False)
    _keys: tuple[tuple[int, UniqueAddress, str], ...] = attrs.field(
        init=False, eq=False, repr=False
    )
    _my_receivers: tuple[UniqueAddress, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.self_node not in self.nodes:
            object.__setattr__(self, "nodes", self.nodes | {self.self_node})
        keys = tuple(sorted(_ring_key(node) for node in self.nodes))
        object.__setattr__(self, "_keys", keys)
        object.__setattr__(self, "_ring", tuple(key[1] for key in keys))
        object.__setattr__(self, "_my_receivers", self.receivers(self.self_node))

    @property
    def ordered(self) -> tuple[UniqueAddress, ...]:
        """All nodes in ring order."""
        return self._ring

    @property
    def my_receivers(self) -> tuple[UniqueAddress, ...]:
        """The receivers of ``self_node``, in ring order."""
        return self._my_receivers

    def receivers(self, sender: UniqueAddress) -> tuple[UniqueAddress, ...]:
        """The nodes ``sender`` sends heartbeats to, in ring order.

        The next ``monitored_by_nr_of_members`` reachable nodes after ``sender`` on the ring,
        plus the unreachable ones met on the way before that many nodes were picked. All other
        nodes when the cluster is that small.
        """
        ring = self._ring
        wanted = self.monitored_by_nr_of_members
        start = bisect.bisect_right(self._keys, _ring_key(sender))
        walk = ring[start:] + ring[:start]
        if wanted >= len(ring) - 1:
            return tuple(node for node in walk if node != sender)
        picked: list[UniqueAddress] = []
        for node in walk:
            if wanted == 0:
                break
            if node == sender:
                continue
            if node in self.unreachable:
                # Kept so that its return is seen, but it does not count towards the reachable
                # ones; past `wanted` picks, unreachable nodes are skipped.
                if len(picked) < self.monitored_by_nr_of_members:
                    picked.append(node)
            else:
                picked.append(node)
                wanted -= 1
        return tuple(picked)

    def with_node(self, node: UniqueAddress) -> HeartbeatNodeRing:
        """This ring with ``node`` added."""
        if node in self.nodes:
            return self
        return attrs.evolve(self, nodes=self.nodes | {node})

    def without_node(self, node: UniqueAddress) -> HeartbeatNodeRing:
        """This ring without ``node`` (also forgotten as unreachable)."""
        if node not in self.nodes and node not in self.unreachable:
            return self
        return attrs.evolve(self, nodes=self.nodes - {node}, unreachable=self.unreachable - {node})

    def with_unreachable(self, node: UniqueAddress) -> HeartbeatNodeRing:
        """This ring with ``node`` marked unreachable."""
        if node in self.unreachable:
            return self
        return attrs.evolve(self, unreachable=self.unreachable | {node})

    def with_reachable(self, node: UniqueAddress) -> HeartbeatNodeRing:
        """This ring with ``node`` reachable again."""
        if node not in self.unreachable:
            return self
        return attrs.evolve(self, unreachable=self.unreachable - {node})


@attrs.frozen(kw_only=True)
class HeartbeatRound:
    """What one heartbeat tick sends: the same :class:`Heartbeat` to each receiver."""

    heartbeat: Heartbeat
    """The message to send."""
    receivers: tuple[UniqueAddress, ...]
    """Where to send it, sorted by address."""
    starved: bool
    """True if this tick came two heartbeat intervals or more after the previous one: heartbeats
    went out late (a blocked event loop, CPU overload, a paused process) and peers may wrongly
    see this node as unreachable. Akka logs a warning."""


@attrs.frozen(kw_only=True)
class HeartbeatSenderStatistics:
    """A snapshot of a :class:`HeartbeatSenderState`, for diagnostics."""

    sequence_nr: int
    """Heartbeat rounds sent so far."""
    nodes: int
    """Nodes on the ring, this one included."""
    receivers: tuple[UniqueAddress, ...]
    """Nodes heartbeats are sent to, sorted."""
    monitored: tuple[UniqueAddress, ...]
    """Nodes that have a failure detector, sorted."""
    awaiting_first_response: tuple[UniqueAddress, ...]
    """Receivers whose expected-first-heartbeat timer is running, sorted."""
    observed_unreachable: tuple[UniqueAddress, ...]
    """Nodes this node reported unreachable and not yet reachable again, sorted."""


@attrs.define(eq=False)
class HeartbeatSenderState:
    """The heartbeat sender of one node: receivers, their detectors, what changed.

    Feed it membership changes, heartbeat responses and the time; it says where to send
    heartbeats (:meth:`tick`) and which nodes this node now sees as unreachable or reachable
    again (:meth:`unreachable`, :meth:`reachable`).

    Example:
        >>> from membership import Address, UniqueAddress
        >>> a, b = (UniqueAddress(Address("10.0.0.1", p), "n", 1) for p in (1, 2))
        >>> state = HeartbeatSenderState(a)
        >>> state.add_member(b, now=0.0)
        >>> state.tick(0.0).receivers == (b,)
        True
        >>> state.unreachable(now=1.5), state.unreachable(now=10.0) == {b}
        (frozenset(), True)
    """

    _self_node: UniqueAddress = attrs.field(alias="self_node")
    _settings: FailureDetectorSettings = attrs.field(
        factory=FailureDetectorSettings, alias="settings"
    )
    _registry: FailureDetectorRegistry = attrs.field(
        default=attrs.Factory(
            lambda self: FailureDetectorRegistry(settings=self._settings), takes_self=True
        ),
        alias="registry",
    )
    _ring: HeartbeatNodeRing = attrs.field(init=False)
    _old_receivers_now_unreachable: set[UniqueAddress] = attrs.field(init=False, factory=set)
    _expected_first: dict[UniqueAddress, float] = attrs.field(init=False, factory=dict)
    _observed_unreachable: set[UniqueAddress] = attrs.field(init=False, factory=set)
    _sequence_nr: int = attrs.field(init=False, default=0)
    _last_tick: float | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._ring = HeartbeatNodeRing(
            self_node=self._self_node,
            nodes={self._self_node},
            monitored_by_nr_of_members=self._settings.monitored_by_nr_of_members,
        )

    @property
    def self_node(self) -> UniqueAddress:
        """The node this state sends heartbeats from."""
        return self._self_node

    @property
    def settings(self) -> FailureDetectorSettings:
        """The failure detector settings in use."""
        return self._settings

    @property
    def registry(self) -> FailureDetectorRegistry:
        """The failure detectors of the receivers."""
        return self._registry

    @property
    def ring(self) -> HeartbeatNodeRing:
        """The current heartbeat ring."""
        return self._ring

    @property
    def receivers(self) -> tuple[UniqueAddress, ...]:
        """Nodes heartbeats go to, sorted by address.

        The ring's choice plus former receivers that became unreachable before they were dropped.
        """
        return tuple(sorted(self._active_receivers()))

    def _active_receivers(self) -> set[UniqueAddress]:
        return set(self._ring.my_receivers) | self._old_receivers_now_unreachable

    def contains(self, node: UniqueAddress) -> bool:
        """True if ``node`` is on the ring."""
        return node in self._ring.nodes

    # -- membership -------------------------------------------------------------------------

    def init(
        self, nodes: Iterable[UniqueAddress], unreachable: Iterable[UniqueAddress], now: float
    ) -> None:
        """Replace the ring with a snapshot of the cluster (Akka's ``CurrentClusterState``).

        A node missing from the snapshot was removed: as :meth:`remove_member`, it is no longer
        heartbeated (even one that had stopped answering) and its detector is forgotten.
        """
        self._expire(now)
        members = frozenset(nodes)
        removed = self._ring.nodes - members - {self._self_node}
        self._membership_change(
            attrs.evolve(self._ring, nodes=members, unreachable=frozenset(unreachable)), now
        )
        for node in removed:
            self._forget(node)

    def add_member(self, node: UniqueAddress, now: float) -> None:
        """A member joined (or was first seen); it may become a receiver."""
        self._expire(now)
        if node != self._self_node:
            self._membership_change(self._ring.with_node(node), now)

    def remove_member(self, node: UniqueAddress, now: float) -> None:
        """A member was removed: stop heartbeating it and forget its detector.

        Removing this node itself does nothing: its heartbeat sender is about to stop.
        """
        self._expire(now)
        if node == self._self_node:
            return
        self._membership_change(self._ring.without_node(node), now)
        self._forget(node)

    def _forget(self, node: UniqueAddress) -> None:
        """``node`` left the cluster: no heartbeats to it, no detector, nothing expected."""
        self._registry.remove(node)
        self._old_receivers_now_unreachable.discard(node)
        self._expected_first.pop(node, None)
        self._observed_unreachable.discard(node)

    def unreachable_member(self, node: UniqueAddress, now: float) -> None:
        """The cluster sees ``node`` as unreachable (by any observer): pick another receiver."""
        self._expire(now)
        self._membership_change(self._ring.with_unreachable(node), now)

    def reachable_member(self, node: UniqueAddress, now: float) -> None:
        """The cluster sees ``node`` as reachable again."""
        self._expire(now)
        self._membership_change(self._ring.with_reachable(node), now)

    def _membership_change(self, ring: HeartbeatNodeRing, now: float) -> None:
        dropped = set(self._ring.my_receivers) - set(ring.my_receivers)
        for node in sorted(dropped):
            if self._registry.is_available(node, now):
                self._registry.remove(node)
            else:
                # Keep heartbeating it, or nobody would notice when it comes back.
                self._old_receivers_now_unreachable.add(node)
        self._ring = ring

    # -- heartbeats -------------------------------------------------------------------------

    def tick(self, now: float) -> HeartbeatRound:
        """A heartbeat round at ``now``: the heartbeat to send and where to send it."""
        self._expire(now)
        self._sequence_nr += 1
        receivers = self.receivers
        deadline = now + self._settings.expected_response_after
        for node in receivers:
            if not self._registry.is_monitoring(node):
                self._expected_first.setdefault(node, deadline)
        last, self._last_tick = self._last_tick, now
        return HeartbeatRound(
            heartbeat=Heartbeat(
                sender=self._self_node, sequence_nr=self._sequence_nr, creation_time=now
            ),
            receivers=receivers,
            starved=last is not None and now - last >= 2 * self._settings.heartbeat_interval,
        )

    def heartbeat_rsp(self, from_node: UniqueAddress, now: float) -> bool:
        """A :class:`HeartbeatRsp` from ``from_node`` arrived at ``now``.

        Returns:
            True if it was recorded; False if ``from_node`` is not a receiver (a late answer
            after a membership change, or a stranger), which is ignored.
        """
        self._expire(now)
        if from_node not in self._active_receivers():
            return False
        self._registry.heartbeat(from_node, now)
        if from_node in self._old_receivers_now_unreachable:
            # Back from unreachable: if the ring no longer picks it, heartbeating it can stop.
            if from_node not in self._ring.my_receivers:
                self._registry.remove(from_node)
            self._old_receivers_now_unreachable.discard(from_node)
        return True

    def _expire(self, now: float) -> None:
        due = sorted(
            (deadline, node) for node, deadline in self._expected_first.items() if deadline <= now
        )
        for deadline, node in due:
            del self._expected_first[node]
            if node in self._active_receivers() and not self._registry.is_monitoring(node):
                # Never answered: start its detector as if it had, so it can be detected.
                self._registry.heartbeat(node, deadline)

    # -- reaping ----------------------------------------------------------------------------

    def unreachable(self, now: float) -> frozenset[UniqueAddress]:
        """Nodes this node newly sees as unreachable at ``now``.

        Each is reported once, until :meth:`reachable` reports it back; the cluster core records
        ``observer=self_node, subject=node, Unreachable`` for each.
        """
        self._expire(now)
        newly = {
            node
            for node in self._ring.ordered
            if node != self._self_node
            and node not in self._observed_unreachable
            and not self._registry.is_available(node, now)
        }
        self._observed_unreachable |= newly
        return frozenset(newly)

    def reachable(self, now: float) -> frozenset[UniqueAddress]:
        """Nodes reported by :meth:`unreachable` that this node sees as available again."""
        self._expire(now)
        back = {
            node
            for node in sorted(self._observed_unreachable)
            if self._registry.is_available(node, now)
        }
        self._observed_unreachable -= back
        return frozenset(back)

    def statistics(self) -> HeartbeatSenderStatistics:
        """Diagnostics: rounds sent, ring size, receivers, detectors, pending timers."""
        return HeartbeatSenderStatistics(
            sequence_nr=self._sequence_nr,
            nodes=len(self._ring.nodes),
            receivers=self.receivers,
            monitored=self._registry.monitored(),
            awaiting_first_response=tuple(sorted(self._expected_first)),
            observed_unreachable=tuple(sorted(self._observed_unreachable)),
        )
