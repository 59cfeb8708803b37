"""The tracing seam's OpenTelemetry implementation (``tracing.start_tracing`` imports it only
when tracing is on; it needs the ``tracing`` extra).

The SDK's ``TracerProvider`` with the standard ``OTEL_*`` variables (service name, resource
attributes, sampler), a batch processor with a bounded queue (spans beyond it are dropped and
counted, never waited for) and an OTLP exporter over gRPC or HTTP. Over gRPC the queue
(``EncodedBatches``, ``otlp``) holds an SDK span's bytes, encoded as it ends, so its objects
never outlive it into the collector's older generations, or one of the proxy's own spans (a
slotted record of a few objects), encoded by the export thread. The spans follow the
OpenTelemetry messaging and RPC semantic conventions; see ``tracing`` for which exist.

Sampling is decided before any span exists when the sampler is parent-based with a ratio for
new traces (``tracing.sample_ratio``, or ``OTEL_TRACES_SAMPLER`` unset or ``parentbased_*``):
a record whose producer did not sample it passes that context on (sampled flag off) and a new
trace is drawn at the ratio; a message not sampled then costs a random draw and no span
object (``_Unsampled``; in batch mode one ``begin_batch`` a call, and a producer's context
read without OpenTelemetry objects), which is what keeps 1 % sampling cheap in batch mode.
With any other sampler the SDK decides for every message.

Sampling decided first and export over gRPC (the default): the spans are the proxy's own
(``spans.ProxyTracer``, a slotted record each, encoded by the export thread) rather than
the SDK's, a fraction of the cost of a sampled message; the SDK still reads the
configuration, builds the resource and the exporter. Over HTTP, or with a sampler of the
SDK's, the SDK makes them.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.span import TraceState

from .config import TracingConfig
from .core.decision import Action, Decision
from .core.outcomes import Classification
from .core.partitions import Delivery
from .core.records import Origin
from .core.tracecontext import (
    TRACEPARENT,
    TRACESTATE,
    Metadata,
    format_traceparent,
    parse_traceparent,
    parse_tracestate,
    trace_headers,
    tracestate_header,
)
from .kafka_log import KafkaLogGate
from .otlp import (
    MAX_CACHED,
    Encoded,
    attribute_key,
    encode_span,
    int_attribute,
    local_link,
    name_and_kind,
    request_of,
    root_tail,
    span_attributes,
    span_head,
)
from .spans import ProxySpan, ProxyTracer

SCOPE = "consumer_proxy"
RPC_SERVICE = "consumerproxy.v1.MessageHandler"
MAX_KEY_CHARS = 256
"""A record key longer than this is not put on the span (nor one that is not UTF-8 text)."""
MAX_TEXT_CHARS = 256
"""Untrusted text (a service's reason) put on a span is cut to this many characters."""
DEFAULT_SERVICE_NAME = "consumer-proxy"
SHUTDOWN_TIMEOUT_S = 10.0
"""At shutdown, spans still queued after this long are dropped (the collector is down)."""
DROP_LOG_INTERVAL_S = 60.0
"""Dropped spans are logged at most this often (with the count since the last line)."""

log = logging.getLogger(__name__)

_ROOT = Context()
"""The empty context a root span starts from (read only: a context is never changed)."""


def _text_key(key: bytes | None) -> str | None:
    if key is None or len(key) > MAX_KEY_CHARS:
        return None
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() else None


Remote = tuple[int, int, int, list[tuple[str, str]] | None, bytes]
"""A record's W3C trace context: trace id, span id, flags, tracestate members (checked), and
the traceparent header as it came."""


def _remote(headers: Sequence[tuple[str, bytes]]) -> Remote | None:
    """The record's W3C trace context, None when it has none or a malformed one; read
    without OpenTelemetry objects (a producer's context not sampled needs none)."""
    parent, state = trace_headers(headers)
    if parent is None:
        return None
    parsed = parse_traceparent(parent)
    if parsed is None:
        return None
    # Checked here, not by TraceState.from_header, which logs a malformed member verbatim.
    return (*parsed, parse_tracestate(state) if state is not None else None, parent)


def _span_context(remote: Remote) -> SpanContext:
    trace_id, span_id, flags, members, _ = remote
    trace_state = TraceState(members) if members else None
    return SpanContext(trace_id, span_id, True, TraceFlags(flags & 0x01), trace_state)


def _metadata(context: SpanContext) -> Metadata:
    parent = format_traceparent(context.trace_id, context.span_id, context.trace_flags)
    state = context.trace_state.to_header() if context.trace_state else ""
    return ((TRACEPARENT, parent), (TRACESTATE, state)) if state else ((TRACEPARENT, parent),)


class _Unsampled:
    """A message whose trace is not sampled (``tracing.MessageTrace``): no span; its calls
    carry the record's own context, if it had one, so that the service does not sample
    either."""

    __slots__ = ("traceparent", "tracestate")
    sampled = False

    def __init__(self, traceparent: str = "", tracestate: str = "") -> None:
        self.traceparent = traceparent
        self.tracestate = tracestate

    def attempt(self, method: str, target: str, attempt: int) -> tuple[object, Metadata | None]:
        parent = self.traceparent
        if not parent:
            return None, None
        if self.tracestate:
            return None, ((TRACEPARENT, parent), (TRACESTATE, self.tracestate))
        return None, ((TRACEPARENT, parent),)

    def attempt_done(self, handle: object, result: Classification | None) -> None:
        pass

    def heartbeat(self, gap_s: float, progress: str) -> None:
        pass

    def event(self, name: str, attributes: Mapping[str, str | int | float | bool]) -> None:
        pass

    def decided(self, decision: Decision, status: str) -> None:
        pass

    def end(self, outcome: str) -> None:
        pass

    def stamped(self, headers: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        return list(headers)

    def write(self, topic: str, what: str) -> object:
        return None

    def written(self, handle: object, ok: bool) -> None:
        pass


NOT_SAMPLED = _Unsampled()
"""A new trace not sampled: nothing to pass on."""


class OtelMessage:
    """One message's process span (``tracing.MessageTrace``)."""

    __slots__ = (
        "_attempt",
        "_ctx",
        "_span",
        "_tracer",
        "_what",
        "sampled",
        "traceparent",
        "tracestate",
    )

    def __init__(self, tracer: Any, span: Span) -> None:
        self._tracer = tracer
        self._span: Span | None = span
        state: TraceState | None
        if type(span) is ProxySpan:  # (sampled, recording: started just now)
            self.sampled = True
            self.traceparent = span.traceparent()
            state = span.trace_state
        else:
            self.sampled = span.is_recording()
            context = span.get_span_context()
            self.traceparent = format_traceparent(
                context.trace_id, context.span_id, context.trace_flags
            )
            state = context.trace_state
        self.tracestate = state.to_header() if state else ""
        self._ctx: Context | None = None
        self._what = "dead_letter"
        self._attempt: Span | None = None  # the attempt under way (its heartbeats' span)

    @property
    def span(self) -> Span:
        """The process span."""
        assert self._span is not None
        return self._span

    def _context(self) -> Context:
        if self._ctx is None:
            self._ctx = set_span_in_context(self.span)
        return self._ctx

    def attempt(self, method: str, target: str, attempt: int) -> tuple[object, Metadata]:
        span = self.span
        if not span.is_recording():
            return None, _metadata(span.get_span_context())
        child = self._tracer.start_span(
            f"{RPC_SERVICE}/{method}",
            context=self._context(),
            kind=SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": RPC_SERVICE,
                "rpc.method": method,
                "server.address": target,
                "messaging.message.delivery_attempt": attempt,
            },
        )
        self._attempt = child
        return child, _metadata(child.get_span_context())

    def attempt_done(self, handle: object, result: Classification | None) -> None:
        if not isinstance(handle, Span):
            return
        if handle is self._attempt:
            self._attempt = None
        if result is None:
            handle.set_attribute("consumer_proxy.cancelled", True)
            handle.set_status(Status(StatusCode.UNSET))
        else:
            handle.set_attribute("rpc.grpc.status", result.status)
            handle.set_attribute("consumer_proxy.outcome", result.outcome.value)
            if result.status not in ("OK", "ACK"):
                handle.set_status(Status(StatusCode.ERROR, result.reason[:MAX_TEXT_CHARS]))
        handle.end()

    def heartbeat(self, gap_s: float, progress: str) -> None:
        # (the SDK keeps at most OTEL_SPAN_EVENT_COUNT_LIMIT events a span, 128 by default)
        attempt = self._attempt
        if attempt is not None:
            attributes: dict[str, str | int] = {"consumer_proxy.gap_ms": round(gap_s * 1000)}
            if progress:
                attributes["consumer_proxy.progress"] = progress[:MAX_TEXT_CHARS]
            attempt.add_event("heartbeat", attributes)

    def event(self, name: str, attributes: Mapping[str, str | int | float | bool]) -> None:
        if self.span.is_recording():
            self.span.add_event(name, attributes)

    def decided(self, decision: Decision, status: str) -> None:
        action = decision.action
        if action is Action.ACK or action is Action.DROP:
            self.end(action.value)
            return
        span = self.span
        if not span.is_recording():
            return
        if action is Action.RETRY:
            span.add_event(
                "retry" if decision.counted else "outage wait",
                {
                    "consumer_proxy.backoff_ms": round(decision.delay_s * 1000),
                    "consumer_proxy.counted": decision.counted,
                    "consumer_proxy.status": status,
                },
            )
        elif action is Action.HOLD:
            span.add_event("held by the dead-letter guard", {"consumer_proxy.status": status})
        else:  # DEAD_LETTER, TIER: the write ends the span
            attributes: dict[str, str | int] = {"consumer_proxy.status": status}
            if decision.reason:
                attributes["consumer_proxy.reason"] = decision.reason[:MAX_TEXT_CHARS]
            if action is Action.TIER:
                attributes["consumer_proxy.tier"] = decision.tier
            span.add_event(action.value, attributes)

    def end(self, outcome: str) -> None:
        span = self.span
        if span.is_recording():
            _ended_as(span, outcome)
            span.end()

    def stamped(self, headers: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        kept = [(k, v) for k, v in headers if k != TRACEPARENT and k != TRACESTATE]
        kept.append((TRACEPARENT, self.traceparent.encode("ascii")))
        if self.tracestate:
            kept.append((TRACESTATE, self.tracestate.encode("ascii")))
        return kept

    def write(self, topic: str, what: str) -> object:
        self._what = what
        if not self.span.is_recording():
            return None
        return self._tracer.start_span(
            f"{topic} publish",
            context=self._context(),
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "publish",
                "messaging.destination.name": topic,
                "consumer_proxy.write": what,
            },
        )

    def written(self, handle: object, ok: bool) -> None:
        if isinstance(handle, Span):
            if not ok:
                handle.set_status(Status(StatusCode.ERROR, "cancelled"))
            handle.end()
        self.end(self._what if ok else "cancelled")


def _ended_as(span: Span, outcome: str) -> None:
    """What a process span says of how the message's work here ended."""
    span.set_attribute("consumer_proxy.outcome", outcome)
    if outcome == "dead_letter":
        span.set_status(Status(StatusCode.ERROR, "dead-lettered"))


def _call_ended(span: Span, status: str) -> None:
    """What a batch call's span says of the call's status."""
    span.set_attribute("rpc.grpc.status", status)
    if status != "OK":
        span.set_status(Status(StatusCode.ERROR, status))


Facts = tuple[str, int, int, str, int, int, bytes | None, Origin]
"""What a process span says of its message: topic, partition, offset, group, delivery
attempt, value size, key, origin."""


def _facts(delivery: Delivery, group: str) -> Facts:
    part = delivery.part
    return (
        part.topic,
        part.partition,
        delivery.offset,
        group,
        delivery.attempt,
        len(delivery.value or b""),
        delivery.key,
        delivery.origin,
    )


def _partition_attributes(topic: str, partition: int) -> dict[str, str | int]:
    """A process span's first attributes, the same for every message of a partition."""
    return {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": str(partition),
    }


def _process_attributes(facts: Facts) -> dict[str, str | int]:
    """A process span's attributes (the messaging semantic conventions'); ``_OwnProcess``'s
    ``encoded`` writes them in the same order."""
    topic, partition, offset, group, attempt, size, key, origin = facts
    attributes = _partition_attributes(topic, partition)
    attributes["messaging.kafka.offset"] = offset
    attributes["messaging.consumer.group.name"] = group
    attributes["messaging.message.delivery_attempt"] = attempt
    attributes["messaging.message.body.size"] = size
    text = _text_key(key)
    if text is not None:
        attributes["messaging.kafka.message.key"] = text
    if origin.topic != topic or origin.offset != offset:
        attributes["consumer_proxy.origin.topic"] = origin.topic
        attributes["consumer_proxy.origin.partition"] = origin.partition
        attributes["consumer_proxy.origin.offset"] = origin.offset
    return attributes


class _OwnProcess(OtelMessage):
    """A process span of the proxy's own (``ProxyTracer``) for a message of a batch call,
    made only once something other than its end happens to it (an attempt, an event: then
    it is ``span``, made on the spot). A message acked with the rest of its call, nearly
    every one, is a record on the event loop (its ids, start, facts, end and outcome) that
    the export thread encodes (``encoded``: the bytes ``built().encoded()`` would be, written
    from the record with what repeats from span to span encoded once).

    What a sampled message costs in batch mode at 1 % is mostly this code run cold, between
    a hundred messages' worth of other work: the less of it on the event loop, the better.
    """

    __slots__ = ("_end", "_facts", "_start", "span_id", "trace_id")

    def __init__(self, tracer: ProxyTracer, facts: Facts) -> None:
        self._tracer = tracer
        self._span = None
        self._facts = facts
        self._end: tuple[int, str] | None = None
        self.trace_id = trace_id = random.getrandbits(128) or 1
        self.span_id = span_id = random.getrandbits(64) or 1
        self._start = time.time_ns()
        self.sampled = True
        self.traceparent = format_traceparent(trace_id, span_id, 1)
        self.tracestate = ""
        self._ctx = None
        self._what = "dead_letter"
        self._attempt = None

    def _made(self) -> ProxySpan:
        tracer: ProxyTracer = self._tracer
        facts = self._facts
        span = tracer.root_span(
            f"{facts[0]} process", SpanKind.CONSUMER, _process_attributes(facts)
        )
        span.trace_id, span.span_id, span.start_time = self.trace_id, self.span_id, self._start
        return span

    @property
    def span(self) -> Span:
        span = self._span
        if span is None:
            span = self._span = self._made()
            if self._end is not None:  # (ended already: its record is on its way)
                span.end_time = self._end[0]
        return span

    def end(self, outcome: str) -> None:
        if self._span is not None:
            super().end(outcome)
        elif self._end is None:
            self._end = (time.time_ns(), outcome)
            self._tracer.defer(self)

    def built(self) -> ProxySpan:
        """The ended span."""
        assert self._end is not None
        span = self._made()
        _ended_as(span, self._end[1])
        span.end_time = self._end[0]
        return span

    def encoded(self, tracer: ProxyTracer) -> bytes:
        """The ended span's OTLP bytes (the export thread's: ``ProxyTracer.defer``), byte for
        byte ``built().encoded()``; made that way when the span limits would cut it."""
        assert self._end is not None
        if tracer.max_attributes < MAX_PROCESS_ATTRIBUTES or tracer.max_span_length is not None:
            return self.built().encoded()
        end, outcome = self._end
        topic, partition, offset, group, attempt, size, key, origin = self._facts
        fixed = _PARTITIONS.get((topic, partition)) or _fixed(
            _PARTITIONS,
            (topic, partition),
            f"{topic} process",
            SpanKind.CONSUMER,
            _partition_attributes(topic, partition),
        )
        parts = [
            span_head(self.trace_id, self.span_id, fixed[0], self._start, end),
            fixed[1],
            int_attribute(_OFFSET, offset),
            _cached_attribute("messaging.consumer.group.name", group),
            int_attribute(_ATTEMPT, attempt),
            int_attribute(_SIZE, size),
        ]
        text = _text_key(key)
        if text is not None:
            parts.append(span_attributes({"messaging.kafka.message.key": text}))
        if origin.topic != topic or origin.offset != offset:
            parts.append(
                span_attributes(
                    {
                        "consumer_proxy.origin.topic": origin.topic,
                        "consumer_proxy.origin.partition": origin.partition,
                        "consumer_proxy.origin.offset": origin.offset,
                    }
                )
            )
        parts.append(_cached_attribute("consumer_proxy.outcome", outcome))
        parts.append(_DEAD_LETTERED if outcome == "dead_letter" else _UNSET)
        return b"".join(parts)


MAX_PROCESS_ATTRIBUTES = 14
"""The most attributes a process span has (``_process_attributes`` and its outcome)."""
_OFFSET = attribute_key("messaging.kafka.offset")
_ATTEMPT = attribute_key("messaging.message.delivery_attempt")
_SIZE = attribute_key("messaging.message.body.size")
_COUNT = attribute_key("messaging.batch.message_count")
_UNSET = root_tail(0, None)
_DEAD_LETTERED = root_tail(StatusCode.ERROR.value, "dead-lettered")
_PARTITIONS: dict[tuple[str, int], tuple[bytes, bytes]] = {}
_TARGETS: dict[tuple[str, str], tuple[bytes, bytes]] = {}
_ATTRIBUTES: dict[tuple[str, str], bytes] = {}


def _fixed(
    cache: dict[Any, tuple[bytes, bytes]],
    key: object,
    name: str,
    kind: SpanKind,
    attributes: dict[str, str | int],
) -> tuple[bytes, bytes]:
    """A span's name and kind, and its first ``attributes``, encoded and kept under ``key``
    (a partition's process spans, a target's batch calls)."""
    fixed = (name_and_kind(name, kind.value), span_attributes(attributes))
    if len(cache) < MAX_CACHED:
        cache[key] = fixed
    return fixed


def _cached_attribute(key: str, value: str) -> bytes:
    """A text attribute of the proxy's own (a group, an outcome, a status), encoded once."""
    encoded = _ATTRIBUTES.get((key, value))
    if encoded is None:
        encoded = span_attributes({key: value})
        if len(_ATTRIBUTES) < MAX_CACHED:
            _ATTRIBUTES[(key, value)] = encoded
    return encoded


CallFacts = tuple[str, str, int, str]
"""What a batch call's span says of it: method, target, message count, group."""


def _target_attributes(method: str, target: str) -> dict[str, str | int]:
    """A batch call's first attributes (the RPC semantic conventions'), the same for every
    call of a method to a target."""
    return {
        "rpc.system": "grpc",
        "rpc.service": RPC_SERVICE,
        "rpc.method": method,
        "server.address": target,
    }


def _call_attributes(facts: CallFacts) -> dict[str, str | int]:
    """A batch call's attributes (and the batch's); ``_OwnCall.encoded`` writes them in the
    same order."""
    method, target, count, group = facts
    attributes = _target_attributes(method, target)
    attributes["messaging.batch.message_count"] = count
    attributes["messaging.consumer.group.name"] = group
    return attributes


class _OwnCall:
    """A batch call's CLIENT span of the proxy's own, a record until the export thread makes
    it into the span and encodes it (``built``), as ``_OwnProcess``."""

    __slots__ = ("_end", "_facts", "_links", "_start", "_tracer", "ids")

    def __init__(self, tracer: ProxyTracer, facts: CallFacts, links: list[tuple[int, int]]) -> None:
        self._tracer = tracer
        self._facts = facts
        self._links = links
        self._end: tuple[int, str] | None = None
        self._start = time.time_ns()
        self.ids = (random.getrandbits(128) or 1, random.getrandbits(64) or 1)

    def done(self, status: str) -> None:
        if self._end is None:
            self._end = (time.time_ns(), status)
            self._tracer.defer(self)

    def built(self) -> ProxySpan:
        assert self._end is not None
        facts = self._facts
        span = self._tracer.root_span(
            f"{RPC_SERVICE}/{facts[0]}", SpanKind.CLIENT, _call_attributes(facts), self._links
        )
        (span.trace_id, span.span_id), span.start_time = self.ids, self._start
        _call_ended(span, self._end[1])
        span.end_time = self._end[0]
        return span

    def encoded(self, tracer: ProxyTracer) -> bytes:
        """As ``_OwnProcess.encoded``: byte for byte ``built().encoded()``."""
        assert self._end is not None
        links = self._links
        if (
            tracer.max_attributes < MAX_CALL_ATTRIBUTES
            or tracer.max_span_length is not None
            or len(links) > tracer.max_links
        ):
            return self.built().encoded()
        end, status = self._end
        method, target, count, group = self._facts
        fixed = _TARGETS.get((method, target)) or _fixed(
            _TARGETS,
            (method, target),
            f"{RPC_SERVICE}/{method}",
            SpanKind.CLIENT,
            _target_attributes(method, target),
        )
        trace_id, span_id = self.ids
        parts = [
            span_head(trace_id, span_id, fixed[0], self._start, end),
            fixed[1],
            int_attribute(_COUNT, count),
            _cached_attribute("messaging.consumer.group.name", group),
            _cached_attribute("rpc.grpc.status", status),
        ]
        parts += [local_link(linked_trace, linked_span) for linked_trace, linked_span in links]
        parts.append(_UNSET if status == "OK" else root_tail(StatusCode.ERROR.value, status))
        return b"".join(parts)


MAX_CALL_ATTRIBUTES = 7
"""The most attributes a batch call's span has (``_call_attributes`` and its status)."""


def _ids(trace: OtelMessage) -> tuple[int, int]:
    """The trace and span ids of a process span of the proxy's own."""
    if isinstance(trace, _OwnProcess):
        return trace.trace_id, trace.span_id
    span = trace.span
    assert isinstance(span, ProxySpan)
    return span.trace_id, span.span_id


class OtelTracer:
    """One group's tracer (``tracing.Tracer``). ``ratio``: the share of new traces sampled,
    decided here before any span (None: the SDK's sampler decides every message).
    ``by_call``: in a batch call (``begin_batch``) that ratio is drawn once for the call's
    messages without a sampled or unsampled parent (``tracing.batch_sampling: call``)."""

    def __init__(
        self,
        tracer: Any,
        group: str,
        link_producer: bool,
        ratio: float | None = None,
        by_call: bool = False,
    ) -> None:
        self._tracer = tracer
        self._group = group
        self._link_producer = link_producer
        self._ratio = ratio
        self._by_call = by_call
        self._draw = random.random
        # The proxy's own spans: a new root and a batch call's span are made without
        # OpenTelemetry objects (``ProxyTracer.root_span``).
        self._own = tracer if isinstance(tracer, ProxyTracer) else None

    def begin(self, delivery: Delivery, held_s: float) -> OtelMessage | _Unsampled:
        return self._begin(delivery, held_s, None)

    def _begin(
        self, delivery: Delivery, held_s: float, drawn: bool | None
    ) -> OtelMessage | _Unsampled:
        """``begin``; ``drawn``: whether its call was drawn into the sample (``by_call``),
        None: a draw of its own when it needs one."""
        trace = delivery.trace
        if trace is not None:
            return trace  # type: ignore[no-any-return]
        remote = _remote(delivery.headers) if delivery.headers else None
        ratio = self._ratio
        if ratio is not None:
            if remote is not None and not self._link_producer:
                if not remote[2] & 0x01:  # the producer did not sample it
                    header = remote[4]
                    parent = (
                        header.decode("ascii")  # (checked: version 00, flags 00, as written)
                        if len(header) == 55 and header.startswith(b"00-") and header[53:] == b"00"
                        else format_traceparent(remote[0], remote[1], 0)
                    )
                    unsampled = delivery.trace = _Unsampled(parent, tracestate_header(remote[3]))
                    return unsampled
            elif ratio < 1.0 and not (self._draw() < ratio if drawn is None else drawn):
                delivery.trace = NOT_SAMPLED
                return NOT_SAMPLED
        return self._process(delivery, remote, held_s)

    def _process(
        self, delivery: Delivery, remote: Remote | None, held_s: float, in_batch: bool = False
    ) -> OtelMessage:
        """``delivery``'s process span (sampled, or for the SDK's sampler to decide);
        ``in_batch``: a message of a batch call (``begin_batch``)."""
        own = self._own
        if own is not None and remote is None and in_batch:
            delivery.trace = lean = _OwnProcess(own, _facts(delivery, self._group))
            return lean
        context: Context | None = None
        links: Sequence[Link] = ()
        if remote is not None:
            if self._link_producer:
                links = (Link(_span_context(remote)),)
                context = _ROOT  # a new root, whatever the caller's context
            else:
                context = set_span_in_context(NonRecordingSpan(_span_context(remote)))
        else:
            context = _ROOT
        part = delivery.part
        attributes = _process_attributes(_facts(delivery, self._group))
        span = (
            own.root_span(f"{part.topic} process", SpanKind.CONSUMER, attributes)
            if own is not None and remote is None
            else self._tracer.start_span(
                f"{part.topic} process",
                context=context,
                kind=SpanKind.CONSUMER,
                attributes=attributes,
                links=links,
            )
        )
        message = OtelMessage(self._tracer, span)
        delivery.trace = message
        if held_s > 0 and span.is_recording():
            span.add_event("breaker held", {"consumer_proxy.held_ms": round(held_s * 1000)})
        return message

    def begin_batch(self, batch: Sequence[Delivery]) -> list[int]:
        # One call a batch, not one a message: a message without headers drawn out of the
        # sample here costs a draw and an attribute (the 99 % at 1 %).
        ratio = self._ratio
        draws = ratio is not None and ratio < 1.0
        draw = self._draw
        # ``by_call``: one draw for the call; a call drawn in traces each such message of it
        # (the share of them traced is still the ratio), and one drawn out costs no more
        # than an attribute a message.
        drawn = draw() < ratio if draws and self._by_call else None  # type: ignore[operator]
        begin = self._begin
        carried = []
        for i, delivery in enumerate(batch):
            trace = delivery.trace
            if trace is None:
                if delivery.headers:
                    trace = begin(delivery, 0.0, drawn)
                elif draws and not (draw() < ratio if drawn is None else drawn):  # type: ignore[operator]
                    delivery.trace = NOT_SAMPLED
                    continue
                else:  # (as ``begin`` would, for a record without a context)
                    trace = self._process(delivery, None, 0.0, in_batch=True)
            if trace.traceparent:
                carried.append(i)
        return carried

    def batch_call(
        self, batch: Sequence[Delivery], carried: Sequence[int], method: str, target: str
    ) -> tuple[object, Metadata | None]:
        traces = [trace for i in carried if (trace := batch[i].trace) is not None and trace.sampled]
        if not traces:
            return None, None
        facts = (method, target, len(batch), self._group)
        own = self._own
        if own is not None:  # (then every process span is one of its own)
            call = _OwnCall(own, facts, [_ids(trace) for trace in traces])
            trace_id, span_id = call.ids
            return call, ((TRACEPARENT, format_traceparent(trace_id, span_id, 1)),)
        span = self._tracer.start_span(
            f"{RPC_SERVICE}/{method}",
            context=_ROOT,
            kind=SpanKind.CLIENT,
            links=[Link(trace.span.get_span_context()) for trace in traces],
            attributes=_call_attributes(facts),
        )
        return span, _metadata(span.get_span_context())

    def batch_done(self, handle: object, status: str, count: int) -> None:
        if isinstance(handle, _OwnCall):
            handle.done(status)
        elif isinstance(handle, Span):
            _call_ended(handle, status)
            handle.end()


def _protocol(config: TracingConfig) -> str:
    return config.protocol or (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )


def _exporter(config: TracingConfig) -> SpanExporter:
    """OTLP over HTTP (the exporter's own encoder; it is given spans), or over gRPC (given
    ``otlp.Encoded`` spans by ``EncodedBatches``)."""
    timeout = config.export_timeout_ms / 1000
    if _protocol(config).startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        endpoint = config.endpoint
        if endpoint is not None and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    class EncodedGrpcExporter(GrpcExporter):
        """The gRPC exporter of spans already encoded (``otlp.Encoded``): its request is
        parsed from the bytes ``request_of`` writes (in C) instead of built object by object
        in Python. (Sending the bytes as they are would mean replacing the exporter's private
        channel and stub: one upgrade of the SDK away from exports that fail.)"""

        def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
            return ExportTraceServiceRequest.FromString(request_of(data))

    insecure = None
    endpoint = config.endpoint
    if endpoint is not None and endpoint.startswith("http://"):
        insecure = True
    return EncodedGrpcExporter(endpoint=endpoint, insecure=insecure, timeout=timeout)


class EncodedBatches(SpanProcessor):
    """A batch span processor whose queue holds encoded spans (``otlp.encode_span``, as each
    ends), or the proxy's own spans to be encoded (``defer``), exported by one thread every
    ``interval_s`` or once ``batch`` are queued.

    The SDK's ``BatchSpanProcessor`` keeps each span object (its attributes, events, links,
    context) until the export: at the proxy's rates they live long enough to reach the
    garbage collector's oldest generation, and its full passes over them were the largest
    part of what 1 % sampling cost in batch mode. Here an SDK span is garbage as it ends;
    the bytes are not tracked by the collector. Bounded: at most ``max_queue`` spans wait; more
    are dropped, counted and logged at most once a minute, never waited for; shutdown waits
    at most ``SHUTDOWN_TIMEOUT_S`` for the export of what is queued.
    """

    def __init__(
        self, exporter: SpanExporter, max_queue: int, batch: int, interval_s: float
    ) -> None:
        self._exporter = exporter
        self._max_queue = max_queue
        self._batch = batch
        self._interval_s = interval_s
        # An SDK span's bytes, or one of the proxy's own spans with its encoder (``defer``).
        self._queue: deque[tuple[Any, Callable[[Any], Encoded] | None]] = deque()
        self._cond = threading.Condition()
        self._flush_asked = 0
        self._flush_done = 0
        self._stopping = False
        self._deadline = float("inf")  # shutdown's: queued spans left after it are dropped
        self.dropped = 0
        self._dropped_logged = 0
        self._drop_logged_at = -DROP_LOG_INTERVAL_S
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return
        self.add(span, encode_span)

    def add(self, span: Any, encode: Callable[[Any], Encoded]) -> None:
        """Queue ``encode(span)``, a finished sampled span of the SDK's."""
        if len(self._queue) >= self._max_queue:  # (read without the lock: the GIL's)
            self.dropped += 1  # not encoded only to be thrown away
            return
        self._put((encode(span), None))

    def defer(self, span: Any, encode: Callable[[Any], Encoded]) -> None:
        """Queue a finished span of the proxy's own (``spans.ProxyTracer``'s sink), to be
        encoded by the export thread. Encoding it here, as it ends, ran cold on the event
        loop (between a hundred messages' worth of other work, in batch mode at 1 %) at
        several times the cost of encoding a queue of them in a row; and such a span is a
        slotted record of a few objects (its attribute dict, of plain values, is not even
        tracked by the collector), not the SDK span's dozen."""
        queue = self._queue
        if len(queue) >= self._max_queue:
            self.dropped += 1
            return
        # Without the lock: only the event loop appends, and the export thread takes from
        # the left (deque's append and popleft are atomic). Waking it takes the lock, so a
        # wake-up is never lost between its check of the queue and its wait.
        queue.append((span, encode))
        if len(queue) == self._batch:
            with self._cond:
                self._cond.notify()

    def _put(self, entry: tuple[Any, Callable[[Any], Encoded] | None]) -> None:
        with self._cond:
            if len(self._queue) >= self._max_queue:
                self.dropped += 1
                return
            self._queue.append(entry)
            if len(self._queue) == self._batch:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if (
                    not self._stopping
                    and len(self._queue) < self._batch
                    and self._flush_asked == self._flush_done
                ):
                    self._cond.wait(self._interval_s)
                stopping, asked = self._stopping, self._flush_asked
                queue = self._queue
                taken = [queue.popleft() for _ in range(len(queue))]  # (see ``defer``)
                dropped = self.dropped
            for start in range(0, len(taken), self._batch):
                if stopping and time.monotonic() > self._deadline:
                    with self._cond:
                        self.dropped += len(taken) - start  # shutdown's time is up
                    dropped = self.dropped
                    break
                self._export(taken[start : start + self._batch])
            self._log_drops(dropped, force=stopping)
            with self._cond:
                self._flush_done = asked
                self._cond.notify_all()
                if stopping and not self._queue:
                    return

    def _export(self, chunk: list[tuple[Any, Callable[[Any], Encoded] | None]]) -> None:
        try:
            encoded = [span if encode is None else encode(span) for span, encode in chunk]
            self._exporter.export(encoded)  # type: ignore[arg-type]
        except Exception:  # the exporter logs its own failures; never let the thread die
            log.debug("span export failed", exc_info=True)

    def _log_drops(self, dropped: int, force: bool = False) -> None:
        now = time.monotonic()
        if dropped > self._dropped_logged and (
            force or now - self._drop_logged_at >= DROP_LOG_INTERVAL_S
        ):
            log.warning(
                "tracing: dropped %d finished spans (the export queue of %d was full, or "
                "the shutdown's %g s were up)",
                dropped - self._dropped_logged,
                self._max_queue,
                SHUTDOWN_TIMEOUT_S,
            )
            self._dropped_logged, self._drop_logged_at = dropped, now

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        with self._cond:
            self._flush_asked += 1
            asked = self._flush_asked
            self._cond.notify_all()
            return (
                self._cond.wait_for(
                    lambda: self._flush_done >= asked or not self._thread.is_alive(),
                    timeout_millis / 1000,
                )
                and self._flush_done >= asked
            )

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Export what is queued within ``timeout_s`` (the rest is dropped and counted), then
        shut the exporter down, which cuts short an export still retrying."""
        with self._cond:
            if self._stopping:
                return
            self._deadline = time.monotonic() + timeout_s
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._exporter.shutdown()
        self._thread.join(1.0)


def _ratio(config: TracingConfig) -> float | None:
    """The share of new traces to sample when the sampler is parent-based with a ratio (the
    config's, or OTEL_TRACES_SAMPLER's parentbased_*); None for any other sampler."""
    if config.sample_ratio is not None:
        return config.sample_ratio
    name = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    if name == "parentbased_always_on":
        return 1.0
    if name == "parentbased_always_off":
        return 0.0
    if name == "parentbased_traceidratio":
        try:
            return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
        except ValueError:
            return 1.0  # as the SDK reads a bad argument
    return None


EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


class ExporterLines(logging.Filter):
    """The OTLP exporters log every failed export: a warning each retry, an error when they
    give up, lines every few seconds while the collector is down (their own filter drops only
    a line identical to the one just before, and theirs alternate). Their warnings and errors
    go through ``gate`` instead (``KafkaLogGate.say``: a line that repeats, digits aside,
    within a minute is suppressed and counted, and the count said with it next time)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = KafkaLogGate(log, "span exporter")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.gate.say(record.levelno, record.getMessage())
        return False


class OtelTracing:
    """The process's tracer provider and exporter (``tracing.Tracing``)."""

    def __init__(self, config: TracingConfig) -> None:
        self._config = config
        self.export_log = ExporterLines()
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(self.export_log)
        attributes = {SERVICE_NAME: config.service_name} if config.service_name else {}
        resource = Resource.create(attributes)
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self.resource = resource
        self.ratio = _ratio(config)
        # With a ratio the tracer decides new traces itself (OtelTracer.begin), so the SDK
        # samples what it is given; otherwise OTEL_TRACES_SAMPLER[_ARG] as the SDK reads them.
        sampler = ParentBased(ALWAYS_ON) if self.ratio is not None else None
        self.provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        exporter = _exporter(config)
        batch = min(512, config.max_queue_size)
        self._processor: SpanProcessor
        if _protocol(config).startswith("http"):
            self._processor = BatchSpanProcessor(
                exporter,
                max_queue_size=config.max_queue_size,
                max_export_batch_size=batch,
                schedule_delay_millis=config.export_interval_ms,
                export_timeout_millis=config.export_timeout_ms,
            )
        else:
            self._processor = EncodedBatches(
                exporter, config.max_queue_size, batch, config.export_interval_ms / 1000
            )
        self.provider.add_span_processor(self._processor)
        self._tracer: Any = self.provider.get_tracer(SCOPE)
        if self.ratio is not None and isinstance(self._processor, EncodedBatches):
            # Sampling is decided before any span, and the spans go out as OTLP bytes: the
            # proxy's own spans, a fraction of the SDK's cost (``spans``).
            self._tracer = ProxyTracer(
                resource, InstrumentationScope(SCOPE), self._processor.defer, SpanLimits()
            )

    def describe(self) -> str:
        """One line for the log: where spans go and how they are sampled."""
        sampler = (
            self.provider.sampler.get_description()
            if self.ratio is None
            else f"parent-based, {self.ratio:g} of new traces"
        )
        return (
            f"service {self.resource.attributes.get(SERVICE_NAME)}, sampler {sampler}, "
            f"link_producer {self._config.link_producer}, "
            f"batch_sampling {self._config.batch_sampling}"
        )

    def tracer(self, group: str) -> OtelTracer:
        config = self._config
        by_call = config.batch_sampling == "call"
        return OtelTracer(self._tracer, group, config.link_producer, self.ratio, by_call)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now (tests and shutdown)."""
        return self.provider.force_flush(round(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).removeFilter(self.export_log)
