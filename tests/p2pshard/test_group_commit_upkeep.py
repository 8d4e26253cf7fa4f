"""What a SQL journal does after a group commit: answer first, then its upkeep.

A batch's appends are answered the moment its transaction has committed; the backend's upkeep
after the commit (SQLite: the checkpoint of its write-ahead log) runs after that in the commit's
thread, and the next batch waits for it. SQLite checkpoints there after a large batch once group
commits have written enough pages, so that under heavy load no commit has SQLite's automatic
checkpoint inside it. A failing
or stalled upkeep never fails appends that are already durable.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pshard import SqliteJournal
from p2pshard.persistence import _sqlite
from p2pshard.persistence._group_commit import PendingAppend, checkpoint_due

EVENT = b"e" * 100


class Gate:
    """Holds the upkeep of the commits it is armed for until released (a worker thread waits)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.release.wait(20), "the test never released the upkeep"

    async def entered_within(self, seconds: float) -> bool:
        return await trio.to_thread.run_sync(self.entered.wait, seconds)


class GatedJournal(SqliteJournal):
    """A SQLite journal whose upkeep after a commit waits at the gates queued for it."""

    def __init__(self, path: Path, **tuning: Any) -> None:
        super().__init__(path, **tuning)
        self.gates: list[Gate] = []
        self.upkept: list[list[str]] = []
        self.fail_with: Exception | None = None

    def _upkeep_after(
        self, batch: Sequence[PendingAppend]
    ) -> Callable[[sqlite3.Connection], None] | None:
        checkpoint = super()._upkeep_after(batch)

        def upkeep(conn: sqlite3.Connection) -> None:
            self.upkept.append([a.persistence_id for a in batch])
            if self.gates:
                self.gates.pop(0).hold()
            if self.fail_with is not None:
                raise self.fail_with
            if checkpoint is not None:
                checkpoint(conn)

        return upkeep


def test_when_a_checkpoint_is_due_after_a_group_commit() -> None:
    """The sans-IO rule: pages estimated since the last one, and only after a large batch."""
    small = [PendingAppend(f"T|{i}", 1, [EVENT], None) for i in range(4)]  # 2 pages each
    large = [PendingAppend("T|big", 1, [b"x" * 10_000, EVENT], None)]  # 1 + 2 + 2 pages
    assert checkpoint_due(0, small, pages=10, min_batch=4) == (8, False)
    assert checkpoint_due(8, small, pages=10, min_batch=4) == (0, True)
    assert checkpoint_due(8, small, pages=10, min_batch=5) == (16, False)  # batch too small
    assert checkpoint_due(0, large, pages=5, min_batch=1) == (0, True)
    assert checkpoint_due(0, large, pages=6, min_batch=1) == (5, False)


async def events_of(journal: SqliteJournal, pid: str) -> list[bytes]:
    return [data for _, data in (await journal.recover(pid, token=None)).events]


async def test_a_batch_is_answered_before_its_upkeep_and_the_next_batch_waits_for_it(
    tmp_path: Path,
) -> None:
    journal = GatedJournal(tmp_path / "journal.db")
    await journal.append("T|setup", 1, [EVENT], token=None)  # the tables
    first, second = Gate(), Gate()
    journal.gates = [first, second]
    done: dict[str, trio.Event] = {pid: trio.Event() for pid in ("T|a", "T|b", "T|c", "T|d")}

    async def append(pid: str) -> None:
        await journal.append(pid, 1, [EVENT], token=None)
        done[pid].set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(append, "T|a")  # commits alone; its upkeep waits at the first gate
        assert await first.entered_within(10)
        nursery.start_soon(append, "T|b")  # these wait for the commit in flight, then go
        nursery.start_soon(append, "T|c")  # together
        await trio.testing.wait_all_tasks_blocked()
        first.release.set()
        assert await second.entered_within(10)  # b and c committed; their upkeep is held
        with trio.fail_after(10):
            await done["T|b"].wait()
            await done["T|c"].wait()
        assert sorted(journal.upkept[-1]) == ["T|b", "T|c"]
        nursery.start_soon(append, "T|d")
        await trio.sleep(0.3)
        assert not done["T|d"].is_set(), "the next batch began before the upkeep ended"
        assert len(journal.upkept) == 3  # setup, a, then b and c: d is not committed yet
        second.release.set()
        with trio.fail_after(10):
            await done["T|d"].wait()
    for pid in done:
        assert await events_of(journal, pid) == [EVENT]
    stats = journal.group_commit_statistics()
    assert (stats.commits, stats.appends, stats.failed) == (4, 5, 0)
    await journal.aclose()


