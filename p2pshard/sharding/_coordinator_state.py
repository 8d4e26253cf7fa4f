"""The shard coordinator's state, folded from domain events, and its form in the replicator.

Theory of operation: as Pekko's ``ShardCoordinator.State``, the state says which regions and
region proxies are registered and where each shard lives, and changes only through
:meth:`CoordinatorState.updated`, a pure function of one :class:`DomainEvent` that checks the
event fits (registering a region twice, allocating to an unknown region, deallocating an
unallocated shard are :class:`IllegalCoordinatorEvent`, and the state is left as it was), or
:meth:`CoordinatorState.updated_all` for a batch of events. With remember-entities a terminated
region's shards become *unallocated* rather than forgotten, so the new coordinator starts them
elsewhere. :class:`StateDraft` is the same fold done in place, for the coordinator's view of
what its pending writes will make: it costs per event what the event touches, where a new
frozen state costs a copy of every shard home.

In ddata mode the state lives in one replicator key as a pycrdt document of four maps (regions,
proxies, shard homes, unallocated shards). :func:`apply_event` records one event in that
document and :func:`apply_events` a batch of them (the ``modify`` function of one write);
:meth:`CoordinatorState.from_document` reads it back. A region is written as
``name@host:port#uid`` (its node's incarnation). Map entries, not one serialized blob, so a
write touches only what its events changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs
from pycrdt import Doc, Map

from membership import Address, ClusterError, UniqueAddress

from ._allocation import ShardId


class IllegalCoordinatorEvent(ClusterError, ValueError):
    """A domain event that does not fit the coordinator's state (a bug in the coordinator)."""


@attrs.frozen
class ShardRegionRegistered:
    """A region (hosting entities) registered with the coordinator."""

    region: UniqueAddress


@attrs.frozen
class ShardRegionProxyRegistered:
    """A region proxy (hosting nothing) registered with the coordinator."""

    proxy: UniqueAddress


@attrs.frozen
class ShardRegionTerminated:
    """A region's node left the cluster; its shards are deallocated."""

    region: UniqueAddress


@attrs.frozen
class ShardRegionProxyTerminated:
    """A region proxy's node left the cluster."""

    proxy: UniqueAddress


@attrs.frozen
class ShardHomeAllocated:
    """``shard`` lives in ``region`` from now on."""

    shard: ShardId
    region: UniqueAddress


@attrs.frozen
class ShardHomeDeallocated:
    """``shard`` has no home (it was handed off, or its region terminated)."""

    shard: ShardId


DomainEvent: TypeAlias = (
    ShardRegionRegistered
    | ShardRegionProxyRegistered
    | ShardRegionTerminated
    | ShardRegionProxyTerminated
    | ShardHomeAllocated
    | ShardHomeDeallocated
)


