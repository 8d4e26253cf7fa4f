"""OpenTelemetry tracing of entity messages: the optional extra ``p2pshard[otel]``.

Theory of operation. When the application configured an OpenTelemetry SDK (a tracer provider
other than the API's no-op one, found when an entity type starts, or one passed to ``open_node``),
a region gets a :class:`Tracing`; otherwise it gets None and its entity references send with the
plain ``tell``/``ask``, so that nothing here runs per message and the envelope carries no trace
field (it is left out of the frame while None: not one byte).

With a :class:`Tracing`, a ``tell`` or ``ask`` made while a recording span is current opens a
short span of its own ("tell Counter", kind PRODUCER; "ask Counter", kind CLIENT, until the answer
comes) and the message travels as :class:`Traced`, the message with that span's context. On this
node the context goes along as it is; to another node as the text carrier OpenTelemetry's
configured propagator writes (W3C ``traceparent`` and ``tracestate`` by default) in the
envelope's ``trace`` field. The entity's ``receive`` then runs inside a span that is a child of
the sender's ("process Counter", kind CONSUMER for a tell, SERVER for an ask), on whichever node
the entity lives, even when the message waited in a buffer or was passed on during a hand-off.
A message sent outside a recording span travels untraced: tracing follows the application's
traces, it starts none.

Names and attributes follow OpenTelemetry's messaging conventions: ``messaging.system`` is
``p2pshard``, the destination is the entity type and its partition the shard. Spans carry the
entity id (``p2pshard.entity.id``): spans are per message and sampled, unlike metrics, whose
labels never hold one. The API is imported only here and only when a region starts, so p2pshard
imports and runs without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final, cast

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

INSTRUMENTATION: Final = "p2pshard"
"""The instrumentation scope name of p2pshard's tracer."""

SYSTEM: Final = "p2pshard"
"""``messaging.system`` of every span."""

ENTITY_ID: Final = "p2pshard.entity.id"
"""The attribute naming the entity a span's message is for."""


class Traced:
    """A message travelling with its sender's trace context (only when tracing is on).

    ``parent`` is an OpenTelemetry ``Context`` for a message sent on this node, or the text
    carrier (a dict of str) that came with it from another node.
    """

    __slots__ = ("message", "parent")

    def __init__(self, message: object, parent: object) -> None:
        self.message = message
        self.parent = parent

    def carrier(self) -> dict[str, str] | None:
        """The trace context as the envelope carries it to another node."""
        return carrier_of(self.parent)


def carrier_of(parent: object) -> dict[str, str] | None:
    """``parent`` (a ``Context``, or a carrier that came from another node) as a text carrier.

    None when the propagator writes nothing (the application configured none).
    """
    if type(parent) is dict:
        return parent
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=cast("Context", parent))
    return carrier or None


def _parent_context(parent: object) -> Context:
    if type(parent) is not dict:
        return cast("Context", parent)
    from opentelemetry import propagate

    # Another node's values: only strings go to the propagator (a bad one makes no parent).
    carrier = {k: v for k, v in parent.items() if type(k) is str and type(v) is str}
    return propagate.extract(carrier)


class Tracing:
    """Starts the spans of one entity type's messages on this node (see the module docstring)."""

    __slots__ = ("_current_span", "_process", "_send", "_tracer", "_type_name", "_use_span")

    def __init__(self, tracer: Tracer, type_name: str) -> None:
        from opentelemetry import trace

        self._tracer = tracer
        self._type_name = type_name
        self._current_span = trace.get_current_span
        self._use_span = trace.use_span
        self._send = {
            "tell": (f"tell {type_name}", trace.SpanKind.PRODUCER),
            "ask": (f"ask {type_name}", trace.SpanKind.CLIENT),
        }
        self._process = {
            False: trace.SpanKind.CONSUMER,
            True: trace.SpanKind.SERVER,
        }

    def _attributes(self, operation: str, shard_id: str, entity_id: str) -> dict[str, str]:
        return {
            "messaging.system": SYSTEM,
            "messaging.operation.type": "send" if operation != "process" else "process",
            "messaging.operation.name": operation,
            "messaging.destination.name": self._type_name,
            "messaging.destination.partition.id": shard_id,
            ENTITY_ID: entity_id,
        }

    def recording(self) -> bool:
        """Whether the current span records: only then is a message sent traced."""
        return self._current_span().is_recording()

    def start_send(self, operation: str, shard_id: str, entity_id: str) -> Span:
        """The span of a ``tell`` or ``ask`` (``operation``), made in a recording span."""
        name, kind = self._send[operation]
        return self._tracer.start_span(
            name, kind=kind, attributes=self._attributes(operation, shard_id, entity_id)
        )

    @contextmanager
    def sending(self, span: Span) -> Iterator[Context]:
        """Make ``span`` current until the block ends, then end it; yields its context.

        An exception out of the block is recorded on the span, which is then marked as failed.
        """
        from opentelemetry import context

        with self._use_span(span, end_on_exit=True):
            yield context.get_current()

    @contextmanager
    def processing(
        self, parent: object, shard_id: str, entity_id: str, *, ask: bool
    ) -> Iterator[Span]:
        """The span an entity's ``receive`` runs in: a child of ``parent`` (see :class:`Traced`).

        An exception out of the block is recorded on the span, which is then marked as failed.
        """
        with self._tracer.start_as_current_span(
            f"process {self._type_name}",
            context=_parent_context(parent),
            kind=self._process[ask],
            attributes=self._attributes("process", shard_id, entity_id),
        ) as span:
            yield span


def tracing_for(provider: object | None, type_name: str) -> Tracing | None:
    """The tracing of entity type ``type_name``, or None when tracing is off.

    ``provider`` is the tracer provider ``open_node`` was given; None means the one
    OpenTelemetry's API has (``opentelemetry.trace.set_tracer_provider``). Off when the API is
    not installed, or the provider is the API's no-op one (no SDK configured).
    """
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    if provider is None:
        provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    if not isinstance(provider, trace.TracerProvider):
        raise TypeError(
            "tracer_provider must be an OpenTelemetry TracerProvider, not "
            f"{type(provider).__name__}"
        )
    return Tracing(provider.get_tracer(INSTRUMENTATION, _version()), type_name)


def _version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("p2pshard")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return None
