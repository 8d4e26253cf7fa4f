"""The trio shell of a singleton proxy: feeds :class:`SingletonProxyCore`, carries out its effects.

The decisions (where to send, when to buffer, pause or give up, when an ask is over) are the
core's; this shell reads the clock, sends envelopes, wakes the asker when its ask is answered or
over, and runs one :class:`CoreTimer` loop for the core's deadlines.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from .._cluster import Cluster
from .._timer import CoreTimer
from ..transport._address import UniqueAddress
from ..transport._errors import ClusterError
from ._messages import SingletonEnvelope
from ._proxy_core import (
    AskAnswered,
    AskTimedOut,
    ProxyEffect,
    SendToSingleton,
    SingletonProxyCore,
    SingletonUnavailable,
)


@attrs.frozen(kw_only=True)
class ProxyServices:
    """What a proxy needs of its node's singletons (``Singletons`` passes them in)."""

    cluster: Cluster
    send: Callable[[UniqueAddress, object], None]
    """Send a message to a node; never blocks, drops it if it cannot go."""
    check_serializable: Callable[[object], None]
    """Raise ``SerializationError`` for a payload that cannot travel."""
    runs_here: Callable[[str], bool]
    """Whether the singleton of this name is started on this node."""
    new_request: Callable[[SingletonProxy], int]
    """A fresh request id; its replies are handed to this proxy's ``_replied``."""
    forget_request: Callable[[int], None]
    """Stop handing replies to this request id to the proxy."""


@attrs.define(eq=False)
class _Ask:
    done: trio.Event = attrs.field(factory=trio.Event)
    value: object = None
    error: str | None = None
    timed_out: bool = False


class SingletonProxy:
    """Sends to a singleton wherever it runs. Get one from ``node.singletons.proxy(name)``.

    Example:
        >>> async def count(node: Node) -> int:
        ...     counter = node.singletons.proxy("counter")
        ...     await counter.tell("increment")
        ...     return await counter.ask("get", timeout=5)
    """

    def __init__(self, services: ProxyServices, name: str, role: str | None, buffer_size: int):
        self._services = services
        self._self_node = services.cluster.self_address
        self.name = name
        self.role = role
        self._core = SingletonProxyCore(
            name, self._self_node, self._target, buffer_size=buffer_size
        )
        self._timer = CoreTimer(self._core.next_deadline)
        self._asks: dict[int, _Ask] = {}

    @property
    def statistics_sent(self) -> int:
        """Messages sent to the singleton so far (resends included)."""
        return self._core.sent

    @property
    def statistics_returned(self) -> int:
        """Messages that came back so far (the singleton did not run where they went)."""
        return self._core.returned

    @property
    def _buffer(self) -> tuple[tuple[object, int], ...]:
        """What waits to be sent, as (payload, request id)."""
        return self._core.buffered

    def _target(self) -> UniqueAddress | None:
        """Where the singleton runs now, as far as this node knows; None if nowhere yet."""
        target = self._services.cluster.singleton_host(self.role)
        if target is None or (
            target.node == self._self_node and not self._services.runs_here(self.name)
        ):
            return None  # nobody eligible, or this node is the oldest and does not run it
        return target.node

    async def tell(self, payload: object) -> None:
        """Send ``payload`` to the singleton, at most once.

        Raises:
            SerializationError: the message cannot travel.
            SingletonUnavailable: the proxy's buffer is full.
        """
        self._services.check_serializable(payload)
        await trio.lowlevel.checkpoint()
        self._feed(self._core.tell(payload, trio.current_time()))

    def tell_nowait(self, payload: object) -> None:
        """:meth:`tell` without the checkpoint, for code that cannot await (a message handler).

        Raises:
            SerializationError: the message cannot travel.
            SingletonUnavailable: the proxy's buffer is full.
        """
        self._services.check_serializable(payload)
        self._feed(self._core.tell(payload, trio.current_time()))

    async def ask(self, payload: object, *, timeout: float) -> object:  # noqa: ASYNC109 - the API
        """Send ``payload`` and wait for the singleton's reply.

        Raises:
            SingletonUnavailable: no answer within ``timeout`` seconds (it may still have been
                processed), or the buffer is full.
            ClusterError: the singleton raised an error while answering.
            ValueError: ``timeout`` is negative or NaN.
        """
        self._services.check_serializable(payload)
        rid = self._services.new_request(self)
        ask = self._asks[rid] = _Ask()
        try:
            now = trio.current_time()
            self._feed(self._core.ask(payload, rid, timeout, now))
            # The core ends the ask at its deadline (AskTimedOut); the asker's own deadline, the
            # same one, is for a proxy whose timer loop ended with its node.
            with trio.move_on_at(now + timeout):
                await ask.done.wait()
            if ask.timed_out or not ask.done.is_set():
                raise SingletonUnavailable(
                    f"singleton {self.name!r} did not answer within {timeout:g} s"
                )
            if ask.error is not None:
                raise ClusterError(f"singleton {self.name!r} failed: {ask.error}")
            return ask.value
        finally:
            del self._asks[rid]
            self._services.forget_request(rid)
            self._core.abandon(rid, trio.current_time())

    # ---- from the node's singletons ----

    def _returned(self, payload: object, request_id: int) -> None:
        """A message came back (``SingletonNotHere``): send it again, first.

        Raises:
            SingletonUnavailable: the buffer is full; the message is dropped.
        """
        self._feed(self._core.not_here(payload, request_id, trio.current_time()))

    def _replied(self, request_id: int, payload: object, error: str | None) -> None:
        self._feed(self._core.replied(request_id, payload, error, trio.current_time()))

    async def _run(self) -> None:
        while True:
            now = await self._timer.wait()
            self._apply(self._core.tick(now))

    # ---- effects ----

    def _feed(self, effects: list[ProxyEffect]) -> None:
        if effects:
            self._apply(effects)
        self._timer.poke()

    def _apply(self, effects: list[ProxyEffect]) -> None:
        for effect in effects:
            match effect:
                case SendToSingleton(to=to, payload=payload, request_id=request_id):
                    self._services.send(
                        to,
                        SingletonEnvelope(name=self.name, payload=payload, request_id=request_id),
                    )
                case AskAnswered(request_id=request_id, payload=payload, error=error):
                    ask = self._asks.get(request_id)
                    if ask is not None:
                        ask.value, ask.error = payload, error
                        ask.done.set()
                case AskTimedOut(request_id=request_id):
                    ask = self._asks.get(request_id)
                    if ask is not None:
                        ask.timed_out = True
                        ask.done.set()
