"""The wire codec: what round-trips, what is refused at the sender, and what a peer can break.

Hypothesis tests print a ``@reproduce_failure`` blob when they fail; paste it above the test to
re-run that exact case.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Any, ClassVar, cast

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membership import (
    FrameDecodeError,
    MessageDecodeError,
    MessageRegistrationError,
    MessageTooLarge,
    SerializationError,
    message,
)
from membership.transport._framing import encode_frame
from membership.transport._wire import (
    EXT_TUPLE,
    HEADER,
    HEADER_SIZE,
    KIND_OBJECT,
    KIND_OBJECT_FLAT,
    KIND_PLAIN,
    MAX_NESTING,
    OMIT_WHEN_NONE,
    WIRE_VERSION,
    FrameEncoder,
    _by_name,
    _EnumSpec,
    _init_only_stores,
    _pack_nested,
    _storing_twin,
    _type_checks,
    decode,
    decode_header,
    decode_parts,
    encode,
    wire_name,
)
from tests._support.examples import examples

fast = settings(max_examples=150, deadline=None, print_blob=True)
fuzz = settings(max_examples=examples(500), deadline=None, print_blob=True)


@message(name="tests.wire.Point")
@attrs.frozen
class Point:
    x: int
    y: int


@message(name="tests.wire.Color")
class Color(enum.Enum):
    RED = "red"
    GREEN = 2
    BLUE = (0, 0, 255)


@message(name="tests.wire.Level")
class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@message(name="tests.wire.Options")
@attrs.frozen(kw_only=True)
class Options:
    name: str
    tags: frozenset[str] = frozenset()
    color: Color = Color.RED


@message(name="tests.wire.Shape")
@attrs.frozen
class Shape:
    points: tuple[Point, ...]
    options: Options
    labels: dict[int, str]
    seen: set[str]
    raw: bytes
    text: str


@message(name="tests.wire.Holder")
@attrs.frozen
class Holder:
    value: Any


@message(name="tests.wire.Scalars")
@attrs.frozen
class Scalars:
    """Fields annotated as plain scalars: not looked at for objects when sent."""

    n: int
    text: str | None = None
    anything: object = None


@message(name="tests.wire.Private")
@attrs.frozen
class Private:
    _secret: int
    _note: str = ""


@message(name="tests.wire.Versioned")
@attrs.frozen
class Versioned:
    a: int
    b: str = "b-default"
    c: tuple[int, ...] = ()


@message(name="tests.wire.Positive")
@attrs.frozen
class Positive:
    n: int = attrs.field(validator=attrs.validators.gt(0))


@message
@attrs.frozen
class DefaultName:
    pass


@message(name="tests.wire.Renamed")
@attrs.frozen
class Renamed:
    pass


@attrs.frozen
class Unregistered:
    n: int = 0


def round_trip(value: object, *, to_uid: int = 0) -> object:
    decoded = decode(encode(value, to_uid=to_uid))
    assert decoded.to_uid == to_uid
    return decoded.message


def typed(value: object) -> object:
    """``value`` with each container and scalar tagged by its exact type: 1, 1.0, True differ."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, [typed(v) for v in value])
    if isinstance(value, set | frozenset):
        return (type(value).__name__, sorted(repr(typed(v)) for v in value))
    if isinstance(value, dict):
        return ("dict", sorted(repr((typed(k), typed(v))) for k, v in value.items()))
    cls = type(value)
    if attrs.has(cls):
        return (cls.__name__, [typed(getattr(value, f.name)) for f in attrs.fields(cls)])
    return (type(value).__name__, repr(value))


def frame(body: bytes, *, kind: int = KIND_PLAIN, version: int = WIRE_VERSION) -> bytes:
    return HEADER.pack(version, kind, 0) + body


def object_frame(*fields: object) -> bytes:
    return frame(msgpack.packb(list(fields)), kind=KIND_OBJECT)


def flat_frame(*fields: object) -> bytes:
    return frame(msgpack.packb(list(fields)), kind=KIND_OBJECT_FLAT)


def nested_tuples(depth: int) -> bytes:
    """A plain message body of ``depth`` tuples, each holding the next; None innermost."""
    body: bytes = msgpack.packb(None)
    for _ in range(depth):
        body = msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\x91" + body))
    return body


# --- round trips ---------------------------------------------------------------------------------


def test_positional_class_round_trips() -> None:
    assert round_trip(Point(1, -2)) == Point(1, -2)


def test_kw_only_class_with_defaults_round_trips() -> None:
    options = Options(name="o", tags=frozenset({"a", "b"}), color=Color.BLUE)
    assert round_trip(options) == options
    assert round_trip(Options(name="d")) == Options(name="d")


