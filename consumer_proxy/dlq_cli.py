"""``consumer-proxy dlq ...``: look at, report on, merge back and purge a group's dead letters.

- ``inspect`` peeks with a plain consumer (read-only: no group joins, no offsets committed).
- ``report`` and ``merge`` run on Spark (``consumer_proxy.pipeline``, the optional ``pipeline``
  extra); this module plans their offset ranges and keeps the merge mark.
- ``purge`` deletes a prefix of each DLQ partition with the admin API (delete records).

The merge mark: how far ``dlq merge`` got, per DLQ partition, kept as the committed offsets of
the consumer group ``<group>.dlq-merge`` on the DLQ topic (Kafka stores it; nothing on disk).
A merge reads from the mark to the end offsets seen at its start, and commits the new mark
only once every selected record is confirmed written to the redrive topic, so a rerun merges
nothing twice and ``purge --merged`` deletes exactly what merges have gone over. Records a
merge's filters leave out are passed over too: the mark is a decision over a range.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from . import pipeline
from .config import GroupConfig, KafkaConfig, ProxyConfig
from .dlq import split_headers
from .errors import ConfigError, KafkaUnavailableError

CommonOptions = Callable[..., None]
KAFKA_TIMEOUT_S = 15.0
EXIT_OK, EXIT_FAILURE = 0, 1
MERGE_MARK_SUFFIX = ".dlq-merge"
T = TypeVar("T")


def merge_mark_group(group: GroupConfig) -> str:
    """The consumer group whose committed offsets on the DLQ are the merge mark."""
    return f"{group.name}{MERGE_MARK_SUFFIX}"


# --- arguments -------------------------------------------------------------------------------


def parse_time(text: str) -> int:
    """A time as epoch milliseconds: ISO-8601 (UTC when no offset is given) or epoch ms."""
    value = text.strip()
    if re.fullmatch(r"\d+", value):
        return int(value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither ISO-8601 (e.g. 2025-05-01T12:00:00Z) nor epoch milliseconds"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def _spark_options(parser: argparse.ArgumentParser) -> None:
    spark = parser.add_argument_group("Spark")
    spark.add_argument(
        "--master",
        default="local[*]",
        metavar="URL",
        help="Spark master (default local[*]: every core of this machine); e.g. "
        "spark://host:7077 for a cluster",
    )
    spark.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, e.g. spark.driver.memory=4g (repeatable)",
    )
    spark.add_argument(
        "--connector-version",
        metavar="V",
        help="version of org.apache.spark:spark-sql-kafka-0-10 (default: the installed "
        "PySpark's; resolved through ~/.ivy2.5.2, ~/.m2 and Maven Central)",
    )


def add_dlq_commands(sub: Any, common: CommonOptions) -> None:
    """Register ``dlq`` and its subcommands on the top-level subparsers."""
    dlq = sub.add_parser("dlq", help="inspect, report on, merge back and purge a group's DLQ")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="DLQ_COMMAND")

    inspect = dlq_sub.add_parser(
        "inspect",
        help="per partition: count, oldest/newest, merge/purge marks, and a sample with cp-* "
        "headers decoded",
    )
    common(inspect, as_json=True)
    inspect.add_argument("--group", required=True, metavar="NAME", help="the group")
    inspect.add_argument(
        "--limit", type=int, default=10, metavar="N", help="records to show (default 10)"
    )
    inspect.add_argument(
        "--dry-run", action="store_true", help="accepted for symmetry; inspect never writes"
    )

    report = dlq_sub.add_parser(
        "report",
        help="Spark job: counts by status, reason, original partition, hour and key; JSON + PNG",
        description="Aggregate the whole DLQ (bounded to its end offsets at start) on Spark. "
        "Writes <out>/<group>-dlq-report.json and .png and prints a summary.",
    )
    common(report, as_json=True)
    report.add_argument("--group", required=True, metavar="NAME", help="the group")
    report.add_argument(
        "--out", type=Path, default=Path("."), metavar="DIR", help="output directory (default .)"
    )
    report.add_argument("--top", type=int, default=10, metavar="N", help="top keys (default 10)")
    report.add_argument(
        "--dry-run", action="store_true", help="accepted for symmetry; report writes only files"
    )
    _spark_options(report)

    columns = "\n".join(f"  {name:<19} {meaning}" for name, meaning in pipeline.DLQ_COLUMNS.items())
    merge = dlq_sub.add_parser(
        "merge",
        help="Spark job: send selected DLQ records back through the group's redrive topic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Read the DLQ from the merge mark to its end offsets at start, keep the "
            "selected records and write them, unchanged (key, value, all headers), to the "
            "group's redrive topic, which the proxy delivers with the original coordinates and "
            "the attempt count carried on. The mark then moves to those end offsets: records the "
            "filters leave out are passed over (and purge --merged deletes them).",
            width=78,
        ),
        epilog="columns for --where (Spark SQL, view dlq; a failed cast is NULL):\n" + columns,
    )
    common(merge, as_json=True)
    merge.add_argument("--group", required=True, metavar="NAME", help="the group")
    merge.add_argument(
        "--since",
        type=parse_time,
        metavar="T",
        help="DLQ record timestamp at or after T (ISO-8601 or epoch ms)",
    )
    merge.add_argument(
        "--until",
        type=parse_time,
        metavar="T",
        help="DLQ record timestamp before T (ISO-8601 or epoch ms)",
    )
    merge.add_argument(
        "--status",
        action="append",
        default=[],
        metavar="S",
        help="cp-status equal to S, e.g. INVALID_ARGUMENT (repeatable, or comma-separated)",
    )
    merge.add_argument(
        "--where", metavar="SPARK_SQL", help="a Spark SQL condition, e.g. \"value LIKE '%%v2%%'\""
    )
    merge.add_argument(
        "--from-start",
        action="store_true",
        help="read from the oldest record still in the DLQ instead of the merge mark",
    )
    merge.add_argument(
        "--dry-run", action="store_true", help="count what would be merged; write nothing"
    )
    merge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _spark_options(merge)

    purge = dlq_sub.add_parser(
        "purge",
        help="delete DLQ records up to a bound (admin API delete records)",
        description="Delete, per DLQ partition, every record before a bound. Shows what it "
        "will delete and asks for confirmation (on a terminal) unless --yes.",
    )
    common(purge, as_json=True)
    purge.add_argument("--group", required=True, metavar="NAME", help="the group")
    bound = purge.add_mutually_exclusive_group(required=True)
    bound.add_argument(
        "--until",
        type=parse_time,
        metavar="T",
        help="records whose timestamp is before T (per partition, up to the first one at or "
        "after T)",
    )
    bound.add_argument(
        "--merged", action="store_true", help="records before the merge mark (already merged)"
    )
    bound.add_argument("--all", action="store_true", help="every record")
    purge.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def run_dlq_command(args: argparse.Namespace, config: ProxyConfig) -> int:
    """Dispatch ``dlq <command>``; returns the exit code."""
    group = config.group(args.group)
    if args.dlq_command == "inspect":
        if args.limit < 0:
            raise ConfigError([f"--limit must be 0 or more, got {args.limit}"])
        report = inspect_dlq(config.kafka, group, args.limit)
        print(json.dumps(report, indent=2) if args.json else render_inspect(report))
        return EXIT_OK
    if args.dlq_command == "report":
        return _report(args, config.kafka, group)
    if args.dlq_command == "merge":
        return _merge(args, config.kafka, group)
    if args.dlq_command == "purge":
        return _purge(args, config.kafka, group)
    raise ConfigError([f"unknown dlq command {args.dlq_command!r}"])


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _confirm(question: str) -> bool:
    answer = input(f"{question} [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _require_confirmation_possible(args: argparse.Namespace, what: str) -> None:
    # Decided before anything runs: a script without --yes fails at once, not after a scan.
    if not args.yes and not args.dry_run and not sys.stdin.isatty():
        raise ConfigError(
            [
                f"refusing to {what} without confirmation: stdin is not a terminal; "
                "pass --yes (or --dry-run to look first)"
            ]
        )


# --- Kafka-side state: partitions, watermarks, merge mark ------------------------------------


@dataclass(frozen=True)
class DlqPartition:
    """One DLQ partition: [low, high) is what it holds; ``merged`` the merge mark or None."""

    partition: int
    low: int
    high: int
    merged: int | None
    merge_note: str | None = None


def _client_conf(kafka: KafkaConfig, group_id: str | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = dict(kafka.client)
    conf["bootstrap.servers"] = kafka.bootstrap_servers
    if group_id is not None:
        conf.update({"group.id": group_id, "enable.auto.commit": False})
    return conf


def _admin_conf(kafka: KafkaConfig) -> dict[str, Any]:
    conf = _client_conf(kafka)
    for consumer_only in ("isolation.level", "auto.offset.reset", "session.timeout.ms"):
        conf.pop(consumer_only, None)
    return conf


def _missing_topic(group: GroupConfig, topic: str, role: str) -> ConfigError:
    hint = (
        "nothing has been dead-lettered yet, or dlq.topic names another topic"
        if role == "DLQ"
        else "start the proxy once (it creates it) or create it by hand"
    )
    return ConfigError([f"group {group.name}: {role} topic {topic} does not exist ({hint})"])


_COORDINATOR_CODES = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
}


def _with_coordinator(call: Callable[[], T], timeout_s: float = KAFKA_TIMEOUT_S) -> T:
    """``call()``, retried while the group coordinator is moving or still loading.

    On a fresh cluster, or while a broker fails over, offset lookups and commits answer
    NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS for a moment; that is no reason to fail.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            transient = isinstance(error, KafkaError) and error.code() in _COORDINATOR_CODES
            if not transient or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def dlq_partitions(kafka: KafkaConfig, group: GroupConfig) -> list[DlqPartition]:
    """Watermarks and merge mark of every DLQ partition; ConfigError if the topic is missing.

    Read-only: the merge-mark group is only asked for its committed offsets, never joined.
    """
    topic = group.dlq_topic
    consumer = Consumer(_client_conf(kafka, merge_mark_group(group)))
    try:
        meta = consumer.list_topics(topic, timeout=KAFKA_TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise _missing_topic(group, topic, "DLQ")
        tps = [TopicPartition(topic, p) for p in sorted(meta.partitions)]
        committed = _with_coordinator(lambda: consumer.committed(tps, timeout=KAFKA_TIMEOUT_S))
        result = []
        for tp in committed:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, tp.partition), timeout=KAFKA_TIMEOUT_S
            )
            merged = tp.offset if tp.offset is not None and tp.offset >= 0 else None
            result.append(DlqPartition(tp.partition, low, high, merged, tp.metadata or None))
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot read {topic}: {exc}") from exc
    finally:
        consumer.close()
    return sorted(result, key=lambda p: p.partition)


