from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Literal

import attrs
import pytest

from membership import (
    Address,
    ConfigurationError,
    IdentityKind,
    PeerIdentity,
    TransportSettings,
)
from membership._cluster_settings import ClusterSettings
from membership._failure_detector import FailureDetectorSettings
from membership.sbr._settings import SplitBrainResolverSettings
from membership.transport._certs import create_certificate, create_cluster_ca
from membership.transport._tls import DenyList
from p2pshard import ClientConfig, DiscoverySettings, ManagementSettings, NodeConfig, TlsFiles

TLS = TlsFiles(
    ca_file=Path("/pki/ca.pem"), cert_file=Path("/pki/node-1.pem"), key_file=Path("/pki/node-1.key")
)

# Top-level keys must come before the first table: tests prepend keys and append tables.
MINIMAL = """\
cluster_name = "shop"
node_name = "node-1"

[tls]
ca_file = "/pki/ca.pem"
cert_file = "/pki/node-1.pem"
key_file = "/pki/node-1.key"
"""


def write(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "node.toml"
    path.write_text(text, encoding="utf-8")
    return path


def load(directory: Path, text: str, **environ: str) -> NodeConfig:
    return NodeConfig.load(write(directory, text), environ=environ)


def load_error(directory: Path, text: str, **environ: str) -> str:
    with pytest.raises(ConfigurationError) as excinfo:
        load(directory, text, **environ)
    return str(excinfo.value)


# --- building in code ---------------------------------------------------------------------------


def test_defaults_and_addresses() -> None:
    config = NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS)
    assert config.bind_address == Address("127.0.0.1", 25520)
    assert config.canonical_address == config.bind_address
    assert config.seed_nodes == ()
    assert config.roles == ()
    assert config.transport == TransportSettings()
    assert config.cluster == ClusterSettings()
    assert config.failure_detector == FailureDetectorSettings()
    assert config.split_brain_resolver == SplitBrainResolverSettings()
    assert config.log_level == "INFO"
    assert config.shutdown_timeout == 10.0


def test_canonical_address_differs_from_bind_address() -> None:
    config = NodeConfig(
        cluster_name="shop",
        node_name="node-1",
        tls=TLS,
        bind_host="0.0.0.0",
        bind_port=2552,
        canonical_host="node-1.shop.internal",
    )
    assert config.bind_address == Address("0.0.0.0", 2552)
    assert config.canonical_address == Address("node-1.shop.internal", 2552)
    assert attrs.evolve(config, canonical_port=30552).canonical_address == Address(
        "node-1.shop.internal", 30552
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"cluster_name": "my shop"},
            "NodeConfig.cluster_name = 'my shop' is invalid: use 1 to 63",
        ),
        ({"node_name": ""}, "NodeConfig.node_name = '' is invalid"),
        ({"bind_host": ""}, "NodeConfig.bind_host = '' is invalid: must be a host name"),
        (
            {"bind_port": 65536},
            "NodeConfig.bind_port = 65536 is invalid: must be an integer from 0",
        ),
        ({"bind_port": True}, "NodeConfig.bind_port = True is invalid"),
        (
            {"canonical_port": 0},
            "NodeConfig.canonical_port = 0 is invalid: must be an integer from 1",
        ),
        ({"seed_nodes": ("127.0.0.1:2551",)}, "NodeConfig.seed_nodes = ('127.0.0.1:2551',) is inv"),
        ({"seed_nodes": (Address("h", 0),)}, "ports from 1 to 65535"),
        ({"roles": ["a"]}, "NodeConfig.roles = ['a'] is invalid: must be a tuple"),
        ({"roles": ("a,b",)}, "NodeConfig.roles = ('a,b',) is invalid"),
        ({"tls": "certs"}, "NodeConfig.tls = 'certs' is invalid: must be a TlsFiles"),
        ({"transport": {}}, "NodeConfig.transport = {} is invalid: must be a TransportSettings"),
        ({"cluster": None}, "NodeConfig.cluster = None is invalid: must be a ClusterSettings"),
        (
            {"failure_detector": FailureDetectorSettings},
            "NodeConfig.failure_detector = <class 'membership._failure_detector.FailureDetector",
        ),
        (
            {"split_brain_resolver": ClusterSettings()},
            "is invalid: must be a SplitBrainResolverSettings",
        ),
        (
            {"log_level": "debug"},
            "NodeConfig.log_level = 'debug' is invalid: must be one of DEBUG,",
        ),
        ({"shutdown_timeout": 0}, "NodeConfig.shutdown_timeout = 0 is invalid: must be a number"),
        ({"shutdown_timeout": float("inf")}, "NodeConfig.shutdown_timeout = inf is invalid"),
        ({"bind_host": "0.0.0.0"}, "NodeConfig.canonical_host = None is invalid: it is required"),
        ({"app_version": "v 2"}, "NodeConfig.app_version = 'v 2' is invalid: must be empty or"),
        ({"app_version": "-rc1"}, "NodeConfig.app_version = '-rc1' is invalid"),
        ({"app_version": "1" * 65}, "up to 64 letters, digits and '.+_-'"),
        ({"app_version": 2}, "NodeConfig.app_version = 2 is invalid"),
        ({"app": "shop.app"}, "NodeConfig.app = 'shop.app' is invalid: the ':' is missing"),
        ({"app": "shop/app.py:setup"}, "'shop/app.py' is not a module name"),
        ({"app": "shop.app:"}, "NodeConfig.app = 'shop.app:' is invalid: '' is not a function"),
        ({"app": 3}, "NodeConfig.app = 3 is invalid: must be a string MODULE:FUNCTION"),
    ],
)
def test_invalid_values_fail_at_construction(changes: dict[str, object], expected: str) -> None:
    arguments: dict[str, object] = {"cluster_name": "shop", "node_name": "node-1", "tls": TLS}
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        NodeConfig(**{**arguments, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [Path(), Path(""), "ca.pem"])
def test_tls_files_must_be_non_empty_paths(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=r"TlsFiles\.ca_file = .* is invalid: must be a"):
        TlsFiles(ca_file=bad, cert_file=Path("c"), key_file=Path("k"))  # type: ignore[arg-type]


# --- writing and loading ------------------------------------------------------------------------


def test_round_trip_of_every_field(tmp_path: Path) -> None:
    odd = tmp_path / 'dir with "quotes", \\ and ünïcödé'
    config = NodeConfig(
        cluster_name="shop",
        node_name="node-1",
        bind_host="::",
        bind_port=0,
        canonical_host="node-1.shop.internal",
        canonical_port=30552,
        seed_nodes=(Address.parse("10.0.0.1:2551"), Address.parse("[::1]:2552")),
        roles=("backend", "eu-west"),
        tls=TlsFiles(ca_file=odd / "ca.pem", cert_file=odd / "n.pem", key_file=odd / "n\t.key"),
        transport=TransportSettings(max_frame_size=2 << 20, connect_timeout=0.25),
        cluster=ClusterSettings(
            gossip_interval=0.5,
            weakly_up_after=None,  # the default is 7.0: written as ""
            min_nr_of_members=3,
            min_nr_of_members_of_role=(("backend", 2), ("eu.west", 1), ('q"uote', 4)),
            prune_gossip_tombstones_after=3600.0,
        ),
        failure_detector=FailureDetectorSettings(
            threshold=12.0, acceptable_heartbeat_pause=6.0, max_sample_size=200
        ),
        split_brain_resolver=SplitBrainResolverSettings(
            active_strategy="static-quorum",
            quorum_size=3,
            down_all_when_unstable=15.0,
            role="backend",
            down_if_alone=False,
            lease_name="shop-lease",
        ),
        log_level="DEBUG",
        shutdown_timeout=2.5,
    )
    text = config.to_toml()
    assert '\nweakly_up_after = ""\n' in text
    assert '\n[cluster.min_nr_of_members_of_role]\nbackend = 2\n"eu.west" = 1\n' in text
    assert NodeConfig.load(write(tmp_path, text), environ={}) == config


@pytest.mark.parametrize(
    "settings",
    [
        SplitBrainResolverSettings(active_strategy="keep-oldest", down_all_when_unstable="off"),
        SplitBrainResolverSettings(active_strategy="down-all", down_all_when_unstable=4),
        SplitBrainResolverSettings(active_strategy="lease-majority", stable_after=7.0),
    ],
)
def test_round_trip_of_split_brain_resolver(
    tmp_path: Path, settings: SplitBrainResolverSettings
) -> None:
    config = NodeConfig(
        cluster_name="shop", node_name="node-1", tls=TLS, split_brain_resolver=settings
    )
    loaded = NodeConfig.load(write(tmp_path, config.to_toml()), environ={})
    assert loaded == config
    assert loaded.split_brain_resolver.down_all_when_unstable_after == (
        settings.down_all_when_unstable_after
    )


def test_round_trip_of_defaults(tmp_path: Path) -> None:
    config = NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS)
    text = config.to_toml()
    assert "canonical_host" not in text  # None is left out when it is the default: TOML has no null
    assert "lease_name" not in text
    assert "\nweakly_up_after = 7.0\n" in text
    assert "\n[cluster.min_nr_of_members_of_role]\n\n[failure_detector]\n" in text  # empty table
    assert '\n[split_brain_resolver]\nactive_strategy = "keep-majority"\n' in text
    assert NodeConfig.load(write(tmp_path, text), environ={}) == config