def test_nested_registered_objects_and_containers_keep_their_types() -> None:
    shape = Shape(
        points=(Point(0, 0), Point(2**63 - 1, -(2**63))),
        options=Options(name="n", tags=frozenset({"t"})),
        labels={1: "one", -7: "minus seven"},
        seen={"x", "y"},
        raw=b"\x00\xff",
        text="\u00e9t\u00e9",
    )
    back = round_trip(shape)
    assert back == shape
    assert typed(back) == typed(shape)


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        2**64 - 1,
        -(2**63),
        1.5,
        -0.0,
        float("inf"),
        "",
        "text",
        b"",
        b"bytes",
        [1, "a", b"b"],
        (1, (2, (3,))),
        (),
        frozenset({1, "a", (2, 3)}),
        {1, 2},
        set(),
        {1: "int key", "s": 2, (1, 2): "tuple key", None: [], b"k": {}},
        Color.RED,
        Color.GREEN,
        Color.BLUE,
        Level.HIGH,
        [Point(1, 2), (Color.RED, {Level.LOW})],
    ],
    ids=lambda value: type(value).__name__,  # a set's repr differs between processes
)
def test_plain_values_round_trip_with_their_types(value: object) -> None:
    back = round_trip(value)
    assert back == value
    assert typed(back) == typed(value)


def test_bytes_and_str_stay_apart() -> None:
    assert round_trip([b"abc", "abc"]) == [b"abc", "abc"]
    assert typed(round_trip(b"abc")) == ("bytes", "b'abc'")


def test_private_attributes_travel_under_their_alias() -> None:
    private = Private(secret=3, note="n")
    assert round_trip(private) == private


def test_to_uid_round_trips() -> None:
    assert decode(encode("m", to_uid=2**63 - 1)).to_uid == 2**63 - 1
    assert decode(encode("m")).to_uid == 0


def test_a_message_from_an_older_peer_with_fewer_fields_gets_the_defaults() -> None:
    assert decode(object_frame("tests.wire.Versioned", 1)).message == Versioned(1)
    assert decode(object_frame("tests.wire.Versioned", 1, "b")).message == Versioned(1, "b")


def test_a_message_from_a_newer_peer_with_more_fields_is_read_without_them() -> None:
    # Issue 22: a newer node adds fields last; this node reads what it knows (this was refused:
    # "arrived with 4 fields; this node knows 3").
    message = decode(object_frame("tests.wire.Versioned", 1, "b", [], "new field")).message
    assert message == decode(object_frame("tests.wire.Versioned", 1, "b", [])).message
    flat = decode_parts(object_frame("tests.wire.Point", 1, 2, {"new": ["x"]}))
    assert flat == (0, Point(1, 2))


# --- registration --------------------------------------------------------------------------------


def test_wire_name_defaults_to_module_and_qualname() -> None:
    assert wire_name(DefaultName) == f"{__name__}.DefaultName"
    assert round_trip(DefaultName()) == DefaultName()


def test_message_name_overrides_the_wire_name() -> None:
    assert wire_name(Point) == "tests.wire.Point"
    assert wire_name(Unregistered) is None


def test_registering_a_class_that_is_not_attrs_is_refused() -> None:
    class Plain:
        pass

    with pytest.raises(MessageRegistrationError, match=r"Plain: @message needs an attrs class"):
        message(Plain)


def test_registering_an_attrs_class_with_an_init_false_field_is_refused() -> None:
    @attrs.frozen
    class Hidden:
        shown: int
        hidden: int = attrs.field(init=False, default=0)

    with pytest.raises(MessageRegistrationError, match=r"fields \['hidden'\] have init=False"):
        message(Hidden)


def test_a_wire_name_taken_by_another_class_is_refused() -> None:
    @attrs.frozen
    class Impostor:
        x: int

    with pytest.raises(MessageRegistrationError, match=r"'tests\.wire\.Point' .* already taken by"):
        message(name="tests.wire.Point")(Impostor)
    assert wire_name(Impostor) is None
    assert round_trip(Point(1, 2)) == Point(1, 2)


@pytest.mark.parametrize("thing", [42, "Point", Point(1, 2)], ids=repr)
def test_registering_something_that_is_not_a_class_is_refused(thing: object) -> None:
    with pytest.raises(MessageRegistrationError, match="applies to classes, not to"):
        message(cast(Any, thing))


def test_an_empty_wire_name_is_refused() -> None:
    @attrs.frozen
    class Nameless:
        pass

    with pytest.raises(MessageRegistrationError, match="must be a non-empty string"):
        message(name="")(Nameless)


def test_registering_the_same_class_again_is_fine() -> None:
    assert message(name="tests.wire.Point")(Point) is Point
    assert round_trip(Point(1, 2)) == Point(1, 2)


def test_registering_a_class_under_a_new_name_releases_the_old_one() -> None:
    message(name="tests.wire.Renamed2")(Renamed)
    assert wire_name(Renamed) == "tests.wire.Renamed2"
    assert round_trip(Renamed()) == Renamed()
    with pytest.raises(MessageDecodeError, match=r"unknown message type 'tests\.wire\.Renamed'"):
        decode(object_frame("tests.wire.Renamed"))


