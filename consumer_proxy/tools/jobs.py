"""The Spark jobs of the DLQ tools: the DLQ as a DataFrame, the report, and merge's passes.

A job reads a *bounded* offset range of the DLQ with Spark's Kafka source (``startingOffsets``
and ``endingOffsets`` pinned per partition by the caller), so a DLQ that keeps growing while
the job runs cannot make it chase the end. The records are exposed with friendly columns (see
``DLQ_COLUMNS``) on which ``--status``, ``--since``/``--until`` and ``--where`` run as Spark
expressions.

A merge runs two passes over the same pinned range. The *selection pass* counts what the
filters select and finds its islands: stretches of selected records with no record between
them that stays unmerged; the caller turns them into the per-record merge mark. The *write
pass* writes the selected records, unchanged, through Spark's own Kafka sink (acks=all,
idempotent, in parallel over the executors), or, with a rate cap, from one task paced by
``pacing.Pacer`` with confluent-kafka, so one cap holds over the whole write. A finished write
means every send was acknowledged; the caller commits the mark only after that.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.records import (
    H_ATTEMPT,
    H_DEAD_LETTERED_AT,
    H_ENDPOINT,
    H_GROUP,
    H_OFFSET,
    H_PARTITION,
    H_REASON,
    H_STATUS,
    H_TIMESTAMP,
    H_TOPIC,
)
from ..errors import ConfigError
from .mark import MergeMark
from .pacing import Pacer
from .render import REASON_MASKS, format_hour, format_ms, show_value
from .reports import (
    DlqReport,
    HourCount,
    Island,
    KeyCount,
    OriginCount,
    PartitionCount,
    ReasonCount,
    ReasonTemplate,
    Selected,
    StatusCount,
)
from .spark import PipelineError, Progress, spark_message

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

# Per task when a DLQ partition is big: smaller tasks spread over the cores and show progress.
RECORDS_PER_TASK = 250_000
PROGRESS_EVERY_S = 2.0
MAX_RECORD_BYTES = 64 * 1024 * 1024
"""The largest record a merge writes, as the proxy's DLQ producer (``dlq.producer_config``):
the redrive topic's own ``max.message.bytes`` decides, not the clients' 1 MB defaults."""

Ranges = dict[int, tuple[int, int]]
"""DLQ partition -> [start, end) offsets to read."""

DLQ_COLUMNS: dict[str, str] = {
    "partition": "INT: the DLQ record's partition",
    "offset": "BIGINT: the DLQ record's offset",
    "timestamp": "TIMESTAMP: the DLQ record's timestamp (--since/--until use it)",
    "key": "STRING: the key as UTF-8 text",
    "value": "STRING: the value as UTF-8 text",
    "key_bytes": "BINARY: the key",
    "value_bytes": "BINARY: the value",
    "headers": "ARRAY<STRUCT<key: STRING, value: BINARY>>: all headers, cp-* included",
    "status": f"STRING: {H_STATUS} (gRPC code name or action)",
    "reason": f"STRING: {H_REASON}",
    "endpoint": f"STRING: {H_ENDPOINT}",
    "dlq_group": f"STRING: {H_GROUP}",
    "original_topic": f"STRING: {H_TOPIC}",
    "original_partition": f"INT: {H_PARTITION}",
    "original_offset": f"BIGINT: {H_OFFSET}",
    "original_timestamp": f"TIMESTAMP: {H_TIMESTAMP}",
    "attempt": f"INT: {H_ATTEMPT} (attempts made before it was dead-lettered)",
    "dead_lettered_at": f"TIMESTAMP: {H_DEAD_LETTERED_AT}, else the record's timestamp",
}
"""The columns ``--where`` may use (view ``dlq``), with their types and meaning."""


@dataclass(frozen=True)
class Selection:
    """Which DLQ records a merge takes: every given condition must hold."""

    # On the DLQ record's timestamp (when the proxy wrote it), the time purge --until uses.
    since_ms: int | None = None  # timestamp >= since
    until_ms: int | None = None  # timestamp < until
    statuses: tuple[str, ...] = ()
    where: str | None = None  # a Spark SQL boolean expression over DLQ_COLUMNS

    @property
    def everything(self) -> bool:
        """Whether the selection takes every record (no condition given)."""
        return self.describe() == "every record"

    def describe(self) -> str:
        """One line for progress output."""
        parts = []
        if self.since_ms is not None:
            parts.append(f"since {format_ms(self.since_ms)}")
        if self.until_ms is not None:
            parts.append(f"until {format_ms(self.until_ms)}")
        if self.statuses:
            parts.append("status in " + ",".join(self.statuses))
        if self.where:
            parts.append(f"where {self.where}")
        return "; ".join(parts) or "every record"


def _header(name: str) -> str:
    # The last occurrence wins: the proxy appends its cp-* headers after the user's.
    return f"CAST(try_element_at(filter(headers, h -> h.key = '{name}'), -1).value AS STRING)"


def dlq_frame(
    spark: SparkSession, kafka_options: dict[str, str], topic: str, ranges: Ranges
) -> DataFrame:
    """The DLQ records in ``ranges`` with the columns of ``DLQ_COLUMNS`` (also view ``dlq``)."""
    from pyspark.sql import functions as F

    parts = sorted(ranges)
    total = sum(max(0, end - start) for start, end in ranges.values())
    reader = (
        spark.read.format("kafka")
        .options(**kafka_options)
        .option("assign", json.dumps({topic: parts}))
        .option("startingOffsets", json.dumps({topic: {str(p): ranges[p][0] for p in parts}}))
        .option("endingOffsets", json.dumps({topic: {str(p): ranges[p][1] for p in parts}}))
        .option("includeHeaders", "true")
        # Records purged between planning and reading are gone either way; skip, do not fail.
        .option("failOnDataLoss", "false")
        .option("groupIdPrefix", "consumer-proxy-dlq")
    )
    if parts and total // len(parts) > RECORDS_PER_TASK:
        reader = reader.option("minPartitions", str(math.ceil(total / RECORDS_PER_TASK)))
    raw = reader.load()
    frame = raw.select(
        F.col("partition"),
        F.col("offset"),
        F.col("timestamp"),
        F.col("key").cast("string").alias("key"),
        F.col("value").cast("string").alias("value"),
        F.col("key").alias("key_bytes"),
        F.col("value").alias("value_bytes"),
        F.col("headers"),
        F.expr(_header(H_STATUS)).alias("status"),
        F.expr(_header(H_REASON)).alias("reason"),
        F.expr(_header(H_ENDPOINT)).alias("endpoint"),
        F.expr(_header(H_GROUP)).alias("dlq_group"),
        F.expr(_header(H_TOPIC)).alias("original_topic"),
        F.expr(f"try_cast({_header(H_PARTITION)} AS INT)").alias("original_partition"),
        F.expr(f"try_cast({_header(H_OFFSET)} AS BIGINT)").alias("original_offset"),
        F.expr(f"timestamp_millis(try_cast({_header(H_TIMESTAMP)} AS BIGINT))").alias(
            "original_timestamp"
        ),
        F.expr(f"try_cast({_header(H_ATTEMPT)} AS INT)").alias("attempt"),
        F.expr(
            f"coalesce(timestamp_millis(try_cast({_header(H_DEAD_LETTERED_AT)} AS BIGINT)), "
            "timestamp)"
        ).alias("dead_lettered_at"),
    )
    frame.createOrReplaceTempView("dlq")
    return frame


def selection_condition(frame: DataFrame, selection: Selection) -> Column:
    """The selection as one boolean column (NULL counts as not selected).

    ConfigError naming the problem for a bad ``--where``: Spark parses and analyses the
    expression right here (no data is read), so a bad one is caught before anything runs.
    """
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    condition = F.lit(True)
    if selection.since_ms is not None:
        condition &= F.col("timestamp") >= F.timestamp_millis(F.lit(selection.since_ms))
    if selection.until_ms is not None:
        condition &= F.col("timestamp") < F.timestamp_millis(F.lit(selection.until_ms))
    if selection.statuses:
        condition &= F.col("status").isin(list(selection.statuses))
    if selection.where:
        try:
            where = F.expr(selection.where)
            _ = frame.where(where).schema  # analysis is eager in classic Spark; make sure of it
        except PySparkException as exc:
            raise ConfigError(
                [
                    f"bad --where {selection.where!r}: {spark_message(exc)}",
                    "columns: " + ", ".join(DLQ_COLUMNS),
                ]
            ) from exc
        condition &= where
    return F.coalesce(condition, F.lit(False))


def check_selection(
    spark: SparkSession, kafka_options: dict[str, str], topic: str, selection: Selection
) -> None:
    """Validate ``selection`` against the DLQ's columns without reading a record."""
    selection_condition(dlq_frame(spark, kafka_options, topic, {0: (0, 0)}), selection)


