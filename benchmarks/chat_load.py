"""Chat load test: the posts/s a chat cluster takes with p99 fan-out latency within 100 ms.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.chat_load            # 5,000 users in 500 rooms, 3 nodes
    .venv/bin/python -m benchmarks.chat_load --quick    # smaller counts, under 2 minutes
    .venv/bin/python -m benchmarks.chat_load --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.chat_load --users 2000 --rooms 100 --clients 4

Progress lines go to stderr unless ``--json``.

The load comes from several processes (``benchmarks/_chat_load_worker.py``, ``--clients`` of
them), each holding its share of the users' WebSockets (wsproto for the protocol,
``benchmarks/_websocket.py``) served by one epoll thread, so that the load costs the machine
little. User ``u`` is in room
``u % rooms``; the members of a room are spread over the nodes and over the load processes, so a
post's deliveries cross processes. The rate is open-loop: each load process sends its share of
the posts at fixed times (a post is due at ``start + k / rate``; its poster is drawn from a
seeded generator), whatever the answers, and stamps each with its send time; every member's
process timestamps the ``message`` frame when its bytes arrive (one monotonic clock for every
process of the host; a frame is stamped at most 1 ms late, never early). A step posts at one
rate for a window, then waits (``drain``) until every member has received every post and every
post has its ``ack``; after a failed step, stragglers are waited for longer (``settle``).

The search: the first step posts at ``--start-rate``; each passing step is followed by one at
``--factor`` times the rate (each failing one, before any passed, by one at the rate over
``--factor``), up to ``--max-steps``; then ``--refine`` steps bisect (geometric mean) between the
highest passing and the lowest failing rate. A step passes when the p99 of post -> each member's
receipt is at most 100 ms, every delivery and ack arrived, no error frame came and no connection
closed, and the load processes kept the pace (the posts went out at 95 % of the rate or more).
The figure is the highest passing rate.

Targets, all running side by side in the same run, each with its own connections of the same
users and rooms; their searches are interleaved, one step of each target per round, back to back
(the order turning each round), so that the drift of a shared machine's background load falls on
every target alike; the targets not being measured are idle meanwhile:

- ``cluster``: the chat example as ``scripts/run-chat.sh`` runs it (``ChatCluster``: ``--nodes``
  node processes, TLS between them, the SQLite journal and lease file in a temporary directory);
  user ``u`` connects to a node chosen so that each room's members are spread over the nodes. A
  post is acknowledged after its event is in the journal (group commit on, the default).
- ``cluster_no_group_commit``: the same with ``[journal] group_commit_max_events = 1``: one
  append per transaction and fsync, as before group commit.
- ``baseline``: the single-process trio fan-out server of ``benchmarks/_chat_baseline.py`` (no
  cluster, no journal, no TLS), every user connected to it.

Persisted posts per second per node: the appends each node's journal counted during the highest
passing step (``p2pshard_journal_appends_total`` from its management endpoint's ``/metrics``,
read before and after the step; nothing but posts is persisted meanwhile), per second of its
window, averaged over the nodes (and each node's own); ``append_mean_ms`` from the nodes'
``p2pshard_journal_append_duration_seconds``.

CPU: for each step, the CPU time (``/proc/PID/stat``) of the load processes, of the server
processes and of the whole machine (``/proc/stat``) over the step's window.
``client_cpu_fraction`` is the load processes' CPU time together over the window's wall time
times the number of CPUs: the share of the machine the load took, at the highest passing rate
(the largest over the targets). ``client_cpu_busiest_process`` is one load process's CPU time
over wall time (1.0: it used a whole core, and so may have been the limit). On a machine of
few cores the load processes, the nodes and the baseline share them.

Every wait has a time limit, all load is bounded in count and time, and on every exit path the
load processes, the nodes and the baseline server are stopped and the temporary directory
removed. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import attrs

from benchmarks._chat_baseline import BaselineProcess
from benchmarks._chat_load_worker import RUN_MARGIN
from benchmarks._process import BenchmarkError, CommandProcess
from benchmarks._report import benchmark_parser, cell, progress_line, run_and_print
from examples.chat.cluster import ChatCluster, free_base_port

P99_LIMIT_MS = 100.0
"""A step passes when the p99 of post -> each member's receipt is at most this."""
PACE = 0.95
"""A step passes only if the posts went out at this fraction of its rate or more."""
BUCKETS_PER_MS = 10
"""The load processes' latency histograms have 0.1 ms buckets."""
TARGETS = ("cluster", "cluster_no_group_commit", "baseline")
NO_GROUP_COMMIT = {"group_commit_max_events": 1}
"""The ``[journal]`` keys of ``cluster_no_group_commit``: one append per transaction."""
MAX_CONNECTIONS = 24_000
"""Users times targets at most: each connection takes a local port (about 28,000 by default)."""
DESCRIPTORS_MARGIN = 256
"""File descriptors a process needs besides one per connection."""


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    users: int
    rooms: int
    nodes: int
    clients: int
    """Load processes."""
    start_rate: float
    """Posts/s of the first step."""
    factor: float
    """The rate of the next step over the last, while steps pass."""
    max_steps: int
    """Steps with a growing rate at most (then ``refine`` more)."""
    refine: int
    """Steps bisecting between the highest passing and the lowest failing rate."""
    window: float
    """Seconds each step posts."""
    drain: float
    """Seconds a step's deliveries and acks may take after its window (else it fails)."""
    settle: float
    """Seconds after its window a failed step's stragglers are waited for, so that the next step
    starts on a target that has caught up (if they do not come, the search ends)."""
    joins_at_once: int
    """Joins in flight per load process while connecting."""
    connect_limit: float
    """Seconds the users of one target may take to connect and join."""
    targets: tuple[str, ...] = TARGETS
    seed: int = 1

    def __attrs_post_init__(self) -> None:
        problems = []
        if self.rooms < 1 or self.users < self.rooms:
            problems.append(f"--users {self.users} --rooms {self.rooms}: need 1 <= rooms <= users")
        if self.users * len(self.targets) > MAX_CONNECTIONS:
            problems.append(
                f"--users {self.users}: at most {MAX_CONNECTIONS // len(self.targets):,} with "
                f"{len(self.targets)} targets (a local port per user and target)"
            )
        if self.nodes < 1 or self.nodes > 32:
            problems.append(f"--nodes {self.nodes}: from 1 to 32")
        if self.clients < 1 or self.clients > self.users:
            problems.append(f"--clients {self.clients}: from 1 to the number of users")
        if self.start_rate <= 0 or self.factor <= 1:
            problems.append(f"--start-rate {self.start_rate} --factor {self.factor}: > 0 and > 1")
        if self.max_steps < 1 or self.refine < 0:
            problems.append(f"--max-steps {self.max_steps} --refine {self.refine}: >= 1, >= 0")
        if self.window <= 0 or not 0 < self.drain <= self.settle:
            problems.append(
                f"--window {self.window} --drain {self.drain}: > 0, and drain <= {self.settle:g}"
            )
        unknown = set(self.targets) - set(TARGETS)
        if unknown or not self.targets:
            problems.append(f"targets {self.targets}: some of {', '.join(TARGETS)}")
        if problems:
            raise ValueError("invalid plan: " + "; ".join(problems))

    @property
    def time_limit(self) -> float:
        """Seconds the whole run may take at most (the load processes' lifetime)."""
        step = self.window + self.settle + 40
        per_target = 120 + self.connect_limit + (self.max_steps + self.refine) * step
        return 60 + len(self.targets) * per_target