async def test_an_upkeep_that_fails_or_stalls_fails_no_append(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = GatedJournal(tmp_path / "journal.db", operation_timeout=0.5)
    await journal.append("T|setup", 1, [EVENT], token=None)

    journal.fail_with = RuntimeError("upkeep broke")
    with caplog.at_level(logging.WARNING, logger="p2pshard.persistence"):
        await journal.append("T|x", 1, [EVENT], token=None)  # answered: it is durable
    assert "after a group commit: upkeep broke" in caplog.text
    journal.fail_with = None
    await journal.append("T|x", 2, [EVENT], token=None)  # the next one is fine

    stalled = Gate()
    journal.gates = [stalled]
    with trio.fail_after(10), caplog.at_level(logging.WARNING, logger="p2pshard.persistence"):
        await journal.append("T|x", 3, [EVENT], token=None)  # past the timeout: still answered
    assert "did not finish within operation_timeout (0.5 s); the next batch waits" in caplog.text
    assert stalled.entered.is_set()
    assert not stalled.release.is_set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: journal.append("T|x", 4, [EVENT], token=None))
        await trio.sleep(0.2)  # the next commit waits for the stalled upkeep's thread
        stalled.release.set()
    assert await events_of(journal, "T|x") == [EVENT] * 4
    assert journal.group_commit_statistics().failed == 0
    await journal.aclose()


class CheckpointFails:
    """A connection whose checkpoints fail as on a broken disk; everything else passes through."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if "wal_checkpoint" in sql:
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def database_file(path: Path) -> bytes:
    """The database file itself: in WAL mode only a checkpoint writes to it."""
    return path.read_bytes()


async def test_sqlite_checkpoints_after_group_commits_not_inside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal.db"
    monkeypatch.setattr(_sqlite, "CHECKPOINT_PAGES", 1_000_000_000, raising=False)
    monkeypatch.setattr(_sqlite, "CHECKPOINT_BATCH", 1, raising=False)
    journal = SqliteJournal(path)
    stored = 0

    async def add(events: int) -> None:
        nonlocal stored
        await journal.append("T|a", stored + 1, [EVENT] * events, token=None)
        stored += events

    for _ in range(5):
        await add(3)
    untouched = database_file(path)
    await add(1)
    assert database_file(path) == untouched  # far below SQLite's own 1,000 pages: no checkpoint

    monkeypatch.setattr(_sqlite, "CHECKPOINT_PAGES", 5, raising=False)
    await add(4)  # over 5 pages estimated since the last: a checkpoint
    checkpointed = database_file(path)
    assert checkpointed != untouched
    await add(1)  # 2 more: none
    assert database_file(path) == checkpointed
    await add(2)  # 3 more, 5 in all: the next
    checkpointed_again = database_file(path)
    assert checkpointed_again != checkpointed
    assert len(await events_of(journal, "T|a")) == stored == 5 * 3 + 1 + 4 + 1 + 2

    monkeypatch.setattr(_sqlite, "CHECKPOINT_BATCH", 2, raising=False)
    await add(6)  # enough pages, but a batch of one append: SQLite's own checkpoint's business
    assert database_file(path) == checkpointed_again
    async with trio.open_nursery() as nursery:  # three at once: the first commits alone, the
        nursery.start_soon(add, 1)  # other two wait for it and go as a batch of two
        nursery.start_soon(partial(journal.append, "T|b", 1, [EVENT], token=None))
        nursery.start_soon(partial(journal.append, "T|c", 1, [EVENT], token=None))
    assert journal.group_commit_statistics().largest_batch == 2
    # The batch was answered before its checkpoint ran; the next commit waits for it.
    await journal.append("T|b", 2, [EVENT], token=None)
    assert database_file(path) != checkpointed_again
    await journal.aclose()


async def test_a_failing_sqlite_checkpoint_is_logged_and_fails_no_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_sqlite, "CHECKPOINT_PAGES", 1, raising=False)
    monkeypatch.setattr(_sqlite, "CHECKPOINT_BATCH", 1, raising=False)

    class Broken(SqliteJournal):
        def _connect(self) -> sqlite3.Connection:
            return CheckpointFails(super()._connect())  # type: ignore[return-value]

    journal = Broken(tmp_path / "journal.db")
    with caplog.at_level(logging.WARNING, logger="p2pshard.persistence"):
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(partial(journal.append, f"T|{i}", 1, [EVENT], token=None))
    assert "checkpoint after a group commit failed (disk I/O error)" in caplog.text
    for i in range(20):
        assert await events_of(journal, f"T|{i}") == [EVENT]
    stats = journal.group_commit_statistics()
    assert (stats.appends, stats.failed) == (20, 0)
    await journal.aclose()
