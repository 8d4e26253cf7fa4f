"""Replicator benchmark: majority writes, gossip at rest and catch-up, on real node processes.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.replicator            # full run, about 5 minutes
    .venv/bin/python -m benchmarks.replicator --quick    # smaller counts, about a minute
    .venv/bin/python -m benchmarks.replicator --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.replicator --quick --profile /tmp/prof
        # also cProfile every node process during each measured step, into
        # /tmp/prof/<cluster>-<step>-node-<i>.prof (read with: python -m pstats FILE); profiling
        # slows the nodes, so the figures printed in that mode are not comparable with normal runs

Progress lines go to stderr unless ``--json``.

Every node is its own OS process (this file run with ``--worker CONFIG``) running
``p2pshard.open_node`` with mutual TLS 1.3 on 127.0.0.1, with certificates and TOML files written
by ``p2pshard.cli._localcluster.LocalCluster.prepare`` and the default settings; ``P2PSHARD_*``
environment variables reach every node, e.g. ``P2PSHARD_REPLICATOR__GOSSIP_INTERVAL=1``. This
process only orchestrates: it sends each node one JSON command per line on its stdin and reads one
JSON answer per line from its stdout; node logs go to files that are shown when a node fails.

What it measures:

1. **Majority writes** on clusters of 3 and 5 nodes. Node 1 (the driver) runs
   ``replicator.update(key, modify, WriteMajority(timeout=3))`` where ``modify`` sets one field of
   the document's map ``"m"``, cycling over 8 keys: sequentially (one write in flight; p50 and p99
   of the latency and writes per second), then with 32 concurrent writers (writes per second and
   latency). The baseline is ``benchmarks/transport.py``'s ping-pong (100-byte message, one in
   flight, between two fresh processes over the same transport), measured in the same run before
   the clusters start: a majority write is one round trip to the nearest replicas, so
   ``write_majority_p50_over_pingpong`` (write p50 on 3 nodes / ping-pong p50) says what the
   replicator adds to it; target <= 2.5.
2. **Gossip at rest**: on the 3-node cluster (and the 5-node one in a full run) the driver writes
   1,000 keys with ``WriteLocal``; once every node holds the same keys with the same digests and a
   settling time passed, the counters of every node are read before and after an idle window:
   the replicator's ``gossip_bytes_sent`` (payload of anti-entropy and delta messages) and the
   transport's bytes sent (all frames: membership heartbeats and gossip too), per node per
   second. A full run also measures the same window before the keys are written (only the 8 write
   keys), so the transport's share of membership traffic shows.
3. **Catch-up**: a fresh 3-node cluster; the driver writes 10,000 keys with ``WriteLocal`` (one
   ``update`` per key, in batches of 1,000); the time until every replica holds them all with
   equal digests is reported; then a 4th node starts and the clock runs from its node being open
   (transport listening, joining) until its replicator holds all 10,000 keys with a combined digest
   (blake2b over every key and ``ReplicatorCore.digest(key)``) equal to the driver's. Also
   reported: when its first key came, and when it saw itself Up (keys may come first: a peer
   gossips to a member as soon as it sees it WeaklyUp or Up).

Next to the times, process CPU time (``time.process_time()`` in each node, less the benchmark's
own digests and statistics) per write and per phase: it says what the work costs when other
processes compete for the CPUs, as they do on a shared machine (the 1-minute load average before
the run is reported, with a warning when it is 0.5 or more).

Every wait has a time limit and every loop a bound; a node process that fails, exits or misses a
limit aborts the benchmark with an error naming it and the tail of its log. Node processes are
killed on every exit path (Ctrl-C included), and end by themselves when this process goes away
(their stdin closes) or after a hard lifetime.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import json
import logging
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pycrdt
import trio

from benchmarks import transport as transport_bench
from benchmarks._process import BenchmarkError, CommandProcess, Lines
from benchmarks._report import benchmark_parser, progress_line, quantiles_us
from crdt import ReplicationError, WriteLocal, WriteMajority
from membership import MemberStatus
from p2pshard import Node, NodeConfig, open_node
from p2pshard.cli._localcluster import LocalCluster

CLUSTER = "bench"
HOST = "127.0.0.1"
MAP = "m"
WRITE_TIMEOUT = 3.0
WRITE_KEYS = 8
WRITERS = 32
IDLE_KEYS = 1_000
CATCH_UP_KEYS = 10_000
CATCH_UP_BATCH = 1_000
RATIO_TARGET = 2.5
"""``write_majority_p50_over_pingpong`` should be at most this."""

_POLL = 0.05
"""Seconds between checks inside a node process."""
_PARENT_POLL = 0.25
"""Seconds between checks of the orchestrating process."""


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    sizes: tuple[int, ...]
    """Cluster sizes for the write measurements."""
    seq_writes: int
    seq_warmup: int
    concurrent_seconds: float
    concurrent_max_writes: int
    idle_sizes: tuple[int, ...]
    """Cluster sizes on which gossip at rest is measured."""
    idle_settle: float
    idle_window: float
    idle_baseline: bool
    """Also measure the idle window before the 1,000 keys are written."""
    pingpong_runs: int
    pingpong_count: int
    pingpong_warmup: int
    form_timeout: float
    """Seconds for a cluster to form (every node sees every other Up)."""
    converge_timeout: float
    """Seconds for replicas to hold the same keys after a burst of local writes."""
    catch_up_timeout: float
    lifetime: float
    """Hard limit on a node process's life, in seconds."""


