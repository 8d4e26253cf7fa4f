"""``p2pshard status``, ``leave`` and ``down``: a running node's view, and admin commands.

Theory of operation. A :class:`StatusRequest` reaches a node like any other message; the node's
:class:`StatusService` (hooked into ``Node._dispatch``) answers the sender with a
:class:`StatusReply`: the members as this node sees them (status, roles, ``up_number`` and age
order), who is unreachable, the leader and the oldest member, and for each entity type started on
the node its region's counters plus ``node.sharding.cluster_stats`` (the shard → entity
counts of every region hosting the type, proxies not included, and apart the regions that did
not answer in time). Gathering the cluster stats waits for other nodes, so each request is
answered from a task in the node's nursery, not from the link task that delivered it; a few
requests at most are answered at once and the rest are dropped.

A :class:`MemberCommand` asks a node to make a member leave or go down (``p2pshard leave|down``).
The node's :class:`MemberCommandService` carries it out only when the link it came over has an
``admin`` certificate (``Envelope.identity``, which the TLS handshake verified; nothing in the
message itself can claim it) and answers a :class:`MemberCommandReply` either way, saying what it
did or why it refused. A ``client`` or ``node`` certificate may read the status and nothing else.

The asking side (:func:`open_client`, :func:`probe_nodes`, :func:`command_member`) is a client
transport: a TCP transport with the mutual TLS identity of a :class:`ClientConfig` (a client's
or an admin's certificate, or a node's when the configuration is a node's), whose name and kind
are read from the certificate, listening on a free port because the answer comes back over a
link the node opens to it. ``p2pshard remove-sharding-data`` uses the same probe to make sure no
node of the cluster is running before it touches a store.

Once the answer to a client that is not a member has left, the node forgets the client's
address (``Transport.forget``), so it does not keep reconnecting to a port that is gone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from crdt import ReplicationError
from membership import (
    Address,
    Cluster,
    ConfigurationError,
    Envelope,
    IdentityKind,
    Member,
    MemberStatus,
    MessageTooLarge,
    PeerIdentity,
    SendQueueFull,
    SerializationError,
    Transport,
    TransportClosed,
    UniqueAddress,
    message,
)
from membership.internal import (
    NOT_UP,
    Sighting,
    TcpTransport,
    TlsIdentity,
    Verdict,
    identity_text,
    open_tcp_transport,
)

from ._config import ClientConfig, NodeConfig
from .sharding._region import RegionStatistics
from .sharding._sharding import Sharding

FORGET_AFTER = 10.0
"""Seconds a reply to a client that is not a member may take to leave before its link is
dropped (see ``Transport.forget``)."""

logger = logging.getLogger("p2pshard.status")

MAX_IN_FLIGHT = 4
"""Status requests a node answers at once; more are dropped (the asker times out)."""

STATS_TIMEOUT_RANGE = (0.05, 10.0)
"""A node bounds the requested wait for other regions' statistics to this range (seconds)."""

_SCALARS = (bool, int, float, str, type(None))


def _of(kind: type | tuple[type, ...]) -> Any:
    return attrs.validators.instance_of(kind)


def _tuple_of(kind: type | tuple[type, ...]) -> Any:
    return attrs.validators.deep_iterable(member_validator=_of(kind), iterable_validator=_of(tuple))


def _dict_of(value: type | tuple[type, ...]) -> Any:
    return attrs.validators.deep_mapping(
        key_validator=_of(str), value_validator=_of(value), mapping_validator=_of(dict)
    )