def test_minimal_file_gets_defaults(tmp_path: Path) -> None:
    assert load(tmp_path, MINIMAL) == NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS)


def test_the_app_comes_from_the_file_or_the_environment(tmp_path: Path) -> None:
    text = MINIMAL.replace("[tls]", 'app = "shop.app:setup"\n\n[tls]')
    assert load(tmp_path, text).app == "shop.app:setup"
    assert load(tmp_path, text, P2PSHARD_APP="shop.jobs:Jobs.setup").app == "shop.jobs:Jobs.setup"
    assert load(tmp_path, MINIMAL).app == ""  # a bare node
    assert load_error(tmp_path, MINIMAL, P2PSHARD_APP="shop") == (
        "app = 'shop' is invalid: the ':' is missing: expected MODULE:FUNCTION, e.g. "
        "'shop.app:setup' (from P2PSHARD_APP)"
    )


def test_example_file_in_docstring_loads(tmp_path: Path) -> None:
    doc = NodeConfig.__doc__
    assert doc is not None
    lines = doc.split("``node.toml``::\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if line.strip() and not line.startswith(" " * 8):
            break
        block.append(line)
    config = load(tmp_path, textwrap.dedent("\n".join(block)))
    assert config.canonical_address == Address("node-1.shop.internal", 25520)
    assert config.tls.ca_file == tmp_path / "certs" / "ca.pem"
    assert config.transport.max_frame_size == 2097152
    assert config.cluster.min_nr_of_members_of_role == (("backend", 2),)
    assert config.failure_detector.threshold == 8.0
    assert config.split_brain_resolver.down_all_when_unstable == "on"
    assert config.app == "shop.app:setup"


def test_relative_paths_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = """\
cluster_name = "shop"
node_name = "node-1"

[tls]
ca_file = "../ca.pem"
cert_file = "certs/node-1.pem"
key_file = "/abs/node-1.key"
"""
    # A relative file path: its directory must be taken absolute, not relative to a later cwd.
    write(tmp_path / "conf", text)
    config = NodeConfig.load("conf/node.toml", environ={})
    assert config.tls.ca_file == tmp_path / "conf" / ".." / "ca.pem"
    assert config.tls.cert_file == tmp_path / "conf" / "certs" / "node-1.pem"
    assert config.tls.key_file == Path("/abs/node-1.key")


def test_int_accepted_for_float_and_stored_as_float(tmp_path: Path) -> None:
    config = load(tmp_path, "shutdown_timeout = 3\n" + MINIMAL)
    assert config.shutdown_timeout == 3.0
    assert isinstance(config.shutdown_timeout, float)


# --- environment overrides ----------------------------------------------------------------------


def test_env_overrides_top_level_fields(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "bind_port = 1111\n" + MINIMAL,
        P2PSHARD_BIND_PORT="2552",
        P2PSHARD_BIND_HOST="0.0.0.0",
        P2PSHARD_CANONICAL_HOST="node-1.shop.internal",
        P2PSHARD_LOG_LEVEL="WARNING",
        P2PSHARD_SHUTDOWN_TIMEOUT="2.5",
        P2PSHARD_ROLES="backend, eu-west",
        PATH="/usr/bin",  # not ours: ignored
        P2PSHARDISH="x",  # no underscore after the prefix: not ours either
    )
    assert config.bind_address == Address("0.0.0.0", 2552)
    assert config.canonical_address == Address("node-1.shop.internal", 2552)
    assert config.log_level == "WARNING"
    assert config.shutdown_timeout == 2.5
    assert config.roles == ("backend", "eu-west")


def test_env_overrides_nested_tls_relative_to_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load(
        tmp_path / "conf",
        MINIMAL,
        P2PSHARD_TLS__CERT_FILE="/etc/p2pshard/node-2.pem",
        P2PSHARD_TLS__KEY_FILE="node-2.key",
    )
    assert config.tls.ca_file == Path("/pki/ca.pem")
    assert config.tls.cert_file == Path("/etc/p2pshard/node-2.pem")
    assert config.tls.key_file == Path("node-2.key")


def test_env_overrides_nested_transport(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL + "\n[transport]\nmax_frame_size = 4096\ninbox_capacity = 7\n",
        P2PSHARD_TRANSPORT__MAX_FRAME_SIZE="2097152",
        P2PSHARD_TRANSPORT__CONNECT_TIMEOUT="1",
    )
    assert config.transport == TransportSettings(
        max_frame_size=2097152, inbox_capacity=7, connect_timeout=1.0
    )


def test_env_transport_override_without_transport_table(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL, P2PSHARD_TRANSPORT__INBOX_CAPACITY="9")
    assert config.transport == TransportSettings(inbox_capacity=9)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2551,127.0.0.1:2552", ("127.0.0.1:2551", "127.0.0.1:2552")),
        (" [::1]:2551 , seed.example:2552, ", ("[::1]:2551", "seed.example:2552")),
        ("", ()),
    ],
)
def test_env_overrides_seed_list(tmp_path: Path, text: str, expected: tuple[str, ...]) -> None:
    config = load(tmp_path, 'seed_nodes = ["10.9.9.9:1"]\n' + MINIMAL, P2PSHARD_SEED_NODES=text)
    assert config.seed_nodes == tuple(Address.parse(a) for a in expected)


