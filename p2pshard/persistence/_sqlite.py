"""The journal in a SQLite file: the embedded backend, for every node process on one host.

Theory of operation: three tables, ``p2pshard_journal_streams(persistence_id, highest, fence)``,
``p2pshard_journal_events(persistence_id, seq, payload)`` with ``(persistence_id, seq)`` unique,
and ``p2pshard_journal_snapshots(persistence_id, seq, payload)`` holding the latest snapshot of
each stream. Every call that writes is one ``BEGIN IMMEDIATE`` transaction: it takes the file's
write lock first, so calls from several processes take turns and the checks of
``p2pshard.persistence._journal`` (fence, next sequence number) cannot interleave with another
writer's. The file is in WAL mode with ``synchronous=FULL``: an append is on disk (the log fsynced)
before it is acknowledged, and readers never block the writer.

A recovery (or a batch of them) is one transaction that raises the fences its tokens ask for (a
``BEGIN IMMEDIATE`` one only then; a recovery without a token to raise takes no write lock) and
reads every stream's row, snapshot and later events with one query. A batch of snapshots is one
``BEGIN IMMEDIATE`` transaction.

Appends are group-committed (``p2pshard.persistence._group_commit``): one transaction reads
the rows of the batch's streams, checks each append against them in order, inserts the events of
those that pass and writes their streams' rows; one commit, one fsync, for the whole batch. A
refused append wrote nothing, the others commit; an error of the storage rolls the whole batch
back. A lone append (a batch of one) to a stream that has a row skips the read: one conditional
``UPDATE`` (:data:`_CONTINUE_STREAM`) moves the row on if the append passes the same rules, and
its events are inserted; if it changes nothing (a new stream, or a refusal), the batch path
decides, and says why. A batch takes the rows the journal's own last batches left
(:class:`_KnownRows`) instead of reading them again while nothing else has changed a stream row:
no other connection has committed (``PRAGMA data_version``) and no recovery or snapshot of this
journal has raised a fence; otherwise it reads them.

Under heavy load the journal checkpoints the write-ahead log itself (``PRAGMA
wal_checkpoint(PASSIVE)``): after a batch of at least :data:`CHECKPOINT_BATCH` appends, once
commits have written about :data:`CHECKPOINT_PAGES` pages since its last one, and after that
batch is answered (``p2pshard.persistence._threads``). SQLite's own automatic checkpoint runs
inside the commit that crosses its threshold, so every append of that batch would wait for the
copy into the database file and its fsync; it stays on, for lighter loads and as the backstop.

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

import itertools
import logging
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from .._errors import JournalError
from .._store_version import newer_schema
from ._batching import StreamRead, fence_raises, group_rows, plan_snapshots
from ._group_commit import PendingAppend, StreamRow, checkpoint_due, plan_batch, streams_of
from ._journal import (
    DEFAULT_CONNECTIONS,
    DEFAULT_GROUP_COMMIT_MAX_BYTES,
    DEFAULT_GROUP_COMMIT_MAX_EVENTS,
    DEFAULT_MAX_EVENT_SIZE,
    DEFAULT_SNAPSHOT_EVERY,
    JOURNAL_SCHEMA_VERSION,
    LOCK_WAIT_FRACTION,
    JournalSettings,
    SnapshotWrite,
)
from ._threads import RECOVERY_READ, ThreadedJournal

_T = TypeVar("_T")

logger = logging.getLogger("p2pshard.persistence")

CHECKPOINT_PAGES = 1000
"""Pages (estimated: one per append and per event, and one per 4 KiB of events) that group
commits write to the log before the journal checkpoints it after a batch of at least
:data:`CHECKPOINT_BATCH` appends; SQLite's own automatic checkpoint, inside a commit, is at
1,000 pages too."""

KNOWN_ROWS_LIMIT = 65_536
"""Stream rows the journal keeps from its group commits (:class:`_KnownRows`) before it starts
afresh."""

CHECKPOINT_BATCH = 128
"""Appends a batch needs for the journal to checkpoint after it: the work of that many answered
tasks preparing their next appends covers much of a checkpoint's time. After smaller batches
SQLite's automatic checkpoint stays in charge, as before."""


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


