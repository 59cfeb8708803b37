"""Tracing (issue 31): one trace from the producer through Kafka and the proxy into the service.

Real parts: the local Kafka broker; a real OTLP receiver nobody here wrote (the OpenTelemetry
Collector's OTLP receiver and file exporter, built from the Go module proxy:
tests/support/collector.py), from which every trace is read back; the Python SDK service
(``consumer_proxy.handler``) with a tracer provider of its own; the Go example (examples/go)
with the OpenTelemetry Go gRPC instrumentation.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from consumer_proxy import handler as cp
from consumer_proxy.cli import main
from consumer_proxy.config import ProxyConfig
from tests.support.collector import Collector, attributes
from tests.support.goexample import GoService, build
from tests.support.goexample import go_service as run_go_service
from tests.support.kafka import (
    Broker,
    consume_all,
    create_topic,
    headers_of,
    produce,
    unique_name,
)
from tests.support.proxy import caught_up, config_dict, start_proxy
from tests.support.waiting import async_wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.kafka, pytest.mark.timeout(900)]

# OTLP span kinds, as the collector's OTLP JSON gives them
SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    with Collector.start(tmp_path_factory.mktemp("otelcol")) as running:
        yield running


def provider(collector: Collector, service: str) -> TracerProvider:
    """A tracer provider of the test's own (the producer's, the Python service's)."""
    tracing = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=collector.otlp_grpc, insecure=True)
    tracing.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    return tracing


def produce_traced(
    bootstrap: str, topic: str, producer: TracerProvider, values: list[str], tracestate: str = ""
) -> list[str]:
    """Produce ``values`` (key k<i>), each inside a PRODUCER span whose W3C context goes in
    the record's headers (with ``tracestate``, if any); returns each record's trace id
    (hex)."""
    tracer = producer.get_tracer("test-producer")
    records: list[dict[str, Any]] = []
    trace_ids: list[str] = []
    for i, value in enumerate(values):
        with tracer.start_as_current_span(f"{topic} publish", kind=SpanKind.PRODUCER) as span:
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier, set_span_in_context(span))
            if tracestate:
                carrier["tracestate"] = tracestate
            trace_ids.append(f"{span.get_span_context().trace_id:032x}")
        headers = [(k, v.encode()) for k, v in carrier.items()]
        records.append({"key": f"k{i}", "value": value, "headers": headers})
    produce(bootstrap, topic, records)
    return trace_ids


async def traced_topic(
    bootstrap: str, collector: Collector, prefix: str, values: list[str], tracestate: str = ""
) -> tuple[str, str, list[str]]:
    """A new topic (2 partitions) holding ``values`` written by an instrumented producer, and
    a group name; returns (topic, group, each record's trace id)."""
    topic, group = unique_name(prefix), unique_name(prefix)
    create_topic(bootstrap, topic, partitions=2)
    producer = provider(collector, "test-producer")
    trace_ids = await asyncio.to_thread(
        produce_traced, bootstrap, topic, producer, values, tracestate
    )
    producer.shutdown()  # exports the producer's spans
    return topic, group, trace_ids


def traced_config(
    bootstrap: str,
    group: str,
    topics: list[str],
    endpoints: list[str],
    collector: Collector,
    **extra: Any,
) -> ProxyConfig:
    raw = config_dict(bootstrap, group, topics, endpoints, **extra)
    raw["tracing"] = {
        "enabled": True,
        "endpoint": collector.otlp_grpc,
        "service_name": "consumer-proxy",
        "export_interval_ms": 100,
    }
    return ProxyConfig(**raw)


