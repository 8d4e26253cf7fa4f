"""acquire_until_granted: how often a refused lease is asked for again."""

from __future__ import annotations

import logging

import attrs
import pytest
import trio
import trio.testing

from membership._lease import acquire_until_granted


@attrs.frozen
class Grant:
    token: int


@attrs.define
class FakeLease:
    """Held by another owner until ``free_at``; every attempt is recorded."""

    free_at: float
    fail_first: int = 0
    attempts: list[float] = attrs.Factory(list)

    def check(self) -> bool:
        return False

    async def acquire(self) -> Grant | None:
        self.attempts.append(trio.current_time())
        if len(self.attempts) <= self.fail_first:
            raise OSError("the lease store did not answer")
        return Grant(7) if trio.current_time() >= self.free_at else None

    async def wait_lost(self) -> None:
        return

    async def release(self) -> bool:
        return True


async def test_a_lease_given_back_soon_is_taken_soon_not_a_whole_interval_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A node cut off from the others downs itself and gives its leases back a moment after the
    # others took its shards away; the new home asked once and was refused. On the old code it
    # asked again only retry_interval (5 s) later, and the failover waited for that.
    lease = FakeLease(free_at=1.0)
    grant = await acquire_until_granted(lease, 5.0, "shard T/1", logging.getLogger("test"))
    assert grant.token == 7
    assert trio.current_time() < 2.5, lease.attempts
    assert lease.attempts[0] == 0.0


async def test_attempts_back_off_to_the_retry_interval_and_no_further(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lease = FakeLease(free_at=60.0)
    await acquire_until_granted(lease, 5.0, "shard T/1", logging.getLogger("test"))
    gaps = [b - a for a, b in zip(lease.attempts, lease.attempts[1:], strict=False)]
    assert gaps == sorted(gaps), gaps  # never sooner than the attempt before
    assert gaps[0] == pytest.approx(5.0 / 16)
    assert max(gaps) == pytest.approx(5.0)
    assert len(lease.attempts) <= 60 / 5.0 + 5  # at most four quicker ones than before


async def test_a_failing_backend_is_asked_again_in_the_same_rhythm(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    lease = FakeLease(free_at=0.0, fail_first=3)
    with caplog.at_level(logging.WARNING):
        await acquire_until_granted(lease, 2.0, "shard T/1", logging.getLogger("test"))
    assert len(lease.attempts) == 4
    assert lease.attempts[1] == pytest.approx(2.0 / 16)
    assert (
        sum(
            "lease not acquired: the lease store did not answer" in r.message
            for r in caplog.records
        )
        == 3
    )
