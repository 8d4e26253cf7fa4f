"""Sharding benchmark: entity messaging, activation, memory and rebalancing against baselines.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.sharding            # full run, a few minutes
    .venv/bin/python -m benchmarks.sharding --quick    # smaller counts, well under a minute
    .venv/bin/python -m benchmarks.sharding --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.sharding --quick --profile /tmp/prof
        # also cProfile the node processes during the measured steps, into /tmp/prof/*.prof
        # (read with: python -m pstats FILE); profiling slows them, so the figures printed in
        # that mode are not comparable with normal runs
    .venv/bin/python -m benchmarks.sharding --quick --management
        # every node also serves [management] on a free port, and its GET /metrics is fetched
        # every second (--scrape-interval) for its whole life: run it paired with a plain run
        # to see what the endpoint and the metrics cost

Progress lines go to stderr unless ``--json``.

Node processes are ``benchmarks/_sharding_worker.py`` (one ``p2pshard.open_node`` each, mutual
TLS 1.3 on 127.0.0.1 with certificates made for the run, default settings unless said), driven by
JSON lines from this process. The entity type is ``Counter`` (``HashExtractor``; an entity counts
its messages, an ask gets the count back; the message is a registered attrs class ``Add(n)``).
Every measured figure is printed beside its baseline, measured in the same run and, for the
two-process figures, in the same processes; a ratio is the median of per-run ratios, each from a
pair measured back to back (this shared machine's speed drifts).

(a) ``local_tell_ratio``: one node (a one-member cluster: it joins itself). One task tells
    N messages round robin to 10,000 entities that were activated beforehand (100 shards), and
    the clock stops when the entities have handled the last one; baseline: the same N messages
    from one task to another through a ``trio.open_memory_channel(1024)``. Rate ratio, target
    >= 0.5. Runs alternate (baseline first, then ours first).
(b) Two processes, A and B. B has role ``host`` and hosts every entity (and the coordinator);
    A starts the type without the role, so it gets a proxy: every message goes over TLS.
    ``remote_tell_ratio``: A tells N messages round robin to 1,000 warm entities; B's rate from
    the end of the warm-up to the last message handled (as the transport benchmark's receiver
    counts), over ``benchmarks/transport.py``'s "ours" one-way throughput with a payload sized
    so that its frame is as large as the tell's ``EntityDelivery`` frame; target >= 0.6.
    ``remote_ask_ratio``: sequential asks per second (A to B's entities, one in flight) over the
    transport ping-pong's round trips per second (one 100-byte message in flight, echoed);
    target >= 0.7. Also reported: ask p50/p99, and 16 concurrent askers (rate, p50/p99).
(c) ``first_message_rtts``: A asks an entity of a shard never used before, so its region asks
    the coordinator on B (which writes the allocation to the replicator, a majority of both
    nodes) before the message goes; p50 of that latency over the p50 of one round trip in the
    same conditions (an ask to a warm entity on B, after the same pause: idle processes take
    longer to wake than a busy ping-pong, for both); target <= 3, which is the least the
    protocol allows (GetShardHome, the majority write, ShardHome, the message and its answer).
    The ratio to the busy transport ping-pong is shown too. Each sample waits a pause first
    (0.25 s); a few "back to back" samples (no pause) are reported apart.
(d) One node (a one-member cluster), ``passivate_idle_after=None``, 100 shards all hosted
    first: one task tells once to each of 1,000,000 new entity ids (100,000 with ``--quick``);
    ``activations_per_s`` = entities / seconds until the last one handled its message (target
    >= 50,000); ``bytes_per_idle_entity`` = growth of VmRSS (after ``gc.collect()``) / entities
    (target <= 1,000). Fresh process.
(e) ``rebalance_intervals_to_balance``: on ``SimNetwork`` with ``MockClock(autojump_threshold=0)``
    and ``deterministic_scheduling(seed)`` (seed printed): three nodes, 1,000 shards all hosted
    (one entity touched per shard), then, after a pause drawn from the seed (uniform within one
    rebalance interval: the join falls anywhere in the coordinator's cycle of rounds), a fourth
    node joins. Simulated time from the moment the coordinator's node sees the fourth Up until
    every shard is hosted and the shards per region differ by at most one (what
    ``LeastShardAllocationStrategy`` stops at, either algorithm), in
    ``ShardingSettings.rebalance_interval`` units, with the library's default strategy and
    settings; target <= 2. One run per seed (1 with ``--quick``, 1 to 5 in a full run); the
    median is reported. A shard handed off is hosted again only when a message asks for it: the
    benchmark tells one entity of every shard that no region hosts, every 0.05 s (at most once
    a second per shard), as steady traffic to every shard would. The spread is sampled at every
    interval, and the rounds (with the shards each moved) come from the coordinator's log; if
    the cap is reached, the report says what spread was reached and projects the rounds left
    from the shards moved per round.

Every wait has a time limit and every loop a bound; a node process that fails, exits or misses a
limit aborts the benchmark with an error naming it and the tail of its log. Node processes are
killed on every exit path (Ctrl-C included), and end by themselves when this process goes away
(their stdin closes) or after a hard lifetime.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from benchmarks import _sharding_worker as worker
from benchmarks import transport as transport_bench
from benchmarks._process import BenchmarkError, CommandProcess
from benchmarks._report import benchmark_parser, progress_line
from membership import (
    Address,
    LinkConditions,
    SimNetwork,
    deterministic_scheduling,
)
from membership._member import MemberStatus
from membership.transport import _wire
from p2pshard import (
    HashExtractor,
    LeastShardAllocationStrategy,
    Node,
    NodeConfig,
    ShardingSettings,
    TlsFiles,
    open_node,
)
from p2pshard.sharding._extractor import stable_shard
from p2pshard.sharding._protocol import EntityDelivery
from p2pshard.sharding._region import ShardRegion
from p2pshard.testing import free_port

HOST = worker.HOST
LOCAL_SHARDS = 100
REMOTE_SHARDS = 200
"""Shards of the two-process cluster: entities measured in the first half, first messages go
to the second half (never used before)."""
CONCURRENT_ASKERS = 16
FIRST_PAUSE = 0.25
"""Seconds before each first-message sample: longer than the singleton proxy's 0.1 s pause."""
PINGPONG_SIZE = 100

