"""The Kafka side of the DLQ tools (confluent-kafka): partitions, merge mark, peek, purge.

Every client here logs through the ``consumer_proxy.tools.kafka_client`` logger, which is
silent unless ``--log-level debug``: an unreachable broker makes librdkafka log a line per
reconnect attempt (hundreds in a few seconds) while the operator needs the one line saying
which bootstrap servers could not be reached and what failed (``unreachable``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ..config import GroupConfig, KafkaConfig
from ..core.records import split_headers
from ..errors import ConfigError, KafkaUnavailableError
from .mark import MergeMark
from .render import show_value
from .reports import Header, InspectReport, PartitionInspect, PurgePartition, SampleRecord

KAFKA_TIMEOUT_S = 15.0
MERGE_MARK_SUFFIX = ".dlq-merge"
CLIENT_LOGGER = logging.getLogger("consumer_proxy.tools.kafka_client")
T = TypeVar("T")


def client_logs(debug: bool) -> None:
    """Show the Kafka clients' own log lines only at debug level."""
    CLIENT_LOGGER.setLevel(logging.DEBUG if debug else logging.CRITICAL + 10)


def merge_mark_group(group: GroupConfig) -> str:
    """The consumer group whose committed offsets on the DLQ are the merge mark."""
    return f"{group.name}{MERGE_MARK_SUFFIX}"


def plain_conf(kafka: KafkaConfig) -> dict[str, Any]:
    """librdkafka settings from the config (picklable: no callbacks), for producers too."""
    conf: dict[str, Any] = dict(kafka.client)
    conf["bootstrap.servers"] = kafka.bootstrap_servers
    for consumer_only in ("isolation.level", "auto.offset.reset", "session.timeout.ms"):
        conf.pop(consumer_only, None)
    return conf


def _client_conf(kafka: KafkaConfig, group_id: str | None = None) -> dict[str, Any]:
    conf: dict[str, Any] = dict(kafka.client)
    conf["bootstrap.servers"] = kafka.bootstrap_servers
    conf["logger"] = CLIENT_LOGGER
    if group_id is not None:
        conf.update({"group.id": group_id, "enable.auto.commit": False})
    return conf


def _admin_conf(kafka: KafkaConfig) -> dict[str, Any]:
    # No logger: an admin client serves no log queue, so librdkafka would print a "purging
    # unserved events" line at exit. Admin calls come after a consumer reached the broker.
    return plain_conf(kafka)


def unreachable(kafka: KafkaConfig, what: str, exc: KafkaException) -> KafkaUnavailableError:
    """One line: which bootstrap servers, what failed, and the client's reason."""
    error = exc.args[0] if exc.args else None
    reason = error.str() if isinstance(error, KafkaError) else str(exc)
    return KafkaUnavailableError(
        f"Kafka at {kafka.bootstrap_servers}: {what} failed: {reason.splitlines()[0]}"
    )


def _missing_topic(group: GroupConfig, topic: str, role: str) -> ConfigError:
    hints = {
        "DLQ": "nothing has been dead-lettered yet, or dlq.topic names another topic",
        "redrive": "start the proxy once (it creates it) or create it by hand",
    }
    hint = hints.get(role, "create it first")
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


# --- partitions and the merge mark -----------------------------------------------------------


@dataclass(frozen=True)
class DlqPartition:
    """One DLQ partition: [low, high) is what it holds; ``mark`` its merge mark, if any."""

    partition: int
    low: int
    high: int
    mark: MergeMark | None

    @property
    def merged_to(self) -> int | None:
        """The merged prefix (the committed offset), or None before the first merge."""
        return None if self.mark is None else self.mark.prefix

    def merged_above(self) -> int:
        """Records still held, at or after the merged prefix, that a merge sent back."""
        if self.mark is None:
            return 0
        return self.mark.merged_between(max(self.low, self.mark.prefix), self.high)

    def not_merged(self) -> int:
        """Records still held that no merge sent back."""
        if self.mark is None:
            return max(0, self.high - self.low)
        return max(0, self.high - self.low) - self.mark.merged_between(self.low, self.high)


def _read_marks(
    consumer: Consumer, topic: str, partitions: list[int]
) -> dict[int, MergeMark | None]:
    tps = [TopicPartition(topic, p) for p in partitions]
    committed = _with_coordinator(lambda: consumer.committed(tps, timeout=KAFKA_TIMEOUT_S))
    return {
        tp.partition: (
            MergeMark.from_commit(tp.offset, tp.metadata)
            if tp.offset is not None and tp.offset >= 0
            else None
        )
        for tp in committed
    }


