"""A journal in this process's memory, on the trio clock: for tests and the simulated cluster.

Every node of a simulated cluster in one ``trio.run`` can share one :class:`MemoryJournal`, as
the nodes of a real cluster share a database. The rules (fences, sequence numbers, sizes) are
those of every backend (``p2pshard.persistence._journal``). Faults for tests:

- :meth:`MemoryJournal.fail_next` makes the next calls fail as a storage failure would, with
  nothing done;
- :meth:`MemoryJournal.delay_token` makes the calls that carry one fencing token take time to
  reach the journal, as the requests of a paused or partitioned lease holder do. Such a request
  is *in flight*: it is applied when it arrives even if its caller has given up waiting (was
  cancelled), as a request already sent over a network is. Requests are applied in the order
  they arrive; a later call, or any inspection (:meth:`MemoryJournal.events`), first applies
  those whose time has come.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import trio

from .._errors import JournalError, JournalFenced
from ._batching import StreamRead, assemble_recoveries, fence_raises, plan_snapshots
from ._gather import drain_snapshots
from ._group_commit import StreamRow
from ._journal import (
    DEFAULT_MAX_EVENT_SIZE,
    DEFAULT_SNAPSHOT_EVERY,
    JournalSettings,
    Recovery,
    SnapshotWrite,
    admit_token,
    check_append,
    check_next,
    check_persistence_id,
    check_recoveries,
    check_snapshots,
    check_token,
)

_T = TypeVar("_T")


def _each(pid: str, exc: JournalError) -> JournalError:
    """The failure of a whole batch, as the error of its member ``pid``."""
    if exc.persistence_id == pid:
        return exc
    error = JournalError(pid, str(exc).split(": ", 1)[-1])
    error.__cause__ = exc
    return error


@attrs.define
class _Stream:
    events: list[bytes] = attrs.field(factory=list)
    fence: int | None = None
    snapshot: tuple[int, bytes] | None = None


@attrs.frozen
class MemoryJournalStatistics:
    """What a :class:`MemoryJournal` has done since it was made."""

    appends: int
    """Appends that were written."""
    events: int
    """Events written, over all streams."""
    snapshots: int
    """Snapshots written."""
    recoveries: int
    """Recoveries answered."""
    fenced: int
    """Calls refused with JournalFenced."""
    conflicts: int
    """Calls refused with JournalConflict."""
    failures: int
    """Calls failed by :meth:`MemoryJournal.fail_next`."""
    in_flight: int
    """Delayed requests that have not arrived yet."""
    recovery_batches: int = 0
    """``recover_many`` calls answered (``recover`` not included): the batched reads."""
    snapshot_batches: int = 0
    """``save_snapshots`` calls answered (``save_snapshot`` not included)."""


class _InFlight(Generic[_T]):
    __slots__ = ("due", "error", "operation", "order", "result")

    def __init__(self, due: float, order: int, operation: Callable[[], _T]) -> None:
        self.due = due
        self.order = order
        self.operation: Callable[[], _T] | None = operation
        self.result: _T | None = None
        self.error: Exception | None = None

    def land(self) -> None:
        operation, self.operation = self.operation, None
        if operation is not None:
            try:
                self.result = operation()
            except Exception as exc:  # the answer that travels back: raised to the caller
                self.error = exc

    def outcome(self) -> _T:
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


class MemoryJournal:
    """Event streams in memory, shared by everything in one process that holds this object.

    Example:
        >>> async def main() -> None:
        ...     journal = MemoryJournal()
        ...     await journal.append("Room|lobby", 1, [b"joined"], token=None)
        ...     assert (await journal.recover("Room|lobby", None)).highest_seq == 1
    """

    def __init__(
        self,
        *,
        max_event_size: int = DEFAULT_MAX_EVENT_SIZE,
        snapshot_every: int | None = DEFAULT_SNAPSHOT_EVERY,
    ) -> None:
        JournalSettings(max_event_size=max_event_size, snapshot_every=snapshot_every)  # checks
        self._max_event_size = max_event_size
        self._snapshot_every = snapshot_every
        self._streams: dict[str, _Stream] = {}
        self._failing: list[str] = []
        self._delays: dict[int, float] = {}
        self._in_flight: list[_InFlight[Any]] = []
        self._order = itertools.count()
        self._closed = False
        self._counts = dict.fromkeys(
            (
                "appends",
                "events",
                "snapshots",
                "recoveries",
                "fenced",
                "conflicts",
                "failures",
                "recovery_batches",
                "snapshot_batches",
            ),
            0,
        )

    @property
    def max_event_size(self) -> int:
        """Bytes one event or snapshot may take."""
        return self._max_event_size

    @property
    def snapshot_every(self) -> int | None:
        """Events between snapshots for entity types that do not set their own."""
        return self._snapshot_every

    # -- faults and inspection --------------------------------------------------------------

    def fail_next(self, count: int = 1, *, reason: str = "injected storage failure") -> None:
        """Make the next ``count`` calls fail with :class:`JournalError`, doing nothing."""
        self._failing.extend([reason] * count)

    def delay_token(self, token: int, seconds: float | None) -> None:
        """Calls carrying ``token`` arrive ``seconds`` after they are made (None: at once again).

        They are applied on arrival even if the caller was cancelled meanwhile.
        """
        if seconds is None:
            self._delays.pop(token, None)
        else:
            self._delays[token] = seconds

    def events(self, persistence_id: str) -> list[bytes]:
        """The stored events of ``persistence_id``, in order (after what has arrived landed)."""
        self._land()
        stream = self._streams.get(persistence_id)
        return [] if stream is None else list(stream.events)

    def fence(self, persistence_id: str) -> int | None:
        """The stream's fence: the largest token it has admitted (None: none yet)."""
        self._land()
        stream = self._streams.get(persistence_id)
        return None if stream is None else stream.fence

    def snapshot(self, persistence_id: str) -> tuple[int, bytes] | None:
        """The stream's stored snapshot as ``(sequence number, data)``, or None."""
        self._land()
        stream = self._streams.get(persistence_id)
        return None if stream is None else stream.snapshot

    def statistics(self) -> MemoryJournalStatistics:
        """What this journal has done, for tests."""
        self._land()
        counts = dict(self._counts)
        return MemoryJournalStatistics(**counts, in_flight=len(self._in_flight))

    # -- the Journal interface --------------------------------------------------------------

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        """See :meth:`p2pshard.Journal.recover`."""
        check_persistence_id(persistence_id)
        check_token(token)

        def recover() -> Recovery:
            (answer,) = self._recover_now([(persistence_id, token)])
            if isinstance(answer, JournalError):
                raise answer
            return answer

        return await self._call(persistence_id, token, recover)

    async def recover_many(
        self, requests: Sequence[tuple[str, int | None]]
    ) -> list[Recovery | JournalError]:
        """See :meth:`p2pshard.BatchJournal.recover_many`.

        Requests whose token is delayed (:meth:`delay_token`) travel alone, as with
        :meth:`recover`; the others are answered together, in one step.
        """
        batch = check_recoveries(requests)
        delayed = [i for i, (_, token) in enumerate(batch) if self._delayed(token)]
        answers: list[Recovery | JournalError | None] = [None] * len(batch)

        async def alone(i: int) -> None:
            pid, token = batch[i]
            try:
                answers[i] = await self.recover(pid, token)
            except JournalError as exc:
                answers[i] = exc

        together = [i for i in range(len(batch)) if i not in set(delayed)]
        async with trio.open_nursery() as nursery:
            for i in delayed:
                nursery.start_soon(alone, i)
            if together:
                self._counts["recovery_batches"] += 1
                first = batch[together[0]][0]
                try:
                    read = await self._call(
                        first, None, lambda: self._recover_now([batch[i] for i in together])
                    )
                except JournalError as exc:
                    read = [_each(batch[i][0], exc) for i in together]
                for i, answer in zip(together, read, strict=True):
                    answers[i] = answer
        return [a for a in answers if a is not None]

    def _recover_now(
        self, batch: Sequence[tuple[str, int | None]]
    ) -> list[Recovery | JournalError]:
        """Raise the fences the batch asks for, then read each stream (the SQL backends' way)."""
        for pid, token in fence_raises(batch).items():
            stream = self._streams.setdefault(pid, _Stream())
            if stream.fence is None or stream.fence < token:
                stream.fence = token
        reads: dict[str, StreamRead] = {}
        for pid, _ in batch:
            found = self._streams.get(pid)
            if found is None:
                continue
            start = 0 if found.snapshot is None else found.snapshot[0]
            reads[pid] = StreamRead(
                StreamRow(len(found.events), found.fence),
                found.snapshot,
                list(enumerate(found.events[start:], start + 1)),
            )
        answers = assemble_recoveries(batch, reads)
        for answer in answers:
            self._counts["fenced" if isinstance(answer, JournalError) else "recoveries"] += 1
        return answers

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`."""
        batch = [
            bytes(e) for e in check_append(persistence_id, first_seq, events, self._max_event_size)
        ]
        check_token(token)

        def append() -> None:
            stream = self._streams.setdefault(persistence_id, _Stream())
            fence = self._admit(persistence_id, stream.fence, token)
            try:
                check_next(persistence_id, first_seq, len(stream.events))
            except JournalError:
                self._counts["conflicts"] += 1
                raise
            stream.fence = fence
            stream.events.extend(batch)
            self._counts["appends"] += 1
            self._counts["events"] += len(batch)

        await self._call(persistence_id, token, append)

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.save_snapshot`."""
        (write,) = check_snapshots(
            [SnapshotWrite(persistence_id, seq, data, token)], self._max_event_size
        )

        def save() -> None:
            (refusal,) = self._save_now([write])
            if refusal is not None:
                raise refusal

        await self._call(persistence_id, token, save)

    async def save_snapshots(self, snapshots: Sequence[SnapshotWrite]) -> list[JournalError | None]:
        """See :meth:`p2pshard.BatchJournal.save_snapshots` (one step; delays as the first's)."""
        batch = check_snapshots(snapshots, self._max_event_size)
        if not batch:
            return []
        self._counts["snapshot_batches"] += 1
        first = batch[0]
        try:
            return await self._call(
                first.persistence_id, first.token, lambda: self._save_now(batch)
            )
        except JournalError as exc:
            return [_each(s.persistence_id, exc) for s in batch]

    def _save_now(self, batch: Sequence[SnapshotWrite]) -> list[JournalError | None]:
        rows = {
            s.persistence_id: StreamRow(len(stream.events), stream.fence)
            for s in batch
            if (stream := self._streams.get(s.persistence_id)) is not None
        }
        plan = plan_snapshots(batch, rows)
        for pid, fence in plan.fences.items():
            self._streams[pid].fence = fence
        for pid, (seq, data) in plan.writes.items():
            stream = self._streams[pid]
            if stream.snapshot is None or stream.snapshot[0] < seq:
                stream.snapshot = (seq, data)
                self._counts["snapshots"] += 1
        for refusal in plan.refusals:
            if refusal is not None:
                self._counts["fenced" if isinstance(refusal, JournalFenced) else "conflicts"] += 1
        return plan.refusals

    async def aclose(self) -> None:
        """Refuse further calls; requests in flight are dropped.

        Snapshots queued for this journal by its entities are written first (up to a second).
        """
        if not self._closed:
            await drain_snapshots(self, 1.0)
        self._closed = True
        self._in_flight.clear()

    # -- the request model --------------------------------------------------------------------

    def _delayed(self, token: int | None) -> bool:
        return token is not None and token in self._delays

    def _admit(self, persistence_id: str, fence: int | None, token: int | None) -> int | None:
        try:
            return admit_token(persistence_id, fence, token)
        except JournalError:
            self._counts["fenced"] += 1
            raise

    async def _call(
        self, persistence_id: str, token: int | None, operation: Callable[[], _T]
    ) -> _T:
        if self._closed:
            raise JournalError(persistence_id, "the memory journal is closed")
        await trio.lowlevel.checkpoint()
        if self._failing:
            reason = self._failing.pop(0)
            self._counts["failures"] += 1
            raise JournalError(persistence_id, f"storage failed: {reason}") from OSError(
                errno.EIO, reason
            )
        delay = None if token is None else self._delays.get(token)
        if delay is None:
            self._land()
            return operation()
        request: _InFlight[_T] = _InFlight(
            trio.current_time() + delay, next(self._order), operation
        )
        self._in_flight.append(request)
        await trio.sleep_until(request.due)
        self._land()
        return request.outcome()

    def _land(self) -> None:
        """Apply the requests in flight whose time has come, in the order they arrive."""
        if not self._in_flight:
            return
        now = trio.current_time()
        arrived = sorted(
            (r for r in self._in_flight if r.due <= now), key=lambda r: (r.due, r.order)
        )
        for request in arrived:
            self._in_flight.remove(request)
            request.land()
