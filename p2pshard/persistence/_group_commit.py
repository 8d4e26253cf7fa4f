"""Group commit for the SQL journals: many appends in one transaction, each with its own answer.

Sans-IO. Theory of operation. One fsync per append caps a journal at the disk's commit rate
whatever the CPU. The SQL journals therefore write appends in batches: while one transaction is
being committed, the appends that arrive wait in an :class:`AppendQueue`; when it is done, the
next transaction takes what waits (up to ``max_events`` events and ``max_bytes`` bytes, and
always at least one append, however large) and writes it all with one commit. An append that
arrives when nothing is being committed goes out at once, alone: batching adds no waiting.

Inside the transaction :func:`plan_batch` applies the rules of ``p2pshard.persistence._journal``
to each append in arrival order, against the stream rows as stored, updated as it goes: a
fenced append, or one that does not continue its stream (the stored highest sequence number,
or that of an earlier append of the same batch), is refused alone with its own
:class:`p2pshard.JournalFenced` or :class:`p2pshard.JournalConflict`, and writes nothing; the
others' events and stream rows are written. A refused append changes nothing, as in a
transaction of its own that rolled back: a conflicting append with a higher token does not raise
the fence. So the outcome of each append is the one it would have had in a transaction of its
own, taken in queue order.

What the shell (``p2pshard.persistence._threads``) does with the plan: it writes it and commits;
then each append is answered, success or its refusal. If the storage fails (an I/O error, a
full disk, the commit itself), the transaction is rolled back and every append of the batch
fails with that error: nothing is acknowledged that is not durable, and a retry writes each
once. A batch never holds an append whose stream has one in a batch still being committed
(:meth:`AppendQueue.take_batch`'s ``busy``), so the order of appends per stream is kept even
where two batches are in flight at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

from .._errors import JournalError
from ._journal import admit_token, check_next


@attrs.define(eq=False)
class PendingAppend:
    """One append waiting to be written: its stream, first sequence number, events and token."""

    persistence_id: str
    first_seq: int
    events: list[bytes]
    token: int | None
    size: int = attrs.field(init=False)
    """Bytes of the events."""

    def __attrs_post_init__(self) -> None:
        self.size = sum(map(len, self.events))

    @property
    def last_seq(self) -> int:
        """The sequence number of the append's last event."""
        return self.first_seq + len(self.events) - 1


@attrs.frozen
class StreamRow:
    """A stream's stored row: the highest sequence number and the fence."""

    highest: int
    fence: int | None


NEW_STREAM = StreamRow(0, None)
"""The row of a stream that has none yet."""

_A = TypeVar("_A", bound=PendingAppend)


class AppendQueue(Generic[_A]):
    """The appends waiting for the next transaction, in arrival order.

    Example:
        >>> queue: AppendQueue[PendingAppend] = AppendQueue(max_events=2, max_bytes=1 << 20)
        >>> for i in range(3):
        ...     queue.add(PendingAppend(f"R|{i}", 1, [b"e"], None))
        >>> [a.persistence_id for a in queue.take_batch()]
        ['R|0', 'R|1']
        >>> len(queue)
        1
    """

    def __init__(self, *, max_events: int, max_bytes: int) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError(
                f"a batch needs room for one event: max_events={max_events}, max_bytes={max_bytes}"
            )
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._waiting: deque[_A] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, append: _A) -> None:
        """Queue ``append`` behind those already waiting."""
        self._waiting.append(append)

    def head(self) -> _A | None:
        """The append that has waited longest, or None."""
        return self._waiting[0] if self._waiting else None

    def discard(self, append: _A) -> bool:
        """Take ``append`` out of the queue; False if it is not waiting (taken into a batch)."""
        for i, waiting in enumerate(self._waiting):
            if waiting is append:
                del self._waiting[i]
                return True
        return False

    def take_batch(
        self, *, busy: Container[str] = frozenset(), max_appends: int | None = None
    ) -> list[_A]:
        """The appends of the next transaction, oldest first, within the limits.

        The first append is always taken, even above the limits alone; the others while the
        batch's events and bytes stay within ``max_events`` and ``max_bytes`` (and its appends
        within ``max_appends``, if given). Appends are taken in order: one that does not fit
        ends the batch, so none overtakes another. The appends of the streams in ``busy`` (those
        of a batch still in flight) stay waiting, in their order, and those of other streams
        may pass them: an append must not be checked before the one before it on its stream
        has committed.

        Example:
            >>> queue: AppendQueue[PendingAppend] = AppendQueue(max_events=9, max_bytes=1 << 20)
            >>> for pid, seq in [("R|a", 2), ("R|b", 1), ("R|a", 3), ("R|c", 1)]:
            ...     queue.add(PendingAppend(pid, seq, [b"e"], None))
            >>> [(a.persistence_id, a.first_seq) for a in queue.take_batch(busy={"R|a"})]
            [('R|b', 1), ('R|c', 1)]
            >>> [(a.persistence_id, a.first_seq) for a in queue.take_batch()]
            [('R|a', 2), ('R|a', 3)]
        """
        batch: list[_A] = []
        most = len(self._waiting) if max_appends is None else max(1, max_appends)
        held: deque[_A] = deque()
        events = size = 0
        while self._waiting and len(batch) < most:
            head = self._waiting[0]
            if head.persistence_id in busy:
                held.append(self._waiting.popleft())
                continue
            if batch and (
                events + len(head.events) > self._max_events or size + head.size > self._max_bytes
            ):
                break
            batch.append(self._waiting.popleft())
            events += len(head.events)
            size += head.size
        if held:  # back at the front, in their order
            held.extend(self._waiting)
            self._waiting = held
        return batch


