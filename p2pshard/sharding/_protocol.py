"""Messages between shard regions and their coordinator: Akka's sharding protocol.

Every message names its entity type (``type_name``), since one node runs a region (or proxy) and
maybe the coordinator for each entity type it started. Directions, as in Akka::

    region ──Register / RegisterProxy──▶ coordinator ──RegisterAck──▶ region
    region ──GetShardHome(shard)───────▶ coordinator ──ShardHome(shard, region)──▶ region
                                          coordinator ──HostShard(shard)──▶ owner ──ShardStarted──▶
    rebalance: coordinator ──BeginHandOff──▶ every region and proxy ──BeginHandOffAck──▶
               coordinator ──HandOff──▶ owner (stops the shard's entities) ──ShardStopped──▶
    shutdown:  region ──GracefulShutdownReq──▶ coordinator (hands all its shards off)
               region ──RegionStopped──▶ coordinator
    entities:  region ──EntityDelivery (or a batch: EntityDeliveries)──▶ region
               region ──EntityReply (the answer to an ask)──▶ the asking node
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs

from membership import UniqueAddress, message
from membership.internal import wire

_OMITTED_WHEN_NONE = {wire.OMIT_WHEN_NONE: True}
"""Left out of the frame while None: an envelope without a trace costs no byte for it."""


def _of(kind: type | tuple[type, ...]) -> Any:
    return attrs.validators.instance_of(kind)


def _name() -> Any:
    return attrs.field(validator=_of(str))


@message(name="p2pshard.sharding.Register")
@attrs.frozen(kw_only=True)
class Register:
    """A region asks to be registered (sent until RegisterAck comes)."""

    type_name: str = _name()
    number_of_shards: int = attrs.field(validator=_of(int))


@message(name="p2pshard.sharding.RegisterProxy")
@attrs.frozen(kw_only=True)
class RegisterProxy:
    """A proxy (hosting nothing) asks to be registered, so it hears of hand-offs."""

    type_name: str = _name()
    number_of_shards: int = attrs.field(validator=_of(int))


@message(name="p2pshard.sharding.RegisterAck")
@attrs.frozen(kw_only=True)
class RegisterAck:
    """The coordinator registered the region; ``coordinator`` is where it runs."""

    type_name: str = _name()
    coordinator: UniqueAddress = attrs.field(validator=_of(UniqueAddress))


@message(name="p2pshard.sharding.RegisterRefused")
@attrs.frozen(kw_only=True)
class RegisterRefused:
    """The region cannot join this entity type, and why (a different number of shards)."""

    type_name: str = _name()
    reason: str = attrs.field(validator=_of(str))


@message(name="p2pshard.sharding.GetShardHome")
@attrs.frozen(kw_only=True)
class GetShardHome:
    """Where does ``shard`` live? (allocating it if it lives nowhere)."""

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))


@message(name="p2pshard.sharding.ShardHome")
@attrs.frozen(kw_only=True)
class ShardHome:
    """``shard`` lives in the region on node ``region``."""

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))
    region: UniqueAddress = attrs.field(validator=_of(UniqueAddress))


@message(name="p2pshard.sharding.HostShard")
@attrs.frozen(kw_only=True)
class HostShard:
    """Start ``shard`` here (resent until ShardStarted comes)."""

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))


@message(name="p2pshard.sharding.ShardStarted")
@attrs.frozen(kw_only=True)
class ShardStarted:
    """The region started ``shard``."""

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))


@message(name="p2pshard.sharding.BeginHandOff")
@attrs.frozen(kw_only=True)
class BeginHandOff:
    """``shard`` is moving: forget its home and buffer its messages.

    ``handoff_id`` names this hand-off; the acknowledgement repeats it, so a late answer to an
    earlier hand-off of the same shard does not count for this one.
    """

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))
    handoff_id: int = attrs.field(default=0, validator=_of(int))


@message(name="p2pshard.sharding.BeginHandOffAck")
@attrs.frozen(kw_only=True)
class BeginHandOffAck:
    """The region ``acked_by`` forgot the home of ``shard`` and buffers for it.

    A region sends it to the shard's current owner, which passes it on to the coordinator:
    it travels behind every message that region sent the owner, so the owner has them all
    before HandOff can come, and they are handled before the shard stops (per-sender order
    holds through a rebalance). A region that knows no owner sends it to the coordinator.
    """

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))
    handoff_id: int = attrs.field(default=0, validator=_of(int))
    acked_by: UniqueAddress | None = attrs.field(
        default=None, validator=attrs.validators.optional(_of(UniqueAddress))
    )


@message(name="p2pshard.sharding.HandOff")
@attrs.frozen(kw_only=True)
class HandOff:
    """Stop ``shard``'s entities and answer ShardStopped."""

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))
    handoff_id: int = attrs.field(default=0, validator=_of(int))


@message(name="p2pshard.sharding.ShardStopped")
@attrs.frozen(kw_only=True)
class ShardStopped:
    """Every entity of ``shard`` stopped here; it may start elsewhere."""

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))
    handoff_id: int = attrs.field(default=0, validator=_of(int))


@message(name="p2pshard.sharding.GracefulShutdownReq")
@attrs.frozen(kw_only=True)
class GracefulShutdownReq:
    """The region is shutting down: hand all its shards off."""

    type_name: str = _name()


