"""The journal in a SQLite file: the embedded backend, for every node process on one host.

Theory of operation: three tables, ``p2pshard_journal_streams(persistence_id, highest, fence)``,
``p2pshard_journal_events(persistence_id, seq, payload)`` with ``(persistence_id, seq)`` unique,
and ``p2pshard_journal_snapshots(persistence_id, seq, payload)`` holding the latest snapshot of
each stream. Every call is one ``BEGIN IMMEDIATE`` transaction: it takes the file's write lock
first, so calls from several processes take turns and the checks of
``p2pshard.persistence._journal`` (fence, next sequence number) cannot interleave with another
writer's. The file is in WAL mode with ``synchronous=FULL``: an append is on disk (the log fsynced)
before it is acknowledged, and readers never block the writer.

Appends are group-committed (``p2pshard.persistence._group_commit``): one transaction reads
the rows of the batch's streams, checks each append against them in order, inserts the events of
those that pass and writes their streams' rows; one commit, one fsync, for the whole batch. A
refused append wrote nothing, the others commit; an error of the storage rolls the whole batch
back.

The blocking calls run in worker threads (at most ``threads`` at a time), each on a connection
from a small pool that stays open (``p2pshard.persistence._threads``), which also keeps the
write-ahead log from being checkpointed away after every call. A call has
``operation_timeout`` seconds. Waiting for another process's lock ends a little sooner
(SQLite's busy timeout, ``LOCK_WAIT_FRACTION`` of it) with a :class:`p2pshard.JournalError` and
nothing written; a call that is still not done at the full timeout (a stalled disk) raises
:class:`p2pshard.JournalError` too and its thread is abandoned, so the outcome of such an
append is unknown (it may still commit).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from .._errors import JournalError
from .._store_version import newer_schema
from ._group_commit import PendingAppend, StreamRow, plan_batch, streams_of
from ._journal import (
    DEFAULT_CONNECTIONS,
    DEFAULT_GROUP_COMMIT_MAX_BYTES,
    DEFAULT_GROUP_COMMIT_MAX_EVENTS,
    DEFAULT_MAX_EVENT_SIZE,
    DEFAULT_SNAPSHOT_EVERY,
    JOURNAL_SCHEMA_VERSION,
    LOCK_WAIT_FRACTION,
    JournalSettings,
    Recovery,
    admit_token,
    check_append,
    check_persistence_id,
    check_size,
    check_snapshot_seq,
    check_token,
)
from ._threads import ThreadedJournal, read_recovery

_T = TypeVar("_T")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS p2pshard_journal_streams (
        persistence_id TEXT PRIMARY KEY,
        highest INTEGER NOT NULL,
        fence INTEGER
    )""",
    """CREATE TABLE IF NOT EXISTS p2pshard_journal_events (
        persistence_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        payload BLOB NOT NULL,
        PRIMARY KEY (persistence_id, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS p2pshard_journal_snapshots (
        persistence_id TEXT PRIMARY KEY,
        seq INTEGER NOT NULL,
        payload BLOB NOT NULL
    )""",
)


def _schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _stream(conn: sqlite3.Connection, persistence_id: str) -> tuple[int, int | None]:
    row = conn.execute(
        "SELECT highest, fence FROM p2pshard_journal_streams WHERE persistence_id = ?",
        (persistence_id,),
    ).fetchone()
    return (0, None) if row is None else (int(row[0]), row[1])


_READ_CHUNK = 500
"""Persistence ids per ``IN (...)`` query when a batch reads its stream rows."""


def _streams(conn: sqlite3.Connection, persistence_ids: Sequence[str]) -> dict[str, StreamRow]:
    rows: dict[str, StreamRow] = {}
    for start in range(0, len(persistence_ids), _READ_CHUNK):
        chunk = persistence_ids[start : start + _READ_CHUNK]
        marks = ", ".join("?" * len(chunk))
        for pid, highest, fence in conn.execute(
            "SELECT persistence_id, highest, fence FROM p2pshard_journal_streams "
            f"WHERE persistence_id IN ({marks})",
            chunk,
        ):
            rows[pid] = StreamRow(int(highest), None if fence is None else int(fence))
    return rows


def _put_streams(conn: sqlite3.Connection, rows: Iterable[tuple[str, int, int | None]]) -> None:
    conn.executemany(
        "INSERT INTO p2pshard_journal_streams VALUES (?, ?, ?) ON CONFLICT (persistence_id) "
        "DO UPDATE SET highest = excluded.highest, fence = excluded.fence",
        rows,
    )


