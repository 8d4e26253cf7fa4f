"""Node identity after the TLS handshake, TLS contexts, trusted CAs, deny lists, and the hello
check that follows."""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any

import attrs
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from membership import (
    Address,
    ConfigurationError,
    HandshakeError,
    IdentityKind,
    PeerIdentity,
    UniqueAddress,
)
from membership.transport._identity import identity_uri, parse_identity_uri
from membership.transport._tcp import Hello, HelloAck, check_hello
from membership.transport._tls import (
    DenyList,
    TlsIdentity,
    certificate_identity,
    issued_by_any,
    peer_identity,
    peer_node_name,
    peer_serial,
)

from .conftest import CLUSTER, CertSet

SENDER = UniqueAddress(Address("10.0.0.1", 25520), "node-a", 7)


def cert_with(*san: tuple[str, str]) -> dict[str, Any]:
    """The shape ``SSLSocket.getpeercert()`` returns, reduced to the SAN."""
    return {"subject": ((("commonName", "x"),),), "subjectAltName": san}


def test_peer_node_name_reads_the_node_from_the_cluster_uri() -> None:
    cert = cert_with(
        ("DNS", "node-a.example"),
        ("URI", "https://example.com/"),
        ("URI", "p2pshard://elsewhere/node-z"),
        ("URI", f"p2pshard://{CLUSTER}/node-a"),
    )
    assert peer_node_name(cert, CLUSTER) == "node-a"


@pytest.mark.parametrize("cert", [None, {}], ids=["none", "empty"])
def test_no_peer_certificate_is_refused(cert: dict[str, Any] | None) -> None:
    with pytest.raises(HandshakeError, match="peer presented no certificate"):
        peer_node_name(cert, CLUSTER)


def test_a_certificate_without_a_uri_is_refused() -> None:
    with pytest.raises(HandshakeError, match=r"no p2pshard:// SAN URI \(URIs: none\)"):
        peer_node_name(cert_with(("DNS", "node-a")), CLUSTER)
    with pytest.raises(HandshakeError, match="no p2pshard:// SAN URI"):
        peer_node_name({"subject": ()}, CLUSTER)


def test_a_uri_of_another_scheme_is_refused_and_shown() -> None:
    with pytest.raises(HandshakeError, match=r"no p2pshard:// SAN URI \(URIs: \['spiffe://"):
        peer_node_name(cert_with(("URI", f"spiffe://{CLUSTER}/node-a")), CLUSTER)


def test_a_certificate_for_another_cluster_is_refused() -> None:
    with pytest.raises(
        HandshakeError,
        match=f"certificate is for p2pshard://shop/node-a, not for cluster '{CLUSTER}'",
    ):
        peer_node_name(cert_with(("URI", "p2pshard://shop/node-a")), CLUSTER)


@pytest.mark.parametrize("node", ["", "bad name", "x" * 64])
def test_an_invalid_node_name_in_the_uri_is_refused(node: str) -> None:
    uri = f"p2pshard://{CLUSTER}/{node}"
    with pytest.raises(HandshakeError, match=f"node name {node!r} is invalid") as info:
        peer_node_name(cert_with(("URI", uri)), CLUSTER)
    assert repr(uri) in str(info.value)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("node-a", PeerIdentity(IdentityKind.NODE, "node-a")),
        ("node/node-a", PeerIdentity(IdentityKind.NODE, "node-a")),
        ("client/ops", PeerIdentity(IdentityKind.CLIENT, "ops")),
        ("admin/alice", PeerIdentity(IdentityKind.ADMIN, "alice")),
    ],
)
def test_the_uri_names_the_kind_and_the_name(path: str, expected: PeerIdentity) -> None:
    cert = cert_with(("URI", f"p2pshard://{CLUSTER}/{path}"))
    assert peer_identity(cert, CLUSTER) == expected
    assert parse_identity_uri(identity_uri(CLUSTER, expected)) == (CLUSTER, expected)


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("root/alice", "names the kind 'root'; known kinds: node, client, admin"),
        ("a/b/c", "is not p2pshard://<cluster>/<node> or p2pshard://<cluster>/<kind>/<name>"),
        ("client/bad name", "client name 'bad name' is invalid"),
        ("admin/", "admin name '' is invalid"),
    ],
)
def test_a_malformed_identity_uri_is_refused_with_the_reason(path: str, error: str) -> None:
    with pytest.raises(HandshakeError, match=re.escape(error)):
        peer_identity(cert_with(("URI", f"p2pshard://{CLUSTER}/{path}")), CLUSTER)