# --- progress --------------------------------------------------------------------------------


@contextlib.contextmanager
def every(seconds: float, report: Callable[[], None]) -> Iterator[None]:
    """Call ``report`` every ``seconds`` (from a thread) while the body runs."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(seconds):
            with contextlib.suppress(Exception):  # progress is best effort; never fail the job
                report()

    watcher = threading.Thread(target=watch, name="dlq-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


@contextlib.contextmanager
def stage_progress(spark: SparkSession, label: str, progress: Progress) -> Iterator[None]:
    """Print ``label: done/total tasks`` while a Spark action runs (on change, every 2 s)."""
    tracker = spark.sparkContext.statusTracker()
    last = [""]

    def report() -> None:
        done = total = 0
        for stage_id in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        line = f"  {label}: {done}/{total} tasks done" if total else ""
        if line and line != last[0]:
            progress(line)
            last[0] = line

    with every(PROGRESS_EVERY_S, report):
        yield


# --- report ----------------------------------------------------------------------------------


def reason_template_column(column: Column) -> Column:
    """``render.reason_template`` as a Spark expression (same masks, same order)."""
    from pyspark.sql import functions as F

    for pattern, replacement in REASON_MASKS:
        column = F.regexp_replace(column, pattern, replacement)
    return column


def build_report(
    spark: SparkSession,
    kafka_options: dict[str, str],
    topic: str,
    ranges: Ranges,
    progress: Progress,
    top: int = 10,
) -> DlqReport:
    """Counts by status, reason kind, original partition, hour and key over the DLQ range."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    frame = dlq_frame(spark, kafka_options, topic, ranges).select(
        "partition",
        "status",
        "reason",
        reason_template_column(F.col("reason")).alias("reason_template"),
        "original_topic",
        "original_partition",
        "key_bytes",
        F.unix_millis(F.date_trunc("hour", "timestamp")).alias("hour_ms"),
    )
    # One read of Kafka; every aggregate below runs over the cached projection.
    frame.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        with stage_progress(spark, "reading the DLQ", progress):
            by_dlq_partition = {
                int(r["partition"]): int(r["count"])
                for r in frame.groupBy("partition").count().collect()
            }
        total = sum(by_dlq_partition.values())
        progress(f"read {total} records; aggregating")

        def counted(*cols: str) -> list[Any]:
            return frame.groupBy(*cols).count().orderBy(F.desc("count"), *cols).collect()

        by_status = [StatusCount(r["status"], r["count"]) for r in counted("status")]
        reasons = counted("reason")
        templates = (
            frame.groupBy("reason_template")
            .agg(
                F.count("*").alias("count"),
                F.countDistinct("reason").alias("distinct"),
                F.min("reason").alias("example"),
            )
            .orderBy(F.desc("count"), "reason_template")
            .collect()
        )
        by_origin = [
            OriginCount(r["original_topic"], r["original_partition"], r["count"])
            for r in frame.groupBy("original_topic", "original_partition")
            .count()
            .orderBy("original_topic", "original_partition")
            .collect()
        ]
        by_hour = [
            HourCount(
                format_hour(r["hour_ms"]) if r["hour_ms"] is not None else None,
                r["hour_ms"],
                r["count"],
            )
            for r in frame.groupBy("hour_ms").count().orderBy("hour_ms").collect()
        ]
        keys = (
            frame.groupBy("key_bytes")
            .count()
            .orderBy(F.desc("count"), "key_bytes")
            .limit(top)
            .collect()
        )
    finally:
        frame.unpersist()
    return DlqReport(
        topic=topic,
        generated_at=format_ms(int(time.time() * 1000)),
        offsets={str(p): list(r) for p, r in sorted(ranges.items())},
        total=total,
        by_dlq_partition=[PartitionCount(p, n) for p, n in sorted(by_dlq_partition.items())],
        by_status=by_status,
        by_reason_template=[
            ReasonTemplate(r["reason_template"], r["count"], r["distinct"], r["example"])
            for r in templates[:50]
        ],
        by_reason=[ReasonCount(r["reason"], r["count"]) for r in reasons[:20]],
        reasons_distinct=len(reasons),
        by_original_partition=by_origin,
        by_hour=by_hour,
        top_keys=[
            KeyCount(
                show_value(bytes(r["key_bytes"]) if r["key_bytes"] is not None else None),
                r["count"],
            )
            for r in keys
        ],
    )


