"""Sharding at scale, simulated: cold allocation, rebalance after joins, recovery after crashes.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.scale             # full run: 10, 50 and 100 nodes
    .venv/bin/python -m benchmarks.scale --quick     # 10 and 20 nodes, 1,000 shards; < 2 min
    .venv/bin/python -m benchmarks.scale --json      # one JSON object instead of the table
    .venv/bin/python -m benchmarks.scale --nodes 100 --cold-only --profile /tmp/coord
        # only the cold allocation at 100 nodes, with the coordinator's handling profiled
        # (cProfile, enabled only inside it) into /tmp/coord/coordinator-n100.prof

Progress lines go to stderr unless ``--json``.

Every cluster is real ``p2pshard`` nodes on ``membership.SimNetwork`` (``p2pshard.testing``'s
``SimCluster``: links delay each frame by 1-5 ms, nothing is lost), one ``trio.run`` per cluster
size on ``MockClock(autojump_threshold=0)`` under ``deterministic_scheduling(seed)`` (seed
printed; a seed replays the same run), with the default ``ShardingSettings`` and allocation
strategy. "Seconds" are simulated seconds unless called wall-clock or CPU seconds. One entity
type, ``HashExtractor(shards)``, hosted on every node; its entity counts its messages.

For each cluster size N (nodes 1..N; node 1 is the oldest, so it runs the coordinator):

1. **Cold allocation.** N nodes start and form a cluster; once every region registered, one
   entity of one shard is asked (the *one shard* baseline: a lone GetShardHome, the majority
   write of its home, HostShard, the message and its answer). Then every node tells its share of
   ``entities`` entity ids (spread over all ``shards`` shards) one message each, all at the same
   simulated instant. ``cold_allocation_s``: from then until every shard has a started entity
   (every shard allocated and hosted); also until every entity handled its message.
   *Coordinator CPU*: real process CPU seconds spent in the coordinator's handling (its core's
   decisions and the shell carrying out their effects, which includes starting each replicator
   write; ``time.process_time`` around the outermost such call, so nothing is counted twice),
   over the cold allocation, per shard allocated. The same-run baseline is the allocation
   strategy alone making the same ``shards`` allocations among N regions, without the network
   or the coordinator's state.
2. **Joins.** ``joins`` nodes more start at once. From the moment node 1 sees them all Up, the
   time until every shard is hosted and the shards per region differ by at most one, in
   ``rebalance_interval`` units. As in ``benchmarks.sharding``: a shard handed off is hosted again
   only when a message asks for it, so one entity of every unhosted shard is told every 0.05 s
   (at most once a second per shard), as steady traffic would.
3. **Crashes.** ``crashes`` nodes (never node 1 or 2, drawn from the seed) crash at once. Every
   shard is asked (one entity each, from the running nodes in turn, 1 s timeout, asked again
   until it answers);
   the time until every shard answered, and until each shard that was on a crashed node did
   (p50, max). Baseline in the same run: when node 1 saw every crashed node Down. The split
   brain resolver runs with the library's defaults (``stable_after`` 20 s; ``SimCluster``'s
   5 s makes some member down everyone when ten crashes are noticed over more than 4 s), and
   the coordinator waits ``stable_after`` again before it moves a downed node's shards
   (``down_removal_margin``'s default without shard leases).

The JSON's ``cold_allocation_s_n100`` is the cold allocation at N = 100 (null when the run did
not include 100 nodes); ``rebalance_intervals_after_10_joins`` is the worst over the sizes run
(null if one did not balance). Targets: 10,000 shards allocated from cold within 10 s at 100
nodes; balanced within 3 rebalance intervals after the joins.

Every wait has a simulated-time bound and every run a wall-clock limit; a run that reaches one is
reported with the reason, not aborted.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from benchmarks import _sharding_worker as worker
from benchmarks._report import benchmark_parser, cell, progress_line, run_and_print
from benchmarks.sharding import MovesLog
from membership import (
    Address,
    MemberStatus,
    SimNetwork,
    SplitBrainResolverSettings,
    UniqueAddress,
    deterministic_scheduling,
)
from p2pshard import (
    AskTimeout,
    EntityContext,
    HashExtractor,
    LeastShardAllocationStrategy,
    Node,
    ShardingError,
    ShardingSettings,
)
from p2pshard.sharding._allocation import ClusterView, ShardId
from p2pshard.sharding._coordinator import ShardCoordinator
from p2pshard.sharding._coordinator_core import ShardCoordinatorCore
from p2pshard.testing import SIM_LINKS, SimCluster, node_name
from p2pshard.testing._sim import autojump_clock

TYPE_NAME = "Scale"
COLD_TARGET_S = 10.0
"""Simulated seconds to allocate 10,000 shards from cold at 100 nodes."""
REBALANCE_TARGET = 3.0
"""Rebalance intervals until balanced after the joins."""
POLL = 0.05
"""Simulated seconds between checks of cluster state."""
TOUCH_AGAIN = 1.0
"""Simulated seconds before an unhosted shard is told again."""
ASK_TIMEOUT = 1.0
GONE = (None, MemberStatus.DOWN, MemberStatus.REMOVED)
FORM_BOUND = 600.0
"""Simulated seconds the cluster may take to form, or the joiners to be Up."""


@attrs.frozen(kw_only=True)
class Plan:
    """Sizes, counts and limits of one benchmark run."""

    sizes: tuple[int, ...]
    shards: int
    entities: int
    joins: int
    crashes: int
    seed: int
    churn: bool = True
    """Measure joins and crashes (False: the cold allocation only)."""
    cold_bound: float = 600.0
    """Simulated seconds the cold allocation may take."""
    rebalance_max_intervals: int = 20
    crash_bound: float = 120.0
    """Simulated seconds the shards may take to answer after the crashes."""
    wall_limit: float = 1800.0
    """Wall-clock seconds one cluster size may take."""


def make_plan(
    *,
    quick: bool,
    seed: int = 1,
    sizes: tuple[int, ...] | None = None,
    churn: bool = True,
    shards: int | None = None,
    entities: int | None = None,
) -> Plan:
    """The full plan: 10, 50, 100 nodes, 10,000 shards, 100,000 entities; quick: smaller."""
    if quick:
        plan = Plan(sizes=(10, 20), shards=1_000, entities=10_000, joins=10, crashes=5, seed=seed)
        plan = attrs.evolve(plan, wall_limit=100.0, rebalance_max_intervals=10)
    else:
        plan = Plan(
            sizes=(10, 50, 100), shards=10_000, entities=100_000, joins=10, crashes=10, seed=seed
        )
    return attrs.evolve(
        plan,
        sizes=sizes or plan.sizes,
        churn=churn,
        shards=shards or plan.shards,
        entities=entities or plan.entities,
    )


# ==== the entity and what it tells the benchmark ================================================


@attrs.define(eq=False)
class Tally:
    """What the entities did, counted as it happens (every node runs in this process)."""

    handled: int = 0
    started_shards: set[str] = attrs.Factory(set)
    want_handled: int = 0
    want_shards: int = 0
    handled_at: float | None = None
    shards_at: float | None = None

    def expect(self, *, handled: int, shards: int) -> None:
        """Count afresh, until ``handled`` messages and ``shards`` shards with an entity."""
        self.handled, self.started_shards = 0, set()
        self.want_handled, self.want_shards = handled, shards
        self.handled_at = self.shards_at = None

    def started(self, shard: str) -> None:
        self.started_shards.add(shard)
        if self.shards_at is None and len(self.started_shards) >= self.want_shards > 0:
            self.shards_at = trio.current_time()

    def one(self) -> None:
        self.handled += 1
        if self.handled_at is None and self.handled >= self.want_handled > 0:
            self.handled_at = trio.current_time()


class ScaleEntity:
    """Counts its messages; an ask gets the count back."""

    def __init__(self, ctx: EntityContext, tally: Tally) -> None:
        self.count = 0
        self.tally = tally
        tally.started(ctx.shard_id)

    async def receive(self, message: object, ctx: EntityContext) -> object:
        self.count += 1
        self.tally.one()
        return self.count


# ==== the coordinator's CPU ======================================================================


@attrs.define(eq=False)
class CoordinatorCpu:
    """Process CPU seconds spent in the coordinator's handling, while :meth:`installed`."""

    profile: cProfile.Profile | None = None
    seconds: float = 0.0
    calls: int = 0
    _depth: int = 0

    def reset(self) -> tuple[float, int]:
        """The seconds and calls so far; counting starts again from zero."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out

    def _timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            if self.profile is not None:
                self.profile.enable()
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - started
                self.calls += 1
                if self.profile is not None:
                    self.profile.disable()
                self._depth -= 1

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap the coordinator's entry points (every coordinator in this process)."""
        targets: list[tuple[type, str]] = [
            (ShardCoordinator, "_receive"),
            (ShardCoordinator, "_apply"),
            (ShardCoordinatorCore, "state_loaded"),
            (ShardCoordinatorCore, "set_cluster"),
            (ShardCoordinatorCore, "state_updated"),
            (ShardCoordinatorCore, "tick"),
        ]
        saved = [(cls, name, cls.__dict__[name]) for cls, name in targets]
        try:
            for cls, name, function in saved:
                setattr(cls, name, self._timed(function))
            yield
        finally:
            for cls, name, function in saved:
                setattr(cls, name, function)