def make_plan(*, quick: bool, **overrides: Any) -> Plan:
    """The full plan (5,000 users in 500 rooms over 3 nodes) or the quick one (under 2 min)."""
    if quick:
        plan = Plan(
            users=600, rooms=60, nodes=3, clients=2, start_rate=50, factor=2.0, max_steps=6,
            refine=0, window=1.5, drain=4.0, settle=15.0, joins_at_once=16, connect_limit=60,
        )  # fmt: skip
    else:
        plan = Plan(
            users=5000, rooms=500, nodes=3, clients=4, start_rate=50, factor=1.5, max_steps=12,
            refine=2, window=5.0, drain=10.0, settle=60.0, joins_at_once=8, connect_limit=300,
        )  # fmt: skip
    return attrs.evolve(plan, **{k: v for k, v in overrides.items() if v is not None})


# ==== users, rooms, processes =====================================================================


@attrs.frozen
class User:
    """One simulated user: its name, room, node (0-based) and load process."""

    name: str
    room: str
    node: int
    client: int


def users_of(plan: Plan) -> list[User]:
    """User ``u`` is in room ``u % rooms``; a room's members are spread over nodes and clients."""
    users = []
    for u in range(plan.users):
        r, k = u % plan.rooms, u // plan.rooms
        users.append(User(f"u{u}", f"r{r}", (k + r) % plan.nodes, (k + r) % plan.clients))
    return users


