"""What a chaos run's rolling upgrade must show when it really happened (issue 22)."""

from __future__ import annotations

from p2pshard.testing import NEXT_BUILD, PREVIOUS_BUILD, ChaosReport


def assert_rolled_out(report: ChaosReport) -> None:
    """Every node went to the next build once, then one came back; the cluster shows it.

    Each step ended with its node Up everywhere; after the quiet every member record shows the
    node's app version, the next-build nodes' links speak protocol version 2 with each other
    and 1 with the node rolled back; a crash and a partition came during the rollout.
    """
    rollout = report.rollout
    assert rollout is not None, f"seed {report.seed} drew no rollout"
    nodes = [f"n{i}" for i in range(1, report.settings.nodes + 1)]
    *upgrades, back = rollout.steps
    assert sorted(step.node for step in upgrades) == nodes, rollout.steps
    assert all(step.up is not None for step in rollout.steps), rollout.steps
    old, new = PREVIOUS_BUILD.app_version, NEXT_BUILD.app_version
    assert {(step.old, step.new) for step in upgrades} == {(old, new)}
    assert (back.old, back.new) == (new, old)
    assert dict(rollout.versions) == {n: old if n == back.node else new for n in nodes}
    assert {(a, b): v for a, b, v in rollout.links} == {
        (a, b): 1 if back.node in (a, b) else 2 for a in nodes for b in nodes if a != b
    }
    during = [fault for fault in report.faults if fault.endswith("(rollout)")]
    assert [fault.split(" ", 2)[1] for fault in during] in (
        ["crash", "partition"],
        ["partition", "crash"],
    ), report.faults
