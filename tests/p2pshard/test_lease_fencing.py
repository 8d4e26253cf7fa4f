"""Fencing, with a real process: paused past its lease, it wakes up unable to do harm.

A worker process takes the lease and writes with its token; it is stopped with SIGSTOP for longer
than the lease's time-to-live; this test takes the lease over (a larger token) and writes; after
SIGCONT the worker's ``check()`` is false at once, and the write it makes anyway with its old
token is refused by the token-checking store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import trio

from p2pshard import Lease, SqliteLeaseBackend
from tests._support.fencing_worker import SETTINGS, FencedStore


def ask(worker: subprocess.Popen[str], line: str, answers: int = 1) -> list[str]:
    assert worker.stdin is not None
    assert worker.stdout is not None
    worker.stdin.write(line + "\n")
    worker.stdin.flush()
    return [worker.stdout.readline().strip() for _ in range(answers)]


def test_a_paused_holder_wakes_up_fenced_off(tmp_path: Path) -> None:
    lease_db, store_db = tmp_path / "leases.db", tmp_path / "store.db"
    with subprocess.Popen(
        [sys.executable, "-m", "tests._support.fencing_worker", str(lease_db), str(store_db), "a"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            check_fencing(worker, lease_db, store_db)
        finally:
            worker.kill()


def check_fencing(worker: subprocess.Popen[str], lease_db: Path, store_db: Path) -> None:
    assert worker.stdout is not None
    granted = worker.stdout.readline().split()
    assert granted[0] == "granted", granted
    old_token = int(granted[1])
    assert ask(worker, "write from-a", 2) == ["check True", "written"]

    os.kill(worker.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    new_token = trio.run(take_over, lease_db, store_db)
    assert time.monotonic() - stopped_at >= SETTINGS.ttl - SETTINGS.safety_margin
    assert new_token > old_token
    os.kill(worker.pid, signal.SIGCONT)

    assert ask(worker, "write stale-from-a", 2) == ["check False", "rejected"]
    with closing(FencedStore(store_db)) as store:
        assert store.read("k") == ("from-b", new_token)
    deadline = time.monotonic() + 5
    while ask(worker, "lost?") != ["lost True"]:
        assert time.monotonic() < deadline, "the worker never noticed it lost the lease"
        time.sleep(0.05)


async def take_over(lease_db: Path, store_db: Path) -> int:
    backend = SqliteLeaseBackend(lease_db)
    async with trio.open_nursery() as nursery:
        lease = Lease(backend, "fenced", "b", SETTINGS, nursery=nursery)
        with trio.fail_after(SETTINGS.ttl * 5):
            while (grant := await lease.acquire()) is None:  # noqa: ASYNC110 - polls the file
                await trio.sleep(0.05)
        with closing(FencedStore(store_db)) as store:
            assert store.write("k", "from-b", grant.token)
        nursery.cancel_scope.cancel()
    await backend.aclose()
    return grant.token
