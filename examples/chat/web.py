"""Each node's web server: the page, the cluster page and its JSON, and the chat WebSocket.

A small HTTP/1.1 server on trio (one request per connection, ``Connection: close``) serves
``/`` (the chat page), ``/cluster`` (the cluster page), ``/cluster.json`` (from the node's
management endpoint when it has one, see :func:`cluster_json`) and the static files.
``GET /ws`` with an Upgrade header is handed, bytes already read included, to trio-websocket.

WebSocket frames are JSON objects with a ``type``. From the page: ``join`` (room, user),
``leave``, ``post`` (text, id: the client's message id), ``history``. To the page: ``hello``
(node, nodes: every node's URL), ``joined`` (room, user, members, history), ``message``,
``members``, ``ack`` (id, seq, duplicate), ``history``, ``left`` and ``error`` (error, the id of
the post it refers to if any, retry: whether trying again may help).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

import p2pshard

from .gateway import Hub, RunningHere, Session, WhatRunsHere, message_json
from .protocol import (
    History,
    InvalidInput,
    Join,
    Leave,
    Post,
    Posted,
    RoomView,
    check_client_id,
    check_room,
    check_text,
    check_user,
)

logger = logging.getLogger("examples.chat.web")

STATIC = Path(__file__).parent / "static"
ASK_TIMEOUT = 4.0
STATS_TIMEOUT = 0.8
"""Seconds ``/cluster.json`` waits for other nodes (regions' statistics, gateways)."""
MANAGEMENT_TIMEOUT = 3.0
"""Seconds ``/cluster.json`` waits for the management endpoint (its shards route waits 2 s)."""
MANAGEMENT_ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError)
"""What a failed or unexpected answer of the management endpoint raises here."""
ASKED_STATUSES = frozenset({"JOINING", "WEAKLY_UP", "UP", "LEAVING", "EXITING"})
"""Members whose gateways ``/cluster.json`` asks for their entities."""
MAX_FRAME = 64 * 1024
MAX_HEAD = 16 * 1024
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/cluster": ("cluster.html", "text/html; charset=utf-8"),
    "/cluster.js": ("cluster.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}


class _ReplayStream(trio.abc.Stream):
    """A stream that first yields bytes already read from ``inner``."""

    def __init__(self, inner: trio.abc.Stream, head: bytes) -> None:
        self._inner = inner
        self._head = head

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._head:
            head, self._head = self._head, b""
            await trio.lowlevel.checkpoint()
            return head
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def serve_web(
    hub: Hub, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Listen on 127.0.0.1:``port`` until cancelled; ``nursery.start`` gets the port."""
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    bound = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await _serve_connection(hub, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            logger.exception("web request failed")
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()

    task_status.started(bound)
    await trio.serve_listeners(handler, listeners)


async def _serve_connection(hub: Hub, stream: trio.SocketStream) -> None:
    buf = b""
    with trio.move_on_after(10) as scope:
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(4096)
            if not data:
                return
            buf += data
            if len(buf) > MAX_HEAD:
                await _respond(stream, 431, "text/plain", b"request head too large\n")
                return
    if scope.cancelled_caught:
        return
    head = buf.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    lines = head.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        await _respond(stream, 400, "text/plain", b"bad request line\n")
        return
    method, target, _ = parts
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    path = target.split("?", 1)[0]
    if path == "/ws" and "websocket" in headers.get("upgrade", "").lower():
        await _serve_websocket(hub, _ReplayStream(stream, buf))
        return
    if method != "GET":
        await _respond(stream, 405, "text/plain", b"only GET\n")
        return
    if path == "/cluster.json":
        body = json.dumps(await cluster_json(hub)).encode()
        await _respond(stream, 200, "application/json", body)
    elif path in _FILES:
        name, kind = _FILES[path]
        await _respond(stream, 200, kind, (STATIC / name).read_bytes())
    else:
        await _respond(stream, 404, "text/plain", f"no such page: {path}\n".encode())


async def _respond(stream: trio.abc.Stream, status: int, kind: str, body: bytes) -> None:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}.get(
        status, "Error"
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    )
    await stream.send_all(head.encode("latin-1") + body)


async def cluster_json(hub: Hub) -> dict[str, Any]:
    """Members, and per entity type every region's shards and the entities on each node.

    The members and the shards come from the node's management endpoint when it has one
    (``GET /cluster/members`` and ``GET /cluster/shards/{type}``), else from the node's own
    API (``node.cluster``, ``node.sharding.cluster_stats``); ``source`` says which. The ids of
    the entities (rooms) on each node come from that node's gateway (:class:`WhatRunsHere`).
    """
    node = hub.node
    view: dict[str, Any] | None = None
    source = "node"
    if node.management_address is not None:
        try:
            view = await _from_management(hub)
            source = "management"
        except MANAGEMENT_ERRORS as exc:
            logger.warning("management endpoint unusable (%r); reading the node instead", exc)
    if view is None:
        view = await _from_node(hub)
    entities = await _entities_per_node(hub, view["members"])
    for type_name, t in view["types"].items():
        t["entities"] = {name: e.get(type_name, []) for name, e in sorted(entities.items())}
        state = node.sharding.region_state(type_name)
        t["local_entities"] = {s.shard_id: sorted(s.entity_ids) for s in state.shards}
    return {
        "node": hub.node_name,
        "nodes": list(hub.web_urls),
        "source": source,
        "management": None if node.management_address is None else str(node.management_address),
        **view,
    }


async def _from_management(hub: Hub) -> dict[str, Any]:
    """Members and shards as the node's management endpoint gives them."""
    node = hub.node
    token = node.config.management.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    types: dict[str, Any] = {}
    errors: list[Exception] = []
    async with httpx.AsyncClient(
        base_url=f"http://{node.management_address}", headers=headers, timeout=MANAGEMENT_TIMEOUT
    ) as http:

        async def one(type_name: str) -> None:
            try:
                answer = await http.get(f"/cluster/shards/{type_name}")
                stats = answer.raise_for_status().json()
                regions = sorted(stats["regions"], key=_name)
                types[type_name] = {
                    "nodes": {r["name"]: r["shards"] for r in regions},
                    "failed": sorted(f["name"] for f in stats["failed"]),
                }
            except MANAGEMENT_ERRORS as exc:  # one error for the caller, not a group
                errors.append(exc)

        view = (await http.get("/cluster/members")).raise_for_status().json()
        async with trio.open_nursery() as nursery:
            for type_name in sorted(node.sharding.type_names):
                nursery.start_soon(one, type_name)
    if errors:
        raise errors[0]
    return {
        "leader": (view["leader"] or {}).get("name"),
        "oldest": (view["oldest"] or {}).get("name"),
        "members": [
            {
                "name": m["name"],
                "address": m["address"],
                "status": m["status"],
                "reachable": m["reachable"],
            }
            for m in view["members"]
        ],
        "types": {name: types[name] for name in sorted(types)},
    }


def _name(region: dict[str, Any]) -> str:
    return str(region["name"])


async def _from_node(hub: Hub) -> dict[str, Any]:
    """Members and shards from the node's own API (no management endpoint here)."""
    node = hub.node
    unreachable = {m.node for m in node.cluster.unreachable}
    leader = node.cluster.leader
    oldest = node.cluster.oldest()
    types: dict[str, Any] = {}

    async def one(type_name: str) -> None:
        stats = await node.sharding.cluster_stats(type_name, timeout=STATS_TIMEOUT)
        types[type_name] = {
            "nodes": {a.name: shards for a, shards in sorted(stats.regions.items(), key=str)},
            "failed": sorted(a.name for a in stats.failed),
        }

    async with trio.open_nursery() as nursery:
        for type_name in sorted(node.sharding.type_names):
            nursery.start_soon(one, type_name)
    return {
        "leader": leader.name if leader else None,
        "oldest": oldest.node.name if oldest else None,
        "members": [
            {
                "name": m.node.name,
                "address": str(m.node.address),
                "status": m.status.name,
                "reachable": m.node not in unreachable,
            }
            for m in node.cluster.members
        ],
        "types": {name: types[name] for name in sorted(types)},
    }


async def _entities_per_node(
    hub: Hub, members: list[dict[str, Any]]
) -> dict[str, dict[str, list[str]]]:
    """Per node name, the entity ids active there by type, as each node's gateway tells.

    Only reachable members that are not down are asked; a node whose gateway does not answer in
    time (or answers from another node) is left out.
    """
    found = {hub.node_name: hub.running_here().entities}

    async def one(name: str) -> None:
        try:
            answer = await hub.gateways.entity_ref(name).ask(WhatRunsHere(), timeout=STATS_TIMEOUT)
        except p2pshard.ClusterError as exc:
            logger.info("the gateway of %s did not tell its entities: %r", name, exc)
            return
        if isinstance(answer, RunningHere) and answer.node == name:
            found[name] = answer.entities

    async with trio.open_nursery() as nursery:
        for m in members:
            if m["name"] != hub.node_name and m["reachable"] and m["status"] in ASKED_STATUSES:
                nursery.start_soon(one, m["name"])
    return found


async def _serve_websocket(hub: Hub, stream: trio.abc.Stream) -> None:
    async with trio.open_nursery() as nursery:
        request = await trio_websocket.wrap_server_stream(
            nursery, stream, max_message_size=MAX_FRAME
        )
        ws = await request.accept()
        try:
            await _chat(hub, ws)
        finally:
            nursery.cancel_scope.cancel()


async def _chat(hub: Hub, ws: trio_websocket.WebSocketConnection) -> None:
    conn = f"{hub.node_name}/{secrets.token_hex(8)}"
    send, receive = trio.open_memory_channel[dict[str, Any]](512)
    session = Session(conn, send)
    hub.sessions[conn] = session
    try:
        async with trio.open_nursery() as nursery:

            async def writer() -> None:
                async with receive:
                    async for frame in receive:
                        await ws.send_message(json.dumps(frame))

            async def watch_overflow() -> None:
                await session.overflow.wait()
                logger.warning("%s cannot keep up; closing it", conn)
                await ws.aclose(code=1013, reason="too slow: reconnect and reload")

            async def reader() -> None:
                with contextlib.suppress(trio_websocket.ConnectionClosed):
                    await _read_frames(hub, ws, session)
                nursery.cancel_scope.cancel()

            nursery.start_soon(writer)
            nursery.start_soon(watch_overflow)
            session.push({"type": "hello", "node": hub.node_name, "nodes": list(hub.web_urls)})
            nursery.start_soon(reader)
    except trio_websocket.ConnectionClosed:
        pass
    finally:
        del hub.sessions[conn]
        if session.room is not None and session.user is not None:
            leave = Leave(user=session.user, conn=conn)
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(2),
                contextlib.suppress(p2pshard.ShardingError),
            ):
                await hub.rooms.entity_ref(session.room).tell(leave)


async def _read_frames(hub: Hub, ws: trio_websocket.WebSocketConnection, session: Session) -> None:
    while True:
        raw = await ws.get_message()
        if isinstance(raw, bytes):
            session.push(_error("binary frames are not understood: send JSON text frames"))
            continue
        try:
            frame = json.loads(raw)
        except ValueError as exc:
            session.push(_error(f"malformed JSON frame ({exc}); nothing was done"))
            continue
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            session.push(_error('a frame must be a JSON object with a "type" string'))
            continue
        ref = frame.get("id") if isinstance(frame.get("id"), str) else None
        try:
            await _handle(hub, session, frame)
        except InvalidInput as exc:
            session.push(_error(str(exc), ref))
        except (p2pshard.AskTimeout, p2pshard.ShardingError) as exc:
            logger.info("%s: room %s not reached: %r", session.conn, session.room, exc)
            session.push(
                _error(
                    f"the room {session.room} could not be reached in time (it may be moving to "
                    "another node after a failure): try again",
                    ref,
                    retry=True,
                )
            )


def _error(text: str, ref: str | None = None, *, retry: bool = False) -> dict[str, Any]:
    return {"type": "error", "error": text, "id": ref, "retry": retry}


async def _handle(hub: Hub, session: Session, frame: dict[str, Any]) -> None:
    kind = frame["type"]
    if kind not in ("join", "post", "history", "leave"):
        raise InvalidInput(f"unknown frame type {kind!r}: use join, post, history or leave")
    if kind == "join":
        room, user = check_room(frame.get("room")), check_user(frame.get("user"))
        if session.room is not None and session.user is not None and session.room != room:
            old = Leave(user=session.user, conn=session.conn)
            await hub.rooms.entity_ref(session.room).ask(old, timeout=ASK_TIMEOUT)
        session.room, session.user = room, user
        view = await hub.rooms.entity_ref(room).ask(
            Join(user=user, conn=session.conn), timeout=ASK_TIMEOUT
        )
        assert isinstance(view, RoomView)
        session.push(
            {
                "type": "joined",
                "room": room,
                "user": user,
                "members": list(view.members),
                "history": [message_json(m) for m in view.messages],
            }
        )
        return
    if session.room is None or session.user is None:
        raise InvalidInput(f"join a room before {kind!r}")
    room_ref = hub.rooms.entity_ref(session.room)
    if kind == "post":
        text, client_id = check_text(frame.get("text")), check_client_id(frame.get("id"))
        posted = await room_ref.ask(
            Post(user=session.user, text=text, client_id=client_id), timeout=ASK_TIMEOUT
        )
        assert isinstance(posted, Posted)
        session.push(
            {"type": "ack", "id": client_id, "seq": posted.seq, "duplicate": posted.duplicate}
        )
    elif kind == "history":
        view = await room_ref.ask(History(), timeout=ASK_TIMEOUT)
        assert isinstance(view, RoomView)
        session.push(
            {
                "type": "history",
                "room": session.room,
                "members": list(view.members),
                "history": [message_json(m) for m in view.messages],
            }
        )
    else:
        await room_ref.ask(Leave(user=session.user, conn=session.conn), timeout=ASK_TIMEOUT)
        session.room = session.user = None
        session.push({"type": "left"})
