"""The replicator's protocol with several ReplicatorCores wired together, without trio or sockets.

A tiny driver (:class:`World`) carries out the effects every call returns: ``Send`` goes into one
network queue (which can drop, duplicate and reorder), ``Complete`` is recorded (and must come
once per operation), ``Persist`` is acknowledged at once or held for the test, ``Compact`` is
recorded. Messages travel with no delay; time only moves when the test says so.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pycrdt import Doc, Map

from crdt import (
    DataDeleted,
    GetFailure,
    ReadAll,
    ReadFrom,
    ReadLocal,
    ReadMajority,
    ReplicatorSettings,
    StoreFailure,
    UpdateTimeout,
    WriteAll,
    WriteConsistency,
    WriteLocal,
    WriteMajority,
    WriteMajorityPlus,
)
from crdt._core import (
    Compact,
    Complete,
    Effect,
    Peers,
    Persist,
    ReplicatorCore,
    Send,
)
from crdt._digest import EMPTY_STATE, decode_state_vector
from crdt._protocol import (
    Delete,
    DeleteAck,
    Deltas,
    KeyDigests,
    Read,
    ReadResult,
    ReplicatorMessage,
    Status,
    Sync,
    Write,
    WriteAck,
    WriteNack,
)
from membership import Address, MessageDecodeError, UniqueAddress
from membership.transport import _wire

Modify = Callable[[Doc[Any]], object]


def node(i: int) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", i), f"n{i}", 1000 + i)


@attrs.frozen
class Flight:
    """One message on the network."""

    src: UniqueAddress
    to: UniqueAddress
    message: ReplicatorMessage


class World:
    """Cores n1..nN, all replicas of each other, on a zero-delay network the test drives."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        settings: ReplicatorSettings | None = None,
        client_ids: Iterable[int] | None = None,
        auto_persist: bool = True,
    ) -> None:
        self.settings = settings if settings is not None else ReplicatorSettings()
        self.now = 0.0
        self.nodes = [node(i) for i in range(1, n + 1)]
        ids = list(client_ids) if client_ids is not None else [100 + i for i in range(1, n + 1)]
        self.cores: dict[UniqueAddress, ReplicatorCore] = {}
        for i, (address, client_id) in enumerate(zip(self.nodes, ids, strict=True), start=1):
            core = ReplicatorCore(
                address,
                self.settings,
                client_id=client_id,
                rng=random.Random(seed * 1000 + i),
                now=0.0,
            )
            effects = core.set_peers(Peers(replicas=frozenset(self.nodes) - {address}), 0.0)
            assert all(isinstance(e, Send) and isinstance(e.message, Status) for e in effects)
            # Not carried out: the greeting Status to new peers, with nothing to sync yet.
            self.cores[address] = core
        self.queue: list[Flight] = []
        self.sent: list[Flight] = []
        self.dropped: list[Flight] = []
        self.results: dict[tuple[UniqueAddress, int], Complete] = {}
        self.auto_persist = auto_persist
        self.persists: list[tuple[UniqueAddress, Persist]] = []
        self.compacts: list[tuple[UniqueAddress, Compact]] = []
        self.down: set[UniqueAddress] = set()
        self.drop: Callable[[Flight], bool] = lambda flight: False

    # -- access -------------------------------------------------------------------------------

    def __getitem__(self, i: int) -> ReplicatorCore:
        return self.cores[self.nodes[i - 1]]

    def result(self, i: int, op: int) -> Complete | None:
        return self.results.get((self.nodes[i - 1], op))

    def value(self, i: int, op: int) -> object:
        done = self.result(i, op)
        assert done is not None, f"operation {op} of n{i} has not completed"
        assert done.error is None, f"operation {op} of n{i} failed: {done.error!r}"
        return done.value

    def error(self, i: int, op: int) -> BaseException:
        done = self.result(i, op)
        assert done is not None, f"operation {op} of n{i} has not completed"
        assert done.error is not None, f"operation {op} of n{i} succeeded: {done.value!r}"
        return done.error

    def in_flight(self, kind: type[object], *, to: int | None = None) -> list[Flight]:
        return [
            f
            for f in self.queue
            if isinstance(f.message, kind) and (to is None or f.to == self.nodes[to - 1])
        ]

    def sent_of(self, kind: type[object]) -> list[Flight]:
        return [f for f in self.sent if isinstance(f.message, kind)]

    # -- operations ---------------------------------------------------------------------------

    def update(self, i: int, key: str, modify: Modify, consistency: WriteConsistency) -> int:
        core = self[i]
        try:
            op, effects = core.update(key, modify, consistency, self.now)
        except BaseException:
            self.drain(core, core.take_effects())
            raise
        self.drain(core, effects)
        return op

    def delete(self, i: int, key: str, consistency: WriteConsistency) -> int:
        core = self[i]
        try:
            op, effects = core.delete(key, consistency, self.now)
        except BaseException:
            self.drain(core, core.take_effects())
            raise
        self.drain(core, effects)
        return op

    def get(self, i: int, key: str, consistency: Any) -> int:
        core = self[i]
        op, effects = core.get(key, consistency, self.now)
        self.drain(core, effects)
        return op

    def persist(self, index: int = 0, error: BaseException | None = None) -> Persist:
        address, effect = self.persists.pop(index)
        core = self.cores[address]
        self.drain(core, core.persisted(effect.ticket, error, self.now))
        return effect

    # -- effects and the network --------------------------------------------------------------

    def drain(self, core: ReplicatorCore, effects: list[Effect]) -> None:
        """Carry out ``effects``, then what carrying them out made the core return, and so on."""
        while effects:
            more: list[Effect] = []
            for effect in effects:
                more += self._carry_out(core, effect)
            effects = more

    def _carry_out(self, core: ReplicatorCore, effect: Effect) -> list[Effect]:
        me = core.self_node
        match effect:
            case Send(to=to, message=message):
                assert to != me, "a core sent a message to itself"
                flight = Flight(me, to, message)
                self.sent.append(flight)
                if me in self.down or to in self.down or self.drop(flight):
                    self.dropped.append(flight)
                else:
                    self.queue.append(flight)
            case Complete(op=op):
                assert (me, op) not in self.results, f"operation {op} of {me} completed twice"
                self.results[me, op] = effect
            case Persist():
                if self.auto_persist:
                    return core.persisted(effect.ticket, None, self.now)
                self.persists.append((me, effect))
            case Compact():
                self.compacts.append((me, effect))
        return []

    def deliver(self, index: int = 0) -> Flight:
        flight = self.queue.pop(index)
        if flight.to in self.down:
            self.dropped.append(flight)
            return flight
        core = self.cores[flight.to]
        self.drain(core, core.receive(flight.src, flight.message, self.now))
        return flight

    def inject(self, src: int, to: int, message: ReplicatorMessage) -> None:
        """Deliver ``message`` to ``to`` as if ``src`` had sent it (receive must not raise)."""
        core = self[to]
        self.drain(core, core.receive(self.nodes[src - 1], message, self.now))

    def deliver_all(self, limit: int = 200_000) -> int:
        count = 0
        while self.queue:
            self.deliver()
            count += 1
            assert count < limit, "messages keep flowing: a loop in the protocol?"
        return count

    def tick(self, to: float) -> None:
        """Move time to ``to`` and tick every core once."""
        self.now = max(self.now, to)
        for core in self.cores.values():
            self.drain(core, core.tick(self.now))

    def run(self, seconds: float) -> None:
        """Deliver everything and tick each core at its deadlines for ``seconds``."""
        end = self.now + seconds
        while True:
            self.deliver_all()
            due = min(core.next_deadline() for core in self.cores.values())
            if due > end:
                self.now = end
                return
            self.now = max(self.now, due)
            for core in self.cores.values():
                if core.next_deadline() <= self.now:
                    self.drain(core, core.tick(self.now))

    def settle(self, max_seconds: float = 200.0) -> float:
        """Run gossip until every replica holds the same; returns the seconds it took."""
        start = self.now
        step = self.settings.gossip_interval
        while not (self.converged() and not self.queue):
            assert self.now - start < max_seconds, f"no convergence:\n{self.describe()}"
            self.run(step)
        return self.now - start

    # -- comparing replicas -------------------------------------------------------------------

    def all_keys(self) -> set[str]:
        keys: set[str] = set()
        for core in self.cores.values():
            keys |= set(core.held_keys()) | core.deleted_keys()
        return keys

    def converged(self) -> bool:
        cores = list(self.cores.values())
        first = cores[0]
        return all(
            core.digest(key) == first.digest(key) for key in self.all_keys() for core in cores
        )

    def describe(self) -> str:
        lines = []
        for address, core in self.cores.items():
            lines.append(
                f"{address.name}: held={core.held_keys()} deleted={sorted(core.deleted_keys())}"
            )
        return "\n".join(lines)


