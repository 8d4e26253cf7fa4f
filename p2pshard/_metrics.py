"""Prometheus metrics of a node, read at scrape time from the counters it keeps anyway.

Theory of operation. The node already counts what an operator wants to see: the transport its
frames, bytes, refused handshakes and closed links (``Node.transport_statistics``), membership
its members and refusals (``Cluster.statistics``) and a phi accrual failure detector per
watched peer, each region its shards, entities, buffered and dropped messages
(``ShardRegion.statistics``), each replicator its gossip and store counters. Those are plain
integers, bumped on the hot path as they always were. What needed counting for the metrics
is counted the same way: asks, activations, drops by reason, hand-offs, replicator calls,
lease renewals and journal appends are integers, and their latencies
:class:`~membership.LatencyHistogram` objects (fixed buckets of integers), kept by the
components. :class:`NodeCollector` is a custom ``prometheus_client`` collector: only when
Prometheus scrapes does it read them and build the metric families, so metrics cost nothing
between scrapes. A tell does no work for them; an ask reads the clock at its start and its
answer.

Naming follows Prometheus' conventions: every name starts with ``p2pshard_``, a counter ends in
``_total``, a unit is spelled out in the name (``_bytes``). Labels are bounded: an entity type,
a member status, a cause, a replicator's name, or a peer's address (one series per peer of a
cluster of bounded size); never an entity or shard id. The list, with what each metric means,
is in the Metrics section of docs/operations.md.

Where it differs from Akka: Akka's sharding answers its counts as messages
(``GetShardRegionStats``, ``GetClusterShardingStats``) and leaves exporting them to add-ons;
here the node exports them itself, in the format Prometheus scrapes.

Reading a series needs the node's trio thread (the failure detectors read the trio clock):
call :func:`metrics_text` from a task of the node, as the management endpoint does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from crdt import Replicator
from membership import (
    Cluster,
    ConfigurationError,
    HistogramSnapshot,
    MemberStatus,
    TransportStatistics,
)

from ._config import NodeConfig
from .leases._leases import Leases
from .persistence._journal import Journal
from .persistence._journal_stats import journal_statistics
from .sharding._region import RegionStatistics
from .sharding._sharding import Sharding


class Node(Protocol):
    """What the metrics read of a node (a :class:`~p2pshard.Node` is one).

    A protocol rather than the class: the node serves these metrics (``GET /metrics``), so it
    imports this module.
    """

    @property
    def config(self) -> NodeConfig:
        """The node's configuration."""
        ...

    @property
    def cluster(self) -> Cluster:
        """Its membership."""
        ...

    @property
    def sharding(self) -> Sharding:
        """Its entity types."""
        ...

    @property
    def replicators(self) -> Mapping[str, Replicator]:
        """Its replicators, by name."""
        ...

    @property
    def leases(self) -> Leases:
        """Its leases (raises ConfigurationError without a lease backend)."""
        ...

    @property
    def journal(self) -> Journal:
        """Its journal (raises ConfigurationError without one)."""
        ...

    def transport_statistics(self) -> TransportStatistics:
        """Its transport's counters."""
        ...


METRICS_CONTENT_TYPE: str = CONTENT_TYPE_LATEST
"""The ``Content-Type`` of what :func:`metrics_text` returns (Prometheus' text format)."""

MEMBER_STATUSES: tuple[str, ...] = tuple(
    s.value for s in MemberStatus if s is not MemberStatus.REMOVED
)
"""The values of the ``status`` label: every status a listed member can have (a removed member
is no longer listed)."""

_Rows = Iterable[tuple[Sequence[str], float]]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauges(name: str, documentation: str, labels: Sequence[str], rows: _Rows) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _counters(name: str, documentation: str, labels: Sequence[str], rows: _Rows) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes ``le``: ``0.005``, ``1.0``, ``+Inf``."""
    return "+Inf" if bound == math.inf else repr(float(bound))


def _histograms(
    name: str,
    documentation: str,
    labels: Sequence[str],
    rows: Iterable[tuple[Sequence[str], HistogramSnapshot | None]],
) -> Metric:
    """A histogram family from the components' own fixed-bucket counts (cumulative ``le``)."""
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for values, snapshot in rows:
        if snapshot is None:
            continue
        buckets = [(_le(bound), n) for bound, n in snapshot.cumulative()]
        family.add_metric(values, buckets, snapshot.sum)
    return family


