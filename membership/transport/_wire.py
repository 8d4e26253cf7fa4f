"""The wire format: how one message becomes one frame, and back. Sans-IO.

Theory of operation: a frame's payload is a fixed 10-byte header, ``version`` (1 byte), ``kind``
(1 byte) and ``to_uid`` (8 bytes, the recipient incarnation, 0 for "any"), then a msgpack body.
Kind ``PLAIN`` carries a plain msgpack value; kind ``OBJECT`` carries ``[wire_name, *fields]`` of a
class registered with :func:`message`. Registered objects nested inside a message, tuples, sets and
registered enums travel as msgpack extension types, so they come back as what was sent (msgpack on
its own turns tuples into lists). There is no pickle anywhere: a peer can only make us build
classes that were registered on purpose, through their validating constructors. (A class whose
attrs ``__init__`` only stores its fields, with no validator, converter or hook, is built by
storing them, which makes the same object in half the time: see :func:`_init_only_stores` and
:func:`_storing_twin`. One whose only validators are ``instance_of`` checks, optional or not, is
built the same way once the same ``isinstance`` checks pass, and by its constructor otherwise:
see :func:`_type_checks`.)

A registered object in a field of the message itself travels flat instead: kind ``OBJECT_FLAT``
carries ``[wire_name, *fields, mask]``, each such field as its own ``[wire_name, *fields]`` list,
and bit ``i`` of ``mask`` set for the field at position ``i`` of the body. An extension's body is
a second msgpack document, packed and read by a msgpack call of its own through Python hooks;
the fields of a flat body are packed and read with the message. For the commonest message of
all, a shard region's ``EntityDelivery`` with the entity's message in a field, that makes
encoding a third cheaper and decoding a tenth. Deeper objects, and enums, stay extensions. A
node older than this format refuses the kind (a broken link): every node of a cluster must speak
it.

The header is fixed-size binary rather than msgpack so that a bad header (which means the link is
broken: close it) is told apart cheaply from a bad body (one message nobody here understands: drop
it, keep the link), which is also Akka's split between framing errors and serializer errors.

New fields of a registered class must be added last and with defaults: fields travel by
position, and a message from an older peer with fewer fields gets the defaults; one from a newer
peer with more fields is read without the ones this node does not know. (The golden wire
fixtures under ``tests/wire_fixtures`` check that no change breaks either direction.) A trailing
field whose attrs metadata sets :data:`OMIT_WHEN_NONE` is left out of the body while it holds
None, its default: such a field costs no byte when unused, and the body is the one the class
made before the field was added (the receiver reads a missing field as its default, as from an
older peer). Sharding's envelopes carry their optional trace context so.
"""

from __future__ import annotations

import enum
import functools
import keyword
import operator
import struct
import threading
import types
from collections.abc import Callable, Sequence
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
from ._framing import HEADER as _FRAME_PREFIX

WIRE_VERSION: Final = 1
KIND_PLAIN: Final = 1
KIND_OBJECT: Final = 2
KIND_OBJECT_FLAT: Final = 3

HEADER = struct.Struct(">BBQ")
HEADER_SIZE: Final = HEADER.size
_FRAMED_HEADER = struct.Struct(">IBBQ")
"""The length prefix followed by :data:`HEADER`, for :class:`FrameEncoder`."""
_unpack_version_kind = struct.Struct(">HQ").unpack_from
"""Reads :data:`HEADER` with version and kind as one number, ``version << 8 | kind``."""
_unpackb = msgpack.unpackb

_VERSION_PLAIN: Final = WIRE_VERSION << 8 | KIND_PLAIN
_VERSION_OBJECT: Final = WIRE_VERSION << 8 | KIND_OBJECT
_VERSION_FLAT: Final = WIRE_VERSION << 8 | KIND_OBJECT_FLAT
_VERSION_KINDS: Final = frozenset({_VERSION_PLAIN, _VERSION_OBJECT, _VERSION_FLAT})

EXT_OBJECT: Final = 1
EXT_TUPLE: Final = 2
EXT_FROZENSET: Final = 3
EXT_SET: Final = 4
EXT_ENUM: Final = 5

MAX_NESTING: Final = 32
"""How deep tuples, sets and registered objects may nest in a received message. msgpack keeps its
parser state (about 40 KB) on the C stack and each of these levels parses its extension body with
a fresh parser, so without a limit a frame of a couple of kilobytes nesting a few hundred tuples
overflows the stack and kills the process. An object sent flat (see ``KIND_OBJECT_FLAT``) is no
extension: it is parsed with its message, and does not count."""

OMIT_WHEN_NONE: Final = "membership.wire.omit_when_none"
"""attrs field metadata key: ``metadata={OMIT_WHEN_NONE: True}`` leaves the field out of the
frame while it holds None. Only for fields with default None after every field without it (the
body must stay a prefix of the fields); registering another class raises."""

T = TypeVar("T", bound=type)


