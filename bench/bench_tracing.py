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

The three modes run interleaved in each round (the order rotates), after ``--warmup`` rounds
not counted (a fresh broker, handler and collector). The headline is the median over rounds
of each round's ratio on/off of the proxy's CPU µs per message (from ``/proc``, all threads)
in a steady window: from the arrival of ``--window-from`` of the messages (10 %: the start-
up's one-time costs, the exporter's connection among them, left out on both sides) to the
N-th, divided by the messages that arrived between the two readings. Printed alongside: the
ratio of the sums over rounds, the rounds' spread, and each thread's share (the proxy runs
under ``bench.profiling`` kind ``threads``: the event loop, the export thread, librdkafka's
threads, the rest) with the garbage collector's full passes. Goal: at most 1.05 at 1 %.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result, rotated
from bench.options import BenchOptions, broker
from bench.producing import produce_bulk
from bench.proxy import proxy_backlog_run
from tests.support.collector import Collector
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(rounds=5, warmup=1)
PARTITIONS = 4
MODES: dict[str, float | None] = {"off": None, "0%": 0.0, "1%": 0.01, "100%": 1.0}
"""Tracing off, or on at a sampling ratio; 0 % (on, nothing sampled: what a message not
sampled costs) only when asked for (``--tracing``)."""
THREADS = ("loop", "export", "kafka", "other")
"""The proxy's threads as the bench groups them (``threads_of``)."""
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


def threads_of(cpu_ns: dict[str, int], messages: int) -> dict[str, float]:
    """CPU µs per message by thread group: the event loop (the main thread), the export thread
    (``otlp-export``), librdkafka's (``rdk:*``), and the rest (the consumer's executor, gRPC's
    own threads)."""
    groups = dict.fromkeys(THREADS, 0)
    for name, ns in cpu_ns.items():
        if name == "MainThread":
            groups["loop"] += ns
        elif name == "otlp-export":
            groups["export"] += ns
        elif name.startswith("rdk:"):
            groups["kafka"] += ns
        else:
            groups["other"] += ns
    return {group: ns / 1000 / max(messages, 1) for group, ns in groups.items()}


def spread(values: Sequence[float]) -> str:
    """The values in order, for a line of the report."""
    return ", ".join(f"{v:.2f}" for v in values)


