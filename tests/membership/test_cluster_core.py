"""The membership protocol with several ClusterCores wired together, without trio or sockets.

A tiny discrete-event loop delivers Send effects after a fixed delay (and can cut links), calls
tick when a core's deadline comes, and records every published event.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Iterable

import attrs
import msgpack
import pytest

from membership import Address, ConfigurationError, UniqueAddress
from membership._cluster_core import (
    ClusterCore,
    Effect,
    Phase,
    Publish,
    Send,
    Shutdown,
    StartExiting,
)
from membership._cluster_messages import InitJoin, InitJoinAck, InitJoinNack, Join, Welcome
from membership._cluster_settings import ClusterSettings
from membership._events import MemberDowned, MemberRemoved, MemberUp
from membership._gossip import convergence, leader, oldest
from membership._islands import Verdict, loses_to
from membership._member import MemberStatus

S = MemberStatus
DELAY = 0.01


def address(i: int) -> Address:
    return Address("10.0.0.1", 2550 + i)


SEEDS12 = (Address("10.0.0.1", 2551), Address("10.0.0.1", 2552))


def phase(core: ClusterCore) -> Phase:
    """The core's phase now (a call, so that a type checker does not narrow it across steps)."""
    return core.phase


@attrs.define
class World:
    seed: int
    now: float = 0.0
    cores: dict[Address, ClusterCore] = attrs.field(factory=dict)
    queue: list[tuple[float, int, Address, UniqueAddress, object]] = attrs.field(factory=list)
    cut: set[tuple[Address, Address]] = attrs.field(factory=set)
    events: dict[Address, list[object]] = attrs.field(factory=dict)
    exiting: list[Address] = attrs.field(factory=list)
    sent: list[tuple[float, Address, Address, object]] = attrs.field(factory=list)
    _seq: int = 0

    def add(
        self, i: int, *, seeds: Iterable[int] = (1,), uid: int = 1, **settings: object
    ) -> ClusterCore:
        node = UniqueAddress(address(i), f"n{i}", uid)
        config = ClusterSettings(**settings)  # type: ignore[arg-type]
        seed_nodes = tuple(address(s) for s in seeds)
        core = ClusterCore(node, config, random.Random(self.seed * 1000 + i), seed_nodes)
        self.cores[address(i)] = core
        self.events[address(i)] = []
        self.apply(core, core.start(self.now))
        return core

    def apply(self, core: ClusterCore, effects: list[Effect]) -> None:
        src = core.self_node.address
        for effect in effects:
            match effect:
                case Send(to=to, message=msg):
                    dst = to.address if isinstance(to, UniqueAddress) else to
                    self.sent.append((self.now, src, dst, msg))
                    if (src, dst) in self.cut:
                        continue
                    self._seq += 1
                    heapq.heappush(
                        self.queue, (self.now + DELAY, self._seq, dst, core.self_node, msg)
                    )
                case Publish(event=event):
                    self.events[src].append(event)
                case StartExiting():
                    self.exiting.append(src)
                    self.apply(core, core.exiting_completed(self.now))
                case Shutdown():
                    pass

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            next_tick = min((c.next_deadline() for c in self.cores.values()), default=float("inf"))
            next_msg = self.queue[0][0] if self.queue else float("inf")
            t = min(next_tick, next_msg)
            if t > end:
                self.now = end
                return
            self.now = max(self.now, t)
            if next_msg <= next_tick:
                _, _, dst, sender, msg = heapq.heappop(self.queue)
                core = self.cores.get(dst)
                if core is not None and core.phase is not Phase.SHUT_DOWN:
                    self.apply(core, core.receive(sender, msg, self.now))
            else:
                for core in list(self.cores.values()):
                    if core.next_deadline() <= self.now and core.phase is not Phase.SHUT_DOWN:
                        self.apply(core, core.tick(self.now))

    def statuses(self, i: int) -> dict[str, MemberStatus]:
        return {m.node.name: m.status for m in self.cores[address(i)].gossip.members}

    def partition(self, a: Iterable[int], b: Iterable[int]) -> None:
        for i in a:
            for j in b:
                self.cut |= {(address(i), address(j)), (address(j), address(i))}

    def probes(self, src: int, since: float) -> list[Address]:
        """Where node ``src`` sent InitJoin as a member (probes), since ``since``."""
        return [
            dst
            for t, s, dst, msg in self.sent
            if t >= since and s == address(src) and isinstance(msg, InitJoin)
        ]


def test_first_seed_forms_the_cluster_and_others_join_and_become_up() -> None:
    w = World(seed=1)
    for i in range(1, 6):
        w.add(i, seeds=(1, 2))
    w.run(30)
    for i in range(1, 6):
        assert w.statuses(i) == {f"n{j}": S.UP for j in range(1, 6)}, w.statuses(i)
        core = w.cores[address(i)]
        assert convergence(core.gossip, core.self_node)
        assert leader(core.gossip, core.self_node) == w.cores[address(1)].self_node
    up_numbers = sorted(m.up_number for m in w.cores[address(3)].gossip.members)
    assert up_numbers == [1, 2, 3, 4, 5]  # distinct: "oldest" is well defined
    oldest_member = oldest(w.cores[address(4)].gossip)
    assert oldest_member is not None
    assert oldest_member.node.name == "n1"
    assert any(isinstance(e, MemberUp) for e in w.events[address(5)])


