"""Chat benchmark: one room, 100 users over 3 chat node processes, beside a trivial fan-out server.

How to run it (from the project root)::

    .venv/bin/python -m benchmarks.chat            # full run, about two minutes
    .venv/bin/python -m benchmarks.chat --quick    # smaller counts, under a minute
    .venv/bin/python -m benchmarks.chat --json     # one JSON object instead of the table

Progress lines go to stderr unless ``--json``.

Ours: the chat example as ``scripts/run-chat.sh`` runs it (:class:`ChatCluster`: three node
processes on 127.0.0.1, TLS between them, the SQLite journal and lease file in a temporary
directory), 100 WebSocket clients of ``examples/chat/client.py`` in this process, client ``i``
connected to node ``i % 3 + 1``, all in one room. A post is acknowledged after its event is in
the journal; the room then sends one ``Deliver`` per node, whose gateway pushes a ``message`` and
a ``members`` frame to each local member.

Baseline, in the same run: the same 100 clients, the same client code and frames, against a
single trio process (``benchmarks/_chat_baseline.py``) that keeps the room in a dict: on a post
it pushes the same ``message`` and ``members`` frames into each member's queue (512 frames, a
writer task per connection, as the chat nodes do) and answers ``ack``. No cluster, no journal,
no TLS: what any WebSocket fan-out in Python costs here, this client included (the 100 clients
share one process, which is part of both figures; ``benchmarks/chat_load.py`` spreads its
clients over several processes).

1. ``fanout``: posts one at a time (each by the next user in turn), each followed until all 100
   members (the poster too) have its ``message`` frame: latency from the post being sent to
   each member's receipt (p50/p99 over all receipts), to the last member's receipt (p50/p99 per
   post), and to the ``ack``.
2. ``throughput``: 10 users post in a closed loop (each waits for its ``ack``) for a window;
   messages acknowledged per second, and frames delivered; then every member must have received
   every acknowledged message (missing deliveries are counted and reported).

Ratios are ours / baseline; with several rounds (full run), each round measures both targets
back to back (the order alternates) and a ratio is the median of the per-round ratios. Every
wait has a time limit; on every exit path the node processes and the baseline server are
stopped and the temporary directory removed.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from benchmarks._chat_baseline import BaselineProcess
from benchmarks._process import BenchmarkError
from benchmarks._report import benchmark_parser, cell, progress_line, quantiles_ms, run_and_print
from examples.chat.client import ChatClient, open_chat_client
from examples.chat.cluster import ChatCluster, free_base_port

NODES = 3
JOINS_AT_ONCE = 10
WAIT = 15.0
"""Seconds any one answer or delivery may take before the benchmark fails."""


@attrs.frozen(kw_only=True)
class Plan:
    """Counts and limits of one benchmark run."""

    users: int
    fanout_posts: int
    warmup_posts: int
    posters: int
    window: float
    """Seconds the posters start new posts in the throughput part."""
    rounds: int
    part_limit: float
    """Seconds one target's round may take."""


def make_plan(*, quick: bool) -> Plan:
    """The quick plan takes well under a minute on two cores; the full one about two."""
    return Plan(
        users=100,
        fanout_posts=40 if quick else 200,
        warmup_posts=5,
        posters=10,
        window=3.0 if quick else 8.0,
        rounds=1 if quick else 3,
        part_limit=120.0 if quick else 300.0,
    )


# ==== measurements ================================================================================