# --- refused at the sender -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        Unregistered(),
        [1, 2, Unregistered()],
        {"key": Unregistered()},
        (1, Unregistered()),
        Holder(Unregistered()),
        Holder([Holder((Unregistered(),))]),
    ],
    ids=["top", "in-list", "dict-value", "in-tuple", "attrs-field", "deep"],
)
def test_an_unregistered_type_is_refused_naming_it(value: object) -> None:
    with pytest.raises(SerializationError, match=r"test_wire\.Unregistered is not serializable"):
        encode(value)
    # The shared Packer must not keep the half-written message.
    assert encode([3]) == frame(msgpack.packb([3]))


def test_an_int_beyond_64_bits_is_refused() -> None:
    with pytest.raises(
        SerializationError, match=r"builtins\.list: an int outside -2\*\*63\.\.2\*\*64-1"
    ):
        encode([2**64])
    assert encode([3]) == frame(msgpack.packb([3]))


def test_a_message_over_max_size_is_refused() -> None:
    payload = encode(b"x" * 100)
    assert encode(b"x" * 100, max_size=len(payload)) == payload
    with pytest.raises(MessageTooLarge, match=f"encodes to {len(payload)} bytes, above .* 50"):
        encode(b"x" * 100, max_size=50)


# --- what a peer can send ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"", "0 bytes is shorter than the header"),
        (frame(b"")[: HEADER_SIZE - 1], "9 bytes is shorter than the header"),
        (frame(b"\xc0", version=2), "wire version 2 is not supported"),
        (frame(b"\xc0", version=0), "wire version 0 is not supported"),
        (frame(b"\xc0", kind=4), "unknown frame kind 4"),
        (frame(b"\xc0", kind=0), "unknown frame kind 0"),
    ],
    ids=["empty", "short", "version-2", "version-0", "kind-4", "kind-0"],
)
def test_a_bad_header_is_a_frame_decode_error(payload: bytes, error: str) -> None:
    with pytest.raises(FrameDecodeError, match=error):
        decode(payload)


def test_an_unknown_wire_name_is_refused_naming_it() -> None:
    with pytest.raises(MessageDecodeError, match=r"unknown message type 'tests\.wire\.Martian'"):
        decode(object_frame("tests.wire.Martian", 1))


def test_an_unknown_wire_name_nested_in_a_plain_message_is_refused() -> None:
    inner = msgpack.ExtType(1, msgpack.packb(["tests.wire.Martian"]))
    with pytest.raises(MessageDecodeError, match=r"'tests\.wire\.Martian'"):
        decode(frame(msgpack.packb([inner])))


def test_a_constructor_that_rejects_the_fields_gives_a_message_decode_error() -> None:
    with pytest.raises(MessageDecodeError, match="ValueError"):
        decode(object_frame("tests.wire.Positive", -1))


def test_an_object_body_that_is_not_a_name_and_fields_is_refused() -> None:
    with pytest.raises(MessageDecodeError, match=r"not \[wire_name, \*fields\]"):
        decode(frame(msgpack.packb({"a": 1}), kind=KIND_OBJECT))


def test_ten_thousand_nested_arrays_are_a_message_decode_error() -> None:
    with pytest.raises(MessageDecodeError):
        decode(frame(b"\x91" * 10_000 + b"\xc0"))


def test_tuples_nested_up_to_the_limit_round_trip() -> None:
    value: object = None
    for _ in range(MAX_NESTING):
        value = (value,)
    assert round_trip(value) == value


def test_nesting_beyond_the_limit_fails_at_send_not_at_the_receiver() -> None:
    value: object = None
    for _ in range(MAX_NESTING + 1):
        value = (value,)
    with pytest.raises(SerializationError, match=f"nested more than {MAX_NESTING} deep"):
        encode(value)
    assert round_trip((1,)) == (1,)  # the encoder is still usable


def test_a_nested_value_that_fails_to_pack_leaves_every_level_usable() -> None:
    # Nested values are packed by one reused Packer per depth: a failure deep inside must not
    # leave a half-written buffer in any of them.
    for bad in [((1, (2, object())),), Holder((3, Holder(2**70)))]:
        with pytest.raises(SerializationError):
            encode(bad)
        encoder = FrameEncoder(1 << 20)
        with pytest.raises(SerializationError):
            encoder.frame(bad, 0)
        good = ((1, (2, Point(3, 4))), Holder((5, Holder(6))))
        assert round_trip(good) == good
        assert decode(encoder.frame(good, 0)[4:]).message == good


def test_tuples_nested_beyond_the_limit_are_refused_not_a_crash() -> None:
    # Each level used to cost msgpack ~40 KB of C stack: a few hundred levels killed the process.
    assert decode(frame(nested_tuples(MAX_NESTING))).message is not None
    for depth in (MAX_NESTING + 1, 1_000):
        with pytest.raises(MessageDecodeError, match=f"nested more than {MAX_NESTING} deep"):
            decode(frame(nested_tuples(depth)))