def test_a_node_that_is_its_own_only_seed_forms_its_cluster_after_a_short_listen() -> None:
    w = World(seed=2)
    core = w.add(1, seeds=(1,))
    assert core.phase is Phase.SEEDING
    assert core.next_deadline() <= 2.0  # own_seed_listen, not seed_node_timeout (5 s)
    w.run(2.5)
    assert w.statuses(1) == {"n1": S.UP}
    assert not w.sent  # it asked nobody
    at_once = World(seed=2).add(1, seeds=(1,), own_seed_listen=0.0)
    assert at_once.phase is Phase.MEMBER


def test_a_restarted_own_only_seed_joins_the_cluster_that_probes_it_instead_of_forming() -> None:
    core = ClusterCore(
        UniqueAddress(address(1), "n1", 9), ClusterSettings(), random.Random(1), (address(1),)
    )
    core.start(0.0)
    member = UniqueAddress(address(3), "n3", 7)
    effects = core.receive(member, InitJoin(sender=member, oldest=member, size=4), 0.5)
    assert Send(address(3), InitJoin(sender=core.self_node)) in effects
    core.tick(3.0)  # past own_seed_listen: it waits for the member that probed it
    assert phase(core) is Phase.SEEDING
    core.receive(member, InitJoinAck(sender=member, oldest=member, size=4), 3.1)
    assert phase(core) is Phase.JOINING


def test_non_first_seed_never_forms_its_own_cluster() -> None:
    w = World(seed=2)
    w.add(2, seeds=(1, 2))
    w.run(60)
    assert w.cores[address(2)].phase is Phase.SEEDING
    w.add(1, seeds=(1, 2))
    w.run(30)
    assert w.statuses(2) == {"n1": S.UP, "n2": S.UP}


def test_graceful_leave_goes_leaving_exiting_removed_and_the_node_shuts_down() -> None:
    w = World(seed=3)
    for i in range(1, 4):
        w.add(i)
    w.run(20)
    leaving = w.cores[address(2)]
    w.apply(leaving, leaving.leave(address(2), w.now))
    w.run(20)
    assert address(2) in w.exiting
    assert leaving.phase is Phase.SHUT_DOWN
    for i in (1, 3):
        assert w.statuses(i) == {"n1": S.UP, "n3": S.UP}
        removed = [e for e in w.events[address(i)] if isinstance(e, MemberRemoved)]
        assert [(e.member.node.name, e.previous_status) for e in removed] == [("n2", S.EXITING)]


def test_down_removes_an_unreachable_member_and_tombstone_keeps_it_out() -> None:
    w = World(seed=4)
    for i in range(1, 4):
        w.add(i)
    w.run(20)
    victim = w.cores.pop(address(3))
    for i in (1, 2):
        core = w.cores[address(i)]
        w.apply(core, core.update_reachability({victim.self_node}, w.now))
    w.run(5)
    assert w.statuses(1)["n3"] is S.UP  # unreachable is not down: never auto-down
    w.apply(w.cores[address(1)], w.cores[address(1)].down(address(3), w.now))
    w.run(10)
    for i in (1, 2):
        assert "n3" not in w.statuses(i)
        assert w.cores[address(i)].gossip.is_tombstoned(victim.self_node)
    # The same incarnation comes back (a partition heals): it is told it was removed.
    w.cores[address(3)] = victim
    w.apply(victim, victim.tick(w.now))
    w.run(10)
    assert victim.phase is Phase.SHUT_DOWN
    assert "n3" not in w.statuses(1)


def test_restarted_incarnation_joins_only_after_the_old_one_is_removed() -> None:
    w = World(seed=5)
    for i in range(1, 4):
        w.add(i)
    w.run(20)
    old = w.cores[address(3)].self_node
    w.add(3, uid=2, retry_unsuccessful_join_after=2.0)  # same host:port, new process
    w.run(30)
    seen = [(type(e).__name__, e.member.node) for e in w.events[address(1)] if hasattr(e, "member")]
    new = UniqueAddress(address(3), "n3", 2)
    assert seen.index(("MemberDowned", old)) < seen.index(("MemberRemoved", old))
    assert seen.index(("MemberRemoved", old)) < seen.index(("MemberJoined", new))
    for i in (1, 2, 3):
        members = {m.node for m in w.cores[address(i)].gossip.members}
        assert old not in members
        assert UniqueAddress(address(3), "n3", 2) in members
        assert w.statuses(i)["n3"] is S.UP


def test_restarted_incarnation_gets_in_as_soon_as_the_old_one_is_removed() -> None:
    # Akka lets the new incarnation in on its next Join, retry_unsuccessful_join_after (10 s)
    # later; the member that took the first Join remembers it and answers once it can.
    w = World(seed=5)
    for i in range(1, 4):
        w.add(i)
    w.run(20)
    started = w.now
    w.add(3, uid=2)
    w.run(8)  # less than the joiner's retry
    joins = [m for t, s, _, m in w.sent if t >= started and s == address(3) and isinstance(m, Join)]
    assert len(joins) == 1
    for i in (1, 2, 3):
        assert w.statuses(i) == {"n1": S.UP, "n2": S.UP, "n3": S.UP}
        assert w.cores[address(i)].gossip.member(UniqueAddress(address(3), "n3", 2)) is not None


