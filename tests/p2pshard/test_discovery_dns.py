"""The bootstrap shell's DNS lookups against a real DNS server: Debian's ``dnsmasq`` on 127.0.0.1.

Each test starts its own dnsmasq at a free port of 127.0.0.1 (UDP and TCP), with its own
configuration only (``--conf-file=/dev/null``, ``--no-resolv``, ``--no-hosts``): the records come
from ``--host-record`` and ``--srv-host`` options and from a hosts file in the test's directory,
and ``--local=/p2pshard.test/`` makes a name of that domain that it does not know not exist
(NXDOMAIN). The tests ask it through :func:`p2pshard._discovery.dns_lookup` with ``nameservers =
["127.0.0.1:PORT"]``, as a node does. No namespaces and no root are needed; the tests skip when
``dnsmasq`` is missing (``scripts/test.sh`` installs Debian's ``dnsmasq-base`` as root).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import dns.exception
import dns.message
import dns.query
import dns.rdatatype
import pytest
import trio

from membership import Address
from p2pshard import DiscoverySettings, _discovery
from p2pshard._discovery import LookupFailed, dns_lookup

DOMAIN = "p2pshard.test"
READY = f"ready.{DOMAIN}"
"""A name dnsmasq answers as soon as it runs: the tests wait for it."""

SERVICE = f"_cluster._tcp.{DOMAIN}"
MANY = 200
"""How many A records ``many.p2pshard.test`` has (each listed twice in the hosts file), and how
many SRV records ``_many._tcp.p2pshard.test`` has (each its own target)."""

RECORDS = [
    f"--host-record={READY},127.0.0.1",
    f"--host-record=node-a.{DOMAIN},127.0.0.11",
    # An IPv6 address spelled long: DNS carries it as 16 bytes, the lookup gives it short.
    f"--host-record=node-b.{DOMAIN},127.0.0.12,fd00:0:0:0:0:0:0:12",
    f"--srv-host={SERVICE},node-a.{DOMAIN},25521",
    f"--srv-host={SERVICE},node-b.{DOMAIN},25522",
    # node-b again on the same port at another priority: one contact point, not two.
    f"--srv-host={SERVICE},node-b.{DOMAIN},25522,1",
    # Two nodes on one host: the same target at two ports is two contact points.
    f"--srv-host={SERVICE},node-a.{DOMAIN},25524",
    # A target behind a CNAME: dnsmasq sends no address along, so the lookup asks for it.
    f"--host-record=node-c.{DOMAIN},127.0.0.13",
    f"--cname=alias.{DOMAIN},node-c.{DOMAIN}",
    f"--srv-host={SERVICE},alias.{DOMAIN},25525",
    # A target that does not exist (a pod that is gone): skipped, with a log line.
    f"--srv-host={SERVICE},ghost.{DOMAIN},25523",
    # Port 0 is no port a node listens on: skipped, with a log line.
    f"--srv-host={SERVICE},node-b.{DOMAIN},0",
    # No target: the record's target is ".", "the service is not available at this domain".
    f"--srv-host=_closed._tcp.{DOMAIN}",
    f"--srv-host=_only-ghosts._tcp.{DOMAIN},ghost.{DOMAIN},25520",
    *(f"--srv-host=_many._tcp.{DOMAIN},srv-{i}.{DOMAIN},{25520 + i}" for i in range(MANY)),
]

HOSTS = "".join(
    [
        f"127.0.0.21 nodes.{DOMAIN}\n",
        f"127.0.0.22 nodes.{DOMAIN}\n",
        f"fd00:0:0::23 nodes.{DOMAIN}\n",
        # 127.0.0.21 again, as an IPv4-mapped IPv6 address: the same contact point.
        f"::ffff:127.0.0.21 nodes.{DOMAIN}\n",
        *[f"127.0.1.{i} many.{DOMAIN}\n" for i in range(MANY)] * 2,
        *(f"127.0.2.{i} srv-{i}.{DOMAIN}\n" for i in range(MANY)),
    ]
)


def _dnsmasq() -> str | None:
    return shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")


@pytest.fixture(autouse=True, scope="module")
def _needs_dnsmasq() -> None:
    if _dnsmasq() is None:
        pytest.skip(
            "the DNS lookup tests need dnsmasq: install Debian's dnsmasq-base "
            "(scripts/test.sh does, as root)"
        )


def _free_port() -> int:
    """A port of 127.0.0.1 free for both UDP and TCP (dnsmasq listens on both)."""
    for _ in range(100):
        with (
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp,
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        ):
            tcp.bind(("127.0.0.1", 0))
            port: int = tcp.getsockname()[1]
            try:
                udp.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no port of 127.0.0.1 is free for both UDP and TCP")


@contextlib.contextmanager
def _running_dnsmasq(directory: Path, port: int, *, wait: bool = True) -> Iterator[Path]:
    """dnsmasq serving :data:`RECORDS` and :data:`HOSTS` on 127.0.0.1:``port``, killed after.

    Yields the file where it logs every question it gets.
    """
    dnsmasq = _dnsmasq()
    assert dnsmasq is not None
    directory.mkdir(parents=True, exist_ok=True)
    hosts = directory / "hosts"
    hosts.write_text(HOSTS)
    stderr_path = directory / "dnsmasq.stderr"
    log = directory / "queries.log"
    with stderr_path.open("wb") as stderr:
        popen = subprocess.Popen(
            [
                dnsmasq,
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                f"--addn-hosts={hosts}",
                f"--local=/{DOMAIN}/",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                f"--port={port}",
                f"--pid-file={directory / 'dnsmasq.pid'}",
                # Stay this user: as root dnsmasq would become "nobody", who cannot read the
                # hosts file in the test's private directory.
                f"--user={pwd.getpwuid(os.geteuid()).pw_name}",
                "--local-ttl=0",
                "--log-queries",
                f"--log-facility={log}",
                *RECORDS,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        if wait:
            _wait_until_it_answers(port, popen, stderr_path)
        yield log
    finally:
        popen.kill()
        popen.wait()


def _wait_until_it_answers(port: int, popen: subprocess.Popen[bytes], stderr: Path) -> None:
    query = dns.message.make_query(READY, dns.rdatatype.A)
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(dns.exception.Timeout, OSError):
            dns.query.udp(query, "127.0.0.1", port=port, timeout=0.05)
            return
        if popen.poll() is not None:
            raise AssertionError(f"dnsmasq exited ({popen.returncode}): {stderr.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"dnsmasq does not answer on 127.0.0.1:{port}")
        time.sleep(0.05)


class Server(NamedTuple):
    """A running dnsmasq: its port on 127.0.0.1, and the log of the questions it got."""

    port: int
    log: Path


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One dnsmasq for the tests that only ask it (they change nothing in it)."""
    port = _free_port()
    with _running_dnsmasq(tmp_path_factory.mktemp("dns"), port) as log:
        yield Server(port, log)


