"""LeastShardAllocationStrategy: Pekko's LeastShardAllocationStrategySpec examples, the legacy
algorithm, settings validation, and randomized convergence in the style of Pekko's
LeastShardAllocationStrategyRandomizedSpec.

Regions A, B, C are nodes 10.0.0.1:1, :2, :3; ``allocations(a, b, c)`` gives them consecutive
shards "001", "002", ... in that order, as Pekko's ``createAllocations`` does. Every expected
result below is derived by hand from the algorithm (see the comments), not copied from a run.

Hypothesis tests print a ``@reproduce_failure`` blob when they fail; paste it above the test to
re-run that exact case.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from membership import Address, ConfigurationError, MemberStatus, UniqueAddress
from p2pshard.sharding._allocation import ClusterView, LeastShardAllocationStrategy, ShardId

fast = settings(max_examples=60, deadline=None, print_blob=True)


def region(port: int, *, host: str = "10.0.0.1", uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address(host, port), f"node-{port}", uid)


A, B, C, D = region(1), region(2), region(3), region(4)
SHARDS = [ShardId(f"{n:03d}") for n in range(1, 1000)]

Current = dict[UniqueAddress, list[ShardId]]

UNLIMITED = LeastShardAllocationStrategy(
    rebalance_absolute_limit=1000, rebalance_relative_limit=1.0
)
LEAVING_STATUSES = [MemberStatus.LEAVING, MemberStatus.EXITING, MemberStatus.DOWN]


def allocations(*counts: int) -> Current:
    """Regions A, B, C, ... with ``counts`` shards each, numbered consecutively."""
    result: Current = {}
    start = 0
    for i, count in enumerate(counts):
        result[region(i + 1)] = SHARDS[start : start + count]
        start += count
    return result


def up(nodes: Iterable[UniqueAddress], **statuses: MemberStatus) -> ClusterView:
    """Every node in ``nodes`` Up, except those named by port in ``statuses`` (``p2=LEAVING``)."""
    members = {node: MemberStatus.UP for node in nodes}
    for key, status in statuses.items():
        members[region(int(key[1:]))] = status
    return ClusterView(members=members)


def after_rebalance(
    strategy: LeastShardAllocationStrategy,
    current: Mapping[UniqueAddress, Sequence[ShardId]],
    moved: frozenset[ShardId],
    cluster: ClusterView,
    order: Sequence[ShardId] | None = None,
) -> Current:
    """Pekko's ``afterRebalance``: take the moved shards off, then allocate them one by one."""
    result = {node: [s for s in ids if s not in moved] for node, ids in current.items()}
    for shard in sorted(moved) if order is None else order:
        home = strategy.allocate_shard(A, shard, result, cluster)
        result[home].append(shard)
    return result


def ids(*names: str) -> frozenset[ShardId]:
    return frozenset(ShardId(name) for name in names)


def counts(current: Mapping[UniqueAddress, Sequence[ShardId]]) -> list[int]:
    return [len(ids) for ids in current.values()]


# --- allocate_shard ---------------------------------------------------------------------------


def test_allocate_to_region_with_fewest_shards() -> None:
    current = allocations(1, 1, 0)
    assert UNLIMITED.allocate_shard(A, ShardId("003"), current, up(current)) == C
    current = allocations(3, 1, 2)
    assert UNLIMITED.allocate_shard(A, ShardId("007"), current, up(current)) == B


@pytest.mark.parametrize("status", LEAVING_STATUSES)
def test_allocate_prefers_a_region_not_leaving_even_with_more_shards(status: MemberStatus) -> None:
    current = {A: [], B: SHARDS[:5], C: SHARDS[5:6]}
    cluster = up(current, p1=status)
    assert UNLIMITED.allocate_shard(B, ShardId("100"), current, cluster) == C
    # Pekko's "prefer least shards, non downed, leaving or exiting nodes": the leaving region
    # comes last whatever its count, the others by count.
    current = {A: [], B: SHARDS[:2], C: SHARDS[2:3], D: []}
    cluster = up(current, p1=status)
    assert UNLIMITED.allocate_shard(B, ShardId("100"), current, cluster) == D
    del current[D]
    assert UNLIMITED.allocate_shard(B, ShardId("100"), current, cluster) == C


