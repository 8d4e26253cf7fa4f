"""What event-sourced entities counted of their appends, per journal object.

Theory of operation. :meth:`EventSourcedEntity.persist_all` is the one place every append of an
event-sourced entity goes through, whatever the journal (SQLite, PostgreSQL, in memory, the
application's own): it counts there, into the counters of the journal object it appends to,
found once per entity incarnation. The counters hang off the journal in a weak mapping, so that
a journal implementation need not know about them, and :func:`journal_statistics` reads them
(``node.journal``'s are in the node's Prometheus metrics). Nodes that share one journal object
(in one process, in tests) share its counters.
"""

from __future__ import annotations

import weakref

import attrs

from membership import HistogramSnapshot, LatencyHistogram

APPEND_FAILURE_REASONS: tuple[str, ...] = ("fenced", "conflict", "error")
"""Why an append failed: a newer lease holder raised the stream's fence (``JournalFenced``);
another writer took the sequence number (``JournalConflict``); the storage failed
(``JournalError``)."""


@attrs.frozen(kw_only=True)
class JournalStatistics:
    """What event-sourced entities counted of their appends to one journal.

    Attributes:
        appends: appends begun (one per ``persist`` or ``persist_all`` that had events).
        events: events in the appends that succeeded.
        append_failures: appends the journal refused or failed, by reason: ``fenced``,
            ``conflict``, ``error``.
        append_seconds: seconds each successful append took.
    """

    appends: int
    events: int
    append_failures: dict[str, int]
    append_seconds: HistogramSnapshot


class JournalCounters:
    """The counters behind :class:`JournalStatistics`, bumped by ``persist_all``."""

    __slots__ = ("append_failures", "append_seconds", "appends", "events")

    def __init__(self) -> None:
        self.appends = 0
        self.events = 0
        self.append_failures = dict.fromkeys(APPEND_FAILURE_REASONS, 0)
        self.append_seconds = LatencyHistogram()

    def statistics(self) -> JournalStatistics:
        """A frozen snapshot."""
        return JournalStatistics(
            appends=self.appends,
            events=self.events,
            append_failures=dict(self.append_failures),
            append_seconds=self.append_seconds.snapshot(),
        )


_COUNTERS: weakref.WeakKeyDictionary[object, JournalCounters] = weakref.WeakKeyDictionary()


def journal_counters(journal: object) -> JournalCounters:
    """The counters of ``journal`` (made on first use)."""
    try:
        counters = _COUNTERS.get(journal)
        if counters is None:
            counters = _COUNTERS[journal] = JournalCounters()
    except TypeError:  # not hashable, or no weak reference: counted nowhere that is read
        return JournalCounters()
    return counters


def journal_statistics(journal: object) -> JournalStatistics:
    """What the event-sourced entities of this process counted of their appends to ``journal``.

    Example:
        >>> async def appends(node: Node) -> int:
        ...     return journal_statistics(node.journal).appends
    """
    return journal_counters(journal).statistics()