def setter(field: str, value: object, returns: object = None) -> Modify:
    def modify(doc: Doc[Any]) -> object:
        doc.get("m", type=Map)[field] = value
        return returns

    return modify


def remover(field: str) -> Modify:
    def modify(doc: Doc[Any]) -> None:
        m = doc.get("m", type=Map)
        if field in m:
            del m[field]

    return modify


def content(doc: object) -> dict[str, Any] | None:
    if doc is None:
        return None
    assert isinstance(doc, Doc)
    result: dict[str, Any] = doc.get("m", type=Map).to_py() or {}
    return result


def local(core: ReplicatorCore, key: str) -> dict[str, Any] | None:
    return content(core.snapshot(key))


# -- 1. write consistency ----------------------------------------------------------------------


def test_majority_write_completes_after_quorum_minus_one_acks_with_modify_result() -> None:
    w = World(5)
    op = w.update(1, "k", setter("a", 1, returns="done"), WriteMajority(timeout=2))
    writes = w.in_flight(Write)
    assert len(writes) == 4  # to every other replica
    assert w.result(1, op) is None
    w.deliver()  # first Write
    assert isinstance(w.queue[-1].message, WriteAck)
    w.deliver(len(w.queue) - 1)  # the first ack: 2 of the 3 needed
    assert w.result(1, op) is None
    assert w[1].statistics().pending_writes == 1
    w.deliver()  # second Write
    w.deliver(len(w.queue) - 1)  # second ack: quorum reached
    assert w.value(1, op) == "done"
    assert w[1].statistics().pending_writes == 0
    w.deliver_all()  # the late acks change nothing and complete nothing twice
    assert len(w.results) == 1


def test_duplicate_and_stray_acks_do_not_count() -> None:
    w = World(5)
    op = w.update(1, "k", setter("a", 1), WriteMajority(timeout=2))
    w.deliver()
    ack = w.queue.pop()
    assert isinstance(ack.message, WriteAck)
    for _ in range(3):  # the same replica acknowledging again is still one replica
        w.inject(2, 1, ack.message)
    assert w.result(1, op) is None
    w.inject(1, 1, ack.message)  # from itself: not a target
    assert w.result(1, op) is None
    w.inject(3, 1, ack.message)
    assert w.value(1, op) is None


def test_local_write_completes_at_once() -> None:
    w = World(3)
    op = w.update(1, "k", setter("a", 1, returns=42), WriteLocal())
    assert w.value(1, op) == 42
    assert w.queue == []  # nothing sent until the delta interval
    w.run(w.settings.delta_interval)
    deltas = w.sent_of(Deltas)
    assert {f.to for f in deltas} == {w.nodes[1], w.nodes[2]}
    assert local(w[2], "k") == {"a": 1.0}
    assert local(w[3], "k") == {"a": 1.0}


def test_write_all_with_a_silent_replica_times_out_then_spreads_by_gossip() -> None:
    w = World(3)
    w.down.add(w.nodes[2])
    op = w.update(1, "k", setter("a", "x"), WriteAll(timeout=1.5))
    w.deliver_all()
    assert w.result(1, op) is None
    assert w[1].next_deadline() <= 1.5
    w.tick(1.49)
    assert w.result(1, op) is None
    w.tick(1.5)
    error = w.error(1, op)
    assert isinstance(error, UpdateTimeout)
    assert "confirmed by 2 of the 3 replicas" in str(error)
    assert local(w[1], "k") == {"a": "x"}  # the write stays
    assert local(w[2], "k") == {"a": "x"}
    assert not w[3].has("k")
    w.down.clear()
    w.settle()
    assert local(w[3], "k") == {"a": "x"}


def test_write_majority_plus_leaves_out_leaving_members() -> None:
    w = World(5)
    leaving = w.nodes[4]
    w.drain(
        w[1],
        w[1].set_peers(Peers(replicas=frozenset(w.nodes[1:]), leaving=frozenset({leaving})), w.now),
    )
    op = w.update(1, "k", setter("a", 1), WriteMajorityPlus(additional=1, timeout=2))
    assert {f.to for f in w.in_flight(Write)} == set(w.nodes[1:4])
    # N' = 4, quorum = min(4, 4 // 2 + 1 + 1) = 4: all three non-leaving peers must confirm.
    for _ in range(3):
        w.deliver()
    assert len(w.in_flight(WriteAck)) == 3
    w.deliver()
    w.deliver()
    assert w.result(1, op) is None
    w.deliver()
    assert w.value(1, op) is None
    assert not w[5].has("k")