# --- merge -----------------------------------------------------------------------------------


def _flagged(
    spark: SparkSession,
    kafka_options: dict[str, str],
    topic: str,
    ranges: Ranges,
    selection: Selection,
    merged: dict[int, MergeMark],
    islands: Sequence[tuple[int, int, int]] | None = None,
) -> DataFrame:
    """The DLQ range with ``chosen`` (the filters hold) and ``already`` (a merge sent it back).

    ``islands`` (partition, start, end): the selection pass's islands, which then say what is
    chosen instead of the filters (see ``write_selected``). The merged intervals and the
    islands are few (the mark's metadata budget bounds them), so they are broadcast and joined
    on the DLQ partition with the offset range as the join condition.
    """
    from pyspark.sql import functions as F

    frame = dlq_frame(spark, kafka_options, topic, ranges)
    if islands is None:
        frame = frame.withColumn("chosen", selection_condition(frame, selection))
    else:
        frame = _in_intervals(spark, frame, islands, "inner", "chosen")
    intervals = _merged_in(ranges, merged)
    if not intervals:
        return frame.withColumn("already", F.lit(False))
    return _in_intervals(spark, frame, intervals, "left", "already")


def _in_intervals(
    spark: SparkSession,
    frame: DataFrame,
    intervals: Sequence[tuple[int, int, int]],
    how: str,
    flag: str,
) -> DataFrame:
    """``frame`` joined (``how``) with the (partition, start, end) ``intervals``, broadcast;
    ``flag`` says whether a record's offset lies in one of them."""
    from pyspark.sql import functions as F

    found = spark.createDataFrame(list(intervals), "j_partition INT, j_start BIGINT, j_end BIGINT")
    joined = frame.join(
        F.broadcast(found),
        (F.col("partition") == F.col("j_partition"))
        & (F.col("offset") >= F.col("j_start"))
        & (F.col("offset") < F.col("j_end")),
        how,
    )
    return joined.withColumn(flag, F.col("j_partition").isNotNull()).drop(
        "j_partition", "j_start", "j_end"
    )


