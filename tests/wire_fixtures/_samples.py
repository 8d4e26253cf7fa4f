"""The instances the golden frames are made from: at least one per internal message type.

Each is built by wire name (:func:`make`), not by importing its class, so that moving a class to
another module changes nothing here. Fields hold values other than their defaults where that
makes sense, objects nest as they do in a running cluster, and a user's ``@message`` class
(:class:`Increment`) travels inside the envelopes that carry entity messages, so that frames of
kind ``OBJECT_FLAT`` are covered. A new message type needs a sample here before
``python -m tests.wire_fixtures.regenerate`` can write its frame.
"""

from __future__ import annotations

import enum
from typing import Any, cast

import attrs

from membership import message
from membership.internal import wire

from ._golden import import_packages, registered_class


@message(name="golden.counter.Increment")
@attrs.frozen(kw_only=True)
class Increment:
    """A user's message class, as an application defines one for a counter entity."""

    delta: int = attrs.field(validator=attrs.validators.instance_of(int))
    note: str = ""


def make(name: str, /, **fields: object) -> Any:
    """An instance of the class registered under wire name ``name``.

    Raises:
        ValueError: the class no longer takes these fields (the message names the sample).
    """
    try:
        return registered_class(name)(**fields)
    except Exception as exc:  # whatever the class raises, the sample is what to fix
        raise ValueError(
            f"the sample of {name} in tests/wire_fixtures/_samples.py does not build: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def members(name: str) -> list[enum.Enum]:
    """Every member of the enum registered under wire name ``name``."""
    return list(cast(type[enum.Enum], registered_class(name)))


TO_UID = 0x5EED_0000_0000_0002
"""The recipient incarnation in every frame's header (``to_uid``); 0 would mean "any"."""
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
"""A W3C trace context header, as in the trace context specification's examples."""


def samples() -> list[object]:
    """The instances to encode, in the order their frames are written."""
    import_packages()
    a = make("p2pshard.Address", host="10.0.0.1", port=25520)
    b = make("p2pshard.Address", host="10.0.0.2", port=25521)
    c = make("p2pshard.Address", host="fd00::3", port=25522)
    node_a = make("p2pshard.UniqueAddress", address=a, name="node-a", uid=0x5EED_0000_0000_0001)
    node_b = make("p2pshard.UniqueAddress", address=b, name="node-b", uid=TO_UID)
    node_c = make("p2pshard.UniqueAddress", address=c, name="node-c", uid=2**63 - 1)
    node_d = make("p2pshard.UniqueAddress", address=c, name="node-d", uid=7)
    status = {m.name: m for m in members("p2pshard.MemberStatus")}
    reach = {m.name: m for m in members("p2pshard.ReachabilityStatus")}
    member_a = make(
        "p2pshard.Member",
        node=node_a,
        status=status["UP"],
        up_number=1,
        roles=frozenset({"frontend", "backend"}),
        app_version="2.4.1",
    )
    member_b = make("p2pshard.Member", node=node_b, status=status["LEAVING"], up_number=2)
    member_c = make("p2pshard.Member", node=node_c)
    record = make(
        "p2pshard.ReachabilityRecord",
        observer=node_a,
        subject=node_c,
        status=reach["UNREACHABLE"],
        version=3,
    )
    reachability = make("p2pshard.Reachability", records=(record,), versions=((node_a, 3),))
    clock = make("p2pshard.VectorClock", entries=(("node-a-1", 5), ("node-b-2", 2)))
    gossip = make(
        "p2pshard.Gossip",
        members=(member_a, member_b, member_c),
        seen=frozenset({node_a, node_b}),
        reachability=reachability,
        version=clock,
        tombstones=((node_d, 1_790_000_000.25),),
    )
    increment = Increment(delta=3, note="from the golden fixtures")
    user = make("golden.counter.Increment", delta=-1)
    rtype = "Counter"
    entity_type = make(
        "p2pshard.status.EntityType",
        type_name=rtype,
        region={"shards": 3, "entities": 12, "proxy": False, "load": 0.5, "role": None},
        regions=(make("p2pshard.status.RegionShards", node=node_a, shards={"s1": 4, "s2": 8}),),
        failed=(node_c,),
        error="node-c did not answer",
    )
    other_cluster = make(
        "p2pshard.status.OtherCluster",
        oldest=node_d,
        size=2,
        vouched=1,
        addresses=(c,),
        verdict="ignored",
    )
    return [
        # membership: addresses, members, gossip
        a,
        c,
        node_a,
        *members("p2pshard.MemberStatus"),
        *members("p2pshard.ReachabilityStatus"),
        member_a,
        record,
        reachability,
        clock,
        gossip,
        make("p2pshard.Heartbeat", sender=node_a, sequence_nr=41, creation_time=12.5),
        make("p2pshard.HeartbeatRsp", sender=node_b, sequence_nr=41, creation_time=12.5),
        make("p2pshard.cluster.InitJoin", sender=node_a, oldest=node_b, size=3),
        make("p2pshard.cluster.InitJoin", sender=node_a),
        make("p2pshard.cluster.InitJoinAck", sender=node_b, oldest=node_b, size=3),
        make("p2pshard.cluster.InitJoinNack", sender=node_b),
        make(
            "p2pshard.cluster.Join", node=node_c, roles=frozenset({"backend"}), app_version="2.4.1"
        ),
        make("p2pshard.cluster.Welcome", sender=node_a, gossip=gossip),
        make("p2pshard.cluster.GossipEnvelope", sender=node_a, to=node_b, gossip=gossip),
        make(
            "p2pshard.cluster.GossipStatus", sender=node_a, version=clock, seen_digest=b"\x01\xfe"
        ),
        make("p2pshard.cluster.Leave", node=b),
        make("p2pshard.cluster.Down", node=c),
        make("p2pshard.cluster.ExitingConfirmed", node=node_b),
        make("p2pshard.cluster.OtherClusterSeen", sender=node_a, at=(c, b)),
        make(
            "p2pshard.transport.Hello",
            cluster="golden",
            sender=node_a,
            protocol_low=1,
            protocol_high=1,
            app_version="2.4.1",
        ),
        make("p2pshard.transport.HelloAck", sender=node_b, protocol=1, app_version="2.4.0"),
        make("p2pshard.transport.HelloRefused", reason="no wire protocol version in common"),
        # singletons
        make("p2pshard.singleton.HandOverToMe", name="coordinator"),
        make("p2pshard.singleton.HandOverInProgress", name="coordinator"),
        make("p2pshard.singleton.HandOverDone", name="coordinator"),
        make("p2pshard.singleton.TakeOverFromMe", name="coordinator"),
        make("p2pshard.singleton.Envelope", name="ledger", payload=increment, request_id=9),
        make("p2pshard.singleton.NotHere", name="ledger", payload=("a", 1), request_id=9),
        make("p2pshard.singleton.Reply", request_id=9, payload={"total": 3}, error=None),
        make("p2pshard.singleton.Reply", request_id=10, error="ValueError: no such account"),
        # replicated state
        make("p2pshard.ddata.Read", replicator="ddata", key="cart", request_id=5, state=b"\x00s"),
        make(
            "p2pshard.ddata.ReadResult", replicator="ddata", request_id=5, update=b"u", deleted=True
        ),
        make(
            "p2pshard.ddata.Write",
            replicator="ddata",
            key="cart",
            request_id=6,
            update=b"u",
            required=b"r",
        ),
        make("p2pshard.ddata.WriteAck", replicator="ddata", request_id=6),
        make(
            "p2pshard.ddata.WriteNack", replicator="ddata", request_id=6, state=b"s", deleted=True
        ),
        make("p2pshard.ddata.Delete", replicator="ddata", key="cart", request_id=7),
        make("p2pshard.ddata.DeleteAck", replicator="ddata", request_id=7),
        make("p2pshard.ddata.Status", replicator="ddata", buckets=b"\x00\x01\x02"),
        make(
            "p2pshard.ddata.KeyDigests",
            replicator="ddata",
            buckets=(0, 7),
            digests={"cart": b"\xaa"},
        ),
        make(
            "p2pshard.ddata.Sync",
            replicator="ddata",
            updates={"cart": b"u"},
            states={"seen": b"s"},
            delete_sets={"old": b"d"},
            deleted=("gone",),
            reply=True,
        ),
        make("p2pshard.ddata.Deltas", replicator="ddata", updates={"cart": b"delta"}),
        # sharding
        make("p2pshard.sharding.Register", type_name=rtype, number_of_shards=100),
        make("p2pshard.sharding.RegisterProxy", type_name=rtype, number_of_shards=100),
        make("p2pshard.sharding.RegisterAck", type_name=rtype, coordinator=node_a),
        make("p2pshard.sharding.RegisterRefused", type_name=rtype, reason="100 shards, not 50"),
        make("p2pshard.sharding.GetShardHome", type_name=rtype, shard="17"),
        make("p2pshard.sharding.ShardHome", type_name=rtype, shard="17", region=node_b),
        make("p2pshard.sharding.HostShard", type_name=rtype, shard="17"),
        make("p2pshard.sharding.ShardStarted", type_name=rtype, shard="17"),
        make("p2pshard.sharding.BeginHandOff", type_name=rtype, shard="17", handoff_id=4),
        make(
            "p2pshard.sharding.BeginHandOffAck",
            type_name=rtype,
            shard="17",
            handoff_id=4,
            acked_by=node_c,
        ),
        make("p2pshard.sharding.HandOff", type_name=rtype, shard="17", handoff_id=4),
        make("p2pshard.sharding.ShardStopped", type_name=rtype, shard="17", handoff_id=4),
        make("p2pshard.sharding.GracefulShutdownReq", type_name=rtype),
        make("p2pshard.sharding.RegionStopped", type_name=rtype),
        # the commonest frame: a user's message sent flat in its envelope
        make(
            "p2pshard.sharding.EntityDelivery",
            type_name=rtype,
            shard="17",
            entity_id="counter-1",
            message=increment,
            request_id=12,
            origin=node_a,
        ),
        make(
            "p2pshard.sharding.EntityDelivery",
            type_name=rtype,
            shard="17",
            entity_id="c",
            message=7,
        ),
        make(
            "p2pshard.sharding.EntityDelivery",
            type_name=rtype,
            shard="17",
            entity_id="counter-1",
            message=increment,
            trace={"traceparent": TRACEPARENT, "tracestate": "p2pshard=1"},
        ),
        make(
            "p2pshard.sharding.EntityDeliveries",
            type_name=rtype,
            entries=[
                *("17", "counter-1", wire.encode(increment), 13, node_a),
                *("18", "counter-2", wire.encode(user), 0, None),
            ],
        ),
        make(
            "p2pshard.sharding.EntityDeliveries",
            type_name=rtype,
            entries=[
                *("17", "counter-1", wire.encode(increment), 0, None),
                *("18", "counter-2", wire.encode(user), 15, node_a),
            ],
            traces=[None, {"traceparent": TRACEPARENT}],
        ),
        make("p2pshard.sharding.EntityReply", request_id=12, value=user),
        make(
            "p2pshard.sharding.EntityReply", request_id=13, error_type="KeyError", error_text="'x'"
        ),
        make("p2pshard.sharding.ShardingEnvelope", entity_id="counter-1", message=increment),
        make("p2pshard.sharding.GetRegionStats", type_name=rtype, request_id=14),
        make("p2pshard.sharding.RegionStats", type_name=rtype, request_id=14, shards={"17": 2}),
        # status and member commands
        make("p2pshard.status.Request", request_id=15, stats_timeout=0.5),
        make(
            "p2pshard.status.Member",
            node=node_a,
            status="up",
            roles=("backend", "frontend"),
            up_number=1,
            age=3,
            app_version="2.4.1",
        ),
        entity_type,
        other_cluster,
        make("p2pshard.status.RegionShards", node=node_b, shards={"17": 2}),
        make(
            "p2pshard.status.Reply",
            request_id=15,
            node=node_a,
            members=(
                make(
                    "p2pshard.status.Member",
                    node=node_b,
                    status="leaving",
                    roles=(),
                    up_number=2,
                    age=2,
                ),
            ),
            unreachable=(node_c,),
            leader=node_a,
            oldest=node_a,
            entity_types=(entity_type,),
            other_clusters=(other_cluster,),
        ),
        make("p2pshard.status.MemberCommand", request_id=16, action="down", address=c),
        make("p2pshard.status.MemberCommandReply", request_id=16, ok=True, text="node-c is down"),
        # the testing kit's workloads
        make("p2pshard.testing.Add", sender="client-1", seq=8),
        make("p2pshard.testing.Added", sender="client-1", seq=8),
        make("p2pshard.testing.Read"),
        make("p2pshard.testing.Probe"),
        make("p2pshard.testing.Stall", seconds=1.5),
        make("p2pshard.testing.Deliver", room="Room/r1", first=3, posts=(("alice", 3), ("bob", 4))),
        make("p2pshard.testing.Copied", room="Room/r1", sender="alice", seq=3),
        # a user's message class on its own
        increment,
        user,
    ]


def plain_samples() -> list[object]:
    """Plain values (frame kind PLAIN), covering each extension type of the wire."""
    return [
        {"counter-1": 3, "nested": [1, 2.5, None, True, b"\x00"]},
        (1, "a", (2, 3)),
        frozenset({1, 2}),
        {"x", "y"},
        "text",
        -(2**63),
    ]
