"""Merging the history files of node processes into one history the checkers read.

Each process writes its events with CLOCK_MONOTONIC times, so the files merge by time. What the
orchestrator saw is added: an incarnation of a killed process ends at the kill, and the time a
process spent stopped (SIGSTOP) counts as live only where the incarnation acted in it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ._history import History, Sent, Span


@attrs.define(eq=False)
class ProcessRun:
    """One node process as the orchestrator saw it: what the merge needs besides its file."""

    node: str
    """The node name, e.g. ``node-2``."""
    label: str
    """This process among the node's: ``node-2#3`` is its third start."""
    history: Path
    started: float
    """CLOCK_MONOTONIC time before the process was started."""
    ended: float | None = None
    """When it was killed (taken right after the kill), or was seen to have exited."""
    killed: bool = False
    """Ended by the schedule's SIGKILL (not by itself, not at the end of the run)."""
    exit_status: int | None = None
    pauses: list[tuple[float, float]] = attrs.field(factory=list)
    """(SIGSTOP, SIGCONT) times: taken after the stop and before the continue."""
    pid: int = 0
    ready: bool = False
    restart_after: float = 0.0
    offset: int = 0
    """How much of the history file the orchestrator has read."""
    reports: list[dict[str, Any]] = attrs.field(factory=list)
    """The ``view`` and ``answers`` lines read so far."""
    popen: subprocess.Popen[bytes] | None = None

    def new_events(self) -> list[dict[str, Any]]:
        """The events of the complete lines appended to the history file since the last call.

        A line the process is still writing waits for the next call; a line that does not
        parse is skipped (:func:`read_events` counts those when the run is merged).
        """
        try:
            with self.history.open("rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and isinstance(event.get("t"), int | float):
                    events.append(event)
        return events


@attrs.frozen
class Merged:
    """The merged record of a run: the History, and counts the History does not keep."""

    history: History
    incarnations: int
    """Entity incarnations started (a History counts pieces split at pauses as more)."""
    broken_lines: int
    """Lines that did not parse (none expected: a line is written whole or not at all)."""


def read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The events of one history file, in order, and how many lines did not parse."""
    events: list[dict[str, Any]] = []
    broken = 0
    with contextlib.suppress(FileNotFoundError), path.open("rb") as file:
        for line in file:
            try:
                event = json.loads(line)
            except ValueError:
                broken += 1
                continue
            if isinstance(event, dict) and isinstance(event.get("t"), int | float):
                events.append(event)
            else:
                broken += 1
    return events, broken


def live_pieces(
    start: float, end: float, pauses: Sequence[tuple[float, float]], acts: Sequence[float]
) -> list[tuple[float, float]]:
    """The parts of an incarnation ``[start, end]`` during which it was live.

    Its process ran nothing while stopped (``pauses``); the part before the first stop is live,
    a part after a stop only if the incarnation acted in it (``acts``: the times it handled a
    message).
    """
    pieces: list[tuple[float, float, bool]] = []
    at, resumed = start, False
    for stopped, continued in sorted(pauses):
        if continued <= at or stopped >= end:
            continue
        if stopped > at:
            pieces.append((at, stopped, resumed))
        at, resumed = max(at, continued), True
    if at < end:
        pieces.append((at, end, resumed))
    return [(a, b) for a, b, r in pieces if not r or any(a <= t <= b for t in acts)]


def merge_histories(runs: Sequence[ProcessRun], *, origin: float = 0.0) -> Merged:
    """Merge the history files of ``runs`` into one History; times become ``t - origin``.

    Every run must have ended (``ended`` set): incarnations and singleton instances still open
    in a file end then. Incarnations are cut at the run's pauses (see :func:`live_pieces`).
    Entity logs are merged in time order.
    """
    history = History()
    incarnations = broken = 0
    logs: list[tuple[float, int, int, str, str, int]] = []
    for index, run in enumerate(runs):
        if run.ended is None:
            raise ValueError(f"{run.label} has not ended: stop every process before merging")
        events, bad = read_events(run.history)
        broken += bad
        open_: dict[tuple[str, str], tuple[float, int | None]] = {}
        spans: list[tuple[str, str, float, float, int | None]] = []
        acts: dict[tuple[str, str], list[float]] = {}
        for line, event in enumerate(events):
            kind, t = event.get("e"), float(event["t"])
            if kind in ("start", "singleton-start"):
                what = "entity" if kind == "start" else "singleton"
                key = (what, str(event.get("key") or event.get("name")))
                if key in open_:  # a second start without a stop: the first ends here
                    first, token = open_.pop(key)
                    spans.append((*key, first, t, token))
                open_[key] = (t, event.get("token"))
                incarnations += what == "entity"
            elif kind in ("stop", "singleton-stop"):
                what = "entity" if kind == "stop" else "singleton"
                key = (what, str(event.get("key") or event.get("name")))
                if key in open_:
                    first, token = open_.pop(key)
                    spans.append((*key, first, t, token))
            elif kind == "log":
                key = ("entity", str(event["key"]))
                acts.setdefault(key, []).append(t)
                logs.append((t, index, line, key[1], str(event["sender"]), int(event["seq"])))
            elif kind == "singleton-act":
                acts.setdefault(("singleton", str(event["name"])), []).append(t)
            elif kind == "sent":
                sender, seq = str(event["sender"]), int(event["seq"])
                history.messages[(sender, seq)] = Sent(sender, str(event["key"]), seq, t - origin)
            elif kind == "ack":
                message = history.messages.get((str(event["sender"]), int(event["seq"])))
                if message is not None:
                    message.acknowledged_at = t - origin
        spans += [(*key, first, run.ended, token) for key, (first, token) in open_.items()]
        for what, name, first, last, token in spans:
            table = history.incarnations if what == "entity" else history.singletons
            for a, b in live_pieces(first, last, run.pauses, acts.get((what, name), ())):
                table.setdefault(name, []).append(
                    Span(run.label, name, a - origin, b - origin, token=token)
                )
    for spans_of_key in (*history.incarnations.values(), *history.singletons.values()):
        spans_of_key.sort(key=lambda span: span.start)
    for _, _, _, entity, sender, seq in sorted(logs):
        history.logged(entity, sender, seq)
    return Merged(history, incarnations, broken)
