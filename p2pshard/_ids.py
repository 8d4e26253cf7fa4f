"""The ids that sharding, leases and persistence share: of entities and of shards."""

from typing import NewType

ShardId = NewType("ShardId", str)
"""A shard's id: a string, the same for every node (see the extractors)."""

EntityId = NewType("EntityId", str)
"""An entity's id, unique within its entity type."""
