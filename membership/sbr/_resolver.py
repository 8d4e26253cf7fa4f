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
from typing import TypeAlias

import attrs

from .._member import Member, MemberStatus
from .._reachability import Reachability
from ..transport._address import UniqueAddress
from ._settings import SplitBrainResolverSettings
from ._strategy import Decision, DowningView, decide, resolve, reverse_decision

S = MemberStatus

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