def test_empty_env_value_clears_optional_field(tmp_path: Path) -> None:
    config = load(tmp_path, "canonical_port = 30552\n" + MINIMAL, P2PSHARD_CANONICAL_PORT="")
    assert config.canonical_port is None


def test_env_supplies_required_values(tmp_path: Path) -> None:
    text = '[tls]\nca_file = "ca.pem"\ncert_file = "n.pem"\n'
    config = load(
        tmp_path,
        text,
        P2PSHARD_CLUSTER_NAME="shop",
        P2PSHARD_NODE_NAME="node-7",
        P2PSHARD_TLS__KEY_FILE="/k.pem",
    )
    assert (config.cluster_name, config.node_name) == ("shop", "node-7")
    assert config.tls == TlsFiles(
        ca_file=tmp_path / "ca.pem", cert_file=tmp_path / "n.pem", key_file=Path("/k.pem")
    )


def test_environ_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PSHARD_BIND_PORT", "2553")
    assert NodeConfig.load(write(tmp_path, MINIMAL)).bind_port == 2553


# --- load errors: each names the field (or key, or variable), the value and what is allowed ------


def test_bad_port_in_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    assert load_error(tmp_path, "bind_port = 70000\n" + MINIMAL) == (
        f"bind_port = 70000 is invalid: must be an integer from 0 to 65535 (in {path})"
    )


def test_bad_port_in_env(tmp_path: Path) -> None:
    assert load_error(tmp_path, MINIMAL, P2PSHARD_BIND_PORT="70000") == (
        "bind_port = 70000 is invalid: must be an integer from 0 to 65535 (from P2PSHARD_BIND_PORT)"
    )
    assert load_error(tmp_path, MINIMAL, P2PSHARD_BIND_PORT="abc") == (
        "P2PSHARD_BIND_PORT='abc' is invalid: expected an integer"
    )


def test_bad_name(tmp_path: Path) -> None:
    message = load_error(tmp_path, MINIMAL.replace('"node-1"', '"node 1"'))
    assert message.startswith("node_name = 'node 1' is invalid: use 1 to 63 letters")
    assert message.endswith(f"(in {tmp_path / 'node.toml'})")
    message = load_error(tmp_path, MINIMAL, P2PSHARD_CLUSTER_NAME="-shop")
    assert message.startswith("cluster_name = '-shop' is invalid: use 1 to 63 letters")
    assert message.endswith("(from P2PSHARD_CLUSTER_NAME)")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, "bind_prot = 2552\n" + MINIMAL)
    assert message.startswith(
        f"unknown key 'bind_prot' at the top level of {tmp_path / 'node.toml'} "
        "(did you mean bind_port?); allowed: cluster_name, node_name, bind_host, bind_port, "
    )
    assert message.endswith(
        "tls, transport, cluster, failure_detector, split_brain_resolver, replicator, lease, "
        "journal, management, discovery, app, log_level, shutdown_timeout"
    )


def test_unknown_nested_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, MINIMAL + "\n[transport]\nmax_frame = 4096\n")
    assert message.startswith(
        "unknown key 'transport.max_frame' at [transport] of "
        f"{tmp_path / 'node.toml'} (did you mean max_frame_size?); allowed: max_frame_size, "
    )


def test_unknown_table(tmp_path: Path) -> None:
    message = load_error(tmp_path, MINIMAL + "\n[node]\nbind_port = 1\n")
    assert message.startswith("unknown key 'node' at the top level")


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("P2PSHARD_BIND_PROT", " (did you mean P2PSHARD_BIND_PORT?)"),
        (
            "P2PSHARD_TRANSPORT_MAX_FRAME_SIZE",
            " (did you mean P2PSHARD_TRANSPORT__MAX_FRAME_SIZE?)",
        ),
        ("P2PSHARD_TLS", ""),  # a table, not a value
        (
            "P2PSHARD_CLUSTER_GOSSIP_INTERVAL",
            " (did you mean P2PSHARD_CLUSTER__GOSSIP_INTERVAL?)",
        ),
        ("P2PSHARD_BIND_PORT__X", ""),
    ],
)
def test_unknown_env_var(tmp_path: Path, name: str, suggestion: str) -> None:
    message = load_error(tmp_path, MINIMAL, **{name: "1"})
    assert message.startswith(f"environment variable {name} matches no setting")
    assert suggestion in message
    assert "allowed: P2PSHARD_CLUSTER_NAME, " in message
    assert "P2PSHARD_TLS__CA_FILE" in message
    assert "P2PSHARD_TRANSPORT__MAX_FRAME_SIZE" in message
    assert "P2PSHARD_SPLIT_BRAIN_RESOLVER__ACTIVE_STRATEGY" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('bind_port = "2552"', "bind_port = '2552' is invalid: expected an integer"),
        ("bind_port = 2552.0", "bind_port = 2552.0 is invalid: expected an integer"),
        ("bind_host = 127", "bind_host = 127 is invalid: expected a string"),
        ("shutdown_timeout = true", "shutdown_timeout = True is invalid: expected a number"),
        (
            'seed_nodes = "10.0.0.1:2551"',
            "seed_nodes = '10.0.0.1:2551' is invalid: expected an array, each item an address"
            " 'host:port'",
        ),
        (
            'seed_nodes = ["10.0.0.1:2551", "nohost"]',
            "seed_nodes = ['10.0.0.1:2551', 'nohost'] is invalid: item 1 ('nohost'): expected an"
            " address 'host:port'",
        ),
        ("roles = [1]", "roles = [1] is invalid: item 0 (1): expected a string"),
        ('transport = "fast"', "transport = 'fast' is invalid: expected a table [transport]"),
    ],
)
def test_wrong_type_in_file(tmp_path: Path, line: str, expected: str) -> None:
    message = load_error(tmp_path, line + "\n" + MINIMAL)
    assert message == f"{expected} (in {tmp_path / 'node.toml'})"


def test_wrong_type_in_nested_table(tmp_path: Path) -> None:
    message = load_error(tmp_path, MINIMAL + '\n[transport]\nconnect_timeout = "5s"\n')
    assert message.startswith("transport.connect_timeout = '5s' is invalid: expected a number")
    message = load_error(tmp_path, MINIMAL.replace('"/pki/ca.pem"', '""'))
    assert message.startswith("tls.ca_file = '' is invalid: expected a non-empty path")
    message = load_error(tmp_path, MINIMAL.replace('"/pki/ca.pem"', "[]"))
    assert message.startswith("tls.ca_file = [] is invalid: expected a non-empty path")


