"""Membership benchmark: whole clusters of ``membership._cluster.Cluster`` on the simulated network.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.membership            # full run (N up to 200), ~25 min
    .venv/bin/python -m benchmarks.membership --quick    # N = 5 and 25 only, under 60 s
    .venv/bin/python -m benchmarks.membership --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.membership --max-n 100  # full run without the N = 200 cluster
    .venv/bin/python -m benchmarks.membership --json-file out.json  # the table, and the JSON too

Progress lines go to stderr unless ``--json``.

Everything runs on ``trio.testing.MockClock(autojump_threshold=0)`` over ``membership.SimNetwork``
(links delay every frame uniformly by 1-5 ms, nothing is lost unless a scenario cuts a link), with
the default ``ClusterSettings``, ``FailureDetectorSettings`` and ``SplitBrainResolverSettings``
and seed nodes 1, 2 and 3. "Seconds" are simulated seconds; each scenario also reports the
wall-clock seconds it took to simulate. Every cluster run is one ``trio.run`` inside
``membership.deterministic_scheduling(seed)`` with a network and per-node generators derived from
that seed: the seeds are fixed and printed, and a seed replays the same run. Every wait is bounded
by ``trio.fail_after`` on the mock clock and every run by a wall-clock limit, so the script always
terminates; a run that hits a limit is reported (null values with the reason), not fatal.

What it measures:

1. **Join convergence** (N = 5, 25, 100, 200). Start N nodes at once, wait until node 1 sees all
   N Up with converged gossip (and then every node does), then start ONE more node. The clock
   runs from the moment a member accepts its Join (the first ``MemberJoined`` for it on any
   existing member; its start, the seed-node handshake, is a few milliseconds earlier and is also
   reported) until every node, the new one included, holds gossip that has converged with the new
   node Up. Reported in simulated seconds and in gossip rounds (seconds / ``gossip_interval``).
   The runs with crashes (below) add one more sample per crash: after the crashed node is
   removed (and the leader had a tick with converged gossip, which resets its WeaklyUp timer), a
   replacement joins the remaining N - 1 nodes and is measured the same way. The phases are
   reported too: the Joining version known everywhere, the leader moving the node Up, the Up
   version known everywhere, and the last node's gossip converging.
2. **Failure detection** (N = 25 and 100). In a converged cluster, after 10 s of steady
   heartbeats and a random fraction of a second, crash one node (``SimNetwork.crash`` and cancel
   its tasks): the time until the first other node marks it unreachable (``UnreachableMember``
   there: its own failure detector) and until every other node sees it unreachable. Then node 1
   downs it, every node converges without it, a replacement joins, and the next crash follows;
   several crashes per cluster and several seeds give p50 and p99 (nearest rank: with few
   samples p99 is the maximum). Node 1 (the leader) is never crashed.
3. **False unreachability under pauses** (N = 5). Isolate one node (both directions) for 2.0 s and
   for 2.5 s, shorter than ``acceptable_heartbeat_pause`` (3 s), heal, let the cluster settle,
   and repeat with the next node; count ``UnreachableMember`` events on every node, the isolated
   one included. Each pause length gets fresh clusters (one per pause seed, after 20 s of regular
   heartbeats), because every tolerated pause widens the detectors' interval history and makes
   the next pause easier to tolerate: the first pause of each cluster is the strict case. A 3.5 s
   control pause, above the acceptable pause and outside the target, shows that the scenario
   does see alarms when there are some.
4. **Steady-state traffic** (N = 25 and 100). Over 30 s of a converged, quiet cluster (after 10 s
   of settling): bytes and frames sent by all transports (``transport.statistics()``, summed over
   peers), per node per second, and the received messages split by type (heartbeats vs. gossip),
   each re-encoded to count its bytes.

Targets (from the issue):

- join convergence at N = 100 within 2 * ceil(log2 N) + 2 = 16 gossip rounds (checked against the
  slowest sample; the same formula is shown for every N);
- failure detection p99 <= 8 s with the default ``FailureDetectorSettings`` (first detection);
- zero ``UnreachableMember`` events for pauses shorter than ``acceptable_heartbeat_pause``.

Simulation cost: every node runs in this one process, so wall-clock time grows faster than N.
On the 2-core development machine: forming 100 nodes takes 30-40 s of wall-clock time and one
join into them about 45 s; forming 200 nodes about 100 s and one join into them about 135 s; the
full run about 25 minutes, ``--quick`` about 40 s.
"""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from benchmarks._report import benchmark_parser
from membership import (
    Address,
    LinkConditions,
    SimNetwork,
    SimTransport,
    UniqueAddress,
    deterministic_scheduling,
)
from membership._cluster import Cluster
from membership._cluster_messages import GossipEnvelope, GossipStatus
from membership._cluster_settings import ClusterSettings
from membership._events import (
    ClusterEvent,
    MemberEvent,
    ReachableMember,
    UnreachableMember,
)
from membership._failure_detector import FailureDetectorSettings
from membership._heartbeat import Heartbeat, HeartbeatRsp
from membership._member import MemberStatus
from membership.sbr._settings import SplitBrainResolverSettings
from membership.transport import _wire as wire

HOST = "10.0.0.1"
BASE_PORT = 2550
SEED_NODES = (1, 2, 3)
LINK = LinkConditions(delay_min=0.001, delay_max=0.005)

CLUSTER_SETTINGS = ClusterSettings()
FD_SETTINGS = FailureDetectorSettings()
SBR_SETTINGS = SplitBrainResolverSettings()
GOSSIP_INTERVAL = CLUSTER_SETTINGS.gossip_interval

DETECT_P99_TARGET_S = 8.0
FALSE_UNREACHABLE_TARGET = 0
TARGET_N = 100

