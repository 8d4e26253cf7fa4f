"""Bootstrap by DNS: the trio shell around :class:`BootstrapCore` (``[discovery] method = "dns"``).

Theory of operation: :func:`bootstrap` runs in the node's nursery from its start until it has
decided. One task looks ``service_name`` up every ``resolve_interval`` with dnspython's
asynchronous resolver on its trio backend (A and AAAA records at the contact port, or SRV
records with their targets' addresses, sent along or looked up in turn; a record that leads
nowhere, its target ``.``, without an address or at port 0, is skipped and logged once), each
lookup bounded in time; the
other feeds the lookups and the contact points' answers to the core, sends the probes it asks
for through the cluster (InitJoin), and carries out its one decision: ``Cluster.join_seed_nodes``
to join, or ``Cluster.join`` of this node's own address to form. A name that does not exist
(NXDOMAIN) or has no records is an empty set of contact points; a timeout or an unreachable
server is no answer at all, logged once (and once more when it answers again), and asked again
next round: the node never stops for DNS. See ``p2pshard._bootstrap`` for the rules.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable

import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdataclass
import dns.rdatatype
import dns.resolver
import trio

from membership import Address, Cluster, UniqueAddress

from ._bootstrap import BootstrapCore, FormCluster, JoinSeedNodes, Probe
from ._config import DiscoverySettings

logger = logging.getLogger("p2pshard.discovery")

LOOKUP_LIFETIME = 5.0
"""Seconds one lookup (every query of it, retries included) may take before it counts as failed."""

WAITING_LOG_INTERVAL = 10.0
"""Seconds between the log lines that say why the node has neither joined nor formed yet."""

Lookup = Callable[[], Awaitable[frozenset[Address]]]
"""A lookup of the contact points: the set found, or :class:`LookupFailed`."""


class LookupFailed(Exception):
    """A lookup got no answer (timeout, unreachable or failing server); the message says which."""


def _resolver(settings: DiscoverySettings) -> dns.asyncresolver.Resolver:
    if settings.nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(ip, port) for ip, port in settings.nameserver_addresses
        ]
    else:
        try:
            resolver = dns.asyncresolver.Resolver()
        except dns.resolver.NoResolverConfiguration as exc:
            raise LookupFailed(
                f"the system has no DNS configuration ({exc}); set [discovery] nameservers"
            ) from None
    resolver.lifetime = LOOKUP_LIFETIME
    resolver.timeout = min(2.0, LOOKUP_LIFETIME)
    return resolver


def _ip_text(address: str) -> str:
    """``address`` in one spelling: IPv6 short, an IPv4-mapped IPv6 address as its IPv4 one."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


async def _addresses(resolver: dns.asyncresolver.Resolver, name: dns.name.Name | str) -> set[str]:
    """The IPv4 and IPv6 addresses of ``name``: A and AAAA records (none if it has none).

    One family failing does not fail the lookup when the other gave addresses: a server that
    knows only the A records of a name may refuse its AAAA question (a small local server with
    no upstream does).
    """
    found: set[str] = set()
    failed: dns.exception.DNSException | None = None
    backend = dns.asyncbackend.get_backend("trio")
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        try:
            answer = await resolver.resolve(name, rdtype, backend=backend)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except dns.exception.DNSException as exc:
            failed = failed or exc
            continue
        found |= {_ip_text(record.address) for record in answer}
    if failed is not None and not found:
        raise failed
    return found


def _additional_addresses(answer: dns.resolver.Answer) -> dict[dns.name.Name, set[str]]:
    """The addresses the server sent along with SRV records, by name (its additional section).

    A server that knows the targets' addresses (a Kubernetes cluster's DNS does) sends them
    with the SRV records: taking them from there saves two questions per target, which for a
    few hundred records is most of the lookup's time.
    """
    found: dict[dns.name.Name, set[str]] = {}
    for rrset in answer.response.additional:
        if rrset.rdclass == dns.rdataclass.IN and rrset.rdtype in (
            dns.rdatatype.A,
            dns.rdatatype.AAAA,
        ):
            found.setdefault(rrset.name, set()).update(_ip_text(r.address) for r in rrset)
    return found