# --- objects in a message's fields travel flat ---------------------------------------------------


def test_a_registered_object_in_a_field_travels_flat() -> None:
    payload = encode(Holder(Point(1, 2)), to_uid=5)
    assert payload == HEADER.pack(WIRE_VERSION, KIND_OBJECT_FLAT, 5) + msgpack.packb(
        ["tests.wire.Holder", ["tests.wire.Point", 1, 2], 0b10]
    )
    assert decode(payload) == (5, Holder(Point(1, 2)))
    typed_ = Typed(name="n", where=Point(3, 4), anything=Holder(None))
    assert decode(encode(typed_)).message == typed_
    assert msgpack.unpackb(encode(typed_)[HEADER_SIZE:])[-1] == 0b101000  # where, anything


def test_an_object_in_a_field_annotated_as_a_scalar_still_travels_as_an_extension() -> None:
    assert decode_header(encode(Scalars(1, "a", Point(1, 2))))[0] == KIND_OBJECT_FLAT
    # Annotations are not enforced: an object where the class says int goes nested instead.
    odd = Scalars(Point(1, 2), Point(3, 4))  # type: ignore[arg-type]
    kind, _ = decode_header(encode(odd))
    assert kind == KIND_OBJECT
    assert round_trip(odd) == odd


def test_a_message_without_an_object_field_and_deeper_objects_keep_their_format() -> None:
    for value in (Holder([Point(1, 2)]), Holder(Color.RED), Holder((Point(1, 2),)), Point(1, 2)):
        kind, _ = decode_header(encode(value))
        assert kind == KIND_OBJECT, value
        assert round_trip(value) == value
    body = msgpack.unpackb(encode(Holder(Holder(Point(1, 2))))[HEADER_SIZE:])
    assert body[1][1] == msgpack.ExtType(1, _pack_nested(["tests.wire.Point", 1, 2]))


def test_an_object_sent_flat_is_no_extension_level() -> None:
    # It is parsed with its message, not by a parser of its own: what it holds may nest as deep
    # as a message's own fields.
    value: object = None
    for _ in range(MAX_NESTING):
        value = (value,)
    assert round_trip(Holder(Holder(value))) == Holder(Holder(value))
    with pytest.raises(SerializationError, match=f"nested more than {MAX_NESTING} deep"):
        encode(Holder(Holder((value,))))


@pytest.mark.parametrize(
    "mask",
    [0, 1, 0b11, -2, True, 2.0, "2", None, [2], 1 << 9, 1 << 63],
    ids=repr,
)
def test_a_flat_body_with_a_bad_mask_is_a_message_decode_error(mask: object) -> None:
    with pytest.raises(MessageDecodeError):
        decode(flat_frame("tests.wire.Holder", ["tests.wire.Point", 1, 2], mask))
    assert decode(flat_frame("tests.wire.Holder", ["tests.wire.Point", 1, 2], 2)).message == (
        Holder(Point(1, 2))
    )


@pytest.mark.parametrize(
    ("inner", "error"),
    [
        (["tests.wire.Martian", 1], r"unknown message type 'tests\.wire\.Martian'"),
        ("tests.wire.Point", r"not \[wire_name, \*fields\]"),
        ([], "IndexError"),
        (["tests.wire.Point", 1], "missing 1 required positional argument"),
        (["tests.wire.Positive", 0], "ValueError"),
    ],
    ids=["unknown", "not-a-list", "empty", "too-few", "refused"],
)
def test_a_bad_object_sent_flat_is_a_message_decode_error(inner: object, error: str) -> None:
    with pytest.raises(MessageDecodeError, match=error):
        decode(flat_frame("tests.wire.Holder", inner, 2))


def test_a_flat_body_that_is_not_a_name_and_fields_is_refused() -> None:
    bodies: list[object] = [{"a": 1}, [], 7]
    for body in bodies:
        with pytest.raises(MessageDecodeError, match=r"not \[wire_name, \*fields\]"):
            decode(frame(msgpack.packb(body), kind=KIND_OBJECT_FLAT))
    with pytest.raises(MessageDecodeError, match="unknown message type"):
        decode(flat_frame("tests.wire.Martian", ["tests.wire.Point", 1, 2], 2))


# --- properties ----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(Color)
    | st.sampled_from(Level)
)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
hashables = st.recursive(
    scalars | st.builds(Point, int64, int64),
    lambda inner: st.lists(inner, max_size=3).map(tuple) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
values = st.recursive(
    hashables,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(hashables, inner, max_size=3)
        | st.sets(hashables, max_size=3)
        | st.builds(Holder, inner)
    ),
    max_leaves=10,
)


@fast
@given(value=values, to_uid=st.integers(min_value=0, max_value=2**64 - 1))
def test_any_supported_value_round_trips_with_its_types(value: object, to_uid: int) -> None:
    back = round_trip(value, to_uid=to_uid)
    assert typed(back) == typed(value)


