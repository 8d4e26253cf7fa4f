"""One node process of a real-process chaos run: a node, the counter workload, a history file.

Run by ``p2pshard chaos --real`` (``p2pshard.testing._real``), once per node start, as
``python -m p2pshard.testing._real_node --config node.toml --history FILE`` with the options
``--clients N --entities E --shards S --interval SECONDS --seed S --parent PID --no-lease``,
and for the failover benchmark ``--event-sourced --probe-interval SECONDS
--lease-retry-interval SECONDS --retry-interval SECONDS --state-timeout SECONDS
--rebalance-interval SECONDS`` (see ``--help``).

Theory of operation: the process runs :func:`p2pshard.open_node` with the configuration, starts
the counter entity type (shard leases on, from the ``[lease]`` backend the configuration names;
all processes share one SQLite lease file; with ``--event-sourced`` the counter keeps its count
as events in the ``[journal]`` the configuration names, which all processes on the host may
share, so that a counter recovers its events wherever it starts), the singleton probe under a
lease, ``N`` workload clients, and with ``--probe-interval`` a probe client, and records what
happens in FILE, one JSON object a line, each with ``t``, the time on CLOCK_MONOTONIC
(``time.monotonic()``), which all processes on one host share (the trio clock of each process
starts anywhere). Lines are written with one ``os.write`` on an
``O_APPEND`` descriptor, so a line is whole even when the process is killed right after it, and
the page cache keeps it: a line written is a line the orchestrator will read.

The lines, by ``e`` (event):

- ``starting``: the process is about to open the node (``pid``), so the node begins to join
  now;
- ``ready``: the node runs (``pid``, ``node``, ``uid``);
- ``members``: the membership as this node sees it, written whenever it changed (looked at every
  ``MEMBERS_POLL`` seconds): ``uid`` (this incarnation's, hex), ``members`` ([name, uid,
  status] of every member but the removed ones) and ``unreachable`` (uids some member cannot
  reach);
- ``start`` / ``stop``: an entity incarnation (``key`` ``type/id``, ``token`` its shard lease's
  fencing token), from ``node.sharding.observe``;
- ``log``: the entity handled (``sender``, ``seq``): the counter writes it **before** it
  replies, so an acknowledgement means "handled and written", as a journal write would;
- ``sent`` / ``ack``: a client sent (``sender``, ``seq``) to ``key``, and its answer came back;
- ``probe``: with ``--probe-interval``, a probe client asks one entity of every shard
  (:func:`probe_entities`) with ``Probe`` every that many seconds, without waiting for the
  answers (each may take ``PROBE_TIMEOUT``), and writes a line when a shard is answered by
  another node than the last time: ``shard``, ``by`` (the node that answered now), ``prev_by``
  and ``prev_t`` (the node and time of the answer before, None at first); so the line of a
  shard that moved says when this node last heard from the old home and first from the new
  one; ``probe-rtt``: every ``RTT_SAMPLE_EVERY``-th answered probe, its round trip
  (``rtt``, seconds);
- ``singleton-start`` / ``singleton-stop`` / ``singleton-act``: the probe singleton's
  instances and the pings it answered;
- ``view`` and ``answers``: on SIGUSR1, the members this node sees, its region's shard homes,
  its replicas' digests and its ``stats`` (:func:`node_stats`); then, for one probe entity per
  shard, whether it answered through this node (the orchestrator's final checks);
- ``leaving``: SIGTERM came: the node hands off its shards and leaves the cluster gracefully,
  as ``p2pshard node`` does;
- ``exit``: the node left the cluster (downed, removed, or left after SIGTERM: ``why``) and the
  process ends, as ``p2pshard node`` does; the orchestrator starts it again. With ``stats``, the
  node's counters at the end (:func:`node_stats`).

Sender names hold the pid, so that a restarted process, which counts its sequence numbers from 1
again, is a different sender.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from membership import ClusterError, MemberStatus, SingletonContext

from .._config import NodeConfig
from .._node import Node, open_node
from ..cli._exit import EXIT_DOWNED
from ..persistence._journal import Journal
from ..sharding._allocation import EntityId
from ..sharding._entity import EntityContext
from ..sharding._extractor import HashExtractor
from ..sharding._region import ShardRegion
from ..sharding._settings import ShardingSettings
from ._workload import COUNTER, Add, Added, CountsAdded, Probe, Read

PROBE = "chaos-probe"
"""The singleton probe's name (and its lease's)."""

ASK_TIMEOUT = 2.0
"""Seconds a client waits for each answer."""

PING_INTERVAL = 1.0
"""Seconds between pings to the singleton probe."""

ANSWER_TIMEOUT = 10.0
"""Seconds each shard's probe entity may take to answer on SIGUSR1."""

