"""The etcd lease backend: against a real etcd started per test, and against a fake one.

What every lease backend must do is the conformance kit's business; these tests cover what is
etcd's own: tokens from revisions, expiry by etcd lease, keep-alives, endpoint failover, a stopped
server, and answers that are not what the JSON gateway gives (through ``httpx.MockTransport``).
Each real etcd starts in about 0.2 s (``p2pshard/testing/_etcd.py``).
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from membership import ConfigurationError
from p2pshard._errors import LeaseUnavailable, NodeLeaseGone
from p2pshard.leases._etcd import EtcdLeaseBackend
from p2pshard.leases._lease import Lease, LeaseSettings
from p2pshard.leases._leases import Leases
from p2pshard.leases._node_lease import AttachedLease
from p2pshard.testing import EtcdServer, running_etcd, start_etcd

TEST_LIMIT = 10.0
"""Seconds any one test may take."""


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    async with start_etcd(tmp_path) as server:
        yield server


@pytest.fixture
async def backend(etcd: EtcdServer) -> AsyncIterator[EtcdLeaseBackend]:
    backend = EtcdLeaseBackend([etcd.url], request_timeout=2.0)
    try:
        yield backend
    finally:
        await backend.aclose()


async def etcd_leases(url: str) -> int:
    """How many etcd leases exist, asked directly."""
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = (await client.post(url + "/v3/lease/leases", json={})).json()
    return len(answer.get("leases", []))


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port that was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# --- against a real etcd ---------------------------------------------------------------------


async def test_grant_holder_renew_release(backend: EtcdLeaseBackend, etcd: EtcdServer) -> None:
    with trio.fail_after(TEST_LIMIT):
        token = await backend.try_acquire("orders", "node-1", 5)
        assert token is not None
        assert await backend.holder("orders") == ("node-1", token)
        assert await backend.renew("orders", "node-1", token, 5)
        assert not await backend.renew("orders", "node-2", token, 5)  # not its owner
        assert await backend.release("orders", "node-1", token)
        assert await backend.holder("orders") is None
        assert await etcd_leases(etcd.url) == 0  # the release revoked the etcd lease
        assert not await backend.renew("orders", "node-1", token, 5)
        assert not await backend.release("orders", "node-1", token)


async def test_another_owner_is_refused_and_leaves_no_etcd_lease(
    backend: EtcdLeaseBackend, etcd: EtcdServer
) -> None:
    with trio.fail_after(TEST_LIMIT):
        token = await backend.try_acquire("orders", "node-1", 5)
        assert token is not None
        assert await backend.try_acquire("orders", "node-2", 5) is None
        assert await backend.holder("orders") == ("node-1", token)
        assert await etcd_leases(etcd.url) == 1  # the refused grant's etcd lease was revoked
        # Another owner naming node-1's token neither renews nor ends node-1's grant.
        assert not await backend.renew("orders", "node-2", token, 5)
        assert not await backend.release("orders", "node-2", token)
        assert await backend.holder("orders") == ("node-1", token)
        assert await backend.renew("orders", "node-1", token, 5)


async def test_tokens_strictly_increase_across_grants_and_names(
    backend: EtcdLeaseBackend,
) -> None:
    with trio.fail_after(TEST_LIMIT):
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        for round_ in range(4):
            for name in tokens:
                owner = f"node-{round_ % 2}"
                token = await backend.try_acquire(name, owner, 5)
                assert token is not None
                tokens[name].append(token)
                assert await backend.release(name, owner, token)
        for name, granted in tokens.items():
            assert granted == sorted(set(granted)), f"{name}: {granted}"


async def test_the_same_owner_reacquiring_gets_a_new_larger_token(
    backend: EtcdLeaseBackend, etcd: EtcdServer
) -> None:
    with trio.fail_after(TEST_LIMIT):
        first = await backend.try_acquire("orders", "node-1", 5)
        assert first is not None
        # A restarted process: a new backend that knows nothing of the first grant.
        restarted = EtcdLeaseBackend([etcd.url])
        try:
            second = await restarted.try_acquire("orders", "node-1", 5)
            assert second is not None
            assert second > first
            assert await restarted.holder("orders") == ("node-1", second)
            assert not await backend.renew("orders", "node-1", first, 5)  # the old grant is over
            assert not await restarted.renew("orders", "node-1", first, 5)  # never its grant
            assert await restarted.renew("orders", "node-1", second, 5)
            # And again in the same process: the grant it holds is replaced by a newer one.
            third = await restarted.try_acquire("orders", "node-1", 5)
            assert third is not None
            assert third > second
            assert not await restarted.renew("orders", "node-1", second, 5)
            assert await restarted.renew("orders", "node-1", third, 5)
        finally:
            await restarted.aclose()


async def test_an_expired_etcd_lease_makes_renew_false(backend: EtcdLeaseBackend) -> None:
    with trio.fail_after(TEST_LIMIT):
        began = trio.current_time()
        token = await backend.try_acquire("orders", "node-1", 0.5)  # asks etcd for 1 s
        assert token is not None
        while await backend.holder("orders") is not None:  # noqa: ASYNC110 - polls etcd
            await trio.sleep(0.05)
        # etcd deleted the key no earlier than ttl after the call began (whole seconds, up).
        assert trio.current_time() - began >= 1.0
        assert not await backend.renew("orders", "node-1", token, 0.5)
        later = await backend.try_acquire("orders", "node-2", 1)
        assert later is not None
        assert later > token


async def test_renewals_keep_a_grant_past_its_ttl(backend: EtcdLeaseBackend) -> None:
    """Through :class:`Lease`: a 1 s grant is still held after 2.5 s of keep-alives."""
    settings = LeaseSettings(ttl=1.0, renew_interval=0.3, operation_timeout=0.5, safety_margin=0.2)
    with trio.fail_after(TEST_LIMIT):
        async with trio.open_nursery() as nursery:
            lease = Lease(backend, "orders", "node-1", settings, nursery=nursery)
            grant = await lease.acquire()
            assert grant is not None
            await trio.sleep(2.5)
            assert lease.check()
            assert await backend.holder("orders") == ("node-1", grant.token)
            assert await lease.release()
        assert await backend.holder("orders") is None


async def test_renew_of_a_grant_this_backend_did_not_make_is_false(
    backend: EtcdLeaseBackend,
) -> None:
    with trio.fail_after(TEST_LIMIT):
        assert not await backend.renew("orders", "node-1", 12345, 5)


async def test_renew_for_longer_than_the_granted_ttl_is_refused(
    backend: EtcdLeaseBackend,
) -> None:
    with trio.fail_after(TEST_LIMIT):
        token = await backend.try_acquire("orders", "node-1", 2)
        assert token is not None
        with pytest.raises(ValueError, match=r"longer than the 2 s its etcd lease was granted"):
            await backend.renew("orders", "node-1", token, 10)


async def test_a_paused_etcd_raises_lease_unavailable_within_the_request_timeout(
    etcd: EtcdServer,
) -> None:
    backend = EtcdLeaseBackend([etcd.url], request_timeout=0.5)
    try:
        with trio.fail_after(TEST_LIMIT):
            token = await backend.try_acquire("orders", "node-1", 5)
            spare = await backend.try_acquire("spare", "node-1", 5)
            assert token is not None
            assert spare is not None
            etcd.pause()
            try:
                # A request that timed out may still take effect when etcd resumes (it waits in
                # the socket): the release is of another lease so that "orders" stays held.
                calls: list[tuple[str, str, Callable[[], Awaitable[object]]]] = [
                    ("acquire", "fresh", lambda: backend.try_acquire("fresh", "node-1", 5)),
                    ("renewal", "orders", lambda: backend.renew("orders", "node-1", token, 5)),
                    ("release", "spare", lambda: backend.release("spare", "node-1", spare)),
                    ("read", "orders", lambda: backend.holder("orders")),
                ]
                for what, name, call in calls:
                    began = trio.current_time()
                    with pytest.raises(LeaseUnavailable) as caught:
                        await call()
                    assert trio.current_time() - began < 1.5, what
                    message = str(caught.value)
                    assert etcd.url in message
                    assert f"{what} of lease {name!r} failed" in message
                    assert "no answer within request_timeout (0.5 s)" in message
            finally:
                etcd.resume()
            assert await backend.renew("orders", "node-1", token, 5)
    finally:
        await backend.aclose()


async def test_a_dead_endpoint_followed_by_a_live_one_works(etcd: EtcdServer) -> None:
    dead = dead_url()
    backend = EtcdLeaseBackend([dead, etcd.url])
    try:
        with trio.fail_after(TEST_LIMIT):
            token = await backend.try_acquire("orders", "node-1", 5)
            assert token is not None
            assert await backend.holder("orders") == ("node-1", token)
    finally:
        await backend.aclose()


async def test_no_endpoint_to_connect_to_names_them_all() -> None:
    first, second = dead_url(), dead_url()
    backend = EtcdLeaseBackend([first, second])
    try:
        with trio.fail_after(TEST_LIMIT), pytest.raises(LeaseUnavailable) as caught:
            await backend.holder("orders")
    finally:
        await backend.aclose()
    message = str(caught.value)
    assert "read of lease 'orders' failed: could not connect to any endpoint" in message
    assert first in message
    assert second in message


class CountingTransport(httpx.AsyncBaseTransport):
    """The network, counting the requests of each path."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.paths: dict[str, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths[request.url.path] = self.paths.get(request.url.path, 0) + 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


