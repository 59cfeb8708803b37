"""``consumer-proxy status``: the state of each group read straight from Kafka.

No running proxy is needed: committed offsets and their ack-state metadata come from the group
coordinator, end offsets and DLQ depth from the partition leaders; each retry tier's depth
(records the group has not committed) and the earliest due time among its partitions' next
records, read with an assigned consumer that never commits. Nothing is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from .config import GroupConfig, KafkaConfig
from .core.codec import CodecError, decode
from .core.records import due_at_from_headers, split_headers
from .errors import ConsumerProxyError, KafkaUnavailableError


def _client_conf(kafka: KafkaConfig, group: str) -> dict[str, Any]:
    conf: dict[str, Any] = dict(kafka.client)
    conf.update(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    return conf


def _partitions(consumer: Consumer, topic: str) -> list[int]:
    meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
    if meta is None or meta.error is not None:
        return []
    return sorted(meta.partitions)


def collect_status(kafka: KafkaConfig, groups: Sequence[GroupConfig]) -> dict[str, Any]:
    """A JSON-ready report: per group, per partition offsets, lag and ack state; DLQ depth."""
    report: dict[str, Any] = {"groups": []}
    for group in groups:
        # A consumer that never subscribes never joins the group: reading is side-effect free.
        consumer = Consumer(_client_conf(kafka, group.name))
        try:
            entry = _group_status(consumer, group)
        except KafkaException as exc:
            raise KafkaUnavailableError(
                f"cannot read group {group.name} from {kafka.bootstrap_servers}: {exc}"
            ) from exc
        finally:
            consumer.close()
        report["groups"].append(entry)
    return report


def _group_status(consumer: Consumer, group: GroupConfig) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    for topic in [*group.topics, group.redrive_topic, *group.retry_topics]:
        parts = _partitions(consumer, topic)
        if not parts:
            missing.append(topic)
            continue
        committed = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        for tp in committed:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            offset = tp.offset if tp.offset is not None and tp.offset >= 0 else None
            acked_above = 0
            state = "none"
            if offset is not None and tp.metadata:
                try:
                    ack = decode(tp.metadata)
                    acked_above = sum(ack.runs[1::2]) if ack.base == offset else 0
                    state = "ok" if ack.base == offset else "stale"
                except CodecError:
                    state = "foreign"
            lag = high - (offset if offset is not None else low)
            rows.append(
                {
                    "topic": topic,
                    "partition": tp.partition,
                    "committed": offset,
                    "end": high,
                    "lag": max(0, lag),
                    "acked_above_commit": acked_above,
                    "ack_state": state,
                    "metadata_bytes": len(tp.metadata or ""),
                }
            )
    dlq_depth = 0
    dlq_parts = _partitions(consumer, group.dlq_topic)
    for p in dlq_parts:
        low, high = consumer.get_watermark_offsets(TopicPartition(group.dlq_topic, p), timeout=10)
        dlq_depth += max(0, high - low)
    return {
        "group": group.name,
        "partitions": rows,
        "total_lag": sum(r["lag"] for r in rows),
        "dlq_topic": group.dlq_topic,
        "dlq_depth": dlq_depth if dlq_parts else None,
        "retry_tiers": [_tier_status(consumer, group, n) for n in range(len(group.retry_topics))],
        "missing_topics": missing,
        "push": _push(group),
    }


def _push(group: GroupConfig) -> str:
    """How the group pushes, as configured (the running proxy's /readyz and
    ``consumer_proxy_push_instances`` say which instances get batches under ``auto``)."""
    batch = group.delivery.batch
    if batch is None:
        return "unary calls (delivery.batch off)"
    if batch.mode == "auto":
        return (
            "delivery.batch auto: batches to the instances that serve HandleMessageBatch, "
            "unary calls to the others (which: /readyz, consumer_proxy_push_instances)"
        )
    return "batches always (delivery.batch section)"


HEAD_READ_TIMEOUT_S = 10.0


def _tier_status(consumer: Consumer, group: GroupConfig, index: int) -> dict[str, Any]:
    """One retry tier: its depth, and the earliest ``cp-due-at`` among the records each of its
    partitions delivers next (its waiting records are in due order per partition, unless a
    handler's retry_after asked for more than the tier's delay)."""
    topic = group.retry_topics[index]
    entry: dict[str, Any] = {
        "tier": index + 1,
        "topic": topic,
        "delay_ms": group.delivery.retry_topics[index].delay_ms,
        "depth": None,
        "oldest_due_at_ms": None,
    }
    parts = _partitions(consumer, topic)
    if not parts:
        return entry
    heads: list[TopicPartition] = []
    depth = 0
    for tp in consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10):
        low, high = consumer.get_watermark_offsets(tp, timeout=10)
        start = max(low, tp.offset if tp.offset is not None and tp.offset >= 0 else low)
        if high > start:
            depth += high - start
            heads.append(TopicPartition(topic, tp.partition, start))
    entry["depth"] = depth
    if heads:
        consumer.assign(heads)
        try:
            seen: set[int] = set()
            oldest: int | None = None
            deadline = time.monotonic() + HEAD_READ_TIMEOUT_S
            while len(seen) < len(heads) and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is None or msg.error() is not None or msg.partition() in seen:
                    continue
                seen.add(msg.partition() or 0)
                due = due_at_from_headers(split_headers(msg.headers())[1])
                oldest = due if oldest is None else min(oldest, due)
            entry["oldest_due_at_ms"] = oldest
        finally:
            consumer.unassign()
    return entry


PROXY_ANSWER_LIMIT = 4 << 20
"""Most bytes read of one answer of a running proxy's console API."""


