"""The outage rule against a real broker and a real gRPC service: a hung service dead-letters
nothing (deadlines are charged to a message only while the service answers others)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.proxy import caught_up, make_config, start_proxy
from tests.support.service import Behaviour, TestService, always
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

HANG_S = 60.0  # longer than the whole outage: every call during it ends in its deadline


async def test_a_hung_service_dead_letters_nothing(kafka: Broker) -> None:
    bootstrap = kafka.bootstrap
    # Given 4 messages, a 0.3 s call deadline, 5 attempts, a breaker that opens after 2
    # deadlines in a row and probes every 0.3 s
    topic, group = unique_name("hung"), unique_name("hung")
    create_topic(bootstrap, topic, partitions=1)
    await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(4)])
    async with TestService(always(Behaviour(delay_s=HANG_S))) as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            service={"timeout_ms": 300},
            delivery={"concurrency": 2, "max_attempts": 5},
            breaker={"failure_threshold": 2, "reset_timeout_s": 0.3},
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        # When every call hangs past its deadline for long enough for 20 failed probes (each
        # message would have used up its 5 attempts)
        await async_wait_until(
            lambda: runner.breaker.openings >= 20, timeout=120, message="20 breaker openings"
        )
        assert runner.partitions.counters.dead_letter == 0
        # and the service answers again
        service.behaviour = always(Behaviour())
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=90)
        await proxy.shutdown()
        await task
    # Then every message was acked and none dead-lettered
    assert {d.value for d in service.deliveries if d.outcome == "ACK"} == {
        f"m{i}".encode() for i in range(4)
    }
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq") == []
