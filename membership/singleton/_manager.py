"""``node.singletons``: one instance of an async function on the oldest member, and proxies.

Theory of operation: :meth:`Singletons.start` registers a singleton on this node: a manager
(:class:`SingletonManagerCore` for the hand-over protocol, plus this shell) watches the cluster and
runs the function when this node is the oldest Up member of the role, handing it over when that
changes. Every node that may host it must call ``start`` with the same name. :meth:`proxy` returns
a :class:`SingletonProxy` that sends to wherever the singleton runs: to the oldest member in this
node's view. A manager that is about to start the instance (waiting for the hand-over) buffers
what arrives; one that does not run it answers "not here" with the message, and the proxy keeps
it and tries again once the cluster view settles. Messages inside a stopping instance's inbox are
lost, as in Akka: delivery is at most once; ask() fails by timeout.

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
from ..transport import _wire
from ..transport._address import UniqueAddress
from ..transport._errors import ClusterError, ConfigurationError, SendQueueFull, TransportClosed
from ..transport._transport import Envelope, Transport
from ..transport._wire import message
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

logger = logging.getLogger("membership.singleton")

_SUCCESSOR_STATUSES = frozenset(
    {MemberStatus.UP, MemberStatus.LEAVING, MemberStatus.WEAKLY_UP, MemberStatus.JOINING}
)
"""Members that could take a singleton over from an exiting node."""

RESTART_BACKOFF = 1.0
"""Seconds before a crashed singleton instance is started again."""


class SingletonUnavailable(ClusterError):
    """An ``ask`` to a singleton got no answer in time, or the proxy's buffer is full."""


@message(name="p2pshard.singleton.Envelope")
@attrs.frozen(kw_only=True)
class SingletonEnvelope:
    """A message for the singleton ``name``; ``request_id`` 0 means no answer is wanted."""

    name: str
    payload: object
    request_id: int = 0


@message(name="p2pshard.singleton.Reply")
@attrs.frozen(kw_only=True)
class SingletonReply:
    """The answer to an ask."""

    request_id: int
    payload: object = None
    error: str | None = None


@message(name="p2pshard.singleton.NotHere")
@attrs.frozen(kw_only=True)
class SingletonNotHere:
    """The singleton does not run here: the message comes back to be sent again."""

    name: str
    payload: object
    request_id: int = 0


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
        self.wakeup = trio.Event()
        self.waiting_until = float("inf")
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
                self.waiting_until = self.core.next_deadline()
                with trio.move_on_at(self.waiting_until):
                    await self.wakeup.wait()
                self.wakeup = trio.Event()
                self.waiting_until = -float("inf")  # the loop itself: it re-reads the deadline
                self._apply(self.core.tick(trio.current_time()))

    def _view(self) -> None:
        cluster = self.s.cluster
        if cluster.terminated.is_set():
            self._apply(self.core.terminate())
            return
        oldest = cluster.oldest(self.role)
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
        if self.core.next_deadline() < self.waiting_until:
            self.wakeup.set()  # a retry is due sooner than the timer loop is sleeping

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


