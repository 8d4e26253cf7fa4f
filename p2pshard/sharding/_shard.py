"""A shard's entities and the worker pool that runs them: Akka's ``Shard``.

Theory of operation. A :class:`Shard` maps entity ids to :class:`EntityContext` objects (the
entity's state machine, mailbox and instance; see ``p2pshard.sharding._entity``). ``deliver``
appends to the entity's mailbox and, if the entity is not queued yet, puts it on the region's
:class:`EntityWorkers` run queue. A worker task takes an entity off the queue and awaits its
``receive`` for the waiting messages, one at a time (at most ``BATCH`` before others get a turn). No
entity has a task of its own, so an idle entity costs only its objects.

Workers: a few stay parked while there is nothing to run and are woken directly; when every
worker is busy and the queue makes no progress for ``SPAWN_AFTER``, another is started (up to
``MAX_WORKERS``), so an entity that awaits something slow holds up only itself. Extra workers end
once idle.

Passivation (``ctx.passivate``, idle time, the active-entity limit) appends a :class:`Stop` to
the mailbox: messages already there are handled first, messages after it are held and start the
next incarnation once this one stopped. A hand-off (:meth:`Shard.stop_all`) stops every entity
the same way, entities waiting to restart included (they restart at once to drain their mailbox):
every message that reached this shard is handled here before the shard reports it stopped.
Unlike Akka, nothing is dropped at hand-off (akka#30957). At three quarters of
``handoff_timeout`` entities still running are cancelled, and what they held is logged as lost.
An entity that raises while it is stopping is not restarted after a backoff: the messages before
its stop go to a fresh instance at once, which then stops.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from membership.internal import acquire_until_granted

from .._tracing import Traced, Tracing
from ..leases._lease import ShardLease
from ._allocation import EntityId, ShardId
from ._entity import (
    WAKE,
    Entity,
    EntityContext,
    EntityEvent,
    EntitySender,
    EntityState,
    Mail,
    Reply,
    Stop,
    Wake,
    check_entity,
)
from ._remember import RememberStore
from ._services import IncarnationObserver
from ._settings import ShardingSettings

logger = logging.getLogger("p2pshard.shard")

BATCH = 64
"""Messages one entity handles before the worker lets another entity have a turn."""

MIN_WORKERS = 2
"""Worker tasks that stay parked when there is nothing to run."""

MAX_WORKERS = 10_000
"""Most worker tasks at once: the most entities whose ``receive`` can be awaiting at once."""

FORCED_STOP_FRACTION = 0.75
"""Part of ``handoff_timeout`` a shard waits for its entities to stop before it cancels them:
a little before the coordinator gives a hand-off up, so ShardStopped still reaches it."""

SPAWN_AFTER = 0.005
"""Seconds entities may wait in the run queue, with every worker busy and none of them taking
the next entity, before another worker starts (an entity awaiting something slow)."""

_ACTIVE = EntityState.ACTIVE
_STOPPING = EntityState.STOPPING
_RESTARTING = EntityState.RESTARTING
_GONE = EntityState.GONE
SPARE_MAILBOXES = 256
"""Empty mailboxes a region keeps for reuse. An idle entity keeps no deque (it would cost more
than the entity), so every message to an idle entity needs one: taking a spare costs a tenth of
making a new one."""

_deque = collections.deque
_CONTROL = frozenset({Stop, Wake, Traced})
"""Mailbox entries that are not plain messages for the entity: the workers' common case leaves
them to ``Shard._run``."""


class EntityWorkers:
    """The run queue of entities with waiting messages, and the workers that run them.

    A parked worker is woken directly (``trio.lowlevel.reschedule``). When every worker is busy,
    a watcher starts another only if the queue makes no progress for ``SPAWN_AFTER``: busy
    workers that keep taking entities are cheaper than new tasks, and an entity that awaits
    something slow still holds up only itself.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._ready: collections.deque[EntityContext] = collections.deque()
        self._idle: list[trio.lowlevel.Task] = []
        self._workers = 0
        self._progress = 0
        self.spare_mailboxes: list[collections.deque[Mail]] = []
        """Empty mailboxes to reuse (see SPARE_MAILBOXES)."""
        self._watching = False
        self.peak_workers = 0

    def schedule(self, context: EntityContext) -> None:
        """Queue ``context`` to run (the caller set ``context._scheduled``)."""
        self._ready.append(context)
        if self._idle:
            trio.lowlevel.reschedule(self._idle.pop())
        elif self._workers == 0:
            self._spawn()
        elif not self._watching:
            self._watching = True
            self._nursery.start_soon(self._watch)

    @property
    def workers(self) -> int:
        """Worker tasks alive now."""
        return self._workers

    def _spawn(self) -> None:
        self._workers += 1
        self.peak_workers = max(self.peak_workers, self._workers)
        self._nursery.start_soon(self._worker)

    async def _watch(self) -> None:
        try:
            while self._ready:
                seen = self._progress
                await trio.sleep(SPAWN_AFTER)
                if (
                    self._ready
                    and self._progress == seen
                    and not self._idle
                    and self._workers < MAX_WORKERS
                ):
                    self._spawn()
        finally:
            self._watching = False

    async def _worker(self) -> None:
        ready = self._ready
        task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            if task in self._idle:
                self._idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        while True:
            # One cancel scope per wake-up, not per entity: a forced stop cancels the entity
            # running in it (see Shard.force_stop), and the worker goes on with a new one.
            with trio.CancelScope() as scope:
                while ready:
                    context = ready.popleft()
                    self._progress += 1
                    context._scope = scope
                    shard: Shard = context._shard  # type: ignore[assignment]  # a Shard, as all here
                    instance = context._instance
                    mailbox = context._mailbox
                    # Shard._run's common case spelled out here, one coroutine less per turn: a
                    # running entity with one message waiting, in a shard with no lease to check
                    # (test_shard_copies.py checks that both handle messages alike).
                    if (
                        instance is None
                        or mailbox is None
                        or len(mailbox) != 1
                        or shard.lease_token is not None
                        or type(mailbox[0][0]) in _CONTROL
                    ):
                        await shard._run(context)
                        continue
                    message, reply = mailbox.popleft()
                    try:
                        result = await instance.receive(message, context)
                    except Exception as exc:
                        shard._crashed(context, exc, reply)
                    else:
                        if reply is not None:
                            reply.ok(result)
                    finally:
                        context._scope = None
                        context._scheduled = False
                    shard._turn_ended(context, mailbox)
            if ready:
                continue
            if self._workers > MIN_WORKERS:
                self._workers -= 1
                return
            self._idle.append(task)
            await trio.lowlevel.wait_task_rescheduled(abort)


