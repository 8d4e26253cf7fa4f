"""The configuration of one node: :class:`NodeConfig`, built in code or loaded from TOML.

Theory of operation: a ``NodeConfig`` is a frozen attrs class whose validators reject a bad value
when the object is built, so a node never starts with a configuration it cannot run. ``load`` reads
a TOML file whose layout mirrors the class: plain fields at the top level, each nested attrs class
(``tls``, ``transport``, ``cluster`` and the other ``*Settings``) in a table named after its
field. Then ``P2PSHARD_*`` environment variables override single values, as Akka lets ``-D``
system properties override ``application.conf``.

The loader walks the attrs fields and their resolved type hints, so nesting another settings class
needs no loader code, only a field. It reads ``bool``, ``int``, ``float``, ``str``, ``Path``,
:class:`membership.Address`, ``Literal`` of strings, unions of these (string literals are tried
first), ``X | None``, ``tuple[X, ...]`` (a TOML array), ``tuple[tuple[str, X], ...]`` (a TOML table
of ``name = value``, read as pairs sorted by name) and attrs classes; another type is a
programming error (``TypeError``) at every load. Errors name where a value came from: the
dotted field path and the file, or the environment variable. Validators of settings classes report
``"ClassName.field = value is invalid: ..."`` (see ``membership.transport._settings``); the loader
rewrites ``ClassName.`` into the field's dotted path, so a nested class gets located messages for
free.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

import attrs

from crdt import ReplicatorSettings

# Imported at run time, not under TYPE_CHECKING: the loader resolves the field annotations.
from membership import (
    Address,
    ClusterSettings,
    ConfigurationError,
    FailureDetectorSettings,
    PeerIdentity,
    SplitBrainResolverSettings,
    TransportSettings,
)
from membership.internal import DenyList, TlsIdentity, certificate_identity, check_name

from .leases._lease import LeaseSettings
from .persistence._journal import JournalSettings

ENV_PREFIX = "P2PSHARD_"
"""Environment variables that override configuration values start with this."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""The allowed values of :attr:`NodeConfig.log_level`."""

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})

_T = TypeVar("_T")
_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


# --- validators: "ClassName.field = value is invalid: what is allowed" -------------------------


def _invalid(
    instance: object, attribute: attrs.Attribute[Any], value: object, allowed: str
) -> ConfigurationError:
    return ConfigurationError(
        f"{type(instance).__name__}.{attribute.name} = {value!r} is invalid: {allowed}"
    )


