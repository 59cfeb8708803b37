"""Batch push (``delivery.batch``) end to end: the real broker and real gRPC services.

Every outcome of a mixed run is the same as in unary mode; a service outage dead-letters
nothing; a service without ``HandleMessageBatch`` is an outage said in the log, /readyz and
a metric; a wrong-length answer is retried without counting; a kill -9 loses nothing.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from consumer_proxy.core import records as dlq_records
from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.kafka import (
    Broker,
    committed_offsets,
    consume_all,
    create_topic,
    end_offsets,
    produce,
    unique_name,
)
from tests.support.ledger import Ledger
from tests.support.proxy import (
    ProxyProcess,
    caught_up,
    caught_up_now,
    make_config,
    start_proxy,
    write_config,
)
from tests.support.scrape import http_get, scrape
from tests.support.service import (
    DROP,
    RETRY,
    Behaviour,
    TestService,
    ThreadedService,
    UnaryOnly,
    serve,
)
from tests.support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.kafka

BATCH = {"max_messages": 20}


def _kind(i: int) -> str:
    if i % 40 == 0:
        return "poison"
    if i % 40 == 1:
        return "drop"
    if i % 40 == 6:
        return "hopeless"  # fails every attempt: dead-lettered after max_attempts
    if i % 10 == 2:
        return "retry"
    if i % 10 == 3:
        return "flaky"
    if i % 25 == 5:
        return "db-down"  # UNAVAILABLE once: an outage signal, never an attempt
    if i % 50 == 4:
        return "slow"
    return "ok"


def mixed(msg: handler_pb2.Message, n: int) -> Behaviour:
    """The same answer in both modes, decided by the message and its delivery count only."""
    kind = msg.value.decode().split(":")[0]
    if kind == "poison":
        return Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="bad payload")
    if kind == "drop":
        return Behaviour(action=DROP)
    if kind == "hopeless":
        return Behaviour(status=grpc.StatusCode.INTERNAL, details="always fails")
    if kind == "retry" and n <= 2:
        return Behaviour(action=RETRY, retry_after_ms=10, reason="not yet")
    if kind == "flaky" and n == 1:
        return Behaviour(status=grpc.StatusCode.INTERNAL, details="flaky")
    if kind == "db-down" and n == 1:
        return Behaviour(status=grpc.StatusCode.UNAVAILABLE, details="database down")
    if kind == "slow":
        return Behaviour(delay_s=0.3)
    return Behaviour(delay_s=0.002)


def _dead(bootstrap: str, group: str) -> dict[str, tuple[str, str]]:
    """{value: (cp-status, cp-reason)} of the group's DLQ."""
    out = {}
    for m in consume_all(bootstrap, f"{group}.dlq"):
        _, ours = dlq_records.split_headers(m.headers())
        out[(m.value() or b"").decode()] = (ours[dlq_records.H_STATUS], ours[dlq_records.H_REASON])
    return out


async def test_a_mixed_run_ends_in_batch_mode_exactly_as_in_unary_mode(kafka: Broker) -> None:
    await _mixed(kafka.bootstrap)