SHORT = LeaseSettings(ttl=2.0, renew_interval=0.3, operation_timeout=1.0, safety_margin=0.3)


async def create_revision(client: httpx.AsyncClient, url: str, key: str) -> int:
    """The key's create_revision, asked directly (0: no such key)."""
    answer = (await client.post(url + "/v3/kv/range", json={"key": b64(key)})).json()
    kvs = answer.get("kvs", [])
    return int(kvs[0]["create_revision"]) if kvs else 0


async def token_of(handle: Lease | AttachedLease) -> int:
    """Acquire: the token (the name must be free)."""
    grant = await handle.acquire()
    assert grant is not None
    return grant.token


async def test_a_node_lease_keeps_many_shard_keys_with_one_keep_alive_per_interval(
    etcd: EtcdServer,
) -> None:
    counting = CountingTransport()
    backend = EtcdLeaseBackend([etcd.url], request_timeout=1.0, transport=counting)
    try:
        with trio.fail_after(TEST_LIMIT):
            async with trio.open_nursery() as nursery:
                leases = Leases(backend, "n1", SHORT, "c", nursery)
                handles = [leases.shard_lease("T", str(shard)) for shard in range(40)]
                grants = [await h.acquire() for h in handles]
                assert all(isinstance(h, AttachedLease) for h in handles)
                paths = counting.paths
                assert (paths["/v3/lease/grant"], paths["/v3/kv/txn"]) == (1, 40), paths
                await trio.sleep(SHORT.ttl * 1.5)  # renewed past the ttl
                assert all(h.check() for h in handles)
                keepalives = counting.paths["/v3/lease/keepalive"]
                assert 5 <= keepalives <= 20, counting.paths  # about 3 s / 0.3 s, not 40 each
                assert set(counting.paths) == {
                    "/v3/lease/grant",
                    "/v3/kv/txn",
                    "/v3/lease/keepalive",
                }
                assert await etcd_leases(etcd.url) == 1  # one etcd lease for the 40 keys
                async with httpx.AsyncClient(trust_env=False) as client:  # one for the 40
                    for shard, grant in enumerate(grants):
                        assert grant is not None
                        # The fencing token is the key's create_revision.
                        assert await create_revision(
                            client, etcd.url, f"p2pshard/leases/c-shard-T-{shard}"
                        ) == (grant.token)
                assert await handles[0].release()  # a hand-off frees one key only
                assert await backend.holder("c-shard-T-0") is None
                assert await backend.holder("c-shard-T-1") == ("n1", handles[1].token)
                assert await leases.release_all() == 39  # one revoke frees the rest
                assert await etcd_leases(etcd.url) == 0
                assert [await backend.holder(f"c-shard-T-{s}") for s in range(40)] == [None] * 40
                nursery.cancel_scope.cancel()
    finally:
        await backend.aclose()


