"""The replicator's protocol, sans-IO: pycrdt documents, quorum reads and writes, anti-entropy.

Akka Distributed Data's ``Replicator``, rebuilt on yrs documents.

Theory of operation. Every key holds one pycrdt ``Doc``; every replica of a key edits its own
copy and copies merge by exchanging yrs updates, in any order, any number of times. All
documents of one replicator incarnation write under one client id, drawn at random (53 bits)
when the core is built and never reused: a restarted node must not write under an old id, or
replicas silently diverge.

*Writes.* :meth:`ReplicatorCore.update` runs the caller's ``modify`` inside one transaction on
the local document and captures that transaction's update. For a write above local consistency
the update goes to the other replicas in a ``Write`` with the writer's state vector after the
write as ``required``. A replica applies it and acknowledges only once its own state vector covers
``required``: that proves it holds the write and everything the write builds on (a delete of an
item it never saw would otherwise stay pending). A replica that lacks something answers with its
state vector and the writer sends the missing part. Where Akka counts "message received", this
counts "state covers the write". The write completes when ``quorum - 1`` other replicas
acknowledged (and, for a durable key, the local append is on disk); at the timeout it fails with
:class:`UpdateTimeout` but stays in the local replica and spreads by gossip.

*Reads* ask replicas for what they hold beyond the reader's state vector, merge every answer into
the local replica (read repair) and complete when ``quorum - 1`` answered.

*Anti-entropy.* Every ``gossip_interval`` the core sends one random reachable peer a
:class:`Status` with one hash per digest bucket (keys hash into a fixed number of buckets; a
bucket's hash is the XOR of its keys' digests, so a cluster at rest exchanges a few hundred
bytes whatever the number of keys). For the buckets that differ the peer sends per-key digests;
then both sides exchange state vectors and the updates the other lacks (:class:`Sync`). A digest
is a hash of the state vector *and* the delete set, because deleting never advances a state
vector. Local-only writes are also pushed to every peer as :class:`Deltas` every
``delta_interval``.

*Deleted keys* leave a tombstone that wins over any update and is never removed: a deleted key
cannot be reused, as in Akka.

*Durability* is the shell's: the core emits :class:`Persist` for every change of a durable key
and holds back what depends on it (the caller's completion, a ``WriteAck``) until the shell
reports :meth:`ReplicatorCore.persisted`. A failed append fails the write with
:class:`StoreFailure`; as in Akka the change stays in memory and spreads.

The core keeps the contract of every sans-IO core (``membership/_timer.py``): each input takes
``now`` and returns the effects it decided, in order: :meth:`ReplicatorCore.receive` (a peer's
message), :meth:`~ReplicatorCore.tick` (time passed; :meth:`~ReplicatorCore.next_deadline` says
when it is next due), :meth:`~ReplicatorCore.set_peers`, :meth:`~ReplicatorCore.persisted` and
:meth:`~ReplicatorCore.abandon`; :meth:`~ReplicatorCore.update`, :meth:`~ReplicatorCore.get` and
:meth:`~ReplicatorCore.delete` return the new operation's id with them. A shell that answers an
effect at once with another input (``persisted`` for a :class:`Persist`, as the unit tests'
driver does) carries out what that input returns after the rest of the list it is working
through. When :meth:`~ReplicatorCore.update` raises because the caller's ``modify`` did, the
effects of what ``modify`` changed come from :meth:`~ReplicatorCore.take_effects`.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import attrs
from pycrdt import Doc, merge_updates

from membership import Member, MemberStatus, UniqueAddress
from membership.internal import node_order

from ._consistency import (
    Consistency,
    ReadConsistency,
    ReadLocal,
    WriteConsistency,
    WriteLocal,
    excludes_leaving,
    quorum,
)
from ._digest import (
    DELETED_DIGEST,
    EMPTY_STATE,
    MalformedState,
    covers,
    decode_state_vector,
    delete_set_hash,
    digest,
)
from ._errors import DataDeleted, GetFailure, ReplicationError, StoreFailure, UpdateTimeout
from ._protocol import (
    Delete,
    DeleteAck,
    Deltas,
    KeyDigests,
    Read,
    ReadResult,
    ReplicatorMessage,
    Status,
    Sync,
    Write,
    WriteAck,
    WriteNack,
)
from ._settings import ReplicatorSettings

logger = logging.getLogger("crdt.replicator")

EMPTY_UPDATE = b"\x00\x00"
"""A yrs update that changes nothing."""

MAX_KEY_LENGTH = 1024
"""Longest key, in characters."""

MAX_WRITE_RESENDS = 3
"""How often a write sends a lagging replica the part it lacks before leaving it to gossip."""

_MESSAGE_OVERHEAD = 16
"""Bytes counted per entry on top of its key and payload when splitting gossip messages."""


@attrs.frozen
class Send:
    """Effect: send ``message`` to ``to``."""

    to: UniqueAddress
    message: ReplicatorMessage


@attrs.frozen
class Persist:
    """Effect: append to the durable store, then call ``persisted(ticket, error, now)``.

    ``entries`` maps a key to a yrs update to append, or to None: the key was deleted. With
    ``snapshot`` each update is the key's full state and replaces what is stored (after a
    failed append, the next change of the key is stored this way).
    """

    ticket: int
    entries: tuple[tuple[str, bytes | None], ...]
    snapshot: bool = False


@attrs.frozen
class Compact:
    """Effect: replace the stored updates of ``key`` by ``snapshot`` (its full state).

    It must reach the store after every ``Persist`` emitted before it.
    """

    key: str
    snapshot: bytes


@attrs.frozen
class Complete:
    """Effect: operation ``op`` finished with ``value``, or failed with ``error``."""

    op: int
    value: object = None
    error: ReplicationError | None = None


Effect: TypeAlias = Send | Persist | Compact | Complete


_REPLICA_STATUSES = frozenset(
    {MemberStatus.UP, MemberStatus.LEAVING, MemberStatus.EXITING, MemberStatus.DOWN}
)
"""Members that count towards quorums (Down ones until they are removed)."""
_LEAVING_STATUSES = frozenset({MemberStatus.LEAVING, MemberStatus.EXITING})


@attrs.frozen
class Peers:
    """The other members this replicator talks to, as the shell sees the cluster.

    ``replicas`` count towards quorums (Up, Leaving, Exiting, or Down but not yet removed);
    ``leaving`` are those of them that are leaving or exiting; ``weakly_up`` get gossip but do not
    count; ``unreachable`` get no gossip (direct reads and writes still try them).
    """

    replicas: frozenset[UniqueAddress] = frozenset()
    leaving: frozenset[UniqueAddress] = frozenset()
    weakly_up: frozenset[UniqueAddress] = frozenset()
    unreachable: frozenset[UniqueAddress] = frozenset()

    @classmethod
    def of(
        cls,
        members: Iterable[Member],
        unreachable: Iterable[UniqueAddress],
        *,
        self_node: UniqueAddress,
        role: str | None,
    ) -> Peers:
        """The peers of ``self_node`` among the cluster's ``members`` (with ``role``, if set)."""
        replicas: set[UniqueAddress] = set()
        leaving: set[UniqueAddress] = set()
        weakly_up: set[UniqueAddress] = set()
        for member in members:
            if member.node == self_node or (role is not None and role not in member.roles):
                continue
            if member.status in _REPLICA_STATUSES:
                replicas.add(member.node)
                if member.status in _LEAVING_STATUSES:
                    leaving.add(member.node)
            elif member.status is MemberStatus.WEAKLY_UP:
                weakly_up.add(member.node)
        return cls(
            frozenset(replicas), frozenset(leaving), frozenset(weakly_up), frozenset(unreachable)
        )