def test_allocate_to_a_leaving_region_when_every_region_is_leaving() -> None:
    current = {A: SHARDS[:3], B: SHARDS[3:4], C: SHARDS[4:6]}
    cluster = ClusterView(
        members={A: MemberStatus.LEAVING, B: MemberStatus.EXITING, C: MemberStatus.DOWN}
    )
    assert UNLIMITED.allocate_shard(A, ShardId("100"), current, cluster) == B


def test_allocate_ties_break_on_address_whatever_the_mapping_order() -> None:
    # Same count everywhere: host first, then port, then uid (the incarnation).
    nodes = [
        region(7, host="10.0.0.2"),
        region(9, host="10.0.0.1"),
        region(8, host="10.0.0.1", uid=5),
        region(8, host="10.0.0.1", uid=3),
    ]
    expected = region(8, host="10.0.0.1", uid=3)
    for order in itertools.permutations(nodes):
        current = {node: [ShardId(f"s{i}")] for i, node in enumerate(order)}
        assert UNLIMITED.allocate_shard(order[0], ShardId("x"), current, up(order)) == expected


def test_allocate_ignores_the_requester() -> None:
    current = allocations(0, 5)
    assert UNLIMITED.allocate_shard(B, ShardId("100"), current, up(current)) == A


def test_allocate_without_regions_raises_value_error() -> None:
    with pytest.raises(ValueError, match="'042'"):
        UNLIMITED.allocate_shard(A, ShardId("042"), {}, ClusterView())


# --- rebalance, newer algorithm: Pekko's LeastShardAllocationStrategySpec --------------------


def test_rebalance_shards_1_2_0() -> None:
    # 3 shards, 3 regions: optimal = 1; B is one above, its first shard "002" moves, to C.
    current = allocations(1, 2, 0)
    moved = UNLIMITED.rebalance(current, frozenset(), up(current))
    assert moved == {"002"}
    assert counts(after_rebalance(UNLIMITED, current, moved, up(current))) == [1, 1, 1]


def test_rebalance_shards_2_0_0() -> None:
    # optimal = ceil(2/3) = 1: A gives its first shard; B and C tie at 0, B has the lower port.
    current = allocations(2, 0, 0)
    moved = UNLIMITED.rebalance(current, frozenset(), up(current))
    assert moved == {"001"}
    assert counts(after_rebalance(UNLIMITED, current, moved, up(current))) == [1, 1, 0]


def test_no_rebalance_shards_1_1_0() -> None:
    # optimal = 1: nobody above it, nobody two below it (optimal - 1 = 0).
    current = allocations(1, 1, 0)
    assert UNLIMITED.rebalance(current, frozenset(), up(current)) == frozenset()


def test_rebalance_shards_3_0_0() -> None:
    # optimal = 1: A gives "001" and "002"; allocated in order, they go to B then C.
    current = allocations(3, 0, 0)
    moved = UNLIMITED.rebalance(current, frozenset(), up(current))
    assert moved == {"001", "002"}
    after = after_rebalance(UNLIMITED, current, moved, up(current))
    assert after == {A: ["003"], B: ["001"], C: ["002"]}


def test_rebalance_shards_4_4_0() -> None:
    # optimal = ceil(8/3) = 3: A and B each give their first shard ("001", "005"), both to C.
    current = allocations(4, 4, 0)
    moved = UNLIMITED.rebalance(current, frozenset(), up(current))
    assert moved == {"001", "005"}
    assert counts(after_rebalance(UNLIMITED, current, moved, up(current))) == [3, 3, 2]


def test_rebalance_shards_4_4_2_in_phase_2() -> None:
    # optimal = ceil(10/3) = 4: nobody above it, so phase 1 selects nothing. Phase 2: C is
    # optimal - 1 - 2 = 1 below optimal - 1, so one shard moves: the head of the first region at
    # optimal in sorted order (C 2, A 4, B 4), which is A's "001". It goes to C: [3, 4, 3].
    current = allocations(4, 4, 2)
    moved = UNLIMITED.rebalance(current, frozenset(), up(current))
    assert moved == {"001"}
    assert counts(after_rebalance(UNLIMITED, current, moved, up(current))) == [3, 4, 3]


