"""Lease benchmark: the SQLite and etcd lease backends; what shard leases add to a first message.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.leases            # full run, a few minutes
    .venv/bin/python -m benchmarks.leases --quick    # smaller counts, under two minutes
    .venv/bin/python -m benchmarks.leases --json     # one JSON object instead of the table

Progress lines go to stderr unless ``--json``.

Everything runs in this process, on 127.0.0.1: the SQLite file and the node's files live in a
temporary directory that is removed at the end; etcd is a real single-member server
(``p2pshard.testing.running_etcd``: fresh ports, a temporary data directory, a 100 ms election
timeout) that this benchmark starts and stops, on every exit path. Every figure is beside a
baseline measured in the same run, and a ratio is the median of per-round ratios, each from a
pair measured back to back (this shared machine's speed drifts).

1. Per backend (``SqliteLeaseBackend`` on a temporary file, ``EtcdLeaseBackend`` on the real
   server, each built as ``open_node`` builds it, with ``request_timeout``/``busy_timeout`` 5 s):

   - ``acquire``: ``Lease.acquire`` of a name never used before (what a shard does when it
     starts), over many distinct names; ``renew``: the backend's ``renew`` of each of those
     grants (what the keep-alive task calls every ``renew_interval``); ``release``:
     ``Lease.release``. p50 and p99. Each sample is paired with a no-op round trip of the same
     kind, taken just before or after it (alternately): for SQLite, a connection opened in a
     worker thread (``trio.to_thread.run_sync`` with the same limiter of 4 threads and
     ``abandon_on_cancel``, as the backend runs each operation) that runs ``SELECT 1`` and
     closes; for etcd, an HTTP POST of ``/v3/kv/range`` for a missing key over the kept-alive
     connections the backend uses for an ``http://`` endpoint (``_etcd_http.PlainChannel``, at
     most 8 requests in flight as in the backend). ``*_ratio`` = lease op p50 / no-op p50.
   - ``renewals_per_s``: 1,000 leases held (as by the 1,000 shards of one node), one task per
     lease renewing in a loop for a fixed window (closed loop, 1,000 renewals in flight);
     renewals completed within the window per second (what is still in flight at its end gets
     one more second, uncounted, then is cancelled). Baseline: the same 1,000 tasks doing the
     no-op round trip (its client first warmed with requests 16 at a time, as the backend's
     is by taking the 1,000 leases that way). Also: when the first answer came, the renewal
     latency under that load, and the rate of one renewal at a time (``1 / mean`` of the
     sequential renew samples).
     For etcd the same windows again with at most 8 requests in flight (a ``trio.Semaphore``
     around each ``renew`` and each no-op; ``renewals_bounded_*``), kept from the time the
     backend spoke through httpx, whose connection pool spent its time in its bookkeeping with
     1,000 requests queued. SQLite runs at most 4 operations at a time anyway (its thread
     limiter). Each window has a backend object (and no-op connections) of its own.
   - What-if (a diagnostic, not a target): SQLite renew latency while another connection to
     the file stays open, beside the same renewals without it.
   - Full run only, ``keepalive``: 1,000 ``Lease`` objects with the default ``LeaseSettings``
     (ttl 15 s, renew_interval 3 s) acquired at once, as the shards of a node that starts 1,000
     shards together do, then kept alive by their own keep-alive tasks for 20 s (more than a
     ttl): renewals per second achieved against the 1,000 / 3 s needed, renewals that failed,
     and leases lost.

2. ``first_message``: one node (``open_node`` with a ``NodeConfig`` on 127.0.0.1, mutual TLS with
   certificates made for the run, a one-member cluster that joins itself) with ``[lease]``
   backend sqlite (then another with etcd). Two entity types on the same node, ``Counter`` of
   ``benchmarks/_sharding_worker.py`` on ``HashExtractor(shards)``: one with
   ``ShardingSettings(use_lease=True)``, one without. For each shard, one ask to a fresh entity of
   that never-used shard in each type (order alternating), a short pause before each: the time
   from the ``ask`` until its answer. Reported: p50/p99 with and without leases, their ratio, and
   the milliseconds added (p50 with - p50 without). After each round both types are shut down
   gracefully (their shards hand off and release their leases), so that the node does not keep
   hundreds of leases alive into the next round; and each backend's first messages are measured
   before the load of part 1 is put on it.

   The etcd node's shard leases are attached to its node lease (``Leases.shard_lease``); the
   same again with a lease of its own per shard (the design before node leases, the backend
   wrapped so that it offers no node leases) is the before figure, in the same run:
   ``first_message_etcd_over_none`` and ``first_message_etcd_per_shard_over_none`` (p50 with
   leases over p50 without, medians of per-round ratios).

   In the etcd node's rounds, after each pair of asks, a pause and then the transaction that
   takes a shard lease sent to etcd straight, over the connections the backend keeps (a
   put-if-absent of a new key onto one etcd lease: a raft entry, etcd's WAL fsync on the data
   directory's disk, its JSON gateway, nothing of the node): ``etcd_alone_p50_ms``, and
   ``etcd_alone_over_none``, its p50 over the p50 of the first message without leases (median
   of per-round ratios). A first message with a lease waits for that transaction after its
   shard is allocated, so ``first_message_etcd_over_none`` cannot be below about one plus it.
   etcd's data directory is in the temporary directory, on whatever disk that is (here the root
   file system, not a tmpfs).

3. ``scale`` (etcd): one ``Leases`` of a node with the default ``LeaseSettings`` (ttl 15 s, renew
   every 3 s) holds 100, 1,000 and 10,000 shard leases attached to its node lease, acquired 64 at a
   time, growing from one size to the next; after each, for a window (4 s quick, 30 s full) this
   process's CPU time over the wall time (``etcd_core_fraction_<n>_shards``, the fraction of one
   core the node spends on its leases and everything else it runs, which is nothing else here),
   etcd's own CPU (from ``/proc``), and the requests sent to etcd per second (the backend's
   ``requests`` counts). Baselines in the same run: the same process holding no lease
   (``etcd_core_fraction_idle``) and 100 shard leases with a lease of their own each
   (``etcd_core_fraction_per_shard_100``). Every case checks that all its leases are still held at
   the end of the window and counts losses.

Every wait has a time limit and every loop a bound; a part that misses its limit aborts the
benchmark with an error naming it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from benchmarks import _sharding_worker as worker
from benchmarks import transport as transport_bench
from benchmarks._process import BenchmarkError
from benchmarks._report import (
    benchmark_parser,
    cell,
    median,
    progress_line,
    quantiles_ms,
    run_and_print,
)
from p2pshard import (
    HashExtractor,
    LeaseSettings,
    NodeConfig,
    ShardingSettings,
    TlsFiles,
    open_node,
)
from p2pshard._errors import AskTimeout, LeaseUnavailable
from p2pshard.leases._etcd import MAX_IN_FLIGHT, EtcdLeaseBackend
from p2pshard.leases._etcd_http import ChannelError, PlainChannel
from p2pshard.leases._lease import Lease, LeaseBackend
from p2pshard.leases._leases import Leases
from p2pshard.leases._node_lease import AttachedLease
from p2pshard.leases._sqlite import SqliteLeaseBackend
from p2pshard.sharding._region import ShardRegion
from p2pshard.testing import EtcdNotInstalled, running_etcd

HOST = "127.0.0.1"
OWNER = "127.0.0.1:25520"
"""The owner of the benchmark's leases (a node's address, as ``node.leases`` uses)."""
REQUEST_TIMEOUT = 5.0
"""The backends' ``request_timeout``/``busy_timeout``: ``LeaseSettings().operation_timeout``,
as ``open_node`` builds them."""
SQLITE_THREADS = 4
"""``SqliteLeaseBackend``'s default limit of worker threads; the no-op uses a limiter as large."""
MISSING_KEY = base64.b64encode(b"p2pshard/bench/missing-key").decode("ascii")
SETUP_INFLIGHT = 16
"""Concurrent requests while setting up or tearing down the 1,000 leases (not measured)."""
BOUNDED_INFLIGHT = 8
SCALE_SETUP_INFLIGHT = 64
"""Shard leases acquired at once while a scale case sets up (the backend sends at most 8)."""
"""etcd: the renewals (and no-ops) in flight at once in the bounded windows."""
FIRST_PAUSE = 0.01
"""Seconds before each first-message sample, so that each starts from a quiet node."""
ASK_TIMEOUT = 10.0

