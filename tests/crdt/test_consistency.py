"""Read and write consistency levels and their quorums (crdt._consistency)."""

from __future__ import annotations

import math
import re
from typing import Any

import attrs
import pytest

from crdt import (
    ReadAll,
    ReadFrom,
    ReadLocal,
    ReadMajority,
    ReadMajorityPlus,
    WriteAll,
    WriteLocal,
    WriteMajority,
    WriteMajorityPlus,
    WriteTo,
    quorum,
)
from crdt._consistency import (
    DEFAULT_TIMEOUT,
    Consistency,
    check_read,
    check_write,
    excludes_leaving,
)
from membership import ConfigurationError

READ_CLASSES = "ReadLocal, ReadFrom, ReadMajority, ReadMajorityPlus or ReadAll"
WRITE_CLASSES = "WriteLocal, WriteTo, WriteMajority, WriteMajorityPlus or WriteAll"

READS: list[Consistency] = [
    ReadLocal(),
    ReadFrom(n=2),
    ReadMajority(),
    ReadMajorityPlus(additional=1),
    ReadAll(),
]
WRITES: list[Consistency] = [
    WriteLocal(),
    WriteTo(n=2),
    WriteMajority(),
    WriteMajorityPlus(additional=1),
    WriteAll(),
]

# --- quorum: every level for N = 1..9 ------------------------------------------------------------

N = range(1, 10)