@attrs.frozen
class _ClassSpec:
    cls: type
    name: str
    aliases: tuple[str, ...]
    as_list: Callable[[Any], list[Any]]
    """Gives ``[name, *fields]`` of an instance: its body when nested in another value."""
    as_body: Callable[[Any], tuple[int, list[Any]]]
    """Gives the frame kind and the body of an instance sent as a message (see
    :func:`_body_maker`)."""
    build: Callable[[list[Any]], object]
    """Builds the object from a received ``[name, *fields]``."""


@attrs.frozen
class _EnumSpec:
    cls: type[enum.Enum]
    name: str

    def build(self, value: list[Any]) -> object:
        if len(value) != 2:
            raise MessageDecodeError(f"enum {self.name!r} needs exactly one value")
        return self.cls(value[1])


_by_class: dict[type, _ClassSpec | _EnumSpec] = {}
_by_name: dict[str, _ClassSpec | _EnumSpec] = {}
_as_list_by_class: dict[type, Callable[[Any], list[Any]]] = {}
"""``_ClassSpec.as_list`` of each registered attrs class: one lookup per nested object."""
_as_body_by_class: dict[type, Callable[[Any], tuple[int, list[Any]]]] = {}
"""``_ClassSpec.as_body`` of each registered attrs class: one lookup per message sent.

A class registered with ``since`` above 1 has a stand-in here that raises
:class:`NeedsProtocol`, so that the send path checks the link's version for it alone."""
_since_by_class: dict[type, int] = {}
"""The classes registered with ``since`` above 1, and that version."""


class NeedsProtocol(Exception):
    """Raised by :meth:`FrameEncoder.frame` for a message type that a later protocol added.

    The transport then encodes it with :meth:`FrameEncoder.frame_since` only for a peer whose
    link agreed on ``version`` or later.
    """

    def __init__(self, version: int) -> None:
        super().__init__(version)
        self.version = version


def _gated(version: int) -> Callable[[Any], tuple[int, list[Any]]]:
    def as_body(message: Any) -> tuple[int, list[Any]]:
        raise NeedsProtocol(version)

    return as_body


_SCALARS: Final = frozenset({str, int, float, bool, bytes, type(None)})
"""Types a field whose validator checks for them only cannot hold a registered object."""
_SCALAR_ANNOTATIONS: Final = frozenset(
    {"str", "int", "float", "bool", "bytes", "None", *(f"{t} | None" for t in ("str", "int"))}
)
"""The same types as annotations under ``from __future__ import annotations`` (strings)."""


def _lister(name: str, names: tuple[str, ...], required: int) -> Callable[[Any], list[Any]]:
    """A function giving ``[name, *fields]`` of an instance.

    The fields past ``required`` go only up to the last that is not None (see
    :data:`OMIT_WHEN_NONE`).
    """
    if all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
        as_list: Callable[[Any], list[Any]]
        if required == len(names):
            # Generated, like _builder: twice as fast as [name, *attrgetter(*names)(obj)].
            items = "".join(f", o.{n}" for n in names)
            as_list = eval(f"lambda o: [name{items}]", {"name": name})
            return as_list
        values = [f"a{i}" for i in range(1, len(names) + 1)]
        lines = ["def as_list(o):"]
        lines += (f"    {v} = o.{n}" for v, n in zip(values, names, strict=True))
        for count in range(len(names), required, -1):
            lines += [
                f"    if {values[count - 1]} is not None:",
                f"        return [{', '.join(['name', *values[:count]])}]",
            ]
        lines.append(f"    return [{', '.join(['name', *values[:required]])}]")
        namespace: dict[str, Any] = {"name": name}
        exec("\n".join(lines), namespace)
        as_list = namespace["as_list"]
        return as_list
    getters = tuple(operator.attrgetter(n) for n in names)

    def as_list_by_name(obj: Any) -> list[Any]:
        return _trimmed([name, *(get(obj) for get in getters)], required)

    return as_list_by_name


def _trimmed(body: list[Any], required: int) -> list[Any]:
    """``body`` (``[name, *fields]``) without its trailing Nones past ``required`` fields."""
    while len(body) > required + 1 and body[-1] is None:
        body.pop()
    return body


def _required_fields(cls: type, fields: Sequence[attrs.Attribute[Any]]) -> int:
    """How many fields always travel: those before the first :data:`OMIT_WHEN_NONE` one.

    Raises:
        MessageRegistrationError: an omitted field has another default than None, or a field
            that always travels follows one.
    """
    omitted = [bool(f.metadata.get(OMIT_WHEN_NONE)) for f in fields]
    required = omitted.index(True) if True in omitted else len(fields)
    for f, omit in zip(fields[required:], omitted[required:], strict=True):
        if not omit or f.default is not None:
            raise MessageRegistrationError(
                f"cannot register {cls.__qualname__}: field {f.name!r} follows a field left out "
                "of the frame when None, so it must be one too: give it default None and "
                "metadata={OMIT_WHEN_NONE: True}, or move the fields without it before them"
            )
    return required