def _is_message(client_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda f: f["type"] == "message" and f["message"]["id"] == client_id


async def _join_all(clients: list[ChatClient], room: str) -> None:
    limiter = trio.CapacityLimiter(JOINS_AT_ONCE)

    async def join(i: int, client: ChatClient) -> None:
        async with limiter:
            await client.join(room, f"user{i}", wait=WAIT)

    async with trio.open_nursery() as nursery:
        for i, client in enumerate(clients):
            nursery.start_soon(join, i, client)


async def fanout(clients: list[ChatClient], posts: int, tag: str) -> dict[str, list[float]]:
    """Posts one at a time, each followed until every member has it."""
    receipts: list[float] = []
    complete: list[float] = []
    acks: list[float] = []
    for k in range(posts):
        poster = clients[k % len(clients)]
        client_id = f"{tag}-{k}"
        starts = [len(c.frames) for c in clients]
        sent = trio.current_time()
        await poster.post(f"fan-out message {k} from {tag}", client_id, wait=WAIT)
        acks.append(trio.current_time() - sent)
        last = 0.0
        for client, start in zip(clients, starts, strict=True):
            frame = await client.expect(_is_message(client_id), start=start, wait=WAIT)
            receipts.append(frame["_at"] - sent)
            last = max(last, frame["_at"] - sent)
        complete.append(last)
    return {"receipts": receipts, "complete": complete, "acks": acks}


async def throughput(clients: list[ChatClient], plan: Plan, tag: str) -> dict[str, Any]:
    """Closed-loop posters for a window; then check that every member got every message."""
    starts = [len(c.frames) for c in clients]
    posters = clients[: plan.posters]
    acked: list[str] = []
    began = trio.current_time()
    end = began + plan.window

    async def post_loop(p: int, client: ChatClient) -> None:
        n = 0
        while trio.current_time() < end:
            client_id = f"{tag}-p{p}-{n}"
            await client.post(f"load message {n} from poster {p}", client_id, wait=WAIT)
            acked.append(client_id)
            n += 1

    async with trio.open_nursery() as nursery:
        for p, client in enumerate(posters):
            nursery.start_soon(post_loop, p, client)
    elapsed = trio.current_time() - began
    wanted = set(acked)
    missing = 0
    deadline = trio.current_time() + WAIT
    while True:
        missing = 0
        for client, start in zip(clients, starts, strict=True):
            got = {f["message"]["id"] for f in client.frames[start:] if f["type"] == "message"}
            missing += len(wanted - got)
        if missing == 0 or trio.current_time() > deadline:
            break
        await trio.sleep(0.1)
    delivered_by = trio.current_time() - began
    return {
        "messages": len(acked),
        "seconds": elapsed,
        "messages_per_s": len(acked) / elapsed,
        "deliveries_per_s": (len(acked) * len(clients) - missing) / delivered_by,
        "missing_deliveries": missing,
    }


async def measure_target(
    name: str, url_of: Callable[[int], str], plan: Plan, room: str, progress: bool
) -> dict[str, Any]:
    """Connect the users, join them, warm up, then the fan-out and throughput parts."""
    with trio.fail_after(plan.part_limit):
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(open_chat_client(url_of(i)))
                for i in range(plan.users)
            ]
            await _join_all(clients, room)
            await fanout(clients, plan.warmup_posts, f"{room}-warm")
            progress_line(progress, f"  {name}: {plan.users} users joined {room}; fan-out")
            fan = await fanout(clients, plan.fanout_posts, f"{room}-fan")
            progress_line(progress, f"  {name}: throughput, {plan.window:g} s window")
            load = await throughput(clients, plan, f"{room}-load")
            closed = sum(c.closed for c in clients)
    if closed:
        raise BenchmarkError(f"{name}: {closed} connections were closed by the server")
    figures: dict[str, Any] = {}
    for key, samples in (
        ("receipt", fan["receipts"]),
        ("complete", fan["complete"]),
        ("ack", fan["acks"]),
    ):
        for q, value in quantiles_ms(samples).items():
            figures[f"{key}_{q}"] = value
    figures.update(load)
    return figures


FIGURES = (
    "receipt_p50_ms",
    "receipt_p99_ms",
    "complete_p50_ms",
    "complete_p99_ms",
    "ack_p50_ms",
    "messages_per_s",
    "deliveries_per_s",
)


