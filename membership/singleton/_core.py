"""Cluster singleton hand-over, sans-IO: Akka's ``ClusterSingletonManager`` state machine.

Theory of operation: every node that may host a singleton runs one manager per singleton name.
The singleton runs on the oldest Up or Leaving member (of the role). When that changes, the
managers hand it over so that at most one instance runs at any moment::

    YOUNGER ──I am oldest, nobody before me──────────────────────────► OLDEST (running)
       │                                                                   │
       └─I am oldest, P was──► BECOMING_OLDEST ──HandOverDone from P,──────┘
                               (HandOverToMe to P,  or P removed)
                                every retry interval)

    OLDEST ──HandOverToMe from S──► HANDING_OVER ──instance stopped──► WAS_OLDEST
      │      (HandOverInProgress to S)         (HandOverDone to S)
      └──no longer oldest, successor S known: TakeOverFromMe to S (retried), S asks HandOverToMe

A new oldest starts the instance only after the previous oldest said HandOverDone, or after the
previous oldest was removed from the cluster (a removed member was downed or has left, and a
downed node stops its services before anyone removes it), never on a timeout alone: Akka takes
over after ``max-hand-over-retries``, which can run two instances while the previous oldest is
alive but slow; here the split brain resolver must down it first. A terminated node (downed or
removed) stops its instance at once.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Collection

import attrs

from ..transport._address import UniqueAddress
from ..transport._wire import message

logger = logging.getLogger("membership.singleton")


class SingletonState(enum.Enum):
    """Where this node's manager is in the hand-over protocol."""

    YOUNGER = "younger"
    BECOMING_OLDEST = "becoming_oldest"
    OLDEST = "oldest"
    HANDING_OVER = "handing_over"
    WAS_OLDEST = "was_oldest"
    STOPPED = "stopped"


@message(name="p2pshard.singleton.HandOverToMe")
@attrs.frozen(kw_only=True)
class HandOverToMe:
    """From the new oldest to the previous one: stop your instance and tell me when done."""

    name: str


@message(name="p2pshard.singleton.HandOverInProgress")
@attrs.frozen(kw_only=True)
class HandOverInProgress:
    """The previous oldest is stopping its instance."""

    name: str


@message(name="p2pshard.singleton.HandOverDone")
@attrs.frozen(kw_only=True)
class HandOverDone:
    """The previous oldest's instance has stopped: the new oldest may start."""

    name: str


@message(name="p2pshard.singleton.TakeOverFromMe")
@attrs.frozen(kw_only=True)
class TakeOverFromMe:
    """From the previous oldest to its successor: ask me to hand over."""

    name: str


HAND_OVER_MESSAGES = (HandOverToMe, HandOverInProgress, HandOverDone, TakeOverFromMe)


@attrs.frozen
class SendTo:
    """Send ``message`` to ``to``."""

    to: UniqueAddress
    message: object


@attrs.frozen
class StartInstance:
    """Start the singleton instance on this node."""


@attrs.frozen
class StopInstance:
    """Stop the instance; report with :meth:`SingletonManagerCore.instance_stopped`."""


SingletonEffect = SendTo | StartInstance | StopInstance