def _body_maker(
    name: str, fields: Sequence[attrs.Attribute[Any]], required: int
) -> Callable[[Any], tuple[int, list[Any]]]:
    """A function giving ``(kind, body)`` of an instance sent as a message.

    ``(KIND_OBJECT, [name, *fields])`` when no field holds a registered attrs object;
    otherwise ``(KIND_OBJECT_FLAT, [name, *fields, mask])`` with each such field as its own
    ``[wire_name, *fields]`` list and bit ``i`` of ``mask`` set for position ``i`` of the body.
    Only fields whose validator allows no more than plain scalars are not looked at: a
    registered object there (built around its validators) travels as an extension, as any
    deeper one does. The fields past ``required`` go only up to the last that is not None
    (see :data:`OMIT_WHEN_NONE`).
    """
    names = tuple(f.name for f in fields)
    maybe = tuple(i for i, f in enumerate(fields, start=1) if _may_hold_object(f))
    namespace: dict[str, Any] = {
        "name": name,
        "lister": _as_list_by_class.get,
        "plain": KIND_OBJECT,
        "flat": KIND_OBJECT_FLAT,
    }
    if all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
        # Generated, like _lister: each field read once, each object field tested in place.
        values = [f"a{i}" for i in range(1, len(names) + 1)]
        lines = [
            "def as_body(o):",
            *(f"    {v} = o.{n}" for v, n in zip(values, names, strict=True)),
        ]
        lines.append("    mask = 0")
        for i in maybe:
            value = values[i - 1]
            lines += [
                f"    as_list = lister(type({value}))",
                "    if as_list is not None:",
                f"        {value} = as_list({value})",
                f"        mask |= {1 << i}",
            ]

        def returns(count: int, indent: str) -> list[str]:
            body = ", ".join(["name", *values[:count]])
            return [
                f"{indent}if mask:",
                f"{indent}    return flat, [{body}, mask]",
                f"{indent}return plain, [{body}]",
            ]

        for count in range(len(names), required, -1):  # the omitted fields, last first
            lines.append(f"    if {values[count - 1]} is not None:")
            lines += returns(count, "        ")
        lines += returns(required, "    ")
        exec("\n".join(lines), namespace)
        as_body: Callable[[Any], tuple[int, list[Any]]] = namespace["as_body"]
        return as_body
    getters = tuple(operator.attrgetter(n) for n in names)
    lister = _as_list_by_class.get

    def as_body_by_name(obj: Any) -> tuple[int, list[Any]]:
        body = _trimmed([name, *(get(obj) for get in getters)], required)
        mask = 0
        for i in maybe:
            if i >= len(body):
                break
            as_list = lister(type(body[i]))
            if as_list is not None:
                body[i] = as_list(body[i])
                mask |= 1 << i
        if mask:
            body.append(mask)
            return KIND_OBJECT_FLAT, body
        return KIND_OBJECT, body

    return as_body_by_name


def _init_only_stores(cls: type, fields: Sequence[attrs.Attribute[Any]]) -> bool:
    """Whether ``cls(...)`` does nothing but store each argument in its slot.

    True for the ``__init__`` attrs writes for a slotted class with no validator, converter,
    ``__attrs_pre_init__``, ``__attrs_post_init__``, hash cache or ``__setattr__`` of its own.
    Storing the fields straight into a new instance then makes the same object as the
    constructor, in half the time. Anything else (a hand-written ``__init__`` included) keeps
    the constructor, so every check a class makes still runs on what a peer sent.
    """
    checks = _type_checks(cls, fields)
    return checks is not None and all(check is None for check in checks)


_INSTANCE_OF: Final[Any] = type(attrs.validators.instance_of(object))
_OPTIONAL: Final[Any] = type(attrs.validators.optional(attrs.validators.instance_of(object)))


@attrs.frozen
class _Frozen:
    pass


_PLAIN_SETATTR: Final[tuple[object, ...]] = (object.__setattr__, _Frozen.__setattr__)
"""A class's ``__setattr__`` when its constructor stores into the slots directly: none of its
own, or that of a frozen attrs class (whose ``__init__`` goes around it)."""


def _may_hold_object(field: attrs.Attribute[Any]) -> bool:
    """Whether to look for a registered object in ``field`` when sending its message.

    Not for a field that a validator or its annotation says holds a plain scalar: the look
    costs a twentieth of sending a small message. An annotation is not checked at run time, so
    an object there anyway still travels, as an extension (as any deeper object does).
    """
    validator: Any = field.validator
    if type(validator) is _OPTIONAL:
        validator = validator.validator
    if type(validator) is not _INSTANCE_OF:
        annotation: object = field.type  # a type, or its text under postponed annotations
        return annotation not in _SCALARS and annotation not in _SCALAR_ANNOTATIONS
    kinds = validator.type if isinstance(validator.type, tuple) else (validator.type,)
    return not all(kind in _SCALARS for kind in kinds)


