"""Dead letters: the DLQ record format, the confirmed (acks=all, idempotent) writer, topic setup.

An offset whose message is dead-lettered becomes done only when the broker confirms the DLQ
write. A failed write is retried with backoff for as long as it takes; meanwhile the offset
stays pending, so the commit cannot pass it (a DLQ outage holds the partition, it never loses
the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from .config import GroupConfig, KafkaConfig
from .core.records import (
    CP_PREFIX,
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
    Headers,
    Origin,
    UserHeaders,
    dlq_headers,
    origin_from_headers,
    split_headers,
)
from .errors import DeadLetterWriteError, TopicSetupError

# The record format lives in the core; re-exported here for the writer's callers.
__all__ = [
    "CP_PREFIX",
    "H_ATTEMPT",
    "H_DEAD_LETTERED_AT",
    "H_ENDPOINT",
    "H_GROUP",
    "H_OFFSET",
    "H_PARTITION",
    "H_REASON",
    "H_STATUS",
    "H_TIMESTAMP",
    "H_TOPIC",
    "DeadLetterWriter",
    "Headers",
    "Origin",
    "UserHeaders",
    "dlq_headers",
    "ensure_topics",
    "origin_from_headers",
    "producer_config",
    "split_headers",
]

log = logging.getLogger(__name__)


def producer_config(kafka: KafkaConfig, write_timeout_ms: int) -> dict[str, Any]:
    """A safe producer: idempotent, acks=all; user passthrough may add security settings."""
    conf: dict[str, Any] = {"linger.ms": 5, "compression.type": "lz4"}
    conf.update(kafka.client)
    for consumer_only in ("isolation.level", "auto.offset.reset", "session.timeout.ms"):
        conf.pop(consumer_only, None)
    conf.update(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": write_timeout_ms,
            # A DLQ copy is as large as its source record plus the cp-* headers: let the
            # broker's topic limit decide, not librdkafka's 1 MB default.
            "message.max.bytes": 64 * 1024 * 1024,
        }
    )
    return conf


class DeadLetterWriter:
    """Writes DLQ records and resolves when the broker has confirmed each one."""

    def __init__(
        self,
        conf: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
    ) -> None:
        self._producer = Producer(conf, logger=log)
        self._loop = loop
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._stop = threading.Event()
        # librdkafka fires delivery reports from poll(); a thread of its own keeps polling.
        self._poller = threading.Thread(target=self._poll, name="dlq-poller", daemon=True)
        self._poller.start()
        self.failures = 0

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(0.1)

    async def _produce_once(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers
    ) -> None:
        future: asyncio.Future[None] = self._loop.create_future()

        def report(err: KafkaError | None, _msg: Any) -> None:
            def settle() -> None:
                if future.done():
                    return
                if err is None:
                    future.set_result(None)
                else:
                    future.set_exception(DeadLetterWriteError(str(err)))

            self._loop.call_soon_threadsafe(settle)

        try:
            self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=report)
        except BufferError as exc:
            raise DeadLetterWriteError("the DLQ producer queue is full") from exc
        except KafkaException as exc:
            raise DeadLetterWriteError(str(exc)) from exc
        await future

    async def write(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        on_failure: Any = None,
    ) -> int:
        """Write one record and return once confirmed; retries until then (or cancellation).

        Returns how many attempts failed before the write was confirmed.
        """
        delay = self._retry_initial_s
        failed = 0
        while True:
            try:
                await self._produce_once(topic, key, value, headers)
                return failed
            except DeadLetterWriteError as exc:
                failed += 1
                self.failures += 1
                if on_failure is not None:
                    on_failure(exc)
                log.warning(
                    "DLQ write to %s failed (attempt %d), retrying in %.1fs; the offset stays "
                    "uncommitted: %s",
                    topic,
                    failed,
                    delay,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued, then stop the poller."""
        await asyncio.to_thread(self._producer.flush, timeout_s)
        self._stop.set()
        await asyncio.to_thread(self._poller.join, 5)


