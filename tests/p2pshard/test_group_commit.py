"""Group commit in the SQL journals: many appends per transaction, each answered alone.

The sans-IO core (``p2pshard.persistence._group_commit``) first, without a database: the
queue's limits and order, and the per-append rules of a batch, checked against the memory
journal applying the same appends one by one. Then each SQL backend (SQLite, and a real
PostgreSQL started for the module): a batch in which one append is fenced and one out of
sequence (the others commit), a storage failure in the middle of a batch (a trigger that
aborts; for SQLite also a real write error, ``prlimit`` on a writer process) that fails the
whole batch while a retry writes everything once, and kill -9 of a writer process in the middle
of heavy group-committed appends, which loses no acknowledged event.
"""

from __future__ import annotations

import itertools
import os
import random
import resource
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import psycopg
import pytest
import trio
import trio.testing

from p2pshard import (
    ConfigurationError,
    JournalConflict,
    JournalError,
    JournalFenced,
    JournalSettings,
    MemoryJournal,
    PostgresJournal,
    SnapshotWrite,
    SqliteJournal,
)
from p2pshard.persistence._group_commit import (
    AppendQueue,
    PendingAppend,
    StreamRow,
    plan_batch,
)
from p2pshard.testing import PostgresServer, running_postgres
from tests._support.group_commit_worker import payload

_ids = itertools.count()

SqlJournal = SqliteJournal | PostgresJournal


def fresh_id(name: str) -> str:
    """A persistence id no other test used (the PostgreSQL server is shared by the module)."""
    return f"GroupCommit|{os.getpid()}-{next(_ids)}-{name}"


# --- the sans-IO core -----------------------------------------------------------------------------


def appends(*specs: tuple[str, int, int, int | None]) -> list[PendingAppend]:
    """``(stream, first_seq, events, token)`` each; events of 10 bytes."""
    return [PendingAppend(s, first, [b"0123456789"] * n, token) for s, first, n, token in specs]


def test_a_batch_takes_the_oldest_appends_within_the_limits() -> None:
    queue: AppendQueue[PendingAppend] = AppendQueue(max_events=5, max_bytes=1000)
    a, b, c, d = appends(("a", 1, 2, None), ("b", 1, 3, None), ("c", 1, 1, None), ("d", 1, 1, None))
    for append in (a, b, c, d):
        queue.add(append)
    assert queue.take_batch() == [a, b]  # c would make 6 events: it waits, and d behind it
    assert queue.take_batch() == [c, d]
    assert queue.take_batch() == []

    by_bytes: AppendQueue[PendingAppend] = AppendQueue(max_events=1000, max_bytes=25)
    big, small = appends(("big", 1, 4, None), ("small", 1, 1, None))
    by_bytes.add(big)
    by_bytes.add(small)
    assert by_bytes.take_batch() == [big]  # above the limit alone: it goes, alone
    assert by_bytes.take_batch() == [small]

    e, f = appends(("e", 1, 1, None), ("f", 1, 1, None))
    queue.add(e)
    queue.add(f)
    assert queue.discard(e)  # a cancelled append leaves the queue
    assert not queue.discard(e)
    assert queue.head() is f
    with pytest.raises(ValueError, match="room for one event"):
        AppendQueue(max_events=0, max_bytes=1)


def test_each_append_of_a_batch_is_checked_alone_in_order() -> None:
    stored = {"fenced": StreamRow(3, 7), "behind": StreamRow(4, None)}
    batch = appends(
        ("new", 1, 2, 1),
        ("fenced", 4, 1, 6),  # token 6 < fence 7
        ("behind", 4, 1, None),  # the stream is at 4: 4 is taken
        ("new", 3, 1, 2),  # continues the first append of this batch, raises the fence to 2
        ("new", 5, 1, 2),  # a gap
        ("new", 4, 1, 1),  # fenced by the fence this batch raised
        ("behind", 5, 1, 9),  # fine: raises the fence to 9
    )
    plan = plan_batch(batch, stored)
    kinds = [None if r is None else type(r) for r in plan.refusals]
    assert kinds == [
        None,
        JournalFenced,
        JournalConflict,
        None,
        JournalConflict,
        JournalFenced,
        None,
    ]
    assert "token 6 is lower than 7" in str(plan.refusals[1])
    assert "append at sequence number 4, but the highest stored is 4" in str(plan.refusals[2])
    assert [(pid, seq) for pid, seq, _ in plan.events] == [
        ("new", 1),
        ("new", 2),
        ("new", 3),
        ("behind", 5),
    ]
    assert plan.streams == {"new": StreamRow(3, 2), "behind": StreamRow(5, 9)}


def test_a_refused_append_changes_nothing_not_even_the_fence() -> None:
    plan = plan_batch(appends(("s", 9, 1, 50)), {"s": StreamRow(2, 10)})  # conflict, token 50
    assert isinstance(plan.refusals[0], JournalConflict)
    assert (plan.events, plan.streams) == ([], {})