async def test_an_expired_node_lease_frees_every_key_for_another_node_with_larger_tokens(
    etcd: EtcdServer,
) -> None:
    crashed_backend = EtcdLeaseBackend([etcd.url], request_timeout=1.0)
    taker_backend = EtcdLeaseBackend([etcd.url], request_timeout=1.0)
    try:
        with trio.fail_after(TEST_LIMIT):
            async with trio.open_nursery() as nursery:
                crashed = Leases(crashed_backend, "n1", SHORT, "c", nursery)
                old = [crashed.shard_lease("T", str(s)) for s in range(10)]
                old_tokens = [await token_of(h) for h in old]
                crashed.abandon_all()  # its keep-alives stop; nothing is given back
                assert not any(h.check() for h in old)
                began = trio.current_time()
                taker = Leases(taker_backend, "n2", SHORT, "c", nursery)
                new = [taker.shard_lease("T", str(s)) for s in range(10)]
                while await new[0].acquire() is None:  # noqa: ASYNC110 - polls etcd
                    await trio.sleep(0.05)
                assert trio.current_time() - began >= SHORT.ttl - SHORT.safety_margin - 0.5
                new_tokens = [await token_of(h) for h in new]
                assert all(a < b for a, b in zip(old_tokens, new_tokens, strict=True))
                nursery.cancel_scope.cancel()
    finally:
        await crashed_backend.aclose()
        await taker_backend.aclose()