# Long enough that no keep-alive runs while the latencies are measured: renewals are measured
# through the backend directly.
MEASURE_SETTINGS = LeaseSettings(ttl=120.0, renew_interval=50.0, operation_timeout=REQUEST_TIMEOUT)

_EXPECTED_ERRORS = (LeaseUnavailable, ChannelError, sqlite3.Error, OSError)
"""What a lease operation or a no-op may fail with under load (counted, not raised)."""


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    names: int
    """Distinct lease names per round of acquire/renew/release latencies."""
    rounds: int
    """Rounds per backend (latencies and the concurrent windows)."""
    concurrent_leases: int
    window: float
    """Seconds of each closed-loop window of concurrent renewals (or no-ops)."""
    drain: float
    """Seconds the operations still in flight at the end of a window may take to finish."""
    whatif_names: int
    keepalive_seconds: float
    """Seconds the 1,000 default leases are watched (0: no keep-alive run)."""
    first_shards: int
    first_rounds: int
    scale_sizes: tuple[int, ...]
    """Shard leases held by one node in the scale part."""
    scale_window: float
    """Seconds each scale case is watched (renewals every 3 s by default)."""
    part_limit: float
    """Seconds any one part (a backend, the first messages) may take."""


def make_plan(*, quick: bool) -> Plan:
    """The quick plan takes well under a minute on two cores; the full one a few minutes."""
    return Plan(
        names=100 if quick else 400,
        rounds=1 if quick else 3,
        concurrent_leases=1000,
        window=2.0 if quick else 5.0,
        drain=1.0,
        whatif_names=60 if quick else 200,
        keepalive_seconds=0.0 if quick else 20.0,
        first_shards=60 if quick else 200,
        first_rounds=1 if quick else 3,
        scale_sizes=(100, 1000, 10_000),
        scale_window=4.0 if quick else 30.0,
        part_limit=120.0 if quick else 600.0,
    )


def ms(seconds: float) -> float:
    """Seconds in milliseconds."""
    return seconds * 1e3


@contextlib.contextmanager
def quiet_logs(*names: str) -> Iterator[None]:
    """Only errors from these loggers (a lost lease is counted, not logged 1,000 times)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


# ==== the no-op round trips =======================================================================

NoOp = Callable[[], Awaitable[None]]


def sqlite_noop(path: Path) -> NoOp:
    """A connection to the lease file opened in a worker thread, ``SELECT 1``, closed."""
    limiter = trio.CapacityLimiter(SQLITE_THREADS)

    def work() -> None:
        conn = sqlite3.connect(path, timeout=REQUEST_TIMEOUT, isolation_level=None)
        try:
            conn.execute("SELECT 1").fetchone()
        finally:
            conn.close()

    async def noop() -> None:
        await trio.to_thread.run_sync(work, limiter=limiter, abandon_on_cancel=True)

    return noop


def etcd_noop(channel: PlainChannel) -> NoOp:
    """POST ``/v3/kv/range`` of a missing key, its JSON answer read; at most ``MAX_IN_FLIGHT``
    at once, as the backend sends its requests."""
    in_flight = trio.Semaphore(MAX_IN_FLIGHT)

    async def noop() -> None:
        async with in_flight:
            status, content = await channel.post("/v3/kv/range", {"key": MISSING_KEY})
        if status != 200 or "header" not in json.loads(content):
            raise BenchmarkError(f"etcd no-op: HTTP {status}: {content[:200]!r}")

    return noop


def etcd_channel(url: str) -> PlainChannel:
    """The connections to etcd that ``EtcdLeaseBackend`` keeps to an ``http://`` endpoint."""
    return PlainChannel(url, timeout=REQUEST_TIMEOUT, limit=MAX_IN_FLIGHT)


# ==== latencies ===================================================================================


async def timed(op: Callable[[], Awaitable[object]]) -> tuple[float, object]:
    """Seconds ``op`` took, and its result."""
    sent = time.perf_counter()
    result = await op()
    return time.perf_counter() - sent, result


async def paired(
    index: int, op: Callable[[], Awaitable[object]], noop: NoOp, out: list[float], base: list[float]
) -> object:
    """One sample of ``op`` and one of ``noop``, in an order that alternates with ``index``."""
    if index % 2 == 0:
        base.append((await timed(noop))[0])
    took, result = await timed(op)
    out.append(took)
    if index % 2 == 1:
        base.append((await timed(noop))[0])
    return result


async def latency_round(
    backend: LeaseBackend, noop: NoOp, prefix: str, count: int, nursery: trio.Nursery
) -> dict[str, list[float]]:
    """Acquire ``count`` new names (``Lease.acquire``), renew each, release each."""
    settings = MEASURE_SETTINGS
    leases = [
        Lease(backend, f"{prefix}-{i}", OWNER, settings, nursery=nursery) for i in range(count)
    ]
    s: dict[str, list[float]] = {
        f"{op}{kind}": [] for op in ("acquire", "renew", "release") for kind in ("", "_base")
    }
    for i, lease in enumerate(leases):
        grant = await paired(i, lease.acquire, noop, s["acquire"], s["acquire_base"])
        if grant is None:
            raise BenchmarkError(f"lease {lease.name} was refused: it was never used before")
    for i, lease in enumerate(leases):
        token = lease.token
        assert token is not None

        async def renew(lease: Lease = lease, token: int = token) -> bool:
            return await backend.renew(lease.name, OWNER, token, settings.ttl)

        if await paired(i, renew, noop, s["renew"], s["renew_base"]) is not True:
            raise BenchmarkError(f"the renewal of {lease.name} was refused")
    for i, lease in enumerate(leases):
        if await paired(i, lease.release, noop, s["release"], s["release_base"]) is not True:
            raise BenchmarkError(f"the release of {lease.name} was refused")
    return s


# ==== concurrent renewals =========================================================================


@attrs.define
class Load:
    """A closed-loop window: operations completed within it, failures, latencies."""

    window: float
    ok: int = 0
    refused: int = 0
    failed: int = 0
    cut_off: int = 0
    """Operations still in flight when the drain limit ended them."""
    first_s: float = math.nan
    """Seconds from the start until the first operation completed."""
    first_error: str = ""
    latencies: list[float] = attrs.Factory(list)

    def summary(self) -> dict[str, Any]:
        return {
            "per_s": self.ok / self.window,
            "ok": self.ok,
            "refused": self.refused,
            "failed": self.failed,
            "cut_off": self.cut_off,
            "first_s": self.first_s,
            "first_error": self.first_error,
            **quantiles_ms(self.latencies),
        }


