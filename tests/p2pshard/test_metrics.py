"""Prometheus metrics (issue 23): a scrape of a node of a simulated cluster, parsed back with
``prometheus_client.parser``, shows what the node counted, and moves as the workload did."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pycrdt
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from crdt import WriteMajority
from p2pshard import (
    AskTimeout,
    EntityId,
    HashExtractor,
    MemoryLeaseBackend,
    Node,
    RemoteEntityError,
    testing,
)
from p2pshard._metrics import MEMBER_STATUSES, METRICS_CONTENT_TYPE, metrics_text
from tests._support.sharding_sim import (
    CounterAdd,
    CounterRead,
    CounterSim,
    Fail,
    PassivateMe,
    Sleep,
    standard_setup,
)

Labels = tuple[tuple[str, str], ...]

ALLOWED_LABELS = {
    "status",
    "peer",
    "entity_type",
    "cause",
    "kind",
    "replicator",
    "reason",
    "outcome",
    "operation",
    "consistency",
}
"""Every label a p2pshard series may carry (``p2pshard_node_info``'s aside): all bounded."""

INFO_LABELS = {"cluster", "node", "app_version"}

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"

EXTRACTOR = HashExtractor(10)
"""The extractor ``standard_setup(number_of_shards=10)`` starts ``Counter`` with."""


class Scrape:
    """One scrape of a node, parsed back: sample name and labels → value, and family types."""

    def __init__(self, node: Node) -> None:
        self.samples: dict[str, dict[Labels, float]] = {}
        self.types: dict[str, str] = {}
        for family in text_string_to_metric_families(metrics_text(node).decode()):
            self.types[family.name] = family.type
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                self.samples.setdefault(sample.name, {})[labels] = sample.value

    def value(self, name: str, **labels: str) -> float:
        series = self.samples[name]
        key = tuple(sorted(labels.items()))
        assert key in series, f"{name}{labels} not scraped; its series: {sorted(series)}"
        return series[key]

    def total(self, name: str, **labels: str) -> float:
        """The sum of the series of ``name`` that carry ``labels`` (and any others)."""
        want = set(labels.items())
        return sum(v for k, v in self.samples.get(name, {}).items() if want <= set(k))

    def by_labels(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """The series of ``name`` that carry ``labels``, keyed by the value of ``label``."""
        want = set(labels.items())
        return {dict(k)[label]: v for k, v in self.samples.get(name, {}).items() if want <= set(k)}

    def by(self, name: str, label: str) -> dict[str, float]:
        """Every series of ``name``, keyed by the value of its one label ``label``."""
        out = {}
        for labels, value in self.samples.get(name, {}).items():
            assert [k for k, _ in labels] == [label], f"{name} has labels {labels}"
            out[labels[0][1]] = value
        return out


async def test_scrapes_show_members_entities_and_messages_moving_with_the_workload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    entities = [f"room-{k}" for k in range(12)]
    async with testing.simulated_cluster_of(
        CounterSim, 23, standard_setup(number_of_shards=10), lease_backend=MemoryLeaseBackend()
    ) as sim:
        await sim.start_up([1, 2, 3])
        region = sim.regions[1]
        for entity in entities:  # every entity started, and its shard's home known on n1
            assert await region.entity_ref(entity).ask(CounterRead(), timeout=30) is not None
        lease = sim.nodes[2].leases.lease("metrics-test")
        assert await lease.acquire() is not None
        await sim.nodes[3].replicator.update(
            "metrics-test",
            lambda doc: doc.get("m", type=pycrdt.Map).update({"a": "b"}),
            WriteMajority(timeout=5),
        )

        first = {i: Scrape(sim.nodes[i]) for i in (1, 2, 3)}
        for i, scrape in first.items():
            members = scrape.by("p2pshard_cluster_members", "status")
            assert members == {s: (3.0 if s == "up" else 0.0) for s in MEMBER_STATUSES}
            assert scrape.value("p2pshard_cluster_unreachable_members") == 0
            assert scrape.value("p2pshard_cluster_self_status", status="up") == 1
            assert sum(scrape.by("p2pshard_cluster_self_status", "status").values()) == 1
            peers = {str(testing.node_address(j)) for j in (1, 2, 3) if j != i}
            phi = scrape.by("p2pshard_failure_detector_phi", "peer")
            assert set(phi) == peers
            assert all(0 <= value < 8 for value in phi.values()), phi
            assert set(scrape.by("p2pshard_transport_peer_connected", "peer")) >= peers
            assert scrape.value("p2pshard_node_info", cluster="sim", node=f"n{i}", app_version="")
            assert scrape.value("p2pshard_sharding_region_registered", entity_type="Counter") == 1
        assert sum(f.value("p2pshard_cluster_is_leader") for f in first.values()) == 1
        # Every entity the test created is active on exactly one node.
        active = [
            f.value("p2pshard_sharding_entities", entity_type="Counter") for f in first.values()
        ]
        assert sum(active) == len(entities)
        hosted = [
            f.value("p2pshard_sharding_shards", entity_type="Counter") for f in first.values()
        ]
        shards = {EXTRACTOR.shard_id(EntityId(e)) for e in entities}
        assert sum(hosted) == len(shards)
        # One incarnation per entity, none stopped; n1 made one ask per entity and looked up
        # the home of each of their shards once.
        activations = [
            f.value("p2pshard_sharding_entity_activations_total", entity_type="Counter")
            for f in first.values()
        ]
        assert activations == active
        for f in first.values():
            assert (
                f.value("p2pshard_sharding_entity_passivations_total", entity_type="Counter") == 0
            )
        assert first[1].value("p2pshard_sharding_asks_total", entity_type="Counter") == len(
            entities
        )
        lookups = "p2pshard_sharding_shard_home_lookup_duration_seconds_count"
        assert first[1].value(lookups, entity_type="Counter") == len(shards)
        assert first[2].value("p2pshard_leases_held") == 1
        # The coordinator's state is replicated: keys on every node. A scrape reads the
        # replicator's counters without encoding every key (key_sizes=False).
        full = sim.nodes[1].replicator.statistics()
        cheap = sim.nodes[1].replicator.statistics(key_sizes=False)
        assert full.bytes_per_key
        assert not cheap.bytes_per_key
        assert attrs.evolve(cheap, bytes_per_key=full.bytes_per_key) == full
        assert first[1].value("p2pshard_replicator_keys", replicator="ddata") == full.keys >= 1
        assert first[1].value("p2pshard_leases_held") == 0
        # The majority write made on n3, counted there under its consistency level and timed.
        write = {"replicator": "ddata", "operation": "write", "consistency": "majority"}
        assert first[3].value("p2pshard_replicator_operations_total", **write) == 1
        assert first[3].value("p2pshard_replicator_operation_failures_total", **write) == 0
        took = "p2pshard_replicator_operation_duration_seconds"
        assert first[3].value(f"{took}_count", **write) == 1
        assert first[3].value(f"{took}_sum", **write) > 0
        assert first[2].total("p2pshard_replicator_operations_total", **write) == 0

        # The workload between the scrapes: 5 tells to each entity from n1, then one ask each
        # (its answer says every tell before it arrived).
        tells = 5
        for seq in range(tells):
            for entity in entities:
                await region.entity_ref(entity).tell(CounterAdd(sender="metrics", seq=seq))
        for entity in entities:
            await region.entity_ref(entity).ask(CounterRead(), timeout=30)
        second = {i: Scrape(sim.nodes[i]) for i in (1, 2, 3)}

        def moved(name: str, i: int, **labels: str) -> float:
            return second[i].value(name, **labels) - first[i].value(name, **labels)

        counter = {"entity_type": "Counter"}
        # The asks: every one counted, every one answered, and none failed.
        assert moved("p2pshard_sharding_asks_total", 1, **counter) == len(entities)
        asked = "p2pshard_sharding_ask_duration_seconds"
        assert moved(f"{asked}_count", 1, **counter) == len(entities)
        assert moved(f"{asked}_bucket", 1, le="+Inf", **counter) == len(entities)
        assert moved(f"{asked}_sum", 1, **counter) > 0  # remote asks take simulated time
        assert second[1].total("p2pshard_sharding_ask_failures_total", **counter) == 0
        for i in (2, 3):
            assert second[i].value("p2pshard_sharding_asks_total", **counter) == 0
        sent_here = moved("p2pshard_sharding_messages_delivered_locally_total", 1, **counter)
        sent_away = moved("p2pshard_sharding_messages_sent_remote_total", 1, **counter)
        assert sent_here + sent_away == len(entities) * (tells + 1)
        assert sent_away > 0
        received = sum(
            moved("p2pshard_sharding_messages_received_remote_total", i, **counter) for i in (2, 3)
        )
        assert received == sent_away
        for i in (2, 3):  # nobody but n1 sent entity messages
            assert moved("p2pshard_sharding_messages_sent_remote_total", i, **counter) == 0
            assert moved("p2pshard_sharding_messages_delivered_locally_total", i, **counter) == 0
        # The transport counts a batch of entity messages as one message: it received at least
        # as many as n1 sent batches (besides the unbatched ones, gossip, heartbeats...).
        assert sum(moved("p2pshard_transport_received_messages_total", i) for i in (2, 3)) >= moved(
            "p2pshard_sharding_batches_sent_total", 1, **counter
        )
        for peer in (2, 3):
            address = str(testing.node_address(peer))
            assert moved("p2pshard_transport_sent_bytes_total", 1, peer=address) > 0
            assert moved("p2pshard_transport_sent_frames_total", 1, peer=address) > 0
        # No new entity: the same ones handled the tells.
        again = [s.value("p2pshard_sharding_entities", **counter) for s in second.values()]
        assert again == active
        for i in (1, 2, 3):
            drops = second[i].samples["p2pshard_sharding_region_dropped_messages_total"]
            assert {dict(k)["reason"] for k in drops} == {
                "buffer_full",
                "not_sent",
                "refused",
                "send_queue_full",
                "stopped",
            }
            assert set(drops.values()) == {0}
            assert second[i].value("p2pshard_sharding_region_buffered_messages", **counter) == 0
            assert moved("p2pshard_transport_received_bytes_total", i) > 0

        for scrape in (*first.values(), *second.values()):
            check_bounded(scrape, entities)
        exported = {
            f"{name}_total" if kind == "counter" else name
            for name, kind in first[2].types.items()
            if name.startswith("p2pshard_")
        }
        # Every metric documented, and every documented one exported (the journal's only on a
        # node with a journal, which the simulated ones lack).
        documented = documented_metrics()
        journal = {name for name in documented if name.startswith("p2pshard_journal_")}
        assert len(journal) == 4
        assert exported == documented - journal


async def test_passivations_failed_asks_hand_offs_and_rebalance_rounds_are_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    entities = [f"room-{k}" for k in range(12)]
    counter = {"entity_type": "Counter"}
    async with testing.simulated_cluster_of(
        CounterSim, 26, standard_setup(number_of_shards=10)
    ) as sim:
        await sim.start_up([1, 2, 3])
        region = sim.regions[1]
        for entity in entities:
            await region.entity_ref(entity).ask(CounterRead(), timeout=30)

        # K entities passivate themselves: K passivations in all, the same entities active.
        passivated = entities[:4]
        for entity in passivated:
            assert await region.entity_ref(entity).ask(PassivateMe(), timeout=30) == "passivating"
        with trio.fail_after(30):
            while (  # noqa: ASYNC110 - polls on the mock clock
                sum(sim.regions[i].statistics().entities for i in (1, 2, 3))
                > len(entities) - len(passivated)
            ):
                await trio.sleep(0.1)
        scrapes = {i: Scrape(sim.nodes[i]) for i in (1, 2, 3)}
        total = {
            name: sum(
                f.value(f"p2pshard_sharding_entity_{name}_total", **counter)
                for f in scrapes.values()
            )
            for name in ("activations", "passivations")
        }
        assert total == {"activations": len(entities), "passivations": len(passivated)}

        # Asks that fail: the entity raises; the entity does not answer in time.
        with pytest.raises(RemoteEntityError):
            await region.entity_ref(entities[5]).ask(Fail(text="no"), timeout=30)
        with pytest.raises(AskTimeout):
            await region.entity_ref(entities[6]).ask(Sleep(seconds=5.0), timeout=1.0)
        scrape = Scrape(sim.nodes[1])
        failures = scrape.by_labels("p2pshard_sharding_ask_failures_total", "reason", **counter)
        assert failures == {
            "timeout": 1,
            "entity_error": 1,
            "buffer_full": 0,
            "region_stopped": 0,
            "not_delivered": 0,
        }
        asks = len(entities) + len(passivated) + 2
        assert scrape.value("p2pshard_sharding_asks_total", **counter) == asks
        # Answered: all but the one that timed out (the entity's error is an answer).
        answered = scrape.value("p2pshard_sharding_ask_duration_seconds_count", **counter)
        assert answered == asks - 1

        # The coordinator runs on n1, the oldest; a rebalance round comes every interval.
        await trio.sleep(region.settings.rebalance_interval + 1)
        before = Scrape(sim.nodes[1])
        assert before.value("p2pshard_sharding_coordinator_running", **counter) == 1
        assert before.value("p2pshard_sharding_rebalance_rounds_total", **counter) >= 1
        for i in (2, 3):
            assert scrapes[i].value("p2pshard_sharding_coordinator_running", **counter) == 0
            assert scrapes[i].value("p2pshard_sharding_rebalance_rounds_total", **counter) == 0
        # n3 leaves: the coordinator hands each of its shards off.
        leaving = sim.regions[3].statistics().shards
        assert leaving > 0
        await sim.graceful_leave(3)
        after = Scrape(sim.nodes[1])
        handoffs = after.by_labels("p2pshard_sharding_handoffs_total", "outcome", **counter)
        started = before.by_labels("p2pshard_sharding_handoffs_total", "outcome", **counter)
        assert handoffs["completed"] - started["completed"] >= leaving
        assert handoffs["timed_out"] == 0
        took = "p2pshard_sharding_handoff_duration_seconds"
        assert after.value(f"{took}_count", **counter) == handoffs["completed"]
        assert after.value(f"{took}_sum", **counter) > 0
        check_bounded(after, entities)


async def test_lease_acquisitions_renewals_and_a_loss_are_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = MemoryLeaseBackend()
    async with testing.simulated_cluster_of(
        testing.SimCluster, 27, None, lease_backend=backend
    ) as sim:
        await sim.start_up([1, 2])
        node = sim.nodes[1]
        settings = node.leases.settings
        assert await node.leases.lease("job").acquire() is not None
        assert await sim.nodes[2].leases.lease("job").acquire() is None  # n1 holds it
        await trio.sleep(settings.renew_interval * 3 + 0.5)
        scrape = Scrape(node)
        assert scrape.by("p2pshard_leases_acquisitions_total", "outcome") == {
            "granted": 1,
            "refused": 0,
            "unavailable": 0,
        }
        assert Scrape(sim.nodes[2]).by("p2pshard_leases_acquisitions_total", "outcome") == {
            "granted": 0,
            "refused": 1,
            "unavailable": 0,
        }
        renewals = scrape.by("p2pshard_leases_renewals_total", "outcome")
        assert renewals["renewed"] >= 3
        took = "p2pshard_leases_renewal_duration_seconds"
        assert scrape.value(f"{took}_count") == renewals["renewed"]
        assert scrape.value("p2pshard_leases_lost_total") == 0

        # The backend stops answering n1 past the grant's deadline: the lease is lost, once.
        backend.cut_off(str(node.address))
        await trio.sleep(settings.ttl + settings.renew_interval)
        scrape = Scrape(node)
        assert scrape.value("p2pshard_leases_lost_total") == 1
        assert scrape.by("p2pshard_leases_renewals_total", "outcome")["failed"] >= 1
        assert scrape.value("p2pshard_leases_held") == 0


def documented_metrics() -> set[str]:
    """The metric names the tables of the Metrics section of docs/operations.md list."""
    section = OPERATIONS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(p2pshard_[a-z_]+)` \|", section, re.MULTILINE))


def check_bounded(scrape: Scrape, entity_ids: list[str]) -> None:
    """Only bounded labels; no entity id anywhere; counters typed as counters."""
    for name, series in scrape.samples.items():
        if not name.startswith("p2pshard_"):
            continue
        for labels in series:
            names = {k for k, _ in labels}
            allowed = INFO_LABELS if name == "p2pshard_node_info" else ALLOWED_LABELS
            if name.endswith("_bucket"):
                allowed = allowed | {"le"}
            assert names <= allowed, f"{name} has unbounded labels {names - allowed}"
            assert not {v for _, v in labels} & set(entity_ids), f"{name}{labels}"
        if name.endswith(("_bucket", "_count", "_sum")) and name.rsplit("_", 1)[0] in scrape.types:
            family = name.rsplit("_", 1)[0]
            assert scrape.types[family] == "histogram", f"{name} is a {scrape.types[family]}"
            assert family.endswith("_seconds"), f"{family}: a histogram of seconds, named so"
            continue
        family = name.removesuffix("_total")
        expected = "counter" if name.endswith("_total") else "gauge"
        assert scrape.types[family] == expected, f"{name} is a {scrape.types[family]}"


async def test_a_crashed_peer_shows_as_unreachable_with_a_rising_phi_until_it_is_downed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with testing.simulated_cluster(24) as sim:
        await sim.start_up([1, 2, 3])
        node = sim.nodes[1]
        gone, alive = str(testing.node_address(3)), str(testing.node_address(2))
        sim.crash(3)
        with trio.fail_after(60):
            while not node.cluster.unreachable:  # noqa: ASYNC110 - polls on the mock clock
                await trio.sleep(0.1)
        scrape = Scrape(node)
        assert scrape.value("p2pshard_cluster_unreachable_members") == 1
        phi = scrape.by("p2pshard_failure_detector_phi", "peer")
        assert phi[gone] >= 8 > phi[alive]
        assert scrape.by("p2pshard_cluster_members", "status")["up"] == 3
        assert scrape.value("p2pshard_transport_peer_connected", peer=gone) == 0
        await trio.sleep(2.0)
        assert Scrape(node).by("p2pshard_failure_detector_phi", "peer")[gone] > phi[gone]

        with trio.fail_after(60):  # the split brain resolver downs it, then it is removed
            while len(node.cluster.members) != 2:  # noqa: ASYNC110 - polls on the mock clock
                await trio.sleep(0.1)
        scrape = Scrape(node)
        assert scrape.by("p2pshard_cluster_members", "status")["up"] == 2
        assert scrape.value("p2pshard_cluster_unreachable_members") == 0
        assert set(scrape.by("p2pshard_failure_detector_phi", "peer")) == {alive}


async def test_scraped_values_are_the_counters_the_node_keeps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with testing.simulated_cluster(25) as sim:
        await sim.start_up([1, 2])
        node = sim.nodes[1]
        # No checkpoint between the scrape and the reads: nothing can change in between.
        scrape = Scrape(node)
        transport = node.transport_statistics()
        replicator = node.replicator.statistics()
        assert scrape.value("p2pshard_transport_received_bytes_total") == transport.bytes_received
        assert scrape.value("p2pshard_transport_received_frames_total") == transport.frames_received
        assert (
            scrape.value("p2pshard_transport_received_messages_total")
            == transport.messages_received
        )
        for peer in transport.peers:
            labels = {"peer": str(peer.address)}
            assert scrape.value("p2pshard_transport_sent_bytes_total", **labels) == peer.bytes_sent
            assert scrape.value("p2pshard_transport_connects_total", **labels) == peer.connects
        name = node.config.replicator.name
        assert scrape.value("p2pshard_replicator_keys", replicator=name) == replicator.keys
        assert (
            scrape.value("p2pshard_replicator_gossip_sent_messages_total", replicator=name)
            == replicator.gossip_messages_sent
        )
        assert scrape.by("p2pshard_transport_links_closed_total", "cause") == dict.fromkeys(
            ("frame_too_large", "truncated", "undecodable", "tls_error", "refused_messages"), 0.0
        )
        assert "p2pshard_leases_held" not in scrape.samples  # no lease backend
        assert "p2pshard_sharding_entities" not in scrape.samples  # no series: no entity type
        assert "python_info" in scrape.samples  # and the process's metrics beside the node's
        assert METRICS_CONTENT_TYPE.startswith("text/plain")
