"""Shard allocation strategies, sans-IO: where a new shard goes, and which shards to move.

Theory of operation: the shard coordinator asks its strategy two things, as in Akka: on a
GetShardHome for an unallocated shard, :meth:`ShardAllocationStrategy.allocate_shard` picks the
region; every ``rebalance_interval``, :meth:`ShardAllocationStrategy.rebalance` picks shards to
hand off (they are then allocated again, one by one, through ``allocate_shard``). Regions are
named by the node that hosts them (one region per entity type per node). Both calls get the
coordinator's view of the cluster, so strategies stay pure functions of their arguments.

:class:`LeastShardAllocationStrategy` is Akka's default: allocate to the region with the fewest
shards, preferring members that are not leaving; rebalance from the fullest regions towards the
emptiest. Its newer algorithm (used when ``rebalance_absolute_limit > 0``) moves, in one round,
every shard above the optimal count ``ceil(shards / regions)`` up to the smaller of the two
limits, and once no region is above optimal, single shards towards regions two or more below it;
the legacy algorithm (``rebalance_absolute_limit = 0``) moves up to ``rebalance_threshold``
shards from the fullest to the emptiest region when they differ by more than the threshold, with
at most ``max_simultaneous_rebalance`` in flight. Neither rebalances while any member is
unreachable, joining or weakly up (the hand-off needs every region's acknowledgement, and a
joining node will soon want shards too), nor while a rebalance is in progress (newer algorithm).
Ties break on the region's address, so every coordinator decides the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import attrs

from membership import AppVersion, MemberStatus, UniqueAddress
from membership.internal import in_range, node_order

from .._ids import EntityId as EntityId
from .._ids import ShardId as ShardId

Allocations = Mapping[UniqueAddress, Sequence[ShardId]]
"""Each region (by its node) and the shards allocated to it, in allocation order."""

_LEAVING = frozenset(
    {MemberStatus.LEAVING, MemberStatus.EXITING, MemberStatus.DOWN, MemberStatus.REMOVED}
)
_JOINING = frozenset({MemberStatus.JOINING, MemberStatus.WEAKLY_UP})


@attrs.frozen
class ClusterView:
    """What a strategy may know of the cluster.

    Member statuses, who is unreachable, and each member's ``app_version``.
    """

    members: Mapping[UniqueAddress, MemberStatus] = attrs.field(factory=dict)
    unreachable: frozenset[UniqueAddress] = frozenset()
    app_versions: Mapping[UniqueAddress, str] = attrs.field(factory=dict)
    """Each member's ``app_version`` (a member missing here counts as the empty version)."""

    def app_version(self, node: UniqueAddress) -> AppVersion:
        """``node``'s application version, ordered (the empty version if not known)."""
        return AppVersion.parse(self.app_versions.get(node, ""))

    def one_app_version(self, nodes: Iterable[UniqueAddress]) -> bool:
        """Whether every one of ``nodes`` runs the same application version (no rollout)."""
        nodes = list(nodes)
        # Equal texts are equal versions: parsed only when they differ (the coordinator asks
        # this for every allocation, with every region).
        if len({self.app_versions.get(node, "") for node in nodes}) <= 1:
            return True
        return len({self.app_version(node) for node in nodes}) <= 1

    def good_time_to_rebalance(self) -> bool:
        """No member unreachable, joining or weakly up (Akka's ``isAGoodTimeToRebalance``)."""
        return not self.unreachable and not any(s in _JOINING for s in self.members.values())

    def is_leaving(self, node: UniqueAddress) -> bool:
        """Whether ``node`` is on its way out (Leaving, Exiting, Down or Removed)."""
        return self.members.get(node) in _LEAVING


class ShardAllocationStrategy(Protocol):
    """Decides shard homes for the coordinator. Implementations must be deterministic."""

    def allocate_shard(
        self,
        requester: UniqueAddress,
        shard_id: ShardId,
        current: Allocations,
        cluster: ClusterView,
    ) -> UniqueAddress:
        """The region (one of ``current``'s keys) to host ``shard_id``.

        ``requester`` is the region that asked; ``current`` holds every registered region, with
        an empty sequence for a region without shards.
        """
        ...

    def rebalance(
        self, current: Allocations, in_progress: frozenset[ShardId], cluster: ClusterView
    ) -> frozenset[ShardId]:
        """Shards to hand off now (maybe none); ``in_progress`` are being handed off already."""
        ...


