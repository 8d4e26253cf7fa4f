"""The singleton proxy's routing, buffering and ask timeouts, without trio, at made-up times."""

from __future__ import annotations

import pytest

from membership import Address, UniqueAddress
from membership.singleton._proxy_core import (
    LOCATE_INTERVAL,
    NEVER,
    RESEND_PAUSE,
    AskAnswered,
    AskTimedOut,
    SendToSingleton,
    SingletonProxyCore,
    SingletonUnavailable,
)


def node(i: int) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", i), f"n{i}", i)


SELF, A, B = node(1), node(2), node(3)


class View:
    """Where the shell believes the singleton runs; tests move it."""

    def __init__(self, where: UniqueAddress | None) -> None:
        self.where = where
        self.looks = 0

    def locate(self) -> UniqueAddress | None:
        self.looks += 1
        return self.where


def proxy(view: View, buffer_size: int = 10) -> SingletonProxyCore:
    return SingletonProxyCore("s", SELF, view.locate, buffer_size=buffer_size)


def paused(core: SingletonProxyCore) -> bool:
    """Read it through a call, so the type checker does not narrow it between calls."""
    return core.paused


def send(to: UniqueAddress, payload: object, request_id: int = 0) -> SendToSingleton:
    return SendToSingleton(to, payload, request_id)


def test_a_waiting_proxy_sends_at_once_to_the_known_singleton() -> None:
    view = View(A)
    core = proxy(view)
    assert core.tell("a", now=1.0) == [send(A, "a")]
    assert core.tell("b", now=1.0) == [send(A, "b")]
    assert core.buffered == ()
    assert core.next_deadline() == NEVER  # nothing to do until the next input
    assert core.sent == 2


def test_it_buffers_while_the_singleton_runs_nowhere_and_sends_once_it_is_found() -> None:
    view = View(None)
    core = proxy(view)
    assert core.tell("a", now=1.0) == []
    assert core.tell("b", now=1.5) == []
    assert [p for p, _ in core.buffered] == ["a", "b"]
    assert core.next_deadline() == 1.0  # route at the next tick
    assert core.tick(now=1.5) == []  # nobody yet: look again after the interval
    assert paused(core)
    assert core.next_deadline() == 1.5 + LOCATE_INTERVAL
    assert core.tell("c", now=1.6) == []  # paused: queued behind the others
    assert core.tick(now=1.6) == []  # the pause is not over
    view.where = A
    looked_at = 1.5 + LOCATE_INTERVAL
    assert core.tick(now=looked_at) == []  # the pause is over: a route is due at once
    assert core.next_deadline() == looked_at
    assert core.tick(now=looked_at) == [send(A, "a"), send(A, "b"), send(A, "c")]
    assert core.buffered == ()
    assert not paused(core)
    assert core.next_deadline() == NEVER
    assert core.tell("d", now=2.0) == [send(A, "d")]  # waiting again: at once


def test_it_keeps_looking_every_interval_until_the_singleton_is_found() -> None:
    view = View(None)
    core = proxy(view)
    core.tell("a", now=0.0)
    now = 0.0
    for _ in range(5):
        looks = view.looks
        assert core.tick(now) == []  # routes: nobody
        assert view.looks == looks + 1
        assert core.next_deadline() == pytest.approx(now + LOCATE_INTERVAL)
        now = core.next_deadline()
        assert core.tick(now) == []  # the pause is over: route again at once
        assert core.next_deadline() == now
    view.where = B
    assert core.tick(now) == [send(B, "a")]


def test_between_a_look_and_the_next_route_an_idle_proxy_sends_at_once() -> None:
    view = View(None)
    core = proxy(view)
    core.tell("a", now=0.0)
    core.tick(now=0.0)  # nobody: paused
    view.where = A
    assert core.tell("b", now=0.1) == []  # paused: queued
    assert core.tick(now=LOCATE_INTERVAL) == []  # the look is due at once
    assert core.tick(now=LOCATE_INTERVAL) == [send(A, "a"), send(A, "b")]
    # Nothing buffered: a message told before the next route goes at once.
    core.tick(now=LOCATE_INTERVAL)
    assert core.tell("c", now=0.3) == [send(A, "c")]


def test_a_full_buffer_refuses_the_message_and_keeps_what_it_has() -> None:
    view = View(None)
    core = proxy(view, buffer_size=2)
    core.tell("a", now=0.0)
    core.tell("b", now=0.0)
    with pytest.raises(SingletonUnavailable, match="buffers 2 messages already"):
        core.tell("c", now=0.0)
    with pytest.raises(SingletonUnavailable):
        core.ask("d", 7, timeout=5.0, now=0.0)
    assert core.pending_asks == frozenset()  # the refused ask has no deadline
    assert [p for p, _ in core.buffered] == ["a", "b"]
    view.where = A
    assert core.tick(now=0.0) == [send(A, "a"), send(A, "b")]
    assert core.tell("c", now=0.1) == [send(A, "c")]  # room again


def test_to_the_singleton_on_this_node_it_always_goes_through_the_tick() -> None:
    view = View(SELF)
    core = proxy(view)
    assert core.tell("a", now=3.0) == []  # never inside the caller's call
    assert core.next_deadline() == 3.0
    assert core.tick(now=3.0) == [send(SELF, "a")]