def test_rebalance_shards_5_5_0_in_two_rounds() -> None:
    # Round 1, optimal = ceil(10/3) = 4: A gives "001", B gives "006"; both go to C: [4, 4, 2].
    current = allocations(5, 5, 0)
    cluster = up(current)
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    assert moved == {"001", "006"}
    current = after_rebalance(UNLIMITED, current, moved, cluster)
    assert counts(current) == [4, 4, 2]
    # Round 2 is phase 2 (as [4, 4, 2] above): A's head is now "002".
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    assert moved == {"002"}
    current = after_rebalance(UNLIMITED, current, moved, cluster)
    assert counts(current) == [3, 4, 3]
    assert UNLIMITED.rebalance(current, frozenset(), cluster) == frozenset()


def test_rebalance_shards_50_0_50_in_two_rounds() -> None:
    # A holds "001".."050", C holds "051".."100". Round 1, optimal = ceil(100/3) = 34: A and C
    # each give their first 16 shards, all 32 go to B: [34, 32, 34].
    current = {A: SHARDS[:50], B: [], C: SHARDS[50:100]}
    cluster = up(current)
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    assert moved == set(SHARDS[:16]) | set(SHARDS[50:66])
    current = after_rebalance(UNLIMITED, current, moved, cluster)
    assert counts(current) == [34, 32, 34]
    # Round 2, phase 2: B is one below optimal - 1 = 33; sorted B, A, C, so A's head "017" moves.
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    assert moved == {"017"}
    current = after_rebalance(UNLIMITED, current, moved, cluster)
    assert counts(current) == [33, 33, 34]


def test_rebalance_phase_2_moves_as_many_as_the_deficit_within_the_limit() -> None:
    # [3, 3, 3, 0]: optimal = ceil(9/4) = 3, D is 2 below optimal - 1 = 2. Sorted D, A, B, C;
    # heads of the regions at optimal: "001", "004", "007"; two of them move, both to D.
    current = allocations(3, 3, 3, 0)
    cluster = up(current)
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    assert moved == {"001", "004"}
    assert counts(after_rebalance(UNLIMITED, current, moved, cluster)) == [2, 2, 3, 2]
    # An absolute limit of 1 allows one per round: "001" now, then B's head "004".
    one = LeastShardAllocationStrategy(rebalance_absolute_limit=1, rebalance_relative_limit=1.0)
    moved = one.rebalance(current, frozenset(), cluster)
    assert moved == {"001"}
    current = after_rebalance(one, current, moved, cluster)
    assert counts(current) == [2, 3, 3, 1]
    moved = one.rebalance(current, frozenset(), cluster)
    assert moved == {"004"}
    assert counts(after_rebalance(one, current, moved, cluster)) == [2, 2, 3, 2]


def test_rebalance_respects_absolute_limit() -> None:
    # [1, 9, 0]: optimal = ceil(10/3) = 4; B is 5 above, limit min(int(1.0 * 10), 3) = 3: B's
    # first three. They go to the emptiest in turn: C (0), then A (1, ties C at 1, lower port),
    # then C (1 < A's 2): [2, 6, 2].
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=3, rebalance_relative_limit=1.0
    )
    current = allocations(1, 9, 0)
    moved = strategy.rebalance(current, frozenset(), up(current))
    assert moved == {"002", "003", "004"}
    assert counts(after_rebalance(strategy, current, moved, up(current))) == [2, 6, 2]


def test_rebalance_respects_relative_limit() -> None:
    # As above, with limit min(int(0.3 * 10), 5) = 3.
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=5, rebalance_relative_limit=0.3
    )
    current = allocations(1, 9, 0)
    moved = strategy.rebalance(current, frozenset(), up(current))
    assert moved == {"002", "003", "004"}
    assert counts(after_rebalance(strategy, current, moved, up(current))) == [2, 6, 2]


