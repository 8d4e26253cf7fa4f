"""The ``intruder`` chaos fault: a node that is not a member sends forged membership messages.

Theory of operation: an :class:`Intruder` attaches to the cluster's simulated network as one more
transport, at :data:`INTRUDER_ADDRESS` under the name ``intruder``, which no member ever has. Each
session (one ``intruder`` fault of a schedule) carries out two to four attacks drawn from
:data:`ATTACKS`, each one message or a few, addressed to a running member:

- ``join-1`` and ``join-5``: ``Join`` for one or five nodes that do not exist (``fake<k>``, at
  made-up addresses, some of which sort before the real nodes', so that fake members would win
  the split brain resolver's tie-break);
- ``down`` and ``leave``: ``Down`` or ``Leave`` naming a running member;
- ``gossip-fake-members``: a gossip envelope holding the target's own gossip plus fake members,
  all Up, under a newer version, claiming to come from a real member;
- ``gossip-tombstone``: a gossip envelope that tombstones a running member (sent to that member
  itself, or to another one);
- ``gossip-down``: a gossip envelope that marks a running member Down;
- ``gossip-status``: a gossip status claiming a newer version, from a real member's name;
- ``heartbeat``: a heartbeat whose sender is a fake node at a made-up address.

The intruder knows every incarnation (uids included), as an attacker who watched the cluster
would: only the identity the link was set up with may decide what a message can do, never what
the message says about its sender. After each attack it waits :data:`SETTLE` seconds and looks
at the nodes: a fake member in any node's view, a member marked Down, Leaving or removed by the
target on the intruder's word, a node that shut itself down on a forged tombstone, or a node
dialling an address only the intruder named, is a violation of ``intruder-ignored``. The look is
narrow on purpose: only a member that the target saw Up and reachable before, whose incarnation
still runs, counts, so that a real fault does not pass for the intruder's doing. What it sent is
recorded in the run's fault list (``intruder: ...``); its choices come from a generator seeded
from the run's seed, so a seed replays the same attacks.
"""

from __future__ import annotations

import random

import attrs
import trio

from membership import (
    Address,
    Member,
    MemberStatus,
    SendQueueFull,
    Transport,
    TransportClosed,
    UniqueAddress,
)
from membership.internal import Down, GossipEnvelope, GossipStatus, Heartbeat, Join, Leave

from ._checkers import INTRUDER_IGNORED, Violation
from ._sim import SimCluster, node_address

INTRUDER_ADDRESS = Address("10.0.0.99", 25520)
"""Where the intruder attaches: no member ever lives there."""

INTRUDER_NAME = "intruder"
"""The intruder's node name: no member ever has it."""

ATTACKS = (
    "join-1",
    "join-5",
    "down",
    "leave",
    "gossip-fake-members",
    "gossip-tombstone",
    "gossip-down",
    "gossip-status",
    "heartbeat",
)
"""Every attack a session draws from (see the module docstring)."""

SETTLE = 0.2
"""Seconds between an attack and the look at its effect: the message is delivered within 5 ms,
and no real fault downs a reachable member that fast."""

FAKE_HOSTS = ("10.0.0.0", "10.0.0.1", "10.0.0.7")
"""Hosts of the fake nodes' addresses; ``10.0.0.0`` sorts before every real node."""

_LIVE = (MemberStatus.JOINING, MemberStatus.WEAKLY_UP, MemberStatus.UP)
_DOWNED = (MemberStatus.DOWN, MemberStatus.REMOVED)
_LEFT = (MemberStatus.LEAVING, MemberStatus.EXITING, MemberStatus.REMOVED)


