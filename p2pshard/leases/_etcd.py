"""Leases in etcd: the backend for a cluster whose nodes run on several hosts.

Theory of operation. A lease name is the etcd key ``<prefix><name>``; its value is the owner. A
grant is that key attached to an etcd *lease* (etcd's word for a time-to-live that keys share),
so etcd deletes the key by itself when the holder stops renewing. The fencing token is the key's
``create_revision``: etcd's revision counts every change of the whole store and never goes back,
so each new creation of the key gets a larger number than any before, across releases, expiries
and restarts of etcd (it is kept in etcd's write-ahead log), and no counter of our own is needed.

- :meth:`~EtcdLeaseBackend.try_acquire` grants an etcd lease of ``ceil(ttl)`` seconds (etcd
  counts whole seconds, and may raise a TTL to its minimum; both only lengthen it, so etcd still
  counts at least ``ttl`` from no earlier than the call began), then runs one transaction: if
  the key does not exist (``create_revision == 0``), put it with that lease; otherwise read it.
  A put's token is the transaction's revision. When the key is there and its value is ``owner``
  itself (an earlier grant this owner lost track of, say before a restart), it is deleted by a
  transaction guarded on its ``mod_revision`` and the create is tried once more, so the owner
  gets a new, larger token. Otherwise the etcd lease just granted is revoked and the answer is
  None.
- :meth:`~EtcdLeaseBackend.renew` sends a keep-alive for the grant's etcd lease, then reads the
  key: the grant is still held if the etcd lease had time left and the key still has the grant's
  ``create_revision``, owner and lease. The etcd lease ID of each grant is remembered in this
  object, so a grant made by another process (or before a restart) cannot be renewed here.
- :meth:`~EtcdLeaseBackend.release` deletes the key in a transaction guarded on the token and the
  owner, then revokes the grant's etcd lease.

Node leases (see ``p2pshard.leases._node_lease``): a node lease is one etcd lease of the node;
:meth:`~EtcdLeaseBackend.try_acquire_attached` runs the same create-if-absent transaction with
the key put on that etcd lease instead of one of its own, so the token is again the key's
``create_revision``; one keep-alive of the etcd lease keeps every key on it, and revoking it
deletes them all at once. A key whose etcd lease is gone cannot be put (etcd answers "requested
lease not found"), which :class:`~p2pshard.NodeLeaseGone` reports. A renewal
of the node lease is a keep-alive only: the keys on it are not read back, since only their owner
deletes them (a release, or a new grant to the same owner, which that owner's node lease knows).

This mirrors Akka's ``akka-lease-kubernetes`` (a compare-and-swap on a resource version), with
the expiry kept by the server instead of a timestamp written by the holder. etcd measures time on
its leader's monotonic clock and, when a new leader is elected, gives every etcd lease its whole
TTL again; either way a grant only lasts longer in etcd than the holder believes, which is the
safe direction (others wait a little longer).

The backend speaks etcd's v3 JSON gateway (``POST /v3/...``, etcd 3.4 or newer): to an
``http://`` endpoint over kept-alive HTTP/1.1 connections of its own (``_etcd_http``: h11 on a
trio socket, about a quarter of the CPU per request that httpx takes, and a shard's first message
waits for one request), to an ``https://`` endpoint through httpx. In that JSON, keys and values
are base64, 64-bit integers are strings, and a field whose value is zero, false or empty is left
out. Endpoints are tried in order when one cannot be connected to (the request was then never
sent, so trying it elsewhere is safe); at most ``MAX_IN_FLIGHT`` requests are in flight at once;
the one that answered is tried first next time. Any other failure (a timeout, an error status, an
answer that does not parse) raises :class:`LeaseUnavailable` naming the endpoint, the operation
and the lease, since whether the request took effect is unknown: a request that timed out may
still be carried out later (a paused etcd reads it from its socket when it resumes). An acquire
that gave up that way may thus still create the key; nobody renews that grant, so it expires
after ``ttl``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import httpx
import trio

from membership import ConfigurationError

from .._errors import LeaseUnavailable, NodeLeaseGone
from ._etcd_http import (
    Channel,
    ChannelConnectError,
    ChannelError,
    ChannelTimeout,
    HttpxChannel,
    PlainChannel,
)

logger = logging.getLogger("p2pshard.lease")

_T = TypeVar("_T")
_Json = dict[str, Any]

_GRPC_NOT_FOUND = 5
"""The gRPC status code etcd gives for a lease that does not exist (any more)."""

MAX_IN_FLIGHT = 8
"""Requests one backend has in flight at most; the rest wait their turn. Without a cap, a node
renewing a thousand shard leases at once swamps httpx's connection pool (whose bookkeeping grows
with the queue, encode/httpcore#1035) and gets almost no renewal through; cancelled requests also
leak pool slots there (encode/httpcore#1093), and the cap bounds that too. Over the backend's own
connections to an ``http://`` endpoint, it also bounds how many are open at once."""

_MAX_TTL = 9_000_000_000
"""The largest TTL etcd grants, in seconds (its ``MaxLeaseTTL``)."""


class _BadAnswer(Exception):
    """An error status, or an answer without the shape etcd's gateway gives; the text says which."""


@attrs.frozen
class _Grant:
    """The etcd lease behind one grant, and the TTL etcd gave it."""

    lease_id: int
    ttl: int


@attrs.frozen
class _Kv:
    """A lease key as etcd returned it."""

    owner: str
    create_revision: int
    mod_revision: int
    lease_id: int


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode("ascii")


def _field(obj: _Json, name: str, kind: type[_T], default: _T) -> _T:
    value = obj.get(name, default)
    if not isinstance(value, kind):
        raise _BadAnswer(f"field {name!r} is {value!r}, not a {kind.__name__}")
    return value


def _int(obj: _Json, name: str) -> int:
    """An int64 field: a decimal string in etcd's JSON, absent when zero."""
    value = obj.get(name, "0")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _BadAnswer(f"field {name!r} is {value!r}, not an integer")


def _revision(answer: _Json) -> int:
    if "header" not in answer:
        raise _BadAnswer("the answer has no header")
    revision = _int(_field(answer, "header", dict, {}), "revision")
    if revision <= 0:
        raise _BadAnswer(f"the header's revision is {revision}, not positive")
    return revision


def _kvs(answer: _Json, name: str = "kvs") -> list[_Kv]:
    kvs = []
    for kv in _field(answer, name, list, []):
        if not isinstance(kv, dict):
            raise _BadAnswer(f"an entry of {name!r} is {kv!r}, not an object")
        try:
            owner = base64.b64decode(_field(kv, "value", str, ""), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise _BadAnswer(
                f"the value {kv.get('value')!r} is not base64 of UTF-8: {exc}"
            ) from None
        kvs.append(
            _Kv(owner, _int(kv, "create_revision"), _int(kv, "mod_revision"), _int(kv, "lease"))
        )
    return kvs


def _first_response(answer: _Json, kind: str) -> _Json:
    responses = _field(answer, "responses", list, [])
    if not responses or not isinstance(responses[0], dict) or kind not in responses[0]:
        raise _BadAnswer(f"the transaction answered {responses!r}, not a {kind}")
    return _field(responses[0], kind, dict, {})


def _succeeded(answer: _Json) -> bool:
    _revision(answer)
    return _field(answer, "succeeded", bool, False)


class EtcdLeaseBackend:
    """Leases in an etcd cluster (3.4 or newer) reached at ``endpoints``, through its JSON gateway.

    Args:
        endpoints: client URLs such as ``http://10.0.0.5:2379``, tried in order when one cannot
            be connected to.
        prefix: put before each lease name to make its key (default ``"p2pshard/leases/"``).
        request_timeout: seconds each request may take to connect, send or receive before it
            fails with :class:`LeaseUnavailable` (default 5).
        transport: an httpx transport to use instead of the network for every endpoint (tests
            use ``httpx.MockTransport``).

    Raises:
        ConfigurationError: no endpoints, an endpoint that is not an http(s) URL, or a timeout
            that is not positive.

    Example:
        >>> async def main() -> None:
        ...     backend = EtcdLeaseBackend(["http://127.0.0.1:2379"])
        ...     try:
        ...         token = await backend.try_acquire("nightly-report", "node-1", ttl=15)
        ...         if token is not None:
        ...             await backend.release("nightly-report", "node-1", token)
        ...     finally:
        ...         await backend.aclose()
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        prefix: str = "p2pshard/leases/",
        request_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ConfigurationError(
                f"etcd endpoints {endpoints!r} are invalid: must be a non-empty list of client "
                "URLs such as 'http://127.0.0.1:2379'"
            )
        for url in endpoints:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ConfigurationError(
                    f"etcd endpoint {url!r} is invalid: must be an http:// or https:// URL such "
                    "as 'http://127.0.0.1:2379'"
                )
        if not isinstance(prefix, str):
            raise ConfigurationError(f"etcd key prefix {prefix!r} is invalid: must be a string")
        if not (isinstance(request_timeout, int | float) and 0 < request_timeout < math.inf):
            raise ConfigurationError(
                f"etcd request_timeout {request_timeout!r} is invalid: must be positive seconds"
            )
        self.endpoints = tuple(url.rstrip("/") for url in endpoints)
        self.prefix = prefix
        self.request_timeout = float(request_timeout)
        self._client: httpx.AsyncClient | None = None
        self._channels: list[Channel] = []
        for url in self.endpoints:
            if transport is None and url.startswith("http://"):
                self._channels.append(
                    PlainChannel(url, timeout=self.request_timeout, limit=MAX_IN_FLIGHT)
                )
                continue
            if self._client is None:
                # trust_env=False: proxy variables meant for the web must not reroute lease
                # traffic.
                self._client = httpx.AsyncClient(
                    timeout=self.request_timeout,
                    transport=transport,
                    trust_env=False,
                    limits=httpx.Limits(
                        max_connections=MAX_IN_FLIGHT, max_keepalive_connections=MAX_IN_FLIGHT
                    ),
                )
            self._channels.append(HttpxChannel(self._client, url))
        self.requests: dict[str, int] = {}
        """Requests made so far, by path (``/v3/kv/txn``, ...); each endpoint tried counts."""
        self._in_flight = trio.Semaphore(MAX_IN_FLIGHT)
        self._preferred = 0
        self._grants: dict[tuple[str, str, int], _Grant] = {}
        self._node_leases: dict[tuple[str, int], _Grant] = {}
        self._closed = False

    async def try_acquire(self, name: str, owner: str, ttl: float) -> int | None:
        """See :meth:`p2pshard.LeaseBackend.try_acquire`.

        Raises:
            ValueError: ``ttl`` is not positive or longer than etcd allows (9e9 s).
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        if not 0 < ttl <= _MAX_TTL:
            raise ValueError(f"lease ttl {ttl!r} is invalid: must be in (0, {_MAX_TTL}] seconds")
        what = f"acquire of lease {name!r}"
        key = _b64(self.prefix + name)
        asked = math.ceil(ttl)
        granted = functools.partial(_granted, asked)

        def created(answer: _Json) -> int | _Kv:
            if _succeeded(answer):
                return _revision(answer)
            kvs = _kvs(_first_response(answer, "response_range"))
            if not kvs:
                raise _BadAnswer("the key exists but reading it found nothing")
            return kvs[0]

        grant = await self._post("/v3/lease/grant", {"TTL": str(asked)}, what, granted)
        create = {
            "compare": [
                {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            ],
            "success": [
                {"request_put": {"key": key, "value": _b64(owner), "lease": str(grant.lease_id)}}
            ],
            "failure": [{"request_range": {"key": key}}],
        }
        for attempt in (1, 2):
            outcome = await self._post("/v3/kv/txn", create, what, created)
            if isinstance(outcome, int):
                self._forget_older(name, outcome)
                self._grants[(name, owner, outcome)] = grant
                return outcome
            if outcome.owner != owner or attempt == 2:
                break
            # Our own earlier grant: delete it unless it changed meanwhile, then create again.
            await self._delete_own_grant(name, owner, key, outcome, what)
        await self._revoke(grant.lease_id, what)
        return None

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> bool:
        """See :meth:`p2pshard.LeaseBackend.renew`.

        etcd cannot change the TTL of an etcd lease: a renewal extends the grant by the TTL
        etcd gave it at the acquire, which is at least the ``ttl`` asked for then.

        Raises:
            ValueError: ``ttl`` is longer than the TTL of the grant's etcd lease.
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        grant = self._grants.get((name, owner, token))
        if grant is None:  # not granted through this object, or already given up
            return False
        if ttl > grant.ttl:
            raise ValueError(
                f"lease {name!r}: cannot renew for ttl {ttl!r} s, longer than the {grant.ttl} s "
                "its etcd lease was granted with; etcd cannot change a lease's TTL"
            )
        what = f"renewal of lease {name!r}"

        keepalive = {"ID": str(grant.lease_id)}
        if await self._post("/v3/lease/keepalive", keepalive, what, _time_left) > 0:
            kvs = await self._post("/v3/kv/range", {"key": _b64(self.prefix + name)}, what, _read)
            if kvs and (kvs[0].create_revision, kvs[0].owner, kvs[0].lease_id) == (
                token,
                owner,
                grant.lease_id,
            ):
                return True
        self._grants.pop((name, owner, token), None)  # expired, deleted or taken over
        return False

    async def release(self, name: str, owner: str, token: int) -> bool:
        """See :meth:`p2pshard.LeaseBackend.release`.

        Raises:
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        what = f"release of lease {name!r}"
        key = _b64(self.prefix + name)

        def deleted(answer: _Json) -> _Kv | None:
            if not _succeeded(answer):
                return None
            kvs = _kvs(_first_response(answer, "response_delete_range"), "prev_kvs")
            if not kvs:
                raise _BadAnswer("the guarded delete succeeded but deleted nothing")
            return kvs[0]

        release = {
            "compare": [
                {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": str(token)},
                {"key": key, "target": "VALUE", "result": "EQUAL", "value": _b64(owner)},
            ],
            "success": [{"request_delete_range": {"key": key, "prev_kv": True}}],
        }
        kv = await self._post("/v3/kv/txn", release, what, deleted)
        # Even when the key was not deleted, this owner's etcd lease for the grant carries no
        # other key (each grant has its own), so revoking it cannot end anyone else's grant; a
        # node lease carries others, and is left alone.
        grant = self._grants.pop((name, owner, token), None)
        lease_id = grant.lease_id if grant is not None else kv.lease_id if kv is not None else 0
        if lease_id and (owner, lease_id) not in self._node_leases:
            await self._revoke(lease_id, what)
        return kv is not None

    async def grant_node_lease(self, owner: str, ttl: float) -> int:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.grant_node_lease`.

        Raises:
            ValueError: ``ttl`` is not positive or longer than etcd allows (9e9 s).
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        if not 0 < ttl <= _MAX_TTL:
            raise ValueError(f"lease ttl {ttl!r} is invalid: must be in (0, {_MAX_TTL}] seconds")
        asked = math.ceil(ttl)
        granted = functools.partial(_granted, asked)

        what = f"grant of the node lease of {owner!r}"
        grant = await self._post("/v3/lease/grant", {"TTL": str(asked)}, what, granted)
        self._node_leases[(owner, grant.lease_id)] = grant
        return grant.lease_id

    async def keep_node_lease(self, owner: str, lease_id: int, ttl: float) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.keep_node_lease`.

        Raises:
            ValueError: ``ttl`` is longer than the TTL the etcd lease was granted with.
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        grant = self._node_leases.get((owner, lease_id))
        if grant is None:  # not granted through this object, or already ended
            return False
        if ttl > grant.ttl:
            raise ValueError(
                f"node lease {lease_id}: cannot renew for ttl {ttl!r} s, longer than the "
                f"{grant.ttl} s it was granted with; etcd cannot change a lease's TTL"
            )
        what = f"renewal of the node lease of {owner!r}"
        if await self._post("/v3/lease/keepalive", {"ID": str(lease_id)}, what, _time_left) > 0:
            return True
        del self._node_leases[(owner, lease_id)]
        return False

    async def revoke_node_lease(self, owner: str, lease_id: int) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.revoke_node_lease`.

        Raises:
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        what = f"revoke of the node lease of {owner!r}"
        answer = await self._post(
            "/v3/lease/revoke", {"ID": str(lease_id)}, what, _gone_or_revoked, gone_ok=True
        )
        self._node_leases.pop((owner, lease_id), None)
        return answer

    async def try_acquire_attached(self, name: str, owner: str, lease_id: int) -> int | None:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.try_acquire_attached`.

        Raises:
            NodeLeaseGone: the etcd lease ``lease_id`` does not exist (any more).
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        what = f"acquire of lease {name!r}"
        key = _b64(self.prefix + name)

        def created(answer: _Json) -> int | _Kv | None:
            if not answer:  # the etcd lease is gone
                return None
            if _succeeded(answer):
                return _revision(answer)
            kvs = _kvs(_first_response(answer, "response_range"))
            if not kvs:
                raise _BadAnswer("the key exists but reading it found nothing")
            return kvs[0]

        create = {
            "compare": [
                {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            ],
            "success": [
                {"request_put": {"key": key, "value": _b64(owner), "lease": str(lease_id)}}
            ],
            "failure": [{"request_range": {"key": key}}],
        }
        for attempt in (1, 2):
            outcome = await self._post("/v3/kv/txn", create, what, created, gone_ok=True)
            if outcome is None:
                self._node_leases.pop((owner, lease_id), None)
                raise NodeLeaseGone(f"etcd: {what} failed: node lease {lease_id} has ended")
            if isinstance(outcome, int):
                self._forget_older(name, outcome)
                return outcome
            if outcome.owner != owner or attempt == 2:
                return None
            # This owner's own earlier grant (a shard it took again, or one of a node lease it
            # gave up): delete it unless it changed meanwhile, then create again.
            await self._delete_own_grant(name, owner, key, outcome, what)
        return None  # pragma: no cover - the loop returns

    async def release_attached(self, name: str, owner: str, lease_id: int, token: int) -> bool:
        """See :meth:`~p2pshard.leases._node_lease.NodeLeaseBackend.release_attached`.

        Raises:
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        what = f"release of lease {name!r}"
        key = _b64(self.prefix + name)
        release = {
            "compare": [
                {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": str(token)},
                {"key": key, "target": "VALUE", "result": "EQUAL", "value": _b64(owner)},
                {"key": key, "target": "LEASE", "result": "EQUAL", "lease": str(lease_id)},
            ],
            "success": [{"request_delete_range": {"key": key}}],
        }
        return await self._post("/v3/kv/txn", release, what, _succeeded)

    async def holder(self, name: str) -> tuple[str, int] | None:
        """See :meth:`p2pshard.LeaseBackend.holder`.

        Raises:
            LeaseUnavailable: etcd could not be reached or answered with an error.
        """
        what = f"read of lease {name!r}"
        kvs = await self._post("/v3/kv/range", {"key": _b64(self.prefix + name)}, what, _read)
        return (kvs[0].owner, kvs[0].create_revision) if kvs else None

    async def aclose(self) -> None:
        """Close the connections; grants stay in etcd until their etcd leases expire."""
        self._closed = True
        for channel in self._channels:
            await channel.aclose()
        if self._client is not None:
            await self._client.aclose()

    def _forget_older(self, name: str, token: int) -> None:
        """A new grant of ``name`` ends every older one this object still remembers."""
        for stale in [k for k in self._grants if k[0] == name and k[2] < token]:
            del self._grants[stale]

    async def _delete_own_grant(
        self, name: str, owner: str, key: str, current: _Kv, what: str
    ) -> None:
        """Delete ``key``, this owner's earlier grant, unless it changed since ``current``."""
        delete = {
            "compare": [
                {
                    "key": key,
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(current.mod_revision),
                }
            ],
            "success": [{"request_delete_range": {"key": key}}],
        }
        await self._post("/v3/kv/txn", delete, what, _succeeded)
        self._grants.pop((name, owner, current.create_revision), None)

    async def _revoke(self, lease_id: int, what: str) -> None:
        """Revoke an etcd lease that holds no grant any more, if etcd answers.

        The outcome of the operation is known by then, so a failure is only logged: the etcd
        lease expires by itself.
        """
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease_id)}, what, _ignore, gone_ok=True)
        except LeaseUnavailable as exc:
            logger.warning("etcd lease %d is left to expire: %s", lease_id, exc)

    async def _post(
        self,
        path: str,
        body: _Json,
        what: str,
        parse: Callable[[_Json], _T],
        *,
        gone_ok: bool = False,
    ) -> _T:
        """POST ``body`` to ``path`` and parse the answer, trying endpoints that do not connect.

        ``gone_ok``: an etcd lease that does not exist any more is not an error (a revoke).
        """
        if self._closed:
            raise LeaseUnavailable(f"etcd: {what} failed: the lease backend is closed")
        failures = []
        count = len(self.endpoints)
        for step in range(count):
            index = (self._preferred + step) % count
            url = self.endpoints[index] + path
            try:
                async with self._in_flight:
                    self.requests[path] = self.requests.get(path, 0) + 1
                    status, content = await self._channels[index].post(path, body)
            except ChannelConnectError as exc:
                failures.append(f"{self.endpoints[index]}: {exc}")
                continue
            except ChannelTimeout as exc:
                raise LeaseUnavailable(
                    f"etcd {url}: {what} failed: no answer within request_timeout "
                    f"({self.request_timeout:g} s); whether it took effect is unknown"
                ) from exc
            except ChannelError as exc:
                raise LeaseUnavailable(
                    f"etcd {url}: {what} failed: {exc}; whether it took effect is unknown"
                ) from exc
            self._preferred = index
            try:
                return parse(_answer(status, content, gone_ok))
            except _BadAnswer as exc:
                raise LeaseUnavailable(f"etcd {url}: {what} failed: {exc}") from None
        raise LeaseUnavailable(
            f"etcd: {what} failed: could not connect to any endpoint ({'; '.join(failures)})"
        )


def _granted(asked: int, answer: _Json) -> _Grant:
    """The lease etcd granted, checked: an id, and at least the ``asked`` TTL in seconds."""
    _revision(answer)
    grant = _Grant(_int(answer, "ID"), _int(answer, "TTL"))
    if grant.lease_id == 0 or grant.ttl < asked:
        raise _BadAnswer(f"granted {grant}, asked for a TTL of {asked} s")
    return grant


def _read(answer: _Json) -> list[_Kv]:
    _revision(answer)
    return _kvs(answer)


def _ignore(answer: _Json) -> None:
    return None


def _gone_or_revoked(answer: _Json) -> bool:
    """A revoke's answer: True if it revoked, False if the etcd lease was gone already."""
    if not answer:
        return False
    _revision(answer)
    return True


def _time_left(answer: _Json) -> int:
    """A keep-alive's answer: the TTL left (0 when the etcd lease is gone)."""
    # The gateway streams keep-alives: each answer is wrapped in "result".
    result = _field(answer, "result", dict, {})
    _revision(result)
    return _int(result, "TTL")


def _answer(status: int, content: bytes, gone_ok: bool) -> _Json:
    """The JSON object of an answer, or :class:`_BadAnswer` saying what is wrong with it.

    ``gone_ok``: an error saying that the etcd lease does not exist gives ``{}``.
    """
    try:
        answer = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        answer = None
    text = content[:200].decode(errors="replace")
    if status != 200:
        if isinstance(answer, dict):
            if gone_ok and answer.get("code") == _GRPC_NOT_FOUND:
                return {}
            message = answer.get("message", answer.get("error", answer))
        else:
            message = text
        raise _BadAnswer(f"HTTP {status}: {message}")
    if not isinstance(answer, dict):
        raise _BadAnswer(f"the answer is not a JSON object: {text!r}")
    if "error" in answer:  # a streamed call (keep-alive) reports its failure with status 200
        error = answer["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise _BadAnswer(f"etcd reported an error: {message}")
    return answer
