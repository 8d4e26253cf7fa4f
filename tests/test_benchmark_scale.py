"""``benchmarks.scale`` on its smallest plan: it runs every phase and reports its keys.

A check of the benchmark's plumbing (a few seconds), not of its figures: no timing is asserted,
only that each phase reached its end on a simulated cluster of four nodes.
"""

from __future__ import annotations

import json

from benchmarks import scale
from benchmarks._report import json_safe


def test_the_smallest_plan_reports_every_phase_and_the_must_show_keys() -> None:
    plan = scale.Plan(sizes=(4,), shards=30, entities=90, joins=2, crashes=1, seed=3)
    report = scale.run_all(plan)
    assert set(report) >= {"cold_allocation_s_n100", "rebalance_intervals_after_10_joins"}
    assert report["cold_allocation_s_n100"] is None  # no 100-node cluster in this plan
    assert report["rebalance_intervals_after_10_joins"] is not None
    (size,) = report["sizes"]
    assert "stopped" not in size, size["stopped"]
    cold = size["cold"]
    assert cold["shards_allocated"] == 30
    assert cold["entities_handled"] == 90
    assert cold["cold_allocation_s"] is not None
    assert cold["all_entities_s"] is not None
    assert cold["coordinator_calls"] > 0
    assert sum(cold["counts"]) == 30
    joins = size["joins"]
    assert joins["joined"] == 2
    assert joins["reason"] == ""
    assert joins["final_min_max"][1] - joins["final_min_max"][0] <= 1
    crashes = size["crashes"]
    assert crashes["reason"] == ""
    assert crashes["answered"] == 30
    assert crashes["every_shard_s"] is not None
    assert crashes["down_seen_s"] is not None
    json.dumps(json_safe(report))  # the --json output
    table = scale.format_table(report)
    assert "cold allocation at 100 nodes" in table