def test_a_remembered_join_is_dropped_once_its_joiner_stopped_waiting() -> None:
    # The joiner waits retry_unsuccessful_join_after for Welcome, then asks again (perhaps as
    # yet another incarnation): a Join older than that must not let in a node that is gone.
    w = World(seed=6)
    for i in range(1, 4):
        w.add(i)
    w.run(20)
    w.partition([1], [2])  # n2 misses the gossip: no convergence, the old n3 stays
    w.add(3, uid=2)
    w.run(1)
    assert w.cores[address(1)]._deferred_joins  # its Join came and waits
    del w.cores[address(3)]  # the new incarnation dies before it gets in
    w.run(12)
    w.cut.clear()
    w.run(10)
    assert "n3" not in w.statuses(1)  # the old one removed, the stale Join not taken
    assert not w.cores[address(1)]._deferred_joins


def test_leader_does_not_move_members_up_without_convergence() -> None:
    w = World(seed=6)
    w.add(1, weakly_up_after=None)
    w.add(2, weakly_up_after=None)
    w.run(20)
    w.cores[address(2)].update_reachability({w.cores[address(1)].self_node}, w.now)
    first = w.cores[address(1)]
    w.apply(first, first.update_reachability({w.cores[address(2)].self_node}, w.now))
    w.add(3, weakly_up_after=None)
    w.run(30)
    assert w.statuses(1).get("n3") is S.JOINING


def test_weakly_up_after_non_convergence() -> None:
    w = World(seed=7)
    w.add(1, weakly_up_after=3.0)
    w.add(2, weakly_up_after=3.0)
    w.run(20)
    first = w.cores[address(1)]
    w.apply(first, first.update_reachability({w.cores[address(2)].self_node}, w.now))
    w.add(3, weakly_up_after=3.0)
    w.run(15)
    assert w.statuses(1)["n3"] is S.WEAKLY_UP


def test_min_nr_of_members_holds_everyone_in_joining() -> None:
    w = World(seed=8)
    w.add(1, min_nr_of_members=3)
    w.add(2, min_nr_of_members=3)
    w.run(20)
    assert set(w.statuses(1).values()) == {S.JOINING}
    w.add(3, min_nr_of_members=3)
    w.run(20)
    assert set(w.statuses(1).values()) == {S.UP}


def test_join_from_a_tombstoned_incarnation_is_answered_with_the_tombstone() -> None:
    w = World(seed=9)
    for i in range(1, 3):
        w.add(i)
    w.run(20)
    first = w.cores[address(1)]
    gone = w.cores[address(2)].self_node
    w.apply(first, first.down(address(2), w.now))
    del w.cores[address(2)]  # the downed node stops; the failure detector notices
    w.apply(first, first.update_reachability({gone}, w.now))
    w.run(10)
    assert first.gossip.is_tombstoned(gone)
    (answer,) = first.receive(gone, Join(node=gone), w.now)
    assert isinstance(answer, Send)
    assert isinstance(answer.message, Welcome)
    assert answer.message.gossip.is_tombstoned(gone)  # it is not let in, and learns why
    assert not answer.message.gossip.has_member(gone)


def test_a_joiner_removed_before_its_welcome_arrived_shuts_down_at_its_next_try() -> None:
    # Chaos seed 711 (fast-lan, rollout): the leader moved the joiner Up, its Welcome was lost,
    # the others found it unreachable and removed it; its join retries were ignored, so the
    # node neither joined nor exited for its supervisor to start a new incarnation.
    w = World(seed=10)
    for i in range(1, 3):
        w.add(i)
    w.run(20)
    first = w.cores[address(1)]
    joiner = w.add(3)
    for _ in range(1000):
        if first.gossip.has_member(joiner.self_node):
            break
        w.run(0.01)
    w.queue = [q for q in w.queue if not isinstance(q[4], Welcome)]  # the Welcome is lost
    heapq.heapify(w.queue)
    w.cut |= {(address(1), address(3)), (address(2), address(3))}  # and all that follows
    w.run(5)
    assert first.gossip.has_member(joiner.self_node)
    assert joiner.phase is Phase.JOINING
    w.apply(first, first.down(address(3), w.now))
    w.apply(first, first.update_reachability({joiner.self_node}, w.now))
    w.run(10)
    assert first.gossip.is_tombstoned(joiner.self_node)
    w.cut.clear()
    w.run(30)  # its next join try
    phase: Phase = joiner.phase  # (mypy narrowed it to JOINING above)
    assert phase is Phase.SHUT_DOWN


@pytest.mark.parametrize("seed", range(5))
def test_same_seed_same_history(seed: int) -> None:
    def history(s: int) -> list[tuple[str, str]]:
        w = World(seed=s)
        for i in range(1, 6):
            w.add(i, seeds=(1, 2))
        w.run(30)
        return [(k.host + str(k.port), type(e).__name__) for k, es in w.events.items() for e in es]

    assert history(seed) == history(seed)


