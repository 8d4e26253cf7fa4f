"""The journal in a SQLite file: the embedded backend, for every node process on one host.

Theory of operation: three tables, ``p2pshard_journal_streams(persistence_id, highest, fence)``,
``p2pshard_journal_events(persistence_id, seq, payload)`` with ``(persistence_id, seq)`` unique,
and ``p2pshard_journal_snapshots(persistence_id, seq, payload)`` holding the latest snapshot of
each stream. Every call is one ``BEGIN IMMEDIATE`` transaction: it takes the file's write lock
first, so calls from several processes take turns and the checks of ``p2pshard._journal``
(fence, next sequence number) cannot interleave with another writer's. The file is in WAL mode
with ``synchronous=FULL``: an append is on disk (the log fsynced) before it is acknowledged, and
readers never block the writer.

The blocking calls run in worker threads (at most ``threads`` at a time), each on a connection
from a small pool that stays open, which also keeps the write-ahead log from being checkpointed
away after every call. A call has ``operation_timeout`` seconds. Waiting for another process's
lock ends a little sooner (SQLite's busy timeout, ``LOCK_WAIT_FRACTION`` of it) with a
:class:`p2pshard.JournalError` and nothing written; a call that is still not done at the full
timeout (a stalled disk) raises :class:`p2pshard.JournalError` too and its thread is abandoned,
so the outcome of such an append is unknown (it may still commit).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import trio

from ._errors import JournalError
from ._journal import (
    DEFAULT_MAX_EVENT_SIZE,
    DEFAULT_SNAPSHOT_EVERY,
    LOCK_WAIT_FRACTION,
    JournalSettings,
    Recovery,
    admit_token,
    check_append,
    check_next,
    check_persistence_id,
    check_size,
    check_snapshot_seq,
    check_token,
)

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


def _stream(conn: sqlite3.Connection, persistence_id: str) -> tuple[int, int | None]:
    row = conn.execute(
        "SELECT highest, fence FROM p2pshard_journal_streams WHERE persistence_id = ?",
        (persistence_id,),
    ).fetchone()
    return (0, None) if row is None else (int(row[0]), row[1])


def _put_stream(
    conn: sqlite3.Connection, persistence_id: str, highest: int, fence: int | None
) -> None:
    conn.execute(
        "INSERT INTO p2pshard_journal_streams VALUES (?, ?, ?) ON CONFLICT (persistence_id) "
        "DO UPDATE SET highest = excluded.highest, fence = excluded.fence",
        (persistence_id, highest, fence),
    )


class SqliteJournal:
    """Event streams in the SQLite file ``path``, shared by every process on this host using it.

    Example:
        >>> journal = SqliteJournal("/var/lib/shop/journal.db", operation_timeout=5.0)
    """

    def __init__(
        self,
        path: str | Path,
        *,
        operation_timeout: float = 5.0,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        snapshot_every: int | None = DEFAULT_SNAPSHOT_EVERY,
        threads: int = 4,
    ) -> None:
        JournalSettings(  # checks the values, with the usual messages
            operation_timeout=operation_timeout,
            max_event_size=max_event_size,
            snapshot_every=snapshot_every,
        )
        self.path = Path(path)
        self._timeout = operation_timeout
        self._max_event_size = max_event_size
        self._snapshot_every = snapshot_every
        self._limiter = trio.CapacityLimiter(threads)
        self._idle: list[sqlite3.Connection] = []
        self._pool_lock = threading.Lock()
        self._ready = False
        self._creating = trio.Lock()
        self._closed = False

    @property
    def max_event_size(self) -> int:
        """Bytes one event or snapshot may take."""
        return self._max_event_size

    @property
    def snapshot_every(self) -> int | None:
        """Events between snapshots for entity types that do not set their own."""
        return self._snapshot_every

    # -- connections --------------------------------------------------------------------------

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

    def _take(self) -> sqlite3.Connection:
        with self._pool_lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _give_back(self, conn: sqlite3.Connection) -> None:
        with self._pool_lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _create(self) -> None:
        conn = self._connect()
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute("COMMIT")
        except BaseException:
            conn.close()
            raise
        self._give_back(conn)

    async def _run(
        self, persistence_id: str, what: str, fn: Callable[[sqlite3.Connection], _T]
    ) -> _T:
        if self._closed:
            raise JournalError(persistence_id, f"sqlite journal {self.path} is closed")
        with trio.move_on_after(self._timeout) as scope:
            if not self._ready:
                async with self._creating:  # one thread creates the tables, the others wait
                    if not self._ready:
                        await self._in_thread(persistence_id, "creating the tables", self._create)
                        self._ready = True

            def work() -> _T:
                conn = self._take()
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        result = fn(conn)
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                        raise
                except JournalError:
                    self._give_back(conn)  # a refusal: the connection is fine
                    raise
                except BaseException:
                    conn.close()  # whatever went wrong, a new connection starts clean
                    raise
                self._give_back(conn)
                return result

            return await self._in_thread(persistence_id, what, work)
        assert scope.cancelled_caught
        raise JournalError(
            persistence_id,
            f"sqlite journal {self.path}: {what} did not finish within operation_timeout "
            f"({self._timeout:g} s); its outcome is unknown",
        )

    async def _in_thread(self, persistence_id: str, what: str, work: Callable[[], _T]) -> _T:
        try:
            return await trio.to_thread.run_sync(
                work, limiter=self._limiter, abandon_on_cancel=True
            )
        except (sqlite3.Error, OSError) as exc:
            raise JournalError(
                persistence_id, f"sqlite journal {self.path}: {what} failed: {exc}"
            ) from exc

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
            row = conn.execute(
                "SELECT seq, payload FROM p2pshard_journal_snapshots WHERE persistence_id = ?",
                (persistence_id,),
            ).fetchone()
            snapshot = None if row is None else (int(row[0]), bytes(row[1]))
            after = 0 if snapshot is None else snapshot[0]
            events = conn.execute(
                "SELECT seq, payload FROM p2pshard_journal_events "
                "WHERE persistence_id = ? AND seq > ? ORDER BY seq",
                (persistence_id, after),
            ).fetchall()
            return Recovery(snapshot, tuple((int(s), bytes(p)) for s, p in events), highest)

        return await self._run(persistence_id, "recovery", recover)

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`."""
        batch = check_append(persistence_id, first_seq, events, self._max_event_size)
        check_token(token)
        rows = [(persistence_id, first_seq + i, bytes(e)) for i, e in enumerate(batch)]

        def append(conn: sqlite3.Connection) -> None:
            highest, fence = _stream(conn, persistence_id)
            raised = admit_token(persistence_id, fence, token)
            check_next(persistence_id, first_seq, highest)
            conn.executemany("INSERT INTO p2pshard_journal_events VALUES (?, ?, ?)", rows)
            _put_stream(conn, persistence_id, first_seq + len(rows) - 1, raised)

        await self._run(persistence_id, f"append at {first_seq}", append)

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

    async def aclose(self) -> None:
        """Close the pooled connections; a call still running closes its own when done."""
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
