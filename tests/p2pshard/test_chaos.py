"""The chaos suite: random fault schedules against a sharded cluster, and its checkers.

Each seed is a whole cluster in one ``trio.run`` (``p2pshard.testing.run_chaos``): partitions of
every shape, flaky and slow links, crashes, pauses, downed nodes restarted, under a counter
workload; then every invariant. The default run covers ``CI_SEEDS`` seeds in two processes, and
``FAN_OUT_SEEDS`` with the chat-like fan-out workload instead; ``--slow`` adds ``CI_SLOW_SEEDS``,
``SLOW_SEEDS`` and ``FAN_OUT_SLOW_SEEDS``. The checkers are shown to catch what they must: with
leases off, with a network that delivers frames twice, with a test fault that activates an entity
twice, and on views made by hand (two islands, fake members).

``REALISTIC_CI_SETTINGS`` is as hard as real hosts: seed nodes drawn per seed (a few, not every
node), seed nodes restarted during partitions, long partitions with the seed nodes on the losing
side, an intruder sending forged membership messages, and in about one seed of thirty a rolling
upgrade (``tests/p2pshard/test_chaos_rollout.py``): the CI seeds run with it, and ``--slow``
runs them once more with the first wave's schedules (every node a seed node, the classic fault
kinds). ``FAST_LAN_SETTINGS`` runs the same, with every node on the fast LAN failover profile
(``p2pshard.FAST_LAN``), over ``FAST_LAN_SEEDS``: the profile is checked safe by chaos as well as by
the settings' validation (``--slow`` adds ``FAST_LAN_SLOW_SEEDS``). A seed whose run hangs fails in
bounded time with the seed named.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import random
import time
from collections.abc import Iterable

import attrs
import pytest
import trio
import trio.testing

from membership import ConfigurationError
from p2pshard import FAST_LAN
from p2pshard.cli._main import main
from p2pshard.testing import (
    FAULTS,
    REALISTIC,
    ChaosHung,
    ChaosReport,
    ChaosSettings,
    History,
    Scenario,
    Violation,
    _chaos,
    _sim,
    check_acknowledged_kept,
    check_agreement_views,
    check_convergence_digests,
    check_fan_out,
    check_no_fakes,
    check_one_cluster,
    check_sender_order,
    check_single_activation,
    check_single_singleton,
    draw_seed_nodes,
    run_chaos,
    run_scenario,
    run_seeds,
    summarize,
)
from tests._support.rollout import assert_rolled_out

CI_SEEDS = range(80)
CI_SLOW_SEEDS = range(80, 200)  # left the default run on 2026-11-26: CI's 15 minutes
CI_SETTINGS = ChaosSettings(duration=15.0, quiet=30.0, message_interval=0.3)
FAN_OUT_SEEDS = range(200, 212)
FAN_OUT_SLOW_SEEDS = range(212, 400)  # 212-223 in the default run until 2026-11-26
FAN_OUT_SETTINGS = attrs.evolve(CI_SETTINGS, workloads=("fan-out",))
ROLLOUT_SHARE = 0.03  # 2 of the CI seeds, 5 of the slow ones, none of the others
REALISTIC_CI_SETTINGS = attrs.evolve(
    REALISTIC,
    duration=CI_SETTINGS.duration,
    quiet=30.0,
    message_interval=0.3,
    rollout=ROLLOUT_SHARE,
)
FAST_LAN_SEEDS = range(400, 406)
FAST_LAN_SLOW_SEEDS = range(406, 500)  # 406-419 in the default run until CI's 15 minutes neared
FAST_LAN_SETTINGS = attrs.evolve(REALISTIC_CI_SETTINGS, profile="fast-lan")
INTRUDER_SEEDS = range(300, 304)
INTRUDER_SETTINGS = attrs.evolve(REALISTIC_CI_SETTINGS, faults=("intruder",), quiet=20.0)
SHORT_PROFILED = ChaosSettings(nodes=3, duration=0.0, quiet=10.0, message_interval=0.3)
SLOW_SEEDS = range(1000, 3000)
JOBS = 2


def run_and_check(
    seeds: range, settings: ChaosSettings, ran: Iterable[ChaosReport] | None = None
) -> list[ChaosReport]:
    """Run ``seeds`` (or take the reports of a run of them, ``ran``), check each, return them."""
    reports = []
    for report in run_seeds(seeds, settings, jobs=JOBS) if ran is None else ran:
        print(
            f"seed={report.seed}: {report.incarnations} incarnations, {len(report.faults)} "
            f"faults, {report.acknowledged}/{report.sent} acknowledged, "
            f"{len(report.violations)} violations"
        )
        reports.append(report)
    print(summarize(reports))
    failing = [r for r in reports if not r.ok]
    assert not failing, "\n".join(
        f"seed {r.seed}: {r.violations[0]} (replay: {r.replay_command()})" for r in failing
    )
    assert all(r.incarnations > 0 and r.acknowledged > 0 for r in reports)
    for report in reports:
        if report.rollout is not None:
            assert_rolled_out(report)
    return reports


def test_every_invariant_holds_over_the_ci_seeds() -> None:
    """As hard as real hosts: seed subsets drawn per seed, seed nodes restarted during
    partitions, seed partitions, the intruder among the faults, and in a few seeds a rolling
    upgrade with its own crash and partition."""
    reports = run_and_check(CI_SEEDS, REALISTIC_CI_SETTINGS)
    assert [r.seed for r in reports if r.rollout is not None] == [15, 51]


@pytest.mark.slow
def test_every_invariant_holds_over_more_realistic_seeds() -> None:
    reports = run_and_check(CI_SLOW_SEEDS, REALISTIC_CI_SETTINGS)
    assert [r.seed for r in reports if r.rollout is not None] == [112, 122, 159, 189, 198]


def test_every_invariant_holds_over_fan_out_seeds() -> None:
    """Chat-like rooms copying each post to three inboxes before they answer."""
    run_and_check(FAN_OUT_SEEDS, FAN_OUT_SETTINGS)


@pytest.mark.slow
def test_every_invariant_holds_over_more_fan_out_seeds() -> None:
    run_and_check(FAN_OUT_SLOW_SEEDS, FAN_OUT_SETTINGS)


@pytest.mark.slow
def test_every_invariant_holds_over_the_ci_seeds_with_every_node_a_seed() -> None:
    """The schedules of the first wave: every node a seed node, the classic fault kinds."""
    run_and_check(range(CI_SLOW_SEEDS.stop), CI_SETTINGS)


def test_every_invariant_holds_with_the_fast_lan_failover_profile() -> None:
    """p2pshard.FAST_LAN (detection in under 2 s, stable_after 1 s, 3 s leases) on every node,
    as hard as real hosts: the profile's timing must keep every invariant too."""
    run_and_check(FAST_LAN_SEEDS, FAST_LAN_SETTINGS)


