"""A load process of ``benchmarks/chat_load.py``: many chat WebSocket users in one process.

``benchmarks/chat_load.py`` starts several of these as ``python -m benchmarks._chat_load_worker
--index I --lifetime S`` from the project root, sends one JSON command per line on stdin and
reads one JSON answer per line from stdout; logs go to stderr. The process ends when stdin
closes, on ``{"cmd": "stop"}``, or after ``--lifetime`` seconds.

Commands:

- ``connect`` (``group``, ``users``: ``[user, room, url]`` triples, ``at_once``, ``within``
  seconds): a group of connections (one per server measured, all kept open together): open one
  WebSocket per user (``benchmarks/_websocket.py``: wsproto's protocol, the worker's own
  I/O), join its room (again after a second when the server answers "try again", as the chat
  page does); answered once every user
  has its ``joined`` frame. From then on the engine thread reads every connection.
- ``run`` (``group``, ``tag``, ``rate``, ``start_at``, ``duration``, ``offset``, ``seed``):
  open-loop posts from the users of ``group``. Post ``k`` is due at ``start_at + (k + offset) /
  rate`` (``time.monotonic()``, the one clock of every process of the host), sent by a user
  drawn from the seed, whatever the answers to earlier posts; its text is its send time and its
  id ``<tag>-<index>-<k>``. Answered after the last one, with the posts per room and how late
  the latest went out.
- ``tally`` (``tag``, ``final``): what this process received of the posts of ``tag`` so far:
  ``message`` frames (a delivery: the time from the post's send, its text, to the frame's
  arrival here, in a histogram of 0.1 ms buckets), ``ack`` frames of its own posts (the post is
  in the journal), ``error`` frames. ``final`` adds the histograms and forgets the tag.
- ``disconnect``: close every connection (as ``stop`` does).

Trio runs the commands and the connections' set-up (handshakes and joins, many at once, within
a time limit). Once joined, the connections are served by one plain thread, the engine
(:meth:`LoadClient._engine`): one ``epoll`` wait for every socket and for the next post's due
time, one ``read`` per readable socket, messages taken whole by wsproto and only the needed ones
decoded as JSON, posts
written straight to their sockets. A pass of trio's scheduler per wake-up (a task per
connection, or a task waiting on the epoll descriptor, and a task sleeping until each post)
cost several times the frame's own work when frames come one at a time, so the load process
was as busy as the server it measured. The arrival time of the frames of one wake-up is read
once, right after the wait; after reading, the engine waits a millisecond (``GATHER``) before it
looks again, so that the frames of one post, which come within about that time, are read with
one wake-up: a frame is stamped at most that late, never early.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import resource
import select
import sys
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from benchmarks._process import Lines
from benchmarks._websocket import CLOSE, TEXT, ClientWebSocket, WebSocketProtocolError

logger = logging.getLogger("benchmarks.chat_load_worker")

BUCKETS_PER_S = 10_000
"""Histogram buckets per second of latency: 0.1 ms each."""
RECEIVE = 1 << 16
JOIN_TRIES = 10
"""Joins sent at most per user while the server answers "try again" (the room is slow)."""
JOIN_RETRY_AFTER = 1.0
"""Seconds before a join is sent again, as the chat page waits."""
GATHER = 0.001
"""Seconds the engine waits after reading before it looks for more frames: a frame that came
meanwhile is stamped at most this late (1 % of the 100 ms limit); waking up for each frame
alone cost more than reading it."""
IDLE_POLL = 0.1
"""Seconds the engine waits at most, with no post due, before it looks at its stop flag."""
RUN_MARGIN = 30.0
"""Seconds past a step's window its posts may take to go out before ``run`` fails."""
MEMBERS_FRAME = '{"type": "members"'
"""How the frames this client does not need begin."""


class WorkerError(Exception):
    """A command could not be carried out (the orchestrator reports it and stops)."""


@attrs.define(eq=False)
class Connection:
    """One user's WebSocket (served by :meth:`LoadClient._engine` once joined)."""

    user: str
    room: str
    stream: trio.SocketStream
    ws: ClientWebSocket
    closed: bool = False
    joins: int = 1
    """Joins sent (more than one when the server answered "try again")."""

    @property
    def fd(self) -> int:
        return self.stream.socket.fileno()