async def _mixed(bootstrap: str) -> None:
    # Given 400 messages over 4 partitions: ok, slow, retried, flaky, poison, dropped,
    # hopeless and "database down" once
    topic = unique_name("mixed")
    create_topic(bootstrap, topic, partitions=4)
    values = [f"{_kind(i)}:{i}" for i in range(400)]
    await asyncio.to_thread(produce, bootstrap, topic, values)
    unary_group, batch_group = unique_name("unary"), unique_name("batch")
    delivery = {"concurrency": 4, "max_attempts": 3}
    # ... and the same service twice: one answering unary calls, one batch calls with
    # per-message statuses (as the SDK does)
    async with (
        TestService(mixed) as unary_service,
        TestService(mixed, per_message_status=True) as batch_service,
    ):
        # When one group reads the topic in unary mode and another in batch mode
        unary, unary_task = start_proxy(
            make_config(bootstrap, unary_group, [topic], [unary_service.address], delivery=delivery)
        )
        batched, batch_task = start_proxy(
            make_config(
                bootstrap,
                batch_group,
                [topic],
                [batch_service.address],
                delivery={**delivery, "batch": BATCH},
                metrics_port=0,
            )
        )
        try:
            await async_wait_until(lambda: caught_up(bootstrap, unary_group, topic), timeout=90)
            await async_wait_until(lambda: caught_up(bootstrap, batch_group, topic), timeout=90)
            assert batched.http is not None
            metrics = await scrape(batched.http.port)
        finally:
            await unary.shutdown()
            await batched.shutdown()
            await asyncio.gather(unary_task, batch_task)

    # Then the batch group got only batch calls, several messages per call
    assert all(d.batch for d in batch_service.deliveries)
    assert not any(d.batch for d in unary_service.deliveries)
    calls = batch_service.batch_calls
    assert max(calls) > 1 and max(calls) <= BATCH["max_messages"]
    histogram = (
        "consumer_proxy_batch_size_messages_count",
        "consumer_proxy_batch_size_messages_sum",
    )
    assert metrics.value(histogram[0], group=batch_group) == len(calls)
    assert metrics.value(histogram[1], group=batch_group) == sum(calls)

    # and every message ended the same way in both modes: acked, dropped or dead-lettered
    # with the same status and reason
    def ended(service: TestService) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for d in service.deliveries:
            out.setdefault((d.value or b"").decode(), set()).add(d.outcome)
        return out

    assert ended(batch_service) == ended(unary_service)
    acked = {v for v, o in ended(batch_service).items() if "ACK" in o}
    assert acked == {v for v in values if v.split(":")[0] not in ("poison", "drop", "hopeless")}
    dead_unary, dead_batch = await asyncio.gather(
        asyncio.to_thread(_dead, bootstrap, unary_group),
        asyncio.to_thread(_dead, bootstrap, batch_group),
    )
    assert dead_batch == dead_unary
    assert set(dead_batch) == {v for v in values if v.split(":")[0] in ("poison", "hopeless")}
    assert {s for s, _ in dead_batch.values()} == {"INVALID_ARGUMENT", "INTERNAL"}
    # and the same number of deliveries per message (the "database down" one: not counted)
    assert batch_service.counts == unary_service.counts


@pytest.mark.parametrize("where", ["call", "per-message"])
async def test_a_batch_service_outage_dead_letters_nothing(kafka: Broker, where: str) -> None:
    await _outage(kafka.bootstrap, where)


async def _outage(bootstrap: str, where: str) -> None:
    # Given a batch group whose every attempt would be its last (max_attempts 1) and a
    # service that is down: UNAVAILABLE for whole calls, or for every message of each call
    topic, group = unique_name("outage"), unique_name("outage")
    create_topic(bootstrap, topic, partitions=4)
    down = Behaviour(status=grpc.StatusCode.UNAVAILABLE, details="database down")
    async with TestService(
        lambda _m, _n: down, per_message_status=where == "per-message"
    ) as service:
        proxy, task = start_proxy(
            make_config(
                bootstrap,
                group,
                [topic],
                [service.address],
                delivery={"batch": BATCH, "max_attempts": 1, "concurrency": 2},
                breaker={"failure_threshold": 3, "reset_timeout_s": 0.3},
                metrics_port=0,
            )
        )
        try:
            # When 200 messages arrive during the outage
            await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(200)])
            # Then the breaker opens
            await async_wait_until(lambda: proxy.runners[0].breaker.is_open, timeout=30)
            opened_after = len(service.batch_calls)
            await async_wait_until(lambda: len(service.batch_calls) > opened_after, timeout=30)
            # and when the service recovers, everything is acked
            service.behaviour = lambda _m, _n: Behaviour()
            await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
            assert proxy.http is not None
            metrics = await scrape(proxy.http.port)
        finally:
            await proxy.shutdown()
            await task
    # and nothing was dead-lettered
    assert metrics.total("consumer_proxy_dlq_writes_total", group=group) == 0
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 3.0) == []
    acked = {d.value for d in service.deliveries if d.outcome == "ACK"}
    assert acked == {f"m{i}".encode() for i in range(200)}
    # and the breaker opened after 3 failed calls, not 3 failed messages: a call carried more
    assert opened_after >= 3