@fuzz
@given(data=st.binary(max_size=40))
def test_arbitrary_bytes_only_raise_decode_errors(data: bytes) -> None:
    with contextlib.suppress(FrameDecodeError, MessageDecodeError):
        decode(data)


@fuzz
@given(kind=st.sampled_from([KIND_PLAIN, KIND_OBJECT]), body=st.binary(max_size=40))
def test_a_valid_header_and_arbitrary_body_only_raise_message_decode_error(
    kind: int, body: bytes
) -> None:
    with contextlib.suppress(MessageDecodeError):
        decode(frame(body, kind=kind))


@fuzz
@given(
    code=st.integers(min_value=0, max_value=8),
    name=st.sampled_from(["tests.wire.Point", "tests.wire.Color", "tests.wire.Positive", "?"]),
    fields=st.lists(hashables, max_size=4),
)
def test_registered_names_with_arbitrary_fields_only_raise_message_decode_error(
    code: int, name: str, fields: list[object]
) -> None:
    body = _pack_nested([name, *fields])
    for payload in (
        frame(body, kind=KIND_OBJECT),
        frame(msgpack.packb(msgpack.ExtType(code, body))),
    ):
        with contextlib.suppress(MessageDecodeError):
            decode(payload)


# --- the fast paths ------------------------------------------------------------------------------
# The receive path builds a registered class by storing its fields when its __init__ only stores
# them, and the send path frames through a FrameEncoder. These tests hold both to the plain paths:
# the constructor, and encode() plus encode_frame().


@message(name="tests.wire.Converted")
@attrs.frozen
class Converted:
    n: int = attrs.field(converter=int)


@message(name="tests.wire.Checked")
@attrs.frozen
class Checked:
    n: int

    def __attrs_post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n must not be negative")


@message(name="tests.wire.CachedHash")
@attrs.frozen(cache_hash=True)
class CachedHash:
    n: int


@message(name="tests.wire.HandWritten")
@attrs.frozen
class HandWritten:
    n: int

    def __init__(self, n: int) -> None:
        if not isinstance(n, int):
            raise TypeError("n must be an int")
        self.__attrs_init__(n)  # type: ignore[attr-defined]


@message(name="tests.wire.WithDict")
@attrs.frozen(slots=False)
class WithDict:
    n: int


@message(name="tests.wire.Typed")
@attrs.frozen(kw_only=True)
class Typed:
    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    count: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    where: Point | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(Point))
    )
    number: int | float = attrs.field(
        default=0, validator=attrs.validators.instance_of((int, float))
    )
    anything: object = None


@message(name="tests.wire.TypedAndChecked")
@attrs.frozen
class TypedAndChecked:
    n: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.gt(0)])


@message(name="tests.wire.OwnSetattr")
@attrs.define
class OwnSetattr:
    n: int

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, abs(value) if name == "n" else value)


def test_only_a_constructor_that_just_stores_its_fields_is_bypassed() -> None:
    plain: list[type[Any]] = [Point, Options, Private, Versioned, DefaultName, Holder, Shape]
    checked: list[type[Any]] = [
        Positive,
        Converted,
        Checked,
        CachedHash,
        HandWritten,
        WithDict,
        Typed,
        TypedAndChecked,
        OwnSetattr,
    ]
    for cls in plain:
        assert _init_only_stores(cls, attrs.fields(cls)), cls
    for cls in checked:
        assert not _init_only_stores(cls, attrs.fields(cls)), cls


def test_a_constructor_that_only_checks_types_is_bypassed_with_the_same_checks() -> None:
    assert _type_checks(Typed, attrs.fields(Typed)) == [
        (str, False),
        (int, False),
        (Point, True),
        ((int, float), False),
        None,
    ]
    checked: list[type[Any]] = [
        Positive,
        Converted,
        Checked,
        CachedHash,
        HandWritten,
        WithDict,
        TypedAndChecked,
    ]
    for cls in checked:
        assert _type_checks(cls, attrs.fields(cls)) is None, cls
    typed = Typed(name="a", count=True, where=Point(1, 2), number=1.5, anything=[1])
    assert decode(encode(typed)).message == typed  # a bool is an int, for isinstance too
    assert decode(encode(Typed(name="b"))).message == Typed(name="b")
    with pytest.raises(
        MessageDecodeError, match=r"TypeError: .*'count' must be <class 'int'> \(got '1'"
    ):
        decode(object_frame("tests.wire.Typed", "a", "1", None, 0, None))
    with pytest.raises(MessageDecodeError, match=r"TypeError: .*'where' must be"):
        decode(object_frame("tests.wire.Typed", "a", 1, 2, 0, None))
    with pytest.raises(MessageDecodeError, match="ValueError"):
        decode(object_frame("tests.wire.TypedAndChecked", 0))
    with attrs.validators.disabled():  # the constructor decides, as it would without fast paths
        odd = decode(object_frame("tests.wire.Typed", 1, 2, 3, 4, 5)).message
    assert isinstance(odd, Typed)
    assert odd.name == 1  # type: ignore[comparison-overlap]


