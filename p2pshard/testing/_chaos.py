"""Seeded chaos runs: a cluster, a workload, a random fault schedule, then every invariant.

Theory of operation: :func:`run_chaos` runs one seed in its own ``trio.run`` under a mock clock
with the scheduler seeded, so the seed alone decides the run and its network trace hash. The
cluster has ``settings.nodes`` nodes, each hosting the counter entity type (shard leases on by
default) and the singleton probe (under a lease), all sharing one
:class:`~p2pshard.MemoryLeaseBackend`. For ``settings.duration`` seconds the schedule injects one
fault at a time, chosen from ``settings.faults``:

- ``partition``: a random minority cut off from the rest, both ways;
- ``isolate``: one node cut off from every other;
- ``bridge``: A and C cannot reach each other, while both reach B (a ring's missing link);
- ``one-way``: one node's messages to the others are lost, theirs to it arrive;
- ``flaky``: one node's links lose 5 to 30 % of frames;
- ``slow``: one node's links take 50 to 500 ms;
- ``crash``: one node dies at once and is started again later, as a new incarnation;
- ``pause``: everything to and from one node, and its lease calls, waits (a long GC pause);
- ``skew``: the clock one node's leases read runs 0.8 ``safety_margin / ttl`` slower to
  ``safety_margin / ttl`` faster than the lease backend's, while later faults come and go;
- ``seed-partition``: a minority holding seed nodes (all of them if they fit) cut off for 8 to
  40 s: long enough for the split brain resolver to down it and for its nodes to restart while
  they cannot reach the rest, as when the seed nodes end up on the losing side on real hosts;
- ``intruder``: a node that is not a member sends forged ``Join``, ``Down``, ``Leave``, gossip and
  heartbeats (``p2pshard.testing._intruder``); what it achieved breaks ``intruder-ignored``.

The default ``faults`` are the first nine (:data:`CLASSIC_FAULTS`), so that seeds pinned before the
last two came keep their runs. The seed nodes are every node by default (``seed_layout="all"``);
``"first-1"`` to ``"first-3"`` and ``"drawn"`` (per seed: the first one, two or three nodes, or
sometimes a random subset in a random order, never every node) are what real deployments look
like. With ``seed_restarts`` above 0, a partition (``partition``, ``isolate``, ``seed-partition``)
whose losing side holds a seed node crashes one such seed node, with that probability, and
restarts it while the partition holds or right around the heal (then its links take 1 to 8 s to
come up, as TCP links reconnecting). :data:`REALISTIC` turns all of it on.

With ``rollout`` above 0, a seed may draw a rolling upgrade (:func:`rolling_upgrade`) that runs
alongside its schedule: the nodes start on :data:`PREVIOUS_BUILD` (an app version and a wire
protocol range); one at a time each leaves gracefully, is waited for until removed, and comes back
at its address as a new incarnation of :data:`NEXT_BUILD`; then one is rolled back the same way.
A crash of another node and a partition come during drawn steps, whatever the schedule does
meanwhile; a node restarted for any reason keeps its build. The quiet begins when both the
schedule and the rollout are done; the ``rollout`` checker then asks every member record for
the node's app version and every link for the protocol version both builds agree on, and the
report gives each step's phases in simulated seconds (:class:`RolloutStep`).

A node that is downed exits (as ``p2pshard node`` does) and a supervisor starts it again a few
seconds later. Meanwhile :class:`CounterWorkload` clients send numbered messages through every
node: to counters, and with the ``fan-out`` workload also to chat-like rooms that copy every post
to their members' inboxes (``p2pshard.testing._fanout``). After the schedule every fault is
lifted and the cluster is left quiet; then the checkers run: the history invariants (the fan-out
copies among them), membership and shard-home agreement, one cluster rather than islands,
every shard answering through every node, replica convergence, and that nothing an intruder
announced stuck.

With ``event_sourced``, the counters, rooms and inboxes are event-sourced entities on one
group-committing :class:`~p2pshard.MemoryJournal` the nodes share (a paused node's journal calls
wait for the pause to end, and arrive even if their callers are gone): their logs and copies are
read from the journal for the checkers, and ``journal-fencing`` checks from the journal's record
that no append was accepted under a token lower than one its stream had seen
(``p2pshard.testing._journaled``).

A run that hangs (a task that never lets the mock clock move on) is stopped after
:data:`WALL_LIMIT` real seconds: :func:`run_chaos` raises :class:`ChaosHung` naming the seed,
again every few seconds if something swallowed it, and as a last resort dumps every thread's
stack and ends the process; :func:`run_seeds` runs each seed in a child process that it kills
when it overruns, and reports the seed as a ``run-finishes`` violation while the others go on.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import trio
import trio.testing

from membership import (
    Address,
    ConfigurationError,
    LinkConditions,
    MemberStatus,
    SplitBrainResolverSettings,
    UniqueAddress,
    deterministic_scheduling,
)
from membership.internal import ProtocolRange, in_range

from .._config import NodeConfig
from .._failover import FAILOVER_PROFILES
from .._node import Node
from ..leases._memory import MemoryLeaseBackend
from ..persistence._memory import MemoryJournal, MemoryJournalStatistics
from ..sharding._extractor import HashExtractor
from ..sharding._settings import ShardingSettings
from ._checkers import (
    AGREEMENT,
    INVARIANTS,
    ROLLOUT,
    RUN_FINISHES,
    Violation,
    check_agreement_views,
    check_builds,
    check_convergence_digests,
    check_history,
    check_journal_calls,
    check_no_fakes,
    check_one_cluster,
)
from ._fanout import INBOX, ROOM, inbox_entity, room_entity, room_members
from ._history import History
from ._intruder import Intruder
from ._journaled import (
    chaos_journal,
    journaled_counter,
    journaled_inbox,
    journaled_room,
    node_journal,
    read_journal,
)
from ._sim import SimCluster, autojump_clock, node_address, node_name, simulated_cluster
from ._workload import COUNTER, CounterWorkload, Read, counter_entity, singleton_probe

CLASSIC_FAULTS = (
    "partition",
    "isolate",
    "bridge",
    "one-way",
    "flaky",
    "slow",
    "crash",
    "pause",
    "skew",
)
"""The fault kinds a schedule draws from by default: every kind but the last two of FAULTS."""

FAULTS = (*CLASSIC_FAULTS, "seed-partition", "intruder")
"""Every fault kind a schedule can draw from."""

SEED_LAYOUTS = ("all", "first-1", "first-2", "first-3", "drawn")
"""Which nodes are seed nodes: every one, the first one to three, or drawn per seed."""

WORKLOADS = ("counter", "fan-out")
"""The workloads a run can drive: counters, and rooms fanning posts out to inboxes."""

PROBE = "chaos-probe"
"""The singleton probe's name."""

WALL_LIMIT = 120
"""Real seconds one run may take before it fails as hung (a task that never lets the mock clock
move on, such as a busy loop, stops simulated time)."""

HUNG_RETRY = 10
"""Real seconds between further :class:`ChaosHung` raised into a hung run that swallowed one."""

HUNG_EXIT = 60
"""Real seconds after ``WALL_LIMIT`` when a run that still hangs ends its whole process, with
every thread's stack on standard error (the one stop that no task can swallow)."""


