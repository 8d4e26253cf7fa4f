"""The real-host harness without namespaces (not root): every node on 127.0.0.1, no network
faults. What ``benchmarks/failover.py`` falls back to."""

from __future__ import annotations

import socket

import pytest

from p2pshard.testing._netns import LoopbackNetwork, NetnsError, loopback_network


def test_each_node_gets_a_free_port_of_its_own_on_loopback() -> None:
    network = loopback_network(5)
    assert isinstance(network, LoopbackNetwork)
    assert [network.host(i) for i in network.every()] == ["127.0.0.1"] * 5
    ports = [network.port(i) for i in network.every()]
    assert len(set(ports)) == 5
    for port in ports:  # free now: a node can bind it
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    assert network.exec_prefix(3) == []
    assert network.leftovers() == []
    with pytest.raises(ValueError, match="node 6 is not in this network"):
        network.port(6)


def test_network_faults_are_refused_with_the_reason() -> None:
    network = loopback_network(3)
    with pytest.raises(NetnsError, match=r"network faults .* need network namespaces"):
        network.partition([1])
    with pytest.raises(NetnsError, match="need network namespaces"):
        network.one_way([1], [2])
    network.heal()  # nothing to heal, no error
    assert network.drops == set()
