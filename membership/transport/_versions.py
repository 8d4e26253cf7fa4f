"""Which versions of the wire protocol a node speaks, and the one two nodes agree on. Sans-IO.

A node speaks a range of protocol versions, from the oldest it still reads and writes to the
newest it knows. Two nodes agree, in the link handshake, on the newest version both speak; a peer
whose range does not meet ours is refused, each side naming both ranges. What a version adds
(a message type, a frame kind, a field) is sent to a peer only once the link agreed on that
version or a later one: see :meth:`TcpTransport.peer_protocol`.

Versions so far:

* 1: the first with the negotiation: every message and frame kind of p2pshard 0.2.0, the first
  release that speaks it (0.1.0 nodes cannot link to it: see CHANGELOG.md).
"""

from __future__ import annotations

from typing import Final

import attrs

from ._errors import ConfigurationError, HandshakeError


def _check_range(instance: ProtocolRange, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or not 1 <= value <= 255:
        raise ConfigurationError(
            f"ProtocolRange.{attribute.name} = {value!r} is invalid: must be an int from 1 to 255"
        )


@attrs.frozen
class ProtocolRange:
    """The protocol versions a node speaks, ``low`` to ``high`` (both included).

    Example:
        >>> ProtocolRange(1, 3).agree(ProtocolRange(2, 5))
        3
    """

    low: int = attrs.field(validator=_check_range)
    high: int = attrs.field(validator=_check_range)

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise ConfigurationError(
                f"ProtocolRange({self.low}, {self.high}) is invalid: low must not be above high"
            )

    def agree(self, peer: ProtocolRange) -> int:
        """The newest version both speak.

        Raises:
            HandshakeError: the ranges do not meet; the message names both.
        """
        version = min(self.high, peer.high)
        if version < max(self.low, peer.low):
            raise HandshakeError(
                f"no wire protocol version in common: the peer speaks {peer}, this node {self}; "
                "upgrade the older node, or roll back the newer one, to a release whose range "
                "meets the other's"
            )
        return version

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self.low <= version <= self.high

    def __str__(self) -> str:
        if self.low == self.high:
            return f"version {self.low}"
        return f"versions {self.low}-{self.high}"


CURRENT_PROTOCOL: Final = ProtocolRange(1, 1)
"""The protocol versions this release speaks."""