@pytest.mark.parametrize(
    ("absolute", "relative", "expected"),
    [
        (2, 1.0, {"001", "002"}),  # min(10, 2) = 2
        (1000, 0.25, {"001", "002"}),  # min(int(2.5), 1000) = 2
        (1000, 0.05, {"001"}),  # min(int(0.5), 1000) = 0, raised to 1
        (1000, 0.0, {"001"}),  # 0, raised to 1
    ],
)
def test_rebalance_limit_is_min_of_both_and_at_least_one(
    absolute: int, relative: float, expected: set[str]
) -> None:
    # [10, 0, 0]: optimal = 4, A is 6 above; the limit decides how many of "001".."006" move.
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=absolute, rebalance_relative_limit=relative
    )
    current = allocations(10, 0, 0)
    assert strategy.rebalance(current, frozenset(), up(current)) == expected


def test_rebalance_takes_from_regions_in_sorted_order_under_a_limit() -> None:
    # [0, 7, 6] with limit 2: optimal = 5, B is 2 above, C 1 above. Sorted A (0), C (6), B (7):
    # C's first shard "008" is selected before B's "001" and "002".
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=2, rebalance_relative_limit=1.0
    )
    current = {A: [], B: SHARDS[:7], C: SHARDS[7:13]}
    assert strategy.rebalance(current, frozenset(), up(current)) == {"008", "001"}


def test_rebalance_nothing_without_shards_or_regions() -> None:
    current = allocations(0, 0, 0)
    assert UNLIMITED.rebalance(current, frozenset(), up(current)) == frozenset()
    assert UNLIMITED.rebalance({}, frozenset(), ClusterView()) == frozenset()
    legacy = LeastShardAllocationStrategy(rebalance_absolute_limit=0)
    assert legacy.rebalance({}, frozenset(), ClusterView()) == frozenset()


def test_no_rebalance_while_in_progress() -> None:
    current = allocations(10, 0, 0)
    cluster = up(current)
    assert UNLIMITED.rebalance(current, ids("002", "003"), cluster) == frozenset()
    # Even when what is in progress is no longer allocated anywhere.
    assert UNLIMITED.rebalance(current, ids("999"), cluster) == frozenset()
    assert UNLIMITED.rebalance(current, frozenset(), cluster) != frozenset()


def test_leaving_region_does_not_block_rebalance_and_gives_all_its_shards() -> None:
    # [4 (leaving), 0, 0]: only B and C stay, so optimal = 2 and every shard of the leaving A
    # is surplus: all four move, two to B and two to C.
    current = allocations(4, 0, 0)
    cluster = up(current, p1=MemberStatus.LEAVING)
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    assert moved == {"001", "002", "003", "004"}
    assert counts(after_rebalance(UNLIMITED, current, moved, cluster)) == [0, 2, 2]


LEGACY = LeastShardAllocationStrategy(
    rebalance_absolute_limit=0, rebalance_threshold=1, max_simultaneous_rebalance=3
)


@pytest.mark.parametrize("strategy", [UNLIMITED, LEGACY], ids=["newer", "legacy"])
@pytest.mark.parametrize(
    "cluster",
    [
        ClusterView(members={A: MemberStatus.UP, B: MemberStatus.UP}, unreachable=frozenset({B})),
        # An unreachable node without a region blocks it too: it may host a proxy.
        ClusterView(members={A: MemberStatus.UP, B: MemberStatus.UP}, unreachable=frozenset({D})),
        ClusterView(members={A: MemberStatus.UP, B: MemberStatus.UP, D: MemberStatus.JOINING}),
        ClusterView(members={A: MemberStatus.UP, B: MemberStatus.WEAKLY_UP}),
    ],
    ids=["unreachable-region", "unreachable-other", "joining", "weakly-up"],
)
def test_no_rebalance_when_not_a_good_time(
    strategy: LeastShardAllocationStrategy, cluster: ClusterView
) -> None:
    current = allocations(5, 0)
    assert strategy.rebalance(current, frozenset(), cluster) == frozenset()
    assert strategy.rebalance(current, frozenset(), up(current)) != frozenset()


