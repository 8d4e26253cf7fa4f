"""Defaults of the membership package: the role of Akka's ``reference.conf``.

Every field says its default and meaning. Values are checked when the object is built, so an
invalid configuration fails at load with the field, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ._address import Address
from ._errors import ConfigurationError


def in_range(
    low: float, high: float, *, integer: bool = False
) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator: a number within ``[low, high]`` (an integer if ``integer``)."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        kinds: tuple[type, ...] = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:  # type: ignore[operator]
            what = "an integer" if integer else "a number"
            bounds = f"{int(low)} to {int(high)}" if integer else f"{low:g} to {high:g}"
            raise ConfigurationError(
                f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be "
                f"{what} from {bounds}"
            )

    return check


def _check_dial_via(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    def valid(entry: Any) -> bool:
        try:
            peer, target = entry
            return isinstance(target, Address) and bool(Address.parse(peer))
        except (ConfigurationError, TypeError, ValueError):
            return False

    if not isinstance(value, tuple) or not all(valid(entry) for entry in value):
        raise ConfigurationError(
            f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be a tuple "
            "of (peer address 'host:port', Address to connect to instead) pairs"
        )


@attrs.frozen(kw_only=True)
class TransportSettings:
    """How node-to-node links behave. Defaults suit a LAN or one host."""

    max_frame_size: int = attrs.field(
        default=1 << 20, validator=in_range(1024, 1 << 30, integer=True)
    )
    """Largest frame, header included, in bytes (default 1 MiB). A bigger message fails at the
    sending call with MessageTooLarge; a peer announcing a bigger frame has its link closed."""

    send_queue_capacity: int = attrs.field(
        default=4096, validator=in_range(1, 1 << 24, integer=True)
    )
    """Frames queued per peer before the link takes them (default 4096). When full,
    ``send_nowait`` raises SendQueueFull and ``send`` waits for room: never a silent drop."""

    inbox_capacity: int = attrs.field(default=4096, validator=in_range(1, 1 << 24, integer=True))
    """Received messages buffered for the application (default 4096). When full, links stop
    reading, which pushes back on the senders through TCP."""

    max_batch_bytes: int = attrs.field(
        default=64 << 10, validator=in_range(1, 1 << 30, integer=True)
    )
    """Write coalescing: queued frames are joined into one write of up to this many bytes
    (default 64 KiB, what a link reads at a time; a frame larger than this still goes out whole).
    Larger writes made streams of small messages slower: the sender ran ahead in bursts while
    the receiver caught up, and both sat idle more often."""

    connect_timeout: float = attrs.field(default=5.0, validator=in_range(0.001, 3600))
    """Seconds to open a TCP connection to a peer (default 5)."""

    handshake_timeout: float = attrs.field(default=5.0, validator=in_range(0.001, 3600))
    """Seconds for the TLS handshake plus the hello exchange, both directions (default 5)."""

    max_pending_handshakes: int = attrs.field(
        default=256, validator=in_range(1, 1 << 20, integer=True)
    )
    """Connections accepted but not yet through the handshake, from all peers together
    (default 256). One more is closed at once: idle or slow connections cannot take every file
    descriptor and the memory of a node, and each is dropped after ``handshake_timeout``."""

    max_pending_handshakes_per_host: int = attrs.field(
        default=16, validator=in_range(1, 1 << 20, integer=True)
    )
    """The same, per source address (default 16): one host cannot take the whole budget."""

    refused_messages_per_second: float = attrs.field(default=100.0, validator=in_range(0.01, 1e9))
    """A link whose messages the node refuses for who sent them (a non-member's member
    traffic, forged membership messages) faster than this on average, beyond
    ``refused_messages_burst``, is closed (default 100/s)."""

    refused_messages_burst: int = attrs.field(
        default=1000, validator=in_range(1, 1 << 30, integer=True)
    )
    """How many refused messages a link may send at once before that rate applies
    (default 1000)."""

    refused_bytes_per_second: int = attrs.field(
        default=1 << 20, validator=in_range(1, 1 << 40, integer=True)
    )
    """The same in bytes: a link whose refused messages come faster than this many bytes per
    second on average, beyond ``refused_bytes_burst``, is closed (default 1 MiB/s)."""

    refused_bytes_burst: int = attrs.field(
        default=16 << 20, validator=in_range(1, 1 << 40, integer=True)
    )
    """How many bytes of refused messages a link may send at once (default 16 MiB)."""

    reconnect_backoff_min: float = attrs.field(default=0.1, validator=in_range(0.0, 3600))
    """First wait before reconnecting a failed link, doubled after each failure (default 0.1 s)."""

    reconnect_backoff_max: float = attrs.field(default=5.0, validator=in_range(0.0, 3600))
    """Cap of the reconnect wait (default 5 s)."""

    shutdown_flush_timeout: float = attrs.field(default=1.0, validator=in_range(0.0, 3600))
    """On close, seconds to wait for queued frames to reach connected peers (default 1 s)."""

    dial_via: tuple[tuple[str, Address], ...] = attrs.field(default=(), validator=_check_dial_via)
    """A testing aid, TCP only: connect to a peer somewhere else than the address it advertises
    (default: nowhere else). Pairs of the peer's canonical address ``"host:port"`` and the
    address to connect to instead; in TOML a table ``[transport.dial_via]`` with entries
    ``"127.0.0.1:25521" = "127.0.0.1:40001"``. ``p2pshard chaos --real`` routes each node's links
    through a fault-injecting proxy this way, one per ordered pair of nodes, to cut links one
    way or both. The node reached is checked as on any link (certificate and hello) but not
    against the address: an entry must lead to the node that advertises it."""

    def __attrs_post_init__(self) -> None:
        if self.reconnect_backoff_max < self.reconnect_backoff_min:
            raise ConfigurationError(
                f"TransportSettings.reconnect_backoff_max = {self.reconnect_backoff_max!r} is "
                f"invalid: must be at least reconnect_backoff_min ({self.reconnect_backoff_min!r})"
            )
