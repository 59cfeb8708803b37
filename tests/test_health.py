"""The proxy's own health: grpc.health.v1 and /readyz follow the service's outages."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import pytest
from confluent_kafka import Consumer, KafkaError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer_proxy.config import HealthConfig, ProxyConfig
from consumer_proxy.health import KafkaLink
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import (
    Broker,
    alter_topic,
    consume_all,
    create_topic,
    produce,
    unique_name,
)
from tests.support.proxy import caught_up, config_dict, make_config, start_proxy
from tests.support.scrape import http_get, scrape
from tests.support.service import Behaviour, TestService
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

T = TypeVar("T")


async def test_health_follows_the_service_down_and_back_up(kafka: Broker) -> None:
    await _service_outage(kafka.bootstrap)


async def _service_outage(bootstrap: str) -> None:
    # Given a proxy with gRPC health and /readyz, a breaker that opens after 3 failures
    topic, group = unique_name("health"), unique_name("health")
    create_topic(bootstrap, topic, partitions=2)
    async with TestService() as service:
        config = make_config(
            bootstrap,
            group,
            [topic],
            [service.address],
            breaker={"failure_threshold": 3, "reset_timeout_s": 0.5},
            metrics_port=0,
        ).model_copy(update={"health": HealthConfig(grpc_port=0, host="127.0.0.1")})
        proxy, task = start_proxy(config)
        channel: grpc.aio.Channel | None = None
        try:
            await async_wait_until(lambda: proxy.health._port, timeout=30)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{proxy.health.port}")
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                request = health_pb2.HealthCheckRequest(service=name)
                # grpc_health ships no py.typed: its messages and stubs are Any to mypy
                serving: int = (await stub.Check(request, timeout=5)).status
                return serving

            async def probes() -> tuple[int, int, int]:
                assert proxy.http is not None
                ready, _ = await http_get(proxy.http.port, "/readyz")
                return await status(""), await status(group), ready

            # When the consumer is up and the service answers
            await async_wait_until(
                lambda: _equals(probes(), (SERVING, SERVING, 200)),
                timeout=30,
                message="SERVING once the consumer is up",
            )
            await asyncio.to_thread(produce, bootstrap, topic, [f"a{i}" for i in range(20)])
            await async_wait_until(lambda: len(service.counts) == 20, timeout=30)
            # Then the proxy is serving overall and for the group; an unknown name is NOT_FOUND
            assert await probes() == (SERVING, SERVING, 200)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await status("no-such-group")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

            # When the service dies while messages keep coming
            await service.stop()
            await asyncio.to_thread(produce, bootstrap, topic, [f"b{i}" for i in range(20)])
            # Then the breaker opens and both probes say not serving, with the reason
            await async_wait_until(
                lambda: _equals(probes(), (NOT_SERVING, NOT_SERVING, 503)),
                timeout=30,
                message="NOT_SERVING while the breaker is open",
            )
            assert proxy.runners[0].breaker.is_open
            assert proxy.http is not None
            _, detail = await http_get(proxy.http.port, "/readyz")
            assert f"{group}: circuit" in detail and "the service is failing" in detail
            _, healthz = await http_get(proxy.http.port, "/healthz")
            assert healthz == "ok\n"  # alive all the same: a restart would not help
            # ... and the pod itself is ready (the chart's readiness probe): another team's
            # outage must not hold a rollout of the proxy
            assert await http_get(proxy.http.port, "/readyz/pod") == (200, "pod ready\n")

            # When the service comes back on the same port
            await service.restart()
            # Then a probe closes the breaker and the proxy serves again
            await async_wait_until(
                lambda: _equals(probes(), (SERVING, SERVING, 200)),
                timeout=60,
                message="SERVING again after the service returned",
            )
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        finally:
            await proxy.shutdown()
            await task
            if channel is not None:
                await channel.close()

    # and the outage dead-lettered nothing: every message was acked
    acked = {d.value for d in service.deliveries if d.outcome == "ACK"}
    assert acked == {f"{p}{i}".encode() for p in "ab" for i in range(20)}
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 5) == []


async def _equals(awaitable: Awaitable[T], expected: T) -> bool:
    return (await awaitable) == expected


async def test_the_proxy_health_says_not_serving_while_shutting_down(kafka: Broker) -> None:
    await _shutdown(kafka.bootstrap)


async def _shutdown(bootstrap: str) -> None:
    topic, group = unique_name("health-stop"), unique_name("health-stop")
    create_topic(bootstrap, topic, partitions=1)
    async with TestService() as service:
        config = make_config(bootstrap, group, [topic], [service.address]).model_copy(
            update={"health": HealthConfig(grpc_port=0, host="127.0.0.1")}
        )
        proxy, task = start_proxy(config)
        await async_wait_until(lambda: proxy.ready()[0], timeout=30)
        assert proxy.ready() == (True, "ready")
        # When shutdown begins, readiness drops before the groups have drained
        proxy.request_shutdown()
        await async_wait_until(lambda: not proxy.ready()[0], timeout=5)
        assert proxy.ready() == (False, f"{group}: shutting down")
        await task


async def test_a_dlq_that_refuses_records_makes_readyz_not_ready(kafka: Broker) -> None:
    await _dlq_refuses(kafka.bootstrap)


async def _dlq_refuses(bootstrap: str) -> None:
    # Given a DLQ topic created beforehand with a max.message.bytes too small for a poison pill
    topic, group = unique_name("dlqready"), unique_name("dlqready")
    dlq = f"{group}.dlq"
    create_topic(bootstrap, topic, partitions=1)
    create_topic(bootstrap, dlq, partitions=1, config={"max.message.bytes": "200"})

    def behaviour(msg: handler_pb2.Message, n: int) -> Behaviour:
        if msg.value.startswith(b"poison"):
            return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="cannot parse")
        return Behaviour()

    async with TestService(behaviour) as service:
        config = make_config(bootstrap, group, [topic], [service.address], metrics_port=0)
        proxy, task = start_proxy(config)
        try:
            await async_wait_until(lambda: proxy.ready()[0], timeout=30)
            assert proxy.http is not None
            port = proxy.http.port

            async def readyz() -> tuple[int, str]:
                return await http_get(port, "/readyz")

            # When a poison pill cannot be dead-lettered
            values = ["a", "poison " + "x" * 1000, "b"]
            await asyncio.to_thread(produce, bootstrap, topic, values)
            # Then /readyz says not ready, naming the DLQ and the reason
            _, detail = await async_wait_until(
                lambda: _when(readyz(), lambda r: r[0] == 503),
                timeout=30,
                message="/readyz to answer 503 while the DLQ refuses the record",
            )
            assert detail.startswith(f"{group}: DLQ {dlq} refuses records (record_too_large: ")
            assert "1 dead letter waits" in detail
            # and the metrics count the failures by reason and show the message held
            metrics = await scrape(port)
            errors = metrics.value(
                "consumer_proxy_dlq_write_errors_total", group=group, reason="record_too_large"
            )
            assert errors is not None and errors >= 1
            assert metrics.value("consumer_proxy_dlq_held_messages", group=group) == 1
            # When the topic is fixed
            await asyncio.to_thread(alter_topic, bootstrap, dlq, {"max.message.bytes": "1048588"})
            # Then the proxy recovers by itself: ready again, nothing held, the commit at the end
            await async_wait_until(
                lambda: _when(readyz(), lambda r: r == (200, "ready\n")),
                timeout=60,
                message="/readyz to answer 200 once the DLQ accepts the record",
            )
            metrics = await scrape(port)
            assert metrics.value("consumer_proxy_dlq_held_messages", group=group) == 0
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        finally:
            await proxy.shutdown()
            await task
    assert len(await asyncio.to_thread(consume_all, bootstrap, dlq)) == 1


async def _when(awaitable: Awaitable[T], accept: Callable[[T], bool]) -> T | None:
    value = await awaitable
    return value if accept(value) else None


def test_kafka_reachability_comes_from_the_consumers_statistics(kafka: Broker) -> None:
    # Given one consumer on the real broker and one on a port where nothing listens
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    links: dict[str, KafkaLink] = {}
    consumers: list[Consumer] = []
    for name, bootstrap in (("live", kafka.bootstrap), ("dead", dead)):
        link = KafkaLink()
        conf = {
            "bootstrap.servers": bootstrap,
            "group.id": unique_name("link"),
            "statistics.interval.ms": 200,
            "log_level": 0,
        }
        link.attach(conf)
        consumer = Consumer(conf)
        consumer.subscribe([unique_name("absent")])
        links[name], consumers = link, [*consumers, consumer]

    try:
        # When both have polled for a while
        def reported() -> bool:
            for consumer in consumers:
                consumer.poll(0.1)
            return all(link.reachable is not None for link in links.values())

        wait_until(reported, timeout=30)
        wait_until(lambda: [c.poll(0.1) for c in consumers] and links["live"].reachable, timeout=30)
    finally:
        for consumer in consumers:
            consumer.close()

    # Then only the consumer with a broker connection counts as reaching Kafka
    assert links["live"].reachable is True
    assert links["dead"].reachable is False
    assert links["dead"].detail.startswith("cannot reach Kafka: no broker connection is up (")
    assert dead in links["dead"].detail


def test_a_users_statistics_interval_wins_and_zero_turns_the_check_off() -> None:
    link = KafkaLink()
    conf = {"statistics.interval.ms": 0}
    link.attach(conf)
    assert conf["statistics.interval.ms"] == 0 and link.enabled is False
    assert callable(conf["stats_cb"])
    link.on_stats("not json")  # ignored, never raised on the consumer thread
    assert link.reachable is None


def test_the_link_tells_a_change_of_reachability_once() -> None:
    # Given a link whose changes are watched (the runner wakes the health publisher with it)
    link = KafkaLink()
    changes: list[bool | None] = []
    link.on_change = lambda: changes.append(link.reachable)

    def stats(state: str) -> str:
        return json.dumps({"brokers": {"b:9092/1": {"name": "b:9092/1", "state": state}}})

    # When statistics arrive: up, up again, down, down again, up
    for state in ("UP", "UP", "DOWN", "DOWN", "UP"):
        link.on_stats(stats(state))
    # Then each change is told once, and repeated statistics tell nothing
    assert changes == [True, False, True]


def test_a_successful_call_or_all_brokers_down_change_reachability_at_once() -> None:
    # Given a link whose statistics come seldom (15 s by default for a consumer)
    link = KafkaLink()
    conf: dict[str, object] = {}
    link.attach(conf)
    assert conf["statistics.interval.ms"] == 15000 and callable(conf["error_cb"])
    changes: list[bool | None] = []
    link.on_change = lambda: changes.append(link.reachable)
    # When a call that needs a broker succeeds (a rebalance callback, a commit), twice
    link.confirm()
    link.confirm()
    # Then the link is reachable at once, told once
    assert (link.reachable, link.detail, changes) == (True, "connected to Kafka", [True])
    # When librdkafka reports another error, then that every broker connection is down
    link.on_error(KafkaError(KafkaError._TRANSPORT, "b:9092/1: Connection refused"))
    assert link.reachable is True
    link.on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    # Then only the second makes it unreachable, naming why; a success turns it back
    assert link.reachable is False and "1/1 brokers are down" in link.detail
    link.confirm()
    assert changes == [True, False, True]


async def test_a_new_group_is_ready_before_its_first_statistics(kafka: Broker) -> None:
    await _ready_without_statistics(kafka.bootstrap)


async def _ready_without_statistics(bootstrap: str) -> None:
    # Given a group whose consumer's statistics would first arrive after ten minutes
    topic, group = unique_name("readynostats"), unique_name("readynostats")
    create_topic(bootstrap, topic, partitions=1)
    async with TestService() as service:
        config = ProxyConfig(
            **config_dict(
                bootstrap,
                group,
                [topic],
                [service.address],
                client={"statistics.interval.ms": 600_000},
            )
        )
        proxy, task = start_proxy(config)
        runner = proxy.runners[0]
        # When the group joins: then it is ready, Kafka reachable from the assignment alone
        await async_wait_until(lambda: proxy.ready()[0], timeout=60)
        assert runner.kafka_link.reachable is True
        assert runner.kafka_link.detail == "connected to Kafka"
        await proxy.shutdown()
        await task
