"""``delivery.batch: auto`` (the default) end to end: the real broker, real gRPC services.

An SDK service (it serves ``HandleMessageBatch``) gets batches; a hand-written service with
only ``HandleMessage`` gets unary calls, no message delayed, counted or dead-lettered; a
rolling replacement of an instance by the other kind switches it without a restart. The log,
``/readyz`` and ``consumer_proxy_push_instances`` say which.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

import grpc
import pytest

from consumer_proxy import handler as cp
from consumer_proxy.config import ProxyConfig
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.proxy import Proxy
from tests.support.kafka import Broker, consume_all, create_topic, produce, unique_name
from tests.support.proxy import caught_up, config_dict, start_proxy
from tests.support.scrape import http_get, scrape
from tests.support.service import UnaryOnly, serve
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.kafka

# A retry would wait a minute: a message delayed by the detection fails the test's waits.
NO_RETRY_SOON = {"backoff": {"initial_ms": 60_000, "max_ms": 60_000}}


async def serve_unary_only(port: int = 0) -> tuple[grpc.aio.Server, UnaryOnly, int]:
    servicer = UnaryOnly()
    server, bound = await serve(servicer, port)
    return server, servicer, bound


class Recorder:
    """An SDK handler that records what it got."""

    def __init__(self) -> None:
        self.got: list[cp.Message] = []

    async def handle(self, message: cp.Message) -> None:
        self.got.append(message)


def default_config(bootstrap: str, group: str, topic: str, endpoint: str, **delivery: Any) -> Any:
    """A group that does not say ``batch``: the product's default."""
    data = config_dict(bootstrap, group, [topic], [endpoint], delivery=delivery, metrics_port=0)
    del data["groups"][0]["delivery"]["batch"]  # the tests' helper says off; the product not
    return ProxyConfig(**data)


async def batch_calls(proxy: Proxy, group: str) -> float:
    assert proxy.http is not None
    metrics = await scrape(proxy.http.port)
    return metrics.value("consumer_proxy_batch_size_messages_count", group=group) or 0.0


async def instances(proxy: Proxy, group: str) -> dict[str, float]:
    assert proxy.http is not None
    metrics = await scrape(proxy.http.port)
    return {
        mode: metrics.value("consumer_proxy_push_instances", group=group, mode=mode) or 0.0
        for mode in ("batch", "unary", "unknown")
    }


async def test_an_sdk_service_gets_batches_by_default(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an SDK service and a group that does not mention batch
    bootstrap = kafka.bootstrap
    topic, group = unique_name("autosdk"), unique_name("autosdk")
    create_topic(bootstrap, topic, partitions=2)
    caplog.set_level(logging.INFO, logger="consumer_proxy.dispatcher")
    recorder = Recorder()
    async with cp.Server(recorder.handle) as server:
        proxy, task = start_proxy(default_config(bootstrap, group, topic, server.address))
        try:
            # When messages arrive
            await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(300)])
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
            # Then they went in batch calls
            assert await batch_calls(proxy, group) > 0
            assert {m.value for m in recorder.got} >= {f"m{i}".encode() for i in range(300)}
            # and the metric, /readyz and the log (once) say the instance gets batches
            assert await instances(proxy, group) == {"batch": 1, "unary": 0, "unknown": 0}
            assert proxy.http is not None
            status, body = await http_get(proxy.http.port, "/readyz")
            assert status == 200 and f"HandleMessageBatch to {server.address}" in body
            said = [r for r in caplog.records if "answers HandleMessageBatch" in r.message]
            assert len(said) == 1 and server.address in said[0].message
        finally:
            await proxy.shutdown()
            await task


@pytest.mark.parametrize("ordering", ["none", "key", "partition"])
async def test_a_unary_only_service_gets_unary_calls_with_no_message_delayed(
    kafka: Broker, caplog: pytest.LogCaptureFixture, ordering: str
) -> None:
    # Given a hand-written service without HandleMessageBatch, a group that does not mention
    # batch, and retries that would wait a minute
    bootstrap = kafka.bootstrap
    topic, group = unique_name("autounary"), unique_name("autounary")
    create_topic(bootstrap, topic, partitions=2)
    caplog.set_level(logging.INFO, logger="consumer_proxy.dispatcher")
    server, service, port = await serve_unary_only()
    address = f"127.0.0.1:{port}"
    config = default_config(
        bootstrap, group, topic, address, ordering=ordering, rate_limit_per_s=5000, **NO_RETRY_SOON
    )
    proxy, task = start_proxy(config)
    try:
        # When messages arrive (keyed: five keys)
        values = [f"m{i}" for i in range(300)]
        records = [{"key": f"k{i % 5}", "value": v} for i, v in enumerate(values)]
        await asyncio.to_thread(produce, bootstrap, topic, records)
        # Then every one is delivered by a unary call, the first time (no attempt counted,
        # no retry: a retry would wait a minute) and acked
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        got = [(m.value.decode(), m.attempt) for m in service.got]
        assert sorted(got) == sorted((v, 1) for v in values)
        # and the batch method was asked, at most once per call slot before the answer
        assert 1 <= service.batch_calls <= config.groups[0].delivery.concurrency
        # and nothing opened the breaker or went to the DLQ
        assert proxy.runners[0].breaker.openings == 0
        assert proxy.http is not None
        metrics = await scrape(proxy.http.port)
        assert metrics.total("consumer_proxy_dlq_writes_total", group=group) == 0
        # and with key (partition) ordering each key's (partition's) messages came in offset
        # order
        if ordering != "none":
            offsets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
            for m in service.got:
                offsets[(m.partition, m.key if ordering == "key" else b"")].append(m.offset)
            assert all(seq == sorted(seq) for seq in offsets.values())
        # and the metric, /readyz and the log (once) say the instance gets unary calls
        assert await instances(proxy, group) == {"batch": 0, "unary": 1, "unknown": 0}
        status, body = await http_get(proxy.http.port, "/readyz")
        assert status == 200 and f"HandleMessage to {address}" in body
        said = [r for r in caplog.records if "answered UNIMPLEMENTED" in r.message]
        assert len(said) == 1 and address in said[0].message
    finally:
        await proxy.shutdown()
        await task
        await server.stop(None)
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 3.0) == []


