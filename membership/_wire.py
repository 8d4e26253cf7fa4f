"""The wire format: how one message becomes one frame, and back. Sans-IO.

Theory of operation: a frame's payload is a fixed 10-byte header, ``version`` (1 byte), ``kind``
(1 byte) and ``to_uid`` (8 bytes, the recipient incarnation, 0 for "any"), then a msgpack body.
Kind ``PLAIN`` carries a plain msgpack value; kind ``OBJECT`` carries ``[wire_name, *fields]`` of a
class registered with :func:`message`. Registered objects nested inside a message, tuples, sets and
registered enums travel as msgpack extension types, so they come back as what was sent (msgpack on
its own turns tuples into lists). There is no pickle anywhere: a peer can only make us build
classes that were registered on purpose, through their validating constructors.

The header is fixed-size binary rather than msgpack so that a bad header (which means the link is
broken: close it) is told apart cheaply from a bad body (one message nobody here understands: drop
it, keep the link), which is also Akka's split between framing errors and serializer errors.

New fields of a registered class must be added last and with defaults: fields travel by
position, and a message from an older peer with fewer fields gets the defaults.
"""

from __future__ import annotations

import enum
import functools
import operator
import struct
import threading
from collections.abc import Callable
from typing import Any, Final, NamedTuple, TypeVar, overload

import attrs
import msgpack

from ._errors import (
    FrameDecodeError,
    MessageDecodeError,
    MessageRegistrationError,
    MessageTooLarge,
    SerializationError,
)

WIRE_VERSION: Final = 1
KIND_PLAIN: Final = 1
KIND_OBJECT: Final = 2

HEADER = struct.Struct(">BBQ")
HEADER_SIZE: Final = HEADER.size

EXT_OBJECT: Final = 1
EXT_TUPLE: Final = 2
EXT_FROZENSET: Final = 3
EXT_SET: Final = 4
EXT_ENUM: Final = 5

MAX_NESTING: Final = 32
"""How deep tuples, sets and registered objects may nest in a received message. msgpack keeps its
parser state (about 40 KB) on the C stack and each of these levels parses its extension body with
a fresh parser, so without a limit a frame of a couple of kilobytes nesting a few hundred tuples
overflows the stack and kills the process."""

T = TypeVar("T", bound=type)


@attrs.frozen
class _ClassSpec:
    cls: type
    name: str
    aliases: tuple[str, ...]
    fields: Callable[[Any], tuple[Any, ...]]
    build: Callable[[list[Any]], object]
    """Builds the object from ``[name, *fields]`` with every field present (the fast path)."""


@attrs.frozen
class _EnumSpec:
    cls: type[enum.Enum]
    name: str


_by_class: dict[type, _ClassSpec | _EnumSpec] = {}
_by_name: dict[str, _ClassSpec | _EnumSpec] = {}


def _field_getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        (only,) = names
        return lambda obj: (getattr(obj, only),)
    return operator.attrgetter(*names)


def _builder(cls: type, aliases: tuple[str, ...]) -> Callable[[list[Any]], object]:
    # Keyword arguments spelled out once per class: three times cheaper than cls(**dict(zip())).
    # The aliases are attrs-checked identifiers, so the generated source is safe.
    assert all(alias.isidentifier() for alias in aliases)
    arguments = ", ".join(f"{alias}=v[{i}]" for i, alias in enumerate(aliases, start=1))
    build: Callable[[list[Any]], object] = eval(f"lambda v: cls({arguments})", {"cls": cls})
    return build


