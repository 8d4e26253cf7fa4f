"""Cluster sharding end to end on the simulated network (mock clock)."""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from membership import deterministic_scheduling
from p2pshard import (
    AskTimeout,
    ConfigurationError,
    EntityContext,
    HashExtractor,
    MemoryLeaseBackend,
    Node,
    ShardingSettings,
    ShardRegion,
    message,
)
from p2pshard.sharding._extractor import stable_shard
from p2pshard.testing import SIM_LEASES, History
from tests._support.sharding_sim import (
    CounterAdd,
    CounterRead,
    CounterSim,
    PassivateMe,
    Sleep,
    StopNow,
    addr,
    sim_cluster,
    standard_setup,
)

Counts = dict[str, dict[str, int]]


async def test_tell_and_ask_reach_one_entity_from_every_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(1) as sim:
        await sim.start_up([1, 2, 3])
        for seq in range(1, 4):
            for i in (1, 2, 3):
                await sim.regions[i].entity_ref("e-1").tell(CounterAdd(sender=f"n{i}", seq=seq))
        answers: list[tuple[str, int]] = []
        for i in (1, 2, 3):
            answer = await sim.regions[i].entity_ref("e-1").ask(CounterRead(), timeout=30)
            assert isinstance(answer, tuple)
            answers.append(answer)
        assert len({owner for owner, _ in answers}) == 1
        assert answers[-1][1] == 9
        sim.journal.check_per_sender_order("e-1", {"n1": 3, "n2": 3, "n3": 3})
        assert len(sim.journal.of("e-1")) == 1


def entity_per_shard(number_of_shards: int) -> dict[str, str]:
    """One entity id for every shard (shard id → entity id)."""
    found: dict[str, str] = {}
    k = 0
    while len(found) < number_of_shards:
        found.setdefault(stable_shard(f"e-{k}", number_of_shards), f"e-{k}")
        k += 1
    return found


async def send_forever(
    sim: CounterSim, i: int, entities: list[str], sent: Counts, *, name: str = "", pause: float
) -> None:
    """Node ``i`` sends numbered Adds to ``entities`` round-robin until cancelled."""
    name = name or f"n{i}"
    while True:
        for entity_id in entities:
            seq = sent.setdefault(entity_id, {}).get(name, 0) + 1
            await sim.regions[i].entity_ref(entity_id).tell(CounterAdd(sender=name, seq=seq))
            sent[entity_id][name] = seq
        await trio.sleep(pause)


async def settle(sim: CounterSim, nodes: list[int], entities: list[str]) -> None:
    """Every node's earlier messages to ``entities`` have been handled."""
    for i in nodes:
        for entity_id in entities:
            await sim.regions[i].entity_ref(entity_id).ask(CounterRead(), timeout=60)


async def owner_of(region: ShardRegion, entity_id: str, *, timeout: float) -> str:  # noqa: ASYNC109
    """The node whose incarnation of ``entity_id`` answers."""
    answer = await region.entity_ref(entity_id).ask(CounterRead(), timeout=timeout)
    assert isinstance(answer, tuple)
    return str(answer[0])


def shard_counts(sim: CounterSim, nodes: list[int]) -> list[int]:
    return [sim.regions[i].statistics().shards for i in nodes]