@pytest.mark.slow
def test_every_invariant_holds_with_the_fast_lan_profile_over_more_seeds() -> None:
    run_and_check(FAST_LAN_SLOW_SEEDS, FAST_LAN_SETTINGS)


def test_the_profile_reaches_every_node_and_entity_type() -> None:
    seen: list[tuple[float, float, float, float, float]] = []

    async def body(scenario: Scenario) -> None:
        for i in scenario.sim.live:
            config = scenario.sim.nodes[i].config
            sharding = scenario.sim.regions[i].settings
            seen.append(
                (
                    config.failure_detector.heartbeat_interval,
                    config.split_brain_resolver.stable_after,
                    config.lease.ttl,
                    sharding.lease_retry_interval,
                    sharding.state_timeout,
                )
            )
        await trio.sleep(1.0)

    settings = attrs.evolve(SHORT_PROFILED, profile="fast-lan")
    report = run_scenario(5, body, settings)
    assert report.ok, report.violations
    p = FAST_LAN
    expected = (p.heartbeat_interval, p.stable_after, p.lease_ttl, p.lease_retry_interval)
    assert seen == [(*expected, p.state_timeout)] * 3
    assert report.replay_command().endswith(" --profile fast-lan")


@pytest.mark.slow
def test_every_invariant_holds_over_two_thousand_more_seeds() -> None:
    run_and_check(SLOW_SEEDS, ChaosSettings())


@functools.cache
def intruder_reports() -> tuple[ChaosReport, ...]:
    """The intruder seeds' reports, run once for the two tests below when one worker runs both."""
    return tuple(run_seeds(INTRUDER_SEEDS, INTRUDER_SETTINGS, jobs=JOBS))


