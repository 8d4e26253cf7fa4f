"""Failover profiles: the fast LAN profile passes the settings' own validation, the documented
tables are the profile's, and a profile that breaks a timing rule is refused."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from membership import ConfigurationError
from p2pshard import (
    FAILOVER_PROFILES,
    FAST_LAN,
    FailoverProfile,
    LeaseSettings,
    NodeConfig,
    ShardingSettings,
    TlsFiles,
)

ROOT = Path(__file__).resolve().parents[2]
TLS = TlsFiles(ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key"))
BASE = NodeConfig(
    cluster_name="shop",
    node_name="node-1",
    tls=TLS,
    lease=LeaseSettings(backend="sqlite", path=Path("/var/lib/shop/leases.db")),
)
MINIMAL = """\
cluster_name = "shop"
node_name = "node-1"

[tls]
ca_file = "ca.pem"
cert_file = "n.pem"
key_file = "n.key"
"""


def test_the_fast_lan_profile_makes_a_valid_configuration_and_keeps_the_rest() -> None:
    config = FAST_LAN.apply(BASE)
    fd = config.failure_detector
    assert (fd.heartbeat_interval, fd.first_heartbeat_estimate) == (0.25, 0.25)
    assert (fd.acceptable_heartbeat_pause, fd.threshold) == (1.0, 8.0)
    assert (fd.unreachable_nodes_reaper_interval, fd.expected_response_after) == (0.25, 0.25)
    assert (config.cluster.gossip_interval, config.cluster.leader_actions_interval) == (0.25, 0.25)
    assert config.split_brain_resolver.stable_after == 1.0
    assert (config.lease.ttl, config.lease.renew_interval) == (3.0, 0.5)
    assert (config.lease.operation_timeout, config.lease.safety_margin) == (1.0, 0.5)
    # What the profile does not name stays as it was.
    assert config.lease.backend == "sqlite"
    assert config.lease.path == Path("/var/lib/shop/leases.db")
    assert config.split_brain_resolver.active_strategy == "keep-majority"
    assert config.failure_detector.monitored_by_nr_of_members == 9
    assert config.cluster.seed_node_timeout == BASE.cluster.seed_node_timeout
    sharding = FAST_LAN.sharding(ShardingSettings(rebalance_interval=3.0, use_lease=True))
    assert (sharding.lease_retry_interval, sharding.retry_interval) == (0.5, 0.5)
    assert sharding.state_timeout == 0.25
    assert (sharding.rebalance_interval, sharding.use_lease) == (3.0, True)


def test_the_default_profile_is_what_the_defaults_give() -> None:
    defaults = FAILOVER_PROFILES["default"]
    assert defaults == FailoverProfile.defaults()
    assert defaults.apply(BASE) == BASE
    assert defaults.sharding() == ShardingSettings()
    assert FAILOVER_PROFILES["fast-lan"] is FAST_LAN


def test_floors_follow_the_detector_and_stable_after() -> None:
    # The membership docs: a node silent after a steady history is found gone after about
    # 4.5 s with the default detector (1 s heartbeats, 3 s of pause tolerated, and phi 8 is
    # about 5.2 minimum deviations of 0.1 s later); fast-lan: 0.25 + 1 + 0.52 s.
    defaults = FailoverProfile.defaults()
    assert 4.4 < defaults.detection_time() < 4.6
    assert defaults.floor() == pytest.approx(defaults.detection_time() + 20.0)
    assert 1.7 < FAST_LAN.detection_time() < 1.85
    assert FAST_LAN.floor() == pytest.approx(FAST_LAN.detection_time() + 1.0)
    slower = attrs.evolve(FAST_LAN, threshold=12.0)
    assert slower.detection_time() > FAST_LAN.detection_time()


def test_the_profile_s_tables_load_into_the_same_configuration(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(MINIMAL + "\n" + FAST_LAN.toml())
    loaded = NodeConfig.load(path, environ={})
    plain = NodeConfig(cluster_name="shop", node_name="node-1", tls=loaded.tls)
    assert loaded == FAST_LAN.apply(plain)


def test_the_documented_tables_are_the_fast_lan_profile() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    assert FAST_LAN.toml() in blocks, "docs/operations.md lacks FAST_LAN.toml() as a block"


def test_a_profile_that_breaks_a_timing_rule_is_refused() -> None:
    # stable_after below the spread of detections (0.25 + 0.25 + 0.25 s): refused by NodeConfig.
    hasty = attrs.evolve(FAST_LAN, stable_after=0.5)
    with pytest.raises(ConfigurationError, match=r"stable_after = 0.5 is invalid .* = 0.75 s"):
        hasty.apply(BASE)
    slow_gossip = attrs.evolve(FAST_LAN, gossip_interval=1.0)
    with pytest.raises(ConfigurationError, match=r"stable_after = 1.0 is invalid .* = 1.5 s"):
        slow_gossip.apply(BASE)
    # A lease that cannot retry a timed-out renewal before its deadline: refused at once.
    with pytest.raises(
        ConfigurationError, match=r"renew_interval = 0.5 is invalid with operation_timeout = 2.0"
    ):
        attrs.evolve(FAST_LAN, lease_operation_timeout=2.0)
    with pytest.raises(ConfigurationError, match=r"FailoverProfile.name = 'fast lan' is invalid"):
        attrs.evolve(FAST_LAN, name="fast lan")