def one_or_more_of(allowed: tuple[str, ...]) -> Any:
    """An attrs validator: a non-empty tuple of fault kinds, each one of ``allowed``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, tuple) or not value or any(k not in allowed for k in value):
            raise ConfigurationError(
                f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: choose one "
                f"or more of {', '.join(allowed)}"
            )

    return check


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _one_of(allowed: tuple[str, ...]) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise ConfigurationError(
                f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: choose one "
                f"of {', '.join(allowed)}"
            )

    return check


DAY = 86400.0
"""The longest any duration setting may be, in seconds."""


def _profile_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and value not in FAILOVER_PROFILES:
        raise ConfigurationError(
            f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: choose one of "
            f"{', '.join(FAILOVER_PROFILES)}, or None"
        )


@attrs.frozen(kw_only=True)
class ChaosSettings:
    """What one chaos run does. Every field is checked: a bad value raises ConfigurationError."""

    nodes: int = attrs.field(default=5, validator=in_range(3, 64, integer=True))
    """Cluster size (at least 3)."""
    duration: float = attrs.field(default=30.0, validator=in_range(0, DAY))
    """Simulated seconds of faults."""
    quiet: float = attrs.field(default=40.0, validator=in_range(10, DAY))
    """Simulated seconds without faults before the final checks."""
    entities: int = attrs.field(default=20, validator=in_range(1, 1 << 20, integer=True))
    shards: int = attrs.field(default=10, validator=in_range(1, 1 << 16, integer=True))
    clients_per_node: int = attrs.field(default=1, validator=in_range(1, 1000, integer=True))
    message_interval: float = attrs.field(default=0.1, validator=in_range(0.001, 3600))
    """Seconds each workload client waits between messages (on average)."""
    use_lease: bool = True
    """Shard and singleton leases; without them single activation rests on the split brain
    resolver and the coordinator's removal margin."""
    removal_margin: float | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(in_range(0, 3600)),
    )
    """The counter type's ``down_removal_margin`` (None: the default, ``stable_after`` without
    leases and 0 with them). 0 without leases shows what the margin prevents."""
    faults: tuple[str, ...] = attrs.field(
        default=CLASSIC_FAULTS, converter=_names, validator=one_or_more_of(FAULTS)
    )
    """The fault kinds the schedule draws from (default :data:`CLASSIC_FAULTS`; every kind is in
    :data:`FAULTS`)."""
    seed_layout: str = attrs.field(default="all", validator=_one_of(SEED_LAYOUTS))
    """Which nodes are the seed nodes, in every node's configuration: ``all`` (default, every
    node, in order: a restarted node finds the cluster through whichever node it reaches),
    ``first-1``, ``first-2``, ``first-3`` (nodes 1 to k), or ``drawn``: per seed, the first one,
    two or three nodes, or (one time in four) a random subset of 1 to ``nodes - 1`` nodes in a
    random order; never every node. The first seed node is the one that forms a new cluster when
    no other seed node answers."""
    seed_restarts: float = attrs.field(default=0.0, validator=in_range(0, 1))
    """The probability that a partition whose losing side (the minority, the isolated node)
    holds a running seed node crashes one of those seed nodes during the partition and starts
    it again while the partition holds or within 1.5 s of the heal; in the second case its links
    take 1 to 8 s more to come up, as TCP links reconnecting after a partition (default 0:
    never)."""
    duplicate: float = attrs.field(default=0.0, validator=in_range(0, 1))
    """Test-only: the probability that a link delivers a frame twice. TCP never does; the
    checkers must then catch messages handled twice."""
    workloads: tuple[str, ...] = attrs.field(
        default=("counter",), converter=_names, validator=one_or_more_of(WORKLOADS)
    )
    """Which clients run: ``counter`` (numbered messages to counters) and ``fan-out`` (numbered
    posts to rooms of ``rooms`` rooms, each copying them to ``members_per_room`` of ``inboxes``
    inboxes before it answers)."""
    rooms: int = attrs.field(default=5, validator=in_range(1, 1 << 16, integer=True))
    inboxes: int = attrs.field(default=10, validator=in_range(1, 1 << 16, integer=True))
    members_per_room: int = attrs.field(default=3, validator=in_range(1, 1 << 16, integer=True))
    double_activation_at: float | None = None
    """Test-only: at this time, start a live entity's shard on a second node too, skipping its
    lease. The single-activation checker must catch it."""
    profile: str | None = attrs.field(default=None, validator=_profile_name)
    """A failover profile by name (``p2pshard.FAILOVER_PROFILES``: ``fast-lan`` or
    ``default``) applied to every node's timing (failure detector, gossip, split brain
    resolver, leases) and the entity types' retries, in place of the simulation's own (default
    None: 1 s heartbeats, ``stable_after`` 5 s, 4 s leases)."""
    event_sourced: bool = False
    """Counters, rooms and inboxes keep their state as events in one group-committing
    :class:`~p2pshard.MemoryJournal` the nodes share, with their shards' lease tokens; the
    checkers read the logs and copies from the journal and check its fencing (default False:
    plain entities whose logs are kept in the history)."""
    rollout: float = attrs.field(default=0.0, validator=in_range(0, 1))
    """The probability that a run performs a rolling upgrade alongside its fault schedule, drawn
    per seed from a generator of its own (default 0: never; 1: every seed). The nodes start on
    :data:`PREVIOUS_BUILD`; one at a time, each leaves gracefully and comes back at its address
    as :data:`NEXT_BUILD`; then one, drawn, is rolled back the same way. One drawn step sees a
    crash of another node, one a partition (see :func:`rolling_upgrade`)."""

    def __attrs_post_init__(self) -> None:
        if self.seed_layout.startswith("first-") and int(self.seed_layout[6:]) > self.nodes:
            raise ConfigurationError(
                f"ChaosSettings.seed_layout = {self.seed_layout!r} is invalid with {self.nodes} "
                "nodes: name at most as many seed nodes as there are nodes"
            )


REALISTIC = ChaosSettings(seed_layout="drawn", seed_restarts=0.5, faults=FAULTS)
"""The settings that make a run as hard as real hosts: seed nodes drawn per seed, seed nodes
restarted during partitions, every fault kind (the intruder too). Combine with others through
``attrs.evolve``."""


@attrs.frozen
class Build:
    """A release of the application a node can run: its app version and wire protocol range.

    Example:
        >>> NEXT_BUILD.protocol.agree(PREVIOUS_BUILD.protocol)
        1
    """

    app_version: str
    protocol: ProtocolRange

    def __str__(self) -> str:
        return f"{self.app_version} ({self.protocol})"


PREVIOUS_BUILD = Build("1.0.0", ProtocolRange(1, 1))
"""The build a rolling upgrade starts from: this release's protocol only."""

NEXT_BUILD = Build("1.1.0", ProtocolRange(1, 2))
"""The build a rolling upgrade moves to: it still speaks version 1, so it links to the previous
build at 1 and to its own kind at 2."""

ROLLOUT_STEP_BOUND = 90.0
"""Simulated seconds a rollout step waits for each phase: the node Up everywhere before it leaves,
its leave (then it is killed), its removal (then it comes back anyway), its new incarnation Up.
The first and the last stop the rollout when they run out."""


