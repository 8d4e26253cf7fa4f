"""What a simulated (or real) cluster run did, recorded for the invariant checkers.

Theory of operation: a :class:`History` is filled while the run goes on and read by the
checkers afterwards (``p2pshard.testing._checkers``). It holds

- every entity incarnation as a :class:`Span` (which node, when it started and ended, the shard
  lease token it ran under), fed by ``node.sharding.observe(history.observer(node))``;
- every singleton instance as a span (:meth:`History.singleton_started`);
- every message a workload sent and whether it was acknowledged (:meth:`History.sent`,
  :meth:`History.acknowledged`);
- each entity's log: the (sender, sequence number) pairs the entity durably handled, in order
  (:meth:`History.logged`); the workload entity writes it before it answers;
- for the fan-out workload, each room's members and each member's copy of each room's log;
- the faults injected, as lines of text.

Times are whatever clock the run shares: the trio clock in simulation (one mock clock for the
whole cluster, so "the same instant" is exact), CLOCK_MONOTONIC for processes on one host.
"""

from __future__ import annotations

import attrs
import trio


@attrs.define
class Span:
    """One incarnation of an entity (or one singleton instance) on one node."""

    node: str
    key: str
    start: float
    end: float | None = None
    token: int | None = None

    def describe(self) -> str:
        """``node [start, end] token T``, for violation messages."""
        end = "running" if self.end is None else f"{self.end:.3f}"
        return f"{self.node} [{self.start:.3f}, {end}] token {self.token}"


@attrs.define
class Sent:
    """One workload message: who sent it, to which entity, and whether it was acknowledged."""

    sender: str
    entity: str
    seq: int
    at: float
    acknowledged_at: float | None = None


class _Observer:
    """The ``IncarnationObserver`` for one node of a :class:`History`."""

    __slots__ = ("_history", "_node")

    def __init__(self, history: History, node: str) -> None:
        self._history = history
        self._node = node

    def entity_started(self, type_name: str, entity_id: str, token: int | None) -> None:
        self._history.entity_started(self._node, f"{type_name}/{entity_id}", token)

    def entity_stopped(self, type_name: str, entity_id: str) -> None:
        self._history.entity_stopped(self._node, f"{type_name}/{entity_id}")


@attrs.define
class History:
    """Everything the checkers look at, recorded during one run.

    Example:
        >>> history = History()
        >>> # node.sharding.observe(history.observer("n1")) for every node, then run a workload
        >>> from p2pshard.testing import check_history
        >>> check_history(history)
        []
    """

    incarnations: dict[str, list[Span]] = attrs.field(factory=dict)
    """Entity key (``type/id``) → its incarnations, in start order."""
    singletons: dict[str, list[Span]] = attrs.field(factory=dict)
    """Singleton name → its instances, in start order."""
    messages: dict[tuple[str, int], Sent] = attrs.field(factory=dict)
    """(sender, seq) → the message; a sender's sequence numbers are unique."""
    logs: dict[str, list[tuple[str, int]]] = attrs.field(factory=dict)
    """Entity key → the (sender, seq) pairs it durably handled, in order."""
    room_members: dict[str, tuple[str, ...]] = attrs.field(factory=dict)
    """Fan-out workload: room key → the keys of its members' inboxes."""
    copies: dict[str, dict[str, list[tuple[str, int]]]] = attrs.field(factory=dict)
    """Fan-out workload: inbox key → room key → the room's posts it holds, in order."""
    faults: list[str] = attrs.field(factory=list)
    """The faults injected, one line each, with the time."""
    _open: dict[str, dict[str, Span]] = attrs.field(factory=dict, alias="_open")

    # -- recording ---------------------------------------------------------------------------

    def observer(self, node: str) -> _Observer:
        """An ``IncarnationObserver`` for ``node.sharding.observe``, recording into this."""
        return _Observer(self, node)

    def entity_started(
        self, node: str, key: str, token: int | None, at: float | None = None
    ) -> None:
        """An incarnation of entity ``key`` started on ``node`` (under lease ``token``)."""
        span = Span(node, key, _now(at), token=token)
        self.incarnations.setdefault(key, []).append(span)
        self._open.setdefault(node, {})[key] = span

    def entity_stopped(self, node: str, key: str, at: float | None = None) -> None:
        """The incarnation of ``key`` on ``node`` ended."""
        span = self._open.get(node, {}).pop(key, None)
        if span is not None:
            span.end = _now(at)

    def node_gone(self, node: str, at: float | None = None) -> None:
        """``node`` crashed or exited: whatever ran there ends now."""
        end = _now(at)
        for span in self._open.pop(node, {}).values():
            span.end = end
        for spans in self.singletons.values():
            for span in spans:
                if span.node == node and span.end is None:
                    span.end = end

    def singleton_started(self, node: str, name: str, at: float | None = None) -> Span:
        """An instance of singleton ``name`` started on ``node``; set its ``end`` when it stops."""
        span = Span(node, name, _now(at))
        self.singletons.setdefault(name, []).append(span)
        return span

    def sent(self, sender: str, entity: str, seq: int, at: float | None = None) -> None:
        """A workload sent (sender, seq) to ``entity`` (a ``type/id`` key)."""
        self.messages[(sender, seq)] = Sent(sender, entity, seq, _now(at))

    def acknowledged(self, sender: str, seq: int, at: float | None = None) -> None:
        """The entity's answer to (sender, seq) came back."""
        self.messages[(sender, seq)].acknowledged_at = _now(at)

    def logged(self, entity: str, sender: str, seq: int) -> None:
        """Entity ``entity`` durably handled (sender, seq)."""
        self.logs.setdefault(entity, []).append((sender, seq))

    def fault(self, text: str, at: float | None = None) -> None:
        """A fault was injected (or a node exited): one line for the report."""
        self.faults.append(f"{_now(at):.1f} {text}")

    # -- reading -----------------------------------------------------------------------------

    def open_incarnations(self) -> list[tuple[str, str]]:
        """(node, entity key) of every incarnation still running, sorted."""
        return sorted((node, key) for node, spans in self._open.items() for key in spans)

    def incarnation_count(self) -> int:
        """How many incarnations started in all."""
        return sum(len(spans) for spans in self.incarnations.values())

    def acknowledged_count(self) -> int:
        """How many messages were acknowledged."""
        return sum(1 for m in self.messages.values() if m.acknowledged_at is not None)


def _now(at: float | None) -> float:
    return trio.current_time() if at is None else at
