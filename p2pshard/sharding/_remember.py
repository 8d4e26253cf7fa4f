"""Remember entities: each shard's set of active entity ids, in the replicator.

Theory of operation (Akka's ``remember-entities-store = ddata``). A shard of an entity type with
``remember_entities`` keeps the ids of its active entities in the replicated key
``sharding/<type>/entities/<shard>`` (a pycrdt map, id → True). When the shard starts (at its
first home, after a rebalance, after a crash or a full cluster restart) it reads the set with a
majority read and starts those entities, all at once or a few at a time
(``entity_recovery_strategy``). A new entity is written to the set (a majority write) before it
gets its first message; passivation removes it; a hand-off or shutdown leaves it in, so it
restarts at the shard's next home.

Writes of one shard go out in order, batched: one writer task takes every queued change in one
replicator update, and retries failures with backoff. For a full cluster restart the keys must be
durable: put ``sharding/*`` in the replicator's ``durable_keys``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from pycrdt import Doc, Map

from crdt import ReadMajority, Replicator, WriteMajority

from ._retry import until_done
from ._settings import ShardingSettings

logger = logging.getLogger("p2pshard.remember")


def entities_key(type_name: str, shard_id: str) -> str:
    """The replicator key of one shard's remembered entity ids."""
    return f"sharding/{type_name}/entities/{shard_id}"


class RememberStore:
    """One shard's remembered entity ids: load once, then ordered batched adds and removes."""

    def __init__(
        self,
        replicator: Replicator,
        type_name: str,
        shard_id: str,
        settings: ShardingSettings,
    ) -> None:
        self._replicator = replicator
        self.key = entities_key(type_name, shard_id)
        self._read = ReadMajority(min_cap=settings.majority_min_cap, timeout=settings.state_timeout)
        self._write = WriteMajority(
            min_cap=settings.majority_min_cap, timeout=settings.state_timeout
        )
        self._queue: list[tuple[str, bool, Callable[[], None] | None]] = []
        self._wakeup = trio.Event()
        self._closed = False
        self.writes = 0
        self.failures = 0

    async def load(self) -> list[str]:
        """The remembered ids (sorted), retrying the majority read until it succeeds."""
        doc = await until_done(
            lambda: self._replicator.get(self.key, self._read),
            f"reading {self.key}",
            logger,
            on_failure=self._failed,
        )
        if doc is None:
            return []
        return sorted(map(str, list(doc.get("entities", type=Map).keys())))

    def _failed(self) -> None:
        self.failures += 1

    def add(self, entity_id: str, done: Callable[[], None]) -> None:
        """Remember ``entity_id``; ``done`` runs once a majority has it."""
        self._queue.append((entity_id, True, done))
        self._wakeup.set()

    def remove(self, entity_id: str) -> None:
        """Forget ``entity_id`` (it was passivated)."""
        self._queue.append((entity_id, False, None))
        self._wakeup.set()

    def close(self) -> None:
        """Write what is queued, then let :meth:`run` return."""
        self._closed = True
        self._wakeup.set()

    async def run(self) -> None:
        """Write queued changes, in order, until closed and drained (or cancelled)."""
        while True:
            if self._closed and not self._queue:
                return
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            await until_done(
                partial(self._replicator.update, self.key, _changes(batch), self._write),
                f"remembering {len(batch)} change(s) in {self.key}",
                logger,
                on_failure=self._failed,
            )
            self.writes += 1
            for _, _, done in batch:
                if done is not None:
                    done()


def _changes(
    batch: list[tuple[str, bool, Callable[[], None] | None]],
) -> Callable[[Doc[Any]], None]:
    def modify(doc: Doc[Any]) -> None:
        entities = doc.get("entities", type=Map)
        for entity_id, add, _ in batch:
            if add:
                entities[entity_id] = True
            elif entity_id in entities:
                del entities[entity_id]

    return modify