def test_a_message_that_comes_back_is_sent_again_first_after_a_pause() -> None:
    view = View(A)
    core = proxy(view)
    assert core.tell("a", now=0.0) == [send(A, "a")]
    view.where = B  # the oldest changed while "a" was on its way
    assert core.not_here("a", 0, now=1.0) == []
    assert core.returned == 1
    assert core.tell("b", now=1.0) == []  # queued behind the returned message
    assert [p for p, _ in core.buffered] == ["a", "b"]
    assert core.tick(now=1.0) == []  # the pause starts
    assert core.next_deadline() == 1.0 + RESEND_PAUSE
    assert core.tick(now=1.05) == []
    assert core.tick(now=1.0 + RESEND_PAUSE) == [send(B, "a"), send(B, "b")]  # re-routed to B
    assert core.tell("c", now=1.2) == [send(B, "c")]


def test_a_message_that_comes_back_during_the_pause_goes_with_the_batch() -> None:
    view = View(A)
    core = proxy(view)
    core.not_here("a", 0, now=0.0)
    core.tick(now=0.0)  # pausing
    core.not_here("b", 0, now=0.05)  # front of the buffer
    assert core.tick(now=RESEND_PAUSE) == [send(A, "b"), send(A, "a")]
    # Something came back since the pause began: the next message pauses again first.
    assert core.tell("c", now=0.2) == []
    assert core.tick(now=0.2) == []
    assert core.tick(now=0.2 + RESEND_PAUSE) == [send(A, "c")]


def test_a_returned_message_with_a_full_buffer_is_dropped() -> None:
    view = View(None)
    core = proxy(view, buffer_size=1)
    core.tell("a", now=0.0)
    with pytest.raises(SingletonUnavailable):
        core.not_here("b", 0, now=0.0)
    assert [p for p, _ in core.buffered] == ["a"]
    assert core.returned == 1


def test_an_ask_is_answered_once_and_its_deadline_forgotten() -> None:
    view = View(A)
    core = proxy(view)
    assert core.ask("q", 1, timeout=5.0, now=10.0) == [send(A, "q", 1)]
    assert core.pending_asks == {1}
    assert core.next_deadline() == 15.0
    assert core.replied(1, "answer", None, now=11.0) == [AskAnswered(1, "answer", None)]
    assert core.replied(1, "again", None, now=11.5) == []  # a duplicate is dropped
    assert core.pending_asks == frozenset()
    assert core.next_deadline() == NEVER
    assert core.tick(now=15.0) == []


def test_an_ask_without_an_answer_times_out_and_a_late_answer_is_dropped() -> None:
    view = View(None)  # nowhere to send: the ask waits in the buffer
    core = proxy(view)
    assert core.ask("q1", 1, timeout=2.0, now=0.0) == []
    assert core.ask("q2", 2, timeout=1.0, now=0.5) == []
    assert core.next_deadline() == 0.0  # the route is due first
    assert core.tick(now=0.0) == []
    assert core.next_deadline() == LOCATE_INTERVAL  # the next look, before any ask ends
    assert core.tick(now=1.5) == [AskTimedOut(2)]
    assert core.pending_asks == {1}
    assert core.tick(now=2.0) == [AskTimedOut(1)]
    assert core.replied(1, "late", None, now=2.1) == []
    assert core.pending_asks == frozenset()
    # The messages themselves still go once the singleton is found (at most once, not never).
    view.where = A
    assert core.tick(now=core.next_deadline()) == []  # the look is due
    assert core.tick(now=core.next_deadline()) == [send(A, "q1", 1), send(A, "q2", 2)]


def test_an_abandoned_ask_has_no_deadline_any_more() -> None:
    core = proxy(View(A))
    core.ask("q1", 1, timeout=1.0, now=0.0)
    core.ask("q2", 2, timeout=3.0, now=0.0)
    assert core.abandon(1, now=0.5) == []
    assert core.next_deadline() == 3.0
    assert core.tick(now=1.0) == []
    assert core.tick(now=3.0) == [AskTimedOut(2)]


def test_a_zero_timeout_is_due_at_once() -> None:
    core = proxy(View(A))
    core.ask("q", 1, timeout=0.0, now=4.0)
    assert core.next_deadline() == 4.0
    assert core.tick(now=4.0) == [AskTimedOut(1)]


@pytest.mark.parametrize(
    ("request_id", "timeout", "error"),
    [
        (1, -1.0, "0 seconds or more"),
        (1, float("nan"), "a number of seconds"),
        (0, 1.0, "must be positive"),
    ],
)
def test_a_bad_ask_is_refused_and_nothing_is_sent(
    request_id: int, timeout: float, error: str
) -> None:
    view = View(A)
    core = proxy(view)
    with pytest.raises(ValueError, match=error):
        core.ask("q", request_id, timeout=timeout, now=0.0)
    assert core.sent == 0
    assert core.buffered == ()
    assert core.pending_asks == frozenset()


def test_a_request_id_in_use_is_refused() -> None:
    core = proxy(View(A))
    core.ask("q", 1, timeout=1.0, now=0.0)
    with pytest.raises(ValueError, match="not in use"):
        core.ask("q", 1, timeout=1.0, now=0.0)
    assert core.sent == 1


def test_a_busy_proxy_looks_for_the_singleton_only_when_it_routes() -> None:
    view = View(None)
    core = proxy(view)
    core.tell("a", now=0.0)  # waiting: looks (nowhere), then queues
    looks = view.looks
    for i in range(5):
        core.tell(i, now=0.0)  # queued behind "a": no look
    assert view.looks == looks
    core.tick(now=0.0)
    assert view.looks == looks + 1
