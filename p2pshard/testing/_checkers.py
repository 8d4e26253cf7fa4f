"""Invariant checkers: pure functions over a :class:`History`, and live checks of a quiet cluster.

The history checkers (single activation, acknowledged messages kept exactly once, per-sender
order, at most one singleton) read only the record (for event-sourced workloads, the logs and
copies are read from the journal into it first), so they apply the same way to a simulated run
and to real processes whose records were merged on one clock. The live checks (membership and
shard homes agree, one cluster and not islands, every shard answers, replicas converge, nothing an
intruder announced stuck) look at the nodes of a :class:`~p2pshard.testing.SimCluster` after the
faults have healed and the cluster was quiet; each takes plain views (names, sets), so it can be
shown to catch what it must on views made by hand. :func:`check_journal_calls` reads a memory
journal's record of the calls it accepted: the fence, recomputed from that record alone, was
never passed by.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import attrs

from membership import HandshakeError
from membership.internal import ProtocolRange

from ..persistence._memory import AcceptedCall
from ._history import History, Span

SINGLE_ACTIVATION = "single-activation"
ACKNOWLEDGED_KEPT = "acknowledged-kept"
SENDER_ORDER = "sender-order"
AGREEMENT = "agreement"
SINGLE_SINGLETON = "single-singleton"
CONVERGENCE = "convergence"
FAN_OUT = "fan-out"
JOURNAL_FENCING = "journal-fencing"
ONE_CLUSTER = "one-cluster"
INTRUDER_IGNORED = "intruder-ignored"
ROLLOUT = "rollout"
RUN_FINISHES = "run-finishes"

INVARIANTS = (
    SINGLE_ACTIVATION,
    ACKNOWLEDGED_KEPT,
    SENDER_ORDER,
    AGREEMENT,
    SINGLE_SINGLETON,
    CONVERGENCE,
    FAN_OUT,
    JOURNAL_FENCING,
    ONE_CLUSTER,
    INTRUDER_IGNORED,
    ROLLOUT,
    RUN_FINISHES,
)
"""Every invariant name, in report order. ``rollout`` is a rolling upgrade's: every step ended with
its node Up, and afterwards every member record shows the node's build and every link speaks the
protocol version the two builds agree on. ``journal-fencing`` is the event-sourced workloads':
no append accepted under a token lower than one its stream had seen, and every stream one
unbroken sequence. ``run-finishes`` is not about the cluster: a seed whose
run hung (or raised) is reported under it, so that the other seeds' reports still come."""


@attrs.frozen
class Violation:
    """One broken invariant: which, and what exactly was seen."""

    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def check_history(history: History) -> list[Violation]:
    """Every history invariant: activation, acknowledged kept, order, singleton, fan-out."""
    return [
        *check_single_activation(history),
        *check_acknowledged_kept(history),
        *check_sender_order(history),
        *check_single_singleton(history),
        *check_fan_out(history),
    ]


def check_single_activation(history: History) -> list[Violation]:
    """(i) Never two live incarnations of one entity at the same instant."""
    return [
        Violation(SINGLE_ACTIVATION, f"{key}: {a.describe()} and {b.describe()} overlap")
        for key, spans in sorted(history.incarnations.items())
        for a, b in _overlapping(spans)
    ]


def check_single_singleton(history: History) -> list[Violation]:
    """(v) Never two instances of one singleton at the same instant."""
    return [
        Violation(SINGLE_SINGLETON, f"{name}: {a.describe()} and {b.describe()} overlap")
        for name, spans in sorted(history.singletons.items())
        for a, b in _overlapping(spans)
    ]


def check_acknowledged_kept(history: History) -> list[Violation]:
    """(ii) Every acknowledged message is in its entity's log exactly once; none twice.

    A message that was not acknowledged may be in the log once (it was handled, the answer got
    lost) or not at all (at-most-once delivery), never twice.
    """
    found = []
    counts: dict[tuple[str, str, int], int] = {}
    for entity, log in history.logs.items():
        for sender, seq in log:
            counts[(entity, sender, seq)] = counts.get((entity, sender, seq), 0) + 1
    for (entity, sender, seq), count in sorted(counts.items()):
        if count > 1:
            found.append(
                Violation(ACKNOWLEDGED_KEPT, f"{entity}: {sender}#{seq} handled {count} times")
            )
    for message in sorted(history.messages.values(), key=lambda m: (m.sender, m.seq)):
        if message.acknowledged_at is None:
            continue
        if (message.entity, message.sender, message.seq) not in counts:
            found.append(
                Violation(
                    ACKNOWLEDGED_KEPT,
                    f"{message.entity}: {message.sender}#{message.seq} was acknowledged at "
                    f"{message.acknowledged_at:.3f} but is not in the entity's log",
                )
            )
    return found


