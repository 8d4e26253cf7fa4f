"""``NodeConfig.app_version`` (issue 22): each node's reaches every member, and ``p2pshard
status`` shows it per member, so a rolling upgrade can be followed."""

from __future__ import annotations

import attrs
import trio
import trio.testing

from p2pshard import NodeConfig
from p2pshard._status import reply_json, reply_text
from p2pshard.testing import simulated_cluster

VERSIONS = {1: "2.4.1", 2: "2.5.0-rc1", 3: ""}


async def test_status_shows_each_members_app_version(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with simulated_cluster(7) as sim:

        def configure(i: int, config: NodeConfig) -> NodeConfig:
            return attrs.evolve(config, app_version=VERSIONS[i])

        sim.configure = configure
        await sim.start_up([1, 2, 3])
        for i in VERSIONS:
            seen = {m.node.name: m.app_version for m in sim.nodes[i].cluster.members}
            assert seen == {f"n{j}": v for j, v in VERSIONS.items()}
        status = sim.nodes[3]._status
        assert status is not None
        reply = await status.status(1, 1.0)
        by_name = {m["name"]: m["app_version"] for m in reply_json(reply)["members"]}
        assert by_name == {"n1": "2.4.1", "n2": "2.5.0-rc1", "n3": None}
        lines = reply_text(reply).splitlines()
        header = next(line for line in lines if line.startswith("MEMBER"))
        assert header.split()[-1] == "VERSION"
        rows = {
            line.split()[0]: line.split()[-1] for line in lines if line[:2] in ("n1", "n2", "n3")
        }
        assert rows == {"n1": "2.4.1", "n2": "2.5.0-rc1", "n3": "-"}
