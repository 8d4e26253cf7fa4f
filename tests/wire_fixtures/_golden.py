"""What the golden wire fixtures hold, and the rules a newer node's code must keep to read them.

Fields of registered classes travel by position (see the wire module's docstring), so a node can
read a message of another version exactly when the fields they share sit at the same positions
with the same types, and every field one side lacks has a default on the other. A *schema* is that
shape, per wire name: the ordered fields (name, annotation text, has a default) of an attrs class,
or the values of an enum. Comparing the schema committed with an older set against the current
classes tells whether the older code could read what this code sends, and this code what the older
sent, without running the older code: :func:`compare_schemas`.

A *set* is, per protocol version, the frames this code's samples encode to (``frames.json``) and
the schema (``schema.json``). :func:`check_frame` decodes one recorded frame and compares the
object field by field with what was recorded (its *value*, a JSON picture of the object): a field
added since then must hold its default, as it does when an older node sends the message.
"""

from __future__ import annotations

import enum
import importlib
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeAlias, cast

import attrs

from membership.internal import CURRENT_PROTOCOL, wire

FIXTURES: Final = Path(__file__).resolve().parent
"""Where the sets live: ``v<version>/frames.json`` and ``v<version>/schema.json``."""

PACKAGES: Final = ("membership", "crdt", "p2pshard")
"""A registered class defined in one of these is an internal message type."""

MODULES: Final = (
    "membership",
    "crdt",
    "p2pshard",
    "p2pshard.sharding",
    "p2pshard.persistence",
    "p2pshard.testing",
)
"""Importing these registers every internal message type."""

REGENERATE: Final = "python -m tests.wire_fixtures.regenerate"
RULE: Final = "a field may only be added last with a default"
PLAIN: Final = "(plain msgpack)"
"""The key of frames holding plain msgpack values (kind PLAIN) rather than a registered type."""

KIND_NAMES: Final = {
    wire.KIND_PLAIN: "plain",
    wire.KIND_OBJECT: "object",
    wire.KIND_OBJECT_FLAT: "flat",
}

Json: TypeAlias = Any
"""A value as :func:`json.loads` gives it."""
Schema: TypeAlias = dict[str, dict[str, Any]]
"""Wire name -> ``{"fields": [[name, annotation, has_default], ...]}`` or ``{"enum": [values]}``."""


def current_version() -> int:
    """The protocol version this code speaks, at most: the only set regeneration writes."""
    return CURRENT_PROTOCOL.high


def set_label(version: int) -> str:
    """The directory name (and the name in messages) of a version's set: ``v1``."""
    return f"v{version}"