def test_rebalance_does_not_hand_a_shard_back_to_its_own_region() -> None:
    # A is leaving with no shards; B and C are Up with 2 each. optimal = ceil(4/3) = 2, A is
    # 2 - 1 - 0 = 1 below optimal - 1, so phase 2 picks B's head "001". allocate_shard prefers
    # regions not leaving, so "001" goes to the emptiest Up region: B again. The hand-off stops
    # and restarts its entities for nothing, and the next round does the same.
    current = allocations(0, 2, 2)
    cluster = up(current, p1=MemberStatus.LEAVING)
    moved = UNLIMITED.rebalance(current, frozenset(), cluster)
    after = after_rebalance(UNLIMITED, current, moved, cluster)
    home = {s: node for node, ids in current.items() for s in ids}
    new_home = {s: node for node, ids in after.items() for s in ids}
    assert [s for s in moved if new_home[s] == home[s]] == []


# --- rebalance, legacy algorithm ----------------------------------------------------------------


def legacy(threshold: int, max_simultaneous: int) -> LeastShardAllocationStrategy:
    return LeastShardAllocationStrategy(
        rebalance_absolute_limit=0,
        rebalance_threshold=threshold,
        max_simultaneous_rebalance=max_simultaneous,
    )


@pytest.mark.parametrize(
    ("counts_", "expected"),
    [
        ((4, 1, 1), set()),  # difference 3 is not more than the threshold 3
        ((5, 1, 1), {"001"}),  # 4 - 3 = 1 shard
        ((6, 0, 0), {"001", "002", "003"}),  # min(6 - 3, 3) = 3
        ((10, 0, 0), {"001", "002", "003"}),  # min(10 - 3, 3): never more than the threshold
        ((1, 8, 0), {"002", "003", "004"}),  # from the fullest region, B
    ],
)
def test_legacy_threshold(counts_: tuple[int, ...], expected: set[str]) -> None:
    current = allocations(*counts_)
    assert legacy(3, 10).rebalance(current, frozenset(), up(current)) == expected


def test_legacy_max_simultaneous_rebalance_counts_shards_in_progress() -> None:
    # [10, 0, 0], threshold 3: 3 shards wanted; with 2 of 4 slots taken, only 2.
    current = allocations(10, 0, 0)
    cluster = up(current)
    strategy = legacy(3, 4)
    assert strategy.rebalance(current, ids("x1", "x2"), cluster) == {"001", "002"}
    assert strategy.rebalance(current, ids("x1", "x2", "x3"), cluster) == {"001"}
    assert strategy.rebalance(current, ids("x1", "x2", "x3", "x4"), cluster) == set()


def test_legacy_excludes_shards_in_progress() -> None:
    # A's "001" and "002" are being handed off: 8 movable, least 0, min(8 - 3, 3, 10 - 2) = 3.
    current = allocations(10, 0, 0)
    moved = legacy(3, 10).rebalance(current, ids("001", "002"), up(current))
    assert moved == {"003", "004", "005"}


def test_legacy_fullest_region_is_counted_without_shards_in_progress() -> None:
    # A has 6 shards but 3 of them are in progress; B has 5 movable, so B is the fullest.
    # Least is C (0); difference 5 > 1; min(5 - 1, 1, 5 - 3) = 1: B's smallest id "007".
    current = allocations(6, 5, 0)
    moved = legacy(1, 5).rebalance(current, ids("001", "002", "003"), up(current))
    assert moved == {"007"}


def test_legacy_takes_the_smallest_shard_ids_not_the_oldest() -> None:
    current: Current = {A: [ShardId(s) for s in ["s3", "s1", "s2", "s0"]], B: [], C: []}
    assert legacy(1, 3).rebalance(current, frozenset(), up(current)) == {"s0"}