def test_bad_env_values(tmp_path: Path) -> None:
    assert load_error(tmp_path, MINIMAL, P2PSHARD_SHUTDOWN_TIMEOUT="soon") == (
        "P2PSHARD_SHUTDOWN_TIMEOUT='soon' is invalid: expected a number"
    )
    assert load_error(tmp_path, MINIMAL, P2PSHARD_SEED_NODES="10.0.0.1:2551,nohost").startswith(
        "P2PSHARD_SEED_NODES='10.0.0.1:2551,nohost' is invalid: item 1 ('nohost'): expected an"
    )
    assert load_error(tmp_path, MINIMAL, P2PSHARD_TLS__CA_FILE="") == (
        "P2PSHARD_TLS__CA_FILE='' is invalid: expected a non-empty path"
    )


def test_bad_toml_syntax(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'cluster_name = "shop\n' + MINIMAL)
    assert message.startswith(f"configuration file {tmp_path / 'node.toml'} is not valid TOML: ")
    assert "line 1" in message


def test_file_not_valid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_bytes(b'cluster_name = "\xff"\n')
    with pytest.raises(ConfigurationError, match=re.escape(f"configuration file {path} is not")):
        NodeConfig.load(path, environ={})


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    with pytest.raises(ConfigurationError) as excinfo:
        NodeConfig.load(path, environ={})
    assert str(excinfo.value) == f"cannot read configuration file {path}: No such file or directory"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            MINIMAL.replace('cluster_name = "shop"\n', ""),
            "cluster_name is missing: it is required; set it at the top level of {file} "
            "or with P2PSHARD_CLUSTER_NAME",
        ),
        (
            'cluster_name = "shop"\nnode_name = "n"\n',
            "tls.ca_file is missing: it is required; set it at [tls] of {file} "
            "or with P2PSHARD_TLS__CA_FILE",
        ),
        (
            MINIMAL.replace('key_file = "/pki/node-1.key"\n', ""),
            "tls.key_file is missing: it is required; set it at [tls] of {file} "
            "or with P2PSHARD_TLS__KEY_FILE",
        ),
    ],
)
def test_missing_required_field(tmp_path: Path, text: str, expected: str) -> None:
    assert load_error(tmp_path, text) == expected.format(file=tmp_path / "node.toml")


def test_bad_log_level(tmp_path: Path) -> None:
    assert load_error(tmp_path, 'log_level = "debug"\n' + MINIMAL) == (
        "log_level = 'debug' is invalid: must be one of DEBUG, INFO, WARNING, ERROR "
        f"(in {tmp_path / 'node.toml'})"
    )


def test_invalid_transport_value(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    message = load_error(tmp_path, MINIMAL + "\n[transport]\nmax_frame_size = 10\n")
    assert message.startswith("transport.max_frame_size = 10 is invalid: must be an integer from")
    assert message.endswith(f"(in {path})")
    message = load_error(tmp_path, MINIMAL, P2PSHARD_TRANSPORT__MAX_FRAME_SIZE="10")
    assert message.startswith("transport.max_frame_size = 10 is invalid: must be an integer from")
    assert message.endswith("(from P2PSHARD_TRANSPORT__MAX_FRAME_SIZE)")


def test_invalid_transport_combination(tmp_path: Path) -> None:
    message = load_error(tmp_path, MINIMAL + "\n[transport]\nreconnect_backoff_max = 0.01\n")
    assert message.startswith(
        "transport.reconnect_backoff_max = 0.01 is invalid: must be at least reconnect_backoff_min"
    )
    assert message.endswith(f"(in {tmp_path / 'node.toml'})")


def test_invalid_combination_of_defaults(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'bind_host = "0.0.0.0"\n' + MINIMAL)
    assert message.startswith("canonical_host = None is invalid: it is required when bind_host")
    assert message.endswith(f"(loading {tmp_path / 'node.toml'})")


def test_self_join_from_file_and_env(tmp_path: Path) -> None:
    assert NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS).self_join is False
    assert load(tmp_path, "self_join = true\n" + MINIMAL).self_join is True
    assert load(tmp_path, MINIMAL, P2PSHARD_SELF_JOIN="yes").self_join is True
    config = NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS, self_join=True)
    assert NodeConfig.load(write(tmp_path, config.to_toml()), environ={}) == config


def test_self_join_with_seed_nodes_is_refused(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'self_join = true\nseed_nodes = ["10.0.0.1:2551"]\n' + MINIMAL)
    assert message.startswith("self_join = True is invalid with seed_nodes (10.0.0.1:2551)")
    assert "set seed_nodes = [] or drop self_join" in message
    with pytest.raises(ConfigurationError, match="must be a bool"):
        NodeConfig(cluster_name="shop", node_name="node-1", tls=TLS, self_join=1)  # type: ignore[arg-type]


# --- cluster, failure detector and split brain resolver settings --------------------------------

STRATEGIES = "'keep-majority', 'static-quorum', 'keep-oldest', 'down-all', 'lease-majority'"


def test_settings_tables_in_file(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL
        + """
[cluster]
gossip_interval = 2
weakly_up_after = 3

[cluster.min_nr_of_members_of_role]
frontend = 1
backend = 2

[failure_detector]
threshold = 10.0
monitored_by_nr_of_members = 5

[split_brain_resolver]
active_strategy = "keep-oldest"
down_all_when_unstable = "off"
""",
    )
    assert config.cluster == ClusterSettings(
        gossip_interval=2.0,
        weakly_up_after=3.0,
        min_nr_of_members_of_role=(("backend", 2), ("frontend", 1)),  # sorted by role
    )
    assert isinstance(config.cluster.weakly_up_after, float)
    assert config.failure_detector == FailureDetectorSettings(
        threshold=10.0, monitored_by_nr_of_members=5
    )
    assert config.split_brain_resolver == SplitBrainResolverSettings(
        active_strategy="keep-oldest", down_all_when_unstable="off"
    )


def test_settings_in_env(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL + "\n[cluster.min_nr_of_members_of_role]\nold = 5\n",
        P2PSHARD_CLUSTER__GOSSIP_INTERVAL="0.5",
        P2PSHARD_CLUSTER__WEAKLY_UP_AFTER="",
        P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE=" frontend = 1 ,backend=2,",
        P2PSHARD_FAILURE_DETECTOR__MAX_SAMPLE_SIZE="100",
        P2PSHARD_SPLIT_BRAIN_RESOLVER__ACTIVE_STRATEGY="down-all",
        P2PSHARD_SPLIT_BRAIN_RESOLVER__DOWN_ALL_WHEN_UNSTABLE="12",
    )
    assert config.cluster == ClusterSettings(
        gossip_interval=0.5,
        weakly_up_after=None,
        min_nr_of_members_of_role=(("backend", 2), ("frontend", 1)),  # replaces the file's
    )
    assert config.failure_detector == FailureDetectorSettings(max_sample_size=100)
    assert config.split_brain_resolver == SplitBrainResolverSettings(
        active_strategy="down-all", down_all_when_unstable=12.0
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [('"on"', "on"), ('"off"', "off"), ("12", 12.0), ("2.5", 2.5), ("1e3", 1000.0)],
)
def test_down_all_when_unstable_in_file(tmp_path: Path, line: str, expected: object) -> None:
    text = f"{MINIMAL}\n[split_brain_resolver]\ndown_all_when_unstable = {line}\n"
    value = load(tmp_path, text).split_brain_resolver.down_all_when_unstable
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "expected"), [("on", "on"), ("off", "off"), ("12", 12.0), (" 2.5 ", 2.5)]
)
def test_down_all_when_unstable_in_env(tmp_path: Path, text: str, expected: object) -> None:
    config = load(tmp_path, MINIMAL, P2PSHARD_SPLIT_BRAIN_RESOLVER__DOWN_ALL_WHEN_UNSTABLE=text)
    value = config.split_brain_resolver.down_all_when_unstable
    assert value == expected
    assert type(value) is type(expected)


