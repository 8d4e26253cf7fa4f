"""Entities: what user code sees (:class:`EntityContext`, :class:`EntityRef`) and their lifecycle.

Theory of operation. An entity is a plain object made by the entity type's factory from its
:class:`EntityContext`, and one ``receive(message, ctx)`` coroutine call per message. It is not a
trio task: an idle entity is the object and its context, a few hundred bytes, so a node holds a
million of them. When messages wait for an entity, its context is put on the region's run queue
and one of a small pool of worker tasks runs them, one at a time and in order
(``p2pshard.sharding._shard``).

The lifecycle, as Pekko's ``Shard`` ``EntityState`` (a context exists only in these states)::

                 receive raised                     backoff over
      ACTIVE ───────────────────▶ RESTARTING ──────────────────▶ ACTIVE
        │ passivate(), idle, LRU, hand-off           │ hand-off: restart at once, then stop
        ▼                                            ▼
     STOPPING ──stop message handled (or none)──▶ gone (messages held meanwhile start the
                                                        next incarnation)

An illegal transition raises :class:`IllegalEntityTransition` and changes nothing.
"""

from __future__ import annotations

import collections
import enum
import functools
import inspect
import logging
import typing
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs

from membership import ClusterError, ConfigurationError

from ._allocation import EntityId, ShardId
from ._reply import Reply as Reply

logger = logging.getLogger("p2pshard.entity")


class EntityState(enum.Enum):
    """Where one entity incarnation is in its life."""

    ACTIVE = "active"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    GONE = "gone"


class EntityEvent(enum.Enum):
    """What moves an entity from state to state."""

    CRASHED = "crashed"
    RESTARTED = "restarted"
    STOP = "stop"
    STOPPED = "stopped"


_TRANSITIONS: dict[tuple[EntityState, EntityEvent], EntityState] = {
    (EntityState.ACTIVE, EntityEvent.CRASHED): EntityState.RESTARTING,
    (EntityState.ACTIVE, EntityEvent.STOP): EntityState.STOPPING,
    (EntityState.RESTARTING, EntityEvent.RESTARTED): EntityState.ACTIVE,
    (EntityState.RESTARTING, EntityEvent.STOPPED): EntityState.GONE,
    (EntityState.STOPPING, EntityEvent.CRASHED): EntityState.STOPPING,
    (EntityState.STOPPING, EntityEvent.STOPPED): EntityState.GONE,
    (EntityState.ACTIVE, EntityEvent.STOPPED): EntityState.GONE,  # forced (hand-off timeout)
}


class IllegalEntityTransition(ClusterError, ValueError):
    """A lifecycle event that does not apply in the entity's state (a bug in the runtime)."""


def transition(state: EntityState, event: EntityEvent) -> EntityState:
    """The state after ``event``; raises :class:`IllegalEntityTransition` if there is none."""
    try:
        return _TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalEntityTransition(
            f"entity event {event.value} in state {state.value}"
        ) from None


class Entity(Protocol):
    """What an entity class provides: ``receive`` is called once per message, in order.

    The value it returns answers an ``ask`` (and is ignored for a ``tell``); an exception it
    raises restarts the entity after ``entity_restart_backoff`` and fails the ask with
    :class:`RemoteEntityError`.
    """

    async def receive(self, message: Any, ctx: EntityContext, /) -> object:
        """Handle one message."""
        ...


def _is_async(method: object) -> bool:
    # A decorator made with functools.wraps may return the coroutine from a plain function.
    return inspect.iscoroutinefunction(method) or (
        callable(method) and inspect.iscoroutinefunction(inspect.unwrap(method))
    )


def _not_async(type_name: str, owner: str, receive: object) -> ConfigurationError:
    return ConfigurationError(
        f"entity type {type_name!r}: {owner}.receive is {type(receive).__name__} "
        f"{getattr(receive, '__qualname__', receive)!r}, not a coroutine function: write it "
        "as `async def receive(self, message, ctx)`; the runtime awaits it for every message"
    )


