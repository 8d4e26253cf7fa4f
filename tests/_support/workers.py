"""Node processes driven line by line through stdin and stdout (the ``*_worker.py`` programs).

Each worker prints ``ready`` once its node is Up, then answers one line per command line; its log
goes to a file next to its config. :func:`workers` kills whatever still runs at the end.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from subprocess import PIPE

import attrs
import trio

from benchmarks._process import Lines
from membership import ClusterSettings

REPO = Path(__file__).resolve().parents[2]
"""The project root: the working directory of every worker process."""
DURABLE_WORKER = [sys.executable, "-m", "tests._support.durable_worker"]
"""The replicator worker program (``durable_worker.py``), to which each process gets its config."""
FAST = ClusterSettings(
    gossip_interval=0.2,
    leader_actions_interval=0.2,
    seed_node_timeout=1.0,
    seed_node_retry_interval=0.2,
)
START_LIMIT = 20.0
"""Seconds a node process may take to be Up (imports, TLS, joining)."""
COMMAND_LIMIT = 10.0
"""Seconds one command may take; the worker's own timeouts are 3 s."""


@attrs.define(eq=False)
class Worker:
    """One node process; ``ask`` sends a command and returns the answer line."""

    process: trio.Process
    log: Path
    lines: Lines

    async def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        with trio.fail_after(COMMAND_LIMIT):
            await self.process.stdin.send_all(command.encode() + b"\n")
            line = await self.lines.readline()
        assert line is not None, f"the worker exited:\n{self.log.read_text()}"
        return line

    async def ready(self) -> None:
        with trio.fail_after(START_LIMIT):
            line = await self.lines.readline()
        assert line == "ready", f"{line!r}:\n{self.log.read_text()}"

    async def kill(self) -> None:
        """kill -9: no leave, no flush, no close."""
        self.process.send_signal(signal.SIGKILL)
        await self.close()

    async def close(self) -> None:
        """Kill the process if it still runs, reap it and close the pipes (even if cancelled)."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            await self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    await stream.aclose()

    async def quit(self) -> None:
        """Leave the cluster gracefully and exit."""
        assert await self.ask("quit") == "bye", self.log.read_text()
        with trio.fail_after(COMMAND_LIMIT):
            assert await self.process.wait() == 0, self.log.read_text()
        await self.close()


@attrs.define(eq=False)
class Workers:
    """Starts node processes and remembers them, so that none outlives the test."""

    command: Sequence[str] = tuple(DURABLE_WORKER)
    """The worker program, to which each process gets its config path."""
    started: list[Worker] = attrs.Factory(list)

    async def start(self, *configs: Path) -> list[Worker]:
        """Start one process per config (at once), then wait until each is Up."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("P2PSHARD_")}
        new = []
        for config in configs:
            log = config.parent / f"worker-{len(self.started) + 1}.log"
            with log.open("wb") as stderr:
                process = await trio.lowlevel.open_process(
                    [*self.command, str(config)],
                    stdin=PIPE,
                    stdout=PIPE,
                    stderr=stderr,
                    cwd=REPO,
                    env={**env, "PYTHONUNBUFFERED": "1"},
                )
            assert process.stdout is not None
            worker = Worker(process, log, Lines(process.stdout))
            self.started.append(worker)
            new.append(worker)
        for worker in new:
            await worker.ready()
        return new

    async def kill_all(self) -> None:
        for worker in self.started:
            await worker.close()


@asynccontextmanager
async def workers(command: Sequence[str] = tuple(DURABLE_WORKER)) -> AsyncIterator[Workers]:
    running = Workers(command)
    try:
        yield running
    finally:
        await running.kill_all()


async def all_up(nodes: Sequence[Worker]) -> None:
    """Wait until every node sees every node Up."""
    for node in nodes:
        while await node.ask("members") != str(len(nodes)):  # noqa: ASYNC110 - another process
            await trio.sleep(0.1)