def test_every_invariant_holds_while_an_intruder_forges_membership_messages() -> None:
    run_and_check(INTRUDER_SEEDS, INTRUDER_SETTINGS, intruder_reports())


def test_the_intruder_attacks_deterministically_and_every_attack_is_recorded() -> None:
    seen: set[str] = set()
    reports = intruder_reports()
    for report in reports:
        print(f"seed={report.seed}: {list(report.faults)}")
        attacks = [f.split(" ", 2)[2] for f in report.faults if " intruder: " in f]
        assert attacks, report.faults
        seen |= {attack.split(" ", 1)[0].split("(")[0] for attack in attacks}
        # Whatever the intruder got through is reported under its own invariant, naming it.
        for violation in report.violations:
            if violation.invariant == "intruder-ignored":
                assert "intruder" in violation.detail or "fake" in violation.detail, violation
    # Over these seeds the intruder sent every kind of message it knows.
    assert {"Join", "Down", "Leave", "gossip", "GossipStatus", "Heartbeat"} <= seen, seen
    [again] = run_seeds([reports[0].seed], INTRUDER_SETTINGS)
    assert (again.trace_hash, again.faults) == (reports[0].trace_hash, reports[0].faults)


def test_the_autojump_clock_jumps_as_trio_s_own() -> None:
    async def sleeps() -> list[float]:
        seen = []
        for delay in (0.5, 3.0, 0.001, 0.0, 120.25):
            with trio.move_on_after(delay * 2):  # a deadline that never fires, as well
                await trio.sleep(delay)
            seen.append(trio.current_time())
        return seen

    clock = _sim.autojump_clock()
    assert "_autojump" in vars(clock)  # the cheaper jump is in place
    expected = trio.run(sleeps, clock=trio.testing.MockClock(autojump_threshold=0))
    assert trio.run(sleeps, clock=clock) == expected
    assert expected[-1] == pytest.approx(123.751)


def test_seed_layouts() -> None:
    rng = random.Random(7)
    assert draw_seed_nodes(ChaosSettings(), rng) == (1, 2, 3, 4, 5)
    assert draw_seed_nodes(ChaosSettings(seed_layout="first-2"), rng) == (1, 2)
    drawn = [draw_seed_nodes(ChaosSettings(seed_layout="drawn"), rng) for _ in range(400)]
    assert all(0 < len(layout) < 5 and set(layout) <= {1, 2, 3, 4, 5} for layout in drawn)
    assert all(len(set(layout)) == len(layout) for layout in drawn)
    assert {(1,), (1, 2), (1, 2, 3)} <= set(drawn)
    subsets = [layout for layout in drawn if layout not in {(1,), (1, 2), (1, 2, 3)}]
    assert subsets
    assert any(layout[0] != 1 for layout in subsets)
    with pytest.raises(ConfigurationError, match="seed_layout = 'some' is invalid: choose one"):
        ChaosSettings(seed_layout="some")
    with pytest.raises(ConfigurationError, match="seed_restarts = 2 is invalid"):
        ChaosSettings(seed_restarts=2)
    assert set(FAULTS) >= {"seed-partition", "intruder"}
    assert "intruder" not in ChaosSettings().faults  # pinned seeds keep their schedules


def test_seed_partitions_cut_off_the_seed_nodes_and_restart_them() -> None:
    settings = attrs.evolve(
        REALISTIC_CI_SETTINGS, faults=("seed-partition",), seed_restarts=1.0, duration=30.0
    )
    report = run_chaos(2, settings)
    print(report.seed_nodes, list(report.faults))
    partitions = [f for f in report.faults if " seed-partition " in f]
    assert partitions
    for fault in partitions:  # each cut-off minority holds a seed node: "(seeds [1])"
        assert "(seeds [])" not in fault, fault
    assert any(" seed-restart " in f for f in report.faults), report.faults


