"""Transport benchmark: our TCP + TLS transport against the ceiling for Python, in one run.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.transport            # full run, a few minutes
    .venv/bin/python -m benchmarks.transport --quick    # smaller counts, under 60 s
    .venv/bin/python -m benchmarks.transport --json     # one JSON object instead of the table
    .venv/bin/python -m benchmarks.transport --quick --profile /tmp/prof
        # also cProfile every child process into /tmp/prof/<run>-<impl>-<workload>-<role>.prof
        # (read with: python -m pstats FILE); profiling slows both sides, so the rates printed
        # in that mode are not comparable with normal runs

What it measures: two OS processes on 127.0.0.1 talk over mutual TLS 1.3 with certificates made
for the run (``membership.transport._certs``) and SSL contexts from
``membership.transport._tls.TlsIdentity``, so both implementations do exactly the same
cryptography. Each process runs its own ``trio.run``.

- **ours**: ``membership.transport._tcp.open_tcp_transport`` on each side, a registered attrs
  message (``bench.Payload``) sent with ``await transport.send(...)`` and received by a handler
  (``transport.set_handler``, the path a node's dispatcher uses); a reply
  goes over the replier's own outbound link, as the transport always does. Its TLS runs in
  ``membership.transport._tlslink.TlsLink`` (the same ``ssl`` objects and contexts as
  ``trio.SSLStream``, without its scheduler passes, and with writes that need not wait).
- **ceiling**: one raw ``trio.SSLStream``; the sender ``msgpack.packb``-s ``[seq, data]`` into
  4-byte-length-prefixed frames and writes up to 64 frames per ``send_all``; the receiver splits
  frames and ``msgpack.unpackb``-s each one. No routing, no queues, no envelope: the least work any
  Python implementation of a message transport must do.

Workloads, each for both implementations:

1. ``oneway_100b``: one-way throughput, 100-byte payloads. The sender sends warm-up messages and
   then N measured ones without a pause; the receiver's clock runs from the last warm-up message
   (the start marker) to the N-th measured one. Rate = N / that time, in messages per second.
2. ``oneway_10k``: the same with 10 KiB payloads.
3. ``pingpong_100b``: one 100-byte message in flight at a time, echoed back; after warm-up round
   trips, K round trips are timed by the initiator; p50 and p99 in microseconds.

Every measurement starts fresh processes (so connection set-up and first-use costs fall in the
warm-up) and is repeated (3 times with ``--quick``, 5 otherwise) with ours and the ceiling
interleaved and the first of each pair alternating, so a burst of noise on this shared machine hits
both sides alike. Absolute numbers are medians over the runs; a ratio is the median of the per-run
ratios, each from an ours/ceiling pair measured back to back. Progress lines go to stderr. Each
measurement has a hard time limit, enforced in the parent and in both children, that aborts the
benchmark with an error naming the measurement; child processes are stopped on every exit path,
Ctrl-C included.

Targets and how to read the ratios: a ratio is "ours as a fraction of the ceiling", so higher is
better in every row and 1.0 means "as fast as the bare minimum" done through ``trio.SSLStream``.
Ours can pass 1.0 where its leaner TLS layer saves more than its envelope and queues cost.

- ``oneway_100b_ratio`` = ours msgs/s / ceiling msgs/s; target >= 0.6. Per-message overhead:
  queues, scheduling, envelope, building the message object (which the ceiling never does).
- ``oneway_10k_ratio`` = ours msgs/s / ceiling msgs/s; no target. Per-byte costs (TLS, copies)
  weigh more here, so it shows what batching and copying cost on large messages.
- ``pingpong_ratio`` = ceiling p50 / ours p50; target >= 0.8. Latency: the work between a
  frame's arrival and the next one's write on each side. Ours replies from the handler straight
  onto its idle link (no link writer task in between); the initiator's reply still goes from
  the link reader's handler to the waiting task, a scheduler pass the ceiling does not make.
"""

from __future__ import annotations

import cProfile
import json
import logging
import multiprocessing
import os
import signal
import statistics
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any, Literal

import attrs
import msgpack
import trio

