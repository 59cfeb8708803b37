"""The tracing seam's pure parts and the process span's parent, without a broker.

``core.tracecontext`` reads producers' W3C headers (untrusted: bounded, never raising); the
OpenTelemetry implementation (``consumer_proxy.otel``) is checked against the SDK's in-memory
exporter for what it makes of those headers and of the core's decisions.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import re
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision as Decision_
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind

from consumer_proxy import otlp
from consumer_proxy.batch_push import BatchPush
from consumer_proxy.config import (
    BackoffConfig,
    DeliveryConfig,
    TracingConfig,
)
from consumer_proxy.core.batching import BatchLimits, BatchOutcome
from consumer_proxy.core.decision import Action, Decision
from consumer_proxy.core.outcomes import Classification, Outcome
from consumer_proxy.core.partitions import Delivery, PartitionState
from consumer_proxy.core.records import Origin
from consumer_proxy.core.tracecontext import (
    MAX_TRACEPARENT_BYTES,
    MAX_TRACESTATE_BYTES,
    format_traceparent,
    parse_traceparent,
    parse_tracestate,
)
from consumer_proxy.flow import StaticLimiter
from consumer_proxy.metrics import ProxyMetrics
from consumer_proxy.otel import (
    EXPORTER_LOGGERS,
    EncodedBatches,
    OtelTracer,
    OtelTracing,
    _exporter,
)
from consumer_proxy.otlp import Encoded, encode_span, request_of
from consumer_proxy.parking import Tally
from consumer_proxy.ports import Edges
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.push import PushParts
from consumer_proxy.readyq import ReadyDeque
from consumer_proxy.spans import ProxyTracer
from consumer_proxy.tracing import end_trace, start_tracing
from consumer_proxy.wire import batch_request
from tests.support.core import CoreRig
from tests.support.records import Rec
from tests.support.waiting import wait_until

VALID = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_read() -> None:
    assert parse_traceparent(VALID) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736,
        0x00F067AA0BA902B7,
        1,
    )


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"garbage",
        VALID[:-1],
        VALID + b"-extra",  # version 00 has exactly four fields
        VALID.replace(b"00-", b"ff-", 1),  # version ff is invalid
        VALID.upper(),  # hex is lower case
        b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01",  # all-zero trace id
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-" + b"0" * 16 + b"-01",  # all-zero span id
        b"00-4bf92f3577b34da6a3ce929d0e0e473\xff-00f067aa0ba902b7-01",  # not ASCII
        VALID + b"-" + b"a" * MAX_TRACEPARENT_BYTES,  # over the bound: not even looked at
        b"00-4bf92f3577b34da6a3ce929d0e0e4736+00f067aa0ba902b7-01",
    ],
)
def test_a_malformed_traceparent_is_ignored(value: bytes) -> None:
    assert parse_traceparent(value) is None


@given(st.binary(max_size=300))
def test_parsing_any_bytes_never_raises(value: bytes) -> None:
    parse_traceparent(value)


@given(
    st.integers(1, 2**128 - 1),
    st.integers(1, 2**64 - 1),
    st.integers(0, 255),
)
def test_format_then_parse_is_the_identity(trace_id: int, span_id: int, flags: int) -> None:
    assert parse_traceparent(format_traceparent(trace_id, span_id, flags).encode()) == (
        trace_id,
        span_id,
        flags,
    )


def test_with_tracing_off_there_is_no_tracing() -> None:
    assert start_tracing(TracingConfig()) is None


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def delivery(headers: list[tuple[str, bytes]], key: bytes | None = b"k1") -> Delivery:
    part = PartitionState("orders", 3)
    origin = Origin("orders", 3, 42, 0, 0)
    return Delivery(part, 0, 42, key, b"v", headers, origin, 3, 1, 1)


def finished(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("traceparent", b"garbage")],
        [("traceparent", b"a" * 100_000)],
        [("traceparent", b"00-" + b"z" * 52)],
        [("tracestate", b"x=1")],  # a tracestate alone is no context
    ],
    ids=["none", "garbage", "huge", "not-hex", "state-only"],
)
def test_a_message_without_a_valid_context_gets_a_root_span(
    exported: tuple[TracerProvider, InMemorySpanExporter], headers: list[tuple[str, bytes]]
) -> None:
    # Given a message whose headers carry no usable trace context
    provider, exporter = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=False)
    d = delivery(headers)
    # When it is traced and acked
    trace = tracer.begin(d, 0.0)
    trace.decided(Decision(Action.ACK), "OK")
    # Then its process span is a root, with the messaging attributes
    span = finished(exporter)["orders process"]
    assert span.parent is None
    assert span.kind is SpanKind.CONSUMER
    assert span.attributes is not None
    assert span.attributes["messaging.destination.partition.id"] == "3"
    assert span.attributes["messaging.kafka.offset"] == 42
    assert span.attributes["consumer_proxy.outcome"] == "ack"


@pytest.mark.parametrize("link_producer", [False, True])
def test_the_process_span_is_the_records_child_or_a_linked_root(
    exported: tuple[TracerProvider, InMemorySpanExporter], link_producer: bool
) -> None:
    # Given a message with a W3C context (and a tracestate)
    provider, exporter = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=link_producer)
    d = delivery([("traceparent", VALID), ("tracestate", b"vendor=abc")])
    # When it is traced, retried once and dead-lettered
    trace = tracer.begin(d, 0.25)
    handle, metadata = trace.attempt("HandleMessage", "127.0.0.1:1", 1)
    trace.attempt_done(handle, None)
    trace.decided(Decision(Action.RETRY, delay_s=0.1, counted=True), "INTERNAL")
    trace.decided(Decision(Action.DEAD_LETTER, reason="bad"), "INVALID_ARGUMENT")
    write = trace.write("billing.dlq", "dead_letter")
    stamped = trace.stamped([("traceparent", VALID), ("a", b"1")])
    trace.written(write, True)
    # Then the process span is the record's child (or a root linked to it) ...
    spans = finished(exporter)
    process = spans["orders process"]
    context = process.get_span_context()
    assert context is not None
    if link_producer:
        assert process.parent is None
        assert [link.context.span_id for link in process.links] == [0x00F067AA0BA902B7]
    else:
        assert process.parent is not None
        assert process.parent.span_id == 0x00F067AA0BA902B7
        assert context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert [e.name for e in process.events] == ["breaker held", "retry", "dead_letter"]
    # ... the attempt its child, whose context the call's metadata carries
    attempt = spans["consumerproxy.v1.MessageHandler/HandleMessage"]
    assert attempt.parent is not None and attempt.parent.span_id == context.span_id
    attempt_context = attempt.get_span_context()
    assert attempt_context is not None
    assert dict(metadata or ())["traceparent"] == format_traceparent(
        attempt_context.trace_id, attempt_context.span_id, attempt_context.trace_flags
    )
    # ... the DLQ write a PRODUCER child, and the DLQ record carries the process span's context
    dlq = spans["billing.dlq publish"]
    assert dlq.kind is SpanKind.PRODUCER
    assert dlq.parent is not None and dlq.parent.span_id == context.span_id
    assert stamped[0] == ("a", b"1")
    assert stamped[1] == (
        "traceparent",
        format_traceparent(context.trace_id, context.span_id, context.trace_flags).encode(),
    )
    assert process.attributes is not None
    assert process.attributes["consumer_proxy.outcome"] == "dead_letter"


@pytest.mark.parametrize(
    ("flags", "state", "passed_on"),
    [
        (b"00", b"vendor=abc", ("00", "vendor=abc")),
        (b"02", b" vendor=abc ,x=1", ("00", "vendor=abc,x=1")),  # sampled bit only; OWS gone
        (b"00", b"K=bad", ("00", "")),  # a malformed tracestate is not passed on
    ],
)
def test_a_producer_that_did_not_sample_is_followed_without_a_span_or_opentelemetry_objects(
    exported: tuple[TracerProvider, InMemorySpanExporter],
    monkeypatch: pytest.MonkeyPatch,
    flags: bytes,
    state: bytes,
    passed_on: tuple[str, str],
) -> None:
    # Given a record whose producer did not sample its trace, parent-based sampling, and no
    # OpenTelemetry context object to be had (the 99 % pass without any)
    provider, exporter = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=False, ratio=1.0)
    unsampled = VALID[:-2] + flags
    d = delivery([("traceparent", unsampled), ("tracestate", state)])
    for name in ("SpanContext", "TraceState", "Link", "NonRecordingSpan"):
        monkeypatch.setattr(f"consumer_proxy.otel.{name}", None)
    # When it is traced through an attempt and acked
    trace = tracer.begin(d, 0.0)
    _, metadata = trace.attempt("HandleMessage", "127.0.0.1:1", 1)
    trace.decided(Decision(Action.ACK), "OK")
    # Then no span is recorded, and the call passes the producer's context on, not sampled
    assert not trace.sampled
    assert exporter.get_finished_spans() == ()
    parent = (VALID[:-2] + passed_on[0].encode()).decode()
    state_on = (("tracestate", passed_on[1]),) if passed_on[1] else ()
    assert metadata == (("traceparent", parent), *state_on)
    assert (trace.traceparent, trace.tracestate) == (parent, passed_on[1])


@pytest.mark.parametrize(
    ("header", "members"),
    [
        (b"vendor=abc, other@t=x y ,,", [("vendor", "abc"), ("other@t", "x y")]),
        (b"a=b,\nFAKE LOG LINE level=ERROR x", None),  # a forged log line
        (b"a=b,a=c", None),  # a key twice
        (b",".join(b"k%d=v" % i for i in range(33)), None),  # 33 members
        (b"k=" + b"v" * (MAX_TRACESTATE_BYTES - 1), None),  # over 512 bytes
        (b"k=\xff", None),
        (b"K=v", None),
        (b"k=v ", [("k", "v")]),  # optional white space around a member
    ],
)
def test_a_tracestate_breaking_the_w3c_grammar_is_ignored_whole(
    header: bytes, members: list[tuple[str, str]] | None
) -> None:
    assert parse_tracestate(header) == members


def test_a_producers_malformed_tracestate_reaches_neither_the_log_nor_the_service(
    exported: tuple[TracerProvider, InMemorySpanExporter], caplog: pytest.LogCaptureFixture
) -> None:
    # Given records whose producer wrote a malformed tracestate (a forged log line, too many
    # members), sampled or not by their producer
    provider, _ = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=False, ratio=1.0)
    forged = b"a=b,\nFAKE LOG LINE level=ERROR x"
    many = b",".join(b"k%d=v" % i for i in range(40))
    with caplog.at_level(logging.DEBUG):
        for state in (forged, many):
            for parent in (VALID, VALID[:-2] + b"00"):
                trace = tracer.begin(delivery([("traceparent", parent), ("tracestate", state)]), 0)
                _, metadata = trace.attempt("HandleMessage", "127.0.0.1:1", 1)
                # Then the call carries the producer's traceparent and no tracestate
                assert metadata is not None and [k for k, _ in metadata] == ["traceparent"]
                trace.end("acked")
    # and nothing was logged of it (OpenTelemetry's parser logs a bad member verbatim)
    assert not [r for r in caplog.records if "FAKE" in r.getMessage() or "k39" in r.getMessage()]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batch"])
@pytest.mark.parametrize(("ratio", "recorded"), [(0.0, 0), (0.1, 5), (0.5, 25), (1.0, 50)])
def test_new_traces_are_sampled_at_the_ratio(
    exported: tuple[TracerProvider, InMemorySpanExporter],
    ratio: float,
    recorded: int,
    batched: bool,
) -> None:
    # Given 50 messages without trace context
    provider, exporter = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=False, ratio=ratio)
    draws = iter([i / 50 for i in range(50)])  # 0.00, 0.02, ... 0.98: a fixed random draw
    tracer._draw = lambda: next(draws)
    deliveries = [delivery([]) for _ in range(50)]
    # When each is traced (one by one, or as a batch call's) and acked
    carried = tracer.begin_batch(deliveries) if batched else None
    for d in deliveries:
        trace = tracer.begin(d, 0.0)
        handle, metadata = trace.attempt("HandleMessage", "127.0.0.1:1", 1)
        trace.attempt_done(handle, None)
        trace.decided(Decision(Action.ACK), "OK")
        # Then a message not sampled passes no context on (nothing to continue)
        assert trace.sampled or metadata is None
    # and the ratio decides how many are recorded (a process and an attempt span each)
    assert len(exporter.get_finished_spans()) == 2 * recorded
    if batched:  # the batch call carries the context of those sampled
        assert carried == [i for i, d in enumerate(deliveries) if d.trace.sampled]


def test_in_batch_mode_a_call_is_sampled_as_one_and_a_producers_decision_still_holds(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # Given a tracer sampling half of new traces a call at a time (batch_sampling: call)
    provider, _ = exported
    tracer = OtelTracer(provider.get_tracer("t"), "g", False, ratio=0.5, by_call=True)
    draws = iter([0.1, 0.9])  # the first call is drawn in, the second out
    asked: list[float] = []

    def draw() -> float:
        asked.append(next(draws))
        return asked[-1]

    tracer._draw = draw
    calls = []
    for _ in range(2):
        # and calls of 3 messages without a trace context, 1 with other headers only,
        # 1 whose producer sampled it and 1 whose producer did not
        batch = [delivery([]) for _ in range(3)]
        batch.append(delivery([("x-team", b"billing")]))
        batch.append(delivery([("traceparent", VALID)]))
        batch.append(delivery([("traceparent", VALID[:-2] + b"00")]))
        calls.append((batch, tracer.begin_batch(batch)))
    # Then each call took one draw
    assert asked == [0.1, 0.9]
    # and the call drawn in traces every message that starts a trace, the one drawn out none
    (drawn_in, carried_in), (drawn_out, carried_out) = calls
    assert [d.trace.sampled for d in drawn_in] == [True, True, True, True, True, False]
    assert [d.trace.sampled for d in drawn_out] == [False, False, False, False, True, False]
    # while the producers' decisions hold in both (their contexts are carried either way)
    assert carried_in == [0, 1, 2, 3, 4, 5] and carried_out == [4, 5]
    # and the call span links what its call traced
    assert tracer.batch_call(drawn_out[:4], [], "HandleMessageBatch", "t:1") == (None, None)


@pytest.mark.parametrize(
    ("by_call", "calls_with_a_span"),
    [(True, (5, 15)), (False, (590, 680))],
    ids=["call", "message"],
)
def test_sampled_a_call_at_a_time_the_share_traced_is_the_ratio_and_few_calls_make_a_span(
    exported: tuple[TracerProvider, InMemorySpanExporter],
    by_call: bool,
    calls_with_a_span: tuple[int, int],
) -> None:
    # Given 1 % sampling, by call or by message (a seeded draw), and 1,000 calls of 100
    # messages without a trace context
    provider, _ = exported
    tracer = OtelTracer(provider.get_tracer("t"), "g", False, ratio=0.01, by_call=by_call)
    tracer._draw = random.Random(7).random
    traced = calls = 0
    for _ in range(1000):
        carried = tracer.begin_batch([delivery([]) for _ in range(100)])
        traced += len(carried)
        calls += bool(carried)
    # Then about 1 % of the messages are traced either way (by call, 100 a call drawn in)
    assert 500 <= traced <= 1500
    # but by call only about 1 % of the calls make a call span, by message about 63 %
    low, high = calls_with_a_span
    assert low <= calls <= high


def test_calls_are_sampled_as_one_unless_the_config_says_message_by_message() -> None:
    endpoint = "http://127.0.0.1:4317"
    default = OtelTracing(TracingConfig(enabled=True, endpoint=endpoint, sample_ratio=0.01))
    by_message = OtelTracing(
        TracingConfig(enabled=True, endpoint=endpoint, sample_ratio=0.01, batch_sampling="message")
    )
    try:
        assert default.tracer("g")._by_call and "batch_sampling call" in default.describe()
        assert not by_message.tracer("g")._by_call
    finally:
        default.shutdown()
        by_message.shutdown()


def test_a_batch_request_carries_each_messages_traceparent_and_tracestate(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # Given two messages whose producers sent a tracestate, one sampled and one not
    provider, _ = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=False, ratio=1.0)
    sampled = delivery([("traceparent", VALID), ("tracestate", b"vendor=abc")])
    unsampled = delivery([("traceparent", VALID[:-2] + b"00"), ("tracestate", b"other=1")])
    # When they go in one batch request
    request = handler_pb2.HandleMessageBatchRequest.FromString(
        batch_request([sampled, unsampled], "billing", tracer.begin_batch([sampled, unsampled]))
    )
    # Then each message carries its own context: the process span's (with the producer's
    # tracestate, which the span keeps), or the producer's own when it did not sample
    first, second = request.messages
    assert first.traceparent == sampled.trace.traceparent
    assert first.traceparent != VALID.decode()
    assert first.tracestate == "vendor=abc"
    assert (second.traceparent, second.tracestate) == ((VALID[:-2] + b"00").decode(), "other=1")


class TracedCore(CoreRig):
    """The pure core (a ``PartitionSet`` on a virtual clock) with tracing's ``gone`` hook, as
    the group wires it when tracing is on; each message is traced when it is pushed."""

    def __init__(self, provider: TracerProvider, **delivery_config: Any) -> None:
        super().__init__(
            DeliveryConfig(backoff=BackoffConfig(initial_ms=1000, jitter=0.0), **delivery_config)
        )
        self.core.gone = end_trace
        self.tracer = OtelTracer(provider.get_tracer("t"), "g", link_producer=False)
        self.part = self.core.parts[("t", 0)]

    def fetch_and_fail(self, offset: int) -> Delivery:
        """Fetch the record at ``offset`` and push it once: it fails and waits for a retry."""
        self.core.intake(Rec("t", offset))
        d = self.ready.pop()
        assert self.core.begin(d)
        self.tracer.begin(d, 0.0)
        decision = self.core.finish(d, FAILED, probe=False)
        assert decision is not None and decision.action is Action.RETRY
        d.trace.decided(decision, FAILED.status)
        return d


FAILED = Classification(Outcome.RETRY, "INTERNAL", reason="flaky")


def outcome_of_process_span(exporter: InMemorySpanExporter) -> object:
    (process,) = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert process.attributes is not None
    return process.attributes["consumer_proxy.outcome"]


@pytest.mark.parametrize(
    ("leave", "outcome"),
    [
        (lambda rig: rig.core.forget(rig.part), "revoked"),
        (lambda rig: rig.core.forget(rig.part, "lost"), "lost"),
        (lambda rig: rig.core.cancel_timers(), "shutdown"),
        (lambda rig: rig.core.intake(Rec("t", 0)), "truncated"),  # the log cut below it
    ],
    ids=["revoked", "lost", "shutdown", "log-cut"],
)
def test_a_message_that_leaves_while_it_waits_for_a_retry_ends_its_span(
    exported: tuple[TracerProvider, InMemorySpanExporter],
    leave: Callable[[TracedCore], None],
    outcome: str,
) -> None:
    # Given a traced message that failed once and waits on its retry timer
    provider, exporter = exported
    rig = TracedCore(provider)
    rig.fetch_and_fail(0)
    assert exporter.get_finished_spans() == ()
    # When it leaves before the timer fires
    leave(rig)
    # Then its process span ends, saying why
    assert outcome_of_process_span(exporter) == outcome


@pytest.mark.parametrize("revoked_after", ["timer", "leaving"])
def test_a_retried_message_dropped_on_its_way_out_of_the_ready_queue_ends_its_span(
    exported: tuple[TracerProvider, InMemorySpanExporter], revoked_after: str
) -> None:
    # Given a traced message whose retry timer fired (it is ready again)
    provider, exporter = exported
    rig = TracedCore(provider)
    rig.fetch_and_fail(0)
    rig.clock.advance(2.0)
    (d,) = rig.ready
    # When its partition is revoked (forgotten, or still leaving) before a worker pushes it
    if revoked_after == "timer":
        rig.core.forget(rig.part)
        expected = "stale"
    else:
        rig.core.leave([rig.part])
        expected = "revoked"
    # Then the worker skips it and its process span ends
    assert not rig.core.begin(d)
    assert outcome_of_process_span(exporter) == expected


SERVICE_WITHOUT_A_PROVIDER = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from consumer_proxy.handler import _NO_SPAN, _ServerSpans
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.spans import ProxyTracer

message = handler_pb2.Message(topic="t", traceparent="{traceparent}")
spans = _ServerSpans(recheck_s=0.0)
unset = spans.span("HandleMessageBatch", message, (), in_batch=True) is _NO_SPAN
told_noop = _ServerSpans(trace.NoOpTracerProvider())
noop = told_noop.span("HandleMessage", message, ()) is _NO_SPAN
trace.set_tracer_provider(TracerProvider())
with spans.span("HandleMessageBatch", message, (), in_batch=True):
    recorded = trace.get_current_span().is_recording()
print(unset, noop, recorded)
"""


