#!/usr/bin/env python3
"""Batch push (``delivery.batch``): throughput, Parallel-Consumer-style workloads, latency.

Every party runs in its own process: the handler service (``bench.handlers``, with its cheap
``count_only`` books: the Python one parses a request in C, counts the messages and answers a
pre-encoded all-ack response, never looking at a message in Python; the Go one by default),
the proxy (``consumer-proxy run``, one process), a bare grpc.aio client, and this process
(produces, polls, reads commits).

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

import statistics
import sys
import time
from typing import Any

from bench.floors import consume_only_run
from bench.handlers import HandlerServer, HandlerSpec
from bench.loops import run_bare_batch_loop
from bench.measure import Result, percentile
from bench.offsets import CommittedReader
from bench.options import BenchOptions, broker
from bench.producing import produce_at_rate, produce_bulk, sized_value
from bench.proxy import BenchProxy, bench_config, drain, drain_figures
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(handler=True, rounds=3)

VALUE_BYTES = 100
PC_ONE_PARTITION_20MS = 8327.0  # msg/s, quoted in issue 13 (quiet machine)
PC_FOUR_PARTITIONS_NOOP = 35309.0


# --------------------------------------------------------------------------- proxy runs


def proxy_run(
    bootstrap: str, handler: HandlerServer, topic: str, n: int, delivery: dict[str, Any]
) -> dict[str, Any]:
    """The proxy drains ``topic`` (n messages) with a fresh group."""
    group = unique_name("bench-batch")
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    handler.reset()
    with BenchProxy(config) as proxy, CommittedReader(bootstrap, group, topic) as reader:
        reader.sum()  # the reader's connection and coordinator lookup, before the clock runs
        drained = drain(handler, proxy, reader, n, time.monotonic() + 300)
    figures = drain_figures(n, drained, proxy.started_at)
    return {**figures, "cpu_us_per_msg": figures["client_cpu_us_per_msg"]}


def latency_run(
    bootstrap: str, handler: HandlerServer, delivery: dict[str, Any], seconds: float, per_s: float
) -> dict[str, Any]:
    """Open loop at ``per_s`` on one fresh partition while the proxy runs."""
    topic = create_topic(bootstrap, unique_name("bench-batch-lat"), partitions=1)
    group = unique_name("bench-batch-lat")
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    with BenchProxy(config) as proxy:
        handler.reset()
        produce_at_rate(bootstrap, topic, 1, 0.001)  # warm-up: wait until the group is up
        handler.wait_seen(1, 60)
        handler.reset()
        n = produce_at_rate(bootstrap, topic, per_s, seconds)
        handler.wait_seen(n, 60)
        proxy.check_alive()
        stats = handler.stats()
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
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200_000, help="messages (throughput run)")
    parser.add_argument("--max-messages", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    parser.add_argument(
        "--pc-window", type=int, default=1000, help="max_in_flight of the 1-partition workload"
    )
    parser.add_argument("--only", nargs="+", choices=["throughput", "pc", "latency"], default=None)
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
            produce_bulk(bootstrap, topic, n, partitions=4, value=sized_value)
            print(f"produced {n} x {VALUE_BYTES} B to {topic} in {time.monotonic() - t0:.1f}s")
            bares, proxies, reads = [], [], []
            with HandlerServer(HandlerSpec(count_only=True), args.handler) as handler:
                for round_ in range(rounds):
                    print(f"throughput round {round_ + 1}/{rounds}", flush=True)
                    bare = run_bare_batch_loop(
                        handler.address, n, args.max_messages, args.concurrency
                    )
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
            produce_bulk(bootstrap, topic, pc_n, partitions=1, value=sized_value)
            delivery = {
                "concurrency": 4,
                "max_in_flight": args.pc_window,
                "commit_interval_ms": 100,
                "batch": {"max_messages": 50},
            }
            runs, pc_bares = [], []
            with HandlerServer(HandlerSpec(delay_ms=20, count_only=True), args.handler) as handler:
                for round_ in range(rounds):
                    # The same calls without Kafka or the proxy: what this machine allows now.
                    pc_bare = run_bare_batch_loop(handler.address, pc_n, 50, 4)
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
            with HandlerServer(HandlerSpec(latency=True, count_only=True), args.handler) as handler:
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
