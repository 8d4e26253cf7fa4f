"""Read and write consistency levels, and the quorum each needs: Akka Distributed Data's.

A level says how many replicas (this node included) must answer before a read or a write
completes, and how long to wait for them. With ``N`` replicas of the replicator's role:

=========================  =====================================================================
``ReadLocal/WriteLocal``    1: this node only; never waits.
``ReadFrom(n)/WriteTo(n)``  ``n`` (a read or write for more replicas than exist times out).
``*Majority``               ``min(N, max(N // 2 + 1, min_cap))``
``*MajorityPlus(a)``        ``min(N', max(N' // 2 + 1 + a, min_cap))`` where ``N'`` leaves out
                            members that are leaving or exiting (they will not keep the value).
``*All``                    ``N``
=========================  =====================================================================

A majority write followed by a majority read always meets one replica that has the write, as long
as the set of replicas does not change in between; ``min_cap`` keeps quorums overlapping in small
clusters that shrink (Akka's ``majority-min-cap``).
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

from membership.internal import in_range

DEFAULT_TIMEOUT = 3.0
"""Seconds a read or write waits for its quorum unless told otherwise."""

_timeout = attrs.field(default=DEFAULT_TIMEOUT, validator=in_range(1e-6, 86400.0))
_min_cap = attrs.field(default=0, validator=in_range(0, 1 << 16, integer=True))


@attrs.frozen(kw_only=True)
class ReadLocal:
    """Read this node's replica only. Always sees this node's own writes."""

    timeout: float = _timeout


@attrs.frozen(kw_only=True)
class ReadFrom:
    """Read from ``n`` replicas, this node included, and merge what they hold."""

    n: int = attrs.field(validator=in_range(1, 1 << 16, integer=True))
    timeout: float = _timeout


@attrs.frozen(kw_only=True)
class ReadMajority:
    """Read from a majority of the replicas (at least ``min_cap`` of them when there are that many).

    Example:
        >>> ReadMajority(timeout=2.0)
        ReadMajority(timeout=2.0, min_cap=0)
    """

    timeout: float = _timeout
    min_cap: int = _min_cap


@attrs.frozen(kw_only=True)
class ReadMajorityPlus:
    """Read from a majority plus ``additional`` replicas, not counting members that are leaving."""

    additional: int = attrs.field(validator=in_range(0, 1 << 16, integer=True))
    timeout: float = _timeout
    min_cap: int = _min_cap


@attrs.frozen(kw_only=True)
class ReadAll:
    """Read from every replica."""

    timeout: float = _timeout


@attrs.frozen(kw_only=True)
class WriteLocal:
    """Write to this node's replica only; gossip spreads it."""

    timeout: float = _timeout


@attrs.frozen(kw_only=True)
class WriteTo:
    """Wait until ``n`` replicas, this node included, hold the write."""

    n: int = attrs.field(validator=in_range(1, 1 << 16, integer=True))
    timeout: float = _timeout


@attrs.frozen(kw_only=True)
class WriteMajority:
    """Wait until a majority of the replicas (at least ``min_cap`` when there are) hold the write.

    Example:
        >>> WriteMajority(timeout=2.0, min_cap=3)
        WriteMajority(timeout=2.0, min_cap=3)
    """

    timeout: float = _timeout
    min_cap: int = _min_cap


@attrs.frozen(kw_only=True)
class WriteMajorityPlus:
    """Wait for a majority plus ``additional`` replicas, not counting members that are leaving."""

    additional: int = attrs.field(validator=in_range(0, 1 << 16, integer=True))
    timeout: float = _timeout
    min_cap: int = _min_cap


@attrs.frozen(kw_only=True)
class WriteAll:
    """Wait until every replica holds the write."""

    timeout: float = _timeout


ReadConsistency: TypeAlias = ReadLocal | ReadFrom | ReadMajority | ReadMajorityPlus | ReadAll
WriteConsistency: TypeAlias = WriteLocal | WriteTo | WriteMajority | WriteMajorityPlus | WriteAll
Consistency: TypeAlias = ReadConsistency | WriteConsistency

_READS = (ReadLocal, ReadFrom, ReadMajority, ReadMajorityPlus, ReadAll)
_WRITES = (WriteLocal, WriteTo, WriteMajority, WriteMajorityPlus, WriteAll)


def check_read(consistency: object) -> ReadConsistency:
    """``consistency`` if it is a read level, else a TypeError naming what is allowed."""
    if not isinstance(consistency, _READS):
        raise TypeError(
            f"{consistency!r} is not a read consistency: use ReadLocal, ReadFrom, ReadMajority, "
            "ReadMajorityPlus or ReadAll"
        )
    return consistency


def check_write(consistency: object) -> WriteConsistency:
    """``consistency`` if it is a write level, else a TypeError naming what is allowed."""
    if not isinstance(consistency, _WRITES):
        raise TypeError(
            f"{consistency!r} is not a write consistency: use WriteLocal, WriteTo, WriteMajority, "
            "WriteMajorityPlus or WriteAll"
        )
    return consistency


def excludes_leaving(consistency: Consistency) -> bool:
    """Whether members that are leaving are left out of the replicas asked (the Plus levels)."""
    return isinstance(consistency, ReadMajorityPlus | WriteMajorityPlus)


def quorum(consistency: Consistency, replicas: int) -> int:
    """How many replicas, this node included, must answer out of ``replicas``.

    ``replicas`` counts this node; for the Plus levels it must already leave out the members that
    are leaving.

    Example:
        >>> quorum(WriteMajority(), 5), quorum(WriteMajorityPlus(additional=1), 5)
        (3, 4)
        >>> quorum(ReadMajority(min_cap=5), 3)
        3
    """
    n = replicas
    match consistency:
        case ReadLocal() | WriteLocal():
            return 1
        case ReadFrom(n=wanted) | WriteTo(n=wanted):
            return wanted
        case ReadMajority(min_cap=cap) | WriteMajority(min_cap=cap):
            return min(n, max(n // 2 + 1, cap))
        case (
            ReadMajorityPlus(additional=plus, min_cap=cap)
            | WriteMajorityPlus(additional=plus, min_cap=cap)
        ):
            return min(n, max(n // 2 + 1 + plus, cap))
        case ReadAll() | WriteAll():
            return n
    raise TypeError(f"{consistency!r} is not a consistency level")  # pragma: no cover
