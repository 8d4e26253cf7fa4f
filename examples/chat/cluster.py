"""A local chat cluster: N chat node processes on 127.0.0.1 with generated certificates.

``scripts/run-chat.sh [--nodes N] [--base-port P] [--dir DIR]`` runs this module. It makes a
cluster CA and node certificates with the ``p2pshard certs`` command (once), writes each node's
TOML file (SQLite journal and lease file shared in the data directory, a quick split brain
resolver so a killed node's rooms move within about ten seconds, the management endpoint on
127.0.0.1 at the cluster port + 2000, which the node's ``/cluster`` page reads), starts
``python -m examples.chat.node`` per node, prints the page URLs and waits. Ctrl-C stops every
node (SIGTERM, then SIGKILL after 15 s; a second Ctrl-C kills them at once). The nodes run in a
session of their own, so the terminal's Ctrl-C reaches only this launcher and each node gets
one signal, from it. The tests use :class:`ChatCluster` directly.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import FrameType
from typing import IO, Any

import attrs

from p2pshard.cli import main as p2pshard_command

_ROOT = Path(__file__).resolve().parents[2]


def _toml_str(value: object) -> str:
    return json.dumps(str(value))


@attrs.define(eq=False)
class ChatCluster:
    """A plan and, once started, the processes of a local chat cluster."""

    nodes: int
    data_dir: Path
    base_port: int = 27520
    http_offset: int = 1000
    management_offset: int = 2000
    management_nodes: frozenset[int] | None = None
    """The nodes that serve the management endpoint (None: every node), at their cluster port
    plus ``management_offset``; a node's ``/cluster`` page reads it when it is there."""
    cluster: str = "chat"
    log_level: str = "INFO"
    journal_options: dict[str, int] = attrs.Factory(dict)
    """More keys of each node's ``[journal]`` table, e.g. ``{"group_commit_max_events": 1}``."""
    log_to_files: bool = False
    procs: dict[int, subprocess.Popen[bytes]] = attrs.Factory(dict)
    _logs: list[IO[bytes]] = attrs.Factory(list)

    def port(self, i: int) -> int:
        """Node ``i``'s (1-based) cluster port."""
        return self.base_port + i - 1

    def url(self, i: int) -> str:
        """Node ``i``'s page."""
        return f"http://127.0.0.1:{self.port(i) + self.http_offset}/"

    def has_management(self, i: int) -> bool:
        """Whether node ``i`` serves the management endpoint."""
        return self.management_nodes is None or i in self.management_nodes

    def management_url(self, i: int) -> str:
        """Node ``i``'s management endpoint (when it has one)."""
        return f"http://127.0.0.1:{self.port(i) + self.management_offset}/"

    def ws_url(self, i: int) -> str:
        """Node ``i``'s chat WebSocket."""
        return f"ws://127.0.0.1:{self.port(i) + self.http_offset}/ws"

    def name(self, i: int) -> str:
        """Node ``i``'s name."""
        return f"node-{i}"

    def prepare(self) -> list[Path]:
        """Certificates (once) and configuration files; return the config paths."""
        data = self.data_dir.resolve()
        data.mkdir(parents=True, exist_ok=True)
        ca = data / "ca"
        if not (ca / "ca.pem").exists():
            _certs("init", "--cluster", self.cluster, "--out", str(ca))
        seeds = ", ".join(_toml_str(f"127.0.0.1:{self.port(i)}") for i in range(1, self.nodes + 1))
        paths = []
        for i in range(1, self.nodes + 1):
            node_dir = data / self.name(i)
            if not (node_dir / "node.pem").exists():
                _certs("node", self.name(i), "--ca", str(ca), "--out", str(node_dir))
            path = node_dir / "node.toml"
            path.write_text(
                f"""# a chat node (written by examples/chat/cluster.py)
cluster_name = {_toml_str(self.cluster)}
node_name = {_toml_str(self.name(i))}
bind_host = "127.0.0.1"
bind_port = {self.port(i)}
seed_nodes = [{seeds}]
log_level = {_toml_str(self.log_level)}
shutdown_timeout = 10.0

[tls]
ca_file = {_toml_str(node_dir / "ca.pem")}
cert_file = {_toml_str(node_dir / "node.pem")}
key_file = {_toml_str(node_dir / "node-key.pem")}

[split_brain_resolver]
stable_after = 3.0

[lease]
backend = "sqlite"
path = {_toml_str(data / "leases.db")}
ttl = 6.0
renew_interval = 1.0
operation_timeout = 2.0
safety_margin = 1.0

[journal]
backend = "sqlite"
path = {_toml_str(data / "journal.db")}
"""
                + "".join(f"{key} = {value:d}\n" for key, value in self.journal_options.items())
                + (
                    f"""
[management]
enabled = true
host = "127.0.0.1"
port = {self.port(i) + self.management_offset}
"""
                    if self.has_management(i)
                    else ""
                )
            )
            paths.append(path)
        return paths

    def ports(self) -> list[int]:
        """Every port the cluster listens on: each node's cluster, page and management ports."""
        return [
            p
            for i in range(1, self.nodes + 1)
            for p in (
                self.port(i),
                self.port(i) + self.http_offset,
                self.port(i) + self.management_offset,
            )
        ]

    def check_ports(self) -> None:
        """Fail early, naming the port, if one is taken."""
        for port in self.ports():
            error = _taken(port)
            if error is not None:
                raise SystemExit(
                    f"port {port} is taken ({error.strerror}): pass another --base-port"
                )

    def start(self) -> None:
        """Write the files and start every node."""
        configs = self.prepare()
        self.check_ports()
        for i in range(1, self.nodes + 1):
            self.start_node(i, configs[i - 1])

    def start_node(self, i: int, config: Path | None = None) -> None:
        """Start node ``i`` (again)."""
        config = config or self.data_dir.resolve() / self.name(i) / "node.toml"
        urls = ",".join(self.url(j) for j in range(1, self.nodes + 1))
        out: IO[bytes] | None = None
        if self.log_to_files:
            out = (self.data_dir / f"{self.name(i)}.log").open("ab")
            self._logs.append(out)
        env = dict(os.environ, PYTHONPATH=str(_ROOT))
        self.procs[i] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "examples.chat.node",
                "--config",
                str(config),
                "--http-port",
                str(self.port(i) + self.http_offset),
                "--web-urls",
                urls,
            ],
            cwd=_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # see the module docstring
        )

    def status(self, i: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """Node ``i``'s ``/cluster.json``, or None if it does not answer."""
        try:
            with urllib.request.urlopen(self.url(i) + "cluster.json", timeout=timeout) as r:
                result: dict[str, Any] = json.loads(r.read())
                return result
        except (OSError, ValueError):
            return None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until every running node's page answers and sees every running node Up."""
        deadline = time.monotonic() + timeout
        running = [i for i, p in self.procs.items() if p.poll() is None]
        while time.monotonic() < deadline:
            for i, proc in self.procs.items():
                if i in running and proc.poll() is not None:
                    raise RuntimeError(f"{self.name(i)} exited with status {proc.returncode}")
            answers = [self.status(i) for i in running]
            if all(
                a is not None and sum(m["status"] == "UP" for m in a["members"]) == len(running)
                for a in answers
            ):
                return
            time.sleep(0.3)
        raise TimeoutError(f"the chat cluster was not ready within {timeout:g} s")

    def kill(self, i: int) -> None:
        """Stop node ``i`` with SIGKILL (``kill -9``)."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def stop(self) -> int:
        """SIGTERM to every node still running, a bounded wait, then SIGKILL; 0 if all clean.

        A Ctrl-C (or SIGTERM to the launcher) while waiting kills the rest at once.
        """
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        status = 0
        for i, proc in self.procs.items():
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{self.name(i)} did not stop in time; killing it", flush=True)
                proc.kill()
                code = proc.wait()
            except (KeyboardInterrupt, _Stop):
                print("killing the nodes", flush=True)
                for other in self.procs.values():
                    if other.poll() is None:
                        other.kill()
                code = proc.wait()
                status = 1
            if code not in (0, -signal.SIGTERM, -signal.SIGKILL):
                status = 1
        for log in self._logs:
            log.close()
        return status


def _taken(port: int) -> OSError | None:
    """Why ``port`` on 127.0.0.1 cannot be listened on now (None: it can).

    With ``SO_REUSEADDR``, as the nodes' and web servers' listeners: connections of a cluster
    stopped a moment ago, waiting out TIME-WAIT on the port, do not make it taken.
    """
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc
    return None


def free_base_port(nodes: int, *, tries: int = 50) -> int:
    """A random base port from 30000 at which a cluster of ``nodes`` finds all its ports free."""
    for _ in range(tries):
        plan = ChatCluster(nodes, Path(), random.randrange(30000, 50000))
        if all(_taken(port) is None for port in plan.ports()):
            return plan.base_port
    raise RuntimeError(f"no free ports for a {nodes}-node chat cluster in {tries} tries")


def _certs(*args: str) -> None:
    """``p2pshard certs ARGS``, run in this process (an interpreter per call took seconds)."""
    with contextlib.redirect_stdout(io.StringIO()):
        status = p2pshard_command(["certs", *args])
    if status != 0:
        raise RuntimeError(f"p2pshard certs {' '.join(args)} failed with status {status}")


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def main(argv: list[str] | None = None) -> int:
    """``scripts/run-chat.sh``: start a local chat cluster and wait for Ctrl-C."""
    parser = argparse.ArgumentParser(prog="run-chat.sh", description="a local chat cluster")
    parser.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    parser.add_argument("--base-port", type=int, default=27520, help="node-1's cluster port")
    parser.add_argument("--dir", type=Path, default=Path("chat-data"), help="data directory")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= 32:
        parser.error(f"--nodes {args.nodes} is invalid: must be from 1 to 32")
    cluster = ChatCluster(args.nodes, args.dir, args.base_port, log_level=args.log_level)
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C even when started in the background by a shell, which ignores SIGINT there.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        pids = ", ".join(f"{cluster.name(i)} pid {p.pid}" for i, p in cluster.procs.items())
        print(f"chat cluster starting ({pids}); data in {args.dir}", flush=True)
        cluster.wait_ready()
        print("chat pages (Ctrl-C stops the cluster):", flush=True)
        for i in cluster.procs:
            print(
                f"  {cluster.name(i)}: {cluster.url(i)}   cluster: {cluster.url(i)}cluster"
                f"   management: {cluster.management_url(i)}"
            )
        sys.stdout.flush()
        while any(p.poll() is None for p in cluster.procs.values()):
            time.sleep(0.3)
        print("every node has exited", flush=True)
    except (KeyboardInterrupt, _Stop):
        print("stopping the chat cluster (Ctrl-C again kills the nodes at once)", flush=True)
    finally:
        status = cluster.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status


if __name__ == "__main__":
    sys.exit(main())