async def test_a_key_cannot_be_attached_to_an_etcd_lease_that_is_gone(
    backend: EtcdLeaseBackend,
) -> None:
    with trio.fail_after(TEST_LIMIT):
        lease_id = await backend.grant_node_lease("n1", 5)
        assert await backend.try_acquire_attached("a", "n1", lease_id) is not None
        assert await backend.try_acquire_attached("a", "n2", lease_id) is None  # n1 holds it
        assert await backend.revoke_node_lease("n1", lease_id)
        assert await backend.holder("a") is None  # the revoke deleted the key
        with pytest.raises(NodeLeaseGone, match=r"node lease .* has ended"):
            await backend.try_acquire_attached("b", "n1", lease_id)
        assert not await backend.keep_node_lease("n1", lease_id, 5)
        assert not await backend.revoke_node_lease("n1", lease_id)


def test_the_sync_server_stops_and_removes_its_data(tmp_path: Path) -> None:
    with running_etcd(tmp_path) as server:
        assert httpx.get(server.url + "/health", trust_env=False).json() == {"health": "true"}
        assert server.data_dir.is_dir()
    assert server.exited()
    assert not server.data_dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)


# --- against a fake etcd ---------------------------------------------------------------------

URL = "http://etcd.test:2379"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


KV = {
    "key": b64("p2pshard/leases/orders"),
    "value": b64("node-1"),
    "create_revision": "2",
    "mod_revision": "2",
    "lease": "7",
}
GOOD: dict[str, Any] = {
    "/v3/lease/grant": {"header": {"revision": "1"}, "ID": "7", "TTL": "5"},
    "/v3/kv/txn": {
        "header": {"revision": "2"},
        "succeeded": True,
        "responses": [{"response_put": {"header": {"revision": "2"}}}],
    },
    "/v3/lease/keepalive": {"result": {"header": {"revision": "2"}, "ID": "7", "TTL": "5"}},
    "/v3/kv/range": {"header": {"revision": "2"}, "kvs": [KV], "count": "1"},
    "/v3/lease/revoke": {"header": {"revision": "2"}},
}
"""What etcd 3.4 answers when ``node-1`` holds ``orders`` with token 2 and etcd lease 7."""

DELETED = {
    "header": {"revision": "3"},
    "succeeded": True,
    "responses": [
        {"response_delete_range": {"header": {"revision": "3"}, "deleted": "1", "prev_kvs": [KV]}}
    ],
}
"""etcd's answer to a transaction that deleted that key."""


def good(request: httpx.Request) -> httpx.Response:
    """etcd's answer to ``request`` when all goes well."""
    if request.url.path == "/v3/kv/txn" and b"request_delete_range" in request.content:
        return httpx.Response(200, json=DELETED)
    return httpx.Response(200, json=GOOD[request.url.path])