def _type_checks(
    cls: type, fields: Sequence[attrs.Attribute[Any]]
) -> list[tuple[Any, bool] | None] | None:
    """The ``instance_of`` checks ``cls(...)`` makes, if that is all it does besides storing.

    One entry per field: None (no validator), or ``(types, optional)`` for a validator
    ``instance_of(types)``, or ``optional(instance_of(types))`` when ``optional``. None as a
    whole when the constructor does anything else: a converter, another validator, a hook, a
    hash cache, a ``__setattr__`` of the class's own, a field not in a slot, an ``__init__``
    that attrs did not write. When the same ``isinstance`` checks pass, storing the fields
    makes what the constructor makes (the validators would have passed); when one fails, the
    constructor runs and raises its own error.
    """
    code = getattr(vars(cls).get("__init__"), "__code__", None)
    if code is None or not code.co_filename.startswith("<attrs generated"):
        return None
    hooks = ("__attrs_pre_init__", "__attrs_post_init__", "_attrs_cached_hash")
    if any(hasattr(cls, hook) for hook in hooks) or cls.__setattr__ not in _PLAIN_SETATTR:
        return None
    checks: list[tuple[Any, bool] | None] = []
    for f in fields:
        if f.converter is not None or not isinstance(
            getattr(cls, f.name, None), types.MemberDescriptorType
        ):
            return None
        validator: Any = f.validator
        optional = type(validator) is _OPTIONAL
        if optional:
            validator = validator.validator
        if validator is None:
            checks.append(None)
        elif type(validator) is _INSTANCE_OF:
            checks.append((validator.type, optional))
        else:
            return None
    return checks


def _builder(
    cls: type, fields: Sequence[attrs.Attribute[Any]], aliases: tuple[str, ...], required: int
) -> Callable[[list[Any]], object]:
    """A function building ``cls`` from a received ``[name, *fields]``.

    The common cases, every field present or (for a class with :data:`OMIT_WHEN_NONE` fields)
    every field but those, which are None, run generated code (keyword arguments spelled out
    once: three times cheaper than ``cls(**dict(zip()))``; or, when the constructor only stores
    its arguments, maybe after ``instance_of`` checks, the same checks and the stores
    themselves, through a :func:`_storing_twin` when the class has one). Any other count goes
    to :func:`_build_partial`.
    """
    # The source names fields by position only; the classes and descriptors are in namespace.
    namespace: dict[str, Any] = {
        "cls": cls,
        "new": object.__new__,
        "partial": functools.partial(_build_partial, cls, aliases),
    }
    assert all(alias.isidentifier() for alias in aliases)  # attrs checks them
    # The fields are unpacked into locals a1, a2, ... at once: cheaper than indexing each.
    names = [f"a{i}" for i in range(1, len(fields) + 1)]
    arguments = ", ".join(f"{alias}={name}" for alias, name in zip(aliases, names, strict=True))
    checks = _type_checks(cls, fields)
    if checks is not None:
        tests = []
        for i, check in enumerate(checks):
            if check is not None:
                namespace[f"t{i}"], optional = check
                test = f"isinstance({names[i]}, t{i})"
                tests.append(f"({names[i]} is None or {test})" if optional else test)
        lines = []
        if tests:
            # A value a validator would refuse: the constructor raises its own error for it.
            lines += [f"    if not ({' and '.join(tests)}):", f"        return cls({arguments})"]
        twin = _storing_twin(cls, fields)
        if twin is not None:
            namespace["twin"] = twin
            lines.append("    o = twin()")
            lines += [f"    o.{f.name} = {names[i]}" for i, f in enumerate(fields)]
            lines.append("    o.__class__ = cls")
        else:
            lines.append("    o = new(cls)")
            for i, f in enumerate(fields):
                namespace[f"set{i}"] = getattr(cls, f.name).__set__
                lines.append(f"    set{i}(o, {names[i]})")
    else:
        lines = [f"    o = cls({arguments})"]
    if required == len(names):
        source = [
            "def build(v):",
            "    try:",
            f"        {', '.join(['_', *names])}, = v",
            "    except ValueError:  # not every field: an older (or newer) peer's",
            "        return partial(v)",
        ]
    else:  # the omitted fields left out first: the common case
        source = [
            "def build(v):",
            "    try:",
            f"        {', '.join(['_', *names[:required]])}, = v",
            *(f"        {n} = None" for n in names[required:]),
            "    except ValueError:",
            "        try:",
            f"            {', '.join(['_', *names])}, = v",
            "        except ValueError:  # some omitted fields, or an older (or newer) peer's",
            "            return partial(v)",
        ]
    exec("\n".join([*source, *lines, "    return o"]), namespace)
    build: Callable[[list[Any]], object] = namespace["build"]
    return build


