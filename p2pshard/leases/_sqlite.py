"""Leases in a SQLite file: the embedded backend for every node of a cluster on one host.

Theory of operation: one table ``leases(name, owner, token, expires, boot)``. Each operation is
one ``BEGIN IMMEDIATE`` transaction, so concurrent processes take turns on the file's write lock
and a compare-and-swap cannot interleave with another. A release keeps the row, so the next
grant's token is still one more than the last (tokens never go back, even after a release).

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

from .._errors import LeaseUnavailable
from .._store_version import newer_schema

_T = TypeVar("_T")

LEASE_SCHEMA_VERSION = 1
"""The layout of the lease table this release reads and writes (the file's ``user_version``; a
file without a number is of this layout and gets it). A file a newer release wrote is refused."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    owner TEXT,
    token INTEGER NOT NULL,
    expires REAL NOT NULL,
    boot TEXT NOT NULL
)
"""


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
            conn.execute(_SCHEMA)
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
            row = conn.execute(
                "SELECT owner, token, expires, boot FROM leases WHERE name = ?", (name,)
            ).fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO leases VALUES (?, ?, 1, ?, ?)", (name, owner, now + ttl, boot)
                )
                return 1
            held_by, token, expires, row_boot = row
            if held_by is not None and held_by != owner and row_boot == boot and expires > now:
                return None
            conn.execute(
                "UPDATE leases SET owner = ?, token = ?, expires = ?, boot = ? WHERE name = ?",
                (owner, token + 1, now + ttl, boot, name),
            )
            return int(token) + 1

        return await self._run(f"acquire of {name!r}", acquire)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        """See :meth:`p2pshard.LeaseBackend.renew`."""

        def renew(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "UPDATE leases SET expires = ? WHERE name = ? AND owner = ? AND token = ? "
                "AND boot = ? AND expires > ?",
                (now + ttl, name, owner, token, boot, now),
            )
            return cursor.rowcount == 1

        return await self._run(f"renewal of {name!r}", renew)

    async def release(self, name: str, owner: str, token: int) -> bool:
        """See :meth:`p2pshard.LeaseBackend.release`."""

        def release(conn: sqlite3.Connection, now: float, boot: str) -> bool:
            cursor = conn.execute(
                "UPDATE leases SET owner = NULL, expires = 0 "
                "WHERE name = ? AND owner = ? AND token = ?",
                (name, owner, token),
            )
            return cursor.rowcount == 1

        return await self._run(f"release of {name!r}", release)

    async def holder(self, name: str) -> tuple[str, int] | None:
        """See :meth:`p2pshard.LeaseBackend.holder`."""

        def holder(conn: sqlite3.Connection, now: float, boot: str) -> tuple[str, int] | None:
            row = conn.execute(
                "SELECT owner, token FROM leases WHERE name = ? AND owner IS NOT NULL "
                "AND boot = ? AND expires > ?",
                (name, boot, now),
            ).fetchone()
            return None if row is None else (str(row[0]), int(row[1]))

        return await self._run(f"read of {name!r}", holder)

    async def aclose(self) -> None:
        """Close the connection that keeps the write-ahead log open."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.close()
