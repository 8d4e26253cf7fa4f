"""A private network of Linux network namespaces for real-host tests: one address per node.

Theory of operation: :func:`open_network` builds, for one test, a hub namespace holding a
Linux bridge, and one namespace per node with a veth pair to the bridge and its own IPv4 address
(``10.A.B.100+i`` on a /24). Nothing is created in, or changed about, the namespace the tests run
in (its interfaces, routes and firewall): every ``ip`` command names the namespace it acts in,
and the node namespaces have no route out of their /24, so no packet leaves the bridge. Each
network is apart from every other one, so concurrent tests could even share addresses; the /24
is still drawn from the pytest-xdist worker and a per-process counter so that logs of
concurrent runs do not look alike.

Faults are nftables rules in the node namespaces, which drop packets silently as a cut cable or
a firewall on the way does: the sender's packets leave and are lost, its kernel retransmits with
the usual back-off, its handshakes time out. So the rules sit at the *receiving* end: each node
namespace has one table, ``inet p2pshard``, with a set of source addresses whose packets its
input hook drops. (A drop on the sender's output hook is not silent: the sender's kernel learns
of it at once, ``sendto`` fails with EPERM, and TCP retransmits every half second without
back-off, so links come back far sooner than after a real outage.) "A's packets to B are
dropped" is one element, A's address, in B's set, and:

- :meth:`NetnsNetwork.partition`: every packet between two groups is dropped, both ways;
- :meth:`NetnsNetwork.one_way`: A's packets to B are dropped, B's to A pass (TCP between them
  then fails both ways, since every connection needs packets in both directions, but each side
  sees something different: A's SYNs are lost, B's SYNs arrive and their answers are lost);
- :meth:`NetnsNetwork.bridge`: A and C cannot reach each other, both reach B;
- :meth:`NetnsNetwork.heal`: every set emptied.

TCP in the node namespaces retransmits SYNs with the classic exponential back-off (1, 2, 4 s
...): recent kernels can make the first few retransmissions linear, one second apart
(``net.ipv4.tcp_syn_linear_timeouts``, per namespace); it is set to 0 where it exists, so that
how soon a link comes back after a heal does not depend on the host's kernel.

Namespaces are named ``p2ps-<pid>-<n>-hub`` and ``p2ps-<pid>-<n>-<i>`` (the pid of the process
that made them). The context manager removes them on the way out, after killing anything still
running in them; and before it builds a network it removes namespaces of this prefix whose
creating process is gone (left by a test run that was killed), so a killed run leaves nothing
behind for long. Deleting a namespace deletes its interfaces and nftables table with it.

Needs root, ``ip`` (iproute2) and ``nft`` (nftables); :func:`netns_unavailable` says what is
missing, for a skip reason (``scripts/test.sh`` installs both packages when run as root).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence

import attrs

PREFIX = "p2ps-"
"""Every namespace this module makes has a name starting with this."""

BRIDGE = "br0"
"""The bridge's name, inside the hub namespace."""

NODE_INTERFACE = "eth0"
"""Each node namespace's interface to the bridge."""

TABLE = "p2pshard"
"""The nftables table (family ``inet``) in each node namespace."""

DROP_SET = "drop_from"
"""The set of source addresses whose packets a node namespace drops on arrival."""

COMMAND_TIMEOUT = 30.0
"""Seconds one ``ip`` or ``nft`` command may take."""

PORT = 25520
"""The port every node binds, each on its own namespace's address."""

_CLASSIC_SYN_BACKOFF = (
    "f=/proc/sys/net/ipv4/tcp_syn_linear_timeouts; if [ -e $f ]; then echo 0 > $f; fi"
)
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
_counter = itertools.count()
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(?:probe|\d+-(?:hub|\d+))$")


class NetnsError(Exception):
    """An ``ip`` or ``nft`` command failed while building, changing or removing a network."""


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in _SBIN:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    return None


