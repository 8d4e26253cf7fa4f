"""The phi accrual failure detector, its registry and its settings (sans-IO, synchronous)."""

from __future__ import annotations

import itertools
import math
import random
import re

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from membership import Address, ConfigurationError, UniqueAddress
from membership._failure_detector import (
    FailureDetectorRegistry,
    FailureDetectorSettings,
    PhiAccrualFailureDetector,
    phi,
)

DEFAULTS = FailureDetectorSettings()


def node(port: int, uid: int = 1) -> UniqueAddress:
    return UniqueAddress(Address("10.0.0.1", port), f"n{port}", uid)


def steady(detector: PhiAccrualFailureDetector, count: int, interval: float = 1.0) -> float:
    """Feed ``count`` heartbeats ``interval`` apart from time 0; return the last one's time."""
    now = 0.0
    for i in range(count):
        now = i * interval
        detector.heartbeat(now)
    return now


def detection_delay(detector: PhiAccrualFailureDetector, last: float) -> float:
    """Seconds after ``last`` at which the detector first says unavailable (to 1 microsecond)."""
    low, high = 0.0, 3600.0
    assert not detector.is_available(last + high)
    while high - low > 1e-6:
        middle = (low + high) / 2
        if detector.is_available(last + middle):
            low = middle
        else:
            high = middle
    return high


def akka_phi(time_diff: float, mean: float, std_deviation: float) -> float:
    """Akka's two-branch formula, as a reference for the values where it is finite."""
    y = (time_diff - mean) / std_deviation
    e = math.exp(-y * (1.5976 + 0.070566 * y * y))
    if time_diff > mean:
        return -math.log10(e / (1.0 + e))
    return -math.log10(1.0 - 1.0 / (1.0 + e))


# -- phi ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("elapsed", "mean", "std"),
    [(3.0, 4.0, 0.1), (3.9, 4.0, 0.1), (4.0, 4.0, 0.1), (4.3, 4.0, 0.1), (4.5, 4.0, 0.1),
     (5.0, 4.0, 0.5), (1.0, 1.0, 0.25), (2.0, 1.0, 0.25), (0.5, 4.0, 2.0), (9.0, 4.0, 2.0)],
)  # fmt: skip
def test_phi_is_akkas_formula(elapsed: float, mean: float, std: float) -> None:
    assert phi(elapsed, mean, std) == pytest.approx(
        akka_phi(elapsed, mean, std), rel=1e-9, abs=1e-12
    )


def test_phi_at_the_mean_is_log10_of_two() -> None:
    assert phi(4.0, 4.0, 0.1) == pytest.approx(math.log10(2))


def test_phi_stays_finite_where_akkas_overflows() -> None:
    assert phi(0.0, 4.0, 0.001) == 0.0  # far below the mean: Akka's exp() overflows here
    far = phi(100.0, 4.0, 0.1)  # long after a crash: Akka returns Infinity
    assert math.isfinite(far)
    assert far > 1e6
    assert phi(200.0, 4.0, 0.1) > far


@given(
    st.floats(0, 1000, allow_nan=False),
    st.floats(0, 1000, allow_nan=False),
    st.floats(0.001, 10),
)
def test_phi_is_non_negative_finite_and_rises_with_elapsed_time(
    a: float, b: float, std: float
) -> None:
    low, high = sorted((a, b))
    assert 0.0 <= phi(low, 4.0, std) <= phi(high, 4.0, std) < math.inf


# -- the detector -------------------------------------------------------------------------------


def test_a_node_never_heard_from_is_available_and_not_monitored() -> None:
    detector = PhiAccrualFailureDetector()
    assert not detector.is_monitoring
    assert detector.phi(1000.0) == 0.0
    assert detector.is_available(1000.0)


