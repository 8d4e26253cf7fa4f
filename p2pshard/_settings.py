"""Defaults of cluster sharding: the role of Akka's ``pekko.cluster.sharding`` section.

Every field says its default and meaning; values are checked when the object is built. The
fields land with the parts of sharding that use them.
"""

from __future__ import annotations

import attrs

from membership._settings import in_range


@attrs.frozen(kw_only=True)
class ShardingSettings:
    """How an entity type's coordinator and regions behave."""

    rebalance_interval: float = attrs.field(default=10.0, validator=in_range(0.01, 86400.0))
    """Seconds between the coordinator's rebalance rounds (default 10)."""

    shard_start_timeout: float = attrs.field(default=10.0, validator=in_range(0.01, 86400.0))
    """Seconds before the coordinator resends HostShard to a region that has not answered
    ShardStarted (default 10)."""

    handoff_timeout: float = attrs.field(default=60.0, validator=in_range(0.01, 86400.0))
    """Seconds a hand-off may take before it is given up (coordinator) or its entities are
    stopped by force (region) (default 60)."""

    min_nr_of_members: int = attrs.field(default=1, validator=in_range(1, 1 << 16, integer=True))
    """Regions that must have registered before the first shard is allocated (default 1)."""

    remember_entities: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    """Restart a shard's entities wherever it goes next (default off)."""
