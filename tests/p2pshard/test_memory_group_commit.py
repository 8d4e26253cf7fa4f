"""The memory journal's group commit: batches planned by the SQL journals' own planner.

``MemoryJournal(group_commit=True)`` queues appends while a batch is in flight (its
``commit_latency`` on the mock clock) and lands the next batch through
``p2pshard.persistence._group_commit.plan_batch``, the function the SQL journals use: a fenced
append and an out-of-sequence one fail alone inside a batch whose others are written; an injected
storage failure fails the whole batch and a retry writes each append once; order per stream is
kept; the same seed gives the same batches. A journal whose planner ignores the fence is caught
by ``check_journal_calls`` reading the journal's record of what it accepted.
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from membership import deterministic_scheduling
from p2pshard import JournalConflict, JournalError, JournalFenced, MemoryJournal
from p2pshard.persistence import _group_commit, _memory
from p2pshard.testing import Violation, check_journal_calls


def verdict(journal: MemoryJournal) -> list[Violation]:
    """``check_journal_calls`` over what ``journal`` accepted and stores."""
    stored = {pid: len(journal.events(pid)) for pid in journal.persistence_ids()}
    return check_journal_calls(journal.accepted_calls(), stored)


async def append_all(
    journal: MemoryJournal, appends: list[tuple[str, int, list[bytes], int | None]]
) -> list[JournalError | None]:
    """Start ``appends`` 0.1 ms apart, in order; each one's outcome."""
    outcomes: list[JournalError | None] = [None] * len(appends)

    async def one(n: int) -> None:
        pid, first, events, token = appends[n]
        try:
            await journal.append(pid, first, events, token=token)
        except JournalError as exc:
            outcomes[n] = exc

    async with trio.open_nursery() as nursery:
        for n in range(len(appends)):
            nursery.start_soon(one, n)
            await trio.sleep(0.0001)  # so that they queue in this order, all within one commit
    return outcomes


