#!/usr/bin/env python3
"""Retry tiers vs in-memory retries: commit lag and duplicates after a kill -9.

Two partitions; a producer writes at a steady rate for a while; 2% of the messages are slow
to recover: the handler fails them (INTERNAL) until ``recover_s`` after their first delivery,
then acks them. The same workload runs twice, each with a fresh group and topic:

- in memory: today's retries (backoff 100 ms .. 30 s), ``max_attempts`` high enough that
  nothing is dead-lettered;
- tiers: ``retry_topics`` of 2 s and 5 s after one in-memory attempt (same ``max_attempts``).

Commit lag = end offsets - committed offsets of the source topic, summed, sampled every
0.25 s while the producer runs (mean, p95, max). Half-way through, the proxy process is killed
with SIGKILL and started again; duplicates = acks beyond the first, from the ledger.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import grpc
from confluent_kafka import Producer

from bench.measure import Result, percentile
from bench.options import BenchOptions, broker
from consumer_proxy.proto.v1 import handler_pb2
from tests.support.kafka import committed_offsets, create_topic, end_offsets, unique_name
from tests.support.ledger import Ledger
from tests.support.proxy import ProxyProcess, write_config
from tests.support.service import Behaviour, ThreadedService
from tests.support.waiting import wait_until

OPTIONS = BenchOptions()


def _lag(bootstrap: str, group: str, topic: str) -> int:
    ends = end_offsets(bootstrap, topic)
    committed = committed_offsets(bootstrap, group, topic)
    return sum(max(0, end - committed.get(p, (0, None))[0]) for p, end in ends.items())


def run_one(
    bootstrap: str, tiers: bool, rate_per_s: int, seconds: float, recover_s: float, tmp: Path
) -> dict[str, Any]:
    topic, group = unique_name("bench-tiers"), unique_name("bench-tiers")
    create_topic(bootstrap, topic, partitions=2)
    ledger = Ledger("tiers" if tiers else "in memory")
    first_seen: dict[str, float] = {}
    slow: set[str] = set()

    def behaviour(msg: handler_pb2.Message, _k: int) -> Behaviour:
        ident = Ledger.id_of((h.key, h.value) for h in msg.headers)
        if ident not in slow or ident is None:
            return Behaviour()
        first = first_seen.setdefault(ident, time.monotonic())
        if time.monotonic() - first < recover_s:
            return Behaviour(status=grpc.StatusCode.INTERNAL, details="not yet")
        return Behaviour()

    delivery: dict[str, Any] = {"concurrency": 50, "max_in_flight": 2000, "max_attempts": 50}
    delivery["backoff"] = {"initial_ms": 100, "max_ms": 30000}
    delivery["commit_interval_ms"] = 1000
    if tiers:
        delivery["retry_topics"] = [{"delay_ms": 2000}, {"delay_ms": 5000}]
    total = int(rate_per_s * seconds)
    records = ledger.records(total, partitions=2)
    for i, record in enumerate(records):
        if i % 50 == 7:
            slow.add(Ledger.id_of(record["headers"]) or "")
    samples: list[int] = []
    with ThreadedService(behaviour) as service:
        config = write_config(
            tmp / f"{group}.json",
            bootstrap,
            group,
            [topic],
            [service.address],
            delivery=delivery,
            client={"session.timeout.ms": 3000, "heartbeat.interval.ms": 300},
        )
        log = tmp / f"{group}.log"
        proxy = ProxyProcess(config, log).start()
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        done = threading.Event()

        def produce() -> None:
            started = time.monotonic()
            for i, record in enumerate(records):
                due = started + i / rate_per_s
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                producer.produce(
                    topic,
                    value=record["value"],
                    headers=record["headers"],
                    partition=record["partition"],
                )
                producer.poll(0)
            producer.flush(30)
            done.set()

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        killed = False
        started = time.monotonic()
        try:
            while not done.is_set():
                time.sleep(0.25)
                samples.append(_lag(bootstrap, group, topic))
                if not killed and time.monotonic() - started >= seconds / 2:
                    proxy.kill()
                    proxy = ProxyProcess(config, log).start()
                    killed = True
            thread.join()

            def all_acked() -> bool:
                acked = {Ledger.id_of(d.headers) for d in service.deliveries if d.outcome == "ACK"}
                return len(acked) >= total

            wait_until(all_acked, timeout=180, interval=0.5)
        finally:
            code = proxy.stop()
        assert code == 0, proxy.output()[-2000:]
        ledger.observe(service.deliveries)
    summary = ledger.summary()
    assert summary.missing == 0, summary.line()
    after_kill = samples[len(samples) // 2 + 8 :] or samples
    return {
        "lag_mean": sum(samples) / len(samples),
        "lag_p95": percentile([float(s) for s in samples], 95) or 0.0,
        "lag_max": max(samples),
        "lag_mean_before_kill": sum(samples[: len(samples) // 2]) / max(1, len(samples) // 2),
        "lag_mean_after_kill": sum(after_kill) / len(after_kill),
        "duplicates": summary.duplicates,
        "messages": total,
        "slow": len(slow),
        "dead_lettered": summary.dead_lettered,
    }


def main() -> int:
    parser = OPTIONS.parser(__doc__ or "")
    parser.add_argument("--rate", type=int, default=400, help="messages per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to produce")
    parser.add_argument("--recover-s", type=float, default=6.0)
    args = parser.parse_args()
    seconds = 10.0 if args.quick else args.seconds
    result = Result("bench_retry_tiers", params=vars(args))
    with broker(args.bootstrap) as bootstrap, TemporaryDirectory() as tmp:
        figures = {}
        for tiers in (False, True):
            name = "tiers" if tiers else "memory"
            print(f"run: {name}", flush=True)
            figures[name] = run_one(bootstrap, tiers, args.rate, seconds, args.recover_s, Path(tmp))
            for key, value in figures[name].items():
                result.figure(f"{name} {key}", value)
        mem, tie = figures["memory"], figures["tiers"]
        result.ratio("commit lag mean, tiers / memory", tie["lag_mean"] / max(1.0, mem["lag_mean"]))
        result.ratio("commit lag p95, tiers / memory", tie["lag_p95"] / max(1.0, mem["lag_p95"]))
        result.ratio(
            "duplicates after kill -9, tiers / memory",
            tie["duplicates"] / max(1, mem["duplicates"]),
        )
    result.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
