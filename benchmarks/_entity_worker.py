"""One window of event-sourced commands with frequent snapshots, in a process of its own.

``benchmarks.persistence`` runs this file (not as a module: by its path, with ``PYTHONPATH``
naming the source tree to measure) so that the same load can be measured against the current
code and a checkout of an earlier release, alternately, in one benchmark run::

    PYTHONPATH=TREE python benchmarks/_entity_worker.py sqlite PATH ENTITIES WINDOW EVERY

It drives ``ENTITIES`` event-sourced entities directly (no cluster: the entity side alone), each
in a closed loop of commands that persist one 100-byte event, for ``WINDOW`` seconds, with a
snapshot of a 1 KiB state every ``EVERY`` events (``none``: never), and prints one JSON object:
commands completed per second. It imports only the public API and the standard library, so
that it runs against either tree.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any

import trio

from p2pshard import (
    EntityContext,
    EntityId,
    EventSourcedEntity,
    Journal,
    PostgresJournal,
    ShardId,
    SqliteJournal,
)

EVENT = "e" * 100
PAD = b"s" * 1024


class _Owner:
    """The shard of an entity driven without a cluster."""

    def __init__(self, token: int) -> None:
        self.lease_token = token
        self.shard_id = ShardId("0")
        self.type_name = "Bench"
        self.sender: Any = None

    def passivate(self, context: EntityContext, stop_message: object = None) -> None:
        pass


def _entity_class(every: int | None) -> type[EventSourcedEntity[dict[str, Any]]]:
    class Counter(EventSourcedEntity[dict[str, Any]]):
        snapshot_every = every

        def empty_state(self) -> dict[str, Any]:
            return {"n": 0, "pad": PAD}

        def apply_event(self, state: dict[str, Any], event: Any) -> dict[str, Any]:
            return {"n": state["n"] + 1, "pad": state["pad"]}

        async def handle_command(self, command: Any, ctx: EntityContext) -> object:
            await self.persist(EVENT)
            return self.state["n"]

    return Counter


async def window(journal: Journal, entities: int, seconds: float, every: int | None) -> float:
    await journal.recover("Bench|warm", None)  # connections and tables
    cls = _entity_class(every)
    run = time.monotonic_ns()
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        ctx = EntityContext(EntityId(f"{run}-{i}"), _Owner(1), 0.0)
        entity = cls(ctx, journal)
        for _ in itertools.count():
            await entity.receive("go", ctx)
            done += 1

    start = time.perf_counter()
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for i in range(entities):
                nursery.start_soon(loop, i)
    rate = done / (time.perf_counter() - start)
    with trio.CancelScope(shield=True):
        await journal.aclose()
    return rate


def main(argv: list[str]) -> int:
    backend, where, entities, seconds, every = argv
    journal: Journal = SqliteJournal(where) if backend == "sqlite" else PostgresJournal(where)
    rate = trio.run(
        window, journal, int(entities), float(seconds), None if every == "none" else int(every)
    )
    print(json.dumps({"commands_per_s": rate}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
