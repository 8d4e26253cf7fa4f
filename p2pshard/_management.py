"""The management endpoint: health, readiness and cluster state over HTTP, as JSON.

Theory of operation: Akka Management gives operators and orchestrators HTTP routes for a
cluster (``/cluster/members``, ``/cluster/shards/{name}``, leave and down) and health checks
(``/alive``, ``/ready`` with the sharding check: every region registered with its coordinator,
given up on a while after the member is Up so a rolling upgrade cannot stall). This module does
the same for one node, when its ``[management]`` table enables it (:class:`ManagementSettings`).

What a request gets is decided by plain functions that know neither trio nor HTTP: :func:`route`
(path and method to a route, or 404/405), :func:`check_token` (the bearer token),
:func:`parse_operation` (the body of a ``PUT``) and :func:`readiness` (from the member status,
when the node became Up, and whether each region registered). :class:`ManagementApp` is the thin
shell around them: a small ASGI application that reads the request, asks them, reads the node's
state (``StatusService`` builds the same members and shard tables ``p2pshard status`` shows) and
writes the JSON. :func:`serve_management` runs it with hypercorn's trio worker in the node's
nursery; cancelling the nursery closes the listening socket and every connection.

``GET /`` is the live dashboard (``p2pshard._dashboard``): a static page and its files, which
need no token, and ``GET /dashboard/state``, a read route the page polls. The endpoint's
nursery also runs the dashboard's sampler and event log.

Who may do what is :func:`authorize`'s decision, from the bearer token and, with ``tls``, the
identity of the client's certificate (``membership``'s kinds: an ``admin`` may leave and down,
``read_access`` says who may read). hypercorn does not pass the client certificate to the
application (its issue 62: the ASGI TLS extension is not implemented), so with ``tls`` this
module accepts the connections itself and hands each to hypercorn's connection handler with an
application that adds ``scope["extensions"]["tls"]`` (the extension's ``client_cert_chain``,
PEM, the client's certificate first) for that connection; see :func:`serve_management`.

Where it differs from Akka: a member is named by its address ``host:port``, not an actor system
URI; ``down`` of the node that serves the request is refused (400), since a node that downs
itself stops before it can answer: ask another node. Without ``tls``, plain HTTP: bind a private
address.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import attrs
import hypercorn.config
import hypercorn.trio
import trio
from cryptography import x509
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ConnectionState, Scope
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import Metric

from membership import (
    Address,
    Cluster,
    ClusterError,
    ConfigurationError,
    HandshakeError,
    IdentityKind,
    MemberStatus,
    PeerIdentity,
    UniqueAddress,
)
from membership.internal import TlsIdentity, identity_text, peer_identity

from ._config import ManagementSettings
from ._dashboard import SECURITY_HEADERS, Dashboard, asset
from ._status import (
    MEMBER_ACTIONS,
    StatusService,
    carry_out,
    entity_type_json,
    is_member_now,
    member_at,
    no_member_text,
    node_json,
    not_a_member_text,
    reply_json,
)
from .sharding._sharding import Sharding

logger = logging.getLogger("p2pshard.management")

server_logger = logging.getLogger("p2pshard.management.server")
"""hypercorn's own log lines. Its INFO line at start repeats what this module logs (and tells
to press Ctrl-C), so WARNING is the least it logs unless the application sets a level."""
if server_logger.level == logging.NOTSET:
    server_logger.setLevel(logging.WARNING)

READY_STATUSES = frozenset({MemberStatus.UP, MemberStatus.WEAKLY_UP})
"""The member statuses ``/ready`` counts as up (Akka's default ``ready-states``)."""

MAX_BODY = 64 * 1024
"""Bytes a request body may have; a larger one is refused with 413."""

STATS_TIMEOUT = 2.0
"""Seconds ``/cluster/shards/{type}`` waits for other regions' statistics."""

ROUTES = (
    "GET /alive",
    "GET /ready",
    "GET /cluster/members",
    "GET /cluster/members/{address}",
    "PUT /cluster/members/{address}",
    "GET /cluster/shards",
    "GET /cluster/shards/{type}",
    "GET /metrics",
    "GET /",
    "GET /dashboard/state",
    "GET /dashboard/{file}",
)
"""Every route, as the 404 answer lists them."""

RouteName = Literal[
    "alive",
    "ready",
    "members",
    "member",
    "operation",
    "types",
    "shards",
    "metrics",
    "dashboard",
    "dashboard_state",
    "dashboard_file",
]


@attrs.frozen
class Answer:
    """What a request gets: an HTTP status, a JSON body and extra headers.

    ``text`` with its ``content_type`` replaces the JSON body (the metrics' text format).
    """

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()
    text: bytes | None = None
    content_type: str = "application/json"


def refusal(status: int, text: str, *headers: tuple[str, str]) -> Answer:
    """An error answer: ``{"error": text}``."""
    return Answer(status, {"error": text}, headers)


@attrs.frozen
class Route:
    """A matched route and its path argument (an address or a type name; else empty)."""

    name: RouteName
    argument: str = ""


def route(method: str, path: str) -> Route | Answer:
    """The route of a request, or the 404 (no such path) or 405 (not that method) answer.

    Example:
        >>> route("GET", "/cluster/shards/Counter")
        Route(name='shards', argument='Counter')
        >>> route("POST", "/alive").status
        405
    """
    methods: dict[str, RouteName]
    argument = ""
    match path.split("/"):
        case ["", "alive"]:
            methods = {"GET": "alive"}
        case ["", "ready"]:
            methods = {"GET": "ready"}
        case ["", "cluster", "members"]:
            methods = {"GET": "members"}
        case ["", "cluster", "members", address] if address:
            methods, argument = {"GET": "member", "PUT": "operation"}, address
        case ["", "cluster", "shards"]:
            methods = {"GET": "types"}
        case ["", "cluster", "shards", type_name] if type_name:
            methods, argument = {"GET": "shards"}, type_name
        case ["", "metrics"]:
            methods = {"GET": "metrics"}
        case ["", ""]:
            methods = {"GET": "dashboard"}
        case ["", "dashboard", "state"]:
            methods = {"GET": "dashboard_state"}
        case ["", "dashboard", file_name] if file_name:
            methods, argument = {"GET": "dashboard_file"}, file_name
        case _:
            return refusal(404, f"no route {path!r}; the routes are: {', '.join(ROUTES)}")
    name = methods.get(method)
    if name is None:
        allowed = ", ".join(sorted(methods))
        return refusal(405, f"{method} is not allowed on {path}; use {allowed}", ("allow", allowed))
    return Route(name, argument)


_CHALLENGE = ("www-authenticate", 'Bearer realm="p2pshard-management"')


def check_token(
    settings: ManagementSettings, authorization: str | None, *, mutating: bool
) -> Answer | None:
    """None if the request may go on, else the refusal (401, or 403 when no token is set).

    401 answers a missing or wrong token, 403 a route that needs a token when none is
    configured. Read routes need the token only with ``read_token_required``; the comparison
    takes the same time wherever the given token differs.
    """
    if not mutating and not settings.read_token_required:
        return None
    if settings.token is None:
        return refusal(
            403,
            "leave and down over HTTP are off on this node: it has no management token. Set "
            "[management] token (or P2PSHARD_MANAGEMENT__TOKEN) in its configuration to "
            "enable them",
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return refusal(
            401, "this route needs the header 'Authorization: Bearer <token>'", _CHALLENGE
        )
    if not hmac.compare_digest(given.strip().encode(), settings.token.encode()):
        challenge = (_CHALLENGE[0], _CHALLENGE[1] + ', error="invalid_token"')
        return refusal(401, "the bearer token is wrong", challenge)
    return None


def certificate_caller(chain: Sequence[str], tls: TlsIdentity) -> PeerIdentity | str | None:
    """The identity a client's verified certificate names, or why it names none usable.

    ``chain`` is the ASGI TLS extension's ``client_cert_chain`` (PEM, the client's certificate
    first; empty: the client presented none, then None). The TLS handshake has already checked
    that a trusted CA signed it; this reads the ``p2pshard://`` SAN URI, which must name
    ``tls.cluster``, and applies ``tls.deny``. A string is the reason the certificate gives no
    identity (another cluster's, no such URI, denied).
    """
    if not chain:
        return None
    try:
        certificate = x509.load_pem_x509_certificate(chain[0].encode("ascii"))
    except ValueError as exc:
        return f"the client certificate cannot be read: {exc}"
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    try:
        identity = peer_identity({"subjectAltName": [("URI", u) for u in uris]}, tls.cluster)
    except HandshakeError as exc:
        return str(exc).replace("peer certificate", "the client certificate", 1)
    denied = tls.deny.reason(identity, certificate.serial_number)
    return identity if denied is None else denied


_READ_NEEDS = {
    "client": "a certificate of this cluster (client, admin or node)",
    "admin": "an admin certificate",
}


def authorize(
    settings: ManagementSettings,
    caller: PeerIdentity | str | None,
    authorization: str | None,
    *,
    mutating: bool,
) -> Answer | None:
    """None if the request may go on, else the refusal (401 or 403, with the reason).

    ``caller`` is what the client's certificate gave (:func:`certificate_caller`; always None
    without ``tls``). A mutating route needs an ``admin`` certificate or the bearer token; a
    read route what ``settings.read_level`` says (``"open"``: nothing). A certificate that is
    enough wins; otherwise an ``Authorization`` header is judged as :func:`check_token` does.
    Without one: 403 when a certificate was presented but is not enough (or no token is set to
    ask for), 401 when the client presented nothing.

    Example:
        >>> admin = PeerIdentity(IdentityKind.ADMIN, "alice")
        >>> settings = ManagementSettings(enabled=True, tls=True, read_access="client")
        >>> authorize(settings, admin, None, mutating=True) is None
        True
        >>> ops = PeerIdentity(IdentityKind.CLIENT, "ops")
        >>> authorize(settings, ops, None, mutating=True).status
        403
    """
    level = "admin" if mutating else settings.read_level
    if level == "open":
        return None
    if isinstance(caller, PeerIdentity) and (
        level == "client" or caller.kind is IdentityKind.ADMIN
    ):
        return None
    if not settings.tls:
        return check_token(settings, authorization, mutating=True)
    what = "leave and down" if mutating else "reading the cluster's state"
    needs = _READ_NEEDS[level]
    if settings.token is not None:
        if authorization:
            return check_token(settings, authorization, mutating=True)
        needs += " or the header 'Authorization: Bearer <token>'"
    elif authorization:
        return refusal(
            403,
            f"{what} needs {needs}: this node takes no bearer token (it has no [management] token)",
        )
    if isinstance(caller, PeerIdentity):
        return refusal(
            403,
            f"{what} needs {needs}; this client's certificate is {identity_text(caller)}",
        )
    if isinstance(caller, str):
        return refusal(403, f"{what} needs {needs}; {caller}")
    if settings.token is None:
        return refusal(403, f"{what} needs {needs}: present one (mutual TLS)")
    return refusal(401, f"{what} needs {needs}", _CHALLENGE)


def parse_operation(body: bytes) -> str | Answer:
    """The operation a ``PUT /cluster/members/{address}`` body asks for, or the 400 answer.

    Example:
        >>> parse_operation(b'{"operation": "leave"}')
        'leave'
        >>> parse_operation(b"leave").status
        400
    """
    wanted = 'send {"operation": "leave"} or {"operation": "down"}'
    try:
        document = json.loads(body)
    except ValueError as exc:  # not UTF-8, or not JSON
        return refusal(400, f"the body is not JSON ({exc}): {wanted}")
    if not isinstance(document, dict) or set(document) != {"operation"}:
        return refusal(400, f"the body must be an object with one key, operation: {wanted}")
    operation = document["operation"]
    if operation not in MEMBER_ACTIONS:
        return refusal(400, f"unknown operation {operation!r}: {wanted}")
    return str(operation)


@attrs.frozen
class RegionReadiness:
    """Whether one region (or proxy) on this node has registered with its coordinator."""

    type_name: str
    registered: bool


def readiness(
    status: MemberStatus,
    up_since: float | None,
    now: float,
    regions: Sequence[RegionReadiness],
    give_up_after: float,
) -> Answer:
    """The ``/ready`` answer: 200 when this node is Up and every region registered, else 503.

    ``up_since`` is when the node was first seen Up (None: not yet). Once ``give_up_after``
    seconds have passed since, regions that have not registered no longer hold readiness back;
    the answer names them under ``gave_up_waiting_for``.

    Example:
        >>> up = MemberStatus.UP
        >>> readiness(up, 0.0, 1.0, [RegionReadiness("Room", False)], 10.0).status
        503
        >>> readiness(up, 0.0, 12.0, [RegionReadiness("Room", False)], 10.0).body["ready"]
        True
    """
    if status not in READY_STATUSES:
        why = "not Up yet" if status is MemberStatus.JOINING else "not Up"
        return Answer(
            503,
            {"ready": False, "status": status.name, "reason": f"this node is {status.name}: {why}"},
        )
    registered = sorted(r.type_name for r in regions if r.registered)
    waiting = sorted(r.type_name for r in regions if not r.registered)
    body: dict[str, Any] = {"ready": True, "status": status.name, "registered": registered}
    if not waiting:
        return Answer(200, body)
    waited = 0.0 if up_since is None else max(0.0, now - up_since)
    names = ", ".join(waiting)
    if waited >= give_up_after:
        reason = (
            f"regions not registered with their coordinator: {names}; ready anyway, as this "
            f"node has been Up for {waited:.1f} s (ready_give_up_after = {give_up_after:g} s)"
        )
        return Answer(200, {**body, "gave_up_waiting_for": waiting, "reason": reason})
    reason = f"regions not registered with their coordinator yet: {names}"
    return Answer(
        503,
        {
            **body,
            "ready": False,
            "waiting_for": waiting,
            "gives_up_in": round(give_up_after - waited, 3),
            "reason": reason,
        },
    )


@attrs.define(eq=False)
class ManagementApp:
    """The ASGI application of the management endpoint of one node.

    :func:`serve_management` runs it; the node makes it when ``[management]`` is enabled.
    """

    _settings: ManagementSettings
    _cluster: Cluster
    _sharding: Sharding
    _status: StatusService
    _metrics: Callable[[], bytes] | None = None
    """The node's metrics in Prometheus' text format, now (None: ``/metrics`` answers 404)."""
    _families: Callable[[], Iterable[Metric]] | None = None
    """The node's metric families, for the dashboard's charts (None: no charts)."""
    _dashboard: Dashboard = attrs.field(init=False)
    """The dashboard's series and timeline (``GET /``, ``GET /dashboard/state``)."""
    _up_since: float | None = None
    """When this node was first seen Up (trio's clock), for the readiness give-up."""
    _tls: TlsIdentity | None = None
    """The node's certificate, key, CA and deny list, for ``settings.tls`` (None: no TLS)."""

    @property
    def tls(self) -> TlsIdentity | None:
        """The TLS identity HTTPS is served with and client certificates are judged by."""
        return self._tls

    def __attrs_post_init__(self) -> None:
        self._dashboard = Dashboard(self._cluster, self._sharding, self._families)

    @property
    def dashboard(self) -> Dashboard:
        """The dashboard's series and timeline; :func:`serve_management` runs it."""
        return self._dashboard

    @property
    def node(self) -> UniqueAddress:
        """The node this endpoint serves."""
        return self._cluster.self_address

    async def watch_up(self) -> None:
        """Note when this node becomes Up (run as a task for the node's lifetime)."""
        # It reads every event to the end (cancellation), as leaving an event stream half read
        # leaves its generator to the garbage collector.
        while True:
            try:
                async with self._cluster.subscribe() as events:
                    async for _ in events:
                        self._note_up()
            except ClusterError:  # fell behind the events: look again
                self._note_up()

    def _note_up(self) -> None:
        if self._up_since is None and self._cluster.self_member.status in READY_STATUSES:
            self._up_since = trio.current_time()

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """Answer one ASGI connection scope (``http``; ``lifespan`` is acknowledged)."""
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif event["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return  # websockets: hypercorn refuses a connection the app does not accept
        body = b""
        too_large = False
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                return
            if event["type"] == "http.request":
                if not too_large:
                    body += event.get("body", b"")
                    too_large = len(body) > MAX_BODY
                    if too_large:
                        body = b""
                if not event.get("more_body", False):
                    break
        headers = {
            name.decode("latin-1").lower(): v.decode("latin-1") for name, v in scope["headers"]
        }
        if too_large:
            answer = refusal(413, f"the body is larger than {MAX_BODY} bytes")
        else:
            client = scope.get("client")
            caller = "unknown" if client is None else f"{client[0]}:{client[1]}"
            certificate: PeerIdentity | str | None = None
            if self._settings.tls and self._tls is not None:
                tls = scope.get("extensions", {}).get("tls") or {}
                certificate = certificate_caller(tls.get("client_cert_chain", ()), self._tls)
                if isinstance(certificate, PeerIdentity):
                    caller += f" ({identity_text(certificate)})"
            try:
                answer = await self.answer(
                    scope["method"], scope["path"], headers, body, caller, certificate
                )
            except Exception:
                logger.exception("%s: management request failed", self._cluster.self_address)
                answer = refusal(500, "internal error: see the node's log")
        await _send_json(send, answer)

    async def answer(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        caller: str = "unknown",
        certificate: PeerIdentity | str | None = None,
    ) -> Answer:
        """The answer to one request (headers by lower-case name); ``caller`` is for the log.

        ``certificate`` is what the client's certificate gave (see :func:`certificate_caller`).
        """
        matched = route(method, path)
        if isinstance(matched, Answer):
            return matched
        if matched.name == "alive":
            return Answer(200, {"alive": True})
        if matched.name == "ready":
            return self._ready()
        if matched.name in ("dashboard", "dashboard_file"):  # the page itself needs no token
            return _dashboard_file(matched.argument or "index.html")
        refused = authorize(
            self._settings,
            certificate,
            headers.get("authorization"),
            mutating=matched.name == "operation",
        )
        if refused is not None:
            if matched.name == "operation":
                logger.warning(
                    "%s: refused %s %s from %s: %s",
                    self._cluster.self_address,
                    method,
                    path,
                    caller,
                    refused.body["error"],
                )
            return refused
        if matched.name == "metrics":
            if self._metrics is None:
                return refusal(404, "this node serves no metrics")
            return Answer(200, {}, text=self._metrics(), content_type=CONTENT_TYPE_LATEST)
        if matched.name == "members":
            return Answer(200, self._members())
        if matched.name == "dashboard_state":
            return Answer(200, await self._dashboard.state(self._status, STATS_TIMEOUT))
        if matched.name == "types":
            return Answer(200, {"entity_types": sorted(self._sharding.type_names)})
        if matched.name == "shards":
            return await self._shards(matched.argument)
        address = _address(matched.argument)
        if isinstance(address, Answer):
            return address
        if matched.name == "member":
            return self._member(address)
        operation = parse_operation(body)
        if isinstance(operation, Answer):
            return operation
        answer = self._operate(address, operation)
        log = logger.info if answer.status == 200 else logger.warning
        log(
            "%s: %s %s over HTTP from %s: %s",
            self._cluster.self_address,
            operation,
            address,
            caller,
            answer.body.get("message") or answer.body.get("error"),
        )
        return answer

    def _ready(self) -> Answer:
        regions = [
            RegionReadiness(name, self._registered(name))
            for name in sorted(self._sharding.type_names)
        ]
        return readiness(
            self._cluster.self_member.status,
            self._up_since,
            trio.current_time(),
            regions,
            self._settings.ready_give_up_after,
        )

    def _registered(self, type_name: str) -> bool:
        try:
            return self._sharding.region(type_name).statistics().registered
        except ConfigurationError:  # sharding shut down meanwhile: the node is stopping
            return False

    def _members(self) -> dict[str, Any]:
        view = reply_json(self._status.members(1))
        return {
            "self": view["node"],
            "leader": view["leader"],
            "oldest": view["oldest"],
            "members": view["members"],
            "unreachable": view["unreachable"],
            "other_clusters": view["other_clusters"],
        }

    def _member(self, address: Address) -> Answer:
        for member in self._members()["members"]:
            if member["address"] == str(address):
                return Answer(200, member)
        return refusal(404, no_member_text(self._cluster, address))

    async def _shards(self, type_name: str) -> Answer:
        if type_name not in self._sharding.type_names:
            started = ", ".join(sorted(self._sharding.type_names)) or "none"
            return refusal(
                404, f"entity type {type_name!r} is not started on this node (started: {started})"
            )
        status = await self._status.entity_type(type_name, STATS_TIMEOUT)
        return Answer(200, entity_type_json(status))

    def _operate(self, address: Address, operation: str) -> Answer:
        cluster = self._cluster
        if not is_member_now(cluster):
            return refusal(503, not_a_member_text(cluster))
        member = member_at(cluster, address)
        if member is None:
            return refusal(404, no_member_text(cluster, address))
        if operation == "down" and member.node == cluster.self_address:
            return refusal(
                400,
                f"{member.node} is the node serving this request: it cannot down itself (it "
                "would stop before answering). Ask another node's management endpoint, or "
                "use the operation leave",
            )
        ok, text = carry_out(cluster, member, operation)
        if not ok:
            return refusal(409, text)
        return Answer(
            200, {"operation": operation, "member": node_json(member.node), "message": text}
        )


def _dashboard_file(name: str) -> Answer:
    found = asset(name)
    if found is None:
        return refusal(404, f"the dashboard has no file {name!r}; open / for the dashboard")
    content, content_type = found
    return Answer(200, {}, SECURITY_HEADERS, text=content, content_type=content_type)


def _address(text: str) -> Address | Answer:
    try:
        return Address.parse(text)
    except ConfigurationError:
        return refusal(
            400,
            f"{text!r} is not a member address: expected host:port, as in GET /cluster/members "
            "(an IPv6 host in brackets, [::1]:25520)",
        )


async def _send_json(send: ASGISendCallable, answer: Answer) -> None:
    payload = json.dumps(answer.body).encode() + b"\n" if answer.text is None else answer.text
    headers = [
        (b"content-type", answer.content_type.encode("latin-1")),
        (b"content-length", str(len(payload)).encode()),
        (b"cache-control", b"no-store"),
        *((name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers),
    ]
    await send(
        {
            "type": "http.response.start",
            "status": answer.status,
            "headers": headers,
            "trailers": False,
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def serve_management(
    app: ManagementApp,
    settings: ManagementSettings,
    *,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``settings.host:port`` until cancelled; started with the bound address.

    With ``settings.tls``, HTTPS with ``app.tls`` (see :func:`management_ssl_context`): this
    function accepts the connections and does the TLS handshake (a client whose certificate no
    trusted CA signed is refused there, and logged), then hands each connection to hypercorn's
    own connection handler with the client's certificate added to every request's scope, as
    the ASGI TLS extension's ``client_cert_chain``; hypercorn's ``serve`` cannot pass it.

    Raises:
        ConfigurationError: the address cannot be listened on (taken, or not this host's); or
            ``tls`` is on and the certificate, key or CA cannot be loaded.
    """
    context: ssl.SSLContext | None = None
    if settings.tls:
        if app.tls is None:
            raise ConfigurationError(
                "[management] tls = true needs the node's TLS files, but none were given to "
                "the management endpoint"
            )
        try:
            context = management_ssl_context(app.tls)
        except ConfigurationError as exc:
            raise ConfigurationError(f"[management] tls = true: {exc}") from None
    fd, address = await _bind(settings)
    config = hypercorn.config.Config()
    config.bind = [f"fd://{fd}"]  # hypercorn owns the socket from here on, and closes it
    config.accesslog = None
    config.errorlog = server_logger
    async with trio.open_nursery() as nursery:
        if context is None:
            await nursery.start(partial(hypercorn.trio.serve, app, config, mode="asgi"))
            scheme = "http"
        else:
            sock = trio.socket.from_stdlib_socket(socket.socket(fileno=fd))
            sock.listen(config.backlog)
            listener = trio.SSLListener(trio.SocketListener(sock), context, https_compatible=True)
            await nursery.start(_serve_tls, app, config, listener)
            scheme = "https"
        nursery.start_soon(app.watch_up)
        nursery.start_soon(app.dashboard.run)
        logger.info("%s: management endpoint on %s://%s", app.node, scheme, address)
        task_status.started(address)


HANDSHAKE_TIMEOUT = 10.0
"""Seconds a client may take over its TLS handshake with the management endpoint."""


def management_ssl_context(tls: TlsIdentity) -> ssl.SSLContext:
    """The server side of the management endpoint's HTTPS: the node's certificate and CAs.

    TLS 1.3, as the cluster port; the client's certificate is optional (``CERT_OPTIONAL``), so
    a probe without one reaches ``/alive`` and ``/ready``, but one that is presented must be
    signed by a trusted CA or the handshake fails. Which routes need which certificate is
    :func:`authorize`'s decision.

    Raises:
        ConfigurationError: a file is missing or cannot be loaded (the message names it).
    """
    context = tls.server_context()
    context.verify_mode = ssl.CERT_OPTIONAL
    context.set_alpn_protocols(["http/1.1"])
    return context


def tls_extension(stream: trio.SSLStream[trio.SocketStream]) -> dict[str, Any]:
    """The ASGI TLS extension of a connection whose handshake is done.

    ``client_cert_chain`` holds the client's certificate (PEM), or nothing when it presented
    none; Python's ``ssl`` gives only the client's own certificate, not the rest of its chain.
    The keys it cannot fill are None.
    """
    der = stream.getpeercert(binary_form=True)
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": None,
        "client_cert_error": None,
        "tls_version": 0x0304,  # the context allows TLS 1.3 only
        "cipher_suite": None,
    }


async def _serve_tls(
    app: ManagementApp,
    config: hypercorn.config.Config,
    listener: trio.SSLListener[trio.SocketStream],
    *,
    task_status: trio.TaskStatus[list[trio.SSLListener[trio.SocketStream]]] = (
        trio.TASK_STATUS_IGNORED
    ),
) -> None:
    """Accept HTTPS connections and serve each with hypercorn's handler, until cancelled."""
    worker = WorkerContext(None)
    state = ConnectionState({})

    async def connection(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            peer = stream.transport_stream.socket.getpeername()
            where = f"{peer[0]}:{peer[1]}"
        except OSError:  # gone already
            where = "a client"
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await stream.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            reason = exc.__cause__ or "took too long"
            logger.warning(
                "%s: management endpoint refused a TLS handshake from %s: %s",
                app.node,
                where,
                reason,
            )
            await trio.aclose_forcefully(stream)
            return
        extension = tls_extension(stream)

        async def with_tls(
            scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
        ) -> None:
            if scope["type"] != "lifespan":
                scope["extensions"] = {**(scope.get("extensions") or {}), "tls": extension}
            await app(scope, receive, send)

        # hypercorn's handler skips the handshake it finds done and serves HTTP/1.1 on it.
        await TCPServer(ASGIWrapper(with_tls), config, worker, state, stream)

    await trio.serve_listeners(connection, [listener], task_status=task_status)


async def _bind(settings: ManagementSettings) -> tuple[int, Address]:
    """A socket bound to the management address, as its file descriptor, and the address.

    Bound here rather than by hypercorn, which leaves the socket of a failed bind unclosed.
    """
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with trio.socket.socket(family, socket.SOCK_STREAM) as sock:  # closed unless detached
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await sock.bind((settings.host, settings.port))
        except OSError as exc:
            where = Address(settings.host, settings.port)
            raise ConfigurationError(
                f"cannot listen on the management address {where}: {exc.strerror or exc}; "
                "change [management] host or port (port 0 takes any free port)"
            ) from None
        port = sock.getsockname()[1]
        return sock.detach(), Address(settings.host, port)