@attrs.frozen
class CoreStatistics:
    """Counters of one replicator core."""

    keys: int
    deleted_keys: int
    pending_writes: int
    pending_reads: int
    gossip_messages_sent: int
    gossip_messages_received: int
    gossip_bytes_sent: int
    gossip_bytes_received: int
    malformed_messages: int


@attrs.define(eq=False)
class _Entry:
    doc: Doc[Any]
    durable: bool
    captured: list[bytes] = attrs.Factory(list)
    appended: int = 0


@attrs.define(eq=False)
class _Op:
    kind: Literal["read", "write", "delete"]
    key: str
    deadline: float
    needed: int
    targets: frozenset[UniqueAddress]
    answered: set[UniqueAddress] = attrs.Factory(set)
    persisted: bool = True
    value: object = None
    required: bytes = b""
    resends: dict[UniqueAddress, int] = attrs.Factory(dict)
    failed: ReplicationError | None = None
    consistency: Consistency | None = None
    """The level it was asked for, to count again when replicas are removed meanwhile."""


@attrs.define(eq=False)
class _Ticket:
    keys: tuple[str, ...]
    snapshot: bool
    ops: list[int] = attrs.Factory(list)
    sends: list[Send] = attrs.Factory(list)


def check_key(key: object) -> str:
    """``key`` if it is a valid key (a non-empty string up to 1024 characters), else an error."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"key {key!r:.80} is invalid: must be a non-empty string of at most "
            f"{MAX_KEY_LENGTH} characters"
        )
    return key


def _stable_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class ReplicatorCore:
    """One replicator's keys and protocol state. See the module docstring."""

    def __init__(
        self,
        self_node: UniqueAddress,
        settings: ReplicatorSettings,
        *,
        client_id: int,
        rng: random.Random,
        now: float,
        loaded: Mapping[str, Sequence[bytes] | None] = {},
    ) -> None:
        """Build the core; ``loaded`` is what the durable store held (None: deleted key)."""
        if not 0 < client_id < 1 << 53:
            raise ValueError(f"client_id {client_id} is outside 1 to 2**53 - 1")
        self.self_node = self_node
        self.settings = settings
        self.client_id = client_id
        self._effects: list[Effect] = []  # what the input under way decided so far
        self._name = settings.name
        self._rng = rng
        self._docs: dict[str, _Entry] = {}
        self._deleted: set[str] = set()
        self._peers = Peers()
        self._ops: dict[int, _Op] = {}
        self._next_id = 1
        self._tickets: dict[int, _Ticket] = {}
        self._unpersisted: dict[str, int] = {}  # key -> its latest ticket not yet on disk
        self._disk_stale: set[str] = set()  # keys whose disk copy missed a failed append
        self._deltas: dict[str, list[bytes]] = {}
        self._changed: set[str] = set()
        # Anti-entropy bookkeeping: each key's contribution to its bucket's hash.
        self._bucket_of: dict[str, int] = {}
        self._contribution: dict[str, int] = {}
        self._digests: dict[str, bytes] = {}
        self._bucket_hash = [0] * settings.digest_buckets
        self._bucket_keys: list[set[str]] = [set() for _ in range(settings.digest_buckets)]
        self._dirty: set[str] = set()
        self._next_gossip = now + settings.gossip_interval * rng.random()
        self._next_delta: float | None = None
        self._sent = self._received = self._bytes_sent = self._bytes_received = 0
        self._malformed = 0
        for key, data in loaded.items():
            if data is None:
                self._deleted.add(key)
                self._dirty.add(key)
                continue
            entry = self._entry(key)
            for update in data:
                entry.doc.apply_update(update)
            entry.captured.clear()
        self._changed.clear()

    # -- the caller's operations ------------------------------------------------------------

    def update(
        self,
        key: str,
        modify: Callable[[Doc[Any]], object],
        consistency: WriteConsistency,
        now: float,
    ) -> tuple[int, list[Effect]]:
        """Run ``modify`` on the key's document in one transaction and replicate the change.

        Returns the operation id and the effects; a :class:`Complete` with ``modify``'s result
        follows (maybe among these effects). If ``modify`` raises, what it changed before
        raising stays (yrs cannot roll back), is replicated like a local write, and the error
        propagates: the effects of that change then come from :meth:`take_effects`.

        Raises:
            DataDeleted: the key was deleted.
            ValueError: an invalid key.
        """
        check_key(key)
        if key in self._deleted:
            raise DataDeleted(f"key {key!r} was deleted and cannot be updated or reused")
        created = key not in self._docs
        entry = self._entry(key)
        entry.captured.clear()
        try:
            with entry.doc.transaction():
                value = modify(entry.doc)
                if inspect.isawaitable(value):
                    if inspect.iscoroutine(value):
                        value.close()
                    raise TypeError(
                        "modify must be a plain function that edits the document and returns; "
                        "it returned an awaitable"
                    )
        except BaseException:
            delta = self._take_captured(entry)
            if delta is not None:
                self._local_change(key, entry, delta, now, replicate=True)
            elif created:
                self._forget(key)  # nothing was written: leave no empty key behind
            raise
        delta = self._take_captured(entry)
        op_id = self._new_op_id()
        local = isinstance(consistency, WriteLocal)
        if delta:
            ticket = self._local_change(key, entry, delta, now, replicate=local)
        else:  # nothing changed; still, what this write returns on must be on disk
            ticket = self._unpersisted.get(key)
        targets, needed = self._quorum(consistency)
        op = _Op(
            "write",
            key,
            now + consistency.timeout,
            needed,
            targets,
            value=value,
            required=entry.doc.get_state(),
            persisted=ticket is None,
            consistency=consistency,
        )
        self._ops[op_id] = op
        if ticket is not None:
            self._tickets[ticket].ops.append(op_id)
        if not local:
            for node in targets:
                self._send(
                    node,
                    Write(
                        replicator=self._name,
                        request_id=op_id,
                        key=key,
                        update=delta or EMPTY_UPDATE,
                        required=op.required,
                    ),
                )
        self._maybe_complete(op_id, op)
        return op_id, self._take()

    def get(self, key: str, consistency: ReadConsistency, now: float) -> tuple[int, list[Effect]]:
        """Read ``key``; returns the operation id and the effects.

        A :class:`Complete` with a snapshot ``Doc`` (or None) follows, maybe among these effects.

        Raises:
            ValueError: an invalid key.
        """
        check_key(key)
        op_id = self._new_op_id()
        if isinstance(consistency, ReadLocal):
            self._complete_read(op_id, key)
            return op_id, self._take()
        targets, needed = self._quorum(consistency)
        op = _Op("read", key, now + consistency.timeout, needed, targets, consistency=consistency)
        self._ops[op_id] = op
        entry = self._docs.get(key)
        state = entry.doc.get_state() if entry is not None else EMPTY_STATE
        for node in targets:
            self._send(node, Read(replicator=self._name, request_id=op_id, key=key, state=state))
        self._maybe_complete(op_id, op)
        return op_id, self._take()

    def delete(
        self, key: str, consistency: WriteConsistency, now: float
    ) -> tuple[int, list[Effect]]:
        """Delete ``key`` for good; returns the operation id and the effects.

        A :class:`Complete` follows, maybe among these effects.

        Raises:
            DataDeleted: the key was deleted already.
            ValueError: an invalid key.
        """
        check_key(key)
        if key in self._deleted:
            raise DataDeleted(f"key {key!r} was deleted already")
        ticket = self._delete_local(key)
        op_id = self._new_op_id()
        targets, needed = self._quorum(consistency)
        op = _Op("delete", key, now + consistency.timeout, needed, targets, consistency=consistency)
        op.persisted = ticket is None
        if ticket is not None:
            self._tickets[ticket].ops.append(op_id)
        self._ops[op_id] = op
        if not isinstance(consistency, WriteLocal):
            for node in targets:
                self._send(node, Delete(replicator=self._name, request_id=op_id, key=key))
        self._maybe_complete(op_id, op)
        return op_id, self._take()

    def snapshot(self, key: str) -> Doc[Any] | None:
        """A detached copy of the local replica of ``key`` (None: no such key).

        Raises:
            DataDeleted: the key was deleted.
        """
        if key in self._deleted:
            raise DataDeleted(f"key {key!r} was deleted")
        entry = self._docs.get(key)
        if entry is None:
            return None
        copy: Doc[Any] = Doc(client_id=self._rng.randrange(1, 1 << 53))
        copy.apply_update(entry.doc.get_update())
        return copy

    def held_keys(self) -> list[str]:
        """The keys this replica holds, sorted (deleted keys are not listed)."""
        return sorted(self._docs)

    def has(self, key: str) -> bool:
        """Whether this replica holds ``key``."""
        return key in self._docs

    def is_deleted(self, key: str) -> bool:
        """Whether ``key`` was deleted."""
        return key in self._deleted

    def digest(self, key: str) -> bytes | None:
        """The key's digest (equal on replicas holding the same), None when absent."""
        if key in self._deleted:
            return DELETED_DIGEST
        entry = self._docs.get(key)
        return digest(entry.doc) if entry is not None else None

    def size_of(self, key: str) -> int:
        """Bytes of the key's full state as a yrs update (0 when absent or deleted)."""
        entry = self._docs.get(key)
        return len(entry.doc.get_update()) if entry is not None else 0

    def take_changed(self) -> set[str]:
        """Keys changed (or deleted) since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def set_peers(self, peers: Peers, now: float) -> list[Effect]:
        """The cluster changed: these are the peers now (operations under way keep theirs).

        A peer that was not there before gets a gossip round at once, so a node that joins
        catches up without waiting for the random choice to fall on it. A replica that was
        removed (it is no member any more; a Down one still counts until then) leaves the
        operations under way, whose quorum is counted again over the replicas that remain, as
        if they had started after the removal: a write waiting for a crashed node's answer
        completes when the node is removed instead of timing out.
        """
        old = self._peers
        self._peers = peers
        for op_id, op in list(self._ops.items()):
            gone = op.targets - peers.replicas
            if not gone or op.consistency is None:
                continue
            op.targets = op.targets - gone
            op.answered -= gone
            wanted = quorum(op.consistency, len(op.targets) + 1) - 1
            op.needed = max(0, min(op.needed, wanted - len(op.answered)))
            self._maybe_complete(op_id, op)
        new = (peers.replicas | peers.weakly_up) - peers.unreachable
        known = (old.replicas | old.weakly_up) - old.unreachable
        joined = sorted(new - known, key=node_order)
        if joined:
            self._refresh()
            for node in joined:
                self._send_status(node)
        return self._take()

    def abandon(self, op_id: int, now: float) -> list[Effect]:
        """Forget an operation whose caller stopped waiting (its effects are not undone).

        It decides nothing new: the list is empty unless an earlier input raised and left
        effects that :meth:`take_effects` did not collect.
        """
        self._ops.pop(op_id, None)
        return self._take()

    # -- time -------------------------------------------------------------------------------

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do next."""
        deadline = self._next_gossip
        if self._next_delta is not None:
            deadline = min(deadline, self._next_delta)
        for op in self._ops.values():
            deadline = min(deadline, op.deadline)
        return deadline

    def tick(self, now: float) -> list[Effect]:
        """Time out operations, push deltas and gossip when due."""
        for op_id, op in list(self._ops.items()):
            if now >= op.deadline:
                del self._ops[op_id]
                self._effects.append(Complete(op_id, error=self._timeout_error(op)))
        if self._next_delta is not None and now >= self._next_delta:
            self._next_delta = None
            self._push_deltas()
        if now >= self._next_gossip:
            self._next_gossip = now + self.settings.gossip_interval
            self._gossip()
        return self._take()

    # -- durability -------------------------------------------------------------------------

    def persisted(self, ticket: int, error: BaseException | None, now: float) -> list[Effect]:
        """The store finished ``ticket``: release what waited on it, or fail it."""
        waiting = self._tickets.pop(ticket, None)
        if waiting is None:
            return self._take()
        for key in waiting.keys:
            if self._unpersisted.get(key) == ticket:
                del self._unpersisted[key]
            if error is not None:
                self._disk_stale.add(key)
            elif waiting.snapshot:
                self._disk_stale.discard(key)
            elif key in self._disk_stale:
                # Stored after an append of this key failed: on disk it would build on a hole.
                error = StoreFailure(f"an earlier write of {key!r} to the durable store failed")
        for op_id in waiting.ops:
            op = self._ops.get(op_id)
            if op is None:
                continue
            if error is not None:
                del self._ops[op_id]
                failure = StoreFailure(f"writing {op.key!r} to the durable store failed: {error}")
                failure.__cause__ = error
                self._effects.append(Complete(op_id, error=failure))
            else:
                op.persisted = True
                self._maybe_complete(op_id, op)
        if error is None:
            self._effects.extend(waiting.sends)  # acknowledgements promised on disk
        return self._take()

    # -- messages from peers ----------------------------------------------------------------

    def receive(
        self, sender: UniqueAddress, message: ReplicatorMessage, now: float
    ) -> list[Effect]:
        """Handle one message from another replicator with this name.

        A malformed message (bad key, state or update bytes) is counted and dropped; what it
        had changed before the bad part stays, as any valid update would.
        """
        try:
            self._dispatch(sender, message)
        except (MalformedState, ValueError, TypeError, OverflowError) as error:
            self._malformed += 1
            logger.warning(
                "dropped a malformed %s from %s: %s", type(message).__name__, sender, error
            )
        return self._take()

    def take_effects(self) -> list[Effect]:
        """The effects an input decided before it raised (an input that returns hands its own).

        When :meth:`update` raises because ``modify`` did, what ``modify`` had changed is kept
        and replicated: the shell carries out these effects before it lets the error go on.
        """
        return self._take()

    def _take(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        return effects

    def _dispatch(self, sender: UniqueAddress, message: ReplicatorMessage) -> None:
        match message:
            case Write():
                self._on_write(sender, message)
            case WriteAck(request_id=op_id):
                op = self._answered(sender, op_id, "write")
                if op is not None:
                    op.needed -= 1
                    self._maybe_complete(op_id, op)
            case WriteNack():
                self._on_write_nack(sender, message)
            case Read():
                self._on_read(sender, message)
            case ReadResult():
                self._on_read_result(sender, message)
            case Delete(key=key, request_id=op_id):
                check_key(key)
                reply = Send(sender, DeleteAck(replicator=self._name, request_id=op_id))
                if key in self._deleted:
                    ticket = self._unpersisted.get(key)  # its tombstone may be on its way
                else:
                    ticket = self._delete_local(key)
                self._after(ticket, reply)
            case DeleteAck(request_id=op_id):
                op = self._answered(sender, op_id, "delete")
                if op is not None:
                    op.needed -= 1
                    self._maybe_complete(op_id, op)
            case Status():
                self._received += 1
                self._bytes_received += len(message.buckets)
                self._on_status(sender, message)
            case KeyDigests():
                self._received += 1
                self._bytes_received += sum(len(k) + len(d) for k, d in message.digests.items())
                self._on_key_digests(sender, message)
            case Sync():
                self._received += 1
                self._bytes_received += _sync_size(message)
                self._on_sync(sender, message)
            case Deltas(updates=updates):
                self._received += 1
                self._bytes_received += sum(len(k) + len(u) for k, u in updates.items())
                for key, update in updates.items():
                    if check_key(key) not in self._deleted:
                        self._apply(key, update)

    def _on_write(self, sender: UniqueAddress, message: Write) -> None:
        key = check_key(message.key)
        if key in self._deleted:
            self._send(
                sender,
                WriteNack(replicator=self._name, request_id=message.request_id, deleted=True),
            )
            return
        required = decode_state_vector(message.required)
        ticket = self._apply(key, message.update)
        if ticket is None:  # nothing new, but what it holds may not be on disk yet
            ticket = self._unpersisted.get(key)
        state = self._docs[key].doc.get_state()
        if state == message.required or covers(decode_state_vector(state), required):
            reply: ReplicatorMessage = WriteAck(
                replicator=self._name, request_id=message.request_id
            )
        else:
            reply = WriteNack(replicator=self._name, request_id=message.request_id, state=state)
        self._after(ticket, Send(sender, reply))

    def _on_write_nack(self, sender: UniqueAddress, message: WriteNack) -> None:
        op = self._ops.get(message.request_id)
        if op is None or op.kind != "write" or sender not in op.targets:
            return
        if message.deleted:
            del self._ops[message.request_id]
            self._delete_local(op.key)
            self._effects.append(
                Complete(message.request_id, error=DataDeleted(f"key {op.key!r} was deleted"))
            )
            return
        resends = op.resends.get(sender, 0)
        entry = self._docs.get(op.key)
        if resends >= MAX_WRITE_RESENDS or entry is None:
            return
        op.resends[sender] = resends + 1
        missing = entry.doc.get_update(message.state)
        self._send(
            sender,
            Write(
                replicator=self._name,
                request_id=message.request_id,
                key=op.key,
                update=missing,
                required=op.required,
            ),
        )

    def _on_read(self, sender: UniqueAddress, message: Read) -> None:
        key = check_key(message.key)
        rid = message.request_id
        if key in self._deleted:
            self._send(sender, ReadResult(replicator=self._name, request_id=rid, deleted=True))
            return
        entry = self._docs.get(key)
        if entry is None:
            self._send(sender, ReadResult(replicator=self._name, request_id=rid))
            return
        decode_state_vector(message.state)  # yrs would panic on some garbage; check first
        self._send(
            sender,
            ReadResult(
                replicator=self._name, request_id=rid, update=entry.doc.get_update(message.state)
            ),
        )

    def _on_read_result(self, sender: UniqueAddress, message: ReadResult) -> None:
        op = self._answered(sender, message.request_id, "read")
        if op is None:
            return
        if message.deleted:
            if op.key not in self._deleted:
                self._delete_local(op.key)
        elif message.update is not None and op.key not in self._deleted:
            self._apply(op.key, message.update)  # read repair of the local replica
        op.needed -= 1
        self._maybe_complete(message.request_id, op)

    # -- anti-entropy -----------------------------------------------------------------------

    def _gossip(self) -> None:
        peers = sorted(
            (self._peers.replicas | self._peers.weakly_up) - self._peers.unreachable,
            key=node_order,
        )
        if not peers:
            return
        self._refresh()
        self._send_status(self._rng.choice(peers))

    def _send_status(self, to: UniqueAddress) -> None:
        buckets = b"".join(h.to_bytes(8, "big") for h in self._bucket_hash)
        self._gossip_send(to, Status(replicator=self._name, buckets=buckets), len(buckets))

    def _on_status(self, sender: UniqueAddress, message: Status) -> None:
        count = self.settings.digest_buckets
        if len(message.buckets) != 8 * count:
            raise MalformedState(
                f"Status has {len(message.buckets) // 8} buckets, this node {count}: "
                "digest_buckets must be the same on every node"
            )
        self._refresh()
        differing = [
            i
            for i in range(count)
            if self._bucket_hash[i] != int.from_bytes(message.buckets[8 * i : 8 * i + 8], "big")
        ]
        batch: list[int] = []
        digests: dict[str, bytes] = {}
        size = 0
        for bucket in differing:
            keys = self._bucket_keys[bucket]
            bucket_size = sum(len(k) + 16 + _MESSAGE_OVERHEAD for k in keys)
            if batch and size + bucket_size > self.settings.max_message_bytes:
                self._send_digests(sender, batch, digests, size)
                batch, digests, size = [], {}, 0
            batch.append(bucket)
            for key in keys:
                digests[key] = self._digests[key]
            size += bucket_size
        if batch:
            self._send_digests(sender, batch, digests, size)

    def _send_digests(
        self, to: UniqueAddress, buckets: list[int], digests: dict[str, bytes], size: int
    ) -> None:
        message = KeyDigests(replicator=self.settings.name, buckets=tuple(buckets), digests=digests)
        self._gossip_send(to, message, size)

    def _on_key_digests(self, sender: UniqueAddress, message: KeyDigests) -> None:
        self._refresh()
        keys: set[str] = set()
        for bucket in message.buckets:
            if not 0 <= bucket < self.settings.digest_buckets:
                raise MalformedState(f"bucket {bucket} out of range")
            keys |= self._bucket_keys[bucket]
        for key in message.digests:
            keys.add(check_key(key))
        parts: list[_SyncPart] = []
        for key in sorted(keys):
            theirs = message.digests.get(key)
            mine = self._digests.get(key)
            if mine == theirs:
                continue
            if theirs == DELETED_DIGEST:
                self._delete_local(key)
            elif mine == DELETED_DIGEST:
                parts.append(_SyncPart(key, deleted=True))
            elif mine is None:
                parts.append(_SyncPart(key, state=EMPTY_STATE))
            elif theirs is None:
                parts.append(_SyncPart(key, update=self._docs[key].doc.get_update()))
            else:
                doc = self._docs[key].doc
                parts.append(_SyncPart(key, state=doc.get_state(), ds=delete_set_hash(doc)))
        self._send_sync(sender, parts, reply=True)

    def _on_sync(self, sender: UniqueAddress, message: Sync) -> None:
        for key in message.deleted:
            if check_key(key) not in self._deleted:
                self._delete_local(key)
        for key, update in message.updates.items():
            if check_key(key) not in self._deleted:
                self._apply(key, update)
        parts: list[_SyncPart] = []
        for key, state in message.states.items():
            check_key(key)
            if key in self._deleted:
                parts.append(_SyncPart(key, deleted=True))
                continue
            entry = self._docs.get(key)
            if entry is None:
                if message.reply:
                    parts.append(_SyncPart(key, state=EMPTY_STATE))
                continue
            if state == EMPTY_STATE:  # the sender has nothing of it: all, no comparison
                parts.append(_SyncPart(key, update=entry.doc.get_update()))
                continue
            part = _SyncPart(key)
            mine = entry.doc.get_state()
            ds = delete_set_hash(entry.doc)
            if not covers(decode_state_vector(state), decode_state_vector(mine)) or (
                message.delete_sets.get(key) != ds
            ):
                part.update = entry.doc.get_update(state)
            if message.reply:
                part.state, part.ds = mine, ds
            if part.update is not None or part.state is not None:
                parts.append(part)
        self._send_sync(sender, parts, reply=False)

    def _send_sync(self, to: UniqueAddress, parts: list[_SyncPart], *, reply: bool) -> None:
        limit = self.settings.max_message_bytes
        batch: list[_SyncPart] = []
        size = 0
        for part in parts:
            if batch and size + part.size() > limit:
                self._gossip_send(to, _sync_message(self.settings.name, batch, reply), size)
                batch, size = [], 0
            batch.append(part)
            size += part.size()
        if batch:
            self._gossip_send(to, _sync_message(self.settings.name, batch, reply), size)

    def _push_deltas(self) -> None:
        deltas, self._deltas = self._deltas, {}
        merged = {
            key: updates[0] if len(updates) == 1 else merge_updates(*updates)
            for key, updates in deltas.items()
            if key in self._docs
        }
        peers = (self._peers.replicas | self._peers.weakly_up) - self._peers.unreachable
        if not merged or not peers:
            return
        batches: list[tuple[dict[str, bytes], int]] = [({}, 0)]
        for key, update in merged.items():
            size = len(key) + len(update) + _MESSAGE_OVERHEAD
            updates, total = batches[-1]
            if updates and total + size > self.settings.max_message_bytes:
                batches.append(({}, 0))
                updates, total = batches[-1]
            updates[key] = update
            batches[-1] = (updates, total + size)
        for node in sorted(peers, key=node_order):
            for updates, total in batches:
                self._gossip_send(
                    node, Deltas(replicator=self.settings.name, updates=updates), total
                )

    # -- local state ------------------------------------------------------------------------

    def _entry(self, key: str) -> _Entry:
        entry = self._docs.get(key)
        if entry is None:
            entry = _Entry(Doc(client_id=self.client_id), self.settings.is_durable(key))
            captured = entry.captured
            # Keep the subscription alive as long as the document.
            entry.doc.observe(lambda event: captured.append(event.update))
            self._docs[key] = entry
            self._dirty.add(key)
        return entry

    def _take_captured(self, entry: _Entry) -> bytes | None:
        captured = entry.captured
        if not captured:
            return None
        update = captured[0] if len(captured) == 1 else merge_updates(*captured)
        captured.clear()
        return update

    def _local_change(
        self, key: str, entry: _Entry, delta: bytes, now: float, *, replicate: bool
    ) -> int | None:
        """Record a change made here; returns the store ticket when the key is durable."""
        self._dirty.add(key)
        self._changed.add(key)
        if replicate:
            self._deltas.setdefault(key, []).append(delta)
            if self._next_delta is None:
                self._next_delta = now + self.settings.delta_interval
        return self._persist_update(key, entry, delta)

    def _apply(self, key: str, update: bytes) -> int | None:
        """Merge a peer's update into the local replica; returns the store ticket if any."""
        created = key not in self._docs
        entry = self._entry(key)
        entry.captured.clear()
        try:
            entry.doc.apply_update(update)
        except BaseException:
            if created and not entry.captured:
                self._forget(key)
            raise
        delta = self._take_captured(entry)
        if delta is None:
            return None
        self._dirty.add(key)
        self._changed.add(key)
        return self._persist_update(key, entry, delta)

    def _persist_update(self, key: str, entry: _Entry, delta: bytes) -> int | None:
        if not entry.durable:
            return None
        if key in self._disk_stale:
            entry.appended = 0
            return self._persist(((key, entry.doc.get_update()),), snapshot=True)
        ticket = self._persist(((key, delta),))
        entry.appended += 1
        if entry.appended >= self.settings.compact_after:
            entry.appended = 0
            self._effects.append(Compact(key, entry.doc.get_update()))
        return ticket

    def _persist(
        self, entries: tuple[tuple[str, bytes | None], ...], *, snapshot: bool = False
    ) -> int:
        ticket = self._new_op_id()
        keys = tuple(key for key, _ in entries)
        self._tickets[ticket] = _Ticket(keys, snapshot)
        for key in keys:
            self._unpersisted[key] = ticket
        self._effects.append(Persist(ticket, entries, snapshot))
        return ticket

    def _delete_local(self, key: str) -> int | None:
        durable = self.settings.is_durable(key)
        self._forget(key)
        self._deleted.add(key)
        self._dirty.add(key)
        self._changed.add(key)
        self._deltas.pop(key, None)
        return self._persist(((key, None),)) if durable else None

    def _forget(self, key: str) -> None:
        self._docs.pop(key, None)
        self._dirty.add(key)

    def _after(self, ticket: int | None, send: Send) -> None:
        if ticket is None:
            self._effects.append(send)
        else:
            self._tickets[ticket].sends.append(send)

    def _refresh(self) -> None:
        """Bring the bucket hashes up to date with the keys changed since the last refresh."""
        buckets = self.settings.digest_buckets
        for key in self._dirty:
            old = self._contribution.pop(key, None)
            bucket = self._bucket_of.get(key)
            if bucket is None:
                bucket = _stable_hash(key.encode()) % buckets
            if old is not None:
                self._bucket_hash[bucket] ^= old
            if key in self._deleted:
                key_digest = DELETED_DIGEST
            elif key in self._docs:
                key_digest = digest(self._docs[key].doc)
            else:
                self._bucket_of.pop(key, None)
                self._bucket_keys[bucket].discard(key)
                self._digests.pop(key, None)
                continue
            contribution = _stable_hash(key.encode() + key_digest)
            self._bucket_of[key] = bucket
            self._bucket_keys[bucket].add(key)
            self._contribution[key] = contribution
            self._digests[key] = key_digest
            self._bucket_hash[bucket] ^= contribution
        self._dirty.clear()

    # -- operations -------------------------------------------------------------------------

    def _quorum(self, consistency: Consistency) -> tuple[frozenset[UniqueAddress], int]:
        targets = self._peers.replicas
        if excludes_leaving(consistency):
            targets = targets - self._peers.leaving
        return targets, quorum(consistency, len(targets) + 1) - 1

    def _answered(self, sender: UniqueAddress, op_id: int, kind: str) -> _Op | None:
        op = self._ops.get(op_id)
        if op is None or op.kind != kind or sender not in op.targets or sender in op.answered:
            return None
        op.answered.add(sender)
        return op

    def _maybe_complete(self, op_id: int, op: _Op) -> None:
        if op.needed > 0 or not op.persisted or op_id not in self._ops:
            return
        del self._ops[op_id]
        if op.kind == "read":
            self._complete_read(op_id, op.key)
        else:
            self._effects.append(Complete(op_id, op.value))

    def _complete_read(self, op_id: int, key: str) -> None:
        try:
            value = self.snapshot(key)
        except DataDeleted as error:
            self._effects.append(Complete(op_id, error=error))
        else:
            self._effects.append(Complete(op_id, value))

    def _timeout_error(self, op: _Op) -> ReplicationError:
        got = len(op.answered)
        wanted = got + op.needed
        if op.kind == "read":
            return GetFailure(
                f"read of {op.key!r} got {got + 1} of the {wanted + 1} replicas it needs "
                "(this node included) within its timeout"
            )
        what = "update" if op.kind == "write" else "delete"
        disk = "" if op.persisted else "; its write to the local durable store had not finished"
        return UpdateTimeout(
            f"{what} of {op.key!r} was confirmed by {got + 1} of the {wanted + 1} replicas it "
            f"needs (this node included) within its timeout{disk}; it stays in the local "
            "replica and spreads by gossip"
        )

    def _new_op_id(self) -> int:
        op_id = self._next_id
        self._next_id += 1
        return op_id

    def _send(self, to: UniqueAddress, message: ReplicatorMessage) -> None:
        self._effects.append(Send(to, message))

    def _gossip_send(self, to: UniqueAddress, message: ReplicatorMessage, size: int) -> None:
        self._sent += 1
        self._bytes_sent += size
        self._effects.append(Send(to, message))

    def statistics(self) -> CoreStatistics:
        """Counters since the core was built."""
        pending_writes = sum(1 for op in self._ops.values() if op.kind != "read")
        return CoreStatistics(
            keys=len(self._docs),
            deleted_keys=len(self._deleted),
            pending_writes=pending_writes,
            pending_reads=len(self._ops) - pending_writes,
            gossip_messages_sent=self._sent,
            gossip_messages_received=self._received,
            gossip_bytes_sent=self._bytes_sent,
            gossip_bytes_received=self._bytes_received,
            malformed_messages=self._malformed,
        )

    def documents(self) -> Iterator[tuple[str, Doc[Any]]]:
        """The live local documents, for tests that compare replicas. Do not edit them."""
        for key in sorted(self._docs):
            yield key, self._docs[key].doc

    def deleted_keys(self) -> frozenset[str]:
        """The keys deleted (tombstones are kept for good)."""
        return frozenset(self._deleted)


@attrs.define
class _SyncPart:
    key: str
    update: bytes | None = None
    state: bytes | None = None
    ds: bytes | None = None
    deleted: bool = False

    def size(self) -> int:
        return (
            len(self.key)
            + _MESSAGE_OVERHEAD
            + len(self.update or b"")
            + len(self.state or b"")
            + len(self.ds or b"")
        )


def _sync_message(name: str, parts: list[_SyncPart], reply: bool) -> Sync:
    return Sync(
        replicator=name,
        updates={p.key: p.update for p in parts if p.update is not None},
        states={p.key: p.state for p in parts if p.state is not None},
        delete_sets={p.key: p.ds for p in parts if p.ds is not None},
        deleted=tuple(p.key for p in parts if p.deleted),
        reply=reply,
    )


def _sync_size(message: Sync) -> int:
    return (
        sum(len(k) + len(v) for k, v in message.updates.items())
        + sum(len(k) + len(v) for k, v in message.states.items())
        + sum(len(k) + len(v) for k, v in message.delete_sets.items())
        + sum(len(k) for k in message.deleted)
    )