# With --slow (about 45 s): the default run checks the checker with a planted double activation
# (test_an_entity_activated_twice_by_a_test_fault_is_caught) and the margin by unit tests.
@pytest.mark.slow
def test_without_leases_the_checker_finds_two_live_incarnations() -> None:
    # Found by running seeds 0..19 with leases off: a node that is partitioned or paused keeps
    # its entities until it downs itself, while the other side has already moved its shards.
    # Which seeds show it moves with timing (2026-11-22: 13 and 15; 2026-11-26: 8 first), so
    # the seeds run in order until one is caught with two live incarnations, twenty at most.
    # The coordinator's removal margin (issue 19) closes that window, so it is turned off here:
    # this shows that the checker catches what the margin prevents.
    settings = ChaosSettings(use_lease=False, removal_margin=0.0)
    caught = []
    for report in run_seeds(range(20), settings, jobs=JOBS):
        if not report.ok:
            print(report.seed, [str(v) for v in report.violations[:2]])
            caught.append(report)
        if any(v.invariant == "single-activation" for v in report.violations):
            break
    assert caught
    invariants = {v.invariant for r in caught for v in r.violations}
    assert "single-activation" in invariants


@pytest.mark.slow
def test_without_leases_the_removal_margin_keeps_single_activation() -> None:
    # The same twenty seeds with the default margin (stable_after): none shows two live
    # incarnations of an entity (about two minutes on two cores).
    settings = ChaosSettings(use_lease=False)
    failed = []
    for report in run_seeds(range(20), settings, jobs=JOBS):
        if any(v.invariant == "single-activation" for v in report.violations):
            print(report.replay_command(), [str(v) for v in report.violations[:2]])
            failed.append(report.seed)
    assert not failed


def test_a_network_that_delivers_twice_is_caught_as_messages_handled_twice() -> None:
    report = run_chaos(5, ChaosSettings(duration=10.0, quiet=10.0, duplicate=0.05))
    doubled = [v for v in report.violations if v.invariant == "acknowledged-kept"]
    assert doubled, report.violations
    assert all("handled 2 times" in v.detail for v in doubled)
    assert "--seed 5" in report.replay_command()


def test_an_entity_activated_twice_by_a_test_fault_is_caught() -> None:
    report = run_chaos(3, ChaosSettings(duration=20.0, double_activation_at=10.0))
    [fault] = [line for line in report.faults if "test fault" in line]
    entity = fault.split()[3]
    activation = [v for v in report.violations if v.invariant == "single-activation"]
    assert activation
    assert all(v.detail.startswith(f"{entity}: ") for v in activation), activation


@pytest.mark.parametrize(
    "settings",
    [
        ChaosSettings(duration=20.0, quiet=10.0),
        attrs.evolve(REALISTIC, duration=30.0, quiet=10.0),
    ],
    ids=["classic", "realistic"],
)
def test_a_chaos_run_replays_from_its_seed(settings: ChaosSettings) -> None:
    first, second = run_chaos(4, settings), run_chaos(4, settings)
    assert first == second
    assert first.faults
    assert run_chaos(5, settings).trace_hash != first.trace_hash


def test_summary_names_the_first_failing_seed_and_how_to_replay_it() -> None:
    ok = run_chaos(4, ChaosSettings(duration=10.0, quiet=10.0))
    failing = attrs.evolve(ok, violations=(Violation("sender-order", "Counter/e1: c1.0#5 ..."),))
    table = summarize([ok, failing])
    assert "seeds run                            2" in table
    assert "sender-order                       1" in table
    assert f"first failing seed {failing.seed}: sender-order: Counter/e1" in table
    assert "replay: p2pshard chaos --seed 4 --nodes 5 --duration 10 --quiet 10" in table


# -- the checkers on hand-made histories --------------------------------------------------------


async def test_single_activation(autojump_clock: trio.testing.MockClock) -> None:
    h = History()
    h.entity_started("n1", "T/a", 1)
    await trio.sleep(1)
    h.entity_stopped("n1", "T/a")
    h.entity_started("n2", "T/a", 2)  # right after: not an overlap
    h.entity_started("n3", "T/b", None)
    await trio.sleep(1)
    h.entity_started("n4", "T/b", None)  # n3's is still alive
    await trio.sleep(1)
    h.node_gone("n3")
    assert [str(v) for v in check_single_activation(h)] == [
        "single-activation: T/b: n3 [1.000, 3.000] token None and "
        "n4 [2.000, running] token None overlap"
    ]
    assert h.incarnation_count() == 4


