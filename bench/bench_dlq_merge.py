#!/usr/bin/env python3
"""``dlq merge`` throughput on local Spark: records/s at 100k and 1M DLQ records.

    .venv/bin/python -m bench.bench_dlq_merge [--sizes 100000,1000000] [--master local[*]]

Per size, a fresh group's DLQ (4 partitions) is filled with records shaped like the proxy's
dead letters (a 100-byte value, a user header and the ten cp-* headers), then:

- ``dry run``: ``dlq merge --dry-run --status INVALID_ARGUMENT`` (read and select, no write);
- ``merge``: ``dlq merge --yes`` of every record (the whole command in-process: offsets and
  mark lookup, the counting pass into Spark's cache, the write to the redrive topic with
  acks=all, the mark commit), reported as records/s and, separately, the write phase alone;
- ``baseline``: the same records copied DLQ -> a scratch topic by one Python process with
  confluent-kafka (consume, produce acks=all idempotent, flush), the way a merge without Spark
  would move them. The headline ratio is merge / baseline.

Spark's start-up (JVM, Kafka connector resolution from the Ivy cache, session) is timed on its
own, then one small merge warms the JVM up, so the rates above are steady-state job costs.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from bench.measure import Result, rate
from bench.options import BenchOptions, broker
from bench.producing import produce_bulk
from consumer_proxy.cli import main as cli_main
from consumer_proxy.core import records as dlq_records
from consumer_proxy.tools import spark
from tests.support.kafka import create_topic, end_offsets, unique_name
from tests.support.proxy import make_config

OPTIONS = BenchOptions(always_quick=True)

PARTITIONS = 4
VALUE = b"v" * 100
STATUSES = ["INVALID_ARGUMENT", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED", "DATA_LOSS"]


def produce_dlq(bootstrap: str, topic: str, n: int) -> float:
    """Produce ``n`` dead letters round-robin over the partitions; returns the seconds taken."""
    now = int(time.time() * 1000)

    def headers(i: int) -> list[tuple[str, str | bytes | None]]:
        origin = dlq_records.Origin("orders", i % 12, i, now - 60_000, 1)
        return dlq_records.dlq_headers(
            [("trace-id", b"%016d" % i)],
            origin,
            attempt=1,
            status=STATUSES[i % len(STATUSES)],
            reason="cannot parse the payload",
            endpoint="10.0.0.1:50051",
            group="bench",
            now_ms=now,
        )

    started = time.monotonic()
    produce_bulk(
        bootstrap,
        topic,
        n,
        partitions=PARTITIONS,
        value=lambda i: VALUE,
        key=lambda i: b"k%06d" % (i % 50_000),
        headers=headers,
        settings={
            "enable.idempotence": True,
            "linger.ms": 50,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 500_000,
        },
    )
    return time.monotonic() - started


def python_copy(bootstrap: str, source: str, target: str) -> tuple[int, float]:
    """Copy every record of ``source`` to ``target`` with confluent-kafka; (records, seconds)."""
    ends = end_offsets(bootstrap, source)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique_name("bench-copy"),
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 20,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 500_000,
        }
    )
    pending = {p for p, end in ends.items() if end > 0}
    copied = 0
    started = time.monotonic()
    consumer.assign([TopicPartition(source, p, 0) for p in sorted(pending)])
    try:
        while pending:
            for msg in consumer.consume(10_000, 1.0):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                    continue
                while True:
                    try:
                        producer.produce(target, msg.value(), msg.key(), headers=msg.headers())
                        break
                    except BufferError:
                        producer.poll(0.05)
                copied += 1
                offset, partition = msg.offset(), msg.partition()
                assert offset is not None and partition is not None
                if offset >= ends[partition] - 1:
                    pending.discard(partition)
            producer.poll(0)
        if producer.flush(120):
            raise RuntimeError("the baseline copy did not flush")
    finally:
        consumer.close()
    return copied, time.monotonic() - started


def merge(config: Path, group: str, *extra: str) -> tuple[float, dict[str, Any]]:
    """``consumer-proxy dlq merge`` in-process (reusing the running Spark); (seconds, summary)."""
    out = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out):
        code = cli_main(
            ["dlq", "merge", "--config", str(config), "--group", group, "--json", *extra]
        )
    elapsed = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"dlq merge exited {code}: {out.getvalue()}")
    summary: dict[str, Any] = json.loads(out.getvalue())
    return elapsed, summary


def group_with_dlq(bootstrap: str, directory: Path, n: int) -> tuple[str, Path, float]:
    group = unique_name("bench-dlq")
    create_topic(bootstrap, f"{group}.dlq", partitions=PARTITIONS)
    create_topic(bootstrap, f"{group}.redrive", partitions=PARTITIONS)
    seconds = produce_dlq(bootstrap, f"{group}.dlq", n)
    config = make_config(bootstrap, group, [f"{group}.source"], ["127.0.0.1:1"])
    path = directory / f"{group}.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    return group, path, seconds


def main() -> int:
    parser = OPTIONS.parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="100000,1000000", help="DLQ sizes, comma-separated (default %(default)s)"
    )
    parser.add_argument("--master", default=spark.DEFAULT_MASTER, help="Spark master")
    args = parser.parse_args()
    sizes = [20_000, 100_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    result = Result(
        "bench_dlq_merge",
        params={"sizes": sizes, "partitions": PARTITIONS, "master": args.master,
                "value_bytes": len(VALUE)},
    )  # fmt: skip
    with broker(args.bootstrap) as bootstrap, tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        started = time.monotonic()
        run = spark.start_spark(spark.SparkOptions(master=args.master), print)
        result.figure("spark_startup_s", round(time.monotonic() - started, 2), "s")
        try:
            group, config, _ = group_with_dlq(bootstrap, directory, 2000)
            seconds, _summary = merge(config, group, "--yes")
            result.figure("first_merge_2k_records_s (JVM warm-up)", round(seconds, 2), "s")
            for n in sizes:
                print(f"--- {n} DLQ records", flush=True)
                group, config, produce_s = group_with_dlq(bootstrap, directory, n)
                result.figure(f"{n}.produce_records_per_s", rate(n, produce_s), "rec/s")
                seconds, summary = merge(config, group, "--dry-run", "--status", "INVALID_ARGUMENT")
                assert summary["selected"] == n // len(STATUSES) + (n % len(STATUSES) > 0)
                result.figure(f"{n}.dry_run_scan_records_per_s", rate(n, seconds), "rec/s")
                seconds, summary = merge(config, group, "--yes")
                assert summary["merged"] == n, summary
                merge_rate = rate(n, seconds)
                result.figure(f"{n}.merge_seconds", round(seconds, 2), "s")
                result.figure(f"{n}.merge_records_per_s", merge_rate, "rec/s")
                result.figure(
                    f"{n}.merge_write_phase_records_per_s",
                    rate(n, summary["write_seconds"]),
                    "rec/s",
                )
                scratch = create_topic(bootstrap, unique_name("bench-copy"), PARTITIONS)
                copied, copy_s = python_copy(bootstrap, f"{group}.dlq", scratch)
                assert copied == n, (copied, n)
                baseline = rate(n, copy_s)
                result.figure(f"{n}.baseline_python_copy_records_per_s", baseline, "rec/s")
                result.ratio(f"{n}.merge_vs_python_copy", merge_rate / baseline)
        finally:
            run.spark.stop()
            if run.console_log is not None:
                run.console_log.unlink(missing_ok=True)
    result.note(
        "merge rates are for the whole command (count pass + write + mark); Spark start-up "
        "is not in them"
    )
    result.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
