"""Who can reach whom, as observed by the failure detectors. Sans-IO.

Theory of operation (Akka's ``Reachability``): each observer keeps records about the subjects it
monitors: Unreachable or Reachable (and Terminated, which is final). Only the observer changes its
own records, and every change bumps that observer's version, so when two tables are merged the
rows of each observer are taken whole from the side with the higher version. An observer that sees
everyone as reachable keeps no rows at all, so a healthy cluster gossips an empty table.

A subject is unreachable if any observer that is not itself Down says so; it blocks convergence
until it is reachable again or Down/Exiting. Values are kept in canonical (sorted) form, so two
tables with the same content are equal.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

import attrs

from .transport._address import UniqueAddress, node_order
from .transport._wire import message


@message(name="p2pshard.ReachabilityStatus")
class ReachabilityStatus(enum.Enum):
    """One observer's view of one subject."""

    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"
    TERMINATED = "terminated"


@message(name="p2pshard.ReachabilityRecord")
@attrs.frozen
class Record:
    """``observer`` sees ``subject`` with ``status``, as of the observer's ``version``."""

    observer: UniqueAddress
    subject: UniqueAddress
    status: ReachabilityStatus
    version: int


# Sorted by node_order keys, the order of comparing the addresses themselves: the attrs-made
# comparison builds tuples at every step, and every gossip decoded sorts its table again.
def _sorted_records(records: Iterable[Record]) -> tuple[Record, ...]:
    return tuple(sorted(records, key=lambda r: (node_order(r.observer), node_order(r.subject))))


def _sorted_versions(
    versions: Iterable[tuple[UniqueAddress, int]],
) -> tuple[tuple[UniqueAddress, int], ...]:
    return tuple(sorted(versions, key=lambda nv: (node_order(nv[0]), nv[1])))