@attrs.define(eq=False)
class Tally:
    """What this process saw of one step's posts."""

    posts_by_room: Counter[str] = attrs.Factory(Counter)
    receipts: int = 0
    receipt_hist: Counter[int] = attrs.Factory(Counter)
    acks: int = 0
    ack_hist: Counter[int] = attrs.Factory(Counter)
    errors: int = 0
    error_texts: list[str] = attrs.Factory(list)
    group: str = ""
    """The connections the step posted from."""

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_texts) < 5:
            self.error_texts.append(text)


@attrs.define(eq=False)
class Schedule:
    """One step's posts, sent by the engine thread at their due times."""

    tag: str
    rate: float
    start_at: float
    offset: float
    count: int
    rng: random.Random
    posters: list[Connection]
    tally: Tally = attrs.Factory(Tally)
    k: int = 0
    """The next post."""
    late: float = 0.0
    first: float = 0.0
    last: float = 0.0
    send_errors: int = 0
    done: threading.Event = attrs.Factory(threading.Event)

    def due(self) -> float:
        """When post ``k`` is due."""
        return self.start_at + (self.k + self.offset) / self.rate


def split_ws_url(url: str) -> tuple[str, int, str]:
    """Host, port and path of a ``ws://`` URL."""
    parts = urlsplit(url)
    if parts.scheme != "ws" or parts.hostname is None or parts.port is None:
        raise WorkerError(f"not a ws://HOST:PORT/PATH URL: {url!r}")
    return parts.hostname, parts.port, parts.path or "/"


def tag_of(post_id: object) -> str | None:
    """The step tag of a post id ``<tag>-<index>-<k>`` (None for anything else)."""
    if not isinstance(post_id, str) or "-" not in post_id:
        return None
    return post_id.split("-", 1)[0]


