"""Wire protocol versions: the range each node speaks, the version a link agrees on, and the
refusal of a peer whose range does not meet ours, told on both sides (issue 22)."""

from __future__ import annotations

import enum
import logging

import attrs
import pytest
import trio
import trio.testing

from membership import (
    Address,
    ConfigurationError,
    HandshakeError,
    MessageRegistrationError,
    SimNetwork,
    Transport,
    message,
)
from membership.transport._tcp import open_tcp_transport
from membership.transport._versions import CURRENT_PROTOCOL, ProtocolRange
from tests._support.polling import wait_until

from .conftest import CertSet, Seq

LOCAL = Address("127.0.0.1", 0)


# --- the range, sans-IO ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "theirs", "agreed"),
    [((1, 1), (1, 1), 1), ((1, 3), (2, 5), 3), ((2, 5), (1, 3), 3), ((1, 4), (2, 2), 2)],
)
def test_two_nodes_agree_on_the_newest_version_both_speak(
    ours: tuple[int, int], theirs: tuple[int, int], agreed: int
) -> None:
    assert ProtocolRange(*ours).agree(ProtocolRange(*theirs)) == agreed


def test_ranges_that_do_not_meet_are_refused_naming_both() -> None:
    with pytest.raises(HandshakeError) as caught:
        ProtocolRange(1, 2).agree(ProtocolRange(3, 4))
    text = str(caught.value)
    assert "the peer speaks versions 3-4, this node versions 1-2" in text
    assert "upgrade the older node" in text