def test_a_removed_replica_leaves_the_operations_under_way_which_count_again() -> None:
    # A write waiting for a crashed replica completes once that replica is removed from the
    # cluster (as a write started after the removal would), not when its timeout is up.
    w = World(5)
    crashed = w.nodes[4]
    w.down.add(crashed)
    op = w.update(1, "k", setter("a", 1), WriteAll(timeout=5))
    read = w.get(1, "k", ReadAll(timeout=5))
    w.deliver_all()
    assert w.result(1, op) is None  # 4 of 5
    assert w.result(1, read) is None
    # Down: counts
    w.drain(w[1], w[1].set_peers(Peers(replicas=frozenset(w.nodes[1:4]) | {crashed}), w.now))
    assert w.result(1, op) is None
    w.drain(w[1], w[1].set_peers(Peers(replicas=frozenset(w.nodes[1:4])), w.now))  # removed
    assert w.value(1, op) is None
    assert w.value(1, read) is not None
    # An operation that already had what it needs is not counted twice.
    again = w.update(1, "k", setter("a", 2), WriteMajority(timeout=5))
    w.deliver_all()
    assert w.value(1, again) is None


def test_read_from_n_asks_enough_replicas() -> None:
    w = World(3)
    w.update(2, "k", setter("a", 7), WriteLocal())
    w.down.add(w.nodes[2])
    op = w.get(1, "k", ReadFrom(n=2, timeout=1))
    w.deliver_all()
    assert content(w.value(1, op)) == {"a": 7.0}


# -- 2. state-vector cover acks ----------------------------------------------------------------


def test_a_lagging_replica_nacks_and_gets_the_missing_part() -> None:
    w = World(3)
    w.drop = lambda f: f.to == w.nodes[2] and isinstance(f.message, Write)
    first = w.update(1, "k", setter("a", 1), WriteMajority(timeout=2))
    w.deliver_all()
    assert w.value(1, first) is None
    assert not w[3].has("k")
    w.drop = lambda f: False
    # Overwriting "a" builds on the first write, which n3 never saw.
    second = w.update(1, "k", setter("a", 2), WriteAll(timeout=2))
    w.deliver_all()
    answers = [f.message for f in w.sent if f.src == w.nodes[2]]
    assert [type(m) for m in answers] == [WriteNack, WriteAck]
    nack = answers[0]
    assert isinstance(nack, WriteNack)
    assert not nack.deleted
    assert nack.state == EMPTY_STATE
    resends = [
        f.message
        for f in w.sent_of(Write)
        if f.to == w.nodes[2] and isinstance(f.message, Write) and f.message.request_id == second
    ]
    assert len(resends) == 2  # the write, then what lay beyond n3's state
    assert w.value(1, second) is None
    assert local(w[3], "k") == {"a": 2.0}
    assert w[3].digest("k") == w[1].digest("k")


def test_a_replica_missing_another_writers_item_nacks() -> None:
    w = World(3)
    w.drop = lambda f: f.to == w.nodes[2]
    w.update(2, "k", setter("b", "from-2"), WriteLocal())
    w.run(w.settings.delta_interval)  # n1 gets n2's item, n3 does not
    assert local(w[1], "k") == {"b": "from-2"}
    assert not w[3].has("k")
    w.drop = lambda f: False
    op = w.update(1, "k", setter("b", "from-1"), WriteAll(timeout=2))
    w.deliver_all()
    assert w.value(1, op) is None
    assert len([f for f in w.sent_of(WriteNack) if f.src == w.nodes[2]]) == 1
    assert local(w[3], "k") == {"b": "from-1"}


def test_delete_only_write_is_acked_only_once_the_delete_is_applied() -> None:
    w = World(3)
    w.drop = lambda f: f.to == w.nodes[2]
    w.update(1, "k", setter("a", 1), WriteLocal())
    w.update(1, "k", setter("keep", 2), WriteLocal())
    w.run(w.settings.delta_interval)
    assert not w[3].has("k")
    w.drop = lambda f: False
    state_before = w[1].snapshot("k")
    assert state_before is not None
    op = w.update(1, "k", remover("a"), WriteAll(timeout=2))
    write = w.in_flight(Write, to=3)[0].message
    assert isinstance(write, Write)
    assert write.required == state_before.get_state()  # deleting does not advance the vector
    w.deliver_all()
    assert w.value(1, op) is None
    n3_answers = [type(f.message) for f in w.sent if f.src == w.nodes[2]]
    assert n3_answers == [WriteNack, WriteAck]
    assert local(w[3], "k") == {"keep": 2.0}
    assert w[3].digest("k") == w[1].digest("k") == w[2].digest("k")


def test_delete_only_write_to_an_up_to_date_replica_is_acked_at_once() -> None:
    w = World(2)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    op = w.update(1, "k", remover("a"), WriteAll(timeout=2))
    w.deliver_all()
    assert w.value(1, op) is None
    assert w.sent_of(WriteNack) == []
    assert local(w[2], "k") == {}
    assert w[2].digest("k") == w[1].digest("k")


def test_resends_to_a_lagging_replica_are_bounded() -> None:
    w = World(2)
    w.update(1, "k", setter("a", 1), WriteLocal())
    op = w.update(1, "k", setter("a", 2), WriteAll(timeout=2))
    assert w.queue  # the Write to n2, which lacks the first write
    # n2 keeps claiming it has nothing: the writer gives up after MAX_WRITE_RESENDS resends.
    w.queue.clear()
    for _ in range(10):
        w.inject(2, 1, WriteNack(replicator="ddata", request_id=op, state=EMPTY_STATE))
    assert len(w.in_flight(Write)) == 3
    w.tick(2.0)
    assert isinstance(w.error(1, op), UpdateTimeout)


# -- 3. reads ----------------------------------------------------------------------------------


