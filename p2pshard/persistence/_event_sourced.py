"""Event-sourced entities: state kept as events in a journal, so it outlives every incarnation.

Theory of operation. Akka does not move an entity's state when its shard moves to another node,
is handed off, or its node crashes: the entity starts again from nothing unless it persists
itself. :class:`EventSourcedEntity` is the small helper for that, after Akka's
``EventSourcedBehavior``: a subclass says what its empty state is, how an event changes the
state (``apply_event``, a pure function) and how a command is handled (``handle_command``,
which calls ``persist`` for each change). ``receive`` is implemented here:

1. On the first message of an incarnation the entity *recovers*: it reads its stream from the
   :class:`p2pshard.Journal` (persistence id ``<type name>|<entity id>``) with the shard's lease
   token, which raises the stream's fence so an older holder can write no more, then folds the
   latest snapshot and the events after it through ``apply_event``.
2. ``persist(event)`` encodes the event with the wire format (registered ``@message`` classes or
   plain msgpack types; never pickle), applies it to a copy of the state, appends it at the next
   sequence number with the token taken at recovery, and only then makes the new state current.
   Applying first means a bug in ``apply_event`` writes nothing.
3. After the command, every ``snapshot_every`` events the state is saved as a snapshot, so that a
   later recovery reads the snapshot and replays only the events after it. The command does not
   wait for that write: the state is encoded at once and handed to the journal's snapshot
   writer (``p2pshard.persistence._gather``), one trio system task per journal object, not per
   entity, which writes the waiting snapshots of many entities in one transaction, and the next
   commands run meanwhile (their appends may be stored before the snapshot: a snapshot at N is
   the state after event N whatever follows). A stream has at most one snapshot write in
   flight; one that becomes due meanwhile waits for the next batch, replacing any older one
   still waiting (only the newest matters to recovery).

Recoveries, too, go through the journal's batcher: those that arrive while a batched read is in
flight (remembered entities woken after a rebalance or a crash, a burst of first messages) are
read together by the next, in one transaction (``BatchJournal.recover_many``); each entity gets
its own recovery, or its own error. A journal without the batch methods is called once per
recovery and per snapshot, as before.

Failure semantics. An event that cannot be encoded (:class:`p2pshard.SerializationError`) or is
too large (:class:`p2pshard.EventTooLarge`) fails that ``persist`` before anything is written;
the incarnation goes on. A journal failure (:class:`p2pshard.JournalError`: storage failed,
:class:`p2pshard.JournalFenced`, :class:`p2pshard.JournalConflict`), or a ``persist`` cancelled
before the journal answered, applies nothing and ends the incarnation: the message fails (an
``ask`` gets :class:`p2pshard.RemoteEntityError` naming the error) even if ``handle_command``
caught the error, and the entity restarts as any entity that raised does, after
``entity_restart_backoff``, with the messages that came meanwhile going to a fresh incarnation
that recovers from the journal. Whatever the journal acknowledged is in that recovery; an append
whose outcome was unknown (a timeout) is in it too if it committed. A failed snapshot is only
logged (and tried again after the next command), except a refusal (fenced, conflict): the
command that made it due has already succeeded (its events are stored), and the first message
that comes after the refusal is known ends the incarnation. An entity that stops does not wait
for its snapshot: the writer still writes it (a stale holder's is refused by the fence), and a
write cut short is one transaction, written whole or not at all, so recovery reads either it or
the previous snapshot with a longer tail.

The incarnation recovers on its first *message*: a remembered entity woken after a hand-off or
a crash (``remember_entities``) is made at once, but reads its journal when a message comes.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable
from typing import Any, ClassVar, Generic, TypeVar

import trio

from membership import MessageDecodeError, SerializationError
from membership.internal import decode_value, encode_value

from .._errors import JournalConflict, JournalError, JournalFenced
from ..sharding._entity import EntityContext, EntityState
from ._gather import SnapshotTicket, journal_batcher
from ._journal import Journal, Recovery
from ._journal_stats import journal_counters

logger = logging.getLogger("p2pshard.persistence")

S = TypeVar("S")


class EventSourcedEntity(abc.ABC, Generic[S]):
    """An entity whose state is the fold of its persisted events; subclass it.

    Set ``snapshot_every`` on the class to snapshot the state every that many events (None: never;
    left out: the journal's ``snapshot_every``, default 100). ``state`` is the current state and
    ``last_sequence_nr`` the number of the last event in it.

    Example:
        >>> @message
        ... @attrs.frozen
        ... class Joined:
        ...     user: str
        >>> @message
        ... @attrs.frozen
        ... class Join:
        ...     user: str
        >>> class Room(EventSourcedEntity[tuple[str, ...]]):
        ...     snapshot_every = 50
        ...     def empty_state(self) -> tuple[str, ...]:
        ...         return ()
        ...     def apply_event(self, state: tuple[str, ...], event: object) -> tuple[str, ...]:
        ...         match event:
        ...             case Joined(user=user):
        ...                 return (*state, user)
        ...         return state
        ...     async def handle_command(self, command: object, ctx: EntityContext) -> object:
        ...         match command:
        ...             case Join(user=user) if user not in self.state:
        ...                 await self.persist(Joined(user))
        ...         return self.state
        >>> async def main(node: Node) -> None:
        ...     rooms = await node.sharding.start(
        ...         "Room", lambda ctx: Room(ctx, node.journal), extractor=HashExtractor(100)
        ...     )
        ...     members = await rooms.entity_ref("lobby").ask(Join("ann"), timeout=5)
    """

    snapshot_every: ClassVar[int | None]
    """Events between snapshots of this entity type; None for never. Optional: when the class
    leaves it out, the journal's ``snapshot_every`` applies."""

    def __init__(self, ctx: EntityContext, journal: Journal) -> None:
        self._journal = journal
        self._ctx = ctx
        self._persistence_id = f"{ctx.type_name}|{ctx.entity_id}"
        self._logger = ctx.logger
        self._state: S | None = None
        self._recovered = False
        self._seq = 0
        self._snapshot_seq = 0
        """The sequence number of the latest snapshot stored or handed to the writer."""
        self._snapshot_stored = 0
        """The sequence number of the latest snapshot known to be stored."""
        self._snapshot_refused: JournalError | None = None
        self._batcher = journal_batcher(journal)
        self._token: int | None = None
        self._failed: JournalError | None = None
        self._appending = False
        self._counters = journal_counters(journal)

    # -- what subclasses write --------------------------------------------------------------

    @abc.abstractmethod
    def empty_state(self) -> S:
        """The state before the first event."""

    @abc.abstractmethod
    def apply_event(self, state: S, event: Any) -> S:
        """The state after ``event``: a pure function of its arguments, also used in recovery.

        Return a new state rather than changing ``state``: ``persist`` applies the event before
        the journal has stored it, and keeps the result only if it has.
        """

    @abc.abstractmethod
    async def handle_command(self, command: Any, ctx: EntityContext) -> object:
        """Handle one message; what it returns answers an ``ask``.

        Call :meth:`persist` to change the state; ``self.state`` is already recovered.
        """

    # -- what subclasses use ----------------------------------------------------------------

    @property
    def persistence_id(self) -> str:
        """The entity's stream in the journal: ``<type name>|<entity id>``.

        Override it to keep the streams of a renamed entity type.
        """
        return self._persistence_id

    @property
    def journal(self) -> Journal:
        """The journal this entity persists to."""
        return self._journal

    @property
    def state(self) -> S:
        """The current state: every persisted event applied.

        Raises:
            RuntimeError: before recovery (in the constructor): use it in ``handle_command``.
        """
        if not self._recovered:
            raise RuntimeError(
                f"{self.persistence_id}: the state is not recovered before the first message; "
                "read it in handle_command"
            )
        return self._state  # type: ignore[return-value]

    @property
    def last_sequence_nr(self) -> int:
        """The sequence number of the last event in ``state`` (0: none yet)."""
        return self._seq

    async def persist(self, event: object) -> None:
        """Store ``event`` in the journal, then apply it to ``state``.

        Raises:
            SerializationError: the event cannot be encoded (the error names the type); nothing
                was written and the incarnation goes on.
            EventTooLarge: the event is above the journal's ``max_event_size``; likewise.
            JournalError: the journal failed or refused (fenced, conflict): nothing was applied
                and the incarnation ends with this message (see the module docstring).
            RuntimeError: called outside ``handle_command``, or while another persist of this
                entity has not returned.
        """
        await self.persist_all((event,))

    async def persist_all(self, events: Iterable[object]) -> None:
        """Store ``events`` in one atomic append (all or none), then apply them in order.

        Raises:
            SerializationError: as :meth:`persist`.
            EventTooLarge: as :meth:`persist`.
            JournalError: as :meth:`persist`.
            RuntimeError: as :meth:`persist`.
        """
        pid = self.persistence_id
        if not self._recovered:
            raise RuntimeError(f"{pid}: persist is for handle_command, after recovery")
        if self._failed is not None:
            raise self._failed
        if self._appending:
            raise RuntimeError(
                f"{pid}: persist called while another persist of this entity has not returned; "
                "await each in turn (or use persist_all)"
            )
        batch = list(events)
        if not batch:
            return
        payloads = [encode_value(event) for event in batch]
        state = self._state
        for event in batch:
            state = self.apply_event(state, event)  # type: ignore[arg-type]
        first = self._seq + 1
        self._appending = True
        answered = False
        counters = self._counters
        counters.appends += 1
        started = trio.current_time()
        try:
            await self._journal.append(pid, first, payloads, token=self._token)
            answered = True
        except (SerializationError, ValueError, TypeError):
            answered = True  # refused before anything was written
            raise
        except JournalError as exc:
            answered = True
            self._failed = exc
            reason = (
                "fenced"
                if isinstance(exc, JournalFenced)
                else "conflict"
                if isinstance(exc, JournalConflict)
                else "error"
            )
            counters.append_failures[reason] += 1
            raise
        finally:
            self._appending = False
            if not answered and self._failed is None:
                self._failed = JournalError(
                    pid,
                    f"the append at {first} was interrupted before the journal answered; its "
                    "outcome is unknown, so this incarnation ends",
                )
        counters.append_seconds.observe(trio.current_time() - started)
        counters.events += len(batch)
        self._state = state
        self._seq = first + len(batch) - 1

    # -- the Entity protocol ----------------------------------------------------------------

    async def receive(self, message: Any, ctx: EntityContext, /) -> object:
        """Recover on the first message, then hand each message to :meth:`handle_command`.

        Not to be overridden: write ``handle_command``.
        """
        if self._failed is None and self._snapshot_refused is not None:
            self._failed = self._snapshot_refused
        if self._failed is not None:
            raise self._failed
        if not self._recovered:
            await self._recover(ctx)
        result = await self.handle_command(message, ctx)
        if self._failed is not None:  # a persist failed and the handler went on anyway
            raise self._failed
        self._snapshot_if_due()
        return result

    # -- recovery and snapshots ---------------------------------------------------------------

    async def _recover(self, ctx: EntityContext) -> None:
        pid = self.persistence_id
        token = ctx.lease_token  # kept: after a lost lease the context's token is None
        recovery = await self._batcher.recover(pid, token)
        state, seq = self._fold(recovery)
        self._state, self._seq, self._token = state, seq, token
        self._snapshot_seq = 0 if recovery.snapshot is None else recovery.snapshot[0]
        self._snapshot_stored = self._snapshot_seq
        self._recovered = True
        self._logger.debug(
            "%s recovered to %d: snapshot at %d and %d events (token %s)",
            pid,
            seq,
            self._snapshot_seq,
            len(recovery.events),
            token,
        )

    def _fold(self, recovery: Recovery) -> tuple[S, int]:
        pid = self.persistence_id
        if recovery.snapshot is None:
            state, seq = self.empty_state(), 0
        else:
            seq = recovery.snapshot[0]
            state = self._decode(recovery.snapshot[1], f"the snapshot at {seq}")  # type: ignore[assignment]
        for number, data in recovery.events:
            if number != seq + 1:
                raise JournalError(
                    pid, f"recovery read event {number} after {seq}: the stream has a gap"
                )
            state = self.apply_event(state, self._decode(data, f"event {number}"))
            seq = number
        if seq != recovery.highest_seq:
            raise JournalError(
                pid,
                f"recovery read up to event {seq}, but the highest stored is "
                f"{recovery.highest_seq}",
            )
        return state, seq

    def _decode(self, data: bytes, what: str) -> object:
        try:
            return decode_value(data)
        except MessageDecodeError as exc:
            raise JournalError(
                self.persistence_id,
                f"{what} cannot be read: {exc} (is every event class imported and registered "
                "with @message under the same name?)",
            ) from exc

    def _snapshot_interval(self) -> int | None:
        every: int | None = getattr(type(self), "snapshot_every", self._journal.snapshot_every)
        return every

    def _snapshot_if_due(self) -> None:
        """Hand a snapshot to the journal's writer if one is due; never waits for the write."""
        every = self._snapshot_interval()
        if every is None or self._seq - self._snapshot_seq < every:
            return
        pid, seq = self.persistence_id, self._seq
        try:
            data = encode_value(self._state)
            self._batcher.save_snapshot_later(
                pid, seq, data, token=self._token, on_done=self._snapshot_done
            )
        except SerializationError as exc:  # EventTooLarge included: recovery replays instead
            self._logger.warning("%s: no snapshot at %d: %s", pid, seq, exc)
        self._snapshot_seq = seq  # not again before another snapshot_every events

    def _snapshot_done(self, ticket: SnapshotTicket) -> None:
        """The writer's word on a snapshot of this incarnation (called in the writer's task)."""
        pid, seq, exc = self.persistence_id, ticket.write.seq, ticket.error
        if ticket.superseded:
            return
        if exc is None:
            self._snapshot_stored = max(self._snapshot_stored, seq)
        elif isinstance(exc, JournalFenced | JournalConflict):
            if self._ctx.state is EntityState.ACTIVE:
                self._logger.warning(
                    "%s: snapshot at %d refused; the incarnation ends at its next message: %s",
                    pid,
                    seq,
                    exc,
                )
            else:  # it stopped meanwhile (a hand-off: the new holder's recovery fenced it)
                self._logger.debug(
                    "%s: snapshot at %d of a stopped incarnation refused: %s", pid, seq, exc
                )
            self._snapshot_refused = exc
        else:
            self._logger.warning("%s: snapshot at %d failed (tried again later): %s", pid, seq, exc)
            if self._snapshot_seq == seq:  # no newer one asked for: due again after a command
                self._snapshot_seq = self._snapshot_stored
