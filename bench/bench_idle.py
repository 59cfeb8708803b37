#!/usr/bin/env python3
"""Idle cost of many groups: one proxy process serving G groups vs G bare consumers.

Side by side, on the same broker, with no traffic (issue 13, "the idle cost of a group"):

- the proxy: ``consumer-proxy run`` with G groups, each reading its own topic of 4 partitions
  (plus the DLQ and redrive topics it creates) and pushing to one no-op service;
- the floor: one Python process with G bare confluent-kafka consumers (each its own group on
  the same topics, a thread per consumer calling ``poll(1.0)``) and G idempotent producers.

Once every group owns its partitions, both are sampled over the same window: CPU (% of one
core, from /proc), RSS and threads. Ratios proxy ÷ floor, target ≤ 1.2 for CPU and memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.handlers import HandlerServer, HandlerSpec
from bench.measure import Result, cpu_seconds, wait_for
from bench.options import ROOT, BenchOptions, broker, client_settings
from tests.support.kafka import create_topic, unique_name

OPTIONS = BenchOptions()

PARTITIONS = 4


def proc_status(pid: int) -> tuple[float, int]:
    """(RSS MiB, threads) of ``pid``."""
    rss, threads = 0.0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024.0
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU nanoseconds so far of ``pid``'s threads, summed by thread name (librdkafka names its
    threads ``rdk:main``, ``rdk:broker1``...; Python's show as ``python``)."""
    by_name: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        by_name[name] = by_name.get(name, 0) + ns
    return by_name