def make_plan(*, quick: bool) -> Plan:
    """The quick plan takes about a minute on two cores; the full one about five."""
    return Plan(
        sizes=(3, 5),
        seq_writes=300 if quick else 2_000,
        seq_warmup=50 if quick else 200,
        concurrent_seconds=3.0 if quick else 10.0,
        concurrent_max_writes=20_000 if quick else 100_000,
        idle_sizes=(3,) if quick else (3, 5),
        idle_settle=3.0 if quick else 5.0,
        idle_window=8.0 if quick else 30.0,
        idle_baseline=not quick,
        pingpong_runs=1 if quick else 3,
        pingpong_count=1_500 if quick else 3_000,
        pingpong_warmup=300,
        form_timeout=30.0,
        converge_timeout=60.0,
        catch_up_timeout=60.0 if quick else 120.0,
        lifetime=300.0 if quick else 900.0,
    )


def latency_us(samples: Sequence[float]) -> dict[str, float | None]:
    """p50 and p99 of ``samples`` (seconds) in microseconds, as benchmarks/transport.py cuts."""
    if len(samples) < 2:
        only = samples[0] * 1e6 if samples else None
        return {"p50_us": only, "p99_us": only}
    cuts = quantiles_us(list(samples))
    return {"p50_us": cuts["p50_us"], "p99_us": cuts["p99_us"]}


# ==== the node process (--worker) ================================================================


def set_field(field: str, value: str) -> Callable[[pycrdt.Doc[Any]], None]:
    """A ``modify`` that sets one field of the document's map."""

    def modify(doc: pycrdt.Doc[Any]) -> None:
        doc.get(MAP, type=pycrdt.Map)[field] = value

    return modify


@attrs.define(eq=False)
class NodeState:
    """One node process's node and the wall-clock times of its milestones."""

    node: Node
    opened_at: float
    up_at: float | None = None
    profiler: cProfile.Profile | None = None
    bench_cpu: float = 0.0
    """CPU seconds this process spent on the benchmark's own digests, left out of ``cpu``."""

    async def watch_up(self) -> None:
        """Note when this node is Up (or WeaklyUp)."""
        await self.node.cluster.wait_up()
        self.up_at = time.time()

    def key_count(self) -> int:
        """Keys the local replica holds (cheap: no encoding)."""
        return self.node.replicator._core.statistics().keys

    def cpu(self) -> float:
        """CPU seconds of this process so far, less those of the benchmark's digests."""
        return time.process_time() - self.bench_cpu

    def combined_digest(self) -> str:
        """One hash over every held key and its digest: equal on replicas holding the same."""
        started = time.process_time()
        core = self.node.replicator._core
        h = hashlib.blake2b(digest_size=16)
        for key in core.held_keys():
            h.update(key.encode())
            h.update(b"\0")
            h.update(core.digest(key) or b"")
        self.bench_cpu += time.process_time() - started
        return h.hexdigest()

    def ready_for(self, nodes: int) -> bool:
        """Every one of ``nodes`` Up, all reachable, and as many replicas in the replicator."""
        cluster = self.node.cluster
        up = sum(m.status is MemberStatus.UP for m in cluster.members)
        replicas = self.node.replicator._core._peers.replicas
        return (
            up == nodes
            and not cluster.unreachable
            and cluster.has_converged()
            and len(replicas) == nodes - 1
        )

    def stats(self) -> dict[str, Any]:
        """Replicator and transport counters, with this process's wall-clock and CPU time."""
        wall, cpu, started = time.time(), self.cpu(), time.process_time()
        rep = self.node.replicator.statistics()  # one encoding per key: left out of the CPU
        tr = self.node.transport.statistics()
        self.bench_cpu += time.process_time() - started
        return {
            "wall": wall,
            "cpu_s": cpu,
            "keys": rep.keys,
            "gossip_bytes_sent": rep.gossip_bytes_sent,
            "gossip_bytes_received": rep.gossip_bytes_received,
            "gossip_messages_sent": rep.gossip_messages_sent,
            "gossip_messages_received": rep.gossip_messages_received,
            "dropped_sends": rep.dropped_sends,
            "transport_bytes_sent": sum(p.bytes_sent for p in tr.peers),
            "transport_frames_sent": sum(p.frames_sent for p in tr.peers),
            "transport_bytes_received": tr.bytes_received,
            "transport_frames_received": tr.frames_received,
        }


async def wait_ready(state: NodeState, nodes: int, limit: float) -> dict[str, Any]:
    """Wait (up to ``limit`` seconds) until this node sees ``nodes`` members Up and replicas."""
    with trio.move_on_after(limit):
        # Polled: readiness spans the membership and the replicator, no one event says it.
        while not state.ready_for(nodes):  # noqa: ASYNC110
            await trio.sleep(_POLL)
        return {"ready": True}
    members = [f"{m.node.name} {m.status.name}" for m in state.node.cluster.members]
    raise BenchmarkError(f"not {nodes} members Up within {limit:g} s: {members}")