def check_sender_order(history: History) -> list[Violation]:
    """(iii) Each sender's messages to one entity were handled in the order it sent them.

    Gaps are allowed (an unacknowledged message may be lost); going back is not.
    """
    found = []
    for entity, log in sorted(history.logs.items()):
        last: dict[str, int] = {}
        for sender, seq in log:
            previous = last.get(sender)
            if previous is not None and seq < previous:
                found.append(
                    Violation(
                        SENDER_ORDER,
                        f"{entity}: {sender}#{seq} was handled after {sender}#{previous}",
                    )
                )
            last[sender] = max(seq, previous or seq)
    return found


def check_agreement_views(
    members: dict[str, frozenset[tuple[str, str]]],
    homes: dict[str, dict[str, str]],
    live: Iterable[str],
) -> list[Violation]:
    """(iv) Live nodes agree on membership and on shard homes (a pure check of their views).

    ``members`` maps each live node to the (node, status) pairs it sees; every live node must see
    the same set, with every live node Up in it. ``homes`` maps each live node to the shard →
    home-node table its region knows; no two regions may name different homes for one shard, and
    every home must be a live node.
    """
    live = sorted(live)
    found = []
    views = {frozenset(view) for view in members.values()}
    if len(views) > 1:
        detail = "; ".join(f"{node} sees {sorted(members[node])}" for node in sorted(members))
        found.append(Violation(AGREEMENT, f"members differ: {detail}"))
    for node, view in sorted(members.items()):
        up = {name for name, status in view if status == "up"}
        missing = [name for name in live if name not in up]
        if missing:
            found.append(
                Violation(AGREEMENT, f"{node} does not see {missing} Up (it sees {sorted(view)})")
            )
    owner: dict[str, tuple[str, str]] = {}
    for node, table in sorted(homes.items()):
        for shard, home in sorted(table.items()):
            if home not in live:
                found.append(
                    Violation(AGREEMENT, f"{node} thinks shard {shard} lives on {home}, not live")
                )
            seen = owner.setdefault(shard, (home, node))
            if seen[0] != home:
                found.append(
                    Violation(
                        AGREEMENT,
                        f"shard {shard}: {seen[1]} says {seen[0]}, {node} says {home}",
                    )
                )
    return found


def check_convergence_digests(digests: dict[str, dict[str, bytes | None]]) -> list[Violation]:
    """(vi) Replicas converged: every live node holds the same digest for every key.

    ``digests`` maps each live node to key → digest (None: the node lacks the key).
    """
    keys = sorted({key for table in digests.values() for key in table})
    found = []
    for key in keys:
        values = {node: table.get(key) for node, table in sorted(digests.items())}
        if len(set(values.values())) > 1:
            detail = ", ".join(
                f"{node}: {'absent' if value is None else value.hex()[:12]}"
                for node, value in values.items()
            )
            found.append(Violation(CONVERGENCE, f"replicas of {key} differ: {detail}"))
    return found


def _overlapping(spans: list[Span]) -> Iterable[tuple[Span, Span]]:
    ordered = sorted(spans, key=lambda s: s.start)
    for i, a in enumerate(ordered):
        a_end = float("inf") if a.end is None else a.end
        for b in ordered[i + 1 :]:
            if b.start >= a_end:
                break
            yield a, b


def check_fan_out(history: History) -> list[Violation]:
    """(vii) Fan-out copies are prefixes of the room's log, holding what it acknowledged.

    Each member's copy of a room is a prefix of the room's log (nothing lost, repeated or
    reordered), and holds every post the room acknowledged.
    """
    found = []
    for member, rooms in sorted(history.copies.items()):
        for room, copy in sorted(rooms.items()):
            log = history.logs.get(room, [])
            at = next((n for n, post in enumerate(copy) if n >= len(log) or log[n] != post), None)
            if at is not None:
                has = "nothing" if at >= len(log) else f"{log[at][0]}#{log[at][1]}"
                found.append(
                    Violation(
                        FAN_OUT,
                        f"{member}'s copy of {room} holds {copy[at][0]}#{copy[at][1]} as post "
                        f"{at + 1}; the room's log has {has} there",
                    )
                )
    numbers = {
        room: {post: n for n, post in enumerate(history.logs.get(room, []), start=1)}
        for room in history.room_members
    }
    for message in sorted(history.messages.values(), key=lambda m: (m.sender, m.seq)):
        room = message.entity
        if room not in numbers or message.acknowledged_at is None:
            continue
        number = numbers[room].get((message.sender, message.seq))
        if number is None:
            continue  # acknowledged-kept reports it
        for member in history.room_members[room]:
            if len(history.copies.get(member, {}).get(room, ())) < number:
                found.append(
                    Violation(
                        FAN_OUT,
                        f"{room}: {message.sender}#{message.seq} (post {number}) was "
                        f"acknowledged at {message.acknowledged_at:.3f} but {member} lacks it",
                    )
                )
    return found


