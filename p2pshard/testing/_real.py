"""Real-process chaos: node processes on loopback over mutual TLS, killed, stopped, cut off, slowed.

The command::

    p2pshard chaos --real [--nodes 5] [--duration 600] [--quiet 30] [--seed S]
                          [--faults kill,pause,...] [--message-interval 0.1] [--no-lease]
                          [--dir DIR] [--json] [--quick]

(or :func:`run_real_chaos`) runs the chaos suite against the real thing: each node is its own OS
process (``python -m p2pshard.testing._real_node``: ``open_node`` over TCP with mutual TLS on
127.0.0.1, the counter entity type with shard leases, the singleton probe under a lease, the
counter workload), all sharing one SQLite lease file. ``--nodes`` node processes (3 to 16,
default 5) go through ``--duration`` seconds of faults (default 600), then ``--quiet`` seconds
without (default 30). ``--quick`` is 3 nodes, 35 s of shorter faults and 15 s quiet, about 70 s
in all. ``--seed`` fixes the schedule (default: a random seed, printed), ``--faults`` the kinds
drawn from, ``--message-interval`` each workload client's mean pause between messages,
``--dir`` where the certificates, configurations, logs and history files go
(default a temporary directory, removed after a clean run), ``--json`` prints the report as one
JSON object instead of the table. The exit status is 1 when an invariant was broken. The
simulated suite (``p2pshard chaos``) covers many seeds quickly; this one covers what the
simulation cannot: real sockets, real scheduling, real clocks, processes that freeze.

Theory of operation. The orchestrator (this module, one trio program) makes a data directory
with a cluster CA, one certificate and one TOML file per node (every node a seed node), and one
:class:`FaultProxy` per ordered pair of nodes (A, B): node A's configuration says, with
``[transport.dial_via]``, to connect to B through that proxy. A link carries frames one way only
(the peer answers over its own link), so blocking the proxy of (A, B) cuts A → B and nothing
else: blocking both directions is a partition, one direction a one-way partition. A blocked proxy
stops forwarding and holds its connections (as a network that drops packets: the sender sees
nothing, its handshakes time out); when the fault heals it resets them, and the nodes reconnect.
A slow proxy forwards each chunk of the byte stream a fixed delay after it arrived, in order. A
flaky proxy resets a connection, both ends, instead of forwarding a chunk, with a small chance
for each: TCP never loses bytes inside a connection, so what a lossy link does to it is break
it, and the transport must reconnect (the proxy accepts new connections throughout).
Proxies rather than packet filters (nftables rules on per-node loopback addresses): they need no
root, no kernel module and no package, so the run is the same in an unprivileged container, on a
laptop and on CI, and nothing is left to clean up if the run is killed.

A supervisor task per node starts the node process (in a session of its own, so a Ctrl-C at the
terminal reaches only the orchestrator), and starts it again a few seconds after it exits (the
node exits when it is downed, as ``p2pshard node`` does) or is killed. The orchestrator kills
every node process when it ends, on errors and Ctrl-C too; should the orchestrator itself be
killed, Linux kills them (each asks for ``PR_SET_PDEATHSIG``).

The schedule, seeded, injects one fault at a time for ``duration`` seconds (and on until each
kind was injected once, for at most twice that), taking the kinds in turns (every kind once, in a
shuffled order, then again), while at least three nodes and a majority run unpaused:

- ``kill``: SIGKILL to one node process; it is started again 2 to 8 s later;
- ``pause``: SIGSTOP for 1 to 3 s, then SIGCONT (shorter than failure detection);
- ``pause-long``: SIGSTOP for longer than the lease time-to-live, so the process wakes up
  holding shard leases the backend has expired, and may have been downed meanwhile (fencing);
- ``partition``: a random minority cut off from the rest, both ways;
- ``isolate``: one node cut off from every other;
- ``one-way``: one node's links to the others cut, theirs to it kept;
- ``bridge``: A and C cannot reach each other, both reach B;
- ``slow``: every link to and from one node delays each chunk by 50 to 500 ms;
- ``flaky``: every link to and from one node breaks its connection at a chunk with a chance of
  5 to 25 % per chunk; the nodes reconnect, and lose what was on its way.

Then every fault is healed and the cluster is left ``quiet``; then each node process is asked
(SIGUSR1) for its view: the members it sees, its shard homes, its replicas' digests, and whether
one probe entity per shard answers through it. Every node must run and see the same members, all
Up, the same homes, the same digests, and every shard must answer
(:func:`~p2pshard.testing.check_agreement_views`, ``check_convergence_digests``); if not, the
question is asked again every few seconds for up to ``settle`` more seconds, and the report says
how long agreement took. Then every process is killed and the history files are merged
(:func:`merge_histories`) into one :class:`~p2pshard.testing.History` for the same checkers as
the simulation (:func:`~p2pshard.testing.check_history`): single activation, acknowledged kept
exactly once, per-sender order, single singleton.

Times: each process records ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for the whole host);
the report shows them as seconds since the run started. An incarnation whose process was killed
ends at the kill; one whose process exited ends when the orchestrator saw the exit (a little
late, never early). A process stopped by SIGSTOP runs nothing, so while it is stopped its
incarnations are not live; once continued, an incarnation counts as live again only if it
handles a message before it ends (a singleton: answers a ping). An incarnation that wakes up,
finds its lease lost and stops without acting did nothing a second incarnation could conflict
with (that is what leases with fencing are for); one that acts is checked like any other.

A rolling upgrade, ``p2pshard chaos --real --rolling [--nodes 3] [--upgrade N] [--seed S]``
(``RealChaosSettings(rolling=True)``), runs the same node processes without faults: they start
on the previous build of a :class:`~p2pshard.testing._rolling.Rollout` (a source root put first
on ``PYTHONPATH``, and an ``app_version`` in each node's TOML file) and are replaced one at a
time, in an order drawn from the seed, by processes of the next build; then one of them is
rolled back. A step sends SIGTERM (the node leaves gracefully and exits 0; its supervisor then
waits for the rollout instead of restarting it), waits until every other node has removed it,
starts the node's new process on the same address and waits until every node agrees and every
shard answers through every node; the step's times are printed. Besides the history checkers,
the nodes' counters (``stats`` in their views and exit lines) must show no message dropped as
undecodable (a type the receiver does not know), no link closed for a bad frame, each link on
the lower protocol version of its two builds, and with two or more next-build nodes (of the
default rollout), that each received the next build's new message type
(``ROLLING`` violations). Without a rollout given, the builds are this source tree and the
next build :func:`~p2pshard.testing._rolling.make_next_build` makes in the data directory.

Where it differs from the simulation: a run is not replayable (real timing): the seed fixes the
schedule's draws, but which nodes are up to be picked depends on timing; a flaky link loses
connections, not frames, and a slow one delays chunks of a byte stream, not frames (a proxy sees
no frames); a pause is a real SIGSTOP, which freezes the node's timers too (the simulation's
pause only holds messages).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from membership import (
    Address,
    ConfigurationError,
    SplitBrainResolverSettings,
    TransportSettings,
)
from membership.internal import (
    CURRENT_PROTOCOL,
    create_cluster_ca,
    create_node_certificate,
    in_range,
    single_error,
)

from .._config import NodeConfig, TlsFiles
from ..cli._exit import EXIT_DOWNED
from ..leases._lease import LeaseSettings
from ._chaos import DAY, one_or_more_of
from ._checkers import (
    AGREEMENT,
    INVARIANTS,
    Violation,
    check_agreement_views,
    check_convergence_digests,
    check_history,
)
from ._merge import ProcessRun, merge_histories
from ._proxy import FaultProxy
from ._real_node import ANSWER_TIMEOUT
from ._rolling import SOURCE_ROOT, Build, Rollout, default_rollout

REAL_FAULTS = (
    "kill",
    "pause",
    "pause-long",
    "partition",
    "isolate",
    "one-way",
    "bridge",
    "slow",
    "flaky",
)
"""Every fault kind a real-process schedule can draw from."""

QUICK_FAULTS = ("kill", "pause", "pause-long", "isolate", "one-way", "flaky")
"""The kinds of ``--quick`` (with three nodes a partition's minority is one node: ``isolate``).

Not ``slow``, the mildest fault on loopback: a schedule goes on until every kind came once, and
a seventh kind would make the quick run about 10 s longer.
"""

NODE_PROCESS = "node-process"
"""The invariant name of a node process that failed: exited with an error, or never ready."""

ROLLING = "rolling-upgrade"
"""The invariant name of what a rolling upgrade must keep: each step's graceful leave and return,
no message dropped for an unknown type, no link closed for a bad frame, the agreed protocols."""

THIS_BUILD = Build("this", SOURCE_ROOT, "", protocol=CURRENT_PROTOCOL.high)
"""The build of a run without a rollout: this source tree."""

LEAVE_TIMEOUT = 30.0
"""Seconds a node may take from SIGTERM to its exit, leaving gracefully."""

REMOVED_TIMEOUT = 30.0
"""Seconds, after a node's exit, until every other node must have removed it."""

GREETING_TRIES = 5
"""Times the views are asked for again until every next-build node received a greeting."""

CLUSTER = "chaos"
"""The cluster name of real-process runs."""

POLL = 0.1
"""Seconds between the supervisors' looks at their processes."""

READY_TIMEOUT = 60.0
"""Seconds the first start may take until every node sees every node Up."""

FLAKY_MIN, FLAKY_MAX = 0.05, 0.25
"""A flaky link resets its connection instead of forwarding a chunk with a chance in this range
(drawn per fault)."""


@attrs.frozen(kw_only=True)
class RealChaosSettings:
    """What one real-process run does. A bad value raises ConfigurationError."""

    nodes: int = attrs.field(default=5, validator=in_range(3, 16, integer=True))
    """Node processes (3 to 16; default 5)."""
    duration: float = attrs.field(default=600.0, validator=in_range(0, DAY))
    """Seconds of faults (default 600); the last fault may run over by up to ``fault_max``."""
    quiet: float = attrs.field(default=30.0, validator=in_range(0, DAY))
    """Seconds without faults before the final checks (default 30)."""
    settle: float = attrs.field(default=30.0, validator=in_range(0, DAY))
    """Seconds more the final checks may wait for the nodes to agree (default 30)."""
    fault_max: float = attrs.field(default=15.0, validator=in_range(3, DAY))
    """Longest partition, slow or flaky link, or long pause, in seconds (default 15)."""
    max_faults: int = attrs.field(default=1000, validator=in_range(0, 1 << 20, integer=True))
    """At most this many faults (default 1000)."""
    faults: tuple[str, ...] = attrs.field(
        default=REAL_FAULTS, validator=one_or_more_of(REAL_FAULTS)
    )
    """The fault kinds to draw from (default all of ``REAL_FAULTS``)."""
    entities: int = attrs.field(default=20, validator=in_range(1, 1 << 20, integer=True))
    shards: int = attrs.field(default=10, validator=in_range(1, 1 << 16, integer=True))
    clients_per_node: int = attrs.field(default=1, validator=in_range(0, 1000, integer=True))
    message_interval: float = attrs.field(default=0.1, validator=in_range(0.01, 3600))
    """Seconds each workload client waits between messages, on average (default 0.1)."""
    lease_ttl: float = attrs.field(default=5.0, validator=in_range(2, 3600))
    """The shard and singleton leases' time-to-live in seconds (default 5)."""
    stable_after: float = attrs.field(default=5.0, validator=in_range(3, 3600))
    """The split brain resolver's ``stable_after`` (default 5 s; at least 3 s, the spread of
    detections with the default failure detector and gossip that ``NodeConfig`` asks for)."""
    use_lease: bool = True
    """Shard and singleton leases; without them single activation is not guaranteed."""
    rolling: bool = False
    """A rolling upgrade instead of faults (see :class:`~p2pshard.testing._rolling.Rollout`):
    every node is replaced in turn by one of the next build, then one is rolled back."""
    upgrade: int = attrs.field(default=0, validator=in_range(0, 16, integer=True))
    """With ``rolling``: how many nodes are upgraded before one of them is rolled back (default
    0: all)."""

    def __attrs_post_init__(self) -> None:
        if self.upgrade > self.nodes:
            raise ConfigurationError(
                f"RealChaosSettings.upgrade = {self.upgrade} is invalid: there are only "
                f"{self.nodes} nodes to upgrade"
            )

    @classmethod
    def quick(cls) -> RealChaosSettings:
        """``--quick``: three nodes, 35 s of shorter faults of every quick kind, 15 s quiet."""
        return cls(nodes=3, duration=35.0, quiet=15.0, fault_max=8.0, faults=QUICK_FAULTS)

    @classmethod
    def rolling_upgrade(cls) -> RealChaosSettings:
        """``--rolling``: three nodes upgraded one at a time, one rolled back; no faults."""
        return cls(nodes=3, rolling=True)

    @property
    def leases(self) -> LeaseSettings:
        """The lease timing of the node processes (the path is set per run)."""
        ttl = self.lease_ttl
        return LeaseSettings(
            ttl=ttl, renew_interval=ttl / 5, operation_timeout=ttl * 0.4, safety_margin=ttl / 5
        )


@attrs.frozen
class RealChaosReport:
    """What one real-process run did and what the checkers found."""

    seed: int
    settings: RealChaosSettings
    violations: tuple[Violation, ...]
    faults: tuple[str, ...]
    incarnations: int
    sent: int
    acknowledged: int
    processes: int
    """Node processes started (restarts included)."""
    seconds: float
    """Real seconds the whole run took."""
    agreed_after: float | None
    """Seconds after the quiet period until the final views agreed (None: they never did)."""
    data_dir: Path
    pids: tuple[int, ...]
    """Every node process started (all stopped by the time the report exists)."""
    steps: tuple[RollingStep, ...] = ()
    """With ``rolling``, each node step of the rollout, in order."""

    @property
    def ok(self) -> bool:
        """No invariant broken."""
        return not self.violations

    def fault_counts(self) -> dict[str, int]:
        """How many faults of each kind were injected (and ``exit (downed)`` etc.)."""
        return _fault_kinds(self.faults)

    def replay_command(self) -> str:
        """The command that draws the same schedule again (the timing will differ).

        Settings the command has no option for (``fault_max``, ``lease_ttl`` ...) are left out.
        """
        s = self.settings
        if s.rolling:
            parts = [f"p2pshard chaos --real --rolling --seed {self.seed}"]
            if s.nodes != RealChaosSettings.rolling_upgrade().nodes:
                parts.append(f"--nodes {s.nodes}")
            if s.upgrade:
                parts.append(f"--upgrade {s.upgrade}")
            if s.message_interval != RealChaosSettings().message_interval:
                parts.append(f"--message-interval {s.message_interval:g}")
            if not s.use_lease:
                parts.append("--no-lease")
            return " ".join(parts)
        quick = RealChaosSettings.quick()
        base = quick if s.fault_max == quick.fault_max else RealChaosSettings()
        parts = [f"p2pshard chaos --real{' --quick' if base is quick else ''} --seed {self.seed}"]
        if s.nodes != base.nodes:
            parts.append(f"--nodes {s.nodes}")
        if s.duration != base.duration or s.quiet != base.quiet:
            parts.append(f"--duration {s.duration:g} --quiet {s.quiet:g}")
        if s.faults != base.faults:
            parts.append(f"--faults {','.join(s.faults)}")
        if s.message_interval != base.message_interval:
            parts.append(f"--message-interval {s.message_interval:g}")
        if not s.use_lease:
            parts.append("--no-lease")
        return " ".join(parts)


@attrs.frozen
class RollingStep:
    """One node step of a rolling upgrade: its graceful leave, its removal, its return."""

    node: str
    """The node name, e.g. ``node-2``."""
    label: str
    """The process that came back, e.g. ``node-2#2``."""
    from_build: str
    to_build: str
    left: float
    """Seconds from SIGTERM until the process exited."""
    removed: float
    """Seconds from its exit until every other node had removed it."""
    up: float
    """Seconds from then until its new process ran and every node agreed and answered again."""

    @property
    def seconds(self) -> float:
        """The whole step, leave to agreement."""
        return self.left + self.removed + self.up

    def __str__(self) -> str:
        return (
            f"{self.node} {self.from_build} -> {self.to_build}: left {self.left:.1f} s, "
            f"removed {self.removed:.1f} s, up and agreed {self.up:.1f} s; "
            f"{self.seconds:.1f} s in all"
        )


def check_rolling_stats(label: str, build: Build, stats: dict[str, Any]) -> list[Violation]:
    """What one node process's ``stats`` (see ``node_stats``) must show after a rolling upgrade.

    Nothing dropped as undecodable (a message type it does not know: a newer node sent it one
    although their link does not speak the protocol version that added it), no link closed for
    a bad frame or for too many refused messages.

    Example:
        >>> b = Build("previous", SOURCE_ROOT, "1.0.0", protocol=1)
        >>> for v in check_rolling_stats("node-1#1", b, {"dropped_undecodable": 2}):
        ...     print(v.detail)
        node-1#1 (build previous) dropped 2 messages it could not decode (a type it does not know?)
    """
    found = []
    dropped = stats.get("dropped_undecodable", 0)
    if dropped:
        found.append(
            Violation(
                ROLLING,
                f"{label} (build {build.name}) dropped {dropped} messages it could not decode "
                "(a type it does not know?)",
            )
        )
    for key, what in (
        ("links_closed_undecodable", "a frame it could not read"),
        ("links_closed_refused", "too many refused messages"),
    ):
        if stats.get(key, 0):
            found.append(
                Violation(
                    ROLLING,
                    f"{label} (build {build.name}) closed {stats[key]} links for {what}",
                )
            )
    return found


def check_link_protocols(
    stats: dict[str, dict[str, Any]], builds: dict[str, Build]
) -> list[Violation]:
    """Each link's agreed protocol is the lower of its two builds' newest.

    ``stats`` maps node names to their ``stats`` (``protocols``: peer name → version or None),
    ``builds`` node names to the build they run. A link not up (None) is not checked.

    Example:
        >>> old = Build("previous", SOURCE_ROOT, "1.0.0", protocol=1)
        >>> new = Build("next", SOURCE_ROOT, "1.1.0", protocol=2)
        >>> stats = {"node-1": {"protocols": {"node-2": 2}}}
        >>> [v.detail for v in check_link_protocols(stats, {"node-1": new, "node-2": old})]
        ['node-1 (build next) speaks protocol 2 to node-2 (build previous), not 1']
    """
    found = []
    for name, node_stats in sorted(stats.items()):
        for peer, version in sorted(node_stats.get("protocols", {}).items()):
            if version is None or name not in builds or peer not in builds:
                continue
            expected = min(builds[name].protocol, builds[peer].protocol)
            if version != expected:
                found.append(
                    Violation(
                        ROLLING,
                        f"{name} (build {builds[name].name}) speaks protocol {version} to {peer} "
                        f"(build {builds[peer].name}), not {expected}",
                    )
                )
    return found


# --- the run -------------------------------------------------------------------------------------


def node_tls(name: str, ca_dir: Path, node_dir: Path, *, cluster: str) -> TlsFiles:
    """Make node ``name``'s key and certificate in ``node_dir``, signed by the CA in ``ca_dir``."""
    create_node_certificate(name, ca_dir, node_dir, cluster=cluster)
    return TlsFiles(
        ca_file=node_dir / "ca.pem",
        cert_file=node_dir / "node.pem",
        key_file=node_dir / "node-key.pem",
    )


def node_process_command(
    config: Path,
    history: Path,
    *,
    clients: int,
    entities: int,
    shards: int,
    interval: float,
    seed: int,
    use_lease: bool,
    options: Sequence[str] = (),
) -> list[str]:
    """The command line of one node process (``p2pshard.testing._real_node``).

    ``options`` are more of its options, added at the end (``--event-sourced``, ...).

    The process dies with this one (``--parent``): start it from the main thread, since the
    parent-death signal follows the thread that started the child.
    """
    command = [
        sys.executable,
        "-m",
        "p2pshard.testing._real_node",
        "--config",
        str(config),
        "--history",
        str(history),
        "--clients",
        str(clients),
        "--entities",
        str(entities),
        "--shards",
        str(shards),
        "--interval",
        str(interval),
        "--seed",
        str(seed),
        "--parent",
        str(os.getpid()),
    ]
    if not use_lease:
        command.append("--no-lease")
    command.extend(options)
    return command


def node_process_env(root: Path | None = None) -> dict[str, str]:
    """The environment of node processes: this one's, with a p2pshard first on the path.

    ``root`` is the source root of the build to run (default: where this p2pshard is imported
    from). ``PYTHONSAFEPATH`` keeps the working directory off the path, so that a p2pshard
    there cannot shadow the build's.
    """
    if root is None:
        root = Path(__file__).resolve().parents[2]  # where this p2pshard is imported from
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))),
        "PYTHONSAFEPATH": "1",
    }