def test_acknowledged_kept_exactly_once() -> None:
    h = History()
    for seq in (1, 2, 3, 4):
        h.sent("c1", "T/a", seq, at=float(seq))
    h.acknowledged("c1", 1, at=1.5)
    h.acknowledged("c1", 2, at=2.5)
    h.acknowledged("c1", 4, at=4.5)
    h.logged("T/a", "c1", 1)
    h.logged("T/a", "c1", 3)  # not acknowledged, handled: fine
    h.logged("T/a", "c1", 3)  # ...but never twice
    h.logged("T/a", "c1", 4)
    assert [str(v) for v in check_acknowledged_kept(h)] == [
        "acknowledged-kept: T/a: c1#3 handled 2 times",
        "acknowledged-kept: T/a: c1#2 was acknowledged at 2.500 but is not in the entity's log",
    ]


def test_sender_order_allows_gaps_but_not_going_back() -> None:
    h = History()
    for sender, seq in [("c1", 1), ("c2", 7), ("c1", 3), ("c2", 8), ("c1", 2), ("c1", 4)]:
        h.logged("T/a", sender, seq)
    h.logged("T/b", "c1", 1)  # order is per entity: another entity may see older numbers
    assert [str(v) for v in check_sender_order(h)] == [
        "sender-order: T/a: c1#2 was handled after c1#3"
    ]


def test_single_singleton() -> None:
    h = History()
    first = h.singleton_started("n1", "probe", at=0.0)
    first.end = 5.0
    h.singleton_started("n2", "probe", at=5.0)  # after the first: fine
    h.singleton_started("n3", "probe", at=6.0)  # while n2's runs
    [violation] = check_single_singleton(h)
    assert violation.invariant == "single-singleton"
    assert "n2 [5.000, running]" in violation.detail
    assert "n3 [6.000, running]" in violation.detail


def test_agreement_views() -> None:
    up = frozenset({("n1", "up"), ("n2", "up")})
    assert check_agreement_views({"n1": up, "n2": up}, {"n1": {"3": "n2"}}, ["n1", "n2"]) == []
    islands = {"n1": frozenset({("n1", "up")}), "n2": frozenset({("n2", "up")})}
    found = [str(v) for v in check_agreement_views(islands, {}, ["n1", "n2"])]
    assert found[0].startswith("agreement: members differ: n1 sees [('n1', 'up')]")
    assert "agreement: n1 does not see ['n2'] Up (it sees [('n1', 'up')])" in found
    homes = {"n1": {"3": "n2"}, "n2": {"3": "n1", "4": "n9"}}
    assert [str(v) for v in check_agreement_views({"n1": up, "n2": up}, homes, ["n1", "n2"])] == [
        "agreement: shard 3: n1 says n2, n2 says n1",
        "agreement: n2 thinks shard 4 lives on n9, not live",
    ]


def test_one_cluster_names_the_islands() -> None:
    whole = {n: ["n1", "n2", "n3"] for n in ("n1", "n2", "n3")}
    assert check_one_cluster(whole, ["n1", "n2", "n3"]) == []
    islands = {
        "n1": ["n1", "n2"],
        "n2": ["n2", "n1"],
        "n3": ["n3", "n4", "n10"],
        "n4": ["n3", "n4", "n10"],
        "n10": ["n10", "n3", "n4"],
    }
    assert [str(v) for v in check_one_cluster(islands, islands)] == [
        "one-cluster: 2 clusters after the quiet: [n1, n2] see Up [n1, n2]; "
        "[n3, n4, n10] see Up [n3, n4, n10]"
    ]
    # One view, but a running node is outside it and a member in it runs nowhere.
    stale = {n: ["n1", "n2", "n3 (incarnation 7, gone)"] for n in ("n1", "n2")}
    assert [str(v) for v in check_one_cluster(stale, ["n1", "n2", "n3"])] == [
        "one-cluster: one view, but not of the running nodes: [n1, n2] see Up "
        "[n1, n2, n3 (incarnation 7, gone)]; running but not Up in it: [n3]; Up in it but not "
        "running: [n3 (incarnation 7, gone)]"
    ]


