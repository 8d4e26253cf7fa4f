"""Application versions and their order: which members run the newest release during a rollout.

Theory of operation: every node joins with the ``app_version`` it was started with (a node
setting, carried in its member record). While a rolling upgrade is under way the members run
different versions, and two decisions depend on which is the newest: the shard coordinators give
new shards only to regions of the newest version (and do not rebalance), and singletons run on
the oldest member of the newest version, so that they move once, to the first upgraded node,
rather than at every step of the rollout.

The order is Akka's (``akka.util.Version``), close to semantic versioning: the text is cut at the
first ``-`` (a qualifier follows) and at the first ``+`` (build metadata, ignored); the part before
is compared number by number, so ``1.10.0`` is newer than ``1.9.2``, and missing numbers count as
zero (``1.2`` equals ``1.2.0``). A version with a qualifier is older than the same version
without one (``1.0.0-rc1`` comes before ``1.0.0``). Qualifiers compare part by part on ``.``,
numeric parts numerically and before alphanumeric ones, as in semantic versioning
(``rc.2`` < ``rc.10``, but ``rc10`` < ``rc2`` as text). A part of the leading section that is
not a number (``2024a``) starts the qualifier there. The empty version (not set) is older than
every other, so a cluster that sets no versions behaves as if they were all equal.

Example:
    >>> AppVersion.parse("1.10.0") > AppVersion.parse("1.9.2")
    True
    >>> AppVersion.parse("1.0.0-rc1") < AppVersion.parse("1.0.0")
    True
    >>> AppVersion.parse("1.2") == AppVersion.parse("1.2.0+build.7")
    True
    >>> newest_app_version(["1.0.0", "", "1.1.0-rc.1", "1.0.9"])
    '1.1.0-rc.1'
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

import attrs

__all__ = ["AppVersion", "newest_app_version"]

_NUMBER = re.compile(r"\d+")

_Part = tuple[int, int, str]
"""One qualifier part: numeric parts ``(0, n, "")`` sort before alphanumeric ``(1, 0, text)``."""


def _qualifier_part(text: str) -> _Part:
    return (0, int(text), "") if _NUMBER.fullmatch(text) else (1, 0, text)


@attrs.frozen(order=True)
class AppVersion:
    """An application version, ordered as Akka orders them (see the module docstring).

    Build one with :meth:`parse`; instances compare with ``<``, ``==`` and the rest. Two texts
    that differ only in build metadata or trailing zeros are equal.
    """

    given: bool
    """False for the empty version, which is older than every other."""
    numbers: tuple[int, ...]
    """The leading numbers, trailing zeros dropped (``1.2.0`` → ``(1, 2)``)."""
    released: bool
    """False when the version has a qualifier (a pre-release), which makes it older."""
    qualifier: tuple[_Part, ...]
    """The qualifier's parts, as sort keys."""

    @classmethod
    def parse(cls, text: str) -> AppVersion:
        """The version ``text`` names; any string is accepted (the node setting is validated).

        Example:
            >>> AppVersion.parse("2.4.1-rc.2").numbers
            (2, 4, 1)
        """
        return _parse(text)

    @property
    def is_empty(self) -> bool:
        """Whether this is the empty version (``app_version`` not set)."""
        return not self.given


@functools.lru_cache(maxsize=256)
def _parse(text: str) -> AppVersion:
    text = text.split("+", 1)[0]
    main, dash, qualifier = text.partition("-")
    numbers: list[int] = []
    rest: list[str] = []
    if main:
        parts = main.split(".")
        for i, part in enumerate(parts):
            if not _NUMBER.fullmatch(part):
                head = _NUMBER.match(part)
                if head is not None:
                    numbers.append(int(head.group()))
                    part = part[head.end() :]
                rest = [part, *parts[i + 1 :]]
                break
            numbers.append(int(part))
    if dash:
        rest.extend(qualifier.split("."))
    while numbers and numbers[-1] == 0:
        numbers.pop()
    parts_key = tuple(_qualifier_part(p) for p in rest if p)
    return AppVersion(bool(text), tuple(numbers), released=not parts_key, qualifier=parts_key)


def newest_app_version(versions: Iterable[str]) -> str | None:
    """The newest of ``versions`` in the :class:`AppVersion` order (None when there are none).

    Of texts that name the same version (``1.2`` and ``1.2.0``), the first one given.
    """
    newest: str | None = None
    newest_key: AppVersion | None = None
    for text in versions:
        key = _parse(text)
        if newest_key is None or key > newest_key:
            newest, newest_key = text, key
    return newest
