#!/usr/bin/env python3
"""Tracing's cost: the proxy's CPU per message with tracing off, on at 1 % sampling, on at 100 %.

A topic of small messages, pushed by ``consumer-proxy run`` (one process) with a fresh group per
run to a no-op handler in its own process (the Go one, a few µs of CPU per call, so the handler
does not eat the proxy's core), in unary mode (``concurrency`` 100; 20,000 messages) and in
batch mode (``batch: always``, 100 a batch; 100,000 messages, its CPU per message being a
tenth). Tracing on exports OTLP/gRPC to a real OpenTelemetry Collector (the tests' one,
tests/support/collector.py) writing to a file, so the export's own CPU is counted. The records
carry no trace context (each message is a new trace), so the ratio decides (parent-based: a
producer's sampled flag would decide otherwise).

The three modes run interleaved in each round (the order rotates), and the headline is the
median over rounds of each round's ratio on/off of the proxy's CPU µs per message (from
``/proc``, all threads, first delivery to the N-th). Goal: at most 1.05 at 1 %.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result, rotated
from bench.options import BenchOptions, broker
from bench.producing import produce_bulk
from bench.proxy import proxy_backlog_run
from tests.support.collector import Collector
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions()
PARTITIONS = 4
MODES: dict[str, float | None] = {"off": None, "1%": 0.01, "100%": 1.0}
DELIVERY: dict[str, dict[str, Any]] = {
    "unary": {"concurrency": 100, "commit_interval_ms": 200, "batch": "off"},
    "batch": {
        "concurrency": 4,
        "commit_interval_ms": 200,
        "batch": {"mode": "always", "max_messages": 100, "linger_ms": 5},
    },
}


def tracing(collector: Collector, ratio: float | None) -> dict[str, Any]:
    if ratio is None:
        return {"tracing": {"enabled": False}}
    return {
        "tracing": {
            "enabled": True,
            "endpoint": collector.otlp_grpc,
            "sample_ratio": ratio,
            "max_queue_size": 65536,  # no span dropped at 100 %: all of them are paid for
        }
    }


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=20000, help="unary: messages per run (20000)")
    parser.add_argument(
        "--batch-n", type=int, default=100000, help="batch: messages per run (100000)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the 3 modes (default 5)")
    parser.add_argument("--modes", nargs="+", choices=list(DELIVERY), default=list(DELIVERY))
    args = parser.parse_args()
    sizes = (
        {"unary": 5000, "batch": 20000} if args.quick else {"unary": args.n, "batch": args.batch_n}
    )
    rounds = 1 if args.quick else args.rounds
    result = Result(
        "bench_tracing",
        params={"n": sizes, "partitions": PARTITIONS, "rounds": rounds, "handler": "go no-op"},
    )
    with (
        broker(args.bootstrap) as bootstrap,
        HandlerServer(HandlerSpec(), "go") as handler,
        tempfile.TemporaryDirectory() as directory,
        Collector.start(Path(directory)) as collector,
    ):
        for kind in args.modes:
            n = sizes[kind]
            topic = create_topic(bootstrap, unique_name("bench-tracing"), partitions=PARTITIONS)
            produce_bulk(bootstrap, topic, n, partitions=PARTITIONS)
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for round_ in range(rounds):
                order = rotated(list(MODES), round_)
                for mode in order:
                    run = proxy_backlog_run(
                        bootstrap,
                        handler,
                        topic,
                        n,
                        DELIVERY[kind],
                        sections=tracing(collector, MODES[mode]),
                    )
                    runs[mode].append(run)
                    print(
                        f"{kind} round {round_ + 1}/{rounds} tracing {mode:>4}: "
                        f"{run['client_cpu_us_per_msg']:.1f} µs/msg proxy CPU, "
                        f"seen {run['seen_rate']:,.0f}/s",
                        flush=True,
                    )
            for mode in MODES:
                cpu = statistics.median(r["client_cpu_us_per_msg"] for r in runs[mode])
                result.figure(f"{kind} proxy CPU/msg tracing {mode}", cpu, "µs")
            for mode, target in (("1%", 1.05), ("100%", None)):
                ratio = statistics.median(
                    on["client_cpu_us_per_msg"] / off["client_cpu_us_per_msg"]
                    for on, off in zip(runs[mode], runs["off"], strict=True)
                )
                result.ratio(
                    f"{kind} CPU/msg tracing {mode} / off", ratio, target, higher_is_better=False
                )
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