async def test_a_unary_only_service_s_retries_go_through_the_retry_tiers(kafka: Broker) -> None:
    # Given a hand-written service without HandleMessageBatch that asks for a retry of every
    # tenth message on its first two attempts, and a group with two retry tiers that does not
    # mention batch
    bootstrap = kafka.bootstrap
    topic, group = unique_name("autotiers"), unique_name("autotiers")
    create_topic(bootstrap, topic, partitions=2)
    retry, ack = handler_pb2.HandleMessageResponse.RETRY, handler_pb2.HandleMessageResponse.ACK

    def answer(m: handler_pb2.Message) -> handler_pb2.HandleMessageResponse:
        flaky = int(m.value[1:]) % 10 == 0 and m.attempt <= 2
        return handler_pb2.HandleMessageResponse(action=retry if flaky else ack)

    server, port = await serve(service := UnaryOnly(answer))
    tiers = [{"delay_ms": 300}, {"delay_ms": 600}]
    config = default_config(
        bootstrap,
        group,
        topic,
        f"127.0.0.1:{port}",
        retry_topics=tiers,
        in_memory_attempts=1,
        max_attempts=5,
    )
    proxy, task = start_proxy(config)
    try:
        # When 100 messages arrive
        values = [f"m{i}" for i in range(100)]
        await asyncio.to_thread(produce, bootstrap, topic, values)
        # Then each flaky one was tried from the source, then from each tier, in unary calls,
        # and acked on its third attempt; every message acked once, none dead-lettered
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        await async_wait_until(
            lambda: _acked(service) == set(values), timeout=60, message="every message acked"
        )
        flaky = sorted(
            (m.value.decode(), m.attempt) for m in service.got if m.value in {b"m0", b"m10"}
        )
        assert flaky == [("m0", 1), ("m0", 2), ("m0", 3), ("m10", 1), ("m10", 2), ("m10", 3)]
        sources = {m.attempt: m.source for m in service.got if m.value == b"m0"}
        assert sources == {
            1: handler_pb2.DELIVERY_SOURCE_PRIMARY,
            2: handler_pb2.DELIVERY_SOURCE_RETRY,
            3: handler_pb2.DELIVERY_SOURCE_RETRY,
        }
        assert await instances(proxy, group) == {"batch": 0, "unary": 1, "unknown": 0}
        assert proxy.runners[0].breaker.openings == 0
    finally:
        await proxy.shutdown()
        await task
        await server.stop(None)
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 3.0) == []


def _acked(service: UnaryOnly) -> set[str]:
    """The values the service acked (every answer but the flaky first two)."""
    return {
        m.value.decode() for m in service.got if not (int(m.value[1:]) % 10 == 0 and m.attempt <= 2)
    }


async def test_a_rolling_replacement_switches_the_instance_without_a_restart(
    kafka: Broker,
) -> None:
    # Given a unary-only instance behind a group that does not mention batch
    bootstrap = kafka.bootstrap
    topic, group = unique_name("autoroll"), unique_name("autoroll")
    create_topic(bootstrap, topic, partitions=2)
    server, unary, port = await serve_unary_only()
    address = f"127.0.0.1:{port}"
    proxy, task = start_proxy(default_config(bootstrap, group, topic, address, **NO_RETRY_SOON))
    runner = proxy.runners[0]

    async def deliver(values: list[str]) -> None:
        await asyncio.to_thread(produce, bootstrap, topic, values)
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)

    try:
        await deliver([f"a{i}" for i in range(50)])
        assert await instances(proxy, group) == {"batch": 0, "unary": 1, "unknown": 0}
        assert {m.value for m in unary.got} == {f"a{i}".encode() for i in range(50)}
        # When a rolling deploy replaces it, at the same address, by an SDK build
        await server.stop(None)
        await async_wait_until(lambda: "not asked yet" in runner.push_detail, timeout=30)
        recorder = Recorder()
        async with cp.Server(recorder.handle, port=port):
            before = await batch_calls(proxy, group)
            await deliver([f"b{i}" for i in range(50)])
            # Then the new build gets batches, each message the first time
            assert await batch_calls(proxy, group) > before
            assert await instances(proxy, group) == {"batch": 1, "unary": 0, "unknown": 0}
            assert sorted((m.value, m.attempt) for m in recorder.got) == sorted(
                (f"b{i}".encode(), 1) for i in range(50)
            )
        # When it is replaced again by the unary-only build
        server, unary, _ = await serve_unary_only(port)
        await deliver([f"c{i}" for i in range(50)])
        # Then unary calls carry every message, the first time, none dead-lettered
        assert sorted((m.value, m.attempt) for m in unary.got) == sorted(
            (f"c{i}".encode(), 1) for i in range(50)
        )
        assert await instances(proxy, group) == {"batch": 0, "unary": 1, "unknown": 0}
        assert runner.breaker.openings == 0
    finally:
        await proxy.shutdown()
        await task
        await server.stop(None)
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 3.0) == []