LOCAL_TELL_TARGET = 0.5
REMOTE_TELL_TARGET = 0.6
REMOTE_ASK_TARGET = 0.7
FIRST_MESSAGE_TARGET = 3.0
BYTES_PER_ENTITY_TARGET = 1000.0
ACTIVATIONS_TARGET = 50_000.0
REBALANCE_TARGET = 2.0

REBALANCE_NODES = 3
REBALANCE_SHARDS = 1000
REBALANCE_POLL = 0.05
"""Simulated seconds between checks of the shards hosted per region."""
REBALANCE_TOUCH_AGAIN = 1.0
"""Simulated seconds before an unhosted shard is told again."""
SIM_HOST = "10.0.0.1"
SIM_TLS = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))

_PARENT_POLL = 0.25


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    local_entities: int
    local_count: int
    local_repeats: int
    remote_repeats: int
    remote_entities: int
    tell_count: int
    tell_warmup: int
    pingpong_count: int
    pingpong_warmup: int
    ask_count: int
    ask_warmup: int
    concurrent_count: int
    first_samples: int
    first_back_to_back: int
    idle_entities: int
    rebalance_seeds: tuple[int, ...]
    rebalance_max_intervals: int
    rebalance_wall_limit: float
    step_timeout: float
    """Seconds any one command to a node process may take."""
    lifetime: float
    """Hard limit on a node process's life, in seconds."""
    scrape_interval: float | None = None
    """``--management``: every node serves ``[management]`` and its metrics are fetched every
    so many seconds (None: no management endpoint, the default)."""


def make_plan(*, quick: bool, seed: int | None, scrape_interval: float | None = None) -> Plan:
    """The quick plan takes well under a minute on two cores; the full one a few minutes."""
    seeds = (seed,) if seed is not None else (1,) if quick else (1, 2, 3, 4, 5)
    return Plan(
        local_entities=10_000,
        local_count=20_000 if quick else 100_000,
        local_repeats=3 if quick else 5,
        remote_repeats=2 if quick else 5,
        remote_entities=1_000,
        tell_count=15_000 if quick else 100_000,
        tell_warmup=5_000 if quick else 20_000,
        pingpong_count=600 if quick else 3_000,
        pingpong_warmup=100 if quick else 300,
        ask_count=600 if quick else 3_000,
        ask_warmup=100 if quick else 300,
        concurrent_count=1_600 if quick else 16_000,
        first_samples=5 if quick else 20,
        first_back_to_back=2 if quick else 5,
        idle_entities=100_000 if quick else 1_000_000,
        rebalance_seeds=seeds,
        rebalance_max_intervals=20 if quick else 60,
        rebalance_wall_limit=60.0 if quick else 300.0,
        step_timeout=60.0 if quick else 180.0,
        lifetime=300.0 if quick else 1200.0,
        scrape_interval=scrape_interval,
    )


