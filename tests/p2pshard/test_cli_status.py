"""``p2pshard status`` and ``p2pshard remove-sharding-data`` against real TCP nodes.

The nodes run in the test's own trio run, over TCP with mutual TLS on 127.0.0.1, with
certificates and configuration files from :class:`p2pshard._localcluster.LocalCluster` and faster
membership timers. The command runs in a worker thread (``main`` starts its own trio run), so the
nodes keep answering while it waits.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import pycrdt
import pytest
import trio

from crdt import ReplicatorSettings, WriteLocal
from crdt._store import Append, DurableStore
from membership import ClusterSettings, MemberStatus
from membership._tcp import open_tcp_transport
from p2pshard import (
    EntityContext,
    EntityId,
    HashExtractor,
    Node,
    NodeConfig,
    ShardingSettings,
    message,
)
from p2pshard._cli import main
from p2pshard._localcluster import LocalCluster
from p2pshard._node import open_node
from p2pshard._status import client_identity
from tests.p2pshard.test_cli import free_port_block

FAST = ClusterSettings(
    gossip_interval=0.2,
    leader_actions_interval=0.2,
    seed_node_timeout=1.0,
    seed_node_retry_interval=0.2,
)
LIMIT = 25.0


@message(name="tests.cli_status.Touch")
@attrs.frozen
class Touch:
    pass


class Counter:
    """Counts the touches it gets; an ask answers the count."""

    def __init__(self, ctx: EntityContext) -> None:
        self.count = 0

    async def receive(self, msg: object, ctx: EntityContext) -> object:
        self.count += 1
        return self.count


def prepare(data_dir: Path, nodes: int, *, durable: bool = False) -> list[Path]:
    """Certificates and one config per node; with ``durable``, ``sharding/*`` and ``other/*``
    are durable keys in ``node-N/ddata.sqlite``."""
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
                durable_keys=("sharding/*", "other/*") if durable else (),
                durable_path=path.parent / "ddata.sqlite" if durable else None,
            ),
        )
        path.write_text(config.to_toml())
    return configs


@asynccontextmanager
async def running(configs: Sequence[Path]) -> AsyncIterator[list[Node]]:
    """Start a node per config; yield once every node sees every node Up."""
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(open_node(NodeConfig.load(path, environ={})))
            for path in configs
        ]
        while not all(  # noqa: ASYNC110 - polls several nodes' views
            len(node.cluster.members) == len(nodes)
            and all(m.status is MemberStatus.UP for m in node.cluster.members)
            for node in nodes
        ):
            await trio.sleep(0.05)
        yield nodes


async def start_counters(
    nodes: Sequence[Node], type_name: str, entity_ids: Sequence[str], *, remember: bool = False
) -> None:
    """Start ``type_name`` on every node and touch each entity once (from the first node)."""
    settings = ShardingSettings(remember_entities=remember)
    regions = [
        await node.sharding.start(
            type_name, Counter, extractor=HashExtractor(10), settings=settings
        )
        for node in nodes
    ]
    for entity_id in entity_ids:
        assert await regions[0].entity_ref(entity_id).ask(Touch(), timeout=10) == 1


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the command in a thread; its exit status, stdout and stderr."""
    capsys.readouterr()
    code = await trio.to_thread.run_sync(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_status_shows_members_and_shard_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = prepare(tmp_path, 2)
    ids = [f"c-{i}" for i in range(12)]
    with trio.fail_after(LIMIT):
        async with running(configs) as nodes:
            await start_counters(nodes, "Counter", ids)
            second = str(nodes[1].address.address)
            # node-1's identity asks node-2: any node's config will do.
            code, out, err = await cli(
                capsys, "status", "--node", second, "--config", str(configs[0]), "--json"
            )
            assert code == 0, err
            status = json.loads(out)
            assert status["node"]["name"] == "node-2"
            members = {m["name"]: m for m in status["members"]}
            assert set(members) == {"node-1", "node-2"}
            assert all(m["status"] == "UP" and m["reachable"] for m in members.values())
            assert sorted(m["age"] for m in members.values()) == [1, 2]
            assert status["unreachable"] == []
            oldest = min(members.values(), key=lambda m: m["age"])
            assert status["oldest"]["name"] == oldest["name"]
            assert status["leader"]["name"] in members
            (counter,) = status["entity_types"]
            assert counter["type_name"] == "Counter"
            assert counter["failed"] == []
            assert counter["region"]["proxy"] is False
            assert sorted(r["name"] for r in counter["regions"]) == ["node-1", "node-2"]
            assert sum(r["entity_count"] for r in counter["regions"]) == len(ids)
            assert sum(r["shard_count"] for r in counter["regions"]) == len(
                {HashExtractor(10).shard_id(EntityId(i)) for i in ids}
            )
            for region in counter["regions"]:
                assert region["shard_count"] == len(region["shards"])
                assert region["entity_count"] == sum(region["shards"].values())
            # The same as text: a members table, then a table of regions.
            code, out, err = await cli(
                capsys, "status", "--node", second, "--config", str(configs[1])
            )
            assert code == 0, err
            assert "MEMBER" in out
            assert "REGION" in out
            assert "entity type Counter" in out
            assert f"{len(ids)} entities in 2 regions" in out
            # The asked node forgets the clients once they have their answers: it links only
            # to the other member again, instead of reconnecting to ports that are gone.
            members_only = {nodes[0].address.address}
            while {p.address for p in nodes[1].statistics().peers} != members_only:  # noqa: ASYNC110
                await trio.sleep(0.05)


async def test_status_of_an_address_where_nothing_listens_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (config,) = prepare(tmp_path, 1)
    port = free_port_block(1)
    code, out, err = await cli(
        capsys,
        "status",
        "--node",
        f"127.0.0.1:{port}",
        "--config",
        str(config),
        "--timeout",
        "1",
    )
    assert code == 1
    assert out == ""
    assert f"p2pshard status: error: no answer from 127.0.0.1:{port} within 1 s" in err
    assert "cannot link to it" in err


@pytest.mark.parametrize("node", ["nonsense", "127.0.0.1:0", "127.0.0.1:99999", ":25520"])
def test_status_with_a_bad_node_value_exits_2(
    node: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--node", node, "--config", str(tmp_path / "none.toml")]) == 2
    assert f"p2pshard status: error: --node {node!r} is invalid" in capsys.readouterr().err


def test_remove_sharding_data_needs_types_and_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (config,) = prepare(tmp_path, 1)
    assert main(["remove-sharding-data", "--config", str(config)]) == 2
    assert "--type TYPE (repeatable) or --all-types" in capsys.readouterr().err
    assert main(["remove-sharding-data", "--config", str(config), "--type", "a/b"]) == 2
    assert "--type 'a/b' is invalid" in capsys.readouterr().err
    assert main(["remove-sharding-data", "--config", str(config), "--all-types"]) == 0
    assert "nothing to remove: node-1 has no durable store" in capsys.readouterr().out


def sharding_keys(path: Path) -> dict[str, list[bytes] | None]:
    store = DurableStore(path)
    try:
        return store.load()
    finally:
        store.close()


async def test_remove_sharding_data_refuses_while_a_node_runs_then_removes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (config,) = prepare(tmp_path, 1, durable=True)
    store = config.parent / "ddata.sqlite"
    remove = ("remove-sharding-data", "--config", str(config), "--probe-timeout", "1")
    with trio.fail_after(LIMIT):
        async with running([config]) as (node,):
            await start_counters([node], "Counter", ["a", "b", "c"], remember=True)
            await start_counters([node], "Keeper", ["k"], remember=True)

            def modify(doc: pycrdt.Doc[pycrdt.Map[int]]) -> None:
                doc.get("m", type=pycrdt.Map)["x"] = 1

            await node.replicator.update("other/keep", modify, WriteLocal())
            code, out, err = await cli(capsys, *remove[:-1], "3", "--type", "Counter")
            assert code == 2, out + err
            assert "refusing to remove sharding data" in err
            assert f"{node.address} (at {node.address.address}) answered" in err
    stored = sharding_keys(store)
    counter_keys = sorted(k for k in stored if k.startswith("sharding/Counter/"))
    assert "sharding/Counter/coordinator" in counter_keys
    assert any(k.startswith("sharding/Counter/entities/") for k in counter_keys)
    assert any(k.startswith("sharding/Keeper/") for k in stored)

    code, out, err = await cli(capsys, *remove, "--type", "Counter", "--type", "Nope")
    assert code == 0, err
    for key in counter_keys:
        assert f"  {key}  (" in out
    assert f"{len(counter_keys)} keys removed (Counter: {len(counter_keys)} keys)" in out
    assert "no sharding data found for: Nope" in out
    after = sharding_keys(store)
    assert not any(k.startswith("sharding/Counter/") for k in after)
    assert any(k.startswith("sharding/Keeper/") for k in after)  # another type: untouched
    assert after["other/keep"] == stored["other/keep"]  # another key: untouched

    code, out, err = await cli(capsys, *remove, "--type", "Counter")
    assert code == 0, err
    assert f"nothing to remove: no sharding data of Counter in {store}" in out

    code, out, err = await cli(capsys, *remove, "--all-types")
    assert code == 0, err
    assert "(Keeper: " in out
    assert set(sharding_keys(store)) == {"other/keep"}


async def test_remove_sharding_data_from_a_store_written_directly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tombstones and snapshots go too; a key that only looks alike stays."""
    (config,) = prepare(tmp_path, 1, durable=True)
    path = config.parent / "ddata.sqlite"
    store = DurableStore(path)
    store.write(
        [
            Append("sharding/T/coordinator", b"1"),
            Append("sharding/T/coordinator", b"2"),
            Append("sharding/T/entities/3", None),  # deleted: a tombstone row
            Append("sharding/T/other", b"x"),  # not sharding's
            Append("sharding/TT/coordinator", b"y"),  # another type
        ]
    )
    store.close()
    code, out, err = await cli(
        capsys,
        "remove-sharding-data",
        "--config",
        str(config),
        "--type",
        "T",
        "--probe-timeout",
        "0.5",
    )
    assert code == 0, err
    assert "  sharding/T/coordinator  (2 updates)" in out
    assert "  sharding/T/entities/3  (tombstone)" in out
    assert set(sharding_keys(path)) == {"sharding/T/other", "sharding/TT/coordinator"}


async def test_remove_sharding_data_refuses_when_a_node_links_but_does_not_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A member of the cluster without the status service (an older version, say) still counts."""
    (path,) = prepare(tmp_path, 1, durable=True)
    config = NodeConfig.load(path, environ={})
    DurableStore(config.replicator.durable_path or tmp_path / "none").close()
    with trio.fail_after(LIMIT):
        async with open_tcp_transport(
            client_identity(config), "node-1", config.bind_address
        ) as silent:
            code, out, err = await cli(
                capsys,
                "remove-sharding-data",
                "--config",
                str(path),
                "--all-types",
                "--probe-timeout",
                "1",
            )
            assert silent.statistics().messages_received >= 1  # the request reached it
    assert code == 2, out + err
    assert f"a node at {config.bind_address} (it accepted a link but did not answer)" in err