_READ_CHUNK = 300
"""Persistence ids per ``IN (...)`` list when a batch reads its stream rows (a recovery read
names them three times: within SQLite's 999 parameters)."""


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


_CONTINUE_STREAM = (
    "UPDATE p2pshard_journal_streams SET highest = ?1, "
    "fence = CASE WHEN ?2 IS NOT NULL AND (fence IS NULL OR ?2 > fence) THEN ?2 ELSE fence END "
    "WHERE persistence_id = ?3 AND highest = ?4 AND (?2 IS NULL OR fence IS NULL OR ?2 >= fence)"
)
"""A lone append's stream row, moved on in one statement if the append passes the rules of
:func:`p2pshard.persistence._group_commit.plan_batch` (it continues the stored highest sequence
number; its token, if any, is not below the fence, and raises it): parameters ``(last_seq,
token, persistence_id, first_seq - 1)``. It changes no row for a new stream or an append that is
refused; the batch path then decides, and says why. A test holds the two to the same decisions.
"""

_INSERT_EVENT = "INSERT INTO p2pshard_journal_events VALUES (?, ?, ?)"

_RAISE_FENCE = (
    "INSERT INTO p2pshard_journal_streams VALUES (?, 0, ?) ON CONFLICT (persistence_id) "
    "DO UPDATE SET fence = excluded.fence WHERE p2pshard_journal_streams.fence IS NULL "
    "OR p2pshard_journal_streams.fence < excluded.fence"
)
"""A recovery's fence raise: a new stream's row, or a higher fence; a lower token changes
nothing (its recovery is refused)."""


