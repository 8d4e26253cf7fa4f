"""The ``p2pshard`` command.

``p2pshard certs init`` and ``p2pshard certs node`` make a cluster CA and node certificates;
``p2pshard node --config FILE`` runs one node until Ctrl-C or SIGTERM; ``p2pshard local-cluster``
runs several nodes as separate processes on one host, with throwaway certificates (the README's
main job). Errors in what the user typed or configured end with a one-line message and exit
status 2; a node that fails at run time exits with 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from membership import ConfigurationError
from membership._certs import create_cluster_ca, create_node_certificate

from ._config import NodeConfig

logger = logging.getLogger("p2pshard.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pshard",
        description="Run and manage p2pshard cluster nodes.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    certs = commands.add_parser("certs", help="make a cluster CA and node certificates")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True, metavar="WHAT")
    init = certs_commands.add_parser("init", help="make a cluster CA")
    init.add_argument("--cluster", required=True, help="the cluster name")
    init.add_argument("--out", required=True, type=Path, help="directory for ca.pem, ca-key.pem")
    init.add_argument("--days", type=int, default=3650, help="validity (default 3650)")
    init.add_argument("--force", action="store_true", help="replace existing files")
    node_cert = certs_commands.add_parser("node", help="make a node key and certificate")
    node_cert.add_argument("node", help="the node name")
    node_cert.add_argument("--ca", required=True, type=Path, help="directory of the cluster CA")
    node_cert.add_argument("--out", required=True, type=Path, help="directory for the files")
    node_cert.add_argument("--cluster", help="cluster name (default: the CA's)")
    node_cert.add_argument("--days", type=int, default=825, help="validity (default 825)")
    node_cert.add_argument("--force", action="store_true", help="replace existing files")

    node = commands.add_parser("node", help="run one node until Ctrl-C")
    node.add_argument("--config", required=True, type=Path, help="the node's TOML file")

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``p2pshard`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "certs":
            return _certs(args)
        if args.command == "node":
            return _node(args.config)
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


def _certs(args: argparse.Namespace) -> int:
    if args.certs_command == "init":
        ca = create_cluster_ca(args.cluster, args.out, days=args.days, force=args.force)
        print(f"cluster CA for {ca.cluster!r}: {ca.cert_file} (key {ca.key_file}, mode 0600)")
    else:
        files = create_node_certificate(
            args.node, args.ca, args.out, cluster=args.cluster, days=args.days, force=args.force
        )
        print(
            f"node {files.node!r} of cluster {files.cluster!r}: {files.cert_file} "
            f"(key {files.key_file}, mode 0600; CA copy {files.ca_file})"
        )
    return 0


def _node(config_file: Path) -> int:
    config = NodeConfig.load(config_file)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        trio.run(_serve_node, config)
    except OSError as exc:
        logger.error("%s: cannot run: %s", config.node_name, exc)
        return 1
    return 0


async def _serve_node(config: NodeConfig) -> None:
    from ._node import open_node

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_node(config) as node, trio.open_nursery() as nursery:
            logger.info(
                "%s: running as %s; Ctrl-C or SIGTERM stops it", config.node_name, node.address
            )

            async def stop_on_signal() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    logger.info("%s: %s received, leaving the cluster", config.node_name, name)
                    break
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_on_signal)
            await node.terminated.wait()  # downed or removed: nothing left to run
            nursery.cancel_scope.cancel()