@pytest.mark.parametrize("kind", [IdentityKind.CLIENT, IdentityKind.ADMIN])
def test_a_node_never_takes_a_client_or_admin_certificate_for_a_node(kind: IdentityKind) -> None:
    uri = identity_uri(CLUSTER, PeerIdentity(kind, "node-a"))
    with pytest.raises(HandshakeError, match=f"is a {kind.value} identity"):
        peer_node_name(cert_with(("URI", uri)), CLUSTER)


@pytest.mark.parametrize("side", ["server_context", "client_context"])
def test_contexts_require_tls_1_3_and_a_peer_certificate(certs: CertSet, side: str) -> None:
    context: ssl.SSLContext = getattr(certs.identity("node-a"), side)()
    assert context.minimum_version is ssl.TLSVersion.TLSv1_3
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert not context.check_hostname


@pytest.mark.parametrize("which", [0, 1, 2], ids=["ca", "cert", "key"])
def test_a_missing_file_is_a_configuration_error_naming_it(
    certs: CertSet, tmp_path: Path, which: int
) -> None:
    good = certs.identity("node-a")
    files = [good.ca_file, good.cert_file, good.key_file]
    files[which] = missing = tmp_path / "missing.pem"
    with pytest.raises(
        ConfigurationError, match=re.escape(f"file {str(missing)!r} does not exist")
    ):
        TlsIdentity(CLUSTER, *files).server_context()


def test_a_key_that_does_not_match_the_certificate_is_a_configuration_error(
    certs: CertSet,
) -> None:
    identity = attrs.evolve(certs.identity("node-a"), key_file=certs.identity("node-b").key_file)
    with pytest.raises(ConfigurationError, match=r"cannot load certificate .* with key"):
        identity.client_context()


def test_a_ca_file_that_is_not_a_certificate_is_a_configuration_error(
    certs: CertSet, tmp_path: Path
) -> None:
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate")
    identity = attrs.evolve(certs.identity("node-a"), ca_file=garbage)
    with pytest.raises(
        ConfigurationError, match=re.escape(f"cannot load the CA file {str(garbage)!r}")
    ):
        identity.server_context()


def test_an_identity_with_an_invalid_cluster_name_is_refused(certs: CertSet) -> None:
    identity = certs.identity("node-a")
    with pytest.raises(ConfigurationError, match="cluster name 'no such' is invalid"):
        attrs.evolve(identity, cluster="no such")


def test_check_hello_accepts_the_right_hello() -> None:
    hello = Hello(cluster=CLUSTER, sender=SENDER)
    assert check_hello(hello, cluster=CLUSTER, certificate_name="node-a") == SENDER


def test_check_hello_refuses_anything_but_a_hello() -> None:
    with pytest.raises(HandshakeError, match="expected a Hello first, got HelloAck"):
        check_hello(HelloAck(sender=SENDER), cluster=CLUSTER, certificate_name="node-a")


def test_check_hello_refuses_another_cluster() -> None:
    hello = Hello(cluster="shop", sender=SENDER)
    with pytest.raises(HandshakeError, match=f"cluster 'shop', not '{CLUSTER}'"):
        check_hello(hello, cluster=CLUSTER, certificate_name="node-a")


def test_check_hello_refuses_a_name_other_than_the_certificates() -> None:
    hello = Hello(cluster=CLUSTER, sender=SENDER)
    with pytest.raises(
        HandshakeError, match="names node 'node-a' but the certificate is for 'node-b'"
    ):
        check_hello(hello, cluster=CLUSTER, certificate_name="node-b")


# --- several trusted CAs ---------------------------------------------------------------------


def der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(
        serialization.Encoding.DER
    )


def test_a_bundle_and_extra_ca_files_are_all_trusted(
    certs: CertSet, other_certs: CertSet, tmp_path: Path
) -> None:
    old, new = certs.root / "ca" / "ca.pem", other_certs.root / "ca" / "ca.pem"
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(old.read_bytes() + new.read_bytes())
    own = certs.identity("node-a")
    for identity in (
        attrs.evolve(own, ca_file=bundle),
        attrs.evolve(own, ca_file=old, ca_files=(new,)),
    ):
        trusted = identity.trusted_certificates()
        assert len(trusted) == 2
        assert identity.server_context().cert_store_stats()["x509_ca"] == 2
        # Both CAs are trusted; the old one alone trusts only its own certificates.
        assert issued_by_any(der(certs.identity("node-b").cert_file), trusted)
        assert issued_by_any(der(other_certs.identity("node-b").cert_file), trusted)
    only_old = own.trusted_certificates()
    assert len(only_old) == 1
    assert not issued_by_any(der(other_certs.identity("node-b").cert_file), only_old)


