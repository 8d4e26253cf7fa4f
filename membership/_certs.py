"""Cluster certificates: a CA per cluster, and a key and certificate per node.

A node certificate carries the SAN URI ``p2pshard://<cluster>/<node>``; after the TLS handshake
each side checks that URI against its own cluster name (see ``_tls``), so a certificate from the
same CA issued for another cluster does not get in. Keys are ECDSA P-256; private keys are written
with mode 0600 and never overwritten silently.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ._address import check_name
from ._errors import ConfigurationError
from ._identity import IdentityKind, PeerIdentity, identity_uri

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
NODE_CERT = "node.pem"
NODE_KEY = "node-key.pem"
_CA_COMMON_NAME = "p2pshard cluster CA"
_CA_NAME_PREFIX = _CA_COMMON_NAME + " "  # CAs made before the cluster name moved to O


def node_uri(cluster: str, node: str) -> str:
    """The SAN URI that identifies ``node`` of ``cluster``."""
    return identity_uri(cluster, PeerIdentity(IdentityKind.NODE, node))


@attrs.frozen
class CaFiles:
    """Where a cluster CA was written."""

    cluster: str
    cert_file: Path
    key_file: Path


@attrs.frozen
class NodeFiles:
    """Where a node's certificate, key and a copy of the CA certificate were written."""

    cluster: str
    node: str
    ca_file: Path
    cert_file: Path
    key_file: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes, *, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigurationError(
            f"{path} already exists; refusing to overwrite a private key (pass force=True / "
            "--force to replace it)"
        ) from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_public(path: Path, data: bytes, *, force: bool) -> None:
    if path.exists() and not force:
        raise ConfigurationError(f"{path} already exists (pass force=True / --force to replace it)")
    path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def create_cluster_ca(
    cluster: str, out_dir: Path, *, days: int = 3650, force: bool = False
) -> CaFiles:
    """Make a cluster CA in ``out_dir`` (``ca.pem`` and ``ca-key.pem``, the key mode 0600).

    Example:
        >>> ca = create_cluster_ca("shop", Path("certs/ca"))  # doctest: +SKIP
    """
    check_name("cluster name", cluster)
    if days < 1:
        raise ConfigurationError(f"days = {days!r} is invalid: must be at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    # The cluster name goes in O, as in node certificates: a CN holds at most 64 characters, too
    # few for a prefix plus a 63-character cluster name.
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, _CA_COMMON_NAME),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    files = CaFiles(cluster, out_dir / CA_CERT, out_dir / CA_KEY)
    _write_private(files.key_file, _key_pem(key), force=force)
    _write_public(files.cert_file, cert.public_bytes(serialization.Encoding.PEM), force=force)
    return files


def load_cluster_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    """Read a CA made by :func:`create_cluster_ca`: its certificate, key and cluster name."""
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the cluster CA in {ca_dir}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigurationError(f"{ca_dir / CA_KEY} is not an ECDSA key")
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common = str(names[0].value) if names else ""
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    if common == _CA_COMMON_NAME and orgs:
        cluster = str(orgs[0].value)
    else:
        cluster = common.removeprefix(_CA_NAME_PREFIX) if common.startswith(_CA_NAME_PREFIX) else ""
    return cert, key, cluster


def create_node_certificate(
    node: str,
    ca_dir: Path,
    out_dir: Path,
    *,
    cluster: str | None = None,
    days: int = 825,
    force: bool = False,
) -> NodeFiles:
    """Make a key and certificate for ``node``, signed by the CA in ``ca_dir``.

    Writes ``node.pem``, ``node-key.pem`` (mode 0600) and a copy of ``ca.pem`` into ``out_dir``.
    The cluster name defaults to the one the CA was made for.

    Example:
        >>> ca, out = Path("certs/ca"), Path("certs/node-1")
        >>> create_node_certificate("node-1", ca, out)  # doctest: +SKIP
    """
    return create_certificate(
        PeerIdentity(IdentityKind.NODE, node),
        ca_dir,
        out_dir,
        cluster=cluster,
        days=days,
        force=force,
    )


def create_certificate(
    identity: PeerIdentity,
    ca_dir: Path,
    out_dir: Path,
    *,
    cluster: str | None = None,
    days: int = 825,
    force: bool = False,
) -> NodeFiles:
    """Make a key and certificate for ``identity`` (a node, client or admin), signed by the CA.

    Writes ``node.pem``, ``node-key.pem`` (mode 0600) and a copy of ``ca.pem`` into ``out_dir``;
    the certificate's SAN URI names the identity's kind and name (see ``membership._identity``).
    The cluster name defaults to the one the CA was made for.

    Example:
        >>> ops = PeerIdentity(IdentityKind.CLIENT, "ops")
        >>> create_certificate(ops, Path("certs/ca"), Path("certs/ops"))  # doctest: +SKIP
    """
    node = identity.name
    if days < 1:
        raise ConfigurationError(f"days = {days!r} is invalid: must be at least 1")
    ca_cert, ca_key, ca_cluster = load_cluster_ca(ca_dir)
    if cluster is None:
        cluster = ca_cluster
        if not cluster:
            raise ConfigurationError(
                f"the CA in {ca_dir} does not name a cluster: pass the cluster name explicitly"
            )
    check_name("cluster name", cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, node),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(identity_uri(cluster, identity))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = NodeFiles(cluster, node, out_dir / CA_CERT, out_dir / NODE_CERT, out_dir / NODE_KEY)
    _write_private(files.key_file, _key_pem(key), force=force)
    _write_public(files.cert_file, cert.public_bytes(serialization.Encoding.PEM), force=force)
    if files.ca_file.resolve() != (ca_dir / CA_CERT).resolve():
        _write_public(files.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM), force=True)
    return files