def check_journal_calls(
    calls: Iterable[AcceptedCall], stored: Mapping[str, int]
) -> list[Violation]:
    """(x) No stale writer got through: every append was accepted under the stream's fence.

    ``calls`` are the calls a journal accepted, in the order it applied them
    (:meth:`p2pshard.MemoryJournal.accepted_calls`); ``stored`` maps each stream to how many
    events it holds. The fence is recomputed from ``calls`` alone (the largest token any earlier
    accepted call on the stream carried: recoveries, appends, snapshots), not taken from the
    journal: an append under a lower token is a second writer accepted after the first was
    fenced out. Each append must also start right after the one before it, and the appends
    must account for every stored event.

    Example:
        >>> calls = [
        ...     AcceptedCall("C|a", "recover", 7, 0, 0, 1.0),
        ...     AcceptedCall("C|a", "append", 4, 1, 1, 2.0),
        ... ]
        >>> (violation,) = check_journal_calls(calls, {"C|a": 1})
        >>> print(violation)  # doctest: +ELLIPSIS
        journal-fencing: C|a: append at 1 under token 4 was accepted after token 7 had...
    """
    found = []
    fences: dict[str, tuple[int, float]] = {}
    highest: dict[str, int] = {}
    for call in calls:
        pid, token = call.persistence_id, call.token
        fence = fences.get(pid)
        if call.kind == "append":
            if token is not None and fence is not None and token < fence[0]:
                found.append(
                    Violation(
                        JOURNAL_FENCING,
                        f"{pid}: append at {call.seq} under token {token} was accepted after "
                        f"token {fence[0]} had fenced the stream (at {fence[1]:.3f}), at "
                        f"{call.at:.3f}",
                    )
                )
            if call.seq != highest.get(pid, 0) + 1:
                found.append(
                    Violation(
                        JOURNAL_FENCING,
                        f"{pid}: append at {call.seq} was accepted after event "
                        f"{highest.get(pid, 0)}, at {call.at:.3f}",
                    )
                )
            highest[pid] = call.seq + call.events - 1
        if token is not None and (fence is None or token > fence[0]):
            fences[pid] = (token, call.at)
    for pid in sorted(set(stored) | set(highest)):
        if stored.get(pid, 0) != highest.get(pid, 0):
            found.append(
                Violation(
                    JOURNAL_FENCING,
                    f"{pid}: the stream holds {stored.get(pid, 0)} events, but its accepted "
                    f"appends wrote {highest.get(pid, 0)}",
                )
            )
    return found


def check_one_cluster(
    views: Mapping[str, Iterable[str]], running: Iterable[str]
) -> list[Violation]:
    """(viii) After heal and quiet the running nodes form one cluster, not islands.

    ``views`` maps each running node to the members it sees Up (as labels: a running
    incarnation by its node name, anything else by a label that no running node has, such as
    ``"n3 (stopped incarnation)"``). Every running node must see the same set, and that set must
    be exactly the running nodes: a node missing from it is outside the cluster, and an Up member
    that runs nowhere (a stale incarnation, a fake member) is a member that is not there. When
    nodes disagree, the violation groups them by what they see, one group per cluster.
    """
    live = sorted(set(running), key=_node_key)
    groups: dict[frozenset[str], list[str]] = {}
    for node in sorted(views, key=_node_key):
        groups.setdefault(frozenset(views[node]), []).append(node)
    if len(groups) > 1:
        clusters = "; ".join(
            f"{_listed(nodes)} see Up {_listed(view)}"
            for view, nodes in sorted(groups.items(), key=lambda g: _node_key(g[1][0]))
        )
        return [Violation(ONE_CLUSTER, f"{len(groups)} clusters after the quiet: {clusters}")]
    if not groups:
        return []
    [(view, nodes)] = groups.items()
    missing = [node for node in live if node not in view]
    stray = sorted(view - set(live), key=_node_key)
    if not missing and not stray:
        return []
    parts = [f"{_listed(nodes)} see Up {_listed(view)}"]
    if missing:
        parts.append(f"running but not Up in it: {_listed(missing)}")
    if stray:
        parts.append(f"Up in it but not running: {_listed(stray)}")
    return [Violation(ONE_CLUSTER, "one view, but not of the running nodes: " + "; ".join(parts))]


