#!/usr/bin/env python3
"""Head-of-line blocking: the proxy vs a plain sequential confluent-kafka consumer.

One partition; the handler (its own process) takes 20 ms per message, and 2 s for 1% of them
(every 100th message, offset % 100 == 50, carries the "slow" marker).

Throughput (pre-produced backlog):
- sequential: a plain ``Consumer`` polling one message at a time, calling the handler over gRPC
  (sync stub) and committing after each (``commit(message, asynchronous=False)``), as a queue
  consumer would. It runs for a fixed window (default 20 s) from its first message; its rate is
  messages handled and committed / elapsed.
- proxy: ``consumer-proxy run`` with ``concurrency`` (default 200) and ``max_in_flight`` 10000
  (the window must hold ~2 s of traffic behind a slow message), over N (default 40000)
  messages. Its rate is N / (first delivery -> every offset committed), which includes the 2 s
  tail of the last slow message; the rate to the N-th first delivery ("seen") and the 10%..90%
  arrival rate ("steady") are reported too. The headline ratio uses the committed rate
  (target >= 100).

Latency (open loop): a producer writes to a fresh one-partition topic at a steady rate (linger 0)
while the proxy runs; **latency = handler receipt (wall clock) - the record's Kafka timestamp
(CreateTime, set by the producer when it accepted the record)**, first deliveries only, same
machine clock. Measured for the fast messages, once with 1% slow messages in the stream and once
without; "unaffected" means their p99 ratio stays near 1. For contrast the sequential consumer's
fast-message p99 is measured the same way at a rate it can sustain (default 10 msg/s).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import grpc
from confluent_kafka import Consumer

from bench.handlers import SLOW_MARKER, HandlerServer, HandlerSpec
from bench.measure import Result, percentile, rate
from bench.offsets import committed_sum
from bench.options import BenchOptions, broker
from bench.producing import produce_at_rate, produce_bulk
from bench.proxy import BenchProxy, bench_config, proxy_backlog_run
from consumer_proxy.proto.v1 import handler_pb2, handler_pb2_grpc
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions()

FAST_MS, SLOW_MS = 20.0, 2000.0


def value_with_slow(i: int) -> bytes:
    """1%: every 100th message, at offset % 100 == 50, is slow."""
    return (SLOW_MARKER if i % 100 == 50 else b"fast") + b"-%012d" % i


def value_fast(i: int) -> bytes:
    return b"fast-%012d" % i


class Sequential:
    """A plain queue-style consumer: poll one, handle it, commit it, repeat."""

    def __init__(self, bootstrap: str, topic: str, address: str) -> None:
        self.topic = topic
        self.group = unique_name("bench-hol-seq")
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": self.group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        self.consumer.subscribe([topic])
        self.channel = grpc.insecure_channel(address)
        self.stub = handler_pb2_grpc.MessageHandlerStub(self.channel)

    def handle_one(self, timeout_s: float) -> bool:
        """Poll one message and, if there was one, handle and commit it."""
        msg = self.consumer.poll(timeout_s)
        if msg is None or msg.error() is not None:
            return False
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        assert topic is not None and partition is not None and offset is not None
        request = handler_pb2.HandleMessageRequest(
            message=handler_pb2.Message(
                topic=topic,
                partition=partition,
                offset=offset,
                value=msg.value() or b"",
                has_value=msg.value() is not None,
                timestamp_ms=max(msg.timestamp()[1], 0),
                consumer_group=self.group,
                attempt=1,
                source=handler_pb2.DELIVERY_SOURCE_PRIMARY,
            )
        )
        self.stub.HandleMessage(request, timeout=30)
        self.consumer.commit(message=msg, asynchronous=False)
        return True

    def close(self) -> None:
        self.consumer.close()
        self.channel.close()


def sequential_throughput(
    bootstrap: str, topic: str, handler: HandlerServer, window_s: float
) -> dict[str, float]:
    seq = Sequential(bootstrap, topic, handler.address)
    try:
        count, first, joined_by = 0, None, time.monotonic() + 60
        while True:
            handled = seq.handle_one(0.5)
            now = time.monotonic()
            if handled:
                count += 1
                if first is None:
                    first = now  # the join is not part of the window; its first message is
            if first is not None and now - first >= window_s:
                break
            if first is None and now > joined_by:
                raise TimeoutError("the sequential consumer got no message in 60s")
        committed = committed_sum(bootstrap, seq.group, topic)
    finally:
        seq.close()
    return {
        "handled": count,
        "elapsed_s": now - first,
        "rate": rate(count, now - first),
        "committed_offset": committed,
    }


def proxy_throughput(
    bootstrap: str, topic: str, handler: HandlerServer, n: int, concurrency: int
) -> dict[str, float]:
    # The window must hold ~2 s of traffic behind a slow message: max_in_flight 10000.
    delivery = {"concurrency": concurrency, "max_in_flight": 10000, "commit_interval_ms": 200}
    return proxy_backlog_run(bootstrap, handler, topic, n, delivery, timeout_s=240)


def latency_summary(values: list[float]) -> dict[str, Any]:
    return {
        "count": len(values),
        "p50_ms": percentile(values, 50),
        "p99_ms": percentile(values, 99),
        "max_ms": max(values) if values else None,
    }


def proxy_latency(
    bootstrap: str,
    handler: HandlerServer,
    slow: bool,
    rate_per_s: float,
    duration_s: float,
    concurrency: int,
) -> dict[str, Any]:
    topic = create_topic(bootstrap, unique_name("bench-hol-lat"), partitions=1)
    group = unique_name("bench-hol-lat")
    delivery = {"concurrency": concurrency, "max_in_flight": 10000, "commit_interval_ms": 200}
    handler.reset()
    produce_bulk(bootstrap, topic, 1, value=lambda _i: b"warm-up")
    with BenchProxy(bench_config(bootstrap, group, [topic], [handler.address], delivery)) as proxy:
        handler.wait_seen(1, timeout_s=60)  # joined and delivering: start the clock now
        handler.reset()
        produced = produce_at_rate(
            bootstrap,
            topic,
            rate_per_s,
            duration_s,
            value=value_with_slow if slow else value_fast,
        )
        handler.wait_seen(produced, timeout_s=60)
        proxy.check_alive()
        stats = handler.stats()
    return {
        "produced": produced,
        "fast": latency_summary(stats["latency_fast_ms"]),
        "slow": latency_summary(stats["latency_slow_ms"]),
    }


def sequential_latency(
    bootstrap: str, handler: HandlerServer, rate_per_s: float, duration_s: float
) -> dict[str, Any]:
    topic = create_topic(bootstrap, unique_name("bench-hol-seqlat"), partitions=1)
    produce_bulk(bootstrap, topic, 1, value=lambda _i: b"warm-up")
    seq = Sequential(bootstrap, topic, handler.address)
    try:
        deadline = time.monotonic() + 60
        while not seq.handle_one(0.5):
            if time.monotonic() > deadline:
                raise TimeoutError("the sequential consumer did not join in 60s")
        handler.reset()
        produced: list[int] = []
        producer = threading.Thread(
            target=lambda: produced.append(
                produce_at_rate(bootstrap, topic, rate_per_s, duration_s, value=value_with_slow)
            ),
            daemon=True,
        )
        producer.start()
        handled = 0
        deadline = time.monotonic() + duration_s + 60
        while producer.is_alive() or handled < produced[0]:
            handled += seq.handle_one(0.2)
            if time.monotonic() > deadline:
                raise TimeoutError("the sequential consumer fell behind by more than 60s")
        stats = handler.stats()
    finally:
        seq.close()
    return {
        "produced": produced[0],
        "fast": latency_summary(stats["latency_fast_ms"]),
        "slow": latency_summary(stats["latency_slow_ms"]),
    }


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=40000, help="proxy backlog (default 40000)")
    parser.add_argument("--concurrency", type=int, default=200, help="proxy concurrency")
    parser.add_argument("--window", type=float, default=20.0, help="sequential window, s")
    parser.add_argument("--rate", type=float, default=300.0, help="latency phase msg/s")
    parser.add_argument("--duration", type=float, default=15.0, help="latency phase s")
    parser.add_argument(
        "--seq-rate",
        type=float,
        default=10.0,
        help="sequential latency phase msg/s (0: skip; it must stay below ~24 msg/s)",
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.window, args.duration = 3000, 5.0, 5.0
        args.seq_rate = 0.0
    result = Result(
        "bench_hol",
        params={
            "n": args.n,
            "concurrency": args.concurrency,
            "sequential_window_s": args.window,
            "handler_ms": FAST_MS,
            "slow_ms": SLOW_MS,
            "slow_fraction": 0.01,
            "latency_rate_per_s": args.rate,
            "latency_duration_s": args.duration,
            "sequential_latency_rate_per_s": args.seq_rate,
        },
    )
    spec = HandlerSpec(delay_ms=FAST_MS, slow_ms=SLOW_MS)
    with broker(args.bootstrap) as bootstrap, HandlerServer(spec) as handler:
        topic = create_topic(bootstrap, unique_name("bench-hol"), partitions=1)
        produce_bulk(bootstrap, topic, args.n, value=value_with_slow)
        print(f"produced {args.n} messages (1% slow) to {topic}", flush=True)

        print(f"sequential consumer for {args.window:g}s ...", flush=True)
        seq = sequential_throughput(bootstrap, topic, handler, args.window)
        result.figure("sequential.msgs_per_s", seq["rate"], "msg/s")
        result.figure("sequential.handled", seq["handled"])
        result.figures["sequential"] = seq

        print(f"proxy over {args.n} messages ...", flush=True)
        prox = proxy_throughput(bootstrap, topic, handler, args.n, args.concurrency)
        result.figure("proxy.msgs_per_s_to_committed", prox["committed_rate"], "msg/s")
        result.figure("proxy.msgs_per_s_seen", prox["seen_rate"], "msg/s")
        result.figure("proxy.msgs_per_s_steady", prox["steady_rate"], "msg/s")
        result.figure("proxy.duplicates", prox["duplicates"])
        result.figure("proxy.cpu_us_per_msg", round(prox["client_cpu_us_per_msg"], 1), "us")
        result.figures["proxy"] = prox
        result.ratio("proxy_over_sequential", prox["committed_rate"] / seq["rate"], 100.0)
        result.ratio("proxy_seen_over_sequential", prox["seen_rate"] / seq["rate"])
        result.ratio("proxy_steady_over_sequential", prox["steady_rate"] / seq["rate"])

        lat = {}
        for slow in (False, True):
            label = "with_slow" if slow else "without_slow"
            print(
                f"proxy latency, {label}, {args.rate:g} msg/s for {args.duration:g}s ...",
                flush=True,
            )
            lat[label] = proxy_latency(
                bootstrap, handler, slow, args.rate, args.duration, args.concurrency
            )
            fast = lat[label]["fast"]
            result.figure(f"proxy.{label}.fast_p50_ms", fast["p50_ms"], "ms")
            result.figure(f"proxy.{label}.fast_p99_ms", fast["p99_ms"], "ms")
            result.figure(f"proxy.{label}.fast_max_ms", fast["max_ms"], "ms")
            result.figure(f"proxy.{label}.fast_count", fast["count"])
        result.figures["proxy.latency"] = lat
        p99_with = lat["with_slow"]["fast"]["p99_ms"]
        p99_without = lat["without_slow"]["fast"]["p99_ms"]
        result.ratio(
            "fast_p99_with_over_without_slow", p99_with / p99_without, 1.5, higher_is_better=False
        )

        if args.seq_rate > 0:
            print(
                f"sequential latency, with slow, {args.seq_rate:g} msg/s for {args.window:g}s ...",
                flush=True,
            )
            seq_lat = sequential_latency(bootstrap, handler, args.seq_rate, args.window)
            result.figure("sequential.with_slow.fast_p50_ms", seq_lat["fast"]["p50_ms"], "ms")
            result.figure("sequential.with_slow.fast_p99_ms", seq_lat["fast"]["p99_ms"], "ms")
            result.figures["sequential.latency"] = seq_lat
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
