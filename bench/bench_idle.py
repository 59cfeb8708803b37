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

from common import (
    ROOT,
    HandlerServer,
    HandlerSpec,
    Result,
    base_parser,
    broker,
    cpu_seconds,
    create_topic,
    unique_name,
    wait_for,
)

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


def floor_main(bootstrap: str, topics: list[str], ready_file: str) -> None:
    """G bare consumers (a polling thread each) and G idempotent producers."""
    from confluent_kafka import Consumer, Producer

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

        def on_assign(_c: object, parts: list[object]) -> None:
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
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=30.0, help="sampling window")
    args = parser.parse_args()
    groups = 5 if args.quick else args.groups
    seconds = 10.0 if args.quick else args.seconds
    result = Result("bench_idle", params={"groups": groups, "partitions": PARTITIONS})
    with (
        broker(args.bootstrap) as bootstrap,
        HandlerServer(HandlerSpec()) as handler,
        tempfile.TemporaryDirectory(prefix="cp-bench-idle-") as tmp,
    ):
        topics = [
            create_topic(bootstrap, unique_name("idle"), partitions=PARTITIONS)
            for _ in range(groups)
        ]
        names = [unique_name("idle-g") for _ in topics]
        config = {
            "kafka": {"bootstrap_servers": bootstrap},
            "metrics": {"enabled": False},
            "groups": [
                {"name": name, "topics": [topic], "service": {"endpoints": [handler.address]}}
                for name, topic in zip(names, topics, strict=True)
            ],
        }
        path = Path(tmp) / "proxy.json"
        path.write_text(json.dumps(config))
        log = open(Path(tmp) / "proxy.log", "wb")  # noqa: SIM115
        proxy = subprocess.Popen(
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
            cwd=str(ROOT),
        )
        ready = Path(tmp) / "floor.ready"
        floor = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; sys.path.insert(0, 'bench'); import bench_idle as b; "
                "b.floor_main(sys.argv[1], sys.argv[2].split(','), sys.argv[3])",
                bootstrap,
                ",".join(topics),
                str(ready),
            ],
            cwd=str(ROOT),
        )
        try:

            def proxy_assigned() -> bool:
                text = (Path(tmp) / "proxy.log").read_text(errors="replace")
                return all(f"{t}[{PARTITIONS - 1}]" in text for t in topics)

            wait_for(proxy_assigned, 180, what="the proxy's groups to own their partitions")
            wait_for(ready.exists, 180, what="the bare consumers to own their partitions")
            time.sleep(5.0)  # joins and first commits settle
            cpu0 = (cpu_seconds(proxy.pid), cpu_seconds(floor.pid))
            t0 = time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - t0
            cpu1 = (cpu_seconds(proxy.pid), cpu_seconds(floor.pid))
            proxy_cpu = 100.0 * (cpu1[0] - cpu0[0]) / elapsed
            floor_cpu = 100.0 * (cpu1[1] - cpu0[1]) / elapsed
            proxy_rss, proxy_threads = proc_status(proxy.pid)
            floor_rss, floor_threads = proc_status(floor.pid)
        finally:
            proxy.terminate()
            floor.kill()
            proxy.wait(60)
            floor.wait(30)
            log.close()
    result.figure("proxy.cpu_percent_of_a_core", round(proxy_cpu, 2), "%")
    result.figure("floor.cpu_percent_of_a_core", round(floor_cpu, 2), "%")
    result.figure("proxy.rss_mib", round(proxy_rss, 1), "MiB")
    result.figure("floor.rss_mib", round(floor_rss, 1), "MiB")
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
