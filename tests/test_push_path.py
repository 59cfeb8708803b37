"""The push path end to end against the real broker and a real in-process gRPC service."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from consumer_proxy import dlq
from tests.support.kafka import consume_all, create_topic, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

CP_HEADERS = {
    dlq.H_TOPIC, dlq.H_PARTITION, dlq.H_OFFSET, dlq.H_TIMESTAMP, dlq.H_ATTEMPT, dlq.H_STATUS,
    dlq.H_REASON, dlq.H_ENDPOINT, dlq.H_GROUP, dlq.H_DEAD_LETTERED_AT,
}


def test_every_message_is_acked_or_dead_lettered_and_commits_reach_the_end(kafka) -> None:
    asyncio.run(_mixed_run(kafka.bootstrap))


async def _mixed_run(bootstrap: str) -> None:
    # Given 600 messages over 4 partitions, 12 of them poison pills
    topic, group = unique_name("orders"), unique_name("billing")
    create_topic(bootstrap, topic, partitions=4)
    poison = {f"m{i}" for i in range(0, 600, 50)}
    records = [
        {"key": f"k{i}", "value": (f"m{i}" if f"m{i}" not in poison else f"m{i} poison")}
        for i in range(600)
    ]
    await asyncio.to_thread(produce, bootstrap, topic, records)
    rng = random.Random(7)

    # ... and a service with random latencies that fails some first attempts
    def behaviour(msg, n):
        if msg.value.endswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad payload")
        if n == 1 and rng.random() < 0.1:
            return Behaviour(status=grpc.StatusCode.INTERNAL, details="flaky")
        return Behaviour(delay_s=rng.random() * 0.02)

    async with TestService(behaviour) as service:
        config = make_config(bootstrap, group, [topic], [service.address])
        proxy, task = start_proxy(config)
        # When the proxy runs until everything is committed
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        await proxy.shutdown()
        await task

    # Then every message was acked once or dead-lettered, and the DLQ holds the poison pills
    acked = {d.value.decode() for d in service.deliveries if d.outcome == "ACK"}
    assert acked == {r["value"] for r in records} - {f"{p} poison" for p in poison}
    dead = await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq")
    assert sorted(m.value().decode() for m in dead) == sorted(f"{p} poison" for p in poison)
    for m in dead:
        _, ours = dlq.split_headers(m.headers())
        assert set(ours) == CP_HEADERS
        assert ours[dlq.H_STATUS] == "INVALID_ARGUMENT"
        assert ours[dlq.H_GROUP] == group
        assert ours[dlq.H_ORIGINAL_TOPIC if hasattr(dlq, "H_ORIGINAL_TOPIC") else dlq.H_TOPIC] == topic