from benchmarks._report import benchmark_parser, quantiles_us
from membership import Address, Envelope, UniqueAddress, message
from membership.transport._certs import create_cluster_ca, create_node_certificate
from membership.transport._tcp import open_tcp_transport
from membership.transport._tls import TlsIdentity

CLUSTER = "bench"
SERVER_NODE = "bench-server"
CLIENT_NODE = "bench-client"
HOST = "127.0.0.1"
READ_SIZE = 1 << 16
"""Bytes per ``receive_some`` for the ceiling, as ``membership.transport._tcp`` reads."""
CEILING_BATCH = 64
"""Frames the ceiling sender joins into one ``send_all``."""
ONEWAY_TARGET = 0.6
PINGPONG_TARGET = 0.8
ACK = -1
"""Sequence number of control messages (the one-way ack, the reverse-link opener)."""

_LENGTH = struct.Struct(">I")
_WATCH_INTERVAL = 0.5

Impl = Literal["ours", "ceiling"]
Role = Literal["server", "client"]


class BenchmarkError(Exception):
    """A measurement failed: a child crashed, timed out or saw wrong data."""


@message(name="bench.Payload")
@attrs.frozen(kw_only=True)
class Payload:
    """The benchmark message: a sequence number and an opaque payload."""

    seq: int
    data: bytes


@attrs.frozen(kw_only=True)
class Workload:
    """One workload: what is sent, how many times, after how much warm-up."""

    key: str
    kind: Literal["oneway", "pingpong"]
    size: int
    """Payload bytes per message."""
    count: int
    """Measured messages (one-way) or round trips (ping-pong)."""
    warmup: int
    """Messages or round trips before the measured ones, not timed."""


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    workloads: tuple[Workload, ...]
    repeats: int
    timeout: float
    """Hard limit per measurement, in seconds, from starting its processes to their exit."""


def make_plan(*, quick: bool, repeats: int | None) -> Plan:
    """The quick plan fits in under a minute; the full one takes a few minutes."""
    scale = 1 if quick else 3
    workloads = (
        Workload(
            key="oneway_100b",
            kind="oneway",
            size=100,
            count=80_000 * scale,
            warmup=20_000,
        ),
        Workload(
            key="oneway_10k",
            kind="oneway",
            size=10 * 1024,
            count=10_000 * scale,
            warmup=2_000,
        ),
        Workload(
            key="pingpong_100b",
            kind="pingpong",
            size=100,
            count=1_500 * scale,
            warmup=300,
        ),
    )
    return Plan(
        workloads=workloads,
        repeats=repeats or (3 if quick else 5),
        timeout=20.0 if quick else 90.0,
    )


# ---- child processes ----


@attrs.frozen(kw_only=True)
class Job:
    """What one child process does; pickled to it by multiprocessing."""

    impl: Impl
    role: Role
    workload: Workload
    certs: Path
    port: int
    timeout: float
    parent_pid: int
    profile: Path | None
    run: int


def identity(certs: Path, node: str) -> TlsIdentity:
    """The credentials of ``node`` made by :func:`make_certificates`."""
    files = certs / node
    return TlsIdentity(CLUSTER, files / "ca.pem", files / "node.pem", files / "node-key.pem")


def make_certificates(root: Path) -> None:
    """A cluster CA and a certificate for each of the two nodes."""
    create_cluster_ca(CLUSTER, root / "ca")
    for node in (SERVER_NODE, CLIENT_NODE):
        create_node_certificate(node, root / "ca", root / node)


def payload_data(size: int) -> bytes:
    """Incompressible bytes (TLS 1.3 does not compress, but be sure)."""
    return os.urandom(size)


def _check_seq(got: object, expected: int) -> int:
    if got != expected:
        raise BenchmarkError(f"expected message {expected}, got {got!r}: lost or reordered")
    return expected + 1


# ---- ours ----


def _ours_payload(envelope_message: object) -> Payload:
    if not isinstance(envelope_message, Payload):
        raise BenchmarkError(f"unexpected message {envelope_message!r}")
    return envelope_message