def test_min_nr_of_members_of_role_as_inline_table_and_empty(tmp_path: Path) -> None:
    text = MINIMAL + '\n[cluster]\nmin_nr_of_members_of_role = { backend = 2, "eu.west" = 3 }\n'
    config = load(tmp_path, text)
    assert config.cluster.min_nr_of_members_of_role == (("backend", 2), ("eu.west", 3))
    config = load(tmp_path, text, P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE="")
    assert config.cluster.min_nr_of_members_of_role == ()


def test_empty_string_sets_optional_field_to_none(tmp_path: Path) -> None:
    config = load(
        tmp_path, 'canonical_host = ""\n' + MINIMAL + '\n[cluster]\nweakly_up_after = ""\n'
    )
    assert config.canonical_host is None
    assert config.cluster.weakly_up_after is None
    config = load(tmp_path, MINIMAL, P2PSHARD_CLUSTER__WEAKLY_UP_AFTER="2")
    assert config.cluster.weakly_up_after == 2.0


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            '[split_brain_resolver]\nactive_strategy = "keep-minority"',
            "split_brain_resolver.active_strategy = 'keep-minority' is invalid: expected one of "
            + STRATEGIES,
        ),
        (
            "[split_brain_resolver]\nactive_strategy = 1",
            f"split_brain_resolver.active_strategy = 1 is invalid: expected one of {STRATEGIES}",
        ),
        (
            '[split_brain_resolver]\ndown_all_when_unstable = "maybe"',
            "split_brain_resolver.down_all_when_unstable = 'maybe' is invalid: expected one of "
            "'on', 'off' or a number",
        ),
        (
            "[split_brain_resolver]\ndown_all_when_unstable = true",
            "split_brain_resolver.down_all_when_unstable = True is invalid: expected one of "
            "'on', 'off' or a number",
        ),
        (
            "[split_brain_resolver]\ndown_all_when_unstable = -1",
            "split_brain_resolver.down_all_when_unstable = -1.0 is invalid: must be 'on', 'off' "
            "or seconds above 0 (up to 604800)",
        ),
        (
            '[cluster.min_nr_of_members_of_role]\nbackend = "two"',
            "cluster.min_nr_of_members_of_role = {'backend': 'two'} is invalid: entry 'backend' "
            "('two'): expected an integer",
        ),
        (
            "[cluster.min_nr_of_members_of_role]\nbackend = 1.5",
            "cluster.min_nr_of_members_of_role = {'backend': 1.5} is invalid: entry 'backend' "
            "(1.5): expected an integer",
        ),
        (
            "[cluster.min_nr_of_members_of_role]\nbackend = 0",
            "cluster.min_nr_of_members_of_role['backend'] = 0 is invalid: "
            "must be an integer of at least 1",
        ),
        (
            '[cluster]\nmin_nr_of_members_of_role = ["backend=2"]',
            "cluster.min_nr_of_members_of_role = ['backend=2'] is invalid: expected a table of "
            "name = value, each value an integer",
        ),
        (
            "[cluster]\ngossip_interval = 0",
            "cluster.gossip_interval = 0.0 is invalid: must be a number from 0.001 to 60",
        ),
        (
            '[cluster]\nweakly_up_after = "off"',
            "cluster.weakly_up_after = 'off' is invalid: expected a number",
        ),
        (
            "[failure_detector]\nmax_sample_size = 0",
            "failure_detector.max_sample_size = 0 is invalid: must be an integer from 1 to 1000000",
        ),
    ],
)
def test_bad_settings_in_file(tmp_path: Path, table: str, expected: str) -> None:
    message = load_error(tmp_path, f"{MINIMAL}\n{table}\n")
    assert message == f"{expected} (in {tmp_path / 'node.toml'})"


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (
            "P2PSHARD_SPLIT_BRAIN_RESOLVER__ACTIVE_STRATEGY",
            "majority",
            "P2PSHARD_SPLIT_BRAIN_RESOLVER__ACTIVE_STRATEGY='majority' is invalid: expected one "
            f"of {STRATEGIES}",
        ),
        (
            "P2PSHARD_SPLIT_BRAIN_RESOLVER__DOWN_ALL_WHEN_UNSTABLE",
            "maybe",
            "P2PSHARD_SPLIT_BRAIN_RESOLVER__DOWN_ALL_WHEN_UNSTABLE='maybe' is invalid: expected "
            "one of 'on', 'off' or a number",
        ),
        (
            "P2PSHARD_SPLIT_BRAIN_RESOLVER__DOWN_ALL_WHEN_UNSTABLE",
            "0",
            "split_brain_resolver.down_all_when_unstable = 0.0 is invalid: must be 'on', 'off' or "
            "seconds above 0 (up to 604800) "
            "(from P2PSHARD_SPLIT_BRAIN_RESOLVER__DOWN_ALL_WHEN_UNSTABLE)",
        ),
        (
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE",
            "backend=2,frontend",
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE='backend=2,frontend' is invalid: entry "
            "'frontend': expected name=value, e.g. a=1,b=2",
        ),
        (
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE",
            "=2",
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE='=2' is invalid: entry '=2': expected "
            "name=value, e.g. a=1,b=2",
        ),
        (
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE",
            "backend=two",
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE='backend=two' is invalid: entry "
            "'backend' ('two'): expected an integer",
        ),
        (
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE",
            "backend=1,backend=2",
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE='backend=1,backend=2' is invalid: entry "
            "'backend=2': 'backend' is given twice",
        ),
        (
            "P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE",
            "backend=0",
            "cluster.min_nr_of_members_of_role['backend'] = 0 is invalid: "
            "must be an integer of at least 1 (from P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE)",
        ),
        (
            "P2PSHARD_CLUSTER__GOSSIP_INTERVAL",
            "120",
            "cluster.gossip_interval = 120.0 is invalid: must be a number from 0.001 to 60 "
            "(from P2PSHARD_CLUSTER__GOSSIP_INTERVAL)",
        ),
        (
            "P2PSHARD_CLUSTER__GOSSIP_INTERVAL",
            "1s",
            "P2PSHARD_CLUSTER__GOSSIP_INTERVAL='1s' is invalid: expected a number",
        ),
    ],
)
def test_bad_settings_in_env(tmp_path: Path, name: str, text: str, expected: str) -> None:
    assert load_error(tmp_path, MINIMAL, **{name: text}) == expected


def test_invalid_split_brain_resolver_combination(tmp_path: Path) -> None:
    message = load_error(
        tmp_path, MINIMAL, P2PSHARD_SPLIT_BRAIN_RESOLVER__ACTIVE_STRATEGY="static-quorum"
    )
    assert message == (
        "split_brain_resolver.quorum_size = None is invalid: must be an integer of at least 1 "
        f"when active_strategy is 'static-quorum' (loading {tmp_path / 'node.toml'})"
    )