def raise_descriptor_limit(plan: Plan) -> None:
    """Raise this process's soft limit (the nodes and the baseline inherit it), or fail early."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    per_client = plan.users * len(plan.targets) // plan.clients
    needed = max(plan.users, per_client) + DESCRIPTORS_MARGIN  # the baseline holds every user
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise BenchmarkError(
            f"{plan.users} users need about {needed} file descriptors in one process, but the "
            f"hard limit is {hard}: raise it (ulimit -Hn), or pass fewer --users or more "
            "--clients"
        )
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class LoadProcess(CommandProcess):
    """One load process (``benchmarks/_chat_load_worker.py``) and its command pipe."""

    def __init__(self, index: int, log: Path, lifetime: float) -> None:
        args = [sys.executable, "-m", "benchmarks._chat_load_worker", "--index", str(index)]
        super().__init__(f"load process {index}", [*args, "--lifetime", str(lifetime)], log)

    def request(self, command: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one command and wait for its answer."""
        self.send(command)
        return self.receive(timeout, command["cmd"])

    def stop(self) -> None:
        """Ask the process to stop, kill it if it does not, and reap it."""
        if self.process.poll() is None:
            with contextlib.suppress(BenchmarkError, OSError):
                self.send({"cmd": "stop"})
            with contextlib.suppress(Exception):
                self.process.wait(5)
        self.reap()


def ask_all(
    clients: list[LoadProcess], commands: list[dict[str, Any]], timeout: float
) -> list[dict[str, Any]]:
    """Send each process its command, then collect the answers (they work at the same time)."""
    for client, command in zip(clients, commands, strict=True):
        client.send(command)
    return [
        c.receive(timeout, command["cmd"]) for c, command in zip(clients, commands, strict=True)
    ]


@contextlib.contextmanager
def load_processes(root: Path, plan: Plan) -> Iterator[list[LoadProcess]]:
    """Start the load processes; all are stopped when the block ends."""
    started: list[LoadProcess] = []
    try:
        for i in range(plan.clients):
            started.append(LoadProcess(i, root / f"load-{i}.log", plan.time_limit))
        for process in started:
            process.wait_event("ready", 30)
        yield started
    finally:
        for process in started:
            process.stop()


