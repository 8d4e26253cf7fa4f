"""Event-sourced chaos workloads: counters, rooms and inboxes whose durable state is a journal.

Theory of operation: with ``ChaosSettings.event_sourced`` the counters, rooms and inboxes of
every node are :class:`~p2pshard.EventSourcedEntity` subclasses writing to one group-committing
:class:`~p2pshard.MemoryJournal` that the whole simulated cluster shares, as real nodes share a
database; each incarnation writes with its shard's lease token. A counter persists
``Added(sender, seq)`` before it answers; a room persists ``Added`` and then copies the post to
its members, as the plain room does (``p2pshard.testing._fanout``); an inbox persists
``Copied(room, sender, seq)`` for each post it takes. None of them writes a log into the
:class:`~p2pshard.testing.History`: after the run :func:`read_journal` fills the history's logs
and copies from the journal's streams, so the same checkers (every acknowledged message kept
exactly once, each sender's order, every member holding every acknowledged post) judge what the
journal holds, and :func:`~p2pshard.testing.check_journal_calls` checks from the journal's own
record that no append got past a fence.

Each node reaches the journal through :meth:`~p2pshard.MemoryJournal.link`: while the node is
paused (the ``pause`` fault) its calls are in flight until the pause ends and arrive even if
their callers are gone by then, as a paused process's requests do. An incarnation that lost its
shard during the pause thus sends its appends late, into batches with the new holder's, and the
fence the new holder's recovery raised must refuse them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from membership import message
from membership.internal import decode_value

from ..persistence._event_sourced import EventSourcedEntity
from ..persistence._journal import Journal
from ..persistence._memory import MemoryJournal
from ..sharding._entity import EntityContext
from ..sharding._sharding import Sharding
from ._fanout import INBOX, ROOM, Deliver, copy_to_member
from ._history import History
from ._sim import SimCluster
from ._workload import COUNTER, Add, Added, CountsAdded, Read, Stall

SNAPSHOT_EVERY = 10
"""Events between the workload entities' snapshots: often, so that chaos runs recover from
snapshots (and fence them) too."""


@message(name="p2pshard.testing.Copied")
@attrs.frozen(kw_only=True)
class Copied:
    """The event-sourced inbox's event: it took ``sender``'s post ``seq`` of ``room``."""

    room: str
    sender: str
    seq: int


def chaos_journal(latency: Callable[[], float]) -> MemoryJournal:
    """The journal of an event-sourced chaos run: group commit, ``latency()`` per batch."""
    return MemoryJournal(group_commit=True, commit_latency=latency, snapshot_every=SNAPSHOT_EVERY)


def node_journal(journal: MemoryJournal, sim: SimCluster, i: int) -> Journal:
    """Node ``i``'s way to ``journal``: its calls wait while the node is paused."""
    return journal.link(functools.partial(_paused_for, sim, i))


def _paused_for(sim: SimCluster, i: int) -> float:
    return sim.paused_until.get(i, 0.0) - trio.current_time()


def journaled_counter(journal: Journal) -> Callable[[EntityContext], Any]:
    """The counter workload's entity, event-sourced: each ``Add`` is an ``Added`` event.

    Answered with the count once the event is stored; ``Read`` and ``Stall`` as the plain one.
    """

    class Counter(CountsAdded):
        def __init__(self, ctx: EntityContext) -> None:
            super().__init__(ctx, journal)

        async def handle_command(self, command: object, ctx: EntityContext) -> object:
            match command:
                case Add(sender=sender, seq=seq):
                    await self.persist(Added(sender=sender, seq=seq))
                    return self.state
                case Read():
                    return self.state
                case Stall(seconds=seconds):
                    await trio.sleep(seconds)
                    return None
            raise ValueError(f"the counter does not understand {command!r}")

    return Counter


Posts = Sequence[Sequence[Any]]
"""A room's posts, ``(sender, seq)`` each (lists once read back from a snapshot)."""


def journaled_room(
    history: History,
    journal: Journal,
    sharding: Sharding,
    members: Callable[[str], tuple[str, ...]],
    *,
    timeout: float = 1.0,
) -> Callable[[EntityContext], Any]:
    """The fan-out room, event-sourced: its posts are ``Added`` events, stored before the copies.

    As :func:`~p2pshard.testing.room_entity` otherwise: it answers once every member holds the
    post; what each member holds it learns from their answers.
    """

    class Room(EventSourcedEntity[Posts]):
        def __init__(self, ctx: EntityContext) -> None:
            super().__init__(ctx, journal)
            self.key = f"{ctx.type_name}/{ctx.entity_id}"
            self.members = members(ctx.entity_id)
            self.held = dict.fromkeys(self.members, 0)
            history.room_members[self.key] = tuple(f"{INBOX}/{m}" for m in self.members)

        def empty_state(self) -> Posts:
            return ()

        def apply_event(self, state: Posts, event: object) -> Posts:
            if isinstance(event, Added):
                return (*state, (event.sender, event.seq))
            return state

        async def handle_command(self, command: object, ctx: EntityContext) -> object:
            match command:
                case Add(sender=sender, seq=seq):
                    await self.persist(Added(sender=sender, seq=seq))
                    posts, upto = self.state, len(self.state)
                    for member in self.members:
                        self.held[member] = await copy_to_member(
                            sharding, self.key, member, posts, self.held[member], upto, timeout
                        )
                    return upto
                case Read():
                    return len(self.state)
            raise ValueError(f"the room does not understand {command!r}")

    return Room


def journaled_inbox(journal: Journal) -> Callable[[EntityContext], Any]:
    """The fan-out member inbox, event-sourced: each post it takes is a ``Copied`` event.

    Its state is how many posts of each room it holds; as the plain inbox, it takes post ``n``
    only right after post ``n - 1``, skips what it holds, and answers how many it holds.
    """

    class Inbox(EventSourcedEntity[dict[str, int]]):
        def __init__(self, ctx: EntityContext) -> None:
            super().__init__(ctx, journal)

        def empty_state(self) -> dict[str, int]:
            return {}

        def apply_event(self, state: dict[str, int], event: object) -> dict[str, int]:
            if isinstance(event, Copied):
                return {**state, event.room: state.get(event.room, 0) + 1}
            return state

        async def handle_command(self, command: object, ctx: EntityContext) -> object:
            match command:
                case Deliver(room=room, first=first, posts=posts):
                    held = self.state.get(room, 0)
                    if first <= held + 1:
                        new = posts[held + 1 - first :]
                        if new:
                            await self.persist_all(
                                Copied(room=room, sender=sender, seq=seq) for sender, seq in new
                            )
                    return self.state.get(room, 0)
            raise ValueError(f"the inbox does not understand {command!r}")

    return Inbox


def read_journal(journal: MemoryJournal, history: History) -> None:
    """Fill ``history``'s logs and copies from the streams of the workload entities in ``journal``.

    A counter's or room's log is its ``Added`` events, an inbox's copy of each room its
    ``Copied`` events, in stream order: the durable state the checkers then judge.
    """
    for pid in journal.persistence_ids():
        type_name, _, entity_id = pid.partition("|")
        key = f"{type_name}/{entity_id}"
        events = [decode_value(data) for data in journal.events(pid)]
        if type_name in (COUNTER, ROOM) and events:
            history.logs[key] = [(e.sender, e.seq) for e in events if isinstance(e, Added)]
        elif type_name == INBOX:
            copies = history.copies.setdefault(key, {})
            for e in events:
                if isinstance(e, Copied):
                    copies.setdefault(e.room, []).append((e.sender, e.seq))