def measured_run(
    bootstrap: str,
    handler: HandlerServer,
    collector: Collector,
    topic: str,
    n: int,
    kind: str,
    mode: str,
    window_from: int,
    out: Path,
) -> dict[str, Any]:
    """One proxy run over the backlog, with its threads' CPU in the same window."""
    run = proxy_backlog_run(
        bootstrap,
        handler,
        topic,
        n,
        DELIVERY[kind],
        sections=tracing(collector, MODES[mode]),
        profile="threads",
        profile_out=out,
        window_from=window_from,
    )
    profiled = json.loads(out.read_text())
    run["threads"] = threads_of(profiled["thread_cpu_ns"], run["window_msgs"])
    run["full_gc"] = profiled["gc"]["2"][0]
    return run


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[1])
    parser.add_argument("-n", type=int, default=20000, help="unary: messages per run (20000)")
    parser.add_argument(
        "--batch-n", type=int, default=100000, help="batch: messages per run (100000)"
    )
    parser.add_argument(
        "--window-from",
        type=float,
        default=0.1,
        help="the CPU window starts once this share of the messages arrived (default 0.1)",
    )
    parser.add_argument("--modes", nargs="+", choices=list(DELIVERY), default=list(DELIVERY))
    parser.add_argument(
        "--tracing",
        nargs="+",
        choices=list(MODES),
        default=["off", "1%", "100%"],
        help="the modes to compare (off 1%% 100%%)",
    )
    args = parser.parse_args()
    sizes = (
        {"unary": 5000, "batch": 20000} if args.quick else {"unary": args.n, "batch": args.batch_n}
    )
    rounds = 1 if args.quick else args.rounds
    warmup = 0 if args.quick else args.warmup
    modes = [mode for mode in MODES if mode in args.tracing]
    result = Result(
        "bench_tracing",
        params={
            "n": sizes,
            "partitions": PARTITIONS,
            "rounds": rounds,
            "warmup": warmup,
            "window_from": args.window_from,
            "tracing": modes,
            "handler": "go no-op",
        },
    )
    with (
        broker(args.bootstrap) as bootstrap,
        HandlerServer(HandlerSpec(), "go") as handler,
        tempfile.TemporaryDirectory() as directory,
        Collector.start(Path(directory)) as collector,
    ):
        for kind in args.modes:
            n = sizes[kind]
            window_from = max(1, round(args.window_from * n))
            topic = create_topic(bootstrap, unique_name("bench-tracing"), partitions=PARTITIONS)
            produce_bulk(bootstrap, topic, n, partitions=PARTITIONS)
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for round_ in range(-warmup, rounds):
                counted = round_ >= 0
                label = f"{round_ + 1}/{rounds}" if counted else "warm-up"
                for mode in rotated(modes, round_ % len(modes)):
                    out = Path(directory) / f"{kind}-{mode}-{round_}.json".replace("%", "pc")
                    run = measured_run(
                        bootstrap, handler, collector, topic, n, kind, mode, window_from, out
                    )
                    if counted:
                        runs[mode].append(run)
                    threads = " ".join(f"{k} {v:.2f}" for k, v in run["threads"].items())
                    print(
                        f"{kind} round {label} tracing {mode:>4}: "
                        f"{run['window_cpu_us_per_msg']:.2f} µs/msg proxy CPU ({threads}; "
                        f"full gc {run['full_gc']}), seen {run['seen_rate']:,.0f}/s, "
                        f"{run['mean_batch']:.1f} a call",
                        flush=True,
                    )
            for mode in modes:
                cpu = statistics.median(r["window_cpu_us_per_msg"] for r in runs[mode])
                result.figure(f"{kind} proxy CPU/msg tracing {mode}", cpu, "µs")
                for group in THREADS:
                    share = statistics.median(r["threads"][group] for r in runs[mode])
                    result.figures[f"{kind} {group} CPU/msg tracing {mode}"] = share
                print(
                    f"  {kind} tracing {mode:>4} by thread (medians, µs/msg): "
                    + ", ".join(
                        f"{group} {result.figures[f'{kind} {group} CPU/msg tracing {mode}']:.2f}"
                        for group in THREADS
                    ),
                    flush=True,
                )
            if "off" not in modes:
                continue
            offs = runs["off"]
            for mode, target in (("0%", None), ("1%", 1.05), ("100%", None)):
                if mode not in modes:
                    continue
                ons = runs[mode]
                ratios = [
                    on["window_cpu_us_per_msg"] / off["window_cpu_us_per_msg"]
                    for on, off in zip(ons, offs, strict=True)
                ]
                loop_ratios = [
                    on["threads"]["loop"] / off["threads"]["loop"]
                    for on, off in zip(ons, offs, strict=True)
                ]
                of_sums = sum(r["window_cpu_us_per_msg"] for r in ons) / sum(
                    r["window_cpu_us_per_msg"] for r in offs
                )
                result.figures[f"{kind} {mode} / off rounds"] = [round(r, 3) for r in ratios]
                result.figures[f"{kind} {mode} / off ratio of sums"] = round(of_sums, 3)
                print(
                    f"  {kind} {mode} / off: rounds [{spread(ratios)}] (sorted "
                    f"[{spread(sorted(ratios))}]), ratio of sums {of_sums:.3f}; event loop only "
                    f"[{spread(loop_ratios)}], median {statistics.median(loop_ratios):.3f}",
                    flush=True,
                )
                result.ratio(
                    f"{kind} CPU/msg tracing {mode} / off",
                    statistics.median(ratios),
                    target,
                    higher_is_better=False,
                )
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