def dns_lookup(settings: DiscoverySettings, default_port: int) -> Lookup:
    """A lookup of ``settings.service_name`` as ``settings.lookup`` says (A/AAAA or SRV).

    ``default_port`` is the port of A/AAAA contact points when ``contact_port`` is 0. A name
    that does not exist or has no records gives no contact points. Of SRV records, one whose
    target is ``.`` (the service is not available there), whose port is 0, or whose target has
    no address (does not exist, or has no A or AAAA record) is skipped, and logged once (again
    only after a lookup without it); a target whose lookup *fails* fails the whole lookup, as a
    set found without it could make this node believe it has the lowest address. A target's
    addresses come from the SRV answer's additional section when the server sent them there
    (as Akka does), else from its own A and AAAA lookups. Each answer is bounded by the size
    of a DNS message (64 KiB: some 4000 A records), and a whole lookup in time
    (``LOOKUP_LIFETIME`` and a second); duplicate records give one contact point.

    Example::

        lookup = dns_lookup(DiscoverySettings(method="dns", service_name="p2pshard.svc"), 25520)
        contact_points = await lookup()  # frozenset of Address, or LookupFailed
    """
    name = settings.service_name
    asked = f"{'SRV' if settings.lookup == 'srv' else 'A/AAAA'} records of {name!r}"
    servers = ", ".join(settings.nameservers) or "the system's DNS servers"
    backend = dns.asyncbackend.get_backend("trio")
    reported: set[str] = set()  # the SRV records the last lookup skipped, logged already

    async def srv(resolver: dns.asyncresolver.Resolver) -> frozenset[Address]:
        try:
            answer = await resolver.resolve(name, dns.rdatatype.SRV, backend=backend)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            reported.clear()
            return frozenset()
        found: set[Address] = set()
        skipped: dict[str, str] = {}
        resolved = _additional_addresses(answer)  # and each target asked at most once
        for record in answer:
            target = record.target.to_text(omit_final_dot=True)
            which = f"SRV record {target}:{record.port} of {name!r}"
            if record.target == dns.name.root:
                skipped[which] = "its target '.' says the service is not available there"
                continue
            if record.port == 0:
                skipped[which] = "port 0 is no port a node listens on"
                continue
            if record.target not in resolved:
                resolved[record.target] = await _addresses(resolver, record.target)
            if resolved[record.target]:
                found |= {Address(ip, record.port) for ip in resolved[record.target]}
            else:
                skipped[which] = f"{target} does not exist or has no A or AAAA record"
        for which, why in skipped.items():
            if which not in reported:
                logger.warning("%s skipped: %s", which, why)
        reported.clear()
        reported.update(skipped)
        return frozenset(found)

    async def lookup() -> frozenset[Address]:
        try:
            with trio.fail_after(LOOKUP_LIFETIME + 1.0):
                resolver = _resolver(settings)
                if settings.lookup == "srv":
                    return await srv(resolver)
                port = settings.contact_port or default_port
                return frozenset(Address(ip, port) for ip in await _addresses(resolver, name))
        except (trio.TooSlowError, dns.exception.Timeout):
            # Not the timeout's own text: it holds the seconds it took, different every time,
            # and the shell logs a failure again only when its text changes.
            raise LookupFailed(
                f"{asked} from {servers}: no answer within {LOOKUP_LIFETIME:g} s"
            ) from None
        except (dns.exception.DNSException, OSError) as exc:
            raise LookupFailed(f"{asked} from {servers}: {exc}") from None

    return lookup


