"""OpenTelemetry tracing of entity messages (``p2pshard[otel]``), across two real nodes.

The nodes run in the test's own trio run, over TCP with mutual TLS on 127.0.0.1 (the
configurations of ``test_cli_status``), each with a tracer provider of its own that exports to
memory: what node 1 records is the sender's side, what node 2 records the side of the entities
that live there. The global tracer provider is never set (it can be set once per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import ClassVar, NamedTuple

import msgpack
import pytest
import trio
import trio.testing
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanContext, SpanKind, StatusCode, Tracer

from membership import Address, MemberStatus, SimNetwork
from membership.internal import wire
from p2pshard import (
    EntityContext,
    EntityId,
    HashExtractor,
    Node,
    NodeConfig,
    RemoteEntityError,
    ShardId,
    ShardRegion,
    TlsFiles,
)
from p2pshard._node import open_node
from p2pshard._tracing import ENTITY_ID, tracing_for
from p2pshard.sharding._outbox import Outbox
from p2pshard.sharding._protocol import EntityDeliveries, unchecked_delivery
from tests.p2pshard.test_cli_status import prepare

LIMIT = 30.0
TLS = TlsFiles(
    ca_file=Path("unused-ca.pem"), cert_file=Path("unused.pem"), key_file=Path("unused.key")
)
EXTRACTOR = HashExtractor(10)
ROOT = Path(__file__).resolve().parents[2]


class Probe:
    """Records the span current while it handles each message; an ask answers its span id."""

    seen: ClassVar[list[tuple[str, object, SpanContext]]] = []

    def __init__(self, ctx: EntityContext) -> None:
        pass

    async def receive(self, msg: object, ctx: EntityContext) -> object:
        context = trace.get_current_span().get_span_context()
        Probe.seen.append((ctx.entity_id, msg, context))
        return context.span_id


@asynccontextmanager
async def traced_nodes(
    configs: Sequence[Path], providers: Sequence[TracerProvider]
) -> AsyncIterator[list[Node]]:
    """A node per config, each tracing with its provider; yield once every node sees all Up."""
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                open_node(NodeConfig.load(path, environ={}), tracer_provider=provider)
            )
            for path, provider in zip(configs, providers, strict=True)
        ]
        while not all(  # noqa: ASYNC110 - polls several nodes' views
            len(node.cluster.members) == len(nodes)
            and all(m.status is MemberStatus.UP for m in node.cluster.members)
            for node in nodes
        ):
            await trio.sleep(0.05)
        yield nodes


class ProbePair(NamedTuple):
    """Two traced nodes running the Probe type, the first node's region, and the spans."""

    nodes: list[Node]
    sender: ShardRegion
    exporter1: InMemorySpanExporter
    exporter2: InMemorySpanExporter
    app: Tracer


@asynccontextmanager
async def probe_pair(tmp_path: Path) -> AsyncIterator[ProbePair]:
    """Two nodes, each recording its spans, with Probe started on both, within ``LIMIT``."""
    configs = prepare(tmp_path, 2)
    (provider1, exporter1), (provider2, exporter2) = recording(), recording()
    Probe.seen = []
    async with traced_nodes(configs, [provider1, provider2]) as nodes:
        with trio.fail_after(LIMIT):
            regions = [
                await node.sharding.start("Probe", Probe, extractor=EXTRACTOR) for node in nodes
            ]
            app = provider1.get_tracer("tests.tracing")
            yield ProbePair(list(nodes), regions[0], exporter1, exporter2, app)


def recording() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def shard_of(entity_id: str) -> ShardId:
    return EXTRACTOR.shard_id(EntityId(entity_id))


def home_of(region: ShardRegion, entity_id: str) -> object:
    return region.shard_homes().get(shard_of(entity_id))


def attribute(span: ReadableSpan, key: str) -> object:
    assert span.attributes is not None
    return span.attributes.get(key)


def by_id(spans: Sequence[ReadableSpan]) -> dict[int, ReadableSpan]:
    return {span.context.span_id: span for span in spans}


def parent_id(span: ReadableSpan) -> int:
    assert span.parent is not None, f"{span.name} has no parent"
    return int(span.parent.span_id)