def test_a_join_downs_every_old_incarnation_of_its_address() -> None:
    # A process restarted twice in quick succession can leave two old incarnations in the
    # gossip, one already Down. The third one's Join must get the Up one downed too, or it
    # waits forever behind it.
    w = World(seed=9)
    for i in range(1, 4):
        w.add(i, uid=5)
    w.run(20)
    first = w.cores[address(1)]
    older = UniqueAddress(address(3), "n3", 2)  # already downed, not yet removed (sorts first)
    old = w.cores[address(3)].self_node  # still Up in the gossip
    member = first.gossip.member(old)
    assert member is not None
    first.gossip = first.gossip.with_member(attrs.evolve(member, node=older, status=S.DOWN))
    newest = UniqueAddress(address(3), "n3", 8)
    w.apply(first, first.receive(newest, Join(node=newest), w.now))
    assert first.gossip.member(old) is not None
    assert first.gossip.member(old).status is S.DOWN  # type: ignore[union-attr]


# ---- islands: a second cluster of the same name is found and merged ----------------------------

PROBE = 1.0
"""seed_probe_interval of these tests."""


def test_seed_probe_interval_is_validated() -> None:
    assert ClusterSettings().seed_probe_interval == 5.0
    assert ClusterSettings(seed_probe_interval=0.5).seed_probe_interval == 0.5
    for bad in (0, -1.0, 3601, "5", True, None):
        with pytest.raises(ConfigurationError, match="seed_probe_interval"):
            ClusterSettings(seed_probe_interval=bad)  # type: ignore[arg-type]


def test_a_healthy_cluster_sends_no_probes() -> None:
    w = World(seed=31)
    for i in range(1, 5):
        w.add(i, seeds=(1, 2, 3), seed_probe_interval=PROBE)
    w.run(20)
    assert all(set(w.statuses(i).values()) == {S.UP} for i in range(1, 5))
    since = w.now
    w.run(20)
    assert [w.probes(i, since) for i in range(1, 5)] == [[], [], [], []]


def test_members_probe_only_seed_addresses_without_a_live_member() -> None:
    w = World(seed=32)
    for i in range(1, 4):
        w.add(
            i, seeds=(1, 2, 9), seed_probe_interval=PROBE
        )  # n3 is no seed; nothing ever runs at 9
    w.run(20)
    assert all(set(w.statuses(i).values()) == {S.UP} for i in range(1, 4))
    since = w.now
    w.run(10)
    assert set(w.probes(1, since)) == set(w.probes(2, since)) == {address(9)}
    assert 9 <= len(w.probes(1, since)) <= 11  # once per seed_probe_interval
    # n3 is no seed node and probes too: an island may hold no seed node at all
    assert set(w.probes(3, since)) == {address(9)}

    # n2 unreachable: its address gets probed as well; n2 itself never probes its own address.
    first, second = w.cores[address(1)], w.cores[address(2)]
    w.apply(first, first.update_reachability({second.self_node}, w.now))
    w.run(1)
    since = w.now
    w.run(5)
    assert set(w.probes(1, since)) == {address(2), address(9)}
    assert set(w.probes(2, since)) == {address(9)}

    # Reachable again but Down: still probed (the member there is on its way out).
    w.apply(first, first.update_reachability(set(), w.now))
    w.apply(first, first.down(address(2), w.now))
    w.run(1)
    since = w.now
    w.run(5)
    assert address(2) in w.probes(1, since)


def test_the_rule_bigger_cluster_wins_then_lower_oldest_address() -> None:
    def node(port: int, name: str = "n", uid: int = 1, host: str = "10.0.0.1") -> UniqueAddress:
        return UniqueAddress(Address(host, port), name, uid)

    a, b = node(2551), node(2552)
    assert loses_to(1, a, 3, b)  # bigger wins, whatever the address
    assert not loses_to(3, b, 1, a)
    assert loses_to(2, b, 2, a)  # tie: lower port wins
    assert not loses_to(2, a, 2, b)
    assert loses_to(2, node(1, host="10.0.0.2"), 2, node(9, host="10.0.0.10"))  # host as text
    assert loses_to(2, node(1, name="z"), 2, node(1, name="a"))  # same host:port: name
    assert loses_to(2, node(1, uid=9), 2, node(1, uid=3))  # two incarnations of one node
    assert not loses_to(2, a, 2, a)  # the same cluster never loses to itself
    pairs = [(s, n) for s in (1, 2) for n in (a, b, node(2551, uid=2))]
    for mine in pairs:
        for theirs in pairs:
            if mine != theirs:  # exactly one of two different clusters gives way
                assert loses_to(*mine, *theirs) != loses_to(*theirs, *mine)