def _put_stream(
    conn: sqlite3.Connection, persistence_id: str, highest: int, fence: int | None
) -> None:
    conn.execute(
        "INSERT INTO p2pshard_journal_streams VALUES (?, ?, ?) ON CONFLICT (persistence_id) "
        "DO UPDATE SET highest = excluded.highest, fence = excluded.fence",
        (persistence_id, highest, fence),
    )


class SqliteJournal(ThreadedJournal[sqlite3.Connection]):
    """Event streams in the SQLite file ``path``, shared by every process on this host using it.

    Example:
        >>> journal = SqliteJournal("/var/lib/shop/journal.db", operation_timeout=5.0)
    """

    _driver_errors = (sqlite3.Error, OSError)

    def __init__(
        self,
        path: str | Path,
        *,
        operation_timeout: float = 5.0,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        snapshot_every: int | None = DEFAULT_SNAPSHOT_EVERY,
        threads: int = DEFAULT_CONNECTIONS,
        group_commit_max_events: int = DEFAULT_GROUP_COMMIT_MAX_EVENTS,
        group_commit_max_bytes: int = DEFAULT_GROUP_COMMIT_MAX_BYTES,
    ) -> None:
        settings = JournalSettings(  # checks the values, with the usual messages
            operation_timeout=operation_timeout,
            max_event_size=max_event_size,
            snapshot_every=snapshot_every,
            connections=threads,
            group_commit_max_events=group_commit_max_events,
            group_commit_max_bytes=group_commit_max_bytes,
        )
        super().__init__(settings, threads)
        self.path = Path(path)

    # -- connections and transactions ---------------------------------------------------------

    def _describe(self) -> str:
        return f"sqlite journal {self.path}"

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path,
            timeout=self._timeout * LOCK_WAIT_FRACTION,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.execute("PRAGMA synchronous=FULL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _close(self, conn: sqlite3.Connection) -> None:
        conn.close()

    def _create(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        self._transaction(conn, "", "creating the tables", self._create_tables)

    def _create_tables(self, conn: sqlite3.Connection) -> None:
        """Create the tables, or check those there (their schema version: ``user_version``)."""
        where, found = f"sqlite journal {self.path}", _schema_version(conn)
        refusal = newer_schema("journal", where, found, JOURNAL_SCHEMA_VERSION)
        if refusal is not None:
            raise JournalError("", refusal)
        for statement in _SCHEMA:
            conn.execute(statement)
        if _schema_version(conn) < JOURNAL_SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version = {JOURNAL_SCHEMA_VERSION}")

    def _transaction(
        self,
        conn: sqlite3.Connection,
        persistence_id: str,
        what: str,
        fn: Callable[[sqlite3.Connection], _T],
    ) -> _T:
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    # -- the Journal interface --------------------------------------------------------------

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        """See :meth:`p2pshard.Journal.recover`."""
        check_persistence_id(persistence_id)
        check_token(token)

        def recover(conn: sqlite3.Connection) -> Recovery:
            highest, fence = _stream(conn, persistence_id)
            raised = admit_token(persistence_id, fence, token)
            if raised != fence:
                _put_stream(conn, persistence_id, highest, raised)
            return read_recovery(conn, persistence_id, highest, "?")

        return await self._run(persistence_id, "recovery", recover)

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`."""
        batch = check_append(persistence_id, first_seq, events, self._max_event_size)
        check_token(token)
        await self._append(persistence_id, first_seq, batch, token)

    def _commit_batch(
        self, conn: sqlite3.Connection, batch: Sequence[PendingAppend]
    ) -> list[JournalError | None]:
        plan = plan_batch(batch, _streams(conn, streams_of(batch)))
        if plan.events:
            conn.executemany("INSERT INTO p2pshard_journal_events VALUES (?, ?, ?)", plan.events)
            _put_streams(conn, ((pid, s.highest, s.fence) for pid, s in plan.streams.items()))
        return plan.refusals

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.save_snapshot`."""
        check_persistence_id(persistence_id)
        check_size(persistence_id, f"snapshot at {seq}", data, self._max_event_size)
        check_token(token)
        payload = bytes(data)

        def save(conn: sqlite3.Connection) -> None:
            highest, fence = _stream(conn, persistence_id)
            raised = admit_token(persistence_id, fence, token)
            check_snapshot_seq(persistence_id, seq, highest)
            if raised != fence:
                _put_stream(conn, persistence_id, highest, raised)
            conn.execute(
                "INSERT INTO p2pshard_journal_snapshots VALUES (?, ?, ?) "
                "ON CONFLICT (persistence_id) DO UPDATE SET seq = excluded.seq, "
                "payload = excluded.payload WHERE excluded.seq > seq",
                (persistence_id, seq, payload),
            )

        await self._run(persistence_id, f"snapshot at {seq}", save)