async def test_the_entity_span_is_the_child_of_the_senders_across_two_nodes(
    tmp_path: Path,
) -> None:
    async with probe_pair(tmp_path) as (nodes, sender, exporter1, exporter2, app):
        cold = [f"cold-{i}" for i in range(20)]
        # Asks to shards with no home yet: each waits in the region's buffer, then goes to
        # whichever node the coordinator picks, with its context.
        asked: dict[str, int] = {}
        for entity_id in cold:
            with app.start_as_current_span(f"app ask {entity_id}") as app_span:
                answer = await sender.entity_ref(entity_id).ask("hello", timeout=10)
                asked[entity_id] = app_span.get_span_context().span_id
            assert isinstance(answer, int)
        remote = [e for e in cold if home_of(sender, e) == nodes[1].address]
        local = [e for e in cold if home_of(sender, e) == nodes[0].address]
        assert remote, "the coordinator gave every shard to node 1"
        assert local, "the coordinator gave every shard to node 2"
        # Tells to shards whose home is known: straight to the entity's node.
        told: dict[str, int] = {}
        for entity_id in cold:
            with app.start_as_current_span(f"app tell {entity_id}") as app_span:
                await sender.entity_ref(entity_id).tell("tell")
                told[entity_id] = app_span.get_span_context().span_id
        while len(Probe.seen) < 2 * len(cold):  # noqa: ASYNC110 - the entities' own record
            await trio.sleep(0.01)

    sent = by_id(exporter1.get_finished_spans())
    processed = [s for s in exporter1.get_finished_spans() if s.name == "process Probe"]
    processed_remote = [s for s in exporter2.get_finished_spans() if s.name == "process Probe"]
    assert {attribute(s, ENTITY_ID) for s in processed_remote} == set(remote)
    assert {attribute(s, ENTITY_ID) for s in processed} == set(local)
    assert len(processed) + len(processed_remote) == 2 * len(cold)
    in_receive = {(entity_id, msg): context.span_id for entity_id, msg, context in Probe.seen}
    for span in processed + processed_remote:
        traced_id = attribute(span, ENTITY_ID)
        assert isinstance(traced_id, str)
        send = sent[parent_id(span)]  # the tell or ask span on node 1
        assert send.context.trace_id == span.context.trace_id
        operation = attribute(send, "messaging.operation.name")
        expected = asked if operation == "ask" else told
        assert parent_id(send) == expected[traced_id]  # the application's span around the send
        assert send.name == f"{operation} Probe"
        assert send.kind is (SpanKind.CLIENT if operation == "ask" else SpanKind.PRODUCER)
        assert span.kind is (SpanKind.SERVER if operation == "ask" else SpanKind.CONSUMER)
        # receive ran inside the span, which ended after it
        assert in_receive[(traced_id, "hello" if operation == "ask" else "tell")] == (
            span.context.span_id
        )
        assert span.attributes == {
            "messaging.system": "p2pshard",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": "Probe",
            "messaging.destination.partition.id": shard_of(traced_id),
            ENTITY_ID: traced_id,
        }


async def test_messages_gathered_into_batches_carry_each_its_own_context(
    tmp_path: Path,
) -> None:
    async with probe_pair(tmp_path) as (nodes, sender, exporter1, exporter2, app):
        ids = [f"e-{i}" for i in range(40)]
        for entity_id in ids:  # untraced: outside any span, so nothing is recorded
            await sender.entity_ref(entity_id).ask("warm", timeout=10)
        assert exporter1.get_finished_spans() == ()
        assert exporter2.get_finished_spans() == ()
        remote = [e for e in ids if home_of(sender, e) == nodes[1].address]
        assert remote
        # Tells without a yield between them fill the link's queue: the rest are gathered.
        # Every other one is sent outside a span: a batch mixes traced and untraced ones.
        rounds = 0
        while sender.statistics().batches_sent == 0:
            rounds += 1
            assert rounds <= 20, "no tell was ever gathered into a batch"
            for n in range(200):
                entity_id = remote[n % len(remote)]
                if n % 2:
                    await sender.entity_ref(entity_id).tell(("plain", rounds, n))
                else:
                    with app.start_as_current_span(f"app {rounds} {n}"):
                        await sender.entity_ref(entity_id).tell(("traced", rounds, n))
        expected = len(ids) + 200 * rounds
        while len(Probe.seen) < expected:  # noqa: ASYNC110 - the entities' own record
            await trio.sleep(0.01)

    sent = by_id(exporter1.get_finished_spans())
    processed = [s for s in exporter2.get_finished_spans() if s.name == "process Probe"]
    assert len(processed) == 100 * rounds  # one per traced tell, none for the others
    app_of = {
        span.name: span.context.span_id
        for span in exporter1.get_finished_spans()
        if span.name.startswith("app ")
    }
    spans_in_receive = {
        msg: context.span_id for _, msg, context in Probe.seen if isinstance(msg, tuple)
    }
    for span in processed:
        send = sent[parent_id(span)]
        assert send.name == "tell Probe"
        assert send.context.trace_id == span.context.trace_id
        _, round_, n = next(
            msg for msg, span_id in spans_in_receive.items() if span_id == span.context.span_id
        )
        assert parent_id(send) == app_of[f"app {round_} {n}"]  # its own sender's, not another's
    untraced = [c for msg, c in spans_in_receive.items() if msg[0] == "plain"]
    assert untraced
    assert all(span_id == 0 for span_id in untraced)  # no span at all


class Failing:
    async def receive(self, msg: object, ctx: EntityContext) -> object:
        raise KeyError(msg)