def run_all(plan: Plan, progress: bool) -> dict[str, Any]:
    """Start both targets, measure them round by round, stop them; the report."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="p2pshard-bench-chat-") as tmp:
        root = Path(tmp)
        cluster = ChatCluster(
            NODES, root / "cluster", free_base_port(NODES), log_level="WARNING",
            log_to_files=True,
        )  # fmt: skip
        baseline: BaselineProcess | None = None
        try:
            progress_line(progress, f"starting {NODES} chat nodes and the baseline server")
            cluster.start()
            baseline = BaselineProcess(root / "baseline.log")
            cluster.wait_ready(timeout=60)
            base_url = baseline.url
            targets: dict[str, Callable[[int], str]] = {
                "cluster": lambda i: cluster.ws_url(i % NODES + 1),
                "baseline": lambda i: base_url,
            }
            for r in range(plan.rounds):
                order = ["baseline", "cluster"] if r % 2 == 0 else ["cluster", "baseline"]
                figures: dict[str, dict[str, Any]] = {}
                for name in order:
                    progress_line(progress, f"round {r + 1}/{plan.rounds}: {name}")
                    figures[name] = trio.run(
                        measure_target, name, targets[name], plan, f"bench{r}", progress
                    )
                rounds.append(figures)
        except BaseException:
            for log in sorted((root / "cluster").glob("*.log")):
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
                print(f"--- {log.name} (last lines)\n{tail}", file=sys.stderr)
            raise
        finally:
            if baseline is not None:
                baseline.stop()
            cluster.stop()
    report: dict[str, Any] = {}
    for target in ("cluster", "baseline"):
        for key in FIGURES:
            report[f"{target}_{key}"] = statistics.median(r[target][key] for r in rounds)
    for key in FIGURES:
        report[f"{key.removesuffix('_ms').removesuffix('_per_s')}_ratio"] = statistics.median(
            r["cluster"][key] / r["baseline"][key] for r in rounds
        )
    report["missing_deliveries"] = {
        t: sum(r[t]["missing_deliveries"] for r in rounds) for t in ("cluster", "baseline")
    }
    report.update(
        {
            "rounds": rounds,
            "counts": attrs.asdict(plan),
            "nodes": NODES,
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "elapsed_s": time.monotonic() - started,
        }
    )
    return report


def format_table(report: dict[str, Any]) -> str:
    """The report as a table for people."""
    counts = report["counts"]
    users = counts["users"]
    rows: list[tuple[str, str, str, str]] = []
    for key, what, spec in (
        ("messages_per_s", f"messages/s, {counts['posters']} posters in closed loop", ",.0f"),
        ("deliveries_per_s", f"    message frames delivered/s ({users} members)", ",.0f"),
        ("receipt_p50_ms", "fan-out, post -> each member's receipt, p50 (ms)", ".2f"),
        ("receipt_p99_ms", "    p99 (ms)", ".2f"),
        ("complete_p50_ms", f"fan-out, post -> all {users} members, p50 (ms)", ".2f"),
        ("complete_p99_ms", "    p99 (ms)", ".2f"),
        ("ack_p50_ms", "post -> ack, p50 (ms)", ".2f"),
    ):
        ratio = report[f"{key.removesuffix('_ms').removesuffix('_per_s')}_ratio"]
        rows.append(
            (
                what,
                cell(report[f"cluster_{key}"], spec),
                cell(report[f"baseline_{key}"], spec),
                cell(ratio),
            )
        )
    missing = report["missing_deliveries"]
    rows.append(("missing deliveries", str(missing["cluster"]), str(missing["baseline"]), ""))
    header = ("figure", "chat cluster", "baseline (same run)", "ratio")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return f"{first}  {rest}".rstrip()

    lines = [
        f"chat benchmark: one room, {users} WebSocket users over {report['nodes']} chat node "
        "processes (TLS, SQLite journal); baseline: the same clients and frames against a "
        "single-process trio fan-out server; ratio = cluster / baseline"
        + (", median of per-round ratios" if counts["rounds"] > 1 else ""),
        f"{counts['rounds']} round(s); {counts['fanout_posts']} fan-out posts one at a time; "
        f"throughput window {counts['window']:g} s",
        "",
        line(header),
        line(tuple("-" * w for w in widths)),
        *(line(row) for row in rows),
        "",
        f"total {report['elapsed_s']:.0f} s on {report['cpus']} CPUs; 1-minute load average "
        f"before the run {report['load_average_before']:.2f}",
    ]
    if report["load_average_before"] >= 0.5:
        lines.append(
            "warning: other processes were using the CPUs when the run started; the absolute "
            "figures are pessimistic"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the benchmark, print the table or the JSON."""
    parser = benchmark_parser(__doc__, quick="smaller counts; under a minute")
    args = parser.parse_args(argv)
    plan = make_plan(quick=args.quick)
    return run_and_print(
        lambda: run_all(plan, progress=not args.json),
        format_table,
        as_json=args.json,
        stopped="processes stopped, temporary files removed",
    )


if __name__ == "__main__":
    sys.exit(main())
