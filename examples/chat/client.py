"""A Python client of the chat WebSocket, for the tests and the benchmark.

Example::

    async with open_chat_client("ws://127.0.0.1:28520/ws") as alice:
        await alice.join("lobby", "alice")
        seq = await alice.post("hello", "alice-1")
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio_websocket


class ChatError(Exception):
    """The server answered with an error frame."""

    def __init__(self, frame: dict[str, Any]) -> None:
        super().__init__(frame.get("error"))
        self.frame = frame


@attrs.define(eq=False)
class ChatClient:
    """One connection: every frame received is kept in ``frames``, in order."""

    ws: trio_websocket.WebSocketConnection
    frames: list[dict[str, Any]] = attrs.Factory(list)
    _changed: trio.Event = attrs.Factory(trio.Event)
    closed: bool = False

    async def _read(self) -> None:
        try:
            while True:
                frame = json.loads(await self.ws.get_message())
                frame["_at"] = trio.current_time()
                self.frames.append(frame)
                self._changed.set()
                self._changed = trio.Event()
        except trio_websocket.ConnectionClosed:
            self.closed = True
            self._changed.set()

    async def send(self, frame: dict[str, Any] | str) -> None:
        """Send a frame (a dict as JSON, a str as it is)."""
        await self.ws.send_message(frame if isinstance(frame, str) else json.dumps(frame))

    async def expect(
        self, match: Callable[[dict[str, Any]], bool], *, start: int = 0, wait: float = 10
    ) -> dict[str, Any]:
        """The first frame at or after index ``start`` that matches (up to ``wait`` s)."""
        with trio.fail_after(wait):
            while True:
                for frame in self.frames[start:]:
                    if match(frame):
                        return frame
                if self.closed:
                    raise trio_websocket.ConnectionClosed(None)
                await self._changed.wait()

    async def request(
        self, frame: dict[str, Any], answer: str, *, wait: float = 10
    ) -> dict[str, Any]:
        """Send ``frame``; return the next frame of type ``answer`` (ChatError on an error)."""
        start = len(self.frames)
        await self.send(frame)
        ref = frame.get("id")
        got = await self.expect(
            lambda f: (
                (f["type"] == answer and (answer != "ack" or f["id"] == ref))
                or (f["type"] == "error" and (ref is None or f.get("id") in (None, ref)))
            ),
            start=start,
            wait=wait,
        )
        if got["type"] == "error":
            raise ChatError(got)
        return got

    async def join(self, room: str, user: str, *, wait: float = 10) -> dict[str, Any]:
        """Join; return the ``joined`` frame."""
        return await self.request({"type": "join", "room": room, "user": user}, "joined", wait=wait)

    async def post(self, text: str, client_id: str, *, wait: float = 10) -> dict[str, Any]:
        """Post; return the ``ack`` frame."""
        return await self.request({"type": "post", "text": text, "id": client_id}, "ack", wait=wait)

    async def history(self, *, wait: float = 10) -> dict[str, Any]:
        """The room's members and last messages."""
        return await self.request({"type": "history"}, "history", wait=wait)


@asynccontextmanager
async def open_chat_client(url: str) -> AsyncIterator[ChatClient]:
    """Connect to a node's ``/ws``; the connection closes at the end of the block."""
    try:
        async with trio_websocket.open_websocket_url(url) as ws, trio.open_nursery() as nursery:
            client = ChatClient(ws)
            nursery.start_soon(client._read)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise _single(group) from None


def _single(error: BaseException) -> BaseException:
    """The one error inside nested groups of one (so a test sees its own AssertionError)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error
