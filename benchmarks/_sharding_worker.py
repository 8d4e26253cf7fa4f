"""The node process of ``benchmarks/sharding.py``: one p2pshard node, driven by JSON lines.

``benchmarks/sharding.py`` starts this module as ``python -m benchmarks._sharding_worker --certs
DIR --lifetime S`` from the project root, sends one JSON command per line on its stdin and reads
one JSON answer per line from its stdout; logs go to stderr (a file the orchestrator shows when
something fails). The process ends when its stdin closes, on ``{"cmd": "stop"}``, or after
``--lifetime`` seconds.

Besides a node (``open`` forms a cluster or joins one, ``start_type`` starts the ``Counter``
entity type), a process runs the transport baselines of ``benchmarks/transport.py`` (its
"ours" one-way server and client and ping-pong server, plus a ping-pong client that also
reports the rate), so a node's figures and their baselines come from the same processes.

Every ``Counter`` in the process counts what it handles in one :class:`Tally`, which timestamps
two marks (the end of a warm-up, the last message): "until every message is handled" is
measured where the messages are handled, as the transport benchmark's receiver does.

The entity type, its message and the entity-id helpers are also used by the in-process parts of
the benchmark (the simulated rebalance).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from benchmarks import transport as transport_bench
from benchmarks._process import Lines
from benchmarks._report import quantiles_us
from membership import Address
from membership._member import MemberStatus
from membership.transport._tcp import open_tcp_transport
from p2pshard import (
    EntityContext,
    HashExtractor,
    ManagementSettings,
    Node,
    NodeConfig,
    ShardingSettings,
    TlsFiles,
    message,
    open_node,
)
from p2pshard.sharding._region import ShardRegion

TYPE_NAME = "Counter"
HOST_ROLE = "host"
"""The role of the nodes that host ``Counter`` entities; a node without it gets a proxy."""
CLUSTER = transport_bench.CLUSTER
HOST = "127.0.0.1"
ASK_TIMEOUT = 10.0
_POLL = 0.02


class WorkerError(Exception):
    """A command could not be carried out (the orchestrator reports it with this text)."""


# ---- the entity type ----------------------------------------------------------------------------


@message(name="bench.sharding.Add")
@attrs.frozen
class Add:
    """The benchmark's message: add ``n`` to a counter."""

    n: int


class Tally:
    """Messages handled by every ``Counter`` of this process, with the times of two marks."""

    def __init__(self) -> None:
        self.handled = 0
        self.mark = 0
        self.target = 0
        self.mark_at = 0.0
        self.target_at = 0.0
        self.mark_cpu = 0.0
        self.target_cpu = 0.0
        self.done: trio.Event | None = None

    def reset(self, *, mark: int, target: int) -> trio.Event:
        """Count from zero; note the time at ``mark`` and at ``target`` handled messages."""
        self.handled = 0
        self.mark = mark
        self.target = target
        self.mark_at = self.target_at = 0.0
        self.mark_cpu = self.target_cpu = 0.0
        self.done = trio.Event()
        return self.done

    def one(self) -> None:
        """One more message handled (called by ``Counter.receive``)."""
        handled = self.handled = self.handled + 1
        if handled == self.mark:
            self.mark_at = time.perf_counter()
            self.mark_cpu = time.process_time()
        if handled == self.target:
            self.target_at = time.perf_counter()
            self.target_cpu = time.process_time()
            assert self.done is not None
            self.done.set()


TALLY = Tally()


class Counter:
    """The benchmark's entity: counts its messages; an ask gets the count back."""

    def __init__(self, ctx: EntityContext) -> None:
        self.count = 0

    async def receive(self, message: object, ctx: EntityContext) -> object:
        """Count one message."""
        self.count += 1
        TALLY.one()
        return self.count


