"""Whether a message can travel: checked at every send, local ones too.

A message that works while its entity is on this node must not fail once the shard moves, so a
local send is checked as strictly as a remote one. Encoding every message would cost more than a
local delivery; a registered attrs class whose field values are all plain scalars this time is
checked by looking at them, and anything else is encoded.
"""

from __future__ import annotations

import attrs

from membership import Transport
from membership.internal import wire

_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})
_INT_MIN, _INT_LIMIT = -(1 << 63), 1 << 64  # what msgpack encodes
_MAX_CHECKED_BYTES = 4096


def _small_scalar(value: object) -> bool:
    """A value msgpack surely encodes in a small frame: a number, a short string, None."""
    if type(value) is int:
        return _INT_MIN <= value < _INT_LIMIT
    if type(value) is str or type(value) is bytes:
        return len(value) <= _MAX_CHECKED_BYTES
    return type(value) in _PLAIN


class MessageCheck:
    """Checks messages against the transport's frame limit.

    It remembers which registered classes held only scalars, to look at their fields next time.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._scalar_fields: dict[type, tuple[str, ...]] = {}

    def check(self, message: object) -> int:
        """Raise ``SerializationError`` (naming the type) if ``message`` cannot travel.

        Returns:
            The encoded size in bytes, or 0 when the message was only looked at (it is small).
        """
        kind = type(message)
        if kind in _PLAIN:
            if _small_scalar(message):
                return 0
        else:
            fields = self._scalar_fields.get(kind)
            if fields is not None and all(_small_scalar(getattr(message, f)) for f in fields):
                return 0
        payload = wire.encode(message, max_size=self._transport.settings.max_frame_size - 256)
        if kind not in _PLAIN and wire.wire_name(kind) is not None and attrs.has(kind):
            self._scalar_fields[kind] = tuple(f.name for f in attrs.fields(kind))
        return len(payload)
