"""Where a singleton proxy sends, when it waits, and when an ask is over. Sans-IO.

Theory of operation (Akka's ``ClusterSingletonProxy``): a proxy sends each message to the node
it believes runs the singleton, the oldest member (of the role) in this node's view. While it
knows of none it buffers, up to a limit; a full buffer refuses more (:class:`SingletonUnavailable`)
rather than grow without bound. A node that does not run the singleton sends the message back
(``SingletonNotHere``): it goes to the front of the buffer and the proxy pauses briefly before
routing again, so that the cluster view can move on (the oldest may be changing). Delivery is at
most once; an ask that gets no answer in time is over, and a late answer is dropped.

The core has two states, waiting and paused::

    WAITING ──message queued, nothing came back──────────► route: send the buffer, WAITING
       │   ──message queued, something came back────────► PAUSED (RESEND_PAUSE)
       │                                                        │ over: route
       └──route finds no singleton anywhere──► PAUSED (LOCATE_INTERVAL) ──over: as if queued

A queued message makes a route due at once: the shell ticks as soon as its loop runs. "Route"
sends everything buffered, in order, to the node ``locate`` names then. While the core waits
(not paused) with nothing buffered and nothing came back, a message goes at once, in the
caller's call (a new shard's first ``GetShardHome`` leaves without a pass through the proxy's
task), except to this node itself: a singleton serving here would handle it inside the caller's
call.

Where the singleton runs is not an input: the core reads it through ``locate`` (the shell's
current cluster view) each time it routes, which is as often as Akka's proxy looks at its
membership and no more, so that a busy proxy does not compute the oldest member per message.
The core polls ``locate`` every ``LOCATE_INTERVAL`` while it finds nobody, which is how it
notices a singleton appear. Each input takes ``now`` and returns effects; :meth:`tick` and
:meth:`next_deadline` follow the contract of ``membership._timer``.
"""

from __future__ import annotations

import collections
import enum
import heapq
import math
from collections.abc import Callable

import attrs

from ..transport._address import UniqueAddress
from ..transport._errors import ClusterError

NEVER = float("inf")

RESEND_PAUSE = 0.1
"""Seconds the proxy waits before it routes again after a message came back."""

LOCATE_INTERVAL = 0.2
"""Seconds between two looks for the singleton while no node is known to run it."""


class SingletonUnavailable(ClusterError):
    """An ``ask`` to a singleton got no answer in time, or the proxy's buffer is full."""


@attrs.frozen
class SendToSingleton:
    """Send ``payload`` (with ``request_id``, 0 for a tell) to the singleton on ``to``."""

    to: UniqueAddress
    payload: object
    request_id: int


@attrs.frozen
class AskAnswered:
    """The ask ``request_id`` got its answer (``error`` set if the singleton failed)."""

    request_id: int
    payload: object
    error: str | None


@attrs.frozen
class AskTimedOut:
    """The ask ``request_id`` got no answer in time: it is over."""

    request_id: int


ProxyEffect = SendToSingleton | AskAnswered | AskTimedOut


class _Pause(enum.Enum):
    RESEND = "resend"
    """Something came back: route again after RESEND_PAUSE."""
    LOCATE = "locate"
    """No singleton anywhere: look again after LOCATE_INTERVAL."""