@attrs.frozen(kw_only=True)
class RolloutStep:
    """One node's step of a rolling upgrade (or of the roll-back), and how long each phase took.

    Each duration is in simulated seconds from the start of the node's graceful leave; ``None``
    where the phase did not end within :data:`ROLLOUT_STEP_BOUND`.
    """

    node: str
    old: str
    """The app version it ran."""
    new: str
    """The app version it runs now."""
    at: float
    """When (trio clock) the leave began."""
    waited: float
    """Seconds the step waited first for the node to run and be Up in every running node's view
    (after a crash, a partition, or being downed)."""
    left: float | None
    """Until the old incarnation had left and stopped (else it was crashed at the bound)."""
    removed: float | None
    """Until every running node had dropped the old incarnation or listed it as Removed."""
    up: float | None
    """Until every running node saw the new incarnation Up: the whole step."""

    def __str__(self) -> str:
        def phase(seconds: float | None) -> str:
            return "not within the bound" if seconds is None else f"{seconds:.1f}s"

        return (
            f"{self.node} {self.old} -> {self.new}: left {phase(self.left)}, removed "
            f"{phase(self.removed)}, Up {phase(self.up)}"
            + (f" (waited {self.waited:.1f}s for it to be Up first)" if self.waited else "")
        )


@attrs.frozen(kw_only=True)
class RolloutReport:
    """What a run's rolling upgrade did, and the builds and links it left after the quiet."""

    steps: tuple[RolloutStep, ...]
    """Every step taken, in order: the upgrades, then the roll-back."""
    versions: tuple[tuple[str, str], ...]
    """(node, app version) as the running nodes' member records show it; differing views are
    joined with ``|``."""
    links: tuple[tuple[str, str, int | None], ...]
    """(from, to, protocol version) of every ordered pair of running nodes (None: no link)."""


@attrs.frozen
class ChaosReport:
    """What one seed did and what the checkers found."""

    seed: int
    settings: ChaosSettings
    violations: tuple[Violation, ...]
    faults: tuple[str, ...]
    incarnations: int
    sent: int
    acknowledged: int
    trace_hash: str
    seed_nodes: tuple[str, ...] = ()
    """The seed nodes of the run, in configuration order (the first one forms the cluster)."""
    rollout: RolloutReport | None = None
    """What the run's rolling upgrade did (None: the run had none)."""
    journal: MemoryJournalStatistics | None = None
    """What the event-sourced entities' journal did (None: plain entities)."""

    @property
    def ok(self) -> bool:
        """No invariant broken."""
        return not self.violations

    def replay_command(self) -> str:
        """The ``p2pshard chaos`` command that runs this seed again."""
        s = self.settings
        parts = [
            f"p2pshard chaos --seed {self.seed} --nodes {s.nodes}",
            f"--duration {s.duration:g} --quiet {s.quiet:g}",
        ]
        if s.message_interval != ChaosSettings().message_interval:
            parts.append(f"--message-interval {s.message_interval:g}")
        if not s.use_lease:
            parts.append("--no-lease")
        if s.removal_margin is not None:
            parts.append(f"--removal-margin {s.removal_margin:g}")
        default = ChaosSettings()
        if s.faults != default.faults:
            parts.append(f"--faults {','.join(s.faults)}")
        if s.workloads != default.workloads:
            parts.append(f"--workloads {','.join(s.workloads)}")
        if s.seed_layout != default.seed_layout:
            parts.append(f"--seed-layout {s.seed_layout}")
        if s.seed_restarts != default.seed_restarts:
            parts.append(f"--seed-restarts {s.seed_restarts:g}")
        if s.profile is not None:
            parts.append(f"--profile {s.profile}")
        if s.rollout != default.rollout:
            parts.append(f"--rollout {s.rollout:g}")
        if s.event_sourced:
            parts.append("--event-sourced")
        return " ".join(parts)


def run_chaos(seed: int, settings: ChaosSettings | None = None) -> ChaosReport:
    """Run one seeded chaos schedule in its own ``trio.run`` and check every invariant.

    The same seed and settings give the same run (compare ``trace_hash``). Fails with
    :class:`ChaosHung` after ``WALL_LIMIT`` real seconds.
    """
    return run_scenario(seed, random_schedule, settings)


def run_scenario(
    seed: int,
    body: ScenarioBody,
    settings: ChaosSettings | None = None,
    *,
    split_brain_resolver: SplitBrainResolverSettings | None = None,
    sharding: ShardingSettings | None = None,
    configure: Callable[[int, NodeConfig], NodeConfig] | None = None,
    stop_message: object = None,
    builds: tuple[Build, Build] = (PREVIOUS_BUILD, NEXT_BUILD),
) -> ChaosReport:
    """Run ``body`` against a chaos cluster in its own ``trio.run``, then check every invariant.

    The cluster is the one :func:`run_chaos` uses (``settings.nodes`` nodes, the counter entity
    type, the singleton probe, a counter workload, downed nodes restarted); ``body`` gets the
    :class:`Scenario` once every node is Up and injects its faults. When it returns, every fault
    is lifted, the cluster is left quiet for ``settings.quiet`` and the checkers run.
    ``sharding`` replaces the counter type's settings (``use_lease`` still follows
    ``settings``); ``split_brain_resolver`` the default keep-majority after 5 s; ``configure``
    adjusts node ``i``'s configuration before each start; ``stop_message`` is what the
    counters get when their shard is handed off (by default they are just stopped). When the
    seed draws a rolling upgrade (``settings.rollout``), it runs alongside ``body`` from the
    first of ``builds`` to the second (a test may hand in builds that cannot link), and the
    quiet begins once both are done.
    """
    settings = settings or ChaosSettings()

    async def main() -> ChaosReport:
        return await _scenario(
            seed, body, settings, split_brain_resolver, sharding, configure, stop_message, builds
        )

    with _watchdog(seed):
        try:
            with deterministic_scheduling(seed):
                return trio.run(main, clock=autojump_clock())
        except BaseException as exc:
            hung = _hung_in(exc)
            if hung is None or hung is exc:
                raise
            # Raised inside a task, it comes wrapped in the nurseries' groups: say it plainly.
            raise ChaosHung(str(hung)) from exc


class ChaosHung(BaseException):
    """A chaos run took longer than ``WALL_LIMIT`` real seconds.

    A BaseException, so that no ``except Exception`` in the code under test swallows it.
    """


@contextlib.contextmanager
def _watchdog(seed: int) -> Iterator[None]:
    """Stop a hung run: ChaosHung after WALL_LIMIT s, again every HUNG_RETRY s, then exit.

    The alarm signal reaches only the main thread; elsewhere only the last resort is armed.
    """
    limit = WALL_LIMIT
    raised = 0

    def hung(signum: int, frame: object) -> None:
        nonlocal raised
        raised += 1
        signal.alarm(HUNG_RETRY)  # in case something swallows this one
        message = (
            f"seed {seed}: not done after {limit + (raised - 1) * HUNG_RETRY} s of real time: a "
            "task that never lets the mock clock move on (a busy loop)?"
        )
        if raised == 1:
            print(
                f"{message} The process ends in {HUNG_EXIT} s unless the run stops.",
                file=sys.stderr,
                flush=True,
            )
        raise ChaosHung(message)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGALRM, hung) if main else None
    if main:
        signal.alarm(limit)
    # The one stop nothing can swallow: a thread of the interpreter's own, which prints every
    # thread's stack and ends the process, even while the main thread is stuck in native code.
    faulthandler.dump_traceback_later(limit + HUNG_EXIT, exit=True, file=2)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if main:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _hung_in(exc: BaseException) -> ChaosHung | None:
    """The ChaosHung that ``exc`` is or holds (in exception groups), if any."""
    if isinstance(exc, ChaosHung):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _hung_in(inner)
            if found is not None:
                return found
    return None


