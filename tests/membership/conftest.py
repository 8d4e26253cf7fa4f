"""Fixtures shared by the membership tests: cluster certificates and transport harnesses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio

from membership import (
    Address,
    IdentityKind,
    PeerIdentity,
    SimNetwork,
    Transport,
    TransportSettings,
    message,
)
from membership.transport._certs import create_certificate, create_cluster_ca, identity_file_names
from membership.transport._tcp import open_tcp_transport
from membership.transport._tls import TlsIdentity

CLUSTER = "conformance"


@message(name="tests.Seq")
@attrs.frozen
class Seq:
    """A numbered test message with an optional payload."""

    n: int
    data: bytes = b""


@attrs.frozen
class CertSet:
    """A cluster CA directory and a way to make node identities from it."""

    root: Path
    cluster: str

    def identity(
        self, node: str, *, cluster: str | None = None, kind: IdentityKind = IdentityKind.NODE
    ) -> TlsIdentity:
        """Credentials for ``node`` (of identity ``kind``); made on first use, signed by this CA."""
        out = self.root / f"{cluster or self.cluster}-{kind.value}-{node}"
        cert_name, key_name = identity_file_names(kind)
        if not (out / cert_name).exists():
            identity = PeerIdentity(kind, node)
            create_certificate(identity, self.root / "ca", out, cluster=cluster)
        return TlsIdentity(self.cluster, out / "ca.pem", out / cert_name, out / key_name)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    root = tmp_path_factory.mktemp("certs")
    create_cluster_ca(CLUSTER, root / "ca")
    return CertSet(root, CLUSTER)


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    """A second CA that issues certificates for the same cluster name."""
    root = tmp_path_factory.mktemp("other-certs")
    create_cluster_ca(CLUSTER, root / "ca")
    return CertSet(root, CLUSTER)


class Harness:
    """Starts, stops and restarts transports of one implementation, for the conformance kit.

    Each transport lives in a task of the fixture's nursery, so it is opened and closed by the
    same task, as trio requires of anything that owns a nursery.
    """

    kind = ""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._stops: dict[int, tuple[trio.Event, trio.Event]] = {}

    def _open(
        self, name: str, address: Address | None, settings: TransportSettings
    ) -> contextlib.AbstractAsyncContextManager[Transport]:
        raise NotImplementedError

    async def _run(
        self,
        manager: contextlib.AbstractAsyncContextManager[Transport],
        *,
        task_status: trio.TaskStatus[Transport],
    ) -> None:
        stop, stopped = trio.Event(), trio.Event()
        try:
            async with manager as transport:
                self._stops[id(transport)] = (stop, stopped)
                task_status.started(transport)
                await stop.wait()
        finally:
            stopped.set()

    async def start(
        self,
        name: str,
        *,
        address: Address | None = None,
        settings: TransportSettings | None = None,
    ) -> Transport:
        manager = self._open(name, address, settings or TransportSettings())
        transport: Transport = await self._nursery.start(self._run, manager)
        return transport

    async def stop(self, transport: Transport) -> None:
        stop, stopped = self._stops.pop(id(transport))
        stop.set()
        await stopped.wait()


class TcpHarness(Harness):
    kind = "tcp"

    def __init__(self, nursery: trio.Nursery, certs: CertSet) -> None:
        super().__init__(nursery)
        self._certs = certs

    def _open(
        self, name: str, address: Address | None, settings: TransportSettings
    ) -> contextlib.AbstractAsyncContextManager[Transport]:
        return open_tcp_transport(
            self._certs.identity(name),
            name,
            address or Address("127.0.0.1", 0),
            settings=settings,
        )


class SimHarness(Harness):
    kind = "sim"

    def __init__(self, nursery: trio.Nursery) -> None:
        super().__init__(nursery)
        self.network = SimNetwork(seed=1234)
        self._next_port = 7000

    def _open(
        self, name: str, address: Address | None, settings: TransportSettings
    ) -> contextlib.AbstractAsyncContextManager[Transport]:
        if address is None:
            self._next_port += 1
            address = Address("10.0.0.1", self._next_port)
        return self.network.transport(address, name, settings=settings)


@pytest.fixture(params=["tcp", "sim"])
async def harness(request: pytest.FixtureRequest, certs: CertSet) -> AsyncIterator[Harness]:
    async with trio.open_nursery() as nursery:
        if request.param == "tcp":
            yield TcpHarness(nursery, certs)
        else:
            yield SimHarness(nursery)
        nursery.cancel_scope.cancel()