class FakeEtcd:
    """Answers as etcd does (:func:`good`), except on the paths in ``broken``; records requests."""

    def __init__(self) -> None:
        self.broken: dict[str, httpx.Response | Exception] = {}
        self.requests: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        answer = self.broken.get(request.url.path)
        if isinstance(answer, Exception):
            raise answer
        if answer is not None:
            return answer
        return good(request)

    def backend(self, endpoints: tuple[str, ...] = (URL,)) -> EtcdLeaseBackend:
        return EtcdLeaseBackend(endpoints, transport=httpx.MockTransport(self))


async def acquire(backend: EtcdLeaseBackend) -> object:
    return await backend.try_acquire("orders", "node-1", 5)


async def renew(backend: EtcdLeaseBackend) -> object:
    return await backend.renew("orders", "node-1", 2, 5)


async def release(backend: EtcdLeaseBackend) -> object:
    return await backend.release("orders", "node-1", 2)


async def read(backend: EtcdLeaseBackend) -> object:
    return await backend.holder("orders")


Operation = Callable[[EtcdLeaseBackend], Awaitable[object]]

MALFORMED: list[tuple[str, Operation, str, httpx.Response | Exception, str]] = [
    ("acquire", acquire, "/v3/lease/grant", httpx.Response(200, text="<html>"), "not a JSON"),
    ("acquire", acquire, "/v3/lease/grant", httpx.Response(200, json=[1]), "not a JSON object"),
    ("acquire", acquire, "/v3/lease/grant", httpx.Response(200, json={"ID": "7"}), "no header"),
    (
        "acquire",
        acquire,
        "/v3/kv/txn",
        httpx.Response(200, json={"header": {"revision": "two"}}),
        "field 'revision' is 'two', not an integer",
    ),
    (
        "acquire",
        acquire,
        "/v3/kv/txn",
        httpx.Response(
            500,
            json={"error": "etcdserver: no leader", "message": "etcdserver: no leader", "code": 14},
        ),
        "HTTP 500: etcdserver: no leader",
    ),
    (
        "renewal",
        renew,
        "/v3/lease/keepalive",
        httpx.Response(200, json={"error": {"grpc_code": 14, "message": "stream broke"}}),
        "etcd reported an error: stream broke",
    ),
    (
        "renewal",
        renew,
        "/v3/lease/keepalive",
        httpx.Response(200, json={"result": {"header": {"revision": "2"}, "TTL": [5]}}),
        "field 'TTL' is [5], not an integer",
    ),
    ("release", release, "/v3/kv/txn", httpx.Response(404, text="Not Found"), "HTTP 404"),
    (
        "release",
        release,
        "/v3/kv/txn",
        httpx.Response(200, json={"header": {"revision": "3"}, "succeeded": True}),
        "not a response_delete_range",
    ),
    (
        "read",
        read,
        "/v3/kv/range",
        httpx.Response(200, json={"header": {"revision": "2"}, "kvs": [{"value": "!!"}]}),
        "is not base64",
    ),
    ("read", read, "/v3/kv/range", httpx.ReadError("connection reset"), "connection reset"),
    ("read", read, "/v3/kv/range", httpx.RemoteProtocolError("garbage"), "RemoteProtocolError"),
]


@pytest.mark.parametrize(
    ("what", "operation", "path", "answer", "detail"),
    MALFORMED,
    ids=[f"{case[0]}-{case[2]}-{case[4]}" for case in MALFORMED],
)
async def test_a_malformed_answer_raises_lease_unavailable_saying_where_and_what(
    what: str,
    operation: Operation,
    path: str,
    answer: httpx.Response | Exception,
    detail: str,
) -> None:
    fake = FakeEtcd()
    backend = fake.backend()
    try:
        if operation in (renew, release):
            assert await acquire(backend) == 2  # the grant these operate on
        fake.broken[path] = answer
        with pytest.raises(LeaseUnavailable) as caught:
            await operation(backend)
    finally:
        await backend.aclose()
    message = str(caught.value)
    assert f"etcd {URL}{path}: {what} of lease 'orders' failed: " in message
    assert detail in message