async def closed_loop(
    op: Callable[[int], Awaitable[bool]], tasks: int, window: float, drain: float
) -> dict[str, Any]:
    """``tasks`` tasks calling ``op(task)`` one after another until ``window`` seconds passed.

    Counts what completed within the window; what is in flight then may finish (not counted)
    for up to ``drain`` seconds, and is cancelled after that.
    """
    load = Load(window=window)
    in_flight = [0]
    start = time.perf_counter()
    deadline = start + window

    async def one(task: int) -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            in_flight[0] += 1
            try:
                good = await op(task)
            except _EXPECTED_ERRORS as exc:
                if time.perf_counter() <= deadline:
                    load.failed += 1
                    load.first_error = load.first_error or f"{type(exc).__name__}: {exc}"
                continue
            finally:
                in_flight[0] -= 1
            done = time.perf_counter()
            if math.isnan(load.first_s):
                load.first_s = done - start
            if done > deadline:
                return
            if good:
                load.ok += 1
                load.latencies.append(done - sent)
            else:
                load.refused += 1

    with trio.move_on_after(window + drain):
        async with trio.open_nursery() as nursery:
            for task in range(tasks):
                nursery.start_soon(one, task)
    load.cut_off = in_flight[0]
    return load.summary()


async def bounded(items: list[Any], fn: Callable[[Any], Awaitable[None]], limit: int) -> None:
    """``fn`` of every item, at most ``limit`` at a time."""
    semaphore = trio.Semaphore(limit)

    async def run(item: Any) -> None:
        async with semaphore:
            await fn(item)

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(run, item)


async def hold_leases(backend: LeaseBackend, prefix: str, count: int) -> dict[str, int]:
    """Acquire ``count`` new names directly from the backend (set-up); their tokens by name."""
    tokens: dict[str, int] = {}

    async def acquire(name: str) -> None:
        token = await backend.try_acquire(name, OWNER, MEASURE_SETTINGS.ttl)
        if token is None:
            raise BenchmarkError(f"lease {name} was refused: it was never used before")
        tokens[name] = token

    await bounded([f"{prefix}-{i}" for i in range(count)], acquire, SETUP_INFLIGHT)
    return tokens


async def release_leases(backend: LeaseBackend, tokens: dict[str, int]) -> None:
    """Release what :func:`hold_leases` took (tear-down; a failure is left to expire)."""

    async def release(item: tuple[str, int]) -> None:
        with contextlib.suppress(*_EXPECTED_ERRORS):
            await backend.release(item[0], OWNER, item[1])

    await bounded(list(tokens.items()), release, SETUP_INFLIGHT)


def renew_op(
    backend: LeaseBackend, tokens: dict[str, int], inflight: int | None = None
) -> Callable[[int], Awaitable[bool]]:
    """``op(task)`` renewing the task's lease; at most ``inflight`` at a time if given."""
    names = list(tokens)
    semaphore = trio.Semaphore(inflight) if inflight else None

    async def op(task: int) -> bool:
        name = names[task]
        if semaphore is None:
            return await backend.renew(name, OWNER, tokens[name], MEASURE_SETTINGS.ttl)
        async with semaphore:
            return await backend.renew(name, OWNER, tokens[name], MEASURE_SETTINGS.ttl)

    return op


def noop_op(noop: NoOp, inflight: int | None = None) -> Callable[[int], Awaitable[bool]]:
    """``op(task)`` doing the no-op round trip; at most ``inflight`` at a time if given."""
    semaphore = trio.Semaphore(inflight) if inflight else None

    async def op(task: int) -> bool:
        if semaphore is None:
            await noop()
        else:
            async with semaphore:
                await noop()
        return True

    return op


# ==== the keep-alive of 1,000 default leases ======================================================


class CountingBackend:
    """A :class:`LeaseBackend` that counts the renewals passing through it."""

    def __init__(self, inner: LeaseBackend) -> None:
        self.inner = inner
        self.renewed = 0
        self.refused = 0
        self.failed = 0

    async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        return await self.inner.try_acquire(name, owner, ttl)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        try:
            renewed = await self.inner.renew(name, owner, token, ttl)
        except BaseException:
            self.failed += 1  # a failure, or cut short by the keep-alive's deadline
            raise
        if renewed:
            self.renewed += 1
        else:
            self.refused += 1
        return renewed

    async def release(self, name: str, owner: str, token: int) -> bool:
        return await self.inner.release(name, owner, token)

    async def holder(self, name: str) -> tuple[str, int] | None:
        return await self.inner.holder(name)

    async def aclose(self) -> None:
        await self.inner.aclose()


# ==== one backend =================================================================================


@attrs.frozen
class BackendUnderTest:
    """How to open the backend and its no-op round trip, and what else is measured on it.

    Each concurrent window gets a backend object and an HTTP client of its own, so a window
    that leaves one of them in a bad state cannot spoil the next figures.
    """

    name: str
    open_backend: Callable[[], contextlib.AbstractAsyncContextManager[LeaseBackend]]
    open_noop: Callable[[], contextlib.AbstractAsyncContextManager[NoOp]]
    bounded_inflight: int | None = None
    """Also measure the concurrent renewals (and no-ops) with at most this many in flight."""
    whatif: Callable[[LeaseBackend, Plan], Awaitable[dict[str, Any]]] | None = None


async def sqlite_whatif(backend: LeaseBackend, plan: Plan) -> dict[str, Any]:
    """Renew latency without, then with, another connection to the file kept open."""
    assert isinstance(backend, SqliteLeaseBackend)
    tokens = await hold_leases(backend, "whatif", plan.whatif_names)
    samples: dict[str, list[float]] = {"alone": [], "keeper_open": []}

    async def renew_all(into: list[float]) -> None:
        for name, token in tokens.items():
            sent = time.perf_counter()
            renewed = await backend.renew(name, OWNER, token, MEASURE_SETTINGS.ttl)
            into.append(time.perf_counter() - sent)
            if not renewed:
                raise BenchmarkError(f"the renewal of {name} was refused")

    await renew_all(samples["alone"])
    keeper = sqlite3.connect(backend.path)
    try:
        keeper.execute("SELECT count(*) FROM leases").fetchone()
        await renew_all(samples["keeper_open"])
    finally:
        keeper.close()
    await release_leases(backend, tokens)
    return {
        "renew_alone": quantiles_ms(samples["alone"]),
        "renew_keeper_open": quantiles_ms(samples["keeper_open"]),
    }


