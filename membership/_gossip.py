"""The gossiped cluster state and the rules computed from it. Sans-IO.

Theory of operation (Akka's ``Gossip`` and ``MembershipState``): every node holds one
:class:`Gossip`: the members, a reachability table, a vector clock version, the set of nodes that
have seen this exact version, and tombstones of removed incarnations. Nodes exchange it with
random peers. When two versions are concurrent they are merged: tombstones unite and remove their
members, members keep the status furthest along their life cycle, each observer's reachability
rows come from the side with that observer's newer version, and the merged state is seen by nobody
yet. That merge is
commutative, associative and idempotent (a hypothesis test checks it), so every node that has
heard the same updates holds the same state, whatever the order.

One deliberate difference in the merge: Akka also drops a member that only one side knows if it is
Down or Exiting, reasoning that the other side must have removed it. That is not associative (a
third view that never heard of the member makes the result depend on the merge order, as the
property test found), and it is not needed: every removal leaves a tombstone, and tombstones travel
with the gossip, so here only tombstones remove members in a merge.

*Convergence* is when every Up or Leaving member has seen the current version and no member is
unreachable unless it is Down or Exiting. Only then does the *leader*, the first reachable member
in address order (Up/Leaving preferred; no election), move members along: Joining/WeaklyUp to
Up with increasing ``up_number``, Leaving to Exiting, and unreachable Down/Exiting members out
(Removed, with a tombstone so that incarnation never comes back). While gossip does not converge,
the leader may move reachable Joining members to WeaklyUp after ``weakly_up_after``.

Differences from Akka: no data centers, no app-version, no PreparingForShutdown.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import attrs

from ._app_version import AppVersion
from ._member import (
    CONVERGENCE_STATUSES,
    LEADER_STATUSES,
    NOT_UP,
    SKIP_UNREACHABLE_STATUSES,
    Member,
    MemberStatus,
    highest_priority,
)
from ._reachability import Reachability
from ._vclock import VectorClock
from .transport._address import UniqueAddress, node_order
from .transport._wire import message


def _sorted_members(members: Iterable[Member]) -> tuple[Member, ...]:
    return tuple(sorted(members, key=lambda m: node_order(m.node)))


def _node_set(nodes: Iterable[UniqueAddress]) -> frozenset[UniqueAddress]:
    return frozenset(nodes)


def _sorted_tombstones(
    tombstones: Iterable[tuple[UniqueAddress, float]],
) -> tuple[tuple[UniqueAddress, float], ...]:
    return tuple(sorted(tombstones))


@message(name="p2pshard.Gossip")
@attrs.frozen
class Gossip:
    """One version of the cluster state."""

    members: tuple[Member, ...] = attrs.field(default=(), converter=_sorted_members)
    seen: frozenset[UniqueAddress] = attrs.field(default=frozenset(), converter=_node_set)
    reachability: Reachability = attrs.field(factory=Reachability)
    version: VectorClock = attrs.field(factory=VectorClock)
    tombstones: tuple[tuple[UniqueAddress, float], ...] = attrs.field(
        default=(), converter=_sorted_tombstones
    )

    def member(self, node: UniqueAddress) -> Member | None:
        """The member for ``node``, or None."""
        for m in self.members:
            if m.node == node:
                return m
        return None

    def has_member(self, node: UniqueAddress) -> bool:
        """Whether ``node`` is a member (in any status but Removed)."""
        return self.member(node) is not None

    def is_tombstoned(self, node: UniqueAddress) -> bool:
        """Whether ``node`` was removed: that incarnation may never return."""
        return any(n == node for n, _ in self.tombstones)

    def nodes(self) -> frozenset[UniqueAddress]:
        """Every member's incarnation."""
        return frozenset(m.node for m in self.members)

    def with_member(self, member: Member) -> Gossip:
        """This gossip with ``member`` added or replaced (same node)."""
        others = [m for m in self.members if m.node != member.node]
        return attrs.evolve(self, members=[*others, member])

    def incremented(self, node: UniqueAddress) -> Gossip:
        """A new version, made by ``node``."""
        return attrs.evolve(self, version=self.version.increment(node))

    def seen_by(self, node: UniqueAddress) -> bool:
        """Whether ``node`` has seen this version."""
        return node in self.seen

    def mark_seen(self, node: UniqueAddress) -> Gossip:
        """This version, also seen by ``node``."""
        if node in self.seen:
            return self
        return attrs.evolve(self, seen=self.seen | {node})

    def only_seen(self, node: UniqueAddress) -> Gossip:
        """This version, seen by ``node`` alone (after ``node`` changed it)."""
        return attrs.evolve(self, seen=frozenset({node}))

    def merge_seen(self, other: Gossip) -> Gossip:
        """Same version: unite who has seen it."""
        return attrs.evolve(self, seen=self.seen | other.seen)

    def merge(self, other: Gossip) -> Gossip:
        """Combine two concurrent versions (see the module docstring)."""
        tombstones = dict(self.tombstones)
        for node, when in other.tombstones:
            tombstones[node] = max(when, tombstones.get(node, when))
        version = self.version.merge(other.version)
        for node in tombstones:
            version = version.prune(node)
        mine = {m.node: m for m in self.members}
        theirs = {m.node: m for m in other.members}
        members = []
        for node in mine.keys() | theirs.keys():
            if node in tombstones:
                continue
            a, b = mine.get(node), theirs.get(node)
            if a is not None and b is not None:
                members.append(highest_priority(a, b))
            else:
                only = a if a is not None else b
                assert only is not None
                members.append(only)
        nodes = frozenset(m.node for m in members)
        reachability = self.reachability.merge(nodes, other.reachability)
        return Gossip(members, frozenset(), reachability, version, tombstones.items())

    def removed(self, node: UniqueAddress, now: float) -> Gossip:
        """``node`` taken out of the cluster, with a tombstone stamped ``now``."""
        return Gossip(
            [m for m in self.members if m.node != node],
            self.seen - {node},
            self.reachability.remove([node]),
            self.version.prune(node),
            [*self.tombstones, (node, now)],
        )

    def marked_down(self, node: UniqueAddress) -> Gossip:
        """``node`` moved to Down (and out of the seen set: it no longer counts)."""
        member = self.member(node)
        if member is None or member.status is MemberStatus.DOWN:
            return self
        return attrs.evolve(
            self.with_member(member.with_status(MemberStatus.DOWN)), seen=self.seen - {node}
        )

    def pruned_tombstones(self, older_than: float) -> Gossip:
        """Forget tombstones stamped before ``older_than``."""
        kept = [(n, t) for n, t in self.tombstones if t >= older_than]
        if len(kept) == len(self.tombstones):
            return self
        return attrs.evolve(self, tombstones=kept)