def test_majority_read_repairs_the_local_replica() -> None:
    w = World(3)
    w.drop = lambda f: isinstance(f.message, Deltas)
    w.update(1, "k", setter("a", "v"), WriteLocal())
    w.tick(w.settings.delta_interval)
    assert w.dropped
    assert not w[2].has("k")
    w.down.add(w.nodes[2])  # only n1 can answer
    op = w.get(2, "k", ReadMajority(timeout=2))
    reads = w.in_flight(Read)
    assert len(reads) == 1
    assert isinstance(reads[0].message, Read)
    assert reads[0].message.state == EMPTY_STATE
    w.deliver_all()
    assert content(w.value(2, op)) == {"a": "v"}
    assert local(w[2], "k") == {"a": "v"}
    assert w[2].digest("k") == w[1].digest("k")
    again = w.get(2, "k", ReadLocal())
    assert content(w.value(2, again)) == {"a": "v"}


def test_majority_read_merges_every_answer() -> None:
    w = World(3)
    w.drop = lambda f: isinstance(f.message, Deltas)
    w.update(2, "k", setter("from2", 2), WriteLocal())
    w.update(3, "k", setter("from3", 3), WriteLocal())
    w.update(1, "k", setter("from1", 1), WriteLocal())
    op = w.get(1, "k", ReadAll(timeout=2))
    w.deliver_all()
    assert content(w.value(1, op)) == {"from1": 1.0, "from2": 2.0, "from3": 3.0}


def test_read_of_a_key_nobody_has_is_none() -> None:
    w = World(3)
    op = w.get(1, "nothing", ReadMajority(timeout=2))
    w.deliver_all()
    assert w.value(1, op) is None
    assert not w[1].has("nothing")


def test_majority_read_with_too_few_replies_fails_at_the_timeout() -> None:
    w = World(5)
    w.down |= {w.nodes[2], w.nodes[3], w.nodes[4]}
    op = w.get(1, "k", ReadMajority(timeout=2))
    w.deliver_all()
    w.tick(1.99)
    assert w.result(1, op) is None
    assert w[1].statistics().pending_reads == 1
    w.tick(2.0)
    error = w.error(1, op)
    assert isinstance(error, GetFailure)
    assert "got 2 of the 3 replicas" in str(error)
    assert w[1].statistics().pending_reads == 0


def test_read_from_a_replica_with_a_tombstone_fails_with_data_deleted() -> None:
    w = World(3)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    w.down.add(w.nodes[2])
    w.delete(2, "k", WriteLocal())
    op = w.get(1, "k", ReadMajority(timeout=2))
    w.deliver_all()
    assert isinstance(w.error(1, op), DataDeleted)
    assert w[1].is_deleted("k")


# -- 4. deletes --------------------------------------------------------------------------------


def test_delete_with_quorum_and_the_tombstone_refuses_further_use() -> None:
    w = World(3)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    op = w.delete(2, "k", WriteAll(timeout=2))
    assert len(w.in_flight(Delete)) == 2
    w.deliver_all()
    assert w.value(2, op) is None
    assert len(w.sent_of(DeleteAck)) == 2
    for i in (1, 2, 3):
        core = w[i]
        assert core.is_deleted("k")
        assert "k" not in core.held_keys()
        assert core.statistics().deleted_keys == 1
        with pytest.raises(DataDeleted):
            core.update("k", setter("a", 2), WriteLocal(), w.now)
        with pytest.raises(DataDeleted):
            core.delete("k", WriteLocal(), w.now)
        with pytest.raises(DataDeleted):
            core.snapshot("k")
    read = w.get(3, "k", ReadLocal())
    assert isinstance(w.error(3, read), DataDeleted)


def test_tombstone_wins_over_writes_syncs_and_deltas() -> None:
    w = World(3)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    w.down.add(w.nodes[0])
    w.delete(1, "k", WriteLocal())
    w.down.clear()
    # n2 keeps writing, unaware of the delete.
    update = w[2].snapshot("k")
    assert update is not None
    w.update(2, "k", setter("b", 2), WriteLocal())
    later = w[2].snapshot("k")
    assert later is not None
    full = later.get_update()
    w.inject(2, 1, Deltas(replicator="ddata", updates={"k": full}))
    w.inject(2, 1, Sync(replicator="ddata", updates={"k": full}))
    w.inject(2, 1, Sync(replicator="ddata", states={"k": later.get_state()}, reply=True))
    w.inject(
        2,
        1,
        ReadResult(replicator="ddata", request_id=12345, update=full),
    )
    assert w[1].is_deleted("k")
    assert not w[1].has("k")
    # The Sync with states is answered with the tombstone.
    answers = [f.message for f in w.queue if f.src == w.nodes[0]]
    assert any(isinstance(m, Sync) and m.deleted == ("k",) for m in answers)
    w.queue.clear()
    w.inject(2, 1, Write(replicator="ddata", key="k", request_id=77, update=full, required=b"\0"))
    assert not w[1].has("k")
    nacks = [f.message for f in w.queue if isinstance(f.message, WriteNack)]
    assert nacks == [WriteNack(replicator="ddata", request_id=77, deleted=True)]
    w.queue.clear()
    w.settle()
    for i in (1, 2, 3):
        assert w[i].is_deleted("k")
        assert w[i].held_keys() == []


def test_concurrent_update_and_delete_end_deleted_everywhere() -> None:
    w = World(3, seed=4)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    w.delete(1, "k", WriteLocal())
    w.update(2, "k", setter("a", 2), WriteLocal())
    w.update(3, "k", setter("c", 3), WriteLocal())
    w.settle()
    assert all(w[i].is_deleted("k") for i in (1, 2, 3))
    w.run(10 * w.settings.gossip_interval)  # and it stays so
    assert all(w[i].is_deleted("k") and not w[i].has("k") for i in (1, 2, 3))


def test_write_nack_deleted_fails_the_write_with_data_deleted() -> None:
    w = World(3)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    w.down.add(w.nodes[1])
    w.delete(2, "k", WriteLocal())
    w.down.clear()
    op = w.update(1, "k", setter("a", 2), WriteAll(timeout=2))
    w.deliver_all()
    error = w.error(1, op)
    assert isinstance(error, DataDeleted)
    assert w[1].is_deleted("k")
    assert w[1].statistics().pending_writes == 0
    w.tick(5.0)  # no second completion at the timeout (World asserts once per op)


# -- 5. anti-entropy ---------------------------------------------------------------------------