async def ours_oneway_server(job: Job, ready: Callable[[int], None]) -> dict[str, float]:
    """Count the sender's messages in a handler, as a node's dispatcher receives them."""
    w = job.workload
    total = w.warmup + w.count
    state = {"expected": 0, "start": 0.0, "end": 0.0}
    senders: list[UniqueAddress] = []
    done = trio.Event()
    async with open_tcp_transport(
        identity(job.certs, SERVER_NODE), SERVER_NODE, Address(HOST, 0)
    ) as transport:

        def handle(envelope: Envelope) -> None:
            expected = _check_seq(_ours_payload(envelope.message).seq, int(state["expected"]))
            state["expected"] = expected
            if expected == 1:
                # Open our link back now, in the warm-up, so the final ack does not wait for a
                # connection (and closing the transport flushes it).
                senders.append(envelope.sender)
                transport.send_nowait(envelope.sender, Payload(seq=ACK, data=b""))
            if expected == w.warmup:
                state["start"] = time.perf_counter()
            elif expected == total:
                state["end"] = time.perf_counter()
                done.set()

        transport.set_handler(handle)
        ready(transport.local_address.address.port)
        await done.wait()
        transport.set_handler(None)
        elapsed = state["end"] - state["start"]
        await transport.send(senders[0], Payload(seq=ACK, data=b""))
    return {"msgs_per_s": w.count / elapsed, "elapsed_s": elapsed}


async def ours_oneway_client(job: Job, ready: Callable[[int], None]) -> None:
    """Send every message as fast as ``send`` takes them, then wait for the receiver's ack."""
    w = job.workload
    data = payload_data(w.size)
    target = Address(HOST, job.port)
    async with open_tcp_transport(
        identity(job.certs, CLIENT_NODE), CLIENT_NODE, Address(HOST, 0)
    ) as transport:
        for seq in range(w.warmup + w.count):
            await transport.send(target, Payload(seq=seq, data=data))
        for _ in range(2):  # the reverse-link opener, then the final ack
            ack = _ours_payload((await transport.receive()).message)
            if ack.seq != ACK:
                raise BenchmarkError(f"expected an ack, got message {ack.seq}")


async def ours_pingpong_server(job: Job, ready: Callable[[int], None]) -> None:
    """Echo every message back to its sender's incarnation, from a handler."""
    w = job.workload
    total = w.warmup + w.count
    state = {"expected": 0}
    done = trio.Event()
    async with open_tcp_transport(
        identity(job.certs, SERVER_NODE), SERVER_NODE, Address(HOST, 0)
    ) as transport:

        def handle(envelope: Envelope) -> None:
            ping = _ours_payload(envelope.message)
            if ping.seq == ACK and state["expected"] == total:
                done.set()
                return
            state["expected"] = _check_seq(ping.seq, state["expected"])
            if state["expected"] > total:
                raise BenchmarkError(f"more than the {total} pings expected")
            transport.send_nowait(envelope.sender, Payload(seq=ping.seq, data=ping.data))

        transport.set_handler(handle)
        ready(transport.local_address.address.port)
        await done.wait()


async def ours_pingpong_client(job: Job, ready: Callable[[int], None]) -> dict[str, float]:
    """Time round trips, one in flight; replies arrive through a handler."""
    w = job.workload
    data = payload_data(w.size)
    target = Address(HOST, job.port)
    rtts: list[float] = []
    replies: list[Payload] = []
    arrived = trio.Event()
    async with open_tcp_transport(
        identity(job.certs, CLIENT_NODE), CLIENT_NODE, Address(HOST, 0)
    ) as transport:

        def handle(envelope: Envelope) -> None:
            replies.append(_ours_payload(envelope.message))
            arrived.set()

        transport.set_handler(handle)
        for seq in range(w.warmup + w.count):
            sent = time.perf_counter()
            transport.send_nowait(target, Payload(seq=seq, data=data))
            await arrived.wait()
            rtt = time.perf_counter() - sent
            arrived = trio.Event()
            _check_seq(replies.pop().seq, seq)
            if seq >= w.warmup:
                rtts.append(rtt)
        await transport.send(target, Payload(seq=ACK, data=b""))
    return _latency(rtts)


# ---- ceiling ----