def test_legacy_least_region_is_the_one_allocate_would_pick() -> None:
    # A is leaving with 0 shards; the least Up region is C with 3, so the difference is
    # 5 - 3 = 2, not above the threshold 2. With A Up, it would be 5 - 0: min(3, 2) shards.
    current = {A: [], B: SHARDS[:5], C: SHARDS[5:8]}
    assert (
        legacy(2, 5).rebalance(current, frozenset(), up(current, p1=MemberStatus.LEAVING)) == set()
    )
    assert legacy(2, 5).rebalance(current, frozenset(), up(current)) == {"001", "002"}


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rebalance_absolute_limit", -1),
        ("rebalance_absolute_limit", 1.5),
        ("rebalance_absolute_limit", True),
        ("rebalance_relative_limit", -0.1),
        ("rebalance_relative_limit", 1.01),
        ("rebalance_relative_limit", math.nan),
        ("rebalance_relative_limit", "0.5"),
        ("rebalance_threshold", 0),
        ("rebalance_threshold", -3),
        ("max_simultaneous_rebalance", 0),
        ("max_simultaneous_rebalance", 2.0),
    ],
)
def test_invalid_settings_raise_configuration_error_naming_the_field(
    field: str, value: object
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(f"{field} = {value!r}")):
        LeastShardAllocationStrategy(**{field: value})  # type: ignore[arg-type]


def test_boundary_settings_are_accepted() -> None:
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=0,
        rebalance_relative_limit=1,
        rebalance_threshold=1,
        max_simultaneous_rebalance=1,
    )
    assert strategy.rebalance_relative_limit == 1
    assert LeastShardAllocationStrategy(rebalance_relative_limit=0.0).rebalance_relative_limit == 0


# --- randomized (Pekko's LeastShardAllocationStrategyRandomizedSpec) ---------------------------


