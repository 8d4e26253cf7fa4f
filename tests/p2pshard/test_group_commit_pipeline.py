"""Batches of appends committed side by side (PostgreSQL): two in flight, never on one stream.

Under heavy load a PostgreSQL journal commits a batch while the one before it is still in
flight, on a connection of its own, so that the server writes one while the node answers the
other's appends. What must hold: a batch leaves out the streams of the batches in flight (an
append is checked only once the one before it on its stream has committed, or a batch that
reached the server first would refuse it); below the overlap threshold one batch goes at a
time, and from it on an append that arrives while one batch is in flight goes out in the free
slot; a failure fails its own batch only; and no append is ever left in the queue with nothing
to commit it. First with a journal whose storage is a dictionary and whose commits the test
holds and releases (``HeldJournal``), then against a real PostgreSQL whose row locks hold them.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from collections.abc import Iterator, Sequence

import psycopg
import pytest
import trio
import trio.testing

from p2pshard import JournalConflict, JournalError, JournalSettings, PostgresJournal
from p2pshard.persistence._group_commit import (
    AppendQueue,
    PendingAppend,
    StreamRow,
    batch_share,
    plan_batch,
    streams_of,
)
from p2pshard.persistence._threads import ThreadedJournal
from p2pshard.testing import PostgresServer, running_postgres

# --- the queue ----------------------------------------------------------------------------------


def waiting(*specs: tuple[str, int]) -> AppendQueue[PendingAppend]:
    queue: AppendQueue[PendingAppend] = AppendQueue(max_events=4, max_bytes=1 << 20)
    for pid, seq in specs:
        queue.add(PendingAppend(pid, seq, [b"e"], None))
    return queue


def taken(batch: Sequence[PendingAppend]) -> list[tuple[str, int]]:
    return [(a.persistence_id, a.first_seq) for a in batch]


def test_a_batch_leaves_the_streams_in_flight_waiting_in_their_order() -> None:
    queue = waiting(("a", 2), ("b", 1), ("a", 3), ("c", 1), ("b", 2))
    assert taken(queue.take_batch(busy={"a"})) == [("b", 1), ("c", 1), ("b", 2)]
    assert taken(queue.take_batch(busy={"a"})) == []  # only a's wait: none may go
    assert taken(queue.take_batch()) == [("a", 2), ("a", 3)]


def test_a_batch_share_caps_its_appends_and_the_limits_still_end_it() -> None:
    queue = waiting(*((f"s{i}", 1) for i in range(7)))
    assert taken(queue.take_batch(max_appends=2)) == [("s0", 1), ("s1", 1)]
    assert taken(queue.take_batch(max_appends=0)) == [("s2", 1)]  # always at least one
    assert taken(queue.take_batch(busy={"s3"})) == [("s4", 1), ("s5", 1), ("s6", 1)]
    assert taken(queue.take_batch()) == [("s3", 1)]
    queue = waiting(*((f"s{i}", 1) for i in range(6)))
    assert len(queue.take_batch(busy={"s0"}, max_appends=10)) == 4  # max_events=4 ends it
    assert taken(queue.take_batch()) == [("s0", 1), ("s5", 1)]


def test_the_share_of_a_batch_overlaps_only_under_heavy_load_and_staggers() -> None:
    def share(waiting: int, appends: int, in_flight: int, slots: int = 2) -> int | None:
        return batch_share(
            waiting=waiting,
            appends_in_flight=appends,
            in_flight=in_flight,
            slots=slots,
            overlap_from=128,
        )

    assert share(16, 0, 0) is None  # light load: all of them, one batch at a time
    assert share(16, 16, 1) == 0  # light load and a batch in flight: wait for it
    assert share(256, 0, 0) == 86  # none in flight: a third, so that the two stagger
    assert share(170, 86, 1) == 128  # one in flight: an equal half of all outstanding
    assert share(100, 128, 2) == 0  # every slot taken
    assert share(256, 0, 0, slots=1) is None  # SQLite: one batch at a time, all of them
    assert share(0, 200, 1, slots=1) == 0


# --- a journal whose commits the test holds -------------------------------------------------------


class HeldJournal(ThreadedJournal[object]):
    """Streams in a dictionary, two batches in flight at once, and commits the test holds.

    Batches overlap from ``overlap_from`` outstanding appends (1: always; the backends'
    default is :data:`p2pshard.persistence._group_commit.OVERLAP_FROM`). A batch with a stream in
    ``held`` waits in its thread, before it reads anything, until the test releases that
    stream; ``entered`` tells which streams' batches got there. Each batch is checked as the
    SQL backends check theirs (``plan_batch`` against the stored rows, under a
    lock), so a batch that overtook an earlier one of its stream would be refused.
    """

    _commits_at_once = 2

    def __init__(self, *, thread_delay: float = 0.0, seed: int = 0, overlap_from: int = 1) -> None:
        super().__init__(JournalSettings(operation_timeout=30.0), 4)
        self._overlap_from = overlap_from  # from the first append on, unless a test says
        self.rows: dict[str, StreamRow] = {}
        self.stored: dict[str, list[int]] = {}
        self.batches: list[list[tuple[str, int]]] = []
        self.held: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}
        self.failing: set[str] = set()
        self._lock = threading.Lock()
        self._delay = thread_delay
        self._rng = random.Random(seed)
        self.creation = threading.Event()
        """Set: the tables are created at once; cleared, creating them waits until it is set."""
        self.creation.set()

    def _describe(self) -> str:
        return "held journal"

    def _connect(self) -> object:
        return object()

    def _close(self, conn: object) -> None:
        pass

    def _create(self, conn: object) -> None:
        assert self.creation.wait(20), "the test never let the tables be created"

    def hold(self, pid: str) -> None:
        self.held[pid] = threading.Event()
        self.entered[pid] = threading.Event()

    async def reached(self, pid: str) -> None:
        """Until a batch with ``pid`` waits at its hold."""
        assert await trio.to_thread.run_sync(self.entered[pid].wait, 10), pid

    def release(self, pid: str) -> None:
        self.held.pop(pid).set()

    def _write_batch(
        self, conn: object, batch: Sequence[PendingAppend]
    ) -> list[JournalError | None]:
        for pid in streams_of(batch):
            if pid in self.held:
                self.entered[pid].set()
                assert self.held[pid].wait(20), f"the test never released {pid}"
        if self._delay:
            with self._lock:
                pause = self._rng.uniform(0, self._delay)
            threading.Event().wait(pause)
        with self._lock:
            if self.failing & {a.persistence_id for a in batch}:
                raise OSError("injected failure")
            plan = plan_batch(batch, {p: self.rows[p] for p in streams_of(batch) if p in self.rows})
            self.rows.update(plan.streams)
            for pid, seq, _ in plan.events:
                self.stored.setdefault(pid, []).append(seq)
            self.batches.append([(a.persistence_id, a.first_seq) for a in batch])
            return plan.refusals


async def started(nursery: trio.Nursery, journal: HeldJournal, pid: str, seq: int) -> trio.Event:
    """Start an append; the event is set when it is acknowledged."""
    done = trio.Event()

    async def append() -> None:
        await journal.append(pid, seq, [b"e"], token=None)
        done.set()

    nursery.start_soon(append)
    await trio.testing.wait_all_tasks_blocked()
    return done


async def test_a_second_batch_commits_beside_the_first_without_its_streams() -> None:
    journal = HeldJournal()
    journal.hold("lone")
    journal.hold("x")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            lone = await started(nursery, journal, "lone", 1)  # commits alone, held
            await journal.reached("lone")
            x1 = await started(nursery, journal, "x", 1)  # in the free slot, beside it: held
            await journal.reached("x")
            z1 = await started(nursery, journal, "z", 1)  # both slots taken: waits
            journal.release("lone")
            await lone.wait()
            await z1.wait()  # in the slot lone left
            x2 = await started(nursery, journal, "x", 2)  # x is in flight: it waits
            y1 = await started(nursery, journal, "y", 1)  # in the free slot, beside x 1
            await y1.wait()
            assert not x1.is_set()
            assert not x2.is_set()
            journal.release("x")
            await x2.wait()
    assert journal.batches == [[("lone", 1)], [("z", 1)], [("y", 1)], [("x", 1)], [("x", 2)]]
    assert journal.stored["x"] == [1, 2]
    statistics = journal.group_commit_statistics()
    assert statistics.most_in_flight == 2
    assert statistics.refused == 0


async def test_under_light_load_one_batch_goes_at_a_time() -> None:
    """Below ``overlap_from`` outstanding appends a batch waits for the one in flight (at light
    load a batch costs mostly its round trip and fsync, so fewer and fuller batches are
    cheaper); from it on, the next goes out beside it with its share of the appends."""
    journal = HeldJournal(overlap_from=8)
    journal.hold("lone")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            lone = await started(nursery, journal, "lone", 1)
            await journal.reached("lone")
            light = [await started(nursery, journal, f"a{i}", 1) for i in range(3)]
            await trio.sleep(0.1)
            assert not any(done.is_set() for done in light)  # 4 outstanding: they wait
            assert journal.group_commit_statistics().most_in_flight == 1
            heavy = [await started(nursery, journal, f"b{i}", 1) for i in range(4)]
            for done in light + heavy[:1]:  # 8 outstanding: a share of 4 goes beside lone
                await done.wait()
            assert not any(done.is_set() for done in heavy[1:])
            assert not lone.is_set()
            journal.release("lone")
    assert journal.batches[0] == [("a0", 1), ("a1", 1), ("a2", 1), ("b0", 1)]  # before lone
    assert journal.group_commit_statistics().most_in_flight == 2


async def test_a_failing_batch_fails_alone_and_the_one_beside_it_commits() -> None:
    journal = HeldJournal()
    journal.hold("bad")
    journal.failing.add("bad")
    outcomes: dict[str, BaseException | None] = {}
    good_done = trio.Event()

    async def append(pid: str, seq: int) -> None:
        try:
            await journal.append(pid, seq, [b"e"], token=None)
            outcomes[pid] = None
        except JournalError as exc:
            outcomes[pid] = exc
        if pid == "good":
            good_done.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(append, "bad", 1)
            await journal.reached("bad")
            nursery.start_soon(append, "good", 1)  # beside it
            await good_done.wait()
            assert outcomes == {"good": None}
            journal.release("bad")
    assert "injected failure" in str(outcomes["bad"])
    assert journal.stored == {"good": [1]}
    journal.failing.clear()
    # Nothing was written: the retry starts at 1.
    await journal.append("bad", 1, [b"again"], token=None)
    assert journal.stored == {"good": [1], "bad": [1]}


async def test_appends_issued_ahead_on_one_stream_are_checked_in_order_never_refused() -> None:
    """Writers each issue their stream's appends without waiting for the ones before, while
    commits take random time: with two batches in flight, an append must still be checked only
    after the one before it on its stream, or the batch that got there first would refuse it.
    And no append may be left waiting with nothing to commit it (the test ends)."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    journal = HeldJournal(thread_delay=0.002, seed=seed)
    streams = [f"w{i}" for i in range(24)]
    per_stream = 30
    refused: list[tuple[str, int, JournalError]] = []

    async def one(
        pid: str, seq: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()  # and on, without a checkpoint, until the append is queued
        try:
            await journal.append(pid, seq, [b"e"], token=None)
        except JournalError as exc:
            refused.append((pid, seq, exc))

    async def writer(pid: str, nursery: trio.Nursery) -> None:
        for seq in range(1, per_stream + 1):
            await nursery.start(one, pid, seq)  # queued in the order issued
            for _ in range(rng.randrange(4)):  # arrivals spread over scheduling rounds
                await trio.lowlevel.checkpoint()
            if rng.random() < 0.1:
                await trio.sleep(rng.uniform(0, 0.003))

    with trio.fail_after(60):  # the first appends wait for the tables, the others line up
        async with trio.open_nursery() as nursery:
            for pid in streams:
                nursery.start_soon(writer, pid, nursery)
    assert refused == [], (seed, refused[:3])
    assert journal.stored == {pid: list(range(1, per_stream + 1)) for pid in streams}, seed
    assert journal.group_commit_statistics().most_in_flight == 2, seed


async def test_appends_waiting_for_the_tables_are_not_overtaken_by_later_ones() -> None:
    """Appends issued ahead on one stream while the tables are being created, and the next one
    issued the moment they exist: all go out in the order issued. The later one used to pass
    those still in line for the tables and was refused as out of sequence."""
    for _ in range(5):
        journal = HeldJournal()
        journal.creation.clear()
        outcomes = await issue_around_the_tables(journal)
        assert outcomes == dict.fromkeys((1, 2, 3, 4)), outcomes
        assert journal.stored == {"s": [1, 2, 3, 4]}


async def issue_around_the_tables(journal: HeldJournal) -> dict[int, JournalError | None]:
    """Appends 1 to 3 on stream ``s`` while the tables wait, 4 the moment they exist."""
    outcomes: dict[int, JournalError | None] = {}

    async def one(seq: int, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()  # and on, without a checkpoint, into the append
        try:
            await journal.append("s", seq, [b"e"], token=None)
            outcomes[seq] = None
        except JournalError as exc:
            outcomes[seq] = exc

    async def the_moment_they_exist(nursery: trio.Nursery) -> None:
        while not journal._ready:
            await trio.lowlevel.checkpoint()
        await nursery.start(one, 4)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for seq in (1, 2, 3):  # 1 creates the tables; 2 and 3 wait for them
                await nursery.start(one, seq)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(the_moment_they_exist, nursery)
            journal.creation.set()
    return outcomes


async def test_no_append_is_stranded_when_the_committer_ends() -> None:
    """Appends that arrive at every scheduling round around the moment the committer finds the
    queue empty and ends: each is committed (one arriving while it ended used to wait for ever)."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    journal = HeldJournal(seed=seed)
    streams = [f"s{i}" for i in range(8)]
    sequence = dict.fromkeys([*streams, "late"], 0)

    async def burst(pid: str) -> None:
        sequence[pid] += 1
        await journal.append(pid, sequence[pid], [b"e"], token=None)

    for _ in range(600):
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for pid in rng.sample(streams, rng.randrange(1, 5)):
                    nursery.start_soon(burst, pid)
                for _ in range(rng.randrange(12)):
                    await trio.lowlevel.checkpoint()
                nursery.start_soon(burst, "late")
    assert journal.stored["late"] == list(range(1, sequence["late"] + 1)), seed


# --- a real PostgreSQL ----------------------------------------------------------------------------

_ids = itertools.count()


def fresh_id(name: str) -> str:
    return f"Pipeline|{os.getpid()}-{next(_ids)}-{name}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres(fsync=False) as server:
        yield server


class OverlappingJournal(PostgresJournal):
    """A PostgreSQL journal that sends a batch beside another from the first append on."""

    _overlap_from = 1


class RowLock:
    """Another connection holding a stream's row lock, so that the batch with it waits."""

    def __init__(self, dsn: str, pid: str) -> None:
        self._db = psycopg.connect(dsn)
        self._db.execute(
            "SELECT 1 FROM p2pshard_journal_streams WHERE persistence_id = %s FOR UPDATE", (pid,)
        )

    def release(self) -> None:
        if not self._db.closed:
            self._db.rollback()
            self._db.close()


async def test_postgresql_commits_a_batch_while_the_one_before_waits_for_a_row_lock(
    postgres: PostgresServer,
) -> None:
    journal = OverlappingJournal(postgres.dsn, operation_timeout=20.0)
    lone, x, y, z = (fresh_id(name) for name in ("lone", "x", "y", "z"))
    for pid in (lone, x):
        await journal.append(pid, 1, [b"row"], token=None)
    acked: list[tuple[str, int]] = []
    lone_done, three_done = trio.Event(), trio.Event()

    async def append(pid: str, seq: int) -> None:
        await journal.append(pid, seq, [f"{pid} {seq}".encode()], token=None)
        acked.append((pid, seq))
        if pid == lone:
            lone_done.set()
        if len(acked) == 3:
            three_done.set()

    lone_lock, x_lock = RowLock(postgres.dsn, lone), RowLock(postgres.dsn, x)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, lone, 2)  # alone, waits for lone's row
                await trio.sleep(0.2)
                nursery.start_soon(append, x, 2)  # beside it, waits for x's row
                await trio.sleep(0.2)
                await trio.to_thread.run_sync(lone_lock.release)
                await lone_done.wait()
                nursery.start_soon(append, x, 3)  # x is in flight: waits for x 2
                nursery.start_soon(append, y, 1)  # goes beside x 2, and commits
                nursery.start_soon(append, z, 1)
                await three_done.wait()
                assert sorted(acked) == sorted([(lone, 2), (y, 1), (z, 1)])
                await trio.sleep(0.2)
                assert len(acked) == 3  # x 2 and x 3 wait for x's row
                await trio.to_thread.run_sync(x_lock.release)
    finally:
        lone_lock.release()
        x_lock.release()
    assert acked[-2:] == [(x, 2), (x, 3)]
    assert journal.group_commit_statistics().most_in_flight == 2
    events = (await journal.recover(x, None)).events
    assert [seq for seq, _ in events] == [1, 2, 3]
    with pytest.raises(JournalConflict, match="highest stored is 3"):
        await journal.append(x, 3, [b"again"], token=None)
    await journal.aclose()
