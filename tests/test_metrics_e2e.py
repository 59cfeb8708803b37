"""/metrics scraped over HTTP during and after a real run: the counters add up to what the
service saw, and the gauges settle where the commit log says they must."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import Broker, consume_all, create_topic, end_offsets, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.scrape import Scrape, http_get, scrape
from tests.support.service import DEAD_LETTER, DROP, RETRY, Behaviour, Delivery, TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

MAX_ATTEMPTS = 3
OUTCOMES = ("ack", "retry", "dead_letter", "drop")
# How many messages of each kind each batch has; the kind is the value's prefix.
KINDS = {"ack": 40, "retry": 6, "flaky": 6, "dead": 4, "poison": 4, "drop": 5, "hopeless": 3}


def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
    kind = msg.value.decode().split("-")[0]
    if kind == "retry" and n == 1:
        return Behaviour(action=RETRY, retry_after_ms=10)
    if kind == "flaky" and n == 1:
        return Behaviour(status=grpc.StatusCode.INTERNAL, details="flaky")
    if kind == "dead":
        return Behaviour(action=DEAD_LETTER, reason="cannot be processed")
    if kind == "poison":
        return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad payload")
    if kind == "drop":
        return Behaviour(action=DROP)
    if kind == "hopeless":
        return Behaviour(status=grpc.StatusCode.INTERNAL, details="always fails")
    if kind == "slow" and n == 1:
        return Behaviour(delay_s=4.0)
    return Behaviour()


def proxy_outcome(delivery: Delivery) -> str:
    """What the proxy must have counted for one finished delivery, by the status table."""
    return {
        "ACK": "ack",
        "DROP": "drop",
        "DEAD_LETTER": "dead_letter",
        "INVALID_ARGUMENT": "dead_letter",
        "RETRY": "retry",
        # a counted failure is retried until the last attempt, which dead-letters
        "INTERNAL": "dead_letter" if delivery.n == MAX_ATTEMPTS else "retry",
    }[delivery.outcome]


def expected_counts(service: TestService) -> dict[str, int]:
    seen = Counter(proxy_outcome(d) for d in service.finished())
    return {outcome: seen[outcome] for outcome in OUTCOMES}


def counted(metrics: Scrape, group: str) -> dict[str, int]:
    return {
        outcome: int(
            metrics.value("consumer_proxy_messages_total", group=group, outcome=outcome) or 0
        )
        for outcome in OUTCOMES
    }


def batch(tag: str) -> list[dict[str, str]]:
    return [
        {"key": f"{tag}{kind}{i}", "value": f"{kind}-{tag}-{i}"}
        for kind, count in KINDS.items()
        for i in range(count)
    ]


async def test_metrics_add_up_to_what_the_service_saw(kafka: Broker) -> None:
    await _metrics_run(kafka.bootstrap)


async def _metrics_run(bootstrap: str) -> None:
    # Given a topic with three partitions and a service that acks, retries, dead-letters
    # and drops by the message's kind
    topic, group = unique_name("metrics"), unique_name("metrics")
    create_topic(bootstrap, topic, partitions=3)
    first = batch("a")
    await asyncio.to_thread(produce, bootstrap, topic, first)

    async with TestService(behaviour) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"max_attempts": MAX_ATTEMPTS},
            metrics_port=0,
        )
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(
                lambda: proxy.http is not None and proxy.health.ready()[0], timeout=30
            )
            assert proxy.http is not None
            port = proxy.http.port

            # When the first batch has been handled, a scrape during the run adds up
            done_first = len(first) + KINDS["retry"] + KINDS["flaky"] + 2 * KINDS["hopeless"]
            await async_wait_until(lambda: len(service.finished()) == done_first, timeout=60)
            mid = await async_wait_until(
                lambda: _adds_up(port, group, service),
                timeout=10,
                message="messages_total to match the service's deliveries mid-run",
            )
            assert mid["ack"] == KINDS["ack"] + KINDS["retry"] + KINDS["flaky"]

            # and while slow calls are under way, in_flight and the tracker window show them
            second = batch("b") + [{"key": f"slow{i}", "value": f"slow-b-{i}"} for i in range(3)]
            await asyncio.to_thread(produce, bootstrap, topic, second)
            await async_wait_until(
                lambda: (
                    sum(
                        1
                        for d in service.deliveries
                        if (d.value or b"").startswith(b"slow") and d.outcome == "PENDING"
                    )
                    == 3
                ),
                timeout=30,
            )
            during = await scrape(port)
            assert (during.value("consumer_proxy_in_flight", group=group) or 0) >= 3
            window = await async_wait_until(
                lambda: _uncommitted(port, group),
                timeout=3,
                message="uncommitted_messages to count the slow messages",
            )
            assert window >= 3

            # When everything is committed
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
            final = await async_wait_until(
                lambda: _settled(port, group, topic, bootstrap),
                timeout=15,
                message="committed_offset = end offsets, lag 0, in_flight 0",
            )
        finally:
            await proxy.shutdown()
            await task

    # Then the outcome counters are exactly what the service's answers imply
    want = expected_counts(service)
    assert counted(final, group) == want
    messages = len(first) + len(second)
    assert want == {
        "ack": 2 * (KINDS["ack"] + KINDS["retry"] + KINDS["flaky"]) + 3,
        "retry": 2 * (KINDS["retry"] + KINDS["flaky"] + (MAX_ATTEMPTS - 1) * KINDS["hopeless"]),
        "dead_letter": 2 * (KINDS["dead"] + KINDS["poison"] + KINDS["hopeless"]),
        "drop": 2 * KINDS["drop"],
    }
    assert want["ack"] + want["dead_letter"] + want["drop"] == messages
    # one push duration per delivery
    deliveries = len(service.deliveries)
    assert final.value("consumer_proxy_push_duration_seconds_count", group=group) == deliveries
    assert (
        final.value("consumer_proxy_push_duration_seconds_bucket", group=group, le="+Inf")
        == deliveries
    )
    assert (final.value("consumer_proxy_push_duration_seconds_sum", group=group) or 0) >= 3 * 4.0
    assert final.types["consumer_proxy_push_duration_seconds"] == "histogram"
    # the DLQ writes are confirmed, and the DLQ holds exactly the dead letters
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert final.value("consumer_proxy_dlq_writes_total", group=group, result="ok") == len(dead)
    assert len(dead) == want["dead_letter"]
    # the breaker stayed closed and nothing is paused at rest
    assert final.value("consumer_proxy_circuit_open", group=group) == 0
    assert final.value("consumer_proxy_partitions_paused", group=group) == 0
    # per-partition series stay bounded by the assignment (source and redrive partitions)
    for name in (
        "consumer_proxy_committed_offset",
        "consumer_proxy_lag_messages",
        "consumer_proxy_uncommitted_messages",
    ):
        topics = {labels["topic"] for labels, _ in final.series(name, group=group)}
        assert topics <= {topic, f"{group}.redrive"}
        assert len(final.series(name, group=group)) <= 3 + 3


async def _adds_up(port: int, group: str, service: TestService) -> dict[str, int] | None:
    metrics = await scrape(port)
    seen = counted(metrics, group)
    return seen if seen == expected_counts(service) else None


async def _uncommitted(port: int, group: str) -> float:
    return (await scrape(port)).total("consumer_proxy_uncommitted_messages", group=group)


async def _settled(port: int, group: str, topic: str, bootstrap: str) -> Scrape | None:
    metrics = await scrape(port)
    ends = await asyncio.to_thread(end_offsets, bootstrap, topic)
    committed = {
        int(labels["partition"]): value
        for labels, value in metrics.series(
            "consumer_proxy_committed_offset", group=group, topic=topic
        )
    }
    settled = (
        committed == {p: float(end) for p, end in ends.items()}
        and metrics.total("consumer_proxy_lag_messages", group=group, topic=topic) == 0
        and metrics.total("consumer_proxy_uncommitted_messages", group=group, topic=topic) == 0
        and metrics.value("consumer_proxy_in_flight", group=group) == 0
    )
    return metrics if settled else None


async def test_the_http_endpoint_answers_probes_and_unknown_paths(kafka: Broker) -> None:
    await _endpoint(kafka.bootstrap)


async def _endpoint(bootstrap: str) -> None:
    topic, group = unique_name("endpoint"), unique_name("endpoint")
    create_topic(bootstrap, topic)
    async with TestService() as service:
        proxy, task = start_proxy(
            make_config(bootstrap, group, [topic], [service.address], metrics_port=0)
        )
        try:
            await async_wait_until(lambda: proxy.ready()[0], timeout=30)
            assert proxy.http is not None
            port = proxy.http.port
            assert await http_get(port, "/healthz") == (200, "ok\n")
            assert await http_get(port, "/readyz") == (200, "ready\n")
            status, body = await http_get(port, "/nope")
            assert status == 404 and "/metrics" in body
            status, body = await http_get(port, "/metrics?name[]=x")
            assert status == 200 and "consumer_proxy_messages_total" in body
        finally:
            await proxy.shutdown()
            await task
