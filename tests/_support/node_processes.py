"""Driving ``p2pshard`` node processes from a test: start them, wait for their logs, stop them."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

PYTHON = [sys.executable, "-m", "p2pshard"]
"""The ``p2pshard`` command, run by this interpreter."""


@contextmanager
def node_processes(
    configs: list[Path], logs: list[Path], env: dict[str, str]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``p2pshard node`` for each config, its stderr in the matching log; on the way out, every
    one still running is woken (SIGCONT), asked to leave (SIGTERM), and killed after 30 s."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        for config, log in zip(configs, logs, strict=True):
            with log.open("w") as out:
                command = [*PYTHON, "node", "--config", str(config)]
                children.append(subprocess.Popen(command, stderr=out, env=env))
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def wait_for_lines(logs: list[Path], text: str, *, limit: float, after: str = "") -> None:
    """Wait until every log contains ``text`` (after the first ``after``)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        contents = [log.read_text() for log in logs]
        if all(text in (c.split(after, 1)[-1] if after else c) for c in contents):
            return
        time.sleep(0.2)
    raise AssertionError(f"not in every log within {limit} s: {text!r}\n" + "\n".join(contents))


def read_until(stream: IO[str], text: str, seen: list[str], *, limit: float = 60) -> None:
    """Read lines of ``stream`` into ``seen`` until one contains ``text``."""
    deadline = time.monotonic() + limit
    for line in stream:
        seen.append(line)
        if text in line:
            return
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"{text!r} never came:\n" + "".join(seen))


def time_wait_port() -> int:
    """A port whose last connection is in TIME-WAIT, listened on as the nodes do (SO_REUSEADDR)."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port: int = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server side closes first: its end waits in TIME-WAIT
            assert client.recv(1) == b""
    # A port check without SO_REUSEADDR finds it taken:
    with socket.socket() as probe, pytest.raises(OSError, match="Address already in use"):
        probe.bind(("127.0.0.1", port))
    return port
