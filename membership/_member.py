"""Cluster members and their life cycle. Sans-IO.

Theory of operation: a member is one node incarnation (:class:`UniqueAddress`) with a status,
roles and an ``up_number``. The status moves only along Akka's transitions::

    Joining ──► WeaklyUp ──► Up ──► Leaving ──► Exiting ──► Removed
       │  │        │  │      │         │  │        │
       │  └────────┼──┴──────┼─────────┼──┴──► Down ┴─► Removed
       └───────────┴─────────┴─────────┴────────────────►(Removed)

Every live status may also go to Down (by the downing provider or a user) and to Removed; Down
and Exiting go only to Removed (Exiting also to Down). Anything else raises
:class:`IllegalTransition` and leaves the member unchanged.

The leader gives each member an ``up_number`` when it moves it to Up; a lower number means an
older member. "Oldest" (where singletons run) is the member with the lowest ``up_number``, ties
broken by address, exactly Akka's ``Member.isOlderThan``.

When two gossips disagree about a member, the merge keeps the status furthest along the life
cycle (:func:`highest_priority`), as Akka does: a status only ever moves forward, so whichever
view is further along is the newer one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from .transport._address import UniqueAddress
from .transport._errors import IllegalTransition
from .transport._wire import message

NOT_UP: int = 2**31 - 1
"""``up_number`` of a member that was never Up (Akka's ``Int.MaxValue``)."""


@message(name="p2pshard.MemberStatus")
class MemberStatus(enum.Enum):
    """Where a member is in its life cycle (see the module docstring for the transitions)."""

    JOINING = "joining"
    WEAKLY_UP = "weakly_up"
    UP = "up"
    LEAVING = "leaving"
    EXITING = "exiting"
    DOWN = "down"
    REMOVED = "removed"


S = MemberStatus
ALLOWED_TRANSITIONS: dict[MemberStatus, frozenset[MemberStatus]] = {
    S.JOINING: frozenset({S.WEAKLY_UP, S.UP, S.LEAVING, S.DOWN, S.REMOVED}),
    S.WEAKLY_UP: frozenset({S.UP, S.LEAVING, S.DOWN, S.REMOVED}),
    S.UP: frozenset({S.LEAVING, S.DOWN, S.REMOVED}),
    S.LEAVING: frozenset({S.EXITING, S.DOWN, S.REMOVED}),
    S.EXITING: frozenset({S.REMOVED, S.DOWN}),
    S.DOWN: frozenset({S.REMOVED}),
    S.REMOVED: frozenset(),
}
"""Akka's allowed member status transitions (without PreparingForShutdown)."""

# How far along the life cycle a status is, for merging: Removed > Down > Exiting > Leaving > Up
# > WeaklyUp > Joining. The one place where this differs from the enum's declaration order.
_PRIORITY = {
    S.JOINING: 0,
    S.WEAKLY_UP: 1,
    S.UP: 2,
    S.LEAVING: 3,
    S.EXITING: 4,
    S.DOWN: 5,
    S.REMOVED: 6,
}

# Akka's leaderStatusOrdering puts these last, in this order (Down very last).
_LEADER_RANK = {S.WEAKLY_UP: 1, S.JOINING: 2, S.EXITING: 3, S.DOWN: 4}

LEADER_STATUSES = frozenset({S.UP, S.LEAVING})
"""A member with one of these may be leader; others only when no such member is reachable."""

CONVERGENCE_STATUSES = frozenset({S.UP, S.LEAVING})
"""Members that must have seen a gossip version for it to have converged."""

SKIP_UNREACHABLE_STATUSES = frozenset({S.DOWN, S.EXITING})
"""Unreachable members with these statuses do not block convergence; they are removed."""


def _roles(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


@message(name="p2pshard.Member")
@attrs.frozen(order=False)
class Member:
    """One node incarnation as the cluster sees it."""

    node: UniqueAddress
    status: MemberStatus = MemberStatus.JOINING
    up_number: int = NOT_UP
    roles: frozenset[str] = attrs.field(default=frozenset(), converter=_roles)
    app_version: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    """The application version the node was started with (``NodeConfig.app_version``; empty
    when not set), as its Join told the cluster."""

    @property
    def address(self) -> UniqueAddress:
        """The member's incarnation (same as ``node``)."""
        return self.node

    def has_role(self, role: str | None) -> bool:
        """True for ``role=None`` (any member) or if the member has that role."""
        return role is None or role in self.roles

    def with_status(self, status: MemberStatus) -> Member:
        """This member with another status.

        Raises:
            IllegalTransition: Akka's life cycle does not allow that move.
        """
        if status is self.status:
            return self
        if status not in ALLOWED_TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"{self.node}: {self.status.name} -> {status.name} is not an allowed transition "
                f"(from {self.status.name}: "
                f"{', '.join(sorted(s.name for s in ALLOWED_TRANSITIONS[self.status])) or 'none'})"
            )
        return attrs.evolve(self, status=status)

    def up(self, up_number: int) -> Member:
        """This member moved to Up with the given ``up_number`` (the leader's action)."""
        return attrs.evolve(self.with_status(MemberStatus.UP), up_number=up_number)

    def is_older_than(self, other: Member) -> bool:
        """Akka's age order: lower ``up_number`` is older; equal numbers fall back to address."""
        if self.up_number == other.up_number:
            return self.node < other.node
        return self.up_number < other.up_number

    def age_key(self) -> tuple[int, UniqueAddress]:
        """Sort key: oldest first."""
        return (self.up_number, self.node)

    def leader_key(self) -> tuple[int, UniqueAddress]:
        """Sort key of Akka's ``leaderStatusOrdering``: by address, Joining/Exiting/Down last."""
        return (_LEADER_RANK.get(self.status, 0), self.node)


def highest_priority(a: Member, b: Member) -> Member:
    """Of two views of the same member, the one further along its life cycle.

    Same status: the older one (lower ``up_number``), so merging is order independent.
    """
    pa, pb = _PRIORITY[a.status], _PRIORITY[b.status]
    if pa != pb:
        return a if pa > pb else b
    if a.up_number != b.up_number:
        return a if a.up_number < b.up_number else b
    # Same status and number: the roles and app version come from the joining node and are the
    # same; pick deterministically anyway.
    return a if (sorted(a.roles), a.app_version) <= (sorted(b.roles), b.app_version) else b
