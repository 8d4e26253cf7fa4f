"""The ``p2pshard`` command.

``p2pshard certs init`` makes a cluster CA; ``certs node|client|admin`` make a key and certificate
where the CA is, ``certs request`` makes a key and a signing request where it will be used and
``certs sign`` signs that request where the CA is. ``p2pshard node --config FILE`` runs one node
until Ctrl-C or SIGTERM (SIGHUP reloads its ``[tls]`` table), with ``--app MODULE:FUNCTION``
(or the config's ``app``) an application on it: ``async def setup(node)`` starts its entity
types and singletons; ``p2pshard local-cluster`` runs
several nodes as separate processes on one host, with throwaway certificates (the README's main
job). ``p2pshard status`` asks a running node for its members and shards, ``p2pshard leave`` and
``down`` ask it to make a member leave or go down (an admin certificate only);
``p2pshard remove-sharding-data`` deletes entity types' sharding state from a stopped node's
durable store; ``p2pshard chaos`` runs seeded chaos schedules on a simulated cluster (with
``--real``, one schedule on node processes of this host). Errors in what the user typed or
configured end with a one-line message and exit status 2; a node that fails at run time, does
not answer, or refuses, exits with 1; a node that the cluster downed or removed exits with
``EXIT_DOWNED`` (3), so that a supervisor restarting on failure starts it again; a node whose
app's setup raised leaves the cluster and exits with ``EXIT_APP_FAILED`` (4).
``p2pshard --version`` prints the installed release (the version of the package's metadata,
which ``pyproject.toml`` sets).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from crdt.internal import SCHEMA_VERSION
from membership import Address, ConfigurationError, IdentityKind, PeerIdentity
from membership.internal import (
    TcpTransport,
    create_certificate,
    create_cluster_ca,
    create_signing_request,
    sign_request,
    single_error,
)

from .._config import ClientConfig, NodeConfig
from ._exit import EXIT_APP_FAILED, EXIT_DOWNED

if TYPE_CHECKING:
    from .._node import Node
    from .._status import CommandAnswer, Probe
    from ._app import App

logger = logging.getLogger("p2pshard.cli")


def release() -> str:
    """The installed p2pshard release, as its package metadata says (``pyproject.toml``)."""
    try:
        return importlib.metadata.version("p2pshard")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e . sets it)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pshard",
        description="Run and manage p2pshard cluster nodes.",
    )
    parser.add_argument("--version", action="version", version=f"p2pshard {release()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    certs = commands.add_parser(
        "certs",
        help="make a cluster CA and certificates",
        description="Make a cluster CA (init); a key and certificate where the CA is (node, "
        "client, admin); or, to keep every key on the machine that uses it, a key and a signing "
        "request there (request) and its certificate where the CA is (sign).",
    )
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, metavar="WHAT")
    init = certs_commands.add_parser("init", help="make a cluster CA")
    init.add_argument("--cluster", required=True, help="the cluster name")
    init.add_argument("--out", required=True, type=Path, help="directory for ca.pem, ca-key.pem")
    init.add_argument("--days", type=int, default=3650, help="validity (default 3650)")
    init.add_argument("--force", action="store_true", help="replace existing files")
    for kind, what in (
        (IdentityKind.NODE, "a node (a cluster member)"),
        (IdentityKind.CLIENT, "a client (reads the cluster's status, nothing else)"),
        (IdentityKind.ADMIN, "an admin (reads the status, makes members leave or go down)"),
    ):
        local = certs_commands.add_parser(
            kind.value,
            help=f"make the key and certificate of {what}, here where the CA is",
        )
        local.add_argument("name", help=f"the {kind.value}'s name")
        local.add_argument("--ca", required=True, type=Path, help="directory of the cluster CA")
        local.add_argument(
            "--out",
            required=True,
            type=Path,
            help=f"directory for {kind.value}.pem, {kind.value}-key.pem and a copy of ca.pem",
        )
        local.add_argument("--cluster", help="cluster name (default: the CA's)")
        local.add_argument("--days", type=int, default=825, help="validity (default 825)")
        local.add_argument("--force", action="store_true", help="replace existing files")
    request = certs_commands.add_parser(
        "request",
        help="make a key and a certificate signing request, on the machine that will use them",
        description="Make a private key (mode 0600) and a signing request for an identity, "
        "here; take the request (not the key) to the CA's machine and sign it with "
        "'p2pshard certs sign'.",
    )
    request.add_argument("name", help="the identity's name")
    request.add_argument(
        "--kind",
        required=True,
        choices=[k.value for k in IdentityKind],
        help="node (a cluster member), client (reads the status) or admin (also makes members "
        "leave or go down)",
    )
    request.add_argument("--cluster", required=True, help="the cluster name")
    request.add_argument(
        "--out", required=True, type=Path, help="directory for KIND-key.pem and KIND.csr"
    )
    request.add_argument("--force", action="store_true", help="replace existing files")
    sign = certs_commands.add_parser(
        "sign",
        help="check a signing request and sign it with the cluster CA",
        description="Check a signing request made by 'p2pshard certs request' (its signature, "
        "its key, and that it asks for exactly one identity of the CA's cluster and nothing "
        "else), print what it asks for, and write the certificate. A request that does not "
        "pass is refused with the reason, and nothing is written.",
    )
    sign.add_argument("request", type=Path, help="the signing request file (PEM or DER)")
    sign.add_argument("--ca", required=True, type=Path, help="directory of the cluster CA")
    sign.add_argument("--out", required=True, type=Path, help="file for the certificate (PEM)")
    sign.add_argument("--cluster", help="cluster name (default: the CA's)")
    sign.add_argument("--days", type=int, default=825, help="validity (default 825)")
    sign.add_argument("--force", action="store_true", help="replace an existing --out file")

    node = commands.add_parser(
        "node",
        help="run one node (and an application on it: --app) until Ctrl-C",
        description="Run one node until Ctrl-C or SIGTERM, which make it leave the cluster. "
        "With --app MODULE:FUNCTION, import the application's module (from the current "
        "directory or PYTHONPATH, as python -m does) and, once the node has started, await "
        "FUNCTION(node), an async function that starts the app's entity types and singletons; "
        "the node runs on when it returns, and leaves the cluster (exit status 4) if it "
        "raises. SIGHUP reads the configuration file again and applies its [tls] table (CAs, "
        "the node's certificate and key, the deny list) at once: open links the new settings "
        "refuse are closed. A configuration that does not load is refused, and the old settings "
        "kept.",
    )
    node.add_argument("--config", required=True, type=Path, help="the node's TOML file")
    node.add_argument(
        "--app",
        metavar="MODULE:FUNCTION",
        help="the application's setup function, e.g. shop.app:setup: async def setup(node) "
        "(default: the config's app key, or P2PSHARD_APP; none: a bare node)",
    )

    local = commands.add_parser(
        "local-cluster", help="run a cluster of node processes on this host (Ctrl-C stops it)"
    )
    local.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    local.add_argument(
        "--dir",
        type=Path,
        default=Path("cluster-data"),
        help="data directory for certificates and configs (default ./cluster-data)",
    )
    local.add_argument("--cluster", default="local", help="cluster name (default 'local')")
    local.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    local.add_argument(
        "--base-port", type=int, default=25520, help="port of node-1; node-N gets base+N-1"
    )
    local.add_argument(
        "--duration", type=float, help="stop by itself after this many seconds (default: never)"
    )
    local.add_argument("--log-level", default="INFO", help="node log level (default INFO)")

    status = commands.add_parser(
        "status",
        help="show a running node's members and shards",
        description="Ask a running node for the members it sees (status, roles, age, "
        "reachability, leader, oldest) and, for each entity type started on it, every region's "
        "shards and entity counts. The command connects with the cluster name and TLS files of "
        "--config: a client's configuration (a client or admin certificate), or a node's (it "
        "presents that node's certificate). Reading changes nothing in the cluster.",
    )
    target = status.add_mutually_exclusive_group(required=True)
    target.add_argument("--node", help="the node to ask over the cluster port, HOST:PORT")
    target.add_argument(
        "--management",
        metavar="URL",
        help="ask the node's management endpoint instead, http(s)://HOST:PORT; the bearer "
        "token, if it needs one, comes from P2PSHARD_MANAGEMENT__TOKEN or --token-file",
    )
    status.add_argument(
        "--config",
        type=Path,
        help="a client's TOML file (cluster_name, [tls]), or a node's; required with --node "
        "and with an https:// --management",
    )
    status.add_argument(
        "--token-file",
        type=Path,
        help="with --management: a file holding the bearer token",
    )
    status.add_argument(
        "--type",
        action="append",
        dest="types",
        metavar="NAME",
        help="with --management: show this entity type (repeatable; default: every type "
        "started on the node)",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)"
    )
    status.add_argument(
        "--bind", help="host to listen on for the answer (default: the config's bind_host)"
    )

    for action, what in (
        (
            "leave",
            "make a member leave the cluster gracefully: it hands its shards and singletons "
            "over, then is removed (and its process stops)",
        ),
        (
            "down",
            "mark a member Down: for a member that is surely gone (crashed, its host lost); "
            "it is removed once the others no longer reach it, and stops if it still runs",
        ),
    ):
        member = commands.add_parser(
            action,
            help=f"{action} a member (needs an admin certificate)",
            description=f"Ask a running node to {what}. The node does it only for an admin "
            "certificate (see 'p2pshard certs admin' and 'certs request --kind admin'); it "
            "answers what it did or why it refused. Exit status 0 when done, 1 when refused "
            "or unanswered, 2 on bad usage.",
        )
        member.add_argument("address", help="the member, HOST:PORT")
        member.add_argument(
            "--config",
            required=True,
            type=Path,
            help="a client's TOML file (cluster_name, [tls]) with an admin certificate",
        )
        member.add_argument(
            "--node",
            help="the member to ask, HOST:PORT (default: the member itself; to down one that "
            "is gone, ask another)",
        )
        member.add_argument(
            "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)"
        )
        member.add_argument(
            "--bind", help="host to listen on for the answer (default: the config's bind_host)"
        )

    remove = commands.add_parser(
        "remove-sharding-data",
        help="delete entity types' sharding data from a stopped node's durable store",
        description="Delete the internal sharding data of entity types (the replicator keys "
        "sharding/<type>/coordinator and sharding/<type>/entities/*: shard homes and remembered "
        "entities) from the durable store of the node --config describes (its "
        "replicator.durable_path). Every node keeps its own store: stop the whole cluster, then "
        "run this once on every node, with that node's configuration. It refuses while any seed "
        "node, or the node itself, answers.",
    )
    remove.add_argument("--config", required=True, type=Path, help="the node's TOML file")
    remove.add_argument(
        "--type",
        dest="types",
        action="append",
        default=[],
        metavar="TYPE",
        help="an entity type whose data to delete (repeat for more)",
    )
    remove.add_argument(
        "--all-types", action="store_true", help="delete the data of every entity type"
    )
    remove.add_argument(
        "--probe-timeout",
        type=float,
        default=3.0,
        help="seconds to wait for a running node to answer (default 3)",
    )
    remove.add_argument(
        "--client-config",
        type=Path,
        help="a client's TOML file to check with that no node runs (default: the node's own "
        "certificate)",
    )

    chaos = commands.add_parser(
        "chaos",
        help="run seeded chaos schedules on a simulated cluster (or real processes: --real) "
        "and check every invariant",
        description="Run a simulated cluster (one process, mock clock) under random "
        "partitions, flaky and slow links, crashes, pauses and lease clock skew, with a "
        "counter workload (or chat-like rooms fanning posts out to inboxes), then check "
        "single activation, "
        "acknowledged messages kept exactly once, per-sender order, agreement after heal, at "
        "most one singleton, replica convergence and the fan-out copies. Prints a summary "
        "table; a failing seed is run once more to check that it reproduces, and the command "
        "that replays it is printed. With --real, run one schedule against node processes on "
        "127.0.0.1 instead (TCP with mutual TLS, shard leases in a shared SQLite file): "
        "faults by SIGKILL, SIGSTOP/SIGCONT (shorter and longer than the lease time-to-live), "
        "partitions, slow links and connection resets (a proxy between every ordered pair of "
        "nodes, so one-way too); then heal, quiet, check that every node runs and agrees, "
        "merge the processes' histories and check the same invariants. Exit status 1 when an "
        "invariant was broken.",
    )
    chaos.add_argument("--seeds", type=int, default=100, help="how many seeds (default 100)")
    chaos.add_argument("--start-seed", type=int, default=0, help="the first seed (default 0)")
    chaos.add_argument(
        "--seed",
        type=int,
        help="run this one seed and print its faults and violations (with --real: the "
        "schedule's seed; default a random one, printed)",
    )
    chaos.add_argument("--nodes", type=int, help="cluster size (default 5; with --real --quick 3)")
    chaos.add_argument(
        "--duration",
        type=float,
        help="seconds of faults: simulated (default 30); with --real, real seconds (default "
        "600; --quick 35)",
    )
    chaos.add_argument(
        "--quiet",
        type=float,
        help="seconds without faults before the final checks (default 40; with --real 30, "
        "--quick 15)",
    )
    chaos.add_argument(
        "--faults",
        help="comma-separated fault kinds to draw from (default: partition, isolate, bridge, "
        "one-way, flaky, slow, crash, pause, skew; also seed-partition, intruder; with --real: "
        "kill, pause, pause-long, partition, isolate, one-way, bridge, slow, flaky; --real "
        "--quick: kill, pause, pause-long, isolate, one-way, flaky)",
    )
    chaos.add_argument(
        "--seed-layout",
        help="which nodes are seed nodes: all (the default), first-1, first-2, first-3, or "
        "drawn (per seed: the first one to three nodes or a random subset, never all); not "
        "with --real",
    )
    chaos.add_argument(
        "--seed-restarts",
        type=float,
        help="probability that a partition whose losing side holds a seed node crashes that "
        "seed node and restarts it while cut off or at the heal (default 0); not with --real",
    )
    chaos.add_argument(
        "--realistic",
        action="store_true",
        help="as hard as real hosts: --seed-layout drawn --seed-restarts 0.5 and every fault "
        "kind, the intruder too (the options given still apply on top); not with --real",
    )
    chaos.add_argument(
        "--profile",
        help="a failover profile for every node's timing: fast-lan or default (default: the "
        "simulation's own); not with --real",
    )
    chaos.add_argument(
        "--rollout",
        type=float,
        help="probability that a seed runs a rolling upgrade alongside its faults (default 0; "
        "1: every seed): every node, one at a time, leaves and comes back on the next build "
        "(app version 1.1.0, wire protocol versions 1-2), then one is rolled back to 1.0.0, "
        "with a crash and a partition during the rollout; not with --real",
    )
    chaos.add_argument(
        "--message-interval",
        type=float,
        default=0.1,
        help="seconds between a workload client's messages, on average (default 0.1)",
    )
    chaos.add_argument(
        "--workloads",
        help="comma-separated workloads: counter (the default), fan-out (rooms copying each "
        "post to member inboxes before they answer), or both; not with --real",
    )
    chaos.add_argument(
        "--event-sourced",
        action="store_true",
        help="counters, rooms and inboxes keep their state as events in a group-committing "
        "memory journal the nodes share, and the checkers read it; not with --real",
    )
    chaos.add_argument(
        "--no-lease", action="store_true", help="run without shard and singleton leases"
    )
    chaos.add_argument(
        "--removal-margin",
        type=float,
        help="seconds the coordinator waits before moving a downed node's shards (default: "
        "stable_after without leases, 0 with them); not with --real",
    )
    chaos.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="processes to run seeds in (default: one per core; not with --real)",
    )
    chaos.add_argument(
        "--real",
        action="store_true",
        help="run node processes on 127.0.0.1 instead of a simulated cluster",
    )
    chaos.add_argument(
        "--quick",
        action="store_true",
        help="with --real: 3 nodes, 35 s of shorter faults, 15 s quiet (about 70 s in all)",
    )
    chaos.add_argument(
        "--rolling",
        action="store_true",
        help="with --real: a rolling upgrade instead of faults: 3 nodes (or --nodes) on this "
        "source tree (app_version 1.0.0) replaced one at a time by a next build made with "
        "tests/rolling/next_build.patch (1.1.0: a new heartbeat field, a new message type, "
        "protocol versions 1-2), then one rolled back; prints the time of each node step "
        "(about 60 s; needs a source checkout and git)",
    )
    chaos.add_argument(
        "--upgrade",
        type=int,
        help="with --rolling: upgrade only this many nodes (in the order the seed draws) before "
        "rolling one of them back (default: all)",
    )
    chaos.add_argument(
        "--dir",
        type=Path,
        help="with --real: the data directory (certificates, configurations, logs, histories); "
        "default a temporary one, removed after a clean run",
    )
    chaos.add_argument("--json", action="store_true", help="print one JSON object per seed")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``p2pshard`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        code = _command(args)
        sys.stdout.flush()  # a reader that went away (| head) shows here, not at exit
    except BrokenPipeError:
        return _stdout_closed()
    return code


def _command(args: argparse.Namespace) -> int:
    try:
        if args.command == "certs":
            return _certs(args)
        if args.command == "node":
            return _node(args.config, args.app)
        if args.command == "status":
            return _status(args)
        if args.command in ("leave", "down"):
            return _member_command(args)
        if args.command == "remove-sharding-data":
            return _remove_sharding_data(args)
        if args.command == "chaos":
            return _chaos(args)
        from ._localcluster import LocalCluster

        cluster = LocalCluster(
            nodes=args.nodes,
            data_dir=args.dir,
            cluster=args.cluster,
            host=args.host,
            base_port=args.base_port,
            log_level=args.log_level,
        )
        return cluster.run(duration=args.duration)
    except ConfigurationError as exc:
        print(f"p2pshard {args.command}: error: {exc}", file=sys.stderr)
        return 2


EXIT_STDOUT_CLOSED = 141
"""The exit status when the reader of standard output went away (``| head``): 128 + SIGPIPE,
what a shell reports for a program that signal stops."""


def _stdout_closed() -> int:
    """Exit quietly when standard output is a pipe whose reader is gone (``status | head``).

    What is still buffered for it cannot be written, and Python would say so at exit; standard
    output is pointed at the null device instead.
    """
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):  # no file descriptor (a test's stand-in): nothing to flush
        pass
    return EXIT_STDOUT_CLOSED


def _chaos(args: argparse.Namespace) -> int:
    import os
    import time

    import attrs

    from ..testing import ChaosSettings, run_chaos, run_seeds, summarize
    from ..testing._chaos import REALISTIC

    if args.real:
        return _chaos_real(args)
    if args.quick or args.rolling or args.upgrade is not None or args.dir is not None:
        raise ConfigurationError("--quick, --rolling, --upgrade and --dir go with --real")
    base = REALISTIC if args.realistic else ChaosSettings()
    faults = base.faults
    if args.faults is not None:
        faults = tuple(k.strip() for k in args.faults.split(","))
    workloads = ChaosSettings().workloads
    if args.workloads is not None:
        workloads = tuple(k.strip() for k in args.workloads.split(","))
    settings = attrs.evolve(
        base,
        workloads=workloads,
        nodes=5 if args.nodes is None else args.nodes,
        duration=30.0 if args.duration is None else args.duration,
        quiet=40.0 if args.quiet is None else args.quiet,
        faults=faults,
        use_lease=not args.no_lease,
        message_interval=args.message_interval,
        seed_layout=base.seed_layout if args.seed_layout is None else args.seed_layout,
        seed_restarts=base.seed_restarts if args.seed_restarts is None else args.seed_restarts,
        profile=args.profile,
        removal_margin=args.removal_margin,
        rollout=base.rollout if args.rollout is None else args.rollout,
        event_sourced=args.event_sourced,
    )
    if args.seeds < 1:
        raise ConfigurationError(f"--seeds {args.seeds} is invalid: must be at least 1")
    if args.seed is not None:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
        report = run_chaos(args.seed, settings)
        print(f"seed {report.seed}: trace {report.trace_hash}")
        print(f"seed nodes: {', '.join(report.seed_nodes)}")
        print("faults:")
        for fault in report.faults:
            print(f"  {fault}")
        print(
            f"{report.incarnations} entity incarnations, {report.acknowledged} of "
            f"{report.sent} messages acknowledged"
        )
        if report.rollout is not None:
            print("rolling upgrade (simulated seconds from each node's leave):")
            for step in report.rollout.steps:
                print(f"  {step}")
            versions = ", ".join(f"{node} {version}" for node, version in report.rollout.versions)
            print(f"  app versions after the quiet: {versions}")
        print(f"violations: {len(report.violations)}")
        for violation in report.violations:
            print(f"  {violation}")
        return 0 if report.ok else 1
    jobs = args.jobs or os.cpu_count() or 1
    seeds = range(args.start_seed, args.start_seed + args.seeds)
    started = time.monotonic()
    reports = []
    for report in run_seeds(seeds, settings, jobs=jobs):
        reports.append(report)
        if args.json:
            print(
                json.dumps(
                    {
                        "seed": report.seed,
                        "violations": [str(v) for v in report.violations],
                        "faults": len(report.faults),
                        "incarnations": report.incarnations,
                        "sent": report.sent,
                        "acknowledged": report.acknowledged,
                        "trace_hash": report.trace_hash,
                        "rollout": None
                        if report.rollout is None
                        else [attrs.asdict(step) for step in report.rollout.steps],
                    }
                ),
                flush=True,
            )
        elif not report.ok:
            print(f"seed {report.seed}: {report.violations[0]}", flush=True)
    if not args.json:
        print(summarize(reports))
        print(f"{'real seconds':<28}{time.monotonic() - started:>10.1f}")
    failing = [r for r in reports if not r.ok]
    if failing:
        first = failing[0]
        [again] = run_seeds([first.seed], settings)
        same = again.trace_hash == first.trace_hash
        print(
            f"seed {first.seed} run again: "
            + ("the same trace, it reproduces" if same else "a different trace: NOT reproducible")
        )
        return 1
    return 0


def _chaos_real(args: argparse.Namespace) -> int:
    import random

    from ..testing._real import RealChaosSettings, remove_data, run_real_chaos, summarize_real

    if args.workloads is not None:
        raise ConfigurationError("--workloads goes with the simulated cluster, not --real")
    if args.event_sourced:
        raise ConfigurationError("--event-sourced goes with the simulated cluster, not --real")
    if (
        args.seed_layout is not None
        or args.seed_restarts is not None
        or args.realistic
        or args.profile is not None
        or args.rollout is not None
    ):
        raise ConfigurationError(
            "--seed-layout, --seed-restarts, --profile, --realistic and --rollout go with the "
            "simulated cluster, not --real"
        )
    if args.removal_margin is not None:
        raise ConfigurationError(
            "--removal-margin goes with the simulated cluster, not --real (a real node takes "
            "sharding.down_removal_margin from its entity type's settings)"
        )
    if args.rolling:
        if args.quick or args.faults is not None or args.duration is not None:
            raise ConfigurationError(
                "--rolling injects no faults: --quick, --faults and --duration do not go with it"
            )
        base = RealChaosSettings.rolling_upgrade()
    else:
        if args.upgrade is not None:
            raise ConfigurationError("--upgrade goes with --real --rolling")
        base = RealChaosSettings.quick() if args.quick else RealChaosSettings()
    faults = (
        base.faults if args.faults is None else tuple(k.strip() for k in args.faults.split(","))
    )
    settings = attrs.evolve(
        base,
        nodes=base.nodes if args.nodes is None else args.nodes,
        duration=base.duration if args.duration is None else args.duration,
        quiet=base.quiet if args.quiet is None else args.quiet,
        faults=faults,
        use_lease=not args.no_lease,
        message_interval=args.message_interval,
        upgrade=args.upgrade or 0,
    )
    seed = random.randrange(1 << 31) if args.seed is None else args.seed
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    try:
        report = run_real_chaos(seed, settings, data_dir=args.dir)
    except KeyboardInterrupt:
        print("p2pshard chaos: interrupted; every node process was stopped", file=sys.stderr)
        return 130
    if args.json:
        print(
            json.dumps(
                {
                    "seed": report.seed,
                    "violations": [str(v) for v in report.violations],
                    "faults": report.fault_counts(),
                    "processes": report.processes,
                    "incarnations": report.incarnations,
                    "sent": report.sent,
                    "acknowledged": report.acknowledged,
                    "agreed_after": None
                    if report.agreed_after is None
                    else round(report.agreed_after, 1),
                    "seconds": round(report.seconds, 1),
                    "data_dir": str(report.data_dir),
                    "steps": [
                        {
                            "node": step.node,
                            "from": step.from_build,
                            "to": step.to_build,
                            "left": round(step.left, 1),
                            "removed": round(step.removed, 1),
                            "up": round(step.up, 1),
                        }
                        for step in report.steps
                    ],
                }
            )
        )
    else:
        print(summarize_real(report))
        for violation in report.violations[1:20]:
            print(f"  {violation}")
    if report.ok and args.dir is None:
        remove_data(report)
    return 0 if report.ok else 1


def _certs(args: argparse.Namespace) -> int:
    command = args.certs_command
    if command == "init":
        ca = create_cluster_ca(args.cluster, args.out, days=args.days, force=args.force)
        print(f"cluster CA for {ca.cluster!r}: {ca.cert_file} (key {ca.key_file}, mode 0600)")
    elif command == "request":
        identity = PeerIdentity(IdentityKind(args.kind), args.name)
        requested = create_signing_request(
            identity, args.out, cluster=args.cluster, force=args.force
        )
        print(
            f"{identity.kind.value} {identity.name!r} of cluster {requested.cluster!r}: key "
            f"{requested.key_file} (mode 0600, keep it here), signing request "
            f"{requested.request_file}\n"
            f"take the request to the CA's machine: p2pshard certs sign "
            f"{requested.request_file.name} --ca CA_DIR --out {identity.kind.value}.pem"
        )
    elif command == "sign":
        signed = sign_request(
            args.request,
            args.ca,
            args.out,
            cluster=args.cluster,
            days=args.days,
            force=args.force,
        )
        kind = signed.identity.kind.value
        print(
            f"signed {kind} {signed.identity.name!r} of cluster {signed.cluster!r}\n"
            f"  identity     {signed.uri}\n"
            f"  key          {signed.key_description}\n"
            f"  serial       {signed.serial:x}  (deny it with serial:{signed.serial:x})\n"
            f"  valid until  {signed.not_valid_after:%Y-%m-%d %H:%M} UTC\n"
            f"  certificate  {signed.cert_file}\n"
            f"send back {signed.cert_file} and the CA certificate {signed.ca_file}"
        )
    else:
        files = create_certificate(
            PeerIdentity(IdentityKind(command), args.name),
            args.ca,
            args.out,
            cluster=args.cluster,
            days=args.days,
            force=args.force,
        )
        print(
            f"{command} {files.node!r} of cluster {files.cluster!r}: {files.cert_file} "
            f"(key {files.key_file}, mode 0600; CA copy {files.ca_file}; serial {files.serial:x})"
        )
    return 0


def _node(config_file: Path, app_option: str | None) -> int:
    from ._app import load_app

    config = NodeConfig.load(config_file)
    if not config.seed_nodes and not config.self_join and config.discovery.method == "static":
        raise ConfigurationError(
            f"{config_file}: seed_nodes is empty and self_join is false, so this node would "
            "never join a cluster: list the seed nodes (a first node may list only itself), or "
            "set self_join = true for a cluster of its own, or find the others by DNS "
            '([discovery] method = "dns")'
        )
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Loaded before the node starts: a typo in the app's name costs no join and no leave.
    app = None
    if app_option is not None:
        app = load_app(app_option, "--app")
    elif config.app:
        source = "P2PSHARD_APP" if os.environ.get("P2PSHARD_APP") else f"app of {config_file}"
        app = load_app(config.app, source)
    try:
        return trio.run(_serve_node, config, config_file, app)
    except OSError as exc:
        logger.error("%s: cannot run: %s", config.node_name, exc)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C while the node started, before it took signals: it was in no cluster yet.
        logger.info("%s: interrupted while starting", config.node_name)
        return 130


def _reload_tls(node: Node, running: NodeConfig, config_file: Path) -> bool:
    """Read ``config_file`` again and apply its ``[tls]`` table to the running node.

    A file that does not load, changes the node's cluster or name, or names TLS files the
    transport refuses, is refused with the reason (logged), and the old settings stay.
    """
    name = running.node_name
    try:
        config = NodeConfig.load(config_file)
        if (config.cluster_name, config.node_name) != (running.cluster_name, running.node_name):
            raise ConfigurationError(
                f"it names node {config.node_name!r} of cluster {config.cluster_name!r}, but "
                f"this is {running.node_name!r} of {running.cluster_name!r}: restart the node "
                "to change them"
            )
        transport = node.transport
        if not isinstance(transport, TcpTransport):  # pragma: no cover - the command runs TCP
            raise ConfigurationError("this node's transport has no TLS settings to reload")
        transport.reload_tls(config.tls.identity(config.cluster_name))
    except ConfigurationError as exc:
        logger.error(
            "%s: SIGHUP: kept the TLS settings it runs with; %s is refused: %s",
            name,
            config_file,
            exc,
        )
        return False
    logger.info("%s: SIGHUP: applied [tls] of %s", name, config_file)
    if attrs.evolve(config, tls=running.tls) != running:
        logger.warning(
            "%s: SIGHUP: %s changes more than [tls]; the rest applies at the next start",
            name,
            config_file,
        )
    return True


async def _serve_node(config: NodeConfig, config_file: Path, app: App | None = None) -> int:
    """Run the node until a signal (then leave: 0) or the cluster removes it (EXIT_DOWNED).

    With ``app``, its setup runs once the node has started (see :func:`_run_app`); if it raises,
    the node leaves and the status is EXIT_APP_FAILED. SIGHUP applies the file's ``[tls]`` table
    again (see :func:`_reload_tls`).
    """
    from .._node import open_node

    name = config.node_name
    running_node: list[Node] = []
    # The receiver stays open until the node is gone, so that a second Ctrl-C during the leave
    # is taken here too, not raised as KeyboardInterrupt once the block is left.
    signals_taken = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    with trio.open_signal_receiver(*signals_taken) as signals, single_error():
        async with trio.open_nursery() as watcher:
            running = trio.CancelScope()

            async def stop_on_signal() -> None:
                async for signum in signals:
                    what = signal.Signals(signum).name
                    if signum == signal.SIGHUP:
                        if running_node:
                            _reload_tls(running_node[0], config, config_file)
                        else:
                            logger.info("%s: SIGHUP while starting; ignored", name)
                    elif running.cancel_called:
                        logger.info("%s: %s received; already leaving", name, what)
                    else:
                        logger.info("%s: %s received, leaving the cluster", name, what)
                        running.cancel()

            watcher.start_soon(stop_on_signal)
            async with open_node(config) as node:
                running_node.append(node)
                logger.info(
                    "%s: running as %s (p2pshard %s, app_version %s); Ctrl-C or SIGTERM stops "
                    "it, SIGHUP reloads [tls]",
                    name,
                    node.address,
                    release(),
                    config.app_version or "not set",
                )
                app_failed = False
                with running:
                    app_failed = await _run_app(node, app)
                removed = not running.cancel_called and not app_failed
                if app_failed:
                    running.cancel()  # a signal during the leave finds the node leaving
            watcher.cancel_scope.cancel()
    if app_failed:
        assert app is not None
        logger.error(
            "%s: exiting with status %d: the setup of app %s failed (the traceback is above)",
            name,
            EXIT_APP_FAILED,
            app.spec,
        )
        return EXIT_APP_FAILED
    if removed:
        reason = node.cluster.termination_reason
        logger.warning(
            "%s: out of the cluster (%s); exiting with status %d so that a supervisor starts "
            "this node again",
            name,
            reason,
            EXIT_DOWNED,
        )
        return EXIT_DOWNED
    return 0


async def _run_app(node: Node, app: App | None) -> bool:
    """Run ``app``'s setup on ``node`` until the node is out of the cluster; whether it raised.

    A setup that returns leaves the node running; one that keeps running (a web server of the
    app, say) is cancelled when the node leaves. Without an app, wait until the node is out.
    """
    name = node.config.node_name
    failed = False
    async with trio.open_nursery() as tasks:

        async def set_up(app: App) -> None:
            nonlocal failed
            logger.info("%s: setting up app %s", name, app.spec)
            try:
                await app.setup(node)
            except Exception:
                failed = True
                logger.exception(
                    "%s: the setup of app %s raised; leaving the cluster", name, app.spec
                )
                tasks.cancel_scope.cancel()
            else:
                logger.info("%s: app %s is set up; the node runs on", name, app.spec)

        if app is not None:
            tasks.start_soon(set_up, app)
        await node.terminated.wait()  # downed or removed: nothing left to run
        tasks.cancel_scope.cancel()
    return failed


def _error(command: str, text: str) -> None:
    print(f"p2pshard {command}: error: {text}", file=sys.stderr)


def _quiet_logging() -> None:
    """Only errors of the client transport reach stderr (unless logging is set up already)."""
    logging.basicConfig(
        level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def _check_timeout(option: str, value: float) -> None:
    if not 0 < value < 3600:
        raise ConfigurationError(f"{option} {value!r} is invalid: must be seconds from 0 to 3600")


def _address(option: str, value: str) -> Address:
    try:
        address = Address.parse(value)
        if address.port == 0:
            raise ConfigurationError("port 0")
    except ConfigurationError:
        raise ConfigurationError(
            f"{option} {value!r} is invalid: expected HOST:PORT with a port from 1 to 65535, "
            "e.g. 127.0.0.1:25520"
        ) from None
    return address


MANAGEMENT_TOKEN_VARIABLE = "P2PSHARD_MANAGEMENT__TOKEN"
"""Where ``p2pshard status --management`` finds the bearer token (a node's own override)."""


def _management_status(args: argparse.Namespace) -> int:
    from .._management_client import ManagementRequestError, fetch_status, management_url
    from .._status import reply_json, reply_text

    if args.bind is not None:
        raise ConfigurationError("--bind goes with --node, not --management")
    url = management_url(args.management)
    _check_timeout("--timeout", args.timeout)
    config = None if args.config is None else ClientConfig.load(args.config)
    token = os.environ.get(MANAGEMENT_TOKEN_VARIABLE) or None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read --token-file {args.token_file}: {exc.strerror or exc}"
            ) from None
    _quiet_logging()
    try:
        reply = trio.run(
            partial(
                fetch_status,
                url,
                config=config,
                token=token,
                request_timeout=args.timeout,
                types=args.types or (),
            )
        )
    except ManagementRequestError as exc:
        _error("status", str(exc))
        return 1
    if args.json:
        print(json.dumps(reply_json(reply), indent=2))
    else:
        print(reply_text(reply))
    return 0