async def write_sequential(
    state: NodeState, count: int, warmup: int, keys: int, write_timeout: float
) -> dict[str, Any]:
    """Majority writes one at a time: latency of each and the rate."""
    replicator = state.node.replicator
    consistency = WriteMajority(timeout=write_timeout)
    samples: list[float] = []
    failures = 0
    measured_from = time.perf_counter()
    for i in range(warmup + count):
        if i == warmup:
            measured_from = time.perf_counter()
        started = time.perf_counter()
        try:
            await replicator.update(f"w-{i % keys}", set_field("f", f"v{i}"), consistency)
        except ReplicationError:
            failures += 1
            continue
        if i >= warmup:
            samples.append(time.perf_counter() - started)
    elapsed = time.perf_counter() - measured_from
    return {
        **latency_us(samples),
        "writes": len(samples),
        "failures": failures,
        "writes_per_s": len(samples) / elapsed,
        "elapsed_s": elapsed,
    }


async def write_concurrent(
    state: NodeState, writers: int, seconds: float, max_writes: int, keys: int, write_timeout: float
) -> dict[str, Any]:
    """``writers`` tasks each writing one majority write after another for ``seconds``."""
    replicator = state.node.replicator
    consistency = WriteMajority(timeout=write_timeout)
    samples: list[float] = []
    failures = [0]
    stop_at = time.perf_counter() + seconds

    async def writer(w: int) -> None:
        for i in range(max_writes):  # bounded by count as well as by time
            if time.perf_counter() >= stop_at or len(samples) + failures[0] >= max_writes:
                return
            write = set_field(f"w{w}", f"v{i}")
            started = time.perf_counter()
            try:
                await replicator.update(f"c-{w % keys}", write, consistency)
            except ReplicationError:
                failures[0] += 1
                continue
            samples.append(time.perf_counter() - started)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in range(writers):
            nursery.start_soon(writer, w)
    elapsed = time.perf_counter() - started
    return {
        **latency_us(samples),
        "writers": writers,
        "writes": len(samples),
        "failures": failures[0],
        "writes_per_s": len(samples) / elapsed,
        "elapsed_s": elapsed,
    }


async def write_local(state: NodeState, prefix: str, count: int, batch: int) -> dict[str, Any]:
    """``count`` keys, one local write each, with a pause between batches for the deltas."""
    replicator = state.node.replicator
    started, cpu = time.perf_counter(), state.cpu()
    for i in range(count):
        await replicator.update(f"{prefix}{i:05d}", set_field("f", f"v{i}"), WriteLocal())
        if (i + 1) % batch == 0:
            await trio.sleep(0.01)
    return {"elapsed_s": time.perf_counter() - started, "cpu_s": state.cpu() - cpu}


async def wait_keys(state: NodeState, count: int, digest: str, limit: float) -> dict[str, Any]:
    """Wait until this replica holds ``count`` keys with the combined ``digest``."""
    first_key_at = count_at = None
    last_check = 0.0
    with trio.move_on_after(limit):
        while True:
            held = state.key_count()
            now = time.time()
            if held and first_key_at is None:
                first_key_at = now
            if held >= count:
                count_at = count_at or now
                # The digest is computed without yielding: it describes the state at ``now``.
                if now - last_check >= 0.25:
                    last_check = now
                    cpu = state.cpu()
                    if state.combined_digest() == digest:
                        return {
                            "opened_at": state.opened_at,
                            "up_at": state.up_at,
                            "first_key_at": first_key_at,
                            "count_at": count_at,
                            "caught_up_at": now,
                            "cpu_s": cpu,
                            "keys": held,
                        }
            await trio.sleep(_POLL)
    raise BenchmarkError(
        f"holds {state.key_count()} of {count} keys (combined digest "
        f"{'equal' if state.combined_digest() == digest else 'different'}) after {limit:g} s"
    )


async def run_command(state: NodeState, command: dict[str, Any]) -> dict[str, Any]:
    """Carry out one command from the orchestrating process."""
    match command["cmd"]:
        case "wait_ready":
            return await wait_ready(state, command["nodes"], command["timeout"])
        case "write_seq":
            return await write_sequential(
                state, command["count"], command["warmup"], command["keys"], command["timeout"]
            )
        case "write_concurrent":
            return await write_concurrent(
                state,
                command["writers"],
                command["seconds"],
                command["max_writes"],
                command["keys"],
                command["timeout"],
            )
        case "write_local":
            return await write_local(state, command["prefix"], command["count"], command["batch"])
        case "count":
            return {"keys": state.key_count()}
        case "info":
            return {"opened_at": state.opened_at, "up_at": state.up_at, "cpu_s": state.cpu()}
        case "holding":
            return {"keys": state.key_count(), "digest": state.combined_digest()}
        case "stats":
            return state.stats()
        case "wait_keys":
            return await wait_keys(state, command["count"], command["digest"], command["timeout"])
        case "profile_start":
            state.profiler = cProfile.Profile()
            state.profiler.enable()
            return {}
        case "profile_stop":
            if state.profiler is not None:
                state.profiler.disable()
                state.profiler.dump_stats(command["path"])
                state.profiler = None
            return {}
    raise BenchmarkError(f"unknown command {command!r}")