FORM_LIMIT = 120.0
"""Simulated seconds allowed for forming a cluster."""
JOIN_LIMIT = 120.0
"""Simulated seconds allowed for one join to converge."""
DETECT_LIMIT = 60.0
"""Simulated seconds allowed for every node to see a crashed node unreachable."""
SETTLE_LIMIT = 120.0
"""Simulated seconds allowed for a cluster to converge after a removal or a pause."""
SETTLE = 10.0
"""Simulated seconds of quiet before a measurement (heartbeat histories fill up)."""
STEADY_WINDOW = 30.0
PAUSE_RECOVERY = 15.0
"""Simulated seconds after a heal before the next pause."""
JOIN_POLL = 0.05
"""Simulated seconds between convergence checks while a join is measured (its resolution)."""
DETECT_POLL = 0.05
FORM_POLL = 0.1


def join_target_rounds(n: int) -> int:
    """The issue's convergence target for N nodes: 2 * ceil(log2 N) + 2 gossip rounds."""
    return 2 * math.ceil(math.log2(n)) + 2


def addr(i: int) -> Address:
    """Node ``i``'s address (node 1 has the lowest, so it is the leader)."""
    return Address(HOST, BASE_PORT + i)


class LogCounter(logging.Handler):
    """Counts the membership layer's warnings and errors by message template, silently.

    The nodes log every unreachable mark and every downing: thousands of lines in a run. The
    counts go into the report instead ("heartbeats are late" would mean the simulation starved).
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = f"{record.levelname} {record.msg}"
        self.counts[key] = self.counts.get(key, 0) + 1


class WallClockExceeded(Exception):
    """A run took longer in wall-clock time than its limit."""


# ---- the plan ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RunSpec:
    """One cluster run: form ``n`` nodes with ``seed``, then measure what is asked."""

    n: int
    seed: int
    joins: bool = True
    """Measure one join into the formed cluster."""
    crashes: int = 0
    """Crashes (each followed by a replacement join) to measure."""
    steady: bool = False
    """Measure the steady-state traffic window."""
    wall_limit: float = 600.0
    """Wall-clock seconds this run may take."""

    @property
    def name(self) -> str:
        parts = ["join"] if self.joins else []
        if self.steady:
            parts.append("traffic")
        if self.crashes:
            parts.append(f"{self.crashes} crashes")
        return f"N={self.n} seed={self.seed} ({', '.join(parts)})"


@attrs.frozen(kw_only=True)
class PauseSpec:
    """The pause scenario: for each pause length and seed, a fresh cluster paused a few times."""

    seeds: tuple[int, ...]
    n: int = 5
    pauses: tuple[float, ...] = (2.0, 2.5)
    control: float | None = 3.5
    """A pause longer than acceptable_heartbeat_pause, outside the target: it should raise
    alarms, which shows that the scenario can see them."""
    per_cluster: int = 4
    """Pauses per cluster, each of a different node; the first one meets the tightest
    heartbeat history (every pause that is tolerated widens it)."""
    wall_limit: float = 60.0
    """Wall-clock seconds per cluster."""

    @property
    def lengths(self) -> tuple[float, ...]:
        return (*self.pauses, *(() if self.control is None else (self.control,)))

    def name(self, length: float, seed: int) -> str:
        kind = "control pause" if length == self.control else "pause"
        return f"N={self.n} seed={seed} ({kind} {length:g} s x {self.per_cluster})"


@attrs.frozen(kw_only=True)
class Plan:
    """Every run of one benchmark invocation."""

    quick: bool
    sizes: tuple[int, ...]
    skipped_sizes: dict[int, str]
    runs: tuple[RunSpec, ...]
    pause: PauseSpec


def make_plan(*, quick: bool, max_n: int) -> Plan:
    """The runs for ``--quick`` or a full run, without clusters larger than ``max_n``."""
    if quick:
        runs = [
            *(RunSpec(n=5, seed=s, wall_limit=20) for s in (101, 102, 103)),
            RunSpec(n=25, seed=251, crashes=2, steady=True, wall_limit=40),
        ]
        pause = PauseSpec(seeds=(501, 502, 503), per_cluster=3, wall_limit=20)
    else:
        runs = [
            *(RunSpec(n=5, seed=s, wall_limit=30) for s in (101, 102, 103, 104, 105)),
            RunSpec(n=25, seed=251, crashes=6, steady=True, wall_limit=240),
            RunSpec(n=25, seed=252, crashes=6, wall_limit=240),
            RunSpec(n=25, seed=253, crashes=6, wall_limit=240),
            RunSpec(n=100, seed=1001, crashes=3, steady=True, wall_limit=1200),
            RunSpec(n=100, seed=1002, crashes=2, wall_limit=1200),
            RunSpec(n=200, seed=2001, wall_limit=1500),
        ]
        pause = PauseSpec(seeds=(501, 502, 503, 504, 505, 506), per_cluster=4)
    all_sizes = (5, 25, 100, 200)
    skipped: dict[int, str] = {}
    for n in all_sizes:
        if n > max_n:
            skipped[n] = f"skipped: N={n} is above --max-n {max_n}"
        elif not any(r.n == n for r in runs):
            skipped[n] = (
                f"skipped by --quick: an N={n} run takes "
                f"{'5-10 min' if n <= 100 else 'about 5 min'} of wall-clock time "
                f"(forming {n} nodes alone {'30-40 s' if n <= 100 else 'about 100 s'})"
            )
    kept = tuple(r for r in runs if r.n <= max_n)
    return Plan(
        quick=quick,
        sizes=tuple(n for n in all_sizes if n not in skipped),
        skipped_sizes=skipped,
        runs=kept,
        pause=pause,
    )


# ---- the simulated cluster -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Traffic:
    """Received messages of one kind: how many and their encoded bytes (frame prefix included)."""

    messages: int
    bytes: int


class Sim:
    """Nodes of one cluster on one simulated network, with every cluster event time-stamped."""

    def __init__(self, seed: int, nursery: trio.Nursery, budget: Budget) -> None:
        self.seed = seed
        self.net = SimNetwork(seed, conditions=LINK, keep_trace=False)
        self.nursery = nursery
        self.budget = budget
        self.rng = random.Random(seed * 7919 + 1)
        self.clusters: dict[int, Cluster] = {}
        self.transports: dict[int, SimTransport] = {}
        self.scopes: dict[int, trio.CancelScope] = {}
        self.alive: list[int] = []
        self.next_index = 1
        self.first_seen: dict[tuple[str, UniqueAddress, int], float] = {}
        """(event kind, subject, observer node index) -> when the observer first had it."""
        self.unreachable_log: list[tuple[float, int, UniqueAddress]] = []
        """Every UnreachableMember event: (time, observer index, subject)."""
        self.traffic: dict[str, list[int]] | None = None
        """While set: received message type -> [count, bytes]."""

    # ---- nodes ----

    async def start(self, i: int | None = None) -> int:
        """Start node ``i`` (default: the next unused index); returns its index."""
        if i is None:
            i = self.next_index
        self.next_index = max(self.next_index, i + 1)
        await self.nursery.start(self._run, i)
        self.alive.append(i)
        return i

    async def _run(self, i: int, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            self.scopes[i] = scope
            async with self.net.transport(addr(i), f"n{i}") as transport:
                cluster = Cluster(
                    transport,
                    settings=CLUSTER_SETTINGS,
                    failure_detector=FD_SETTINGS,
                    split_brain_resolver=SBR_SETTINGS,
                    seed_nodes=[addr(s) for s in SEED_NODES],
                    rng=random.Random(self.seed * 100_003 + i),
                )
                self.clusters[i] = cluster
                self.transports[i] = transport
                async with trio.open_nursery() as inner:

                    async def dispatch() -> None:
                        async for envelope in transport:
                            if self.traffic is not None:
                                self._count(envelope.message, transport.local_address.uid)
                            cluster.handle(envelope)

                    async def record() -> None:
                        async with cluster.subscribe() as events:
                            async for event in events:
                                self._record(i, event)

                    inner.start_soon(dispatch)
                    inner.start_soon(record)
                    await inner.start(cluster.run)
                    task_status.started()
                    await cluster.terminated.wait()
                    inner.cancel_scope.cancel()

    def crash(self, i: int) -> None:
        """Crash node ``i``: its network endpoint goes away and its tasks are cancelled."""
        self.net.crash(addr(i))
        self.scopes[i].cancel()
        self.alive.remove(i)

    def node(self, i: int) -> UniqueAddress:
        return self.clusters[i].self_address

    # ---- events and traffic ----

    def _record(self, observer: int, event: ClusterEvent) -> None:
        now = trio.current_time()
        if isinstance(event, MemberEvent | UnreachableMember | ReachableMember):
            key = (type(event).__name__, event.member.node, observer)
            self.first_seen.setdefault(key, now)
        if isinstance(event, UnreachableMember):
            self.unreachable_log.append((now, observer, event.member.node))

    def seen_at(self, kind: str, subject: UniqueAddress, observer: int) -> float | None:
        """When ``observer`` first published a ``kind`` event about ``subject``."""
        return self.first_seen.get((kind, subject, observer))

    def _count(self, message: object, uid: int) -> None:
        assert self.traffic is not None
        if isinstance(message, Heartbeat | HeartbeatRsp):
            kind = "heartbeat"
        elif isinstance(message, GossipEnvelope):
            kind = "gossip_full"
        elif isinstance(message, GossipStatus):
            kind = "gossip_status"
        else:
            kind = "other"
        size = len(wire.encode(message, to_uid=uid)) + 4
        entry = self.traffic.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += size

    def sent_totals(self) -> tuple[int, int]:
        """Bytes and frames sent so far by every live transport, over all its peers."""
        total_bytes = total_frames = 0
        for i in self.alive:
            for peer in self.transports[i].statistics().peers:
                total_bytes += peer.bytes_sent
                total_frames += peer.frames_sent
        return total_bytes, total_frames

    # ---- views ----

    def converged_with(self, i: int, expected: frozenset[UniqueAddress]) -> bool:
        """Whether node ``i`` sees exactly ``expected``, all Up, with converged gossip."""
        cluster = self.clusters[i]
        members = cluster.members
        if len(members) != len(expected):
            return False
        if any(m.status is not MemberStatus.UP or m.node not in expected for m in members):
            return False
        return cluster.has_converged()

    def expected(self) -> frozenset[UniqueAddress]:
        return frozenset(self.node(i) for i in self.alive)

    def all_converged(self) -> bool:
        expected = self.expected()
        return all(self.converged_with(i, expected) for i in self.alive)

    # ---- time ----

    async def wait_until(
        self, predicate: Callable[[], bool], limit: float, what: str, poll: float
    ) -> float:
        """Poll ``predicate`` every ``poll`` simulated seconds; returns the time it took."""
        start = trio.current_time()
        try:
            with trio.fail_after(limit):
                while not predicate():
                    self.budget.check()
                    await trio.sleep(poll)
        except trio.TooSlowError:
            raise trio.TooSlowError(f"{what}: not within {limit:g} simulated seconds") from None
        return trio.current_time() - start

    async def sleep(self, seconds: float) -> None:
        """Sleep on the mock clock, checking the wall-clock budget every simulated second."""
        end = trio.current_time() + seconds
        while (left := end - trio.current_time()) > 0:
            self.budget.check()
            await trio.sleep(min(1.0, left))


@attrs.define
class Budget:
    """The wall-clock limit of one run."""

    what: str
    limit: float
    started: float = attrs.field(factory=time.perf_counter)

    def check(self) -> None:
        elapsed = time.perf_counter() - self.started
        if elapsed > self.limit:
            raise WallClockExceeded(
                f"{self.what}: stopped after {elapsed:.0f} s of wall-clock time "
                f"(limit {self.limit:.0f} s)"
            )


# ---- measurements ----------------------------------------------------------------------------


async def form(sim: Sim, n: int) -> dict[str, float]:
    """Start ``n`` nodes at once and wait until node 1, then every node, sees all Up."""
    wall = time.perf_counter()
    start = trio.current_time()
    for i in range(1, n + 1):
        await sim.start(i)
    expected = sim.expected()
    await sim.wait_until(
        lambda: sim.converged_with(1, expected), FORM_LIMIT, f"forming {n} nodes", FORM_POLL
    )
    node1 = trio.current_time() - start
    await sim.wait_until(sim.all_converged, FORM_LIMIT, f"forming {n} nodes", FORM_POLL)
    return {
        "node1_s": round(node1, 3),
        "all_s": round(trio.current_time() - start, 3),
        "wall_s": round(time.perf_counter() - wall, 2),
    }


async def measure_join(sim: Sim, kind: str) -> dict[str, Any]:
    """Start one more node and time its way to converged gossip everywhere (see the docstring)."""
    wall = time.perf_counter()
    cluster_size = len(sim.alive)
    started = trio.current_time()
    i = await sim.start()
    new = sim.node(i)
    converged_at: dict[int, float] = {}

    def everyone_converged() -> bool:
        now = trio.current_time()
        expected = sim.expected()
        done = True
        for j in sim.alive:
            if sim.seen_at("MemberUp", new, j) is None:
                done = False
                continue
            if sim.converged_with(j, expected):
                converged_at.setdefault(j, now)
            else:
                done = False
        return done

    await sim.wait_until(everyone_converged, JOIN_LIMIT, f"join of n{i}", JOIN_POLL)
    end = trio.current_time()
    others = [j for j in sim.alive if j != i]
    accepted = min(t for j in others if (t := sim.seen_at("MemberJoined", new, j)) is not None)

    def first_heard(j: int) -> float:
        kinds = ("MemberJoined", "MemberWeaklyUp", "MemberUp")
        return min(t for k in kinds if (t := sim.seen_at(k, new, j)) is not None)

    up_times = {j: sim.seen_at("MemberUp", new, j) for j in sim.alive}
    up = {j: t for j, t in up_times.items() if t is not None}
    weakly_up = any(sim.seen_at("MemberWeaklyUp", new, j) is not None for j in sim.alive)
    laggards = sorted(converged_at, key=lambda j: converged_at[j])[-3:]

    def rel(t: float) -> float:
        return round(t - accepted, 3)

    seconds = end - accepted
    return {
        "kind": kind,
        "cluster_size": cluster_size,
        "new_node": f"n{i}",
        "seconds": round(seconds, 3),
        "rounds": round(seconds / GOSSIP_INTERVAL, 2),
        "seconds_from_start": round(end - started, 3),
        "accepted_after_start_s": round(accepted - started, 3),
        "phases_s": {
            "joining_known_everywhere": rel(max(first_heard(j) for j in sim.alive)),
            "leader_moved_up": rel(min(up.values())),
            "up_known_everywhere": rel(max(up.values())),
            "all_converged": rel(end),
        },
        "weakly_up": weakly_up,
        "last_to_converge": [
            {"node": f"n{j}", "converged_s": rel(converged_at[j]), "saw_up_s": rel(up[j])}
            for j in reversed(laggards)
        ],
        "wall_s": round(time.perf_counter() - wall, 2),
    }


async def measure_crash(sim: Sim, victim: int) -> dict[str, Any]:
    """Crash ``victim``: time its detection, then down it and wait until it is removed."""
    wall = time.perf_counter()
    await sim.sleep(sim.rng.uniform(0.0, 1.0))  # a random phase against the heartbeat timers
    target = sim.node(victim)
    monitors = {j for j in sim.alive if target in sim.clusters[j]._heartbeats.receivers}
    crashed_at = trio.current_time()
    sim.crash(victim)
    observers = list(sim.alive)

    def everyone_detected() -> bool:
        return all(sim.seen_at("UnreachableMember", target, j) is not None for j in observers)

    await sim.wait_until(
        everyone_detected, DETECT_LIMIT, f"detection of n{victim}'s crash", DETECT_POLL
    )
    times = {j: sim.seen_at("UnreachableMember", target, j) for j in observers}
    detected = {j: t - crashed_at for j, t in times.items() if t is not None}
    first = min(detected, key=lambda j: detected[j])
    sim.clusters[1].down(target)
    await sim.wait_until(sim.all_converged, SETTLE_LIMIT, f"removal of n{victim}", FORM_POLL)
    return {
        "victim": f"n{victim}",
        "cluster_size": len(observers) + 1,
        "first_s": round(detected[first], 3),
        "first_observer": f"n{first}",
        "first_observer_monitored_it": first in monitors,
        "monitors": len(monitors),
        "all_s": round(max(detected.values()), 3),
        "wall_s": round(time.perf_counter() - wall, 2),
    }


async def measure_steady(sim: Sim, seconds: float) -> dict[str, Any]:
    """Bytes and messages of a quiet cluster over ``seconds``, per node per second."""
    wall = time.perf_counter()
    nodes = len(sim.alive)
    bytes_before, frames_before = sim.sent_totals()
    sim.traffic = {}
    await sim.sleep(seconds)
    traffic, sim.traffic = sim.traffic, None
    bytes_after, frames_after = sim.sent_totals()
    per = nodes * seconds
    by_kind = {
        kind: {
            "messages_per_node_per_s": round(count / per, 2),
            "bytes_per_node_per_s": round(size / per, 1),
            "mean_bytes": round(size / count, 1),
        }
        for kind, (count, size) in sorted(traffic.items())
    }
    gossip_bytes = sum(traffic.get(k, [0, 0])[1] for k in ("gossip_full", "gossip_status"))
    gossip_messages = sum(traffic.get(k, [0, 0])[0] for k in ("gossip_full", "gossip_status"))
    return {
        "nodes": nodes,
        "window_s": seconds,
        "bytes_per_node_per_s": round((bytes_after - bytes_before) / per, 1),
        "messages_per_node_per_s": round((frames_after - frames_before) / per, 2),
        "gossip_only_bytes_per_node_per_s": round(gossip_bytes / per, 1),
        "gossip_only_messages_per_node_per_s": round(gossip_messages / per, 2),
        "received_by_kind": by_kind,
        "wall_s": round(time.perf_counter() - wall, 2),
    }


async def cluster_run(spec: RunSpec, budget: Budget, result: dict[str, Any]) -> None:
    """One :class:`RunSpec`: form, then traffic window, crashes with replacements, one join.

    Fills ``result`` as it goes, so a run stopped by a limit keeps what it measured.
    """
    async with trio.open_nursery() as nursery:
        sim = Sim(spec.seed, nursery, budget)
        result["form"] = await form(sim, spec.n)
        joins: list[dict[str, Any]] = []
        crashes: list[dict[str, Any]] = []
        result["joins"], result["crashes"] = joins, crashes
        await sim.sleep(SETTLE)
        if spec.steady:
            result["steady"] = await measure_steady(sim, STEADY_WINDOW)
        for _ in range(spec.crashes):
            victim = sim.rng.choice([i for i in sim.alive if i != 1])
            crashes.append(await measure_crash(sim, victim))
            # Let the leader see the removal converged at one of its ticks first: it resets the
            # WeaklyUp timer only then (as Akka does), and a join right after convergence would
            # otherwise inherit a running timer and be moved to WeaklyUp early.
            await sim.sleep(2 * CLUSTER_SETTINGS.leader_actions_interval)
            joins.append(await measure_join(sim, "replacement"))
            await sim.sleep(SETTLE)
        if spec.joins:
            joins.append(await measure_join(sim, "one_more"))
        nursery.cancel_scope.cancel()


async def pause_run(spec: PauseSpec, length: float, budget: Budget, result: dict[str, Any]) -> None:
    """Isolate nodes for ``length`` seconds, one after another; count UnreachableMember events.

    ``unreachable_events`` counts every UnreachableMember event of the run, forming and settling
    included: in this cluster none is justified unless ``length`` exceeds the acceptable pause.
    """
    async with trio.open_nursery() as nursery:
        sim = Sim(result["seed"], nursery, budget)
        result["form"] = await form(sim, spec.n)
        await sim.sleep(2 * SETTLE)  # a long, regular heartbeat history: the strictest detector
        per_pause: list[int] = []
        details: list[dict[str, Any]] = []
        result["events_per_pause"] = per_pause
        result["details"] = details
        for r in range(spec.per_cluster):
            victim = 2 + r % (spec.n - 1)
            await sim.sleep(sim.rng.uniform(0.0, 1.0))  # a random phase against the heartbeats
            before = len(sim.unreachable_log)
            started = trio.current_time()
            sim.net.isolate(addr(victim))
            await sim.sleep(length)
            sim.net.heal()
            await sim.sleep(PAUSE_RECOVERY)
            await sim.wait_until(
                lambda: (
                    sim.all_converged() and not any(sim.clusters[i].unreachable for i in sim.alive)
                ),
                SETTLE_LIMIT,
                f"recovery after pausing n{victim}",
                FORM_POLL,
            )
            new_events = sim.unreachable_log[before:]
            per_pause.append(len(new_events))
            if new_events:
                details.append(
                    {
                        "pause": r,
                        "isolated": f"n{victim}",
                        "events": [
                            {
                                "after_s": round(t - started, 3),
                                "observer": f"n{o}",
                                "subject": subject.name,
                            }
                            for t, o, subject in new_events[:10]
                        ],
                    }
                )
        result["unreachable_events"] = len(sim.unreachable_log)
        nursery.cancel_scope.cancel()


def simulate(
    name: str,
    seed: int,
    wall_limit: float,
    body: Callable[[Budget, dict[str, Any]], Awaitable[None]],
    result: dict[str, Any],
) -> dict[str, Any]:
    """One deterministic trio run on the mock clock; a limit hit becomes an ``error`` entry."""
    budget = Budget(name, wall_limit)
    clock = trio.testing.MockClock(autojump_threshold=0)
    logger = logging.getLogger("membership")
    counter = LogCounter()
    logger.addHandler(counter)
    propagate, logger.propagate = logger.propagate, False
    try:
        with deterministic_scheduling(seed):
            trio.run(body, budget, result, clock=clock)
    except* (trio.TooSlowError, WallClockExceeded) as group:
        first = _leaves(group)[0]
        result["error"] = str(first) if isinstance(first, WallClockExceeded) else f"{name}: {first}"
    finally:
        logger.removeHandler(counter)
        logger.propagate = propagate
    result["log_warnings"] = dict(sorted(counter.counts.items()))
    result["wall_s"] = round(time.perf_counter() - budget.started, 2)
    return result


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


def run_all(plan: Plan, *, progress: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every cluster run, then the pause run; progress lines on stderr."""

    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    runs: list[dict[str, Any]] = []
    for spec in plan.runs:
        say(f"run {spec.name} ...")

        async def body(budget: Budget, result: dict[str, Any], spec: RunSpec = spec) -> None:
            await cluster_run(spec, budget, result)

        result = {"n": spec.n, "seed": spec.seed, "name": spec.name}
        runs.append(simulate(spec.name, spec.seed, spec.wall_limit, body, result))
        say(f"    {_run_line(result)}")
    pauses: list[dict[str, Any]] = []
    spec_p = plan.pause
    for length in spec_p.lengths:
        for seed in spec_p.seeds:
            name = spec_p.name(length, seed)
            say(f"run {name} ...")

            async def pause_body(
                budget: Budget, result: dict[str, Any], length: float = length
            ) -> None:
                await pause_run(spec_p, length, budget, result)

            result = {
                "n": spec_p.n,
                "seed": seed,
                "name": name,
                "pause_s": length,
                "control": length == spec_p.control,
            }
            pauses.append(simulate(name, seed, spec_p.wall_limit, pause_body, result))
            events = result.get("events_per_pause")
            say(f"    {result.get('error') or f'UnreachableMember events per pause: {events}'}")
    return runs, pauses


