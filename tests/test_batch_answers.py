"""Batch mode's call slots against services that answer badly or change under them.

Each test runs the real ``BatchPush`` call slots over a real ``PartitionSet`` on the event
loop, pushing through the real ``Dispatcher`` to a real in-process gRPC service; Kafka plays no
part in what is tested (the records are handed to the core as a fetch would hand them), the
DLQ writer is the group's ``Tally`` sink, recorded.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc import aio

from consumer_proxy.batch_push import BatchPush
from consumer_proxy.config import BackoffConfig, CircuitBreakerConfig, DeliveryConfig, ServiceConfig
from consumer_proxy.core.batching import BatchLimits
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.core.partitions import PartitionSet
from consumer_proxy.dispatcher import Dispatcher
from consumer_proxy.flow import Breaker, StaticLimiter
from consumer_proxy.metrics import ProxyMetrics
from consumer_proxy.parking import Tally
from consumer_proxy.ports import Edges
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.push import PushParts
from consumer_proxy.readyq import ReadyDeque
from tests.support.records import Rec

SERVICE = "consumerproxy.v1.MessageHandler"
FAST = BackoffConfig(initial_ms=1, max_ms=5, jitter=0.0)
Answer = Callable[[bytes, Any], Any]


class Service:
    """A service whose methods are raw handlers (bytes in, bytes out): each answers as its
    test says. Counts the calls in flight at once."""

    def __init__(self, batch: Answer | None = None, unary: Answer | None = None) -> None:
        self._batch = batch
        self._unary = unary
        self.batch_calls = 0
        self.unary_calls = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.server: Any = None
        self.address = ""

    async def start(self) -> Service:
        methods = {}
        if self._batch is not None:
            methods["HandleMessageBatch"] = grpc.unary_unary_rpc_method_handler(
                self._on_batch, request_deserializer=None, response_serializer=None
            )
        if self._unary is not None:
            methods["HandleMessage"] = grpc.unary_unary_rpc_method_handler(
                self._on_unary, request_deserializer=None, response_serializer=None
            )
        self.server = aio.server()
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, methods)]
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def _on_batch(self, data: bytes, context: Any) -> Any:
        self.batch_calls += 1
        assert self._batch is not None
        return await self._counted(self._batch, data, context)

    async def _on_unary(self, data: bytes, context: Any) -> Any:
        self.unary_calls += 1
        assert self._unary is not None
        return await self._counted(self._unary, data, context)

    async def _counted(self, answer: Answer, data: bytes, context: Any) -> Any:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            result = answer(data, context)
            return await result if asyncio.iscoroutine(result) else result
        finally:
            self.in_flight -= 1


class Group:
    """A group in batch mode over one partition per ``partitions``: its core, its ready
    deque, its ``BatchPush`` with ``concurrency`` call slots, and the real dispatcher."""

    def __init__(
        self,
        address: str,
        *,
        concurrency: int = 1,
        max_messages: int = 100,
        auto: bool = False,
        partitions: int = 1,
        max_attempts: int = 5,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.ready = ReadyDeque()
        self.breaker = Breaker("g", CircuitBreakerConfig())
        self.dead: list[int] = []
        self.problems = 0
        self.core = PartitionSet(
            "g",
            DeliveryConfig(max_in_flight=1000, backoff=FAST, max_attempts=max_attempts),
            "g.redrive",
            self.breaker,
            emit=self.ready.put,
            schedule=loop.call_later,
            rng=random.Random(1),
            emit_batch=self.ready.put_batch,
            runs=True,
        )
        for p in range(partitions):
            self.core.assign("t", p, 0, "")
        self.core.pause_plan()
        self.dispatcher = Dispatcher(
            "g", ServiceConfig(endpoints=[address]), Classifier(), auto_batch=auto
        )
        metrics = ProxyMetrics()
        tally = Tally("g", metrics, lambda delivery, *rest: self.dead.append(delivery.offset))
        edges = Edges(None, self.dispatcher, None, loop.time, None)  # type: ignore[arg-type]
        parts = PushParts(
            "g",
            self.core,
            edges,
            self.breaker,
            StaticLimiter(concurrency),
            None,
            tally,
            metrics,
            asyncio.Event(),
        )
        self.push = BatchPush(
            parts,
            self.ready,
            concurrency,
            BatchLimits(max_messages, 1 << 20),
            0,
            self._problem,
            auto,
        )
        self.tasks = [loop.create_task(self.push.worker()) for _ in range(concurrency)]

    def _problem(self) -> None:
        self.problems += 1

    def committable(self, partition: int = 0) -> int:
        tracker = self.core.parts[("t", partition)].tracker
        assert tracker is not None
        return tracker.committable()

    async def until(self, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                await asyncio.sleep(0.002)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.dispatcher.close()


def acks(data: bytes, context: Any) -> bytes:
    """An answer of plain acks, one per message of the request."""
    count = len(handler_pb2.HandleMessageBatchRequest.FromString(data).messages)
    return handler_pb2.HandleMessageBatchResponse(
        results=[handler_pb2.HandleMessageResponse() for _ in range(count)]
    ).SerializeToString()


def ack(data: bytes, context: Any) -> bytes:
    return handler_pb2.HandleMessageResponse().SerializeToString()


async def test_instances_of_two_builds_under_batch_always_are_said_once_not_per_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a group with a batch section (always) whose one target balances over pods of two
    # builds during a rolling deploy: every other batch call finds a pod without
    # HandleMessageBatch (UNIMPLEMENTED), the others a pod that acks
    calls = iter(range(10**6))

    async def mixed(data: bytes, context: Any) -> bytes:
        if next(calls) % 2:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return acks(data, context)

    caplog.set_level(logging.INFO, logger="consumer_proxy.batch_push")
    service = await Service(batch=mixed).start()
    group = Group(service.address, max_messages=1)
    try:
        # When 60 messages go through it (well within a minute)
        group.core.intake_batch([Rec("t", o) for o in range(60)])
        await group.until(lambda: group.committable() == 60)
    finally:
        await group.stop()
        await service.server.stop(None)
    # Then every message was acked (the calls answered UNIMPLEMENTED counted for nothing) ...
    assert service.batch_calls >= 100 and group.dead == []
    # ... and the missing method was said once, not once per call that found the old build,
    # and /readyz was told of it once: it does not flap at the rate of calls
    said = [r for r in caplog.records if "does not implement HandleMessageBatch" in r.message]
    again = [r for r in caplog.records if "answers HandleMessageBatch again" in r.message]
    assert (len(said), len(again)) == (1, 0), f"{len(said)} + {len(again)} lines"
    assert group.problems == 1
    assert group.push.service_problem


async def test_a_service_that_serves_batches_again_is_said_so_after_the_settle_time(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a group with a batch section (always) whose service answers UNIMPLEMENTED to its
    # first batch calls (an old build), then acks (the new build is rolled out)
    monkeypatch.setattr("consumer_proxy.core.support.SERVES_AGAIN_S", 0.3)
    old = {"calls": 3}

    async def rolled_out(data: bytes, context: Any) -> bytes:
        if old["calls"]:
            old["calls"] -= 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        return acks(data, context)

    caplog.set_level(logging.INFO, logger="consumer_proxy.batch_push")
    service = await Service(batch=rolled_out).start()
    group = Group(service.address, max_messages=1)
    try:
        # When messages keep coming past the settle time
        group.core.intake_batch([Rec("t", o) for o in range(5)])
        await group.until(lambda: group.committable() == 5)
        await asyncio.sleep(0.35)
        group.core.intake_batch([Rec("t", o) for o in range(5, 10)])
        await group.until(lambda: group.committable() == 10)
    finally:
        await group.stop()
        await service.server.stop(None)
    # Then the problem was said and then cleared, once each
    said = [r for r in caplog.records if "does not implement HandleMessageBatch" in r.message]
    again = [r for r in caplog.records if "answers HandleMessageBatch again" in r.message]
    assert (len(said), len(again), group.problems) == (1, 1, 2)
    assert not group.push.service_problem


async def test_the_unary_calls_of_auto_keep_the_groups_concurrency() -> None:
    # Given a group in batch mode auto with concurrency 2, batches of up to 50, and a
    # hand-written service with HandleMessage only (UNIMPLEMENTED to batches) taking 20 ms
    async def slow_ack(data: bytes, context: Any) -> bytes:
        await asyncio.sleep(0.02)
        return ack(data, context)

    service = await Service(unary=slow_ack).start()
    group = Group(service.address, concurrency=2, max_messages=50, auto=True, partitions=2)
    try:
        # When 100 messages are ready as the group starts (its first fetch)
        group.core.intake_batch([Rec("t", o) for o in range(50)])
        group.core.intake_batch([Rec("t", o, partition=1) for o in range(50)])
        await group.until(lambda: group.committable(0) == 50 and group.committable(1) == 50)
    finally:
        await group.stop()
        await service.server.stop(None)
    # Then every message was acked by a unary call, none dead-lettered ...
    assert service.unary_calls == 100 and group.dead == []
    # ... and the service never had more than the group's concurrency in flight: "a unary
    # instance gets one message per call, so concurrency counts calls in flight in both
    # kinds" (docs/operating.md)
    assert service.most_in_flight <= 2, f"{service.most_in_flight} calls in flight at once"


@pytest.mark.parametrize("method", ["batch", "unary"])
async def test_answers_that_do_not_decode_are_said_once_with_no_traceback_per_call(
    caplog: pytest.LogCaptureFixture, method: str
) -> None:
    # Given a service whose answers are OK with bytes that do not decode
    def garbage(data: bytes, context: Any) -> bytes:
        return b"\xff\xff\xff\xff"

    service = await Service(**{method: garbage}).start()
    dispatcher = Dispatcher("g", ServiceConfig(endpoints=[service.address]), Classifier())
    endpoint = dispatcher.endpoints[0]
    caplog.set_level(logging.INFO)
    try:
        # When the proxy makes 50 calls to it
        for _ in range(50):
            if method == "batch":
                payload = handler_pb2.HandleMessageBatchRequest(
                    messages=[handler_pb2.Message(topic="t", offset=o) for o in range(3)]
                ).SerializeToString()
                outcome = await dispatcher.push_batch(payload, 3, endpoint)
                results = outcome.results
            else:
                request = handler_pb2.HandleMessageRequest(message=handler_pb2.Message(topic="t"))
                results = [await dispatcher.push(request, endpoint)]
            # Then each is retried as documented (no message is lost to it) ...
            assert all(r.outcome.name == "RETRY" for r in results)
    finally:
        await dispatcher.close()
        await service.server.stop(None)
    # ... and the log says it once, naming the group and the instance, with no traceback
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [f"{r.name}: {r.getMessage()[:80]}" for r in lines]
    assert not lines[0].exc_info
    assert "group g" in lines[0].message and service.address in lines[0].message


async def test_one_results_undecodable_reason_dead_letters_that_message_only() -> None:
    # Given a service that acks every message, except that its result for offset 0 carries a
    # reason that is not UTF-8 (the whole answer then does not decode)
    bad_result = b"\x0a\x03\x1a\x01\xff"  # results { reason: b"\xff" }

    def answer(data: bytes, context: Any) -> bytes:
        request = handler_pb2.HandleMessageBatchRequest.FromString(data)
        offsets = [m.offset for m in request.messages]
        if 0 not in offsets:
            return acks(data, context)
        return b"".join(
            bad_result if o == 0 else b"\x0a\x00" for o in offsets
        )  # each good result: results {}

    service = await Service(batch=answer).start()
    group = Group(service.address, max_messages=100, max_attempts=3)
    try:
        # When 5 messages arrive together
        group.core.intake_batch([Rec("t", o) for o in range(5)])
        await group.until(lambda: group.dead == [0] and group.committable() == 0)
        await group.until(lambda: not group.core.parts[("t", 0)].retrying)
    finally:
        await group.stop()
        await service.server.stop(None)
    # Then only message 0 is dead-lettered, as in unary mode where the broken answer is its
    # own; messages 1-4, whose results were acks, are acked
    assert group.dead == [0]
    tracker = group.core.parts[("t", 0)].tracker
    assert tracker is not None and tracker.pending == 1
