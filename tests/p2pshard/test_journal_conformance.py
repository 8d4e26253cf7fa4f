"""The journal conformance kit (``p2pshard.testing.check_journal``) against every backend.

Memory (appending one at a time, and group-committing), SQLite and PostgreSQL, each check a
test of its own; and what the kit cannot do alone,
processes that append to one stream through a shared backend.

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
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import attrs
import psycopg
import pytest
import trio

from p2pshard import (
    Journal,
    MemoryJournal,
    PostgresJournal,
    Recovery,
    SqliteJournal,
)
from p2pshard.testing import JOURNAL_CHECKS, PostgresServer, check_journal, running_postgres

_ids = itertools.count()


def fresh_id() -> str:
    """A persistence id no other test used (the PostgreSQL server is shared by the module).

    Not ``Kit|...``: the kit numbers its own streams so, with a counter of its own, in the same
    database.
    """
    return f"KitTest|{os.getpid()}-{next(_ids)}"


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
    poison: Callable[[bytes], None] | None
    """Makes the storage abort a transaction in the middle when it inserts the given event."""
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

    def poison(payload: bytes) -> None:
        with sqlite3.connect(path, isolation_level=None) as db:
            db.execute(
                "CREATE TRIGGER IF NOT EXISTS poison BEFORE INSERT ON p2pshard_journal_events "
                "WHEN NEW.payload = ? BEGIN SELECT RAISE(ABORT, 'injected failure'); END".replace(
                    "?", "X'" + payload.hex() + "'"
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

    def poison(payload: bytes) -> None:
        with psycopg.connect(server.dsn, autocommit=True) as db:
            db.execute(
                "CREATE OR REPLACE FUNCTION p2pshard_test_poison() RETURNS trigger AS $$ "
                f"BEGIN IF NEW.payload = '\\x{payload.hex()}'::bytea THEN "
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


@pytest.fixture(params=["memory", "memory-group-commit", "sqlite", "postgresql"])
async def kit(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Kit]:
    kind = request.param
    if kind.startswith("memory"):
        grouped = {"group_commit": kind == "memory-group-commit"}
        shared = MemoryJournal(**grouped)

        def open_memory(**tuning: object) -> Journal:
            return MemoryJournal(**grouped, **tuning) if tuning else shared  # type: ignore[arg-type]

        def broken_memory() -> Journal:
            journal = MemoryJournal(**grouped)
            journal.fail_next(100, reason="the disk is on fire")
            return journal

        made = Kit(kind, open_memory, "", broken_memory, None, None)
    elif kind == "sqlite":
        made = _sqlite_kit(tmp_path)
    else:
        made = _postgres_kit(request.getfixturevalue("postgres"))
    yield made
    for journal in made.journals:
        await journal.aclose()


SKIPPED_FOR_MEMORY = {
    "a_failure_in_the_middle_of_a_batch_writes_none_of_it": (
        "the memory journal applies a batch in one step: it cannot fail half-way"
    ),
    "a_closed_and_reopened_journal_has_everything": "the memory journal is gone when closed",
    "a_locked_stream_times_out_with_a_journal_error": "nothing holds locks in the memory journal",
}


@pytest.mark.parametrize("check", JOURNAL_CHECKS)
async def test_the_journal_passes_the_conformance_kit(kit: Kit, check: str) -> None:
    if kit.kind.startswith("memory") and check in SKIPPED_FOR_MEMORY:
        pytest.skip(SKIPPED_FOR_MEMORY[check])
    await check_journal(
        kit.open,
        durable=not kit.kind.startswith("memory"),
        broken=kit.broken,
        lock=kit.lock,
        poison=kit.poison,
        checks=[check],
    )


async def test_processes_appending_to_one_stream_lose_and_double_nothing(
    kit: Kit, tmp_path: Path
) -> None:
    if kit.kind.startswith("memory"):
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


async def test_the_kit_refuses_unknown_checks_and_checks_it_has_no_means_for() -> None:
    with pytest.raises(ValueError, match=r"unknown journal checks \['no_such_check'\]"):
        await check_journal(MemoryJournal, checks=["no_such_check"])
    with pytest.raises(
        ValueError, match="'a_locked_stream_times_out_with_a_journal_error' needs lock"
    ):
        await check_journal(
            MemoryJournal, checks=["a_locked_stream_times_out_with_a_journal_error"]
        )


class PlainJournal:
    """A journal written for an earlier release: the :class:`Journal` methods only, no batches."""

    def __init__(self, inner: MemoryJournal) -> None:
        self._inner = inner

    @property
    def max_event_size(self) -> int:
        return self._inner.max_event_size

    @property
    def snapshot_every(self) -> int | None:
        return self._inner.snapshot_every

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        return await self._inner.recover(persistence_id, token)

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        await self._inner.append(persistence_id, first_seq, events, token=token)

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        await self._inner.save_snapshot(persistence_id, seq, data, token=token)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_journal_without_the_batch_methods_still_passes_the_kit() -> None:
    shared = PlainJournal(MemoryJournal())

    def open_plain(**tuning: object) -> Journal:
        return PlainJournal(MemoryJournal(**tuning)) if tuning else shared  # type: ignore[arg-type]

    assert not hasattr(shared, "recover_many")
    await check_journal(open_plain, durable=False)