@message(name="tests.wire.Subclassed")
@attrs.frozen
class Subclassed:
    n: int
    subclasses: ClassVar[list[type]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Subclassed.subclasses.append(cls)


@message(name="tests.wire.Finalized")
@attrs.frozen
class Finalized:
    n: int

    def __del__(self) -> None:
        pass


def test_a_decoded_object_is_built_through_a_storing_twin_only_where_that_runs_no_code() -> None:
    twin = _storing_twin(Typed, attrs.fields(Typed))
    assert twin is not None
    assert issubclass(twin, Typed)
    for cls in (Subclassed, Finalized, DefaultName):  # a hook, a finalizer, no field
        assert _storing_twin(cls, attrs.fields(cls)) is None, cls
    assert Subclassed.subclasses == []
    for value in (Typed(name="t", where=Point(1, 2)), Subclassed(3), Finalized(4), Point(5, 6)):
        back = round_trip(value)
        assert back == value
        assert type(back) is type(value)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cast(Point, round_trip(Point(1, 2))).x = 3  # type: ignore[misc]


def test_classes_that_check_or_convert_their_fields_are_still_built_by_their_constructor() -> None:
    assert decode(object_frame("tests.wire.Converted", "5")).message == Converted(5)
    for name, bad in [
        ("tests.wire.Positive", 0),
        ("tests.wire.Checked", -1),
        ("tests.wire.HandWritten", "1"),
    ]:
        with pytest.raises(MessageDecodeError, match=r"ValueError|TypeError"):
            decode(object_frame(name, bad))
    assert decode(object_frame("tests.wire.OwnSetattr", -3)).message == OwnSetattr(3)
    cached = decode(object_frame("tests.wire.CachedHash", 7)).message
    assert cached == CachedHash(7)
    assert hash(cached) == hash(CachedHash(7))
    assert round_trip(WithDict(3)) == WithDict(3)
    assert round_trip(HandWritten(4)) == HandWritten(4)


def reference_decode(payload: bytes) -> tuple[int, object]:
    """The decoder as it was before the fast paths: every object through its constructor."""
    kind, to_uid = decode_header(payload)

    def build(value: Any) -> object:
        if not isinstance(value, list) or not value or not isinstance(value[0], str):
            raise MessageDecodeError("object body is not [wire_name, *fields]")
        spec = _by_name.get(value[0])
        if spec is None:
            raise MessageDecodeError(f"unknown message type {value[0]!r}: not registered")
        if isinstance(spec, _EnumSpec):
            if len(value) != 2:
                raise MessageDecodeError("enum needs exactly one value")
            return spec.cls(value[1])
        values = value[1:]  # more than this node knows: a newer peer's, the extras left out
        return spec.cls(**dict(zip(spec.aliases, values, strict=False)))

    def ext_hook(depth: int, code: int, data: bytes) -> object:
        if depth > MAX_NESTING:
            raise MessageDecodeError("nested too deep")
        inner = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            ext_hook=lambda c, d: ext_hook(depth + 1, c, d),
        )
        if code in (1, 5):  # EXT_OBJECT, EXT_ENUM
            return build(inner)
        if not isinstance(inner, list):
            raise MessageDecodeError("extension does not hold a list")
        constructors: dict[int, Any] = {2: tuple, 3: frozenset, 4: set}
        if code not in constructors:
            raise MessageDecodeError("unknown extension type")
        return constructors[code](inner)

    try:
        value = msgpack.unpackb(
            payload[HEADER_SIZE:],
            raw=False,
            strict_map_key=False,
            ext_hook=lambda c, d: ext_hook(1, c, d),
        )
        if kind == KIND_OBJECT_FLAT:
            if not isinstance(value, list) or not value:
                raise MessageDecodeError("object body is not [wire_name, *fields]")
            *value, mask = value
            if type(mask) is not int or mask <= 0 or mask & 1:
                raise MessageDecodeError("not a field mask")
            for i in range(1, mask.bit_length()):
                if mask >> i & 1:
                    if not isinstance(value[i], list):
                        raise MessageDecodeError("a flat field is not [wire_name, *fields]")
                    value[i] = build(value[i])
        if kind in (KIND_OBJECT, KIND_OBJECT_FLAT):
            value = build(value)
    except MessageDecodeError:
        raise
    except Exception as exc:
        raise MessageDecodeError(f"{type(exc).__name__}") from None
    return to_uid, value


def outcome(decoder: Any, payload: bytes) -> tuple[str, object]:
    try:
        to_uid, value = decoder(payload)
    except (FrameDecodeError, MessageDecodeError) as exc:
        return type(exc).__name__, None
    return "ok", (to_uid, typed(value))


