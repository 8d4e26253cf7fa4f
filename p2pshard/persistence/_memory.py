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
  those whose time has come (a request whose caller gave up lands at its time regardless);
- :meth:`MemoryJournal.link` gives one caller (a simulated node) a view of the journal whose
  calls are in flight for as long as its ``delay`` says, as the requests of a paused process
  are.

With ``group_commit=True`` appends are group-committed as the SQL journals' are, with the same
sans-IO planner (``p2pshard.persistence._group_commit``): an append that arrives joins a queue;
while one batch is being committed (``commit_latency`` seconds on the trio clock, so a mock clock
makes it deterministic) the appends that arrive wait, and the next batch takes them (up to
``group_commit_max_events`` events and ``group_commit_max_bytes`` bytes). When a batch lands,
:func:`~p2pshard.persistence._group_commit.plan_batch` checks each of its appends in order
against the streams as they are then: a fenced one fails alone with JournalFenced, an
out-of-sequence one with JournalConflict; a failure from :meth:`MemoryJournal.fail_next` fails the
whole batch with nothing written. One batch is in flight at a time, so order per stream is kept;
an append cancelled while it waits in the queue leaves it with nothing written, one whose batch
is in flight is committed whatever its caller does. Recoveries and snapshots are not batched.

Every call the journal accepts is recorded in order (:meth:`MemoryJournal.accepted_calls`), so
that a checker can verify from the journal itself that no append was accepted under a token
lower than one the stream had already seen (``p2pshard.testing.check_journal_calls``).
"""

from __future__ import annotations

import errno
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import attrs
import trio

from .._errors import JournalConflict, JournalError, JournalFenced
from ._batching import StreamRead, assemble_recoveries, fence_raises, plan_snapshots
from ._gather import drain_snapshots, work_waiting
from ._group_commit import AppendQueue, PendingAppend, StreamRow, plan_batch, streams_of
from ._journal import (
    DEFAULT_GROUP_COMMIT_MAX_BYTES,
    DEFAULT_GROUP_COMMIT_MAX_EVENTS,
    DEFAULT_MAX_EVENT_SIZE,
    DEFAULT_SNAPSHOT_EVERY,
    Journal,
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
    batches: int = 0
    """Group commit: batches of appends committed or failed (0 without group commit)."""
    largest_batch: int = 0
    """Group commit: the most appends one batch held."""


DEFAULT_COMMIT_LATENCY = 0.002
"""Seconds one group commit of a :class:`MemoryJournal` takes by default (on the trio clock)."""


@attrs.frozen
class AcceptedCall:
    """One call a :class:`MemoryJournal` accepted, as it applied it (see ``accepted_calls``)."""

    persistence_id: str
    kind: Literal["recover", "append", "snapshot"]
    token: int | None
    """The fencing token the call carried."""
    seq: int
    """append: its first sequence number; snapshot: its sequence number; recover: the highest
    stored sequence number it read."""
    events: int
    """append: how many events it wrote; else 0."""
    at: float
    """When it was applied (trio clock)."""


@attrs.define(eq=False)
class _Waiting(PendingAppend):
    """An append in the group-commit queue, and how its caller learns the outcome."""

    done: trio.Event = attrs.field(init=False, factory=trio.Event)
    error: JournalError | None = attrs.field(init=False, default=None)

    def answer(self, error: JournalError | None) -> None:
        self.error = error
        self.done.set()


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
        group_commit: bool = False,
        commit_latency: float | Callable[[], float] = DEFAULT_COMMIT_LATENCY,
        group_commit_max_events: int = DEFAULT_GROUP_COMMIT_MAX_EVENTS,
        group_commit_max_bytes: int = DEFAULT_GROUP_COMMIT_MAX_BYTES,
    ) -> None:
        """Make an empty journal.

        Args:
            max_event_size: bytes one event or snapshot may take.
            snapshot_every: events between snapshots for entity types that do not set theirs.
            group_commit: write appends in batches, as the SQL journals do (see the module
                docstring); False (default): each append is applied alone, at once.
            commit_latency: group commit: the seconds each batch takes to commit, or a function
                called once per batch that returns them (seed its generator for a run that
                replays); a negative value counts as 0.
            group_commit_max_events: group commit: events one batch may hold.
            group_commit_max_bytes: group commit: bytes of events one batch may hold.

        Raises:
            ConfigurationError: a size or limit out of range.
            ValueError: ``commit_latency`` is a negative or not finite number.
        """
        JournalSettings(  # checks
            max_event_size=max_event_size,
            snapshot_every=snapshot_every,
            group_commit_max_events=group_commit_max_events,
            group_commit_max_bytes=group_commit_max_bytes,
        )
        if not callable(commit_latency) and not (
            isinstance(commit_latency, int | float) and 0 <= commit_latency < math.inf
        ):
            raise ValueError(
                f"commit_latency must be seconds (a finite number from 0) or a function "
                f"returning them, not {commit_latency!r}"
            )
        self._group_commit = group_commit
        self._latency: Callable[[], float] = (
            commit_latency if callable(commit_latency) else lambda: float(commit_latency)
        )
        self._queue: AppendQueue[_Waiting] = AppendQueue(
            max_events=group_commit_max_events, max_bytes=group_commit_max_bytes
        )
        self._committing = False
        self._accepted: list[AcceptedCall] = []
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
                "batches",
                "largest_batch",
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

    @property
    def group_commit(self) -> bool:
        """Whether appends are group-committed."""
        return self._group_commit

    # -- faults and inspection --------------------------------------------------------------

    def fail_next(self, count: int = 1, *, reason: str = "injected storage failure") -> None:
        """Make the next ``count`` calls fail with :class:`JournalError`, doing nothing.

        With group commit an append takes its failure when its batch commits: the whole batch
        fails (each of its appends with an error of its own), and counts as one call.
        """
        self._failing.extend([reason] * count)

    def link(self, delay: Callable[[], float]) -> Journal:
        """This journal as one caller reaches it: each call is in flight for ``delay()`` seconds.

        ``delay`` is asked at each call (0 or less: the call arrives at once). A call in flight
        arrives, and is applied, even if its caller was cancelled meanwhile, as a request sent
        over a network is: a simulated node that is paused reaches its journal this way.
        Closing the view does not close the journal.
        """
        return _Link(self, delay)

    def accepted_calls(self) -> list[AcceptedCall]:
        """Every call this journal accepted, in the order it applied them (what has landed)."""
        self._land()
        return list(self._accepted)

    def persistence_ids(self) -> list[str]:
        """Every stream that has been recovered, written or snapshotted, sorted."""
        self._land()
        return sorted(self._streams)

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
        return await self._recover(persistence_id, token, 0.0)

    async def _recover(self, persistence_id: str, token: int | None, delay: float) -> Recovery:
        check_persistence_id(persistence_id)
        check_token(token)

        def recover() -> Recovery:
            (answer,) = self._recover_now([(persistence_id, token)])
            if isinstance(answer, JournalError):
                raise answer
            return answer

        return await self._call(persistence_id, token, recover, delay)

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
        for (pid, asked), answer in zip(batch, answers, strict=True):
            if isinstance(answer, JournalError):
                self._counts["fenced"] += 1
            else:
                self._counts["recoveries"] += 1
                self._record(pid, "recover", asked, answer.highest_seq)
        return answers

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`."""
        await self._append(persistence_id, first_seq, events, token, 0.0)

    async def _append(
        self,
        persistence_id: str,
        first_seq: int,
        events: Sequence[bytes],
        token: int | None,
        delay: float,
    ) -> None:
        batch = [
            bytes(e) for e in check_append(persistence_id, first_seq, events, self._max_event_size)
        ]
        check_token(token)
        if self._group_commit:
            await self._append_grouped(
                PendingAppend(persistence_id, first_seq, batch, token), delay
            )
            return

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
            self._record(persistence_id, "append", token, first_seq, len(batch))

        await self._call(persistence_id, token, append, delay)

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.save_snapshot`."""
        await self._save_snapshot(persistence_id, seq, data, token, 0.0)

    async def _save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, token: int | None, delay: float
    ) -> None:
        (write,) = check_snapshots(
            [SnapshotWrite(persistence_id, seq, data, token)], self._max_event_size
        )

        def save() -> None:
            (refusal,) = self._save_now([write])
            if refusal is not None:
                raise refusal

        await self._call(persistence_id, token, save, delay)

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
        for write, refusal in zip(batch, plan.refusals, strict=True):
            if refusal is None:
                self._record(write.persistence_id, "snapshot", write.token, write.seq)
            else:
                self._counts["fenced" if isinstance(refusal, JournalFenced) else "conflicts"] += 1
        return plan.refusals

    async def aclose(self) -> None:
        """Refuse further calls; requests in flight are dropped, appends waiting fail.

        Snapshots queued for this journal by its entities are written first (up to a second).
        """
        if not self._closed:
            await drain_snapshots(self, 1.0)
        self._closed = True
        self._in_flight.clear()
        waiting = []
        while self._queue:
            waiting += self._queue.take_batch()
        for append in waiting:
            append.answer(JournalError(append.persistence_id, "the memory journal is closed"))

    # -- group commit -------------------------------------------------------------------------

    async def _append_grouped(self, append: PendingAppend, delay: float) -> None:
        """Queue the append when it arrives, wait for its batch, raise its refusal or failure."""
        waiting = _Waiting(append.persistence_id, append.first_seq, append.events, append.token)
        # Arriving is the request's landing: in flight, it is queued even if this task is
        # cancelled meanwhile. Failures are the batch's, drawn when it commits.
        await self._call(
            append.persistence_id, append.token, lambda: self._enqueue(waiting), delay, fails=False
        )
        try:
            await waiting.done.wait()
        except BaseException:
            self._queue.discard(waiting)  # if it still waits, it leaves with nothing written
            raise
        if waiting.error is not None:
            raise waiting.error

    def _enqueue(self, waiting: _Waiting) -> None:
        self._queue.add(waiting)
        if not self._committing:
            self._committing = True
            trio.lowlevel.spawn_system_task(self._committer, name="memory journal commits")

    async def _committer(self) -> None:
        """Commit batch after batch while appends wait, one at a time; then end.

        A system task, so that no caller's cancellation stops a batch in flight.
        """
        try:
            while True:
                if not await work_waiting(self._queue):  # the answered tasks' next appends
                    break
                batch = self._queue.take_batch()
                self._counts["batches"] += 1
                self._counts["largest_batch"] = max(self._counts["largest_batch"], len(batch))
                await trio.sleep(max(0.0, self._latency()))
                self._commit(batch)
        finally:
            self._committing = False

    def _commit(self, batch: list[_Waiting]) -> None:
        """Land ``batch``: plan it against the streams as they are now, write, answer."""
        self._land()  # what arrived while the batch was in flight comes first
        if self._closed or self._failing:
            cause = None
            if self._closed:
                why = "the memory journal was closed"
            else:
                reason = self._failing.pop(0)
                cause = OSError(errno.EIO, reason)
                why = f"storage failed: {reason}"
                self._counts["failures"] += 1
            others = f" (in one batch with {len(batch) - 1} others)" if len(batch) > 1 else ""
            for append in batch:
                error = JournalError(
                    append.persistence_id,
                    f"append at {append.first_seq}{others} failed: {why}; nothing of its batch "
                    "was written",
                )
                error.__cause__ = cause
                append.answer(error)
            return
        stored = {
            pid: StreamRow(len(self._streams[pid].events), self._streams[pid].fence)
            for pid in streams_of(batch)
            if pid in self._streams
        }
        plan = plan_batch(batch, stored)
        for pid, seq, payload in plan.events:
            stream = self._streams.setdefault(pid, _Stream())
            if seq != len(stream.events) + 1:  # the planner's promise, kept honest
                raise AssertionError(f"{pid}: plan writes {seq} after {len(stream.events)}")
            stream.events.append(payload)
        for pid, row in plan.streams.items():
            self._streams[pid].fence = row.fence
        for append, refusal in zip(batch, plan.refusals, strict=True):
            if refusal is None:
                self._counts["appends"] += 1
                self._counts["events"] += len(append.events)
                self._record(
                    append.persistence_id,
                    "append",
                    append.token,
                    append.first_seq,
                    len(append.events),
                )
            elif isinstance(refusal, JournalFenced):
                self._counts["fenced"] += 1
            elif isinstance(refusal, JournalConflict):
                self._counts["conflicts"] += 1
            append.answer(refusal)

    # -- the request model --------------------------------------------------------------------

    def _delayed(self, token: int | None) -> bool:
        return token is not None and token in self._delays

    def _record(
        self,
        persistence_id: str,
        kind: Literal["recover", "append", "snapshot"],
        token: int | None,
        seq: int,
        events: int = 0,
    ) -> None:
        self._accepted.append(
            AcceptedCall(persistence_id, kind, token, seq, events, trio.current_time())
        )

    def _admit(self, persistence_id: str, fence: int | None, token: int | None) -> int | None:
        try:
            return admit_token(persistence_id, fence, token)
        except JournalError:
            self._counts["fenced"] += 1
            raise

    async def _call(
        self,
        persistence_id: str,
        token: int | None,
        operation: Callable[[], _T],
        link_delay: float = 0.0,
        *,
        fails: bool = True,
    ) -> _T:
        if self._closed:
            raise JournalError(persistence_id, "the memory journal is closed")
        await trio.lowlevel.checkpoint()
        if fails and self._failing:
            reason = self._failing.pop(0)
            self._counts["failures"] += 1
            raise JournalError(persistence_id, f"storage failed: {reason}") from OSError(
                errno.EIO, reason
            )
        delay = None if token is None else self._delays.get(token)
        if link_delay > 0:
            delay = link_delay if delay is None else max(delay, link_delay)
        if delay is None:
            self._land()
            return operation()
        request: _InFlight[_T] = _InFlight(
            trio.current_time() + delay, next(self._order), operation
        )
        self._in_flight.append(request)
        try:
            await trio.sleep_until(request.due)
        except BaseException:
            # The caller gave up; the request still arrives when it is due (a group-committed
            # append has to join the queue then, not at whatever call comes next).
            trio.lowlevel.spawn_system_task(self._land_at, request.due, name="journal request")
            raise
        self._land()
        return request.outcome()

    async def _land_at(self, due: float) -> None:
        await trio.sleep_until(due)
        self._land()

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


class _Link:
    """A view of a :class:`MemoryJournal` whose calls are in flight for ``delay()`` seconds."""

    def __init__(self, journal: MemoryJournal, delay: Callable[[], float]) -> None:
        self._journal = journal
        self._delay = delay

    @property
    def max_event_size(self) -> int:
        """Bytes one event or snapshot may take."""
        return self._journal.max_event_size

    @property
    def snapshot_every(self) -> int | None:
        """Events between snapshots for entity types that do not set their own."""
        return self._journal.snapshot_every

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        """See :meth:`p2pshard.Journal.recover`."""
        return await self._journal._recover(persistence_id, token, self._delay())

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`."""
        await self._journal._append(persistence_id, first_seq, events, token, self._delay())

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.save_snapshot`."""
        await self._journal._save_snapshot(persistence_id, seq, data, token, self._delay())

    async def aclose(self) -> None:
        """Nothing: the journal itself stays open."""
