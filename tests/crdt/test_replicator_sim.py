"""The replicator on a simulated cluster: quorum reads and writes, gossip, subscriptions."""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from crdt import (
    Changed,
    DataDeleted,
    Deleted,
    GetFailure,
    PendingUpdate,
    ReadConsistency,
    ReadLocal,
    ReadMajority,
    ReplicationError,
    ReplicatorSettings,
    UpdateTimeout,
    WriteConsistency,
    WriteLocal,
    WriteMajority,
)
from crdt._digest import decode_state_vector
from membership import Address, ConfigurationError, LinkConditions, deterministic_scheduling
from tests._support.replicator_sim import (
    HOST,
    ReplicatorCluster,
    cluster,
    content,
    eventually,
    setter,
)


async def test_majority_write_is_seen_by_a_majority_read_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=1) as c:
        await c.start_up(1, 2, 3)
        await c.nodes[1].replicator.update("k", setter("a", "x"), WriteMajority(timeout=2))
        doc = await c.nodes[3].replicator.get("k", ReadMajority(timeout=2))
        assert content(doc) == {"a": "x"}
        await c.nodes[3].replicator.get("k")
        await c.nodes[3].replicator.delete("k", WriteLocal())
        # Each call counted where it was made, under its operation and consistency level.
        [write] = c.nodes[1].replicator.statistics(key_sizes=False).operations
        assert (write.operation, write.consistency, write.started, write.failed) == (
            "write",
            "majority",
            1,
            0,
        )
        assert write.seconds.count == 1
        assert write.seconds.sum > 0  # the replicas' acknowledgements take simulated time
        calls = c.nodes[3].replicator.statistics().operations
        assert [(o.operation, o.consistency, o.started, o.seconds.count) for o in calls] == [
            ("delete", "local", 1, 1),
            ("read", "local", 1, 1),
            ("read", "majority", 1, 1),
        ]
        assert c.nodes[2].replicator.statistics().operations == ()


async def test_start_update_sends_before_it_returns_and_result_gives_the_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=11) as c:
        await c.start_up(1, 2, 3)
        node = c.nodes[1]

        def frames_out() -> int:
            return sum(p.frames_sent + p.queued_frames for p in node.transport_statistics().peers)

        def set_a(doc: Any) -> str:
            setter("a", "x")(doc)
            return "set"

        before = frames_out()
        pending = node.replicator.start_update("k", set_a, WriteMajority(timeout=2))
        assert frames_out() >= before + 2  # the writes to both others left (no await between)
        assert content(node.replicator._core.snapshot("k")) == {"a": "x"}
        assert await pending.result() == "set"  # once a majority confirmed
        assert content(await c.nodes[3].replicator.get("k", ReadMajority(timeout=2))) == {"a": "x"}
        c.net.isolate(Address(HOST, 1))
        late = node.replicator.start_update("k", setter("a", "y"), WriteMajority(timeout=1))
        with pytest.raises(UpdateTimeout):
            await late.result()
        with pytest.raises(ValueError, match="key"):
            node.replicator.start_update("", setter("a", "z"))


async def test_on_success_runs_in_the_task_that_takes_the_confirmation(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    async with cluster(seed=12) as c:
        await c.start_up(1, 2, 3)
        replicator = c.nodes[1].replicator
        calls: list[tuple[str, bool]] = []
        waiter_task: list[trio.lowlevel.Task] = []

        def note(name: str, pending: PendingUpdate[None]) -> Callable[[], None]:
            def called() -> None:
                # Before the waiting task has run again: it learns the outcome afterwards.
                calls.append((name, trio.lowlevel.current_task() in waiter_task))
                assert pending.done

            return called

        async def wait_for(pending: PendingUpdate[None]) -> None:
            waiter_task.append(trio.lowlevel.current_task())
            await pending.result()
            assert calls[-1][0] == "confirmed"

        confirmed = replicator.start_update("k", setter("a", "x"), WriteMajority(timeout=2))
        confirmed.on_success(note("confirmed", confirmed))
        with pytest.raises(ValueError, match="already has an on_success"):
            confirmed.on_success(note("twice", confirmed))
        assert not confirmed.done
        await wait_for(confirmed)
        assert calls == [("confirmed", False)]

        # A callback that raises is logged; the update's outcome is not affected.
        def broken() -> None:
            raise RuntimeError("broken callback")

        raising = replicator.start_update("k", setter("a", "y"), WriteMajority(timeout=2))
        raising.on_success(broken)
        with caplog.at_level(logging.ERROR, logger="crdt.replicator"):
            await raising.result()
        assert "an on_success callback of an update failed" in caplog.text
        assert "broken callback" in caplog.text

        # Never called for a write that fails, nor for one whose waiter gave up.
        c.net.isolate(Address(HOST, 1))
        failed = replicator.start_update("k", setter("a", "z"), WriteMajority(timeout=1))
        failed.on_success(note("failed", failed))
        with pytest.raises(UpdateTimeout):
            await failed.result()
        c.net.heal()
        abandoned = replicator.start_update("k", setter("b", "1"), WriteMajority(timeout=2))
        abandoned.on_success(note("abandoned", abandoned))
        with trio.move_on_after(0):
            await abandoned.result()
        await trio.sleep(3)
        assert calls == [("confirmed", False)]


async def test_a_write_times_out_on_time_and_a_local_write_spreads_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The replicator's timer sleeps until its next gossip round (2 s): a write whose timeout is
    # sooner, or a local write whose delta is due sooner, must wake it.
    async with cluster(seed=13) as c:
        await c.start_up(1, 2, 3)
        replicator = c.nodes[1].replicator
        core = replicator._core
        await trio.sleep_until(core._next_gossip + 0.01)  # just after a round: the next is far
        c.net.isolate(Address(HOST, 1))
        started = trio.current_time()
        with pytest.raises(UpdateTimeout):
            await replicator.update("k", setter("a", "x"), WriteMajority(timeout=0.3))
        assert trio.current_time() - started == pytest.approx(0.3, abs=0.01)
        c.net.heal()
        await trio.sleep_until(core._next_gossip + 0.01)
        await replicator.update("k", setter("a", "y"), WriteLocal())
        started = trio.current_time()
        with trio.fail_after(5):
            while content(c.nodes[2].replicator._core.snapshot("k")) != {"a": "y"}:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert trio.current_time() - started <= core.settings.delta_interval + 0.03


async def test_local_write_spreads_to_every_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=2) as c:
        await c.start_up(1, 2, 3)
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
        await c.start_up(1, 2, 3)
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


