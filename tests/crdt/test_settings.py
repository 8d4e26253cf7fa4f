"""ReplicatorSettings (crdt._settings) and how NodeConfig holds and loads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from crdt import ReplicatorSettings
from membership import ConfigurationError, TransportSettings
from p2pshard import NodeConfig, TlsFiles

TLS = TlsFiles(
    ca_file=Path("/pki/ca.pem"), cert_file=Path("/pki/node-1.pem"), key_file=Path("/pki/node-1.key")
)

MINIMAL = """\
cluster_name = "shop"
node_name = "node-1"

[tls]
ca_file = "/pki/ca.pem"
cert_file = "/pki/node-1.pem"
key_file = "/pki/node-1.key"
"""

REPLICATOR_TABLE = """
[replicator]
durable_keys = ["coord-*"]
durable_path = "data/x.sqlite"
"""


def write(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "node.toml"
    path.write_text(text, encoding="utf-8")
    return path


def node_config(**changes: Any) -> NodeConfig:
    return NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS, **changes)


# --- ReplicatorSettings --------------------------------------------------------------------------


def test_defaults() -> None:
    settings = ReplicatorSettings()
    assert settings.name == "ddata"
    assert settings.role is None
    assert settings.gossip_interval == 2.0
    assert settings.delta_interval == 0.2
    assert settings.notify_interval == 0.5
    assert settings.digest_buckets == 64
    assert settings.max_message_bytes == 256 * 1024
    assert settings.durable_keys == ()
    assert settings.durable_path is None
    assert settings.compact_after == 500
    assert not settings.is_durable("anything")


def test_frozen_and_keyword_only() -> None:
    settings = ReplicatorSettings()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ReplicatorSettings("ddata")  # type: ignore[call-arg]
    assert settings == ReplicatorSettings()
    assert settings != ReplicatorSettings(name="other")


def test_durable_keys_need_a_durable_path() -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        ReplicatorSettings(durable_keys=["coord-*", "lease-*"])
    assert str(excinfo.value) == (
        "ReplicatorSettings.durable_keys = ['coord-*', 'lease-*'] needs a durable_path: the "
        "SQLite file to keep them in"
    )


def test_durable_path_without_durable_keys_is_allowed() -> None:
    settings = ReplicatorSettings(durable_path=Path("/data/x.sqlite"))
    assert settings.durable_path == Path("/data/x.sqlite")
    assert not settings.is_durable("coord-1")


def test_list_of_keys_becomes_a_tuple_and_string_path_a_path() -> None:
    settings = ReplicatorSettings(
        durable_keys=["coord-*", "lease"],
        durable_path="data/x.sqlite",
    )
    assert settings.durable_keys == ("coord-*", "lease")
    assert isinstance(settings.durable_keys, tuple)
    assert settings.durable_path == Path("data/x.sqlite")
    assert isinstance(settings.durable_path, Path)
    # Equal to the same settings given as a tuple and a Path.
    assert settings == ReplicatorSettings(
        durable_keys=("coord-*", "lease"), durable_path=Path("data/x.sqlite")
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"gossip_interval": 0},
            "ReplicatorSettings.gossip_interval = 0 is invalid: must be a number from 0.01 to 3600",
        ),
        (
            {"gossip_interval": 3601.0},
            "ReplicatorSettings.gossip_interval = 3601.0 is invalid: must be a number from 0.01",
        ),
        (
            {"delta_interval": -1.0},
            "ReplicatorSettings.delta_interval = -1.0 is invalid: must be a number from 0.001",
        ),
        (
            {"notify_interval": "1"},
            "ReplicatorSettings.notify_interval = '1' is invalid: must be a number from 0.001",
        ),
        (
            {"digest_buckets": 0},
            "ReplicatorSettings.digest_buckets = 0 is invalid: must be an integer from 1 to 4096",
        ),
        (
            {"digest_buckets": 4097},
            "ReplicatorSettings.digest_buckets = 4097 is invalid: must be an integer from 1",
        ),
        (
            {"digest_buckets": 64.0},
            "ReplicatorSettings.digest_buckets = 64.0 is invalid: must be an integer",
        ),
        (
            {"max_message_bytes": 1023},
            "ReplicatorSettings.max_message_bytes = 1023 is invalid: must be an integer from 1024",
        ),
        (
            {"compact_after": 0},
            "ReplicatorSettings.compact_after = 0 is invalid: must be an integer from 1",
        ),
        (
            {"compact_after": True},
            "ReplicatorSettings.compact_after = True is invalid: must be an integer",
        ),
        (
            {"name": "bad name"},
            "ReplicatorSettings.name = 'bad name' is invalid: use 1 to 63 letters, digits",
        ),
        ({"name": ""}, "ReplicatorSettings.name = '' is invalid: use 1 to 63"),
        ({"name": "-ddata"}, "ReplicatorSettings.name = '-ddata' is invalid"),
        ({"role": ""}, "ReplicatorSettings.role = '' is invalid: must be None or a role name"),
        ({"role": "a b"}, "ReplicatorSettings.role = 'a b' is invalid"),
        ({"role": 5}, "ReplicatorSettings.role = 5 is invalid"),
        (
            {"durable_keys": "coord-*", "durable_path": Path("x")},
            "ReplicatorSettings.durable_keys = 'coord-*' is invalid: must be a list of non-empty "
            "glob patterns such as 'coordinator-*'",
        ),
        (
            {"durable_keys": ["coord-*", ""], "durable_path": Path("x")},
            "ReplicatorSettings.durable_keys = ('coord-*', '') is invalid: must be a list of",
        ),
        (
            {"durable_keys": [1], "durable_path": Path("x")},
            "ReplicatorSettings.durable_keys = (1,) is invalid: must be a list of",
        ),
    ],
)
def test_invalid_values_name_the_field(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        ReplicatorSettings(**changes)
    assert str(excinfo.value).startswith(expected)


def test_boundaries_are_accepted() -> None:
    settings = ReplicatorSettings(
        name="a",
        gossip_interval=0.01,
        delta_interval=3600,
        digest_buckets=4096,
        max_message_bytes=1024,
        compact_after=1,
    )
    assert settings.digest_buckets == 4096
    assert ReplicatorSettings(name="x" * 63).name == "x" * 63
    with pytest.raises(ConfigurationError, match=r"ReplicatorSettings\.name"):
        ReplicatorSettings(name="x" * 64)


@pytest.mark.parametrize("bad", [123, Path()])
def test_bad_durable_path_is_rejected(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"^ReplicatorSettings\.durable_path = "):
        ReplicatorSettings(durable_keys=["coord-*"], durable_path=bad)


def test_an_empty_durable_path_means_none() -> None:
    assert ReplicatorSettings(durable_path="").durable_path is None
    with pytest.raises(ConfigurationError, match="needs a durable_path"):
        ReplicatorSettings(durable_keys=["coord-*"], durable_path="")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("coord-1", True),
        ("coord-", True),  # * matches nothing too
        ("coord", False),
        ("COORD-1", False),  # case-sensitive on every platform
        ("xcoord-1", False),
        ("lease", True),
        ("lease-1", False),
        ("shard-7", True),
        ("shard-17", False),
        ("a-x", True),
        ("b-", True),
        ("c-x", False),
        ("", False),
    ],
)
def test_is_durable_glob_matching(key: str, expected: bool) -> None:
    settings = ReplicatorSettings(
        durable_keys=("coord-*", "lease", "shard-?", "[ab]-*"), durable_path=Path("x.sqlite")
    )
    assert settings.is_durable(key) is expected


def test_star_makes_every_key_durable() -> None:
    settings = ReplicatorSettings(durable_keys=("*",), durable_path=Path("x.sqlite"))
    assert all(settings.is_durable(key) for key in ("", "a", "coord-1", "x/y"))


# --- NodeConfig: max_message_bytes against the transport's frame size ---------------------------


@pytest.mark.parametrize(
    ("max_message_bytes", "max_frame_size"),
    [(2049, 4096), (2049, 4097), (4096, 4096), (1 << 20, 1 << 20), (600_000, 1 << 20)],
)
def test_message_bytes_above_half_the_frame_size(
    max_message_bytes: int, max_frame_size: int
) -> None:
    with pytest.raises(ConfigurationError) as excinfo:
        node_config(
            replicator=ReplicatorSettings(max_message_bytes=max_message_bytes),
            transport=TransportSettings(max_frame_size=max_frame_size),
        )
    assert str(excinfo.value) == (
        f"NodeConfig.replicator.max_message_bytes = {max_message_bytes} is invalid: must be at "
        f"most half of transport.max_frame_size ({max_frame_size}), to leave room for the "
        "message around the payload"
    )


@pytest.mark.parametrize(
    ("max_message_bytes", "max_frame_size"),
    [(2048, 4096), (2048, 4097), (1024, 2048), (1 << 19, 1 << 20), (256 << 10, 1 << 20)],
)
def test_message_bytes_up_to_half_the_frame_size(
    max_message_bytes: int, max_frame_size: int
) -> None:
    config = node_config(
        replicator=ReplicatorSettings(max_message_bytes=max_message_bytes),
        transport=TransportSettings(max_frame_size=max_frame_size),
    )
    assert config.replicator.max_message_bytes == max_message_bytes


def test_default_replicator_fits_the_default_transport() -> None:
    config = node_config()
    assert config.replicator == ReplicatorSettings()
    assert config.replicator.max_message_bytes <= config.transport.max_frame_size // 2
    # The default message size does not fit a transport with small frames.
    with pytest.raises(ConfigurationError, match=r"replicator\.max_message_bytes = 262144"):
        node_config(transport=TransportSettings(max_frame_size=256 << 10))


def test_not_replicator_settings() -> None:
    with pytest.raises(ConfigurationError, match="must be a ReplicatorSettings"):
        node_config(replicator={"name": "ddata"})


# --- NodeConfig.load: the [replicator] table -----------------------------------------------------


def test_replicator_table_in_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "conf", MINIMAL + REPLICATOR_TABLE)
    config = NodeConfig.load("conf/node.toml", environ={})
    assert config.replicator.durable_keys == ("coord-*",)
    # Relative to the file's directory, as the [tls] paths are (not to the working directory).
    assert config.replicator.durable_path == tmp_path / "conf" / "data" / "x.sqlite"
    assert config.replicator.is_durable("coord-7")
    assert config.replicator == ReplicatorSettings(
        durable_keys=("coord-*",), durable_path=tmp_path / "conf" / "data" / "x.sqlite"
    )


def test_replicator_paths_resolve_like_tls_paths(tmp_path: Path) -> None:
    text = MINIMAL.replace('"/pki/ca.pem"', '"../ca.pem"') + REPLICATOR_TABLE.replace(
        "data/x.sqlite", "../data/x.sqlite"
    )
    config = NodeConfig.load(write(tmp_path / "conf", text), environ={})
    assert config.tls.ca_file == tmp_path / "conf" / ".." / "ca.pem"
    assert config.replicator.durable_path == tmp_path / "conf" / ".." / "data" / "x.sqlite"


def test_absolute_durable_path_in_file(tmp_path: Path) -> None:
    text = MINIMAL + REPLICATOR_TABLE.replace("data/x.sqlite", "/var/lib/p2pshard/x.sqlite")
    config = NodeConfig.load(write(tmp_path, text), environ={})
    assert config.replicator.durable_path == Path("/var/lib/p2pshard/x.sqlite")


def test_replicator_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "conf", MINIMAL + REPLICATOR_TABLE)
    config = NodeConfig.load(
        path,
        environ={
            "P2PSHARD_REPLICATOR__DURABLE_KEYS": "a-*, b",
            "P2PSHARD_REPLICATOR__DURABLE_PATH": "rel/y.sqlite",
            "P2PSHARD_REPLICATOR__GOSSIP_INTERVAL": "0.5",
        },
    )
    assert config.replicator.durable_keys == ("a-*", "b")
    # From the environment, relative to the working directory, as for the [tls] paths.
    assert config.replicator.durable_path == Path("rel/y.sqlite")
    assert config.replicator.gossip_interval == 0.5


def test_replicator_table_missing_durable_path(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[replicator]\ndurable_keys = ["coord-*"]\n')
    with pytest.raises(ConfigurationError) as excinfo:
        NodeConfig.load(path, environ={})
    message = str(excinfo.value)
    assert message.startswith("replicator.durable_keys = ['coord-*'] needs a durable_path")
    assert str(path) in message


def test_replicator_bad_value_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "\n[replicator]\ndigest_buckets = 0\n")
    with pytest.raises(ConfigurationError) as excinfo:
        NodeConfig.load(path, environ={})
    assert str(excinfo.value) == (
        f"replicator.digest_buckets = 0 is invalid: must be an integer from 1 to 4096 (in {path})"
    )


def test_message_bytes_check_when_loading(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        MINIMAL + "\n[transport]\nmax_frame_size = 65536\n\n[replicator]\nmax_message_bytes = "
        "40000\n",
    )
    with pytest.raises(ConfigurationError) as excinfo:
        NodeConfig.load(path, environ={})
    message = str(excinfo.value)
    assert message.startswith("replicator.max_message_bytes = 40000 is invalid: must be at most")
    assert str(path) in message
    config = NodeConfig.load(path, environ={"P2PSHARD_REPLICATOR__MAX_MESSAGE_BYTES": "32768"})
    assert config.replicator.max_message_bytes == 32768


def test_replicator_round_trip(tmp_path: Path) -> None:
    config = node_config(
        replicator=ReplicatorSettings(
            name="state",
            role="backend",
            gossip_interval=1.5,
            digest_buckets=16,
            durable_keys=("coord-*", "lease"),
            durable_path=tmp_path / "data" / "x.sqlite",
            compact_after=10,
        )
    )
    text = config.to_toml()
    assert "\n[replicator]\n" in text
    assert NodeConfig.load(write(tmp_path, text), environ={}) == config