MEMBERS_POLL = 0.2
"""Seconds between looks at the membership for ``members`` lines."""

PROBE_TIMEOUT = 5.0
"""Seconds a probe waits for its answer (probes overlap: one leaves every probe interval)."""

RTT_SAMPLE_EVERY = 50
"""One answered probe in this many writes its round trip (a ``probe-rtt`` line)."""

logger = logging.getLogger("p2pshard.testing.real_node")


class HistoryFile:
    """Appends one JSON line per event to a file, at once, with the CLOCK_MONOTONIC time."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: str, **fields: object) -> None:
        """One line: ``{"e": event, "t": now, **fields}``, written before this returns."""
        line = json.dumps({"e": event, "t": time.monotonic(), **fields}, separators=(",", ":"))
        os.write(self._fd, line.encode() + b"\n")

    def close(self) -> None:
        os.close(self._fd)


class _Observer:
    """Records entity incarnations (``node.sharding.observe``)."""

    def __init__(self, history: HistoryFile) -> None:
        self._history = history

    def entity_started(self, type_name: str, entity_id: str, lease_token: int | None) -> None:
        self._history.write("start", key=f"{type_name}/{entity_id}", token=lease_token)

    def entity_stopped(self, type_name: str, entity_id: str) -> None:
        self._history.write("stop", key=f"{type_name}/{entity_id}")


def counter_entity(history: HistoryFile, node_name: str) -> Callable[[EntityContext], Any]:
    """The counter: each ``Add`` is written to the history file before the answer goes out.

    ``Probe`` is answered with ``node_name``.
    """

    class Counter:
        def __init__(self, ctx: EntityContext) -> None:
            self.key = f"{ctx.type_name}/{ctx.entity_id}"
            self.handled = 0

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            match msg:
                case Add(sender=sender, seq=seq):
                    history.write("log", key=self.key, sender=sender, seq=seq)
                    self.handled += 1
                    return self.handled
                case Read():
                    return self.handled
                case Probe():
                    return node_name
            raise ValueError(f"the counter does not understand {msg!r}")

    return Counter


def event_sourced_counter(
    history: HistoryFile, journal: Journal, node_name: str
) -> Callable[[EntityContext], Any]:
    """The counter with its count in ``journal``: each ``Add`` is an event.

    The event is stored before the history line and the answer. ``Probe`` is answered with
    ``node_name``.
    """

    class Counter(CountsAdded):
        def __init__(self, ctx: EntityContext) -> None:
            super().__init__(ctx, journal)
            self.key = f"{ctx.type_name}/{ctx.entity_id}"

        async def handle_command(self, command: object, ctx: EntityContext) -> object:
            match command:
                case Add(sender=sender, seq=seq):
                    await self.persist(Added(sender=sender, seq=seq))
                    history.write("log", key=self.key, sender=sender, seq=seq)
                    return self.state
                case Read():
                    return self.state
                case Probe():
                    return node_name
            raise ValueError(f"the counter does not understand {command!r}")

    return Counter


def singleton_probe(history: HistoryFile) -> Callable[[SingletonContext], Any]:
    """A singleton that records its instances and every ping it answers."""

    async def probe(ctx: SingletonContext) -> None:
        history.write("singleton-start", name=ctx.name)
        try:
            async for request in ctx:
                history.write("singleton-act", name=ctx.name)
                request.reply(os.getpid())
        finally:
            history.write("singleton-stop", name=ctx.name)

    return probe


async def _client(
    region: ShardRegion,
    history: HistoryFile,
    sender: str,
    entities: int,
    interval: float,
    rng: random.Random,
) -> None:
    seq = 0
    while True:
        await trio.sleep(interval * rng.uniform(0.5, 1.5))
        seq += 1
        key = f"{COUNTER}/e{rng.randrange(entities)}"
        history.write("sent", sender=sender, key=key, seq=seq)
        with trio.move_on_after(ASK_TIMEOUT):
            try:
                await region.entity_ref(key.split("/", 1)[1]).ask(
                    Add(sender=sender, seq=seq), timeout=ASK_TIMEOUT
                )
            except ClusterError:  # timed out, region stopping, buffer full: not acknowledged
                continue
            history.write("ack", sender=sender, seq=seq)


async def _probe_shards(
    region: ShardRegion, history: HistoryFile, shards: int, interval: float, rng: random.Random
) -> None:
    """Ask every shard's probe entity every ``interval`` seconds; note who answers (see above)."""
    last: dict[str, tuple[str, float]] = {}
    answered = 0

    async def ask(shard: str, entity: str) -> None:
        nonlocal answered
        sent = time.monotonic()
        try:
            by = await region.entity_ref(entity).ask(Probe(), timeout=PROBE_TIMEOUT)
        except ClusterError:  # timed out, region stopping, buffer full: not answered
            return
        now = time.monotonic()
        answered += 1
        if answered % RTT_SAMPLE_EVERY == 0:
            history.write("probe-rtt", rtt=now - sent)
        previous = last.get(shard)
        if previous is None or previous[0] != by:
            history.write(
                "probe",
                shard=shard,
                by=by,
                prev_by=None if previous is None else previous[0],
                prev_t=None if previous is None else previous[1],
            )
        last[shard] = (str(by), now)

    async def keep_asking(shard: str, entity: str, nursery: trio.Nursery) -> None:
        await trio.sleep(rng.uniform(0, interval))  # spread the shards over the interval
        while True:
            nursery.start_soon(ask, shard, entity)
            await trio.sleep(interval)

    async with trio.open_nursery() as nursery:
        for shard, entity in sorted(probe_entities(shards).items()):
            nursery.start_soon(keep_asking, shard, entity, nursery)