async def bootstrap(
    settings: DiscoverySettings,
    cluster: Cluster,
    *,
    lookup: Lookup | None = None,
) -> None:
    """Find the cluster by discovery and join it, or form it; return once that is decided.

    Args:
        settings: the ``[discovery]`` table (``method = "dns"``).
        cluster: this node's cluster, opened without seed nodes and not yet told to join.
        lookup: how to find the contact points (default: :func:`dns_lookup` of ``settings``
            at this node's own port); tests pass their own.
    """
    own = cluster.self_address.address
    if lookup is None:
        lookup = dns_lookup(settings, own.port)
    core = BootstrapCore(
        own,
        required_contact_points=settings.required_contact_points,
        stable_margin=settings.stable_margin,
        probe_interval=settings.resolve_interval,
        new_cluster_enabled=settings.new_cluster_enabled,
    )
    send, receive = trio.open_memory_channel[frozenset[Address] | tuple[Address, bool]](256)

    def on_answer(sender: UniqueAddress, is_member: bool) -> None:
        # Answers come once per probe round: a full queue means the next round is due anyway.
        with contextlib.suppress(trio.WouldBlock):
            send.send_nowait((sender.address, is_member))

    logger.info(
        "%s: looking for the cluster by DNS (%s records of %r); %d contact points needed to form",
        own,
        settings.lookup.upper(),
        settings.service_name,
        settings.required_contact_points,
    )
    cluster.on_probe_answer(on_answer)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_look_up_forever, lookup, settings.resolve_interval, send)
            await _decide(core, cluster, receive)
            nursery.cancel_scope.cancel()
    finally:
        cluster.on_probe_answer(None)


async def _look_up_forever(
    lookup: Lookup,
    interval: float,
    send: trio.MemorySendChannel[frozenset[Address] | tuple[Address, bool]],
) -> None:
    failing: str | None = None
    while True:
        started = trio.current_time()
        try:
            found = await lookup()
        except LookupFailed as exc:
            if str(exc) != failing:
                logger.warning("DNS lookup failed, asking again every %g s: %s", interval, exc)
            failing = str(exc)
        else:
            if failing is not None:
                logger.info("DNS lookup answers again")
                failing = None
            await send.send(found)
        await trio.sleep_until(started + interval)


async def _decide(
    core: BootstrapCore,
    cluster: Cluster,
    receive: trio.MemoryReceiveChannel[frozenset[Address] | tuple[Address, bool]],
) -> None:
    own = cluster.self_address.address
    found: tuple[Address, ...] | None = None
    next_report = trio.current_time() + WAITING_LOG_INTERVAL
    while core.decision is None:
        item: frozenset[Address] | tuple[Address, bool] | None = None
        with trio.move_on_at(min(core.next_deadline(), next_report)):
            item = await receive.receive()
        now = trio.current_time()
        if isinstance(item, frozenset):
            effects = core.discovered(item, now)
            if core.contact_points != found:
                found = core.contact_points
                logger.info(
                    "%s: contact points found: %s", own, ", ".join(map(str, found)) or "none"
                )
        elif item is not None:
            effects = core.answered(item[0], item[1], now)
        else:
            effects = core.tick(now)
        for effect in effects:
            match effect:
                case Probe(contact_point=address):
                    cluster.probe(address)
                case JoinSeedNodes(seed_nodes=seeds):
                    logger.info(
                        "%s: a contact point is a member of a cluster; joining through %s",
                        own,
                        ", ".join(map(str, seeds)),
                    )
                    cluster.join_seed_nodes(seeds)
                case FormCluster(contact_points=points):
                    logger.info(
                        "%s: no contact point is a member and this node has the lowest address "
                        "of %s; forming a new cluster",
                        own,
                        ", ".join(map(str, points)),
                    )
                    cluster.join(own)
        if core.decision is None and now >= next_report:
            next_report = now + WAITING_LOG_INTERVAL
            logger.info("%s: not joined yet: %s", own, core.waiting_for(now))
