"""The ``[journal]`` table: JournalSettings, loading it, and how a node opens its journal."""

from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest
import trio
import trio.testing

from membership import Address, LinkConditions, SimNetwork
from p2pshard import (
    ConfigurationError,
    JournalError,
    JournalSettings,
    MemoryJournal,
    NodeConfig,
    PostgresJournal,
    SqliteJournal,
    TlsFiles,
    open_journal,
    open_node,
)

TLS = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))
MINIMAL = """\
cluster_name = "shop"
node_name = "node-1"

[tls]
ca_file = "ca.pem"
cert_file = "n.pem"
key_file = "n.key"
"""


def load(tmp_path: Path, text: str, **environ: str) -> NodeConfig:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return NodeConfig.load(path, environ=environ)


def test_defaults_are_no_journal_with_sensible_limits() -> None:
    settings = JournalSettings()
    assert settings.backend is None
    assert settings.operation_timeout == 5.0
    assert settings.snapshot_every == 100
    assert settings.max_event_size == 1 << 20
    assert NodeConfig(cluster_name="shop", node_name="n", tls=TLS).journal == settings


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"backend": "mysql"},
            "JournalSettings.backend = 'mysql' is invalid: must be 'sqlite', 'postgresql' or None",
        ),
        ({"backend": "sqlite"}, "JournalSettings.path is missing: backend 'sqlite' needs"),
        ({"backend": "postgresql"}, "JournalSettings.dsn is missing: backend 'postgresql' needs"),
        ({"dsn": "  "}, "JournalSettings.dsn = '  ' is invalid: must be a PostgreSQL connection"),
        ({"path": Path()}, r"JournalSettings.path = PosixPath\('.'\) is invalid"),
        (
            {"operation_timeout": 0},
            "JournalSettings.operation_timeout = 0 is invalid: must be a number from 0.01 to 3600",
        ),
        (
            {"snapshot_every": 0},
            "JournalSettings.snapshot_every = 0 is invalid: must be an integer from 1",
        ),
        ({"snapshot_every": 2.5}, "JournalSettings.snapshot_every = 2.5 is invalid"),
        (
            {"max_event_size": -1},
            "JournalSettings.max_event_size = -1 is invalid: must be an integer from 1 to",
        ),
    ],
)
def test_invalid_settings_name_the_field_the_value_and_what_is_allowed(
    changes: dict[str, object], expected: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{expected}"):
        JournalSettings(**changes)  # type: ignore[arg-type]


def test_the_journal_table_loads_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL
        + textwrap.dedent("""
            [journal]
            backend = "sqlite"
            path = "data/journal.db"
            snapshot_every = ""
            max_event_size = 4096
            """),
    )
    assert config.journal == JournalSettings(
        backend="sqlite",
        path=tmp_path / "data" / "journal.db",
        snapshot_every=None,
        max_event_size=4096,
    )


def test_environment_variables_set_the_journal(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL,
        P2PSHARD_JOURNAL__BACKEND="postgresql",
        P2PSHARD_JOURNAL__DSN="host=db-host dbname=shop",
        P2PSHARD_JOURNAL__OPERATION_TIMEOUT="2.5",
    )
    assert config.journal.backend == "postgresql"
    assert config.journal.dsn == "host=db-host dbname=shop"
    assert config.journal.operation_timeout == 2.5


def test_bad_journal_values_in_a_file_are_located(tmp_path: Path) -> None:
    file = tmp_path / "node.toml"
    with pytest.raises(ConfigurationError) as caught:
        load(tmp_path, MINIMAL + '\n[journal]\nbackend = "mysql"\n')
    assert str(caught.value) == (
        f"journal.backend = 'mysql' is invalid: expected one of 'sqlite', 'postgresql' (in {file})"
    )
    with pytest.raises(ConfigurationError, match=r"^journal.path is missing: backend 'sqlite'"):
        load(tmp_path, MINIMAL + '\n[journal]\nbackend = "sqlite"\n')
    with pytest.raises(ConfigurationError, match=r"^journal.snapshot_every = 0 is invalid"):
        load(tmp_path, MINIMAL + "\n[journal]\nsnapshot_every = 0\n")
    with pytest.raises(ConfigurationError, match=r"unknown key 'journal.pth'.*did you mean path"):
        load(tmp_path, MINIMAL + '\n[journal]\npth = "x.db"\n')


def test_the_journal_table_round_trips(tmp_path: Path) -> None:
    config = NodeConfig(
        cluster_name="shop",
        node_name="node-1",
        tls=TLS,
        journal=JournalSettings(
            backend="postgresql",
            dsn="postgresql://p2pshard@db-host/shop",
            operation_timeout=3.0,
            snapshot_every=None,
        ),
    )
    text = config.to_toml()
    assert '\n[journal]\nbackend = "postgresql"\n' in text
    assert load(tmp_path, text).journal == config.journal


def test_open_journal_builds_the_backend_the_settings_name(tmp_path: Path) -> None:
    sqlite = open_journal(
        JournalSettings(backend="sqlite", path=tmp_path / "j.db", snapshot_every=7)
    )
    assert isinstance(sqlite, SqliteJournal)
    assert sqlite.path == tmp_path / "j.db"
    assert sqlite.snapshot_every == 7
    postgres = open_journal(
        JournalSettings(backend="postgresql", dsn="host=db-host port=6543 password=secret")
    )
    assert isinstance(postgres, PostgresJournal)
    assert postgres.where == "db-host:6543/"  # never the password
    with pytest.raises(ConfigurationError, match=r"backend = None is invalid here"):
        open_journal(JournalSettings())


def _config(journal: JournalSettings) -> NodeConfig:
    return NodeConfig(
        cluster_name="sim",
        node_name="n1",
        bind_host="10.0.0.1",
        bind_port=1,
        seed_nodes=(Address("10.0.0.1", 1),),
        tls=TLS,
        journal=journal,
    )


async def test_a_node_opens_the_configured_journal_and_closes_it(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    net = SimNetwork(1, conditions=LinkConditions(delay_min=0.001, delay_max=0.002))
    settings = JournalSettings(backend="sqlite", path=tmp_path / "journal.db")
    async with (
        net.transport(Address("10.0.0.1", 1), "n1") as transport,
        open_node(_config(settings), transport=transport, rng=random.Random(1)) as node,
    ):
        journal = node.journal
        assert isinstance(journal, SqliteJournal)
        assert journal.path == tmp_path / "journal.db"
    with pytest.raises(JournalError, match="closed"):  # closed with the node
        await journal.recover("Room|r", None)


async def test_a_node_without_a_journal_says_how_to_configure_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(2, conditions=LinkConditions(delay_min=0.001, delay_max=0.002))
    async with (
        net.transport(Address("10.0.0.1", 1), "n1") as transport,
        open_node(_config(JournalSettings()), transport=transport, rng=random.Random(1)) as node,
    ):
        with pytest.raises(ConfigurationError, match=r"no journal: set \[journal\] backend"):
            _ = node.journal


async def test_a_journal_handed_to_the_node_is_used_and_left_open(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    net = SimNetwork(3, conditions=LinkConditions(delay_min=0.001, delay_max=0.002))
    given = MemoryJournal()
    settings = JournalSettings(backend="sqlite", path=tmp_path / "unused.db")
    async with (
        net.transport(Address("10.0.0.1", 1), "n1") as transport,
        open_node(
            _config(settings), transport=transport, rng=random.Random(1), journal=given
        ) as node,
    ):
        assert node.journal is given
    await given.append("Room|r", 1, [b"still open"], token=None)
    assert not (tmp_path / "unused.db").exists()
