"""Node addresses.

An :class:`Address` is where a node can be reached (its canonical, advertised address, which may
differ from the one it binds to). A :class:`UniqueAddress` adds the node name from its certificate
and a random ``uid`` drawn at every process start, so a node restarted on the same host and port is
a different incarnation: Akka's ``UniqueAddress``. Both order by host, port (and uid), which later
gives the membership leader rule "first reachable member by address" a total order.
"""

from __future__ import annotations

import re

import attrs

from ._errors import ConfigurationError
from ._wire import message

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
"""Cluster and node names: they go into certificate URIs, file names and log lines."""

MAX_UID = (1 << 63) - 1
"""Incarnation uids are 1..2**63-1; 0 on the wire means "whichever incarnation"."""


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid cluster or node name, else raise ConfigurationError."""
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise ConfigurationError(
            f"{kind} {value!r} is invalid: use 1 to 63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def _check_port(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
        raise ConfigurationError(f"port {value!r} is invalid: must be an integer from 0 to 65535")


def _check_host(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ConfigurationError(f"host {value!r} is invalid: must be a non-empty name or IP")


@message(name="p2pshard.Address")
@attrs.frozen(order=True, cache_hash=True)
class Address:
    """Where a node can be reached: ``host:port``.

    Example:
        >>> Address.parse("127.0.0.1:25520")
        Address(host='127.0.0.1', port=25520)
    """

    host: str = attrs.field(validator=_check_host)
    port: int = attrs.field(validator=_check_port)

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``"host:port"`` (IPv6 hosts in brackets: ``"[::1]:25520"``)."""
        if not isinstance(text, str):
            raise ConfigurationError(f"address {text!r} is invalid: expected 'host:port'")
        host, sep, port = text.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not (port.isascii() and port.isdigit()):
            raise ConfigurationError(f"address {text!r} is invalid: expected 'host:port'")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _check_uid(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_UID:
        raise ConfigurationError(f"uid {value!r} is invalid: must be an integer in 1..2**63-1")


@message(name="p2pshard.UniqueAddress")
@attrs.frozen(order=True, cache_hash=True)
class UniqueAddress:
    """One incarnation of a node: its address, its name and a uid drawn at process start."""

    address: Address
    name: str = attrs.field(order=False)
    uid: int = attrs.field(validator=_check_uid)

    def __attrs_post_init__(self) -> None:
        check_name("node name", self.name)

    def __str__(self) -> str:
        return f"{self.name}@{self.address}#{self.uid:x}"


def node_order(node: UniqueAddress) -> tuple[str, int, int]:
    """Sort key with the same order as comparing :class:`UniqueAddress` values.

    Much cheaper: the attrs-generated comparison builds tuples on every call, and gossip sorts
    often.
    """
    return (node.address.host, node.address.port, node.uid)
