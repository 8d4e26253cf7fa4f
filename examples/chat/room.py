"""The room: a sharded, event-sourced entity holding its connections and its last messages.

Every command is handled one at a time (the entity's mailbox), so the sequence numbers of posts
are gap-free and a retried post (same user and client message id) is found in ``recent`` and
answered with its first sequence number instead of being stored again. After a change, the room
tells the gateway of each node that holds one of its connections (see
:mod:`examples.chat.gateway`); the gateway passes it on to the WebSockets.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import p2pshard
from p2pshard import EntityContext, EventSourcedEntity, Journal

from .protocol import (
    HISTORY_LIMIT,
    RECENT_IDS_LIMIT,
    ChatMessage,
    ConnectionsGone,
    Deliver,
    History,
    Join,
    Joined,
    Leave,
    Left,
    Post,
    Posted,
    RoomState,
    RoomView,
    connection_node,
)

if TYPE_CHECKING:
    from .gateway import Hub

logger = logging.getLogger("examples.chat.room")


def updated(state: RoomState, event: object) -> RoomState:
    """The room after ``event``: a pure function, used live and in recovery."""
    match event:
        case Joined(user=user, conn=conn):
            if (user, conn) in state.conns:
                return state
            return RoomState(
                conns=(*state.conns, (user, conn)),
                messages=state.messages,
                last_seq=state.last_seq,
                recent=state.recent,
            )
        case Left(user=user, conn=conn):
            return RoomState(
                conns=tuple(c for c in state.conns if c != (user, conn)),
                messages=state.messages,
                last_seq=state.last_seq,
                recent=state.recent,
            )
        case ChatMessage(seq=seq, user=user, client_id=client_id):
            if seq != state.last_seq + 1:
                raise ValueError(f"message {seq} after {state.last_seq}: the room has a gap")
            return RoomState(
                conns=state.conns,
                messages=(*state.messages, event)[-HISTORY_LIMIT:],
                last_seq=seq,
                recent=(*state.recent, (f"{user} {client_id}", seq))[-RECENT_IDS_LIMIT:],
            )
    raise TypeError(f"not a room event: {event!r}")


class Room(EventSourcedEntity[RoomState]):
    """One chat room (entity type ``Room``, entity id = the room name)."""

    snapshot_every = 100

    def __init__(self, ctx: EntityContext, journal: Journal, hub: Hub) -> None:
        super().__init__(ctx, journal)
        self._hub = hub
        self._room = ctx.entity_id

    def empty_state(self) -> RoomState:
        """An empty room."""
        return RoomState()

    def apply_event(self, state: RoomState, event: Any) -> RoomState:
        """See :func:`updated`."""
        return updated(state, event)

    async def handle_command(self, command: Any, ctx: EntityContext) -> object:
        """Join, Leave, Post, History and ConnectionsGone (see :mod:`examples.chat.protocol`)."""
        match command:
            case Join(user=user, conn=conn):
                if (user, conn) not in self.state.conns:
                    await self.persist(Joined(user=user, conn=conn))
                    await self._fan_out(None, skip=conn)
                return self._view()
            case Leave(user=user, conn=conn):
                if (user, conn) in self.state.conns:
                    await self.persist(Left(user=user, conn=conn))
                    await self._fan_out(None)
                return self.state.members()
            case Post(user=user, text=text, client_id=client_id):
                known = self.state.seq_of(user, client_id)
                if known is not None:
                    return Posted(seq=known, duplicate=True)
                posted = ChatMessage(
                    seq=self.state.last_seq + 1,
                    user=user,
                    text=text,
                    client_id=client_id,
                    at=time.time(),
                )
                await self.persist(posted)
                await self._fan_out(posted)
                return Posted(seq=posted.seq, duplicate=False)
            case History():
                return self._view()
            case ConnectionsGone(conns=conns):
                gone = [Left(user=u, conn=c) for u, c in self.state.conns if c in set(conns)]
                if gone:
                    await self.persist_all(gone)
                    await self._fan_out(None)
                return None
        raise TypeError(f"a room does not handle {type(command).__name__}")

    def _view(self) -> RoomView:
        return RoomView(members=self.state.members(), messages=self.state.messages)

    async def _fan_out(self, posted: ChatMessage | None, *, skip: str | None = None) -> None:
        """Tell each node's gateway what its connections in this room should see."""
        by_node: dict[str, list[str]] = defaultdict(list)
        for _, conn in self.state.conns:
            if conn != skip:
                by_node[connection_node(conn)].append(conn)
        members = self.state.members()
        for node, conns in sorted(by_node.items()):
            deliver = Deliver(room=self._room, conns=tuple(conns), message=posted, members=members)
            try:
                await self._hub.gateways.entity_ref(node).tell(deliver)
            except p2pshard.ShardingError as exc:  # the node's members see it in the history
                logger.warning("room %s: cannot reach the gateway of %s: %s", self._room, node, exc)
