"""Durable keys across real crashes and restarts: node processes over TLS on 127.0.0.1.

Each node runs ``tests/_support/durable_worker.py`` in its own process, driven line by line through
its stdin and stdout; its log goes to a file under ``tmp_path``. Certificates and configuration
files come from :class:`p2pshard.cli._localcluster.LocalCluster`, with faster membership timers.
Every test bounds its time with ``trio.fail_after`` and kills what is still running at the end.
"""

from __future__ import annotations

import resource
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from crdt import ReplicatorSettings
from p2pshard import NodeConfig
from p2pshard.cli._localcluster import LocalCluster
from p2pshard.testing import free_port_block
from tests._support.workers import FAST, Worker, all_up, workers


def prepare(data_dir: Path, nodes: int) -> list[Path]:
    """Certificates and one config per node; durable keys ``d-*`` in ``node-N/ddata.sqlite``."""
    configs = LocalCluster(
        nodes=nodes, data_dir=data_dir, base_port=free_port_block(nodes)
    ).prepare()
    for path in configs:
        config = attrs.evolve(
            NodeConfig.load(path, environ={}),
            cluster=FAST,
            shutdown_timeout=5.0,
            replicator=ReplicatorSettings(
                gossip_interval=0.5,
                durable_keys=("d-*",),
                durable_path=path.parent / "ddata.sqlite",
            ),
        )
        path.write_text(config.to_toml())
    return configs


async def eventually(node: Worker, command: str, expected: str, limit: float = 10.0) -> None:
    """Ask until the answer is ``expected``."""
    with trio.fail_after(limit):
        while (reply := await node.ask(command)) != expected:
            print(f"{command!r}: {reply!r}, waiting for {expected!r}")
            await trio.sleep(0.1)


async def test_acknowledged_durable_write_survives_kill_9(tmp_path: Path) -> None:
    """Acknowledged, then kill -9 at once: the restarted node reads it back from its own file.

    The other nodes are killed too before the restart, so nothing but node-1's SQLite file
    can bring the value back; the non-durable key written just before is gone.
    """
    configs = prepare(tmp_path, 3)
    with trio.fail_after(50):
        async with workers() as running:
            nodes = await running.start(*configs)
            await all_up(nodes)
            a, b, c = nodes
            assert await a.ask("put v-1 f volatile local") == "ok"
            assert await a.ask("put d-1 f acknowledged local") == "ok"
            await a.kill()
            await b.kill()
            await c.kill()
            (a,) = await running.start(configs[0])
            assert await a.ask("members") == "1"  # alone: the others are dead
            assert await a.ask("get d-1 f local") == "value acknowledged"
            assert await a.ask("get v-1 f local") == "none"


async def test_full_cluster_restart_keeps_durable_keys_only(tmp_path: Path) -> None:
    """Majority writes, every node leaves, every node restarts: durable keys are back."""
    configs = prepare(tmp_path, 3)
    expected = {
        ("d-1", "f"): "one",
        ("d-2", "f"): "two",
        ("d-3", "f"): "three",
        ("d-shared", "a"): "from-node-1",
        ("d-shared", "b"): "from-node-2",
    }
    with trio.fail_after(55):
        async with workers() as running:
            nodes = await running.start(*configs)
            await all_up(nodes)
            assert await nodes[0].ask("put d-1 f one majority") == "ok"
            assert await nodes[1].ask("put d-2 f two majority") == "ok"
            assert await nodes[2].ask("put d-3 f three majority") == "ok"
            assert await nodes[0].ask("put d-shared a from-node-1 majority") == "ok"
            assert await nodes[1].ask("put d-shared b from-node-2 majority") == "ok"
            assert await nodes[2].ask("put v-1 f volatile majority") == "ok"
            assert await nodes[0].ask("get v-1 f majority") == "value volatile"
            async with trio.open_nursery() as nursery:
                for node in nodes:
                    nursery.start_soon(node.quit)

            nodes = await running.start(*configs)
            await all_up(nodes)
            for node in nodes:
                for (key, field), value in expected.items():
                    await eventually(node, f"get {key} {field} local", f"value {value}")
            for node in nodes:
                assert await node.ask("get v-1 f all") == "none"


LIMIT = 1 << 20
"""The file size limit (RLIMIT_FSIZE) that makes SQLite's writes fail."""


@asynccontextmanager
async def file_size_limit(worker: Worker) -> AsyncIterator[None]:
    """Limit the size of files ``worker`` may write, from outside, while the block runs.

    Python ignores SIGXFSZ, so a write past the limit fails with EFBIG and SQLite reports a
    real I/O error: the same path as a full disk, without needing root or a tiny filesystem.
    """
    pid = worker.process.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))


needs_prlimit = pytest.mark.skipif(
    not hasattr(resource, "prlimit"), reason="limits another process's file size with prlimit"
)


@needs_prlimit
async def test_store_failure_surfaces_in_a_real_process(tmp_path: Path) -> None:
    """A write SQLite cannot store fails with StoreFailure; the node keeps storing the rest."""
    (config,) = prepare(tmp_path, 1)
    with trio.fail_after(40):
        async with workers() as running:
            (node,) = await running.start(config)
            assert await node.ask("put d-small f before local") == "ok"
            async with file_size_limit(node):
                reply = await node.ask(f"fill d-big f {4 * LIMIT} local")
            assert reply.startswith(
                "error StoreFailure writing 'd-big' to the durable store failed"
            ), reply
            assert await node.ask("put d-small f after local") == "ok"
            assert await node.ask("get d-small f local") == "value after"
            assert "durable store" in node.log.read_text()  # logged as an error too
            await node.kill()
            (node,) = await running.start(config)
            assert await node.ask("get d-small f local") == "value after"
            assert await node.ask("get d-big f local") == "none"


@needs_prlimit
async def test_a_write_after_a_store_failure_of_the_same_key_survives_kill_9(
    tmp_path: Path,
) -> None:
    """After a failed append, the next acknowledged write of the same key is on disk too.

    The second write overwrites the field the failed one set, so its yrs update names the
    failed write's item as its origin: the file must hold both, or the value cannot load.
    """
    (config,) = prepare(tmp_path, 1)
    with trio.fail_after(40):
        async with workers() as running:
            (node,) = await running.start(config)
            async with file_size_limit(node):
                reply = await node.ask(f"fill d-1 f {4 * LIMIT} local")
            assert reply.startswith("error StoreFailure"), reply
            assert await node.ask("put d-1 f acknowledged local") == "ok"
            assert await node.ask("get d-1 f local") == "value acknowledged"
            await node.kill()
            (node,) = await running.start(config)
            assert await node.ask("get d-1 f local") == "value acknowledged"
