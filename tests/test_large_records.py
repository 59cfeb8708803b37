"""Records larger than gRPC's default 4 MiB, pushed to a handler-SDK service on the real broker.

The SDK accepts what the proxy sends (``max_request_bytes``, 128 MiB by default), and a
record that a service's own limit still refuses is "message too large for the service": a
counted failure with its own reason, dead-lettered after ``max_attempts``, never a slow-down
of the group nor a circuit-breaker failure.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from consumer_proxy import handler as cp
from consumer_proxy.core import records as dlq_records
from consumer_proxy.core.outcomes import Classification
from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

MIB = 1024 * 1024
BIG_TOPIC = {"max.message.bytes": str(16 * MIB)}
BIG_PRODUCER = {"message.max.bytes": 16 * MIB}  # librdkafka refuses > 1,000,000 bytes by default


def big_record(tag: int, size: int = 5 * MIB) -> bytes:
    return tag.to_bytes(1, "big") * size


class Recorder:
    """A handler that notes what it saw (value sizes by first byte) and acks."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    async def handle(self, message: cp.Message) -> None:
        self.seen.append(message.value or b"")


@pytest.mark.parametrize(
    "delivery",
    [
        pytest.param({}, id="unary"),
        pytest.param({"batch": {}}, id="batch-alone"),  # 5 MiB > batch.max_bytes: goes alone
        pytest.param({"batch": {"max_bytes": 16 * MIB}}, id="batch-16MiB"),
    ],
)
async def test_a_5_mib_record_reaches_an_sdk_service_and_is_acked(
    kafka: Broker, delivery: dict[str, Any]
) -> None:
    # Given a topic that allows 16 MiB records, holding three 5 MiB records among small ones
    bootstrap = kafka.bootstrap
    topic, group = unique_name("big"), unique_name("big")
    create_topic(bootstrap, topic, partitions=1, config=BIG_TOPIC)
    values = [b"small-1", big_record(1), big_record(2), b"small-2", big_record(3)]
    await asyncio.to_thread(produce, bootstrap, topic, values, BIG_PRODUCER)
    recorder = Recorder()
    # When the proxy pushes them to an SDK service with its default limits
    async with cp.Server(recorder) as server:
        config = make_config(bootstrap, group, [topic], [server.address], delivery=delivery)
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        finally:
            await proxy.shutdown()
            await task
    # Then every record reached the handler whole, once, and was acked (nothing dead-lettered)
    assert sorted(recorder.seen) == sorted(values)
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq") == []


async def test_a_record_too_large_for_the_service_is_dead_lettered_as_such_not_slowed_or_broken(
    kafka: Broker,
) -> None:
    # Given an SDK service that accepts calls up to 64 KiB, and 100 KiB records among small
    # ones, and a breaker that would open on one failure
    bootstrap = kafka.bootstrap
    topic, group = unique_name("toobig"), unique_name("toobig")
    create_topic(bootstrap, topic, partitions=1)
    too_big = [big_record(i, 100 * 1024) for i in (1, 2)]
    small = [f"m{i}".encode() for i in range(30)]
    await asyncio.to_thread(produce, bootstrap, topic, [*small[:15], *too_big, *small[15:]])
    recorder = Recorder()
    async with cp.Server(recorder, max_request_bytes=64 * 1024) as server:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [server.address],
            delivery={
                "max_attempts": 3,
                "backoff": {"initial_ms": 10, "max_ms": 50},
            },
            breaker={"failure_threshold": 1},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        # (spies on what the breaker and the concurrency limiter hear of each call)
        breaker_failures: list[bool] = []
        slow_downs: list[bool] = []
        record, release = runner.breaker.record, runner.limiter.release

        def breaker_spy(service_failure: bool, probe: bool, answered: bool = True) -> None:
            breaker_failures.append(service_failure)
            record(service_failure, probe, answered)

        def limiter_spy(rtt_s: float, result: Classification | None) -> None:
            if result is not None:
                slow_downs.append(result.slow_down)
            release(rtt_s, result)

        runner.breaker.record = breaker_spy  # type: ignore[method-assign]
        runner.limiter.release = limiter_spy  # type: ignore[method-assign]
        # When the proxy pushes them all
        try:
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        finally:
            await proxy.shutdown()
            await task
    # Then the small ones were acked and each large one is in the DLQ, whole, saying why
    assert sorted(recorder.seen) == sorted(small)
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert sorted(m.value() or b"" for m in dead) == too_big
    for message in dead:
        _, ours = dlq_records.split_headers(message.headers())
        assert ours["cp-status"] == "RESOURCE_EXHAUSTED"
        assert ours["cp-attempt"] == "3"
        reason = ours["cp-reason"]
        assert "message too large for the service" in reason, reason
        assert "Received message larger than max" in reason, reason
    # and no call told the group to slow down or counted as a breaker failure
    assert len(slow_downs) >= len(small) + 3 * len(too_big)
    assert not any(slow_downs)
    assert len(breaker_failures) == len(slow_downs)
    assert not any(breaker_failures)