@attrs.frozen
class CoordinatorState:
    """Regions, proxies and shard homes. Build new states with :meth:`updated`.

    Example:
        >>> region = UniqueAddress(Address("10.0.0.1", 1), "n1", 7)
        >>> state = CoordinatorState().updated(ShardRegionRegistered(region))
        >>> state.updated(ShardHomeAllocated(ShardId("3"), region)).shards
        {'3': UniqueAddress(address=Address(host='10.0.0.1', port=1), name='n1', uid=7)}
    """

    shards: Mapping[ShardId, UniqueAddress] = attrs.field(factory=dict)
    regions: Mapping[UniqueAddress, tuple[ShardId, ...]] = attrs.field(factory=dict)
    region_proxies: frozenset[UniqueAddress] = frozenset()
    unallocated_shards: frozenset[ShardId] = frozenset()
    remember_entities: bool = False

    def updated(self, event: DomainEvent) -> CoordinatorState:
        """The state after ``event``.

        Raises:
            IllegalCoordinatorEvent: the event does not fit this state (nothing changes).
        """
        return self.updated_all((event,))

    def updated_all(self, events: Sequence[DomainEvent]) -> CoordinatorState:
        """The state after ``events``, in order: one copy of the state, however many events.

        Raises:
            IllegalCoordinatorEvent: an event does not fit the state the ones before it made
                (nothing changes).
        """
        draft = StateDraft.of(self)
        for event in events:
            draft.apply(event)
        return draft.frozen()

    def summary(self) -> str:
        """A one-line description for errors and logs."""
        return (
            f"{len(self.regions)} regions, {len(self.region_proxies)} proxies, "
            f"{len(self.shards)} shards allocated, {len(self.unallocated_shards)} unallocated"
        )

    @classmethod
    def from_document(cls, doc: Doc[Any], *, remember_entities: bool = False) -> CoordinatorState:
        """Read the state that :func:`apply_event` recorded in ``doc``.

        A shard whose region is not registered (possible only if two coordinators wrote at
        once, as in a split brain) is left out, so the result always satisfies the invariants.
        """
        regions_map, proxies_map, shards_map, unallocated_map = _maps(doc)
        regions: dict[UniqueAddress, list[ShardId]] = {
            decode_region(key): [] for key in sorted(regions_map.keys())
        }
        shards: dict[ShardId, UniqueAddress] = {}
        for shard in sorted(shards_map.keys()):
            region = decode_region(str(shards_map[shard]))
            if region in regions:
                shards[ShardId(shard)] = region
                regions[region].append(ShardId(shard))
        return cls(
            shards=shards,
            regions={region: tuple(ids) for region, ids in regions.items()},
            region_proxies=frozenset(decode_region(key) for key in list(proxies_map.keys())),
            unallocated_shards=frozenset(
                ShardId(s) for s in list(unallocated_map.keys()) if s not in shards
            )
            if remember_entities
            else frozenset(),
            remember_entities=remember_entities,
        )


@attrs.define(eq=False)
class StateDraft:
    """A :class:`CoordinatorState` edited in place, event by event.

    Each event costs what it touches, not a copy of every shard home: the coordinator keeps one
    as the state its pending writes will make (and :meth:`CoordinatorState.updated_all` folds
    a batch of events with one), so that deciding a thousand allocations does not copy a state
    of ten thousand shards a thousand times. A region's shards stay in allocation order.
    """

    shards: dict[ShardId, UniqueAddress]
    regions: dict[UniqueAddress, list[ShardId]]
    region_proxies: set[UniqueAddress]
    unallocated_shards: set[ShardId]
    remember_entities: bool

    @classmethod
    def of(cls, state: CoordinatorState) -> StateDraft:
        """A draft holding a copy of ``state``."""
        return cls(
            shards=dict(state.shards),
            regions={region: list(ids) for region, ids in state.regions.items()},
            region_proxies=set(state.region_proxies),
            unallocated_shards=set(state.unallocated_shards),
            remember_entities=state.remember_entities,
        )

    def frozen(self) -> CoordinatorState:
        """The state the draft holds now (a copy: later edits of the draft do not change it)."""
        return CoordinatorState(
            shards=dict(self.shards),
            regions={region: tuple(ids) for region, ids in self.regions.items()},
            region_proxies=frozenset(self.region_proxies),
            unallocated_shards=frozenset(self.unallocated_shards),
            remember_entities=self.remember_entities,
        )

    def apply(self, event: DomainEvent) -> None:
        """Edit the draft as ``event`` says (see :meth:`CoordinatorState.updated`).

        Raises:
            IllegalCoordinatorEvent: the event does not fit the draft (nothing changes).
        """
        match event:
            case ShardRegionRegistered(region=region):
                self._require(region not in self.regions, f"region {region} already registered")
                self.regions[region] = []
            case ShardRegionProxyRegistered(proxy=proxy):
                self._require(
                    proxy not in self.region_proxies, f"region proxy {proxy} already registered"
                )
                self.region_proxies.add(proxy)
            case ShardRegionTerminated(region=region):
                self._require(region in self.regions, f"terminated region {region} unknown")
                lost = self.regions.pop(region)
                for shard in lost:
                    del self.shards[shard]
                if self.remember_entities:
                    self.unallocated_shards.update(lost)
            case ShardRegionProxyTerminated(proxy=proxy):
                self._require(
                    proxy in self.region_proxies, f"terminated region proxy {proxy} unknown"
                )
                self.region_proxies.discard(proxy)
            case ShardHomeAllocated(shard=shard, region=region):
                self._require(region in self.regions, f"region {region} not registered")
                self._require(
                    shard not in self.shards,
                    f"shard {shard!r} already allocated to {self.shards.get(shard)}",
                )
                self.shards[shard] = region
                self.regions[region].append(shard)
                self.unallocated_shards.discard(shard)
            case ShardHomeDeallocated(shard=shard):
                self._require(shard in self.shards, f"shard {shard!r} not allocated")
                self.regions[self.shards.pop(shard)].remove(shard)
                if self.remember_entities:
                    self.unallocated_shards.add(shard)
            case _:
                raise IllegalCoordinatorEvent(f"{event!r} is not a coordinator domain event")

    def _require(self, condition: bool, problem: str) -> None:
        if not condition:
            raise IllegalCoordinatorEvent(
                f"{problem}: {len(self.regions)} regions, {len(self.region_proxies)} proxies, "
                f"{len(self.shards)} shards allocated, {len(self.unallocated_shards)} unallocated"
            )