def floor_main(bootstrap: str, topics: list[str], ready_file: str) -> None:
    """G bare consumers (a polling thread each) and G idempotent producers."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    producers = [
        Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
        for _ in topics
    ]
    assigned: set[str] = set()
    lock = threading.Lock()

    def run(topic: str) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": unique_name("floor"),
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "partition.assignment.strategy": "cooperative-sticky",
            }
        )

        def on_assign(_c: Consumer, parts: list[TopicPartition]) -> None:
            if parts:
                with lock:
                    assigned.add(topic)
                    if len(assigned) == len(topics):
                        Path(ready_file).write_text("ready")

        consumer.subscribe([topic], on_assign=on_assign)
        while True:
            consumer.poll(1.0)

    for topic in topics:
        threading.Thread(target=run, args=(topic,), daemon=True).start()
    while True:
        for producer in producers:
            producer.poll(0)
        time.sleep(1.0)


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=30.0, help="sampling window")
    parser.add_argument(
        "--baseline-root",
        help="also run the proxy from this checkout (e.g. /work/main) side by side: before/after",
    )
    parser.add_argument(
        "--kafka-client",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka setting for the proxy's kafka.client (A/B of one setting; repeatable)",
    )
    args = parser.parse_args()
    groups = 5 if args.quick else args.groups
    client = client_settings(args.kafka_client)
    seconds = 10.0 if args.quick else args.seconds
    result = Result(
        "bench_idle", params={"groups": groups, "partitions": PARTITIONS, "kafka_client": client}
    )
    with (
        broker(args.bootstrap) as bootstrap,
        HandlerServer(HandlerSpec()) as handler,
        tempfile.TemporaryDirectory(prefix="cp-bench-idle-") as tmp,
    ):
        topics = [
            create_topic(bootstrap, unique_name("idle"), partitions=PARTITIONS)
            for _ in range(groups)
        ]

        def start_proxy(root: Path, tag: str) -> tuple[subprocess.Popen[bytes], Path]:
            names = [unique_name(f"idle-{tag}") for _ in topics]
            config = {
                "kafka": {"bootstrap_servers": bootstrap, "client": client},
                "metrics": {"enabled": False},
                "groups": [
                    {"name": name, "topics": [topic], "service": {"endpoints": [handler.address]}}
                    for name, topic in zip(names, topics, strict=True)
                ],
            }
            path = Path(tmp) / f"proxy-{tag}.json"
            path.write_text(json.dumps(config))
            log_path = Path(tmp) / f"proxy-{tag}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "consumer_proxy",
                        "run",
                        "--config",
                        str(path),
                        "--log-level",
                        "info",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(root),  # `python -m` imports consumer_proxy from there
                )
            return proc, log_path

        proxy, proxy_log = start_proxy(ROOT, "proxy")
        baseline = start_proxy(Path(args.baseline_root), "base") if args.baseline_root else None
        ready = Path(tmp) / "floor.ready"
        floor = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; import bench.bench_idle as b; "
                "b.floor_main(sys.argv[1], sys.argv[2].split(','), sys.argv[3])",
                bootstrap,
                ",".join(topics),
                str(ready),
            ],
            cwd=str(ROOT),
        )
        try:

            def assigned(log_path: Path) -> bool:
                text = log_path.read_text(errors="replace")
                return all(f"{t}[{PARTITIONS - 1}]" in text for t in topics)

            wait_for(lambda: assigned(proxy_log), 180, what="the proxy's groups to own partitions")
            if baseline is not None:
                wait_for(lambda: assigned(baseline[1]), 180, what="the baseline proxy's groups")
            wait_for(ready.exists, 180, what="the bare consumers to own their partitions")
            time.sleep(5.0)  # joins and first commits settle
            pids = [proxy.pid, floor.pid] + ([baseline[0].pid] if baseline else [])
            cpu0 = [cpu_seconds(pid) for pid in pids]
            split0 = [thread_cpu_ns(pid) for pid in pids[:2]]
            t0 = time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - t0
            split = [
                {k: (v - before.get(k, 0)) / 1e6 / elapsed for k, v in thread_cpu_ns(pid).items()}
                for pid, before in zip(pids[:2], split0, strict=True)
            ]
            cpu = [
                100.0 * (cpu_seconds(pid) - c) / elapsed for pid, c in zip(pids, cpu0, strict=True)
            ]
            status = [proc_status(pid) for pid in pids]
        finally:
            for proc in [proxy, *([baseline[0]] if baseline else [])]:
                proc.terminate()
            floor.kill()
            for proc in [proxy, *([baseline[0]] if baseline else [])]:
                proc.wait(60)
            floor.wait(30)
    proxy_cpu, floor_cpu = cpu[0], cpu[1]
    (proxy_rss, proxy_threads), (floor_rss, floor_threads) = status[0], status[1]
    if baseline is not None:
        result.figure("baseline.cpu_percent_of_a_core", round(cpu[2], 2), "%")
        result.figure("baseline.rss_mib", round(status[2][0], 1), "MiB")
        result.figure("baseline.threads", status[2][1])
        result.ratio("baseline_cpu_over_floor", cpu[2] / max(floor_cpu, 1e-9))
        result.ratio("baseline_rss_over_floor", status[2][0] / floor_rss)
    result.figure("proxy.cpu_percent_of_a_core", round(proxy_cpu, 2), "%")
    result.figure("floor.cpu_percent_of_a_core", round(floor_cpu, 2), "%")
    result.figure("proxy.rss_mib", round(proxy_rss, 1), "MiB")
    result.figure("floor.rss_mib", round(floor_rss, 1), "MiB")
    for who, found in zip(("proxy", "floor"), split, strict=True):
        # Where the CPU goes, by thread name: the diagnostic for the next idle-cost hunt.
        for name, ms in sorted(found.items(), key=lambda kv: -kv[1])[:4]:
            result.figure(f"{who}.cpu_ms_per_s.{name}", round(ms, 2), "ms/s")
    result.figure("proxy.threads", proxy_threads)
    result.figure("floor.threads", floor_threads)
    result.ratio(
        "cpu_proxy_over_floor", proxy_cpu / max(floor_cpu, 1e-9), 1.2, higher_is_better=False
    )
    result.ratio("rss_proxy_over_floor", proxy_rss / floor_rss, 1.2, higher_is_better=False)
    result.ratio("threads_proxy_over_floor", proxy_threads / floor_threads)
    result.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