def strategy_alone(nodes: int, shards: int) -> dict[str, float]:
    """The default strategy making ``shards`` allocations among ``nodes`` regions: CPU seconds."""
    strategy = LeastShardAllocationStrategy()
    regions = [UniqueAddress(Address("10.0.0.1", i), f"n{i}", i) for i in range(1, nodes + 1)]
    view = ClusterView(members=dict.fromkeys(regions, MemberStatus.UP))
    current: dict[UniqueAddress, list[ShardId]] = {r: [] for r in regions}
    started = time.process_time()
    for k in range(shards):
        shard = ShardId(str(k))
        chosen = strategy.allocate_shard(regions[k % nodes], shard, current, view)
        current[chosen].append(shard)
    seconds = time.process_time() - started
    return {"cpu_s": seconds, "cpu_per_allocation_us": seconds / shards * 1e6}


# ==== one cluster size ============================================================================


@attrs.define(eq=False)
class ScaleRun:
    """One simulated cluster of one size, and the helpers its phases share."""

    n: int
    plan: Plan
    sim: SimCluster
    tally: Tally
    by_shard: dict[str, str]
    """One entity id per shard."""
    wall: float = attrs.Factory(time.perf_counter)

    @property
    def node1(self) -> Node:
        return self.sim.nodes[1]

    def over_wall(self) -> bool:
        return time.perf_counter() - self.wall > self.plan.wall_limit

    def counts(self) -> dict[int, int]:
        """Shards hosted per region, by node."""
        return {i: len(r.shard_entity_counts()) for i, r in sorted(self.sim.regions.items())}

    def hosted(self) -> set[str]:
        return {s for r in self.sim.regions.values() for s in r.shard_entity_counts()}

    def sees_up(self, names: set[str]) -> bool:
        """Whether node 1 sees exactly ``names`` as members, all Up."""
        members = self.node1.cluster.members
        return {m.node.name for m in members} == names and all(
            m.status is MemberStatus.UP for m in members
        )

    async def wait_until(self, check: Callable[[], bool], bound: float, what: str) -> None:
        """Poll ``check`` on the mock clock for up to ``bound`` simulated seconds."""
        with trio.move_on_after(bound):
            while not check():
                if self.over_wall():
                    break
                await trio.sleep(POLL)
            else:
                return
        raise BenchmarkLimit(f"{what} within {bound:g} simulated s (or the wall-clock limit)")