def _storing_twin(cls: type, fields: Sequence[attrs.Attribute[Any]]) -> type | None:
    """A subclass of ``cls`` that adds nothing but plain attribute stores, or None.

    A frozen class's slots are written through their descriptors' ``__set__``, a call that
    costs as much as building the object. An instance of this twin takes plain stores
    instead (``object.__setattr__``, specialized by the interpreter) and then becomes a ``cls``
    by ``__class__`` assignment, which Python allows between classes of the same layout: the
    cheaper way to the same object, even for one field. Only for a class with the
    plain metaclass and no ``__init_subclass__``, ``__del__`` or odd field name (so that making
    the twin runs nothing of the class's own), and only if the assignment works here.
    """
    if (
        not fields
        or type(cls) is not type
        or any("__init_subclass__" in vars(c) or "__del__" in vars(c) for c in cls.__mro__[:-1])
        or not all(f.name.isidentifier() and not keyword.iskeyword(f.name) for f in fields)
    ):
        return None
    namespace = {
        "__slots__": (),
        "__init__": object.__init__,  # twin() makes an empty one: cheaper than object.__new__
        "__setattr__": object.__setattr__,
        "__delattr__": object.__delattr__,
        "__module__": __name__,
        "__qualname__": f"_storing_twin.<{cls.__qualname__}>",
    }
    twin = type(f"{cls.__name__}Twin", (cls,), namespace)
    probe: Any = object.__new__(twin)
    try:
        probe.__class__ = cls
    except TypeError:
        return None
    return twin


def _build_partial(cls: type, aliases: tuple[str, ...], value: list[Any]) -> object:
    """Build ``cls`` from a body with fewer or more fields than this node knows.

    Fewer: an older peer's, the rest get their defaults. More: a newer peer's, the fields this
    node does not know are left out.
    """
    return cls(**dict(zip(aliases, value[1:], strict=False)))


