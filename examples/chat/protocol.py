"""The chat's messages between nodes and its events in the journal, with input validation.

Rooms (:mod:`examples.chat.room`) take :class:`Join`, :class:`Leave`, :class:`Post`,
:class:`History` and :class:`ConnectionsGone`; node gateways (:mod:`examples.chat.gateway`)
take :class:`Deliver`. A room persists :class:`Joined`, :class:`Left` and :class:`ChatMessage`
events and snapshots its :class:`RoomState`.
"""

from __future__ import annotations

import re

import attrs

from p2pshard import message

HISTORY_LIMIT = 100
"""Messages a room keeps (and answers ``History`` with)."""

RECENT_IDS_LIMIT = 1000
"""Client message ids a room remembers, so that a retried post is not stored twice."""

MAX_TEXT_BYTES = 4096
"""Largest message text, UTF-8 encoded."""

_ROOM = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_USER = re.compile(r"[\w.-]{1,32}")
_CLIENT_ID = re.compile(r"[\w.:-]{1,64}")


class InvalidInput(ValueError):
    """A client sent something the chat refuses; the text says what and what to do instead."""


def check_room(room: object) -> str:
    """Return ``room`` if it is a valid room name, else raise :class:`InvalidInput`."""
    if not isinstance(room, str) or not _ROOM.fullmatch(room):
        raise InvalidInput(
            f"invalid room name {room!r}: use 1 to 32 characters, lower-case letters, digits, "
            "'-' and '_', starting with a letter or digit"
        )
    return room


def check_user(user: object) -> str:
    """Return ``user`` if it is a valid user name, else raise :class:`InvalidInput`."""
    if not isinstance(user, str) or not _USER.fullmatch(user):
        raise InvalidInput(
            f"invalid user name {user!r}: use 1 to 32 letters, digits, '.', '-' or '_'"
        )
    return user


def check_text(text: object) -> str:
    """Return ``text`` if it is a message text that may be posted, else raise."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput("a message needs some text")
    size = len(text.encode("utf-8"))
    if size > MAX_TEXT_BYTES:
        raise InvalidInput(
            f"message too long: {size} bytes, at most {MAX_TEXT_BYTES} (4 KiB) are allowed"
        )
    return text


def check_client_id(client_id: object) -> str:
    """Return ``client_id`` if it is a valid client message id, else raise."""
    if not isinstance(client_id, str) or not _CLIENT_ID.fullmatch(client_id):
        raise InvalidInput(
            f"invalid message id {client_id!r}: 1 to 64 letters, digits, '.', ':', '-' or '_'"
        )
    return client_id


def connection_node(conn: str) -> str:
    """The node a connection id (``<node name>/<random>``) belongs to."""
    return conn.split("/", 1)[0]


# -- events (and the state) ------------------------------------------------------------------


@message
@attrs.frozen(kw_only=True)
class ChatMessage:
    """A posted message: an event in the room's journal, and what members receive."""

    seq: int
    user: str
    text: str
    client_id: str
    at: float


@message
@attrs.frozen(kw_only=True)
class Joined:
    """Event: ``user`` is in the room through connection ``conn``."""

    user: str
    conn: str


@message
@attrs.frozen(kw_only=True)
class Left:
    """Event: connection ``conn`` of ``user`` is out of the room."""

    user: str
    conn: str


@message
@attrs.frozen(kw_only=True)
class RoomState:
    """A room: its connections (user, connection id), its last messages, recent client ids."""

    conns: tuple[tuple[str, str], ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    last_seq: int = 0
    recent: tuple[tuple[str, int], ...] = ()  # ("<user> <client id>", seq), oldest first

    def members(self) -> tuple[str, ...]:
        """The users with at least one connection, sorted."""
        return tuple(sorted({user for user, _ in self.conns}))

    def seq_of(self, user: str, client_id: str) -> int | None:
        """The sequence number of ``user``'s post with ``client_id``, if it is remembered."""
        key = f"{user} {client_id}"
        for known, seq in self.recent:
            if known == key:
                return seq
        return None


# -- commands to a room ----------------------------------------------------------------------


@message
@attrs.frozen(kw_only=True)
class Join:
    """Put ``user`` in the room through connection ``conn``; answered by :class:`RoomView`."""

    user: str
    conn: str


@message
@attrs.frozen(kw_only=True)
class Leave:
    """Take connection ``conn`` of ``user`` out of the room; answered by the members."""

    user: str
    conn: str


@message
@attrs.frozen(kw_only=True)
class Post:
    """Append a message; answered by :class:`Posted`. ``client_id`` makes a retry idempotent."""

    user: str
    text: str
    client_id: str


@message
@attrs.frozen(kw_only=True)
class History:
    """Ask for the members and last messages; answered by :class:`RoomView`."""


@message
@attrs.frozen(kw_only=True)
class ConnectionsGone:
    """From a gateway: these connections no longer exist; the room forgets them."""

    conns: tuple[str, ...]


@message
@attrs.frozen(kw_only=True)
class RoomView:
    """The members and the last messages of a room."""

    members: tuple[str, ...]
    messages: tuple[ChatMessage, ...]


@message
@attrs.frozen(kw_only=True)
class Posted:
    """A post is stored (``duplicate``: it had been already, under the same client id)."""

    seq: int
    duplicate: bool


# -- to a node's gateway ---------------------------------------------------------------------


@message
@attrs.frozen(kw_only=True)
class Deliver:
    """To the gateway of the node holding ``conns``: pass this on to those connections.

    ``message`` is a new message (None for a change of members only); ``members`` the room's
    members after it.
    """

    room: str
    conns: tuple[str, ...]
    message: ChatMessage | None
    members: tuple[str, ...]
