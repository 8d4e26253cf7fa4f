"""The durable store: SQLite appends, snapshots and tombstones (crdt._store)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pycrdt import Doc, Map

from crdt._digest import digest
from crdt._store import SCHEMA_VERSION, Append, DurableStore, Snapshot, StoreOperation
from membership import ConfigurationError


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "node-1.sqlite"


@pytest.fixture
def store(path: Path) -> Iterator[DurableStore]:
    store = DurableStore(path)
    yield store
    store.close()


def pragma(store: DurableStore, name: str) -> Any:
    return store._db.execute(f"PRAGMA {name}").fetchone()[0]


# --- appends, snapshots, tombstones --------------------------------------------------------------


def test_new_store_is_empty(store: DurableStore, path: Path) -> None:
    assert store.path == path
    assert path.is_file()
    assert store.load() == {}
    store.write([])
    assert store.load() == {}


def test_append_and_load_keep_order(store: DurableStore) -> None:
    store.write([Append("a", b"a1"), Append("b", b"b1"), Append("a", b"a2")])
    store.write([Append("a", b"a3")])
    store.write([Append("c", b"\x00\xff" * 1000), Append("b", b"b2")])
    assert store.load() == {
        "a": [b"a1", b"a2", b"a3"],
        "b": [b"b1", b"b2"],
        "c": [b"\x00\xff" * 1000],
    }
    # Loading does not consume anything.
    assert store.load()["a"] == [b"a1", b"a2", b"a3"]


def test_many_appends_keep_order(store: DurableStore) -> None:
    updates = [i.to_bytes(2, "big") for i in range(300)]
    store.write([Append("k", u) for u in updates[:270]])
    for u in updates[270:]:
        store.write([Append("k", u)])
    assert store.load() == {"k": updates}


def test_snapshot_replaces_earlier_rows(store: DurableStore) -> None:
    store.write([Append("a", b"a1"), Append("a", b"a2"), Append("b", b"b1")])
    store.write([Snapshot("a", b"A12")])
    assert store.load() == {"a": [b"A12"], "b": [b"b1"]}
    store.write([Append("a", b"a3")])
    assert store.load() == {"a": [b"A12", b"a3"], "b": [b"b1"]}
    store.write([Snapshot("a", b"A123")])
    assert store.load() == {"a": [b"A123"], "b": [b"b1"]}
    count = store._db.execute("SELECT COUNT(*) FROM updates WHERE key = 'a'").fetchone()[0]
    assert count == 0


def test_snapshot_and_appends_in_one_batch(store: DurableStore) -> None:
    store.write(
        [
            Append("a", b"a1"),
            Snapshot("a", b"S"),
            Append("a", b"a2"),
            Snapshot("b", b"T"),
            Append("b", b"b1"),
        ]
    )
    assert store.load() == {"a": [b"S", b"a2"], "b": [b"T", b"b1"]}


def test_tombstone(store: DurableStore) -> None:
    store.write([Append("a", b"a1"), Snapshot("a", b"S"), Append("a", b"a2"), Append("b", b"b")])
    store.write([Append("a", None)])
    assert store.load() == {"a": None, "b": [b"b"]}
    count = store._db.execute("SELECT COUNT(*) FROM updates WHERE key = 'a'").fetchone()[0]
    assert count == 0
    # A deleted key stays deleted, whatever is appended to it later.
    store.write([Append("a", b"late")])
    assert store.load() == {"a": None, "b": [b"b"]}


def test_tombstone_of_a_key_never_written(store: DurableStore) -> None:
    store.write([Append("gone", None)])
    assert store.load() == {"gone": None}


def test_tombstone_survives_reopen(path: Path) -> None:
    store = DurableStore(path)
    store.write([Append("a", b"a1"), Append("b", b"b1")])
    store.write([Append("a", None)])
    store.close()
    store = DurableStore(path)
    try:
        assert store.load() == {"a": None, "b": [b"b1"]}
    finally:
        store.close()


def test_reopen_after_close_keeps_data(path: Path) -> None:
    store = DurableStore(path)
    store.write([Append("a", b"a1"), Append("b", b"b1")])
    store.write([Snapshot("b", b"B"), Append("a", b"a2"), Append("b", b"b2")])
    before = store.load()
    store.close()
    with pytest.raises(sqlite3.ProgrammingError):
        store.load()
    store = DurableStore(path)
    try:
        assert store.load() == before == {"a": [b"a1", b"a2"], "b": [b"B", b"b2"]}
        store.write([Append("a", b"a3")])
        assert store.load()["a"] == [b"a1", b"a2", b"a3"]
    finally:
        store.close()
    # Committed data is in the database file itself or its WAL: a plain reader sees it.
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT COUNT(*) FROM updates").fetchone()[0] == 4
    finally:
        db.close()


def test_opens_in_a_directory_that_does_not_exist_yet(tmp_path: Path) -> None:
    path = tmp_path / "data" / "nested" / "x.sqlite"
    store = DurableStore(path)
    try:
        store.write([Append("k", b"v")])
        assert store.load() == {"k": [b"v"]}
    finally:
        store.close()
    assert path.is_file()


# --- durability settings -------------------------------------------------------------------------


def test_wal_journal_and_full_sync(store: DurableStore) -> None:
    assert pragma(store, "journal_mode") == "wal"
    assert pragma(store, "synchronous") == 2  # FULL
    assert pragma(store, "user_version") == SCHEMA_VERSION == 1


def test_autocommit_between_batches(store: DurableStore) -> None:
    store.write([Append("a", b"1")])
    assert not store._db.in_transaction
    # Another connection sees the batch at once: it was committed, not left open.
    other = sqlite3.connect(store.path)
    try:
        assert other.execute("SELECT data FROM updates").fetchall() == [(b"1",)]
    finally:
        other.close()


# --- files that are not stores -------------------------------------------------------------------


def test_file_that_is_not_sqlite(path: Path) -> None:
    garbage = b"not a database at all, only some text\n" * 200
    path.write_bytes(garbage)
    with pytest.raises(ConfigurationError) as excinfo:
        DurableStore(path)
    message = str(excinfo.value)
    assert str(path) in message
    assert "is not a usable durable store" in message
    assert path.read_bytes() == garbage  # left as it was


@pytest.mark.parametrize("version", [2, 7, -1])
def test_store_of_another_schema_version(path: Path, version: int) -> None:
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={version}")
    db.execute("CREATE TABLE updates (x)")
    db.execute("INSERT INTO updates VALUES ('kept')")
    db.commit()
    db.close()
    with pytest.raises(ConfigurationError) as excinfo:
        DurableStore(path)
    assert str(excinfo.value) == (
        f"{path} is a durable store of schema version {version}; this version of p2pshard reads "
        "version 1"
    )
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == version
        assert db.execute("SELECT * FROM updates").fetchall() == [("kept",)]
    finally:
        db.close()


def test_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot open the durable store") as excinfo:
        DurableStore(tmp_path)
    assert str(tmp_path) in str(excinfo.value)


def test_parent_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "sub" / "x.sqlite"
    with pytest.raises(ConfigurationError, match="cannot open the durable store") as excinfo:
        DurableStore(path)
    assert str(path) in str(excinfo.value)


# --- a failed batch stores nothing ---------------------------------------------------------------


def test_full_disk_stores_nothing_of_the_batch(store: DurableStore) -> None:
    store.write([Append("a", b"a1"), Snapshot("b", b"B")])
    before = store.load()
    pages = pragma(store, "page_count")
    assert pragma(store, f"max_page_count={pages + 2}") == pages + 2
    big: list[StoreOperation] = [Append("a", b"a2"), Snapshot("b", b"B2"), Append("c", b"c1")]
    big += [Append(f"k{i}", bytes([i]) * 4000) for i in range(50)]
    with pytest.raises(sqlite3.Error, match="full"):
        store.write(big)
    assert store.load() == before
    assert not store._db.in_transaction
    # The store still works for writes that fit.
    store.write([Append("a", b"a3"), Append("c", b"c1")])
    assert store.load() == {"a": [b"a1", b"a3"], "b": [b"B"], "c": [b"c1"]}
    # And once there is room again, for big ones too.
    store._db.execute("PRAGMA max_page_count=1000000")
    store.write(big)
    loaded = store.load()
    assert loaded["a"] == [b"a1", b"a3", b"a2"]
    assert loaded["b"] == [b"B2"]
    assert loaded["k49"] == [bytes([49]) * 4000]


def test_bad_operation_late_in_a_batch_stores_nothing(store: DurableStore) -> None:
    store.write([Append("a", b"a1")])
    bad: Any = {"not": "bytes"}
    batch: list[StoreOperation] = [Append("a", b"a2"), Snapshot("a", b"S"), Append("b", bad)]
    with pytest.raises(sqlite3.ProgrammingError):
        store.write(batch)
    assert store.load() == {"a": [b"a1"]}
    assert not store._db.in_transaction
    store.write([Append("b", b"b1")])
    assert store.load() == {"a": [b"a1"], "b": [b"b1"]}


def test_write_while_another_connection_holds_the_lock(store: DurableStore) -> None:
    other = sqlite3.connect(store.path, timeout=0, isolation_level=None)
    store._db.execute("PRAGMA busy_timeout=0")
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            store.write([Append("a", b"a1")])
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert store.load() == {}
    store.write([Append("a", b"a1")])
    assert store.load() == {"a": [b"a1"]}


# --- a pycrdt document rebuilt from the store ----------------------------------------------------


def test_loaded_updates_rebuild_the_document(path: Path) -> None:
    doc: Doc[Any] = Doc(client_id=1)
    root = doc.get("m", type=Map)
    pending: list[bytes] = []
    doc.observe(lambda event: pending.append(event.update))
    store = DurableStore(path)

    def change(key: str, value: object | None) -> None:
        with doc.transaction():
            if value is None:
                del root[key]
            else:
                root[key] = value
        store.write([Append("doc", u) for u in pending] + [Append("other", b"x")])
        pending.clear()

    change("a", 1)
    change("b", "two")
    change("a", 3)
    store.write([Snapshot("doc", doc.get_update())])  # compaction
    change("c", [1, 2])
    change("b", None)
    store.close()

    store = DurableStore(path)
    try:
        loaded = store.load()
    finally:
        store.close()
    updates = loaded["doc"]
    assert updates is not None
    assert len(updates) == 3  # the snapshot and the two changes after it
    rebuilt: Doc[Any] = Doc(client_id=2)
    for update in updates:
        rebuilt.apply_update(update)
    assert rebuilt.get("m", type=Map).to_py() == {"a": 3.0, "c": [1.0, 2.0]}
    assert digest(rebuilt) == digest(doc)