class BenchmarkLimit(Exception):
    """A wait of the benchmark reached its bound."""


def entity_ids(extractor: HashExtractor, count: int, shards: int) -> list[str]:
    """``count`` entity ids covering every shard (the first ``shards`` ids: one per shard)."""
    ids = list(worker.one_id_per_shard(extractor, "s-", range(shards)).values())
    ids += [f"e-{k}" for k in range(max(0, count - len(ids)))]
    return ids[:count]


async def cold_allocation(run: ScaleRun, ids: list[str], cpu: CoordinatorCpu) -> dict[str, Any]:
    """Phase 1 (the cluster is formed): one shard alone, then every shard at once."""
    sim, plan, n = run.sim, run.plan, run.n
    out: dict[str, Any] = {}
    await run.wait_until(
        lambda: all(r.statistics().registered for r in sim.regions.values()),
        FORM_BOUND,
        "every region registered",
    )
    # The baseline: a lone first message to an entity of a shard not allocated yet (the
    # phase's own entities fill every shard, this one's too: it counts as hosted already).
    lone = f"lone-{n}"
    started = trio.current_time()
    await sim.regions[1 + n // 2].entity_ref(lone).ask(worker.Add(1), timeout=30)
    out["one_shard_s"] = trio.current_time() - started
    out["one_shard_id"] = str(HashExtractor(plan.shards).shard_id(lone))  # type: ignore[arg-type]
    run.tally.expect(handled=len(ids), shards=len(run.by_shard))
    run.tally.started_shards.add(out["one_shard_id"])  # hosted already
    cpu.reset()
    started = trio.current_time()
    cpu_wall = time.perf_counter()
    live = sorted(sim.regions)
    share = math.ceil(len(ids) / len(live))

    async def tell_share(i: int, part: list[str]) -> None:
        region = sim.regions[i]
        for entity_id in part:
            await region.entity_ref(entity_id).tell(worker.Add(1))

    async with trio.open_nursery() as nursery:
        for k, i in enumerate(live):
            nursery.start_soon(tell_share, i, ids[k * share : (k + 1) * share])
    tally = run.tally
    with contextlib.suppress(BenchmarkLimit):
        await run.wait_until(
            lambda: tally.shards_at is not None and tally.handled_at is not None,
            plan.cold_bound,
            "every shard allocated and every entity's message handled",
        )
    seconds, calls = cpu.reset()
    allocated = len(tally.started_shards)
    out.update(
        {
            "cold_allocation_s": None if tally.shards_at is None else tally.shards_at - started,
            "all_entities_s": None if tally.handled_at is None else tally.handled_at - started,
            "shards_allocated": allocated,
            "entities_handled": tally.handled,
            "coordinator_cpu_s": seconds,
            "coordinator_calls": calls,
            "coordinator_cpu_per_allocation_us": seconds / max(1, allocated) * 1e6,
            "wall_s": time.perf_counter() - cpu_wall,
            "counts": sorted(run.counts().values()),
        }
    )
    return out


async def joins(run: ScaleRun, moves: MovesLog) -> dict[str, Any]:
    """Phase 2: ``joins`` nodes start at once; intervals until the shards are balanced."""
    sim, plan, n = run.sim, run.plan, run.n
    interval = ShardingSettings().rebalance_interval
    new = list(range(n + 1, n + plan.joins + 1))
    before = sorted(run.counts().values())
    for i in new:
        await sim.start(i)
    everyone = {node_name(i) for i in sorted(sim.nodes)}
    await run.wait_until(lambda: run.sees_up(everyone), FORM_BOUND, "the joining nodes Up")
    up_at = trio.current_time()
    stats = run.node1.sharding.coordinator_statistics(TYPE_NAME)
    rounds_before = 0 if stats is None else stats.rebalance_rounds
    moves.moves.clear()
    touched: dict[str, float] = {}
    timeline: list[dict[str, Any]] = []
    next_sample = up_at
    balanced_at: float | None = None
    reason = ""
    with trio.move_on_after(plan.rebalance_max_intervals * interval):
        while True:
            now = trio.current_time()
            counts = list(run.counts().values())
            hosted = run.hosted()
            if now >= next_sample:
                timeline.append({"t": now - up_at, "spread": max(counts) - min(counts)})
                next_sample += interval
            if len(hosted) == plan.shards and max(counts) - min(counts) <= 1:
                balanced_at = now
                break
            if run.over_wall():
                reason = f"wall-clock limit of {plan.wall_limit:g} s reached"
                break
            for shard, entity_id in run.by_shard.items():
                if shard not in hosted and now - touched.get(shard, -math.inf) >= TOUCH_AGAIN:
                    touched[shard] = now
                    await sim.regions[1].entity_ref(entity_id).tell(worker.Add(1))
            await trio.sleep(POLL)
    if balanced_at is None and not reason:
        reason = f"not balanced within {plan.rebalance_max_intervals} rebalance intervals"
    final = sorted(run.counts().values())
    rounds: dict[float, int] = {}
    for at in moves.moves:
        key = round(at - up_at, 3)
        rounds[key] = rounds.get(key, 0) + 1
    stats = run.node1.sharding.coordinator_statistics(TYPE_NAME)
    return {
        "joined": len(new),
        "before": [before[0], before[-1]],
        "intervals": None if balanced_at is None else (balanced_at - up_at) / interval,
        "seconds": None if balanced_at is None else balanced_at - up_at,
        "reason": reason,
        "final_min_max": [final[0], final[-1]],
        "rounds_moving": [{"t": t, "shards": k} for t, k in sorted(rounds.items())],
        "rounds_asked": None if stats is None else stats.rebalance_rounds - rounds_before,
        "rebalance_interval": interval,
        "timeline": timeline,
    }


async def crashes(run: ScaleRun) -> dict[str, Any]:
    """Phase 3: ``crashes`` nodes crash at once; until every shard answers again."""
    sim, plan = run.sim, run.plan
    victims = sorted(random.Random(plan.seed).sample([i for i in sim.nodes if i > 2], plan.crashes))
    homes = {i: set(sim.regions[i].shard_entity_counts()) for i in victims}
    affected: set[str] = set().union(*homes.values())
    names = {node_name(i) for i in victims}
    crashed_at = trio.current_time()
    for i in victims:
        sim.crash(i)
    answered: dict[str, float] = {}
    failures: dict[str, int] = {}
    down_at: float | None = None
    # Each shard is asked from one of the nodes still running, in turn, as clients spread over
    # the cluster would ask (one node asking for every shard at once fills its send queue to
    # each crashed node: the transport then fails those asks at once, "send queue full").
    askers = [sim.regions[i] for i in sorted(sim.regions) if i not in victims]

    async def ask_until_answered(k: int, shard: str, entity_id: str) -> None:
        region = askers[k % len(askers)]
        while True:
            try:
                await region.entity_ref(entity_id).ask(worker.Add(1), timeout=ASK_TIMEOUT)
            except ShardingError as error:
                reason = type(error).__name__
                failures[reason] = failures.get(reason, 0) + 1
                if not isinstance(error, AskTimeout):
                    await trio.sleep(ASK_TIMEOUT)  # failed at once: try again as a client would
                continue
            answered[shard] = trio.current_time() - crashed_at
            return

    async def watch_down() -> None:
        nonlocal down_at
        while down_at is None:
            statuses = {m.node.name: m.status for m in run.node1.cluster.members}
            if all(statuses.get(name) in GONE for name in names):
                down_at = trio.current_time() - crashed_at
                return
            await trio.sleep(POLL)

    reason = ""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_down)
        for k, (shard, entity_id) in enumerate(sorted(run.by_shard.items())):
            nursery.start_soon(ask_until_answered, k, shard, entity_id)
        deadline = crashed_at + plan.crash_bound
        while len(answered) < len(run.by_shard) or down_at is None:
            if trio.current_time() >= deadline:
                reason = f"not every shard answered within {plan.crash_bound:g} simulated s"
                break
            if run.over_wall():
                reason = f"wall-clock limit of {plan.wall_limit:g} s reached"
                break
            await trio.sleep(POLL)
        nursery.cancel_scope.cancel()
    hit = sorted(answered[s] for s in affected if s in answered)
    return {
        "crashed": victims,
        "shards_on_crashed": len(affected),
        "every_shard_s": max(answered.values()) if len(answered) == len(run.by_shard) else None,
        "crashed_shards_p50_s": statistics.median(hit) if hit else None,
        "crashed_shards_max_s": hit[-1] if len(hit) == len(affected) and hit else None,
        "answered": len(answered),
        "failed_asks": failures,
        "down_seen_s": down_at,
        "reason": reason,
    }


