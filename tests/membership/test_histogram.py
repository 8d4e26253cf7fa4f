"""LatencyHistogram: bucket edges as Prometheus' ``le``, cumulative output, bad bounds."""

from __future__ import annotations

import math

import pytest

from membership import LATENCY_BOUNDS, ConfigurationError, LatencyHistogram


def test_a_value_on_a_bound_counts_in_that_bucket_and_one_above_in_the_next() -> None:
    h = LatencyHistogram((0.1, 1.0))
    for seconds in (0.0, 0.1, 0.1000001, 1.0, 1.5, 100.0):
        h.observe(seconds)
    snap = h.snapshot()
    assert snap.bounds == (0.1, 1.0)
    assert snap.counts == (2, 2, 2)  # (<= 0.1), (0.1, 1], (> 1)
    assert snap.count == 6
    assert snap.sum == pytest.approx(0.0 + 0.1 + 0.1000001 + 1.0 + 1.5 + 100.0)
    assert snap.cumulative() == [(0.1, 2), (1.0, 4), (math.inf, 6)]


def test_a_negative_duration_counts_in_the_first_bucket() -> None:
    h = LatencyHistogram((0.5,))
    h.observe(-0.25)
    assert h.snapshot().counts == (1, 0)
    assert h.snapshot().sum == -0.25


def test_an_empty_histogram_has_every_bucket_at_zero_and_ends_with_inf() -> None:
    snap = LatencyHistogram().snapshot()
    assert snap.bounds == LATENCY_BOUNDS
    assert snap.count == 0
    assert snap.sum == 0.0
    cumulative = snap.cumulative()
    assert [b for b, _ in cumulative] == [*LATENCY_BOUNDS, math.inf]
    assert {n for _, n in cumulative} == {0}


def test_cumulative_counts_never_fall_and_end_at_the_count() -> None:
    h = LatencyHistogram()
    values = [0.0001 * 1.7**k for k in range(40)]  # from 0.1 ms to far past the last bound
    for seconds in values:
        h.observe(seconds)
    cumulative = h.snapshot().cumulative()
    counts = [n for _, n in cumulative]
    assert counts == sorted(counts)
    assert counts[-1] == len(values)
    for bound, n in cumulative:
        assert n == sum(1 for v in values if v <= bound)


def test_a_snapshot_does_not_move_with_later_observations() -> None:
    h = LatencyHistogram((1.0,))
    h.observe(0.5)
    snap = h.snapshot()
    h.observe(0.5)
    assert snap.counts == (1, 0)
    assert h.snapshot().counts == (2, 0)


@pytest.mark.parametrize(
    "bounds",
    [(), (1.0, 1.0), (2.0, 1.0), (0.0, 1.0), (-1.0,), (math.inf,), (math.nan,), (True,), ("1",)],
)
def test_bad_bounds_are_refused_with_what_to_give(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ConfigurationError, match="strictly ascending"):
        LatencyHistogram(bounds)