def _status(args: argparse.Namespace) -> int:
    from .._status import open_client, probe_nodes, reply_json, reply_text

    if args.management is not None:
        return _management_status(args)
    if args.types or args.token_file is not None:
        raise ConfigurationError("--type and --token-file go with --management, not --node")
    if args.config is None:
        raise ConfigurationError("--node needs --config, a client's file or a node's")
    target = _address("--node", args.node)
    _check_timeout("--timeout", args.timeout)
    config = ClientConfig.load(args.config)
    config.identity()  # a certificate that is unreadable or for another cluster: exit 2
    _quiet_logging()

    async def ask() -> Probe:
        async with open_client(config, bind_host=args.bind) as transport:
            (probe,) = await probe_nodes(
                transport,
                [target],
                timeout=args.timeout,
                stats_timeout=min(2.0, args.timeout * 0.4),
            )
        return probe

    try:
        probe = trio.run(ask)
    except OSError as exc:
        _error("status", f"cannot listen for the answer: {exc}")
        return 1
    reply = probe.reply
    if reply is None:
        why = (
            "linked to it, but it did not answer (is it a node of cluster "
            f"{config.cluster_name!r} with the status service?)"
            if probe.linked
            else "cannot link to it (is a node of cluster "
            f"{config.cluster_name!r} running there, and does it trust this certificate?)"
        )
        _error("status", f"no answer from {target} within {args.timeout:g} s: {why}")
        return 1
    if args.json:
        print(json.dumps(reply_json(reply), indent=2))
    else:
        print(reply_text(reply))
    return 0


