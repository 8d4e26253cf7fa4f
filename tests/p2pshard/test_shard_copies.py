"""The entity worker's hot-path copy of ``Shard._run``'s common case.

``EntityWorkers._worker`` handles a running entity with one message waiting, in a shard with no
lease, itself instead of awaiting ``Shard._run``. The randomized test runs the same script of
tells and asks (an entity that raises, one that passivates itself, idle gaps and bursts) twice on
a live one-node cluster: once as is, where most turns take the copy, and once with every turn
forced through ``Shard._run`` (the shard holds a lease token, and no lease to check). Both runs
must give the same replies and errors, in order, the same incarnations handling the same
messages in the same order, and the same entity states. The seed is printed, and
``SHARD_COPIES_SEED=<seed>`` replays it.
"""

from __future__ import annotations

import os
import random

import attrs
import trio
import trio.testing

from p2pshard.sharding._entity import EntityContext
from tests._support.sharding_sim import (
    CounterAdd,
    CounterRead,
    Fail,
    PassivateMe,
    sim_cluster,
    standard_setup,
)

ENTITIES = ("a", "b", "c")
STEPS = 120
TIMEOUT = 60.0  # virtual seconds: longer than entity_restart_backoff


@attrs.frozen
class Step:
    kind: str  # "tell", "ask", "settle" (a moment) or "drain" (restarts due, mailboxes empty)
    entity_id: str = ""
    message: object = None


def script(rng: random.Random) -> list[Step]:
    """Random tells, asks and settles, with a raising and a passivating message of each kind."""
    steps: list[Step] = []
    seq = 0

    def random_message() -> object:
        nonlocal seq
        roll = rng.random()
        if roll < 0.08:
            return Fail(text=f"boom {len(steps)}")
        if roll < 0.14:
            return PassivateMe()
        if roll < 0.3:
            return CounterRead()
        seq += 1
        return CounterAdd(sender="t", seq=seq)

    for _ in range(STEPS):
        roll = rng.random()
        if roll < 0.25:
            steps.append(Step("settle"))
        else:
            kind = "ask" if roll < 0.6 else "tell"
            steps.append(Step(kind, rng.choice(ENTITIES), random_message()))
    for kind in ("tell", "ask"):  # each at least once, wherever it falls
        for message in (Fail(text=f"{kind} boom"), PassivateMe()):
            steps.insert(rng.randrange(len(steps) + 1), Step(kind, rng.choice(ENTITIES), message))
    # And whatever the random part did, once each on the copy's own ground (an entity with an
    # instance, nothing else waiting): an ask that raises, an ask, a passivation.
    entity = rng.choice(ENTITIES)
    steps += [
        Step("drain"),
        Step("ask", entity, CounterRead()),  # its instance exists after this
        Step("ask", entity, Fail(text="alone boom")),
        Step("drain"),
        Step("ask", entity, CounterRead()),
        Step("ask", entity, CounterAdd(sender="t", seq=seq + 1)),
        Step("tell", entity, PassivateMe()),
        Step("settle"),
        Step("ask", entity, CounterRead()),
    ]
    return steps


@attrs.frozen
class Outcome:
    replies: list[tuple[int, object]]
    handled: dict[str, list[list[tuple[str, int]]]]
    states: dict[str, tuple[str, bool, int, int]]
    runs: int


def entity_state(context: EntityContext) -> tuple[str, bool, int, int]:
    return (
        context._state.name,
        context._instance is not None,
        len(context._mailbox or ()),
        len(context._held or ()),
    )


async def run(seed: int, steps: list[Step], *, through_run: bool) -> Outcome:
    async with sim_cluster(seed % 1000, standard_setup(number_of_shards=1)) as sim:
        await sim.start_up([1])
        region = sim.regions[1]
        assert await region.entity_ref("warm-up").ask(CounterRead(), timeout=TIMEOUT) == ("n1", 0)
        (shard,) = region._running.values()
        if through_run:
            shard.lease_token = 1  # Shard._run checks a lease only when it has one: none here
        runs = 0
        run_shard = shard._run

        async def counted(context: EntityContext) -> None:
            nonlocal runs
            runs += 1
            await run_shard(context)

        shard._run = counted  # type: ignore[method-assign]
        replies: list[tuple[int, object]] = []
        for at, step in enumerate(steps):
            if step.kind == "settle":
                await trio.sleep(0.01)
                continue
            if step.kind == "drain":
                await trio.sleep(TIMEOUT)
                continue
            ref = region.entity_ref(step.entity_id)
            if step.kind == "tell":
                await ref.tell(step.message)
                continue
            try:
                replies.append((at, await ref.ask(step.message, timeout=TIMEOUT)))
            except Exception as exc:
                replies.append((at, (type(exc).__qualname__, str(exc))))
        await trio.sleep(TIMEOUT)  # every restart due, every mailbox drained
        journal = sim.journal
        return Outcome(
            replies,
            {e: [inc.handled for inc in journal.of(e)] for e in ENTITIES},
            {e: entity_state(c) for e, c in shard.entities.items() if e in ENTITIES},
            runs,
        )


async def test_the_worker_handles_messages_as_shard_run_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seed = int(os.environ.get("SHARD_COPIES_SEED", random.randrange(2**32)))
    print(f"SHARD_COPIES_SEED={seed}")
    steps = script(random.Random(seed))

    copy = await run(seed, steps, through_run=False)
    original = await run(seed, steps, through_run=True)

    where = f"(seed {seed})"
    # The copy was taken (turns the forced run sent through Shard._run, the plain one did not).
    assert copy.runs < original.runs, f"{where}: the worker's copy never ran"
    assert copy.replies == original.replies, f"{where}: replies or errors differ"
    assert copy.handled == original.handled, f"{where}: incarnations handled differently"
    assert copy.states == original.states, f"{where}: entity states differ"
    errors = [r for _, r in copy.replies if isinstance(r, tuple) and "boom" in str(r)]
    assert errors, f"{where}: no ask saw its entity raise"
    assert any(len(incs) > 1 for incs in copy.handled.values()), f"{where}: no entity restarted"