def _check_name(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    # check_name says "<kind> <value> is invalid: ..."; this kind gives our message's form.
    check_name(f"{type(instance).__name__}.{attribute.name} =", value)


def _check_host(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _invalid(instance, attribute, value, "must be a host name or IP address")


def _port(low: int) -> _Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 65535:
            raise _invalid(instance, attribute, value, f"must be an integer from {low} to 65535")

    return check


def _check_seed_nodes(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(a, Address) and a.port != 0 for a in value
    ):
        raise _invalid(
            instance,
            attribute,
            value,
            "must be a tuple of Address with ports from 1 to 65535, "
            "e.g. (Address.parse('10.0.0.1:25520'),)",
        )


def _check_roles(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(r, str) and r and "," not in r and not any(c.isspace() for c in r) for r in value
    ):
        raise _invalid(
            instance, attribute, value, "must be a tuple of non-empty strings without ',' or spaces"
        )


_APP_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")


def _check_app_version(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or (value and _APP_VERSION.fullmatch(value) is None):
        raise _invalid(
            instance,
            attribute,
            value,
            "must be empty or a version such as '2.4.1' or '2026.11-rc1': up to 64 letters, "
            "digits and '.+_-', starting with a letter or digit",
        )


def app_spec_problem(value: str) -> str | None:
    """What is wrong with an application entry point ``MODULE:FUNCTION``, or None if nothing.

    ``MODULE`` is a dotted module name (``shop.app``), ``FUNCTION`` a name in it, or a dotted
    path of attributes (``Shop.setup``). Used for ``NodeConfig.app`` and ``p2pshard node --app``.

    Example:
        >>> app_spec_problem("shop.app:setup") is None
        True
        >>> app_spec_problem("shop.app")
        "the ':' is missing: expected MODULE:FUNCTION, e.g. 'shop.app:setup'"
    """
    example = "expected MODULE:FUNCTION, e.g. 'shop.app:setup'"
    if ":" not in value:
        return f"the ':' is missing: {example}"
    module, _, function = value.partition(":")
    if not module or not all(part.isidentifier() for part in module.split(".")):
        return f"{module!r} is not a module name (dotted Python names, no '/' or '.py'): {example}"
    if module.endswith(".py"):
        return f"{module!r} is a file name: give the module's name, {module[:-3]!r}"
    if not function or not all(part.isidentifier() for part in function.split(".")):
        return f"{function!r} is not a function name (a Python name): {example}"
    return None


def _check_app(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise _invalid(instance, attribute, value, "must be a string MODULE:FUNCTION, or empty")
    problem = value and app_spec_problem(value)
    if problem:
        raise _invalid(instance, attribute, value, problem)


def _check_file(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Path) or value == Path():
        raise _invalid(instance, attribute, value, "must be a non-empty pathlib.Path to a file")


def _check_files(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(p, Path) and p != Path() for p in value):
        raise _invalid(
            instance, attribute, value, "must be a tuple of non-empty pathlib.Path to files"
        )


def _check_deny(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple):
        raise _invalid(instance, attribute, value, "must be a tuple of deny entries (strings)")
    try:
        DenyList.parse(value)
    except ConfigurationError as exc:
        raise _invalid(instance, attribute, value, str(exc)) from None


def _check_log_level(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in LOG_LEVELS:
        raise _invalid(instance, attribute, value, f"must be one of {', '.join(LOG_LEVELS)}")


def _check_timeout(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise _invalid(instance, attribute, value, "must be a number of seconds greater than 0")


def _one_of(*allowed: str) -> _Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise _invalid(instance, attribute, value, f"must be one of {', '.join(allowed)}")

    return check


def _instance_of(cls: type) -> _Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, cls):
            raise _invalid(instance, attribute, value, f"must be a {cls.__name__}")

    return check


def detection_spread(config: NodeConfig) -> float:
    """How far apart the members of one partition may be found unreachable, in seconds.

    The last heartbeat replies of two members arrive up to one ``heartbeat_interval`` apart, the
    detectors are read every ``unreachable_nodes_reaper_interval``, and a member that the leader
    does not watch itself is reported to it by gossip (``gossip_interval``). The split brain
    resolver's ``stable_after`` must be at least this, so that it waits for the whole picture
    (bigger clusters need more: Akka recommends 7 s for 5 nodes and 20 s for 100 with its
    default detector). Example: 3.0 with the defaults (1 + 1 + 1).
    """
    fd = config.failure_detector
    gossip = config.cluster.gossip_interval
    return fd.heartbeat_interval + fd.unreachable_nodes_reaper_interval + gossip


# --- the configuration classes -----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TlsFiles:
    """The PEM files for mutual TLS between nodes, and the certificates to refuse.

    ``p2pshard certs`` makes the files (see ``docs/security.md``). Whether they exist is not
    checked here: the transport reports a missing or unreadable file, with its path, when it
    starts. A running ``p2pshard node`` reads this table again on SIGHUP: new CAs, a renewed
    certificate and a new deny list apply at once, and open links they refuse are closed.
    """

    ca_file: Path = attrs.field(validator=_check_file)
    """The cluster's CA certificate (required): peers must present a certificate signed by it.
    The file may hold several CA certificates (a bundle); any of them will do."""

    cert_file: Path = attrs.field(validator=_check_file)
    """This node's certificate (required), with the SAN URI ``p2pshard://<cluster>/<node>``."""

    key_file: Path = attrs.field(validator=_check_file)
    """The private key of ``cert_file`` (required)."""

    ca_files: tuple[Path, ...] = attrs.field(default=(), validator=_check_files)
    """More CA certificates to trust besides ``ca_file`` (default none): while a cluster moves
    to a new CA, every node trusts both."""

    deny: tuple[str, ...] = attrs.field(default=(), validator=_check_deny)
    """Certificates to refuse although a trusted CA signed them (default none): ``serial:<hex>``
    names one certificate by the serial ``p2pshard certs sign`` printed, ``node:<name>``,
    ``client:<name>`` or ``admin:<name>`` every certificate of that identity. Checked after every
    handshake, both ways."""

    def identity(self, cluster: str) -> TlsIdentity:
        """These files and the deny list as the transport takes them, for ``cluster``.

        Example:
            >>> files = TlsFiles(
            ...     ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key")
            ... )
            >>> files.identity("shop").cluster
            'shop'
        """
        return TlsIdentity(
            cluster,
            self.ca_file,
            self.cert_file,
            self.key_file,
            ca_files=self.ca_files,
            deny=DenyList.parse(self.deny),
        )


_TOKEN = re.compile(r"[\x21-\x7e]{16,4096}")
"""What a management token may be: visible ASCII (it travels in an HTTP header), 16 or more."""


def _check_token(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise _invalid(instance, attribute, value, "must be a string or None")
    if _TOKEN.fullmatch(value) is None:
        # The value is a secret: the message says what is wrong with it, not what it is.
        raise ConfigurationError(
            f"{type(instance).__name__}.{attribute.name} = <{len(value)} characters, not shown> "
            "is invalid: must be 16 to 4096 visible ASCII characters without spaces, such as "
            "the output of `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )


@attrs.frozen(kw_only=True)
class ManagementSettings:
    """The management endpoint: health, readiness and cluster state over HTTP (``[management]``).

    Off unless ``enabled``. The node then serves, on ``host:port``, ``GET /alive``,
    ``GET /ready`` (for load balancers and Kubernetes probes), ``GET /cluster/members``,
    ``GET /cluster/members/{address}``, ``PUT /cluster/members/{address}`` (leave or down, with
    the bearer ``token`` or an ``admin`` certificate) and ``GET /cluster/shards/{type}``, as
    JSON (see ``docs/operations.md``). By default it speaks plain HTTP: bind it to a private
    address (loopback, the pod's or the host's internal network), never to one the internet
    reaches. With ``tls`` it speaks HTTPS with the node's own certificate from ``[tls]`` and
    takes client certificates signed by the cluster CA (``p2pshard certs client|admin``) as
    credentials. A file::

        [management]
        enabled = true
        host = "10.0.0.5"
        port = 8558
        token = "change-me-to-32-random-characters"  # or P2PSHARD_MANAGEMENT__TOKEN
        tls = true               # HTTPS; an admin certificate may leave and down too
        read_access = "client"   # GET /cluster/... and /metrics: any certificate of the cluster

    Example:
        >>> ManagementSettings(enabled=True, port=0).read_level
        'open'
        >>> ManagementSettings(enabled=True, tls=True, read_access="client").read_level
        'client'
    """

    enabled: bool = attrs.field(default=False, validator=_instance_of(bool))
    """Serve the management endpoint (default false)."""

    host: str = attrs.field(default="127.0.0.1", validator=_check_host)
    """The interface to listen on (default ``"127.0.0.1"``): a private address when the endpoint
    speaks plain HTTP; ``"0.0.0.0"`` inside a pod, where only the pod network reaches it."""

    port: int = attrs.field(default=8558, validator=_port(0))
    """The TCP port to listen on (default 8558, as Akka Management's; 0 takes any free port,
    which ``node.management_address`` tells)."""

    token: str | None = attrs.field(default=None, validator=_check_token, repr=False)
    """The bearer token ``PUT /cluster/members/{address}`` needs in its ``Authorization:
    Bearer`` header (default None: leave and down over HTTP are refused with 403). 16 to 4096
    visible ASCII characters; keep it out of the file with ``P2PSHARD_MANAGEMENT__TOKEN``."""

    read_token_required: bool = attrs.field(default=False, validator=_instance_of(bool))
    """Whether ``GET /cluster/...`` needs the token too (default false); the same as
    ``read_access = "admin"``, which also takes an admin certificate when ``tls`` is on.
    ``/alive`` and ``/ready`` never do: probes and load balancers call them without
    credentials."""

    ready_give_up_after: float = attrs.field(default=10.0, validator=_check_timeout)
    """Seconds after this node became Up that ``/ready`` stops waiting for its regions to
    register with their coordinators and answers ready anyway, saying so (default 10, as Akka's
    sharding health check's ``disabled-after``): a coordinator that cannot be reached must not
    stall a rolling upgrade for ever."""

    tls: bool = attrs.field(default=False, validator=_instance_of(bool))
    """Speak HTTPS with this node's certificate, key and CA from ``[tls]`` (default false:
    plain HTTP). TLS 1.3, as between nodes. A client may present a certificate signed by the
    cluster CA (mutual TLS; ``[tls] deny`` applies): an ``admin`` certificate may leave and
    down, as the token may, and ``read_access`` says which may read. A client certificate is
    optional at the TLS level, so ``/alive`` and ``/ready`` still answer without one (probes);
    a certificate the CA did not sign fails the handshake. Read when the node starts (a SIGHUP
    reload of ``[tls]`` applies to the cluster port only)."""

    read_access: Literal["open", "client", "admin"] = attrs.field(
        default="open", validator=_one_of("open", "client", "admin")
    )
    """Who may ``GET /cluster/...`` and ``/metrics`` (default ``"open"``): ``"open"`` anyone
    who reaches the port; ``"client"`` a certificate of this cluster of any kind (client,
    admin or node; needs ``tls``) or the token; ``"admin"`` an admin certificate or the token.
    ``/alive`` and ``/ready`` are always open."""

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.read_token_required and self.token is None:
            raise ConfigurationError(
                f"{name}.read_token_required = True is invalid without a token: "
                "set token (or P2PSHARD_MANAGEMENT__TOKEN), or read_token_required = false"
            )
        if self.read_token_required and self.read_access == "client":
            raise ConfigurationError(
                f"{name}.read_token_required = True is invalid with read_access = 'client': "
                "the first says only the token may read, the second that any certificate of "
                "the cluster may; keep read_access alone"
            )
        if self.read_access == "client" and not self.tls:
            raise ConfigurationError(
                f"{name}.read_access = 'client' is invalid without tls: a client proves who it "
                "is with its certificate, which only HTTPS carries; set tls = true, or "
                "read_access = 'admin' (the token) or 'open'"
            )
        if self.read_access == "admin" and not self.tls and self.token is None:
            raise ConfigurationError(
                f"{name}.read_access = 'admin' is invalid without tls and without a token: "
                "nobody could read; set token (or P2PSHARD_MANAGEMENT__TOKEN), or tls = true "
                "for admin certificates"
            )

    @property
    def read_level(self) -> Literal["open", "client", "admin"]:
        """What the read routes need: ``read_access``; ``"admin"`` with ``read_token_required``."""
        return "admin" if self.read_token_required else self.read_access


_DNS_NAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?)*\.?"
)
"""A DNS name to look up: dot-separated labels of letters, digits, ``-`` and ``_`` (SRV names
such as ``_cluster._tcp.shop.svc`` start with ``_``)."""


def nameserver_address(text: str) -> tuple[str, int]:
    """A DNS server given as ``IP`` or ``IP:PORT`` (``[IPv6]:PORT``), as ``(ip, port)``.

    The port defaults to 53. Names are refused: the server that resolves names cannot be found
    by a name.

    Raises:
        ValueError: ``text`` is not an IP address with an optional port; the message says why.

    Example:
        >>> nameserver_address("10.0.0.1:5353")
        ('10.0.0.1', 5353)
        >>> nameserver_address("fd00::1")
        ('fd00::1', 53)
    """
    host, port_text = text, ""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 address with a port is written [ADDRESS]:PORT")
        port_text = rest[1:] if rest else ""
        if rest and not port_text:
            raise ValueError("the port after ':' is missing")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if not port_text:
            raise ValueError("the port after ':' is missing")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{host!r} is not an IP address (a DNS server is given by its address, "
            "e.g. '10.0.0.1' or '10.0.0.1:5353')"
        ) from None
    port = 53
    if port_text:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"port {port_text!r} is not an integer from 1 to 65535")
        port = int(port_text)
    return str(ip), port


def _check_nameservers(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise _invalid(instance, attribute, value, "must be a tuple of strings such as '10.0.0.1'")
    for text in value:
        try:
            nameserver_address(text)
        except ValueError as exc:
            raise _invalid(instance, attribute, value, f"{text!r}: {exc}") from None


def _count_at_least_one(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10_000:
        raise _invalid(instance, attribute, value, "must be an integer from 1 to 10000")


def _check_seconds_or_zero(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise _invalid(instance, attribute, value, "must be a number of seconds, 0 or more")


@attrs.frozen(kw_only=True)
class DiscoverySettings:
    """How a node finds the cluster to join at start (``[discovery]``), as Akka's Cluster Bootstrap.

    With ``method = "static"`` (the default) the node joins through ``seed_nodes`` (or
    ``self_join``), as it always did. With ``method = "dns"`` it looks ``service_name`` up in DNS
    every ``resolve_interval`` (A/AAAA records, each at ``contact_port``, or SRV records with
    their ports, as a Kubernetes headless service gives) and asks each address found, its
    *contact points*, whether it is a member of a cluster. It joins through the first that is;
    when none is, once at least ``required_contact_points`` were found, the set stayed unchanged
    for ``stable_margin`` and every one of them said it is not a member, only the contact point
    with the lowest address forms a new cluster (and only with ``new_cluster_enabled``); the
    others join it. A file::

        [discovery]
        method = "dns"
        service_name = "p2pshard.shop.svc.cluster.local"
        required_contact_points = 3

    Each node's ``canonical_host`` must be the address DNS gives for it (its IP): a node that
    does not find itself among the contact points never forms a cluster, it only joins one.
    See ``docs/operations.md`` ("Bootstrap by DNS").

    Example:
        >>> DiscoverySettings(method="dns", service_name="p2pshard.shop.svc").lookup
        'a'
    """

    method: typing.Literal["static", "dns"] = attrs.field(
        default="static", validator=attrs.validators.in_(("static", "dns"))
    )
    """How to find the cluster (default ``"static"``: ``seed_nodes`` or ``self_join``; ``"dns"``:
    the contact points ``service_name`` resolves to)."""

    service_name: str = attrs.field(default="")
    """The DNS name to look up (default empty; required with ``method = "dns"``), e.g.
    ``"p2pshard.default.svc.cluster.local"`` for a headless service, or for SRV records
    ``"_cluster._tcp.p2pshard.default.svc.cluster.local"``."""

    lookup: typing.Literal["a", "srv"] = attrs.field(
        default="a", validator=attrs.validators.in_(("a", "srv"))
    )
    """Which records to read (default ``"a"``: A and AAAA records, each address at
    ``contact_port``; ``"srv"``: SRV records, each giving a host and a port, the host's
    addresses looked up in turn)."""

    contact_port: int = attrs.field(default=0, validator=_port(0))
    """The cluster port of the contact points with ``lookup = "a"`` (default 0: this node's own
    port, ``canonical_port`` or else ``bind_port``, as every node of a deployment listens on the
    same one)."""

    required_contact_points: int = attrs.field(default=2, validator=_count_at_least_one)
    """How many contact points must be found before a new cluster may be formed (default 2;
    joining a cluster that exists needs only one that is a member). Set it to the number of
    nodes that start together, or fewer."""

    stable_margin: float = attrs.field(default=5.0, validator=_check_seconds_or_zero)
    """Seconds the set of contact points must stay unchanged before a new cluster is formed
    (default 5): DNS records of nodes that start together appear over a few seconds."""

    resolve_interval: float = attrs.field(default=1.0, validator=_check_timeout)
    """Seconds between lookups, and between the questions to each contact point (default 1)."""

    new_cluster_enabled: bool = attrs.field(default=True, validator=_instance_of(bool))
    """Whether the lowest contact point may form a new cluster (default true). False for nodes
    added to a cluster that must already run: they wait until it answers."""

    nameservers: tuple[str, ...] = attrs.field(default=(), validator=_check_nameservers)
    """The DNS servers to ask, each ``"IP"`` or ``"IP:PORT"`` (default none: the system's, from
    ``/etc/resolv.conf``)."""

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.method == "dns" and not self.service_name:
            raise ConfigurationError(
                f"{name}.service_name = '' is invalid with method = 'dns': give the DNS name "
                "whose records list the nodes, e.g. 'p2pshard.default.svc.cluster.local'"
            )
        if self.service_name and _DNS_NAME.fullmatch(self.service_name) is None:
            raise ConfigurationError(
                f"{name}.service_name = {self.service_name!r} is invalid: must be a DNS name, "
                "labels of letters, digits, '-' and '_' separated by dots"
            )
        if self.lookup == "srv" and self.contact_port != 0:
            raise ConfigurationError(
                f"{name}.contact_port = {self.contact_port} is invalid with lookup = 'srv': SRV "
                "records carry each contact point's port; leave contact_port out"
            )

    @property
    def nameserver_addresses(self) -> tuple[tuple[str, int], ...]:
        """``nameservers`` as ``(ip, port)`` pairs."""
        return tuple(nameserver_address(n) for n in self.nameservers)


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything one node needs to start: who it is, where it listens, whom it asks to join.

    Build it in code, or :meth:`load` it from a TOML file. The file mirrors the class: plain fields
    at the top level, each nested class in a table named after its field. Only ``cluster_name``,
    ``node_name`` and the ``[tls]`` table are required; a left out key keeps its default. Relative
    paths are relative to the file's directory. A key that is not a field is an error, so a typo
    cannot go unnoticed. TOML has no null: an empty string ``""`` sets an optional field to None
    (``weakly_up_after = ""`` turns WeaklyUp off), as an empty environment variable does. A full
    file, ``node.toml``::

        cluster_name = "shop"
        node_name = "node-1"
        bind_host = "0.0.0.0"
        bind_port = 25520
        # What peers dial: needed when binding 0.0.0.0, in containers and behind NAT.
        canonical_host = "node-1.shop.internal"
        canonical_port = 25520
        seed_nodes = ["node-1.shop.internal:25520", "node-2.shop.internal:25520"]
        # self_join = true  # instead of seed_nodes: a cluster of this node alone, formed at once
        roles = ["backend"]
        app_version = "2.4.1"
        app = "shop.app:setup"  # what p2pshard node runs on it (--app)
        log_level = "INFO"
        shutdown_timeout = 10.0

        [tls]
        ca_file = "certs/ca.pem"
        cert_file = "certs/node-1.pem"
        key_file = "certs/node-1.key"

        [transport]  # membership.TransportSettings; leave out what keeps its default
        max_frame_size = 2097152
        connect_timeout = 5.0

        [cluster]  # membership.ClusterSettings: gossip, joining, the leader
        gossip_interval = 1.0
        weakly_up_after = 7.0

        [cluster.min_nr_of_members_of_role]  # nobody is Up before 2 backend nodes joined
        backend = 2

        [failure_detector]  # membership._failure_detector.FailureDetectorSettings
        threshold = 8.0
        acceptable_heartbeat_pause = 3.0

        [split_brain_resolver]  # membership.SplitBrainResolverSettings
        active_strategy = "keep-majority"
        stable_after = 20.0
        down_all_when_unstable = "on"  # or "off", or seconds

        [lease]  # p2pshard.LeaseSettings: shard leases, lease-majority downing
        backend = "sqlite"  # every node on this host shares the file; or "etcd"
        path = "leases.db"
        # endpoints = ["http://10.0.0.5:2379"]  # backend = "etcd"
        ttl = 15.0
        renew_interval = 3.0

        [journal]  # p2pshard.JournalSettings: where event-sourced entities keep their events
        backend = "sqlite"  # every node on this host may share the file; or "postgresql"
        path = "journal.db"
        # dsn = "postgresql://p2pshard@db-host/shop"  # backend = "postgresql"
        snapshot_every = 100

        [management]  # p2pshard.ManagementSettings: health checks and cluster state over HTTP
        enabled = true
        host = "127.0.0.1"  # plain HTTP: a private address only
        port = 8558
        # token: set P2PSHARD_MANAGEMENT__TOKEN to allow leave and down over HTTP

    Environment variables override the file: ``P2PSHARD_`` and the field name in upper case, a
    double underscore for each table level. Lists are comma-separated, tables of ``name = value``
    are comma-separated ``name=value`` lists, booleans are true/false/1/0/yes/no, and an empty
    value sets an optional field to None. Relative paths given this way are relative to the
    working directory::

        P2PSHARD_BIND_PORT=2552
        P2PSHARD_SEED_NODES=127.0.0.1:2551,127.0.0.1:2552
        P2PSHARD_TLS__CERT_FILE=/etc/p2pshard/node-2.pem
        P2PSHARD_TRANSPORT__MAX_FRAME_SIZE=2097152
        P2PSHARD_CLUSTER__GOSSIP_INTERVAL=0.5
        P2PSHARD_CLUSTER__MIN_NR_OF_MEMBERS_OF_ROLE=backend=2,frontend=1
        P2PSHARD_SPLIT_BRAIN_RESOLVER__ACTIVE_STRATEGY=keep-oldest

    An invalid value fails when the object is built or loaded, with a
    :class:`membership.ConfigurationError` naming the field, the value and what is allowed.

    Example:
        >>> from pathlib import Path
        >>> config = NodeConfig(
        ...     cluster_name="shop",
        ...     node_name="node-1",
        ...     tls=TlsFiles(
        ...         ca_file=Path("ca.pem"), cert_file=Path("n1.pem"), key_file=Path("n1.key")
        ...     ),
        ... )
        >>> str(config.canonical_address)
        '127.0.0.1:25520'
    """

    cluster_name: str = attrs.field(validator=_check_name)
    """The cluster's name (required). A peer whose certificate names another cluster is refused."""

    node_name: str = attrs.field(validator=_check_name)
    """This node's name (required): in its certificate, its logs and the cluster's member list."""

    bind_host: str = attrs.field(default="127.0.0.1", validator=_check_host)
    """The interface to listen on (default ``"127.0.0.1"``; ``"0.0.0.0"`` for all of them)."""

    bind_port: int = attrs.field(default=25520, validator=_port(0))
    """The TCP port to listen on (default 25520; 0 takes any free port)."""

    canonical_host: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_check_host)
    )
    """The host peers dial, when it differs from ``bind_host`` (containers, NAT; default None:
    ``bind_host``). Required when ``bind_host`` is a wildcard such as ``"0.0.0.0"``."""

    canonical_port: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_port(1))
    )
    """The port peers dial, when it differs from ``bind_port`` (default None: ``bind_port``)."""

    seed_nodes: tuple[Address, ...] = attrs.field(default=(), validator=_check_seed_nodes)
    """Nodes to contact to join the cluster (default none). As in Akka, the first seed node starts
    a new cluster by joining itself when it cannot reach the others. A node that is its own only
    seed node forms its cluster after ``cluster.own_seed_listen`` (2 s), unless a running cluster
    of its name probes it meanwhile (then it joins that one), and later nodes join it through the
    same list. With no
    seed nodes, set ``self_join``, or call ``node.cluster.join(address)`` after ``open_node``
    (``p2pshard node`` refuses a configuration with neither)."""

    self_join: bool = attrs.field(default=False, validator=_instance_of(bool))
    """Form a new cluster of this node alone at start, at once, asking nobody (default false).
    For a node that is always on its own (a laptop, a test); others may still join it with
    ``node.cluster.join(its address)``. Only without ``seed_nodes``: a node with seed nodes joins
    through them."""

    roles: tuple[str, ...] = attrs.field(default=(), validator=_check_roles)
    """This node's roles (default none): shard regions and singletons can be limited to a role."""

    app_version: str = attrs.field(default="", validator=_check_app_version)
    """The version of the application this node runs (default empty: not set), as Akka's
    ``app-version``: the cluster learns it when the node joins, and ``p2pshard status`` shows
    each member's, so a rolling upgrade can be followed."""

    tls: TlsFiles = attrs.field(validator=_instance_of(TlsFiles))
    """The CA, certificate and key files for mutual TLS (required; ``[tls]`` in a file)."""

    transport: TransportSettings = attrs.field(
        factory=TransportSettings, validator=_instance_of(TransportSettings)
    )
    """How node-to-node links behave (default ``TransportSettings()``; ``[transport]`` in a
    file)."""

    cluster: ClusterSettings = attrs.field(
        factory=ClusterSettings, validator=_instance_of(ClusterSettings)
    )
    """How the membership protocol gossips, joins and moves members (default
    ``ClusterSettings()``; ``[cluster]`` in a file)."""

    failure_detector: FailureDetectorSettings = attrs.field(
        factory=FailureDetectorSettings, validator=_instance_of(FailureDetectorSettings)
    )
    """How nodes watch each other with heartbeats (default ``FailureDetectorSettings()``;
    ``[failure_detector]`` in a file)."""

    split_brain_resolver: SplitBrainResolverSettings = attrs.field(
        factory=SplitBrainResolverSettings, validator=_instance_of(SplitBrainResolverSettings)
    )
    """How unreachable members are downed after a partition (default
    ``SplitBrainResolverSettings()``; ``[split_brain_resolver]`` in a file)."""

    replicator: ReplicatorSettings = attrs.field(
        factory=ReplicatorSettings, validator=_instance_of(ReplicatorSettings)
    )
    """The node's replicated keys: gossip, notifications, durable keys (default
    ``ReplicatorSettings()``; ``[replicator]`` in a file)."""

    lease: LeaseSettings = attrs.field(factory=LeaseSettings, validator=_instance_of(LeaseSettings))
    """Where the node's leases live and how they are kept alive (default: no lease backend;
    ``[lease]`` in a file). Needed by ``ShardingSettings.use_lease`` and the lease-majority split
    brain strategy."""

    journal: JournalSettings = attrs.field(
        factory=JournalSettings, validator=_instance_of(JournalSettings)
    )
    """Where event-sourced entities keep their events, ``node.journal`` (default: no journal;
    ``[journal]`` in a file)."""

    management: ManagementSettings = attrs.field(
        factory=ManagementSettings, validator=_instance_of(ManagementSettings)
    )
    """The HTTP management endpoint: health, readiness, members, leave and down (default off;
    ``[management]`` in a file)."""

    discovery: DiscoverySettings = attrs.field(
        factory=DiscoverySettings, validator=_instance_of(DiscoverySettings)
    )
    """How the node finds its cluster at start: ``seed_nodes`` (``method = "static"``, the
    default) or DNS (``method = "dns"``; ``[discovery]`` in a file)."""

    app: str = attrs.field(default="", validator=_check_app)
    """The application ``p2pshard node`` runs on this node, ``"MODULE:FUNCTION"`` (default empty:
    a bare node), as ``--app`` gives it: ``FUNCTION`` is ``async def setup(node)``, which starts
    the entity types and singletons. :func:`open_node` does not read it; see the Operations
    page of the documentation."""

    log_level: str = attrs.field(default="INFO", validator=_check_log_level)
    """The least severe log records to emit: DEBUG, INFO, WARNING or ERROR (default INFO)."""

    shutdown_timeout: float = attrs.field(default=10.0, validator=_check_timeout)
    """Seconds a graceful leave (handing off shards, leaving the cluster) may take before the node
    stops anyway (default 10)."""

    def __attrs_post_init__(self) -> None:
        if self.replicator.max_message_bytes > self.transport.max_frame_size // 2:
            raise ConfigurationError(
                f"{type(self).__name__}.replicator.max_message_bytes = "
                f"{self.replicator.max_message_bytes} is invalid: must be at most half of "
                f"transport.max_frame_size ({self.transport.max_frame_size}), to leave room for "
                "the message around the payload"
            )
        if self.self_join and self.seed_nodes:
            raise ConfigurationError(
                f"{type(self).__name__}.self_join = True is invalid with seed_nodes "
                f"({', '.join(map(str, self.seed_nodes))}): self_join forms a cluster without "
                "asking anyone, seed nodes are whom to ask; set seed_nodes = [] or drop self_join "
                "(a node that is its own only seed node forms its cluster within "
                "cluster.own_seed_listen too)"
            )
        self._check_discovery()
        if self.canonical_host is None and self.bind_host in _WILDCARD_HOSTS:
            raise ConfigurationError(
                f"{type(self).__name__}.canonical_host = None is invalid: it is required when "
                f"bind_host is the wildcard {self.bind_host!r}, which peers cannot dial"
            )
        stable_after = self.split_brain_resolver.stable_after
        spread = detection_spread(self)
        if stable_after < spread - 1e-9:
            raise ConfigurationError(
                f"{type(self).__name__}.split_brain_resolver.stable_after = {stable_after!r} is "
                f"invalid with these timings: must be at least "
                "failure_detector.heartbeat_interval + "
                "failure_detector.unreachable_nodes_reaper_interval + cluster.gossip_interval "
                f"= {spread:g} s. The members on the other side of a partition are found "
                "unreachable up to that far apart; a resolver that decides sooner may act on "
                "part of a partition, and then both sides can keep running. Raise stable_after "
                "or make the detector and gossip faster"
            )

    def _check_discovery(self) -> None:
        if self.discovery.method != "dns":
            return
        name = type(self).__name__
        if self.seed_nodes or self.self_join:
            given = "seed_nodes" if self.seed_nodes else "self_join = True"
            raise ConfigurationError(
                f"{name}.discovery.method = 'dns' is invalid with {given}: DNS discovery finds "
                "the nodes to join through, and forms a cluster when there is none; drop "
                f"{given.partition(' ')[0]}, or set discovery.method = 'static'"
            )
        if (
            self.discovery.lookup == "a"
            and self.discovery.contact_port == 0
            and self.canonical_address.port == 0
        ):
            raise ConfigurationError(
                f"{name}.discovery.contact_port = 0 is invalid with bind_port = 0: the contact "
                "points' port is this node's own by default, and port 0 names no port; set "
                "bind_port (or canonical_port), or discovery.contact_port"
            )

    @property
    def bind_address(self) -> Address:
        """The address this node listens on."""
        return Address(self.bind_host, self.bind_port)

    @property
    def canonical_address(self) -> Address:
        """The address advertised to peers: the canonical host and port, else the bind ones.

        Its port is 0 when ``bind_port`` is 0 and no ``canonical_port`` is set; the transport
        then advertises the port it was given.
        """
        return Address(
            self.bind_host if self.canonical_host is None else self.canonical_host,
            self.bind_port if self.canonical_port is None else self.canonical_port,
        )

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> Self:
        """Read a TOML file, apply the ``P2PSHARD_*`` variables of ``environ``, and validate.

        Args:
            path: The TOML file; see the class docstring for its layout.
            environ: The environment variables to apply (default ``os.environ``).

        Raises:
            membership.ConfigurationError: The file cannot be read or is not valid TOML; a key or
                variable names no field; a required value is missing; or a value is invalid.
                The message names the file or variable, the field, the value and what is allowed.

        Example::

            config = NodeConfig.load("node.toml", environ={"P2PSHARD_BIND_PORT": "2552"})
        """
        file, document = _read_document(path)
        return _load(cls, document, file, os.environ if environ is None else environ)

    def to_toml(self) -> str:
        """This configuration as a TOML file that :meth:`load` reads back to an equal one.

        Every field is written, defaults included, except optional ones that are None where None
        is the default (a None that is not the default is written as ``""``). Paths are written as
        they are; as ``load`` reads relative paths relative to the file's directory, use absolute
        paths unless the file goes to the directory they are relative to.
        """
        lines = ["# p2pshard node configuration (NodeConfig.to_toml)", *_toml_lines(self, "")]
        return "\n".join(lines) + "\n"


@attrs.frozen(kw_only=True)
class ClientConfig:
    """How a command reaches a running cluster: ``p2pshard status``, ``leave`` and ``down``.

    A client presents its own certificate, a ``client`` one to read the cluster's state or an
    ``admin`` one to also make members leave or go down (``p2pshard certs client|admin`` or
    ``request``/``sign``); its name and kind are read from the certificate, never configured.
    It listens on a free port of ``bind_host``, because the answer comes back over a link the
    node opens to it. The file, ``client.toml``::

        cluster_name = "shop"
        bind_host = "10.0.0.9"          # where this host is reachable from the nodes
        # canonical_host = "ops.shop.internal"   # what nodes dial, when not bind_host

        [tls]
        ca_file = "certs/ops/ca.pem"
        cert_file = "certs/ops/client.pem"
        key_file = "certs/ops/client-key.pem"

    The layout is that of :class:`NodeConfig` (``[transport]`` too); ``P2PSHARD_*`` environment
    variables, which are meant for nodes, do not apply. :meth:`load` also reads a node's file,
    and a command then presents that node's certificate.

    Example:
        >>> client = ClientConfig(
        ...     cluster_name="shop",
        ...     tls=TlsFiles(
        ...         ca_file=Path("ca.pem"), cert_file=Path("ops.pem"), key_file=Path("ops.key")
        ...     ),
        ... )
        >>> client.bind_host
        '127.0.0.1'
    """

    cluster_name: str = attrs.field(validator=_check_name)
    """The cluster's name (required)."""

    tls: TlsFiles = attrs.field(validator=_instance_of(TlsFiles))
    """The CA, this client's certificate and its key (required; ``[tls]`` in a file)."""

    bind_host: str = attrs.field(default="127.0.0.1", validator=_check_host)
    """The interface to listen on for answers (default ``"127.0.0.1"``)."""

    canonical_host: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_check_host)
    )
    """The host nodes dial to answer, when it differs from ``bind_host`` (default None)."""

    transport: TransportSettings = attrs.field(
        factory=TransportSettings, validator=_instance_of(TransportSettings)
    )
    """How links behave (default ``TransportSettings()``); ``max_frame_size`` must let the
    cluster's answers through."""

    def __attrs_post_init__(self) -> None:
        if self.canonical_host is None and self.bind_host in _WILDCARD_HOSTS:
            raise ConfigurationError(
                f"{type(self).__name__}.canonical_host = None is invalid: it is required when "
                f"bind_host is the wildcard {self.bind_host!r}, which nodes cannot dial"
            )

    @classmethod
    def of_node(cls, config: NodeConfig) -> Self:
        """The client side of a node's configuration: its cluster, TLS files and host."""
        return cls(
            cluster_name=config.cluster_name,
            tls=config.tls,
            bind_host=config.bind_host,
            canonical_host=config.canonical_host,
            transport=config.transport,
        )

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
    ) -> Self:
        """Read a client's TOML file, or a node's (one with ``node_name``), and validate.

        ``environ`` (default ``os.environ``) applies to a node's file only, as
        :meth:`NodeConfig.load` applies it.

        Raises:
            membership.ConfigurationError: as :meth:`NodeConfig.load`.
        """
        file, document = _read_document(path)
        if "node_name" in document:
            node = _load(NodeConfig, document, file, os.environ if environ is None else environ)
            return cls.of_node(node)
        return _load(cls, document, file, {})

    def tls_identity(self) -> TlsIdentity:
        """The TLS identity this client presents."""
        return self.tls.identity(self.cluster_name)

    def identity(self) -> PeerIdentity:
        """The kind and name this client's certificate names in its cluster.

        Raises:
            membership.ConfigurationError: the certificate cannot be read or is for another
                cluster.
        """
        return certificate_identity(self.tls.cert_file, self.cluster_name)