async def test_a_batch_has_the_outcomes_of_its_appends_made_one_by_one() -> None:
    """Random batches against the memory journal applying the same appends one at a time."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    streams = ["a", "b", "c"]
    model = MemoryJournal()
    stored: dict[str, StreamRow] = {}
    for _ in range(200):
        batch = [
            PendingAppend(
                s := rng.choice(streams),
                max(1, len(model.events(s)) + rng.choice([1, 1, 1, 0, 2])),
                [bytes([rng.randrange(256)])] * rng.randint(1, 3),
                rng.choice([None, rng.randint(1, 8)]),
            )
            for _ in range(rng.randint(1, 6))
        ]
        plan = plan_batch(batch, stored)
        expected: list[type[JournalError] | None] = []
        for append in batch:
            try:
                await model.append(
                    append.persistence_id, append.first_seq, append.events, token=append.token
                )
                expected.append(None)
            except JournalError as exc:
                expected.append(type(exc))
        assert [None if r is None else type(r) for r in plan.refusals] == expected, seed
        stored.update(plan.streams)
        for s in streams:
            assert stored.get(s, StreamRow(0, None)) == StreamRow(
                len(model.events(s)), model.fence(s)
            ), seed


def test_the_batch_limits_are_checked_with_clear_errors() -> None:
    for field, value in (
        ("group_commit_max_events", 0),
        ("group_commit_max_bytes", -5),
        ("connections", 0),
        ("group_commit_max_events", 2.5),
    ):
        with pytest.raises(ConfigurationError, match=f"^JournalSettings.{field} = {value} is"):
            JournalSettings(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="group_commit_max_bytes = 0 is invalid"):
        SqliteJournal("x.db", group_commit_max_bytes=0)
    assert JournalSettings().group_commit_max_events == 1000


# --- the SQL backends ---------------------------------------------------------------------------


@attrs.define
class Backend:
    kind: str
    open: Callable[..., SqlJournal]
    where: str
    lock: Callable[[], AbstractContextManager[None]]
    """Inside it, another connection holds the lock the next batch needs (for ``blocker``)."""
    poison: Callable[[bytes], None]
    """Makes the storage abort the transaction that inserts the given event."""
    cure: Callable[[], None]
    blocker: str
    journals: list[SqlJournal] = attrs.field(factory=list)

    def journal(self, **tuning: object) -> SqlJournal:
        journal = self.open(**tuning)
        self.journals.append(journal)
        return journal


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres(fsync=False) as server:
        yield server


def _sqlite(tmp_path: Path) -> Backend:
    path = tmp_path / "journal.db"

    @contextmanager
    def lock() -> Iterator[None]:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")  # the journal's next transaction waits for it
        try:
            yield
        finally:
            db.execute("ROLLBACK")
            db.close()

    def poison(event: bytes) -> None:
        with sqlite3.connect(path, isolation_level=None) as db:
            db.execute(
                "CREATE TRIGGER poison BEFORE INSERT ON p2pshard_journal_events "
                f"WHEN NEW.payload = X'{event.hex()}' "
                "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
            )
        db.close()

    def cure() -> None:
        with sqlite3.connect(path, isolation_level=None) as db:
            db.execute("DROP TRIGGER poison")
        db.close()

    return Backend(
        "sqlite",
        lambda **tuning: SqliteJournal(path, **tuning),
        str(path),
        lock,
        poison,
        cure,
        fresh_id("blocker"),
    )


def _postgres(server: PostgresServer) -> Backend:
    blocker = fresh_id("blocker")

    @contextmanager
    def lock() -> Iterator[None]:
        with psycopg.connect(server.dsn) as db, db.transaction():
            db.execute(
                "SELECT 1 FROM p2pshard_journal_streams WHERE persistence_id = %s FOR UPDATE",
                (blocker,),
            )
            yield

    def poison(event: bytes) -> None:
        with psycopg.connect(server.dsn, autocommit=True) as db:
            db.execute(
                "CREATE OR REPLACE FUNCTION p2pshard_test_poison() RETURNS trigger AS $$ "
                f"BEGIN IF NEW.payload = '\\x{event.hex()}'::bytea THEN "
                "RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$ "
                "LANGUAGE plpgsql"
            )
            db.execute(
                "CREATE OR REPLACE TRIGGER poison BEFORE INSERT ON p2pshard_journal_events "
                "FOR EACH ROW EXECUTE FUNCTION p2pshard_test_poison()"
            )

    def cure() -> None:
        with psycopg.connect(server.dsn, autocommit=True) as db:
            db.execute("DROP TRIGGER poison ON p2pshard_journal_events")

    return Backend(
        "postgresql",
        lambda **tuning: PostgresJournal(server.dsn, **tuning),
        server.dsn,
        lock,
        poison,
        cure,
        blocker,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    made = (
        _sqlite(tmp_path)
        if request.param == "sqlite"
        else _postgres(request.getfixturevalue("postgres"))
    )
    yield made
    for journal in made.journals:
        await journal.aclose()


Outcome = BaseException | None


async def one_batch(
    backend: Backend,
    journal: SqlJournal,
    calls: list[tuple[str, int, bytes, int | None]],
) -> list[Outcome]:
    """Make ``calls`` wait behind a blocked commit, so that they go out in one transaction.

    Each is ``(persistence_id, first_seq, event, token)``; started one after another, so that
    their order in the queue is theirs. Returns each one's outcome (None: acknowledged).
    """
    outcomes: list[Outcome] = [None] * len(calls)
    seq = (await journal.recover(backend.blocker, None)).highest_seq + 1
    await journal.append(backend.blocker, seq, [b"the stream row exists"], token=None)
    blocked_seq = seq + 1

    async def call(i: int) -> None:
        pid, seq, event, token = calls[i]
        try:
            await journal.append(pid, seq, [event], token=token)
        except JournalError as exc:
            outcomes[i] = exc

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            with backend.lock():
                nursery.start_soon(
                    lambda: journal.append(backend.blocker, blocked_seq, [b"blocked"], token=None)
                )
                await trio.testing.wait_all_tasks_blocked()
                before = journal.group_commit_statistics()
                for i in range(len(calls)):
                    nursery.start_soon(call, i)
                    await trio.testing.wait_all_tasks_blocked()
                assert journal.group_commit_statistics() == before  # all wait, none committed
    after = journal.group_commit_statistics()
    assert after.batches == before.batches + 1  # after the blocked one, all of them at once
    assert after.largest_batch >= len(calls)
    return outcomes


async def test_a_fenced_and_an_out_of_sequence_append_fail_alone_in_their_batch(
    backend: Backend,
) -> None:
    journal = backend.journal(operation_timeout=20.0)
    fenced, behind, twice = fresh_id("fenced"), fresh_id("behind"), fresh_id("twice")
    good = [fresh_id(f"good{i}") for i in range(5)]
    good.append(fresh_id('odd "quotes", {braces}, \\back\\slashes, NULL and ünïcødé'))
    await journal.append(fenced, 1, [b"f1"], token=3)
    await journal.recover(fenced, 5)  # a newer holder took over
    await journal.append(behind, 1, [b"b1"], token=None)
    calls: list[tuple[str, int, bytes, int | None]] = [
        (good[0], 1, b"g0", 1),
        (fenced, 2, b"stale", 4),
        (good[1], 1, b"g1", None),
        (behind, 3, b"gap", None),
        (twice, 1, b"t1", 2),
        (twice, 2, b"t2", 2),  # the same stream twice in one batch, in order
        *((pid, 1, pid.encode(), 7) for pid in good[2:]),
    ]
    outcomes = await one_batch(backend, journal, calls)
    assert isinstance(outcomes[1], JournalFenced), outcomes[1]
    assert "token 4 is lower than 5" in str(outcomes[1])
    assert fenced in str(outcomes[1])
    assert isinstance(outcomes[3], JournalConflict), outcomes[3]
    assert "append at sequence number 3, but the highest stored is 1" in str(outcomes[3])
    assert [i for i, o in enumerate(outcomes) if o is not None] == [1, 3]
    check = backend.journal()
    assert (await check.recover(fenced, None)).events == ((1, b"f1"),)
    assert (await check.recover(behind, None)).events == ((1, b"b1"),)
    assert (await check.recover(twice, None)).events == ((1, b"t1"), (2, b"t2"))
    assert (await check.recover(good[0], None)).events == ((1, b"g0"),)
    assert (await check.recover(good[1], None)).events == ((1, b"g1"),)
    for pid in good[2:]:
        assert (await check.recover(pid, None)).events == ((1, pid.encode()),)
    with pytest.raises(JournalFenced):  # the batch raised good[2]'s fence to 7
        await check.append(good[2], 2, [b"x"], token=6)


async def test_a_takeover_during_group_commits_fences_every_later_append_of_the_old_holder(
    backend: Backend,
) -> None:
    """Writers append to their streams with token 1 through one journal, in batches, while each
    stream is taken over (recovered with token 2) at a random moment: half of them through
    another journal while the writers go on, half through that same journal while no append is
    in flight (the recovery then takes the connection the commits were using from the pool). An
    append of the old holder acknowledged after the takeover would be split brain: none is,
    every writer ends fenced, and the stream holds exactly the acknowledged events."""
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    old, other = backend.journal(operation_timeout=20.0), backend.journal(operation_timeout=20.0)
    streams = [fresh_id(f"takeover{i}") for i in range(16)]
    acked: dict[str, list[int]] = {pid: [] for pid in streams}
    seen_at_takeover: dict[str, int] = {}
    fenced: set[str] = set()
    turns = trio.Semaphore(len(streams))  # a takeover that holds every turn has the pool alone
    under_way = trio.Event()  # every writer has an acknowledged append

    async def writer(pid: str) -> None:
        for seq in itertools.count(1):
            try:
                async with turns:
                    await old.append(pid, seq, [f"{pid} {seq}".encode()], token=1)
            except JournalFenced:
                fenced.add(pid)
                return
            acked[pid].append(seq)
            if all(acked.values()):
                under_way.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for pid in streams:
                nursery.start_soon(writer, pid)
            await under_way.wait()
            for k, pid in enumerate(rng.sample(streams, len(streams))):
                await trio.sleep(rng.uniform(0.002, 0.02))
                if k % 2:
                    recovery = await other.recover(pid, 2)
                else:
                    for _ in streams:
                        await turns.acquire()
                    recovery = await old.recover(pid, 2)
                    for _ in streams:
                        turns.release()
                seen_at_takeover[pid] = recovery.highest_seq
    assert fenced == set(streams), seed
    statistics = old.group_commit_statistics()
    assert statistics.largest_batch > 1, seed  # the writers' appends went out in batches
    for pid in streams:
        assert max(acked[pid]) <= seen_at_takeover[pid], (seed, pid)
        events = (await other.recover(pid, None)).events
        assert [seq for seq, _ in events] == acked[pid], (seed, pid)


async def test_a_storage_failure_fails_the_whole_batch_and_a_retry_writes_each_once(
    backend: Backend,
) -> None:
    journal = backend.journal(operation_timeout=20.0)
    pids = [fresh_id(f"s{i}") for i in range(6)]
    calls: list[tuple[str, int, bytes, int | None]] = [
        (pid, 1, f"event of {i}".encode(), None) for i, pid in enumerate(pids)
    ]
    await journal.append(pids[0], 1, [b"tables"], token=None)  # creates the tables
    calls[0] = (pids[0], 2, b"event of 0", None)
    calls.insert(3, (pids[3], 1, b"poison", None))  # in the middle of the batch
    del calls[4]
    backend.poison(b"poison")
    outcomes = await one_batch(backend, journal, calls)
    for outcome, (pid, _, _, _) in zip(outcomes, calls, strict=True):
        assert isinstance(outcome, JournalError), outcome
        assert not isinstance(outcome, JournalFenced | JournalConflict)
        assert pid in str(outcome)
        assert "injected failure" in str(outcome)
        assert outcome.__cause__ is not None
    for pid in pids:  # nothing of the batch was written
        assert (await journal.recover(pid, None)).highest_seq == (1 if pid == pids[0] else 0)
    backend.cure()
    outcomes = await one_batch(backend, journal, calls)  # the retry
    assert outcomes == [None] * len(calls)
    check = backend.journal()
    for pid, seq, event, _ in calls:
        events = (await check.recover(pid, None)).events
        assert events[-1] == (seq, event)
        assert len(events) == seq


async def test_a_batch_that_cannot_get_its_lock_fails_with_nothing_written(
    backend: Backend,
) -> None:
    journal = backend.journal(operation_timeout=0.6)
    await journal.append(backend.blocker, 1, [b"row"], token=None)
    with backend.lock(), trio.fail_after(10):
        with pytest.raises(JournalError, match=backend.blocker) as caught:
            await journal.append(backend.blocker, 2, [b"locked out"], token=None)
        assert not isinstance(caught.value, JournalFenced | JournalConflict)
    await trio.sleep(1.0)  # long enough for an abandoned commit to have landed, were there one
    assert (await journal.recover(backend.blocker, None)).highest_seq == 1
    await journal.append(backend.blocker, 2, [b"after"], token=None)  # the journal goes on
    assert journal.group_commit_statistics().failed == 1


async def test_cancelled_appenders_stop_and_an_append_cancelled_while_waiting_writes_nothing(
    backend: Backend,
) -> None:
    journal = backend.journal(operation_timeout=20.0)
    prefix = fresh_id("loop")

    async def closed_loop(t: int) -> None:
        for n in itertools.count(1):
            await journal.append(f"{prefix}-{t}", n, [b"e"], token=None)

    with trio.fail_after(15):  # every task sees the cancellation, the committing one too
        with trio.move_on_after(0.3):
            async with trio.open_nursery() as nursery:
                for t in range(32):
                    nursery.start_soon(closed_loop, t)
    assert journal.group_commit_statistics().largest_batch > 1

    await journal.append(backend.blocker, 1, [b"row"], token=None)
    cancelled, waiting = trio.CancelScope(), fresh_id("cancelled")

    async def append_then_give_up() -> None:
        with cancelled:
            await journal.append(waiting, 1, [b"never"], token=None)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            with backend.lock():
                nursery.start_soon(lambda: journal.append(backend.blocker, 2, [b"b"], token=None))
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(append_then_give_up)
                await trio.testing.wait_all_tasks_blocked()
                cancelled.cancel()
                await trio.testing.wait_all_tasks_blocked()
    assert cancelled.cancelled_caught
    assert (await journal.recover(waiting, None)).highest_seq == 0
    assert (await journal.recover(backend.blocker, None)).highest_seq == 2


# --- processes ------------------------------------------------------------------------------------


@attrs.define
class Worker:
    process: trio.Process
    lines: list[str] = attrs.field(factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for line in self.lines if line.startswith(kind + " "))

    def pairs(self, kind: str) -> list[tuple[int, int]]:
        return [
            (int(line.split()[1]), int(line.split()[2]))
            for line in self.lines
            if line.startswith(kind + " ")
        ]

    def largest_batch(self) -> int:
        stats = [line for line in self.lines if line.startswith("stats ")]
        return max((int(line.split()[3]) for line in stats), default=0)


async def read_lines(worker: Worker) -> None:
    stdout = worker.process.stdout
    assert stdout is not None
    buffer = b""
    async for chunk in stdout:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        worker.lines.extend(line.decode() for line in complete)


async def until(worker: Worker, what: Callable[[], bool], text: str) -> None:
    while not what():
        if worker.process.returncode is not None:
            raise AssertionError(f"the worker exited ({worker.process.returncode}) before {text}")
        await trio.sleep(0.05)


async def check_stored(kind: str, where: str, worker: Worker, streams: int, size: int) -> None:
    """Each stream holds 1..n in order, each event once, and every acknowledged one."""
    acknowledged: dict[int, int] = {}
    for stream, seq in worker.pairs("ok"):
        acknowledged[stream] = max(acknowledged.get(stream, 0), seq)
    journal = SqliteJournal(where) if kind == "sqlite" else PostgresJournal(where)
    try:
        for stream in range(streams):
            events = (await journal.recover(f"GC|{stream}", None)).events
            assert events == tuple(
                (seq, payload(stream, seq, size)) for seq in range(1, len(events) + 1)
            ), stream
            assert len(events) >= acknowledged.get(stream, 0), (stream, acknowledged[stream])
    finally:
        await journal.aclose()


async def run_worker(kind: str, where: str, streams: int, count: int, size: int) -> Worker:
    command = [sys.executable, "-m", "tests._support.group_commit_worker", kind, where]
    process = await trio.lowlevel.open_process(
        [*command, str(streams), str(count), str(size)], stdout=-1
    )
    return Worker(process)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_kill_9_during_heavy_group_commits_loses_no_acknowledged_event(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = (
        str(tmp_path / "journal.db")
        if kind == "sqlite"
        else request.getfixturevalue("postgres").dsn
    )
    streams, size = 64, 200
    with trio.fail_after(60):
        worker = await run_worker(kind, where, streams, 1_000_000, size)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_lines, worker)
            await until(worker, lambda: worker.count("ok") >= 3000, "3000 acknowledgements")
            # The worker reports its batches every 0.2 s; 3000 appends can take less.
            await until(worker, lambda: worker.count("stats") > 0, "a report of its batches")
            worker.process.send_signal(signal.SIGKILL)
            await worker.process.wait()
    assert worker.process.returncode == -signal.SIGKILL
    assert worker.largest_batch() > 1, "the appends were not group-committed"
    await check_stored(kind, where, worker, streams, size)


FILE_SIZE_LIMIT = 1
"""RLIMIT_FSIZE for the writer while its writes must fail: every write past byte 1 fails."""


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="limits a process's file size")
async def test_write_errors_in_a_writer_process_fail_batches_and_retries_store_each_once(
    tmp_path: Path,
) -> None:
    """Python ignores SIGXFSZ: a write past the limit fails with EFBIG, a real I/O error."""
    where, streams, count, size = str(tmp_path / "journal.db"), 16, 60, 300
    with trio.fail_after(90):
        worker = await run_worker("sqlite", where, streams, count, size)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_lines, worker)
            await until(worker, lambda: worker.count("ok") >= 100, "100 acknowledgements")
            pid = worker.process.pid
            soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, hard))
            try:
                await until(worker, lambda: worker.count("fail") >= 50, "50 failed appends")
            finally:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
            assert await worker.process.wait() == 0
    assert worker.count("ok") == streams * count
    assert worker.largest_batch() > 1, "the appends were not group-committed"
    failed = set(worker.pairs("fail"))
    assert failed <= set(worker.pairs("ok"))  # each failed append was retried and acknowledged
    await check_stored("sqlite", where, worker, streams, size)


# --- PostgreSQL: the append function against the sans-IO rules --------------------------------


def random_batch(
    rng: random.Random, streams: list[str], stored: dict[str, StreamRow], size: int
) -> list[PendingAppend]:
    """``size`` appends to ``streams``, mostly in sequence (like an entity's), some not, with
    random tokens; ``stored`` holds the streams' rows now."""
    highest = {s: stored.get(s, StreamRow(0, None)).highest for s in streams}
    batch = []
    for _ in range(size):
        pid = rng.choice(streams)
        append = PendingAppend(
            pid,
            max(1, highest[pid] + rng.choice([1, 1, 1, 1, 0, 2, -3])),
            [rng.randbytes(rng.randint(0, 3)) for _ in range(rng.randint(1, 3))],
            rng.choice([None, rng.randint(1, 8)]),
        )
        batch.append(append)
        if rng.random() < 0.8:
            highest[pid] = max(highest[pid], append.last_seq)
    return batch


def random_distinct_batch(
    rng: random.Random, streams: list[str], stored: dict[str, StreamRow]
) -> list[PendingAppend]:
    """Appends each on a stream of its own, as ``random_batch`` makes them; about half the
    batches have one event per append (the distinct function's shortest path)."""
    one_event = rng.random() < 0.5
    batch = []
    for pid in rng.sample(streams, rng.randint(2, len(streams))):
        highest = stored.get(pid, StreamRow(0, None)).highest
        batch.append(
            PendingAppend(
                pid,
                max(1, highest + rng.choice([1, 1, 1, 1, 0, 2, -3])),
                [
                    rng.randbytes(rng.randint(0, 3))
                    for _ in range(1 if one_event else rng.randint(1, 3))
                ],
                rng.choice([None, rng.randint(1, 8)]),
            )
        )
    return batch


class _Statements:
    """A connection that records the statements sent through it."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.sent: list[str] = []

    def execute(self, query: str, params: Any = None) -> Any:
        self.sent.append(query)
        return self.conn.execute(query, params)


def decisions(refusals: list[JournalError | None]) -> list[tuple[type, str] | None]:
    """Each append's outcome, comparable: None, or its refusal's type and text."""
    return [None if r is None else (type(r), str(r)) for r in refusals]


def _stored_rows(conn: psycopg.Connection[Any], streams: list[str]) -> dict[str, StreamRow]:
    return {
        pid: StreamRow(int(highest), None if fence is None else int(fence))
        for pid, highest, fence in conn.execute(
            "SELECT persistence_id, highest, fence FROM p2pshard_journal_streams "
            "WHERE persistence_id = ANY(%s)",
            (streams,),
        )
    }


async def test_the_postgresql_append_function_decides_as_plan_batch_does(
    postgres: PostgresServer,
) -> None:
    """Random batches: the server's refusals, rows and events are those ``plan_batch`` makes.

    Batches of one append go to the function for one, batches whose appends are each on a stream
    of its own to the distinct function, the others to the general one.
    """
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    journal = PostgresJournal(postgres.dsn)
    streams = [fresh_id(f"random{i}") for i in range(8)]
    await journal.recover(streams[0], None)  # creates the tables and the function
    events: dict[str, list[tuple[int, bytes]]] = {s: [] for s in streams}
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        used = {"append_one_v1": 0, "append_distinct_v1": 0, "append_v1": 0}
        for _ in range(90):
            stored = _stored_rows(conn, streams)
            shape = rng.choice(["one", "distinct", "any"])
            if shape == "distinct":
                batch = random_distinct_batch(rng, streams, stored)
            else:
                size = 1 if shape == "one" else rng.randint(len(streams) + 1, 30)
                batch = random_batch(rng, streams, stored, size)
            plan = plan_batch(batch, stored)
            spy = _Statements(conn)
            refusals = journal._write_batch(spy, batch)  # type: ignore[arg-type]
            # Which function served it: the shape's (more appends than streams repeat one).
            [function] = [f for f in used if f"p2pshard_journal_{f}(" in spy.sent[0]]
            assert function == {"one": "append_one_v1", "distinct": "append_distinct_v1"}.get(
                shape, "append_v1"
            ), seed
            used[function] += 1
            assert decisions(refusals) == decisions(plan.refusals), seed
            after = _stored_rows(conn, streams)
            for pid in streams:
                want = plan.streams.get(pid, stored.get(pid))
                assert after.get(pid, StreamRow(0, None)) == (want or StreamRow(0, None)), seed
            for pid, seq, payload in plan.events:
                events[pid].append((seq, payload))
        assert all(used.values()), (used, seed)
        for pid in streams:
            stored_events = conn.execute(
                "SELECT seq, payload FROM p2pshard_journal_events WHERE persistence_id = %s "
                "ORDER BY seq",
                (pid,),
            ).fetchall()
            assert [(int(s), bytes(p)) for s, p in stored_events] == events[pid], seed
    await journal.aclose()


async def test_the_sqlite_journal_decides_as_plan_batch_does_and_a_lone_append_reads_nothing(
    tmp_path: Path,
) -> None:
    """Random batches: the refusals, rows and events SQLite stores are those ``plan_batch`` makes.

    A lone append to a stream that has a row moves that row on with one conditional ``UPDATE``
    instead of reading it first: one that passes runs no ``SELECT``. Some streams start with a
    row that only a recovery's fence made (highest 0).
    """
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    journal = SqliteJournal(tmp_path / "journal.db")
    streams = [f"Random|{i}" for i in range(6)]
    for pid in streams[:2]:
        await journal.recover(pid, rng.randint(1, 5))  # a row: highest 0, a fence
    conn = journal._connect()
    statements: list[str] = []
    conn.set_trace_callback(statements.append)

    def stored_rows() -> dict[str, StreamRow]:
        rows = conn.execute("SELECT persistence_id, highest, fence FROM p2pshard_journal_streams")
        return {pid: StreamRow(highest, fence) for pid, highest, fence in rows}

    other = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    events: dict[str, list[tuple[int, bytes]]] = {s: [] for s in streams}
    fast = 0
    for _ in range(150):
        if rng.random() < 0.15:  # a fence raised by another connection, or by this journal
            pid, fence = rng.choice(streams), rng.randint(1, 9)
            if rng.random() < 0.5:
                other.execute(
                    "UPDATE p2pshard_journal_streams SET fence = ? WHERE persistence_id = ?",
                    (fence, pid),
                )
            else:
                journal._read_recoveries(conn, [(pid, fence)])
        stored = stored_rows()
        batch = random_batch(rng, streams, stored, rng.choice([1, 1, 1, rng.randint(2, 6)]))
        plan = plan_batch(batch, stored)
        statements.clear()
        refusals = journal._write_batch(conn, batch)
        assert decisions(refusals) == decisions(plan.refusals), seed
        if len(batch) == 1 and batch[0].persistence_id in stored and plan.refusals == [None]:
            assert not [s for s in statements if s.lstrip().upper().startswith("SELECT")], (
                seed,
                statements,
            )
            fast += 1
        after = stored_rows()
        for pid in streams:
            want = plan.streams.get(pid, stored.get(pid))
            assert after.get(pid) == want, seed
        for pid, seq, data in plan.events:
            events[pid].append((seq, data))
    assert fast > 20, seed  # the conditional update was taken often enough to mean something
    for pid in streams:
        rows = conn.execute(
            "SELECT seq, payload FROM p2pshard_journal_events WHERE persistence_id = ? "
            "ORDER BY seq",
            (pid,),
        ).fetchall()
        assert rows == events[pid], seed
    conn.close()
    other.close()
    await journal.aclose()


async def test_sqlite_batches_reuse_the_rows_they_wrote_until_anything_else_writes(
    tmp_path: Path,
) -> None:
    """A batch of appends reads no stream row that the journal's last batch left, unless
    another connection (of this process or another) or another call of this journal on the
    same connection has changed stream rows since; then it reads them, and sees the change."""
    path = tmp_path / "journal.db"
    journal, elsewhere = SqliteJournal(path), SqliteJournal(path)
    a, b, c = "Known|a", "Known|b", "Known|c"
    await journal.recover(a, None)  # creates the tables
    conn = journal._connect()
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    seq = dict.fromkeys((a, b, c), 0)

    def batch(*specs: tuple[str, int | None]) -> list[type[JournalError] | None]:
        """One append per ``(stream, token)``, each at its stream's next sequence number."""
        appends_ = [PendingAppend(pid, seq[pid] + 1, [b"e"], token) for pid, token in specs]
        statements.clear()
        refusals = journal._write_batch(conn, appends_)
        for append, refusal in zip(appends_, refusals, strict=True):
            if refusal is None:
                seq[append.persistence_id] += 1
        return [None if r is None else type(r) for r in refusals]

    def read_rows() -> bool:
        return any("FROM p2pshard_journal_streams" in s for s in statements)

    assert batch((a, 1), (b, 1), (c, 1)) == [None, None, None]
    assert read_rows()
    assert batch((a, 1), (b, 1)) == [None, None]
    assert not read_rows()  # nothing else wrote: the rows of the last batch are still stored

    await elsewhere.recover(a, 5)  # another connection raises a's fence
    assert batch((a, 1), (b, 1)) == [JournalFenced, None]
    assert read_rows()

    journal._read_recoveries(conn, [(b, 6)])  # this journal, on the same connection
    assert batch((b, 1), (c, 1)) == [JournalFenced, None]
    assert read_rows()

    snapshot = SnapshotWrite(c, seq[c], b"state", 7)  # a snapshot's higher token raises c's fence
    journal._transaction(conn, c, "snapshot", lambda db: journal._write_snapshots(db, [snapshot]))
    assert batch((c, 1), (a, 5)) == [JournalFenced, None]
    assert read_rows()

    await elsewhere.append(a, seq[a] + 1, [b"by another writer"], token=5)
    assert batch((a, 5), (b, 6)) == [JournalConflict, None]  # a's number is taken now
    assert read_rows()
    seq[a] += 1  # the other writer's event
    assert batch((a, 5), (b, 6)) == [None, None]  # the rows it read (a's refusal's too) serve
    assert not read_rows()

    poison = sqlite3.connect(path, isolation_level=None)
    poison.execute(
        "CREATE TRIGGER poison BEFORE INSERT ON p2pshard_journal_events "
        "WHEN NEW.persistence_id = 'Known|c' BEGIN SELECT RAISE(ABORT, 'injected'); END"
    )
    with pytest.raises(sqlite3.IntegrityError, match="injected"):
        batch((b, 6), (c, 7))  # fails as a whole: b's row did not move on
    poison.execute("DROP TRIGGER poison")
    poison.close()
    assert batch((b, 6), (c, 7)) == [None, None]
    assert read_rows()  # the failed batch's rows were forgotten
    recovered = await journal.recover(b, None)
    assert recovered.highest_seq == seq[b]
    conn.close()
    await journal.aclose()
    await elsewhere.aclose()


async def test_a_postgresql_database_of_the_previous_release_is_used_as_it_is(
    postgres: PostgresServer,
) -> None:
    """Tables that a release without the append function made: read, appended to, unchanged.

    The function comes with the next journal that opens the database; the tables and their
    schema version stay, so the previous release still reads and writes them.
    """
    database = f"upgrade_{os.getpid()}_{next(_ids)}"
    with psycopg.connect(postgres.dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
    dsn = postgres.dsn.replace("dbname=postgres", f"dbname={database}")
    with psycopg.connect(dsn, autocommit=True) as old:  # what the previous release made
        old.execute(
            "CREATE TABLE p2pshard_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
        )
        old.execute("INSERT INTO p2pshard_schema VALUES ('journal', 1)")
        old.execute(
            "CREATE TABLE p2pshard_journal_streams "
            "(persistence_id TEXT PRIMARY KEY, highest BIGINT NOT NULL, fence BIGINT)"
        )
        old.execute(
            "CREATE TABLE p2pshard_journal_events (persistence_id TEXT NOT NULL, "
            "seq BIGINT NOT NULL, payload BYTEA NOT NULL, PRIMARY KEY (persistence_id, seq))"
        )
        old.execute(
            "CREATE TABLE p2pshard_journal_snapshots "
            "(persistence_id TEXT PRIMARY KEY, seq BIGINT NOT NULL, payload BYTEA NOT NULL)"
        )
        old.execute("INSERT INTO p2pshard_journal_streams VALUES ('Cart|1', 2, 5)")
        old.execute(
            "INSERT INTO p2pshard_journal_events VALUES ('Cart|1', 1, 'a'), ('Cart|1', 2, 'b')"
        )
    journal = PostgresJournal(dsn)
    try:
        with pytest.raises(JournalFenced):  # the stored fence holds
            await journal.append("Cart|1", 3, [b"stale"], token=4)
        await journal.append("Cart|1", 3, [b"c"], token=5)
        await journal.append("Cart|2", 1, [b"new"], token=None)
        recovery = await journal.recover("Cart|1", None)
        assert recovery.events == ((1, b"a"), (2, b"b"), (3, b"c"))
    finally:
        await journal.aclose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT component, version FROM p2pshard_schema").fetchall() == [
            ("journal", 1)
        ]
        assert conn.execute(
            "SELECT proname FROM pg_proc WHERE proname LIKE 'p2pshard_journal_append%' "
            "ORDER BY proname"
        ).fetchall() == [
            ("p2pshard_journal_append_distinct_v1",),
            ("p2pshard_journal_append_one_v1",),
            ("p2pshard_journal_append_v1",),
        ]
        # The previous release's statements go on working on the same tables.
        conn.execute(
            "UPDATE p2pshard_journal_streams SET highest = 4 WHERE persistence_id = 'Cart|1'"
        )
        conn.execute("INSERT INTO p2pshard_journal_events VALUES ('Cart|1', 4, 'd')")
    other = f"other_{database}"  # another role, that may write the tables but owns nothing
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {other} LOGIN")
        conn.execute(f"GRANT CREATE, USAGE ON SCHEMA public TO {other}")
        conn.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {other}")
    journal = PostgresJournal(dsn.replace("user=p2pshard", f"user={other}"))
    try:
        await journal.append("Cart|1", 5, [b"e"], token=5)
        assert (await journal.recover("Cart|1", None)).highest_seq == 5
    finally:
        await journal.aclose()
    with psycopg.connect(postgres.dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE {database}")
        admin.execute(f"DROP ROLE {other}")
