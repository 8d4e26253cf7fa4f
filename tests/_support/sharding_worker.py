"""One real node process running sharded ``Counter`` entities with remember-entities.

Run as ``python -m tests._support.sharding_worker CONFIG``. The config's replicator must keep
``sharding/*`` in its durable store (``tests/p2pshard/test_remember_processes.py`` writes such
configs). The worker opens a node, waits until it is Up, starts the entity type ``Counter``
(``remember_entities=True``, 20 shards), prints ``ready``, then answers each command on stdin
with one line on stdout:

    touch ID            -> at <node-name>   (asks entity ID where it runs; starts it if needed)
    passivate ID        -> passivating      (the entity passivates itself: it is forgotten)
    started             -> ids ...          (ids of Counter instances made in this process)
    received            -> ids ...          (ids that handled a message in this process)
    hosted              -> ids ...          (active entity ids here, from ``region_state``)
    shards              -> ids ...          (shard ids hosted here)
    remembered SHARD    -> ids ...          (the shard's remembered ids in the local replica)
    members             -> the number of Up members
    quit                -> leaves the cluster gracefully, prints bye

A failing command answers ``error <ExceptionClass> <message>``; end of input is a quit. Ids are
listed sorted, with repeats (an id made twice in this process is listed twice). Every wait is
bounded: the node's own operations by their timeouts, the start by ``START_LIMIT``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import trio
from pycrdt import Map

from benchmarks._process import Lines
from crdt import ReadLocal
from membership import MemberStatus
from p2pshard import (
    EntityContext,
    HashExtractor,
    Node,
    NodeConfig,
    ShardingSettings,
    open_node,
)
from p2pshard.sharding._remember import entities_key
from tests._support.durable_worker import answer, is_up

TYPE_NAME = "Counter"
SHARDS = 20
ASK_TIMEOUT = 5.0
START_LIMIT = 15.0
"""Seconds the node may take to be Up and start its region before the worker gives up."""

SETTINGS = ShardingSettings(
    remember_entities=True,
    passivate_idle_after=None,  # only an explicit passivation forgets an entity
    rebalance_interval=3600.0,  # no shard moves during a test: each entity starts once
    retry_interval=0.5,
)

logger = logging.getLogger("tests.sharding_worker")


class Record:
    """What the Counter instances of this process did, in order."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.received: list[str] = []


class Counter:
    """Records its construction; answers ``where`` and passivates itself on ``passivate``."""

    def __init__(self, ctx: EntityContext, record: Record, node_name: str) -> None:
        self._record = record
        self._node_name = node_name
        record.started.append(ctx.entity_id)
        logger.info("Counter %s started (shard %s)", ctx.entity_id, ctx.shard_id)

    async def receive(self, message: object, ctx: EntityContext) -> object:
        self._record.received.append(ctx.entity_id)
        if message == "passivate":
            ctx.passivate()
            return "passivating"
        return f"at {self._node_name}"


def ids(values: list[str] | set[str] | frozenset[str]) -> str:
    return " ".join(["ids", *sorted(values)])


async def run(node: Node, record: Record, words: list[str]) -> str:
    """One command's answer."""
    region = node.sharding.region(TYPE_NAME)
    match words:
        case ["touch", entity_id]:
            return str(await region.entity_ref(entity_id).ask("where", timeout=ASK_TIMEOUT))
        case ["passivate", entity_id]:
            return str(await region.entity_ref(entity_id).ask("passivate", timeout=ASK_TIMEOUT))
        case ["started"]:
            return ids(record.started)
        case ["received"]:
            return ids(record.received)
        case ["hosted"]:
            state = node.sharding.region_state(TYPE_NAME)
            return ids([e for shard in state.shards for e in shard.entity_ids])
        case ["shards"]:
            return ids([shard.shard_id for shard in node.sharding.region_state(TYPE_NAME).shards])
        case ["remembered", shard_id]:
            doc = await node.replicator.get(entities_key(TYPE_NAME, shard_id), ReadLocal())
            if doc is None:
                return ids([])
            return ids([str(k) for k in doc.get("entities", type=Map)])
        case ["members"]:
            return str(sum(m.status is MemberStatus.UP for m in node.cluster.members))
    return f"error ValueError unknown command {' '.join(words)!r}"


async def serve(config: NodeConfig) -> None:
    record = Record()
    began = time.monotonic()
    async with open_node(config) as node:
        with trio.fail_after(START_LIMIT):
            await node.cluster.wait_up()
            async with node.cluster.subscribe() as events:  # WeaklyUp is not enough: wait for Up
                if not is_up(node):
                    async for _ in events:
                        if is_up(node):
                            break
            await node.sharding.start(
                TYPE_NAME,
                lambda ctx: Counter(ctx, record, config.node_name),
                extractor=HashExtractor(SHARDS),
                settings=SETTINGS,
            )
        logger.info("ready %.2f s after the start", time.monotonic() - began)
        answer("ready")
        async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
            lines = Lines(stdin)
            while (line := await lines.readline()) is not None and line.strip() != "quit":
                try:
                    reply = await run(node, record, line.split())
                except Exception as error:  # the test asserts on it; the node keeps serving
                    message = " ".join(str(error).split())
                    reply = f"error {type(error).__name__} {message}"
                answer(reply)
    answer("bye")


def main() -> None:
    config = NodeConfig.load(sys.argv[1])
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    trio.run(serve, config)


if __name__ == "__main__":
    main()