def replicas_identical(c: ReplicatorCluster, numbers: tuple[int, ...]) -> bool:
    cores = [c.nodes[i].replicator._core for i in numbers]
    keys = cores[0].held_keys()
    return (
        all(core.held_keys() == keys for core in cores)
        and all(core.deleted_keys() == cores[0].deleted_keys() for core in cores)
        and all(len({core.digest(k) for core in cores}) == 1 for k in keys)
    )


async def test_write_majority_without_a_majority_times_out_then_arrives_after_heal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=5) as c:
        await c.start_up(*range(1, 6))
        c.net.partition([Address(HOST, 1), Address(HOST, 2)], [Address(HOST, i) for i in (3, 4, 5)])
        started = trio.current_time()
        with pytest.raises(UpdateTimeout, match="confirmed by 2 of the 3 replicas"):
            await c.nodes[1].replicator.update(
                "k", setter("a", "minority"), WriteMajority(timeout=1.5)
            )
        assert trio.current_time() - started == pytest.approx(1.5)
        assert content(await c.nodes[1].replicator.get("k")) == {"a": "minority"}  # kept
        with pytest.raises(GetFailure):
            await c.nodes[1].replicator.get("k", ReadMajority(timeout=1.0))
        assert await c.nodes[4].replicator.get("k", ReadMajority(timeout=1.0)) is None
        # The failures are counted, and not timed: only successes are.
        calls = {
            (o.operation, o.consistency): (o.started, o.failed, o.seconds.count)
            for o in c.nodes[1].replicator.statistics(key_sizes=False).operations
        }
        assert calls == {
            ("write", "majority"): (1, 1, 0),
            ("read", "local"): (1, 0, 1),
            ("read", "majority"): (1, 1, 0),
        }
        c.net.heal()
        await eventually(
            lambda: all(
                content(c.nodes[i].replicator._core.snapshot("k")) == {"a": "minority"}
                for i in range(1, 6)
            ),
            limit=30,
        )


async def test_replicas_converge_over_lossy_duplicating_reordering_links_after_heal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seed = 21
    print(f"seed={seed}")
    rng = random.Random(seed)
    bad = LinkConditions(drop=0.2, duplicate=0.1, reorder=0.3, delay_min=0.001, delay_max=0.05)
    async with cluster(seed) as c:
        await c.start_up(1, 2, 3)
        c.net.set_conditions(bad)
        for step in range(300):
            node = c.nodes[rng.randint(1, 3)].replicator
            key = f"k{rng.randrange(15)}"
            if rng.random() < 0.02 and key in set(node.keys()):
                with contextlib.suppress(DataDeleted):
                    await node.delete(key)
            else:
                with contextlib.suppress(DataDeleted):
                    await node.update(key, setter(f"f{rng.randrange(5)}", step))
            await trio.sleep(rng.uniform(0, 0.05))
        assert not replicas_identical(c, (1, 2, 3))  # the faults did leave them apart
        c.net.set_conditions(LinkConditions(delay_min=0.001, delay_max=0.005))
        await eventually(lambda: replicas_identical(c, (1, 2, 3)), limit=60)
        contents = [
            {
                k: content(c.nodes[i].replicator._core.snapshot(k))
                for k in list(c.nodes[1].replicator.keys())
            }
            for i in (1, 2, 3)
        ]
        assert contents[0] == contents[1] == contents[2]