def _merged_in(ranges: Ranges, merged: dict[int, MergeMark]) -> list[tuple[int, int, int]]:
    """(partition, start, end) of the merged intervals that overlap ``ranges``."""
    return [
        (p, start, end)
        for p, mark in sorted(merged.items())
        if p in ranges
        for start, end in mark.merged_intervals()
        if end > ranges[p][0] and start < ranges[p][1]
    ]


def select_for_merge(
    spark: SparkSession,
    kafka_options: dict[str, str],
    topic: str,
    ranges: Ranges,
    selection: Selection,
    merged: dict[int, MergeMark],
    progress: Progress,
) -> Selected:
    """The selection pass: what the filters select, already merged or not, as islands.

    ``merged``: the marks whose merged records are skipped (empty to send them again).
    """
    from pyspark.errors import PySparkException
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    in_range = sum(max(0, end - start) for start, end in ranges.values())
    flagged = _flagged(spark, kafka_options, topic, ranges, selection, merged).select(
        "partition", "offset", "status", "chosen", "already"
    )
    if selection.everything and not _merged_in(ranges, merged):
        # Every record is selected and none merged: one island per partition, and no need to
        # sort the range by offset to find where islands break.
        gap = F.lit(0)
    else:
        # Records that stay unmerged after this merge split the selected ones into islands:
        # the running count of them before a record names its island.
        stays = (~F.col("chosen")) & (~F.col("already"))
        window = (
            Window.partitionBy("partition")
            .orderBy("offset")
            .rowsBetween(Window.unboundedPreceding, Window.currentRow)
        )
        gap = F.sum(F.when(stays, 1).otherwise(0)).over(window)
    islands = (
        flagged.withColumn("gap", gap)
        .where(F.col("chosen"))
        .groupBy(
            "partition",
            F.when(F.col("already"), F.lit(-1)).otherwise(F.col("gap")).alias("island"),
            "status",
            "already",
        )
        .agg(
            F.count("*").alias("n"),
            F.min("offset").alias("first"),
            F.max("offset").alias("last"),
        )
    )
    try:
        with stage_progress(spark, "selecting", progress):
            rows = islands.collect()
    except PySparkException as exc:
        raise PipelineError(
            f"reading or selecting from {topic} failed (nothing written): {spark_message(exc)}"
        ) from exc
    found = Selected(in_range=in_range)
    by_island: dict[tuple[int, int], list[Any]] = {}
    for row in rows:
        part, count = int(row["partition"]), int(row["n"])
        if row["already"]:
            found.already_merged[part] = found.already_merged.get(part, 0) + count
            continue
        by_island.setdefault((part, int(row["island"])), []).append(row)
    for (part, _gap), group in sorted(by_island.items()):
        statuses: dict[str, int] = {}
        for row in group:
            status = row["status"] or "(none)"
            statuses[status] = statuses.get(status, 0) + int(row["n"])
        found.islands.append(
            Island(
                partition=part,
                start=min(int(r["first"]) for r in group),
                end=max(int(r["last"]) for r in group) + 1,
                count=sum(statuses.values()),
                by_status=statuses,
            )
        )
    found.islands.sort(key=lambda i: (i.partition, i.start))
    return found