KILL_AFTER = 10
"""Real seconds past ``WALL_LIMIT + HUNG_EXIT`` when :func:`run_seeds` kills a seed's process
that has not ended itself."""


def run_seeds(
    seeds: Iterable[int], settings: ChaosSettings | None = None, *, jobs: int = 1
) -> Iterator[ChaosReport]:
    """Run many seeds, each in a child process, ``jobs`` at a time; yields reports in seed order.

    Each run's own log output is silenced (the report carries what matters). A seed whose run
    raises, hangs past ``WALL_LIMIT`` or whose process dies yields a report with one
    ``run-finishes`` violation that says what happened (and where it was running, for a hang);
    the other seeds go on. A hung seed's process is killed ``WALL_LIMIT + HUNG_EXIT +
    KILL_AFTER`` real seconds after it started at the latest, after a dump of its stack on
    standard error.
    """
    settings = settings or ChaosSettings()
    order = list(seeds)
    context = multiprocessing.get_context("fork")
    pending = list(enumerate(order))
    pending.reverse()
    running: dict[int, _Child] = {}
    done: dict[int, ChaosReport] = {}
    try:
        for n in range(len(order)):
            while n not in done:
                while pending and len(running) < max(1, jobs):
                    index, started = pending.pop()
                    running[index] = _Child.start(context, started, settings)
                _wait_for_children(running, done, settings)
            yield done.pop(n)
    finally:
        for child in running.values():
            child.process.kill()
            child.process.join()


@attrs.define(eq=False)
class _Child:
    """One seed's run in a forked process, and the end of the pipe its report comes through."""

    seed: int
    process: Any
    reports: multiprocessing.connection.Connection
    deadline: float

    @classmethod
    def start(cls, context: Any, seed: int, settings: ChaosSettings) -> _Child:
        reports, send = context.Pipe(duplex=False)
        process = context.Process(
            target=_child_main, args=(seed, settings, send), name=f"chaos seed {seed}", daemon=True
        )
        process.start()
        send.close()  # so that the pipe reads as closed once the child is gone
        deadline = time.monotonic() + WALL_LIMIT + HUNG_EXIT + KILL_AFTER
        return cls(seed, process, reports, deadline)


def _wait_for_children(
    running: dict[int, _Child], done: dict[int, ChaosReport], settings: ChaosSettings
) -> None:
    """Wait until a child reports, dies or overruns, and put its report in ``done``."""
    now = time.monotonic()
    timeout = max(0.0, min(child.deadline for child in running.values()) - now)
    ready = multiprocessing.connection.wait([c.reports for c in running.values()], timeout)
    for index, child in list(running.items()):
        if child.reports in ready:
            try:
                report: ChaosReport = child.reports.recv()
            except EOFError:
                child.process.join()
                report = _failed(
                    child.seed,
                    settings,
                    f"its process ended without a report (exit code {child.process.exitcode}; "
                    "a stack dump on standard error says where it was if it hung)",
                )
        elif time.monotonic() >= child.deadline:
            os.kill(child.process.pid, signal.SIGUSR1)  # the child dumps its stacks
            child.process.join(1.0)
            child.process.kill()
            report = _failed(
                child.seed,
                settings,
                f"killed after {WALL_LIMIT + HUNG_EXIT + KILL_AFTER} s of real time (its "
                "stacks are on standard error)",
            )
        else:
            continue
        child.process.join()
        child.reports.close()
        del running[index]
        done[index] = report


def _child_main(seed: int, settings: ChaosSettings, reports: Any) -> None:
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
    try:
        report = _run_quietly(seed, settings)
    except ChaosHung as exc:
        report = _failed(seed, settings, f"{exc} It was running {_where(exc)}.")
    except BaseException as exc:  # reported as this seed's failure; the other seeds go on
        report = _failed(seed, settings, f"raised {_where(exc)}")
    reports.send(report)
    reports.close()


def _failed(seed: int, settings: ChaosSettings, detail: str) -> ChaosReport:
    named = detail if detail.startswith(f"seed {seed}: ") else f"seed {seed}: {detail}"
    return ChaosReport(seed, settings, (Violation(RUN_FINISHES, named),), (), 0, 0, 0, "")


def _where(exc: BaseException) -> str:
    """For a hang: the innermost frames the alarm interrupted. Else: the whole traceback."""
    if not isinstance(exc, ChaosHung):
        return "".join(traceback.format_exception(exc)).rstrip()
    if isinstance(exc.__cause__, BaseException):
        exc = _hung_in(exc.__cause__) or exc
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.name != "hung"][-3:]
    where = " < ".join(
        f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in reversed(frames)
    )
    return where or "(no frame recorded)"


def _run_quietly(seed: int, settings: ChaosSettings) -> ChaosReport:
    with _silenced(), contextlib.redirect_stdout(None):
        return run_chaos(seed, settings)


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


@attrs.define(eq=False)
class Scenario:
    """What a scenario body works with: the cluster, a seeded generator, the settings.

    Node numbers run from 1 to ``settings.nodes``; ``sim.live`` are those running now.
    """

    sim: SimCluster
    rng: random.Random
    settings: ChaosSettings
    backend: MemoryLeaseBackend
    down: set[int] = attrs.field(factory=set)
    """Nodes crashed or exited that will be started again."""
    seeds: tuple[int, ...] = ()
    """The seed nodes, in configuration order."""
    intruder: Intruder | None = None
    """The ``intruder`` fault's attacker (one per run, attached only during its faults)."""
    rollout: Rollout | None = None
    """The run's rolling upgrade, if its seed drew one: each node's build, the steps so far."""
    journal: MemoryJournal | None = None
    """The event-sourced entities' journal (``settings.event_sourced``), else None."""

    @property
    def nodes(self) -> list[int]:
        """Every node number of the cluster."""
        return list(range(1, self.settings.nodes + 1))

    def set_build(self, i: int, build: Build) -> None:
        """Run ``build`` on node ``i`` from its next start on, and on every restart after it."""
        if self.rollout is None:
            raise RuntimeError("set_build needs a rollout: the run's seed drew none")
        self.rollout.builds[i] = build
        self.sim.protocols[i] = build.protocol

    def crash(self, i: int, *, restart_after: float | None, why: str = "") -> None:
        """Kill node ``i``; start it again (a new incarnation) after ``restart_after`` seconds.

        The restart keeps the node's build. ``why`` is added to the fault's line.
        """
        self.down.add(i)
        self.sim.history.fault(f"crash n{i}{why}")
        self.sim.crash(i)
        if restart_after is not None:
            self.sim.nursery.start_soon(self.restart_later, i, restart_after)

    def restart_seed(
        self, i: int, *, crash_at: float, restart_at: float, when: str, reconnect: float = 0.0
    ) -> None:
        """In ``crash_at`` s, crash seed node ``i`` if it runs; start it again at ``restart_at``.

        With ``reconnect``, the restarted node's links take that long to come up: what it sends
        and what is sent to it meanwhile waits and arrives when they do, as over TCP links that
        reconnect with a back-off after a partition.
        """

        async def crash_then_restart() -> None:
            sim = self.sim
            await trio.sleep(crash_at)
            if i not in sim.nodes or i in self.down:
                return  # downed and exited meanwhile: its supervisor restarts it
            links = f", links up {reconnect:.1f}s later" if reconnect else ""
            sim.history.fault(
                f"seed-restart n{i}: crashed, back in {restart_at - crash_at:.1f}s ({when}{links})"
            )
            self.down.add(i)
            sim.crash(i)
            await trio.sleep(restart_at - crash_at)
            if reconnect:
                up = trio.current_time() + reconnect
                held = attrs.evolve(
                    sim.links, delay_sampler=lambda rng: max(up - trio.current_time(), 0.001)
                )
                sim.set_links(i, held, among=self.nodes)
                sim.nursery.start_soon(_links_back, sim, i, self.nodes, reconnect)
            await self.restart_later(i, 0.0)

        self.sim.nursery.start_soon(crash_then_restart)

    async def restart_later(self, i: int, delay: float) -> None:
        """Start node ``i`` again after ``delay`` seconds, unless it runs by then."""
        await trio.sleep(delay)
        self.down.discard(i)
        if i not in self.sim.nodes:
            await self.sim.start(i)

    def coordinator_node(self) -> int:
        """The node running the counter type's coordinator: the oldest member, as seen by any."""
        i = self.sim.live[0]
        oldest = self.sim.nodes[i].cluster.singleton_host()
        assert oldest is not None
        return next(j for j in self.sim.live if self.sim.nodes[j].address == oldest.node)


