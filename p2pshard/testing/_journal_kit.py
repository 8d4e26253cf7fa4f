"""The journal conformance kit: what every :class:`p2pshard.Journal` must give its entities.

:func:`check_journal` runs the same checks over any journal, so one written by a user is held to
the promises the bundled ones keep (memory, SQLite, PostgreSQL) and that
:class:`p2pshard.EventSourcedEntity` relies on: events numbered 1..n without gaps, read back in
order after a snapshot; appends that are all or nothing; one winner when writers race for a
sequence number; fencing by token per persistence id; durability across a close and reopen; a
:class:`p2pshard.JournalError` naming the persistence id, cause chained, when the storage
fails or a stream stays locked; and, for the recoveries and snapshots the entity side gathers
into batches, an answer of its own for each stream (through the optional
:class:`p2pshard.BatchJournal` methods when the journal has them, else one call each).

Each check uses persistence ids no other check uses, so one storage can serve all of them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from contextlib import AbstractContextManager

import attrs
import trio

from membership import ConfigurationError

from .._errors import EventTooLarge, JournalConflict, JournalError, JournalFenced
from ..persistence import Journal, Recovery, SnapshotWrite
from ..persistence._gather import JournalBatcher, SnapshotTicket
from ._expect import expect_raises

POISON = b"poison: the test trigger aborts the transaction that inserts this"
"""The event that :func:`check_journal` asks ``poison`` to make the storage fail on."""

_ids = itertools.count()


@attrs.define
class _Run:
    open: Callable[..., Journal]
    broken: Callable[[], Journal] | None
    lock: Callable[[str], AbstractContextManager[None]] | None
    poison: Callable[[bytes], None] | None
    journals: list[Journal] = attrs.field(factory=list)

    def journal(self, **tuning: object) -> Journal:
        journal = self.open(**tuning)
        self.journals.append(journal)
        return journal

    @staticmethod
    def fresh_id() -> str:
        return f"Kit|{os.getpid()}-{next(_ids)}"


async def _events_come_back_in_order_with_the_highest_sequence_number(run: _Run) -> None:
    journal, pid = run.journal(), run.fresh_id()
    empty = await journal.recover(pid, None)
    assert (empty.snapshot, empty.events, empty.highest_seq) == (None, (), 0)
    await journal.append(pid, 1, [b"one"], token=None)
    await journal.append(pid, 2, [b"two", b"three", b""], token=None)
    recovery = await journal.recover(pid, None)
    assert recovery.snapshot is None
    assert recovery.events == ((1, b"one"), (2, b"two"), (3, b"three"), (4, b""))
    assert recovery.highest_seq == 4
    other = await journal.recover(run.fresh_id(), None)  # streams are separate
    assert other.highest_seq == 0


async def _an_append_must_continue_the_sequence(run: _Run) -> None:
    journal, pid = run.journal(), run.fresh_id()
    await journal.append(pid, 1, [b"a"], token=None)
    for wrong in (1, 3):
        with expect_raises(JournalConflict, rf"{pid}.*append at sequence number {wrong}"):
            await journal.append(pid, wrong, [b"x"], token=None)
    await journal.append(pid, 2, [b"b"], token=None)
    assert [e for _, e in (await journal.recover(pid, None)).events] == [b"a", b"b"]


async def _a_snapshot_hides_the_events_before_it(run: _Run) -> None:
    journal, pid = run.journal(), run.fresh_id()
    await journal.append(pid, 1, [b"1", b"2", b"3", b"4", b"5"], token=None)
    await journal.save_snapshot(pid, 3, b"state at 3", token=None)
    recovery = await journal.recover(pid, None)
    assert recovery.snapshot == (3, b"state at 3")
    assert recovery.events == ((4, b"4"), (5, b"5"))
    assert recovery.highest_seq == 5
    await journal.save_snapshot(pid, 2, b"older", token=None)  # ignored: not newer
    await journal.save_snapshot(pid, 5, b"state at 5", token=None)
    recovery = await journal.recover(pid, None)
    assert (recovery.snapshot, recovery.events, recovery.highest_seq) == (
        (5, b"state at 5"),
        (),
        5,
    )
    with expect_raises(JournalConflict, "snapshot at sequence number 6 is beyond"):
        await journal.save_snapshot(pid, 6, b"from the future", token=None)


async def _an_oversize_event_refuses_the_whole_batch_before_writing(run: _Run) -> None:
    journal, pid = run.journal(max_event_size=100), run.fresh_id()
    with expect_raises(EventTooLarge, rf"event 2 of '{pid}' encodes to 101 bytes.*100"):
        await journal.append(pid, 1, [b"x" * 100, b"y" * 101, b"z"], token=None)
    with expect_raises(EventTooLarge, "snapshot at 1"):
        await journal.save_snapshot(pid, 1, b"s" * 101, token=None)
    assert (await journal.recover(pid, None)).highest_seq == 0
    await journal.append(pid, 1, [b"x" * 100], token=None)  # at the limit: fine


async def _a_failure_in_the_middle_of_a_batch_writes_none_of_it(run: _Run) -> None:
    assert run.poison is not None
    journal, pid = run.journal(), run.fresh_id()
    await journal.append(pid, 1, [b"before"], token=None)  # creates the tables
    run.poison(POISON)
    with expect_raises(JournalError, "injected failure") as caught:
        await journal.append(pid, 2, [b"a", b"b", POISON, b"c"], token=None)
    assert caught.value is not None
    assert caught.value.__cause__ is not None
    assert pid in str(caught.value)
    recovery = await journal.recover(pid, None)
    assert recovery.events == ((1, b"before"),)
    assert recovery.highest_seq == 1
    await journal.append(pid, 2, [b"a", b"b"], token=None)  # the journal still works
    assert (await journal.recover(pid, None)).highest_seq == 3


async def _two_writers_racing_for_a_sequence_number_one_wins(run: _Run) -> None:
    first, second, pid = run.journal(), run.journal(), run.fresh_id()
    assert (await first.recover(pid, None)).highest_seq == 0
    assert (await second.recover(pid, None)).highest_seq == 0
    await first.append(pid, 1, [b"first"], token=None)
    with expect_raises(JournalConflict, f"{pid}.*highest stored is 1"):
        await second.append(pid, 1, [b"second", b"more"], token=None)
    assert (await second.recover(pid, None)).events == ((1, b"first"),)


async def _recovery_with_a_token_fences_off_lower_tokens(run: _Run) -> None:
    journal, pid = run.journal(), run.fresh_id()
    await journal.append(pid, 1, [b"by 3"], token=3)
    recovery = await journal.recover(pid, 5)  # a new holder with token 5 takes over
    assert recovery.highest_seq == 1
    with expect_raises(JournalFenced, rf"{pid}.*token 4 is lower than 5"):
        await journal.append(pid, 2, [b"stale"], token=4)
    with expect_raises(JournalFenced):
        await journal.save_snapshot(pid, 1, b"stale snapshot", token=4)
    with expect_raises(JournalFenced):
        await journal.recover(pid, 4)  # a stale holder cannot even recover
    assert (await journal.recover(pid, None)).events == ((1, b"by 3"),)
    await journal.append(pid, 2, [b"by 5"], token=5)
    await journal.append(pid, 3, [b"no token"], token=None)  # None: leases off, not checked
    await journal.append(pid, 4, [b"by 7"], token=7)  # a higher token raises the fence too
    with expect_raises(JournalFenced, "token 5 is lower than 7"):
        await journal.append(pid, 5, [b"by 5 again"], token=5)
    recovery = await journal.recover(pid, None)
    assert [e for _, e in recovery.events] == [b"by 3", b"by 5", b"no token", b"by 7"]


async def _fences_are_per_persistence_id(run: _Run) -> None:
    journal, a, b = run.journal(), run.fresh_id(), run.fresh_id()
    await journal.recover(a, 10)
    await journal.append(b, 1, [b"b with 2"], token=2)  # b's fence is not a's
    with expect_raises(JournalFenced):
        await journal.append(a, 1, [b"a with 2"], token=2)


async def _concurrent_appends_have_one_winner_per_sequence_number(run: _Run) -> None:
    journal, pid = run.journal(), run.fresh_id()
    outcomes: list[str] = []

    async def race(i: int) -> None:
        try:
            await journal.append(pid, 1, [f"racer {i}".encode()], token=None)
            outcomes.append("won")
        except JournalConflict:
            outcomes.append("conflict")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(race, i)
    assert sorted(outcomes) == ["conflict"] * 9 + ["won"]

    acknowledged: list[tuple[int, bytes]] = []

    async def writer(w: int) -> None:
        for i in range(10):
            payload = f"w{w}-{i}".encode()
            while True:
                highest = (await journal.recover(pid, None)).highest_seq
                try:
                    await journal.append(pid, highest + 1, [payload], token=None)
                except JournalConflict:
                    continue
                acknowledged.append((highest + 1, payload))
                break

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for w in range(6):
                nursery.start_soon(writer, w)
    events = (await journal.recover(pid, None)).events
    assert [seq for seq, _ in events] == list(range(1, 62))
    assert sorted(events[1:]) == sorted(acknowledged)


async def _a_closed_and_reopened_journal_has_everything(run: _Run) -> None:
    journal, pid = run.open(), run.fresh_id()
    await journal.append(pid, 1, [b"1", b"2", b"3"], token=8)
    await journal.save_snapshot(pid, 2, b"at 2", token=8)
    await journal.aclose()
    with expect_raises(JournalError, "closed"):
        await journal.recover(pid, None)
    reopened = run.journal()
    recovery = await reopened.recover(pid, None)
    assert (recovery.snapshot, recovery.events, recovery.highest_seq) == (
        (2, b"at 2"),
        ((3, b"3"),),
        3,
    )
    with expect_raises(JournalFenced):  # the fence is stored too
        await reopened.append(pid, 4, [b"stale"], token=7)


async def _a_storage_failure_is_a_journal_error_naming_the_stream(run: _Run) -> None:
    assert run.broken is not None
    journal, pid = run.broken(), run.fresh_id()
    run.journals.append(journal)
    for call in (
        journal.recover(pid, None),
        journal.append(pid, 1, [b"x"], token=None),
        journal.save_snapshot(pid, 1, b"x", token=None),
    ):
        with expect_raises(JournalError) as caught:
            await call
        error = caught.value
        assert isinstance(error, JournalError)
        assert not isinstance(error, JournalFenced | JournalConflict)
        assert error.persistence_id == pid
        assert pid in str(error)
        assert error.__cause__ is not None


async def _a_locked_stream_times_out_with_a_journal_error(run: _Run) -> None:
    assert run.lock is not None
    journal, pid = run.journal(operation_timeout=0.5), run.fresh_id()
    await journal.append(pid, 1, [b"a"], token=None)
    with run.lock(pid), trio.fail_after(10):
        with expect_raises(JournalError, pid) as caught:
            await journal.append(pid, 2, [b"b"], token=None)
        assert not isinstance(caught.value, JournalFenced | JournalConflict)
    await trio.sleep(1.0)  # long enough for an abandoned append to have landed, were there one
    assert (await journal.recover(pid, None)).highest_seq == 1  # the lock wait gave up: no write
    await journal.append(pid, 2, [b"b"], token=None)  # free again


async def _bad_arguments_are_refused_before_any_io(run: _Run) -> None:
    journal = run.journal()
    with expect_raises(ValueError, "non-empty string"):
        await journal.recover("", None)
    with expect_raises(TypeError, "fencing token"):
        await journal.recover("x", "5")  # type: ignore[arg-type]
    with expect_raises(ValueError, "at least one event"):
        await journal.append("x", 1, [], token=None)
    with expect_raises(ValueError, "first_seq"):
        await journal.append("x", 0, [b"a"], token=None)
    with expect_raises(TypeError, "must be bytes, not str"):
        await journal.append("x", 1, ["text"], token=None)  # type: ignore[list-item]
    with expect_raises(ConfigurationError, "max_event_size = 0 is invalid"):
        run.open(max_event_size=0)


async def _gathered(
    batcher: JournalBatcher, requests: list[tuple[str, int | None]]
) -> list[Recovery | JournalError]:
    """The recoveries of ``requests``, asked at once through ``batcher`` (so gathered)."""
    answers: list[Recovery | JournalError | None] = [None] * len(requests)

    async def one(i: int, pid: str, token: int | None) -> None:
        try:
            answers[i] = await batcher.recover(pid, token)
        except JournalError as exc:
            answers[i] = exc

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i, (pid, token) in enumerate(requests):
                nursery.start_soon(one, i, pid, token)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


async def _batched_recoveries_answer_each_stream_alone(run: _Run) -> None:
    journal = run.journal()
    a, b, c, d = (run.fresh_id() for _ in range(4))
    await journal.append(a, 1, [b"a1", b"a2", b"a3"], token=2)
    await journal.save_snapshot(a, 2, b"a at 2", token=2)
    await journal.append(b, 1, [b"b1"], token=None)
    await journal.recover(c, 9)  # c's fence is 9
    batcher = JournalBatcher(journal)
    answers = await _gathered(batcher, [(a, 3), (b, None), (c, 4), (d, 1)])
    assert answers[0] == Recovery((2, b"a at 2"), ((3, b"a3"),), 3), answers[0]
    assert answers[1] == Recovery(None, ((1, b"b1"),), 1), answers[1]
    assert isinstance(answers[2], JournalFenced), answers[2]
    assert answers[2].persistence_id == c
    assert "token 4 is lower than 9" in str(answers[2])
    assert answers[3] == Recovery(None, (), 0), answers[3]
    # The fences the batch raised hold, each for its own stream only.
    with expect_raises(JournalFenced, "token 2 is lower than 3"):
        await journal.append(a, 4, [b"stale"], token=2)
    with expect_raises(JournalFenced, "token 0 is lower than 1"):
        await journal.append(d, 1, [b"stale"], token=0)
    await journal.append(c, 1, [b"by 9"], token=9)
    recover_many = getattr(journal, "recover_many", None)
    if recover_many is None:  # optional: the entity side then recovers one stream at a time
        return
    direct = await recover_many([(a, 3), (c, 9), (a, 5), (a, 4), (b, 1)])
    assert isinstance(direct[0], JournalFenced), "two of one stream: as if the higher came first"
    assert direct[1] == Recovery(None, ((1, b"by 9"),), 1), direct[1]
    assert direct[2] == Recovery((2, b"a at 2"), ((3, b"a3"),), 3), direct[2]
    assert isinstance(direct[3], JournalFenced)
    assert "token 4 is lower than 5" in str(direct[3])
    assert direct[4] == Recovery(None, ((1, b"b1"),), 1), direct[4]
    assert await recover_many([]) == []


async def _batched_snapshots_are_checked_each_alone(run: _Run) -> None:
    journal = run.journal()
    a, b, c, d = (run.fresh_id() for _ in range(4))
    await journal.append(a, 1, [b"a1", b"a2", b"a3"], token=1)
    await journal.append(b, 1, [b"b1"], token=None)
    await journal.append(d, 1, [b"d1"], token=5)
    batcher = JournalBatcher(journal)
    outcomes: dict[tuple[str, int], JournalError | str | None] = {}

    def told(ticket: SnapshotTicket) -> None:
        key = (ticket.write.persistence_id, ticket.write.seq)
        outcomes[key] = "superseded" if ticket.superseded else ticket.error

    for pid, seq, token in ((a, 1, 1), (b, 5, None), (c, 1, None), (d, 1, 3), (a, 2, 2)):
        batcher.save_snapshot_later(pid, seq, f"{pid} at {seq}".encode(), token=token, on_done=told)
    with trio.fail_after(60):
        assert await batcher.drain(60)
    assert outcomes[(a, 1)] == "superseded"  # the newer one of a replaced it while it waited
    assert outcomes[(a, 2)] is None
    assert isinstance(outcomes[(b, 5)], JournalConflict)
    assert isinstance(outcomes[(c, 1)], JournalConflict)
    assert isinstance(outcomes[(d, 1)], JournalFenced)
    assert (await journal.recover(a, None)).snapshot == (2, f"{a} at 2".encode())
    assert (await journal.recover(d, None)).snapshot is None
    with expect_raises(JournalFenced, "token 1 is lower than 2"):  # a's snapshot raised it
        await journal.append(a, 4, [b"stale"], token=1)
    save_snapshots = getattr(journal, "save_snapshots", None)
    if save_snapshots is None:
        return
    refusals = await save_snapshots(
        [
            SnapshotWrite(a, 3, b"a at 3", 2),
            SnapshotWrite(d, 2, b"beyond", 5),
            SnapshotWrite(a, 1, b"older", 2),  # kept out: not newer than the stored one
        ]
    )
    assert refusals[0] is None, refusals
    assert refusals[2] is None, refusals
    assert isinstance(refusals[1], JournalConflict)
    assert refusals[1].persistence_id == d
    assert (await journal.recover(a, None)).snapshot == (3, b"a at 3")
    assert await save_snapshots([]) == []


_CHECKS: Mapping[str, Callable[[_Run], Awaitable[None]]] = {
    "events_come_back_in_order_with_the_highest_sequence_number": (
        _events_come_back_in_order_with_the_highest_sequence_number
    ),
    "an_append_must_continue_the_sequence": _an_append_must_continue_the_sequence,
    "a_snapshot_hides_the_events_before_it": _a_snapshot_hides_the_events_before_it,
    "an_oversize_event_refuses_the_whole_batch_before_writing": (
        _an_oversize_event_refuses_the_whole_batch_before_writing
    ),
    "a_failure_in_the_middle_of_a_batch_writes_none_of_it": (
        _a_failure_in_the_middle_of_a_batch_writes_none_of_it
    ),
    "two_writers_racing_for_a_sequence_number_one_wins": (
        _two_writers_racing_for_a_sequence_number_one_wins
    ),
    "recovery_with_a_token_fences_off_lower_tokens": _recovery_with_a_token_fences_off_lower_tokens,
    "fences_are_per_persistence_id": _fences_are_per_persistence_id,
    "concurrent_appends_have_one_winner_per_sequence_number": (
        _concurrent_appends_have_one_winner_per_sequence_number
    ),
    "a_closed_and_reopened_journal_has_everything": _a_closed_and_reopened_journal_has_everything,
    "a_storage_failure_is_a_journal_error_naming_the_stream": (
        _a_storage_failure_is_a_journal_error_naming_the_stream
    ),
    "a_locked_stream_times_out_with_a_journal_error": (
        _a_locked_stream_times_out_with_a_journal_error
    ),
    "bad_arguments_are_refused_before_any_io": _bad_arguments_are_refused_before_any_io,
    "batched_recoveries_answer_each_stream_alone": _batched_recoveries_answer_each_stream_alone,
    "batched_snapshots_are_checked_each_alone": _batched_snapshots_are_checked_each_alone,
}

JOURNAL_CHECKS: tuple[str, ...] = tuple(_CHECKS)
"""The names of :func:`check_journal`'s checks, in the order it runs them."""


