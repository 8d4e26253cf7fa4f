"""A real PostgreSQL server for tests, on 127.0.0.1 with a free port and a temporary data dir.

``with running_postgres() as pg:`` finds Debian's server binaries (``/usr/lib/postgresql/<n>/bin``,
the newest; else ``postgres`` and ``initdb`` on PATH), runs ``initdb`` into a new temporary
directory, starts ``postgres`` there listening on 127.0.0.1 at a free port with its unix socket in
the same directory, waits until it accepts a connection, and at the end stops it by its PID
(SIGINT, PostgreSQL's fast shutdown; SIGKILL after ``STOP_TIMEOUT``) and removes the directory.
``pg.dsn`` connects as the superuser ``p2pshard`` to the database ``postgres``, without a password.

PostgreSQL refuses to run as root. As root the server runs as the unprivileged ``postgres``
user that Debian's package creates (the temporary directory is made under /tmp, which that
user can reach, and handed to it); as anyone else it runs as the caller.
``scripts/test.sh`` installs Debian's ``postgresql`` when the binaries are missing.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

from ._ports import free_port
from ._server_process import ServerProcess

START_TIMEOUT = 30.0
"""Seconds initdb plus the server's start may take."""

STOP_TIMEOUT = 10.0
"""Seconds the server may take to exit after SIGINT before it is killed."""

START_ATTEMPTS = 3
"""Starts tried with fresh ports when the server exits at once (a port taken since picked)."""

SUPERUSER = "p2pshard"


class PostgresNotInstalled(RuntimeError):
    """No PostgreSQL server binaries were found."""


def find_bindir() -> Path:
    """The directory holding ``postgres`` and ``initdb``.

    Raises:
        PostgresNotInstalled: there is none; ``scripts/test.sh`` installs Debian's package.
    """
    debian = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/postgres"),
        key=lambda p: [int(x) if x.isdigit() else 0 for x in Path(p).parent.parent.name.split(".")],
    )
    if debian:
        return Path(debian[-1]).parent
    found = shutil.which("postgres")
    if found is not None and shutil.which("initdb", path=str(Path(found).parent)):
        return Path(found).parent
    raise PostgresNotInstalled(
        "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/postgres, no postgres on "
        "PATH): run scripts/test.sh, which installs Debian's postgresql, or run "
        "'apt-get install postgresql' as root"
    )


def _run_as() -> pwd.struct_passwd | None:
    """The user the server must run as: None for the caller, ``postgres`` for root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise PostgresNotInstalled(
            "running as root, but there is no 'postgres' user to run PostgreSQL as (the server "
            "refuses root): install Debian's postgresql, which creates it"
        ) from None


@attrs.define(eq=False)
class PostgresServer(ServerProcess):
    """A running PostgreSQL: its connection string, PID, directories and log file."""

    dsn: str
    """``host=127.0.0.1 port=<port> user=p2pshard dbname=postgres``."""
    port: int
    pid: int
    root: Path
    """The temporary directory: ``data/`` (the cluster), the unix socket and the log."""
    log: Path
    _process: subprocess.Popen[bytes]

    def stop(self) -> None:
        """Stop the server and remove its directory; calling it again does nothing more."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)  # fast shutdown: clients are cut off
            try:
                self._process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _start(bindir: Path, user: pwd.struct_passwd | None, *, fsync: bool) -> PostgresServer:
    # As root the server's user must reach the directory: /tmp is open to all, a TMPDIR may not be.
    parent = "/tmp" if user is not None and os.path.isdir("/tmp") else None
    root = Path(tempfile.mkdtemp(prefix="p2pshard-pg-", dir=parent))
    data, log = root / "data", root / "postgres.log"
    uid: int | None = None  # None: run as the caller
    gid: int | None = None
    extra_groups: list[int] | None = None
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
        uid, gid, extra_groups = user.pw_uid, user.pw_gid, []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    if user is not None:
        env["HOME"] = user.pw_dir
    try:
        initdb = subprocess.run(
            [
                str(bindir / "initdb"),
                f"--pgdata={data}",
                f"--username={SUPERUSER}",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            timeout=START_TIMEOUT,
            check=False,
            user=uid,
            group=gid,
            extra_groups=extra_groups,
        )
        if initdb.returncode != 0:
            raise RuntimeError(
                f"initdb into {data} failed ({initdb.returncode}):\n"
                f"{initdb.stdout.decode(errors='replace')}{initdb.stderr.decode(errors='replace')}"
            )
        port = free_port()
        command = [
            str(bindir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(root),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"fsync={'on' if fsync else 'off'}",
            "-c",
            "max_connections=100",
        ]
        with log.open("wb") as stderr:
            if user is not None:
                os.chown(log, user.pw_uid, user.pw_gid)
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                cwd=root,
                env=env,
                start_new_session=True,  # a ^C in the terminal is for pytest, not the server
                user=uid,
                group=gid,
                extra_groups=extra_groups,
            )
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    dsn = f"host=127.0.0.1 port={port} user={SUPERUSER} dbname=postgres"
    return PostgresServer(dsn, port, process.pid, root, log, process)


def _became_ready(server: PostgresServer, deadline: float) -> bool:
    import psycopg  # only here: importing p2pshard.testing must not need the postgresql extra

    """True once the server accepts a connection, False if it exits first."""
    while not server.exited():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"postgres (pid {server.pid}, port {server.port}) did not accept connections "
                f"within {START_TIMEOUT:g} s; its log {server.log}:\n{server.log_tail()}"
            )
        try:
            with psycopg.connect(server.dsn, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            time.sleep(0.05)
    return False


@contextmanager
def running_postgres(*, fsync: bool = True) -> Iterator[PostgresServer]:
    """A running PostgreSQL server, stopped and removed at the end.

    ``fsync=False`` trades durability against a crash of the machine for speed (the server's
    data is thrown away at the end anyway); the default keeps PostgreSQL's normal behaviour,
    which benchmarks need.

    Raises:
        PostgresNotInstalled: the binaries (or, as root, the ``postgres`` user) are missing.
        RuntimeError: initdb failed or the server did not start; the message has its log.

    Example:
        >>> from p2pshard.testing import running_postgres
        >>> with running_postgres(fsync=False) as pg:  # doctest: +SKIP
        ...     journal = PostgresJournal(pg.dsn)
    """
    bindir, user = find_bindir(), _run_as()
    started: list[PostgresServer] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for _ in range(START_ATTEMPTS):
            started.append(server := _start(bindir, user, fsync=fsync))
            if _became_ready(server, deadline):
                break
        else:
            raise RuntimeError(
                f"postgres exited at once, {START_ATTEMPTS} times; its last log "
                f"{started[-1].log}:\n{started[-1].log_tail()}"
            )
        yield server
    finally:
        for server in started:
            server.stop()
