"""The dashboard at ``GET /`` of the management endpoint: its series, its timeline, its routes.

The sampler and the event log are sans-IO and tested with made-up times and counters; the page,
its files and ``GET /dashboard/state`` over real HTTP on real (simulated-network) nodes, as in
``test_management``. The page in a real browser is ``test_dashboard_browser``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from membership import (
    Address,
    ClusterEvent,
    LeaderChanged,
    Member,
    MemberDowned,
    MemberJoined,
    MemberRemoved,
    MemberStatus,
    MemberUp,
    ReachableMember,
    UniqueAddress,
    UnreachableMember,
)
from p2pshard import EntityId, HashExtractor, ManagementSettings, Node, ShardingSettings
from p2pshard._dashboard import (
    ASK_SECONDS_COUNT,
    ASK_SECONDS_SUM,
    ASKS,
    DELIVERED,
    MESSAGES,
    EventLog,
    RateSampler,
    asset,
    reading,
)
from p2pshard.sharding._services import ShardingEvent
from tests.p2pshard.test_cli_status import Counter, Touch
from tests.p2pshard.test_management import (
    BOUND,
    TOKEN,
    bearer,
    client,
    cluster,
    refused,
    registered,
)

# --- the sampler ----------------------------------------------------------------------------------


def test_the_sampler_gives_rates_per_second_summed_over_types() -> None:
    sampler = RateSampler()
    sampler.add(100.0, {(MESSAGES, "Room"): 10.0, (MESSAGES, "User"): 0.0})
    assert sampler.points() == []  # one reading has no rate yet
    sampler.add(101.0, {(MESSAGES, "Room"): 30.0, (MESSAGES, "User"): 5.0})
    sampler.add(103.0, {(MESSAGES, "Room"): 30.0, (MESSAGES, "User"): 9.0})
    points = sampler.points()
    assert [p.at for p in points] == [101.0, 103.0]
    assert [p.messages_per_second for p in points] == [25.0, 2.0]  # a 2 s gap: per second still
    assert all(p.asks_per_second is None and p.ask_latency is None for p in points)
    series = sampler.series_json()
    assert series["ages"] == [-2.0, 0.0]
    assert series["messages_per_second"] == [25.0, 2.0]
    assert series["messages"] is True
    assert series["asks"] is False  # no ask counters: the page says "no data"
    assert series["latency"] is False


def test_the_sampler_takes_restarted_and_new_counters_as_prometheus_does() -> None:
    sampler = RateSampler()
    sampler.add(0.0, {(MESSAGES, "Room"): 50.0})
    sampler.add(1.0, {(MESSAGES, "Room"): 4.0, (MESSAGES, "User"): 3.0})  # Room restarted
    sampler.add(2.0, {(MESSAGES, "User"): 4.0})  # Room stopped: only what is there counts
    assert [p.messages_per_second for p in sampler.points()] == [7.0, 1.0]
    sampler.add(2.0, {(MESSAGES, "User"): 100.0})  # not after the last: ignored
    sampler.add(1.5, {(MESSAGES, "User"): 100.0})
    assert len(sampler.points()) == 2
    sampler.add(3.0, {})  # the counter is gone (no entity type left): no data
    assert sampler.points()[-1].messages_per_second is None
    assert sampler.series_json()["messages"] is False


def test_the_sampler_gives_the_mean_latency_of_the_asks_answered_in_each_interval() -> None:
    sampler = RateSampler()

    def asks(n: float, seconds: float, answered: float) -> dict[tuple[str, str], float]:
        return {
            (ASKS, "Room"): n,
            (ASK_SECONDS_SUM, "Room"): seconds,
            (ASK_SECONDS_COUNT, "Room"): answered,
        }

    sampler.add(0.0, asks(0, 0.0, 0))
    sampler.add(1.0, asks(4, 0.010, 4))  # four asks, 2.5 ms each on average
    sampler.add(2.0, asks(4, 0.010, 4))  # none: no latency, not zero latency
    sampler.add(4.0, asks(10, 0.070, 10))  # six more, 10 ms each
    points = sampler.points()
    assert [p.asks_per_second for p in points] == [4.0, 0.0, 3.0]
    latencies = [p.ask_latency for p in points]
    assert latencies[1] is None
    assert math.isclose(latencies[0] or 0, 0.0025)
    assert math.isclose(latencies[2] or 0, 0.010)
    series = sampler.series_json()
    assert series["ask_latency_ms"] == [2.5, None, 10.0]
    assert series["asks"] is True
    assert series["latency"] is True
    assert series["messages"] is False


def test_the_sampler_keeps_the_last_points_only() -> None:
    sampler = RateSampler(keep=3)
    for second in range(10):
        sampler.add(float(second), {(MESSAGES, ""): float(second * second)})
    assert [p.at for p in sampler.points()] == [7.0, 8.0, 9.0]
    assert [p.messages_per_second for p in sampler.points()] == [13.0, 15.0, 17.0]
    with pytest.raises(ValueError, match="at least 1"):
        RateSampler(keep=0)


def test_reading_takes_the_sampled_names_by_entity_type_and_nothing_else() -> None:
    local, remote = (
        CounterMetricFamily(name.removesuffix("_total"), "d", labels=["entity_type"])
        for name in DELIVERED
    )
    local.add_metric(["Room"], 7)
    local.add_metric(["User"], 2)
    remote.add_metric(["Room"], 5)
    other = CounterMetricFamily("p2pshard_sharding_messages_sent_remote", "o", labels=["t"])
    other.add_metric(["Room"], 99)
    latency = HistogramMetricFamily(
        "p2pshard_sharding_ask_duration_seconds", "l", labels=["entity_type"]
    )
    latency.add_metric(["Room"], [("0.01", 3), ("+Inf", 4)], sum_value=0.5)
    assert reading([local, remote, other, latency]) == {
        (MESSAGES, "Room"): 12.0,
        (MESSAGES, "User"): 2.0,
        (ASK_SECONDS_SUM, "Room"): 0.5,
        (ASK_SECONDS_COUNT, "Room"): 4.0,
    }


# --- the event log --------------------------------------------------------------------------------


def member(port: int, status: MemberStatus) -> Member:
    return Member(UniqueAddress(Address("10.0.0.1", port), f"n{port}", port), status)


def test_the_event_log_notes_changes_only_so_a_replay_adds_nothing() -> None:
    log = EventLog()
    joined, up = member(2, MemberStatus.JOINING), member(2, MemberStatus.UP)
    replay: list[ClusterEvent] = [
        MemberUp(member(1, MemberStatus.UP)),
        LeaderChanged(member(1, MemberStatus.UP).node),
    ]
    first: list[ClusterEvent] = [MemberJoined(joined), MemberUp(up), UnreachableMember(up)]
    for event in [*replay, *first]:
        log.cluster_event(10.0, event)
    for event in [*replay, *first[1:]]:  # subscribed again: the state replayed
        log.cluster_event(11.0, event)
    log.cluster_event(12.0, ReachableMember(up))
    log.cluster_event(12.5, ReachableMember(up))
    downed = member(2, MemberStatus.DOWN)
    log.cluster_event(13.0, MemberDowned(downed))
    log.cluster_event(14.0, MemberRemoved(member(2, MemberStatus.REMOVED), MemberStatus.DOWN))
    log.cluster_event(14.0, MemberRemoved(member(2, MemberStatus.REMOVED), MemberStatus.DOWN))
    log.cluster_event(15.0, LeaderChanged(None))
    log.sharding_event(16.0, ShardingEvent("rebalance", "Room", "rebalance: moving shard 3"))
    seen = [(e.time, e.kind, e.subject) for e in log.events()]
    assert seen == [
        (10.0, "up", "n1"),
        (10.0, "leader", "n1"),
        (10.0, "joined", "n2"),
        (10.0, "up", "n2"),
        (10.0, "unreachable", "n2"),
        (12.0, "reachable", "n2"),
        (13.0, "downed", "n2"),
        (14.0, "removed", "n2"),
        (15.0, "leader", ""),
        (16.0, "rebalance", "Room"),
    ]
    texts = [e.text for e in log.events()]
    assert texts[2] == "n2 (10.0.0.1:2) is joining"
    assert texts[5] == "n2 (10.0.0.1:2) is reachable again"
    assert texts[7] == "n2 (10.0.0.1:2) was removed (it was DOWN)"
    assert texts[9] == "Room: rebalance: moving shard 3"
    assert log.events_json()[0] == {
        "time": 10.0,
        "kind": "up",
        "subject": "n1",
        "text": "n1 (10.0.0.1:1) is Up",
    }


def test_the_event_log_settles_what_a_lost_stretch_of_events_changed() -> None:
    log = EventLog()
    n1, n2, n3 = (member(i, MemberStatus.UP) for i in (1, 2, 3))
    for event in (MemberUp(n1), MemberUp(n2), MemberUp(n3), UnreachableMember(n2)):
        log.cluster_event(1.0, event)
    log.cluster_event(2.0, UnreachableMember(n3))
    # fell behind: n2 went away, n3 is reachable again; the replay says only who is there
    log.settle(5.0, [n1, n3], [])
    assert [(e.kind, e.subject, e.text) for e in log.events()][-2:] == [
        ("removed", "n2", "n2 (10.0.0.1:2) was removed (it was UP)"),
        ("reachable", "n3", "n3 (10.0.0.1:3) is reachable again"),
    ]
    log.settle(6.0, [n1, n3], [])  # nothing more changed
    log.cluster_event(6.0, MemberUp(n3))
    assert len(log.events()) == 7


def test_the_event_log_is_bounded() -> None:
    log = EventLog(keep=5)
    for i in range(12):
        log.record(float(i), "hand-off", "Room", f"shard {i}")
    assert [e.text for e in log.events()] == [f"shard {i}" for i in range(7, 12)]
    with pytest.raises(ValueError, match="at least 1"):
        EventLog(keep=0)


def test_the_page_files_are_in_the_package() -> None:
    for name, kind in (
        ("index.html", "text/html"),
        ("dashboard.js", "text/javascript"),
        ("dashboard.css", "text/css"),
    ):
        found = asset(name)
        assert found is not None, name
        assert found[1].startswith(kind)
        assert found[0]
    assert asset("../_management.py") is None
    assert asset("__init__.py") is None


# --- over HTTP, on real nodes ---------------------------------------------------------------------


def subjects(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["kind"], e["subject"]) for e in events]


async def state_until(
    http: httpx.AsyncClient, done: Callable[[dict[str, Any]], bool], headers: Any = None
) -> dict[str, Any]:
    """``GET /dashboard/state`` until ``done`` says yes; that state."""
    with trio.fail_after(BOUND):
        while True:
            answer = await http.get("/dashboard/state", headers=headers)
            assert answer.status_code == 200, answer.text
            state: dict[str, Any] = answer.json()
            if done(state):
                return state
            await trio.sleep(0.1)


async def test_the_page_and_its_files_are_served_without_a_token() -> None:
    protected = ManagementSettings(enabled=True, port=0, token=TOKEN, read_token_required=True)
    async with cluster(seed=11, settings={1: protected}) as sim:
        await sim.start_up([1], bound=BOUND)
        async with client(sim.nodes[1]) as http:
            page = await http.get("/")
            assert page.status_code == 200, page.text
            assert page.headers["content-type"] == "text/html; charset=utf-8"
            assert "default-src 'none'" in page.headers["content-security-policy"]
            assert page.headers["x-content-type-options"] == "nosniff"
            assert '<script src="/dashboard/dashboard.js"' in page.text
            assert 'href="/dashboard/dashboard.css"' in page.text
            script = await http.get("/dashboard/dashboard.js")
            assert script.status_code == 200
            assert script.headers["content-type"] == "text/javascript; charset=utf-8"
            assert "/dashboard/state" in script.text
            style = await http.get("/dashboard/dashboard.css")
            assert (style.status_code, style.headers["content-type"]) == (
                200,
                "text/css; charset=utf-8",
            )
            refused(await http.get("/dashboard/nope.js"), 404, "'nope.js'", "open /")
            refused(await http.get("/dashboard/"), 404)
            refused(await http.post("/"), 405, "POST")
            # the state is a read route: the token is asked for, as on /cluster/members
            refused(await http.get("/dashboard/state"), 401, "Authorization: Bearer")
            refused(await http.get("/dashboard/state", headers=bearer("x" * 20)), 401, "wrong")
            state = await http.get("/dashboard/state", headers=bearer())
            assert state.status_code == 200, state.text
            assert [m["name"] for m in state.json()["members"]] == ["n1"]


async def start_counter_rebalancing_once(i: int, node: Node, sim: Any) -> None:
    """Counter, with no rebalance round but the one a new region brings (in a second)."""
    sim.regions[i] = await node.sharding.start(
        "Counter",
        Counter,
        extractor=HashExtractor(10),
        settings=ShardingSettings(rebalance_interval=600.0),
    )


async def test_the_state_shows_members_shards_rates_and_events_of_a_real_cluster() -> None:
    async with cluster(seed=12, setup=start_counter_rebalancing_once) as sim:
        await sim.start_up([1], bound=BOUND)
        await registered(sim, [1])
        extractor = HashExtractor(10)
        entities: dict[str, str] = {}  # one entity in each of the ten shards
        n = 0
        while len(entities) < 10:
            entities.setdefault(extractor.shard_id(EntityId(f"e{n}")), f"e{n}")
            n += 1
        for entity in entities.values():  # every shard allocated, all on node 1
            assert await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10) == 1
        async with client(sim.nodes[1]) as http:
            await sim.start(2)
            await sim.all_up([1, 2], bound=BOUND)
            await registered(sim, [1, 2])
            # Node 2's region registered: a rebalance round soon moves shards off node 1 (their
            # next message allocates them again, to node 2).
            first = await state_until(
                http, lambda state: any("moved off n1" in e["text"] for e in state["events"])
            )
            asked = 0
            with trio.fail_after(BOUND):  # asks from node 1 over two more samples at least
                while True:
                    state = (await http.get("/dashboard/state")).json()
                    if len(state["series"]["ages"]) >= len(first["series"]["ages"]) + 2:
                        break
                    for entity in entities.values():
                        await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10)
                        asked += 1
                    await trio.sleep(0.05)
            scrape = (await http.get("/metrics")).text

    assert state["self"]["name"] == "n1"
    assert state["leader"]["name"] == "n1"
    assert state["oldest"]["name"] == "n1"
    assert sorted((m["name"], m["status"], m["reachable"]) for m in state["members"]) == [
        ("n1", "UP", True),
        ("n2", "UP", True),
    ]
    [counter] = state["entity_types"]
    assert counter["type_name"] == "Counter"
    assert counter["shards"] == 10
    assert counter["entities"] == 10
    assert counter["failed"] == []
    regions = {r["name"]: r for r in counter["regions"]}
    assert set(regions) == {"n1", "n2"}
    assert regions["n2"]["shard_count"] > 0  # the shards moved, allocated again
    assert sum(r["shard_count"] for r in regions.values()) == 10

    series = state["series"]
    assert series["messages"] is True
    # Each interval's rate times its length is what reached node 1's own shards then (only node 1
    # asks): together no more than it was asked, and some of it (it kept shards) in the new points.
    ages = series["ages"]
    rates = series["messages_per_second"]
    new = len(ages) - len(first["series"]["ages"])
    delivered = [
        rate * (ages[i] - ages[i - 1]) for i, rate in enumerate(rates) if i >= len(ages) - new
    ]
    assert 0 < sum(delivered) <= asked + 0.05 * len(delivered), (delivered, asked)
    assert max(rates[-new:]) > 0
    assert series["asks"] is ("p2pshard_sharding_asks_total" in scrape)

    events = [(e["kind"], e["subject"]) for e in state["events"]]
    assert ("up", "n1") in events
    assert ("leader", "n1") in events
    assert events.index(("joined", "n2")) < events.index(("up", "n2"))
    kinds = {kind for kind, _ in events}
    assert {"rebalance", "hand-off"} <= kinds, events
    texts = [e["text"] for e in state["events"] if e["subject"] == "Counter"]
    assert any(t.startswith("Counter: rebalance: moving") and "off n1" in t for t in texts), texts
    assert any("handed off from this node" in t for t in texts), texts  # the region's side
    assert any("moved off n1" in t for t in texts), texts  # the coordinator saw it end
    assert all(e["time"] <= state["time"] for e in state["events"])


async def test_the_timeline_shows_a_member_leaving_and_its_shards_handed_off() -> None:
    async with cluster(seed=13) as sim:
        await sim.start_up([1, 2], bound=BOUND)
        await registered(sim, [1, 2])
        for entity in ("a", "b", "c", "d", "e", "f", "g", "h"):
            await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10)
        on_2 = sim.regions[2].statistics().shards
        await sim.graceful_leave(2)
        async with client(sim.nodes[1]) as http:
            state = await state_until(
                http, lambda state: ("removed", "n2") in subjects(state["events"])
            )
    kinds = [e["kind"] for e in state["events"] if e["subject"] == "n2"]
    assert kinds[-3:] == ["leaving", "exiting", "removed"], kinds
    assert [m["name"] for m in state["members"]] == ["n1"]
    if on_2:
        texts = [e["text"] for e in state["events"] if e["subject"] == "Counter"]
        assert any("of n2: its region is shutting down" in t for t in texts), texts