# --- the loader ----------------------------------------------------------------------------------


def _read_document(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The absolute path of a TOML file and its contents."""
    file = Path(path).absolute()
    try:
        with file.open("rb") as f:
            return file, tomllib.load(f)
    except OSError as e:
        raise ConfigurationError(
            f"cannot read configuration file {file}: {e.strerror or e}"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigurationError(f"configuration file {file} is not valid TOML: {e}") from None


def _load(
    cls: type[_T], document: Mapping[str, object], file: Path, environ: Mapping[str, str]
) -> _T:
    values: dict[str, _Value] = {}
    _read_table(cls, document, "", file, values)
    _read_environ(cls, environ, file, values)
    return _build(cls, "", values, file)


@attrs.frozen
class _Value:
    """One value from the file or the environment, before conversion to its field's type."""

    path: str
    """The dotted field path, e.g. ``"transport.max_frame_size"``."""

    raw: object
    """The TOML value, or the environment variable's text."""

    file: Path
    """The configuration file being loaded; relative paths in it are relative to its directory."""

    env_var: str | None = None
    """The environment variable it came from; None if it came from the file."""

    def source(self) -> str:
        return f"from {self.env_var}" if self.env_var else f"in {self.file}"

    def invalid(self, allowed: str) -> ConfigurationError:
        if self.env_var:
            return ConfigurationError(f"{self.env_var}={self.raw!r} is invalid: {allowed}")
        return ConfigurationError(
            f"{self.path} = {self.raw!r} is invalid: {allowed} ({self.source()})"
        )


class _Invalid(Exception):
    """A value cannot be converted; the message says what was expected."""


def _fields(cls: Any) -> list[tuple[attrs.Attribute[Any], Any]]:
    """The init fields of an attrs class, in order, each with its resolved type hint."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in attrs.fields(cls) if f.init]


def _env_var(path: str) -> str:
    return ENV_PREFIX + path.replace(".", "__").upper()


def _leaf_paths(cls: type, prefix: str) -> Iterator[str]:
    """The dotted paths of every value (not table) in the class, nested ones included."""
    for field, hint in _fields(cls):
        if attrs.has(hint):
            yield from _leaf_paths(hint, f"{prefix}{field.name}.")
        elif not _readable(hint):
            raise TypeError(f"the configuration loader cannot read {prefix}{field.name}: {hint}")
        else:
            yield prefix + field.name


def _unknown(what: str, given: str, allowed: list[str]) -> ConfigurationError:
    close = difflib.get_close_matches(given, allowed, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigurationError(f"{what}{hint}; allowed: {', '.join(allowed)}")


def _read_table(
    cls: type, table: Mapping[str, object], prefix: str, file: Path, out: dict[str, _Value]
) -> None:
    fields = {field.name: hint for field, hint in _fields(cls)}
    for key, raw in table.items():
        path = prefix + key
        if key not in fields:
            where = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise _unknown(f"unknown key {path!r} at {where} of {file}", key, list(fields))
        hint = fields[key]
        if not attrs.has(hint):
            out[path] = _Value(path, raw, file)
        elif isinstance(raw, dict):
            _read_table(hint, raw, path + ".", file, out)
        else:
            raise _Value(path, raw, file).invalid(f"expected a table [{path}]")


def _read_environ(
    cls: type, environ: Mapping[str, str], file: Path, out: dict[str, _Value]
) -> None:
    paths = {_env_var(path): path for path in _leaf_paths(cls, "")}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in paths:
            raise _unknown(f"environment variable {name} matches no setting", name, list(paths))
        out[paths[name]] = _Value(paths[name], text, file, env_var=name)


def _build(cls: type[_T], prefix: str, values: Mapping[str, _Value], file: Path) -> _T:
    kwargs: dict[str, object] = {}
    for field, hint in _fields(cls):
        path = prefix + field.name
        required = field.default is attrs.NOTHING
        if attrs.has(hint):
            if required or any(p.startswith(path + ".") for p in values):
                kwargs[field.alias or field.name] = _build(hint, path + ".", values, file)
        elif path in values:
            kwargs[field.alias or field.name] = _convert(values[path], hint)
        elif required:
            table = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise ConfigurationError(
                f"{path} is missing: it is required; set it at {table} of {file} "
                f"or with {_env_var(path)}"
            )
    try:
        return cls(**kwargs)
    except ConfigurationError as e:
        raise _located(e, cls, prefix, values, file) from None


def _located(
    error: ConfigurationError, cls: type, prefix: str, values: Mapping[str, _Value], file: Path
) -> ConfigurationError:
    """The validator's error with ``ClassName.`` replaced by the dotted path, and its source."""
    message, head = str(error), f"{cls.__name__}."
    if not message.startswith(head):  # not the usual form: say at least which table
        table = f"in [{prefix[:-1]}], " if prefix else ""
        return ConfigurationError(f"{message} ({table}loading {file})")
    rest = message[len(head) :]
    name = re.split(r"\W", rest, maxsplit=1)[0]  # "field = ..." or "field['key'] = ..."
    path = prefix + name
    source = values[path].source() if path in values else f"loading {file}"
    return ConfigurationError(f"{path}{rest[len(name) :]} ({source})")


def _convert(value: _Value, hint: Any) -> object:
    try:
        if value.env_var is None:
            return _from_toml(value.raw, hint, value.file.parent)
        return _from_toml(_from_text(str(value.raw), hint), hint, None)
    except _Invalid as e:
        raise value.invalid(str(e)) from None


# --- the field types: each helper returns None when the hint is not its kind ---------------------


def _union(hint: Any) -> tuple[Any, ...] | None:
    """The members of a union type, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return None


def _optional(hint: Any) -> Any:
    """``X`` if ``hint`` is ``X | None`` (``X`` a union if several types remain), else None."""
    members = _union(hint)
    if members is None or type(None) not in members:
        return None
    rest = [m for m in members if m is not type(None)]
    return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007


def _alternatives(hint: Any) -> list[Any] | None:
    """The members of a union without None, string literals first (the most specific), else None."""
    members = _union(hint)
    if members is None or type(None) in members:
        return None
    return sorted(members, key=lambda m: _literals(m) is None)


def _literals(hint: Any) -> tuple[object, ...] | None:
    """The values of ``Literal["a", "b", ...]``, else None."""
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None


def _tuple_item(hint: Any) -> Any:
    """``X`` if ``hint`` is ``tuple[X, ...]``, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _table_value(hint: Any) -> Any:
    """``X`` if ``hint`` is ``tuple[tuple[str, X], ...]``, a TOML table ``name = X``, else None."""
    pair = _tuple_item(hint)
    args = typing.get_args(pair)
    if typing.get_origin(pair) is tuple and len(args) == 2 and args[0] is str:
        return None if args[1] is Ellipsis else args[1]
    return None


_EXPECTED = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Path: "a non-empty path",
    Address: "an address 'host:port'",
}
"""The plain types the loader reads, and how an error message names a value of each."""


