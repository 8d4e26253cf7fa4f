"""The replicator on a simulated cluster: quorum reads and writes, gossip, subscriptions."""

from __future__ import annotations

import trio
import trio.testing

from crdt import ReadMajority, WriteLocal, WriteMajority

from .sim import cluster, content, eventually, setter


async def test_majority_write_is_seen_by_a_majority_read_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=1) as c:
        for i in (1, 2, 3):
            await c.start(i)
        await c.all_up(1, 2, 3)
        await c.nodes[1].replicator.update("k", setter("a", "x"), WriteMajority(timeout=2))
        doc = await c.nodes[3].replicator.get("k", ReadMajority(timeout=2))
        assert content(doc) == {"a": "x"}


async def test_local_write_spreads_to_every_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=2) as c:
        for i in (1, 2, 3):
            await c.start(i)
        await c.all_up(1, 2, 3)
        await c.nodes[2].replicator.update("k", setter("a", "y"), WriteLocal())

        def seen(i: int) -> bool:
            return content(c.nodes[i].replicator._core.snapshot("k")) == {"a": "y"}

        await eventually(lambda: seen(1) and seen(3), limit=10)