async def test_the_fake_answers_are_understood() -> None:
    """The other fake-etcd tests mean something only if the unbroken fake works."""
    backend = FakeEtcd().backend()
    try:
        assert await acquire(backend) == 2
        assert await renew(backend) is True
        assert await read(backend) == ("node-1", 2)
        assert await release(backend) is True
    finally:
        await backend.aclose()


async def test_failover_only_on_connect_errors_and_sticks_to_the_endpoint_that_answered() -> None:
    down, up = "http://down.test:2379", "http://up.test:2379"

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down.test":
            raise httpx.ConnectError("connection refused")
        return good(request)

    seen: list[str] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return route(request)

    backend = EtcdLeaseBackend([down, up], transport=httpx.MockTransport(recording))
    try:
        assert await read(backend) == ("node-1", 2)
        assert await read(backend) == ("node-1", 2)
    finally:
        await backend.aclose()
    assert seen == ["down.test", "up.test", "up.test"]

    def slow_first(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        raise httpx.ReadTimeout("timed out")

    seen.clear()
    backend = EtcdLeaseBackend([up, down], transport=httpx.MockTransport(slow_first))
    try:
        with pytest.raises(LeaseUnavailable, match="no answer within request_timeout"):
            await acquire(backend)
    finally:
        await backend.aclose()
    assert seen == ["up.test"]  # an unknown outcome is not tried elsewhere


async def test_revoking_an_etcd_lease_that_is_gone_is_not_an_error() -> None:
    gone = {"error": "etcdserver: requested lease not found", "code": 5}
    fake = FakeEtcd()
    backend = fake.backend()
    try:
        assert await acquire(backend) == 2
        fake.broken["/v3/lease/revoke"] = httpx.Response(404, json=gone)
        assert await release(backend) is True
    finally:
        await backend.aclose()
    assert fake.requests[-1] == URL + "/v3/lease/revoke"


async def test_a_failed_revoke_is_logged_not_raised_once_the_outcome_is_known(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeEtcd()
    backend = fake.backend()
    try:
        assert await acquire(backend) == 2
        fake.broken["/v3/lease/revoke"] = httpx.Response(500, json={"message": "disk full"})
        assert await release(backend) is True  # the key is gone; its etcd lease expires later
    finally:
        await backend.aclose()
    assert "etcd lease 7 is left to expire" in caplog.text
    assert "HTTP 500: disk full" in caplog.text


async def test_requests_speak_the_gateway_json() -> None:
    bodies: list[tuple[str, Any]] = []

    def recording(request: httpx.Request) -> httpx.Response:
        bodies.append((request.url.path, json.loads(request.content)))
        return good(request)

    backend = EtcdLeaseBackend([URL], prefix="x/", transport=httpx.MockTransport(recording))
    try:
        assert await backend.try_acquire("orders", "node-1", 1.2) == 2
    finally:
        await backend.aclose()
    assert bodies[0] == ("/v3/lease/grant", {"TTL": "2"})  # whole seconds, rounded up
    path, txn = bodies[1]
    assert path == "/v3/kv/txn"
    assert txn["compare"] == [
        {"key": b64("x/orders"), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
    ]
    assert txn["success"] == [
        {"request_put": {"key": b64("x/orders"), "value": b64("node-1"), "lease": "7"}}
    ]


async def test_a_closed_backend_raises_lease_unavailable() -> None:
    backend = FakeEtcd().backend()
    await backend.aclose()
    with pytest.raises(LeaseUnavailable, match=r"read of lease 'orders' failed: .* closed"):
        await read(backend)


@pytest.mark.parametrize(
    ("endpoints", "timeout", "match"),
    [
        ([], 5.0, "non-empty list"),
        ("http://127.0.0.1:2379", 5.0, "non-empty list"),
        (["127.0.0.1:2379"], 5.0, "'127.0.0.1:2379' is invalid: must be an http"),
        ([URL], 0.0, "request_timeout 0.0 is invalid"),
    ],
)
def test_bad_arguments_are_refused_naming_them(endpoints: Any, timeout: float, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        EtcdLeaseBackend(endpoints, request_timeout=timeout)