@message(name="p2pshard.sharding.RegionStopped")
@attrs.frozen(kw_only=True)
class RegionStopped:
    """The region stopped after its graceful shutdown."""

    type_name: str = _name()


@message(name="p2pshard.sharding.EntityDelivery")
@attrs.frozen(kw_only=True)
class EntityDelivery:
    """A message for entity ``entity_id`` of ``shard``, between regions.

    ``request_id`` is non-zero for an ask, whose answer goes to ``origin`` (the asking node),
    however many regions the message passes through. ``trace`` is the sender's trace context
    (the W3C ``traceparent`` and ``tracestate`` as OpenTelemetry's propagator writes them) when
    the message was sent inside a recording span; otherwise None, and not in the frame at all.
    """

    type_name: str = _name()
    shard: str = attrs.field(validator=_of(str))
    entity_id: str = attrs.field(validator=_of(str))
    message: object
    request_id: int = attrs.field(default=0, validator=_of(int))
    origin: UniqueAddress | None = attrs.field(
        default=None, validator=attrs.validators.optional(_of(UniqueAddress))
    )
    trace: dict[str, str] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_of(dict)), metadata=_OMITTED_WHEN_NONE
    )


_new = object.__new__
# The slots' own setters: calling them is a third cheaper than object.__setattr__ by name.
(
    _set_type_name,
    _set_shard,
    _set_entity_id,
    _set_message,
    _set_request_id,
    _set_origin,
    _set_trace,
) = (getattr(EntityDelivery, f.name).__set__ for f in attrs.fields(EntityDelivery))


def unchecked_delivery(
    type_name: str,
    shard: str,
    entity_id: str,
    message: object,
    request_id: int,
    origin: UniqueAddress | None,
    trace: dict[str, str] | None = None,
) -> EntityDelivery:
    """An :class:`EntityDelivery` built without running its validators.

    For the region's hot path only, where every field has just come from values of the right
    type; a received one is always validated when it is decoded.
    """
    delivery: EntityDelivery = _new(EntityDelivery)
    _set_type_name(delivery, type_name)
    _set_shard(delivery, shard)
    _set_entity_id(delivery, entity_id)
    _set_message(delivery, message)
    _set_request_id(delivery, request_id)
    _set_origin(delivery, origin)
    _set_trace(delivery, trace)
    return delivery


ENTRY_FIELDS = 5
"""Values per message in :attr:`EntityDeliveries.entries`."""


@message(name="p2pshard.sharding.EntityDeliveries")
@attrs.frozen(kw_only=True)
class EntityDeliveries:
    """Messages for entities of one type, between regions, in the order they were sent.

    A region sends these in place of single :class:`EntityDelivery` messages while the link to
    that node is busy: what it sends then waits in the queue anyway, and one frame of many is
    cheaper to send and to receive than many frames. ``entries`` is flat, :data:`ENTRY_FIELDS`
    values per message: shard id, entity id, the message as a frame payload of its own
    (``_wire.encode``), request id (0 for a tell), and the asking node, or None when it is the
    sender. The receiver checks each entry on its own: a bad one is dropped, not the others.
    ``traces`` is None (and not in the frame) when no message of the batch carries a trace
    context; otherwise one value per message, its ``EntityDelivery.trace`` or None.
    """

    type_name: str = _name()
    entries: list[object] = attrs.field(validator=_of(list))
    traces: list[object] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_of(list)), metadata=_OMITTED_WHEN_NONE
    )


@message(name="p2pshard.sharding.EntityReply")
@attrs.frozen(kw_only=True)
class EntityReply:
    """The answer to an ask: the entity's return value, or the error it raised."""

    request_id: int = attrs.field(validator=_of(int))
    value: object = None
    error_type: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_of(str))
    )
    error_text: str = attrs.field(default="", validator=_of(str))


@message(name="p2pshard.sharding.GetRegionStats")
@attrs.frozen(kw_only=True)
class GetRegionStats:
    """Which shards does this region host, with how many entities each?"""

    type_name: str = _name()
    request_id: int = attrs.field(validator=_of(int))


@message(name="p2pshard.sharding.RegionStats")
@attrs.frozen(kw_only=True)
class RegionStats:
    """Answer to :class:`GetRegionStats`: shard id to number of active entities."""

    type_name: str = _name()
    request_id: int = attrs.field(validator=_of(int))
    shards: dict[str, int] = attrs.field(validator=_of(dict))


CoordinatorCommand: TypeAlias = (
    Register
    | RegisterProxy
    | GetShardHome
    | ShardStarted
    | BeginHandOffAck
    | ShardStopped
    | GracefulShutdownReq
    | RegionStopped
)
"""What regions send the coordinator."""

CoordinatorMessage: TypeAlias = (
    RegisterAck | RegisterRefused | ShardHome | HostShard | BeginHandOff | HandOff
)
"""What the coordinator sends regions."""

COORDINATOR_COMMANDS = (
    Register,
    RegisterProxy,
    GetShardHome,
    ShardStarted,
    BeginHandOffAck,
    ShardStopped,
    GracefulShutdownReq,
    RegionStopped,
)
