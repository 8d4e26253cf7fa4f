"""The live dashboard of the management endpoint: its static page, series and event timeline.

Theory of operation. ``GET /`` on the management port serves a small page (``index.html``,
``dashboard.js``, ``dashboard.css`` in this package, shipped in the wheel) that polls
``GET /dashboard/state`` about once a second and draws what it gets as HTML and inline SVG:
members, shards per node, entities per type, two charts and a timeline. Nothing is fetched from
elsewhere; the page's Content-Security-Policy says so to the browser too.

The state has three parts the node keeps for it:

- the members and each entity type's regions, read when asked, from the same sources as
  ``/cluster/members`` and ``/cluster/shards/{type}`` (``StatusService``);
- :class:`RateSampler`, sans-IO: fed (time, counter values) once a second, it keeps the last
  minutes of messages delivered per second, asks per second and their mean latency per interval.
  The values are read by metric name from the node's Prometheus collector
  (:data:`SAMPLED`); a metric this build does not have gives "no data", not an error;
- :class:`EventLog`, sans-IO: a bounded ring of cluster events (joins, Up, unreachable,
  reachable again, downed, removed, leader changes) made from the membership's events, and of
  the shard hand-offs and rebalance rounds this node sees (``Sharding.listen``). It notes only
  changes, so subscribing again after falling behind repeats nothing.

:class:`Dashboard` is the trio shell: the management endpoint's nursery runs :meth:`Dashboard.run`
(sample every second, follow the cluster's events, listen to sharding) for as long as the
endpoint serves, and :meth:`Dashboard.state` answers the page.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any

import attrs
import trio
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from membership import (
    Cluster,
    ClusterError,
    ClusterEvent,
    LeaderChanged,
    Member,
    MemberDowned,
    MemberExited,
    MemberJoined,
    MemberLeft,
    MemberRemoved,
    MemberStatus,
    MemberUp,
    MemberWeaklyUp,
    ReachableMember,
    UniqueAddress,
    UnreachableMember,
)

from .._metrics import Node as MetricsNode
from .._metrics import metrics_registry
from .._status import StatusService, reply_json
from ..sharding._services import ShardingEvent
from ..sharding._sharding import Sharding

MESSAGES = "messages"
"""Messages per second on the dashboard: the rate of the :data:`DELIVERED` counters' sum over
entity types, which :func:`reading` gives under this name."""
DELIVERED = (
    "p2pshard_sharding_messages_delivered_locally_total",
    "p2pshard_sharding_messages_received_remote_total",
)
"""Messages for entities on this node: sent on this node, and received from other nodes."""
ASKS = "p2pshard_sharding_asks_total"
"""Asks made from this node, by entity type."""
ASK_SECONDS_SUM = "p2pshard_sharding_ask_duration_seconds_sum"
ASK_SECONDS_COUNT = "p2pshard_sharding_ask_duration_seconds_count"
"""The ask latency histogram's sum and count: their increases give the mean per interval."""
SAMPLED = (*DELIVERED, ASKS, ASK_SECONDS_SUM, ASK_SECONDS_COUNT)
"""The sample names the dashboard reads; any of them may be missing."""

Reading = Mapping[tuple[str, str], float]
"""Counter values at one moment: (sample name, entity type) -> value."""

ASSETS: dict[str, str] = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
"""The page's files, with their ``Content-Type``."""

SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
)
"""Sent with every file of the page: it loads nothing but its own files."""


def asset(name: str) -> tuple[bytes, str] | None:
    """One of the page's files and its ``Content-Type``; None if there is no such file."""
    content_type = ASSETS.get(name)
    if content_type is None:
        return None
    return resources.files(__package__).joinpath(name).read_bytes(), content_type


def metric_families(node: MetricsNode) -> Iterable[Metric]:
    """``node``'s metric families now, as ``GET /metrics`` gives them (without the process')."""
    return metrics_registry(node, process=False).collect()