def _readable(hint: Any) -> bool:
    if (literals := _literals(hint)) is not None:
        return all(isinstance(x, str) for x in literals)
    if (members := _alternatives(hint)) is not None:
        return all(_readable(m) for m in members)
    if (value := _table_value(hint)) is not None:
        return _readable(value)
    inner = _optional(hint) or _tuple_item(hint)
    return hint in _EXPECTED if inner is None else _readable(inner)


def _expected(hint: Any) -> str:
    """How an error message names a value of a type the loader reads, as found in TOML."""
    if (literals := _literals(hint)) is not None:
        return "one of " + ", ".join(map(repr, literals))
    if (members := _alternatives(hint)) is not None:
        return " or ".join(_expected(m) for m in members)
    if (value := _table_value(hint)) is not None:
        return f"a table of name = value, each value {_expected(value)}"
    if (item := _tuple_item(hint)) is not None:
        return f"an array, each item {_expected(item)}"
    if (inner := _optional(hint)) is not None:
        return _expected(inner)
    return _EXPECTED[hint]


# --- reading values ------------------------------------------------------------------------------


def _from_toml(raw: object, hint: Any, base_dir: Path | None) -> object:
    """Check a TOML value against a field type and convert it.

    ``""`` becomes None where None is allowed, lists become tuples, tables sorted tuples of
    ``(name, value)`` pairs, integers floats where a float is expected, and strings paths
    (relative ones resolved against ``base_dir``) or addresses.
    """
    if (inner := _optional(hint)) is not None:
        return None if raw is None or raw == "" else _from_toml(raw, inner, base_dir)
    if (literals := _literals(hint)) is not None:
        if isinstance(raw, str) and raw in literals:
            return raw
        raise _Invalid(f"expected {_expected(hint)}")
    if (members := _alternatives(hint)) is not None:
        for member in members:
            try:
                return _from_toml(raw, member, base_dir)
            except _Invalid:
                pass
        raise _Invalid(f"expected {_expected(hint)}")
    if (value := _table_value(hint)) is not None:
        if not isinstance(raw, dict):
            raise _Invalid(f"expected {_expected(hint)}")
        pairs = []
        for name, x in sorted(raw.items()):
            try:
                pairs.append((name, _from_toml(x, value, base_dir)))
            except _Invalid as e:
                raise _Invalid(f"entry {name!r} ({x!r}): {e}") from None
        return tuple(pairs)
    if (item := _tuple_item(hint)) is not None:
        if not isinstance(raw, list):
            raise _Invalid(f"expected {_expected(hint)}")
        converted = []
        for i, x in enumerate(raw):
            try:
                converted.append(_from_toml(x, item, base_dir))
            except _Invalid as e:
                raise _Invalid(f"item {i} ({x!r}): {e}") from None
        return tuple(converted)
    if isinstance(raw, bool):  # bool is an int subclass: a bool is only ever a bool
        if hint is bool:
            return raw
    elif hint is int and isinstance(raw, int):
        return raw
    elif hint is float and isinstance(raw, int | float):
        return float(raw)
    if hint is str and isinstance(raw, str):
        return raw
    if hint is Path and isinstance(raw, str) and raw:
        # base_dir / "/abs/path" is "/abs/path": only relative paths move.
        return Path(raw) if base_dir is None else base_dir / raw
    if hint is Address and isinstance(raw, str):
        try:
            return Address.parse(raw)
        except ConfigurationError:
            pass
    raise _Invalid(f"expected {_expected(hint)}")


