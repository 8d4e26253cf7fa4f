"""``node.replicator``: replicated keys holding pycrdt documents (Akka Distributed Data).

Theory of operation: the :class:`Replicator` is the trio shell around :class:`ReplicatorCore`.
It feeds the core the cluster's members (replicas are members with the replicator's role),
messages from the transport and the time, and carries out the core's effects: sending, appending
to the durable store (in a worker thread, many changes per fsync), completing the callers' calls
and notifying subscribers every ``notify_interval``.

Durable keys are loaded from the store by :func:`open_replicator` before the replicator exists, so
no write can come before them. The pycrdt client id is fresh for every replicator incarnation.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import attrs
import trio
from pycrdt import Doc

from membership import (
    Cluster,
    ClusterError,
    Envelope,
    HistogramSnapshot,
    LatencyHistogram,
    SendQueueFull,
    SerializationError,
    Transport,
    TransportClosed,
    UniqueAddress,
)
from membership.internal import CoreTimer

from ._consistency import (
    ReadAll,
    ReadConsistency,
    ReadFrom,
    ReadLocal,
    ReadMajority,
    ReadMajorityPlus,
    WriteAll,
    WriteConsistency,
    WriteLocal,
    WriteMajority,
    WriteMajorityPlus,
    WriteTo,
    check_read,
    check_write,
)
from ._core import (
    Compact,
    Complete,
    Effect,
    Peers,
    Persist,
    ReplicatorCore,
    Send,
    check_key,
)
from ._errors import ReplicationError
from ._protocol import REPLICATOR_MESSAGES
from ._settings import ReplicatorSettings
from ._store import Append, DurableStore, Snapshot, StoreOperation

logger = logging.getLogger("crdt.replicator")

T = TypeVar("T")
RunBlocking = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs blocking store calls: a worker thread by default, inline in a simulation."""

CONSISTENCY_NAMES: dict[type, str] = {
    ReadLocal: "local",
    ReadFrom: "from",
    ReadMajority: "majority",
    ReadMajorityPlus: "majority_plus",
    ReadAll: "all",
    WriteLocal: "local",
    WriteTo: "to",
    WriteMajority: "majority",
    WriteMajorityPlus: "majority_plus",
    WriteAll: "all",
}
"""Each consistency level's name in :class:`OperationStatistics` (a metric label's value)."""


@attrs.frozen
class OperationStatistics:
    """Reads, writes or deletes of one consistency level (see ``ReplicatorStatistics``).

    Attributes:
        operation: ``read`` (``get``), ``write`` (``update``) or ``delete``.
        consistency: ``local``, ``from`` (``ReadFrom``), ``to`` (``WriteTo``), ``majority``,
            ``majority_plus`` or ``all``.
        started: calls begun.
        failed: calls that ended with an error (a timeout, too few replicas, the store...).
        seconds: seconds from the call to its success, for each call that succeeded.
    """

    operation: str
    consistency: str
    started: int
    failed: int
    seconds: HistogramSnapshot


class _OperationCounts:
    """What :class:`OperationStatistics` snapshots: bumped as calls begin and end."""

    __slots__ = ("consistency", "failed", "operation", "seconds", "started")

    def __init__(self, operation: str, consistency: str) -> None:
        self.operation = operation
        self.consistency = consistency
        self.started = 0
        self.failed = 0
        self.seconds = LatencyHistogram()

    def snapshot(self) -> OperationStatistics:
        return OperationStatistics(
            self.operation, self.consistency, self.started, self.failed, self.seconds.snapshot()
        )


@attrs.frozen
class Changed:
    """A subscribed key changed; ``doc`` is a detached snapshot of it after the change."""

    key: str
    doc: Doc[Any]


@attrs.frozen
class Deleted:
    """A subscribed key was deleted; the subscription ends after this."""

    key: str


