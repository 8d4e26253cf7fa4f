"""open_node on the simulated network: nodes find their seeds and each other."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from membership import Address, LinkConditions, SimNetwork
from p2pshard import NodeConfig, TlsFiles, open_node

TLS = TlsFiles(
    ca_file=Path("unused-ca.pem"), cert_file=Path("unused.pem"), key_file=Path("unused.key")
)


def config(name: str, port: int, seeds: list[Address]) -> NodeConfig:
    return NodeConfig(
        cluster_name="sim",
        node_name=name,
        bind_host="10.0.0.1",
        bind_port=port,
        seed_nodes=tuple(seeds),
        tls=TLS,
    )


async def test_nodes_link_to_seeds_and_to_peers_that_contact_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(seed=7, conditions=LinkConditions(delay_min=0.001, delay_max=0.01))
    seed = Address("10.0.0.1", 1)
    addresses = [seed, Address("10.0.0.1", 2), Address("10.0.0.1", 3)]
    with trio.fail_after(60):
        async with (
            net.transport(addresses[0], "n1") as t1,
            net.transport(addresses[1], "n2") as t2,
            net.transport(addresses[2], "n3") as t3,
            open_node(config("n1", 1, [seed]), transport=t1) as n1,
            open_node(config("n2", 2, [seed]), transport=t2) as n2,
            open_node(config("n3", 3, [seed]), transport=t3) as n3,
        ):
            # n2 and n3 know only the seed; the seed learns them from their contact and links
            # back. n2 and n3 never learn of each other yet: that is gossip's job.
            while len(n1.linked_peers()) < 2:  # noqa: ASYNC110 - links have no event to await
                await trio.sleep(0.1)
            assert [p.name for p in n1.linked_peers()] == ["n2", "n3"]
            assert [p.name for p in n2.linked_peers()] == ["n1"]
            assert [p.name for p in n3.linked_peers()] == ["n1"]
            net.isolate(addresses[2])
            await trio.sleep(5)
            assert [p.name for p in n1.linked_peers()] == ["n2"]
            net.heal()
            await trio.sleep(5)
            assert [p.name for p in n1.linked_peers()] == ["n2", "n3"]


async def test_an_error_in_the_block_comes_out_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    net = SimNetwork(seed=1)
    address = Address("10.0.0.1", 1)
    with pytest.raises(ValueError, match="boom"):
        async with (
            net.transport(address, "n1") as transport,
            open_node(config("n1", 1, []), transport=transport),
        ):
            raise ValueError("boom")