registered_names = st.sampled_from(
    [
        "tests.wire.Point",
        "tests.wire.Options",
        "tests.wire.Private",
        "tests.wire.Versioned",
        "tests.wire.Holder",
        "tests.wire.Positive",
        "tests.wire.Converted",
        "tests.wire.Checked",
        "tests.wire.CachedHash",
        "tests.wire.HandWritten",
        "tests.wire.Typed",
        "tests.wire.TypedAndChecked",
        "tests.wire.OwnSetattr",
        "tests.wire.Color",
        "?",
    ]
)


@fuzz
@given(name=registered_names, fields=st.lists(values, max_size=4), nested=st.booleans())
def test_fast_decode_accepts_and_refuses_exactly_what_the_constructors_do(
    name: str, fields: list[object], nested: bool
) -> None:
    body = _pack_nested([name, *fields])
    payload = (
        frame(msgpack.packb([msgpack.ExtType(1, body)]))
        if nested
        else frame(body, kind=KIND_OBJECT)
    )
    assert outcome(decode_parts, payload) == outcome(reference_decode, payload)


@fuzz
@given(
    outer=registered_names,
    inner=registered_names,
    fields=st.lists(values, max_size=3),
    inner_fields=st.lists(values, max_size=3),
    at=st.integers(min_value=0, max_value=3),
    mask=st.integers(min_value=-4, max_value=1 << 6),
)
def test_fast_decode_of_flat_bodies_accepts_and_refuses_what_the_constructors_do(
    outer: str, inner: str, fields: list[object], inner_fields: list[object], at: int, mask: int
) -> None:
    # The object sent flat at ``at`` (its bit in ``mask``, or any other mask a peer may send).
    body = [outer, *fields]
    body.insert(min(at, len(fields)) + 1, [inner, *inner_fields])
    payload = frame(_pack_nested([*body, mask]), kind=KIND_OBJECT_FLAT)
    assert outcome(decode_parts, payload) == outcome(reference_decode, payload)
    payload = frame(_pack_nested([*body, 1 << min(at + 1, len(body) - 1)]), kind=KIND_OBJECT_FLAT)
    assert outcome(decode_parts, payload) == outcome(reference_decode, payload)


@fuzz
@given(data=st.binary(max_size=60))
def test_fast_decode_refuses_arbitrary_bytes_as_the_reference_does(data: bytes) -> None:
    for kind in (KIND_PLAIN, KIND_OBJECT, KIND_OBJECT_FLAT):
        payload = frame(data, kind=kind)
        assert outcome(decode_parts, payload) == outcome(reference_decode, payload)
    assert outcome(decode_parts, data) == outcome(reference_decode, data)


def test_fast_decode_reports_what_was_wrong() -> None:
    assert decode_parts(encode(Point(1, 2), to_uid=9)) == (9, Point(1, 2))
    with pytest.raises(FrameDecodeError, match="3 bytes is shorter than the header"):
        decode_parts(b"\x01\x02\x00")
    with pytest.raises(FrameDecodeError, match="wire version 2 is not supported"):
        decode_parts(frame(b"\xc0", version=2))
    with pytest.raises(FrameDecodeError, match="unknown frame kind 7"):
        decode_parts(frame(b"\xc0", kind=7))
    with pytest.raises(MessageDecodeError, match=r"not \[wire_name, \*fields\]"):
        decode_parts(frame(msgpack.packb([]), kind=KIND_OBJECT))
    with pytest.raises(MessageDecodeError, match="missing 1 required positional argument"):
        decode_parts(object_frame("tests.wire.Point", 1))


@fast
@given(value=values, to_uid=st.integers(min_value=0, max_value=2**64 - 1))
def test_frame_encoder_makes_the_frame_encode_and_encode_frame_make(
    value: object, to_uid: int
) -> None:
    encoder = FrameEncoder(1 << 20)
    assert encoder.frame(value, to_uid) == encode_frame(encode(value, to_uid=to_uid))


def test_frame_encoder_refuses_what_encode_refuses_and_stays_usable() -> None:
    encoder = FrameEncoder(1024)
    for value in ([1, 2, Unregistered()], [2**64], Holder([Holder((Unregistered(),))])):
        with pytest.raises(SerializationError) as refused:
            encoder.frame(value, 0)
        with pytest.raises(SerializationError) as expected:
            encode(value)
        assert str(refused.value) == str(expected.value)
        assert encoder.frame([3], 0) == encode_frame(encode([3]))  # no half-written message
    big = b"x" * 1010
    with pytest.raises(MessageTooLarge) as refused_size:
        encoder.frame(big, 0)
    with pytest.raises(MessageTooLarge) as expected_size:
        encode(big, max_size=1024 - 4)
    assert str(refused_size.value) == str(expected_size.value)
    fits = b"x" * (1024 - 4 - HEADER_SIZE - 3)  # 3: the msgpack bin header
    assert encoder.frame(fits, 0) == encode_frame(encode(fits))


