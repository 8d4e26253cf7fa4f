"""The chaos suite with event-sourced entities on a group-committing memory journal (issue 24).

With ``ChaosSettings(event_sourced=True)`` the counters, rooms and inboxes are event-sourced
entities on one ``MemoryJournal(group_commit=True)`` the nodes share, each writing with its
shard's lease token (``p2pshard/testing/_journaled.py``); the checkers read the logs and copies
from the journal, and ``journal-fencing`` checks from the journal's record that no append got
past a fence. The default run takes the first counter CI seed and the first fan-out CI seed;
``--slow`` runs every CI seed of both workloads this way (``CI_SEEDS`` with the realistic
settings, ``FAN_OUT_SEEDS``). The random schedules seldom make a stale holder's append arrive
after a new holder's recovery (one fenced append over all 92 CI seeds, 2026-11-27), so a scenario
makes it happen: a holder paused for 14 s appends meanwhile, and its appends arrive after the new
holders' recoveries, in sequence; the fence refuses them, and a journal whose batches ignore the
fence lets them in and is caught by ``journal-fencing``.
"""

from __future__ import annotations

import contextlib
import functools
import re

import attrs
import pytest
import trio

from membership import ClusterError
from p2pshard import EntityId, HashExtractor
from p2pshard.persistence import _group_commit, _memory
from p2pshard.testing import Add, ChaosReport, ChaosSettings, Read, Scenario, run_scenario
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


STALE_SEED = 2
"""A seed whose pause leaves stale appends in sequence when they arrive (2026-11-27: six of
them), so that only the fence stands between them and the stream."""

STALE_SETTINGS = ChaosSettings(duration=0.0, quiet=20.0, message_interval=1.0, event_sourced=True)
"""Few client messages, so that the new holders' recoveries are not followed by appends of
their own before the stale ones arrive."""


async def stale_holder(scenario: Scenario) -> None:
    """A holder appends while paused; its shards move; its appends arrive after the recoveries.

    Node ``n`` (not the coordinator) is paused for 14 s; half a second in, each counter it holds
    gets an ``Add`` through ``n``'s own region, whose append waits in flight. 11 s in, after the
    split brain resolver has downed ``n`` and its shards have moved, another node reads each of
    those counters: the new holders recover them, raising their fences. When the pause ends the
    stale appends arrive, in sequence, and only the fence refuses them.
    """
    sim = scenario.sim
    await trio.sleep(3.0)
    n = next(i for i in sim.live if i != scenario.coordinator_node())
    other = next(i for i in sim.live if i != n)
    here = sim.nodes[n].cluster.self_member.node
    extractor = HashExtractor(scenario.settings.shards)
    homes = sim.regions[n].shard_homes()
    held = [
        f"e{k}"
        for k in range(scenario.settings.entities)
        if homes.get(extractor.shard_id(EntityId(f"e{k}"))) == here
    ]
    sim.history.fault(f"pause n{n} for 14.0s; stale appends to {held}")

    async def ask(i: int, entity: str, message: object) -> None:
        with contextlib.suppress(ClusterError):
            await sim.regions[i].entity_ref(entity).ask(message, timeout=2.0)

    async def recover_elsewhere() -> None:
        await trio.sleep(11.0)
        for entity in held:
            await ask(other, entity, Read())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(sim.pause, n, 14.0, among=scenario.nodes))
        await trio.sleep(0.5)
        for k, entity in enumerate(held, start=1):
            nursery.start_soon(ask, n, entity, Add(sender="stale", seq=k))
        nursery.start_soon(recover_elsewhere)


def test_a_stale_holder_s_late_appends_are_fenced_in_their_batches() -> None:
    report = run_scenario(STALE_SEED, stale_holder, STALE_SETTINGS)
    print(f"seed={STALE_SEED}: {list(report.faults)}; {report.journal}")
    assert report.ok, report.violations
    assert report.journal is not None
    assert report.journal.fenced >= 1


def test_a_journal_that_ignores_the_fence_is_caught_in_a_chaos_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = _group_commit.plan_batch

    def fence_blind(
        batch: list[_group_commit.PendingAppend], stored: dict[str, _group_commit.StreamRow]
    ) -> _group_commit.BatchPlan:
        blind = {pid: _group_commit.StreamRow(row.highest, None) for pid, row in stored.items()}
        return plan(batch, blind)

    monkeypatch.setattr(_memory, "plan_batch", fence_blind)
    report = run_scenario(STALE_SEED, stale_holder, STALE_SETTINGS)
    print(f"seed={STALE_SEED}: {[str(v) for v in report.violations]}")
    caught = [v for v in report.violations if v.invariant == "journal-fencing"]
    assert caught
    for violation in caught:
        assert re.match(
            r"Counter\|e\d+: append at \d+ under token \d+ was accepted after token \d+ had "
            r"fenced the stream",
            violation.detail,
        ), violation


@pytest.mark.slow
def test_the_stale_holder_scenario_replays_from_its_seed() -> None:
    first = run_scenario(STALE_SEED, stale_holder, STALE_SETTINGS)
    assert run_scenario(STALE_SEED, stale_holder, STALE_SETTINGS) == first
