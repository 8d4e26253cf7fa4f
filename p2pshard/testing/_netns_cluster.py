"""Node processes on a network of namespaces: the real-host test tier's cluster harness.

:func:`open_netns_cluster` gives a test a :class:`NetnsCluster`: ``settings.nodes`` node
namespaces on a bridge (:mod:`p2pshard.testing._netns`), one TLS certificate and one TOML file
per node (each node binds its own namespace's address, port ``PORT``; the seed nodes are the ones
``settings.seeds`` names, the first of them the first seed), and one SQLite lease file for all
(every process runs on this host), and one SQLite journal with ``settings.event_sourced``. The
test starts node processes, cuts links, kills, stops and restarts processes, and waits for what
it expects; the harness kills every process and removes the namespaces on the way out, also when
the test fails or is cancelled.

A node process is, by default, ``python -m p2pshard.testing._real_node`` (as ``p2pshard chaos
--real`` runs: the node, the counter entity type, the singleton probe and workload clients,
recording a history file), started with ``ip netns exec``; or the real ``p2pshard node`` command
(``program="cli"``), which records nothing but its log and exit status. Every process's stdout
and stderr go to ``<data_dir>/node-<i>/node.log``, each start marked with a ``===`` line; what
the test did (starts, exits, faults) goes to ``<data_dir>/events.log``, with the wall-clock time
the node logs show.

What a test can observe, all on CLOCK_MONOTONIC (shown as seconds since the cluster was opened):

- each process's history (:attr:`NetnsRun.events`), read as it grows: its ``members`` lines
  give :class:`MembersView` timelines (:attr:`NetnsRun.views`), its ``exit`` line why it ended;
- each process's exit status (:attr:`~p2pshard.testing.ProcessRun.exit_status`);
- the merged history after :meth:`NetnsCluster.stop_all`, for the checkers
  (:meth:`NetnsCluster.merged`; :func:`check_single_cluster` for two clusters of one name);
- what ``p2pshard status`` says, run in a node's namespace (:meth:`NetnsCluster.status`).

Waits (:meth:`NetnsCluster.wait_one_cluster`, :meth:`~NetnsCluster.wait_exit`, ...) are bounded
and raise :class:`NetnsTimeout`, which says what every node saw last; :meth:`NetnsCluster.converged`
is the same check as a bool, for tests whose point is whether the cluster comes together.

A supervisor task per process reads its history and notices its exit. A process that ends by
itself (downed, removed, left) is started again after the node's restart delay when one is set
(:meth:`NetnsCluster.restart_on_exit`), as a service manager would; a process the test killed is
started again only when the test says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import attrs
import trio

from membership import (
    Address,
    ClusterSettings,
    ConfigurationError,
    FailureDetectorSettings,
    SplitBrainResolverSettings,
    TransportSettings,
)
from membership.internal import create_cluster_ca, in_range, single_error

from .._config import LOG_LEVELS, NodeConfig
from ..leases._lease import LeaseSettings
from ..persistence._journal import JournalSettings
from ._checkers import Violation
from ._merge import Merged, ProcessRun, merge_histories
from ._netns import PORT as PORT  # where it was first defined; kept importable from here
from ._netns import (
    NetnsError,
    NetnsNetwork,
    loopback_network,
    netns_unavailable,
    open_network,
)
from ._real import node_process_command, node_process_env
from ._real import node_tls as make_node_tls

CLUSTER = "realnet"
"""The cluster name of namespace runs."""

POLL = 0.1
"""Seconds between the supervisors' looks at their processes and history files."""

SINGLE_CLUSTER = "single-cluster"
"""The invariant name of :func:`check_single_cluster`."""

Program = Literal["node", "cli"]
"""What a node process runs: ``node`` the chaos node process with its workload and history,
``cli`` the ``p2pshard node`` command."""


class NetnsTimeout(Exception):
    """A bounded wait of the harness ran out; the message says what every node saw last.

    Not an AssertionError on purpose: a test that expects a defect to show (``xfail`` with
    ``raises=AssertionError``) must not count a scenario that never got going as the defect.
    """


