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

Appends are group-committed (``p2pshard.persistence._group_commit``), and a batch, or a lone
append, is one statement in one round trip: a call of a server-side function, autocommitted, so
that the server answers only once the transaction is committed. There are three, each PL/pgSQL:
``p2pshard_journal_append_v1`` (:data:`APPEND_FUNCTION`) for any batch;
``p2pshard_journal_append_distinct_v1`` (:data:`APPEND_DISTINCT_FUNCTION`) for a batch whose
appends are each on a stream of its own, as under load from many entities (the same decisions
with statements over whole arrays instead of a loop per append: about a fifth less of the
server's work per append); and ``p2pshard_journal_append_one_v1`` for a batch of one, with plain
arguments. Each inserts the rows of new streams and locks every stream row of the batch with
``SELECT ... FOR UPDATE``, in persistence id order (so that two writers' batches cannot
deadlock); applies the rules of :func:`p2pshard.persistence._group_commit.plan_batch` to each
append in order (the fence, then the sequence number, against the stream as the appends before
it left it); inserts the events of the appends that pass and updates their streams' rows; and
returns the appends it refused, each with the stream row it was checked against, from which the
shell makes the same :class:`p2pshard.JournalFenced` or :class:`p2pshard.JournalConflict` as
``plan_batch`` (a test holds them to the same decisions on random batches). The functions are
created with the tables when they are missing (under the advisory lock); the version in a name
is the function's own: a later release that changes one adds another name, so that nodes of two
releases sharing a database during a rolling upgrade each call their own, and the tables, and
their schema version, stay as they were. Two batches may be in flight at once
(``_commits_at_once``), on streams of their own (``p2pshard.persistence._threads``): each locks
only its own rows, so neither waits for the other.

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
from ._group_commit import PendingAppend, StreamRow, streams_of
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
    admit_token,
    check_next,
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

APPEND_FUNCTION = """CREATE OR REPLACE FUNCTION p2pshard_journal_append_v1(
    streams text[], stream_of integer[], first_seqs bigint[], counts integer[], tokens bigint[],
    payloads bytea[], OUT refused integer[], OUT refused_highest bigint[],
    OUT refused_fence bigint[]
) LANGUAGE plpgsql AS $$
DECLARE
    n integer := cardinality(streams);
    v_highest bigint[] := array_fill(0::bigint, ARRAY[n]);
    v_fence bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    v_changed boolean[] := array_fill(false, ARRAY[n]);
    v_event_stream integer[] := '{}';
    v_event_seq bigint[] := '{}';
    v_event_ok boolean[] := '{}';
    v_row record;
    v_k integer;
    v_token bigint;
    v_ok boolean;
    v_events integer := 0;
BEGIN
    refused := '{}';
    refused_highest := '{}';
    refused_fence := '{}';
    -- A row for each stream an append may start (at 1); a stream without a row refuses any
    -- other append whatever another writer does meanwhile, so it needs no row to lock.
    INSERT INTO p2pshard_journal_streams
        SELECT DISTINCT streams[s.k], 0::bigint, NULL::bigint
        FROM unnest(stream_of, first_seqs) AS s(k, first_seq)
        WHERE s.first_seq = 1 ORDER BY 1
        ON CONFLICT (persistence_id) DO NOTHING;
    FOR v_row IN
        SELECT u.k, s.highest, s.fence
        FROM unnest(streams) WITH ORDINALITY AS u(persistence_id, k)
        JOIN p2pshard_journal_streams AS s ON s.persistence_id = u.persistence_id
        ORDER BY s.persistence_id FOR UPDATE OF s
    LOOP
        v_highest[v_row.k] := v_row.highest;
        v_fence[v_row.k] := v_row.fence;
    END LOOP;
    FOR a IN 1 .. cardinality(stream_of) LOOP
        v_k := stream_of[a];
        v_token := tokens[a];
        v_ok := (v_token IS NULL OR v_fence[v_k] IS NULL OR v_token >= v_fence[v_k])
            AND first_seqs[a] = v_highest[v_k] + 1;
        IF v_ok THEN
            v_fence[v_k] := GREATEST(v_fence[v_k], v_token);
            v_highest[v_k] := first_seqs[a] + counts[a] - 1;
            v_changed[v_k] := true;
        ELSE
            refused := refused || a;
            refused_highest := refused_highest || v_highest[v_k];
            refused_fence := refused_fence || v_fence[v_k];
        END IF;
        FOR j IN 0 .. counts[a] - 1 LOOP
            v_events := v_events + 1;
            v_event_stream[v_events] := v_k;
            v_event_seq[v_events] := first_seqs[a] + j;
            v_event_ok[v_events] := v_ok;
        END LOOP;
    END LOOP;
    INSERT INTO p2pshard_journal_events
        SELECT s.persistence_id, e.seq, e.payload
        FROM unnest(v_event_stream, v_event_seq, payloads, v_event_ok) AS e(k, seq, payload, ok)
        JOIN unnest(streams) WITH ORDINALITY AS s(persistence_id, k) ON s.k = e.k
        WHERE e.ok;
    UPDATE p2pshard_journal_streams AS s SET highest = u.highest, fence = u.fence
        FROM unnest(streams, v_highest, v_fence, v_changed)
            AS u(persistence_id, highest, fence, changed)
        WHERE u.changed AND s.persistence_id = u.persistence_id;
END
$$"""
"""The function that writes any batch of appends (see the module's docstring), created with the
tables. Its arguments: the batch's distinct persistence ids; for each append, in order, the
(1-based) index of its stream among them, its first sequence number, its number of events and
its token; every event's payload, append after append. It returns the (1-based) numbers of the
appends it refused, and for each the stream's highest sequence number and fence it saw."""

APPEND_ONE_FUNCTION = """CREATE OR REPLACE FUNCTION p2pshard_journal_append_one_v1(
    p_persistence_id text, p_first_seq bigint, p_token bigint, p_payloads bytea[],
    OUT written boolean, OUT seen_highest bigint, OUT seen_fence bigint
) LANGUAGE plpgsql AS $$
BEGIN
    IF p_first_seq = 1 THEN
        INSERT INTO p2pshard_journal_streams VALUES (p_persistence_id, 0, NULL)
            ON CONFLICT (persistence_id) DO NOTHING;
    END IF;
    SELECT s.highest, s.fence INTO seen_highest, seen_fence
        FROM p2pshard_journal_streams AS s WHERE s.persistence_id = p_persistence_id
        FOR UPDATE;
    seen_highest := coalesce(seen_highest, 0);
    written := (p_token IS NULL OR seen_fence IS NULL OR p_token >= seen_fence)
        AND p_first_seq = seen_highest + 1;
    IF written THEN
        INSERT INTO p2pshard_journal_events
            SELECT p_persistence_id, p_first_seq + e.n - 1, e.payload
            FROM unnest(p_payloads) WITH ORDINALITY AS e(payload, n);
        UPDATE p2pshard_journal_streams
            SET highest = p_first_seq + cardinality(p_payloads) - 1,
                fence = GREATEST(seen_fence, p_token)
            WHERE persistence_id = p_persistence_id;
    END IF;
END
$$"""
"""The batch function for a batch of one append (a lone append, most often), with plain
arguments and statements: about half the server's and the client's work of the general one.
It returns whether it wrote the append, and the stream's highest sequence number and fence it
saw."""

APPEND_DISTINCT_FUNCTION = """CREATE OR REPLACE FUNCTION p2pshard_journal_append_distinct_v1(
    streams text[], first_seqs bigint[], counts integer[], tokens bigint[], payloads bytea[],
    OUT refused integer[], OUT refused_highest bigint[], OUT refused_fence bigint[]
) LANGUAGE plpgsql AS $$
DECLARE
    n integer := cardinality(streams);
    v_moved integer[];
BEGIN
    -- As the general function: the rows of streams an append may start, then every row locked.
    INSERT INTO p2pshard_journal_streams
        SELECT u.p, 0::bigint, NULL::bigint FROM unnest(streams, first_seqs) AS u(p, f)
        WHERE u.f = 1 ORDER BY 1
        ON CONFLICT (persistence_id) DO NOTHING;
    PERFORM FROM p2pshard_journal_streams AS s WHERE s.persistence_id = ANY(streams)
        ORDER BY s.persistence_id FOR UPDATE;
    -- Each append is its stream's only one: it passes if it continues the locked row and its
    -- token is not below the fence; its row moves on and its events are inserted.
    IF cardinality(payloads) = n THEN  -- one event each
        WITH moved AS (
            UPDATE p2pshard_journal_streams AS s SET highest = u.f, fence = GREATEST(s.fence, u.t)
            FROM unnest(streams, first_seqs, tokens) WITH ORDINALITY AS u(p, f, t, k)
            WHERE s.persistence_id = u.p AND s.highest = u.f - 1
                AND (u.t IS NULL OR s.fence IS NULL OR u.t >= s.fence)
            RETURNING u.k, u.p, u.f
        ), written AS (
            INSERT INTO p2pshard_journal_events
                SELECT moved.p, moved.f, payloads[moved.k] FROM moved
        )
        SELECT array_agg(moved.k) INTO v_moved FROM moved;
    ELSE
        WITH a AS (
            SELECT u.p, u.f, u.n, u.t, u.k, sum(u.n) OVER (ORDER BY u.k) - u.n AS o
            FROM unnest(streams, first_seqs, counts, tokens) WITH ORDINALITY AS u(p, f, n, t, k)
        ), moved AS (
            UPDATE p2pshard_journal_streams AS s
                SET highest = a.f + a.n - 1, fence = GREATEST(s.fence, a.t)
            FROM a
            WHERE s.persistence_id = a.p AND s.highest = a.f - 1
                AND (a.t IS NULL OR s.fence IS NULL OR a.t >= s.fence)
            RETURNING a.k, a.p, a.f, a.n, a.o
        ), written AS (
            INSERT INTO p2pshard_journal_events
                SELECT moved.p, moved.f + g.j, payloads[moved.o + g.j + 1]
                FROM moved, generate_series(0, moved.n - 1) AS g(j)
        )
        SELECT array_agg(moved.k) INTO v_moved FROM moved;
    END IF;
    IF coalesce(cardinality(v_moved), 0) = n THEN
        refused := '{}';
        refused_highest := '{}';
        refused_fence := '{}';
        RETURN;
    END IF;
    -- The others are refused; their rows, still locked, are as they were checked.
    SELECT coalesce(array_agg(u.k ORDER BY u.k), '{}'),
            coalesce(array_agg(coalesce(s.highest, 0) ORDER BY u.k), '{}'),
            coalesce(array_agg(s.fence ORDER BY u.k), '{}')
        INTO refused, refused_highest, refused_fence
        FROM unnest(streams) WITH ORDINALITY AS u(p, k)
        LEFT JOIN unnest(v_moved) AS m(k) ON m.k = u.k
        LEFT JOIN p2pshard_journal_streams AS s ON s.persistence_id = u.p
        WHERE m.k IS NULL;
END
$$"""
"""The function for a batch whose appends are on distinct streams (see the module's docstring),
created with the tables. Its arguments, for each append in order: its persistence id, its first
sequence number, its number of events (at least one: as many payloads as appends means one
each) and its token; then every event's payload, append after append. It returns what
:data:`APPEND_FUNCTION` returns. The gain is in its branch for one event per append (about
18 against 25 µs of the server's CPU per append, batches of 128); its branch for several costs
about what the general function does."""

_FUNCTIONS = (
    (
        "p2pshard_journal_append_v1(text[], integer[], bigint[], integer[], bigint[], bytea[])",
        APPEND_FUNCTION,
    ),
    ("p2pshard_journal_append_one_v1(text, bigint, bigint, bytea[])", APPEND_ONE_FUNCTION),
    (
        "p2pshard_journal_append_distinct_v1(text[], bigint[], integer[], bigint[], bytea[])",
        APPEND_DISTINCT_FUNCTION,
    ),
)
"""Each function's signature and its creation."""

_APPEND_ONE = (
    "SELECT * FROM p2pshard_journal_append_one_v1(%s::text, %s::bigint, %s::bigint, %b::bytea[])"
)

_APPEND_DISTINCT = (
    "SELECT * FROM p2pshard_journal_append_distinct_v1(%b::text[], %b::bigint[], "
    "%b::integer[], %b::bigint[], %b::bytea[])"
)

_APPEND = (
    "SELECT * FROM p2pshard_journal_append_v1(%b::text[], %b::integer[], %b::bigint[], "
    "%b::integer[], %b::bigint[], %b::bytea[])"
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


def _refusal(append: PendingAppend, highest: int, fence: int | None) -> JournalError:
    """Why the append function refused ``append``, found by the rules on the row it saw."""
    pid = append.persistence_id
    try:
        admit_token(pid, fence, append.token)
        check_next(pid, append.first_seq, highest)
    except JournalError as refusal:
        return refusal
    return JournalError(  # the function and the rules disagree: a defect, but nothing was written
        pid,
        f"append at {append.first_seq} was refused by the journal's append function against "
        f"highest {highest} and fence {fence}, which the rules admit; nothing was written",
    )


class PostgresJournal(ThreadedJournal[Connection]):
    """Event streams in the PostgreSQL database ``dsn`` names (a libpq string or URL).

    Example:
        >>> journal = PostgresJournal("postgresql://p2pshard@db-host/shop")
    """

    _driver_errors = (psycopg.Error, OSError)
    _commits_at_once = 2

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
            # Created if missing only: replacing a function needs its owner, and a function's
            # body never changes under its name.
            for signature, creation in _FUNCTIONS:
                exists = conn.execute("SELECT to_regprocedure(%s) IS NOT NULL", (signature,))
                if exists.fetchone() != (True,):
                    conn.execute(creation)
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

    # -- the Journal interface (``append``: the base class's) ---------------------------------

    def _write_batch(
        self, conn: Connection, batch: Sequence[PendingAppend]
    ) -> list[JournalError | None]:
        try:
            # One statement, autocommitted: its answer comes once the transaction is committed.
            # Arrays go in binary (%b): psycopg writes them several times faster than as text.
            if len(batch) == 1:
                [append] = batch
                one = conn.execute(
                    _APPEND_ONE,
                    (append.persistence_id, append.first_seq, append.token, append.events),
                ).fetchone()
                assert one is not None
                written, highest, fence = one
                return [None if written else _refusal(append, highest, fence)]
            pids = [a.persistence_id for a in batch]
            appends = (
                [a.first_seq for a in batch],
                [len(a.events) for a in batch],
                [a.token for a in batch],
                [e for a in batch for e in a.events],
            )
            if len(set(pids)) == len(pids):  # each on a stream of its own: whole arrays at once
                row = conn.execute(_APPEND_DISTINCT, (pids, *appends)).fetchone()
            else:
                streams = streams_of(batch)
                index = {pid: k for k, pid in enumerate(streams, 1)}
                stream_of = [index[pid] for pid in pids]
                row = conn.execute(_APPEND, (streams, stream_of, *appends)).fetchone()
        except psycopg.errors.UniqueViolation as exc:  # rolled back: the connection is fine
            raise JournalConflict(
                batch[0].persistence_id,
                f"group commit: another writer stored that sequence number first ({exc}); "
                "nothing was written",
            ) from exc
        assert row is not None
        refusals: list[JournalError | None] = [None] * len(batch)
        for number, highest, fence in zip(*row, strict=True):
            refusals[number - 1] = _refusal(batch[number - 1], highest, fence)
        return refusals

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
