"""A rolling upgrade of real node processes, and a rollback, under the counter workload (issue 22).

Three node processes of the previous build (this source tree, ``app_version`` 1.0.0) with shard
leases on are replaced one at a time, each by a graceful leave and a new process on the same
address, by processes of the next build (this tree with ``tests/rolling/next_build.patch``:
protocol versions 1-2, a new trailing heartbeat field, a new message type sent only over
protocol 2 links; 1.1.0); then one node is rolled back. The checkers run over the merged
histories (no acknowledged message lost, no double activation, sender order kept), every shard
answers through every node after every step, every previous-build process decoded everything it
received (the new type never reached it) and no link closed for a bad frame, every link agreed
on the lower protocol of its two builds, and the next-build nodes received the new type from
each other. About 50 s, in the default run. What a run that sends the new type to every peer
looks like is checked on the counters alone (the real run showing it is in the issue's notes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from membership import ConfigurationError
from p2pshard.cli._main import main
from p2pshard.testing import RealChaosReport, RealChaosSettings, run_real_chaos, summarize_real
from p2pshard.testing._real import (
    ROLLING,
    check_link_protocols,
    check_rolling_stats,
    node_process_env,
)
from p2pshard.testing._rolling import (
    NEXT_BUILD_PATCH,
    SOURCE_ROOT,
    Build,
    PatchDoesNotApply,
    make_next_build,
    previous_build,
)
from tests.p2pshard.test_chaos_real import running

SEED = 20261126


def check_rollout(report: RealChaosReport, upgraded: int) -> None:
    print(summarize_real(report))
    assert not [pid for pid in report.pids if running(pid)], "node processes left running"
    assert report.ok, "\n".join(str(v) for v in report.violations[:20])
    steps = [(step.node, step.from_build, step.to_build) for step in report.steps]
    assert len(steps) == upgraded + 1
    assert len({node for node, _, _ in steps[:upgraded]}) == upgraded
    assert all(step[1:] == ("previous", "next") for step in steps[:upgraded])
    assert steps[-1][0] in {node for node, _, _ in steps[:upgraded]}
    assert steps[-1][1:] == ("next", "previous")
    assert report.processes == report.settings.nodes + upgraded + 1
    assert report.incarnations > 0
    assert report.acknowledged > report.sent / 2 > 0
    assert report.agreed_after is not None


def test_two_of_three_nodes_upgraded_and_one_rolled_back_lose_nothing(tmp_path: Path) -> None:
    """The default run's variant (about 40 s): next-build nodes beside a previous-build one."""
    print(f"seed={SEED}")
    settings = RealChaosSettings(nodes=3, rolling=True, upgrade=2)
    check_rollout(run_real_chaos(SEED, settings, data_dir=tmp_path / "run"), 2)


@pytest.mark.slow
def test_every_node_upgraded_and_one_rolled_back_lose_nothing(tmp_path: Path) -> None:
    """The issue's test: three nodes upgraded, one rolled back (50 to 70 s here)."""
    print(f"seed={SEED}")
    report = run_real_chaos(SEED, RealChaosSettings.rolling_upgrade(), data_dir=tmp_path / "run")
    check_rollout(report, 3)


def test_the_next_build_is_this_tree_patched_and_wins_the_path(tmp_path: Path) -> None:
    build = make_next_build(tmp_path / "next")
    assert (build.app_version, build.protocol, build.greets) == ("1.1.0", 2, True)
    assert "class Greeting" in (build.root / "membership" / "_heartbeat.py").read_text()
    assert "class Greeting" not in (SOURCE_ROOT / "membership" / "_heartbeat.py").read_text()
    # Started from this source tree's root, as pytest and the orchestrator may be: the build on
    # PYTHONPATH is imported all the same, not the tree in the working directory.
    probe = (
        "import membership\nfrom membership.transport._versions import CURRENT_PROTOCOL\n"
        "print(membership.__file__, CURRENT_PROTOCOL)"
    )
    for root, expected in ((build.root, "versions 1-2"), (SOURCE_ROOT, "version 1")):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env=node_process_env(root),
            cwd=SOURCE_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert Path(out[0]).is_relative_to(root), out
        assert " ".join(out[1:]) == expected
    assert previous_build().protocol == 1