def reachability_excluding_downed(gossip: Gossip) -> Reachability:
    """The table without what Down members observed."""
    downed = [m.node for m in gossip.members if m.status is MemberStatus.DOWN]
    return gossip.reachability.remove_observers(downed)


def is_reachable(gossip: Gossip, node: UniqueAddress) -> bool:
    """Whether no member that is not Down sees ``node`` as unreachable."""
    return gossip.has_member(node) and reachability_excluding_downed(gossip).is_reachable(node)


def convergence(
    gossip: Gossip, self_node: UniqueAddress, exiting_confirmed: Collection[UniqueAddress] = ()
) -> bool:
    """Whether this version has converged (see the module docstring)."""
    confirmed = frozenset(exiting_confirmed)
    for m in gossip.members:
        if (
            m.status in CONVERGENCE_STATUSES
            and m.node not in gossip.seen
            and m.node not in confirmed
        ):
            return False
    for node in reachability_excluding_downed(gossip).all_unreachable_or_terminated():
        if node == self_node or node in confirmed:
            continue
        member = gossip.member(node)
        if member is not None and member.status not in SKIP_UNREACHABLE_STATUSES:
            return False
    return True


def leader(
    gossip: Gossip, self_node: UniqueAddress, role: str | None = None
) -> UniqueAddress | None:
    """The leader (of ``role``'s members): first reachable member by address, no election.

    Members that are Up or Leaving are preferred; otherwise Akka's leader status order
    (WeaklyUp, then Joining, then Exiting, Down never) decides.
    """
    reachability = gossip.reachability
    candidates = [
        m
        for m in gossip.members
        if m.has_role(role)
        and m.status is not MemberStatus.DOWN
        and (m.node == self_node or reachability.is_reachable(m.node))
    ]
    if not candidates:
        return None
    for m in candidates:  # already in address order
        if m.status in LEADER_STATUSES:
            return m.node
    return min(candidates, key=Member.leader_key).node


_HOSTS = (MemberStatus.UP, MemberStatus.LEAVING)
"""The statuses of members that may run singletons."""


def oldest(
    gossip: Gossip,
    role: str | None = None,
    statuses: Collection[MemberStatus] = _HOSTS,
) -> Member | None:
    """The oldest member (of ``role``) among those with one of ``statuses``.

    By default Up and Leaving: WeaklyUp and Joining members never run singletons.
    """
    eligible = [m for m in gossip.members if m.has_role(role) and m.status in statuses]
    return min(eligible, key=Member.age_key, default=None)


