"""The chaos suite with event-sourced entities on a group-committing memory journal (issue 24).

With ``ChaosSettings(event_sourced=True)`` the counters, rooms and inboxes are event-sourced
entities on one ``MemoryJournal(group_commit=True)`` the nodes share, each writing with its
shard's lease token (``p2pshard/testing/_journaled.py``); the checkers read the logs and copies
from the journal, and ``journal-fencing`` checks from the journal's record that no append got
past a fence. The default run takes the first counter CI seed and the first fan-out CI seed
(about 10 s); ``--slow`` runs every CI seed of both workloads this way (``CI_SEEDS`` with the
realistic settings, ``FAN_OUT_SEEDS``), and a scenario whose long pause makes a stale holder's
appends arrive after the new holder's recovery, so that the fence refuses some of them.
"""

from __future__ import annotations

import attrs
import pytest
import trio

from p2pshard.testing import ChaosReport, ChaosSettings, Scenario, run_scenario
from tests.p2pshard.test_chaos import (
    CI_SEEDS,
    FAN_OUT_SEEDS,
    FAN_OUT_SETTINGS,
    REALISTIC_CI_SETTINGS,
    run_and_check,
)

EVENT_SOURCED_CI = attrs.evolve(REALISTIC_CI_SETTINGS, event_sourced=True)
EVENT_SOURCED_FAN_OUT = attrs.evolve(FAN_OUT_SETTINGS, event_sourced=True)
DEFAULT_COUNTER_SEEDS = CI_SEEDS[:1]
DEFAULT_FAN_OUT_SEEDS = FAN_OUT_SEEDS[:1]


def check_event_sourced(reports: list[ChaosReport]) -> None:
    """Each run wrote its entities' state through the journal, in batches."""
    for report in reports:
        journal = report.journal
        assert journal is not None, report.seed
        print(f"seed={report.seed}: journal {journal}")
        assert journal.appends > 0
        assert journal.recoveries > 0
        assert journal.snapshots > 0
        assert journal.batches <= journal.appends + journal.fenced + journal.conflicts


def test_event_sourced_entities_keep_every_invariant_over_the_first_ci_seeds() -> None:
    """The first counter CI seed and the first fan-out CI seed."""
    reports = run_and_check(DEFAULT_COUNTER_SEEDS, EVENT_SOURCED_CI)
    reports += run_and_check(DEFAULT_FAN_OUT_SEEDS, EVENT_SOURCED_FAN_OUT)
    check_event_sourced(reports)
    assert all("--event-sourced" in r.replay_command() for r in reports)


@pytest.mark.slow
def test_event_sourced_entities_keep_every_invariant_over_the_counter_ci_seeds() -> None:
    check_event_sourced(run_and_check(CI_SEEDS, EVENT_SOURCED_CI))


@pytest.mark.slow
def test_event_sourced_entities_keep_every_invariant_over_the_fan_out_ci_seeds() -> None:
    check_event_sourced(run_and_check(FAN_OUT_SEEDS, EVENT_SOURCED_FAN_OUT))


async def pause_a_holder(scenario: Scenario) -> None:
    """Pause a node that is not the coordinator for 14 s, once the workload runs.

    Its lease runs out, its shards move, and the appends its entities sent meanwhile arrive
    when the pause ends: after some of the new holders' recoveries.
    """
    await trio.sleep(3.0)
    i = next(j for j in scenario.sim.live if j != scenario.coordinator_node())
    scenario.sim.history.fault(f"pause n{i} for 14.0s")
    await scenario.sim.pause(i, 14.0, among=scenario.nodes)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 3])
def test_a_stale_holder_s_late_appends_are_fenced_in_their_batches(seed: int) -> None:
    # About 10 s each on an idle machine. Seed 2 shows no stale append arriving after a
    # recovery, so it is not among them (2026-11-27: seeds 1 and 3 each have one fenced).
    settings = ChaosSettings(duration=0.0, quiet=20.0, message_interval=0.1, event_sourced=True)
    report = run_scenario(seed, pause_a_holder, settings)
    print(f"seed={seed}: {report.journal}; replay: run_scenario({seed}, pause_a_holder, ...)")
    assert report.ok, report.violations
    assert report.journal is not None
    assert report.journal.fenced > 0
    assert run_scenario(seed, pause_a_holder, settings) == report  # replays from its seed