def _check_seeds(instance: NetnsClusterSettings, attribute: Any, value: object) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or len(set(value)) != len(value)
        or not all(isinstance(i, int) and 1 <= i <= instance.nodes for i in value)
    ):
        raise ConfigurationError(
            f"NetnsClusterSettings.seeds = {value!r} is invalid: must be a non-empty tuple of "
            f"distinct node numbers from 1 to {instance.nodes} (the first is the first seed)"
        )


def _check_log_level(instance: object, attribute: Any, value: object) -> None:
    if value not in LOG_LEVELS:
        raise ConfigurationError(
            f"NetnsClusterSettings.log_level = {value!r} is invalid: must be one of "
            f"{', '.join(LOG_LEVELS)}"
        )


def _check_options(instance: object, attribute: Any, value: object) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(option, str) and option for option in value
    ):
        raise ConfigurationError(
            f"NetnsClusterSettings.node_options = {value!r} is invalid: must be a tuple of "
            "non-empty strings, such as ('--probe-interval', '0.5')"
        )


def fast_leases(ttl: float) -> LeaseSettings:
    """Lease timing for ``ttl`` seconds: renew every fifth of it (the path is set per run)."""
    return LeaseSettings(
        ttl=ttl, renew_interval=ttl / 5, operation_timeout=ttl * 0.4, safety_margin=ttl / 5
    )


def quick_membership() -> ClusterSettings:
    """Membership settings for quick scenarios (change one with ``attrs.evolve``).

    Gossip every 0.5 s, island probes every 2 s, and the first seed forms the cluster after 2 s
    without an answer from another seed (default 5 s).
    """
    return ClusterSettings(gossip_interval=0.5, seed_probe_interval=2.0, seed_node_timeout=2.0)


@attrs.frozen(kw_only=True)
class NetnsClusterSettings:
    """What the node processes of one namespace run are and how they are configured.

    The defaults are quicker than production's (a failure is acted on in seconds) where the
    issue a test looks at does not depend on them, so that a scenario takes well under a minute;
    a test that depends on one sets it.
    """

    nodes: int = attrs.field(default=5, validator=in_range(2, 16, integer=True))
    """Node namespaces and processes (2 to 16; default 5)."""
    seeds: tuple[int, ...] = attrs.field(default=(1, 2), validator=_check_seeds)
    """The seed nodes by number, the first seed first (default nodes 1 and 2, as a deployment
    names two or three of its nodes, not all)."""
    use_lease: bool = True
    """Shard and singleton leases (in one SQLite file); without them single activation rests on
    the split brain resolver's timing alone."""
    leases: LeaseSettings = attrs.field(factory=lambda: fast_leases(6.0))
    """Lease timing (default a 6 s time-to-live); the backend and path are set per run."""
    cluster: ClusterSettings = attrs.field(factory=quick_membership)
    """Membership settings (default :func:`quick_membership`)."""
    failure_detector: FailureDetectorSettings = attrs.field(
        factory=lambda: FailureDetectorSettings(
            heartbeat_interval=0.5, acceptable_heartbeat_pause=2.0
        )
    )
    """Failure detection (default: heartbeats every 0.5 s, 2 s of silence tolerated)."""
    split_brain_resolver: SplitBrainResolverSettings = attrs.field(
        factory=lambda: SplitBrainResolverSettings(stable_after=3.0)
    )
    """Downing (default keep-majority after 3 s of stable unreachability)."""
    transport: TransportSettings = attrs.field(
        factory=lambda: TransportSettings(reconnect_backoff_max=2.0)
    )
    """The links (default: reconnect within 2 s at most)."""
    entities: int = attrs.field(default=20, validator=in_range(1, 1 << 20, integer=True))
    shards: int = attrs.field(default=10, validator=in_range(1, 1 << 16, integer=True))
    clients_per_node: int = attrs.field(default=1, validator=in_range(0, 1000, integer=True))
    message_interval: float = attrs.field(default=0.1, validator=in_range(0.01, 3600))
    """Seconds each workload client waits between messages, on average (default 0.1)."""
    event_sourced: bool = False
    """The counters keep their counts as events in one SQLite journal for all (``[journal]``,
    ``--event-sourced``), as the chat example's rooms do; default: in memory."""
    node_options: tuple[str, ...] = attrs.field(default=(), validator=_check_options)
    """More options of every node process (``python -m p2pshard.testing._real_node --help``),
    such as ``("--probe-interval", "0.5")``; default none."""
    log_level: str = attrs.field(default="INFO", validator=_check_log_level)
    """The node processes' log level (default INFO: the logs tell the story of a failure)."""
    shutdown_timeout: float = attrs.field(default=5.0, validator=in_range(0.1, 3600))


