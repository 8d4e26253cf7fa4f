"""The journal backend factory: the backend a node's ``[journal]`` settings name.

A module of its own because it imports every backend, and the backends import the journal
interface.
"""

from __future__ import annotations

from membership import ConfigurationError

from ._journal import Journal, JournalSettings


def open_journal(settings: JournalSettings) -> Journal:
    """The journal ``settings`` names (not connected yet: the first call connects).

    Raises:
        ConfigurationError: ``settings.backend`` is None, or psycopg is missing for PostgreSQL.
    """
    if settings.backend == "sqlite":
        from ._sqlite import SqliteJournal

        assert settings.path is not None
        return SqliteJournal(
            settings.path,
            operation_timeout=settings.operation_timeout,
            max_event_size=settings.max_event_size,
            snapshot_every=settings.snapshot_every,
            threads=settings.connections,
            group_commit_max_events=settings.group_commit_max_events,
            group_commit_max_bytes=settings.group_commit_max_bytes,
        )
    if settings.backend == "postgresql":
        try:
            from ._postgres import PostgresJournal
        except ImportError as exc:
            raise ConfigurationError(
                "[journal] backend = 'postgresql' needs psycopg 3: install p2pshard[postgresql] "
                f"(pip install 'psycopg[binary]'); importing it failed: {exc}"
            ) from exc
        assert settings.dsn is not None
        return PostgresJournal(
            settings.dsn,
            operation_timeout=settings.operation_timeout,
            max_event_size=settings.max_event_size,
            snapshot_every=settings.snapshot_every,
            connections=settings.connections,
            group_commit_max_events=settings.group_commit_max_events,
            group_commit_max_bytes=settings.group_commit_max_bytes,
        )
    raise ConfigurationError(
        "JournalSettings.backend = None is invalid here: set [journal] backend to 'sqlite' "
        "(with path) or 'postgresql' (with dsn)"
    )
