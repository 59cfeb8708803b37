"""The SDK's long-running call (HandleMessageStream): heartbeats for the handler, progress
notes, the result, cancellation the handler sees, and a blocked event loop that stops the
heartbeats. Real gRPC: the SDK's server and a raw client stub in the same loop (the blocked
loop case serves from a thread of its own)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from consumer_proxy import handler as cp
from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.waiting import async_wait_until


def _request(interval_ms: int, offset: int = 7) -> handler_pb2.HandleMessageStreamRequest:
    return handler_pb2.HandleMessageStreamRequest(
        message=handler_pb2.Message(topic="t", partition=0, offset=offset, attempt=1),
        heartbeat_interval_ms=interval_ms,
        max_processing_ms=60_000,
    )


async def test_the_sdk_heartbeats_while_the_handler_runs_then_answers_its_result() -> None:
    # Given a handler that works 0.5 s, saying how far it got halfway
    async def handle(message: cp.Message) -> cp.Result | None:
        await asyncio.sleep(0.25)
        await message.progress("50%")
        await asyncio.sleep(0.25)
        return cp.retry(after_ms=5, reason="later")

    async with cp.Server(handle) as server, grpc.aio.insecure_channel(server.address) as ch:
        stub = handler_pb2_grpc.MessageHandlerStub(ch)
        # When the proxy calls it asking for a heartbeat every 50 ms
        started = time.monotonic()
        events = [event async for event in stub.HandleMessageStream(_request(50), timeout=10)]
        took = time.monotonic() - started
    # Then heartbeats came at that pace, one with the note, and the result came last
    beats = [e for e in events if e.HasField("heartbeat")]
    assert 5 <= len(beats) <= 15, len(beats)
    assert "50%" in [b.heartbeat.progress for b in beats]
    assert all(e.HasField("heartbeat") for e in events[:-1])
    last = events[-1]
    assert last.HasField("result")
    assert last.result.action == handler_pb2.HandleMessageResponse.RETRY
    assert last.result.retry_after_ms == 5
    assert took < 5


async def test_a_handler_error_fails_the_stream_as_it_fails_handle_message() -> None:
    async def handle(message: cp.Message) -> cp.Result | None:
        raise cp.PoisonPill("bad input")

    async with cp.Server(handle) as server, grpc.aio.insecure_channel(server.address) as ch:
        stub = handler_pb2_grpc.MessageHandlerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [event async for event in stub.HandleMessageStream(_request(50), timeout=10)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "bad input"


async def test_a_cancelled_call_cancels_the_handler_unary_streaming_and_batch_alike() -> None:
    # Given a handler that would run for a minute and notes its cancellation
    started: list[int] = []
    cancelled: list[int] = []

    async def handle(message: cp.Message) -> cp.Result | None:
        started.append(message.offset)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(message.offset)
            raise
        return None

    async with cp.Server(handle) as server, grpc.aio.insecure_channel(server.address) as ch:
        stub = handler_pb2_grpc.MessageHandlerStub(ch)
        stream = stub.HandleMessageStream(_request(50, offset=1), timeout=30)
        unary = stub.HandleMessage(
            handler_pb2.HandleMessageRequest(message=_request(50, offset=2).message), timeout=30
        )
        batch = stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(
                messages=[_request(50, offset=o).message for o in (3, 4)]
            ),
            timeout=30,
        )
        await async_wait_until(lambda: sorted(started) == [1, 2, 3, 4], timeout=10)
        # When the proxy cancels the three calls
        stream.cancel()
        unary.cancel()
        batch.cancel()
        # Then the handler saw every cancellation, each of the batch's messages' too
        await async_wait_until(lambda: sorted(cancelled) == [1, 2, 3, 4], timeout=10)


def test_a_handler_that_blocks_its_event_loop_stops_the_heartbeats() -> None:
    # Given the SDK serving from its own loop, a handler that blocks that loop for 1 s
    async def handle(message: cp.Message) -> cp.Result | None:
        time.sleep(1.0)
        return None

    ready: list[cp.Server] = []
    stop = threading.Event()

    async def serve() -> None:
        async with cp.Server(handle) as server:
            ready.append(server)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:

        async def call() -> list[float]:
            await async_wait_until(lambda: ready, timeout=10)
            arrivals: list[float] = []
            async with grpc.aio.insecure_channel(ready[0].address) as ch:
                stub = handler_pb2_grpc.MessageHandlerStub(ch)
                began = time.monotonic()
                async for _event in stub.HandleMessageStream(_request(50), timeout=10):
                    arrivals.append(time.monotonic() - began)
            return arrivals

        # When the proxy calls it asking for a heartbeat every 50 ms
        arrivals = asyncio.run(call())
    finally:
        stop.set()
        thread.join(10)
    # Then nothing but the result came: no heartbeat while the loop was blocked
    assert len(arrivals) == 1, arrivals
    assert arrivals[0] >= 0.9
