"""Failover benchmark: how long the shards of a lost node stay unavailable, on real hosts.

How to run it (from the project root, as root: it builds network namespaces)::

    .venv/bin/python -m benchmarks.failover            # full run, about 15 minutes
    .venv/bin/python -m benchmarks.failover --quick    # 2 faults and 1 leave a profile, ~4 min
    .venv/bin/python -m benchmarks.failover --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.failover --dir D    # keep the node logs and histories in D

Progress lines go to stderr unless ``--json``.
``--profiles fast-lan`` measures one profile, ``--faults N --leaves N`` change the counts. The
exit status is 1 when an entity ran twice at once (a double activation) or a measurement failed.
Without root (or with ``--loopback``) every node runs on 127.0.0.1 instead, and every fault is a
``kill -9`` (partitions need the namespaces); the report says so on its second line.

The cluster. Five node processes (``p2pshard.testing._real_node``), each in a network namespace
of its own on one bridge (``p2pshard.testing._netns``), with mutual TLS between them, shard
leases on in one SQLite file, and the counters event-sourced in one SQLite journal: every
``Add`` is an event, and a counter that starts elsewhere first reads its events back. Nodes 1
and 2 are the seed nodes; node 1 forms the cluster, so it is the oldest member (the shard
coordinator runs there) and, with the lowest address, the leader. Load: on every node a client
sends ``Add`` asks to 20 counters (one every 0.2 s on average), and a probe client asks one
*probe entity* of each of the 50 shards (``HashExtractor(50)``) every 0.5 s, each ask with a
5 s time-out, without waiting for the previous answer, so with five nodes a shard is asked about
every 0.1 s. The probe entity answers with the name of the node it runs on, and each probe
client writes down when a shard is first answered by another node than before (and when it last
heard from the one before). The whole run is done twice, once per *profile* (see
``p2pshard.FailoverProfile``): ``default`` (``NodeConfig()`` and ``ShardingSettings()``: failure
detection about 4.5 s after the last heartbeat, ``stable_after`` 20 s, leases of 15 s renewed
every 3 s, a shard asks again for a lease every 5 s, the coordinator's writes wait up to 5 s) and
``fast-lan`` (``p2pshard.FAST_LAN``: about 1.8 s, 1 s, 3 s leases renewed every 0.5 s, 0.5 s,
0.25 s; see ``docs/operations.md``). Rebalancing runs every 5 s in both (it only brings the
cluster back into balance between faults).

Faults, per profile: ``faults`` times (10 in the full run), alternately ``kill -9`` of one node
process and a *partition* that cuts one node off from the four others (nftables drops in the
namespaces, both ways; the lease and journal files stay reachable to it, as on one host). The
victim is one of nodes 2 to 5 in turn (not node 1, where the coordinator runs: then the
coordinator would move too, a longer and different failover), and hosts about a fifth of the
shards: before each fault the benchmark waits until all five nodes are one cluster and each
hosts 8 to 12 of the 50 shards. For each shard the victim hosted, its *unavailability* is the
time from the fault until a probe of that shard is first answered by another node (as any
surviving node's probe client saw it; the probes' spacing makes each figure up to about 0.1 s
late). Then the victim is started again (a partitioned victim
first downs itself and exits, as ``p2pshard node`` does; then the partition heals).

Graceful leave, per profile: ``leaves`` times (3), SIGTERM to one of nodes 2 to 5: it hands its
shards off and leaves. For each of its shards the unavailability is the time from the last
answer by the leaving node to the first answer by the new home (as the surviving nodes' probe
clients saw them: the latest of their last answers from the old home, the earliest of their
first answers from the new one).

Baselines, measured in the same run:

- For a kill or a partition, *membership's share*: the time from the fault until a surviving
  node first sees the victim Down (the leader's decision, gossiped; the nodes' ``members``
  lines, looked at every 0.2 s). Everything sharding adds (the coordinator's majority writes,
  asking for a home, the lease, the journal recovery) is the rest; ``ratio`` is the median over
  faults of (the median unavailability of the fault's shards / its Down time), so 1.0 would
  mean that sharding adds nothing. Shown beside it is the profile's configured floor,
  ``FailoverProfile.floor()``: the detection time after the last heartbeat of a steady history
  plus ``stable_after``.
- For a graceful leave: the hand-off of a shard moved by the rebalancer in the same run (while
  the cluster gets back into balance after a fault, measured the same way, from the last answer
  by the old home to the first by the new one); ``ratio`` = leave p50 / rebalance hand-off p50.

Safety: after each profile every process is stopped and the histories are merged; the
single-activation checker (``p2pshard.testing.check_single_activation``) counts double
activations over the whole run, and must find none (the other history checkers and the
single-cluster check are reported too).

JSON keys: ``default_p99_s`` and ``fast_p99_s`` (the unavailability after a kill or a partition,
p99 over every shard of every fault of the profile), ``double_activations`` (both profiles),
``leave_unavailable_p99_s`` (graceful leave, p99 over both profiles' samples), ``targets_met``,
and the details per profile under ``profiles`` (every fault's victim, Down time and per-shard
unavailability among them).

Targets (issue 19): defaults p99 <= 30 s, fast-lan p99 <= 5 s, graceful leave p99 <= 1 s,
double activations 0.

Every wait has a time limit and every loop a bound; a step that misses its limit aborts the
benchmark with an error naming it (the data directory is then kept, and named).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

from benchmarks._process import BenchmarkError
from benchmarks._report import benchmark_parser, cell, median, p99, progress_line, run_and_print
from membership import SplitBrainResolverSettings, TransportSettings
from membership._cluster_settings import ClusterSettings
from membership._failure_detector import FailureDetectorSettings
from p2pshard import FAST_LAN, FailoverProfile, LeaseSettings
from p2pshard.testing import check_history, check_single_activation
from p2pshard.testing._netns import netns_unavailable
from p2pshard.testing._netns_cluster import (
    NetnsCluster,
    NetnsClusterSettings,
    NetnsTimeout,
    check_single_cluster,
    open_netns_cluster,
)
from p2pshard.testing._real_node import probe_entities
from p2pshard.testing._workload import COUNTER

NODES = 5
VICTIMS = (2, 3, 4, 5)
SEED = 19
"""Seeds the workload clients' choices (the faults are not random)."""
ENTITIES = 20
REBALANCE_INTERVAL = 5.0

