"""The entity side of event sourcing: snapshots written behind the command, recoveries batched.

Against every backend (memory, SQLite, a real PostgreSQL started for the module): a snapshot
write held in the journal does not hold up the next command, a stream has one snapshot write in
flight at a time, a refused snapshot ends the incarnation at its next message while another
failure is only logged and tried again; an entity that stops with its snapshot in flight leaves
nothing behind that recovery cannot read; recoveries asked at once are read in a few batches,
each stream with its own answer and its own error, and a seeded random run gives the same
answers batched as one at a time. The sans-IO queues and rules
(``p2pshard.persistence._batching``) are tested alone first.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import trio
import trio.testing

from p2pshard import (
    EntityContext,
    EntityId,
    EventSourcedEntity,
    HashExtractor,
    Journal,
    JournalConflict,
    JournalError,
    JournalFenced,
    MemoryJournal,
    Node,
    PostgresJournal,
    Recovery,
    ShardId,
    ShardingSettings,
    SnapshotWrite,
    SqliteJournal,
)
from p2pshard.persistence._batching import (
    PendingRecovery,
    PendingSnapshot,
    RecoveryQueue,
    SnapshotQueue,
    StreamRead,
    assemble_recoveries,
    fence_raises,
    group_rows,
    plan_snapshots,
)
from p2pshard.persistence._gather import JournalBatcher, journal_batcher
from p2pshard.persistence._group_commit import StreamRow
from p2pshard.sharding._entity import EntityEvent
from p2pshard.testing import PostgresServer, running_postgres
from tests._support.sharding_sim import CounterSim, sim_cluster

# -- the sans-IO core ---------------------------------------------------------------------------


def test_the_snapshot_queue_keeps_the_newest_snapshot_of_each_stream() -> None:
    queue: SnapshotQueue[PendingSnapshot] = SnapshotQueue(max_snapshots=2)

    def snap(pid: str, seq: int) -> PendingSnapshot:
        return PendingSnapshot(SnapshotWrite(pid, seq, b"", None))

    a5, b3, a9, a7, c1 = snap("a", 5), snap("b", 3), snap("a", 9), snap("a", 7), snap("c", 1)
    assert queue.add(a5) is None
    assert queue.add(b3) is None
    assert queue.add(a9) is a5  # replaced
    assert queue.add(a7) is a7  # older than the one waiting: not queued
    assert queue.add(c1) is None
    assert len(queue) == 3
    assert queue.take_batch() == [a9, b3]  # first-arrival order, within max_snapshots
    assert queue.take_all() == [c1]
    with pytest.raises(ValueError, match="room for one snapshot"):
        SnapshotQueue(max_snapshots=0)


def test_the_recovery_queue_takes_batches_in_arrival_order() -> None:
    queue: RecoveryQueue[PendingRecovery] = RecoveryQueue(max_streams=2)
    waiting = [PendingRecovery(f"s{i}", i) for i in range(5)]
    for recovery in waiting:
        queue.add(recovery)
    assert queue.discard(waiting[1])
    assert not queue.discard(waiting[1])
    assert queue.take_batch() == [waiting[0], waiting[2]]
    assert queue.take_batch() == [waiting[3], waiting[4]]
    assert queue.take_batch() == []


def test_fences_and_answers_of_a_batch_are_per_stream() -> None:
    assert fence_raises([("b", 4), ("a", None), ("b", 2), ("c", 0)]) == {"b": 4, "c": 0}
    reads = group_rows(
        [
            (2, "a", 4, None, b"e4"),
            (0, "a", 4, 9, None),
            (2, "a", 3, None, b"e3"),
            (1, "a", 2, None, b"s2"),
            (0, "b", 1, None, None),
            (2, "b", 1, None, b"b1"),
        ]
    )
    assert reads["a"] == StreamRead(StreamRow(4, 9), (2, b"s2"), [(3, b"e3"), (4, b"e4")])
    answers = assemble_recoveries([("a", 9), ("a", 8), ("b", None), ("new", 3)], reads)
    assert answers[0] == Recovery((2, b"s2"), ((3, b"e3"), (4, b"e4")), 4)
    assert isinstance(answers[1], JournalFenced)
    assert answers[2] == Recovery(None, ((1, b"b1"),), 1)
    assert answers[3] == Recovery(None, (), 0)


def test_a_snapshot_plan_refuses_each_snapshot_alone() -> None:
    plan = plan_snapshots(
        [
            SnapshotWrite("a", 2, b"a2", 5),
            SnapshotWrite("a", 1, b"a1", 5),  # older than a2 of this batch: a2 is written
            SnapshotWrite("b", 4, b"b4", None),  # beyond b's last event
            SnapshotWrite("c", 1, b"c1", 1),  # below c's fence
            SnapshotWrite("new", 1, b"n1", None),  # a stream without events
        ],
        {"a": StreamRow(3, 4), "b": StreamRow(3, None), "c": StreamRow(1, 2)},
    )
    assert plan.writes == {"a": (2, b"a2")}
    assert plan.fences == {"a": 5}
    assert [None if r is None else type(r) for r in plan.refusals] == [
        None,
        None,
        JournalConflict,
        JournalFenced,
        JournalConflict,
    ]


# -- backends -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres(fsync=False) as server:
        yield server


_ids = iter(range(1 << 30))


def fresh(prefix: str = "Tally") -> str:
    return f"{prefix}|{os.getpid()}-{next(_ids)}"


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Journal]:
    journal: Journal
    if request.param == "memory":
        journal = MemoryJournal()
    elif request.param == "sqlite":
        journal = SqliteJournal(tmp_path / "journal.db")
    else:
        journal = PostgresJournal(request.getfixturevalue("postgres").dsn)
    yield journal
    await journal.aclose()


def batch_count(journal: Journal) -> int:
    """The recovery transactions the backend counted (batched reads)."""
    if isinstance(journal, MemoryJournal):
        return journal.statistics().recovery_batches
    assert isinstance(journal, SqliteJournal | PostgresJournal)
    return journal.group_commit_statistics().recovery_batches


class HeldJournal:
    """A journal whose snapshot writes wait while ``held`` (and can be made to fail)."""

    def __init__(self, inner: Journal) -> None:
        self.inner = inner
        self.held = False
        self.entered = trio.Event()
        self._release = trio.Event()
        self.calls: list[list[tuple[str, int]]] = []
        self.in_flight: dict[str, int] = {}
        self.most_in_flight = 0
        self.failing = 0

    def hold(self) -> None:
        self.held, self.entered, self._release = True, trio.Event(), trio.Event()

    def release(self) -> None:
        self.held = False
        self._release.set()

    @property
    def max_event_size(self) -> int:
        return self.inner.max_event_size

    @property
    def snapshot_every(self) -> int | None:
        return self.inner.snapshot_every

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        return await self.inner.recover(persistence_id, token)

    async def recover_many(
        self, requests: Sequence[tuple[str, int | None]]
    ) -> list[Recovery | JournalError]:
        result: list[Recovery | JournalError] = await self.inner.recover_many(requests)  # type: ignore[attr-defined]
        return result

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        await self.inner.append(persistence_id, first_seq, events, token=token)

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        await self.inner.save_snapshot(persistence_id, seq, data, token=token)

    async def save_snapshots(self, snapshots: Sequence[SnapshotWrite]) -> list[JournalError | None]:
        self.calls.append([(s.persistence_id, s.seq) for s in snapshots])
        for s in snapshots:
            self.in_flight[s.persistence_id] = self.in_flight.get(s.persistence_id, 0) + 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight[s.persistence_id])
        try:
            if self.held:
                self.entered.set()
                await self._release.wait()
            if self.failing:
                self.failing -= 1
                raise JournalError(snapshots[0].persistence_id, "injected snapshot failure")
            result: list[JournalError | None] = await self.inner.save_snapshots(snapshots)  # type: ignore[attr-defined]
            return result
        finally:
            for s in snapshots:
                self.in_flight[s.persistence_id] -= 1

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- an entity driven directly ------------------------------------------------------------------


@attrs.define
class Owner:
    """The shard an entity driven without a cluster belongs to."""

    lease_token: int | None = None
    shard_id: ShardId = attrs.field(factory=lambda: ShardId("0"))
    type_name: str = "Tally"
    sender: Any = None
    passivated: int = 0

    def passivate(self, context: EntityContext, stop_message: object = None) -> None:
        self.passivated += 1


class Tally(EventSourcedEntity[tuple[int, ...]]):
    """Keeps the numbers it was sent; ``"state"`` answers them, ``"leave"`` passivates."""

    snapshot_every: ClassVar[int | None] = 2

    def __init__(self, ctx: EntityContext, journal: Journal) -> None:
        super().__init__(ctx, journal)
        self.replayed = 0

    def empty_state(self) -> tuple[int, ...]:
        return ()

    def apply_event(self, state: tuple[int, ...], event: Any) -> tuple[int, ...]:
        self.replayed += 1
        return (*state, int(event))

    async def handle_command(self, command: Any, ctx: EntityContext) -> object:
        if command == "leave":
            ctx.passivate()
        elif command != "state":
            await self.persist(int(command))
        return self.state


def tally(
    journal: Journal, entity_id: str, token: int | None = None
) -> tuple[Tally, EntityContext]:
    ctx = EntityContext(EntityId(entity_id), Owner(lease_token=token), 0.0)
    return Tally(ctx, journal), ctx


async def drained(journal: Journal) -> None:
    with trio.fail_after(30):
        assert await journal_batcher(journal).drain(30)


async def test_a_held_snapshot_write_does_not_hold_up_the_next_command(
    backend: Journal,
) -> None:
    held = HeldJournal(backend)
    entity, ctx = tally(held, fresh().split("|")[1], token=7)
    pid = entity.persistence_id
    held.hold()
    with trio.fail_after(30):
        assert await entity.receive(1, ctx) == (1,)
        assert await entity.receive(2, ctx) == (1, 2)  # makes the snapshot at 2 due
        await held.entered.wait()  # the writer is inside save_snapshots, held there
        assert await entity.receive(3, ctx) == (1, 2, 3)  # answered while it is held
        assert await entity.receive(4, ctx) == (1, 2, 3, 4)  # the snapshot at 4 waits
    assert held.calls == [[(pid, 2)]]
    recovery = await backend.recover(pid, None)
    assert (recovery.snapshot, recovery.highest_seq) == (None, 4)  # appends went first
    held.release()
    await drained(held)
    assert held.calls == [[(pid, 2)], [(pid, 4)]]
    assert held.most_in_flight == 1  # never two snapshot writes of one stream at once
    recovery = await backend.recover(pid, None)
    assert recovery.snapshot is not None
    assert recovery.snapshot[0] == 4
    assert (recovery.events, recovery.highest_seq) == ((), 4)


async def snapshot_held_at_2(backend: Journal) -> tuple[HeldJournal, Tally, EntityContext]:
    """An entity with token 7 whose snapshot at 2 is inside the journal's writer, held there."""
    held = HeldJournal(backend)
    entity, ctx = tally(held, fresh().split("|")[1], token=7)
    held.hold()
    await entity.receive(1, ctx)
    await entity.receive(2, ctx)
    with trio.fail_after(30):
        await held.entered.wait()
    return held, entity, ctx


