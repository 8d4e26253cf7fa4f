"""Named fault scenarios after Akka's multi-node sharding specs, each checked by every invariant.

Every scenario runs on the chaos cluster of ``p2pshard.testing.run_scenario`` (shard and singleton
leases, the counter workload through every node, downed nodes restarted by a supervisor), injects
its faults, heals, waits for quiet and then checks single activation, acknowledged messages kept
exactly once, per-sender order, agreement (members, shard homes, every shard answering through
every node), at most one singleton and replica convergence. The scenario-specific expectations are
asserted inside the bodies.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from membership import LinkConditions, SplitBrainResolverSettings
from p2pshard import ShardingSettings
from p2pshard.testing import ChaosReport, ChaosSettings, Scenario, ScenarioBody, run_scenario

SETTINGS = ChaosSettings(quiet=30.0)


def check(report: ChaosReport) -> None:
    print(
        f"seed={report.seed}: {report.incarnations} incarnations, "
        f"{report.acknowledged}/{report.sent} acknowledged; faults: {list(report.faults)}"
    )
    assert report.acknowledged > 0
    assert report.ok, "\n".join(str(v) for v in report.violations[:10])


def hosts(scenario: Scenario, i: int) -> set[str]:
    """The shards node ``i`` hosts now."""
    return {s.shard_id for s in scenario.sim.nodes[i].sharding.region_state("Counter").shards}


async def region_and_coordinator_blackholed_during_allocation(scenario: Scenario) -> None:
    c = scenario.coordinator_node()
    r = next(i for i in scenario.nodes if i != c)
    scenario.sim.partition(r, c)  # r's GetShardHome and c's HostShard are lost for a while
    scenario.sim.history.fault(f"blackhole n{r} <-> n{c} (coordinator) for 3s")
    await trio.sleep(3.0)
    scenario.sim.heal()
    await trio.sleep(5.0)


async def coordinator_node_crashed(scenario: Scenario) -> None:
    c = scenario.coordinator_node()
    await trio.sleep(3.0)
    before = {i: hosts(scenario, i) for i in scenario.sim.live if i != c}
    scenario.crash(c, restart_after=30.0)
    await trio.sleep(20.0)  # downed, removed, a new coordinator on the next oldest
    for i, shards in before.items():
        assert shards <= hosts(scenario, i), f"n{i} lost shards that were not on n{c}"


async def other_node_crashed(scenario: Scenario) -> None:
    c = scenario.coordinator_node()
    await trio.sleep(3.0)
    victim = next(i for i in reversed(scenario.nodes) if i != c)
    before = {i: hosts(scenario, i) for i in scenario.sim.live if i != victim}
    scenario.crash(victim, restart_after=30.0)
    await trio.sleep(20.0)
    for i, shards in before.items():
        assert shards <= hosts(scenario, i), f"n{i} lost shards that were not on n{victim}"


async def two_oldest_leave_at_once(scenario: Scenario) -> None:
    await trio.sleep(3.0)
    async with trio.open_nursery() as nursery:
        for i in (1, 2):
            nursery.start_soon(scenario.sim.graceful_leave, i)
    await trio.sleep(10.0)


async def graceful_shutdown_of_the_oldest(scenario: Scenario) -> None:
    await trio.sleep(3.0)
    await scenario.sim.graceful_leave(scenario.coordinator_node())
    await trio.sleep(10.0)


async def coordinator_without_a_write_majority(scenario: Scenario) -> None:
    c = scenario.coordinator_node()
    minority = [c, next(i for i in scenario.nodes if i != c)]
    rest = [i for i in scenario.nodes if i not in minority]
    await trio.sleep(3.0)
    scenario.sim.partition(minority, rest)
    scenario.sim.history.fault(f"partition {minority} (with the coordinator) for 20s")
    await trio.sleep(20.0)
    scenario.sim.heal()


async def coordinator_crash_in_the_middle_of_a_rebalance(scenario: Scenario) -> None:
    newest = scenario.nodes[-1]
    await trio.sleep(3.0)
    scenario.crash(newest, restart_after=None)
    await trio.sleep(25.0)  # downed and removed: its shards moved to the others
    await scenario.sim.start(newest)
    scenario.down.discard(newest)
    await scenario.sim.all_up(scenario.nodes)
    # A new region brings the next rebalance round forward to about a second after it
    # registered; the hand-offs to it are under way then.
    await trio.sleep(1.2)
    scenario.crash(scenario.coordinator_node(), restart_after=25.0)
    await trio.sleep(20.0)


async def remembered_entities_after_coordinator_failover(scenario: Scenario) -> None:
    await trio.sleep(5.0)
    c = scenario.coordinator_node()
    remembered = {key for node, key in scenario.sim.history.open_incarnations() if node != f"n{c}"}
    scenario.crash(c, restart_after=30.0)
    await trio.sleep(25.0)
    running = {key for _, key in scenario.sim.history.open_incarnations()}
    assert remembered <= running, f"not running after failover: {remembered - running}"


async def shard_lease_failing_then_lost(scenario: Scenario) -> None:
    victim = scenario.nodes[-1]
    await trio.sleep(3.0)
    owner = f"10.0.0.1:{victim}"
    scenario.backend.cut_off(owner)  # renewals fail: every lease of n<victim> is lost
    scenario.sim.history.fault(f"lease backend cut off from n{victim} for 12s")
    await trio.sleep(12.0)
    open_there = [k for node, k in scenario.sim.history.open_incarnations() if node == f"n{victim}"]
    assert not open_there, f"n{victim} still runs {open_there} without its leases"
    scenario.backend.cut_off(owner, False)
    await trio.sleep(5.0)


async def three_oldest_of_six_crash_at_once(scenario: Scenario) -> None:
    await trio.sleep(3.0)
    for i in (1, 2, 3):
        scenario.crash(i, restart_after=30.0)
    await trio.sleep(25.0)


async def a_member_paused_shorter_than_downing(scenario: Scenario) -> None:
    victim = scenario.nodes[-1]
    await trio.sleep(3.0)
    scenario.sim.history.fault(f"pause n{victim} for 4s")
    await scenario.sim.pause(victim, 4.0, among=scenario.nodes)


SCENARIOS: dict[str, tuple[ScenarioBody, dict[str, Any]]] = {
    "region and coordinator blackholed during allocation": (
        region_and_coordinator_blackholed_during_allocation,
        {},
    ),
    "the coordinator's node downed": (coordinator_node_crashed, {}),
    "a node other than the coordinator's downed": (other_node_crashed, {}),
    "the two oldest leave at once": (two_oldest_leave_at_once, {}),
    "graceful shutdown of the oldest": (graceful_shutdown_of_the_oldest, {}),
    "the coordinator without a write majority": (coordinator_without_a_write_majority, {}),
    "coordinator crash in the middle of a rebalance": (
        coordinator_crash_in_the_middle_of_a_rebalance,
        {},
    ),
    "remembered entities after coordinator failover": (
        remembered_entities_after_coordinator_failover,
        {"sharding": ShardingSettings(remember_entities=True, lease_retry_interval=1.0)},
    ),
    "shard lease failing, then lost": (shard_lease_failing_then_lost, {}),
    "three oldest of six crash at once": (
        three_oldest_of_six_crash_at_once,
        {"settings": ChaosSettings(nodes=6, quiet=40.0)},
    ),
    "a member paused for less than the downing time": (a_member_paused_shorter_than_downing, {}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(name: str) -> None:
    body, options = SCENARIOS[name]
    options = dict(options)
    settings = options.pop("settings", SETTINGS)
    check(run_scenario(7, body, settings, **options))


STRATEGIES = {
    "keep-majority": SplitBrainResolverSettings(stable_after=5.0),
    "static-quorum": SplitBrainResolverSettings(
        active_strategy="static-quorum", quorum_size=3, stable_after=5.0
    ),
    "keep-oldest": SplitBrainResolverSettings(active_strategy="keep-oldest", stable_after=5.0),
    "down-all": SplitBrainResolverSettings(active_strategy="down-all", stable_after=5.0),
    "lease-majority": SplitBrainResolverSettings(
        active_strategy="lease-majority", stable_after=5.0
    ),
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("split", [(1, 2), (4, 5), (1, 5)])
def test_split_brain_matrix_with_sharding_and_leases(strategy: str, split: tuple[int, int]) -> None:
    async def partition(scenario: Scenario) -> None:
        await trio.sleep(3.0)
        rest = [i for i in scenario.nodes if i not in split]
        scenario.sim.partition(list(split), rest)
        scenario.sim.history.fault(f"partition {list(split)} | {rest} for 25s")
        await trio.sleep(25.0)
        scenario.sim.heal()

    sbr = STRATEGIES[strategy]
    check(run_scenario(11, partition, SETTINGS, split_brain_resolver=sbr))


@pytest.mark.parametrize("nodes", [3, 5, 9])
def test_flaky_links_with_lease_majority(nodes: int) -> None:
    async def flaky(scenario: Scenario) -> None:
        lossy = LinkConditions(delay_min=0.001, delay_max=0.02, drop=0.1)
        scenario.sim.history.fault("every link drops 10% for 30s")
        for i in scenario.nodes:
            scenario.sim.set_links(i, lossy, among=scenario.nodes)
        await trio.sleep(30.0)

    sbr = SplitBrainResolverSettings(active_strategy="lease-majority", stable_after=5.0)
    settings = ChaosSettings(nodes=nodes, quiet=40.0)
    check(run_scenario(13, flaky, settings, split_brain_resolver=sbr))