def netns_unavailable() -> str | None:
    """Why network namespace tests cannot run here, or None when they can.

    They need Linux, root, ``ip`` from iproute2 and ``nft`` from nftables, and a kernel that
    lets this process make namespaces (a container without ``CAP_SYS_ADMIN`` does not). The
    last is tried once per process, with a namespace made and removed at once.

    Example:
        >>> import pytest
        >>> reason = netns_unavailable()
        >>> if reason is not None:  # doctest: +SKIP
        ...     pytest.skip(reason)
    """
    if not sys.platform.startswith("linux"):
        return "network namespaces exist on Linux only"
    if os.geteuid() != 0:
        return "network namespace tests need root (CI runs them as root)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if _tool(tool) is None:
            return (
                f"network namespace tests need {tool!r}: install Debian's {package} "
                "(scripts/test.sh does, as root)"
            )
    return _namespace_refused()


@functools.cache
def _namespace_refused() -> str | None:
    """Why a namespace cannot be made here (tried once per process), or None."""
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", name])
    except NetnsError as exc:
        return f"cannot make a network namespace here: {exc}"
    with contextlib.suppress(NetnsError):
        _run(["ip", "netns", "del", name])
    return None


def _run(command: Sequence[str], *, stdin: str | None = None) -> str:
    """Run ``ip`` or ``nft`` (found in the sbin directories too); its output, or NetnsError."""
    tool = _tool(command[0])
    if tool is None:
        raise NetnsError(f"{command[0]} is not installed")
    try:
        done = subprocess.run(
            [tool, *command[1:]],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(command)} took over {COMMAND_TIMEOUT:g} s") from None
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def namespaces() -> list[str]:
    """The names of every network namespace on this host (as ``ip netns list`` shows them)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    """SIGKILL every process running in ``namespace`` (ours: only our namespaces are passed)."""
    with contextlib.suppress(NetnsError):
        for pid in _run(["ip", "netns", "pids", namespace]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    with contextlib.suppress(NetnsError):
        _run(["ip", "netns", "del", namespace])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Remove the namespaces of this prefix whose creating process is gone; their names.

    A namespace whose creator still runs is left alone, even when that pid now belongs to
    another program: better a namespace too many until the next run than one pulled from
    under a test.
    """
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match is not None and not _alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