def _register(cls: T, name: str | None, since: int = 1) -> T:
    if not isinstance(cls, type):
        raise MessageRegistrationError(f"@message applies to classes, not to {cls!r}")
    if not isinstance(since, int) or isinstance(since, bool) or since < 1:
        raise MessageRegistrationError(
            f"cannot register {cls.__qualname__} with since={since!r}: since is the wire "
            "protocol version that added the type, a whole number from 1"
        )
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
        required = _required_fields(cls, fields)
        spec = _ClassSpec(
            cls,
            wire_name,
            aliases,
            _lister(wire_name, tuple(f.name for f in fields), required),
            _body_maker(wire_name, fields, required),
            _builder(cls, fields, aliases, required),
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
        _as_list_by_class.pop(taken.cls, None)
        _as_body_by_class.pop(taken.cls, None)
        _since_by_class.pop(taken.cls, None)
    old = _by_class.get(cls)
    if old is not None and old.name != wire_name:
        del _by_name[old.name]
    _by_class[cls] = spec
    _by_name[wire_name] = spec
    _since_by_class.pop(cls, None)
    if isinstance(spec, _ClassSpec):
        _as_list_by_class[cls] = spec.as_list
        _as_body_by_class[cls] = spec.as_body
        if since > 1:
            _since_by_class[cls] = since
            _as_body_by_class[cls] = _gated(since)
    elif since > 1:
        raise MessageRegistrationError(
            f"cannot register {cls.__qualname__} with since={since}: only a message class can "
            "need a protocol version, not an enum"
        )
    return cls


@overload
def message(cls: T, /) -> T: ...
@overload
def message(*, name: str | None = None, since: int = 1) -> Callable[[T], T]: ...
def message(
    cls: T | None = None, /, *, name: str | None = None, since: int = 1
) -> T | Callable[[T], T]:
    """Register an attrs class (or an Enum) so that it can be sent between nodes.

    The wire name defaults to the class's module plus qualified name; pass ``name=`` to keep it
    stable across a rename. Every node must import the class before messages of it arrive.

    ``since`` is the wire protocol version that added the type (default 1). A message of a type
    with ``since`` above 1 goes only to peers whose link agreed on that version or a later one:
    to an older peer (or one with no link yet) the transport drops it, counts it
    (``messages_not_sent_protocol``) and logs why, so an older node never sees a type it cannot
    read. Check :meth:`~membership.Transport.peer_protocol` to do something else for older peers.
    The gate applies to a message sent on its own, not to an object nested inside another.

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
        return _register(cls, name, since)
    return lambda c: _register(c, name, since)


def needs_protocol(cls: type) -> int:
    """The wire protocol version a message type needs (its ``since``; 1 for most)."""
    return _since_by_class.get(cls, 1)


def wire_name(cls: type) -> str | None:
    """The wire name a class is registered under, or None."""
    spec = _by_class.get(cls)
    return None if spec is None else spec.name


_ExtType = msgpack.ExtType
_new_ext = tuple.__new__
"""``_new_ext(_ExtType, (code, data))`` makes an ExtType without the checks of its Python
``__new__`` (code in 0..127, data bytes), which hold for every one made here: a third of the
cost of packing a nested object."""


def _default(obj: Any) -> Any:
    cls = type(obj)
    as_list = _as_list_by_class.get(cls)
    if as_list is not None:  # a registered attrs class: the common case first
        return _new_ext(_ExtType, (EXT_OBJECT, _pack_nested(as_list(obj))))
    spec = _by_class.get(cls)
    if spec is not None:
        if isinstance(spec, _EnumSpec):
            return _new_ext(_ExtType, (EXT_ENUM, _pack_nested([spec.name, obj.value])))
        return _new_ext(_ExtType, (EXT_OBJECT, _pack_nested(spec.as_list(obj))))
    if cls is tuple:
        return _new_ext(_ExtType, (EXT_TUPLE, _pack_nested(list(obj))))
    if cls is frozenset:
        return _new_ext(_ExtType, (EXT_FROZENSET, _pack_nested(list(obj))))
    if cls is set:
        return _new_ext(_ExtType, (EXT_SET, _pack_nested(list(obj))))
    if cls is int:  # msgpack hands us the ints it cannot pack itself
        raise SerializationError("an int outside -2**63..2**64-1 is not serializable")
    raise SerializationError(
        f"{cls.__module__}.{cls.__qualname__} is not serializable: register it with "
        "@p2pshard.message or send plain msgpack types (None, bool, int, float, str, bytes, "
        "list, tuple, dict, set)"
    )


def _pack_nested(value: Any) -> bytes:
    # Refuse here what every receiver would drop (see MAX_NESTING), rather than lose it there.
    nested = _local.nested  # one thread-local lookup: each costs as much as packing an int
    depth = nested.depth
    if depth >= MAX_NESTING:
        raise SerializationError(
            f"tuples, sets or registered objects nested more than {MAX_NESTING} deep"
        )
    # One Packer per depth, reused: the one of a level is busy while the levels inside it pack,
    # and making a new one (msgpack.packb) cost as much as the packing.
    packers = nested.packers
    if depth == len(packers):
        packers.append(_new_packer())
    nested.depth = depth + 1
    try:
        packed: bytes = packers[depth].pack(value)
    except BaseException:
        packers[depth] = _new_packer()  # see _encode_body
        raise
    finally:
        nested.depth = depth
    return packed


def _new_packer() -> msgpack.Packer:
    return msgpack.Packer(default=_default, use_bin_type=True, strict_types=True)


class _Nested:
    """What :func:`_pack_nested` keeps per thread: how deep it is now, and a Packer per depth."""

    __slots__ = ("depth", "packers")

    def __init__(self) -> None:
        self.depth = 0
        self.packers: list[msgpack.Packer] = []


class _Local(threading.local):
    def __init__(self) -> None:
        # One Packer per thread: reusing it is five times cheaper than msgpack.packb, but a Packer
        # is neither thread-safe nor re-entrant (nested objects use _pack_nested instead).
        self.packer = _new_packer()
        self.nested = _Nested()


_local = _Local()


def encode(message: object, *, to_uid: int = 0, max_size: int | None = None) -> bytes:
    """Encode one message as a frame payload (without the length prefix).

    Raises:
        SerializationError: the message or a value inside it is not serializable; the error
            names the type.
        MessageTooLarge: the payload would exceed ``max_size``.
    """
    kind, body = _encode_body(message)
    payload: bytes = HEADER.pack(WIRE_VERSION, kind, to_uid) + body
    if max_size is not None and len(payload) > max_size:
        raise _too_large(message, len(payload), max_size)
    return payload


class FrameEncoder:
    """Encodes messages as whole frames, length prefix included, for one transport.

    The send path: :func:`encode` and ``_framing.encode_frame`` in one step that copies the body
    once, with a Packer of its own rather than the thread's (a transport sends from its trio
    thread only). Together that is a third less work per message.
    """

    __slots__ = ("_max_size", "_packer")

    def __init__(self, max_frame_size: int) -> None:
        self._packer = _new_packer()
        self._max_size = max_frame_size - _FRAME_PREFIX.size
        """The payload limit, as ``max_size`` of :func:`encode`."""

    def frame(self, message: object, to_uid: int) -> bytes:
        """The frame of ``message`` for incarnation ``to_uid`` (0: any).

        Raises:
            SerializationError: as :func:`encode`.
            MessageTooLarge: the frame would exceed ``max_frame_size``.
        """
        as_body = _as_body_by_class.get(type(message))
        try:
            if as_body is not None:
                kind, fields = as_body(message)
                body = self._packer.pack(fields)
            else:
                body = self._packer.pack(message)
                kind = KIND_PLAIN
        except (SerializationError, TypeError, ValueError, OverflowError) as exc:
            self._packer = _new_packer()  # see _encode_body
            raise _cannot_send(message, exc) from _cause(exc)
        size = HEADER_SIZE + len(body)
        if size > self._max_size:
            raise _too_large(message, size, self._max_size)
        framed: bytes = _FRAMED_HEADER.pack(size, WIRE_VERSION, kind, to_uid) + body
        return framed

    def frame_since(self, message: object, to_uid: int) -> bytes:
        """The frame of a message whose type needs a later protocol (:class:`NeedsProtocol`).

        For a link the caller found to speak that version: :meth:`frame` refuses such a type.

        Raises:
            SerializationError: as :func:`encode`.
            MessageTooLarge: the frame would exceed ``max_frame_size``.
        """
        kind, body = _encode_body(message)
        size = HEADER_SIZE + len(body)
        if size > self._max_size:
            raise _too_large(message, size, self._max_size)
        framed: bytes = _FRAMED_HEADER.pack(size, WIRE_VERSION, kind, to_uid) + body
        return framed


def _encode_body(message: object) -> tuple[int, bytes]:
    spec = _by_class.get(type(message))
    try:
        if spec is not None and isinstance(spec, _ClassSpec):
            kind, fields = spec.as_body(message)
            return kind, _local.packer.pack(fields)
        return KIND_PLAIN, _local.packer.pack(message)
    except (SerializationError, TypeError, ValueError, OverflowError) as exc:
        # A fresh Packer: a failed pack leaves the shared one with a half-written buffer.
        _local.packer = _new_packer()
        raise _cannot_send(message, exc) from _cause(exc)


def _cannot_send(message: object, exc: Exception) -> SerializationError:
    return SerializationError(f"cannot send {_describe(message)}: {exc}")


def _cause(exc: Exception) -> Exception | None:
    return None if isinstance(exc, SerializationError) else exc


def _too_large(message: object, size: int, max_size: int) -> MessageTooLarge:
    return MessageTooLarge(
        f"{_describe(message)} encodes to {size} bytes, above max_frame_size {max_size}"
    )


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
    if len(payload) >= HEADER_SIZE:
        version, kind, to_uid = HEADER.unpack_from(payload)
        if version == WIRE_VERSION and kind in (KIND_PLAIN, KIND_OBJECT, KIND_OBJECT_FLAT):
            return kind, to_uid
    raise _header_error(payload)


def _header_error(payload: bytes) -> FrameDecodeError:
    if len(payload) < HEADER_SIZE:
        return FrameDecodeError(f"frame of {len(payload)} bytes is shorter than the header")
    version, kind, _ = HEADER.unpack_from(payload)
    if version != WIRE_VERSION:
        return FrameDecodeError(f"wire version {version} is not supported (this node speaks 1)")
    return FrameDecodeError(f"unknown frame kind {kind}")


def decode(payload: bytes) -> Decoded:
    """Decode a frame payload made by :func:`encode`.

    Raises:
        FrameDecodeError: the header is bad (close the link).
        MessageDecodeError: the body is not a message this node can build (drop the message).
    """
    to_uid, message = decode_parts(payload)
    return Decoded(to_uid, message)


def decode_parts(payload: bytes) -> tuple[int, object]:
    """:func:`decode` as a plain ``(to_uid, message)`` tuple, cheaper to make: the receive path.

    Raises:
        FrameDecodeError: as :func:`decode`.
        MessageDecodeError: as :func:`decode`.
    """
    # decode_header inlined, with version and kind read as one number: once per message.
    try:
        version_kind, to_uid = _unpack_version_kind(payload)
    except struct.error:
        raise _header_error(payload) from None
    if version_kind not in _VERSION_KINDS:
        raise _header_error(payload)
    try:
        value = _unpackb(
            payload[HEADER_SIZE:], raw=False, strict_map_key=False, ext_hook=_top_ext_hook
        )
        if version_kind == _VERSION_PLAIN:
            return to_uid, value
        if type(value) is not list or not value:
            raise _not_an_object()
        if version_kind == _VERSION_FLAT:
            # The objects sent flat, built in place (as in ext_hook): once per message.
            mask = value.pop()
            positions = _SMALL_MASKS.get(mask) if type(mask) is int else None
            for i in positions or _flat_positions(mask):
                inner = value[i]
                if type(inner) is not list:
                    raise _not_an_object()
                spec = _by_name.get(inner[0])
                if spec is None:
                    raise _unknown_type(inner[0])
                value[i] = spec.build(inner)
        # Building the object inlined (as in ext_hook): once per message.
        spec = _by_name.get(value[0])
        if spec is None:
            raise _unknown_type(value[0])
        value = spec.build(value)
    except MessageDecodeError:
        raise
    except Exception as exc:
        # msgpack raises a handful of unrelated types for malformed input (ValueError,
        # ExtraData, StackError, FormatError, TypeError for unhashable keys, ...): all mean the
        # same thing here. Constructors of registered classes may raise anything on bad fields.
        raise MessageDecodeError(f"undecodable message body: {type(exc).__name__}: {exc}") from None
    return to_uid, value


def _flat_positions(mask: object) -> tuple[int, ...]:
    """The body positions whose field was sent flat, from the mask ending a flat body.

    Bit ``i`` marks position ``i``: a field, never the wire name at 0. A position past the end
    of the body fails when it is read.
    """
    if type(mask) is not int or mask <= 0 or mask & 1:
        raise MessageDecodeError(f"flat object body ends with {mask!r}, not a field mask")
    return tuple(i for i in range(1, mask.bit_length()) if mask >> i & 1)


_SMALL_MASKS: Final[dict[int, tuple[int, ...]]] = {}
"""What :func:`_flat_positions` gives for the masks of bodies with up to 7 fields: looked up
first, once per message."""
_SMALL_MASKS.update((mask, _flat_positions(mask)) for mask in range(2, 256, 2))


def _not_an_object() -> MessageDecodeError:
    return MessageDecodeError("object body is not [wire_name, *fields]")


def _unknown_type(name: str) -> MessageDecodeError:
    return MessageDecodeError(f"unknown message type {name!r}: not registered on this node")


ExtHook = Callable[[int, bytes], object]


def _ext_hook_at(inside: ExtHook) -> ExtHook:
    """The ``ext_hook`` for one level of extensions; ``inside`` reads those nested in them."""

    def ext_hook(code: int, data: bytes) -> object:
        inner = _unpackb(data, raw=False, strict_map_key=False, ext_hook=inside)
        if code in (EXT_OBJECT, EXT_ENUM):
            # Building the object inlined: once per nested object, such as every entity message.
            if not isinstance(inner, list) or not inner or not isinstance(inner[0], str):
                raise _not_an_object()
            spec = _by_name.get(inner[0])
            if spec is None:
                raise _unknown_type(inner[0])
            return spec.build(inner)
        if not isinstance(inner, list):
            raise MessageDecodeError(f"extension {code} does not hold a list")
        if code == EXT_TUPLE:
            return tuple(inner)
        if code == EXT_FROZENSET:
            return frozenset(inner)
        if code == EXT_SET:
            return set(inner)
        raise MessageDecodeError(f"unknown extension type {code}")

    return ext_hook


def _too_deep(code: int, data: bytes) -> object:
    raise MessageDecodeError(
        f"tuples, sets or objects nested more than {MAX_NESTING} deep in a message"
    )


def _ext_hooks() -> ExtHook:
    # One closure per depth, made once and chained, innermost first: the depth is known without
    # an argument, and no functools.partial is made or called per value.
    hook: ExtHook = _too_deep  # what an extension MAX_NESTING + 1 levels deep meets
    for _ in range(MAX_NESTING):
        hook = _ext_hook_at(hook)
    return hook


_top_ext_hook: Final = _ext_hooks()
"""Reads the extensions of a top-level value (depth 1)."""


# --- one value on its own, for storage (the journal of event-sourced entities) ------------------

VALUE_VERSION: Final = 1
"""The first byte of :func:`encode_value`'s output: the format of stored values."""


