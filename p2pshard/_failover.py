"""Failover profiles: the timing settings that decide how soon a lost node's shards answer again.

Theory of operation. When a node is killed or cut off, each of its shards answers again on
another node only after a chain of steps, and each step is bounded by a setting:

1. *Detection.* The other nodes stop getting its heartbeat replies; their phi accrual detectors
   call it unavailable about ``heartbeat_interval + acceptable_heartbeat_pause`` plus a few
   standard deviations after the last reply (:meth:`FailoverProfile.detection_time`), looked at
   every ``unreachable_nodes_reaper_interval``.
2. *Downing.* The split brain resolver on the leader waits until nothing changed for
   ``stable_after`` (it looks once a second), then downs the node; a node cut off downs itself
   the same way, on its side.
3. *Re-allocation.* The shard coordinator learns of the Down (gossip, ``gossip_interval``) and
   deallocates the node's shards; a region holding messages for one of them asks for a new home
   (again every ``ShardingSettings.retry_interval`` while unanswered).
4. *The lease.* The new home takes the shard's lease. A killed node's lease ends ``ttl`` after
   its last renewal; a node that was cut off from the others but not from the lease store gives
   its leases back once it downed itself and its entities stopped, which can be a moment after
   the others saw it Down. A refused attempt is made again 1/16 of
   ``ShardingSettings.lease_retry_interval`` later, then twice as long each time, up to it.
5. *Recovery.* The entity reads its events from the journal and answers.

:meth:`FailoverProfile.defaults` is what ``NodeConfig()`` and ``ShardingSettings()`` give: about
30 s, most of it ``stable_after`` (20 s, Akka's default, sized for clusters of up to about a
hundred nodes on any network). :data:`FAST_LAN` is a profile for a small cluster (up to ten or
so nodes) on one LAN, whose failover takes a few seconds: it detects in under 2 s, waits 1 s of
stability, keeps leases of 3 s, and retries every half second (``docs/operations.md`` has both
profiles side by side, and what ``benchmarks/failover.py`` measured). It is checked by the settings'
own validation (:meth:`FailoverProfile.apply` builds a :class:`~p2pshard.NodeConfig`, which
refuses a ``stable_after`` shorter than the spread of the detections of one partition, and a
:class:`~p2pshard.LeaseSettings` that could not retry a renewal before its deadline) and by the
chaos suite's seeds run with it (``p2pshard chaos --profile fast-lan``).

A profile sets only the fields it names: :meth:`FailoverProfile.apply` keeps everything else of
the configuration (the lease backend and path among them), :meth:`FailoverProfile.sharding` of
the sharding settings, and :meth:`FailoverProfile.toml` writes the tables to put in node.toml.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from membership import (
    ClusterSettings,
    ConfigurationError,
    FailureDetectorSettings,
    SplitBrainResolverSettings,
)
from membership.internal import in_range, phi

from ._config import NodeConfig
from .leases._lease import LeaseSettings
from .sharding._settings import ShardingSettings


def _check_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ConfigurationError(
            f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be a "
            "non-empty name without spaces, such as 'fast-lan'"
        )


def _seconds(low: float = 0.001) -> Any:
    return in_range(low, 3600.0)


@attrs.frozen(kw_only=True)
class FailoverProfile:
    """The settings that together decide how long a lost node's shards stay unavailable.

    Apply one to a configuration with :meth:`apply` (and to an entity type's sharding settings
    with :meth:`sharding`), or copy :meth:`toml` into node.toml. The node configuration it
    makes is validated like any other, so a profile that would be unsafe fails there.

    Example:
        >>> from pathlib import Path
        >>> from p2pshard import NodeConfig, TlsFiles
        >>> tls = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))
        >>> config = FAST_LAN.apply(NodeConfig(cluster_name="shop", node_name="n1", tls=tls))
        >>> config.split_brain_resolver.stable_after
        1.5
        >>> FAST_LAN.sharding().lease_retry_interval
        0.5
    """

    name: str = attrs.field(validator=_check_name)
    """What the profile is called (``default``, ``fast-lan``)."""

    heartbeat_interval: float = attrs.field(validator=_seconds())
    """``[failure_detector] heartbeat_interval`` (also its ``first_heartbeat_estimate``)."""

    acceptable_heartbeat_pause: float = attrs.field(validator=in_range(0.0, 3600.0))
    """``[failure_detector] acceptable_heartbeat_pause``: silence tolerated before phi climbs."""

    threshold: float = attrs.field(validator=in_range(0.001, 1000.0))
    """``[failure_detector] threshold``: phi at which a node counts as unavailable."""

    expected_response_after: float = attrs.field(validator=_seconds())
    """``[failure_detector] expected_response_after``."""

    unreachable_nodes_reaper_interval: float = attrs.field(validator=_seconds())
    """``[failure_detector] unreachable_nodes_reaper_interval``: how often detectors are read."""

    gossip_interval: float = attrs.field(validator=_seconds())
    """``[cluster] gossip_interval``: how fast a Down reaches every node."""

    leader_actions_interval: float = attrs.field(validator=_seconds())
    """``[cluster] leader_actions_interval``: how soon the leader removes a downed member."""

    stable_after: float = attrs.field(validator=in_range(0.0, 3600.0))
    """``[split_brain_resolver] stable_after``."""

    lease_ttl: float = attrs.field(validator=_seconds(0.1))
    """``[lease] ttl``: how long a killed node's shard leases outlive it at most."""

    lease_renew_interval: float = attrs.field(validator=_seconds(0.01))
    """``[lease] renew_interval``."""

    lease_operation_timeout: float = attrs.field(validator=_seconds(0.01))
    """``[lease] operation_timeout``."""

    lease_safety_margin: float = attrs.field(validator=in_range(0.0, 1800.0))
    """``[lease] safety_margin``."""

    lease_retry_interval: float = attrs.field(validator=_seconds(0.01))
    """``ShardingSettings.lease_retry_interval``: how soon a shard asks again for a lease that
    its old home still held."""

    retry_interval: float = attrs.field(validator=_seconds(0.01))
    """``ShardingSettings.retry_interval``: how soon a region asks again for a shard's home."""

    state_timeout: float = attrs.field(validator=_seconds(0.01))
    """``ShardingSettings.state_timeout``: how long the coordinator's write that deallocates a
    lost node's shards may wait before it is tried again. Its first try, made when the node is
    downed, waits out this whole time: the downed member still counts as a replica until the
    leader removes it, and it never answers."""

    def __attrs_post_init__(self) -> None:
        self.lease_settings(LeaseSettings())  # a lease timing that cannot work fails here

    @classmethod
    def defaults(cls) -> FailoverProfile:
        """The profile of the defaults: what ``NodeConfig()`` and ``ShardingSettings()`` give."""
        fd, cluster = FailureDetectorSettings(), ClusterSettings()
        sbr, lease, sharding = SplitBrainResolverSettings(), LeaseSettings(), ShardingSettings()
        return cls(
            name="default",
            heartbeat_interval=fd.heartbeat_interval,
            acceptable_heartbeat_pause=fd.acceptable_heartbeat_pause,
            threshold=fd.threshold,
            expected_response_after=fd.expected_response_after,
            unreachable_nodes_reaper_interval=fd.unreachable_nodes_reaper_interval,
            gossip_interval=cluster.gossip_interval,
            leader_actions_interval=cluster.leader_actions_interval,
            stable_after=sbr.stable_after,
            lease_ttl=lease.ttl,
            lease_renew_interval=lease.renew_interval,
            lease_operation_timeout=lease.operation_timeout,
            lease_safety_margin=lease.safety_margin,
            lease_retry_interval=sharding.lease_retry_interval,
            retry_interval=sharding.retry_interval,
            state_timeout=sharding.state_timeout,
        )

    def apply(self, config: NodeConfig) -> NodeConfig:
        """``config`` with this profile's membership and lease timing; everything else kept.

        Raises:
            membership.ConfigurationError: the result is not a valid configuration (the
                message names the field and the rule).
        """
        return attrs.evolve(
            config,
            failure_detector=self.failure_detector(config.failure_detector),
            cluster=attrs.evolve(
                config.cluster,
                gossip_interval=self.gossip_interval,
                leader_actions_interval=self.leader_actions_interval,
            ),
            split_brain_resolver=attrs.evolve(
                config.split_brain_resolver, stable_after=self.stable_after
            ),
            lease=self.lease_settings(config.lease),
        )

    def failure_detector(self, settings: FailureDetectorSettings) -> FailureDetectorSettings:
        """``settings`` with this profile's detector timing."""
        return attrs.evolve(
            settings,
            heartbeat_interval=self.heartbeat_interval,
            first_heartbeat_estimate=self.heartbeat_interval,
            acceptable_heartbeat_pause=self.acceptable_heartbeat_pause,
            threshold=self.threshold,
            expected_response_after=self.expected_response_after,
            unreachable_nodes_reaper_interval=self.unreachable_nodes_reaper_interval,
        )

    def lease_settings(self, settings: LeaseSettings) -> LeaseSettings:
        """``settings`` (backend, path, endpoints) with this profile's lease timing."""
        return attrs.evolve(
            settings,
            ttl=self.lease_ttl,
            renew_interval=self.lease_renew_interval,
            operation_timeout=self.lease_operation_timeout,
            safety_margin=self.lease_safety_margin,
        )

    def sharding(self, settings: ShardingSettings | None = None) -> ShardingSettings:
        """``settings`` (default ``ShardingSettings()``) with this profile's retries."""
        return attrs.evolve(
            settings or ShardingSettings(),
            lease_retry_interval=self.lease_retry_interval,
            retry_interval=self.retry_interval,
            state_timeout=self.state_timeout,
        )

    def detection_time(self) -> float:
        """Seconds from a node's last heartbeat reply until it is found unavailable.

        For a steady history (every interval ``heartbeat_interval``, so the detector's
        ``min_std_deviation`` of 0.1 s applies): where phi reaches ``threshold``. Reading the
        detectors every ``unreachable_nodes_reaper_interval`` adds up to that much.
        """
        mean = self.heartbeat_interval + self.acceptable_heartbeat_pause
        std = FailureDetectorSettings().min_std_deviation
        low, high = 0.0, mean + 100 * std
        while phi(high, mean, std) < self.threshold:
            high *= 2
        for _ in range(60):  # phi increases with the silence: bisect
            middle = (low + high) / 2
            low, high = (middle, high) if phi(middle, mean, std) < self.threshold else (low, middle)
        return high

    def floor(self) -> float:
        """The least time a lost node's shards are unavailable: detection and ``stable_after``.

        Failover takes longer by the resolver's check (once a second), the gossip of the Down,
        the coordinator's majority writes, the lease (:attr:`lease_ttl` after a kill, at most)
        and the entity's recovery.
        """
        return self.detection_time() + self.stable_after

    def toml(self) -> str:
        """The node.toml tables of this profile (to add to a file that has none of them)."""
        values = {
            "cluster": {
                "gossip_interval": self.gossip_interval,
                "leader_actions_interval": self.leader_actions_interval,
            },
            "failure_detector": {
                "heartbeat_interval": self.heartbeat_interval,
                "first_heartbeat_estimate": self.heartbeat_interval,
                "acceptable_heartbeat_pause": self.acceptable_heartbeat_pause,
                "threshold": self.threshold,
                "expected_response_after": self.expected_response_after,
                "unreachable_nodes_reaper_interval": self.unreachable_nodes_reaper_interval,
            },
            "split_brain_resolver": {"stable_after": self.stable_after},
            "lease": {
                "ttl": self.lease_ttl,
                "renew_interval": self.lease_renew_interval,
                "operation_timeout": self.lease_operation_timeout,
                "safety_margin": self.lease_safety_margin,
            },
        }
        tables = [
            "\n".join([f"[{table}]", *(f"{key} = {_toml_float(v)}" for key, v in fields.items())])
            for table, fields in values.items()
        ]
        return "\n\n".join(tables) + "\n"