def _topic_exists(kafka: KafkaConfig, topic: str) -> bool:
    try:
        meta = AdminClient(_admin_conf(kafka)).list_topics(topic, timeout=KAFKA_TIMEOUT_S)
    except KafkaException as exc:
        raise KafkaUnavailableError(f"cannot reach Kafka: {exc}") from exc
    found = meta.topics.get(topic)
    return found is not None and found.error is None and bool(found.partitions)


def commit_merge_mark(
    kafka: KafkaConfig, group: GroupConfig, marks: dict[int, int], counts: dict[int, int]
) -> None:
    """Move the merge mark to ``marks`` (never backwards), noting when and how many merged."""
    topic = group.dlq_topic
    now = int(time.time() * 1000)
    consumer = Consumer(_client_conf(kafka, merge_mark_group(group)))
    try:
        wanted = [TopicPartition(topic, p) for p in marks]
        current = {
            tp.partition: tp.offset
            for tp in _with_coordinator(lambda: consumer.committed(wanted, timeout=KAFKA_TIMEOUT_S))
        }
        offsets = [
            TopicPartition(
                topic,
                p,
                max(offset, current.get(p, -1)),
                metadata=json.dumps({"merged_at": now, "records": counts.get(p, 0)}),
            )
            for p, offset in sorted(marks.items())
        ]
        # A group that is never joined takes plain commits: the mark costs no membership.
        _with_coordinator(lambda: consumer.commit(offsets=offsets, asynchronous=False))
    except KafkaException as exc:
        raise KafkaUnavailableError(
            f"the records were written but the merge mark could not be committed: {exc}; "
            "the next merge would send them again"
        ) from exc
    finally:
        consumer.close()


