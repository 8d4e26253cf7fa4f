"""``benchmarks.chat_load`` on its smallest plan, and the WebSocket client it loads with.

The end-to-end test checks the benchmark's plumbing (real node processes, load processes and the
baseline server, a few seconds of posts), not its figures: every post is delivered to every
member of its room and acknowledged, and the report has the keys a script reads. The client tests
talk to wsproto's server side, in memory.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    Pong,
    Request,
    TextMessage,
)

from benchmarks import chat_load
from benchmarks._report import json_safe
from benchmarks._websocket import BINARY, CLOSE, TEXT, ClientWebSocket, WebSocketProtocolError
from examples.chat.cluster import ChatCluster
from p2pshard import NodeConfig


def accepted_pair() -> tuple[ClientWebSocket, WSConnection]:
    """A client whose opening a wsproto server accepted, and that server."""
    client = ClientWebSocket("127.0.0.1", 8000, "/ws")
    server = WSConnection(ConnectionType.SERVER)
    server.receive_data(client.opening())
    (request,) = server.events()
    assert isinstance(request, Request)
    assert request.target == "/ws"
    assert client.feed(server.send(AcceptConnection())) == []
    assert client.accepted
    return client, server


def test_messages_come_whole_whatever_the_chunks_they_arrive_in() -> None:
    client, server = accepted_pair()
    stream = (
        server.send(Message(data="short"))
        + server.send(Message(data="m" * 300))
        + server.send(Message(data=b"b" * 70_000))
        + server.send(Message(data="frag", message_finished=False))
        + server.send(Message(data="mented"))
    )
    expected = [(TEXT, "short"), (TEXT, "m" * 300), (BINARY, b"b" * 70_000), (TEXT, "fragmented")]
    for size in (1, 3, 125, 4096, len(stream)):
        client, _ = accepted_pair()
        got = []
        for start in range(0, len(stream), size):
            got += client.feed(stream[start : start + size])
        assert got == expected, size


def test_what_the_client_sends_the_server_reads_and_a_ping_is_answered() -> None:
    client, server = accepted_pair()
    server.receive_data(client.text('{"type": "post"}') + client.text("é" * 70_000))
    texts = [e.data for e in server.events() if isinstance(e, TextMessage)]
    assert "".join(texts) == '{"type": "post"}' + "é" * 70_000
    assert client.feed(server.send(Ping(b"p"))) == []
    server.receive_data(client.outgoing())
    assert [e for e in server.events() if isinstance(e, Pong)] == [Pong(b"p")]
    assert client.outgoing() == b""


def test_a_close_or_a_broken_frame_is_reported_as_a_close_and_a_refusal_raises() -> None:
    client, server = accepted_pair()
    assert client.feed(server.send(CloseConnection(code=1001, reason="bye"))) == [
        (CLOSE, "1001 bye")
    ]
    refused = ClientWebSocket("127.0.0.1", 8000, "/ws")
    with pytest.raises(WebSocketProtocolError, match="refused"):
        refused.feed(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
    client, _ = accepted_pair()
    broken = client.feed(bytes((0x81, 0x81)) + b"mask" + b"x")  # a server must not mask
    assert broken == [(CLOSE, "1002 client received unexpected masked frame")]


def test_quantiles_of_a_histogram_of_tenth_milliseconds() -> None:
    histogram = Counter({5: 50, 10: 49, 2000: 1})  # 0.5 ms, 1.0 ms, 200 ms
    assert chat_load.quantile_ms(histogram, 0.5) == pytest.approx(0.55)
    assert chat_load.quantile_ms(histogram, 0.99) == pytest.approx(1.05)
    assert chat_load.quantile_ms(histogram, 1.0) == pytest.approx(200.05)
    assert math.isnan(chat_load.quantile_ms(Counter(), 0.5))


def test_each_room_spans_the_nodes_and_the_load_processes() -> None:
    plan = chat_load.make_plan(quick=True, users=120, rooms=12, nodes=3, clients=4)
    users = chat_load.users_of(plan)
    assert len({u.name for u in users}) == 120
    for room in {u.room for u in users}:
        members = [u for u in users if u.room == room]
        assert len(members) == 10
        assert {u.node for u in members} == {0, 1, 2}
        assert {u.client for u in members} == {0, 1, 2, 3}
    assert sorted(Counter(u.node for u in users).values()) == [40, 40, 40]
    assert sorted(Counter(u.client for u in users).values()) == [30, 30, 30, 30]


def test_a_bad_plan_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="rooms <= users"):
        chat_load.make_plan(quick=True, users=5, rooms=10)
    with pytest.raises(ValueError, match="--factor"):
        chat_load.make_plan(quick=True, factor=1.0)


def test_the_no_group_commit_cluster_writes_one_append_per_transaction(tmp_path: Path) -> None:
    cluster = ChatCluster(1, tmp_path, journal_options=chat_load.NO_GROUP_COMMIT)
    (config,) = cluster.prepare()
    assert NodeConfig.load(config).journal.group_commit_max_events == 1
    (default,) = ChatCluster(1, tmp_path / "default").prepare()
    assert NodeConfig.load(default).journal.group_commit_max_events > 1


def test_the_smallest_plan_delivers_every_post_and_reports_the_keys() -> None:
    plan = chat_load.Plan(
        users=12, rooms=3, nodes=1, clients=2, start_rate=8, factor=2, max_steps=2, refine=0,
        window=0.5, drain=20, settle=20, joins_at_once=4, connect_limit=60,
    )  # fmt: skip
    report = chat_load.run_all(plan, progress=True)
    for key in (
        "posts_per_s_at_p99_100ms",
        "baseline_posts_per_s_at_p99_100ms",
        "no_group_commit_posts_per_s_at_p99_100ms",
        "client_cpu_fraction",
        "persisted_posts_per_s_per_node",
        "persisted_posts_per_s_per_node_no_group_commit",
        "append_mean_ms",
        "append_mean_ms_no_group_commit",
    ):
        assert key in report
    assert set(report["targets"]) == {"cluster", "cluster_no_group_commit", "baseline"}
    for name, target in report["targets"].items():
        assert target["steps"], name
        for step in target["steps"]:
            assert step["posts"] == round(step["rate"] * plan.window), (name, step)
            assert step["deliveries_expected"] == step["posts"] * 4, (name, step)
            assert step["missing_deliveries"] == 0, (name, step)
            assert step["acks"] == step["posts"], (name, step)
            assert step["errors"] == 0, (name, step)
            assert step["closed_connections"] == 0, (name, step)
            assert 0 <= step["client_cpu_fraction"] < 1, (name, step)
        if name != "baseline":  # each post is one append, counted by the node that ran its room
            for step in target["steps"]:
                assert sum(step["journal_appends_by_node"].values()) == step["posts"], step
    json.dumps(json_safe(report), allow_nan=False)  # the --json output
    table = chat_load.format_table(report)
    assert "posts/s at p99<=100ms" in table


def fake_steps(capacity: float, *, unclean_above: float = math.inf) -> list[float]:
    """The rates ``search`` tries against a target that passes up to ``capacity`` posts/s."""
    rates: list[float] = []

    def run(rate: float) -> dict[str, object]:
        rates.append(rate)
        return {"rate": rate, "passed": rate <= capacity, "clean": rate <= unclean_above}

    plan = chat_load.make_plan(quick=True, start_rate=50, factor=2, max_steps=6, refine=2)
    search = chat_load.search(plan)
    rate = next(search)
    while True:
        try:
            rate = search.send(run(rate))
        except StopIteration as done:
            steps, best, saturated = done.value
            break
    assert [s["rate"] for s in steps] == rates
    assert saturated == any(r > capacity for r in rates)
    passing = [r for r in rates if r <= capacity]
    assert (best["rate"] if best else None) == (max(passing) if passing else None)
    return rates


def test_the_search_climbs_then_bisects() -> None:
    assert fake_steps(130) == pytest.approx([50, 100, 200, 141.42, 118.92], abs=0.01)


def test_the_search_comes_down_when_the_first_step_fails() -> None:
    assert fake_steps(20) == pytest.approx([50, 25, 12.5, 17.68, 21.02], abs=0.01)


def test_the_search_stops_at_a_step_that_leaves_deliveries_behind() -> None:
    assert fake_steps(130, unclean_above=150) == [50, 100, 200]  # no bisecting after it


def test_the_search_says_when_no_step_failed() -> None:
    assert fake_steps(10_000) == [50, 100, 200, 400, 800, 1600]


def test_the_searches_are_interleaved_in_turning_order() -> None:
    plan = chat_load.make_plan(quick=True, start_rate=50, factor=2, max_steps=3, refine=0)
    targets = [chat_load.Target(name, [], [], {}) for name in ("a", "b", "c")]
    capacity = {"a": 60, "b": 1000, "c": 15}
    order: list[tuple[str, float]] = []

    def run(target: chat_load.Target, rate: float) -> dict[str, object]:
        order.append((target.name, rate))
        return {"rate": rate, "passed": rate <= capacity[target.name], "clean": True}

    results = chat_load.interleave(targets, plan, run)
    assert order == [
        ("a", 50), ("b", 50), ("c", 50),  # round 1
        ("b", 100), ("c", 25), ("a", 100),  # round 2 starts one further; a is done
        ("c", 12.5), ("b", 200),  # c is done; b has had its three steps
    ]  # fmt: skip
    assert {n: r["posts_per_s_at_p99_100ms"] for n, r in results.items()} == {
        "a": 50,
        "b": 200,
        "c": 12.5,
    }
    assert {n: r["saturated"] for n, r in results.items()} == {"a": True, "b": False, "c": True}
