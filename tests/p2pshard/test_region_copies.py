"""The region's ordering rules (``SendOrder``), and the hot-path copy of one of them.

``ShardRegion._send`` spells ``SendOrder.remote_home`` out inline, for speed. The randomized
test feeds a live region's ``_send`` and ``SendOrder.remote_home`` the same states (seeded; the
seed is printed, and ``REGION_COPIES_SEED=<seed>`` replays it) and checks that both send the
message to the same node, or both keep it here.
"""

from __future__ import annotations

import collections
import os
import random

import attrs
import trio
import trio.testing

from membership import Address, UniqueAddress
from p2pshard.sharding._allocation import EntityId, ShardId
from p2pshard.sharding._region import Delivery
from p2pshard.sharding._region_core import SendOrder, ShardRegionCore
from p2pshard.sharding._settings import ShardingSettings
from tests._support.sharding_sim import CounterAdd, sim_cluster


def node(i: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", i), f"n{i}", uid)


SELF, N2, N3 = node(1), node(2), node(3)
A, B = ShardId("a"), ShardId("b")


def order() -> tuple[ShardRegionCore[str], SendOrder[str]]:
    core: ShardRegionCore[str] = ShardRegionCore(
        "counter", SELF, 10, ShardingSettings(), hosting=True, now=0.0
    )
    return core, SendOrder(core)


# -- SendOrder, sans-IO ---------------------------------------------------------------------


def test_a_message_goes_straight_to_a_known_remote_home_only() -> None:
    core, rules = order()
    assert rules.remote_home(A, ()) is None  # no home known: it stays (the core buffers it)
    core.homes[A] = N2
    assert rules.remote_home(A, ()) is N2
    assert rules.remote_home(A, {A}) is None  # running here (the table is behind)
    core.homes[B] = SELF
    assert rules.remote_home(B, ()) is None


def test_newer_messages_wait_behind_a_buffer_on_its_way_to_another_node() -> None:
    core, rules = order()
    core.homes[A] = N2
    rules.flushing[A] = collections.deque(["a1", "a2"])
    assert rules.remote_home(A, ()) is None  # not straight there: it would overtake them
    queue = rules.behind_flush(A)
    assert queue is rules.flushing[A]
    assert rules.behind_flush(B) is None  # nothing on its way: the core buffers it
    del core.homes[A]  # the shard moves again: the core buffers newer ones
    assert rules.behind_flush(A) is None
    core.homes[A] = SELF
    assert rules.behind_flush(A) is None


def test_a_relayed_hand_off_ack_waits_for_every_earlier_send_to_the_owner() -> None:
    _, rules = order()
    assert not rules.ack_waits(A, gathered_for_owner=False)
    assert rules.ack_waits(A, gathered_for_owner=True)
    rules.block(A)
    rules.block(A)
    assert rules.ack_waits(A, gathered_for_owner=False)
    assert not rules.ack_waits(B, gathered_for_owner=False)
    assert not rules.unblock(A)  # one send still waits
    assert rules.ack_waits(A, gathered_for_owner=False)
    assert rules.unblock(A)
    assert not rules.ack_waits(A, gathered_for_owner=False)
    rules.flushing[A] = collections.deque(["a1"])
    assert rules.ack_waits(A, gathered_for_owner=False)


# -- the copy in ShardRegion._send ----------------------------------------------------------


@attrs.define
class RecordingTransport:
    """Stands in for the region's transport: records sends, never busy."""

    settings: object
    sent: list[UniqueAddress] = attrs.Factory(list)

    def backlog(self, to: UniqueAddress) -> int:
        return 0

    def send_nowait(self, to: UniqueAddress, message: object) -> None:
        self.sent.append(to)


CASES = 300


async def test_send_decides_as_send_order_remote_home(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seed = int(os.environ.get("REGION_COPIES_SEED", random.randrange(2**32)))
    print(f"REGION_COPIES_SEED={seed}")
    rng = random.Random(seed)
    async with sim_cluster(seed % 1000) as sim:
        await sim.start_up([1])
        region = sim.regions[1]
        self_node = region._self_node
        twin = UniqueAddress(self_node.address, self_node.name, self_node.uid)  # equal, not it
        homes_choice: list[UniqueAddress | None] = [None, self_node, twin, N2, N3]
        shards = [ShardId(f"s{i}") for i in range(6)]
        transport = RecordingTransport(region._transport.settings)
        kept: list[ShardId] = []

        def place_here(
            shard_id: ShardId, entity_id: EntityId, message: object, reply: object
        ) -> bool:
            kept.append(shard_id)
            return True

        saved = (region._transport, dict(region._core.homes), region._running)
        region._transport = transport  # type: ignore[assignment]
        region._place_here = place_here  # type: ignore[method-assign]
        try:
            for case in range(CASES):
                region._core.homes.clear()
                region._flushing.clear()
                running = {s for s in shards if rng.random() < 0.3}
                region._running = {s: None for s in running}  # type: ignore[misc]
                for shard in shards:
                    home = rng.choice(homes_choice)
                    if home is not None:
                        region._core.homes[shard] = home
                    if rng.random() < 0.2:
                        region._flushing[shard] = collections.deque[Delivery]()
                shard = rng.choice(shards)
                entity_id = EntityId(f"e-{case}")
                region._shard_cache[entity_id] = shard
                expected = region._order.remote_home(shard, region._running)
                transport.sent.clear()
                kept.clear()

                await region._send(entity_id, CounterAdd(sender="t", seq=case), None)

                state = f"case {case} (seed {seed}): shard {shard}, running {sorted(running)}"
                if expected is None:
                    assert kept == [shard], f"{state}: kept here by the rule, sent by _send"
                    assert transport.sent == []
                else:
                    assert transport.sent == [expected], f"{state}: _send sent elsewhere"
                    assert kept == []
        finally:
            region._flushing.clear()
            region._core.homes.clear()
            region._transport, homes, region._running = saved
            region._core.homes.update(homes)
            del region._place_here
