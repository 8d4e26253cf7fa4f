"""Where an ask's answer goes: the interface the entity side, the outbox and the asks share."""

from __future__ import annotations

from typing import Protocol


class Reply(Protocol):
    """Where an ask's answer goes: a waiting caller here, or an asking node."""

    request_id: int

    def ok(self, value: object) -> None:
        """The entity answered ``value``."""

    def fail(self, error_type: str, error_text: str) -> None:
        """The entity raised, or the message could not be delivered."""
