"""Refused input, counted by kind and logged at most once per interval per kind.

Theory of operation: a hostile or broken peer can send refused input as fast as its link
carries it: 20,000 tiny frames of an unknown type would otherwise be 20,000 log lines. Every
refusal is counted (the counts are in the statistics of whoever refuses); the first refusal of a
kind is logged at once with its reason, and later ones of the same kind only once
``interval`` has passed since that kind's last line, with how many were refused meanwhile. Time
comes in as an argument, so the same code serves real and simulated clocks.
"""

from __future__ import annotations

import logging

import attrs

REPORT_INTERVAL = 10.0
"""Seconds between two log lines about refusals of one kind (the first is logged at once)."""


@attrs.define(eq=False)
class Refusals:
    """Counts refusals by kind; logs each kind at most once per ``interval``.

    Example:
        >>> refusals = Refusals(logging.getLogger("demo"))
        >>> for now in (0.0, 1.0, 2.0, 12.0):
        ...     refusals.refuse("unknown-type", "dropped a message of an unknown type", now)
        >>> refusals.counts["unknown-type"]
        4
    """

    logger: logging.Logger
    interval: float = REPORT_INTERVAL
    counts: dict[str, int] = attrs.field(factory=dict)
    """Refusals so far, by kind."""
    _reported: dict[str, tuple[float, int]] = attrs.field(factory=dict)
    """Per kind: when its last line was logged, and how many were refused since."""

    def refuse(self, kind: str, text: str, now: float, *, level: int = logging.WARNING) -> None:
        """Count one refusal of ``kind``; log ``text`` (the reason) unless logged lately."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        last = self._reported.get(kind)
        if last is not None and now - last[0] < self.interval:
            self._reported[kind] = (last[0], last[1] + 1)
            return
        if last is not None and last[1]:
            self.logger.log(
                level, "%s (and %d more of this kind since the last report)", text, last[1]
            )
        else:
            self.logger.log(level, "%s", text)
        self._reported[kind] = (now, 0)

    def total(self) -> int:
        """Refusals of every kind so far."""
        return sum(self.counts.values())
