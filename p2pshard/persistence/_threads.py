"""What the SQL journals share: a pool of blocking connections used from trio worker threads.

Theory of operation: every journal call is one transaction, run by :meth:`ThreadedJournal._run`
in a worker thread (at most ``threads`` at a time, by a capacity limiter) on a connection taken
from a small pool and given back after. The hand-off to the thread is :func:`_in_worker_thread`,
``trio.to_thread.run_sync`` without what a journal's call does not use, which is much of a lone
append's cost beside the database's own. The first call creates the tables, once (later calls
wait for it; appends waiting for them go on in the order they came, and any append that comes
while some still wait lines up behind them, so that none passes an earlier one of its stream).
A call has ``operation_timeout`` seconds in all: past it the thread is abandoned and the caller
gets a :class:`p2pshard.JournalError` saying the outcome is unknown. A refusal by the journal's
rules (:class:`p2pshard.JournalError` raised inside the transaction) gives the connection back;
any other failure closes it, so the next call starts on a clean one. A
backend provides the connection (``_connect``, ``_usable``), the table creation (``_create``),
one transaction around a function (``_transaction``), the errors its driver raises
(``_driver_errors``) and how it names itself in messages (``_describe``).

Appends are group-committed (the rules: ``p2pshard.persistence._group_commit``). An append that
finds nothing being committed commits itself at once, in its own task. Appends arriving
meanwhile join the journal's queue and wait for their answer, and the journal's committer, a
trio system task, takes over: when a commit slot is free it takes the next batch from the queue
(the oldest appends, within the limits), writes it in one transaction in a worker thread of its
own on a pooled connection (the backend's ``_write_batch``), answers each append of the batch
(success, its refusal, or for a storage error the failure of all of them), and goes on until
the queue is empty and nothing is in flight, and ends. A lone append therefore commits at once;
appends arriving during a commit go out together in the next. A backend may have more than one
batch in flight (``_commits_at_once``: PostgreSQL two, each on a connection of its own; SQLite
one, as its writers take turns anyway): the committer then sends the next batch while another
is being committed, and the server writes one while the node answers the other's appends. A
batch leaves out the streams of the batches in flight (their appends wait, in their order), so
an append is checked only once the one before it on its stream has committed, and order per
stream is kept. This overlap starts at ``OVERLAP_FROM`` outstanding appends (waiting and in
flight); then each batch takes an equal share of them (a smaller one when none is in flight, so
that the batches go out staggered rather than together); the rule is
``p2pshard.persistence._group_commit.batch_share``. Under lighter load one batch goes at a
time, as its cost is then mostly a round trip and an fsync. Each commit is shielded from
cancellation and bounded by ``operation_timeout`` (after it, every append of the batch fails
with an unknown outcome). An append cancelled while it waits in the queue leaves it with nothing
written; one still waiting when its ``operation_timeout`` has passed is failed, with nothing
written, when its turn comes (so an append waits at most about twice ``operation_timeout``: the
commit before it, then its own).

When the backend has upkeep due after a commit (``_upkeep_after``: SQLite checkpoints its
write-ahead log), the answers go out from the worker thread the moment the transaction has
committed, and the upkeep runs after them in the same thread, while the answered tasks prepare
their next appends; the next batch waits for it. An upkeep that fails or outlasts
``operation_timeout`` is logged and the appends before it stay acknowledged.

Recoveries and snapshots come in batches too (:class:`p2pshard.BatchJournal`; the entity side
gathers them, ``p2pshard.persistence._gather``): :meth:`ThreadedJournal.recover_many` is one
call on one connection that raises the fences the batch's tokens ask for and reads every
stream's row, snapshot and later events with one query (:data:`RECOVERY_READ`), in one
transaction; :meth:`ThreadedJournal.save_snapshots` checks each snapshot against the stored
stream rows (``p2pshard.persistence._batching.plan_snapshots``) and writes those that pass in
one transaction. ``recover`` and ``save_snapshot`` are batches of one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import trio

from .._errors import JournalError
from ._batching import StreamRead, assemble_recoveries
from ._gather import drain_snapshots, work_waiting
from ._group_commit import OVERLAP_FROM, AppendQueue, PendingAppend, batch_share
from ._journal import (
    JournalSettings,
    Recovery,
    SnapshotWrite,
    check_append,
    check_recoveries,
    check_snapshots,
    check_token,
)

logger = logging.getLogger("p2pshard.persistence")

Conn = TypeVar("Conn")
_T = TypeVar("_T")


RECOVERY_READ = (
    "SELECT 0, persistence_id, highest, fence, NULL FROM p2pshard_journal_streams "
    "WHERE persistence_id {match} "
    "UNION ALL SELECT 1, persistence_id, seq, NULL, payload FROM p2pshard_journal_snapshots "
    "WHERE persistence_id {match} "
    "UNION ALL SELECT 2, e.persistence_id, e.seq, NULL, e.payload "
    "FROM p2pshard_journal_events AS e "
    "LEFT JOIN p2pshard_journal_snapshots AS s ON s.persistence_id = e.persistence_id "
    "WHERE e.persistence_id {match} AND e.seq > COALESCE(s.seq, 0)"
)
"""One query that reads, for the streams ``{match}`` selects (three times the same list), each
stream's row, snapshot and the events after it, as the rows
:func:`p2pshard.persistence._batching.group_rows` takes. One statement reads one consistent
state: an append writes its events and its stream's row in one transaction."""