class FrameReader:
    """Splits a stream into length-prefixed frames and unpacks each: nothing more."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def messages(self) -> list[Any]:
        """Read until at least one whole frame is in; return all whole frames, unpacked."""
        buffer = self._buffer
        while True:
            out: list[Any] = []
            offset = 0
            end = len(buffer)
            with memoryview(buffer) as view:
                while end - offset >= 4:
                    (size,) = _LENGTH.unpack_from(buffer, offset)
                    stop = offset + 4 + size
                    if stop > end:
                        break
                    out.append(msgpack.unpackb(view[offset + 4 : stop]))
                    offset = stop
            if offset:
                del buffer[:offset]
            if out:
                return out
            data = await self._stream.receive_some(READ_SIZE)
            if not data:
                raise BenchmarkError("the peer closed the stream early")
            buffer += data


def frame(seq: int, data: bytes) -> bytes:
    """One ceiling frame: length prefix and ``msgpack.packb([seq, data])``."""
    body: bytes = msgpack.packb([seq, data])
    return _LENGTH.pack(len(body)) + body


async def _ceiling_accept(job: Job, ready: Callable[[int], None]) -> trio.SSLStream[Any]:
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    try:
        ready(listeners[0].socket.getsockname()[1])
        tcp = await listeners[0].accept()
    finally:
        for listener in listeners:
            await listener.aclose()
    stream = trio.SSLStream(
        tcp, identity(job.certs, SERVER_NODE).server_context(), server_side=True
    )
    await stream.do_handshake()
    return stream


async def _ceiling_connect(job: Job) -> trio.SSLStream[Any]:
    tcp = await trio.open_tcp_stream(HOST, job.port)
    stream = trio.SSLStream(
        tcp, identity(job.certs, CLIENT_NODE).client_context(), server_hostname=None
    )
    await stream.do_handshake()
    return stream


async def ceiling_oneway_server(job: Job, ready: Callable[[int], None]) -> dict[str, float]:
    """Count frames; time from the last warm-up one to the last measured one; ack with a byte."""
    w = job.workload
    stream = await _ceiling_accept(job, ready)
    async with stream:
        reader = FrameReader(stream)
        expected = 0
        total = w.warmup + w.count
        start = 0.0
        while expected < total:  # bounded: each round consumes at least one frame
            for seq, _data in await reader.messages():
                expected = _check_seq(seq, expected)
                if expected == w.warmup:
                    start = time.perf_counter()
        elapsed = time.perf_counter() - start
        await stream.send_all(b"!")
    return {"msgs_per_s": w.count / elapsed, "elapsed_s": elapsed}


async def ceiling_oneway_client(job: Job, ready: Callable[[int], None]) -> None:
    """Send frames in batches of up to 64 per write, then wait for the receiver's ack."""
    w = job.workload
    data = payload_data(w.size)
    stream = await _ceiling_connect(job)
    async with stream:
        batch: list[bytes] = []
        for seq in range(w.warmup + w.count):
            body: bytes = msgpack.packb([seq, data])
            batch.append(_LENGTH.pack(len(body)) + body)
            if len(batch) == CEILING_BATCH:
                await stream.send_all(b"".join(batch))
                batch.clear()
        if batch:
            await stream.send_all(b"".join(batch))
        if not await stream.receive_some(1):
            raise BenchmarkError("the receiver closed the stream without an ack")


async def ceiling_pingpong_server(job: Job, ready: Callable[[int], None]) -> None:
    """Echo every frame back on the same stream."""
    w = job.workload
    stream = await _ceiling_accept(job, ready)
    async with stream:
        reader = FrameReader(stream)
        expected = 0
        while expected < w.warmup + w.count:  # bounded: each round consumes at least one frame
            replies = []
            for seq, data in await reader.messages():
                expected = _check_seq(seq, expected)
                replies.append(frame(seq, data))
            await stream.send_all(b"".join(replies))


async def ceiling_pingpong_client(job: Job, ready: Callable[[int], None]) -> dict[str, float]:
    """Time round trips, one in flight."""
    w = job.workload
    data = payload_data(w.size)
    rtts: list[float] = []
    stream = await _ceiling_connect(job)
    async with stream:
        reader = FrameReader(stream)
        for seq in range(w.warmup + w.count):
            sent = time.perf_counter()
            await stream.send_all(frame(seq, data))
            replies = await reader.messages()
            rtt = time.perf_counter() - sent
            if len(replies) != 1:
                raise BenchmarkError(f"expected one reply, got {len(replies)}")
            _check_seq(replies[0][0], seq)
            if seq >= w.warmup:
                rtts.append(rtt)
    return _latency(rtts)


