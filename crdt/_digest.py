"""What a replica holds, in comparable form: state vectors, delete sets and digests.

Theory of operation: a pycrdt document's *state vector* maps each client id to the number of
items that client has written and this replica has integrated. It says which insertions a replica
has, but not which deletions: deleting never advances it. Two replicas hold the same document
exactly when their state vectors and their *delete sets* (the ranges of deleted item ids) are
equal. The digest of a key is a hash of both, in a canonical form: yrs encodes both from hash
maps, so the raw bytes of two equal replicas may list clients in different orders, and a delete
set may split one range in two.

The encodings read here are yrs' v1 formats (lib0 unsigned varints): a state vector is
``count, (client, clock)*``; an update is ``struct groups, delete set`` where a delete set is
``count, (client, range count, (clock, length)*)*``.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pycrdt import Doc

from ._errors import ReplicationError

StateVector = dict[int, int]
"""Client id → number of that client's items integrated."""

EMPTY_STATE = b"\x00"
"""The encoded state vector of an empty document."""

DELETED_DIGEST = b"\xff" * 16
"""The digest gossiped for a key that was deleted."""


class MalformedState(ReplicationError):
    """Bytes that should be a yrs state vector or update are not (a peer sent garbage)."""


def _varuint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise MalformedState("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise MalformedState("varint longer than 64 bits")


def _put_varuint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def decode_state_vector(data: bytes) -> StateVector:
    """The state vector encoded in ``data`` (what ``Doc.get_state()`` returns).

    Raises:
        MalformedState: ``data`` is not an encoded state vector.
    """
    count, pos = _varuint(data, 0)
    if count > len(data):
        raise MalformedState(f"state vector claims {count} clients in {len(data)} bytes")
    vector: StateVector = {}
    for _ in range(count):
        client, pos = _varuint(data, pos)
        clock, pos = _varuint(data, pos)
        vector[client] = clock
    if pos != len(data):
        raise MalformedState(f"{len(data) - pos} bytes after the state vector")
    return vector


def covers(have: StateVector, need: StateVector) -> bool:
    """Whether a replica at ``have`` has integrated every item of one at ``need``."""
    return all(have.get(client, 0) >= clock for client, clock in need.items())


def _canonical_state(data: bytes) -> bytes:
    out = bytearray()
    vector = sorted(decode_state_vector(data).items())
    _put_varuint(out, len(vector))
    for client, clock in vector:
        _put_varuint(out, client)
        _put_varuint(out, clock)
    return bytes(out)


def _canonical_delete_set(doc: Doc[Any]) -> bytes:
    # An update from the document's own state vector holds no items, only the full delete set.
    data = doc.get_update(doc.get_state())
    groups, pos = _varuint(data, 0)
    if groups != 0:  # pragma: no cover - yrs always omits integrated items here
        raise MalformedState("an update from the own state vector carried items")
    clients, pos = _varuint(data, pos)
    ranges: dict[int, list[tuple[int, int]]] = {}
    for _ in range(clients):
        client, pos = _varuint(data, pos)
        count, pos = _varuint(data, pos)
        spans = ranges.setdefault(client, [])
        for _ in range(count):
            clock, pos = _varuint(data, pos)
            length, pos = _varuint(data, pos)
            if length:
                spans.append((clock, clock + length))
    out = bytearray()
    _put_varuint(out, len(ranges))
    for client in sorted(ranges):
        merged: list[list[int]] = []
        for start, end in sorted(ranges[client]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        _put_varuint(out, client)
        _put_varuint(out, len(merged))
        for start, end in merged:
            _put_varuint(out, start)
            _put_varuint(out, end - start)
    return bytes(out)


def delete_set_hash(doc: Doc[Any]) -> bytes:
    """An 8-byte hash of the document's delete set, equal on replicas with equal delete sets."""
    return hashlib.blake2b(_canonical_delete_set(doc), digest_size=8).digest()


def digest(doc: Doc[Any]) -> bytes:
    """A 16-byte hash that two replicas share exactly when they hold the same document."""
    h = hashlib.blake2b(_canonical_state(doc.get_state()), digest_size=16)
    h.update(_canonical_delete_set(doc))
    return h.digest()
