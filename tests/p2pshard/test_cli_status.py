"""``p2pshard status``, ``leave``, ``down`` and ``remove-sharding-data`` against real TCP nodes.

The nodes run in the test's own trio run, over TCP with mutual TLS on 127.0.0.1, with
certificates and configuration files from :class:`p2pshard.cli._localcluster.LocalCluster` and
faster membership timers. The command runs in a worker thread (``main`` starts its own trio run), so
the nodes keep answering while it waits.
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
from membership import ClusterSettings, IdentityKind, MemberStatus, PeerIdentity
from membership.transport._certs import create_certificate
from membership.transport._tcp import open_tcp_transport
from p2pshard import (
    EntityContext,
    EntityId,
    HashExtractor,
    Node,
    NodeConfig,
    ShardingSettings,
    message,
)
from p2pshard._config import ClientConfig
from p2pshard._node import open_node
from p2pshard._status import client_identity, open_client
from p2pshard.cli._localcluster import LocalCluster
from p2pshard.cli._main import main
from p2pshard.testing import free_port_block

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
            while {p.address for p in nodes[1].transport_statistics().peers} != members_only:  # noqa: ASYNC110
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


# --- client and admin certificates -----------------------------------------------------------


def client_config(data_dir: Path, kind: IdentityKind, name: str, cluster: str = "local") -> Path:
    """A client's configuration file with a ``kind`` certificate from the cluster's CA."""
    out = data_dir / f"{kind.value}-{name}"
    files = create_certificate(PeerIdentity(kind, name), data_dir / "ca", out, cluster=cluster)
    path = data_dir / f"{kind.value}-{name}.toml"
    path.write_text(
        f'cluster_name = "{cluster}"\n[tls]\nca_file = "{files.ca_file}"\n'
        f'cert_file = "{files.cert_file}"\nkey_file = "{files.key_file}"\n'
    )
    return path


def all_up(nodes: Sequence[Node], count: int) -> bool:
    return all(
        len(node.cluster.members) == count
        and all(m.status is MemberStatus.UP for m in node.cluster.members)
        for node in nodes
    )


async def test_status_with_a_client_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = prepare(tmp_path, 2)
    client = client_config(tmp_path, IdentityKind.CLIENT, "ops")
    with trio.fail_after(LIMIT):
        # The kind and name come from the certificate: nothing in the file can claim more.
        async with open_client(ClientConfig.load(client)) as transport:
            assert transport.identity == PeerIdentity(IdentityKind.CLIENT, "ops")
        async with running(configs) as nodes:
            first = str(nodes[0].address.address)
            code, out, err = await cli(capsys, "status", "--node", first, "--config", str(client))
            assert code == 0, err
            assert "MEMBER" in out
            assert "node-1" in out
            assert "node-2" in out
            code, out, err = await cli(
                capsys, "status", "--node", first, "--config", str(client), "--json"
            )
            assert code == 0, err
            assert {m["name"] for m in json.loads(out)["members"]} == {"node-1", "node-2"}
            assert all_up(nodes, 2)


async def test_status_with_a_certificate_of_another_cluster_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepare(tmp_path, 1)
    stranger = client_config(tmp_path, IdentityKind.CLIENT, "ops", cluster="other")
    stranger.write_text(stranger.read_text().replace('"other"', '"local"', 1))
    code, _, err = await cli(
        capsys, "status", "--node", "127.0.0.1:25520", "--config", str(stranger)
    )
    assert code == 2
    assert "is not usable: it is for p2pshard://other/client/ops, not for cluster 'local'" in err


async def test_leave_and_down_need_an_admin_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = prepare(tmp_path, 2)
    refused = {
        "ops": (client_config(tmp_path, IdentityKind.CLIENT, "ops"), "client"),
        "node-9": (client_config(tmp_path, IdentityKind.NODE, "node-9"), "node"),  # no member
        "node-1": (configs[0], "node"),  # a member's own certificate
    }
    with trio.fail_after(LIMIT):
        async with running(configs) as nodes:
            target = str(nodes[1].address.address)
            for name, (config, kind) in refused.items():
                for action in ("leave", "down"):
                    code, out, err = await cli(capsys, action, target, "--config", str(config))
                    assert code == 1, out
                    assert out == ""
                    assert (
                        f"p2pshard {action}: error: {target} answered: refused: leave/down needs "
                        f"an admin certificate; {name!r} is a {kind}"
                    ) in err
            assert all_up(nodes, 2)  # nothing changed
            assert not any(node.terminated.is_set() for node in nodes)


async def test_an_admin_makes_members_leave_and_go_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = prepare(tmp_path, 3)
    admin = str(client_config(tmp_path, IdentityKind.ADMIN, "alice"))
    with trio.fail_after(LIMIT):
        async with running(configs) as (first, second, third):
            # Leave, asked of the member that leaves.
            code, out, err = await cli(
                capsys, "leave", str(third.address.address), "--config", admin
            )
            assert code == 0, err
            assert out.startswith(f"{third.address} marked LEAVING: it hands its shards")
            await third.terminated.wait()
            assert third.cluster.termination_reason == "removed from the cluster"
            while len(first.cluster.members) != 2:  # noqa: ASYNC110 - polls a view
                await trio.sleep(0.05)
            # Down, asked of another member: the downed one, still running, stops.
            ask_first = ("--node", str(first.address.address), "--config", admin)
            code, out, err = await cli(capsys, "down", str(second.address.address), *ask_first)
            assert code == 0, err
            assert out.startswith(f"{second.address} marked DOWN")
            await second.terminated.wait()
            assert second.cluster.termination_reason == "downed"
            while [m.node for m in first.cluster.members] != [first.address]:  # noqa: ASYNC110
                await trio.sleep(0.05)
            # A member that is not there any more.
            code, out, err = await cli(capsys, "leave", str(third.address.address), *ask_first)
            assert code == 1
            assert (
                f"{first.address.address} answered: no member at {third.address.address} "
                f"(members: node-1 at {first.address.address})"
            ) in err
            # A downed node that still runs answers that it is no member now.
            ask_second = ("--node", str(second.address.address), "--config", admin)
            code, out, err = await cli(capsys, "leave", str(first.address.address), *ask_second)
            assert code == 1
            assert f"{second.address} is not a member of the cluster now; ask a member" in err
            # Asking where no node runs: no answer, and a hint to ask another member.
            gone = f"127.0.0.1:{free_port_block(1)}"
            code, out, err = await cli(capsys, "down", gone, "--config", admin, "--timeout", "1")
            assert code == 1
            assert f"no answer from {gone} within 1 s: cannot link to it" in err
            assert "ask another one with --node HOST:PORT" in err
            assert not first.terminated.is_set()


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["leave", "nonsense"], "ADDRESS 'nonsense' is invalid: expected HOST:PORT"),
        (["down", "127.0.0.1:1", "--node", "x:0"], "--node 'x:0' is invalid"),
        (["leave", "127.0.0.1:1", "--timeout", "0"], "--timeout 0.0 is invalid"),
    ],
)
def test_leave_and_down_with_bad_arguments_exit_2(
    argv: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--config", str(tmp_path / "none.toml")]) == 2
    assert error in capsys.readouterr().err
    assert main(["leave", "127.0.0.1:1", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read configuration file" in capsys.readouterr().err


async def test_remove_sharding_data_checks_with_a_client_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (path,) = prepare(tmp_path, 1, durable=True)
    config = NodeConfig.load(path, environ={})
    DurableStore(config.replicator.durable_path or tmp_path / "none").close()
    client = client_config(tmp_path, IdentityKind.CLIENT, "ops")
    remove = ("remove-sharding-data", "--config", str(path), "--all-types")
    with trio.fail_after(LIMIT):
        async with running([path]) as (node,):
            code, out, err = await cli(
                capsys, *remove, "--probe-timeout", "3", "--client-config", str(client)
            )
            assert code == 2, out + err
            assert f"{node.address} (at {node.address.address}) answered" in err
    stranger = client_config(tmp_path, IdentityKind.CLIENT, "x", cluster="other")
    code, out, err = await cli(capsys, *remove, "--client-config", str(stranger))
    assert code == 2
    assert f"--client-config {stranger} is for cluster 'other', but the node's is 'local'" in err
