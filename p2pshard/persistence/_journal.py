"""The journal of event-sourced entities: the interface, its settings and its rules. Sans-IO.

Theory of operation. Akka does not move an entity's state when its shard moves: an entity that
must outlive its incarnation persists itself. :class:`p2pshard.EventSourcedEntity` keeps its
state as a sequence of events in a :class:`Journal`, one *stream* per persistence id
(``<type name>|<entity id>``, as Akka's ``PersistenceId.of``), numbered 1, 2, 3, ... with no
gaps, plus at most one snapshot of the state at some sequence number. A new incarnation
recovers: the latest snapshot, then the events after it.

Every stream also keeps a *fence*: the largest fencing token any call on it has carried. Each
call is one transaction that first checks the token against the fence (these rules are the
functions :func:`admit_token` and :func:`check_next` below, shared by every backend):

- a token lower than the fence is refused with :class:`JournalFenced` and nothing is written;
  a higher one raises the fence (``recover`` included, so a new holder's recovery shuts out
  the old holder at once, before it has written anything);
- a token of None (leases are off) is not checked and does not move the fence;
- an append must start at the highest stored sequence number plus one, else
  :class:`JournalConflict`: another writer got there first, with or without tokens;
- an append is all or nothing: a batch of events is written in one transaction, and an event
  above ``max_event_size`` refuses the whole batch with :class:`EventTooLarge` before any I/O.

The SQL backends may write the appends of several callers in one transaction (group commit,
``p2pshard.persistence._group_commit``): each is still checked by these rules alone, in arrival
order, and gets its own answer, as if it had had a transaction of its own.

Fencing is per persistence id. The shard's lease token (see ``p2pshard.leases._lease``) reaches each
incarnation through ``EntityContext.lease_token``; a new holder raises the fence of an entity
when it recovers that entity. Until then an old holder that has not noticed its loss may still
append to an entity the new holder has not touched yet, but the new holder's recovery reads
those events, so nothing acknowledged is lost and the stream stays one linear history. Akka's
persistence has no fence; its answer to two writers is a sequence-number clash only.

Backends: :class:`p2pshard.SqliteJournal` (one file shared by every node process on a host, the
default), :class:`p2pshard.PostgresJournal` (multi-host) and :class:`p2pshard.MemoryJournal`
(tests and the simulated cluster, with fault injection).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs

from membership import ConfigurationError
from membership.internal import in_range

from .._errors import EventTooLarge, JournalConflict, JournalError, JournalFenced

DEFAULT_MAX_EVENT_SIZE = 1 << 20
"""Bytes an encoded event or snapshot may take by default (1 MiB)."""

DEFAULT_SNAPSHOT_EVERY = 100
"""Events between snapshots by default, for entity types that do not say."""

DEFAULT_GROUP_COMMIT_MAX_EVENTS = 1000
"""Events one group commit of the SQL journals may write by default."""

DEFAULT_GROUP_COMMIT_MAX_BYTES = 4 << 20
"""Bytes of events one group commit of the SQL journals may write by default (4 MiB)."""

DEFAULT_CONNECTIONS = 4
"""Connections (worker threads) a SQL journal keeps by default."""

LOCK_WAIT_FRACTION = 0.8
"""Part of ``operation_timeout`` a storage backend lets one call wait for another writer's lock
(SQLite's busy timeout, PostgreSQL's ``statement_timeout`` and ``lock_timeout``): the store then
refuses the call itself, with nothing written, before the caller's timeout abandons the thread
and leaves the outcome unknown."""

JOURNAL_SCHEMA_VERSION = 1
"""The layout of the journal's tables that this release writes and reads. A store of a higher
version (a newer release wrote it) is refused rather than misread; a store of a lower one is
migrated forward when opened (see ``p2pshard._store_version``). Version 1 is the first numbered
one: a store without a number is of that layout, and gets it."""


def _invalid(instance: Any, attribute: attrs.Attribute[Any], value: Any, allowed: str) -> None:
    raise ConfigurationError(
        f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: must be {allowed}"
    )


def _check_backend(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in (None, "sqlite", "postgresql"):
        _invalid(instance, attribute, value, "'sqlite', 'postgresql' or None")


def _check_path(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, Path) or value == Path()):
        _invalid(instance, attribute, value, "a path to a file, or None")


def _check_dsn(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        _invalid(
            instance,
            attribute,
            value,
            "a PostgreSQL connection string such as 'postgresql://user@db-host/shop' or "
            "'host=db-host dbname=shop', or None",
        )


@attrs.frozen(kw_only=True)
class JournalSettings:
    """Where a node's event-sourced entities keep their events (the ``[journal]`` table).

    ``backend`` None (default) means the node has no journal: ``node.journal`` raises, and
    event-sourced entity types need a journal handed to them. ``"sqlite"`` keeps the events in
    the file ``path``, which every node process on one host may share; ``"postgresql"`` in the
    database ``dsn`` names (multi-host; needs the ``postgresql`` extra, psycopg 3)::

        [journal]
        backend = "sqlite"
        path = "journal.db"     # relative to the configuration file
        snapshot_every = 100
        group_commit_max_events = 1000  # one transaction writes the appends waiting, up to
        group_commit_max_bytes = 4194304  # these limits (a lone append goes out at once)
        connections = 4
        # backend = "postgresql"
        # dsn = "postgresql://p2pshard@db-host/shop"

    Example:
        >>> JournalSettings(backend="sqlite", path=Path("journal.db")).operation_timeout
        5.0
    """

    backend: Literal["sqlite", "postgresql"] | None = attrs.field(
        default=None, validator=_check_backend
    )
    """``"sqlite"``, ``"postgresql"`` or None (default: no journal)."""

    path: Path | None = attrs.field(default=None, validator=_check_path)
    """sqlite: the database file (created if missing; its directory must exist)."""

    dsn: str | None = attrs.field(default=None, validator=_check_dsn)
    """postgresql: a libpq connection string or URL. The tables are created if missing."""

    operation_timeout: float = attrs.field(default=5.0, validator=in_range(0.01, 3600.0))
    """Seconds one journal call may take, waiting for locks included, before it fails with
    :class:`p2pshard.JournalError` (default 5)."""

    snapshot_every: int | None = attrs.field(
        default=DEFAULT_SNAPSHOT_EVERY,
        validator=attrs.validators.optional(in_range(1, 1 << 30, integer=True)),  # type: ignore[arg-type]
    )
    """Events between snapshots for entity types that do not set their own ``snapshot_every``
    (default 100); None: no snapshots, recovery replays every event."""

    max_event_size: int = attrs.field(
        default=DEFAULT_MAX_EVENT_SIZE, validator=in_range(1, 1 << 30, integer=True)
    )
    """Bytes one encoded event or snapshot may take (default 1 MiB); a larger one is refused
    with :class:`p2pshard.EventTooLarge` before anything is written."""

    group_commit_max_events: int = attrs.field(
        default=DEFAULT_GROUP_COMMIT_MAX_EVENTS, validator=in_range(1, 1_000_000, integer=True)
    )
    """sqlite, postgresql: events one transaction may write (default 1000). Appends that arrive
    while a transaction is being committed wait and go out together in the next one, up to this
    many events and ``group_commit_max_bytes`` (an append above either goes alone); 1 writes
    each append in a transaction of its own."""

    group_commit_max_bytes: int = attrs.field(
        default=DEFAULT_GROUP_COMMIT_MAX_BYTES, validator=in_range(1, 1 << 30, integer=True)
    )
    """sqlite, postgresql: bytes of events one transaction may write (default 4 MiB)."""

    connections: int = attrs.field(
        default=DEFAULT_CONNECTIONS, validator=in_range(1, 1000, integer=True)
    )
    """sqlite, postgresql: connections kept open, and so calls (recoveries, snapshots) run at
    once (default 4). Appends use connections of their own besides, in batches: SQLite one,
    PostgreSQL up to two under heavy load, each committing a batch while the other's appends
    are answered."""

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.backend == "sqlite" and self.path is None:
            raise ConfigurationError(
                f"{name}.path is missing: backend 'sqlite' needs the database file, e.g. "
                'path = "journal.db"'
            )
        if self.backend == "postgresql" and self.dsn is None:
            raise ConfigurationError(
                f"{name}.dsn is missing: backend 'postgresql' needs a connection string, e.g. "
                'dsn = "postgresql://p2pshard@db-host/shop"'
            )


@attrs.frozen
class Recovery:
    """What :meth:`Journal.recover` read: the latest snapshot and the events after it."""

    snapshot: tuple[int, bytes] | None
    """The latest snapshot as ``(sequence number, data)``, or None."""

    events: tuple[tuple[int, bytes], ...]
    """The events after the snapshot (all of them without one), as ``(sequence number, data)``
    in order."""

    highest_seq: int
    """The highest stored sequence number (0 for a new stream): the next append starts after it."""


@attrs.frozen
class SnapshotWrite:
    """One snapshot of a batch (:meth:`BatchJournal.save_snapshots`).

    The state of ``persistence_id`` after event ``seq``, written with ``token``.
    """

    persistence_id: str
    """The stream."""

    seq: int
    """The sequence number of the last event in the state."""

    data: bytes
    """The encoded state."""

    token: int | None
    """The fencing token, as for :meth:`Journal.save_snapshot`."""


class Journal(Protocol):
    """Where event-sourced entities keep their events: one stream per persistence id.

    Each call is one transaction (appends may share one, each checked and answered alone: group
    commit). Every method raises :class:`p2pshard.JournalError` (naming
    the persistence id, the cause chained) when the storage fails; see the module docstring of
    ``p2pshard.persistence._journal`` for the fencing and sequence rules.

    Example:
        >>> async def two_events(journal: Journal) -> None:
        ...     recovery = await journal.recover("Room|lobby", token=None)
        ...     await journal.append(
        ...         "Room|lobby", recovery.highest_seq + 1, [b"joined", b"left"], token=None
        ...     )
    """

    @property
    def max_event_size(self) -> int:
        """Bytes one event or snapshot may take."""
        ...

    @property
    def snapshot_every(self) -> int | None:
        """Events between snapshots for entity types that do not set their own."""
        ...

    async def recover(self, persistence_id: str, token: int | None) -> Recovery:
        """Raise the stream's fence to ``token`` and read its latest snapshot and later events.

        Raises:
            JournalFenced: ``token`` is lower than the fence (nothing changed).
            JournalError: the storage failed.
        """
        ...

    async def append(
        self, persistence_id: str, first_seq: int, events: Sequence[bytes], *, token: int | None
    ) -> None:
        """Store ``events`` as ``first_seq``, ``first_seq + 1``, ...: all of them or none.

        Raises:
            EventTooLarge: an event is above ``max_event_size`` (nothing written).
            JournalFenced: ``token`` is lower than the fence (nothing written).
            JournalConflict: ``first_seq`` is not the highest sequence number plus one.
            JournalError: the storage failed; after a timeout the append may have been written.
            ValueError: no events, a ``first_seq`` below 1, an event that is not bytes.
        """
        ...

    async def save_snapshot(
        self, persistence_id: str, seq: int, data: bytes, *, token: int | None
    ) -> None:
        """Keep ``data`` as the state after event ``seq``, replacing an older snapshot.

        A snapshot older than the stored one is ignored.

        Raises:
            EventTooLarge: ``data`` is above ``max_event_size`` (nothing written).
            JournalFenced: ``token`` is lower than the fence (nothing written).
            JournalConflict: ``seq`` is beyond the highest stored event.
            JournalError: the storage failed.
        """
        ...

    async def aclose(self) -> None:
        """Close connections. Calls after it fail with :class:`p2pshard.JournalError`."""
        ...


class BatchJournal(Journal, Protocol):
    """A :class:`Journal` that also reads many recoveries, and writes many snapshots, at once.

    Optional: :class:`p2pshard.EventSourcedEntity` gathers the recoveries and snapshot writes
    of many entities into batches when its journal has these two methods (the bundled ones do),
    and otherwise calls :meth:`Journal.recover` and :meth:`Journal.save_snapshot` one at a
    time, so a journal written for an earlier release keeps working unchanged. Each element of
    a batch has the outcome it would have had alone, in the batch's order; a storage failure
    may fail the whole batch.

    Example:
        >>> async def wake(journal: BatchJournal) -> list[Recovery | JournalError]:
        ...     return await journal.recover_many([("Room|a", 7), ("Room|b", 7)])
    """

    async def recover_many(
        self, requests: Sequence[tuple[str, int | None]]
    ) -> list[Recovery | JournalError]:
        """:meth:`Journal.recover` for each ``(persistence_id, token)``, in one transaction.

        Returns, in the order of ``requests``, each stream's :class:`Recovery` or its own
        :class:`p2pshard.JournalError` (a :class:`p2pshard.JournalFenced` for a stale token),
        naming that stream. Two requests for one stream are answered as if the higher token
        came first.

        Raises:
            ValueError: a persistence id is not a non-empty string (nothing read).
            TypeError: a token is not an int or None (nothing read).
        """
        ...

    async def save_snapshots(self, snapshots: Sequence[SnapshotWrite]) -> list[JournalError | None]:
        """:meth:`Journal.save_snapshot` for each of ``snapshots``, in one transaction.

        Returns, in order, None for each snapshot kept (or ignored as older than the stored
        one) and its own :class:`p2pshard.JournalError` for each refused or failed one.

        Raises:
            ValueError: a sequence number below 1 (nothing written).
            TypeError: data that is not bytes, or a bad token (nothing written).
            EventTooLarge: data above ``max_event_size`` (nothing written).
        """
        ...


# --- the rules every backend applies inside its transaction -------------------------------------


def check_persistence_id(persistence_id: object) -> str:
    """``persistence_id`` if it is a non-empty string, else ValueError."""
    if not isinstance(persistence_id, str) or not persistence_id:
        raise ValueError(f"a persistence id must be a non-empty string, not {persistence_id!r}")
    return persistence_id


def check_token(token: object) -> int | None:
    """``token`` if it is None or an int, else TypeError."""
    if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
        raise TypeError(f"a fencing token must be an int or None, not {token!r}")
    return token


def check_append(
    persistence_id: str, first_seq: int, events: Sequence[bytes], max_event_size: int
) -> list[bytes]:
    """The arguments of an append, checked before any I/O; returns the events as a list of bytes.

    Raises:
        ValueError: no events, or ``first_seq`` is not an integer from 1.
        TypeError: an event is not bytes.
        EventTooLarge: an event is above ``max_event_size``.
    """
    check_persistence_id(persistence_id)
    if not isinstance(first_seq, int) or isinstance(first_seq, bool) or first_seq < 1:
        raise ValueError(f"first_seq must be an integer from 1, not {first_seq!r}")
    batch = list(events)
    if not batch:
        raise ValueError(f"an append to {persistence_id!r} needs at least one event")
    for i, event in enumerate(batch):
        if type(event) is not bytes or len(event) > max_event_size:  # else nothing to say
            check_size(persistence_id, f"event {first_seq + i}", event, max_event_size)
            batch[i] = bytes(event)
    return batch


def check_recoveries(requests: Sequence[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    """The requests of a batched recovery, checked before any I/O, as a list."""
    checked = [(check_persistence_id(pid), check_token(token)) for pid, token in requests]
    return checked


def check_snapshots(snapshots: Sequence[SnapshotWrite], max_event_size: int) -> list[SnapshotWrite]:
    """The snapshots of a batched write, checked before any I/O, as a list."""
    batch = list(snapshots)
    for snapshot in batch:
        pid = check_persistence_id(snapshot.persistence_id)
        check_size(pid, f"snapshot at {snapshot.seq}", snapshot.data, max_event_size)
        check_token(snapshot.token)
        seq = snapshot.seq
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
            raise ValueError(f"a snapshot's sequence number must be an integer from 1, not {seq!r}")
    return batch


def check_size(persistence_id: str, what: str, data: bytes, max_event_size: int) -> None:
    """Raise :class:`EventTooLarge` (or TypeError for non-bytes) before ``data`` is written."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{what} of {persistence_id!r} must be bytes, not {type(data).__name__}")
    if len(data) > max_event_size:
        raise EventTooLarge(
            f"{what} of {persistence_id!r} encodes to {len(data)} bytes, above the journal's "
            f"max_event_size {max_event_size}; nothing was written"
        )