def ids_in_shards(extractor: HashExtractor, prefix: str, count: int, shards: range) -> list[str]:
    """``count`` entity ids ``prefix<k>`` whose shards lie in ``shards``, in order of ``k``."""
    out: list[str] = []
    fraction = len(shards) / extractor.number_of_shards
    for k in range(int(count / fraction * 4) + 1000):  # bounded: a hash spreads evenly
        entity_id = f"{prefix}{k}"
        if int(extractor.shard_id(entity_id)) in shards:  # type: ignore[arg-type]
            out.append(entity_id)
            if len(out) == count:
                return out
    raise WorkerError(f"found only {len(out)} of {count} ids in shards {shards}")


def one_id_per_shard(extractor: HashExtractor, prefix: str, shards: range) -> dict[int, str]:
    """For each shard in ``shards``, the first id ``prefix<k>`` that falls in it."""
    out: dict[int, str] = {}
    if not shards:
        return out
    for k in range(len(shards) * 50 + 1000):  # bounded: a hash covers every shard soon
        entity_id = f"{prefix}{k}"
        shard = int(extractor.shard_id(entity_id))  # type: ignore[arg-type]
        if shard in shards and shard not in out:
            out[shard] = entity_id
            if len(out) == len(shards):
                return dict(sorted(out.items()))
    raise WorkerError(f"found ids for only {len(out)} of the {len(shards)} shards {shards}")


def latency_summary(samples: list[float]) -> dict[str, float]:
    """p50, p99 and mean of ``samples`` (seconds) in microseconds."""
    if not samples:
        return {"p50_us": math.nan, "p99_us": math.nan, "mean_us": math.nan}
    if len(samples) == 1:
        only = samples[0] * 1e6
        return {"p50_us": only, "p99_us": only, "mean_us": only}
    return {**quantiles_us(samples), "mean_us": statistics.fmean(samples) * 1e6}


def rss_bytes() -> int:
    """This process's resident set size (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise WorkerError("no VmRSS in /proc/self/status")


# ---- the process's state ------------------------------------------------------------------------


@attrs.define(eq=False)
class Background:
    """A command's part that runs on while other commands are served (a transport server)."""

    done: trio.Event = attrs.Factory(trio.Event)
    port: int = 0
    listening: trio.Event = attrs.Factory(trio.Event)
    result: dict[str, Any] | None = None
    error: str | None = None


@attrs.define(eq=False)
class State:
    """One worker process: its node (if open), its region, its background jobs."""

    certs: Path
    nursery: trio.Nursery
    scrape_interval: float | None = None
    """With ``--management``: the node serves ``[management]`` and this process fetches its
    ``GET /metrics`` every so many seconds while the node is open (None: no endpoint)."""
    scrapes: int = 0
    node: Node | None = None
    node_scope: trio.CancelScope | None = None
    node_closed: trio.Event | None = None
    region: ShardRegion | None = None
    extractor: HashExtractor | None = None
    background: dict[str, Background] = attrs.Factory(dict)
    measured_ids: list[str] = attrs.Factory(list)
    fresh_ids: Iterator[str] | None = None
    profiler: cProfile.Profile | None = None

    def need_region(self) -> ShardRegion:
        if self.region is None:
            raise WorkerError("no entity type started in this process")
        return self.region

    def need_node(self) -> Node:
        if self.node is None:
            raise WorkerError("no node open in this process")
        return self.node

    # -- profiling ------------------------------------------------------------------------------

    def profile_start(self, path: str | None) -> None:
        if path:
            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def profile_stop(self, path: str | None) -> None:
        if path and self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(path)
            self.profiler = None


def node_config(
    certs: Path, name: str, port: int, roles: tuple[str, ...], *, management: bool = False
) -> NodeConfig:
    """A node on 127.0.0.1 with the certificate ``benchmarks/transport.py`` made for ``name``;
    ``management``: with the management endpoint on a free port."""
    files = certs / name
    return NodeConfig(
        cluster_name=CLUSTER,
        node_name=name,
        bind_host=HOST,
        bind_port=port,
        roles=roles,
        tls=TlsFiles(
            ca_file=files / "ca.pem",
            cert_file=files / "node.pem",
            key_file=files / "node-key.pem",
        ),
        log_level="WARNING",
        management=ManagementSettings(enabled=management, port=0),
    )


