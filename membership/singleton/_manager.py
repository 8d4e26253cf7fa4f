"""``node.singletons``: one instance of an async function on the oldest member, and proxies.

Theory of operation: :meth:`Singletons.start` registers a singleton on this node: a manager
(:class:`SingletonManagerCore` for the hand-over protocol, plus this shell) watches the cluster and
runs the function when this node is the oldest Up member of the role, handing it over when that
changes. While a rolling upgrade is under way (members of different ``app_version``) it is the
oldest member of the newest version instead, so that the rollout moves the singleton once
(:meth:`~membership.Cluster.singleton_host`). Every node that may host it must call ``start``
with the same name. :meth:`proxy` returns a :class:`SingletonProxy` that sends to wherever the
singleton runs: to that member in this node's view. A manager that is about to start the
instance (waiting for the hand-over) buffers what arrives; one that does not run it answers
"not here" with the message, and the proxy keeps it and tries again once the cluster view
settles. Messages inside a stopping instance's inbox are lost, as in Akka: delivery is at most
once; ask() fails by timeout.

The function gets a :class:`SingletonContext` to read its messages from (or to have them handed
to a function of its own, ``serve``). It is cancelled on
hand-over (``finally`` blocks run), restarted after a second if it crashes, and stops for good
when the node leaves the cluster.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

import attrs
import trio

from .._cluster import Cluster
from .._lease import HeldLease, acquire_until_granted
from .._member import MemberStatus
from .._timer import CoreTimer
from ..transport import _wire
from ..transport._address import UniqueAddress
from ..transport._errors import ClusterError, ConfigurationError, SendQueueFull, TransportClosed
from ..transport._transport import Envelope, Transport
from ._core import (
    HAND_OVER_MESSAGES,
    HandOverDone,
    HandOverToMe,
    SendTo,
    SingletonEffect,
    SingletonManagerCore,
    SingletonState,
    StartInstance,
    StopInstance,
)
from ._messages import SingletonEnvelope, SingletonNotHere, SingletonReply
from ._proxy import ProxyServices, SingletonProxy
from ._proxy_core import SingletonUnavailable

logger = logging.getLogger("membership.singleton")

_SUCCESSOR_STATUSES = frozenset(
    {MemberStatus.UP, MemberStatus.LEAVING, MemberStatus.WEAKLY_UP, MemberStatus.JOINING}
)
"""Members that could take a singleton over from an exiting node."""

RESTART_BACKOFF = 1.0
"""Seconds before a crashed singleton instance is started again."""


@attrs.frozen
class SingletonRequest:
    """One message for the singleton; answer an ask with :meth:`reply`."""

    message: object
    sender: UniqueAddress
    _reply: Callable[[object], None] | None = attrs.field(alias="reply", repr=False)

    @property
    def wants_reply(self) -> bool:
        """Whether the sender asked (and waits for an answer)."""
        return self._reply is not None

    def reply(self, value: object) -> None:
        """Answer an ask (does nothing for a tell)."""
        if self._reply is not None:
            self._reply(value)


class SingletonContext:
    """What a singleton instance gets: its name, the node, and its messages."""

    def __init__(
        self,
        name: str,
        node: UniqueAddress,
        inbox: trio.MemoryReceiveChannel[SingletonRequest],
        held: Callable[[], bool] | None = None,
        set_handler: Callable[[Callable[[SingletonRequest], None] | None], None] | None = None,
    ) -> None:
        self.name = name
        self.node = node
        self._inbox = inbox
        self._held = held
        self._set_handler = set_handler

    async def receive(self) -> SingletonRequest:
        """The next message.

        Under a lease, a message that comes after the lease's deadline passed is never handed
        out (the instance waits to be stopped instead): the deadline can pass before the task
        watching the lease runs, in a process that was stopped or starved past it.
        """
        request = await self._inbox.receive()
        if self._held is not None and not self._held():
            await trio.sleep_forever()  # the manager stops this instance as soon as it runs
        return request

    async def serve(self, handler: Callable[[SingletonRequest], None]) -> NoReturn:
        """Give every message to ``handler`` as it arrives, in the task that received it.

        Instead of :meth:`receive`, for an instance whose work per message never waits: each
        message then skips a pass through the scheduler. Messages that came before go to
        ``handler`` first, in order. ``handler`` must not block. It never returns: what
        ``handler`` raises is raised here (the instance then ends, as if it had raised), and
        under a lease whose deadline passed messages are not handed out any more.
        """
        if self._set_handler is None:
            raise RuntimeError("this context cannot hand messages to a handler")
        set_handler = self._set_handler
        failed = trio.Event()
        errors: list[Exception] = []

        def take(request: SingletonRequest) -> None:
            if failed.is_set():
                return
            if self._held is not None and not self._held():
                failed.set()  # the manager stops this instance as soon as it runs
                return
            try:
                handler(request)
            except Exception as exc:
                errors.append(exc)
                failed.set()

        while not failed.is_set():
            try:
                take(self._inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        set_handler(take)
        try:
            await failed.wait()
            if errors:
                raise errors[0]
            await trio.sleep_forever()
        finally:
            set_handler(None)

    def __aiter__(self) -> SingletonContext:
        return self

    async def __anext__(self) -> SingletonRequest:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


SingletonFunction = Callable[[SingletonContext], Awaitable[None]]


class _Manager:
    """The shell of one singleton on one node."""

    def __init__(
        self,
        singletons: Singletons,
        name: str,
        fn: SingletonFunction,
        role: str | None,
        lease: HeldLease | None,
        buffer_size: int,
        retry_interval: float,
    ) -> None:
        self.s = singletons
        self.name = name
        self.fn = fn
        self.role = role
        self.lease = lease
        self.core = SingletonManagerCore(
            name, singletons.cluster.self_address, retry_interval=retry_interval
        )
        self.buffer: collections.deque[tuple[UniqueAddress, SingletonEnvelope]] = (
            collections.deque()
        )
        self.buffer_size = buffer_size
        self.inbox_send: trio.MemorySendChannel[SingletonRequest] | None = None
        self.handler: Callable[[SingletonRequest], None] | None = None
        """What the running instance handles messages with, if it asked (``serve``)."""
        self.instance_scope: trio.CancelScope | None = None
        self.instance_done = trio.Event()
        self.instance_done.set()
        self.timer = CoreTimer(self.core.next_deadline)
        self.handed_over = trio.Event()
        self.nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cluster = self.s.cluster
        async with trio.open_nursery() as nursery, cluster.subscribe() as events:
            self.nursery = nursery
            self._view()
            task_status.started()

            async def follow_cluster() -> None:
                async for _ in events:
                    self._view()
                self._apply(self.core.terminate())  # subscription ends: node is out

            nursery.start_soon(follow_cluster)
            while True:
                now = await self.timer.wait()
                self._apply(self.core.tick(now))

    def _view(self) -> None:
        cluster = self.s.cluster
        if cluster.terminated.is_set():
            self._apply(self.core.terminate())
            return
        oldest = cluster.singleton_host(self.role)
        members = cluster.gossip.nodes()
        self._apply(
            self.core.update(None if oldest is None else oldest.node, members, trio.current_time())
        )

    def _apply(self, effects: list[SingletonEffect]) -> None:
        for effect in effects:
            match effect:
                case SendTo(to=to, message=msg):
                    self.s._send(to, msg)
                case StartInstance():
                    assert self.nursery is not None
                    self.instance_done = trio.Event()
                    self.nursery.start_soon(self._run_instance)
                case StopInstance():
                    if self.instance_scope is not None:
                        self.instance_scope.cancel()
                    elif self.nursery is not None:
                        self.nursery.start_soon(self._report_stopped)
        if self.core.state in (SingletonState.WAS_OLDEST, SingletonState.STOPPED):
            self.handed_over.set()
        self.timer.poke()  # a retry may be due sooner than the timer loop is sleeping

    async def _report_stopped(self) -> None:
        await self.instance_done.wait()
        self._apply(self.core.instance_stopped(trio.current_time()))

    async def _run_instance(self) -> None:
        me = self.s.cluster.self_address
        try:
            with trio.CancelScope() as scope:
                self.instance_scope = scope
                if self.lease is None:
                    await self._serve(me)
                else:
                    await self._serve_under_lease(me, self.lease)
        finally:
            self.instance_scope = None
            if self.lease is not None:
                with trio.CancelScope(shield=True):
                    try:
                        await self.lease.release()
                    except ClusterError as exc:
                        logger.warning("%s: singleton lease not released: %s", me, exc)
            self.instance_done.set()
            self._apply(self.core.instance_stopped(trio.current_time()))

    async def _serve_under_lease(self, me: UniqueAddress, lease: HeldLease) -> None:
        """Run the instance only while the lease is held; stop it at once when it is lost."""
        while True:
            await acquire_until_granted(
                lease, self.core.retry_interval, f"{me}: singleton {self.name!r}", logger
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve, me)
                await lease.wait_lost()
                logger.warning("%s: singleton %r lost its lease; stopping it", me, self.name)
                nursery.cancel_scope.cancel()

    async def _serve(self, me: UniqueAddress) -> None:
        while True:
            send, receive = trio.open_memory_channel[SingletonRequest](self.buffer_size)
            self.inbox_send = send
            while self.buffer:
                sender, envelope = self.buffer.popleft()
                self._deliver(sender, envelope)
            try:
                held = None if self.lease is None else self.lease.check
                await self.fn(SingletonContext(self.name, me, receive, held, self._set_handler))
                logger.info("%s: singleton %r returned", me, self.name)
                await trio.sleep_forever()
            except Exception:
                logger.exception("%s: singleton %r crashed; restarting", me, self.name)
                await trio.sleep(RESTART_BACKOFF)
            finally:
                self.inbox_send = None
                self.handler = None
                send.close()

    def _set_handler(self, handler: Callable[[SingletonRequest], None] | None) -> None:
        self.handler = handler

    def receive(self, sender: UniqueAddress, envelope: SingletonEnvelope) -> None:
        if self.inbox_send is not None and self.core.running:
            self._deliver(sender, envelope)
        elif self.core.takes_messages and len(self.buffer) < self.buffer_size:
            self.buffer.append((sender, envelope))
        else:
            self.s._send(
                sender,
                SingletonNotHere(
                    name=self.name, payload=envelope.payload, request_id=envelope.request_id
                ),
            )

    def _deliver(self, sender: UniqueAddress, envelope: SingletonEnvelope) -> None:
        assert self.inbox_send is not None
        reply = None
        if envelope.request_id:
            rid = envelope.request_id

            def reply(value: object) -> None:
                self.s._send(sender, SingletonReply(request_id=rid, payload=value))

        request = SingletonRequest(envelope.payload, sender, reply)
        if self.handler is not None:
            self.handler(request)  # see SingletonContext.serve
            return
        try:
            self.inbox_send.send_nowait(request)
        except trio.WouldBlock:
            self.s._send(
                sender,
                SingletonNotHere(
                    name=self.name, payload=envelope.payload, request_id=envelope.request_id
                ),
            )


class Singletons:
    """``node.singletons``: run singletons on the oldest member and talk to them.

    Example:
        >>> async def coordinator(ctx: SingletonContext) -> None:
        ...     async for request in ctx:
        ...         request.reply(f"handled {request.message}")
        >>> async def main(node: Node) -> None:
        ...     await node.singletons.start("coordinator", coordinator)
        ...     print(await node.singletons.proxy("coordinator").ask("x", timeout=5))
    """

    def __init__(self, transport: Transport, cluster: Cluster, nursery: trio.Nursery) -> None:
        self._transport = transport
        self.cluster = cluster
        self._nursery = nursery
        self._managers: dict[str, _Manager] = {}
        self._proxies: dict[tuple[str, str | None], SingletonProxy] = {}
        self._requests: dict[int, SingletonProxy] = {}
        """Which proxy asked, by request id: replies go to it."""
        self._ids = itertools.count(1)
        self._proxy_services = ProxyServices(
            cluster=cluster,
            send=self._send,
            check_serializable=self._check_serializable,
            runs_here=self._managers.__contains__,
            new_request=self._new_request,
            forget_request=self._forget_request,
        )
        cluster.add_exiting_task(self._hand_over_all)

    async def start(
        self,
        name: str,
        fn: SingletonFunction,
        *,
        role: str | None = None,
        lease: HeldLease | None = None,
        buffer_size: int = 1000,
        retry_interval: float = 1.0,
    ) -> None:
        """Run ``fn`` as the singleton ``name`` whenever this node is the singleton host.

        The host is the oldest member (of ``role``), or during a rolling upgrade the oldest of
        the newest ``app_version`` (:meth:`~membership.Cluster.singleton_host`).

        With a ``lease`` (Akka's ``use-lease``), the instance starts only once the lease is
        granted (asked for again every ``retry_interval``), is stopped at once when it is lost
        and started again when it is granted again, and the lease is released at hand-over.

        Raises:
            ConfigurationError: ``name`` is already started on this node, or this node lacks
                ``role``.
        """
        if name in self._managers:
            raise ConfigurationError(f"singleton {name!r} is already started on this node")
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"singleton name {name!r} must be a non-empty string")
        if role is not None and role not in self.cluster.self_member.roles:
            raise ConfigurationError(
                f"singleton {name!r} is for role {role!r}, which this node does not have "
                f"(roles: {sorted(self.cluster.self_member.roles) or 'none'}); use proxy() here"
            )
        manager = _Manager(self, name, fn, role, lease, buffer_size, retry_interval)
        self._managers[name] = manager
        await self._nursery.start(manager.run)

    def proxy(
        self, name: str, *, role: str | None = None, buffer_size: int = 1000
    ) -> SingletonProxy:
        """A proxy to the singleton ``name`` (of ``role``), on any node."""
        key = (name, role)
        proxy = self._proxies.get(key)
        if proxy is None:
            proxy = SingletonProxy(self._proxy_services, name, role, buffer_size)
            self._proxies[key] = proxy
            self._nursery.start_soon(proxy._run)
        return proxy

    def state(self, name: str) -> SingletonState | None:
        """This node's hand-over state for ``name`` (None if not started here)."""
        manager = self._managers.get(name)
        return None if manager is None else manager.core.state

    # ---- plumbing ----

    def _check_serializable(self, payload: object) -> None:
        _wire.encode(payload, max_size=self._transport.settings.max_frame_size - 64)

    def _new_request(self, proxy: SingletonProxy) -> int:
        rid = next(self._ids)
        self._requests[rid] = proxy
        return rid

    def _forget_request(self, rid: int) -> None:
        self._requests.pop(rid, None)

    def _send(self, to: UniqueAddress, msg: object) -> None:
        try:
            self._transport.send_nowait(to, msg)
        except SendQueueFull:
            logger.debug("singleton message to %s dropped: send queue full", to)
        except TransportClosed:
            pass

    def handle(self, envelope: Envelope) -> bool:
        """Take a singleton message from the transport; False if it is not one."""
        msg, sender = envelope.message, envelope.sender
        now = trio.current_time()
        if isinstance(msg, SingletonEnvelope):
            manager = self._managers.get(msg.name)
            if manager is None:
                self._send(
                    sender,
                    SingletonNotHere(name=msg.name, payload=msg.payload, request_id=msg.request_id),
                )
            else:
                manager.receive(sender, msg)
            return True
        if isinstance(msg, SingletonReply):
            proxy = self._requests.get(msg.request_id)
            if proxy is not None:
                proxy._replied(msg.request_id, msg.payload, msg.error)
            return True
        if isinstance(msg, SingletonNotHere):
            for (name, _), proxy in self._proxies.items():
                if name == msg.name:
                    try:
                        proxy._returned(msg.payload, msg.request_id)
                    except SingletonUnavailable:
                        logger.warning("singleton %r: message dropped, proxy buffer full", name)
                    break
            return True
        if isinstance(msg, HAND_OVER_MESSAGES):
            manager = self._managers.get(msg.name)
            if manager is not None:
                manager._apply(manager.core.receive(sender, msg, now))
            elif isinstance(msg, HandOverToMe):  # nothing runs here: the requester may start
                self._send(sender, HandOverDone(name=msg.name))
            return True
        return False

    async def _hand_over_all(self) -> None:
        """Exiting task: wait (bounded) until every singleton running here was handed over."""
        for manager in self._managers.values():
            if not manager.core.running:
                continue
            others = [
                m
                for m in self.cluster.members
                if m.node != self.cluster.self_address
                and m.has_role(manager.role)
                and m.status in _SUCCESSOR_STATUSES
            ]
            with trio.move_on_after(10 if others else 0):
                await manager.handed_over.wait()
            if manager.core.running:
                manager._apply(manager.core.terminate())
                await manager.instance_done.wait()