def dlq_partitions(kafka: KafkaConfig, group: GroupConfig) -> list[DlqPartition]:
    """Watermarks and merge mark of every DLQ partition; ConfigError if the topic is missing.

    Read-only: the merge-mark group is only asked for its committed offsets, never joined.
    """
    topic = group.dlq_topic
    consumer = Consumer(_client_conf(kafka, merge_mark_group(group)))
    try:
        try:
            meta = consumer.list_topics(topic, timeout=KAFKA_TIMEOUT_S).topics.get(topic)
        except KafkaException as exc:
            raise unreachable(kafka, f"reading the metadata of {topic}", exc) from exc
        if meta is None or meta.error is not None or not meta.partitions:
            raise _missing_topic(group, topic, "DLQ")
        try:
            marks = _read_marks(consumer, topic, sorted(meta.partitions))
            result = []
            for p, mark in sorted(marks.items()):
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=KAFKA_TIMEOUT_S
                )
                result.append(DlqPartition(p, low, high, mark))
        except KafkaException as exc:
            raise unreachable(kafka, f"reading the offsets and merge mark of {topic}", exc) from exc
    finally:
        consumer.close()
    return result


def topic_exists(kafka: KafkaConfig, topic: str) -> bool:
    """Whether ``topic`` exists with at least one partition."""
    try:
        meta = AdminClient(_admin_conf(kafka)).list_topics(topic, timeout=KAFKA_TIMEOUT_S)
    except KafkaException as exc:
        raise unreachable(kafka, f"reading the metadata of {topic}", exc) from exc
    found = meta.topics.get(topic)
    return found is not None and found.error is None and bool(found.partitions)


def require_topic(kafka: KafkaConfig, group: GroupConfig, topic: str, role: str) -> None:
    """ConfigError (exit 2) when ``topic`` does not exist."""
    if not topic_exists(kafka, topic):
        raise _missing_topic(group, topic, role)


def end_total(kafka: KafkaConfig, topic: str) -> int:
    """The sum of ``topic``'s end offsets (how many records were ever written to it)."""
    consumer = Consumer(_client_conf(kafka, "consumer-proxy-progress"))
    try:
        meta = consumer.list_topics(topic, timeout=KAFKA_TIMEOUT_S).topics[topic]
        return sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=KAFKA_TIMEOUT_S)[1]
            for p in meta.partitions
        )
    except KafkaException as exc:
        raise unreachable(kafka, f"reading the end offsets of {topic}", exc) from exc
    finally:
        consumer.close()


def commit_merge_mark(kafka: KafkaConfig, group: GroupConfig, marks: dict[int, MergeMark]) -> None:
    """Add ``marks`` to the committed merge mark (a union: it never loses a merged record)."""
    topic = group.dlq_topic
    consumer = Consumer(_client_conf(kafka, merge_mark_group(group)))
    try:
        current = _read_marks(consumer, topic, sorted(marks))
        offsets = []
        for p, mark in sorted(marks.items()):
            before = current.get(p)
            # A merge that ran meanwhile keeps what it merged: union, never a rollback.
            union = mark if before is None else before.with_merged(mark.merged_intervals())
            offsets.append(TopicPartition(topic, p, union.prefix, metadata=union.metadata()))
        # A group that is never joined takes plain commits: the mark costs no membership.
        _with_coordinator(lambda: consumer.commit(offsets=offsets, asynchronous=False))
    except KafkaException as exc:
        raise KafkaUnavailableError(
            f"the records were written but the merge mark could not be committed to Kafka at "
            f"{kafka.bootstrap_servers}: {exc}; the next merge would send them again"
        ) from exc
    finally:
        consumer.close()


# --- inspect ---------------------------------------------------------------------------------


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


def plain_consumer(kafka: KafkaConfig) -> Consumer:
    conf = _client_conf(kafka, f"consumer-proxy-inspect-{int(time.time())}")
    conf.update({"enable.partition.eof": True, "auto.offset.reset": "earliest"})
    return Consumer(conf)


def inspect_dlq(kafka: KafkaConfig, group: GroupConfig, limit: int) -> InspectReport:
    """Counts, time range, marks and a sample of the group's DLQ (assign, never subscribe)."""
    topic = group.dlq_topic
    state = dlq_partitions(kafka, group)
    consumer = plain_consumer(kafka)
    partitions: list[PartitionInspect] = []
    sample: list[SampleRecord] = []
    try:
        for part in state:
            p, low, high = part.partition, part.low, part.high
            oldest = newest = None
            if high > low:
                oldest = _timestamp_at(consumer, topic, p, low)
                newest = _timestamp_at(consumer, topic, p, high - 1)
                if len(sample) < limit:
                    sample += read_range(
                        consumer, topic, p, low, min(high, low + limit - len(sample))
                    )
            partitions.append(
                PartitionInspect(
                    partition=p,
                    low=low,
                    high=high,
                    count=max(0, high - low),
                    oldest_ms=oldest,
                    newest_ms=newest,
                    purged_to=low,
                    merged_to=part.merged_to,
                    merged_above=part.merged_above(),
                    not_merged=part.not_merged(),
                )
            )
    except KafkaException as exc:
        raise unreachable(kafka, f"reading {topic}", exc) from exc
    finally:
        consumer.close()
    return InspectReport(
        group=group.name,
        topic=topic,
        merge_mark_group=merge_mark_group(group),
        total=sum(p.count for p in partitions),
        not_merged=sum(p.not_merged for p in partitions),
        partitions=partitions,
        sample=sample,
    )


