"""``consumer-proxy dlq ...``: look at a group's dead letters.

``inspect`` peeks with a plain consumer (read-only: no group joins, no offsets committed).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from .config import GroupConfig, KafkaConfig, ProxyConfig
from .dlq import split_headers
from .errors import ConfigError, KafkaUnavailableError

CommonOptions = Callable[..., None]


def add_dlq_commands(sub: Any, common: CommonOptions) -> None:
    """Register ``dlq`` and its subcommands on the top-level subparsers."""
    dlq = sub.add_parser("dlq", help="inspect a group's dead-letter topic")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="DLQ_COMMAND")
    inspect = dlq_sub.add_parser(
        "inspect",
        help="per partition: count, oldest/newest, and a sample with cp-* headers decoded",
    )
    common(inspect, as_json=True)
    inspect.add_argument("--group", required=True, metavar="NAME", help="the group")
    inspect.add_argument(
        "--limit", type=int, default=10, metavar="N", help="records to show (default 10)"
    )
    inspect.add_argument(
        "--dry-run", action="store_true", help="accepted for symmetry; inspect never writes"
    )


def run_dlq_command(args: argparse.Namespace, config: ProxyConfig) -> int:
    """Dispatch ``dlq <command>``; returns the exit code."""
    group = config.group(args.group)
    if args.dlq_command == "inspect":
        if args.limit < 0:
            raise ConfigError([f"--limit must be 0 or more, got {args.limit}"])
        report = inspect_dlq(config.kafka, group, args.limit)
        print(json.dumps(report, indent=2) if args.json else render_inspect(report))
        return 0
    raise ConfigError([f"unknown dlq command {args.dlq_command!r}"])


def show_value(value: bytes | None, limit: int = 200) -> str:
    """Text when the bytes are UTF-8 text, else hex with the length; never raw bytes."""
    if value is None:
        return "(null)"
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        head = value[: limit // 2].hex()
        return f"hex:{head}{'...' if len(value) > limit // 2 else ''} ({len(value)} bytes)"
    if not text.isprintable() and not all(c.isprintable() or c in "\n\t\r" for c in text):
        return f"hex:{value[: limit // 2].hex()} ({len(value)} bytes)"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} bytes)"


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


def _plain_consumer(kafka: KafkaConfig) -> Consumer:
    conf: dict[str, Any] = dict(kafka.client)
    conf.update(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": f"consumer-proxy-inspect-{int(time.time())}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    return Consumer(conf)


def inspect_dlq(kafka: KafkaConfig, group: GroupConfig, limit: int) -> dict[str, Any]:
    """Counts, time range and a sample of the group's DLQ (assign, never subscribe)."""
    topic = group.dlq_topic
    consumer = _plain_consumer(kafka)
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise ConfigError([f"group {group.name}: DLQ topic {topic} does not exist"])
        partitions: list[dict[str, Any]] = []
        sample: list[dict[str, Any]] = []
        for p in sorted(meta.partitions):
            tp = TopicPartition(topic, p)
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            entry: dict[str, Any] = {
                "partition": p,
                "low": low,
                "high": high,
                "count": max(0, high - low),
                "oldest_ms": None,
                "newest_ms": None,
            }
            if high > low:
                entry["oldest_ms"] = _timestamp_at(consumer, topic, p, low)
                entry["newest_ms"] = _timestamp_at(consumer, topic, p, high - 1)
                if len(sample) < limit:
                    sample += _read(consumer, topic, p, low, min(high, low + limit - len(sample)))
            partitions.append(entry)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot read {topic}: {exc}") from exc
    finally:
        consumer.close()
    return {
        "group": group.name,
        "topic": topic,
        "total": sum(p["count"] for p in partitions),
        "partitions": partitions,
        "sample": sample,
    }


def _timestamp_at(consumer: Consumer, topic: str, partition: int, offset: int) -> int | None:
    records = _read(consumer, topic, partition, offset, offset + 1)
    return records[0]["timestamp_ms"] if records else None


def _read(
    consumer: Consumer, topic: str, partition: int, start: int, end: int
) -> list[dict[str, Any]]:
    consumer.assign([TopicPartition(topic, partition, start)])
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while len(records) < end - start and time.monotonic() < deadline:
        for msg in consumer.consume(end - start - len(records), 1.0):
            if msg.error() is not None:
                continue
            offset = msg.offset() or 0
            if offset >= end:
                break
            user, ours = split_headers(msg.headers())
            records.append(
                {
                    "partition": partition,
                    "offset": msg.offset(),
                    "timestamp_ms": msg.timestamp()[1],
                    "key": show_value(_as_bytes(msg.key())),
                    "value": show_value(_as_bytes(msg.value())),
                    "headers": {k: show_value(v) for k, v in user},
                    "cp": ours,
                }
            )
    consumer.unassign()
    return records


def render_inspect(report: dict[str, Any]) -> str:
    """A readable summary and the sample."""
    lines = [f"DLQ {report['topic']} of group {report['group']}: {report['total']} records"]
    for p in report["partitions"]:
        lines.append(
            f"  partition {p['partition']}: {p['count']} records (offsets {p['low']}..{p['high']})"
            f" oldest_ms={p['oldest_ms']} newest_ms={p['newest_ms']}"
        )
    for rec in report["sample"]:
        cp = rec["cp"]
        lines.append(
            f"- [{rec['partition']}@{rec['offset']}] {cp.get('cp-original-topic')}"
            f"[{cp.get('cp-original-partition')}]@{cp.get('cp-original-offset')} "
            f"status={cp.get('cp-status')} attempt={cp.get('cp-attempt')} "
            f"reason={cp.get('cp-reason', '')[:120]!r}"
        )
        lines.append(f"    key={rec['key']} value={rec['value']}")
    return "\n".join(lines)
