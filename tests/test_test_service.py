"""The programmable test service honours what the test asks of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.service import (
    DEAD_LETTER,
    DROP,
    EMPTY,
    RETRY,
    SERVICE_NAME,
    Behaviour,
    TestService,
    ThreadedService,
    ack_all,
    always,
)

Response = handler_pb2.HandleMessageResponse


def request(offset: int = 0, **fields: Any) -> handler_pb2.HandleMessageRequest:
    values: dict[str, Any] = {"topic": "t", "partition": 0, "offset": offset, "attempt": 1}
    values.update(fields)
    return handler_pb2.HandleMessageRequest(message=handler_pb2.Message(**values))


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


async def status_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_it_acks_with_an_empty_response_and_records_the_delivery() -> None:
    async with (
        TestService() as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        response = await stub.HandleMessage(
            request(
                offset=5,
                key=b"k",
                has_key=True,
                headers=[handler_pb2.Header(key="h", value=b"1")],
                attempt=2,
                consumer_group="billing",
                source=handler_pb2.DELIVERY_SOURCE_REDRIVE,
                timestamp_ms=123,
            ),
            timeout=5,
        )
        assert response == Response()

        [delivery] = service.deliveries
        assert delivery.coordinates == ("t", 0, 5)
        assert (delivery.key, delivery.value) == (b"k", None)
        assert delivery.headers == (("h", b"1"),)
        assert (delivery.attempt, delivery.source, delivery.consumer_group) == (
            2,
            "redrive",
            "billing",
        )
        assert (delivery.timestamp_ms, delivery.n, delivery.batch) == (123, 1, False)
        assert delivery.outcome == "ACK"
        assert delivery.finished_at is not None
        assert delivery.finished_at >= delivery.received_at
        assert service.address == f"127.0.0.1:{service.port}"


@pytest.mark.parametrize(
    ("behaviour", "outcome"),
    [
        (Behaviour(action=RETRY, retry_after_ms=50, reason="later"), "RETRY"),
        (Behaviour(action=DEAD_LETTER, reason="bad"), "DEAD_LETTER"),
        (Behaviour(action=DROP), "DROP"),
    ],
)
async def test_it_answers_the_chosen_action(behaviour: Behaviour, outcome: str) -> None:
    async with (
        TestService(always(behaviour)) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        response = await stub.HandleMessage(request(), timeout=5)
        assert (response.action, response.retry_after_ms, response.reason) == (
            behaviour.action,
            behaviour.retry_after_ms,
            behaviour.reason,
        )
        assert service.outcomes() == {outcome: 1}


async def test_it_answers_the_chosen_status() -> None:
    behaviour = Behaviour(status=grpc.StatusCode.INVALID_ARGUMENT, details="cannot parse")
    async with (
        TestService(always(behaviour)) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "cannot parse"
        assert service.outcomes() == {"INVALID_ARGUMENT": 1}


async def test_it_waits_the_chosen_delay_and_records_a_caller_that_gave_up() -> None:
    async with (
        TestService(lambda msg, _n: Behaviour(delay_s=msg.offset / 10)) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        started = time.monotonic()
        await stub.HandleMessage(request(offset=2), timeout=5)
        assert time.monotonic() - started >= 0.2

        code = await status_of(stub.HandleMessage(request(offset=50), timeout=0.2))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: service.outcomes() == {"ACK": 1, "CANCELLED": 1})


async def test_the_behaviour_sees_how_often_an_offset_was_delivered() -> None:
    def fail_twice(_msg: handler_pb2.Message, n: int) -> Behaviour:
        return Behaviour(action=RETRY) if n < 3 else Behaviour()

    async with (
        TestService(fail_twice) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        actions = [
            (await stub.HandleMessage(request(offset=7), timeout=5)).action for _ in range(3)
        ]
        await stub.HandleMessage(request(offset=8), timeout=5)

        assert actions == [RETRY, RETRY, EMPTY]
        assert [d.n for d in service.deliveries] == [1, 2, 3, 1]
        assert service.count("t", 0, 7) == 3
        assert service.counts == {("t", 0, 7): 3, ("t", 0, 8): 1}

        service.reset()
        assert service.deliveries == []
        assert service.count("t", 0, 7) == 0


async def test_a_concurrency_limit_refuses_calls_beyond_it() -> None:
    async with (
        TestService(always(Behaviour(delay_s=60)), max_concurrency=2) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        held = [
            asyncio.ensure_future(stub.HandleMessage(request(offset=i), timeout=30))
            for i in range(2)
        ]
        await eventually(lambda: service.in_flight == 2)

        code = await status_of(stub.HandleMessage(request(offset=9), timeout=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert service.rejected == 1
        assert service.count("t", 0, 9) == 0  # a refused call is not a delivery

        for call in held:
            call.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await eventually(lambda: service.in_flight == 0)
        assert service.peak_in_flight == 2
        assert service.outcomes() == {"CANCELLED": 2}

        service.behaviour = ack_all
        assert await stub.HandleMessage(request(offset=9), timeout=5) == Response()


async def test_health_can_be_switched() -> None:
    async with (
        TestService() as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)

        async def status(name: str) -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            return int(reply.status)

        assert await status("") == health_pb2.HealthCheckResponse.SERVING
        assert await status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        await service.set_health(False)
        assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        await service.set_health(True)
        assert await status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING


async def test_a_crash_fails_in_flight_calls_and_refuses_connections_until_restart() -> None:
    def crash_on_1(msg: handler_pb2.Message, _n: int) -> Behaviour:
        return Behaviour(crash=True) if msg.offset == 1 else Behaviour(delay_s=60)

    async with TestService(crash_on_1) as service:
        port = service.port
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            bystander = asyncio.ensure_future(status_of(stub.HandleMessage(request(0))))
            await eventually(lambda: service.in_flight == 1)

            crashing = await status_of(stub.HandleMessage(request(offset=1), timeout=5))
            assert crashing in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
            assert await bystander in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
            await eventually(lambda: not service.running)
            assert service.crashes == 1
            code = await status_of(stub.HandleMessage(request(offset=2), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE

        service.behaviour = ack_all
        await service.restart()
        assert service.port == port
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            assert await stub.HandleMessage(request(offset=3), timeout=5) == Response()
        assert [d.outcome for d in service.deliveries] == ["CANCELLED", "CRASH", "ACK"]


async def test_a_failing_behaviour_is_an_internal_error_and_is_kept() -> None:
    def broken(_msg: handler_pb2.Message, _n: int) -> Behaviour:
        raise ZeroDivisionError("oops")

    async with (
        TestService(broken) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        code = await status_of(stub.HandleMessage(request(), timeout=5))
        assert code == grpc.StatusCode.INTERNAL
        assert [type(e) for e in service.errors] == [ZeroDivisionError]
        assert service.outcomes() == {"BEHAVIOUR_ERROR": 1}


async def test_a_batch_plays_each_behaviour_and_answers_in_order() -> None:
    def by_offset(msg: handler_pb2.Message, _n: int) -> Behaviour:
        # Earlier messages take longer, so they finish last.
        return Behaviour(delay_s=(3 - msg.offset) / 20, action=RETRY, retry_after_ms=msg.offset)

    async with (
        TestService(by_offset) as service,
        grpc.aio.insecure_channel(service.address) as channel,
    ):
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        batch = handler_pb2.HandleMessageBatchRequest(
            messages=[request(offset=i).message for i in range(3)]
        )
        response = await stub.HandleMessageBatch(batch, timeout=5)
        assert [r.retry_after_ms for r in response.results] == [0, 1, 2]
        assert all(d.batch for d in service.deliveries)
        assert service.peak_in_flight == 1  # one call

        service.behaviour = lambda msg, _n: (
            Behaviour(status=grpc.StatusCode.UNAVAILABLE) if msg.offset == 1 else Behaviour()
        )
        code = await status_of(stub.HandleMessageBatch(batch, timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE


def test_the_threaded_service_serves_sync_callers() -> None:
    with ThreadedService(always(Behaviour(action=DROP))) as service:
        with grpc.insecure_channel(service.address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            assert stub.HandleMessage(request(offset=1), timeout=5).action == DROP
            assert service.count("t", 0, 1) == 1
            assert service.outcomes() == {"DROP": 1}

            health = health_pb2_grpc.HealthStub(channel)
            service.set_health(False)
            reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        service.crash()
        service.behaviour = ack_all
        service.restart()
        with grpc.insecure_channel(service.address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            assert stub.HandleMessage(request(offset=2), timeout=5) == Response()
    assert not service.service.running


async def test_the_threaded_service_serves_a_caller_in_another_event_loop() -> None:
    with ThreadedService() as service:
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            response = await stub.HandleMessage(request(offset=3), timeout=5)
        assert response == Response()
        assert [d.offset for d in service.deliveries] == [3]
