"""The phi accrual failure detector and its per-node registry. Sans-IO.

Theory of operation: a detector watches one node. Every heartbeat response from that node is fed
in with the time it arrived (:meth:`PhiAccrualFailureDetector.heartbeat`); the detector keeps the
last ``max_sample_size`` intervals between arrivals and their mean and variance. Asked at time
``now``, it answers with phi, the suspicion that the node is gone::

    phi = -log10(1 - F(now - last_arrival))

where ``F`` is the cumulative distribution function of a normal distribution whose mean is the
mean interval plus ``acceptable_heartbeat_pause`` and whose standard deviation is the measured
one, but at least ``min_std_deviation``. ``F`` is the logistic approximation of the normal CDF
(error about 1e-4 at three sigma). A node is available while phi is below ``threshold``. This is
Hayashibara et al.'s detector exactly as Akka/Pekko's ``PhiAccrualFailureDetector`` computes it:

- the history starts with two intervals, ``first_heartbeat_estimate`` plus and minus a quarter of
  it, so a node that sent a single heartbeat still becomes unavailable;
- a heartbeat that arrives while the node is already judged unavailable restarts the clock but
  does not enter the history, so one long pause does not teach the detector to tolerate the next;
- a node that never sent a heartbeat has phi 0 (it is not monitored yet).

With the defaults (1 s heartbeats, 3 s acceptable pause, 0.1 s minimum deviation, threshold 8) a
node that stops answering after a steady history is detected about 4.5 s after its last heartbeat
arrived.

Where it differs from Akka, and why:

- Time is an argument (seconds, from any monotonic clock such as trio's), never read here, so the
  same code runs under trio's ``MockClock`` and replays exactly. Time that goes backwards counts
  as no time passing, instead of a negative interval.
- Intervals are kept as integer nanoseconds (Akka: integer milliseconds), so the running sums
  never drift and the variance, computed exactly, is never negative.
- ``-log10(1 - F)`` is evaluated as ``log10(1 + exp(z))`` in a form that neither overflows nor
  underflows: Akka's two branches yield Infinity long after a crash, this yields a large finite
  phi that keeps rising. Below Infinity the values are the same.
- The registry is keyed by :class:`UniqueAddress` (Akka: by ``Address``), so a restarted node is a
  new incarnation with a fresh history.
- Akka logs a warning when an interval grows past two thirds of the acceptable pause; here
  :meth:`PhiAccrualFailureDetector.statistics` reports the last interval and the caller decides.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import attrs

from .transport._address import UniqueAddress
from .transport._settings import in_range

_NS_PER_SECOND = 1_000_000_000
_LN_10 = math.log(10.0)


@attrs.frozen(kw_only=True)
class FailureDetectorSettings:
    """How nodes watch each other: Akka's ``pekko.cluster.failure-detector`` section.

    Example:
        >>> FailureDetectorSettings(acceptable_heartbeat_pause=5.0).threshold
        8.0
    """

    heartbeat_interval: float = attrs.field(default=1.0, validator=in_range(0.001, 3600))
    """Seconds between two heartbeats sent to each monitored node (default 1 s)."""

    threshold: float = attrs.field(default=8.0, validator=in_range(0.001, 1000))
    """Phi at or above which a node counts as unavailable (default 8). Lower detects a real
    crash sooner but suspects healthy nodes more often; higher makes fewer mistakes but takes
    longer."""

    acceptable_heartbeat_pause: float = attrs.field(default=3.0, validator=in_range(0.0, 3600))
    """Seconds of missing heartbeats tolerated before phi starts to climb (default 3 s): added to
    the mean interval, it absorbs occasional pauses (garbage collection, a congested network)."""

    min_std_deviation: float = attrs.field(default=0.1, validator=in_range(0.001, 3600))
    """Smallest standard deviation of the intervals used for phi, in seconds (default 0.1 s).
    With very regular heartbeats a smaller one would make phi jump at the first late one."""

    max_sample_size: int = attrs.field(default=1000, validator=in_range(1, 1_000_000, integer=True))
    """Number of recent heartbeat intervals the mean and deviation are computed from (default
    1000)."""

    first_heartbeat_estimate: float = attrs.field(default=1.0, validator=in_range(0.001, 3600))
    """Seconds assumed between heartbeats before any were measured (default 1 s; keep it equal
    to ``heartbeat_interval``, as Akka does). Seeds the history with two intervals, a quarter
    below and above it."""

    monitored_by_nr_of_members: int = attrs.field(
        default=9, validator=in_range(1, 10_000, integer=True)
    )
    """How many other nodes send heartbeats to each node (default 9, Akka's): each node is
    watched by that many (or all others, in a smaller cluster)."""

    expected_response_after: float = attrs.field(default=1.0, validator=in_range(0.001, 3600))
    """Seconds after the first heartbeat to a node at which its failure detection starts even
    if it never answered (default 1 s), so a node that is dead from the start is detected too."""

    unreachable_nodes_reaper_interval: float = attrs.field(
        default=1.0, validator=in_range(0.001, 3600)
    )
    """Seconds between two checks of the failure detectors for nodes that became unreachable or
    reachable again (default 1 s)."""


def phi(elapsed: float, mean: float, std_deviation: float) -> float:
    """Suspicion that a node silent for ``elapsed`` seconds is gone.

    ``-log10(1 - F(elapsed))`` for the normal distribution N(``mean``, ``std_deviation``), with
    ``F`` the logistic approximation ``1 / (1 + exp(-y * (1.5976 + 0.070566 * y**2)))``,
    ``y = (elapsed - mean) / std_deviation``. Always finite and non-negative, and increasing in
    ``elapsed``.

    Example:
        >>> round(phi(4.0, 4.0, 0.1), 3)  # at the mean: F = 1/2
        0.301
    """
    y = (elapsed - mean) / std_deviation
    z = y * (1.5976 + 0.070566 * y * y)
    # 1 - F = 1 / (1 + exp(z)), so phi = log10(1 + exp(z)): a softplus, computed so that exp
    # neither overflows (z large, long after a crash) nor loses everything to rounding.
    if z > 0:
        return (z + math.log1p(math.exp(-z))) / _LN_10
    return math.log1p(math.exp(z)) / _LN_10


class _HeartbeatHistory:
    """The last ``max_sample_size`` intervals, in integer nanoseconds, with exact running sums."""

    __slots__ = ("_intervals", "_max", "_sum", "_sum_of_squares")

    def __init__(self, max_sample_size: int) -> None:
        self._max = max_sample_size
        self._intervals: deque[int] = deque()
        self._sum = 0
        self._sum_of_squares = 0

    def append(self, interval: int) -> None:
        if len(self._intervals) >= self._max:
            oldest = self._intervals.popleft()
            self._sum -= oldest
            self._sum_of_squares -= oldest * oldest
        self._intervals.append(interval)
        self._sum += interval
        self._sum_of_squares += interval * interval

    def __len__(self) -> int:
        return len(self._intervals)

    @property
    def mean(self) -> float:
        """Mean interval in seconds."""
        return self._sum / len(self._intervals) / _NS_PER_SECOND

    @property
    def std_deviation(self) -> float:
        """Population standard deviation of the intervals in seconds."""
        n = len(self._intervals)
        # n * sum(x^2) - sum(x)^2 is an exact integer and never negative.
        numerator = n * self._sum_of_squares - self._sum * self._sum
        return math.sqrt(numerator) / n / _NS_PER_SECOND


def _to_ns(seconds: float) -> int:
    return round(seconds * _NS_PER_SECOND)


@attrs.frozen(kw_only=True)
class FailureDetectorStatistics:
    """A snapshot of one detector, for diagnostics."""

    monitoring: bool
    """Whether a heartbeat was ever recorded."""
    samples: int
    """Intervals in the history (the two seeded ones included)."""
    mean: float
    """Mean interval in seconds."""
    std_deviation: float
    """Measured standard deviation in seconds (before ``min_std_deviation`` is applied)."""
    last_heartbeat: float | None
    """Time of the last heartbeat, or None."""
    last_interval: float | None
    """Seconds between the last two heartbeats, or None. Akka warns when this grows past two
    thirds of ``acceptable_heartbeat_pause``."""


@attrs.define(eq=False)
class PhiAccrualFailureDetector:
    """Suspicion, as a number, that one node is gone (see the module docstring).

    Example:
        >>> detector = PhiAccrualFailureDetector()
        >>> for t in range(10):
        ...     detector.heartbeat(float(t))
        >>> detector.is_available(10.0), detector.is_available(20.0)
        (True, False)
    """

    _settings: FailureDetectorSettings = attrs.field(
        factory=FailureDetectorSettings, alias="settings"
    )
    _history: _HeartbeatHistory = attrs.field(init=False)
    _last: float | None = attrs.field(init=False, default=None)
    _last_interval: float | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._history = self._first_history()

    def _first_history(self) -> _HeartbeatHistory:
        # Two intervals around the estimate, with a deviation of a quarter of it: wide, since
        # nothing is known yet about this node's network.
        history = _HeartbeatHistory(self._settings.max_sample_size)
        mean = _to_ns(self._settings.first_heartbeat_estimate)
        deviation = mean // 4
        history.append(mean - deviation)
        history.append(mean + deviation)
        return history

    @property
    def settings(self) -> FailureDetectorSettings:
        """The settings this detector was made with."""
        return self._settings

    @property
    def is_monitoring(self) -> bool:
        """True once a heartbeat was recorded; before that the node counts as available."""
        return self._last is not None

    def heartbeat(self, now: float) -> None:
        """Record a heartbeat from the node that arrived at ``now`` (seconds)."""
        last = self._last
        if last is None:
            self._history = self._first_history()
            self._last = now
            return
        if now < last:
            now = last
        interval = now - last
        # The first heartbeat after the node was judged unavailable restarts the clock but is
        # kept out of the history: one long pause must not make the next one look normal.
        if self.is_available(now):
            self._history.append(_to_ns(interval))
        self._last = now
        self._last_interval = interval

    def phi(self, now: float) -> float:
        """Suspicion level at ``now``: 0 for a node never heard from, rising while it is silent."""
        last = self._last
        if last is None:
            return 0.0
        settings = self._settings
        return phi(
            max(now - last, 0.0),
            self._history.mean + settings.acceptable_heartbeat_pause,
            max(self._history.std_deviation, settings.min_std_deviation),
        )

    def is_available(self, now: float) -> bool:
        """True while phi at ``now`` is below the threshold."""
        return self.phi(now) < self._settings.threshold

    def statistics(self) -> FailureDetectorStatistics:
        """Diagnostics: the history's size, mean and deviation, the last heartbeat."""
        return FailureDetectorStatistics(
            monitoring=self.is_monitoring,
            samples=len(self._history),
            mean=self._history.mean,
            std_deviation=self._history.std_deviation,
            last_heartbeat=self._last,
            last_interval=self._last_interval,
        )


@attrs.define(eq=False)
class FailureDetectorRegistry:
    """One :class:`PhiAccrualFailureDetector` per node, made at its first heartbeat.

    Akka's ``DefaultFailureDetectorRegistry``: a node without a detector counts as available.

    Example:
        >>> from membership import Address, UniqueAddress
        >>> registry = FailureDetectorRegistry()
        >>> node = UniqueAddress(Address("10.0.0.1", 25520), "a", 1)
        >>> registry.is_available(node, 0.0), registry.is_monitoring(node)
        (True, False)
        >>> registry.heartbeat(node, 0.0)
        >>> registry.is_available(node, 1.0), registry.is_available(node, 30.0)
        (True, False)
    """

    _settings: FailureDetectorSettings = attrs.field(
        factory=FailureDetectorSettings, alias="settings"
    )
    _factory: Callable[[], PhiAccrualFailureDetector] | None = attrs.field(
        default=None, alias="factory"
    )
    _detectors: dict[UniqueAddress, PhiAccrualFailureDetector] = attrs.field(
        init=False, factory=dict
    )

    @property
    def settings(self) -> FailureDetectorSettings:
        """The settings new detectors are made with (unless a factory was given)."""
        return self._settings

    def heartbeat(self, node: UniqueAddress, now: float) -> None:
        """Record a heartbeat from ``node`` at ``now``, creating its detector if needed."""
        detector = self._detectors.get(node)
        if detector is None:
            detector = (
                self._factory()
                if self._factory is not None
                else PhiAccrualFailureDetector(settings=self._settings)
            )
            self._detectors[node] = detector
        detector.heartbeat(now)

    def is_available(self, node: UniqueAddress, now: float) -> bool:
        """False only if ``node`` is monitored and its phi reached the threshold."""
        detector = self._detectors.get(node)
        return detector is None or detector.is_available(now)

    def is_monitoring(self, node: UniqueAddress) -> bool:
        """True if a heartbeat from ``node`` was recorded since it was last removed."""
        detector = self._detectors.get(node)
        return detector is not None and detector.is_monitoring

    def phi(self, node: UniqueAddress, now: float) -> float:
        """Phi of ``node`` at ``now`` (0 if it is not monitored)."""
        detector = self._detectors.get(node)
        return 0.0 if detector is None else detector.phi(now)

    def detector(self, node: UniqueAddress) -> PhiAccrualFailureDetector | None:
        """The detector of ``node``, or None (for diagnostics)."""
        return self._detectors.get(node)

    def monitored(self) -> tuple[UniqueAddress, ...]:
        """Nodes that have a detector, sorted by address."""
        return tuple(sorted(self._detectors))

    def remove(self, node: UniqueAddress) -> None:
        """Forget ``node``'s detector; it counts as available until it is heard from again."""
        self._detectors.pop(node, None)

    def reset(self) -> None:
        """Forget every detector."""
        self._detectors.clear()
