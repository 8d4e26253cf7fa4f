"""ShardRegionCore and the entity lifecycle table, sans-IO: synchronous, no bytes, no trio.

The region core is driven directly: each test builds a core (``region()`` or ``proxy()``),
feeds it inputs and compares the effects it returns. The region under test runs on ``n1``
(``SELF``); other regions are ``n2`` and ``n3``; the coordinator runs on ``n9``. Deliveries are
plain strings (``"a1"``, ``"a2"``, ...): the core only counts and orders them.

The randomized test (hypothesis) drives a core with random inputs and checks its invariants
after every step; hypothesis prints the falsifying steps (and keeps them in ``.hypothesis``) if
one fails.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import attrs
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from membership import Address, MemberStatus, UniqueAddress
from p2pshard.sharding._allocation import ShardId
from p2pshard.sharding._entity import EntityEvent, EntityState, IllegalEntityTransition, transition
from p2pshard.sharding._protocol import (
    BeginHandOff,
    BeginHandOffAck,
    GetShardHome,
    GracefulShutdownReq,
    HandOff,
    HostShard,
    RegionStopped,
    Register,
    RegisterAck,
    RegisterProxy,
    RegisterRefused,
    ShardHome,
    ShardStarted,
    ShardStopped,
)
from p2pshard.sharding._region_core import (
    REGISTER_FIRST_RETRY,
    Drop,
    DropReason,
    Flush,
    LocalShard,
    Refused,
    RegionEffect,
    SendTo,
    ShardRegionCore,
    StartShard,
    StopShard,
    ToCoordinator,
)
from p2pshard.sharding._settings import ShardingSettings
from tests._support.examples import examples

TYPE = "counter"
SHARDS = 100
RETRY = 2.0  # ShardingSettings' default retry_interval


def node(i: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", i), f"n{i}", uid)


SELF, N2, N3, COORD = node(1), node(2), node(3), node(9)
A, B, C = ShardId("a"), ShardId("b"), ShardId("c")

Effects = list[RegionEffect[str]]


# -- messages -------------------------------------------------------------------------------


def register() -> ToCoordinator:
    return ToCoordinator(Register(type_name=TYPE, number_of_shards=SHARDS))


def register_proxy() -> ToCoordinator:
    return ToCoordinator(RegisterProxy(type_name=TYPE, number_of_shards=SHARDS))


def ask(shard: str) -> ToCoordinator:
    return ToCoordinator(GetShardHome(type_name=TYPE, shard=shard))


def started(shard: str) -> ToCoordinator:
    return ToCoordinator(ShardStarted(type_name=TYPE, shard=shard))


def stopped(shard: str, handoff_id: int) -> ToCoordinator:
    return ToCoordinator(ShardStopped(type_name=TYPE, shard=shard, handoff_id=handoff_id))


def shutdown_req() -> ToCoordinator:
    return ToCoordinator(GracefulShutdownReq(type_name=TYPE))


def region_stopped() -> ToCoordinator:
    return ToCoordinator(RegionStopped(type_name=TYPE))


def ack(coordinator: UniqueAddress = COORD) -> RegisterAck:
    return RegisterAck(type_name=TYPE, coordinator=coordinator)


def refused(reason: str = "number of shards differs: 100 here, 10 there") -> RegisterRefused:
    return RegisterRefused(type_name=TYPE, reason=reason)


def home(shard: str, region: UniqueAddress) -> ShardHome:
    return ShardHome(type_name=TYPE, shard=shard, region=region)


def host(shard: str) -> HostShard:
    return HostShard(type_name=TYPE, shard=shard)


def begin(shard: str, handoff_id: int = 0) -> BeginHandOff:
    return BeginHandOff(type_name=TYPE, shard=shard, handoff_id=handoff_id)


def begin_ack(shard: str, handoff_id: int = 0, by: UniqueAddress = SELF) -> BeginHandOffAck:
    return BeginHandOffAck(type_name=TYPE, shard=shard, handoff_id=handoff_id, acked_by=by)


def hand_off(shard: str, handoff_id: int = 0) -> HandOff:
    return HandOff(type_name=TYPE, shard=shard, handoff_id=handoff_id)


# -- building cores -------------------------------------------------------------------------


def region(
    *,
    registered: bool = False,
    hosting: bool = True,
    now: float = 0.0,
    settings: ShardingSettings | None = None,
) -> ShardRegionCore[str]:
    """A region (or, with ``hosting=False``, a proxy) on SELF; ``registered`` acks it at ``now``."""
    core: ShardRegionCore[str] = ShardRegionCore(
        TYPE, SELF, SHARDS, settings or ShardingSettings(), hosting=hosting, now=now
    )
    if registered:
        assert core.tick(now) == [register() if hosting else register_proxy()]
        assert core.receive(COORD, ack(), now) == []
        assert core.registered
    return core


def proxy(*, registered: bool = False, now: float = 0.0) -> ShardRegionCore[str]:
    return region(registered=registered, hosting=False, now=now)


def hosting_shard(core: ShardRegionCore[str], shard: str, now: float = 0.0) -> None:
    """Make ``shard`` run at ``core`` (HostShard with nothing buffered)."""
    assert core.receive(COORD, host(shard), now) == [StartShard(ShardId(shard)), started(shard)]
    assert core.local[ShardId(shard)] is LocalShard.RUNNING


def stopping_shard(core: ShardRegionCore[str], shard: str, handoff_id: int, now: float = 0) -> None:
    """Make ``shard`` run at ``core`` and then start handing it off."""
    hosting_shard(core, shard, now)
    assert core.receive(COORD, hand_off(shard, handoff_id), now) == [StopShard(ShardId(shard))]
    assert core.local[ShardId(shard)] is LocalShard.STOPPING


def has_stopped(core: ShardRegionCore[str]) -> bool:
    """``core.stopped``, read through a call (so mypy does not narrow it for good)."""
    return core.stopped


def register_times(core: ShardRegionCore[str], until: float) -> list[float]:
    """Tick at every deadline up to ``until``; the times Register went out."""
    times = []
    while (now := core.next_deadline()) <= until:
        effects = core.tick(now)
        assert effects in ([], [register()]), effects
        if effects:
            times.append(now)
    return times


# -- 1. registration ------------------------------------------------------------------------


def test_the_first_register_goes_out_at_the_first_tick() -> None:
    core = region(now=5.0)
    assert not core.registered
    assert core.next_deadline() == 5.0
    assert core.tick(4.9) == []
    assert core.tick(5.0) == [register()]
    assert core.tick(5.0) == []  # not again at once


def test_a_proxy_registers_as_a_proxy() -> None:
    core = proxy(now=1.0)
    assert core.tick(1.0) == [register_proxy()]
    assert core.receive(COORD, ack(), 1.0) == []
    assert core.registered
    assert core.coordinator_changed(3.0) == [register_proxy()]


def test_register_is_repeated_with_a_doubling_backoff_up_to_the_retry_interval() -> None:
    core = region(settings=ShardingSettings(retry_interval=1.0))
    times = register_times(core, until=6.0)
    gaps = [round(b - a, 9) for a, b in itertools.pairwise(times)]
    assert gaps[0] in (REGISTER_FIRST_RETRY, 2 * REGISTER_FIRST_RETRY)
    for before, after in itertools.pairwise(gaps):
        assert after == pytest.approx(min(2 * before, 1.0))
    assert gaps[-3:] == pytest.approx([1.0, 1.0, 1.0])  # capped at retry_interval
    assert times[0] == 0.0


def test_the_first_repeat_of_register_comes_register_first_retry_after_the_first() -> None:
    core = region(settings=ShardingSettings(retry_interval=1.0))
    times = register_times(core, until=1.0)
    assert times[1] - times[0] == pytest.approx(REGISTER_FIRST_RETRY)


def test_after_coordinator_changed_register_repeats_after_register_first_retry() -> None:
    core = region(registered=True, settings=ShardingSettings(retry_interval=1.0))
    assert core.coordinator_changed(10.0) == [register()]
    times = [10.0, *register_times(core, until=14.0)]
    gaps = [round(b - a, 9) for a, b in itertools.pairwise(times)]
    assert gaps[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0])


def test_register_ack_stops_the_retries_and_asks_for_every_buffered_shard_once() -> None:
    core = region()
    assert core.tick(0.0) == [register()]
    for shard, delivery in [("b", "b1"), ("c", "c1"), ("a", "a1"), ("b", "b2"), ("a", "a2")]:
        assert core.buffer(ShardId(shard), delivery, 0.05) == []  # nobody to ask yet
    assert core.buffered == 5

    assert core.receive(COORD, ack(), 0.1) == [ask("a"), ask("b"), ask("c")]  # sorted, once
    assert core.registered
    assert core.coordinator == COORD
    assert core.receive(COORD, ack(), 0.2) == []  # a repeated ack asks nothing again
    # No more Register, however long it takes; the asks are repeated every retry_interval.
    assert core.tick(1.0) == []
    assert core.tick(RETRY) == [ask("a"), ask("b"), ask("c")]
    assert core.tick(50.0) == [ask("a"), ask("b"), ask("c")]
    assert core.next_deadline() == 50.0 + RETRY


def test_register_ack_does_not_ask_for_shards_stopping_here() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=3)
    assert core.buffer(A, "a1", 0.0) == []
    assert core.coordinator_changed(1.0) == [register()]
    assert core.buffer(B, "b1", 1.0) == []
    assert core.receive(COORD, ack(), 1.1) == [ask("b")]


def test_coordinator_changed_registers_again_at_once_and_keeps_the_known_homes() -> None:
    core = region(registered=True)
    hosting_shard(core, "c")
    assert core.receive(COORD, home("a", N2), 0.5) == []
    assert core.coordinator_changed(1.0) == [register()]
    assert not core.registered
    assert core.homes == {A: N2, C: SELF}  # established shards keep working
    assert core.local == {C: LocalShard.RUNNING}
    assert core.next_deadline() == pytest.approx(1.0 + REGISTER_FIRST_RETRY)
    assert core.tick(1.05) == []
    assert core.tick(1.0 + REGISTER_FIRST_RETRY) == [register()]

    assert core.buffer(B, "b1", 1.2) == []  # not registered: asks once the new one acks
    new = node(8)
    assert core.receive(new, ack(new), 1.3) == [ask("b")]
    assert core.coordinator == new
    assert core.homes == {A: N2, C: SELF}


def test_coordinator_changed_does_nothing_after_a_refusal_or_a_stop() -> None:
    core = region(registered=True)
    core.receive(COORD, refused(), 0.0)
    assert core.coordinator_changed(1.0) == []

    core = region(registered=True)
    assert core.graceful_shutdown(0.0) == [shutdown_req(), region_stopped()]
    assert core.coordinator_changed(1.0) == []
    assert core.registered  # the stopped region stays as it was


# -- 2. refusal -----------------------------------------------------------------------------


def test_register_refused_drops_everything_buffered_and_every_later_message() -> None:
    core = region()
    assert core.tick(0.0) == [register()]
    for shard, delivery in [("a", "a1"), ("b", "b1"), ("a", "a2")]:
        core.buffer(ShardId(shard), delivery, 0.0)
    reason = "number of shards differs: 100 here, 10 there"

    effects = core.receive(COORD, refused(reason), 0.1)
    assert effects[0] == Refused(reason)
    [drop] = effects[1:]
    assert isinstance(drop, Drop)
    assert drop.reason == reason
    assert sorted(drop.deliveries) == ["a1", "a2", "b1"]
    assert drop.deliveries.index("a1") < drop.deliveries.index("a2")
    assert core.refused == reason
    assert core.buffered == 0
    assert core.buffers == {}
    assert core.dropped == 3

    assert core.buffer(C, "c1", 0.2) == [Drop(["c1"], reason)]
    assert core.dropped == 4
    assert core.buffered == 0
    assert core.tick(0.3) == []
    assert core.tick(1000.0) == []  # no more Register, no asks
    assert core.next_deadline() == float("inf")
    assert core.receive(COORD, refused("again"), 2.0) == []  # once is enough
    assert core.refused == reason


def test_register_refused_with_nothing_buffered_drops_nothing() -> None:
    core = region(registered=True)
    effects = core.receive(COORD, refused("no"), 0.0)
    assert effects[0] == Refused("no")
    assert all(isinstance(e, Drop) and e.deliveries == [] for e in effects[1:])
    assert core.dropped == 0


# -- 3. buffering ---------------------------------------------------------------------------


def test_the_first_message_for_a_shard_asks_for_its_home_once() -> None:
    core = region(registered=True)
    assert core.buffer(A, "a1", 0.0) == [ask("a")]
    assert core.buffer(A, "a2", 0.0) == []
    assert core.buffer(B, "b1", 0.0) == [ask("b")]
    assert core.buffer(A, "a3", 0.0) == []
    assert core.buffered == 4
    assert {s: list(q) for s, q in core.buffers.items()} == {A: ["a1", "a2", "a3"], B: ["b1"]}
    assert core.dropped == 0


def test_a_full_buffer_drops_new_messages_and_says_how_big_it_is() -> None:
    core = region(registered=True, settings=ShardingSettings(buffer_size=3))
    assert core.buffer(A, "a1", 0.0) == [ask("a")]
    assert core.buffer(B, "b1", 0.0) == [ask("b")]
    assert core.buffer(A, "a2", 0.0) == []
    assert core.buffered == 3  # over all shards

    [drop] = core.buffer(C, "c1", 0.0)  # a new shard: not asked for either
    assert isinstance(drop, Drop)
    assert drop.deliveries == ["c1"]
    assert "buffer is full" in drop.reason
    assert "(3 messages" in drop.reason
    assert core.buffer(A, "a3", 0.0) == [Drop(["a3"], drop.reason)]
    assert core.dropped == 2
    assert core.buffered == 3
    assert C not in core.buffers

    # Releasing a shard's buffer makes room again.
    assert core.receive(COORD, home("a", N2), 0.1) == [Flush(A, N2, ["a1", "a2"])]
    assert core.buffered == 1
    assert core.buffer(C, "c2", 0.2) == [ask("c")]
    assert core.buffered == 2


def test_a_buffer_of_size_zero_drops_everything() -> None:
    core = region(registered=True, settings=ShardingSettings(buffer_size=0))
    [drop] = core.buffer(A, "a1", 0.0)
    assert isinstance(drop, Drop)
    assert drop.deliveries == ["a1"]
    assert "(0 messages" in drop.reason
    assert core.buffered == 0
    assert core.dropped == 1


def test_every_drop_says_its_cause_as_a_drop_reason_and_only_a_full_buffer_overflows() -> None:
    full = region(registered=True, settings=ShardingSettings(buffer_size=0))
    [drop] = full.buffer(A, "a1", 0.0)
    assert isinstance(drop, Drop)
    assert drop.cause is DropReason.BUFFER_FULL

    # Words that look like another cause do not make it one: the cause is not read from them.
    refusing = region()
    refusing.buffer(A, "a1", 0.0)
    _, drop = refusing.receive(COORD, refused("the region's buffer is full, says a joke"), 0.1)
    assert isinstance(drop, Drop)
    assert drop.cause is DropReason.REFUSED
    [drop] = refusing.buffer(B, "b1", 0.2)
    assert isinstance(drop, Drop)
    assert drop.cause is DropReason.REFUSED

    stopping = region(registered=True)
    stopping.graceful_shutdown(0.0)
    [drop] = stopping.buffer(A, "a1", 0.1)
    assert isinstance(drop, Drop)
    assert drop.cause is DropReason.STOPPED
    assert drop.reason == "the region has stopped"

    assert [r for r in DropReason if r.overflow] == [DropReason.BUFFER_FULL]
    # Each counted under its own reason.
    assert full.drops[DropReason.BUFFER_FULL] == 1
    assert refusing.drops[DropReason.REFUSED] == 2  # the buffered one and the later one
    assert stopping.drops[DropReason.STOPPED] == 1
    for core in (full, refusing, stopping):
        assert core.dropped == sum(core.drops.values()) == max(core.drops.values())
    assert {r.label for r in DropReason} == {
        "stopped",
        "refused",
        "buffer_full",
        "send_queue_full",
        "not_sent",
    }


def test_drops_the_shell_counts_go_into_the_cores_counter() -> None:
    core = region(registered=True)
    core.count_dropped(3)
    core.count_dropped(1)
    core.count_dropped(2, DropReason.NOT_SENT)
    assert core.dropped == 6
    assert core.drops[DropReason.SEND_QUEUE_FULL] == 4
    assert core.drops[DropReason.NOT_SENT] == 2


def test_a_shard_home_lookup_is_timed_from_its_first_request_to_the_answer() -> None:
    core = region(registered=True, now=0.0)
    assert core.buffer(A, "a1", 1.0) == [ask("a")]
    assert core.buffer(B, "b1", 1.5) == [ask("b")]
    # The repeat of the request does not restart the lookup's time.
    assert ask("a") in core.tick(1.0 + RETRY)
    core.receive(COORD, home("a", N2), 4.0)  # 3 s after the first request
    core.receive(COORD, host("b"), 1.75)  # comes here: a quarter second
    lookups = core.home_lookups.snapshot()
    assert lookups.count == 2
    assert lookups.sum == pytest.approx(3.25)
    assert dict(lookups.cumulative())[0.25] == 1
    # An answer nobody here asked for (the coordinator placing a shard) is no lookup.
    core.receive(COORD, host("c"), 5.0)
    core.receive(COORD, home("a", N3), 5.0)
    assert core.home_lookups.snapshot().count == 2
    assert core.home_requests == 4  # a and b, then both again at the retry


# -- 4. homes: ShardHome and HostShard ------------------------------------------------------


def test_shard_home_elsewhere_flushes_the_buffer_there_in_order() -> None:
    core = region(registered=True)
    core.buffer(A, "a1", 0.0)
    core.buffer(B, "b1", 0.0)
    core.buffer(A, "a2", 0.0)
    core.buffer(A, "a3", 0.0)
    assert core.receive(COORD, home("a", N2), 0.1) == [Flush(A, N2, ["a1", "a2", "a3"])]
    assert core.homes == {A: N2}
    assert core.buffered == 1
    assert A not in core.buffers
    assert core.local == {}
    # A second answer (a retried GetShardHome) has nothing left to flush.
    assert core.receive(COORD, home("a", N2), 0.2) == []
    # A home without a buffer is just learned.
    assert core.receive(COORD, home("c", N3), 0.3) == []
    assert core.homes == {A: N2, C: N3}


def test_the_homes_on_one_node_are_one_object_until_its_region_is_gone() -> None:
    # The shell's sends compare destinations by identity (the transport's route cache).
    core = region(registered=True)
    core.receive(COORD, home("a", node(2)), 0.0)
    core.receive(COORD, home("b", node(2)), 0.0)
    core.receive(COORD, home("c", node(3)), 0.0)
    assert core.homes[A] is core.homes[B]
    assert core.homes[C] == N3
    core.regions_gone([N2], 0.1)
    core.receive(COORD, home("a", n2_again := node(2)), 0.2)
    assert core.homes[A] is n2_again


def test_shard_home_here_starts_the_shard_without_answering_shard_started() -> None:
    core = region(registered=True)
    core.buffer(A, "a1", 0.0)
    core.buffer(A, "a2", 0.0)
    assert core.receive(COORD, home("a", SELF), 0.1) == [
        StartShard(A),
        Flush(A, SELF, ["a1", "a2"]),
    ]
    assert core.local == {A: LocalShard.RUNNING}
    assert core.homes == {A: SELF}
    assert core.buffered == 0
    # Already running: nothing to start again.
    assert core.receive(COORD, home("a", SELF), 0.2) == []


def test_host_shard_starts_the_shard_answers_and_flushes_to_itself() -> None:
    core = region(registered=True)
    core.buffer(A, "a1", 0.0)
    core.buffer(A, "a2", 0.0)
    assert core.receive(COORD, host("a"), 0.1) == [
        StartShard(A),
        started("a"),
        Flush(A, SELF, ["a1", "a2"]),
    ]
    assert core.local == {A: LocalShard.RUNNING}
    assert core.homes == {A: SELF}
    # The coordinator resends HostShard until ShardStarted arrives: answer, do not restart.
    assert core.receive(COORD, host("a"), 0.2) == [started("a")]
    assert core.receive(COORD, host("b"), 0.3) == [StartShard(B), started("b")]


def test_a_proxy_never_starts_a_shard() -> None:
    core = proxy(registered=True)
    assert core.buffer(A, "a1", 0.0) == [ask("a")]
    assert core.receive(COORD, host("a"), 0.1) == []
    assert core.receive(COORD, home("a", SELF), 0.1) == []
    assert core.local == {}
    assert core.homes == {}
    assert core.buffered == 1  # still waiting
    assert core.receive(COORD, home("a", N2), 0.2) == [Flush(A, N2, ["a1"])]


def test_shard_home_elsewhere_for_a_shard_running_here_is_believed_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = region(registered=True)
    hosting_shard(core, "a")
    with caplog.at_level(logging.WARNING, logger="p2pshard.region"):
        assert core.receive(COORD, home("a", N2), 0.1) == []
    assert "runs here" in caplog.text
    assert core.homes == {A: N2}
    assert core.local == {A: LocalShard.RUNNING}


# -- 5. retries -----------------------------------------------------------------------------


def test_tick_asks_again_for_shards_still_without_a_home() -> None:
    core = region(registered=True)
    assert core.buffer(B, "b1", 0.0) == [ask("b")]
    assert core.buffer(A, "a1", 0.5) == [ask("a")]
    assert core.tick(RETRY - 0.01) == []
    assert core.tick(RETRY) == [ask("a"), ask("b")]
    assert core.next_deadline() == 2 * RETRY

    core.receive(COORD, home("a", N2), 2.5)
    stopping_shard(core, "c", handoff_id=1, now=2.5)
    assert core.buffer(C, "c1", 2.6) == []  # stopping here: asked for once it stopped
    assert core.tick(2 * RETRY) == [ask("b")]  # neither a (known) nor c (stopping)
    assert core.tick(2 * RETRY + 1) == []


def test_tick_does_not_ask_before_registration() -> None:
    core = region()
    assert core.tick(0.0) == [register()]
    core.buffer(A, "a1", 0.0)
    effects = core.tick(RETRY)
    assert ask("a") not in effects
    assert all(e == register() for e in effects)


# -- 6. BeginHandOff ------------------------------------------------------------------------


def test_begin_hand_off_forgets_the_home_and_acks_through_the_owner() -> None:
    core = region(registered=True)
    core.receive(COORD, home("a", N2), 0.0)
    assert core.receive(COORD, begin("a", handoff_id=7), 0.1) == [SendTo(N2, begin_ack("a", 7))]
    assert A not in core.homes
    # Later messages buffer and ask the coordinator again.
    assert core.buffer(A, "a1", 0.2) == [ask("a")]


def test_begin_hand_off_for_an_unknown_home_acks_to_the_coordinator() -> None:
    core = region(registered=True)
    assert core.receive(COORD, begin("a", handoff_id=3), 0.0) == [
        ToCoordinator(begin_ack("a", 3)),
    ]
    p = proxy(registered=True)
    [effect] = p.receive(COORD, begin("a", handoff_id=4), 0.0)
    assert effect == ToCoordinator(begin_ack("a", 4))


def test_begin_hand_off_for_a_shard_owned_here_acks_to_the_coordinator() -> None:
    core = region(registered=True)
    hosting_shard(core, "a")
    assert core.receive(COORD, begin("a", handoff_id=9), 0.1) == [ToCoordinator(begin_ack("a", 9))]
    assert A not in core.homes
    assert core.local == {A: LocalShard.RUNNING}  # it runs until HandOff


def test_a_relayed_begin_hand_off_ack_goes_on_to_the_coordinator_unchanged() -> None:
    core = region(registered=True)
    hosting_shard(core, "a")
    relayed = begin_ack("a", 11, by=N3)
    [effect] = core.receive(N3, relayed, 0.1)
    assert isinstance(effect, ToCoordinator)
    assert effect.message is relayed
    assert core.homes == {A: SELF}


# -- 7. HandOff -----------------------------------------------------------------------------


def test_hand_off_of_a_shard_not_hosted_here_is_answered_at_once() -> None:
    core = region(registered=True)
    core.receive(COORD, home("a", N2), 0.0)
    assert core.receive(COORD, hand_off("a", 5), 0.1) == [stopped("a", 5)]
    assert core.homes == {}
    assert proxy(registered=True).receive(COORD, hand_off("b", 6), 0.0) == [stopped("b", 6)]


def test_hand_off_stops_a_running_shard_then_answers_when_it_stopped() -> None:
    core = region(registered=True)
    hosting_shard(core, "a")
    assert core.receive(COORD, hand_off("a", 5), 0.1) == [StopShard(A)]
    assert core.local == {A: LocalShard.STOPPING}
    assert A not in core.homes
    assert core.shard_stopped(A, 0.5) == [stopped("a", 5)]
    assert core.local == {}
    assert core.shard_stopped(A, 0.6) == []  # once
    assert core.shard_stopped(B, 0.6) == []  # never hosted


def test_a_repeated_hand_off_while_stopping_takes_the_new_id_and_stops_once() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=5)
    assert core.receive(COORD, hand_off("a", 6), 0.2) == []
    assert core.local == {A: LocalShard.STOPPING}
    assert core.shard_stopped(A, 0.5) == [stopped("a", 6)]


def test_host_shard_while_stopping_starts_it_again_once_stopped() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=5)
    assert core.buffer(A, "a1", 0.1) == []
    assert core.receive(COORD, host("a"), 0.2) == []  # remembered (akka#32976)
    assert core.local == {A: LocalShard.STOPPING}
    assert core.buffer(A, "a2", 0.3) == []
    assert core.shard_stopped(A, 0.5) == [
        stopped("a", 5),
        StartShard(A),
        started("a"),
        Flush(A, SELF, ["a1", "a2"]),
    ]
    assert core.local == {A: LocalShard.RUNNING}
    assert core.homes == {A: SELF}
    assert core.buffered == 0


def test_a_hand_off_after_host_shard_while_stopping_cancels_the_restart() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=5)
    assert core.receive(COORD, host("a"), 0.2) == []
    assert core.receive(COORD, hand_off("a", 6), 0.3) == []
    assert core.shard_stopped(A, 0.5) == [stopped("a", 6)]
    assert core.local == {}


def test_shard_home_here_while_stopping_starts_it_again_once_stopped() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=5)
    assert core.receive(COORD, home("a", SELF), 0.2) == []
    effects = core.shard_stopped(A, 0.5)
    assert effects[0] == stopped("a", 5)
    assert StartShard(A) in effects
    assert core.local == {A: LocalShard.RUNNING}


def test_messages_for_a_stopping_shard_are_asked_for_once_it_stopped() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=5)
    assert core.buffer(A, "a1", 0.1) == []
    assert core.buffer(A, "a2", 0.1) == []
    assert core.tick(RETRY) == []
    assert core.shard_stopped(A, 2.5) == [stopped("a", 5), ask("a")]
    assert core.tick(2 * RETRY) == [ask("a")]
    assert core.receive(COORD, home("a", N2), 4.5) == [Flush(A, N2, ["a1", "a2"])]


def test_messages_for_a_shard_that_stopped_while_unregistered_are_asked_for_on_ack() -> None:
    core = region(registered=True)
    stopping_shard(core, "a", handoff_id=5)
    core.buffer(A, "a1", 0.1)
    core.coordinator_changed(0.2)
    assert core.shard_stopped(A, 0.3) == [stopped("a", 5)]  # nobody to ask
    assert core.receive(COORD, ack(), 0.4) == [ask("a")]


# -- 8. regions gone ------------------------------------------------------------------------


def test_regions_gone_forgets_the_homes_on_those_nodes() -> None:
    core = region(registered=True)
    core.receive(COORD, home("a", N2), 0.0)
    core.receive(COORD, home("b", N3), 0.0)
    core.receive(COORD, home("d", N2), 0.0)
    hosting_shard(core, "c")
    assert core.regions_gone([node(2, uid=2)], 0.1) == []  # another incarnation of n2
    assert core.homes == {A: N2, B: N3, ShardId("d"): N2, C: SELF}
    assert core.regions_gone([N2], 0.2) == []
    assert core.homes == {B: N3, C: SELF}
    assert core.buffer(A, "a1", 0.3) == [ask("a")]
    assert core.regions_gone(iter([N3, N2]), 0.4) == []  # any iterable
    assert core.homes == {C: SELF}


# -- 9. graceful shutdown -------------------------------------------------------------------


def test_graceful_shutdown_waits_for_every_shard_to_be_handed_off() -> None:
    core = region(registered=True)
    hosting_shard(core, "a")
    assert core.graceful_shutdown(0.5) == [shutdown_req()]
    assert core.graceful
    assert not has_stopped(core)
    assert core.graceful_shutdown(0.6) == []  # once
    assert core.next_deadline() == RETRY
    assert core.tick(RETRY) == [shutdown_req()]  # repeated while shards are here
    assert core.receive(COORD, hand_off("a", 4), 2.5) == [StopShard(A)]
    assert core.tick(2 * RETRY) == [shutdown_req()]  # still stopping
    assert core.shard_stopped(A, 4.5) == [stopped("a", 4), region_stopped()]
    assert core.stopped
    assert core.next_deadline() == float("inf")
    assert core.tick(3 * RETRY) == []
    assert core.graceful_shutdown(7.0) == []
    assert core.buffer(B, "b1", 7.0) == [Drop(["b1"], "the region has stopped")]
    assert core.dropped == 1


def test_graceful_shutdown_of_an_empty_region_stops_at_once() -> None:
    core = region(registered=True)
    assert core.graceful_shutdown(0.0) == [shutdown_req(), region_stopped()]
    assert core.stopped
    assert core.tick(RETRY) == []


def test_graceful_shutdown_waits_for_buffered_messages_to_leave() -> None:
    core = region(registered=True)
    core.buffer(A, "a1", 0.0)
    assert core.graceful_shutdown(0.1) == [shutdown_req()]
    assert not has_stopped(core)
    assert core.tick(RETRY) == [ask("a")]  # no GracefulShutdownReq: no shard is here
    assert core.receive(COORD, home("a", N2), 2.1) == [Flush(A, N2, ["a1"]), region_stopped()]
    assert core.stopped
    assert core.receive(COORD, home("b", N2), 2.2) == []  # RegionStopped goes out once


def test_graceful_shutdown_of_an_unregistered_region_sends_nothing() -> None:
    core = region()
    assert core.graceful_shutdown(0.0) == []
    assert core.stopped  # nothing to hand off, and no coordinator to tell


def test_graceful_shutdown_of_a_proxy_sends_nothing() -> None:
    core = proxy(registered=True)
    core.buffer(A, "a1", 0.0)
    assert core.graceful_shutdown(0.1) == []
    assert not has_stopped(core)
    assert core.tick(RETRY) == [ask("a")]
    assert core.receive(COORD, home("a", N2), 2.1) == [Flush(A, N2, ["a1"])]
    assert core.stopped


def test_graceful_shutdown_asks_again_after_registering_with_a_new_coordinator() -> None:
    core = region(registered=True)
    hosting_shard(core, "a")
    core.coordinator_changed(0.5)
    assert core.graceful_shutdown(0.6) == []  # no coordinator to ask yet
    assert core.receive(COORD, ack(), 0.7) == []
    assert core.tick(RETRY) == [shutdown_req()]


# -- 10. next_deadline ----------------------------------------------------------------------


def test_next_deadline_in_each_phase() -> None:
    core = region(now=3.0)
    assert core.next_deadline() == 3.0  # the first Register is due
    core.tick(3.0)
    assert 3.0 < core.next_deadline() <= 3.0 + 2 * REGISTER_FIRST_RETRY  # its first repeat

    core.receive(COORD, ack(), 3.1)
    assert core.next_deadline() == 3.0 + RETRY  # the retry timer, from construction
    core.tick(3.0 + RETRY)
    assert core.next_deadline() == 3.0 + 2 * RETRY

    # Unregistered again: the earlier of the next Register and the next retry.
    core.coordinator_changed(6.95)
    assert core.next_deadline() == 7.0  # the retry (6.95 + 0.1 for Register is later)
    assert core.tick(7.0) == []  # nothing to retry while unregistered
    assert core.next_deadline() == pytest.approx(6.95 + REGISTER_FIRST_RETRY)
    assert core.tick(core.next_deadline()) == [register()]

    stopped_core = region(registered=True)
    stopped_core.graceful_shutdown(0.0)
    assert stopped_core.next_deadline() == float("inf")
    refused_core = region()
    refused_core.receive(COORD, refused(), 0.0)
    assert refused_core.next_deadline() == float("inf")


# -- 11. random runs ------------------------------------------------------------------------

SHARD_POOL = [ShardId(s) for s in "abc"]
NODES = [SELF, N2, N3]

Op = tuple[str, int, int]  # (kind, shard index, a number: see decode)

# Each kind's weight is how often it appears here; refusal and shutdown end a run early.
KINDS = [
    *["buffer"] * 8,
    *["home"] * 3,
    *["host"] * 3,
    *["begin"] * 2,
    *["handoff"] * 3,
    *["stopped"] * 3,
    *["tick"] * 2,
    "tick_due",
    "ack",
    "coordinator_changed",
    "gone",
    "graceful",
    "refused",
]


def decode(n: int) -> Op:
    """One op from one drawn integer (one draw per op keeps the runs fast)."""
    n, number = divmod(n, 7)
    kind, shard = divmod(n, len(SHARD_POOL))
    return (KINDS[kind], shard, number)


# (kind, shard index, a number: the node index mod 3, the hand-off id, or half-seconds to wait)
ops = st.lists(
    st.integers(0, len(KINDS) * len(SHARD_POOL) * 7 - 1).map(decode),
    min_size=20,
    max_size=100,
)


@attrs.define
class Run:
    """One randomized run: the core, what went in and what came out."""

    core: ShardRegionCore[int]
    now: float = 0.0
    serial: int = 0
    shard_of: dict[int, ShardId] = attrs.Factory(dict)  # delivery → its shard
    sent: dict[ShardId, list[int]] = attrs.Factory(dict)  # what buffer() got, per shard
    out: dict[int, str] = attrs.Factory(dict)  # delivery → "flush" or "drop"
    flushed: dict[ShardId, list[int]] = attrs.Factory(dict)  # in the order flushed
    dropped: int = 0
    handoff_ids: dict[ShardId, int] = attrs.Factory(dict)  # the latest HandOff per shard
    region_stopped: int = 0

    def step(self, op: Op) -> list[RegionEffect[int]]:
        core = self.core
        kind, index, value = op
        shard = SHARD_POOL[index]
        if kind == "buffer":
            self.serial += 1
            delivery = self.serial
            self.shard_of[delivery] = shard
            self.sent.setdefault(shard, []).append(delivery)
            return core.buffer(shard, delivery, self.now)
        if kind == "home":
            return core.receive(COORD, home(shard, NODES[value % 3]), self.now)
        if kind == "host":
            return core.receive(COORD, host(shard), self.now)
        if kind == "begin":
            return core.receive(COORD, begin(shard, value), self.now)
        if kind == "handoff":
            self.handoff_ids[shard] = value
            return core.receive(COORD, hand_off(shard, value), self.now)
        if kind == "stopped":
            if core.local.get(shard) is LocalShard.RUNNING:
                return []  # the shell calls it only after StopShard
            return core.shard_stopped(shard, self.now)
        if kind in ("tick", "tick_due"):
            if kind == "tick":
                self.now += value * 0.5
            elif core.next_deadline() != float("inf"):
                self.now = max(self.now, core.next_deadline())
            effects = core.tick(self.now)
            assert core.next_deadline() > self.now, "tick left a deadline that is already due"
            return effects
        if kind == "ack":
            return core.receive(COORD, ack(), self.now)
        if kind == "coordinator_changed":
            return core.coordinator_changed(self.now)
        if kind == "gone":
            return core.regions_gone([NODES[1 + value % 2]], self.now)
        if kind == "graceful":
            return core.graceful_shutdown(self.now)
        assert kind == "refused"
        return core.receive(COORD, refused(), self.now)

    def check(
        self, op: Op, local_before: dict[ShardId, LocalShard], effects: Sequence[object]
    ) -> None:
        core = self.core
        for effect in effects:
            match effect:
                case Flush(shard=shard, home=where, deliveries=deliveries):
                    assert deliveries, "an empty Flush"
                    if where == SELF:
                        assert core.hosting
                        assert core.local.get(shard) is LocalShard.RUNNING, (
                            f"Flush to self for shard {shard} not running here"
                        )
                    for d in deliveries:
                        assert self.shard_of[d] == shard, f"{d} flushed with the wrong shard"
                        assert d not in self.out, f"{d} came out twice"
                        self.out[d] = "flush"
                    self.flushed.setdefault(shard, []).extend(deliveries)
                case Drop(deliveries=deliveries):
                    for d in deliveries:
                        assert d not in self.out, f"{d} came out twice"
                        self.out[d] = "drop"
                    self.dropped += len(deliveries)
                case StartShard(shard=shard):
                    assert core.hosting, "a proxy started a shard"
                    before = local_before.get(shard)
                    assert before is not LocalShard.RUNNING, f"shard {shard} started twice"
                    if before is LocalShard.STOPPING:  # started again only once it stopped
                        assert op[0] == "stopped"
                        assert SHARD_POOL[op[1]] == shard
                    assert core.local[shard] is LocalShard.RUNNING
                case StopShard(shard=shard):
                    assert local_before.get(shard) is LocalShard.RUNNING
                    assert core.local[shard] is LocalShard.STOPPING
                case ToCoordinator(message=ShardStopped(shard=shard, handoff_id=handoff_id)):
                    assert handoff_id == self.handoff_ids[ShardId(shard)]
                case ToCoordinator(message=RegionStopped()):
                    self.region_stopped += 1
                    assert core.stopped
                case ToCoordinator(message=ShardStarted()):
                    assert core.hosting
        # The counters agree with the buffers.
        assert core.buffered == sum(len(q) for q in core.buffers.values())
        assert core.buffered <= core.settings.buffer_size
        assert all(core.buffers.values()), "an empty buffer is kept"
        assert core.dropped == self.dropped
        # Every delivery is out exactly once or still buffered, never both.
        buffered = [d for q in core.buffers.values() for d in q]
        assert len(buffered) == len(set(buffered))
        assert not set(buffered) & set(self.out)
        assert set(buffered) | set(self.out) == set(self.shard_of)
        # Per shard, deliveries come out (and wait) in the order they went in.
        for shard, sent in self.sent.items():
            order = {d: i for i, d in enumerate(sent)}
            delivered = [*self.flushed.get(shard, []), *core.buffers.get(shard, [])]
            positions = [order[d] for d in delivered]
            assert positions == sorted(positions), f"shard {shard} out of order: {delivered}"
        for shard, queue in core.buffers.items():
            assert all(self.shard_of[d] == shard for d in queue)
        # A home here is a shard running here.
        for shard, where in core.homes.items():
            if where == SELF:
                assert core.local.get(shard) is LocalShard.RUNNING, (
                    f"home here, {shard} not running"
                )
        if not core.hosting:
            assert core.local == {}
        assert self.region_stopped <= 1
        if core.refused is not None or core.stopped:
            assert core.buffered == 0
            assert core.next_deadline() == float("inf")


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=ops,
    hosting=st.booleans(),
    buffer_size=st.one_of(st.just(100), st.integers(0, 8)),
    start_registered=st.sampled_from([True, True, True, False]),
)
def test_random_inputs_keep_the_invariants(
    steps: list[Op], hosting: bool, buffer_size: int, start_registered: bool
) -> None:
    settings_ = ShardingSettings(buffer_size=buffer_size, retry_interval=1.0)
    core: ShardRegionCore[int] = ShardRegionCore(
        TYPE, SELF, SHARDS, settings_, hosting=hosting, now=0.0
    )
    run = Run(core)
    if start_registered:
        core.tick(0.0)
        core.receive(COORD, ack(), 0.0)
    for op in steps:
        local_before = dict(core.local)
        effects = run.step(op)
        note(f"t={run.now} {op} -> {effects}")
        run.check(op, local_before, effects)


# -- 12. the entity lifecycle ---------------------------------------------------------------

LEGAL = {
    (EntityState.ACTIVE, EntityEvent.CRASHED): EntityState.RESTARTING,
    (EntityState.ACTIVE, EntityEvent.STOP): EntityState.STOPPING,
    (EntityState.ACTIVE, EntityEvent.STOPPED): EntityState.GONE,
    (EntityState.RESTARTING, EntityEvent.RESTARTED): EntityState.ACTIVE,
    (EntityState.RESTARTING, EntityEvent.STOPPED): EntityState.GONE,
    (EntityState.STOPPING, EntityEvent.CRASHED): EntityState.STOPPING,
    (EntityState.STOPPING, EntityEvent.STOPPED): EntityState.GONE,
}
ILLEGAL = [(s, e) for s in EntityState for e in EntityEvent if (s, e) not in LEGAL]


@pytest.mark.parametrize(("state", "event"), list(LEGAL), ids=lambda v: v.value)
def test_every_legal_entity_transition(state: EntityState, event: EntityEvent) -> None:
    assert transition(state, event) is LEGAL[(state, event)]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: v.value)
def test_an_illegal_entity_transition_raises_naming_the_event_and_the_state(
    state: EntityState, event: EntityEvent
) -> None:
    with pytest.raises(IllegalEntityTransition) as info:
        transition(state, event)
    assert str(info.value) == f"entity event {event.value} in state {state.value}"
    assert isinstance(info.value, ValueError)


def test_gone_is_final_and_the_illegal_list_is_complete() -> None:
    assert len(LEGAL) + len(ILLEGAL) == len(EntityState) * len(EntityEvent)
    assert all(s is not EntityState.GONE for s, _ in LEGAL)
    assert (EntityState.RESTARTING, EntityEvent.STOP) in ILLEGAL


# -- the cluster view ---------------------------------------------------------------------------


def test_cluster_changed_registers_again_only_when_the_oldest_changes() -> None:
    core: ShardRegionCore[str] = ShardRegionCore(
        TYPE, SELF, SHARDS, ShardingSettings(), hosting=True, now=0.0, oldest=COORD
    )
    up = {SELF: MemberStatus.UP, N2: MemberStatus.UP, COORD: MemberStatus.UP}
    assert core.cluster_changed(COORD, up, 1.0) == []  # the same coordinator
    assert core.cluster_changed(N2, up, 2.0) == [register()]
    assert core.cluster_changed(N2, up, 3.0) == []
    assert core.cluster_changed(None, {SELF: MemberStatus.UP}, 4.0) == []  # nobody yet: wait


def test_cluster_changed_forgets_homes_on_nodes_down_removed_or_gone() -> None:
    core = region(registered=True)
    core.receive(COORD, home("1", N2), 0.0)
    core.receive(COORD, home("2", N3), 0.0)
    core.receive(COORD, home("3", COORD), 0.0)
    view = {SELF: MemberStatus.UP, N2: MemberStatus.DOWN, COORD: MemberStatus.UP}  # N3 gone
    assert core.cluster_changed(None, view, 1.0) == []
    assert core.homes == {ShardId("3"): COORD}


def test_cluster_changed_starts_the_graceful_shutdown_when_this_node_leaves() -> None:
    core = region(registered=True)
    leaving = {SELF: MemberStatus.LEAVING, COORD: MemberStatus.UP}
    effects = core.cluster_changed(None, leaving, 1.0)
    assert effects[0] == shutdown_req()
    assert core.graceful
    assert core.cluster_changed(None, leaving, 2.0) == []  # once