async def _in_worker_thread(fn: Callable[[], _T], limiter: trio.CapacityLimiter) -> _T:
    """``fn()`` in a worker thread of trio's, holding a token of ``limiter`` while it runs.

    Cancellation abandons the thread: the call raises at once, the thread runs on, its result
    is dropped, and its token goes back when it ends. That is what ``trio.to_thread.run_sync(fn,
    limiter=limiter, abandon_on_cancel=True)`` does, without what a journal's call does not use
    (the caller's context variables, a name for the thread, the way back for
    ``trio.from_thread``) and without its extra turn through the scheduler while a token is
    free: every append's commit goes through here, a lone one on its own, and this costs it
    about 60 µs less (125 against 186 µs on this machine, for a function that returns at once).
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    borrower = object()  # its own: a task may go on while a thread it abandoned holds a token
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    waiting = True

    def back(result: Any) -> None:  # in the trio thread, once fn has ended
        limiter.release_on_behalf_of(borrower)
        if waiting:
            trio.lowlevel.reschedule(task, result)

    def deliver(result: Any) -> None:  # in the worker thread: fn's outcome
        with contextlib.suppress(trio.RunFinishedError):  # abandoned, and trio has ended since
            token.run_sync_soon(back, result)

    try:
        trio.lowlevel.start_thread_soon(fn, deliver)
    except BaseException:
        limiter.release_on_behalf_of(borrower)
        raise

    def abandon(_: object) -> trio.lowlevel.Abort:
        nonlocal waiting
        waiting = False
        return trio.lowlevel.Abort.SUCCEEDED

    value: _T = await trio.lowlevel.wait_task_rescheduled(abandon)
    return value


def _each(pid: str, exc: JournalError, size: int, what: str) -> JournalError:
    """The failure of a batch of ``size``, as the error of its member ``pid``."""
    if size == 1:
        return exc
    text = str(exc).split(": ", 1)[-1]
    error = JournalError(pid, f"{what} (in one batch with {size - 1} others): {text}")
    error.__cause__ = exc
    return error


@attrs.frozen(kw_only=True)
class GroupCommitStatistics:
    """What a SQL journal's group commit has done since the journal was made."""

    batches: int
    """Transactions of appends begun."""
    commits: int
    """Transactions of appends committed."""
    appends: int
    """Appends those transactions wrote."""
    refused: int
    """Appends refused alone in them (fenced, out of sequence)."""
    failed: int
    """Appends failed with their whole batch (storage error, timeout)."""
    largest_batch: int
    """The most appends one transaction held."""
    most_in_flight: int = 0
    """The most transactions of appends being committed at once (PostgreSQL: up to two)."""
    recovery_batches: int = 0
    """Batched recoveries read (``recover_many`` calls, ``recover`` included): transactions."""
    recoveries: int = 0
    """Streams those batched recoveries read."""
    snapshot_batches: int = 0
    """Batched snapshot writes (``save_snapshots`` calls, ``save_snapshot`` included)."""
    snapshots: int = 0
    """Snapshots in those batches."""


