"""ClusterSettings: joining, seed nodes, gossip and the leader's timing (``pekko.cluster``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from .transport._errors import ConfigurationError
from .transport._settings import in_range


def check_roles(value: Iterable[str]) -> frozenset[str]:
    """The roles as a frozen set, each checked to be a valid name."""
    roles = frozenset(value)
    for role in roles:
        if not isinstance(role, str) or not role or "," in role or role != role.strip():
            raise ConfigurationError(
                f"roles contain {role!r}: roles are non-empty strings without "
                "commas or surrounding spaces"
            )
    return roles


def _per_role(value: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    pairs = []
    for role, count in value:
        check_roles([role])
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigurationError(
                f"ClusterSettings.min_nr_of_members_of_role[{role!r}] = {count!r} is invalid: "
                "must be an integer of at least 1"
            )
        pairs.append((role, count))
    return tuple(sorted(pairs))


def _optional_seconds(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        in_range(0.0, 3600.0)(instance, attribute, value)


@attrs.frozen(kw_only=True)
class ClusterSettings:
    """How the membership protocol behaves (Akka's ``pekko.cluster`` defaults)."""

    gossip_interval: float = attrs.field(default=1.0, validator=in_range(0.001, 60))
    """Seconds between gossip rounds (default 1)."""

    leader_actions_interval: float = attrs.field(default=1.0, validator=in_range(0.001, 60))
    """Seconds between the leader's moves of members (default 1)."""

    seed_node_timeout: float = attrs.field(default=5.0, validator=in_range(0.001, 3600))
    """How long the first seed waits for other seeds before forming the cluster (default 5 s)."""

    own_seed_listen: float = attrs.field(default=2.0, validator=in_range(0.0, 3600))
    """How long a node whose only seed node is itself listens before it forms its cluster
    (default 2 s; 0: at once). A running cluster of its name probes it meanwhile if it was
    restarted while that cluster went on, and it joins that one instead of forming a second."""

    seed_node_retry_interval: float = attrs.field(default=1.0, validator=in_range(0.001, 60))
    """Seconds between InitJoin rounds to the seed nodes (default 1)."""

    retry_unsuccessful_join_after: float = attrs.field(
        default=10.0, validator=in_range(0.001, 3600)
    )
    """Resend Join when no Welcome came after this many seconds (default 10)."""

    weakly_up_after: float | None = attrs.field(default=7.0, validator=_optional_seconds)
    """Move reachable Joining members to WeaklyUp after this long without convergence
    (default 7 s; None turns WeaklyUp off)."""

    min_nr_of_members: int = attrs.field(default=1, validator=in_range(1, 10_000, integer=True))
    """The leader moves nobody to Up before this many members joined (default 1)."""

    min_nr_of_members_of_role: tuple[tuple[str, int], ...] = attrs.field(
        default=(), converter=_per_role
    )
    """The same, per role: ``(("backend", 2),)`` (default none)."""

    gossip_different_view_probability: float = attrs.field(default=0.8, validator=in_range(0, 1))
    """Chance of gossiping to a member that has not seen the current version (default 0.8)."""

    reduce_gossip_different_view_probability: int = attrs.field(
        default=400, validator=in_range(1, 1_000_000, integer=True)
    )
    """Above this cluster size that chance is reduced, as in Akka (default 400)."""

    prune_gossip_tombstones_after: float = attrs.field(
        default=24 * 3600.0, validator=in_range(1, 365 * 24 * 3600)
    )
    """Forget removed incarnations after this many seconds (default 24 h)."""

    seed_probe_interval: float = attrs.field(default=5.0, validator=in_range(0.001, 3600))
    """Seconds between a member's InitJoin probes to the seed addresses where its cluster has
    no live member (none in a healthy cluster), to find a second cluster of the same name and
    merge it (default 5 s; not in Akka). A foreign cluster is acted on after two probe rounds in
    a row saw it."""