@pytest.mark.parametrize(
    ("low", "high", "error"),
    [
        (0, 1, "ProtocolRange.low = 0 is invalid: must be an int from 1 to 255"),
        (1, 256, "ProtocolRange.high = 256 is invalid"),
        (3, 2, "ProtocolRange(3, 2) is invalid: low must not be above high"),
    ],
)
def test_an_invalid_range_is_refused(low: int, high: int, error: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        ProtocolRange(low, high)
    assert error in str(caught.value)


def test_this_release_speaks_version_1() -> None:
    assert ProtocolRange(1, 1) == CURRENT_PROTOCOL
    assert 1 in CURRENT_PROTOCOL
    assert 2 not in CURRENT_PROTOCOL


@message(name="tests.versions.Gossip2", since=2)
@attrs.frozen
class Gossip2:
    """A message type that protocol version 2 added."""

    n: int


def test_since_must_be_a_version_and_only_on_message_classes() -> None:
    for bad in (0, -1, True, "2", 1.5):

        @attrs.frozen
        class Bad:
            n: int

        with pytest.raises(MessageRegistrationError, match=f"since={bad!r}: since is the wire"):
            message(since=bad)(Bad)  # type: ignore[arg-type]

    class Colour(enum.Enum):
        RED = 1

    with pytest.raises(MessageRegistrationError, match="only a message class can need"):
        message(name="tests.versions.Colour", since=2)(Colour)


async def _gate_holds(sender: Transport, newer: Transport, older: Transport) -> None:
    """``sender`` and ``newer`` speak version 2, ``older`` version 1 only."""
    newer_at, older_at = newer.local_address.address, older.local_address.address
    await sender.send(older_at, Gossip2(0))  # no link yet: not sent either
    assert sender.statistics().messages_not_sent_protocol == 1
    for to in (newer_at, older_at):
        await sender.send(to, Seq(1))
    await wait_until(lambda: None not in (sender.peer_protocol(a) for a in (newer_at, older_at)))
    assert (sender.peer_protocol(newer_at), sender.peer_protocol(older_at)) == (2, 1)
    await sender.send(older_at, Gossip2(1))  # never sent: older could not read it
    await sender.send(newer_at, Gossip2(2))
    await sender.send(older_at, Seq(3))
    with trio.fail_after(10):
        assert [(await newer.receive()).message for _ in range(2)] == [Seq(1), Gossip2(2)]
        assert [(await older.receive()).message for _ in range(2)] == [Seq(1), Seq(3)]
    assert sender.statistics().messages_not_sent_protocol == 2
    assert older.statistics().messages_dropped_undecodable == 0  # nothing unreadable came


# --- over TCP -------------------------------------------------------------------------------------


async def test_a_link_speaks_the_newest_version_both_ends_speak(certs: CertSet) -> None:
    async with (
        open_tcp_transport(
            certs.identity("old"), "old", LOCAL, protocol=ProtocolRange(1, 2), app_version="1.4"
        ) as old,
        open_tcp_transport(
            certs.identity("new"), "new", LOCAL, protocol=ProtocolRange(2, 3), app_version="2.0"
        ) as new,
    ):
        await new.send(old.local_address.address, Seq(1))
        await old.send(new.local_address.address, Seq(2))
        with trio.fail_after(10):
            assert (await old.receive()).message == Seq(1)
            assert (await new.receive()).message == Seq(2)
        assert new.peer_protocol(old.local_address.address) == 2
        assert old.peer_protocol(new.local_address.address) == 2
        assert new.peer_app_version(old.local_address.address) == "1.4"
        assert old.peer_app_version(new.local_address.address) == "2.0"
        assert new.peer_protocol(Address("127.0.0.1", 1)) is None  # no link there


async def test_a_type_of_a_later_version_goes_only_to_peers_that_speak_it(
    certs: CertSet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    two = ProtocolRange(1, 2)
    async with (
        open_tcp_transport(certs.identity("sender"), "sender", LOCAL, protocol=two) as sender,
        open_tcp_transport(certs.identity("newer"), "newer", LOCAL, protocol=two) as newer,
        open_tcp_transport(certs.identity("older"), "older", LOCAL) as older,
    ):
        await _gate_holds(sender, newer, older)
    lines = [r.getMessage() for r in caplog.records if "did not send a Gossip2" in r.getMessage()]
    assert any("needs wire protocol version 2, and the link speaks version 1" in x for x in lines)


async def test_a_peer_of_an_unsupported_version_is_refused_on_both_sides(
    certs: CertSet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        open_tcp_transport(certs.identity("server"), "server", LOCAL) as server,
        open_tcp_transport(
            certs.identity("future"), "future", LOCAL, protocol=ProtocolRange(2, 3)
        ) as future,
        open_tcp_transport(certs.identity("good"), "good", LOCAL) as good,
    ):
        await future.send(server.local_address.address, Seq(0))
        await wait_until(lambda: server.statistics().handshakes_refused >= 1)
        await wait_until(lambda: future.statistics().peers[0].connect_failures >= 1)
        assert future.peer_protocol(server.local_address.address) is None
        # Nothing crashed, and the server still serves a peer of its own version.
        await good.send(server.local_address.address, Seq(7))
        with trio.fail_after(10):
            envelope = await server.receive()
        assert envelope.message == Seq(7)
        assert server.statistics().messages_received == 1
    both = "the peer speaks versions 2-3, this node version 1"
    server_side = [r.getMessage() for r in caplog.records if "refused a link" in r.getMessage()]
    assert any(both in line for line in server_side), server_side
    dialer_side = [r.getMessage() for r in caplog.records if "cannot link to" in r.getMessage()]
    assert any(both in line and "refused the link" in line for line in dialer_side), dialer_side


# --- on the simulated network ---------------------------------------------------------------------


async def test_on_the_simulated_network_links_agree_or_are_refused_as_over_tcp(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    net = SimNetwork(seed=3, cluster="versions")
    old_at, new_at, bridge_at = (Address("10.0.0.1", port) for port in (1, 2, 3))
    async with (
        net.transport(old_at, "old") as old,
        net.transport(new_at, "new", protocol=ProtocolRange(2, 3)) as new,
        net.transport(bridge_at, "bridge", protocol=ProtocolRange(1, 2)) as bridge,
    ):
        await new.send(old_at, Seq(1))
        await bridge.send(old_at, Seq(2))
        await bridge.send(new_at, Seq(3))
        with trio.fail_after(10):
            assert (await old.receive()).message == Seq(2)  # new's Seq(1) never arrives
            assert (await new.receive()).message == Seq(3)
        await trio.sleep(5)
        assert old.statistics().messages_received == 1
        assert old.statistics().handshakes_refused == 1  # once, however many frames
        assert new.statistics().peer(old_at).connect_failures == 1  # type: ignore[union-attr]
        assert new.peer_protocol(old_at) is None
        assert bridge.peer_protocol(old_at) == 1
        assert bridge.peer_protocol(new_at) == 2
        assert [e.kind for e in net.trace if e.kind == "refused"] == ["refused"]
    both = "the peer speaks versions 2-3, this node version 1"
    lines = [r.getMessage() for r in caplog.records]
    assert any("refused a link from new" in line and both in line for line in lines), lines
    assert any("cannot link to old" in line and both in line for line in lines), lines


async def test_a_type_of_a_later_version_goes_only_to_peers_that_speak_it_on_the_simulated_network(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    net = SimNetwork(seed=5, cluster="versions")
    two = ProtocolRange(1, 2)
    async with (
        net.transport(Address("10.0.0.1", 1), "sender", protocol=two) as sender,
        net.transport(Address("10.0.0.1", 2), "newer", protocol=two) as newer,
        net.transport(Address("10.0.0.1", 3), "older") as older,
    ):
        await _gate_holds(sender, newer, older)
    lines = [r.getMessage() for r in caplog.records if "did not send a Gossip2" in r.getMessage()]
    assert any("needs wire protocol version 2, and the link is not up" in x for x in lines), lines


def test_a_protocol_that_is_not_a_range_is_refused() -> None:
    net = SimNetwork(seed=1)
    with pytest.raises(TypeError, match="protocol must be a ProtocolRange, not tuple"):
        net.transport(Address("10.0.0.1", 1), "n", protocol=(1, 2))  # type: ignore[arg-type]
