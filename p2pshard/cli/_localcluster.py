"""``p2pshard local-cluster``: several node processes on one host, for trying things out.

It makes (or reuses) a cluster CA and one certificate and TOML file per node in a data directory,
checks that the ports are free, starts ``p2pshard node --config ...`` once per node as a separate
process, and waits. Ctrl-C (or SIGTERM, SIGHUP, or ``--duration`` running out) stops the nodes:
each gets SIGTERM and its configured shutdown time, then SIGKILL; a second Ctrl-C kills them at
once. The nodes run in a session of their own, so a Ctrl-C in the terminal reaches the launcher
only and each node gets one signal, from it (a node still importing its modules then ends
quietly instead of printing a KeyboardInterrupt traceback). A node that dies on its own is
reported; the others keep running, as a cluster would.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import attrs

from membership import Address, ConfigurationError
from membership.internal import (
    CA_CERT,
    check_name,
    create_cluster_ca,
    create_node_certificate,
    load_cluster_ca,
)

from .._config import LOG_LEVELS, NodeConfig, TlsFiles

_POLL = 0.2


class _Stop(Exception):
    """SIGTERM arrived at the launcher."""


@attrs.frozen(kw_only=True)
class LocalCluster:
    """A plan for a local cluster: how many nodes, where, and under which names."""

    nodes: int
    data_dir: Path
    cluster: str = "local"
    host: str = "127.0.0.1"
    base_port: int = 25520
    log_level: str = "INFO"

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ConfigurationError(f"--nodes {self.nodes} is invalid: must be from 1 to 64")
        if not 1 <= self.base_port <= 65535 - self.nodes + 1:
            raise ConfigurationError(
                f"--base-port {self.base_port} is invalid: ports {self.base_port} to "
                f"{self.base_port + self.nodes - 1} must lie within 1..65535"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigurationError(
                f"--log-level {self.log_level!r} is invalid: must be one of {', '.join(LOG_LEVELS)}"
            )
        check_name("cluster name", self.cluster)

    def addresses(self) -> list[Address]:
        """node-1's address first: the seed nodes, in order."""
        return [Address(self.host, self.base_port + i) for i in range(self.nodes)]

    def prepare(self) -> list[Path]:
        """Write certificates (once) and configuration files; return the config paths."""
        data = self.data_dir.resolve()
        ca_dir = data / "ca"
        if (ca_dir / CA_CERT).exists():
            _, _, existing = load_cluster_ca(ca_dir)
            if existing != self.cluster:
                raise ConfigurationError(
                    f"{ca_dir} holds a CA for cluster {existing!r}, not {self.cluster!r}: use "
                    "another --dir or remove it"
                )
        else:
            create_cluster_ca(self.cluster, ca_dir)
        seeds = tuple(self.addresses())
        paths = []
        for i, address in enumerate(seeds, start=1):
            name = f"node-{i}"
            node_dir = data / name
            if not (node_dir / "node.pem").exists():
                create_node_certificate(name, ca_dir, node_dir, cluster=self.cluster, force=True)
            config = NodeConfig(
                cluster_name=self.cluster,
                node_name=name,
                bind_host=address.host,
                bind_port=address.port,
                seed_nodes=seeds,
                tls=TlsFiles(
                    ca_file=node_dir / "ca.pem",
                    cert_file=node_dir / "node.pem",
                    key_file=node_dir / "node-key.pem",
                ),
                log_level=self.log_level,
            )
            path = node_dir / "node.toml"
            path.write_text(config.to_toml())
            paths.append(path)
        return paths

    def check_ports(self) -> None:
        """Fail early, naming the port, if one is taken.

        The probe sets ``SO_REUSEADDR``, as the nodes' listeners do: connections of a cluster
        stopped a moment ago, waiting out TIME-WAIT on these ports, do not count as taken.
        """
        for address in self.addresses():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((address.host, address.port))
                except OSError as exc:
                    raise ConfigurationError(
                        f"cannot use {address} for a node ({exc.strerror}): pass another "
                        "--base-port or stop what is listening there"
                    ) from None

    def run(self, *, duration: float | None = None) -> int:
        """Start the nodes and wait for Ctrl-C, SIGTERM or ``duration``; return exit status."""
        configs = self.prepare()
        self.check_ports()
        children: dict[str, subprocess.Popen[bytes]] = {}
        # SIGINT too, rather than Python's KeyboardInterrupt: a launcher started with SIGINT
        # ignored (from a background job of a script) gets no KeyboardInterrupt at all.
        stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, _raise_stop) for s in stops}
        try:
            for path in configs:
                name = path.parent.name
                children[name] = subprocess.Popen(
                    [sys.executable, "-m", "p2pshard", "node", "--config", str(path)],
                    start_new_session=True,  # see the module docstring
                )
            listing = ", ".join(
                f"{n} {a} (pid {c.pid})"
                for (n, c), a in zip(children.items(), self.addresses(), strict=True)
            )
            print(
                f"local cluster {self.cluster!r}: {listing}; data in {self.data_dir}; "
                + (f"stops after {duration:g} s" if duration else "Ctrl-C stops it"),
                flush=True,
            )
            deadline = None if duration is None else time.monotonic() + duration
            reported: set[str] = set()
            while deadline is None or time.monotonic() < deadline:
                for name, child in children.items():
                    code = child.poll()
                    if code is not None and name not in reported:
                        reported.add(name)
                        print(f"{name} exited with status {code}", flush=True)
                if len(reported) == len(children):
                    return 1
                time.sleep(_POLL)
        except (KeyboardInterrupt, _Stop):
            print("stopping the cluster (Ctrl-C again kills the nodes at once)", flush=True)
        finally:
            status = _stop_all(children)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return status


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _stop_all(children: dict[str, subprocess.Popen[bytes]]) -> int:
    """SIGTERM to every node still running, then a bounded wait, then SIGKILL.

    A Ctrl-C (or SIGTERM) while waiting kills the nodes still running at once.
    """
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    status = 0
    for name, child in children.items():
        try:
            code = child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{name} did not stop in time; killing it", flush=True)
            child.kill()
            code = child.wait()
        except (KeyboardInterrupt, _Stop):
            print("killing the nodes", flush=True)
            for other in children.values():
                if other.poll() is None:
                    other.kill()
            code = child.wait()
            status = 1
        if code not in (0, -signal.SIGTERM):
            status = 1
    return status