def add_open_calls(report: dict[str, Any], url: str) -> None:
    """Add what a running proxy knows to each partition row it owns: the oldest call under
    way (``oldest_call_age_s``, ``oldest_call_offset``) and its window (``in_flight``), read
    from its console API (``console.enabled``). Rows of partitions it does not own get None.
    A proxy that cannot be read is a ConsumerProxyError naming the address (exit 1)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    for group in report["groups"]:
        address = f"{url.rstrip('/')}/console/api/groups/{urllib.parse.quote(group['group'])}"
        try:
            with urllib.request.urlopen(address, timeout=10) as answer:
                state = json.loads(answer.read(PROXY_ANSWER_LIMIT))
        except urllib.error.HTTPError as exc:
            hint = " (is console.enabled set?)" if exc.code == 404 else ""
            raise ConsumerProxyError(f"{address}: HTTP {exc.code}{hint}") from exc
        except (OSError, ValueError) as exc:
            raise ConsumerProxyError(f"cannot read the proxy's state at {address}: {exc}") from exc
        try:
            owned = {(r["topic"], r["partition"]): r for r in state.get("rows", [])}
            for row in group["partitions"]:
                mine = owned.get((row["topic"], row["partition"]))
                call = mine.get("oldest_call") if mine else None
                row["in_flight"] = mine["window"] if mine else None
                row["oldest_call_age_s"] = call["age_s"] if call else None
                row["oldest_call_offset"] = call["offset"] if call else None
        except (AttributeError, KeyError, TypeError) as exc:
            raise ConsumerProxyError(
                f"{address} did not answer as a consumer-proxy console does ({exc!r:.100})"
            ) from exc
        group["proxy"] = url


def _when(epoch_ms: int | None) -> str:
    if epoch_ms is None:
        return "-"
    try:
        moment = datetime.fromtimestamp(epoch_ms / 1000, UTC)
    except (ValueError, OverflowError, OSError):  # a tier record's forged cp-due-at
        return f"{epoch_ms} ms (not a date)"
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def render_status(report: dict[str, Any]) -> str:
    """A plain table per group."""
    lines: list[str] = []
    for group in report["groups"]:
        depth = "missing" if group["dlq_depth"] is None else str(group["dlq_depth"])
        lines.append(
            f"group {group['group']}: lag {group['total_lag']}, "
            f"DLQ {group['dlq_topic']} depth {depth}"
        )
        for tier in group.get("retry_tiers", []):
            depth = "missing" if tier["depth"] is None else str(tier["depth"])
            lines.append(
                f"  retry tier {tier['tier']} {tier['topic']} ({tier['delay_ms']} ms): depth "
                f"{depth}, oldest due {_when(tier['oldest_due_at_ms'])}"
            )
        if group.get("push"):
            lines.append(f"  push: {group['push']}")
        if group["missing_topics"]:
            lines.append(f"  missing topics: {', '.join(group['missing_topics'])}")
        proxy = "proxy" in group  # --proxy: what the running proxy knows, per partition
        lines.append(
            f"  {'topic':<32} {'part':>4} {'committed':>10} {'end':>10} {'lag':>8} "
            f"{'acked>commit':>12} {'state':>7}"
            + (f" {'in flight':>9} {'oldest call':>18}" if proxy else "")
        )
        for r in group["partitions"]:
            committed = "-" if r["committed"] is None else str(r["committed"])
            line = (
                f"  {r['topic']:<32} {r['partition']:>4} {committed:>10} {r['end']:>10} "
                f"{r['lag']:>8} {r['acked_above_commit']:>12} {r['ack_state']:>7}"
            )
            if proxy:
                flight = "-" if r["in_flight"] is None else str(r["in_flight"])
                age = r["oldest_call_age_s"]
                oldest = "-" if age is None else f"{age:.1f}s @{r['oldest_call_offset']}"
                line += f" {flight:>9} {oldest:>18}"
            lines.append(line)
    return "\n".join(lines)