EntityFactory = Callable[[EntityContext], Entity]
"""Makes an entity instance from its context (usually the entity class itself)."""


@attrs.frozen(eq=False)
class ShardHost:
    """What a :class:`Shard` needs of the region hosting it; the region makes one for its shards.

    The callables are the region's: a shard calls them as it starts, stops and reroutes entities.
    """

    type_name: str
    settings: ShardingSettings
    workers: EntityWorkers
    """The region's run queue and worker tasks, shared by its shards."""
    recently_used: collections.OrderedDict[EntityContext, None] | None
    """Active entities, least recently used first, when ``active_entity_limit`` is set."""
    entity_factory: EntityFactory
    stop_message: object
    """What a passivated entity receives last, unless ``passivate`` names another."""
    observers: Sequence[IncarnationObserver]
    sender: EntitySender
    """Sends to this entity type's entities (an entity's ``self_ref``)."""
    route: Callable[[ShardId, EntityId, object, Reply | None], None]
    """Route a message again, without waiting (a shard handed off while messages waited)."""
    entity_started: Callable[[EntityContext], None]
    """A context was made: counted, and subject to the active-entity limit."""
    entity_stopped: Callable[[EntityContext], None]
    """A context is gone."""
    restart_due: Callable[[], None]
    """An entity waits to restart: the region's timer must see :meth:`Shard.tick`'s new due time."""
    tracing: Tracing | None = None
    """The entity type's tracing; None when it is off (a traced message then runs untraced)."""


