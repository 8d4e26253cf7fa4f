"""What the transport tests share beyond their fixtures."""

from __future__ import annotations

import trio

from membership import Envelope, Transport


async def receive_n(transport: Transport, n: int, *, limit: float = 20) -> list[Envelope]:
    """The next ``n`` envelopes ``transport`` receives, within ``limit`` seconds."""
    got: list[Envelope] = []
    with trio.fail_after(limit):
        while len(got) < n:
            got.append(await transport.receive())
    return got