async def test_the_refused_snapshot_of_a_stopped_incarnation_is_not_a_warning(
    backend: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    """After a hand-off the old incarnation's queued snapshot is fenced: expected, not a fault."""
    held, entity, ctx = await snapshot_held_at_2(backend)
    pid = entity.persistence_id
    ctx._set(EntityEvent.STOP)  # the shard is handed off: the incarnation stops...
    ctx._set(EntityEvent.STOPPED)
    await backend.recover(pid, 8)  # ...and the new holder's recovery raises the fence
    with caplog.at_level(logging.DEBUG, logger=ctx.logger.name):
        held.release()
        await drained(held)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    said = [(level, text) for level, text in said if "snapshot at 2" in text]
    assert len(said) == 1
    assert said[0][0] == logging.DEBUG
    assert "snapshot at 2 of a stopped incarnation refused" in said[0][1]
    assert (await backend.recover(pid, None)).snapshot is None


async def test_a_refused_snapshot_ends_the_incarnation_and_a_failed_one_is_tried_again(
    backend: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    held, entity, ctx = await snapshot_held_at_2(backend)
    pid = entity.persistence_id
    await backend.recover(pid, 8)  # a newer holder of the shard's lease takes the stream
    with caplog.at_level(logging.WARNING):
        held.release()
        await drained(held)
    assert "snapshot at 2 refused; the incarnation ends at its next message" in caplog.text
    with pytest.raises(JournalFenced, match="token 7 is lower than 8"):
        await entity.receive(3, ctx)
    assert (await backend.recover(pid, None)).highest_seq == 2  # nothing more was written

    caplog.clear()
    other, octx = tally(held, fresh().split("|")[1], token=None)
    held.failing = 1
    with caplog.at_level(logging.WARNING):
        await other.receive(1, octx)
        await other.receive(2, octx)
        await drained(held)
    assert "snapshot at 2 failed (tried again later)" in caplog.text
    assert await other.receive(3, octx) == (1, 2, 3)  # the incarnation goes on; tries again
    await drained(held)
    stored = await backend.recover(other.persistence_id, None)
    assert stored.snapshot is not None
    assert stored.snapshot[0] == 3


async def test_batched_recoveries_give_each_entity_its_own_state_and_error(
    backend: Journal,
) -> None:
    streams = [fresh("Batch") for _ in range(40)]
    for i, pid in enumerate(streams):
        await backend.append(pid, 1, [f"{pid}:{n}".encode() for n in range(i % 5 + 1)], token=1)
        if i % 2:
            await backend.save_snapshot(pid, 1, f"{pid} at 1".encode(), token=1)
    await backend.recover(streams[7], 100)  # stream 7 has moved on to a newer holder
    batcher = JournalBatcher(backend)
    before = batch_count(backend)
    answers: dict[str, Recovery | JournalError] = {}

    async def recover(pid: str) -> None:
        try:
            answers[pid] = await batcher.recover(pid, 50)
        except JournalError as exc:
            answers[pid] = exc

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for pid in streams:
                nursery.start_soon(recover, pid)
    for i, pid in enumerate(streams):
        answer = answers[pid]
        if i == 7:
            assert isinstance(answer, JournalFenced), answer
            assert answer.persistence_id == pid
            continue
        assert isinstance(answer, Recovery), answer
        events = [(n + 1, f"{pid}:{n}".encode()) for n in range(i % 5 + 1)]
        assert answer.highest_seq == len(events)
        if i % 2:
            assert answer.snapshot == (1, f"{pid} at 1".encode())
            assert list(answer.events) == events[1:]
        else:
            assert (answer.snapshot, list(answer.events)) == (None, events)
    stats = batcher.statistics()
    assert stats.recoveries == 40
    # Forty recoveries asked at once: a first alone at most, then the rest together.
    assert stats.recovery_batches <= 3, stats
    assert stats.largest_recovery_batch >= 20, stats
    assert batch_count(backend) - before == stats.recovery_batches
    with pytest.raises(JournalFenced):  # the batch raised the fences to 50
        await backend.append(streams[0], 2, [b"stale"], token=1)


async def test_a_failed_batch_fails_each_recovery_with_an_error_naming_its_stream() -> None:
    journal = MemoryJournal()
    batcher = JournalBatcher(journal)
    streams = [fresh("Failing") for _ in range(5)]
    errors: dict[str, JournalError] = {}

    async def recover(pid: str) -> None:
        try:
            await batcher.recover(pid, None)
        except JournalError as exc:
            errors[pid] = exc

    journal.fail_next(1, reason="the disk is on fire")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for pid in streams:
                nursery.start_soon(recover, pid)
    # Asked at once, they were read in one batch, which failed: each has its own error.
    assert sorted(errors) == sorted(streams)
    for pid, error in errors.items():
        assert error.persistence_id == pid
        assert "the disk is on fire" in str(error)
        assert error.__cause__ is not None
    assert batcher.statistics().recovery_batches == 1


async def test_batched_recoveries_answer_as_recoveries_one_at_a_time(backend: Journal) -> None:
    """Random streams; the same recoveries batched (one copy) and one by one (another copy)."""
    seed = int(os.environ.get("RECOVERY_BATCH_SEED", random.randrange(2**32)))
    print(f"seed {seed} (replay: RECOVERY_BATCH_SEED={seed})")
    rng = random.Random(seed)
    run = fresh("Random").split("|")[1]
    names = [f"s{i}" for i in range(12)]

    def pid(copy: str, name: str) -> str:
        return f"Random-{run}-{copy}|{name}"

    for name in names:  # the same history in both copies
        seq, highest_token = 0, 0
        for _ in range(rng.randrange(4)):
            highest_token += rng.randrange(2)
            token = rng.choice([None, highest_token])
            count = rng.randrange(1, 4)
            for copy in "AB":
                await backend.append(
                    pid(copy, name),
                    seq + 1,
                    [f"{name}{seq + n}".encode() for n in range(count)],
                    token=token,
                )
            seq += count
            if rng.random() < 0.4:
                at = rng.randrange(1, seq + 1)
                for copy in "AB":
                    await backend.save_snapshot(
                        pid(copy, name), at, f"at {at}".encode(), token=token
                    )
    batcher = JournalBatcher(backend)
    for round_ in range(3):
        chosen = rng.sample(names, rng.randrange(1, len(names) + 1))
        tokens = {name: rng.choice([None, *range(0, 8)]) for name in chosen}
        batched: dict[str, object] = {}

        async def one(
            name: str, tokens: dict[str, int | None] = tokens, batched: dict[str, object] = batched
        ) -> None:
            try:
                batched[name] = await batcher.recover(pid("A", name), tokens[name])
            except JournalFenced:
                batched[name] = JournalFenced

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for name in chosen:
                    nursery.start_soon(one, name)
        for name in chosen:
            try:
                alone: object = await backend.recover(pid("B", name), tokens[name])
            except JournalFenced:
                alone = JournalFenced
            assert batched[name] == alone, (seed, round_, name)


# -- entities that stop with a snapshot in flight -----------------------------------------------


async def test_an_entity_stopping_with_its_snapshot_in_flight_recovers_correctly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = MemoryJournal()
    held = HeldJournal(memory)
    made: list[Tally] = []

    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        def factory(ctx: EntityContext) -> Tally:
            made.append(Tally(ctx, held))
            return made[-1]

        sim.regions[i] = await node.sharding.start(
            "Tally", factory, extractor=HashExtractor(10), settings=ShardingSettings()
        )

    async with sim_cluster(31, setup) as sim:
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("t")
        held.hold()
        assert await ref.ask(1, timeout=10) == (1,)
        assert await ref.ask(2, timeout=10) == (1, 2)
        await held.entered.wait()
        assert await ref.ask("leave", timeout=10) == (1, 2)  # stops without waiting for it
        # A new incarnation while the snapshot is still held: the events alone.
        assert await ref.ask("state", timeout=10) == (1, 2)
        assert (len(made), made[-1].replayed) == (2, 2)
        held.release()
        await drained(held)
        assert memory.snapshot("Tally|t") is not None
        assert await ref.ask("leave", timeout=10) == (1, 2)
        assert await ref.ask(3, timeout=10) == (1, 2, 3)
        assert (len(made), made[-1].replayed) == (3, 1)  # the snapshot at 2, then event 3


def test_a_snapshot_cut_short_by_the_end_of_the_run_leaves_a_recoverable_stream(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    pid: list[str] = []

    journals: list[SqliteJournal] = []

    async def first_run() -> None:
        journals.append(SqliteJournal(path))
        held = HeldJournal(journals[0])
        entity, ctx = tally(held, "cut", token=3)
        pid.append(entity.persistence_id)
        held.hold()
        for n in (1, 2, 3):
            await entity.receive(n, ctx)
        with trio.fail_after(30):
            await held.entered.wait()
        # The run ends here, the snapshot write still held: the writer task is cancelled.

    trio.run(first_run)
    trio.run(journals[0].aclose)

    async def second_run() -> None:
        journal = SqliteJournal(path)
        try:
            recovery = await journal.recover(pid[0], 3)
            assert (recovery.snapshot, recovery.highest_seq) == (None, 3)
            entity, ctx = tally(journal, "cut", token=3)
            assert await entity.receive("state", ctx) == (1, 2, 3)
            assert await entity.receive(4, ctx) == (1, 2, 3, 4)
            await drained(journal)
            assert (await journal.recover(pid[0], 3)).snapshot is not None
        finally:
            await journal.aclose()

    trio.run(second_run)
