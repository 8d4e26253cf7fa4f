"""How many examples a costly property test draws: a third in the default run, all with --slow.

The default run must stay inside CI's 15 minutes, so the property tests that draw hundreds of
costly examples (gossip histories, wire fuzzing, coordinator states) draw a third of them there,
never fewer than hypothesis' own default of 100; ``--slow`` draws the full count.
``tests/conftest.py`` sets :data:`FULL` before any test module is imported.
"""

from __future__ import annotations

FULL = False
"""Whether this run draws every example (``--slow``)."""


def examples(full: int) -> int:
    """The example count for a property test whose full count is ``full``."""
    return full if FULL else max(100, full // 3)
