"""Bootstrap by discovery, sans-IO: whom a starting node joins, or whether it forms the cluster.

Theory of operation: Akka's Cluster Bootstrap. A node started with ``[discovery] method = "dns"``
has no seed nodes. Its shell looks a name up every ``resolve_interval`` and hands the addresses
found, the *contact points*, to :meth:`BootstrapCore.discovered`; it asks each contact point (an
InitJoin over the cluster transport, :class:`Probe`) whether it is a member of a cluster, and
hands each answer to :meth:`BootstrapCore.answered`. The core decides, once:

- **join** (:class:`JoinSeedNodes`) as soon as any contact point says it is a member: the node
  then joins through the contact points as through seed nodes (it asks them all and joins the
  first member that answers, and asks again if the join goes unanswered). This is also how a
  restarted node finds the cluster that went on without it.
- **form** (:class:`FormCluster`) only when all of these hold: at least
  ``required_contact_points`` were found; the set found has not changed for ``stable_margin``;
  this node is among them and has the lowest address of them; every other contact point said
  it is *not* a member lately (within three probe intervals: one lost round is forgiven); and
  ``new_cluster_enabled``. The other nodes never form: they keep asking, and join the lowest
  one once it has formed.

Why one start forms one cluster: with ``required_contact_points`` the number of nodes that start
together, a node forms only once it found all of them, so every node that may form sees the
same set and the same lowest address, and only that node forms; every other node only ever
joins a member. With fewer required, the stable margin must cover the time DNS takes to list
them all (as in Akka): a node that found only part of the set for the whole margin may form with
that part, and a lower node found later then joins it, unless it found its own part at the same
time. A node that does not find itself among the contact points
(its ``canonical_host`` is not the address DNS gives for it) cannot be the lowest: it only joins.
"Lowest" orders IP addresses numerically (IPv4 before IPv6), names after addresses, then ports:
``10.0.0.9`` comes before ``10.0.0.10``, which a comparison of strings would get wrong.

Where it differs from Akka: Akka asks the contact points over its HTTP management endpoint for
their seed nodes; here the question is the membership protocol's own InitJoin, which every node
already answers (InitJoinAck from a member, InitJoinNack otherwise), so nothing else needs to be
reachable. Requiring a fresh "not a member" from every contact point before forming is Akka's
``contact-with-all-contact-points`` default, always on.

States::

    LOOKING ──a contact point is a member──────────────────────────► JOINING (done)
       │
       └──enough, stable, lowest is this node, all said "not a member"──► FORMING (done)
"""

from __future__ import annotations

import enum
import ipaddress
import math
from collections.abc import Iterable

import attrs

from membership import Address


@attrs.frozen
class Probe:
    """Ask ``contact_point`` whether it is a member of a cluster (an InitJoin)."""

    contact_point: Address


@attrs.frozen
class JoinSeedNodes:
    """Join the cluster through these addresses, as seed nodes: a contact point is a member."""

    seed_nodes: tuple[Address, ...]


@attrs.frozen
class FormCluster:
    """Form a new cluster of this node: the lowest of ``contact_points``, none a member."""

    contact_points: tuple[Address, ...]


BootstrapEffect = Probe | JoinSeedNodes | FormCluster
"""What the shell carries out: probes, then at most one decision."""


class BootstrapState(enum.Enum):
    """Where the bootstrap is: looking, or decided (joining or forming)."""

    LOOKING = "looking"
    JOINING = "joining"
    FORMING = "forming"


def contact_point_order(address: Address) -> tuple[int, int, str, int]:
    """The sort key that says which contact point is the lowest.

    IP addresses compare as numbers (IPv4 before IPv6), names after every address and
    alphabetically; then ports.

    Example:
        >>> a, b = Address("10.0.0.9", 25520), Address("10.0.0.10", 25520)
        >>> min([b, a], key=contact_point_order) == a
        True
    """
    try:
        ip = ipaddress.ip_address(address.host)
    except ValueError:
        return (2, 0, address.host.lower(), address.port)
    return (0 if ip.version == 4 else 1, int(ip), "", address.port)


def normal_address(address: Address) -> Address:
    """``address`` with an IP host in its normal form (``fd00::1``, not ``fd00:0::1``).

    So an address DNS gives and the one a node was configured with compare equal.
    """
    try:
        host = str(ipaddress.ip_address(address.host))
    except ValueError:
        return address
    return address if host == address.host else Address(host, address.port)


