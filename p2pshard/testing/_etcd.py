"""A real single-member etcd for tests, on 127.0.0.1 with free ports and a temporary data dir.

``async with start_etcd(tmp_path) as etcd:`` (or ``with running_etcd(tmp_path) as etcd:`` in a
synchronous fixture) starts the ``etcd`` binary found on PATH or at /usr/bin/etcd, waits until its
``/health`` says true, and at the end stops it by its PID (SIGTERM, then SIGKILL after
``STOP_TIMEOUT``) and removes its data directory. Its log stays in ``tmp_path`` for a failed test
to show. ``scripts/test.sh`` installs Debian's etcd-server when the binary is missing.

Raft runs with a 10 ms heartbeat and a 100 ms election timeout, so the member leads within a
fraction of a second; that also makes etcd's smallest lease TTL 1 s (it is 1.5 election timeouts,
rounded up to whole seconds; 2 s with the default settings).
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import attrs
import httpx
import trio

from ._ports import free_port
from ._server_process import ServerProcess

START_TIMEOUT = 15.0
"""Seconds etcd may take to answer ``/health`` after it was started."""

STOP_TIMEOUT = 5.0
"""Seconds etcd may take to exit after SIGTERM before it is killed."""

START_ATTEMPTS = 3
"""Starts tried with fresh ports when etcd exits at once (a port taken since it was picked)."""

_GO_ARCH = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "armv7l": "arm",
    "armv6l": "arm",
    "i386": "386",
    "i686": "386",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
    "mips64": "mips64",
    "mips64el": "mips64le",
    "loongarch64": "loong64",
}
_SUPPORTED_ARCH = {"amd64", "ppc64le"}
"""Where etcd 3.4 runs without ETCD_UNSUPPORTED_ARCH=<go arch> (it exits at once elsewhere)."""


class EtcdNotInstalled(RuntimeError):
    """The etcd binary is neither on PATH nor at /usr/bin/etcd."""


def find_etcd() -> str:
    """The path of the etcd binary.

    Raises:
        EtcdNotInstalled: it is missing; ``scripts/test.sh`` installs it.
    """
    found = shutil.which("etcd")
    if found is not None:
        return found
    if os.access("/usr/bin/etcd", os.X_OK):
        return "/usr/bin/etcd"
    raise EtcdNotInstalled(
        "etcd is not installed (not on PATH, not /usr/bin/etcd): run scripts/test.sh, which "
        "installs Debian's etcd-server, or run 'apt-get install etcd-server' as root"
    )


def _environment() -> dict[str, str]:
    # ETCD_* variables are flags to etcd: the caller's must not change the test server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    arch = _GO_ARCH.get(platform.machine().lower(), platform.machine().lower())
    if arch not in _SUPPORTED_ARCH:
        env["ETCD_UNSUPPORTED_ARCH"] = arch
    return env


@attrs.define(eq=False)
class EtcdServer(ServerProcess):
    """A running etcd process: its client URL, PID, data directory and log file."""

    url: str
    """The client URL, ``http://127.0.0.1:<port>``."""
    pid: int
    data_dir: Path
    log: Path
    _process: subprocess.Popen[bytes]

    def pause(self) -> None:
        """SIGSTOP: etcd's sockets stay open, but nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop etcd (SIGTERM, SIGKILL after ``STOP_TIMEOUT``) and remove its data directory.

        Blocks until the process has exited; calling it again does nothing more.
        """
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            # A paused process would only see SIGTERM once continued.
            os.kill(self.pid, signal.SIGCONT)
            try:
                self._process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _launch(tmp_path: Path) -> EtcdServer:
    """Start an etcd process (not yet ready) with fresh ports under ``tmp_path``."""
    binary = find_etcd()
    client, peer = free_port(), free_port()
    while peer == client:
        peer = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix="etcd-data-", dir=tmp_path))
    log = tmp_path / f"etcd-{client}.log"
    client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    command = [
        binary,
        "--name=test",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=test={peer_url}",
        "--initial-cluster-state=new",
        "--heartbeat-interval=10",
        "--election-timeout=100",
        "--logger=zap",
        "--log-outputs=stderr",
        "--log-level=warn",
    ]
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            env=_environment(),
            start_new_session=True,  # a ^C in the terminal is for pytest, not for etcd
        )
    return EtcdServer(client_url, process.pid, data_dir, log, process)


def _healthy(response: httpx.Response) -> bool:
    try:
        return response.status_code == 200 and response.json().get("health") == "true"
    except ValueError:
        return False


def _not_ready(server: EtcdServer) -> RuntimeError:
    return RuntimeError(
        f"etcd {server.url} (pid {server.pid}) did not become healthy within "
        f"{START_TIMEOUT:g} s; its log {server.log}:\n{server.log_tail()}"
    )


def _exited(server: EtcdServer) -> RuntimeError:
    return RuntimeError(
        f"etcd exited at once, {START_ATTEMPTS} times; its last log {server.log}:\n"
        f"{server.log_tail()}"
    )


async def _became_healthy(client: httpx.AsyncClient, server: EtcdServer) -> bool:
    """True once ``/health`` says so, False if etcd exits first."""
    with trio.move_on_after(START_TIMEOUT):
        while not server.exited():
            try:
                if _healthy(await client.get(server.url + "/health")):
                    return True
            except httpx.HTTPError:
                pass  # not listening yet
            await trio.sleep(0.02)
        return False
    raise _not_ready(server)


def _became_healthy_sync(client: httpx.Client, server: EtcdServer) -> bool:
    deadline = time.monotonic() + START_TIMEOUT
    while not server.exited():
        if time.monotonic() > deadline:
            raise _not_ready(server)
        try:
            if _healthy(client.get(server.url + "/health")):
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return False


@asynccontextmanager
async def start_etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    """A running etcd, stopped at the end (even when the test is cancelled).

    Raises:
        EtcdNotInstalled: the binary is missing.
        RuntimeError: etcd did not become healthy; the message has the end of its log.
    """
    started: list[EtcdServer] = []
    try:
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
            for _ in range(START_ATTEMPTS):
                started.append(server := _launch(tmp_path))
                if await _became_healthy(client, server):
                    break
            else:
                raise _exited(started[-1])
        yield server
    finally:
        with trio.CancelScope(shield=True):
            for server in started:
                await trio.to_thread.run_sync(server.stop)


@contextmanager
def running_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """:func:`start_etcd` for synchronous code such as a module-scoped pytest fixture.

    Raises:
        EtcdNotInstalled: the binary is missing.
        RuntimeError: etcd did not become healthy; the message has the end of its log.

    Example:
        >>> from p2pshard.testing import running_etcd
        >>> with running_etcd(tmp_path) as etcd:  # doctest: +SKIP
        ...     backend = EtcdLeaseBackend([etcd.url])
    """
    started: list[EtcdServer] = []
    try:
        with httpx.Client(timeout=1.0, trust_env=False) as client:
            for _ in range(START_ATTEMPTS):
                started.append(server := _launch(tmp_path))
                if _became_healthy_sync(client, server):
                    break
            else:
                raise _exited(started[-1])
        yield server
    finally:
        for server in started:
            server.stop()
