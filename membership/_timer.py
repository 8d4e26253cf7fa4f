"""The one contract every sans-IO core keeps, and the driver that runs any core's timers.

A core is a plain object: each input (a message, a cluster change, a finished write) is a
method call that takes the current time ``now`` and returns the effects it decided, as a list;
:meth:`TimedCore.tick` is the input "time passed", and :meth:`TimedCore.next_deadline` says
when the core next wants one. The core never reads a clock and never sleeps, so a test drives
it with made-up times.

Its trio shell feeds it inputs as they arrive and carries out the effects. The shell's timer
loop is a :class:`CoreTimer`: it sleeps until the core's next deadline, and after an input the
shell calls :meth:`CoreTimer.poke`, which wakes the loop only when that input brought the
deadline closer than the loop is sleeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import trio

EffectT_co = TypeVar("EffectT_co", covariant=True)

NEVER = float("inf")
"""The deadline of a core that wants no timer: it waits for its next input."""


class TimedCore(Protocol[EffectT_co]):
    """What a sans-IO core offers its timer: when it is next due, and what it does then."""

    def next_deadline(self) -> float:
        """When the core next wants :meth:`tick` (trio time; ``inf`` for never)."""
        ...

    def tick(self, now: float) -> Sequence[EffectT_co]:
        """Time passed: do what is due at ``now`` and return the effects."""
        ...


class CoreTimer:
    """Sleeps until a deadline, and wakes early when an input brings the deadline closer.

    Args:
        next_deadline: When the loop should next wake, read afresh before every sleep and by
            :meth:`poke`. Usually a core's :meth:`TimedCore.next_deadline`, or the earliest of
            it and deadlines the shell keeps itself.
    """

    __slots__ = ("_next_deadline", "_sleeping_until", "_wakeup")

    def __init__(self, next_deadline: Callable[[], float]) -> None:
        self._next_deadline = next_deadline
        self._wakeup = trio.Event()
        # While the loop works (not asleep) every poke is redundant: it re-reads the deadline.
        self._sleeping_until = -NEVER

    @property
    def sleeping_until(self) -> float:
        """The deadline the loop sleeps until now (``-inf`` while it is not asleep)."""
        return self._sleeping_until

    def poke(self) -> None:
        """An input reached the core: wake the loop if the deadline is now sooner."""
        if self._next_deadline() < self._sleeping_until:
            self._wakeup.set()

    def wake(self) -> None:
        """Wake the loop now, whatever the deadline (a deadline the timer cannot read moved)."""
        self._wakeup.set()

    async def wait(self) -> float:
        """Sleep until the deadline or a wake-up, and return the time then (``trio`` time)."""
        self._sleeping_until = self._next_deadline()
        with trio.move_on_at(self._sleeping_until):
            await self._wakeup.wait()
        self._wakeup = trio.Event()
        self._sleeping_until = -NEVER
        return trio.current_time()
