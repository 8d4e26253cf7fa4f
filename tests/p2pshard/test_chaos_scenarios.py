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

import attrs
import pytest
import trio

from membership import LinkConditions, SplitBrainResolverSettings
from p2pshard import AskTimeout, EntityId, HashExtractor, NodeConfig, ShardingSettings
from p2pshard.testing import (
    SIM_LEASES,
    ChaosReport,
    ChaosSettings,
    Read,
    Scenario,
    ScenarioBody,
    Stall,
    run_scenario,
)
from p2pshard.testing._checkers import SINGLE_ACTIVATION

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


async def shard_lease_failing_lost_then_refused(scenario: Scenario) -> None:
    """The newest node's renewals fail until its shard leases are lost; while it is cut off,
    another owner takes those leases for 8 s, so when the node is back its shards are refused
    until they expire, and only then run again."""
    victim = scenario.nodes[-1]
    await trio.sleep(3.0)
    shards = hosts(scenario, victim)
    assert shards, f"n{victim} hosts no shard"
    owner = str(scenario.sim.nodes[victim].address)  # leases are owned by incarnations
    scenario.backend.cut_off(owner)  # renewals fail: every lease of n<victim> is lost
    scenario.sim.history.fault(f"lease backend cut off from n{victim} for 12s")
    await trio.sleep(6.0)
    for shard in sorted(shards):
        name = f"sim-shard-Counter-{shard}"
        token = await scenario.backend.try_acquire(name, "intruder", 8.0)
        assert token is not None, f"{name} was not free {SIM_LEASES.ttl:g} s after the cut"
    scenario.sim.history.fault(f"another owner holds the leases of shards {sorted(shards)} for 8s")
    await trio.sleep(6.0)
    open_there = [k for node, k in scenario.sim.history.open_incarnations() if node == f"n{victim}"]
    assert not open_there, f"n{victim} still runs {open_there} without its leases"
    scenario.backend.cut_off(owner, False)
    await trio.sleep(1.5)  # its shards ask for their leases again, and are refused
    open_there = [k for node, k in scenario.sim.history.open_incarnations() if node == f"n{victim}"]
    assert not open_there, f"n{victim} runs {open_there} under leases another owner holds"
    await trio.sleep(10.0)
    running = {k for node, k in scenario.sim.history.open_incarnations() if node == f"n{victim}"}
    assert running, f"n{victim} runs nothing after the other owner's leases expired"


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


def other_than_the_coordinator(scenario: Scenario, n: int) -> list[int]:
    """The ``n`` newest nodes that do not run the coordinator, newest first."""
    c = scenario.coordinator_node()
    return [i for i in reversed(scenario.nodes) if i != c][:n]


def entity_in(scenario: Scenario, shard: str) -> str:
    """An entity id of ``shard`` that the workload never sends to."""
    extractor = HashExtractor(scenario.settings.shards)
    return next(
        f"probe-{n}" for n in range(10_000) if extractor.shard_id(EntityId(f"probe-{n}")) == shard
    )


async def min_nr_of_members_gates_allocation(scenario: Scenario) -> None:
    """Five regions are the minimum: with one node gone, its shards find no new home."""
    (victim,) = other_than_the_coordinator(scenario, 1)
    await trio.sleep(3.0)
    orphans = hosts(scenario, victim)
    assert orphans, f"n{victim} hosts no shard to orphan"
    scenario.crash(victim, restart_after=None)
    await trio.sleep(20.0)  # downed and removed: four regions left
    probe = entity_in(scenario, min(orphans))
    with pytest.raises(AskTimeout):
        await scenario.sim.regions[scenario.sim.live[0]].entity_ref(probe).ask(Read(), timeout=5)
    for i in scenario.sim.live:
        assert not orphans & hosts(scenario, i), f"n{i} got an orphan below min_nr_of_members"
    await scenario.sim.start(victim)
    scenario.down.discard(victim)
    await scenario.sim.all_up(scenario.nodes)
    with trio.fail_after(20.0):
        await scenario.sim.regions[scenario.sim.live[0]].entity_ref(probe).ask(Read(), timeout=20)


async def no_rebalance_while_a_member_is_unreachable_or_joining(scenario: Scenario) -> None:
    """A node comes back empty while another is unreachable (not downed: the split brain
    resolver waits a minute): nothing moves until the unreachable node is back."""
    newest, unreachable = other_than_the_coordinator(scenario, 2)
    others = [i for i in scenario.nodes if i != unreachable]
    await trio.sleep(3.0)
    scenario.down.add(newest)  # not restarted by the supervisor: this body starts it
    await scenario.sim.graceful_leave(newest)
    await trio.sleep(3.0)
    scenario.sim.partition(unreachable, others)
    scenario.sim.history.fault(f"isolate n{unreachable} for 30s (not downed)")
    await trio.sleep(5.0)
    before = {i: hosts(scenario, i) for i in scenario.sim.live}
    await scenario.sim.start(newest)
    scenario.down.discard(newest)
    await trio.sleep(20.0)  # four rebalance intervals, with an empty region joining
    assert not hosts(scenario, newest), "a shard moved to the joining node"
    for i, shards in before.items():
        assert hosts(scenario, i) == shards, f"n{i}'s shards moved while n{unreachable} was away"
    scenario.sim.heal()
    await scenario.sim.all_up(scenario.nodes)
    with trio.fail_after(20.0):  # four rebalance intervals
        while not hosts(scenario, newest):  # noqa: ASYNC110 - polls on the mock clock
            await trio.sleep(0.5)


