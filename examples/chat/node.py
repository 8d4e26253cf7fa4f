"""One chat node: a p2pshard node with the Room and Gateway entity types and a web server.

Run a whole local cluster with ``scripts/run-chat.sh``; one node by hand::

    python -m examples.chat.node --config chat-data/node-1/node.toml --http-port 26520 \
        --web-urls http://127.0.0.1:26520/,http://127.0.0.1:26521/

The configuration needs a ``[journal]`` and a ``[lease]`` table (the launcher,
``examples/chat/cluster.py``, writes SQLite ones into the data directory). Ctrl-C or SIGTERM
makes the node hand its rooms off and leave the cluster.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import trio

from p2pshard import (
    ConfigurationError,
    HashExtractor,
    Node,
    NodeConfig,
    ShardingSettings,
    open_node,
)

from .gateway import Gateway, Hub, NodeNamedAllocation, NodeNameExtractor, Ping
from .room import Room
from .web import serve_web

logger = logging.getLogger("examples.chat.node")

ROOM_SHARDS = 30


async def serve(config: NodeConfig, http_port: int, web_urls: tuple[str, ...]) -> None:
    """Run the node and its web server until a signal, or until the node is downed."""
    name = config.node_name
    # The receiver stays open until the node is gone: a second signal during the leave is
    # taken here too, not raised as KeyboardInterrupt once the block is left.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as watcher:
            running = trio.CancelScope()

            async def stop_on_signal() -> None:
                async for signum in signals:
                    what = signal.Signals(signum).name
                    if running.cancel_called:
                        logger.info("%s: %s received; already leaving", name, what)
                    else:
                        logger.info("%s: %s received, leaving", name, what)
                        running.cancel()

            watcher.start_soon(stop_on_signal)
            async with open_node(config) as node:
                with running:
                    await _serve(node, name, http_port, web_urls)
            watcher.cancel_scope.cancel()


async def _serve(node: Node, name: str, http_port: int, web_urls: tuple[str, ...]) -> None:
    await node.cluster.wait_up()
    hub = Hub(node, web_urls)
    gateways = await node.sharding.start(
        "Gateway",
        lambda ctx: Gateway(ctx, hub),
        extractor=NodeNameExtractor(),
        allocation_strategy=NodeNamedAllocation(),
        settings=ShardingSettings(rebalance_interval=2.0, entity_restart_backoff=0.2),
    )
    rooms = await node.sharding.start(
        "Room",
        lambda ctx: Room(ctx, node.journal, hub),
        extractor=HashExtractor(ROOM_SHARDS),
        settings=ShardingSettings(use_lease=True, entity_restart_backoff=0.5),
    )
    hub.set_regions(rooms, gateways)
    with trio.fail_after(30):  # places this node's gateway here before any room needs it
        where = await gateways.entity_ref(name).ask(Ping(), timeout=10)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_web, hub, http_port)
        print(f"{name}: chat at http://127.0.0.1:{port}/ (gateway on {where})", flush=True)
        await node.terminated.wait()
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.chat.node --config FILE [--http-port N] [--web-urls URL,...]``."""
    parser = argparse.ArgumentParser(prog="examples.chat.node", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="the node's TOML file")
    parser.add_argument(
        "--http-port", type=int, default=None, help="web port (default: node port + 1000)"
    )
    parser.add_argument(
        "--web-urls", default="", help="every node's page URL, comma-separated (for reconnects)"
    )
    args = parser.parse_args(argv)
    config = NodeConfig.load(args.config)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    port = config.bind_port + 1000 if args.http_port is None else args.http_port
    urls = tuple(u for u in args.web_urls.split(",") if u)
    try:
        try:
            trio.run(serve, config, port, urls)
        except BaseExceptionGroup as group:  # serve's nurseries wrap a single error
            error: BaseException = group
            while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
                error = error.exceptions[0]
            if error is group:
                raise
            raise error from None
    except ConfigurationError as exc:
        logger.error("%s: cannot run: %s", config.node_name, exc)
        return 2
    except OSError as exc:
        logger.error("%s: cannot run: %s", config.node_name, exc)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C while the node started, before it took signals: it was in no cluster yet.
        logger.info("%s: interrupted while starting", config.node_name)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
