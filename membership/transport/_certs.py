"""Cluster certificates: a CA per cluster, and a key and certificate per identity.

A certificate carries one SAN URI naming its identity (``p2pshard://<cluster>/<node>`` for a
node, ``p2pshard://<cluster>/<kind>/<name>`` for a client or an admin, see ``_identity``); after
the TLS handshake each side checks that URI against its own cluster name (see ``_tls``), so a
certificate from the same CA issued for another cluster does not get in. Keys are ECDSA P-256;
private keys are written with mode 0600 and never overwritten silently.

Two ways to issue one. On the CA's machine, :func:`create_certificate` makes the key and the
certificate at once (``p2pshard certs node|client|admin``): right for a test cluster, but the key
must then travel to where it is used. Otherwise the key never leaves the machine that uses it:
:func:`create_signing_request` makes the key and a signing request there (``p2pshard certs
request``), the request travels to the CA's machine, :func:`sign_request` checks it and signs it
(``p2pshard certs sign``), and the certificate travels back. The CA's key stays on its machine
in both ways. A request is checked before it is signed (its signature, and that it asks for
exactly one identity of the CA's cluster and nothing else), and the certificate is built from
what was checked, never by copying the request's extensions.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ._address import check_name
from ._errors import ConfigurationError, HandshakeError
from ._identity import URI_SCHEME, IdentityKind, PeerIdentity, identity_uri, parse_identity_uri

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
NODE_CERT = "node.pem"
NODE_KEY = "node-key.pem"
REQUEST_SUFFIX = ".csr"
_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)
_MIN_RSA_BITS = 2048
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


def identity_file_names(kind: IdentityKind) -> tuple[str, str]:
    """The names of an identity's certificate and key files, by its kind.

    ``node.pem`` and ``node-key.pem`` for a node, ``client.pem`` and ``client-key.pem`` for a
    client, ``admin.pem`` and ``admin-key.pem`` for an admin.
    """
    return f"{kind.value}.pem", f"{kind.value}-key.pem"


@attrs.frozen
class NodeFiles:
    """Where an identity's certificate, key and a copy of the CA certificate were written.

    ``node`` is the identity's name (a node's, a client's or an admin's; ``kind`` says which).
    """

    cluster: str
    node: str
    ca_file: Path
    cert_file: Path
    key_file: Path
    kind: IdentityKind = IdentityKind.NODE
    serial: int = 0
    """The certificate's serial number (``serial:<hex>`` in a deny list names it)."""


@attrs.frozen
class RequestFiles:
    """Where :func:`create_signing_request` wrote a key and its signing request."""

    cluster: str
    identity: PeerIdentity
    request_file: Path
    key_file: Path


