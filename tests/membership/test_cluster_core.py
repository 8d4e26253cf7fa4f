"""The membership protocol with several ClusterCores wired together, without trio or sockets.

A tiny discrete-event loop delivers Send effects after a fixed delay (and can cut links), calls
tick when a core's deadline comes, and records every published event.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable

import attrs
import pytest

from membership import Address, UniqueAddress
from membership._cluster_core import (
    ClusterCore,
    ClusterSettings,
    Effect,
    Join,
    Phase,
    Publish,
    Send,
    Shutdown,
    StartExiting,
)
from membership._events import MemberRemoved, MemberUp
from membership._gossip import convergence, leader, oldest
from membership._member import MemberStatus

S = MemberStatus
DELAY = 0.01


def address(i: int) -> Address:
    return Address("10.0.0.1", 2550 + i)


@attrs.define
class World:
    seed: int
    now: float = 0.0
    cores: dict[Address, ClusterCore] = attrs.field(factory=dict)
    queue: list[tuple[float, int, Address, UniqueAddress, object]] = attrs.field(factory=list)
    cut: set[tuple[Address, Address]] = attrs.field(factory=set)
    events: dict[Address, list[object]] = attrs.field(factory=dict)
    exiting: list[Address] = attrs.field(factory=list)
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


def test_join_from_a_tombstoned_incarnation_is_ignored() -> None:
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
    assert first.receive(gone, Join(node=gone), w.now) == []


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
