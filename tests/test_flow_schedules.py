"""The push shells' flow objects (breaker, rate limit) with long calls and batch calls, on the
virtual loop (``tests.sim.vloop``): minutes of a schedule in milliseconds, the same every run.
The services are scripted ``Pusher`` edges; the shells and the core are the real ones."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import grpc

from consumer_proxy.batch_push import BatchPush
from consumer_proxy.config import (
    BackoffConfig,
    CircuitBreakerConfig,
    DeliveryConfig,
    LongRunningConfig,
    RetryTopicConfig,
)
from consumer_proxy.core.batching import BatchLimits, summarize
from consumer_proxy.core.outcomes import Classifier
from consumer_proxy.core.partitions import PartitionSet
from consumer_proxy.dispatcher import read_stream
from consumer_proxy.flow import Breaker, RateLimiter, StaticLimiter
from consumer_proxy.metrics import ProxyMetrics
from consumer_proxy.parking import Tally
from consumer_proxy.ports import Edges
from consumer_proxy.proto.v1 import handler_pb2
from consumer_proxy.push import PushParts
from consumer_proxy.readyq import ReadyDeque
from consumer_proxy.stream import StreamPush
from tests.sim.edges import BEAT, Stream
from tests.sim.vloop import run_virtual
from tests.support.core import ACK
from tests.support.records import Rec

CLASSIFY = Classifier()

DONE = handler_pb2.HandleMessageStreamEvent(result=handler_pb2.HandleMessageResponse())


class _Endpoint:
    target = "svc"
    ejected = False


class LongService:
    """A long-running handler: 300 s of work, heartbeating every second; while ``down``, every
    call fails at once with UNAVAILABLE (the instances are gone)."""

    def __init__(self) -> None:
        self.down = True
        self.open = 0
        self.endpoint = _Endpoint()

    def pick(self) -> Any:
        return self.endpoint

    async def push_stream(self, request: Any, endpoint: Any, watch: Any, on_heartbeat: Any,
                          metadata: Any = None) -> Any:  # fmt: skip
        if self.down:
            await asyncio.sleep(0.01)
            return CLASSIFY.from_status(grpc.StatusCode.UNAVAILABLE, "no instance")
        self.open += 1
        try:
            stream = Stream([(1.0, BEAT)] * 299 + [(1.0, DONE)], 1.0)
            return await read_stream(stream.read, watch, on_heartbeat, CLASSIFY)
        finally:
            self.open -= 1


def test_a_long_running_groups_breaker_closes_at_its_probes_first_heartbeat() -> None:
    async def main() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        # Given a long-running group (10 workers; handlers take 5 minutes, heartbeating every
        # second) whose service was down long enough to open the breaker
        breaker = Breaker("g", CircuitBreakerConfig(failure_threshold=5, reset_timeout_s=10),
                          clock=loop.time)  # fmt: skip
        ready: asyncio.Queue[Any] = asyncio.Queue()
        core = PartitionSet(
            "g",
            DeliveryConfig(max_in_flight=1000, concurrency=10),
            "g.redrive",
            breaker,
            emit=ready.put_nowait,
            schedule=loop.call_later,
            rng=random.Random(1),
        )
        core.assign("t", 0, 0, "")
        core.pause_plan()
        service = LongService()
        metrics = ProxyMetrics()
        tally = Tally("g", metrics, lambda *a: None)
        edges = Edges(None, service, None, loop.time, None)  # type: ignore[arg-type]
        parts = PushParts("g", core, edges, breaker, StaticLimiter(10), None, tally, metrics,
                          asyncio.Event())  # fmt: skip
        push = StreamPush(
            parts,
            ready,
            10,
            LongRunningConfig(heartbeat_timeout_ms=3000, max_processing_ms=600_000),
        )
        workers = [loop.create_task(push.worker()) for _ in range(10)]
        for offset in range(50):
            core.intake(Rec("t", offset))
        await asyncio.sleep(1.0)
        assert breaker.state == "open"
        # When the service comes back (its instances heartbeat as they work)
        service.down = False
        # Then, a minute later (the probe went at ~10 s and has heartbeated ~50 times since),
        # the group pushes at its concurrency again, not one message at a time for a whole
        # handler: the probe's heartbeats say the service is up
        await asyncio.sleep(60.0)
        seen = (breaker.state, service.open)
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        return seen

    state, open_calls = run_virtual(main())
    assert (state, open_calls) == ("closed", 10)


# -- batch mode: a call waiting for the rate limit counts as a push under way ----------------


class BatchService:
    """Answers each batch after 50 ms: offset 0's first attempt fails (INTERNAL, counted),
    everything else is acked. Counts the attempts the service really saw, per offset."""

    def __init__(self) -> None:
        self.endpoint = _Endpoint()
        self.seen: dict[int, int] = {}

    def pick(self) -> Any:
        return self.endpoint

    def batches(self, endpoint: Any) -> bool:
        return True

    async def push_batch(
        self, payload: bytes, count: int, endpoint: Any, metadata: Any = None
    ) -> Any:
        request = handler_pb2.HandleMessageBatchRequest.FromString(payload)
        results = []
        for m in request.messages:
            self.seen[m.offset] = self.seen.get(m.offset, 0) + 1
            first = m.offset == 0 and self.seen[m.offset] == 1
            results.append(
                CLASSIFY.from_status(grpc.StatusCode.INTERNAL, "flaky") if first else ACK
            )
        await asyncio.sleep(0.05)
        return summarize(results)


def test_a_batch_waiting_for_the_rate_limit_is_never_moved_aside_as_a_failed_attempt() -> None:
    seen: dict[int, int] = {}

    async def main() -> list[tuple[int, int, int]]:
        loop = asyncio.get_running_loop()
        # Given a batch group (3 call slots of 10 messages) with rate_limit_per_s 10, a retry
        # tier and head_block_ms 2000; offset 0's first attempt fails (a counted retry), so
        # its retry is taken last, behind the rate limit's queue
        breaker = Breaker("g", CircuitBreakerConfig(), clock=loop.time)
        ready = ReadyDeque()
        core = PartitionSet(
            "g",
            DeliveryConfig(
                max_in_flight=1000,
                max_attempts=5,
                backoff=BackoffConfig(initial_ms=10, max_ms=10, jitter=0.0),
                retry_topics=[RetryTopicConfig(delay_ms=60_000)],
                in_memory_attempts=3,
                head_block_ms=2000,
            ),
            "g.redrive",
            breaker,
            emit=ready.put,
            schedule=loop.call_later,
            rng=random.Random(1),
            emit_batch=ready.put_batch,
            runs=True,
            retry_topics=["g.retry.1"],
            clock=loop.time,
        )
        core.assign("t", 0, 0, "")
        core.pause_plan()
        service = BatchService()
        metrics = ProxyMetrics()
        tally = Tally("g", metrics, lambda *a: None)
        edges = Edges(None, service, None, loop.time, None)  # type: ignore[arg-type]
        parts = PushParts("g", core, edges, breaker, StaticLimiter(3), RateLimiter(10.0, loop.time),
                          tally, metrics, asyncio.Event())  # fmt: skip
        push = BatchPush(parts, ready, 3, BatchLimits(10, 1 << 20), 0, lambda: None, False)
        workers = [loop.create_task(push.worker()) for _ in range(3)]
        for offset in range(60):
            core.intake(Rec("t", offset))
        # When the intake runs head-of-line unblocking every 100 ms for 8 s
        moves: list[tuple[int, int, int]] = []
        for _ in range(80):
            await asyncio.sleep(0.1)
            for delivery, _decision in core.unblock(loop.time()):
                # (offset, attempts charged to it, attempts the service really saw)
                moves.append(
                    (delivery.offset, delivery.counted_here, service.seen[delivery.offset])
                )
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        seen.update(service.seen)
        return moves

    moves = run_virtual(main())
    # Then a message is never charged an attempt the service did not see: offset 0, waiting
    # for rate tokens (not pushed), must not be moved aside "as a failed attempt"
    assert all(charged <= saw for _, charged, saw in moves), moves
    # ... and every message was delivered, offset 0 twice (its failed first attempt and its
    # retry), none a second time from a move aside
    assert seen == {0: 2, **{offset: 1 for offset in range(1, 60)}}