@attrs.define(eq=False)
class _Ticket(PendingAppend):
    """A waiting append and how its task learns the outcome."""

    deadline: float = attrs.field(kw_only=True)
    """Past it (trio's clock) the append is not taken into a batch any more."""
    error: JournalError | None = attrs.field(init=False, default=None)
    _waiter: trio.lowlevel.Task | None = attrs.field(init=False, default=None)

    def answer(self, error: JournalError | None) -> None:
        self.error = error
        if self._waiter is not None:
            trio.lowlevel.reschedule(self._waiter)
            self._waiter = None

    def park(self) -> Callable[[object], trio.lowlevel.Abort]:
        """Before the task waits for the answer (it must not be answered yet): its abort.

        The waiting itself is ``trio.lowlevel.wait_task_rescheduled(ticket.park())`` in the
        append's own coroutine: a ``trio.Event``, or a coroutine of the ticket's, would cost
        more, once per append.
        """
        self._waiter = trio.lowlevel.current_task()
        return self._abort

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._waiter = None  # cancelled: the answer, if one comes, wakes nobody
        return trio.lowlevel.Abort.SUCCEEDED


class ThreadedJournal(Generic[Conn]):
    """The pool, the timeout and the error handling of a journal over blocking connections."""

    _driver_errors: tuple[type[BaseException], ...] = (OSError,)
    """Exceptions of the driver that mean "this call failed" (a JournalError to the caller)."""

    _commits_at_once = 1
    """Batches of appends in flight at once, each on a connection of its own (on streams of
    their own). One for a backend whose writers take turns anyway (SQLite)."""

    _overlap_from = OVERLAP_FROM
    """Outstanding appends from which a batch goes out beside another (``OVERLAP_FROM``)."""

    def __init__(self, settings: JournalSettings, threads: int) -> None:
        self._timeout = settings.operation_timeout
        self._max_event_size = settings.max_event_size
        self._snapshot_every = settings.snapshot_every
        self._limiter = trio.CapacityLimiter(threads)
        self._idle: list[Conn] = []
        self._pool_lock = threading.Lock()
        self._ready = False
        self._creating = trio.Lock()
        self._waiting_for_tables = 0
        """Calls in line for the tables (:meth:`_ensure_tables`), until each is through."""
        self._closed = False
        self._queue: AppendQueue[_Ticket] = AppendQueue(
            max_events=settings.group_commit_max_events,
            max_bytes=settings.group_commit_max_bytes,
        )
        self._committer_running = False
        self._in_flight = 0
        """Batches of appends being committed (a lone append's included)."""
        self._appends_in_flight = 0
        self._busy: set[str] = set()
        """The streams of the batches in flight (a stream is in one of them at most)."""
        self._commit_done = trio.lowlevel.ParkingLot()
        self._commit_limiter = trio.CapacityLimiter(self._commits_at_once)
        self._counts = dict.fromkeys(
            (
                "batches",
                "commits",
                "appends",
                "refused",
                "failed",
                "largest_batch",
                "most_in_flight",
                "recovery_batches",
                "recoveries",
                "snapshot_batches",
                "snapshots",
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

    def group_commit_statistics(self) -> GroupCommitStatistics:
        """What the group commit of appends has done since this journal was made.

        Example:
            >>> journal.group_commit_statistics().commits  # doctest: +SKIP
            12
        """
        return GroupCommitStatistics(**self._counts)

    # -- what a backend provides --------------------------------------------------------------

    def _describe(self) -> str:
        """``<backend> journal <where>``, for messages."""
        raise NotImplementedError

    def _connect(self) -> Conn:
        raise NotImplementedError

    def _usable(self, conn: Conn) -> bool:
        """Whether a pooled connection can still be used."""
        return True

    def _close(self, conn: Conn) -> None:
        raise NotImplementedError

    def _create(self, conn: Conn) -> None:
        """Create the tables if they are missing."""
        raise NotImplementedError

    def _transaction(
        self, conn: Conn, persistence_id: str, what: str, fn: Callable[[Conn], _T]
    ) -> _T:
        """Run ``fn`` in one transaction on ``conn``, committed if it returns."""
        raise NotImplementedError

    def _read_recoveries(
        self, conn: Conn, requests: Sequence[tuple[str, int | None]]
    ) -> dict[str, StreamRead]:
        """In one transaction of its own: raise the fences ``fence_raises`` gives, then read."""
        raise NotImplementedError

    def _write_snapshots(
        self, conn: Conn, batch: Sequence[SnapshotWrite]
    ) -> list[JournalError | None]:
        """Inside the open transaction: write what ``plan_snapshots`` accepts; the refusals."""
        raise NotImplementedError

    def _write_batch(self, conn: Conn, batch: Sequence[PendingAppend]) -> list[JournalError | None]:
        """Write and commit ``batch``, one transaction; return each append's refusal or None.

        Checks each append against its stream's stored row as ``plan_batch`` does and writes
        those that pass. On an error of the storage, nothing is written and it raises.
        """
        raise NotImplementedError

    def _upkeep_after(self, batch: Sequence[PendingAppend]) -> Callable[[Conn], None] | None:
        """The upkeep due after ``batch`` committed, or None; called in the commit's thread.

        What it returns runs on the commit's connection in the same thread once the batch's
        appends are answered, while the answered tasks prepare their next appends; the next
        batch waits for it. The batch is durable and answered, so it must not raise for a
        failure of its own (log it). By default none; SQLite checkpoints its write-ahead log.
        """
        return None

    # -- the pool -----------------------------------------------------------------------------

    def _take(self) -> Conn:
        with self._pool_lock:
            while self._idle:
                conn = self._idle.pop()
                if self._usable(conn):
                    return conn
        return self._connect()

    def _give_back(self, conn: Conn) -> None:
        with self._pool_lock:
            if not self._closed and self._usable(conn):
                self._idle.append(conn)
                return
        self._close(conn)

    def _with_connection(self, work: Callable[[Conn], _T]) -> _T:
        conn = self._take()
        try:
            result = work(conn)
        except JournalError:
            self._give_back(conn)  # a refusal, rolled back: the connection is fine
            raise
        except BaseException:
            self._close(conn)  # whatever went wrong, a new connection starts clean
            raise
        self._give_back(conn)
        return result

    async def _ensure_tables(self, persistence_id: str) -> None:
        """Until the tables exist, behind every call that came to wait for them before this one.

        One call creates them, the others wait on a first-come lock; and while any call is in
        line (``_waiting_for_tables``), later ones line up behind it even once the tables
        exist, so that an append issued after another on its stream cannot pass it here. Each
        leaves the line and goes on to its commit without a checkpoint between.
        """
        if self._ready and not self._waiting_for_tables:
            return
        self._waiting_for_tables += 1
        try:
            async with self._creating:
                if not self._ready:
                    await self._in_thread(
                        persistence_id,
                        "creating the tables",
                        lambda: self._with_connection(self._create),
                    )
                    self._ready = True
        finally:
            self._waiting_for_tables -= 1

    async def _run(
        self,
        persistence_id: str,
        what: str,
        fn: Callable[[Conn], _T],
        *,
        own_transaction: bool = False,
    ) -> _T:
        """``fn`` on a pooled connection in a worker thread, within ``operation_timeout``.

        In one transaction (``_transaction``), unless ``own_transaction``: then ``fn`` makes
        its own.
        """
        if self._closed:
            raise JournalError(persistence_id, f"{self._describe()} is closed")
        with trio.move_on_after(self._timeout) as scope:
            await self._ensure_tables(persistence_id)

            def work() -> _T:
                if own_transaction:
                    return self._with_connection(fn)
                return self._with_connection(
                    lambda conn: self._transaction(conn, persistence_id, what, fn)
                )

            return await self._in_thread(persistence_id, what, work)
        assert scope.cancelled_caught
        raise JournalError(
            persistence_id,
            f"{self._describe()}: {what} did not finish within operation_timeout "
            f"({self._timeout:g} s); its outcome is unknown",
        )

    # -- recoveries and snapshots, one at a time or in batches ---------------------------------

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        """See :meth:`p2pshard.Journal.recover`: a batch of one."""
        (answer,) = await self.recover_many([(persistence_id, token)])
        if isinstance(answer, JournalError):
            raise answer
        return answer

    async def recover_many(
        self, requests: Sequence[tuple[str, int | None]]
    ) -> list[Recovery | JournalError]:
        """See :meth:`p2pshard.BatchJournal.recover_many`: one transaction, one read query."""
        batch = check_recoveries(requests)
        if not batch:
            return []
        self._counts["recovery_batches"] += 1
        self._counts["recoveries"] += len(batch)
        first = batch[0][0]
        what = "recovery" if len(batch) == 1 else f"recovery of {len(batch)} streams"
        try:
            reads = await self._run(
                first, what, lambda conn: self._read_recoveries(conn, batch), own_transaction=True
            )
        except JournalError as exc:
            return [_each(pid, exc, len(batch), "recovery") for pid, _ in batch]
        return assemble_recoveries(batch, reads)

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.save_snapshot`: a batch of one."""
        (refusal,) = await self.save_snapshots([SnapshotWrite(persistence_id, seq, data, token)])
        if refusal is not None:
            raise refusal

    async def save_snapshots(self, snapshots: Sequence[SnapshotWrite]) -> list[JournalError | None]:
        """See :meth:`p2pshard.BatchJournal.save_snapshots`: one transaction."""
        batch = [
            attrs.evolve(s, data=bytes(s.data))
            for s in check_snapshots(snapshots, self._max_event_size)
        ]
        if not batch:
            return []
        self._counts["snapshot_batches"] += 1
        self._counts["snapshots"] += len(batch)
        first = batch[0]
        what = f"snapshot at {first.seq}" if len(batch) == 1 else f"{len(batch)} snapshots"
        try:
            return await self._run(
                first.persistence_id, what, lambda conn: self._write_snapshots(conn, batch)
            )
        except JournalError as exc:
            return [_each(s.persistence_id, exc, len(batch), "snapshot") for s in batch]

    # -- group commit -------------------------------------------------------------------------

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """See :meth:`p2pshard.Journal.append`: written with the next group commit.

        The whole path of an append is this one coroutine (and the commit's, for an append that
        commits alone): every level of coroutines costs each append's task its wake-up and its
        suspension once more.
        """
        pid = persistence_id
        payloads = check_append(pid, first_seq, events, self._max_event_size)
        check_token(token)
        # A task that commits its own append (below, shielded) again and again must still see
        # its cancellation.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise JournalError(pid, f"{self._describe()} is closed")
        if not self._ready or self._waiting_for_tables:
            with trio.move_on_after(self._timeout) as waited:
                await self._ensure_tables(pid)
            if waited.cancelled_caught or not self._ready:
                raise JournalError(
                    pid,
                    f"{self._describe()}: creating the tables did not finish within "
                    f"operation_timeout ({self._timeout:g} s); nothing was appended",
                )
        ticket = _Ticket(
            pid, first_seq, payloads, token, deadline=trio.current_time() + self._timeout
        )
        if not self._in_flight and not self._committer_running:
            # Nothing is being committed, so nothing waits: this append commits at once, alone.
            batch = [ticket]
            self._take_off(batch)
            await self._fly(batch)
        else:
            self._queue.add(ticket)
            if not self._committer_running:  # behind a lone append: the committer takes over
                self._committer_running = True
                trio.lowlevel.spawn_system_task(self._committer, name=f"{self._describe()} commits")
            elif self._commit_done and self._share():  # the committer waits, and may go now
                self._commit_done.unpark_all()
            try:  # nothing above let the committer run: the ticket is not answered yet
                await trio.lowlevel.wait_task_rescheduled(ticket.park())
            except BaseException:
                self._queue.discard(ticket)  # if it still waits, it leaves with nothing written
                raise
        if ticket.error is not None:
            raise ticket.error

    def _take_off(self, batch: list[_Ticket]) -> None:
        """Count ``batch`` in flight, its streams busy, until :meth:`_fly` has committed it."""
        self._in_flight += 1
        self._appends_in_flight += len(batch)
        counts = self._counts
        counts["most_in_flight"] = max(counts["most_in_flight"], self._in_flight)
        self._busy.update(ticket.persistence_id for ticket in batch)

    async def _fly(self, batch: list[_Ticket]) -> None:
        """:meth:`_commit` a batch counted in flight by :meth:`_take_off`; then land it."""
        try:
            await self._commit(batch)
        finally:
            self._in_flight -= 1
            self._appends_in_flight -= len(batch)
            self._busy.difference_update(ticket.persistence_id for ticket in batch)
            if self._commit_done:
                self._commit_done.unpark_all()

    def _share(self) -> int | None:
        """:func:`p2pshard.persistence._group_commit.batch_share` for the journal as it is."""
        return batch_share(
            waiting=len(self._queue),
            appends_in_flight=self._appends_in_flight,
            in_flight=self._in_flight,
            slots=self._commits_at_once,
            overlap_from=self._overlap_from,
        )

    async def _next_done(self) -> None:
        """Until a batch in flight is answered or an append finds a slot free; then two rounds.

        In those rounds the tasks just answered queue their next appends, so that these go out
        together.
        """
        await self._commit_done.park()
        await trio.lowlevel.cancel_shielded_checkpoint()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def _committer(self) -> None:
        """Commit batch after batch while appends wait; then end (the next append restarts it).

        A system task, so that the next batch starts the moment a commit returns, while the
        tasks of the answered appends run, and so that no caller's cancellation stops it. Each
        commit is shielded and bounded by ``operation_timeout``. With room for more than one
        batch in flight (``_commits_at_once``), the next batch goes out while others are still
        being committed, without their streams: an append waits until the one before it on its
        stream has committed.
        """
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    if not await work_waiting(self._queue):  # the answered tasks' next appends
                        if not self._in_flight:
                            # Now, not after the nursery's end (a checkpoint): an append that
                            # came then would wait in the queue with no committer to take it.
                            self._committer_running = False
                            break
                        await self._next_done()
                        continue
                    share = self._share()
                    if share == 0:  # every slot taken, or light load and a batch in flight
                        await self._next_done()
                        continue
                    batch = self._queue.take_batch(busy=self._busy, max_appends=share)
                    if not batch:  # all that waits is on streams in flight
                        await self._next_done()
                        continue
                    now = trio.current_time()
                    late = [t for t in batch if t.deadline <= now]
                    if late:
                        self._fail(
                            late,
                            None,
                            f"waited operation_timeout ({self._timeout:g} s) for earlier appends "
                            "to commit; nothing was written",
                            together=False,
                        )
                        batch = [t for t in batch if t.deadline > now]
                    if batch:
                        self._take_off(batch)
                        if share is None:  # one batch at a time: committed here
                            await self._fly(batch)
                        else:
                            nursery.start_soon(self._fly, batch)
        except BaseException:
            self._committer_running = False
            raise

    async def _commit(self, batch: list[_Ticket]) -> None:
        """Write ``batch`` in one transaction in a worker thread and answer each of its appends.

        Shielded from the caller's cancellation and bounded by ``operation_timeout`` (one cancel
        scope does both: an append that commits alone pays for one). When the backend has
        upkeep due after the commit (:meth:`_upkeep_after`), the answers go out from the thread
        the moment the transaction has committed (through trio's run queue), before the upkeep
        runs in the same thread; this returns when both are done.
        """
        counts = self._counts
        counts["batches"] += 1
        counts["largest_batch"] = max(counts["largest_batch"], len(batch))
        token = trio.lowlevel.current_trio_token()
        answered = False

        def answer(refusals: list[JournalError | None]) -> None:  # in the trio thread
            nonlocal answered
            if answered:
                return
            answered = True
            counts["commits"] += 1
            refused = 0
            for ticket, refusal in zip(batch, refusals, strict=True):
                if refusal is not None:
                    refused += 1
                ticket.answer(refusal)
            counts["appends"] += len(batch) - refused
            counts["refused"] += refused

        def commit(conn: Conn) -> list[JournalError | None]:
            refusals = self._write_batch(conn, batch)
            upkeep = self._upkeep_after(batch)
            if upkeep is not None:  # (if not, this call's own result carries the answers)
                try:
                    token.run_sync_soon(answer, refusals)  # runs before this call's result
                except trio.RunFinishedError:  # abandoned past its timeout; trio has ended
                    return refusals
                upkeep(conn)
            return refusals

        try:
            with trio.CancelScope(deadline=trio.current_time() + self._timeout, shield=True):
                refusals = await _in_worker_thread(
                    lambda: self._with_connection(commit), self._commit_limiter
                )
                answer(refusals)
                return
            if answered:  # committed and answered; the upkeep after it is left to finish alone
                logger.warning(
                    "%s: the upkeep after a group commit did not finish within "
                    "operation_timeout (%g s); the next batch waits for it",
                    self._describe(),
                    self._timeout,
                )
                return
            answered = True  # an answer the abandoned thread sends later is not given
            self._fail(
                batch,
                None,
                f"did not finish within operation_timeout ({self._timeout:g} s); its outcome "
                "is unknown",
            )
        except BaseException as exc:
            if answered:  # the upkeep after the commit failed: the batch is durable, answered
                if not isinstance(exc, Exception):
                    raise
                logger.warning("%s: after a group commit: %s", self._describe(), exc)
                return
            answered = True
            if isinstance(exc, JournalError):  # refused as a whole, nothing written
                self._fail(batch, exc, f"refused: {str(exc).split(': ', 1)[-1]}", kind=type(exc))
            elif isinstance(exc, Exception):
                text = str(exc).strip() or type(exc).__name__
                self._fail(batch, exc, f"failed: {text}; nothing of its batch was written")
            else:  # KeyboardInterrupt and the like: answer, then go on up
                self._fail(batch, exc, "was interrupted; its outcome is unknown")
                raise

    def _fail(
        self,
        batch: list[_Ticket],
        cause: BaseException | None,
        text: str,
        *,
        kind: type[JournalError] = JournalError,
        together: bool = True,
    ) -> None:
        """Answer every append of ``batch`` with a failure of its own, ``cause`` chained."""
        self._counts["failed"] += len(batch)
        others = (
            f" (in one transaction with {len(batch) - 1} others)"
            if together and len(batch) > 1
            else ""
        )
        for ticket in batch:
            error = kind(
                ticket.persistence_id,
                f"{self._describe()}: append at {ticket.first_seq}{others} {text}",
            )
            error.__cause__ = cause
            ticket.answer(error)

    async def _in_thread(self, persistence_id: str, what: str, work: Callable[[], _T]) -> _T:
        try:
            return await _in_worker_thread(work, self._limiter)
        except self._driver_errors as exc:
            text = str(exc).strip() or type(exc).__name__
            raise JournalError(
                persistence_id, f"{self._describe()}: {what} failed: {text}"
            ) from exc

    async def aclose(self) -> None:
        """Close the pooled connections; a call still running closes its own when done.

        Snapshots queued for this journal by its entities are written first, within
        ``operation_timeout``.
        """
        if not self._closed:
            with trio.CancelScope(shield=True):
                await drain_snapshots(self, self._timeout)
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            self._close(conn)
