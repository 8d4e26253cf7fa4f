"""Defaults of the replicator: the role of Akka's ``pekko.cluster.distributed-data`` section.

Every field says its default and meaning; values are checked when the object is built.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import attrs

from membership import ConfigurationError
from membership.internal import NAME_PATTERN, in_range


def _check_patterns(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(p, str) and p for p in value):
        raise ConfigurationError(
            f"ReplicatorSettings.{attribute.name} = {value!r} is invalid: must be a list of "
            "non-empty glob patterns such as 'coordinator-*'"
        )


def _invalid(attribute: attrs.Attribute[Any], value: object, allowed: str) -> ConfigurationError:
    return ConfigurationError(
        f"ReplicatorSettings.{attribute.name} = {value!r} is invalid: {allowed}"
    )


def _check_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise _invalid(
            attribute,
            value,
            "use 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )


def _check_role(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (
        not isinstance(value, str) or not value or "," in value or any(c.isspace() for c in value)
    ):
        raise _invalid(attribute, value, "must be None or a role name without ',' or spaces")


def _check_path(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, Path) or value == Path()):
        raise _invalid(attribute, value, "must be None or a non-empty path to an SQLite file")


def _as_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _as_path(value: object) -> object:
    return Path(value) if isinstance(value, str) and value else None if value == "" else value


@attrs.frozen(kw_only=True)
class ReplicatorSettings:
    """How a replicator spreads and keeps its keys. The defaults suit a LAN or one host."""

    name: str = attrs.field(default="ddata", validator=_check_name)
    """The replicator's name (default ``ddata``). Replicators with the same name on different
    nodes are replicas of each other; a node may run several under different names."""

    role: str | None = attrs.field(default=None, validator=_check_role)
    """Only members with this role hold replicas (default: every member)."""

    gossip_interval: float = attrs.field(default=2.0, validator=in_range(0.01, 3600.0))
    """Seconds between anti-entropy rounds with one random peer (default 2)."""

    delta_interval: float = attrs.field(default=0.2, validator=in_range(0.001, 3600.0))
    """Seconds between pushes of recent local-only writes to every peer (default 0.2)."""

    notify_interval: float = attrs.field(default=0.5, validator=in_range(0.001, 3600.0))
    """Seconds between change notifications to subscribers; changes in between coalesce
    (default 0.5)."""

    digest_buckets: int = attrs.field(default=64, validator=in_range(1, 4096, integer=True))
    """Keys are hashed into this many buckets; a gossip round first compares one hash per
    bucket, so a cluster at rest exchanges a few hundred bytes whatever the number of keys
    (default 64; must be the same on every node)."""

    max_message_bytes: int = attrs.field(
        default=256 << 10, validator=in_range(1024, 1 << 30, integer=True)
    )
    """Largest payload of CRDT updates or digests in one gossip message, in bytes (default
    256 KiB); more goes in several messages. Must stay below the transport's max_frame_size."""

    durable_keys: tuple[str, ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_check_patterns
    )
    """Glob patterns (``fnmatch``) of keys kept in the durable store (default none). A write to a
    durable key is on disk before it is acknowledged; durable keys survive a full restart."""

    durable_path: Path | None = attrs.field(default=None, converter=_as_path, validator=_check_path)
    """SQLite file of the durable store (default none; needed when ``durable_keys`` is set)."""

    compact_after: int = attrs.field(default=500, validator=in_range(1, 1 << 30, integer=True))
    """A durable key's appended updates are folded into one snapshot after this many (default
    500)."""

    def __attrs_post_init__(self) -> None:
        if self.durable_keys and self.durable_path is None:
            raise ConfigurationError(
                f"ReplicatorSettings.durable_keys = {list(self.durable_keys)!r} needs a "
                "durable_path: the SQLite file to keep them in"
            )

    def is_durable(self, key: str) -> bool:
        """Whether ``key`` matches one of ``durable_keys``."""
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.durable_keys)