async def size_main(n: int, plan: Plan, cpu: CoordinatorCpu, moves: MovesLog) -> dict[str, Any]:
    """One cluster of ``n`` nodes through the phases."""
    tally = Tally()
    extractor = HashExtractor(plan.shards)
    ids = entity_ids(extractor, plan.entities, plan.shards)
    by_shard: dict[str, str] = {}
    for entity_id in ids:
        by_shard.setdefault(str(extractor.shard_id(entity_id)), entity_id)  # type: ignore[arg-type]

    async def setup(i: int, node: Node, sim: Any) -> None:
        sim.regions[i] = await node.sharding.start(
            TYPE_NAME, functools.partial(ScaleEntity, tally=tally), extractor=extractor
        )

    out: dict[str, Any] = {"nodes": n, "seed": plan.seed}
    net = SimNetwork(plan.seed * 1000 + n, conditions=SIM_LINKS)
    async with trio.open_nursery() as nursery:
        # The library's split brain resolver settings, not SimCluster's short test ones: with
        # stable_after = 5 s, ten nodes crashing at once in a large cluster are detected by
        # different members over more than the 4 s of "unstable" allowed after it, and some
        # member downs the whole cluster (down-all-when-unstable), as Akka's would.
        sim = SimCluster(
            net,
            nursery,
            setup,
            links=SIM_LINKS,
            split_brain_resolver=SplitBrainResolverSettings(),
        )
        run = ScaleRun(n=n, plan=plan, sim=sim, tally=tally, by_shard=by_shard)
        try:
            started = trio.current_time()
            for i in range(1, n + 1):
                await sim.start(i)
            names = {node_name(i) for i in range(1, n + 1)}
            await run.wait_until(lambda: run.sees_up(names), FORM_BOUND, "the cluster formed")
            out["formed_s"] = trio.current_time() - started
            out["formed_wall_s"] = time.perf_counter() - run.wall
            out["cold"] = await cold_allocation(run, ids, cpu)
            if plan.churn:
                out["joins"] = await joins(run, moves)
                out["crashes"] = await crashes(run)
        except BenchmarkLimit as limit:
            out["stopped"] = str(limit)
        nursery.cancel_scope.cancel()
    out["wall_s"] = time.perf_counter() - run.wall
    return out


