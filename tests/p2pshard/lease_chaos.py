"""Random partitions, crashes and pauses against sharded entities, with a single-activation check.

Theory of operation: :func:`run_chaos` runs a five-node cluster on the simulated network under
the mock clock, every node with the entity type ``Counter`` (shard leases on or off) and a shared
:class:`p2pshard.MemoryLeaseBackend`. A seeded schedule injects one fault at a time: a partition
(a random minority cut off both ways), a crash (the node restarts later as a new incarnation), or
a pause (every message to and from the node, and its lease calls, wait until it resumes, as under
a long GC pause or CPU starvation). A node that is downed exits, as the ``p2pshard node`` command
does, and is started again, as a supervisor would. Meanwhile a workload tells entities from random
nodes, so shards keep being allocated and entities started.

:class:`ActivationChecker` records every incarnation through ``node.sharding.observe``: it starts
when the entity object is made and ends when it is dropped or its node stops. The invariant is
that no two incarnations of one entity are alive at the same instant. Because the whole cluster
shares one clock, "the same instant" is exact here.
"""

from __future__ import annotations

import random
import signal

import attrs
import trio
import trio.testing

from membership import LinkConditions, deterministic_scheduling
from p2pshard import EntityId, HashExtractor, MemoryLeaseBackend, Node, ShardingSettings

from .sharding_sim import ActivationChecker, Add, SimCluster, addr, counter_factory, sim_cluster

NODES = 5
WALL_LIMIT = 120
"""Real seconds one run may take (about 2 s is usual): past it the run fails instead of hanging
(under the mock clock, a task that spins without sleeping stops time)."""
ENTITIES = 20
SHARDS = 10


@attrs.define
class ChaosResult:
    seed: int
    violations: list[str]
    faults: list[str]
    incarnations: int
    delivered: int
    trace_hash: str