async def concurrent_windows(
    under_test: BackendUnderTest, prefix: str, plan: Plan, r: int
) -> dict[str, dict[str, Any]]:
    """Closed-loop windows of renewals and of no-ops, one task per lease.

    The bounded windows (if any) come first, then the unbounded ones, in an order alternating
    with ``r``. Returns the leases' tokens too (under ``"tokens"``), to release them.
    """
    load: dict[str, Any] = {}
    async with under_test.open_backend() as backend:
        tokens = await hold_leases(backend, prefix, plan.concurrent_leases)
        load["tokens"] = tokens
        windows: list[tuple[str, int | None]] = [("ours", None), ("base", None)]
        if r % 2 == 1:
            windows.reverse()
        if under_test.bounded_inflight is not None:
            windows[:0] = [
                ("ours_bounded", under_test.bounded_inflight),
                ("base_bounded", under_test.bounded_inflight),
            ]
        for key, inflight in windows:
            if key.startswith("ours"):
                op = renew_op(backend, tokens, inflight)
                load[key] = await closed_loop(op, len(tokens), plan.window, plan.drain)
            else:
                async with under_test.open_noop() as noop:
                    # Warmed as the backend's client was by hold_leases: connections open.
                    await bounded(list(range(4 * SETUP_INFLIGHT)), lambda _: noop(), SETUP_INFLIGHT)
                    op = noop_op(noop, inflight)
                    load[key] = await closed_loop(op, len(tokens), plan.window, plan.drain)
    return load


async def measure_backend(
    under_test: BackendUnderTest, plan: Plan, progress: bool
) -> dict[str, Any]:
    """Latencies, concurrent renewals, the what-if and the keep-alive run of one backend."""
    name = under_test.name
    rounds: list[dict[str, Any]] = []
    whatif: dict[str, Any] = {}
    with trio.fail_after(plan.part_limit):
        async with (
            under_test.open_backend() as backend,
            under_test.open_noop() as noop,
            trio.open_nursery() as nursery,
        ):
            for r in range(plan.rounds):
                started = time.monotonic()
                s = await latency_round(backend, noop, f"bench-r{r}", plan.names, nursery)
                load = await concurrent_windows(under_test, f"bench-c{r}", plan, r)
                tokens = load.pop("tokens")
                if r < plan.rounds - 1 or plan.keepalive_seconds > 0:
                    # (Nothing follows the last round of a quick run: the leases then expire
                    # with the run's file or server.)
                    async with under_test.open_backend() as cleaner:
                        await release_leases(cleaner, tokens)
                result: dict[str, Any] = {
                    op: {
                        **quantiles_ms(s[op]),
                        "mean_ms": ms(statistics.fmean(s[op])),
                        "baseline": quantiles_ms(s[f"{op}_base"]),
                        "ratio": statistics.median(s[op]) / statistics.median(s[f"{op}_base"]),
                    }
                    for op in ("acquire", "renew", "release")
                }
                result["concurrent"] = load
                rounds.append(result)
                ours, base = load["ours"], load["base"]
                bounded_text = (
                    f"; at most {under_test.bounded_inflight} in flight: "
                    f"{load['ours_bounded']['per_s']:,.0f} renewals/s, "
                    f"{load['base_bounded']['per_s']:,.0f} no-ops/s"
                    if "ours_bounded" in load
                    else ""
                )
                progress_line(
                    progress,
                    f"{name} round {r + 1}/{plan.rounds}: acquire p50 "
                    f"{result['acquire']['p50_ms']:.2f} ms, renew p50 "
                    f"{result['renew']['p50_ms']:.2f} ms, release p50 "
                    f"{result['release']['p50_ms']:.2f} ms, no-op p50 "
                    f"{result['renew']['baseline']['p50_ms']:.2f} ms; {len(tokens):,} leases at "
                    f"once: {ours['per_s']:,.0f} renewals/s ({ours['failed']} failed), "
                    f"{base['per_s']:,.0f} no-ops/s ({base['failed']} failed){bounded_text} "
                    f"({time.monotonic() - started:.1f} s)",
                )
            if under_test.whatif is not None:
                whatif = await under_test.whatif(backend, plan)
            nursery.cancel_scope.cancel()
    keepalive = None
    if plan.keepalive_seconds > 0:
        started = time.monotonic()
        with trio.fail_after(plan.part_limit), quiet_logs("p2pshard.lease"):
            keepalive = await keepalive_run(under_test, plan)
        progress_line(
            progress,
            f"{name} keep-alive: {keepalive['granted']:,} of {keepalive['leases']:,} granted in "
            f"{keepalive['acquire_burst_s']:.1f} s; {keepalive['renewals_per_s']:,.0f} "
            f"renewals/s (needed {keepalive['needed_per_s']:,.0f}), "
            f"{keepalive['renewals_failed']} failed, {keepalive['lost']} lost "
            f"({time.monotonic() - started:.1f} s)",
        )
    return summarize_backend(rounds, whatif, keepalive)


async def keepalive_run(under_test: BackendUnderTest, plan: Plan) -> dict[str, Any]:
    """1,000 leases with the default settings, acquired at once, kept alive for a while.

    The leases still held at the end are released through another backend object: the one
    under test may be left unusable by the load (see the report).
    """
    settings = LeaseSettings()
    count, seconds = plan.concurrent_leases, plan.keepalive_seconds
    out: dict[str, Any] = {"leases": count, "seconds": seconds, "settings": attrs.asdict(settings)}
    granted: list[Lease] = []
    async with under_test.open_backend() as inner, trio.open_nursery() as nursery:
        backend = CountingBackend(inner)
        leases = [
            Lease(backend, f"bench-k-{i}", OWNER, settings, nursery=nursery) for i in range(count)
        ]
        acquire_failed = [0]

        async def acquire(lease: Lease) -> None:
            try:
                if await lease.acquire() is not None:
                    granted.append(lease)
            except LeaseUnavailable:
                acquire_failed[0] += 1

        started = time.perf_counter()
        with trio.move_on_after(settings.ttl):  # what is unanswered by then is cancelled
            async with trio.open_nursery() as burst:
                for lease in leases:
                    burst.start_soon(acquire, lease)
        out["acquire_burst_s"] = time.perf_counter() - started
        out["granted"] = len(granted)
        out["acquire_failed"] = acquire_failed[0]
        before = (backend.renewed, backend.refused, backend.failed)
        watched = time.perf_counter()
        await trio.sleep(seconds)
        elapsed = time.perf_counter() - watched
        out["renewed"] = backend.renewed - before[0]
        out["renewals_refused"] = backend.refused - before[1]
        out["renewals_failed"] = backend.failed - before[2]
        out["renewals_per_s"] = out["renewed"] / elapsed
        out["needed_per_s"] = len(granted) / settings.renew_interval
        out["lost"] = sum(1 for lease in granted if not lease.check())
        nursery.cancel_scope.cancel()
    held = {lease.name: lease.token for lease in granted if lease.token is not None}
    async with under_test.open_backend() as cleaner:
        await release_leases(cleaner, held)
    return out


