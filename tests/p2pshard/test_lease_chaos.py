"""No two incarnations of an entity alive at once, under random partitions, crashes and pauses.

Each seed is a whole five-node cluster in one ``trio.run`` (see ``lease_chaos``). The default run
takes ``DEFAULT_SEEDS`` seeds; ``--slow`` runs ``SLOW_SEEDS``. The checker is shown to catch what
it must: with shard leases off the same schedules do produce two live incarnations, and a test
fault that activates an entity twice is reported.
"""

from __future__ import annotations

import pytest
import trio

from .lease_chaos import run_chaos
from .sharding_sim import ActivationChecker

DEFAULT_SEEDS = range(1, 16)
SLOW_SEEDS = range(1000, 2000)


def check(seed: int) -> None:
    result = run_chaos(seed)
    print(f"seed={seed}: {result.incarnations} incarnations, {len(result.faults)} faults")
    assert result.incarnations > 0
    assert result.delivered > 0
    assert not result.violations, f"seed {seed} (replay: run_chaos({seed})): " + "\n".join(
        [*result.violations[:5], "faults:", *result.faults]
    )


@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_single_activation_under_partitions_crashes_and_pauses_with_leases(seed: int) -> None:
    check(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_single_activation_over_a_thousand_seeds(seed: int) -> None:
    check(seed)


def test_without_leases_the_checker_finds_two_live_incarnations() -> None:
    # Seeds 2 and 6 were found by running seeds 1..10 with leases off: a node that is partitioned
    # or paused keeps its entities until it downs itself, while the other side's coordinator
    # has already moved its shards.
    caught = {seed: run_chaos(seed, use_lease=False).violations for seed in (2, 6)}
    assert all(caught.values()), caught
    assert all(" overlap" in line for lines in caught.values() for line in lines)


def test_the_checker_reports_an_entity_activated_twice_by_a_test_fault() -> None:
    result = run_chaos(3, duration=20.0, double_activation_at=10.0)
    [fault] = [line for line in result.faults if "test fault" in line]
    entity = fault.split()[3]
    assert result.violations
    assert all(line.startswith(f"{entity}: ") for line in result.violations), result.violations


def test_a_chaos_run_replays_from_its_seed() -> None:
    first = run_chaos(4, duration=20.0)
    second = run_chaos(4, duration=20.0)
    assert first == second


async def test_the_checker_on_hand_made_histories(autojump_clock: trio.testing.MockClock) -> None:
    checker = ActivationChecker()
    checker.started("n1", "a", 1)
    await trio.sleep(1)
    checker.stopped("n1", "a")
    checker.started("n2", "a", 2)  # right after: not an overlap
    checker.started("n3", "b", None)
    await trio.sleep(1)
    checker.started("n4", "b", None)  # n3's is still alive
    await trio.sleep(1)
    checker.node_gone("n3")
    assert checker.violations() == [
        "b: n3 [1.000, 3.0] token None and n4 [2.000, None] token None overlap"
    ]
    assert checker.incarnations() == 4