CONSUME_CHUNK = 10_000
"""The most records one ``consume`` is asked for (confluent-kafka refuses over 1,000,000)."""


def _timestamp_at(consumer: Consumer, topic: str, partition: int, offset: int) -> int | None:
    records = read_range(consumer, topic, partition, offset, offset + 1)
    return records[0].timestamp_ms if records else None


def read_range(
    consumer: Consumer, topic: str, partition: int, start: int, end: int, timeout_s: float = 10.0
) -> list[SampleRecord]:
    """The records of ``partition`` in [start, end) as ``SampleRecord``s, read with an
    assigned ``consumer`` (``plain_consumer``) for at most ``timeout_s``, or until the
    partition's end."""
    consumer.assign([TopicPartition(topic, partition, start)])
    records: list[SampleRecord] = []
    deadline = time.monotonic() + timeout_s
    at_end = False
    while len(records) < end - start and time.monotonic() < deadline and not at_end:
        for msg in consumer.consume(min(end - start - len(records), CONSUME_CHUNK), 1.0):
            error = msg.error()
            if error is not None:
                at_end = at_end or error.code() == KafkaError._PARTITION_EOF
                continue
            offset = msg.offset() or 0
            if offset >= end:
                break
            user, ours = split_headers(msg.headers())
            records.append(
                SampleRecord(
                    partition=partition,
                    offset=offset,
                    timestamp_ms=msg.timestamp()[1],
                    key=show_value(_as_bytes(msg.key())),
                    value=show_value(_as_bytes(msg.value())),
                    headers=[Header(k, show_value(v)) for k, v in user],
                    cp=ours,
                )
            )
    consumer.unassign()
    return records


# --- purge -----------------------------------------------------------------------------------


def plan_purge(
    kafka: KafkaConfig,
    group: GroupConfig,
    *,
    until_ms: int | None = None,
    merged: bool = False,
) -> list[PurgePartition]:
    """Per partition: the bound to delete before, and how many offsets that removes.

    Bounds never go below the current start (nothing is un-deleted) nor past the end.
    ``until_ms``: the first offset whose timestamp is at or after it (the end if none);
    ``merged``: the merged prefix, i.e. the first record no merge sent back (Kafka deletes
    prefixes only: merged records after it are kept, and counted); neither: the end.
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
            raise unreachable(kafka, f"looking up offsets by time in {topic}", exc) from exc
        finally:
            consumer.close()
        bounds = time_bounds(
            kafka,
            topic,
            [
                (tp.partition, tp.offset, None if tp.error is None else tp.error.str())
                for tp in found
            ],
            {p.partition: p.high for p in state},
        )
    plan = []
    for part in state:
        past_end = False
        if until_ms is not None:
            bound = bounds[part.partition]
        elif merged:
            # The first record still held that no merge sent back (records purged by time
            # may have taken the unmerged ones before it).
            bound = part.mark.state.next_pending(part.low) if part.mark is not None else part.low
            past_end = part.mark is not None and mark_past_end(part.mark, part.high)
            if past_end:
                bound = part.low  # the mark is not of this log: keep every record
        else:
            bound = part.high
        bound = min(max(bound, part.low), part.high)
        plan.append(
            PurgePartition(
                partition=part.partition,
                low=part.low,
                high=part.high,
                merged_to=part.merged_to,
                delete_before=bound,
                count=bound - part.low,
                merged_kept=(
                    part.mark.merged_between(bound, part.high)
                    if part.mark is not None and not past_end
                    else 0
                ),
                mark_past_end=past_end,
            )
        )
    return plan


def time_bounds(
    kafka: KafkaConfig,
    topic: str,
    found: Sequence[tuple[int, int, str | None]],
    high: dict[int, int],
) -> dict[int, int]:
    """Per partition, the first offset whose timestamp is at or after the time looked up, from
    ``found`` (partition, offset, error) of ``offsets_for_times``: the end when no record is
    (offset -1). A partition whose lookup failed (its leader moving, say) fails the purge,
    nothing deleted: its offset says nothing, and read as "no record that late" it would
    delete the whole partition."""
    failed = [f"partition {p}: {error}" for p, _offset, error in found if error is not None]
    if failed:
        raise KafkaUnavailableError(
            f"Kafka at {kafka.bootstrap_servers}: looking up offsets by time in {topic} failed "
            f"({'; '.join(failed)}); nothing deleted"
        )
    return {p: offset if offset >= 0 else high[p] for p, offset, _error in found}


def mark_past_end(mark: MergeMark, high: int) -> bool:
    """Whether a merge mark says records at or past the partition's end were merged: the log
    was cut below it (an unclean election) or the topic made anew, and offsets under the mark
    now hold records no merge sent back. ``merge`` reads such a partition from the mark on
    and warns; ``purge --merged`` deletes nothing there."""
    return any(end > high for _start, end in mark.merged_intervals())


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
        raise KafkaUnavailableError(
            f"Kafka at {kafka.bootstrap_servers}: deleting records from {topic} failed: "
            + "; ".join(errors)
        )
    return result
