"""Golden wire fixtures: the current code reads every committed set, and older nodes could read it.

The sets live in ``tests/wire_fixtures/v<protocol version>/`` (see that package's docstring, and
"Golden wire fixtures" in docs/testing.md). Two directions are checked:

- newer reads older: every committed frame decodes with the current code into what was recorded
  (a field added since holds its default);
- older reads newer: every committed schema is compatible with the current classes (same fields
  at the same positions with the same annotations, new fields last with defaults, enum values and
  wire names kept), which is what the older code needs, without running it.
"""

from __future__ import annotations

import copy
import sys
import types
from pathlib import Path
from typing import NewType

import pytest

from membership.internal import wire
from tests.wire_fixtures import _golden, regenerate
from tests.wire_fixtures._golden import RULE, GoldenSet, compare_schemas, load_set, registered_class
from tests.wire_fixtures._samples import Increment

_golden.import_packages()  # as a node does: every internal type registered before frames arrive
VERSIONS = _golden.committed_versions()
CURRENT = _golden.current_version()
MOVED = "(fields travel by position)"
HOW = f"run {_golden.REGENERATE} (see 'Golden wire fixtures' in docs/testing.md)"


@pytest.fixture(scope="module")
def sets() -> dict[int, GoldenSet]:
    return {version: load_set(version) for version in VERSIONS}


def test_there_is_a_set_for_every_version_up_to_the_current_one() -> None:
    assert VERSIONS, "no committed set under tests/wire_fixtures"
    assert CURRENT in VERSIONS, f"no golden set of protocol version {CURRENT}: {HOW}"
    assert max(VERSIONS) == CURRENT, f"sets newer than protocol version {CURRENT}: {VERSIONS}"


@pytest.mark.parametrize("version", VERSIONS, ids=_golden.set_label)
def test_every_committed_frame_decodes_as_recorded(
    sets: dict[int, GoldenSet], version: int
) -> None:
    golden = sets[version]
    problems = [
        problem
        for name, index, frame in _golden.iter_frames(golden.frames)
        for problem in _golden.check_frame(golden.label, name, index, frame)
    ]
    assert not problems, (
        f"the current code does not read frames of golden set {golden.label} as they were "
        "recorded:\n  " + "\n  ".join(problems)
    )


@pytest.mark.parametrize("version", VERSIONS, ids=_golden.set_label)
def test_every_committed_schema_is_compatible_with_the_current_classes(
    sets: dict[int, GoldenSet], version: int
) -> None:
    golden = sets[version]
    live = _golden.live_schema([n for n in golden.schema if n in wire._by_name])
    problems = compare_schemas(golden.schema, live)
    assert not problems, (
        f"nodes speaking golden set {golden.label} could not exchange messages with this code "
        f"(tests/wire_fixtures/{golden.label}/schema.json):\n  " + "\n  ".join(problems)
    )


def test_the_current_set_has_every_internal_message_type(sets: dict[int, GoldenSet]) -> None:
    golden = sets[CURRENT]
    missing = [name for name in _golden.internal_wire_names() if name not in golden.frames]
    assert not missing, (
        f"no golden frame of {', '.join(missing)} in {golden.label}: add a representative "
        f"instance to samples() in tests/wire_fixtures/_samples.py, then {HOW}"
    )


def test_the_current_set_matches_the_current_classes(sets: dict[int, GoldenSet]) -> None:
    # Compatible changes (a field added last, an enum value added): the current set must record
    # the current shape. Incompatible ones fail the test above, and regenerating refuses them.
    golden = sets[CURRENT]
    live = _golden.live_schema([n for n in golden.schema if n in wire._by_name])
    stale = sorted(
        name
        for name in live
        if live[name] != golden.schema[name]
        and not compare_schemas({name: golden.schema[name]}, {name: live[name]})
    )
    assert not stale, f"{', '.join(stale)} changed since {golden.label} was written: {HOW}"


def test_the_current_set_covers_every_frame_kind_and_a_user_class(
    sets: dict[int, GoldenSet],
) -> None:
    golden = sets[CURRENT]
    kinds = {frame["kind"] for _, _, frame in _golden.iter_frames(golden.frames)}
    assert kinds == {"plain", "object", "flat"}
    user = wire.wire_name(Increment)
    assert user in golden.frames
    # The commonest frame: a user's message sent flat inside an EntityDelivery.
    deliveries = golden.frames["p2pshard.sharding.EntityDelivery"]
    assert any(
        frame["kind"] == "flat" and frame["value"]["fields"]["message"].get("object") == user
        for frame in deliveries
    )


