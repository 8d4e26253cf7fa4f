"""The lease conformance kit (``p2pshard.testing.check_lease_backend``) against every backend.

Memory, SQLite and a real etcd, each check a test of its own; and what the kit cannot do alone,
processes that compete through one shared backend.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

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
from p2pshard.testing import (
    KIT_LEASE_SETTINGS,
    LEASE_CHECKS,
    CutOff,
    EtcdServer,
    check_lease_backend,
    running_etcd,
)

SETTINGS = KIT_LEASE_SETTINGS
"""Short leases: expiry within seconds. etcd rounds 2 s up to 2 s, its smallest here is 1 s."""

_names = itertools.count()


def fresh_name() -> str:
    """A lease name no other test used (the etcd server is shared by the module)."""
    return f"conformance-{os.getpid()}-{next(_names)}"


@attrs.define
class Kit:
    """One backend under test: how to make one, where it keeps its state, how to cut it off."""

    kind: str
    make_backend: Callable[[], LeaseBackend]
    where: str
    cut_off: CutOff


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@contextmanager
def cut_memory(backend: LeaseBackend, owner: str) -> Iterator[None]:
    assert isinstance(backend, MemoryLeaseBackend)
    backend.cut_off(owner)
    try:
        yield
    finally:
        backend.cut_off(owner, False)


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Kit:
    kind = request.param
    if kind == "memory":
        return Kit(kind, MemoryLeaseBackend, "", cut_memory)
    if kind == "sqlite":
        path = tmp_path / "leases.db"

        @contextmanager
        def cut_sqlite(backend: LeaseBackend, owner: str) -> Iterator[None]:
            lock = sqlite3.connect(path, isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")  # every other writer waits, then gives up
            try:
                yield
            finally:
                lock.execute("ROLLBACK")
                lock.close()

        return Kit(kind, lambda: SqliteLeaseBackend(path, busy_timeout=0.5), str(path), cut_sqlite)
    from p2pshard.leases._etcd import EtcdLeaseBackend

    server: EtcdServer = request.getfixturevalue("etcd")

    @contextmanager
    def cut_etcd(backend: LeaseBackend, owner: str) -> Iterator[None]:
        server.pause()
        try:
            yield
        finally:
            server.resume()

    return Kit(
        kind, lambda: EtcdLeaseBackend([server.url], request_timeout=0.5), server.url, cut_etcd
    )


@pytest.mark.parametrize("attached", [False, True], ids=["own", "attached"])
@pytest.mark.parametrize("check", LEASE_CHECKS)
async def test_the_backend_passes_the_conformance_kit(kit: Kit, check: str, attached: bool) -> None:
    """``attached``: shard leases attached to a node lease of each owner (one keep-alive per
    owner), as ``Leases.shard_lease`` makes them, instead of leases renewed on their own."""
    await check_lease_backend(
        kit.make_backend, cut_off=kit.cut_off, checks=[check], attached=attached
    )


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


async def test_the_kit_refuses_unknown_checks_and_cut_off_checks_without_cut_off() -> None:
    with pytest.raises(ValueError, match=r"unknown lease checks \['no_such_check'\]"):
        await check_lease_backend(MemoryLeaseBackend, checks=["no_such_check"])
    needy = "a_holder_never_believes_it_holds_after_another_could_acquire"
    with pytest.raises(ValueError, match=rf"\['{needy}'\] need cut_off"):
        await check_lease_backend(MemoryLeaseBackend, checks=[needy])


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
