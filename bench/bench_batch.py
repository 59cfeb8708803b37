#!/usr/bin/env python3
"""Batch push (``delivery.batch``): throughput, Parallel-Consumer-style workloads, latency.

Every party runs in its own process: a cheap batch handler (a grpc.aio server whose
HandleMessageBatch parses the request in C, counts the messages and answers a pre-encoded
all-ack response; it never looks at a message in Python), the proxy (``consumer-proxy run``,
one process), a bare grpc.aio client, and this process (produces, polls, reads commits).

1. **Throughput** (targets: proxy >= 50,000 msg/s committed, >= 0.8 x bare). N pre-produced
   100-byte messages on 4 partitions; the proxy drains them with ``delivery.batch``; the bare
   loop sends the same number of messages as pre-built batches of ``max_messages`` with the
   same number of calls in flight. Interleaved rounds (bare, proxy, bare, proxy, ...); the
   ratio is the median of per-round ratios of the proxy's committed rate (first arrival ->
   every offset committed) to the bare loop's rate.
2. **Workloads of the Parallel Consumer comparison** (issue 13): (a) 1 partition, 20 ms of work
   per message with a batch's messages worked on concurrently (a batch call takes 20 ms),
   200 messages in flight as 4 calls of 50: ceiling 10,000 msg/s, Parallel Consumer 8,327;
   (b) 4 partitions, no-op: Parallel Consumer 35,309 (the throughput run above).
3. **Latency** at 1,000 msg/s open loop on one partition, no-op handler: handler receipt minus
   the record's CreateTime, first deliveries; unary vs batch in the same run (alternating),
   target p99(batch) <= 1.5 x p99(unary).

Reports CPU microseconds per message of the proxy process (first arrival -> N-th) and the
batch sizes the handler saw.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
from grpc import aio

from bench.common import (
    _SPAWN,
    BenchProxy,
    CommittedReader,
    GoHandlerProcess,
    Result,
    base_parser,
    bench_config,
    broker,
    create_topic,
    in_child,
    percentile,
    produce_at_rate,
    produce_bulk,
    rate,
    unique_name,
    wait_for,
)
from consumer_proxy.proto.v1 import handler_pb2

SERVICE = "consumerproxy.v1.MessageHandler"
BATCH_METHOD = f"/{SERVICE}/HandleMessageBatch"
VALUE_BYTES = 100
PC_ONE_PARTITION_20MS = 8327.0  # msg/s, quoted in issue 13 (quiet machine)
PC_FOUR_PARTITIONS_NOOP = 35309.0


def value_of(i: int) -> bytes:
    return (b"m%015d" % i).ljust(VALUE_BYTES, b".")


# --------------------------------------------------------------------------- the batch handler


@dataclass(frozen=True)
class BatchHandlerSpec:
    """``delay_ms`` per call (a batch's messages are worked on concurrently); ``latency``:
    decode each message's timestamp to record its latency (first attempts only)."""

    delay_ms: float = 0.0
    latency: bool = False


class _Books:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.messages = 0
        self.first: float | None = None
        self.last: float | None = None
        self.sizes: dict[int, int] = {}
        self.latency_ms: list[float] = []
        self.in_flight = 0
        self.peak_in_flight = 0


def _handler_main(spec: BatchHandlerSpec, conn: Connection) -> None:
    asyncio.run(_serve(spec, conn))


async def _serve(spec: BatchHandlerSpec, conn: Connection) -> None:
    books = _Books()
    delay_s = spec.delay_ms / 1000.0
    answers: dict[int, bytes] = {}
    parse_batch = handler_pb2.HandleMessageBatchRequest.FromString
    parse_one = handler_pb2.HandleMessageRequest.FromString

    def arrived(count: int) -> None:
        now = time.monotonic()
        if books.first is None:
            books.first = now
        books.last = now
        books.calls += 1
        books.messages += count
        books.sizes[count] = books.sizes.get(count, 0) + 1

    async def batch(request: bytes, _context: Any) -> bytes:
        messages = parse_batch(request).messages  # parsed in C; no message is read in Python
        count = len(messages)
        arrived(count)
        if spec.latency:
            wall_ms = time.time() * 1000.0
            books.latency_ms += [wall_ms - m.timestamp_ms for m in messages if m.attempt == 1]
        if delay_s:
            books.in_flight += 1
            books.peak_in_flight = max(books.peak_in_flight, books.in_flight)
            await asyncio.sleep(delay_s)
            books.in_flight -= 1
        answer = answers.get(count)
        if answer is None:  # `count` empty results (field 1, length 0): all acks
            answer = answers[count] = b"\x0a\x00" * count
        return answer

    async def unary(request: bytes, _context: Any) -> bytes:
        arrived(1)
        if spec.latency:
            message = parse_one(request).message
            if message.attempt == 1:
                books.latency_ms.append(time.time() * 1000.0 - message.timestamp_ms)
        if delay_s:
            await asyncio.sleep(delay_s)
        return b""  # the empty response: ack

    server = aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "HandleMessageBatch": grpc.unary_unary_rpc_method_handler(batch),
                    "HandleMessage": grpc.unary_unary_rpc_method_handler(unary),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    loop = asyncio.get_running_loop()
    try:
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                break
            if command == "reset":
                books.reset()
                conn.send(True)
            elif command == "progress":
                conn.send(
                    (books.messages, books.calls, books.first, books.last, time.process_time())
                )
            elif command == "stats":
                conn.send(
                    {
                        "sizes": dict(books.sizes),
                        "latency_ms": list(books.latency_ms),
                        "peak_calls": books.peak_in_flight,
                    }
                )
    finally:
        await server.stop(grace=1.0)
        conn.send("stopped")


class BatchHandler:
    """The batch handler in its own process."""

    def __init__(self, spec: BatchHandlerSpec, impl: str = "python") -> None:
        self.spec, self.impl = spec, impl
        self._go: GoHandlerProcess | None = None
        self._conn, child = _SPAWN.Pipe()
        self._proc = _SPAWN.Process(target=_handler_main, args=(spec, child), daemon=True)
        self.port = 0

    def __enter__(self) -> BatchHandler:
        if self.impl == "go":
            self._go = GoHandlerProcess(self.spec.delay_ms, latency=self.spec.latency)
            self.port = self._go.port
            return self
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the batch handler did not start within 60s")
        self.port = self._conn.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._go is not None:
            self._go.close()
        if self._proc.is_alive():
            self._conn.send("stop")
            if self._conn.poll(10):
                self._conn.recv()
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ask(self, command: str) -> Any:
        if self._go is not None:
            answer = self._go.ask(command)
            if command == "progress":  # deliveries, as the Python handler counts messages
                return (
                    answer["deliveries"],
                    answer["calls"],
                    answer["first"],
                    answer["last"],
                    answer["cpu_s"],
                )
            if command == "stats":
                return {
                    "sizes": {int(k): v for k, v in answer["sizes"].items()},
                    "latency_ms": answer["latency_ms"],
                    "peak_calls": answer["peak_calls"],
                }
            return answer
        self._conn.send(command)
        return self._conn.recv()


# --------------------------------------------------------------------------- bare batch loop


def _bare_main(address: str, n: int, size: int, concurrency: int, out: Connection) -> None:
    out.send(asyncio.run(_bare_loop(address, n, size, concurrency)))


async def _bare_loop(address: str, n: int, size: int, concurrency: int) -> dict[str, float]:
    # Batches shaped like the proxy's (same fields, distinct offsets), encoded before timing.
    requests = []
    for start in range(0, n, size):
        request = handler_pb2.HandleMessageBatchRequest()
        for i in range(start, min(n, start + size)):
            request.messages.add(
                topic="bare",
                partition=i % 4,
                offset=i,
                value=value_of(i),
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


def bare_run(handler: BatchHandler, n: int, size: int, concurrency: int) -> dict[str, float]:
    return in_child(_bare_main, (handler.address, n, size, concurrency), "the bare loop")


# --------------------------------------------------------------------------- consume only


def _consume_only_main(bootstrap: str, topic: str, n: int, out: Connection) -> None:
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique_name("bench-consume-only"),
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    seen, started = 0, 0.0
    cpu0 = time.process_time()
    while seen < n:
        messages = consumer.consume(1000, 1.0)
        if messages and not started:
            started, cpu0 = time.monotonic(), time.process_time()
        seen += sum(1 for m in messages if m.error() is None and m.value() is not None)
    ended = time.monotonic()
    cpu = time.process_time() - cpu0
    consumer.close()
    out.send({"rate": rate(n, ended - started), "cpu_us_per_msg": 1e6 * cpu / n})


def consume_only_run(bootstrap: str, topic: str, n: int) -> dict[str, float]:
    """A bare confluent-kafka loop reading the same records and doing nothing with them: what
    any Python consumer, a proxy included, can at most move on this machine."""
    return in_child(_consume_only_main, (bootstrap, topic, n), "the consume-only loop")


# --------------------------------------------------------------------------- proxy runs


def proxy_run(
    bootstrap: str, handler: BatchHandler, topic: str, n: int, delivery: dict[str, Any]
) -> dict[str, Any]:
    """The proxy drains ``topic`` (n messages) with a fresh group."""
    group = unique_name("bench-batch")
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    handler.ask("reset")
    deadline = time.monotonic() + 300
    with BenchProxy(config) as proxy, CommittedReader(bootstrap, group, topic) as reader:
        reader.sum()  # the reader's connection and coordinator lookup, before the clock runs
        cpu_first = 0.0
        while True:
            seen, _calls, first, _last, _ = handler.ask("progress")
            if first is not None and not cpu_first:
                cpu_first = proxy.cpu_seconds()
            if seen >= n:
                cpu_last = proxy.cpu_seconds()
                break
            proxy.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy delivered {seen} of {n}")
            time.sleep(0.02)
        while reader.sum() < n:
            proxy.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the proxy did not commit every offset")
            time.sleep(0.01)
        committed_at = time.monotonic()
        seen, calls, first, last, _ = handler.ask("progress")
        stats = handler.ask("stats")
        sizes = stats["sizes"]
    return {
        "committed_rate": rate(n, committed_at - first),
        "seen_rate": rate(n, last - first),
        "cpu_us_per_msg": 1e6 * (cpu_last - cpu_first) / n,
        "calls": calls,
        "mean_batch": seen / max(calls, 1),
        "sizes": sizes,
        "peak_calls": stats["peak_calls"],
        "duplicates": seen - n,
    }


def latency_run(
    bootstrap: str, handler: BatchHandler, delivery: dict[str, Any], seconds: float, per_s: float
) -> dict[str, Any]:
    """Open loop at ``per_s`` on one fresh partition while the proxy runs."""
    topic = create_topic(bootstrap, unique_name("bench-batch-lat"), partitions=1)
    group = unique_name("bench-batch-lat")
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    with BenchProxy(config) as proxy:
        handler.ask("reset")
        produce_at_rate(bootstrap, topic, 1, 0.001)  # warm-up: wait until the group is up
        wait_for(lambda: handler.ask("progress")[0] >= 1, 60, what="the warm-up message")
        handler.ask("reset")
        n = produce_at_rate(bootstrap, topic, per_s, seconds)
        wait_for(lambda: handler.ask("progress")[0] >= n, 60, what="every message")
        proxy.check_alive()
        stats = handler.ask("stats")
    lat = stats["latency_ms"]
    return {
        "p50": percentile(lat, 50),
        "p99": percentile(lat, 99),
        "max": max(lat),
        "sizes": stats["sizes"],
    }


def sizes_line(sizes: dict[int, int]) -> str:
    calls = sum(sizes.values())
    messages = sum(k * v for k, v in sizes.items())
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:4]
    return (
        f"{calls} calls, mean {messages / max(calls, 1):.1f}, max {max(sizes) if sizes else 0}; "
        f"most frequent {', '.join(f'{k}x{v}' for k, v in top)}"
    )


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200_000, help="messages (throughput run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-messages", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    parser.add_argument(
        "--pc-window", type=int, default=1000, help="max_in_flight of the 1-partition workload"
    )
    parser.add_argument("--only", nargs="+", choices=["throughput", "pc", "latency"], default=None)
    parser.add_argument(
        "--handler",
        choices=["go", "python"],
        default="go",
        help="the handler service: bench/gohandler (default) or the grpc.aio one",
    )
    args = parser.parse_args()
    n = 20_000 if args.quick else args.n
    rounds = 1 if args.quick else args.rounds
    parts = set(args.only or ["throughput", "pc", "latency"])
    result = Result(
        "bench_batch",
        params={
            "n": n,
            "rounds": rounds,
            "max_messages": args.max_messages,
            "concurrency": args.concurrency,
            "value_bytes": VALUE_BYTES,
            "handler": args.handler,
        },
    )
    throughput_delivery = {
        "concurrency": args.concurrency,
        "max_in_flight": 20_000,
        "fetch_batch": 5000,
        "commit_interval_ms": 100,
        "batch": {"max_messages": args.max_messages},
    }
    with broker(args.bootstrap) as bootstrap:
        if "throughput" in parts:
            topic = create_topic(bootstrap, unique_name("bench-batch"), partitions=4)
            t0 = time.monotonic()
            produce_bulk(bootstrap, topic, n, partitions=4, value=value_of)
            print(f"produced {n} x {VALUE_BYTES} B to {topic} in {time.monotonic() - t0:.1f}s")
            bares, proxies, reads = [], [], []
            with BatchHandler(BatchHandlerSpec(), args.handler) as handler:
                for round_ in range(rounds):
                    print(f"throughput round {round_ + 1}/{rounds}", flush=True)
                    bare = bare_run(handler, n, args.max_messages, args.concurrency)
                    print(
                        f"  bare : {bare['rate']:,.0f} msg/s, client CPU "
                        f"{bare['cpu_us_per_msg']:.1f} us/msg",
                        flush=True,
                    )
                    prox = proxy_run(bootstrap, handler, topic, n, throughput_delivery)
                    print(
                        f"  proxy: committed {prox['committed_rate']:,.0f} msg/s (seen "
                        f"{prox['seen_rate']:,.0f}), CPU {prox['cpu_us_per_msg']:.1f} us/msg, "
                        f"batches: {sizes_line(prox['sizes'])}",
                        flush=True,
                    )
                    read = consume_only_run(bootstrap, topic, n)
                    print(
                        f"  consume only (no push, no tracking): {read['rate']:,.0f} msg/s, "
                        f"CPU {read['cpu_us_per_msg']:.1f} us/msg",
                        flush=True,
                    )
                    bares.append(bare)
                    proxies.append(prox)
                    reads.append(read)
            med = statistics.median
            result.figure("throughput.bare_msgs_per_s", med(b["rate"] for b in bares), "msg/s")
            proxy_rate = med(p["committed_rate"] for p in proxies)
            result.figure("throughput.proxy_msgs_per_s_committed", proxy_rate, "msg/s")
            result.figure(
                "throughput.proxy_cpu_us_per_msg", med(p["cpu_us_per_msg"] for p in proxies), "us"
            )
            result.figure(
                "throughput.bare_cpu_us_per_msg", med(b["cpu_us_per_msg"] for b in bares), "us"
            )
            result.figure("throughput.mean_batch", med(p["mean_batch"] for p in proxies))
            result.figures["throughput.runs"] = {"bare": bares, "proxy": proxies}
            per_round = [
                p["committed_rate"] / b["rate"] for b, p in zip(bares, proxies, strict=True)
            ]
            result.figures["throughput.ratio_per_round"] = [round(r, 3) for r in per_round]
            result.ratio("throughput.proxy_committed_over_50k", proxy_rate / 50_000, 1.0)
            result.ratio("throughput.proxy_over_bare", med(per_round), 0.8)
            # The bare loop has no Kafka in it: a loop that only reads the records bounds what
            # any Python consumer can reach against it, and the proxy against that.
            result.figure(
                "throughput.consume_only_msgs_per_s", med(r["rate"] for r in reads), "msg/s"
            )
            result.ratio(
                "throughput.consume_only_over_bare",
                med(r["rate"] / b["rate"] for r, b in zip(reads, bares, strict=True)),
            )
            result.ratio(
                "throughput.proxy_over_consume_only",
                med(p["committed_rate"] / r["rate"] for p, r in zip(proxies, reads, strict=True)),
            )
            result.ratio(
                "pc.four_partitions_noop_over_parallel_consumer",
                proxy_rate / PC_FOUR_PARTITIONS_NOOP,
                1.0,
            )
            result.ratio(
                "throughput.cpu_us_per_msg_over_20",
                med(p["cpu_us_per_msg"] for p in proxies) / 20.0,
                1.0,
                higher_is_better=False,
            )
        if "pc" in parts:
            pc_n = 4000 if args.quick else 60_000
            topic = create_topic(bootstrap, unique_name("bench-batch-pc1"), partitions=1)
            produce_bulk(bootstrap, topic, pc_n, partitions=1, value=value_of)
            delivery = {
                "concurrency": 4,
                "max_in_flight": args.pc_window,
                "commit_interval_ms": 100,
                "batch": {"max_messages": 50},
            }
            runs, pc_bares = [], []
            with BatchHandler(BatchHandlerSpec(delay_ms=20), args.handler) as handler:
                for round_ in range(rounds):
                    # The same calls without Kafka or the proxy: what this machine allows now.
                    pc_bare = bare_run(handler, pc_n, 50, 4)
                    pc_bares.append(pc_bare)
                    print(
                        f"  1 partition, 20 ms/msg, round {round_ + 1}: bare 4 x 50 "
                        f"{pc_bare['rate']:,.0f} msg/s",
                        flush=True,
                    )
                    run = proxy_run(bootstrap, handler, topic, pc_n, delivery)
                    print(
                        f"  1 partition, 20 ms/msg, round {round_ + 1}: committed "
                        f"{run['committed_rate']:,.0f} msg/s, CPU {run['cpu_us_per_msg']:.1f} "
                        f"us/msg, batches: {sizes_line(run['sizes'])}; "
                        f"peak calls {run['peak_calls']}",
                        flush=True,
                    )
                    runs.append(run)
            pc_rate = statistics.median(r["committed_rate"] for r in runs)
            result.figure("pc.one_partition_20ms_msgs_per_s", pc_rate, "msg/s")
            result.figure(
                "pc.one_partition_20ms_cpu_us_per_msg",
                statistics.median(r["cpu_us_per_msg"] for r in runs),
                "us",
            )
            result.figures["pc.one_partition_20ms_runs"] = runs
            result.figure(
                "pc.one_partition_20ms_bare_msgs_per_s",
                statistics.median(b["rate"] for b in pc_bares),
                "msg/s",
            )
            result.ratio(
                "pc.one_partition_20ms_over_bare",
                statistics.median(
                    r["committed_rate"] / b["rate"] for r, b in zip(runs, pc_bares, strict=True)
                ),
            )
            result.ratio("pc.one_partition_20ms_over_ceiling_10k", pc_rate / 10_000)
            result.ratio(
                "pc.one_partition_20ms_over_parallel_consumer", pc_rate / PC_ONE_PARTITION_20MS, 1.0
            )
        if "latency" in parts:
            seconds = 4.0 if args.quick else 10.0
            unary_delivery = {"concurrency": 100, "commit_interval_ms": 200}
            batch_delivery = {**unary_delivery, "concurrency": 4, "batch": {}}
            unary_runs: list[Any] = []
            batch_runs: list[Any] = []
            with BatchHandler(BatchHandlerSpec(latency=True), args.handler) as handler:
                for round_ in range(max(2, rounds - 1) if not args.quick else 1):
                    for name, delivery, runs in (
                        ("unary", unary_delivery, unary_runs),
                        ("batch", batch_delivery, batch_runs),
                    ):
                        run = latency_run(bootstrap, handler, delivery, seconds, 1000.0)
                        print(
                            f"  latency {name} round {round_ + 1}: p50 {run['p50']:.1f} ms, "
                            f"p99 {run['p99']:.1f} ms, max {run['max']:.1f} ms; batches: "
                            f"{sizes_line(run['sizes'])}",
                            flush=True,
                        )
                        runs.append(run)
            med = statistics.median
            unary_p99 = med(r["p99"] for r in unary_runs)
            batch_p99 = med(r["p99"] for r in batch_runs)
            result.figure("latency.unary_p50_ms", med(r["p50"] for r in unary_runs), "ms")
            result.figure("latency.unary_p99_ms", unary_p99, "ms")
            result.figure("latency.batch_p50_ms", med(r["p50"] for r in batch_runs), "ms")
            result.figure("latency.batch_p99_ms", batch_p99, "ms")
            result.figures["latency.runs"] = {"unary": unary_runs, "batch": batch_runs}
            result.ratio(
                "latency.batch_p99_over_unary_p99",
                batch_p99 / unary_p99,
                1.5,
                higher_is_better=False,
            )
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
