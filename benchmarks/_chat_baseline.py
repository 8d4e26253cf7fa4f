"""The chat benchmarks' baseline: a single trio process speaking the chat's WebSocket frames.

``python -m benchmarks._chat_baseline`` prints its port on stdout and serves until it is
stopped; :class:`BaselineProcess` runs it for ``benchmarks/chat.py`` and
``benchmarks/chat_load.py``. It keeps each room's members in a dict: on a post it pushes the
same ``message`` and ``members`` frames as a chat node's gateway into the queue of each member of
the poster's room (512 frames, a writer task per connection, a connection that cannot keep up is
closed, as the chat nodes do) and answers ``ack``. No cluster, no journal, no TLS: what any
WebSocket fan-out in Python costs here.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio_websocket

from benchmarks._process import ROOT, BenchmarkError

HOST = "127.0.0.1"
QUEUE = 512
"""Frames queued per connection before the server drops it (as the chat nodes do)."""

Member = tuple[str, trio.MemorySendChannel[dict[str, Any]]]
"""A connection in a room: its user and the queue of its writer task."""


async def baseline_server() -> None:
    """Serve the chat frames on 127.0.0.1; print the port, serve until cancelled."""
    rooms: dict[str, dict[int, Member]] = {}
    room_of: dict[int, str] = {}
    seq = 0

    def names(members: dict[int, Member]) -> list[str]:
        return sorted({user for user, _ in members.values()})

    def drop(key: int) -> None:
        room = room_of.pop(key, None)
        if room is not None:
            rooms[room].pop(key, None)

    def push(key: int, frame: dict[str, Any]) -> None:
        room = room_of.get(key)
        entry = None if room is None else rooms[room].get(key)
        if entry is None:
            return
        try:
            entry[1].send_nowait(frame)
        except trio.WouldBlock:  # too slow: dropped, as a chat node drops it
            drop(key)
            entry[1].close()

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        key = id(ws)
        send, receive = trio.open_memory_channel[dict[str, Any]](QUEUE)

        async def writer() -> None:
            with contextlib.suppress(trio_websocket.ConnectionClosed):
                async with receive:
                    async for frame in receive:
                        await ws.send_message(json.dumps(frame))
                await ws.aclose(code=1013, reason="too slow")

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await send.send({"type": "hello", "node": "baseline", "nodes": []})
                with contextlib.suppress(trio_websocket.ConnectionClosed):
                    while True:
                        handle(key, send, json.loads(await ws.get_message()))
                nursery.cancel_scope.cancel()
        finally:
            drop(key)

    def handle(
        key: int, send: trio.MemorySendChannel[dict[str, Any]], frame: dict[str, Any]
    ) -> None:
        nonlocal seq
        if frame["type"] == "join":
            room = frame["room"]
            drop(key)
            members = rooms.setdefault(room, {})
            members[key], room_of[key] = (frame["user"], send), room
            listed = names(members)
            push(key, {"type": "joined", "room": room, "user": frame["user"],
                       "members": listed, "history": []})  # fmt: skip
            for other in list(members):
                if other != key:
                    push(other, {"type": "members", "room": room, "members": listed})
        elif frame["type"] == "post" and key in room_of:
            room = room_of[key]
            members = rooms[room]
            seq += 1
            message = {"seq": seq, "user": members[key][0], "text": frame["text"],
                       "id": frame["id"], "at": time.time()}  # fmt: skip
            listed = names(members)
            for other in list(members):
                push(other, {"type": "message", "room": room, "message": message})
                push(other, {"type": "members", "room": room, "members": listed})
            push(key, {"type": "ack", "id": frame["id"], "seq": seq, "duplicate": False})

    async with trio.open_nursery() as nursery:
        server = await nursery.start(trio_websocket.serve_websocket, handler, HOST, 0, None)
        print(server.port, flush=True)


class BaselineProcess:
    """The baseline server as a process of its own, like each chat node."""

    def __init__(self, log: Path) -> None:
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._chat_baseline"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 20)
        line = self.process.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            self.stop()
            raise BenchmarkError(f"the baseline server did not start; see {log}")
        self.url = f"ws://{HOST}:{int(line)}/ws"

    def stop(self) -> None:
        """SIGTERM, a bounded wait, then SIGKILL."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


if __name__ == "__main__":
    trio.run(baseline_server)