async def test_a_service_without_handle_message_batch_is_an_outage_said_everywhere(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await _unimplemented(kafka.bootstrap, caplog)


async def _unimplemented(bootstrap: str, caplog: pytest.LogCaptureFixture) -> None:
    # Given a batch group (UNIMPLEMENTED even dead-letters in its unary table) and a service
    # that implements only HandleMessage
    topic, group = unique_name("noimpl"), unique_name("noimpl")
    create_topic(bootstrap, topic, partitions=2)
    servicer = UnaryOnly()
    server, port = await serve(servicer)
    caplog.set_level(logging.ERROR, logger="consumer_proxy")
    proxy, task = start_proxy(
        make_config(
            bootstrap,
            group,
            [topic],
            [f"127.0.0.1:{port}"],
            delivery={
                "batch": {},
                "max_attempts": 1,
                "status_overrides": {"UNIMPLEMENTED": "dead_letter"},
            },
            breaker={"failure_threshold": 2, "reset_timeout_s": 0.3},
            metrics_port=0,
        )
    )
    try:
        # When messages arrive
        await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(30)])
        assert proxy.http is not None
        http = proxy.http.port

        async def readyz() -> tuple[int, str]:
            return await http_get(http, "/readyz")

        # Then /readyz says why the group is not ready
        status, body = await async_wait_until(
            lambda: _when(readyz(), lambda r: "does not implement HandleMessageBatch" in r[1]),
            timeout=30,
        )
        assert status == 503 and group in body
        # and a metric says it
        metrics = await scrape(http)
        assert metrics.value("consumer_proxy_batch_unsupported", group=group) == 1
        # and so does the log, once, naming the instance
        said = [r for r in caplog.records if "does not implement HandleMessageBatch" in r.message]
        assert said and f"127.0.0.1:{port}" in said[0].message
        # and the breaker keeps probing: the messages wait, none is dead-lettered nor pushed
        # through HandleMessage
        await async_wait_until(
            lambda: proxy.runners[0].breaker.is_open and proxy.runners[0].breaker.openings >= 2,
            timeout=30,
        )
        assert servicer.got == []
        assert metrics.total("consumer_proxy_dlq_writes_total", group=group) == 0
        assert not await caught_up(bootstrap, group, topic)
    finally:
        await proxy.shutdown()
        await task
        await server.stop(None)
    assert await asyncio.to_thread(consume_all, bootstrap, f"{group}.dlq", 3.0) == []


async def _when(awaitable: Any, check: Any) -> Any:
    value = await awaitable
    return value if check(value) else None


class _WrongLength(handler_pb2_grpc.MessageHandlerServicer):
    """Answers each batch of several messages holding one seen for the first time with one
    result too few (odd calls) or too many (even calls); then acks. (A wrong answer to a
    batch of one would be that message's counted failure: those are answered right.)"""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.acked: list[bytes] = []
        self.calls = 0

    async def HandleMessage(self, request: Any, context: Any) -> Any:
        return handler_pb2.HandleMessageResponse()

    async def HandleMessageBatch(self, request: Any, context: Any) -> Any:
        self.calls += 1
        fresh = [(m.partition, m.offset) for m in request.messages]
        n = len(request.messages)
        if n > 1 and not set(fresh) <= self.seen:
            self.seen.update(fresh)
            n = n - 1 if self.calls % 2 else n + 1
        else:
            self.acked += [m.value for m in request.messages]
        return handler_pb2.HandleMessageBatchResponse(
            results=[handler_pb2.HandleMessageResponse()] * n
        )

    def HandleMessageStream(self, request: Any, context: Any) -> Any:
        raise NotImplementedError  # never called: these groups push in batches