def _latency(rtts: list[float]) -> dict[str, float]:
    if len(rtts) < 2:
        raise statistics.StatisticsError("must have at least two data points")
    return quantiles_us(rtts)


RoleFunction = Callable[[Job, Callable[[int], None]], Awaitable[dict[str, float] | None]]
ROLES: dict[tuple[Impl, str, Role], RoleFunction] = {
    ("ours", "oneway", "server"): ours_oneway_server,
    ("ours", "oneway", "client"): ours_oneway_client,
    ("ours", "pingpong", "server"): ours_pingpong_server,
    ("ours", "pingpong", "client"): ours_pingpong_client,
    ("ceiling", "oneway", "server"): ceiling_oneway_server,
    ("ceiling", "oneway", "client"): ceiling_oneway_client,
    ("ceiling", "pingpong", "server"): ceiling_pingpong_server,
    ("ceiling", "pingpong", "client"): ceiling_pingpong_client,
}


async def _watch_parent(parent_pid: int, checks: int) -> None:
    """End this child if the benchmark process died without cleaning up."""
    for _ in range(checks):
        if os.getppid() != parent_pid:
            raise BenchmarkError("the benchmark process went away")
        await trio.sleep(_WATCH_INTERVAL)


async def _child_main(job: Job, conn: Connection) -> dict[str, float] | None:
    function = ROLES[job.impl, job.workload.kind, job.role]
    result: dict[str, float] | None = None
    with trio.fail_after(job.timeout):
        async with trio.open_nursery() as nursery:
            checks = int(job.timeout / _WATCH_INTERVAL) + 1  # outlasts the fail_after around it
            nursery.start_soon(_watch_parent, job.parent_pid, checks)
            result = await function(job, lambda port: conn.send(("ready", port)))
            nursery.cancel_scope.cancel()
    return result