@attrs.frozen
class ReplicatorStatistics:
    """A snapshot of a replicator's counters.

    Attributes:
        keys: keys held (deleted ones not counted).
        deleted_keys: tombstones held.
        bytes_per_key: each key's full state, in bytes of a yrs update (empty when the
            snapshot was taken with ``key_sizes=False``).
        pending_writes: updates and deletes waiting for replicas.
        pending_reads: reads waiting for replicas.
        gossip_messages_sent: anti-entropy and delta messages sent.
        gossip_messages_received: anti-entropy and delta messages received.
        gossip_bytes_sent: payload bytes (updates, states, digests) in those sent.
        gossip_bytes_received: payload bytes in those received.
        malformed_messages: messages from peers dropped as malformed.
        dropped_sends: messages not sent because a peer's send queue was full.
        store_batches: transactions committed to the durable store.
        store_failures: transactions of the durable store that failed.
        client_id: this incarnation's pycrdt client id.
        operations: the reads, writes and deletes called here, per operation and consistency
            level used so far.
    """

    keys: int
    deleted_keys: int
    bytes_per_key: dict[str, int]
    pending_writes: int
    pending_reads: int
    gossip_messages_sent: int
    gossip_messages_received: int
    gossip_bytes_sent: int
    gossip_bytes_received: int
    malformed_messages: int
    dropped_sends: int
    store_batches: int
    store_failures: int
    client_id: int
    operations: tuple[OperationStatistics, ...] = ()


@attrs.define(eq=False)
class _Waiter:
    done: trio.Event = attrs.Factory(trio.Event)
    value: object = None
    error: ReplicationError | None = None
    on_success: Callable[[], None] | None = None
    counts: _OperationCounts | None = None
    started: float = 0.0