@attrs.define(eq=False)
class LoadClient:
    """This process's connections, in groups (one per server), and what they received."""

    index: int
    groups: dict[str, list[Connection]] = attrs.Factory(dict)
    tallies: dict[str, Tally] = attrs.Factory(dict)
    """Per step tag."""
    pending: dict[str, float] = attrs.Factory(dict)
    """Post id -> send time, until its ack."""
    stray: int = 0
    """Frames of steps already tallied for good (arrived after the drain)."""
    _epoll: select.epoll = attrs.Factory(select.epoll)
    _by_fd: dict[int, Connection] = attrs.Factory(dict)
    _wake: tuple[int, int] = attrs.Factory(os.pipe)
    """Written to make the engine look at a new schedule (or its stop) at once."""
    _engine_thread: tuple[threading.Thread, threading.Event] | None = None
    _schedule: Schedule | None = None
    _failure: str | None = None
    """Why the engine thread stopped by itself, if it did."""

    # -- receiving ------------------------------------------------------------------------------

    def on_frame(self, frame: dict[str, Any], now: float) -> None:
        kind = frame.get("type")
        if kind == "message":
            message = frame["message"]
            tally = self.tallies.get(tag_of(message.get("id")) or "")
            if tally is None:
                self.stray += 1
                return
            tally.receipts += 1
            tally.receipt_hist[int((now - float(message["text"])) * BUCKETS_PER_S)] += 1
        elif kind == "ack":
            sent = self.pending.pop(frame["id"], None)
            tally = self.tallies.get(tag_of(frame["id"]) or "")
            if sent is None or tally is None:
                self.stray += 1
                return
            tally.acks += 1
            tally.ack_hist[int((now - sent) * BUCKETS_PER_S)] += 1
        elif kind == "error":
            tally = self.tallies.get(tag_of(frame.get("id")) or "")
            if tally is None:
                logger.warning("error frame outside a step: %s", frame.get("error"))
                self.stray += 1
                return
            self.pending.pop(frame["id"], None)
            tally.error(str(frame.get("error")))

    def on_bytes(self, conn: Connection, data: bytes, now: float) -> None:
        """Handle what a connection received at ``now``."""
        for kind, payload in conn.ws.feed(data):
            if kind == CLOSE:
                raise trio.BrokenResourceError(f"the server closed the WebSocket: {payload!r}")
            # The members frames (half of all) are not needed: skip decoding them (both servers
            # write "type" first; a frame laid out otherwise is decoded, and ignored below).
            if kind == TEXT and isinstance(payload, str) and not payload.startswith(MEMBERS_FRAME):
                self.on_frame(json.loads(payload), now)
        if pong := conn.ws.outgoing():
            os.write(conn.fd, pong)

    async def _join(self, user: str, room: str, url: str) -> Connection:
        """Connect and join; the connection once its ``joined`` frame has come."""
        host, port, path = split_ws_url(url)
        stream = await trio.open_tcp_stream(host, port)
        try:
            ws = ClientWebSocket(host, port, path)
            await stream.send_all(ws.opening())
            messages: list[tuple[str, str | bytes]] = []
            while not ws.accepted:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    raise WorkerError(f"{url} closed the connection during the handshake")
                messages += ws.feed(chunk)
            conn = Connection(user, room, stream, ws)
            join = ws.text(json.dumps({"type": "join", "room": room, "user": user}))
            await stream.send_all(join)
            joined = False
            tries = 1
            while True:
                for kind, payload in messages:
                    if kind == CLOSE:
                        raise WorkerError(f"{user}: {url} closed the connection at the join")
                    frame = json.loads(payload) if kind == TEXT else {}
                    if frame.get("type") == "joined":
                        joined = True
                    elif frame.get("type") == "error" and not joined:
                        if not frame.get("retry") or tries >= JOIN_TRIES:
                            raise WorkerError(
                                f"{user} could not join {room} ({tries} tries): {frame['error']}"
                            )
                        # As the chat page does: the room is slow or moving, ask again.
                        tries += 1
                        conn.joins = tries
                        await trio.sleep(JOIN_RETRY_AFTER)
                        await stream.send_all(
                            ws.text(json.dumps({"type": "join", "room": room, "user": user}))
                        )
                    else:
                        self.on_frame(frame, time.monotonic())
                if joined:
                    return conn
                if pong := ws.outgoing():
                    await stream.send_all(pong)
                data = await stream.receive_some(RECEIVE)
                if not data:
                    raise WorkerError(f"{user}: {url} closed the connection at the join")
                messages = ws.feed(data)
        except BaseException:
            await stream.aclose()
            raise

    # -- the engine thread ---------------------------------------------------------------------

    def _engine(self, stop: threading.Event) -> None:
        """Read the connections and send the posts when due, until ``stop`` is set."""
        try:
            epoll = self._epoll
            while not stop.is_set():
                schedule = self._schedule
                timeout = IDLE_POLL
                if schedule is not None:
                    timeout = min(timeout, max(0.0, schedule.due() - time.monotonic()))
                ready = epoll.poll(timeout)
                if ready:
                    self._read(ready, time.monotonic())
                if schedule is not None:
                    self._post_due(schedule)
                if ready and (schedule is None or schedule.due() - time.monotonic() > GATHER):
                    # Let the frames that follow gather for a moment, so that one wake-up and
                    # one read take several: stamped at most GATHER late, never early.
                    time.sleep(GATHER)
        except Exception as exc:  # told to the next command, which fails with it
            logger.exception("the engine thread failed")
            self._failure = f"the engine thread failed: {type(exc).__name__}: {exc}"

    def _read(self, ready: list[tuple[int, int]], now: float) -> None:
        for fd, _ in ready:
            if fd == self._wake[0]:
                os.read(fd, 512)
                continue
            conn = self._by_fd.get(fd)
            if conn is None:
                continue
            try:
                data = os.read(fd, RECEIVE)
                if not data:
                    raise trio.BrokenResourceError("end of stream")
                self.on_bytes(conn, data, now)
            except BlockingIOError:
                continue
            except (OSError, trio.BrokenResourceError, WebSocketProtocolError, ValueError,
                    KeyError) as exc:  # fmt: skip
                logger.warning("%s: connection lost: %r", conn.user, exc)
                self._lost(conn)

    def _lost(self, conn: Connection) -> None:
        self._forget(conn)
        conn.closed = True

    def _post_due(self, schedule: Schedule) -> None:
        now = time.monotonic()
        while schedule.k < schedule.count and (due := schedule.due()) <= now:
            conn = schedule.rng.choice(schedule.posters)
            post_id = f"{schedule.tag}-{self.index}-{schedule.k}"
            text = json.dumps({"type": "post", "text": f"{now:.6f}", "id": post_id})
            frame = conn.ws.text(text)
            try:
                written = -1 if conn.closed else os.write(conn.fd, frame)
            except OSError:  # a full socket buffer included: the server stopped reading
                written = -1
            if written == len(frame):
                self.pending[post_id] = now
                schedule.tally.posts_by_room[conn.room] += 1
            else:
                schedule.send_errors += 1
                schedule.tally.error(f"{conn.user}: post not sent ({written} bytes written)")
                if written != -1 or not conn.closed:
                    self._lost(conn)  # a frame cut short leaves the stream unusable
            schedule.late = max(schedule.late, now - due)
            schedule.first = schedule.first or now
            schedule.last = now
            schedule.k += 1
            now = time.monotonic()
        if schedule.k >= schedule.count:
            self._schedule = None
            schedule.done.set()

    def _poke(self) -> None:
        os.write(self._wake[1], b"!")

    def _forget(self, conn: Connection) -> None:
        if self._by_fd.pop(conn.fd, None) is not None:
            self._epoll.unregister(conn.fd)

    # -- commands -------------------------------------------------------------------------------

    async def connect(
        self, group: str, users: list[list[str]], at_once: int, within: float
    ) -> dict[str, Any]:
        if group in self.groups:
            raise WorkerError(f"group {group!r} is connected already")
        limiter = trio.CapacityLimiter(at_once)
        began = time.monotonic()
        failures: list[str] = []
        joined: list[Connection] = []

        async def one(user: str, room: str, url: str) -> None:
            async with limiter:
                try:
                    conn = await self._join(user, room, url)
                except (WorkerError, OSError, WebSocketProtocolError, ValueError) as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    starting.cancel_scope.cancel()
                    return
                joined.append(conn)

        with trio.move_on_after(within) as scope:
            async with trio.open_nursery() as starting:
                for user, room, url in users:
                    starting.start_soon(one, user, room, url)
        if failures or scope.cancelled_caught:
            for conn in joined:
                await conn.stream.aclose()
            why = failures[0] if failures else f"the time limit ({within:g} s)"
            raise WorkerError(f"{len(joined)} of {len(users)} users joined, then: {why}")
        self.groups[group] = joined
        for conn in joined:
            self._by_fd[conn.fd] = conn
            self._epoll.register(conn.fd, select.EPOLLIN)
        if self._engine_thread is None:
            self._epoll.register(self._wake[0], select.EPOLLIN)
            stop = threading.Event()
            thread = threading.Thread(target=self._engine, args=(stop,), name="engine", daemon=True)
            thread.start()
            self._engine_thread = (thread, stop)
        return {
            "connected": len(joined),
            "seconds": time.monotonic() - began,
            "join_retries": sum(c.joins - 1 for c in joined),
        }

    async def run(
        self,
        group: str,
        tag: str,
        rate: float,
        start_at: float,
        duration: float,
        offset: float,
        seed: int,
    ) -> dict[str, Any]:
        self._check_engine()
        if tag in self.tallies or "-" in tag:
            raise WorkerError(f"tag {tag!r} is in use or has a '-'")
        posters = [c for c in self.groups.get(group, []) if not c.closed]
        if not posters:
            raise WorkerError(f"no open connection of group {group!r} to post from")
        count = max(0, math.ceil(rate * duration - offset))  # due in [start_at, +duration)
        schedule = Schedule(tag, rate, start_at, offset, count, random.Random(seed), posters)
        schedule.tally.group = group
        self.tallies[tag] = schedule.tally
        if count:
            self._schedule = schedule
            self._poke()
            limit = start_at + duration + RUN_MARGIN - time.monotonic()
            done = await trio.to_thread.run_sync(schedule.done.wait, limit, abandon_on_cancel=True)
            if not done:
                self._schedule = None
                self._check_engine()
                raise WorkerError(f"{schedule.k} of {count} posts sent in {limit:.0f} s")
        return {
            "posts": sum(schedule.tally.posts_by_room.values()),
            "posts_by_room": dict(schedule.tally.posts_by_room),
            "send_errors": schedule.send_errors,
            "late_max_ms": schedule.late * 1e3,
            "first_sent": schedule.first,
            "last_sent": schedule.last,
        }

    def _check_engine(self) -> None:
        if self._failure is not None:
            raise WorkerError(self._failure)

    def tally(self, tag: str, final: bool) -> dict[str, Any]:
        self._check_engine()
        tally = self.tallies.get(tag)
        if tally is None:
            raise WorkerError(f"no step {tag!r} here")
        answer: dict[str, Any] = {
            "receipts": tally.receipts,
            "acks": tally.acks,
            "errors": tally.errors,
            "closed": sum(c.closed for c in self.groups[tally.group]),
        }
        if final:
            # The engine thread may still count a late frame: the copies below are made in C,
            # under the GIL, so they see a tally either before or after it.
            del self.tallies[tag]
            for post_id in [p for p in list(self.pending) if tag_of(p) == tag]:
                self.pending.pop(post_id, None)
            answer.update(
                receipt_hist=sorted(tally.receipt_hist.items()),
                ack_hist=sorted(tally.ack_hist.items()),
                error_texts=tally.error_texts,
                stray=self.stray,
            )
        return answer

    async def disconnect(self) -> dict[str, Any]:
        """Stop the engine, close every connection."""
        if self._engine_thread is not None:
            thread, stop = self._engine_thread
            stop.set()
            self._poke()
            await trio.to_thread.run_sync(thread.join, 5.0)
            self._engine_thread = None
            self._epoll.unregister(self._wake[0])
        closed = 0
        for conns in self.groups.values():
            for conn in conns:
                self._forget(conn)
                await conn.stream.aclose()
                closed += 1
        self.groups.clear()
        self.tallies.clear()
        self.pending.clear()
        return {"closed": closed}


