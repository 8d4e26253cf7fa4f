"""Batched recoveries and snapshot writes: the queues and the rules. Sans-IO.

Theory of operation. Many entities recover at once after a rebalance or a crash (remembered
entities woken together) or in a burst of first messages, and an entity under load makes a
snapshot due every ``snapshot_every`` events. Each of these was one transaction of its own; the
journal shell (``p2pshard.persistence._gather``) now gathers them, as group commit gathers
appends (``p2pshard.persistence._group_commit``):

- Recoveries wait in a :class:`RecoveryQueue` while a batch of them is being read; the next batch
  takes what waits (up to ``max_streams``), and a journal that offers ``recover_many`` (see
  :class:`p2pshard.BatchJournal`) reads them all in one transaction. Each stream still gets its
  own answer: :func:`assemble_recoveries` turns the rows read into one :class:`Recovery` per
  request, or that request's own :class:`p2pshard.JournalFenced`. The fence raises of a batch
  are :func:`fence_raises`: per stream the highest token asked for, written before the read, so
  two recoveries of one stream in a batch behave as if the higher came first.
- Snapshot writes wait in a :class:`SnapshotQueue`, one per stream: a newer snapshot of a stream
  whose snapshot still waits replaces it (the older one is then useless: recovery reads only the
  latest, and a journal ignores a snapshot older than the stored one). Batches are written one
  at a time, so a stream never has two snapshot writes in flight. :func:`plan_snapshots` applies
  the rules of ``p2pshard.persistence._journal`` to each snapshot of a batch against the stored
  stream rows, refusing each alone (fenced, beyond the last event).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, TypeVar

import attrs

from .._errors import JournalError
from ._group_commit import NEW_STREAM, StreamRow
from ._journal import Recovery, SnapshotWrite, admit_token, check_snapshot_seq

DEFAULT_MAX_RECOVERY_BATCH = 256
"""Streams one batched recovery reads at most."""

DEFAULT_MAX_SNAPSHOT_BATCH = 256
"""Snapshots one batched snapshot write holds at most."""


@attrs.define(eq=False)
class PendingRecovery:
    """A recovery waiting for the next batch."""

    persistence_id: str
    token: int | None


@attrs.define(eq=False)
class PendingSnapshot:
    """A snapshot write waiting for the next batch."""

    write: SnapshotWrite

    @property
    def persistence_id(self) -> str:
        """The stream of the snapshot."""
        return self.write.persistence_id


_R = TypeVar("_R", bound=PendingRecovery)
_S = TypeVar("_S", bound=PendingSnapshot)


class RecoveryQueue(Generic[_R]):
    """Recoveries waiting for the next batched read, in arrival order.

    Example:
        >>> queue: RecoveryQueue[PendingRecovery] = RecoveryQueue(max_streams=2)
        >>> for i in range(3):
        ...     queue.add(PendingRecovery(f"R|{i}", None))
        >>> [r.persistence_id for r in queue.take_batch()]
        ['R|0', 'R|1']
        >>> len(queue)
        1
    """

    def __init__(self, *, max_streams: int = DEFAULT_MAX_RECOVERY_BATCH) -> None:
        if max_streams < 1:
            raise ValueError(f"a recovery batch needs room for one stream, not {max_streams}")
        self._max = max_streams
        self._waiting: deque[_R] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, recovery: _R) -> None:
        """Queue ``recovery`` behind those already waiting."""
        self._waiting.append(recovery)

    def discard(self, recovery: _R) -> bool:
        """Take ``recovery`` out; False if it is not waiting (taken into a batch)."""
        try:
            self._waiting.remove(recovery)
        except ValueError:
            return False
        return True

    def take_batch(self) -> list[_R]:
        """The next batch: the oldest ``max_streams`` recoveries."""
        count = min(self._max, len(self._waiting))
        return [self._waiting.popleft() for _ in range(count)]

    def take_all(self) -> list[_R]:
        """Every waiting recovery (to fail them when the reader stops)."""
        waiting = list(self._waiting)
        self._waiting.clear()
        return waiting


class SnapshotQueue(Generic[_S]):
    """Snapshot writes waiting for the next batch: at most one per stream, the newest.

    Example:
        >>> queue: SnapshotQueue[PendingSnapshot] = SnapshotQueue()
        >>> old = PendingSnapshot(SnapshotWrite("R|a", 5, b"at 5", None))
        >>> queue.add(old)
        >>> new = PendingSnapshot(SnapshotWrite("R|a", 10, b"at 10", None))
        >>> queue.add(new) is old  # the older one is replaced
        True
        >>> [p.write.seq for p in queue.take_batch()]
        [10]
    """

    def __init__(self, *, max_snapshots: int = DEFAULT_MAX_SNAPSHOT_BATCH) -> None:
        if max_snapshots < 1:
            raise ValueError(f"a snapshot batch needs room for one snapshot, not {max_snapshots}")
        self._max = max_snapshots
        self._waiting: dict[str, _S] = {}  # insertion order: the order of first arrival

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, snapshot: _S) -> _S | None:
        """Queue ``snapshot``; returns the one it displaced, if any.

        A stream keeps only its newest waiting snapshot: an older one waiting is replaced (and
        returned), and ``snapshot`` itself is returned, not queued, if the one waiting is newer
        or as new.
        """
        pid = snapshot.persistence_id
        waiting = self._waiting.get(pid)
        if waiting is not None and waiting.write.seq >= snapshot.write.seq:
            return snapshot
        self._waiting[pid] = snapshot
        return waiting

    def take_batch(self) -> list[_S]:
        """The next batch: up to ``max_snapshots`` snapshots, of distinct streams."""
        batch: list[_S] = []
        for pid in list(self._waiting)[: self._max]:
            batch.append(self._waiting.pop(pid))
        return batch

    def take_all(self) -> list[_S]:
        """Every waiting snapshot (to answer them when the writer stops)."""
        waiting = list(self._waiting.values())
        self._waiting.clear()
        return waiting


def fence_raises(requests: Iterable[tuple[str, int | None]]) -> dict[str, int]:
    """Per stream, the highest token its recoveries carry (None tokens raise nothing), sorted.

    Example:
        >>> fence_raises([("R|b", 3), ("R|a", None), ("R|b", 5), ("R|c", 1)])
        {'R|b': 5, 'R|c': 1}
    """
    raises: dict[str, int] = {}
    for pid, token in requests:
        if token is not None and (pid not in raises or raises[pid] < token):
            raises[pid] = token
    return dict(sorted(raises.items()))


@attrs.define
class StreamRead:
    """What a batched read found of one stream: its row, snapshot and events after it."""

    row: StreamRow = NEW_STREAM
    snapshot: tuple[int, bytes] | None = None
    events: list[tuple[int, bytes]] = attrs.field(factory=list)


def group_rows(
    rows: Iterable[tuple[int, str, int, int | None, bytes | None]],
) -> dict[str, StreamRead]:
    """The rows of a batched read, by stream.

    Each row is ``(kind, persistence_id, number, fence, payload)``: kind 0 a stream row (number
    the highest sequence number), 1 its snapshot (number its sequence number), 2 an event after
    the snapshot. Events come back sorted, whatever order the rows came in.
    """
    reads: dict[str, StreamRead] = {}
    for kind, pid, number, fence, payload in rows:
        read = reads.get(pid)
        if read is None:
            read = reads[pid] = StreamRead()
        if kind == 0:
            read.row = StreamRow(int(number), None if fence is None else int(fence))
        elif kind == 1:
            assert payload is not None
            read.snapshot = (int(number), bytes(payload))
        else:
            assert payload is not None
            read.events.append((int(number), bytes(payload)))
    for read in reads.values():
        read.events.sort(key=lambda e: e[0])
    return reads


def assemble_recoveries(
    requests: Sequence[tuple[str, int | None]], reads: Mapping[str, StreamRead]
) -> list[Recovery | JournalError]:
    """Each request's recovery, or its own refusal, from what the batch read after its fences.

    ``reads`` is what the batch read *after* it raised the fences (:func:`fence_raises`): a
    request whose token is below the stream's fence then was refused, with nothing changed for
    it (a token below the fence raises nothing).

    Example:
        >>> reads = {"R|a": StreamRead(StreamRow(2, 7), None, [(1, b"x"), (2, b"y")])}
        >>> ok, fenced = assemble_recoveries([("R|a", 7), ("R|a", 6)], reads)
        >>> ok.highest_seq, type(fenced).__name__
        (2, 'JournalFenced')
    """
    answers: list[Recovery | JournalError] = []
    for pid, token in requests:
        read = reads.get(pid) or StreamRead()
        try:
            admit_token(pid, read.row.fence, token)
        except JournalError as refusal:
            answers.append(refusal)
            continue
        answers.append(Recovery(read.snapshot, tuple(read.events), read.row.highest))
    return answers


@attrs.frozen
class SnapshotPlan:
    """What one transaction writes for a batch of snapshots, and the refusals it answers."""

    writes: dict[str, tuple[int, bytes]]
    """Per stream, the newest accepted snapshot ``(seq, data)``."""

    fences: dict[str, int | None]
    """The new fence of each stream whose fence the batch raises."""

    refusals: list[JournalError | None]
    """For each snapshot of the batch, in order: its refusal, or None if it is written."""


def plan_snapshots(batch: Sequence[SnapshotWrite], stored: Mapping[str, StreamRow]) -> SnapshotPlan:
    """Apply the fence and sequence rules to each snapshot of ``batch`` in order.

    ``stored`` holds the stored rows of the batch's streams, read inside the transaction. A
    snapshot is refused (fenced, or beyond the stream's last event) alone; one older than
    another accepted in the batch is accepted and written as the newer (the journal keeps only
    the newest).

    Example:
        >>> plan = plan_snapshots(
        ...     [SnapshotWrite("R|a", 2, b"s", 4), SnapshotWrite("R|b", 9, b"t", None)],
        ...     {"R|a": StreamRow(3, 1), "R|b": StreamRow(3, None)},
        ... )
        >>> plan.writes, plan.fences
        ({'R|a': (2, b's')}, {'R|a': 4})
        >>> type(plan.refusals[1]).__name__
        'JournalConflict'
    """
    rows = dict(stored)
    writes: dict[str, tuple[int, bytes]] = {}
    fences: dict[str, int | None] = {}
    refusals: list[JournalError | None] = []
    for snapshot in batch:
        pid = snapshot.persistence_id
        row = rows.get(pid, NEW_STREAM)
        try:
            fence = admit_token(pid, row.fence, snapshot.token)
            check_snapshot_seq(pid, snapshot.seq, row.highest)
        except JournalError as refusal:
            refusals.append(refusal)
            continue
        refusals.append(None)
        if fence != row.fence:
            rows[pid] = StreamRow(row.highest, fence)
            fences[pid] = fence
        if pid not in writes or writes[pid][0] < snapshot.seq:
            writes[pid] = (snapshot.seq, bytes(snapshot.data))
    return SnapshotPlan(writes, fences, refusals)