async def _chaos(
    seed: int, *, use_lease: bool, duration: float, double_activation_at: float | None
) -> ChaosResult:
    rng = random.Random(seed)
    checker = ActivationChecker()
    backend = MemoryLeaseBackend(latency=lambda: rng.uniform(0.001, 0.02))
    faults: list[str] = []
    delivered = [0]

    async def setup(i: int, node: Node, sim: SimCluster) -> None:
        node.sharding.observe(checker.observer(f"n{i}"))
        sim.regions[i] = await node.sharding.start(
            "Counter",
            counter_factory(sim.journal, f"n{i}"),
            extractor=HashExtractor(SHARDS),
            settings=ShardingSettings(
                use_lease=use_lease, lease_retry_interval=1.0, rebalance_interval=5.0
            ),
        )

    conditions = LinkConditions(delay_min=0.001, delay_max=0.005)
    async with sim_cluster(seed, setup, conditions=conditions) as sim:
        sim.lease_backend = backend
        sim.exit_when_terminated = True
        crashed: set[int] = set()
        restarting: set[int] = set()

        async def restart_later(i: int, delay: float) -> None:
            await trio.sleep(delay)
            crashed.discard(i)
            restarting.discard(i)
            if i not in sim.nodes:
                await sim.start(i)

        def on_exit(i: int) -> None:
            checker.node_gone(f"n{i}")
            if i not in crashed and i not in restarting:  # downed: a supervisor restarts it
                restarting.add(i)
                faults.append(f"{trio.current_time():.1f} n{i} exited (downed); restarts")
                sim.nursery.start_soon(restart_later, i, rng.uniform(2.0, 6.0))

        sim.on_exit = on_exit
        for i in range(1, NODES + 1):
            await sim.start(i)
        await sim.all_up(list(range(1, NODES + 1)))

        async def workload() -> None:
            sequence = 0
            while True:
                await trio.sleep(0.1)
                live = sorted(i for i in sim.regions if i in sim.nodes)
                if not live:
                    continue
                i = rng.choice(live)
                sequence += 1
                entity = f"e{rng.randrange(ENTITIES)}"
                with trio.move_on_after(1.0):
                    try:
                        await (
                            sim.regions[i]
                            .entity_ref(entity)
                            .tell(Add(sender=f"w{i}", seq=sequence))
                        )
                        delivered[0] += 1
                    except Exception:  # a stopping node, a full buffer: the workload goes on
                        pass

        async def inject_double_activation() -> None:
            """Start a live entity's shard on a second node too, past its lease (a test fault)."""
            assert double_activation_at is not None
            await trio.sleep(double_activation_at)
            live = sorted(
                (node, entity) for node, spans in checker.open.items() for entity in spans
            )
            node_name, entity_id = live[0]
            entity = EntityId(entity_id)
            other = next(i for i in sorted(sim.nodes) if f"n{i}" != node_name)
            faults.append(f"{trio.current_time():.1f} test fault: {entity} on n{other} too")
            region = sim.nodes[other].sharding.region("Counter")
            shard_id = region._extractor.shard_id(entity)
            region._start_shard(shard_id)
            shard = region._running[shard_id]
            shard.take_pending()  # skip the lease: deliver at once
            shard.deliver(entity, Add(sender="fault", seq=0), None)

        sim.nursery.start_soon(workload)
        if double_activation_at is not None:
            sim.nursery.start_soon(inject_double_activation)

        start = trio.current_time()
        while trio.current_time() - start < duration:
            await trio.sleep(rng.uniform(1.0, 5.0))
            live = sorted(i for i in sim.nodes if i not in crashed)
            if len(live) < 3:
                continue
            now = trio.current_time()
            kind = rng.choice(["partition", "crash", "pause"])
            if kind == "partition":
                minority = rng.sample(live, rng.randint(1, len(live) // 2))
                rest = [i for i in range(1, NODES + 1) if i not in minority]
                sim.net.partition([addr(i) for i in minority], [addr(i) for i in rest])
                lasting = rng.uniform(2.0, 15.0)
                faults.append(f"{now:.1f} partition {minority} for {lasting:.1f}s")
                await trio.sleep(lasting)
                sim.net.heal()
            elif kind == "crash":
                i = rng.choice(live)
                crashed.add(i)
                faults.append(f"{now:.1f} crash n{i}")
                sim.crash(i)
                sim.nursery.start_soon(restart_later, i, rng.uniform(3.0, 12.0))
            else:
                i = rng.choice(live)
                lasting = rng.uniform(1.0, 10.0)
                faults.append(f"{now:.1f} pause n{i} for {lasting:.1f}s")
                held = LinkConditions(delay_min=lasting, delay_max=lasting)
                for j in range(1, NODES + 1):
                    if j != i:
                        sim.net.set_link(addr(i), addr(j), held)
                        sim.net.set_link(addr(j), addr(i), held)
                backend.pause(f"{addr(i)}", now + lasting)
                await trio.sleep(lasting)
                for j in range(1, NODES + 1):
                    if j != i:
                        sim.net.set_link(addr(i), addr(j), conditions)
                        sim.net.set_link(addr(j), addr(i), conditions)
        sim.net.heal()
        await trio.sleep(20.0)  # quiet: the last fault's consequences play out
        result = ChaosResult(
            seed,
            checker.violations(),
            faults,
            checker.incarnations(),
            delivered[0],
            sim.net.trace_hash(),
        )
        for i in list(sim.nodes):
            sim.crash(i)
        return result


def run_chaos(
    seed: int,
    *,
    use_lease: bool = True,
    duration: float = 60.0,
    double_activation_at: float | None = None,
) -> ChaosResult:
    """One seeded chaos run in its own ``trio.run`` (replayable from ``seed``)."""

    async def main() -> ChaosResult:
        return await _chaos(
            seed, use_lease=use_lease, duration=duration, double_activation_at=double_activation_at
        )

    def hung(signum: int, frame: object) -> None:
        raise ChaosHung(
            f"seed {seed}: not done after {WALL_LIMIT} s of real time: a task that never lets "
            "the mock clock move on (a busy loop)?"
        )

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(WALL_LIMIT)
    try:
        with deterministic_scheduling(seed):
            return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class ChaosHung(BaseException):
    """A chaos run took longer than ``WALL_LIMIT`` seconds of real time.

    A BaseException, so that no ``except Exception`` in the code under test swallows it.
    """