def test_phi_rises_with_the_time_since_the_last_heartbeat() -> None:
    detector = PhiAccrualFailureDetector()
    last = steady(detector, 20)
    values = [detector.phi(last + k * 0.25) for k in range(40)]
    assert values[0] < 0.01
    assert all(a <= b for a, b in itertools.pairwise(values))
    assert values[-1] > DEFAULTS.threshold
    assert detector.phi(last + 4.0) < detector.phi(last + 4.2) < detector.phi(last + 4.4)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_a_node_with_jittery_regular_heartbeats_stays_available(seed: int) -> None:
    print(f"seed={seed}")
    rng = random.Random(seed)
    detector = PhiAccrualFailureDetector()
    now = 0.0
    detector.heartbeat(now)
    for _ in range(2000):
        # up to 40% jitter, and now and then a heartbeat twice as late
        gap = 1.0 + rng.uniform(-0.4, 0.4) + (1.0 if rng.random() < 0.02 else 0.0)
        # checked just before the next heartbeat: the worst moment
        assert detector.is_available(now + gap - 1e-9), f"suspected at {now + gap}"
        now += gap
        detector.heartbeat(now)


def test_a_pause_shorter_than_the_acceptable_pause_is_not_detected() -> None:
    detector = PhiAccrualFailureDetector()
    last = steady(detector, 100)
    assert detector.is_available(last + 2.5)
    assert detector.is_available(last + DEFAULTS.acceptable_heartbeat_pause)
    detector.heartbeat(last + 2.5)
    assert detector.is_available(last + 3.5)


def test_a_pause_longer_than_the_acceptable_pause_is_detected_soon_after() -> None:
    detector = PhiAccrualFailureDetector()
    last = steady(detector, 100)
    assert not detector.is_available(last + DEFAULTS.acceptable_heartbeat_pause + 3 * 1.0)
    delay = detection_delay(detector, last)
    pause = DEFAULTS.acceptable_heartbeat_pause
    assert pause <= delay <= pause + 3.0
    # mean interval 1 s + pause 3 s, plus about 5.2 standard deviations of 0.1 s (the minimum)
    assert delay == pytest.approx(4.52, abs=0.01)
    assert detector.phi(last + delay) >= DEFAULTS.threshold > detector.phi(last + delay - 1e-5)


def test_a_node_heard_from_once_is_detected_using_the_first_heartbeat_estimate() -> None:
    detector = PhiAccrualFailureDetector()
    detector.heartbeat(10.0)
    stats = detector.statistics()
    assert (stats.samples, stats.mean, stats.std_deviation) == (2, 1.0, 0.25)
    # mean 1 s + pause 3 s, deviation a quarter of the estimate: about 5.2 * 0.25 s later
    assert detection_delay(detector, 10.0) == pytest.approx(5.31, abs=0.01)


def test_the_first_heartbeat_estimate_seeds_the_history() -> None:
    detector = PhiAccrualFailureDetector(
        settings=FailureDetectorSettings(first_heartbeat_estimate=2.0)
    )
    detector.heartbeat(0.0)
    stats = detector.statistics()
    assert (stats.samples, stats.mean, stats.std_deviation) == (2, 2.0, 0.5)


def test_the_minimum_standard_deviation_is_honoured() -> None:
    tight = PhiAccrualFailureDetector()
    loose = PhiAccrualFailureDetector(settings=FailureDetectorSettings(min_std_deviation=0.5))
    last = steady(tight, 1000)
    steady(loose, 1000)
    measured = tight.statistics().std_deviation
    assert measured < 0.1  # so the minimum, not the measurement, is used
    mean = tight.statistics().mean + DEFAULTS.acceptable_heartbeat_pause
    assert tight.phi(last + 4.3) == pytest.approx(phi(4.3, mean, 0.1))
    assert loose.phi(last + 4.3) == pytest.approx(phi(4.3, mean, 0.5))
    # detection comes y* standard deviations after the mean: y* is the same for both
    y_tight = (detection_delay(tight, last) - mean) / 0.1
    y_loose = (detection_delay(loose, last) - mean) / 0.5
    assert y_tight == pytest.approx(y_loose, abs=1e-4)
    assert 5.1 < y_tight < 5.3