def form_two_clusters(w: World, first: Iterable[int], second: Iterable[int]) -> None:
    """n1 forms a cluster with ``first``; n2, cut off from it, forms one with ``second``."""
    first, second = list(first), list(second)
    w.partition([1, *first], [2, *second])
    w.add(1, seeds=(1, 2), seed_probe_interval=PROBE)  # the first seed: forms one alone
    n2 = w.add(2, seeds=(1, 2), seed_probe_interval=PROBE)
    w.apply(n2, n2.join(address(2), w.now))  # as if it had been the first seed of the other one
    for i in first:
        w.add(i, seeds=(1,), seed_probe_interval=PROBE)
    for i in second:
        w.add(i, seeds=(2,), seed_probe_interval=PROBE)
    w.run(30)
    assert w.statuses(1) == {f"n{i}": S.UP for i in (1, *first)}
    assert w.statuses(2) == {f"n{i}": S.UP for i in (2, *second)}


def downed(w: World, i: int) -> list[str]:
    return [e.member.node.name for e in w.events[address(i)] if isinstance(e, MemberDowned)]


def test_smaller_cluster_downs_itself_and_its_nodes_rejoin_the_bigger_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = World(seed=33)
    form_two_clusters(w, [3], [4, 5])  # {n1, n3} and {n2, n4, n5}
    caplog.set_level(logging.INFO, "membership.cluster")
    w.cut.clear()  # the partition heals
    w.run(10)
    for i in (1, 3):  # the smaller one loses, although its oldest (n1) sorts first
        assert w.cores[address(i)].phase is Phase.SHUT_DOWN
        assert w.statuses(i) == {"n1": S.DOWN, "n3": S.DOWN}
    for i in (2, 4, 5):
        assert w.cores[address(i)].phase is Phase.MEMBER
        assert w.statuses(i) == {"n2": S.UP, "n4": S.UP, "n5": S.UP}
        assert downed(w, i) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    loser = [m for m in warnings if "loses" in m]
    assert len(loser) == 1
    assert "oldest n2@10.0.0.1:2552#1, 3 members" in loser[0]
    assert "oldest n1@10.0.0.1:2551#1, 2 members" in loser[0]
    assert any("wins" in m and m.startswith("n2@") for m in warnings)

    # A supervisor restarts the downed nodes: they join the cluster that won.
    w.add(1, seeds=(1, 2), uid=2, seed_probe_interval=PROBE)
    w.add(3, seeds=(1,), uid=2, seed_probe_interval=PROBE)
    w.run(30)
    for i in range(1, 6):
        assert w.statuses(i) == {f"n{j}": S.UP for j in range(1, 6)}, (i, w.statuses(i))


def test_an_island_without_a_seed_node_finds_the_cluster_that_holds_them() -> None:
    w = World(seed=35)
    form_two_clusters(w, [3], [4, 5])  # {n1, n3} and {n2, n4, n5}
    w.cut.clear()
    w.run(10)  # {n1, n3} gave way, as above; n1 restarts into the big cluster, n3 does not
    w.add(1, seeds=(1, 2), uid=2, seed_probe_interval=PROBE)
    w.run(30)
    assert w.statuses(2) == {f"n{j}": S.UP for j in (1, 2, 4, 5)}
    # Now an island {n4, n5} without any seed node: n4 and n5 are cut off, downed by the rest,
    # and meanwhile form a cluster of their own (n4 as if it had been a first seed).
    w.partition([4, 5], [1, 2])
    w.run(40)
    n4 = w.add(4, seeds=(1, 2), uid=2, seed_probe_interval=PROBE)
    w.apply(n4, n4.join(address(4), w.now))
    w.add(5, seeds=(4,), uid=2, seed_probe_interval=PROBE)
    w.run(20)
    assert w.statuses(4) == {"n4": S.UP, "n5": S.UP}
    w.cut.clear()
    w.run(15)  # n4 and n5 probe the seed addresses, find the bigger cluster and give way
    for i in (4, 5):
        assert w.cores[address(i)].phase is Phase.SHUT_DOWN, i


def test_when_every_seed_node_was_on_the_losing_side_the_clusters_still_merge() -> None:
    """Seeds n1 and n2 restarted while cut off and formed a cluster of their own; n3 to n5 go
    on without any seed node. The cluster of the seeds probes nobody (its seeds are its own),
    yet it hears the others' probes, gives way, and its restarted nodes, looking for a cluster,
    are found by the winner's probes and join it instead of forming one again."""
    w = World(seed=36)
    w.partition([1, 2], [3, 4, 5])
    w.add(1, seeds=(1, 2), seed_probe_interval=PROBE)
    w.add(2, seeds=(1, 2), seed_probe_interval=PROBE)
    for i in (3, 4, 5):
        core = w.add(i, seeds=(1, 2), seed_probe_interval=PROBE)
        w.apply(core, core.join(address(3), w.now))  # the cluster they were in all along
    w.run(30)
    assert w.statuses(1) == {"n1": S.UP, "n2": S.UP}
    assert w.statuses(3) == {"n3": S.UP, "n4": S.UP, "n5": S.UP}
    assert [w.probes(i, w.now - 5) for i in (1, 2)] == [[], []]  # every seed is theirs

    w.cut.clear()
    w.run(15)
    for i in (1, 2):
        assert w.cores[address(i)].phase is Phase.SHUT_DOWN, i
    # A supervisor restarts them, with the same two seed nodes: they join the winner.
    for i in (1, 2):
        w.add(i, seeds=(1, 2), uid=2, seed_probe_interval=PROBE)
    w.run(30)
    for i in range(1, 6):
        assert w.statuses(i) == {f"n{j}": S.UP for j in range(1, 6)}, (i, w.statuses(i))
    oldest_member = oldest(w.cores[address(1)].gossip)
    assert oldest_member is not None
    assert oldest_member.node.name == "n3"  # the winner's oldest: nobody formed a new cluster


