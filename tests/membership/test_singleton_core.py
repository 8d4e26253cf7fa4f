"""The singleton hand-over state machine, without trio: transitions and the safety rule."""

from __future__ import annotations

from membership import Address, UniqueAddress
from membership.singleton._core import (
    HandOverDone,
    HandOverInProgress,
    HandOverToMe,
    SendTo,
    SingletonManagerCore,
    SingletonState,
    StartInstance,
    StopInstance,
    TakeOverFromMe,
)

S = SingletonState


def node(i: int) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", i), f"n{i}", i)


def state(c: SingletonManagerCore) -> SingletonState:
    """Read the state through a call, so the type checker does not narrow it between calls."""
    return c.state


def core(i: int) -> SingletonManagerCore:
    return SingletonManagerCore("s", node(i), retry_interval=1.0)


def test_first_oldest_starts_at_once() -> None:
    c = core(1)
    assert c.update(node(1), {node(1)}, now=0.0) == [StartInstance()]
    assert state(c) is S.OLDEST


def test_younger_does_nothing_until_it_is_oldest() -> None:
    c = core(2)
    assert c.update(node(1), {node(1), node(2)}, now=0.0) == []
    assert state(c) is S.YOUNGER


def test_new_oldest_asks_and_waits_for_hand_over_done() -> None:
    c = core(2)
    c.update(node(1), {node(1), node(2)}, now=0.0)
    effects = c.update(node(2), {node(1), node(2)}, now=1.0)  # n1 is Exiting: n2 is oldest now
    assert effects == [SendTo(node(1), HandOverToMe(name="s"))]
    assert state(c) is S.BECOMING_OLDEST
    assert c.receive(node(1), HandOverInProgress(name="s"), now=1.5) == []
    assert c.tick(now=2.0) == [SendTo(node(1), HandOverToMe(name="s"))]  # retried
    assert c.receive(node(3), HandOverDone(name="s"), now=2.1) == []  # not from the previous
    assert state(c) is S.BECOMING_OLDEST
    assert c.receive(node(1), HandOverDone(name="s"), now=2.2) == [StartInstance()]
    assert state(c) is S.OLDEST


def test_never_starts_on_a_timeout_only_when_the_previous_is_removed() -> None:
    c = core(2)
    c.update(node(1), {node(1), node(2)}, now=0.0)
    c.update(node(2), {node(1), node(2)}, now=1.0)
    for t in range(2, 100):
        assert StartInstance() not in c.tick(now=float(t))
    assert state(c) is S.BECOMING_OLDEST
    assert c.update(node(2), {node(2)}, now=100.0) == [StartInstance()]  # n1 removed


def test_oldest_hands_over_on_request() -> None:
    c = core(1)
    c.update(node(1), {node(1)}, now=0.0)
    effects = c.receive(node(2), HandOverToMe(name="s"), now=5.0)
    assert effects == [SendTo(node(2), HandOverInProgress(name="s")), StopInstance()]
    assert state(c) is S.HANDING_OVER
    assert c.instance_stopped(now=5.5) == [SendTo(node(2), HandOverDone(name="s"))]
    assert state(c) is S.WAS_OLDEST
    # Asked again (our Done was lost): nothing runs here, so say so.
    assert c.receive(node(2), HandOverToMe(name="s"), now=6.0) == [
        SendTo(node(2), HandOverDone(name="s"))
    ]


def test_previous_oldest_prompts_its_successor() -> None:
    old = core(1)
    old.update(node(1), {node(1), node(2)}, now=0.0)
    assert old.update(node(2), {node(1), node(2)}, now=1.0) == [
        SendTo(node(2), TakeOverFromMe(name="s"))
    ]
    assert old.tick(now=2.0) == [SendTo(node(2), TakeOverFromMe(name="s"))]
    successor = core(2)
    successor.update(node(1), {node(1), node(2)}, now=0.0)
    assert successor.receive(node(1), TakeOverFromMe(name="s"), now=2.0) == [
        SendTo(node(1), HandOverToMe(name="s"))
    ]
    assert state(successor) is S.BECOMING_OLDEST


def test_terminated_node_stops_and_never_starts_again() -> None:
    c = core(1)
    c.update(node(1), {node(1)}, now=0.0)
    assert c.terminate() == [StopInstance()]
    assert c.update(node(1), {node(1)}, now=1.0) == []
    assert state(c) is S.STOPPED