@attrs.frozen
class SignedCertificate:
    """What :func:`sign_request` signed, and where it wrote the certificate."""

    cluster: str
    identity: PeerIdentity
    serial: int
    """The certificate's serial number (``serial:<hex>`` in a deny list names it)."""
    not_valid_after: datetime.datetime
    key_description: str
    """The requester's public key, e.g. ``"ECDSA P-256"``."""
    cert_file: Path
    ca_file: Path
    """The CA certificate that signed it: the requester needs a copy to trust the cluster."""

    @property
    def uri(self) -> str:
        """The SAN URI the certificate carries."""
        return identity_uri(self.cluster, self.identity)


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

    For local use, where the CA is: the key is made here too. Writes the certificate and the key
    (mode 0600) under the names :func:`identity_file_names` gives (``node.pem`` and
    ``node-key.pem`` for a node, ``client.pem``... for a client) and a copy of ``ca.pem`` into
    ``out_dir``; the certificate's SAN URI names the identity's kind and name (see
    ``membership.transport._identity``). The cluster name defaults to the one the CA was made for.

    Example:
        >>> ops = PeerIdentity(IdentityKind.CLIENT, "ops")
        >>> create_certificate(ops, Path("certs/ca"), Path("certs/ops"))  # doctest: +SKIP
    """
    _check_days(days)
    ca_cert, ca_key, cluster = _load_ca_for(ca_dir, cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(ca_cert, ca_key, cluster, identity, key.public_key(), days)
    cert_name, key_name = identity_file_names(identity.kind)
    files = NodeFiles(
        cluster,
        identity.name,
        out_dir / CA_CERT,
        out_dir / cert_name,
        out_dir / key_name,
        identity.kind,
        cert.serial_number,
    )
    _write_private(files.key_file, _key_pem(key), force=force)
    _write_public(files.cert_file, cert.public_bytes(serialization.Encoding.PEM), force=force)
    if files.ca_file.resolve() != (ca_dir / CA_CERT).resolve():
        _write_public(files.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM), force=True)
    return files


def create_signing_request(
    identity: PeerIdentity, out_dir: Path, *, cluster: str, force: bool = False
) -> RequestFiles:
    """Make a key and a certificate signing request for ``identity``, on the machine that uses it.

    Writes the key (mode 0600; ``node-key.pem``, ``client-key.pem`` or ``admin-key.pem``) and the
    request (``node.csr``, ``client.csr`` or ``admin.csr``, PEM) into ``out_dir``. The request
    names the identity in the SAN URI its certificate will carry; take it to the CA's machine
    and sign it with :func:`sign_request`. The key never has to leave this machine.

    Example:
        >>> alice = PeerIdentity(IdentityKind.ADMIN, "alice")
        >>> create_signing_request(alice, Path("certs/alice"), cluster="shop")  # doctest: +SKIP
    """
    check_name("cluster name", cluster)
    cert_name, key_name = identity_file_names(identity.kind)
    files = RequestFiles(
        cluster,
        identity,
        out_dir / (cert_name.removesuffix(".pem") + REQUEST_SUFFIX),
        out_dir / key_name,
    )
    if files.request_file.exists() and not force:
        raise ConfigurationError(
            f"{files.request_file} already exists (pass force=True / --force to replace it)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_subject(cluster, identity))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(identity_uri(cluster, identity))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    _write_private(files.key_file, _key_pem(key), force=force)
    _write_public(files.request_file, request.public_bytes(serialization.Encoding.PEM), force=force)
    return files


def check_signing_request(request: x509.CertificateSigningRequest, cluster: str) -> PeerIdentity:
    """The identity a signing request asks for, if the CA of ``cluster`` may sign it.

    A request passes if its signature verifies with its own key (it was made with that key and
    not altered since), its key is ECDSA (P-256, P-384 or P-521), RSA of at least 2048 bits,
    Ed25519 or Ed448, its subjectAltName is exactly one ``p2pshard://`` URI naming a valid
    identity of ``cluster``, its subject (if it has one) names the same, and it asks for no
    extension but that one (and ``basicConstraints`` without CA). What a certificate may do is
    decided by the cluster, not by the requester.

    Raises:
        ConfigurationError: the reason the request is refused.
    """
    if not request.is_signature_valid:
        raise ConfigurationError(
            "its signature does not verify with its own key: it was altered after it was made, "
            "or it is not a signing request"
        )
    _issuable(request.public_key())  # refuses weak or unknown keys
    try:
        extensions = list(request.extensions)
    except (ValueError, x509.DuplicateExtension, x509.UnsupportedGeneralNameType) as exc:
        raise ConfigurationError(f"its extensions cannot be read: {exc}") from None
    san: x509.SubjectAlternativeName | None = None
    for extension in extensions:
        value = extension.value
        if isinstance(value, x509.SubjectAlternativeName):
            san = value
        elif isinstance(value, x509.BasicConstraints) and not value.ca:
            continue
        else:
            name = getattr(extension.oid, "_name", None) or extension.oid.dotted_string
            raise ConfigurationError(
                f"it asks for the extension {name}, which p2pshard certificates do not take "
                "from a request: make the request with 'p2pshard certs request'"
            )
    if san is None:
        raise ConfigurationError(
            f"it names no identity: it has no subjectAltName with a {URI_SCHEME}:// URI"
        )
    entries = list(san)
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    if len(entries) != 1 or len(uris) != 1:
        shown = ", ".join(_general_name(e) for e in entries) or "nothing"
        raise ConfigurationError(
            f"its subjectAltName must be exactly one {URI_SCHEME}:// URI, but it names {shown}"
        )
    try:
        request_cluster, identity = parse_identity_uri(uris[0])
    except HandshakeError as exc:
        raise ConfigurationError(f"its identity is not valid: {exc}") from None
    if request_cluster != cluster:
        raise ConfigurationError(
            f"it is for cluster {request_cluster!r} ({uris[0]}), but this CA signs for cluster "
            f"{cluster!r}"
        )
    for oid, expected, what in (
        (NameOID.COMMON_NAME, identity.name, "common name"),
        (NameOID.ORGANIZATION_NAME, cluster, "organization"),
    ):
        for attribute in request.subject.get_attributes_for_oid(oid):
            if attribute.value != expected:
                raise ConfigurationError(
                    f"its subject's {what} {attribute.value!r} does not match its URI {uris[0]}"
                )
    return identity


def sign_request(
    request_file: Path,
    ca_dir: Path,
    out_file: Path,
    *,
    cluster: str | None = None,
    days: int = 825,
    force: bool = False,
) -> SignedCertificate:
    """Check a signing request (see :func:`check_signing_request`) and sign it with the CA.

    Writes the certificate (PEM) to ``out_file``; nothing is written if the request is refused.
    The certificate is valid for ``days`` (at most until the CA expires) and carries the
    requested identity only. The cluster defaults to the one the CA was made for.

    Example:
        >>> signed = sign_request(  # doctest: +SKIP
        ...     Path("alice.csr"), Path("certs/ca"), Path("alice.pem")
        ... )
        >>> print(signed.uri, hex(signed.serial))  # doctest: +SKIP

    Raises:
        ConfigurationError: the request cannot be read or is refused (the message says why),
            the CA cannot be read, or ``out_file`` exists and ``force`` is not set.
    """
    _check_days(days)
    try:
        data = request_file.read_bytes()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the signing request {request_file}: {exc.strerror or exc}"
        ) from None
    try:
        request = x509.load_pem_x509_csr(data)
    except ValueError:
        try:
            request = x509.load_der_x509_csr(data)
        except ValueError:
            raise ConfigurationError(
                f"{request_file} is not a certificate signing request (PEM or DER)"
            ) from None
    ca_cert, ca_key, cluster = _load_ca_for(ca_dir, cluster)
    try:
        identity = check_signing_request(request, cluster)
    except ConfigurationError as exc:
        raise ConfigurationError(f"refusing to sign {request_file}: {exc}") from None
    if out_file.exists() and not force:
        raise ConfigurationError(
            f"{out_file} already exists (pass force=True / --force to replace it)"
        )
    public_key, key_description = _issuable(request.public_key())
    cert = _issue(ca_cert, ca_key, cluster, identity, public_key, days)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    _write_public(out_file, cert.public_bytes(serialization.Encoding.PEM), force=True)
    return SignedCertificate(
        cluster=cluster,
        identity=identity,
        serial=cert.serial_number,
        not_valid_after=cert.not_valid_after_utc,
        key_description=key_description,
        cert_file=out_file,
        ca_file=ca_dir / CA_CERT,
    )


# --- helpers -------------------------------------------------------------------------------------

_IssuableKey = (
    ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey | ed448.Ed448PublicKey
)


def _check_days(days: int) -> None:
    if days < 1:
        raise ConfigurationError(f"days = {days!r} is invalid: must be at least 1")


def _load_ca_for(
    ca_dir: Path, cluster: str | None
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    """The CA, and the cluster to sign for: ``cluster`` if given, else the CA's."""
    ca_cert, ca_key, ca_cluster = load_cluster_ca(ca_dir)
    if cluster is None:
        cluster = ca_cluster
        if not cluster:
            raise ConfigurationError(
                f"the CA in {ca_dir} does not name a cluster: pass the cluster name explicitly"
            )
    check_name("cluster name", cluster)
    return ca_cert, ca_key, cluster