def _member_command(args: argparse.Namespace) -> int:
    from .._status import command_member, open_client

    command: str = args.command
    address = _address("ADDRESS", args.address)
    target = address if args.node is None else _address("--node", args.node)
    _check_timeout("--timeout", args.timeout)
    config = ClientConfig.load(args.config)
    config.identity()  # a certificate that is unreadable or for another cluster: exit 2
    _quiet_logging()

    async def ask() -> CommandAnswer:
        async with open_client(config, bind_host=args.bind) as transport:
            return await command_member(transport, target, command, address, timeout=args.timeout)

    try:
        answer = trio.run(ask)
    except OSError as exc:
        _error(command, f"cannot listen for the answer: {exc}")
        return 1
    reply = answer.reply
    if reply is None:
        why = (
            "linked to it, but it did not answer (is it a node of cluster "
            f"{config.cluster_name!r}?)"
            if answer.linked
            else "cannot link to it (is a node of cluster "
            f"{config.cluster_name!r} running there, and does it trust this certificate?)"
        )
        hint = (
            "; to down a member that is gone, ask another one with --node HOST:PORT"
            if command == "down" and args.node is None
            else ""
        )
        _error(command, f"no answer from {target} within {args.timeout:g} s: {why}{hint}")
        return 1
    if not reply.ok:
        _error(command, f"{target} answered: {reply.text}")
        return 1
    print(reply.text)
    return 0


