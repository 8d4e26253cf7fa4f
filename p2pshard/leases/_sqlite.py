"""Leases in a SQLite file: the embedded backend for every node of a cluster on one host.

Theory of operation: one table ``leases(name, owner, token, expires, boot, node_lease)``. Each
operation is one ``BEGIN IMMEDIATE`` transaction, so concurrent processes take turns on the file's
write lock and a compare-and-swap cannot interleave with another. A release keeps the row, so the
next grant's token is still one more than the last (tokens never go back, even after a release).

Node leases (see ``p2pshard.leases._node_lease``) are the heartbeat rows of ``node_leases(id,
owner, expires, boot)``, one per owner at a time: a lease row whose ``node_lease`` names one is
held while that heartbeat row has not expired (its own ``expires`` is not read), so a node's
keep-alive is one update of one row however many shard leases it holds. Revoking the node lease
frees its rows and deletes the heartbeat row in one transaction. Heartbeat rows that expired are
deleted when a node lease is granted. Schema version 2 added the table and the column; a file of
version 1 gets them when opened.

Expiry uses the host's monotonic clock (``time.monotonic``), the clock trio uses too, so a holder's
deadline and the row's ``expires`` run at the same rate and a wall-clock step cannot extend a
lease. That clock starts again at boot, so each row also records the boot id
(``/proc/sys/kernel/random/boot_id``): a row written before a reboot has expired.

Each operation opens its own connection in a worker thread (at most ``threads`` at a time), so an
operation that outlives its caller's ``operation_timeout`` is abandoned without blocking the
next; an abandoned acquire may still commit, and that grant then expires unrenewed after ``ttl``.
One more connection stays open for the backend's lifetime: when the last connection to a WAL
database closes, SQLite checkpoints and deletes the log, which costs several disk syncs; with it
open an operation takes a fraction of a millisecond instead of ~20 ms on a slow disk.
A locked or unreadable file raises :class:`LeaseUnavailable` naming the file and the error.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import trio

from .._errors import LeaseUnavailable, NodeLeaseGone
from .._store_version import newer_schema

_T = TypeVar("_T")

LEASE_SCHEMA_VERSION = 2
"""The layout of the lease tables this release reads and writes (the file's ``user_version``; a
file without a number is of layout 1). Version 2 added node leases; a file of an older layout is
migrated when opened, and one a newer release wrote is refused."""

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    owner TEXT,
    token INTEGER NOT NULL,
    expires REAL NOT NULL,
    boot TEXT NOT NULL,
    node_lease INTEGER
)
""",
    """
CREATE TABLE IF NOT EXISTS node_leases (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL,
    expires REAL NOT NULL,
    boot TEXT NOT NULL
)
""",
    "CREATE INDEX IF NOT EXISTS leases_by_node_lease ON leases (node_lease)",
)

_HELD = """
owner IS NOT NULL AND (
    (node_lease IS NULL AND boot = :boot AND expires > :now)
    OR EXISTS (
        SELECT 1 FROM node_leases AS n
        WHERE n.id = leases.node_lease AND n.boot = :boot AND n.expires > :now
    )
)
"""
"""Whether a row of ``leases`` is held now: its own expiry, or its node lease's."""


