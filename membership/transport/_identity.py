"""Who is at the other end of a link: the identity its certificate names, not what it says.

Theory of operation: every certificate the cluster CA signs carries one SAN URI naming its
cluster, its kind and its name. The kind decides what a link with that certificate may do, once
the TLS handshake has verified it:

- ``node``: may join the cluster as itself (the Join names the certificate's own node at the
  address its link announced), and once a member, takes part in everything (gossip, heartbeats,
  replication, singletons, sharding). It speaks only for itself: it cannot join or leave for
  another node, and a node that is not a member can do nothing but ask to join and read status.
- ``client``: may read (``p2pshard status``) and nothing else.
- ``admin``: may read, and make other members leave or go down (``p2pshard leave|down``).

The URI is ``p2pshard://<cluster>/<node>`` for a node (the form every node certificate has had
since the first release) and ``p2pshard://<cluster>/<kind>/<name>`` for the others (``node`` may
be written that way too). Names never contain ``/``, so the two forms cannot be confused.
"""

from __future__ import annotations

import enum

import attrs

from ._address import check_name
from ._errors import ConfigurationError, HandshakeError

URI_SCHEME = "p2pshard"


class IdentityKind(enum.Enum):
    """What a certificate allows its holder to do (see the module docstring)."""

    NODE = "node"
    CLIENT = "client"
    ADMIN = "admin"


@attrs.frozen(cache_hash=True)
class PeerIdentity:
    """The verified identity of a link: its certificate's kind and name.

    Example:
        >>> PeerIdentity(IdentityKind.CLIENT, "ops-laptop")
        PeerIdentity(kind=<IdentityKind.CLIENT: 'client'>, name='ops-laptop')
    """

    kind: IdentityKind
    name: str

    def __attrs_post_init__(self) -> None:
        check_name(f"{self.kind.value} name", self.name)

    @property
    def is_node(self) -> bool:
        """Whether this is a node's identity (one that may be a member)."""
        return self.kind is IdentityKind.NODE

    def __str__(self) -> str:
        return self.name if self.kind is IdentityKind.NODE else f"{self.kind.value}:{self.name}"


def identity_uri(cluster: str, identity: PeerIdentity) -> str:
    """The SAN URI that names ``identity`` in ``cluster``.

    Example:
        >>> identity_uri("shop", PeerIdentity(IdentityKind.NODE, "node-1"))
        'p2pshard://shop/node-1'
        >>> identity_uri("shop", PeerIdentity(IdentityKind.ADMIN, "alice"))
        'p2pshard://shop/admin/alice'
    """
    if identity.kind is IdentityKind.NODE:
        return f"{URI_SCHEME}://{cluster}/{identity.name}"
    return f"{URI_SCHEME}://{cluster}/{identity.kind.value}/{identity.name}"


def parse_identity_uri(uri: str) -> tuple[str, PeerIdentity]:
    """The cluster and identity a ``p2pshard://`` SAN URI names.

    Raises:
        HandshakeError: not a ``p2pshard://`` URI, or one whose parts are not valid names.

    Example:
        >>> parse_identity_uri("p2pshard://shop/client/ops")
        ('shop', PeerIdentity(kind=<IdentityKind.CLIENT: 'client'>, name='ops'))
    """
    prefix = f"{URI_SCHEME}://"
    if not uri.startswith(prefix):
        raise HandshakeError(f"{uri!r} is not a {prefix} URI")
    parts = uri[len(prefix) :].split("/")
    try:
        if len(parts) == 2:
            cluster, name = parts
            kind = IdentityKind.NODE
        elif len(parts) == 3:
            cluster, kind_name, name = parts
            try:
                kind = IdentityKind(kind_name)
            except ValueError:
                kinds = ", ".join(k.value for k in IdentityKind)
                raise HandshakeError(
                    f"certificate URI {uri!r} names the kind {kind_name!r}; known kinds: {kinds}"
                ) from None
        else:
            raise HandshakeError(
                f"certificate URI {uri!r} is not {prefix}<cluster>/<node> or "
                f"{prefix}<cluster>/<kind>/<name>"
            )
        check_name("cluster name", cluster)
        return cluster, PeerIdentity(kind, name)
    except ConfigurationError as exc:
        raise HandshakeError(f"certificate URI {uri!r}: {exc}") from None
