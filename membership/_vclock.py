"""Vector clocks that version the gossiped cluster state. Sans-IO.

Theory of operation: each node that changes the cluster state increments its own entry; two
versions compare as before, after, same or concurrent (Akka's ``VectorClock``). Concurrent
versions are merged (pointwise maximum) and the merged state then gets a new increment. Entries of
removed nodes are pruned so the clock does not grow without bound. Entries are kept sorted, so
equal clocks are equal values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from .transport._address import UniqueAddress
from .transport._wire import message


class Order(enum.Enum):
    """How two vector clocks relate."""

    SAME = "same"
    BEFORE = "before"
    AFTER = "after"
    CONCURRENT = "concurrent"


def clock_key(node: UniqueAddress) -> str:
    """A node's entry name: address and incarnation (a restarted node counts from zero)."""
    return f"{node.address}-{node.uid:x}"


def _sorted_entries(entries: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((str(k), int(v)) for k, v in entries))


@message(name="p2pshard.VectorClock")
@attrs.frozen
class VectorClock:
    """An immutable vector clock: sorted ``(node key, counter)`` pairs."""

    entries: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=_sorted_entries)

    def get(self, key: str) -> int:
        """The counter of one node (0 if absent)."""
        for k, v in self.entries:
            if k == key:
                return v
        return 0

    def increment(self, node: UniqueAddress) -> VectorClock:
        """This clock with ``node``'s counter one higher."""
        key = clock_key(node)
        counts = dict(self.entries)
        counts[key] = counts.get(key, 0) + 1
        return VectorClock(tuple(counts.items()))

    def merge(self, other: VectorClock) -> VectorClock:
        """Pointwise maximum."""
        counts = dict(self.entries)
        for k, v in other.entries:
            if v > counts.get(k, 0):
                counts[k] = v
        return VectorClock(tuple(counts.items()))

    def prune(self, node: UniqueAddress) -> VectorClock:
        """This clock without ``node``'s entry."""
        key = clock_key(node)
        if all(k != key for k, _ in self.entries):
            return self
        return VectorClock(tuple((k, v) for k, v in self.entries if k != key))

    def compare(self, other: VectorClock) -> Order:
        """SAME, BEFORE (self happened before other), AFTER or CONCURRENT."""
        mine, theirs = dict(self.entries), dict(other.entries)
        less = greater = False
        for key in mine.keys() | theirs.keys():
            a, b = mine.get(key, 0), theirs.get(key, 0)
            if a < b:
                less = True
            elif a > b:
                greater = True
        if less and greater:
            return Order.CONCURRENT
        if less:
            return Order.BEFORE
        if greater:
            return Order.AFTER
        return Order.SAME
