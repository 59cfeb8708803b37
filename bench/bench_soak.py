#!/usr/bin/env python3
"""Soak: the proxy under a steady load for a long run (default 10 minutes); memory and latency.

Not part of the test suite. Processes: a private broker (unless ``--bootstrap``), the handler
service in a process of its own (``delay_ms`` per call, always ACK), ``consumer-proxy run``
(one worker, so its RSS is one process's), and this process, which produces at a steady rate
(open loop, round robin over the partitions, linger 0) from a thread and samples once a minute:

- the proxy's RSS (``VmRSS`` from /proc/PID/status; psutil is not needed) and peak (``VmHWM``);
- latency of the messages first delivered in that minute: handler receipt (wall clock) minus the
  record's Kafka timestamp (CreateTime), p50 / p90 / p99 / max;
- the proxy's CPU seconds, deliveries and duplicate deliveries, the group's uncommitted backlog.

At the end production stops, the proxy must commit every offset, and it is stopped with SIGTERM.
Headline ratios (baseline = the first full minute, after start-up):
``rss_end_over_rss_minute1`` (flat memory: target <= 1.25) and ``p99_last_over_p99_first``
(stable latency; informational on a shared machine). Prints a table and writes
``bench/results/bench_soak-<time>.json``.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result, percentile
from bench.offsets import committed_sum
from bench.options import BenchOptions, broker
from bench.proxy import BenchProxy, bench_config
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions(always_quick=True)


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB, from /proc/PID/status."""
    found = {"VmRSS": 0, "VmHWM": 0}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in found:
            found[name] = int(rest.split()[0])
    return found["VmRSS"], found["VmHWM"]