def _reserve_port(stack: contextlib.ExitStack) -> int:
    """A port free on 127.0.0.1, held (bound) until ``stack`` closes.

    It is taken below the ephemeral range, where the ports of outgoing connections come from:
    a node's port must still be free when the node is started again after a kill.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.Random()
    for _ in range(1000):
        port = chooser.randrange(max(1024, low - 10000), low)
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            probe.close()
            continue
        stack.enter_context(probe)
        return port
    raise OSError(f"no free port on 127.0.0.1 below {low}")


def _fault_kinds(faults: Sequence[str]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for fault in faults:
        words = fault.split(" ", 3)
        if "exited" in fault:
            kind = "exit (downed)" if "downed" in fault else "exit (error)"
        else:
            kind = words[1].rstrip(":")
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@attrs.define(eq=False)
class _Orchestrator:
    seed: int
    settings: RealChaosSettings
    data_dir: Path
    rng: random.Random
    origin: float = attrs.field(factory=time.monotonic)
    addresses: list[Address] = attrs.field(factory=list)
    proxies: dict[tuple[int, int], FaultProxy] = attrs.field(factory=dict)
    """(i, j) → the proxy node i reaches node j through."""
    via: dict[tuple[int, int], Address] = attrs.field(factory=dict)
    """(i, j) → where that proxy listens."""
    configs: dict[tuple[int, str], Path] = attrs.field(factory=dict)
    """(i, build name) → node i's TOML file for that build."""
    runs: list[ProcessRun] = attrs.field(factory=list)
    current: dict[int, ProcessRun] = attrs.field(factory=dict)
    faults: list[str] = attrs.field(factory=list)
    violations: list[Violation] = attrs.field(factory=list)
    stopping: trio.Event = attrs.field(factory=trio.Event)
    rollout: Rollout | None = None
    """The builds of a rolling upgrade (``settings.rolling``)."""
    build_of: dict[int, Build] = attrs.field(factory=dict)
    """i → the build node i's next process runs."""
    run_builds: dict[str, Build] = attrs.field(factory=dict)
    """Process label → the build it ran."""
    uids: dict[str, str] = attrs.field(factory=dict)
    """Process label → its incarnation's uid (hex), once ready."""
    members_seen: dict[str, frozenset[str]] = attrs.field(factory=dict)
    """Process label → the uids in its latest ``members`` line."""
    stats: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Process label → its latest ``stats`` (from a view or its exit line)."""
    last_views: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    """i → the view node i gave to the latest :meth:`ask_views`."""
    leaving: set[str] = attrs.field(factory=set)
    """Labels of the processes told to leave (SIGTERM) by the rollout."""
    restart: dict[int, trio.Event] = attrs.field(factory=dict)
    """i → set by the rollout when node i, having left, is to start again."""
    steps: list[RollingStep] = attrs.field(factory=list)
    disagreements: list[Violation] = attrs.field(factory=list)
    """The first disagreement of each round of the latest :meth:`wait_agreement`, until it
    agreed."""

    def __attrs_post_init__(self) -> None:
        first = THIS_BUILD if self.rollout is None else self.rollout.previous
        for i in self.nodes:
            self.build_of[i] = first
            self.restart[i] = trio.Event()

    @property
    def builds(self) -> tuple[Build, ...]:
        return (THIS_BUILD,) if self.rollout is None else (self.rollout.previous, self.rollout.next)

    @property
    def nodes(self) -> list[int]:
        return list(range(1, self.settings.nodes + 1))

    def now(self) -> float:
        return time.monotonic()

    def progress(self, text: str) -> None:
        """One line of progress, to stderr (stdout is for the report)."""
        print(text, file=sys.stderr, flush=True)

    def fault(self, text: str) -> None:
        line = f"{self.now() - self.origin:.1f} {text}"
        self.faults.append(line)
        self.progress(f"  {line}")

    # -- set-up ---------------------------------------------------------------------------------

    async def start_proxies(self, nursery: trio.Nursery) -> None:
        with contextlib.ExitStack() as held:  # the nodes' ports, so no proxy takes one
            ports = [_reserve_port(held) for _ in self.nodes]
            self.addresses = [Address("127.0.0.1", port) for port in ports]
            for i in self.nodes:
                for j in self.nodes:
                    if i != j:
                        proxy = FaultProxy(f"node-{i}->node-{j}", self.addresses[j - 1])
                        self.proxies[(i, j)] = proxy
                        self.via[(i, j)] = await nursery.start(proxy.serve)

    def write_configs(self) -> None:
        ca_dir = self.data_dir / "ca"
        create_cluster_ca(CLUSTER, ca_dir)
        seeds = tuple(self.addresses)
        leases = attrs.evolve(
            self.settings.leases, backend="sqlite", path=self.data_dir / "leases.db"
        )
        for i, build in ((i, build) for i in self.nodes for build in self.builds):
            name = f"node-{i}"
            node_dir = self.data_dir / name
            if build is not self.builds[0] and (node_dir / "ca.pem").exists():
                tls = TlsFiles(
                    ca_file=node_dir / "ca.pem",
                    cert_file=node_dir / "node.pem",
                    key_file=node_dir / "node-key.pem",
                )
            else:
                tls = node_tls(name, ca_dir, node_dir, cluster=CLUSTER)
            config = NodeConfig(
                cluster_name=CLUSTER,
                node_name=name,
                bind_host="127.0.0.1",
                bind_port=seeds[i - 1].port,
                seed_nodes=seeds,
                tls=tls,
                transport=TransportSettings(
                    dial_via=tuple(
                        (str(seeds[j - 1]), self.via[(i, j)]) for j in self.nodes if j != i
                    ),
                    reconnect_backoff_max=2.0,
                ),
                split_brain_resolver=SplitBrainResolverSettings(
                    stable_after=self.settings.stable_after
                ),
                lease=leases,
                log_level="WARNING",
                shutdown_timeout=5.0,
                app_version=build.app_version,
            )
            path = node_dir / ("node.toml" if build is THIS_BUILD else f"node-{build.name}.toml")
            path.write_text(config.to_toml())
            self.configs[(i, build.name)] = path
            (node_dir / "history").mkdir(exist_ok=True)

    # -- the node processes ---------------------------------------------------------------------

    def spawn(self, i: int) -> ProcessRun:
        name = f"node-{i}"
        count = sum(1 for run in self.runs if run.node == name) + 1
        history = self.data_dir / name / "history" / f"{count}.jsonl"
        s = self.settings
        build = self.build_of[i]
        command = node_process_command(
            self.configs[(i, build.name)],
            history,
            clients=s.clients_per_node,
            entities=s.entities,
            shards=s.shards,
            interval=s.message_interval,
            seed=self.seed,
            use_lease=s.use_lease,
        )
        env = node_process_env(build.root)
        log = (self.data_dir / name / "node.log").open("ab")
        on = "" if build is THIS_BUILD else f" on build {build.name}"
        log.write(f"=== {name}#{count} starts at {self.now() - self.origin:.1f}{on}\n".encode())
        log.flush()
        run = ProcessRun(name, f"{name}#{count}", history, self.now())
        self.run_builds[run.label] = build
        with log:
            # In the main thread, not a worker thread: the child's parent-death signal
            # (--parent) follows the thread that started it.
            run.popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=self.data_dir / name,
            )
        run.pid = run.popen.pid
        self.runs.append(run)
        self.current[i] = run
        return run

    def alive(self, i: int) -> bool:
        run = self.current.get(i)
        return run is not None and run.ended is None

    def send_signal(self, run: ProcessRun, signum: signal.Signals) -> bool:
        """Send ``signum`` to the run's process group, if it has not been reaped yet."""
        if run.popen is None or run.popen.returncode is not None:
            return False
        try:
            os.killpg(run.pid, signum)
        except ProcessLookupError:
            return False
        return True

    async def supervise(self, i: int) -> None:
        """Keep node ``i`` running: start it, wait for it to end, start it again later."""
        while not self.stopping.is_set():
            run = self.spawn(i)
            assert run.popen is not None
            while (status := run.popen.poll()) is None:
                self.read_new(run)
                await trio.sleep(POLL)
            if run.ended is None:
                run.ended = self.now()
            run.exit_status = status
            self.read_new(run)
            if self.stopping.is_set():
                return
            if run.label in self.leaving:  # the rollout's graceful leave
                if status != 0:
                    self.violations.append(
                        Violation(
                            NODE_PROCESS,
                            f"{run.label} (pid {run.pid}) exited with status {status} after "
                            f"SIGTERM, not 0: see {self.data_dir / run.node / 'node.log'}",
                        )
                    )
                await self.restart[i].wait()  # the rollout starts it again, on its next build
                self.restart[i] = trio.Event()
                continue
            if run.killed:
                delay = run.restart_after
            else:
                delay = self.rng.uniform(2.0, 6.0)
                if status == EXIT_DOWNED:
                    self.fault(f"{run.label} exited (downed); restarts in {delay:.1f}s")
                else:
                    self.fault(f"{run.label} exited with status {status}; restarts")
                    self.violations.append(
                        Violation(
                            NODE_PROCESS,
                            f"{run.label} (pid {run.pid}) exited with status {status}: see "
                            f"{self.data_dir / run.node / 'node.log'}",
                        )
                    )
            await trio.sleep(delay)

    def read_new(self, run: ProcessRun) -> None:
        """Read the complete lines appended to the run's history file since the last call."""
        for event in run.new_events():
            kind = event["e"]
            if kind == "ready":
                run.ready = True
                self.uids[run.label] = str(event.get("uid"))
            elif kind == "members":
                self.members_seen[run.label] = frozenset(uid for _, uid, _ in event["members"])
            elif kind in ("view", "answers"):
                run.reports.append(event)
            if isinstance(event.get("stats"), dict):  # in views and exit lines
                self.stats[run.label] = event["stats"]

    def stop_all(self) -> None:
        """SIGKILL every node process still running and reap it (bounded)."""
        self.stopping.set()
        for run in self.runs:
            if run.popen is not None and run.popen.poll() is None:
                self.send_signal(run, signal.SIGKILL)
                if run.ended is None:
                    run.ended = self.now()
        for run in self.runs:
            if run.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.exit_status = run.popen.wait(timeout=10)
                if run.ended is None:
                    run.ended = self.now()
            if run.pauses and run.pauses[-1][1] == float("inf"):
                run.pauses[-1] = (run.pauses[-1][0], run.ended or self.now())

    # -- views ----------------------------------------------------------------------------------

    async def ask_views(self, bound: float) -> tuple[list[Violation], bool]:
        """Signal every node for its view and answers; check them. Returns (violations, all in)."""
        found: list[Violation] = []
        asked: dict[int, tuple[ProcessRun, float]] = {}
        for i in self.nodes:
            run = self.current.get(i)
            if run is None or run.ended is not None or not run.ready:
                found.append(Violation(AGREEMENT, f"node-{i} is not running (or not ready)"))
                continue
            self.read_new(run)
            asked[i] = (run, self.now())
            self.send_signal(run, signal.SIGUSR1)
        views: dict[int, dict[str, Any]] = {}
        answers: dict[int, dict[str, str]] = {}
        deadline = self.now() + bound
        while len(answers) < len(asked) and self.now() < deadline:
            await trio.sleep(0.2)
            for i, (run, since) in asked.items():
                self.read_new(run)
                for event in run.reports:
                    if event["t"] >= since and event["e"] == "view":
                        views[i] = event
                    elif event["t"] >= since and event["e"] == "answers":
                        answers[i] = event["answers"]
        for i, (run, _) in asked.items():
            if i not in answers:
                found.append(Violation(AGREEMENT, f"{run.label} did not report its view in time"))
        self.last_views = views
        members = {
            f"node-{i}": frozenset((name, status) for name, status in view["members"])
            for i, view in views.items()
        }
        homes = {f"node-{i}": dict(view["homes"]) for i, view in views.items()}
        found += check_agreement_views(members, homes, [f"node-{i}" for i in self.nodes])
        digests = {
            f"node-{i}": {
                key: None if value is None else bytes.fromhex(value)
                for key, value in view["digests"].items()
            }
            for i, view in views.items()
        }
        found += check_convergence_digests(digests)
        for i, table in sorted(answers.items()):
            found += [
                Violation(
                    AGREEMENT,
                    f"shard {shard} did not answer node-{i} within {ANSWER_TIMEOUT:g} s: {result}",
                )
                for shard, result in sorted(table.items())
                if result != "ok"
            ]
        return found, len(views) == len(self.nodes)

    async def wait_agreement(self, bound: float) -> tuple[list[Violation], float | None]:
        """Ask for views until they agree or ``bound`` seconds pass; the last violations."""
        started = self.now()
        self.disagreements = []
        while True:
            found, _ = await self.ask_views(ANSWER_TIMEOUT + 5)
            if not found:
                return [], self.now() - started
            self.disagreements.append(found[0])
            if self.now() - started >= bound:
                return found, None
            await trio.sleep(2.0)

    # -- faults ---------------------------------------------------------------------------------

    def live(self) -> list[int]:
        return [i for i in self.nodes if self.alive(i) and not self.paused(i)]

    def paused(self, i: int) -> bool:
        run = self.current.get(i)
        return run is not None and bool(run.pauses) and run.pauses[-1][1] == float("inf")

    def cut(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        for i in sources:
            for j in targets:
                if i != j:
                    self.proxies[(i, j)].block()

    def links(self, i: int) -> list[FaultProxy]:
        """The proxies of every link to and from node ``i``."""
        return [proxy for (a, b), proxy in self.proxies.items() if i in (a, b)]

    def heal(self) -> None:
        for proxy in self.proxies.values():
            proxy.heal()

    async def schedule(self) -> None:
        s, rng = self.settings, self.rng
        start = self.now()
        deadline = start + s.duration
        turn: list[str] = []
        injected = 0
        missing = set(s.faults)  # every kind once, even if that takes longer (up to twice)

        def going_on() -> bool:
            now = self.now()
            more = now < deadline or (missing and now < start + 2 * s.duration)
            return bool(more) and injected < s.max_faults

        while going_on():
            await trio.sleep(rng.uniform(1.0, 3.0))
            live = self.live()
            if len(live) < max(3, len(self.nodes) // 2 + 1):
                continue  # too many down or paused already
            if not turn:
                turn = list(s.faults)
                rng.shuffle(turn)
            kind = turn.pop()
            await self.inject(kind, live)
            missing.discard(kind)
            injected += 1

    async def inject(self, kind: str, live: list[int]) -> None:
        s, rng = self.settings, self.rng
        lasting = rng.uniform(3.0, s.fault_max)
        if kind == "kill":
            i = rng.choice(live)
            run = self.current[i]
            run.killed = True
            run.restart_after = rng.uniform(2.0, 8.0)
            self.send_signal(run, signal.SIGKILL)
            run.ended = self.now()  # nothing of it runs after this
            self.fault(f"kill {run.label} (restarts in {run.restart_after:.1f}s)")
            return
        if kind in ("pause", "pause-long"):
            i = rng.choice(live)
            run = self.current[i]
            ttl = s.lease_ttl
            seconds = (
                rng.uniform(1.0, 3.0)
                if kind == "pause"
                else rng.uniform(ttl + 1.0, max(ttl + 2.0, s.fault_max))
            )
            if not self.send_signal(run, signal.SIGSTOP):
                return
            run.pauses.append((self.now(), float("inf")))
            self.fault(f"{kind} {run.label} for {seconds:.1f}s")
            try:
                await trio.sleep(seconds)
            finally:
                run.pauses[-1] = (run.pauses[-1][0], self.now())
                self.send_signal(run, signal.SIGCONT)
            return
        if kind == "partition":
            minority = sorted(rng.sample(live, rng.randint(1, (len(self.nodes) - 1) // 2)))
            rest = [j for j in self.nodes if j not in minority]
            self.cut(minority, rest)
            self.cut(rest, minority)
            self.fault(f"partition {[f'node-{j}' for j in minority]} for {lasting:.1f}s")
        elif kind == "isolate":
            i = rng.choice(live)
            others = [j for j in self.nodes if j != i]
            self.cut([i], others)
            self.cut(others, [i])
            self.fault(f"isolate node-{i} for {lasting:.1f}s")
        elif kind == "one-way":
            i = rng.choice(live)
            self.cut([i], [j for j in self.nodes if j != i])
            self.fault(f"one-way: node-{i} cannot reach the others for {lasting:.1f}s")
        elif kind == "slow":
            i = rng.choice(live)
            delay = rng.uniform(0.05, 0.5)
            for proxy in self.links(i):
                proxy.slow(delay)
            self.fault(f"slow node-{i} (every chunk {delay * 1000:.0f} ms late) for {lasting:.1f}s")
        elif kind == "flaky":
            i = rng.choice(live)
            chance = rng.uniform(FLAKY_MIN, FLAKY_MAX)
            chunks = random.Random(rng.getrandbits(64))  # the schedule's draws stay apart
            for proxy in self.links(i):
                proxy.flaky(chance, chunks)
            self.fault(f"flaky node-{i} (reset at {chance:.0%} of chunks) for {lasting:.1f}s")
        else:  # bridge
            a, b, c = rng.sample(live, 3)
            self.cut([a], [c])
            self.cut([c], [a])
            self.fault(
                f"bridge node-{a}-node-{b}-node-{c} (node-{a}, node-{c} cut) for {lasting:.1f}s"
            )
        try:
            await trio.sleep(lasting)
        finally:
            self.heal()

    # -- the whole run --------------------------------------------------------------------------

    async def run(self) -> RealChaosReport:
        agreed_after: float | None = None
        try:
            with single_error():
                async with trio.open_nursery() as nursery:
                    await self.start_proxies(nursery)
                    self.write_configs()
                    self.progress(
                        f"seed={self.seed}: {self.settings.nodes} node processes on "
                        f"{', '.join(map(str, self.addresses))}; data in {self.data_dir}"
                    )
                    for i in self.nodes:
                        nursery.start_soon(self.supervise, i)
                    agreed_after = await (self.roll() if self.settings.rolling else self.chaos())
                    self.stop_all()
                    nursery.cancel_scope.cancel()
        finally:
            self.stop_all()
        return self.report(agreed_after)

    async def formed(self) -> bool:
        """Wait for the cluster to form and agree; False (a violation noted) if it did not."""
        found, _ = await self.wait_agreement(READY_TIMEOUT)
        if found:
            self.violations.append(
                Violation(
                    AGREEMENT, f"the cluster did not form within {READY_TIMEOUT:g} s: {found[0]}"
                )
            )
        return not found

    async def chaos(self) -> float | None:
        """Wait for the cluster, inject the faults, heal, be quiet, check the views."""
        if not await self.formed():
            return None
        self.progress(f"cluster up after {self.now() - self.origin:.1f} s; faults:")
        await self.schedule()
        self.heal()
        self.progress(f"faults over; quiet for {self.settings.quiet:g} s")
        await trio.sleep(self.settings.quiet)
        found, agreed_after = await self.wait_agreement(self.settings.settle)
        self.violations += found
        return agreed_after

    # -- a rolling upgrade ----------------------------------------------------------------------

    async def roll(self) -> float | None:
        """Form the cluster on the previous build, replace every node by the next, roll one back.

        Each step checks that every node agrees and every shard answers through every node (the
        coordinator keeps answering); the node order and the node rolled back are drawn from the
        seed. Returns the seconds the last step's agreement took (None: a step failed).
        """
        assert self.rollout is not None
        previous, next_ = self.rollout.previous, self.rollout.next
        if not await self.formed():
            return None
        order = list(self.nodes)
        self.rng.shuffle(order)
        order = order[: self.settings.upgrade or len(order)]
        back = self.rng.choice(order)
        plan = [(i, next_) for i in order] + [(back, previous)]
        self.progress(
            f"cluster up on build {previous.name} after {self.now() - self.origin:.1f} s; "
            f"upgrading {', '.join(f'node-{i}' for i in order)} to build {next_.name}, then "
            f"node-{back} back:"
        )
        agreed: float | None = None
        for k, (i, build) in enumerate(plan, 1):
            agreed = await self.replace(i, build, f"{k}/{len(plan)}")
            if agreed is None:
                return None
            if k == len(order) and next_.greets and len(order) > 1:
                await self.check_greetings()
        return agreed

    async def wait_until(self, done: Callable[[], bool], bound: float) -> bool:
        """Poll ``done`` until it is true (True) or ``bound`` seconds pass (False)."""
        deadline = self.now() + bound
        while not done():
            if self.now() >= deadline:
                return False
            await trio.sleep(POLL)
        return True

    def removed_everywhere(self, i: int, uid: str | None) -> bool:
        """Whether no other running node lists incarnation ``uid`` of node ``i`` any more."""
        return all(
            uid not in self.members_seen.get(self.current[j].label, frozenset())
            for j in self.nodes
            if j != i and self.alive(j)
        )

    async def replace(self, i: int, build: Build, step: str) -> float | None:
        """One step: node ``i`` leaves gracefully and comes back on ``build`` at its address.

        Returns the seconds the cluster took to agree again (None: the step failed, and a
        violation says why).
        """
        run = self.current[i]
        old = self.run_builds[run.label]
        uid = self.uids.get(run.label)
        began = self.now()
        self.leaving.add(run.label)
        self.fault(f"step {step}: {run.label} leaves (SIGTERM), to come back on build {build.name}")
        self.send_signal(run, signal.SIGTERM)
        if not await self.wait_until(lambda: run.ended is not None, LEAVE_TIMEOUT):
            self.violations.append(
                Violation(
                    ROLLING, f"{run.label} did not leave and exit {LEAVE_TIMEOUT:g} s after SIGTERM"
                )
            )
            return None
        exited = self.now()
        if not await self.wait_until(lambda: self.removed_everywhere(i, uid), REMOVED_TIMEOUT):
            self.violations.append(
                Violation(
                    ROLLING,
                    f"{run.label} had left, and the other nodes still listed it "
                    f"{REMOVED_TIMEOUT:g} s after it exited",
                )
            )
            return None
        removed = self.now()
        self.build_of[i] = build
        self.restart[i].set()
        if not await self.wait_until(
            lambda: self.current[i] is not run and self.current[i].ready, READY_TIMEOUT
        ):
            self.violations.append(
                Violation(
                    ROLLING,
                    f"node-{i} on build {build.name} was not ready within {READY_TIMEOUT:g} s",
                )
            )
            return None
        found, agreed = await self.wait_agreement(self.settings.settle)
        if found or agreed is None:
            self.violations += found
            return None
        result = RollingStep(
            f"node-{i}",
            self.current[i].label,
            old.name,
            build.name,
            left=exited - began,
            removed=removed - exited,
            up=self.now() - removed,
        )
        self.steps.append(result)
        self.progress(f"    step {step}: {result}")
        for k, seen in enumerate(self.disagreements, 1):
            self.progress(f"      not yet agreed ({k}): {seen}")
        self.violations += check_link_protocols(
            {f"node-{j}": view.get("stats", {}) for j, view in self.last_views.items()},
            {f"node-{j}": self.build_of[j] for j in self.nodes},
        )
        return agreed

    async def check_greetings(self) -> None:
        """With two or more nodes on the next build: each must have received its new type."""

        def silent() -> list[str]:
            return [
                f"node-{i}"
                for i in self.nodes
                if self.build_of[i].greets
                and not self.last_views.get(i, {}).get("stats", {}).get("greetings")
            ]

        for _ in range(GREETING_TRIES):
            if not silent():
                return
            await trio.sleep(1.0)
            await self.ask_views(ANSWER_TIMEOUT + 5)
        if not silent():
            return
        self.violations.append(
            Violation(
                ROLLING,
                f"{', '.join(silent())} on the next build received no message of the type it added "
                "from the other next-build nodes (the protocol 2 links)",
            )
        )

    def report(self, agreed_after: float | None) -> RealChaosReport:
        """Merge every history file, run the history checkers, and report."""
        merged = merge_histories(self.runs, origin=self.origin)
        history = merged.history
        violations = [*check_history(history), *self.violations]
        if self.settings.rolling:
            for run in self.runs:
                stats = self.stats.get(run.label)
                if stats is None:
                    violations.append(
                        Violation(ROLLING, f"{run.label} reported no counters (no view, no exit)")
                    )
                    continue
                violations += check_rolling_stats(run.label, self.run_builds[run.label], stats)
            # The first next-build process ran beside previous-build ones: its greetings to them
            # must have been held back by the transport (``since=2``), not sent.
            greeters = [run for run in self.runs if self.run_builds[run.label].greets]
            held_back = sum(
                self.stats.get(r.label, {}).get("not_sent_protocol", 0) for r in greeters
            )
            if greeters and not held_back:
                violations.append(
                    Violation(
                        ROLLING,
                        "no next-build node held back a message of the type it added from a "
                        "previous-build peer: the protocol gate was never exercised",
                    )
                )
        if merged.broken_lines:
            violations.append(
                Violation(NODE_PROCESS, f"{merged.broken_lines} history lines did not parse")
            )
        return RealChaosReport(
            self.seed,
            self.settings,
            tuple(violations),
            tuple(self.faults),
            merged.incarnations,
            len(history.messages),
            history.acknowledged_count(),
            len(self.runs),
            self.now() - self.origin,
            agreed_after,
            self.data_dir,
            tuple(run.pid for run in self.runs),
            tuple(self.steps),
        )


def run_real_chaos(
    seed: int,
    settings: RealChaosSettings | None = None,
    *,
    data_dir: Path | None = None,
    rollout: Rollout | None = None,
) -> RealChaosReport:
    """Run one real-process chaos run (see the module docstring) and check every invariant.

    ``data_dir`` (default: a new temporary directory; if given, it must be new or empty) gets
    the certificates, configurations, lease file, each node's log and history files; it is left
    in place for inspection. Every
    node process is killed before this returns, also when it raises (Ctrl-C included).

    With ``settings.rolling``, a rolling upgrade between the builds of ``rollout`` (default:
    this source tree and the next build made from it in ``data_dir/next-build``, see
    :mod:`p2pshard.testing._rolling`) instead of faults.

    Example:
        >>> report = run_real_chaos(1, RealChaosSettings.quick())  # doctest: +SKIP
        >>> print(summarize_real(report))  # doctest: +SKIP

    Raises:
        ConfigurationError: ``data_dir`` is not a new or empty directory; a ``rollout`` without
            ``settings.rolling``; the next build cannot be made
            (:class:`~p2pshard.testing._rolling.PatchDoesNotApply` says how to remake its patch).
    """
    settings = settings or RealChaosSettings()
    if rollout is not None and not settings.rolling:
        raise ConfigurationError("a rollout goes with RealChaosSettings(rolling=True)")
    if data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="p2pshard-chaos-real-"))
    elif data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
        raise ConfigurationError(
            f"{data_dir} is not an empty directory: a run writes its certificates and history "
            "files there; give a new or empty one"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    if settings.rolling and rollout is None:
        rollout = default_rollout(data_dir / "next-build")
    orchestrator = _Orchestrator(
        seed, settings, data_dir.resolve(), random.Random(seed), rollout=rollout
    )
    return trio.run(orchestrator.run)


def summarize_real(report: RealChaosReport) -> str:
    """The simulated suite's summary table (see ``summarize``), for one real-process run."""
    lines = [f"{'nodes':<28}{report.settings.nodes:>10}"]
    kinds = report.fault_counts()
    lines.append(f"{'faults injected':<28}{sum(kinds.values()):>10}")
    lines += [f"  {kind:<26}{count:>10}" for kind, count in sorted(kinds.items())]
    lines.append(f"{'process starts':<28}{report.processes:>10}")
    lines.append(f"{'entity incarnations':<28}{report.incarnations:>10}")
    lines.append(f"{'messages sent':<28}{report.sent:>10}")
    lines.append(f"{'messages acknowledged':<28}{report.acknowledged:>10}")
    if report.steps:
        lines.append(f"{'rollout steps':<28}{len(report.steps):>10}")
        lines += [f"  {step}" for step in report.steps]
    names = (*INVARIANTS, NODE_PROCESS, *((ROLLING,) if report.settings.rolling else ()))
    by_invariant = dict.fromkeys(names, 0)
    for violation in report.violations:
        by_invariant[violation.invariant] = by_invariant.get(violation.invariant, 0) + 1
    lines.append(f"{'violations':<28}{sum(by_invariant.values()):>10}")
    lines += [f"  {name:<26}{count:>10}" for name, count in by_invariant.items()]
    agreed = "never" if report.agreed_after is None else f"{report.agreed_after:.1f} s"
    after = "agreed after the last step" if report.settings.rolling else "agreed after the quiet"
    lines.append(f"{after:<28}{agreed:>10}")
    lines.append(f"{'real seconds':<28}{report.seconds:>10.1f}")
    if report.violations:
        lines.append(f"first violation: {report.violations[0]}")
        lines.append(f"data (logs, histories): {report.data_dir}")
        lines.append(f"same schedule again: {report.replay_command()}")
    return "\n".join(lines)


def remove_data(report: RealChaosReport) -> None:
    """Delete the run's data directory (what the CLI does after a clean run)."""
    shutil.rmtree(report.data_dir, ignore_errors=True)
