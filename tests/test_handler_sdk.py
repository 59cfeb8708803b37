"""The handler SDK, called over real gRPC with the generated stubs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from consumer_proxy import handler as cp
from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc

Response = handler_pb2.HandleMessageResponse


def wire_message(offset: int = 0, **fields: Any) -> handler_pb2.Message:
    values: dict[str, Any] = {
        "topic": "orders",
        "partition": 3,
        "offset": offset,
        "has_value": True,
        "value": b"v",
        "attempt": 1,
        "consumer_group": "billing",
        "source": handler_pb2.DELIVERY_SOURCE_PRIMARY,
    }
    values.update(fields)
    return handler_pb2.Message(**values)


def request(offset: int = 0, **fields: Any) -> handler_pb2.HandleMessageRequest:
    return handler_pb2.HandleMessageRequest(message=wire_message(offset, **fields))


@contextlib.asynccontextmanager
async def serving(
    handler: cp.Handler, **options: Any
) -> AsyncIterator[tuple[cp.Server, handler_pb2_grpc.MessageHandlerAsyncStub]]:
    async with (
        cp.Server(handler, **options) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        yield server, handler_pb2_grpc.MessageHandlerStub(channel)  # type: ignore[misc]


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


async def acks(_message: cp.Message) -> None:
    return None


def answer(result: cp.Result | None) -> Callable[[cp.Message], Awaitable[cp.Result | None]]:
    async def handle(_message: cp.Message) -> cp.Result | None:
        return result

    return handle


def raising(exc: BaseException) -> Callable[[cp.Message], Awaitable[cp.Result | None]]:
    async def handle(_message: cp.Message) -> cp.Result | None:
        raise exc

    return handle


# -------------------------------------------------------------------------- single messages


async def test_returning_none_answers_an_empty_response_which_means_ack() -> None:
    async with serving(acks) as (_server, stub):
        response = await stub.HandleMessage(request(), timeout=5)
    assert response == Response()
    assert response.action == Response.ACTION_UNSPECIFIED


@pytest.mark.parametrize(
    ("result", "action", "retry_after_ms", "reason"),
    [
        (cp.ack(), Response.ACK, 0, ""),
        (cp.retry(), Response.RETRY, 0, ""),
        (cp.retry(after_ms=250, reason="db busy"), Response.RETRY, 250, "db busy"),
        (cp.dead_letter("unknown currency"), Response.DEAD_LETTER, 0, "unknown currency"),
        (cp.drop(), Response.DROP, 0, ""),
    ],
)
async def test_result_helpers_set_the_action_and_its_fields(
    result: cp.Result, action: int, retry_after_ms: int, reason: str
) -> None:
    async with serving(answer(result)) as (_server, stub):
        response = await stub.HandleMessage(request(), timeout=5)
    assert (response.action, response.retry_after_ms, response.reason) == (
        action,
        retry_after_ms,
        reason,
    )


async def test_a_long_reason_is_cut_to_one_kib() -> None:
    async with serving(answer(cp.dead_letter("é" * 1000))) as (_server, stub):
        response = await stub.HandleMessage(request(), timeout=5)
    assert response.reason == "é" * 512
    assert len(response.reason.encode()) == 1024


def test_a_negative_retry_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="retry_after_ms"):
        cp.retry(after_ms=-1)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (cp.PoisonPill("cannot parse"), grpc.StatusCode.INVALID_ARGUMENT),
        (cp.AlreadyProcessed("seen it"), grpc.StatusCode.ALREADY_EXISTS),
        (cp.Overloaded("too busy"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (cp.Unavailable("db down"), grpc.StatusCode.UNAVAILABLE),
        (cp.HandlerError(grpc.StatusCode.NOT_FOUND, "no such account"), grpc.StatusCode.NOT_FOUND),
    ],
)
async def test_handler_errors_become_their_grpc_status(
    error: cp.HandlerError, code: grpc.StatusCode
) -> None:
    async with serving(raising(error)) as (_server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=5)
    assert caught.value.code() == code
    assert caught.value.details() == error.message


def test_a_handler_error_needs_a_non_ok_code() -> None:
    with pytest.raises(ValueError, match="non-OK"):
        cp.HandlerError(grpc.StatusCode.OK, "fine")


async def test_any_other_exception_is_internal_with_its_type_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with serving(raising(KeyError("account"))) as (_server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(offset=7), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "KeyError: 'account'"
    assert "orders[3]@7: handler failed" in caplog.text


async def test_a_handler_that_is_not_async_is_an_internal_error() -> None:
    def not_async(_message: cp.Message) -> None:
        return None

    async with serving(not_async) as (_server, stub):  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "must be async" in (caught.value.details() or "")


async def test_every_message_field_reaches_the_handler() -> None:
    seen: list[cp.Message] = []

    async def record(message: cp.Message) -> None:
        seen.append(message)

    headers = [
        handler_pb2.Header(key="trace", value=b"t1"),
        handler_pb2.Header(key="tenant", value=b"acme"),
        handler_pb2.Header(key="trace", value=b"t2"),
    ]

    async with serving(record) as (_server, stub):
        await stub.HandleMessage(
            request(
                offset=42,
                key=b"k",
                has_key=True,
                value=b"",
                has_value=True,
                headers=headers,
                timestamp_ms=1_700_000_000_123,
                attempt=4,
                source=handler_pb2.DELIVERY_SOURCE_REDRIVE,
            ),
            timeout=5,
        )
        await stub.HandleMessage(request(offset=43, has_value=False, value=b""), timeout=5)
    first, tombstone = seen
    assert first == cp.Message(
        topic="orders",
        partition=3,
        offset=42,
        key=b"k",
        value=b"",
        headers=(("trace", b"t1"), ("tenant", b"acme"), ("trace", b"t2")),
        timestamp_ms=1_700_000_000_123,
        consumer_group="billing",
        attempt=4,
        source="redrive",
    )
    assert first.header("trace") == b"t1"
    assert first.header_values("trace") == [b"t1", b"t2"]
    assert first.header("missing") is None
    assert (tombstone.key, tombstone.value, tombstone.source) == (None, None, "primary")
    assert cp.Message.from_proto(first.to_proto()) == first


async def test_an_object_with_a_handle_method_is_a_handler() -> None:
    class Counter:
        def __init__(self) -> None:
            self.seen = 0

        async def handle(self, message: cp.Message) -> cp.Result | None:
            self.seen += 1
            return cp.retry(after_ms=message.offset)

    counter = Counter()

    async with serving(counter) as (_server, stub):
        response = await stub.HandleMessage(request(offset=9), timeout=5)
    assert (response.action, response.retry_after_ms) == (Response.RETRY, 9)
    assert counter.seen == 1


# -------------------------------------------------------------------------- batches


async def test_a_batch_runs_concurrently_and_answers_in_request_order() -> None:
    # Each message finishes only after the next one did: completion runs in reverse order,
    # and the batch would hang if the handler were called one message at a time.
    done = {offset: asyncio.Event() for offset in range(5)}

    async def reverse(message: cp.Message) -> cp.Result:
        following = done.get(message.offset + 1)
        if following is not None:
            await following.wait()
        done[message.offset].set()
        return cp.retry(after_ms=message.offset)

    async with serving(reverse) as (_server, stub):
        response = await stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(
                messages=[wire_message(offset) for offset in range(5)]
            ),
            timeout=5,
        )
    assert [r.retry_after_ms for r in response.results] == [0, 1, 2, 3, 4]


async def test_errors_in_a_batch_carry_their_unary_status_and_the_action_it_leads_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def mixed(message: cp.Message) -> cp.Result | None:
        match message.offset:
            case 1:
                raise cp.PoisonPill("cannot parse")
            case 2:
                raise cp.AlreadyProcessed()
            case 3:
                raise cp.Overloaded("too busy")
            case 4:
                raise RuntimeError("boom")
            case 5:
                return cp.drop()
            case 6:
                raise cp.Unavailable("database down")
        return None

    async with serving(mixed) as (_server, stub):
        response = await stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(
                messages=[wire_message(offset) for offset in range(7)]
            ),
            timeout=5,
        )
    code = grpc.StatusCode
    assert [(r.status_code, r.action, r.reason) for r in response.results] == [
        (0, Response.ACTION_UNSPECIFIED, ""),
        (code.INVALID_ARGUMENT.value[0], Response.DEAD_LETTER, "cannot parse"),
        (code.ALREADY_EXISTS.value[0], Response.ACK, ""),
        (code.RESOURCE_EXHAUSTED.value[0], Response.RETRY, "too busy"),
        (code.INTERNAL.value[0], Response.RETRY, "RuntimeError: boom"),
        (0, Response.DROP, ""),
        (code.UNAVAILABLE.value[0], Response.RETRY, "database down"),
    ]
    assert "orders[3]@4: handler failed" in caplog.text


# A lone surrogate is a str that has no UTF-8 form (os.fsdecode of a bad file name, a
# surrogateescape decode); protobuf and gRPC refuse it as text.
SURROGATE = "bad byte \udcff here"


async def test_one_error_with_a_lone_surrogate_fails_only_its_own_message_in_a_batch() -> None:
    async def mixed(message: cp.Message) -> cp.Result | None:
        match message.offset:
            case 1:
                raise RuntimeError(SURROGATE)
            case 2:
                raise cp.PoisonPill(SURROGATE)
            case 3:
                return cp.dead_letter(SURROGATE)
        return None

    async with serving(mixed) as (_server, stub):
        response = await stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(
                messages=[wire_message(offset) for offset in range(5)]
            ),
            timeout=5,
        )
    code = grpc.StatusCode
    assert [(r.status_code, r.action, r.reason) for r in response.results] == [
        (0, Response.ACTION_UNSPECIFIED, ""),
        (code.INTERNAL.value[0], Response.RETRY, "RuntimeError: bad byte ? here"),
        (code.INVALID_ARGUMENT.value[0], Response.DEAD_LETTER, "bad byte ? here"),
        (0, Response.DEAD_LETTER, "bad byte ? here"),
        (0, Response.ACTION_UNSPECIFIED, ""),
    ]


@pytest.mark.parametrize(
    ("handler", "code"),
    [
        (raising(RuntimeError(SURROGATE)), grpc.StatusCode.INTERNAL),
        (raising(cp.PoisonPill(SURROGATE)), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_an_error_with_a_lone_surrogate_keeps_its_status_in_a_unary_call(
    handler: cp.HandlerFunc, code: grpc.StatusCode
) -> None:
    async with serving(handler) as (_server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=5)
    assert caught.value.code() == code
    assert "bad byte ? here" in (caught.value.details() or "")


async def test_a_reason_with_a_lone_surrogate_is_answered_in_a_unary_call() -> None:
    async with serving(answer(cp.dead_letter(SURROGATE))) as (_server, stub):
        response = await stub.HandleMessage(request(), timeout=5)
    assert (response.action, response.reason) == (Response.DEAD_LETTER, "bad byte ? here")


# -------------------------------------------------------------------------- large calls

MIB = 1024 * 1024


def sizes(seen: list[int]) -> Callable[[cp.Message], Awaitable[None]]:
    async def record(message: cp.Message) -> None:
        seen.append(len(message.value or b""))

    return record


async def test_a_5_mib_record_reaches_the_handler_by_default_alone_and_in_a_batch() -> None:
    # gRPC's own default would refuse anything over 4 MiB before the handler saw it
    seen: list[int] = []
    big = b"x" * (5 * MIB)
    async with serving(sizes(seen)) as (_server, stub):
        response = await stub.HandleMessage(request(value=big), timeout=30)
        batch = await stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(
                messages=[wire_message(offset, value=big) for offset in range(3)]
            ),
            timeout=30,
        )
    assert response == Response()
    assert [r.status_code for r in batch.results] == [0, 0, 0]
    assert seen == [5 * MIB] * 4


async def test_max_request_bytes_refuses_a_larger_call_before_the_handler() -> None:
    seen: list[int] = []
    async with serving(sizes(seen), max_request_bytes=64 * 1024) as (_server, stub):
        fits = await stub.HandleMessage(request(value=b"x" * 60_000), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(value=b"x" * 70_000), timeout=5)
    assert fits == Response()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Received message larger than max" in (caught.value.details() or "")
    assert seen == [60_000]


@pytest.mark.parametrize("size", [0, -1, 2**31])
def test_max_request_bytes_must_be_a_grpc_length(size: int) -> None:
    with pytest.raises(ValueError, match="max_request_bytes"):
        cp.Server(acks, max_request_bytes=size)


# -------------------------------------------------------------------------- serving


async def test_health_reports_serving_and_can_be_flipped() -> None:
    async with (
        cp.Server(acks) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            request = health_pb2.HealthCheckRequest(service=service)
            return int((await health.Check(request, timeout=5)).status)

        assert await status("") == health_pb2.HealthCheckResponse.SERVING
        assert await status(cp.SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING

        await server.set_serving(False)
        assert await status("") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status(cp.SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_serve_returns_a_started_server_on_a_free_port() -> None:
    server = await cp.serve(acks)
    try:
        assert server.port > 0
        assert server.address == f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = handler_pb2_grpc.MessageHandlerStub(channel)
            assert await stub.HandleMessage(request(), timeout=5) == Response()
    finally:
        await server.stop()


async def test_a_taken_port_is_an_error_not_a_shared_port() -> None:
    async with cp.Server(acks) as first:
        with pytest.raises(OSError, match="cannot listen"):
            await cp.serve(acks, port=first.port)


async def test_max_concurrency_refuses_calls_beyond_the_limit() -> None:
    release = asyncio.Event()
    started: list[int] = []

    async def blocking(message: cp.Message) -> None:
        started.append(message.offset)
        await release.wait()

    async with serving(blocking, max_concurrency=1) as (_server, stub):
        first = asyncio.ensure_future(stub.HandleMessage(request(offset=1), timeout=5))
        await eventually(lambda: started == [1])

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(offset=2), timeout=5)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        release.set()
        assert await first == Response()
        assert await stub.HandleMessage(request(offset=3), timeout=5) == Response()
    assert started == [1, 3]


async def test_stop_reports_not_serving_and_lets_in_flight_calls_finish() -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def blocking(_message: cp.Message) -> cp.Result:
        started.set()
        await release.wait()
        return cp.drop()

    server = await cp.serve(blocking)
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        call = asyncio.ensure_future(stub.HandleMessage(request(), timeout=10))
        await asyncio.wait_for(started.wait(), 5)

        stopping = asyncio.ensure_future(server.stop(grace_s=10))
        also_stopping = asyncio.ensure_future(server.stop())  # idempotent: same shutdown
        update = await asyncio.wait_for(watch.read(), 5)
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        assert not stopping.done()

        release.set()
        assert (await call).action == Response.DROP
        await asyncio.wait_for(asyncio.gather(stopping, also_stopping), 10)


# -- answers whatever the handler raises or returns (a review, 2026-11-27) ----------------

SDK_CODE = grpc.StatusCode


def batch(n: int) -> handler_pb2.HandleMessageBatchRequest:
    return handler_pb2.HandleMessageBatchRequest(messages=[wire_message(o) for o in range(n)])


def summary(response: handler_pb2.HandleMessageBatchResponse) -> list[tuple[int, int, str]]:
    return [(r.status_code, r.action, r.reason) for r in response.results]


# ------------------------------------------------------------------ 1: non-str error texts


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (cp.Unavailable(ConnectionError("db down")), SDK_CODE.UNAVAILABLE),  # type: ignore[arg-type]
        (cp.PoisonPill(ValueError("db down")), SDK_CODE.INVALID_ARGUMENT),  # type: ignore[arg-type]
    ],
)
async def test_a_handler_error_built_from_an_exception_keeps_its_status_in_a_unary_call(
    error: cp.HandlerError, code: grpc.StatusCode
) -> None:
    # Given a handler that wraps the exception it caught: raise cp.Unavailable(exc)
    async def handle(_message: cp.Message) -> None:
        raise error

    async with serving(handle) as (_server, stub):
        # When the proxy calls HandleMessage
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=5)
    # Then the call fails with the error's status (UNAVAILABLE: an outage, not counted)
    assert (caught.value.code(), caught.value.details()) == (code, "db down")


async def test_a_handler_error_built_from_an_exception_fails_only_its_message_in_a_batch() -> None:
    # Given a batch where one message's handler raises cp.Unavailable(exc)
    async def handle(message: cp.Message) -> None:
        if message.offset == 1:
            raise cp.Unavailable(ConnectionError("db down"))  # type: ignore[arg-type]

    async with serving(handle) as (_server, stub):
        # When the proxy sends a batch of three
        response = await stub.HandleMessageBatch(batch(3), timeout=5)
    # Then only that message fails, with UNAVAILABLE; the others are acked
    assert summary(response) == [
        (0, Response.ACTION_UNSPECIFIED, ""),
        (SDK_CODE.UNAVAILABLE.value[0], Response.RETRY, "db down"),
        (0, Response.ACTION_UNSPECIFIED, ""),
    ]


async def test_a_dead_letter_whose_reason_is_an_exception_is_a_dead_letter_in_a_unary_call() -> (
    None
):
    # Given a handler that answers cp.dead_letter(exc)
    async def handle(_message: cp.Message) -> cp.Result:
        return cp.dead_letter(ValueError("not json"))  # type: ignore[arg-type]

    async with serving(handle) as (_server, stub):
        # When the proxy calls HandleMessage
        response = await stub.HandleMessage(request(), timeout=5)
    # Then the answer is DEAD_LETTER with the exception's text
    assert (response.action, response.reason) == (Response.DEAD_LETTER, "not json")


# ------------------------------------------------------------ 2: errors that cannot be printed


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() failed")


async def test_an_error_that_cannot_be_printed_fails_only_its_own_message_in_a_batch() -> None:
    # Given a batch where one message's handler raises an exception whose str() raises
    async def handle(message: cp.Message) -> None:
        if message.offset == 1:
            raise Unprintable()

    async with serving(handle) as (_server, stub):
        # When the proxy sends a batch of three
        response = await stub.HandleMessageBatch(batch(3), timeout=5)
    # Then that message alone fails INTERNAL; the other two are acked
    assert [(r.status_code, r.action) for r in response.results] == [
        (0, Response.ACTION_UNSPECIFIED),
        (SDK_CODE.INTERNAL.value[0], Response.RETRY),
        (0, Response.ACTION_UNSPECIFIED),
    ]


async def test_an_error_that_cannot_be_printed_is_internal_in_a_unary_call() -> None:
    # Given a handler raising an exception whose str() raises
    async def handle(_message: cp.Message) -> None:
        raise Unprintable()

    async with serving(handle) as (_server, stub):
        # When the proxy calls HandleMessage
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=5)
    # Then the status is INTERNAL ("any other exception"), with the type's name
    assert caught.value.code() == SDK_CODE.INTERNAL
    assert "Unprintable" in (caught.value.details() or "")


# ------------------------------------------------------- 3: one hung message holds its batch


async def test_a_hung_message_does_not_cost_its_batch_mates_their_answers() -> None:
    # Given a batch where message 1's handler never returns and the others ack at once
    handled: list[int] = []

    async def handle(message: cp.Message) -> None:
        if message.offset == 1:
            await asyncio.sleep(3600)
        handled.append(message.offset)

    async with serving(handle) as (_server, stub):
        # When the proxy sends the batch with a 2 s deadline (service.timeout_ms)
        started = time.monotonic()
        response = await stub.HandleMessageBatch(batch(3), timeout=2)
        took = time.monotonic() - started
    # Then the SDK answers before the deadline: the done messages acked, the hung one
    # failed alone as a deadline (retried, counted), as a unary call of it would have been
    assert took < 2
    assert handled == [0, 2]
    assert [(r.status_code, r.action) for r in response.results] == [
        (0, Response.ACTION_UNSPECIFIED),
        (SDK_CODE.DEADLINE_EXCEEDED.value[0], Response.RETRY),
        (0, Response.ACTION_UNSPECIFIED),
    ]


# ------------------------------------------------------ 4: BaseException subclasses: no answer


class LibraryAbort(BaseException):
    """A library's BaseException (gevent.Timeout, trio.Cancelled and the like)."""