def test_gossip_alone_converges_two_hundred_keys() -> None:
    w = World(3, seed=5)
    w.drop = lambda f: isinstance(f.message, Deltas)
    for n in range(200):
        i = 1 + n % 3
        w.update(i, f"key-{n}", setter("n", n), WriteLocal())
        if n % 7 == 0:
            w.update(1 + (i % 3), f"key-{n}", setter("other", "x"), WriteLocal())
    assert not w.converged()
    took = w.settle()
    assert took <= 20 * w.settings.gossip_interval
    assert w.sent_of(Write) == []
    for n in range(200):
        digests = {w[i].digest(f"key-{n}") for i in (1, 2, 3)}
        assert len(digests) == 1
        assert None not in digests
    assert local(w[2], "key-7") == {"n": 7.0, "other": "x"}
    for i in (1, 2, 3):
        assert len(w[i].held_keys()) == 200


def test_a_round_at_rest_is_one_status_and_nothing_else() -> None:
    w = World(3, seed=6)
    for n in range(50):
        w.update(1 + n % 3, f"key-{n}", setter("n", n), WriteLocal())
    w.settle()
    w.deliver_all()
    sent_before = len(w.sent)
    core = w[2]
    stats = core.statistics()
    w.now = core.next_deadline()
    assert w.now < w.settings.delta_interval + 1000  # a gossip deadline, no op pending
    w.drain(core, core.tick(w.now))
    new = w.sent[sent_before:]
    assert len(new) == 1
    status = new[0].message
    assert isinstance(status, Status)
    assert len(status.buckets) == 8 * w.settings.digest_buckets
    after = core.statistics()
    assert after.gossip_messages_sent == stats.gossip_messages_sent + 1
    assert after.gossip_bytes_sent == stats.gossip_bytes_sent + len(status.buckets)
    w.deliver_all()
    assert len(w.sent) == sent_before + 1  # the peer found nothing to say


def test_status_with_the_wrong_number_of_buckets_is_malformed() -> None:
    w = World(2)
    w.update(1, "k", setter("a", 1), WriteLocal())
    w.queue.clear()
    w.inject(2, 1, Status(replicator="ddata", buckets=b"\x01" * 8 * 3))
    assert w[1].statistics().malformed_messages == 1
    assert w.queue == []
    assert local(w[1], "k") == {"a": 1.0}


def test_gossip_messages_are_split_at_max_message_bytes() -> None:
    limit = 2048
    w = World(2, seed=7, settings=ReplicatorSettings(max_message_bytes=limit))
    for n in range(100):
        w.update(1, f"key-{n:03}", setter("v", f"{n:03}" * 10), WriteLocal())
        w.update(2, f"other-{n:03}", setter("v", f"{n:03}" * 10), WriteLocal())
        w.update(2, f"key-{n:03}", setter("w", n), WriteLocal())
    w.drop = lambda f: f.src == w.nodes[0] and isinstance(f.message, Deltas)
    w.run(w.settings.delta_interval)
    deltas = [f.message for f in w.sent_of(Deltas) if f.src == w.nodes[0]]
    assert len(deltas) > 1
    for message in deltas:
        assert isinstance(message, Deltas)
        assert sum(len(k) + len(u) for k, u in message.updates.items()) <= limit
    assert sum(len(m.updates) for m in deltas if isinstance(m, Deltas)) == 100
    w.drop = lambda f: False
    w.settle()
    digests = [f.message for f in w.sent_of(KeyDigests)]
    syncs = [f.message for f in w.sent_of(Sync)]
    assert len(digests) > 1
    assert len(syncs) > 2
    for message in digests:
        assert isinstance(message, KeyDigests)
        assert sum(len(k) + len(d) for k, d in message.digests.items()) <= limit
    for message in syncs:
        assert isinstance(message, Sync)
        size = (
            sum(len(k) + len(v) for k, v in message.updates.items())
            + sum(len(k) + len(v) for k, v in message.states.items())
            + sum(len(k) + len(v) for k, v in message.delete_sets.items())
            + sum(len(k) for k in message.deleted)
        )
        assert size <= limit
    assert w[1].held_keys() == w[2].held_keys()
    assert len(w[1].held_keys()) == 200


def test_gossip_heals_a_difference_in_delete_sets_alone() -> None:
    # Deleting never advances a state vector: replicas with equal vectors can still differ.
    w = World(3, seed=10)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.update(1, "k", setter("b", 2), WriteAll(timeout=2))
    w.deliver_all()
    w.drop = lambda f: isinstance(f.message, Deltas)
    w.update(2, "k", remover("a"), WriteLocal())
    docs = {i: w[i].snapshot("k") for i in (1, 2, 3)}
    states = {doc.get_state() for doc in docs.values() if doc is not None}
    assert len(states) == 1
    assert w[2].digest("k") != w[1].digest("k") == w[3].digest("k")
    w.settle()
    for i in (1, 2, 3):
        assert local(w[i], "k") == {"b": 2.0}
    assert len(w.sent_of(Write)) == 4  # only the two WriteAll, to two replicas each


def test_gossip_spreads_tombstones_to_replicas_that_never_held_the_key() -> None:
    w = World(3, seed=8)
    w.down.add(w.nodes[2])
    w.update(1, "gone", setter("a", 1), WriteLocal())
    w.delete(1, "gone", WriteLocal())
    w.down.clear()
    w.settle()
    assert all(w[i].is_deleted("gone") for i in (1, 2, 3))
    assert all(not w[i].has("gone") for i in (1, 2, 3))


def test_unreachable_peers_get_no_gossip() -> None:
    w = World(3, seed=9)
    others = frozenset(w.nodes[1:])
    w.drain(
        w[1], w[1].set_peers(Peers(replicas=others, unreachable=frozenset({w.nodes[1]})), w.now)
    )
    w.update(1, "k", setter("a", 1), WriteLocal())
    w.run(20 * w.settings.gossip_interval)
    assert not [f for f in w.sent if f.src == w.nodes[0] and f.to == w.nodes[1]]
    assert [f for f in w.sent if f.src == w.nodes[0] and f.to == w.nodes[2]]


# -- 6. convergence under loss, duplication and reordering -------------------------------------

FIELDS = ("a", "b", "c")
KEYS = ("k0", "k1", "k2", "k3", "k4", "k5")

Op = tuple[str, int, int, int, int | str]
"""(kind, node 1-3, key index, field index, value)."""

KINDS = [
    *["set"] * 8,
    *["remove"] * 4,
    *["set-majority"] * 2,
    "read-majority",
    "delete",
]

op_strategy = st.tuples(
    st.sampled_from(KINDS),
    st.integers(1, 3),
    st.integers(0, len(KEYS) - 1),
    st.integers(0, len(FIELDS) - 1),
    st.one_of(st.integers(-1000, 1000), st.text(max_size=5)),
)


