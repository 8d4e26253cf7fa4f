"""The chat example over real processes: 3 nodes with TLS, WebSocket clients, kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from examples.chat.client import ChatClient, ChatError, open_chat_client
from examples.chat.cluster import ChatCluster, _taken, free_base_port
from tests._support.chat import room_home, running_chat
from tests._support.node_processes import read_until, time_wait_port

ROOT = Path(__file__).resolve().parents[2]


MANAGED = frozenset({1, 2})
"""The nodes with a management endpoint: node 3's /cluster page reads the node itself."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatCluster]:
    with running_chat(tmp_path_factory.mktemp("chat"), management_nodes=MANAGED) as chat:
        yield chat


async def test_bad_input_gets_error_frames(cluster: ChatCluster) -> None:
    async with open_chat_client(cluster.ws_url(1)) as c:
        await c.expect(lambda f: f["type"] == "hello")
        cases: list[tuple[Any, str]] = [
            ("{not json", "malformed JSON"),
            ("[1, 2]", "JSON object"),
            ({"type": "post", "text": "hi", "id": "x1"}, "join a room"),
            ({"type": "join", "room": "Bad Room!", "user": "eve"}, "invalid room name"),
            ({"type": "join", "room": "", "user": "eve"}, "invalid room name"),
            ({"type": "join", "room": "ok", "user": ""}, "invalid user name"),
            ({"type": "dance"}, "unknown frame type"),
        ]
        for frame, expected in cases:
            start = len(c.frames)
            await c.send(frame if isinstance(frame, str) else json.dumps(frame))
            got = await c.expect(lambda f: f["type"] == "error", start=start)
            assert expected in got["error"], (frame, got)
        await c.join("errors", "eve")
        with pytest.raises(ChatError, match="message too long"):
            await c.post("x" * 4097, "big-1")
        with pytest.raises(ChatError, match="message too long"):
            await c.post("é" * 2049, "big-2")  # 4098 bytes in UTF-8
        ack = await c.post("y" * 4096, "ok-1")  # exactly 4 KiB is fine
        assert ack["seq"] == 1
        view = await c.history()
        assert [m["id"] for m in view["history"]] == ["ok-1"]  # nothing else got in


async def test_the_cluster_page_names_each_room_on_the_row_of_its_node(
    cluster: ChatCluster,
) -> None:
    rooms = [f"spread-{k}" for k in range(8)]
    async with open_chat_client(cluster.ws_url(3)) as c:
        for room in rooms:  # each room stays active after its member moved on
            await c.join(room, "carol")
    homes = {room: room_home(cluster, room) for room in rooms}
    assert None not in homes.values(), homes
    for i in (1, 2, 3):
        status = await _complete_status(cluster, i)
        assert status["source"] == ("management" if i in MANAGED else "node"), status["source"]
        assert (status["management"] is not None) == (i in MANAGED)
        assert {m["name"] for m in status["members"]} == {cluster.name(j) for j in (1, 2, 3)}
        table = status["types"]["Room"]
        assert set(table["nodes"]) == {cluster.name(j) for j in (1, 2, 3)}, table
        assert table["failed"] == []
        for room, home in homes.items():
            rows = [node for node, names in table["entities"].items() if room in names]
            assert rows == [cluster.name(home or 0)], (i, room, table["entities"])
        for node, names in table["entities"].items():  # as many rooms as the shards count
            assert len(names) == sum(table["nodes"][node].values()), (i, node, table)
    page = await trio.to_thread.run_sync(_get, cluster.url(3) + "cluster")
    assert 'id="types"' in page


async def _complete_status(cluster: ChatCluster, i: int) -> dict[str, Any]:
    """Node ``i``'s /cluster.json once every node's gateway has named its entities in it."""
    everyone = {cluster.name(j) for j in (1, 2, 3)}
    with trio.fail_after(20):
        while True:
            status = await trio.to_thread.run_sync(cluster.status, i)
            if status is not None and set(status["types"]["Room"]["entities"]) == everyone:
                return status
            await trio.sleep(0.3)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return str(answer.read().decode())


