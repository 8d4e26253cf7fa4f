"""The node facade: :func:`open_node` starts everything a node runs and owns its lifetime.

Theory of operation: a node is one incarnation of a cluster member. ``open_node`` opens its
transport (TCP with mutual TLS from the configuration, or one handed in, such as a simulated
network's), starts the node's services in a nursery it owns, and yields a :class:`Node`. The
transport hands each received message straight to the service it belongs to; today
that is membership (``node.cluster``: gossip, heartbeats, split brain resolver) and cluster
singletons (``node.singletons``). With ``[management]`` enabled the nursery also serves the HTTP
management endpoint (``p2pshard._management``) at ``node.management_address``.

Leaving the block leaves the cluster gracefully, as Akka's coordinated shutdown does: the node
asks to leave, waits (up to ``shutdown_timeout``) until it has gone through Leaving and Exiting
and was removed, then stops its services and closes the transport, which flushes what is queued.
A node that is downed, or removed without having asked, stops its services at once:
``node.terminated`` is set and ``node.cluster.termination_reason`` says why.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import random
import time
import types
import warnings
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import attrs
import trio
from cryptography import x509

from crdt import Replicator, ReplicatorSettings, open_replicator
from membership import (
    Address,
    Cluster,
    ConfigurationError,
    DowningLease,
    Envelope,
    LeaderChanged,
    MemberEvent,
    ReachableMember,
    Singletons,
    Transport,
    TransportStatistics,
    UniqueAddress,
    UnreachableMember,
)
from membership.internal import (
    TlsIdentity,
    member_traffic_refusal,
    node_uri,
    open_tcp_transport,
    single_error,
)

from ._config import NodeConfig
from ._dashboard import metric_families
from ._discovery import bootstrap
from ._management import ManagementApp, serve_management
from ._metrics import metrics_text
from ._status import MemberCommandService, StatusService
from .leases._lease import TRIO_CLOCK, LeaseBackend, LeaseClock, LeaseSettings
from .leases._leases import Leases
from .leases._sqlite import SqliteLeaseBackend
from .persistence._journal import Journal, JournalSettings
from .persistence._open import open_journal
from .sharding._sharding import Sharding

logger = logging.getLogger("p2pshard.node")


@attrs.define(eq=False)
class Node:
    """A running node. Get one from :func:`open_node`.

    Example:
        >>> async def main(config: NodeConfig) -> None:
        ...     async with open_node(config) as node:
        ...         await node.cluster.wait_up()
        ...         print([m.node.name for m in node.cluster.members])
    """

    _config: NodeConfig
    _transport: Transport
    _cluster: Cluster
    _singletons: Singletons | None = None
    _replicator: Replicator | None = None
    _replicators: dict[str, Replicator] = attrs.Factory(dict)
    _sharding: Sharding | None = None
    _status: StatusService | None = None
    _member_commands: MemberCommandService | None = None
    _leases: Leases | None = None
    _journal: Journal | None = None
    _management_address: Address | None = None
    _nursery: trio.Nursery | None = None
    _rng: random.Random = attrs.Factory(random.Random)
    _trusted: object = None
    """The sender of the last message admitted as a member's (the very object its link
    hands in), so that a stream from one member costs one identity check; forgotten whenever
    the members change."""

    @property
    def config(self) -> NodeConfig:
        """The configuration this node runs with."""
        return self._config

    @property
    def address(self) -> UniqueAddress:
        """This incarnation: canonical address, node name and uid."""
        return self._transport.local_address

    @property
    def management_address(self) -> Address | None:
        """Where the HTTP management endpoint listens (None: ``[management]`` is not enabled).

        With ``port = 0`` in ``[management]`` this is the port it was given.

        Example:
            >>> async def ready(node: Node) -> bool:
            ...     async with httpx.AsyncClient() as http:
            ...         answer = await http.get(f"http://{node.management_address}/ready")
            ...     return answer.status_code == 200
        """
        return self._management_address

    @property
    def cluster(self) -> Cluster:
        """Membership: members, leader, oldest, events, leave and down."""
        return self._cluster

    @property
    def singletons(self) -> Singletons:
        """Cluster singletons: run one instance on the oldest member; proxies to reach it."""
        assert self._singletons is not None
        return self._singletons

    @property
    def replicator(self) -> Replicator:
        """Replicated keys holding pycrdt documents, with majority reads and writes."""
        assert self._replicator is not None
        return self._replicator

    @property
    def replicators(self) -> Mapping[str, Replicator]:
        """Every replicator running on this node, by name (a read-only view that follows them).

        The default one (:attr:`replicator`) and those started with :meth:`start_replicator`.
        """
        return types.MappingProxyType(self._replicators)

    @property
    def leases(self) -> Leases:
        """This node's leases, from the ``[lease]`` backend of its configuration.

        Raises:
            ConfigurationError: the node has no lease backend.
        """
        if self._leases is None:
            raise ConfigurationError(
                "this node has no lease backend: set [lease] backend (and path or endpoints) in "
                "its config, or pass lease_backend= to open_node"
            )
        return self._leases

    @property
    def journal(self) -> Journal:
        """The journal of this node's event-sourced entities, from its ``[journal]`` table.

        Example:
            >>> async def start_rooms(node: Node) -> ShardRegion:
            ...     return await node.sharding.start(
            ...         "Room", lambda ctx: Room(ctx, node.journal), extractor=HashExtractor(100)
            ...     )

        Raises:
            ConfigurationError: the node has no journal.
        """
        if self._journal is None:
            raise ConfigurationError(
                'this node has no journal: set [journal] backend = "sqlite" (and path) or '
                '"postgresql" (and dsn) in its config, or pass journal= to open_node'
            )
        return self._journal

    @property
    def sharding(self) -> Sharding:
        """Cluster sharding: start entity types, send to entities, inspect and shut down."""
        assert self._sharding is not None
        return self._sharding

    async def start_replicator(self, settings: ReplicatorSettings) -> Replicator:
        """Start another replicator on this node (for a role, say), running until the node stops.

        Each replicator keeps its own keys; replicators with the same ``name`` on different nodes
        are replicas of each other. Start it on every node that should hold its keys.

        Example:
            >>> async def backend_state(node: Node) -> Replicator:
            ...     return await node.start_replicator(
            ...         ReplicatorSettings(name="backend", role="backend")
            ...     )

        Raises:
            ConfigurationError: the name is taken on this node, or this node lacks the role.
        """
        if settings.name in self._replicators:
            raise ConfigurationError(
                f"a replicator named {settings.name!r} already runs on this node; give "
                "ReplicatorSettings.name another value"
            )
        _check_role(self._cluster, settings)
        assert self._nursery is not None, "the node is not running"
        replicator: Replicator = await self._nursery.start(self._run_replicator, settings)
        return replicator

    async def _run_replicator(
        self, settings: ReplicatorSettings, *, task_status: trio.TaskStatus[Replicator]
    ) -> None:
        async with open_replicator(
            self._transport, self._cluster, settings, rng=self._rng
        ) as replicator:
            self._replicators[settings.name] = replicator
            try:
                task_status.started(replicator)
                await trio.sleep_forever()
            finally:
                del self._replicators[settings.name]

    @property
    def transport(self) -> Transport:
        """The node's transport (for diagnostics and the layers built on it)."""
        return self._transport

    @property
    def terminated(self) -> trio.Event:
        """Set once this node is out of the cluster (left, downed or removed)."""
        return self._cluster.terminated

    def linked_peers(self) -> list[UniqueAddress]:
        """Peers this node has an established outbound link to, ordered by address."""
        return self._transport.connected_peers()

    def transport_statistics(self) -> TransportStatistics:
        """The transport's counters: links, frames, refused handshakes, dropped messages."""
        return self._transport.statistics()

    def statistics(self) -> TransportStatistics:
        """Deprecated alias of :meth:`transport_statistics` (the name said less than it gave).

        Warns with ``DeprecationWarning``; removed in 0.3.
        """
        warnings.warn(
            "Node.statistics() is deprecated: use Node.transport_statistics()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.transport_statistics()

    def _dispatch(self, envelope: Envelope) -> bool | None:
        """Hand one received message to the service it belongs to (runs in the link task).

        Returns False when the message was refused for who sent it (the transport closes a
        link that sends too many of those).
        """
        if envelope.sender is not self._trusted:
            return self._dispatch_untrusted(envelope)
        # Sharding first: entity messages are nearly all the traffic, and no two services take
        # the same message type, so the order decides only how many are asked.
        if not (
            (self._sharding is not None and self._sharding.handle(envelope))
            or self._cluster.handle(envelope)
            or self.singletons.handle(envelope)
            or self._to_replicator(envelope)
            or (self._status is not None and self._status.handle(envelope))
            or (self._member_commands is not None and self._member_commands.handle(envelope))
        ):
            logger.debug(
                "%s: no service handles %s from %s",
                self.address.name,
                type(envelope.message).__name__,
                envelope.sender,
            )
        return None

    def _dispatch_untrusted(self, envelope: Envelope) -> bool | None:
        """A message from a sender not (yet) known to be a member over its own link.

        A member's is dispatched as any, and its sender remembered. Anybody else with a
        certificate of the cluster may only ask to join (membership checks that a node speaks
        only for itself), read status, or, with an admin certificate, make a member leave or go
        down (``MemberCommand``); what else it sends is refused, counted and logged.
        """
        sender = envelope.sender
        if sender is self._transport.local_address or self._cluster.is_member_link(envelope):
            self._trusted = sender
            return self._dispatch(envelope)
        refused_before = self._cluster.refusals.total()
        if not (
            self._cluster.handle(envelope)
            or (self._status is not None and self._status.handle(envelope))
            or (self._member_commands is not None and self._member_commands.handle(envelope))
        ):
            self._cluster.refuse(
                member_traffic_refusal(envelope.message, sender, envelope.identity)
            )
        return self._cluster.refusals.total() == refused_before

    def _forget_trusted(self) -> None:
        self._trusted = None

    def _to_replicator(self, envelope: Envelope) -> bool:
        name = getattr(envelope.message, "replicator", None)
        replicator = self._replicators.get(name) if isinstance(name, str) else None
        return replicator is not None and replicator.handle(envelope)

    async def _log_membership(self) -> None:
        """Log member changes as one line of the whole membership, and reachability changes."""
        name = self.address.name
        logged = ""
        async with self._cluster.subscribe() as events:
            async for event in events:
                if isinstance(event, MemberEvent):
                    members = ", ".join(
                        f"{m.node.name} {m.status.name}" for m in self._cluster.members
                    )
                    if members != logged:  # one gossip change often brings several events
                        logger.info("%s: members: %s", name, members or "none")
                        logged = members
                elif isinstance(event, UnreachableMember):
                    logger.warning("%s: %s is unreachable", name, event.member.node)
                elif isinstance(event, ReachableMember):
                    logger.info("%s: %s is reachable again", name, event.member.node)
                elif isinstance(event, LeaderChanged):
                    logger.info("%s: leader is %s", name, event.leader or "nobody")


def _check_role(cluster: Cluster, settings: ReplicatorSettings) -> None:
    role = settings.role
    if role is not None and role not in cluster.self_member.roles:
        raise ConfigurationError(
            f"the replicator {settings.name!r} is for role {role!r}, which this node does not "
            f"have (its roles: {sorted(cluster.self_member.roles) or 'none'}); start it only on "
            "members with that role"
        )


def _tls_identity(config: NodeConfig) -> TlsIdentity:
    return config.tls.identity(config.cluster_name)


@asynccontextmanager
async def open_node(
    config: NodeConfig,
    *,
    transport: Transport | None = None,
    rng: random.Random | None = None,
    downing_lease: DowningLease | None = None,
    lease_backend: LeaseBackend | None = None,
    journal: Journal | None = None,
    lease_clock: LeaseClock = TRIO_CLOCK,
    tracer_provider: object | None = None,
) -> AsyncIterator[Node]:
    """Start a node and join the cluster (seed nodes, self_join, or DNS); leaving the block leaves.

    Args:
        config: the node's configuration.
        transport: a transport to use instead of opening TCP from ``config`` (the simulated
            network's, in tests). The caller keeps ownership of it.
        rng: the source of the node's random choices (gossip targets); a seeded one makes a
            simulated run replayable.
        downing_lease: the lease the ``lease-majority`` split brain strategy competes for
            (default: ``<cluster>-p2pshard-sbr`` in the node's lease backend).
        lease_backend: a lease backend to use instead of the one ``config.lease`` names (a
            simulated cluster's shared one, in tests). The caller keeps ownership of it.
        journal: a journal to use instead of the one ``config.journal`` names (a
            :class:`MemoryJournal` shared by a simulated cluster, say). The caller keeps
            ownership of it; one the configuration names is closed when the node stops.
        lease_clock: the clock the node's leases measure their deadlines on (trio's by
            default; the simulated cluster's clock-skew fault gives a node a slower or faster
            one).
        tracer_provider: the OpenTelemetry tracer provider that traces entity messages (see
            "Tracing" in docs/operations.md); None: the one set with OpenTelemetry's
            ``trace.set_tracer_provider`` when an entity type starts, if any.

    Example:
        >>> async def main() -> None:
        ...     async with open_node(NodeConfig.load("node.toml")) as node:
        ...         await node.cluster.wait_up()
        ...         await node.terminated.wait()

    Raises:
        ConfigurationError: unreadable certificate files, or a certificate that names another
            node or cluster than ``config``; the bind address is taken or cannot be listened on
            (the message names it); the lease-majority strategy without a lease.
    """
    sbr = config.split_brain_resolver
    if (
        sbr.active_strategy == "lease-majority"
        and downing_lease is None
        and lease_backend is None
        and config.lease.backend is None
    ):
        raise ConfigurationError(
            "split_brain_resolver.active_strategy = 'lease-majority' needs a lease: set [lease] "
            "backend (and path or endpoints) in the config"
        )
    async with (
        _lease_backend(config.lease, lease_backend) as backend,
        _journal(config.journal, journal) as node_journal,
    ):
        if transport is not None:
            async with _run(
                config,
                transport,
                rng,
                downing_lease,
                backend,
                node_journal,
                wall_offset=0.0,
                lease_clock=lease_clock,
                tracer_provider=tracer_provider,
            ) as node:
                yield node
            return
        _check_own_certificate(config)
        async with contextlib.AsyncExitStack() as stack:
            try:
                tcp = await stack.enter_async_context(
                    open_tcp_transport(
                        _tls_identity(config),
                        config.node_name,
                        config.bind_address,
                        canonical=config.canonical_address,
                        settings=config.transport,
                        app_version=config.app_version,
                    )
                )
            except OSError as exc:  # only listening can fail so: the files raised already
                raise _cannot_listen(config, exc) from None
            async with _run(
                config,
                tcp,
                rng,
                downing_lease,
                backend,
                node_journal,
                wall_offset=time.time() - trio.current_time(),
                lease_clock=lease_clock,
                tracer_provider=tracer_provider,
            ) as node:
                yield node


def _check_own_certificate(config: NodeConfig) -> None:
    """Refuse to start with a certificate made for another node or cluster.

    Peers check the certificate's SAN URI against their cluster name and the name the node
    announces, and refuse the link: without this check such a node would run alone for ever,
    and only the peers' logs would say why. A file that is missing or not a certificate is left
    to the transport, which names it.
    """
    path = config.tls.cert_file
    try:
        certificate = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return
    wanted = node_uri(config.cluster_name, config.node_name)
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        uris = [str(u) for u in san.value.get_values_for_type(x509.UniformResourceIdentifier)]
    except x509.ExtensionNotFound:
        uris = []
    if wanted in uris:
        return
    scheme = wanted.partition("://")[0] + "://"
    named = [_describe_uri(u, scheme) for u in uris if u.startswith(scheme)]
    raise ConfigurationError(
        f"the certificate {str(path)!r} is for {' and '.join(named) or 'no p2pshard identity'}, "
        f"but this node's configuration says cluster_name = {config.cluster_name!r} and "
        f"node_name = {config.node_name!r}, which needs a certificate for {wanted}: peers "
        "would refuse every link. Point [tls] at that node's files, or make them with "
        f"`p2pshard certs node {config.node_name} --ca CA_DIR --out DIR`"
    )


def _describe_uri(uri: str, scheme: str) -> str:
    parts = uri.removeprefix(scheme).split("/")
    if len(parts) == 2:
        return f"node {parts[1]!r} of cluster {parts[0]!r} ({uri})"
    if len(parts) == 3:
        return f"the {parts[1]} {parts[2]!r} of cluster {parts[0]!r} ({uri})"
    return uri


def _cannot_listen(config: NodeConfig, exc: OSError) -> ConfigurationError:
    """The error for a bind address this node cannot listen on, naming it."""
    address = config.bind_address
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        hint = (
            "another process listens there (another node, or this one still running?): stop it, "
            "or give this node another bind_port"
        )
    else:
        hint = "check bind_host and bind_port: the host must be an address of this machine"
    return ConfigurationError(f"cannot listen on {address}: {reason}; {hint}")


@asynccontextmanager
async def _lease_backend(
    settings: LeaseSettings, given: LeaseBackend | None
) -> AsyncIterator[LeaseBackend | None]:
    """The given backend, or the one ``settings`` names (closed at the end), or None."""
    if given is not None or settings.backend is None:
        yield given
        return
    backend: LeaseBackend
    if settings.backend == "sqlite":
        assert settings.path is not None
        backend = SqliteLeaseBackend(settings.path, busy_timeout=settings.operation_timeout)
    else:
        from .leases._etcd import EtcdLeaseBackend

        backend = EtcdLeaseBackend(settings.endpoints, request_timeout=settings.operation_timeout)
    try:
        yield backend
    finally:
        with trio.CancelScope(shield=True):
            await backend.aclose()


@asynccontextmanager
async def _journal(
    settings: JournalSettings, given: Journal | None
) -> AsyncIterator[Journal | None]:
    """The given journal, or the one ``settings`` names (closed at the end), or None."""
    if given is not None or settings.backend is None:
        yield given
        return
    journal = open_journal(settings)
    try:
        yield journal
    finally:
        with trio.CancelScope(shield=True):
            await journal.aclose()


@asynccontextmanager
async def _run(
    config: NodeConfig,
    transport: Transport,
    rng: random.Random | None,
    downing_lease: DowningLease | None,
    lease_backend: LeaseBackend | None,
    journal: Journal | None,
    *,
    wall_offset: float,
    lease_clock: LeaseClock,
    tracer_provider: object | None = None,
) -> AsyncIterator[Node]:
    leases: Leases | None = None
    node: Node | None = None
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                if lease_backend is not None:
                    leases = Leases(
                        lease_backend,
                        str(transport.local_address),
                        config.lease,
                        config.cluster_name,
                        nursery,
                        clock=lease_clock,
                    )
                sbr = config.split_brain_resolver
                if (
                    downing_lease is None
                    and leases is not None
                    and sbr.active_strategy == "lease-majority"
                ):
                    downing_lease = leases.lease(sbr.lease_name_for(config.cluster_name))
                cluster = Cluster(
                    transport,
                    settings=config.cluster,
                    failure_detector=config.failure_detector,
                    split_brain_resolver=sbr,
                    seed_nodes=config.seed_nodes,
                    roles=config.roles,
                    app_version=config.app_version,
                    rng=rng,
                    downing_lease=downing_lease,
                    wall_offset=wall_offset,
                )
                node = Node(config, transport, cluster, rng=rng or random.Random())
                node._leases = leases
                node._journal = journal
                node._singletons = Singletons(transport, cluster, nursery)
                cluster.on_members_changed(node._forget_trusted)
                transport.set_handler(node._dispatch)
                nursery.start_soon(node._log_membership)
                await nursery.start(cluster.run)
                if config.self_join:
                    logger.info("%s: self_join: forming a new cluster", transport.local_address)
                    cluster.join(transport.local_address.address)
                elif config.discovery.method == "dns":
                    nursery.start_soon(bootstrap, config.discovery, cluster)
                try:
                    node._nursery = nursery
                    _check_role(cluster, config.replicator)
                    async with open_replicator(
                        transport, cluster, config.replicator, rng=node._rng
                    ) as node._replicator:
                        node._replicators[config.replicator.name] = node._replicator
                        node._sharding = Sharding(
                            transport,
                            cluster,
                            node._singletons,
                            node._replicator,
                            nursery,
                            node._rng,
                            leases,
                            removal_margin=config.split_brain_resolver.stable_after,
                            tracer_provider=tracer_provider,
                        )
                        node._status = StatusService(transport, cluster, node._sharding, nursery)
                        node._member_commands = MemberCommandService(transport, cluster, nursery)
                        if config.management.enabled:
                            # Served until the nursery is cancelled, so /ready says 503 while
                            # the node leaves.
                            app = ManagementApp(
                                config.management,
                                cluster,
                                node._sharding,
                                node._status,
                                functools.partial(metrics_text, node),
                                functools.partial(metric_families, node),
                                tls=config.tls.identity(config.cluster_name),
                            )
                            node._management_address = await nursery.start(
                                serve_management, app, config.management
                            )
                        try:
                            yield node
                        except Exception:
                            await _leave(node)  # an error in the block: still hand over, re-raise
                            raise
                        else:
                            await _leave(node)
                finally:
                    # Cancellation skips the leave on purpose: it means "stop now", like a crash;
                    # the others will find this node unreachable and down it.
                    if node._sharding is not None:
                        node._sharding.close()
                    transport.set_handler(None)
                    nursery.cancel_scope.cancel()
    finally:
        # After every task of the node ended: its entities and singletons are stopped, so
        # what they held may go to another node at once rather than when it expires.
        if node is not None and node._sharding is not None:
            node._sharding.end_incarnations()
        if leases is not None:
            with trio.CancelScope(shield=True):
                await leases.release_all()
    logger.info("%s: stopped (%s)", node.address.name, cluster.termination_reason or "left")


async def _leave(node: Node) -> None:
    """Hand off shards, then leave the cluster, all within ``shutdown_timeout``."""
    cluster = node.cluster
    if cluster.terminated.is_set() or not cluster.gossip.has_member(cluster.self_address):
        return  # out already, or never got in: nothing to hand over
    deadline = trio.current_time() + node.config.shutdown_timeout
    if node._sharding is not None and node._sharding.type_names:
        logger.info("%s: handing off shards", node.address.name)
        # Most of the time is for the hand-off; a leave needs a few gossip rounds.
        with trio.move_on_at(deadline - node.config.shutdown_timeout / 4) as handoff:
            await node._sharding.shutdown()
        if handoff.cancelled_caught:
            logger.warning("%s: shards not all handed off in time; leaving", node.address.name)
    logger.info("%s: leaving the cluster", node.address.name)
    cluster.leave()
    with trio.move_on_at(deadline) as scope:
        await cluster.terminated.wait()
    if scope.cancelled_caught:
        logger.warning(
            "%s: not removed within shutdown_timeout (%g s); stopping anyway",
            node.address.name,
            node.config.shutdown_timeout,
        )