def _check_request_id(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**63:
        raise ValueError(f"{attribute.name} = {value!r} must be an integer in 1..2**63-1")


def _check_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ValueError(f"{attribute.name} = {value!r} must be a number of seconds above 0")


_optional_node = attrs.validators.optional(_of(UniqueAddress))

MEMBER_ACTIONS = ("leave", "down")
"""What a :class:`MemberCommand` may ask for."""

_LEAVABLE = frozenset({MemberStatus.JOINING, MemberStatus.WEAKLY_UP, MemberStatus.UP})
_LEAVING = frozenset({MemberStatus.LEAVING, MemberStatus.EXITING})


@message(name="p2pshard.status.Request")
@attrs.frozen(kw_only=True)
class StatusRequest:
    """Asks a node for a :class:`StatusReply`; ``stats_timeout`` bounds its wait for regions."""

    request_id: int = attrs.field(validator=_check_request_id)
    stats_timeout: float = attrs.field(default=2.0, validator=_check_seconds)


@message(name="p2pshard.status.Member")
@attrs.frozen(kw_only=True)
class MemberInfo:
    """One member as the answering node sees it."""

    node: UniqueAddress = attrs.field(validator=_of(UniqueAddress))
    status: str = attrs.field(validator=_of(str))
    """The :class:`membership.MemberStatus` name: ``JOINING``, ``UP``, ``LEAVING`` ..."""
    roles: tuple[str, ...] = attrs.field(validator=_tuple_of(str))
    up_number: int = attrs.field(validator=_of(int))
    """Lower is older; ``NOT_UP`` (2**31-1) for a member that was never Up."""
    age: int = attrs.field(validator=_of(int))
    """1 for the oldest member, 2 for the next ...; 0 for a member that was never Up."""
    app_version: str = attrs.field(default="", validator=_of(str))
    """The ``app_version`` the member joined with (empty: not set)."""


@message(name="p2pshard.status.RegionShards")
@attrs.frozen(kw_only=True)
class RegionShards:
    """The shards one region (node) hosts, each with its number of active entities."""

    node: UniqueAddress = attrs.field(validator=_of(UniqueAddress))
    shards: dict[str, int] = attrs.field(validator=_dict_of(int))


@message(name="p2pshard.status.EntityType")
@attrs.frozen(kw_only=True)
class EntityTypeStatus:
    """One entity type started on the answering node."""

    type_name: str = attrs.field(validator=_of(str))
    region: dict[str, bool | int | float | str | None] = attrs.field(validator=_dict_of(_SCALARS))
    """This node's ``RegionStatistics`` as a table (the coordinator as a string)."""
    regions: tuple[RegionShards, ...] = attrs.field(validator=_tuple_of(RegionShards))
    """``cluster_stats``: every region hosting the type that answered (never a proxy)."""
    failed: tuple[UniqueAddress, ...] = attrs.field(validator=_tuple_of(UniqueAddress))
    """``cluster_stats``: the regions hosting the type that did not answer in time."""
    error: str = attrs.field(default="", validator=_of(str))
    """Why the cluster stats are missing, if they are."""


@message(name="p2pshard.status.OtherCluster")
@attrs.frozen(kw_only=True)
class OtherCluster:
    """Another cluster of this cluster's name that the answering node saw lately (an island)."""

    oldest: UniqueAddress = attrs.field(validator=_of(UniqueAddress))
    """Its oldest Up member."""
    size: int = attrs.field(validator=_of(int))
    """Its size as its members say."""
    vouched: int = attrs.field(validator=_of(int))
    """How many of its members were heard from lately."""
    addresses: tuple[Address, ...] = attrs.field(validator=_tuple_of(Address))
    """Where it was seen."""
    verdict: str = attrs.field(validator=_of(str))
    """``ours wins``, ``ours loses`` or ``undecided`` (the facts have not held long enough)."""


@message(name="p2pshard.status.Reply")
@attrs.frozen(kw_only=True)
class StatusReply:
    """A node's answer to :class:`StatusRequest`."""

    request_id: int = attrs.field(validator=_check_request_id)
    node: UniqueAddress = attrs.field(validator=_of(UniqueAddress))
    members: tuple[MemberInfo, ...] = attrs.field(validator=_tuple_of(MemberInfo))
    unreachable: tuple[UniqueAddress, ...] = attrs.field(validator=_tuple_of(UniqueAddress))
    leader: UniqueAddress | None = attrs.field(validator=_optional_node)
    oldest: UniqueAddress | None = attrs.field(validator=_optional_node)
    entity_types: tuple[EntityTypeStatus, ...] = attrs.field(validator=_tuple_of(EntityTypeStatus))
    other_clusters: tuple[OtherCluster, ...] = attrs.field(
        default=(), validator=_tuple_of(OtherCluster)
    )
    """Other clusters of the same name seen lately (new: an older node sends none)."""


@message(name="p2pshard.status.MemberCommand")
@attrs.frozen(kw_only=True)
class MemberCommand:
    """Asks a node to make the member at ``address`` leave (gracefully) or go down.

    Carried out only if the link it comes over has an ``admin`` certificate.
    """

    request_id: int = attrs.field(validator=_check_request_id)
    action: str = attrs.field(validator=attrs.validators.in_(MEMBER_ACTIONS))
    address: Address = attrs.field(validator=_of(Address))


@message(name="p2pshard.status.MemberCommandReply")
@attrs.frozen(kw_only=True)
class MemberCommandReply:
    """A node's answer to :class:`MemberCommand`: whether it did it, and what it did or why not."""

    request_id: int = attrs.field(validator=_check_request_id)
    ok: bool = attrs.field(validator=_of(bool))
    text: str = attrs.field(validator=_of(str))


# --- the node side -------------------------------------------------------------------------------


class StatusService:
    """Answers :class:`StatusRequest` on a node. ``Node._dispatch`` passes it every message."""

    def __init__(
        self, transport: Transport, cluster: Cluster, sharding: Sharding, nursery: trio.Nursery
    ) -> None:
        self._transport = transport
        self._cluster = cluster
        self._sharding = sharding
        self._nursery = nursery
        self._in_flight = 0

    def handle(self, envelope: Envelope) -> bool:
        """Take a status request (answered from a task); False if it is not one."""
        request = envelope.message
        if type(request) is not StatusRequest:
            return False
        if self._in_flight >= MAX_IN_FLIGHT:
            logger.warning(
                "%s: dropped a status request from %s: %d are being answered",
                self._transport.local_address,
                envelope.sender,
                self._in_flight,
            )
            return True
        try:
            self._nursery.start_soon(self._answer, envelope.sender, request)
        except RuntimeError:  # the nursery is closing: the node is stopping
            return True
        self._in_flight += 1
        return True

    async def _answer(self, asker: UniqueAddress, request: StatusRequest) -> None:
        try:
            low, high = STATS_TIMEOUT_RANGE
            reply = await self.status(
                request.request_id, min(max(request.stats_timeout, low), high)
            )
            try:
                self._transport.send_nowait(asker, reply)
            except MessageTooLarge as exc:  # many regions and shards: send the rest
                slim = tuple(
                    attrs.evolve(t, regions=(), failed=(), error=f"too large to send: {exc}")
                    for t in reply.entity_types
                )
                self._transport.send_nowait(asker, attrs.evolve(reply, entity_types=slim))
        except (SendQueueFull, TransportClosed, SerializationError) as exc:
            logger.warning(
                "%s: cannot answer the status request of %s: %s",
                self._transport.local_address,
                asker,
                exc,
            )
        finally:
            self._in_flight -= 1
        if not any(m.node.address == asker.address for m in self._cluster.members):
            # A command-line client: once it has the answer, stop linking to its port.
            with contextlib.suppress(TransportClosed):
                await self._transport.forget(asker.address, flush_timeout=FORGET_AFTER)

    async def status(self, request_id: int, stats_timeout: float) -> StatusReply:
        """This node's view now, with every region's statistics gathered within the timeout."""
        types: dict[str, EntityTypeStatus] = {}

        async def one(type_name: str) -> None:
            types[type_name] = await self.entity_type(type_name, stats_timeout)

        async with trio.open_nursery() as nursery:
            for type_name in sorted(self._sharding.type_names):
                nursery.start_soon(one, type_name)
        return attrs.evolve(
            self.members(request_id), entity_types=tuple(types[name] for name in sorted(types))
        )

    def members(self, request_id: int) -> StatusReply:
        """This node's view of the members now, without entity types (nothing to wait for)."""
        cluster = self._cluster
        oldest = cluster.oldest()
        return StatusReply(
            request_id=request_id,
            node=self._transport.local_address,
            members=_member_infos(cluster.members),
            unreachable=tuple(sorted(m.node for m in cluster.unreachable)),
            leader=cluster.leader,
            oldest=None if oldest is None else oldest.node,
            entity_types=(),
            other_clusters=tuple(_other_cluster(s) for s in cluster.other_clusters()),
        )

    async def entity_type(self, type_name: str, stats_timeout: float) -> EntityTypeStatus:
        """This node's region of ``type_name`` and every region's shards, gathered in time.

        A type that is not started here (or stopped meanwhile) gets an empty region table and
        the reason in ``error``.
        """
        try:
            stats = await self._sharding.cluster_stats(type_name, timeout=stats_timeout)
            regions = tuple(
                RegionShards(node=node, shards=dict(shards))
                for node, shards in sorted(stats.regions.items())
            )
            failed, error = tuple(sorted(stats.failed)), ""
        except (ConfigurationError, ReplicationError) as exc:  # stopped meanwhile
            regions, failed, error = (), (), str(exc)
        try:
            region = _plain_table(self._sharding.region(type_name).statistics())
        except ConfigurationError:
            region = {}
        return EntityTypeStatus(
            type_name=type_name, region=region, regions=regions, failed=failed, error=error
        )


class MemberCommandService:
    """Carries out :class:`MemberCommand` for admins. ``Node._dispatch`` passes it every message."""

    def __init__(self, transport: Transport, cluster: Cluster, nursery: trio.Nursery) -> None:
        self._transport = transport
        self._cluster = cluster
        self._nursery = nursery

    def handle(self, envelope: Envelope) -> bool:
        """Take a member command (answered at once); False if it is not one."""
        command = envelope.message
        if type(command) is not MemberCommand:
            return False
        ok, text = self.apply(command, envelope.identity)
        # A refusal by kind is worth a warning: someone without the right certificate tried.
        refused_kind = envelope.identity.kind is not IdentityKind.ADMIN
        log = logger.warning if refused_kind else logger.info
        log(
            "%s: %s %s from %s (%s): %s",
            self._transport.local_address,
            command.action,
            command.address,
            identity_text(envelope.identity),
            envelope.sender,
            text,
        )
        reply = MemberCommandReply(request_id=command.request_id, ok=ok, text=text)
        asker = envelope.sender
        try:
            # Queued now, before this node could stop (asked to leave or go down itself): the
            # transport flushes what is queued when it closes.
            self._transport.send_nowait(asker, reply)
        except (SendQueueFull, TransportClosed, SerializationError) as exc:
            logger.warning(
                "%s: cannot answer the member command of %s: %s",
                self._transport.local_address,
                asker,
                exc,
            )
        if member_at(self._cluster, asker.address) is None:
            with contextlib.suppress(RuntimeError):  # the nursery is closing: the node stops
                self._nursery.start_soon(self._forget, asker.address)
        return True

    def apply(self, command: MemberCommand, identity: PeerIdentity) -> tuple[bool, str]:
        """Carry out ``command`` if ``identity`` may ask for it; whether it was, and a text.

        Only an ``admin`` identity may make members leave or go down.
        """
        if identity.kind is not IdentityKind.ADMIN:
            return False, (
                f"refused: leave/down needs an admin certificate; {identity.name!r} is a "
                f"{identity.kind.value}"
            )
        cluster = self._cluster
        if not is_member_now(cluster):
            return False, not_a_member_text(cluster)
        member = member_at(cluster, command.address)
        if member is None:
            return False, no_member_text(cluster, command.address)
        return carry_out(cluster, member, command.action)

    async def _forget(self, client: Address) -> None:
        """A command-line client: once it has the answer, stop linking to its port."""
        with contextlib.suppress(TransportClosed):
            await self._transport.forget(client, flush_timeout=FORGET_AFTER)


def member_at(cluster: Cluster, address: Address) -> Member | None:
    """The member at ``address`` as ``cluster`` sees it, or None."""
    for member in cluster.members:
        if member.node.address == address:
            return member
    return None


def is_member_now(cluster: Cluster) -> bool:
    """Whether this node is a member (so its view of the members may be acted on)."""
    return cluster.statistics().phase == "member"


def not_a_member_text(cluster: Cluster) -> str:
    """Why a node that is not a member now refuses to make members leave or go down."""
    return f"{cluster.self_address} is not a member of the cluster now; ask a member"


def no_member_text(cluster: Cluster, address: Address) -> str:
    """The refusal for an address no member has, naming the members there are."""
    known = ", ".join(f"{m.node.name} at {m.node.address}" for m in cluster.members)
    return f"no member at {address} (members: {known or 'none'})"


def carry_out(cluster: Cluster, member: Member, action: str) -> tuple[bool, str]:
    """Make ``member`` leave or go down (``action``); whether that was done, and a text.

    Leaving a member that is leaving already, or downing one that is Down, counts as done.
    """
    status = member.status
    node = member.node
    if action == "leave":
        if status in _LEAVING:
            return True, f"{node} is leaving already ({status.name})"
        if status not in _LEAVABLE:
            return False, f"{node} is {status.name}: it cannot leave any more"
        cluster.leave(node.address)
        done = MemberStatus.LEAVING
        what = "it hands its shards and singletons over, then is removed"
    else:
        if status is MemberStatus.DOWN:
            return True, f"{node} is Down already"
        cluster.down(node)
        done = MemberStatus.DOWN
        what = "it is removed once the others no longer reach it; if it runs, it stops"
    after = member_at(cluster, node.address)
    if after is None or after.status is not done:
        now = "removed" if after is None else after.status.name
        return False, f"{node} could not be marked {done.name} (it is {now})"
    return True, f"{node} marked {done.name}: {what}"


def _other_cluster(sighting: Sighting) -> OtherCluster:
    verdict = {None: "undecided", Verdict.WINS: "ours wins", Verdict.LOSES: "ours loses"}
    return OtherCluster(
        oldest=sighting.oldest,
        size=sighting.size,
        vouched=sighting.vouched,
        addresses=sighting.addresses,
        verdict=verdict[sighting.verdict],
    )


def _member_infos(members: Iterable[Member]) -> tuple[MemberInfo, ...]:
    members = list(members)
    by_age = sorted((m for m in members if m.up_number != NOT_UP), key=Member.age_key)
    age = {m.node: i for i, m in enumerate(by_age, start=1)}
    return tuple(
        MemberInfo(
            node=m.node,
            status=m.status.name,
            roles=tuple(sorted(m.roles)),
            up_number=m.up_number,
            age=age.get(m.node, 0),
            app_version=m.app_version,
        )
        for m in members
    )


def _plain_table(stats: RegionStatistics) -> dict[str, bool | int | float | str | None]:
    """An attrs instance's fields as plain values; anything else (an address) as its string."""
    table: dict[str, bool | int | float | str | None] = {}
    for field in attrs.fields(type(stats)):
        value = getattr(stats, field.name)
        table[field.name] = value if isinstance(value, _SCALARS) else str(value)
    return table


# --- the asking side -----------------------------------------------------------------------------


@attrs.frozen
class Probe:
    """What came back from one address: the reply, or None; whether a link to it came up."""

    target: Address
    reply: StatusReply | None
    linked: bool


def client_identity(config: NodeConfig | ClientConfig) -> TlsIdentity:
    """The TLS identity in ``config``, which a command presents to the cluster."""
    return config.tls.identity(config.cluster_name)


@asynccontextmanager
async def open_client(
    config: ClientConfig | NodeConfig, *, bind_host: str | None = None
) -> AsyncIterator[TcpTransport]:
    """A transport with ``config``'s certificate, listening on a free port for answers.

    Its name and kind (node, client or admin) are those its certificate names. It binds
    ``bind_host`` (default: the config's ``bind_host``) and advertises the config's canonical
    host, where the nodes can reach the host this runs on.

    Example:
        >>> async def members(config: ClientConfig, node: Address) -> None:
        ...     async with open_client(config) as transport:
        ...         (probe,) = await probe_nodes(transport, [node], timeout=5, stats_timeout=2)
        ...         print(probe.reply)

    Raises:
        ConfigurationError: unreadable certificate files, or a certificate for another cluster.
        OSError: the host cannot be bound.
    """
    if isinstance(config, NodeConfig):
        config = ClientConfig.of_node(config)
    identity = config.identity()
    host = bind_host or config.bind_host
    advertised = config.canonical_host if bind_host is None and config.canonical_host else host
    settings = attrs.evolve(
        config.transport, shutdown_flush_timeout=min(config.transport.shutdown_flush_timeout, 0.5)
    )
    async with open_tcp_transport(
        config.tls_identity(),
        identity.name,
        Address(host, 0),
        canonical=Address(advertised, 0),
        settings=settings,
        kind=identity.kind,
    ) as transport:
        yield transport


async def probe_nodes(
    transport: Transport,
    targets: Sequence[Address],
    *,
    timeout: float,  # noqa: ASYNC109 - one deadline for every target
    stats_timeout: float,
    first_answer: bool = False,
) -> list[Probe]:
    """Send every target a :class:`StatusRequest` at once; wait up to ``timeout`` for answers.

    With ``first_answer``, return as soon as any target answers (the rest count as silent).
    Returns one :class:`Probe` per target, in order.
    """
    ids = {secrets.randbits(62) + 1: target for target in targets}
    replies: dict[Address, StatusReply] = {}
    with trio.move_on_after(timeout):
        for request_id, target in ids.items():
            with contextlib.suppress(SendQueueFull):
                await transport.send(
                    target, StatusRequest(request_id=request_id, stats_timeout=stats_timeout)
                )
        while not (replies and (first_answer or len(replies) == len(ids))):
            reply = (await transport.receive()).message
            if isinstance(reply, StatusReply) and reply.request_id in ids:
                replies[ids[reply.request_id]] = reply
    statistics = transport.statistics()
    probes = []
    for target in targets:
        peer = statistics.peer(target)
        linked = peer is not None and (peer.connected or peer.connects > 0)
        probes.append(Probe(target, replies.get(target), linked))
    return probes


@attrs.frozen
class CommandAnswer:
    """What came back from the node asked to carry out a member command."""

    target: Address
    reply: MemberCommandReply | None
    linked: bool


async def command_member(
    transport: Transport,
    target: Address,
    action: str,
    address: Address,
    *,
    timeout: float,  # noqa: ASYNC109 - the whole exchange
) -> CommandAnswer:
    """Ask the node at ``target`` to make the member at ``address`` leave or go down.

    Waits up to ``timeout`` for the answer; the node decides by the certificate of ``transport``.

    Example:
        >>> async def leave(transport: Transport, node: Address) -> None:
        ...     answer = await command_member(transport, node, "leave", node, timeout=5)
        ...     print(answer.reply.text if answer.reply else "no answer")
    """
    request_id = secrets.randbits(62) + 1
    command = MemberCommand(request_id=request_id, action=action, address=address)
    reply = None
    with trio.move_on_after(timeout):
        await transport.send(target, command)
        while reply is None:
            message = (await transport.receive()).message
            if isinstance(message, MemberCommandReply) and message.request_id == request_id:
                reply = message
    peer = transport.statistics().peer(target)
    linked = peer is not None and (peer.connected or peer.connects > 0)
    return CommandAnswer(target, reply, linked)


# --- rendering -----------------------------------------------------------------------------------


def node_json(node: UniqueAddress | None) -> dict[str, str] | None:
    """A node incarnation as JSON: name, address and uid (hex, as in the logs)."""
    if node is None:
        return None
    return {"name": node.name, "address": str(node.address), "uid": f"{node.uid:x}"}


def reply_json(reply: StatusReply) -> dict[str, Any]:
    """The reply as a JSON-ready dict (what ``p2pshard status --json`` prints)."""
    unreachable = set(reply.unreachable)
    return {
        "node": node_json(reply.node),
        "members": [
            {
                **(node_json(m.node) or {}),
                "status": m.status,
                "roles": list(m.roles),
                "up_number": None if m.up_number == NOT_UP else m.up_number,
                "age": m.age or None,
                "reachable": m.node not in unreachable,
                "app_version": m.app_version or None,
            }
            for m in reply.members
        ],
        "unreachable": [node_json(n) for n in reply.unreachable],
        "leader": node_json(reply.leader),
        "oldest": node_json(reply.oldest),
        "other_clusters": [
            {
                "oldest": node_json(o.oldest),
                "size": o.size,
                "vouched": o.vouched,
                "addresses": [str(a) for a in o.addresses],
                "verdict": o.verdict,
            }
            for o in reply.other_clusters
        ],
        "entity_types": [entity_type_json(t) for t in reply.entity_types],
    }


def entity_type_json(status: EntityTypeStatus) -> dict[str, Any]:
    """One entity type's region and cluster stats as a JSON-ready dict (as in ``reply_json``)."""
    return {
        "type_name": status.type_name,
        "region": dict(status.region),
        "regions": [
            {
                **(node_json(r.node) or {}),
                "shard_count": len(r.shards),
                "entity_count": sum(r.shards.values()),
                "shards": _sorted_shards(r.shards),
            }
            for r in status.regions
        ],
        "failed": [node_json(n) for n in status.failed],
        "error": status.error or None,
    }


def _node_of(document: Any) -> UniqueAddress:
    """The inverse of :func:`node_json`."""
    return UniqueAddress(
        Address.parse(document["address"]), document["name"], int(document["uid"], 16)
    )


def entity_type_from_json(document: Mapping[str, Any]) -> EntityTypeStatus:
    """The inverse of :func:`entity_type_json` (``GET /cluster/shards/{type}``'s answer).

    Raises:
        KeyError, TypeError, ValueError: the document is not such an answer.
    """
    return EntityTypeStatus(
        type_name=document["type_name"],
        region=dict(document["region"]),
        regions=tuple(
            RegionShards(node=_node_of(r), shards=dict(r["shards"])) for r in document["regions"]
        ),
        failed=tuple(_node_of(n) for n in document["failed"]),
        error=document["error"] or "",
    )


def reply_from_json(
    members: Mapping[str, Any], entity_types: Sequence[EntityTypeStatus] = ()
) -> StatusReply:
    """A :class:`StatusReply` from the management endpoint's ``GET /cluster/members`` answer.

    The inverse of :func:`reply_json` (whose ``node`` the endpoint names ``self``), so that
    ``p2pshard status --management`` prints what it prints over the cluster port.

    Raises:
        KeyError, TypeError, ValueError: the document is not such an answer.
    """
    return StatusReply(
        request_id=1,
        node=_node_of(members["self"] if "self" in members else members["node"]),
        members=tuple(
            MemberInfo(
                node=_node_of(m),
                status=m["status"],
                roles=tuple(m["roles"]),
                up_number=NOT_UP if m["up_number"] is None else m["up_number"],
                age=m["age"] or 0,
                app_version=m["app_version"] or "",
            )
            for m in members["members"]
        ),
        unreachable=tuple(_node_of(n) for n in members["unreachable"]),
        leader=None if members["leader"] is None else _node_of(members["leader"]),
        oldest=None if members["oldest"] is None else _node_of(members["oldest"]),
        entity_types=tuple(entity_types),
        other_clusters=tuple(
            OtherCluster(
                oldest=_node_of(o["oldest"]),
                size=o["size"],
                vouched=o["vouched"],
                addresses=tuple(Address.parse(a) for a in o["addresses"]),
                verdict=o["verdict"],
            )
            for o in members["other_clusters"]
        ),
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _shard_order(shard: str) -> tuple[bool, int, str]:
    """Numeric shard ids (HashExtractor's) in numeric order, then the others."""
    numeric = shard.isascii() and shard.isdigit()
    return (not numeric, int(shard) if numeric else 0, shard)


def _sorted_shards(shards: dict[str, int]) -> dict[str, int]:
    return {shard: shards[shard] for shard in sorted(shards, key=_shard_order)}


def _shard_list(shards: dict[str, int], limit: int = 60) -> str:
    text = " ".join(f"{shard}:{count}" for shard, count in _sorted_shards(shards).items())
    return text if len(text) <= limit else text[: limit - 3].rsplit(" ", 1)[0] + " ..."


def reply_text(reply: StatusReply) -> str:
    """The reply as readable text: the members, then a table of regions per entity type."""
    unreachable = set(reply.unreachable)
    lines = [
        f"node {reply.node}",
        f"leader: {reply.leader or 'none'}",
        f"oldest: {reply.oldest or 'none'}",
        f"unreachable: {', '.join(map(str, reply.unreachable)) or 'none'}",
        "",
    ]
    lines += _table(
        ("MEMBER", "ADDRESS", "UID", "STATUS", "ROLES", "UP#", "AGE", "REACHABLE", "VERSION"),
        [
            (
                m.node.name,
                str(m.node.address),
                f"{m.node.uid:x}",
                m.status,
                ",".join(m.roles) or "-",
                "-" if m.up_number == NOT_UP else str(m.up_number),
                str(m.age or "-"),
                "no" if m.node in unreachable else "yes",
                m.app_version or "-",
            )
            for m in reply.members
        ],
    )
    for other in reply.other_clusters:
        lines += [
            "",
            f"another cluster of this name: oldest {other.oldest}, {other.size} members "
            f"({other.vouched} heard from) at {', '.join(map(str, other.addresses))}; "
            f"{other.verdict}",
        ]
    if not reply.entity_types:
        lines += ["", "no entity types started on this node"]
    for t in reply.entity_types:
        region = t.region
        lines += [
            "",
            f"entity type {t.type_name}",
            f"  this node: {'proxy' if region.get('proxy') else 'region'}, "
            f"{'registered' if region.get('registered') else 'not registered'}, "
            f"{region.get('shards', 0)} shards, {region.get('entities', 0)} entities, "
            f"{region.get('buffered', 0)} buffered, {region.get('dropped', 0)} dropped",
            f"  coordinator: {region.get('coordinator') or 'unknown'}",
        ]
        if t.error:
            lines.append(f"  cluster stats: {t.error}")
        rows = [
            (
                r.node.name,
                str(r.node.address),
                str(len(r.shards)),
                str(sum(r.shards.values())),
                _shard_list(r.shards) or "-",
            )
            for r in t.regions
        ]
        rows += [(n.name, str(n.address), "?", "?", "(no answer)") for n in t.failed]
        if rows:
            header = ("REGION", "ADDRESS", "SHARDS", "ENTITIES", "SHARD:ENTITIES")
            lines += ["  " + line for line in _table(header, rows)]
        shards = sum(len(r.shards) for r in t.regions)
        entities = sum(sum(r.shards.values()) for r in t.regions)
        lines.append(
            f"  total: {shards} shards, {entities} entities in {len(t.regions)} regions"
            + (f"; {len(t.failed)} regions did not answer" if t.failed else "")
        )
    return "\n".join(lines)