def reading(families: Iterable[Metric]) -> dict[tuple[str, str], float]:
    """The :data:`SAMPLED` values among ``families``, by sample name and entity type.

    The :data:`DELIVERED` ones are added up under :data:`MESSAGES`.
    """
    values: dict[tuple[str, str], float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in SAMPLED:
                name = MESSAGES if sample.name in DELIVERED else sample.name
                key = (name, _entity_type(sample))
                values[key] = values.get(key, 0.0) + sample.value
    return values


def _entity_type(sample: Sample) -> str:
    return sample.labels.get("entity_type", "")


# --- the series ------------------------------------------------------------------------------


@attrs.frozen
class Point:
    """One interval of the series, ending at ``at`` (seconds, the sampler's clock)."""

    at: float
    messages_per_second: float | None
    """None: the messages counter is missing."""
    asks_per_second: float | None
    """None: the asks counter is missing."""
    ask_latency: float | None
    """Mean seconds of the asks answered in the interval; None: none were, or no histogram."""


def _increase(name: str, before: Reading, now: Reading) -> float | None:
    """How much the counters of ``name`` grew, summed over entity types (None: no such counter).

    A value lower than before is a counter that started again (its region restarted): all of it
    is new, as Prometheus' ``rate`` takes it. A type not there before started meanwhile.
    """
    keys = [key for key in now if key[0] == name]
    if not keys:
        return None
    grown = 0.0
    for key in keys:
        old = before.get(key)
        grown += now[key] if old is None or now[key] < old else now[key] - old
    return grown


class RateSampler:
    """The last minutes of messages and asks per second and ask latency. Sans-IO.

    Feed it :meth:`add` once per interval with the time (any monotonic clock, in seconds) and
    the counter values then; each call after the first makes a :class:`Point`.

    Example:
        >>> sampler = RateSampler(keep=3)
        >>> sampler.add(10.0, {(MESSAGES, "Room"): 5.0})
        >>> sampler.add(12.0, {(MESSAGES, "Room"): 25.0})
        >>> sampler.points()[-1].messages_per_second
        10.0
    """

    def __init__(self, *, keep: int = 300) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 point, not {keep}")
        self._points: deque[Point] = deque(maxlen=keep)
        self._last: tuple[float, Reading] | None = None

    def add(self, now: float, values: Reading) -> None:
        """Take the counter values at ``now``; ignored if ``now`` is not after the last time."""
        last = self._last
        if last is not None and now <= last[0]:
            return
        self._last = (now, dict(values))
        if last is None:
            return
        then, before = last
        seconds = now - then
        messages = _increase(MESSAGES, before, values)
        asks = _increase(ASKS, before, values)
        answered = _increase(ASK_SECONDS_COUNT, before, values)
        waited = _increase(ASK_SECONDS_SUM, before, values)
        latency = waited / answered if waited is not None and answered else None
        self._points.append(
            Point(
                at=now,
                messages_per_second=None if messages is None else messages / seconds,
                asks_per_second=None if asks is None else asks / seconds,
                ask_latency=latency,
            )
        )

    def points(self) -> list[Point]:
        """The points kept, oldest first."""
        return list(self._points)

    def series_json(self) -> dict[str, Any]:
        """The points as JSON: each point's age in seconds (0 the newest) and its values.

        ``messages``/``asks`` say whether the counters exist at all (false: "no data"); a
        latency of null is an interval with no asks answered.
        """
        points = list(self._points)
        newest = points[-1].at if points else 0.0
        return {
            "ages": [round(p.at - newest, 3) for p in points],
            "messages_per_second": [_rounded(p.messages_per_second) for p in points],
            "asks_per_second": [_rounded(p.asks_per_second) for p in points],
            "ask_latency_ms": [
                None if p.ask_latency is None else round(p.ask_latency * 1000, 3) for p in points
            ],
            "messages": bool(points) and points[-1].messages_per_second is not None,
            "asks": bool(points) and points[-1].asks_per_second is not None,
            "latency": bool(points) and any(p.ask_latency is not None for p in points),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 2)


# --- the event timeline ----------------------------------------------------------------------


@attrs.frozen
class Event:
    """One entry of the timeline."""

    time: float
    """Seconds since the epoch (wall clock)."""
    kind: str
    """``joined``, ``weakly-up``, ``up``, ``leaving``, ``exiting``, ``downed``, ``removed``,
    ``unreachable``, ``reachable``, ``leader``, ``hand-off`` or ``rebalance``."""
    subject: str
    """The member's name, or the entity type."""
    text: str


_STATUS_KINDS: dict[type, str] = {
    MemberJoined: "joined",
    MemberWeaklyUp: "weakly-up",
    MemberUp: "up",
    MemberLeft: "leaving",
    MemberExited: "exiting",
    MemberDowned: "downed",
    MemberRemoved: "removed",
}


def _who(member: Member | UniqueAddress) -> str:
    node = member.node if isinstance(member, Member) else member
    return f"{node.name} ({node.address})"


class EventLog:
    """The last ``keep`` cluster events, newest last. Sans-IO.

    It remembers each member's status, who is unreachable and the leader, and records a
    membership event only when it changes one of them: the events a new subscription replays
    (the current state) add nothing already recorded.

    Example:
        >>> log = EventLog(keep=10)
        >>> log.record(0.0, "rebalance", "Room", "moving shard 3 off n2")
        >>> [e.kind for e in log.events()]
        ['rebalance']
    """

    def __init__(self, *, keep: int = 200) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 event, not {keep}")
        self._events: deque[Event] = deque(maxlen=keep)
        self._status: dict[UniqueAddress, MemberStatus] = {}
        self._unreachable: set[UniqueAddress] = set()
        self._leader: UniqueAddress | None = None

    def record(self, at: float, kind: str, subject: str, text: str) -> None:
        """Add an event (the oldest goes once ``keep`` are held)."""
        self._events.append(Event(at, kind, subject, text))

    def cluster_event(self, at: float, event: ClusterEvent) -> None:
        """Record a membership event if it changes what the log knows."""
        match event:
            case LeaderChanged(leader=leader):
                if leader == self._leader:
                    return
                self._leader = leader
                if leader is None:
                    self.record(at, "leader", "", "no leader: no member can act as one")
                else:
                    self.record(at, "leader", leader.name, f"{_who(leader)} is the leader")
            case UnreachableMember(member=member):
                if member.node in self._unreachable:
                    return
                self._unreachable.add(member.node)
                self.record(at, "unreachable", member.node.name, f"{_who(member)} is unreachable")
            case ReachableMember(member=member):
                if member.node not in self._unreachable:
                    return
                self._unreachable.discard(member.node)
                self.record(at, "reachable", member.node.name, f"{_who(member)} is reachable again")
            case MemberRemoved(member=member, previous_status=previous):
                if self._status.pop(member.node, None) is None:
                    return
                self._unreachable.discard(member.node)
                self.record(
                    at,
                    "removed",
                    member.node.name,
                    f"{_who(member)} was removed (it was {previous.name})",
                )
            case _:
                member = event.member
                if self._status.get(member.node) is member.status:
                    return
                self._status[member.node] = member.status
                self.record(at, _STATUS_KINDS[type(event)], member.node.name, _status_text(member))

    def settle(
        self, at: float, members: Iterable[Member], unreachable: Iterable[UniqueAddress]
    ) -> None:
        """Record what a lost stretch of events changed: removals, and reachable again.

        For a subscriber that fell behind: the state a new subscription replays says who is
        there and unreachable, not who stopped being so.
        """
        present = {m.node for m in members}
        for node in sorted(set(self._status) - present):
            was = self._status.pop(node)
            self._unreachable.discard(node)
            self.record(at, "removed", node.name, f"{_who(node)} was removed (it was {was.name})")
        for node in sorted(self._unreachable - set(unreachable)):
            self._unreachable.discard(node)
            self.record(at, "reachable", node.name, f"{_who(node)} is reachable again")

    def sharding_event(self, at: float, event: ShardingEvent) -> None:
        """Record a hand-off or rebalance round."""
        self.record(at, event.kind, event.type_name, f"{event.type_name}: {event.text}")

    def events(self) -> list[Event]:
        """The events held, oldest first."""
        return list(self._events)

    def events_json(self) -> list[dict[str, Any]]:
        """The events as JSON, oldest first."""
        return [attrs.asdict(event) for event in self._events]


def _status_text(member: Member) -> str:
    who = _who(member)
    match member.status:
        case MemberStatus.JOINING:
            roles = f" with roles {', '.join(sorted(member.roles))}" if member.roles else ""
            version = f", app version {member.app_version}" if member.app_version else ""
            return f"{who} is joining{roles}{version}"
        case MemberStatus.WEAKLY_UP:
            return f"{who} is WeaklyUp: Up on this side until the gossip converges"
        case MemberStatus.UP:
            return f"{who} is Up"
        case MemberStatus.LEAVING:
            return f"{who} is leaving"
        case MemberStatus.EXITING:
            return f"{who} is exiting: its shards and singletons are handed over"
        case MemberStatus.DOWN:
            return f"{who} was downed"
        case _:
            return f"{who} is {member.status.name}"


# --- the shell -------------------------------------------------------------------------------

SAMPLE_INTERVAL = 1.0
"""Seconds between two samples of the counters."""


@attrs.define(eq=False)
class Dashboard:
    """What the dashboard shows of one node: run :meth:`run` while the endpoint serves.

    ``families`` gives the node's metric families (:func:`metric_families`), read by name once
    per :data:`SAMPLE_INTERVAL` (None: no series).
    """

    _cluster: Cluster
    _sharding: Sharding
    _families: Callable[[], Iterable[Metric]] | None = None
    sampler: RateSampler = attrs.field(factory=RateSampler)
    """The series (the last five minutes at one point a second)."""
    log: EventLog = attrs.field(factory=EventLog)
    """The timeline."""
    _clock: Callable[[], float] = time.time
    """The wall clock the events are stamped with."""

    async def run(self) -> None:
        """Sample, follow the cluster and listen to sharding until cancelled."""
        stop = self._sharding.listen(self._on_sharding)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._follow_cluster)
                if self._families is not None:
                    nursery.start_soon(self._sample, self._families)
        finally:
            stop()

    def _on_sharding(self, event: ShardingEvent) -> None:
        self.log.sharding_event(self._clock(), event)

    async def _follow_cluster(self) -> None:
        # Every event is read to the end, and after falling behind the log is fed the state
        # again: it notes only what changed.
        while True:
            try:
                async with self._cluster.subscribe() as events:
                    async for event in events:
                        self.log.cluster_event(self._clock(), event)
            except ClusterError:
                cluster = self._cluster
                unreachable = [m.node for m in cluster.unreachable]
                self.log.settle(self._clock(), cluster.members, unreachable)

    async def _sample(self, families: Callable[[], Iterable[Metric]]) -> None:
        while True:
            self.sampler.add(trio.current_time(), reading(families()))
            await trio.sleep(SAMPLE_INTERVAL)

    async def state(self, status: StatusService, stats_timeout: float) -> dict[str, Any]:
        """What ``GET /dashboard/state`` answers: members, entity types, series and events."""
        view = reply_json(await status.status(1, stats_timeout))
        types = [
            {
                "type_name": t["type_name"],
                "regions": [
                    {key: r[key] for key in ("name", "address", "shard_count", "entity_count")}
                    for r in t["regions"]
                ],
                "shards": sum(r["shard_count"] for r in t["regions"]),
                "entities": sum(r["entity_count"] for r in t["regions"]),
                "failed": t["failed"],
                "error": t["error"],
                "proxy": bool(t["region"].get("proxy", False)),
            }
            for t in view["entity_types"]
        ]
        return {
            "time": self._clock(),
            "self": view["node"],
            "leader": view["leader"],
            "oldest": view["oldest"],
            "members": view["members"],
            "unreachable": view["unreachable"],
            "entity_types": types,
            "series": self.sampler.series_json(),
            "events": self.log.events_json(),
        }