def _toml_float(value: float) -> str:
    if not math.isfinite(value):
        raise ValueError(f"{value!r} has no TOML form here")
    return repr(float(value))


FAST_LAN = FailoverProfile(
    name="fast-lan",
    heartbeat_interval=0.25,
    acceptable_heartbeat_pause=1.0,
    threshold=8.0,
    expected_response_after=0.25,
    unreachable_nodes_reaper_interval=0.25,
    gossip_interval=0.25,
    leader_actions_interval=0.25,
    stable_after=1.0,
    lease_ttl=3.0,
    lease_renew_interval=0.5,
    lease_operation_timeout=1.0,
    lease_safety_margin=0.5,
    lease_retry_interval=0.5,
    retry_interval=0.5,
    state_timeout=0.25,
)
"""Failover in a few seconds, for a small cluster (up to about ten nodes) on one LAN.

Heartbeats every 0.25 s and 1 s of silence tolerated find a node gone about 1.8 s after its last
reply; the split brain resolver then waits 1 s of stability (gossip and the leader's actions
every 0.25 s); a killed node's shard leases end at most 3 s after it died (renewed every 0.5 s);
shards and regions ask again every 0.5 s, and the coordinator tries a write again after 0.25 s.
A node that stalls for more than about 1.5 s (a long garbage collection, a starved CPU) is found
unreachable, and one silent for about 3 s is downed: keep the defaults where that happens."""

FAILOVER_PROFILES: dict[str, FailoverProfile] = {
    "default": FailoverProfile.defaults(),
    FAST_LAN.name: FAST_LAN,
}
"""Every named profile: ``default`` and ``fast-lan``."""
