"""Durable stores carry a schema version (issue 22, item 5): a store an older release wrote is
read (and numbered), one a newer release wrote is refused with a clear error, untouched."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import trio

from p2pshard import JournalError, LeaseUnavailable
from p2pshard.leases._sqlite import SqliteLeaseBackend, boot_id
from p2pshard.persistence._journal import JOURNAL_SCHEMA_VERSION
from p2pshard.persistence._postgres import PostgresJournal
from p2pshard.persistence._sqlite import SqliteJournal
from p2pshard.testing import PostgresServer, running_postgres

OLD_LAYOUT = (  # the journal's tables as releases before the schema number wrote them
    "CREATE TABLE p2pshard_journal_streams (persistence_id TEXT PRIMARY KEY, "
    "highest INTEGER NOT NULL, fence INTEGER)",
    "CREATE TABLE p2pshard_journal_events (persistence_id TEXT NOT NULL, seq INTEGER NOT NULL, "
    "payload BLOB NOT NULL, PRIMARY KEY (persistence_id, seq))",
    "CREATE TABLE p2pshard_journal_snapshots (persistence_id TEXT PRIMARY KEY, "
    "seq INTEGER NOT NULL, payload BLOB NOT NULL)",
    "INSERT INTO p2pshard_journal_streams VALUES ('cart-1', 2, NULL)",
    "INSERT INTO p2pshard_journal_events VALUES ('cart-1', 1, X'61'), ('cart-1', 2, X'62')",
)


def user_version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


async def events_of(journal: SqliteJournal | PostgresJournal, persistence_id: str) -> list[bytes]:
    recovery = await journal.recover(persistence_id, None)
    return [data for _, data in recovery.events]


def test_a_new_sqlite_journal_is_numbered(tmp_path: Path) -> None:
    async def main() -> None:
        journal = SqliteJournal(tmp_path / "journal.db")
        await journal.append("cart-1", 1, [b"a"], token=None)
        await journal.aclose()

    trio.run(main)
    assert user_version(tmp_path / "journal.db") == JOURNAL_SCHEMA_VERSION == 1


def test_a_sqlite_journal_of_the_unnumbered_layout_is_read_and_numbered(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with sqlite3.connect(path) as db:
        for statement in OLD_LAYOUT:
            db.execute(statement)

    async def main() -> None:
        journal = SqliteJournal(path)
        assert await events_of(journal, "cart-1") == [b"a", b"b"]
        await journal.append("cart-1", 3, [b"c"], token=None)
        assert await events_of(journal, "cart-1") == [b"a", b"b", b"c"]
        await journal.aclose()

    trio.run(main)
    assert user_version(path) == 1


def test_a_sqlite_journal_a_newer_release_wrote_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    with sqlite3.connect(path) as db:
        for statement in OLD_LAYOUT:
            db.execute(statement)
        db.execute("PRAGMA user_version = 2")

    async def main() -> None:
        journal = SqliteJournal(path)
        with pytest.raises(JournalError) as caught:
            await journal.append("cart-1", 3, [b"c"], token=None)
        assert (
            f"sqlite journal {path} holds journal schema version 2, written by a newer p2pshard; "
            "this release reads version 1 and older" in str(caught.value)
        )
        with pytest.raises(JournalError, match="schema version 2"):  # every call, not once
            await journal.recover("cart-1", None)
        await journal.aclose()

    trio.run(main)
    assert user_version(path) == 2
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM p2pshard_journal_events").fetchone()[0] == 2


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres(fsync=False) as server:
        yield server


def reset(server: PostgresServer) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as db:
        for table in ("streams", "events", "snapshots"):
            db.execute(f"DROP TABLE IF EXISTS p2pshard_journal_{table}")
        db.execute("DROP TABLE IF EXISTS p2pshard_schema")
        for statement in OLD_LAYOUT:
            db.execute(
                statement.replace("BLOB", "BYTEA")
                .replace("X'61'", "'\\x61'::bytea")
                .replace("X'62'", "'\\x62'::bytea")
            )


def pg_version(server: PostgresServer) -> int | None:
    with psycopg.connect(server.dsn) as db:
        row = db.execute(
            "SELECT version FROM p2pshard_schema WHERE component = 'journal'"
        ).fetchone()
    return None if row is None else int(row[0])


def test_a_postgresql_journal_of_the_unnumbered_layout_is_read_and_numbered(
    postgres: PostgresServer,
) -> None:
    reset(postgres)

    async def main() -> None:
        journal = PostgresJournal(postgres.dsn)
        assert await events_of(journal, "cart-1") == [b"a", b"b"]
        await journal.aclose()

    trio.run(main)
    assert pg_version(postgres) == 1


def test_a_postgresql_journal_a_newer_release_wrote_is_refused_and_left_alone(
    postgres: PostgresServer,
) -> None:
    reset(postgres)
    with psycopg.connect(postgres.dsn, autocommit=True) as db:
        db.execute("CREATE TABLE p2pshard_schema (component TEXT PRIMARY KEY, version INTEGER)")
        db.execute("INSERT INTO p2pshard_schema VALUES ('journal', 3)")

    async def main() -> None:
        journal = PostgresJournal(postgres.dsn)
        with pytest.raises(JournalError) as caught:
            await journal.append("cart-1", 3, [b"c"], token=None)
        assert "holds journal schema version 3, written by a newer p2pshard" in str(caught.value)
        await journal.aclose()

    trio.run(main)
    assert pg_version(postgres) == 3
    with psycopg.connect(postgres.dsn) as db:
        assert db.execute("SELECT count(*) FROM p2pshard_journal_events").fetchone() == (2,)


def test_a_lease_file_a_newer_release_wrote_is_refused_and_an_old_one_is_numbered(
    tmp_path: Path,
) -> None:
    newer, older = tmp_path / "newer.db", tmp_path / "older.db"
    with sqlite3.connect(newer) as db:
        db.execute("PRAGMA user_version = 3")
    with sqlite3.connect(older) as db:  # the unnumbered layout, with a lease held
        db.execute(
            "CREATE TABLE leases (name TEXT PRIMARY KEY, owner TEXT, token INTEGER NOT NULL, "
            "expires REAL NOT NULL, boot TEXT NOT NULL)"
        )
        db.execute("INSERT INTO leases VALUES ('shard-1', 'n1:1', 7, 1e18, ?)", (boot_id(),))

    async def main() -> None:
        backend = SqliteLeaseBackend(newer)
        with pytest.raises(LeaseUnavailable) as caught:
            await backend.try_acquire("shard-1", "n2:2", 10.0)
        assert (
            f"sqlite lease file {newer} holds lease schema version 3, written by a newer "
            "p2pshard; this release reads version 2 and older" in str(caught.value)
        )
        backend = SqliteLeaseBackend(older)
        assert await backend.try_acquire("shard-1", "n2:2", 10.0) is None  # n1 still holds it
        assert await backend.try_acquire("shard-2", "n2:2", 10.0) == 1
        # Migrated to layout 2: a node lease of n2 can hold names too, beside n1's own lease.
        node_lease = await backend.grant_node_lease("n2:2", 10.0)
        assert await backend.try_acquire_attached("shard-1", "n2:2", node_lease) is None
        assert await backend.try_acquire_attached("shard-3", "n2:2", node_lease) == 1
        assert await backend.holder("shard-1") == ("n1:1", 7)
        await backend.aclose()

    trio.run(main)
    assert user_version(newer) == 3
    assert user_version(older) == 2
