"""What a received message may do, decided by the link it came on, not by what it says (sans-IO).

Theory of operation: every :class:`~membership.Envelope` carries the incarnation its link's hello
announced (``sender``, whose name the transport checked against the certificate) and the
certificate's identity (``identity``: kind and name). :func:`authorize_membership` decides, from
those two and from whether the sender is a member now, whether a membership message is taken:

- a node joins only as itself: ``Join.node``, ``InitJoin.sender`` and every other field that
  names the message's author must be the link's own incarnation;
- gossip, gossip status, heartbeats and exiting confirmations come only from members;
- ``Leave`` and ``Down`` of any member come only from members (their split brain resolver and
  their users decide) or from an ``admin`` identity;
- a ``client`` identity takes part in nothing: it may only read (``p2pshard status``).

Everything else a node receives (replication, singletons, sharding) is member traffic: see
:func:`member_traffic_refusal`. A refusal names its kind (for counting and rate-limited logging,
see ``_refusals``) and its reason. Akka trusts any peer that completed the TLS handshake; here a
certificate speaks only for its own node.
"""

from __future__ import annotations

import enum

import attrs

from ._cluster_messages import (
    Down,
    ExitingConfirmed,
    GossipEnvelope,
    GossipStatus,
    InitJoin,
    InitJoinAck,
    InitJoinNack,
    Join,
    Leave,
    OtherClusterSeen,
    Welcome,
)
from ._heartbeat import Heartbeat, HeartbeatRsp
from .transport._address import UniqueAddress
from .transport._identity import IdentityKind, PeerIdentity


@attrs.frozen
class Refused:
    """Why a message was refused: a short ``kind`` to count it by, and a sentence for the log."""

    kind: str
    reason: str


class Standing(enum.Enum):
    """What the sender is to this node, by its gossip."""

    MEMBER = "member"
    """In the gossip, in any status but Removed."""
    REMOVED = "removed"
    """Removed (a tombstone): it may still gossip, and is answered with the tombstone."""
    STRANGER = "stranger"
    """Neither: maybe a node that asks to join, maybe anybody with a certificate."""


_GOSSIP = (GossipEnvelope, GossipStatus)
_MEMBERS_ONLY = (Heartbeat, HeartbeatRsp, ExitingConfirmed, OtherClusterSeen)


def _author(message: object) -> UniqueAddress | None:
    """The incarnation a membership message says it is from, if it says."""
    match message:
        case Join(node=node) | ExitingConfirmed(node=node):
            return node
        case (
            InitJoin(sender=node)
            | InitJoinAck(sender=node)
            | InitJoinNack(sender=node)
            | Welcome(sender=node)
            | GossipEnvelope(sender=node)
            | GossipStatus(sender=node)
            | Heartbeat(sender=node)
            | HeartbeatRsp(sender=node)
            | OtherClusterSeen(sender=node)
        ):
            return node
    return None


def authorize_membership(
    message: object, sender: UniqueAddress, identity: PeerIdentity, standing: Standing
) -> Refused | None:
    """None if the membership ``message`` from ``sender`` (over ``identity``'s link) is taken.

    ``standing``: what ``sender`` is in this node's gossip now.

    Example:
        >>> from membership import Address
        >>> me = UniqueAddress(Address("10.0.0.5", 25520), "node-5", 9)
        >>> other = UniqueAddress(Address("10.0.0.6", 25520), "node-6", 3)
        >>> node = PeerIdentity(IdentityKind.NODE, "node-5")
        >>> authorize_membership(Join(node=me), me, node, Standing.STRANGER) is None
        True
        >>> authorize_membership(Join(node=other), me, node, Standing.STRANGER).kind
        'forged-author'
    """
    name = type(message).__name__
    if identity.kind is not IdentityKind.NODE:
        if isinstance(message, Leave | Down) and identity.kind is IdentityKind.ADMIN:
            return None
        what = "read cluster state" if identity.kind is IdentityKind.CLIENT else "leave or down"
        return Refused(
            f"{identity.kind.value}-identity",
            f"refused {name} from {identity}: a {identity.kind.value} certificate may only "
            f"{what}, not take part in membership",
        )
    author = _author(message)
    if author is not None and author != sender:
        return Refused(
            "forged-author",
            f"refused {name} for {author} that came on the link of {sender}: a node speaks only "
            "for itself",
        )
    if standing is Standing.MEMBER:
        return None
    if isinstance(message, _GOSSIP) and standing is Standing.REMOVED:
        return None
    if isinstance(message, _MEMBERS_ONLY + _GOSSIP):
        return Refused("not-a-member", f"refused {name} from {sender}, which is not a member")
    if isinstance(message, Leave | Down):
        return Refused(
            "not-a-member",
            f"refused {name} of {message.node} from {sender}, which is not a member: only "
            "members and admin certificates may make a member leave or go down",
        )
    return None


def member_traffic_refusal(
    message: object, sender: UniqueAddress, identity: PeerIdentity
) -> Refused:
    """The refusal of a message that only members may send (replication, singletons, sharding).

    Example:
        >>> from membership import Address
        >>> who = UniqueAddress(Address("10.0.0.9", 25520), "visitor", 4)
        >>> member_traffic_refusal(b"x", who, PeerIdentity(IdentityKind.CLIENT, "visitor")).kind
        'client-identity'
    """
    name = type(message).__name__
    if identity.kind is not IdentityKind.NODE:
        return Refused(
            f"{identity.kind.value}-identity",
            f"refused {name} from {identity}: a {identity.kind.value} certificate is not a "
            "member's",
        )
    return Refused("not-a-member", f"refused {name} from {sender}, which is not a member")