class DeadLetterWriters:
    """The process's DLQ producers: one per distinct producer configuration, shared by every
    group that needs it (usually one for the whole process), closed when its last group
    lets go. Each producer costs librdkafka threads, buffers and a polling thread that wakes
    ten times a second: per group, that was most of an idle group's cost."""

    def __init__(self) -> None:
        self._writers: dict[str, tuple[DeadLetterWriter, int]] = {}

    @staticmethod
    def _key(conf: dict[str, Any]) -> str:
        return json.dumps(conf, sort_keys=True, default=str)

    def acquire(self, conf: dict[str, Any], loop: asyncio.AbstractEventLoop) -> DeadLetterWriter:
        """The writer for ``conf``, created on first use."""
        key = self._key(conf)
        entry = self._writers.get(key)
        writer = entry[0] if entry is not None else DeadLetterWriter(conf, loop)
        self._writers[key] = (writer, (entry[1] if entry is not None else 0) + 1)
        return writer

    async def release(self, writer: DeadLetterWriter, timeout_s: float = 10.0) -> None:
        """A group is done with ``writer``; the last one closes it (flushing what is queued)."""
        for key, (known, users) in list(self._writers.items()):
            if known is writer:
                if users > 1:
                    self._writers[key] = (known, users - 1)
                    return
                del self._writers[key]
                break
        await writer.close(timeout_s)


def ensure_topics(kafka: KafkaConfig, group: GroupConfig, timeout_s: float = 30.0) -> list[str]:
    """Create the group's missing DLQ and redrive topics (blocking; call off the loop).

    Returns the names created. Raises TopicSetupError saying what failed and how to fix it.
    """
    conf: dict[str, Any] = dict(kafka.client)
    conf["bootstrap.servers"] = kafka.bootstrap_servers
    for consumer_only in ("isolation.level", "auto.offset.reset", "session.timeout.ms"):
        conf.pop(consumer_only, None)
    admin = AdminClient(conf, logger=log)
    try:
        metadata = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise TopicSetupError(f"cannot reach Kafka at {kafka.bootstrap_servers}: {exc}") from exc
    existing = metadata.topics
    wanted = [group.dlq_topic, group.redrive_topic]
    missing = [t for t in wanted if t not in existing]
    absent_sources = [t for t in group.topics if t not in existing]
    if absent_sources:
        log.warning(
            "group %s: source topics %s do not exist yet; the proxy waits for them",
            group.name,
            ", ".join(absent_sources),
        )
    if not missing:
        return []
    if not group.dlq.create:
        raise TopicSetupError(
            f"group {group.name}: topics {', '.join(missing)} do not exist and dlq.create is "
            "false; create them or set dlq.create: true"
        )
    partitions = group.dlq.partitions
    if partitions is None:
        counts = [len(existing[t].partitions) for t in group.topics if t in existing]
        partitions = max(counts, default=1)
    replication = group.dlq.replication_factor or -1
    widths = {group.dlq_topic: partitions, group.redrive_topic: group.dlq.redrive_partitions}
    config = _record_size_config(admin, [t for t in group.topics if t in existing], timeout_s)
    futures = admin.create_topics(
        [
            NewTopic(t, num_partitions=widths[t], replication_factor=replication, config=config)
            for t in missing
        ],
        request_timeout=timeout_s,
    )
    created = []
    for name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            created.append(name)
            log.info("group %s: created topic %s (%d partitions)", group.name, name, widths[name])
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            raise TopicSetupError(
                f"group {group.name}: cannot create topic {name}: {exc}; create it by hand "
                "or grant the proxy's principal CREATE on it"
            ) from exc
    with contextlib.suppress(KafkaException):
        # Metadata propagation: wait until the new topics are visible before consuming them.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(t in admin.list_topics(timeout=5).topics for t in created):
                break
            time.sleep(0.1)
    return created


def _record_size_config(admin: AdminClient, sources: list[str], timeout_s: float) -> dict[str, str]:
    """``max.message.bytes`` for created DLQ/redrive topics: the largest of the source topics'.

    A record that fits its source topic must fit the DLQ too (plus the cp-* headers), or its
    dead letter could never be written and would hold the partition forever.
    """
    if not sources:
        return {}
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in sources]
    sizes: list[int] = []
    try:
        for future in admin.describe_configs(resources, request_timeout=timeout_s).values():
            entry = future.result(timeout=timeout_s).get("max.message.bytes")
            if entry is not None and entry.value is not None:
                sizes.append(int(entry.value))
    except (KafkaException, ValueError) as exc:
        log.warning("cannot read the source topics' max.message.bytes (%s); broker default", exc)
        return {}
    # Headroom for the cp-* headers (about 1 KiB of reason plus the coordinates).
    return {"max.message.bytes": str(max(sizes) + 16 * 1024)} if sizes else {}
