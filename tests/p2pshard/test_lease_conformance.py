"""The lease conformance kit: the same tests against every backend (memory, SQLite, a real etcd).

What every backend must give :class:`p2pshard.Lease`: one holder at a time among many concurrent
acquirers (tasks, and for the shared backends processes); expiry and take-over with a larger
token; tokens that only grow; release; a holder that sees "lost" when its backend stops
answering; and above all, a holder that never believes it holds the lease at a moment when
another owner could already have acquired it.

These run on the real clock with short time-to-lives (etcd counts whole seconds), so each
takes a few seconds; the etcd server is started once for the module.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from p2pshard import (
    ConfigurationError,
    Lease,
    LeaseBackend,
    LeaseSettings,
    LeaseUnavailable,
    MemoryLeaseBackend,
    SqliteLeaseBackend,
)
from p2pshard.testing import EtcdServer, running_etcd

SETTINGS = LeaseSettings(ttl=2.0, renew_interval=0.3, operation_timeout=1.0, safety_margin=0.3)
"""Short leases: expiry within seconds. etcd rounds 2 s up to 2 s, its smallest here is 1 s."""

_names = itertools.count()


def fresh_name() -> str:
    """A lease name no other test used (the etcd server is shared by the module)."""
    return f"conformance-{os.getpid()}-{next(_names)}"


@attrs.define
class Kit:
    """One backend under test, and how to cut a holder off from it."""

    kind: str
    backend: LeaseBackend
    where: str
    cut_off: Any  # a context manager: the backend does not answer inside it


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(params=["memory", "sqlite", "etcd"])
async def kit(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Kit]:
    kind = request.param
    if kind == "memory":
        memory = MemoryLeaseBackend()

        @contextmanager
        def cut_memory(owner: str) -> Iterator[None]:
            memory.cut_off(owner)
            try:
                yield
            finally:
                memory.cut_off(owner, False)

        yield Kit(kind, memory, "", cut_memory)
    elif kind == "sqlite":
        path = tmp_path / "leases.db"
        sqlite = SqliteLeaseBackend(path, busy_timeout=0.5)

        @contextmanager
        def cut_sqlite(owner: str) -> Iterator[None]:
            lock = sqlite3.connect(path, isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")  # every other writer waits, then gives up
            try:
                yield
            finally:
                lock.execute("ROLLBACK")
                lock.close()

        yield Kit(kind, sqlite, str(path), cut_sqlite)
        await sqlite.aclose()
    else:
        from p2pshard.leases._etcd import EtcdLeaseBackend

        server: EtcdServer = request.getfixturevalue("etcd")
        etcd_backend = EtcdLeaseBackend([server.url], request_timeout=0.5)

        @contextmanager
        def cut_etcd(owner: str) -> Iterator[None]:
            server.pause()
            try:
                yield
            finally:
                server.resume()

        yield Kit(kind, etcd_backend, server.url, cut_etcd)
        await etcd_backend.aclose()


async def test_one_of_many_concurrent_acquirers_gets_the_lease(kit: Kit) -> None:
    name = fresh_name()
    grants: dict[str, int | None] = {}
    async with trio.open_nursery() as nursery:
        leases = [
            Lease(kit.backend, name, f"owner-{i}", SETTINGS, nursery=nursery) for i in range(12)
        ]

        async def try_once(lease: Lease) -> None:
            grant = await lease.acquire()
            grants[lease.owner] = None if grant is None else grant.token

        async with trio.open_nursery() as racers:
            for lease in leases:
                racers.start_soon(try_once, lease)
        winners = [owner for owner, token in grants.items() if token is not None]
        assert len(winners) == 1, grants
        assert [lease.owner for lease in leases if lease.check()] == winners
        assert await kit.backend.holder(name) == (winners[0], grants[winners[0]])
        nursery.cancel_scope.cancel()


async def test_processes_take_turns_and_tokens_grow_in_time_order(kit: Kit, tmp_path: Path) -> None:
    if kit.kind == "memory":
        pytest.skip("the memory backend lives in one process")
    name, out = fresh_name(), tmp_path / "holds.txt"

    async def worker(i: int) -> None:
        command = [sys.executable, "-m", "tests._support.lease_worker", kit.kind, kit.where]
        done = await trio.run_process(
            [*command, name, f"worker-{i}", "8", str(out)], capture_stderr=True, check=False
        )
        assert done.returncode == 0, done.stderr.decode()

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(worker, i)
    holds = sorted(
        (float(start), float(end), int(token))
        for token, start, end in (line.split() for line in out.read_text().splitlines())
    )
    assert len(holds) == 4 * 8
    for (_, end_a, token_a), (start_b, _, token_b) in itertools.pairwise(holds):
        assert end_a <= start_b, f"holds overlap: token {token_a} and token {token_b}"
        assert token_a < token_b, f"token {token_b} was granted after {token_a}"


async def test_an_abandoned_lease_expires_and_is_taken_over_with_a_larger_token(
    kit: Kit,
) -> None:
    name = fresh_name()
    async with trio.open_nursery() as nursery:
        taker = Lease(kit.backend, name, "taker", SETTINGS, nursery=nursery)
        async with trio.open_nursery() as crashed:  # its keep-alive dies with this nursery
            first = await Lease(kit.backend, name, "crashed", SETTINGS, nursery=crashed).acquire()
            assert first is not None
            crashed.cancel_scope.cancel()
        abandoned = time.monotonic()
        assert await taker.acquire() is None  # still held: not yet expired
        with trio.fail_after(SETTINGS.ttl * 3 + 2):
            while (second := await taker.acquire()) is None:  # noqa: ASYNC110 - polls
                await trio.sleep(0.05)
        assert time.monotonic() - abandoned >= SETTINGS.ttl - 0.5
        assert second.token > first.token
        assert taker.check()
        nursery.cancel_scope.cancel()


async def test_a_held_lease_is_renewed_past_its_ttl(kit: Kit) -> None:
    name = fresh_name()
    async with trio.open_nursery() as nursery:
        holder = Lease(kit.backend, name, "holder", SETTINGS, nursery=nursery)
        other = Lease(kit.backend, name, "other", SETTINGS, nursery=nursery)
        grant = await holder.acquire()
        assert grant is not None
        await trio.sleep(SETTINGS.ttl * 2)
        assert holder.check()
        assert await other.acquire() is None
        assert holder.grant is not None
        assert holder.grant.token == grant.token
        assert holder.grant.deadline > grant.deadline  # moved with the renewals
        nursery.cancel_scope.cancel()


async def test_tokens_only_grow_across_grants_and_releases(kit: Kit) -> None:
    name = fresh_name()
    tokens = []
    async with trio.open_nursery() as nursery:
        owners = [Lease(kit.backend, name, f"o{i}", SETTINGS, nursery=nursery) for i in range(3)]
        for lease in owners * 3:
            grant = await lease.acquire()
            assert grant is not None
            tokens.append(grant.token)
            assert await lease.release()
        again = await owners[0].acquire()  # the same owner twice in a row: a new token too
        assert again is not None
        assert await owners[0].release()
        assert (await owners[0].acquire()).token > again.token  # type: ignore[union-attr]
        nursery.cancel_scope.cancel()
    assert tokens == sorted(set(tokens))


async def test_release_frees_the_lease_at_once_and_only_for_its_holder(kit: Kit) -> None:
    name = fresh_name()
    async with trio.open_nursery() as nursery:
        a = Lease(kit.backend, name, "a", SETTINGS, nursery=nursery)
        b = Lease(kit.backend, name, "b", SETTINGS, nursery=nursery)
        grant = await a.acquire()
        assert grant is not None
        assert not await b.release()  # b holds nothing
        assert not await kit.backend.release(name, "b", grant.token)  # not b's to release
        assert await kit.backend.holder(name) == ("a", grant.token)
        assert await a.release()
        assert not a.check()
        assert not await a.release()  # twice: nothing held any more
        assert await kit.backend.holder(name) is None
        taken = await b.acquire()
        assert taken is not None
        assert taken.token > grant.token
        nursery.cancel_scope.cancel()


async def test_a_holder_cut_off_from_the_backend_sees_lost_before_anyone_else_can_acquire(
    kit: Kit,
) -> None:
    name = fresh_name()
    async with trio.open_nursery() as nursery:
        holder = Lease(kit.backend, name, "holder", SETTINGS, nursery=nursery)
        grant = await holder.acquire()
        assert grant is not None
        with kit.cut_off("holder"):
            with trio.fail_after(SETTINGS.ttl + 2):
                await holder.wait_lost()
            lost_at = time.monotonic()
            assert not holder.check()
            with pytest.raises(LeaseUnavailable):
                await holder.acquire()
        # Back in touch: another owner gets it only after the holder had let go.
        other = Lease(kit.backend, name, "other", SETTINGS, nursery=nursery)
        with trio.fail_after(SETTINGS.ttl * 3 + 2):
            while True:
                sent = time.monotonic()
                taken = await other.acquire()
                if taken is not None:
                    break
                await trio.sleep(0.02)
        assert lost_at <= sent
        assert taken.token > grant.token
        nursery.cancel_scope.cancel()


async def test_a_holder_never_believes_it_holds_after_another_could_acquire(kit: Kit) -> None:
    """Renewals get slower and then stop; a rival polls all the while.

    Every moment the holder's ``check()`` said True must come before the send time of the
    rival's successful acquire.
    """
    name = fresh_name()
    believed: list[float] = []
    rival_sent: list[float] = []
    async with trio.open_nursery() as nursery:
        holder = Lease(kit.backend, name, "holder", SETTINGS, nursery=nursery)
        rival = Lease(kit.backend, name, "rival", SETTINGS, nursery=nursery)
        assert await holder.acquire() is not None

        async def watch_holder() -> None:
            while True:
                if holder.check():
                    believed.append(time.monotonic())
                await trio.sleep(0.005)

        async def poll_rival() -> None:
            while True:
                sent = time.monotonic()
                try:
                    if await rival.acquire() is not None:
                        rival_sent.append(sent)
                        return
                except LeaseUnavailable:
                    pass
                await trio.sleep(0.01)

        nursery.start_soon(watch_holder)
        await trio.sleep(SETTINGS.renew_interval * 3)
        with trio.fail_after(SETTINGS.ttl * 4 + 5):
            with kit.cut_off("holder"):
                await holder.wait_lost()
            await poll_rival()
        nursery.cancel_scope.cancel()
    assert believed
    assert max(believed) < rival_sent[0]


async def test_bad_settings_and_names_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError, match=r"renew_interval = 3.0 .* under ttl / 2"):
        LeaseSettings(ttl=4.0, renew_interval=3.0)
    with pytest.raises(ConfigurationError, match=r"operation_timeout = 5.0 .* ttl - safety_margin"):
        LeaseSettings(ttl=5.0, renew_interval=1.0, operation_timeout=5.0)
    with pytest.raises(
        ConfigurationError,
        match=r"renew_interval = 2.0 is invalid with operation_timeout = 2.0: .* tried again",
    ):
        LeaseSettings(ttl=5.0, renew_interval=2.0, operation_timeout=2.0, safety_margin=1.0)
    with pytest.raises(ConfigurationError, match=r"path is missing"):
        LeaseSettings(backend="sqlite")
    with pytest.raises(ConfigurationError, match=r"endpoints is empty"):
        LeaseSettings(backend="etcd")
    with pytest.raises(ConfigurationError, match=r"endpoints = \('localhost:2379',\)"):
        LeaseSettings(backend="etcd", endpoints=("localhost:2379",))
    async with trio.open_nursery() as nursery:
        with pytest.raises(ConfigurationError, match="lease name '' is invalid"):
            Lease(MemoryLeaseBackend(), "", "me", nursery=nursery)
        with pytest.raises(ConfigurationError, match="lease owner 3 is invalid"):
            Lease(MemoryLeaseBackend(), "x", 3, nursery=nursery)  # type: ignore[arg-type]


async def test_an_unreadable_sqlite_file_is_unavailable_with_the_file_named(
    tmp_path: Path,
) -> None:
    garbage = tmp_path / "not-a-db"
    garbage.write_bytes(b"this is not a database" * 100)
    backend = SqliteLeaseBackend(garbage)
    async with trio.open_nursery() as nursery:
        lease = Lease(backend, "x", "me", SETTINGS, nursery=nursery)
        with pytest.raises(LeaseUnavailable, match="not-a-db"):
            await lease.acquire()
    await backend.aclose()
    missing_dir = SqliteLeaseBackend(tmp_path / "no" / "such" / "dir.db")
    with pytest.raises(LeaseUnavailable, match=r"dir\.db"):
        await missing_dir.try_acquire("x", "me", 1.0)
    await missing_dir.aclose()