# Index i holds the quorum out of N = i + 1 replicas.
QUORUMS: list[tuple[str, tuple[Consistency, Consistency], list[int]]] = [
    ("local", (ReadLocal(), WriteLocal()), [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ("from 1", (ReadFrom(n=1), WriteTo(n=1)), [1, 1, 1, 1, 1, 1, 1, 1, 1]),
    # More replicas asked for than exist: the quorum stays n (and the request times out).
    ("from 4", (ReadFrom(n=4), WriteTo(n=4)), [4, 4, 4, 4, 4, 4, 4, 4, 4]),
    ("majority", (ReadMajority(), WriteMajority()), [1, 2, 2, 3, 3, 4, 4, 5, 5]),
    (
        "majority cap 1",
        (ReadMajority(min_cap=1), WriteMajority(min_cap=1)),
        [1, 2, 2, 3, 3, 4, 4, 5, 5],
    ),
    (
        "majority cap 5",
        (ReadMajority(min_cap=5), WriteMajority(min_cap=5)),
        [1, 2, 3, 4, 5, 5, 5, 5, 5],
    ),
    (
        "majority cap 100",
        (ReadMajority(min_cap=100), WriteMajority(min_cap=100)),
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
    ),
    (
        "majority plus 0",
        (ReadMajorityPlus(additional=0), WriteMajorityPlus(additional=0)),
        [1, 2, 2, 3, 3, 4, 4, 5, 5],
    ),
    (
        "majority plus 1",
        (ReadMajorityPlus(additional=1), WriteMajorityPlus(additional=1)),
        [1, 2, 3, 4, 4, 5, 5, 6, 6],
    ),
    (
        "majority plus 2",
        (ReadMajorityPlus(additional=2), WriteMajorityPlus(additional=2)),
        [1, 2, 3, 4, 5, 6, 6, 7, 7],
    ),
    (
        "majority plus 1 cap 6",
        (ReadMajorityPlus(additional=1, min_cap=6), WriteMajorityPlus(additional=1, min_cap=6)),
        [1, 2, 3, 4, 5, 6, 6, 6, 6],
    ),
    (
        "majority plus 9",
        (ReadMajorityPlus(additional=9), WriteMajorityPlus(additional=9)),
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
    ),
    ("all", (ReadAll(), WriteAll()), [1, 2, 3, 4, 5, 6, 7, 8, 9]),
]


@pytest.mark.parametrize(
    ("levels", "expected"), [(levels, q) for _, levels, q in QUORUMS], ids=[n for n, *_ in QUORUMS]
)
def test_quorum_table(levels: tuple[Consistency, Consistency], expected: list[int]) -> None:
    for level in levels:
        assert [quorum(level, n) for n in N] == expected, level


@pytest.mark.parametrize("additional", [0, 1, 2, 3, 7])
@pytest.mark.parametrize("min_cap", [0, 1, 2, 4, 5, 9, 12])
def test_majority_formula(additional: int, min_cap: int) -> None:
    for n in N:
        majority = min(n, max(n // 2 + 1, min_cap))
        plus = min(n, max(n // 2 + 1 + additional, min_cap))
        assert quorum(ReadMajority(min_cap=min_cap), n) == majority
        assert quorum(WriteMajority(min_cap=min_cap), n) == majority
        assert quorum(ReadMajorityPlus(additional=additional, min_cap=min_cap), n) == plus
        assert quorum(WriteMajorityPlus(additional=additional, min_cap=min_cap), n) == plus


def test_majorities_overlap() -> None:
    # A majority write and a majority read over the same replicas share at least one replica.
    for n in N:
        assert quorum(WriteMajority(), n) + quorum(ReadMajority(), n) > n
        assert 1 <= quorum(WriteMajority(), n) <= n


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1 << 16])
def test_read_from_and_write_to_return_n(n: int) -> None:
    for replicas in (1, 3, 100):
        assert quorum(ReadFrom(n=n), replicas) == n
        assert quorum(WriteTo(n=n), replicas) == n


def test_docstring_examples() -> None:
    assert (quorum(WriteMajority(), 5), quorum(WriteMajorityPlus(additional=1), 5)) == (3, 4)
    assert quorum(ReadMajority(min_cap=5), 3) == 3
    assert repr(ReadMajority(timeout=2.0)) == "ReadMajority(timeout=2.0, min_cap=0)"
    assert repr(WriteMajority(timeout=2.0, min_cap=3)) == ("WriteMajority(timeout=2.0, min_cap=3)")


# --- construction and validation -----------------------------------------------------------------


def test_defaults() -> None:
    assert DEFAULT_TIMEOUT == 3.0
    for level in READS + WRITES:
        assert level.timeout == DEFAULT_TIMEOUT
    assert ReadMajority().min_cap == 0
    assert WriteMajorityPlus(additional=2).min_cap == 0


def test_values_are_frozen_keyword_only_and_comparable() -> None:
    level = WriteMajority(timeout=1.5, min_cap=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        level.timeout = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ReadFrom(3)  # type: ignore[call-arg]
    assert level == WriteMajority(timeout=1.5, min_cap=2)
    assert level != WriteMajority(timeout=1.5)
    read_all: object = ReadAll()
    assert read_all != WriteAll()
    assert len({ReadFrom(n=2), ReadFrom(n=2), ReadFrom(n=3)}) == 2


def test_accepted_boundaries() -> None:
    assert ReadLocal(timeout=1e-6).timeout == 1e-6
    assert WriteAll(timeout=86400.0).timeout == 86400.0
    assert ReadFrom(n=1).n == 1
    assert WriteTo(n=1 << 16).n == 1 << 16
    assert ReadMajorityPlus(additional=0).additional == 0
    assert WriteMajority(timeout=2).timeout == 2


@pytest.mark.parametrize("cls", [ReadLocal, ReadMajority, ReadAll, WriteLocal, WriteAll])
@pytest.mark.parametrize("timeout", [0, 0.0, -1.0, 1e-9, 86401.0, math.inf, math.nan])
def test_bad_timeout(cls: type[Any], timeout: float) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        cls(timeout=timeout)
    assert str(excinfo.value) == (
        f"{cls.__name__}.timeout = {timeout!r} is invalid: must be a number from 1e-06 to 86400"
    )


@pytest.mark.parametrize("timeout", [True, "3", None])
def test_timeout_of_the_wrong_type(timeout: object) -> None:
    with pytest.raises(ConfigurationError, match=r"^WriteTo\.timeout = .* is invalid: must be a"):
        WriteTo(n=1, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [ReadFrom, WriteTo])
@pytest.mark.parametrize("n", [0, -1, (1 << 16) + 1, 2.0, True])
def test_bad_n(cls: type[ReadFrom | WriteTo], n: Any) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        cls(n=n)
    assert str(excinfo.value) == (
        f"{cls.__name__}.n = {n!r} is invalid: must be an integer from 1 to 65536"
    )


@pytest.mark.parametrize("cls", [ReadMajorityPlus, WriteMajorityPlus])
@pytest.mark.parametrize("additional", [-1, -100, 1.0, False])
def test_bad_additional(cls: type[ReadMajorityPlus | WriteMajorityPlus], additional: Any) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        cls(additional=additional)
    assert str(excinfo.value) == (
        f"{cls.__name__}.additional = {additional!r} is invalid: must be an integer from 0 to 65536"
    )


@pytest.mark.parametrize("cls", [ReadMajorityPlus, WriteMajorityPlus])
def test_additional_is_required(cls: type[ReadMajorityPlus | WriteMajorityPlus]) -> None:
    with pytest.raises(TypeError, match="additional"):
        cls()  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", [ReadMajority, WriteMajority])
@pytest.mark.parametrize("min_cap", [-1, 1.5, (1 << 16) + 1])
def test_bad_min_cap(cls: type[ReadMajority | WriteMajority], min_cap: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"^{cls.__name__}\.min_cap = "):
        cls(min_cap=min_cap)


def test_configuration_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="is invalid"):
        ReadFrom(n=0)


# --- check_read / check_write / excludes_leaving -------------------------------------------------


@pytest.mark.parametrize("level", READS, ids=lambda level: type(level).__name__)
def test_check_read_accepts_read_levels(level: Consistency) -> None:
    assert check_read(level) is level
    with pytest.raises(TypeError) as excinfo:
        check_write(level)
    assert str(excinfo.value) == (f"{level!r} is not a write consistency: use {WRITE_CLASSES}")


@pytest.mark.parametrize("level", WRITES, ids=lambda level: type(level).__name__)
def test_check_write_accepts_write_levels(level: Consistency) -> None:
    assert check_write(level) is level
    with pytest.raises(TypeError) as excinfo:
        check_read(level)
    assert str(excinfo.value) == f"{level!r} is not a read consistency: use {READ_CLASSES}"


@pytest.mark.parametrize("value", [None, "majority", 3, ReadMajority, WriteAll, object()])
def test_check_rejects_non_levels(value: object) -> None:
    with pytest.raises(TypeError, match=f"^{re.escape(repr(value))} is not a read consistency"):
        check_read(value)
    with pytest.raises(TypeError, match=f"^{re.escape(repr(value))} is not a write consistency"):
        check_write(value)


@pytest.mark.parametrize("level", READS + WRITES, ids=lambda level: type(level).__name__)
def test_excludes_leaving_only_for_plus_levels(level: Consistency) -> None:
    expected = isinstance(level, ReadMajorityPlus | WriteMajorityPlus)
    assert excludes_leaving(level) is expected


def test_excludes_leaving_table() -> None:
    assert [excludes_leaving(level) for level in READS] == [False, False, False, True, False]
    assert [excludes_leaving(level) for level in WRITES] == [False, False, False, True, False]
