"""The entity side of a journal: recoveries gathered into batched reads, snapshots written behind.

Theory of operation. Every journal object has one :class:`JournalBatcher` (made on first use,
kept in a weak mapping as the append counters are, so a journal implementation need not know of
it), shared by the event-sourced entities of this process that use that journal. It holds two
queues (``p2pshard.persistence._batching``, sans-IO) and, while either has work, one trio system
task per queue that empties it; the task ends when its queue is empty, and the next request
starts another. No entity has a task of its own.

- :meth:`JournalBatcher.recover`: the entity's recovery joins the recovery queue and waits for
  its answer. The reader task takes the waiting recoveries (up to ``max_recovery_batch``) and
  reads them with one :meth:`p2pshard.BatchJournal.recover_many` call, one transaction; then the
  next batch, so recoveries that arrive while one batch is read are served together by the next.
  A lone recovery is read at once. Each entity gets its own recovery or its own error (a stale
  token fails only that stream; a storage failure fails the batch, each with an error naming its
  stream). A recovery cancelled while it waits leaves the queue; once in a batch, its answer is
  dropped. A journal without ``recover_many`` is called once per recovery, as before.
- :meth:`JournalBatcher.save_snapshot_later`: the entity hands the encoded snapshot over and
  returns at once; the writer task writes the waiting snapshots of many entities with one
  :meth:`p2pshard.BatchJournal.save_snapshots` call (or, for a journal without it, one
  ``save_snapshot`` per snapshot, concurrently) and tells each entity the outcome through the
  callback it gave. One batch is written at a time and the queue keeps one snapshot per stream,
  the newest (a newer snapshot of a stream replaces a waiting older one, whose callback hears
  that it was superseded), so a stream never has two snapshot writes in flight. A snapshot that
  becomes due while its stream's previous one is being written waits for the next batch rather
  than being skipped: the state it holds is newer, and the one in flight may fail.

A snapshot request outlives the incarnation that made it: an entity that stops (passivation,
hand-off, shutdown) does not wait for it, and it is written as any other (a snapshot at sequence
number N is the state after event N whatever came after; a stale holder's is refused by the
fence, harmlessly). :func:`drain_snapshots` waits, within a bound, for the snapshots still
queued; the bundled journals call it when they close. A write cut short (the journal's timeout,
the trio run ending) is one transaction: it is written whole or not at all, and recovery reads
the previous snapshot and a longer tail.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from .._errors import JournalError
from ._batching import (
    DEFAULT_MAX_RECOVERY_BATCH,
    DEFAULT_MAX_SNAPSHOT_BATCH,
    PendingRecovery,
    PendingSnapshot,
    RecoveryQueue,
    SnapshotQueue,
)
from ._journal import Journal, Recovery, SnapshotWrite, check_size

logger = logging.getLogger("p2pshard.persistence")


@attrs.define(eq=False)
class _RecoveryTicket(PendingRecovery):
    done: trio.Event = attrs.field(init=False, factory=trio.Event)
    answer: Recovery | JournalError | None = attrs.field(init=False, default=None)

    def give(self, answer: Recovery | JournalError) -> None:
        self.answer = answer
        self.done.set()


SnapshotOutcome = Callable[["SnapshotTicket"], None]
"""Told once what became of a snapshot; called in the writer's task, must not block or raise."""


@attrs.define(eq=False)
class SnapshotTicket(PendingSnapshot):
    """A snapshot handed to the writer, and what became of it."""

    on_done: SnapshotOutcome
    superseded: bool = attrs.field(init=False, default=False)
    """A newer snapshot of the stream replaced it before it was written."""
    error: JournalError | None = attrs.field(init=False, default=None)
    """Its refusal or failure; None if it was written (or superseded)."""

    def settle(self, error: JournalError | None, *, superseded: bool = False) -> None:
        self.error, self.superseded = error, superseded
        try:
            self.on_done(self)
        except Exception:  # the writer serves every entity: one callback's bug stops none
            logger.exception("%s: the snapshot callback raised", self.persistence_id)


@attrs.frozen(kw_only=True)
class BatcherStatistics:
    """What a journal's batcher has done since it was made (for tests and benchmarks)."""

    recovery_batches: int
    """Batched reads begun (``recover_many`` calls, or single recoveries without it)."""
    recoveries: int
    """Recoveries answered."""
    largest_recovery_batch: int
    """The most recoveries one read held."""
    snapshot_batches: int
    """Snapshot batches begun."""
    snapshots: int
    """Snapshots answered (written, refused or failed)."""
    superseded: int
    """Snapshots replaced by a newer one of their stream before they were written."""


