"""Cluster sharding end to end on the simulated network (mock clock)."""

from __future__ import annotations

import trio
import trio.testing

from .sharding_sim import Add, Read, sim_cluster


async def test_tell_and_ask_reach_one_entity_from_every_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with sim_cluster(1) as sim:
        for i in (1, 2, 3):
            await sim.start(i)
        await sim.all_up([1, 2, 3])
        for seq in range(1, 4):
            for i in (1, 2, 3):
                await sim.regions[i].entity_ref("e-1").tell(Add(sender=f"n{i}", seq=seq))
        answers: list[tuple[str, int]] = []
        for i in (1, 2, 3):
            answer = await sim.regions[i].entity_ref("e-1").ask(Read(), timeout=30)
            assert isinstance(answer, tuple)
            answers.append(answer)
        assert len({owner for owner, _ in answers}) == 1
        assert answers[-1][1] == 9
        sim.journal.check_per_sender_order("e-1", {"n1": 3, "n2": 3, "n3": 3})
        assert len(sim.journal.of("e-1")) == 1
