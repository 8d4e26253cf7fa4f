"""The durable store: durable keys' yrs updates appended to SQLite, fsynced before acknowledging.

Theory of operation: one SQLite file per node (WAL journal, ``synchronous=FULL``, so a committed
transaction is on disk). Every change of a durable key is appended as a row of ``updates``; every
``compact_after`` appends the key's rows are replaced by one row of ``snapshots`` holding its full
state, in the same transaction, so a crash leaves either the rows or the snapshot, never neither.
A deleted key keeps a tombstone row. Loading replays each key's snapshot, then its rows in order.

Batches are written in one transaction: the shell groups every change that queued up while the
previous commit was running (group commit), so many concurrent writes share one fsync.

pycrdt-store is not used: it loses data when squashing and swallows write errors. Here a failed
transaction raises, and every change in it fails with :class:`StoreFailure`.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import attrs

from membership import ConfigurationError

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS updates (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS updates_by_key ON updates (key, seq);
CREATE TABLE IF NOT EXISTS snapshots (
    key TEXT PRIMARY KEY,
    data BLOB,
    deleted INTEGER NOT NULL DEFAULT 0
);
"""


@attrs.frozen
class Append:
    """Append ``data`` (a yrs update) to ``key``; None marks the key deleted."""

    key: str
    data: bytes | None


@attrs.frozen
class Snapshot:
    """Replace the rows of ``key`` by its full state ``data``."""

    key: str
    data: bytes


StoreOperation = Append | Snapshot


class DurableStore:
    """One SQLite file holding a node's durable keys. Not thread-safe: one caller at a time.

    Example:
        >>> store = DurableStore(Path("/tmp/node-1.sqlite"))  # doctest: +SKIP
        >>> store.write([Append("coordinator", update)])  # doctest: +SKIP
        >>> store.load()["coordinator"]  # doctest: +SKIP
    """

    def __init__(self, path: Path) -> None:
        """Open (or create) the store at ``path``.

        Raises:
            ConfigurationError: the file is not a store of this version, or cannot be opened.
        """
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as error:
            raise ConfigurationError(f"cannot open the durable store {path}: {error}") from None
        try:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):  # checked before changing anything
                raise ConfigurationError(
                    f"{path} is a durable store of schema version {version}; this version of "
                    f"p2pshard reads version {SCHEMA_VERSION}"
                )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise ConfigurationError(
                f"{path} is not a usable durable store (an SQLite file): {error}"
            ) from None
        except BaseException:
            self._db.close()
            raise

    def load(self) -> dict[str, list[bytes] | None]:
        """Every stored key: its snapshot and appended updates in order, or None if deleted."""
        keys: dict[str, list[bytes] | None] = {}
        for key, data, deleted in self._db.execute(
            "SELECT key, data, deleted FROM snapshots ORDER BY key"
        ):
            keys[key] = None if deleted else [data]
        for key, data in self._db.execute("SELECT key, data FROM updates ORDER BY seq"):
            updates = keys.setdefault(key, [])
            if updates is not None:
                updates.append(data)
        return keys

    def write(self, operations: Sequence[StoreOperation]) -> None:
        """Apply ``operations`` in one transaction and wait until it is on disk.

        Raises:
            sqlite3.Error | OSError: nothing of the batch was stored.
        """
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for operation in operations:
                match operation:
                    case Append(key=key, data=None):
                        db.execute("DELETE FROM updates WHERE key = ?", (key,))
                        db.execute(
                            "INSERT OR REPLACE INTO snapshots (key, data, deleted) "
                            "VALUES (?, NULL, 1)",
                            (key,),
                        )
                    case Append(key=key, data=data):
                        db.execute("INSERT INTO updates (key, data) VALUES (?, ?)", (key, data))
                    case Snapshot(key=key, data=data):
                        db.execute("DELETE FROM updates WHERE key = ?", (key,))
                        db.execute(
                            "INSERT OR REPLACE INTO snapshots (key, data, deleted) "
                            "VALUES (?, ?, 0)",
                            (key, data),
                        )
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):  # the original error says more
                db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close the file."""
        self._db.close()
