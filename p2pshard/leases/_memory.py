"""Leases in this process's memory, on the trio clock: for tests and the simulated cluster.

Every :class:`Lease` of one :class:`MemoryLeaseBackend` shares its table, so the nodes of a
simulated cluster in one ``trio.run`` compete for the same names, and under
``trio.testing.MockClock`` expiry follows the mock clock. Faults for the simulation: an owner cut
off from the backend (:meth:`MemoryLeaseBackend.cut_off`) has its calls hang, as a partition from
a real lease server does; a paused one (:meth:`MemoryLeaseBackend.pause`) has them wait until it
resumes; and ``latency`` delays each request on its way there and its answer on
its way back, so a grant can arrive after part of its time-to-live has passed.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from .._errors import LeaseUnavailable


@attrs.define
class _Row:
    owner: str | None
    token: int
    expires: float


class MemoryLeaseBackend:
    """A lease table in memory. ``latency()`` gives each one-way delay (None: no delay)."""

    def __init__(self, *, latency: Callable[[], float] | None = None) -> None:
        self._rows: dict[str, _Row] = {}
        self._cut_off: set[str] = set()
        self._paused: dict[str, float] = {}
        self._latency = latency
        self._closed = False

    def pause(self, owner: str, until: float) -> None:
        """Hold ``owner``'s calls until ``until`` on the trio clock (a paused process)."""
        self._paused[owner] = until

    def cut_off(self, owner: str, cut: bool = True) -> None:
        """Make ``owner``'s calls hang (``cut``) or reach the backend again."""
        if cut:
            self._cut_off.add(owner)
        else:
            self._cut_off.discard(owner)

    async def _travel(self, owner: str) -> None:
        if self._closed:
            raise LeaseUnavailable("the memory lease backend is closed")
        if self._latency is not None:
            await trio.sleep(self._latency())
        paused = self._paused.get(owner)
        if paused is not None:
            await trio.sleep_until(paused)
        if owner in self._cut_off:
            await trio.sleep_forever()

    async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """See :meth:`p2pshard.LeaseBackend.try_acquire`."""
        await self._travel(owner)
        now = trio.current_time()
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = _Row(None, 0, 0.0)
        if row.owner is not None and row.owner != owner and row.expires > now:
            granted = None
        else:
            row.owner, row.token, row.expires = owner, row.token + 1, now + ttl
            granted = row.token
        await self._travel(owner)
        return granted

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        """See :meth:`p2pshard.LeaseBackend.renew`."""
        await self._travel(owner)
        now = trio.current_time()
        row = self._rows.get(name)
        renewed = row is not None and (row.owner, row.token) == (owner, token) and row.expires > now
        if renewed:
            assert row is not None
            row.expires = now + ttl
        await self._travel(owner)
        return renewed

    async def release(self, name: str, owner: str, token: int) -> bool:
        """See :meth:`p2pshard.LeaseBackend.release`."""
        await self._travel(owner)
        row = self._rows.get(name)
        released = row is not None and (row.owner, row.token) == (owner, token)
        if released:
            assert row is not None
            row.owner, row.expires = None, 0.0
        await self._travel(owner)
        return released

    async def holder(self, name: str) -> tuple[str, int] | None:
        """See :meth:`p2pshard.LeaseBackend.holder`."""
        row = self._rows.get(name)
        if row is None or row.owner is None or row.expires <= trio.current_time():
            return None
        return row.owner, row.token

    async def aclose(self) -> None:
        """Refuse further calls."""
        self._closed = True