@attrs.frozen
class MembersView:
    """What one node process saw of the membership at one time (a ``members`` line)."""

    t: float
    """CLOCK_MONOTONIC time of the line."""
    self_uid: str
    members: frozenset[tuple[str, str, str]]
    """(node name, uid, status) of every member but the removed ones."""
    unreachable: frozenset[str]
    """Uids of the members some member cannot reach."""

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> MembersView:
        """Read a ``members`` line of a history file."""
        return cls(
            float(event["t"]),
            str(event["uid"]),
            frozenset((str(n), str(u), str(s)) for n, u, s in event["members"]),
            frozenset(str(u) for u in event["unreachable"]),
        )

    @property
    def uids(self) -> frozenset[str]:
        """The uids of every member in this view."""
        return frozenset(uid for _, uid, _ in self.members)

    def status_of_self(self) -> str | None:
        """This process's own status in its view (None: not a member yet, or not any more)."""
        return next((s for _, uid, s in self.members if uid == self.self_uid), None)

    def is_member(self) -> bool:
        """Whether this process is in a cluster: Joining to Exiting in its own view."""
        return self.status_of_self() in ("joining", "weakly_up", "up", "leaving", "exiting")

    def up_names(self) -> frozenset[str]:
        """The names of the Up members."""
        return frozenset(name for name, _, status in self.members if status == "up")

    def describe(self) -> str:
        """``node-1 up, node-2 up (unreachable), ...``."""
        return ", ".join(
            f"{name}#{uid[:6]} {status}{' (unreachable)' if uid in self.unreachable else ''}"
            for name, uid, status in sorted(self.members)
        )


@attrs.define(eq=False)
class NetnsRun(ProcessRun):
    """One node process of a namespace run: the merge's record plus what the harness read."""

    index: int = 0
    """The node's number."""
    program: Program = "node"
    events: list[dict[str, Any]] = attrs.field(factory=list)
    """Every history line read so far, in order."""
    views: list[MembersView] = attrs.field(factory=list)
    """Its ``members`` lines, in order."""
    exit_reason: str | None = None
    """The ``why`` of its ``exit`` line, if it wrote one."""
    started_at: float | None = None
    """CLOCK_MONOTONIC time of its ``starting`` line: when it began to open the node."""
    done: trio.Event = attrs.field(factory=trio.Event)
    """Set once the process has exited and was reaped."""

    @property
    def running(self) -> bool:
        """Not ended (it may be stopped by SIGSTOP)."""
        return self.ended is None

    @property
    def view(self) -> MembersView | None:
        """Its latest membership view (None: none recorded yet)."""
        return self.views[-1] if self.views else None

    def read(self) -> None:
        """Take in the lines appended to its history file since the last call."""
        if self.program != "node":
            return
        for event in self.new_events():
            self.events.append(event)
            kind = event["e"]
            if kind == "members":
                self.views.append(MembersView.from_event(event))
            elif kind == "ready":
                self.ready = True
            elif kind == "starting":
                self.started_at = float(event["t"])
            elif kind == "exit":
                self.exit_reason = str(event.get("why"))


