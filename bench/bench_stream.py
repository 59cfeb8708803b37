#!/usr/bin/env python3
"""Long-running push (``delivery.long_running``): what the streaming call costs.

Every party runs in its own process: the bench handler (``bench.handlers.HandlerServer``, whose
``HandleMessageStream`` heartbeats every ``heartbeat_interval_ms`` while it works as
``HandleMessage`` does), the proxy (``consumer-proxy run``) and this process.

1. **Short handlers through the stream vs unary**, same run, alternating rounds: N messages of
   a 5 ms handler on 4 partitions, drained by a unary group and by a long-running group
   (concurrency 200 each): msg/s (first arrival -> every offset committed) and the proxy's CPU
   microseconds per message. Ratios stream / unary.
2. **1,000 open long calls**: 1,000 messages whose handler runs for minutes, 6 s heartbeat
   timeout (a heartbeat every 2 s per call, so 500 heartbeats/s): the proxy's CPU per second
   with the calls open, minus its CPU per second idle just before (same process), i.e. what the
   heartbeats cost; also per heartbeat.
"""

from __future__ import annotations

import statistics
import time

from bench.handlers import SLOW_MARKER, HandlerServer, HandlerSpec
from bench.measure import Result, rate, wait_for
from bench.offsets import CommittedReader
from bench.options import BenchOptions, broker
from bench.producing import produce_bulk
from bench.proxy import BenchProxy, bench_config
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(rounds=3)

PARTITIONS = 4
LONG_RUNNING = {"heartbeat_timeout_ms": 6000, "max_processing_ms": 3_600_000}


def drain(bootstrap: str, handler: HandlerServer, n: int, stream: bool) -> tuple[float, float]:
    """One round: (msg/s, proxy CPU µs per message) draining ``n`` pre-produced messages."""
    topic, group = unique_name("stream-bench"), unique_name("stream-bench")
    create_topic(bootstrap, topic, partitions=PARTITIONS)
    produce_bulk(bootstrap, topic, n, partitions=PARTITIONS)
    delivery: dict[str, object] = {"concurrency": 200, "max_in_flight": 2000}
    if stream:
        delivery["long_running"] = LONG_RUNNING
    handler.reset()
    config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
    with BenchProxy(config) as proxy, CommittedReader(bootstrap, group, topic) as committed:
        first = wait_for(lambda: handler.progress()[0] > 0, 120, 0.01, "the first arrival")
        cpu0 = proxy.cpu_seconds()
        done = wait_for(lambda: committed.sum() >= n, 600, 0.02, "every offset committed")
        cpu = proxy.cpu_seconds() - cpu0
    return rate(n, done - first), cpu / n * 1e6


def open_calls(bootstrap: str, calls: int, window_s: float) -> tuple[float, float]:
    """(proxy CPU s per s idle, proxy CPU s per s with ``calls`` long calls open)."""
    topic, group = unique_name("stream-open"), unique_name("stream-open")
    create_topic(bootstrap, topic, partitions=PARTITIONS)
    delivery = {"concurrency": calls, "max_in_flight": calls, "long_running": LONG_RUNNING}
    with HandlerServer(HandlerSpec(slow_ms=3_600_000)) as handler:
        config = bench_config(bootstrap, group, [topic], [handler.address], delivery)
        with BenchProxy(config) as proxy:
            # Idle first: the proxy polls, commits, heartbeats to Kafka, nothing else.
            time.sleep(10.0)  # the group joins and settles
            cpu0, t0 = proxy.cpu_seconds(), time.monotonic()
            time.sleep(window_s)
            idle = (proxy.cpu_seconds() - cpu0) / (time.monotonic() - t0)
            produce_bulk(
                bootstrap,
                topic,
                calls,
                partitions=PARTITIONS,
                value=lambda i: SLOW_MARKER + b"%d" % i,
            )
            handler.wait_seen(calls, 120)
            time.sleep(3.0)  # every call has had a heartbeat
            cpu0, t0 = proxy.cpu_seconds(), time.monotonic()
            time.sleep(window_s)
            busy = (proxy.cpu_seconds() - cpu0) / (time.monotonic() - t0)
            proxy.check_alive()
    return idle, busy


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--window", type=float, default=20.0, help="CPU sampling window, s")
    args = parser.parse_args()
    n = 4000 if args.quick else args.messages
    rounds = 1 if args.quick else args.rounds
    window = 10.0 if args.quick else args.window
    result = Result(
        "bench_stream",
        params={"messages": n, "rounds": rounds, "calls": args.calls, "window_s": window},
    )
    with broker(args.bootstrap) as bootstrap:
        with HandlerServer(HandlerSpec(delay_ms=5)) as handler:
            figures: dict[str, list[tuple[float, float]]] = {"unary": [], "stream": []}
            for _ in range(rounds):
                for mode in ("unary", "stream"):
                    figures[mode].append(drain(bootstrap, handler, n, mode == "stream"))
        for mode, runs in figures.items():
            result.figure(f"{mode}: msg/s (median)", statistics.median(r[0] for r in runs))
            result.figure(
                f"{mode}: proxy CPU per message (median)",
                statistics.median(r[1] for r in runs),
                "µs",
            )
        ratios = [s[0] / u[0] for u, s in zip(figures["unary"], figures["stream"], strict=True)]
        cpu = [s[1] / u[1] for u, s in zip(figures["unary"], figures["stream"], strict=True)]
        result.ratio("stream / unary msg/s", statistics.median(ratios))
        result.ratio("stream / unary CPU per message", statistics.median(cpu))
        idle, busy = open_calls(bootstrap, args.calls, window)
        beats_per_s = args.calls / (LONG_RUNNING["heartbeat_timeout_ms"] / 3 / 1000)
        result.figure("proxy CPU idle", idle * 100, "% of a core")
        result.figure(f"proxy CPU with {args.calls} long calls open", busy * 100, "% of a core")
        result.figure("heartbeats per second", beats_per_s)
        result.figure("proxy CPU per heartbeat", (busy - idle) / beats_per_s * 1e6, "µs")
        result.ratio("heartbeat CPU (s per s)", busy - idle)
    result.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