TARGETS = {"default": 30.0, FAST_LAN.name: 5.0}
"""p99 targets of the unavailability after a kill or a partition, per profile (issue 19)."""

PROFILES = {"default": FailoverProfile.defaults(), FAST_LAN.name: FAST_LAN}
"""The profiles measured, in order."""


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    shards: int
    faults: int
    """Kills and partitions per profile, alternately."""
    leaves: int
    """Graceful leaves per profile."""
    probe_interval: float
    """Seconds between one node's probes of one shard."""
    message_interval: float
    """Mean seconds between one node's workload asks."""
    form_limit: float = 120.0
    """Seconds the five processes may take to form one cluster."""
    settle_limit: float = 240.0
    """Seconds the cluster may take to be one and balanced again after a fault."""


def make_plan(*, quick: bool) -> Plan:
    """The quick plan: 2 faults and a leave per profile; the full one: 10 faults and 3 leaves."""
    return Plan(
        shards=50,
        faults=2 if quick else 10,
        leaves=1 if quick else 3,
        probe_interval=0.5,
        message_interval=0.2,
    )


@attrs.frozen(kw_only=True)
class Fault:
    """One fault and what it cost: unavailability per shard the victim hosted."""

    kind: str
    """``kill``, ``partition`` or ``leave``."""
    victim: int
    at: float
    """CLOCK_MONOTONIC time of the fault."""
    unavailable: dict[str, float]
    """Shard → seconds."""
    down_seen: float | None = None
    """Seconds from the fault until a surviving node saw the victim Down (kills, partitions)."""


@attrs.define
class ProfileRun:
    """What one profile's cluster did."""

    profile: FailoverProfile
    faults: list[Fault] = attrs.field(factory=list)
    handoffs: list[float] = attrs.field(factory=list)
    """Rebalance hand-offs while the cluster got back into balance: seconds unavailable each."""
    rtts: list[float] = attrs.field(factory=list)
    double_activations: list[str] = attrs.field(factory=list)
    other_violations: list[str] = attrs.field(factory=list)
    incarnations: int = 0
    acknowledged: int = 0
    sent: int = 0
    elapsed: float = 0.0