@attrs.define(eq=False)
class BootstrapCore:
    """Decides, from lookups and answers, whether to join a cluster or form one (see module).

    Example:
        >>> me = Address("10.0.0.1", 25520)
        >>> other = Address("10.0.0.2", 25520)
        >>> core = BootstrapCore(me, required_contact_points=2, stable_margin=5.0)
        >>> core.discovered([me, other], now=0.0)
        [Probe(contact_point=Address(host='10.0.0.2', port=25520))]
        >>> core.answered(other, is_member=False, now=0.1)
        []
        >>> core.tick(now=5.0)[-1] == FormCluster((me, other))
        True
    """

    self_address: Address = attrs.field(converter=normal_address)
    """This node's canonical address, as the other nodes find it in DNS."""
    required_contact_points: int = 2
    stable_margin: float = 5.0
    probe_interval: float = 1.0
    new_cluster_enabled: bool = True
    state: BootstrapState = BootstrapState.LOOKING
    decision: JoinSeedNodes | FormCluster | None = None
    """The decision once made (then the core does nothing more)."""
    _contact_points: frozenset[Address] | None = None
    """The set the last lookup found (None: no lookup answered yet)."""
    _stable_since: float = 0.0
    _not_members: dict[Address, float] = attrs.field(factory=dict)
    """When each contact point last said it is not a member."""
    _members: set[Address] = attrs.field(factory=set)
    _next_probe: float = -math.inf

    @property
    def contact_points(self) -> tuple[Address, ...]:
        """The contact points the last lookup found, lowest first."""
        return tuple(sorted(self._contact_points or (), key=contact_point_order))

    @property
    def freshness(self) -> float:
        """How old a "not a member" answer may be and still count (seconds).

        Short on purpose: a contact point that formed (or joined) a cluster since it said no
        answers yes to the next probe, and that must reach this node before it forms.
        """
        return 3 * self.probe_interval

    def discovered(self, contact_points: Iterable[Address], now: float) -> list[BootstrapEffect]:
        """A lookup found ``contact_points`` (an empty answer is an empty set)."""
        if self.state is not BootstrapState.LOOKING:
            return []
        found = frozenset(normal_address(a) for a in contact_points)
        if found != self._contact_points:
            self._contact_points = found
            self._stable_since = now
            self._next_probe = now  # ask the new ones at once
        return self.tick(now)

    def answered(
        self, contact_point: Address, is_member: bool, now: float
    ) -> list[BootstrapEffect]:
        """``contact_point`` answered a probe: it is a member of a cluster, or it is not."""
        if self.state is not BootstrapState.LOOKING:
            return []
        contact_point = normal_address(contact_point)
        if is_member:
            self._members.add(contact_point)
            return self._join()
        self._not_members[contact_point] = now
        return self.tick(now)

    def tick(self, now: float) -> list[BootstrapEffect]:
        """Do what is due at ``now``: the next round of probes, forming the cluster."""
        if self.state is not BootstrapState.LOOKING:
            return []
        effects: list[BootstrapEffect] = []
        if now >= self._next_probe and self._contact_points:
            self._next_probe = now + self.probe_interval
            effects += [Probe(a) for a in self.contact_points if a != self.self_address]
        if self.waiting_for(now) is None:
            self.state = BootstrapState.FORMING
            self.decision = FormCluster(self.contact_points)
            effects.append(self.decision)
        return effects

    def next_deadline(self) -> float:
        """The earliest time :meth:`tick` has something to do."""
        if self.state is not BootstrapState.LOOKING or self._contact_points is None:
            return math.inf
        stable_at = self._stable_since + self.stable_margin
        if stable_at <= self._next_probe:
            return self._next_probe
        return min(self._next_probe, stable_at)

    def waiting_for(self, now: float) -> str | None:
        """Why this node does not form a cluster at ``now``; None if it may.

        Example:
            >>> core = BootstrapCore(Address("10.0.0.1", 25520))
            >>> core.waiting_for(now=0.0)
            'no lookup has answered yet'
        """
        found = self._contact_points
        if found is None:
            return "no lookup has answered yet"
        if len(found) < self.required_contact_points:
            return (
                f"{len(found)} contact point(s) found, {self.required_contact_points} required "
                "to form a cluster"
            )
        lowest = self.contact_points[0]
        if self.self_address not in found:
            return (
                f"this node ({self.self_address}) is not among the contact points found, so it "
                "joins a cluster but never forms one"
            )
        if lowest != self.self_address:
            return f"{lowest} has the lowest address: it forms the cluster, this node joins it"
        if not self.new_cluster_enabled:
            return "no contact point is a member and new_cluster_enabled is false"
        if now < self._stable_since + self.stable_margin:
            return (
                f"the contact points have been stable for {now - self._stable_since:.1f} s "
                f"of the {self.stable_margin:g} s stable_margin"
            )
        horizon = now - self.freshness
        silent = [
            str(a)
            for a in self.contact_points
            if a != self.self_address and self._not_members.get(a, -math.inf) < horizon
        ]
        if silent:
            return f"no answer lately from {', '.join(silent)}"
        return None

    def _join(self) -> list[BootstrapEffect]:
        seeds = (self._members | set(self._contact_points or ())) - {self.self_address}
        self.state = BootstrapState.JOINING
        self.decision = JoinSeedNodes(tuple(sorted(seeds, key=contact_point_order)))
        return [self.decision]
