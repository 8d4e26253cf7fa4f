"""The HTTP management endpoint: every route and every refusal, on real nodes over real HTTP.

The nodes run on the simulated network (no TLS to set up) under trio's real clock, with fast
membership timers; each serves its management endpoint with hypercorn on a free port of
127.0.0.1, and the tests speak to it with httpx. The routing, token, body and readiness
decisions are also tested as the plain functions they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from membership import Address, ClusterSettings, ConfigurationError, MemberStatus, SimNetwork
from p2pshard import (
    EntityId,
    HashExtractor,
    ManagementSettings,
    Node,
    NodeConfig,
    TlsFiles,
    open_node,
)
from p2pshard._management import (
    RegionReadiness,
    Route,
    check_token,
    parse_operation,
    readiness,
    route,
)
from p2pshard.testing import SimCluster, node_address, simulated_cluster_of
from tests.p2pshard.test_cli_status import Counter, Touch

TOKEN = "management-test-token-0123456789"
FAST = ClusterSettings(
    gossip_interval=0.2,
    leader_actions_interval=0.2,
    seed_node_timeout=1.0,
    seed_node_retry_interval=0.2,
)
ENTITIES = ("a", "b", "c", "d")
BOUND = 20.0
"""Seconds (real) any one wait for the cluster may take before the test fails."""


async def start_counter(i: int, node: Node, sim: Any) -> None:
    sim.regions[i] = await node.sharding.start("Counter", Counter, extractor=HashExtractor(10))


def managed(
    settings: dict[int, ManagementSettings],
) -> Callable[[int, NodeConfig], NodeConfig]:
    def configure(i: int, config: NodeConfig) -> NodeConfig:
        default = ManagementSettings(enabled=True, port=0, token=TOKEN)
        return attrs.evolve(
            config,
            cluster=FAST,
            shutdown_timeout=5.0,
            management=settings.get(i, default),
            # Node 1 forms the cluster at once; the others join through it.
            self_join=i == 1,
            seed_nodes=() if i == 1 else (node_address(1),),
        )

    return configure


@asynccontextmanager
async def cluster(
    seed: int,
    settings: dict[int, ManagementSettings] | None = None,
    setup: Any = start_counter,
) -> AsyncIterator[SimCluster]:
    async with simulated_cluster_of(
        SimCluster, seed, setup, configure=managed(settings or {})
    ) as sim:
        yield sim


@asynccontextmanager
async def client(node: Node) -> AsyncIterator[httpx.AsyncClient]:
    assert node.management_address is not None
    base = f"http://{node.management_address}"
    async with httpx.AsyncClient(base_url=base, timeout=10.0) as http:
        yield http


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def statuses(sim: SimCluster, nodes: Iterable[int]) -> dict[int, dict[str, str]]:
    """Each node's view: every member's name, incarnation and status."""
    return {
        i: {f"{m.node.name}#{m.node.uid:x}": m.status.name for m in sim.nodes[i].cluster.members}
        for i in nodes
    }


async def registered(sim: SimCluster, nodes: Iterable[int]) -> None:
    with trio.fail_after(BOUND):
        while not all(sim.regions[i].statistics().registered for i in nodes):  # noqa: ASYNC110
            await trio.sleep(0.05)


async def answer_until(
    http: httpx.AsyncClient, path: str, done: Callable[[httpx.Response], bool]
) -> list[httpx.Response]:
    """Ask ``path`` until ``done``; every answer, the last one ``done``."""
    seen: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        while True:
            response = await http.get(path)
            seen.append(response)
            if done(response):
                return seen
            await trio.sleep(0.05)


def refused(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    text = response.json()["error"]
    assert isinstance(text, str)
    for word in words:
        assert word in text, text
    return text


# --- the routes on a running cluster ------------------------------------------------------------


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus scrape as {(sample name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_are_served_in_the_prometheus_format_and_move_with_the_work() -> None:
    async with cluster(seed=4) as sim:
        await sim.start_up([1, 2], bound=BOUND)
        await registered(sim, [1, 2])
        for entity in ENTITIES:  # the shards' homes known: each message counts where it goes
            assert await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10) == 1
        async with client(sim.nodes[1]) as http:
            first = await http.get("/metrics")
            assert first.status_code == 200, first.text
            assert first.headers["content-type"].startswith("text/plain")
            before = scraped(first.text)
            assert before[("p2pshard_cluster_members", (("status", "up"),))] == 2
            for entity in ENTITIES:
                assert await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10) == 2
            after = scraped((await http.get("/metrics")).text)
            counter = (("entity_type", "Counter"),)
            moved = sum(
                after[(name, counter)] - before.get((name, counter), 0.0)
                for name in (
                    "p2pshard_sharding_messages_delivered_locally_total",
                    "p2pshard_sharding_messages_sent_remote_total",
                )
            )
            assert moved == len(ENTITIES)  # each ask went to its entity once, here or away
            hosted_here = sim.regions[1].statistics().entities
            assert after[("p2pshard_sharding_entities", counter)] == hosted_here
            refused(await http.post("/metrics"), 405, "POST", "GET")


async def test_alive_members_and_shards_of_a_running_cluster() -> None:
    async with cluster(seed=1) as sim:
        await sim.start_up([1, 2], bound=BOUND)
        await registered(sim, [1, 2])
        for entity in ENTITIES:
            assert await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10) == 1
        n1, n2 = sim.nodes[1], sim.nodes[2]
        assert n1.management_address is not None
        assert n1.management_address.host == "127.0.0.1"
        assert n1.management_address.port != 0
        assert n1.management_address != n2.management_address
        async with client(n1) as http:
            alive = await http.get("/alive")
            assert (alive.status_code, alive.json()) == (200, {"alive": True})
            assert alive.headers["content-type"] == "application/json"

            ready = await http.get("/ready")
            assert ready.status_code == 200, ready.text
            assert ready.json() == {"ready": True, "status": "UP", "registered": ["Counter"]}

            view = (await http.get("/cluster/members")).json()
            assert view["self"] == {
                "name": "n1",
                "address": "10.0.0.1:1",
                "uid": f"{n1.address.uid:x}",
            }
            assert view["leader"]["name"] == "n1"  # the lowest address
            assert view["oldest"]["name"] == "n1"
            assert view["unreachable"] == []
            members = {m["name"]: m for m in view["members"]}
            assert set(members) == {"n1", "n2"}
            assert members["n2"] == {
                "name": "n2",
                "address": "10.0.0.1:2",
                "uid": f"{n2.address.uid:x}",
                "status": "UP",
                "roles": [],
                "up_number": members["n2"]["up_number"],
                "age": 2,
                "reachable": True,
                "app_version": None,
            }
            assert members["n1"]["up_number"] < members["n2"]["up_number"]

            one = await http.get("/cluster/members/10.0.0.1:2")
            assert one.status_code == 200
            assert one.json() == members["n2"]

            listed = await http.get("/cluster/shards")
            assert listed.status_code == 200, listed.text
            assert listed.json() == {"entity_types": ["Counter"]}
            shards = await http.get("/cluster/shards/Counter")
            assert shards.status_code == 200, shards.text
            stats = shards.json()
            assert stats["type_name"] == "Counter"
            assert stats["region"]["registered"] is True
            assert stats["region"]["proxy"] is False
            assert stats["failed"] == []
            assert {r["name"] for r in stats["regions"]} == {"n1", "n2"}
            assert sum(r["entity_count"] for r in stats["regions"]) == 4
            shards_used = {HashExtractor(10).shard_id(EntityId(e)) for e in ENTITIES}
            assert sum(r["shard_count"] for r in stats["regions"]) == len(shards_used)

            refused(await http.get("/cluster/shards/Nope"), 404, "'Nope'", "Counter")
            refused(await http.get("/cluster/members/10.0.0.1:9"), 404, "n1 at 10.0.0.1:1")
            refused(await http.get("/cluster/members/nonsense"), 400, "host:port")
            for path in (
                "/alive/",
                "/cluster",
                "/cluster/members/",
                "/cluster/shards/",
                "/metrics/",
            ):
                refused(await http.get(path), 404, "GET /alive", "PUT /cluster/members")
            wrong = await http.post("/alive")
            refused(wrong, 405, "POST", "GET")
            assert wrong.headers["allow"] == "GET"
            wrong = await http.delete("/cluster/members/10.0.0.1:2")
            refused(wrong, 405, "DELETE")
            assert wrong.headers["allow"] == "GET, PUT"
            refused(await http.put("/cluster/shards/Counter", json={}), 405)


async def test_every_bad_put_is_refused_and_leaves_the_cluster_as_it_was() -> None:
    read_protected = ManagementSettings(enabled=True, port=0, token=TOKEN, read_token_required=True)
    settings = {2: ManagementSettings(enabled=True, port=0), 3: read_protected}
    async with cluster(seed=2, settings=settings) as sim:
        await sim.start_up([1, 2, 3], bound=BOUND)
        before = statuses(sim, [1, 2, 3])
        path = "/cluster/members/10.0.0.1:2"
        async with client(sim.nodes[1]) as http:
            no_header = await http.put(path, json={"operation": "leave"})
            refused(no_header, 401, "Authorization: Bearer")
            assert no_header.headers["www-authenticate"].startswith("Bearer")
            basic = {"Authorization": "Basic dXNlcjpwYXNz"}
            refused(await http.put(path, json={"operation": "leave"}, headers=basic), 401)
            wrong = await http.put(
                path, json={"operation": "leave"}, headers=bearer("x" * len(TOKEN))
            )
            refused(wrong, 401, "wrong")
            assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
            for body in (b"{leave", b'{"operation": "leave"', b"\xff\xfe", b""):
                refused(await http.put(path, content=body, headers=bearer()), 400, "not JSON")
            documents: list[object] = [[], "leave", {"op": "leave"}, {"operation": "leave", "x": 1}]
            for document in documents:
                answer = await http.put(path, json=document, headers=bearer())
                refused(answer, 400, "one key, operation")
            for operation in ("explode", "Leave", 1, None):
                answer = await http.put(path, json={"operation": operation}, headers=bearer())
                refused(answer, 400, "unknown operation", '{"operation": "leave"}')
            unknown = await http.put(
                "/cluster/members/10.0.0.1:99", json={"operation": "down"}, headers=bearer()
            )
            refused(unknown, 404, "no member at 10.0.0.1:99", "n2 at 10.0.0.1:2")
            not_an_address = await http.put(
                "/cluster/members/n2", json={"operation": "down"}, headers=bearer()
            )
            refused(not_an_address, 400, "host:port")
            itself = await http.put(
                "/cluster/members/10.0.0.1:1", json={"operation": "down"}, headers=bearer()
            )
            refused(itself, 400, "cannot down itself", "Ask another node")
            huge = await http.put(path, content=b" " * (65 * 1024), headers=bearer())
            refused(huge, 413)

        async with client(sim.nodes[2]) as http:  # no token configured: mutations are off
            off = await http.put(path, json={"operation": "leave"}, headers=bearer())
            refused(off, 403, "P2PSHARD_MANAGEMENT__TOKEN")
            assert (await http.get("/cluster/members")).status_code == 200

        async with client(sim.nodes[3]) as http:  # read routes need the token here
            refused(await http.get("/cluster/members"), 401, "Authorization: Bearer")
            refused(await http.get("/cluster/shards/Counter", headers=bearer("no" * 10)), 401)
            assert (await http.get("/cluster/members", headers=bearer())).status_code == 200
            assert (await http.get("/alive")).status_code == 200  # probes need no token
            assert (await http.get("/ready")).status_code in (200, 503)

        await trio.sleep(1.0)  # a few gossip rounds: a change would have spread by now
        assert statuses(sim, [1, 2, 3]) == before
        assert all(status == "UP" for view in before.values() for status in view.values()), before


async def test_leave_and_down_over_http() -> None:
    async with cluster(seed=3) as sim:
        await sim.start_up([1, 2, 3], bound=BOUND)
        n2, n3 = sim.nodes[2], sim.nodes[3]
        async with client(sim.nodes[1]) as http:
            left = await http.put(
                "/cluster/members/10.0.0.1:2", json={"operation": "leave"}, headers=bearer()
            )
            assert left.status_code == 200, left.text
            assert left.json()["operation"] == "leave"
            assert left.json()["member"]["name"] == "n2"
            assert "LEAVING" in left.json()["message"]
            again = await http.put(
                "/cluster/members/10.0.0.1:2", json={"operation": "leave"}, headers=bearer()
            )
            assert again.status_code in (200, 404), again.text  # leaving already, or gone
            downed = await http.put(
                "/cluster/members/10.0.0.1:3", json={"operation": "down"}, headers=bearer()
            )
            assert downed.status_code == 200, downed.text
            assert "DOWN" in downed.json()["message"]
            members = (await http.get("/cluster/members")).json()["members"]
            seen = {m["name"]: m["status"] for m in members}
            assert seen.get("n2", "REMOVED") in ("LEAVING", "EXITING", "REMOVED"), seen
            assert seen.get("n3", "REMOVED") in ("DOWN", "REMOVED"), seen
        with trio.fail_after(BOUND):
            await n3.terminated.wait()  # it learnt it is Down, and stopped
            await n2.terminated.wait()  # it left: Leaving, Exiting, Removed


# --- readiness ------------------------------------------------------------------------------------


async def test_ready_goes_503_then_200_as_a_node_joins_and_503_when_it_leaves() -> None:
    async with cluster(seed=4) as sim:
        await sim.start_up([1], bound=BOUND)
        sim.partition(2, 1)  # node 2 cannot join until the partition heals
        await sim.start(2)
        address = sim.nodes[2].management_address
        async with client(sim.nodes[2]) as http:
            joining = await http.get("/ready")
            assert joining.status_code == 503, joining.text
            assert joining.json()["ready"] is False
            assert joining.json()["status"] == "JOINING"
            assert "not Up yet" in joining.json()["reason"]
            assert (await http.get("/alive")).status_code == 200

            sim.heal()
            seen = await answer_until(http, "/ready", lambda r: r.status_code == 200)
            assert seen[-1].json() == {"ready": True, "status": "UP", "registered": ["Counter"]}
            for early in seen[:-1]:  # Joining, or Up with the region not registered yet
                assert early.status_code == 503
                body = early.json()
                assert body["status"] == "JOINING" or body["waiting_for"] == ["Counter"], body
            assert sim.regions[2].statistics().registered

            sim.nodes[2].cluster.leave()
            seen = await answer_until(http, "/ready", lambda r: r.status_code == 503)
            body = seen[-1].json()
            assert body["ready"] is False
            assert body["status"] in ("LEAVING", "EXITING", "REMOVED"), body
            assert "not Up" in body["reason"]
        await sim.graceful_leave(2)
        async with httpx.AsyncClient(timeout=5.0) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"http://{address}/alive")


async def start_ghost_proxy(i: int, node: Node, sim: Any) -> None:
    """A proxy for a role no member has: it finds no coordinator and never registers."""
    sim.regions[i] = await node.sharding.start(
        "Ghost", Counter, extractor=HashExtractor(10), role="nobody"
    )


async def test_ready_gives_up_on_a_region_that_cannot_register() -> None:
    give_up = ManagementSettings(enabled=True, port=0, ready_give_up_after=4.0)
    async with cluster(seed=5, settings={1: give_up}, setup=start_ghost_proxy) as sim:
        await sim.start(1)
        async with client(sim.nodes[1]) as http:
            seen = await answer_until(http, "/ready", lambda r: r.status_code == 200)
        assert not sim.regions[1].statistics().registered
        final = seen[-1].json()
        assert final["ready"] is True
        assert final["gave_up_waiting_for"] == ["Ghost"]
        assert "ready_give_up_after = 4 s" in final["reason"]
        waiting = [r.json() for r in seen if r.json()["status"] == "UP"][:-1]
        assert waiting, "the node was never seen Up and waiting for its region"
        assert all(body["waiting_for"] == ["Ghost"] for body in waiting)
        assert all(r.status_code == 503 for r in seen[:-1])


# --- starting and stopping ------------------------------------------------------------------------

_TLS = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))


async def test_a_taken_port_is_a_configuration_error_and_off_means_no_endpoint() -> None:
    net = SimNetwork(6)
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = NodeConfig(
            cluster_name="sim",
            node_name="n1",
            bind_host="10.0.0.1",
            bind_port=1,
            tls=_TLS,
            management=ManagementSettings(enabled=True, port=port),
        )
        async with net.transport(Address("10.0.0.1", 1), "n1") as transport:
            with pytest.raises(ConfigurationError) as error:
                async with open_node(config, transport=transport):
                    pass
        assert str(error.value).startswith(
            f"cannot listen on the management address 127.0.0.1:{port}: "
        )
        assert "[management] host or port" in str(error.value)
    off = attrs.evolve(config, management=ManagementSettings())
    async with (
        net.transport(Address("10.0.0.1", 2), "n1") as transport,
        open_node(attrs.evolve(off, bind_port=2), transport=transport) as node,
    ):
        assert node.management_address is None


# --- the decisions, without HTTP -----------------------------------------------------------------


def test_routes() -> None:
    assert route("GET", "/alive") == Route("alive")
    assert route("GET", "/ready") == Route("ready")
    assert route("GET", "/cluster/members") == Route("members")
    assert route("GET", "/cluster/members/[::1]:25520") == Route("member", "[::1]:25520")
    assert route("PUT", "/cluster/members/10.0.0.1:2") == Route("operation", "10.0.0.1:2")
    assert route("GET", "/cluster/shards") == Route("types")
    assert route("GET", "/cluster/shards/Room") == Route("shards", "Room")
    assert route("GET", "/") == Route("dashboard")
    assert route("GET", "/dashboard/state") == Route("dashboard_state")
    assert route("GET", "/dashboard/dashboard.js") == Route("dashboard_file", "dashboard.js")
    for path in ("", "/alive/", "/cluster/shards/", "/cluster/shards/a/b", "/Alive", "/dashboard/"):
        answer = route("GET", path)
        assert not isinstance(answer, Route)
        assert answer.status == 404, path
    answer = route("HEAD", "/ready")
    assert not isinstance(answer, Route)
    assert (answer.status, answer.headers) == (405, (("allow", "GET"),))


def test_tokens() -> None:
    with_token = ManagementSettings(enabled=True, token=TOKEN)
    assert check_token(with_token, None, mutating=False) is None
    assert check_token(with_token, f"Bearer {TOKEN}", mutating=True) is None
    assert check_token(with_token, f"bearer  {TOKEN} ", mutating=True) is None
    for header in (None, "", "Bearer", "Bearer ", TOKEN, f"Basic {TOKEN}"):
        answer = check_token(with_token, header, mutating=True)
        assert answer is not None
        assert answer.status == 401, header
        assert "invalid_token" not in dict(answer.headers)["www-authenticate"]
    for wrong in (TOKEN[:-1], TOKEN + "x", TOKEN.upper()):
        answer = check_token(with_token, f"Bearer {wrong}", mutating=True)
        assert answer is not None
        assert answer.status == 401
        assert 'error="invalid_token"' in dict(answer.headers)["www-authenticate"]
    without = ManagementSettings(enabled=True)
    answer = check_token(without, f"Bearer {TOKEN}", mutating=True)
    assert answer is not None
    assert answer.status == 403
    assert check_token(without, None, mutating=False) is None
    reads = ManagementSettings(enabled=True, token=TOKEN, read_token_required=True)
    answer = check_token(reads, None, mutating=False)
    assert answer is not None
    assert answer.status == 401
    assert check_token(reads, f"Bearer {TOKEN}", mutating=False) is None


def test_operations() -> None:
    assert parse_operation(b'{"operation": "leave"}') == "leave"
    assert parse_operation(b' {"operation":"down"}\n') == "down"
    for body in (b"", b"down", b"[", b"\xff", b"null", b'{"operation": "stop"}', b"{}"):
        answer = parse_operation(body)
        assert not isinstance(answer, str)
        assert answer.status == 400, body


def test_readiness() -> None:
    up, joining, leaving = MemberStatus.UP, MemberStatus.JOINING, MemberStatus.LEAVING
    room, ghost = RegionReadiness("Room", True), RegionReadiness("Ghost", False)
    assert readiness(joining, None, 5.0, [room], 10.0).status == 503
    assert readiness(leaving, 0.0, 50.0, [room], 10.0).body["status"] == "LEAVING"
    assert readiness(leaving, 0.0, 50.0, [], 10.0).status == 503
    assert readiness(MemberStatus.WEAKLY_UP, 0.0, 1.0, [room], 10.0).status == 200
    assert readiness(up, 0.0, 1.0, [], 10.0).body == {
        "ready": True,
        "status": "UP",
        "registered": [],
    }
    waiting = readiness(up, 100.0, 103.0, [room, ghost], 10.0)
    assert waiting.status == 503
    assert waiting.body["waiting_for"] == ["Ghost"]
    assert waiting.body["registered"] == ["Room"]
    assert waiting.body["gives_up_in"] == 7.0
    gave_up = readiness(up, 100.0, 110.0, [room, ghost], 10.0)
    assert gave_up.status == 200
    assert gave_up.body["gave_up_waiting_for"] == ["Ghost"]
    assert readiness(up, None, 1e9, [ghost], 10.0).status == 503  # not seen Up: keeps waiting
