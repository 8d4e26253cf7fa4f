"""A chat example cluster for the chat tests: started on free ports, asked where a room lives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from examples.chat.cluster import ChatCluster, free_base_port


@contextlib.contextmanager
def running_chat(
    data: Path, *, management_nodes: frozenset[int] | None = None
) -> Iterator[ChatCluster]:
    """A 3-node chat cluster on free ports, ready; stopped (and its logs' ends printed) after.

    ``management_nodes``: the nodes serving the management endpoint (None: all).
    """
    chat = ChatCluster(
        3,
        data,
        free_base_port(3),
        log_level="WARNING",
        log_to_files=True,
        management_nodes=management_nodes,
    )
    try:
        chat.start()
        chat.wait_ready(timeout=60)
        yield chat
    finally:
        chat.stop()
        for log in sorted(data.glob("*.log")):
            print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-15:]))


def room_home(chat: ChatCluster, room: str) -> int | None:
    """The node whose ``Room`` entities include ``room``, or None while no running node has it."""
    for i, proc in chat.procs.items():
        if proc.poll() is not None:
            continue
        status = chat.status(i, timeout=5.0)  # it asks every node's gateway: slower when loaded
        if status is None:
            continue
        for ids in status["types"]["Room"]["local_entities"].values():
            if room in ids:
                return i
    return None
