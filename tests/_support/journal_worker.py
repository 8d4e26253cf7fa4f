"""One process appending to a shared stream, for the journal kit's many-process test.

Run as ``python -m tests._support.journal_worker BACKEND WHERE PERSISTENCE_ID WORKER COUNT OUT``:
BACKEND is ``sqlite`` (WHERE a file) or ``postgresql`` (WHERE a connection string). The worker
appends COUNT events ``<WORKER>-<i>`` to PERSISTENCE_ID, one at a time: it recovers to learn
the highest sequence number, appends after it, and on :class:`p2pshard.JournalConflict` (another
process got that number) tries again. For each acknowledged append it writes one line
``<seq> <payload>`` to OUT. The test checks that the stream holds exactly the acknowledged
events, each once, numbered 1..n without a gap.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import trio

from p2pshard import Journal, JournalConflict, SqliteJournal

ATTEMPTS = 10_000
"""Conflicts one event may meet before the worker gives up with an error."""


def journal_of(kind: str, where: str) -> Journal:
    """The journal a worker or a test names on the command line."""
    if kind == "sqlite":
        return SqliteJournal(where, operation_timeout=30.0)
    if kind == "postgresql":
        from p2pshard import PostgresJournal

        return PostgresJournal(where, operation_timeout=30.0)
    raise SystemExit(f"unknown backend {kind!r}: expected sqlite or postgresql")


async def append_all(
    kind: str, where: str, persistence_id: str, worker: str, count: int, out: Path
) -> None:
    journal = journal_of(kind, where)
    rng = random.Random(worker)
    try:
        for i in range(count):
            payload = f"{worker}-{i}"
            for _ in range(ATTEMPTS):
                highest = (await journal.recover(persistence_id, None)).highest_seq
                try:
                    await journal.append(
                        persistence_id, highest + 1, [payload.encode()], token=None
                    )
                except JournalConflict:
                    await trio.sleep(rng.uniform(0.0, 0.002))
                    continue
                with out.open("a") as f:
                    f.write(f"{highest + 1} {payload}\n")
                break
            else:
                raise RuntimeError(f"{worker}: {ATTEMPTS} conflicts in a row")
    finally:
        await journal.aclose()


def main() -> None:
    kind, where, persistence_id, worker, count, out = sys.argv[1:7]
    trio.run(append_all, kind, where, persistence_id, worker, int(count), Path(out))


if __name__ == "__main__":
    main()
