"""Journal benchmark: appends to the SQLite and PostgreSQL journals, against raw inserts.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.persistence            # full run, about 5 minutes
    .venv/bin/python -m benchmarks.persistence --quick    # smaller counts, about 80 seconds
    .venv/bin/python -m benchmarks.persistence --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.persistence --appends --backend sqlite --streams 256
                                                          # one figure: SQLite at 256 streams

Progress lines go to stderr unless ``--json``.

Everything runs in this process, on this machine: the SQLite files live in a temporary
directory; PostgreSQL is a real server (``p2pshard.testing.running_postgres``: initdb into a
temporary directory, a free port on 127.0.0.1, fsync on as in production) that this benchmark
starts and stops. Each event is 100 bytes, one event per append, as an entity's ``persist`` makes.

For each backend (``SqliteJournal``, ``PostgresJournal``, built as ``open_node`` builds them):

- ``append``: one append at a time to one stream, p50 and p99. Each sample is paired with a
  baseline taken just before or after it (alternately): the raw INSERT and commit of one row
  into a table of the same shape, on the same kind of storage, in a worker thread through
  ``trio.to_thread.run_sync`` as the journal runs its calls. SQLite's baseline is another file in
  WAL mode with ``synchronous=FULL`` (``BEGIN IMMEDIATE``, ``INSERT``, ``COMMIT`` on a kept
  connection); PostgreSQL's an autocommitted ``INSERT`` on a kept connection to the same server.
  ``ratio`` = p50 ours / p50 baseline, the median over rounds.
- ``appends/s``: 16, 64 and 256 tasks, each appending to a stream of its own in a closed loop
  for a fixed window; appends completed per second, and the latency of each append under that
  load (p50, p99). Baseline: as many tasks doing the raw single-row insert, through 4 threads
  (the journals' default pool). One window of each per round, back to back in alternating
  order; the figures and the ratio are medians over rounds, the latencies over all windows.
  ``batch``: appends per transaction the journal's group commit wrote, on average.
- ``appends/s`` on long streams: when the windows include 256 streams, as many windows again at
  256 streams whose streams (the journal's and the baseline's) already hold 300 events each,
  written before the window starts (and for SQLite checkpointed, so that the window does not
  copy the bulk load's pages). A fresh stream's first events share index pages with other
  streams', so a short window of fresh streams commits fewer pages per batch than long-lived
  entities do; these windows show the rate and p99 once every stream's newest entries have a
  page of their own.
- CPU per append in those windows (medians over rounds): this process's, every thread (the
  event loop, the commit's threads, the benchmark's own tasks), and for PostgreSQL the server's
  (its processes, read from ``/proc``), each beside the raw insert's. From them, the most
  appends per second the machine's cores could complete with that much CPU per append, if
  every core were busy all the time (``cpu_ceiling_per_s``), and that over the raw rate
  (``cpu_ceiling_ratio``): a ratio the journal cannot pass on this machine without spending
  less CPU per append.

What the journal adds to a raw insert is the stream row (read, locked, updated: the fence and
sequence checks) and, for PostgreSQL, the extra round trips of those statements; what it saves
is the commit: appends that arrive while one is committed go out together in the next
(``p2pshard.persistence._group_commit``).

The entity side (``--entity`` runs only these, ``--appends`` none of them; ``--backend`` picks
one backend, ``--streams`` the stream counts of the closed-loop windows):

- ``recovery``: 1,000 streams (five events, a snapshot at the third) recover at once with a new
  fencing token, as remembered entities do after a rebalance or a crash: gathered into batched
  reads (``p2pshard.persistence._gather``, what ``EventSourcedEntity`` does) against one
  ``recover`` call per stream, all issued at once (what it did before). One of each per round,
  the order alternating; milliseconds for the 1,000, medians, and the median of per-round ratios
  (one at a time over batched). ``transactions``: the reads the batched rounds took.
- ``snapshot-heavy commands/s``: 64 event-sourced entities, each a closed loop of commands that
  persist one event, a 1 KiB snapshot every 2 events (``benchmarks/_entity_worker.py``, in a
  process of its own per window). With ``--before TREE`` (a checkout of an earlier release, e.g.
  ``git worktree add --detach /tmp/before v0.x``) each round runs a window of that tree and one of
  this one, the order alternating: ``ratio`` is the median of per-round ratios (this one over the
  earlier one). A window without snapshots, of this tree, is given for scale.

``--json`` adds the figures a script checks, for ``sqlite`` and ``postgres``:
``<backend>_appends_256_ratio`` (appends/s at 256 streams over the raw single-insert rate at 256
tasks), ``<backend>_append_p99_ms_256`` (p99 of an append at 256 streams) and
``<backend>_append_1_p50_ratio`` (one append at a time: p50 over the raw insert's),
``<backend>_cpu_ceiling_256_ratio`` (the ceiling above, at 256 streams), and
``<backend>_appends_256_long_ratio`` and ``<backend>_append_p99_ms_256_long`` (the first two on
long streams).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import psycopg
import trio

from benchmarks._report import benchmark_parser, quantiles_ms
from p2pshard import Journal, PostgresJournal, SqliteJournal
from p2pshard.persistence._gather import JournalBatcher
from p2pshard.testing import PostgresNotInstalled, running_postgres

EVENT = b"e" * 100
STREAMS = (16, 64, 256)
"""Concurrent streams of the throughput windows."""
THREADS = 4
"""The journals' default limit of worker threads; the baselines use a limiter as large."""
LONG_AT = 256
"""Streams of the long-stream windows (run when the closed-loop windows include this count)."""
HELD = 300
"""Events each stream of a long-stream window already holds when the window starts: enough that
the newest entries of every stream's key sit on a page of their own, as for long-lived entities
(in a fresh stream's first events, many streams share a page)."""


