"""The proxy's own spans for OTLP/gRPC export: a slotted record per span, encoded straight to
OTLP bytes by ``otlp`` in the export thread (``otel`` uses them only when tracing is on, the
export is OTLP over gRPC and sampling was decided before the span, see ``otel.OtelTracer``).

An OpenTelemetry SDK span costs ~20 µs to start and ~17 µs to end and encode in the proxy
(validated attribute dicts, the sampler, span processors, locks, a context object per span):
at 1 % sampling in batch mode the sampled few cost more than the goal allows for all
(bench/README.md's bench_tracing paragraph). ``ProxyTracer.start_span`` takes the SDK
tracer's arguments and returns a ``ProxySpan``, an ``opentelemetry.trace.Span``, so the
process, attempt, write and batch spans are made by the same code either way. What the SDK
would add is done here too: the span limits (``SpanLimits``, from the ``OTEL_*_LIMIT``
variables: attributes, events and links beyond them are dropped and counted), a parent's
tracestate carried over, random ids; what it would not do for these spans (a sampler: every
span here is sampled; other processors) is not needed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
)
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes, AttributeValue

from .core.tracecontext import format_traceparent
from .otlp import Encoded, Event, LinkTo, span_bytes

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class ProxySpan(Span):
    """One span of the proxy's, sampled, recording until ``end``."""

    __slots__ = (
        "_context",
        "_tracer",
        "attributes",
        "dropped_attributes",
        "dropped_events",
        "dropped_links",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent_id",
        "remote_parent",
        "span_id",
        "start_time",
        "status_code",
        "status_text",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        tracer: ProxyTracer,
        name: str,
        kind: SpanKind,
        trace_id: int,
        trace_state: TraceState | None,
        parent_id: int | None,
        remote_parent: bool,
        attributes: dict[str, Any],
    ) -> None:
        self._tracer = tracer
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = random.getrandbits(64) or 1
        self.trace_state = trace_state
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.attributes = attributes
        self.dropped_attributes = 0
        self.events: list[Event] = []
        self.dropped_events = 0
        self.links: Sequence[LinkTo] = ()
        self.dropped_links = 0
        self.status_code = 0
        self.status_text: str | None = None
        self._context: SpanContext | None = None
        self.end_time = 0
        self.start_time = time.time_ns()

    def traceparent(self) -> str:
        """Its context as a W3C ``traceparent`` (sampled: every span here is)."""
        return format_traceparent(self.trace_id, self.span_id, 1)

    def get_span_context(self) -> SpanContext:
        context = self._context
        if context is None:
            context = self._context = SpanContext(
                self.trace_id, self.span_id, False, _SAMPLED, self.trace_state
            )
        return context

    def is_recording(self) -> bool:
        return not self.end_time

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        if self.end_time:
            return
        tracer = self._tracer
        attributes = self.attributes
        if key in attributes:
            del attributes[key]  # (set again: now the newest, as in the SDK)
        elif len(attributes) >= tracer.max_attributes:  # full: the oldest makes room
            self.dropped_attributes += 1
            if not attributes:
                return
            del attributes[next(iter(attributes))]
        attributes[key] = _cut(value, tracer.max_span_length)

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Attributes = None, timestamp: int | None = None
    ) -> None:
        if self.end_time:
            return
        tracer = self._tracer
        events = self.events
        if len(events) >= tracer.max_events:  # full: the oldest makes room
            self.dropped_events += 1
            if not events:
                return
            del events[0]
        kept, dropped = _bounded(attributes, tracer.max_event_attributes, tracer.max_length)
        events.append((timestamp or time.time_ns(), name, kept, dropped))

    def update_name(self, name: str) -> None:
        if not self.end_time:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if self.end_time:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if self.status_code == StatusCode.OK.value:  # OK is final, as in the SDK
            return
        self.status_code = status.status_code.value
        self.status_text = status.description

    def record_exception(
        self,
        exception: BaseException,
        attributes: Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        self.add_event(
            "exception",
            {
                "exception.type": type(exception).__name__,
                "exception.message": str(exception),
                "exception.escaped": escaped,
                **(attributes or {}),
            },
            timestamp,
        )

    def end(self, end_time: int | None = None) -> None:
        if self.end_time:
            return
        self.end_time = end_time or time.time_ns()
        self._tracer.ended(self)

    def encoded(self) -> bytes:
        """The OTLP ``Span`` message of this ended span."""
        return span_bytes(
            self.trace_id,
            self.span_id,
            self.trace_state,
            self.parent_id,
            self.remote_parent,
            self.name,
            self.kind.value,
            self.start_time,
            self.end_time,
            self.attributes,
            self.dropped_attributes,
            self.events,
            self.dropped_events,
            self.links,
            self.dropped_links,
            self.status_code,
            self.status_text,
        )


class ProxyTracer:
    """Makes ``ProxySpan``s (the SDK tracer's ``start_span``) and hands each ended one, with
    its encoder, to ``sink`` (``otel.EncodedBatches.defer``)."""

    def __init__(
        self,
        resource: Any,
        scope: InstrumentationScope,
        sink: Callable[[Any, Callable[[Any], Encoded]], None],
        limits: SpanLimits | None = None,
    ) -> None:
        limits = limits or SpanLimits()
        self.max_attributes: int = _limit(limits.max_span_attributes)
        self.max_events: int = _limit(limits.max_events)
        self.max_event_attributes: int = _limit(limits.max_event_attributes)
        self.max_links: int = _limit(limits.max_links)
        self.max_link_attributes: int = _limit(limits.max_link_attributes)
        self.max_span_length: int | None = limits.max_span_attribute_length
        self.max_length: int | None = limits.max_attribute_length
        self._resource = resource
        self._scope = scope
        self._sink = sink

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Attributes = None,
        links: Sequence[Link] | None = (),
    ) -> ProxySpan:
        """A new span, the child of the span in ``context`` (a root without one)."""
        parent = get_current_span(context) if context else None
        parent_id: int | None = None
        remote = False
        trace_state: TraceState | None = None
        if isinstance(parent, ProxySpan):
            trace_id, parent_id, trace_state = parent.trace_id, parent.span_id, parent.trace_state
        elif parent is not None and (parent_context := parent.get_span_context()).is_valid:
            trace_id, parent_id = parent_context.trace_id, parent_context.span_id
            trace_state, remote = parent_context.trace_state or None, parent_context.is_remote
        else:
            trace_id = random.getrandbits(128) or 1
        span = ProxySpan(self, name, kind, trace_id, trace_state, parent_id, remote, {})
        kept, dropped = _bounded(attributes, self.max_attributes, self.max_span_length)
        if kept:
            span.attributes = kept
        span.dropped_attributes = dropped
        if links:
            valid = [link for link in links if link.context.is_valid]
            kept_links: list[LinkTo] = []
            for link in valid[len(valid) - min(len(valid), self.max_links) :]:  # the newest
                linked = link.context
                attributes, dropped = _bounded(
                    link.attributes, self.max_link_attributes, self.max_length
                )
                kept_links.append(
                    (linked.trace_id, linked.span_id, linked.is_remote, attributes, dropped)
                )
            span.links = kept_links
            span.dropped_links = len(valid) - len(kept_links)
        return span

    def root_span(
        self,
        name: str,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: Sequence[tuple[int, int]] = (),
    ) -> ProxySpan:
        """``start_span`` of a new root (no context) linked to ``links`` (trace id, span id:
        the proxy's own spans), with no OpenTelemetry object made: what a sampled message and
        a batch call cost on the event loop, most of it in batch mode at 1 % (there, the code
        runs cold, between a hundred messages' worth of other work). ``attributes`` is taken
        as it is (the caller's own, fresh dict) when it is within the limits."""
        span = ProxySpan(self, name, kind, random.getrandbits(128) or 1, None, None, False, {})
        if len(attributes) <= self.max_attributes and self.max_span_length is None:
            span.attributes = attributes
        else:
            kept, span.dropped_attributes = _bounded(
                attributes, self.max_attributes, self.max_span_length
            )
            if kept:
                span.attributes = kept
        if links:
            kept_links = links[len(links) - min(len(links), self.max_links) :]  # the newest
            span.links = [(trace, linked, False, None, 0) for trace, linked in kept_links]
            span.dropped_links = len(links) - len(kept_links)
        return span

    def ended(self, span: ProxySpan) -> None:
        self._sink(span, self._encode)

    def defer(self, record: Any) -> None:
        """Queue ``record``, whose ``encoded(tracer)`` writes its ended span's bytes in the
        export thread (a span the event loop did not make: ``otel._OwnProcess``,
        ``otel._OwnCall``)."""
        self._sink(record, self._encode_record)

    def _encode_record(self, record: Any) -> Encoded:
        return (self._resource, self._scope, record.encoded(self))

    def _encode(self, span: ProxySpan) -> Encoded:
        return (self._resource, self._scope, span.encoded())


def _cut(value: Any, length: int | None) -> Any:
    """``value`` cut to the attribute length limit (text and bytes, as the SDK cuts them)."""
    if length is not None and isinstance(value, str | bytes):
        return value[:length]
    return value


def _bounded(
    attributes: Attributes, limit: int, length: int | None
) -> tuple[dict[str, Any] | None, int]:
    """The newest ``limit`` of ``attributes`` (values cut to ``length``), and how many were
    dropped, as the SDK bounds them."""
    if not attributes:
        return None, 0
    if length is None and len(attributes) <= limit:
        return dict(attributes), 0
    items = list(attributes.items())
    kept = {key: _cut(value, length) for key, value in items[len(items) - min(len(items), limit) :]}
    return kept, len(attributes) - len(kept)


def _limit(value: int | None) -> int:
    return (1 << 31) if value is None else value
