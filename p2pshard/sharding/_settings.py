"""Defaults of cluster sharding: the role of Akka's ``pekko.cluster.sharding`` section.

Every field says its default and meaning; values are checked when the object is built. The
fields land with the parts of sharding that use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from membership import ConfigurationError
from membership.internal import in_range


def _one_of(*choices: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise ConfigurationError(
                f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be one "
                f"of {', '.join(map(repr, choices))}"
            )

    return check


@attrs.frozen(kw_only=True)
class ShardingSettings:
    """How an entity type's coordinator and regions behave."""

    rebalance_interval: float = attrs.field(default=10.0, validator=in_range(0.01, 86400.0))
    """Seconds between the coordinator's rebalance rounds (default 10)."""

    shard_start_timeout: float = attrs.field(default=10.0, validator=in_range(0.01, 86400.0))
    """Seconds before the coordinator resends HostShard to a region that has not answered
    ShardStarted (default 10)."""

    handoff_timeout: float = attrs.field(default=60.0, validator=in_range(0.01, 86400.0))
    """Seconds a hand-off may take before the coordinator gives it up (default 60). The region
    stops entities that have not stopped by force after three quarters of it, so the shard
    still moves."""

    min_nr_of_members: int = attrs.field(default=1, validator=in_range(1, 1 << 16, integer=True))
    """Regions that must have registered before the first shard is allocated (default 1)."""

    remember_entities: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    """Restart a shard's entities wherever it goes next (default off)."""

    entity_recovery_strategy: str = attrs.field(default="all", validator=_one_of("all", "constant"))
    """How a shard restarts its remembered entities: ``"all"`` at once (default) or
    ``"constant"``: ``entity_recovery_constant_rate_number_of_entities`` every
    ``entity_recovery_constant_rate_frequency`` seconds."""

    entity_recovery_constant_rate_frequency: float = attrs.field(
        default=0.1, validator=in_range(0.001, 3600.0)
    )
    """Seconds between batches of the ``"constant"`` recovery (default 0.1)."""

    entity_recovery_constant_rate_number_of_entities: int = attrs.field(
        default=5, validator=in_range(1, 1 << 30, integer=True)
    )
    """Entities per batch of the ``"constant"`` recovery (default 5)."""

    use_lease: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Each shard holds the lease ``<cluster>-shard-<type>-<shard>`` of the node's lease backend
    while its entities run (Akka's ``use-lease``; default off). The node needs a ``[lease]``
    backend; see ``p2pshard.leases._lease``."""

    coordinator_use_lease: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    """The coordinator singleton holds the lease ``<cluster>-singleton-sharding/<type>`` while it
    runs (Akka's singleton ``use-lease``; default off)."""

    down_removal_margin: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(in_range(0.0, 3600.0)),
    )
    """Seconds the coordinator waits, after a region's node was downed, before it moves that
    region's shards elsewhere (Akka's ``down-removal-margin``): the downed node may still be
    running them, on the far side of a partition, until its own split brain resolver decides.
    None (default): the split brain resolver's ``stable_after`` for an entity type without shard
    leases, 0 with them (a lease keeps a shard from running twice). A node that leaves
    gracefully hands its shards off, with no margin."""

    lease_retry_interval: float = attrs.field(default=5.0, validator=in_range(0.01, 3600.0))
    """Seconds between a shard's attempts to take its lease at most, when the entity type uses
    shard leases (default 5). After a refusal the first attempts come sooner: 1/16 of it later,
    then doubling (a lease is usually refused in a failover while its old owner gives it back)."""

    buffer_size: int = attrs.field(default=100_000, validator=in_range(0, 1 << 30, integer=True))
    """Messages a region holds for shards whose home it does not know yet, over all shards
    (default 100,000). Past it a tell is dropped (logged, counted) and an ask fails at once."""

    retry_interval: float = attrs.field(default=2.0, validator=in_range(0.01, 3600.0))
    """Seconds between a region's retries of Register and of GetShardHome for shards it buffers
    for (default 2). Registration starts faster and backs off up to this."""

    entity_restart_backoff: float = attrs.field(default=10.0, validator=in_range(0.0, 3600.0))
    """Seconds before an entity whose ``receive`` raised is started again; messages that come
    meanwhile wait for it (default 10)."""

    passivate_idle_after: float | None = attrs.field(
        default=120.0,
        validator=attrs.validators.optional(in_range(0.01, 1e9)),  # type: ignore[arg-type]
    )
    """Seconds without a message after which an entity is passivated; None turns idle
    passivation off (default 120)."""

    active_entity_limit: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(in_range(1, 1 << 40, integer=True))
    )
    """Most entities a region keeps active; the least recently used is passivated to make room
    for a new one. None means no limit (default)."""

    write_majority_plus: int = attrs.field(default=3, validator=in_range(0, 1 << 16, integer=True))
    """Replicas beyond a majority that confirm each write of the coordinator's state
    (default 3, as Akka's ``coordinator-state.write-majority-plus``)."""

    read_majority_plus: int = attrs.field(default=5, validator=in_range(0, 1 << 16, integer=True))
    """Replicas beyond a majority that answer the coordinator's first read (default 5)."""

    majority_min_cap: int = attrs.field(default=5, validator=in_range(1, 1 << 16, integer=True))
    """The least number of replicas in a majority, when the cluster is small (default 5)."""

    state_timeout: float = attrs.field(default=5.0, validator=in_range(0.01, 3600.0))
    """Seconds one read or write of the coordinator's state may take before it is retried
    (default 5)."""
