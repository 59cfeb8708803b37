"""The bare gRPC loops: the handler called from a process of its own with no Kafka and no proxy
in between, with requests shaped like the proxy's and built before the clock runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from grpc import aio

from bench.handlers import SERVICE, SPAWN
from bench.measure import rate
from bench.producing import sized_value
from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc

BATCH_METHOD = f"/{SERVICE}/HandleMessageBatch"


def in_child(target: Callable[..., None], args: tuple[Any, ...], what: str) -> dict[str, float]:
    """Run ``target(*args, conn)`` in a process of its own and return what it sends on
    ``conn`` (a dict of figures); ``what`` names it in the timeout error."""
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=target, args=(*args, child))
    proc.start()
    try:
        if not parent.poll(600):
            raise TimeoutError(f"{what} did not finish within 600s")
        result: dict[str, float] = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return result


def _bare_main(
    address: str, topic: str, n: int, concurrency: int, profile_out: str | None, out: Connection
) -> None:
    out.send(asyncio.run(_bare_loop(address, topic, n, concurrency, profile_out)))


async def _bare_loop(
    address: str, topic: str, n: int, concurrency: int, profile_out: str | None = None
) -> dict[str, float]:
    # Requests shaped like the proxy's (same fields, distinct offsets), built before timing:
    # the proxy's cost of building them is part of what the comparison measures.
    requests = [
        handler_pb2.HandleMessageRequest(
            message=handler_pb2.Message(
                topic=topic,
                partition=i % 4,
                offset=i,
                key=b"",
                value=b"x" * 16,
                has_value=True,
                timestamp_ms=0,
                consumer_group="bare",
                attempt=1,
                source=handler_pb2.DELIVERY_SOURCE_PRIMARY,
            )
        )
        for i in range(n)
    ]
    async with aio.insecure_channel(address) as channel:
        stub = handler_pb2_grpc.MessageHandlerStub(channel)
        await stub.HandleMessage(requests[0], timeout=10)  # connect outside the timing
        it = iter(requests[1:])
        errors = 0

        async def worker() -> None:
            nonlocal errors
            for request in it:  # a shared iterator: each request is sent once
                try:
                    await stub.HandleMessage(request, timeout=10)
                except aio.AioRpcError:
                    errors += 1

        profiler = None
        if profile_out is not None:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        started, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended, cpu = time.monotonic(), time.process_time() - cpu
        if profiler is not None and profile_out is not None:
            profiler.disable()
            profiler.dump_stats(profile_out)
    return {"started": started, "ended": ended, "errors": float(errors), "cpu_s": cpu}


def run_bare_loop(
    address: str, n: int, concurrency: int, topic: str = "bare", profile_out: Path | None = None
) -> dict[str, float]:
    """Call the handler ``n`` times with ``concurrency`` calls in flight, from a process of its
    own; returns its monotonic ``started`` / ``ended`` (first call to last answer) and
    ``cpu_s``. ``profile_out``: a cProfile dump of the timed part."""
    out = None if profile_out is None else str(profile_out)
    return in_child(_bare_main, (address, topic, n, concurrency, out), "the bare loop")


def _bare_batch_main(
    address: str, n: int, size: int, concurrency: int, value_bytes: int, out: Connection
) -> None:
    out.send(asyncio.run(_bare_batch_loop(address, n, size, concurrency, value_bytes)))


async def _bare_batch_loop(
    address: str, n: int, size: int, concurrency: int, value_bytes: int
) -> dict[str, float]:
    # Batches shaped like the proxy's (same fields, distinct offsets), encoded before timing.
    requests = []
    for start in range(0, n, size):
        request = handler_pb2.HandleMessageBatchRequest()
        for i in range(start, min(n, start + size)):
            request.messages.add(
                topic="bare",
                partition=i % 4,
                offset=i,
                value=sized_value(i, value_bytes),
                has_value=True,
                timestamp_ms=1,
                consumer_group="bare",
                attempt=1,
                source=handler_pb2.DELIVERY_SOURCE_PRIMARY,
            )
        requests.append(request.SerializeToString())
    parse = handler_pb2.HandleMessageBatchResponse.FromString
    async with aio.insecure_channel(address) as channel:
        call = channel.unary_unary(BATCH_METHOD, response_deserializer=parse)
        await call(requests[0], timeout=10)  # connect outside the timing
        it = iter(requests)

        async def worker() -> None:
            for request in it:
                await call(request, timeout=30)

        started, cpu = time.monotonic(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        ended, cpu = time.monotonic(), time.process_time() - cpu
    return {"rate": rate(n, ended - started), "cpu_us_per_msg": 1e6 * cpu / n}


def run_bare_batch_loop(
    address: str, n: int, size: int, concurrency: int, value_bytes: int = 100
) -> dict[str, float]:
    """Send ``n`` messages as pre-encoded batches of ``size``, ``concurrency`` calls in flight,
    from a process of its own; returns ``rate`` (msg/s) and the client's ``cpu_us_per_msg``."""
    args = (address, n, size, concurrency, value_bytes)
    return in_child(_bare_batch_main, args, "the bare batch loop")