def test_a_first_seed_looking_for_its_cluster_waits_for_a_link_that_just_came_up() -> None:
    core = ClusterCore(
        UniqueAddress(address(1), "n1", 1), ClusterSettings(), random.Random(1), SEEDS12
    )
    core.start(0.0)
    assert core.next_deadline() == 0.0 + 1.0  # the next InitJoin round
    core.tick(4.5)
    core.peer_linked(address(2), 4.5)  # the link to n2 came up: our questions are on their way
    core.tick(5.0)
    assert phase(core) is Phase.SEEDING  # seed_node_timeout passed, but it waits a little
    effects = core.tick(6.5)
    # Nobody answered: one last round, asked past the deadline, and a round's time for it.
    assert effects == [Send(address(2), InitJoin(sender=core.self_node))]
    assert phase(core) is Phase.SEEDING
    core.tick(7.5)
    assert phase(core) is Phase.MEMBER  # nobody answered after all: it forms the cluster
    late = ClusterCore(
        UniqueAddress(address(1), "n1", 2), ClusterSettings(), random.Random(1), SEEDS12
    )
    late.start(0.0)
    for t in range(1, 25):  # a link that keeps flapping extends the wait only so far
        late.peer_linked(address(2), float(t) / 2)
        late.tick(float(t) / 2)
    assert late.phase is Phase.MEMBER


def test_a_first_seed_asks_once_more_past_its_deadline_unless_every_seed_said_no() -> None:
    quiet = ClusterCore(
        UniqueAddress(address(1), "n1", 1), ClusterSettings(), random.Random(1), SEEDS12
    )
    quiet.start(0.0)
    for t in range(1, 5):
        quiet.tick(float(t))
    effects = quiet.tick(5.0)  # the deadline: n2 never answered (a partition, or it is gone)
    assert effects == [Send(address(2), InitJoin(sender=quiet.self_node))]
    assert phase(quiet) is Phase.SEEDING
    quiet.tick(6.0)
    assert phase(quiet) is Phase.MEMBER
    # n2 answers that it is no member (it is up, and seeding too): no need to wait longer.
    cold = ClusterCore(
        UniqueAddress(address(1), "n1", 2), ClusterSettings(), random.Random(1), SEEDS12
    )
    cold.start(0.0)
    n2 = UniqueAddress(address(2), "n2", 3)
    for t in range(1, 5):
        cold.tick(float(t))
        cold.receive(n2, InitJoinNack(sender=n2), float(t) + 0.01)
    cold.tick(5.0)
    assert phase(cold) is Phase.MEMBER


def test_a_seeding_node_probed_by_a_member_of_a_cluster_joins_through_it() -> None:
    core = ClusterCore(
        UniqueAddress(address(1), "n1", 1), ClusterSettings(), random.Random(1), SEEDS12
    )
    core.start(0.0)
    member = UniqueAddress(address(3), "n3", 7)
    effects = core.receive(member, InitJoin(sender=member, oldest=member, size=3), 4.0)
    assert Send(address(3), InitJoin(sender=core.self_node)) in effects
    core.tick(6.0)  # past seed_node_timeout: it does not form a cluster of its own
    assert phase(core) is Phase.SEEDING
    core.receive(member, InitJoinAck(sender=member, oldest=member, size=3), 6.1)
    assert phase(core) is Phase.JOINING
    effects = core.tick(7.0)
    assert not any(isinstance(e, Send) and isinstance(e.message, Join) for e in effects)


def test_equal_sizes_the_cluster_with_the_lower_oldest_address_wins() -> None:
    w = World(seed=34)
    form_two_clusters(w, [3], [4])  # {n1, n3} and {n2, n4}: n1 sorts before n2
    w.cut.clear()
    w.run(10)
    for i in (2, 4):
        assert w.cores[address(i)].phase is Phase.SHUT_DOWN
    for i in (1, 3):
        assert w.cores[address(i)].phase is Phase.MEMBER
        assert w.statuses(i) == {"n1": S.UP, "n3": S.UP}


# A lone cluster {n1} (seeds n1 and n2; nothing of ours at n2) and answers from a stranger at n2.
FOREIGN = UniqueAddress(address(2), "n2", 77)
FOREIGN_OLDEST = UniqueAddress(address(7), "n7", 5)


def lone_member() -> ClusterCore:
    core = ClusterCore(
        UniqueAddress(address(1), "n1", 1),
        ClusterSettings(seed_probe_interval=PROBE),
        random.Random(1),
        (address(1), address(2)),
    )
    core.join(address(1), 0.0)
    probe_round(core)
    assert core.self_member is not None
    assert core.self_member.status is S.UP
    return core


