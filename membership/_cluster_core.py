"""The membership protocol of one node, sans-IO: Akka's ``ClusterCoreDaemon`` as a state machine.

Theory of operation: :class:`ClusterCore` holds this node's gossip and reacts to three kinds of
input: messages from peers (:meth:`receive`), the passage of time (:meth:`tick`) and local
requests (:meth:`join`, :meth:`leave`, :meth:`down`, :meth:`update_reachability` from the failure
detector, :meth:`exiting_completed`). Each returns the effects to carry out, as values:
:class:`Send`, :class:`Publish`, :class:`StartExiting` and :class:`Shutdown`. Time comes in as an
argument and randomness from an injected ``random.Random``, so a run is a pure function of its
inputs and a seed.

Phases::

    IDLE ──start()──► SEEDING ──InitJoinAck──► JOINING ──Welcome──► MEMBER ──► SHUT_DOWN
      │                  │ (first seed, nobody answers: joins itself) ▲
      └──join(address)───┴───────────────────► JOINING ───────────────┘

Joining (Akka's seed node process): the first seed node asks the other seeds with InitJoin and,
if none answers within ``seed_node_timeout``, forms the cluster by joining itself; every other
node keeps asking the seeds until one that is a member answers, then sends Join and waits for
Welcome, retrying after ``retry_unsuccessful_join_after``. A member that receives Join adds the
node as Joining, unless that incarnation was removed (tombstone: it may never return) or another
incarnation of the same host:port is still a member: then the old one is marked terminated and
Down, and the new one is let in as soon as the old one is removed (Akka leaves it to the joiner's
next retry, ``retry_unsuccessful_join_after`` later), if that comes before the joiner's retry.

Gossip: every ``gossip_interval`` the node picks a random reachable member, preferring one that
has not seen the current version (with Akka's probability), and sends the full gossip if that
member has not seen it, else only a status (version and seen digest) so the two can tell who is
behind. Receiving gossip compares vector clocks: same (unite seen sets), older (answer with ours),
newer (take it), concurrent (merge). While fewer than half the members have seen the current
version, gossip goes out three times per interval (Akka's speed-up).

A node that finds itself Down in the gossip, or finds its incarnation tombstoned, shuts down. A
node that finds itself Exiting runs its exiting tasks (:class:`StartExiting`; singletons hand
over), then tells the members with ExitingConfirmed so the leader can remove it at once.

Islands (not in Akka): the first seed forms a new cluster when no other seed answers in time, so
if it restarts while a partition cuts it off from the other seeds it forms a second cluster of the
same name, which others may join. Akka leaves the two apart for ever. Here every member probes
for another cluster of its name and the smaller one gives way (see ``_islands``: where it probes,
how a sighting becomes a verdict, and why both sides agree); the loser downs all its members, this
node last, through the normal Down path, and a supervisor restarts them. A node looking for a
cluster (seeding) that is probed by a member of one asks that member too, and a first seed node
forms a new cluster only when no such member probed it lately: so the restarted loser joins the
winner even when every seed node was on the losing side. A first seed node also waits a little
longer when a link to another seed comes up just before its time is out (:meth:`peer_linked`):
right after a partition heals, its questions are only then on their way.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import random
from collections.abc import Collection

import attrs

from ._cluster_messages import (
    Down,
    ExitingConfirmed,
    GossipEnvelope,
    GossipStatus,
    InitJoin,
    InitJoinAck,
    InitJoinNack,
    Join,
    Leave,
    OtherClusterSeen,
    Welcome,
)
from ._cluster_settings import ClusterSettings, check_roles
from ._events import ClusterEvent, MemberRemoved, diff
from ._gossip import (
    Gossip,
    convergence,
    is_reachable,
    leader,
    leader_actions_on_convergence,
    leader_actions_weakly_up,
    oldest,
)
from ._islands import IslandFinder, Sighting, Verdict
from ._member import Member, MemberStatus
from ._vclock import Order, VectorClock
from .transport._address import Address, UniqueAddress, node_order

logger = logging.getLogger("membership.cluster")


class Phase(enum.Enum):
    """Where this node is in joining the cluster."""

    IDLE = "idle"
    SEEDING = "seeding"
    JOINING = "joining"
    MEMBER = "member"
    SHUT_DOWN = "shut_down"


# ---- effects -----------------------------------------------------------------------------------


@attrs.frozen
class Send:
    """Send ``message`` to ``to``."""

    to: Address | UniqueAddress
    message: object


@attrs.frozen
class Publish:
    """Tell subscribers about ``event``."""

    event: ClusterEvent


@attrs.frozen
class StartExiting:
    """This node is Exiting: run the exiting tasks, then call ``exiting_completed``."""


@attrs.frozen
class Shutdown:
    """This node is out of the cluster (downed or removed): stop its services."""

    reason: str


Effect = Send | Publish | StartExiting | Shutdown


def seen_digest(gossip: Gossip) -> bytes:
    """A digest of who has seen ``gossip`` (Akka's seenDigest)."""
    text = ",".join(f"{n.address}-{n.uid:x}" for n in sorted(gossip.seen, key=node_order))
    return hashlib.sha1(text.encode(), usedforsecurity=False).digest()


@attrs.define(eq=False)
class ClusterCore:
    """The membership state machine of one node (see the module docstring)."""

    self_node: UniqueAddress
    settings: ClusterSettings
    random: random.Random
    seed_nodes: tuple[Address, ...] = ()
    """Where to ask to join; the first one forms the cluster if nobody answers (none: call
    :meth:`join` yourself)."""
    roles: frozenset[str] = attrs.field(default=frozenset(), converter=check_roles)
    """This node's roles."""
    wall_offset: float = 0.0
    """Added to ``now`` for tombstone stamps, which other nodes compare with their own clocks:
    the shell passes wall-clock minus monotonic time (0 in simulation)."""
    app_version: str = ""
    """This node's application version, told to the cluster when it joins."""
    phase: Phase = Phase.IDLE
    gossip: Gossip = attrs.field(factory=Gossip)
    exiting_confirmed: set[UniqueAddress] = attrs.field(factory=set)
    _join_target: Address | None = None
    _seeding_deadline: float = 0.0
    _next_seed_round: float = 0.0
    _next_join_retry: float = 0.0
    _next_gossip: float = 0.0
    _next_leader_actions: float = 0.0
    _first_non_convergence: float | None = None
    _exiting_started: bool = False
    _islands: IslandFinder = attrs.field(init=False)
    """Probes for, and sightings of, other clusters of this name (see ``_islands``)."""
    _candidates: dict[Address, float] = attrs.field(factory=dict)
    """While seeding: addresses a member of a cluster of ours probed us from, until when they
    are asked too (a restarted node finds the cluster that won a merge through them)."""
    _seeding_limit: float = 0.0
    """The latest a first seed node waits for other seeds, however many links come up."""
    _final_round_at: float | None = None
    """When a first seed node asked the other seeds one last time, past its deadline."""
    _nacked: dict[Address, float] = attrs.field(factory=dict)
    """While seeding: when each seed node last said it is no member (it is up, seeding too)."""
    _deferred_joins: dict[Address, tuple[Join, float]] = attrs.field(factory=dict)
    """Joins of new incarnations waiting for the old one to be removed: the Join, and when the
    joiner stops waiting for our Welcome (it asks again then)."""

    def __attrs_post_init__(self) -> None:
        self._islands = IslandFinder(
            self.self_node,
            self.seed_nodes,
            self.settings.seed_probe_interval,
            self.settings.seed_node_retry_interval,
        )

    # ---- public state ----

    @property
    def self_member(self) -> Member | None:
        """This node's member entry, once it is in the gossip."""
        return self.gossip.member(self.self_node)

    def is_leader(self) -> bool:
        """Whether this node is the leader now."""
        return self.phase is Phase.MEMBER and leader(self.gossip, self.self_node) == self.self_node

    def next_deadline(self) -> float:
        """The earliest time :meth:`tick` has something to do."""
        if self.phase is Phase.SEEDING:
            if self.seed_nodes[0] == self.self_node.address:
                # Not before every member that probed us had its chance to answer.
                form_at = max([self._seeding_deadline, *self._candidates.values()])
                return min(self._next_seed_round, form_at)
            return self._next_seed_round
        if self.phase is Phase.JOINING:
            return self._next_join_retry
        if self.phase is Phase.MEMBER:
            return min(self._next_gossip, self._next_leader_actions, self._islands.next_deadline())
        return float("inf")

    def addresses_in_use(self) -> set[Address]:
        """The addresses this node has reason to reach.

        Members' (removed ones are not), the seed nodes', where it joins or is asked to let
        someone in, and where it probes for islands. The transport forgets links to any other
        address once idle (``Transport.prune``).
        """
        addresses = {m.node.address for m in self.gossip.members}
        addresses |= self._islands.addresses() | set(self._candidates) | set(self._deferred_joins)
        if self._join_target is not None:
            addresses.add(self._join_target)
        return addresses

    def sightings(self, now: float) -> list[Sighting]:
        """Other clusters of this name seen lately (see ``_islands``)."""
        return self._islands.sightings(now)

    def peer_linked(self, address: Address, now: float) -> list[Effect]:
        """The transport's link to ``address`` just came up (a heal, or a peer that started).

        A first seed node still looking for the other seeds waits a little longer then: what it
        asked the others is only now on its way, and their answers need a round trip. Bounded:
        never past twice ``seed_node_timeout`` after it started looking.
        """
        if (
            self.phase is Phase.SEEDING
            and self.seed_nodes[0] == self.self_node.address
            and (address in self.seed_nodes or address in self._candidates)
        ):
            grace = now + 2 * self.settings.seed_node_retry_interval
            self._seeding_deadline = min(max(self._seeding_deadline, grace), self._seeding_limit)
        return []

    # ---- local requests ----

    def start(self, now: float) -> list[Effect]:
        """Begin joining through the seed nodes (nothing to do without seed nodes).

        A node that is its own only seed node has nobody to ask: it forms its cluster after
        ``own_seed_listen`` rather than ``seed_node_timeout``, unless a member of a running
        cluster of its name probes it meanwhile (it was restarted while that cluster ran on),
        which it then joins.
        """
        if self.phase is not Phase.IDLE or not self.seed_nodes:
            return []
        self.phase = Phase.SEEDING
        own_only = self.seed_nodes == (self.self_node.address,)
        if own_only and self.settings.own_seed_listen == 0:
            logger.info("%s: the only seed node is this one; forming a new cluster", self.self_node)
            return self._join_self(now)
        wait = self.settings.own_seed_listen if own_only else self.settings.seed_node_timeout
        self._seeding_deadline = now + wait
        self._final_round_at = None
        self._nacked.clear()
        self._seeding_limit = now + 2 * wait
        self._next_seed_round = now
        return self.tick(now)

    def join_seed_nodes(self, seed_nodes: Collection[Address], now: float) -> list[Effect]:
        """Begin joining through ``seed_nodes`` found after the start (Akka's joinSeedNodes).

        For a node started without seed nodes whose bootstrap found members to join through:
        it asks them as it asks seed nodes, joins the first that answers, and asks them all
        again if a join goes unanswered. This node itself is left out of the list, so it never
        forms a cluster from it. Nothing happens unless the node is idle (not joining yet).
        """
        seeds = tuple(dict.fromkeys(a for a in seed_nodes if a != self.self_node.address))
        if self.phase is not Phase.IDLE or not seeds:
            return []
        self.seed_nodes = seeds
        self._islands = IslandFinder(
            self.self_node,
            self.seed_nodes,
            self.settings.seed_probe_interval,
            self.settings.seed_node_retry_interval,
        )
        return self.start(now)

    def join(self, address: Address, now: float) -> list[Effect]:
        """Join the cluster through the member at ``address`` (this node's own: form one)."""
        if self.phase in (Phase.MEMBER, Phase.SHUT_DOWN):
            logger.info(
                "%s: already %s; join(%s) ignored", self.self_node, self.phase.value, address
            )
            return []
        if address == self.self_node.address:
            return self._join_self(now)
        self.phase = Phase.JOINING
        self._join_target = address
        self._next_join_retry = now + self.settings.retry_unsuccessful_join_after
        logger.info("%s: joining through %s", self.self_node, address)
        join = Join(node=self.self_node, roles=self.roles, app_version=self.app_version)
        return [Send(address, join)]

    def leave(self, address: Address, now: float) -> list[Effect]:
        """Mark the member at ``address`` Leaving (this node's own: leave gracefully)."""
        if self.phase is not Phase.MEMBER:
            return []
        return self._leaving(address, now)

    def down(self, address: Address | UniqueAddress, now: float) -> list[Effect]:
        """Mark the member at ``address`` Down (a user or the split brain resolver decided)."""
        if self.phase is not Phase.MEMBER:
            return []
        return self._downing(address, now)

    def down_nodes(self, nodes: Collection[UniqueAddress], now: float) -> list[Effect]:
        """Mark ``nodes`` Down in one decision (the split brain resolver's), this node last.

        When the decision downs this node too, every other member it downs is sent the new
        gossip before this node shuts down: they are on its side of the partition, so they
        learn of their own downing at once instead of running on until their own resolver
        decides (the margin ``stable_after`` promises the other side).
        """
        if self.phase is not Phase.MEMBER:
            return []
        downed = set(nodes)
        effects: list[Effect] = []
        for node in sorted(downed - {self.self_node}):
            effects += self._downing(node, now)
        if self.self_node not in downed:
            return effects
        last = self._downing(self.self_node, now)
        tell: list[Effect] = [
            self._full_gossip_to(m.node)
            for m in self.gossip.members
            if m.node in downed and m.node != self.self_node
        ]
        shutdown = [e for e in last if isinstance(e, Shutdown)]
        return effects + [e for e in last if not isinstance(e, Shutdown)] + tell + shutdown

    def update_reachability(
        self, unreachable: Collection[UniqueAddress], now: float
    ) -> list[Effect]:
        """Record what this node's failure detector says: ``unreachable`` are not heard."""
        if self.phase is not Phase.MEMBER:
            return []
        me = self.self_member
        if me is None or me.status is MemberStatus.DOWN:
            return []
        reachability = self.gossip.reachability
        updated = reachability
        for m in self.gossip.members:
            if m.node == self.self_node:
                continue
            if m.node in unreachable:
                updated = updated.unreachable(self.self_node, m.node)
            else:
                updated = updated.reachable(self.self_node, m.node)
        if updated == reachability:
            return []
        for node in sorted(
            set(updated.all_unreachable_from(self.self_node))
            - set(reachability.all_unreachable_from(self.self_node))
        ):
            logger.warning("%s: marking %s unreachable", self.self_node, node)
        return self._update(attrs.evolve(self.gossip, reachability=updated), now)

    def exiting_completed(self, now: float) -> list[Effect]:
        """This node's exiting tasks are done: let the members remove it at once."""
        if self.phase is not Phase.MEMBER:
            return []
        confirmed = ExitingConfirmed(node=self.self_node)
        self.exiting_confirmed.add(self.self_node)
        return [Send(m.node, confirmed) for m in self.gossip.members if m.node != self.self_node]

    # ---- time ----

    def tick(self, now: float) -> list[Effect]:
        """Do what is due at ``now``: seed rounds, join retries, gossip, leader actions."""
        effects: list[Effect] = []
        if self.phase is Phase.SEEDING:
            effects += self._seed_tick(now)
        elif self.phase is Phase.JOINING and now >= self._next_join_retry:
            assert self._join_target is not None
            logger.info(
                "%s: no Welcome from %s; asking the seeds again", self.self_node, self._join_target
            )
            if self.seed_nodes:
                self.phase = Phase.IDLE
                effects += self.start(now)
            else:
                self.phase = Phase.IDLE
                effects += self.join(self._join_target, now)
        if self.phase is Phase.MEMBER:
            if now >= self._next_leader_actions:
                self._next_leader_actions = now + self.settings.leader_actions_interval
                effects += self._leader_actions(now)
                effects += self._admit_deferred_joins(now)
            if now >= self._next_gossip and self.phase is Phase.MEMBER:
                effects += self._gossip_round()
                interval = self.settings.gossip_interval
                speedup = len(self.gossip.seen) < len(self.gossip.members) / 2
                self._next_gossip = now + (interval / 3 if speedup else interval)
            if now >= self._islands.next_deadline() and self.phase is Phase.MEMBER:
                effects += self._probe(now)
        return effects

    def _seed_tick(self, now: float) -> list[Effect]:
        seeds = self.seed_nodes
        me = self.self_node.address
        self._candidates = {a: until for a, until in self._candidates.items() if until > now}
        if seeds[0] == me and now >= self._seeding_deadline and not self._candidates:
            if self._final_round_at is None and self._silent_seeds(now):
                # One last round, asked after the deadline, and a round's time to answer: a
                # partition that healed just before the deadline gets its chance (the
                # transport connects afresh for each round). Not when every other seed said it
                # is no member: they are up, and looking for a cluster too.
                self._final_round_at = now
                self._seeding_deadline = min(
                    now + self.settings.seed_node_retry_interval, self._seeding_limit
                )
                self._next_seed_round = now
            else:
                return self._form(now)
        if now < self._next_seed_round:
            return []
        self._next_seed_round = now + self.settings.seed_node_retry_interval
        asked = [seed for seed in seeds if seed != me]
        asked += sorted(set(self._candidates) - set(asked))
        return [Send(address, InitJoin(sender=self.self_node)) for address in asked]

    def _silent_seeds(self, now: float) -> list[Address]:
        """The other seed nodes that did not answer the last two rounds (not even a Nack)."""
        horizon = now - 2 * self.settings.seed_node_retry_interval
        me = self.self_node.address
        return [
            seed
            for seed in self.seed_nodes
            if seed != me and self._nacked.get(seed, float("-inf")) < horizon
        ]

    def _form(self, now: float) -> list[Effect]:
        """Seeding is over and nobody answered: form a new cluster, this node its first member."""
        if self.seed_nodes == (self.self_node.address,):
            logger.info(
                "%s: the only seed node is this one, and no cluster of our name probed it; "
                "forming a new cluster",
                self.self_node,
            )
        else:
            logger.info("%s: no other seed node answered; forming a new cluster", self.self_node)
        return self._join_self(now)

    def _join_self(self, now: float) -> list[Effect]:
        me = Member(self.self_node, roles=self.roles, app_version=self.app_version)
        self._become_member(now)
        return self._update(Gossip([me]), now)

    def _become_member(self, now: float) -> None:
        self.phase = Phase.MEMBER
        self._join_target = None
        self._next_gossip = now
        self._next_leader_actions = now
        self._candidates.clear()
        # Every member probes, not only seed nodes: an island may hold no seed node at all
        # (its seed node was downed and restarted into the main cluster). Not at once: a new
        # member's view may still lag behind its cluster's.
        self._islands.start(now)

    # ---- islands ----

    def _live_addresses(self) -> set[Address]:
        gossip = self.gossip
        return {
            m.node.address
            for m in gossip.members
            if m.status not in (MemberStatus.DOWN, MemberStatus.REMOVED)
            and is_reachable(gossip, m.node)
        }

    def _probe(self, now: float) -> list[Effect]:
        """Ask the addresses where another cluster of our name may be (see ``_islands``)."""
        me = self.self_member
        if me is None or me.status not in (
            MemberStatus.JOINING,
            MemberStatus.WEAKLY_UP,
            MemberStatus.UP,
        ):
            self._islands.probe(now, set())  # keeps the schedule; nothing is sent
            return []
        targets = self._islands.probe(now, self._live_addresses())
        if not targets:
            return []
        first, size = self._identity()
        probe = InitJoin(sender=self.self_node, oldest=first, size=size)
        return [Send(address, probe) for address in targets]

    def _identity(self) -> tuple[UniqueAddress | None, int]:
        """This cluster's oldest Up member and its count of Up and WeaklyUp members."""
        gossip = self.gossip
        first = oldest(gossip, statuses=(MemberStatus.UP,))
        size = sum(m.status in (MemberStatus.UP, MemberStatus.WEAKLY_UP) for m in gossip.members)
        return (None if first is None else first.node), size

    def _on_init_join_ack(
        self, sender: UniqueAddress, ack: InitJoinAck, now: float
    ) -> list[Effect]:
        if self.phase is Phase.SEEDING:
            return self.join(sender.address, now)
        if not self._islands.probed_lately(sender.address, now):
            return []  # a late answer from when we were joining
        return self._sighted(sender, ack.oldest, ack.size, now)

    def _sighted(
        self, sender: UniqueAddress, their_oldest: UniqueAddress | None, size: int, now: float
    ) -> list[Effect]:
        """``sender`` said its cluster's oldest member and size: is it another cluster?"""
        if (
            self.phase is not Phase.MEMBER
            or their_oldest is None
            or self.gossip.has_member(sender)
            or self.gossip.has_member(their_oldest)
            or self.gossip.is_tombstoned(their_oldest)
        ):
            return []
        me = self.self_member
        if me is None or me.status not in (MemberStatus.WEAKLY_UP, MemberStatus.UP):
            return []
        own_oldest, own_size = self._identity()
        if own_oldest is None:
            return []  # the other side skips too: what we say carries no oldest
        effects: list[Effect] = []
        if self._islands.is_new(their_oldest, sender.address):
            if self._islands.is_new(their_oldest):
                logger.info(
                    "%s: %s speaks for another cluster of our name (oldest %s, %d members; "
                    "ours %d); telling our members to probe it too",
                    self.self_node,
                    sender,
                    their_oldest,
                    size,
                    own_size,
                )
            seen = OtherClusterSeen(sender=self.self_node, at=(sender.address,))
            live = self._live_addresses()
            effects += [
                Send(m.node, seen)
                for m in self.gossip.members
                if m.node != self.self_node and m.node.address in live
            ]
        verdict = self._islands.observe(now, sender, their_oldest, size, own_oldest, own_size)
        if verdict is None:
            return effects
        loses = verdict is Verdict.LOSES
        logger.log(
            logging.WARNING,
            "%s: found another cluster of the same name (oldest %s, %d members) at %s; ours "
            "(oldest %s, %d members) %s",
            self.self_node,
            their_oldest,
            size,
            sender.address,
            own_oldest,
            own_size,
            "loses: downing all our members so that they rejoin it"
            if loses
            else "wins: the other one will down itself",
        )
        return effects + (self._down_own_cluster(now) if loses else [])

    def _down_own_cluster(self, now: float) -> list[Effect]:
        """Down every member, this node last, as the split brain resolver's down-all does."""
        return self.down_nodes([m.node for m in self.gossip.members], now)

    # ---- messages ----

    def receive(self, sender: UniqueAddress, message: object, now: float) -> list[Effect]:
        """Handle one protocol message from ``sender``."""
        match message:
            case InitJoin():
                return self._on_init_join(sender, message, now)
            case InitJoinAck():
                return self._on_init_join_ack(sender, message, now)
            case InitJoinNack():
                if self.phase is Phase.SEEDING:
                    self._nacked[sender.address] = now
                return []
            case Join():
                return self._on_join(message, now)
            case Welcome(gossip=gossip):
                return self._on_welcome(sender, gossip, now)
            case GossipEnvelope(to=to, gossip=gossip):
                if to != self.self_node:
                    return []
                return self._on_gossip(sender, gossip, now)
            case GossipStatus(version=version, seen_digest=digest):
                return self._on_gossip_status(sender, version, digest)
            case Leave(node=node):
                return self.leave(node, now)
            case Down(node=node):
                return self.down(node, now)
            case ExitingConfirmed(node=node):
                self.exiting_confirmed.add(node)
                return []
            case OtherClusterSeen(at=at):
                if self.phase is Phase.MEMBER:
                    self._islands.watch(at, now)
                return []
        return []

    def _on_init_join(self, sender: UniqueAddress, probe: InitJoin, now: float) -> list[Effect]:
        if probe.oldest is not None and probe.size > 0:
            if self.phase in (Phase.SEEDING, Phase.JOINING, Phase.IDLE):
                return self._candidate(sender, now) + self._answer_init_join(sender)
            return self._answer_init_join(sender) + self._sighted(
                sender, probe.oldest, probe.size, now
            )
        return self._answer_init_join(sender)

    def _candidate(self, sender: UniqueAddress, now: float) -> list[Effect]:
        """While looking for a cluster: a member of one probed us. Ask it too, at once."""
        if self.phase is not Phase.SEEDING:
            return []
        new = sender.address not in self._candidates
        self._candidates[sender.address] = now + self.settings.seed_node_timeout
        if not new:
            return []
        logger.info(
            "%s: a member of a cluster of our name probed us from %s; asking it too",
            self.self_node,
            sender.address,
        )
        return [Send(sender.address, InitJoin(sender=self.self_node))]

    def _answer_init_join(self, sender: UniqueAddress) -> list[Effect]:
        me = self.self_member
        if (
            self.phase is Phase.MEMBER
            and me is not None
            and me.status
            in (
                MemberStatus.UP,
                MemberStatus.WEAKLY_UP,
                MemberStatus.JOINING,
                MemberStatus.LEAVING,
            )
        ):
            first, size = self._identity()
            return [Send(sender, InitJoinAck(sender=self.self_node, oldest=first, size=size))]
        return [Send(sender, InitJoinNack(sender=self.self_node))]

    def _on_join(self, join: Join, now: float) -> list[Effect]:
        node, roles = join.node, frozenset(join.roles)
        if self.phase is not Phase.MEMBER:
            return []
        gossip = self.gossip
        if gossip.is_tombstoned(node):
            # It was removed before it learnt it was in (our Welcome lost, say): it retries its
            # join for ever unless told. The gossip's tombstone tells it, so that it shuts down
            # and its supervisor starts a new incarnation, which may join.
            logger.info(
                "%s: %s was removed and may not join again; telling it", self.self_node, node
            )
            return [Send(node, Welcome(sender=self.self_node, gossip=gossip))]
        existing = gossip.member(node)
        if existing is not None:
            # Our Welcome was lost, or it retried: welcome it again.
            return [Send(node, Welcome(sender=self.self_node, gossip=gossip))]
        old = [m for m in gossip.members if m.node.address == node.address]
        if old:
            # A node restarted quickly may leave several old incarnations: down every one of
            # them (not only the first); the joiner gets in once they are removed
            # (_admit_deferred_joins), or with its next retry.
            self._deferred_joins[node.address] = (
                join,
                now + self.settings.retry_unsuccessful_join_after,
            )
            effects = []
            for m in old:
                logger.info(
                    "%s: new incarnation %s of %s; the old one is downed and removed first",
                    self.self_node,
                    node,
                    m.node,
                )
                if m.status is MemberStatus.DOWN:
                    continue
                gossip = self.gossip
                terminated = gossip.reachability.terminated(self.self_node, m.node)
                effects += self._update(attrs.evolve(gossip, reachability=terminated), now)
                effects += self._downing(m.node, now)
            return effects
        logger.info(
            "%s: %s is joining with roles %s", self.self_node, node, sorted(roles) or "none"
        )
        member = Member(node, roles=roles, app_version=join.app_version)
        effects = self._update(gossip.with_member(member), now)
        effects.append(Send(node, Welcome(sender=self.self_node, gossip=self.gossip)))
        return effects

    def _on_welcome(self, sender: UniqueAddress, gossip: Gossip, now: float) -> list[Effect]:
        if self.phase is not Phase.JOINING or sender.address != self._join_target:
            return []
        if gossip.is_tombstoned(self.self_node):
            return self._shut_down("removed from the cluster before it was welcomed")
        if not gossip.has_member(self.self_node):
            return []
        logger.info("%s: welcomed by %s", self.self_node, sender)
        self._become_member(now)
        old = self.gossip
        self.gossip = gossip.mark_seen(self.self_node)
        effects: list[Effect] = self._changes(old, self.gossip, now)
        effects.append(self._full_gossip_to(sender))
        return effects + self._check_self()

    def _on_gossip(self, sender: UniqueAddress, remote: Gossip, now: float) -> list[Effect]:
        if self.phase is not Phase.MEMBER:
            return []
        local = self.gossip
        if remote.is_tombstoned(self.self_node):
            return self._shut_down("removed from the cluster")
        if local.is_tombstoned(sender):
            # A removed node still talks to us: show it the tombstone so it stops.
            return [Send(sender, GossipEnvelope(sender=self.self_node, to=sender, gossip=local))]
        if not remote.has_member(self.self_node) or not local.has_member(sender):
            return []
        order = remote.version.compare(local.version)
        # Talk back (always with the full gossip) when the sender does not know that we have
        # seen the winning version: that is how seen sets flow back to whoever made a change.
        unaware = not remote.seen_by(self.self_node)
        if order is Order.SAME:
            winner, talkback = local.merge_seen(remote), unaware
        elif order is Order.BEFORE:
            winner, talkback = local, True
        elif order is Order.AFTER:
            winner, talkback = remote, unaware
        else:
            winner, talkback = remote.merge(local), True
        winner = winner.mark_seen(self.self_node)
        self.gossip = winner
        effects: list[Effect] = self._changes(local, winner, now)
        if talkback:
            effects.append(self._full_gossip_to(sender))
        return effects + self._check_self() + self._admit_deferred_joins(now)

    def _admit_deferred_joins(self, now: float) -> list[Effect]:
        """Let in the new incarnations whose old ones are gone from the gossip now."""
        if not self._deferred_joins or self.phase is not Phase.MEMBER:
            return []
        effects: list[Effect] = []
        for address, (join, until) in list(self._deferred_joins.items()):
            if now >= until or self.gossip.member(join.node) is not None:
                del self._deferred_joins[address]  # it asks again by itself, or it got in
            elif not any(m.node.address == address for m in self.gossip.members):
                del self._deferred_joins[address]
                effects += self._on_join(join, now)
        return effects

    def _on_gossip_status(
        self, sender: UniqueAddress, version: VectorClock, digest: bytes
    ) -> list[Effect]:
        if self.phase is not Phase.MEMBER:
            return []
        if self.gossip.is_tombstoned(sender):
            return [
                Send(sender, GossipEnvelope(sender=self.self_node, to=sender, gossip=self.gossip))
            ]
        if not self.gossip.has_member(sender):
            return []
        order = version.compare(self.gossip.version)
        if order is Order.SAME:
            if digest != seen_digest(self.gossip):
                return [self._full_gossip_to(sender)]
            return []
        if order is Order.AFTER:
            return [Send(sender, self._status())]  # they are ahead: they will send it
        return [self._full_gossip_to(sender)]

    # ---- changes ----

    def _update(self, gossip: Gossip, now: float) -> list[Effect]:
        """Adopt a locally changed gossip: new version, seen only by us, publish, check self."""
        old = self.gossip
        self.gossip = gossip.incremented(self.self_node).only_seen(self.self_node)
        return self._changes(old, self.gossip, now) + self._check_self()

    def _changes(self, old: Gossip, new: Gossip, now: float) -> list[Effect]:
        """The events from ``old`` to ``new``, to publish; a downed member's removal is noted.

        The address of a member removed after it was downed (not one that left) is probed for
        a while: a cluster of our name may form there if it restarts cut off from us.
        """
        events = diff(old, new, self.self_node)
        for event in events:
            if isinstance(event, MemberRemoved) and event.previous_status is MemberStatus.DOWN:
                self._islands.add_contact(event.member.node.address, now)
        return [Publish(e) for e in events]

    def _leaving(self, address: Address, now: float) -> list[Effect]:
        for m in self.gossip.members:
            if m.node.address == address and m.status in (
                MemberStatus.JOINING,
                MemberStatus.WEAKLY_UP,
                MemberStatus.UP,
            ):
                logger.info("%s: marking %s Leaving", self.self_node, m.node)
                return self._update(
                    self.gossip.with_member(m.with_status(MemberStatus.LEAVING)), now
                )
        return []

    def _downing(self, address: Address | UniqueAddress, now: float) -> list[Effect]:
        for m in self.gossip.members:
            matches = (
                m.node == address
                if isinstance(address, UniqueAddress)
                else m.node.address == address
            )
            if matches and m.status is not MemberStatus.DOWN:
                logger.warning("%s: marking %s Down", self.self_node, m.node)
                return self._update(self.gossip.marked_down(m.node), now)
        return []

    def _check_self(self) -> list[Effect]:
        me = self.self_member
        if me is None:
            if self.phase is Phase.MEMBER:
                return self._shut_down("removed from the cluster")
            return []
        if me.status is MemberStatus.DOWN:
            return self._shut_down("downed")
        if me.status is MemberStatus.EXITING and not self._exiting_started:
            self._exiting_started = True
            return [StartExiting()]
        return []

    def _shut_down(self, reason: str) -> list[Effect]:
        if self.phase is Phase.SHUT_DOWN:
            return []
        logger.warning("%s: leaving the cluster: %s", self.self_node, reason)
        self.phase = Phase.SHUT_DOWN
        return [Shutdown(reason)]

    def _leader_actions(self, now: float) -> list[Effect]:
        wall = now + self.wall_offset
        self.gossip = self.gossip.pruned_tombstones(
            wall - self.settings.prune_gossip_tombstones_after
        )
        if not self.is_leader():
            self._first_non_convergence = None
            return []
        gossip = self.gossip
        if convergence(gossip, self.self_node, self.exiting_confirmed):
            self._first_non_convergence = None
            result = leader_actions_on_convergence(
                gossip,
                self.self_node,
                wall,
                exiting_confirmed=self.exiting_confirmed,
                min_nr_of_members=self.settings.min_nr_of_members,
                min_nr_of_members_of_role=self.settings.min_nr_of_members_of_role,
            )
        else:
            if self._first_non_convergence is None:
                self._first_non_convergence = now
            weakly_up_after = self.settings.weakly_up_after
            if weakly_up_after is None or now - self._first_non_convergence < weakly_up_after:
                return []
            result = leader_actions_weakly_up(gossip, self.self_node)
        if not result.changed:
            return []
        for m in result.moved_up:
            logger.info("%s: leader moved %s to Up (#%d)", self.self_node, m.node, m.up_number)
        for m in result.removed:
            logger.info("%s: leader removed %s", self.self_node, m.node)
            self.exiting_confirmed.discard(m.node)
        old = self.gossip
        self.gossip = result.gossip
        effects: list[Effect] = self._changes(old, self.gossip, now)
        # Removed nodes learn it from the tombstone; exiting ones are told at once, and so are
        # the two oldest members, where singletons run and must take over.
        tell = {m.node for m in result.removed} | {m.node for m in result.exiting}
        ages = sorted(self.gossip.members, key=Member.age_key)
        tell |= {m.node for m in ages[:2]} if result.exiting else set()
        for node in sorted(tell - {self.self_node}):
            effects.append(self._full_gossip_to(node))
        return effects + self._check_self()

    # ---- gossip out ----

    def _status(self) -> GossipStatus:
        return GossipStatus(
            sender=self.self_node, version=self.gossip.version, seen_digest=seen_digest(self.gossip)
        )

    def _full_gossip_to(self, node: UniqueAddress) -> Send:
        return Send(node, GossipEnvelope(sender=self.self_node, to=node, gossip=self.gossip))

    def _gossip_to(self, node: UniqueAddress) -> Send:
        if self.gossip.seen_by(node):
            return Send(node, self._status())
        return self._full_gossip_to(node)

    def _gossip_round(self) -> list[Effect]:
        gossip = self.gossip
        reachability = gossip.reachability
        candidates = [
            m.node
            for m in gossip.members
            if m.node != self.self_node and reachability.is_reachable_from(self.self_node, m.node)
        ]
        if not candidates:
            return []
        if self.random.random() < self._different_view_probability(len(gossip.members)):
            unseen = [n for n in candidates if not gossip.seen_by(n)]
            if unseen:
                candidates = unseen
        return [self._gossip_to(self.random.choice(candidates))]

    def _different_view_probability(self, size: int) -> float:
        p = self.settings.gossip_different_view_probability
        low = self.settings.reduce_gossip_different_view_probability
        high = low * 3
        if size <= low:
            return p
        if size >= high:
            return p / 10
        return p - (size - low) * (p - p / 10) / (high - low)