@functools.cache
def boot_id() -> str:
    """This boot's id ("" where the system does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class SqliteLeaseBackend:
    """Leases in the SQLite file ``path``, shared by every process on this host that uses it.

    ``busy_timeout`` is how long an operation waits for another process's transaction before it
    fails with :class:`LeaseUnavailable`.
    """

    def __init__(self, path: str | Path, *, busy_timeout: float = 5.0, threads: int = 4) -> None:
        self.path = Path(path)
        self._busy_timeout = busy_timeout
        self._limiter = trio.CapacityLimiter(threads)
        self._ready = False
        self._creating = trio.Lock()
        self._keeper: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            conn.close()
            raise
        return conn

    def _create(self) -> None:
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            found = int(conn.execute("PRAGMA user_version").fetchone()[0])
            where = f"sqlite lease file {self.path}"
            refusal = newer_schema("lease", where, found, LEASE_SCHEMA_VERSION)
            if refusal is not None:
                raise LeaseUnavailable(refusal)
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
            if "leases" in tables:
                columns = {row[1] for row in conn.execute("PRAGMA table_info(leases)")}
                if "node_lease" not in columns:  # a file of layout 1
                    conn.execute("ALTER TABLE leases ADD COLUMN node_lease INTEGER")
            for statement in _SCHEMA:
                conn.execute(statement)
            if found < LEASE_SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version = {LEASE_SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.close()  # an uncommitted transaction rolls back
            raise
        self._keeper = conn

    async def _run(self, what: str, fn: Callable[[sqlite3.Connection, float, str], _T]) -> _T:
        if not self._ready:
            async with self._creating:  # one thread creates the table, the others wait
                if not self._ready:
                    await self._in_thread(what, self._create)
                    self._ready = True

        def work() -> _T:
            conn = self._connect()
            try:
                conn.execute("BEGIN IMMEDIATE")
                result = fn(conn, time.monotonic(), boot_id())
                conn.execute("COMMIT")
                return result
            finally:
                conn.close()  # an uncommitted transaction rolls back

        return await self._in_thread(what, work)

    async def _in_thread(self, what: str, work: Callable[[], _T]) -> _T:
        try:
            return await trio.to_thread.run_sync(
                work, limiter=self._limiter, abandon_on_cancel=True
            )
        except (sqlite3.Error, OSError) as exc:
            raise LeaseUnavailable(f"sqlite lease file {self.path}: {what} failed: {exc}") from exc

    async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """See :meth:`p2pshard.LeaseBackend.try_acquire`."""

        def acquire(conn: sqlite3.Connection, now: float, boot: str) -> int | None:
            return _grant(conn, name, owner, now, boot, now + ttl, None)

        return await self._run(f"acquire of {name!r}", acquire)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        """See :meth:`p2pshard.LeaseBackend.renew`."""

        def renew(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "UPDATE leases SET expires = ? WHERE name = ? AND owner = ? AND token = ? "
                "AND boot = ? AND expires > ? AND node_lease IS NULL",
                (now + ttl, name, owner, token, boot, now),
            )
            return cursor.rowcount == 1

        return await self._run(f"renewal of {name!r}", renew)

    async def release(self, name: str, owner: str, token: int) -> bool:
        """See :meth:`p2pshard.LeaseBackend.release`."""

        def release(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "UPDATE leases SET owner = NULL, expires = 0, node_lease = NULL "
                "WHERE name = ? AND owner = ? AND token = ?",
                (name, owner, token),
            )
            return cursor.rowcount == 1

        return await self._run(f"release of {name!r}", release)

    async def holder(self, name: str) -> tuple[str, int] | None:
        """See :meth:`p2pshard.LeaseBackend.holder`."""

        def holder(conn: sqlite3.Connection, now: float, boot: str) -> tuple[str, int] | None:
            row = conn.execute(
                f"SELECT owner, token FROM leases WHERE name = :name AND {_HELD}",
                {"name": name, "boot": boot, "now": now},
            ).fetchone()
            return None if row is None else (str(row[0]), int(row[1]))

        return await self._run(f"read of {name!r}", holder)

    async def grant_node_lease(self, owner: str, ttl: float) -> int:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.grant_node_lease`."""

        def grant(conn: sqlite3.Connection, now: float, boot: str) -> int:
            conn.execute("DELETE FROM node_leases WHERE expires <= ? OR boot != ?", (now, boot))
            cursor = conn.execute(
                "INSERT INTO node_leases (owner, expires, boot) VALUES (?, ?, ?)",
                (owner, now + ttl, boot),
            )
            assert cursor.lastrowid is not None
            return cursor.lastrowid

        return await self._run(f"grant of the node lease of {owner!r}", grant)

    async def keep_node_lease(self, owner: str, lease_id: int, ttl: float) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.keep_node_lease`."""

        def keep(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "UPDATE node_leases SET expires = ? WHERE id = ? AND owner = ? AND boot = ? "
                "AND expires > ?",
                (now + ttl, lease_id, owner, boot, now),
            )
            return cursor.rowcount == 1

        return await self._run(f"renewal of the node lease of {owner!r}", keep)

    async def revoke_node_lease(self, owner: str, lease_id: int) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.revoke_node_lease`."""

        def revoke(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "DELETE FROM node_leases WHERE id = ? AND owner = ?", (lease_id, owner)
            )
            if cursor.rowcount != 1:
                return False
            conn.execute(
                "UPDATE leases SET owner = NULL, expires = 0, node_lease = NULL "
                "WHERE node_lease = ?",
                (lease_id,),
            )
            return True

        return await self._run(f"revoke of the node lease of {owner!r}", revoke)

    async def try_acquire_attached(self, name: str, owner: str, lease_id: int) -> int | None:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.try_acquire_attached`."""

        def acquire(conn: sqlite3.Connection, now: float, boot: str) -> int | None:
            alive = conn.execute(
                "SELECT 1 FROM node_leases WHERE id = ? AND owner = ? AND boot = ? AND expires > ?",
                (lease_id, owner, boot, now),
            ).fetchone()
            if alive is None:
                raise NodeLeaseGone(
                    f"sqlite lease file {self.path}: node lease {lease_id} of {owner!r} has ended"
                )
            return _grant(conn, name, owner, now, boot, 0.0, lease_id)

        return await self._run(f"acquire of {name!r}", acquire)

    async def release_attached(self, name: str, owner: str, lease_id: int, token: int) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.release_attached`."""

        def release(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "UPDATE leases SET owner = NULL, expires = 0, node_lease = NULL "
                "WHERE name = ? AND owner = ? AND token = ? AND node_lease = ?",
                (name, owner, token, lease_id),
            )
            return cursor.rowcount == 1

        return await self._run(f"release of {name!r}", release)

    async def aclose(self) -> None:
        """Close the connection that keeps the write-ahead log open."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.close()


def _grant(
    conn: sqlite3.Connection,
    name: str,
    owner: str,
    now: float,
    boot: str,
    expires: float,
    node_lease: int | None,
) -> int | None:
    """Grant ``name`` to ``owner`` unless another owner holds it: the new token, or None."""
    row = conn.execute(
        f"SELECT token, owner IS NOT NULL AND owner != :owner AND {_HELD} FROM leases "
        "WHERE name = :name",
        {"name": name, "owner": owner, "boot": boot, "now": now},
    ).fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO leases VALUES (?, ?, 1, ?, ?, ?)", (name, owner, expires, boot, node_lease)
        )
        return 1
    token, held_by_another = row
    if held_by_another:
        return None
    conn.execute(
        "UPDATE leases SET owner = ?, token = ?, expires = ?, boot = ?, node_lease = ? "
        "WHERE name = ?",
        (owner, token + 1, expires, boot, node_lease, name),
    )
    return int(token) + 1