def node_name(i: int) -> str:
    """Node ``i``'s name."""
    return NetnsCluster.name(i)


def cluster_settings(profile: FailoverProfile, plan: Plan) -> NetnsClusterSettings:
    """Five event-sourced counter nodes with ``profile``'s timing, defaults otherwise."""
    options = [
        "--probe-interval",
        str(plan.probe_interval),
        "--lease-retry-interval",
        str(profile.lease_retry_interval),
        "--retry-interval",
        str(profile.retry_interval),
        "--state-timeout",
        str(profile.state_timeout),
        "--rebalance-interval",
        str(REBALANCE_INTERVAL),
    ]
    return NetnsClusterSettings(
        nodes=NODES,
        seeds=(1, 2),
        use_lease=True,
        leases=profile.lease_settings(LeaseSettings()),
        cluster=attrs.evolve(
            ClusterSettings(),
            gossip_interval=profile.gossip_interval,
            leader_actions_interval=profile.leader_actions_interval,
        ),
        failure_detector=profile.failure_detector(FailureDetectorSettings()),
        split_brain_resolver=SplitBrainResolverSettings(stable_after=profile.stable_after),
        transport=TransportSettings(),
        entities=ENTITIES,
        shards=plan.shards,
        clients_per_node=1,
        message_interval=plan.message_interval,
        event_sourced=True,
        node_options=tuple(options),
        log_level="INFO",
        shutdown_timeout=10.0,
    )


# ==== observing the cluster ======================================================================


def shard_of(shards: int) -> dict[str, str]:
    """Probe entity key (``Counter/probe-N``) → its shard."""
    return {f"{COUNTER}/{entity}": shard for shard, entity in probe_entities(shards).items()}


def hosting(cluster: NetnsCluster, shards: dict[str, str]) -> dict[int, set[str]]:
    """Node → the shards whose probe entity runs in its current process."""
    found: dict[int, set[str]] = {}
    for i in cluster.nodes:
        run = cluster.current.get(i)
        keys = cluster.incarnations_of(run) if run is not None and run.running else set()
        found[i] = {shards[key] for key in keys if key in shards}
    return found


def balanced(cluster: NetnsCluster, shards: dict[str, str]) -> bool:
    """One cluster of all five, every shard hosted once, each node 8 to 12 of 50 (a fifth ±2)."""
    if not cluster.one_cluster(cluster.nodes):
        return False
    hosted = hosting(cluster, shards)
    counts = [len(s) for s in hosted.values()]
    fifth = len(shards) / NODES
    every = set().union(*hosted.values())
    return (
        sum(counts) == len(shards)
        and len(every) == len(shards)
        and all(fifth - 2 <= c <= fifth + 2 for c in counts)
    )


def probe_lines(cluster: NetnsCluster, nodes: list[int], marks: dict[int, int]) -> Iterator[Any]:
    """The ``probe`` lines of ``nodes``' current processes read since ``marks`` (indexes)."""
    for i in nodes:
        run = cluster.current[i]
        for event in run.events[marks.get(i, 0) :]:
            if event["e"] == "probe":
                yield event


def marks_now(cluster: NetnsCluster) -> dict[int, int]:
    """How many lines of each current process were read so far."""
    return {i: len(run.events) for i, run in cluster.current.items()}


