"""Gateways: how a room's message reaches WebSockets connected to other nodes.

Each node runs one ``Gateway`` entity whose id is the node's name, and a custom allocation
strategy (:class:`NodeNamedAllocation`, in the spirit of Akka's external shard allocation)
puts the shard of that name on the node of that name. A room tells ``Gateway/<node>`` one
:class:`Deliver` per node holding some of its connections; the gateway entity runs on that node
and pushes the frame to its local connections through the process's :class:`Hub`.

When a node dies, its gateway shard is allocated to some surviving node once the dead node is
removed; that incarnation finds none of the connections and, as its node is no longer a member,
tells the room they are gone. A gateway that is (briefly) not on its own node while that node
is a member drops the frames without forgetting the connections; the page notices the gap in
sequence numbers and reloads the history.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from p2pshard import (
    ClusterView,
    EntityContext,
    EntityId,
    Node,
    ShardId,
    ShardRegion,
    UniqueAddress,
    message,
)

from .protocol import ConnectionsGone, Deliver

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger("examples.chat.gateway")


@message
@attrs.frozen(kw_only=True)
class Ping:
    """Answered with the name of the node the gateway runs on."""


@message
@attrs.frozen(kw_only=True)
class WhatRunsHere:
    """Answered with :class:`RunningHere`: the entities of every type on the gateway's node.

    The ``/cluster`` page asks each member's gateway, so every node's row names its rooms
    (the cluster's statistics count entities per shard, without their ids).
    """


@message
@attrs.frozen(kw_only=True)
class RunningHere:
    """The node the gateway runs on, and the ids of the entities active there, per type."""

    node: str
    entities: dict[str, list[str]]


class NodeNameExtractor:
    """Entity id = shard id = a node name (sent to with ``entity_ref``)."""

    number_of_shards = 1
    """Nominal: the shards are the node names, so there is no fixed number."""

    def entity_id(self, message: object) -> EntityId | None:
        """Gateways are addressed with ``entity_ref(node name)`` only."""
        return None

    def entity_message(self, message: object) -> object:
        """The message itself."""
        return message

    def shard_id(self, entity_id: EntityId) -> ShardId:
        """The shard is named after the node, as the entity is."""
        return ShardId(entity_id)


@attrs.frozen
class NodeNamedAllocation:
    """Shard ``<name>`` goes to the region on the node called ``<name>`` while it is a member.

    Otherwise (the node is gone) to the region that asked. Rebalancing moves a shard back home
    when its node is (again) a member and not leaving.
    """

    def _home(
        self,
        shard_id: ShardId,
        current: Mapping[UniqueAddress, Sequence[ShardId]],
        view: ClusterView,
    ) -> UniqueAddress | None:
        for region in sorted(current, key=str):
            if region.name == shard_id and not view.is_leaving(region):
                return region
        return None

    def allocate_shard(
        self,
        requester: UniqueAddress,
        shard_id: ShardId,
        current: Mapping[UniqueAddress, Sequence[ShardId]],
        cluster: ClusterView,
    ) -> UniqueAddress:
        """The named node's region, else the requester (else any region)."""
        home = self._home(shard_id, current, cluster)
        if home is not None:
            return home
        return requester if requester in current else min(current, key=str)

    def rebalance(
        self,
        current: Mapping[UniqueAddress, Sequence[ShardId]],
        in_progress: frozenset[ShardId],
        cluster: ClusterView,
    ) -> frozenset[ShardId]:
        """Shards away from their named node while it is a member."""
        if not cluster.good_time_to_rebalance():
            return frozenset()
        moving = set()
        for region, shards in current.items():
            for shard in shards:
                if shard in in_progress or shard == region.name:
                    continue
                if self._home(shard, current, cluster) is not None:
                    moving.add(shard)
        return frozenset(moving)


@attrs.define(eq=False)
class Session:
    """One WebSocket connection on this node."""

    conn: str
    send: trio.MemorySendChannel[dict[str, Any]]
    room: str | None = None
    user: str | None = None
    overflow: trio.Event = attrs.Factory(trio.Event)

    def push(self, frame: dict[str, Any]) -> None:
        """Queue a frame for the page; a page that cannot keep up is disconnected."""
        try:
            self.send.send_nowait(frame)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.overflow.set()


@attrs.define(eq=False)
class Hub:
    """This process's connections and regions, shared by the gateway entity and the web server."""

    node: Node
    web_urls: tuple[str, ...] = ()
    sessions: dict[str, Session] = attrs.Factory(dict)
    _rooms: ShardRegion | None = None
    _gateways: ShardRegion | None = None

    @property
    def node_name(self) -> str:
        """This node's name."""
        return self.node.config.node_name

    @property
    def rooms(self) -> ShardRegion:
        """The ``Room`` region."""
        assert self._rooms is not None
        return self._rooms

    @property
    def gateways(self) -> ShardRegion:
        """The ``Gateway`` region."""
        assert self._gateways is not None
        return self._gateways

    def set_regions(self, rooms: ShardRegion, gateways: ShardRegion) -> None:
        """Called once both types are started."""
        self._rooms, self._gateways = rooms, gateways

    def is_member(self, node_name: str) -> bool:
        """Whether a node of that name is in the cluster (not down or removed)."""
        return any(
            m.node.name == node_name and m.status.name not in ("DOWN", "REMOVED")
            for m in self.node.cluster.members
        )

    def running_here(self) -> RunningHere:
        """The ids of the entities active on this node, per entity type."""
        sharding = self.node.sharding
        entities: dict[str, list[str]] = {}
        for type_name in sorted(sharding.type_names):
            state = sharding.region_state(type_name)
            entities[type_name] = sorted(str(e) for s in state.shards for e in s.entity_ids)
        return RunningHere(node=self.node_name, entities=entities)

    def deliver(self, deliver: Deliver) -> list[str]:
        """Push ``deliver`` to the local connections it names; return those not found here."""
        missing = []
        for conn in deliver.conns:
            session = self.sessions.get(conn)
            if session is None:
                missing.append(conn)
            elif session.room == deliver.room:
                if deliver.message is not None:
                    session.push(
                        {
                            "type": "message",
                            "room": deliver.room,
                            "message": message_json(deliver.message),
                        }
                    )
                session.push(
                    {"type": "members", "room": deliver.room, "members": list(deliver.members)}
                )
        return missing


def message_json(m: Any) -> dict[str, Any]:
    """A :class:`ChatMessage` as the page sees it."""
    return {"seq": m.seq, "user": m.user, "text": m.text, "id": m.client_id, "at": m.at}


class Gateway:
    """The entity ``Gateway/<node name>``: hands deliveries to this node's WebSockets."""

    def __init__(self, ctx: EntityContext, hub: Hub) -> None:
        self._hub = hub
        self._name = ctx.entity_id

    async def receive(self, msg: object, ctx: EntityContext) -> object:
        """Deliver, or answer a Ping with where this gateway runs."""
        match msg:
            case Deliver():
                missing = self._hub.deliver(msg)
                own = self._name == self._hub.node_name
                if missing and (own or not self._hub.is_member(self._name)):
                    await self._hub.rooms.entity_ref(msg.room).tell(
                        ConnectionsGone(conns=tuple(missing))
                    )
                return None
            case Ping():
                return self._hub.node_name
            case WhatRunsHere():
                return self._hub.running_here()
        raise TypeError(f"a gateway does not handle {type(msg).__name__}")
