"""The messages of the membership protocol between nodes.

Joining (through seed nodes or at once), gossip, leaving, downing, and sightings of another
cluster of the same name.
"""

from __future__ import annotations

from typing import Any

import attrs

from ._gossip import (
    Gossip,
)
from ._vclock import VectorClock
from .transport._address import Address, UniqueAddress
from .transport._wire import message


def _optional_node(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, UniqueAddress):
        raise TypeError(f"{attribute.name} must be a UniqueAddress or None, not {value!r}")


def _count(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{attribute.name} must be a non-negative integer, not {value!r}")


@message(name="p2pshard.cluster.InitJoin")
@attrs.frozen(kw_only=True)
class InitJoin:
    """To a seed node: are you a member I can join through?

    A member sends it too, as a probe for another cluster of its name (see ``_islands``); then
    ``oldest`` and ``size`` name the prober's cluster. They are new: an older node sends
    neither, and a joining node has no cluster to name.
    """

    sender: UniqueAddress
    oldest: UniqueAddress | None = attrs.field(default=None, validator=_optional_node)
    """The prober's cluster's oldest Up member (None: not a member's probe)."""
    size: int = attrs.field(default=0, validator=_count)
    """How many Up and WeaklyUp members the prober's cluster has."""


@message(name="p2pshard.cluster.InitJoinAck")
@attrs.frozen(kw_only=True)
class InitJoinAck:
    """Yes: send me Join. Also says which cluster answered, to tell islands apart.

    ``oldest`` and ``size`` are new: an older peer sends neither and they take their defaults,
    which never look like a foreign cluster.
    """

    sender: UniqueAddress
    oldest: UniqueAddress | None = attrs.field(default=None, validator=_optional_node)
    """The answering node's oldest Up member (None: nobody is Up yet)."""
    size: int = attrs.field(default=0, validator=_count)
    """How many Up and WeaklyUp members the answering node's cluster has."""


@message(name="p2pshard.cluster.InitJoinNack")
@attrs.frozen(kw_only=True)
class InitJoinNack:
    """No: I am not a member (yet)."""

    sender: UniqueAddress


@message(name="p2pshard.cluster.Join")
@attrs.frozen(kw_only=True)
class Join:
    """Please add me as a Joining member."""

    node: UniqueAddress
    roles: frozenset[str] = frozenset()
    app_version: str = ""


@message(name="p2pshard.cluster.Welcome")
@attrs.frozen(kw_only=True)
class Welcome:
    """You are in: here is the gossip with you as Joining."""

    sender: UniqueAddress
    gossip: Gossip


@message(name="p2pshard.cluster.GossipEnvelope")
@attrs.frozen(kw_only=True)
class GossipEnvelope:
    """The full gossip, for one incarnation."""

    sender: UniqueAddress
    to: UniqueAddress
    gossip: Gossip


@message(name="p2pshard.cluster.GossipStatus")
@attrs.frozen(kw_only=True)
class GossipStatus:
    """Just the version and a digest of who has seen it: who of us is behind?"""

    sender: UniqueAddress
    version: VectorClock
    seen_digest: bytes


@message(name="p2pshard.cluster.Leave")
@attrs.frozen(kw_only=True)
class Leave:
    """Mark this member Leaving."""

    node: Address


@message(name="p2pshard.cluster.Down")
@attrs.frozen(kw_only=True)
class Down:
    """Mark this member Down."""

    node: Address


@message(name="p2pshard.cluster.ExitingConfirmed")
@attrs.frozen(kw_only=True)
class ExitingConfirmed:
    """The exiting member finished its exiting tasks: the leader may remove it now."""

    node: UniqueAddress


@message(name="p2pshard.cluster.OtherClusterSeen")
@attrs.frozen(kw_only=True)
class OtherClusterSeen:
    """To the members of one's own cluster: another cluster of our name is at ``at``.

    They probe it too, so that it hears from each of us (see ``_islands``).
    """

    sender: UniqueAddress
    at: tuple[Address, ...]

    def __attrs_post_init__(self) -> None:
        if not 1 <= len(self.at) <= 16 or not all(isinstance(a, Address) for a in self.at):
            raise TypeError(f"at must be 1 to 16 Address values, not {self.at!r}")


CLUSTER_MESSAGES: tuple[type, ...] = (
    InitJoin,
    InitJoinAck,
    InitJoinNack,
    Join,
    Welcome,
    GossipEnvelope,
    GossipStatus,
    Leave,
    Down,
    ExitingConfirmed,
    OtherClusterSeen,
)