def _register(cls: T, name: str | None) -> T:
    if not isinstance(cls, type):
        raise MessageRegistrationError(f"@message applies to classes, not to {cls!r}")
    wire_name = name if name is not None else f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(wire_name, str) or not wire_name:
        raise MessageRegistrationError(f"wire name {wire_name!r} must be a non-empty string")
    spec: _ClassSpec | _EnumSpec
    if issubclass(cls, enum.Enum):
        spec = _EnumSpec(cls, wire_name)
    elif attrs.has(cls):
        fields = attrs.fields(cls)
        hidden = [f.name for f in fields if not f.init]
        if hidden:
            raise MessageRegistrationError(
                f"cannot register {cls.__qualname__}: fields {hidden} have init=False, so they "
                "could not be rebuilt on the receiving node"
            )
        aliases = tuple(f.alias for f in fields)
        spec = _ClassSpec(
            cls,
            wire_name,
            aliases,
            _field_getter(tuple(f.name for f in fields)),
            _builder(cls, aliases),
        )
    else:
        raise MessageRegistrationError(
            f"cannot register {cls.__qualname__}: @message needs an attrs class "
            "(decorate it with @attrs.frozen first) or an Enum"
        )
    taken = _by_name.get(wire_name)
    if taken is not None and taken.cls is not cls:
        same_place = (taken.cls.__module__, taken.cls.__qualname__) == (
            cls.__module__,
            cls.__qualname__,
        )
        if not same_place:
            raise MessageRegistrationError(
                f"wire name {wire_name!r} of {cls.__module__}.{cls.__qualname__} is already "
                f"taken by {taken.cls.__module__}.{taken.cls.__qualname__}; pass "
                "@message(name=...) to pick another"
            )
        # The same class defined again (a module reloaded): the newest definition wins.
        del _by_class[taken.cls]
    old = _by_class.get(cls)
    if old is not None and old.name != wire_name:
        del _by_name[old.name]
    _by_class[cls] = spec
    _by_name[wire_name] = spec
    return cls


@overload
def message(cls: T, /) -> T: ...
@overload
def message(*, name: str) -> Callable[[T], T]: ...
def message(cls: T | None = None, /, *, name: str | None = None) -> T | Callable[[T], T]:
    """Register an attrs class (or an Enum) so that it can be sent between nodes.

    The wire name defaults to the class's module plus qualified name; pass ``name=`` to keep it
    stable across a rename. Every node must import the class before messages of it arrive.

    Example:
        >>> import attrs
        >>> @message
        ... @attrs.frozen
        ... class Increment:
        ...     delta: int = 1
        >>> @message(name="counter.Get")
        ... @attrs.frozen
        ... class Get: ...

    Raises:
        MessageRegistrationError: not an attrs class or Enum, or the wire name is taken.
    """
    if cls is not None:
        return _register(cls, name)
    return lambda c: _register(c, name)


def wire_name(cls: type) -> str | None:
    """The wire name a class is registered under, or None."""
    spec = _by_class.get(cls)
    return None if spec is None else spec.name


def _default(obj: Any) -> Any:
    cls = type(obj)
    spec = _by_class.get(cls)
    if spec is not None:
        if isinstance(spec, _EnumSpec):
            return msgpack.ExtType(EXT_ENUM, _pack_nested([spec.name, obj.value]))
        return msgpack.ExtType(EXT_OBJECT, _pack_nested([spec.name, *spec.fields(obj)]))
    if cls is tuple:
        return msgpack.ExtType(EXT_TUPLE, _pack_nested(list(obj)))
    if cls is frozenset:
        return msgpack.ExtType(EXT_FROZENSET, _pack_nested(list(obj)))
    if cls is set:
        return msgpack.ExtType(EXT_SET, _pack_nested(list(obj)))
    if cls is int:  # msgpack hands us the ints it cannot pack itself
        raise SerializationError("an int outside -2**63..2**64-1 is not serializable")
    raise SerializationError(
        f"{cls.__module__}.{cls.__qualname__} is not serializable: register it with "
        "@p2pshard.message or send plain msgpack types (None, bool, int, float, str, bytes, "
        "list, tuple, dict, set)"
    )


def _pack_nested(value: Any) -> bytes:
    # Refuse here what every receiver would drop (see MAX_NESTING), rather than lose it there.
    local = _local
    if local.depth >= MAX_NESTING:
        raise SerializationError(
            f"tuples, sets or registered objects nested more than {MAX_NESTING} deep"
        )
    local.depth += 1
    try:
        packed: bytes = msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)
    finally:
        local.depth -= 1
    return packed


def _new_packer() -> msgpack.Packer:
    return msgpack.Packer(default=_default, use_bin_type=True, strict_types=True)


class _Local(threading.local):
    def __init__(self) -> None:
        # One Packer per thread: reusing it is five times cheaper than msgpack.packb, but a Packer
        # is neither thread-safe nor re-entrant (nested objects use _pack_nested instead).
        self.packer = _new_packer()
        self.depth = 0


_local = _Local()