def _batch_error(pid: str, exc: BaseException, size: int, what: str) -> JournalError:
    if size == 1 and isinstance(exc, JournalError) and exc.persistence_id == pid:
        return exc
    text = str(exc).strip() or type(exc).__name__
    error = JournalError(pid, f"{what} (in one batch with {size - 1} others) failed: {text}")
    error.__cause__ = exc
    return error


class JournalBatcher:
    """The recovery queue and snapshot writer of one journal object.

    Example:
        >>> async def recover(journal: Journal) -> Recovery:
        ...     return await journal_batcher(journal).recover("Room|lobby", None)
    """

    def __init__(
        self,
        journal: Journal,
        *,
        max_recovery_batch: int = DEFAULT_MAX_RECOVERY_BATCH,
        max_snapshot_batch: int = DEFAULT_MAX_SNAPSHOT_BATCH,
    ) -> None:
        self._journal = journal
        self._recoveries: RecoveryQueue[_RecoveryTicket] = RecoveryQueue(
            max_streams=max_recovery_batch
        )
        self._snapshots: SnapshotQueue[SnapshotTicket] = SnapshotQueue(
            max_snapshots=max_snapshot_batch
        )
        self._reading = False
        self._writing = False
        self._idle = trio.Event()
        self._idle.set()
        self._counts = dict.fromkeys(
            (
                "recovery_batches",
                "recoveries",
                "largest_recovery_batch",
                "snapshot_batches",
                "snapshots",
                "superseded",
            ),
            0,
        )

    def statistics(self) -> BatcherStatistics:
        """What this batcher has done."""
        return BatcherStatistics(**self._counts)

    # -- recoveries ---------------------------------------------------------------------------

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        """The stream's recovery, read with the other recoveries waiting (see the module).

        Raises:
            JournalError: as :meth:`p2pshard.Journal.recover`.
        """
        if getattr(self._journal, "recover_many", None) is None:
            self._counts["recovery_batches"] += 1
            self._counts["recoveries"] += 1
            self._counts["largest_recovery_batch"] = max(1, self._counts["largest_recovery_batch"])
            return await self._journal.recover(persistence_id, token)
        ticket = _RecoveryTicket(persistence_id, token)
        self._recoveries.add(ticket)
        if not self._reading:
            self._reading = True
            trio.lowlevel.spawn_system_task(self._read_batches, name="journal recoveries")
        try:
            await ticket.done.wait()
        except BaseException:
            self._recoveries.discard(ticket)
            raise
        answer = ticket.answer
        if isinstance(answer, JournalError):
            raise answer
        assert answer is not None
        return answer

    async def _read_batches(self) -> None:
        recover_many = self._journal.recover_many  # type: ignore[attr-defined]
        counts = self._counts
        try:
            while True:
                if not await work_waiting(self._recoveries):
                    break
                batch = self._recoveries.take_batch()
                counts["recovery_batches"] += 1
                counts["largest_recovery_batch"] = max(counts["largest_recovery_batch"], len(batch))
                requests = [(t.persistence_id, t.token) for t in batch]
                try:
                    answers: Sequence[Any] = await recover_many(requests)
                    if len(answers) != len(batch):
                        raise JournalError(
                            batch[0].persistence_id,
                            f"recover_many answered {len(answers)} of {len(batch)} recoveries",
                        )
                except Exception as exc:
                    answers = [
                        _batch_error(t.persistence_id, exc, len(batch), "recovery") for t in batch
                    ]
                except BaseException as exc:
                    for t in batch:
                        t.give(_batch_error(t.persistence_id, exc, len(batch), "recovery"))
                    raise
                counts["recoveries"] += len(batch)
                for ticket, answer in zip(batch, answers, strict=True):
                    ticket.give(answer)
        finally:
            self._reading = False
            for t in self._recoveries.take_all():
                t.give(JournalError(t.persistence_id, "the journal's recovery reader stopped"))

    # -- snapshots ----------------------------------------------------------------------------

    def save_snapshot_later(
        self,
        persistence_id: str,
        seq: int,
        data: bytes,
        *,
        token: int | None,
        on_done: SnapshotOutcome,
    ) -> SnapshotTicket:
        """Queue the snapshot for the writer and return at once; ``on_done`` hears the outcome.

        Raises:
            EventTooLarge: ``data`` is above the journal's ``max_event_size`` (nothing queued).
        """
        check_size(persistence_id, f"snapshot at {seq}", data, self._journal.max_event_size)
        ticket = SnapshotTicket(SnapshotWrite(persistence_id, seq, bytes(data), token), on_done)
        displaced = self._snapshots.add(ticket)
        if displaced is not None:
            self._counts["superseded"] += 1
            displaced.settle(None, superseded=True)
        if not self._writing and self._snapshots:
            self._writing = True
            self._idle = trio.Event()
            trio.lowlevel.spawn_system_task(self._write_batches, name="journal snapshots")
        return ticket

    async def drain(self, within: float) -> bool:
        """Wait up to ``within`` seconds for the queued snapshots; True if none is left."""
        with trio.move_on_after(within):
            await self._idle.wait()
        return self._idle.is_set()

    async def _write_batches(self) -> None:
        counts = self._counts
        try:
            while True:
                if not await work_waiting(self._snapshots):
                    break
                batch = self._snapshots.take_batch()
                counts["snapshot_batches"] += 1
                try:
                    outcomes = await self._write(batch)
                except BaseException as exc:
                    for t in batch:
                        t.settle(_batch_error(t.persistence_id, exc, len(batch), "snapshot"))
                    raise
                counts["snapshots"] += len(batch)
                for ticket, outcome in zip(batch, outcomes, strict=True):
                    ticket.settle(outcome)
        finally:
            self._writing = False
            for t in self._snapshots.take_all():
                t.settle(JournalError(t.persistence_id, "the journal's snapshot writer stopped"))
            self._idle.set()

    async def _write(self, batch: list[SnapshotTicket]) -> list[JournalError | None]:
        journal = self._journal
        save_snapshots = getattr(journal, "save_snapshots", None)
        if save_snapshots is not None:
            try:
                outcomes: list[JournalError | None] = await save_snapshots([t.write for t in batch])
                if len(outcomes) != len(batch):
                    raise JournalError(
                        batch[0].persistence_id,
                        f"save_snapshots answered {len(outcomes)} of {len(batch)} snapshots",
                    )
            except Exception as exc:
                return [_batch_error(t.persistence_id, exc, len(batch), "snapshot") for t in batch]
            return outcomes
        outcomes = [None] * len(batch)

        async def one(i: int, write: SnapshotWrite) -> None:
            try:
                await journal.save_snapshot(
                    write.persistence_id, write.seq, write.data, token=write.token
                )
            except Exception as exc:
                outcomes[i] = _batch_error(write.persistence_id, exc, 1, "snapshot")

        async with trio.open_nursery() as nursery:
            for i, ticket in enumerate(batch):
                nursery.start_soon(one, i, ticket.write)
        return outcomes


