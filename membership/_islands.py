"""Another cluster of the same name: finding it, and which of the two gives way (sans-IO).

Theory of operation: a partition can leave two clusters of one name running side by side (the
downed side restarts and its first seed node, seeing no other seed, forms a new cluster; Akka
leaves them apart for ever). Every member therefore *probes*: it sends InitJoin, naming its
cluster (oldest Up member and size), to every address where its cluster may have gone missing:
the seed nodes and the *contacts* (addresses a cluster of the same name was seen at, and members
downed lately), minus the addresses where its own cluster has a live member. A member answers a
probe with an InitJoinAck naming its own cluster. So each side learns of the other from the
answers to its probes *and* from the other side's probes, whatever the seed layout: a cluster
holding every seed node probes nobody, yet it hears the other one's probes.

An observation of a foreign cluster is a *sighting*: its oldest member, its size, and who vouched
for it. Its size counts only as far as distinct members of it (by certificate name: the link
names them) were heard from lately, so one certificate cannot pose as a big cluster. To be heard
by all of the other side, the member that sees another cluster first tells the members of its own
(``OtherClusterSeen``), and they probe it too, every ``seed_node_retry_interval``. Both sides
pick the same winner from the same facts (:func:`loses_to`): the bigger cluster, on a tie the one
whose oldest member sorts first. A side acts only once the facts held for a whole
``seed_probe_interval`` (a view that lags during a join or a change of size never downs anyone);
the loser downs all its members, whose supervisor restarts them; meanwhile the winner keeps
probing the addresses it saw the loser at, every ``seed_node_retry_interval``, so that the
restarted nodes, still looking for a cluster, hear of it at once and join it
(:meth:`IslandFinder.observe` for sightings, the cluster core for joining).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from .transport._address import Address, UniqueAddress

MAX_CONTACTS = 64
"""Contacts a node keeps at most (the ones heard from longest ago are forgotten first)."""

CONTACT_PROBES = 12
"""A contact is probed for this many ``seed_probe_interval`` after it was last heard from (or
its member downed), then forgotten: a node never probes an address for ever."""

FAST_PROBE_PROBES = 6
"""After a sighting, its addresses are probed every ``seed_node_retry_interval`` for this many
``seed_probe_interval``: until the loser has restarted and rejoined."""

VOUCHER_PROBES = 3
"""A member of the other cluster vouches for its size for this many ``seed_probe_interval``."""


def cluster_rank(size: int, oldest: UniqueAddress) -> tuple[int, str, int, str, int]:
    """Sort key of clusters meeting after a partition: the first one wins (see :func:`loses_to`)."""
    return (-size, oldest.address.host, oldest.address.port, oldest.name, oldest.uid)


def loses_to(
    own_size: int, own_oldest: UniqueAddress, other_size: int, other_oldest: UniqueAddress
) -> bool:
    """Whether this cluster gives way to another one of the same name that it found.

    The bigger cluster (counting Up and WeaklyUp members) wins; on a tie, the one whose oldest
    member's address sorts first (host, port, then node name; then uid, so that two incarnations
    of one node still differ). Both sides compute this from the same two facts, so exactly one
    of two different clusters loses.

    Example:
        >>> a = UniqueAddress(Address("10.0.0.1", 2551), "n1", 7)
        >>> b = UniqueAddress(Address("10.0.0.1", 2552), "n2", 3)
        >>> loses_to(1, a, 3, b), loses_to(2, a, 2, b), loses_to(2, b, 2, a)
        (True, False, True)
    """
    return cluster_rank(other_size, other_oldest) < cluster_rank(own_size, own_oldest)


class Verdict(enum.Enum):
    """What a stable sighting means for this cluster."""

    WINS = "wins"
    LOSES = "loses"


@attrs.frozen(kw_only=True)
class Sighting:
    """Another cluster of the same name, as this node has seen it lately."""

    oldest: UniqueAddress
    """Its oldest Up member."""
    size: int
    """Its size as it says (Up and WeaklyUp members)."""
    vouched: int
    """How many distinct members of it were heard from lately (its size counts up to this)."""
    addresses: tuple[Address, ...]
    """Where it was seen."""
    first_seen: float
    last_seen: float
    verdict: Verdict | None
    """Which side gives way, once the facts held long enough (None: not yet)."""


@attrs.define(eq=False)
class _Seen:
    facts: tuple[int, int, UniqueAddress]
    """Their size (as far as vouched for), our size, our oldest: what the verdict rests on."""
    claimed: int
    since: float
    """Since when ``facts`` held."""
    first: float
    last: float
    vouchers: dict[str, float] = attrs.field(factory=dict)
    addresses: dict[Address, float] = attrs.field(factory=dict)
    verdict: Verdict | None = None


@attrs.define(eq=False)
class IslandFinder:
    """One member's probes for, and sightings of, other clusters of its name.

    ``probe_interval`` is ``seed_probe_interval``; ``fast_interval`` is
    ``seed_node_retry_interval`` (probes of a sighted cluster's addresses).
    """

    self_node: UniqueAddress
    seeds: tuple[Address, ...]
    probe_interval: float
    fast_interval: float
    _contacts: dict[Address, float] = attrs.field(factory=dict)
    """Address -> until when it is probed (every ``probe_interval``)."""
    _watched: dict[Address, float] = attrs.field(factory=dict)
    """Address -> until when it is probed every ``fast_interval``: where another cluster was
    seen, by this node or another member of its cluster."""
    _seen: dict[UniqueAddress, _Seen] = attrs.field(factory=dict)
    _probed: dict[Address, float] = attrs.field(factory=dict)
    """Address -> when it was last probed (answers from elsewhere are not taken)."""
    _next_round: float = float("inf")
    _next_fast: float = float("inf")

    # ---- schedule ----

    def start(self, now: float) -> None:
        """This node became a member: probe from one interval on (its view may still lag)."""
        self._next_round = now + self.probe_interval

    def stop(self) -> None:
        """This node is no member any more: no more probes."""
        self._next_round = self._next_fast = float("inf")

    def next_deadline(self) -> float:
        """When :meth:`probe` has something to send."""
        return min(self._next_round, self._next_fast)

    def probe(self, now: float, live: set[Address]) -> list[Address]:
        """Where to send a probe now (sorted): nothing unless :meth:`next_deadline` came.

        ``live`` are the addresses of this cluster's reachable members that are not Down.
        """
        self._expire(now)
        targets: set[Address] = set()
        if now >= self._next_round:
            self._next_round = now + self.probe_interval
            targets |= set(self.seeds) | set(self._contacts)
        fast = set(self._watched) - live
        if not fast:
            self._next_fast = float("inf")
        elif now >= self._next_fast:
            targets |= fast
            self._next_fast = now + self.fast_interval
        targets -= live | {self.self_node.address}
        for address in targets:
            self._probed[address] = now
        return sorted(targets)

    def watch(self, addresses: Iterable[Address], now: float) -> bool:
        """Probe ``addresses`` every ``fast_interval`` for a while: another cluster is there.

        Returns whether any of them was not watched already.
        """
        until = now + FAST_PROBE_PROBES * self.probe_interval
        new = False
        for address in addresses:
            if address == self.self_node.address:
                continue
            new = new or address not in self._watched
            self._watched[address] = until
            if len(self._watched) > MAX_CONTACTS:
                del self._watched[min(self._watched, key=self._watched.__getitem__)]
        if new:
            self._next_fast = min(self._next_fast, now)
        return new

    def probed_lately(self, address: Address, now: float) -> bool:
        """Whether a probe went to ``address`` in the last two intervals (an answer counts)."""
        return now - self._probed.get(address, float("-inf")) <= 2 * self.probe_interval

    # ---- contacts ----

    def add_contact(self, address: Address, now: float) -> None:
        """Probe ``address`` for a while (``CONTACT_PROBES`` intervals from now)."""
        if address == self.self_node.address:
            return
        self._contacts[address] = max(
            self._contacts.get(address, now), now + CONTACT_PROBES * self.probe_interval
        )
        if len(self._contacts) > MAX_CONTACTS:
            del self._contacts[min(self._contacts, key=self._contacts.__getitem__)]

    def contacts(self) -> list[Address]:
        """The addresses probed besides the seed nodes, sorted."""
        return sorted(self._contacts)

    def addresses(self) -> set[Address]:
        """Every address this finder may probe now: seeds, contacts and watched ones."""
        return set(self.seeds) | set(self._contacts) | set(self._watched)

    # ---- sightings ----

    def observe(
        self,
        now: float,
        sender: UniqueAddress,
        their_oldest: UniqueAddress,
        their_size: int,
        own_oldest: UniqueAddress,
        own_size: int,
    ) -> Verdict | None:
        """A member of another cluster (``sender``) said what its cluster is.

        Returns the verdict once the facts held for a whole probe interval; None before.
        """
        self._expire(now)
        seen = self._seen.get(their_oldest)
        if seen is None:
            seen = self._seen[their_oldest] = _Seen(
                facts=(0, 0, own_oldest), claimed=their_size, since=now, first=now, last=now
            )
        seen.vouchers[sender.name] = now
        seen.addresses[sender.address] = now
        self.add_contact(sender.address, now)
        self.watch([sender.address], now)
        seen.claimed, seen.last = their_size, now
        facts = (min(their_size, len(seen.vouchers)), own_size, own_oldest)
        if facts != seen.facts:
            seen.facts, seen.since, seen.verdict = facts, now, None
        if seen.verdict is not None or now - seen.since < self.probe_interval:
            return None
        loses = loses_to(own_size, own_oldest, facts[0], their_oldest)
        seen.verdict = Verdict.LOSES if loses else Verdict.WINS
        return seen.verdict

    def is_new(self, their_oldest: UniqueAddress, address: Address | None = None) -> bool:
        """Whether the cluster of ``their_oldest`` was not seen lately (at ``address``)."""
        seen = self._seen.get(their_oldest)
        return seen is None or (address is not None and address not in seen.addresses)

    def sightings(self, now: float) -> list[Sighting]:
        """The other clusters seen lately, by oldest member."""
        self._expire(now)
        return [
            Sighting(
                oldest=oldest,
                size=seen.claimed,
                vouched=len(seen.vouchers),
                addresses=tuple(sorted(seen.addresses)),
                first_seen=seen.first,
                last_seen=seen.last,
                verdict=seen.verdict,
            )
            for oldest, seen in sorted(self._seen.items())
        ]

    def _expire(self, now: float) -> None:
        vouch = VOUCHER_PROBES * self.probe_interval
        for oldest, seen in list(self._seen.items()):
            for name, at in list(seen.vouchers.items()):
                if now - at > vouch:
                    del seen.vouchers[name]
            if not seen.vouchers and now - seen.last > FAST_PROBE_PROBES * self.probe_interval:
                del self._seen[oldest]
        for table in (self._contacts, self._watched):
            for address, until in list(table.items()):
                if now > until:
                    del table[address]
        horizon = 2 * self.probe_interval
        for address, at in list(self._probed.items()):
            if now - at > horizon:
                del self._probed[address]