def check_no_fakes(
    members: Mapping[str, Iterable[str]],
    dialled: Mapping[str, Iterable[str]],
    fakes: Mapping[str, str],
) -> list[Violation]:
    """(ix) Nothing an intruder announced stuck: no fake member, no fake address dialled.

    ``fakes`` maps each node name the intruder made up to the address it gave it; ``members``
    maps each running node to the names of the members it knows (any status), ``dialled`` to
    the addresses (as text) it keeps an outbound link or queue for. A fake name among the
    members means a forged Join or gossip was believed; a fake address among the dialled ones
    means the node answers (and will keep trying to reach) an address only the intruder named.
    """
    found = []
    addresses = {address: name for name, address in fakes.items()}
    for node in sorted(members, key=_node_key):
        listed = sorted(set(members[node]) & set(fakes), key=_node_key)
        if listed:
            found.append(
                Violation(INTRUDER_IGNORED, f"{node} lists fake members {_listed(listed)}")
            )
    for node in sorted(dialled, key=_node_key):
        called = sorted(set(dialled[node]) & set(addresses))
        if called:
            named = ", ".join(f"{address} ({addresses[address]})" for address in called)
            found.append(
                Violation(
                    INTRUDER_IGNORED, f"{node} dials addresses only the intruder named: {named}"
                )
            )
    return found


def check_builds(
    builds: Mapping[str, tuple[str, ProtocolRange]],
    seen: Mapping[str, Mapping[str, str]],
    links: Mapping[tuple[str, str], int | None],
) -> list[Violation]:
    """After a rolling upgrade, every node runs the build it was given, and the links agree.

    ``builds`` maps each running node to the app version and wire protocol range it was started
    with; ``seen`` maps each running node to the app version its member record of every other
    running node shows; ``links`` maps ordered pairs of running nodes to the protocol version of
    the link between them (None: no link now). A record that shows another version means the
    member record is stale or wrong; two builds whose ranges do not meet can never link (the
    rollout is broken whatever else happens); a link that speaks another version than the newest
    both ranges hold means the negotiation went wrong. A missing link between builds that do
    meet is left to the agreement checks.

    Example:
        >>> one = {"n1": ("1.0.0", ProtocolRange(1, 1)), "n2": ("1.1.0", ProtocolRange(2, 2))}
        >>> [str(v) for v in check_builds(one, {}, {})]  # doctest: +NORMALIZE_WHITESPACE
        ['rollout: n1 (1.0.0, version 1) and n2 (1.1.0, version 2) cannot link: no wire
          protocol version in common']
    """
    found = []
    names = sorted(builds, key=_node_key)
    for viewer in sorted(seen, key=_node_key):
        for node in names:
            version = seen[viewer].get(node)
            if version is not None and version != builds[node][0]:
                found.append(
                    Violation(
                        ROLLOUT,
                        f"{viewer}'s member record of {node} shows app version {version!r}, "
                        f"but {node} runs {builds[node][0]!r}",
                    )
                )
    for n, a in enumerate(names):
        for b in names[n + 1 :]:
            (version_a, range_a), (version_b, range_b) = builds[a], builds[b]
            agreed = _agreed(range_a, range_b)
            if agreed is None:
                found.append(
                    Violation(
                        ROLLOUT,
                        f"{a} ({version_a}, {range_a}) and {b} ({version_b}, {range_b}) cannot "
                        "link: no wire protocol version in common",
                    )
                )
                continue
            for source, target in ((a, b), (b, a)):
                speaks = links.get((source, target))
                if speaks is not None and speaks != agreed:
                    found.append(
                        Violation(
                            ROLLOUT,
                            f"{source}'s link to {target} speaks protocol version {speaks}, "
                            f"not {agreed}, the newest both builds speak",
                        )
                    )
    return found


def _agreed(a: ProtocolRange, b: ProtocolRange) -> int | None:
    try:
        return a.agree(b)
    except HandshakeError:
        return None


def _node_key(name: str) -> tuple[str, int, str]:
    """Sort ``n2`` before ``n10``."""
    match = re.match(r"(\D*)(\d+)(.*)", name)
    if match is None:
        return (name, -1, "")
    return (match.group(1), int(match.group(2)), match.group(3))


def _listed(names: Iterable[str]) -> str:
    return "[" + ", ".join(sorted(names, key=_node_key)) + "]"