@st.composite
def shard_counts(draw: st.DrawFn, max_regions: int, max_shards: int) -> list[int]:
    """Shards per region, at most ``max_shards`` in all: even, skewed or mostly empty."""
    n = draw(st.integers(1, max_regions))
    cap = draw(st.sampled_from([1, 3, 10, 50, max_shards]))
    raw = draw(st.lists(st.integers(0, cap), min_size=n, max_size=n))
    total = sum(raw)
    if total > max_shards:
        raw = [c * max_shards // total for c in raw]
    return raw


def build(shard_counts_: Sequence[int]) -> Current:
    ids = (ShardId(f"s{i}") for i in itertools.count())
    return {region(i + 1): [next(ids) for _ in range(c)] for i, c in enumerate(shard_counts_)}


def move(
    strategy: LeastShardAllocationStrategy,
    current: Current,
    moved: frozenset[ShardId],
    cluster: ClusterView,
    rnd: random.Random,
) -> Current:
    """One round's hand-offs completed, the shards allocated again in a random order."""
    order = sorted(moved)
    rnd.shuffle(order)
    after = after_rebalance(strategy, current, moved, cluster, order)
    assert sorted(s for ids in after.values() for s in ids) == sorted(
        s for ids in current.values() for s in ids
    ), "shards were lost or duplicated"
    return after


def excess(current: Current, optimal: int) -> int:
    return sum(max(0, len(ids) - optimal) for ids in current.values())


def deficit(current: Current, optimal: int) -> int:
    return sum(max(0, optimal - 1 - len(ids)) for ids in current.values())


def spread(current: Current) -> int:
    sizes = counts(current)
    return max(sizes) - min(sizes)


def settle_newer(
    strategy: LeastShardAllocationStrategy, shard_counts_: Sequence[int], seed: int
) -> int:
    """Rebalance until nothing moves, checking each round exactly; return the rounds that moved.

    With every region Up, S shards over n regions, optimal = ceil(S / n) and limit
    L = max(1, min(int(relative * S), absolute)) (constant: S never changes):

    * Phase 1 (some region above optimal, excess E = sum of (size - optimal) over those): exactly
      min(E, L) shards move and E drops by that much. While a moved shard waits, fewer than S
      shards are placed, so the emptiest region is below optimal: a receiver never goes above
      it. Phase 1 therefore takes ceil(E0 / L) rounds and phase 2 never brings it back.
    * Phase 2 (nobody above optimal, deficit D = sum of (optimal - 1 - size) over the regions
      two or more below optimal): exactly min(D, L) shards move, each from a region at optimal
      (to optimal - 1) to a region with a deficit, so D drops by that much. D < n: the n - k
      regions short of optimal miss r = n * optimal - S < n shards in all, and D = r - k with
      k >= 1 when D > 0; so D <= n - 2. Also D <= n * (optimal - 1) < S.
    * Nothing moves exactly when E = D = 0, i.e. every size is optimal - 1 or optimal: the
      spread left is at most 1, not 2 (a spread of 2 means a region at optimal - 2 or one above
      optimal, which phase 2 or phase 1 would move).

    So the strategy settles within ceil(E0 / L) + ceil(min(n - 2, S - 1) / L) rounds (2 without
    limits, as Pekko's spec expects) and the next round returns nothing.
    """
    rnd = random.Random(seed)
    current = build(shard_counts_)
    cluster = up(current)
    n, total = len(current), sum(shard_counts_)
    if total == 0:
        assert strategy.rebalance(current, frozenset(), cluster) == frozenset()
        return 0
    optimal = math.ceil(total / n)
    limit = max(
        1, min(int(strategy.rebalance_relative_limit * total), strategy.rebalance_absolute_limit)
    )
    bound = math.ceil(excess(current, optimal) / limit) + math.ceil(
        max(0, min(n - 2, total - 1)) / limit
    )
    history = [counts(current)]
    for rounds in range(bound + 1):
        moved = strategy.rebalance(current, frozenset(), cluster)
        e, d = excess(current, optimal), deficit(current, optimal)
        home = {s: node for node, ids in current.items() for s in ids}
        assert moved <= home.keys(), "rebalance returned shards that are not allocated"
        if e > 0:
            assert len(moved) == min(e, limit), history
            assert all(len(current[home[s]]) > optimal for s in moved), history
        elif d > 0:
            assert len(moved) == min(d, limit), history
            assert all(len(current[home[s]]) == optimal for s in moved), history
            assert len({home[s] for s in moved}) == len(moved), "two heads of one region"
        else:
            assert moved == frozenset(), history
            assert spread(current) <= 1, history
            return rounds
        current = move(strategy, current, moved, cluster, rnd)
        history.append(counts(current))
        if e > 0:
            assert excess(current, optimal) == e - len(moved), history
        else:
            assert excess(current, optimal) == 0, history
            assert deficit(current, optimal) == d - len(moved), history
    pytest.fail(f"not settled within {bound} rounds: {history}")


@fast
@given(shard_counts(max_regions=100, max_shards=1000), st.integers(0, 2**32 - 1))
@example([5, 5, 0], 0)
@example([50, 0, 50], 0)
@example([1000] + [0] * 99, 0)
@example([0] * 99 + [1000], 0)
@example([3] * 60 + [0] * 40, 0)
def test_newer_algorithm_settles_in_two_rounds_without_limits(
    shard_counts_: list[int], seed: int
) -> None:
    assert settle_newer(UNLIMITED, shard_counts_, seed) <= 2


@fast
@given(
    shard_counts(max_regions=100, max_shards=1000),
    st.integers(1, 50),
    st.floats(0.0, 1.0),
    st.integers(0, 2**32 - 1),
)
@example([1, 9, 0], 3, 1.0, 0)
@example([1000] + [0] * 99, 1, 0.0, 0)
@example([3] * 60 + [0] * 40, 7, 0.05, 0)
def test_newer_algorithm_settles_within_the_derived_bound_with_limits(
    shard_counts_: list[int], absolute: int, relative: float, seed: int
) -> None:
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=absolute, rebalance_relative_limit=relative
    )
    settle_newer(strategy, shard_counts_, seed)