async def test_a_fenced_and_an_out_of_sequence_append_fail_alone_in_their_batch(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = MemoryJournal(group_commit=True, commit_latency=0.01)
    await journal.recover("S|fenced", 5)  # the fence is 5
    await journal.append("S|behind", 1, [b"1"], token=None)  # a lone append commits at once
    assert trio.current_time() == pytest.approx(0.01)
    planned: list[int] = []
    plan = _group_commit.plan_batch

    def spy(
        batch: list[_group_commit.PendingAppend], stored: dict[str, _group_commit.StreamRow]
    ) -> _group_commit.BatchPlan:
        planned.append(len(batch))
        return plan(batch, stored)

    monkeypatch.setattr(_memory, "plan_batch", spy)
    outcomes = await append_all(
        journal,
        [
            ("S|other", 1, [b"a"], None),  # alone: in flight while the others queue
            ("S|fenced", 1, [b"x"], 3),  # token 3 < fence 5
            ("S|behind", 1, [b"again"], None),  # 1 is taken
            ("S|behind", 2, [b"2", b"3"], None),
            ("S|fenced", 1, [b"y"], 5),
        ],
    )
    assert planned == [1, 4]  # the memory journal plans with the SQL journals' own function
    kinds = [None if o is None else type(o) for o in outcomes]
    assert kinds == [None, JournalFenced, JournalConflict, None, None]
    assert "token 3 is lower than 5" in str(outcomes[1])
    assert journal.events("S|behind") == [b"1", b"2", b"3"]
    assert journal.events("S|fenced") == [b"y"]
    stats = journal.statistics()
    assert (stats.batches, stats.largest_batch, stats.fenced, stats.conflicts) == (3, 4, 1, 1)
    assert verdict(journal) == []


async def test_a_failed_batch_writes_nothing_and_a_retry_writes_each_append_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal = MemoryJournal(group_commit=True, commit_latency=0.01)
    await journal.append("S|a", 1, [b"a1"], token=None)
    batch = [("S|lead", 1, [b"l"], None), ("S|a", 2, [b"a2"], 1), ("S|b", 1, [b"b1", b"b2"], 1)]
    async with trio.open_nursery() as nursery:
        outcomes = []

        async def appending() -> None:
            outcomes.extend(await append_all(journal, batch))

        nursery.start_soon(appending)
        await trio.sleep(0.015)  # the lead's lone batch has landed; the other two are in flight
        journal.fail_next(reason="the disk is full")
    assert outcomes[0] is None
    for failed in outcomes[1:]:
        assert type(failed) is JournalError
        assert "(in one batch with 1 others) failed: storage failed: the disk is full" in str(
            failed
        )
        assert isinstance(failed.__cause__, OSError)
    assert (journal.events("S|a"), journal.events("S|b")) == ([b"a1"], [])
    assert journal.fence("S|a") is None  # nothing of the failed batch, not even the fence
    assert await append_all(journal, batch[1:]) == [None, None]
    assert (journal.events("S|a"), journal.events("S|b")) == ([b"a1", b"a2"], [b"b1", b"b2"])
    assert journal.statistics().failures == 1
    assert verdict(journal) == []


def test_order_per_stream_is_kept_and_a_seed_gives_the_same_batches() -> None:
    seed = random.randrange(1 << 32)
    print(f"seed={seed}")

    async def main() -> tuple[list[list[bytes]], list[tuple[str, int, float]], int]:
        latencies = random.Random(seed)
        journal = MemoryJournal(
            group_commit=True,
            commit_latency=lambda: latencies.uniform(0.001, 0.02),
            group_commit_max_events=5,
        )

        async def writer(pid: str, rng: random.Random) -> None:
            for seq in range(1, 31):
                await trio.sleep(rng.uniform(0, 0.01))
                await journal.append(pid, seq, [f"{pid}#{seq}".encode()], token=None)

        async with trio.open_nursery() as nursery:
            for k in range(6):
                nursery.start_soon(writer, f"S|{k}", random.Random(f"{seed}/{k}"))
        calls = [(c.persistence_id, c.seq, c.at) for c in journal.accepted_calls()]
        streams = [journal.events(f"S|{k}") for k in range(6)]
        return streams, calls, journal.statistics().largest_batch

    def run() -> tuple[list[list[bytes]], list[tuple[str, int, float]], int]:
        with deterministic_scheduling(seed):
            return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    streams, calls, largest = run()
    for k, events in enumerate(streams):
        assert events == [f"S|{k}#{seq}".encode() for seq in range(1, 31)], seed
    assert 1 < largest <= 5, seed  # batches formed, within the limit
    assert run() == (streams, calls, largest), seed


async def test_an_append_in_flight_lands_though_its_caller_gave_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal = MemoryJournal(group_commit=True, commit_latency=0.01)
    paused_until = 5.0
    node = journal.link(lambda: paused_until - trio.current_time())
    with trio.move_on_after(1.0):
        await node.append("S|a", 1, [b"late"], token=1)  # sent while paused: arrives at 5
    await journal.recover("S|a", 2)  # a newer holder, meanwhile: the stale append is fenced
    await trio.sleep(10)
    assert journal.events("S|a") == []
    assert journal.statistics().fenced == 1
    with trio.move_on_after(1.0):
        await node.append("S|b", 1, [b"late"], token=1)
    await trio.sleep(10)
    assert journal.events("S|b") == [b"late"]  # in flight, then queued and committed
    assert verdict(journal) == []


async def test_a_journal_that_ignores_the_fence_in_a_batch_is_caught(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _group_commit.plan_batch

    def fence_blind(
        batch: list[_group_commit.PendingAppend], stored: dict[str, _group_commit.StreamRow]
    ) -> _group_commit.BatchPlan:
        return plan(
            batch, {pid: _group_commit.StreamRow(r.highest, None) for pid, r in stored.items()}
        )

    monkeypatch.setattr(_memory, "plan_batch", fence_blind)
    journal = MemoryJournal(group_commit=True, commit_latency=0.01)
    await journal.recover("S|a", 7)
    await journal.append("S|a", 1, [b"new holder"], token=7)
    await journal.append("S|a", 2, [b"stale"], token=4)  # accepted by the broken planner
    assert journal.events("S|a") == [b"new holder", b"stale"]
    [violation] = verdict(journal)
    assert violation.invariant == "journal-fencing"
    assert violation.detail.startswith(
        "S|a: append at 2 under token 4 was accepted after token 7 had fenced the stream"
    ), violation


def test_bad_settings_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="commit_latency must be seconds"):
        MemoryJournal(group_commit=True, commit_latency=-1.0)
    with pytest.raises(Exception, match="group_commit_max_events = 0 is invalid"):
        MemoryJournal(group_commit=True, group_commit_max_events=0)


async def test_closing_fails_the_batch_in_flight_and_the_appends_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    journal = MemoryJournal(group_commit=True, commit_latency=0.01)
    async with trio.open_nursery() as nursery:
        outcomes: list[JournalError | None] = []

        async def appending() -> None:
            outcomes.extend(
                await append_all(journal, [("S|a", 1, [b"a"], None), ("S|b", 1, [b"b"], None)])
            )

        nursery.start_soon(appending)
        await trio.sleep(0.005)  # S|a's batch is in flight, S|b waits behind it
        await journal.aclose()
    assert [str(o).split(": ", 1)[1] for o in outcomes] == [
        "append at 1 failed: the memory journal was closed; nothing of its batch was written",
        "the memory journal is closed",
    ]
    assert journal.statistics().appends == 0