def summarize_backend(
    rounds: list[dict[str, Any]], whatif: dict[str, Any], keepalive: dict[str, Any] | None
) -> dict[str, Any]:
    """Medians over the rounds; ratios are medians of per-round ratios."""

    def of(*path: str) -> float:
        values = []
        for r in rounds:
            value: Any = r
            for key in path:
                value = value[key]
            values.append(float(value))
        return median(values)

    def ratio(ours: str, base: str) -> float:
        return median(
            [
                r["concurrent"][ours]["per_s"] / r["concurrent"][base]["per_s"]
                if r["concurrent"][base]["per_s"]
                else math.nan
                for r in rounds
            ]
        )

    out: dict[str, Any] = {}
    for op in ("acquire", "renew", "release"):
        out[f"{op}_p50_ms"] = of(op, "p50_ms")
        out[f"{op}_p99_ms"] = of(op, "p99_ms")
        out[f"{op}_baseline_p50_ms"] = of(op, "baseline", "p50_ms")
        out[f"{op}_baseline_p99_ms"] = of(op, "baseline", "p99_ms")
        out[f"{op}_ratio"] = of(op, "ratio")
    out["renewals_sequential_per_s"] = median([1e3 / r["renew"]["mean_ms"] for r in rounds])
    for suffix in ("", "_bounded"):
        if f"ours{suffix}" not in rounds[0]["concurrent"]:
            continue
        ours, base = f"ours{suffix}", f"base{suffix}"
        out[f"renewals{suffix}_per_s"] = of("concurrent", ours, "per_s")
        out[f"renewals{suffix}_baseline_per_s"] = of("concurrent", base, "per_s")
        out[f"renewals{suffix}_ratio"] = ratio(ours, base)
        out[f"renewals{suffix}_loaded_p50_ms"] = of("concurrent", ours, "p50_ms")
        out[f"renewals{suffix}_loaded_p99_ms"] = of("concurrent", ours, "p99_ms")
        out[f"renewals{suffix}_first_s"] = of("concurrent", ours, "first_s")
        out[f"renewals{suffix}_baseline_first_s"] = of("concurrent", base, "first_s")
        out[f"renewals{suffix}_failed"] = sum(r["concurrent"][ours]["failed"] for r in rounds)
        out[f"renewals{suffix}_baseline_failed"] = sum(
            r["concurrent"][base]["failed"] for r in rounds
        )
    out["whatif"] = whatif
    out["keepalive"] = keepalive
    out["rounds"] = rounds
    return out


async def sqlite_part(root: Path, plan: Plan, progress: bool) -> dict[str, Any]:
    """The SQLite backend on a file in ``root``."""
    path = root / "bench-leases.db"

    @contextlib.asynccontextmanager
    async def open_backend() -> AsyncIterator[LeaseBackend]:
        backend = SqliteLeaseBackend(path, busy_timeout=REQUEST_TIMEOUT)
        try:
            yield backend
        finally:
            await backend.aclose()

    @contextlib.asynccontextmanager
    async def open_noop() -> AsyncIterator[NoOp]:
        yield sqlite_noop(path)

    under_test = BackendUnderTest("sqlite", open_backend, open_noop, whatif=sqlite_whatif)
    return await measure_backend(under_test, plan, progress)


async def etcd_part(url: str, plan: Plan, progress: bool) -> dict[str, Any]:
    """The etcd backend on the server at ``url``."""

    @contextlib.asynccontextmanager
    async def open_backend() -> AsyncIterator[LeaseBackend]:
        backend = EtcdLeaseBackend([url], request_timeout=REQUEST_TIMEOUT)
        try:
            yield backend
        finally:
            with trio.CancelScope(shield=True):
                await backend.aclose()

    @contextlib.asynccontextmanager
    async def open_noop() -> AsyncIterator[NoOp]:
        channel = etcd_channel(url)
        try:
            yield etcd_noop(channel)
        finally:
            with trio.CancelScope(shield=True):
                await channel.aclose()

    under_test = BackendUnderTest(
        "etcd", open_backend, open_noop, bounded_inflight=BOUNDED_INFLIGHT
    )
    return await measure_backend(under_test, plan, progress)