def test_ca_files_are_paths_and_each_must_exist(certs: CertSet, tmp_path: Path) -> None:
    identity = attrs.evolve(certs.identity("node-a"), ca_files=[str(tmp_path / "missing.pem")])
    assert identity.ca_files == (tmp_path / "missing.pem",)
    assert identity.trust_files == (identity.ca_file, tmp_path / "missing.pem")
    message = f"TLS CA file {str(tmp_path / 'missing.pem')!r} does not exist"
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        identity.client_context()
    with pytest.raises(ConfigurationError, match="cannot read the CA file"):
        identity.trusted_certificates()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(
        ConfigurationError, match=re.escape(f"cannot load the CA file {str(garbage)!r}")
    ):
        attrs.evolve(identity, ca_files=(garbage,)).trusted_certificates()


# --- what a certificate file says of itself ---------------------------------------------------


@pytest.mark.parametrize("kind", list(IdentityKind))
def test_certificate_identity_reads_the_kind_and_name_from_the_file(
    certs: CertSet, kind: IdentityKind
) -> None:
    identity = certs.identity("ops", kind=kind)
    assert certificate_identity(identity.cert_file, CLUSTER) == PeerIdentity(kind, "ops")
    assert identity.certificate_identity() == PeerIdentity(kind, "ops")


def test_certificate_identity_refuses_another_cluster_or_no_certificate(
    certs: CertSet, tmp_path: Path
) -> None:
    other = certs.identity("n", cluster="other")
    with pytest.raises(
        ConfigurationError,
        match=re.escape(
            f"the certificate {str(other.cert_file)!r} is not usable: it is for "
            f"p2pshard://other/n, not for cluster '{CLUSTER}'"
        ),
    ):
        certificate_identity(other.cert_file, CLUSTER)
    with pytest.raises(ConfigurationError, match="cannot read the certificate"):
        certificate_identity(tmp_path / "missing.pem", CLUSTER)
    (tmp_path / "x.pem").write_text("nope")
    with pytest.raises(ConfigurationError, match="is not a PEM certificate"):
        certificate_identity(tmp_path / "x.pem", CLUSTER)


def test_peer_serial_reads_the_hex_serial() -> None:
    assert peer_serial({"serialNumber": "0A1B"}) == 0x0A1B
    for bad in (None, {}, {"serialNumber": "xyz"}):
        with pytest.raises(HandshakeError, match="no readable serial number"):
            peer_serial(bad)


# --- deny lists --------------------------------------------------------------------------------

ALICE = PeerIdentity(IdentityKind.ADMIN, "alice")
NODE_7 = PeerIdentity(IdentityKind.NODE, "node-7")


def test_a_deny_list_names_serials_and_identities() -> None:
    deny = DenyList.parse(["serial:0A:1B:2c", "serial:ff", "admin:alice", "node:node-7"])
    assert deny.serials == {0x0A1B2C, 0xFF}
    assert deny.identities == {ALICE, NODE_7}
    assert deny.entries() == ("serial:ff", "serial:a1b2c", "admin:alice", "node:node-7")
    assert len(deny) == 4
    assert DenyList.parse(deny.entries()) == deny


def test_a_deny_list_refuses_by_serial_or_by_identity_and_says_which_entry() -> None:
    deny = DenyList.parse(["serial:a1b2c", "admin:alice"])
    assert deny.reason(ALICE, 5) == (
        "admin:alice (certificate serial 5) is denied by the entry 'admin:alice'"
    )
    assert deny.reason(NODE_7, 0xA1B2C) == (
        "node:node-7 (certificate serial a1b2c) is denied by the entry 'serial:a1b2c'"
    )
    assert deny.reason(NODE_7, 5) is None
    # The kind is part of the identity: a client named alice is not the admin alice.
    assert deny.reason(PeerIdentity(IdentityKind.CLIENT, "alice"), 5) is None
    assert DenyList().reason(ALICE, 5) is None


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ("alice", "expected 'serial:<hex>' (a certificate's serial number) or '<kind>:<name>'"),
        ("root:alice", "(kind node, client, admin)"),
        ("serial:", "a serial is hexadecimal digits"),
        ("serial:0x1f", "a serial is hexadecimal digits"),
        ("serial:xyz", "a serial is hexadecimal digits"),
        ("admin:", "admin name '' is invalid"),
        ("node:bad name", "node name 'bad name' is invalid"),
    ],
)
def test_a_bad_deny_entry_is_refused_naming_it(entry: str, error: str) -> None:
    with pytest.raises(
        ConfigurationError, match=re.escape(f"deny entry {entry!r} is invalid")
    ) as info:
        DenyList.parse(["admin:ok", entry])
    assert error in str(info.value)