@attrs.define(eq=False)
class SingletonManagerCore:
    """The hand-over protocol of one singleton on one node (see the module docstring)."""

    name: str
    self_node: UniqueAddress
    retry_interval: float = 1.0
    state: SingletonState = SingletonState.YOUNGER
    previous_oldest: UniqueAddress | None = None
    """The last other node we saw as oldest: the one to take over from."""
    _oldest: UniqueAddress | None = None
    _members: frozenset[UniqueAddress] = frozenset()
    _hand_over_to: UniqueAddress | None = None
    _successor: UniqueAddress | None = None
    _next_retry: float = float("inf")
    _seen_any: bool = False

    def next_deadline(self) -> float:
        """When :meth:`tick` has a retry to send."""
        return self._next_retry

    def update(
        self, oldest: UniqueAddress | None, members: Collection[UniqueAddress], now: float
    ) -> list[SingletonEffect]:
        """A new cluster view: the oldest eligible member and every current member."""
        members = frozenset(members)
        previous_view = self._oldest
        self._members = members
        self._oldest = oldest
        effects: list[SingletonEffect] = []
        if oldest is not None and oldest != self.self_node:
            self.previous_oldest = oldest
        elif oldest == self.self_node and previous_view not in (None, self.self_node):
            self.previous_oldest = previous_view
        first_view = not self._seen_any
        self._seen_any = True
        match self.state:
            case SingletonState.YOUNGER:
                if oldest == self.self_node:
                    previous = self.previous_oldest
                    if previous is None or previous not in members or first_view:
                        effects += self._start()
                    else:
                        effects += self._become_oldest(now)
            case SingletonState.BECOMING_OLDEST:
                if self.previous_oldest is None or self.previous_oldest not in members:
                    logger.info(
                        "%s: previous oldest of singleton %r was removed: taking over",
                        self.self_node,
                        self.name,
                    )
                    effects += self._start()
            case SingletonState.OLDEST:
                if oldest is not None and oldest != self.self_node:
                    if oldest != self._successor:
                        self._successor = oldest
                        effects += self._take_over_from_me(now)
                elif self._successor is not None:
                    self._successor = None  # we are the oldest again: nobody to nag
                    self._next_retry = float("inf")
            case _:
                pass
        return effects

    def receive(self, sender: UniqueAddress, message: object, now: float) -> list[SingletonEffect]:
        """A hand-over message from ``sender``."""
        match message:
            case HandOverToMe():
                if self.state in (SingletonState.OLDEST, SingletonState.HANDING_OVER):
                    self._hand_over_to = sender
                    self._next_retry = float("inf")
                    if self.state is SingletonState.OLDEST:
                        logger.info(
                            "%s: handing singleton %r over to %s", self.self_node, self.name, sender
                        )
                        self.state = SingletonState.HANDING_OVER
                        return [SendTo(sender, HandOverInProgress(name=self.name)), StopInstance()]
                    return [SendTo(sender, HandOverInProgress(name=self.name))]
                if self.state in (
                    SingletonState.WAS_OLDEST,
                    SingletonState.STOPPED,
                    SingletonState.YOUNGER,
                ):
                    # Nothing runs here (any more): the requester may go ahead.
                    return [SendTo(sender, HandOverDone(name=self.name))]
                return []
            case HandOverDone():
                if self.state is SingletonState.BECOMING_OLDEST and sender == self.previous_oldest:
                    return self._start()
                return []
            case HandOverInProgress():
                return []
            case TakeOverFromMe():
                if self.state in (SingletonState.YOUNGER, SingletonState.BECOMING_OLDEST):
                    self.previous_oldest = sender
                    if self.state is SingletonState.YOUNGER:
                        self.state = SingletonState.BECOMING_OLDEST
                    self._next_retry = now + self.retry_interval
                    return [SendTo(sender, HandOverToMe(name=self.name))]
                return []
        return []

    def tick(self, now: float) -> list[SingletonEffect]:
        """Resend what is due."""
        if now < self._next_retry:
            return []
        self._next_retry = now + self.retry_interval
        if self.state is SingletonState.BECOMING_OLDEST and self.previous_oldest is not None:
            return [SendTo(self.previous_oldest, HandOverToMe(name=self.name))]
        if self.state is SingletonState.OLDEST and self._successor is not None:
            return [SendTo(self._successor, TakeOverFromMe(name=self.name))]
        self._next_retry = float("inf")
        return []

    def instance_stopped(self, now: float) -> list[SingletonEffect]:
        """The instance has stopped (after :class:`StopInstance`)."""
        if self.state is SingletonState.HANDING_OVER:
            self.state = SingletonState.WAS_OLDEST
            assert self._hand_over_to is not None
            logger.info(
                "%s: singleton %r handed over to %s", self.self_node, self.name, self._hand_over_to
            )
            return [SendTo(self._hand_over_to, HandOverDone(name=self.name))]
        return []

    def terminate(self) -> list[SingletonEffect]:
        """This node is out of the cluster: stop at once, never start again."""
        was_running = self.state in (SingletonState.OLDEST, SingletonState.HANDING_OVER)
        self.state = SingletonState.STOPPED
        self._next_retry = float("inf")
        return [StopInstance()] if was_running else []

    @property
    def takes_messages(self) -> bool:
        """Whether messages for the singleton belong here: running, or about to start (buffer).

        Anywhere else they go back to the sender's proxy to be routed again.
        """
        return self.state in (SingletonState.BECOMING_OLDEST, SingletonState.OLDEST)

    @property
    def running(self) -> bool:
        """Whether this node should have the instance running (or stopping)."""
        return self.state in (SingletonState.OLDEST, SingletonState.HANDING_OVER)

    def _start(self) -> list[SingletonEffect]:
        logger.info("%s: starting singleton %r", self.self_node, self.name)
        self.state = SingletonState.OLDEST
        self._next_retry = float("inf")
        if self._oldest is not None and self._oldest != self.self_node:
            self._successor = self._oldest
        return [StartInstance()]

    def _become_oldest(self, now: float) -> list[SingletonEffect]:
        assert self.previous_oldest is not None
        logger.info(
            "%s: singleton %r: asking %s to hand over",
            self.self_node,
            self.name,
            self.previous_oldest,
        )
        self.state = SingletonState.BECOMING_OLDEST
        self._next_retry = now + self.retry_interval
        return [SendTo(self.previous_oldest, HandOverToMe(name=self.name))]

    def _take_over_from_me(self, now: float) -> list[SingletonEffect]:
        assert self._successor is not None
        self._next_retry = now + self.retry_interval
        return [SendTo(self._successor, TakeOverFromMe(name=self.name))]