def admit_token(persistence_id: str, fence: int | None, token: int | None) -> int | None:
    """The stream's fence after a call carrying ``token``; JournalFenced if it is refused."""
    if token is None:
        return fence
    if fence is not None and token < fence:
        raise JournalFenced(
            persistence_id,
            f"fencing token {token} is lower than {fence}, which a newer holder of the shard's "
            "lease has used: this incarnation is stale; nothing was written",
        )
    return token if fence is None else max(fence, token)


def check_next(persistence_id: str, first_seq: int, highest: int) -> None:
    """Raise :class:`JournalConflict` unless ``first_seq`` continues a stream at ``highest``."""
    if first_seq != highest + 1:
        raise JournalConflict(
            persistence_id,
            f"append at sequence number {first_seq}, but the highest stored is {highest}: "
            "another writer appended first; nothing was written",
        )


def check_snapshot_seq(persistence_id: str, seq: int, highest: int) -> None:
    """Raise :class:`JournalConflict` if a snapshot at ``seq`` would be beyond the last event."""
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ValueError(f"a snapshot's sequence number must be an integer from 1, not {seq!r}")
    if seq > highest:
        raise JournalConflict(
            persistence_id,
            f"snapshot at sequence number {seq} is beyond the highest stored event {highest}; "
            "nothing was written",
        )