@fast
@given(
    shard_counts(max_regions=50, max_shards=500),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
)
@example([500] + [0] * 49, 1, 1, 0)
def test_legacy_algorithm_settles_to_within_the_threshold(
    shard_counts_: list[int], threshold: int, max_simultaneous: int, seed: int
) -> None:
    """Each round moves c = min(diff - t, t, max_simultaneous) >= 1 shards off the fullest region
    (size a, diff = a - least > t) and each lands on the emptiest at that moment, which is at
    most least + j - 1 for the j-th. So the sum of squared sizes drops by at least
    2ca - c^2 - (2c * least + c^2) = 2c(diff - c) >= 2ct. Nothing moves exactly when
    diff <= t; since the sum of squares is at least S^2 / n, that happens within
    (sum0 - S^2 / n) / 2t rounds."""
    strategy = legacy(threshold, max_simultaneous)
    rnd = random.Random(seed)
    current = build(shard_counts_)
    cluster = up(current)
    n, total = len(current), sum(shard_counts_)

    def squares(c: Current) -> int:
        return sum(len(ids) ** 2 for ids in c.values())

    bound = math.floor((squares(current) - total * total / n) / (2 * threshold))
    history = [counts(current)]
    for _ in range(bound + 1):
        moved = strategy.rebalance(current, frozenset(), cluster)
        if spread(current) <= threshold:
            assert moved == frozenset(), history
            return
        assert 1 <= len(moved) <= min(threshold, max_simultaneous), history
        before = squares(current)
        current = move(strategy, current, moved, cluster, rnd)
        history.append(counts(current))
        assert before - squares(current) >= 2 * len(moved) * threshold, history
    pytest.fail(f"not settled within {bound} rounds: {history}")


ANY_STATUS = st.sampled_from(list(MemberStatus))
# Half the clusters are a good time to rebalance, so the limits get exercised too.
SETTLED_STATUS = st.sampled_from([MemberStatus.UP, *LEAVING_STATUSES, MemberStatus.REMOVED])


@fast
@given(
    shard_counts(max_regions=20, max_shards=200),
    st.data(),
    st.sampled_from([0, 1, 2, 5, 30]),  # 0: the legacy algorithm
    st.floats(0.0, 1.0),
    st.integers(1, 5),
    st.integers(1, 5),
)
def test_rebalance_returns_only_allocated_shards_within_the_limit(
    shard_counts_: list[int],
    data: st.DataObject,
    absolute: int,
    relative: float,
    threshold: int,
    max_simultaneous: int,
) -> None:
    strategy = LeastShardAllocationStrategy(
        rebalance_absolute_limit=absolute,
        rebalance_relative_limit=relative,
        rebalance_threshold=threshold,
        max_simultaneous_rebalance=max_simultaneous,
    )
    current = build(shard_counts_)
    nodes = list(current)
    settled = data.draw(st.booleans())
    status = SETTLED_STATUS if settled else ANY_STATUS
    members = {node: data.draw(status) for node in nodes}
    unreachable = frozenset(
        () if settled else data.draw(st.sets(st.sampled_from(nodes), max_size=2))
    )
    cluster = ClusterView(members=members, unreachable=unreachable)
    allocated = {s for ids in current.values() for s in ids}
    candidates = [*sorted(allocated), ShardId("gone-1"), ShardId("gone-2")]
    in_progress = frozenset(data.draw(st.sets(st.sampled_from(candidates), max_size=6)))
    moved = strategy.rebalance(current, in_progress, cluster)

    assert moved <= allocated
    assert not moved & in_progress
    if not cluster.good_time_to_rebalance():
        assert moved == frozenset()
    total = len(allocated)
    if absolute > 0:
        if in_progress:
            assert moved == frozenset()
        assert len(moved) <= max(1, min(int(relative * total), absolute))
    else:
        assert len(moved) <= min(threshold, max(0, max_simultaneous - len(in_progress)))

    # allocate_shard: a registered region with the fewest shards among those not leaving (all
    # regions if every one is leaving) and, among those, reachable ones first, whatever the
    # order of the mapping.
    home = strategy.allocate_shard(nodes[0], ShardId("new"), current, cluster)
    staying = [node for node in nodes if not cluster.is_leaving(node)] or nodes
    preferred = [node for node in staying if node not in unreachable] or staying
    assert home in preferred
    assert len(current[home]) == min(len(current[node]) for node in preferred)
    shuffled = dict(reversed(list(current.items())))
    assert strategy.allocate_shard(nodes[-1], ShardId("new"), shuffled, cluster) == home
