"""A process appending to many streams at once through a group-committing journal.

Run as ``python -m tests._support.group_commit_worker BACKEND WHERE STREAMS COUNT SIZE``:
BACKEND is ``sqlite`` (WHERE a file) or ``postgresql`` (WHERE a connection string). STREAMS
tasks each append COUNT events, one per append, to a stream of their own
(``GC|<stream>``), each event SIZE bytes (see :func:`payload`), so that the journal gathers the
appends into batches. After each acknowledged append the worker prints ``ok <stream> <seq>``;
after a failed one (:class:`p2pshard.JournalError`) ``fail <stream> <seq>``, and it tries the
same append again a little later until it is acknowledged. Every 0.2 s, and at the end, it
prints ``stats <commits> <appends> <largest batch>``. Lines go to stdout, flushed one by one: a
pipe, which a limit on file sizes does not touch, and which keeps what was printed when the
process is killed.

The tests check the journal against these lines: every acknowledged event is stored, and each
event is stored once, whether the process was killed or its writes failed for a while.
"""

from __future__ import annotations

import sys

import trio

from p2pshard import JournalConflict, JournalError
from tests._support.journal_worker import journal_of

RETRY_DELAY = 0.02
"""Seconds between tries of an append that failed."""


def payload(stream: int, seq: int, size: int) -> bytes:
    """The event ``seq`` of stream ``stream``: its name, padded to ``size`` bytes."""
    head = f"{stream}-{seq}:".encode()
    return head + b"x" * max(0, size - len(head))


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run(kind: str, where: str, streams: int, count: int, size: int) -> None:
    journal = journal_of(kind, where)

    def stats() -> str:
        s = journal.group_commit_statistics()  # type: ignore[attr-defined]
        return f"stats {s.commits} {s.appends} {s.largest_batch}"

    async def stream(i: int) -> None:
        pid = f"GC|{i}"
        seq = (await journal.recover(pid, None)).highest_seq + 1
        while seq <= count:
            try:
                await journal.append(pid, seq, [payload(i, seq, size)], token=None)
            except JournalConflict:  # an earlier try whose outcome was unknown did commit
                seq = (await journal.recover(pid, None)).highest_seq + 1
                continue
            except JournalError:
                say(f"fail {i} {seq}")
                await trio.sleep(RETRY_DELAY)
                continue
            say(f"ok {i} {seq}")
            seq += 1

    async def report() -> None:
        while True:
            await trio.sleep(0.2)
            say(stats())

    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(report)
            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(stream, i)
            outer.cancel_scope.cancel()
        say(stats())
    finally:
        await journal.aclose()


def main() -> None:
    kind, where, streams, count, size = sys.argv[1:6]
    trio.run(run, kind, where, int(streams), int(count), int(size))


if __name__ == "__main__":
    main()
