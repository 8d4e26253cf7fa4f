"""The split brain resolver's decisions and timing, without sockets or trio.

The scenario tests follow Akka's ``SplitBrainResolverIntegrationSpec`` matrix: nodes by side, the
decision evaluated once from each side. After a clean partition each side knows only its own
observations (the other side's gossip no longer arrives), so each view holds "everyone here sees
everyone over there as unreachable", and each side has seen its own gossip.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from membership import Address, ConfigurationError, UniqueAddress
from membership._member import NOT_UP, Member, MemberStatus
from membership._reachability import Reachability
from membership.sbr._resolver import (
    AcquireLease,
    DownNodes,
    ReleaseLease,
    ResolverState,
    SplitBrainResolverCore,
    SplitBrainResolverEffect,
)
from membership.sbr._settings import SplitBrainResolverSettings, StrategyName
from membership.sbr._strategy import Decision, DowningView, decide, resolve, reverse_decision

S = MemberStatus
D = Decision


def node(i: int) -> UniqueAddress:
    # Port order is address order: node(1) has the lowest address.
    return UniqueAddress(Address("10.0.0.1", 25520 + i), f"n{i}", 1000 + i)


def member(
    i: int,
    status: MemberStatus = S.UP,
    *,
    up: int | None = None,
    roles: Sequence[str] = (),
) -> Member:
    up_number = up if up is not None else (NOT_UP if status in (S.JOINING, S.WEAKLY_UP) else i)
    return Member(node(i), status, up_number, frozenset(roles))


def ups(*indexes: int) -> list[Member]:
    return [member(i) for i in indexes]


def nodes_of(members: Sequence[Member]) -> frozenset[UniqueAddress]:
    return frozenset(m.node for m in members)


def partition_table(mine: Sequence[Member], theirs: Sequence[Member]) -> Reachability:
    """Everyone in ``mine`` sees everyone in ``theirs`` as unreachable."""
    reachability = Reachability()
    for observer in mine:
        for subject in theirs:
            reachability = reachability.unreachable(observer.node, subject.node)
    return reachability


def side_view(mine: Sequence[Member], theirs: Sequence[Member]) -> DowningView:
    """The view of the first member of ``mine`` after a clean partition from ``theirs``."""
    return DowningView.of(
        self_node=mine[0].node,
        members=[*mine, *theirs],
        reachability=partition_table(mine, theirs),
        seen_by=nodes_of(mine),
    )


@attrs.frozen
class Outcome:
    side1: frozenset[UniqueAddress]  # what side 1 downs
    side2: frozenset[UniqueAddress]  # what side 2 downs


def split(
    settings: SplitBrainResolverSettings, side1: Sequence[Member], side2: Sequence[Member]
) -> Outcome:
    return Outcome(
        resolve(settings, side_view(side1, side2)).nodes_to_down,
        resolve(settings, side_view(side2, side1)).nodes_to_down,
    )


class Expected(enum.Enum):
    KEEP_SIDE_1 = "keep side 1"
    KEEP_SIDE_2 = "keep side 2"
    SHUTDOWN_BOTH = "shut down both"


def check(outcome: Outcome, expected: Expected, side1: list[Member], side2: list[Member]) -> None:
    one, two = nodes_of(side1), nodes_of(side2)
    if expected is Expected.KEEP_SIDE_1:
        assert outcome == Outcome(two, two)
    elif expected is Expected.KEEP_SIDE_2:
        assert outcome == Outcome(one, one)
    else:
        # Each side downs (at least) itself: nobody keeps running.
        assert one <= outcome.side1
        assert two <= outcome.side2


def sides(size1: int, size2: int) -> tuple[list[Member], list[Member]]:
    """Side 1 holds the lowest addresses and the oldest members."""
    return ups(*range(1, size1 + 1)), ups(*range(size1 + 1, size1 + size2 + 1))


QUORUM_5 = SplitBrainResolverSettings(active_strategy="static-quorum", quorum_size=5)
KEEP_MAJORITY = SplitBrainResolverSettings()
KEEP_OLDEST = SplitBrainResolverSettings(active_strategy="keep-oldest")
DOWN_ALL = SplitBrainResolverSettings(active_strategy="down-all")
LEASE_MAJORITY = SplitBrainResolverSettings(active_strategy="lease-majority")


# --- Akka's integration matrix ---------------------------------------------------------------


def test_static_quorum_1_2_shuts_down_both() -> None:
    side1, side2 = sides(1, 2)
    outcome = split(QUORUM_5, side1, side2)
    check(outcome, Expected.SHUTDOWN_BOTH, side1, side2)
    assert outcome == Outcome(nodes_of(side1), nodes_of(side2))


def test_static_quorum_4_4_shuts_down_both() -> None:
    side1, side2 = sides(4, 4)
    outcome = split(QUORUM_5, side1, side2)
    assert outcome == Outcome(nodes_of(side1), nodes_of(side2))


def test_static_quorum_5_4_keeps_side_1() -> None:
    side1, side2 = sides(5, 4)
    check(split(QUORUM_5, side1, side2), Expected.KEEP_SIDE_1, side1, side2)


def test_static_quorum_1_5_keeps_side_2() -> None:
    side1, side2 = sides(1, 5)
    check(split(QUORUM_5, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_static_quorum_4_5_keeps_side_2() -> None:
    side1, side2 = sides(4, 5)
    check(split(QUORUM_5, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_static_quorum_downs_all_when_more_than_twice_the_quorum_minus_one() -> None:
    side1, side2 = sides(5, 5)  # 10 > 5 * 2 - 1: both sides could think they have the quorum
    everyone = nodes_of(side1) | nodes_of(side2)
    assert split(QUORUM_5, side1, side2) == Outcome(everyone, everyone)
    assert decide(QUORUM_5, side_view(side1, side2)) is D.DOWN_ALL


def test_keep_majority_2_1_keeps_side_1() -> None:
    side1, side2 = sides(2, 1)
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_1, side1, side2)


def test_keep_majority_1_2_keeps_side_2() -> None:
    side1, side2 = sides(1, 2)
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_keep_majority_4_5_keeps_side_2() -> None:
    side1, side2 = sides(4, 5)
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_keep_majority_4_4_keeps_the_side_with_the_lowest_address() -> None:
    side1, side2 = sides(4, 4)  # node(1), the lowest address, is on side 1
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_1, side1, side2)
    # Move the lowest address to side 2: side 2 stays.
    side1, side2 = ups(2, 3, 4, 5), ups(1, 6, 7, 8)
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_keep_oldest_3_3_keeps_the_side_with_the_oldest() -> None:
    side1, side2 = sides(3, 3)
    check(split(KEEP_OLDEST, side1, side2), Expected.KEEP_SIDE_1, side1, side2)
    # Age is the up number, not the address.
    side1 = [member(1, up=10), member(2, up=11), member(3, up=12)]
    side2 = [member(4, up=1), member(5, up=13), member(6, up=14)]
    check(split(KEEP_OLDEST, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_keep_oldest_1_1_keeps_the_oldest() -> None:
    side1, side2 = sides(1, 1)
    check(split(KEEP_OLDEST, side1, side2), Expected.KEEP_SIDE_1, side1, side2)


def test_keep_oldest_1_2_downs_the_oldest_alone() -> None:
    side1, side2 = sides(1, 2)
    check(split(KEEP_OLDEST, side1, side2), Expected.KEEP_SIDE_2, side1, side2)
    # Without down_if_alone the oldest is kept even when alone.
    keep = attrs.evolve(KEEP_OLDEST, down_if_alone=False)
    check(split(keep, side1, side2), Expected.KEEP_SIDE_1, side1, side2)


def test_down_all_1_2_downs_everyone() -> None:
    side1, side2 = sides(1, 2)
    everyone = nodes_of(side1) | nodes_of(side2)
    assert split(DOWN_ALL, side1, side2) == Outcome(everyone, everyone)


class FirstComeLease:
    """In-memory stand-in for the Lease: granted to the first owner that asks."""

    def __init__(self) -> None:
        self.owner: UniqueAddress | None = None

    def acquire(self, owner: UniqueAddress) -> bool:
        if self.owner is None:
            self.owner = owner
        return self.owner == owner


def only(effects: list[SplitBrainResolverEffect]) -> SplitBrainResolverEffect:
    assert len(effects) == 1, effects
    return effects[0]


def test_lease_majority_4_5_keeps_side_2() -> None:
    side1, side2 = sides(4, 5)
    everyone = [*side1, *side2]
    lease = FirstComeLease()
    cores = {}
    for mine, theirs in ((side1, side2), (side2, side1)):
        core = SplitBrainResolverCore(LEASE_MAJORITY, mine[0].node, now=0.0)
        core.update(everyone, Reachability(), is_leader=True, now=0.0)
        core.update(everyone, partition_table(mine, theirs), is_leader=True, now=1.0)
        cores[mine[0].node] = core
    leader1, leader2 = cores[side1[0].node], cores[side2[0].node]

    # Stable 20 s after the split: the majority tries at once, the minority waits first.
    ask2 = only(leader2.tick(21.0))
    ask1 = only(leader1.tick(21.0))
    assert ask2 == AcquireLease(delay=0.0, decision=D.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE)
    assert ask1 == AcquireLease(delay=2.0, decision=D.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE)
    assert leader1.state is ResolverState.WAITING_FOR_LEASE
    assert leader1.tick(22.0) == []  # ticks are ignored while waiting

    down2 = only(leader2.lease_acquired(lease.acquire(side2[0].node), now=21.0))
    down1 = only(leader1.lease_acquired(lease.acquire(side1[0].node), now=23.0))
    assert down2 == DownNodes(
        nodes=tuple(m.node for m in side1), decision=D.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE
    )
    # Refused: the reverse decision downs its own side, self last.
    assert down1 == DownNodes(
        nodes=(*(m.node for m in side1[1:]), side1[0].node), decision=D.DOWN_REACHABLE
    )
    assert leader2.holding_lease
    assert not leader1.holding_lease


def test_indirectly_connected_are_downed_and_the_rest_carries_on() -> None:
    a, b, c = ups(1, 2, 3)
    # A and B cannot see each other; C sees both, so gossip still flows between them via C.
    reachability = Reachability().unreachable(a.node, b.node).unreachable(b.node, a.node)
    for self_node in (a.node, b.node, c.node):
        view = DowningView.of(
            self_node=self_node,
            members=[a, b, c],
            reachability=reachability,
            seen_by={a.node, b.node, c.node},
        )
        assert view.indirectly_connected == {a.node, b.node}
        resolution = resolve(KEEP_MAJORITY, view)
        assert resolution.decision is D.DOWN_INDIRECTLY_CONNECTED
        assert resolution.nodes_to_down == {a.node, b.node}


def test_indirectly_connected_combined_with_a_crash() -> None:
    # Akka: {(A, B), D, E} | {C} => {D, E}: C crashed, A and B are indirectly connected.
    a, b, c, d, e = ups(1, 2, 3, 4, 5)
    reachability = (
        Reachability()
        .unreachable(a.node, b.node)
        .unreachable(b.node, a.node)
        .unreachable(b.node, c.node)
    )
    view = DowningView.of(self_node=d.node, members=[a, b, c, d, e], reachability=reachability)
    resolution = resolve(KEEP_MAJORITY, view)
    assert resolution.decision is D.DOWN_INDIRECTLY_CONNECTED
    assert resolution.nodes_to_down == {a.node, b.node, c.node}


def test_indirectly_connected_found_through_the_seen_set() -> None:
    # A marks B and C unreachable, yet they have seen the current gossip: no clean partition.
    a, b, c = ups(1, 2, 3)
    reachability = Reachability().unreachable(a.node, b.node).unreachable(a.node, c.node)
    everyone = {a.node, b.node, c.node}
    view = DowningView.of(
        self_node=a.node, members=[a, b, c], reachability=reachability, seen_by=everyone
    )
    assert resolve(KEEP_MAJORITY, view).nodes_to_down == everyone
    # The same observations with B and C not having seen it: a clean partition, A alone loses.
    view = DowningView.of(
        self_node=a.node, members=[a, b, c], reachability=reachability, seen_by={a.node}
    )
    assert resolve(KEEP_MAJORITY, view).nodes_to_down == {a.node}


def test_indirectly_connected_found_again_in_the_second_pass_downs_all() -> None:
    # Akka: {A, B, C} | {(D, E), (F, G)} seen from side 1 after D->E and G->F were observed
    # before the clean partition: the second pass still finds them, so everything is downed.
    side1, side2 = ups(1, 2, 3), ups(4, 5, 6, 7)
    d, e, f, g = (m.node for m in side2)
    reachability = partition_table(side1, side2).unreachable(d, e).unreachable(g, f)
    view = DowningView.of(
        self_node=side1[0].node,
        members=[*side1, *side2],
        reachability=reachability,
        seen_by=nodes_of(side1),
    )
    resolution = resolve(KEEP_MAJORITY, view)
    assert resolution.decision is D.DOWN_ALL
    assert resolution.nodes_to_down == nodes_of(side1) | nodes_of(side2)


def test_lease_majority_indirectly_connected_and_its_reverse() -> None:
    a, b, c = ups(1, 2, 3)
    reachability = Reachability().unreachable(a.node, b.node).unreachable(b.node, a.node)
    view = DowningView.of(self_node=c.node, members=[a, b, c], reachability=reachability)
    resolution = resolve(LEASE_MAJORITY, view)
    assert resolution.decision is D.ACQUIRE_LEASE_AND_DOWN_INDIRECTLY_CONNECTED
    assert resolution.acquire_lease_delay == 0.0
    assert resolution.nodes_to_down == {a.node, b.node}
    reverse = resolve(LEASE_MAJORITY, view, reverse_decision(resolution.decision))
    assert reverse.decision is D.REVERSE_DOWN_INDIRECTLY_CONNECTED
    assert reverse.nodes_to_down == {a.node, b.node, c.node}
    with pytest.raises(ValueError, match="does not need a lease"):
        reverse_decision(D.DOWN_ALL)


# --- counting as Akka counts ------------------------------------------------------------------


def test_keep_majority_counts_joining_on_the_other_side_as_possibly_up() -> None:
    # Akka: {A, B, F', G'} | {C, D, E}. Side 1 moved F and G to Up just as the partition
    # happened; side 2 still sees them Joining.
    side1, side2 = ups(1, 2, 6, 7), ups(3, 4, 5)
    assert resolve(KEEP_MAJORITY, side_view(side1, side2)).nodes_to_down == nodes_of(side2)
    seen_from_2 = [member(1), member(2), member(6, S.JOINING), member(7, S.JOINING)]
    resolution = resolve(KEEP_MAJORITY, side_view(side2, seen_from_2))
    # 3 against 2 without them, 3 against 4 with them: the answers differ, so down everyone.
    assert resolution.decision is D.DOWN_ALL
    assert resolution.nodes_to_down == nodes_of(side1) | nodes_of(side2)


def test_joining_members_are_not_counted_but_downed_with_their_side() -> None:
    # Akka: {B, D} | {Aj, C} => {B, D}: joining A is not counted, not even as the lowest address.
    side1, side2 = ups(2, 4), [member(1, S.JOINING), member(3)]
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_1, side1, side2)


def test_leaving_here_may_be_exiting_there() -> None:
    # Akka: {A', B, Ej} | {C, D}: A is Leaving on side 1 and may already be Exiting on side 2.
    side1 = [member(1, S.LEAVING), member(2), member(5, S.JOINING)]
    side2 = ups(3, 4)
    assert decide(KEEP_MAJORITY, side_view(side1, side2)) is D.DOWN_ALL
    side1_seen_from_2 = [member(1, S.EXITING), member(2)]
    resolution = resolve(KEEP_MAJORITY, side_view(side2, side1_seen_from_2))
    assert resolution.decision is D.DOWN_UNREACHABLE
    assert resolution.nodes_to_down == {node(2)}  # Exiting A is not downed


def test_keep_oldest_leaving_oldest_downs_all() -> None:
    # Akka scenario: {A, E'} | {B, C, D} where E (the oldest) is Leaving.
    side1 = [member(1, up=5), member(5, S.LEAVING, up=1)]
    side2 = [member(2, up=2), member(3, up=3), member(4, up=4)]
    assert decide(KEEP_OLDEST, side_view(side1, side2)) is D.DOWN_ALL
    assert decide(KEEP_OLDEST, side_view(side2, side1)) is D.DOWN_REACHABLE


def test_down_and_exiting_members_are_neither_counted_nor_downed() -> None:
    side1 = ups(1, 2)
    side2 = [member(3), member(4, S.DOWN), member(5, S.EXITING)]
    assert split(KEEP_MAJORITY, side1, side2) == Outcome(frozenset({node(3)}), frozenset({node(3)}))


def test_keep_majority_with_role() -> None:
    # Two backends against one backend and three frontends: the backends decide.
    side1 = [member(1, roles=["backend"]), member(2, roles=["backend"])]
    side2 = [member(3, roles=["backend"]), *(member(i, roles=["frontend"]) for i in (4, 5, 6))]
    backend = attrs.evolve(KEEP_MAJORITY, role="backend")
    check(split(backend, side1, side2), Expected.KEEP_SIDE_1, side1, side2)
    check(split(KEEP_MAJORITY, side1, side2), Expected.KEEP_SIDE_2, side1, side2)
    # Equal halves of the role: the lowest address with the role decides.
    side1 = [member(1, roles=["x"]), member(4, roles=["backend"])]
    side2 = [member(2, roles=["x"]), member(3, roles=["backend"])]
    check(split(backend, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_no_member_with_the_role_downs_all() -> None:
    side1, side2 = sides(1, 1)
    nobody = attrs.evolve(KEEP_MAJORITY, role="backend")
    assert decide(nobody, side_view(side1, side2)) is D.DOWN_ALL


def test_static_quorum_and_keep_oldest_with_role() -> None:
    side1 = [member(1), member(2, roles=["db"]), member(3, roles=["db"])]
    side2 = [member(4, roles=["db"]), member(5), member(6)]
    quorum = SplitBrainResolverSettings(active_strategy="static-quorum", quorum_size=2, role="db")
    check(split(quorum, side1, side2), Expected.KEEP_SIDE_1, side1, side2)
    # The oldest with the role is node 4 (up number 1), although node 1 is older.
    side2 = [member(4, up=1, roles=["db"]), member(5), member(6)]
    side1 = [member(1, up=0), member(2, roles=["db"]), member(3, roles=["db"])]
    oldest_db = attrs.evolve(KEEP_OLDEST, role="db", down_if_alone=False)
    check(split(oldest_db, side1, side2), Expected.KEEP_SIDE_2, side1, side2)


def test_lease_majority_delay_on_equal_halves_goes_to_the_side_without_the_lowest_address() -> None:
    side1, side2 = sides(2, 2)
    assert resolve(LEASE_MAJORITY, side_view(side1, side2)).acquire_lease_delay == 0.0
    assert resolve(LEASE_MAJORITY, side_view(side2, side1)).acquire_lease_delay == 2.0


# --- properties -------------------------------------------------------------------------------


@st.composite
def partitions(draw: st.DrawFn) -> tuple[list[Member], list[Member]]:
    """Any split of 2..12 members (random addresses order and ages) into two non-empty sides."""
    n = draw(st.integers(2, 12))
    ages = draw(st.permutations(range(1, n + 1)))
    members = [member(i + 1, up=ages[i]) for i in range(n)]
    in_side1 = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    side1 = [m for m, one in zip(members, in_side1, strict=True) if one]
    side2 = [m for m, one in zip(members, in_side1, strict=True) if not one]
    if not side1 or not side2:
        side1, side2 = members[:1], members[1:]
    return draw(st.permutations(side1)), draw(st.permutations(side2))


def survivors(
    settings: SplitBrainResolverSettings, side1: list[Member], side2: list[Member]
) -> list[int]:
    """Which sides keep running by their own decision."""
    outcome = split(settings, side1, side2)
    kept = []
    if not outcome.side1 & nodes_of(side1):
        kept.append(1)
    if not outcome.side2 & nodes_of(side2):
        kept.append(2)
    return kept


@given(partitions())
def test_keep_majority_exactly_one_side_survives(sides_: tuple[list[Member], list[Member]]) -> None:
    side1, side2 = sides_
    kept = survivors(KEEP_MAJORITY, side1, side2)
    assert len(kept) == 1
    outcome = split(KEEP_MAJORITY, side1, side2)
    # Both sides agree on the loser.
    loser = nodes_of(side2) if kept == [1] else nodes_of(side1)
    assert outcome == Outcome(loser, loser)


@given(partitions())
def test_keep_oldest_exactly_one_side_survives(sides_: tuple[list[Member], list[Member]]) -> None:
    side1, side2 = sides_
    assert len(survivors(KEEP_OLDEST, side1, side2)) == 1


@given(partitions(), st.integers(1, 8))
def test_static_quorum_never_keeps_both_sides(
    sides_: tuple[list[Member], list[Member]], quorum: int
) -> None:
    side1, side2 = sides_
    settings = SplitBrainResolverSettings(active_strategy="static-quorum", quorum_size=quorum)
    assert len(survivors(settings, side1, side2)) <= 1


@st.composite
def partitions_during_membership_changes(
    draw: st.DrawFn,
) -> tuple[list[Member], list[Member], list[Member], list[Member]]:
    """A split at the moment the leader moved members along (Joining to Up, Leaving to Exiting).

    Only the leader's side hears of the moves, wherever the moved members are. Returns (side 1,
    side 2) as side 1 sees them, then (side 1, side 2) as side 2 sees them.
    """
    n = draw(st.integers(2, 10))
    statuses = [draw(st.sampled_from([S.UP, S.UP, S.JOINING, S.LEAVING])) for _ in range(n)]
    in_side1 = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    moved = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    one = [i for i in range(n) if in_side1[i]]
    two = [i for i in range(n) if not in_side1[i]]
    if not one or not two:
        one, two = [0], list(range(1, n))
    before = [member(i + 1, statuses[i]) for i in range(n)]
    # The leader as it was before the split: the first Up or Leaving member by address.
    leader = min(range(n), key=lambda i: (before[i].status not in (S.UP, S.LEAVING), i))
    after = list(before)
    for i, m in enumerate(before):
        if moved[i] and m.status is S.JOINING:
            after[i] = m.up(100 + i)
        elif moved[i] and m.status is S.LEAVING:
            after[i] = m.with_status(S.EXITING)
    by_1, by_2 = (after, before) if leader in one else (before, after)
    return (
        [by_1[i] for i in one],
        [by_1[i] for i in two],
        [by_2[i] for i in one],
        [by_2[i] for i in two],
    )


def keeps_running(downed: frozenset[UniqueAddress], side: Sequence[Member]) -> bool:
    """A side keeps running if one of its members that counts (Up or Leaving) is not downed."""
    return any(m.status in (S.UP, S.LEAVING) and m.node not in downed for m in side)


@pytest.mark.parametrize("strategy", ["keep-majority", "keep-oldest"])
@given(changes=partitions_during_membership_changes())
def test_never_both_sides_survive_even_during_membership_changes(
    strategy: StrategyName,
    changes: tuple[list[Member], list[Member], list[Member], list[Member]],
) -> None:
    # Akka's edge-case checks exist for these two strategies; static-quorum has none.
    side1_by_1, side2_by_1, side1_by_2, side2_by_2 = changes
    settings = SplitBrainResolverSettings(active_strategy=strategy)
    downed_by_1 = resolve(settings, side_view(side1_by_1, side2_by_1)).nodes_to_down
    downed_by_2 = resolve(settings, side_view(side2_by_2, side1_by_2)).nodes_to_down
    assert not (keeps_running(downed_by_1, side1_by_1) and keeps_running(downed_by_2, side2_by_2))


# --- the timing state machine ----------------------------------------------------------------


class Cluster:
    """A core on the first of some Up members, and a way to change what it sees."""

    def __init__(
        self,
        n: int,
        settings: SplitBrainResolverSettings = KEEP_MAJORITY,
        *,
        is_leader: bool = True,
        self_index: int = 1,
    ) -> None:
        self.members = {i: member(i) for i in range(1, n + 1)}
        self.self_node = node(self_index)
        self.core = SplitBrainResolverCore(settings, self.self_node, now=0.0)
        self.unreachable: set[int] = set()
        self.is_leader = is_leader
        self.push(0.0)

    def push(self, now: float) -> None:
        reachability = Reachability()
        for i in sorted(self.unreachable):
            reachability = reachability.unreachable(self.self_node, node(i))
        self.core.update(
            self.members.values(),
            reachability,
            is_leader=self.is_leader,
            now=now,
            seen_by=[self.self_node],
        )

    def lose(self, now: float, *indexes: int) -> None:
        self.unreachable.update(indexes)
        self.push(now)

    def regain(self, now: float, *indexes: int) -> None:
        self.unreachable.difference_update(indexes)
        self.push(now)


def downs(effects: list[SplitBrainResolverEffect]) -> list[tuple[set[int], Decision]]:
    """The DownNodes effects as (member indexes, decision); any other effect fails the test."""
    found = []
    for e in effects:
        assert isinstance(e, DownNodes)
        found.append(({n.address.port - 25520 for n in e.nodes}, e.decision))
    return found


def test_no_decision_before_stable_after() -> None:
    c = Cluster(5)
    c.lose(5.0, 4)
    assert c.core.tick(24.9) == []
    assert downs(c.core.tick(25.0)) == [({4}, D.DOWN_UNREACHABLE)]


def test_a_change_restarts_the_stable_timer() -> None:
    c = Cluster(5)
    c.lose(5.0, 4)
    c.lose(15.0, 5)  # another member becomes unreachable: restart
    assert c.core.tick(25.0) == []
    assert c.core.tick(34.9) == []
    assert downs(c.core.tick(35.0)) == [({4, 5}, D.DOWN_UNREACHABLE)]


def test_healing_all_resets_the_measurement_of_instability() -> None:
    settings = SplitBrainResolverSettings(stable_after=2.0, down_all_when_unstable=1.0)
    c = Cluster(5, settings)
    for t in range(10):
        (c.lose if t % 2 == 0 else c.regain)(float(t), 5)
        assert c.core.tick(float(t)) == []


def test_healing_during_stable_after_needs_no_decision() -> None:
    c = Cluster(3)
    c.lose(5.0, 3)
    c.regain(10.0, 3)
    assert c.core.tick(100.0) == []
    assert c.core.statistics().reachability_changes == 0  # healed: instability reset


def test_joining_members_do_not_restart_the_stable_timer() -> None:
    c = Cluster(5)
    c.lose(5.0, 4)
    c.members[6] = member(6, S.JOINING)
    c.push(15.0)
    c.members[6] = member(6, S.WEAKLY_UP)
    c.push(16.0)
    # WeaklyUp 6 is reachable and stays; unreachable 4 is downed on time.
    assert downs(c.core.tick(25.0)) == [({4}, D.DOWN_UNREACHABLE)]


def test_members_becoming_up_restart_the_stable_timer() -> None:
    c = Cluster(5)
    c.members[6] = member(6, S.JOINING)
    c.push(1.0)
    c.lose(5.0, 4)
    c.members[6] = member(6)
    c.push(15.0)
    assert c.core.tick(25.0) == []
    assert downs(c.core.tick(35.0)) == [({4}, D.DOWN_UNREACHABLE)]


def test_decides_again_only_after_a_new_stable_period() -> None:
    c = Cluster(5)
    c.lose(0.0, 5)
    assert downs(c.core.tick(20.0)) == [({5}, D.DOWN_UNREACHABLE)]
    assert c.core.tick(21.0) == []  # the decision restarted the timer
    # The Down status arrives: a change (Akka treats "downed" as unreachable), then removal.
    c.members[5] = member(5, S.DOWN)
    c.push(22.0)
    assert c.core.tick(60.0) == []  # nothing downable is unreachable
    del c.members[5]
    c.unreachable.discard(5)
    c.push(61.0)
    assert c.core.tick(100.0) == []


def test_only_the_leader_decides() -> None:
    c = Cluster(5, is_leader=False)
    c.lose(0.0, 5)
    assert c.core.tick(30.0) == []
    assert not c.core.is_responsible
    # Becoming leader does not restart the timer: it decides at the next tick.
    c.is_leader = True
    c.push(31.0)
    assert downs(c.core.tick(31.0)) == [({5}, D.DOWN_UNREACHABLE)]


def test_the_leader_decides_only_once_its_own_member_was_added() -> None:
    c = Cluster(3)
    c.members[1] = member(1, S.JOINING)
    c.core = SplitBrainResolverCore(KEEP_MAJORITY, node(1), now=0.0)
    c.lose(0.0, 3)
    assert c.core.tick(30.0) == []
    c.members[1] = member(1, S.WEAKLY_UP)
    c.push(30.0)
    assert c.core.is_responsible
    # Akka's "down when becoming WeaklyUp leader": 1 counted member here (2), 1 over there (3):
    # equal halves, and the lowest counted address (2) is here.
    assert downs(c.core.tick(30.0)) == [({3}, D.DOWN_UNREACHABLE)]


def test_down_all_when_unstable() -> None:
    # Akka's "down all when unstable, scenario 1": stable_after 2 s, 1 s more of instability.
    settings = SplitBrainResolverSettings(stable_after=2.0, down_all_when_unstable=1.0)
    c = Cluster(5, settings)
    c.lose(0.0, 4, 5)
    assert c.core.tick(0.0) == []
    c.regain(1.0, 5)
    assert c.core.tick(1.0) == []
    c.lose(2.0, 5)
    assert c.core.tick(2.0) == []
    c.regain(3.0, 5)
    assert downs(c.core.tick(3.0)) == [({1, 2, 3, 4, 5}, D.DOWN_ALL)]


def test_down_all_when_unstable_runs_on_every_node_not_only_the_leader() -> None:
    settings = SplitBrainResolverSettings(stable_after=2.0, down_all_when_unstable=1.0)
    c = Cluster(5, settings, is_leader=False)
    c.lose(0.0, 4)
    for t in range(4):
        (c.lose if t % 2 == 0 else c.regain)(float(t), 5)
    assert downs(c.core.tick(3.0)) == [({1, 2, 3, 4, 5}, D.DOWN_ALL)]


def test_no_down_all_when_it_becomes_stable_again() -> None:
    settings = SplitBrainResolverSettings(stable_after=2.0, down_all_when_unstable=1.0)
    c = Cluster(5, settings)
    c.lose(0.0, 4, 5)
    c.regain(1.0, 5)
    c.regain(1.5, 4)  # everything healed: the measurement of instability starts over
    c.lose(2.5, 5)
    assert c.core.tick(3.0) == []
    assert downs(c.core.tick(4.5)) == [({5}, D.DOWN_UNREACHABLE)]


def test_down_all_when_unstable_off() -> None:
    settings = SplitBrainResolverSettings(stable_after=2.0, down_all_when_unstable="off")
    c = Cluster(5, settings)
    c.lose(0.0, 4)
    for t in range(10):
        (c.lose if t % 2 == 0 else c.regain)(float(t), 5)
        assert c.core.tick(float(t)) == []
    assert c.core.tick(10.9) == []
    assert downs(c.core.tick(11.0)) == [({4}, D.DOWN_UNREACHABLE)]


def test_self_removed_stops_the_core() -> None:
    c = Cluster(3)
    c.lose(0.0, 3)
    del c.members[1]
    c.push(1.0)
    assert c.core.state is ResolverState.STOPPED
    assert c.core.tick(100.0) == []


def test_quarantined_by_a_member_downs_self() -> None:
    c = Cluster(3, is_leader=False)
    assert downs(c.core.quarantined_by_remote(node(2), 1.0)) == [
        ({1}, D.DOWN_SELF_QUARANTINED_BY_REMOTE)
    ]
    assert c.core.quarantined_by_remote(node(9), 1.0) == []  # not a member: ignored


def test_lease_is_released_after_the_downed_members_are_removed() -> None:
    settings = attrs.evolve(LEASE_MAJORITY, lease_release_after=40.0)
    c = Cluster(3, settings)
    c.lose(0.0, 3)
    assert c.core.tick(20.0) == [
        AcquireLease(delay=0.0, decision=D.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE)
    ]
    # A change while waiting is applied after the result, on the picture the decision came from.
    c.members[4] = member(4, S.JOINING)
    c.push(20.5)
    assert downs(c.core.lease_acquired(True, now=21.0)) == [
        ({3}, D.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE)
    ]
    assert c.core.view.members[-1].node == node(4)
    assert c.core.holding_lease
    c.members[3] = member(3, S.DOWN)
    c.push(22.0)
    assert c.core.tick(50.0) == []  # still waiting for the removal
    del c.members[3]
    c.unreachable.discard(3)
    c.push(60.0)
    assert c.core.tick(99.0) == []
    assert c.core.tick(100.0) == [ReleaseLease()]
    assert c.core.tick(101.0) == []  # one request at a time
    c.core.lease_released(False, now=102.0)
    assert c.core.tick(103.0) == [ReleaseLease()]
    c.core.lease_released(True, now=104.0)
    assert not c.core.holding_lease


def test_holding_the_lease_decides_without_asking_again() -> None:
    c = Cluster(5, LEASE_MAJORITY)
    c.lose(0.0, 5)
    only(c.core.tick(20.0))
    c.core.lease_acquired(True, now=20.0)
    c.lose(30.0, 4)
    assert downs(c.core.tick(50.0)) == [({4, 5}, D.ACQUIRE_LEASE_AND_DOWN_UNREACHABLE)]
    c.core.lease_lost()
    c.lose(51.0, 3)
    assert isinstance(only(c.core.tick(71.0)), AcquireLease)


def test_a_late_lease_result_is_ignored() -> None:
    c = Cluster(3, LEASE_MAJORITY)
    assert c.core.lease_acquired(True, now=1.0) == []
    assert not c.core.holding_lease


def test_statistics() -> None:
    c = Cluster(3)
    c.lose(4.0, 3)
    stats = c.core.statistics()
    assert stats.state is ResolverState.ACTIVE
    assert stats.responsible
    assert stats.unreachable == 1
    assert stats.stable_deadline == 24.0
    assert (stats.reachability_changes, stats.first_change_at) == (1, 4.0)


# --- settings --------------------------------------------------------------------------------


def test_settings_defaults_are_akkas() -> None:
    s = SplitBrainResolverSettings()
    assert s.active_strategy == "keep-majority"
    assert s.stable_after == 20.0
    assert s.down_all_when_unstable_after == 15.0
    assert s.down_if_alone is True
    assert s.acquire_lease_delay_for_minority == 2.0
    assert s.lease_release_after == 40.0
    assert s.lease_name_for("shop") == "shop-p2pshard-sbr"
    assert attrs.evolve(s, lease_name="carts").lease_name_for("shop") == "carts"


@pytest.mark.parametrize(
    ("stable_after", "value", "expected"),
    [(20.0, "on", 15.0), (4.0, "on", 4.0), (0.0, "on", 4.0), (20.0, 7, 7.0), (20.0, "off", None)],
)
def test_down_all_when_unstable_derivation(
    stable_after: float, value: float | str, expected: float | None
) -> None:
    s = SplitBrainResolverSettings(stable_after=stable_after, down_all_when_unstable=value)  # type: ignore[arg-type]
    assert s.down_all_when_unstable_after == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"active_strategy": "keep-referee"},
            r"active_strategy = 'keep-referee' .*'keep-majority'",
        ),
        ({"active_strategy": "static-quorum"}, r"quorum_size = None .*'static-quorum'"),
        ({"active_strategy": "static-quorum", "quorum_size": 0}, r"quorum_size = 0 .*at least 1"),
        ({"quorum_size": True}, r"quorum_size = True"),
        ({"stable_after": -1}, r"stable_after = -1 is invalid"),
        ({"stable_after": float("nan")}, r"stable_after = nan is invalid"),
        ({"down_all_when_unstable": 0}, r"down_all_when_unstable = 0 .*'on', 'off'"),
        ({"down_all_when_unstable": "yes"}, r"down_all_when_unstable = 'yes'"),
        ({"down_all_when_unstable": True}, r"down_all_when_unstable = True"),
        ({"role": ""}, r"role = '' is invalid"),
        ({"lease_name": " x"}, r"lease_name = ' x' is invalid"),
        ({"down_if_alone": "on"}, r"down_if_alone = 'on' .*True or False"),
        ({"acquire_lease_delay_for_minority": -0.5}, r"acquire_lease_delay_for_minority"),
    ],
)
def test_settings_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        SplitBrainResolverSettings(**kwargs)  # type: ignore[arg-type]


def test_duplicate_members_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        DowningView.of(self_node=node(1), members=ups(1, 1), reachability=Reachability())