def test_a_service_with_opentelemetry_but_no_tracer_provider_makes_no_span_objects() -> None:
    # Given a service process with the OpenTelemetry SDK installed and no provider set (a
    # process of its own: the global provider is set once per process)
    script = SERVICE_WITHOUT_A_PROVIDER.format(traceparent=VALID.decode())
    # When the SDK's server spans run for a message, then the service sets a provider (looked
    # at again at once here, within a second by default)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    # Then without a provider (or with the no-op one) each message gets the shared no-op,
    # as without OpenTelemetry; once a provider is set, its spans are recorded
    assert run.stdout.split() == ["True", "True", "True"], run.stderr


def test_a_long_running_calls_heartbeats_are_events_of_its_attempt_span(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # Given a traced message in a streaming call (its attempt span under way)
    provider, exporter = exported
    tracer = OtelTracer(provider.get_tracer("t"), "billing", link_producer=False)
    trace = tracer.begin(delivery([]), 0.0)
    handle, _ = trace.attempt("HandleMessageStream", "127.0.0.1:1", 1)
    # When the service heartbeats twice, the second time with a long progress note, and a
    # late heartbeat comes after the call ended
    trace.heartbeat(1.0, "")
    trace.heartbeat(0.5, "x" * 1000)
    trace.attempt_done(handle, None)
    trace.heartbeat(0.1, "late")
    # Then the attempt span has one event per heartbeat in the call, the note cut short
    attempt = finished(exporter)["consumerproxy.v1.MessageHandler/HandleMessageStream"]
    assert [(e.name, dict(e.attributes or {})) for e in attempt.events] == [
        ("heartbeat", {"consumer_proxy.gap_ms": 1000}),
        ("heartbeat", {"consumer_proxy.gap_ms": 500, "consumer_proxy.progress": "x" * 256}),
    ]


def every_kind_of_span(spans: Any, heartbeats: int = 1) -> None:
    """Spans of every kind the proxy makes, through ``spans`` (a tracer's ``start_span``):
    process spans (a producer's child with a tracestate, a linked root, a root; breaker,
    retry and DLQ events; error statuses), attempts with heartbeats, cancelled or failed, a
    DLQ write, a batch call with links; messages begun for a batch call (acked, dead-lettered,
    retried) and their call; 40 spans."""
    for link_producer in (False, True):
        tracer = OtelTracer(spans, "g", link_producer, ratio=1.0)
        batch = []
        for i in range(6):
            headers = [("traceparent", VALID), ("tracestate", b"v=1")] if i % 2 else []
            d = delivery(headers, key=b"k" if i % 3 else b"\xff")
            batch.append(d)
            trace = tracer.begin(d, 0.25 * (i % 2))
            handle, _ = trace.attempt("HandleMessageStream", "127.0.0.1:1", 1)
            for beat in range(heartbeats):
                trace.heartbeat(1.0 + beat, "40%" if i % 2 else "")
            failed = FAILED if i % 3 == 0 else None
            trace.attempt_done(handle, failed)
            trace.decided(Decision(Action.RETRY, delay_s=0.1, counted=True), "INTERNAL")
            if i % 2:
                trace.decided(Decision(Action.DEAD_LETTER, reason="bad"), "INVALID_ARGUMENT")
                trace.written(trace.write("g.dlq", "dead_letter"), True)
            else:
                trace.decided(Decision(Action.ACK), "OK")
        span, _ = tracer.batch_call(batch, range(6), "HandleMessageBatch", "127.0.0.1:1")
        tracer.batch_done(span, "UNAVAILABLE", len(batch))
        # (begun for a batch call: the proxy's own make the span only for what needs one)
        batch = [delivery([], key=b"k"), delivery([], key=None), delivery([])]
        carried = tracer.begin_batch(batch)
        span, _ = tracer.batch_call(batch, carried, "HandleMessageBatch", "127.0.0.1:1")
        batch[2].trace.decided(Decision(Action.RETRY, delay_s=0.1, counted=True), "INTERNAL")
        tracer.batch_done(span, "OK", len(batch))
        for d, outcome in zip(batch, ("ack", "dead_letter", "ack"), strict=True):
            d.trace.end(outcome)
        end_trace(batch[0], "revoked")  # (ended already: nothing more)


def test_the_exporters_request_is_what_the_otlp_encoder_builds_for_every_kind_of_span(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # Given spans of every kind the proxy makes
    provider, exporter = exported
    every_kind_of_span(provider.get_tracer("t", "1.0"))
    spans = exporter.get_finished_spans()
    # When the proxy's exporter builds its request
    config = TracingConfig(enabled=True, endpoint="http://127.0.0.1:4317")
    encoded = [encode_span(span) for span in spans]
    request = _exporter(config)._translate_data(encoded)  # type: ignore[attr-defined]
    # Then it is field for field what the OTLP exporter's own encoder builds
    assert request == encode_spans(spans)
    assert len(request.resource_spans[0].scope_spans[0].spans) == len(spans) == 40


def _numbered(request: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """``request`` with its ids numbered in order of appearance and its times zero (two runs
    of the same work differ only in those)."""
    ids: dict[bytes, bytes] = {}

    def number(value: bytes) -> bytes:
        return ids.setdefault(value, len(ids).to_bytes(len(value), "big")) if value else value

    for span in request.resource_spans[0].scope_spans[0].spans:
        span.trace_id, span.span_id = number(span.trace_id), number(span.span_id)
        span.parent_span_id = number(span.parent_span_id)
        span.start_time_unix_nano = span.end_time_unix_nano = 0
        for event in span.events:
            event.time_unix_nano = 0
        for link in span.links:
            link.trace_id, link.span_id = number(link.trace_id), number(link.span_id)
    return request


@pytest.mark.parametrize(
    "limits",
    [SpanLimits(), SpanLimits(max_span_attributes=9, max_events=2, max_links=4)],
    ids=["default-limits", "low-limits"],
)
def test_the_proxys_own_spans_are_exported_as_the_sdks_spans_of_the_same_work(
    limits: SpanLimits,
) -> None:
    # Given the same work traced once through the SDK and once through the proxy's own spans
    # (OTLP/gRPC with sampling decided first), under the same span limits
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    every_kind_of_span(provider.get_tracer("t", "1.0"), heartbeats=3)
    sdk = [encode_span(span) for span in exporter.get_finished_spans()]
    ours: list[Encoded] = []
    scope = InstrumentationScope("t", "1.0")
    own = ProxyTracer(
        provider.resource, scope, lambda span, encode: ours.append(encode(span)), limits
    )
    every_kind_of_span(own, heartbeats=3)
    # When each is encoded for export
    expected = _numbered(ExportTraceServiceRequest.FromString(request_of(sdk)))
    request = _numbered(ExportTraceServiceRequest.FromString(request_of(ours)))
    # Then the requests are the same but for ids and times: parents, links, tracestates,
    # attributes, events, statuses, and what the limits dropped
    assert request == expected
    spans = request.resource_spans[0].scope_spans[0].spans
    assert len(spans) == 40
    if limits.max_events == 2:
        assert any(span.dropped_events_count for span in spans)
        assert any(span.dropped_links_count for span in spans)
        assert any(span.dropped_attributes_count for span in spans)
    provider.shutdown()


def test_over_grpc_with_sampling_decided_first_the_proxy_makes_its_own_spans() -> None:
    # Given tracing on over OTLP/gRPC at 1 %, over OTLP/HTTP, and with a sampler of the SDK's
    # that is not parent-based (it decides each span)
    endpoint = "http://127.0.0.1:4317"
    grpc = OtelTracing(TracingConfig(enabled=True, endpoint=endpoint, sample_ratio=0.01))
    http = OtelTracing(
        TracingConfig(enabled=True, endpoint=endpoint, sample_ratio=0.01, protocol="http/protobuf")
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
        own_sampler = OtelTracing(TracingConfig(enabled=True, endpoint=endpoint))
    try:
        # Then only the first makes the proxy's own spans; the others the SDK's
        assert isinstance(grpc.tracer("g")._tracer, ProxyTracer)
        assert not isinstance(http.tracer("g")._tracer, ProxyTracer)
        assert not isinstance(own_sampler.tracer("g")._tracer, ProxyTracer)
    finally:
        for tracing in (grpc, http, own_sampler):
            tracing.shutdown()


class _Chunks(SpanExporter):
    """Records what ``EncodedBatches`` hands the exporter; ``gate`` holds an export."""

    def __init__(self) -> None:
        self.chunks: list[list[Encoded]] = []
        self.gate = threading.Event()
        self.gate.set()

    def export(self, spans: Any) -> SpanExportResult:
        self.gate.wait(10)
        self.chunks.append(list(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _encoding(max_queue: int, batch: int) -> tuple[_Chunks, EncodedBatches, TracerProvider]:
    """A provider whose spans go through ``EncodedBatches`` (a long export interval) to
    ``_Chunks``."""
    exporter = _Chunks()
    processor = EncodedBatches(exporter, max_queue=max_queue, batch=batch, interval_s=3600)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    return exporter, processor, provider


def test_encoded_batches_keep_bytes_not_spans_and_bound_the_queue() -> None:
    # Given the gRPC path's processor with room for 5 spans
    exporter, processor, provider = _encoding(max_queue=5, batch=100)
    tracer = provider.get_tracer("t")
    # When a span ends
    span = tracer.start_span("one", attributes={"a": "b" * 100})
    span.end()
    ref = weakref.ref(span)
    del span
    gc.collect()
    # Then nothing of it but its bytes waits for the export: the span object is gone
    assert ref() is None
    # and 9 more spans fill the queue: 4 are kept, 5 dropped and counted, never waited for
    for i in range(9):
        tracer.start_span(f"s{i}").end()
    assert processor.dropped == 5
    # When flushed, the 5 kept go out, and decode to the spans that ended
    assert processor.force_flush(10_000)
    sent = [entry for chunk in exporter.chunks for entry in chunk]
    request = ExportTraceServiceRequest.FromString(request_of(sent))
    names = [s.name for s in request.resource_spans[0].scope_spans[0].spans]
    assert names == ["one", "s0", "s1", "s2", "s3"]
    provider.shutdown()


def _own_spans(max_queue: int) -> tuple[_Chunks, EncodedBatches, TracerProvider, ProxyTracer]:
    """``_encoding``'s processor fed by the proxy's own tracer."""
    exporter, processor, provider = _encoding(max_queue=max_queue, batch=100)
    own = ProxyTracer(provider.resource, InstrumentationScope("t"), processor.defer)
    return exporter, processor, provider, own


def _callers(obj: Any, method: str) -> list[str]:
    """The names of the threads that call ``obj``'s ``method`` from now on, in order."""
    threads: list[str] = []
    original = getattr(obj, method)

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    setattr(obj, method, recording)
    return threads


def test_the_proxys_own_spans_are_encoded_by_the_export_thread_and_the_queue_is_bounded() -> None:
    # Given the gRPC path's processor with room for 3 spans, fed by the proxy's own tracer
    exporter, processor, provider, own = _own_spans(max_queue=3)
    encoded_on = _callers(own, "_encode")
    # When 5 spans end
    for i in range(5):
        own.start_span(f"s{i}").end()
    # Then none was encoded as it ended (on the event loop's thread): 3 wait, 2 are dropped
    assert encoded_on == []
    assert processor.dropped == 2
    # and the export thread encodes the 3 that waited when it exports them
    assert processor.force_flush(10_000)
    assert encoded_on == ["otlp-export"] * 3
    sent = [entry for chunk in exporter.chunks for entry in chunk]
    request = ExportTraceServiceRequest.FromString(request_of(sent))
    assert [s.name for s in request.resource_spans[0].scope_spans[0].spans] == ["s0", "s1", "s2"]
    provider.shutdown()


def test_a_batch_calls_spans_are_made_by_the_export_thread_from_records() -> None:
    # Given the proxy's own tracer feeding the gRPC path's processor
    exporter, processor, provider, own = _own_spans(max_queue=100)
    made_on = _callers(own, "root_span")
    encoded_on = _callers(own, "_encode_record")
    tracer = OtelTracer(own, "g", link_producer=False, ratio=1.0)
    # When two messages are begun for a batch call, the call is made and they are acked
    batch = [delivery([]), delivery([])]
    carried = tracer.begin_batch(batch)
    call, metadata = tracer.batch_call(batch, carried, "HandleMessageBatch", "127.0.0.1:1")
    tracer.batch_done(call, "OK", len(batch))
    for d in batch:
        d.trace.end("ack")
    # Then no span was made on the event loop's thread, only records with their contexts
    assert made_on == encoded_on == []
    assert processor.force_flush(10_000)
    # and the export thread wrote the three spans from the records (no span object made at
    # all), with the contexts the service was given
    assert encoded_on == ["otlp-export"] * 3 and made_on == []
    sent = [entry for chunk in exporter.chunks for entry in chunk]
    spans = ExportTraceServiceRequest.FromString(request_of(sent)).resource_spans[0]
    batch_call, process_a, process_b = spans.scope_spans[0].spans  # (in the order they ended)

    def traceparent(span: Any) -> str:
        return f"00-{span.trace_id.hex()}-{span.span_id.hex()}-01"

    assert [d.trace.traceparent for d in batch] == [traceparent(process_a), traceparent(process_b)]
    assert metadata == (("traceparent", traceparent(batch_call)),)
    assert [(link.trace_id, link.span_id) for link in batch_call.links] == [
        (process_a.trace_id, process_a.span_id),
        (process_b.trace_id, process_b.span_id),
    ]
    assert process_a.start_time_unix_nano <= batch_call.start_time_unix_nano
    assert batch_call.end_time_unix_nano <= process_a.end_time_unix_nano
    provider.shutdown()


@pytest.mark.parametrize(
    "limits",
    [
        SpanLimits(),
        SpanLimits(max_span_attributes=9, max_links=2),
        SpanLimits(max_attribute_length=3),
    ],
    ids=["default-limits", "few-attributes-and-links", "short-values"],
)
def test_a_batch_calls_records_are_written_byte_for_byte_as_their_spans(
    limits: SpanLimits,
) -> None:
    # Given the records of batch calls' messages and calls, of every shape: keys of text, of
    # bytes, none or too long; a redriven message (its origin elsewhere); each outcome; calls
    # that failed or linked more messages than the limits keep
    records: list[Any] = []
    own = ProxyTracer(
        TracerProvider().resource,
        InstrumentationScope("t"),
        lambda record, encode: records.append(record),
        limits,
    )
    tracer = OtelTracer(own, "g", link_producer=False, ratio=1.0)
    keys = [b"k", None, b"\xff\xfe", b"x" * 300, "é".encode()]
    outcomes = ["ack", "dead_letter", "drop", "revoked", "retry_tier"]
    for size, status in ((1, "OK"), (3, "UNAVAILABLE"), (5, "OK")):
        batch = []
        for i in range(size):
            d = delivery([], key=keys[i])
            d.offset, d.attempt = 2**40 + i, 1 + i
            if i == 2:
                d.given_origin = Origin("orders.retry", 0, 7, 0, 0)
            batch.append(d)
        carried = tracer.begin_batch(batch)
        call, _ = tracer.batch_call(batch, carried, "HandleMessageBatch", "10.0.0.1:50051")
        tracer.batch_done(call, status, len(batch))
        for d, outcome in zip(batch, outcomes, strict=False):
            d.trace.end(outcome)
    # When the export thread writes each record's span
    # Then it is byte for byte what the span built from the record encodes to
    assert len(records) == 12
    for record in records:
        assert record.encoded(own) == record.built().encoded()


class _RecordOnly(Sampler):
    """Records every span without sampling it (the SDK then still ends it in processors)."""

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return SamplingResult(Decision_.RECORD_ONLY)

    def get_description(self) -> str:
        return "record only"


def test_encoded_batches_export_what_is_left_at_shutdown_in_batches() -> None:
    exporter, processor, provider = _encoding(max_queue=100, batch=4)
    tracer = provider.get_tracer("t")
    exporter.gate.clear()  # the first full batch's export waits
    for i in range(10):
        tracer.start_span(f"s{i}").end()
    # a span recorded but not sampled (a record-only sampler's) is never queued
    unsampled = TracerProvider(sampler=_RecordOnly(), shutdown_on_exit=False)
    unsampled.add_span_processor(processor)
    unsampled.get_tracer("t").start_span("off").end()
    exporter.gate.set()
    provider.shutdown()  # every span still queued goes out before it returns
    assert [len(c) for c in exporter.chunks if c] and all(len(c) <= 4 for c in exporter.chunks)
    sent = [entry for chunk in exporter.chunks for entry in chunk]
    assert len(sent) == 10


def test_shutdown_waits_a_bounded_time_for_a_collector_that_does_not_answer() -> None:
    # Given 10 spans queued (batches of 4) and an export that hangs (the collector is down)
    exporter, processor, provider = _encoding(max_queue=100, batch=4)
    tracer = provider.get_tracer("t")
    exporter.gate.clear()
    for i in range(10):
        tracer.start_span(f"s{i}").end()
    # When the processor shuts down with 0.2 s for it
    started = time.monotonic()
    processor.shutdown(timeout_s=0.2)
    # Then it returns although the export still hangs (about 1.2 s; the hang lasts 10)
    assert time.monotonic() - started < 5.0
    # and once the hung export ends, the spans left are dropped and counted, not exported
    exporter.gate.set()
    processor._thread.join(10)
    assert not processor._thread.is_alive()
    assert sum(len(c) for c in exporter.chunks) == 4 and processor.dropped == 6


def test_producers_keys_and_services_reasons_are_encoded_but_never_cached(
    exported: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    # Given spans of many messages, each with a key of its own and a service's reason
    provider, exporter = exported
    tracer = OtelTracer(provider.get_tracer("t"), "g", link_producer=False, ratio=1.0)
    for i in range(50):
        trace = tracer.begin(delivery([], key=b"key-%d" % i), 0.0)
        trace.decided(Decision(Action.DEAD_LETTER, reason=f"bad {i}"), "INVALID_ARGUMENT")
        trace.end("dead_letter")
    before = len(otlp._PAIRS)
    encoded = [encode_span(span) for span in exporter.get_finished_spans()]
    # Then they are in the request, and the encoder's cache kept none of their values
    request = ExportTraceServiceRequest.FromString(request_of(encoded))
    values = {
        a.value.string_value
        for s in request.resource_spans[0].scope_spans[0].spans
        for a in s.attributes
    }
    assert {"key-0", "key-49"} <= values
    cached = {pair[2] for pair in otlp._PAIRS}
    assert not any(str(v).startswith(("key-", "bad ")) for v in cached)
    assert len(otlp._PAIRS) - before < 10


async def test_a_batch_of_plain_acks_with_a_sampled_message_finishes_together(
    exported: tuple[TracerProvider, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch call of 3 traced messages, the second one sampled, in batch mode
    provider, exporter = exported
    rig = TracedCore(provider)
    rig.tracer = OtelTracer(provider.get_tracer("t"), "g", link_producer=False, ratio=0.5)
    draws = iter([0.9, 0.1, 0.9])
    rig.tracer._draw = lambda: next(draws)
    for offset in range(3):
        rig.core.intake(Rec("t", offset))
    batch = rig.core.begin_batch([rig.ready.popleft() for _ in range(3)])
    carried = rig.tracer.begin_batch(batch)
    assert [d.trace.sampled for d in batch] == [False, True, False] and carried == [1]
    edges = Edges(None, None, None, rig.clock, rig.tracer)  # type: ignore[arg-type]
    metrics = ProxyMetrics()
    tally = Tally("g", metrics, lambda *_: None)
    parts = PushParts(
        "g", rig.core, edges, rig.breaker, StaticLimiter(4), None, tally, metrics, asyncio.Event()
    )
    push = BatchPush(parts, ReadyDeque(), 1, BatchLimits(100, 1 << 20), 0, lambda: None)
    monkeypatch.setattr(rig.core, "finish", None)  # one message at a time: not taken
    # When the service acks all three
    acks = [Classification(Outcome.ACK, "OK")] * 3
    endpoint = SimpleNamespace(target="127.0.0.1:1", ejected=False)
    push._finished(batch, BatchOutcome(acks, acks[0], False), False, endpoint, carried)
    # Then they are finished together, and the sampled one's process span ends as acked
    assert rig.part.tracker is not None and rig.part.tracker.pending == 0
    assert outcome_of_process_span(exporter) == "ack"


def test_span_export_failing_for_long_tells_each_line_once_and_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given tracing to a collector that is down (a closed port), exporting every 100 ms
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = TracingConfig(
        enabled=True,
        endpoint=f"http://127.0.0.1:{port}",
        sample_ratio=1.0,
        export_interval_ms=100,
        export_timeout_ms=2500,  # (time for a retry: a warning, then an error, each export)
    )
    caplog.set_level(logging.INFO)
    tracing = OtelTracing(config)
    try:
        # When spans keep coming until the exporter's lines repeated several times over
        def more_failures() -> bool:
            tracing._tracer.root_span("orders process", SpanKind.CONSUMER, {}).end()
            return tracing.export_log.gate.suppressed_total >= 4

        wait_until(more_failures, timeout=60, interval=0.05)
    finally:
        tracing.shutdown()
    # Then none of the exporter's own warnings or errors reached the log as they are, and
    # each of its lines was told once (digits aside), the repeats counted, not a line each
    assert not [r for r in caplog.records if r.name in EXPORTER_LOGGERS and r.levelno >= 30]
    told = [
        re.sub(r"[0-9]+", "#", r.getMessage())
        for r in caplog.records
        if r.name == "consumer_proxy.otel" and r.getMessage().startswith("span exporter: ")
    ]
    assert told and len(told) == len(set(told)), told