def first_answers(
    cluster: NetnsCluster, observers: list[int], marks: dict[int, int], since: float, old: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Per shard: the first answer by a node other than ``old`` after ``since`` (earliest over
    ``observers``), and the last answer by ``old`` before it (latest over them)."""
    first: dict[str, float] = {}
    last_old: dict[str, float] = {}
    for event in probe_lines(cluster, observers, marks):
        t, shard = float(event["t"]), str(event["shard"])
        if t <= since or event["by"] == old:
            continue
        first[shard] = min(first.get(shard, math.inf), t)
        if event["prev_by"] == old and event["prev_t"] is not None:
            last_old[shard] = max(last_old.get(shard, -math.inf), float(event["prev_t"]))
    return first, last_old


def down_seen(cluster: NetnsCluster, observers: list[int], victim_uid: str, since: float) -> float:
    """When a node of ``observers`` first saw ``victim_uid`` Down or removed (inf: not yet)."""
    seen = math.inf
    for i in observers:
        for view in cluster.current[i].views:
            if view.t <= since:
                continue
            statuses = {uid: status for _, uid, status in view.members}
            if statuses.get(victim_uid, "down") in ("down", "removed"):
                seen = min(seen, view.t)
                break
    return seen


def handoff_gaps(cluster: NetnsCluster, marks: dict[int, int], since: float) -> list[float]:
    """Seconds each shard that moved from one running node to another was unavailable.

    For shards moved by the rebalancer: per (shard, new home), from the latest last answer by
    the old home to the earliest first answer by the new one, over every node's probe client.
    Only moves whose old home answered after ``since`` count: a probe client that heard of a
    shard's new home only after the failover's measurement ended is not a hand-off.
    """
    first: dict[tuple[str, str], float] = {}
    last_old: dict[tuple[str, str], float] = {}
    for event in probe_lines(cluster, cluster.nodes, marks):
        if event["prev_by"] is None or event["prev_t"] is None or event["prev_t"] < since:
            continue
        key = (str(event["shard"]), str(event["by"]))
        first[key] = min(first.get(key, math.inf), float(event["t"]))
        last_old[key] = max(last_old.get(key, -math.inf), float(event["prev_t"]))
    return [max(0.0, first[key] - last_old[key]) for key in first]


def rtt_samples(cluster: NetnsCluster, marks: dict[int, int]) -> list[float]:
    """The probes' round trips sampled since ``marks`` (a quiet, balanced cluster)."""
    return [
        float(event["rtt"])
        for i in cluster.nodes
        for event in cluster.current[i].events[marks.get(i, 0) :]
        if event["e"] == "probe-rtt"
    ]


# ==== the run ====================================================================================


async def settle(
    cluster: NetnsCluster, shards: dict[str, str], plan: Plan, run: ProfileRun
) -> None:
    """Wait until the cluster is one and balanced; record the rebalance hand-offs meanwhile."""
    marks, since = marks_now(cluster), time.monotonic()
    took = await cluster.wait_until(
        lambda: balanced(cluster, shards),
        "all five one cluster, each hosting 8-12 shards",
        plan.settle_limit,
    )
    await trio.sleep(2.0)  # quiet: the probes' answers after the last move are in
    run.handoffs += handoff_gaps(cluster, marks, since)
    cluster.note(f"balanced after {took:.1f} s")
    quiet = marks_now(cluster)
    await trio.sleep(3.0)
    run.rtts += rtt_samples(cluster, quiet)


async def fault(
    cluster: NetnsCluster,
    shards: dict[str, str],
    kind: str,
    victim: int,
    limit: float,
    progress: bool,
) -> Fault:
    """Kill, cut off or stop ``victim``; wait until each of its shards is answered elsewhere."""
    run = cluster.current[victim]
    hosted = hosting(cluster, shards)[victim]
    if not hosted:
        raise BenchmarkError(f"{run.label} hosts no shard before the {kind}")
    view = run.view
    assert view is not None
    survivors = [i for i in cluster.nodes if i != victim]
    old = node_name(victim)
    marks = marks_now(cluster)
    at = time.monotonic()
    if kind == "kill":
        cluster.kill(victim)
    elif kind == "partition":
        cluster.partition([victim])
    else:
        cluster.terminate(victim)

    def answered() -> bool:
        first, _ = first_answers(cluster, survivors, marks, at, old)
        return hosted <= first.keys()

    await cluster.wait_until(
        answered, f"every shard of {run.label} ({sorted(hosted)}) answers again", limit
    )
    first, last_old = first_answers(cluster, survivors, marks, at, old)
    if kind == "leave":
        unavailable = {s: max(0.0, first[s] - last_old.get(s, at)) for s in hosted}
        seen = None
    else:
        unavailable = {s: first[s] - at for s in hosted}
        down = down_seen(cluster, survivors, view.self_uid, at)
        seen = down - at if math.isfinite(down) else None
    result = Fault(kind=kind, victim=victim, at=at, unavailable=unavailable, down_seen=seen)
    values = sorted(unavailable.values())
    progress_line(
        progress,
        f"  {kind} {run.label}: {len(values)} shards unavailable "
        f"{values[0]:.2f}-{values[-1]:.2f} s"
        + ("" if seen is None else f" (Down seen after {seen:.2f} s)"),
    )
    return result


async def recover(cluster: NetnsCluster, kind: str, victim: int, limit: float) -> None:
    """Bring ``victim`` back: a partitioned one exits first (downed), then the network heals."""
    if kind == "partition":
        await cluster.wait_exit(victim, within=limit)
        cluster.heal()
    elif kind == "leave":
        await cluster.wait_exit(victim, within=limit)
    cluster.start(victim)


async def measure_profile(
    profile: FailoverProfile, plan: Plan, data_dir: Path, progress: bool, loopback: bool
) -> ProfileRun:
    """One cluster with ``profile``'s timing: its faults and leaves, then the checkers."""
    started = time.monotonic()
    run = ProfileRun(profile)
    shards = shard_of(plan.shards)
    limit = 4 * profile.floor() + 4 * profile.lease_ttl + 30.0
    settings = cluster_settings(profile, plan)
    async with open_netns_cluster(settings, data_dir, seed=SEED, loopback=loopback) as cluster:
        cluster.start_all()
        took = await cluster.wait_one_cluster(within=plan.form_limit)
        progress_line(progress, f"{profile.name}: one cluster of five after {took:.1f} s")
        await settle(cluster, shards, plan, run)
        cut = "kill" if loopback else "partition"  # no partitions without namespaces
        schedule = [("kill" if k % 2 == 0 else cut, k // 2) for k in range(plan.faults)]
        schedule += [("leave", k) for k in range(plan.leaves)]
        for n, (kind, k) in enumerate(schedule):
            victim = VICTIMS[k % len(VICTIMS)] if kind != "leave" else VICTIMS[-1 - k % 4]
            progress_line(progress, f"{profile.name}: fault {n + 1}/{len(schedule)}")
            run.faults.append(await fault(cluster, shards, kind, victim, limit, progress))
            await recover(cluster, kind, victim, limit)
            await settle(cluster, shards, plan, run)
    merged = cluster.merged()
    history = merged.history
    run.double_activations = [str(v) for v in check_single_activation(history)]
    others = [v for v in check_history(history) if v.invariant != "single-activation"]
    others += check_single_cluster(cluster.runs, origin=cluster.origin)
    run.other_violations = [str(v) for v in others]
    run.incarnations = merged.incarnations
    run.sent = len(history.messages)
    run.acknowledged = history.acknowledged_count()
    run.elapsed = time.monotonic() - started
    return run


# ==== the report =================================================================================


def summary(samples: list[float]) -> dict[str, Any]:
    """Count, p50, p99 and max of ``samples`` (seconds)."""
    return {
        "samples": len(samples),
        "p50_s": median(samples),
        "p99_s": p99(samples),
        "max_s": max(samples) if samples else math.nan,
    }


def profile_report(run: ProfileRun) -> dict[str, Any]:
    """One profile's figures."""
    lost = [f for f in run.faults if f.kind != "leave"]
    leaves = [f for f in run.faults if f.kind == "leave"]
    by_kind: dict[str, Any] = {}
    for kind in ("kill", "partition"):
        faults = [f for f in lost if f.kind == kind]
        by_kind[kind] = summary([v for f in faults for v in f.unavailable.values()])
        by_kind[kind]["faults"] = len(faults)
    samples = [v for f in lost for v in f.unavailable.values()]
    downs = [f.down_seen for f in lost if f.down_seen is not None]
    ratios = [
        median(list(f.unavailable.values())) / f.down_seen
        for f in lost
        if f.down_seen is not None and f.down_seen > 0
    ]
    added = [
        v - f.down_seen for f in lost if f.down_seen is not None for v in f.unavailable.values()
    ]
    leave_samples = [v for f in leaves for v in f.unavailable.values()]
    profile = run.profile
    return {
        "settings": attrs.asdict(profile),
        "floor_s": profile.floor(),
        "unavailable": summary(samples),
        "by_kind": by_kind,
        "down_seen": summary(downs),
        "ratio_unavailable_over_down": median(ratios),
        "added_by_sharding": summary(added),
        "leave": {**summary(leave_samples), "leaves": len(leaves)},
        "rebalance_handoff": summary(run.handoffs),
        "leave_ratio_over_handoff": median(leave_samples) / median(run.handoffs)
        if run.handoffs and leave_samples
        else math.nan,
        "probe_rtt_ms_p50": median(run.rtts) * 1e3,
        "double_activations": len(run.double_activations),
        "double_activation_details": run.double_activations[:20],
        "other_violations": run.other_violations[:20],
        "incarnations": run.incarnations,
        "sent": run.sent,
        "acknowledged": run.acknowledged,
        "elapsed_s": run.elapsed,
        "faults": [
            {
                "kind": f.kind,
                "victim": node_name(f.victim),
                "down_seen_s": f.down_seen,
                "unavailable_s": dict(sorted(f.unavailable.items(), key=lambda kv: int(kv[0]))),
            }
            for f in run.faults
        ],
    }


def run_all(
    plan: Plan,
    profiles: list[FailoverProfile],
    *,
    progress: bool,
    keep: Path | None,
    loopback: bool = False,
) -> dict[str, Any]:
    """The profiles, one after the other; the report."""
    reason = "--loopback" if loopback else netns_unavailable()
    network = "network namespaces on a bridge"
    if reason is not None:
        loopback = True
        network = f"127.0.0.1, kill -9 only: no partitions without namespaces ({reason})"
        progress_line(progress, f"NOTE: every node on {network}")
    load = os.getloadavg()[0]
    started = time.monotonic()
    root = keep or Path(tempfile.mkdtemp(prefix="p2pshard-failover-"))
    failed = True
    runs: list[ProfileRun] = []
    sink = sys.stderr if progress else io.StringIO()
    try:
        with contextlib.redirect_stdout(sink):  # the harness notes what it does on stdout
            for profile in profiles:
                progress_line(progress, f"{profile.name}: {profile.floor():.1f} s floor")
                runs.append(
                    trio.run(
                        measure_profile, profile, plan, root / profile.name, progress, loopback
                    )
                )
        failed = False
    except NetnsTimeout as exc:
        raise BenchmarkError(str(exc)) from None
    finally:
        if failed or keep is not None:
            print(f"node logs and histories kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    reports = {run.profile.name: profile_report(run) for run in runs}
    leaves = [
        v for run in runs for f in run.faults if f.kind == "leave" for v in f.unavailable.values()
    ]
    doubles = sum(len(run.double_activations) for run in runs)
    targets = {
        f"{name}_p99": verdict(p["unavailable"]["p99_s"], TARGETS[name]) == "met"
        for name, p in reports.items()
    }
    targets["leave_p99"] = verdict(p99(leaves), 1.0) == "met"
    targets["double_activations"] = doubles == 0
    return {
        "default_p99_s": reports.get("default", {}).get("unavailable", {}).get("p99_s", math.nan),
        "fast_p99_s": reports.get(FAST_LAN.name, {}).get("unavailable", {}).get("p99_s", math.nan),
        "double_activations": doubles,
        "leave_unavailable_p99_s": p99(leaves),
        "targets_met": targets,
        "profiles": reports,
        "network": network,
        "plan": attrs.asdict(plan),
        "elapsed_s": time.monotonic() - started,
        "cpus": os.cpu_count(),
        "load_average_before": load,
    }


def verdict(value: float | None, target: float) -> str:
    """``met`` when ``value`` is at most ``target``; ``NOT met``; ``-`` for no figure."""
    if value is None or math.isnan(value):
        return "-"
    return "met" if value <= target else "NOT met"


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    header = ("figure", "samples", "p50", "p99", "max", "baseline (same run)", "ratio", "target")
    rows: list[tuple[str, ...]] = []

    def row(
        label: str, stats: dict[str, Any], baseline: str = "", ratio: str = "", target: str = ""
    ) -> None:
        figures = (cell(stats["p50_s"]), cell(stats["p99_s"]), cell(stats["max_s"]))
        rows.append((label, str(stats["samples"]), *figures, baseline, ratio, target))

    for name, p in report["profiles"].items():
        u, d = p["unavailable"], p["down_seen"]
        target = TARGETS[name]
        row(
            f"{name}: kill -9 or partition, unavailable (s)",
            u,
            f"Down seen {cell(d['p50_s'])} / {cell(d['p99_s'])}; floor {p['floor_s']:.2f}",
            cell(p["ratio_unavailable_over_down"]),
            f"p99 <= {target:g}  {verdict(u['p99_s'], target)}",
        )
        for kind, k in p["by_kind"].items():
            row(f"    {kind} ({k['faults']} faults)", k)
        row("    after the Down (sharding's share)", p["added_by_sharding"])
        h = p["rebalance_handoff"]
        row(
            f"{name}: graceful leave, unavailable (s)",
            p["leave"],
            f"rebalance hand-off {cell(h['p50_s'])} / {cell(h['p99_s'])}",
            cell(p["leave_ratio_over_handoff"]),
        )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:-1], widths[1:-1], strict=True))
        return f"{first}  {rest}  {cells[-1]}".rstrip()

    leave = report["leave_unavailable_p99_s"]
    doubles = report["double_activations"]
    lines = [
        "failover benchmark: 5 node processes, TLS, shard leases, event-sourced counters; "
        "baselines: Down seen by a survivor (kills, partitions), a rebalance hand-off (leaves)",
        f"nodes on {report['network']}",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"graceful leave p99 over both profiles: {cell(leave)} s (target <= 1 s: "
        f"{verdict(leave, 1.0)})",
        f"double activations: {doubles} (target 0: {'met' if doubles == 0 else 'NOT met'}); "
        + "; ".join(
            f"{name}: {p['incarnations']} incarnations, {p['acknowledged']}/{p['sent']} asks "
            f"acknowledged, other violations {len(p['other_violations'])}"
            for name, p in report["profiles"].items()
        ),
        f"total {report['elapsed_s'] / 60:.1f} min on {report['cpus']} CPUs; 1-minute load "
        f"average before the run {report['load_average_before']:.2f}",
    ]
    for name, p in report["profiles"].items():
        for text in p["double_activation_details"] + p["other_violations"]:
            lines.append(f"{name}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="2 faults and 1 leave a profile")
    parser.add_argument("--dir", type=Path, help="keep the node logs and histories here")
    parser.add_argument(
        "--profiles",
        default=",".join(PROFILES),
        help=f"the profiles to measure, comma-separated (default {','.join(PROFILES)})",
    )
    parser.add_argument("--faults", type=int, help="kills and partitions per profile")
    parser.add_argument("--leaves", type=int, help="graceful leaves per profile")
    parser.add_argument(
        "--loopback",
        action="store_true",
        help="every node on 127.0.0.1, kill -9 only (what a run without root does)",
    )
    args = parser.parse_args(argv)
    plan = make_plan(quick=args.quick)
    if args.faults is not None:
        plan = attrs.evolve(plan, faults=args.faults)
    if args.leaves is not None:
        plan = attrs.evolve(plan, leaves=args.leaves)
    names = [name.strip() for name in args.profiles.split(",") if name.strip()]
    unknown = [name for name in names if name not in PROFILES]
    if unknown or not names:
        parser.error(
            f"--profiles {args.profiles!r}: choose from {', '.join(PROFILES)} (comma-separated)"
        )
    profiles = [PROFILES[name] for name in names]
    report: dict[str, Any] = {}

    def run() -> dict[str, Any]:
        report.update(
            run_all(plan, profiles, progress=not args.json, keep=args.dir, loopback=args.loopback)
        )
        return report

    status = run_and_print(
        run, format_table, as_json=args.json, stopped="node processes killed, namespaces removed"
    )
    if status == 0 and report["double_activations"]:
        print(
            f"FAILED: {report['double_activations']} double activation(s): an entity ran on "
            "two nodes at once (see the lines above)",
            file=sys.stderr,
        )
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