def test_stable_after_shorter_than_the_spread_of_detections_is_refused(tmp_path: Path) -> None:
    # With the defaults the members of one partition are found unreachable up to 1 + 1 + 1 s
    # apart (heartbeats, detector reads, gossip): a resolver deciding sooner may see only part.
    message = load_error(tmp_path, MINIMAL + "\n[split_brain_resolver]\nstable_after = 2.5\n")
    assert message.startswith(
        "split_brain_resolver.stable_after = 2.5 is invalid with these timings: must be at "
        "least failure_detector.heartbeat_interval + "
        "failure_detector.unreachable_nodes_reaper_interval + cluster.gossip_interval = 3 s."
    )
    assert "Raise stable_after or make the detector and gossip faster" in message
    assert message.endswith(f"(loading {tmp_path / 'node.toml'})")
    with pytest.raises(ConfigurationError, match=r"stable_after = 1.0 is invalid .* = 1.25 s"):
        NodeConfig(
            cluster_name="shop",
            node_name="node-1",
            tls=TLS,
            cluster=ClusterSettings(gossip_interval=0.5),
            failure_detector=FailureDetectorSettings(
                heartbeat_interval=0.5, unreachable_nodes_reaper_interval=0.25
            ),
            split_brain_resolver=SplitBrainResolverSettings(stable_after=1.0),
        )
    # At the spread it is accepted; a faster detector and gossip allow a shorter stable_after.
    assert load(tmp_path, MINIMAL + "\n[split_brain_resolver]\nstable_after = 3\n")
    faster = """
[cluster]
gossip_interval = 0.5

[failure_detector]
heartbeat_interval = 0.5
unreachable_nodes_reaper_interval = 0.25

[split_brain_resolver]
stable_after = 1.25
"""
    assert load(tmp_path, MINIMAL + faster).split_brain_resolver.stable_after == 1.25
    message = load_error(tmp_path, MINIMAL + faster, P2PSHARD_CLUSTER__GOSSIP_INTERVAL="1")
    assert message.startswith("split_brain_resolver.stable_after = 1.25 is invalid")
    assert "= 1.75 s." in message


# --- the loader is generic: a later package's settings nest the same way -------------------------


@attrs.frozen(kw_only=True)
class ExtraSettings:
    enabled: bool = False
    ratio: float = 0.5
    tags: tuple[str, ...] = ()
    label: str | None = None
    limit: int = attrs.field(default=1, validator=attrs.validators.ge(1))

    def __attrs_post_init__(self) -> None:
        if self.limit > 100:
            raise ConfigurationError(f"ExtraSettings.limit = {self.limit!r} is invalid: max 100")
        if self.label == "oops":
            raise ConfigurationError("a label of 'oops' is not allowed")


@attrs.frozen(kw_only=True)
class ExtendedConfig(NodeConfig):
    extra: ExtraSettings = attrs.field(factory=ExtraSettings)


@attrs.frozen(kw_only=True)
class UnsupportedConfig(NodeConfig):
    weights: dict[str, int] = attrs.field(factory=dict)


def test_nested_settings_class_round_trip(tmp_path: Path) -> None:
    config = ExtendedConfig(
        cluster_name="shop",
        node_name="node-1",
        tls=TLS,
        extra=ExtraSettings(enabled=True, ratio=0.75, tags=("x", 'y"z'), label="l", limit=3),
    )
    text = config.to_toml()
    assert "\n[extra]\nenabled = true\n" in text
    assert ExtendedConfig.load(write(tmp_path, text), environ={}) == config


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("1", True), ("YES", True), ("false", False), ("0", False), ("no", False)],
)
def test_env_bool(tmp_path: Path, text: str, expected: bool) -> None:
    path = write(tmp_path, MINIMAL)
    config = ExtendedConfig.load(path, environ={"P2PSHARD_EXTRA__ENABLED": text})
    assert config.extra.enabled is expected


def test_nested_settings_errors(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[extra]\nenabled = "yes"\n')
    with pytest.raises(ConfigurationError, match=r"^extra\.enabled = 'yes' is invalid: expected"):
        ExtendedConfig.load(path, environ={})
    path = write(tmp_path, MINIMAL)
    with pytest.raises(
        ConfigurationError, match=r"^P2PSHARD_EXTRA__ENABLED='maybe' is invalid: expected true/"
    ):
        ExtendedConfig.load(path, environ={"P2PSHARD_EXTRA__ENABLED": "maybe"})
    with pytest.raises(
        ConfigurationError,
        match=r"^extra\.limit = 101 is invalid: max 100 \(from P2PSHARD_EXTRA__LIMIT\)$",
    ):
        ExtendedConfig.load(path, environ={"P2PSHARD_EXTRA__LIMIT": "101"})


def test_validator_error_of_another_form_names_the_table(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '\n[extra]\nlabel = "oops"\n')
    with pytest.raises(ConfigurationError) as excinfo:
        ExtendedConfig.load(path, environ={})
    assert str(excinfo.value) == f"a label of 'oops' is not allowed (in [extra], loading {path})"


def test_attrs_validator_errors_pass_through(tmp_path: Path) -> None:
    # attrs' own validators raise ValueError, not ConfigurationError: left unchanged.
    path = write(tmp_path, MINIMAL + "\n[extra]\nlimit = 0\n")
    with pytest.raises(ValueError, match="'limit' must be >= 1: 0"):
        ExtendedConfig.load(path, environ={})


def test_unsupported_field_type_is_a_programming_error(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    with pytest.raises(TypeError, match=r"cannot read weights: dict\[str, int\]"):
        UnsupportedConfig.load(path, environ={})


@attrs.frozen(kw_only=True)
class IntLiteralConfig(NodeConfig):
    level: Literal[1, 2] = 1


@attrs.frozen(kw_only=True)
class IntKeyTableConfig(NodeConfig):
    weights: tuple[tuple[int, int], ...] = ()


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (IntLiteralConfig, r"cannot read level: typing\.Literal\[1, 2\]"),
        (IntKeyTableConfig, r"cannot read weights: tuple\[tuple\[int, int\], \.\.\.\]"),
    ],
)
def test_literals_must_be_strings_and_table_keys_too(
    tmp_path: Path, cls: type[NodeConfig], expected: str
) -> None:
    with pytest.raises(TypeError, match=expected):
        cls.load(write(tmp_path, MINIMAL), environ={})


# --- [tls]: several CAs and a deny list -----------------------------------------------------------


def test_tls_takes_more_cas_and_a_deny_list(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL
        + 'ca_files = ["new-ca.pem", "/pki/other.pem"]\n'
        + 'deny = ["serial:0A:1b", "admin:alice", "node:node-7"]\n',
    )
    assert config.tls.ca_files == (tmp_path / "new-ca.pem", Path("/pki/other.pem"))
    assert config.tls.deny == ("serial:0A:1b", "admin:alice", "node:node-7")
    identity = config.tls.identity(config.cluster_name)
    assert identity.trust_files == (
        Path("/pki/ca.pem"),
        tmp_path / "new-ca.pem",
        Path("/pki/other.pem"),
    )
    assert identity.deny == DenyList.parse(["serial:a1b", "admin:alice", "node:node-7"])
    assert (identity.cluster, identity.cert_file, identity.key_file) == (
        "shop",
        Path("/pki/node-1.pem"),
        Path("/pki/node-1.key"),
    )
    assert NodeConfig.load(write(tmp_path / "again", config.to_toml()), environ={}) == config