# --- inspect ---------------------------------------------------------------------------------


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
    conf = _client_conf(kafka, f"consumer-proxy-inspect-{int(time.time())}")
    conf.update({"enable.partition.eof": True, "auto.offset.reset": "earliest"})
    return Consumer(conf)


def inspect_dlq(kafka: KafkaConfig, group: GroupConfig, limit: int) -> dict[str, Any]:
    """Counts, time range, marks and a sample of the group's DLQ (assign, never subscribe)."""
    topic = group.dlq_topic
    state = dlq_partitions(kafka, group)
    consumer = _plain_consumer(kafka)
    partitions: list[dict[str, Any]] = []
    sample: list[dict[str, Any]] = []
    try:
        for part in state:
            p, low, high = part.partition, part.low, part.high
            pending_from = max(low, part.merged) if part.merged is not None else low
            entry: dict[str, Any] = {
                "partition": p,
                "low": low,
                "high": high,
                "count": max(0, high - low),
                "oldest_ms": None,
                "newest_ms": None,
                # Everything before `low` was purged; before `merged` a merge went over it.
                "purged_to": low,
                "merged_to": part.merged,
                "not_merged": max(0, high - pending_from),
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
        "merge_mark_group": merge_mark_group(group),
        "total": sum(p["count"] for p in partitions),
        "not_merged": sum(p["not_merged"] for p in partitions),
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
    lines = [
        f"DLQ {report['topic']} of group {report['group']}: {report['total']} records, "
        f"{report['not_merged']} not merged yet"
    ]
    for p in report["partitions"]:
        merged = "none" if p["merged_to"] is None else p["merged_to"]
        lines.append(
            f"  partition {p['partition']}: {p['count']} records (offsets {p['low']}..{p['high']})"
            f" purged to {p['purged_to']}, merged to {merged};"
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


# --- report and merge (Spark) ----------------------------------------------------------------


def _spark_settings(args: argparse.Namespace) -> pipeline.SparkOptions:
    pairs = []
    for item in args.spark_conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--spark-conf {item!r}: expected KEY=VALUE"])
        pairs.append((key.strip(), value))
    return pipeline.SparkOptions(
        master=args.master,
        conf=tuple(pairs),
        connector_version=args.connector_version,
        # At debug level the JVM's own console output (Ivy, log4j) stays on the terminal.
        quiet=args.log_level != "debug",
    )


def _report(args: argparse.Namespace, kafka: KafkaConfig, group: GroupConfig) -> int:
    if args.top < 1:
        raise ConfigError([f"--top must be at least 1, got {args.top}"])
    pipeline.require_pipeline("report", chart=True)
    options = _spark_settings(args)
    state = dlq_partitions(kafka, group)  # the bound: end offsets now
    ranges = {p.partition: (p.low, p.high) for p in state}
    _progress(
        f"dlq report: group {group.name}, {group.dlq_topic}: {len(ranges)} partitions, "
        f"{sum(h - lo for lo, h in ranges.values())} records up to the end offsets at start"
    )
    with pipeline.spark_session(options, _progress) as spark:
        report = pipeline.build_report(
            spark,
            pipeline.java_kafka_options(kafka),
            group.dlq_topic,
            ranges,
            _progress,
            top=args.top,
        )
    report["group"] = group.name
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{group.name}-dlq-report.json"
    png_path = args.out / f"{group.name}-dlq-report.png"
    report["files"] = {"json": str(json_path), "png": str(png_path)}
    pipeline.write_chart(report, png_path)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.json else pipeline.render_report(report))
    return EXIT_OK


def _merge(args: argparse.Namespace, kafka: KafkaConfig, group: GroupConfig) -> int:
    if args.since is not None and args.until is not None and args.since > args.until:
        raise ConfigError(
            [
                f"--since {pipeline.format_ms(args.since)} is after --until "
                f"{pipeline.format_ms(args.until)}"
            ]
        )
    statuses = tuple(s.strip() for item in args.status for s in item.split(",") if s.strip())
    if args.where is not None and not args.where.strip():
        raise ConfigError(["--where is empty"])
    selection = pipeline.Selection(args.since, args.until, statuses, args.where)
    _require_confirmation_possible(args, "merge")
    pipeline.require_pipeline("merge")
    options = _spark_settings(args)
    state = dlq_partitions(kafka, group)
    if not _topic_exists(kafka, group.redrive_topic):
        raise _missing_topic(group, group.redrive_topic, "redrive")

    ranges: dict[int, tuple[int, int]] = {}
    for part in state:
        start = part.low if args.from_start or part.merged is None else max(part.low, part.merged)
        if start > part.high:
            _progress(
                f"warning: partition {part.partition}: merge mark {part.merged} is past the end "
                f"{part.high} (was the topic recreated?); nothing to merge there, --from-start "
                "reads it again"
            )
            start = part.high
        ranges[part.partition] = (start, part.high)
    in_range = sum(end - start for start, end in ranges.values())
    _progress(
        f"dlq merge: group {group.name}, {group.dlq_topic} -> {group.redrive_topic}: "
        f"{in_range} records from the {'oldest record' if args.from_start else 'merge mark'} "
        f"to the end offsets at start"
        + "".join(f"\n  partition {p}: offsets {s}..{e}" for p, (s, e) in ranges.items())
    )
    if in_range:

        def confirm(found: pipeline.MergeOutcome) -> bool:
            if args.yes:
                return True
            _progress(_describe_selection(found))
            return _confirm(f"write {found.selected} records to {group.redrive_topic}?")

        with pipeline.spark_session(options, _progress) as spark:
            outcome = pipeline.merge(
                spark, pipeline.java_kafka_options(kafka), group.dlq_topic, group.redrive_topic,
                ranges, selection, _progress, dry_run=args.dry_run, confirm=confirm,
            )  # fmt: skip
    else:
        outcome = pipeline.MergeOutcome(in_range=0, selected=0)
    aborted = not args.dry_run and outcome.selected > 0 and not outcome.written
    marks = {p: end for p, (_start, end) in ranges.items()}
    if not args.dry_run and not aborted and in_range:
        commit_merge_mark(kafka, group, marks, outcome.by_partition)
    summary = {
        "group": group.name,
        "dlq_topic": group.dlq_topic,
        "redrive_topic": group.redrive_topic,
        "dry_run": args.dry_run,
        "aborted": aborted,
        "ranges": {str(p): list(r) for p, r in ranges.items()},
        "in_range": outcome.in_range,
        "selected": outcome.selected,
        "merged": outcome.selected if outcome.written else 0,
        "by_partition": {str(p): n for p, n in sorted(outcome.by_partition.items())},
        "by_status": dict(sorted(outcome.by_status.items())),
        "merge_mark": None if args.dry_run or aborted else {str(p): m for p, m in marks.items()},
        "write_seconds": round(outcome.write_seconds, 3),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    elif args.dry_run:
        print(
            f"dry run: would merge {outcome.selected} of {in_range} records into "
            f"{group.redrive_topic}; nothing written"
        )
        if outcome.selected:
            print(_describe_selection(outcome))
    elif aborted:
        print("aborted: nothing written, the merge mark did not move")
    else:
        rate = (
            f" in {outcome.write_seconds:.1f}s" if outcome.written and outcome.write_seconds else ""
        )
        print(
            f"merged {summary['merged']} of {in_range} records into {group.redrive_topic}{rate}; "
            f"merge mark now at " + ", ".join(f"{p}:{m}" for p, m in marks.items())
        )
    return EXIT_FAILURE if aborted else EXIT_OK


def _describe_selection(outcome: pipeline.MergeOutcome) -> str:
    parts = ", ".join(f"{p}: {n}" for p, n in sorted(outcome.by_partition.items()))
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(outcome.by_status.items()))
    return f"  by DLQ partition: {parts}\n  by status: {statuses}"


# --- purge -----------------------------------------------------------------------------------


def plan_purge(
    kafka: KafkaConfig,
    group: GroupConfig,
    *,
    until_ms: int | None = None,
    merged: bool = False,
) -> list[dict[str, Any]]:
    """Per partition: the bound to delete before, and how many offsets that removes.

    Bounds never go below the current start (nothing is un-deleted) nor past the end.
    ``until_ms``: the first offset whose timestamp is at or after it (the end if none);
    ``merged``: the merge mark (nothing where there is none); neither: the end (``--all``).
    """
    topic = group.dlq_topic
    state = dlq_partitions(kafka, group)
    bounds: dict[int, int] = {}
    if until_ms is not None:
        consumer = Consumer(_client_conf(kafka, f"consumer-proxy-purge-{int(time.time())}"))
        try:
            found = consumer.offsets_for_times(
                [TopicPartition(topic, p.partition, until_ms) for p in state],
                timeout=KAFKA_TIMEOUT_S,
            )
        except KafkaException as exc:
            raise KafkaUnavailableError(
                f"cannot look up offsets by time in {topic}: {exc}"
            ) from exc
        finally:
            consumer.close()
        by_part = {p.partition: p for p in state}
        for tp in found:
            bounds[tp.partition] = tp.offset if tp.offset >= 0 else by_part[tp.partition].high
    for part in state:
        if until_ms is not None:
            bound = bounds[part.partition]
        elif merged:
            bound = part.merged if part.merged is not None else part.low
        else:
            bound = part.high
        bound = min(max(bound, part.low), part.high)
        bounds[part.partition] = bound
    return [
        {
            "partition": p.partition,
            "low": p.low,
            "high": p.high,
            "merged_to": p.merged,
            "delete_before": bounds[p.partition],
            "count": bounds[p.partition] - p.low,
        }
        for p in state
    ]


def delete_before(kafka: KafkaConfig, topic: str, bounds: dict[int, int]) -> dict[int, int]:
    """Delete records before ``bounds`` (admin API); returns each partition's new start."""
    admin = AdminClient(_admin_conf(kafka))
    futures = admin.delete_records(
        [TopicPartition(topic, p, b) for p, b in sorted(bounds.items())],
        request_timeout=KAFKA_TIMEOUT_S,
        operation_timeout=KAFKA_TIMEOUT_S,
    )
    result: dict[int, int] = {}
    errors = []
    for tp, future in futures.items():
        try:
            result[tp.partition] = future.result().low_watermark
        except KafkaException as exc:
            errors.append(f"partition {tp.partition}: {exc}")
    if errors:
        raise KafkaUnavailableError(f"deleting records from {topic} failed: " + "; ".join(errors))
    return result


def _purge(args: argparse.Namespace, kafka: KafkaConfig, group: GroupConfig) -> int:
    _require_confirmation_possible(args, "delete records")
    plan = plan_purge(kafka, group, until_ms=args.until, merged=args.merged)
    bound_name = (
        f"before {datetime.fromtimestamp(args.until / 1000, tz=UTC).isoformat()}"
        if args.until is not None
        else "up to the merge mark"
        if args.merged
        else "all"
    )
    total = sum(p["count"] for p in plan)
    lines = [f"dlq purge: {group.dlq_topic} of group {group.name}, {bound_name}: {total} records"]
    for p in plan:
        lines.append(
            f"  partition {p['partition']}: offsets {p['low']}..{p['delete_before']} "
            f"({p['count']} records; partition end {p['high']}, merged to "
            f"{'none' if p['merged_to'] is None else p['merged_to']})"
        )
    summary: dict[str, Any] = {
        "group": group.name,
        "topic": group.dlq_topic,
        "bound": bound_name,
        "dry_run": args.dry_run,
        "partitions": plan,
        "to_delete": total,
        "deleted": 0,
    }

    def done(code: int, message: str) -> int:
        summary["result"] = message
        print(json.dumps(summary, indent=2) if args.json else "\n".join([*lines, message]))
        return code

    def show_plan_first() -> None:
        # On a terminal the plan comes before the question, and not again after it.
        if not args.json:
            print("\n".join(lines))
            lines.clear()

    if args.merged and all(p["merged_to"] is None for p in plan):
        return done(EXIT_OK, "nothing merged yet: nothing to delete")
    if total == 0:
        return done(EXIT_OK, "nothing to delete")
    if args.dry_run:
        return done(EXIT_OK, f"dry run: would delete {total} records; nothing deleted")
    if not args.yes:
        show_plan_first()
        if not _confirm(f"delete {total} records from {group.dlq_topic}? This cannot be undone."):
            return done(EXIT_FAILURE, "aborted: nothing deleted")
    bounds = {p["partition"]: p["delete_before"] for p in plan if p["count"] > 0}
    new_low = delete_before(kafka, group.dlq_topic, bounds)
    summary["deleted"] = total
    summary["new_low"] = {str(p): o for p, o in sorted(new_low.items())}
    return done(
        EXIT_OK,
        f"deleted {total} records; partitions now start at "
        + ", ".join(f"{p}:{o}" for p, o in sorted(new_low.items())),
    )