async def serve(config: NodeConfig, lifetime: float) -> None:
    """Open the node, say ready, then answer commands until "stop" or the end of stdin."""
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))

    async def answer(message: dict[str, Any]) -> None:
        await stdout.send_all((json.dumps(message) + "\n").encode())

    with trio.fail_after(lifetime), trio.CancelScope() as node_scope:
        async with (
            stdout,
            trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin,
            open_node(config) as node,
            trio.open_nursery() as nursery,
        ):
            state = NodeState(node=node, opened_at=time.time())
            nursery.start_soon(state.watch_up)
            await answer(
                {
                    "event": "ready",
                    "node": str(node.address),
                    "opened_at": state.opened_at,
                    "cpu_s": state.cpu(),
                }
            )
            lines = Lines(stdin)
            while (line := await lines.readline()) is not None:
                command = json.loads(line)
                if command["cmd"] == "stop":
                    await answer({"ok": True})
                    break
                try:
                    result = await run_command(state, command)
                except (BenchmarkError, ReplicationError, KeyError, TypeError) as error:
                    await answer({"ok": False, "error": f"{type(error).__name__}: {error}"})
                else:
                    await answer({"ok": True, **result})
            # Stop now, without a graceful leave: the benchmark is over for this cluster.
            node_scope.cancel()


def worker_main(config_path: Path, lifetime: float) -> int:
    """Run one node process."""
    config = NodeConfig.load(config_path)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    trio.run(serve, config, lifetime)
    return 0


# ==== the orchestrating process ==================================================================


def find_port_block(count: int) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (checked, not reserved)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20_000, 60_000)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise BenchmarkError(f"no block of {count} free ports found on {HOST}")