async def test_a_joining_node_gets_its_share_without_losing_or_reordering_messages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    await joining_scenario(2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
async def test_a_joining_node_under_traffic_many_seeds(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    await joining_scenario(seed)


async def joining_scenario(seed: int) -> None:
    """A 4th node joins 3 with 300 shards while every node writes: balanced in two rounds."""
    shards = 300
    settings = ShardingSettings(rebalance_interval=10.0)
    setup = standard_setup(shards, settings=settings, stop_message=StopNow())
    async with sim_cluster(seed, setup) as sim:
        await sim.start_up([1, 2, 3])
        ids = entity_per_shard(shards)
        for entity_id in ids.values():  # every shard gets a home
            await (
                sim.regions[1 + int(entity_id[2:]) % 3]
                .entity_ref(entity_id)
                .tell(CounterAdd(sender="warmup", seq=1))
            )
        await settle(sim, [1, 2, 3], list(ids.values()))
        assert sum(shard_counts(sim, [1, 2, 3])) == shards
        watched = sorted(ids.values())[::10]  # 30 entities that every node keeps writing to
        sent: Counts = {}
        async with trio.open_nursery() as senders:
            for i in (1, 2, 3):
                senders.start_soon(partial(send_forever, sim, i, watched, sent, pause=0.05))
            # Shards are given a home when a message comes: this keeps every shard in use.
            everything = sorted(ids.values())
            senders.start_soon(partial(send_forever, sim, 2, everything, sent, name="t", pause=1))
            await sim.start(4)
            await sim.all_up([1, 2, 3, 4])
            up_at = trio.current_time()
            with trio.fail_after(60):
                while max(counts := shard_counts(sim, [1, 2, 3, 4])) - min(counts) > 1:  # noqa: ASYNC110
                    await trio.sleep(0.1)
            took = trio.current_time() - up_at
            print(f"balanced {counts} after {took:.1f} s")
            assert took <= 2 * settings.rebalance_interval + 5
            await trio.sleep(5)
            senders.cancel_scope.cancel()
        await settle(sim, [1, 2, 3], everything)
        for entity_id in everything:
            sim.journal.check_per_sender_order(entity_id, sent[entity_id])
        moved = [e for e in watched if len(sim.journal.of(e)) > 1]
        assert moved, "some watched entity should have moved to the new node"
        sim.journal.check_one_at_a_time()
        assert all(sim.regions[i].statistics().dropped == 0 for i in (1, 2, 3, 4))


def hosted(sim: CounterSim, i: int) -> set[str]:
    return {s.shard_id for s in sim.nodes[i].sharding.region_state("Counter").shards}


async def test_the_coordinator_crashing_moves_only_its_shards_and_known_homes_keep_serving(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shards = 40
    async with sim_cluster(3, standard_setup(shards)) as sim:
        await sim.start_up([1, 2, 3])
        ids = entity_per_shard(shards)
        used = {s: e for s, e in ids.items() if int(s) % 2 == 0}  # odd shards stay unused
        for entity_id in used.values():
            for i in (2, 3):  # both survivors learn every home
                await sim.regions[i].entity_ref(entity_id).ask(CounterRead(), timeout=30)
        before = {i: hosted(sim, i) for i in (1, 2, 3)}
        assert all(before.values())
        survivors = [ids[s] for s in sorted(before[2] | before[3])]
        sim.crash(1)  # n1 is the oldest: the coordinator goes with it
        crashed_at = trio.current_time()
        # Known homes answer throughout, with no coordinator at all for a while.
        while trio.current_time() - crashed_at < 20:
            for entity_id in survivors:
                await sim.regions[3].entity_ref(entity_id).ask(CounterRead(), timeout=5)
            await trio.sleep(1)
        # A shard never used before resolves once the new coordinator runs.
        fresh = ids[str(1)]
        owner = await owner_of(sim.regions[3], fresh, timeout=120)
        assert owner in ("n2", "n3")
        # n1's shards come back on the survivors when used; nobody else's moved.
        for shard in sorted(before[1]):
            await sim.regions[2].entity_ref(ids[shard]).ask(CounterRead(), timeout=30)
        for i in (2, 3):
            assert before[i] <= hosted(sim, i)
        assert before[1] <= hosted(sim, 2) | hosted(sim, 3)


async def test_one_get_shard_home_per_new_shard_per_region_and_none_afterwards(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The seeds' scenarios 1 and 2: the first message to a shard asks the coordinator once;
    later messages go straight to the home, from the owner and from every other region."""
    shards = 12
    async with sim_cluster(4, standard_setup(shards)) as sim:
        await sim.start_up([1, 2, 3])
        ids = entity_per_shard(shards)
        for rounds in range(5):
            for i in (1, 2, 3):
                for entity_id in ids.values():
                    await (
                        sim.regions[i]
                        .entity_ref(entity_id)
                        .tell(CounterAdd(sender=f"n{i}", seq=rounds))
                    )
        await settle(sim, [1, 2, 3], list(ids.values()))
        for i in (1, 2, 3):
            stats = sim.regions[i].statistics()
            assert stats.shard_home_requests == shards, (i, stats)
            assert stats.known_homes == shards
        assert sum(r.statistics().shards for r in sim.regions.values()) == shards


async def test_each_step_of_a_new_shards_first_message_goes_from_the_task_that_got_the_last(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """GetShardHome leaves from the asking task, the coordinator's answer from the task that took
    the write's last acknowledgement, the buffered message from the task that took ShardHome: a
    first message waits for no other task to be scheduled on the way."""
    shards = 10
    async with sim_cluster(6, standard_setup(shards)) as sim:
        await sim.start_up([1, 2])  # n1 is the oldest: the coordinator runs there
        sent: list[tuple[int, str, str]] = []
        for i in (1, 2):
            transport = sim.nodes[i].transport
            original = transport.send_nowait

            def recording(to: object, message: object, i: int = i, send: Any = original) -> None:
                task = trio.lowlevel.current_task().name
                sent.append((i, type(message).__name__, task))
                send(to, message)

            transport.send_nowait = recording  # type: ignore[method-assign]
        asker = trio.lowlevel.current_task().name
        homes = set()
        for entity_id in entity_per_shard(shards).values():
            sent.clear()
            answer = await sim.regions[2].entity_ref(entity_id).ask(CounterRead(), timeout=30)
            assert isinstance(answer, tuple)
            homes.add(answer[0])
            steps = [(i, kind, task) for i, kind, task in sent if kind != "Heartbeat"]
            get_home = next(s for s in steps if s[:2] == (2, "SingletonEnvelope"))
            assert get_home[2] == asker, steps
            # ShardHome, or HostShard when the asker's region is the new home.
            answered = next(s for s in steps if s[0] == 1 and s[1] in ("ShardHome", "HostShard"))
            assert "write_event" not in answered[2], steps
            if answer[0] == "n1":
                delivery = next(s for s in steps if s[:2] == (2, "EntityDelivery"))
                assert "_send_flushed" not in delivery[2], steps
        assert homes == {"n1", "n2"}


async def test_graceful_leave_of_the_oldest_hands_off_its_shards_and_the_coordinator(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shards = 30
    setup = standard_setup(shards, stop_message=StopNow())
    async with sim_cluster(5, setup) as sim:
        await sim.start_up([1, 2, 3])
        ids = entity_per_shard(shards)
        everything = sorted(ids.values())
        sent: Counts = {}
        async with trio.open_nursery() as senders:
            for i in (2, 3):
                senders.start_soon(partial(send_forever, sim, i, everything, sent, pause=0.2))
            await trio.sleep(3)
            assert hosted(sim, 1)
            await sim.graceful_leave(1)
            await sim.all_up([2, 3])
            await trio.sleep(3)
            senders.cancel_scope.cancel()
        await settle(sim, [2, 3], everything)
        for entity_id in everything:
            sim.journal.check_per_sender_order(entity_id, sent[entity_id])
        sim.journal.check_one_at_a_time()
        assert hosted(sim, 2) | hosted(sim, 3) == set(ids)
        assert sim.journal.stop_messages > 0  # n1's entities were stopped with the stop message


async def test_the_two_oldest_leaving_at_once(autojump_clock: trio.testing.MockClock) -> None:
    shards = 20
    setup = standard_setup(shards, stop_message=StopNow())
    async with sim_cluster(6, setup) as sim:
        await sim.start_up([1, 2, 3, 4])
        ids = entity_per_shard(shards)
        everything = sorted(ids.values())
        sent: Counts = {}
        async with trio.open_nursery() as senders:
            for i in (3, 4):
                senders.start_soon(partial(send_forever, sim, i, everything, sent, pause=0.2))
            await trio.sleep(3)
            async with trio.open_nursery() as leaving:
                leaving.start_soon(sim.graceful_leave, 1)
                leaving.start_soon(sim.graceful_leave, 2)
            await sim.all_up([3, 4])
            await trio.sleep(3)
            senders.cancel_scope.cancel()
        await settle(sim, [3, 4], everything)
        for entity_id in everything:
            sim.journal.check_per_sender_order(entity_id, sent[entity_id])
        sim.journal.check_one_at_a_time()
        assert hosted(sim, 3) | hosted(sim, 4) == set(ids)


async def test_without_a_write_majority_known_routes_work_and_new_shards_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shards = 10
    async with sim_cluster(7, standard_setup(shards)) as sim:
        sim.stable_after = 1000.0  # nobody is downed: the partition stays a partition
        await sim.start_up([1, 2, 3])
        ids = entity_per_shard(shards)
        owners: dict[str, str] = {}
        for entity_id in [ids[s] for s in sorted(ids)[:6]]:
            for i in (1, 2):
                answer = await sim.regions[i].entity_ref(entity_id).ask(CounterRead(), timeout=30)
                assert isinstance(answer, tuple)
                owners[entity_id] = answer[0]
        reachable = [e for e, owner in owners.items() if owner != "n3"]
        assert reachable
        sim.net.partition([addr(3)], [addr(1), addr(2)])
        # The coordinator (n1) needs every replica for a write in a cluster this small.
        new = ids[sorted(ids)[7]]
        with pytest.raises(AskTimeout):
            await sim.regions[2].entity_ref(new).ask(CounterRead(), timeout=20)
        for entity_id in reachable:  # homes already known keep working
            for i in (1, 2):
                await sim.regions[i].entity_ref(entity_id).ask(CounterRead(), timeout=5)
        sim.net.heal()
        owner = await owner_of(sim.regions[2], new, timeout=60)
        assert owner in ("n1", "n2", "n3")


async def test_min_nr_of_members_holds_allocation_until_enough_regions_registered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    setup = standard_setup(10, settings=ShardingSettings(min_nr_of_members=3))
    async with sim_cluster(8, setup) as sim:
        await sim.start_up([1, 2])
        with pytest.raises(AskTimeout):
            await sim.regions[1].entity_ref("e-1").ask(CounterRead(), timeout=30)
        assert sum(r.statistics().shards for r in sim.regions.values()) == 0
        await sim.start(3)
        owner = await owner_of(sim.regions[1], "e-1", timeout=60)
        assert owner in ("n1", "n2", "n3")


async def test_an_entity_that_ignores_its_stop_message_is_stopped_after_handoff_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = ShardingSettings(handoff_timeout=20.0)
    setup = standard_setup(4, settings=settings, stop_message=Sleep(seconds=10_000))
    async with sim_cluster(9, setup) as sim:
        await sim.start_up([1, 2])
        ids = entity_per_shard(4)
        for entity_id in ids.values():
            await sim.regions[1].entity_ref(entity_id).ask(CounterRead(), timeout=30)
        on_two = sorted(hosted(sim, 2))
        assert on_two
        started = trio.current_time()
        await sim.graceful_leave(2)
        took = trio.current_time() - started
        assert 0.75 * settings.handoff_timeout <= took < settings.handoff_timeout + 20
        for shard in on_two:  # the shard moved: its entity runs again on n1
            owner = await owner_of(sim.regions[1], ids[shard], timeout=30)
            assert owner == "n1"


async def test_remembered_entities_restart_without_a_message_after_their_node_crashed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shards = 12
    settings = ShardingSettings(remember_entities=True)
    setup = standard_setup(shards, settings=settings, stop_message=StopNow())
    async with sim_cluster(10, setup) as sim:
        await sim.start_up([1, 2, 3])
        ids = entity_per_shard(shards)
        for entity_id in ids.values():
            await sim.regions[2].entity_ref(entity_id).ask(CounterRead(), timeout=30)
        on_one = sorted(hosted(sim, 1))
        assert on_one
        # One remembered entity is passivated: it is forgotten and must not come back.
        forgotten = ids[on_one[0]]
        await sim.regions[2].entity_ref(forgotten).ask(PassivateMe(), timeout=30)
        with trio.fail_after(30):
            while any(  # noqa: ASYNC110 - polls region state on the mock clock
                forgotten in s.entity_ids
                for s in sim.nodes[1].sharding.region_state("Counter").shards
            ):
                await trio.sleep(0.1)
        await trio.sleep(5)  # the removal reaches the replicas
        sim.crash(1)  # the coordinator's node, with its shards
        expected = {ids[s] for s in on_one} - {forgotten}
        with trio.fail_after(120):
            while True:
                restarted = {
                    inc.entity_id
                    for inc in sim.journal.incarnations
                    if inc.node != "n1" and inc.entity_id in expected
                }
                if restarted == expected:
                    break
                await trio.sleep(0.5)
        assert not any(
            inc.entity_id == forgotten and inc.node != "n1" for inc in sim.journal.incarnations
        )


@message(name="tests.sharding.Token")
@attrs.frozen
class Token:
    pass


async def test_a_shard_starts_entities_only_while_it_holds_its_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    lifetimes = History()
    name = "sim-shard-Counter-0"

    class Fenced:
        def __init__(self, ctx: EntityContext) -> None:
            self.started = trio.current_time()

        async def receive(self, msg: object, ctx: EntityContext) -> object:
            return (ctx.lease_token, self.started)

    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        node.sharding.observe(lifetimes.observer(f"n{i}"))
        sim.regions[i] = await node.sharding.start(
            "Counter",
            Fenced,
            extractor=HashExtractor(1),
            settings=ShardingSettings(use_lease=True, lease_retry_interval=1.0),
        )

    async with sim_cluster(11, setup) as sim:
        sim.lease_backend = backend
        assert await backend.try_acquire(name, "someone else", 20.0) == 1
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("e")
        with pytest.raises(AskTimeout):  # the lease is taken: no entity starts
            await ref.ask(Token(), timeout=10)
        first = await ref.ask(Token(), timeout=20)  # it expired: granted to n1 with token 2
        assert isinstance(first, tuple)
        assert first[0] == 2
        n1 = str(sim.nodes[1].address)  # leases are owned by a node's incarnation
        assert await backend.holder(name) == (n1, 2)

        # Cut off from the backend: n1 stops the entity before anyone else can take the lease.
        backend.cut_off(n1)
        while await backend.try_acquire(name, "someone else", 20.0) is None:  # noqa: ASYNC110
            await trio.sleep(0.01)
        taken_at = trio.current_time()
        [span] = lifetimes.incarnations["Counter/e"]
        assert span.node == "n1"
        assert span.end is not None
        assert span.end < taken_at
        assert sim.nodes[1].sharding.region_state("Counter").shards[0].entity_ids == frozenset()

        # Back in touch, n1 asks again; a message sent meanwhile waits and reaches the next
        # incarnation, with a larger token, once the other owner's grant expires.
        backend.cut_off(n1, False)
        answer = await ref.ask(Token(), timeout=40)
        assert isinstance(answer, tuple)
        assert answer[0] == 4
        assert answer[1] > taken_at + 19
        spans = lifetimes.incarnations["Counter/e"]
        assert [s.token for s in spans] == [2, 4]


@attrs.define
class LateLease:
    """A shard lease whose holder notices its loss late, as a process stopped past its deadline:
    ``check`` already says False while ``wait_lost`` has not returned yet."""

    held: bool = False
    token: int = 0
    noticed: trio.Event = attrs.field(factory=trio.Event)

    def check(self) -> bool:
        return self.held

    async def acquire(self) -> LateLease:
        self.held, self.token, self.noticed = True, self.token + 1, trio.Event()
        return self

    async def wait_lost(self) -> None:
        await self.noticed.wait()

    async def release(self) -> bool:
        self.held = False
        return True


async def test_no_message_runs_once_the_lease_deadline_passed_even_before_it_is_noticed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lease = LateLease()
    lifetimes = History()

    class Fenced:
        async def receive(self, msg: object, ctx: EntityContext) -> object:
            return ctx.lease_token

    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        node.sharding.observe(lifetimes.observer(f"n{i}"))
        sim.regions[i] = await node.sharding.start(
            "Counter",
            lambda ctx: Fenced(),
            extractor=HashExtractor(1),
            shard_lease=lambda type_name, shard_id: lease,
        )

    async with sim_cluster(14, setup) as sim:
        await sim.start(1)
        await sim.all_up([1])
        ref = sim.regions[1].entity_ref("e")
        assert await ref.ask(Token(), timeout=10) == 1
        lease.held = False  # the deadline passed; the task that would notice has not run
        with pytest.raises(AskTimeout):
            await ref.ask(Token(), timeout=5)  # not handled under a lease that is gone
        [span] = lifetimes.incarnations["Counter/e"]
        assert span.end is not None  # the incarnation ended at once
        lease.noticed.set()  # noticed at last: the shard asks again and gets token 2
        assert await ref.ask(Token(), timeout=10) == 2
        assert [s.token for s in lifetimes.incarnations["Counter/e"]] == [1, 2]


async def test_a_hand_off_releases_the_shard_lease_so_the_new_home_need_not_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    lifetimes = History()

    async def setup(i: int, node: Node, sim: CounterSim) -> None:
        node.sharding.observe(lifetimes.observer(f"n{i}"))
        await standard_setup(
            1, settings=ShardingSettings(use_lease=True, lease_retry_interval=30.0)
        )(i, node, sim)

    async with sim_cluster(12, setup) as sim:
        sim.lease_backend = backend
        await sim.start(1)
        await sim.all_up([1])
        assert await sim.regions[1].entity_ref("e").ask(CounterRead(), timeout=10) == ("n1", 0)
        await sim.start(2)
        await sim.all_up([1, 2])
        await sim.graceful_leave(1)  # the shard moves to n2
        assert await sim.regions[2].entity_ref("e").ask(CounterRead(), timeout=10) == ("n2", 0)
        first, second = lifetimes.incarnations["Counter/e"]
        assert first.node == "n1"
        assert second.node == "n2"
        assert second.token is not None
        assert first.token is not None
        assert second.token > first.token  # a larger token
        # Released at hand-off: taken at the first try, long before the lease could expire
        # (a refusal would have meant waiting lease_retry_interval = 30 s).
        assert first.end is not None
        assert second.start - first.end < SIM_LEASES.ttl
        n2 = str(sim.nodes[2].address)
        assert await backend.holder("sim-shard-Counter-0") == (n2, second.token)


async def test_a_downed_node_gives_its_leases_back_and_a_crashed_one_cannot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Long leases: a failover that waited for them to expire would take 60 s.
    leases = attrs.evolve(SIM_LEASES, ttl=60.0, renew_interval=5.0, operation_timeout=5.0)
    backend = MemoryLeaseBackend()
    settings = ShardingSettings(use_lease=True)
    async with sim_cluster(14, standard_setup(8, settings=settings)) as sim:
        sim.lease_backend, sim.lease_settings = backend, leases
        sim.exit_when_terminated = True
        await sim.start_up([1, 2, 3])
        for k in range(40):
            await sim.regions[1].entity_ref(f"e-{k}").ask(CounterRead(), timeout=30)
        names = [f"sim-shard-Counter-{shard}" for shard in range(8)]

        async def held_by(i: int) -> set[str]:
            owner = str(sim.nodes[i].address)
            return {n for n in names if (h := await backend.holder(n)) and h[0] == owner}

        downed, crashed = await held_by(3), await held_by(2)
        assert downed
        assert crashed
        sim.nodes[1].cluster.down(addr(3))
        await sim.done[3].wait()
        assert {n: await backend.holder(n) for n in downed} == dict.fromkeys(downed)

        owner = str(sim.nodes[2].address)
        sim.crash(2)
        await sim.done[2].wait()
        await trio.sleep(30)  # well within the ttl
        holders = [await backend.holder(n) for n in sorted(crashed)]
        assert [h[0] if h else None for h in holders] == [owner] * len(crashed)


async def test_the_coordinator_runs_under_its_lease_and_leases_need_a_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    settings = ShardingSettings(use_lease=True, coordinator_use_lease=True)
    async with sim_cluster(13, standard_setup(4, settings=settings)) as sim:
        sim.lease_backend = backend
        await sim.start(1)
        await sim.all_up([1])
        assert await sim.regions[1].entity_ref("e").ask(CounterRead(), timeout=10) == ("n1", 0)
        holder = await backend.holder("sim-singleton-sharding/Counter")
        assert holder is not None
        assert holder[0] == str(sim.nodes[1].address)

        sim.lease_backend = None  # a node without a lease backend refuses leases, saying why
        with pytest.raises(ConfigurationError, match=r"use_lease on, but this node has no lease"):
            await sim.start(2)
        assert 2 not in sim.nodes


def run_sharding_scenario(seed: int) -> tuple[str, list[tuple[str, str, float]]]:
    """Three nodes under traffic, the coordinator's node crashes, a fourth joins: the network's
    trace hash and every entity incarnation (node, entity, start time)."""

    async def scenario() -> tuple[str, list[tuple[str, str, float]]]:
        setup = standard_setup(20, settings=ShardingSettings(rebalance_interval=5.0))
        async with sim_cluster(seed, setup) as sim:
            await sim.start_up([1, 2, 3])
            ids = sorted(entity_per_shard(20).values())
            sent: Counts = {}
            async with trio.open_nursery() as senders:
                for i in (2, 3):
                    senders.start_soon(partial(send_forever, sim, i, ids, sent, pause=0.5))
                await trio.sleep(3)
                sim.crash(1)
                await sim.all_up([2, 3])
                await sim.start(4)
                await sim.all_up([2, 3, 4])
                await trio.sleep(15)
                senders.cancel_scope.cancel()
            incarnations = [(i.node, i.entity_id, i.start) for i in sim.journal.incarnations]
            return sim.net.trace_hash(), incarnations

    clock = trio.testing.MockClock(autojump_threshold=0)
    with deterministic_scheduling(seed):
        return trio.run(scenario, clock=clock)


def test_the_same_seed_replays_the_same_sharding_run() -> None:
    first = run_sharding_scenario(31)
    assert run_sharding_scenario(31) == first
    assert run_sharding_scenario(32)[0] != first[0]
