"""Mutual TLS 1.3 between nodes, and the cluster-name check that follows the handshake.

Both sides present a certificate signed by the cluster CA and require one from the peer (TLS 1.3
only). Host names are not checked: nodes are identified by the SAN URI ``p2pshard://<cluster>/
<node>`` instead, which must name this cluster; that keeps out a certificate the same CA issued for
another cluster. Under TLS 1.3 the client finishes its handshake before the server has judged the
client certificate, so a refused client learns it only as EOF on its first read.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import attrs

from ._address import check_name
from ._errors import ConfigurationError, HandshakeError
from ._identity import URI_SCHEME, PeerIdentity, parse_identity_uri


def _path(value: Path | str) -> Path:
    return Path(value)


@attrs.frozen
class TlsIdentity:
    """A node's credentials: the cluster CA, its certificate and key, and its cluster's name.

    Example:
        >>> identity = TlsIdentity("shop", "certs/ca.pem", "certs/node.pem", "certs/node-key.pem")
    """

    cluster: str
    ca_file: Path = attrs.field(converter=_path)
    cert_file: Path = attrs.field(converter=_path)
    key_file: Path = attrs.field(converter=_path)

    def __attrs_post_init__(self) -> None:
        check_name("cluster name", self.cluster)

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
            ("CA", self.ca_file),
            ("certificate", self.cert_file),
            ("key", self.key_file),
        ):
            if not path.is_file():
                raise ConfigurationError(f"TLS {what} file {str(path)!r} does not exist")
        try:
            context.load_verify_locations(cafile=self.ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigurationError(
                f"cannot load the CA file {str(self.ca_file)!r}: {exc}"
            ) from exc
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