def encode_value(value: object) -> bytes:
    """Encode one value without a frame header: a version byte, then msgpack.

    For values kept outside a frame, such as the events and snapshots of event-sourced entities.
    The rules are those of messages: registered classes, registered enums and plain msgpack
    types, tuples and sets included; no pickle.

    Example:
        >>> decode_value(encode_value((1, "a", frozenset({2}))))
        (1, 'a', frozenset({2}))

    Raises:
        SerializationError: the value, or one inside it, is not serializable; the error names
            the type.
    """
    try:
        body: bytes = _local.packer.pack(value)
    except (SerializationError, TypeError, ValueError, OverflowError) as exc:
        _local.packer = _new_packer()  # see _encode_body
        cls = type(value)
        raise SerializationError(
            f"cannot encode a value of type {cls.__module__}.{cls.__qualname__}: {exc}"
        ) from _cause(exc)
    return bytes((VALUE_VERSION,)) + body


def decode_value(data: bytes) -> object:
    """Decode what :func:`encode_value` made.

    Raises:
        MessageDecodeError: an unknown version, malformed msgpack, or a registered type this
            process does not know (not imported, or renamed without ``@message(name=...)``).
    """
    if not data or data[0] != VALUE_VERSION:
        version = data[0] if data else None
        raise MessageDecodeError(
            f"stored value has format version {version}; this process reads {VALUE_VERSION}"
        )
    try:
        return _unpackb(data[1:], raw=False, strict_map_key=False, ext_hook=_top_ext_hook)
    except MessageDecodeError:
        raise
    except Exception as exc:  # as in decode_parts: msgpack and constructors raise many types
        raise MessageDecodeError(f"undecodable value: {type(exc).__name__}: {exc}") from None
