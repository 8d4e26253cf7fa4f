"""Asks: the table of asks waiting on this node, and where answers to other nodes' asks go.

An ask made here gets an :class:`AskSlot` under a fresh request id; the entity's answer comes
back as an ``EntityReply`` carrying that id, from wherever the entity ran, and
:meth:`AskTable.complete` finds the slot. An ask that came from another node is answered through
a :class:`RemoteReply`, which sends the ``EntityReply`` to the asking node (or completes the
local slot when that node is this one).
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import trio

from membership import (
    ClusterError,
    SendQueueFull,
    SerializationError,
    Transport,
    TransportClosed,
    UniqueAddress,
)

from .._errors import BufferOverflow, RegionStopped, RemoteEntityError, ShardingError
from ._protocol import EntityReply

logger = logging.getLogger("p2pshard.sharding")

_LOCAL_ERRORS: dict[str, type[ShardingError]] = {
    "p2pshard.BufferOverflow": BufferOverflow,
    "p2pshard.RegionStopped": RegionStopped,
    "p2pshard.ShardingError": ShardingError,
}
"""Error names an ask's answer can carry that are the region's, not the entity's."""


class AskSlot:
    """An ask waiting for its answer on this node."""

    __slots__ = ("done", "entity_id", "error", "request_id", "value")

    def __init__(self, request_id: int, entity_id: str) -> None:
        self.request_id = request_id
        self.entity_id = entity_id
        self.done = trio.Event()
        self.value: object = None
        self.error: Exception | None = None

    def ok(self, value: object) -> None:
        """The entity answered ``value``."""
        if not self.done.is_set():
            self.value = value
            self.done.set()

    def fail(self, error_type: str, error_text: str) -> None:
        """The ask failed: a region's own error, or the entity's (a ``RemoteEntityError``)."""
        if self.done.is_set():
            return
        local = _LOCAL_ERRORS.get(error_type)
        if local is not None:
            self.error = local(error_text)
        else:
            self.error = RemoteEntityError(self.entity_id, error_type, error_text)
        self.done.set()


class AskTable:
    """The asks waiting on this node, by request id, and the answers this node sends."""

    def __init__(self, transport: Transport, first_id: int) -> None:
        self._transport = transport
        self._asks: dict[int, AskSlot] = {}
        self._ids = itertools.count(first_id)

    def new(self, entity_id: str) -> AskSlot:
        """A slot for a new ask to ``entity_id``, under a fresh request id."""
        slot = AskSlot(next(self._ids), entity_id)
        self._asks[slot.request_id] = slot
        return slot

    def forget(self, slot: AskSlot) -> None:
        """The ask is over (answered, failed or timed out): a late answer finds nothing."""
        self._asks.pop(slot.request_id, None)

    def complete(self, reply: EntityReply) -> None:
        """An answer arrived: complete its ask, if it still waits."""
        slot = self._asks.get(reply.request_id)
        if slot is None:
            return  # timed out already
        if reply.error_type is None:
            slot.ok(reply.value)
        else:
            slot.fail(reply.error_type, reply.error_text)

    def reply(self, origin: UniqueAddress, reply: EntityReply) -> None:
        """Send ``reply`` to the node that asked (this one: complete the ask here)."""
        if origin == self._transport.local_address:
            self.complete(reply)
            return
        try:
            self._transport.send_nowait(origin, reply)
        except SerializationError as exc:
            logger.warning("the answer to ask %d cannot travel: %s", reply.request_id, exc)
            failure = EntityReply(
                request_id=reply.request_id,
                error_type="membership.SerializationError",
                error_text=str(exc),
            )
            with contextlib.suppress(ClusterError):  # then the asker times out
                self._transport.send_nowait(origin, failure)
        except (SendQueueFull, TransportClosed) as exc:
            logger.warning("the answer to ask %d to %s lost: %s", reply.request_id, origin, exc)


class RemoteReply:
    """An ask from another node: the answer goes back to ``origin``."""

    __slots__ = ("_asks", "origin", "request_id")

    def __init__(self, asks: AskTable, origin: UniqueAddress, request_id: int) -> None:
        self._asks = asks
        self.origin = origin
        self.request_id = request_id

    def ok(self, value: object) -> None:
        """Send the entity's answer."""
        self._asks.reply(self.origin, EntityReply(request_id=self.request_id, value=value))

    def fail(self, error_type: str, error_text: str) -> None:
        """Send the failure."""
        self._asks.reply(
            self.origin,
            EntityReply(request_id=self.request_id, error_type=error_type, error_text=error_text),
        )
