"""The replicator on a simulated cluster: quorum reads and writes, gossip, subscriptions."""

from __future__ import annotations

import contextlib
import os
import random

import attrs
import pytest
import trio
import trio.testing

from crdt import (
    GetFailure,
    ReadConsistency,
    ReadLocal,
    ReadMajority,
    ReplicationError,
    UpdateTimeout,
    WriteConsistency,
    WriteLocal,
    WriteMajority,
)
from crdt._digest import decode_state_vector
from membership import Address

from .sim import HOST, cluster, content, eventually, setter


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


# -- the history check: a majority read that starts after a majority write ended sees it ------


@attrs.frozen
class WriteRecord:
    key: str
    field: str
    ended: float


@attrs.frozen
class ReadRecord:
    key: str
    started: float
    fields: frozenset[str]


@attrs.define
class History:
    writes: list[WriteRecord] = attrs.Factory(list)
    reads: list[ReadRecord] = attrs.Factory(list)
    failed: int = 0

    def stale_reads(self) -> list[tuple[ReadRecord, WriteRecord]]:
        """Reads that missed a write which had ended (acknowledged) before the read started."""
        stale = []
        for read in self.reads:
            for write in self.writes:
                if (
                    write.key == read.key
                    and write.ended < read.started
                    and write.field not in read.fields
                ):
                    stale.append((read, write))
                    break
        return stale


async def run_history(
    seed: int, n: int, write: WriteConsistency, read: ReadConsistency, *, duration: float
) -> History:
    """Clients on random nodes write unique fields and read them back while a random minority
    is cut off now and then; returns what they saw."""
    print(f"history seed={seed} n={n} write={write} read={read}")
    rng = random.Random(seed)
    history = History()
    keys = ["a", "b", "c"]
    async with cluster(seed) as c:
        for i in range(1, n + 1):
            await c.start(i)
        await c.all_up(*range(1, n + 1))
        end = trio.current_time() + duration

        async def client(number: int) -> None:
            client_rng = random.Random(f"{seed}-client-{number}")
            count = 0
            while trio.current_time() < end:
                node = c.nodes[client_rng.randint(1, n)].replicator
                key = client_rng.choice(keys)
                try:
                    if client_rng.random() < 0.5:
                        count += 1
                        field = f"c{number}-{count}"
                        await node.update(key, setter(field, True), write)
                        history.writes.append(WriteRecord(key, field, trio.current_time()))
                    else:
                        started = trio.current_time()
                        doc = await node.get(key, read)
                        fields = frozenset(content(doc) or {})
                        history.reads.append(ReadRecord(key, started, fields))
                except (UpdateTimeout, GetFailure):
                    history.failed += 1
                await trio.sleep(client_rng.uniform(0.0, 0.3))

        async def faults() -> None:
            minority = (n - 1) // 2
            while trio.current_time() < end:
                await trio.sleep(rng.uniform(1.0, 3.0))
                cut = rng.sample(range(1, n + 1), rng.randint(1, minority))
                rest = [i for i in range(1, n + 1) if i not in cut]
                c.net.partition([Address(HOST, i) for i in cut], [Address(HOST, i) for i in rest])
                await trio.sleep(rng.uniform(0.5, 3.0))
                c.net.heal()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(faults)
            for number in range(4):
                nursery.start_soon(client, number)
    print(
        f"writes={len(history.writes)} reads={len(history.reads)} failed={history.failed} "
        f"stale={len(history.stale_reads())}"
    )
    return history


@pytest.mark.parametrize("n", [3, 5, 7])
async def test_majority_reads_see_every_majority_write_that_ended_before(
    autojump_clock: trio.testing.MockClock, n: int
) -> None:
    history = await run_history(
        100 + n, n, WriteMajority(timeout=1.0), ReadMajority(timeout=1.0), duration=40.0
    )
    assert len(history.writes) > 50  # the check had material
    assert len(history.reads) > 50
    assert history.failed > 0  # and the partitions did cut minorities off
    assert history.stale_reads() == []


async def test_the_history_check_finds_stale_local_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    history = await run_history(7, 3, WriteLocal(), ReadLocal(), duration=20.0)
    assert history.stale_reads() != []


async def test_replicas_end_identical_after_one_node_restarts_100_times_under_writes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seed = 11
    print(f"seed={seed}")
    rng = random.Random(seed)
    client_ids: set[int] = set()
    restarts = int(os.environ.get("RESTARTS", "100"))
    async with cluster(seed) as c:
        for i in (1, 2, 3):
            await c.start(i)
        await c.all_up(1, 2, 3)
        client_ids.update(c.nodes[i].replicator.client_id for i in (1, 2, 3))
        done = trio.Event()
        written = 0

        async def writer(i: int) -> None:
            nonlocal written
            while not done.is_set():
                node = c.nodes.get(i)
                if node is not None and not node.terminated.is_set():
                    key = f"k{rng.randrange(20)}"
                    level = WriteMajority(timeout=0.5) if rng.random() < 0.5 else WriteLocal()
                    with contextlib.suppress(ReplicationError):
                        await node.replicator.update(key, setter(f"n{i}", written), level)
                        written += 1
                await trio.sleep(rng.uniform(0.01, 0.2))

        async with trio.open_nursery() as nursery:
            for i in (1, 2, 3):
                nursery.start_soon(writer, i)
            for _ in range(restarts):
                await trio.sleep(rng.uniform(0.1, 1.5))
                await c.crash(3)
                await trio.sleep(rng.uniform(0.0, 0.5))
                node = await c.start(3)
                client_ids.add(node.replicator.client_id)
            await c.all_up(1, 2, 3)
            done.set()
        assert len(client_ids) == 3 + restarts  # a fresh client id at every start

        def identical() -> bool:
            replicas = [c.nodes[i].replicator._core for i in (1, 2, 3)]
            keys = replicas[0].held_keys()
            return all(r.held_keys() == keys for r in replicas) and all(
                len({r.digest(k) for r in replicas}) == 1 for k in keys
            )

        await eventually(identical, limit=60)
        contents = [
            {
                k: content(c.nodes[i].replicator._core.snapshot(k))
                for k in c.nodes[i].replicator.keys()  # noqa: SIM118 - not a dict
            }
            for i in (1, 2, 3)
        ]
        assert contents[0] == contents[1] == contents[2]
        assert len(contents[0]) == 20
        writers: set[int] = set()
        for _, doc in c.nodes[1].replicator._core.documents():
            writers |= decode_state_vector(doc.get_state()).keys()
        assert len(writers & client_ids) > 10  # many incarnations of n3 wrote, none collided
        print(f"writes={written}")