class Handler:
    """The Python service: poison pills are dead-lettered unless redriven, flaky ones fail
    their first attempt; every handler call opens a span of its own ("handle work")."""

    def __init__(self, tracing: TracerProvider) -> None:
        self._tracer = tracing.get_tracer("python-handler")

    async def handle(self, message: cp.Message) -> cp.Result | None:
        with self._tracer.start_as_current_span("handle work"):
            value = message.value or b""
            if b"poison" in value and message.source != "redrive":
                return cp.dead_letter('value contains "poison"')
            if b"flaky" in value and message.attempt == 1:
                return cp.retry(reason="flaky")
            if b"progress" in value:
                # A heartbeat with a note (long-running calls), sent while the work goes on;
                # the SDK's periodic one (every second here) repeats the note, should a
                # loaded machine let the work end before the first went out.
                await message.progress("halfway")
                await asyncio.sleep(1.5)
            return None


@pytest.fixture
async def python_service(collector: Collector) -> AsyncIterator[tuple[cp.Server, TracerProvider]]:
    tracing = provider(collector, "python-service")
    async with cp.Server(Handler(tracing), tracer_provider=tracing) as server:
        yield server, tracing
    tracing.shutdown()


@pytest.fixture
def go_service(
    collector: Collector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GoService]:
    """The Go example, exporting its spans (otelgrpc's) to the collector."""
    binary = build(tmp_path_factory.mktemp("go-example"))
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.otlp_grpc,
        "OTEL_SERVICE_NAME": "go-example",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    yield from run_go_service(binary, env=env)


def by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["spanId"]: s for s in spans}


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s.get("parentSpanId") == parent["spanId"]]


def settled(spans: list[dict[str, Any]], calls: int, writes: int) -> bool:
    """Every span of a message's trace is in: the producer's, the process span, ``calls``
    attempts each with the service's span (and the Python handler's own under it), and
    ``writes`` DLQ writes."""
    kinds = [s["kind"] for s in spans]
    if kinds.count(CLIENT) != calls or kinds.count(PRODUCER) != 1 + writes:
        return False
    servers = [s for s in spans if s["kind"] == SERVER]
    work = [s for s in spans if s["name"] == "handle work"]
    python = [s for s in servers if s["service"] == "python-service"]
    return CONSUMER in kinds and len(servers) == calls and len(work) == len(python)


Spans = list[dict[str, Any]]


async def run_until_caught_up(
    config: ProxyConfig, bootstrap: str, group: str, topic: str, timeout: float
) -> None:
    """Run the proxy until ``group`` has committed all of ``topic``, then shut it down (which
    exports its spans)."""
    proxy, task = start_proxy(config)
    try:
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=timeout)
    finally:
        await proxy.shutdown()
        await task


async def read_trace(
    collector: Collector, trace_id: str, complete: Callable[[Spans], bool], what: str
) -> Spans:
    """The trace's spans once ``complete`` says they are all in."""

    async def spans() -> Spans | None:
        found = await asyncio.to_thread(collector.trace, trace_id)
        return found if complete(found) else None

    return await async_wait_until(spans, timeout=60, message=what)


def check_attempt(
    spans: list[dict[str, Any]], attempt: dict[str, Any], method: str = "HandleMessage"
) -> dict[str, Any]:
    """An attempt (CLIENT) span and the one SERVER span it led to; returns the server span."""
    assert attempt["kind"] == CLIENT
    assert attributes(attempt)["rpc.method"] == method
    (server,) = children(spans, attempt)
    assert server["kind"] == SERVER
    assert server["name"] == f"consumerproxy.v1.MessageHandler/{method}"
    return server


