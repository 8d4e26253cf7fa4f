"""Cluster CA and certificates: files, key modes, SAN URIs, signing requests and refusals."""

from __future__ import annotations

import datetime
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from membership import ConfigurationError, IdentityKind, PeerIdentity
from membership.transport._certs import (
    CA_CERT,
    CA_KEY,
    CaFiles,
    create_certificate,
    create_cluster_ca,
    create_node_certificate,
    create_signing_request,
    load_cluster_ca,
    sign_request,
)
from membership.transport._tls import TlsIdentity

INVALID_NAMES = ["", "two words", "a/b", "x" * 64, "-leading-dash"]


@pytest.fixture
def ca(tmp_path: Path) -> CaFiles:
    return create_cluster_ca("shop", tmp_path / "ca")


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def san_uris(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_foreign_ca(ca_dir: Path, common_name: str) -> None:
    """A CA not made by ``create_cluster_ca``: only a common name in its subject."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    ca_dir.mkdir()
    (ca_dir / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (ca_dir / CA_KEY).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def test_the_ca_files_are_written_with_a_private_key_mode_0600(ca: CaFiles) -> None:
    assert (ca.cert_file.name, ca.key_file.name) == (CA_CERT, CA_KEY)
    assert mode(ca.key_file) == 0o600
    cert = load(ca.cert_file)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(cert)


def test_load_cluster_ca_reads_back_the_cluster_name(ca: CaFiles) -> None:
    cert, _key, cluster = load_cluster_ca(ca.cert_file.parent)
    assert cluster == "shop"
    assert cert == load(ca.cert_file)


def test_a_node_certificate_names_its_node_and_is_signed_by_the_ca(
    ca: CaFiles, tmp_path: Path
) -> None:
    files = create_node_certificate("node-1", ca.cert_file.parent, tmp_path / "node-1")
    assert (files.cluster, files.node) == ("shop", "node-1")
    assert mode(files.key_file) == 0o600
    cert = load(files.cert_file)
    assert san_uris(cert) == ["p2pshard://shop/node-1"]
    cert.verify_directly_issued_by(load(ca.cert_file))
    assert files.ca_file.read_bytes() == ca.cert_file.read_bytes()


def test_the_cluster_name_can_be_overridden(ca: CaFiles, tmp_path: Path) -> None:
    files = create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", cluster="other")
    assert files.cluster == "other"
    assert san_uris(load(files.cert_file)) == ["p2pshard://other/n"]


def test_an_existing_ca_key_is_not_overwritten_without_force(ca: CaFiles) -> None:
    key = ca.key_file.read_bytes()
    with pytest.raises(
        ConfigurationError, match=re.escape(f"{ca.key_file} already exists; refusing")
    ):
        create_cluster_ca("shop", ca.cert_file.parent)
    assert ca.key_file.read_bytes() == key


def test_an_existing_node_key_is_not_overwritten_without_force(ca: CaFiles, tmp_path: Path) -> None:
    files = create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")
    key = files.key_file.read_bytes()
    with pytest.raises(ConfigurationError, match="already exists; refusing to overwrite"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")
    assert files.key_file.read_bytes() == key


def test_force_replaces_the_keys_and_keeps_mode_0600(ca: CaFiles, tmp_path: Path) -> None:
    old_ca_key = ca.key_file.read_bytes()
    ca.key_file.chmod(0o644)
    create_cluster_ca("shop", ca.cert_file.parent, force=True)
    assert ca.key_file.read_bytes() != old_ca_key
    assert mode(ca.key_file) == 0o600

    files = create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")
    old_node_key = files.key_file.read_bytes()
    create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", force=True)
    assert files.key_file.read_bytes() != old_node_key
    assert mode(files.key_file) == 0o600
    load(files.cert_file).verify_directly_issued_by(load(ca.cert_file))


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_an_invalid_cluster_name_is_refused_naming_it(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"cluster name {name!r} is invalid"):
        create_cluster_ca(name, tmp_path / "ca")
    assert not (tmp_path / "ca").exists()


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_an_invalid_node_name_is_refused_naming_it(name: str, ca: CaFiles, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"node name {name!r} is invalid"):
        create_node_certificate(name, ca.cert_file.parent, tmp_path / "n")


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_an_invalid_cluster_override_is_refused_naming_it(
    name: str, ca: CaFiles, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match=f"cluster name {name!r} is invalid"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", cluster=name)


def test_63_character_names_are_accepted(tmp_path: Path) -> None:
    long = "c" * 63
    assert create_cluster_ca(long, tmp_path / "ca").cluster == long
    files = create_node_certificate("n" * 63, tmp_path / "ca", tmp_path / "n")
    assert san_uris(load(files.cert_file)) == [f"p2pshard://{long}/{'n' * 63}"]


def test_a_ca_named_in_its_common_name_still_gives_its_cluster(tmp_path: Path) -> None:
    write_foreign_ca(tmp_path / "ca", "p2pshard cluster CA shop")  # the CN-only format
    assert load_cluster_ca(tmp_path / "ca")[2] == "shop"
    assert create_node_certificate("n", tmp_path / "ca", tmp_path / "n").cluster == "shop"


def test_a_foreign_ca_needs_the_cluster_name_passed(tmp_path: Path) -> None:
    write_foreign_ca(tmp_path / "ca", "Acme Root CA")
    with pytest.raises(ConfigurationError, match="does not name a cluster"):
        create_node_certificate("n", tmp_path / "ca", tmp_path / "n")
    files = create_node_certificate("n", tmp_path / "ca", tmp_path / "n", cluster="shop")
    load(files.cert_file).verify_directly_issued_by(load(tmp_path / "ca" / CA_CERT))


def test_a_missing_ca_dir_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot read the cluster CA in .*nowhere"):
        create_node_certificate("n", tmp_path / "nowhere", tmp_path / "n")
    assert not (tmp_path / "n").exists()


def test_a_ca_dir_with_garbage_files_is_a_configuration_error(ca: CaFiles, tmp_path: Path) -> None:
    ca.cert_file.write_bytes(b"not a certificate")
    with pytest.raises(ConfigurationError, match="cannot read the cluster CA"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")


def test_days_below_one_are_refused(ca: CaFiles, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="days = 0 is invalid"):
        create_cluster_ca("shop", tmp_path / "ca2", days=0)
    with pytest.raises(ConfigurationError, match="days = 0 is invalid"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", days=0)


# --- certificates of every kind, made where the CA is -------------------------------------------


@pytest.mark.parametrize("kind", list(IdentityKind))
def test_a_certificate_of_each_kind_is_named_after_its_kind(
    kind: IdentityKind, ca: CaFiles, tmp_path: Path
) -> None:
    files = create_certificate(PeerIdentity(kind, "ops"), ca.cert_file.parent, tmp_path / "ops")
    assert (files.cert_file.name, files.key_file.name) == (
        f"{kind.value}.pem",
        f"{kind.value}-key.pem",
    )
    assert files.kind is kind
    assert files.serial == load(files.cert_file).serial_number
    assert mode(files.key_file) == 0o600
    expected = (
        "p2pshard://shop/ops" if kind is IdentityKind.NODE else f"p2pshard://shop/{kind.value}/ops"
    )
    assert san_uris(load(files.cert_file)) == [expected]
    load(files.cert_file).verify_directly_issued_by(load(ca.cert_file))


# --- signing requests: the key stays where it is used -------------------------------------------


@pytest.mark.parametrize("kind", list(IdentityKind))
def test_a_request_holds_the_identity_and_its_key_stays_private(
    kind: IdentityKind, tmp_path: Path
) -> None:
    identity = PeerIdentity(kind, "alice")
    files = create_signing_request(identity, tmp_path / "alice", cluster="shop")
    assert (files.request_file.name, files.key_file.name) == (
        f"{kind.value}.csr",
        f"{kind.value}-key.pem",
    )
    assert mode(files.key_file) == 0o600
    request = x509.load_pem_x509_csr(files.request_file.read_bytes())
    assert request.is_signature_valid
    san = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    expected = (
        "p2pshard://shop/alice"
        if kind is IdentityKind.NODE
        else f"p2pshard://shop/{kind.value}/alice"
    )
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [expected]
    assert request.subject.rfc4514_string() == "O=shop,CN=alice"
    key = serialization.load_pem_private_key(files.key_file.read_bytes(), password=None)
    assert request.public_key() == key.public_key()


def test_a_request_does_not_overwrite_a_key_or_a_request_without_force(tmp_path: Path) -> None:
    identity = PeerIdentity(IdentityKind.ADMIN, "alice")
    files = create_signing_request(identity, tmp_path, cluster="shop")
    key, request = files.key_file.read_bytes(), files.request_file.read_bytes()
    with pytest.raises(ConfigurationError, match=r"admin\.csr already exists"):
        create_signing_request(identity, tmp_path, cluster="shop")
    files.request_file.unlink()
    with pytest.raises(ConfigurationError, match=r"admin-key\.pem already exists; refusing"):
        create_signing_request(identity, tmp_path, cluster="shop")
    assert files.key_file.read_bytes() == key
    assert not files.request_file.exists()
    again = create_signing_request(identity, tmp_path, cluster="shop", force=True)
    assert again.key_file.read_bytes() != key
    assert again.request_file.read_bytes() != request


@pytest.mark.parametrize("cluster", INVALID_NAMES, ids=repr)
def test_a_request_for_an_invalid_cluster_name_is_refused(cluster: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"cluster name {cluster!r} is invalid"):
        create_signing_request(
            PeerIdentity(IdentityKind.NODE, "n"), tmp_path / "n", cluster=cluster
        )
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("kind", list(IdentityKind))
def test_a_signed_request_gives_a_certificate_for_the_requesters_key(
    kind: IdentityKind, ca: CaFiles, tmp_path: Path
) -> None:
    requested = create_signing_request(
        PeerIdentity(kind, "alice"), tmp_path / "alice", cluster="shop"
    )
    out = tmp_path / "alice" / f"{kind.value}.pem"
    signed = sign_request(requested.request_file, ca.cert_file.parent, out, days=30)
    assert (signed.cluster, signed.identity) == ("shop", PeerIdentity(kind, "alice"))
    assert signed.key_description == "ECDSA P-256"
    assert signed.cert_file == out
    assert signed.ca_file == ca.cert_file
    cert = load(out)
    cert.verify_directly_issued_by(load(ca.cert_file))
    assert san_uris(cert) == [signed.uri]
    assert cert.serial_number == signed.serial
    assert cert.not_valid_after_utc == signed.not_valid_after
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30
    assert (
        cert.public_key()
        == x509.load_pem_x509_csr(requested.request_file.read_bytes()).public_key()
    )
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    # The certificate and the key that never left the requester's directory make a TLS identity.
    TlsIdentity("shop", ca.cert_file, out, requested.key_file).client_context()


def test_a_request_in_der_form_is_signed_too(ca: CaFiles, tmp_path: Path) -> None:
    requested = create_signing_request(
        PeerIdentity(IdentityKind.NODE, "n"), tmp_path, cluster="shop"
    )
    der = tmp_path / "n.der"
    der.write_bytes(
        x509.load_pem_x509_csr(requested.request_file.read_bytes()).public_bytes(
            serialization.Encoding.DER
        )
    )
    signed = sign_request(der, ca.cert_file.parent, tmp_path / "n.pem")
    assert signed.uri == "p2pshard://shop/n"


def test_signing_does_not_overwrite_a_certificate_without_force(
    ca: CaFiles, tmp_path: Path
) -> None:
    requested = create_signing_request(
        PeerIdentity(IdentityKind.NODE, "n"), tmp_path, cluster="shop"
    )
    out = tmp_path / "node.pem"
    first = sign_request(requested.request_file, ca.cert_file.parent, out)
    with pytest.raises(ConfigurationError, match=r"node\.pem already exists"):
        sign_request(requested.request_file, ca.cert_file.parent, out)
    assert load(out).serial_number == first.serial
    second = sign_request(requested.request_file, ca.cert_file.parent, out, force=True)
    assert load(out).serial_number == second.serial != first.serial


def make_request(
    *sans: x509.GeneralName,
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | None = None,
    subject: x509.Name | None = None,
    extensions: tuple[x509.ExtensionType, ...] = (),
) -> x509.CertificateSigningRequest:
    """A signing request as another tool might make it."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(subject or x509.Name([]))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(key or ec.generate_private_key(ec.SECP256R1()), hashes.SHA256())


def uri(text: str) -> x509.UniformResourceIdentifier:
    return x509.UniformResourceIdentifier(text)


REFUSED = [
    ("no SAN", make_request(), "it names no identity: it has no subjectAltName"),
    (
        "another cluster",
        make_request(uri("p2pshard://other/admin/alice")),
        "it is for cluster 'other' (p2pshard://other/admin/alice), but this CA signs for "
        "cluster 'shop'",
    ),
    (
        "a DNS name too",
        make_request(uri("p2pshard://shop/n"), x509.DNSName("n.example")),
        "exactly one p2pshard:// URI, but it names URI:p2pshard://shop/n, DNS:n.example",
    ),
    (
        "two identities",
        make_request(uri("p2pshard://shop/n"), uri("p2pshard://shop/admin/n")),
        "exactly one p2pshard:// URI, but it names URI:p2pshard://shop/n, "
        "URI:p2pshard://shop/admin/n",
    ),
    (
        "another scheme",
        make_request(uri("spiffe://shop/n")),
        "its identity is not valid: 'spiffe://shop/n' is not a p2pshard:// URI",
    ),
    (
        "an unknown kind",
        make_request(uri("p2pshard://shop/root/alice")),
        "names the kind 'root'; known kinds: node, client, admin",
    ),
    (
        "a bad name",
        make_request(uri("p2pshard://shop/client/-x")),
        "client name '-x' is invalid",
    ),
    (
        "a CA",
        make_request(
            uri("p2pshard://shop/n"),
            extensions=(x509.BasicConstraints(ca=True, path_length=None),),
        ),
        "it asks for the extension basicConstraints, which p2pshard certificates do not take",
    ),
    (
        "key usage",
        make_request(
            uri("p2pshard://shop/n"),
            extensions=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]),),
        ),
        "it asks for the extension extendedKeyUsage",
    ),
    (
        "another subject",
        make_request(
            uri("p2pshard://shop/admin/alice"),
            subject=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mallory")]),
        ),
        "its subject's common name 'mallory' does not match its URI p2pshard://shop/admin/alice",
    ),
    (
        "a weak key",
        make_request(
            uri("p2pshard://shop/n"),
            key=rsa.generate_private_key(public_exponent=65537, key_size=1024),
        ),
        "its key is RSA of 1024 bits; at least 2048 are needed",
    ),
    (
        "an odd curve",
        make_request(uri("p2pshard://shop/n"), key=ec.generate_private_key(ec.SECP256K1())),
        "its key is on the curve secp256k1; use P-256, P-384 or P-521",
    ),
]