# ==== the run and the report ======================================================================


@contextlib.contextmanager
def quiet_logs(moves: MovesLog) -> Iterator[None]:
    """Only errors from the nodes; the coordinator's moves to ``moves``."""
    coordinator_log = logging.getLogger("p2pshard.coordinator")
    quiet = {name: logging.getLogger(name) for name in ("membership", "crdt", "p2pshard")}
    levels = {name: log.level for name, log in quiet.items()}
    saved = (coordinator_log.level, coordinator_log.propagate)
    for log in quiet.values():
        log.setLevel(logging.ERROR)
    coordinator_log.setLevel(logging.INFO)
    coordinator_log.propagate = False
    coordinator_log.addHandler(moves)
    try:
        yield
    finally:
        coordinator_log.removeHandler(moves)
        coordinator_log.setLevel(saved[0])
        coordinator_log.propagate = saved[1]
        for name, log in quiet.items():
            log.setLevel(levels[name])


def run_all(plan: Plan, *, profile: Path | None = None, progress: bool = False) -> dict[str, Any]:
    """Every cluster size in turn; the report."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    moves = MovesLog()
    sizes: list[dict[str, Any]] = []
    with quiet_logs(moves):
        for n in plan.sizes:
            progress_line(progress, f"N={n}: seed={plan.seed}, {plan.shards:,} shards")
            profiler = cProfile.Profile() if profile is not None else None
            cpu = CoordinatorCpu(profile=profiler)
            with cpu.installed(), deterministic_scheduling(plan.seed * 1000 + n):
                result = trio.run(size_main, n, plan, cpu, moves, clock=autojump_clock())
            if profiler is not None and profile is not None:
                profiler.dump_stats(profile / f"coordinator-n{n}.prof")
            result["strategy_alone"] = strategy_alone(n, plan.shards)
            cold = result.get("cold")
            if cold is not None:
                alone = result["strategy_alone"]["cpu_per_allocation_us"]
                cold["cpu_over_strategy"] = cold["coordinator_cpu_per_allocation_us"] / alone
            sizes.append(result)
            progress_line(progress, f"N={n}: {size_line(result)}")
    by_n = {r["nodes"]: r for r in sizes}
    n100 = by_n.get(100, {}).get("cold") or {}
    worst: float | None = None
    if plan.churn:
        intervals = [r.get("joins", {}).get("intervals") for r in sizes]
        worst = None if any(i is None for i in intervals) else max(intervals)
    return {
        "cold_allocation_s_n100": n100.get("cold_allocation_s"),
        "rebalance_intervals_after_10_joins": worst,
        "targets": {
            "cold_allocation_s_n100": f"<= {COLD_TARGET_S:g}",
            "rebalance_intervals_after_10_joins": f"<= {REBALANCE_TARGET:g}",
        },
        "sizes": sizes,
        "counts": attrs.asdict(plan),
        "profiled": profile is not None,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "elapsed_s": time.monotonic() - started,
    }


def size_line(result: dict[str, Any]) -> str:
    """One progress line for one cluster size."""
    cold = result.get("cold")
    parts = [f"formed in {cell(result.get('formed_s'), '.1f')} s"]
    if cold:
        parts.append(
            f"cold allocation {cell(cold['cold_allocation_s'], '.2f')} s "
            f"(one shard alone {cold['one_shard_s'] * 1e3:.0f} ms), coordinator CPU "
            f"{cold['coordinator_cpu_per_allocation_us']:.0f} us per allocation"
        )
    if "joins" in result:
        parts.append(f"balanced after {cell(result['joins']['intervals'])} intervals")
    if "crashes" in result:
        parts.append(
            f"every shard answers {cell(result['crashes']['every_shard_s'], '.1f')} s "
            "after the crashes"
        )
    if "stopped" in result:
        parts.append(f"stopped: {result['stopped']}")
    return "; ".join(parts) + f" ({result['wall_s']:.0f} s wall-clock)"


def _met(value: float | None, target: float) -> str:
    return "-" if value is None else "met" if value <= target else "NOT met"


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people: one row per cluster size (the scaling curve)."""
    counts = report["counts"]
    header = (
        "nodes",
        "one shard (s)",
        "cold alloc (s)",
        "all entities (s)",
        "coord CPU/alloc (us)",
        "strategy alone (us)",
        "ratio",
        "joins: intervals",
        "crashes: all answer (s)",
        "Down seen (s)",
        "wall (s)",
    )
    rows: list[tuple[str, ...]] = []
    for r in report["sizes"]:
        cold = r.get("cold") or {}
        join = r.get("joins") or {}
        crash = r.get("crashes") or {}
        rows.append(
            (
                str(r["nodes"]),
                cell(cold.get("one_shard_s"), ".3f"),
                cell(cold.get("cold_allocation_s"), ".2f"),
                cell(cold.get("all_entities_s"), ".2f"),
                cell(cold.get("coordinator_cpu_per_allocation_us"), ".0f"),
                cell(r["strategy_alone"]["cpu_per_allocation_us"], ".1f"),
                cell(cold.get("cpu_over_strategy"), ".0f"),
                cell(join.get("intervals")),
                cell(crash.get("every_shard_s"), ".1f"),
                cell(crash.get("down_seen_s"), ".1f"),
                f"{r['wall_s']:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    cold100 = report["cold_allocation_s_n100"]
    worst = report["rebalance_intervals_after_10_joins"]
    lines = [
        f"sharding at scale, simulated (seed {counts['seed']}): {counts['shards']:,} shards, "
        f"{counts['entities']:,} entities, then {counts['joins']} nodes join and "
        f"{counts['crashes']} crash; seconds are simulated, CPU is real",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"cold allocation at 100 nodes: {cell(cold100, '.2f')} s (target <= {COLD_TARGET_S:g}: "
        f"{_met(cold100, COLD_TARGET_S)})",
        f"rebalance intervals after the joins, worst size: {cell(worst)} (target <= "
        f"{REBALANCE_TARGET:g}: {_met(worst, REBALANCE_TARGET)})",
    ]
    for r in report["sizes"]:
        join = r.get("joins")
        if join:
            moved = ", ".join(f"{x['t']:.1f} s: {x['shards']}" for x in join["rounds_moving"])
            lines.append(
                f"  N={r['nodes']}: per region {join['before'][0]}-{join['before'][1]} shards "
                f"before the joins, {join['final_min_max'][0]}-{join['final_min_max'][1]} at the "
                "end; "
                f"rounds (s after Up: shards moved) {moved or 'none'}"
                + (f"; {join['reason']}" if join["reason"] else "")
            )
        crash = r.get("crashes")
        if crash:
            lines.append(
                f"  N={r['nodes']}: {crash['shards_on_crashed']} shards on the crashed nodes "
                f"{crash['crashed']}: p50 {cell(crash['crashed_shards_p50_s'], '.1f')} s, max "
                f"{cell(crash['crashed_shards_max_s'], '.1f')} s"
                + (f"; {crash['reason']}" if crash["reason"] else "")
            )
        if "stopped" in r:
            lines.append(f"  N={r['nodes']}: stopped: {r['stopped']}")
    lines += [
        "",
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs; 1-minute load average "
        f"before the run {report['load_average_before']:.2f}",
    ]
    if report["profiled"]:
        lines.append("profiled run: the CPU figures are not comparable with normal runs")
    return "\n".join(lines)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 3:
        raise argparse.ArgumentTypeError(
            f"want cluster sizes of 3 nodes or more, comma-separated (10,50,100), not {text!r}"
        )
    return sizes


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="10 and 20 nodes, 1,000 shards; under 2 minutes")
    parser.add_argument("--seed", type=int, default=1, help="seed of the simulation (default 1)")
    parser.add_argument("--nodes", type=_sizes, help="cluster sizes, e.g. 10,50,100")
    parser.add_argument("--shards", type=int, help="number of shards")
    parser.add_argument("--entities", type=int, help="entities told once at the cold start")
    parser.add_argument(
        "--cold-only", action="store_true", help="measure the cold allocation only (no churn)"
    )
    parser.add_argument(
        "--profile", type=Path, help="cProfile the coordinator's handling into this directory"
    )
    args = parser.parse_args(argv)
    for name in ("shards", "entities"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be 1 or more, not {value}")
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    plan = make_plan(
        quick=args.quick,
        seed=args.seed,
        sizes=args.nodes,
        churn=not args.cold_only,
        shards=args.shards,
        entities=args.entities,
    )
    if plan.entities < plan.shards:
        parser.error(f"--entities ({plan.entities}) must cover every shard ({plan.shards})")
    return run_and_print(
        lambda: run_all(plan, profile=args.profile, progress=not args.json),
        format_table,
        as_json=args.json,
        stopped="the simulation stopped",
    )


if __name__ == "__main__":
    sys.exit(main())