def test_a_measured_deviation_above_the_minimum_is_used() -> None:
    detector = PhiAccrualFailureDetector()
    last = 0.0
    for i in range(200):
        detector.heartbeat(last)
        last += 0.5 if i % 2 else 1.5  # intervals 1.5, 0.5, ...: deviation 0.5 s
    last -= 0.5  # the time of the last heartbeat
    stats = detector.statistics()
    assert stats.std_deviation == pytest.approx(0.5, abs=0.01)
    assert detector.phi(last + 4.5) == pytest.approx(
        phi(4.5, stats.mean + DEFAULTS.acceptable_heartbeat_pause, stats.std_deviation)
    )


def test_the_history_keeps_only_max_sample_size_intervals() -> None:
    detector = PhiAccrualFailureDetector(settings=FailureDetectorSettings(max_sample_size=3))
    now = 0.0
    detector.heartbeat(now)
    assert detector.statistics().samples == 2
    for gap in (1.0, 1.0, 1.0, 2.0, 2.0, 2.0):
        now += gap
        detector.heartbeat(now)
        assert detector.statistics().samples <= 3
    stats = detector.statistics()
    assert (stats.samples, stats.mean, stats.std_deviation) == (3, 2.0, 0.0)


def test_the_default_window_is_a_thousand_intervals() -> None:
    detector = PhiAccrualFailureDetector()
    steady(detector, 1500)
    stats = detector.statistics()
    assert stats.samples == 1000
    assert stats.mean == 1.0  # the seeded intervals have left the window
    assert stats.std_deviation == 0.0


def test_the_first_heartbeat_after_a_failure_does_not_enter_the_history() -> None:
    detector = PhiAccrualFailureDetector()
    last = steady(detector, 50)
    before = detector.statistics()
    assert not detector.is_available(last + 60.0)
    detector.heartbeat(last + 60.0)
    after = detector.statistics()
    assert (after.samples, after.mean) == (before.samples, before.mean)
    assert after.last_interval == 60.0
    assert detector.is_available(last + 61.0)


def test_time_going_backwards_counts_as_no_time() -> None:
    detector = PhiAccrualFailureDetector()
    detector.heartbeat(10.0)
    assert detector.phi(5.0) == detector.phi(10.0)
    detector.heartbeat(9.0)
    assert detector.statistics().last_heartbeat == 10.0
    assert detector.statistics().last_interval == 0.0


def test_intervals_are_kept_exactly() -> None:
    # Floating-point running sums would drift; integer nanoseconds do not.
    detector = PhiAccrualFailureDetector(settings=FailureDetectorSettings(max_sample_size=10))
    now = 0.0
    for _ in range(100_000):
        detector.heartbeat(now)
        now += 0.1
    stats = detector.statistics()
    assert stats.std_deviation >= 0.0
    assert stats.mean == pytest.approx(0.1, abs=1e-9)


# -- the registry -------------------------------------------------------------------------------


def test_the_registry_counts_unknown_nodes_as_available() -> None:
    registry = FailureDetectorRegistry()
    assert registry.is_available(node(1), 1e6)
    assert not registry.is_monitoring(node(1))
    assert registry.phi(node(1), 1e6) == 0.0
    assert registry.monitored() == ()


def test_the_registry_keeps_one_detector_per_node() -> None:
    registry = FailureDetectorRegistry()
    a, b = node(1), node(2)
    for t in range(10):
        registry.heartbeat(a, float(t))
    registry.heartbeat(b, 9.0)
    assert registry.is_monitoring(a)
    assert registry.is_monitoring(b)
    assert registry.monitored() == (a, b)
    assert registry.is_available(a, 12.0)
    assert not registry.is_available(a, 20.0)
    assert registry.phi(a, 20.0) > DEFAULTS.threshold
    detector = registry.detector(a)
    assert detector is not None
    assert detector.statistics().samples == 11