class _KnownRows:
    """The stream rows as this journal's own group commits left them, while nothing else wrote.

    A batch of appends reads its streams' rows inside its transaction; at 256 streams that read
    is a tenth of the batch's time. A batch may take a row from here instead, because it is
    still what is stored, when three things are unchanged since the rows were gathered: the
    connection (the commits run one at a time, and the pool gives back the last connection);
    its ``PRAGMA data_version``, which changes when any other connection, of this process or
    another, has committed; and :attr:`writes`, which the journal's other calls that change a
    stream row (a recovery's fence raise, a snapshot's) move on inside their transactions, on
    whichever connection. Otherwise the batch starts afresh and reads every row. A failed batch
    forgets them all.
    """

    def __init__(self) -> None:
        self.rows: dict[str, StreamRow] = {}
        self._counter = itertools.count(1)
        self.writes = 0
        """Moved on by every other call that changes a stream row, inside its transaction."""
        self._made_on: sqlite3.Connection | None = None
        self._made_at: tuple[int, int] = (0, 0)

    def valid_rows(self, conn: sqlite3.Connection, data_version: int) -> dict[str, StreamRow]:
        """The rows a batch on ``conn`` may use (none if anything else wrote since)."""
        at = (data_version, self.writes)
        if conn is not self._made_on or at != self._made_at or len(self.rows) > KNOWN_ROWS_LIMIT:
            self.rows, self._made_on, self._made_at = {}, conn, at
        return self.rows

    def other_write(self) -> None:
        """A call other than a group commit is changing stream rows (in its transaction)."""
        self.writes = next(self._counter)  # one assignment: safe from any thread

    def forget(self) -> None:
        """Start afresh (a batch failed: what it read or wrote may not be stored)."""
        self.rows, self._made_on = {}, None


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
        self._unchecked = 0
        """Estimated pages written since the journal's last checkpoint of its own."""
        self._known = _KnownRows()

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

    # -- the Journal interface (``append``: the base class's) ---------------------------------

    def _write_batch(
        self, conn: sqlite3.Connection, batch: Sequence[PendingAppend]
    ) -> list[JournalError | None]:
        known = self._known
        try:
            refusals, rows = self._transaction(
                conn,
                batch[0].persistence_id,
                "group commit",
                lambda c: self._write_appends(c, batch, known),
            )
        except BaseException:
            known.forget()
            raise
        known.rows.update(rows)
        return refusals

    def _write_appends(
        self, conn: sqlite3.Connection, batch: Sequence[PendingAppend], known: _KnownRows
    ) -> tuple[list[JournalError | None], dict[str, StreamRow]]:
        """Inside the transaction: the refusals, and the batch's stream rows as it leaves them."""
        if len(batch) == 1:  # a lone append: two statements, not four, when it passes
            append = batch[0]
            pid, first_seq, events = append.persistence_id, append.first_seq, append.events
            moved = conn.execute(
                _CONTINUE_STREAM, (append.last_seq, append.token, pid, first_seq - 1)
            )
            if moved.rowcount == 1:
                if len(events) == 1:
                    conn.execute(_INSERT_EVENT, (pid, first_seq, events[0]))
                else:
                    conn.executemany(
                        _INSERT_EVENT, [(pid, first_seq + i, e) for i, e in enumerate(events)]
                    )
                known.rows.pop(pid, None)  # its fence may have risen: read it next time
                return [None], {}
        data_version = conn.execute("PRAGMA data_version").fetchone()[0]
        rows = known.valid_rows(conn, data_version)
        pids = streams_of(batch)
        stored = {pid: rows[pid] for pid in pids if pid in rows}
        if len(stored) < len(pids):
            stored.update(_streams(conn, [pid for pid in pids if pid not in stored]))
        plan = plan_batch(batch, stored)
        if plan.events:
            conn.executemany(_INSERT_EVENT, plan.events)
            _put_streams(conn, ((pid, s.highest, s.fence) for pid, s in plan.streams.items()))
        return plan.refusals, {**stored, **plan.streams}

    def _upkeep_after(
        self, batch: Sequence[PendingAppend]
    ) -> Callable[[sqlite3.Connection], None] | None:
        # SQLite's automatic checkpoint runs inside the commit that crosses its threshold, so
        # every append of that batch would wait for it (copying pages into the database file,
        # an fsync of it). This one runs after the batch is answered, while the answered tasks
        # prepare their next appends; the automatic one stays as the backstop.
        self._unchecked, due = checkpoint_due(
            self._unchecked, batch, pages=CHECKPOINT_PAGES, min_batch=CHECKPOINT_BATCH
        )
        return self._checkpoint if due else None

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            logger.warning(
                "%s: checkpoint after a group commit failed (%s); SQLite's automatic "
                "checkpoint tries again",
                self._describe(),
                exc,
            )

    def _read_recoveries(
        self, conn: sqlite3.Connection, requests: Sequence[tuple[str, int | None]]
    ) -> dict[str, StreamRead]:
        raises = fence_raises(requests)
        pids = sorted({pid for pid, _ in requests})
        # Only a fence to raise needs the write lock; a plain read does not wait for writers.
        conn.execute("BEGIN IMMEDIATE" if raises else "BEGIN")
        try:
            if raises:
                self._known.other_write()
                conn.executemany(_RAISE_FENCE, raises.items())
            reads: dict[str, StreamRead] = {}
            for start in range(0, len(pids), _READ_CHUNK):
                chunk = pids[start : start + _READ_CHUNK]
                match = f"IN ({', '.join('?' * len(chunk))})"
                reads.update(group_rows(conn.execute(RECOVERY_READ.format(match=match), chunk * 3)))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return reads

    def _write_snapshots(
        self, conn: sqlite3.Connection, batch: Sequence[SnapshotWrite]
    ) -> list[JournalError | None]:
        plan = plan_snapshots(batch, _streams(conn, sorted({s.persistence_id for s in batch})))
        if plan.fences:
            self._known.other_write()
            conn.executemany(
                "UPDATE p2pshard_journal_streams SET fence = ? WHERE persistence_id = ?",
                [(fence, pid) for pid, fence in plan.fences.items()],
            )
        if plan.writes:
            conn.executemany(
                "INSERT INTO p2pshard_journal_snapshots VALUES (?, ?, ?) "
                "ON CONFLICT (persistence_id) DO UPDATE SET seq = excluded.seq, "
                "payload = excluded.payload WHERE excluded.seq > seq",
                [(pid, seq, data) for pid, (seq, data) in plan.writes.items()],
            )
        return plan.refusals