ScenarioBody = Callable[[Scenario], Awaitable[None]]
"""A scenario: injects faults into the running cluster, returns when done."""


@attrs.define(eq=False)
class Rollout:
    """A rolling upgrade: its two builds, the build of each node now, what happened so far."""

    previous: Build
    next: Build
    builds: dict[int, Build] = attrs.field(factory=dict)
    """The build each node runs; a node restarted for any reason comes back with it."""
    steps: list[RolloutStep] = attrs.field(factory=list)
    """The steps taken so far, in order."""
    violations: list[Violation] = attrs.field(factory=list)
    """Why the rollout stopped before its last step, if it did."""


async def rolling_upgrade(scenario: Scenario, rng: random.Random) -> None:
    """Upgrade every node, one at a time, to ``scenario.rollout.next``; then roll one back.

    The order and the node rolled back are drawn from ``rng``. Each step waits until its node
    runs and every running node sees it Up (one crashed or downed is restarted by its
    supervisor first), lets it leave gracefully (its shards handed off, as ``p2pshard node``
    does on SIGTERM), waits until every running node dropped the old incarnation or lists it as
    Removed, starts it again at its address as a new incarnation of the other build, and waits
    until every running node sees it Up: the phases timed in its :class:`RolloutStep`. During
    one drawn step another node crashes (back after 3 to 12 s), during one drawn step a minority
    of the running nodes is cut off for 2 to 15 s. A phase that does not end within
    :data:`ROLLOUT_STEP_BOUND` moves on, but a node that is not Up everywhere before its step,
    or after it, stops the rollout as a ``rollout`` violation, as an operator stops rolling out
    when a new node does not join.

    Raises:
        RuntimeError: the scenario has no rollout (its seed drew none).
    """
    rollout = scenario.rollout
    if rollout is None:
        raise RuntimeError("rolling_upgrade needs a rollout: the run's seed drew none")
    nodes = scenario.nodes
    plan = [(i, rollout.next) for i in rng.sample(nodes, len(nodes))]
    plan.append((rng.choice(nodes), rollout.previous))
    crash = (rng.randrange(len(plan)), rng.uniform(0.5, 4.0), rng.uniform(3.0, 12.0))
    partition = (rng.randrange(len(plan)), rng.uniform(0.5, 4.0), rng.uniform(2.0, 15.0))
    picks = random.Random(rng.getrandbits(64))  # the victims, drawn when the faults come
    async with trio.open_nursery() as faults:
        for n, (i, build) in enumerate(plan):
            if n == crash[0]:
                faults.start_soon(_rollout_crash, scenario, picks, crash[1], crash[2])
            if n == partition[0]:
                faults.start_soon(_rollout_partition, scenario, picks, partition[1], partition[2])
            if not await _rollout_step(scenario, rollout, i, build):
                break


async def _rollout_step(scenario: Scenario, rollout: Rollout, i: int, build: Build) -> bool:
    """One node to ``build``: leave, removed, back, Up. False: the rollout stops here."""
    sim, name, bound = scenario.sim, node_name(i), ROLLOUT_STEP_BOUND
    began = trio.current_time()
    with trio.move_on_after(bound):
        while i in scenario.down or not _up_everywhere(sim, i):  # noqa: ASYNC110 - mock clock
            await trio.sleep(0.1)
    if i in scenario.down or not _up_everywhere(sim, i):
        rollout.violations.append(
            Violation(
                ROLLOUT,
                f"{name} was not Up in every running node's view {bound:g} s after its step to "
                f"{build} was due: the rollout stopped there",
            )
        )
        return False
    start = trio.current_time()
    old, was = sim.nodes[i].address, rollout.builds[i]
    scenario.down.add(i)  # its exit is the rollout's: no supervisor restarts it meanwhile
    sim.history.fault(f"rollout {name}: leaves, back as {build}")
    left = removed = up = None
    with trio.move_on_after(bound):
        await sim.graceful_leave(i)
        left = trio.current_time() - start
    if left is None:  # a leave that hangs is ended as an operator would: kill -9
        sim.crash(i)
        await sim.done[i].wait()
    with trio.move_on_after(bound):
        while any(  # noqa: ASYNC110 - polls cluster state on the mock clock
            m.node == old and m.status is not MemberStatus.REMOVED
            for j in sim.live
            for m in sim.nodes[j].cluster.members
        ):
            await trio.sleep(0.1)
        removed = trio.current_time() - start
    scenario.set_build(i, build)
    await scenario.restart_later(i, 0.0)
    with trio.move_on_after(bound):
        while not _up_everywhere(sim, i):  # noqa: ASYNC110 - polls cluster state on the mock clock
            await trio.sleep(0.1)
        up = trio.current_time() - start
    step = RolloutStep(
        node=name,
        old=was.app_version,
        new=build.app_version,
        at=start,
        waited=start - began,
        left=left,
        removed=removed,
        up=up,
    )
    rollout.steps.append(step)
    sim.history.fault(f"rollout {step}")
    if up is None:
        rollout.violations.append(
            Violation(
                ROLLOUT,
                f"{name} ({build.app_version}, {build.protocol}) was not Up in every running "
                f"node's view {bound:g} s after it left: the rollout stopped there",
            )
        )
    return up is not None


def _up_everywhere(sim: SimCluster, i: int) -> bool:
    """Whether node ``i`` runs and every running node sees this incarnation of it Up."""
    node = sim.nodes.get(i)
    return node is not None and all(
        any(m.node == node.address and m.status is MemberStatus.UP for m in view.cluster.members)
        for view in sim.nodes.values()
    )


async def _rollout_crash(
    scenario: Scenario, rng: random.Random, delay: float, restart_after: float
) -> None:
    await trio.sleep(delay)
    live = [i for i in scenario.sim.live if i not in scenario.down]
    if len(live) < 2:
        scenario.sim.history.fault("crash skipped (rollout): too few nodes running")
        return
    scenario.crash(rng.choice(live), restart_after=restart_after, why=" (rollout)")