class Worker(CommandProcess):
    """One node process and its command pipe."""

    def __init__(self, name: str, config: Path, log: Path, *, lifetime: float) -> None:
        args = [sys.executable, "-m", "benchmarks.replicator", "--worker", str(config)]
        super().__init__(name, [*args, "--lifetime", str(lifetime)], log)
        self.launched_at = time.time()
        self.opened_at = 0.0
        self.cpu_at_open = 0.0

    def request(self, command: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one command and wait for its answer."""
        self.send(command)
        return self.receive(timeout, command["cmd"])

    def wait_opened(self, timeout: float) -> None:
        """Wait for the node's "ready": its transport listens and it is joining."""
        message = self.wait_event("ready", timeout)
        self.opened_at = float(message["opened_at"])
        self.cpu_at_open = float(message["cpu_s"])

    def kill(self) -> None:
        """Kill the process if it still runs, and reap it."""
        self.reap()


class Nodes:
    """Node processes of one local cluster, all stopped when the ``with`` block ends."""

    def __init__(
        self, total: int, root: Path, phase: str, plan: Plan, profile: Path | None
    ) -> None:
        self._root = root
        self._phase = phase
        self._plan = plan
        self._profile = profile
        plan_cluster = LocalCluster(
            nodes=total,
            data_dir=root,
            cluster=CLUSTER,
            host=HOST,
            base_port=find_port_block(total),
            log_level="WARNING",
        )
        plan_cluster.check_ports()
        self.configs = plan_cluster.prepare()
        self.workers: list[Worker] = []

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, count: int, timeout: float) -> list[Worker]:
        """Start the next ``count`` node processes; wait until each node is open."""
        started = []
        for _ in range(count):
            i = len(self.workers)
            worker = Worker(
                f"{self._phase} node-{i + 1}",
                self.configs[i],
                self._root / f"node-{i + 1}.log",
                lifetime=self._plan.lifetime,
            )
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_opened(timeout)
        return started

    def wait_formed(self, timeout: float) -> None:
        """Every node sees every node Up, and the replicators have them all as replicas."""
        command = {"cmd": "wait_ready", "nodes": len(self.workers), "timeout": timeout}
        for worker in self.workers:
            worker.send(command)
        for worker in self.workers:
            worker.receive(timeout + 5, "wait_ready")

    def on_all(self, command: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """Send ``command`` to every node at once; their answers in node order."""
        for worker in self.workers:
            worker.send(command)
        return [worker.receive(timeout, command["cmd"]) for worker in self.workers]

    @contextlib.contextmanager
    def profiled(self, step: str) -> Iterator[None]:
        """With ``--profile``: cProfile every node while the block runs, one file per node."""
        if self._profile is None:
            yield
            return
        self.on_all({"cmd": "profile_start"}, 30)
        try:
            yield
        finally:
            for i, worker in enumerate(self.workers, start=1):
                path = self._profile / f"{self._phase}-{step}-node-{i}.prof"
                if worker.process.poll() is None:
                    worker.request({"cmd": "profile_stop", "path": str(path)}, 60)

    def profile_joiner(self, worker: Worker) -> None:
        """With ``--profile``: a node started inside a :meth:`profiled` block joins it."""
        if self._profile is not None:
            worker.request({"cmd": "profile_start"}, 30)

    def close(self) -> None:
        """Stop every node process, killing those that do not stop."""
        for worker in self.workers:
            if worker.process.poll() is None:
                with contextlib.suppress(BenchmarkError):
                    worker.send({"cmd": "stop"})
        deadline = time.monotonic() + 5
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(max(deadline - time.monotonic(), 0.1))
            worker.kill()


def wait_converged(nodes: Sequence[Worker], expected: int | None, timeout: float) -> float:
    """Wait until all ``nodes`` hold the same keys (``expected`` of them) with equal digests.

    Returns the seconds waited.
    """
    started = time.monotonic()
    deadline = started + timeout
    counts: list[int] = []
    while time.monotonic() < deadline:
        for worker in nodes:
            worker.send({"cmd": "count"})
        counts = [int(w.receive(30, "count")["keys"]) for w in nodes]
        if len(set(counts)) == 1 and (expected is None or counts[0] == expected):
            for worker in nodes:
                worker.send({"cmd": "holding"})
            digests = {w.receive(30, "holding")["digest"] for w in nodes}
            if len(digests) == 1:
                return time.monotonic() - started
        time.sleep(_PARENT_POLL)
    raise BenchmarkError(
        f"replicas did not converge within {timeout:g} s: key counts {counts}, expected {expected}"
    )


def measure_pingpong(root: Path, plan: Plan, progress: bool) -> dict[str, float]:
    """benchmarks/transport.py's ping-pong, ours only: median p50 and p99 over the runs."""
    certs = root / "pingpong-certs"
    transport_bench.make_certificates(certs)
    workload = transport_bench.Workload(
        key="pingpong_100b",
        kind="pingpong",
        size=100,
        count=plan.pingpong_count,
        warmup=plan.pingpong_warmup,
    )
    tplan = transport_bench.Plan(workloads=(workload,), repeats=plan.pingpong_runs, timeout=60.0)
    ctx = multiprocessing.get_context("spawn")
    runs: list[dict[str, float]] = []
    for run in range(plan.pingpong_runs):
        try:
            result = transport_bench.measure(
                ctx, "ours", workload, certs=certs, plan=tplan, run=run, profile=None
            )
        except transport_bench.BenchmarkError as error:
            raise BenchmarkError(f"transport ping-pong: {error}") from None
        runs.append(result)
        progress_line(
            progress,
            f"transport ping-pong run {run + 1}/{plan.pingpong_runs}: "
            f"p50 {result['p50_us']:,.0f} us, p99 {result['p99_us']:,.0f} us",
        )
    return {
        "p50_us": statistics.median(r["p50_us"] for r in runs),
        "p99_us": statistics.median(r["p99_us"] for r in runs),
    }


def measure_writes(nodes: Nodes, plan: Plan, progress: bool) -> dict[str, Any]:
    """Sequential and concurrent majority writes from node 1."""
    driver = nodes.workers[0]
    n = len(nodes.workers)
    before = nodes.on_all({"cmd": "stats"}, 30)
    with nodes.profiled("write-seq"):
        seq = driver.request(
            {
                "cmd": "write_seq",
                "count": plan.seq_writes,
                "warmup": plan.seq_warmup,
                "keys": WRITE_KEYS,
                "timeout": WRITE_TIMEOUT,
            },
            timeout=(plan.seq_writes + plan.seq_warmup) * WRITE_TIMEOUT + 10,
        )
    middle = nodes.on_all({"cmd": "stats"}, 30)
    seq.update(cpu_per_write(before, middle, plan.seq_writes + plan.seq_warmup))
    progress_line(
        progress,
        f"{n} nodes: sequential WriteMajority p50 {seq['p50_us']:,.0f} us, "
        f"p99 {seq['p99_us']:,.0f} us, {seq['writes_per_s']:,.0f} writes/s, "
        f"{seq['failures']} failed; CPU per write: driver {seq['cpu_us_driver']:,.0f} us, "
        f"each replica {seq['cpu_us_replica']:,.0f} us",
    )
    with nodes.profiled("write-concurrent"):
        conc = driver.request(
            {
                "cmd": "write_concurrent",
                "writers": WRITERS,
                "seconds": plan.concurrent_seconds,
                "max_writes": plan.concurrent_max_writes,
                "keys": WRITE_KEYS,
                "timeout": WRITE_TIMEOUT,
            },
            timeout=plan.concurrent_seconds + WRITE_TIMEOUT + 30,
        )
    after = nodes.on_all({"cmd": "stats"}, 30)
    conc.update(cpu_per_write(middle, after, conc["writes"] + conc["failures"]))
    progress_line(
        progress,
        f"{n} nodes: {WRITERS} concurrent writers {conc['writes_per_s']:,.0f} writes/s, "
        f"p50 {conc['p50_us']:,.0f} us, p99 {conc['p99_us']:,.0f} us, "
        f"{conc['failures']} failed; CPU per write: driver {conc['cpu_us_driver']:,.0f} us, "
        f"each replica {conc['cpu_us_replica']:,.0f} us",
    )
    keep = (
        "p50_us",
        "p99_us",
        "writes",
        "failures",
        "writes_per_s",
        "elapsed_s",
        "cpu_us_driver",
        "cpu_us_replica",
        "cpu_us_all_nodes",
    )
    return {
        "sequential": {k: seq[k] for k in keep},
        "concurrent": {"writers": WRITERS, **{k: conc[k] for k in keep}},
    }


def cpu_per_write(
    before: list[dict[str, Any]], after: list[dict[str, Any]], writes: int
) -> dict[str, float]:
    """Process CPU time per write: on the driver (node 1), on a replica (mean), on all nodes.

    It covers everything a node did meanwhile (heartbeats and gossip too, a few per second).
    """
    used = [
        (a["cpu_s"] - b["cpu_s"]) * 1e6 / max(writes, 1) for b, a in zip(before, after, strict=True)
    ]
    return {
        "cpu_us_driver": used[0],
        "cpu_us_replica": statistics.mean(used[1:]),
        "cpu_us_all_nodes": sum(used),
    }


def idle_window(nodes: Nodes, plan: Plan) -> dict[str, float]:
    """Counters of every node before and after an idle window: per-node rates, averaged."""
    before = nodes.on_all({"cmd": "stats"}, 30)
    time.sleep(plan.idle_window)
    after = nodes.on_all({"cmd": "stats"}, 30)
    rates: dict[str, list[float]] = {}
    for b, a in zip(before, after, strict=True):
        seconds = a["wall"] - b["wall"]
        for field in (
            "cpu_s",
            "gossip_bytes_sent",
            "gossip_messages_sent",
            "transport_bytes_sent",
            "transport_frames_sent",
        ):
            rates.setdefault(field, []).append((a[field] - b[field]) / seconds)
    out = {f"{field}_per_s": statistics.mean(values) for field, values in rates.items()}
    out["cpu_percent"] = 100 * out.pop("cpu_s_per_s")
    out["max_gossip_bytes_sent_per_s"] = max(rates["gossip_bytes_sent"])
    out["window_s"] = plan.idle_window
    out["keys"] = float(after[0]["keys"])
    return out


def measure_idle(nodes: Nodes, plan: Plan, progress: bool) -> dict[str, Any]:
    """Gossip and transport bytes at rest, before (full run) and after writing 1,000 keys."""
    n = len(nodes.workers)
    out: dict[str, Any] = {}
    if plan.idle_baseline:
        wait_converged(nodes.workers, None, plan.converge_timeout)
        time.sleep(plan.idle_settle)
        out["before_keys"] = idle_window(nodes, plan)
    driver = nodes.workers[0]
    before = int(driver.request({"cmd": "count"}, 10)["keys"])
    driver.request(
        {"cmd": "write_local", "prefix": "idle-", "count": IDLE_KEYS, "batch": 250}, timeout=120
    )
    out["converge_s"] = wait_converged(nodes.workers, before + IDLE_KEYS, plan.converge_timeout)
    time.sleep(plan.idle_settle)
    with nodes.profiled("idle"):
        out["with_keys"] = idle_window(nodes, plan)
    w = out["with_keys"]
    progress_line(
        progress,
        f"{n} nodes at rest with {w['keys']:,.0f} keys: replicator gossip "
        f"{w['gossip_bytes_sent_per_s']:,.0f} B/s per node "
        f"(max {w['max_gossip_bytes_sent_per_s']:,.0f}), "
        f"transport {w['transport_bytes_sent_per_s']:,.0f} B/s per node",
    )
    return out


def measure_catch_up(
    root: Path, plan: Plan, profile: Path | None, progress: bool
) -> dict[str, Any]:
    """10,000 keys on 3 nodes, then a 4th node: the time until it holds them all."""
    existing = 3
    with Nodes(existing + 1, root / "catch-up", "catch-up", plan, profile) as nodes:
        nodes.start(existing, plan.form_timeout)
        nodes.wait_formed(plan.form_timeout)
        driver = nodes.workers[0]
        before = nodes.on_all({"cmd": "stats"}, 30)
        with nodes.profiled("write-10k"):
            started = time.monotonic()
            wrote = driver.request(
                {
                    "cmd": "write_local",
                    "prefix": "k-",
                    "count": CATCH_UP_KEYS,
                    "batch": CATCH_UP_BATCH,
                },
                timeout=300,
            )
            wait_converged(nodes.workers, CATCH_UP_KEYS, plan.converge_timeout)
            replicated = time.monotonic() - started
        written = nodes.on_all({"cmd": "stats"}, 30)
        target = driver.request({"cmd": "holding"}, 30)
        progress_line(
            progress,
            f"catch-up: {CATCH_UP_KEYS:,} local writes took {wrote['elapsed_s']:.2f} s; every "
            f"replica held them {replicated:.2f} s after the first",
        )
        with nodes.profiled("catch-up"):
            (new,) = nodes.start(1, plan.form_timeout)
            nodes.profile_joiner(new)
            reached = new.request(
                {
                    "cmd": "wait_keys",
                    "count": CATCH_UP_KEYS,
                    "digest": target["digest"],
                    "timeout": plan.catch_up_timeout,
                },
                timeout=plan.catch_up_timeout + 30,
            )
        served = [w.request({"cmd": "stats"}, 30) for w in nodes.workers[:existing]]
        # Keys may come before the new node sees itself Up: peers gossip to a member as soon as
        # they see it (Weakly)Up. Its Up time is read once every node sees all of them Up.
        nodes.wait_formed(plan.form_timeout)
        up = new.request({"cmd": "info"}, 30)["up_at"]
        # The others must still hold the same: nothing was lost while the new node caught up.
        wait_converged(nodes.workers, CATCH_UP_KEYS, plan.converge_timeout)
    write_cpu = cpu_per_write(before, written, CATCH_UP_KEYS)
    opened = reached["opened_at"]
    out = {
        "keys": CATCH_UP_KEYS,
        "existing_nodes": existing,
        "write_local_s": wrote["elapsed_s"],
        "replicate_to_existing_s": replicated,
        "process_start_s": new.opened_at - new.launched_at,
        "catch_up_s": reached["caught_up_at"] - opened,
        "join_s": None if up is None else up - opened,
        "caught_up_after_up_s": None if up is None else reached["caught_up_at"] - up,
        "first_key_s": None
        if reached["first_key_at"] is None
        else reached["first_key_at"] - opened,
        "all_keys_s": reached["count_at"] - opened,
        "write_cpu_us_per_key_driver": write_cpu["cpu_us_driver"],
        "write_cpu_us_per_key_replica": write_cpu["cpu_us_replica"],
        "new_node_cpu_s": reached["cpu_s"] - new.cpu_at_open,
        "existing_nodes_cpu_s": [
            a["cpu_s"] - b["cpu_s"] for b, a in zip(written, served, strict=False)
        ],
    }
    progress_line(
        progress,
        f"catch-up: the new node held all {CATCH_UP_KEYS:,} keys {out['catch_up_s']:.2f} s after "
        f"opening (first key after {_number(out['first_key_s'], '.2f')} s; it saw itself Up "
        f"after {_number(out['join_s'], '.2f')} s; CPU {out['new_node_cpu_s']:.2f} s)",
    )
    return out


def run_all(plan: Plan, *, profile: Path | None, progress: bool) -> dict[str, Any]:
    """Every measurement in turn; the report."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="p2pshard-bench-replicator-") as tmp:
        root = Path(tmp)
        pingpong = measure_pingpong(root, plan, progress)
        writes: dict[int, dict[str, Any]] = {}
        idle: dict[int, dict[str, Any]] = {}
        for n in plan.sizes:
            formed = time.monotonic()
            with Nodes(n, root / f"nodes-{n}", f"{n}-nodes", plan, profile) as nodes:
                nodes.start(n, plan.form_timeout)
                nodes.wait_formed(plan.form_timeout)
                progress_line(
                    progress, f"{n} nodes: cluster formed in {time.monotonic() - formed:.1f} s"
                )
                writes[n] = measure_writes(nodes, plan, progress)
                if n in plan.idle_sizes:
                    idle[n] = measure_idle(nodes, plan, progress)
        catch_up = measure_catch_up(root, plan, profile, progress)
    report = summarize(plan, pingpong, writes, idle, catch_up, time.monotonic() - started)
    report["load_average_before"] = load_before
    return report


def summarize(
    plan: Plan,
    pingpong: dict[str, float],
    writes: dict[int, dict[str, Any]],
    idle: dict[int, dict[str, Any]],
    catch_up: dict[str, Any],
    elapsed: float,
) -> dict[str, Any]:
    """The JSON report: headline figures at the top level, the details under them."""
    out: dict[str, Any] = {}
    for n, result in writes.items():
        seq, conc = result["sequential"], result["concurrent"]
        out[f"write_majority_p50_us_{n}_nodes"] = seq["p50_us"]
        out[f"write_majority_p99_us_{n}_nodes"] = seq["p99_us"]
        out[f"write_majority_sequential_writes_per_s_{n}_nodes"] = seq["writes_per_s"]
        out[f"write_majority_concurrent_writes_per_s_{n}_nodes"] = conc["writes_per_s"]
        out[f"write_majority_p50_over_pingpong_{n}_nodes"] = seq["p50_us"] / pingpong["p50_us"]
    out["pingpong_p50_us"] = pingpong["p50_us"]
    out["pingpong_p99_us"] = pingpong["p99_us"]
    smallest = min(writes)
    out["write_majority_p50_over_pingpong"] = out[
        f"write_majority_p50_over_pingpong_{smallest}_nodes"
    ]
    out["write_majority_p50_over_pingpong_target"] = RATIO_TARGET
    if idle:
        first = idle[min(idle)]["with_keys"]
        out["idle_gossip_bytes_per_s_1k_keys"] = first["gossip_bytes_sent_per_s"]
        out["idle_transport_bytes_per_s_1k_keys"] = first["transport_bytes_sent_per_s"]
    out["catch_up_seconds_10k_keys"] = catch_up["catch_up_s"]
    out["writes"] = {f"{n}_nodes": result for n, result in writes.items()}
    out["idle"] = {f"{n}_nodes": result for n, result in idle.items()}
    out["catch_up"] = catch_up
    out["method"] = (
        "node processes over mutual TLS 1.3 on 127.0.0.1, default settings; node 1 drives the "
        f"writes; {WRITE_KEYS} keys, WriteMajority(timeout={WRITE_TIMEOUT:g}); idle figures are "
        "bytes sent per node per second (replicator gossip payload; transport frames); "
        f"ping-pong: benchmarks/transport.py, median of {plan.pingpong_runs} run(s)"
    )
    out["counts"] = {
        "sequential_writes": plan.seq_writes,
        "sequential_warmup": plan.seq_warmup,
        "concurrent_writers": WRITERS,
        "concurrent_seconds": plan.concurrent_seconds,
        "idle_keys": IDLE_KEYS,
        "idle_window_s": plan.idle_window,
        "catch_up_keys": CATCH_UP_KEYS,
    }
    out["cpus"] = os.cpu_count()
    out["elapsed_s"] = elapsed
    return out


def _number(value: object, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    sizes = [key.removesuffix("_nodes") for key in report["writes"]]
    header = ("WriteMajority from node 1", *(f"{n} nodes" for n in sizes))
    rows: list[tuple[str, ...]] = [
        (
            "sequential p50 / p99 (us)",
            *(
                f"{_number(w['sequential']['p50_us'])} / {_number(w['sequential']['p99_us'])}"
                for w in report["writes"].values()
            ),
        ),
        (
            "sequential writes/s",
            *(_number(w["sequential"]["writes_per_s"]) for w in report["writes"].values()),
        ),
        (
            "sequential CPU/write: driver / replica (us)",
            *(
                f"{_number(w['sequential']['cpu_us_driver'])} / "
                f"{_number(w['sequential']['cpu_us_replica'])}"
                for w in report["writes"].values()
            ),
        ),
        (
            f"{WRITERS} writers: writes/s",
            *(_number(w["concurrent"]["writes_per_s"]) for w in report["writes"].values()),
        ),
        (
            f"{WRITERS} writers: p50 / p99 (us)",
            *(
                f"{_number(w['concurrent']['p50_us'])} / {_number(w['concurrent']['p99_us'])}"
                for w in report["writes"].values()
            ),
        ),
        (
            f"{WRITERS} writers: CPU/write: driver / replica (us)",
            *(
                f"{_number(w['concurrent']['cpu_us_driver'])} / "
                f"{_number(w['concurrent']['cpu_us_replica'])}"
                for w in report["writes"].values()
            ),
        ),
        (
            "failed writes (seq / concurrent)",
            *(
                f"{w['sequential']['failures']} / {w['concurrent']['failures']}"
                for w in report["writes"].values()
            ),
        ),
        (
            "p50 / transport ping-pong p50",
            *(_number(report[f"write_majority_p50_over_pingpong_{n}_nodes"], ".2f") for n in sizes),
        ),
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{first}  {rest}"

    ratio = report["write_majority_p50_over_pingpong"]
    lines = [
        f"replicator benchmark: {report['method']}",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"transport ping-pong (100 B, one in flight): p50 {_number(report['pingpong_p50_us'])} us,"
        f" p99 {_number(report['pingpong_p99_us'])} us",
        f"target: write_majority_p50_over_pingpong <= {RATIO_TARGET} "
        f"({ratio:.2f}: {'met' if ratio <= RATIO_TARGET else 'NOT met'})",
        "",
    ]
    for size, result in report["idle"].items():
        for phase, label in (("before_keys", "8 keys"), ("with_keys", "1,000 keys")):
            if phase not in result:
                continue
            w = result[phase]
            lines.append(
                f"at rest, {size.replace('_', ' ')}, {label}, per node: replicator gossip "
                f"{_number(w['gossip_bytes_sent_per_s'])} B/s "
                f"({w['gossip_messages_sent_per_s']:.2f} msgs/s, max node "
                f"{_number(w['max_gossip_bytes_sent_per_s'])} B/s); transport "
                f"{_number(w['transport_bytes_sent_per_s'])} B/s "
                f"({w['transport_frames_sent_per_s']:.1f} frames/s); CPU {w['cpu_percent']:.1f}% "
                f"over {w['window_s']:g} s"
            )
    c = report["catch_up"]
    lines += [
        "",
        f"catch-up, {c['keys']:,} keys on {c['existing_nodes']} nodes: local writes "
        f"{c['write_local_s']:.2f} s, held by every replica after "
        f"{c['replicate_to_existing_s']:.2f} s (CPU per key: driver "
        f"{c['write_cpu_us_per_key_driver']:,.0f} us, each replica "
        f"{c['write_cpu_us_per_key_replica']:,.0f} us)",
        f"new node: {c['catch_up_s']:.2f} s from open to all keys with equal digests "
        f"(it saw itself Up after {_number(c['join_s'], '.2f')} s; "
        f"first key after {_number(c['first_key_s'], '.2f')} s; process start "
        f"{c['process_start_s']:.2f} s not counted); CPU: new node {c['new_node_cpu_s']:.2f} s, "
        f"existing nodes meanwhile "
        f"{', '.join(f'{x:.2f}' for x in c['existing_nodes_cpu_s'])} s",
        "",
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs; 1-minute load average "
        f"before the run {report['load_average_before']:.2f}",
    ]
    if report["load_average_before"] >= 0.5:
        lines.append(
            "warning: other processes were using the CPUs when the run started; latencies and "
            "rates are pessimistic (the CPU-per-write figures suffer least)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark (or one node), print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="smaller counts; about a minute")
    parser.add_argument(
        "--profile", type=Path, help="cProfile the node processes of each step into this directory"
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lifetime", type=float, default=900.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.lifetime)
    if args.profile:
        args.profile = args.profile.resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    plan = make_plan(quick=args.quick)
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