OVERLAP_FROM = 128
"""Outstanding appends (waiting, and in the batches in flight) from which a backend with more
than one commit slot sends a batch while another is in flight, and splits them among the slots.
Under lighter load a batch's time is mostly the commit's fixed cost (a round trip, an fsync),
and the appends go out together, one batch at a time."""


def batch_share(
    *, waiting: int, appends_in_flight: int, in_flight: int, slots: int, overlap_from: int
) -> int | None:
    """How many appends the next batch may take now: 0 none yet, None all the limits allow.

    0 means: wait for a batch in flight to end. ``waiting`` appends are queued,
    ``appends_in_flight`` in the ``in_flight`` batches being committed, out of ``slots`` batches
    the backend may have in flight at once. Below ``overlap_from`` outstanding appends one batch
    goes at a time. From it on, with more than one slot, each batch takes an equal share of the
    outstanding appends, and a smaller one when none is in flight, so that the batches go out
    staggered: one commits while the tasks the other answered make their next appends (two equal
    halves sent together come back together).

    Example:
        >>> batch_share(waiting=16, appends_in_flight=0, in_flight=0, slots=2, overlap_from=128)
        >>> batch_share(waiting=16, appends_in_flight=16, in_flight=1, slots=2, overlap_from=128)
        0
        >>> batch_share(waiting=256, appends_in_flight=0, in_flight=0, slots=2, overlap_from=128)
        86
        >>> batch_share(waiting=170, appends_in_flight=86, in_flight=1, slots=2, overlap_from=128)
        128
    """
    if in_flight >= slots:
        return 0
    outstanding = waiting + appends_in_flight
    if outstanding < overlap_from:
        return 0 if in_flight else None
    if slots == 1:
        return None
    return -(-outstanding // (slots + (not in_flight)))


@attrs.frozen
class BatchPlan:
    """What one transaction writes for a batch, and the refusals it answers."""

    events: list[tuple[str, int, bytes]]
    """Rows to insert, ``(persistence_id, seq, payload)``, in the batch's order."""

    streams: dict[str, StreamRow]
    """The new row of each stream the batch changes."""

    refusals: list[JournalError | None]
    """For each append of the batch, in order: its refusal, or None if it is written."""


def streams_of(batch: Sequence[PendingAppend]) -> list[str]:
    """The distinct persistence ids of ``batch``, sorted (the order in which rows are locked)."""
    return sorted({a.persistence_id for a in batch})


def plan_batch(batch: Sequence[PendingAppend], stored: Mapping[str, StreamRow]) -> BatchPlan:
    """Apply the fence and sequence rules to each append of ``batch`` in order.

    ``stored`` holds the stored rows of the batch's streams, read inside the transaction (a
    stream without a row is new). Each append is checked against its stream as the appends
    before it in the batch left it.

    Example:
        >>> plan = plan_batch(
        ...     [
        ...         PendingAppend("R|a", 1, [b"x"], 5),
        ...         PendingAppend("R|b", 4, [b"y"], 1),  # fenced: b's fence is 2
        ...         PendingAppend("R|a", 2, [b"z"], 5),
        ...     ],
        ...     {"R|b": StreamRow(3, 2)},
        ... )
        >>> plan.events
        [('R|a', 1, b'x'), ('R|a', 2, b'z')]
        >>> [type(r).__name__ for r in plan.refusals]
        ['NoneType', 'JournalFenced', 'NoneType']
    """
    rows = {pid: (row.highest, row.fence) for pid, row in stored.items()}
    events: list[tuple[str, int, bytes]] = []
    changed: dict[str, tuple[int, int | None]] = {}
    refusals: list[JournalError | None] = []
    for append in batch:
        pid, first_seq, token = append.persistence_id, append.first_seq, append.token
        highest, fence = rows.get(pid, (0, None))
        if first_seq == highest + 1 and (token is None or fence is None or token >= fence):
            # What admit_token and check_next admit, without their calls: this loop runs once
            # per append of every batch. A test holds the two to the same decisions.
            if token is not None and (fence is None or token > fence):
                fence = token
        else:
            try:
                admit_token(pid, fence, token)
                check_next(pid, first_seq, highest)
            except JournalError as refusal:
                refusals.append(refusal)
                continue
            raise AssertionError(f"{pid}: the rules admit what the batch planner refused")
        refusals.append(None)
        if len(append.events) == 1:
            events.append((pid, first_seq, append.events[0]))
        else:
            events.extend((pid, first_seq + i, e) for i, e in enumerate(append.events))
        rows[pid] = changed[pid] = (first_seq + len(append.events) - 1, fence)
    return BatchPlan(events, {pid: StreamRow(*row) for pid, row in changed.items()}, refusals)


def checkpoint_due(
    unchecked: int, batch: Sequence[PendingAppend], *, pages: int, min_batch: int
) -> tuple[int, bool]:
    """After ``batch`` committed: the log pages since the last checkpoint, and whether one is due.

    ``unchecked`` is the estimate before the batch: a page per append and per event, and one per
    4 KiB of events. A checkpoint is due once the estimate reaches ``pages``, after a batch of at
    least ``min_batch`` appends (the work of that many answered tasks covers much of it); the
    count then starts again from 0.

    Example:
        >>> batch = [PendingAppend(f"R|{i}", 1, [b"e"], None) for i in range(3)]
        >>> checkpoint_due(0, batch, pages=10, min_batch=2)
        (6, False)
        >>> checkpoint_due(6, batch, pages=10, min_batch=2)
        (0, True)
        >>> checkpoint_due(6, batch[:1], pages=10, min_batch=2)  # a lone append: not after it
        (8, False)
    """
    written = unchecked + len(batch) + sum(len(a.events) + (a.size >> 12) for a in batch)
    if written < pages or len(batch) < min_batch:
        return written, False
    return 0, True
