"""The downing decision of each strategy, as pure functions of a view of the membership. Sans-IO.

Each side of a partition evaluates the same strategy on the same last-known membership, so both
sides reach decisions that fit together (see :mod:`membership.sbr._resolver`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

import attrs

from .._member import Member, MemberStatus
from .._reachability import Reachability, ReachabilityStatus, Record
from ..transport._address import UniqueAddress
from ._settings import SplitBrainResolverSettings

S = MemberStatus

# --- decisions ------------------------------------------------------------------------------


class Decision(enum.Enum):
    """What a strategy decided (Akka's ``DowningStrategy.Decision``)."""

    DOWN_REACHABLE = "down-reachable"
    """Down this side: every member not seen as unreachable, self included."""

    DOWN_UNREACHABLE = "down-unreachable"
    """Down the other side: every unreachable member."""

    DOWN_ALL = "down-all"
    """Down every member."""

    DOWN_INDIRECTLY_CONNECTED = "down-indirectly-connected"
    """Down the indirectly connected members, plus what the strategy decides without them."""

    ACQUIRE_LEASE_AND_DOWN_UNREACHABLE = "acquire-lease-and-down-unreachable"
    """lease-majority: with the lease, down the unreachable; without it, down this side."""

    ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED = "acquire-lease-and-down-indirectly-connected"
    """lease-majority: with the lease, down the indirectly connected (as above); without it,
    :attr:`REVERSE_DOWN_INDIRECTLY_CONNECTED`."""

    REVERSE_DOWN_INDIRECTLY_CONNECTED = "reverse-down-indirectly-connected"
    """The indirectly connected and every reachable member (lease-majority denied the lease)."""

    DOWN_SELF_QUARANTINED_BY_REMOTE = "down-self-quarantined-by-remote"
    """Down self only: a member refused this incarnation for good."""

    @property
    def is_indirectly_connected(self) -> bool:
        """Whether the decision is about indirectly connected members."""
        return self in _INDIRECT_DECISIONS

    @property
    def needs_lease(self) -> bool:
        """Whether the decision holds only if the lease is acquired (lease-majority)."""
        return self in _LEASE_DECISIONS


_INDIRECT_DECISIONS = frozenset(
    {
        Decision.DOWN_INDIRECTLY_CONNECTED,
        Decision.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED,
        Decision.REVERSE_DOWN_INDIRECTLY_CONNECTED,
    }
)
_LEASE_DECISIONS = frozenset(
    {
        Decision.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE,
        Decision.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED,
    }
)


def reverse_decision(decision: Decision) -> Decision:
    """The decision to carry out when the lease a decision needs was not granted.

    Raises:
        ValueError: ``decision`` does not need a lease.
    """
    if decision is Decision.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE:
        return Decision.DOWN_REACHABLE
    if decision is Decision.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED:
        return Decision.REVERSE_DOWN_INDIRECTLY_CONNECTED
    raise ValueError(f"{decision} does not need a lease, so it has no reverse decision")


# Never counted: gone, or already on the way out on every side.
_NOT_COUNTED = frozenset({S.DOWN, S.EXITING, S.REMOVED})
# Counted only as "possibly Up": the other side may have moved them to Up.
_POSSIBLY_UP = frozenset({S.JOINING, S.WEAKLY_UP})
# What downing can still change.
_DOWNABLE = frozenset({S.JOINING, S.WEAKLY_UP, S.UP, S.LEAVING})


def _by_node(members: Iterable[Member]) -> tuple[Member, ...]:
    result: dict[UniqueAddress, Member] = {}
    for m in members:
        if m.node in result:
            raise ValueError(f"{m.node} appears twice in the members given to the resolver")
        if m.status is not S.REMOVED:
            result[m.node] = m
    return tuple(sorted(result.values(), key=lambda m: m.node))


@attrs.frozen(kw_only=True)
class DowningView:
    """What one node knows when it decides (Akka's ``DowningStrategy`` bookkeeping), as a value.

    Build it with :meth:`of`. ``members`` are sorted by address (Akka's member ordering), Removed
    members left out. ``records`` are the unreachable/terminated observations between members.
    ``unreachable`` is every member some observation marks unreachable or terminated, plus the Down
    members (as Akka's resolver counts a downed member as unreachable), never self.
    """

    self_node: UniqueAddress
    members: tuple[Member, ...]
    records: tuple[Record, ...]
    unreachable: frozenset[UniqueAddress]
    seen_by: frozenset[UniqueAddress]
    observed_unreachable: frozenset[UniqueAddress]
    """Members some observation marks unreachable or terminated, never self (no Down members)."""

    @classmethod
    def of(
        cls,
        *,
        self_node: UniqueAddress,
        members: Iterable[Member],
        reachability: Reachability,
        seen_by: Collection[UniqueAddress] = frozenset(),
    ) -> DowningView:
        """The view of ``self_node`` given the gossip's members, reachability and seen set.

        Args:
            self_node: The node that decides.
            members: Every member in the gossip, any status (Removed ones are ignored).
            reachability: The gossip's reachability table.
            seen_by: The nodes that have seen the current gossip version; an unreachable member
                that has seen it is indirectly connected. Pass it: without it such members are
                found only through observation cycles.

        Raises:
            ValueError: A node appears twice in ``members``.
        """
        ordered = _by_node(members)
        nodes = frozenset(m.node for m in ordered)
        records = tuple(
            r
            for r in reachability.records
            if r.status is not ReachabilityStatus.REACHABLE
            and r.observer in nodes
            and r.subject in nodes
        )
        observed = frozenset(r.subject for r in records) - {self_node}
        downed = frozenset(m.node for m in ordered if m.status is S.DOWN) - {self_node}
        return cls(
            self_node=self_node,
            members=ordered,
            records=records,
            unreachable=observed | downed,
            seen_by=frozenset(seen_by),
            observed_unreachable=observed,
        )

    def _with_records(self, records: tuple[Record, ...]) -> DowningView:
        # Akka's second pass recomputes "unreachable" from the remaining records alone, so self
        # may be in it then.
        unreachable = frozenset(r.subject for r in records)
        return attrs.evolve(
            self, records=records, unreachable=unreachable, observed_unreachable=unreachable
        )

    # Akka's members(includingPossiblyUp, excludingPossiblyExiting), with the role filter.
    def counted(
        self,
        role: str | None = None,
        *,
        including_possibly_up: bool = False,
        excluding_possibly_exiting: bool = False,
    ) -> tuple[Member, ...]:
        """Members a strategy counts, in address order.

        Never Down or Exiting; Joining and WeaklyUp only with ``including_possibly_up``; Leaving
        unless ``excluding_possibly_exiting``; only those with ``role`` if it is set.
        """
        return tuple(
            m
            for m in self.members
            if m.status not in _NOT_COUNTED
            and (including_possibly_up or m.status not in _POSSIBLY_UP)
            and not (excluding_possibly_exiting and m.status is S.LEAVING)
            and m.has_role(role)
        )

    def counted_reachable(
        self,
        role: str | None = None,
        *,
        including_possibly_up: bool = False,
        excluding_possibly_exiting: bool = False,
    ) -> tuple[Member, ...]:
        """:meth:`counted` members not in :attr:`unreachable`."""
        return self._counted_where(
            role, including_possibly_up, excluding_possibly_exiting, unreachable=False
        )

    def counted_unreachable(
        self,
        role: str | None = None,
        *,
        including_possibly_up: bool = False,
        excluding_possibly_exiting: bool = False,
    ) -> tuple[Member, ...]:
        """:meth:`counted` members in :attr:`unreachable`."""
        return self._counted_where(
            role, including_possibly_up, excluding_possibly_exiting, unreachable=True
        )

    def _counted_where(
        self,
        role: str | None,
        including_possibly_up: bool,
        excluding_possibly_exiting: bool,
        *,
        unreachable: bool,
    ) -> tuple[Member, ...]:
        counted = self.counted(
            role,
            including_possibly_up=including_possibly_up,
            excluding_possibly_exiting=excluding_possibly_exiting,
        )
        return tuple(m for m in counted if (m.node in self.unreachable) is unreachable)

    @property
    def downable(self) -> frozenset[UniqueAddress]:
        """Members a decision may down: Joining, WeaklyUp, Up or Leaving."""
        return frozenset(m.node for m in self.members if m.status in _DOWNABLE)

    @property
    def _in_cycles(self) -> frozenset[UniqueAddress]:
        # A member that observes someone as unreachable and is itself observed as unreachable:
        # a cycle in the unreachability graph, which a clean partition or a crash never makes.
        observers = frozenset(r.observer for r in self.records)
        return observers & frozenset(r.subject for r in self.records)

    @property
    def _seen_while_unreachable(self) -> frozenset[UniqueAddress]:
        # An "unreachable" member that has seen the current gossip got it through someone.
        found: set[UniqueAddress] = set()
        for r in self.records:
            if r.subject in self.seen_by:
                found.update((r.observer, r.subject))
        return frozenset(found)

    @property
    def indirectly_connected(self) -> frozenset[UniqueAddress]:
        """Members seen as unreachable over some links but still connected through others."""
        return self._in_cycles | self._seen_while_unreachable

    @property
    def all_unreachable_down_or_exiting(self) -> bool:
        """No unreachable member is still counted as Up or Leaving (Akka's reset condition)."""
        return not self.counted_unreachable()


@attrs.frozen(kw_only=True)
class Resolution:
    """A decision and the members it downs."""

    decision: Decision
    """What was decided. DOWN_ALL if the decision asked for could not be carried out safely (a
    second pass over the indirectly connected members found more of them)."""

    nodes_to_down: frozenset[UniqueAddress]
    """The members to mark Down (only Joining, WeaklyUp, Up or Leaving ones)."""

    acquire_lease_delay: float | None
    """For a decision that needs the lease: seconds to wait before trying to acquire it
    (``acquire_lease_delay_for_minority`` on the minority side, else 0). None otherwise."""

    indirectly_connected: frozenset[UniqueAddress]
    """The indirectly connected members found (for logs)."""


def _majority(view: DowningView, this_side: int, other_side: int, lowest: Member) -> Decision:
    if this_side == other_side:
        # Equal halves: the one with the lowest address stays.
        return (
            Decision.DOWN_REACHABLE
            if lowest.node in view.unreachable
            else Decision.DOWN_UNREACHABLE
        )
    return Decision.DOWN_UNREACHABLE if this_side > other_side else Decision.DOWN_REACHABLE


def _keep_majority(view: DowningView, role: str | None) -> Decision:
    if view.indirectly_connected:
        return Decision.DOWN_INDIRECTLY_CONNECTED
    counted = view.counted(role)
    if not counted:
        return Decision.DOWN_ALL  # no member with the role
    decision = _majority(
        view, len(view.counted_reachable(role)), len(view.counted_unreachable(role)), counted[0]
    )
    if decision is not Decision.DOWN_UNREACHABLE:
        return decision
    # Membership may have changed at the moment of the split: over there Joining members may
    # have become Up, over here Leaving members may have become Exiting. Count this side as small
    # and the other side as large as they could be; if that changes the answer, down everything.
    few = view.counted(role, excluding_possibly_exiting=True)
    if not few:
        return Decision.DOWN_ALL
    this_side = len(view.counted_reachable(role, excluding_possibly_exiting=True))
    other_side = len(view.counted_unreachable(role, including_possibly_up=True))
    if _majority(view, this_side, other_side, few[0]) is Decision.DOWN_UNREACHABLE:
        return Decision.DOWN_UNREACHABLE
    return Decision.DOWN_ALL


def _static_quorum(view: DowningView, role: str | None, quorum_size: int) -> Decision:
    counted = view.counted(role)
    if len(counted) > quorum_size * 2 - 1:
        # Both sides could reach the quorum and keep running: down everything instead.
        return Decision.DOWN_ALL
    if view.indirectly_connected:
        return Decision.DOWN_INDIRECTLY_CONNECTED
    if len(counted) - len(view.counted_unreachable(role)) >= quorum_size:
        return Decision.DOWN_UNREACHABLE
    return Decision.DOWN_REACHABLE


def _oldest_decision(
    down_if_alone: bool, oldest_here: bool, this_side: int, other_side: int
) -> Decision:
    if oldest_here:
        # Two members: keep the oldest even though it is alone, the other is no better.
        if down_if_alone and this_side == 1 and other_side >= 2:
            return Decision.DOWN_REACHABLE
        return Decision.DOWN_UNREACHABLE
    if down_if_alone and other_side == 1 and this_side >= 2:
        return Decision.DOWN_UNREACHABLE
    return Decision.DOWN_REACHABLE


def _age_sorted(members: tuple[Member, ...]) -> list[Member]:
    return sorted(members, key=Member.age_key)


def _keep_oldest(view: DowningView, role: str | None, down_if_alone: bool) -> Decision:
    if view.indirectly_connected:
        return Decision.DOWN_INDIRECTLY_CONNECTED
    counted = _age_sorted(view.counted(role))
    if not counted:
        return Decision.DOWN_ALL
    decision = _oldest_decision(
        down_if_alone,
        counted[0].node not in view.unreachable,
        len(view.counted_reachable(role)),
        len(view.counted_unreachable(role)),
    )
    if decision is not Decision.DOWN_UNREACHABLE:
        return decision
    # The oldest may be Exiting on the other side although Leaving here; Joining members may be
    # Up there, which changes who is alone. Different answer: down everything.
    few = _age_sorted(view.counted(role, excluding_possibly_exiting=True))
    if not few:
        return Decision.DOWN_ALL
    possibly_up = down_if_alone  # only the "alone" test depends on them
    again = _oldest_decision(
        down_if_alone,
        few[0].node not in view.unreachable,
        len(
            view.counted_reachable(
                role, including_possibly_up=possibly_up, excluding_possibly_exiting=True
            )
        ),
        len(
            view.counted_unreachable(
                role, including_possibly_up=possibly_up, excluding_possibly_exiting=True
            )
        ),
    )
    return Decision.DOWN_UNREACHABLE if again is Decision.DOWN_UNREACHABLE else Decision.DOWN_ALL


def _in_minority(view: DowningView, role: str | None) -> bool:
    counted = view.counted(role)
    if not counted:
        return False
    unreachable = len(view.counted_unreachable(role))
    if unreachable * 2 == len(counted):
        return counted[0].node in view.unreachable
    return unreachable * 2 > len(counted)


def decide(settings: SplitBrainResolverSettings, view: DowningView) -> Decision:
    """What the active strategy decides from ``view`` (Akka's ``decide()``); see :func:`resolve`."""
    strategy = settings.active_strategy
    if strategy == "keep-majority":
        return _keep_majority(view, settings.role)
    if strategy == "static-quorum":
        assert settings.quorum_size is not None  # the settings check this
        return _static_quorum(view, settings.role, settings.quorum_size)
    if strategy == "keep-oldest":
        return _keep_oldest(view, settings.role, settings.down_if_alone)
    if strategy == "down-all":
        return Decision.DOWN_ALL
    if view.indirectly_connected:
        return Decision.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED
    return Decision.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE


class _StillIndirectlyConnected(Exception):
    """The second pass over indirectly connected members found indirectly connected ones again."""


def _nodes_to_down(
    settings: SplitBrainResolverSettings, view: DowningView, decision: Decision
) -> frozenset[UniqueAddress]:
    downable = view.downable
    if decision in (Decision.DOWN_UNREACHABLE, Decision.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE):
        return downable & view.unreachable
    if decision is Decision.DOWN_REACHABLE:
        return downable - view.unreachable
    if decision is Decision.DOWN_ALL:
        return downable
    if decision in (
        Decision.DOWN_INDIRECTLY_CONNECTED,
        Decision.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED,
    ):
        indirect = view.indirectly_connected
        return downable & (indirect | _also_down_when_indirectly_connected(settings, view))
    if decision is Decision.REVERSE_DOWN_INDIRECTLY_CONNECTED:
        return (downable & view.indirectly_connected) | (downable - view.unreachable)
    # DOWN_SELF_QUARANTINED_BY_REMOTE
    return downable & {view.self_node}


def _also_down_when_indirectly_connected(
    settings: SplitBrainResolverSettings, view: DowningView
) -> frozenset[UniqueAddress]:
    """What the strategy decides once the observations among indirectly connected are dropped.

    A clean partition (or a crash) at the same time as indirectly connected members must still
    be resolved.
    """
    if not (view.unreachable - view.indirectly_connected):
        return frozenset()
    downable = view.downable
    cycles, seen = view._in_cycles, view._seen_while_unreachable
    remaining = tuple(
        r
        for r in view.records
        if r.observer in downable
        and r.subject in downable
        and not (r.observer in cycles and r.subject in cycles)
        and not (r.observer in seen and r.subject in seen)
    )
    second = view._with_records(remaining)
    decision = decide(settings, second)
    if decision.is_indirectly_connected:
        raise _StillIndirectlyConnected
    return _nodes_to_down(settings, second, decision)


def resolve(
    settings: SplitBrainResolverSettings, view: DowningView, decision: Decision | None = None
) -> Resolution:
    """The decision (``decide`` unless given) and the members it downs, from ``view``.

    Example:
        >>> from membership import Address, UniqueAddress
        >>> a, b, c = (UniqueAddress(Address("10.0.0.1", p), f"n{p}", 1) for p in (1, 2, 3))
        >>> view = DowningView.of(
        ...     self_node=a,
        ...     members=[Member(n, MemberStatus.UP, up_number=i) for i, n in enumerate((a, b, c))],
        ...     reachability=Reachability().unreachable(a, c).unreachable(b, c),
        ... )
        >>> resolution = resolve(SplitBrainResolverSettings(), view)  # keep-majority: 2 of 3
        >>> resolution.decision, resolution.nodes_to_down == {c}
        (<Decision.DOWN_UNREACHABLE: 'down-unreachable'>, True)
    """
    if decision is None:
        decision = decide(settings, view)
    try:
        nodes = _nodes_to_down(settings, view, decision)
    except _StillIndirectlyConnected:
        # Akka's "SBR double DownIndirectlyConnected decision, downing all instead".
        decision = Decision.DOWN_ALL
        nodes = _nodes_to_down(settings, view, decision)
    delay: float | None = None
    if decision is Decision.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE:
        minority = _in_minority(view, settings.role)
        delay = settings.acquire_lease_delay_for_minority if minority else 0.0
    elif decision is Decision.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED:
        delay = 0.0
    return Resolution(
        decision=decision,
        nodes_to_down=nodes,
        acquire_lease_delay=delay,
        indirectly_connected=view.indirectly_connected,
    )
