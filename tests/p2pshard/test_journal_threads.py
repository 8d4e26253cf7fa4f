"""How the SQL journals run a blocking call in a worker thread (``_in_worker_thread``).

What a journal relies on: the call's result or error comes back; cancellation abandons the
thread at once while the thread keeps its token of the limiter until it really ends (so the
limiter bounds the threads that run, abandoned ones included); a call waits for a token when
none is free; and a call that is cancelled before it starts starts nothing.
"""

from __future__ import annotations

import threading

import pytest
import trio

from p2pshard.persistence._threads import _in_worker_thread


async def token_back(limiter: trio.CapacityLimiter) -> None:
    """Until the limiter's token is free again (taken and given back), or fail."""
    with trio.fail_after(10):
        async with limiter:
            pass


async def test_a_call_returns_its_result_and_raises_its_error_in_the_caller() -> None:
    limiter = trio.CapacityLimiter(1)
    ran_in: list[int] = []

    def work() -> str:
        ran_in.append(threading.get_ident())
        return "done"

    assert await _in_worker_thread(work, limiter) == "done"
    assert ran_in != [threading.get_ident()]  # in another thread

    def fail() -> None:
        raise ValueError("the disk is full")

    with pytest.raises(ValueError, match="the disk is full"):
        await _in_worker_thread(fail, limiter)
    assert limiter.borrowed_tokens == 0


async def test_a_cancelled_call_abandons_its_thread_which_keeps_its_token_until_it_ends() -> None:
    limiter = trio.CapacityLimiter(1)
    release, ended = threading.Event(), threading.Event()

    def stuck() -> str:
        assert release.wait(20)
        ended.set()
        return "late"

    with trio.move_on_after(0.2) as scope:
        await _in_worker_thread(stuck, limiter)
    assert scope.cancelled_caught  # back at once, the thread still running
    assert not ended.is_set()
    assert limiter.borrowed_tokens == 1
    release.set()
    await token_back(limiter)  # once the thread has ended
    assert ended.is_set()


async def test_a_call_waits_for_the_token_an_abandoned_thread_still_holds() -> None:
    limiter = trio.CapacityLimiter(1)
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        assert release.wait(20)
        order.append("first ended")

    def second() -> str:
        order.append("second ran")
        return "second"

    with trio.move_on_after(0.2):
        await _in_worker_thread(first, limiter)
    async with trio.open_nursery() as nursery:

        async def call_again() -> None:
            # The only token is the one the abandoned call's thread still holds. (That a task
            # may call again while a thread it abandoned holds a token is the cancelled-call
            # test's: its last step borrows from the same task.)
            assert await _in_worker_thread(second, limiter) == "second"

        nursery.start_soon(call_again)
        await trio.sleep(0.2)
        assert order == []  # waiting for the token
        release.set()
    assert order == ["first ended", "second ran"]
    assert limiter.borrowed_tokens == 0


async def test_a_call_cancelled_before_it_starts_starts_no_thread() -> None:
    limiter = trio.CapacityLimiter(1)
    ran: list[str] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await _in_worker_thread(lambda: ran.append("ran"), limiter)
    assert scope.cancelled_caught
    await trio.sleep(0.1)
    assert ran == []
    assert limiter.borrowed_tokens == 0
