"""What a region uses of its node: given by ``Sharding``, the same for every region.

A region does not know ``Sharding``: it gets these services, and sharding passes them in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs

from crdt import Replicator
from membership import Cluster, Singletons, Transport

from ._asks import AskTable

logger = logging.getLogger("p2pshard.sharding")


class IncarnationObserver(Protocol):
    """Told of entity incarnations on one node (see :meth:`Sharding.observe`)."""

    def entity_started(self, type_name: str, entity_id: str, lease_token: int | None) -> None:
        """An incarnation of ``entity_id`` was made (with its shard's lease token, if any)."""
        ...

    def entity_stopped(self, type_name: str, entity_id: str) -> None:
        """The incarnation of ``entity_id`` on this node ended."""
        ...


@attrs.frozen
class ShardingEvent:
    """A shard hand-off or a rebalance round seen on this node (see :meth:`Sharding.listen`)."""

    kind: str
    """``hand-off`` (a region stops a shard, or the coordinator moves one) or ``rebalance``
    (the coordinator's round chose shards to move)."""
    type_name: str
    text: str
    """What happened, in words."""


ShardingListener = Callable[[ShardingEvent], None]
"""Told of each :class:`ShardingEvent`; called synchronously, so it must be cheap."""


def tell_listeners(listeners: Sequence[ShardingListener], event: ShardingEvent) -> None:
    """Give ``event`` to each listener; one that raises is logged and the others still told."""
    for listener in listeners:
        try:
            listener(event)
        except Exception:
            logger.exception("a sharding event listener failed on %s", event)


@attrs.define(eq=False)
class Lifecycle:
    """Whether sharding on this node still takes messages."""

    closed: bool = False


@attrs.frozen(eq=False)
class RegionServices:
    """The node's parts a region works with."""

    transport: Transport
    cluster: Cluster
    singletons: Singletons
    replicator: Replicator
    asks: AskTable
    """Asks made on this node, and answers to other nodes' asks."""
    check_message: Callable[[object], int]
    """Raises if a message cannot travel; its encoded size, or 0 when it is surely small."""
    observers: list[IncarnationObserver]
    """Told of every incarnation that starts or ends here (the list grows as they register)."""
    lifecycle: Lifecycle
    """Closed once this node is out of the cluster: then no region takes messages."""
    listeners: list[ShardingListener] = attrs.field(factory=list)
    """Told of hand-offs and rebalance rounds (the list grows as they register)."""