async def _rollout_partition(
    scenario: Scenario, rng: random.Random, delay: float, lasting: float
) -> None:
    sim = scenario.sim
    await trio.sleep(delay)
    live = [i for i in sim.live if i not in scenario.down]
    if len(live) < 2:
        sim.history.fault("partition skipped (rollout): too few nodes running")
        return
    most = min(len(scenario.nodes) // 2, len(live) - 1)
    minority = sorted(rng.sample(live, rng.randint(1, most)))
    sim.partition(minority, [i for i in scenario.nodes if i not in minority])
    sim.history.fault(f"partition {minority} for {lasting:.1f}s (rollout)")
    await trio.sleep(lasting)
    sim.heal()


async def _roll_out(scenario: Scenario, rng: random.Random, done: trio.Event) -> None:
    try:
        await trio.sleep(rng.uniform(1.0, 5.0))
        await rolling_upgrade(scenario, rng)
    finally:
        done.set()


def _built(
    rollout: Rollout, configure: Callable[[int, NodeConfig], NodeConfig] | None
) -> Callable[[int, NodeConfig], NodeConfig]:
    """Each node's build's app version first, then ``configure`` (which has the last word)."""

    def both(i: int, config: NodeConfig) -> NodeConfig:
        config = attrs.evolve(config, app_version=rollout.builds[i].app_version)
        return config if configure is None else configure(i, config)

    return both


def _versions_seen(sim: SimCluster) -> Iterator[tuple[str, dict[str, str]]]:
    """Per running node: the app version its member record of each running node shows."""
    running = {node.address: node_name(i) for i, node in sim.nodes.items()}
    for i in sim.live:
        members = sim.nodes[i].cluster.members
        yield node_name(i), {running[m.node]: m.app_version for m in members if m.node in running}


def _rollout_report(scenario: Scenario, rollout: Rollout) -> RolloutReport:
    sim = scenario.sim
    seen: dict[str, set[str]] = {}
    for _, view in _versions_seen(sim):
        for name, version in view.items():
            seen.setdefault(name, set()).add(version)
    return RolloutReport(
        steps=tuple(rollout.steps),
        versions=tuple(
            (node_name(i), "|".join(sorted(seen.get(node_name(i), ())))) for i in sim.live
        ),
        links=tuple(
            (node_name(a), node_name(b), sim.nodes[a].transport.peer_protocol(node_address(b)))
            for a in sim.live
            for b in sim.live
            if a != b
        ),
    )


async def random_schedule(scenario: Scenario) -> None:
    """The chaos schedule: random faults of ``settings.faults``, for ``settings.duration`` s."""
    sim, rng, settings = scenario.sim, scenario.rng, scenario.settings
    start = trio.current_time()
    while trio.current_time() - start < settings.duration:
        await trio.sleep(rng.uniform(1.0, 5.0))
        live = [i for i in sim.live if i not in scenario.down]
        if len(live) < 3:
            continue
        await _inject(scenario, rng.choice(settings.faults), live)


async def _scenario(
    seed: int,
    body: ScenarioBody,
    settings: ChaosSettings,
    split_brain_resolver: SplitBrainResolverSettings | None,
    sharding: ShardingSettings | None,
    configure: Callable[[int, NodeConfig], NodeConfig] | None,
    stop_message: object,
    builds: tuple[Build, Build],
) -> ChaosReport:
    rng = random.Random(seed)
    history = History()
    # The backend's latencies have a stream of their own: how many lease calls the code makes
    # must not change which faults a seed draws (node leases made fewer, and every schedule
    # changed with them).
    latencies = random.Random(f"{seed}/lease-latency")
    backend = MemoryLeaseBackend(latency=lambda: latencies.uniform(0.001, 0.02))
    links = LinkConditions(delay_min=0.001, delay_max=0.005, duplicate=settings.duplicate)
    sharding = attrs.evolve(
        sharding or ShardingSettings(lease_retry_interval=1.0, rebalance_interval=5.0),
        use_lease=settings.use_lease,
    )
    if settings.removal_margin is not None:
        sharding = attrs.evolve(sharding, down_removal_margin=settings.removal_margin)
    journal: MemoryJournal | None = None
    if settings.event_sourced:  # commit latencies from a generator of their own, as the lease's
        commits = random.Random(f"{seed}/journal-latency")
        journal = chaos_journal(lambda: commits.uniform(0.001, 0.02))
    profile = None if settings.profile is None else FAILOVER_PROFILES[settings.profile]
    if profile is not None:
        sharding = profile.sharding(sharding)
        configure = _profiled(profile.apply, configure)

    async def setup(i: int, node: Node, sim: SimCluster) -> None:
        node.sharding.observe(history.observer(node_name(i)))
        own = None if journal is None else node_journal(journal, sim, i)
        sim.regions[i] = await node.sharding.start(
            COUNTER,
            counter_entity(history) if own is None else journaled_counter(own),
            extractor=HashExtractor(settings.shards),
            settings=sharding,
            stop_message=stop_message,
        )
        if "fan-out" in settings.workloads:
            await node.sharding.start(
                INBOX,
                inbox_entity(history) if own is None else journaled_inbox(own),
                extractor=HashExtractor(settings.shards),
                settings=sharding,
            )
            members = functools.partial(
                room_members, inboxes=settings.inboxes, per_room=settings.members_per_room
            )
            await node.sharding.start(
                ROOM,
                room_entity(history, node.sharding, members)
                if own is None
                else journaled_room(history, own, node.sharding, members),
                extractor=HashExtractor(settings.shards),
                settings=sharding,
            )
        lease = node.leases.lease(f"sim-singleton-{PROBE}") if settings.use_lease else None
        await node.singletons.start(PROBE, singleton_probe(history, i), lease=lease)

    # Its own generator, so that a run without a rollout draws nothing more from ``rng``.
    rollout_rng = random.Random(f"{seed}/rollout")
    rollout = None
    if settings.rollout and rollout_rng.random() < settings.rollout:
        rollout = Rollout(*builds)
        configure = _built(rollout, configure)

    async with simulated_cluster(seed, setup, links=links, history=history) as sim:
        sim.lease_backend = backend
        sim.exit_when_terminated = True
        sim.split_brain_resolver = split_brain_resolver
        sim.configure = configure
        if profile is not None:  # what the nodes use, and what bounds the skew fault
            sim.lease_settings = profile.lease_settings(sim.lease_settings)
        # Their own generators, so that the old settings draw nothing more from ``rng``.
        seeds = draw_seed_nodes(settings, random.Random(f"{seed}/seed-nodes"))
        sim.seeds = tuple(node_address(i) for i in seeds)
        intruder = Intruder(sim, random.Random(f"{seed}/intruder"))
        scenario = Scenario(
            sim,
            rng,
            settings,
            backend,
            seeds=seeds,
            intruder=intruder,
            rollout=rollout,
            journal=journal,
        )
        nodes = scenario.nodes
        if rollout is not None:
            for i in nodes:
                scenario.set_build(i, rollout.previous)

        def on_exit(i: int) -> None:
            if i not in scenario.down:  # downed: a supervisor starts it again
                scenario.down.add(i)
                history.fault(f"n{i} exited (downed); restarts")
                sim.nursery.start_soon(scenario.restart_later, i, rng.uniform(2.0, 6.0))

        sim.on_exit = on_exit
        for i in nodes:
            await sim.start(i)
        await sim.all_up(nodes)

        clients: dict[str, dict[str, Any]] = {  # fan-out posters send to rooms
            "counter": {"entities": settings.entities},
            "fan-out": {"entities": settings.rooms, "type_name": ROOM, "prefix": "p"},
        }
        for kind in settings.workloads:
            workload = CounterWorkload(
                sim,
                random.Random(f"{seed}/{'workload' if kind == 'counter' else kind}"),
                clients_per_node=settings.clients_per_node,
                interval=settings.message_interval,
                ask_timeout=2.0 if kind == "counter" else 4.0,
                **clients[kind],
            )
            sim.nursery.start_soon(workload.run, nodes)
        if settings.double_activation_at is not None:
            sim.nursery.start_soon(_double_activation, sim, settings.double_activation_at)
        rolled = trio.Event()
        if rollout is not None:
            sim.nursery.start_soon(_roll_out, scenario, rollout_rng, rolled)

        await body(scenario)
        if rollout is not None:  # (a run without one keeps its schedule: no checkpoint here)
            await rolled.wait()  # bounded: every phase of every step is
        sim.heal()
        for i in nodes:
            sim.set_links(i, links, among=nodes)
            sim.skew(i, 1.0)
        await trio.sleep(settings.quiet)
        if journal is not None:
            read_journal(journal, history)
        violations = check_history(history)
        if journal is not None:
            violations += check_journal_calls(
                journal.accepted_calls(),
                {pid: len(journal.events(pid)) for pid in journal.persistence_ids()},
            )
        violations += intruder.found
        violations += await _check_cluster(sim, nodes, settings, intruder.fakes)
        rolled_out = None
        if rollout is not None:
            rolled_out = _rollout_report(scenario, rollout)
            violations += rollout.violations
            violations += check_builds(
                {
                    node_name(i): (rollout.builds[i].app_version, rollout.builds[i].protocol)
                    for i in sim.live
                },
                dict(_versions_seen(sim)),
                {(a, b): v for a, b, v in rolled_out.links},
            )
        report = ChaosReport(
            seed,
            settings,
            tuple(violations),
            tuple(history.faults),
            history.incarnation_count(),
            len(history.messages),
            history.acknowledged_count(),
            sim.net.trace_hash(),
            tuple(node_name(i) for i in seeds),
            rolled_out,
            None if journal is None else journal.statistics(),
        )
        for i in sim.live:
            sim.crash(i)
        return report


def _profiled(
    apply: Callable[[NodeConfig], NodeConfig],
    configure: Callable[[int, NodeConfig], NodeConfig] | None,
) -> Callable[[int, NodeConfig], NodeConfig]:
    """The profile first, then the scenario's own ``configure`` (which has the last word)."""

    def both(i: int, config: NodeConfig) -> NodeConfig:
        config = apply(config)
        return config if configure is None else configure(i, config)

    return both


def draw_seed_nodes(settings: ChaosSettings, rng: random.Random) -> tuple[int, ...]:
    """The seed node numbers for ``settings.seed_layout``, in configuration order.

    Example:
        >>> draw_seed_nodes(ChaosSettings(seed_layout="first-2"), random.Random(1))
        (1, 2)
    """
    n, layout = settings.nodes, settings.seed_layout
    if layout == "all":
        return tuple(range(1, n + 1))
    if layout.startswith("first-"):
        return tuple(range(1, int(layout[6:]) + 1))
    if rng.random() < 0.25:  # what a hand-written list of hosts may look like
        return tuple(rng.sample(range(1, n + 1), rng.randint(1, n - 1)))
    return tuple(range(1, min(rng.choice((1, 2, 3)), n - 1) + 1))


async def _inject(scenario: Scenario, kind: str, live: list[int]) -> None:
    sim, rng, nodes = scenario.sim, scenario.rng, scenario.nodes
    lasting = rng.uniform(2.0, 15.0)
    history = sim.history
    if kind == "intruder":
        assert scenario.intruder is not None
        await scenario.intruder.session()
        return
    if kind == "crash":
        scenario.crash(rng.choice(live), restart_after=rng.uniform(3.0, 12.0))
        return
    if kind == "skew":
        i = rng.choice(live)
        bound = sim.lease_settings.safety_margin / sim.lease_settings.ttl
        rate = rng.uniform(1 - 0.8 * bound, 1 + bound)
        history.fault(f"skew n{i}'s lease clock to {rate:.3f}x for {lasting:.1f}s")
        sim.skew(i, rate)
        sim.nursery.start_soon(_unskew_later, sim, i, lasting)
        return
    if kind == "pause":
        i = rng.choice(live)
        history.fault(f"pause n{i} for {lasting:.1f}s")
        await sim.pause(i, lasting, among=nodes)
        return
    if kind in ("flaky", "slow"):
        i = rng.choice(live)
        if kind == "flaky":
            drop = rng.uniform(0.05, 0.3)
            conditions = attrs.evolve(sim.links, drop=drop)
            history.fault(f"flaky n{i} (drop {drop:.2f}) for {lasting:.1f}s")
        else:
            delay = rng.uniform(0.05, 0.5)
            conditions = attrs.evolve(sim.links, delay_min=delay / 2, delay_max=delay)
            history.fault(f"slow n{i} (up to {delay * 1000:.0f} ms) for {lasting:.1f}s")
        sim.set_links(i, conditions, among=nodes)
        await trio.sleep(lasting)
        sim.set_links(i, sim.links, among=nodes)
        return
    losing: list[int] = []
    if kind == "partition":
        minority = sorted(rng.sample(live, rng.randint(1, len(nodes) // 2)))
        sim.partition(minority, [i for i in nodes if i not in minority])
        history.fault(f"partition {minority} for {lasting:.1f}s")
        losing = minority
    elif kind == "seed-partition":
        lasting = rng.uniform(8.0, 40.0)
        minority = _seed_minority(scenario, live)
        sim.partition(minority, [i for i in nodes if i not in minority])
        seeds = [i for i in scenario.seeds if i in minority]
        history.fault(f"seed-partition {minority} (seeds {seeds}) for {lasting:.1f}s")
        losing = minority
    elif kind == "isolate":
        i = rng.choice(live)
        sim.partition(i, [j for j in nodes if j != i])
        history.fault(f"isolate n{i} for {lasting:.1f}s")
        losing = [i]
    elif kind == "bridge":
        a, b, c = rng.sample(live, 3)
        sim.partition(a, c)
        history.fault(f"bridge n{a}-n{b}-n{c} (n{a} and n{c} cut) for {lasting:.1f}s")
    else:  # one-way
        i = rng.choice(live)
        sim.partition(i, [j for j in nodes if j != i], one_way=True)
        history.fault(f"one-way: n{i} cannot reach the others for {lasting:.1f}s")
    seeds = [i for i in losing if i in scenario.seeds and i in live]
    if scenario.settings.seed_restarts and seeds and rng.random() < scenario.settings.seed_restarts:
        i = rng.choice(seeds)
        crash_at = rng.uniform(0.5, 0.8 * lasting)
        reconnect = 0.0
        if rng.random() < 0.5 and lasting - crash_at > 1.5:
            restart_at, when = rng.uniform(crash_at + 1.0, lasting - 0.5), "while cut off"
        else:
            restart_at, when = max(crash_at + 0.5, lasting + rng.uniform(-1.5, 1.5)), "at the heal"
            reconnect = rng.uniform(1.0, 8.0)
        scenario.restart_seed(
            i, crash_at=crash_at, restart_at=restart_at, when=when, reconnect=reconnect
        )
    await trio.sleep(lasting)
    sim.heal()


def _seed_minority(scenario: Scenario, live: list[int]) -> list[int]:
    """A minority of running nodes that holds the running seed nodes.

    As many seed nodes as fit in a minority (the first one always), topped up with other running
    nodes to a random size.
    """
    rng, most = scenario.rng, scenario.settings.nodes // 2
    seeds = [i for i in scenario.seeds if i in live]
    if len(seeds) > most:
        seeds = [seeds[0], *rng.sample(seeds[1:], most - 1)]
    others = [i for i in live if i not in seeds]
    size = rng.randint(max(1, len(seeds)), most)
    return sorted(seeds + rng.sample(others, min(len(others), size - len(seeds))))


async def _links_back(sim: SimCluster, i: int, nodes: list[int], delay: float) -> None:
    await trio.sleep(delay)
    sim.set_links(i, sim.links, among=nodes)


async def _unskew_later(sim: SimCluster, i: int, delay: float) -> None:
    await trio.sleep(delay)
    sim.skew(i, 1.0)


async def _double_activation(sim: SimCluster, at: float) -> None:
    """Test-only fault: start a live entity's shard on a second node too, past its lease."""
    await trio.sleep(at)
    open_ = sim.history.open_incarnations()
    if not open_:
        sim.history.fault("test fault: no live entity to activate twice")
        return
    node, key = open_[0]
    entity = key.split("/", 1)[1]
    other = next(i for i in sim.live if node_name(i) != node)
    sim.history.fault(f"test fault: {key} activated on n{other} too")
    region = sim.nodes[other].sharding.region(COUNTER)
    shard_id = region._extractor.shard_id(entity)  # type: ignore[arg-type]
    region._start_shard(shard_id)
    shard = region._running[shard_id]
    shard.take_pending()  # skip the lease: deliver at once
    shard.deliver(entity, Read(), None)  # type: ignore[arg-type]


async def _check_cluster(
    sim: SimCluster, nodes: list[int], settings: ChaosSettings, fakes: dict[str, Address]
) -> list[Violation]:
    """(iv), (vi), (viii), (ix): after the quiet period, the live nodes agree.

    They agree on members and shard homes, form one cluster, answer, converge, and nothing an
    intruder announced stuck.
    """
    missing = [i for i in nodes if i not in sim.nodes]
    found: list[Violation] = []
    if missing:
        found.append(
            Violation(AGREEMENT, f"{[node_name(i) for i in missing]} not running after the quiet")
        )
    live = sim.live
    members = {
        node_name(i): frozenset(
            (m.node.name, m.status.value)
            for m in sim.nodes[i].cluster.members
            if m.status is not MemberStatus.REMOVED
        )
        for i in live
    }
    running = {sim.nodes[i].cluster.self_member.node for i in live}
    homes = {
        node_name(i): {
            str(shard): home.name if home in running else str(home)
            for shard, home in sim.regions[i].shard_homes().items()
        }
        for i in live
        if i in sim.regions
    }
    found += check_agreement_views(members, homes, [node_name(i) for i in live])

    def label(node: UniqueAddress) -> str:
        return node.name if node in running else f"{node.name} (incarnation {node.uid:x}, gone)"

    found += check_one_cluster(
        {
            node_name(i): [
                label(m.node) for m in sim.nodes[i].cluster.members if m.status is MemberStatus.UP
            ]
            for i in live
        },
        [node_name(i) for i in live],
    )
    found += check_no_fakes(
        {node_name(i): [m.node.name for m in sim.nodes[i].cluster.members] for i in live},
        {
            node_name(i): [str(p.address) for p in sim.nodes[i].transport_statistics().peers]
            for i in live
        },
        {name: str(address) for name, address in fakes.items()},
    )
    keys = sorted({key for i in live for key in sim.nodes[i].replicator.keys()})  # noqa: SIM118
    found += check_convergence_digests(
        {node_name(i): {key: sim.nodes[i].replicator.digest(key) for key in keys} for i in live}
    )
    found += await _every_shard_answers(sim, live, settings)
    return found


async def _every_shard_answers(
    sim: SimCluster, live: list[int], settings: ChaosSettings, bound: float = 10.0
) -> list[Violation]:
    extractor = HashExtractor(settings.shards)
    probes: dict[str, str] = {}
    n = 0
    while len(probes) < settings.shards:
        entity = f"probe-{n}"
        probes.setdefault(extractor.shard_id(entity), entity)  # type: ignore[arg-type]
        n += 1
    found: list[Violation] = []

    async def ask(i: int, shard: str, entity: str) -> None:
        try:
            await sim.regions[i].entity_ref(entity).ask(Read(), timeout=bound)
        except Exception as exc:  # any failure is the violation being looked for
            found.append(
                Violation(
                    AGREEMENT,
                    f"shard {shard} did not answer {node_name(i)} within {bound:g} s: {exc!r}",
                )
            )

    async with trio.open_nursery() as nursery:
        for i in live:
            if i not in sim.regions:
                continue
            for shard, entity in sorted(probes.items()):
                nursery.start_soon(ask, i, shard, entity)
    return sorted(found, key=str)


def summarize(reports: Sequence[ChaosReport]) -> str:
    """A table of many seeds: faults by kind, incarnations, messages, violations by invariant."""
    lines = [f"{'seeds run':<28}{len(reports):>10}"]
    kinds: dict[str, int] = {}
    for report in reports:
        for fault in report.faults:
            word = fault.split(" ", 2)[1].rstrip(":")
            if word == "rollout":
                continue  # the steps are counted below, not as faults
            kind = "exit (downed)" if "exited" in fault else word
            kinds[kind] = kinds.get(kind, 0) + 1
    lines.append(f"{'faults injected':<28}{sum(kinds.values()):>10}")
    lines += [f"  {kind:<26}{count:>10}" for kind, count in sorted(kinds.items())]
    rollouts = [r.rollout for r in reports if r.rollout is not None]
    if rollouts:
        steps = [step for rollout in rollouts for step in rollout.steps]
        took = [step.up for step in steps if step.up is not None]
        lines.append(f"{'rolling upgrades':<28}{len(rollouts):>10}")
        lines.append(f"  {'node steps':<26}{len(steps):>10}")
        if took:
            lines.append(f"  {'step seconds, mean':<26}{sum(took) / len(took):>10.1f}")
            lines.append(f"  {'step seconds, longest':<26}{max(took):>10.1f}")
    lines.append(f"{'entity incarnations':<28}{sum(r.incarnations for r in reports):>10}")
    lines.append(f"{'messages sent':<28}{sum(r.sent for r in reports):>10}")
    lines.append(f"{'messages acknowledged':<28}{sum(r.acknowledged for r in reports):>10}")
    by_invariant = dict.fromkeys(INVARIANTS, 0)
    for report in reports:
        for violation in report.violations:
            by_invariant[violation.invariant] = by_invariant.get(violation.invariant, 0) + 1
    lines.append(f"{'violations':<28}{sum(by_invariant.values()):>10}")
    lines += [f"  {name:<26}{count:>10}" for name, count in by_invariant.items()]
    failing = [r for r in reports if not r.ok]
    lines.append(f"{'failing seeds':<28}{len(failing):>10}")
    if failing:
        first = failing[0]
        lines.append(f"first failing seed {first.seed}: {first.violations[0]}")
        lines.append(f"replay: {first.replay_command()}")
    return "\n".join(lines)