async def _retrying(call: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """``call`` again every half second while the room answers "retry" or not at all."""
    with trio.fail_after(60):
        while True:
            try:
                return await call()
            except ChatError as exc:
                if not exc.frame["retry"]:
                    raise
            except trio.TooSlowError:
                pass
            await trio.sleep(0.5)


async def _post_retrying(c: ChatClient, text: str, client_id: str) -> dict[str, Any]:
    return await _retrying(lambda: c.post(text, client_id, wait=8))


async def _join_retrying(c: ChatClient, room: str, user: str) -> dict[str, Any]:
    return await _retrying(lambda: c.join(room, user, wait=8))


async def test_two_users_on_two_nodes_survive_kill_of_the_room_node(cluster: ChatCluster) -> None:
    room = "lobby"
    acked: dict[str, int] = {}
    async with open_chat_client(cluster.ws_url(1)) as alice:
        await alice.join(room, "alice")
        async with open_chat_client(cluster.ws_url(2)) as bob:
            joined = await bob.join(room, "bob")
            assert joined["members"] == ["alice", "bob"]
            for n in range(5):
                for who, client in (("alice", alice), ("bob", bob)):
                    ack = await client.post(f"{who} says {n}", f"{who}-{n}")
                    acked[f"{who}-{n}"] = ack["seq"]
            # each sees the other's messages live, across nodes
            await alice.expect(lambda f: f["type"] == "message" and f["message"]["id"] == "bob-4")
            await bob.expect(lambda f: f["type"] == "message" and f["message"]["id"] == "alice-4")
    home = room_home(cluster, room)
    assert home is not None
    cluster.kill(home)
    survivors = [i for i in (1, 2, 3) if i != home]
    async with (
        open_chat_client(cluster.ws_url(survivors[0])) as alice,
        open_chat_client(cluster.ws_url(survivors[1])) as bob,
    ):
        started = trio.current_time()
        await _join_retrying(alice, room, "alice")
        joined = await _join_retrying(bob, room, "bob")
        recovered = trio.current_time() - started
        # a retried post (same client id) is not stored twice
        again = await _post_retrying(alice, "alice says 4", "alice-4")
        assert again == {**again, "seq": acked["alice-4"], "duplicate": True}
        for n in range(5, 8):
            for who, client in (("alice", alice), ("bob", bob)):
                ack = await _post_retrying(client, f"{who} says {n}", f"{who}-{n}")
                acked[f"{who}-{n}"] = ack["seq"]
        await alice.expect(lambda f: f["type"] == "message" and f["message"]["id"] == "bob-7")
        await bob.expect(lambda f: f["type"] == "message" and f["message"]["id"] == "alice-7")
        view = await alice.history()
        ids = [m["id"] for m in view["history"]]
        seqs = [m["seq"] for m in view["history"]]
        assert seqs == list(range(1, len(seqs) + 1))
        assert sorted(ids) == sorted(acked), "every acknowledged message exactly once"
        assert {m["id"]: m["seq"] for m in view["history"]} == acked
        assert set(joined["members"]) >= {"alice", "bob"}
        print(f"room {room} was on node-{home}; both re-joined {recovered:.1f} s after kill -9")
    assert room_home(cluster, room) in survivors


def test_the_port_check_ignores_connections_in_time_wait() -> None:
    """A chat cluster stopped a moment ago leaves TIME-WAIT connections on its ports."""
    assert _taken(time_wait_port()) is None


def test_run_chat_stops_on_ctrl_c_without_a_traceback_and_starts_again_at_once(
    tmp_path: Path,
) -> None:
    """What ``scripts/run-chat.sh`` runs, stopped with Ctrl-C as a terminal sends it (to the
    whole process group), then started again at once on the same ports."""
    base = free_base_port(1)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "P2PSHARD_CLUSTER__SEED_NODE_TIMEOUT": "0.5",  # one node: no other seed to wait for
    }
    command = [sys.executable, "-m", "examples.chat.cluster", "--nodes", "1"]
    command += ["--base-port", str(base), "--dir", str(tmp_path), "--log-level", "WARNING"]
    for run in (1, 2):
        seen: list[str] = []
        with subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ) as launcher:
            try:
                assert launcher.stdout is not None
                read_until(launcher.stdout, "chat pages", seen)
                os.killpg(launcher.pid, signal.SIGINT)
                seen.append(launcher.stdout.read())
                assert launcher.wait(timeout=60) == 0, f"run {run}:\n" + "".join(seen)
            finally:
                if launcher.poll() is None:
                    os.killpg(launcher.pid, signal.SIGKILL)
                    launcher.wait()
        output = "".join(seen)
        assert "stopping the chat cluster" in output, f"run {run}:\n{output}"
        assert "Traceback" not in output, f"run {run}:\n{output}"


def test_the_chat_data_directory_is_ignored_by_git() -> None:
    """It holds the cluster CA's key: ``git add .`` must not pick it up."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git work tree")
    for path in ("chat-data/ca/ca-key.pem", "chat-data/node-1/node-key.pem", "chat-data/x.log"):
        result = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False
        )
        assert result.returncode == 0, f"{path} is not ignored"