def _subnet() -> tuple[int, int]:
    """The second and third octets of this network's 10.A.B.0/24."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    number = int(worker) if worker.isdigit() else 0
    return 100 + number % 100, (os.getpid() + next(_counter)) % 250 + 1


@attrs.define(eq=False)
class NetnsNetwork:
    """Node namespaces on a bridge, with faults by nftables drops (see the module docstring).

    Make one with :func:`open_network`. Nodes are numbered from 1.
    """

    nodes: int
    """How many node namespaces (1 to 250)."""
    name: str
    """The namespaces' common prefix, e.g. ``p2ps-4242-0``."""
    subnet: tuple[int, int]
    """A and B of 10.A.B.0/24."""
    drops: set[tuple[int, int]] = attrs.field(factory=set)
    """(i, j): node i's packets to node j are dropped now."""

    @property
    def hub(self) -> str:
        """The namespace holding the bridge."""
        return f"{self.name}-hub"

    def namespace(self, i: int) -> str:
        """Node ``i``'s namespace."""
        self._check(i)
        return f"{self.name}-{i}"

    def host(self, i: int) -> str:
        """Node ``i``'s IPv4 address."""
        self._check(i)
        a, b = self.subnet
        return f"10.{a}.{b}.{100 + i}"

    def port(self, i: int) -> int:
        """The port node ``i`` listens on: :data:`PORT` (each node has an address of its own)."""
        self._check(i)
        return PORT

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in node ``i``'s namespace."""
        ip = _tool("ip")
        assert ip is not None
        return [ip, "netns", "exec", self.namespace(i)]

    def every(self) -> list[int]:
        """Every node number."""
        return list(range(1, self.nodes + 1))

    def reaches(self, i: int, j: int) -> bool:
        """Whether node ``i``'s packets to node ``j`` pass."""
        return (i, j) not in self.drops

    # -- faults -----------------------------------------------------------------------------

    def drop(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Drop node i's packets to node j for every (i, j) in ``pairs``; i == j is ignored."""
        by_target: dict[int, set[int]] = {}
        for i, j in pairs:
            self._check(i)
            self._check(j)
            if i != j and (i, j) not in self.drops:
                by_target.setdefault(j, set()).add(i)
        for j, sources in sorted(by_target.items()):
            hosts = ", ".join(self.host(i) for i in sorted(sources))
            self._nft(j, f"add element inet {TABLE} {DROP_SET} {{ {hosts} }}\n")
            self.drops.update((i, j) for i in sources)

    def partition(self, *groups: Iterable[int]) -> None:
        """Cut the groups off from each other, both ways; nodes in no group form one more.

        ``partition([1, 2])`` cuts nodes 1 and 2 off from all others; ``partition([1], [2])``
        cuts 1 from 2 and both from the rest.
        """
        sides = [set(group) for group in groups]
        rest = set(self.every()).difference(*sides)
        if rest:
            sides.append(rest)
        self.drop(
            (i, j)
            for a, side in enumerate(sides)
            for b, other in enumerate(sides)
            if a != b
            for i in side
            for j in other
        )

    def one_way(self, sources: Iterable[int], targets: Iterable[int]) -> None:
        """Drop the packets of every node in ``sources`` to every node in ``targets``."""
        targets = list(targets)
        self.drop((i, j) for i in sources for j in targets)

    def bridge(self, a: int, b: int, c: int) -> None:
        """Nodes ``a`` and ``c`` cannot reach each other; both still reach ``b``."""
        self._check(b)
        self.drop([(a, c), (c, a)])

    def heal(self) -> None:
        """Let every packet pass again."""
        for j in sorted({j for _, j in self.drops}):
            self._nft(j, f"flush set inet {TABLE} {DROP_SET}\n")
        self.drops.clear()

    # -- building and removing ------------------------------------------------------------

    def _check(self, i: int) -> None:
        if not 1 <= i <= self.nodes:
            raise ValueError(f"node {i!r} is not in this network: nodes are 1 to {self.nodes}")

    def _nft(self, i: int, script: str) -> None:
        _run(["ip", "netns", "exec", self.namespace(i), "nft", "-f", "-"], stdin=script)

    def _build(self) -> None:
        hub = self.hub
        _run(["ip", "netns", "add", hub])
        _run(["ip", "-n", hub, "link", "set", "lo", "up"])
        _run(["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", BRIDGE, "up"])
        for i in self.every():
            ns, port = self.namespace(i), f"h{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            veth = ["type", "veth", "peer", "name", NODE_INTERFACE, "netns", ns]
            _run(["ip", "-n", hub, "link", "add", port, *veth])
            _run(["ip", "-n", hub, "link", "set", port, "master", BRIDGE, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", NODE_INTERFACE])
            _run(["ip", "-n", ns, "link", "set", NODE_INTERFACE, "up"])
            _run(["ip", "netns", "exec", ns, "sh", "-c", _CLASSIC_SYN_BACKOFF])
            self._nft(
                i,
                f"table inet {TABLE} {{\n"
                f"  set {DROP_SET} {{ type ipv4_addr; }}\n"
                "  chain input {\n"
                "    type filter hook input priority 0; policy accept;\n"
                f"    ip saddr @{DROP_SET} drop\n"
                "  }\n"
                "}\n",
            )

    def close(self) -> None:
        """Remove every namespace of this network (killing what still runs in them)."""
        mine = [ns for ns in namespaces() if ns.startswith(f"{self.name}-")]
        for ns in sorted(mine, key=lambda ns: ns.endswith("-hub")):  # the hub last
            _delete(ns)
        self.drops.clear()

    def leftovers(self) -> list[str]:
        """The namespaces of this network that still exist (none after :meth:`close`)."""
        return [ns for ns in namespaces() if ns.startswith(f"{self.name}-")]


@attrs.define(eq=False)
class LoopbackNetwork(NetnsNetwork):
    """The stand-in where namespaces cannot be made (not root): every node on 127.0.0.1.

    Each node listens on a port of its own (``ports``, below the ephemeral range, so that a
    restarted node finds its port free), and its process runs here, not in a namespace. There
    are no network faults: :meth:`drop` (so :meth:`partition` and the others) raises
    :class:`NetnsError`; killing, stopping and restarting processes works as with namespaces.
    Make one with :func:`loopback_network`.
    """

    ports: tuple[int, ...] = ()

    def host(self, i: int) -> str:
        """127.0.0.1, for every node."""
        self._check(i)
        return "127.0.0.1"

    def port(self, i: int) -> int:
        """Node ``i``'s own port."""
        self._check(i)
        return self.ports[i - 1]

    def exec_prefix(self, i: int) -> list[str]:
        """Nothing: the program runs in this namespace."""
        self._check(i)
        return []

    def drop(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Refused: dropping packets between nodes on one address needs namespaces."""
        raise NetnsError(
            "network faults (partitions, one-way cuts, bridges) need network namespaces, "
            f"which need root; this run has every node on 127.0.0.1 ({netns_unavailable()})"
        )

    def heal(self) -> None:
        """Nothing to heal."""
        self.drops.clear()

    def _build(self) -> None:
        pass

    def close(self) -> None:
        """Nothing to remove."""
        self.drops.clear()

    def leftovers(self) -> list[str]:
        """None: no namespace was made."""
        return []


def loopback_network(nodes: int) -> LoopbackNetwork:
    """A :class:`LoopbackNetwork` of ``nodes`` nodes, each with a port free now.

    Raises:
        ValueError: ``nodes`` is not from 1 to 250.
        OSError: not enough free ports.
    """
    if not 1 <= nodes <= 250:
        raise ValueError(f"a network has 1 to 250 nodes, not {nodes!r}")
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.Random()
    ports: list[int] = []
    with contextlib.ExitStack() as held:  # each held until all are chosen: no port twice
        for _ in range(nodes * 100):
            if len(ports) == nodes:
                break
            port = chooser.randrange(max(1024, low - 10000), low)
            probe = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
    if len(ports) < nodes:
        raise OSError(f"not {nodes} free ports on 127.0.0.1 below {low}")
    name = f"loopback-{os.getpid()}-{next(_counter)}"
    return LoopbackNetwork(nodes, name, (0, 0), ports=tuple(ports))


@contextlib.contextmanager
def open_network(nodes: int) -> Iterator[NetnsNetwork]:
    """Build a network of ``nodes`` node namespaces on a bridge; remove it on the way out.

    Stale namespaces of an earlier, killed run are removed first. Call
    :func:`netns_unavailable` before, to skip where this cannot run.

    Example:
        >>> with open_network(3) as net:  # doctest: +SKIP
        ...     net.partition([1])  # node 1 cut off from 2 and 3
        ...     net.heal()

    Raises:
        ValueError: ``nodes`` is not from 1 to 250.
        NetnsError: an ``ip`` or ``nft`` command failed (what was built is removed).
    """
    if not 1 <= nodes <= 250:
        raise ValueError(f"a network has 1 to 250 nodes, not {nodes!r}")
    remove_stale_namespaces()
    network = NetnsNetwork(nodes, f"{PREFIX}{os.getpid()}-{next(_counter)}", _subnet())
    try:
        network._build()
        yield network
    finally:
        network.close()
