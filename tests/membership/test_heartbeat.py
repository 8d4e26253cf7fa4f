"""Heartbeat receivers on the node ring and the heartbeat sender's state (sans-IO, synchronous)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from membership import Address, ConfigurationError, UniqueAddress
from membership._failure_detector import FailureDetectorRegistry, FailureDetectorSettings
from membership._heartbeat import (
    Heartbeat,
    HeartbeatNodeRing,
    HeartbeatRsp,
    HeartbeatSenderState,
    heartbeat_response,
    ring_position,
)
from membership.transport._wire import decode, encode


def node(i: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address(f"10.0.{i // 250}.{i % 250 + 1}", 25520), f"node-{i}", uid)


def cluster(n: int) -> list[UniqueAddress]:
    return [node(i) for i in range(n)]


def ring_of(
    nodes: list[UniqueAddress], unreachable: set[UniqueAddress] | None = None, n: int = 9
) -> HeartbeatNodeRing:
    return HeartbeatNodeRing(
        self_node=nodes[0],
        nodes=nodes,
        unreachable=unreachable or set(),
        monitored_by_nr_of_members=n,
    )


# -- messages -----------------------------------------------------------------------------------


def test_heartbeats_and_responses_travel_on_the_wire() -> None:
    hb = Heartbeat(sender=node(1), sequence_nr=7, creation_time=12.25)
    rsp = heartbeat_response(node(2), hb)
    assert rsp == HeartbeatRsp(sender=node(2), sequence_nr=7, creation_time=12.25)
    for msg in (hb, rsp):
        assert decode(encode(msg)).message == msg


@pytest.mark.parametrize(
    ("fields", "error", "text"),
    [
        ({"sender": "node-1"}, TypeError, "Heartbeat.sender must be a UniqueAddress, not str"),
        ({"sequence_nr": -1}, ValueError, "Heartbeat.sequence_nr = -1 is invalid"),
        ({"sequence_nr": True}, ValueError, "Heartbeat.sequence_nr = True is invalid"),
        ({"creation_time": float("nan")}, ValueError, "Heartbeat.creation_time = nan is invalid"),
        ({"creation_time": "now"}, ValueError, "Heartbeat.creation_time = 'now' is invalid"),
    ],
)
def test_a_heartbeat_with_a_bad_field_is_refused(
    fields: dict[str, object], error: type[Exception], text: str
) -> None:
    values: dict[str, object] = {"sender": node(1), "sequence_nr": 1, "creation_time": 0.0}
    with pytest.raises(error, match=text):
        Heartbeat(**{**values, **fields})  # type: ignore[arg-type]


# -- the ring -----------------------------------------------------------------------------------


def test_ring_positions_are_pinned() -> None:
    # The ring must be the same in every process and every release: a change here reshuffles
    # which node watches which in a cluster during a rolling upgrade.
    assert ring_position(node(0)) == 0xA15F379EBD0C4AEE
    order = [n.name for n in HeartbeatNodeRing(self_node=node(0), nodes=cluster(8)).ordered]
    assert order == [
        "node-3", "node-1", "node-5", "node-7", "node-6", "node-0", "node-2", "node-4",
    ]  # fmt: skip


RING_SCRIPT = """
import json
from membership import Address, UniqueAddress
from membership._heartbeat import HeartbeatNodeRing
nodes = [UniqueAddress(Address(f"10.0.0.{i + 1}", 25520), f"node-{i}", 1) for i in range(30)]
ring = HeartbeatNodeRing(
    self_node=nodes[0], nodes=nodes, unreachable=set(nodes[3:9]), monitored_by_nr_of_members=4
)
print(json.dumps([[str(r) for r in ring.receivers(n)] for n in nodes]))
"""


def test_the_ring_is_the_same_whatever_the_hash_seed() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", RING_SCRIPT],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "4242")
    ]
    outputs = [run.communicate(timeout=60)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    nodes = cluster(30)
    ring = ring_of(nodes, set(nodes[3:9]), n=4)
    here = [[str(r) for r in ring.receivers(n)] for n in nodes]
    assert [json.loads(output) for output in outputs] == [here, here]


def test_self_is_always_on_the_ring() -> None:
    ring = HeartbeatNodeRing(self_node=node(0), nodes={node(1), node(2)})
    assert node(0) in ring.nodes
    assert set(ring.my_receivers) == {node(1), node(2)}


def test_a_lone_node_has_no_receivers() -> None:
    ring = HeartbeatNodeRing(self_node=node(0), nodes={node(0)})
    assert ring.my_receivers == ()


def test_receivers_are_the_next_nodes_on_the_ring() -> None:
    nodes = cluster(10)
    ring = ring_of(nodes, n=3)
    order = ring.ordered
    for i, sender in enumerate(order):
        assert ring.receivers(sender) == tuple(order[(i + k) % 10] for k in (1, 2, 3))


def test_an_unreachable_receiver_is_kept_and_another_added() -> None:
    nodes = cluster(10)
    order = HeartbeatNodeRing(self_node=nodes[0], nodes=nodes).ordered
    sender = order[0]
    ring = HeartbeatNodeRing(
        self_node=sender, nodes=nodes, unreachable={order[2]}, monitored_by_nr_of_members=3
    )
    assert ring.my_receivers == (order[1], order[2], order[3], order[4])
    # unreachable nodes past the first N picks are skipped
    ring = ring.with_unreachable(order[5])
    assert ring.my_receivers == (order[1], order[2], order[3], order[4])
    ring = ring.with_unreachable(order[4])
    assert ring.my_receivers == (order[1], order[2], order[3], order[6])
    assert ring.with_reachable(order[2]).with_reachable(order[4]).my_receivers == order[1:4]


def test_ring_updates_return_new_rings() -> None:
    nodes = cluster(5)
    ring = ring_of(nodes[:4], n=2)
    assert ring.with_node(nodes[1]) is ring
    assert ring.without_node(nodes[4]) is ring
    bigger = ring.with_node(nodes[4])
    assert bigger.nodes == frozenset(nodes)
    assert ring.nodes == frozenset(nodes[:4])
    marked = bigger.with_unreachable(nodes[4])
    assert marked.without_node(nodes[4]) == ring


def test_a_ring_refuses_a_zero_monitoring_count() -> None:
    with pytest.raises(ConfigurationError, match="monitored_by_nr_of_members = 0 is invalid"):
        HeartbeatNodeRing(self_node=node(0), nodes=cluster(3), monitored_by_nr_of_members=0)


@given(size=st.integers(1, 60), monitored=st.integers(1, 12))
def test_when_all_are_reachable_each_node_is_watched_by_min_n_and_n_minus_1(
    size: int, monitored: int
) -> None:
    nodes = cluster(size)
    ring = ring_of(nodes, n=monitored)
    watchers: Counter[UniqueAddress] = Counter()
    for sender in nodes:
        receivers = ring.receivers(sender)
        assert sender not in receivers
        assert len(set(receivers)) == len(receivers) == min(monitored, size - 1)
        watchers.update(receivers)
    assert all(watchers[n] == min(monitored, size - 1) for n in nodes)


@given(data=st.data(), size=st.integers(1, 60), monitored=st.integers(1, 12))
def test_unreachable_receivers_are_kept_and_replaced(
    data: st.DataObject, size: int, monitored: int
) -> None:
    nodes = cluster(size)
    unreachable = data.draw(st.sets(st.sampled_from(nodes)), label="unreachable")
    healthy = ring_of(nodes, n=monitored)
    ring = ring_of(nodes, unreachable, n=monitored)
    for sender in nodes:
        receivers = ring.receivers(sender)
        others = [n for n in nodes if n != sender]
        reachable_others = [n for n in others if n not in unreachable]
        assert sender not in receivers
        assert len(set(receivers)) == len(receivers)
        # every node watched when all were reachable is still watched ...
        assert set(healthy.receivers(sender)) <= set(receivers)
        # ... and as many reachable ones as there can be
        reachable = [n for n in receivers if n not in unreachable]
        if monitored >= size - 1:
            assert set(receivers) == set(others)
        else:
            assert len(reachable) == min(monitored, len(reachable_others))
            assert len(receivers) <= 2 * monitored


# -- the sender's state -------------------------------------------------------------------------


SETTINGS = FailureDetectorSettings(monitored_by_nr_of_members=3)


def sender_state(size: int, settings: FailureDetectorSettings = SETTINGS) -> HeartbeatSenderState:
    nodes = cluster(size)
    state = HeartbeatSenderState(nodes[0], settings=settings)
    for n in nodes[1:]:
        state.add_member(n, now=0.0)
    return state


def run(
    state: HeartbeatSenderState, start: float, end: float, answering: set[UniqueAddress]
) -> None:
    """Heartbeat rounds each second in ``[start, end)``; ``answering`` nodes reply at once."""
    t = start
    while t < end:
        for to in state.tick(t).receivers:
            if to in answering:
                assert state.heartbeat_rsp(to, t + 0.01)
        t += 1.0


def test_a_tick_heartbeats_the_receivers() -> None:
    state = sender_state(6)
    first = state.tick(0.0)
    assert first.heartbeat == Heartbeat(sender=node(0), sequence_nr=1, creation_time=0.0)
    assert first.receivers == tuple(sorted(state.ring.my_receivers))
    assert len(first.receivers) == 3
    assert not first.starved
    assert state.tick(1.0).heartbeat.sequence_nr == 2
    assert state.tick(3.5).starved
    assert state.statistics().sequence_nr == 3


def test_members_are_added_and_removed() -> None:
    state = sender_state(3)
    assert state.contains(node(2))
    state.add_member(node(0), now=0.0)  # self: nothing changes
    assert state.ring.nodes == frozenset(cluster(3))
    run(state, 0.0, 5.0, answering=set(cluster(3)))
    assert state.registry.is_monitoring(node(2))
    state.remove_member(node(2), now=5.0)
    assert not state.contains(node(2))
    assert not state.registry.is_monitoring(node(2))
    assert state.receivers == (node(1),)
    state.remove_member(node(0), now=5.0)  # self: its sender is about to stop
    assert state.contains(node(0))


def test_init_replaces_the_ring_with_a_snapshot() -> None:
    nodes = cluster(12)
    state = HeartbeatSenderState(nodes[0], settings=SETTINGS)
    state.init(nodes[1:], {nodes[5]}, now=0.0)
    assert state.ring.nodes == frozenset(nodes)
    assert state.ring.unreachable == frozenset({nodes[5]})
    assert state.receivers == tuple(sorted(state.ring.my_receivers))


def test_a_response_from_a_stranger_is_ignored() -> None:
    state = sender_state(3)
    state.tick(0.0)
    assert not state.heartbeat_rsp(node(99), 0.1)
    assert not state.registry.is_monitoring(node(99))


def test_answering_receivers_stay_reachable() -> None:
    state = sender_state(8)
    run(state, 0.0, 60.0, answering=set(cluster(8)))
    assert state.unreachable(60.0) == frozenset()
    assert set(state.registry.monitored()) == set(state.receivers)


def test_a_receiver_that_stops_answering_is_reported_once_then_reported_back() -> None:
    state = sender_state(4)
    victim = state.receivers[0]
    everyone = set(cluster(4))
    run(state, 0.0, 20.0, answering=everyone)
    run(state, 20.0, 30.0, answering=everyone - {victim})
    # its last answer came at 19.01; detected about 4.5 s later, reaped within the interval
    assert state.unreachable(23.0) == frozenset()
    assert state.unreachable(24.0) == {victim}
    assert state.unreachable(25.0) == frozenset()  # already reported
    assert state.statistics().observed_unreachable == (victim,)
    assert state.reachable(29.0) == frozenset()
    run(state, 30.0, 32.0, answering=everyone)
    assert state.reachable(32.0) == {victim}
    assert state.reachable(33.0) == frozenset()
    assert state.unreachable(33.0) == frozenset()


def test_a_receiver_that_never_answers_is_detected() -> None:
    # Akka's ExpectedFirstHeartbeat: without it, a node never heard from counts as available.
    state = sender_state(2)
    (silent,) = state.receivers
    run(state, 0.0, 0.5, answering=set())
    assert state.statistics().awaiting_first_response == (silent,)
    assert not state.registry.is_monitoring(silent)
    assert state.unreachable(2.5) == frozenset()
    assert state.registry.is_monitoring(silent)
    assert state.statistics().awaiting_first_response == ()
    detector = state.registry.detector(silent)
    assert detector is not None
    # recorded at the deadline, expected_response_after after the first heartbeat, not at 2.5
    assert detector.statistics().last_heartbeat == SETTINGS.expected_response_after
    run(state, 3.0, 20.0, answering=set())
    assert state.unreachable(6.0) == frozenset()
    assert state.unreachable(7.0) == {silent}  # 1.0 + about 5.3 s (a single heartbeat)


def test_an_answer_before_the_deadline_cancels_the_expected_first_heartbeat() -> None:
    state = sender_state(2)
    (peer,) = state.receivers
    state.tick(0.0)
    assert state.heartbeat_rsp(peer, 0.5)
    state.tick(1.0)
    detector = state.registry.detector(peer)
    assert detector is not None
    assert detector.statistics().last_heartbeat == 0.5


def test_the_expected_first_heartbeat_comes_before_a_later_event() -> None:
    state = sender_state(2)
    (peer,) = state.receivers
    state.tick(0.0)
    # the answer is late: at 1.5 the timer (due at 1.0) has fired first, as in Akka
    assert state.heartbeat_rsp(peer, 1.5)
    detector = state.registry.detector(peer)
    assert detector is not None
    assert detector.statistics().samples == 3  # seeded two, plus the 0.5 s interval


def test_a_removed_receiver_gets_no_expected_first_heartbeat() -> None:
    state = sender_state(2)
    (peer,) = state.receivers
    state.tick(0.0)
    state.remove_member(peer, now=0.5)
    assert state.unreachable(10.0) == frozenset()
    assert not state.registry.is_monitoring(peer)


def just_after(
    before: UniqueAddress, after: UniqueAddress, taken: set[UniqueAddress]
) -> UniqueAddress:
    """A new node that sits on the ring between ``before`` and ``after``."""
    arc = (ring_position(after) - ring_position(before)) % 2**64
    return next(
        n
        for n in (node(i) for i in range(100, 10_000))
        if 0 < (ring_position(n) - ring_position(before)) % 2**64 < arc and n not in taken
    )


def test_an_unreachable_receiver_is_replaced_but_still_heartbeated() -> None:
    state = sender_state(10)
    everyone = set(cluster(10))
    run(state, 0.0, 10.0, answering=everyone)
    old = state.ring.my_receivers
    victim = old[2]
    run(state, 10.0, 20.0, answering=everyone - {victim})
    assert state.unreachable(20.0) == {victim}
    state.unreachable_member(victim, now=20.0)  # the cluster agrees
    assert victim in state.ring.my_receivers  # kept: among the first N on the ring
    assert len(state.receivers) == 4  # and one more reachable node
    # a node joins just before the receivers: the ring no longer picks the victim
    newcomer = just_after(state.self_node, old[0], everyone)
    state.add_member(newcomer, now=20.0)
    assert state.ring.my_receivers == (newcomer, old[0], old[1])
    assert victim in state.receivers  # an old receiver now unreachable: keep heartbeating it
    run(state, 20.0, 21.0, answering=everyone - {victim})
    assert state.unreachable(21.0) == frozenset()  # reported once
    # when it answers it is reachable again, and dropped since the ring does not pick it
    run(state, 21.0, 22.0, answering=everyone | {newcomer})
    assert victim not in state.receivers
    assert not state.registry.is_monitoring(victim)
    assert state.reachable(22.0) == {victim}


def test_a_receiver_that_stopped_answering_and_is_then_removed_gets_no_more_heartbeats() -> None:
    # The cluster shell feeds whole snapshots (init), never remove_member: a receiver that had
    # stopped answering was kept as an old unreachable receiver, and heartbeated for ever after
    # its removal (its send queue grew without end).
    state = sender_state(10)
    everyone = set(cluster(10))
    run(state, 0.0, 10.0, answering=everyone)
    victim = state.ring.my_receivers[0]
    run(state, 10.0, 20.0, answering=everyone - {victim})
    state.init(everyone, {victim}, now=20.0)
    assert victim in state.receivers  # unreachable: still heartbeated, to notice its return
    state.init(everyone - {victim}, set(), now=25.0)  # downed and removed
    assert victim not in state.receivers
    assert not state.registry.is_monitoring(victim)
    assert victim not in state.tick(26.0).receivers


def test_a_dropped_receiver_that_is_available_is_forgotten() -> None:
    state = sender_state(10)
    everyone = set(cluster(10))
    run(state, 0.0, 5.0, answering=everyone)
    old = state.ring.my_receivers
    state.add_member(just_after(state.self_node, old[0], everyone), now=5.0)
    assert old[2] not in state.receivers
    assert not state.registry.is_monitoring(old[2])
    assert state.registry.is_monitoring(old[1])


def test_a_shared_registry_is_used() -> None:
    registry = FailureDetectorRegistry(settings=SETTINGS)
    state = HeartbeatSenderState(node(0), settings=SETTINGS, registry=registry)
    state.add_member(node(1), now=0.0)
    state.tick(0.0)
    state.heartbeat_rsp(node(1), 0.1)
    assert registry.is_monitoring(node(1))
    assert state.registry is registry


def test_a_simulated_crash_in_a_large_cluster_is_seen_by_its_watchers_only() -> None:
    nodes = cluster(25)
    settings = FailureDetectorSettings()
    states = {n: HeartbeatSenderState(n, settings=settings) for n in nodes}
    for state in states.values():
        state.init(nodes, (), now=0.0)
    crashed = nodes[7]
    t = 0.0
    reports: dict[UniqueAddress, float] = {}
    while t < 30.0:
        for sender, state in states.items():
            if sender == crashed:
                continue
            for to in state.tick(t).receivers:
                if to != crashed or t < 10.0:
                    state.heartbeat_rsp(to, t + 0.002)
            for subject in state.unreachable(t + 0.5):
                assert subject == crashed
                reports.setdefault(sender, t + 0.5)
        t += 1.0
    watchers = {s for s, state in states.items() if crashed in state.ring.my_receivers}
    assert len(watchers) == settings.monitored_by_nr_of_members
    assert set(reports) == watchers
    # last answer at 9.002, detected about 4.5 s later, seen at the next reaping
    assert set(reports.values()) == {14.5}