def _needs(name: str) -> str | None:
    """The argument of :func:`check_journal` that the check ``name`` cannot run without."""
    return {
        "a_failure_in_the_middle_of_a_batch_writes_none_of_it": "poison",
        "a_closed_and_reopened_journal_has_everything": "durable",
        "a_storage_failure_is_a_journal_error_naming_the_stream": "broken",
        "a_locked_stream_times_out_with_a_journal_error": "lock",
    }.get(name)


async def check_journal(
    open_journal: Callable[..., Journal],
    *,
    durable: bool = True,
    broken: Callable[[], Journal] | None = None,
    lock: Callable[[str], AbstractContextManager[None]] | None = None,
    poison: Callable[[bytes], None] | None = None,
    checks: Collection[str] | None = None,
) -> None:
    """Check that a journal keeps the promises :class:`p2pshard.EventSourcedEntity` relies on.

    The checks share the storage, each with persistence ids of its own; every journal the kit
    opened is closed once they are done. A broken promise raises
    :class:`AssertionError` (or the journal's own error) saying what went wrong.

    Args:
        open_journal: ``open_journal(**tuning)`` returns a journal on the same storage each
            time, a new object where the journal can have several (two writers race through
            two of them); ``tuning`` is ``max_event_size``, or ``operation_timeout`` for the
            lock check, as :class:`p2pshard.JournalSettings` names them.
        durable: whether what a closed journal wrote is there for the next one (False for an
            in-memory journal: the check of a close and reopen is left out).
        broken: makes a journal whose storage fails on every call (a file that is not a
            database, a server that refuses the connection); without it that check is left out.
        lock: ``lock(persistence_id)`` returns a context manager inside which another writer
            holds the lock that calls on that stream need; without it that check is left out.
        poison: ``poison(payload)`` makes the storage abort, half-way, a transaction that
            inserts ``payload`` (a trigger); without it the all-or-nothing check is left out.
        checks: the names (from :data:`JOURNAL_CHECKS`) of the checks to run; by default all
            those the arguments allow.

    Raises:
        AssertionError: the journal broke a promise.
        ValueError: a name in ``checks`` is unknown, or needs an argument that was not given.

    Example:
        >>> import trio
        >>> from p2pshard import MemoryJournal
        >>> from p2pshard.testing import check_journal
        >>> shared = MemoryJournal()
        >>> def open_memory(max_event_size=None):
        ...     if max_event_size is None:
        ...         return shared
        ...     return MemoryJournal(max_event_size=max_event_size)
        >>> trio.run(lambda: check_journal(open_memory, durable=False))  # doctest: +SKIP
    """
    given = {"durable": durable, "broken": broken, "lock": lock, "poison": poison}
    if checks is None:
        names = [n for n in JOURNAL_CHECKS if (need := _needs(n)) is None or given[need]]
    else:
        names = list(checks)
        unknown = [n for n in names if n not in _CHECKS]
        if unknown:
            raise ValueError(
                f"unknown journal checks {unknown}: the names are {list(JOURNAL_CHECKS)}"
            )
        for name in names:
            if (need := _needs(name)) is not None and not given[need]:
                raise ValueError(
                    f"the journal check {name!r} needs {need}: pass it, or leave it out"
                )
    run = _Run(open_journal, broken, lock, poison)
    try:
        for name in names:
            await _CHECKS[name](run)
    finally:
        with trio.CancelScope(shield=True):
            # A journal object may come back from several calls (one in-memory journal): each
            # is closed once, at the end, for the checks share it.
            for journal in {id(j): j for j in run.journals}.values():
                await journal.aclose()
