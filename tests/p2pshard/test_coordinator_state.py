"""The coordinator's state: events fold with their invariants checked, and the replicated
document reads back as the same state."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Doc

from membership import Address, UniqueAddress
from p2pshard.sharding._allocation import ShardId
from p2pshard.sharding._coordinator_state import (
    CoordinatorState,
    DomainEvent,
    IllegalCoordinatorEvent,
    ShardHomeAllocated,
    ShardHomeDeallocated,
    ShardRegionProxyRegistered,
    ShardRegionProxyTerminated,
    ShardRegionRegistered,
    ShardRegionTerminated,
    StateDraft,
    apply_event,
    apply_events,
    decode_region,
    encode_region,
)
from tests._support.examples import examples


def region(i: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", 2550 + i), f"n{i}", uid)


R1, R2, P3 = region(1), region(2), region(3)


def check_invariants(state: CoordinatorState) -> None:
    listed = [s for shards in state.regions.values() for s in shards]
    assert len(listed) == len(set(listed))  # a shard lives in one region only
    assert {s: r for r, shards in state.regions.items() for s in shards} == dict(state.shards)
    assert not (state.unallocated_shards & set(state.shards))


@pytest.mark.parametrize(
    ("events", "problem"),
    [
        ([ShardRegionRegistered(R1), ShardRegionRegistered(R1)], "already registered"),
        ([ShardRegionProxyRegistered(P3), ShardRegionProxyRegistered(P3)], "already registered"),
        ([ShardRegionTerminated(R1)], "terminated region .* unknown"),
        ([ShardRegionProxyTerminated(P3)], "terminated region proxy .* unknown"),
        ([ShardHomeAllocated(ShardId("1"), R1)], "not registered"),
        ([ShardHomeDeallocated(ShardId("1"))], "not allocated"),
        (
            [
                ShardRegionRegistered(R1),
                ShardRegionRegistered(R2),
                ShardHomeAllocated(ShardId("1"), R1),
                ShardHomeAllocated(ShardId("1"), R2),
            ],
            "already allocated",
        ),
    ],
)
def test_an_event_that_does_not_fit_is_refused_and_changes_nothing(
    events: list[DomainEvent], problem: str
) -> None:
    state = CoordinatorState()
    for event in events[:-1]:
        state = state.updated(event)
    before = state
    with pytest.raises(IllegalCoordinatorEvent, match=problem):
        state.updated(events[-1])
    assert state == before


def test_a_terminated_regions_shards_are_forgotten_or_kept_unallocated() -> None:
    events: list[DomainEvent] = [
        ShardRegionRegistered(R1),
        ShardRegionRegistered(R2),
        ShardHomeAllocated(ShardId("a"), R1),
        ShardHomeAllocated(ShardId("b"), R2),
        ShardRegionTerminated(R1),
    ]
    plain, remembering = CoordinatorState(), CoordinatorState(remember_entities=True)
    for event in events:
        plain, remembering = plain.updated(event), remembering.updated(event)
    assert plain.shards == {"b": R2}
    assert plain.unallocated_shards == frozenset()
    assert remembering.unallocated_shards == {"a"}  # to start elsewhere
    assert remembering.updated(ShardHomeAllocated(ShardId("a"), R2)).unallocated_shards == set()


def test_regions_keep_their_incarnation_in_the_document() -> None:
    old, new = region(1, uid=0xABC), region(1, uid=0xDEF)
    assert decode_region(encode_region(old)) == old
    assert decode_region(encode_region(new)) != old
    for bad in ("", "n1", "n1@10.0.0.1:1", "n1@10.0.0.1:x#1", "n1@10.0.0.1:1#zz"):
        with pytest.raises(IllegalCoordinatorEvent, match="is not a region"):
            decode_region(bad)


@st.composite
def histories(draw: Any) -> list[DomainEvent]:
    """Valid event sequences: each event fits the state the earlier ones built."""
    state = CoordinatorState(remember_entities=True)
    events: list[DomainEvent] = []
    for _ in range(draw(st.integers(0, 60))):
        regions = sorted(state.regions, key=encode_region)
        options: list[DomainEvent] = []
        options += [
            ShardRegionRegistered(region(i, uid))
            for i in range(1, 5)
            for uid in (1, 2)
            if region(i, uid) not in state.regions
        ][:3]
        options += [ShardRegionProxyRegistered(P3)] if P3 not in state.region_proxies else []
        options += [ShardRegionProxyTerminated(P3)] if P3 in state.region_proxies else []
        options += [ShardRegionTerminated(r) for r in regions]
        free = [ShardId(str(s)) for s in range(12) if ShardId(str(s)) not in state.shards]
        if regions and free:
            options += [ShardHomeAllocated(s, r) for s in free[:3] for r in regions]
        options += [ShardHomeDeallocated(s) for s in sorted(state.shards)]
        if not options:
            break
        event = draw(st.sampled_from(options))
        state = state.updated(event)
        events.append(event)
    return events


@settings(max_examples=examples(200), deadline=None)
@given(histories(), st.booleans())
def test_the_document_reads_back_as_the_folded_state(
    events: list[DomainEvent], remember: bool
) -> None:
    state = CoordinatorState(remember_entities=remember)
    doc: Doc[Any] = Doc(client_id=1)
    for event in events:
        state = state.updated(event)
        check_invariants(state)
        with doc.transaction():
            apply_event(doc, event)
    copy: Doc[Any] = Doc(client_id=2)
    copy.apply_update(doc.get_update())  # as another node's replica holds it
    read = CoordinatorState.from_document(copy, remember_entities=remember)
    check_invariants(read)
    assert dict(read.shards) == dict(state.shards)
    assert {r: set(s) for r, s in read.regions.items()} == {
        r: set(s) for r, s in state.regions.items()
    }
    assert read.region_proxies == state.region_proxies
    assert read.unallocated_shards == state.unallocated_shards


@settings(max_examples=examples(200), deadline=None)
@given(histories(), st.booleans(), st.integers(0, 60))
def test_a_batch_folds_as_its_events_one_by_one(
    events: list[DomainEvent], remember: bool, cut: int
) -> None:
    start = CoordinatorState(remember_entities=remember)
    for event in events[:cut]:
        start = start.updated(event)
    one_by_one = start
    draft = StateDraft.of(start)
    for event in events[cut:]:
        one_by_one = one_by_one.updated(event)
        draft.apply(event)
        assert draft.frozen() == one_by_one
    assert start.updated_all(events[cut:]) == one_by_one
    check_invariants(one_by_one)
    doc: Doc[Any] = Doc(client_id=1)
    with doc.transaction():
        apply_events(doc, events)
    read = CoordinatorState.from_document(doc, remember_entities=remember)
    assert dict(read.shards) == dict(one_by_one.shards)


def test_a_batch_with_an_event_that_does_not_fit_changes_nothing() -> None:
    state = CoordinatorState().updated(ShardRegionRegistered(R1))
    batch: list[DomainEvent] = [
        ShardHomeAllocated(ShardId("1"), R1),
        ShardHomeAllocated(ShardId("2"), R1),
        ShardHomeAllocated(ShardId("1"), R1),  # allocated already, earlier in the batch
    ]
    with pytest.raises(IllegalCoordinatorEvent, match="already allocated"):
        state.updated_all(batch)
    assert state == CoordinatorState().updated(ShardRegionRegistered(R1))
    draft = StateDraft.of(state)
    draft.apply(batch[0])
    with pytest.raises(IllegalCoordinatorEvent, match="not registered"):
        draft.apply(ShardHomeAllocated(ShardId("3"), R2))
    assert draft.frozen() == state.updated(batch[0])


def test_a_region_keeps_its_shards_in_allocation_order() -> None:
    state = CoordinatorState().updated(ShardRegionRegistered(R1))
    state = state.updated_all(
        [ShardHomeAllocated(ShardId(s), R1) for s in ("9", "3", "5")]
        + [ShardHomeDeallocated(ShardId("3")), ShardHomeAllocated(ShardId("1"), R1)]
    )
    assert state.regions[R1] == ("9", "5", "1")