def test_a_patch_that_no_longer_applies_says_how_to_remake_it(tmp_path: Path) -> None:
    stale = tmp_path / "stale.patch"
    text = NEXT_BUILD_PATCH.read_text()
    assert "\n-CURRENT_PROTOCOL" in text
    # As if the tree had moved on: the line the patch replaces is not there any more.
    stale.write_text(text.replace("\n-CURRENT_PROTOCOL", "\n-PROTOCOL_OF_OLD"))
    with pytest.raises(PatchDoesNotApply) as caught:
        make_next_build(tmp_path / "next", patch=stale)
    message = str(caught.value)
    assert str(stale) in message
    assert "git apply --3way tests/rolling/next_build.patch" in message
    assert "git diff -- membership crdt p2pshard" in message
    assert "docs/testing.md" in message


def test_a_missing_patch_or_a_used_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"patch .* is missing: a rolling run needs a"):
        make_next_build(tmp_path / "next", patch=tmp_path / "none.patch")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="is not an empty directory"):
        make_next_build(tmp_path / "used")


def test_a_new_type_sent_to_the_previous_build_and_a_bad_link_are_caught() -> None:
    old = Build("previous", SOURCE_ROOT, "1.0.0", protocol=1)
    new = Build("next", SOURCE_ROOT, "1.1.0", protocol=2)
    clean = {"dropped_undecodable": 0, "links_closed_undecodable": 0, "links_closed_refused": 0}
    assert check_rolling_stats("node-1#1", old, clean) == []
    dropped = check_rolling_stats("node-1#1", old, {**clean, "dropped_undecodable": 3})
    assert [v.invariant for v in dropped] == [ROLLING]
    assert "node-1#1 (build previous) dropped 3 messages" in dropped[0].detail
    closed = check_rolling_stats("node-2#2", new, {**clean, "links_closed_undecodable": 1})
    assert "closed 1 links for a frame it could not read" in closed[0].detail
    builds = {"node-1": new, "node-2": new, "node-3": old}
    agreed: dict[str, dict[str, Any]] = {
        "node-1": {"protocols": {"node-2": 2, "node-3": 1}},
        "node-2": {"protocols": {"node-1": 2, "node-3": None}},  # a link not up: not checked
        "node-3": {"protocols": {"node-1": 1, "node-2": 1}},
    }
    assert check_link_protocols(agreed, builds) == []
    wrong = {**agreed, "node-2": {"protocols": {"node-1": 1, "node-3": 2}}}
    assert [v.detail for v in check_link_protocols(wrong, builds)] == [
        "node-2 (build next) speaks protocol 1 to node-1 (build next), not 2",
        "node-2 (build next) speaks protocol 2 to node-3 (build previous), not 1",
    ]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--rolling"], "--quick, --rolling, --upgrade and --dir go with --real"),
        (["--real", "--rolling", "--quick"], "--rolling injects no faults"),
        (["--real", "--rolling", "--faults", "kill"], "--rolling injects no faults"),
        (["--real", "--rolling", "--nodes", "2"], "RealChaosSettings.nodes = 2 is invalid"),
        (["--real", "--rolling", "--upgrade", "4"], "upgrade = 4 is invalid: there are only 3"),
        (["--real", "--upgrade", "2"], "--upgrade goes with --real --rolling"),
    ],
)
def test_the_command_refuses_bad_rolling_options(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", *argv]) == 2
    assert error in capsys.readouterr().err


def test_the_replay_command_of_a_rolling_run() -> None:
    def replay(settings: RealChaosSettings) -> str:
        report = RealChaosReport(1, settings, (), (), 0, 0, 0, 0, 0.0, None, Path("."), ())
        return report.replay_command()

    assert replay(RealChaosSettings.rolling_upgrade()) == "p2pshard chaos --real --rolling --seed 1"
    five = RealChaosSettings(nodes=5, rolling=True, upgrade=2, use_lease=False)
    assert replay(five) == (
        "p2pshard chaos --real --rolling --seed 1 --nodes 5 --upgrade 2 --no-lease"
    )