def random_ops(rng: random.Random, count: int) -> list[Op]:
    ops: list[Op] = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        value: int | str = (
            rng.randint(-1000, 1000) if rng.random() < 0.5 else rng.choice(["x", "yy", ""])
        )
        ops.append(
            (kind, rng.randint(1, 3), rng.randrange(len(KEYS)), rng.randrange(len(FIELDS)), value)
        )
    return ops


def chaos(ops: list[Op], seed: int) -> World:
    """Run ``ops`` over a lossy, duplicating, reordering network, then heal and settle.

    Most writes are local (the brief of the property: gossip and deltas alone converge); a few
    majority writes and reads mix in the direct protocol, whose messages suffer the same.
    """
    rng = random.Random(seed)
    w = World(3, seed=seed)
    loss, duplication = rng.choice([0.0, 0.2, 0.5]), rng.choice([0.0, 0.2])
    issued: list[tuple[int, int]] = []
    for kind, i, k, f, value in ops:
        key, field = KEYS[k], FIELDS[f]
        deleted = w[i].is_deleted(key)
        if kind == "read-majority":
            issued.append((i, w.get(i, key, ReadMajority(timeout=1))))
        elif deleted:
            pass
        elif kind == "set":
            issued.append((i, w.update(i, key, setter(field, value), WriteLocal())))
        elif kind == "set-majority":
            issued.append((i, w.update(i, key, setter(field, value), WriteMajority(timeout=1))))
        elif kind == "remove":
            issued.append((i, w.update(i, key, remover(field), WriteLocal())))
        else:
            issued.append((i, w.delete(i, key, WriteLocal())))
        for _ in range(rng.randrange(4)):
            if not w.queue:
                break
            index = rng.randrange(len(w.queue))
            roll = rng.random()
            if roll < loss:
                w.dropped.append(w.queue.pop(index))
            elif roll < loss + duplication:
                w.queue.append(w.queue[index])
                w.deliver(index)
            else:
                w.deliver(index)
        if rng.random() < 0.3:
            w.tick(w.now + rng.uniform(0, 2 * w.settings.gossip_interval))
    # Heal: no more loss; let the network and gossip finish, and every operation time out.
    w.settle()
    w.run(1.0)
    assert w.converged()
    for i, op in issued:
        assert w.result(i, op) is not None, f"operation {op} of n{i} never completed"
    for core in w.cores.values():
        stats = core.statistics()
        assert stats.pending_writes == stats.pending_reads == 0
        assert stats.malformed_messages == 0
    return w


def assert_identical(w: World) -> None:
    cores = list(w.cores.values())
    first = cores[0]
    for core in cores[1:]:
        assert core.held_keys() == first.held_keys()
        assert core.deleted_keys() == first.deleted_keys()
    for key in w.all_keys():
        digests = {core.digest(key) for core in cores}
        assert len(digests) == 1, f"{key}: {digests}"
        if first.is_deleted(key):
            continue
        contents = [local(core, key) for core in cores]
        assert all(c == contents[0] for c in contents), f"{key}: {contents}"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_replicas_converge_after_chaos(ops: list[Op], seed: int) -> None:
    assert_identical(chaos(ops, seed))


@pytest.mark.parametrize("seed", range(30))
def test_replicas_converge_after_chaos_seeded(seed: int) -> None:
    print(f"seed={seed}")
    rng = random.Random(seed)
    w = chaos(random_ops(rng, 120), seed)
    assert_identical(w)


# -- 7. durability -----------------------------------------------------------------------------

DURABLE = ReplicatorSettings(
    durable_keys=("d-*",), durable_path=Path("unused.sqlite"), compact_after=3
)


def test_durable_local_write_completes_only_once_persisted() -> None:
    w = World(2, settings=DURABLE, auto_persist=False)
    op = w.update(1, "d-1", setter("a", 1, returns="ok"), WriteLocal())
    assert w.result(1, op) is None
    assert len(w.persists) == 1
    _, effect = w.persists[0]
    assert [key for key, _ in effect.entries] == ["d-1"]
    update = effect.entries[0][1]
    assert update is not None
    replay: Doc[Any] = Doc()
    replay.apply_update(update)
    assert content(replay) == {"a": 1.0}
    w.persist()
    assert w.value(1, op) == "ok"
    plain = w.update(1, "plain", setter("a", 1), WriteLocal())
    assert w.value(1, plain) is None
    assert w.persists == []


def test_durable_write_failing_on_disk_fails_with_store_failure() -> None:
    w = World(2, settings=DURABLE, auto_persist=False)
    op = w.update(1, "d-1", setter("a", 1), WriteLocal())
    disk_full = OSError("disk full")
    w.persist(error=disk_full)
    error = w.error(1, op)
    assert isinstance(error, StoreFailure)
    assert error.__cause__ is disk_full
    assert "disk full" in str(error)
    assert local(w[1], "d-1") == {"a": 1.0}  # as in Akka, it stays in memory and spreads
    w.run(w.settings.delta_interval)
    for _, effect in list(w.persists):  # n2 stores what it got
        assert effect.entries[0][0] == "d-1"
    assert local(w[2], "d-1") == {"a": 1.0}


def test_durable_majority_write_waits_for_acks_and_disk() -> None:
    w = World(3, settings=DURABLE, auto_persist=False)
    op = w.update(1, "d-1", setter("a", 1, returns=5), WriteMajority(timeout=2))
    w.deliver_all()
    assert w.sent_of(WriteAck) == []  # the replicas' appends are not on disk yet
    assert len(w.persists) == 3
    while len(w.persists) > 1:
        address, _ = w.persists[-1]
        assert address != w.nodes[0]
        w.persist(len(w.persists) - 1)
    w.deliver_all()
    assert len(w.sent_of(WriteAck)) == 2
    assert w.result(1, op) is None  # acked, but the writer's own append is pending
    w.persist()
    assert w.value(1, op) == 5


def test_remote_write_to_durable_key_acks_after_persisted_and_not_on_failure() -> None:
    w = World(3, settings=DURABLE, auto_persist=False)
    op = w.update(1, "d-1", setter("a", 1), WriteAll(timeout=2))
    w.persist()  # the writer's own
    w.deliver_all()
    assert w.sent_of(WriteAck) == []
    assert {address for address, _ in w.persists} == {w.nodes[1], w.nodes[2]}
    n2 = [address for address, _ in w.persists].index(w.nodes[1])
    w.persist(n2)
    w.persist(0, error=OSError("I/O error"))  # n3: no ack, ever
    w.deliver_all()
    assert [f.src for f in w.sent_of(WriteAck)] == [w.nodes[1]]
    assert w.result(1, op) is None
    w.tick(2.0)
    assert isinstance(w.error(1, op), UpdateTimeout)