def test_frame_encoder_follows_a_class_registered_again() -> None:
    @attrs.frozen
    class Moving:
        n: int

    message(name="tests.wire.Moving")(Moving)
    encoder = FrameEncoder(1 << 20)
    assert encoder.frame(Moving(1), 0) == encode_frame(encode(Moving(1)))
    message(name="tests.wire.Moved")(Moving)
    framed = encoder.frame(Moving(1), 0)
    assert decode(framed[4:]).message == Moving(1)
    assert b"tests.wire.Moved" in framed

    @attrs.frozen
    class Moving2:  # the same class defined again, as when its module is reloaded
        n: int

    Moving2.__qualname__ = Moving.__qualname__
    message(name="tests.wire.Moved")(Moving2)
    with pytest.raises(SerializationError, match="is not serializable"):
        encoder.frame(Moving(1), 0)
    assert decode(encoder.frame(Moving2(2), 0)[4:]).message == Moving2(2)


# --- fields left out of the frame while None (OMIT_WHEN_NONE) ---------------------------------

_OMIT = {OMIT_WHEN_NONE: True}


@message(name="tests.wire.Before")
@attrs.frozen
class PlainEnvelope:
    """What :class:`TracedEnvelope` was before its optional fields were added."""

    to: str
    payload: object


@message(name="tests.wire.Traced")
@attrs.frozen
class TracedEnvelope:
    to: str
    payload: object
    context: dict[str, str] | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(dict)),
        metadata=_OMIT,
    )
    extra: int | None = attrs.field(default=None, metadata=_OMIT)


@message(name="tests.wire.Traced-by-name")
@attrs.frozen
class TracedByName:
    to: str = attrs.field(alias="to_")
    context: object = attrs.field(default=None, metadata=_OMIT)


def _body(value: object) -> list[Any]:
    body: list[Any] = msgpack.unpackb(encode(value)[HEADER_SIZE:])
    return body


@pytest.mark.parametrize("payload", [7, Point(1, 2), (Point(1, 2),)])
def test_fields_left_out_while_none_add_no_byte(payload: object) -> None:
    plain = encode(PlainEnvelope("a", payload))
    traced = encode(TracedEnvelope("a", payload))
    # The same bytes but for the wire name (of the same length): not one byte for the fields.
    assert traced.replace(b"tests.wire.Traced", b"tests.wire.Before") == plain
    assert decode(traced).message == TracedEnvelope("a", payload)
    holder = Holder(TracedEnvelope("a", payload))  # nested: the same body, as an extension
    assert round_trip(holder) == holder


def test_fields_left_out_while_none_travel_up_to_the_last_that_is_set() -> None:
    context = {"traceparent": "00-x"}
    assert _body(TracedEnvelope("a", 1, context)) == ["tests.wire.Traced", "a", 1, context]
    assert _body(TracedEnvelope("a", 1, None, 5)) == ["tests.wire.Traced", "a", 1, None, 5]
    flat = _body(TracedEnvelope("a", Point(1, 2), context))
    assert flat == ["tests.wire.Traced", "a", ["tests.wire.Point", 1, 2], context, 0b100]
    for value in (
        TracedEnvelope("a", 1, context),
        TracedEnvelope("a", Point(1, 2), None, 5),
        TracedEnvelope("a", Point(1, 2), context, 5),
        Holder(TracedEnvelope("a", Point(1, 2), context)),
        TracedByName("b"),
        TracedByName("b", Point(3, 4)),
    ):
        assert round_trip(value) == value
    assert _body(TracedByName("b")) == ["tests.wire.Traced-by-name", "b"]


def test_an_older_peer_reads_the_new_fields_as_absent_and_a_newer_one_is_read_without_them() -> (
    None
):
    # An older peer's class has no context field: the newer body is read without it.
    newer = encode(TracedEnvelope("a", 1, {"traceparent": "00-x"}))
    older_view = msgpack.unpackb(newer[HEADER_SIZE:])[:3]
    assert older_view == ["tests.wire.Traced", "a", 1]
    # What an older peer sends (no field past the payload) decodes with the defaults.
    old_body = HEADER.pack(WIRE_VERSION, KIND_OBJECT, 0) + msgpack.packb(
        ["tests.wire.Traced", "a", 1]
    )
    assert decode(old_body).message == TracedEnvelope("a", 1)
    bad = HEADER.pack(WIRE_VERSION, KIND_OBJECT, 0) + msgpack.packb(
        ["tests.wire.Traced", "a", 1, 5]
    )
    with pytest.raises(MessageDecodeError, match="context"):
        decode(bad)  # a value the validator refuses is refused, as without the field


def test_a_field_left_out_while_none_must_default_to_none_and_come_last() -> None:
    with pytest.raises(MessageRegistrationError, match="'y' follows a field left out"):

        @message(name="tests.wire.BadOrder")
        @attrs.frozen
        class BadOrder:
            x: int | None = attrs.field(default=None, metadata=_OMIT)
            y: int = 0

    with pytest.raises(MessageRegistrationError, match="'x' follows a field left out"):

        @message(name="tests.wire.BadDefault")
        @attrs.frozen
        class BadDefault:
            x: int = attrs.field(default=0, metadata=_OMIT)
