"""Application versions are ordered as Akka orders them (membership/_app_version.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from membership import AppVersion, newest_app_version

# Oldest first; each entry is strictly older than the next.
ORDERED = [
    "",
    "0.0.1",
    "0.9",
    "1.0.0-alpha",
    "1.0.0-alpha.1",
    "1.0.0-alpha.beta",
    "1.0.0-beta.2",
    "1.0.0-beta.11",
    "1.0.0-rc.1",
    "1.0.0",
    "1.0.1",
    "1.2.0",
    "1.9.2",
    "1.10.0",
    "2",
    "2024.11.26",
]


@pytest.mark.parametrize(("older", "newer"), list(itertools.pairwise(ORDERED)))
def test_versions_are_ordered_number_by_number_and_release_after_qualifier(
    older: str, newer: str
) -> None:
    assert AppVersion.parse(older) < AppVersion.parse(newer)
    assert AppVersion.parse(newer) > AppVersion.parse(older)


@pytest.mark.parametrize(
    ("a", "b"),
    [("1.2", "1.2.0"), ("1.2.0", "1.2.0+build.7"), ("0.0.0", "0"), ("3.1-rc.1", "3.1.0-rc.1")],
)
def test_trailing_zeros_and_build_metadata_do_not_count(a: str, b: str) -> None:
    assert AppVersion.parse(a) == AppVersion.parse(b)


def test_the_empty_version_is_older_than_any_other_even_a_bare_qualifier() -> None:
    assert AppVersion.parse("").is_empty
    assert AppVersion.parse("") < AppVersion.parse("snapshot")
    assert AppVersion.parse("") < AppVersion.parse("0")
    assert not AppVersion.parse("0").is_empty


def test_a_part_that_is_not_a_number_starts_the_qualifier() -> None:
    assert AppVersion.parse("2.4a").numbers == (2, 4)
    assert AppVersion.parse("2.4a") < AppVersion.parse("2.4")
    assert AppVersion.parse("2.4a") > AppVersion.parse("2.3.9")


def test_newest_of_a_shuffled_list() -> None:
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    shuffled = list(ORDERED)
    random.Random(seed).shuffle(shuffled)
    assert newest_app_version(shuffled) == ORDERED[-1]
    assert newest_app_version([]) is None
    assert newest_app_version(["1.2", "1.2.0"]) == "1.2"  # equal: the first given