@attrs.frozen
class _KeyRows:
    """One stored key of sharding data and the rows it takes in the durable store."""

    key: str
    type_name: str
    updates: int
    snapshot: bool
    tombstone: bool


def _sharding_type(key: str) -> str | None:
    """The entity type of an internal sharding key, or None if ``key`` is not one."""
    if not key.startswith("sharding/"):
        return None
    type_name, _, rest = key[len("sharding/") :].partition("/")
    if type_name and (rest == "coordinator" or rest.startswith("entities/")):
        return type_name
    return None


def _remove_sharding_data(args: argparse.Namespace) -> int:
    command = "remove-sharding-data"
    types: list[str] = args.types
    for type_name in types:
        if not type_name or "/" in type_name:
            raise ConfigurationError(
                f"--type {type_name!r} is invalid: an entity type name is non-empty, without '/'"
            )
    if not types and not args.all_types:
        raise ConfigurationError("say which entity types: --type TYPE (repeatable) or --all-types")
    _check_timeout("--probe-timeout", args.probe_timeout)
    config = NodeConfig.load(args.config)
    path = config.replicator.durable_path
    if path is None:
        print(
            f"nothing to remove: {config.node_name} has no durable store (replicator."
            "durable_path is not set), so its sharding data lived only in memory"
        )
        return 0
    if not path.exists():
        print(f"nothing to remove: there is no durable store at {path}")
        return 0
    client = (
        ClientConfig.of_node(config)
        if args.client_config is None
        else ClientConfig.load(args.client_config)
    )
    if client.cluster_name != config.cluster_name:
        raise ConfigurationError(
            f"--client-config {args.client_config} is for cluster {client.cluster_name!r}, "
            f"but the node's is {config.cluster_name!r}"
        )
    client.identity()  # a certificate that is unreadable or for another cluster: exit 2
    answered = _running_nodes(config, client, args.probe_timeout)
    if answered:
        raise ConfigurationError(
            f"refusing to remove sharding data: {answered} answered, so cluster "
            f"{config.cluster_name!r} is running; stop every node first"
        )
    try:
        removed = _delete_sharding_keys(path, None if args.all_types else set(types))
    except sqlite3.Error as exc:
        _error(command, f"cannot change the durable store {path}: {exc}")
        return 1
    wanted = "every entity type" if args.all_types else ", ".join(types)
    if not removed:
        print(f"nothing to remove: no sharding data of {wanted} in {path}")
        return 0
    print(f"removed from {path} ({config.node_name}):")
    for row in removed:
        parts = (["tombstone"] if row.tombstone else ["snapshot"] if row.snapshot else []) + (
            [f"{row.updates} updates"] if row.updates else []
        )
        print(f"  {row.key}  ({', '.join(parts)})")
    by_type: dict[str, int] = {}
    for row in removed:
        by_type[row.type_name] = by_type.get(row.type_name, 0) + 1
    summary = ", ".join(f"{name}: {count} keys" for name, count in sorted(by_type.items()))
    missing = sorted(set(types) - set(by_type)) if not args.all_types else []
    print(f"{len(removed)} keys removed ({summary})")
    if missing:
        print(f"no sharding data found for: {', '.join(missing)}")
    print("run this on every node's store before starting the cluster again")
    return 0


