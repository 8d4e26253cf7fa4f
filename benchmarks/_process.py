"""A benchmark's worker process and its command pipe: one JSON object per line each way.

Shared by the benchmarks that drive worker processes (``replicator.py``, ``sharding.py``,
``chat_load.py``): each starts its worker program with :class:`CommandProcess` and adds its own
start-up and stop steps; a worker reads its commands with :class:`Lines`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
"""The project root: the working directory of every worker process."""


class BenchmarkError(Exception):
    """A measurement failed: a node crashed, timed out, or saw wrong data."""


class CommandProcess:
    """A worker process that reads commands on stdin and answers on stdout, logging to a file."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name = name
        self._log = log
        self._buffer = bytearray()
        with log.open("wb") as stderr:
            self.process = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=ROOT,
                start_new_session=True,  # Ctrl-C reaches only us; we stop the nodes
            )

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the process's log, for error messages."""
        try:
            text = self._log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(f"    {line}" for line in text[-lines:]) or "    (empty log)"

    def _fail(self, what: str) -> BenchmarkError:
        return BenchmarkError(f"{self.name}: {what}; its log ends with:\n{self.log_tail()}")

    def send(self, command: dict[str, Any]) -> None:
        """Send one command without waiting for its answer."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(command) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._fail(
                f"exited (code {self.process.poll()}) before {command['cmd']}"
            ) from None

    def receive(self, timeout: float, what: str) -> dict[str, Any]:
        """The next message from the process; raises on an error answer, an exit or the timeout."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while (end := self._buffer.find(b"\n")) < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(f"no answer to {what} within {timeout:g} s")
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.process.wait(2)
                raise self._fail(f"exited (code {self.process.poll()}) during {what}")
            self._buffer += chunk
        message: dict[str, Any] = json.loads(self._buffer[:end])
        del self._buffer[: end + 1]
        if message.get("ok") is False:
            raise self._fail(f"{what} failed: {message.get('error')}")
        return message

    def wait_event(self, event: str, timeout: float) -> dict[str, Any]:
        """Wait for the process's first message, which must be ``{"event": event, ...}``."""
        message = self.receive(timeout, "start-up")
        if message.get("event") != event:
            raise self._fail(f"expected {event}, got {message!r}")
        return message

    def reap(self) -> None:
        """Kill the process if it still runs, wait for it, and close its pipes."""
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class Lines:
    """Lines of a byte stream (a worker's commands); cancellable, unlike a file read in a thread."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def readline(self) -> str | None:
        """The next line without its newline; None at the end of the stream."""
        while (end := self._buffer.find(b"\n")) < 0:
            chunk = await self._stream.receive_some(1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line.decode()
