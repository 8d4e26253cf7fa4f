"""The split brain resolver: which members to down when some are unreachable. Sans-IO.

Theory of operation (Akka's ``pekko.cluster.sbr``): the failure detectors only say "no heartbeat in
time"; a crashed node, a network partition and a long pause look the same. Left alone, unreachable
members stay in the membership forever (no convergence, so nothing joins or leaves), and a timeout
that removes them would let both sides of a partition remove each other and form two clusters, each
running its own copy of every singleton and entity. The resolver instead waits until the picture has
been *stable* for ``stable_after`` and then lets one deterministic strategy, evaluated separately on
each side from the same last-known membership, decide which side keeps running:

- ``keep-majority`` (default): the side with more members survives; on an equal split the side
  with the lowest address does.
- ``static-quorum``: a side survives if it still has ``quorum_size`` members. More than
  ``quorum_size * 2 - 1`` members in all means both sides could qualify, so everything is downed.
- ``keep-oldest``: the side with the oldest member (where singletons run) survives; with
  ``down_if_alone`` an oldest member cut off from everyone else downs itself instead.
- ``down-all``: everything is downed.
- ``lease-majority``: the side that gets an external lease survives; the minority side waits
  ``acquire_lease_delay_for_minority`` before trying, so the majority usually wins.

The counting follows Akka's ``DowningStrategy`` exactly. Members that are Joining or WeaklyUp are
not counted (the other side may not know them) but are downed with their side; Down and Exiting
members are neither counted nor downed. keep-majority and keep-oldest then check again with the
counts that the other side could see (Joining/WeaklyUp members over there may have become Up,
Leaving members over here may have become Exiting) and down everything if the two answers differ,
because then both sides might believe they won. Only the members with ``role`` are counted when a
role is set.

*Indirectly connected* members are ones the failure detector calls unreachable while gossip still
flows to them through a third node (A and B cannot reach each other but C reaches both). They show
up as a member that is both an observer and a subject of unreachability records, or as an
unreachable member that has seen the current gossip. They are downed, and the strategy is applied
once more to the remaining observations so that a clean partition happening at the same time is
resolved too (if that second pass still finds indirectly connected members, everything is downed).

:func:`decide` and :func:`resolve` are the pure decision over a :class:`DowningView` (members,
reachability, seen set, self). :class:`SplitBrainResolverCore` is the timing around it (Akka's
``SplitBrainResolver`` actor): fed with :meth:`~SplitBrainResolverCore.update` and
:meth:`~SplitBrainResolverCore.tick`, it returns effects as values and never does IO::

                 tick: leader, unreachable, stable,
                 lease-majority and no lease held
      ┌────────┐ ──────────────── AcquireLease ───────────► ┌───────────────────┐
      │ ACTIVE │                                             │ WAITING_FOR_LEASE │
      └────────┘ ◄── lease_acquired(granted) → DownNodes ─── └───────────────────┘
          │  ▲  tick: leader, unreachable, stable → DownNodes       (ticks ignored,
          │  └──────────────────────────────────────┘                updates stashed)
          │ self Removed
          ▼
      ┌─────────┐
      │ STOPPED │  (every call is a no-op)
      └─────────┘

The stable timer restarts whenever a member becomes unreachable, reachable again, Up, Exiting or
Down. Joining, WeaklyUp, Leaving and removals do not restart it (Akka: nodes that keep joining
during a partition must not postpone the decision forever). Only the leader decides, and only once
its own member has been WeaklyUp or Up. If reachability keeps changing for longer than
``stable_after + down_all_when_unstable`` after the first change, every node (leader or not:
Akka's deliberate aggressiveness) downs all members, because an unstable network may have shown
each side a different picture; healing, downing or removing every unreachable member ends that
measurement. Holding the lease, the core asks to release it ``lease_release_after`` seconds after
every member it downed has been removed.

Differences from Akka, and why:

- No data centers (p2pshard has one). No automatic extra time for large clusters: Akka has none
  either, its documentation only recommends a longer ``stable_after`` (7 s for 5 nodes, 20 s for
  100, 30 s for 1000).
- Input is a whole snapshot per :meth:`~SplitBrainResolverCore.update` rather than one event per
  change; the core derives Akka's events (member up/exited/downed, unreachable/reachable) by
  comparing consecutive snapshots, so a change that comes and goes between two snapshots is
  not seen.
- "Stable" and "unstable" compare with ``>=`` (Akka: strictly later), so ``stable_after = 0``
  decides at the first tick.
- The lease itself is outside: the core asks for it with :class:`AcquireLease` and is told the
  result. Instead of Akka's synchronous ``checkLease()`` the core remembers that it holds the
  lease from the grant until it is released or :meth:`~SplitBrainResolverCore.lease_lost` is
  called; members downed while holding it extend the hold like a fresh grant does.
- A decision that downs nobody produces no effect (Akka logs it).
- Self's "member added" latch also accepts Leaving and Exiting, so a core created after its node
  began leaving can still act as leader.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Iterable
from typing import Any, Literal, TypeAlias

import attrs

from .._member import Member, MemberStatus
from .._reachability import Reachability, ReachabilityStatus, Record
from ..transport._address import UniqueAddress
from ..transport._errors import ConfigurationError
from ..transport._settings import in_range

S = MemberStatus

StrategyName: TypeAlias = Literal[
    "keep-majority", "static-quorum", "keep-oldest", "down-all", "lease-majority"
]
STRATEGY_NAMES: tuple[StrategyName, ...] = (
    "keep-majority",
    "static-quorum",
    "keep-oldest",
    "down-all",
    "lease-majority",
)
"""Values of :attr:`SplitBrainResolverSettings.active_strategy`."""

MIN_DOWN_ALL_WHEN_UNSTABLE = 4.0
"""Lower bound of the derived ``down_all_when_unstable`` (Akka: 4 s)."""

_MAX_SECONDS = 7 * 24 * 3600.0


# --- settings -------------------------------------------------------------------------------


def _invalid(attribute: attrs.Attribute[Any], value: object, allowed: str) -> ConfigurationError:
    return ConfigurationError(
        f"SplitBrainResolverSettings.{attribute.name} = {value!r} is invalid: must be {allowed}"
    )


def _check_strategy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in STRATEGY_NAMES:
        raise _invalid(attribute, value, "one of " + ", ".join(map(repr, STRATEGY_NAMES)))


def _check_down_all_when_unstable(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    if value in ("on", "off"):
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= _MAX_SECONDS
    ):
        raise _invalid(attribute, value, f"'on', 'off' or seconds above 0 (up to {_MAX_SECONDS:g})")


def _check_optional_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise _invalid(attribute, value, "None or a non-empty name without surrounding spaces")


def _check_quorum_size(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _invalid(attribute, value, "None or an integer of at least 1")


def _check_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise _invalid(attribute, value, "True or False")


@attrs.frozen(kw_only=True)
class SplitBrainResolverSettings:
    """How the split brain resolver decides (Akka's ``split-brain-resolver`` section).

    Use the same settings on every node: each side of a partition decides on its own and the
    sides only agree if they apply the same rule.

    Example:
        >>> settings = SplitBrainResolverSettings(active_strategy="static-quorum", quorum_size=3)
        >>> settings.down_all_when_unstable_after  # "on": 3/4 of stable_after, at least 4 s
        15.0
    """

    active_strategy: StrategyName = attrs.field(default="keep-majority", validator=_check_strategy)
    """Which strategy decides (default ``"keep-majority"``): ``"keep-majority"``,
    ``"static-quorum"``, ``"keep-oldest"``, ``"down-all"`` or ``"lease-majority"``."""

    stable_after: float = attrs.field(default=20.0, validator=in_range(0.0, _MAX_SECONDS))
    """Seconds without membership or reachability changes before a decision (default 20, Akka's).
    Shorter removes crashed nodes sooner but may act on a partition that would have healed; keep it
    above the time gossip needs to reach everyone (Akka suggests 7 s for 5 nodes, 10 s for 10, 13 s
    for 20, 17 s for 50, 20 s for 100, 30 s for 1000). It is also the margin before a downed
    side's singletons and shards are started elsewhere."""

    down_all_when_unstable: Literal["on", "off"] | float = attrs.field(
        default="on", validator=_check_down_all_when_unstable
    )
    """Down all members if reachability keeps changing for this many seconds beyond
    ``stable_after``, counted from the first change (default ``"on"``: ``stable_after * 3/4`` but
    at least 4 s; ``"off"`` disables it). See :attr:`down_all_when_unstable_after`."""

    role: str | None = attrs.field(default=None, validator=_check_optional_name)
    """Count only members with this role (default None: all members). Used by keep-majority,
    static-quorum, keep-oldest and lease-majority; down-all ignores it. Members without the role are
    still downed with their side."""

    quorum_size: int | None = attrs.field(default=None, validator=_check_quorum_size)
    """static-quorum: the least number of (role) members a side needs to survive. Required, and at
    least 1, when that strategy is active (default None). Never run more than
    ``quorum_size * 2 - 1`` such members: then a decision downs everyone."""

    down_if_alone: bool = attrs.field(default=True, validator=_check_bool)
    """keep-oldest: if the oldest member is cut off from all others (and there are at least two of
    them) down the oldest and keep the rest (default True)."""

    acquire_lease_delay_for_minority: float = attrs.field(
        default=2.0, validator=in_range(0.0, 3600.0)
    )
    """lease-majority: seconds the minority side waits before trying to take the lease, so the
    majority side usually gets it (default 2)."""

    lease_release_after: float = attrs.field(default=40.0, validator=in_range(0.0, _MAX_SECONDS))
    """lease-majority: seconds to keep holding the lease after the members downed by the decision
    have been removed (default 40, Akka's ``release-after``)."""

    lease_name: str | None = attrs.field(default=None, validator=_check_optional_name)
    """lease-majority: name of the lease (default None: ``"<cluster>-p2pshard-sbr"``, see
    :meth:`lease_name_for`)."""

    def __attrs_post_init__(self) -> None:
        if self.active_strategy == "static-quorum" and self.quorum_size is None:
            raise ConfigurationError(
                "SplitBrainResolverSettings.quorum_size = None is invalid: must be an integer of "
                "at least 1 when active_strategy is 'static-quorum'"
            )

    @property
    def down_all_when_unstable_after(self) -> float | None:
        """Seconds of instability beyond ``stable_after`` before downing all, None when off."""
        value = self.down_all_when_unstable
        if value == "off":
            return None
        if value == "on":
            return max(MIN_DOWN_ALL_WHEN_UNSTABLE, self.stable_after * 3 / 4)
        return float(value)

    def lease_name_for(self, cluster: str) -> str:
        """The lease name lease-majority uses in ``cluster``."""
        return self.lease_name if self.lease_name is not None else f"{cluster}-p2pshard-sbr"


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


# --- the timing state machine ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class DownNodes:
    """Effect: mark these members Down (cluster ``down``), in this order; self comes last."""

    nodes: tuple[UniqueAddress, ...]
    decision: Decision


@attrs.frozen(kw_only=True)
class AcquireLease:
    """Effect: wait ``delay`` seconds, try to acquire the lease, report the result.

    Report it with :meth:`SplitBrainResolverCore.lease_acquired` (False if acquiring failed).
    """

    delay: float
    decision: Decision


@attrs.frozen(kw_only=True)
class ReleaseLease:
    """Effect: release the lease, report with :meth:`SplitBrainResolverCore.lease_released`."""


SplitBrainResolverEffect: TypeAlias = DownNodes | AcquireLease | ReleaseLease


class ResolverState(enum.Enum):
    """Where :class:`SplitBrainResolverCore` is (see the module docstring)."""

    ACTIVE = "active"
    WAITING_FOR_LEASE = "waiting-for-lease"
    STOPPED = "stopped"


@attrs.frozen(kw_only=True)
class SplitBrainResolverStatistics:
    """A snapshot of :class:`SplitBrainResolverCore` for diagnostics."""

    state: ResolverState
    responsible: bool
    """Leader and its own member added: this node decides."""
    unreachable: int
    """Members the resolver considers unreachable (Down ones included)."""
    stable_deadline: float
    """Time from which the picture counts as stable (if nothing changes before)."""
    reachability_changes: int
    """Reachability changes since the measurement of instability was last reset."""
    first_change_at: float | None
    latest_change_at: float | None
    holding_lease: bool
    decisions: int
    """Decisions carried out so far (including those that downed nobody)."""
    last_decision: Decision | None


@attrs.frozen
class _WhenMembersRemoved:
    nodes: frozenset[UniqueAddress]


@attrs.frozen
class _WhenTimeElapsed:
    deadline: float


@attrs.frozen
class _Update:
    members: tuple[Member, ...]
    reachability: Reachability
    is_leader: bool
    seen_by: frozenset[UniqueAddress]


@attrs.frozen
class _Quarantined:
    remote: UniqueAddress


_SELF_ADDED = frozenset({S.WEAKLY_UP, S.UP, S.LEAVING, S.EXITING})


@attrs.define(eq=False)
class SplitBrainResolverCore:
    """The split brain resolver's timing, sans-IO (Akka's ``SplitBrainResolver`` actor).

    Feed it every new gossip state with :meth:`update` and call :meth:`tick` periodically (Akka:
    every second); carry out the effects they return. Times are seconds from one monotonic
    clock (``trio.current_time()``).

    Example:
        >>> from membership import Address, UniqueAddress
        >>> a, b, c = (UniqueAddress(Address("10.0.0.1", p), f"n{p}", 1) for p in (1, 2, 3))
        >>> members = [Member(n, MemberStatus.UP, up_number=i) for i, n in enumerate((a, b, c))]
        >>> core = SplitBrainResolverCore(SplitBrainResolverSettings(), a, now=0.0)
        >>> core.update(members, Reachability().unreachable(a, c), is_leader=True, now=1.0)
        >>> core.tick(now=20.0)  # unreachable for 19 s only: not stable yet
        []
        >>> [(effect.nodes == (c,), effect.decision) for effect in core.tick(now=21.0)]
        [(True, <Decision.DOWN_UNREACHABLE: 'down-unreachable'>)]
    """

    settings: SplitBrainResolverSettings
    self_node: UniqueAddress
    _started_at: float = attrs.field(alias="now", kw_only=True)
    _state: ResolverState = attrs.field(default=ResolverState.ACTIVE, init=False)
    _view: DowningView = attrs.field(init=False)
    _is_leader: bool = attrs.field(default=False, init=False)
    _self_added: bool = attrs.field(default=False, init=False)
    _stable_deadline: float = attrs.field(init=False)
    _change_count: int = attrs.field(default=0, init=False)
    _first_change: float = attrs.field(default=0.0, init=False)
    _latest_change: float = attrs.field(default=0.0, init=False)
    _lease_decision: Decision | None = attrs.field(default=None, init=False)
    _stash: list[_Update | _Quarantined] = attrs.field(factory=list, init=False)
    _release: _WhenMembersRemoved | _WhenTimeElapsed | None = attrs.field(default=None, init=False)
    _release_in_flight: bool = attrs.field(default=False, init=False)
    _decisions: int = attrs.field(default=0, init=False)
    _last_decision: Decision | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if not math.isfinite(self._started_at):
            raise ValueError(f"now = {self._started_at!r} is not a finite time")
        self._view = DowningView.of(
            self_node=self.self_node, members=(), reachability=Reachability()
        )
        self._stable_deadline = self._started_at + self.settings.stable_after

    # -- queries

    @property
    def state(self) -> ResolverState:
        """Where the resolver is."""
        return self._state

    @property
    def view(self) -> DowningView:
        """The membership picture decisions are made from."""
        return self._view

    @property
    def is_responsible(self) -> bool:
        """Whether this node takes the decisions: it is leader and its member was added."""
        return self._is_leader and self._self_added

    @property
    def holding_lease(self) -> bool:
        """Whether the core believes it holds the lease (granted, not released or lost)."""
        return self._release is not None

    def statistics(self) -> SplitBrainResolverStatistics:
        """Counters and timers, for logs and tests."""
        changed = self._change_count > 0
        return SplitBrainResolverStatistics(
            state=self._state,
            responsible=self.is_responsible,
            unreachable=len(self._view.unreachable),
            stable_deadline=self._stable_deadline,
            reachability_changes=self._change_count,
            first_change_at=self._first_change if changed else None,
            latest_change_at=self._latest_change if changed else None,
            holding_lease=self.holding_lease,
            decisions=self._decisions,
            last_decision=self._last_decision,
        )

    # -- inputs

    def update(
        self,
        members: Iterable[Member],
        reachability: Reachability,
        *,
        is_leader: bool,
        now: float,
        seen_by: Collection[UniqueAddress] = frozenset(),
    ) -> None:
        """Take a new gossip state.

        Pass all members (any status), the reachability table, whether this node is the leader and
        who has seen this gossip version. While waiting for the lease the update is kept and
        applied after the lease result, so the decision is carried out on the picture it was made
        from (Akka stashes).
        """
        if self._state is ResolverState.STOPPED:
            return
        update = _Update(tuple(members), reachability, is_leader, frozenset(seen_by))
        if self._state is ResolverState.WAITING_FOR_LEASE:
            self._stash.append(update)
            return
        self._apply(update, now)

    def decision_due(self) -> float:
        """When :meth:`tick` would decide for the unreachable members now seen (inf: none).

        The shell ticks on a fixed interval; it also wakes at this moment, so that a decision
        is not a tick late (the fast profiles' ``stable_after`` is about one tick).
        """
        if self._state is not ResolverState.ACTIVE or not (
            self.is_responsible and self._view.unreachable
        ):
            return float("inf")
        return self._stable_deadline

    def tick(self, now: float) -> list[SplitBrainResolverEffect]:
        """Let time pass: decide once stable, down all when unstable too long, release the lease.

        Ignored while waiting for the lease.
        """
        if self._state is not ResolverState.ACTIVE:
            return []
        effects: list[SplitBrainResolverEffect] = []
        after = self.settings.down_all_when_unstable_after
        if self._change_count > 0:
            # Every node, not only the leader, so that an unstable picture ends fast.
            if after is not None and now - self._first_change >= self.settings.stable_after + after:
                effects += self._act(Decision.DOWN_ALL, now)
            elif after is None and now - self._latest_change >= self.settings.stable_after * 2:
                self._reset_changes()
        if self.is_responsible and self._view.unreachable and now >= self._stable_deadline:
            decision = decide(self.settings, self._view)
            if not decision.needs_lease:
                effects += self._act(decision, now)
            elif self.holding_lease:
                effects += self._act_with_lease(decision, now)
            else:
                delay = resolve(self.settings, self._view, decision).acquire_lease_delay
                self._state = ResolverState.WAITING_FOR_LEASE
                self._lease_decision = decision
                effects.append(AcquireLease(delay=delay or 0.0, decision=decision))
                return effects
        release = self._release
        if (
            isinstance(release, _WhenTimeElapsed)
            and now >= release.deadline
            and not self._release_in_flight
        ):
            self._release_in_flight = True
            effects.append(ReleaseLease())
        return effects

    def lease_acquired(self, granted: bool, now: float) -> list[SplitBrainResolverEffect]:
        """The result of an :class:`AcquireLease`.

        Carries out the decision if ``granted``, its reverse (down this side) if not. A result that
        comes when the core is not waiting for one is ignored.
        """
        if self._state is not ResolverState.WAITING_FOR_LEASE or self._lease_decision is None:
            return []
        decision, self._lease_decision = self._lease_decision, None
        self._state = ResolverState.ACTIVE
        if granted:
            effects = self._act_with_lease(decision, now)
        else:
            effects, _ = self._act_on(reverse_decision(decision), now)
            self._release = None
        stash, self._stash = self._stash, []
        for item in stash:
            if self._state is ResolverState.STOPPED:
                break
            if isinstance(item, _Update):
                self._apply(item, now)
            else:
                effects += self._quarantined(item.remote, now)
        return effects

    def lease_released(self, released: bool, now: float) -> None:
        """The result of a :class:`ReleaseLease`; if not ``released`` it is asked again later."""
        self._release_in_flight = False
        if self._state is ResolverState.WAITING_FOR_LEASE:
            return  # superseded by the acquire in progress
        release = self._release
        if released and isinstance(release, _WhenTimeElapsed) and now >= release.deadline:
            self._release = None

    def lease_lost(self) -> None:
        """The lease reported it is no longer held: the next decision will ask for it again."""
        self._release = None
        self._release_in_flight = False

    def quarantined_by_remote(
        self, remote: UniqueAddress, now: float
    ) -> list[SplitBrainResolverEffect]:
        """A member refused this incarnation for good: down self (if ``remote`` is a member)."""
        if self._state is ResolverState.STOPPED:
            return []
        if self._state is ResolverState.WAITING_FOR_LEASE:
            self._stash.append(_Quarantined(remote))
            return []
        return self._quarantined(remote, now)

    # -- internals

    def _quarantined(self, remote: UniqueAddress, now: float) -> list[SplitBrainResolverEffect]:
        if all(m.node != remote for m in self._view.members):
            return []  # not part of the cluster: nothing to conclude
        return self._act(Decision.DOWN_SELF_QUARANTINED_BY_REMOTE, now)

    def _apply(self, update: _Update, now: float) -> None:
        new = DowningView.of(
            self_node=self.self_node,
            members=update.members,
            reachability=update.reachability,
            seen_by=update.seen_by,
        )
        old = self._view
        before = {m.node: m for m in old.members}
        after = {m.node: m for m in new.members}
        if self.self_node in before and self.self_node not in after:
            self._view = new
            self._state = ResolverState.STOPPED  # self removed: Akka stops the actor
            return
        restart = False
        changes = 0
        for node, member in after.items():
            previous = before.get(node)
            if previous is not None and previous.status is member.status:
                continue
            if member.status in (S.UP, S.EXITING):
                restart = True
            elif member.status is S.DOWN and node != self.self_node:
                restart = True  # Akka treats "downed" as "unreachable"
                changes += 1
        if self.self_node in after and after[self.self_node].status in _SELF_ADDED:
            self._self_added = True
        went = new.observed_unreachable - old.observed_unreachable
        came_back = (old.observed_unreachable - new.observed_unreachable) & after.keys()
        changes += len(went) + len(came_back)
        if went or came_back:
            restart = True
        removed = before.keys() - after.keys()
        self._view = new
        self._is_leader = update.is_leader
        if changes:
            if self._change_count == 0:
                self._first_change = now
            self._latest_change = now
            self._change_count += changes
        if restart:
            self._stable_deadline = now + self.settings.stable_after
        if removed:
            self._forget_downed(removed, now)
        if (changes or removed) and self._change_count and new.all_unreachable_down_or_exiting:
            self._reset_changes()  # healed, downed or removed: the instability is over

    def _forget_downed(self, removed: Collection[UniqueAddress], now: float) -> None:
        release = self._release
        if isinstance(release, _WhenMembersRemoved):
            remaining = release.nodes - frozenset(removed)
            if remaining:
                self._release = _WhenMembersRemoved(remaining)
            else:
                self._release = _WhenTimeElapsed(now + self.settings.lease_release_after)

    def _reset_changes(self) -> None:
        self._change_count = 0

    def _act(self, decision: Decision, now: float) -> list[SplitBrainResolverEffect]:
        effects, _ = self._act_on(decision, now)
        return effects

    def _act_with_lease(self, decision: Decision, now: float) -> list[SplitBrainResolverEffect]:
        effects, downed = self._act_on(decision, now)
        release = self._release
        if isinstance(release, _WhenMembersRemoved):
            self._release = _WhenMembersRemoved(release.nodes | downed)
        elif downed:
            self._release = _WhenMembersRemoved(downed)
        else:
            self._release = _WhenTimeElapsed(now + self.settings.lease_release_after)
        return effects

    def _act_on(
        self, decision: Decision, now: float
    ) -> tuple[list[SplitBrainResolverEffect], frozenset[UniqueAddress]]:
        resolution = resolve(self.settings, self._view, decision)
        self._decisions += 1
        self._last_decision = resolution.decision
        nodes = resolution.nodes_to_down
        if not nodes:
            return [], nodes
        # Self last: downing itself may stop this node before it downs the others.
        ordered = sorted(nodes - {self.self_node})
        if self.self_node in nodes:
            ordered.append(self.self_node)
        self._reset_changes()
        self._stable_deadline = now + self.settings.stable_after
        return [DownNodes(nodes=tuple(ordered), decision=resolution.decision)], nodes