class SingletonProxy:
    """Sends to a singleton wherever it runs. Get one from ``node.singletons.proxy(name)``.

    Example:
        >>> async def count(node: Node) -> int:
        ...     counter = node.singletons.proxy("counter")
        ...     await counter.tell("increment")
        ...     return await counter.ask("get", timeout=5)
    """

    def __init__(self, singletons: Singletons, name: str, role: str | None, buffer_size: int):
        self._s = singletons
        self.name = name
        self.role = role
        self._buffer: collections.deque[tuple[object, int]] = collections.deque()
        self._buffer_size = buffer_size
        self._wakeup = trio.Event()
        self._back_off = False
        self._idle = False
        """The proxy's task waits for messages: one may go at once instead (see _enqueue)."""
        self.statistics_sent = 0
        self.statistics_returned = 0

    def _target(self) -> UniqueAddress | None:
        """Where the singleton runs now, as far as this node knows; None if nowhere yet."""
        target = self._s.cluster.oldest(self.role)
        if target is None or (
            target.node == self._s.cluster.self_address and self.name not in self._s._managers
        ):
            return None  # nobody eligible, or this node is the oldest and does not run it
        return target.node

    def _send(self, target: UniqueAddress, payload: object, request_id: int) -> None:
        self.statistics_sent += 1
        self._s._send(
            target, SingletonEnvelope(name=self.name, payload=payload, request_id=request_id)
        )

    def _enqueue(self, payload: object, request_id: int, *, front: bool = False) -> None:
        if self._idle and not front and not self._buffer and not self._back_off:
            # Nothing waits before it and no pause is on: send now, in the caller's task,
            # rather than after a pass through the proxy's task (a new shard's first message
            # waits for its GetShardHome to go). Not to an instance on this node: it would
            # handle the message inside this call (a serving singleton does), and the caller,
            # in the middle of its own work, would find itself called back.
            target = self._target()
            if target is not None and target != self._s.cluster.self_address:
                self._send(target, payload, request_id)
                return
        if len(self._buffer) >= self._buffer_size:
            raise SingletonUnavailable(
                f"proxy of singleton {self.name!r} buffers {self._buffer_size} messages already: "
                "the singleton has been unreachable for a while"
            )
        if front:
            self._buffer.appendleft((payload, request_id))
        else:
            self._buffer.append((payload, request_id))
        self._wakeup.set()

    async def tell(self, payload: object) -> None:
        """Send ``payload`` to the singleton, at most once.

        Raises:
            SerializationError: the message cannot travel.
            SingletonUnavailable: the proxy's buffer is full.
        """
        self._s._check_serializable(payload)
        await trio.lowlevel.checkpoint()
        self._enqueue(payload, 0)

    def tell_nowait(self, payload: object) -> None:
        """:meth:`tell` without the checkpoint, for code that cannot await (a message handler).

        Raises:
            SerializationError: the message cannot travel.
            SingletonUnavailable: the proxy's buffer is full.
        """
        self._s._check_serializable(payload)
        self._enqueue(payload, 0)

    async def ask(self, payload: object, *, timeout: float) -> object:  # noqa: ASYNC109 - the API
        """Send ``payload`` and wait for the singleton's reply.

        Raises:
            SingletonUnavailable: no answer within ``timeout`` seconds (it may still have been
                processed), or the buffer is full.
            ClusterError: the singleton raised an error while answering.
        """
        self._s._check_serializable(payload)
        rid, slot = self._s._new_request()
        try:
            self._enqueue(payload, rid)
            with trio.move_on_after(timeout):
                await slot.done.wait()
            if not slot.done.is_set():
                raise SingletonUnavailable(
                    f"singleton {self.name!r} did not answer within {timeout:g} s"
                )
            if slot.error is not None:
                raise ClusterError(f"singleton {self.name!r} failed: {slot.error}")
            return slot.value
        finally:
            self._s._forget_request(rid)

    def _returned(self, payload: object, request_id: int) -> None:
        self.statistics_returned += 1
        self._back_off = True
        self._enqueue(payload, request_id, front=True)

    async def _run(self) -> None:
        while True:
            self._idle = True
            try:
                await self._wakeup.wait()
            finally:
                self._idle = False
            if self._back_off:  # messages came back: let the cluster view move on first
                self._back_off = False
                await trio.sleep(0.1)
            self._wakeup = trio.Event()
            target = self._target()
            if target is None:
                # Nobody eligible yet, or this node is the oldest and does not run it (so
                # nobody does): wait for the cluster to change.
                await trio.sleep(0.2)
                self._wakeup.set()
                continue
            # What is queued now: a message that comes back at once (this node is the oldest
            # but does not run the singleton) waits for the next round, after the pause.
            batch = list(self._buffer)
            self._buffer.clear()
            for payload, rid in batch:
                self._send(target, payload, rid)


@attrs.define
class _Pending:
    done: trio.Event = attrs.field(factory=trio.Event)
    value: object = None
    error: str | None = None


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
        self._requests: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
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
        """Run ``fn`` as the singleton ``name`` whenever this node is the oldest (of ``role``).

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
            proxy = SingletonProxy(self, name, role, buffer_size)
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

    def _new_request(self) -> tuple[int, _Pending]:
        rid = next(self._ids)
        pending = _Pending()
        self._requests[rid] = pending
        return rid, pending

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
            pending = self._requests.get(msg.request_id)
            if pending is not None and not pending.done.is_set():
                pending.value, pending.error = msg.payload, msg.error
                pending.done.set()
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