async def test_each_message_is_one_trace_from_the_producer_through_the_proxy_into_the_service(
    kafka: Broker,
    collector: Collector,
    python_service: tuple[cp.Server, TracerProvider],
    go_service: GoService,
    tmp_path: Path,
) -> None:
    # Given 200 messages written with trace context by an instrumented producer: every 20th
    # a poison pill, every 20th (another) flaky (its first attempt fails)
    server, service_tracing = python_service
    bootstrap = kafka.bootstrap
    values = [
        f"order {i}" + (" poison" if i % 20 == 3 else " flaky" if i % 20 == 11 else "")
        for i in range(200)
    ]
    topic, group, trace_ids = await traced_topic(bootstrap, collector, "trace", values)

    # When the proxy, tracing to the collector, pushes them to the Python SDK service and the
    # Go example (two instances of one service)
    endpoints = [server.address, go_service.address]
    config = traced_config(bootstrap, group, [topic], endpoints, collector)
    await run_until_caught_up(config, bootstrap, group, topic, 90)
    service_tracing.force_flush()
    go_service.stop()  # flushes its spans

    # Then every message's trace, read back from the collector, is producer -> process -> attempt(s)
    # -> the service's span -> the handler's own span
    # (the Python service's handler adds a span of its own)
    process_of: dict[int, dict[str, Any]] = {}
    served_by: set[str] = set()
    for i, (value, trace_id) in enumerate(zip(values, trace_ids, strict=True)):
        attempts = 2 if "flaky" in value else 1
        writes = 1 if "poison" in value else 0
        what = f"the trace of message {i}"
        spans = await read_trace(
            collector, trace_id, partial(settled, calls=attempts, writes=writes), what
        )
        (publish,) = [s for s in spans if s["service"] == "test-producer"]
        assert publish["kind"] == PRODUCER
        (process,) = children(spans, publish)
        assert process["service"] == "consumer-proxy"
        assert (process["name"], process["kind"]) == (f"{topic} process", CONSUMER)
        seen = attributes(process)
        assert seen["messaging.system"] == "kafka"
        assert seen["messaging.destination.name"] == topic
        assert seen["messaging.consumer.group.name"] == group
        assert seen["messaging.kafka.message.key"] == f"k{i}"
        assert seen["messaging.message.delivery_attempt"] == 1
        assert {"messaging.destination.partition.id", "messaging.kafka.offset"} <= set(seen)
        process_of[i] = process
        tries = sorted(children(spans, process), key=lambda s: int(s["startTimeUnixNano"]))
        calls = [s for s in tries if s["kind"] == CLIENT]
        assert [attributes(c)["messaging.message.delivery_attempt"] for c in calls] == list(
            range(1, attempts + 1)
        )
        for call in calls:
            served = check_attempt(spans, call)
            served_by.add(served["service"])
            if served["service"] == "python-service":
                (work,) = children(spans, served)
                assert work["name"] == "handle work"
            else:
                assert served["service"] == "go-example"
                assert children(spans, served) == []
        if "poison" in value:
            assert seen["consumer_proxy.outcome"] == "dead_letter"
            (write,) = [s for s in tries if s["kind"] == PRODUCER]
            assert write["name"] == f"{group}.dlq publish"
            assert process["status"].get("code") == 2  # ERROR
        else:
            assert seen["consumer_proxy.outcome"] == "ack"
        events = [e["name"] for e in process.get("events", [])]
        if "flaky" in value:
            assert events == ["retry"], events
            (retry,) = process["events"]
            assert attributes(retry)["consumer_proxy.status"] == "RETRY"
            assert [attributes(c)["rpc.grpc.status"] for c in calls] == ["RETRY", "OK"]

    assert served_by == {"python-service", "go-example"}

    # and each DLQ record carries its process span's context
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    poison = [i for i, v in enumerate(values) if "poison" in v]
    assert len(dead) == len(poison)
    for record in dead:
        i = int((record.key() or b"").decode()[1:])
        process = process_of[i]
        assert (
            headers_of(record)["traceparent"]
            .decode()
            .startswith(f"00-{process['traceId']}-{process['spanId']}-")
        )

    # When the DLQ is merged back and the proxy runs again (redrive: the service acks them)
    path = tmp_path / "proxy.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json", exclude_none=True)))
    code = await asyncio.to_thread(
        main, ["dlq", "merge", "--config", str(path), "--group", group, "--yes"]
    )
    assert code == 0
    config = traced_config(bootstrap, group, [topic], [server.address], collector)
    await run_until_caught_up(config, bootstrap, group, f"{group}.redrive", 90)
    service_tracing.force_flush()

    # Then each merged message's delivery continues its trace: a second process span, the
    # child of the first, with its attempt and the service's span
    for i in poison:
        first = process_of[i]
        what = f"the redrive of message {i}"
        spans = await read_trace(
            collector, first["traceId"], lambda found: settled(found, 2, 1), what
        )
        (again,) = [s for s in children(spans, first) if s["kind"] == CONSUMER]
        assert again["name"] == f"{group}.redrive process"
        seen = attributes(again)
        assert seen["consumer_proxy.outcome"] == "ack"
        assert seen["consumer_proxy.origin.topic"] == topic
        assert seen["messaging.message.delivery_attempt"] == 2
        (call,) = children(spans, again)
        assert check_attempt(spans, call)["service"] == "python-service"


