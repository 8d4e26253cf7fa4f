"""Who may send which membership message: decided by the link's identity, never by content."""

from __future__ import annotations

import logging

import pytest

from membership import Address, IdentityKind, PeerIdentity, UniqueAddress
from membership._authorization import (
    Standing,
    authorize_membership,
    member_traffic_refusal,
)
from membership._cluster_messages import (
    Down,
    ExitingConfirmed,
    GossipEnvelope,
    GossipStatus,
    InitJoin,
    InitJoinAck,
    InitJoinNack,
    Join,
    Leave,
    Welcome,
)
from membership._gossip import Gossip
from membership._heartbeat import Heartbeat, HeartbeatRsp
from membership._vclock import VectorClock
from membership.transport._refusals import Refusals

ME = UniqueAddress(Address("10.0.0.5", 25520), "node-5", 9)
OTHER = UniqueAddress(Address("10.0.0.6", 25520), "node-6", 3)
NODE = PeerIdentity(IdentityKind.NODE, "node-5")
CLIENT = PeerIdentity(IdentityKind.CLIENT, "node-5")
ADMIN = PeerIdentity(IdentityKind.ADMIN, "node-5")


def authored_by(author: UniqueAddress) -> list[object]:
    """One of every membership message that names its author."""
    return [
        Join(node=author),
        InitJoin(sender=author),
        InitJoinAck(sender=author),
        InitJoinNack(sender=author),
        Welcome(sender=author, gossip=Gossip()),
        GossipEnvelope(sender=author, to=OTHER, gossip=Gossip()),
        GossipStatus(sender=author, version=VectorClock(), seen_digest=b""),
        Heartbeat(sender=author, sequence_nr=1, creation_time=1.0),
        HeartbeatRsp(sender=author, sequence_nr=1, creation_time=1.0),
        ExitingConfirmed(node=author),
    ]


@pytest.mark.parametrize("message", authored_by(OTHER), ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("standing", list(Standing))
def test_a_message_for_another_node_is_refused_whatever_the_standing(
    message: object, standing: Standing
) -> None:
    refused = authorize_membership(message, ME, NODE, standing)
    assert refused is not None
    assert refused.kind == "forged-author"
    assert f"for {OTHER}" in refused.reason
    assert f"link of {ME}" in refused.reason


@pytest.mark.parametrize("message", authored_by(ME), ids=lambda m: type(m).__name__)
def test_a_member_may_send_any_of_its_own(message: object) -> None:
    assert authorize_membership(message, ME, NODE, Standing.MEMBER) is None


@pytest.mark.parametrize(
    ("message", "taken"),
    [
        (Join(node=ME), True),
        (InitJoin(sender=ME), True),
        (InitJoinAck(sender=ME), True),
        (InitJoinNack(sender=ME), True),
        (Welcome(sender=ME, gossip=Gossip()), True),
        (GossipEnvelope(sender=ME, to=OTHER, gossip=Gossip()), False),
        (GossipStatus(sender=ME, version=VectorClock(), seen_digest=b""), False),
        (Heartbeat(sender=ME, sequence_nr=1, creation_time=1.0), False),
        (HeartbeatRsp(sender=ME, sequence_nr=1, creation_time=1.0), False),
        (ExitingConfirmed(node=ME), False),
        (Down(node=OTHER.address), False),
        (Leave(node=OTHER.address), False),
        (Leave(node=ME.address), False),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, bool) else str(v),
)
def test_a_stranger_may_only_ask_to_join_as_itself(message: object, taken: bool) -> None:
    refused = authorize_membership(message, ME, NODE, Standing.STRANGER)
    assert (refused is None) is taken
    if refused is not None:
        assert refused.kind == "not-a-member"


def test_a_removed_node_gossiping_is_taken_to_be_shown_its_tombstone() -> None:
    gossip = GossipEnvelope(sender=ME, to=OTHER, gossip=Gossip())
    assert authorize_membership(gossip, ME, NODE, Standing.REMOVED) is None
    heartbeat = Heartbeat(sender=ME, sequence_nr=1, creation_time=1.0)
    assert authorize_membership(heartbeat, ME, NODE, Standing.REMOVED) is not None


@pytest.mark.parametrize("message", [*authored_by(ME), Down(node=OTHER.address)])
def test_a_client_takes_part_in_nothing(message: object) -> None:
    refused = authorize_membership(message, ME, CLIENT, Standing.MEMBER)
    assert refused is not None
    assert refused.kind == "client-identity"
    assert "client certificate may only read cluster state" in refused.reason


@pytest.mark.parametrize("message", [Down(node=OTHER.address), Leave(node=OTHER.address)])
def test_an_admin_may_make_a_member_leave_or_go_down(message: object) -> None:
    assert authorize_membership(message, ME, ADMIN, Standing.STRANGER) is None


@pytest.mark.parametrize("message", authored_by(ME), ids=lambda m: type(m).__name__)
def test_an_admin_does_not_take_part_in_membership_itself(message: object) -> None:
    refused = authorize_membership(message, ME, ADMIN, Standing.STRANGER)
    assert refused is not None
    assert refused.kind == "admin-identity"


def test_member_traffic_refusals_name_the_identity() -> None:
    assert member_traffic_refusal(b"x", ME, NODE).kind == "not-a-member"
    refused = member_traffic_refusal(b"x", ME, CLIENT)
    assert refused.kind == "client-identity"
    assert "client:node-5" in refused.reason


def test_refusals_are_counted_each_and_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = Refusals(logging.getLogger("tests.refusals"), interval=10.0)
    with caplog.at_level(logging.INFO, logger="tests.refusals"):
        for t in range(25):  # one a second
            refusals.refuse("a", "refused an a", float(t))
        refusals.refuse("b", "refused a b", 3.0, level=logging.INFO)
    assert refusals.counts == {"a": 25, "b": 1}
    assert refusals.total() == 26
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, "refused an a"),
        (logging.WARNING, "refused an a (and 9 more of this kind since the last report)"),
        (logging.WARNING, "refused an a (and 9 more of this kind since the last report)"),
        (logging.INFO, "refused a b"),
    ]
