"""The fault proxy of the real-process chaos runs: one TCP proxy per ordered pair of nodes.

Nodes dial each other through it (``[transport.dial_via]``), so it can block, slow, reset or
drop a link without root or a packet filter.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct

import attrs
import trio

from membership import Address

HELD_CHUNKS = 64
"""Chunks a proxy holds per direction of a connection (a slow link's latency) before it stops
reading, so TCP flow control slows the sender as a real link would."""


def _reset(stream: trio.SocketStream | None) -> None:
    """Close with a reset (SO_LINGER 0): the peer sees the link break, no TIME_WAIT is left."""
    if stream is None:
        return
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    stream.socket.close()


@attrs.define(eq=False)
class FaultProxy:
    """Forwards TCP connections to ``target``: the link from one node to another, with faults.

    Blocked (:meth:`block`), it forwards nothing more on any connection and accepts new ones
    without forwarding them (as a network that drops every packet). Slow (:meth:`slow`), it
    forwards every chunk ``delay`` seconds after the chunk arrived, in order (a link's latency,
    not its bandwidth). Flaky (:meth:`flaky`), it resets a connection instead of forwarding a
    chunk, now and then, and goes on accepting new ones: TCP never loses bytes inside a
    connection, so a lossy link shows as lost connections. :meth:`heal` ends all three; the
    connections held while blocked are reset, so both ends see the link break and reconnect.

    Example:
        >>> proxy = FaultProxy("node-1->node-2", Address("127.0.0.1", 7355))
        >>> proxy.slow(0.2)  # every chunk 200 ms late
        >>> proxy.heal()
        >>> proxy.delay
        0.0
    """

    name: str
    target: Address
    blocked: bool = False
    delay: float = 0.0
    """Seconds each chunk is held before it is forwarded (0: none)."""
    reset_chance: float = 0.0
    """The chance that a chunk resets its connection instead of being forwarded (0: never)."""
    connections: int = 0
    """Connections accepted so far."""
    resets: int = 0
    """Connections reset by :meth:`flaky` so far."""
    _rng: random.Random = attrs.field(factory=random.Random)
    _pumping: set[trio.CancelScope] = attrs.field(factory=set)
    _healed: trio.Event = attrs.field(factory=trio.Event)

    async def serve(self, *, task_status: trio.TaskStatus[Address]) -> None:
        """Listen on a free port of 127.0.0.1; report that address; forward until cancelled."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._forward, listeners)
            task_status.started(Address("127.0.0.1", port))

    def block(self) -> None:
        """Stop forwarding, on the connections there are and on new ones."""
        if self.blocked:
            return
        self.blocked = True
        self._healed = trio.Event()
        for scope in self._pumping:
            scope.cancel()

    def slow(self, delay: float) -> None:
        """Forward each chunk ``delay`` seconds after it arrived, on every connection.

        Raises:
            ValueError: ``delay`` is negative.
        """
        if not delay >= 0:
            raise ValueError(f"a proxy's delay is seconds, 0 or more, not {delay!r}")
        self.delay = delay

    def flaky(self, chance: float, rng: random.Random) -> None:
        """Reset a connection instead of forwarding a chunk, with ``chance`` for each chunk.

        ``rng`` draws which chunks (give each run's proxies a generator from its seed).

        Raises:
            ValueError: ``chance`` is not between 0 and 1.
        """
        if not 0 <= chance <= 1:
            raise ValueError(f"a proxy's reset chance is between 0 and 1, not {chance!r}")
        self.reset_chance = chance
        self._rng = rng

    def heal(self) -> None:
        """Forward again, without delay or resets; the connections held while blocked are reset."""
        self.blocked = False
        self.delay = 0.0
        self.reset_chance = 0.0
        self._healed.set()

    async def _forward(self, client: trio.SocketStream) -> None:
        self.connections += 1
        upstream: trio.SocketStream | None = None
        pumping = trio.CancelScope()
        try:
            if not self.blocked:
                self._pumping.add(pumping)
                with pumping:
                    with trio.move_on_after(5):
                        upstream = await trio.open_tcp_stream(self.target.host, self.target.port)
                    if upstream is None:
                        return
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                        nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)
                if not pumping.cancel_called:
                    return  # one side closed the connection, or it was reset for flaky
            await self._healed.wait()  # blocked: hold the connection, forward nothing
        except OSError:
            pass  # the target is down (a killed node): the client sees the link break
        finally:
            self._pumping.discard(pumping)
            _reset(client)
            _reset(upstream)

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        """Forward ``src`` to ``dst`` until either breaks or ends; then cancel ``done``.

        A task of its own sends, so that a chunk waits ``delay`` from when it arrived, not
        from when the one before it was sent; a reset for flaky cancels ``done`` at once,
        and what was still on its way is lost with the connection.
        """
        send, receive = trio.open_memory_channel[tuple[float, bytes]](HELD_CHUNKS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliver, receive, dst, done)
            async with send:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await src.receive_some(1 << 16):
                        flaky = self.reset_chance and not done.cancel_called
                        if flaky and self._rng.random() < self.reset_chance:
                            self.resets += 1
                            done.cancel()
                            return
                        await send.send((trio.current_time(), data))

    async def _deliver(
        self,
        receive: trio.MemoryReceiveChannel[tuple[float, bytes]],
        dst: trio.SocketStream,
        done: trio.CancelScope,
    ) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            async with receive:
                async for arrived, data in receive:
                    await trio.sleep_until(arrived + self.delay)
                    await dst.send_all(data)
        done.cancel()
