"""The gossip state and its rules, without sockets or trio."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membership import Address, IllegalTransition, UniqueAddress
from membership._gossip import (
    Gossip,
    convergence,
    leader,
    leader_actions_on_convergence,
    leader_actions_weakly_up,
    oldest,
    singleton_host,
)
from membership._member import ALLOWED_TRANSITIONS, NOT_UP, Member, MemberStatus
from membership._reachability import Reachability
from membership._vclock import Order, VectorClock
from tests._support.examples import examples

S = MemberStatus


def node(i: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", 2550 + i), f"n{i}", uid)


def member(
    i: int, status: MemberStatus = S.UP, up: int | None = None, roles: tuple[str, ...] = ()
) -> Member:
    return Member(
        node(i), status, up if up is not None else (i if status is not S.JOINING else NOT_UP), roles
    )


def gossip(*members: Member, seen: tuple[int, ...] | None = None) -> Gossip:
    g = Gossip(members)
    everyone = [m.node for m in members] if seen is None else [node(i) for i in seen]
    return attrs.evolve(g, seen=frozenset(everyone))


# ---- member life cycle ---------------------------------------------------------------------


@pytest.mark.parametrize("start", list(S))
@pytest.mark.parametrize("end", list(S))
def test_only_akkas_transitions_are_allowed(start: MemberStatus, end: MemberStatus) -> None:
    m = Member(node(1), start)
    if start is end or end in ALLOWED_TRANSITIONS[start]:
        assert m.with_status(end).status is end
    else:
        with pytest.raises(IllegalTransition, match=f"{start.name} -> {end.name}"):
            m.with_status(end)
        assert m.status is start  # unchanged


def test_oldest_is_lowest_up_number_then_address() -> None:
    g = gossip(member(1, up=3), member(2, up=1), member(3, up=1), member(4, S.JOINING))
    found = oldest(g)
    assert found is not None
    assert found.node == node(2)
    assert member(2, up=1).is_older_than(member(3, up=1))
    assert not member(1, up=3).is_older_than(member(2, up=1))


def test_oldest_per_role_and_only_up_or_leaving() -> None:
    g = gossip(
        member(1, S.WEAKLY_UP, up=NOT_UP, roles=("a",)),
        member(2, up=5, roles=("b",)),
        member(3, S.LEAVING, up=7, roles=("a",)),
        member(4, S.EXITING, up=1, roles=("a",)),
    )
    assert oldest(g, "a") == member(3, S.LEAVING, up=7, roles=("a",))
    assert oldest(g, "b") == member(2, up=5, roles=("b",))
    assert oldest(g, "c") is None


def test_singletons_run_on_the_oldest_member_while_every_member_runs_one_version() -> None:
    g = gossip(member(1, up=3), member(2, up=1), member(3, up=2))
    assert singleton_host(g) == oldest(g) == member(2, up=1)
    versioned = [attrs.evolve(m, app_version="1.4.0") for m in g.members]
    host = singleton_host(Gossip(tuple(versioned)))
    assert host == attrs.evolve(member(2, up=1), app_version="1.4.0")


def test_during_a_rollout_singletons_run_on_the_oldest_member_of_the_newest_version() -> None:
    def at(i: int, version: str, status: S = S.UP, roles: tuple[str, ...] = ()) -> Member:
        return attrs.evolve(member(i, status, roles=roles), app_version=version)

    g = gossip(at(1, "1.9.0"), at(2, "1.9.0"), at(3, "1.10.0-rc.1"), at(4, "1.10.0"), at(5, "1.10"))
    assert singleton_host(g) == at(4, "1.10.0")  # 1.10 = 1.10.0 > 1.10.0-rc.1 > 1.9.0
    # A joining member of a newer version does not count until it is Up; a leaving one does.
    g = gossip(at(1, "1.0.0"), at(2, "2.0.0", S.JOINING), at(3, "1.1.0", S.LEAVING))
    assert singleton_host(g) == at(3, "1.1.0", S.LEAVING)
    # Per role: the newest among the role's members only.
    a, b = ("a",), ("b",)
    g = gossip(at(1, "1.0.0", roles=a), at(2, "3.0.0", roles=b), at(3, "2.0.0", roles=a))
    assert singleton_host(g, "a") == at(3, "2.0.0", roles=("a",))
    assert singleton_host(g, "c") is None


# ---- vector clocks ---------------------------------------------------------------------------


def test_vector_clock_order() -> None:
    a = VectorClock().increment(node(1))
    b = a.increment(node(2))
    c = a.increment(node(3))
    assert a.compare(a) is Order.SAME
    assert a.compare(b) is Order.BEFORE
    assert b.compare(a) is Order.AFTER
    assert b.compare(c) is Order.CONCURRENT
    assert b.merge(c).compare(b) is Order.AFTER
    assert b.prune(node(2)) == a


# ---- convergence and leader --------------------------------------------------------------------


def test_convergence_needs_every_up_and_leaving_member_to_have_seen() -> None:
    g = gossip(member(1), member(2, S.LEAVING), member(3, S.JOINING), seen=(1, 2))
    assert convergence(g, node(1))  # a Joining member does not need to have seen it
    assert not convergence(attrs.evolve(g, seen=frozenset({node(1)})), node(1))


def test_unreachable_member_blocks_convergence_unless_down_or_exiting() -> None:
    g = gossip(member(1), member(2), member(3))
    g = attrs.evolve(g, reachability=Reachability().unreachable(node(1), node(3)))
    assert not convergence(g, node(1))
    assert convergence(g.marked_down(node(3)).mark_seen(node(1)).mark_seen(node(2)), node(1))
    exiting = g.with_member(member(3, S.LEAVING).with_status(S.EXITING))
    assert convergence(exiting, node(1))


def test_observations_of_a_down_member_do_not_count() -> None:
    g = gossip(member(1), member(2), member(3, S.DOWN), seen=(1, 2))
    g = attrs.evolve(g, reachability=Reachability().unreachable(node(3), node(2)))
    assert convergence(g, node(1))


def test_leader_is_first_reachable_by_address_preferring_up() -> None:
    g = gossip(member(1, S.JOINING), member(2), member(3))
    assert leader(g, node(3)) == node(2)
    unreachable = attrs.evolve(g, reachability=Reachability().unreachable(node(3), node(2)))
    assert leader(unreachable, node(3)) == node(3)
    only_joining = gossip(member(2, S.JOINING), member(1, S.EXITING, up=1))
    assert leader(only_joining, node(2)) == node(2)
    assert leader(gossip(member(1, S.DOWN)), node(9)) is None


def test_role_leader() -> None:
    g = gossip(member(1, roles=("a",)), member(2, roles=("b",)), member(3, roles=("b",)))
    assert leader(g, node(1), "b") == node(2)


# ---- leader actions ----------------------------------------------------------------------------


def test_leader_moves_joining_up_in_address_order_leaving_to_exiting_and_removes() -> None:
    g = gossip(
        member(1, up=1), member(2, S.LEAVING, up=2), member(4, S.JOINING), member(3, S.JOINING)
    )
    down = g.with_member(Member(node(5), S.DOWN, 3))
    down = attrs.evolve(down, reachability=Reachability().unreachable(node(1), node(5)))
    result = leader_actions_on_convergence(down, node(1), now=100.0)
    assert [m.node for m in result.moved_up] == [node(3), node(4)]
    assert [m.up_number for m in result.moved_up] == [4, 5]
    assert [m.node for m in result.exiting] == [node(2)]
    assert [m.node for m in result.removed] == [node(5)]
    after = result.gossip
    assert not after.has_member(node(5))
    assert after.is_tombstoned(node(5))
    assert after.seen == {node(1)}
    assert after.version.compare(down.version) is Order.AFTER


def test_nothing_to_do_leaves_the_version_alone() -> None:
    g = gossip(member(1), member(2))
    result = leader_actions_on_convergence(g, node(1), now=1.0)
    assert not result.changed
    assert result.gossip == g


def test_min_nr_of_members_gates_joining_to_up() -> None:
    g = gossip(member(1, S.JOINING), member(2, S.JOINING))
    assert not leader_actions_on_convergence(g, node(1), 0.0, min_nr_of_members=3).moved_up
    assert len(leader_actions_on_convergence(g, node(1), 0.0, min_nr_of_members=2).moved_up) == 2
    roles = gossip(member(1, S.JOINING, roles=("a",)), member(2, S.JOINING))
    assert not leader_actions_on_convergence(
        roles, node(1), 0.0, min_nr_of_members_of_role=[("a", 2)]
    ).moved_up


def test_exiting_confirmed_member_is_removed_even_if_reachable() -> None:
    g = gossip(member(1), member(2, S.EXITING))
    result = leader_actions_on_convergence(g, node(1), 5.0, exiting_confirmed=[node(2)])
    assert [m.node for m in result.removed] == [node(2)]


def test_weakly_up_only_for_reachable_joining_members() -> None:
    g = gossip(member(1), member(2, S.JOINING), member(3, S.JOINING))
    g = attrs.evolve(g, reachability=Reachability().unreachable(node(1), node(3)))
    result = leader_actions_weakly_up(g, node(1))
    assert [m.node for m in result.moved_weakly_up] == [node(2)]


def test_tombstoned_incarnation_never_returns_in_a_merge() -> None:
    old = gossip(member(1), member(2))
    removed = old.removed(node(2), now=1.0).incremented(node(1))
    assert removed.merge(old).member(node(2)) is None
    assert old.merge(removed).member(node(2)) is None


# ---- merge is a semilattice join -------------------------------------------------------------

LIFE = [S.JOINING, S.WEAKLY_UP, S.UP, S.LEAVING, S.EXITING, S.DOWN]


@st.composite
def histories(
    draw: st.DrawFn,
) -> tuple[list[list[MemberStatus]], list[list[tuple[int, int, bool]]]]:
    """One cluster history: each member's statuses, each observer's reachability changes."""
    members = []
    for _ in range(6):
        path = [S.JOINING]
        for _ in range(draw(st.integers(0, 3))):
            nexts = [s for s in LIFE if s in ALLOWED_TRANSITIONS[path[-1]] and s is not S.REMOVED]
            if not nexts:
                break
            path.append(draw(st.sampled_from(nexts)))
        members.append(path)
    changes = [
        draw(st.lists(st.tuples(st.integers(1, 6), st.just(observer), st.booleans()), max_size=3))
        for observer in range(1, 7)
    ]
    return members, [[c for c in cs if c[0] != c[1]] for cs in changes]


@st.composite
def views(
    draw: st.DrawFn, history: tuple[list[list[MemberStatus]], list[list[tuple[int, int, bool]]]]
) -> Gossip:
    """What one node may know of ``history``: a prefix of every member's and observer's changes."""
    paths, changes = history
    g = Gossip()
    for i, path in enumerate(paths, start=1):
        known = draw(st.integers(0, len(path)))
        if known:
            status = path[known - 1]
            up = NOT_UP if S.UP not in path[:known] else i
            g = g.with_member(Member(node(i), status, up, frozenset({"ab"[i % 2]})))
    reach = Reachability()
    for observer_changes in changes:
        for subject, observer, unreachable in observer_changes[
            : draw(st.integers(0, len(observer_changes)))
        ]:
            change = reach.unreachable if unreachable else reach.reachable
            reach = change(node(observer), node(subject))
    for n in draw(st.lists(st.sampled_from(range(1, 7)), max_size=2, unique=True)):
        g = g.removed(node(n), now=float(n))  # the removal time is part of the shared history
    counters = {n: draw(st.integers(0, 3)) for n in range(1, 7)}
    g = attrs.evolve(
        g,
        version=VectorClock(
            tuple((f"{node(n).address}-{node(n).uid:x}", c) for n, c in counters.items() if c)
        ),
    )
    for gone, _ in g.tombstones:
        g = attrs.evolve(g, version=g.version.prune(gone))
    return attrs.evolve(g, reachability=reach.merge(g.nodes(), Reachability()))


def same_history(count: int) -> st.SearchStrategy[list[Gossip]]:
    return histories().flatmap(lambda h: st.lists(views(h), min_size=count, max_size=count))


def unseen(g: Gossip) -> Gossip:
    return attrs.evolve(g, seen=frozenset())


@settings(max_examples=examples(300))
@given(same_history(2))
def test_merge_is_commutative(pair: list[Gossip]) -> None:
    a, b = pair
    assert a.merge(b) == b.merge(a)


@settings(max_examples=examples(300))
@given(same_history(3))
def test_merge_is_associative(triple: list[Gossip]) -> None:
    a, b, c = triple
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@settings(max_examples=examples(300))
@given(same_history(1))
def test_merge_is_idempotent(one: list[Gossip]) -> None:
    (a,) = one
    assert a.merge(a) == unseen(a)


@given(same_history(2))
def test_merged_version_dominates_both(pair: list[Gossip]) -> None:
    a, b = pair
    merged = a.merge(b)
    tombstoned = [n for n, _ in merged.tombstones]
    for side in (a, b):
        pruned = side.version
        for n in tombstoned:
            pruned = pruned.prune(n)
        assert merged.version.compare(pruned) in (Order.SAME, Order.AFTER)