def probe_round(core: ClusterCore) -> float:
    """Tick ``core`` until it sends its next probe round; return the time."""
    start = core.next_deadline()
    now = start
    while now < start + 2 * core.settings.seed_probe_interval:
        effects = core.tick(now)
        if any(isinstance(e, Send) and isinstance(e.message, InitJoin) for e in effects):
            return now
        now = core.next_deadline()
    raise AssertionError(f"{core.self_node} sent no probe round")


def ack(size: int = 3, oldest: UniqueAddress | None = FOREIGN_OLDEST) -> InitJoinAck:
    return InitJoinAck(sender=FOREIGN, oldest=oldest, size=size)


def shuts_down(effects: list[Effect]) -> bool:
    return any(isinstance(e, Shutdown) for e in effects)


def foreign_member(i: int) -> UniqueAddress:
    return UniqueAddress(address(10 + i), f"f{i}", 50 + i)


def probe_from(i: int, size: int = 2, oldest: UniqueAddress = FOREIGN_OLDEST) -> InitJoin:
    return InitJoin(sender=foreign_member(i), oldest=oldest, size=size)


def test_a_foreign_cluster_is_acted_on_once_the_same_facts_held_a_probe_interval() -> None:
    core = lone_member()
    now = 100.0
    for i in (1, 2):  # two members of a cluster of two probe us: it is bigger than ours
        effects = core.receive(foreign_member(i), probe_from(i), now)
        assert not shuts_down(effects)
    # Our members are told to probe it too (we have none), and it gets our answer.
    assert [type(e.message).__name__ for e in effects if isinstance(e, Send)] == ["InitJoinAck"]
    assert not shuts_down(core.receive(foreign_member(1), probe_from(1), now + PROBE / 2))
    effects = core.receive(foreign_member(2), probe_from(2), now + PROBE)
    assert shuts_down(effects)
    assert core.phase is Phase.SHUT_DOWN
    assert core.self_member is not None
    assert core.self_member.status is S.DOWN


def test_a_change_in_the_facts_starts_the_wait_again() -> None:
    core = lone_member()
    now = 100.0
    for i in (1, 2):
        core.receive(foreign_member(i), probe_from(i), now)
    now += PROBE / 2
    assert not shuts_down(core.receive(foreign_member(3), probe_from(3, size=3), now))
    now += PROBE * 0.9  # a whole interval since the first sighting, not since the change
    assert not shuts_down(core.receive(foreign_member(1), probe_from(1, size=3), now))
    now += PROBE * 0.2
    assert shuts_down(core.receive(foreign_member(2), probe_from(2, size=3), now))


def test_one_certificate_cannot_pose_as_a_bigger_cluster() -> None:
    # A node that says its cluster has 50 members counts as one member until others of its
    # cluster speak for it too: here our own oldest sorts first, so a tie is ours.
    core = lone_member()
    later = UniqueAddress(address(99), "n99", 5)
    for k in range(20):
        effects = core.receive(foreign_member(1), probe_from(1, size=50, oldest=later), k * 1.0)
        assert not shuts_down(effects)
    assert core.phase is Phase.MEMBER
    [sighting] = core.sightings(19.0)
    assert (sighting.size, sighting.vouched) == (50, 1)
    assert sighting.verdict is Verdict.WINS


def test_the_winner_does_nothing() -> None:
    core = lone_member()
    for _ in range(5):  # tie on size 1; our oldest n1 sorts before n7
        now = probe_round(core)
        assert core.receive(FOREIGN, ack(size=1), now) == []
    assert core.phase is Phase.MEMBER


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(ack(oldest=None), id="their-nobody-is-up"),
        pytest.param(InitJoinAck(sender=FOREIGN), id="older-peer-without-the-fields"),
        pytest.param(ack(oldest=UniqueAddress(address(1), "n1", 1)), id="their-oldest-is-ours"),
    ],
)
def test_answers_that_do_not_name_a_foreign_cluster_never_down_anyone(
    answer: InitJoinAck,
) -> None:
    # "their oldest is ours": a new incarnation that another member of ours just welcomed,
    # before the gossip with it reached this node.
    core = lone_member()
    for _ in range(4):
        now = probe_round(core)
        assert core.receive(FOREIGN, answer, now) == []
    assert core.phase is Phase.MEMBER


def test_answers_from_members_and_from_addresses_not_probed_are_ignored() -> None:
    core = lone_member()
    stranger = UniqueAddress(address(5), "n5", 9)  # n5 is no seed: never probed
    me = core.self_node
    for _ in range(4):
        now = probe_round(core)
        # A late answer to the InitJoin this node sent while it was joining.
        assert core.receive(stranger, attrs.evolve(ack(), sender=stranger), now) == []
        assert core.receive(me, InitJoinAck(sender=me, oldest=FOREIGN_OLDEST, size=9), now) == []
    assert core.phase is Phase.MEMBER


def test_a_cluster_where_nobody_is_up_does_not_decide() -> None:
    core = ClusterCore(
        UniqueAddress(address(1), "n1", 1),
        ClusterSettings(min_nr_of_members=2, seed_probe_interval=PROBE),
        random.Random(1),
        (address(1), address(2)),
    )
    core.join(address(1), 0.0)
    for _ in range(4):
        now = probe_round(core)
        assert core.receive(FOREIGN, ack(size=9), now) == []
    assert core.phase is Phase.MEMBER