def test_no_fakes() -> None:
    fakes = {"fake1": "10.0.0.0:4000", "fake2": "10.0.0.7:5000"}
    clean = check_no_fakes({"n1": ["n1", "n2"]}, {"n1": ["10.0.0.1:2", "10.0.0.99:25520"]}, fakes)
    assert clean == []
    members = {"n1": ["n1", "fake2", "fake1"], "n2": ["n1", "n2"]}
    dialled = {"n1": [], "n2": ["10.0.0.1:1", "10.0.0.7:5000"]}
    assert [str(v) for v in check_no_fakes(members, dialled, fakes)] == [
        "intruder-ignored: n1 lists fake members [fake1, fake2]",
        "intruder-ignored: n2 dials addresses only the intruder named: 10.0.0.7:5000 (fake2)",
    ]


def test_convergence_digests() -> None:
    same: dict[str, dict[str, bytes | None]] = {"n1": {"k": b"\x01"}, "n2": {"k": b"\x01"}}
    assert check_convergence_digests(same) == []
    differ: dict[str, dict[str, bytes | None]] = {"n1": {"k": b"\x01"}, "n2": {"k": None}}
    assert [str(v) for v in check_convergence_digests(differ)] == [
        "convergence: replicas of k differ: n1: 01, n2: absent"
    ]


def test_fan_out_copies_are_prefixes_holding_every_acknowledged_post() -> None:
    h = History()
    h.room_members["Room/r"] = ("Inbox/a", "Inbox/b")
    for seq in (1, 2, 3):
        h.sent("p1", "Room/r", seq, at=float(seq))
        h.logged("Room/r", "p1", seq)
    h.acknowledged("p1", 1, at=1.5)
    h.acknowledged("p1", 2, at=2.5)  # post 3 was not acknowledged: members may lack it
    h.copies["Inbox/a"] = {"Room/r": [("p1", 1), ("p1", 2), ("p1", 3)]}
    h.copies["Inbox/b"] = {"Room/r": [("p1", 1), ("p1", 2)]}
    assert check_fan_out(h) == []
    h.copies["Inbox/b"]["Room/r"] = [("p1", 1)]  # lacks an acknowledged post
    h.copies["Inbox/a"]["Room/r"] = [("p1", 1), ("p1", 3)]  # skipped one
    assert [str(v) for v in check_fan_out(h)] == [
        "fan-out: Inbox/a's copy of Room/r holds p1#3 as post 2; the room's log has p1#2 there",
        "fan-out: Room/r: p1#2 (post 2) was acknowledged at 2.500 but Inbox/b lacks it",
    ]
    h.copies["Inbox/a"]["Room/r"] = [("p1", 1), ("p1", 2), ("p1", 3), ("p1", 3)]
    h.copies["Inbox/b"]["Room/r"] = [("p1", 1), ("p1", 2)]
    assert [str(v) for v in check_fan_out(h)] == [
        "fan-out: Inbox/a's copy of Room/r holds p1#3 as post 4; the room's log has nothing there"
    ]


# --- the command ----------------------------------------------------------------------------------


def test_the_command_runs_one_fan_out_seed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--seed", "3", "--workloads", "counter,fan-out", "--duration", "10", "--quiet", "10"]
    assert main(["chaos", *argv]) == 0
    out = capsys.readouterr().out
    assert "violations: 0" in out
    settings = ChaosSettings(workloads=("counter", "fan-out"), duration=10.0, quiet=10.0)
    assert run_chaos(3, settings).replay_command() == (
        "p2pshard chaos --seed 3 --nodes 5 --duration 10 --quiet 10 --workloads counter,fan-out"
    )


def test_the_replay_command_carries_the_realistic_settings() -> None:
    settings = attrs.evolve(REALISTIC, duration=10.0, quiet=10.0)
    report = _chaos._failed(9, settings, "test")
    assert report.replay_command() == (
        "p2pshard chaos --seed 9 --nodes 5 --duration 10 --quiet 10 --faults "
        + ",".join(FAULTS)
        + " --seed-layout drawn --seed-restarts 0.5"
    )


