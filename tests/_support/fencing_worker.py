"""A process that holds a lease and writes with its fencing token, for the SIGSTOP fencing test.

Run as ``python -m tests._support.fencing_worker LEASE_DB STORE_DB OWNER``. It takes the lease
``fenced`` in the SQLite lease file LEASE_DB, prints ``granted <token>``, and then answers each
line on stdin:

    write VALUE  -> check <True|False>, then ``written`` or ``rejected`` (it writes even when
                    check() is false, to show that the store refuses a stale token)
    lost?        -> lost <True|False> (whether the keep-alive has declared the lease lost)

The store (:class:`FencedStore`) is a SQLite table that remembers the largest token it has seen
and refuses writes that carry a smaller one.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import trio

from p2pshard import Lease, LeaseSettings, SqliteLeaseBackend

SETTINGS = LeaseSettings(ttl=2.0, renew_interval=0.3, operation_timeout=1.0, safety_margin=0.3)


class FencedStore:
    """One value per key, written only with a token at least as large as the last write's."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, timeout=5.0)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS fenced (key TEXT PRIMARY KEY, value TEXT, token INTEGER)"
        )

    def write(self, key: str, value: str, token: int) -> bool:
        """Store ``value`` unless a write with a larger token came first."""
        cursor = self._db.execute(
            "INSERT INTO fenced VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE "
            "SET value = excluded.value, token = excluded.token WHERE excluded.token >= token",
            (key, value, token),
        )
        return cursor.rowcount == 1

    def close(self) -> None:
        self._db.close()

    def read(self, key: str) -> tuple[str, int] | None:
        row = self._db.execute("SELECT value, token FROM fenced WHERE key = ?", (key,)).fetchone()
        return None if row is None else (str(row[0]), int(row[1]))


async def main(lease_db: Path, store_db: Path, owner: str) -> None:
    store = FencedStore(store_db)
    backend = SqliteLeaseBackend(lease_db)
    async with trio.open_nursery() as nursery:
        lease = Lease(backend, "fenced", owner, SETTINGS, nursery=nursery)
        with trio.fail_after(30):
            while (grant := await lease.acquire()) is None:  # noqa: ASYNC110 - polls the file
                await trio.sleep(0.05)
        lost = trio.Event()

        async def watch() -> None:
            await lease.wait_lost()
            lost.set()

        nursery.start_soon(watch)
        print(f"granted {grant.token}", flush=True)
        stdin = trio.wrap_file(sys.stdin)
        async for line in stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "write":
                print(f"check {lease.check()}", flush=True)
                written = store.write("k", arg, grant.token)
                print("written" if written else "rejected", flush=True)
            elif command == "lost?":
                print(f"lost {lost.is_set()}", flush=True)
        store.close()
        nursery.cancel_scope.cancel()
    await backend.aclose()


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