@message(name="p2pshard.Reachability")
@attrs.frozen
class Reachability:
    """An immutable reachability table: records and the version of each observer."""

    records: tuple[Record, ...] = attrs.field(default=(), converter=_sorted_records)
    versions: tuple[tuple[UniqueAddress, int], ...] = attrs.field(
        default=(), converter=_sorted_versions
    )

    def _version(self, observer: UniqueAddress) -> int:
        for node, version in self.versions:
            if node == observer:
                return version
        return 0

    def _rows(self, observer: UniqueAddress) -> list[Record]:
        return [r for r in self.records if r.observer == observer]

    def unreachable(self, observer: UniqueAddress, subject: UniqueAddress) -> Reachability:
        """``observer`` now sees ``subject`` as unreachable."""
        return self._change(observer, subject, ReachabilityStatus.UNREACHABLE)

    def reachable(self, observer: UniqueAddress, subject: UniqueAddress) -> Reachability:
        """``observer`` now sees ``subject`` as reachable again."""
        return self._change(observer, subject, ReachabilityStatus.REACHABLE)

    def terminated(self, observer: UniqueAddress, subject: UniqueAddress) -> Reachability:
        """``observer`` knows ``subject`` is gone for good."""
        return self._change(observer, subject, ReachabilityStatus.TERMINATED)

    def _change(
        self, observer: UniqueAddress, subject: UniqueAddress, status: ReachabilityStatus
    ) -> Reachability:
        rows = self._rows(observer)
        old = next((r for r in rows if r.subject == subject), None)
        reachable = ReachabilityStatus.REACHABLE
        if old is None and status is reachable:
            return self  # reachable is the default: nothing to record
        if old is not None and (
            old.status is ReachabilityStatus.TERMINATED or old.status is status
        ):
            return self
        version = self._version(observer) + 1
        versions = [(n, v) for n, v in self.versions if n != observer] + [(observer, version)]
        others = [r for r in self.records if r.observer != observer]
        kept = [r for r in rows if r.subject != subject]
        if status is reachable and all(r.status is reachable for r in kept):
            # The observer sees everyone as reachable again: drop its rows, keep the version.
            return Reachability(others, versions)
        return Reachability([*others, *kept, Record(observer, subject, status, version)], versions)

    def merge(self, allowed: Collection[UniqueAddress], other: Reachability) -> Reachability:
        """Combine two tables, keeping only observers and subjects in ``allowed``.

        Each observer's rows come whole from the side with its higher version.
        """
        allowed = frozenset(allowed)
        records: list[Record] = []
        versions: dict[UniqueAddress, int] = {}
        observers = {n for n, _ in self.versions} | {n for n, _ in other.versions}
        for observer in observers & allowed:
            mine, theirs = self._version(observer), other._version(observer)
            if mine != theirs:
                rows = (self if mine > theirs else other)._rows(observer)
            else:
                # The same observer state, maybe trimmed to different subjects on each side (a
                # side drops rows about nodes it does not know): the union is that state.
                by_subject = {r.subject: r for r in self._rows(observer)}
                for r in other._rows(observer):
                    by_subject.setdefault(r.subject, r)
                rows = list(by_subject.values())
            records.extend(r for r in rows if r.subject in allowed)
            versions[observer] = max(mine, theirs)
        return Reachability(records, versions.items())

    def remove(self, nodes: Collection[UniqueAddress]) -> Reachability:
        """Forget ``nodes`` as observers and as subjects (they left the cluster)."""
        gone = frozenset(nodes)
        return Reachability(
            [r for r in self.records if r.observer not in gone and r.subject not in gone],
            [(n, v) for n, v in self.versions if n not in gone],
        )

    def remove_observers(self, nodes: Collection[UniqueAddress]) -> Reachability:
        """Ignore what ``nodes`` observed (e.g. observers that are Down)."""
        gone = frozenset(nodes)
        if not gone:
            return self
        return Reachability(
            [r for r in self.records if r.observer not in gone],
            [(n, v) for n, v in self.versions if n not in gone],
        )

    def status(self, observer: UniqueAddress, subject: UniqueAddress) -> ReachabilityStatus:
        """What ``observer`` thinks of ``subject``."""
        for r in self.records:
            if r.observer == observer and r.subject == subject:
                return r.status
        return ReachabilityStatus.REACHABLE

    def is_reachable_from(self, observer: UniqueAddress, subject: UniqueAddress) -> bool:
        """True unless ``observer`` has a negative record about ``subject``."""
        return self.status(observer, subject) is ReachabilityStatus.REACHABLE

    def aggregated_status(self, subject: UniqueAddress) -> ReachabilityStatus:
        """Terminated if any observer says so, else Unreachable if any does, else Reachable."""
        statuses = {r.status for r in self.records if r.subject == subject}
        if ReachabilityStatus.TERMINATED in statuses:
            return ReachabilityStatus.TERMINATED
        if ReachabilityStatus.UNREACHABLE in statuses:
            return ReachabilityStatus.UNREACHABLE
        return ReachabilityStatus.REACHABLE

    def is_reachable(self, subject: UniqueAddress) -> bool:
        """True unless some observer has a negative record about ``subject``."""
        return all(
            r.subject != subject or r.status is ReachabilityStatus.REACHABLE for r in self.records
        )

    @property
    def is_all_reachable(self) -> bool:
        """No negative record at all."""
        return not self.records

    def all_unreachable_or_terminated(self) -> frozenset[UniqueAddress]:
        """Every subject some observer sees as unreachable or terminated."""
        return frozenset(
            r.subject for r in self.records if r.status is not ReachabilityStatus.REACHABLE
        )

    def all_unreachable_from(self, observer: UniqueAddress) -> frozenset[UniqueAddress]:
        """Subjects ``observer`` sees as unreachable."""
        return frozenset(
            r.subject
            for r in self.records
            if r.observer == observer and r.status is ReachabilityStatus.UNREACHABLE
        )

    def observers_grouped_by_unreachable(self) -> dict[UniqueAddress, frozenset[UniqueAddress]]:
        """For each unreachable subject, the observers that see it so."""
        grouped: dict[UniqueAddress, set[UniqueAddress]] = {}
        for r in self.records:
            if r.status is ReachabilityStatus.UNREACHABLE:
                grouped.setdefault(r.subject, set()).add(r.observer)
        return {subject: frozenset(obs) for subject, obs in sorted(grouped.items())}