@dataclass(frozen=True)
class WriteTarget:
    """Where and how fast the write pass writes."""

    topic: str
    rate: float | None = None  # records/s over the whole write; None: as fast as it goes
    producer_conf: dict[str, Any] | None = None  # librdkafka settings for the paced writer


def write_selected(
    spark: SparkSession,
    kafka_options: dict[str, str],
    topic: str,
    ranges: Ranges,
    selection: Selection,
    merged: dict[int, MergeMark],
    target: WriteTarget,
    progress: Progress,
    written_so_far: Callable[[], int],
    expected: int,
    islands: Sequence[tuple[int, int, int]] | None = None,
) -> float:
    """The write pass: the selected, not yet merged records of ``ranges`` to the target.

    ``islands`` (partition, start, end): the islands of the selection pass that the merge
    mark will record; the records written are then exactly theirs, not merged before, and
    the filters are not read again. A filter may answer differently each time it is read
    (``rand()``, ``current_timestamp()``, the minutes the operator took to confirm): read
    twice, it would mark records merged that were never written (and ``purge --merged``
    would delete them). Without ``islands`` (``--to``: no mark is recorded) the filters
    choose again.

    Key, value and every header (the user's and the ``cp-*`` ones) are kept, so the proxy
    delivers them with the original coordinates and the attempt count carried on. Returns the
    seconds the write took once every record is acknowledged (acks=all); PipelineError when
    it failed.
    """
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException
    from pyspark.sql import functions as F

    flagged = _flagged(spark, kafka_options, topic, ranges, selection, merged, islands)
    records = flagged.where(F.col("chosen") & ~F.col("already")).select(
        F.col("key_bytes").alias("key"), F.col("value_bytes").alias("value"), "headers"
    )
    started = time.monotonic()

    def report() -> None:
        done = written_so_far()
        seconds = time.monotonic() - started
        progress(f"  written {done} of {expected} ({done / max(seconds, 1e-9):.0f}/s)")

    try:
        with every(PROGRESS_EVERY_S, report):
            if target.rate is None:
                (
                    records.write.format("kafka")
                    .options(**kafka_options)
                    .option("topic", target.topic)
                    # The proxy's DLQ writer's guarantees: acknowledged by all in-sync
                    # replicas, no duplicates from producer retries.
                    .option("kafka.acks", "all")
                    .option("kafka.enable.idempotence", "true")
                    .option("kafka.compression.type", "lz4")
                    .option("kafka.linger.ms", "20")
                    .option("kafka.batch.size", str(512 * 1024))
                    .option("kafka.max.request.size", str(MAX_RECORD_BYTES))
                    .option("kafka.buffer.memory", str(2 * MAX_RECORD_BYTES))
                    .save()
                )
            else:
                # One task writes, so one pacer caps the whole write: Spark tasks share no
                # state, and a per-task share of the rate would be wrong whenever fewer tasks
                # run at once than were planned.
                records.coalesce(1).foreachPartition(
                    functools.partial(
                        paced_write,
                        conf=dict(target.producer_conf or {}),
                        topic=target.topic,
                        rate=target.rate,
                    )
                )
    except (PySparkException, Py4JJavaError) as exc:
        raise PipelineError(
            f"writing to {target.topic} failed; some records may have been written and "
            f"will be written again by the next merge (the mark did not move): "
            f"{spark_message(exc)}"
        ) from exc
    return time.monotonic() - started