async def an_entity_that_ignores_its_stop_message(scenario: Scenario) -> None:
    """Every counter ignores its stop message: the leaving node's are stopped by force after
    ``handoff_timeout`` (20 s), and only then start on their new homes."""
    (victim,) = other_than_the_coordinator(scenario, 1)
    await trio.sleep(3.0)
    assert hosts(scenario, victim)
    scenario.down.add(victim)
    started = trio.current_time()
    await scenario.sim.graceful_leave(victim)
    took = trio.current_time() - started
    assert 15.0 <= took < 40.0, f"the leave took {took:.1f} s"
    await scenario.sim.start(victim)
    scenario.down.discard(victim)


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
    "shard lease failing, lost, then refused": (shard_lease_failing_lost_then_refused, {}),
    "three oldest of six crash at once": (
        three_oldest_of_six_crash_at_once,
        {"settings": ChaosSettings(nodes=6, quiet=40.0)},
    ),
    "a member paused for less than the downing time": (a_member_paused_shorter_than_downing, {}),
    "min-nr-of-members gates allocation": (
        min_nr_of_members_gates_allocation,
        {"sharding": ShardingSettings(min_nr_of_members=5, lease_retry_interval=1.0)},
    ),
    "no rebalance while a member is unreachable or joining": (
        no_rebalance_while_a_member_is_unreachable_or_joining,
        {
            "sharding": ShardingSettings(rebalance_interval=5.0, lease_retry_interval=1.0),
            "split_brain_resolver": SplitBrainResolverSettings(stable_after=60.0),
        },
    ),
    "an entity that ignores its stop message": (
        an_entity_that_ignores_its_stop_message,
        {
            "sharding": ShardingSettings(
                handoff_timeout=20.0, rebalance_interval=5.0, lease_retry_interval=1.0
            ),
            "stop_message": Stall(seconds=10_000),
        },
    ),
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


SAFE_RATE = 1 - 0.8 * SIM_LEASES.safety_margin / SIM_LEASES.ttl
"""The slowest lease clock the chaos schedule draws: within what ``safety_margin`` covers."""


def cut_off_with_a_skewed_lease_clock(rate: float) -> ScenarioBody:
    """The newest node's lease clock runs at ``rate``; it is isolated and cut off from the
    lease backend for 20 s, while its own clients keep sending to the shards it hosts. It decides
    to down itself late (as a starved process does), so only its leases stop its entities
    before the others take its shards over."""

    async def body(scenario: Scenario) -> None:
        victim = scenario.nodes[-1]
        owner = str(scenario.sim.nodes[victim].address)  # leases are owned by incarnations
        others = [i for i in scenario.nodes if i != victim]
        await trio.sleep(3.0)
        scenario.sim.skew(victim, rate)
        scenario.backend.cut_off(owner)
        scenario.sim.partition(victim, others)
        scenario.sim.history.fault(
            f"n{victim}: lease clock at {rate:g}x, isolated and cut off from leases for 20s"
        )
        await trio.sleep(20.0)
        scenario.backend.cut_off(owner, False)

    return body


def deciding_late(i: int, config: NodeConfig) -> NodeConfig:
    if i != SETTINGS.nodes:
        return config
    late = attrs.evolve(config.split_brain_resolver, stable_after=30.0)
    return attrs.evolve(config, split_brain_resolver=late)


def test_lease_clock_skew_within_the_safety_margin_keeps_single_activation() -> None:
    body = cut_off_with_a_skewed_lease_clock(SAFE_RATE)
    check(run_scenario(17, body, SETTINGS, configure=deciding_late))


def test_lease_clock_skew_beyond_the_safety_margin_is_caught() -> None:
    """The same scenario with a clock at a tenth of the speed: the victim believes its leases
    last ten times as long, keeps its entities past the backend's expiry, and the checker
    finds them live on two nodes at once (the fault has teeth)."""
    body = cut_off_with_a_skewed_lease_clock(0.1)
    report = run_scenario(17, body, SETTINGS, configure=deciding_late)
    print(f"seed={report.seed}: {[str(v) for v in report.violations[:3]]}")
    assert any(v.invariant == SINGLE_ACTIVATION for v in report.violations)