@attrs.define(eq=False)
class Intruder:
    """A non-member that attacks the cluster of ``sim``, one session per ``intruder`` fault.

    ``fakes`` holds every node it made up (name to address), ``found`` what its attacks did
    that they must not have.
    """

    sim: SimCluster
    rng: random.Random
    fakes: dict[str, Address] = attrs.field(factory=dict)
    found: list[Violation] = attrs.field(factory=list)

    async def session(self) -> None:
        """Attach, carry out two to four attacks at random intervals, detach."""
        attacks = [self.rng.choice(ATTACKS) for _ in range(self.rng.randint(2, 4))]
        async with (
            self.sim.net.transport(INTRUDER_ADDRESS, INTRUDER_NAME) as transport,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(_drain, transport)
            for attack in attacks:
                await trio.sleep(self.rng.uniform(0.2, 1.5))
                await self._attack(transport, attack)
            nursery.cancel_scope.cancel()

    async def _attack(self, transport: Transport, attack: str) -> None:
        sim, rng = self.sim, self.rng
        running = [i for i in sim.live if sim.nodes[i].cluster.self_member.status in _LIVE]
        if not running:
            self._record(f"{attack}: no running member to attack")
            return
        # Both drawn every time, so that what comes later does not depend on which attack ran.
        target, victim = rng.choice(running), rng.choice(running)
        to = node_address(target)
        if attack in ("join-1", "join-5"):
            fakes = [self._fake() for _ in range(1 if attack == "join-1" else 5)]
            for fake in fakes:
                self._send(transport, to, Join(node=fake))
            self._record(f"Join for {_names(fakes)} to n{target}")
            await trio.sleep(SETTLE)
            self._check_no_fake_member(fakes, f"the intruder's forged Join to n{target}")
        elif attack in ("down", "leave"):
            before = self._view(target, victim)
            kind = Down if attack == "down" else Leave
            self._send(transport, to, kind(node=node_address(victim)))
            self._record(f"{kind.__name__}(n{victim}) to n{target}")
            await trio.sleep(SETTLE)
            gone = _DOWNED if attack == "down" else _LEFT
            what = f"the intruder's forged {kind.__name__}(n{victim}) to n{target}"
            self._check_kept(before, target, victim, gone, what)
        elif attack.startswith("gossip-"):
            await self._forge_gossip(transport, attack, target, victim)
        else:  # heartbeat
            fake = self._fake()
            beat = Heartbeat(sender=fake, sequence_nr=rng.randint(1, 1000), creation_time=0.0)
            self._send(transport, to, beat)
            self._record(f"Heartbeat from {_names([fake])} to n{target}")
            await trio.sleep(SETTLE)
            self._check_not_dialled(fake.address, f"the intruder's heartbeat to n{target}")

    async def _forge_gossip(
        self, transport: Transport, attack: str, target: int, victim: int
    ) -> None:
        sim, rng = self.sim, self.rng
        node = sim.nodes[target]
        claimed = sim.nodes[rng.choice(sim.live)].address  # a real member's name, not ours
        gossip = node.cluster.gossip
        to = node_address(target)
        if attack == "gossip-status":
            version = gossip.incremented(claimed).version
            self._send(
                transport, to, GossipStatus(sender=claimed, version=version, seen_digest=b"")
            )
            self._record(f"GossipStatus claiming to be {claimed.name} to n{target}")
            return
        before = self._view(target, victim)
        victim_node = sim.nodes[victim].address
        fakes: list[UniqueAddress] = []
        if attack == "gossip-fake-members":
            fakes = [self._fake() for _ in range(rng.randint(1, 3))]
            up = max(
                (m.up_number for m in gossip.members if m.status is MemberStatus.UP), default=0
            )
            for n, fake in enumerate(fakes, start=1):
                gossip = gossip.with_member(Member(fake, MemberStatus.UP, up_number=up + n))
            what = f"gossip with fake members {_names(fakes)} Up"
        elif attack == "gossip-tombstone":
            gossip = gossip.removed(victim_node, trio.current_time())
            what = f"gossip tombstoning n{victim}"
        else:  # gossip-down
            gossip = gossip.marked_down(victim_node)
            what = f"gossip marking n{victim} Down"
        forged = attrs.evolve(gossip.incremented(claimed), seen=frozenset({claimed}))
        envelope = GossipEnvelope(sender=claimed, to=node.address, gossip=forged)
        self._send(transport, to, envelope)
        what = f"{what}, claiming to be {claimed.name}, to n{target}"
        self._record(what)
        await trio.sleep(SETTLE)
        cause = f"the intruder's {what}"
        if attack == "gossip-fake-members":
            self._check_no_fake_member(fakes, cause)
        elif attack == "gossip-tombstone":
            self._check_kept(before, target, victim, (MemberStatus.REMOVED,), cause)
        else:
            self._check_kept(before, target, victim, _DOWNED, cause)

    # ---- looking at the effects ----

    def _view(self, target: int, victim: int) -> _Before | None:
        """What the target sees, if it sees the victim's running incarnation Up and reachable."""
        sim = self.sim
        if target not in sim.nodes or victim not in sim.nodes:
            return None
        cluster = sim.nodes[target].cluster
        victim_node = sim.nodes[victim].address
        member = next((m for m in cluster.members if m.node == victim_node), None)
        if member is None or member.status not in _LIVE:
            return None
        if any(m.node == victim_node for m in cluster.unreachable):
            return None
        members = {m.node: m.status for m in cluster.members}
        return _Before(sim.nodes[target].address, victim_node, members)

    def _check_kept(
        self,
        before: _Before | None,
        target: int,
        victim: int,
        statuses: tuple[MemberStatus, ...],
        cause: str,
    ) -> None:
        """The target still sees the victim as before; a victim that is the target still runs.

        When the target dropped other members too in the meantime (an island giving way downs
        all its members at once), the change is not the intruder's doing for sure: not counted.
        """
        if before is None:
            return  # the target did not see the victim Up and reachable: nothing to compare
        node = self.sim.nodes.get(target)
        if node is None or node.address != before.target or node.terminated.is_set():
            if target == victim:
                self._found(f"n{victim} shut itself down {SETTLE:g} s after {cause}")
            return
        now = {m.node: m.status for m in node.cluster.members}
        others = [
            member
            for member, status in before.members.items()
            if member != before.victim
            and now.get(member, MemberStatus.REMOVED) != status
            and now.get(member, MemberStatus.REMOVED) not in _LIVE
        ]
        status = now.get(before.victim, MemberStatus.REMOVED)
        if status in statuses and not others:
            self._found(f"n{target} sees n{victim} {status.value} {SETTLE:g} s after {cause}")

    def _check_no_fake_member(self, made: list[UniqueAddress], cause: str) -> None:
        names = {fake.name for fake in made}
        for i in self.sim.live:
            fakes = [
                f"{m.node.name} ({m.status.value})"
                for m in self.sim.nodes[i].cluster.members
                if m.node.name in names
            ]
            if fakes:
                self._found(f"n{i} lists fake members {', '.join(fakes)} after {cause}")

    def _check_not_dialled(self, address: Address, cause: str) -> None:
        for i in self.sim.live:
            if any(p.address == address for p in self.sim.nodes[i].transport_statistics().peers):
                self._found(f"n{i} dials {address}, which only the intruder named, after {cause}")

    # ---- helpers ----

    def _fake(self) -> UniqueAddress:
        name = f"fake{len(self.fakes) + 1}"
        address = Address(self.rng.choice(FAKE_HOSTS), self.rng.randint(1024, 65535))
        self.fakes[name] = address
        return UniqueAddress(address, name, self.rng.getrandbits(63) or 1)

    def _send(self, transport: Transport, to: Address, message: object) -> None:
        try:
            transport.send_nowait(to, message)
        except (SendQueueFull, TransportClosed) as exc:
            self._record(f"could not send {type(message).__name__} to {to}: {exc!r}")

    def _record(self, what: str) -> None:
        self.sim.history.fault(f"intruder: {what}")

    def _found(self, what: str) -> None:
        self.found.append(Violation(INTRUDER_IGNORED, f"{trio.current_time():.1f} {what}"))


@attrs.frozen
class _Before:
    """What an attack's target saw before it: its own incarnation, the victim's, every member."""

    target: UniqueAddress
    victim: UniqueAddress
    members: dict[UniqueAddress, MemberStatus]


def _names(nodes: list[UniqueAddress]) -> str:
    return ", ".join(f"{n.name} at {n.address}" for n in nodes)


async def _drain(transport: Transport) -> None:
    """Read and drop whatever the members answer, so that their links to us keep flowing."""
    async for _ in transport:
        pass