# --- the checks can fail: each incompatible change is named --------------------------------


def _schema(sets: dict[int, GoldenSet]) -> _golden.Schema:
    return copy.deepcopy(sets[CURRENT].schema)


SHARD_HOME = "p2pshard.sharding.ShardHome"
UNIQUE = "p2pshard.UniqueAddress"  # annotations name registered classes by wire name


def test_a_retyped_field_is_named(sets: dict[int, GoldenSet]) -> None:
    old = _schema(sets)
    new = _schema(sets)
    new[SHARD_HOME]["fields"][2][1] = "str"
    assert compare_schemas(old, new) == [
        f"{SHARD_HOME}.region: type changed from p2pshard.UniqueAddress to str; {RULE}"
    ]


@pytest.mark.parametrize(
    ("new_fields", "expected"),
    [
        pytest.param(
            [["type_name", "str", False], ["shard", "str", False]],
            [f"{SHARD_HOME}.region: removed; {RULE}"],
            id="removed",
        ),
        pytest.param(
            [
                ["type_name", "str", False],
                ["shard", "str", False],
                ["home", UNIQUE, False],
            ],
            [f"{SHARD_HOME}.region: renamed to home or removed; {RULE}"],
            id="renamed",
        ),
        pytest.param(
            [
                ["type_name", "str", False],
                ["region", UNIQUE, False],
                ["shard", "str", False],
            ],
            [
                f"{SHARD_HOME}.shard: moved from position 2 to 3 {MOVED}; {RULE}",
                f"{SHARD_HOME}.region: moved from position 3 to 2 {MOVED}; {RULE}",
            ],
            id="moved",
        ),
        pytest.param(
            [
                ["type_name", "str", False],
                ["shard", "str", False],
                ["region", UNIQUE, False],
                ["zone", "str", False],
            ],
            [
                f"{SHARD_HOME}.zone: new field without a default (an older node's message lacks "
                f"it); {RULE}"
            ],
            id="added-without-default",
        ),
        pytest.param(
            [
                ["type_name", "str", False],
                ["zone", "str", True],
                ["shard", "str", False],
                ["region", UNIQUE, False],
            ],
            [
                f"{SHARD_HOME}.shard: moved from position 2 to 3 {MOVED}; {RULE}",
                f"{SHARD_HOME}.region: moved from position 3 to 4 {MOVED}; {RULE}",
                f"{SHARD_HOME}.zone: new field at position 2, before older ones; {RULE}",
            ],
            id="inserted",
        ),
        pytest.param(
            [
                ["type_name", "str", False],
                ["shard", "str", False],
                ["region", UNIQUE, False],
                ["zone", "str", True],
            ],
            [],
            id="added-last-with-default",
        ),
    ],
)
def test_field_changes(
    sets: dict[int, GoldenSet], new_fields: list[list[object]], expected: list[str]
) -> None:
    old = _schema(sets)
    new = _schema(sets)
    new[SHARD_HOME]["fields"] = new_fields
    assert compare_schemas(old, new) == expected


def test_annotations_name_registered_classes_by_wire_name_and_newtypes_by_what_they_wrap() -> None:
    # A class renamed or moved keeps its wire name, and a NewType of str travels as a str: neither
    # is a retype. The names resolve in the namespace of the module defining the message class.
    module = types.ModuleType("golden_annotations")
    shard_id = NewType("shard_id", str)
    module.__dict__.update(Home=registered_class(UNIQUE), ShardId=shard_id, Other=Path)
    sys.modules[module.__name__] = module
    try:
        text = _golden.annotation_text("tuple[Home | None, ShardId,  Other]", module.__name__)
    finally:
        del sys.modules[module.__name__]
    assert text == f"tuple[{UNIQUE} | None, str, Other]"


