"""What the helpers that start a real server process (etcd, PostgreSQL) share."""

from __future__ import annotations

import subprocess
from pathlib import Path


class ServerProcess:
    """Mixin for a fixture's server: its ``_process`` and the ``log`` file it writes."""

    log: Path
    _process: subprocess.Popen[bytes]

    def exited(self) -> bool:
        """Whether the process has exited."""
        return self._process.poll() is not None

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log, for failure messages."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"
