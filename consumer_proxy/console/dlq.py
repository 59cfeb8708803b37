"""The console's view of a group's DLQ: a bounded read, counted and filtered.

One page view reads at most ``console.dlq_scan_records`` records (the newest, or from the
first at or after ``since``), with the same consumer and record decoding as ``dlq inspect``
(``tools.kafka_ops``), counts them by status and by reason template (as ``dlq report`` groups
them: ``tools.render.reason_template``), and returns one page of the records the filters
select, newest first. Never a full scan: the full report stays ``dlq report`` on Spark.
Values are previews (``tools.render.show_value``: text, or hex for binary), never raw bytes.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from ..config import GroupConfig, KafkaConfig
from ..core.records import (
    H_ATTEMPT,
    H_DEAD_LETTERED_AT,
    H_OFFSET,
    H_PARTITION,
    H_REASON,
    H_STATUS,
    H_TOPIC,
)
from ..tools import kafka_ops
from ..tools.render import format_ms, reason_template
from ..tools.reports import SampleRecord

PAGE_RECORDS = 50
"""Records one page shows (the newest the filters select)."""
READ_TIMEOUT_S = 3.0
"""Longest one partition's read may take (a page view reads each partition once)."""
STATUS_PATTERN = re.compile(r"[A-Za-z_]{1,64}")
_EPOCH_MS = re.compile(r"[0-9]{1,18}")  # a cp-dead-lettered-at a date may hold
"""A status filter (a gRPC code name or an action name): nothing else reaches a command."""
TEXT_LIMIT = 1024


@dataclass(frozen=True)
class Filter:
    """What the page selects: statuses (any of), a reason template, a time range (the DLQ
    record's timestamp, as ``dlq merge --since/--until`` and ``purge --until`` use)."""

    statuses: tuple[str, ...] = ()
    reason: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None

    @classmethod
    def parse(cls, query: dict[str, list[str]]) -> Filter:
        """From a query string; ValueError naming a bad parameter."""
        statuses = tuple(
            s.strip() for item in query.get("status", []) for s in item.split(",") if s.strip()
        )
        for status in statuses:
            if not STATUS_PATTERN.fullmatch(status):
                raise ValueError(f"status {status[:70]!r}: a gRPC code or action name")
        reason = (query.get("reason") or [""])[0][:TEXT_LIMIT] or None
        return cls(statuses, reason, _ms(query, "since"), _ms(query, "until"))

    def merge_args(self, group: str, config: Path | None) -> list[str]:
        """``dlq merge`` arguments for this filter (status and time; a reason is not a merge
        filter: --where is never built from a record's content)."""
        args = ["dlq", "merge", "--config", str(config or "FILE"), "--group", group]
        for status in self.statuses:
            args += ["--status", status]
        if self.since_ms is not None:
            args += ["--since", str(self.since_ms)]
        if self.until_ms is not None:
            args += ["--until", str(self.until_ms)]
        return args

    def merge_command(self, group: str, config: Path | None) -> str:
        """The exact dry-run command line for this filter, as an operator would type it."""
        return shlex.join(["consumer-proxy", *self.merge_args(group, config), "--dry-run"])


def _ms(query: dict[str, list[str]], name: str) -> int | None:
    value = (query.get(name) or [""])[0].strip()
    if not value:
        return None
    if not re.fullmatch(r"\d{1,15}", value):
        raise ValueError(f"{name}: epoch milliseconds")
    return int(value)


def browse(kafka: KafkaConfig, group: GroupConfig, scan: int, flt: Filter) -> dict[str, Any]:
    """Read at most ``scan`` DLQ records and answer counts and a page (blocking: call it off
    the event loop). A missing DLQ topic is an empty answer with ``missing``."""
    try:
        state = kafka_ops.dlq_partitions(kafka, group)
    except Exception as exc:  # noqa: BLE001 (ConfigError: no DLQ yet; unreachable Kafka)
        return {"topic": group.dlq_topic, "missing": str(exc)[:TEXT_LIMIT], "total": 0}
    consumer = kafka_ops.plain_consumer(kafka)
    records: list[SampleRecord] = []
    complete = True
    try:
        starts = _starts(consumer, group.dlq_topic, state, flt.since_ms)
        share = max(1, scan // max(1, len(state)))
        for part in state:
            start = starts[part.partition]
            first = max(start, part.high - share)
            complete = complete and first <= start
            if part.high > first:
                records += kafka_ops.read_range(
                    consumer, group.dlq_topic, part.partition, first, part.high, READ_TIMEOUT_S
                )
    except KafkaException as exc:
        raise kafka_ops.unreachable(kafka, f"reading {group.dlq_topic}", exc) from exc
    finally:
        consumer.close()
    in_time = [r for r in records if _in_time(r, flt)]
    by_status: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    selected = []
    for record in in_time:
        status = record.cp.get(H_STATUS, "")
        template = reason_template(record.cp.get(H_REASON, "")) or ""
        by_status[status] = by_status.get(status, 0) + 1
        by_reason[template] = by_reason.get(template, 0) + 1
        if (not flt.statuses or status in flt.statuses) and (
            flt.reason is None or template == flt.reason
        ):
            selected.append(record)
    selected.sort(key=lambda r: (r.timestamp_ms or 0, r.partition, r.offset), reverse=True)
    return {
        "topic": group.dlq_topic,
        "total": sum(p.high - p.low for p in state),
        "scanned": len(records),
        "complete": complete,
        "in_time": len(in_time),
        "matching": len(selected),
        "by_status": sorted(by_status.items(), key=lambda kv: -kv[1]),
        "by_reason": sorted(by_reason.items(), key=lambda kv: -kv[1])[:50],
        "records": [_row(r) for r in selected[:PAGE_RECORDS]],
    }


def _starts(
    consumer: Consumer, topic: str, state: list[kafka_ops.DlqPartition], since_ms: int | None
) -> dict[int, int]:
    """Per partition, the first offset the filter's time range can hold."""
    if since_ms is None:
        return {p.partition: p.low for p in state}
    found = consumer.offsets_for_times(
        [TopicPartition(topic, p.partition, since_ms) for p in state],
        timeout=kafka_ops.KAFKA_TIMEOUT_S,
    )
    high = {p.partition: p.high for p in state}
    return {tp.partition: tp.offset if tp.offset >= 0 else high[tp.partition] for tp in found}


def _in_time(record: SampleRecord, flt: Filter) -> bool:
    ts = record.timestamp_ms or 0
    return (flt.since_ms is None or ts >= flt.since_ms) and (
        flt.until_ms is None or ts < flt.until_ms
    )


def _row(record: SampleRecord) -> dict[str, Any]:
    cp = record.cp
    dead_at = cp.get(H_DEAD_LETTERED_AT, "")
    return {
        "partition": record.partition,
        "offset": record.offset,
        "time": format_ms(int(dead_at)) if _EPOCH_MS.fullmatch(dead_at) else "",
        "origin": f"{cp.get(H_TOPIC, '?')}[{cp.get(H_PARTITION, '?')}]@{cp.get(H_OFFSET, '?')}",
        "attempt": cp.get(H_ATTEMPT, ""),
        "status": cp.get(H_STATUS, ""),
        "reason": cp.get(H_REASON, "")[:TEXT_LIMIT],
        "key": record.key,
        "value": record.value,
        "headers": [[h.key[:200], h.value] for h in record.headers[:20]],
    }