def test_tls_defaults_to_one_ca_and_no_deny_list(tmp_path: Path) -> None:
    tls = load(tmp_path, MINIMAL).tls
    assert (tls.ca_files, tls.deny) == ((), ())
    assert tls.identity("shop").deny == DenyList()


def test_env_sets_more_cas_and_the_deny_list(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL,
        P2PSHARD_TLS__CA_FILES="/pki/a.pem,/pki/b.pem",
        P2PSHARD_TLS__DENY="admin:eve, serial:ff",
    )
    assert config.tls.ca_files == (Path("/pki/a.pem"), Path("/pki/b.pem"))
    assert config.tls.deny == ("admin:eve", "serial:ff")


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ("eve", "expected 'serial:<hex>'"),
        ("root:eve", "expected 'serial:<hex>'"),
        ("serial:zz", "a serial is hexadecimal digits"),
        ("client:bad name", "client name 'bad name' is invalid"),
    ],
)
def test_a_bad_deny_entry_is_refused_at_load(tmp_path: Path, entry: str, error: str) -> None:
    message = load_error(tmp_path, MINIMAL + f'deny = ["admin:ok", "{entry}"]\n')
    assert message.startswith(
        f"tls.deny = ('admin:ok', {entry!r}) is invalid: deny entry {entry!r} is invalid: {error}"
    )
    assert message.endswith(f"(in {tmp_path / 'node.toml'})")


def test_bad_tls_lists_in_code_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"TlsFiles\.ca_files = \['x'\] is invalid"):
        attrs.evolve(TLS, ca_files=["x"])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"TlsFiles\.deny = \['admin:a'\] is invalid"):
        attrs.evolve(TLS, deny=["admin:a"])  # type: ignore[arg-type]


# --- the client configuration -------------------------------------------------------------------

CLIENT = """\
cluster_name = "shop"

[tls]
ca_file = "ca.pem"
cert_file = "ops/client.pem"
key_file = "ops/client-key.pem"
"""


def client_file(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "client.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_client_file_needs_only_the_cluster_and_its_tls_files(tmp_path: Path) -> None:
    client = ClientConfig.load(client_file(tmp_path, CLIENT))
    assert client == ClientConfig(
        cluster_name="shop",
        tls=TlsFiles(
            ca_file=tmp_path / "ca.pem",
            cert_file=tmp_path / "ops" / "client.pem",
            key_file=tmp_path / "ops" / "client-key.pem",
        ),
    )
    assert (client.bind_host, client.canonical_host) == ("127.0.0.1", None)
    assert client.transport == TransportSettings()


def test_the_client_file_in_the_docstring_loads(tmp_path: Path) -> None:
    doc = ClientConfig.__doc__
    assert doc is not None
    lines = doc.split("``client.toml``::\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if line.strip() and not line.startswith(" " * 8):
            break
        block.append(line)
    client = ClientConfig.load(client_file(tmp_path, textwrap.dedent("\n".join(block))))
    assert client.bind_host == "10.0.0.9"
    assert client.tls.cert_file == tmp_path / "certs" / "ops" / "client.pem"


def test_environment_variables_do_not_apply_to_a_client_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Meant for a node run from the same shell: they neither change nor break a client.
    monkeypatch.setenv("P2PSHARD_BIND_PORT", "2553")
    monkeypatch.setenv("P2PSHARD_BIND_HOST", "10.1.1.1")
    assert ClientConfig.load(client_file(tmp_path, CLIENT)).bind_host == "127.0.0.1"


def test_a_client_file_with_a_node_key_is_refused_naming_it(tmp_path: Path) -> None:
    path = client_file(tmp_path, 'seed_nodes = ["10.0.0.1:25520"]\n' + CLIENT)
    with pytest.raises(ConfigurationError, match=r"unknown key 'seed_nodes' at the top level of"):
        ClientConfig.load(path)
    path = client_file(tmp_path, 'bind_host = "0.0.0.0"\n' + CLIENT)
    with pytest.raises(
        ConfigurationError, match="canonical_host = None is invalid: it is required"
    ):
        ClientConfig.load(path)


def test_a_nodes_file_serves_as_a_client_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'bind_host = "10.0.0.5"\n' + MINIMAL)
    client = ClientConfig.load(path, environ={"P2PSHARD_CANONICAL_HOST": "n1.shop.internal"})
    assert client == ClientConfig(
        cluster_name="shop",
        tls=TLS,
        bind_host="10.0.0.5",
        canonical_host="n1.shop.internal",
    )


@pytest.mark.parametrize("kind", list(IdentityKind))
def test_a_client_is_who_its_certificate_says(tmp_path: Path, kind: IdentityKind) -> None:
    create_cluster_ca("shop", tmp_path / "ca")
    files = create_certificate(PeerIdentity(kind, "ops"), tmp_path / "ca", tmp_path / "ops")
    client = ClientConfig(
        cluster_name="shop",
        tls=TlsFiles(ca_file=files.ca_file, cert_file=files.cert_file, key_file=files.key_file),
    )
    assert client.identity() == PeerIdentity(kind, "ops")
    assert client.tls_identity().cert_file == files.cert_file
    other = attrs.evolve(client, cluster_name="other")
    with pytest.raises(ConfigurationError, match="not for cluster 'other'"):
        other.identity()


# --- the management endpoint ---------------------------------------------------------------------

MANAGEMENT_TOKEN = "a-token-of-32-characters-exactly"


def test_management_is_off_by_default_and_read_from_its_table(tmp_path: Path) -> None:
    assert load(tmp_path, MINIMAL).management == ManagementSettings()
    assert ManagementSettings().enabled is False
    config = load(
        tmp_path,
        MINIMAL
        + f"""
[management]
enabled = true
host = "10.0.0.5"
port = 0
token = "{MANAGEMENT_TOKEN}"
read_token_required = true
ready_give_up_after = 30
""",
    )
    assert config.management == ManagementSettings(
        enabled=True,
        host="10.0.0.5",
        port=0,
        token=MANAGEMENT_TOKEN,
        read_token_required=True,
        ready_give_up_after=30.0,
    )
    assert MANAGEMENT_TOKEN not in repr(config)  # a secret stays out of logged reprs
    assert NodeConfig.load(write(tmp_path / "again", config.to_toml()), environ={}) == config


def test_management_from_the_environment(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL,
        P2PSHARD_MANAGEMENT__ENABLED="yes",
        P2PSHARD_MANAGEMENT__PORT="18558",
        P2PSHARD_MANAGEMENT__TOKEN=MANAGEMENT_TOKEN,
    )
    assert config.management == ManagementSettings(enabled=True, port=18558, token=MANAGEMENT_TOKEN)
    cleared = load(
        tmp_path,
        MINIMAL + f'\n[management]\ntoken = "{MANAGEMENT_TOKEN}"\n',
        P2PSHARD_MANAGEMENT__TOKEN="",
    )
    assert cleared.management.token is None


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            "port = 70000",
            "management.port = 70000 is invalid: must be an integer from 0 to 65535",
        ),
        ('host = ""', "management.host = '' is invalid: must be a host name or IP address"),
        (
            "ready_give_up_after = 0",
            "management.ready_give_up_after = 0.0 is invalid: must be a number of seconds "
            "greater than 0",
        ),
        (
            "read_token_required = true",
            "management.read_token_required = True is invalid without a token: set token (or "
            "P2PSHARD_MANAGEMENT__TOKEN), or read_token_required = false",
        ),
        (
            'token = "short secret"',
            "management.token = <12 characters, not shown> is invalid: must be 16 to 4096 "
            "visible ASCII characters without spaces, such as the output of "
            "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`",
        ),
    ],
)
def test_bad_management_settings_in_file(tmp_path: Path, table: str, expected: str) -> None:
    message = load_error(tmp_path, f"{MINIMAL}\n[management]\n{table}\n")
    assert message == f"{expected} (in {tmp_path / 'node.toml'})"
    assert "short secret" not in message


