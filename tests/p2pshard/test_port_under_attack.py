"""A node's port under attack, with real processes: idle connections by the thousand, and a
certificate that is not a member's. The cluster must stay as it is, answer throughout, and give
back the memory the attack took."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import trio

from membership import Address, UniqueAddress
from membership._cluster_messages import Down, GossipEnvelope, Join, Leave
from membership._gossip import Gossip
from membership._heartbeat import Heartbeat
from membership._member import Member, MemberStatus
from membership.transport import _wire
from membership.transport._framing import encode_frame
from membership.transport._memory import TRIM_INTERVAL
from membership.transport._tcp import Hello
from membership.transport._tls import TlsIdentity
from p2pshard.cli._localcluster import LocalCluster
from p2pshard.cli._main import main
from p2pshard.testing import free_port_block
from tests._support.node_processes import node_processes, wait_for_lines

from ..membership.test_tcp_security import tls_client

PYTHON = [sys.executable, "-m", "p2pshard"]
ROUNDS = 3
CONNECTIONS = 3000
HANDSHAKE_TIMEOUT = 1.0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@contextmanager
def cluster(tmp_path: Path, nodes: int = 3) -> Iterator[tuple[list[subprocess.Popen[bytes]], int]]:
    base = free_port_block(nodes)
    configs = LocalCluster(nodes=nodes, data_dir=tmp_path, base_port=base).prepare()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "P2PSHARD_TRANSPORT__HANDSHAKE_TIMEOUT": str(HANDSHAKE_TIMEOUT),
    }
    logs = [tmp_path / f"node-{i}.log" for i in range(1, nodes + 1)]
    with node_processes(configs, logs, env) as children:
        everyone = ", ".join(f"node-{i} UP" for i in range(1, nodes + 1))
        wait_for_lines(logs, f"members: {everyone}", limit=60)
        yield children, base


def status(tmp_path: Path, port: int, client: Path) -> dict[str, object]:
    result = subprocess.run(
        [*PYTHON, "status", "--node", f"127.0.0.1:{port}", "--config", str(client), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    reply: dict[str, object] = json.loads(result.stdout)
    return reply


def client_config(tmp_path: Path) -> Path:
    assert (
        main(
            ["certs", "client", "ops", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path / "ops")]
        )
        == 0
    )
    path = tmp_path / "ops.toml"
    path.write_text(
        'cluster_name = "local"\n[tls]\nca_file = "ops/ca.pem"\n'
        'cert_file = "ops/client.pem"\nkey_file = "ops/client-key.pem"\n'
    )
    return path


def up_members(reply: dict[str, object]) -> list[str]:
    members = reply["members"]
    assert isinstance(members, list)
    return sorted(m["name"] for m in members if m["status"] == "UP")


def test_thousands_of_idle_connections_are_refused_and_their_memory_given_back(
    tmp_path: Path,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, CONNECTIONS + 1024), hard))
    try:
        with cluster(tmp_path) as (children, base):
            client = client_config(tmp_path)
            target = children[0].pid
            for _ in range(3):  # warm up: the first answers allocate for good
                assert up_members(status(tmp_path, base, client)) == ["node-1", "node-2", "node-3"]
            before = rss_kib(target)
            peak = before
            for round_ in range(ROUNDS):
                sockets = []
                for k in range(CONNECTIONS):
                    sock = socket.socket()
                    sock.bind((f"127.0.{1 + k // 200}.{2 + k % 200}", 0))  # many source hosts
                    sock.setblocking(False)
                    with suppress(BlockingIOError):
                        sock.connect(("127.0.0.1", base))
                    sockets.append(sock)
                time.sleep(0.5)
                peak = max(peak, rss_kib(target))
                # Served while the idle connections are still there.
                assert up_members(status(tmp_path, base, client)) == ["node-1", "node-2", "node-3"]
                time.sleep(HANDSHAKE_TIMEOUT + 0.5)
                for sock in sockets:
                    sock.close()
                print(f"round {round_}: rss {rss_kib(target)} KiB (before {before}, peak {peak})")
            time.sleep(HANDSHAKE_TIMEOUT + TRIM_INTERVAL + 1)  # the last burst is trimmed too
            after = rss_kib(target)
            print(f"rss before {before} KiB, peak {peak} KiB, after {after} KiB")
            assert after <= before * 1.10, (before, peak, after)
            assert up_members(status(tmp_path, base, client)) == ["node-1", "node-2", "node-3"]
            assert all(child.poll() is None for child in children)
        log = (tmp_path / "node-1.log").read_text()
        busy = [line for line in log.splitlines() if "wait for their handshake" in line]
        assert 1 <= len(busy) <= 3 * ROUNDS, busy  # once per interval, not once per connection
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- a certificate of the cluster that is not a member's ------------------------------------------


def spawn_workload_nodes(tmp_path: Path, base: int) -> list[subprocess.Popen[bytes]]:
    """Three node processes with the counter workload (asks, recorded in history files)."""
    configs = LocalCluster(nodes=3, data_dir=tmp_path, base_port=base).prepare()
    children = []
    for i, config in enumerate(configs, start=1):
        with (tmp_path / f"node-{i}.log").open("w") as log:
            command = [
                sys.executable,
                "-m",
                "p2pshard.testing._real_node",
                *("--config", str(config), "--history", str(tmp_path / f"node-{i}.jsonl")),
                *("--clients", "2", "--entities", "20", "--shards", "10", "--interval", "0.05"),
                *("--seed", str(i), "--parent", str(os.getpid()), "--no-lease"),
            ]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            children.append(subprocess.Popen(command, stderr=log, stdout=log, env=env))
    return children


def attacker_identities(tmp_path: Path) -> tuple[TlsIdentity, TlsIdentity]:
    """A node certificate for a node that never was a member, and a client certificate."""
    ca = str(tmp_path / "ca")
    for kind, name in (("node", "mallory"), ("client", "ops")):
        assert main(["certs", kind, name, "--ca", ca, "--out", str(tmp_path / name)]) == 0
    mallory, ops = tmp_path / "mallory", tmp_path / "ops"
    return (
        TlsIdentity("local", mallory / "ca.pem", mallory / "node.pem", mallory / "node-key.pem"),
        TlsIdentity("local", ops / "ca.pem", ops / "client.pem", ops / "client-key.pem"),
    )


def acks_between(tmp_path: Path, start: float, end: float) -> tuple[int, int]:
    """Asks sent and answered in [start, end) (CLOCK_MONOTONIC), over every node's history."""
    sent = acked = 0
    for i in (1, 2, 3):
        for line in (tmp_path / f"node-{i}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if start <= event["t"] < end:
                sent += event["e"] == "sent"
                acked += event["e"] == "ack"
    return sent, acked


async def test_a_non_member_certificate_changes_nothing_and_asks_are_answered_throughout(
    tmp_path: Path,
) -> None:
    base = free_port_block(4)
    victim = trio.socket.socket()  # where the intruder says it is: nobody may dial it
    await victim.bind(("127.0.0.1", base + 3))
    victim.listen(16)
    children = spawn_workload_nodes(tmp_path, base)
    try:
        everyone = "members: node-1 UP, node-2 UP, node-3 UP"
        with trio.fail_after(90):
            while not all(  # noqa: ASYNC110 - polls log files written by other processes
                everyone in (tmp_path / f"node-{i}.log").read_text() for i in (1, 2, 3)
            ):
                await trio.sleep(0.2)
        await trio.sleep(3)  # the workload gets going
        mallory, ops = attacker_identities(tmp_path)
        me = UniqueAddress(Address("127.0.0.1", base + 3), "mallory", 666)
        real = [Address("127.0.0.1", base + k) for k in range(3)]
        fakes = [
            UniqueAddress(Address("127.0.0.9", 7000 + k), f"ghost-{k}", 1 + k) for k in range(5)
        ]
        ghosts = [Member(f, MemberStatus.UP) for f in fakes]
        forged_gossip = Gossip([Member(me, MemberStatus.UP), *ghosts])
        attack_start = time.monotonic()
        for target in real[:2]:
            stream = await tls_client(target, mallory)
            await stream.send_all(encode_frame(_wire.encode(Hello(cluster="local", sender=me))))
            frames = []
            for round_ in range(50):
                frames += [_wire.encode(Join(node=f, roles=frozenset())) for f in fakes]
                frames.append(_wire.encode(Join(node=fakes[0], roles=frozenset())))
                frames.append(_wire.encode(Down(node=real[2])))
                frames.append(_wire.encode(Leave(node=real[1])))
                frames.append(_wire.encode(GossipEnvelope(sender=me, to=me, gossip=forged_gossip)))
                frames.append(
                    _wire.encode(Heartbeat(sender=me, sequence_nr=round_ + 1, creation_time=1.0))
                )
            for frame in frames:
                await stream.send_all(encode_frame(frame))
                await trio.sleep(0.005)
            await trio.aclose_forcefully(stream)
            client = await tls_client(target, ops)
            ops_me = UniqueAddress(Address("127.0.0.1", base + 3), "ops", 7)
            await client.send_all(encode_frame(_wire.encode(Hello(cluster="local", sender=ops_me))))
            await client.send_all(encode_frame(_wire.encode(Down(node=real[2]))))
            await trio.sleep(0.5)
            await trio.aclose_forcefully(client)
        attack_end = time.monotonic()
        await trio.sleep(15)  # past stable_after: fake members would have been acted on now
        sent, acked = acks_between(tmp_path, attack_start, attack_end)
        assert sent > 50
        assert acked >= 0.95 * sent, (sent, acked)
        later_sent, later_acked = acks_between(tmp_path, attack_end, time.monotonic())
        assert later_acked >= 0.95 * later_sent, (later_sent, later_acked)
        with trio.move_on_after(0.1):
            await victim.accept()
            raise AssertionError("a node dialled the address a non-member announced")
        assert all(child.poll() is None for child in children)
        for i in (1, 2, 3):
            log = (tmp_path / f"node-{i}.log").read_text()
            assert not [line for line in log.splitlines() if "members:" in line and "ghost" in line]
            assert everyone in log
            refusals = [line for line in log.splitlines() if "refused" in line]
            assert len(refusals) <= 12, refusals  # a few lines per kind, not one per frame
    finally:
        victim.close()
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