class PendingUpdate(Generic[T]):
    """An update begun by :meth:`Replicator.start_update`; await :meth:`result` for its outcome."""

    __slots__ = ("_op", "_replicator", "_waiter")

    def __init__(self, replicator: Replicator, op: int, waiter: _Waiter) -> None:
        self._replicator = replicator
        self._op = op
        self._waiter = waiter

    async def result(self) -> T:
        """What ``modify`` returned, once enough replicas confirmed (as :meth:`Replicator.update`).

        Call it once. Cancelled, it stops waiting; the write itself stays and spreads by gossip.

        Raises:
            UpdateTimeout, StoreFailure, DataDeleted, ReplicationError: as ``update``.
        """
        return await self._replicator._finish(self._op, self._waiter)  # type: ignore[return-value]

    @property
    def done(self) -> bool:
        """Whether the outcome is known (``result()`` would not wait)."""
        return self._waiter.done.is_set()

    def on_success(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` as soon as enough replicas confirmed, in the task that learns it.

        For a caller that acts on the confirmation and must not wait for its own task to run
        first (a scheduler pass): the callback runs inside the replicator's handling of the last
        acknowledgement, after the rest of that handling. Not called if the update fails, is
        abandoned (``result()`` cancelled) or has already succeeded (check :attr:`done` first);
        ``result()`` still gives the outcome. It must not raise; an exception is logged.

        Raises:
            ValueError: a callback is already set.
        """
        if self._waiter.on_success is not None:
            raise ValueError("this update already has an on_success callback")
        self._waiter.on_success = callback


@attrs.define(eq=False)
class _Subscriber:
    key: str
    wake: trio.Event = attrs.Factory(trio.Event)
    pending: bool = False


class Subscription:
    """Changes of one key; iterate with ``async for``. Changes in between coalesce."""

    def __init__(self, replicator: Replicator, subscriber: _Subscriber) -> None:
        self._replicator = replicator
        self._subscriber = subscriber

    def __aiter__(self) -> AsyncIterator[Changed | Deleted]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Changed | Deleted]:
        sub = self._subscriber
        while True:
            while not sub.pending:
                await sub.wake.wait()
                sub.wake = trio.Event()
            sub.pending = False
            core = self._replicator._core
            if core.is_deleted(sub.key):
                yield Deleted(sub.key)
                return
            doc = core.snapshot(sub.key)
            if doc is not None:
                yield Changed(sub.key, doc)


class Replicator:
    """Replicated keys, each holding a pycrdt document. Get one as ``node.replicator``.

    Every key's document can be edited on any node; replicas merge. Reads and writes take a
    consistency level (:class:`ReadMajority`, :class:`WriteMajority`, ...). Integers stored in
    pycrdt documents come back as floats.

    Example:
        >>> async def count_visit(replicator: Replicator) -> None:
        ...     def add(doc: Doc) -> None:
        ...         visits = doc.get("visits", type=pycrdt.Map)
        ...         visits["home"] = visits.get("home", 0) + 1
        ...
        ...     await replicator.update("stats", add, WriteMajority(timeout=2.0))
        ...     doc = await replicator.get("stats", ReadMajority(timeout=2.0))
    """

    def __init__(
        self,
        transport: Transport,
        cluster: Cluster,
        core: ReplicatorCore,
        store: DurableStore | None,
        run_blocking: RunBlocking,
    ) -> None:
        """Use :func:`open_replicator`."""
        self._transport = transport
        self._cluster = cluster
        self._core = core
        self._settings = core.settings
        self._store = store
        self._run_blocking = run_blocking
        self._waiters: dict[int, _Waiter] = {}
        self._subscribers: dict[str, list[_Subscriber]] = {}
        self._timer = CoreTimer(core.next_deadline)
        store_send, self._store_receive = trio.open_memory_channel[
            tuple[int | None, StoreOperation]
        ](math.inf)
        self._store_send = store_send
        self._dropped = 0
        self._closed = False
        self._store_batches = 0
        self._store_failures = 0
        self._operations: dict[tuple[str, type], _OperationCounts] = {}

    @property
    def settings(self) -> ReplicatorSettings:
        """The settings this replicator runs with."""
        return self._settings

    @property
    def client_id(self) -> int:
        """This incarnation's pycrdt client id (fresh at every start, never reused)."""
        return self._core.client_id

    async def get(self, key: str, consistency: ReadConsistency | None = None) -> Doc[Any] | None:
        """Read ``key``: a detached snapshot ``Doc``, or None when no replica asked has it.

        Above ``ReadLocal`` (the default) the replicas' answers are merged into the local replica
        first. Edits to the returned document change nothing: use :meth:`update`.

        Example:
            >>> doc = await replicator.get("stats", ReadMajority())  # doctest: +SKIP

        Raises:
            GetFailure: not enough replicas answered within the timeout.
            DataDeleted: the key was deleted.
            ReplicationError: the replicator stopped (its node left or stopped).
            ValueError: an invalid key. TypeError: not a read consistency.
        """
        consistency = check_read(ReadLocal() if consistency is None else consistency)
        self._check_running()
        now = trio.current_time()
        op, effects = self._core.get(key, consistency, now)
        waiter = self._start(op, effects, self._count("read", consistency), now)
        return await self._finish(op, waiter)  # type: ignore[return-value]

    async def update(
        self,
        key: str,
        modify: Callable[[Doc[Any]], T],
        consistency: WriteConsistency | None = None,
    ) -> T:
        """Edit ``key``'s document with ``modify`` (one transaction) and replicate the change.

        ``modify`` gets the live local document (created empty for a new key) and must not keep
        it. It should check its inputs before editing: what it changed before raising stays, as
        pycrdt cannot roll back, and replicates like a local write; the error propagates.

        Example:
            >>> await replicator.update(
            ...     "config", lambda doc: doc.get("m", type=pycrdt.Map).update({"a": "b"})
            ... )  # doctest: +SKIP

        Returns:
            What ``modify`` returned.

        Raises:
            UpdateTimeout: too few replicas confirmed within the timeout (the write stays and
                spreads by gossip).
            StoreFailure: a durable key could not be written to disk.
            DataDeleted: the key was deleted.
            ReplicationError: the replicator stopped (its node left or stopped).
            ValueError: an invalid key. TypeError: not a write consistency, or an async modify.
        """
        return await self.start_update(key, modify, consistency).result()

    def start_update(
        self,
        key: str,
        modify: Callable[[Doc[Any]], T],
        consistency: WriteConsistency | None = None,
    ) -> PendingUpdate[T]:
        """Begin :meth:`update` without waiting; ``result()`` of what it returns waits.

        The edit is made, and the change is on its way to the other replicas, when this
        returns. For a caller that must not wait before the change leaves, such as one that would
        otherwise start a task for each update (a scheduler pass before anything is sent).

        Raises:
            ValueError, TypeError, ReplicationError: as :meth:`update`, at once; so does what
                ``modify`` raises. The rest of :meth:`update`'s errors come from ``result()``.
        """
        consistency = check_write(WriteLocal() if consistency is None else consistency)
        check_key(key)
        self._check_running()
        now = trio.current_time()
        try:
            op, effects = self._core.update(key, modify, consistency, now)
        except BaseException:
            # What modify changed before raising still replicates.
            self._carry_out(self._core.take_effects())
            raise
        counts = self._count("write", consistency)
        return PendingUpdate(self, op, self._start(op, effects, counts, now))

    async def delete(self, key: str, consistency: WriteConsistency | None = None) -> None:
        """Delete ``key`` on every replica, for good: it cannot be reused.

        Raises:
            UpdateTimeout: too few replicas confirmed within the timeout (the delete spreads).
            StoreFailure: the tombstone of a durable key could not be written to disk.
            DataDeleted: the key was deleted already.
        """
        consistency = check_write(WriteLocal() if consistency is None else consistency)
        self._check_running()
        now = trio.current_time()
        op, effects = self._core.delete(key, consistency, now)
        await self._finish(op, self._start(op, effects, self._count("delete", consistency), now))

    @asynccontextmanager
    async def subscribe(self, key: str) -> AsyncIterator[Subscription]:
        """Changes of ``key``: its current value first (if any), then the latest changes.

        At most one change is delivered per ``notify_interval``: changes in between coalesce
        into the latest value. The iteration ends after the key is deleted.

        Example:
            >>> async with replicator.subscribe("stats") as changes:  # doctest: +SKIP
            ...     async for change in changes:
            ...         print(change)
        """
        check_key(key)
        subscriber = _Subscriber(key)
        subscriber.pending = self._core.has(key) or self._core.is_deleted(key)
        self._subscribers.setdefault(key, []).append(subscriber)
        try:
            yield Subscription(self, subscriber)
        finally:
            subscribers = self._subscribers[key]
            subscribers.remove(subscriber)
            if not subscribers:
                del self._subscribers[key]

    def keys(self) -> list[str]:
        """The keys this replica holds, sorted."""
        return self._core.held_keys()

    def digest(self, key: str) -> bytes | None:
        """A digest of this replica's value of ``key`` (None when absent).

        Replicas holding the same value have equal digests, so comparing them across nodes tells
        whether the replicas have converged (``p2pshard.testing`` does that after a chaos run).
        """
        return self._core.digest(key)

    def statistics(self, *, key_sizes: bool = True) -> ReplicatorStatistics:
        """A snapshot of the counters.

        Args:
            key_sizes: whether to fill ``bytes_per_key``, which costs one encoding of every
                key's full state; without it ``bytes_per_key`` is empty and the snapshot costs
                no more than reading the counters (what a metrics scrape wants).
        """
        core = self._core.statistics()
        held = self._core.held_keys() if key_sizes else []
        return ReplicatorStatistics(
            keys=core.keys,
            deleted_keys=core.deleted_keys,
            bytes_per_key={key: self._core.size_of(key) for key in held},
            pending_writes=core.pending_writes,
            pending_reads=core.pending_reads,
            gossip_messages_sent=core.gossip_messages_sent,
            gossip_messages_received=core.gossip_messages_received,
            gossip_bytes_sent=core.gossip_bytes_sent,
            gossip_bytes_received=core.gossip_bytes_received,
            malformed_messages=core.malformed_messages,
            dropped_sends=self._dropped,
            store_batches=self._store_batches,
            store_failures=self._store_failures,
            client_id=self._core.client_id,
            operations=tuple(
                counts.snapshot()
                for _, counts in sorted(
                    self._operations.items(), key=lambda i: (i[1].operation, i[1].consistency)
                )
            ),
        )

    # -- the node's dispatcher calls this ---------------------------------------------------

    def handle(self, envelope: Envelope) -> bool:
        """Take a replicator message from the transport; False if it is not one of ours."""
        message = envelope.message
        if not isinstance(message, REPLICATOR_MESSAGES):
            return False
        if message.replicator != self._settings.name:
            return False
        self._carry_out(self._core.receive(envelope.sender, message, trio.current_time()))
        return True

    # -- running ----------------------------------------------------------------------------

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_members)
            nursery.start_soon(self._store_loop)
            nursery.start_soon(self._notify_loop)
            task_status.started()
            while True:
                now = await self._timer.wait()
                self._carry_out(self._core.tick(now))

    async def _watch_members(self) -> None:
        while True:
            try:
                async with self._cluster.subscribe() as events:
                    self._update_peers()
                    async for _ in events:
                        self._update_peers()
                return  # the cluster stopped publishing: this node is out
            except ClusterError as error:  # fell behind: the view is rebuilt from scratch
                logger.warning("replicator %s: %s", self._settings.name, error)

    def _update_peers(self) -> None:
        peers = Peers.of(
            self._cluster.members,
            (m.node for m in self._cluster.unreachable),
            self_node=self._cluster.self_address,
            role=self._settings.role,
        )
        self._carry_out(self._core.set_peers(peers, trio.current_time()))

    async def _notify_loop(self) -> None:
        while True:
            await trio.sleep(self._settings.notify_interval)
            for key in self._core.take_changed():
                for subscriber in self._subscribers.get(key, ()):
                    subscriber.pending = True
                    subscriber.wake.set()

    async def _store_loop(self) -> None:
        store = self._store
        async for first in self._store_receive:
            batch = [first]
            while True:
                try:
                    batch.append(self._store_receive.receive_nowait())
                except trio.WouldBlock:
                    break
            error: BaseException | None = None
            if store is None:  # pragma: no cover - the core only persists durable keys
                error = ReplicationError("no durable store configured")
            else:
                operations = [operation for _, operation in batch]
                try:
                    await self._run_blocking(functools.partial(store.write, operations))
                    self._store_batches += 1
                except Exception as failure:  # sqlite3.Error, OSError: reported, never swallowed
                    error = failure
                    self._store_failures += 1
                    logger.error("durable store %s: write failed: %s", store.path, failure)
            now = trio.current_time()
            effects: list[Effect] = []
            for ticket, _ in batch:
                if ticket is not None:
                    effects += self._core.persisted(ticket, error, now)
            self._carry_out(effects)

    def _check_running(self) -> None:
        if self._closed:
            raise ReplicationError("the replicator has stopped (its node left or stopped)")

    def _count(self, operation: str, consistency: object) -> _OperationCounts:
        """The counts of ``operation`` at ``consistency``, one call more."""
        key = (operation, type(consistency))
        counts = self._operations.get(key)
        if counts is None:
            name = CONSISTENCY_NAMES[type(consistency)]
            counts = self._operations[key] = _OperationCounts(operation, name)
        counts.started += 1
        return counts

    def _start(
        self, op: int, effects: list[Effect], counts: _OperationCounts, now: float
    ) -> _Waiter:
        """Register a waiter for ``op``, then carry out the ``effects`` that began it.

        ``counts`` takes the call's outcome, and its time from ``now`` if it succeeds.
        """
        waiter = _Waiter(counts=counts, started=now)
        self._waiters[op] = waiter
        self._carry_out(effects)
        self._timer.poke()  # something (its deadline, a delta) may be due before the timer
        return waiter

    async def _finish(self, op: int, waiter: _Waiter) -> object:
        try:
            await waiter.done.wait()
        finally:
            if self._waiters.pop(op, None) is not None:
                self._carry_out(self._core.abandon(op, trio.current_time()))
        if waiter.error is not None:
            raise waiter.error
        return waiter.value

    def _stopped(self) -> None:
        """Fail every call still waiting: nothing will complete them now."""
        self._closed = True
        for waiter in self._waiters.values():
            if waiter.counts is not None:
                waiter.counts.failed += 1
            waiter.error = ReplicationError("the replicator stopped before the operation ended")
            waiter.done.set()
        self._waiters.clear()

    def _carry_out(self, effects: list[Effect]) -> None:
        """Carry out what one input of the core decided, in order.

        Nothing here calls the core back; the on_success callbacks come last and may begin
        another update, which carries out its own effects.
        """
        confirmed: list[Callable[[], None]] = []
        for effect in effects:
            match effect:
                case Send(to=to, message=message):
                    self._send(to, message)
                case Complete(op=op, value=value, error=error):
                    waiter = self._waiters.pop(op, None)
                    if waiter is not None:
                        counts = waiter.counts
                        if counts is not None:
                            if error is None:
                                counts.seconds.observe(trio.current_time() - waiter.started)
                            else:
                                counts.failed += 1
                        waiter.value, waiter.error = value, error
                        waiter.done.set()
                        if error is None and waiter.on_success is not None:
                            confirmed.append(waiter.on_success)
                case Persist(ticket=ticket, entries=entries):
                    for i, (key, data) in enumerate(entries):
                        last = i == len(entries) - 1
                        self._store_send.send_nowait((ticket if last else None, Append(key, data)))
                case Compact(key=key, snapshot=snapshot):
                    self._store_send.send_nowait((None, Snapshot(key, snapshot)))
        # Last: a callback may begin another update, whose effects then follow these.
        for callback in confirmed:
            try:
                callback()
            except Exception:
                logger.exception("an on_success callback of an update failed")

    def _send(self, to: UniqueAddress, message: object) -> None:
        try:
            self._transport.send_nowait(to, message)
        except SendQueueFull:
            self._dropped += 1  # gossip repairs it; a write or read waits for other replicas
        except TransportClosed:
            pass
        except SerializationError as error:  # a key whose state exceeds max_frame_size
            self._dropped += 1
            logger.error("cannot send %s to %s: %s", type(message).__name__, to, error)


async def _run_in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


@asynccontextmanager
async def open_replicator(
    transport: Transport,
    cluster: Cluster,
    settings: ReplicatorSettings | None = None,
    *,
    rng: random.Random | None = None,
    run_blocking: RunBlocking | None = None,
) -> AsyncIterator[Replicator]:
    """Load the durable keys, start a replicator, and stop it when the block ends.

    The caller routes received messages to :meth:`Replicator.handle`.

    Args:
        transport: the node's transport.
        cluster: the node's membership.
        settings: the replicator's settings.
        rng: the source of the client id and gossip choices (seed it in a simulation).
        run_blocking: runs a blocking store call (default: in a worker thread).

    Raises:
        ConfigurationError: the durable store cannot be opened.
    """
    settings = settings or ReplicatorSettings()
    rng = rng or random.Random()
    run_blocking = run_blocking or _run_in_thread
    store: DurableStore | None = None
    loaded: dict[str, list[bytes] | None] = {}
    if settings.durable_path is not None:
        path = settings.durable_path
        store = await run_blocking(lambda: DurableStore(path))
        loaded = await run_blocking(store.load)
    try:
        core = ReplicatorCore(
            transport.local_address,
            settings,
            client_id=rng.randrange(1, 1 << 53),
            rng=rng,
            now=trio.current_time(),
            loaded=loaded,
        )
        replicator = Replicator(transport, cluster, core, store, run_blocking)
        async with trio.open_nursery() as nursery:
            await nursery.start(replicator._run)
            try:
                yield replicator
            finally:
                nursery.cancel_scope.cancel()
                replicator._stopped()
    finally:
        if store is not None:
            store.close()
