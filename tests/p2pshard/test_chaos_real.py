"""Real-process chaos: node processes on loopback, killed, stopped, cut off and slowed by proxies.

The quick run (three processes, about 70 s) is a default test: every invariant holds, every
quick fault kind was injected, messages were acknowledged, no node process is left. The ten
minute run on five processes is ``slow``. The merge of the processes' history files is tested
on hand-made files, which show what the checkers must catch: overlapping incarnations in two
processes, an incarnation that acts after its process was continued, messages acknowledged but
not kept, or kept twice, or out of order, and two singletons at once. A run with leases off and
long pauses shows a real double activation being caught (``slow``: it depends on timing). The
proxies are tested on their own, with an echo server: blocked, slow and flaky links.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import pytest
import trio

from membership import Address
from p2pshard.cli._main import main
from p2pshard.testing import (
    REAL_FAULTS,
    FaultProxy,
    ProcessRun,
    RealChaosReport,
    RealChaosSettings,
    check_history,
    merge_histories,
    run_real_chaos,
    summarize_real,
)
from p2pshard.testing._merge import live_pieces
from p2pshard.testing._real import QUICK_FAULTS, _Orchestrator

SEED = 20261122


def running(pid: int) -> bool:
    """Whether a node process with this pid still runs (a reused pid runs something else)."""
    try:
        return b"_real_node" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def check_run(report: RealChaosReport, kinds: tuple[str, ...]) -> None:
    print(summarize_real(report))
    assert not [pid for pid in report.pids if running(pid)], "node processes left running"
    assert report.ok, "\n".join(str(v) for v in report.violations[:20])
    counts = report.fault_counts()
    assert set(kinds) <= set(counts), f"not every kind was injected: {counts}"
    assert report.incarnations > 0
    assert report.acknowledged > report.sent / 2 > 0
    assert report.processes > report.settings.nodes  # killed (or downed) nodes came back
    assert report.agreed_after is not None


def test_a_quick_real_run_keeps_every_invariant(tmp_path: Path) -> None:
    print(f"seed={SEED}")
    report = run_real_chaos(SEED, RealChaosSettings.quick(), data_dir=tmp_path / "run")
    check_run(report, QUICK_FAULTS)


@pytest.mark.slow
def test_ten_minutes_of_real_chaos_on_five_processes(tmp_path: Path) -> None:
    print(f"seed={SEED}")
    settings = RealChaosSettings(nodes=5, duration=600.0)
    report = run_real_chaos(SEED, settings, data_dir=tmp_path / "run")
    check_run(report, REAL_FAULTS)


@pytest.mark.slow
def test_without_leases_a_long_pause_ends_in_a_double_activation(tmp_path: Path) -> None:
    # The paused node is downed and its shards move; woken up, it still believes it hosts them
    # and its own clients reach its old incarnations until it learns it is out. With leases it
    # would find its leases lost first.
    print(f"seed={SEED}")
    settings = RealChaosSettings(
        nodes=3,
        duration=10.0,
        quiet=10.0,
        settle=20.0,
        faults=("pause-long",),
        max_faults=1,
        lease_ttl=12.0,
        fault_max=18.0,
        use_lease=False,
    )
    report = run_real_chaos(SEED, settings, data_dir=tmp_path / "run")
    print(summarize_real(report))
    assert not [pid for pid in report.pids if running(pid)], "node processes left running"
    assert any(v.invariant == "single-activation" for v in report.violations), report.violations


# --- the merge, on hand-made history files --------------------------------------------------------


def write(path: Path, *events: Mapping[str, object]) -> Path:
    path.write_text("".join(json.dumps(event) + "\n" for event in events))
    return path


def run_of(path: Path, label: str, ended: float, **changes: object) -> ProcessRun:
    run = ProcessRun(label.split("#")[0], label, path, 0.0, ended=ended)
    for name, value in changes.items():
        setattr(run, name, value)
    return run


def start(t: float, key: str = "Counter/e1", token: int = 1) -> dict[str, object]:
    return {"e": "start", "t": t, "key": key, "token": token}


def stop(t: float, key: str = "Counter/e1") -> dict[str, object]:
    return {"e": "stop", "t": t, "key": key}


def log(t: float, sender: str, seq: int, key: str = "Counter/e1") -> dict[str, object]:
    return {"e": "log", "t": t, "key": key, "sender": sender, "seq": seq}


def test_two_processes_with_overlapping_incarnations_break_single_activation(
    tmp_path: Path,
) -> None:
    a = write(tmp_path / "a.jsonl", start(1.0, token=1), stop(10.0))
    b = write(tmp_path / "b.jsonl", start(9.0, token=2), stop(20.0))
    merged = merge_histories([run_of(a, "node-1#1", 30.0), run_of(b, "node-2#1", 30.0)])
    [violation] = check_history(merged.history)
    assert violation.invariant == "single-activation"
    assert "node-1#1 [1.000, 10.000] token 1" in violation.detail
    assert "node-2#1 [9.000, 20.000] token 2" in violation.detail
    assert merged.incarnations == 2


def test_an_incarnation_ends_when_its_process_is_killed_or_seen_to_exit(tmp_path: Path) -> None:
    a = write(tmp_path / "a.jsonl", start(1.0))  # never stopped: killed at 5
    b = write(tmp_path / "b.jsonl", start(6.0))
    runs = [run_of(a, "node-1#1", 5.0, killed=True), run_of(b, "node-2#1", 30.0)]
    assert check_history(merge_histories(runs).history) == []
    runs[0].ended = 7.0  # exited, seen at 7: after b started
    [violation] = check_history(merge_histories(runs).history)
    assert violation.invariant == "single-activation"


def test_a_stopped_process_is_live_again_only_if_it_acts_after_it_is_continued(
    tmp_path: Path,
) -> None:
    # node-1 is stopped from 2 to 12; node-2 takes the entity over at 8. Woken, node-1's
    # incarnation stops at 12.5 without handling anything: no overlap. Had it handled a message
    # after 12, both would have been live.
    a = write(tmp_path / "a.jsonl", start(1.0), log(1.5, "c", 1), stop(12.5))
    b = write(tmp_path / "b.jsonl", start(8.0, token=2), log(9.0, "c", 2))
    runs = [run_of(a, "node-1#1", 30.0, pauses=[(2.0, 12.0)]), run_of(b, "node-2#1", 30.0)]
    assert check_history(merge_histories(runs).history) == []
    write(tmp_path / "a.jsonl", start(1.0), log(1.5, "c", 1), log(12.2, "c", 3), stop(12.5))
    found = check_history(merge_histories(runs).history)
    assert [v.invariant for v in found] == ["single-activation"]
    assert "node-1#1 [12.000, 12.500]" in found[0].detail


def test_live_pieces_cut_an_incarnation_at_its_pauses() -> None:
    pauses = [(2.0, 4.0), (6.0, 8.0)]
    assert live_pieces(1.0, 10.0, pauses, []) == [(1.0, 2.0)]
    assert live_pieces(1.0, 10.0, pauses, [5.0]) == [(1.0, 2.0), (4.0, 6.0)]
    assert live_pieces(1.0, 10.0, pauses, [9.0]) == [(1.0, 2.0), (8.0, 10.0)]
    assert live_pieces(1.0, 10.0, [(12.0, 13.0)], []) == [(1.0, 10.0)]
    assert live_pieces(5.0, 7.0, [(1.0, 2.0)], []) == [(5.0, 7.0)]


def test_messages_lost_kept_twice_or_out_of_order_are_caught_across_files(
    tmp_path: Path,
) -> None:
    sender = "node-1.4242.c0"
    a = write(
        tmp_path / "a.jsonl",
        *(
            {"e": "sent", "t": 0.5 + seq, "sender": sender, "key": "Counter/e1", "seq": seq}
            for seq in (1, 2, 3, 4)
        ),
        *({"e": "ack", "t": 0.9 + seq, "sender": sender, "seq": seq} for seq in (1, 2, 3, 4)),
    )
    b = write(
        tmp_path / "b.jsonl",
        start(0.1),
        log(1.6, sender, 1),
        log(2.6, sender, 3),  # 3 before 2 ...
        stop(3.0),
    )
    c = write(
        tmp_path / "c.jsonl",
        start(3.1, token=2),
        log(3.6, sender, 2),  # ... 2, here: out of order
        log(4.6, sender, 4),
        log(4.7, sender, 4),  # kept twice
    )
    c.write_text(c.read_text() + '{"e": "bro')  # a line cut short does not parse
    runs = [run_of(a, "node-1#1", 9.0), run_of(b, "node-2#1", 9.0), run_of(c, "node-3#1", 9.0)]
    merged = merge_histories(runs)
    assert (
        merged.history.logs["Counter/e1"]
        == [(sender, 1), (sender, 3), (sender, 2)] + [(sender, 4)] * 2
    )
    found = {str(v) for v in check_history(merged.history)}
    assert found == {
        f"acknowledged-kept: Counter/e1: {sender}#4 handled 2 times",
        f"sender-order: Counter/e1: {sender}#2 was handled after {sender}#3",
    }
    assert merged.broken_lines == 1
    assert merged.history.acknowledged_count() == 4


def test_an_acknowledged_message_missing_from_every_log_is_caught(tmp_path: Path) -> None:
    a = write(
        tmp_path / "a.jsonl",
        {"e": "sent", "t": 1.0, "sender": "s", "key": "Counter/e1", "seq": 1},
        {"e": "ack", "t": 2.0, "sender": "s", "seq": 1},
    )
    merged = merge_histories([run_of(a, "node-1#1", 9.0)], origin=0.5)
    [violation] = check_history(merged.history)
    assert str(violation) == (
        "acknowledged-kept: Counter/e1: s#1 was acknowledged at 1.500 but is not in the "
        "entity's log"
    )


def test_two_singleton_instances_at_once_are_caught(tmp_path: Path) -> None:
    a = write(
        tmp_path / "a.jsonl",
        {"e": "singleton-start", "t": 1.0, "name": "chaos-probe"},
        {"e": "singleton-act", "t": 1.5, "name": "chaos-probe"},
    )  # still running when its process was killed at 6
    b = write(tmp_path / "b.jsonl", {"e": "singleton-start", "t": 5.0, "name": "chaos-probe"})
    runs = [run_of(a, "node-1#1", 6.0, killed=True), run_of(b, "node-2#1", 9.0)]
    [violation] = check_history(merge_histories(runs).history)
    assert violation.invariant == "single-singleton"


def test_a_process_that_has_not_ended_cannot_be_merged(tmp_path: Path) -> None:
    run = ProcessRun("node-1", "node-1#1", write(tmp_path / "a.jsonl", start(1.0)), 0.0)
    with pytest.raises(ValueError, match="node-1#1 has not ended"):
        merge_histories([run])


# --- the command ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--quick"], "--quick, --rolling, --upgrade and --dir go with --real"),
        (["--real", "--nodes", "2"], "RealChaosSettings.nodes = 2 is invalid"),
        (["--real", "--faults", "kill,crash"], "RealChaosSettings.faults = ('kill', 'crash')"),
    ],
)
def test_the_command_refuses_bad_real_options(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["chaos", *argv]) == 2
    assert error in capsys.readouterr().err


# --- the proxies ----------------------------------------------------------------------------------


async def echo(stream: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while data := await stream.receive_some(1024):
            await stream.send_all(data)


@contextlib.asynccontextmanager
async def proxy_to(
    server: Callable[[trio.SocketStream], Awaitable[None]],
) -> AsyncIterator[tuple[FaultProxy, Address]]:
    """A proxy to ``server`` on 127.0.0.1, and where to dial it; both stop at the end."""
    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), server, 0
        )
        proxy = FaultProxy("a->b", Address("127.0.0.1", listener.socket.getsockname()[1]))
        yield proxy, await nursery.start(proxy.serve)
        nursery.cancel_scope.cancel()


async def round_trip(stream: trio.SocketStream, data: bytes, wait: float) -> bytes | None:
    """What comes back for ``data`` within ``wait`` seconds (None: nothing; b"": closed)."""
    with trio.move_on_after(wait):
        try:
            await stream.send_all(data)
            return await stream.receive_some(1024)
        except trio.BrokenResourceError:
            return b""
    return None


async def test_a_blocked_proxy_forwards_nothing_and_resets_its_links_when_healed() -> None:
    async with proxy_to(echo) as (proxy, via):
        old = await trio.open_tcp_stream(via.host, via.port)
        assert await round_trip(old, b"one", 5) == b"one"

        proxy.block()
        assert await round_trip(old, b"two", 0.3) is None  # held: neither lost nor passed
        held = await trio.open_tcp_stream(via.host, via.port)  # accepted, never forwarded
        assert await round_trip(held, b"three", 0.3) is None

        proxy.heal()
        for stream in (old, held):  # reset: the ends see the link break and reconnect
            assert await round_trip(stream, b"four", 5) == b""
        new = await trio.open_tcp_stream(via.host, via.port)
        assert await round_trip(new, b"five", 5) == b"five"
        assert proxy.connections == 3
        for stream in (old, held, new):
            await stream.aclose()


async def test_a_slow_proxy_delivers_every_chunk_late_but_whole_and_in_order() -> None:
    send, chunks = trio.open_memory_channel[tuple[float, bytes]](100)

    async def record(stream: trio.SocketStream) -> None:
        async for data in stream:
            await send.send((trio.current_time(), bytes(data)))

    async def receive(size: int) -> list[tuple[float, bytes]]:
        """The chunks (arrival time, data) of the next ``size`` bytes."""
        got: list[tuple[float, bytes]] = []
        with trio.fail_after(10):
            while sum(len(data) for _, data in got) < size:
                got.append(await chunks.receive())
        return got

    async with proxy_to(record) as (proxy, via):
        stream = await trio.open_tcp_stream(via.host, via.port)
        proxy.slow(0.5)
        sent: list[float] = []
        for n in range(20):
            sent.append(trio.current_time())
            await stream.send_all(b"%03d" % n)
            await trio.sleep(0.01)
        arrived = await receive(60)
        assert b"".join(data for _, data in arrived) == b"".join(b"%03d" % n for n in range(20))
        late = [t - sent[n] for n, t in enumerate(arrival_times(arrived, 3))]
        assert 0.5 <= min(late) <= max(late) < 2.0, late  # each chunk its delay, not the sum

        proxy.heal()
        at = trio.current_time()
        await stream.send_all(b"end")
        arrived = await receive(3)
        assert b"".join(data for _, data in arrived) == b"end"
        assert arrived[-1][0] - at < 0.5
        await stream.aclose()


def arrival_times(arrived: list[tuple[float, bytes]], size: int) -> list[float]:
    """When the last byte of each ``size``-byte message arrived."""
    times: list[float] = []
    total = 0
    for t, data in arrived:
        total += len(data)
        times += [t] * (total // size - len(times))
    return times


async def test_a_flaky_proxy_resets_connections_and_accepts_new_ones() -> None:
    async with proxy_to(echo) as (proxy, via):
        old = await trio.open_tcp_stream(via.host, via.port)
        assert await round_trip(old, b"one", 5) == b"one"

        proxy.flaky(1.0, random.Random(SEED))
        assert await round_trip(old, b"two", 5) == b""  # reset: the chunk is lost with the link
        during = await trio.open_tcp_stream(via.host, via.port)  # accepted, reset at once
        assert await round_trip(during, b"three", 5) == b""

        print(f"seed={SEED}")
        proxy.flaky(0.3, random.Random(SEED))  # now and then: some round trips pass
        stream = await trio.open_tcp_stream(via.host, via.port)
        passed = broken = 0
        for n in range(30):
            if await round_trip(stream, b"%02d" % n, 5) == b"%02d" % n:
                passed += 1
            else:
                broken += 1
                await stream.aclose()
                stream = await trio.open_tcp_stream(via.host, via.port)
        assert passed > 0
        assert broken > 0
        assert proxy.resets == 2 + broken

        proxy.heal()
        new = await trio.open_tcp_stream(via.host, via.port)
        assert await round_trip(new, b"four", 5) == b"four"
        assert await round_trip(stream, b"five", 5) == b"five"  # opened while flaky
        assert proxy.resets == 2 + broken
        for each in (old, during, stream, new):
            await each.aclose()


def test_a_proxy_refuses_a_negative_delay_and_a_chance_outside_0_to_1() -> None:
    proxy = FaultProxy("a->b", Address("127.0.0.1", 7355))
    with pytest.raises(ValueError, match=r"not -0\.1"):
        proxy.slow(-0.1)
    with pytest.raises(ValueError, match=r"not 1\.5"):
        proxy.flaky(1.5, random.Random(SEED))
    assert (proxy.delay, proxy.reset_chance) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("kind", "line", "low", "high"),
    [
        ("slow", r"slow node-(\d) \(every chunk (\d+) ms late\) for 3\.0s", 50, 500),
        ("flaky", r"flaky node-(\d) \(reset at (\d+)% of chunks\) for 3\.0s", 5, 25),
    ],
)
async def test_slow_and_flaky_take_every_link_to_and_from_one_node_until_healed(
    kind: str,
    line: str,
    low: int,
    high: int,
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
) -> None:
    print(f"seed={SEED}")
    settings = RealChaosSettings(nodes=4, fault_max=3.0)
    chaos = _Orchestrator(SEED, settings, tmp_path, random.Random(SEED))
    chaos.proxies = {
        (i, j): FaultProxy(f"node-{i}->node-{j}", Address("127.0.0.1", 7355 + j))
        for i in chaos.nodes
        for j in chaos.nodes
        if i != j
    }

    def faulty() -> set[tuple[int, int]]:
        return {pair for pair, proxy in chaos.proxies.items() if proxy.delay or proxy.reset_chance}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chaos.inject, kind, chaos.nodes)
        await trio.sleep(1.0)
        [fault] = chaos.faults
        match = re.fullmatch(r"\d+\.\d " + line, fault)
        assert match, fault
        node, amount = int(match[1]), int(match[2])
        assert faulty() == {(i, j) for i, j in chaos.proxies if node in (i, j)}
        assert low <= amount <= high
    assert faulty() == set()
    report = RealChaosReport(SEED, settings, (), (fault,), 0, 0, 0, 0, 0.0, None, tmp_path, ())
    assert report.fault_counts() == {kind: 1}


def test_the_replay_command_names_what_differs_from_its_base() -> None:
    def replay(settings: RealChaosSettings) -> str:
        report = RealChaosReport(1, settings, (), (), 0, 0, 0, 0, 0.0, None, Path("."), ())
        return report.replay_command()

    assert replay(RealChaosSettings()) == "p2pshard chaos --real --seed 1"
    quick = RealChaosSettings.quick()
    assert replay(quick) == "p2pshard chaos --real --quick --seed 1"
    changed = RealChaosSettings(nodes=4, duration=9, faults=("kill",), use_lease=False)
    assert replay(changed) == (
        "p2pshard chaos --real --seed 1 --nodes 4 --duration 9 --quiet 30 --faults kill --no-lease"
    )