_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


def _from_text(text: str, hint: Any) -> object:
    """An environment variable's text as the TOML value it stands for."""
    if (inner := _optional(hint)) is not None:
        return None if text == "" else _from_text(text, inner)
    if (members := _alternatives(hint)) is not None:
        for member in members:
            try:
                raw = _from_text(text, member)
                _from_toml(raw, member, None)  # the first member the text is a value of wins
                return raw
            except _Invalid:
                pass
        raise _Invalid(f"expected {_expected(hint)}")
    if (value := _table_value(hint)) is not None:
        table: dict[str, object] = {}
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            name, equals, x = (part.strip() for part in entry.partition("="))
            if not equals or not name:
                raise _Invalid(f"entry {entry!r}: expected name=value, e.g. a=1,b=2")
            if name in table:
                raise _Invalid(f"entry {entry!r}: {name!r} is given twice")
            try:
                table[name] = _from_text(x, value)
            except _Invalid as e:
                raise _Invalid(f"entry {name!r} ({x!r}): {e}") from None
        return table
    if (item := _tuple_item(hint)) is not None:
        return [_from_text(part.strip(), item) for part in text.split(",") if part.strip()]
    try:
        if hint is bool:
            word = text.strip().lower()
            if word not in _TRUE | _FALSE:
                raise _Invalid("expected true/false, 1/0 or yes/no")
            return word in _TRUE
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        raise _Invalid(f"expected {_expected(hint)}") from None
    return text


# --- writing TOML --------------------------------------------------------------------------------


def _toml_lines(obj: object, prefix: str) -> list[str]:
    """``obj``'s plain fields as ``key = value`` lines, then its nested classes as tables.

    None is left out when it is the default; otherwise it is written as ``""``, which ``load``
    reads as None.
    """
    lines: list[str] = []
    tables: list[str] = []
    for field, hint in _fields(type(obj)):
        name, value = field.name, getattr(obj, field.name)
        if value is None:
            if field.default is not None:
                lines.append(f'{name} = ""')
        elif attrs.has(type(value)):
            tables += ["", f"[{prefix}{name}]", *_toml_lines(value, f"{prefix}{name}.")]
        elif _table_value(_optional(hint) or hint) is not None:
            entries = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value]
            tables += ["", f"[{prefix}{name}]", *entries]
        else:
            lines.append(f"{name} = {_toml_value(value)}")
    return lines + tables


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _toml_string(name)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # Python's int and float reprs are valid TOML, inf and nan included.
    if isinstance(value, str | Path | Address):
        return _toml_string(str(value))
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} of type {type(value).__name__} as TOML")


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    escaped = "".join(
        f"\\{c}" if c in '"\\' else f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c
        for c in text
    )
    return f'"{escaped}"'