def paired_median(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-run ratios."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


# ==== node processes ==============================================================================


class Worker(CommandProcess):
    """One node process (``benchmarks/_sharding_worker.py``) and its command pipe."""

    def __init__(
        self, name: str, certs: Path, log: Path, *, lifetime: float, scrape: float | None = None
    ) -> None:
        args = [sys.executable, "-m", "benchmarks._sharding_worker", "--certs", str(certs)]
        args += ["--lifetime", str(lifetime)]
        if scrape is not None:
            args += ["--scrape-interval", str(scrape)]
        super().__init__(name, args, log)

    def request(self, command: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one command and wait for its answer (``timeout`` plus a margin)."""
        self.send(command)
        answer = self.receive(timeout + 10, command["cmd"])
        answer.pop("ok", None)
        return answer

    def wait_ready(self, timeout: float) -> None:
        """Wait until the process has imported everything and reads commands."""
        self.wait_event("ready", timeout)

    def kill(self) -> None:
        """Ask the process to stop, kill it if it does not, and reap it."""
        if self.process.poll() is None:
            with contextlib.suppress(BenchmarkError, OSError):
                self.send({"cmd": "stop"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
        self.reap()


@contextlib.contextmanager
def workers(root: Path, certs: Path, names: list[str], plan: Plan) -> Iterator[list[Worker]]:
    """Start one node process per name; all are stopped when the block ends."""
    started: list[Worker] = []
    try:
        for name in names:
            log = root / f"{name}.log"
            started.append(
                Worker(name, certs, log, lifetime=plan.lifetime, scrape=plan.scrape_interval)
            )
        for w in started:
            w.wait_ready(60)
        yield started
    finally:
        for w in started:
            w.kill()


def profile_path(profile: Path | None, name: str) -> str | None:
    """Where a node process writes the profile of step ``name`` (None: no profiling)."""
    return None if profile is None else str(profile / f"{name}.prof")


def open_single_node(w: Worker, plan: Plan, *, passivate: bool) -> None:
    """A one-member cluster (it joins itself) with ``Counter`` on 100 shards."""
    port = free_port()
    w.request(
        {
            "cmd": "open",
            "name": transport_bench.SERVER_NODE,
            "port": port,
            "roles": [worker.HOST_ROLE],
            "join": f"{HOST}:{port}",
        },
        plan.step_timeout,
    )
    w.request({"cmd": "wait_up", "members": 1, "limit": 30}, 30)
    w.request(
        {
            "cmd": "start_type",
            "shards": LOCAL_SHARDS,
            "passivate": passivate,
            "measured": 1,
            "measured_shards": LOCAL_SHARDS,
        },
        plan.step_timeout,
    )


# ==== (a) local tells =============================================================================


def measure_local_tell(
    root: Path, certs: Path, plan: Plan, profile: Path | None, progress: bool
) -> dict[str, Any]:
    """Tell throughput to warm local entities vs a memory channel, in one node process."""
    started = time.monotonic()
    with workers(root, certs, ["local-tell"], plan) as (w,):
        open_single_node(w, plan, passivate=True)
        result = w.request(
            {
                "cmd": "local_tell",
                "entities": plan.local_entities,
                "count": plan.local_count,
                "repeats": plan.local_repeats,
                "limit": plan.step_timeout,
                "profile": profile_path(profile, "local-tell"),
            },
            plan.step_timeout * (plan.local_repeats + 2),
        )
    ours, baseline = result["ours_per_s"], result["baseline_per_s"]
    out = {
        "ratio": paired_median(ours, baseline),
        "ours_per_s": statistics.median(ours),
        "baseline_per_s": statistics.median(baseline),
        "runs_ours_per_s": ours,
        "runs_baseline_per_s": baseline,
        "entities": result["entities"],
        "shards": result["shards"],
        "messages": plan.local_count,
        "activation_s": result["activation_s"],
    }
    progress_line(
        progress,
        f"(a) local tell to {out['entities']:,} warm entities: {out['ours_per_s']:,.0f} msgs/s, "
        f"memory channel {out['baseline_per_s']:,.0f} msgs/s, ratio {out['ratio']:.2f} "
        f"({time.monotonic() - started:.1f} s)",
    )
    return out


# ==== (b), (c) two processes ======================================================================


def delivery_frame_size(entity_id: str, shard: str) -> int:
    """Bytes of the frame payload a remote tell of ``Add(1)`` sends."""
    delivery = EntityDelivery(
        type_name=worker.TYPE_NAME, shard=shard, entity_id=entity_id, message=worker.Add(1)
    )
    return len(_wire.encode(delivery))


def matching_payload_size(frame: int, seq: int) -> int:
    """The data size that makes a ``bench.Payload`` frame as large as ``frame`` bytes."""
    for size in range(frame + 1):
        if len(_wire.encode(transport_bench.Payload(seq=seq, data=bytes(size)))) >= frame:
            return size
    raise BenchmarkError(f"no payload size matches a {frame}-byte frame")


def transport_baselines(
    a: Worker, b: Worker, plan: Plan, oneway_size: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``benchmarks/transport.py``'s one-way (B receives) and ping-pong (A initiates)."""
    timeout = plan.step_timeout
    workload = {"count": plan.tell_count, "warmup": plan.tell_warmup, "limit": timeout}
    port = b.request(
        {"cmd": "server_start", "kind": "oneway", "size": oneway_size, **workload}, timeout
    )["port"]
    a.request({"cmd": "oneway_client", "port": port, "size": oneway_size, **workload}, timeout)
    oneway = b.request({"cmd": "collect", "kind": "oneway", "limit": timeout}, timeout)
    workload = {"count": plan.pingpong_count, "warmup": plan.pingpong_warmup, "limit": timeout}
    port = b.request(
        {"cmd": "server_start", "kind": "pingpong", "size": PINGPONG_SIZE, **workload}, timeout
    )["port"]
    pingpong = a.request(
        {"cmd": "pingpong_client", "port": port, "size": PINGPONG_SIZE, **workload}, timeout
    )
    b.request({"cmd": "collect", "kind": "pingpong", "limit": timeout}, timeout)
    return oneway, pingpong


def sharding_steps(
    a: Worker, b: Worker, plan: Plan, profile: Path | None, run: int
) -> dict[str, Any]:
    """Form the two-node cluster and measure tells, asks and first messages from A to B."""
    timeout = plan.step_timeout
    port_a, port_b = free_port(), free_port()
    join = f"{HOST}:{port_a}"
    a.request(
        {
            "cmd": "open",
            "name": transport_bench.CLIENT_NODE,
            "port": port_a,
            "roles": [],
            "join": join,
        },
        timeout,
    )
    b.request(
        {
            "cmd": "open",
            "name": transport_bench.SERVER_NODE,
            "port": port_b,
            "roles": [worker.HOST_ROLE],
            "join": join,
        },
        timeout,
    )
    for w in (a, b):
        w.send({"cmd": "wait_up", "members": 2, "limit": 30})
    formed = max(w.receive(40, "wait_up")["seconds"] for w in (a, b))
    type_args = {
        "cmd": "start_type",
        "shards": REMOTE_SHARDS,
        "passivate": True,
        "measured": plan.remote_entities,
        "measured_shards": REMOTE_SHARDS // 2,
    }
    if b.request(type_args, timeout)["proxy"] is not False:
        raise BenchmarkError("the host node started a proxy")
    if a.request(type_args, timeout)["proxy"] is not True:
        raise BenchmarkError("the sending node hosts entities: it should be a proxy")

    # Warm up: every measured entity activated (its shard allocated) by one tell.
    entities = plan.remote_entities
    b.request({"cmd": "count_start", "mark": 0, "target": entities, "profile": None}, timeout)
    a.request({"cmd": "tell", "count": entities, "entities": None, "profile": None}, timeout)
    b.request({"cmd": "count_wait", "limit": timeout, "profile": None}, timeout)

    total = plan.tell_warmup + plan.tell_count
    b_profile = profile_path(profile, f"remote-tell-receiver-run{run}")
    b.request(
        {"cmd": "count_start", "mark": plan.tell_warmup, "target": total, "profile": b_profile},
        timeout,
    )
    sent = a.request(
        {
            "cmd": "tell",
            "count": total,
            "entities": None,
            "profile": profile_path(profile, f"remote-tell-sender-run{run}"),
        },
        timeout,
    )
    counted = b.request({"cmd": "count_wait", "limit": timeout, "profile": b_profile}, timeout)
    tell_per_s = plan.tell_count / (counted["target_at"] - counted["mark_at"])

    seq = a.request(
        {
            "cmd": "ask_seq",
            "count": plan.ask_count,
            "warmup": plan.ask_warmup,
            "profile": profile_path(profile, f"remote-ask-run{run}"),
        },
        timeout,
    )
    conc = a.request(
        {
            "cmd": "ask_concurrent",
            "askers": CONCURRENT_ASKERS,
            "count": plan.concurrent_count,
            "warmup": plan.concurrent_count // 4,
            "profile": None,
        },
        timeout,
    )
    first_profiles = [(w, profile_path(profile, f"first-ask-{w.name}")) for w in (a, b)]
    for w, path in first_profiles:
        if path:
            w.request({"cmd": "profile_start", "path": path}, timeout)
    first = a.request(
        {
            "cmd": "first_asks",
            "samples": plan.first_samples,
            "pause": FIRST_PAUSE,
            "back_to_back": plan.first_back_to_back,
        },
        timeout,
    )
    for w, path in first_profiles:
        if path:
            w.request({"cmd": "profile_stop", "path": path}, timeout)
    for w in (a, b):
        w.request({"cmd": "close", "limit": 10}, 10)
    return {
        "formed_s": formed,
        "tell_per_s": tell_per_s,
        "tell_sender_s": sent["elapsed_s"],
        "tell_receiver_cpu_us": counted["cpu_s"] / plan.tell_count * 1e6,
        "tell_sender_cpu_us": sent["cpu_s"] / total * 1e6,
        "ask_seq": seq,
        "ask_concurrent": conc,
        "first": first,
    }


def measure_remote(
    root: Path, certs: Path, plan: Plan, profile: Path | None, progress: bool
) -> dict[str, Any]:
    """(b) and (c): per run, two fresh processes; baselines and sharding, order alternating."""
    sample_id = worker.ids_in_shards(
        HashExtractor(REMOTE_SHARDS), "e-", plan.remote_entities, range(REMOTE_SHARDS // 2)
    )[plan.remote_entities // 2]
    frame = delivery_frame_size(sample_id, stable_shard(sample_id, REMOTE_SHARDS))
    oneway_size = matching_payload_size(frame, plan.tell_warmup + plan.tell_count // 2)
    runs: list[dict[str, Any]] = []
    for run in range(plan.remote_repeats):
        started = time.monotonic()
        with workers(root, certs, [f"A-run{run + 1}", f"B-run{run + 1}"], plan) as (a, b):
            if run % 2 == 0:
                oneway, pingpong = transport_baselines(a, b, plan, oneway_size)
                sharding = sharding_steps(a, b, plan, profile, run)
            else:
                sharding = sharding_steps(a, b, plan, profile, run)
                oneway, pingpong = transport_baselines(a, b, plan, oneway_size)
        result = {"oneway": oneway, "pingpong": pingpong, **sharding}
        runs.append(result)
        first = result["first"]["paused_us"]
        progress_line(
            progress,
            f"(b) run {run + 1}/{plan.remote_repeats}: tell {sharding['tell_per_s']:,.0f}/s vs "
            f"one-way {oneway['msgs_per_s']:,.0f}/s (CPU per tell: receiver "
            f"{sharding['tell_receiver_cpu_us']:.1f} us, sender "
            f"{sharding['tell_sender_cpu_us']:.1f} us); ask {sharding['ask_seq']['per_s']:,.0f}/s "
            f"(p50 {sharding['ask_seq']['p50_us']:,.0f} us) vs ping-pong "
            f"{pingpong['per_s']:,.0f}/s (p50 {pingpong['p50_us']:,.0f} us); "
            f"{CONCURRENT_ASKERS} askers {sharding['ask_concurrent']['per_s']:,.0f}/s; "
            f"first message p50 {statistics.median(first):,.0f} us "
            f"({time.monotonic() - started:.1f} s)",
        )
    return summarize_remote(runs, frame, oneway_size)


def summarize_remote(runs: list[dict[str, Any]], frame: int, oneway_size: int) -> dict[str, Any]:
    """Medians and paired ratios of the two-process runs."""

    def col(get: Callable[[dict[str, Any]], float]) -> list[float]:
        return [get(r) for r in runs]

    tell = col(lambda r: r["tell_per_s"])
    oneway = col(lambda r: r["oneway"]["msgs_per_s"])
    ask = col(lambda r: r["ask_seq"]["per_s"])
    conc = col(lambda r: r["ask_concurrent"]["per_s"])
    pingpong = col(lambda r: r["pingpong"]["per_s"])
    pingpong_p50 = col(lambda r: r["pingpong"]["p50_us"])
    first_p50 = col(lambda r: statistics.median(r["first"]["paused_us"]))
    warm_p50 = col(lambda r: statistics.median(r["first"]["warm_paused_us"]))
    back_to_back = [x for r in runs for x in r["first"]["back_to_back_us"]]
    first_all = [x for r in runs for x in r["first"]["paused_us"]]
    return {
        "remote_tell_ratio": paired_median(tell, oneway),
        "remote_ask_ratio": paired_median(ask, pingpong),
        "remote_ask_p50_ratio": paired_median(pingpong_p50, col(lambda r: r["ask_seq"]["p50_us"])),
        "remote_ask_concurrent_over_pingpong": paired_median(conc, pingpong),
        "first_message_rtts": paired_median(first_p50, warm_p50),
        "first_message_over_hot_pingpong": paired_median(first_p50, pingpong_p50),
        "idle_round_trip_p50_us": statistics.median(warm_p50),
        "tell_per_s": statistics.median(tell),
        "oneway_per_s": statistics.median(oneway),
        "ask_seq_per_s": statistics.median(ask),
        "ask_seq_p50_us": statistics.median(col(lambda r: r["ask_seq"]["p50_us"])),
        "ask_seq_p99_us": statistics.median(col(lambda r: r["ask_seq"]["p99_us"])),
        "ask_concurrent_per_s": statistics.median(conc),
        "ask_concurrent_p50_us": statistics.median(col(lambda r: r["ask_concurrent"]["p50_us"])),
        "ask_concurrent_p99_us": statistics.median(col(lambda r: r["ask_concurrent"]["p99_us"])),
        "pingpong_per_s": statistics.median(pingpong),
        "pingpong_p50_us": statistics.median(pingpong_p50),
        "pingpong_p99_us": statistics.median(col(lambda r: r["pingpong"]["p99_us"])),
        "first_message_p50_us": statistics.median(first_p50),
        "first_message_max_us": max(first_all),
        "first_message_samples": len(first_all),
        "first_message_back_to_back_p50_us": statistics.median(back_to_back),
        "tell_frame_bytes": frame,
        "oneway_payload_bytes": oneway_size,
        "cluster_formed_s": statistics.median(col(lambda r: r["formed_s"])),
        "runs": [
            {
                "tell_per_s": r["tell_per_s"],
                "tell_sender_s": r["tell_sender_s"],
                "tell_receiver_cpu_us": r["tell_receiver_cpu_us"],
                "tell_sender_cpu_us": r["tell_sender_cpu_us"],
                "oneway_per_s": r["oneway"]["msgs_per_s"],
                "ask_seq": r["ask_seq"],
                "ask_concurrent": r["ask_concurrent"],
                "pingpong": r["pingpong"],
                "first_message_us": r["first"],
            }
            for r in runs
        ],
    }


# ==== (d) idle entities ===========================================================================


def measure_idle(
    root: Path, certs: Path, plan: Plan, profile: Path | None, progress: bool
) -> dict[str, Any]:
    """Activate many entities with one tell each in a fresh node process: memory and rate."""
    started = time.monotonic()
    with workers(root, certs, ["idle-entities"], plan) as (w,):
        open_single_node(w, plan, passivate=False)
        timeout = max(plan.step_timeout, plan.idle_entities / 2_000)
        result = w.request(
            {
                "cmd": "idle_entities",
                "count": plan.idle_entities,
                "limit": timeout,
                "profile": profile_path(profile, "idle-entities"),
            },
            timeout,
        )
    progress_line(
        progress,
        f"(d) {result['count']:,} idle entities on {result['shards']} shards: "
        f"{result['bytes_per_entity']:,.0f} bytes each, {result['activations_per_s']:,.0f} "
        f"activations/s ({time.monotonic() - started:.1f} s)",
    )
    return result


# ==== (e) rebalance on the simulated network ======================================================


class MovesLog(logging.Handler):
    """Records when the coordinator starts moving a shard ("moving shard ..."), in mock time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.moves: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "moving shard" in str(record.msg):
            self.moves.append(trio.current_time())


def sim_address(i: int) -> Address:
    """Simulated node ``i``'s address."""
    return Address(SIM_HOST, i)


@attrs.define(eq=False)
class SimRebalance:
    """One simulated cluster of the rebalance measurement."""

    seed: int
    plan: Plan
    net: SimNetwork
    extractor: HashExtractor
    nodes: dict[int, Node] = attrs.Factory(dict)
    regions: dict[int, ShardRegion] = attrs.Factory(dict)

    async def run_node(self, i: int, *, task_status: trio.TaskStatus[None]) -> None:
        config = NodeConfig(
            cluster_name="bench-sim",
            node_name=f"n{i}",
            bind_host=SIM_HOST,
            bind_port=i,
            seed_nodes=(sim_address(1),),
            tls=SIM_TLS,
            log_level="WARNING",
        )
        async with (
            self.net.transport(sim_address(i), f"n{i}") as transport,
            open_node(config, transport=transport, rng=random.Random(self.seed * 1000 + i)) as node,
        ):
            self.nodes[i] = node
            self.regions[i] = await node.sharding.start(
                worker.TYPE_NAME, worker.Counter, extractor=self.extractor
            )
            task_status.started()
            await trio.sleep_forever()

    def counts(self) -> dict[int, int]:
        """Shards hosted per region, by node."""
        return {i: len(region.state().shards) for i, region in sorted(self.regions.items())}

    def hosted(self) -> set[str]:
        """Every shard some region hosts."""
        return {s.shard_id for r in self.regions.values() for s in r.state().shards}

    def sees_up(self, observer: int, names: set[str]) -> bool:
        """Whether node ``observer`` sees exactly ``names`` as members, all Up."""
        members = self.nodes[observer].cluster.members
        return {m.node.name for m in members} == names and all(
            m.status is MemberStatus.UP for m in members
        )


async def wait_until(check: Callable[[], bool], limit: float, what: str) -> None:
    """Poll ``check`` on the mock clock for up to ``limit`` simulated seconds."""
    with trio.move_on_after(limit):
        while not check():  # noqa: ASYNC110 - polls cluster state on the mock clock
            await trio.sleep(REBALANCE_POLL)
        return
    raise BenchmarkError(f"rebalance: {what} within {limit:g} simulated seconds")


async def rebalance_main(seed: int, plan: Plan, moves: MovesLog) -> dict[str, Any]:
    """Three nodes with every shard hosted; a fourth joins; until balanced (or the cap)."""
    wall = time.perf_counter()
    settings = ShardingSettings()
    interval = settings.rebalance_interval
    sim = SimRebalance(
        seed=seed,
        plan=plan,
        net=SimNetwork(seed, conditions=LinkConditions(delay_min=0.001, delay_max=0.005)),
        extractor=HashExtractor(REBALANCE_SHARDS),
    )
    ids = worker.one_id_per_shard(sim.extractor, "r-", range(REBALANCE_SHARDS))
    by_shard = {str(shard): entity_id for shard, entity_id in ids.items()}
    out: dict[str, Any] = {"seed": seed, "rebalance_interval": interval}
    async with trio.open_nursery() as nursery:
        for i in range(1, REBALANCE_NODES + 1):
            await nursery.start(sim.run_node, i)
        first = {f"n{i}" for i in range(1, REBALANCE_NODES + 1)}
        await wait_until(lambda: sim.sees_up(1, first), 120, "three nodes not Up")
        for entity_id in by_shard.values():
            await sim.regions[1].entity_ref(entity_id).tell(worker.Add(1))
        await wait_until(
            lambda: len(sim.hosted()) == REBALANCE_SHARDS, 300, "not every shard hosted"
        )
        out["before"] = list(sim.counts().values())
        # The rebalance rounds tick every interval from the coordinator's start: a seeded pause
        # puts the join at a random point of that cycle (the time to the first round varies).
        out["join_delay"] = random.Random(seed).uniform(0, interval)
        await trio.sleep(out["join_delay"])
        new = REBALANCE_NODES + 1
        await nursery.start(sim.run_node, new)
        await wait_until(lambda: sim.sees_up(1, {*first, f"n{new}"}), 120, "the new node not Up")
        up_at = trio.current_time()
        moves.moves.clear()
        timeline: list[dict[str, Any]] = []
        touched: dict[str, float] = {}
        next_sample = up_at
        balanced_at: float | None = None
        reason = ""
        with trio.move_on_after(plan.rebalance_max_intervals * interval):
            while True:
                now = trio.current_time()
                counts = list(sim.counts().values())
                hosted = sim.hosted()
                if now >= next_sample:
                    timeline.append({"t": now - up_at, "counts": counts, "hosted": len(hosted)})
                    next_sample += interval
                if len(hosted) == REBALANCE_SHARDS and max(counts) - min(counts) <= 1:
                    balanced_at = now
                    timeline.append({"t": now - up_at, "counts": counts, "hosted": len(hosted)})
                    break
                if time.perf_counter() - wall > plan.rebalance_wall_limit:
                    reason = f"wall-clock limit of {plan.rebalance_wall_limit:g} s reached"
                    break
                for shard, entity_id in by_shard.items():
                    if shard not in hosted and now - touched.get(shard, -math.inf) >= (
                        REBALANCE_TOUCH_AGAIN
                    ):
                        touched[shard] = now
                        await sim.regions[1].entity_ref(entity_id).tell(worker.Add(1))
                await trio.sleep(REBALANCE_POLL)
        if balanced_at is None and not reason:
            reason = f"not balanced within {plan.rebalance_max_intervals} rebalance intervals"
        end = trio.current_time()
        final = list(sim.counts().values())
        nursery.cancel_scope.cancel()
    rounds: dict[float, int] = {}
    for at in moves.moves:
        key = round(at - up_at, 3)
        rounds[key] = rounds.get(key, 0) + 1
    optimal = math.ceil(REBALANCE_SHARDS / (REBALANCE_NODES + 1))
    surplus = sum(max(0, c - optimal) for c in final)
    out.update(
        {
            "intervals": None if balanced_at is None else (balanced_at - up_at) / interval,
            "seconds": None if balanced_at is None else balanced_at - up_at,
            "reason": reason,
            "simulated_s": end - up_at,
            "final_counts": final,
            "final_spread": max(final) - min(final),
            "surplus_left": surplus,
            "rounds": [{"t": t, "shards": n} for t, n in sorted(rounds.items())],
            "timeline": timeline,
            "wall_s": time.perf_counter() - wall,
        }
    )
    if balanced_at is None:
        moved = [n for n in rounds.values()]
        per_round = statistics.mean(moved) if moved else 0.0
        out["projected_rounds_left"] = math.ceil(surplus / per_round) if per_round else None
    return out


def rounds_text(run: dict[str, Any]) -> str:
    """The rebalance rounds of one run: "<simulated s after Up>: <shards moved>", ..."""
    return ", ".join(f"{r['t']:.1f} s: {r['shards']}" for r in run["rounds"]) or "none"


def measure_rebalance(plan: Plan, progress: bool) -> dict[str, Any]:
    """(e): one simulated run per seed; the median of the intervals to balance."""
    moves = MovesLog()
    coordinator_log = logging.getLogger("p2pshard.coordinator")
    quiet = {name: logging.getLogger(name) for name in ("membership", "crdt", "p2pshard")}
    levels = {name: log.level for name, log in quiet.items()}
    saved = (coordinator_log.level, coordinator_log.propagate)
    for log in quiet.values():
        log.setLevel(logging.ERROR)
    coordinator_log.setLevel(logging.INFO)
    coordinator_log.propagate = False
    coordinator_log.addHandler(moves)
    runs: list[dict[str, Any]] = []
    try:
        for seed in plan.rebalance_seeds:
            progress_line(progress, f"(e) rebalance: seed={seed}")
            with deterministic_scheduling(seed):
                run = trio.run(
                    rebalance_main,
                    seed,
                    plan,
                    moves,
                    clock=trio.testing.MockClock(autojump_threshold=0),
                )
            runs.append(run)
            progress_line(
                progress,
                f"(e) seed={seed}: "
                + (
                    f"balanced after {run['intervals']:.2f} rebalance intervals "
                    f"({run['seconds']:.1f} simulated s)"
                    if run["intervals"] is not None
                    else f"{run['reason']}: spread {run['final_spread']}, counts "
                    f"{run['final_counts']}"
                )
                + f"; rounds (simulated s after Up: shards moved) {rounds_text(run)}; "
                f"{run['wall_s']:.1f} s of wall-clock time",
            )
    finally:
        coordinator_log.removeHandler(moves)
        coordinator_log.setLevel(saved[0])
        coordinator_log.propagate = saved[1]
        for name, log in quiet.items():
            log.setLevel(levels[name])
    reached = [r["intervals"] for r in runs if r["intervals"] is not None]
    return {
        "intervals": statistics.median(reached) if len(reached) == len(runs) else None,
        "strategy": repr(LeastShardAllocationStrategy()),
        "rebalance_interval": ShardingSettings().rebalance_interval,
        "shards": REBALANCE_SHARDS,
        "seeds": list(plan.rebalance_seeds),
        "runs": runs,
    }


# ==== the report =================================================================================


def run_all(plan: Plan, *, profile: Path | None, progress: bool) -> dict[str, Any]:
    """Every measurement in turn; the report."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="p2pshard-bench-sharding-") as tmp:
        root = Path(tmp)
        certs = root / "certs"
        transport_bench.make_certificates(certs)
        local = measure_local_tell(root, certs, plan, profile, progress)
        remote = measure_remote(root, certs, plan, profile, progress)
        idle = measure_idle(root, certs, plan, profile, progress)
    rebalance = measure_rebalance(plan, progress)
    report: dict[str, Any] = {
        "local_tell_ratio": local["ratio"],
        "remote_tell_ratio": remote["remote_tell_ratio"],
        "remote_ask_ratio": remote["remote_ask_ratio"],
        "first_message_rtts": remote["first_message_rtts"],
        "bytes_per_idle_entity": idle["bytes_per_entity"],
        "activations_per_s": idle["activations_per_s"],
        "rebalance_intervals_to_balance": rebalance["intervals"],
        "targets": {
            "local_tell_ratio": f">= {LOCAL_TELL_TARGET}",
            "remote_tell_ratio": f">= {REMOTE_TELL_TARGET}",
            "remote_ask_ratio": f">= {REMOTE_ASK_TARGET}",
            "first_message_rtts": f"<= {FIRST_MESSAGE_TARGET:g}",
            "bytes_per_idle_entity": f"<= {BYTES_PER_ENTITY_TARGET:g}",
            "activations_per_s": f">= {ACTIVATIONS_TARGET:g}",
            "rebalance_intervals_to_balance": f"<= {REBALANCE_TARGET:g}",
        },
        "local_tell": local,
        "remote": remote,
        "idle_entities": idle,
        "rebalance": rebalance,
        "counts": attrs.asdict(plan),
        "profiled": profile is not None,
        "management_scrape_interval_s": plan.scrape_interval,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "elapsed_s": time.monotonic() - started,
    }
    return report


def _met(value: float | None, target: float, *, at_least: bool) -> str:
    if value is None:
        return "NOT met"
    return "met" if (value >= target if at_least else value <= target) else "NOT met"


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    local, remote, idle, reb = (
        report["local_tell"],
        report["remote"],
        report["idle_entities"],
        report["rebalance"],
    )
    intervals = reb["intervals"]
    rows: list[tuple[str, ...]] = [
        (
            f"(a) local tell, {local['entities']:,} warm entities (msgs/s)",
            f"{local['ours_per_s']:,.0f}",
            f"{local['baseline_per_s']:,.0f} memory channel",
            f"{local['ratio']:.2f}",
            f">= {LOCAL_TELL_TARGET}",
            _met(local["ratio"], LOCAL_TELL_TARGET, at_least=True),
        ),
        (
            f"(b) remote tell, {remote['tell_frame_bytes']} B frame (msgs/s)",
            f"{remote['tell_per_s']:,.0f}",
            f"{remote['oneway_per_s']:,.0f} transport one-way",
            f"{remote['remote_tell_ratio']:.2f}",
            f">= {REMOTE_TELL_TARGET}",
            _met(remote["remote_tell_ratio"], REMOTE_TELL_TARGET, at_least=True),
        ),
        (
            "(b) sequential ask (asks/s)",
            f"{remote['ask_seq_per_s']:,.0f}",
            f"{remote['pingpong_per_s']:,.0f} ping-pong",
            f"{remote['remote_ask_ratio']:.2f}",
            f">= {REMOTE_ASK_TARGET}",
            _met(remote["remote_ask_ratio"], REMOTE_ASK_TARGET, at_least=True),
        ),
        (
            "    p50 / p99 (us)",
            f"{remote['ask_seq_p50_us']:,.0f} / {remote['ask_seq_p99_us']:,.0f}",
            f"{remote['pingpong_p50_us']:,.0f} / {remote['pingpong_p99_us']:,.0f}",
            f"{remote['remote_ask_p50_ratio']:.2f} (p50)",
            "",
            "",
        ),
        (
            f"(b) {CONCURRENT_ASKERS} concurrent askers (asks/s)",
            f"{remote['ask_concurrent_per_s']:,.0f}",
            f"{remote['pingpong_per_s']:,.0f} ping-pong",
            f"{remote['remote_ask_concurrent_over_pingpong']:.2f}",
            "",
            "",
        ),
        (
            "    p50 / p99 (us)",
            f"{remote['ask_concurrent_p50_us']:,.0f} / {remote['ask_concurrent_p99_us']:,.0f}",
            "",
            "",
            "",
            "",
        ),
        (
            "(c) first ask, new shard, p50 (us)",
            f"{remote['first_message_p50_us']:,.0f}",
            f"{remote['idle_round_trip_p50_us']:,.0f} idle round trip",
            f"{remote['first_message_rtts']:.2f} RTTs",
            f"<= {FIRST_MESSAGE_TARGET:g}",
            _met(remote["first_message_rtts"], FIRST_MESSAGE_TARGET, at_least=False),
        ),
        (
            "    over the busy ping-pong's round trip",
            "",
            f"{remote['pingpong_p50_us']:,.0f} ping-pong p50",
            f"{remote['first_message_over_hot_pingpong']:.2f} RTTs",
            "",
            "",
        ),
        (
            "    back to back (no pause), p50 (us)",
            f"{remote['first_message_back_to_back_p50_us']:,.0f}",
            "",
            f"{remote['first_message_back_to_back_p50_us'] / remote['pingpong_p50_us']:.2f} RTTs",
            "",
            "",
        ),
        (
            f"(d) {idle['count']:,} idle entities: bytes each",
            f"{idle['bytes_per_entity']:,.0f}",
            "",
            "",
            f"<= {BYTES_PER_ENTITY_TARGET:,.0f}",
            _met(idle["bytes_per_entity"], BYTES_PER_ENTITY_TARGET, at_least=False),
        ),
        (
            "(d) activations/s",
            f"{idle['activations_per_s']:,.0f}",
            "",
            "",
            f">= {ACTIVATIONS_TARGET:,.0f}",
            _met(idle["activations_per_s"], ACTIVATIONS_TARGET, at_least=True),
        ),
        (
            f"(e) rebalance to a 4th node, {reb['shards']:,} shards (intervals)",
            "-" if intervals is None else f"{intervals:.2f}",
            "",
            "",
            f"<= {REBALANCE_TARGET:g}",
            _met(intervals, REBALANCE_TARGET, at_least=False),
        ),
    ]
    header = ("figure", "ours", "baseline (same run)", "ratio", "target", "")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{first}  {rest}".rstrip()

    counts = report["counts"]
    lines = [
        "sharding benchmark: node processes over mutual TLS 1.3 on 127.0.0.1, default settings; "
        "ratios are medians of per-run ratios of pairs measured back to back",
        f"(a) {counts['local_count']:,} tells x {counts['local_repeats']} runs; "
        f"(b)/(c) {counts['remote_repeats']} runs of two fresh processes, "
        f"{counts['tell_count']:,} tells, {counts['ask_count']:,} asks, "
        f"{remote['first_message_samples']} first-message samples; "
        f"(d) fresh process; (e) simulated, seeds {reb['seeds']}",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"(b) the one-way baseline sends {remote['oneway_payload_bytes']}-byte payloads: frames "
        f"as large as a tell's EntityDelivery ({remote['tell_frame_bytes']} B); ping-pong: 100 B",
        f"(c) first-message samples wait {FIRST_PAUSE:g} s each; back-to-back ones meet the "
        "singleton proxy's 0.1 s pause after each send to the coordinator",
        f"(d) RSS {idle['rss_before'] / 2**20:,.1f} MiB -> {idle['rss_after'] / 2**20:,.1f} MiB "
        f"for {idle['count']:,} new entities ({idle['entities']:,} with the {idle['shards']} that "
        "hosted the shards first)",
        f"(e) strategy {reb['strategy']}, rebalance_interval {reb['rebalance_interval']:g} s:",
    ]
    for run in reb["runs"]:
        rounds = rounds_text(run)
        if run["intervals"] is not None:
            outcome = (
                f"balanced {run['seconds']:.1f} s after the 4th node was Up "
                f"({run['intervals']:.2f} intervals), counts {run['final_counts']}"
            )
        else:
            outcome = (
                f"{run['reason']}; after {run['simulated_s']:.0f} s spread "
                f"{run['final_spread']} (counts {run['final_counts']}, "
                f"{run['surplus_left']} shards above optimal; about "
                f"{run.get('projected_rounds_left')} more rounds at the rate seen)"
            )
        lines.append(
            f"    seed={run['seed']}: {run['before']} -> {outcome}; rounds "
            f"(s after Up: shards moved) {rounds}"
        )
    lines += [
        "",
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs; 1-minute load average "
        f"before the run {report['load_average_before']:.2f}",
    ]
    if report["profiled"]:
        lines.append("profiled run: the figures are not comparable with normal runs")
    if report["management_scrape_interval_s"] is not None:
        lines.append(
            "every node served [management]; its /metrics was fetched every "
            f"{report['management_scrape_interval_s']:g} s"
        )
    if report["load_average_before"] >= 0.5:
        lines.append(
            "warning: other processes were using the CPUs when the run started; the absolute "
            "figures are pessimistic (ratios of back-to-back pairs suffer less)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="smaller counts; under a minute")
    parser.add_argument(
        "--seed", type=int, help="seed of the simulated rebalance (default: 1 quick, 1-5 full)"
    )
    parser.add_argument(
        "--profile", type=Path, help="cProfile the node processes' measured steps into this dir"
    )
    parser.add_argument(
        "--management",
        action="store_true",
        help="every node serves [management] and its GET /metrics is fetched while it runs",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between fetches of /metrics with --management (default 1; Prometheus' "
        "default is 15)",
    )
    args = parser.parse_args(argv)
    if args.scrape_interval <= 0:
        parser.error(f"--scrape-interval must be above 0, not {args.scrape_interval}")
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    scrape = args.scrape_interval if args.management else None
    plan = make_plan(quick=args.quick, seed=args.seed, scrape_interval=scrape)
    # A plain kill also unwinds through the clean-up that stops the node processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report = run_all(plan, profile=args.profile, progress=not args.json)
    except BenchmarkError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; node processes stopped", file=sys.stderr)
        return 130
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
