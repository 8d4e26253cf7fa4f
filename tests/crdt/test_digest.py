"""State vectors, delete sets and digests of pycrdt documents (crdt._digest)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pycrdt import Doc, Map, Text

from crdt import ReplicationError
from crdt._digest import (
    DELETED_DIGEST,
    EMPTY_STATE,
    MalformedState,
    StateVector,
    covers,
    decode_state_vector,
    delete_set_hash,
    digest,
)
from membership import ClusterError

# --- helpers -------------------------------------------------------------------------------------


def new_doc(client_id: int) -> Doc[Any]:
    doc: Doc[Any] = Doc(client_id=client_id)
    doc.get("m", type=Map)
    doc.get("t", type=Text)
    return doc


def the_map(doc: Doc[Any]) -> Map[Any]:
    root: Map[Any] = doc.get("m", type=Map)
    return root


def the_text(doc: Doc[Any]) -> Text:
    root: Text = doc.get("t", type=Text)
    return root


def content(doc: Doc[Any]) -> tuple[dict[str, Any], str]:
    return the_map(doc).to_py() or {}, str(the_text(doc))


def edit(doc: Doc[Any], change: Callable[[Doc[Any]], None]) -> bytes:
    """Run ``change`` in one transaction; return the update it emitted."""
    emitted: list[bytes] = []
    subscription = doc.observe(lambda event: emitted.append(event.update))
    try:
        with doc.transaction():
            change(doc)
    finally:
        doc.unobserve(subscription)
    assert len(emitted) == 1, emitted
    return emitted[0]


def set_key(key: str, value: object) -> Callable[[Doc[Any]], None]:
    def change(doc: Doc[Any]) -> None:
        the_map(doc)[key] = value

    return change


def del_key(key: str) -> Callable[[Doc[Any]], None]:
    def change(doc: Doc[Any]) -> None:
        del the_map(doc)[key]

    return change


def replica(client_id: int, updates: Sequence[bytes]) -> Doc[Any]:
    doc = new_doc(client_id)
    for update in updates:
        doc.apply_update(update)
    return doc


def state(doc: Doc[Any]) -> StateVector:
    return decode_state_vector(doc.get_state())


class FakeDoc:
    """Serves chosen encodings, as a yrs document with other hash map orders would."""

    def __init__(self, state: bytes, own_update: bytes) -> None:
        self._state = state
        self._own_update = own_update

    def get_state(self) -> bytes:
        return self._state

    def get_update(self, state: bytes | None = None) -> bytes:
        assert state == self._state
        return self._own_update


def fake(state: bytes = b"\x00", delete_set: bytes = b"\x00") -> Doc[Any]:
    # An update from the own state vector: no struct groups, then the delete set.
    return cast(Doc[Any], FakeDoc(state, b"\x00" + delete_set))


# --- decode_state_vector -------------------------------------------------------------------------


def test_empty_document() -> None:
    doc = new_doc(1)
    assert doc.get_state() == EMPTY_STATE
    assert decode_state_vector(EMPTY_STATE) == {}
    assert len(digest(doc)) == 16
    assert len(delete_set_hash(doc)) == 8
    assert digest(doc) != DELETED_DIGEST
    assert digest(doc) == digest(new_doc(2))


def test_decode_state_vector_of_real_documents() -> None:
    a, b = new_doc(1), new_doc(2**32 - 1)
    updates = [edit(a, set_key("x", i)) for i in range(3)]
    updates.append(edit(b, set_key("y", "b")))
    c = replica(300, updates)
    assert state(a) == {1: 3}
    assert state(b) == {2**32 - 1: 1}
    assert state(c) == {1: 3, 2**32 - 1: 1}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\x00", {}),
        (b"\x01\x07\x00", {7: 0}),
        (b"\x02\x01\x05\x81\x01\x02", {1: 5, 129: 2}),
        (b"\x01\xff\xff\xff\xff\x0f\xac\x02", {2**32 - 1: 300}),
        # Ten bytes carrying 64 bits is the longest varint allowed.
        (b"\x01" + b"\x80" * 9 + b"\x01" + b"\x05", {2**63: 5}),
    ],
)
def test_decode_state_vector(data: bytes, expected: StateVector) -> None:
    assert decode_state_vector(data) == expected


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated varint"),
        (b"\x80", "truncated varint"),
        (b"\x01\x01", "truncated varint"),
        (b"\x01\x81", "truncated varint"),
        (b"\x02\x01\x01\x02", "truncated varint"),
        (b"\x80" * 10 + b"\x01", "varint longer than 64 bits"),
        (b"\x01\x01" + b"\xff" * 10 + b"\x01", "varint longer than 64 bits"),
        (b"\x00\x00", "1 bytes after the state vector"),
        (b"\x01\x01\x01\x00\x00\x00", "3 bytes after the state vector"),
        (b"\x05", "state vector claims 5 clients in 1 bytes"),
        (b"\xff\xff\xff\xff\x0f\x01\x02", "state vector claims 4294967295 clients in 7 bytes"),
        (b"\x80" * 9 + b"\x01", "state vector claims 9223372036854775808 clients in 10 bytes"),
    ],
)
def test_garbage_is_malformed(data: bytes, message: str) -> None:
    with pytest.raises(MalformedState) as excinfo:
        decode_state_vector(data)
    assert str(excinfo.value) == message


def test_malformed_state_is_a_replication_error() -> None:
    assert issubclass(MalformedState, ReplicationError)
    assert issubclass(MalformedState, ClusterError)


# --- covers --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("have", "need", "expected"),
    [
        ({}, {}, True),
        ({1: 3}, {}, True),
        ({}, {1: 1}, False),
        ({}, {1: 0}, True),  # nothing needed of client 1
        ({1: 3}, {1: 3}, True),
        ({1: 4}, {1: 3}, True),
        ({1: 2}, {1: 3}, False),
        ({1: 3, 2: 1}, {1: 3}, True),
        ({1: 3}, {1: 3, 2: 1}, False),
        ({1: 5, 2: 0}, {1: 3, 2: 1}, False),
        ({1: 5, 2: 7}, {1: 3, 2: 1}, True),
    ],
)
def test_covers(have: StateVector, need: StateVector, expected: bool) -> None:
    assert covers(have, need) is expected


def test_covers_on_real_documents() -> None:
    a = new_doc(1)
    first = edit(a, set_key("x", 1))
    b = replica(2, [first])
    assert covers(state(b), state(a))
    assert covers(state(a), state(b))
    edit(a, set_key("x", 2))
    assert covers(state(a), state(b))
    assert not covers(state(b), state(a))
    edit(b, set_key("y", 1))
    assert not covers(state(a), state(b))
    assert not covers(state(b), state(a))


# --- digest: same document, same digest ----------------------------------------------------------


def test_digest_changes_with_every_edit() -> None:
    doc = new_doc(1)
    seen = {digest(doc)}
    for change in (set_key("x", 1), set_key("y", 2), set_key("x", 3), del_key("y")):
        edit(doc, change)
        seen.add(digest(doc))
    assert len(seen) == 5


def test_same_updates_in_every_order_give_the_same_digest() -> None:
    a, b = new_doc(1), new_doc(2)
    updates = [edit(a, set_key("x", 1)), edit(b, set_key("y", 2)), edit(a, set_key("z", 3))]
    updates.append(edit(b, lambda doc: the_text(doc).insert(0, "hello")))
    reference = replica(100, updates)
    for client_id, order in enumerate(itertools.permutations(updates), start=200):
        other = replica(client_id, order)
        assert content(other) == content(reference)
        assert digest(other) == digest(reference), order


def test_receiving_client_id_does_not_matter() -> None:
    a = new_doc(7)
    updates = [edit(a, set_key("x", 1)), edit(a, del_key("x")), edit(a, set_key("y", 2))]
    digests = {digest(replica(client_id, updates)) for client_id in (1, 8, 2**20, 2**32 - 1)}
    assert digests == {digest(a)}


def test_many_writers_in_opposite_orders() -> None:
    # yrs lists the clients of a state vector in hash map order, which depends on history: with
    # these client ids the raw state vectors of the two replicas list them in different orders.
    seed = 20240501
    print(f"client ids from random.Random({seed})")
    rng = random.Random(seed)
    writers = [new_doc(rng.randrange(1, 2**32)) for _ in range(20)]
    updates = [edit(doc, set_key(f"k{i % 5}", i)) for i, doc in enumerate(writers)]
    forward = replica(1, updates)
    backward = replica(2, updates[::-1])
    assert content(forward) == content(backward)
    assert state(forward) == state(backward)
    assert digest(forward) == digest(backward)
    assert delete_set_hash(forward) == delete_set_hash(backward)


def test_concurrent_writes_to_one_key_converge_to_one_digest() -> None:
    a, b, c = new_doc(1), new_doc(2), new_doc(3)
    base = edit(a, set_key("x", "base"))
    b.apply_update(base)
    c.apply_update(base)
    from_a = edit(a, set_key("x", "a"))
    from_b = edit(b, set_key("x", "b"))
    from_c = edit(c, set_key("x", "c"))
    assert len({digest(a), digest(b), digest(c)}) == 3
    a.apply_update(from_c)
    a.apply_update(from_b)
    b.apply_update(from_a)
    b.apply_update(from_c)
    c.apply_update(from_b)
    c.apply_update(from_a)
    assert content(a) == content(b) == content(c)
    assert the_map(a)["x"] in ("a", "b", "c")
    assert digest(a) == digest(b) == digest(c)
    assert delete_set_hash(a) == delete_set_hash(b) == delete_set_hash(c)


def test_same_content_written_by_different_clients_is_another_document() -> None:
    a, b = new_doc(1), new_doc(2)
    edit(a, set_key("x", 1))
    edit(b, set_key("x", 1))
    assert content(a) == content(b)
    assert digest(a) != digest(b)  # different items: merging them gives a third document


def test_different_content_gives_different_digests() -> None:
    a = new_doc(1)
    one = edit(a, set_key("x", 1))
    two = edit(a, set_key("x", 2))
    assert digest(replica(5, [one])) != digest(replica(5, [one, two]))


# --- deletes -------------------------------------------------------------------------------------


def test_a_delete_changes_the_digest_but_not_the_state_vector() -> None:
    a = new_doc(1)
    updates = [edit(a, set_key("x", 1)), edit(a, set_key("y", 2))]
    b = replica(2, updates)
    before_state, before_digest, before_hash = a.get_state(), digest(a), delete_set_hash(a)
    assert before_digest == digest(b)
    delete = edit(a, del_key("x"))
    assert a.get_state() == before_state
    assert state(a) == {1: 2}
    assert digest(a) != before_digest
    assert delete_set_hash(a) != before_hash
    # b lacks the delete: a state-vector comparison would call them equal, the digest does not.
    assert state(b) == state(a)
    assert digest(b) != digest(a)
    b.apply_update(delete)
    assert content(b) == content(a) == ({"y": 2.0}, "")
    assert digest(b) == digest(a)
    assert delete_set_hash(b) == delete_set_hash(a)


def test_overwriting_a_key_deletes_the_old_value() -> None:
    a = new_doc(1)
    edit(a, set_key("x", 1))
    empty_deletes = delete_set_hash(a)
    edit(a, set_key("x", 2))
    assert delete_set_hash(a) != empty_deletes


def text_deleters() -> tuple[bytes, list[bytes]]:
    """Client 1 writes "abcdefgh"; clients 2, 3 and 4 each delete an adjacent piece of it."""
    writer = new_doc(1)
    base = edit(writer, lambda doc: the_text(doc).insert(0, "abcdefgh"))
    deletes = []
    for client_id, (start, stop) in zip((2, 3, 4), ((1, 3), (3, 5), (5, 6)), strict=True):
        deleter = replica(client_id, [base])

        def cut(doc: Doc[Any], start: int = start, stop: int = stop) -> None:
            del the_text(doc)[start:stop]

        deletes.append(edit(deleter, cut))
    return base, deletes


def test_deletes_in_every_order_give_the_same_digest() -> None:
    base, deletes = text_deleters()
    results = set()
    for client_id, order in enumerate(itertools.permutations(deletes), start=10):
        doc = replica(client_id, [base, *order])
        assert content(doc) == ({}, "agh")
        assert state(doc) == {1: 8}  # deleting never advances a state vector
        results.add((digest(doc), delete_set_hash(doc)))
    assert len(results) == 1
    # The same items deleted in one step, by yet another client: the same document.
    single = replica(20, [base])
    edit(single, lambda doc: the_text(doc).__delitem__(slice(1, 6)))
    assert results == {(digest(single), delete_set_hash(single))}


def test_deletes_split_in_ranges_differ_from_the_joined_range() -> None:
    base, (first, middle, last) = text_deleters()
    with_gap = replica(10, [base, first, last])
    assert str(the_text(with_gap)) == "adegh"
    full = replica(11, [base, first, middle, last])
    assert state(with_gap) == state(full)
    assert digest(with_gap) != digest(full)
    assert delete_set_hash(with_gap) != delete_set_hash(full)
    with_gap.apply_update(middle)
    assert digest(with_gap) == digest(full)


# --- canonical form: the same sets in other encodings ------------------------------------------


def test_state_vector_order_does_not_matter() -> None:
    one = fake(state=b"\x02\x01\x03\x82\x01\x04")
    other = fake(state=b"\x02\x82\x01\x04\x01\x03")
    assert digest(one) == digest(other)
    assert digest(one) != digest(fake(state=b"\x02\x01\x03\x82\x01\x05"))
    assert digest(one) != digest(fake(state=b"\x01\x01\x03"))


@pytest.mark.parametrize(
    "delete_set",
    [
        b"\x02\x01\x01\x00\x05\x02\x01\x03\x01",  # canonical: sorted clients, one range each
        b"\x02\x02\x01\x03\x01\x01\x01\x00\x05",  # clients in the other order
        b"\x02\x01\x02\x00\x02\x02\x03\x02\x01\x03\x01",  # [0, 2) and [2, 5): touching ranges
        b"\x02\x01\x02\x02\x03\x00\x02\x02\x01\x03\x01",  # the same, out of order
        b"\x02\x01\x02\x00\x03\x01\x04\x02\x01\x03\x01",  # [0, 3) and [1, 5): overlapping
        b"\x02\x01\x03\x00\x05\x09\x00\x01\x02\x02\x01\x03\x01",  # an empty range at 9
        b"\x02\x01\x01\x00\x05\x02\x02\x03\x01\x03\x01",  # the same range twice
        b"\x03\x01\x01\x00\x02\x02\x01\x03\x01\x01\x01\x02\x03",  # client 1 listed twice
    ],
)
def test_equal_delete_sets_in_other_encodings_hash_equal(delete_set: bytes) -> None:
    canonical = fake(delete_set=b"\x02\x01\x01\x00\x05\x02\x01\x03\x01")
    assert delete_set_hash(fake(delete_set=delete_set)) == delete_set_hash(canonical)
    assert digest(fake(delete_set=delete_set)) == digest(canonical)


@pytest.mark.parametrize(
    "delete_set",
    [
        b"\x02\x01\x02\x00\x02\x03\x02\x02\x01\x03\x01",  # [0, 2) and [3, 5): a gap at 2
        b"\x02\x01\x01\x00\x06\x02\x01\x03\x01",  # one item more
        b"\x01\x01\x01\x00\x05",  # client 2's delete missing
        b"\x02\x01\x01\x00\x05\x03\x01\x03\x01",  # another client
        b"\x00",  # nothing deleted
    ],
)
def test_different_delete_sets_hash_differently(delete_set: bytes) -> None:
    canonical = fake(delete_set=b"\x02\x01\x01\x00\x05\x02\x01\x03\x01")
    assert delete_set_hash(fake(delete_set=delete_set)) != delete_set_hash(canonical)
    assert digest(fake(delete_set=delete_set)) != digest(canonical)


@pytest.mark.parametrize(
    ("own_update", "message"),
    [
        (b"", "truncated varint"),
        (b"\x00", "truncated varint"),
        (b"\x00\x01\x01", "truncated varint"),
        (b"\x00\x01\x01\x02\x00\x01", "truncated varint"),
        (b"\x00\x01\x01\x01" + b"\xff" * 10 + b"\x01", "varint longer than 64 bits"),
        (b"\x01\x00", "an update from the own state vector carried items"),
    ],
)
def test_malformed_delete_set(own_update: bytes, message: str) -> None:
    doc = cast(Doc[Any], FakeDoc(b"\x00", own_update))
    with pytest.raises(MalformedState, match=message):
        delete_set_hash(doc)
    with pytest.raises(MalformedState, match=message):
        digest(doc)


def test_malformed_state_vector_in_digest() -> None:
    with pytest.raises(MalformedState, match="bytes after the state vector"):
        digest(fake(state=b"\x00\x01"))


# --- a replica holding an update it cannot integrate yet ---------------------------------------


def test_stuck_pending_update_shows_in_the_digest() -> None:
    # b overwrites a's first write; a replica that receives b's update before the write it
    # depends on keeps it pending. With pycrdt 0.14 it stays pending even after the write
    # arrives when another of a's updates came in between: the digest must not hide that.
    a, b = new_doc(1), new_doc(2)
    a1 = edit(a, set_key("y", 0))
    b.apply_update(a1)
    b1 = edit(b, set_key("y", 1))
    a2 = edit(a, set_key("x", 2))
    complete = replica(9, [a1, a2, b1])
    assert content(complete) == ({"x": 2.0, "y": 1.0}, "")
    stuck = replica(10, [b1, a2, a1])
    if state(stuck) != state(complete):
        assert not covers(state(stuck), state(complete))
        assert digest(stuck) != digest(complete)
        stuck.apply_update(b1)  # what anti-entropy sends once it sees the state vectors differ
    assert content(stuck) == content(complete)
    assert digest(stuck) == digest(complete)


# --- property: any delivery order converges to one digest ---------------------------------------

KEYS = "abc"

operation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 2), st.sampled_from(KEYS), st.integers(-100, 100)),
    st.tuples(st.just("del"), st.integers(0, 2), st.sampled_from(KEYS), st.just(0)),
    st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 2), st.just(0)),
)


@settings(max_examples=60, deadline=None, print_blob=True)
@given(
    replicas=st.integers(2, 3),
    operations=st.lists(operation, min_size=1, max_size=25),
    data=st.data(),
)
def test_every_delivery_order_converges_to_one_digest(
    replicas: int, operations: list[tuple[str, int, str | int, int]], data: st.DataObject
) -> None:
    docs = [new_doc(client_id) for client_id in (11, 22, 33)[:replicas]]
    produced: list[bytes] = []  # every local update, in the order they were made
    for kind, i, arg, value in operations:
        doc = docs[i % replicas]
        if kind == "sync":  # anti-entropy from another replica: everything doc lacks
            source = docs[int(arg) % replicas]
            doc.apply_update(source.get_update(doc.get_state()))
        elif kind == "set":
            produced.append(edit(doc, set_key(str(arg), value)))
        elif str(arg) in the_map(doc):
            produced.append(edit(doc, del_key(str(arg))))
    # Whatever the replicas hold now, an equal digest means equal content.
    for one, other in itertools.combinations(docs, 2):
        if digest(one) == digest(other):
            assert content(one) == content(other)
    # Deliver every update to every replica, each replica in its own random order.
    for doc in docs:
        for update in data.draw(st.permutations(produced), label="delivery order"):
            doc.apply_update(update)
    # yrs may leave an update that came before its dependencies pending (see above); the
    # replicator's anti-entropy resends it, which here is a second pass in the order made.
    reference = replica(99, produced)
    for doc in docs:
        if state(doc) != state(reference):
            assert digest(doc) != digest(reference)
            for update in produced:
                doc.apply_update(update)
        assert content(doc) == content(reference)
        assert state(doc) == state(reference)
        assert digest(doc) == digest(reference)
        assert delete_set_hash(doc) == delete_set_hash(reference)