def entity_class(factory: object) -> type | None:
    """The class ``factory`` makes, when that is visible without calling it.

    The class itself; a ``functools.partial`` of one; or a function or method whose return
    annotation is a class. None for anything else (a lambda, say).
    """
    if isinstance(factory, type):
        return factory
    if isinstance(factory, functools.partial):
        return entity_class(factory.func)
    try:
        returned = typing.get_type_hints(factory).get("return")
    except Exception:  # annotations that do not resolve, or no annotations at all
        return None
    return returned if isinstance(returned, type) else None


def check_entity_factory(type_name: str, factory: object) -> None:
    """Refuse, at ``sharding.start``, an entity class whose ``receive`` is not ``async def``.

    Only the class the factory visibly makes is checked (see :func:`entity_class`); for other
    factories :func:`check_entity` checks the first entity made.

    Raises:
        ConfigurationError: naming the type, the class and what to write instead.
    """
    cls = entity_class(factory)
    receive = getattr(cls, "receive", None) if cls is not None else None
    if cls is not None and receive is not None and not _is_async(receive):
        raise _not_async(type_name, cls.__qualname__, receive)


_CHECKED_CLASSES: set[type] = set()
"""Entity classes whose first instance had an ``async def receive``: not checked again."""


def check_entity(type_name: str, instance: object) -> None:
    """Refuse an entity whose ``receive`` is missing or not ``async def`` (once per class).

    Raises:
        ConfigurationError: naming the type, the class and what to write instead.
    """
    cls = type(instance)
    if cls in _CHECKED_CLASSES:
        return
    receive = getattr(instance, "receive", None)
    if receive is None:
        raise ConfigurationError(
            f"entity type {type_name!r}: the factory made a {cls.__qualname__}, which has no "
            "receive method; give it `async def receive(self, message, ctx)`"
        )
    if not _is_async(receive):
        raise _not_async(type_name, cls.__qualname__, receive)
    _CHECKED_CLASSES.add(cls)


@attrs.frozen(eq=False)
class EntitySender:
    """What an :class:`EntityRef` needs of its entity type's region: sending by entity id.

    A region makes one and hands it to every reference it gives out; two references to the same
    entity are equal when they share it.
    """

    type_name: str
    tell: Callable[[EntityId, object], Awaitable[None]]
    """Send a message to an entity (see :meth:`EntityRef.tell`)."""
    ask: Callable[[EntityId, object, float], Awaitable[object]]
    """Send a message and await the entity's answer, with a timeout (see :meth:`EntityRef.ask`)."""


class EntityOwner(Protocol):
    """What an :class:`EntityContext` needs of the shard its entity lives in."""

    @property
    def shard_id(self) -> ShardId:
        """The shard's id."""
        ...

    @property
    def type_name(self) -> str:
        """The entity type."""
        ...

    @property
    def sender(self) -> EntitySender:
        """Sends to the entity type's entities (for :attr:`EntityContext.self_ref`)."""
        ...

    @property
    def lease_token(self) -> int | None:
        """The fencing token of the shard's lease, if it has one now."""
        ...

    def passivate(self, context: EntityContext, stop_message: object = None) -> None:
        """Stop ``context``'s entity once its mailbox is handled (see ``ctx.passivate``)."""
        ...


class Stop:
    """The mailbox entry that ends an incarnation; ``message`` goes to ``receive`` first."""

    __slots__ = ("message",)

    def __init__(self, message: object) -> None:
        self.message = message


class Wake:
    """The mailbox entry that starts a remembered entity without a message."""

    __slots__ = ()


WAKE = Wake()

Mail = tuple[object, "Reply | None"]
"""One mailbox entry: a message (or :class:`Stop`) and where its answer goes."""