def _subject(cluster: str, identity: PeerIdentity) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster),
        ]
    )


def _issuable(key: object) -> tuple[_IssuableKey, str]:
    """The key and how messages name it, if a certificate may carry it; else why not."""
    if isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, _CURVES):
            raise ConfigurationError(
                f"its key is on the curve {key.curve.name}; use P-256, P-384 or P-521"
            )
        return key, f"ECDSA P-{key.curve.key_size}"
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < _MIN_RSA_BITS:
            raise ConfigurationError(
                f"its key is RSA of {key.key_size} bits; at least {_MIN_RSA_BITS} are needed"
            )
        return key, f"RSA {key.key_size}"
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key, "Ed25519"
    if isinstance(key, ed448.Ed448PublicKey):
        return key, "Ed448"
    raise ConfigurationError(
        f"its key is a {type(key).__name__}; use ECDSA (P-256), RSA (2048 bits or more) or Ed25519"
    )


def _general_name(name: x509.GeneralName) -> str:
    labels = {
        x509.UniformResourceIdentifier: "URI",
        x509.DNSName: "DNS",
        x509.IPAddress: "IP",
        x509.RFC822Name: "email",
    }
    return f"{labels.get(type(name), type(name).__name__)}:{name.value}"


def _issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cluster: str,
    identity: PeerIdentity,
    public_key: _IssuableKey,
    days: int,
) -> x509.Certificate:
    """A certificate for ``identity`` in ``cluster`` with ``public_key``, signed by the CA."""
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(_subject(cluster, identity))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
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