class Shard:
    """The entities of one shard hosted by one region."""

    def __init__(self, host: ShardHost, shard_id: ShardId) -> None:
        self.host = host
        self.type_name = host.type_name
        self.sender = host.sender
        self.shard_id = shard_id
        self.entities: dict[EntityId, EntityContext] = {}
        self.stopping = False
        self.lease_token: int | None = None
        self._restarts: dict[EntityContext, float] = {}
        self._on_stopped: Callable[[], None] | None = None
        self.lost = 0
        self.store: RememberStore | None = None
        self.lease: ShardLease | None = None
        self._pending: list[tuple[EntityId, object, Reply | None]] | None = None
        self._loading: trio.CancelScope | None = None
        self._watching = trio.CancelScope()
        # The region's, read on every delivery: one attribute lookup each instead of two.
        self._scheduler = host.workers
        self._lru = host.recently_used
        self._spare_mailboxes = host.workers.spare_mailboxes
        # What trio.current_time() reads, without its two calls and run-context lookup: it is
        # read after every run of an entity.
        self._now: Callable[[], float] = trio.lowlevel.current_clock().current_time

    # -- remembered entities ----------------------------------------------------------------

    def start(
        self,
        nursery: trio.Nursery,
        *,
        store: RememberStore | None = None,
        lease: ShardLease | None = None,
    ) -> None:
        """Start a shard that needs a lease or remembers its entities.

        With a ``lease``, no entity starts before the lease is granted; when it is lost the
        entities are stopped, new messages wait, and the lease is asked for again. With a
        ``store``, the remembered entities restart once it is read. Messages that come
        meanwhile wait, then follow in order.
        """
        self.store = store
        self.lease = lease
        self._pending = []
        if store is not None:
            nursery.start_soon(store.run)
        nursery.start_soon(self._startup)

    async def _startup(self) -> None:
        with trio.CancelScope() as scope:
            self._loading = scope
            if self.lease is not None:
                await self._acquire(self.lease)
            if self.store is not None:
                await self._recover(self.store)
            self._release_pending()
        self._loading = None
        if self.lease is not None and not scope.cancelled_caught:
            with self._watching:  # until the shard is closed, through a hand-off too
                await self._watch_lease(self.lease)

    def close(self) -> None:
        """The shard has stopped: stop watching its lease."""
        self._watching.cancel()

    def end_incarnations(self) -> None:
        """The node stopped (no task of it runs any more): every incarnation here is gone."""
        for context in list(self.entities.values()):
            self._drop(context)

    async def _acquire(self, lease: ShardLease) -> None:
        grant = await acquire_until_granted(
            lease,
            self.host.settings.lease_retry_interval,
            f"shard {self.type_name}/{self.shard_id}",
            logger,
        )
        self.lease_token = grant.token

    async def _watch_lease(self, lease: ShardLease) -> None:
        while True:
            await lease.wait_lost()
            if self.lease_token is not None:  # not already noticed before a message ran
                self.lease_token = None
                self._lease_lost()
            if self.stopping:  # it was being handed off: nothing more to do
                return
            await self._acquire(lease)
            if self.store is not None:
                await self._recover(self.store)  # the remembered entities come back
            self._release_pending()

    def _lease_lost(self) -> None:
        """Stop every entity at once, without its stop message: it may not act any more.

        Messages waiting in mailboxes wait for the next grant instead; the message an entity
        was handling when the lease was lost is cut short.
        """
        logger.warning(
            "shard %s/%s: lease lost; stopping its %d entities at once",
            self.type_name,
            self.shard_id,
            len(self.entities),
        )
        waiting: list[tuple[EntityId, object, Reply | None]] = []
        for context in list(self.entities.values()):
            for queue in (context._mailbox, context._held):
                for message, reply in queue or ():
                    if not isinstance(message, (Stop, Wake)):
                        waiting.append((context.entity_id, message, reply))
            context._mailbox = context._held = None
            self._restarts.pop(context, None)
            if context._scope is not None:
                context._scope.cancel()
            self._entity_stopped(context, forget=False)
        if self.stopping:  # handed off meanwhile: the messages follow the shard
            for entity_id, message, reply in waiting:
                self.host.route(self.shard_id, entity_id, message, reply)
            self._done()
        elif self._pending is None:
            self._pending = waiting  # new messages wait for the lease
        else:
            self._pending[:0] = waiting

    def _release_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._flush_pending(pending)

    async def _recover(self, store: RememberStore) -> None:
        ids = await store.load()
        settings = self.host.settings
        if settings.entity_recovery_strategy == "constant" and ids:
            batch = settings.entity_recovery_constant_rate_number_of_entities
            pause = settings.entity_recovery_constant_rate_frequency
            self._release_pending()  # new messages need not wait for the slow restart
            for start in range(0, len(ids), batch):
                if self.stopping:
                    break
                self._wake(ids[start : start + batch])
                await trio.sleep(pause)
        else:
            self._wake(ids)
        if ids:
            logger.info(
                "shard %s/%s: %d remembered entities restarted",
                self.type_name,
                self.shard_id,
                len(ids),
            )

    def _wake(self, ids: list[str]) -> None:
        for entity_id in ids:
            if EntityId(entity_id) not in self.entities:
                context = self._new_context(EntityId(entity_id), remembered=True)
                context._mailbox = collections.deque([(WAKE, None)])
                context._scheduled = True
                self._scheduler.schedule(context)

    def _flush_pending(self, pending: list[tuple[EntityId, object, Reply | None]]) -> None:
        for entity_id, message, reply in pending:
            self.deliver(entity_id, message, reply)

    def _remembered(self, context: EntityContext) -> None:
        """The store has ``context``'s id: its messages may run now."""
        if context._state is _GONE or context._scope is not None:
            return
        context._scheduled = False
        if context._mailbox and context._state is not _RESTARTING:
            context._scheduled = True
            self._scheduler.schedule(context)

    def take_pending(self) -> list[tuple[EntityId, object, Reply | None]]:
        """Messages still waiting for the lease or the remembered ids (the shard is stopping)."""
        if self._loading is not None:
            self._loading.cancel()
        pending, self._pending = self._pending or [], None
        return pending

    # -- delivery ---------------------------------------------------------------------------

    def deliver(self, entity_id: EntityId, message: object, reply: Reply | None) -> None:
        """Queue ``message`` for the entity, starting it if it is not active."""
        if self._pending is not None:
            self._pending.append((entity_id, message, reply))
            return
        context = self.entities.get(entity_id)
        if context is None:
            context = self._new_context(entity_id)
        elif context._state is _STOPPING:
            if context._held is None:
                context._held = []
            context._held.append((message, reply))
            return
        elif self._lru is not None:
            self._lru.move_to_end(context)
        mailbox = context._mailbox
        if mailbox is None:
            spare = self._spare_mailboxes
            mailbox = context._mailbox = spare.pop() if spare else _deque()
        mailbox.append((message, reply))
        if not context._scheduled and context._state is _ACTIVE:
            context._scheduled = True
            self._scheduler.schedule(context)

    def _new_context(self, entity_id: EntityId, *, remembered: bool = False) -> EntityContext:
        context = EntityContext(entity_id, self, trio.current_time())
        self.entities[entity_id] = context
        self.host.entity_started(context)
        if self.store is not None and not remembered:
            # Held back (marked scheduled) until the store has the id, as Akka's RememberingStart.
            context._scheduled = True
            self.store.add(entity_id, lambda: self._remembered(context))
        return context

    # -- running ----------------------------------------------------------------------------

    async def _run(self, context: EntityContext) -> None:
        mailbox = context._mailbox
        try:
            handled = 0
            lease = self.lease if self.lease_token is not None else None
            while mailbox and handled < BATCH:
                if lease is not None and not lease.check():
                    # The lease's deadline passed and its keep-alive task has not run yet (a
                    # process that was stopped, or starved, past its deadline): this entity may
                    # not act any more. Its messages wait for the next grant.
                    self.lease_token = None
                    self._lease_lost()
                    break
                message, reply = mailbox.popleft()
                handled += 1
                if type(message) is Stop:
                    await self._stop_entity(context, message.message)
                    break
                instance = context._instance
                if type(message) is Wake:
                    if instance is None:
                        try:
                            self._create(context)
                        except Exception as exc:
                            self._crashed(context, exc, None)
                            if context._state is _RESTARTING:
                                break
                    continue
                try:
                    if instance is None:
                        instance = self._create(context)
                    if type(message) is Traced:
                        result = await self._receive_traced(instance, message, context, reply)
                    else:
                        result = await instance.receive(message, context)
                except Exception as exc:
                    self._crashed(context, exc, reply)
                    if context._state is _RESTARTING:
                        break
                    continue
                if reply is not None:
                    reply.ok(result)
        finally:
            context._scope = None
            context._scheduled = False
        self._turn_ended(context, mailbox)

    async def _receive_traced(
        self, instance: Entity, traced: Traced, context: EntityContext, reply: Reply | None
    ) -> object:
        """Run ``receive`` in a span that is a child of the sender's (when tracing is on)."""
        tracing = self.host.tracing
        if tracing is None:
            return await instance.receive(traced.message, context)
        with tracing.processing(
            traced.parent, self.shard_id, context.entity_id, ask=reply is not None
        ):
            return await instance.receive(traced.message, context)

    def _turn_ended(self, context: EntityContext, mailbox: collections.deque[Mail] | None) -> None:
        """After an entity's turn: note when, then queue it again if more came, or let it idle."""
        if context._state is _GONE:
            return
        context._last_active = self._now()
        if mailbox:
            if context._state is not _RESTARTING:
                context._scheduled = True
                self._scheduler.schedule(context)
        else:
            spare = self._spare_mailboxes
            if mailbox is not None and context._mailbox is mailbox and len(spare) < SPARE_MAILBOXES:
                spare.append(mailbox)
            context._mailbox = None  # an idle entity keeps no deque

    def _crashed(self, context: EntityContext, exc: Exception, reply: Reply | None) -> None:
        backoff = self.host.settings.entity_restart_backoff
        logger.error(
            "entity %s/%s raised %s: %s; %s",
            self.type_name,
            context.entity_id,
            type(exc).__qualname__,
            exc,
            "it was stopping" if context._state is _STOPPING else f"restarting in {backoff:g} s",
            exc_info=exc,
        )
        if reply is not None:
            reply.fail(_qualified(type(exc)), str(exc))
        self._drop(context)
        context._set(EntityEvent.CRASHED)
        if context._state is _RESTARTING:
            self._restarts[context] = trio.current_time() + backoff
            self.host.restart_due()

    async def _stop_entity(self, context: EntityContext, stop_message: object) -> None:
        instance = context._instance
        if stop_message is not None and instance is not None:
            try:
                await instance.receive(stop_message, context)
            except Exception as exc:
                logger.error(
                    "entity %s/%s raised %s on its stop message: %s",
                    self.type_name,
                    context.entity_id,
                    type(exc).__qualname__,
                    exc,
                    exc_info=exc,
                )
        self._entity_stopped(context)

    def _create(self, context: EntityContext) -> Entity:
        """A new incarnation of the entity: the factory's object."""
        instance: Entity = self.host.entity_factory(context)
        check_entity(self.type_name, instance)
        context._instance = instance
        observers = self.host.observers
        if observers:
            for observer in observers:
                observer.entity_started(self.type_name, context.entity_id, self.lease_token)
        return instance

    def _drop(self, context: EntityContext) -> None:
        """The incarnation ends (stopped, crashed, or its shard lost its lease)."""
        if context._instance is None:
            return
        context._instance = None
        observers = self.host.observers
        if observers:
            for observer in observers:
                observer.entity_stopped(self.type_name, context.entity_id)

    def _entity_stopped(self, context: EntityContext, *, forget: bool = True) -> None:
        context._set(EntityEvent.STOPPED)
        self._drop(context)
        if self.entities.get(context.entity_id) is context:
            del self.entities[context.entity_id]
        self._restarts.pop(context, None)
        self.host.entity_stopped(context)
        rest = list(context._mailbox or ())
        held = context._held
        context._mailbox = context._held = None
        waiting = rest + (held or [])
        if forget and not waiting and self.store is not None and not self.stopping:
            self.store.remove(context.entity_id)  # passivated: forgotten (a hand-off keeps it)
        if waiting:  # the next incarnation gets them, in order (and stops after, in a hand-off)
            successor = self._new_context(context.entity_id, remembered=True)
            successor._mailbox = collections.deque(waiting)
            successor._scheduled = True
            self._scheduler.schedule(successor)
            if self.stopping:
                self.passivate(successor)
        elif self.stopping and not self.entities:
            self._done()

    # -- lifecycle --------------------------------------------------------------------------

    def passivate(self, context: EntityContext, stop_message: object = None) -> None:
        """Stop ``context`` after the messages in its mailbox (see the module docstring)."""
        if context._state is not _ACTIVE or self.entities.get(context.entity_id) is not context:
            return
        context._set(EntityEvent.STOP)
        message = self.host.stop_message if stop_message is None else stop_message
        mailbox = context._mailbox
        if mailbox is None:
            mailbox = context._mailbox = collections.deque()
        mailbox.append((Stop(message), None))
        if not context._scheduled:
            context._scheduled = True
            self._scheduler.schedule(context)

    def stop_all(self, on_stopped: Callable[[], None]) -> None:
        """Stop every entity (a hand-off); call ``on_stopped`` when none is left."""
        self.stopping = True
        self._on_stopped = on_stopped
        for context in list(self.entities.values()):
            if context._state is _RESTARTING:
                self._restarts.pop(context, None)
                context._set(EntityEvent.RESTARTED)
            self.passivate(context)
        if not self.entities:
            self._done()

    def force_stop(self) -> int:
        """Cancel entities that are still running (``handoff_timeout``); returns how many."""
        contexts = list(self.entities.values())
        for context in contexts:
            lost = len(context._mailbox or ()) + len(context._held or ())
            self.lost += lost
            logger.warning(
                "entity %s/%s did not stop within handoff_timeout; stopped by force%s",
                self.type_name,
                context.entity_id,
                f", {lost} messages it held are lost" if lost else "",
            )
            if context._scope is not None:
                context._scope.cancel()
            context._mailbox = context._held = None
            self._entity_stopped(context)
        if self.stopping and not self.entities:
            self._done()
        return len(contexts)

    def _done(self) -> None:
        callback, self._on_stopped = self._on_stopped, None
        if callback is not None:
            callback()

    def tick(self, now: float, idle_before: float | None) -> float:
        """Restart entities whose backoff ended; passivate idle ones. Returns the next due time."""
        due = float("inf")
        for context, at in list(self._restarts.items()):
            if at <= now:
                del self._restarts[context]
                context._set(EntityEvent.RESTARTED)
                if context._mailbox and not context._scheduled:
                    context._scheduled = True
                    self._scheduler.schedule(context)
            else:
                due = min(due, at)
        if idle_before is not None and not self.stopping:
            for context in list(self.entities.values()):
                if (
                    context._state is _ACTIVE
                    and not context._scheduled
                    and not context._mailbox
                    and context._last_active < idle_before
                ):
                    self.passivate(context)
        return due

    def entity_ids(self) -> list[EntityId]:
        """Ids of the entities active here."""
        return sorted(self.entities)


def _qualified(cls: type[Any]) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


__all__ = ["BATCH", "EntityFactory", "EntityWorkers", "Mail", "Shard", "ShardHost"]