def test_the_replay_command_carries_the_removal_margin() -> None:
    settings = ChaosSettings(use_lease=False, removal_margin=0.0, duration=10.0, quiet=10.0)
    assert _chaos._failed(4, settings, "test").replay_command() == (
        "p2pshard chaos --seed 4 --nodes 5 --duration 10 --quiet 10 --no-lease --removal-margin 0"
    )


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--workloads", "chat"], "ChaosSettings.workloads = ('chat',) is invalid: choose one"),
        (["--faults", "skew,quake"], "ChaosSettings.faults = ('skew', 'quake') is invalid"),
        (["--real", "--workloads", "fan-out"], "--workloads goes with the simulated cluster"),
        (["--real", "--event-sourced"], "--event-sourced goes with the simulated cluster"),
        (["--seed-layout", "every"], "ChaosSettings.seed_layout = 'every' is invalid"),
        (["--real", "--realistic"], "--realistic and --rollout go with the simulated cluster"),
        (["--real", "--rollout", "1"], "--realistic and --rollout go with the simulated cluster"),
        (["--rollout", "2"], "ChaosSettings.rollout = 2.0 is invalid"),
        (["--profile", "slow-wan"], "ChaosSettings.profile = 'slow-wan' is invalid: choose one"),
        (["--real", "--profile", "fast-lan"], "--profile, --realistic and --rollout go with"),
        (["--real", "--removal-margin", "0"], "--removal-margin goes with the simulated cluster"),
        (["--removal-margin", "-1"], "ChaosSettings.removal_margin = -1.0 is invalid"),
    ],
)
def test_the_command_refuses_bad_options(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", *argv]) == 2
    assert error in capsys.readouterr().err


# --- a hung seed fails in bounded time, naming the seed -----------------------------------------


def spin() -> None:
    while True:  # a busy loop that never lets the mock clock move on
        pass


def stubborn_spin() -> None:
    while True:  # ... and swallows whatever is raised into it
        with contextlib.suppress(BaseException):
            spin()


def hang_on_seed(seed: int, loop: object) -> object:
    async def body(scenario: Scenario) -> None:
        await trio.sleep(1.0)
        if scenario.sim.net.seed == seed:
            loop()  # type: ignore[operator]

    return body


@pytest.fixture
def short_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough for a healthy run of SHORT on a loaded machine (about a second).
    monkeypatch.setattr(_chaos, "WALL_LIMIT", 5)
    monkeypatch.setattr(_chaos, "HUNG_RETRY", 1)
    monkeypatch.setattr(_chaos, "HUNG_EXIT", 3)
    monkeypatch.setattr(_chaos, "KILL_AFTER", 1)


SHORT = ChaosSettings(nodes=3, duration=2.0, quiet=10.0, message_interval=0.3)


@pytest.mark.usefixtures("short_limits")
def test_a_hung_run_raises_naming_its_seed() -> None:
    with pytest.raises(ChaosHung, match="seed 6: not done after 5 s of real time"):
        run_scenario(6, hang_on_seed(6, spin), SHORT)  # type: ignore[arg-type]


@pytest.mark.usefixtures("short_limits")
def test_a_hung_seed_is_reported_and_the_other_seeds_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The seeds run in forked processes, which see the patched schedule.
    monkeypatch.setattr(_chaos, "random_schedule", hang_on_seed(6, spin))
    started = time.monotonic()
    hung, other = run_seeds([6, 7], SHORT, jobs=2)
    assert time.monotonic() - started < 40
    [violation] = hung.violations
    assert violation.invariant == "run-finishes"
    assert violation.detail.startswith("seed 6: not done after 5 s of real time")
    assert "It was running spin (test_chaos.py:" in violation.detail
    assert "--seed 6 " in hung.replay_command()
    assert other.ok, other.violations
    table = summarize([hung, other])
    assert "run-finishes                       1" in table
    assert "first failing seed 6: run-finishes: seed 6: not done" in table


@pytest.mark.usefixtures("short_limits")
def test_a_seed_that_swallows_the_alarm_ends_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_chaos, "random_schedule", hang_on_seed(6, stubborn_spin))
    started = time.monotonic()
    [report] = run_seeds([6], SHORT)
    assert time.monotonic() - started < 40
    [violation] = report.violations
    assert violation.detail.startswith("seed 6: its process ended without a report"), violation


@pytest.mark.usefixtures("short_limits")
def test_a_seed_whose_process_does_not_end_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_chaos, "random_schedule", hang_on_seed(6, stubborn_spin))
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda *a, **k: None)
    started = time.monotonic()
    [report] = run_seeds([6], SHORT)
    assert time.monotonic() - started < 40
    [violation] = report.violations
    assert violation.detail.startswith("seed 6: killed after 9 s of real time"), violation
