"""The timer driver every core's shell uses: sleeps to the deadline, wakes early only when due."""

from __future__ import annotations

import trio
import trio.testing

from membership.internal import NEVER, CoreTimer


class _Core:
    def __init__(self) -> None:
        self.deadline = NEVER

    def next_deadline(self) -> float:
        return self.deadline


async def test_the_timer_sleeps_until_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    core = _Core()
    core.deadline = trio.current_time() + 5
    timer = CoreTimer(core.next_deadline)
    woke = await timer.wait()
    assert woke == core.deadline
    assert timer.sleeping_until == -NEVER  # awake: not sleeping until anything


async def test_a_poke_wakes_the_timer_only_for_a_sooner_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    core = _Core()
    start = trio.current_time()
    core.deadline = start + 10
    timer = CoreTimer(core.next_deadline)
    woken: list[float] = []

    async def loop() -> None:
        woken.append(await timer.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop)
        await trio.sleep(1)
        assert timer.sleeping_until == start + 10
        core.deadline = start + 20  # later: the poke leaves the sleep alone
        timer.poke()
        await trio.sleep(1)
        assert woken == []
        core.deadline = start + 3  # sooner: the poke wakes the loop now, to sleep again till 3
        timer.poke()
    assert woken == [start + 2]


async def test_wake_wakes_the_timer_whatever_the_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    timer = CoreTimer(lambda: NEVER)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timer.wait)
        await trio.sleep(1)
        assert timer.sleeping_until == NEVER
        timer.wake()
    assert trio.current_time() == 1