async def _ping_singleton(node: Node) -> None:
    proxy = node.singletons.proxy(PROBE)
    while True:
        await trio.sleep(PING_INTERVAL)
        with contextlib.suppress(ClusterError):
            await proxy.ask("ping", timeout=ASK_TIMEOUT)


def probe_entities(shards: int) -> dict[str, str]:
    """One entity id per shard of ``HashExtractor(shards)``: shard → ``probe-N``."""
    extractor = HashExtractor(shards)
    probes: dict[str, str] = {}
    n = 0
    while len(probes) < shards:
        entity = f"probe-{n}"
        probes.setdefault(str(extractor.shard_id(EntityId(entity))), entity)
        n += 1
    return probes


async def _report(node: Node, region: ShardRegion, history: HistoryFile, shards: int) -> None:
    """The final checks' material: this node's view, then whether every shard answers."""
    members = sorted(
        (m.node.name, m.status.value)
        for m in node.cluster.members
        if m.status is not MemberStatus.REMOVED
    )
    homes = {str(shard): home.name for shard, home in region.shard_homes().items()}
    replicator = node.replicator
    digests = {
        key: (d.hex() if (d := replicator.digest(key)) else None)
        for key in replicator.keys()  # noqa: SIM118
    }
    history.write("view", members=members, homes=homes, digests=digests, stats=node_stats(node))
    answers: dict[str, str] = {}

    async def ask(shard: str, entity: str) -> None:
        try:
            await region.entity_ref(entity).ask(Read(), timeout=ANSWER_TIMEOUT)
        except Exception as exc:  # any failure is what the check looks for
            answers[shard] = repr(exc)
        else:
            answers[shard] = "ok"

    async with trio.open_nursery() as nursery:
        for shard, entity in sorted(probe_entities(shards).items()):
            nursery.start_soon(ask, shard, entity)
    history.write("answers", answers=answers)


