"""Cluster membership events, and how they follow from two gossip versions. Sans-IO.

Subscribers of ``node.cluster.subscribe()`` get these (Akka's ``ClusterEvent``): a member's status
changes (MemberJoined, MemberWeaklyUp, MemberUp, MemberLeft, MemberExited, MemberDowned,
MemberRemoved), reachability changes (UnreachableMember, ReachableMember) and LeaderChanged.
:func:`diff` computes them from the previous and the current gossip, so every node publishes the
same events for the same changes, whatever path the gossip took.
"""

from __future__ import annotations

import attrs

from ._gossip import Gossip, leader, reachability_excluding_downed
from ._member import Member, MemberStatus
from .transport._address import UniqueAddress


@attrs.frozen
class MemberEvent:
    """Base of the member status events; ``member`` is the member as it is now."""

    member: Member


@attrs.frozen
class MemberJoined(MemberEvent):
    """A new member is Joining."""


@attrs.frozen
class MemberWeaklyUp(MemberEvent):
    """A joining member was moved to WeaklyUp while gossip did not converge."""


@attrs.frozen
class MemberUp(MemberEvent):
    """A member is Up (it has an ``up_number``: age order is defined)."""


@attrs.frozen
class MemberLeft(MemberEvent):
    """A member is Leaving."""


@attrs.frozen
class MemberExited(MemberEvent):
    """A member is Exiting: it hands over and stops."""


@attrs.frozen
class MemberDowned(MemberEvent):
    """A member was marked Down."""


@attrs.frozen
class MemberRemoved(MemberEvent):
    """A member was removed from the cluster; ``previous_status`` says from where."""

    previous_status: MemberStatus


@attrs.frozen
class UnreachableMember:
    """The failure detector of some member no longer hears ``member``."""

    member: Member


@attrs.frozen
class ReachableMember:
    """``member`` is reachable again from every observer."""

    member: Member


@attrs.frozen
class LeaderChanged:
    """The leader is now ``leader`` (None: no leader, e.g. everyone else unreachable)."""

    leader: UniqueAddress | None


ClusterEvent = MemberEvent | UnreachableMember | ReachableMember | LeaderChanged
"""Everything ``subscribe()`` yields."""

_STATUS_EVENTS: dict[MemberStatus, type[MemberEvent]] = {
    MemberStatus.JOINING: MemberJoined,
    MemberStatus.WEAKLY_UP: MemberWeaklyUp,
    MemberStatus.UP: MemberUp,
    MemberStatus.LEAVING: MemberLeft,
    MemberStatus.EXITING: MemberExited,
    MemberStatus.DOWN: MemberDowned,
}


def diff(old: Gossip, new: Gossip, self_node: UniqueAddress) -> list[ClusterEvent]:
    """The events that take a subscriber from ``old`` to ``new``, in Akka's order."""
    events: list[ClusterEvent] = []
    before = {m.node: m for m in old.members}
    for m in new.members:
        previous = before.get(m.node)
        if previous is None or previous.status is not m.status:
            events.append(_STATUS_EVENTS[m.status](m))
    now_nodes = new.nodes()
    for m in old.members:
        if m.node not in now_nodes:
            events.append(MemberRemoved(m.with_status(MemberStatus.REMOVED), m.status))
    was = reachability_excluding_downed(old).all_unreachable_or_terminated()
    now = reachability_excluding_downed(new).all_unreachable_or_terminated()
    for node in sorted(now - was):
        member = new.member(node)
        if member is not None and node != self_node:
            events.append(UnreachableMember(member))
    for node in sorted(was - now):
        member = new.member(node)
        if member is not None and node != self_node:
            events.append(ReachableMember(member))
    if leader(old, self_node) != (current := leader(new, self_node)):
        events.append(LeaderChanged(current))
    return events