def test_the_registry_tells_incarnations_apart() -> None:
    registry = FailureDetectorRegistry()
    old, new = node(1, uid=1), node(1, uid=2)
    registry.heartbeat(old, 0.0)
    assert registry.is_monitoring(old)
    assert not registry.is_monitoring(new)
    assert registry.is_available(new, 100.0)


def test_remove_and_reset_forget_detectors() -> None:
    registry = FailureDetectorRegistry()
    a, b = node(1), node(2)
    registry.heartbeat(a, 0.0)
    registry.heartbeat(b, 0.0)
    registry.remove(a)
    registry.remove(a)  # removing twice is fine
    assert not registry.is_monitoring(a)
    assert registry.is_available(a, 100.0)
    assert registry.is_monitoring(b)
    registry.reset()
    assert registry.monitored() == ()
    # a node heard from again starts with a fresh history
    registry.heartbeat(b, 200.0)
    detector = registry.detector(b)
    assert detector is not None
    assert detector.statistics().samples == 2


def test_the_registry_uses_its_settings_or_factory() -> None:
    settings = FailureDetectorSettings(threshold=1.0)
    registry = FailureDetectorRegistry(settings=settings)
    registry.heartbeat(node(1), 0.0)
    detector = registry.detector(node(1))
    assert detector is not None
    assert detector.settings is settings
    made: list[PhiAccrualFailureDetector] = []

    def factory() -> PhiAccrualFailureDetector:
        made.append(PhiAccrualFailureDetector(settings=settings))
        return made[-1]

    registry = FailureDetectorRegistry(factory=factory)
    registry.heartbeat(node(1), 0.0)
    registry.heartbeat(node(1), 1.0)
    assert made == [registry.detector(node(1))]


# -- settings -----------------------------------------------------------------------------------


def test_the_defaults_are_akkas() -> None:
    assert attrs.asdict(DEFAULTS) == {
        "heartbeat_interval": 1.0,
        "threshold": 8.0,
        "acceptable_heartbeat_pause": 3.0,
        "min_std_deviation": 0.1,
        "max_sample_size": 1000,
        "first_heartbeat_estimate": 1.0,
        "monitored_by_nr_of_members": 9,
        "expected_response_after": 1.0,
        "unreachable_nodes_reaper_interval": 1.0,
    }


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("heartbeat_interval", 0, "a number from 0.001 to 3600"),
        ("threshold", 0.0, "a number from 0.001 to 1000"),
        ("threshold", -8, "a number from 0.001 to 1000"),
        ("acceptable_heartbeat_pause", -1.0, "a number from 0 to 3600"),
        ("min_std_deviation", 0, "a number from 0.001 to 3600"),
        ("max_sample_size", 0, "an integer from 1 to 1000000"),
        ("max_sample_size", 10.0, "an integer from 1 to 1000000"),
        ("first_heartbeat_estimate", "1s", "a number from 0.001 to 3600"),
        ("monitored_by_nr_of_members", 0, "an integer from 1 to 10000"),
        ("monitored_by_nr_of_members", True, "an integer from 1 to 10000"),
        ("expected_response_after", math.nan, "a number from 0.001 to 3600"),
        ("unreachable_nodes_reaper_interval", math.inf, "a number from 0.001 to 3600"),
    ],
)
def test_invalid_settings_name_the_field_value_and_what_is_allowed(
    field: str, value: object, allowed: str
) -> None:
    expected = f"FailureDetectorSettings.{field} = {value!r} is invalid: must be {allowed}"
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        FailureDetectorSettings(**{field: value})  # type: ignore[arg-type]


def test_a_zero_acceptable_pause_is_allowed() -> None:
    detector = PhiAccrualFailureDetector(
        settings=FailureDetectorSettings(acceptable_heartbeat_pause=0.0)
    )
    last = steady(detector, 100)
    assert detection_delay(detector, last) == pytest.approx(1.52, abs=0.01)
