"""Errors of cluster sharding, under :class:`membership.ClusterError`.

Local misuse (a bad argument, an unstarted entity type) raises ``ConfigurationError`` or
``TypeError``/``ValueError``; what went wrong somewhere else in the cluster (an entity raised, no
answer came, a buffer overflowed) raises a :class:`ShardingError`.
"""

from __future__ import annotations

from membership import ClusterError, SerializationError


class ShardingError(ClusterError):
    """Something in cluster sharding failed at run time (not a misuse of the API)."""


class RemoteEntityError(ShardingError):
    """The entity raised while handling an ``ask``.

    Raised by ``ask`` only; a ``tell`` that makes an entity raise is logged where the entity
    runs. ``error_type`` is the exception's qualified class name and ``error_text`` its text.
    """

    def __init__(self, entity_id: str, error_type: str, error_text: str) -> None:
        super().__init__(f"entity {entity_id!r} raised {error_type}: {error_text}")
        self.entity_id = entity_id
        self.error_type = error_type
        self.error_text = error_text


class AskTimeout(ShardingError):
    """No answer to an ``ask`` within its timeout. The message may still have been handled."""


class BufferOverflow(ShardingError):
    """The region's buffer for messages to shards without a known home is full.

    Raised by ``ask`` at once; a ``tell`` in that state is dropped, logged and counted in the
    region's statistics (``dropped``), as Akka does. Raised only while homes are unresolved (no
    coordinator, or shards being handed off); a known home never buffers.
    """


class RegionStopped(ShardingError):
    """The region has stopped (its node left or shut the entity type down); nothing is sent."""


class LeaseUnavailable(ClusterError):
    """The lease backend did not answer in time, or failed.

    Whether the operation took effect is unknown; it is not a refusal (``acquire`` returns None
    for that). Try again later.
    """


class NodeLeaseGone(LeaseUnavailable):
    """The node lease a name was to be attached to no longer exists in the backend.

    Raised by a :class:`~p2pshard.NodeLeaseBackend`'s ``try_acquire_attached``; the node then
    asks for a new node lease.
    """


class JournalError(ShardingError):
    """The journal of event-sourced entities could not do what was asked.

    Raised by :class:`p2pshard.Journal` calls (and so by ``EventSourcedEntity.persist``) when
    storage failed (a locked or unreadable file, a lost database connection, no answer within
    ``operation_timeout``) or stored data cannot be read back. The message names the persistence
    id and the cause is chained. After a failure that is not a subclass the outcome may be
    unknown (an append that timed out may still commit); a refusal (:class:`JournalFenced`,
    :class:`JournalConflict`) wrote nothing.
    """

    def __init__(self, persistence_id: str, text: str) -> None:
        super().__init__(f"journal of {persistence_id!r}: {text}")
        self.persistence_id = persistence_id


class JournalFenced(JournalError):
    """A write (or recovery) carried a fencing token lower than one the journal has seen.

    The caller is a stale holder of the shard's lease: a newer holder has recovered the
    persistence id with a larger token since. Nothing was written.
    """


class JournalConflict(JournalError):
    """An append did not continue the stored sequence: another writer appended first.

    ``first_seq`` was not the highest stored sequence number plus one (or a snapshot was taken
    at a sequence number beyond the highest event). Nothing was written.
    """


class EventTooLarge(SerializationError):
    """An event or snapshot encodes to more bytes than the journal's ``max_event_size``.

    Raised by the journal call before anything is written (in a batch, nothing of the batch is
    written). Make the event smaller, or raise ``[journal] max_event_size``.
    """
