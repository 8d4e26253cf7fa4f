"""What proxies and managers of a singleton send each other.

The hand-over messages between managers are in ``_core``.
"""

from __future__ import annotations

import attrs

from ..transport._wire import message


@message(name="p2pshard.singleton.Envelope")
@attrs.frozen(kw_only=True)
class SingletonEnvelope:
    """A message for the singleton ``name``; ``request_id`` 0 means no answer is wanted."""

    name: str
    payload: object
    request_id: int = 0


@message(name="p2pshard.singleton.Reply")
@attrs.frozen(kw_only=True)
class SingletonReply:
    """The answer to an ask."""

    request_id: int
    payload: object = None
    error: str | None = None


@message(name="p2pshard.singleton.NotHere")
@attrs.frozen(kw_only=True)
class SingletonNotHere:
    """The singleton does not run here: the message comes back to be sent again."""

    name: str
    payload: object
    request_id: int = 0