def _describe_error(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    if isinstance(exc, BenchmarkError):
        return str(exc)
    return "".join(traceback.format_exception(exc)).rstrip()


def child_entry(job: Job, conn: Connection) -> None:
    """Run one role in this (spawned) process and send its outcome to the parent."""
    # The parent ends us on Ctrl-C (it may be mid-measurement and must report cleanly).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # Links closing at the end of a run are normal here; real failures raise.
    logging.getLogger("membership").setLevel(logging.ERROR)
    profiler = cProfile.Profile() if job.profile else None
    try:
        if profiler:
            profiler.enable()
        try:
            result = trio.run(_child_main, job, conn)
        finally:
            if profiler and job.profile:
                profiler.disable()
                name = f"{job.run}-{job.impl}-{job.workload.key}-{job.role}.prof"
                profiler.dump_stats(job.profile / name)
    except Exception as exc:
        conn.send(("error", _describe_error(exc)))
        conn.close()
        sys.exit(1)
    conn.send(("done", result))
    conn.close()


# ---- the parent ----


class Measurement:
    """The two processes of one measurement, reaped whatever happens."""

    def __init__(self, ctx: SpawnContext, what: str, timeout: float) -> None:
        self._ctx = ctx
        self._what = what
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self._processes: dict[Role, SpawnProcess] = {}
        self._pipes: dict[Connection, Role] = {}
        self._outcomes: dict[Role, dict[str, float] | None] = {}

    def start(self, job: Job) -> None:
        """Start the child process of ``job.role``."""
        reader, writer = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(
            target=child_entry, args=(job, writer), name=f"{self._what} {job.role}", daemon=True
        )
        self._processes[job.role] = process
        self._pipes[reader] = job.role
        # SIGINT stays blocked in the child until it ignores it (see child_entry): a Ctrl-C during
        # its start-up must not print a traceback there; here it is delivered right after.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        writer.close()  # ours is closed so that reader sees EOF when the child exits

    def next_event(self) -> tuple[Role, str, Any]:
        """The next message from either child; raises on an error, early exit or timeout."""
        remaining = self._deadline - time.monotonic()
        ready = wait(list(self._pipes), timeout=max(remaining, 0.0)) if self._pipes else []
        if not ready:
            raise BenchmarkError(
                f"{self._what}: no result within the {self._timeout:g} s limit; aborted"
            )
        reader = ready[0]
        assert isinstance(reader, Connection)
        role = self._pipes[reader]
        try:
            kind, value = reader.recv()
        except EOFError:
            del self._pipes[reader]
            process = self._processes[role]
            process.join(1)
            raise BenchmarkError(
                f"{self._what}: the {role} process exited (code {process.exitcode}) "
                "without a result"
            ) from None
        if kind == "error":
            raise BenchmarkError(f"{self._what}: the {role} process failed: {value}")
        if kind == "done":
            del self._pipes[reader]
            reader.close()
            self._outcomes[role] = value
        return role, kind, value

    def wait_ready(self) -> int:
        """The port the server process listens on."""
        while True:
            role, kind, value = self.next_event()
            if role == "server" and kind == "ready":
                return int(value)
            if kind == "done":
                raise BenchmarkError(f"{self._what}: the {role} process ended before the start")

    def wait_done(self) -> dict[Role, dict[str, float] | None]:
        """Both processes' results, after both exited."""
        while self._pipes:
            self.next_event()
        for role, process in self._processes.items():
            process.join(max(self._deadline - time.monotonic(), 0.1))
            if process.exitcode is None:
                raise BenchmarkError(
                    f"{self._what}: the {role} process did not exit within the "
                    f"{self._timeout:g} s limit"
                )
            if process.exitcode != 0:
                raise BenchmarkError(
                    f"{self._what}: the {role} process ended with code {process.exitcode}"
                )
        return self._outcomes

    def reap(self) -> None:
        """Stop whatever still runs (after an error, a timeout or Ctrl-C)."""
        for reader in self._pipes:
            reader.close()
        self._pipes.clear()
        for process in self._processes.values():
            if process.is_alive():
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
                process.join(2)


def measure(
    ctx: SpawnContext,
    impl: Impl,
    workload: Workload,
    *,
    certs: Path,
    plan: Plan,
    run: int,
    profile: Path | None,
) -> dict[str, float]:
    """Run one measurement in two fresh processes; the measuring side's numbers."""
    what = f"{workload.key} {impl} (run {run + 1})"
    measurement = Measurement(ctx, what, plan.timeout)

    def job(role: Role, port: int) -> Job:
        return Job(
            impl=impl,
            role=role,
            workload=workload,
            certs=certs,
            port=port,
            timeout=plan.timeout + 5,  # the parent's limit fires first, with a clearer message
            parent_pid=os.getpid(),
            profile=profile,
            run=run,
        )

    try:
        measurement.start(job("server", 0))
        port = measurement.wait_ready()
        measurement.start(job("client", port))
        outcomes = measurement.wait_done()
    finally:
        measurement.reap()
    result = outcomes["server" if workload.kind == "oneway" else "client"]
    if result is None:
        raise BenchmarkError(f"{what}: the measuring process returned no numbers")
    return result


def run_all(plan: Plan, *, profile: Path | None, progress: bool) -> dict[str, Any]:
    """Every measurement, interleaved; medians, ratios and the raw runs."""
    ctx = multiprocessing.get_context("spawn")
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="p2pshard-bench-") as tmp:
        certs = Path(tmp)
        make_certificates(certs)
        for run in range(plan.repeats):
            order: tuple[Impl, Impl] = ("ours", "ceiling") if run % 2 == 0 else ("ceiling", "ours")
            for workload in plan.workloads:
                for impl in order:
                    started = time.monotonic()
                    result = measure(
                        ctx, impl, workload, certs=certs, plan=plan, run=run, profile=profile
                    )
                    for name, value in result.items():
                        if name != "elapsed_s":
                            runs.setdefault(f"{impl}_{workload.key}_{name}", []).append(value)
                    if progress:
                        shown = ", ".join(
                            f"{k} {v:,.0f}" for k, v in result.items() if k != "elapsed_s"
                        )
                        print(
                            f"run {run + 1}/{plan.repeats} {workload.key:<14} {impl:<8} {shown}"
                            f"  ({time.monotonic() - started:.1f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
    return summarize(runs, plan)


def summarize(runs: dict[str, list[float]], plan: Plan) -> dict[str, Any]:
    """The JSON report: medians, ratios, and every run's raw number.

    A ratio is the median of the per-run ratios, each from an ours/ceiling pair measured back to
    back: this machine's speed drifts (it sometimes runs everything twice as fast for a while),
    and pairing keeps such a drift out of the ratio. Absolute numbers are plain medians.
    """

    def median(key: str) -> float:
        return statistics.median(runs[key])

    def paired(numerator: str, denominator: str) -> float:
        pairs = zip(runs[numerator], runs[denominator], strict=True)
        return statistics.median(n / d for n, d in pairs)

    out: dict[str, Any] = {}
    for key in ("oneway_100b", "oneway_10k"):
        ours, ceiling = f"ours_{key}_msgs_per_s", f"ceiling_{key}_msgs_per_s"
        out[f"{key}_ratio"] = paired(ours, ceiling)
        out[ours] = median(ours)
        out[ceiling] = median(ceiling)
    for impl in ("ours", "ceiling"):
        for q in ("p50", "p99"):
            out[f"{impl}_pingpong_{q}_us"] = median(f"{impl}_pingpong_100b_{q}_us")
    out["pingpong_ratio"] = paired("ceiling_pingpong_100b_p50_us", "ours_pingpong_100b_p50_us")
    out["oneway_100b_target"] = ONEWAY_TARGET
    out["pingpong_target"] = PINGPONG_TARGET
    out["method"] = (
        f"{plan.repeats} runs, ours and ceiling interleaved, fresh processes per measurement, "
        "TLS 1.3 over 127.0.0.1; values are medians, ratios the median of per-run ratios"
    )
    out["counts"] = {w.key: {"measured": w.count, "warmup": w.warmup} for w in plan.workloads}
    out["runs"] = {key: [round(v, 1) for v in values] for key, values in sorted(runs.items())}
    return out


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    rows = [
        (
            "one-way 100 B (msgs/s)",
            f"{report['ours_oneway_100b_msgs_per_s']:,.0f}",
            f"{report['ceiling_oneway_100b_msgs_per_s']:,.0f}",
            f"{report['oneway_100b_ratio']:.2f}",
        ),
        (
            "one-way 10 KiB (msgs/s)",
            f"{report['ours_oneway_10k_msgs_per_s']:,.0f}",
            f"{report['ceiling_oneway_10k_msgs_per_s']:,.0f}",
            f"{report['oneway_10k_ratio']:.2f}",
        ),
        (
            "ping-pong 100 B (p50 / p99 us)",
            f"{report['ours_pingpong_p50_us']:,.0f} / {report['ours_pingpong_p99_us']:,.0f}",
            f"{report['ceiling_pingpong_p50_us']:,.0f} / {report['ceiling_pingpong_p99_us']:,.0f}",
            f"{report['pingpong_ratio']:.2f}",
        ),
    ]
    header = ("workload", "ours", "ceiling", "ratio")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{first}  {rest}"

    verdict = (
        f"targets: one-way 100 B ratio >= {ONEWAY_TARGET} "
        f"({'met' if report['oneway_100b_ratio'] >= ONEWAY_TARGET else 'NOT met'}), "
        f"ping-pong ratio >= {PINGPONG_TARGET} "
        f"({'met' if report['pingpong_ratio'] >= PINGPONG_TARGET else 'NOT met'})"
    )
    return "\n".join(
        [
            f"transport benchmark: {report['method']}",
            "ratio: higher is better in every row (throughput: ours / ceiling; "
            "ping-pong: ceiling p50 / ours p50)",
            "",
            line(header),
            line(("-" * widths[0], *("-" * w for w in widths[1:]))),
            *(line(row) for row in rows),
            "",
            verdict,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="smaller counts; under 60 s")
    parser.add_argument("--repeats", type=int, help="runs per value (default 3 quick, 5 full)")
    parser.add_argument(
        "--profile", type=Path, help="cProfile every child process into this directory"
    )
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    plan = make_plan(quick=args.quick, repeats=args.repeats)
    # A plain kill also unwinds through the clean-up that stops the child processes.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report = run_all(plan, profile=args.profile, progress=not args.json)
    except BenchmarkError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; child processes stopped", file=sys.stderr)
        return 130
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