def test_durable_delete_is_persisted_as_none() -> None:
    w = World(2, settings=DURABLE, auto_persist=False)
    w.update(1, "d-1", setter("a", 1), WriteLocal())
    w.persist()
    op = w.delete(1, "d-1", WriteAll(timeout=2))
    assert w.persists[-1][1].entries == (("d-1", None),)
    w.deliver_all()
    assert w.sent_of(DeleteAck) == []  # n2's tombstone is not on disk yet
    w.persist(len(w.persists) - 1)
    w.deliver_all()
    assert w.result(1, op) is None  # the writer's tombstone is not on disk yet
    w.persist(0)
    assert w.value(1, op) is None


def test_compact_every_compact_after_appends() -> None:
    w = World(2, settings=DURABLE)
    for n in range(7):
        w.update(1, "d-1", setter("a", n), WriteLocal())
    compacts = [c for address, c in w.compacts if address == w.nodes[0]]
    assert len(compacts) == 2
    assert all(c.key == "d-1" for c in compacts)
    replay: Doc[Any] = Doc()
    replay.apply_update(compacts[-1].snapshot)
    assert content(replay) == {"a": 5.0}  # the state after the sixth append
    for n in range(5):
        w.update(1, "plain", setter("a", n), WriteLocal())
    assert len(w.compacts) == 2


def test_compact_follows_the_persist_it_covers() -> None:
    w = World(1, settings=DURABLE, auto_persist=False)
    core = w[1]
    effects: list[Effect] = []
    for n in range(3):
        effects += core.update("d-1", setter("a", n), WriteLocal(), w.now)[1]
    kinds = [type(effect).__name__ for effect in effects]
    # The store must see the Compact after the appends it replaces.
    assert kinds == ["Persist", "Persist", "Persist", "Compact"]
    w.drain(core, effects)
    assert len(w.compacts) == 1
    assert len(w.persists) == 3


def test_durable_write_ack_waits_for_an_earlier_pending_append() -> None:
    w = World(3, settings=DURABLE, auto_persist=False)
    op = w.update(1, "d-1", setter("a", 1), WriteAll(timeout=2))
    w.persist()
    write = w.in_flight(Write, to=2)[0]
    w.queue.remove(write)
    # The same update reaches n2 first by another path (gossip, or read repair from n3).
    doc = w[1].snapshot("d-1")
    assert doc is not None
    w.inject(3, 2, Sync(replicator="ddata", updates={"d-1": doc.get_update()}))
    assert [(address, p.entries[0][0]) for address, p in w.persists] == [(w.nodes[1], "d-1")]
    w.queue.insert(0, write)
    w.deliver(0)
    # n2's append of the update is not on disk yet: WriteAck promises it is.
    assert [f for f in w.sent_of(WriteAck) if f.src == w.nodes[1]] == []
    w.persist(0)
    assert [f for f in w.sent_of(WriteAck) if f.src == w.nodes[1]] != []
    w.deliver_all()
    while w.persists:  # n3's append of the Write
        w.persist(0)
        w.deliver_all()
    assert w.value(1, op) is None


def test_durable_delete_ack_waits_for_an_earlier_pending_tombstone() -> None:
    w = World(2, settings=DURABLE, auto_persist=False)
    w.inject(1, 2, Sync(replicator="ddata", deleted=("d-1",)))
    assert w.persists[0][1].entries == (("d-1", None),)
    w.inject(1, 2, Delete(replicator="ddata", key="d-1", request_id=9))
    assert w.sent_of(DeleteAck) == []
    w.persist(0)
    assert len(w.sent_of(DeleteAck)) == 1


# -- 8. bad input ------------------------------------------------------------------------------


def test_malformed_messages_are_counted_and_dropped() -> None:
    w = World(2)
    w.update(1, "k", setter("a", 1), WriteAll(timeout=2))
    w.deliver_all()
    before = w[2].digest("k")
    good_state = w[2].snapshot("k")
    assert good_state is not None
    sv = good_state.get_state()
    bad: list[ReplicatorMessage] = [
        Write(replicator="ddata", key="", request_id=1, update=b"\0\0", required=sv),
        Write(replicator="ddata", key="k", request_id=1, update=b"garbage", required=sv),
        Write(replicator="ddata", key="k", request_id=1, update=b"\0\0", required=b"\xff\xff"),
        Write(replicator="ddata", key="new", request_id=1, update=b"\x01\x02\x03", required=sv),
        Read(replicator="ddata", key="", request_id=1, state=sv),
        Read(replicator="ddata", key="k", request_id=1, state=b"garbage"),
        Delete(replicator="ddata", key="", request_id=1),
        Delete(replicator="ddata", key="x" * 1025, request_id=1),
        Deltas(replicator="ddata", updates={"k": b"garbage"}),
        Deltas(replicator="ddata", updates={"": b"\0\0"}),
        Deltas(replicator="ddata", updates={"fresh": b"\xff\xff\xff"}),
        Sync(replicator="ddata", updates={"k": b"\x07"}),
        Sync(replicator="ddata", states={"k": b"garbage"}),
        Sync(replicator="ddata", deleted=("",)),
        KeyDigests(replicator="ddata", buckets=(9999,), digests={}),
        KeyDigests(replicator="ddata", buckets=(), digests={"": b"x" * 16}),
        Status(replicator="ddata", buckets=b""),
    ]
    for message in bad:
        w.inject(1, 2, message)
    assert w[2].statistics().malformed_messages == len(bad)
    assert w[2].digest("k") == before
    assert local(w[2], "k") == {"a": 1.0}
    assert w[2].held_keys() == ["k"]  # no half-created keys
    assert w[2].deleted_keys() == frozenset()
    w.queue.clear()
    w.inject(1, 2, Read(replicator="ddata", key="k", request_id=2, state=EMPTY_STATE))
    assert len(w.in_flight(ReadResult)) == 1  # still serving


def test_garbage_state_in_a_write_nack_is_malformed() -> None:
    w = World(2)
    w.update(1, "k", setter("a", 1), WriteLocal())
    op = w.update(1, "k", setter("a", 2), WriteAll(timeout=2))
    w.queue.clear()
    w.inject(2, 1, WriteNack(replicator="ddata", request_id=op, state=b"garbage"))
    assert w[1].statistics().malformed_messages == 1
    assert local(w[1], "k") == {"a": 2.0}


