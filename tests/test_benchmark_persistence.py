"""``benchmarks.persistence`` measures what its options choose, and refuses what makes no sense.

A tiny plan (a few samples, short windows) on SQLite only: the figures' shape, not their values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import persistence


@pytest.fixture
def tiny_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        persistence,
        "make_plan",
        lambda *, quick: persistence.Plan(samples=5, rounds=1, window=0.2),
    )


def test_only_the_chosen_backend_and_streams_are_measured(
    tiny_plan: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--appends", "--backend", "sqlite", "--streams", "8", "4", "8", "--json"]
    assert persistence.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["streams"] == [4, 8]
    assert list(report["sqlite"]["streams"]) == ["4", "8"]
    assert report["sqlite"]["streams"]["8"]["appends_per_s"] > 0
    assert report["sqlite"]["appends_per_s"] == report["sqlite"]["streams"]["4"]["appends_per_s"]
    assert "postgresql" not in report
    assert report["entity"] == {"before": None}  # --appends: no recoveries, no snapshots
    assert report["sqlite_appends_256_ratio"] is None  # 256 streams were not measured
    assert report["sqlite_append_1_p50_ratio"] > 0
    at_8 = report["sqlite"]["streams"]["8"]
    assert at_8["cpu_us_per_append"] > 0  # this process's CPU, spread over its appends
    assert at_8["baseline_cpu_us_per_insert"] > 0
    assert at_8["server_cpu_us_per_append"] is None  # SQLite has no server
    assert at_8["cpu_ceiling_per_s"] == pytest.approx(
        report["cpus"] / (at_8["cpu_us_per_append"] * 1e-6)
    )
    assert at_8["cpu_ceiling_ratio"] == pytest.approx(
        at_8["cpu_ceiling_per_s"] / at_8["baseline_per_s"]
    )
    assert report["sqlite_cpu_ceiling_256_ratio"] is None
    assert "long" not in report["sqlite"]  # no long-stream windows without 256 streams
    assert report["sqlite_appends_256_long_ratio"] is None

    assert persistence.main(["--appends", "--backend", "sqlite", "--streams", "4"]) == 0
    table = capsys.readouterr().out
    assert "appends/s, 4 streams at once" in table
    assert "CPU per append, this process" in table
    assert "most appends/s that CPU allows on" in table
    assert "CPU per append, the server" not in table
    assert "entity side" not in table
    assert "postgresql" not in table.split("\n", 1)[1]  # only the title names it


def test_long_stream_windows_go_on_from_the_events_each_stream_already_holds(
    tiny_plan: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Appends that did not go on from the held events would be refused (the journal) or break
    # the primary key (the baseline), and the run would fail.
    monkeypatch.setattr(persistence, "LONG_AT", 4)
    monkeypatch.setattr(persistence, "HELD", 7)
    assert persistence.main(["--appends", "--backend", "sqlite", "--streams", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    long = report["sqlite"]["long"]
    assert (long["streams"], long["held"]) == (4, 7)
    assert long["appends_per_s"] > 0
    assert long["baseline_per_s"] > 0
    assert long["ratio"] == pytest.approx(long["appends_per_s"] / long["baseline_per_s"])
    assert 1 <= long["batch"] <= 4  # the window's commits: at most one append per stream each
    assert report["sqlite_appends_256_long_ratio"] is None  # 4 streams, not 256

    assert persistence.main(["--appends", "--backend", "sqlite", "--streams", "4"]) == 0
    table = capsys.readouterr().out
    assert "appends/s, 4 streams holding 7 events each" in table
    assert "sqlite_appends_256_long_ratio" not in table


def test_long_stream_windows_on_postgresql(
    tiny_plan: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The raw table is filled with COPY, the journal's streams with appends of 7 events each.
    monkeypatch.setattr(persistence, "LONG_AT", 4)
    monkeypatch.setattr(persistence, "HELD", 7)
    argv = ["--appends", "--backend", "postgresql", "--streams", "4", "--json"]
    assert persistence.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report.get("postgresql_missing") is None
    long = report["postgresql"]["long"]
    assert (long["streams"], long["held"]) == (4, 7)
    assert long["appends_per_s"] > 0
    assert long["baseline_per_s"] > 0
    assert long["server_cpu_us_per_append"] > 0
    assert report["postgres_appends_256_long_ratio"] is None  # 4 streams, not 256


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--entity", "--appends"], "--entity and --appends leave nothing to measure together"),
        (["--streams", "0"], "--streams takes counts from 1, not 0"),
        (["--backend", "mysql"], "invalid choice: 'mysql'"),
    ],
)
def test_options_that_make_no_sense_are_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        persistence.main(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_a_servers_cpu_counts_its_children_live_and_ended() -> None:
    """What the benchmark reads from ``/proc`` for PostgreSQL: the server and its children."""
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    me = os.getpid()
    assert persistence.server_cpu(None) is None
    before = persistence.server_cpu(me)
    assert before is not None
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        live = None
        for _ in range(200):  # while it still runs: counted as a live child
            time.sleep(0.01)
            live = persistence.server_cpu(me)
            assert live is not None
            if child.poll() is None and live - before >= 0.15:
                break
        assert live is not None
        assert live - before >= 0.15
    finally:
        child.wait()
    ended = persistence.server_cpu(me)  # reaped: in this process's count of ended children
    assert ended is not None
    assert ended - before >= 0.25
