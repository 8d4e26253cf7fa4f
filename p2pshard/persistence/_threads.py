"""What the SQL journals share: a pool of blocking connections used from trio worker threads.

Theory of operation: every journal call is one transaction, run by :meth:`ThreadedJournal._run`
in a worker thread (at most ``threads`` at a time, by a capacity limiter) on a connection taken
from a small pool and given back after. The first call creates the tables, once (later calls
wait for it). A call has ``operation_timeout`` seconds in all: past it the thread is abandoned
and the caller gets a :class:`p2pshard.JournalError` saying the outcome is unknown. A refusal by
the journal's rules (:class:`p2pshard.JournalError` raised inside the transaction) gives the
connection back; any other failure closes it, so the next call starts on a clean one. A
backend provides the connection (``_connect``, ``_usable``), the table creation (``_create``),
one transaction around a function (``_transaction``), the errors its driver raises
(``_driver_errors``) and how it names itself in messages (``_describe``). Both read a recovery
with :func:`read_recovery`, the same two queries in their drivers' parameter style.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio

from .._errors import JournalError
from ._journal import JournalSettings, Recovery

Conn = TypeVar("Conn")
_T = TypeVar("_T")


def read_recovery(conn: Any, persistence_id: str, highest: int, mark: str) -> Recovery:
    """The stream's snapshot and the events after it, read on ``conn``.

    ``conn`` is a DB-API connection with ``execute``, whose driver writes query parameters as
    ``mark`` (``?`` or ``%s``).
    """
    row = conn.execute(
        f"SELECT seq, payload FROM p2pshard_journal_snapshots WHERE persistence_id = {mark}",
        (persistence_id,),
    ).fetchone()
    snapshot = None if row is None else (int(row[0]), bytes(row[1]))
    after = 0 if snapshot is None else snapshot[0]
    events = conn.execute(
        "SELECT seq, payload FROM p2pshard_journal_events "
        f"WHERE persistence_id = {mark} AND seq > {mark} ORDER BY seq",
        (persistence_id, after),
    ).fetchall()
    return Recovery(snapshot, tuple((int(s), bytes(p)) for s, p in events), highest)


class ThreadedJournal(Generic[Conn]):
    """The pool, the timeout and the error handling of a journal over blocking connections."""

    _driver_errors: tuple[type[BaseException], ...] = (OSError,)
    """Exceptions of the driver that mean "this call failed" (a JournalError to the caller)."""

    def __init__(self, settings: JournalSettings, threads: int) -> None:
        self._timeout = settings.operation_timeout
        self._max_event_size = settings.max_event_size
        self._snapshot_every = settings.snapshot_every
        self._limiter = trio.CapacityLimiter(threads)
        self._idle: list[Conn] = []
        self._pool_lock = threading.Lock()
        self._ready = False
        self._creating = trio.Lock()
        self._closed = False

    @property
    def max_event_size(self) -> int:
        """Bytes one event or snapshot may take."""
        return self._max_event_size

    @property
    def snapshot_every(self) -> int | None:
        """Events between snapshots for entity types that do not set their own."""
        return self._snapshot_every

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

    async def _run(self, persistence_id: str, what: str, fn: Callable[[Conn], _T]) -> _T:
        if self._closed:
            raise JournalError(persistence_id, f"{self._describe()} is closed")
        with trio.move_on_after(self._timeout) as scope:
            if not self._ready:
                async with self._creating:  # one thread creates the tables, the others wait
                    if not self._ready:
                        await self._in_thread(
                            persistence_id,
                            "creating the tables",
                            lambda: self._with_connection(self._create),
                        )
                        self._ready = True

            def work() -> _T:
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

    async def _in_thread(self, persistence_id: str, what: str, work: Callable[[], _T]) -> _T:
        try:
            return await trio.to_thread.run_sync(
                work, limiter=self._limiter, abandon_on_cancel=True
            )
        except self._driver_errors as exc:
            text = str(exc).strip() or type(exc).__name__
            raise JournalError(
                persistence_id, f"{self._describe()}: {what} failed: {text}"
            ) from exc

    async def aclose(self) -> None:
        """Close the pooled connections; a call still running closes its own when done."""
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            self._close(conn)