async def _scrape(state: State, node: Node, interval: float) -> None:
    """Fetch the node's metrics as a Prometheus server would, every ``interval`` seconds."""
    async with httpx.AsyncClient(base_url=f"http://{node.management_address}") as http:
        while True:
            answer = await http.get("/metrics")
            answer.raise_for_status()
            state.scrapes += 1
            await trio.sleep(interval)


async def _run_node(
    state: State,
    config: NodeConfig,
    join: Address,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    closed = state.node_closed = trio.Event()
    try:
        with trio.CancelScope() as scope:
            state.node_scope = scope
            async with open_node(config) as node, trio.open_nursery() as nursery:
                state.node = node
                node.cluster.join(join)
                if state.scrape_interval is not None:
                    nursery.start_soon(_scrape, state, node, state.scrape_interval)
                task_status.started()
                await trio.sleep_forever()
    finally:
        state.node = state.region = None
        closed.set()


# ---- commands: the node -------------------------------------------------------------------------


async def cmd_open(
    state: State, name: str, port: int, roles: list[str], join: str
) -> dict[str, Any]:
    """Open a node and join ``join`` (this node's own address: form a cluster)."""
    if state.node is not None:
        raise WorkerError("a node is open already")
    host, _, join_port = join.rpartition(":")
    config = node_config(
        state.certs, name, port, tuple(roles), management=state.scrape_interval is not None
    )
    await state.nursery.start(_run_node, state, config, Address(host, int(join_port)))
    return {"address": str(state.need_node().address)}


async def cmd_wait_up(state: State, members: int, limit: float) -> dict[str, Any]:
    """Wait until this node sees ``members`` members, all Up, with converged gossip."""
    node = state.need_node()
    started = time.perf_counter()
    with trio.move_on_after(limit):
        # Polled: "every member Up and converged" is no single event.
        while not (  # noqa: ASYNC110
            len(node.cluster.members) == members
            and all(m.status is MemberStatus.UP for m in node.cluster.members)
            and node.cluster.has_converged()
        ):
            await trio.sleep(_POLL)
        return {"seconds": time.perf_counter() - started}
    seen = [f"{m.node.name} {m.status.name}" for m in node.cluster.members]
    raise WorkerError(f"not {members} members Up within {limit:g} s: {seen}")


async def cmd_start_type(
    state: State, shards: int, passivate: bool, measured: int, measured_shards: int
) -> dict[str, Any]:
    """Start ``Counter`` (role ``host``: a proxy on a node without it) with ``shards`` shards.

    Measured entities are ``measured`` ids in shards ``[0, measured_shards)``; first messages go
    to one fresh id per shard in ``[measured_shards, shards)``.
    """
    node = state.need_node()
    extractor = HashExtractor(shards)
    settings = ShardingSettings() if passivate else ShardingSettings(passivate_idle_after=None)
    state.region = await node.sharding.start(
        TYPE_NAME, Counter, extractor=extractor, settings=settings, role=HOST_ROLE
    )
    state.extractor = extractor
    state.measured_ids = ids_in_shards(extractor, "e-", measured, range(measured_shards))
    state.fresh_ids = iter(
        one_id_per_shard(extractor, "f-", range(measured_shards, shards)).values()
    )
    return {"proxy": state.region.is_proxy, "measured_ids": len(state.measured_ids)}


async def cmd_close(state: State, limit: float) -> dict[str, Any]:
    """Stop the node at once (no graceful leave: the benchmark of this cluster is over)."""
    if state.node_scope is None or state.node_closed is None:
        return {}
    state.node_scope.cancel()
    with trio.fail_after(limit):
        await state.node_closed.wait()
    state.node_scope = state.node_closed = None
    return {}


def cmd_count_start(state: State, mark: int, target: int, profile: str | None) -> dict[str, Any]:
    """Count handled messages from zero; note the times at ``mark`` and ``target``."""
    TALLY.reset(mark=mark, target=target)
    state.profile_start(profile)
    return {}


async def cmd_count_wait(state: State, limit: float, profile: str | None) -> dict[str, Any]:
    """Wait until ``target`` messages were handled since ``count_start``."""
    done = TALLY.done
    if done is None:
        raise WorkerError("count_wait without count_start")
    with trio.move_on_after(limit):
        await done.wait()
    state.profile_stop(profile)
    if not done.is_set():
        raise WorkerError(f"{TALLY.handled} of {TALLY.target} messages handled in {limit:g} s")
    return {
        "mark_at": TALLY.mark_at,
        "target_at": TALLY.target_at,
        "cpu_s": TALLY.target_cpu - TALLY.mark_cpu,
        "handled": TALLY.handled,
    }


async def cmd_tell(
    state: State, count: int, entities: int | None, profile: str | None
) -> dict[str, Any]:
    """Tell ``count`` messages, round robin over the measured entities (or their first few)."""
    region = state.need_region()
    ids = state.measured_ids[:entities] if entities else state.measured_ids
    refs = [region.entity_ref(entity_id) for entity_id in ids]
    message = Add(1)
    n = len(refs)
    state.profile_start(profile)
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(count):
        await refs[i % n].tell(message)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    state.profile_stop(profile)
    return {"elapsed_s": elapsed, "cpu_s": cpu}


async def cmd_ask_seq(state: State, count: int, warmup: int, profile: str | None) -> dict[str, Any]:
    """Asks one at a time, round robin over the measured entities: latency and rate."""
    region = state.need_region()
    refs = [region.entity_ref(entity_id) for entity_id in state.measured_ids]
    message = Add(1)
    for i in range(warmup):
        await refs[i % len(refs)].ask(message, timeout=ASK_TIMEOUT)
    samples: list[float] = []
    state.profile_start(profile)
    started = time.perf_counter()
    for i in range(count):
        sent = time.perf_counter()
        await refs[i % len(refs)].ask(message, timeout=ASK_TIMEOUT)
        samples.append(time.perf_counter() - sent)
    elapsed = time.perf_counter() - started
    state.profile_stop(profile)
    return {**latency_summary(samples), "per_s": count / elapsed, "elapsed_s": elapsed}


async def cmd_ask_concurrent(
    state: State, askers: int, count: int, warmup: int, profile: str | None
) -> dict[str, Any]:
    """``askers`` tasks asking one after another (``count`` asks in all): rate and latency."""
    region = state.need_region()
    refs = [region.entity_ref(entity_id) for entity_id in state.measured_ids]
    message = Add(1)
    samples: list[float] = []

    async def asker(first: int, asks: int, record: bool) -> None:
        for i in range(asks):
            ref = refs[(first + i * askers) % len(refs)]
            sent = time.perf_counter()
            await ref.ask(message, timeout=ASK_TIMEOUT)
            if record:
                samples.append(time.perf_counter() - sent)

    async def round_of(total: int, record: bool) -> float:
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for a in range(askers):
                nursery.start_soon(asker, a, total // askers, record)
        return time.perf_counter() - started

    await round_of(warmup, False)
    state.profile_start(profile)
    elapsed = await round_of(count, True)
    state.profile_stop(profile)
    return {
        **latency_summary(samples),
        "per_s": len(samples) / elapsed,
        "elapsed_s": elapsed,
        "askers": askers,
    }


async def cmd_first_asks(
    state: State, samples: int, pause: float, back_to_back: int
) -> dict[str, Any]:
    """Ask entities of never-used shards: ``samples`` after ``pause`` each, then some in a row."""
    region = state.need_region()
    if state.fresh_ids is None:
        raise WorkerError("no entity type started")
    message = Add(1)

    async def first(entity_id: str) -> float:
        sent = time.perf_counter()
        await region.entity_ref(entity_id).ask(message, timeout=ASK_TIMEOUT)
        return time.perf_counter() - sent

    # The unit: one round trip in the same conditions (idle processes after the same pause),
    # an ask to an entity that is warm on the other node.
    warm_ref = region.entity_ref(state.measured_ids[0])
    await warm_ref.ask(message, timeout=ASK_TIMEOUT)
    paused: list[float] = []
    warm: list[float] = []
    for _ in range(samples):
        await trio.sleep(pause)
        sent = time.perf_counter()
        await warm_ref.ask(message, timeout=ASK_TIMEOUT)
        warm.append(time.perf_counter() - sent)
        await trio.sleep(pause)
        paused.append(await first(next(state.fresh_ids)))
    in_a_row: list[float] = []  # right after the last paused one: within the proxy's pause
    for _ in range(back_to_back):
        in_a_row.append(await first(next(state.fresh_ids)))
    return {
        "paused_us": [s * 1e6 for s in paused],
        "warm_paused_us": [s * 1e6 for s in warm],
        "back_to_back_us": [s * 1e6 for s in in_a_row],
    }


# ---- commands: one node on its own --------------------------------------------------------------


async def _activate(region: ShardRegion, ids: list[str], limit: float) -> float:
    """Tell each of ``ids`` once; wait until every message is handled. Returns the seconds."""
    done = TALLY.reset(mark=0, target=len(ids))
    message = Add(1)
    started = time.perf_counter()
    for entity_id in ids:
        await region.entity_ref(entity_id).tell(message)
    with trio.move_on_after(limit):
        await done.wait()
    if not done.is_set():
        raise WorkerError(f"{TALLY.handled} of {len(ids)} activations handled in {limit:g} s")
    return TALLY.target_at - started


async def channel_baseline(count: int) -> float:
    """Messages per second from one task to another through a trio memory channel."""
    send, receive = trio.open_memory_channel[Add](1024)
    message = Add(1)
    received = [0]

    async def receiver() -> None:
        async with receive:
            async for _ in receive:
                received[0] += 1
                if received[0] == count:
                    return

    started = time.perf_counter()
    async with trio.open_nursery() as nursery, send:
        nursery.start_soon(receiver)
        for _ in range(count):
            await send.send(message)
    elapsed = time.perf_counter() - started
    if received[0] != count:
        raise WorkerError(f"the channel baseline received {received[0]} of {count}")
    return count / elapsed


async def local_tells(region: ShardRegion, refs: list[Any], count: int, limit: float) -> float:
    """Messages per second from one task to ``refs`` round robin, until all are handled."""
    done = TALLY.reset(mark=0, target=count)
    message = Add(1)
    n = len(refs)
    started = time.perf_counter()
    for i in range(count):
        await refs[i % n].tell(message)
    with trio.move_on_after(limit):
        await done.wait()
    if not done.is_set():
        raise WorkerError(f"{TALLY.handled} of {count} tells handled in {limit:g} s")
    return count / (TALLY.target_at - started)


async def cmd_local_tell(
    state: State, entities: int, count: int, repeats: int, limit: float, profile: str | None
) -> dict[str, Any]:
    """Tell throughput to ``entities`` warm local entities vs a memory channel, interleaved."""
    region = state.need_region()
    extractor = state.extractor
    assert extractor is not None
    ids = ids_in_shards(extractor, "e-", entities, range(extractor.number_of_shards))
    activation = await _activate(region, ids, limit)
    refs = [region.entity_ref(entity_id) for entity_id in ids]
    ours: list[float] = []
    baseline: list[float] = []
    for run in range(repeats):
        gc.collect()
        if run % 2 == 0:
            baseline.append(await channel_baseline(count))
            ours.append(await local_tells(region, refs, count, limit))
        else:
            ours.append(await local_tells(region, refs, count, limit))
            baseline.append(await channel_baseline(count))
    profiled = None
    if profile:
        state.profile_start(profile)
        profiled = await local_tells(region, refs, count, limit)
        state.profile_stop(profile)
    stats = region.statistics()
    return {
        "ours_per_s": ours,
        "baseline_per_s": baseline,
        "activation_s": activation,
        "entities": stats.entities,
        "shards": stats.shards,
        "profiled_per_s": profiled,
    }


async def cmd_idle_entities(
    state: State, count: int, limit: float, profile: str | None
) -> dict[str, Any]:
    """Activate ``count`` entities with one tell each: RSS growth per entity, activations/s."""
    region = state.need_region()
    extractor = state.extractor
    assert extractor is not None
    # Every shard hosted first, so the growth is the entities' (and their share of the dicts).
    warm = one_id_per_shard(extractor, "w-", range(extractor.number_of_shards))
    await _activate(region, list(warm.values()), limit)
    message = Add(1)
    done = TALLY.reset(mark=0, target=count)
    gc.collect()
    before = rss_bytes()
    state.profile_start(profile)
    started = time.perf_counter()
    for i in range(count):
        await region.entity_ref(f"i-{i:07d}").tell(message)
    with trio.move_on_after(limit):
        await done.wait()
    state.profile_stop(profile)
    if not done.is_set():
        raise WorkerError(f"{TALLY.handled} of {count} activations handled in {limit:g} s")
    elapsed = TALLY.target_at - started
    gc.collect()
    after = rss_bytes()
    stats = region.statistics()
    return {
        "count": count,
        "entities": stats.entities,
        "shards": stats.shards,
        "rss_before": before,
        "rss_after": after,
        "bytes_per_entity": (after - before) / count,
        "activations_per_s": count / elapsed,
        "elapsed_s": elapsed,
    }


# ---- commands: the transport baselines ----------------------------------------------------------


def _job(
    state: State,
    role: transport_bench.Role,
    kind: str,
    size: int,
    count: int,
    warmup: int,
    port: int,
    limit: float,
) -> transport_bench.Job:
    workload = transport_bench.Workload(
        key=f"{kind}_{size}b",
        kind="oneway" if kind == "oneway" else "pingpong",
        size=size,
        count=count,
        warmup=warmup,
    )
    return transport_bench.Job(
        impl="ours",
        role=role,
        workload=workload,
        certs=state.certs,
        port=port,
        timeout=limit,
        parent_pid=os.getppid(),
        profile=None,
        run=0,
    )


async def cmd_server_start(
    state: State, kind: str, size: int, count: int, warmup: int, limit: float
) -> dict[str, Any]:
    """Start ``benchmarks/transport.py``'s "ours" one-way or ping-pong server; its port."""
    job = _job(state, "server", kind, size, count, warmup, 0, limit)
    server: Callable[..., Awaitable[dict[str, float] | None]] = (
        transport_bench.ours_oneway_server
        if kind == "oneway"
        else transport_bench.ours_pingpong_server
    )
    background = state.background[kind] = Background()

    def ready(port: int) -> None:
        background.port = port
        background.listening.set()

    async def run() -> None:
        try:
            with trio.fail_after(limit):
                result = await server(job, ready)
            background.result = dict(result or {})
        except Exception as exc:
            background.error = f"{type(exc).__name__}: {exc}"
        finally:
            background.listening.set()
            background.done.set()

    state.nursery.start_soon(run)
    with trio.fail_after(limit):
        await background.listening.wait()
    if background.error:
        raise WorkerError(background.error)
    return {"port": background.port}


async def cmd_collect(state: State, kind: str, limit: float) -> dict[str, Any]:
    """The result of the background server of ``kind``."""
    background = state.background.pop(kind, None)
    if background is None:
        raise WorkerError(f"no {kind} server running")
    with trio.fail_after(limit):
        await background.done.wait()
    if background.error:
        raise WorkerError(background.error)
    return background.result or {}


async def cmd_oneway_client(
    state: State, port: int, size: int, count: int, warmup: int, limit: float
) -> dict[str, Any]:
    """``benchmarks/transport.py``'s "ours" one-way client."""
    job = _job(state, "client", "oneway", size, count, warmup, port, limit)
    with trio.fail_after(limit):
        await transport_bench.ours_oneway_client(job, lambda port: None)
    return {}


async def cmd_pingpong_client(
    state: State, port: int, size: int, count: int, warmup: int, limit: float
) -> dict[str, Any]:
    """``benchmarks/transport.py``'s "ours" ping-pong client, reporting the rate as well."""
    certs = state.certs
    data = transport_bench.payload_data(size)
    target = Address(HOST, port)
    rtts: list[float] = []
    replies: list[transport_bench.Payload] = []
    arrived = trio.Event()
    measured_from = 0.0
    with trio.fail_after(limit):
        async with open_tcp_transport(
            transport_bench.identity(certs, transport_bench.CLIENT_NODE),
            transport_bench.CLIENT_NODE,
            Address(HOST, 0),
        ) as transport:

            def handle(envelope: Any) -> None:
                replies.append(transport_bench._ours_payload(envelope.message))
                arrived.set()

            transport.set_handler(handle)
            for seq in range(warmup + count):
                if seq == warmup:
                    measured_from = time.perf_counter()
                sent = time.perf_counter()
                transport.send_nowait(target, transport_bench.Payload(seq=seq, data=data))
                await arrived.wait()
                rtt = time.perf_counter() - sent
                arrived = trio.Event()
                transport_bench._check_seq(replies.pop().seq, seq)
                if seq >= warmup:
                    rtts.append(rtt)
            elapsed = time.perf_counter() - measured_from
            await transport.send(target, transport_bench.Payload(seq=transport_bench.ACK, data=b""))
    return {**latency_summary(rtts), "per_s": count / elapsed, "elapsed_s": elapsed}


# ---- the command loop ---------------------------------------------------------------------------


async def run_command(state: State, command: dict[str, Any]) -> dict[str, Any]:
    """Carry out one command."""
    args = {k: v for k, v in command.items() if k != "cmd"}
    match command["cmd"]:
        case "open":
            return await cmd_open(state, **args)
        case "wait_up":
            return await cmd_wait_up(state, **args)
        case "start_type":
            return await cmd_start_type(state, **args)
        case "close":
            return await cmd_close(state, **args)
        case "count_start":
            return cmd_count_start(state, **args)
        case "count_wait":
            return await cmd_count_wait(state, **args)
        case "tell":
            return await cmd_tell(state, **args)
        case "ask_seq":
            return await cmd_ask_seq(state, **args)
        case "ask_concurrent":
            return await cmd_ask_concurrent(state, **args)
        case "first_asks":
            return await cmd_first_asks(state, **args)
        case "local_tell":
            return await cmd_local_tell(state, **args)
        case "idle_entities":
            return await cmd_idle_entities(state, **args)
        case "server_start":
            return await cmd_server_start(state, **args)
        case "collect":
            return await cmd_collect(state, **args)
        case "oneway_client":
            return await cmd_oneway_client(state, **args)
        case "pingpong_client":
            return await cmd_pingpong_client(state, **args)
        case "profile_start":
            state.profile_start(args["path"])
            return {}
        case "profile_stop":
            state.profile_stop(args["path"])
            return {}
    raise WorkerError(f"unknown command {command!r}")


async def serve(certs: Path, lifetime: float, scrape_interval: float | None = None) -> None:
    """Answer commands until "stop", the end of stdin, or the end of ``lifetime``."""
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))

    async def answer(message: dict[str, Any]) -> None:
        await stdout.send_all((json.dumps(message) + "\n").encode())

    with trio.fail_after(lifetime):
        async with (
            stdout,
            trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin,
            trio.open_nursery() as nursery,
        ):
            state = State(certs=certs, nursery=nursery, scrape_interval=scrape_interval)
            await answer({"event": "ready", "pid": os.getpid()})
            lines = Lines(stdin)
            while (line := await lines.readline()) is not None:
                command = json.loads(line)
                if command["cmd"] == "stop":
                    break
                try:
                    result = await run_command(state, command)
                except Exception as exc:  # reported to the orchestrator, which aborts
                    logging.getLogger("bench").exception("%s failed", command["cmd"])
                    await answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                else:
                    await answer({"ok": True, **result})
            nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """Run one worker process."""
    parser = argparse.ArgumentParser(description="node process of benchmarks/sharding.py")
    parser.add_argument("--certs", type=Path, required=True)
    parser.add_argument("--lifetime", type=float, default=600.0)
    parser.add_argument(
        "--scrape-interval",
        type=float,
        help="serve [management] and fetch GET /metrics every so many seconds",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    trio.run(serve, args.certs, args.lifetime, args.scrape_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
