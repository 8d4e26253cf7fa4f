"""Mutual TLS 1.3 between nodes, and the identity checks that follow the handshake.

Both sides present a certificate signed by a cluster CA and require one from the peer (TLS 1.3
only). Host names are not checked: nodes are identified by the SAN URI ``p2pshard://<cluster>/
<node>`` instead (see ``_identity`` for clients and admins), which must name this cluster; that
keeps out a certificate the same CA issued for another cluster. Under TLS 1.3 the client finishes
its handshake before the server has judged the client certificate, so a refused client learns it
only as EOF on its first read.

Trust can change while a cluster runs. Several CA certificates may be trusted at once (``ca_file``
may be a bundle, and ``ca_files`` adds more): a link is accepted if any of them signed the
peer's certificate, so a cluster moves to a new CA by trusting both, re-issuing every
certificate, then dropping the old one. A :class:`DenyList` names certificates to refuse although
a trusted CA signed them: by serial number (one certificate) or by identity (every certificate of
that kind and name). The transport applies both after every handshake and again to its open links
when its settings are reloaded (``TcpTransport.reload_tls``).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ._address import check_name
from ._errors import ConfigurationError, HandshakeError
from ._identity import URI_SCHEME, IdentityKind, PeerIdentity, parse_identity_uri

_SERIAL = "serial"
_KINDS = ", ".join(k.value for k in IdentityKind)
_ENTRY_FORMS = f"'serial:<hex>' (a certificate's serial number) or '<kind>:<name>' (kind {_KINDS})"


def _path(value: Path | str) -> Path:
    return Path(value)


def _paths(values: Iterable[Path | str]) -> tuple[Path, ...]:
    return tuple(Path(v) for v in values)


def identity_text(identity: PeerIdentity) -> str:
    """``kind:name``, as a deny list and the logs name an identity (a node's too)."""
    return f"{identity.kind.value}:{identity.name}"


@attrs.frozen
class DenyList:
    """Certificates to refuse although a trusted CA signed them.

    An entry names one certificate by its serial number (``serial:<hex>``, as ``p2pshard certs
    sign`` prints it; colons between byte pairs are allowed) or every certificate of an identity
    (``node:node-7``, ``client:ops``, ``admin:alice``).

    Example:
        >>> deny = DenyList.parse(["serial:0a1b2c", "admin:alice"])
        >>> deny.reason(PeerIdentity(IdentityKind.ADMIN, "alice"), 0x77)
        "admin:alice (certificate serial 77) is denied by the entry 'admin:alice'"
        >>> deny.reason(PeerIdentity(IdentityKind.NODE, "node-1"), 0x77) is None
        True
    """

    serials: frozenset[int] = frozenset()
    identities: frozenset[PeerIdentity] = frozenset()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> DenyList:
        """Read deny entries.

        Raises:
            ConfigurationError: an entry is neither form; the message names it.
        """
        serials: set[int] = set()
        identities: set[PeerIdentity] = set()
        for entry in entries:
            if not isinstance(entry, str):
                raise ConfigurationError(
                    f"deny entry {entry!r} is invalid: expected {_ENTRY_FORMS}"
                )
            prefix, colon, rest = entry.partition(":")
            if not colon:
                raise ConfigurationError(
                    f"deny entry {entry!r} is invalid: expected {_ENTRY_FORMS}"
                )
            if prefix == _SERIAL:
                digits = rest.replace(":", "")
                try:
                    if not digits or digits.startswith(("0x", "0X", "-", "+")):
                        raise ValueError(digits)
                    serials.add(int(digits, 16))
                except ValueError:
                    raise ConfigurationError(
                        f"deny entry {entry!r} is invalid: a serial is hexadecimal digits, e.g. "
                        "'serial:3f2a0c'"
                    ) from None
                continue
            try:
                kind = IdentityKind(prefix)
            except ValueError:
                raise ConfigurationError(
                    f"deny entry {entry!r} is invalid: expected {_ENTRY_FORMS}"
                ) from None
            try:
                identities.add(PeerIdentity(kind, rest))
            except ConfigurationError as exc:
                raise ConfigurationError(f"deny entry {entry!r} is invalid: {exc}") from None
        return cls(frozenset(serials), frozenset(identities))

    def entries(self) -> tuple[str, ...]:
        """The entries in their written form, serials first, each group sorted."""
        return tuple(f"{_SERIAL}:{s:x}" for s in sorted(self.serials)) + tuple(
            sorted(identity_text(i) for i in self.identities)
        )

    def reason(self, identity: PeerIdentity, serial: int) -> str | None:
        """Why a certificate of ``identity`` with ``serial`` is refused; None if it is not."""
        if serial in self.serials:
            entry = f"{_SERIAL}:{serial:x}"
        elif identity in self.identities:
            entry = identity_text(identity)
        else:
            return None
        return (
            f"{identity_text(identity)} (certificate serial {serial:x}) is denied by the entry "
            f"{entry!r}"
        )

    def __len__(self) -> int:
        return len(self.serials) + len(self.identities)


@attrs.frozen
class TlsIdentity:
    """A node's credentials and trust: cluster name, trusted CAs, certificate, key, deny list.

    ``ca_file`` may hold several CA certificates (a bundle); ``ca_files`` adds more. A peer
    whose certificate any of them signed is accepted, unless ``deny`` names it.

    Example:
        >>> identity = TlsIdentity("shop", "certs/ca.pem", "certs/node.pem", "certs/node-key.pem")
        >>> rotating = TlsIdentity(
        ...     "shop",
        ...     "certs/ca.pem",
        ...     "certs/node.pem",
        ...     "certs/node-key.pem",
        ...     ca_files=["certs/new-ca.pem"],
        ...     deny=DenyList.parse(["node:node-7"]),
        ... )
    """

    cluster: str
    ca_file: Path = attrs.field(converter=_path)
    cert_file: Path = attrs.field(converter=_path)
    key_file: Path = attrs.field(converter=_path)
    ca_files: tuple[Path, ...] = attrs.field(default=(), converter=_paths, kw_only=True)
    deny: DenyList = attrs.field(factory=DenyList, kw_only=True)

    def __attrs_post_init__(self) -> None:
        check_name("cluster name", self.cluster)

    @property
    def trust_files(self) -> tuple[Path, ...]:
        """Every file of trusted CA certificates: ``ca_file``, then ``ca_files``."""
        return (self.ca_file, *self.ca_files)

    def trusted_certificates(self) -> tuple[x509.Certificate, ...]:
        """The CA certificates of every trust file.

        Raises:
            ConfigurationError: a file is missing, unreadable, or holds no PEM certificate.
        """
        found: list[x509.Certificate] = []
        for path in self.trust_files:
            try:
                certificates = x509.load_pem_x509_certificates(path.read_bytes())
            except OSError as exc:
                raise ConfigurationError(
                    f"cannot read the CA file {str(path)!r}: {exc.strerror or exc}"
                ) from None
            except ValueError as exc:
                raise ConfigurationError(f"cannot load the CA file {str(path)!r}: {exc}") from None
            found += certificates
        return tuple(found)

    def certificate_identity(self) -> PeerIdentity:
        """The identity ``cert_file`` names in this cluster (what peers will take us for).

        Raises:
            ConfigurationError: the file cannot be read, or names no identity of this cluster.
        """
        return certificate_identity(self.cert_file, self.cluster)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        protocol = (
            ssl.PROTOCOL_TLS_SERVER
            if purpose is ssl.Purpose.CLIENT_AUTH
            else ssl.PROTOCOL_TLS_CLIENT
        )
        context = ssl.SSLContext(protocol)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        for what, path in (
            *(("CA", ca) for ca in self.trust_files),
            ("certificate", self.cert_file),
            ("key", self.key_file),
        ):
            if not path.is_file():
                raise ConfigurationError(f"TLS {what} file {str(path)!r} does not exist")
        for ca in self.trust_files:
            try:
                context.load_verify_locations(cafile=ca)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigurationError(f"cannot load the CA file {str(ca)!r}: {exc}") from exc
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(
                f"cannot load certificate {str(self.cert_file)!r} with key "
                f"{str(self.key_file)!r}: {exc}"
            ) from exc
        return context

    def server_context(self) -> ssl.SSLContext:
        """An SSL context for accepting links: TLS 1.3, client certificate required."""
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """An SSL context for opening links: TLS 1.3, server certificate verified by the CA."""
        return self._context(ssl.Purpose.SERVER_AUTH)


def peer_identity(peer_certificate: dict[str, Any] | None, cluster: str) -> PeerIdentity:
    """The identity a verified peer certificate's SAN URI names, if it names ``cluster``.

    Raises:
        HandshakeError: no certificate, no ``p2pshard://`` URI, a malformed one, or one for
            another cluster.
    """
    if not peer_certificate:
        raise HandshakeError("peer presented no certificate")
    uris = [v for k, v in peer_certificate.get("subjectAltName", ()) if k == "URI"]
    ours = [u for u in uris if isinstance(u, str) and u.startswith(f"{URI_SCHEME}://")]
    if not ours:
        raise HandshakeError(
            f"peer certificate has no {URI_SCHEME}:// SAN URI (URIs: {uris or 'none'})"
        )
    for uri in ours:
        peer_cluster, _, _ = uri[len(URI_SCHEME) + 3 :].partition("/")
        if peer_cluster == cluster:
            return parse_identity_uri(uri)[1]
    raise HandshakeError(f"peer certificate is for {', '.join(ours)}, not for cluster {cluster!r}")


def peer_node_name(peer_certificate: dict[str, Any] | None, cluster: str) -> str:
    """The node name in a verified peer certificate, which must be a ``node`` identity.

    Raises:
        HandshakeError: as :func:`peer_identity`, or the certificate is a client's or an
            admin's, which no node ever dials.
    """
    identity = peer_identity(peer_certificate, cluster)
    if not identity.is_node:
        raise HandshakeError(
            f"peer certificate is a {identity.kind.value} identity ({identity.name!r}), not a node"
        )
    return identity.name


def peer_serial(peer_certificate: dict[str, Any] | None) -> int:
    """The serial number of a verified peer certificate.

    Raises:
        HandshakeError: no certificate, or one without a readable serial number.
    """
    serial = (peer_certificate or {}).get("serialNumber")
    try:
        return int(serial, 16) if isinstance(serial, str) else int("-")
    except ValueError:
        raise HandshakeError(
            f"peer certificate has no readable serial number ({serial!r})"
        ) from None


def certificate_identity(cert_file: Path, cluster: str) -> PeerIdentity:
    """The identity a certificate file (PEM) names in ``cluster``: its kind and name.

    Read from the certificate, so a command cannot present itself as another kind than its
    certificate says.

    Raises:
        ConfigurationError: the file cannot be read, or names no identity of ``cluster``.
    """
    try:
        certificate = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the certificate {str(cert_file)!r}: {exc.strerror or exc}"
        ) from None
    except ValueError as exc:
        raise ConfigurationError(f"{str(cert_file)!r} is not a PEM certificate: {exc}") from None
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    try:
        return peer_identity({"subjectAltName": [("URI", u) for u in uris]}, cluster)
    except HandshakeError as exc:
        text = str(exc).replace("peer certificate", "it", 1)
        raise ConfigurationError(
            f"the certificate {str(cert_file)!r} is not usable: {text}"
        ) from None


def issued_by_any(certificate_der: bytes, authorities: Iterable[x509.Certificate]) -> bool:
    """Whether one of ``authorities`` signed the certificate (DER); validity dates aside."""
    certificate = x509.load_der_x509_certificate(certificate_der)
    for authority in authorities:
        try:
            certificate.verify_directly_issued_by(authority)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False
