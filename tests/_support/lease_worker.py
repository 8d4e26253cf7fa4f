"""One process competing for a lease, for the conformance kit's many-process exclusion test.

Run as ``python -m tests._support.lease_worker BACKEND WHERE NAME OWNER ROUNDS OUT``: BACKEND is
``sqlite`` (WHERE a file) or ``etcd`` (WHERE a client URL). Each round the worker asks for the
lease until it is granted (bounded by ``ROUND_LIMIT``), holds it for a few milliseconds while
``check()`` is true, and releases it. It appends one line per hold to OUT:
``<token> <start> <end>``, both times from ``time.monotonic()`` (one clock for every process on
the host): start after the grant arrived, end before the release was sent. The test checks that
no two holds overlap and that tokens grow in time order.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import trio

from p2pshard import Lease, LeaseBackend, LeaseSettings, SqliteLeaseBackend

ROUND_LIMIT = 30.0
"""Seconds one round may wait for the lease before the worker gives up with an error."""

SETTINGS = LeaseSettings(ttl=5.0, renew_interval=1.0, operation_timeout=3.0, safety_margin=0.5)


def backend_of(kind: str, where: str) -> LeaseBackend:
    """The backend a worker or a test names on the command line."""
    if kind == "sqlite":
        return SqliteLeaseBackend(where)
    if kind == "etcd":
        from p2pshard.leases._etcd import EtcdLeaseBackend

        return EtcdLeaseBackend([where])
    raise SystemExit(f"unknown backend {kind!r}: expected sqlite or etcd")


async def compete(kind: str, where: str, name: str, owner: str, rounds: int, out: Path) -> None:
    backend = backend_of(kind, where)
    rng = random.Random(owner)
    try:
        async with trio.open_nursery() as nursery:
            lease = Lease(backend, name, owner, SETTINGS, nursery=nursery)
            for _ in range(rounds):
                with trio.fail_after(ROUND_LIMIT):
                    while await lease.acquire() is None:  # noqa: ASYNC110 - polls the backend
                        await trio.sleep(rng.uniform(0.001, 0.01))
                start = time.monotonic()
                grant = lease.grant
                assert grant is not None
                await trio.sleep(rng.uniform(0.001, 0.005))
                assert lease.check(), "the lease was lost while held"
                end = time.monotonic()
                with out.open("a") as f:
                    f.write(f"{grant.token} {start!r} {end!r}\n")
                await lease.release()
                await trio.sleep(rng.uniform(0.0, 0.005))
            nursery.cancel_scope.cancel()
    finally:
        await backend.aclose()


def main() -> None:
    kind, where, name, owner, rounds, out = sys.argv[1:7]
    trio.run(compete, kind, where, name, owner, int(rounds), Path(out))


if __name__ == "__main__":
    main()
