"""Dead letters: the DLQ record format, the confirmed (acks=all, idempotent) writer, topic setup.

An offset whose message is dead-lettered becomes done only when the broker confirms the DLQ
write. A failed write is retried with backoff for as long as it takes; meanwhile the offset
stays pending, so the commit cannot pass it (a DLQ outage holds the partition, it never loses
the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from .config import GroupConfig, KafkaConfig
from .core.records import Headers
from .errors import DeadLetterWriteError, TopicSetupError
from .kafka_log import KafkaLogGate
from .metrics import ProxyMetrics

__all__ = [
    "DeadLetterWriter",
    "SharedProducer",
    "SharedProducers",
    "ensure_topics",
    "producer_config",
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


REASONS = (
    "record_too_large",
    "topic_authorization",
    "unknown_topic",
    "timed_out",
    "queue_full",
    "fatal",
    "other",
)
"""Why a DLQ write failed, as a short category (the ``reason`` label of the metrics)."""

_REASON_OF_CODE = {
    KafkaError.MSG_SIZE_TOO_LARGE: "record_too_large",
    KafkaError.RECORD_LIST_TOO_LARGE: "record_too_large",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic_authorization",
    KafkaError.UNKNOWN_TOPIC_OR_PART: "unknown_topic",
    KafkaError._UNKNOWN_TOPIC: "unknown_topic",
    KafkaError._UNKNOWN_PARTITION: "unknown_topic",
    KafkaError._MSG_TIMED_OUT: "timed_out",
    KafkaError._TIMED_OUT: "timed_out",
    KafkaError.REQUEST_TIMED_OUT: "timed_out",
    KafkaError._QUEUE_FULL: "queue_full",
    KafkaError._FATAL: "fatal",
}


def failure_reason(err: KafkaError | None) -> str:
    """The category of a failed DLQ write (one of REASONS)."""
    if err is None:
        return "other"
    if err.fatal():
        return "fatal"
    return _REASON_OF_CODE.get(err.code(), "other")


class ProducerLike(Protocol):
    """The part of confluent_kafka.Producer the writer uses (tests inject fakes)."""

    def produce(self, topic: str, **kwargs: Any) -> None:
        """Queue one record; ``on_delivery`` reports it."""

    def poll(self, timeout: float) -> int:
        """Serve delivery reports and callbacks."""

    def flush(self, timeout: float) -> int:
        """Wait for queued records; returns how many are left."""

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """Fail every queued record (their reports say so)."""


ProducerFactory = Callable[[dict[str, Any]], ProducerLike]


DLQ_POLL_S = 1.0
"""The DLQ producer's poll timeout: a delivery report ends the wait at once, so this only
bounds how long a stopping poller takes to notice (every wake-up is idle CPU otherwise)."""


class _Session:
    """One producer and the thread that polls it (a fatal error replaces both)."""

    def __init__(self, producer: ProducerLike) -> None:
        self.producer = producer
        self.stop = threading.Event()
        # librdkafka fires delivery reports from poll(); a thread of its own keeps polling.
        self.poller = threading.Thread(target=self._poll, name="dlq-poller", daemon=True)
        self.poller.start()

    def _poll(self) -> None:
        while not self.stop.is_set():
            self.producer.poll(DLQ_POLL_S)

    def discard(self) -> None:
        """Fail what is queued (each report lets its write retry elsewhere), then stop polling.

        Blocking: call off the loop.
        """
        with contextlib.suppress(KafkaException, RuntimeError):
            self.producer.purge()
        with contextlib.suppress(KafkaException, RuntimeError):
            self.producer.flush(5.0)  # serves the purged records' reports
        self.stop.set()


class SharedProducer:
    """The DLQ producer of a process: one client and one polling thread for every group.

    Groups write through their own ``DeadLetterWriter`` (their refusals, retries, metrics and
    log lines stay theirs); what they share is the client, so an idle group costs no producer
    threads, connections or buffers of its own (issue 13: 40 idle groups held 40 producers).
    A fatal producer error (e.g. a missing IdempotentWrite ACL, a sequence error) replaces the
    client for every writer, once however many writes fail on it and at most once per
    ``recreate_every_s``: librdkafka never recovers one by itself. The last writer to close
    flushes and stops it.
    """

    def __init__(
        self,
        conf: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        *,
        recreate_every_s: float = 10.0,
        producer_factory: ProducerFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        label: str = "DLQ producer",
    ) -> None:
        self._loop = loop
        self._recreate_every_s = recreate_every_s
        self._clock = clock
        self.log_gate = KafkaLogGate(log, label)
        self._conf = self.log_gate.attach(dict(conf))
        self._factory: ProducerFactory = producer_factory or self._real_producer
        self._error_cb = self._conf["error_cb"]
        self.session = self._new_session()
        self._last_recreated: float | None = None
        self.recreated = 0
        """Producers replaced after a fatal error."""
        self.users = 0
        self._closed = False

    def _real_producer(self, conf: dict[str, Any]) -> ProducerLike:
        # Producer.produce's stub spells out every keyword; the protocol takes **kwargs.
        return cast(ProducerLike, Producer(conf, logger=self.log_gate))

    def _new_session(self) -> _Session:
        conf = dict(self._conf)
        holder: list[_Session] = []

        def on_error(err: KafkaError) -> None:  # the producer's thread
            self._error_cb(err)
            if err.fatal() and holder:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self._loop.call_soon_threadsafe(self.recreate, holder[0], err.str())

        conf["error_cb"] = on_error
        session = _Session(self._factory(conf))
        holder.append(session)
        return session

    def recreate(self, session: _Session, why: str) -> None:
        """Replace a producer that hit a fatal error (on the loop); see the class."""
        if session is not self.session or self._closed:
            return
        now = self._clock()
        if self._last_recreated is not None and now - self._last_recreated < self._recreate_every_s:
            return
        self._last_recreated = now
        self.log_gate.say(
            logging.WARNING,
            f"the DLQ producer hit a fatal error ({why}); replacing it with a new one",
        )
        self.session = self._new_session()
        self.recreated += 1
        # Its queued records fail (their writes retry on the new producer); a daemon thread,
        # not the default executor, so that a stopping process never waits for it.
        threading.Thread(target=session.discard, name="dlq-discard", daemon=True).start()

    @property
    def closed(self) -> bool:
        """Its last writer closed it: a new writer needs a new producer."""
        return self._closed

    def acquire(self) -> None:
        """A writer starts using it (each ``acquire`` is paired with one ``release``)."""
        if self._closed:
            raise RuntimeError("the DLQ producer is closed: get a new one")
        self.users += 1

    async def release(self, timeout_s: float = 10.0) -> None:
        """A writer is done with it; the last one flushes what is queued and stops the poller."""
        self.users -= 1
        if self.users > 0 or self._closed:
            return
        self._closed = True
        session = self.session
        await asyncio.to_thread(session.producer.flush, timeout_s)
        session.stop.set()
        await asyncio.to_thread(session.poller.join, DLQ_POLL_S + 5)


class SharedProducers:
    """The process's DLQ producers, one per distinct producer configuration (groups with
    another ``dlq.write_timeout_ms`` get one of their own: librdkafka sets the message timeout
    per client)."""

    def __init__(self) -> None:
        self._by_conf: dict[tuple[tuple[str, str], ...], SharedProducer] = {}

    def get(self, conf: dict[str, Any], loop: asyncio.AbstractEventLoop) -> SharedProducer:
        """The producer for ``conf``, created on first use; a closed one is replaced."""
        key = tuple(sorted((k, repr(v)) for k, v in conf.items()))
        found = self._by_conf.get(key)
        if found is None or found.closed:
            found = self._by_conf[key] = SharedProducer(conf, loop)
        return found

    def active(self) -> int:
        """How many producers are in use."""
        return sum(1 for p in self._by_conf.values() if p.users > 0)


class DeadLetterWriter:
    """Writes DLQ records and resolves when the broker has confirmed each one.

    While a record is refused (written, failed, not yet confirmed) the writer says so:
    ``refusal()`` for the health verdict, ``consumer_proxy_dlq_write_errors_total{reason}``
    and ``consumer_proxy_dlq_held_messages`` when metrics are given, and one log line when
    the DLQ starts and one when it stops refusing. The producer is ``producer`` (the
    process's shared one) or a private one built from ``conf``.
    """

    def __init__(
        self,
        conf: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
        *,
        group: str = "",
        metrics: ProxyMetrics | None = None,
        producer_factory: ProducerFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        producer: SharedProducer | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._loop = loop
        self._on_change = on_change  # refusing started or ended (health re-reads the verdict)
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._group = group
        self._metrics = metrics
        self._clock = clock
        if producer is None:
            producer = SharedProducer(
                conf,
                loop,
                recreate_every_s=retry_max_s,
                producer_factory=producer_factory,
                clock=clock,
                label=f"group {group} DLQ producer" if group else "DLQ producer",
            )
        producer.acquire()
        self.producer = producer
        self.log_gate = producer.log_gate
        self.failures = 0
        self._refused: dict[object, tuple[str, str, str]] = {}  # write -> topic, reason, detail
        self._refused_since: float | None = None
        self._said_reasons: set[str] = set()
        self._failures_while_refused = 0
        self._closed = False

    @property
    def recreated(self) -> int:
        """Producers replaced after a fatal error."""
        return self.producer.recreated

    # -- state ---------------------------------------------------------------------------

    def refusal(self) -> str | None:
        """Why the DLQ refuses records right now, or None while every write goes through."""
        if not self._refused:
            return None
        topics = sorted({topic for topic, _, _ in self._refused.values()})
        reasons = sorted({reason for _, reason, _ in self._refused.values()})
        detail = next(iter(self._refused.values()))[2]
        held = len(self._refused)
        return (
            f"DLQ {', '.join(topics)} refuses records ({', '.join(reasons)}: {detail[:200]}); "
            f"{held} dead letter{'s' if held != 1 else ''} wait{'s' if held == 1 else ''}, "
            "their offsets stay uncommitted"
        )

    def _refuse(self, token: object, topic: str, error: DeadLetterWriteError) -> None:
        self.failures += 1
        self._failures_while_refused += 1
        if self._metrics is not None:
            self._metrics.dlq_write_errors.labels(self._group, error.reason).inc()
        first = not self._refused
        self._refused[token] = (topic, error.reason, str(error))
        if first:
            self._refused_since = self._clock()
            if self._on_change is not None:
                self._on_change()
        if error.reason not in self._said_reasons:
            self._said_reasons.add(error.reason)
            log.warning(
                "group %s: DLQ %s refuses records (%s: %s); the dead letters wait and their "
                "offsets stay uncommitted until it accepts them",
                self._group,
                topic,
                error.reason,
                error,
            )
        self._publish()

    def _settled(self, token: object) -> None:
        """A write ended (confirmed or cancelled): it no longer holds anything."""
        entry = self._refused.pop(token, None)
        if entry is None:
            return
        if not self._refused and self._refused_since is not None:
            log.info(
                "group %s: DLQ %s accepts records again after %.0f s (%d failed writes)",
                self._group,
                entry[0],
                self._clock() - self._refused_since,
                self._failures_while_refused,
            )
            self._refused_since = None
            self._said_reasons.clear()
            self._failures_while_refused = 0
            if self._on_change is not None:
                self._on_change()
        self._publish()

    def _publish(self) -> None:
        if self._metrics is not None:
            self._metrics.dlq_held.labels(self._group).set(len(self._refused))

    # -- writing -------------------------------------------------------------------------

    async def _produce_once(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers
    ) -> None:
        session = self.producer.session
        future: asyncio.Future[None] = self._loop.create_future()

        def report(err: KafkaError | None, _msg: Any) -> None:
            def settle() -> None:
                if future.done():  # the write was cancelled: nothing waits for it
                    return
                if err is None:
                    future.set_result(None)
                else:
                    detail = f"{err.name()}: {err.str()}"
                    future.set_exception(DeadLetterWriteError(detail, reason=failure_reason(err)))

            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(settle)

        try:
            session.producer.produce(
                topic, value=value, key=key, headers=headers, on_delivery=report
            )
        except BufferError as exc:
            raise DeadLetterWriteError(
                "the DLQ producer queue is full", reason="queue_full"
            ) from exc
        except KafkaException as exc:
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            reason = failure_reason(error)
            if reason == "fatal":
                self.producer.recreate(session, str(exc))
            raise DeadLetterWriteError(str(exc), reason=reason) from exc
        try:
            await future
        except DeadLetterWriteError as exc:
            if exc.reason == "fatal":
                self.producer.recreate(session, str(exc))
            raise
        self.log_gate.reachable()

    async def write(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers,
        on_failure: Any = None,
    ) -> int:
        """Write one record and return once confirmed; retries until then (or cancellation).

        Returns how many attempts failed before the write was confirmed. A cancelled write
        stops retrying and leaves nothing behind (a record already handed to the producer may
        still land in the DLQ: at least once).
        """
        token = object()
        delay = self._retry_initial_s
        failed = 0
        try:
            while True:
                try:
                    await self._produce_once(topic, key, value, headers)
                    return failed
                except DeadLetterWriteError as exc:
                    failed += 1
                    self._refuse(token, topic, exc)
                    if on_failure is not None:
                        on_failure(exc)
                    log.debug(
                        "group %s: DLQ write to %s failed (attempt %d), retrying in %.1fs: %s",
                        self._group,
                        topic,
                        failed,
                        delay,
                        exc,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._retry_max_s)
        finally:
            self._settled(token)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Done writing; the producer's last writer flushes what is queued and stops it."""
        if self._closed:
            return
        self._closed = True
        await self.producer.release(timeout_s)


def ensure_topics(kafka: KafkaConfig, group: GroupConfig, timeout_s: float = 30.0) -> list[str]:
    """Create the group's missing DLQ, redrive and retry tier topics (blocking; off the loop).

    Returns the names created. Raises TopicSetupError saying what failed and how to fix it.
    """
    conf: dict[str, Any] = dict(kafka.client)
    conf["bootstrap.servers"] = kafka.bootstrap_servers
    for consumer_only in ("isolation.level", "auto.offset.reset", "session.timeout.ms"):
        conf.pop(consumer_only, None)
    gate = KafkaLogGate(log, f"group {group.name} admin")
    conf["error_cb"] = gate.error  # no statistics: nothing polls this short-lived client
    admin = AdminClient(conf, logger=gate)
    try:
        metadata = admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise TopicSetupError(f"cannot reach Kafka at {kafka.bootstrap_servers}: {exc}") from exc
    gate.reachable()
    existing = metadata.topics
    try:
        _tell_orphan_tiers(admin, group, existing, timeout_s)
    except Exception as exc:  # noqa: BLE001 (a warning only: never a failed start)
        log.debug("group %s: reading leftover retry tiers failed: %s", group.name, exc)
    try:
        _tell_short_tier_retention(admin, group, existing, timeout_s)
    except Exception as exc:  # noqa: BLE001 (as above)
        log.debug("group %s: reading the retry tiers' retention failed: %s", group.name, exc)
    wanted = [group.dlq_topic, group.redrive_topic, *group.retry_topics]
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
    # Retry tiers are as wide as the widest source topic (their load is the sources' retries).
    widest = max((len(existing[t].partitions) for t in group.topics if t in existing), default=1)
    widths.update(dict.fromkeys(group.retry_topics, widest))
    config = _record_size_config(admin, [t for t in group.topics if t in existing], timeout_s)
    configs = {t: config for t in missing}
    for topic, tier in zip(group.retry_topics, group.delivery.retry_topics, strict=True):
        # A tier record is its message's only copy (the source offset is committed): kept
        # well past its delay, whatever the cluster's default retention.
        configs[topic] = {**config, "retention.ms": str(tier_retention_ms(tier.delay_ms))}
    futures = admin.create_topics(
        [
            NewTopic(t, num_partitions=widths[t], replication_factor=replication, config=configs[t])
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


TIER_RETENTION_MARGIN_MS = 7 * 24 * 3600 * 1000
"""How much longer than its delay a retry tier topic the proxy creates keeps a record (outages,
a backlog, restarts: a record fetched late must still be there)."""
TIER_RETENTION_SHORT_MS = 24 * 3600 * 1000
"""An existing tier topic whose retention leaves less than this past its delay is told of."""


def tier_retention_ms(delay_ms: int) -> int:
    """``retention.ms`` of a retry tier topic the proxy creates for a tier of ``delay_ms``."""
    return delay_ms + TIER_RETENTION_MARGIN_MS


def _tell_short_tier_retention(
    admin: AdminClient, group: GroupConfig, existing: dict[str, Any], timeout_s: float
) -> None:
    """Tell (an error, once a start) of existing retry tier topics that may delete a record
    before it is due and fetched: a tier record is its message's only copy, so that message
    would be lost (the consumer skips to the log's start)."""
    tiers = {
        topic: tier.delay_ms
        for topic, tier in zip(group.retry_topics, group.delivery.retry_topics, strict=True)
        if topic in existing
    }
    if not tiers:
        return
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in tiers]
    for resource, future in admin.describe_configs(resources, request_timeout=timeout_s).items():
        entry = future.result(timeout=timeout_s).get("retention.ms")
        if entry is None or entry.value is None:
            continue
        retention, delay = int(entry.value), tiers[resource.name]
        if 0 <= retention < delay + TIER_RETENTION_SHORT_MS:
            log.error(
                "group %s: retry tier topic %s keeps records %d ms (retention.ms), less than a "
                "day past its delay_ms %d: a record deleted before it is fetched (an outage, a "
                "backlog) is lost, its source offset committed; raise its retention.ms to at "
                "least %d",
                group.name,
                resource.name,
                retention,
                delay,
                tier_retention_ms(delay),
            )


def _tell_orphan_tiers(
    admin: AdminClient, group: GroupConfig, existing: dict[str, Any], timeout_s: float
) -> None:
    """Tell (an error, once a start) of retry tier topics beyond the configured tiers that hold
    records the group has not consumed: a config with more tiers wrote them, their source
    offsets are committed, and no consumer reads them now. Kafka keeps them (until its
    retention), so putting the tiers back drains them."""
    configured = len(group.retry_topics)
    pattern = re.compile(re.escape(group.name) + r"\.retry\.([1-9][0-9]{0,3})")
    beyond = sorted(
        (int(found.group(1)), topic)
        for topic in existing
        if (found := pattern.fullmatch(topic)) and int(found.group(1)) > configured
    )
    if not beyond:
        return
    partitions = [
        TopicPartition(topic, p) for _n, topic in beyond for p in existing[topic].partitions
    ]
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    asked = admin.list_offsets({tp: latest for tp in partitions}, request_timeout=timeout_s)
    ends = {
        (tp.topic, tp.partition): future.result(timeout=timeout_s).offset
        for tp, future in asked.items()
    }
    request = [ConsumerGroupTopicPartitions(group.name, partitions)]
    read = admin.list_consumer_group_offsets(request, request_timeout=timeout_s)[group.name]
    committed = {
        (tp.topic, tp.partition): max(tp.offset, 0)
        for tp in read.result(timeout_s).topic_partitions
    }
    left = {
        topic: sum(
            max(0, ends[(topic, p)] - committed.get((topic, p), 0))
            for p in existing[topic].partitions
        )
        for _n, topic in beyond
    }
    held = [(n, topic) for n, topic in beyond if left[topic]]
    if held:
        log.error(
            "group %s: retry tier topics beyond the %d configured hold records no tier "
            "consumes now: %s; their source offsets were committed when they were written, so "
            "they are not delivered until delivery.retry_topics has at least %d tiers again "
            "(until they are empty)",
            group.name,
            configured,
            ", ".join(f"{topic} ({left[topic]} records)" for _n, topic in held),
            held[-1][0],
        )


async def ensure_topics_unless_stopped(
    kafka: KafkaConfig, group: GroupConfig, stopping: asyncio.Event, timeout_s: float = 30.0
) -> bool:
    """``ensure_topics`` off the loop, abandoned when ``stopping`` is set first.

    Returns True once the topics are there (raises what ``ensure_topics`` raises), False when
    stopping won. The call runs on a daemon thread of its own, not ``asyncio.to_thread``: the
    default executor's threads are joined when ``asyncio.run`` ends, so a metadata call blocked
    on an unreachable Kafka would hold a stopping process for up to ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    result: asyncio.Future[list[str]] = loop.create_future()

    def settle(value: list[str] | None, error: BaseException | None) -> None:
        if result.done():  # abandoned: nobody waits for it any more
            return
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value or [])

    def work() -> None:
        value: list[str] | None = None
        error: BaseException | None = None
        try:
            value = ensure_topics(kafka, group, timeout_s)
        except Exception as exc:  # noqa: BLE001 (handed over to the loop, raised there)
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name=f"topics-{group.name}", daemon=True).start()
    stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
    waited: set[asyncio.Future[Any]] = {result, stop}
    try:
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not result.done():
            result.cancel()
    if stopping.is_set():
        if not result.cancelled():
            result.exception()  # retrieved: a late failure does not matter when stopping
        return False
    result.result()
    return True


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
