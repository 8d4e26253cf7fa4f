"""Latency histograms kept by the components themselves, cheap enough for a hot path.

Theory of operation. A component that times something (an ask, a replicator write, a lease
renewal, a journal append) keeps one :class:`LatencyHistogram`: a fixed, sorted tuple of bucket
bounds, a list of plain integer counts (one per bucket and one above the last bound) and a float
sum. :meth:`LatencyHistogram.observe` is one ``bisect`` over the bounds, one integer increment and
one float addition: no lock, no allocation, no metrics library. Whoever exports the numbers
(``p2pshard``'s Prometheus collector) takes a :meth:`LatencyHistogram.snapshot` when it is
scraped and turns it into its own format; :meth:`HistogramSnapshot.cumulative` gives Prometheus'
cumulative ``le`` buckets.

A bucket holds the observations up to and including its bound and above the previous one, as
Prometheus' ``le`` ("less than or equal") says.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import pairwise

import attrs

from .transport import ConfigurationError

LATENCY_BOUNDS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""The default bucket bounds, in seconds: from half a millisecond (a local ask) to ten seconds (a
write that waits for its timeout)."""


@attrs.frozen
class HistogramSnapshot:
    """A :class:`LatencyHistogram`'s numbers at one moment.

    Attributes:
        bounds: the buckets' upper bounds, in seconds, ascending.
        counts: observations per bucket (not cumulative): ``counts[i]`` those above
            ``bounds[i - 1]`` and at most ``bounds[i]``; the last, one more than the bounds,
            those above the last bound.
        sum: the sum of every observation, in seconds.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        """Observations in all."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(bound, observations at most bound)`` per bucket, ending with ``(inf, count)``.

        Example:
            >>> h = LatencyHistogram((0.1, 1.0))
            >>> for seconds in (0.05, 0.1, 0.5, 3.0):
            ...     h.observe(seconds)
            >>> h.snapshot().cumulative()
            [(0.1, 2), (1.0, 3), (inf, 4)]
        """
        out = []
        total = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class LatencyHistogram:
    """Durations in fixed buckets: plain integers a component bumps, read when scraped.

    Args:
        bounds: the buckets' upper bounds in seconds, finite, positive and strictly ascending
            (default :data:`LATENCY_BOUNDS`); a bucket above the last one is always there.

    Raises:
        ConfigurationError: ``bounds`` is empty, not ascending, or holds a value that is not a
            finite positive number.

    Example:
        >>> h = LatencyHistogram()
        >>> h.observe(0.003)
        >>> h.snapshot().count
        1
    """

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS) -> None:
        values = tuple(bounds)
        if (
            not values
            or not all(
                isinstance(b, int | float) and not isinstance(b, bool) and 0 < b < math.inf
                for b in values
            )
            or any(a >= b for a, b in pairwise(values))
        ):
            raise ConfigurationError(
                f"histogram bounds {bounds!r} are invalid: give one or more finite positive "
                "numbers of seconds in strictly ascending order"
            )
        self._bounds = tuple(float(b) for b in values)
        self._counts = [0] * (len(values) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration of ``seconds`` (a negative one counts in the first bucket)."""
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        """The numbers now, as a frozen value."""
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._sum)