@attrs.define(eq=False)
class NetnsCluster:
    """Node processes in the namespaces of one network; see the module docstring."""

    settings: NetnsClusterSettings
    network: NetnsNetwork
    data_dir: Path
    seed: int
    """Seeds the workload clients (and anything a test draws from :attr:`rng`)."""
    rng: random.Random
    origin: float = attrs.field(factory=time.monotonic)
    configs: dict[int, Path] = attrs.field(factory=dict)
    runs: list[NetnsRun] = attrs.field(factory=list)
    """Every process started, in start order."""
    current: dict[int, NetnsRun] = attrs.field(factory=dict)
    """Node number → its latest process."""
    faults: list[str] = attrs.field(factory=list)
    """What the test did, one line each, with the time since the cluster was opened."""
    restart_delays: dict[int, float] = attrs.field(factory=dict)
    """Node number → seconds after its process ended by itself before it is started again."""
    _nursery: trio.Nursery | None = None
    _stopping: bool = False

    # -- names, addresses, files -------------------------------------------------------------

    @property
    def nodes(self) -> list[int]:
        """Every node number, 1 to ``settings.nodes``."""
        return list(range(1, self.settings.nodes + 1))

    @staticmethod
    def name(i: int) -> str:
        """Node ``i``'s name: ``node-<i>``."""
        return f"node-{i}"

    def address(self, i: int) -> Address:
        """Where node ``i`` listens."""
        return Address(self.network.host(i), self.network.port(i))

    def log(self, i: int) -> Path:
        """Node ``i``'s log file (every process of it, each start marked)."""
        return self.data_dir / self.name(i) / "node.log"

    def log_text(self, i: int) -> str:
        """Node ``i``'s log so far."""
        try:
            return self.log(i).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def now(self) -> float:
        """Seconds since the cluster was opened."""
        return time.monotonic() - self.origin

    def note(self, text: str) -> None:
        """Record one line of what the test did: printed, and in ``<data_dir>/events.log``."""
        line = f"{self.now():6.1f} {text}"
        self.faults.append(line)
        print(line, flush=True)
        with (self.data_dir / "events.log").open("a") as events:
            now = time.time()  # to the millisecond, as the node logs' times are
            wall = f"{time.strftime('%H:%M:%S', time.localtime(now))},{int(now % 1 * 1000):03d}"
            events.write(f"{wall} {line}\n")

    def write_configs(self) -> None:
        """The CA, every node's certificate and TOML file, and the lease file's place."""
        s = self.settings
        ca_dir = self.data_dir / "ca"
        create_cluster_ca(CLUSTER, ca_dir)
        leases = attrs.evolve(s.leases, backend="sqlite", path=self.data_dir / "leases.db")
        seeds = tuple(self.address(i) for i in s.seeds)
        journal = (
            JournalSettings(backend="sqlite", path=self.data_dir / "journal.db")
            if s.event_sourced
            else JournalSettings()
        )
        for i in self.nodes:
            name = self.name(i)
            node_dir = self.data_dir / name
            config = NodeConfig(
                cluster_name=CLUSTER,
                node_name=name,
                bind_host=self.network.host(i),
                bind_port=self.network.port(i),
                seed_nodes=seeds,
                tls=make_node_tls(name, ca_dir, node_dir, cluster=CLUSTER),
                transport=s.transport,
                cluster=s.cluster,
                failure_detector=s.failure_detector,
                split_brain_resolver=s.split_brain_resolver,
                lease=leases,
                journal=journal,
                log_level=s.log_level,
                shutdown_timeout=s.shutdown_timeout,
            )
            path = node_dir / "node.toml"
            path.write_text(config.to_toml())
            self.configs[i] = path
            (node_dir / "history").mkdir(exist_ok=True)

    # -- processes ---------------------------------------------------------------------------

    def start(self, i: int, *, program: Program = "node") -> NetnsRun:
        """Start a process of node ``i`` in its namespace (it must not be running).

        Raises:
            RuntimeError: node ``i`` runs already, or the cluster is closing.
        """
        if self._nursery is None or self._stopping:
            raise RuntimeError("the cluster is not open")
        if i in self.current and self.current[i].running:
            raise RuntimeError(f"{self.name(i)} runs already ({self.current[i].label})")
        name = self.name(i)
        count = sum(1 for run in self.runs if run.node == name) + 1
        history = self.data_dir / name / "history" / f"{count}.jsonl"
        s = self.settings
        if program == "node":
            command = node_process_command(
                self.configs[i],
                history,
                clients=s.clients_per_node,
                entities=s.entities,
                shards=s.shards,
                interval=s.message_interval,
                seed=self.seed,
                use_lease=s.use_lease,
                options=(*(("--event-sourced",) if s.event_sourced else ()), *s.node_options),
            )
        else:
            command = [sys.executable, "-m", "p2pshard", "node", "--config", str(self.configs[i])]
        run = NetnsRun(name, f"{name}#{count}", history, time.monotonic(), index=i, program=program)
        with self.log(i).open("ab") as log:
            log.write(f"=== {run.label} ({program}) starts at {self.now():.1f}\n".encode())
            log.flush()
            # From the main thread: the child's parent-death signal follows the thread that
            # started it (``ip netns exec`` execs the program, so the child is the program).
            run.popen = subprocess.Popen(
                [*self.network.exec_prefix(i), *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=node_process_env(),
            )
        run.pid = run.popen.pid
        self.runs.append(run)
        self.current[i] = run
        self.note(f"start {run.label} (pid {run.pid}, {program})")
        self._nursery.start_soon(self._supervise, run)
        return run

    def start_all(self, nodes: Iterable[int] | None = None) -> None:
        """Start node processes (default: every node), the seed nodes first."""
        wanted = list(self.nodes if nodes is None else nodes)
        seeds = [i for i in self.settings.seeds if i in wanted]
        for i in seeds + [i for i in wanted if i not in seeds]:
            self.start(i)

    def restart_on_exit(self, nodes: Iterable[int], delay: float | None) -> None:
        """Start ``nodes`` again ``delay`` seconds after their process ends by itself.

        ``None`` turns it off. A process the test kills is not restarted by this.
        """
        for i in nodes:
            if delay is None:
                self.restart_delays.pop(i, None)
            else:
                self.restart_delays[i] = delay

    def _signal(self, run: NetnsRun, signum: signal.Signals) -> bool:
        if run.popen is None or run.popen.returncode is not None:
            return False
        try:
            os.killpg(run.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def _running(self, i: int) -> NetnsRun:
        run = self.current.get(i)
        if run is None or not run.running:
            raise RuntimeError(f"{self.name(i)} is not running")
        return run

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``'s process (kill -9); it is not restarted by itself."""
        run = self._running(i)
        run.killed = True
        self._signal(run, signal.SIGKILL)
        run.ended = time.monotonic()  # nothing of it runs after this
        self.note(f"kill -9 {run.label}")

    def pause(self, i: int) -> None:
        """SIGSTOP node ``i``'s process."""
        run = self._running(i)
        if self._signal(run, signal.SIGSTOP):
            run.pauses.append((time.monotonic(), float("inf")))
            self.note(f"SIGSTOP {run.label}")

    def resume(self, i: int) -> None:
        """SIGCONT node ``i``'s process (stopped by :meth:`pause`)."""
        run = self._running(i)
        if run.pauses and run.pauses[-1][1] == float("inf"):
            run.pauses[-1] = (run.pauses[-1][0], time.monotonic())
        self._signal(run, signal.SIGCONT)
        self.note(f"SIGCONT {run.label}")

    def terminate(self, i: int) -> None:
        """SIGTERM node ``i``'s process: it leaves the cluster gracefully and exits."""
        run = self._running(i)
        self._signal(run, signal.SIGTERM)
        self.note(f"SIGTERM {run.label}")

    async def restart(self, i: int, *, program: Program | None = None) -> NetnsRun:
        """Kill node ``i``'s process if it runs (kill -9), then start it again."""
        run = self.current.get(i)
        if run is not None and run.running:
            self.kill(i)
        if run is not None:
            await run.done.wait()
        return self.start(i, program=program or (run.program if run else "node"))

    async def _supervise(self, run: NetnsRun) -> None:
        assert run.popen is not None
        try:
            while (status := run.popen.poll()) is None:
                run.read()
                await trio.sleep(POLL)
        finally:
            if run.popen.poll() is None:  # cancelled: the cluster is closing
                self._signal(run, signal.SIGKILL)
        run.exit_status = status
        if run.ended is None:
            run.ended = time.monotonic()
        run.read()
        if run.pauses and run.pauses[-1][1] == float("inf"):
            run.pauses[-1] = (run.pauses[-1][0], run.ended)
        run.done.set()
        if run.killed or self._stopping:
            return
        why = f" ({run.exit_reason})" if run.exit_reason else ""
        delay = self.restart_delays.get(run.index)
        self.note(
            f"{run.label} exited with status {status}{why}"
            + ("" if delay is None else f"; restarts in {delay:g} s")
        )
        if delay is not None:
            await trio.sleep(delay)
            if not self._stopping and self.current.get(run.index) is run:
                self.start(run.index, program=run.program)

    def stop_all(self) -> None:
        """SIGKILL every process still running and reap it (bounded); no more restarts."""
        self._stopping = True
        for run in self.runs:
            if run.popen is not None and run.popen.poll() is None:
                self._signal(run, signal.SIGCONT)  # a stopped process is killed all the same
                self._signal(run, signal.SIGKILL)
                if run.ended is None:
                    run.ended = time.monotonic()
        for run in self.runs:
            if run.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.exit_status = run.popen.wait(timeout=10)
            if run.ended is None:
                run.ended = time.monotonic()
            if run.pauses and run.pauses[-1][1] == float("inf"):
                run.pauses[-1] = (run.pauses[-1][0], run.ended)
            run.read()

    # -- faults (the network's, noted) -------------------------------------------------------

    def partition(self, *groups: Iterable[int]) -> None:
        """Cut the groups (and the nodes in none, as one more group) off from each other."""
        sides = [sorted(group) for group in groups]
        self.network.partition(*sides)
        self.note(f"partition {' | '.join(map(str, sides))} (and the rest)")

    def one_way(self, sources: Iterable[int], targets: Iterable[int]) -> None:
        """Drop the packets of ``sources`` to ``targets`` (not the other way)."""
        sources, targets = sorted(sources), sorted(targets)
        self.network.one_way(sources, targets)
        self.note(f"one-way: {sources} cannot reach {targets}")

    def bridge(self, a: int, b: int, c: int) -> None:
        """Nodes ``a`` and ``c`` cannot reach each other; both reach ``b``."""
        self.network.bridge(a, b, c)
        self.note(f"bridge: {a} and {c} cut, both reach {b}")

    def heal(self) -> None:
        """Every packet passes again."""
        self.network.heal()
        self.note("heal")

    # -- observing ---------------------------------------------------------------------------

    def starts(self, i: int) -> int:
        """How many processes of node ``i`` were started."""
        return sum(1 for run in self.runs if run.index == i)

    def view(self, i: int) -> MembersView | None:
        """The latest membership view of node ``i``'s current process."""
        run = self.current.get(i)
        return None if run is None else run.view

    def one_cluster(self, nodes: Iterable[int]) -> bool:
        """Whether ``nodes`` all run and form one cluster with nobody else in it.

        Every one of them with a history (``program="node"``) must be ready and see exactly
        these nodes, all Up and reachable, with the same incarnations as the others see.
        """
        wanted = sorted(nodes)
        names = frozenset(self.name(i) for i in wanted)
        seen: set[frozenset[tuple[str, str, str]]] = set()
        for i in wanted:
            run = self.current.get(i)
            if run is None or not run.running:
                return False
            if run.program != "node":
                continue
            view = run.view
            if (
                not run.ready
                or view is None
                or view.up_names() != names
                or len(view.members) != len(names)
                or view.unreachable
            ):
                return False
            seen.add(view.members)
        return len(seen) <= 1

    def describe(self) -> str:
        """What every node's current process is doing and saw last (for failure messages)."""
        lines = []
        for i in self.nodes:
            run = self.current.get(i)
            if run is None:
                lines.append(f"  {self.name(i)}: never started")
                continue
            state = "running" if run.running else f"exited with {run.exit_status}"
            if run.exit_reason:
                state += f" ({run.exit_reason})"
            view = run.view
            seen = "no view" if view is None else f"sees {view.describe()}"
            lines.append(f"  {run.label}: {state}; {seen}")
        return "\n".join(lines)

    async def wait_until(self, condition: Callable[[], bool], what: str, within: float) -> float:
        """Wait until ``condition()`` holds; how long that took.

        Raises:
            NetnsTimeout: it did not hold within ``within`` seconds.
        """
        started = time.monotonic()
        with trio.move_on_after(within):
            while not condition():  # noqa: ASYNC110 - polls processes and their files
                await trio.sleep(POLL)
            return time.monotonic() - started
        raise NetnsTimeout(
            f"not within {within:g} s: {what}; data in {self.data_dir}\n{self.describe()}"
        )

    async def holds_within(self, condition: Callable[[], bool], within: float) -> bool:
        """Whether ``condition()`` comes to hold within ``within`` seconds (polled)."""
        try:
            await self.wait_until(condition, "", within)
        except NetnsTimeout:
            return False
        return True

    async def converged(self, nodes: Iterable[int], within: float) -> bool:
        """Whether ``nodes`` come to form one cluster (:meth:`one_cluster`) within ``within`` s."""
        wanted = list(nodes)
        return await self.holds_within(lambda: self.one_cluster(wanted), within)

    async def wait_one_cluster(
        self, nodes: Iterable[int] | None = None, *, within: float = 60.0
    ) -> float:
        """Wait until ``nodes`` (default all) form one cluster, all Up; how long it took.

        Raises:
            NetnsTimeout: they did not within ``within`` seconds.
        """
        wanted = sorted(self.nodes if nodes is None else nodes)
        return await self.wait_until(
            lambda: self.one_cluster(wanted),
            f"nodes {wanted} form one cluster, all Up",
            within,
        )

    async def wait_exit(self, i: int, *, within: float) -> int | None:
        """Wait until node ``i``'s current process has exited; its exit status.

        Raises:
            NetnsTimeout: it still runs after ``within`` seconds.
        """
        run = self.current[i]
        await self.wait_until(lambda: run.done.is_set(), f"{run.label} exits", within)
        return run.exit_status

    async def wait_started(self, i: int, *, within: float) -> float:
        """Wait until node ``i``'s current process began to join; the time it did.

        The time is on CLOCK_MONOTONIC: the ``starting`` line, written right before the
        process opens its node.

        Raises:
            NetnsTimeout: it did not within ``within`` seconds.
        """
        run = self.current[i]
        await self.wait_until(lambda: run.started_at is not None, f"{run.label} starts", within)
        assert run.started_at is not None
        return run.started_at

    async def wait_hosting(self, i: int, *, within: float) -> set[str]:
        """Wait until node ``i``'s current process runs entities; the keys of those it runs.

        A node that joined last gets shards by rebalancing, a few a round, so this may take a
        few rounds.

        Raises:
            NetnsTimeout: it ran none within ``within`` seconds.
        """
        run = self.current[i]
        await self.wait_until(
            lambda: bool(self.incarnations_of(run)), f"{run.label} runs entities", within
        )
        return self.incarnations_of(run)

    async def status(self, i: int, *, via: int, wait: float = 5.0) -> dict[str, Any] | None:
        """``p2pshard status --json`` for node ``i``, run in node ``via``'s namespace.

        None when it did not answer within ``wait`` seconds (the command's exit status was not
        0).
        """
        command = [
            *self.network.exec_prefix(via),
            sys.executable,
            "-m",
            "p2pshard",
            "status",
            "--json",
            "--node",
            str(self.address(i)),
            "--config",
            str(self.configs[via]),
            "--timeout",
            str(wait),
        ]
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False, env=node_process_env()
        )
        if done.returncode != 0:
            return None
        reply: dict[str, Any] = json.loads(done.stdout)
        return reply

    def merged(self) -> Merged:
        """Every process's history merged (call after :meth:`stop_all`): times since the start."""
        return merge_histories(
            [run for run in self.runs if run.program == "node"], origin=self.origin
        )

    def incarnations_of(self, run: NetnsRun) -> set[str]:
        """The entity keys whose incarnation was open in ``run`` at its end (or now)."""
        open_: set[str] = set()
        for event in run.events:
            if event["e"] == "start":
                open_.add(str(event["key"]))
            elif event["e"] == "stop":
                open_.discard(str(event["key"]))
        return open_

    def starts_after(self, key: str, t: float, not_on: str) -> list[tuple[str, float]]:
        """(process, time) of every start of entity ``key`` after ``t`` on another node."""
        return [
            (run.label, float(event["t"]))
            for run in self.runs
            if run.node != not_on
            for event in run.events
            if event["e"] == "start" and event["key"] == key and float(event["t"]) > t
        ]


def check_single_cluster(runs: Sequence[NetnsRun], *, origin: float = 0.0) -> list[Violation]:
    """Never two clusters of one name: no two processes members of disjoint memberships at once.

    Each process's ``members`` views are a timeline from each line to the next (the last one
    holds until the process ended). Two processes that are both members (Joining to Exiting in
    their own view) at the same time, whose views share no member incarnation at all, are in
    two different clusters: neither knows anyone the other knows. One violation per pair, with
    the first such interval. (A process that has not been welcomed yet, or was downed and
    removed, is not a member, so joining and leaving do not count.)
    """
    timelines: list[tuple[NetnsRun, list[tuple[float, float, MembersView]]]] = []
    for run in runs:
        end = run.ended if run.ended is not None else time.monotonic()
        pieces = []
        for k, view in enumerate(run.views):
            until = run.views[k + 1].t if k + 1 < len(run.views) else end
            if view.is_member() and until > view.t:
                pieces.append((view.t, until, view))
        timelines.append((run, pieces))
    found = []
    for a in range(len(timelines)):
        for b in range(a + 1, len(timelines)):
            run_a, pieces_a = timelines[a]
            run_b, pieces_b = timelines[b]
            for start_a, end_a, view_a in pieces_a:
                hit = next(
                    (
                        (max(start_a, start_b), min(end_a, end_b), view_b)
                        for start_b, end_b, view_b in pieces_b
                        if max(start_a, start_b) < min(end_a, end_b)
                        and not view_a.uids & view_b.uids
                    ),
                    None,
                )
                if hit is not None:
                    start, end, view_b = hit
                    found.append(
                        Violation(
                            SINGLE_CLUSTER,
                            f"{run_a.label} (in a cluster of {view_a.describe()}) and "
                            f"{run_b.label} (in a cluster of {view_b.describe()}) were in two "
                            f"clusters of one name at {start - origin:.1f}-{end - origin:.1f} s",
                        )
                    )
                    break
    return found


def _new_cluster(
    settings: NetnsClusterSettings, network: NetnsNetwork, data_dir: Path, seed: int
) -> NetnsCluster:
    data_dir.mkdir(parents=True, exist_ok=True)
    cluster = NetnsCluster(settings, network, data_dir.resolve(), seed, random.Random(seed))
    cluster.write_configs()
    return cluster


@asynccontextmanager
async def open_netns_cluster(
    settings: NetnsClusterSettings,
    data_dir: Path,
    *,
    seed: int | None = None,
    loopback: bool = False,
) -> AsyncIterator[NetnsCluster]:
    """A network of ``settings.nodes`` namespaces with configurations; no process started yet.

    ``data_dir`` (a new or empty directory) gets the certificates, configurations, lease file,
    logs and histories, and is left in place. ``seed`` (default: a random one, printed) seeds
    the workload clients. On the way out every process is killed and the namespaces are
    removed, whatever happened.

    Example:
        >>> async def test_five(tmp_path: Path) -> None:  # doctest: +SKIP
        ...     async with open_netns_cluster(NetnsClusterSettings(), tmp_path) as cluster:
        ...         cluster.start_all()
        ...         await cluster.wait_one_cluster(within=60)
        ...         cluster.partition([4, 5])

    With ``loopback``, there are no namespaces (no root needed): every node runs here on
    127.0.0.1 with a port of its own (:class:`~p2pshard.testing._netns.LoopbackNetwork`), and
    network faults raise ``NetnsError``; killing, stopping and restarting processes work.

    Raises:
        NetnsError: this host cannot run it (not root, ``ip`` or ``nft`` missing: see
            :func:`~p2pshard.testing._netns.netns_unavailable`), or building the network failed.
    """
    opened: contextlib.AbstractContextManager[NetnsNetwork]
    if loopback:
        opened = contextlib.nullcontext(loopback_network(settings.nodes))
    else:
        reason = netns_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        opened = open_network(settings.nodes)
    if seed is None:
        seed = random.randrange(1 << 32)
    print(f"seed={seed}", flush=True)
    with opened as network:
        cluster = _new_cluster(settings, network, data_dir, seed)
        hosts = ", ".join(f"{cluster.name(i)} {cluster.address(i)}" for i in cluster.nodes)
        cluster.note(f"network {network.name}: {hosts}; data in {cluster.data_dir}")
        try:
            with single_error():
                async with trio.open_nursery() as nursery:
                    cluster._nursery = nursery
                    yield cluster
                    cluster.stop_all()
                    nursery.cancel_scope.cancel()
        finally:
            cluster.stop_all()