def paced_write(rows: Iterable[Any], *, conf: dict[str, Any], topic: str, rate: float) -> None:
    """Write ``rows`` (key, value, headers) to ``topic`` at most ``rate``/s; runs in a task.

    Raises (failing the task, and so the job) when any send is not acknowledged.
    """
    from confluent_kafka import KafkaError, Message, Producer

    producer = Producer(
        {
            **conf,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 5,
            "compression.type": "lz4",
            "message.max.bytes": MAX_RECORD_BYTES,
        }
    )
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failures.append(str(err))

    pacer = Pacer(rate, time.monotonic)
    for row in rows:
        wait = pacer.delay()
        if wait > 0:
            time.sleep(wait)
        headers: list[tuple[str, str | bytes | None]] = [
            (str(h["key"]), None if h["value"] is None else bytes(h["value"]))
            for h in row["headers"] or ()
        ]
        key = None if row["key"] is None else bytes(row["key"])
        value = None if row["value"] is None else bytes(row["value"])
        while True:
            try:
                producer.produce(topic, value, key, headers=headers, on_delivery=delivered)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(0.05)
        pacer.sent()
        producer.poll(0)
        if failures:
            break
    left = producer.flush(60)
    if failures or left:
        raise RuntimeError(
            f"writing to {topic}: {len(failures)} sends failed ({'; '.join(failures[:3])}), "
            f"{left} unconfirmed"
        )