def test_a_bad_management_token_from_the_environment_is_not_shown(tmp_path: Path) -> None:
    message = load_error(tmp_path, MINIMAL, P2PSHARD_MANAGEMENT__TOKEN="pässwörd-pässwörd")
    assert message.startswith("management.token = <17 characters, not shown> is invalid")
    assert message.endswith("(from P2PSHARD_MANAGEMENT__TOKEN)")
    assert "pässwörd" not in message


# --- discovery -----------------------------------------------------------------------------------

DNS = '\n[discovery]\nmethod = "dns"\nservice_name = "p2pshard.shop.svc.cluster.local"\n'


def test_discovery_is_static_by_default_and_read_from_its_table(tmp_path: Path) -> None:
    assert load(tmp_path, MINIMAL).discovery == DiscoverySettings(method="static")
    text = DNS + textwrap.dedent(
        """\
        lookup = "srv"
        required_contact_points = 3
        stable_margin = 2
        resolve_interval = 0.5
        new_cluster_enabled = false
        nameservers = ["10.0.0.53", "10.0.0.54:5353", "[fd00::53]:53"]
        """
    )
    assert load(tmp_path, MINIMAL + text).discovery == DiscoverySettings(
        method="dns",
        service_name="p2pshard.shop.svc.cluster.local",
        lookup="srv",
        required_contact_points=3,
        stable_margin=2.0,
        resolve_interval=0.5,
        new_cluster_enabled=False,
        nameservers=("10.0.0.53", "10.0.0.54:5353", "[fd00::53]:53"),
    )


def test_discovery_from_the_environment(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        MINIMAL,
        P2PSHARD_DISCOVERY__METHOD="dns",
        P2PSHARD_DISCOVERY__SERVICE_NAME="p2pshard.default.svc.cluster.local",
        P2PSHARD_DISCOVERY__REQUIRED_CONTACT_POINTS="5",
        P2PSHARD_DISCOVERY__NAMESERVERS="10.0.0.53:5353,10.0.0.54",
    )
    assert config.discovery.method == "dns"
    assert config.discovery.service_name == "p2pshard.default.svc.cluster.local"
    assert config.discovery.required_contact_points == 5
    assert config.discovery.nameserver_addresses == (("10.0.0.53", 5353), ("10.0.0.54", 53))
    # The environment turns a file's DNS discovery back into seed nodes, too.
    back = load(
        tmp_path,
        'seed_nodes = ["10.0.0.1:25520"]\n' + MINIMAL + DNS,
        P2PSHARD_DISCOVERY__METHOD="static",
    )
    assert back.discovery.method == "static"
    message = load_error(tmp_path, MINIMAL, P2PSHARD_DISCOVERY__METHOD="mdns")
    assert message == (
        "P2PSHARD_DISCOVERY__METHOD='mdns' is invalid: expected one of 'static', 'dns'"
    )


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            '\n[discovery]\nmethod = "dns"\n',
            "discovery.service_name = '' is invalid with method = 'dns': give the DNS name",
        ),
        (
            DNS + "required_contact_points = 0\n",
            "discovery.required_contact_points = 0 is invalid: must be an integer from 1 to 10000",
        ),
        (
            DNS + "stable_margin = -1\n",
            "discovery.stable_margin = -1.0 is invalid: must be a number of seconds, 0 or more",
        ),
        (
            DNS + "resolve_interval = 0\n",
            "discovery.resolve_interval = 0.0 is invalid: must be a number of seconds greater",
        ),
        (
            DNS + 'nameservers = ["dns.example"]\n',
            "discovery.nameservers = ('dns.example',) is invalid: 'dns.example': 'dns.example' "
            "is not an IP address",
        ),
        (
            DNS + 'nameservers = ["10.0.0.1:99999"]\n',
            "discovery.nameservers = ('10.0.0.1:99999',) is invalid: '10.0.0.1:99999': port "
            "'99999' is not an integer from 1 to 65535",
        ),
        (
            DNS + 'nameservers = ["10.0.0.1:"]\n',
            "'10.0.0.1:': the port after ':' is missing",
        ),
        (
            DNS + 'nameservers = ["fd00::1]:53"]\n',
            "is not an IP address",
        ),
        (
            DNS + 'lookup = "srv"\ncontact_port = 25520\n',
            "discovery.contact_port = 25520 is invalid with lookup = 'srv': SRV records carry",
        ),
        (
            '\n[discovery]\nmethod = "dns"\nservice_name = "bad name"\n',
            "discovery.service_name = 'bad name' is invalid: must be a DNS name",
        ),
        (
            '\n[discovery]\nmethod = "consul"\n',
            "discovery.method = 'consul' is invalid: expected one of 'static', 'dns'",
        ),
    ],
)
def test_bad_discovery_values_are_refused_clearly(
    tmp_path: Path, table: str, expected: str
) -> None:
    assert expected in load_error(tmp_path, MINIMAL + table)


@pytest.mark.parametrize(
    ("top", "given"),
    [('seed_nodes = ["10.0.0.1:25520"]\n', "seed_nodes"), ("self_join = true\n", "self_join")],
)
def test_dns_discovery_contradicts_seed_nodes_and_self_join(
    tmp_path: Path, top: str, given: str
) -> None:
    message = load_error(tmp_path, top + MINIMAL + DNS)
    assert message.startswith(f"discovery.method = 'dns' is invalid with {given}")
    assert f"drop {given}, or set discovery.method = 'static'" in message


def test_dns_discovery_needs_a_port_to_find_the_others_at(tmp_path: Path) -> None:
    message = load_error(tmp_path, "bind_port = 0\n" + MINIMAL + DNS)
    assert "discovery.contact_port = 0 is invalid with bind_port = 0" in message
    assert load(tmp_path, "bind_port = 0\n" + MINIMAL + DNS + "contact_port = 2552\n")
    assert load(tmp_path, "bind_port = 0\ncanonical_port = 2552\n" + MINIMAL + DNS)