async def test_a_wrong_length_answer_is_retried_without_counting_an_attempt(
    kafka: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    await _wrong_length(kafka.bootstrap, caplog)


async def _wrong_length(bootstrap: str, caplog: pytest.LogCaptureFixture) -> None:
    # Given a service answering the wrong number of results to every first delivery, a
    # group with max_attempts 1 and a breaker that opens on the first failure
    topic, group = unique_name("wronglen"), unique_name("wronglen")
    create_topic(bootstrap, topic, partitions=2)
    servicer = _WrongLength()
    server, port = await serve(servicer)
    caplog.set_level(logging.WARNING, logger="consumer_proxy")
    proxy, task = start_proxy(
        make_config(
            bootstrap,
            group,
            [topic],
            [f"127.0.0.1:{port}"],
            delivery={"batch": BATCH, "max_attempts": 1},
            breaker={"failure_threshold": 1, "reset_timeout_s": 30},
            metrics_port=0,
        )
    )
    try:
        # When 100 messages go through
        await asyncio.to_thread(produce, bootstrap, topic, [f"m{i}" for i in range(100)])
        await async_wait_until(lambda: caught_up(bootstrap, group, topic), timeout=60)
        assert proxy.http is not None
        metrics = await scrape(proxy.http.port)
    finally:
        await proxy.shutdown()
        await task
        await server.stop(None)
    # Then every message was acked, none dead-lettered, the breaker never opened
    assert sorted(servicer.acked) == sorted(f"m{i}".encode() for i in range(100))
    assert metrics.total("consumer_proxy_dlq_writes_total", group=group) == 0
    assert metrics.total("consumer_proxy_circuit_transitions_total", group=group) == 0
    # and each protocol error was counted and logged with the endpoint
    errors = metrics.value("consumer_proxy_batch_protocol_errors_total", group=group)
    assert errors is not None and errors >= 2
    logged = [r.message for r in caplog.records if "protocol error" in r.message]
    assert logged and all(f"127.0.0.1:{port}" in m for m in logged)
    assert any("answered" in m and "results for" in m for m in logged)


def test_kill_9_in_batch_mode_loses_nothing(kafka: Broker, tmp_path: Path) -> None:
    # Given 4 partitions of 3000 ledger messages and a batch service taking 5 ms per call
    bootstrap = kafka.bootstrap
    topic, group = unique_name("kill9b"), unique_name("kill9b")
    partitions, window, n, kills = 4, 200, 3000, 3
    create_topic(bootstrap, topic, partitions=partitions)
    ledger = Ledger(f"kill -9 the proxy in batch mode x{kills}")
    produce(bootstrap, topic, ledger.records(n, partitions=partitions))
    with ThreadedService(lambda m, k: Behaviour(delay_s=0.005), per_message_status=True) as service:
        config = write_config(
            tmp_path / "proxy.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery={"concurrency": 4, "max_in_flight": window, "batch": BATCH},
            client={"session.timeout.ms": 3000, "heartbeat.interval.ms": 300},
        )
        log = tmp_path / "proxy.log"

        def acks() -> int:
            return sum(1 for d in service.deliveries if d.outcome == "ACK")

        # When the proxy process is killed with SIGKILL three times while it delivers
        for _ in range(kills):
            target = acks() + 400
            proxy = ProxyProcess(config, log).start()
            try:

                def moved_on(t: int = target, p: ProxyProcess = proxy) -> bool:
                    return acks() >= t or not p.alive()

                wait_until(moved_on, timeout=90)
                assert proxy.alive(), proxy.output()[-3000:]
            finally:
                proxy.kill()
        # and started once more to finish
        proxy = ProxyProcess(config, log).start()
        try:

            def finished() -> bool:
                return caught_up_now(bootstrap, group, topic)

            wait_until(finished, timeout=120, interval=0.3)
        finally:
            code = proxy.stop()
        assert code == 0, proxy.output()[-3000:]
        ledger.observe(service.deliveries)
        assert max(service.service.batch_calls) > 1
    # Then nothing is lost, and at most the windows plus one commit interval of acks came again
    ledger.note(f"{kills} SIGKILLs, batch mode")
    # A kill redelivers what was in the windows plus what was acked since the last commit
    # (one commit interval, 200 ms here): the busiest 200 ms of acks bounds the second term.
    done = sorted(d.finished_at for d in service.deliveries if d.finished_at and d.outcome == "ACK")
    busiest = max((bisect.bisect_right(done, t + 0.2) - k for k, t in enumerate(done)), default=0)
    ledger.check(
        max_duplicates=kills * (partitions * window + busiest),
        bound=f"{kills} kills x ({partitions} partitions x max_in_flight {window} + "
        f"{busiest} acks in the busiest commit interval)",
    )
    ends = end_offsets(bootstrap, topic)
    assert {p: c[0] for p, c in committed_offsets(bootstrap, group, topic).items()} == ends