def node_stats(node: Node) -> dict[str, object]:
    """What the rolling upgrade checks of a node: its dropped and refused frames, its links.

    ``dropped_undecodable`` counts messages this node could not decode (a type it does not
    know: a newer node sent what it should not have), ``links_closed_undecodable`` and
    ``links_closed_refused`` links closed for bad frames or too many refused messages,
    ``protocols`` the wire protocol version agreed with each other member, by name (None: no
    link now), ``not_sent_protocol`` messages it held back because their type needs a later
    protocol than the link's (``@message(since=...)``). A build with more to show adds its own
    fields.
    """
    transport = node.transport_statistics()
    return {
        "dropped_undecodable": transport.messages_dropped_undecodable,
        "not_sent_protocol": transport.messages_not_sent_protocol,
        "links_closed_undecodable": transport.links_closed_undecodable,
        "links_closed_refused": transport.links_closed_refused,
        "protocols": {
            m.node.name: node.transport.peer_protocol(m.node.address)
            for m in node.cluster.members
            if m.node != node.cluster.self_address
        },
    }


def members_view(node: Node) -> dict[str, object]:
    """The fields of a ``members`` line: this incarnation, its members, the unreachable ones."""
    cluster = node.cluster
    return {
        "uid": f"{cluster.self_address.uid:x}",
        "members": [
            [m.node.name, f"{m.node.uid:x}", m.status.value]
            for m in cluster.members
            if m.status is not MemberStatus.REMOVED
        ],
        "unreachable": sorted(f"{m.node.uid:x}" for m in cluster.unreachable),
    }


async def _record_members(node: Node, history: HistoryFile) -> None:
    last: dict[str, object] | None = None
    while True:
        view = members_view(node)
        if view != last:
            history.write("members", **view)
            last = view
        await trio.sleep(MEMBERS_POLL)