async def test_a_node_that_joins_catches_up_and_subscribers_see_changes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with cluster(seed=8) as c:
        await c.start_up(1, 2)
        for k in range(300):
            await c.nodes[1].replicator.update(f"k{k}", setter("v", k))
        await c.nodes[1].replicator.delete("k0", WriteMajority())
        await c.start(3)
        await eventually(lambda: replicas_identical(c, (1, 2, 3)), limit=30)
        assert len(c.nodes[3].replicator.keys()) == 299
        assert c.nodes[3].replicator._core.is_deleted("k0")

        seen: list[Changed | Deleted] = []
        async with c.nodes[3].replicator.subscribe("k5") as changes:

            async def collect() -> None:
                async for change in changes:
                    seen.append(change)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect)
                await eventually(lambda: len(seen) == 1)  # the current value first
                for v in range(10):  # ten quick changes coalesce
                    await c.nodes[1].replicator.update("k5", setter("v", 100 + v))
                await eventually(
                    lambda: (
                        content(seen[-1].doc) == {"v": 109}
                        if isinstance(seen[-1], Changed)
                        else False
                    )
                )
                assert 2 <= len(seen) < 11
                await c.nodes[2].replicator.delete("k5", WriteMajority())
                await eventually(lambda: isinstance(seen[-1], Deleted))
                nursery.cancel_scope.cancel()
        assert isinstance(seen[0], Changed)
        assert content(seen[0].doc) == {"v": 5}
        with pytest.raises(DataDeleted):
            await c.nodes[3].replicator.update("k5", setter("v", 1))
        stats = c.nodes[3].replicator.statistics()
        assert stats.keys == 298
        assert stats.deleted_keys == 2
        assert stats.gossip_messages_received > 0
        assert stats.pending_writes == 0


def run_replicated_scenario(seed: int) -> tuple[str, dict[str, bytes | None]]:
    """Writes over flaky links, then heal: the trace hash and the final digests of n1."""

    async def scenario() -> tuple[str, dict[str, bytes | None]]:
        rng = random.Random(seed)
        bad = LinkConditions(drop=0.1, duplicate=0.1, reorder=0.2, delay_min=0.001, delay_max=0.02)
        async with cluster(seed) as c:
            await c.start_up(1, 2, 3)
            c.net.set_conditions(bad)
            for step in range(60):
                node = c.nodes[rng.randint(1, 3)].replicator
                with contextlib.suppress(UpdateTimeout):
                    await node.update(
                        f"k{rng.randrange(5)}", setter("v", step), WriteMajority(timeout=0.5)
                    )
            c.net.set_conditions(LinkConditions(delay_min=0.001, delay_max=0.005))
            await eventually(lambda: replicas_identical(c, (1, 2, 3)), limit=60)
            core = c.nodes[1].replicator._core
            return c.net.trace_hash(), {k: core.digest(k) for k in core.held_keys()}

    clock = trio.testing.MockClock(autojump_threshold=0)
    with deterministic_scheduling(seed):
        return trio.run(scenario, clock=clock)


def test_same_seed_replays_the_same_replicated_run() -> None:
    first = run_replicated_scenario(31)
    assert run_replicated_scenario(31) == first  # same trace, same client ids, same documents
    assert run_replicated_scenario(32)[0] != first[0]


async def test_a_replicator_for_a_role_keeps_its_keys_on_members_with_the_role(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = ReplicatorSettings(name="backend", role="backend", gossip_interval=0.5)
    async with cluster(seed=9) as c:
        c.roles = {1: ("backend",), 2: ("backend",)}
        await c.start_up(1, 2, 3)
        first = await c.nodes[1].start_replicator(backend)
        second = await c.nodes[2].start_replicator(backend)
        with pytest.raises(ConfigurationError, match="role 'backend', which this node does not"):
            await c.nodes[3].start_replicator(backend)
        with pytest.raises(ConfigurationError, match="already runs on this node"):
            await c.nodes[1].start_replicator(backend)
        # Two replicas of the role: a majority is both of them, whatever the third node does.
        c.net.isolate(Address(HOST, 3))
        await first.update("shards", setter("s1", "n1"), WriteMajority(timeout=1))
        assert content(await second.get("shards")) == {"s1": "n1"}
        assert c.nodes[1].replicator.keys() == []  # the node's default replicator: separate keys
        c.net.heal()
        c.net.isolate(Address(HOST, 2))
        with pytest.raises(UpdateTimeout, match="1 of the 2"):
            await first.update("shards", setter("s2", "n1"), WriteMajority(timeout=1))
