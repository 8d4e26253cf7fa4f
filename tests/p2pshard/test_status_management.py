"""``p2pshard status --management``: the same output, read from a node's management endpoint.

Real TCP nodes with mutual TLS on 127.0.0.1 (``test_cli_status``'s set-up), their management
endpoints over HTTPS (``read_access = "client"``) or plain HTTP with the token required for
reading. The command runs in a worker thread, as there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs
import pytest
import trio

from membership import Address, IdentityKind, UniqueAddress
from membership.internal import NOT_UP
from p2pshard import ManagementSettings, NodeConfig
from p2pshard._status import (
    EntityTypeStatus,
    MemberInfo,
    OtherCluster,
    RegionShards,
    StatusReply,
    entity_type_from_json,
    entity_type_json,
    reply_from_json,
    reply_json,
)
from p2pshard.cli._main import EXIT_STDOUT_CLOSED, main
from tests.p2pshard.test_cli_status import (
    LIMIT,
    cli,
    client_config,
    prepare,
    running,
    start_counters,
)

TOKEN = "status-management-token-0123456789"
HTTPS = ManagementSettings(enabled=True, port=0, tls=True, read_access="client")
HTTP_TOKEN = ManagementSettings(enabled=True, port=0, token=TOKEN, read_token_required=True)


def with_management(configs: list[Path], settings: list[ManagementSettings]) -> None:
    for path, management in zip(configs, settings, strict=True):
        config = NodeConfig.load(path, environ={})
        path.write_text(attrs.evolve(config, management=management).to_toml())


def comparable(document: dict[str, object]) -> dict[str, object]:
    """A ``status --json`` document without what moves between two asks (region counters)."""
    types = document["entity_types"]
    assert isinstance(types, list)
    return {
        **document,
        "entity_types": [{**t, "region": sorted(t["region"])} for t in types],
    }


async def test_status_over_the_management_endpoint_prints_what_the_cluster_port_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    configs = prepare(tmp_path, 2)
    with_management(configs, [HTTPS, HTTP_TOKEN])
    ops = client_config(tmp_path, IdentityKind.CLIENT, "ops")
    ids = [f"c-{i}" for i in range(12)]
    monkeypatch.delenv("P2PSHARD_MANAGEMENT__TOKEN", raising=False)
    with trio.fail_after(LIMIT):
        async with running(configs) as nodes:
            await start_counters(nodes, "Counter", ids)
            https = f"https://{nodes[0].management_address}"
            http = f"http://{nodes[1].management_address}"
            first = str(nodes[0].address.address)

            code, out, err = await cli(capsys, "status", "--node", first, "--config", str(ops))
            assert code == 0, err
            over_cluster = out
            code, out, err = await cli(
                capsys, "status", "--management", https, "--config", str(ops)
            )
            assert code == 0, err
            assert out.splitlines()[:8] == over_cluster.splitlines()[:8]  # the members table
            assert "entity type Counter" in out
            assert "total: " in out
            assert "12 entities in 2 regions" in out

            code, out, err = await cli(
                capsys, "status", "--node", first, "--config", str(ops), "--json"
            )
            assert code == 0, err
            expected = comparable(json.loads(out))
            code, out, err = await cli(
                capsys, "status", "--management", https, "--config", str(ops), "--json"
            )
            assert code == 0, err
            assert comparable(json.loads(out)) == expected

            # --type: only that type; a type the node does not run is the node's 404.
            code, out, err = await cli(
                capsys,
                "status",
                *("--management", https, "--config", str(ops), "--type", "Nope"),
            )
            assert code == 1
            assert "answered 404: entity type 'Nope' is not started on this node" in err

            # Plain HTTP with the token required for reading: from the environment or a file.
            code, out, err = await cli(capsys, "status", "--management", http)
            assert code == 1
            assert "answered 401: reading" not in err  # plain HTTP: the token's own message
            assert "answered 401: this route needs the header 'Authorization: Bearer" in err
            monkeypatch.setenv("P2PSHARD_MANAGEMENT__TOKEN", TOKEN)
            code, out, err = await cli(capsys, "status", "--management", http, "--json")
            assert code == 0, err
            assert json.loads(out)["node"]["name"] == "node-2"
            monkeypatch.delenv("P2PSHARD_MANAGEMENT__TOKEN")
            token_file = tmp_path / "token"
            token_file.write_text(TOKEN + "\n")
            code, out, err = await cli(
                capsys, "status", "--management", http, "--token-file", str(token_file)
            )
            assert code == 0, err

            # HTTPS to a plain HTTP endpoint: no TLS handshake, nothing read.
            wrong_scheme = http.replace("http:", "https:")
            code, out, err = await cli(
                capsys, "status", "--management", wrong_scheme, "--config", str(ops)
            )
            assert code == 1
            assert "cannot reach" in err

            # | head: the reader goes away; the command exits quietly.
            read_end, write_end = os.pipe()
            os.close(read_end)
            with os.fdopen(write_end, "w") as closed:
                monkeypatch.setattr(sys, "stdout", closed)
                argv = ["status", "--management", https, "--config", str(ops)]
                code = await trio.to_thread.run_sync(main, argv)
                monkeypatch.undo()
            assert code == EXIT_STDOUT_CLOSED
            assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--management", "ftp://x:1"], "is not an http:// or https:// URL"),
        (["--management", "http://x:port"], "is not a URL"),
        (["--management", "http://x:8558/cluster"], "has a path"),
        (["--management", "https://127.0.0.1:1"], "is HTTPS: give --config"),
        (["--management", "http://127.0.0.1:1", "--bind", "127.0.0.1"], "--bind goes with"),
        (["--node", "127.0.0.1:1", "--type", "Counter"], "--type and --token-file go with"),
        (["--node", "127.0.0.1:1"], "--node needs --config"),
    ],
)
async def test_bad_status_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await cli(capsys, "status", *argv)
    assert code == 2, err
    assert message in err


def test_the_management_json_reads_back_to_the_same_reply() -> None:
    n1 = UniqueAddress(Address("10.0.0.1", 1), "n1", 0xABC)
    n2 = UniqueAddress(Address("[::1]", 2), "n2", 0xDEF)
    counter = EntityTypeStatus(
        type_name="Counter",
        region={"registered": True, "shards": 2, "coordinator": str(n1)},
        regions=(RegionShards(node=n1, shards={"1": 3, "7": 0}),),
        failed=(n2,),
        error="",
    )
    reply = StatusReply(
        request_id=1,
        node=n1,
        members=(
            MemberInfo(node=n1, status="UP", roles=("a",), up_number=1, age=1, app_version="2"),
            MemberInfo(node=n2, status="JOINING", roles=(), up_number=NOT_UP, age=0),
        ),
        unreachable=(n2,),
        leader=n1,
        oldest=None,
        entity_types=(counter,),
        other_clusters=(
            OtherCluster(
                oldest=n2, size=3, vouched=2, addresses=(n2.address,), verdict="ours wins"
            ),
        ),
    )
    document = reply_json(reply)
    members = {k: v for k, v in document.items() if k not in ("node", "entity_types")}
    members["self"] = document["node"]
    assert reply_from_json(members, [counter]) == reply
    assert entity_type_from_json(entity_type_json(counter)) == counter
    assert entity_type_from_json(json.loads(json.dumps(entity_type_json(counter)))) == counter
