"""Giving memory back to the operating system after a burst (glibc's ``malloc_trim``).

Theory of operation: a burst of short-lived connections (a scan, or an attack of idle
connections) allocates TLS objects and buffers by the thousand. Python frees them when the
connections close, but glibc keeps the freed pages in its heaps, so the process stays as big as
at the peak. ``malloc_trim(0)`` hands what is free back; it costs a few milliseconds for a heap
of this size, so the transport calls it only once a burst is over, and at most every
``TRIM_INTERVAL``. Where the C library has no ``malloc_trim`` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger("membership.memory")

TRIM_INTERVAL = 5.0
"""Seconds between two trims at the most."""


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_TRIM = _load_trim()


def give_memory_back() -> bool:
    """Return free heap memory to the operating system; whether anything was returned."""
    if _TRIM is None:
        return False
    return bool(_TRIM(0))