async def run_node(args: argparse.Namespace) -> int:
    """Run the node and its workload until it is downed or removed; the exit status.

    As ``p2pshard node``: ``EXIT_DOWNED`` when the cluster downed or removed it, 0 after a
    graceful leave on SIGTERM.
    """
    config = NodeConfig.load(args.config)
    history = HistoryFile(args.history)
    rng = random.Random(f"{args.seed}/{config.node_name}/{os.getpid()}")
    sharding = ShardingSettings(
        use_lease=args.use_lease,
        lease_retry_interval=args.lease_retry_interval,
        retry_interval=args.retry_interval,
        state_timeout=args.state_timeout,
        rebalance_interval=args.rebalance_interval,
    )
    left_on_signal = False
    try:
        with (
            trio.open_signal_receiver(signal.SIGUSR1) as reports,
            trio.open_signal_receiver(signal.SIGTERM) as terms,
        ):
            history.write("starting", pid=os.getpid())
            async with open_node(config) as node, trio.open_nursery() as nursery:
                nursery.start_soon(_record_members, node, history)
                node.sharding.observe(_Observer(history))
                entity = (
                    event_sourced_counter(history, node.journal, config.node_name)
                    if args.event_sourced
                    else counter_entity(history, config.node_name)
                )
                region = await node.sharding.start(
                    COUNTER,
                    entity,
                    extractor=HashExtractor(args.shards),
                    settings=sharding,
                )
                lease = node.leases.lease(PROBE) if args.use_lease else None
                await node.singletons.start(PROBE, singleton_probe(history), lease=lease)
                history.write(
                    "ready", pid=os.getpid(), node=config.node_name, uid=f"{node.address.uid:x}"
                )
                for k in range(args.clients):
                    sender = f"{config.node_name}.{os.getpid()}.c{k}"
                    client_rng = random.Random(rng.getrandbits(64))
                    nursery.start_soon(
                        _client, region, history, sender, args.entities, args.interval, client_rng
                    )
                nursery.start_soon(_ping_singleton, node)
                if args.probe_interval is not None:
                    probe_rng = random.Random(rng.getrandbits(64))
                    nursery.start_soon(
                        _probe_shards, region, history, args.shards, args.probe_interval, probe_rng
                    )

                async def report_on_signal() -> None:
                    async for _ in reports:
                        nursery.start_soon(_report, node, region, history, args.shards)

                nursery.start_soon(report_on_signal)

                async def leave_on_sigterm() -> None:
                    nonlocal left_on_signal
                    async for _ in terms:
                        history.write("leaving", why="SIGTERM")
                        left_on_signal = True
                        nursery.cancel_scope.cancel()  # leaving open_node's block leaves
                        return

                nursery.start_soon(leave_on_sigterm)
                await node.terminated.wait()  # downed or removed: the process ends
                history.write(
                    "exit", why=str(node.cluster.termination_reason), stats=node_stats(node)
                )
                nursery.cancel_scope.cancel()
            if left_on_signal:
                reason = node.cluster.termination_reason or "not removed in time"
                history.write("exit", why=f"left on SIGTERM ({reason})", stats=node_stats(node))
    finally:
        history.close()
    return 0 if left_on_signal else EXIT_DOWNED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m p2pshard.testing._real_node",
        description="One node process of p2pshard chaos --real: a node, the counter workload "
        "and its history file.",
    )
    parser.add_argument("--config", required=True, type=Path, help="the node's TOML file")
    parser.add_argument("--history", required=True, type=Path, help="the history file to append")
    parser.add_argument("--clients", type=int, default=1, help="workload clients (default 1)")
    parser.add_argument("--entities", type=int, default=20, help="counter entities (default 20)")
    parser.add_argument("--shards", type=int, default=10, help="shards (default 10)")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.1,
        help="mean seconds between a client's messages (default 0.1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the clients' choices")
    parser.add_argument(
        "--parent",
        type=int,
        help="the orchestrator's pid: this process is killed when it dies (Linux)",
    )
    parser.add_argument(
        "--event-sourced",
        action="store_true",
        help="keep each counter's count as events in the configuration's [journal]",
    )
    parser.add_argument(
        "--probe-interval",
        type=float,
        help="ask every shard's probe entity every SECONDS and write probe lines (default: no "
        "probes)",
    )
    parser.add_argument(
        "--lease-retry-interval",
        type=float,
        default=1.0,
        help="ShardingSettings.lease_retry_interval (default 1)",
    )
    parser.add_argument(
        "--retry-interval",
        type=float,
        default=ShardingSettings().retry_interval,
        help=f"ShardingSettings.retry_interval (default {ShardingSettings().retry_interval:g})",
    )
    parser.add_argument(
        "--state-timeout",
        type=float,
        default=ShardingSettings().state_timeout,
        help=f"ShardingSettings.state_timeout (default {ShardingSettings().state_timeout:g})",
    )
    parser.add_argument(
        "--rebalance-interval",
        type=float,
        default=5.0,
        help="ShardingSettings.rebalance_interval (default 5)",
    )
    parser.add_argument(
        "--no-lease",
        dest="use_lease",
        action="store_false",
        help="no shard or singleton leases (to show what the checkers catch without them)",
    )
    return parser


def _die_with_parent(parent: int) -> None:
    """Have Linux SIGKILL this process when the orchestrator dies (``PR_SET_PDEATHSIG``).

    The orchestrator kills its node processes itself; this covers the orchestrator being killed
    (a CI timeout, say), so that no node process outlives it.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before we asked
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status: ``EXIT_DOWNED`` downed or removed, 0 after a leave."""
    args = _parser().parse_args(argv)
    if args.parent is not None:
        _die_with_parent(args.parent)
    config = NodeConfig.load(args.config)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return trio.run(run_node, args)


if __name__ == "__main__":
    sys.exit(main())