def _running_nodes(config: NodeConfig, client: ClientConfig, timeout: float) -> str:
    """Who of the seed nodes and the node itself answers ('' if nobody), asked as ``client``.

    A node that accepts a link (a TLS handshake as a member of this cluster) but does not answer
    the status request counts as running too: an older version, or one too busy to answer.
    """
    from .._status import open_client, probe_nodes

    targets = list(dict.fromkeys(config.seed_nodes))
    if config.canonical_address.port != 0 and config.canonical_address not in targets:
        targets.append(config.canonical_address)
    if not targets:
        raise ConfigurationError(
            "cannot check that the cluster is stopped: the configuration names no seed nodes and "
            "binds port 0; give it seed_nodes or a bind_port"
        )

    async def ask() -> str:
        async with open_client(client) as transport:
            probes = await probe_nodes(
                transport, targets, timeout=timeout, stats_timeout=0.05, first_answer=True
            )
        return ", ".join(
            f"{p.reply.node} (at {p.target})"
            if p.reply is not None
            else f"a node at {p.target} (it accepted a link but did not answer)"
            for p in probes
            if p.reply is not None or p.linked
        )

    _quiet_logging()
    try:
        return trio.run(ask)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot check that the cluster is stopped: cannot listen for answers: {exc}"
        ) from None