def singleton_host(gossip: Gossip, role: str | None = None) -> Member | None:
    """Where singletons (of ``role``) run: the oldest Up or Leaving member of the newest version.

    Without a rollout under way every member runs one ``app_version`` and this is
    :func:`oldest`. While members run different versions, it is the oldest of those that run
    the newest (:class:`~membership.AppVersion` order), so a rolling upgrade moves singletons
    once, to the first upgraded member, rather than at every step.
    """
    eligible = [m for m in gossip.members if m.has_role(role) and m.status in _HOSTS]
    if not eligible:
        return None
    first = eligible[0].app_version
    if any(m.app_version != first for m in eligible):
        newest = max(AppVersion.parse(m.app_version) for m in eligible)
        eligible = [m for m in eligible if AppVersion.parse(m.app_version) == newest]
    return min(eligible, key=Member.age_key)


@attrs.frozen
class LeaderActionResult:
    """What one round of leader actions changed."""

    gossip: Gossip
    moved_up: tuple[Member, ...] = ()
    moved_weakly_up: tuple[Member, ...] = ()
    exiting: tuple[Member, ...] = ()
    removed: tuple[Member, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether anything moved."""
        return bool(self.moved_up or self.moved_weakly_up or self.exiting or self.removed)


def leader_actions_on_convergence(
    gossip: Gossip,
    self_node: UniqueAddress,
    now: float,
    *,
    exiting_confirmed: Collection[UniqueAddress] = (),
    min_nr_of_members: int = 1,
    min_nr_of_members_of_role: Collection[tuple[str, int]] = (),
) -> LeaderActionResult:
    """Akka's ``leaderActionsOnConvergence``: call only on the leader and at convergence."""
    confirmed = frozenset(exiting_confirmed)
    removable = {
        node
        for node in reachability_excluding_downed(gossip).all_unreachable_or_terminated()
        if (m := gossip.member(node)) is not None and m.status in SKIP_UNREACHABLE_STATUSES
    }
    removable |= {
        m.node for m in gossip.members if m.node in confirmed and m.status is MemberStatus.EXITING
    }
    enough = _enough_members(gossip, min_nr_of_members, min_nr_of_members_of_role)
    up_number = max((m.up_number for m in gossip.members if m.up_number != NOT_UP), default=0)
    moved_up: list[Member] = []
    exiting: list[Member] = []
    updated = gossip
    for m in gossip.members:  # address order: up_numbers are assigned in that order
        if m.node in removable:
            continue
        if enough and m.status in (MemberStatus.JOINING, MemberStatus.WEAKLY_UP):
            up_number += 1
            moved = m.up(up_number)
            moved_up.append(moved)
            updated = updated.with_member(moved)
        elif m.status is MemberStatus.LEAVING:
            moved = m.with_status(MemberStatus.EXITING)
            exiting.append(moved)
            updated = updated.with_member(moved)
    removed: list[Member] = []
    for node in sorted(removable):
        member = updated.member(node)
        assert member is not None
        removed.append(member.with_status(MemberStatus.REMOVED))
        updated = updated.removed(node, now)
    result = LeaderActionResult(updated, tuple(moved_up), (), tuple(exiting), tuple(removed))
    if result.changed:
        result = attrs.evolve(result, gossip=updated.incremented(self_node).only_seen(self_node))
    return result


def leader_actions_weakly_up(gossip: Gossip, self_node: UniqueAddress) -> LeaderActionResult:
    """Akka's move of reachable Joining members to WeaklyUp while gossip does not converge."""
    reachability = reachability_excluding_downed(gossip)
    moved = [
        m.with_status(MemberStatus.WEAKLY_UP)
        for m in gossip.members
        if m.status is MemberStatus.JOINING and reachability.is_reachable(m.node)
    ]
    if not moved:
        return LeaderActionResult(gossip)
    updated = gossip
    for m in moved:
        updated = updated.with_member(m)
    updated = updated.incremented(self_node).only_seen(self_node)
    return LeaderActionResult(updated, moved_weakly_up=tuple(moved))


def _enough_members(gossip: Gossip, minimum: int, per_role: Collection[tuple[str, int]]) -> bool:
    counted = [m for m in gossip.members if m.status is not MemberStatus.DOWN]
    if len(counted) < minimum:
        return False
    return all(sum(1 for m in counted if role in m.roles) >= n for role, n in per_role)