def committed_versions(root: Path = FIXTURES) -> list[int]:
    """The versions with a committed set under ``root``, oldest first."""
    found = (re.fullmatch(r"v([1-9][0-9]*)", p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m is not None)


def import_packages() -> None:
    """Import every module that registers internal message types."""
    for name in MODULES:
        importlib.import_module(name)


def internal_wire_names() -> list[str]:
    """The wire name of every registered class defined in the packages (not in tests)."""
    import_packages()
    return sorted(
        name
        for name, spec in wire._by_name.items()
        if spec.cls.__module__.split(".")[0] in PACKAGES
    )


def registered_class(name: str) -> type:
    """The class registered under wire name ``name``.

    Raises:
        KeyError: nothing is registered under that name.
    """
    return wire._by_name[name].cls


def _fields(cls: type) -> tuple[attrs.Attribute[Any], ...]:
    return tuple(attrs.fields(cast(Any, cls)))


# --- schemas ----------------------------------------------------------------------------------


def annotation_text(annotation: object, module: str | None = None) -> str:
    """An annotation as the wire sees it: as written, with registered classes by wire name.

    Annotations are text under postponed evaluation. Each name in it that ``module`` binds to a
    registered class becomes that class's wire name, and a ``NewType`` becomes what it wraps,
    so that renaming or moving a class, or naming ``str`` ``ShardId``, changes nothing here,
    while a field retyped to another class does.
    """
    if annotation is None:
        return "(none)"
    if isinstance(annotation, type):
        return _type_name(annotation)
    text = " ".join(str(annotation).replace("typing.", "").split())
    namespace = vars(sys.modules[module]) if module in sys.modules else {}
    return _NAME.sub(lambda m: _resolve(m.group(0), namespace), text)


_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _resolve(name: str, namespace: Mapping[str, object]) -> str:
    value = namespace.get(name)
    while value is not None and hasattr(value, "__supertype__"):  # a NewType: what it wraps
        value = value.__supertype__
    if isinstance(value, type) and (value in wire._by_class or value.__module__ == "builtins"):
        return _type_name(value)
    return name


def _type_name(cls: type) -> str:
    spec = wire._by_class.get(cls)
    return spec.name if spec is not None else cls.__qualname__


def schema_of(cls: type) -> dict[str, Any]:
    """The schema entry of one registered class (see :data:`Schema`)."""
    if issubclass(cls, enum.Enum):
        return {"enum": [member.value for member in cls]}
    return {
        "fields": [
            [f.name, annotation_text(f.type, cls.__module__), f.default is not attrs.NOTHING]
            for f in _fields(cls)
        ]
    }


def live_schema(names: list[str]) -> Schema:
    """The schema of the current code for the wire names ``names``."""
    return {name: schema_of(registered_class(name)) for name in sorted(names)}


def compare_schemas(old: Schema, new: Schema) -> list[str]:
    """Why code with schema ``new`` and code with schema ``old`` cannot read each other's messages.

    Empty when compatible: every wire name of ``old`` is still there, as the same kind of type;
    every field of ``old`` is at the same position with the same annotation, and keeps its
    default if it had one; fields of ``new`` not in ``old`` come after them, with defaults; every
    enum value of ``old`` is still a value. Each problem names the message and the field.
    """
    problems: list[str] = []
    for name, before in old.items():
        after = new.get(name)
        if after is None:
            problems.append(
                f"{name}: no longer registered; a message type may only be added (keep the "
                "class, or keep its wire name with @message(name=...))"
            )
        elif "enum" in before:
            if "enum" not in after:
                problems.append(f"{name}: was an enum, is now a class; a wire name keeps its kind")
                continue
            problems += [
                f"{name}: enum value {value!r} removed or changed; an enum may only gain values"
                for value in before["enum"]
                if value not in after["enum"]
            ]
        elif "fields" not in after:
            problems.append(f"{name}: was a class, is now an enum; a wire name keeps its kind")
        else:
            problems += _field_problems(name, before["fields"], after["fields"])
    return problems


def _field_problems(name: str, old: list[list[Any]], new: list[list[Any]]) -> list[str]:
    problems: list[str] = []
    old_at = {field[0]: i for i, field in enumerate(old)}
    new_at = {field[0]: i for i, field in enumerate(new)}
    explained: set[str] = set()
    for i, (field, annotation, had_default) in enumerate(old):
        where = f"{name}.{field}"
        j = new_at.get(field)
        if j is None:
            successor = new[i][0] if i < len(new) and new[i][0] not in old_at else None
            if successor is None:
                problems.append(f"{where}: removed; {RULE}")
            else:
                explained.add(successor)
                problems.append(f"{where}: renamed to {successor} or removed; {RULE}")
            continue
        _, now_annotation, has_default = new[j]
        if j != i:
            problems.append(
                f"{where}: moved from position {i + 1} to {j + 1} (fields travel by "
                f"position); {RULE}"
            )
        if _normal(now_annotation) != _normal(annotation):
            problems.append(f"{where}: type changed from {annotation} to {now_annotation}; {RULE}")
        if had_default and not has_default:
            problems.append(
                f"{where}: lost its default, so a message from a node older than the field no "
                "longer decodes; a field keeps its default"
            )
    for j, (field, _, has_default) in enumerate(new):
        if field in old_at or field in explained:
            continue
        where = f"{name}.{field}"
        if j < len(old):
            problems.append(f"{where}: new field at position {j + 1}, before older ones; {RULE}")
        elif not has_default:
            problems.append(
                f"{where}: new field without a default (an older node's message lacks it); {RULE}"
            )
    return problems


def _normal(annotation: str) -> str:
    return "".join(annotation.split())


# --- values: a JSON picture of a decoded object -----------------------------------------------


def describe(value: object) -> Json:
    """A JSON picture of ``value`` that tells apart everything the wire tells apart.

    Registered objects become ``{"object": wire name, "fields": {...}}`` (in field order), enum
    members ``{"enum": wire name, "value": ...}``, and tuples, frozensets, sets, dicts and bytes
    tagged objects of their own; sets are sorted so that the picture does not depend on the
    process's hash seed.

    Raises:
        TypeError: a value the wire cannot carry.
    """
    cls = type(value)
    if value is None or cls in (bool, int, float, str):
        return value
    spec = wire._by_class.get(cls)
    if spec is not None:
        if isinstance(value, enum.Enum):
            return {"enum": spec.name, "value": value.value}
        return {
            "object": spec.name,
            "fields": {f.name: describe(getattr(value, f.name)) for f in _fields(cls)},
        }
    if cls is bytes:
        assert isinstance(value, bytes)
        return {"bytes": value.hex()}
    if cls is list:
        assert isinstance(value, list)
        return [describe(item) for item in value]
    if cls is tuple:
        assert isinstance(value, tuple)
        return {"tuple": [describe(item) for item in value]}
    if cls in (frozenset, set):
        assert isinstance(value, (frozenset, set))
        items = sorted((describe(item) for item in value), key=_sort_key)
        return {cls.__name__: items}
    if cls is dict:
        assert isinstance(value, dict)
        return {"dict": [[describe(k), describe(v)] for k, v in value.items()]}
    raise TypeError(f"a {cls.__module__}.{cls.__qualname__} cannot travel on the wire")


def _sort_key(picture: Json) -> str:
    return json.dumps(picture, sort_keys=True)


def _same_scalar(recorded: Json, value: object) -> bool:
    return type(recorded) is type(value) and recorded == value


def match(recorded: Json, value: object, path: str) -> list[str]:
    """How ``value`` (just decoded) differs from the picture ``recorded`` when it was encoded.

    A field of a registered class that the picture lacks (added after the set was recorded)
    must hold its default, as it does when an older node sends the message.
    """
    if isinstance(recorded, dict) and "object" in recorded:
        spec = wire._by_class.get(type(value))
        if spec is None or spec.name != recorded["object"]:
            return [f"{path}: recorded a {recorded['object']}, decoded {value!r}"]
        return _match_fields(recorded["fields"], value, path)
    if isinstance(recorded, dict) and len(recorded) == 1:
        ((tag, items),) = recorded.items()
        if tag in ("tuple", "frozenset", "set", "dict") and type(value).__name__ == tag:
            return _match_container(tag, items, value, path)
    if isinstance(recorded, list) and type(value) is list:
        if len(recorded) != len(value):
            return [f"{path}: recorded {len(recorded)} items, decoded {len(value)}"]
        return [p for i, item in enumerate(recorded) for p in match(item, value[i], f"{path}[{i}]")]
    try:
        picture = describe(value)
    except TypeError as exc:
        return [f"{path}: {exc}"]
    if isinstance(recorded, dict | list) or isinstance(picture, dict | list):
        same = picture == recorded
    else:
        same = _same_scalar(recorded, value)
    if same:
        return []
    return [f"{path}: recorded {json.dumps(recorded)}, decoded {json.dumps(picture)}"]


def _match_fields(recorded: Mapping[str, Json], value: object, path: str) -> list[str]:
    problems: list[str] = []
    fields = _fields(type(value))
    for f in fields:
        where = f"{path}.{f.name}"
        got = getattr(value, f.name)
        if f.name in recorded:
            problems += match(recorded[f.name], got, where)
            continue
        # Added after the set was recorded: the frame did not carry it.
        if f.default is attrs.NOTHING:
            problems.append(f"{where}: not in the recorded frame, and has no default")
            continue
        default = f.default
        factory = getattr(default, "factory", None)  # an attrs Factory: what it makes
        if factory is not None:
            default = factory()
        if describe(got) != describe(default):
            problems.append(
                f"{where}: not in the recorded frame, so it should hold its default "
                f"{default!r}; decoded {got!r}"
            )
    known = {f.name for f in fields}
    problems += [
        f"{path}.{name}: recorded, but {type(value).__qualname__} has no such field"
        for name in recorded
        if name not in known
    ]
    return problems


def _match_container(tag: str, items: Json, value: Any, path: str) -> list[str]:
    if len(items) != len(value):
        return [f"{path}: recorded {len(items)} items, decoded {len(value)}"]
    if tag == "tuple":
        return [p for i, item in enumerate(items) for p in match(item, value[i], f"{path}[{i}]")]
    if tag == "dict":
        problems = []
        for i, ((key, item), (got_key, got)) in enumerate(zip(items, value.items(), strict=True)):
            problems += match(key, got_key, f"{path} key {i}")
            problems += match(item, got, f"{path}[{got_key!r}]")
        return problems
    # A set: each recorded item must match one decoded item.
    left = list(value)
    for item in items:
        found = next((got for got in left if not match(item, got, path)), None)
        if found is None:
            return [f"{path}: recorded item {json.dumps(item)} is not among {value!r}"]
        left.remove(found)
    return []


# --- frames -----------------------------------------------------------------------------------


def check_frame(label: str, name: str, index: int, frame: Mapping[str, Json]) -> list[str]:
    """Why recorded frame ``index`` of ``name`` in set ``label`` does not decode as recorded."""
    where = f"{label} {name} #{index}"
    try:
        to_uid, message = wire.decode_parts(bytes.fromhex(frame["hex"]))
    except Exception as exc:  # any failure to decode is the finding, whatever its type
        return [f"{where}: does not decode: {type(exc).__name__}: {exc}"]
    problems = []
    if to_uid != frame["to_uid"]:
        problems.append(f"{where}: to_uid {to_uid}, recorded {frame['to_uid']}")
    problems += [f"{where}: {p}" for p in match(frame["value"], message, "message")]
    return problems


def iter_frames(
    frames: Mapping[str, Sequence[Mapping[str, Json]]],
) -> Iterator[tuple[str, int, Mapping[str, Json]]]:
    """Every ``(wire name, index, frame)`` of a set's frames, in file order."""
    for name, recorded in frames.items():
        for index, frame in enumerate(recorded):
            yield name, index, frame


# --- files ------------------------------------------------------------------------------------


@attrs.frozen
class GoldenSet:
    """One committed set: its protocol version, frames by wire name, and schema."""

    version: int
    frames: dict[str, list[dict[str, Json]]]
    schema: Schema

    @property
    def label(self) -> str:
        """``v<version>``."""
        return set_label(self.version)


def load_set(version: int, root: Path = FIXTURES) -> GoldenSet:
    """Read the set of ``version`` under ``root``."""
    directory = root / set_label(version)
    frames = json.loads((directory / "frames.json").read_text())
    schema = json.loads((directory / "schema.json").read_text())
    return GoldenSet(version=version, frames=frames["frames"], schema=schema["messages"])


def write_set(golden: GoldenSet, root: Path = FIXTURES) -> Path:
    """Write ``golden`` under ``root``; returns its directory."""
    directory = root / golden.label
    directory.mkdir(parents=True, exist_ok=True)
    note = f"Written by {REGENERATE}; never edit by hand, never rewrite an older version's set."
    frames = {"version": golden.version, "note": note, "frames": golden.frames}
    schema = {"version": golden.version, "note": note, "messages": golden.schema}
    # frames: one line per frame attribute; schema: one line per field or enum
    (directory / "frames.json").write_text(dumps(frames, expand=4) + "\n")
    (directory / "schema.json").write_text(dumps(schema, expand=4) + "\n")
    return directory


def dumps(value: Json, expand: int, indent: str = "") -> str:
    """JSON with dicts and lists on several lines down to depth ``expand``, on one line below."""
    if expand <= 0 or not isinstance(value, dict | list) or not value:
        return json.dumps(value, ensure_ascii=False)
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, expand - 1, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    lines = [f"{inner}{dumps(v, expand - 1, inner)}" for v in value]
    return "[\n" + ",\n".join(lines) + f"\n{indent}]"