# ==== CPU =========================================================================================

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_ticks() -> tuple[int, int]:
    """Busy and total CPU ticks of the machine so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@attrs.frozen
class CpuSample:
    """CPU counters at one moment: per load process, per server process, the machine."""

    at: float
    clients: tuple[float, ...]
    servers: tuple[float, ...]
    machine: tuple[int, int]

    @classmethod
    def take(cls, clients: list[int], servers: list[int]) -> CpuSample:
        return cls(
            time.monotonic(),
            tuple(cpu_seconds(p) for p in clients),
            tuple(cpu_seconds(p) for p in servers),
            machine_ticks(),
        )

    def since(self, before: CpuSample) -> dict[str, float]:
        """Fractions over the time between ``before`` and this sample."""
        wall = self.at - before.at
        cpus = os.cpu_count() or 1
        clients = [a - b for a, b in zip(self.clients, before.clients, strict=True)]
        servers = sum(self.servers) - sum(before.servers)
        busy, total = (a - b for a, b in zip(self.machine, before.machine, strict=True))
        return {
            "client_cpu_fraction": sum(clients) / wall / cpus,
            "client_cpu_busiest_process": max(clients) / wall,
            "server_cpu_fraction": servers / wall / cpus,
            "machine_busy_fraction": busy / total if total else math.nan,
        }


# ==== one step ====================================================================================


def quantile_ms(histogram: Counter[int], q: float) -> float:
    """The ``q`` quantile of a histogram of 0.1 ms buckets, in ms (NaN when empty)."""
    total = sum(histogram.values())
    if total == 0:
        return math.nan
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= rank:
            return (bucket + 0.5) / BUCKETS_PER_MS
    raise AssertionError("unreachable")


def sleep_until(moment: float) -> None:
    """Sleep until ``time.monotonic()`` reaches ``moment``."""
    time.sleep(max(0.0, moment - time.monotonic()))


@attrs.define(eq=False)
class Target:
    """What a step needs of the target being measured."""

    name: str
    clients: list[LoadProcess]
    server_pids: list[int]
    members: dict[str, int]
    """Users per room."""
    journal: Callable[[], dict[str, JournalCounters]] | None = None
    """The journal counters of each node (cluster targets)."""
    connect_s: float = math.nan
    join_retries: int = 0
    steps: int = 0


def run_step(target: Target, plan: Plan, rate: float, progress: bool) -> dict[str, Any]:
    """Post at ``rate`` for a window, wait for every delivery and ack; the step's figures."""
    clients = target.clients
    target.steps += 1
    tag = f"{target.name.replace('_', '')}{target.steps}"
    n = len(clients)
    journal_before = target.journal() if target.journal else None
    start_at = time.monotonic() + 0.5
    seed = plan.seed * 100_000 + target.steps * n
    commands = [
        {"cmd": "run", "group": target.name, "tag": tag, "rate": rate / n,
         "start_at": start_at, "duration": plan.window, "offset": i / n, "seed": seed + i}
        for i in range(n)
    ]  # fmt: skip
    for client, command in zip(clients, commands, strict=True):
        client.send(command)
    client_pids = [c.process.pid for c in clients]
    sleep_until(start_at)
    before = CpuSample.take(client_pids, target.server_pids)
    sleep_until(start_at + plan.window)
    cpu = CpuSample.take(client_pids, target.server_pids).since(before)
    runs = [c.receive(RUN_MARGIN + 30, "run") for c in clients]
    posts_by_room: Counter[str] = Counter()
    for run in runs:
        posts_by_room.update(run["posts_by_room"])
    posts = sum(posts_by_room.values())
    expected = sum(count * target.members[room] for room, count in posts_by_room.items())
    first = min(r["first_sent"] for r in runs if r["posts"])
    last = max(r["last_sent"] for r in runs if r["posts"])
    sent_per_s = posts / (last - first + 1 / rate) if posts else 0.0

    window_end = start_at + plan.window
    missing: tuple[int, int] | None = None  # deliveries, answers (acks or errors)
    while True:
        counts = ask_all(clients, [{"cmd": "tally", "tag": tag, "final": False}] * n, 10)
        receipts = sum(c["receipts"] for c in counts)
        answered = sum(c["acks"] + c["errors"] for c in counts)
        complete = receipts >= expected and answered >= posts
        now = time.monotonic()
        if missing is None and (complete or now > window_end + plan.drain):
            missing = (expected - receipts, posts - answered)
        # What is still missing after the drain is waited for longer (the target is not ready
        # for the next step until it has caught up), but the step has failed.
        if complete or now > window_end + plan.settle:
            break
        time.sleep(0.1)
    drained_s = time.monotonic() - window_end
    assert missing is not None  # set at the latest when the settle time ran out
    finals = ask_all(clients, [{"cmd": "tally", "tag": tag, "final": True}] * n, 10)
    receipt_hist: Counter[int] = Counter()
    ack_hist: Counter[int] = Counter()
    error_texts: list[str] = []
    for final in finals:
        receipt_hist.update(dict(map(tuple, final["receipt_hist"])))
        ack_hist.update(dict(map(tuple, final["ack_hist"])))
        error_texts += final["error_texts"]
    receipts = sum(f["receipts"] for f in finals)
    acks = sum(f["acks"] for f in finals)
    errors = sum(f["errors"] for f in finals) + sum(r["send_errors"] for r in runs)
    closed = sum(f["closed"] for f in finals)
    step: dict[str, Any] = {
        "rate": rate,
        "posts": posts,
        "sent_per_s": sent_per_s,
        "late_max_ms": max(r["late_max_ms"] for r in runs),
        "deliveries_expected": expected,
        "deliveries": receipts,
        "missing_deliveries": missing[0],
        "missing_answers": missing[1],
        "missing_after_settle": expected - receipts + max(0, posts - acks - errors),
        "acks": acks,
        "errors": errors,
        "error_texts": error_texts[:5],
        "closed_connections": closed,
        "receipt_p50_ms": quantile_ms(receipt_hist, 0.5),
        "receipt_p99_ms": quantile_ms(receipt_hist, 0.99),
        "receipt_max_ms": quantile_ms(receipt_hist, 1.0),
        "ack_p50_ms": quantile_ms(ack_hist, 0.5),
        "ack_p99_ms": quantile_ms(ack_hist, 0.99),
        "drained_after_s": drained_s,
        "acked_posts_per_s": acks / plan.window,
        **cpu,
    }
    if target.journal is not None and journal_before is not None:
        step.update(journal_figures(journal_before, target.journal(), plan.window))
    reasons = []
    if missing != (0, 0):
        reasons.append(
            f"{missing[0]} deliveries and {missing[1]} acks missing {plan.drain:g} s after the "
            "window"
        )
    if errors:
        reasons.append(f"{errors} errors ({'; '.join(error_texts[:2])})")
    if closed:
        reasons.append(f"{closed} connections closed by the server")
    if not step["receipt_p99_ms"] <= P99_LIMIT_MS:
        reasons.append(f"p99 {step['receipt_p99_ms']:.1f} ms")
    if sent_per_s < PACE * rate:
        reasons.append(f"the load processes sent {sent_per_s:.0f}/s only")
    step["passed"] = not reasons
    step["reason"] = "; ".join(reasons)
    step["clean"] = step["missing_after_settle"] == 0 and closed == 0
    progress_line(
        progress,
        f"  {target.name} step {target.steps}: {rate:,.0f} posts/s, p99 "
        f"{cell(step['receipt_p99_ms'], '.1f')} ms, clients {step['client_cpu_fraction']:.0%} "
        f"of the machine, machine busy {step['machine_busy_fraction']:.0%}: "
        + ("pass" if step["passed"] else f"fail ({step['reason']})"),
    )
    return step


