"""A lease holder measures its deadline on its own clock (``LeaseClock``), which may drift.

The simulated cluster gives each node a :class:`p2pshard.testing.SkewedClock` for its leases, so
the chaos suite can test that ``safety_margin`` covers clocks that run at different rates.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2pshard import Lease, LeaseSettings, LeaseUnavailable, MemoryLeaseBackend
from p2pshard.testing import SkewedClock

SETTINGS = LeaseSettings(ttl=4.0, renew_interval=1.0, operation_timeout=1.0, safety_margin=0.5)


@pytest.mark.parametrize(("rate", "held_for"), [(1.0, 3.5), (0.5, 7.0), (2.0, 1.75)])
async def test_a_cut_off_holder_holds_for_ttl_less_margin_on_its_own_clock(
    autojump_clock: trio.testing.MockClock, rate: float, held_for: float
) -> None:
    backend = MemoryLeaseBackend()
    clock = SkewedClock()
    clock.set_rate(rate)
    async with trio.open_nursery() as nursery:
        lease = Lease(backend, "job", "me", SETTINGS, nursery=nursery, clock=clock)
        start = trio.current_time()
        assert await lease.acquire() is not None
        backend.cut_off("me")  # renewals hang from now on
        while lease.check():  # noqa: ASYNC110 - polls on the mock clock
            await trio.sleep(0.01)
        assert trio.current_time() - start == pytest.approx(held_for, abs=0.02)
        with trio.fail_after(0.1):  # the keep-alive task sees it at the same moment
            await lease.wait_lost()
        nursery.cancel_scope.cancel()


async def test_a_skewed_clock_moves_on_from_where_it_was_at_its_new_rate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = SkewedClock()
    await trio.sleep(10.0)
    assert clock.now() == pytest.approx(trio.current_time())
    clock.set_rate(0.5)
    at = clock.now()
    await trio.sleep(4.0)
    assert clock.now() == pytest.approx(at + 2.0)
    assert clock.trio_time(at + 3.0) == pytest.approx(trio.current_time() + 2.0)
    clock.set_rate(1.0)
    await trio.sleep(1.0)
    assert clock.now() == pytest.approx(at + 3.0)  # the 2 s it lost stay lost
    with pytest.raises(ValueError, match="a clock rate must be positive, not 0"):
        clock.set_rate(0)


class _ReadsAHairBelow:
    """A lease clock that, at the trio time of a reading, reads a hair below it.

    Floating point can make a skewed clock's conversion do this.
    """

    def now(self) -> float:
        return trio.current_time() - 1e-9

    def trio_time(self, reading: float) -> float:
        return reading


class _Unavailable(MemoryLeaseBackend):
    """Renewals fail as unknown (the backend cannot be reached), then are refused after 1,000."""

    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        self.renewals += 1
        if self.renewals >= 1000:
            return False
        raise LeaseUnavailable("the backend cannot be reached")


async def test_a_holder_whose_clock_reads_below_its_deadline_there_still_lets_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = _Unavailable()
    async with trio.open_nursery() as nursery:
        lease = Lease(backend, "job", "me", SETTINGS, nursery=nursery, clock=_ReadsAHairBelow())
        start = trio.current_time()
        assert await lease.acquire() is not None
        await lease.wait_lost()
        # Lost when the deadline passed (ttl less the margin), after a renewal every quarter of
        # renew_interval or so, not by the 1,000th renewal of a loop stuck at the deadline.
        assert trio.current_time() - start == pytest.approx(3.5, abs=0.02)
        assert backend.renewals < 50
        nursery.cancel_scope.cancel()