def _settings(name: str, port: int, **kwargs: object) -> DiscoverySettings:
    return DiscoverySettings(
        method="dns",
        service_name=name,
        nameservers=(f"127.0.0.1:{port}",),
        **kwargs,  # type: ignore[arg-type]
    )


def _skipped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]


async def test_a_records_give_the_addresses_at_the_contact_port(dns_server: Server) -> None:
    lookup = dns_lookup(_settings(f"nodes.{DOMAIN}", dns_server.port, contact_port=25530), 25520)
    assert await lookup() == {
        Address("127.0.0.21", 25530),
        Address("127.0.0.22", 25530),
        Address("fd00::23", 25530),
    }
    # contact_port = 0: the port the node gives (its own).
    lookup = dns_lookup(_settings(f"nodes.{DOMAIN}", dns_server.port), 25520)
    assert {a.port for a in await lookup()} == {25520}


async def test_srv_records_give_each_target_s_addresses_at_the_record_s_port(
    dns_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    lookup = dns_lookup(_settings(SERVICE, dns_server.port, lookup="srv"), 25520)
    with caplog.at_level(logging.INFO, logger="p2pshard.discovery"):
        for _ in range(3):
            assert await lookup() == {
                Address("127.0.0.11", 25521),
                Address("127.0.0.11", 25524),
                Address("127.0.0.12", 25522),
                Address("fd00::12", 25522),
                Address("127.0.0.13", 25525),
            }
    # The target that does not exist and the record at port 0 are skipped, each said once
    # (not every round), naming the record.
    skipped = _skipped(caplog)
    assert len(skipped) == 2, skipped
    assert any(f"ghost.{DOMAIN}:25523" in line for line in skipped), skipped
    assert any(f"node-b.{DOMAIN}:0" in line for line in skipped), skipped


async def test_srv_records_that_all_lead_nowhere_give_no_contact_points(
    dns_server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="p2pshard.discovery"):
        closed = dns_lookup(
            _settings(f"_closed._tcp.{DOMAIN}", dns_server.port, lookup="srv"), 25520
        )
        assert await closed() == frozenset()
        ghosts = dns_lookup(
            _settings(f"_only-ghosts._tcp.{DOMAIN}", dns_server.port, lookup="srv"), 1
        )
        assert await ghosts() == frozenset()
    skipped = _skipped(caplog)
    assert len(skipped) == 2, skipped
    assert "not available" in skipped[0]
    assert f"ghost.{DOMAIN}" in skipped[1]


@pytest.mark.parametrize("lookup", ["a", "srv"])
async def test_a_name_that_does_not_exist_gives_no_contact_points(
    dns_server: Server, lookup: str
) -> None:
    found = dns_lookup(_settings(f"_gone._tcp.{DOMAIN}", dns_server.port, lookup=lookup), 25520)
    assert await found() == frozenset()


async def test_many_a_records_are_all_found_once_each(dns_server: Server) -> None:
    # 200 A records do not fit a 512-byte UDP answer: the resolver asks again over TCP.
    lookup = dns_lookup(_settings(f"many.{DOMAIN}", dns_server.port), 25520)
    found = await lookup()
    assert found == {Address(f"127.0.1.{i}", 25520) for i in range(MANY)}


async def test_many_srv_records_are_all_found(dns_server: Server) -> None:
    lookup = dns_lookup(_settings(f"_many._tcp.{DOMAIN}", dns_server.port, lookup="srv"), 25520)
    found = await lookup()
    assert found == {Address(f"127.0.2.{i}", 25520 + i) for i in range(MANY)}
    # The targets' addresses came with the SRV records: not one question about a target.
    asked = [line for line in dns_server.log.read_text().splitlines() if "query[" in line]
    assert any(f"_many._tcp.{DOMAIN}" in line for line in asked), asked
    assert not [line for line in asked if "srv-" in line], asked


@pytest.mark.parametrize("lookup", ["a", "srv"])
async def test_a_server_that_does_not_answer_is_logged_once_and_its_return_too(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    lookup: str,
) -> None:
    # Nothing listens on the port yet: the questions go unanswered (UDP has no refusal).
    monkeypatch.setattr(_discovery, "LOOKUP_LIFETIME", 0.1)
    port = _free_port()
    name = SERVICE if lookup == "srv" else f"node-a.{DOMAIN}"
    look = dns_lookup(_settings(name, port, lookup=lookup), 25521)
    calls = 0
    two_failed = trio.Event()

    async def counted() -> frozenset[Address]:
        nonlocal calls
        calls += 1
        if calls > 2:
            two_failed.set()
        return await look()

    send, receive = trio.open_memory_channel[frozenset[Address] | tuple[Address, bool]](10)
    with caplog.at_level(logging.INFO, logger="p2pshard.discovery"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_discovery._look_up_forever, counted, 0.01, send)
            with trio.fail_after(30):
                await two_failed.wait()
            failed = [r for r in caplog.records if "lookup failed" in r.getMessage()]
            assert len(failed) == 1, [r.getMessage() for r in failed]
            assert failed[0].levelno == logging.WARNING
            assert f"127.0.0.1:{port}" in failed[0].getMessage()
            with _running_dnsmasq(tmp_path / "dns", port, wait=False):
                with trio.fail_after(30):
                    found = await receive.receive()
                assert isinstance(found, frozenset)
                assert Address("127.0.0.11", 25521) in found
                with trio.fail_after(30):
                    await receive.receive()  # and once more: the next round answers too
            nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "lookup failed" in m]) == 1, messages
    assert len([m for m in messages if "answers again" in m]) == 1, messages
    # What the log said: no answer, not the seconds the resolver happened to wait.
    with pytest.raises(LookupFailed, match=r"no answer within 0\.1 s"):
        await look()