@attrs.frozen(kw_only=True)
class Plan:
    samples: int
    """Paired append samples per round."""
    rounds: int
    window: float
    """Seconds of each closed-loop throughput window."""


def make_plan(*, quick: bool) -> Plan:
    return Plan(
        samples=150 if quick else 500, rounds=2 if quick else 5, window=1.0 if quick else 2.0
    )


def progress(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


class Baseline:
    """A raw insert-and-commit of one row per call, in worker threads with kept connections."""

    def __init__(
        self,
        connect: Callable[[], Any],
        insert: Callable[[Any, str, int], None],
        fill: Callable[[Any, list[tuple[str, int, bytes]]], None],
    ) -> None:
        self._connect, self._insert, self._fill = connect, insert, fill
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self.limiter = trio.CapacityLimiter(THREADS)

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            with self._lock:
                self._all.append(conn)
        return conn

    async def insert(self, stream: str, seq: int) -> None:
        await trio.to_thread.run_sync(
            lambda: self._insert(self._conn(), stream, seq), limiter=self.limiter
        )

    async def fill(self, streams: list[str], held: int) -> None:
        """Give each of ``streams`` the rows 1 to ``held``, in one transaction."""
        rows = [(stream, seq, EVENT) for stream in streams for seq in range(1, held + 1)]
        await trio.to_thread.run_sync(lambda: self._fill(self._conn(), rows), limiter=self.limiter)

    def close(self) -> None:
        for conn in self._all:
            conn.close()


def sqlite_baseline(path: Path) -> Baseline:
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE raw (stream TEXT NOT NULL, seq INTEGER NOT NULL, payload BLOB NOT NULL, "
            "PRIMARY KEY (stream, seq))"
        )

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    def insert(conn: sqlite3.Connection, stream: str, seq: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO raw VALUES (?, ?, ?)", (stream, seq, EVENT))
        conn.execute("COMMIT")

    def fill(conn: sqlite3.Connection, rows: list[tuple[str, int, bytes]]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO raw VALUES (?, ?, ?)", rows)
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()  # as the journal's fill

    return Baseline(connect, insert, fill)


def postgres_baseline(dsn: str) -> Baseline:
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(
            "CREATE TABLE raw (stream TEXT NOT NULL, seq BIGINT NOT NULL, payload BYTEA NOT NULL, "
            "PRIMARY KEY (stream, seq))"
        )

    def insert(conn: psycopg.Connection[Any], stream: str, seq: int) -> None:
        conn.execute("INSERT INTO raw VALUES (%s, %s, %s)", (stream, seq, EVENT))

    def fill(conn: psycopg.Connection[Any], rows: list[tuple[str, int, bytes]]) -> None:
        with conn.cursor().copy("COPY raw (stream, seq, payload) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)

    return Baseline(lambda: psycopg.connect(dsn, autocommit=True), insert, fill)


async def timed(call: Awaitable[None]) -> float:
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


async def latencies(journal: Journal, baseline: Baseline, plan: Plan, show: bool) -> dict[str, Any]:
    ours_all: list[float] = []
    base_all: list[float] = []
    ratios = []
    for r in range(plan.rounds):
        stream = f"Bench|latency-{r}"
        ours, base = [], []
        await journal.append(stream, 1, [EVENT], token=1)  # warm: connections, tables
        await baseline.insert(stream, 1)
        for k in range(2, plan.samples + 2):
            pair = [
                lambda k=k, s=stream: timed(journal.append(s, k, [EVENT], token=1)),
                lambda k=k, s=stream: timed(baseline.insert(s, k)),
            ]
            if k % 2:  # ours first
                ours.append(await pair[0]())
                base.append(await pair[1]())
            else:  # the baseline first
                base.append(await pair[1]())
                ours.append(await pair[0]())
        ratios.append(statistics.median(ours) / statistics.median(base))
        ours_all += ours
        base_all += base
        progress(
            show,
            f"  round {r + 1}: p50 {statistics.median(ours) * 1e3:.2f} ms ours, "
            f"{statistics.median(base) * 1e3:.2f} ms baseline",
        )
    ours_q, base_q = quantiles_ms(ours_all), quantiles_ms(base_all)
    ours_p50, ours_p99 = ours_q["p50_ms"], ours_q["p99_ms"]
    base_p50, base_p99 = base_q["p50_ms"], base_q["p99_ms"]
    return {
        "append_p50_ms": ours_p50,
        "append_p99_ms": ours_p99,
        "baseline_p50_ms": base_p50,
        "baseline_p99_ms": base_p99,
        "ratio_p50": statistics.median(ratios),
        "sequential_appends_per_s": 1 / statistics.mean(ours_all),
        "samples": len(ours_all),
    }


def process_cpu() -> float:
    """CPU seconds this process (every thread) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu(pid: int | None) -> float | None:
    """CPU seconds the server process ``pid`` and its children have used so far.

    Its live children (PostgreSQL's backends, writers, autovacuum workers) from ``/proc``, and
    those already reaped through its own children's count; None without a server or ``/proc``.
    """
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            # After the command's closing parenthesis: state, ppid, ... utime is field 14.
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(entry) == pid:
            total += sum(int(f) for f in fields[11:15]) / tick  # its own and reaped children's
        elif int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


@attrs.define
class Window:
    """What one closed-loop window did: completions per second, each one's latency, CPU used."""

    rate: float
    latencies: list[float]
    cpu_s: float
    """CPU seconds this process used in the window."""
    server_cpu_s: float | None
    """CPU seconds the database server used in it (None: no server, SQLite)."""


async def closed_loop(
    step: Callable[[int, int], Awaitable[None]],
    tasks: int,
    window: float,
    server_pid: int | None = None,
) -> Window:
    """``tasks`` tasks calling ``step(task, n)`` for ``window`` seconds."""
    latencies: list[float] = []

    async def task(t: int) -> None:
        for n in itertools.count(1):
            began = time.perf_counter()
            await step(t, n)
            latencies.append(time.perf_counter() - began)

    server0 = server_cpu(server_pid)  # (reading /proc: outside the window and its CPU)
    cpu0 = process_cpu()
    start = time.perf_counter()
    with trio.move_on_after(window):
        async with trio.open_nursery() as nursery:
            for t in range(tasks):
                nursery.start_soon(task, t)
    elapsed = time.perf_counter() - start
    cpu1 = process_cpu()
    server1 = server_cpu(server_pid)
    return Window(
        len(latencies) / elapsed,
        latencies,
        cpu1 - cpu0,
        None if server0 is None or server1 is None else server1 - server0,
    )


def cpu_us_each(windows: list[Window]) -> dict[str, float | None]:
    """CPU microseconds per completion in ``windows`` (medians): this process's, the server's."""
    node = [w.cpu_s / len(w.latencies) * 1e6 for w in windows if w.latencies]
    server = [
        w.server_cpu_s / len(w.latencies) * 1e6
        for w in windows
        if w.latencies and w.server_cpu_s is not None
    ]
    return {
        "node": statistics.median(node) if node else None,
        "server": statistics.median(server) if server else None,
    }


def batches(journal: Journal) -> tuple[int, int]:
    """(transactions, appends) the journal's group commit wrote so far."""
    stats = journal.group_commit_statistics()  # type: ignore[attr-defined]
    return stats.commits, stats.appends


def checkpoint_sqlite(path: Path) -> None:
    """Copy SQLite's write-ahead log of ``path`` into the file and empty it."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=30.0)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


async def fill_streams(journal: Journal, streams: list[str], held: int) -> None:
    """Give each of ``streams`` the events 1 to ``held``: one append each, all at once.

    Then, for SQLite, the log is checkpointed: the fill is a bulk load no steady state has, and
    the window's first checkpoint would otherwise copy its pages.
    """

    async def fill(pid: str) -> None:
        await journal.append(pid, 1, [EVENT] * held, token=None)

    async with trio.open_nursery() as nursery:
        for pid in streams:
            nursery.start_soon(fill, pid)
    if isinstance(journal, SqliteJournal):
        await trio.to_thread.run_sync(checkpoint_sqlite, journal.path)


async def throughput(
    journal: Journal,
    baseline: Baseline,
    plan: Plan,
    tasks: int,
    server_pid: int | None = None,
    *,
    held: int = 0,
) -> dict[str, float | None]:
    """Windows of ours and the baseline back to back, the order alternating, once per round.

    With ``held``, each window's streams (ours and the baseline's) first get that many events,
    outside the window, and its appends go on from there.
    """
    kind = "long" if held else "load"
    ours, base, ratios = [], [], []
    ours_windows: list[Window] = []
    base_windows: list[Window] = []
    ours_lat: list[float] = []
    base_lat: list[float] = []
    written = [0, 0]  # commits and appends of the journal's windows
    for r in range(plan.rounds):

        async def journal_window(r: int = r) -> Window:
            if held:
                streams = [f"Bench|{kind}-{tasks}-{r}-{t}" for t in range(tasks)]
                await fill_streams(journal, streams, held)
            before = batches(journal)  # the window's commits only, not the fill's
            window = await closed_loop(
                lambda t, n: journal.append(
                    f"Bench|{kind}-{tasks}-{r}-{t}", n + held, [EVENT], token=None
                ),
                tasks,
                plan.window,
                server_pid,
            )
            after = batches(journal)
            written[0] += after[0] - before[0]
            written[1] += after[1] - before[1]
            return window

        async def baseline_window(r: int = r) -> Window:
            if held:
                await baseline.fill([f"{kind}-{tasks}-{r}-{t}" for t in range(tasks)], held)
            return await closed_loop(
                lambda t, n: baseline.insert(f"{kind}-{tasks}-{r}-{t}", n + held),
                tasks,
                plan.window,
                server_pid,
            )

        if r % 2:
            b, o = await baseline_window(), await journal_window()
        else:
            o, b = await journal_window(), await baseline_window()
        ours.append(o.rate)
        base.append(b.rate)
        ours_windows.append(o)
        base_windows.append(b)
        ratios.append(o.rate / b.rate)
        ours_lat += o.latencies
        base_lat += b.latencies
    ours_q, base_q = quantiles_ms(ours_lat), quantiles_ms(base_lat)
    ours_cpu, base_cpu = cpu_us_each(ours_windows), cpu_us_each(base_windows)
    spent = [x for x in (ours_cpu["node"], ours_cpu["server"]) if x is not None]
    # With this much CPU per append, the machine's cores could complete no more than this.
    ceiling = (os.cpu_count() or 1) / (sum(spent) * 1e-6) if spent else None
    return {
        "appends_per_s": statistics.median(ours),
        "baseline_per_s": statistics.median(base),
        "ratio": statistics.median(ratios),
        "append_p50_ms": ours_q["p50_ms"],
        "append_p99_ms": ours_q["p99_ms"],
        "baseline_p50_ms": base_q["p50_ms"],
        "baseline_p99_ms": base_q["p99_ms"],
        "batch": written[1] / max(1, written[0]),
        "cpu_us_per_append": ours_cpu["node"],
        "server_cpu_us_per_append": ours_cpu["server"],
        "baseline_cpu_us_per_insert": base_cpu["node"],
        "baseline_server_cpu_us_per_insert": base_cpu["server"],
        "cpu_ceiling_per_s": ceiling,
        "cpu_ceiling_ratio": None if ceiling is None else ceiling / statistics.median(base),
    }


def window_line(figures: dict[str, float | None]) -> str:
    """A progress line for the closed-loop windows ``throughput`` measured."""
    return (
        f"  {figures['appends_per_s']:,.0f} appends/s (raw {figures['baseline_per_s']:,.0f}), "
        f"p99 {figures['append_p99_ms']:.1f} ms, {figures['batch']:.1f} per commit"
    )


async def measure(
    label: str,
    journal: Journal,
    baseline: Baseline,
    plan: Plan,
    show: bool,
    streams: tuple[int, ...] = STREAMS,
    server_pid: int | None = None,
) -> dict[str, Any]:
    progress(show, f"{label}: append latency")
    try:
        result = await latencies(journal, baseline, plan, show)
        result["streams"] = {}
        for tasks in streams:
            progress(show, f"{label}: {tasks} tasks in closed loop, {plan.rounds} x 2 windows")
            figures = await throughput(journal, baseline, plan, tasks, server_pid)
            result["streams"][str(tasks)] = figures
            progress(show, window_line(figures))
        if LONG_AT in streams:
            progress(
                show,
                f"{label}: {LONG_AT} tasks on streams holding {HELD} events, "
                f"{plan.rounds} x 2 windows",
            )
            figures = await throughput(journal, baseline, plan, LONG_AT, server_pid, held=HELD)
            result["long"] = {"streams": LONG_AT, "held": HELD, **figures}
            progress(show, window_line(figures))
        if streams:  # the fewest streams' figures, at the top level too
            fewest = result["streams"][str(min(streams))]
            result.update({k: fewest[k] for k in ("appends_per_s", "baseline_per_s", "ratio")})
    finally:
        await journal.aclose()
        baseline.close()
    return result


RECOVERING = 1000
"""Streams that recover at once in the recovery figure."""
ENTITIES = 64
"""Event-sourced entities of the snapshot-heavy windows."""
SNAPSHOT_EVERY = 2
"""Events between snapshots in the snapshot-heavy windows."""
RECOVERY_TIMEOUT = 60.0
"""``operation_timeout`` of the recovery figure's journals: 1,000 recoveries issued one call
each queue for the connections, and on a loaded machine the last can wait past the default 5 s
(then the call fails); the figure measures the time, so it lets them finish."""


async def recovery(journal: Journal, plan: Plan, show: bool) -> dict[str, Any]:
    """1,000 streams recovering at once: batched reads against one ``recover`` per stream."""
    pids = [f"Bench|recover-{i}" for i in range(RECOVERING)]

    async def fill(pid: str) -> None:
        await journal.append(pid, 1, [EVENT] * 5, token=1)
        await journal.save_snapshot(pid, 3, EVENT * 10, token=1)

    async with trio.open_nursery() as nursery:
        for pid in pids:
            nursery.start_soon(fill, pid)
    batcher = JournalBatcher(journal)

    async def all_at_once(recover: Callable[[str, int], Awaitable[object]], token: int) -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for pid in pids:
                nursery.start_soon(recover, pid, token)
        return time.perf_counter() - start

    batched, alone, ratios, transactions = [], [], [], []
    token = 1
    for r in range(plan.rounds):
        before = batcher.statistics().recovery_batches
        runs = [("batched", batcher.recover), ("alone", journal.recover)]
        times: dict[str, float] = {}
        for name, recover in runs if r % 2 == 0 else runs[::-1]:
            token += 1
            times[name] = await all_at_once(recover, token)
        transactions.append(batcher.statistics().recovery_batches - before)
        batched.append(times["batched"])
        alone.append(times["alone"])
        ratios.append(times["alone"] / times["batched"])
        progress(
            show,
            f"  round {r + 1}: {RECOVERING} recoveries in {times['batched'] * 1e3:.0f} ms batched "
            f"({transactions[-1]} reads), {times['alone'] * 1e3:.0f} ms one at a time",
        )
    return {
        "recoveries": RECOVERING,
        "batched_ms": statistics.median(batched) * 1e3,
        "alone_ms": statistics.median(alone) * 1e3,
        "ratio": statistics.median(ratios),
        "transactions": statistics.median(transactions),
    }


def entity_window(tree: Path, backend: str, where: str, seconds: float, every: int | None) -> float:
    """Commands per second of one snapshot-heavy window of the code in ``tree``."""
    worker = Path(__file__).with_name("_entity_worker.py")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [
            sys.executable,
            "-P",
            str(worker),
            backend,
            where,
            str(ENTITIES),
            str(seconds),
            "none" if every is None else str(every),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=seconds + 120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the entity worker of {tree} failed: {done.stderr.strip()}")
    rate: float = json.loads(done.stdout)["commands_per_s"]
    return rate


def snapshot_heavy(
    backend: str, where: Callable[[int], str], plan: Plan, before: Path | None, show: bool
) -> dict[str, Any]:
    """Snapshot-heavy windows of this tree (and of ``before``, alternately), and one without."""
    here = Path(__file__).resolve().parent.parent
    ours, theirs, ratios, plain = [], [], [], []
    windows = itertools.count()
    for r in range(plan.rounds):
        runs = [("ours", here)] + ([("before", before)] if before is not None else [])
        rates: dict[str, float] = {}
        for name, tree in runs if r % 2 == 0 else runs[::-1]:
            rates[name] = entity_window(
                tree, backend, where(next(windows)), plan.window, SNAPSHOT_EVERY
            )
        ours.append(rates["ours"])
        if before is not None:
            theirs.append(rates["before"])
            ratios.append(rates["ours"] / rates["before"])
        plain.append(entity_window(here, backend, where(next(windows)), plan.window, None))
        progress(
            show,
            f"  round {r + 1}: {rates['ours']:,.0f} commands/s"
            + (f", before {rates['before']:,.0f}" if before is not None else "")
            + f"; without snapshots {plain[-1]:,.0f}",
        )
    return {
        "entities": ENTITIES,
        "snapshot_every": SNAPSHOT_EVERY,
        "commands_per_s": statistics.median(ours),
        "before_commands_per_s": statistics.median(theirs) if theirs else None,
        "ratio": statistics.median(ratios) if ratios else None,
        "no_snapshot_commands_per_s": statistics.median(plain),
    }


async def measure_recovery(label: str, journal: Journal, plan: Plan, show: bool) -> dict[str, Any]:
    progress(show, f"{label}: {RECOVERING} recoveries at once, batched and one at a time")
    try:
        return await recovery(journal, plan, show)
    finally:
        await journal.aclose()


@contextlib.contextmanager
def temporary_directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="p2pshard-bench-") as name:
        yield Path(name)


BACKENDS = ("sqlite", "postgresql")


def run_all(
    plan: Plan,
    show: bool,
    *,
    appends: bool = True,
    entity_side: bool = True,
    backends: tuple[str, ...] = BACKENDS,
    streams: tuple[int, ...] = STREAMS,
    before: Path | None = None,
) -> dict[str, Any]:
    """The figures of the chosen ``backends``: appends (at each of ``streams``), the entity side."""
    started = time.perf_counter()
    report: dict[str, Any] = {
        "plan": attrs.asdict(plan),
        "cpus": os.cpu_count(),
        "load_average_before": os.getloadavg()[0],
        "streams": list(streams),
    }
    entity: dict[str, Any] = {"before": None if before is None else str(before)}
    report["entity"] = entity

    def backend(
        label: str,
        journal: Callable[..., Journal],
        baseline: Callable[[], Baseline],
        entity_target: Callable[[int], str],
        server_pid: int | None = None,
    ) -> None:
        """One backend's figures; ``journal(**tuning)`` makes a journal, ``baseline()`` its own."""
        if appends:
            report[label] = trio.run(
                measure, label, journal(), baseline(), plan, show, streams, server_pid
            )
        if entity_side:
            recovery_journal = journal(operation_timeout=RECOVERY_TIMEOUT)
            entity[f"{label}_recovery"] = trio.run(
                measure_recovery, label, recovery_journal, plan, show
            )
            progress(show, f"{label}: snapshot-heavy commands, {ENTITIES} entities")
            entity[f"{label}_snapshot_heavy"] = snapshot_heavy(
                label, entity_target, plan, before, show
            )

    if "sqlite" in backends:
        with temporary_directory() as tmp:
            files = itertools.count()
            backend(
                "sqlite",
                lambda **tuning: SqliteJournal(tmp / f"journal-{next(files)}.db", **tuning),
                lambda: sqlite_baseline(tmp / "baseline.db"),
                lambda i: str(tmp / f"entity-{i}.db"),
            )
    if "postgresql" in backends:
        try:
            with running_postgres(fsync=True) as server:
                backend(
                    "postgresql",
                    lambda **tuning: PostgresJournal(server.dsn, **tuning),
                    lambda: postgres_baseline(server.dsn),
                    lambda i: server.dsn,
                    server.pid,
                )
        except PostgresNotInstalled as exc:
            report["postgresql"] = None
            report["postgresql_missing"] = str(exc)
    for label, key in (("sqlite", "sqlite"), ("postgresql", "postgres")):
        r = report.get(label)
        at_256 = None if r is None else r["streams"].get("256")
        report[f"{key}_appends_256_ratio"] = None if at_256 is None else at_256["ratio"]
        report[f"{key}_append_p99_ms_256"] = None if at_256 is None else at_256["append_p99_ms"]
        report[f"{key}_append_1_p50_ratio"] = None if r is None else r["ratio_p50"]
        report[f"{key}_cpu_ceiling_256_ratio"] = (
            None if at_256 is None else at_256["cpu_ceiling_ratio"]
        )
        long = None if r is None else r.get("long")
        long_256 = long if long is not None and long["streams"] == 256 else None
        report[f"{key}_appends_256_long_ratio"] = None if long_256 is None else long_256["ratio"]
        report[f"{key}_append_p99_ms_256_long"] = (
            None if long_256 is None else long_256["append_p99_ms"]
        )
    report["elapsed_s"] = time.perf_counter() - started
    return report


def format_table(report: dict[str, Any]) -> str:
    def f(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x:,.2f}" if x < 100 else f"{x:,.0f}"

    def g(x: float | None) -> str:
        return "-" if x is None else f(x)

    def under_load(what: str, w: dict[str, Any]) -> list[tuple[str, str, str, str]]:
        """A closed-loop window's rate and p99 rows, each beside the raw insert's."""
        return [
            (
                f"    appends/s, {what} ({w['batch']:.1f} per commit)",
                f(w["appends_per_s"]),
                f(w["baseline_per_s"]),
                f(w["ratio"]),
            ),
            (
                "        append p99 under that load (ms)",
                f(w["append_p99_ms"]),
                f(w["baseline_p99_ms"]),
                f(w["append_p99_ms"] / w["baseline_p99_ms"]),
            ),
        ]

    rows: list[tuple[str, str, str, str]] = []
    for label in ("sqlite", "postgresql"):
        r = report.get(label)
        if r is None:
            if label in report:
                rows.append((f"{label}: not measured", "", "", ""))
            continue
        rows += [
            (
                f"{label} append, one at a time, p50 (ms)",
                f(r["append_p50_ms"]),
                f(r["baseline_p50_ms"]),
                f(r["ratio_p50"]),
            ),
            (
                "    p99 (ms)",
                f(r["append_p99_ms"]),
                f(r["baseline_p99_ms"]),
                f(r["append_p99_ms"] / r["baseline_p99_ms"]),
            ),
            ("    appends/s, one at a time", f(r["sequential_appends_per_s"]), "", ""),
        ]
        for tasks, w in r["streams"].items():
            rows += [
                *under_load(f"{tasks} streams at once", w),
                (
                    "        CPU per append, this process (µs)",
                    g(w["cpu_us_per_append"]),
                    g(w["baseline_cpu_us_per_insert"]),
                    "",
                ),
            ]
            if w["server_cpu_us_per_append"] is not None:
                rows.append(
                    (
                        "        CPU per append, the server (µs)",
                        g(w["server_cpu_us_per_append"]),
                        g(w["baseline_server_cpu_us_per_insert"]),
                        "",
                    )
                )
            if w["cpu_ceiling_per_s"] is not None:
                rows.append(
                    (
                        f"        most appends/s that CPU allows on {report['cpus']} cores",
                        f(w["cpu_ceiling_per_s"]),
                        f(w["baseline_per_s"]),
                        f(w["cpu_ceiling_ratio"]),
                    )
                )
        long = r.get("long")
        if long is not None:
            rows += under_load(
                f"{long['streams']} streams holding {long['held']} events each", long
            )
    header = ("figure", "ours", "raw insert (same run)", "ratio")
    entity_rows: list[tuple[str, str, str, str]] = []
    entity = report.get("entity", {})
    for label in ("sqlite", "postgresql"):
        rec, heavy = entity.get(f"{label}_recovery"), entity.get(f"{label}_snapshot_heavy")
        if rec is not None:
            entity_rows.append(
                (
                    f"{label} {rec['recoveries']:,} recoveries at once, ms "
                    f"({rec['transactions']:g} batched reads)",
                    f(rec["batched_ms"]),
                    f(rec["alone_ms"]),
                    f(rec["ratio"]),
                )
            )
        if heavy is not None:
            was = heavy["before_commands_per_s"]
            entity_rows += [
                (
                    f"{label} commands/s, {heavy['entities']} entities, snapshot every "
                    f"{heavy['snapshot_every']}",
                    f(heavy["commands_per_s"]),
                    "-" if was is None else f(was),
                    "-" if heavy["ratio"] is None else f(heavy["ratio"]),
                ),
                ("    without snapshots", f(heavy["no_snapshot_commands_per_s"]), "", ""),
            ]
    entity_header = ("entity side", "batched / ours", "one at a time / before", "ratio")
    widths = [
        max(len(row[i]) for row in (header, entity_header, *rows, *entity_rows)) for i in range(4)
    ]

    def line(cells: tuple[str, ...]) -> str:
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{cells[0].ljust(widths[0])}  {rest}".rstrip()

    plan = report["plan"]
    lines = [
        "journal benchmark: one 100-byte event per append; SQLite (WAL, synchronous=FULL) on a "
        "temporary file, a real PostgreSQL (fsync on) on 127.0.0.1",
        f"{plan['rounds']} round(s) of {plan['samples']} paired samples; ratio p50 = median of "
        f"per-round ratios; throughput: one window of {plan['window']:g} s each per round, "
        "medians",
        "",
        *(
            [line(header), line(tuple("-" * w for w in widths)), *(line(row) for row in rows), ""]
            if rows
            else []
        ),
        *(
            [line(entity_header), line(tuple("-" * w for w in widths)), *map(line, entity_rows), ""]
            if entity_rows
            else []
        ),
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs; 1-minute load average "
        f"before the run {report['load_average_before']:.2f}",
    ]
    for key, p99_target, p50_target in (("sqlite", 20.0, 1.2), ("postgres", 30.0, 1.5)):
        checks = (
            (f"{key}_appends_256_ratio", ">=", 10.0),
            (f"{key}_append_p99_ms_256", "<=", p99_target),
            (f"{key}_append_1_p50_ratio", "<=", p50_target),
            (f"{key}_appends_256_long_ratio", ">=", 10.0),
            (f"{key}_append_p99_ms_256_long", "<=", p99_target),
        )
        for name, op, target in checks:
            value = report.get(name)
            if value is None:
                continue
            met = value >= target if op == ">=" else value <= target
            lines.append(
                f"{name} = {value:.2f} (target {op} {target:g}: {'met' if met else 'NOT met'})"
            )
        ceiling = report.get(f"{key}_cpu_ceiling_256_ratio")
        if ceiling is not None:
            lines.append(
                f"{key}_cpu_ceiling_256_ratio = {ceiling:.2f} (the most {key}_appends_256_ratio "
                "could be with this run's CPU per append on this machine's cores)"
            )
    if report.get("postgresql_missing"):
        lines.append(f"PostgreSQL not measured: {report['postgresql_missing']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, quick="smaller counts")
    parser.add_argument(
        "--entity", action="store_true", help="only the entity side: recoveries, snapshots"
    )
    parser.add_argument(
        "--appends", action="store_true", help="only the appends: no recoveries, no snapshots"
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        action="append",
        help="measure only this backend; repeat it for several (default: both)",
    )
    parser.add_argument(
        "--streams",
        type=int,
        nargs="+",
        metavar="N",
        help="concurrent streams of the closed-loop windows (default: "
        f"{' '.join(map(str, STREAMS))})",
    )
    parser.add_argument(
        "--before",
        type=Path,
        metavar="TREE",
        help="a checkout of an earlier release: its snapshot-heavy windows, alternately",
    )
    args = parser.parse_args(argv)
    if args.entity and args.appends:
        parser.error("--entity and --appends leave nothing to measure together; give one")
    streams = STREAMS if args.streams is None else tuple(sorted(set(args.streams)))
    if any(n < 1 for n in streams):
        parser.error(f"--streams takes counts from 1, not {min(streams)}")
    before = None if args.before is None else args.before.resolve()
    report = run_all(
        make_plan(quick=args.quick),
        show=not args.json,
        appends=not args.entity,
        entity_side=not args.appends,
        backends=BACKENDS if args.backend is None else tuple(dict.fromkeys(args.backend)),
        streams=streams,
        before=before,
    )
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
