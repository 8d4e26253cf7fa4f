"""Messages between replicators. Every message names the replicator it is for.

Direct reads and writes (a request and its answers)::

    Read(state) ──▶ ReadResult(update | deleted)
    Write(update, required) ──▶ WriteAck | WriteNack(state | deleted) ──▶ Write(missing part) ...
    Delete ──▶ DeleteAck

Anti-entropy (one round with a random peer every ``gossip_interval``)::

    Status(bucket hashes) ──▶ KeyDigests(keys of the buckets that differ)
        ──▶ Sync(states, updates, reply=True) ──▶ Sync(updates, states) ──▶ Sync(updates)

Deltas: recent local-only writes pushed to every peer every ``delta_interval``.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs

from membership import message


def _of(kind: type | tuple[type, ...]) -> Any:
    """A validator: a peer's message with a field of the wrong type is rejected when decoded."""
    return attrs.validators.instance_of(kind)


@message(name="p2pshard.ddata.Read")
@attrs.frozen(kw_only=True)
class Read:
    """Ask for what the recipient holds of ``key`` beyond the reader's ``state`` vector."""

    replicator: str = attrs.field(validator=_of(str))
    key: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))
    state: bytes = attrs.field(validator=_of(bytes))


@message(name="p2pshard.ddata.ReadResult")
@attrs.frozen(kw_only=True)
class ReadResult:
    """The answer to a Read: a yrs update (None: no such key here), or the key is deleted."""

    replicator: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))
    update: bytes | None = attrs.field(default=None, validator=_of((bytes, type(None))))
    deleted: bool = attrs.field(default=False, validator=_of(bool))


@message(name="p2pshard.ddata.Write")
@attrs.frozen(kw_only=True)
class Write:
    """Apply ``update`` to ``key``; acknowledge once the replica covers the ``required`` state."""

    replicator: str = attrs.field(validator=_of(str))
    key: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))
    update: bytes = attrs.field(validator=_of(bytes))
    required: bytes = attrs.field(validator=_of(bytes))


@message(name="p2pshard.ddata.WriteAck")
@attrs.frozen(kw_only=True)
class WriteAck:
    """The replica's state covers the write (and, for a durable key, it is on disk)."""

    replicator: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))


@message(name="p2pshard.ddata.WriteNack")
@attrs.frozen(kw_only=True)
class WriteNack:
    """The replica lacks part of what the write builds on, or the key is deleted there.

    ``state`` is the replica's state vector: the writer sends what lies beyond it.
    """

    replicator: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))
    state: bytes = attrs.field(default=b"", validator=_of(bytes))
    deleted: bool = attrs.field(default=False, validator=_of(bool))


@message(name="p2pshard.ddata.Delete")
@attrs.frozen(kw_only=True)
class Delete:
    """Delete ``key`` for good."""

    replicator: str = attrs.field(validator=_of(str))
    key: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))


@message(name="p2pshard.ddata.DeleteAck")
@attrs.frozen(kw_only=True)
class DeleteAck:
    """The key is deleted on the replica (and, for a durable key, on its disk)."""

    replicator: str = attrs.field(validator=_of(str))
    request_id: int = attrs.field(validator=_of(int))


@message(name="p2pshard.ddata.Status")
@attrs.frozen(kw_only=True)
class Status:
    """One 8-byte hash per digest bucket: the XOR of the digests of the keys in it."""

    replicator: str = attrs.field(validator=_of(str))
    buckets: bytes = attrs.field(validator=_of(bytes))


@message(name="p2pshard.ddata.KeyDigests")
@attrs.frozen(kw_only=True)
class KeyDigests:
    """Per-key digests of every key in ``buckets`` (the buckets whose hashes differed)."""

    replicator: str = attrs.field(validator=_of(str))
    buckets: tuple[int, ...] = attrs.field(validator=_of(tuple))
    digests: dict[str, bytes] = attrs.field(validator=_of(dict))


@message(name="p2pshard.ddata.Sync")
@attrs.frozen(kw_only=True)
class Sync:
    """Updates for the recipient, and the sender's state of keys it wants the rest of.

    ``states`` maps a key to the sender's state vector and ``delete_sets`` to the hash of its
    delete set; the recipient answers with what the sender lacks, and with its own states when
    ``reply`` is set.
    """

    replicator: str = attrs.field(validator=_of(str))
    updates: dict[str, bytes] = attrs.field(factory=dict, validator=_of(dict))
    states: dict[str, bytes] = attrs.field(factory=dict, validator=_of(dict))
    delete_sets: dict[str, bytes] = attrs.field(factory=dict, validator=_of(dict))
    deleted: tuple[str, ...] = attrs.field(default=(), validator=_of(tuple))
    reply: bool = attrs.field(default=False, validator=_of(bool))


@message(name="p2pshard.ddata.Deltas")
@attrs.frozen(kw_only=True)
class Deltas:
    """Recent local writes, one merged yrs update per key."""

    replicator: str = attrs.field(validator=_of(str))
    updates: dict[str, bytes] = attrs.field(validator=_of(dict))


ReplicatorMessage: TypeAlias = (
    Read
    | ReadResult
    | Write
    | WriteAck
    | WriteNack
    | Delete
    | DeleteAck
    | Status
    | KeyDigests
    | Sync
    | Deltas
)
REPLICATOR_MESSAGES = (
    Read,
    ReadResult,
    Write,
    WriteAck,
    WriteNack,
    Delete,
    DeleteAck,
    Status,
    KeyDigests,
    Sync,
    Deltas,
)
