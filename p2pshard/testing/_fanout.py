"""A chat-like fan-out workload: rooms that copy every post to their members' inboxes.

Theory of operation: a room (entity type :data:`ROOM`) is a counter whose log is its posts; its
members are inbox entities (type :data:`INBOX`), a fixed few per room, on any node. A room
handles a post (an :class:`~p2pshard.testing.Add`) by writing it to its log and then asking each
member's inbox, one after the other, to take the posts it does not have yet
(:class:`Deliver`); only when every member holds the post does the room answer, so an
acknowledged post is one that reached every member. An inbox keeps, per room, a copy that only
grows at its end: it takes post ``n`` only right after post ``n - 1``, skips what it already
holds, and answers how many posts of the room it holds, so the room can resend from there. The
room remembers what each member holds only while it runs; a new incarnation learns it from the
inboxes' answers.

This is the chat example's pattern (rooms fan out through other entities, a member catches up
from the room's log) under the chaos schedule: entity-to-entity asks crossing shard hand-offs,
crashes and partitions. The copies are in the :class:`~p2pshard.testing.History` (they stand for
the inboxes' durable state), and :func:`~p2pshard.testing.check_fan_out` checks them: every
member's copy of a room is a prefix of the room's log (nothing lost, repeated or reordered), and
holds every post the room acknowledged.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from membership import message

from ..sharding._entity import EntityContext
from ..sharding._sharding import Sharding
from ._history import History
from ._workload import Add, Read

ROOM = "Room"
"""The fan-out workload's room entity type name."""

INBOX = "Inbox"
"""The fan-out workload's member inbox entity type name."""

COPY_ATTEMPTS = 3
"""Deliveries a room makes to one member per post before it gives up (and does not answer)."""


@message(name="p2pshard.testing.Deliver")
@attrs.frozen(kw_only=True)
class Deliver:
    """Fan-out workload: posts number ``first``, ``first + 1``, … of ``room`` for one inbox.

    ``room`` is a ``type/id`` key; the answer is how many of the room's posts the inbox holds.
    """

    room: str
    first: int
    posts: tuple[tuple[str, int], ...]


def room_members(room_id: str, *, inboxes: int, per_room: int) -> tuple[str, ...]:
    """The inbox ids of ``room_id``'s members: ``per_room`` of ``i0`` … ``i<inboxes - 1>``.

    The same on every node and in every run.
    """
    chosen = random.Random(f"members/{room_id}").sample(range(inboxes), min(per_room, inboxes))
    return tuple(f"i{k}" for k in sorted(chosen))


def room_entity(
    history: History,
    sharding: Sharding,
    members: Callable[[str], tuple[str, ...]],
    *,
    timeout: float = 1.0,
) -> Callable[[EntityContext], Any]:
    """The room's entity factory for one node.

    ``sharding`` is that node's (to reach inboxes); ``members`` gives a room's member inbox ids;
    ``timeout`` bounds each delivery.
    """

    class Room:
        def __init__(self, ctx: EntityContext) -> None:
            self.key = f"{ctx.type_name}/{ctx.entity_id}"
            self.members = members(ctx.entity_id)
            self.held = dict.fromkeys(self.members, 0)
            """What each member is known to hold, as far as this incarnation knows."""
            history.room_members[self.key] = tuple(f"{INBOX}/{m}" for m in self.members)

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            match msg:
                case Add(sender=sender, seq=seq):
                    history.logged(self.key, sender, seq)
                    log = history.logs[self.key]
                    upto = len(log)
                    for member in self.members:
                        await self.copy(member, log, upto)
                    return upto
                case Read():
                    return len(history.logs.get(self.key, ()))
            raise ValueError(f"the room does not understand {msg!r}")

        async def copy(self, member: str, log: list[tuple[str, int]], upto: int) -> None:
            self.held[member] = await copy_to_member(
                sharding, self.key, member, log, self.held[member], upto, timeout
            )

    return Room


async def copy_to_member(
    sharding: Sharding,
    room: str,
    member: str,
    log: Sequence[Sequence[Any]],
    held: int,
    upto: int,
    ask_timeout: float,
) -> int:
    """Deliver ``room``'s posts after ``held`` up to ``upto`` to ``member``'s inbox.

    ``log`` is the room's posts, ``held`` what the member is known to hold; each delivery waits
    ``ask_timeout`` seconds at most. Returns what the
    member holds once it holds post ``upto``; RuntimeError after :data:`COPY_ATTEMPTS`
    deliveries that did not get it there.
    """
    inbox = sharding.region(INBOX).entity_ref(member)
    for _ in range(COPY_ATTEMPTS):
        first = held + 1
        posts = tuple((sender, seq) for sender, seq in log[first - 1 : upto])
        answer = await inbox.ask(Deliver(room=room, first=first, posts=posts), timeout=ask_timeout)
        assert isinstance(answer, int)
        held = answer
        if held >= upto:
            return held
    raise RuntimeError(f"{INBOX}/{member} still lacks posts of {room} up to {upto}")


def inbox_entity(history: History) -> Callable[[EntityContext], Any]:
    """The member inbox's entity factory: it appends what a room delivers to its copy."""

    class Inbox:
        def __init__(self, ctx: EntityContext) -> None:
            self.key = f"{ctx.type_name}/{ctx.entity_id}"

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            match msg:
                case Deliver(room=room, first=first, posts=posts):
                    copy = history.copies.setdefault(self.key, {}).setdefault(room, [])
                    for number, post in enumerate(posts, start=first):
                        if number == len(copy) + 1:
                            copy.append(post)
                        elif number > len(copy) + 1:
                            break  # a gap: the room sends from where this copy ends
                    return len(copy)
            raise ValueError(f"the inbox does not understand {msg!r}")

    return Inbox