def test_acks_carry_the_oldest_and_size_and_seeding_nodes_still_nack() -> None:
    core = lone_member()
    asker = UniqueAddress(address(3), "n3", 4)
    (answer,) = core.receive(asker, InitJoin(sender=asker), 100.0)
    assert answer == Send(asker, InitJoinAck(sender=core.self_node, oldest=core.self_node, size=1))

    seeding = ClusterCore(
        UniqueAddress(address(2), "n2", 3), ClusterSettings(), random.Random(1), (address(1),)
    )
    seeding.start(0.0)
    assert seeding.phase is Phase.SEEDING
    (answer,) = seeding.receive(asker, InitJoin(sender=asker), 1.0)
    assert answer == Send(asker, InitJoinNack(sender=seeding.self_node))
    seeding.receive(core.self_node, InitJoinAck(sender=core.self_node), 1.0)
    assert seeding.phase.value == "joining"  # (mypy narrowed phase to SEEDING above)
    (answer,) = seeding.receive(asker, InitJoin(sender=asker), 1.0)
    assert answer == Send(asker, InitJoinNack(sender=seeding.self_node))


def test_an_init_join_ack_from_an_older_peer_gets_the_defaults() -> None:
    from membership.transport._wire import (
        HEADER,
        KIND_OBJECT,
        WIRE_VERSION,
        _default,
        decode,
        encode,
        wire_name,
    )

    sender = UniqueAddress(address(1), "n1", 1)
    new = InitJoinAck(sender=sender, oldest=sender, size=4)
    assert decode(encode(new)).message == new
    # [name, sender], the sender nested as an extension: what older peers send.
    old = msgpack.packb([wire_name(InitJoinAck), sender], default=_default, use_bin_type=True)
    header = HEADER.pack(WIRE_VERSION, KIND_OBJECT, 0)
    assert decode(header + old).message == InitJoinAck(sender=sender)
    with pytest.raises(TypeError, match="size"):
        InitJoinAck(sender=sender, size=-1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("restarted", [1, 3])
def test_a_restarted_node_joining_again_never_looks_like_another_cluster(
    seed: int, restarted: int
) -> None:
    # Every node a seed, probing often, while an incarnation is downed, removed and replaced:
    # answers from the newcomer reach members whose gossip does not have it yet.
    w = World(seed=40 + seed)
    fast = ClusterSettings(seed_probe_interval=0.05, retry_unsuccessful_join_after=2.0)
    for i in range(1, 5):
        w.add(i, seeds=(1, 2, 3, 4), **attrs.asdict(fast))
    w.run(20)
    old = w.cores[address(restarted)].self_node
    w.add(restarted, seeds=(1, 2, 3, 4), uid=2, **attrs.asdict(fast))
    w.run(40)
    probes = sum(len(w.probes(i, 20.0)) for i in range(1, 5))
    assert probes > 50  # the newcomer's address was probed all along
    for i in range(1, 5):
        assert w.cores[address(i)].phase is Phase.MEMBER
        assert w.statuses(i) == {f"n{j}": S.UP for j in range(1, 5)}
        assert w.cores[address(i)].gossip.member(attrs.evolve(old, uid=2)) is not None
        if i != restarted:
            assert downed(w, i) == [f"n{restarted}"]  # the old incarnation only


def test_every_member_learns_each_ones_app_version_from_its_join() -> None:
    # Issue 22: the app version a node was started with travels in its Join, lives in the
    # gossip's member record, and so reaches every member (the first seed's own record too).
    w = World(seed=5)
    versions = {1: "2.4.1", 2: "2.5.0", 3: ""}
    for i, version in versions.items():
        w.add(i).app_version = version  # before it forms or joins: start only sent InitJoin
    w.run(20)
    for i in versions:
        seen = {m.node.name: m.app_version for m in w.cores[address(i)].gossip.members}
        assert seen == {f"n{j}": v for j, v in versions.items()}


def test_join_seed_nodes_found_after_start_asks_them_and_never_forms() -> None:
    """Akka's joinSeedNodes: a bootstrap found members after the node started without seeds."""
    me = UniqueAddress(address(1), "n1", 9)
    core = ClusterCore(me, ClusterSettings(), random.Random(1))
    core.start(0.0)
    assert phase(core) is Phase.IDLE
    effects = core.join_seed_nodes([address(1), address(3), address(2)], 0.0)  # itself left out
    asked = [e.to for e in effects if isinstance(e, Send) and isinstance(e.message, InitJoin)]
    assert asked == [address(3), address(2)]
    assert core.seed_nodes == (address(3), address(2))
    core.tick(60.0)  # nobody answers: it keeps asking, never forms
    assert phase(core) is Phase.SEEDING
    member = UniqueAddress(address(2), "n2", 7)
    core.receive(member, InitJoinAck(sender=member, oldest=member, size=1), 60.5)
    assert phase(core) is Phase.JOINING
    assert core.join_seed_nodes([address(4)], 61.0) == []  # once joining, ignored
    assert core.seed_nodes == (address(3), address(2))
