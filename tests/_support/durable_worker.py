"""One real node process driven line by line, for the durability tests.

Run as ``python -m tests._support.durable_worker CONFIG``. It opens a node from the TOML file,
prints ``ready`` once the node is Up, then answers each command on stdin with one line on stdout:

    put KEY FIELD VALUE local|majority|all    -> ok | error <ExceptionClass> <message>
    fill KEY FIELD SIZE local|majority|all    -> as put, with a value of SIZE "x"s
    get KEY FIELD local|majority|all          -> value <v> | none | error ...
    members                                   -> the number of Up members
    quit                                      -> leaves the cluster gracefully, prints bye

End of input is a quit. Values hold no spaces: one command is one line of words.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import pycrdt
import trio

from benchmarks._process import Lines
from crdt import (
    ReadAll,
    ReadConsistency,
    ReadLocal,
    ReadMajority,
    WriteAll,
    WriteConsistency,
    WriteLocal,
    WriteMajority,
)
from membership import MemberStatus
from p2pshard import Node, NodeConfig, open_node

TIMEOUT = 3.0
MAP = "m"

WRITES: dict[str, WriteConsistency] = {
    "local": WriteLocal(),
    "majority": WriteMajority(timeout=TIMEOUT),
    "all": WriteAll(timeout=TIMEOUT),
}
READS: dict[str, ReadConsistency] = {
    "local": ReadLocal(),
    "majority": ReadMajority(timeout=TIMEOUT),
    "all": ReadAll(timeout=TIMEOUT),
}


def answer(line: str) -> None:
    print(line, flush=True)


def set_field(field: str, value: str) -> Callable[[pycrdt.Doc[Any]], None]:
    def modify(doc: pycrdt.Doc[Any]) -> None:
        doc.get(MAP, type=pycrdt.Map)[field] = value

    return modify


async def run(node: Node, words: list[str]) -> str:
    """One command's answer."""
    match words:
        case ["put", key, field, value, consistency]:
            await node.replicator.update(key, set_field(field, value), WRITES[consistency])
            return "ok"
        case ["fill", key, field, size, consistency]:
            modify = set_field(field, "x" * int(size))
            await node.replicator.update(key, modify, WRITES[consistency])
            return "ok"
        case ["get", key, field, consistency]:
            doc = await node.replicator.get(key, READS[consistency])
            if doc is None:
                return "none"
            value = doc.get(MAP, type=pycrdt.Map).get(field)
            return "none" if value is None else f"value {value}"
        case ["members"]:
            return str(sum(m.status is MemberStatus.UP for m in node.cluster.members))
    return f"error ValueError unknown command {' '.join(words)!r}"


def is_up(node: Node) -> bool:
    return node.cluster.self_member.status is MemberStatus.UP


async def serve(config: NodeConfig) -> None:
    async with open_node(config) as node:
        await node.cluster.wait_up()
        async with node.cluster.subscribe() as events:  # WeaklyUp is not enough: wait for Up
            if not is_up(node):
                async for _ in events:
                    if is_up(node):
                        break
        answer("ready")
        async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
            lines = Lines(stdin)
            while (line := await lines.readline()) is not None and line.strip() != "quit":
                try:
                    reply = await run(node, line.split())
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