@pytest.mark.parametrize(
    ("request_", "reason"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_signing_refuses_a_request_naming_the_reason_and_writes_nothing(
    request_: x509.CertificateSigningRequest, reason: str, ca: CaFiles, tmp_path: Path
) -> None:
    path = tmp_path / "r.csr"
    path.write_bytes(request_.public_bytes(serialization.Encoding.PEM))
    out = tmp_path / "out.pem"
    with pytest.raises(ConfigurationError, match=re.escape(reason)) as info:
        sign_request(path, ca.cert_file.parent, out)
    assert str(info.value).startswith(f"refusing to sign {path}: ")
    assert not out.exists()


def test_signing_refuses_an_altered_request(ca: CaFiles, tmp_path: Path) -> None:
    requested = create_signing_request(
        PeerIdentity(IdentityKind.CLIENT, "ops"), tmp_path, cluster="shop"
    )
    request = x509.load_pem_x509_csr(requested.request_file.read_bytes())
    der = bytearray(request.public_bytes(serialization.Encoding.DER))
    # Turn the requested client into an admin, keeping the length: the signature no longer fits.
    at = der.index(b"client/ops")
    der[at : at + 10] = b"admin/opss"
    altered = tmp_path / "altered.csr"
    altered.write_bytes(bytes(der))
    with pytest.raises(ConfigurationError, match="its signature does not verify with its own key"):
        sign_request(altered, ca.cert_file.parent, tmp_path / "out.pem")
    assert not (tmp_path / "out.pem").exists()


def test_signing_a_file_that_is_no_request_says_so(ca: CaFiles, tmp_path: Path) -> None:
    garbage = tmp_path / "g.csr"
    garbage.write_text("-----BEGIN CERTIFICATE REQUEST-----\nnope\n")
    with pytest.raises(ConfigurationError, match="is not a certificate signing request"):
        sign_request(garbage, ca.cert_file.parent, tmp_path / "out.pem")
    with pytest.raises(ConfigurationError, match=r"cannot read the signing request .*missing\.csr"):
        sign_request(tmp_path / "missing.csr", ca.cert_file.parent, tmp_path / "out.pem")


def test_signing_with_a_missing_ca_is_a_configuration_error(tmp_path: Path) -> None:
    requested = create_signing_request(
        PeerIdentity(IdentityKind.NODE, "n"), tmp_path, cluster="shop"
    )
    with pytest.raises(ConfigurationError, match="cannot read the cluster CA"):
        sign_request(requested.request_file, tmp_path / "no-ca", tmp_path / "out.pem")
