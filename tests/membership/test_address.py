"""Node addresses: parsing, printing, ordering, validation and the wire."""

from __future__ import annotations

import re

import pytest

from membership import Address, ConfigurationError, UniqueAddress
from membership.transport._address import MAX_UID
from membership.transport._wire import decode, encode

HOST_PORT = "address {} is invalid: expected 'host:port'"


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:25520", "127.0.0.1", 25520),
        ("node-1.example.com:2551", "node-1.example.com", 2551),
        ("localhost:0", "localhost", 0),
        ("[::1]:25520", "::1", 25520),
        ("[fe80::1%eth0]:65535", "fe80::1%eth0", 65535),
    ],
)
def test_parse_reads_host_and_port(text: str, host: str, port: int) -> None:
    address = Address.parse(text)
    assert address == Address(host, port)
    assert str(address) == text


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("127.0.0.1", HOST_PORT),
        ("host:", HOST_PORT),
        (":25520", HOST_PORT),
        ("[]:25520", HOST_PORT),
        ("host:port", HOST_PORT),
        ("host:-1", HOST_PORT),
        ("host:+1", HOST_PORT),
        ("host:\u00b2", HOST_PORT),  # superscript two: str.isdigit() says yes
        ("host:\u0663", HOST_PORT),  # Arabic-Indic three
        ("host:65536", "port 65536 is invalid"),
        ("two words:1", "host 'two words' is invalid"),
    ],
)
def test_parse_refuses_a_bad_address_naming_it(text: str, error: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(error.format(repr(text)))):
        Address.parse(text)


def test_parse_refuses_a_non_string() -> None:
    with pytest.raises(ConfigurationError, match="address 25520 is invalid"):
        Address.parse(25520)  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 65536, True, 1.5])
def test_an_address_refuses_a_bad_port(port: object) -> None:
    with pytest.raises(ConfigurationError, match=f"port {port!r} is invalid"):
        Address("host", port)  # type: ignore[arg-type]


def test_addresses_order_by_host_then_port() -> None:
    addresses = [Address("b", 1), Address("a", 2), Address("a", 10), Address("a", 1)]
    assert sorted(addresses) == [
        Address("a", 1),
        Address("a", 2),
        Address("a", 10),
        Address("b", 1),
    ]


def test_unique_addresses_order_by_address_then_uid_ignoring_the_name() -> None:
    first = UniqueAddress(Address("a", 1), "z", 5)
    second = UniqueAddress(Address("a", 1), "a", 6)
    third = UniqueAddress(Address("a", 2), "a", 1)
    assert sorted([third, second, first]) == [first, second, third]


@pytest.mark.parametrize("uid", [0, -1, MAX_UID + 1, True])
def test_a_unique_address_refuses_a_bad_uid(uid: int) -> None:
    with pytest.raises(ConfigurationError, match=f"uid {uid!r} is invalid"):
        UniqueAddress(Address("a", 1), "node", uid)


@pytest.mark.parametrize("name", ["", "bad name", "a/b", "x" * 64])
def test_a_unique_address_refuses_a_bad_name(name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"node name {name!r} is invalid"):
        UniqueAddress(Address("a", 1), name, 1)


def test_a_unique_address_prints_name_address_and_hex_uid() -> None:
    assert str(UniqueAddress(Address("::1", 2551), "n", 255)) == "n@[::1]:2551#ff"


@pytest.mark.parametrize(
    "value",
    [
        Address("127.0.0.1", 25520),
        Address("::1", 0),
        UniqueAddress(Address("10.0.0.1", 2551), "node-1", 1),
        UniqueAddress(Address("h", 65535), "n", MAX_UID),
    ],
    ids=str,
)
def test_addresses_travel_over_the_wire_unchanged(value: object) -> None:
    assert decode(encode(value)).message == value
    assert decode(encode([value, (value,)])).message == [value, (value,)]
