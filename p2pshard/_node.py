"""The node facade: :func:`open_node` starts everything a node runs and owns its lifetime.

Theory of operation: a node is one incarnation of a cluster member. ``open_node`` opens its
transport (TCP with mutual TLS from the configuration, or one handed in, such as a simulated
network's), starts the node's background tasks in a nursery it owns, yields a :class:`Node`,
and on leaving the block stops them and closes the transport gracefully (queued frames are
flushed, bounded by ``transport.shutdown_flush_timeout``).

Today the node keeps links to its seed nodes and to every peer that contacts it, and logs the set
of peers it is linked to whenever that set changes. Gossip membership replaces the contact loop
with the join protocol and heartbeats; the node facade keeps the same shape.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from membership import (
    Address,
    SendQueueFull,
    Transport,
    TransportStatistics,
    UniqueAddress,
    message,
)
from membership._tcp import open_tcp_transport
from membership._tls import TlsIdentity
from membership._trioutil import single_error

from ._config import NodeConfig

logger = logging.getLogger("p2pshard.node")

CONTACT_INTERVAL = 1.0
"""Seconds between contact messages to seed nodes and known peers."""


@message(name="p2pshard.node.Contact")
@attrs.frozen
class Contact:
    """Sent to seed nodes and known peers to open and keep the links to them."""


@attrs.define(eq=False)
class Node:
    """A running node. Get one from :func:`open_node`.

    Example:
        >>> async def main(config: NodeConfig) -> None:
        ...     async with open_node(config) as node:
        ...         print(node.address, node.linked_peers())
    """

    _config: NodeConfig
    _transport: Transport
    _known: dict[Address, None] = attrs.field(factory=dict)

    @property
    def config(self) -> NodeConfig:
        """The configuration this node runs with."""
        return self._config

    @property
    def address(self) -> UniqueAddress:
        """This incarnation: canonical address, node name and uid."""
        return self._transport.local_address

    @property
    def transport(self) -> Transport:
        """The node's transport (for diagnostics and the layers built on it)."""
        return self._transport

    def linked_peers(self) -> list[UniqueAddress]:
        """Peers this node has an established outbound link to, ordered by address."""
        return self._transport.connected_peers()

    def statistics(self) -> TransportStatistics:
        """The transport's counters: links, frames, refused handshakes, dropped messages."""
        return self._transport.statistics()

    def _contact_targets(self) -> list[Address]:
        own = self.address.address
        targets = dict.fromkeys(self._config.seed_nodes)
        targets.update(self._known)
        return [a for a in targets if a != own]

    async def _keep_contact(self) -> None:
        reported: list[UniqueAddress] | None = None
        while True:
            for target in self._contact_targets():
                # Unreachable for a while: its queue holds what it can; try again next round.
                with contextlib.suppress(SendQueueFull):
                    self._transport.send_nowait(target, Contact())
            peers = self.linked_peers()
            if peers != reported:
                names = ", ".join(f"{p.name} ({p.address})" for p in peers) or "none"
                logger.info("%s: linked to %d peer(s): %s", self.address.name, len(peers), names)
                reported = peers
            await trio.sleep(CONTACT_INTERVAL)

    async def _dispatch(self) -> None:
        async for envelope in self._transport:
            self._known.setdefault(envelope.sender.address)
            if not isinstance(envelope.message, Contact):
                logger.debug(
                    "%s: no service handles %s from %s",
                    self.address.name,
                    type(envelope.message).__name__,
                    envelope.sender,
                )


def _tls_identity(config: NodeConfig) -> TlsIdentity:
    return TlsIdentity(
        config.cluster_name, config.tls.ca_file, config.tls.cert_file, config.tls.key_file
    )


@asynccontextmanager
async def open_node(
    config: NodeConfig, *, transport: Transport | None = None
) -> AsyncIterator[Node]:
    """Start a node; leaving the block stops it gracefully.

    Args:
        config: the node's configuration.
        transport: a transport to use instead of opening TCP from ``config`` (the simulated
            network's, in tests). The caller keeps ownership of it.

    Example:
        >>> async def main() -> None:
        ...     async with open_node(NodeConfig.load("node.toml")) as node:
        ...         await trio.sleep_forever()

    Raises:
        ConfigurationError: unreadable certificate files.
        OSError: the bind address is not available.
    """
    if transport is not None:
        async with _run(config, transport) as node:
            yield node
        return
    async with (
        open_tcp_transport(
            _tls_identity(config),
            config.node_name,
            config.bind_address,
            canonical=config.canonical_address,
            settings=config.transport,
        ) as tcp,
        _run(config, tcp) as node,
    ):
        yield node


@asynccontextmanager
async def _run(config: NodeConfig, transport: Transport) -> AsyncIterator[Node]:
    node = Node(config, transport)
    with single_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node._dispatch)
            nursery.start_soon(node._keep_contact)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
    logger.info("%s: stopped", node.address.name)