def _run_line(result: dict[str, Any]) -> str:
    parts = []
    if "form" in result:
        parts.append(f"formed in {result['form']['all_s']} s ({result['form']['wall_s']} s wall)")
    joins = result.get("joins", [])
    if joins:
        parts.append("join rounds " + ", ".join(f"{j['rounds']:g}" for j in joins))
    crashes = result.get("crashes", [])
    if crashes:
        parts.append("first detection s " + ", ".join(f"{c['first_s']:g}" for c in crashes))
    if "steady" in result:
        parts.append(f"{result['steady']['bytes_per_node_per_s']:g} B/node/s")
    if "error" in result:
        parts.append(f"ERROR {result['error']}")
    return "; ".join(parts) + f" [{result['wall_s']} s wall]"


# ---- report --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): always one of the samples."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarize(
    plan: Plan, runs: list[dict[str, Any]], pauses: list[dict[str, Any]]
) -> dict[str, Any]:
    """The JSON report: headline keys, targets and verdicts, then every run in full."""
    out: dict[str, Any] = {"quick": plan.quick}
    reasons: dict[str, str] = {}

    def missing(n: int) -> str:
        return plan.skipped_sizes.get(n, f"no sample at N={n}: see errors")

    joins_by_n: dict[int, list[dict[str, Any]]] = {}
    crashes_by_n: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        joins_by_n.setdefault(r["n"], []).extend(r.get("joins", []))
        crashes_by_n.setdefault(r["n"], []).extend(r.get("crashes", []))

    join_summary: dict[str, Any] = {}
    for n in (5, 25, 100, 200):
        joins = joins_by_n.get(n, [])
        rounds = [float(j["rounds"]) for j in joins]
        target = join_target_rounds(n)
        out[f"converge_rounds_n{n}"] = _median(rounds)
        out[f"converge_rounds_max_n{n}"] = max(rounds) if rounds else None
        out[f"converge_seconds_n{n}"] = _median([float(j["seconds"]) for j in joins])
        if not rounds:
            reasons[f"converge_rounds_n{n}"] = missing(n)
            continue
        join_summary[str(n)] = {
            "samples": len(rounds),
            "rounds_p50": _median(rounds),
            "rounds_max": max(rounds),
            "rounds_min": min(rounds),
            "target_rounds": target,
            "target_met": max(rounds) <= target,
            "seconds_from_start_p50": _median([float(j["seconds_from_start"]) for j in joins]),
            "weakly_up": sum(1 for j in joins if j["weakly_up"]),
            "phases_p50_s": {
                phase: _median([float(j["phases_s"][phase]) for j in joins])
                for phase in joins[0]["phases_s"]
            },
            "wall_s_p50": _median([float(j["wall_s"]) for j in joins]),
        }
    out["converge"] = join_summary

    detect_summary: dict[str, Any] = {}
    for n in (25, 100):
        crashes = crashes_by_n.get(n, [])
        first = [float(c["first_s"]) for c in crashes]
        every = [float(c["all_s"]) for c in crashes]
        out[f"detect_p50_s_n{n}"] = percentile(first, 50) if first else None
        out[f"detect_p99_s_n{n}"] = percentile(first, 99) if first else None
        if not first:
            reasons[f"detect_p99_s_n{n}"] = missing(n)
            continue
        detect_summary[str(n)] = {
            "samples": len(first),
            "first_p50_s": percentile(first, 50),
            "first_p99_s": percentile(first, 99),
            "first_min_s": min(first),
            "all_p50_s": percentile(every, 50),
            "all_p99_s": percentile(every, 99),
            "first_by_a_monitor": sum(1 for c in crashes if c["first_observer_monitored_it"]),
            "target_met": percentile(first, 99) <= DETECT_P99_TARGET_S,
            "wall_s_p50": _median([float(c["wall_s"]) for c in crashes]),
        }
    out["detect"] = detect_summary

    pause_summary: dict[str, Any] = {}
    for length in plan.pause.lengths:
        group = [p for p in pauses if p["pause_s"] == length]
        counts = [c for p in group for c in p.get("events_per_pause", [])]
        pause_summary[f"{length:.1f}"] = {
            "control": length == plan.pause.control,
            "clusters": len(group),
            "pauses": len(counts),
            "unreachable_events": sum(p.get("unreachable_events", 0) for p in group),
            "pauses_with_events": sum(1 for c in counts if c),
            "first_pauses_with_events": sum(
                1 for p in group if p.get("events_per_pause", [0])[:1] != [0]
            ),
        }
    out["pauses"] = pause_summary
    measured = [p for p in pauses if not p["control"]]
    if measured and all("unreachable_events" in p for p in measured):
        out["false_unreachable_events"] = sum(p["unreachable_events"] for p in measured)
    else:
        out["false_unreachable_events"] = None
        reasons["false_unreachable_events"] = "a pause run failed: see errors"

    traffic: dict[str, Any] = {}
    for n in (25, 100):
        key = f"gossip_bytes_per_node_per_s_n{n}"
        steady = next((r["steady"] for r in runs if r["n"] == n and "steady" in r), None)
        out[key] = None if steady is None else steady["bytes_per_node_per_s"]
        out[f"messages_per_node_per_s_n{n}"] = (
            None if steady is None else steady["messages_per_node_per_s"]
        )
        out[f"gossip_only_bytes_per_node_per_s_n{n}"] = (
            None if steady is None else steady["gossip_only_bytes_per_node_per_s"]
        )
        if steady is None:
            reasons[key] = missing(n)
        else:
            traffic[str(n)] = steady
    out["traffic"] = traffic

    out["targets"] = {
        "converge_rounds_n100": join_target_rounds(TARGET_N),
        "detect_p99_s": DETECT_P99_TARGET_S,
        "false_unreachable_events": FALSE_UNREACHABLE_TARGET,
    }
    out["targets_met"] = {
        "converge_rounds_n100": join_summary.get(str(TARGET_N), {}).get("target_met"),
        "detect_p99_s_n25": detect_summary.get("25", {}).get("target_met"),
        "detect_p99_s_n100": detect_summary.get("100", {}).get("target_met"),
        "false_unreachable_events": (
            None
            if out["false_unreachable_events"] is None
            else out["false_unreachable_events"] <= FALSE_UNREACHABLE_TARGET
        ),
    }
    out["null_reasons"] = reasons
    out["errors"] = [r["error"] for r in [*runs, *pauses] if "error" in r]
    out["seeds"] = {"clusters": [r.seed for r in plan.runs], "pauses": list(plan.pause.seeds)}
    out["method"] = (
        "simulated seconds on trio's MockClock over SimNetwork (1-5 ms links), default "
        "settings, seed nodes n1-n3. Join: from the first MemberJoined for the new node (its "
        "Join accepted) until every node's gossip converged with it Up, polled every "
        f"{JOIN_POLL:g} s; rounds = seconds / gossip_interval ({GOSSIP_INTERVAL:g} s); p50 "
        "is the median of all samples, the target is checked against the slowest. Detection: "
        "from the crash to the first (detect_p*) and to the last (detect.<N>.all_p*) "
        "UnreachableMember event, nearest-rank percentiles over every crash. Traffic: "
        "transport bytes and frames "
        f"sent per node per second over {STEADY_WINDOW:g} s of a quiet cluster (heartbeats "
        "included; gossip_only_* in traffic counts gossip messages alone)"
    )
    out["wall_s"] = {
        **{r["name"]: r["wall_s"] for r in runs},
        "pauses": round(sum(p["wall_s"] for p in pauses), 2),
        "total": round(sum(r["wall_s"] for r in [*runs, *pauses]), 1),
    }
    out["runs"] = runs
    out["pause_runs"] = pauses
    return out


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _met(value: bool | None) -> str:
    return "n/a" if value is None else ("met" if value else "NOT met")


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{first}  {rest}"

    return [line(header), line(tuple("-" * w for w in widths)), *(line(row) for row in rows)]