async def test_an_entity_that_raises_marks_its_span_and_the_askers_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, exporter = recording()
    app = provider.get_tracer("tests.tracing")
    config = NodeConfig(
        cluster_name="sim",
        node_name="n1",
        bind_host="10.0.0.1",
        bind_port=1,
        tls=TLS,
        self_join=True,
    )
    async with (
        SimNetwork(seed=1).transport(Address("10.0.0.1", 1), "n1") as transport,
        open_node(config, transport=transport, tracer_provider=provider) as node,
    ):
        with trio.fail_after(LIMIT):
            await node.cluster.wait_up()
            region = await node.sharding.start(
                "Failing", lambda ctx: Failing(), extractor=EXTRACTOR
            )
            with (
                app.start_as_current_span("request"),
                pytest.raises(RemoteEntityError, match="KeyError"),
            ):
                await region.entity_ref("x").ask("boom", timeout=5)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"request", "ask Failing", "process Failing"}
    process, ask = spans["process Failing"], spans["ask Failing"]
    assert parent_id(process) == ask.context.span_id
    assert process.status.status_code is StatusCode.ERROR
    assert [event.name for event in process.events] == ["exception"]
    assert ask.status.status_code is StatusCode.ERROR  # the error came back to the asker


def test_tracing_is_off_without_an_sdk_and_with_the_no_op_provider() -> None:
    # The global provider is the API's stand-in until an application sets one.
    assert tracing_for(None, "Probe") is None
    assert tracing_for(NoOpTracerProvider(), "Probe") is None
    assert tracing_for(TracerProvider(), "Probe") is not None
    with pytest.raises(TypeError, match="must be an OpenTelemetry TracerProvider, not str"):
        tracing_for("provider", "Probe")


def test_an_untraced_envelope_is_the_one_older_nodes_send_and_read() -> None:
    # What every node sent before trace contexts existed: the six fields and nothing more.
    delivery = unchecked_delivery("Probe", "3", "e-1", "hello", 0, None)
    assert wire.encode(delivery)[wire.HEADER_SIZE :] == msgpack.packb(
        ["p2pshard.sharding.EntityDelivery", "Probe", "3", "e-1", "hello", 0, None]
    )
    batch = EntityDeliveries(type_name="Probe", entries=["3", "e-1", b"x", 0, None])
    assert wire.encode(batch)[wire.HEADER_SIZE :] == msgpack.packb(
        ["p2pshard.sharding.EntityDeliveries", "Probe", ["3", "e-1", b"x", 0, None]]
    )
    traced = unchecked_delivery("Probe", "3", "e-1", "hello", 0, None, {"traceparent": "00-x"})
    body = msgpack.unpackb(wire.encode(traced)[wire.HEADER_SIZE :])
    assert body[-1] == {"traceparent": "00-x"}
    assert wire.decode(wire.encode(traced)).message == traced


def untraced(outbox: Outbox) -> bool:
    return outbox.traces is None


def test_an_outbox_keeps_each_messages_context_through_take_and_give_back() -> None:
    outbox = Outbox()
    for n in range(4):
        outbox.entries += ("3", f"e-{n}", b"payload", 0, None)
        outbox.replies.append(None)
        outbox.size += 50
        if n >= 2 or outbox.traces is not None:
            outbox.add_trace({"traceparent": f"t{n}"} if n != 3 else None)
    assert outbox.traces == [None, None, {"traceparent": "t2"}, None]
    entries, replies, traces = outbox.take(130)  # the first two fit
    assert (len(entries), len(replies), traces) == (10, 2, [None, None])
    assert outbox.traces == [{"traceparent": "t2"}, None]
    outbox.give_back(entries, replies, traces)
    assert outbox.traces == [None, None, {"traceparent": "t2"}, None]
    assert outbox.take(1 << 20)[2] == [None, None, {"traceparent": "t2"}, None]
    assert untraced(outbox)
    # An untraced message given back ahead of traced ones gets None for its context.
    outbox.entries += ("3", "e-9", b"payload", 0, None)
    outbox.replies.append(None)
    outbox.add_trace({"traceparent": "t9"})
    outbox.give_back(["3", "e-8", b"payload", 0, None], [None], None)
    assert outbox.traces == [None, {"traceparent": "t9"}]


def test_p2pshard_runs_without_opentelemetry(tmp_path: Path) -> None:
    program = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        sys.modules["opentelemetry"] = None  # any import of it fails, as when not installed

        import trio
        from membership import Address, SimNetwork
        from p2pshard import HashExtractor, NodeConfig, TlsFiles, open_node
        from p2pshard._tracing import tracing_for

        class Echo:
            def __init__(self, ctx):
                pass

            async def receive(self, msg, ctx):
                return msg

        async def main():
            tls = TlsFiles(
                ca_file=Path("ca.pem"), cert_file=Path("n.pem"), key_file=Path("n.key")
            )
            config = NodeConfig(
                cluster_name="sim", node_name="n1", bind_host="10.0.0.1", bind_port=1,
                tls=tls, self_join=True,
            )
            async with (
                SimNetwork(seed=1).transport(Address("10.0.0.1", 1), "n1") as transport,
                open_node(config, transport=transport) as node,
            ):
                await node.cluster.wait_up()
                echo = await node.sharding.start("Echo", Echo, extractor=HashExtractor(4))
                await echo.entity_ref("a").tell("told")
                print(await echo.entity_ref("a").ask("asked", timeout=10))
                print(tracing_for(None, "Echo"))
                node.cluster.leave()

        trio.run(main)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["asked", "None"]