Search = Generator[float, dict[str, Any], tuple[list[dict[str, Any]], dict[str, Any] | None, bool]]
"""Yields the rate of each step, is sent the step's figures; returns the steps, the passing one
of the highest rate and whether some step failed."""


def search(plan: Plan) -> Search:
    """The rates to try, one step at a time (sans-IO: the caller runs each step).

    From ``start_rate``, up by ``factor`` after each pass until a step fails (down by
    ``factor`` after each failure until one passes, if the first fails), at most ``max_steps``
    steps; then ``refine`` steps bisect between the highest pass and the lowest failure. A step
    that leaves deliveries undelivered or connections closed ends the search. No failure means
    the rate was never high enough (raise ``--max-steps`` or ``--start-rate``).
    """
    steps: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    failed: float | None = None
    rate = plan.start_rate
    for _ in range(plan.max_steps):
        step = yield rate
        steps.append(step)
        if step["passed"]:
            best = step
        else:
            failed = rate if failed is None else min(failed, rate)
        if (best is not None and failed is not None) or not step["clean"]:
            break
        rate = rate * plan.factor if step["passed"] else rate / plan.factor
    if best is not None and failed is not None and steps[-1]["clean"]:
        low, high = best["rate"], failed
        for _ in range(plan.refine):
            step = yield math.sqrt(low * high)
            steps.append(step)
            if step["passed"]:
                best, low = step, step["rate"]
            else:
                high = step["rate"]
            if not step["clean"]:
                break
    return steps, best, failed is not None