def encode(message: object, *, to_uid: int = 0, max_size: int | None = None) -> bytes:
    """Encode one message as a frame payload (without the length prefix).

    Raises:
        SerializationError: the message or a value inside it is not serializable; the error
            names the type.
        MessageTooLarge: the payload would exceed ``max_size``.
    """
    spec = _by_class.get(type(message))
    try:
        if spec is not None and isinstance(spec, _ClassSpec):
            body = _local.packer.pack([spec.name, *spec.fields(message)])
            kind = KIND_OBJECT
        else:
            body = _local.packer.pack(message)
            kind = KIND_PLAIN
    except (SerializationError, TypeError, ValueError, OverflowError) as exc:
        # A fresh Packer: a failed pack leaves the shared one with a half-written buffer.
        _local.packer = _new_packer()
        cause = None if isinstance(exc, SerializationError) else exc
        raise SerializationError(f"cannot send {_describe(message)}: {exc}") from cause
    payload: bytes = HEADER.pack(WIRE_VERSION, kind, to_uid) + body
    if max_size is not None and len(payload) > max_size:
        raise MessageTooLarge(
            f"{_describe(message)} encodes to {len(payload)} bytes, above max_frame_size {max_size}"
        )
    return payload


def _describe(message: object) -> str:
    cls = type(message)
    return f"a message of type {cls.__module__}.{cls.__qualname__}"


class Decoded(NamedTuple):
    """A decoded frame payload: the recipient uid it was meant for (0: any) and the message."""

    to_uid: int
    message: object


def decode_header(payload: bytes) -> tuple[int, int]:
    """Check a frame payload's header; return ``(kind, to_uid)``.

    Raises:
        FrameDecodeError: too short, unknown version or unknown kind: the link is broken.
    """
    if len(payload) < HEADER_SIZE:
        raise FrameDecodeError(f"frame of {len(payload)} bytes is shorter than the header")
    version, kind, to_uid = HEADER.unpack_from(payload)
    if version != WIRE_VERSION:
        raise FrameDecodeError(f"wire version {version} is not supported (this node speaks 1)")
    if kind not in (KIND_PLAIN, KIND_OBJECT):
        raise FrameDecodeError(f"unknown frame kind {kind}")
    return kind, to_uid


def decode(payload: bytes) -> Decoded:
    """Decode a frame payload made by :func:`encode`.

    Raises:
        FrameDecodeError: the header is bad (close the link).
        MessageDecodeError: the body is not a message this node can build (drop the message).
    """
    kind, to_uid = decode_header(payload)
    try:
        value = msgpack.unpackb(
            payload[HEADER_SIZE:], raw=False, strict_map_key=False, ext_hook=_top_ext_hook
        )
        if kind == KIND_OBJECT:
            value = _build_object(value)
    except MessageDecodeError:
        raise
    except Exception as exc:
        # msgpack raises a handful of unrelated types for malformed input (ValueError,
        # ExtraData, StackError, FormatError, TypeError for unhashable keys, ...): all mean the
        # same thing here. Constructors of registered classes may raise anything on bad fields.
        raise MessageDecodeError(f"undecodable message body: {type(exc).__name__}: {exc}") from None
    return Decoded(to_uid, value)


def _build_object(value: Any) -> object:
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise MessageDecodeError("object body is not [wire_name, *fields]")
    name = value[0]
    spec = _by_name.get(name)
    if spec is None:
        raise MessageDecodeError(f"unknown message type {name!r}: not registered on this node")
    if isinstance(spec, _EnumSpec):
        if len(value) != 2:
            raise MessageDecodeError(f"enum {name!r} needs exactly one value")
        return spec.cls(value[1])
    if len(value) == len(spec.aliases) + 1:
        return spec.build(value)
    values = value[1:]
    if len(values) > len(spec.aliases):
        raise MessageDecodeError(
            f"{name!r} arrived with {len(values)} fields; this node knows {len(spec.aliases)}"
        )
    return spec.cls(**dict(zip(spec.aliases, values, strict=False)))  # older peer: defaults


def _ext_hook(depth: int, code: int, data: bytes) -> object:
    if depth > MAX_NESTING:
        raise MessageDecodeError(
            f"tuples, sets or objects nested more than {MAX_NESTING} deep in a message"
        )
    inner = msgpack.unpackb(
        data, raw=False, strict_map_key=False, ext_hook=functools.partial(_ext_hook, depth + 1)
    )
    if code in (EXT_OBJECT, EXT_ENUM):
        return _build_object(inner)
    if not isinstance(inner, list):
        raise MessageDecodeError(f"extension {code} does not hold a list")
    if code == EXT_TUPLE:
        return tuple(inner)
    if code == EXT_FROZENSET:
        return frozenset(inner)
    if code == EXT_SET:
        return set(inner)
    raise MessageDecodeError(f"unknown extension type {code}")


_top_ext_hook = functools.partial(_ext_hook, 1)
