"""Extractors: stable shard ids across processes, even spread, entity ids from envelopes and from
the application's own messages, and the envelope on the wire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from membership import ConfigurationError, MessageDecodeError, UniqueAddress
from membership.transport._address import Address
from membership.transport._wire import HEADER, KIND_OBJECT, WIRE_VERSION, decode, encode, wire_name
from p2pshard.sharding._allocation import EntityId
from p2pshard.sharding._extractor import (
    HashExtractor,
    MessageExtractor,
    ShardingEnvelope,
    stable_shard,
)
from tests._support.examples import examples

IDS = [f"user-{i}" for i in range(100)] + ["", "é", "日本語", "a" * 1000, "0", "None"]


def test_stable_shard_is_the_same_in_another_process_with_another_hash_seed() -> None:
    here = [stable_shard(entity_id, 97) for entity_id in IDS]
    script = (
        "import json, sys\n"
        "from p2pshard.sharding._extractor import stable_shard\n"
        "ids = json.load(sys.stdin)\n"
        "print(json.dumps([stable_shard(i, 97) for i in ids]))\n"
        # Proof that the salt differs: str hashes change with PYTHONHASHSEED.
        "print(hash('user-1'))\n"
    )
    outputs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", script],
            input=json.dumps(IDS),
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=60,
        )
        shards, salted = done.stdout.splitlines()
        assert json.loads(shards) == here
        outputs.append(salted)
    assert outputs[0] != outputs[1], "the two processes did not salt hash() differently"


def test_stable_shard_known_values() -> None:
    # Changing the hash would move every entity on a rolling upgrade: these must never change.
    assert stable_shard("user-42", 100) == "98"
    assert HashExtractor(number_of_shards=100).shard_id(EntityId("user-42")) == "98"
    assert stable_shard("anything", 1) == "0"


def test_stable_shard_spreads_ids_evenly() -> None:
    shards = Counter(stable_shard(f"entity-{i}", 10) for i in range(10_000))
    assert set(shards) == {str(i) for i in range(10)}
    # Chi-square with 9 degrees of freedom: 27.9 at p = 0.001; a good hash stays far below 50.
    chi_square = sum((count - 1000) ** 2 / 1000 for count in shards.values())
    assert chi_square < 50, shards
    assert all(850 <= count <= 1150 for count in shards.values()), shards


def test_stable_shard_spreads_sequential_ids_over_many_shards() -> None:
    # Sequential ids must not cluster: 1,000 shards all used by 20,000 ids.
    shards = Counter(stable_shard(str(i), 1000) for i in range(20_000))
    assert len(shards) == 1000
    assert max(shards.values()) < 50, shards.most_common(3)


@settings(max_examples=examples(200), deadline=None, print_blob=True)
@given(st.text(max_size=50), st.integers(1, 1 << 20))
def test_stable_shard_is_a_canonical_number_below_number_of_shards(
    entity_id: str, number_of_shards: int
) -> None:
    shard = stable_shard(entity_id, number_of_shards)
    assert shard == str(int(shard))
    assert 0 <= int(shard) < number_of_shards
    assert stable_shard(entity_id, number_of_shards) == shard


# --- HashExtractor --------------------------------------------------------------------------


@attrs.frozen
class Order:
    order_id: str
    amount: int


@attrs.frozen
class Ping:
    pass


def order_id_of(message: object) -> EntityId | None:
    return EntityId(message.order_id) if isinstance(message, Order) else None


def test_envelopes_with_the_default_extractor() -> None:
    extractor = HashExtractor(number_of_shards=100)
    envelope = ShardingEnvelope(entity_id="user-42", message=("hi", 1))
    assert extractor.entity_id(envelope) == "user-42"
    assert extractor.entity_message(envelope) == ("hi", 1)
    assert extractor.shard_id(EntityId("user-42")) == stable_shard("user-42", 100)
    # Anything else is not for an entity, and passes through as it is.
    assert extractor.entity_id(Order("o-1", 5)) is None
    assert extractor.entity_id("user-42") is None
    assert extractor.entity_message(Order("o-1", 5)) == Order("o-1", 5)


def test_custom_entity_id_of_reads_application_messages() -> None:
    extractor = HashExtractor(number_of_shards=10, entity_id_of=order_id_of)
    order = Order("o-7", 3)
    assert extractor.entity_id(order) == "o-7"
    assert extractor.entity_message(order) is order
    assert extractor.entity_id(Ping()) is None
    assert extractor.shard_id(EntityId("o-7")) == stable_shard("o-7", 10)


def test_envelopes_do_not_reach_a_custom_entity_id_of() -> None:
    seen: list[object] = []

    def recording(message: object) -> EntityId | None:
        seen.append(message)
        return EntityId("from-custom")

    extractor = HashExtractor(number_of_shards=10, entity_id_of=recording)
    assert extractor.entity_id(ShardingEnvelope(entity_id="e-1", message=Ping())) == "e-1"
    assert seen == []
    assert extractor.entity_id(Ping()) == "from-custom"
    assert seen == [Ping()]


@pytest.mark.parametrize("bad", ["", 42, b"o-1", True, ["o-1"]])
def test_bad_custom_entity_ids_raise_configuration_error_naming_the_message_type(
    bad: object,
) -> None:
    extractor = HashExtractor(number_of_shards=10, entity_id_of=lambda message: bad)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigurationError) as raised:
        extractor.entity_id(Order("o-1", 1))
    assert "Order" in str(raised.value)
    assert repr(bad) in str(raised.value)


def test_envelope_with_empty_entity_id_is_refused() -> None:
    with pytest.raises(ValueError, match="entity ids are non-empty strings"):
        ShardingEnvelope(entity_id="", message="hi")


@pytest.mark.parametrize("number_of_shards", [0, -1, (1 << 20) + 1, 1.5, True, "10", None])
def test_number_of_shards_is_validated(number_of_shards: object) -> None:
    with pytest.raises(ConfigurationError, match=r"number_of_shards = "):
        HashExtractor(number_of_shards=number_of_shards)  # type: ignore[arg-type]


@pytest.mark.parametrize("number_of_shards", [1, 1 << 20])
def test_number_of_shards_bounds_are_accepted(number_of_shards: int) -> None:
    extractor = HashExtractor(number_of_shards=number_of_shards)
    assert 0 <= int(extractor.shard_id(EntityId("x"))) < number_of_shards


def test_hash_extractor_is_a_message_extractor() -> None:
    # The protocol declares number_of_shards read-only, so a frozen attrs class satisfies it
    # (strict mypy checks this assignment).
    extractor: MessageExtractor = HashExtractor(number_of_shards=10)
    assert extractor.number_of_shards == 10
    assert extractor.entity_id(ShardingEnvelope(entity_id="a", message=1)) == "a"


# --- ShardingEnvelope on the wire -----------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "hi",
        None,
        {"amount": 3, "items": ["a", "b"]},
        (1, 2.5, b"\x00"),
        frozenset({"x"}),
        UniqueAddress(Address("10.0.0.1", 2552), "node-1", 7),
        ShardingEnvelope(entity_id="inner", message=[1]),
    ],
)
def test_envelope_round_trips_through_the_wire(content: object) -> None:
    envelope = ShardingEnvelope(entity_id="user-42", message=content)
    decoded = decode(encode(envelope, to_uid=5))
    assert decoded.to_uid == 5
    assert type(decoded.message) is ShardingEnvelope
    assert decoded.message == envelope
    assert type(decoded.message.message) is type(content)


def test_envelope_wire_name_is_fixed() -> None:
    # Peers find the class by this name: renaming it breaks mixed-version clusters.
    assert wire_name(ShardingEnvelope) == "p2pshard.sharding.ShardingEnvelope"


@pytest.mark.parametrize("entity_id", [42, None, b"user-42", ["user-42"]])
def test_envelope_with_non_str_entity_id_is_rejected(entity_id: object) -> None:
    with pytest.raises(TypeError, match="entity_id"):
        ShardingEnvelope(entity_id=entity_id, message="hi")  # type: ignore[arg-type]
    # And a peer cannot make one either: the body is dropped as undecodable.
    forged = HEADER.pack(WIRE_VERSION, KIND_OBJECT, 0) + msgpack.packb(
        ["p2pshard.sharding.ShardingEnvelope", entity_id, "hi"], use_bin_type=True
    )
    with pytest.raises(MessageDecodeError, match="entity_id"):
        decode(forged)
