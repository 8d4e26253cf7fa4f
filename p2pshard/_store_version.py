"""The schema version of a durable store this release writes, and the refusal of a newer one.

Each store (the journals, the SQLite lease file) numbers the layout of its tables. A store of
an older layout is migrated forward when opened; one that a newer release wrote is refused, with
this message, rather than misread, and left untouched.
"""

from __future__ import annotations


def newer_schema(what: str, where: str, found: int, reads: int) -> str | None:
    """Why a store of schema version ``found`` cannot be used, or None if it can.

    ``what`` names the store's kind ("journal", "lease"), ``where`` the store itself, ``reads``
    the newest version this release reads.
    """
    if found <= reads:
        return None
    return (
        f"{where} holds {what} schema version {found}, written by a newer p2pshard; this release "
        f"reads version {reads} and older. Run a release that reads it (nothing was changed)"
    )
