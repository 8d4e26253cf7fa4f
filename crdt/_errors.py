"""Errors of the replicated state layer, under :class:`membership.ClusterError`."""

from __future__ import annotations

from membership import ClusterError


class ReplicationError(ClusterError):
    """Base class of the replicator's errors."""


class UpdateTimeout(ReplicationError):
    """An update or delete was not confirmed by enough replicas within its timeout.

    Raised by :meth:`Replicator.update` and :meth:`Replicator.delete` for every consistency level
    above local. The change is not undone: it is in the local replica (and on the replicas that
    did confirm) and still reaches every replica by gossip. Not raised for local writes.
    """


class GetFailure(ReplicationError):
    """A read did not get answers from enough replicas within its timeout.

    Raised by :meth:`Replicator.get` for every consistency level above local. The local replica
    still holds whatever the answers that did arrive brought in.
    """


class StoreFailure(ReplicationError):
    """Writing a durable key to the local SQLite store failed (disk full, I/O error, ...).

    As in Akka, the change is already in memory and spreads to the other replicas by gossip, but
    it is not on this node's disk: if this node stops before another replica has it, it is lost.
    The original error is the ``__cause__``.
    """


class DataDeleted(ReplicationError):
    """The key was deleted. A deleted key stays deleted: it cannot be read, updated or reused."""