class NodeCollector(Collector):
    """A ``prometheus_client`` collector of one node's metrics, built at each scrape.

    Register it with a ``CollectorRegistry`` (:func:`metrics_registry` does), then serve
    ``generate_latest(registry)``. Collect from the node's trio thread.

    Example:
        >>> async def scrape(node: Node) -> bytes:
        ...     registry = CollectorRegistry()
        ...     registry.register(NodeCollector(node))
        ...     return generate_latest(registry)
    """

    def __init__(self, node: Node) -> None:
        self._node = node

    def collect(self) -> Iterator[Metric]:
        """The node's metric families, read from its counters now."""
        yield from self._node_info()
        yield from self._membership()
        yield from self._transport()
        yield from self._sharding()
        yield from self._replicators()
        yield from self._leases()
        yield from self._journal()

    # -- the node and its membership --------------------------------------------------------

    def _node_info(self) -> Iterator[Metric]:
        config = self._node.config
        info = GaugeMetricFamily(
            "p2pshard_node_info",
            "Always 1: this node's cluster, name and application version as labels.",
            labels=("cluster", "node", "app_version"),
        )
        info.add_metric((config.cluster_name, config.node_name, config.app_version), 1)
        yield info

    def _membership(self) -> Iterator[Metric]:
        cluster = self._node.cluster
        counts = dict.fromkeys(MEMBER_STATUSES, 0)
        for member in cluster.members:
            counts[member.status.value] = counts.get(member.status.value, 0) + 1
        yield _gauges(
            "p2pshard_cluster_members",
            "Members this node knows of, by status.",
            ("status",),
            (((status,), n) for status, n in counts.items()),
        )
        statistics = cluster.statistics()
        yield _gauge(
            "p2pshard_cluster_unreachable_members",
            "Members some member (not Down) cannot reach, as this node's gossip says.",
            statistics.unreachable,
        )
        own = cluster.self_member.status
        yield _gauges(
            "p2pshard_cluster_self_status",
            "1 for this node's own member status, 0 for the others.",
            ("status",),
            (((s.value,), float(s is own)) for s in MemberStatus),
        )
        yield _gauge(
            "p2pshard_cluster_is_leader",
            "1 if this node is the leader as it sees the cluster, else 0.",
            float(statistics.leader == cluster.self_address),
        )
        yield _gauge(
            "p2pshard_cluster_converged",
            "1 if every reachable member has seen the current gossip, else 0.",
            float(statistics.convergence),
        )
        yield _counters(
            "p2pshard_cluster_messages_refused_total",
            "Messages refused for who sent them (not a member, forged author, a client's "
            "identity...), by kind.",
            ("kind",),
            (((kind,), n) for kind, n in statistics.refused),
        )
        phi: dict[str, float] = {}
        members = {member.node for member in cluster.members}
        for node, value in cluster.failure_detector_phi().items():
            if node not in members:
                continue  # a detector left over from a removed member says nothing of use
            # Two incarnations at one address can overlap for a moment: the more suspect wins.
            key = str(node.address)
            phi[key] = max(value, phi.get(key, 0.0))
        yield _gauges(
            "p2pshard_failure_detector_phi",
            "Phi of each watched peer's failure detector: suspicion that it is gone; the peer "
            "is marked unreachable at failure_detector.threshold (8 by default).",
            ("peer",),
            (((peer,), value) for peer, value in sorted(phi.items())),
        )

    # -- the transport ----------------------------------------------------------------------

    def _transport(self) -> Iterator[Metric]:
        t = self._node.transport_statistics()
        yield _counter(
            "p2pshard_transport_received_messages_total",
            "Messages received and handed to the node.",
            t.messages_received,
        )
        yield _counter(
            "p2pshard_transport_received_frames_total",
            "Frames received, from every peer.",
            t.frames_received,
        )
        yield _counter(
            "p2pshard_transport_received_bytes_total",
            "Bytes of the frames received (length prefixes included), from every peer.",
            t.bytes_received,
        )
        yield _gauge("p2pshard_transport_inbound_links", "Inbound links open now.", t.inbound_links)
        yield _gauge(
            "p2pshard_transport_inbox_messages",
            "Messages received and waiting for the node to take them.",
            t.inbox_size,
        )
        yield _counter(
            "p2pshard_transport_handshakes_refused_total",
            "Links refused during set-up: bad or missing certificate, another cluster, a bad "
            "hello, a certificate on the deny list.",
            t.handshakes_refused,
        )
        yield _counter(
            "p2pshard_transport_connections_refused_busy_total",
            "Connections closed as soon as accepted: too many handshakes were pending.",
            t.connections_refused_busy,
        )
        yield _counter(
            "p2pshard_transport_accepts_failed_total",
            "Accepts that failed for lack of file descriptors or memory.",
            t.accepts_failed,
        )
        yield _counters(
            "p2pshard_transport_links_closed_total",
            "Links closed for what came over them, by cause.",
            ("cause",),
            (
                (("frame_too_large",), t.links_closed_frame_too_large),
                (("truncated",), t.links_closed_truncated),
                (("undecodable",), t.links_closed_undecodable),
                (("tls_error",), t.links_closed_tls_error),
                (("refused_messages",), t.links_closed_refused),
            ),
        )
        yield _counters(
            "p2pshard_transport_messages_dropped_total",
            "Messages dropped, by cause: received ones of an unknown type or with rejected "
            "fields (undecodable) or for another incarnation of this node "
            "(wrong_incarnation); ones not sent because the peer's link speaks an older wire "
            "protocol, or there was no link yet (protocol_version).",
            ("cause",),
            (
                (("undecodable",), t.messages_dropped_undecodable),
                (("wrong_incarnation",), t.messages_dropped_wrong_incarnation),
                (("protocol_version",), t.messages_not_sent_protocol),
            ),
        )
        peers = sorted(t.peers, key=lambda p: str(p.address))
        names = [(str(p.address),) for p in peers]
        per_peer = (
            ("p2pshard_transport_sent_frames", "Frames sent to the peer.", "frames_sent"),
            (
                "p2pshard_transport_sent_bytes",
                "Bytes of the frames sent to the peer.",
                "bytes_sent",
            ),
            ("p2pshard_transport_connects", "Links to the peer established.", "connects"),
            (
                "p2pshard_transport_connect_failures",
                "Attempts to link to the peer that failed.",
                "connect_failures",
            ),
            (
                "p2pshard_transport_frames_lost_in_flight",
                "Frames handed to a link to the peer that then broke: maybe delivered, maybe not.",
                "frames_lost_in_flight",
            ),
            (
                "p2pshard_transport_send_queue_full",
                "Times a send found the peer's send queue full.",
                "send_queue_full",
            ),
        )
        for name, documentation, field in per_peer:
            yield _counters(
                f"{name}_total",
                documentation,
                ("peer",),
                zip(names, (getattr(p, field) for p in peers), strict=True),
            )
        yield _gauges(
            "p2pshard_transport_send_queue_frames",
            "Frames waiting in the peer's send queue.",
            ("peer",),
            zip(names, (p.queued_frames for p in peers), strict=True),
        )
        yield _gauges(
            "p2pshard_transport_peer_connected",
            "1 while the outbound link to the peer is established, else 0.",
            ("peer",),
            zip(names, (float(p.connected) for p in peers), strict=True),
        )

    # -- sharding ---------------------------------------------------------------------------

    def _sharding(self) -> Iterator[Metric]:
        sharding = self._node.sharding
        regions = [sharding.region(name).statistics() for name in sorted(sharding.type_names)]
        rows = (
            (
                "p2pshard_sharding_shards",
                "Shards of the entity type hosted on this node.",
                "shards",
                False,
            ),
            (
                "p2pshard_sharding_entities",
                "Active entities of the entity type on this node.",
                "entities",
                False,
            ),
            (
                "p2pshard_sharding_region_buffered_messages",
                "Messages the region holds until their shard's home is known (or a hand-off ends).",
                "buffered",
                False,
            ),
            (
                "p2pshard_sharding_known_shard_homes",
                "Shards whose home the region knows.",
                "known_homes",
                False,
            ),
            (
                "p2pshard_sharding_entity_workers",
                "Tasks running the region's entities now.",
                "workers",
                False,
            ),
            (
                "p2pshard_sharding_shard_home_requests_total",
                "GetShardHome requests the region sent to the coordinator.",
                "shard_home_requests",
                True,
            ),
            (
                "p2pshard_sharding_messages_delivered_locally_total",
                "Messages sent on this node to entities of shards that stay on it (into their "
                "mailbox, or buffered until the shard's home is known).",
                "delivered_local",
                True,
            ),
            (
                "p2pshard_sharding_messages_sent_remote_total",
                "Messages sent on this node to entities whose shard is on another node.",
                "sent_remote",
                True,
            ),
            (
                "p2pshard_sharding_messages_received_remote_total",
                "Messages for the entity type received from other nodes.",
                "received_remote",
                True,
            ),
            (
                "p2pshard_sharding_batches_sent_total",
                "Batches (EntityDeliveries) sent: messages gathered while a link was busy.",
                "batches_sent",
                True,
            ),
        )
        names = [(r.type_name,) for r in regions]
        for name, documentation, field, counter in rows:
            family = _counters if counter else _gauges
            yield family(
                name,
                documentation,
                ("entity_type",),
                zip(names, (getattr(r, field) for r in regions), strict=True),
            )
        yield _gauges(
            "p2pshard_sharding_region_registered",
            "1 once the region (or proxy) registered with its coordinator, else 0.",
            ("entity_type",),
            zip(names, (float(r.registered) for r in regions), strict=True),
        )
        yield _gauges(
            "p2pshard_sharding_region_is_proxy",
            "1 if the entity type runs here as a proxy (routes only, hosts no shards).",
            ("entity_type",),
            zip(names, (float(r.proxy) for r in regions), strict=True),
        )
        yield _counters(
            "p2pshard_sharding_region_dropped_messages_total",
            "Messages the region dropped, by reason: its buffer was full (buffer_full), it had "
            "stopped (stopped) or was refused by the coordinator (refused), a send queue stayed "
            "full (send_queue_full), the transport refused the message (not_sent).",
            ("entity_type", "reason"),
            (((r.type_name, reason), n) for r in regions for reason, n in sorted(r.drops.items())),
        )
        yield from self._asks(regions)
        yield _counters(
            "p2pshard_sharding_entity_activations_total",
            "Entity incarnations started on this node (on a first message, a remembered "
            "entity's restart, or after a passivation with messages waiting).",
            ("entity_type",),
            zip(names, (r.activations for r in regions), strict=True),
        )
        yield _counters(
            "p2pshard_sharding_entity_passivations_total",
            "Entity incarnations stopped on this node: passivated (by itself, when idle, over "
            "the active-entity limit) or stopped for a hand-off or a lost lease.",
            ("entity_type",),
            zip(names, (r.passivations for r in regions), strict=True),
        )
        yield _histograms(
            "p2pshard_sharding_shard_home_lookup_duration_seconds",
            "Seconds from a region's first GetShardHome for a shard to the coordinator's answer "
            "(ShardHome, or HostShard when the shard comes here).",
            ("entity_type",),
            zip(names, (r.shard_home_lookups for r in regions), strict=True),
        )
        yield from self._coordinators(sharding)

    def _asks(self, regions: Sequence[RegionStatistics]) -> Iterator[Metric]:
        names = [(r.type_name,) for r in regions]
        yield _counters(
            "p2pshard_sharding_asks_total",
            "Asks made from this node to entities of the type.",
            ("entity_type",),
            zip(names, (r.asks for r in regions), strict=True),
        )
        yield _histograms(
            "p2pshard_sharding_ask_duration_seconds",
            "Seconds from an ask made on this node to its answer (a value or an error; asks "
            "that timed out are not in it).",
            ("entity_type",),
            zip(names, (r.ask_seconds for r in regions), strict=True),
        )
        yield _counters(
            "p2pshard_sharding_ask_failures_total",
            "Asks made from this node that did not end with a value, by reason: timeout, "
            "entity_error (the entity raised), buffer_full, region_stopped, not_delivered.",
            ("entity_type", "reason"),
            (((r.type_name, reason), n) for r in regions for reason, n in r.ask_failures.items()),
        )

    def _coordinators(self, sharding: Sharding) -> Iterator[Metric]:
        stats = [
            s
            for s in (sharding.coordinator_statistics(n) for n in sorted(sharding.type_names))
            if s is not None
        ]
        names = [(s.type_name,) for s in stats]
        yield _gauges(
            "p2pshard_sharding_coordinator_running",
            "1 while the entity type's coordinator runs on this node (the oldest member of "
            "its role), else 0.",
            ("entity_type",),
            zip(names, (float(s.running) for s in stats), strict=True),
        )
        yield _counters(
            "p2pshard_sharding_rebalance_rounds_total",
            "Rebalance rounds of the coordinator on this node: the allocation strategy was "
            "asked which shards to move.",
            ("entity_type",),
            zip(names, (s.rebalance_rounds for s in stats), strict=True),
        )
        yield _counters(
            "p2pshard_sharding_handoffs_total",
            "Hand-offs the coordinator on this node ended, by outcome: completed, timed_out "
            "(the shard stays), region_gone (the owner was terminated meanwhile).",
            ("entity_type", "outcome"),
            (((s.type_name, outcome), n) for s in stats for outcome, n in s.handoffs.items()),
        )
        yield _histograms(
            "p2pshard_sharding_handoff_duration_seconds",
            "Seconds from the coordinator's BeginHandOff to the shard's deallocation, of the "
            "completed hand-offs.",
            ("entity_type",),
            zip(names, (s.handoff_seconds for s in stats), strict=True),
        )

    # -- replicated state and leases --------------------------------------------------------

    def _replicators(self) -> Iterator[Metric]:
        replicators = sorted(self._node.replicators.items())
        stats = [r.statistics(key_sizes=False) for _, r in replicators]
        names = [(name,) for name, _ in replicators]
        rows = (
            ("p2pshard_replicator_keys", "Keys held (deleted ones not counted).", "keys", False),
            (
                "p2pshard_replicator_deleted_keys",
                "Tombstones of deleted keys held.",
                "deleted_keys",
                False,
            ),
            (
                "p2pshard_replicator_pending_writes",
                "Updates and deletes waiting for replicas to acknowledge.",
                "pending_writes",
                False,
            ),
            (
                "p2pshard_replicator_pending_reads",
                "Reads waiting for replicas to answer.",
                "pending_reads",
                False,
            ),
            (
                "p2pshard_replicator_gossip_sent_messages_total",
                "Anti-entropy and delta messages sent.",
                "gossip_messages_sent",
                True,
            ),
            (
                "p2pshard_replicator_gossip_received_messages_total",
                "Anti-entropy and delta messages received.",
                "gossip_messages_received",
                True,
            ),
            (
                "p2pshard_replicator_gossip_sent_bytes_total",
                "Payload bytes (updates, states, digests) in the gossip messages sent.",
                "gossip_bytes_sent",
                True,
            ),
            (
                "p2pshard_replicator_gossip_received_bytes_total",
                "Payload bytes in the gossip messages received.",
                "gossip_bytes_received",
                True,
            ),
            (
                "p2pshard_replicator_malformed_messages_total",
                "Messages from peers dropped as malformed.",
                "malformed_messages",
                True,
            ),
            (
                "p2pshard_replicator_dropped_sends_total",
                "Messages not sent because a peer's send queue was full.",
                "dropped_sends",
                True,
            ),
            (
                "p2pshard_replicator_store_batches_total",
                "Transactions committed to the durable store.",
                "store_batches",
                True,
            ),
            (
                "p2pshard_replicator_store_failures_total",
                "Transactions of the durable store that failed.",
                "store_failures",
                True,
            ),
        )
        for name, documentation, field, counter in rows:
            family = _counters if counter else _gauges
            yield family(
                name,
                documentation,
                ("replicator",),
                zip(names, (getattr(s, field) for s in stats), strict=True),
            )
        labels = ("replicator", "operation", "consistency")
        operations = [
            ((name, o.operation, o.consistency), o)
            for (name, _), s in zip(replicators, stats, strict=True)
            for o in s.operations
        ]
        yield _counters(
            "p2pshard_replicator_operations_total",
            "Reads (get), writes (update) and deletes called on this node, by consistency "
            "level: local, from, to, majority, majority_plus, all.",
            labels,
            ((values, o.started) for values, o in operations),
        )
        yield _counters(
            "p2pshard_replicator_operation_failures_total",
            "Reads, writes and deletes called on this node that failed (too few replicas "
            "answered in time, the store failed, the replicator stopped).",
            labels,
            ((values, o.failed) for values, o in operations),
        )
        yield _histograms(
            "p2pshard_replicator_operation_duration_seconds",
            "Seconds from a read, write or delete called on this node to its success.",
            labels,
            ((values, o.seconds) for values, o in operations),
        )

    def _leases(self) -> Iterator[Metric]:
        try:
            leases = self._node.leases
        except ConfigurationError:
            return  # no lease backend: no lease metrics
        yield _gauge(
            "p2pshard_leases_held",
            "Leases this node holds now (shard leases, singletons', the downing lease).",
            len(leases.held()),
        )
        stats = leases.statistics()
        yield _counters(
            "p2pshard_leases_acquisitions_total",
            "Lease acquisitions this node tried, by outcome: granted, refused (another owner "
            "holds it), unavailable (the backend did not answer or failed).",
            ("outcome",),
            (((outcome,), n) for outcome, n in stats.acquisitions.items()),
        )
        yield _counters(
            "p2pshard_leases_renewals_total",
            "Lease renewals by outcome: renewed, refused (the lease is lost), failed (no "
            "answer in time or an error; tried again until the deadline).",
            ("outcome",),
            (((outcome,), n) for outcome, n in stats.renewals.items()),
        )
        yield _histograms(
            "p2pshard_leases_renewal_duration_seconds",
            "Seconds from sending a lease renewal to the backend's yes.",
            (),
            (((), stats.renewal_seconds),),
        )
        yield _counter(
            "p2pshard_leases_lost_total",
            "Leases lost while held: a renewal refused, or the deadline passed without one.",
            stats.lost,
        )

    def _journal(self) -> Iterator[Metric]:
        try:
            journal = self._node.journal
        except ConfigurationError:
            return  # no journal: no journal metrics
        stats = journal_statistics(journal)
        yield _counter(
            "p2pshard_journal_appends_total",
            "Appends of event-sourced entities to the node's journal (one per persist).",
            stats.appends,
        )
        yield _counter(
            "p2pshard_journal_appended_events_total",
            "Events in the appends that succeeded.",
            stats.events,
        )
        yield _counters(
            "p2pshard_journal_append_failures_total",
            "Appends the journal refused or failed, by reason: fenced (a newer lease holder "
            "raised the stream's fence), conflict (another writer took the sequence number), "
            "error (the storage failed).",
            ("reason",),
            (((reason,), n) for reason, n in stats.append_failures.items()),
        )
        yield _histograms(
            "p2pshard_journal_append_duration_seconds",
            "Seconds each successful append to the node's journal took.",
            (),
            (((), stats.append_seconds),),
        )


def metrics_registry(node: Node, *, process: bool = True) -> CollectorRegistry:
    """A registry of ``node``'s metrics, and with ``process`` the Python process's.

    The process metrics are ``prometheus_client``'s usual ones: CPU seconds, resident memory,
    open file descriptors (``process_...``, on Linux), the Python version (``python_info``) and
    the garbage collector's counts (``python_gc_...``).

    Example:
        >>> async def scrape(node: Node) -> bytes:
        ...     return generate_latest(metrics_registry(node))
    """
    registry = CollectorRegistry()
    registry.register(NodeCollector(node))
    if process:
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)
    return registry


def metrics_text(node: Node, *, process: bool = True) -> bytes:
    """``node``'s metrics now, in Prometheus' text format.

    Serve them with the ``Content-Type`` :data:`METRICS_CONTENT_TYPE`. Call it from a task of
    the node (its trio thread). See :func:`metrics_registry` for ``process``.

    Example:
        >>> async def metrics_route(node: Node) -> tuple[bytes, str]:
        ...     return metrics_text(node), METRICS_CONTENT_TYPE
    """
    return generate_latest(metrics_registry(node, process=process))
