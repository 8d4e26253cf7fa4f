"""Free TCP ports on 127.0.0.1 for tests and benchmarks that start real processes.

A port found free is only checked, not reserved: another process may take it before it is used.
:func:`free_port` asks the kernel for one (port 0), which is right for a single listener.
:func:`free_port_block` finds ``count`` consecutive ports, for a cluster whose nodes are
configured as ``base + i``; each pytest-xdist worker searches a range of its own, because two
workers that search the same range pick the same block between its check and its use.
"""

from __future__ import annotations

import os
import socket

_BLOCK_START = 31000
"""The first port of the block search of the first pytest-xdist worker."""

_BLOCK_RANGE = 7000
"""How many ports each pytest-xdist worker searches for a block (four ranges, then wrap)."""

_BLOCK_STEP = 97
"""How far apart the candidate bases are."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Returns:
        The port the kernel chose for a socket bound to port 0, closed again.

    Example:
        >>> from p2pshard.testing import free_port
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def free_port_block(count: int) -> int:
    """A base port with ``count`` consecutive free TCP ports on 127.0.0.1.

    The ports are checked by binding each once, not reserved. Under pytest-xdist (the
    ``PYTEST_XDIST_WORKER`` environment variable) each worker searches a range of its own.

    Args:
        count: how many consecutive ports, from the base up, must be free.

    Returns:
        The first port of the block.

    Raises:
        AssertionError: no block of ``count`` free ports was found in the worker's range.

    Example:
        >>> from p2pshard.testing import free_port_block
        >>> base = free_port_block(3)
        >>> 31000 <= base < 65536
        True
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = _BLOCK_START + (int(worker) % 4 if worker.isdigit() else 0) * _BLOCK_RANGE
    for base in range(first, first + _BLOCK_RANGE - count, _BLOCK_STEP):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise AssertionError("no free port block")
