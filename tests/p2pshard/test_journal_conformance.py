"""The journal conformance kit: the same tests against every backend (memory, SQLite, PostgreSQL).

What every :class:`p2pshard.Journal` must give :class:`p2pshard.EventSourcedEntity`: events
numbered 1..n without gaps, read back in order after a snapshot; appends that are all or nothing;
one winner when writers race for a sequence number (tasks, and for the shared backends
processes); fencing by token per persistence id; durability across a close and reopen; and a
:class:`p2pshard.JournalError` naming the persistence id, cause chained, when the storage fails.

The PostgreSQL tests run against a real server started once for the module
(``p2pshard/testing/_postgres.py``).
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import attrs
import psycopg
import pytest
import trio

from p2pshard import (
    ConfigurationError,
    EventTooLarge,
    Journal,
    JournalConflict,
    JournalError,
    JournalFenced,
    MemoryJournal,
    PostgresJournal,
    SqliteJournal,
)
from p2pshard.testing import PostgresServer, running_postgres

POISON = b"poison: the test trigger aborts the transaction that inserts this"

_ids = itertools.count()


def fresh_id() -> str:
    """A persistence id no other test used (the PostgreSQL server is shared by the module)."""
    return f"Kit|{os.getpid()}-{next(_ids)}"


@attrs.define
class Kit:
    """One backend under test and the ways to reach, break and lock it."""

    kind: str
    open: Callable[..., Journal]
    """A new journal object on the same storage; keyword arguments tune it."""
    where: str
    """The file or connection string, for worker processes."""
    broken: Callable[[], Journal]
    """A journal whose storage fails."""
    lock: Callable[[str], AbstractContextManager[None]] | None
    """Inside it, another writer holds the lock that calls on the stream need (None: memory)."""
    poison: Callable[[], None] | None
    """Makes the storage abort a transaction in the middle when it inserts POISON."""
    journals: list[Journal] = attrs.field(factory=list)

    def journal(self, **tuning: object) -> Journal:
        journal = self.open(**tuning)
        self.journals.append(journal)
        return journal


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres(fsync=False) as server:
        yield server


def _sqlite_kit(tmp_path: Path) -> Kit:
    path = tmp_path / "journal.db"

    def broken() -> Journal:
        garbage = tmp_path / "not-a-db"
        garbage.write_bytes(b"this is not a database" * 100)
        return SqliteJournal(garbage)

    @contextmanager
    def lock(persistence_id: str) -> Iterator[None]:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")  # every other writer waits, then gives up
        try:
            yield
        finally:
            db.execute("ROLLBACK")
            db.close()

    def poison() -> None:
        with sqlite3.connect(path, isolation_level=None) as db:
            db.execute(
                "CREATE TRIGGER IF NOT EXISTS poison BEFORE INSERT ON p2pshard_journal_events "
                "WHEN NEW.payload = ? BEGIN SELECT RAISE(ABORT, 'injected failure'); END".replace(
                    "?", "X'" + POISON.hex() + "'"
                )
            )
        db.close()

    return Kit(
        "sqlite",
        lambda **tuning: SqliteJournal(path, **tuning),
        str(path),
        broken,
        lock,
        poison,
    )


def _postgres_kit(server: PostgresServer) -> Kit:
    @contextmanager
    def lock(persistence_id: str) -> Iterator[None]:
        with psycopg.connect(server.dsn) as db, db.transaction():
            db.execute(
                "SELECT 1 FROM p2pshard_journal_streams WHERE persistence_id = %s FOR UPDATE",
                (persistence_id,),
            )
            yield

    def poison() -> None:
        with psycopg.connect(server.dsn, autocommit=True) as db:
            db.execute(
                "CREATE OR REPLACE FUNCTION p2pshard_test_poison() RETURNS trigger AS $$ "
                f"BEGIN IF NEW.payload = '\\x{POISON.hex()}'::bytea THEN "
                "RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$ "
                "LANGUAGE plpgsql"
            )
            db.execute(
                "CREATE OR REPLACE TRIGGER poison BEFORE INSERT ON p2pshard_journal_events "
                "FOR EACH ROW EXECUTE FUNCTION p2pshard_test_poison()"
            )

    closed_port = f"host=127.0.0.1 port={server.port} user=nobody-here dbname=nothing"
    return Kit(
        "postgresql",
        lambda **tuning: PostgresJournal(server.dsn, **tuning),
        server.dsn,
        lambda: PostgresJournal(closed_port, operation_timeout=3.0),
        lock,
        poison,
    )


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
async def kit(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Kit]:
    kind = request.param
    if kind == "memory":
        shared = MemoryJournal()

        def open_memory(**tuning: object) -> Journal:
            return MemoryJournal(**tuning) if tuning else shared  # type: ignore[arg-type]

        def broken_memory() -> Journal:
            journal = MemoryJournal()
            journal.fail_next(100, reason="the disk is on fire")
            return journal

        made = Kit("memory", open_memory, "", broken_memory, None, None)
    elif kind == "sqlite":
        made = _sqlite_kit(tmp_path)
    else:
        made = _postgres_kit(request.getfixturevalue("postgres"))
    yield made
    for journal in made.journals:
        await journal.aclose()


async def test_events_come_back_in_order_with_the_highest_sequence_number(kit: Kit) -> None:
    journal, pid = kit.journal(), fresh_id()
    empty = await journal.recover(pid, None)
    assert (empty.snapshot, empty.events, empty.highest_seq) == (None, (), 0)
    await journal.append(pid, 1, [b"one"], token=None)
    await journal.append(pid, 2, [b"two", b"three", b""], token=None)
    recovery = await journal.recover(pid, None)
    assert recovery.snapshot is None
    assert recovery.events == ((1, b"one"), (2, b"two"), (3, b"three"), (4, b""))
    assert recovery.highest_seq == 4
    other = await journal.recover(fresh_id(), None)  # streams are separate
    assert other.highest_seq == 0


async def test_an_append_must_continue_the_sequence(kit: Kit) -> None:
    journal, pid = kit.journal(), fresh_id()
    await journal.append(pid, 1, [b"a"], token=None)
    for wrong in (1, 3):
        with pytest.raises(JournalConflict, match=rf"{pid}.*append at sequence number {wrong}"):
            await journal.append(pid, wrong, [b"x"], token=None)
    await journal.append(pid, 2, [b"b"], token=None)
    assert [e for _, e in (await journal.recover(pid, None)).events] == [b"a", b"b"]


async def test_a_snapshot_hides_the_events_before_it(kit: Kit) -> None:
    journal, pid = kit.journal(), fresh_id()
    await journal.append(pid, 1, [b"1", b"2", b"3", b"4", b"5"], token=None)
    await journal.save_snapshot(pid, 3, b"state at 3", token=None)
    recovery = await journal.recover(pid, None)
    assert recovery.snapshot == (3, b"state at 3")
    assert recovery.events == ((4, b"4"), (5, b"5"))
    assert recovery.highest_seq == 5
    await journal.save_snapshot(pid, 2, b"older", token=None)  # ignored: not newer
    await journal.save_snapshot(pid, 5, b"state at 5", token=None)
    recovery = await journal.recover(pid, None)
    assert (recovery.snapshot, recovery.events, recovery.highest_seq) == (
        (5, b"state at 5"),
        (),
        5,
    )
    with pytest.raises(JournalConflict, match="snapshot at sequence number 6 is beyond"):
        await journal.save_snapshot(pid, 6, b"from the future", token=None)


async def test_an_oversize_event_refuses_the_whole_batch_before_writing(kit: Kit) -> None:
    journal, pid = kit.journal(max_event_size=100), fresh_id()
    with pytest.raises(EventTooLarge, match=rf"event 2 of '{pid}' encodes to 101 bytes.*100"):
        await journal.append(pid, 1, [b"x" * 100, b"y" * 101, b"z"], token=None)
    with pytest.raises(EventTooLarge, match="snapshot at 1"):
        await journal.save_snapshot(pid, 1, b"s" * 101, token=None)
    assert (await journal.recover(pid, None)).highest_seq == 0
    await journal.append(pid, 1, [b"x" * 100], token=None)  # at the limit: fine


async def test_a_failure_in_the_middle_of_a_batch_writes_none_of_it(kit: Kit) -> None:
    if kit.poison is None:
        pytest.skip("the memory journal applies a batch in one step: it cannot fail half-way")
    journal, pid = kit.journal(), fresh_id()
    await journal.append(pid, 1, [b"before"], token=None)  # creates the tables
    kit.poison()
    with pytest.raises(JournalError, match="injected failure") as caught:
        await journal.append(pid, 2, [b"a", b"b", POISON, b"c"], token=None)
    assert caught.value.__cause__ is not None
    assert pid in str(caught.value)
    recovery = await journal.recover(pid, None)
    assert recovery.events == ((1, b"before"),)
    assert recovery.highest_seq == 1
    await journal.append(pid, 2, [b"a", b"b"], token=None)  # the journal still works
    assert (await journal.recover(pid, None)).highest_seq == 3


async def test_two_writers_racing_for_a_sequence_number_one_wins(kit: Kit) -> None:
    first, second, pid = kit.journal(), kit.journal(), fresh_id()
    assert (await first.recover(pid, None)).highest_seq == 0
    assert (await second.recover(pid, None)).highest_seq == 0
    await first.append(pid, 1, [b"first"], token=None)
    with pytest.raises(JournalConflict, match=f"{pid}.*highest stored is 1"):
        await second.append(pid, 1, [b"second", b"more"], token=None)
    assert (await second.recover(pid, None)).events == ((1, b"first"),)


async def test_recovery_with_a_token_fences_off_lower_tokens(kit: Kit) -> None:
    journal, pid = kit.journal(), fresh_id()
    await journal.append(pid, 1, [b"by 3"], token=3)
    recovery = await journal.recover(pid, 5)  # a new holder with token 5 takes over
    assert recovery.highest_seq == 1
    with pytest.raises(JournalFenced, match=rf"{pid}.*token 4 is lower than 5"):
        await journal.append(pid, 2, [b"stale"], token=4)
    with pytest.raises(JournalFenced):
        await journal.save_snapshot(pid, 1, b"stale snapshot", token=4)
    with pytest.raises(JournalFenced):
        await journal.recover(pid, 4)  # a stale holder cannot even recover
    assert (await journal.recover(pid, None)).events == ((1, b"by 3"),)
    await journal.append(pid, 2, [b"by 5"], token=5)
    await journal.append(pid, 3, [b"no token"], token=None)  # None: leases off, not checked
    await journal.append(pid, 4, [b"by 7"], token=7)  # a higher token raises the fence too
    with pytest.raises(JournalFenced, match="token 5 is lower than 7"):
        await journal.append(pid, 5, [b"by 5 again"], token=5)
    recovery = await journal.recover(pid, None)
    assert [e for _, e in recovery.events] == [b"by 3", b"by 5", b"no token", b"by 7"]


async def test_fences_are_per_persistence_id(kit: Kit) -> None:
    journal, a, b = kit.journal(), fresh_id(), fresh_id()
    await journal.recover(a, 10)
    await journal.append(b, 1, [b"b with 2"], token=2)  # b's fence is not a's
    with pytest.raises(JournalFenced):
        await journal.append(a, 1, [b"a with 2"], token=2)


async def test_concurrent_appends_have_one_winner_per_sequence_number(kit: Kit) -> None:
    journal, pid = kit.journal(), fresh_id()
    outcomes: list[str] = []

    async def race(i: int) -> None:
        try:
            await journal.append(pid, 1, [f"racer {i}".encode()], token=None)
            outcomes.append("won")
        except JournalConflict:
            outcomes.append("conflict")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(race, i)
    assert sorted(outcomes) == ["conflict"] * 9 + ["won"]

    acknowledged: list[tuple[int, bytes]] = []

    async def writer(w: int) -> None:
        for i in range(10):
            payload = f"w{w}-{i}".encode()
            while True:
                highest = (await journal.recover(pid, None)).highest_seq
                try:
                    await journal.append(pid, highest + 1, [payload], token=None)
                except JournalConflict:
                    continue
                acknowledged.append((highest + 1, payload))
                break

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for w in range(6):
                nursery.start_soon(writer, w)
    events = (await journal.recover(pid, None)).events
    assert [seq for seq, _ in events] == list(range(1, 62))
    assert sorted(events[1:]) == sorted(acknowledged)


async def test_processes_appending_to_one_stream_lose_and_double_nothing(
    kit: Kit, tmp_path: Path
) -> None:
    if kit.kind == "memory":
        pytest.skip("the memory journal lives in one process")
    pid, out = fresh_id(), tmp_path / "acknowledged.txt"
    workers, count = 4, 15

    async def worker(i: int) -> None:
        command = [sys.executable, "-m", "tests._support.journal_worker", kit.kind, kit.where]
        done = await trio.run_process(
            [*command, pid, f"p{i}", str(count), str(out)], capture_stderr=True, check=False
        )
        assert done.returncode == 0, done.stderr.decode()

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(workers):
                nursery.start_soon(worker, i)
    acknowledged = sorted(
        (int(seq), payload.encode())
        for seq, payload in (line.split() for line in out.read_text().splitlines())
    )
    events = (await kit.journal().recover(pid, None)).events
    assert list(events) == acknowledged
    assert [seq for seq, _ in events] == list(range(1, workers * count + 1))
    assert len({payload for _, payload in events}) == workers * count


async def test_a_closed_and_reopened_journal_has_everything(kit: Kit) -> None:
    if kit.kind == "memory":
        pytest.skip("the memory journal is gone when closed")
    journal, pid = kit.open(), fresh_id()
    await journal.append(pid, 1, [b"1", b"2", b"3"], token=8)
    await journal.save_snapshot(pid, 2, b"at 2", token=8)
    await journal.aclose()
    with pytest.raises(JournalError, match="closed"):
        await journal.recover(pid, None)
    reopened = kit.journal()
    recovery = await reopened.recover(pid, None)
    assert (recovery.snapshot, recovery.events, recovery.highest_seq) == (
        (2, b"at 2"),
        ((3, b"3"),),
        3,
    )
    with pytest.raises(JournalFenced):  # the fence is stored too
        await reopened.append(pid, 4, [b"stale"], token=7)


async def test_a_storage_failure_is_a_journal_error_naming_the_stream(kit: Kit) -> None:
    journal, pid = kit.broken(), fresh_id()
    kit.journals.append(journal)
    for call in (
        journal.recover(pid, None),
        journal.append(pid, 1, [b"x"], token=None),
        journal.save_snapshot(pid, 1, b"x", token=None),
    ):
        with pytest.raises(JournalError) as caught:
            await call
        assert not isinstance(caught.value, JournalFenced | JournalConflict)
        assert caught.value.persistence_id == pid
        assert pid in str(caught.value)
        assert caught.value.__cause__ is not None


async def test_a_locked_stream_times_out_with_a_journal_error(kit: Kit) -> None:
    if kit.lock is None:
        pytest.skip("nothing holds locks in the memory journal")
    journal, pid = kit.journal(operation_timeout=0.5), fresh_id()
    await journal.append(pid, 1, [b"a"], token=None)
    with kit.lock(pid), trio.fail_after(10):
        with pytest.raises(JournalError, match=pid) as caught:
            await journal.append(pid, 2, [b"b"], token=None)
        assert not isinstance(caught.value, JournalFenced | JournalConflict)
    await trio.sleep(1.0)  # long enough for an abandoned append to have landed, were there one
    assert (await journal.recover(pid, None)).highest_seq == 1  # the lock wait gave up: no write
    await journal.append(pid, 2, [b"b"], token=None)  # free again


async def test_bad_arguments_are_refused_before_any_io(kit: Kit) -> None:
    journal = kit.journal()
    with pytest.raises(ValueError, match="non-empty string"):
        await journal.recover("", None)
    with pytest.raises(TypeError, match="fencing token"):
        await journal.recover("x", "5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one event"):
        await journal.append("x", 1, [], token=None)
    with pytest.raises(ValueError, match="first_seq"):
        await journal.append("x", 0, [b"a"], token=None)
    with pytest.raises(TypeError, match="must be bytes, not str"):
        await journal.append("x", 1, ["text"], token=None)  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="max_event_size = 0 is invalid"):
        kit.open(max_event_size=0)
