"""Extractors: which entity a message is for, and which shard that entity lives in.

Akka asks the application for two functions: the entity id of a message, and the shard id of an
entity id. Every node of the cluster must compute the same shard for the same entity, so
:class:`HashExtractor` hashes with BLAKE2b, never with Python's ``hash()``, which is salted per
process. Messages are either the application's own (the extractor reads the entity id from them)
or wrapped in a :class:`ShardingEnvelope`, which is what ``region.entity_ref(id).tell(...)`` sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import attrs

from membership import ConfigurationError, message
from membership.internal import in_range

from ._allocation import EntityId, ShardId


def _check_entity_id(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"entity_id {value!r} is invalid: entity ids are non-empty strings")
    if not value:
        raise ValueError("entity_id '' is invalid: entity ids are non-empty strings")


@message(name="p2pshard.sharding.ShardingEnvelope")
@attrs.frozen(kw_only=True)
class ShardingEnvelope:
    """A message for the entity ``entity_id``: the envelope style of addressing."""

    entity_id: str = attrs.field(validator=_check_entity_id)
    message: object


class MessageExtractor(Protocol):
    """The application's two functions (Akka's ``extractEntityId`` and ``extractShardId``)."""

    @property
    def number_of_shards(self) -> int:
        """How many shards there are; every node must agree (the coordinator checks)."""
        ...

    def entity_id(self, message: object) -> EntityId | None:
        """The entity ``message`` is for, or None when this extractor does not handle it."""
        ...

    def entity_message(self, message: object) -> object:
        """What the entity receives for ``message`` (an envelope's content, say)."""
        ...

    def shard_id(self, entity_id: EntityId) -> ShardId:
        """The shard of ``entity_id``: the same on every node, for as long as the cluster runs."""
        ...


def stable_shard(entity_id: str, number_of_shards: int) -> ShardId:
    """``entity_id``'s shard among ``number_of_shards``, the same in every process.

    Example:
        >>> stable_shard("user-42", 100)
        '98'
    """
    if number_of_shards < 1:
        raise ValueError(f"number_of_shards {number_of_shards} is invalid: must be at least 1")
    digest = hashlib.blake2b(entity_id.encode(), digest_size=8).digest()
    return ShardId(str(int.from_bytes(digest, "big") % number_of_shards))


def _envelope_entity_id(message: object) -> EntityId | None:
    return EntityId(message.entity_id) if isinstance(message, ShardingEnvelope) else None


@attrs.frozen
class HashExtractor:
    """Shards by a stable hash of the entity id; entity ids from envelopes unless told otherwise.

    Example:
        >>> extractor = HashExtractor(100)
        >>> extractor.shard_id(EntityId("user-42"))
        '98'
        >>> extractor.entity_id(ShardingEnvelope(entity_id="user-42", message="hi"))
        'user-42'
    """

    number_of_shards: int = attrs.field(validator=in_range(1, 1 << 20, integer=True))
    """How many shards (Akka suggests ten times the largest number of nodes planned)."""

    entity_id_of: Callable[[object], EntityId | None] = attrs.field(
        default=_envelope_entity_id, kw_only=True
    )
    """Reads the entity id from an application message (default: envelopes only)."""

    def entity_id(self, message: object) -> EntityId | None:
        """The entity ``message`` is for, or None when it is not for an entity."""
        if isinstance(message, ShardingEnvelope):
            return EntityId(message.entity_id)
        entity_id = self.entity_id_of(message)
        if entity_id is not None and (not isinstance(entity_id, str) or not entity_id):
            raise ConfigurationError(
                f"the extractor gave entity id {entity_id!r} for a {type(message).__name__}: "
                "entity ids are non-empty strings"
            )
        return entity_id

    def entity_message(self, message: object) -> object:
        """An envelope's content; any other message as it is."""
        return message.message if isinstance(message, ShardingEnvelope) else message

    def shard_id(self, entity_id: EntityId) -> ShardId:
        """The stable hash of ``entity_id`` modulo ``number_of_shards``."""
        return stable_shard(entity_id, self.number_of_shards)