def encode_region(region: UniqueAddress) -> str:
    """``name@host:port#uid``, the form a region takes in the replicated document."""
    return f"{region.name}@{region.address.host}:{region.address.port}#{region.uid:x}"


def decode_region(text: str) -> UniqueAddress:
    """The region written by :func:`encode_region`.

    Raises:
        IllegalCoordinatorEvent: ``text`` is not such a form.
    """
    try:
        name, rest = text.split("@", 1)
        address, uid = rest.rsplit("#", 1)
        return UniqueAddress(Address.parse(address), name, int(uid, 16))
    except (ValueError, ClusterError) as error:
        raise IllegalCoordinatorEvent(f"{text!r} is not a region: {error}") from None


def _maps(doc: Doc[Any]) -> tuple[Map[Any], Map[Any], Map[Any], Map[Any]]:
    return (
        doc.get("regions", type=Map),
        doc.get("proxies", type=Map),
        doc.get("shards", type=Map),
        doc.get("unallocated", type=Map),
    )


def apply_event(doc: Doc[Any], event: DomainEvent) -> None:
    """Record ``event`` in the replicated document (a replicator ``modify`` function).

    The caller checks the event against the state first (:meth:`CoordinatorState.updated`).
    """
    # Only the maps the event touches: each lookup is a call into pycrdt, and a new shard's
    # first message waits for this write.
    match event:
        case ShardRegionRegistered(region=region):
            doc.get("regions", type=Map)[encode_region(region)] = True
        case ShardRegionProxyRegistered(proxy=proxy):
            doc.get("proxies", type=Map)[encode_region(proxy)] = True
        case ShardRegionTerminated(region=region):
            regions, _, shards, unallocated = _maps(doc)
            key = encode_region(region)
            if key in regions:
                del regions[key]
            # Sorted: a pycrdt map's key order differs between runs, and the update's bytes
            # (so a simulated run's trace) would too.
            for shard in sorted(s for s in list(shards.keys()) if shards[s] == key):
                del shards[shard]
                unallocated[shard] = True
        case ShardRegionProxyTerminated(proxy=proxy):
            proxies = doc.get("proxies", type=Map)
            key = encode_region(proxy)
            if key in proxies:
                del proxies[key]
        case ShardHomeAllocated(shard=shard, region=region):
            doc.get("shards", type=Map)[shard] = encode_region(region)
            unallocated = doc.get("unallocated", type=Map)
            if shard in unallocated:
                del unallocated[shard]
        case ShardHomeDeallocated(shard=shard):
            shards = doc.get("shards", type=Map)
            if shard in shards:
                del shards[shard]
            doc.get("unallocated", type=Map)[shard] = True


def apply_events(doc: Doc[Any], events: Sequence[DomainEvent]) -> None:
    """Record ``events``, in order, in the replicated document: one write for a batch."""
    for event in events:
        apply_event(doc, event)


def describe_events(events: Sequence[DomainEvent], most: int = 3) -> str:
    """The events for a log line: the first ``most``, then how many more."""
    shown = ", ".join(map(str, events[:most]))
    return shown + (f" and {len(events) - most} more" if len(events) > most else "")