def test_a_field_that_loses_its_default_is_named(sets: dict[int, GoldenSet]) -> None:
    old = _schema(sets)
    new = _schema(sets)
    name = "p2pshard.sharding.BeginHandOff"
    assert new[name]["fields"][2] == ["handoff_id", "int", True]
    new[name]["fields"][2][2] = False
    (problem,) = compare_schemas(old, new)
    assert problem.startswith(f"{name}.handoff_id: lost its default")


def test_enum_and_type_changes_are_named(sets: dict[int, GoldenSet]) -> None:
    old = _schema(sets)
    new = _schema(sets)
    new["p2pshard.MemberStatus"]["enum"].remove("weakly_up")
    new["p2pshard.ReachabilityStatus"]["enum"].append("suspect")  # a value may be added
    del new["p2pshard.sharding.HostShard"]
    new["p2pshard.sharding.NewMessage"] = {"fields": []}  # a type may be added
    assert compare_schemas(old, new) == [
        "p2pshard.MemberStatus: enum value 'weakly_up' removed or changed; an enum may only gain "
        "values",
        "p2pshard.sharding.HostShard: no longer registered; a message type may only be added "
        "(keep the class, or keep its wire name with @message(name=...))",
    ]


def test_a_frame_that_decodes_differently_is_named() -> None:
    name = "golden.counter.Increment"
    frame = regenerate.frame_of(Increment(delta=3))
    assert _golden.check_frame("v1", name, 0, frame) == []
    frame["value"]["fields"]["delta"] = 4
    assert _golden.check_frame("v1", name, 0, frame) == [
        f"v1 {name} #0: message.delta: recorded 4, decoded 3"
    ]
    frame["value"]["fields"]["delta"] = 3.0  # the same number, but not what the wire carried
    assert _golden.check_frame("v1", name, 0, frame) == [
        f"v1 {name} #0: message.delta: recorded 3.0, decoded 3"
    ]
    frame["hex"] = frame["hex"][:-4]
    (problem,) = _golden.check_frame("v1", name, 0, frame)
    assert problem.startswith(f"v1 {name} #0: does not decode: MessageDecodeError")


def test_a_field_added_since_a_frame_was_recorded_must_hold_its_default() -> None:
    # As if the set had been recorded before Increment gained ``note``: the frame lacks it, so
    # the decoded field must hold its default.
    increment = Increment(delta=3, note="set")
    recorded = _golden.describe(increment)
    del recorded["fields"]["note"]
    assert _golden.match(recorded, increment, "message") == [
        "message.note: not in the recorded frame, so it should hold its default ''; decoded 'set'"
    ]
    assert _golden.match(recorded, Increment(delta=3), "message") == []
    del recorded["fields"]["delta"]  # no default: an older frame could not have lacked it
    assert _golden.match(recorded, increment, "message")[0] == (
        "message.delta: not in the recorded frame, and has no default"
    )


# --- regeneration ----------------------------------------------------------------------------


def test_regeneration_refuses_an_older_version() -> None:
    with pytest.raises(regenerate.RegenerateError, match="older protocol version"):
        regenerate.regenerate(CURRENT - 1)


def test_regeneration_refuses_to_hide_an_incompatible_change(tmp_path: Path) -> None:
    live = regenerate.build_set(CURRENT)
    region = live.schema[SHARD_HOME]["fields"][2]
    committed = copy.deepcopy(live.schema)
    committed[SHARD_HOME]["fields"][2][1] = "p2pshard.Address"  # as if the class had said so
    _golden.write_set(GoldenSet(version=CURRENT, frames=live.frames, schema=committed), tmp_path)
    with pytest.raises(regenerate.RegenerateError) as caught:
        regenerate.regenerate(root=tmp_path)
    assert f"{SHARD_HOME}.region: type changed from p2pshard.Address to {region[1]}" in str(
        caught.value
    )
    assert load_set(CURRENT, tmp_path).schema == committed  # not rewritten


def test_regeneration_writes_a_set_that_passes_the_checks(tmp_path: Path) -> None:
    directory = regenerate.regenerate(root=tmp_path)
    written = load_set(CURRENT, directory.parent)
    assert set(_golden.internal_wire_names()) <= written.frames.keys()
    assert written.schema.keys() == written.frames.keys() - {_golden.PLAIN}
    for name, index, frame in _golden.iter_frames(written.frames):
        assert _golden.check_frame(written.label, name, index, frame) == []