def interleave(
    targets: list[Target], plan: Plan, run: Callable[[Target, float], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Run every target's search, one step of each per round, back to back.

    The order within a round turns by one each round, so that no target always comes first:
    the machine's background load, which drifts, is spread over the targets alike.
    """
    searches = {t.name: search(plan) for t in targets}
    rates = {t.name: next(searches[t.name]) for t in targets}
    found: dict[str, tuple[list[dict[str, Any]], dict[str, Any] | None, bool]] = {}
    turn = 0
    while rates:
        for target in targets[turn % len(targets) :] + targets[: turn % len(targets)]:
            if target.name not in rates:
                continue
            step = run(target, rates[target.name])
            try:
                rates[target.name] = searches[target.name].send(step)
            except StopIteration as done:
                found[target.name] = done.value
                del rates[target.name]
        turn += 1
    results = {}
    for target in targets:
        steps, best, saturated = found[target.name]
        results[target.name] = {
            "connect_s": target.connect_s,
            "join_retries": target.join_retries,
            "steps": steps,
            "saturated": saturated,
            "posts_per_s_at_p99_100ms": math.nan if best is None else best["rate"],
            "best_step": best,
        }
    return results


# ==== targets =====================================================================================


@contextlib.contextmanager
def running_cluster(
    data: Path, plan: Plan, journal_options: dict[str, int]
) -> Iterator[ChatCluster]:
    """A ready chat cluster; killed at the end (its data is thrown away), with its logs' last
    lines printed if something failed."""
    cluster = ChatCluster(
        plan.nodes, data, free_base_port(plan.nodes), log_level="WARNING", log_to_files=True,
        journal_options=journal_options,
    )  # fmt: skip
    try:
        cluster.start()
        cluster.wait_ready(timeout=120)
        yield cluster
    except BaseException:
        for log in sorted(data.glob("*.log")):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            print(f"--- {log.name} (last lines)\n{tail}", file=sys.stderr)
        raise
    finally:
        for i in cluster.procs:
            cluster.kill(i)
        cluster.stop()  # closes the log files


@attrs.frozen
class JournalCounters:
    """A node's journal counters, from its ``GET /metrics``."""

    appends: float
    """``p2pshard_journal_appends_total``: one per persist of an event-sourced entity."""
    append_seconds: float
    """``p2pshard_journal_append_duration_seconds_sum``."""


def journal_counters(cluster: ChatCluster) -> dict[str, JournalCounters]:
    """Each node's journal counters, read from its management endpoint's ``/metrics``."""
    counters = {}
    for i in cluster.procs:
        url = cluster.management_url(i) + "metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                text = answer.read().decode()
        except OSError as exc:
            raise BenchmarkError(f"{cluster.name(i)}: {url} did not answer: {exc}") from exc
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("p2pshard_journal_appends_total",
                        "p2pshard_journal_append_duration_seconds_sum"):  # fmt: skip
                values[name] = float(value)
        counters[cluster.name(i)] = JournalCounters(
            values["p2pshard_journal_appends_total"],
            values["p2pshard_journal_append_duration_seconds_sum"],
        )
    return counters


def journal_figures(
    before: dict[str, JournalCounters], after: dict[str, JournalCounters], window: float
) -> dict[str, Any]:
    """Appends per node over a step (its posts: nothing else is persisted meanwhile), per second
    of the window, and the mean append's duration."""
    appends = {node: after[node].appends - before[node].appends for node in sorted(after)}
    seconds = sum(after[node].append_seconds - before[node].append_seconds for node in after)
    total = sum(appends.values())
    return {
        "journal_appends_by_node": appends,
        "persisted_posts_per_s_by_node": {node: n / window for node, n in appends.items()},
        "append_mean_ms": seconds / total * 1e3 if total else math.nan,
    }


def connect(
    name: str,
    url_of: Callable[[User], str],
    server_pids: list[int],
    clients: list[LoadProcess],
    plan: Plan,
    progress: bool,
    journal: Callable[[], dict[str, JournalCounters]] | None = None,
) -> Target:
    """Connect every user to the target and join its room."""
    users = users_of(plan)
    commands = [
        {"cmd": "connect", "group": name,
         "users": [[u.name, u.room, url_of(u)] for u in users if u.client == i],
         "at_once": plan.joins_at_once, "within": plan.connect_limit}
        for i in range(len(clients))
    ]  # fmt: skip
    began = time.monotonic()
    answers = ask_all(clients, commands, plan.connect_limit + 30)
    target = Target(name, clients, server_pids, dict(Counter(u.room for u in users)), journal)
    target.connect_s = time.monotonic() - began
    target.join_retries = sum(a["join_retries"] for a in answers)
    connected = sum(a["connected"] for a in answers)
    progress_line(
        progress,
        f"  {name}: {connected} users joined {plan.rooms} rooms in {target.connect_s:.1f} s "
        f"({target.join_retries} joins sent again)",
    )
    if connected != plan.users:
        raise BenchmarkError(f"{name}: {connected} of {plan.users} users connected")
    return target


@contextlib.contextmanager
def running_baseline(root: Path) -> Iterator[BaselineProcess]:
    """The baseline server, stopped at the end."""
    baseline = BaselineProcess(root / "baseline.log")
    try:
        yield baseline
    finally:
        baseline.stop()


def start_target(
    name: str,
    root: Path,
    stack: contextlib.ExitStack,
    clients: list[LoadProcess],
    plan: Plan,
    progress: bool,
) -> Target:
    """Start the server(s) of target ``name`` (stopped when ``stack`` closes), connect the users."""
    progress_line(progress, f"{name}: starting")
    if name == "baseline":
        baseline = stack.enter_context(running_baseline(root))
        url = baseline.url
        return connect(name, lambda u: url, [baseline.process.pid], clients, plan, progress)
    options = NO_GROUP_COMMIT if name == "cluster_no_group_commit" else {}
    cluster = stack.enter_context(running_cluster(root / name, plan, options))
    return connect(
        name,
        lambda u: cluster.ws_url(u.node + 1),
        [p.pid for p in cluster.procs.values()],
        clients,
        plan,
        progress,
        journal=lambda: journal_counters(cluster),
    )


def run_all(plan: Plan, progress: bool) -> dict[str, Any]:
    """Start the load processes and every target, run the searches, stop everything; the report.

    The targets run side by side (idle but for the one being measured), so that their searches
    can be interleaved step by step.
    """
    started = time.monotonic()
    load_before = os.getloadavg()
    raise_descriptor_limit(plan)
    with (
        tempfile.TemporaryDirectory(prefix="p2pshard-bench-chat-load-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        root = Path(tmp)
        progress_line(progress, f"starting {plan.clients} load processes")
        clients = stack.enter_context(load_processes(root, plan))
        targets = [start_target(n, root, stack, clients, plan, progress) for n in plan.targets]
        results = interleave(
            targets, plan, lambda target, rate: run_step(target, plan, rate, progress)
        )
    return report_of(plan, results, started, load_before)


def report_of(
    plan: Plan,
    results: dict[str, dict[str, Any]],
    started: float,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    """The JSON report: the headline keys first, then every target's steps."""

    def best(target: str, key: str) -> float:
        step = results.get(target, {}).get("best_step")
        return math.nan if step is None or key not in step else float(step[key])

    def rate(target: str) -> float:
        return float(results.get(target, {}).get("posts_per_s_at_p99_100ms", math.nan))

    def per_node(target: str) -> float:
        step = results.get(target, {}).get("best_step")
        if step is None:
            return math.nan
        return float(sum(step["persisted_posts_per_s_by_node"].values())) / plan.nodes

    fractions = [best(t, "client_cpu_fraction") for t in results]
    busiest = [best(t, "client_cpu_busiest_process") for t in results]
    report: dict[str, Any] = {
        "posts_per_s_at_p99_100ms": rate("cluster"),
        "baseline_posts_per_s_at_p99_100ms": rate("baseline"),
        "no_group_commit_posts_per_s_at_p99_100ms": rate("cluster_no_group_commit"),
        "posts_per_s_ratio": rate("cluster") / rate("baseline"),
        "persisted_posts_per_s_per_node": per_node("cluster"),
        "persisted_posts_per_s_per_node_no_group_commit": per_node("cluster_no_group_commit"),
        "append_mean_ms": best("cluster", "append_mean_ms"),
        "append_mean_ms_no_group_commit": best("cluster_no_group_commit", "append_mean_ms"),
        "client_cpu_fraction": max((f for f in fractions if not math.isnan(f)), default=math.nan),
        "client_cpu_busiest_process": max(
            (f for f in busiest if not math.isnan(f)), default=math.nan
        ),
        "p99_limit_ms": P99_LIMIT_MS,
        "targets": results,
        "counts": attrs.asdict(plan),
        "cpus": os.cpu_count(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "elapsed_s": time.monotonic() - started,
    }
    return report


# ==== the table ===================================================================================

_NAMES = {
    "cluster": "chat cluster (group commit)",
    "cluster_no_group_commit": "chat cluster, one append per commit",
    "baseline": "baseline: one process, no journal",
}


def format_table(report: dict[str, Any]) -> str:
    """The report as tables for people."""
    counts = report["counts"]
    per_room = counts["users"] / counts["rooms"]
    lines = [
        f"chat load: {counts['users']:,} WebSocket users in {counts['rooms']:,} rooms "
        f"({per_room:g} each) from {counts['clients']} load processes; cluster: "
        f"{counts['nodes']} chat node processes (TLS, SQLite journal); baseline: one trio "
        "process, no journal",
        f"open-loop steps of {counts['window']:g} s from {counts['start_rate']:g} posts/s, x"
        f"{counts['factor']:g} while p99 (post -> each member's receipt) <= "
        f"{report['p99_limit_ms']:g} ms, then {counts['refine']} bisecting steps",
        "",
    ]
    header = ("target", "posts/s at p99<=100ms", "persisted/s per node", "clients' CPU")
    rows: list[tuple[str, ...]] = []
    for name, result in report["targets"].items():
        best = result["best_step"]
        persisted = "-"
        if best is not None and "persisted_posts_per_s_by_node" in best:
            split = best["persisted_posts_per_s_by_node"]
            persisted = (
                f"{sum(split.values()) / counts['nodes']:,.0f} ("
                + " / ".join(f"{v:,.0f}" for v in split.values())
                + ")"
            )
        rate = cell(result["posts_per_s_at_p99_100ms"], ",.0f")
        if not result["saturated"]:
            rate += " (not reached)"
        cpu = "-" if best is None else f"{best['client_cpu_fraction']:.0%}"
        rows.append((_NAMES.get(name, name), rate, persisted, cpu))
    lines += _table(header, rows)
    lines.append("")
    lines.append(
        f"posts_per_s_ratio (cluster / baseline) = {cell(report['posts_per_s_ratio'])}; "
        f"client_cpu_fraction = {cell(report['client_cpu_fraction'], '.3f')} (load processes' "
        f"CPU / wall / {report['cpus']} CPUs at the highest passing rate); busiest load process "
        f"{cell(report['client_cpu_busiest_process'], '.2f')} of a core"
    )
    step_header = ("step posts/s", "sent/s", "p50 ms", "p99 ms", "max ms", "ack p99", "missing",
                   "clients", "servers", "machine", "result")  # fmt: skip
    for name, result in report["targets"].items():
        lines += ["", f"{_NAMES.get(name, name)}: {counts['users']:,} users joined in "
                      f"{result['connect_s']:.1f} s ({result['join_retries']} joins sent again "
                      "after a \"try again\")"]  # fmt: skip
        steps: list[tuple[str, ...]] = [
            (
                f"{s['rate']:,.0f}",
                f"{s['sent_per_s']:,.0f}",
                cell(s["receipt_p50_ms"], ".1f"),
                cell(s["receipt_p99_ms"], ".1f"),
                cell(s["receipt_max_ms"], ".0f"),
                cell(s["ack_p99_ms"], ".1f"),
                str(s["missing_deliveries"]),
                f"{s['client_cpu_fraction']:.0%}",
                f"{s['server_cpu_fraction']:.0%}",
                f"{s['machine_busy_fraction']:.0%}",
                "pass" if s["passed"] else s["reason"],
            )
            for s in result["steps"]
        ]
        lines += _table(step_header, steps)
    before, after = report["load_average_before"], report["load_average_after"]
    lines += [
        "",
        "CPU columns: share of the machine's CPU time over the step's window (clients: the load "
        "processes; servers: the nodes or the baseline; machine: every process)",
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs, shared by the load "
        f"processes and the servers; 1-minute load average {before[0]:.2f} before the run, "
        f"{after[0]:.2f} after",
    ]
    if before[0] >= 0.5:
        lines.append(
            "warning: other processes were using the CPUs when the run started; the absolute "
            "figures are pessimistic"
        )
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:-1], widths[1:-1], strict=True))
        return f"{first}  {rest}  {cells[-1]}".rstrip()

    return [line(header), line(tuple("-" * w for w in widths)), *(line(row) for row in rows)]


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="600 users in 60 rooms, short steps; under 2 minutes")
    parser.add_argument("--users", type=int, help="simulated users (full: 5000)")
    parser.add_argument("--rooms", type=int, help="rooms, users spread evenly (full: 500)")
    parser.add_argument("--nodes", type=int, help="chat node processes (3)")
    parser.add_argument("--clients", type=int, help="load processes (full: 4)")
    parser.add_argument("--start-rate", type=float, help="posts/s of the first step (50)")
    parser.add_argument("--factor", type=float, help="rate of a step over the last (full: 1.5)")
    parser.add_argument("--max-steps", type=int, help="rising steps at most (full: 12)")
    parser.add_argument("--refine", type=int, help="bisecting steps after a failure (full: 2)")
    parser.add_argument("--window", type=float, help="seconds each step posts (full: 5)")
    parser.add_argument("--drain", type=float, help="seconds a step's deliveries may lag (10)")
    parser.add_argument("--seed", type=int, help="the posters' draw (1)")
    parser.add_argument(
        "--targets",
        type=lambda text: tuple(text.split(",")),
        help=f"comma-separated, some of {','.join(TARGETS)} (all)",
    )
    args = parser.parse_args(argv)
    overrides = {
        key: getattr(args, key)
        for key in ("users", "rooms", "nodes", "clients", "start_rate", "factor", "max_steps",
                    "refine", "window", "drain", "seed", "targets")
    }  # fmt: skip
    try:
        plan = make_plan(quick=args.quick, **overrides)
    except ValueError as exc:
        parser.error(str(exc))
    return run_and_print(
        lambda: run_all(plan, progress=not args.json),
        format_table,
        as_json=args.json,
        stopped="processes stopped, temporary files removed",
    )


if __name__ == "__main__":
    sys.exit(main())