class SteadyProducer(threading.Thread):
    """Produces ``rate_per_s`` records a second round robin over ``partitions`` until stopped.

    Open loop: the schedule does not wait for the consumer side; a record's value is its index.
    """

    def __init__(self, bootstrap: str, topic: str, partitions: int, rate_per_s: float) -> None:
        super().__init__(name="soak-producer", daemon=True)
        self._producer = Producer({"bootstrap.servers": bootstrap, "acks": 1, "linger.ms": 0})
        self._topic = topic
        self._partitions = partitions
        self._rate = rate_per_s
        self._halt = threading.Event()
        self.produced = 0
        self.failures: list[str] = []
        self.behind_max_s = 0.0  # how far the producer itself ever fell behind its schedule

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.failures.append(str(err))

    def run(self) -> None:
        started = time.monotonic()
        i = 0
        while not self._halt.is_set():
            due = started + i / self._rate
            now = time.monotonic()
            if due > now:
                self._halt.wait(due - now)
                continue
            self.behind_max_s = max(self.behind_max_s, now - due)
            while True:
                try:
                    self._producer.produce(
                        self._topic,
                        b"m%015d" % i,
                        partition=i % self._partitions,
                        on_delivery=self._delivered,
                    )
                    break
                except BufferError:
                    self._producer.poll(0.05)
            self._producer.poll(0)
            i += 1
            self.produced = i
        left = self._producer.flush(60)
        if left:
            self.failures.append(f"{left} records undelivered at the end")

    def stop(self) -> int:
        self._halt.set()
        self.join(120)
        return self.produced


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="load duration (default 10)")
    parser.add_argument("--rate", type=float, default=300.0, help="messages/s (default 300)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="handler time per call")
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument(
        "--interval-s", type=float, default=60.0, help="sampling interval (default 60)"
    )
    args = parser.parse_args()
    minutes = 1.0 if args.quick else args.minutes
    interval = 15.0 if args.quick else args.interval_s
    result = Result(
        "bench_soak",
        params={
            "minutes": minutes,
            "rate_per_s": args.rate,
            "partitions": args.partitions,
            "handler_delay_ms": args.delay_ms,
            "concurrency": args.concurrency,
            "interval_s": interval,
            "workers": 1,
        },
    )
    with (
        broker(args.bootstrap) as bootstrap,
        HandlerServer(HandlerSpec(delay_ms=args.delay_ms)) as handler,
    ):
        topic = create_topic(bootstrap, unique_name("soak"), partitions=args.partitions)
        group = unique_name("soak")
        config = bench_config(
            bootstrap,
            group,
            [topic],
            [handler.address],
            {"concurrency": args.concurrency, "commit_interval_ms": 500},
        )
        proxy = BenchProxy(config).start()
        try:
            rows = soak(bootstrap, topic, group, handler, proxy, args, minutes, interval, result)
        finally:
            code = proxy.stop()
            proxy.cleanup()
        result.figure("proxy_exit_code", code)
    print_table(rows)
    result.figures["samples"] = rows
    full = [r for r in rows if not r["partial"]] or rows
    first, last = full[0], full[-1]
    result.figure("rss_start_kib", rows[0]["rss_start_kib"], "KiB")
    result.figure("rss_minute1_kib", first["rss_kib"], "KiB")
    result.figure("rss_end_kib", rows[-1]["rss_kib"], "KiB")
    result.figure("rss_peak_kib", max(r["hwm_kib"] for r in rows), "KiB")
    all_p50 = [r["p50_ms"] for r in full if r["p50_ms"] is not None]
    all_p99 = [r["p99_ms"] for r in full if r["p99_ms"] is not None]
    result.figure("p50_ms_median_of_intervals", sorted(all_p50)[len(all_p50) // 2], "ms")
    result.figure("p99_ms_median_of_intervals", sorted(all_p99)[len(all_p99) // 2], "ms")
    result.figure("p99_ms_worst_interval", max(all_p99), "ms")
    result.ratio(
        "rss_end_over_rss_minute1",
        rows[-1]["rss_kib"] / first["rss_kib"],
        1.25,
        higher_is_better=False,
    )
    if first["p99_ms"] and last["p99_ms"]:
        result.ratio("p99_last_over_p99_first", last["p99_ms"] / first["p99_ms"])
    result.write()
    return 0 if code == 0 else 1


def soak(
    bootstrap: str,
    topic: str,
    group: str,
    handler: HandlerServer,
    proxy: BenchProxy,
    args: Any,
    minutes: float,
    interval: float,
    result: Result,
) -> list[dict[str, Any]]:
    """Run the load, sample every ``interval`` seconds; returns one row per interval."""
    # Start-up first (imports, group join) with one warm-up record per partition, so that no
    # backlog built up during the join inflates the first interval's latencies.
    warm = Producer({"bootstrap.servers": bootstrap, "acks": 1})
    for p in range(args.partitions):
        warm.produce(topic, b"warm-up", partition=p)
    if warm.flush(30):
        raise RuntimeError("the warm-up records were not delivered")
    deadline = time.monotonic() + 120
    while handler.progress()[0] < args.partitions:
        proxy.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError("the warm-up records were not delivered within 120s of start")
        time.sleep(0.1)
    handler.reset()
    rss_start = rss_kib(proxy.pid)[0]
    producer = SteadyProducer(bootstrap, topic, args.partitions, args.rate)
    producer.start()
    print(
        f"warm-up delivered after {time.monotonic() - proxy.started_at:.1f}s; proxy RSS "
        f"{rss_start / 1024:.1f} MiB; soaking {minutes:g} min at {args.rate:g}/s",
        flush=True,
    )
    print(_HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    seen_latencies = 0
    cpu_before = proxy.cpu_seconds()
    load_started = time.monotonic()
    end = load_started + minutes * 60.0
    calls_before = distinct_before = 0
    while True:
        now = time.monotonic()
        next_sample = min(end, load_started + (len(rows) + 1) * interval)
        while time.monotonic() < next_sample:
            proxy.check_alive()
            time.sleep(min(1.0, max(0.0, next_sample - time.monotonic())))
        stats = handler.stats()
        latencies = stats["latency_fast_ms"][seen_latencies:]
        seen_latencies = len(stats["latency_fast_ms"])
        rss, hwm = rss_kib(proxy.pid)
        cpu = proxy.cpu_seconds()
        elapsed = time.monotonic() - now
        produced = producer.produced
        backlog = produced + args.partitions - committed_sum(bootstrap, group, topic)
        row = {
            "minute": round((time.monotonic() - load_started) / 60.0, 2),
            "partial": elapsed < interval * 0.9,
            "rss_start_kib": rss_start,
            "rss_kib": rss,
            "hwm_kib": hwm,
            "delivered": len(latencies),
            "p50_ms": percentile(latencies, 50),
            "p90_ms": percentile(latencies, 90),
            "p99_ms": percentile(latencies, 99),
            "max_ms": max(latencies) if latencies else None,
            "cpu_s": round(cpu - cpu_before, 2),
            "duplicates": (stats["calls"] - calls_before) - (stats["distinct"] - distinct_before),
            "uncommitted": backlog,
            "produced": produced,
        }
        calls_before, distinct_before = stats["calls"], stats["distinct"]
        cpu_before = cpu
        rows.append(row)
        print_row(row)
        if time.monotonic() >= end - 0.5:
            break
    produced = producer.stop()
    if producer.failures:
        raise RuntimeError(f"producing failed: {producer.failures[:3]}")
    result.figure("produced", produced)
    result.figure("producer_behind_max_s", round(producer.behind_max_s, 3), "s")
    drain = time.monotonic()
    while committed_sum(bootstrap, group, topic) < produced + args.partitions:
        proxy.check_alive()
        if time.monotonic() - drain > 120:
            raise TimeoutError("the proxy did not commit every offset within 120s of the end")
        time.sleep(0.2)
    result.figure("drain_to_committed_s", round(time.monotonic() - drain, 2), "s")
    stats = handler.stats()
    result.figure("distinct_delivered", stats["distinct"])
    result.figure("duplicate_deliveries", stats["calls"] - stats["distinct"])
    if stats["distinct"] != produced:
        raise RuntimeError(f"{produced} produced but {stats['distinct']} delivered")
    return rows


_HEADER = (
    f"{'min':>6} {'RSS MiB':>8} {'HWM MiB':>8} {'msgs':>7} {'p50 ms':>8} {'p90 ms':>8} "
    f"{'p99 ms':>8} {'max ms':>8} {'CPU s':>6} {'dups':>5} {'uncommitted':>11}"
)


def _ms(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else f"{'-':>8}"


def print_row(row: dict[str, Any], header: bool = False) -> None:
    if header:
        print(_HEADER)
    print(
        f"{row['minute']:6.2f} {row['rss_kib'] / 1024:8.1f} {row['hwm_kib'] / 1024:8.1f} "
        f"{row['delivered']:7d} {_ms(row['p50_ms'])} {_ms(row['p90_ms'])} {_ms(row['p99_ms'])} "
        f"{_ms(row['max_ms'])} {row['cpu_s']:6.1f} {row['duplicates']:5d} "
        f"{row['uncommitted']:11d}",
        flush=True,
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nsoak summary (latency = handler receipt - Kafka CreateTime, first deliveries)")
    print(_HEADER)
    for row in rows:
        print_row(row)


if __name__ == "__main__":
    sys.exit(main())