def test_garbage_update_in_a_read_result_is_malformed() -> None:
    w = World(2)
    op = w.get(1, "k", ReadAll(timeout=2))
    w.queue.clear()
    w.inject(2, 1, ReadResult(replicator="ddata", request_id=op, update=b"garbage"))
    assert w[1].statistics().malformed_messages == 1
    assert not w[1].has("k")
    w.tick(2.0)
    assert isinstance(w.error(1, op), GetFailure)


def test_wrongly_typed_fields_are_rejected_when_decoded() -> None:
    # A peer cannot make the core see a list where a dict belongs, or an int for a key: the
    # constructors check field types, and the wire layer turns that into MessageDecodeError
    # (the transport drops the one message and counts it).
    good: list[ReplicatorMessage] = [
        Deltas(replicator="ddata", updates={"k": b"\0\0"}),
        Sync(replicator="ddata", updates={"k": b"\0\0"}),
        Sync(replicator="ddata", states={"k": b"\0"}),
        Write(replicator="ddata", key="k", request_id=1, update=b"\0\0", required=b"\0"),
    ]
    wrong_values: list[tuple[str, object]] = [
        ("updates", [("k", b"\0\0")]),
        ("updates", [("k", b"\0\0")]),
        ("states", [("k", b"\0")]),
        ("key", 5),
    ]
    for message, (field, value) in zip(good, wrong_values, strict=True):
        object.__setattr__(message, field, value)  # what a misbehaving peer could encode
        payload = _wire.encode(message)
        with pytest.raises(MessageDecodeError, match=f"'{field}' must be"):
            _wire.decode(payload)


def test_async_modify_is_a_type_error() -> None:
    w = World(2)

    async def modify(doc: Doc[Any]) -> None:
        doc.get("m", type=Map)["a"] = 1  # never runs

    with pytest.raises(TypeError, match="awaitable"):
        w.update(1, "k", modify, WriteLocal())
    assert local(w[1], "k") in (None, {})  # the body never ran (see the ghost-key test)
    assert w[1].statistics().pending_writes == 0
    assert w.results == {}


@pytest.mark.parametrize("bad", ["raises", "async"])
def test_failed_modify_that_changed_nothing_leaves_no_key(bad: str) -> None:
    w = World(3, seed=11)

    def raising(doc: Doc[Any]) -> None:
        raise RuntimeError("before any edit")

    async def asynchronous(doc: Doc[Any]) -> None:
        pass

    with pytest.raises((RuntimeError, TypeError)):
        w.update(1, "ghost", raising if bad == "raises" else asynchronous, WriteLocal())
    w.run(10 * w.settings.gossip_interval)
    # A call that failed and changed nothing should leave nothing, here or anywhere else.
    assert [w[i].held_keys() for i in (1, 2, 3)] == [[], [], []]


@pytest.mark.parametrize("key", ["", "x" * 1025, 5, None])
def test_invalid_keys_are_value_errors(key: Any) -> None:
    w = World(2)
    with pytest.raises(ValueError, match="invalid"):
        w.update(1, key, setter("a", 1), WriteLocal())
    with pytest.raises(ValueError, match="invalid"):
        w.get(1, key, ReadLocal())
    with pytest.raises(ValueError, match="invalid"):
        w.delete(1, key, WriteLocal())
    assert w[1].held_keys() == []
    assert w.results == {}


def test_longest_key_is_valid() -> None:
    w = World(1)
    op = w.update(1, "x" * 1024, setter("a", 1), WriteLocal())
    assert w.value(1, op) is None


@pytest.mark.parametrize("consistency", [WriteLocal(), WriteMajority(timeout=2)])
def test_modify_raising_keeps_and_replicates_the_partial_edit(
    consistency: WriteConsistency,
) -> None:
    w = World(3)

    def modify(doc: Doc[Any]) -> None:
        doc.get("m", type=Map)["a"] = 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        w.update(1, "k", modify, consistency)
    assert local(w[1], "k") == {"a": 1.0}
    assert w.results == {}
    assert w[1].statistics().pending_writes == 0
    assert w.queue == []
    w.run(w.settings.delta_interval)
    deltas = w.sent_of(Deltas)
    assert {f.to for f in deltas} == {w.nodes[1], w.nodes[2]}
    assert local(w[2], "k") == {"a": 1.0}
    assert local(w[3], "k") == {"a": 1.0}


def test_client_id_must_be_in_range() -> None:
    for client_id in (0, -1, 1 << 53):
        with pytest.raises(ValueError, match="client_id"):
            ReplicatorCore(
                node(1), ReplicatorSettings(), client_id=client_id, rng=random.Random(0), now=0
            )


# -- 9. client ids -----------------------------------------------------------------------------


@pytest.mark.parametrize(("ids", "winner"), [((5, 7), "n2"), ((9, 7), "n1")])
def test_concurrent_writes_to_one_field_converge_on_the_higher_client_id(
    ids: tuple[int, int], winner: str
) -> None:
    for order in (0, 1):
        w = World(2, client_ids=ids)
        w.update(1, "k", setter("a", "n1"), WriteLocal())
        w.update(2, "k", setter("a", "n2"), WriteLocal())
        w.tick(w.settings.delta_interval)
        assert len(w.queue) == 2
        if order:
            w.queue.reverse()
        w.deliver_all()
        assert local(w[1], "k") == local(w[2], "k") == {"a": winner}
        assert w[1].digest("k") == w[2].digest("k")


def test_every_document_writes_under_the_core_client_id() -> None:
    w = World(2, client_ids=(11, 22))
    w.update(1, "k1", setter("a", 1), WriteLocal())
    w.update(1, "k2", setter("a", 1), WriteLocal())
    w.run(1.0)
    for key, doc in w[2].documents():
        assert set(decode_state_vector(doc.get_state())) == {11}, key


def test_a_peer_that_appears_gets_a_status_at_once() -> None:
    w = World(3)
    newcomer = UniqueAddress(Address("10.0.0.1", 9), "n9", 99)
    effects = w[1].set_peers(
        Peers(replicas=frozenset({w.nodes[1], w.nodes[2]}), weakly_up=frozenset({newcomer})), w.now
    )
    sent = [e for e in effects if isinstance(e, Send)]
    assert [(e.to, type(e.message)) for e in sent] == [(newcomer, Status)]
    again = w[1].set_peers(Peers(replicas=frozenset({w.nodes[1], w.nodes[2], newcomer})), w.now)
    assert again == []  # known already: no greeting again