class EntityContext:
    """What an entity gets: its id, its shard, passivation and a reference to itself.

    One context lives as long as one incarnation of the entity; the entity receives it in its
    constructor and with every message.

    Example:
        >>> class Session:
        ...     def __init__(self, ctx: EntityContext) -> None:
        ...         ctx.logger.info("session %s started", ctx.entity_id)
        ...     async def receive(self, msg: object, ctx: EntityContext) -> object:
        ...         if msg == "logout":
        ...             ctx.passivate()
        ...         return None
    """

    __slots__ = (
        "_held",
        "_instance",
        "_last_active",
        "_mailbox",
        "_scheduled",
        "_scope",
        "_shard",
        "_state",
        "entity_id",
    )

    def __init__(self, entity_id: EntityId, shard: EntityOwner, now: float) -> None:
        self.entity_id = entity_id
        self._shard = shard
        self._instance: Entity | None = None
        self._state = EntityState.ACTIVE
        self._mailbox: collections.deque[Mail] | None = None
        self._held: list[Mail] | None = None  # messages that came while STOPPING
        self._scheduled = False
        self._scope: Any = None  # the trio cancel scope while a worker runs this entity
        self._last_active = now

    @property
    def shard_id(self) -> ShardId:
        """The shard this entity belongs to."""
        return self._shard.shard_id

    @property
    def type_name(self) -> str:
        """The entity type."""
        return self._shard.type_name

    @property
    def state(self) -> EntityState:
        """This incarnation's lifecycle state."""
        return self._state

    @property
    def self_ref(self) -> EntityRef:
        """A reference to this entity, to hand to others (it stays valid across incarnations)."""
        return EntityRef(self._shard.sender, self.entity_id)

    @property
    def lease_token(self) -> int | None:
        """The fencing token of the shard's lease, when the entity type uses leases."""
        return self._shard.lease_token

    @property
    def logger(self) -> logging.Logger:
        """A logger named after the entity type."""
        return logging.getLogger(f"p2pshard.entity.{self.type_name}")

    def passivate(self, stop_message: object = None) -> None:
        """Stop this entity once the messages already in its mailbox are handled.

        ``stop_message`` (or the entity type's ``stop_message``, if None) is handled last;
        messages that come after the call wait and go to the next incarnation, as with Akka's
        ``Passivate``. Calling it again, or on a stopping entity, does nothing.
        """
        self._shard.passivate(self, stop_message)

    def _set(self, event: EntityEvent) -> None:
        self._state = transition(self._state, event)

    def __repr__(self) -> str:
        return f"<EntityContext {self.type_name}/{self.entity_id} {self._state.value}>"


class EntityRef:
    """Sends to one entity, wherever its shard lives. Get one from ``region.entity_ref(id)``.

    Example:
        >>> async def bump(counters: ShardRegion) -> object:
        ...     ref = counters.entity_ref("counter-1")
        ...     await ref.tell(Increment())
        ...     return await ref.ask(Get(), timeout=5)
    """

    __slots__ = ("_sender", "entity_id")

    def __init__(self, sender: EntitySender, entity_id: str) -> None:
        if not isinstance(entity_id, str) or not entity_id:
            raise ValueError(f"an entity id must be a non-empty string, not {entity_id!r}")
        self._sender = sender
        self.entity_id = EntityId(entity_id)

    async def tell(self, message: object) -> None:
        """Send ``message`` to the entity, at most once, in order with this node's other sends.

        Raises:
            SerializationError: the message cannot travel between nodes.
            RegionStopped: the region has stopped.
        """
        await self._sender.tell(self.entity_id, message)

    async def ask(self, message: object, *, timeout: float) -> object:  # noqa: ASYNC109 - the API
        """Send ``message`` and return what the entity's ``receive`` returns.

        Raises:
            AskTimeout: no answer within ``timeout`` seconds (it may still have been handled).
            RemoteEntityError: the entity raised while handling it.
            BufferOverflow: the shard's home is unknown and the region's buffer is full.
            SerializationError: the message cannot travel between nodes.
        """
        return await self._sender.ask(self.entity_id, message, timeout)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, EntityRef)
            and other._sender is self._sender
            and other.entity_id == self.entity_id
        )

    def __hash__(self) -> int:
        return hash((id(self._sender), self.entity_id))

    def __repr__(self) -> str:
        return f"<EntityRef {self._sender.type_name}/{self.entity_id}>"