async def test_in_batch_mode_each_handler_span_is_its_messages_child_and_the_call_links_them(
    kafka: Broker,
    collector: Collector,
    python_service: tuple[cp.Server, TracerProvider],
    go_service: GoService,
) -> None:
    # Given 60 messages written with trace context (a tracestate too)
    server, service_tracing = python_service
    bootstrap = kafka.bootstrap
    values = [f"order {i}" for i in range(60)]
    topic, group, trace_ids = await traced_topic(
        bootstrap, collector, "tracebatch", values, tracestate="cp=batch"
    )

    # When the proxy pushes them in batches (HandleMessageBatch) to the Python SDK service and
    # the Go example
    endpoints = [server.address, go_service.address]
    delivery = {"batch": {"mode": "always", "max_messages": 10, "linger_ms": 20}}
    config = traced_config(bootstrap, group, [topic], endpoints, collector, delivery=delivery)
    await run_until_caught_up(config, bootstrap, group, topic, 90)
    service_tracing.force_flush()
    go_service.stop()

    # Then each message's trace is producer -> process -> the service's span for that message
    # (and the Python handler's own span under it), the tracestate passed on to the service
    def one_message(spans: list[dict[str, Any]]) -> bool:
        servers = [s for s in spans if s["kind"] == SERVER]
        work = [s for s in spans if s["name"] == "handle work"]
        python = [s for s in servers if s["service"] == "python-service"]
        return len(spans) >= 3 and len(servers) == 1 and len(work) == len(python)

    calls: dict[tuple[str, str], set[str]] = {}  # batch call -> the process spans it served
    served_by: set[str] = set()
    for i, trace_id in enumerate(trace_ids):
        spans = await read_trace(collector, trace_id, one_message, f"the trace of message {i}")
        (publish,) = [s for s in spans if s["kind"] == PRODUCER]
        (process,) = children(spans, publish)
        assert (process["name"], process["kind"]) == (f"{topic} process", CONSUMER)
        assert attributes(process)["consumer_proxy.outcome"] == "ack"
        (served,) = children(spans, process)  # no attempt span of its own: the call is shared
        assert served["kind"] == SERVER
        assert served["name"] == "consumerproxy.v1.MessageHandler/HandleMessageBatch"
        assert process.get("traceState") == served.get("traceState") == "cp=batch"
        assert (
            attributes(served)["messaging.kafka.offset"]
            == attributes(process)["messaging.kafka.offset"]
        )
        served_by.add(served["service"])
        if served["service"] == "python-service":
            (work,) = children(spans, served)
            assert work["name"] == "handle work"
        # ... linked to the batch call it came in
        (link,) = served["links"]
        calls.setdefault((link["traceId"], link["spanId"]), set()).add(process["spanId"])
    assert served_by == {"python-service", "go-example"}

    # and each batch call is a CLIENT span (a root of its own) linked to each of its messages'
    # process spans (the Go example links its per-message spans to its otelgrpc server span,
    # the child of that CLIENT span)
    linked: set[str] = set()
    for (trace_id, span_id), processes in calls.items():
        spans = await read_trace(collector, trace_id, bool, "a batch call's trace")
        (call,) = [s for s in spans if s["kind"] == CLIENT]
        assert call["name"] == "consumerproxy.v1.MessageHandler/HandleMessageBatch"
        assert "parentSpanId" not in call or not call["parentSpanId"]
        assert span_id in {call["spanId"], *(s["spanId"] for s in children(spans, call))}
        call_links = {link["spanId"] for link in call["links"]}
        assert processes <= call_links
        assert attributes(call)["messaging.batch.message_count"] == len(call_links)
        linked |= call_links
    assert len(linked) == 60