async def run_command(client: LoadClient, command: dict[str, Any]) -> dict[str, Any]:
    """Carry out one command."""
    args = {k: v for k, v in command.items() if k != "cmd"}
    match command["cmd"]:
        case "connect":
            return await client.connect(**args)
        case "run":
            return await client.run(**args)
        case "tally":
            return client.tally(**args)
        case "disconnect":
            return await client.disconnect()
    raise WorkerError(f"unknown command {command!r}")


async def serve(index: int, lifetime: float) -> None:
    """Answer commands until "stop", the end of stdin, or the end of ``lifetime``."""
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))

    async def answer(message: dict[str, Any]) -> None:
        await stdout.send_all((json.dumps(message) + "\n").encode())

    with trio.fail_after(lifetime):
        async with stdout, trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
            client = LoadClient(index)
            await answer({"event": "ready", "pid": os.getpid()})
            lines = Lines(stdin)
            try:
                while (line := await lines.readline()) is not None:
                    command = json.loads(line)
                    if command["cmd"] == "stop":
                        break
                    try:
                        result = await run_command(client, command)
                    except (WorkerError, OSError, ValueError, KeyError) as exc:
                        logger.exception("%s failed", command["cmd"])
                        await answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                    else:
                        await answer({"ok": True, **result})
            finally:
                with trio.CancelScope(shield=True):
                    await client.disconnect()


def main(argv: list[str] | None = None) -> int:
    """Run one load process."""
    parser = argparse.ArgumentParser(description="load process of benchmarks/chat_load.py")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--lifetime", type=float, default=600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one descriptor per user
    trio.run(serve, args.index, args.lifetime)
    return 0


if __name__ == "__main__":
    sys.exit(main())