async def work_waiting(queue: object) -> bool:
    """Whether ``queue`` has work, once the tasks just answered have had the chance to add theirs.

    ``queue`` is anything true while it holds work. The journals' batch loops (appends,
    recoveries, snapshots) call it before they end. Two scheduling rounds (trio may run this
    task before or after them in the first), so that what they ask next goes out in one batch
    rather than one alone first.
    """
    if not queue:
        await trio.lowlevel.cancel_shielded_checkpoint()
        await trio.lowlevel.cancel_shielded_checkpoint()
    return bool(queue)


_BATCHERS: weakref.WeakKeyDictionary[object, JournalBatcher] = weakref.WeakKeyDictionary()


def journal_batcher(journal: Journal) -> JournalBatcher:
    """The batcher of ``journal`` (made on first use; one per journal object)."""
    try:
        batcher = _BATCHERS.get(journal)
        if batcher is None:
            batcher = _BATCHERS[journal] = JournalBatcher(journal)
    except TypeError:  # not hashable, or no weak reference: a batcher of the caller's own
        return JournalBatcher(journal)
    return batcher


async def drain_snapshots(journal: object, within: float) -> bool:
    """Wait up to ``within`` seconds for ``journal``'s queued snapshot writes to finish.

    True if none is left (also when this process never queued one).

    Example:
        >>> async def close(journal: Journal) -> None:
        ...     await drain_snapshots(journal, 5.0)
        ...     await journal.aclose()
    """
    try:
        batcher = _BATCHERS.get(journal)
    except TypeError:
        return True
    return True if batcher is None else await batcher.drain(within)
