"""The management endpoint over HTTPS: certificates as credentials, on real nodes with httpx.

The nodes run on the simulated network, as in ``test_management``; their management endpoints
speak real HTTPS on 127.0.0.1 with certificates this module makes with the cluster CA (and a
second, untrusted CA). Clients present node, client, admin, denied and foreign certificates, or
none, and the bearer token. The authorization decision is also tested as the plain function it is.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from membership import ConfigurationError, IdentityKind, PeerIdentity
from membership.internal import TlsIdentity, create_certificate, create_cluster_ca
from p2pshard import ManagementSettings, Node, NodeConfig, TlsFiles
from p2pshard._management import authorize, certificate_caller, management_ssl_context
from p2pshard.testing import SimCluster, simulated_cluster_of
from tests.p2pshard.test_cli_status import Touch
from tests.p2pshard.test_management import (
    BOUND,
    ENTITIES,
    TOKEN,
    bearer,
    managed,
    refused,
    registered,
    start_counter,
    statuses,
)

CLUSTER = "sim"  # the simulated cluster's name


@attrs.frozen
class Certs:
    """Every certificate the tests present, by who holds it."""

    root: Path

    def files(self, who: str) -> TlsFiles:
        folder = self.root / who
        prefix = "node" if who in ("n1", "n2") else "admin" if who.startswith("admin") else "client"
        return TlsFiles(
            ca_file=folder / "ca.pem",
            cert_file=folder / f"{prefix}.pem",
            key_file=folder / f"{prefix}-key.pem",
        )


def make_certs(root: Path) -> Certs:
    create_cluster_ca(CLUSTER, root / "ca")
    create_cluster_ca(CLUSTER, root / "rogue-ca")  # same cluster name, another key
    for who, kind, ca, cluster in (
        ("n1", IdentityKind.NODE, "ca", CLUSTER),
        ("n2", IdentityKind.NODE, "ca", CLUSTER),
        ("client-ops", IdentityKind.CLIENT, "ca", CLUSTER),
        ("admin-alice", IdentityKind.ADMIN, "ca", CLUSTER),
        ("banned-eve", IdentityKind.CLIENT, "ca", CLUSTER),
        ("admin-rogue", IdentityKind.ADMIN, "rogue-ca", CLUSTER),
        ("admin-shop", IdentityKind.ADMIN, "ca", "shop"),  # our CA, another cluster's name
    ):
        name = who.partition("-")[2] or who
        create_certificate(PeerIdentity(kind, name), root / ca, root / who, cluster=cluster)
    return Certs(root)


def with_tls(
    certs: Certs, settings: dict[int, ManagementSettings]
) -> Callable[[int, NodeConfig], NodeConfig]:
    base = managed(settings)

    def configure(i: int, config: NodeConfig) -> NodeConfig:
        files = attrs.evolve(certs.files(f"n{i}"), deny=("client:eve",))
        return attrs.evolve(base(i, config), tls=files)

    return configure


@asynccontextmanager
async def tls_cluster(
    seed: int, certs: Certs, settings: dict[int, ManagementSettings]
) -> AsyncIterator[SimCluster]:
    async with simulated_cluster_of(
        SimCluster, seed, start_counter, configure=with_tls(certs, settings)
    ) as sim:
        yield sim


def client_context(certs: Certs, who: str | None, *, ca: str = "ca") -> ssl.SSLContext:
    """What a client trusts (the cluster CA; node certificates name no host) and presents."""
    context = ssl.create_default_context(cafile=certs.root / ca / "ca.pem")
    context.check_hostname = False
    if who is not None:
        files = certs.files(who)
        context.load_cert_chain(files.cert_file, files.key_file)
    return context


@asynccontextmanager
async def https(node: Node, certs: Certs, who: str | None) -> AsyncIterator[httpx.AsyncClient]:
    assert node.management_address is not None
    base = f"https://{node.management_address}"
    context = client_context(certs, who)
    async with httpx.AsyncClient(base_url=base, verify=context, timeout=10.0) as http:
        yield http


TLS_CLIENT_READS = ManagementSettings(
    enabled=True, port=0, token=TOKEN, tls=True, read_access="client"
)


async def test_certificates_decide_who_may_read_and_who_may_leave_and_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    certs = make_certs(tmp_path)
    no_token = ManagementSettings(enabled=True, port=0, tls=True, read_access="admin")
    settings = {1: TLS_CLIENT_READS, 2: no_token}
    async with tls_cluster(5, certs, settings) as sim:
        await sim.start_up([1, 2], bound=BOUND)
        await registered(sim, [1, 2])
        for entity in ENTITIES:
            assert await sim.regions[1].entity_ref(entity).ask(Touch(), timeout=10) == 1
        before = statuses(sim, [1, 2])
        n1, n2 = sim.nodes[1], sim.nodes[2]
        leave_n2 = "/cluster/members/10.0.0.1:2"

        async with https(n1, certs, None) as http:  # a probe: no certificate
            alive = await http.get("/alive")
            assert (alive.status_code, alive.json()) == (200, {"alive": True})
            assert (await http.get("/ready")).status_code == 200
            nothing = await http.get("/cluster/members")
            refused(nothing, 401, "a certificate of this cluster", "Authorization: Bearer")
            assert nothing.headers["www-authenticate"].startswith("Bearer")
            refused(await http.put(leave_n2, json={"operation": "leave"}), 401, "admin")
            # The token still works, for reading and for the mutating route.
            assert (await http.get("/cluster/members", headers=bearer())).status_code == 200
            refused(await http.get("/metrics", headers=bearer("no" * 10)), 401, "wrong")
            unknown = await http.put(
                "/cluster/members/10.0.0.1:99", json={"operation": "down"}, headers=bearer()
            )
            refused(unknown, 404, "no member at 10.0.0.1:99")  # past the authorization

        async with https(n1, certs, "client-ops") as http:
            members = await http.get("/cluster/members")
            assert members.status_code == 200, members.text
            assert {m["name"] for m in members.json()["members"]} == {"n1", "n2"}
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/cluster/shards/Counter")).status_code == 200
            put = await http.put(leave_n2, json={"operation": "leave"})
            refused(put, 403, "leave and down needs an admin certificate", "client:ops")
            # A token sent along is judged: a wrong one is refused, the right one is enough.
            wrong = await http.put(leave_n2, json={"operation": "leave"}, headers=bearer("x" * 16))
            refused(wrong, 401, "wrong")

        async with https(n1, certs, "n2") as http:  # a node's certificate reads, as the transport
            assert (await http.get("/cluster/members")).status_code == 200
            refused(await http.put(leave_n2, json={"operation": "down"}), 403, "node:n2")

        async with https(n1, certs, "banned-eve") as http:  # signed by the CA, but denied
            refused(await http.get("/cluster/members"), 403, "denied", "client:eve")
            assert (await http.get("/alive")).status_code == 200

        async with https(n1, certs, "admin-shop") as http:  # our CA, but another cluster
            refused(await http.get("/cluster/members"), 403, "not for cluster 'sim'")

        # An admin certificate of a CA the node does not trust: the handshake fails (TLS 1.3:
        # the client learns it at its first read), the node logs it. And a client that trusts
        # another CA does not take the node's certificate.
        for who, ca in (("admin-rogue", "ca"), ("client-ops", "rogue-ca")):
            context = client_context(certs, who, ca=ca)
            base = f"https://{n1.management_address}"
            async with httpx.AsyncClient(base_url=base, verify=context, timeout=10.0) as http:
                with pytest.raises(httpx.TransportError):
                    await http.get("/alive")
        logged = [r.getMessage() for r in caplog.records if "refused a TLS handshake" in r.message]
        assert any("CERTIFICATE_VERIFY_FAILED" in text for text in logged), logged

        async with https(n2, certs, "client-ops") as http:  # read_access = "admin", no token
            refused(await http.get("/cluster/members"), 403, "an admin certificate", "client:ops")
            refused(
                await http.get("/cluster/members", headers=bearer()),
                403,
                "takes no bearer token",
            )
        async with https(n2, certs, None) as http:
            refused(await http.get("/metrics"), 403, "an admin certificate", "mutual TLS")
            assert (await http.get("/ready")).status_code == 200

        await trio.sleep(1.0)  # a few gossip rounds: a change would have spread by now
        assert statuses(sim, [1, 2]) == before

        async with https(n2, certs, "admin-alice") as http:  # an admin reads, and may leave
            assert (await http.get("/cluster/members")).status_code == 200
            left = await http.put("/cluster/members/10.0.0.1:1", json={"operation": "leave"})
            assert left.status_code == 200, left.text
            assert left.json()["member"]["name"] == "n1"
        with trio.fail_after(BOUND):
            await n1.terminated.wait()  # it left: Leaving, Exiting, Removed


async def test_plain_http_to_the_https_port_gets_no_answer(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    async with tls_cluster(6, certs, {1: TLS_CLIENT_READS}) as sim:
        await sim.start_up([1], bound=BOUND)
        node = sim.nodes[1]
        async with httpx.AsyncClient(base_url=f"http://{node.management_address}") as http:
            with pytest.raises(httpx.TransportError):
                await http.get("/alive")
        async with https(node, certs, None) as http:  # the endpoint still serves
            assert (await http.get("/alive")).status_code == 200


# --- bad configuration -------------------------------------------------------------------------


def test_tls_with_missing_files_is_refused_with_the_file_named(tmp_path: Path) -> None:
    identity = TlsIdentity(CLUSTER, tmp_path / "ca.pem", tmp_path / "n.pem", tmp_path / "n.key")
    with pytest.raises(ConfigurationError, match=r"TLS CA file .*ca\.pem' does not exist"):
        management_ssl_context(identity)


async def test_a_node_whose_management_tls_files_are_missing_does_not_start(
    tmp_path: Path,
) -> None:
    settings = {1: TLS_CLIENT_READS}
    configure = managed(settings)  # the simulated nodes' [tls] names files that do not exist
    missing = pytest.RaisesExc(
        ConfigurationError, match=r"\[management\] tls = true: TLS CA file 'ca.pem' does not exist"
    )
    with pytest.RaisesGroup(missing, flatten_subgroups=True):
        async with simulated_cluster_of(SimCluster, 7, start_counter, configure=configure) as sim:
            await sim.start(1)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"P2PSHARD_MANAGEMENT__READ_ACCESS": "client"},
            "management.read_access = 'client' is invalid without tls",
        ),
        (
            {"P2PSHARD_MANAGEMENT__READ_ACCESS": "everyone"},
            "P2PSHARD_MANAGEMENT__READ_ACCESS='everyone' is invalid: expected one of 'open', "
            "'client', 'admin'",
        ),
        (
            {"P2PSHARD_MANAGEMENT__READ_ACCESS": "admin"},
            "read_access = 'admin' is invalid without tls and without a token",
        ),
        (
            {
                "P2PSHARD_MANAGEMENT__TLS": "true",
                "P2PSHARD_MANAGEMENT__READ_ACCESS": "client",
                "P2PSHARD_MANAGEMENT__READ_TOKEN_REQUIRED": "true",
                "P2PSHARD_MANAGEMENT__TOKEN": TOKEN,
            },
            "read_token_required = True is invalid with read_access = 'client'",
        ),
    ],
)
def test_bad_management_tls_settings_are_refused(
    tmp_path: Path, environ: dict[str, str], message: str
) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        'cluster_name = "shop"\nnode_name = "n1"\n[tls]\nca_file = "ca.pem"\n'
        'cert_file = "n.pem"\nkey_file = "n.key"\n[management]\nenabled = true\n'
    )
    with pytest.raises(ConfigurationError) as caught:
        NodeConfig.load(path, environ=environ)
    assert message in str(caught.value)


def test_tls_settings_load_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        'cluster_name = "shop"\nnode_name = "n1"\n[tls]\nca_file = "ca.pem"\n'
        'cert_file = "n.pem"\nkey_file = "n.key"\n[management]\nenabled = true\ntls = true\n'
        'read_access = "client"\n'
    )
    management = NodeConfig.load(path, environ={}).management
    assert (management.tls, management.read_access, management.read_level) == (
        True,
        "client",
        "client",
    )
    assert ManagementSettings(token=TOKEN, read_token_required=True).read_level == "admin"


# --- the decision, as a plain function ---------------------------------------------------------

ADMIN = PeerIdentity(IdentityKind.ADMIN, "alice")
CLIENT = PeerIdentity(IdentityKind.CLIENT, "ops")
NODE = PeerIdentity(IdentityKind.NODE, "n2")
BEARER = f"Bearer {TOKEN}"


@pytest.mark.parametrize(
    ("settings", "caller", "authorization", "mutating", "status"),
    [
        # Plain HTTP: the token alone, as before.
        (ManagementSettings(token=TOKEN), None, None, False, None),
        (ManagementSettings(token=TOKEN), None, None, True, 401),
        (ManagementSettings(token=TOKEN), None, BEARER, True, None),
        (ManagementSettings(), None, BEARER, True, 403),
        (ManagementSettings(token=TOKEN, read_access="admin"), None, None, False, 401),
        # HTTPS, reads by any certificate of the cluster.
        (TLS_CLIENT_READS, CLIENT, None, False, None),
        (TLS_CLIENT_READS, NODE, None, False, None),
        (TLS_CLIENT_READS, ADMIN, None, True, None),
        (TLS_CLIENT_READS, ADMIN, "Bearer wrong-but-the-certificate-wins", True, None),
        (TLS_CLIENT_READS, CLIENT, None, True, 403),
        (TLS_CLIENT_READS, NODE, None, True, 403),
        (TLS_CLIENT_READS, CLIENT, BEARER, True, None),
        (TLS_CLIENT_READS, None, None, False, 401),
        (TLS_CLIENT_READS, None, BEARER, False, None),
        (TLS_CLIENT_READS, "denied", None, False, 403),
        # HTTPS, reads open (the default), no token.
        (ManagementSettings(tls=True), None, None, False, None),
        (ManagementSettings(tls=True), None, None, True, 403),
        (ManagementSettings(tls=True), ADMIN, None, True, None),
        (ManagementSettings(tls=True), CLIENT, BEARER, True, 403),
        # HTTPS, reads by admins only.
        (ManagementSettings(tls=True, read_access="admin"), CLIENT, None, False, 403),
        (ManagementSettings(tls=True, read_access="admin"), ADMIN, None, False, None),
    ],
)
def test_authorize(
    settings: ManagementSettings,
    caller: PeerIdentity | str | None,
    authorization: str | None,
    mutating: bool,
    status: int | None,
) -> None:
    answer = authorize(settings, caller, authorization, mutating=mutating)
    assert (None if answer is None else answer.status) == status
    if answer is not None:
        assert answer.body["error"]
        assert (answer.status == 401) == any(h == "www-authenticate" for h, _ in answer.headers)


def test_certificate_caller_reads_the_identity_and_applies_the_deny_list(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)

    def pem(who: str) -> list[str]:
        return [certs.files(who).cert_file.read_text()]

    tls = attrs.evolve(certs.files("n1"), deny=("client:eve",)).identity(CLUSTER)
    assert certificate_caller([], tls) is None
    assert certificate_caller(pem("admin-alice"), tls) == ADMIN
    assert certificate_caller(pem("client-ops"), tls) == CLIENT
    assert certificate_caller(pem("n2"), tls) == PeerIdentity(IdentityKind.NODE, "n2")
    denied = certificate_caller(pem("banned-eve"), tls)
    assert isinstance(denied, str)
    assert "denied by the entry 'client:eve'" in denied
    foreign = certificate_caller(pem("admin-shop"), tls)
    assert isinstance(foreign, str)
    assert "not for cluster 'sim'" in foreign
    assert isinstance(certificate_caller(["not a certificate"], tls), str)
