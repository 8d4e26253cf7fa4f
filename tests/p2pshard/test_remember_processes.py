"""Remembered entities across a full cluster crash: node processes over TLS on 127.0.0.1.

Each node runs ``tests/_support/sharding_worker.py`` in its own process, driven line by line
through its stdin and stdout (as ``tests/crdt/test_durability_processes.py`` drives its workers);
its log goes to a file under ``tmp_path``. The replicator keeps ``sharding/*`` in each node's
SQLite file: the remembered entity ids of every shard and the coordinator's state. Every test
bounds its time with ``trio.fail_after`` and kills what is still running at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import trio

from crdt import ReplicatorSettings
from p2pshard import NodeConfig
from p2pshard.cli._localcluster import LocalCluster
from p2pshard.sharding._extractor import stable_shard
from p2pshard.testing import free_port_block
from tests._support.sharding_worker import SHARDS
from tests._support.workers import FAST, Worker, all_up, workers

WORKER = [sys.executable, "-m", "tests._support.sharding_worker"]
RECOVERY_LIMIT = 30.0
"""Seconds the restarted cluster may take to restart every remembered entity."""


def prepare(data_dir: Path, nodes: int) -> list[Path]:
    """Certificates and one config per node; ``sharding/*`` durable in ``node-N/ddata.sqlite``."""
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
                durable_keys=("sharding/*",),
                durable_path=path.parent / "ddata.sqlite",
            ),
        )
        path.write_text(config.to_toml())
    return configs


async def id_list(node: Worker, command: str) -> list[str]:
    """The ids of an ``ids ...`` answer, in order."""
    reply = await node.ask(command)
    words = reply.split()
    assert words[:1] == ["ids"], f"{command!r}: {reply!r}\n{node.log.read_text()}"
    return words[1:]


async def until(holds: Callable[[], Awaitable[bool]], limit: float) -> None:
    """Ask the processes until ``holds()`` is true; fail after ``limit`` seconds."""
    with trio.fail_after(limit):
        while not await holds():  # noqa: ASYNC110 - polls other processes
            await trio.sleep(0.1)


async def hosted(nodes: Sequence[Worker]) -> list[str]:
    """Every active entity id over ``nodes``, sorted, one entry per node hosting it."""
    return sorted([e for node in nodes for e in await id_list(node, "hosted")])


async def remembered(nodes: Sequence[Worker], shard_id: str) -> list[str]:
    """The shard's remembered ids in every node's local replica, one entry per replica."""
    return sorted([e for node in nodes for e in await id_list(node, f"remembered {shard_id}")])


def pick_entities(count: int) -> tuple[list[str], str]:
    """``count`` entities on ``count`` different shards, and one more sharing the first's shard.

    The extra one is passivated (forgotten) before the crash. Its shard restarts the remembered
    ids it reads all at once, so once its neighbour is back, it would be back too if the
    passivation had not been remembered.
    """
    chosen: dict[str, str] = {}
    extra = None
    for i in range(10_000):
        entity_id = f"counter-{i}"
        shard = stable_shard(entity_id, SHARDS)
        if shard not in chosen and len(chosen) < count:
            chosen[shard] = entity_id
        elif chosen and extra is None and shard == next(iter(chosen)):
            extra = entity_id
        if len(chosen) == count and extra is not None:
            return list(chosen.values()), extra
    raise AssertionError("no such entities")


async def test_remembered_entities_restart_after_every_node_was_killed(tmp_path: Path) -> None:
    """kill -9 every node, start them all again: each remembered entity restarts by itself.

    Fifteen entities are started by asks from one node; one of them is then passivated, which
    forgets it. After the whole cluster is killed and started again (new incarnations on the same
    ports and SQLite files) no message goes to any entity, yet the coordinator finds the old
    regions gone in its durable state, allocates their shards at once, and each shard restarts
    the ids it remembered: every entity but the passivated one, each once, none by a message.
    """
    configs = prepare(tmp_path, 3)
    kept, forgotten = pick_entities(14)
    touched = [*kept, forgotten]
    buddy = kept[0]  # in forgotten's shard
    shard_of = {e: stable_shard(e, SHARDS) for e in touched}
    with trio.fail_after(60):
        async with workers(WORKER) as running:
            nodes = await running.start(*configs)
            await all_up(nodes)
            for entity_id in touched:
                reply = await nodes[0].ask(f"touch {entity_id}")
                assert reply.startswith("at node-"), reply

            async def all_active() -> bool:
                return await hosted(nodes) == sorted(touched)

            await until(all_active, 10)
            # Asks are answered only once a majority (here: every node) has stored the id.
            for node in nodes:
                for entity_id in touched:
                    ids = await id_list(node, f"remembered {shard_of[entity_id]}")
                    assert entity_id in ids, (node.log, ids)

            assert await nodes[1].ask(f"passivate {forgotten}") == "passivating"

            async def forgotten_everywhere() -> bool:
                return forgotten not in await hosted(nodes) and forgotten not in await remembered(
                    nodes, shard_of[forgotten]
                )

            await until(forgotten_everywhere, 10)
            await trio.sleep(1.0)  # each replica's append of the removal reaches its disk
            for node in nodes:
                assert await id_list(node, f"remembered {shard_of[forgotten]}") == [buddy]

            for node in nodes:
                await node.kill()
            restarted_at = trio.current_time()
            nodes = await running.start(*configs)
            await all_up(nodes)
            up_at = trio.current_time()
            expected = sorted(kept)

            async def recovered() -> bool:
                return set(expected) <= set(await hosted(nodes))

            await until(recovered, RECOVERY_LIMIT)
            recovered_at = trio.current_time()
            print(
                f"after the kill: every node Up in {up_at - restarted_at:.2f} s, every remembered "
                f"entity active in {recovered_at - restarted_at:.2f} s"
            )
            assert await hosted(nodes) == expected, (
                "each remembered entity, once, and not the passivated one"
            )
            started = [e for node in nodes for e in await id_list(node, "started")]
            assert sorted(started) == expected, "each started exactly once, by recovery"
            for node in nodes:
                assert await id_list(node, "received") == [], "no entity got a message"