def _check_relative(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    in_range(0.0, 1.0)(instance, attribute, value)


@attrs.frozen(kw_only=True)
class LeastShardAllocationStrategy:
    """Akka's default strategy: fewest shards first; rebalance from the fullest regions.

    The newer algorithm is the default, with limits that let a node that joins get its share
    within two rebalance rounds (15% of all shards may move per round). Set
    ``rebalance_absolute_limit=0`` for Akka's legacy algorithm (``rebalance_threshold``,
    ``max_simultaneous_rebalance``), or lower the limits for gentler, slower rebalancing.

    Example:
        >>> strategy = LeastShardAllocationStrategy(rebalance_absolute_limit=20)
        >>> strategy.rebalance_relative_limit
        0.15
    """

    rebalance_absolute_limit: int = attrs.field(
        default=1000, validator=in_range(0, 1 << 30, integer=True)
    )
    """Most shards moved in one round by the newer algorithm (default 1000); 0 selects the
    legacy algorithm."""

    rebalance_relative_limit: float = attrs.field(default=0.15, validator=_check_relative)
    """Most shards moved in one round by the newer algorithm, as a fraction of all shards
    (default 0.15; Akka's 0.1 takes three rounds to fill a fourth node)."""

    rebalance_threshold: int = attrs.field(default=1, validator=in_range(1, 1 << 30, integer=True))
    """Legacy: rebalance when the fullest region has more than this many shards over the
    emptiest; moves up to this many in one round."""

    max_simultaneous_rebalance: int = attrs.field(
        default=3, validator=in_range(1, 1 << 30, integer=True)
    )
    """Legacy: most shards being handed off at once."""

    def allocate_shard(
        self,
        requester: UniqueAddress,
        shard_id: ShardId,
        current: Allocations,
        cluster: ClusterView,
    ) -> UniqueAddress:
        """The region with the fewest shards among members not leaving (if there are any).

        Unlike Akka, a region whose member is unreachable is chosen only when every region's is:
        a shard allocated there could not start until the partition heals.
        """
        if not current:
            raise ValueError(f"no region to allocate shard {shard_id!r} to")
        return min(
            current.items(),
            key=lambda item: (
                cluster.is_leaving(item[0]),
                item[0] in cluster.unreachable,
                len(item[1]),
                node_order(item[0]),
            ),
        )[0]

    def rebalance(
        self, current: Allocations, in_progress: frozenset[ShardId], cluster: ClusterView
    ) -> frozenset[ShardId]:
        """Shards to move this round (see the module docstring)."""
        if not current or not cluster.good_time_to_rebalance():
            return frozenset()
        if self.rebalance_absolute_limit > 0:
            return self._rebalance(current, in_progress, cluster)
        return self._rebalance_legacy(current, in_progress, cluster)

    def _sorted(
        self, current: Allocations, cluster: ClusterView
    ) -> list[tuple[UniqueAddress, Sequence[ShardId]]]:
        return sorted(
            current.items(),
            key=lambda item: (cluster.is_leaving(item[0]), len(item[1]), node_order(item[0])),
        )

    def _rebalance(
        self, current: Allocations, in_progress: frozenset[ShardId], cluster: ClusterView
    ) -> frozenset[ShardId]:
        if in_progress:
            return frozenset()  # one round at a time
        entries = self._sorted(current, cluster)
        shards = sum(len(ids) for _, ids in entries)
        # Only regions that stay receive shards (allocate_shard skips leaving ones), so only
        # they set the optimum; a leaving region's shards are all surplus. Counting leaving
        # regions in, as Akka does, hands shards back to the region they came from.
        entries = [(r, ids) for r, ids in entries if not cluster.is_leaving(r)]
        leaving = [ids for r, ids in current.items() if cluster.is_leaving(r)]
        if shards == 0 or not entries:
            return frozenset()
        optimal = math.ceil(shards / len(entries))
        limit = max(
            1, min(int(self.rebalance_relative_limit * shards), self.rebalance_absolute_limit)
        )
        selected: list[ShardId] = [s for ids in leaving for s in sorted(ids)]
        for _, ids in entries:
            if len(ids) > optimal:
                selected.extend(ids[: len(ids) - optimal])
        if selected:
            return frozenset(selected[:limit])
        # Rounded up, "optimal" can leave one region two or more below it: move single shards.
        below = sum(max(0, optimal - 1 - len(ids)) for _, ids in entries)
        if below == 0:
            return frozenset()
        heads = [ids[0] for _, ids in entries if len(ids) >= optimal]
        return frozenset(heads[: min(below, limit)])

    def _rebalance_legacy(
        self, current: Allocations, in_progress: frozenset[ShardId], cluster: ClusterView
    ) -> frozenset[ShardId]:
        room = self.max_simultaneous_rebalance - len(in_progress)
        if room <= 0:
            return frozenset()
        entries = self._sorted(current, cluster)
        least = len(entries[0][1])
        movable = [[s for s in ids if s not in in_progress] for _, ids in entries]
        most = max(movable, key=len)  # the first of the fullest, in the sorted order
        difference = len(most) - least
        if difference <= self.rebalance_threshold:
            return frozenset()
        count = min(difference - self.rebalance_threshold, self.rebalance_threshold, room)
        return frozenset(sorted(most)[:count])