def format_table(report: dict[str, Any], plan: Plan) -> str:
    """The report as tables for people."""
    notes: list[str] = []

    def skipped(n: int, key: str, width: int) -> tuple[str, ...]:
        notes.append(f"  N={n}: {report['null_reasons'].get(key, 'no sample')}")
        return (str(n), *(["-"] * (width - 1)))

    lines = [
        "membership benchmark: simulated seconds (MockClock, SimNetwork 1-5 ms links, default "
        "settings)",
        f"seeds: clusters {report['seeds']['clusters']}, pauses {report['seeds']['pauses']}",
        "",
        "1. join convergence, from the new node's Join accepted until every node's gossip has "
        "converged with it Up",
        "   (rounds = simulated seconds / gossip_interval; phases: median seconds after the Join "
        "was accepted)",
    ]
    rows: list[tuple[str, ...]] = []
    for n in (5, 25, 100, 200):
        s = report["converge"].get(str(n))
        if s is None:
            rows.append(skipped(n, f"converge_rounds_n{n}", 12))
            continue
        p = s["phases_p50_s"]
        rows.append(
            (
                str(n),
                str(s["samples"]),
                _fmt(s["rounds_p50"], ".2f"),
                _fmt(s["rounds_max"], ".2f"),
                str(s["target_rounds"]),
                _met(s["target_met"]),
                _fmt(s["seconds_from_start_p50"], ".2f"),
                f"{p['joining_known_everywhere']:.1f}",
                f"{p['leader_moved_up']:.1f}",
                f"{p['up_known_everywhere']:.1f}",
                str(s["weakly_up"]),
                f"{s['wall_s_p50']:.1f}",
            )
        )
    lines += _table(
        (
            "N",
            "samples",
            "rounds p50",
            "max",
            "target",
            "met",
            "s from start",
            "Joining everywhere",
            "Up by leader",
            "Up everywhere",
            "WeaklyUp",
            "wall s/join",
        ),
        rows,
    )
    lines += notes
    notes.clear()
    lines += ["", "2. failure detection after a crash, seconds (first observer / every node)"]
    rows = []
    for n in (25, 100):
        d = report["detect"].get(str(n))
        if d is None:
            rows.append(skipped(n, f"detect_p99_s_n{n}", 8))
            continue
        rows.append(
            (
                str(n),
                str(d["samples"]),
                f"{d['first_p50_s']:.2f}",
                f"{d['first_p99_s']:.2f}",
                f"{d['all_p50_s']:.2f}",
                f"{d['all_p99_s']:.2f}",
                f"{d['first_by_a_monitor']}/{d['samples']}",
                _met(d["target_met"]),
            )
        )
    lines += _table(
        (
            "N",
            "samples",
            "first p50",
            "first p99",
            "all p50",
            "all p99",
            "first by a monitor",
            f"p99 <= {DETECT_P99_TARGET_S:g}",
        ),
        rows,
    )
    lines += notes
    notes.clear()
    lines += [
        "",
        f"3. false unreachability: N={plan.pause.n}, one node isolated (both ways) then healed; "
        f"fresh clusters (seeds {list(plan.pause.seeds)}), {plan.pause.per_cluster} pauses each",
    ]
    rows = [
        (
            f"{length} s" + (" (control: above the 3 s acceptable pause)" if p["control"] else ""),
            str(p["pauses"]),
            str(p["unreachable_events"]),
            str(p["pauses_with_events"]),
            f"{p['first_pauses_with_events']}/{p['clusters']}",
        )
        for length, p in report["pauses"].items()
    ]
    lines += _table(
        ("pause", "pauses", "UnreachableMember events", "pauses with events", "first pauses"),
        rows,
    )
    lines.append(
        f"target: {FALSE_UNREACHABLE_TARGET} events: "
        f"{_met(report['targets_met']['false_unreachable_events'])}"
    )
    lines += [
        "",
        f"4. steady-state traffic over {STEADY_WINDOW:g} s, per node per second "
        "(all = transport bytes/frames sent, heartbeats included)",
    ]
    rows = []
    for n in (25, 100):
        t = report["traffic"].get(str(n))
        if t is None:
            rows.append(skipped(n, f"gossip_bytes_per_node_per_s_n{n}", 7))
            continue
        kinds = t["received_by_kind"]
        rows.append(
            (
                str(n),
                f"{t['bytes_per_node_per_s']:,.0f}",
                f"{t['messages_per_node_per_s']:.2f}",
                f"{t['gossip_only_bytes_per_node_per_s']:,.0f}",
                f"{t['gossip_only_messages_per_node_per_s']:.2f}",
                f"{kinds.get('gossip_status', {}).get('mean_bytes', 0):,.0f}",
                f"{kinds.get('heartbeat', {}).get('messages_per_node_per_s', 0):.2f}",
            )
        )
    lines += _table(
        (
            "N",
            "all bytes",
            "all msgs",
            "gossip bytes",
            "gossip msgs",
            "status size",
            "heartbeat msgs",
        ),
        rows,
    )
    lines += notes
    notes.clear()
    lines += ["", "wall-clock seconds per run (form / traffic / crashes / joins / total)"]
    rows = []
    for r in report["runs"]:
        rows.append(
            (
                r["name"],
                _fmt(r.get("form", {}).get("wall_s")),
                _fmt(r.get("steady", {}).get("wall_s")),
                f"{sum(c['wall_s'] for c in r.get('crashes', [])):.1f}",
                f"{sum(j['wall_s'] for j in r.get('joins', [])):.1f}",
                f"{r['wall_s']:.1f}",
            )
        )
    rows.append(("pause runs (all)", "-", "-", "-", "-", f"{report['wall_s']['pauses']:.1f}"))
    lines += _table(("run", "form", "traffic", "crashes", "joins", "total"), rows)
    lines.append(f"total wall-clock: {report['wall_s']['total']:.1f} s")
    met = report["targets_met"]
    lines += [
        "",
        "targets: "
        f"join at N={TARGET_N} <= {join_target_rounds(TARGET_N)} rounds (slowest sample): "
        f"{_met(met['converge_rounds_n100'])}; "
        f"detection p99 <= {DETECT_P99_TARGET_S:g} s: N=25 {_met(met['detect_p99_s_n25'])}, "
        f"N=100 {_met(met['detect_p99_s_n100'])}; "
        f"false unreachable = {FALSE_UNREACHABLE_TARGET}: "
        f"{_met(met['false_unreachable_events'])}",
    ]
    for error in report["errors"]:
        lines.append(f"ERROR: {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the tables or the JSON."""
    parser = benchmark_parser(__doc__, quick="N = 5 and 25 only; under 60 s")
    parser.add_argument(
        "--max-n", type=int, default=200, help="leave out clusters larger than this (default 200)"
    )
    parser.add_argument(
        "--json-file", type=Path, help="also write the JSON report to this file (with the table)"
    )
    args = parser.parse_args(argv)
    if args.max_n < 5:
        parser.error("--max-n must be at least 5")
    plan = make_plan(quick=args.quick, max_n=args.max_n)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not args.json:
        seeds = ", ".join(str(r.seed) for r in plan.runs)
        print(
            f"seeds: clusters {seeds}; pauses {', '.join(map(str, plan.pause.seeds))}",
            file=sys.stderr,
            flush=True,
        )
    try:
        runs, pauses = run_all(plan, progress=not args.json)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    report = summarize(plan, runs, pauses)
    if args.json_file is not None:
        args.json_file.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.json else format_table(report, plan))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