class SingletonProxyCore:
    """The routing, buffering and ask timeouts of one singleton proxy (see the module docstring).

    Args:
        name: The singleton's name (for error messages).
        self_node: This node: the core never sends to it at once, only from :meth:`tick`.
        locate: Where the singleton runs as far as this node knows, or None if nowhere yet.
        buffer_size: How many messages the core keeps while it cannot send them.
    """

    def __init__(
        self,
        name: str,
        self_node: UniqueAddress,
        locate: Callable[[], UniqueAddress | None],
        *,
        buffer_size: int,
    ) -> None:
        self.name = name
        self.self_node = self_node
        self._locate = locate
        self.buffer_size = buffer_size
        self._buffer: collections.deque[tuple[object, int]] = collections.deque()
        self._route_due = False
        """A message was queued since the last routing: route at the next tick."""
        self._route_due_at = NEVER
        self._back_off = False
        """A message came back since the last resend pause: pause before routing again."""
        self._pause: _Pause | None = None
        self._resume_at = NEVER
        self._asks: dict[int, float] = {}
        """Each pending ask's deadline."""
        self._ask_deadlines: list[tuple[float, int]] = []
        """A heap of (deadline, request id); its head is always a pending ask."""
        self.sent = 0
        """Messages sent to a singleton so far (resends included)."""
        self.returned = 0
        """Messages that came back so far (the singleton did not run where they went)."""

    @property
    def buffered(self) -> tuple[tuple[object, int], ...]:
        """The messages waiting to be sent, in order, as (payload, request id)."""
        return tuple(self._buffer)

    @property
    def paused(self) -> bool:
        """Whether the core waits out a pause before it routes again."""
        return self._pause is not None

    @property
    def pending_asks(self) -> frozenset[int]:
        """The request ids of the asks still waiting for an answer."""
        return frozenset(self._asks)

    def next_deadline(self) -> float:
        """When :meth:`tick` has something to do (``inf``: at the next input only)."""
        if self._pause is not None:
            deadline = self._resume_at
        else:
            deadline = self._route_due_at if self._route_due else NEVER
        if self._ask_deadlines:
            return min(deadline, self._ask_deadlines[0][0])
        return deadline

    # ---- inputs ----

    def tell(self, payload: object, now: float) -> list[ProxyEffect]:
        """Send ``payload`` to the singleton, at most once.

        Raises:
            SingletonUnavailable: the buffer is full (nothing changed).
        """
        return self._enqueue(payload, 0, now)

    def ask(
        self, payload: object, request_id: int, timeout: float, now: float
    ) -> list[ProxyEffect]:
        """Send ``payload`` as the ask ``request_id``, over after ``timeout`` seconds.

        Raises:
            ValueError: ``timeout`` is negative or NaN, or ``request_id`` is not positive or
                is pending already (nothing changed).
            SingletonUnavailable: the buffer is full (nothing changed).
        """
        if math.isnan(timeout):
            raise ValueError(f"ask timeout must be a number of seconds, not {timeout!r}")
        if timeout < 0:
            raise ValueError(f"ask timeout must be 0 seconds or more, not {timeout!r}")
        if request_id <= 0 or request_id in self._asks:
            raise ValueError(
                f"request id {request_id!r} must be positive and not in use by a pending ask"
            )
        effects = self._enqueue(payload, request_id, now)
        deadline = now + timeout
        self._asks[request_id] = deadline
        heapq.heappush(self._ask_deadlines, (deadline, request_id))
        return effects

    def not_here(self, payload: object, request_id: int, now: float) -> list[ProxyEffect]:
        """A message came back: the singleton did not run where it went. It is sent again first.

        Raises:
            SingletonUnavailable: the buffer is full; the message is dropped.
        """
        self.returned += 1
        self._back_off = True
        return self._enqueue(payload, request_id, now, front=True)

    def replied(
        self, request_id: int, payload: object, error: str | None, now: float
    ) -> list[ProxyEffect]:
        """The singleton answered the ask ``request_id``; dropped unless that ask is pending."""
        if self._asks.pop(request_id, None) is None:
            return []
        self._drop_finished_deadlines()
        return [AskAnswered(request_id, payload, error)]

    def abandon(self, request_id: int, now: float) -> list[ProxyEffect]:
        """The asker of ``request_id`` waits no more (cancelled): forget its deadline."""
        if self._asks.pop(request_id, None) is not None:
            self._drop_finished_deadlines()
        return []

    def tick(self, now: float) -> list[ProxyEffect]:
        """Time passed: end the asks that are overdue, and route what is due."""
        effects: list[ProxyEffect] = []
        while self._ask_deadlines and self._ask_deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._ask_deadlines)
            del self._asks[request_id]
            effects.append(AskTimedOut(request_id))
            self._drop_finished_deadlines()
        if self._pause is not None and now >= self._resume_at:
            pause, self._pause, self._resume_at = self._pause, None, NEVER
            if pause is _Pause.RESEND:
                effects += self._route(now)
            else:
                # Look again at the next tick, due at once, as if a message had come: the
                # shell's loop goes round once first, and meanwhile a message may go at once.
                self._route_due, self._route_due_at = True, now
                return effects
        if self._pause is None and self._route_due:
            if self._back_off:
                self._back_off = False
                self._pause_for(_Pause.RESEND, now + RESEND_PAUSE)
            else:
                effects += self._route(now)
        return effects

    # ---- internals ----

    def _enqueue(
        self, payload: object, request_id: int, now: float, *, front: bool = False
    ) -> list[ProxyEffect]:
        if not front and self._pause is None and not self._buffer and not self._back_off:
            target = self._locate()
            if target is not None and target != self.self_node:
                self.sent += 1
                return [SendToSingleton(target, payload, request_id)]
        if len(self._buffer) >= self.buffer_size:
            raise SingletonUnavailable(
                f"proxy of singleton {self.name!r} buffers {self.buffer_size} messages already: "
                "the singleton has been unreachable for a while"
            )
        if front:
            self._buffer.appendleft((payload, request_id))
        else:
            self._buffer.append((payload, request_id))
        self._request_route(now)
        return []

    def _request_route(self, now: float) -> None:
        if not self._route_due:
            self._route_due = True
            self._route_due_at = now

    def _pause_for(self, pause: _Pause, until: float) -> None:
        self._pause = pause
        self._resume_at = until

    def _route(self, now: float) -> list[ProxyEffect]:
        self._route_due = False
        self._route_due_at = NEVER
        target = self._locate()
        if target is None:
            # Nobody eligible yet, or this node is the oldest and does not run it (so nobody
            # does): look again later.
            self._pause_for(_Pause.LOCATE, now + LOCATE_INTERVAL)
            return []
        # What is queued now; a message that comes back at once (this node is the oldest but
        # does not run the singleton) waits for the next round, after the pause.
        batch = list(self._buffer)
        self._buffer.clear()
        self.sent += len(batch)
        return [SendToSingleton(target, payload, request_id) for payload, request_id in batch]

    def _drop_finished_deadlines(self) -> None:
        heap = self._ask_deadlines
        while heap and self._asks.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