@pytest.mark.parametrize("error", [LibraryAbort, GeneratorExit])
async def test_a_base_exception_from_the_handler_is_answered_internal_at_once(
    error: type[BaseException],
) -> None:
    # Given a handler raising a BaseException that is not Exception (nor a cancellation)
    async def handle(_message: cp.Message) -> None:
        raise error()

    async with serving(handle) as (_server, stub):
        # When the proxy calls HandleMessage with a 3 s deadline
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.HandleMessage(request(), timeout=3)
        took = time.monotonic() - started
    # Then the call fails INTERNAL at once, not at the proxy's deadline
    assert caught.value.code() == SDK_CODE.INTERNAL
    assert took < 1


async def test_a_base_exception_in_a_batch_fails_only_its_own_message() -> None:
    # Given a batch where one message's handler raises a library's BaseException
    async def handle(message: cp.Message) -> None:
        if message.offset == 1:
            raise LibraryAbort()

    async with serving(handle) as (_server, stub):
        # When the proxy sends a batch of three with a 3 s deadline
        response = await stub.HandleMessageBatch(batch(3), timeout=3)
    # Then that message fails INTERNAL and the other two are acked
    assert [(r.status_code, r.action) for r in response.results] == [
        (0, Response.ACTION_UNSPECIFIED),
        (SDK_CODE.INTERNAL.value[0], Response.RETRY),
        (0, Response.ACTION_UNSPECIFIED),
    ]


# ------------------------------------------------------------- 5: handlers that cannot work


class NotCallableHandle:
    handle = "billing"


class AHandlerClass:
    async def handle(self, message: cp.Message) -> None:
        return None


@pytest.mark.parametrize("handler", [NotCallableHandle(), AHandlerClass], ids=["attr", "class"])
def test_a_handler_that_can_never_be_called_is_refused_when_the_server_is_built(
    handler: Any,
) -> None:
    # Given an object whose handle is not callable, or a handler class instead of an instance
    # When a Server is built with it
    # Then it is refused at once, as a non-callable handler is (not INTERNAL for every
    # message, each logged with a traceback, each dead-lettered after max_attempts)
    with pytest.raises(TypeError):
        cp.Server(handler)
