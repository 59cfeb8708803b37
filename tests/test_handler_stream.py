"""The SDK's long-running call (HandleMessageStream): heartbeats for the handler, progress
notes, the result, cancellation the handler sees, and a blocked event loop that stops the
heartbeats. Real gRPC: the SDK's server and a raw client stub in the same loop (the blocked
loop case serves from a thread of its own)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

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


async def test_a_cancellation_the_handler_raises_itself_answers_internal_at_once() -> None:
    # Given a handler that awaits a task something else cancelled (its call is not cancelled)
    async def handle(message: cp.Message) -> cp.Result | None:
        other = asyncio.create_task(asyncio.sleep(60))
        asyncio.get_running_loop().call_soon(other.cancel)
        await other
        return None

    async with cp.Server(handle) as server, grpc.aio.insecure_channel(server.address) as ch:
        stub = handler_pb2_grpc.MessageHandlerStub(ch)
        started = time.monotonic()
        # When the proxy calls it, long-running, unary and batch (deadlines of 20 s)
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            _ = [event async for event in stub.HandleMessageStream(_request(50), timeout=20)]
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.HandleMessage(
                handler_pb2.HandleMessageRequest(message=_request(50).message), timeout=20
            )
        batch = await stub.HandleMessageBatch(
            handler_pb2.HandleMessageBatchRequest(messages=[_request(50).message]), timeout=20
        )
        took = time.monotonic() - started
    # Then each answers INTERNAL at once, naming the cancellation (not the deadline, which
    # the proxy would count as an outage's timeout)
    assert stream.value.code() == unary.value.code() == grpc.StatusCode.INTERNAL
    assert "CancelledError" in (unary.value.details() or "")
    (result,) = batch.results
    assert result.status_code == grpc.StatusCode.INTERNAL.value[0]
    assert took < 10


@pytest.mark.parametrize("method", ["stream", "unary"])
async def test_a_cancelled_handler_keeps_its_slot_until_it_ends_and_stop_waits_for_it(
    method: str,
) -> None:
    # Given a service of one slot whose handler cleans up for 1 s when cancelled
    running: set[int] = set()

    async def handle(message: cp.Message) -> cp.Result | None:
        running.add(message.offset)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(1.0)  # a rollback, say
            raise
        finally:
            running.discard(message.offset)
        return None

    server = await cp.Server(handle, max_concurrency=1, grace_s=0.1).start()
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = handler_pb2_grpc.MessageHandlerStub(ch)

        def call(offset: int) -> Any:
            if method == "stream":
                return stub.HandleMessageStream(_request(50, offset=offset), timeout=30)
            request = handler_pb2.HandleMessageRequest(message=_request(50, offset=offset).message)
            return stub.HandleMessage(request, timeout=30)

        first = call(1)
        await async_wait_until(lambda: running == {1}, timeout=10)
        # When the proxy cancels its call, and calls again while the handler cleans up
        first.cancel()
        await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            second = call(2)
            if method == "stream":
                _ = [event async for event in second]
            else:
                await second
        # Then the second call is refused: the slot is the cleaning handler's still
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert running == {1}
        # and stop() returns only once that handler has ended
        third = call(3)
        await asyncio.sleep(0.1)  # (refused, or running: either way, stop ends it)
        third.cancel()
        await server.stop()
        assert running == set()


async def test_progress_notes_in_a_tight_loop_bring_at_most_four_heartbeats_an_interval() -> None:
    # Given a handler that notes its progress after every millisecond of work, for 1 s
    async def handle(message: cp.Message) -> cp.Result | None:
        for step in range(1000):
            await message.progress(f"step {step}")
            await asyncio.sleep(0.001)
        return None

    async with cp.Server(handle) as server, grpc.aio.insecure_channel(server.address) as ch:
        stub = handler_pb2_grpc.MessageHandlerStub(ch)
        # When the proxy asks for a heartbeat every 200 ms
        started = time.monotonic()
        events = [event async for event in stub.HandleMessageStream(_request(200), timeout=30)]
        took = time.monotonic() - started
    # Then the notes came with the heartbeats, at most four of them per interval (not one
    # per note), and the result came last
    beats = [e for e in events if e.HasField("heartbeat")]
    assert 2 <= len(beats) <= 4 * (took / 0.2) + 1, (len(beats), took)
    assert all(b.heartbeat.progress.startswith("step ") for b in beats)
    assert events[-1].HasField("result")


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
