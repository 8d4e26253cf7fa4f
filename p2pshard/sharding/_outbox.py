"""Messages for one node gathered while its link is busy, sent later as one ``EntityDeliveries``.

A region hands a message for another node to the transport at once when the link is free; when
it is busy, the message waits in that node's :class:`Outbox` and the region's batcher sends what
gathered as one batch, oldest first, in batches of at most a byte budget.
"""

from __future__ import annotations

from typing import Any

import trio

from ._protocol import ENTRY_FIELDS
from ._reply import Reply

ENTRY_OVERHEAD = 32
"""Bytes an entry of ``EntityDeliveries`` takes besides its ids and payload, at most."""


class Outbox:
    """Messages for one node gathered while its link is busy, not yet given to the transport."""

    __slots__ = ("entries", "lock", "replies", "size", "traces")

    def __init__(self) -> None:
        self.entries: list[Any] = []
        """Flat, ``ENTRY_FIELDS`` values per message, as in ``EntityDeliveries.entries``."""
        self.replies: list[Reply | None] = []
        """One per message: the asks to fail if their batch is lost."""
        self.traces: list[object] | None = None
        """None while no message here has a trace context; then one per message (maybe None),
        as in ``EntityDeliveries.traces``."""
        self.size = 0
        """An upper estimate of the entries' encoded size, in bytes."""
        self.lock = trio.Lock()
        """Held while a batch is on its way: batches to one node leave in the order made."""

    def add_trace(self, trace: dict[str, str] | None) -> None:
        """The trace context of the message just gathered (called once one has a context)."""
        if self.traces is None:
            self.traces = [None] * (len(self.replies) - 1)
        self.traces.append(trace)

    def take(self, budget: int) -> tuple[list[Any], list[Reply | None], list[object] | None]:
        """Remove and return the oldest messages that fit in ``budget`` bytes (one at least).

        Their entries, their replies and their trace contexts (None when none has one).
        """
        entries, replies, traces = self.entries, self.replies, self.traces
        if self.size <= budget:
            self.entries, self.replies, self.traces, self.size = [], [], None, 0
            return entries, replies, traces
        count = size = 0
        for i in range(0, len(entries), ENTRY_FIELDS):
            one = entry_size(entries[i], entries[i + 1], entries[i + 2])
            if count and size + one > budget:
                break
            count += 1
            size += one
        cut = count * ENTRY_FIELDS
        self.entries, self.replies = entries[cut:], replies[count:]
        self.size -= size
        if traces is None:
            return entries[:cut], replies[:count], None
        self.traces = traces[count:]
        return entries[:cut], replies[:count], traces[:count]

    def give_back(
        self, entries: list[Any], replies: list[Reply | None], traces: list[object] | None
    ) -> None:
        """Put back what :meth:`take` gave, ahead of what was gathered since."""
        if traces is not None or self.traces is not None:
            none: list[object] = [None]
            ahead = traces if traces is not None else none * len(replies)
            behind = self.traces if self.traces is not None else none * len(self.replies)
            self.traces = ahead + behind
        self.entries[:0] = entries
        self.replies[:0] = replies
        self.size += sum(
            entry_size(entries[i], entries[i + 1], entries[i + 2])
            for i in range(0, len(entries), ENTRY_FIELDS)
        )


def entry_size(shard_id: str, entity_id: str, payload: bytes) -> int:
    """An upper bound of the bytes an entry of ``EntityDeliveries`` takes."""
    # An upper bound: a character is at most 4 bytes of UTF-8.
    return len(payload) + 4 * (len(shard_id) + len(entity_id)) + ENTRY_OVERHEAD