# ==== node leases at scale =======================================================================


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds the process ``pid`` used so far (from ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def scale_cases(
    url: str,
    etcd_pid: int,
    sizes: tuple[int, ...],
    design: str,
    window: float,
    limit: float,
    progress: bool,
) -> list[dict[str, Any]]:
    """A node (``Leases`` with the default ``LeaseSettings``) holding more and more shard leases.

    ``design`` "node": attached to the node lease; "per-shard": each renewed on its own (the
    backend wrapped so that it offers no node leases). For each of ``sizes`` (ascending), the
    node acquires shard leases up to that many, then a window of ``window`` seconds: this
    process's CPU, etcd's CPU, requests to etcd, renewals, losses.
    """
    etcd = EtcdLeaseBackend([url], request_timeout=REQUEST_TIMEOUT)
    backend: LeaseBackend = etcd if design == "node" else CountingBackend(etcd)
    cases: list[dict[str, Any]] = []
    try:
        with trio.fail_after(limit), quiet_logs("p2pshard.lease"):
            async with trio.open_nursery() as nursery:
                leases = Leases(backend, OWNER, LeaseSettings(), "bench", nursery)
                handles: list[Lease | AttachedLease] = []
                refused: list[str] = []

                async def acquire(handle: Lease | AttachedLease) -> None:
                    if await handle.acquire() is None:
                        refused.append(handle.name)

                for shards in sizes:
                    more = [
                        leases.shard_lease("Scale", str(i)) for i in range(len(handles), shards)
                    ]
                    started = time.perf_counter()
                    await bounded(more, acquire, SCALE_SETUP_INFLIGHT)
                    handles += more
                    out: dict[str, Any] = {"shards": shards, "design": design, "window_s": window}
                    out["acquire_s"] = time.perf_counter() - started
                    if refused:
                        raise BenchmarkError(f"{len(refused)} new shard leases were refused")
                    before, paths = leases.statistics(), dict(etcd.requests)
                    cpu, etcd_cpu = time.process_time(), cpu_seconds(etcd_pid)
                    wall = time.perf_counter()
                    await trio.sleep(window)
                    wall = time.perf_counter() - wall
                    cpu, etcd_cpu = time.process_time() - cpu, cpu_seconds(etcd_pid) - etcd_cpu
                    after = leases.statistics()
                    requests = {k: v - paths.get(k, 0) for k, v in etcd.requests.items()}
                    out.update(
                        {
                            "core_fraction": cpu / wall,
                            "etcd_core_fraction": etcd_cpu / wall,
                            "requests_per_s": sum(requests.values()) / wall,
                            "requests": {k: v for k, v in requests.items() if v},
                            "renewed": after.renewals["renewed"] - before.renewals["renewed"],
                            "renewals_failed": (
                                after.renewals["failed"] - before.renewals["failed"]
                            ),
                            "lost": after.lost - before.lost,
                            "held": sum(1 for h in handles if h.check()),
                        }
                    )
                    cases.append(out)
                    progress_line(
                        progress,
                        f"scale: {shards:,} shards, {design} leases: "
                        f"{out['core_fraction'] * 100:.2f} % of a core, etcd "
                        f"{out['etcd_core_fraction'] * 100:.2f} %, "
                        f"{out['requests_per_s']:.2f} requests/s, {out['held']:,} held, "
                        f"{out['lost']} lost ({shards - len(handles) + len(more):,} acquired "
                        f"in {out['acquire_s']:.1f} s)",
                    )
                await leases.release_all()
                nursery.cancel_scope.cancel()
    finally:
        await etcd.aclose()
    return cases


async def scale_part(url: str, etcd_pid: int, plan: Plan, progress: bool) -> dict[str, Any]:
    """Baselines (an idle node; the per-shard design at 100 shards), then the node lease at
    each size."""
    window, limit = plan.scale_window, plan.part_limit * 2
    cases = [
        *await scale_cases(url, etcd_pid, (0,), "node", window, limit, progress),
        *await scale_cases(url, etcd_pid, (100,), "per-shard", window, limit, progress),
        *await scale_cases(url, etcd_pid, plan.scale_sizes, "node", window, limit, progress),
    ]
    return {"cases": cases}


# ==== first messages ==============================================================================


def node_config(certs: Path, lease: LeaseSettings) -> NodeConfig:
    """A node on 127.0.0.1 (any free port) with the certificate made for it, and ``lease``."""
    name = transport_bench.SERVER_NODE
    files = certs / name
    return NodeConfig(
        cluster_name=transport_bench.CLUSTER,
        node_name=name,
        bind_host=HOST,
        bind_port=0,
        tls=TlsFiles(
            ca_file=files / "ca.pem",
            cert_file=files / "node.pem",
            key_file=files / "node-key.pem",
        ),
        lease=lease,
        log_level="WARNING",
    )


class EtcdAlone:
    """A shard lease's transaction sent to etcd straight, beside the first messages.

    Over the connections the backend keeps to an ``http://`` endpoint; each a put-if-absent of a
    new key onto one etcd lease, as a shard takes its lease attached to the node lease: a raft
    entry, etcd's WAL fsync on the data directory's disk, its JSON gateway, and nothing of the
    node.
    """

    def __init__(self, url: str) -> None:
        self.channel = etcd_channel(url)
        self.lease_id = ""
        self.sent = 0

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, content = await self.channel.post(path, body)
        if status != 200:
            raise BenchmarkError(f"etcd {path}: HTTP {status}: {content[:200]!r}")
        answer: dict[str, Any] = json.loads(content)
        return answer

    async def txn(self) -> float:
        """Seconds one transaction took."""
        if not self.lease_id:
            self.lease_id = (await self.call("/v3/lease/grant", {"TTL": "60"}))["ID"]
        self.sent += 1
        key = base64.b64encode(f"p2pshard/bench/alone/{self.sent}".encode()).decode("ascii")
        body = {
            "compare": [
                {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            ],
            "success": [{"request_put": {"key": key, "value": "eA==", "lease": self.lease_id}}],
            "failure": [{"request_range": {"key": key}}],
        }
        sent = time.perf_counter()
        await self.call("/v3/kv/txn", body)
        return time.perf_counter() - sent

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            if self.lease_id:
                await self.call("/v3/lease/revoke", {"ID": self.lease_id})
            await self.channel.aclose()


async def first_ask(region: ShardRegion, entity_id: str) -> float | None:
    """Seconds from the ask to an entity of a shard never used before until its answer.

    None if it timed out (``ASK_TIMEOUT``): counted and reported, not a sample.
    """
    sent = time.perf_counter()
    try:
        await region.entity_ref(entity_id).ask(worker.Add(1), timeout=ASK_TIMEOUT)
    except AskTimeout:
        return None
    return time.perf_counter() - sent


async def first_messages(
    certs: Path,
    lease: LeaseSettings,
    plan: Plan,
    label: str,
    progress: bool,
    backend: LeaseBackend | None = None,
    alone: EtcdAlone | None = None,
) -> dict[str, Any]:
    """One node with ``lease``; per round, two fresh entity types (leases on, off) on it.

    ``backend``: the node's lease backend instead of the one ``lease`` names (closed here).
    ``alone``: after each pair of asks, a pause and one shard lease transaction sent to etcd
    straight (``etcd_alone`` in each round).
    """
    rounds: list[dict[str, Any]] = []
    with trio.fail_after(plan.part_limit), quiet_logs("membership", "crdt"):
        async with open_node(node_config(certs, lease), lease_backend=backend) as node:
            node.cluster.join(node.address.address)
            with trio.fail_after(30):
                await node.cluster.wait_up()
            extractor = HashExtractor(plan.first_shards)
            ids = worker.one_id_per_shard(extractor, "f-", range(plan.first_shards))
            for r in range(plan.first_rounds):
                started = time.monotonic()
                off = await node.sharding.start(
                    f"Plain{r}", worker.Counter, extractor=extractor, settings=ShardingSettings()
                )
                on = await node.sharding.start(
                    f"Leased{r}",
                    worker.Counter,
                    extractor=extractor,
                    settings=ShardingSettings(use_lease=True),
                )
                # One warm ask each first: the coordinators have started and allocated a shard,
                # and the region has registered, so every sample is a first message and no more.
                warm = worker.ids_in_shards(extractor, "w-", 1, range(1))[0]
                for region in (off, on):
                    await region.entity_ref(warm).ask(worker.Add(1), timeout=ASK_TIMEOUT)
                samples: dict[str, list[float]] = {"off": [], "on": [], "alone": []}
                timeouts = {"off": 0, "on": 0}
                pairs = [(off, "off"), (on, "on")]
                for i, entity_id in enumerate(list(ids.values())[1:]):
                    for region, key in pairs if i % 2 == 0 else pairs[::-1]:
                        await trio.sleep(FIRST_PAUSE)
                        took = await first_ask(region, entity_id)
                        if took is None:
                            timeouts[key] += 1
                        else:
                            samples[key].append(took)
                    if alone is not None:
                        await trio.sleep(FIRST_PAUSE)
                        samples["alone"].append(await alone.txn())
                held = on.statistics().shards
                # Hand the shards off, so that the leases of one round are released before the
                # next: a node keeping hundreds of leases alive is not what is measured here.
                with trio.move_on_after(30):
                    for type_name in (f"Plain{r}", f"Leased{r}"):
                        await node.sharding.graceful_shutdown(type_name)
                result: dict[str, Any] = {
                    "off": quantiles_ms(samples["off"]),
                    "on": quantiles_ms(samples["on"]),
                    "samples": len(samples["on"]),
                    "timeouts": timeouts,
                    "shards_with_leases": held,
                }
                if alone is not None:
                    result["etcd_alone"] = quantiles_ms(samples["alone"])
                rounds.append(result)
                progress_line(
                    progress,
                    f"first message, {label} round {r + 1}/{plan.first_rounds}: p50 "
                    f"{result['on']['p50_ms']:.2f} ms with shard leases, "
                    f"{result['off']['p50_ms']:.2f} ms without; p99 "
                    f"{result['on']['p99_ms']:.2f} / {result['off']['p99_ms']:.2f} ms"
                    + (
                        f"; etcd alone {result['etcd_alone']['p50_ms']:.2f} ms"
                        if alone is not None
                        else ""
                    )
                    + f" ({time.monotonic() - started:.1f} s)",
                )

    def col(get: Callable[[dict[str, Any]], float]) -> float:
        return median([get(r) for r in rounds])

    return {
        "backend": label,
        "on_p50_ms": col(lambda r: r["on"]["p50_ms"]),
        "on_p99_ms": col(lambda r: r["on"]["p99_ms"]),
        "off_p50_ms": col(lambda r: r["off"]["p50_ms"]),
        "off_p99_ms": col(lambda r: r["off"]["p99_ms"]),
        "added_ms_p50": col(lambda r: r["on"]["p50_ms"] - r["off"]["p50_ms"]),
        "added_ms_p99": col(lambda r: r["on"]["p99_ms"] - r["off"]["p99_ms"]),
        "ratio_p50": col(lambda r: r["on"]["p50_ms"] / r["off"]["p50_ms"]),
        "ratio_p99": col(lambda r: r["on"]["p99_ms"] / r["off"]["p99_ms"]),
        "samples": sum(r["samples"] for r in rounds),
        "timeouts_on": sum(r["timeouts"]["on"] for r in rounds),
        "timeouts_off": sum(r["timeouts"]["off"] for r in rounds),
        "etcd_alone_p50_ms": (
            col(lambda r: r["etcd_alone"]["p50_ms"]) if alone is not None else None
        ),
        "etcd_alone_over_none": (
            col(lambda r: r["etcd_alone"]["p50_ms"] / r["off"]["p50_ms"])
            if alone is not None
            else None
        ),
        "rounds": rounds,
    }


async def first_messages_etcd(certs: Path, url: str, plan: Plan, progress: bool) -> dict[str, Any]:
    """:func:`first_messages` with the etcd at ``url``, and etcd's transaction alone beside."""
    alone = EtcdAlone(url)
    try:
        return await first_messages(
            certs,
            LeaseSettings(backend="etcd", endpoints=(url,)),
            plan,
            "etcd",
            progress,
            alone=alone,
        )
    finally:
        await alone.aclose()


async def first_messages_per_shard(
    certs: Path, url: str, plan: Plan, progress: bool
) -> dict[str, Any]:
    """:func:`first_messages` with etcd leases of the design before node leases: a lease of its
    own per shard (the backend wrapped so that it offers no node leases)."""
    backend = CountingBackend(EtcdLeaseBackend([url], request_timeout=REQUEST_TIMEOUT))
    try:
        return await first_messages(
            certs,
            LeaseSettings(backend="etcd", endpoints=(url,)),
            plan,
            "etcd per-shard",
            progress,
            backend,
        )
    finally:
        await backend.aclose()


# ==== the report ==================================================================================


def run_all(plan: Plan, *, progress: bool) -> dict[str, Any]:
    """Every measurement in turn; the report."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="p2pshard-bench-leases-") as tmp:
        root = Path(tmp)
        certs = root / "certs"
        transport_bench.make_certificates(certs)
        # Each backend's first messages come before the load on it, which could linger.
        first_sqlite = trio.run(
            first_messages,
            certs,
            LeaseSettings(backend="sqlite", path=root / "node-leases.db"),
            plan,
            "sqlite",
            progress,
        )
        sqlite = trio.run(sqlite_part, root, plan, progress)
        etcd: dict[str, Any] | None = None
        first_etcd: dict[str, Any] | None = None
        first_etcd_per_shard: dict[str, Any] | None = None
        scale: dict[str, Any] | None = None
        etcd_missing = ""
        try:
            etcd_dir = root / "etcd"
            etcd_dir.mkdir()
            with running_etcd(etcd_dir) as server:
                first_etcd = trio.run(first_messages_etcd, certs, server.url, plan, progress)
                first_etcd_per_shard = trio.run(
                    first_messages_per_shard, certs, server.url, plan, progress
                )

                scale = trio.run(scale_part, server.url, server.pid, plan, progress)
                etcd = trio.run(etcd_part, server.url, plan, progress)
        except EtcdNotInstalled as exc:
            etcd_missing = str(exc)
            progress_line(progress, f"etcd skipped: {exc}")
    for name, figures in (("sqlite", sqlite), ("etcd", etcd)):
        for key in (
            *(
                f"{op}_{q}"
                for op in ("acquire", "renew", "release")
                for q in ("p50_ms", "p99_ms", "baseline_p50_ms")
            ),
            "acquire_ratio",
            "renew_ratio",
            "release_ratio",
            "renewals_per_s",
            "renewals_baseline_per_s",
            "renewals_ratio",
            "renewals_bounded_per_s",
            "renewals_bounded_baseline_per_s",
            "renewals_bounded_ratio",
        ):
            if figures is None or key in figures:
                report[f"{name}_{key}"] = None if figures is None else figures[key]
    report["first_message_added_ms_p50"] = first_sqlite["added_ms_p50"]
    report["first_message_ratio_p50"] = first_sqlite["ratio_p50"]
    report["first_message_p50_ms"] = first_sqlite["on_p50_ms"]
    report["first_message_no_lease_p50_ms"] = first_sqlite["off_p50_ms"]
    report["etcd_first_message_added_ms_p50"] = (
        None if first_etcd is None else first_etcd["added_ms_p50"]
    )
    report["etcd_first_message_ratio_p50"] = None if first_etcd is None else first_etcd["ratio_p50"]
    report["first_message_etcd_over_none"] = report["etcd_first_message_ratio_p50"]
    report["first_message_etcd_per_shard_over_none"] = (
        None if first_etcd_per_shard is None else first_etcd_per_shard["ratio_p50"]
    )
    report["etcd_alone_p50_ms"] = None if first_etcd is None else first_etcd["etcd_alone_p50_ms"]
    report["etcd_alone_over_none"] = (
        None if first_etcd is None else first_etcd["etcd_alone_over_none"]
    )
    report.update(scale_keys(scale))
    report.update(
        {
            "sqlite": sqlite,
            "etcd": etcd,
            "etcd_missing": etcd_missing,
            "first_message_sqlite": first_sqlite,
            "first_message_etcd": first_etcd,
            "first_message_etcd_per_shard": first_etcd_per_shard,
            "scale": scale,
            "counts": attrs.asdict(plan),
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "elapsed_s": time.monotonic() - started,
        }
    )
    return report


def scale_keys(scale: dict[str, Any] | None) -> dict[str, Any]:
    """The scale part's headline figures, flat (None when etcd was not measured)."""

    def case(shards: int, design: str) -> dict[str, Any] | None:
        if scale is None:
            return None
        found = [c for c in scale["cases"] if (c["shards"], c["design"]) == (shards, design)]
        return found[0] if found else None

    out: dict[str, Any] = {}
    for shards in (100, 1000, 10_000):
        c = case(shards, "node")
        label = "10k" if shards == 10_000 else f"{shards}"
        for key, field in (
            ("etcd_core_fraction", "core_fraction"),
            ("etcd_server_core_fraction", "etcd_core_fraction"),
            ("etcd_requests_per_s", "requests_per_s"),
        ):
            out[f"{key}_{label}_shards"] = None if c is None else c[field]
    for name, (shards, design) in (("idle", (0, "node")), ("per_shard_100", (100, "per-shard"))):
        c = case(shards, design)
        out[f"etcd_core_fraction_{name}"] = None if c is None else c["core_fraction"]
        out[f"etcd_requests_per_s_{name}"] = None if c is None else c["requests_per_s"]
    return out


def scale_rows(scale: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """The table rows of the scale part."""
    if scale is None:
        return [("node leases at scale: not measured", "", "", "")]
    cases = scale["cases"]
    idle = next(c for c in cases if c["shards"] == 0)
    per_shard = next(c for c in cases if c["design"] == "per-shard")
    rows: list[tuple[str, ...]] = [
        (
            "etcd, node idle (no lease): % of a core / etcd % / requests/s",
            f"{idle['core_fraction'] * 100:.2f} / {idle['etcd_core_fraction'] * 100:.2f} / "
            f"{idle['requests_per_s']:.2f}",
            "",
            "",
        )
    ]
    for c in cases:
        if c["shards"] == 0:
            continue
        what = "a lease per shard" if c["design"] == "per-shard" else "node lease"
        rows.append(
            (
                f"etcd, {c['shards']:,} shards, {what}: % of a core / etcd % / requests/s",
                f"{c['core_fraction'] * 100:.2f} / {c['etcd_core_fraction'] * 100:.2f} / "
                f"{c['requests_per_s']:.2f}",
                f"{per_shard['core_fraction'] * 100:.2f} / "
                f"{per_shard['etcd_core_fraction'] * 100:.2f} / "
                f"{per_shard['requests_per_s']:.2f} at 100, a lease each",
                f"{c['held']:,} held, {c['lost']} lost",
            )
        )
    return rows


def _failed(count: int) -> str:
    return f" ({count:,} failed)" if count else ""


def backend_rows(
    name: str, b: dict[str, Any] | None, plan: dict[str, Any]
) -> list[tuple[str, ...]]:
    """The table rows of one backend."""
    if b is None:
        return [(f"{name}: not measured", "", "", "")]
    noop = "connect+SELECT 1" if name == "sqlite" else "POST kv/range"
    rows: list[tuple[str, ...]] = []
    for op, what in (
        ("acquire", "Lease.acquire, new name"),
        ("renew", "backend.renew"),
        ("release", "Lease.release"),
    ):
        rows.append(
            (
                f"{name} {what}, p50 / p99 (ms)",
                f"{cell(b[f'{op}_p50_ms'])} / {cell(b[f'{op}_p99_ms'])}",
                f"{cell(b[f'{op}_baseline_p50_ms'])} / {cell(b[f'{op}_baseline_p99_ms'])} {noop}",
                cell(b[f"{op}_ratio"]),
            )
        )
    rows.append(
        (
            "    one renewal at a time (renewals/s)",
            cell(b["renewals_sequential_per_s"], ",.0f"),
            "",
            "",
        )
    )
    leases = plan["concurrent_leases"]
    for suffix, what in (
        ("", f"{leases:,} leases at once"),
        ("_bounded", f"{leases:,} leases, at most {BOUNDED_INFLIGHT} in flight"),
    ):
        if f"renewals{suffix}_per_s" not in b:
            continue
        rows += [
            (
                f"{name} renewals/s, {what}",
                cell(b[f"renewals{suffix}_per_s"], ",.0f") + _failed(b[f"renewals{suffix}_failed"]),
                cell(b[f"renewals{suffix}_baseline_per_s"], ",.0f")
                + " no-ops/s"
                + _failed(b[f"renewals{suffix}_baseline_failed"]),
                cell(b[f"renewals{suffix}_ratio"]),
            ),
            (
                "    first answer after (s)",
                cell(b[f"renewals{suffix}_first_s"]),
                cell(b[f"renewals{suffix}_baseline_first_s"]),
                "",
            ),
            (
                "    renewal p50 / p99 under that load, queueing included (ms)",
                f"{cell(b[f'renewals{suffix}_loaded_p50_ms'])} / "
                f"{cell(b[f'renewals{suffix}_loaded_p99_ms'])}",
                "",
                "",
            ),
        ]
    whatif = b["whatif"]
    if whatif:
        rows.append(
            (
                "    what-if: renew p50 with another connection open (ms)",
                cell(whatif["renew_keeper_open"]["p50_ms"]),
                f"{cell(whatif['renew_alone']['p50_ms'])} without it",
                cell(whatif["renew_keeper_open"]["p50_ms"] / whatif["renew_alone"]["p50_ms"]),
            )
        )
    k = b["keepalive"]
    if k is not None:
        rows.append(
            (
                f"{name} keep-alive, {k['leases']:,} default leases, {k['seconds']:g} s",
                f"{k['renewals_per_s']:,.0f} renewals/s",
                f"{k['needed_per_s']:,.0f}/s needed",
                cell(k["renewals_per_s"] / k["needed_per_s"] if k["needed_per_s"] else math.nan),
            )
        )
        pending = k["leases"] - k["granted"] - k["acquire_failed"]
        rows.append(
            (
                "    granted / failed / unanswered / renewals failed / lost",
                f"{k['granted']:,} / {k['acquire_failed']:,} / {pending:,} / "
                f"{k['renewals_failed']:,} / {k['lost']:,}",
                f"burst over after {k['acquire_burst_s']:.1f} s",
                "",
            )
        )
    return rows


def first_rows(label: str, f: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """The table rows of one first-message measurement."""
    if f is None:
        return [(f"first message, {label} shard leases: not measured", "", "", "")]
    return [
        (
            f"first ask to a new shard, {label} leases, p50 (ms)",
            cell(f["on_p50_ms"]),
            f"{cell(f['off_p50_ms'])} leases off",
            cell(f["ratio_p50"]),
        ),
        (
            "    p99 (ms)",
            cell(f["on_p99_ms"]),
            f"{cell(f['off_p99_ms'])} leases off",
            cell(f["ratio_p99"]),
        ),
        (
            "    added by the lease, p50 / p99 (ms)",
            f"{cell(f['added_ms_p50'])} / {cell(f['added_ms_p99'])}",
            "",
            "",
        ),
        *(
            [
                (
                    f"    asks that timed out ({ASK_TIMEOUT:g} s), not in the figures",
                    f"{f['timeouts_on']}",
                    f"{f['timeouts_off']} leases off",
                    "",
                )
            ]
            if f["timeouts_on"] or f["timeouts_off"]
            else []
        ),
    ]


def alone_rows(f: dict[str, Any] | None) -> list[tuple[str, ...]]:
    """The row of what etcd alone takes for a shard lease's transaction (:class:`EtcdAlone`)."""
    if f is None or f["etcd_alone_p50_ms"] is None:
        return []
    return [
        (
            "    etcd alone: a shard lease's transaction, p50 (ms)",
            cell(f["etcd_alone_p50_ms"]),
            f"{cell(f['off_p50_ms'])} leases off",
            cell(f["etcd_alone_over_none"]),
        )
    ]


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    counts = report["counts"]
    rows = [
        *backend_rows("sqlite", report["sqlite"], counts),
        *backend_rows("etcd", report["etcd"], counts),
        *first_rows("sqlite", report["first_message_sqlite"]),
        *first_rows("etcd", report["first_message_etcd"]),
        *alone_rows(report["first_message_etcd"]),
        *first_rows("etcd per-shard", report["first_message_etcd_per_shard"]),
        *scale_rows(report["scale"]),
    ]
    header = ("figure", "ours", "baseline (same run)", "ratio")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{first}  {rest}".rstrip()

    first = report["first_message_sqlite"]
    lines = [
        "lease benchmark: SQLite on a temporary file, a real etcd on 127.0.0.1; ratios are "
        "medians of per-round ratios of samples paired back to back",
        f"{counts['rounds']} round(s) per backend of {counts['names']} names; "
        f"{counts['concurrent_leases']:,} leases renewing in closed loop for "
        f"{counts['window']:g} s windows; first messages: {counts['first_rounds']} round(s) of "
        f"{first['samples'] // counts['first_rounds']} new shards per type, one node with two "
        "entity types",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs; 1-minute load average "
        f"before the run {report['load_average_before']:.2f}",
    ]
    if report["etcd_missing"]:
        lines.append(f"etcd not measured: {report['etcd_missing']}")
    if report["load_average_before"] >= 0.5:
        lines.append(
            "warning: other processes were using the CPUs when the run started; the absolute "
            "figures are pessimistic (ratios of back-to-back pairs suffer less)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="smaller counts and windows; under two minutes")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    plan = make_plan(quick=args.quick)
    return run_and_print(
        lambda: run_all(plan, progress=not args.json),
        format_table,
        as_json=args.json,
        stopped="etcd stopped, temporary files removed",
    )


if __name__ == "__main__":
    sys.exit(main())