def _delete_sharding_keys(path: Path, types: set[str] | None) -> list[_KeyRows]:
    """Delete the sharding keys of ``types`` (None: every type) in one transaction."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=rw", uri=True, isolation_level=None, timeout=5)
    except sqlite3.Error as exc:
        raise ConfigurationError(f"cannot open the durable store {path}: {exc}") from None
    try:
        try:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = {
                name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
        except sqlite3.DatabaseError as exc:
            raise ConfigurationError(
                f"{path} is not a durable store (an SQLite file): {exc}"
            ) from None
        if version != SCHEMA_VERSION or not {"updates", "snapshots"} <= tables:
            raise ConfigurationError(
                f"{path} is not a durable store of schema version {SCHEMA_VERSION} "
                f"(user_version {version}, tables {sorted(tables) or 'none'})"
            )
        db.execute("BEGIN IMMEDIATE")
        try:
            rows: dict[str, _KeyRows] = {}

            def wanted(key: str) -> str | None:
                type_name = _sharding_type(key)
                return type_name if type_name and (types is None or type_name in types) else None

            for key, deleted in db.execute("SELECT key, deleted FROM snapshots"):
                if type_name := wanted(key):
                    rows[key] = _KeyRows(key, type_name, 0, not deleted, bool(deleted))
            for key, count in db.execute("SELECT key, count(*) FROM updates GROUP BY key"):
                if type_name := wanted(key):
                    old = rows.get(key) or _KeyRows(key, type_name, 0, False, False)
                    rows[key] = attrs.evolve(old, updates=count)
            keys = [(key,) for key in rows]
            db.executemany("DELETE FROM updates WHERE key = ?", keys)
            db.executemany("DELETE FROM snapshots WHERE key = ?", keys)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return [rows[key] for key in sorted(rows)]
    finally:
        db.close()