async def test_a_long_running_call_is_an_attempt_whose_stream_the_service_continues(
    kafka: Broker, collector: Collector, python_service: tuple[cp.Server, TracerProvider]
) -> None:
    # Given 5 messages written with trace context, for a long-running group (the handler
    # reports progress on the first: a heartbeat)
    server, service_tracing = python_service
    bootstrap = kafka.bootstrap
    values = ["job 0 progress"] + [f"job {i}" for i in range(1, 5)]
    topic, group, trace_ids = await traced_topic(bootstrap, collector, "tracelong", values)
    long_running = {"heartbeat_timeout_ms": 3000, "max_processing_ms": 20000}
    config = traced_config(
        bootstrap,
        group,
        [topic],
        [server.address],
        collector,
        delivery={"long_running": long_running},
    )
    # When the proxy pushes them through HandleMessageStream to the Python SDK service
    await run_until_caught_up(config, bootstrap, group, topic, 60)
    service_tracing.force_flush()
    # Then each trace is producer -> process -> the streaming attempt -> the SDK's server span
    # -> the handler's own span, and the heartbeat an event of its attempt
    for i, trace_id in enumerate(trace_ids):
        complete = partial(settled, calls=1, writes=0)
        spans = await read_trace(collector, trace_id, complete, f"the trace of message {i}")
        (publish,) = [s for s in spans if s["kind"] == PRODUCER]
        (process,) = children(spans, publish)
        (call,) = children(spans, process)
        served = check_attempt(spans, call, "HandleMessageStream")
        (work,) = children(spans, served)
        assert work["name"] == "handle work"
        notes = [
            attributes(e).get("consumer_proxy.progress")
            for e in call.get("events", [])
            if e["name"] == "heartbeat"
        ]  # (a loaded machine may add the SDK's periodic heartbeats, with no note before)
        assert ("halfway" in notes) == (i == 0)


OFF_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from consumer_proxy.config import ProxyConfig
    from tests.support.proxy import caught_up, config_dict, start_proxy
    from tests.support.service import TestService, ack_all
    from tests.support.waiting import async_wait_until

    async def run(bootstrap, topic, group, tracing):
        async with TestService(ack_all) as service:
            raw = config_dict(bootstrap, group, [topic], [service.address])
            raw["tracing"] = {
                "enabled": tracing, "endpoint": "http://127.0.0.1:9", "export_timeout_ms": 200
            }
            proxy, task = start_proxy(ProxyConfig(**raw))
            try:
                await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
            finally:
                await proxy.shutdown()
                await task
        assert len(service.deliveries) >= 20
        print(sorted({m.split(".")[0] for m in sys.modules if m.startswith("opentelemetry")}))

    asyncio.run(run(*sys.argv[1:4], sys.argv[4] == "on"))
    """
)


@pytest.mark.parametrize("tracing", ["off", "on"])
def test_with_tracing_off_no_opentelemetry_module_is_imported(kafka: Broker, tracing: str) -> None:
    # Given 20 messages and a proxy in a process of its own, tracing off (or, to show the
    # check sees an import, on)
    topic, group = unique_name("notrace"), unique_name("notrace")
    create_topic(kafka.bootstrap, topic, partitions=1)
    produce(kafka.bootstrap, topic, [f"m{i}" for i in range(20)])
    # When it delivers them all
    proc = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, kafka.bootstrap, topic, group, tracing],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # Then no opentelemetry module was imported with tracing off (and some were with it on)
    imported = proc.stdout.strip().splitlines()[-1]
    assert imported == ("[]" if tracing == "off" else "['opentelemetry']"), proc.stdout
