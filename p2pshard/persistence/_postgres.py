"""The journal in PostgreSQL: the backend for nodes on several hosts.

Theory of operation: the tables of the SQLite backend (``p2pshard.persistence._sqlite``):
``p2pshard_journal_streams(persistence_id, highest, fence)``, ``p2pshard_journal_events`` with
the primary key ``(persistence_id, seq)`` and ``p2pshard_journal_snapshots``, created if missing
(under an advisory lock, as concurrent ``CREATE TABLE IF NOT EXISTS`` can clash). Every append
and snapshot is one transaction that first locks the stream's row with ``SELECT ... FOR UPDATE``
(inserting the row of a new stream first; a recovery's fence raise locks it too, below), so
calls on one stream from any number of hosts take turns, the
fence and sequence checks of ``p2pshard.persistence._journal`` see the latest committed row, and
calls on other streams go on in parallel. The unique key is a second guard: a duplicate sequence
number can never be stored.

Appends are group-committed (``p2pshard.persistence._group_commit``): one transaction writes
every append waiting, whatever their number, in two round trips, the statements going out in
pipeline mode: BEGIN, the insert of missing stream rows and the locking ``SELECT ... FOR UPDATE``
of all the batch's stream rows (in persistence id order, so that two writers' batches cannot
deadlock); then, once each append is checked against them, one statement that inserts every
accepted event and updates their streams' rows (arrays unnested), and COMMIT.

A recovery, or a batch of them, is one round trip: one pipeline sends BEGIN, one statement that
raises the fences the tokens ask for (inserting the rows of new streams; its row locks wait for
appends in flight, so what follows sees them), one query that reads every stream's row,
snapshot and later events (arrays, ``= ANY``), and COMMIT. Without a token to raise it is that
query alone. A batch of snapshots locks its streams' rows, checks each snapshot against them and
writes those that pass with one statement.

psycopg 3 (the ``postgresql`` extra) does the talking, in worker threads through
``trio.to_thread``, with a small pool of connections (at most ``connections`` calls at once;
``p2pshard.persistence._threads``, shared with the SQLite backend).
Each connection has ``statement_timeout`` and ``lock_timeout`` a little under
``operation_timeout`` (``LOCK_WAIT_FRACTION`` of it), so a statement stuck behind another writer is
cancelled by the server, with nothing written; a call that is still not done at the full
timeout raises :class:`p2pshard.JournalError` too and abandons its thread, and then the
outcome of an append is unknown (it may still commit). A broken connection is
dropped, and the next call opens a new one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psycopg
import psycopg.conninfo
import psycopg.errors

from .._errors import JournalConflict, JournalError
from .._store_version import newer_schema
from ._batching import StreamRead, fence_raises, group_rows, plan_snapshots
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
    SnapshotWrite,
    check_append,
    check_token,
)
from ._threads import RECOVERY_READ, ThreadedJournal

_T = TypeVar("_T")

_SCHEMA_LOCK = 0x70327368_6A726E6C
"""The advisory lock (``p2sh`` ``jrnl``) held while the tables are created."""

_VERSIONS = """CREATE TABLE IF NOT EXISTS p2pshard_schema (
    component TEXT PRIMARY KEY,
    version INTEGER NOT NULL
)"""
"""The schema version of each p2pshard component's tables in this database."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS p2pshard_journal_streams (
        persistence_id TEXT PRIMARY KEY,
        highest BIGINT NOT NULL,
        fence BIGINT
    )""",
    """CREATE TABLE IF NOT EXISTS p2pshard_journal_events (
        persistence_id TEXT NOT NULL,
        seq BIGINT NOT NULL,
        payload BYTEA NOT NULL,
        PRIMARY KEY (persistence_id, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS p2pshard_journal_snapshots (
        persistence_id TEXT PRIMARY KEY,
        seq BIGINT NOT NULL,
        payload BYTEA NOT NULL
    )""",
)

Connection = psycopg.Connection[Any]


def _where(dsn: str) -> str:
    """``host:port/dbname`` of a connection string, without the password, for messages."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        return "(an unparsable connection string)"
    host = info.get("host") or info.get("hostaddr") or "localhost"
    port = f":{info['port']}" if info.get("port") else ""
    return f"{host}{port}/{info.get('dbname') or info.get('user') or ''}"


def _lock_stream(conn: Connection, persistence_id: str) -> tuple[int, int | None]:
    """The stream's highest sequence number and fence, its row locked until the transaction ends.

    The row of a new stream is inserted first (a no-op, writing nothing, when it exists); in
    pipeline mode both statements go out together with the transaction's BEGIN.
    """
    conn.execute(
        "INSERT INTO p2pshard_journal_streams VALUES (%s, 0, NULL) "
        "ON CONFLICT (persistence_id) DO NOTHING",
        (persistence_id,),
    )
    row = conn.execute(
        "SELECT highest, fence FROM p2pshard_journal_streams WHERE persistence_id = %s FOR UPDATE",
        (persistence_id,),
    ).fetchone()
    assert row is not None
    return int(row[0]), None if row[1] is None else int(row[1])


_RAISE_FENCES = (
    "INSERT INTO p2pshard_journal_streams AS s "
    "SELECT p, 0, t FROM unnest(%b::text[], %b::bigint[]) AS u(p, t) ORDER BY p "
    "ON CONFLICT (persistence_id) DO UPDATE SET fence = excluded.fence "
    "WHERE s.fence IS NULL OR s.fence < excluded.fence"
)
"""The fence raises of a batch of recoveries, one row per stream, in persistence id order (as
every batch locks rows): a new stream's row, or a higher fence; a lower token changes nothing."""


class PostgresJournal(ThreadedJournal[Connection]):
    """Event streams in the PostgreSQL database ``dsn`` names (a libpq string or URL).

    Example:
        >>> journal = PostgresJournal("postgresql://p2pshard@db-host/shop")
    """

    _driver_errors = (psycopg.Error, OSError)

    def __init__(
        self,
        dsn: str,
        *,
        operation_timeout: float = 5.0,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        snapshot_every: int | None = DEFAULT_SNAPSHOT_EVERY,
        connections: int = DEFAULT_CONNECTIONS,
        group_commit_max_events: int = DEFAULT_GROUP_COMMIT_MAX_EVENTS,
        group_commit_max_bytes: int = DEFAULT_GROUP_COMMIT_MAX_BYTES,
    ) -> None:
        settings = JournalSettings(  # checks the values, with the usual messages
            backend="postgresql",
            dsn=dsn,
            operation_timeout=operation_timeout,
            max_event_size=max_event_size,
            snapshot_every=snapshot_every,
            connections=connections,
            group_commit_max_events=group_commit_max_events,
            group_commit_max_bytes=group_commit_max_bytes,
        )
        super().__init__(settings, connections)
        self._dsn = dsn
        self.where = _where(dsn)
        """The server and database, for messages (never the password)."""

    # -- connections and transactions ---------------------------------------------------------

    def _describe(self) -> str:
        return f"postgresql journal {self.where}"

    def _connect(self) -> Connection:
        conn = psycopg.connect(
            self._dsn,
            autocommit=True,
            connect_timeout=max(2, math.ceil(self._timeout)),  # libpq: whole seconds, >= 2
        )
        try:
            milliseconds = str(max(1, int(self._timeout * LOCK_WAIT_FRACTION * 1000)))
            for setting in ("statement_timeout", "lock_timeout"):
                conn.execute("SELECT set_config(%s, %s, false)", (setting, milliseconds))
        except BaseException:
            conn.close()
            raise
        return conn

    def _usable(self, conn: Connection) -> bool:
        return not conn.closed

    def _close(self, conn: Connection) -> None:
        conn.close()

    def _create(self, conn: Connection) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute(_VERSIONS)
            row = conn.execute(
                "SELECT version FROM p2pshard_schema WHERE component = 'journal'"
            ).fetchone()
            found = 1 if row is None else int(row[0])  # no row: the first layout, unnumbered
            where = f"postgresql journal {self.where}"
            refusal = newer_schema("journal", where, found, JOURNAL_SCHEMA_VERSION)
            if refusal is not None:
                raise JournalError("", refusal)
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO p2pshard_schema VALUES ('journal', %s) ON CONFLICT (component) "
                "DO UPDATE SET version = GREATEST(p2pshard_schema.version, excluded.version)",
                (JOURNAL_SCHEMA_VERSION,),
            )

    def _transaction(
        self, conn: Connection, persistence_id: str, what: str, fn: Callable[[Connection], _T]
    ) -> _T:
        try:
            # Pipeline mode sends BEGIN with the first statements and COMMIT with the last: an
            # append is two round trips, not five.
            with conn.pipeline(), conn.transaction():
                return fn(conn)
        except psycopg.errors.UniqueViolation as exc:  # rolled back: the connection is fine
            raise JournalConflict(
                persistence_id,
                f"{what}: another writer stored that sequence number first ({exc}); "
                "nothing was written",
            ) from exc

    # -- the Journal interface --------------------------------------------------------------

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`."""
        batch = check_append(persistence_id, first_seq, events, self._max_event_size)
        check_token(token)
        await self._append(persistence_id, first_seq, [bytes(e) for e in batch], token)

    def _commit_batch(
        self, conn: Connection, batch: Sequence[PendingAppend]
    ) -> list[JournalError | None]:
        pids = streams_of(batch)
        if len(pids) == 1:  # a lone append, most often: the plain statements are cheaper
            stored = {pids[0]: StreamRow(*_lock_stream(conn, pids[0]))}
        else:
            conn.execute(  # new streams get a row to lock; in order, as the lock below
                "INSERT INTO p2pshard_journal_streams "
                "SELECT p, 0, NULL FROM unnest(%b::text[]) AS p ORDER BY p "
                "ON CONFLICT (persistence_id) DO NOTHING",
                (pids,),
            )
            locked = conn.execute(
                "SELECT persistence_id, highest, fence FROM p2pshard_journal_streams "
                "WHERE persistence_id = ANY(%b::text[]) ORDER BY persistence_id FOR UPDATE",
                (pids,),
            ).fetchall()
            stored = {
                str(pid): StreamRow(int(highest), None if fence is None else int(fence))
                for pid, highest, fence in locked
            }
        plan = plan_batch(batch, stored)
        if plan.events:
            # Arrays go in binary (%b): psycopg writes them several times faster than as text.
            conn.execute(  # every accepted event and the new stream rows: one statement
                "WITH stored AS (INSERT INTO p2pshard_journal_events "
                "SELECT * FROM unnest(%b::text[], %b::bigint[], %b::bytea[])) "
                "UPDATE p2pshard_journal_streams AS s SET highest = u.highest, fence = u.fence "
                "FROM unnest(%b::text[], %b::bigint[], %b::bigint[]) "
                "AS u(persistence_id, highest, fence) WHERE s.persistence_id = u.persistence_id",
                (
                    [pid for pid, _, _ in plan.events],
                    [seq for _, seq, _ in plan.events],
                    [payload for _, _, payload in plan.events],
                    list(plan.streams),
                    [row.highest for row in plan.streams.values()],
                    [row.fence for row in plan.streams.values()],
                ),
            )
        return plan.refusals

    def _read_recoveries(
        self, conn: Connection, requests: Sequence[tuple[str, int | None]]
    ) -> dict[str, StreamRead]:
        raises = fence_raises(requests)
        pids = sorted({pid for pid, _ in requests})
        read = RECOVERY_READ.format(match="= ANY(%b::text[])")
        if not raises:  # one statement reads one consistent state: no transaction needed
            return group_rows(conn.execute(read, (pids, pids, pids)).fetchall())
        # One round trip: BEGIN, the fence raises (their row locks wait for appends in flight,
        # so the read after them sees those appends), the read, COMMIT, sent as one pipeline.
        with conn.pipeline():
            conn.execute("BEGIN")
            conn.execute(_RAISE_FENCES, (list(raises), list(raises.values())))
            cursor = conn.execute(read, (pids, pids, pids))
            conn.execute("COMMIT")
            rows = cursor.fetchall()
        return group_rows(rows)

    def _write_snapshots(
        self, conn: Connection, batch: Sequence[SnapshotWrite]
    ) -> list[JournalError | None]:
        pids = sorted({s.persistence_id for s in batch})
        locked = conn.execute(  # a stream without a row has no event: its snapshot is refused
            "SELECT persistence_id, highest, fence FROM p2pshard_journal_streams "
            "WHERE persistence_id = ANY(%b::text[]) ORDER BY persistence_id FOR UPDATE",
            (pids,),
        ).fetchall()
        plan = plan_snapshots(
            batch,
            {
                str(pid): StreamRow(int(highest), None if fence is None else int(fence))
                for pid, highest, fence in locked
            },
        )
        if plan.fences:
            conn.execute(
                "UPDATE p2pshard_journal_streams AS s SET fence = u.fence "
                "FROM unnest(%b::text[], %b::bigint[]) AS u(persistence_id, fence) "
                "WHERE s.persistence_id = u.persistence_id",
                (list(plan.fences), list(plan.fences.values())),
            )
        if plan.writes:
            conn.execute(
                "INSERT INTO p2pshard_journal_snapshots AS s "
                "SELECT * FROM unnest(%b::text[], %b::bigint[], %b::bytea[]) "
                "ON CONFLICT (persistence_id) DO UPDATE SET seq = excluded.seq, "
                "payload = excluded.payload WHERE excluded.seq > s.seq",
                (
                    list(plan.writes),
                    [seq for seq, _ in plan.writes.values()],
                    [data for _, data in plan.writes.values()],
                ),
            )
        return plan.refusals
