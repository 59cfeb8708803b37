"""One group from intake to commit: the GroupRunner shell.

A GroupRunner owns: the fetcher (Kafka consumer), a tracker per assigned partition, a pool of
push workers, retry timers, DLQ writes and the committer. Data flow:

    consume -> intake (tracker window, backlog when full) -> ready queue -> workers -> push
    push result -> ack/drop: done | retry: timer -> ready queue | dead letter: DLQ write -> done
    committer: every commit_interval_ms, on revoke, on shutdown -> committable offset + ack state

Shutdown order (``Proxy.shutdown`` / SIGTERM): stop intake -> let in-flight calls finish
within the grace period, then cancel them -> commit what is done -> close the consumer
(leave the group) -> close the DLQ producer and the gRPC channels.

Bounds: each partition holds at most ``max_in_flight`` offsets in its tracker; the backlog of a
full partition is paused at once (at most one fetch batch plus what librdkafka prefetched,
itself capped by queued.max.messages.kbytes); the group holds at most ``max_in_flight_bytes``
of message bytes before intake pauses. The ready queue and the retry timers only ever hold
messages that are inside a tracker window, so they are bounded by the windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from .config import GroupConfig, KafkaConfig
from .core.codec import CodecError, decode
from .core.outcomes import Classification, Classifier, Outcome, backoff_s
from .core.tracker import PartitionTracker
from .dispatcher import Dispatcher
from .dlq import (
    DeadLetterWriter,
    Origin,
    dlq_headers,
    ensure_topics_unless_stopped,
    origin_from_headers,
    producer_config,
    split_headers,
)
from .fetcher import TP, Fetcher, consumer_config
from .flow import AdaptiveLimiter, Breaker, ConcurrencyLimiter, RateLimiter, StaticLimiter
from .health import KafkaLink
from .metrics import ProxyMetrics
from .proto.v1 import handler_pb2

log = logging.getLogger(__name__)

_PRIMARY = handler_pb2.DELIVERY_SOURCE_PRIMARY
_REDRIVE = handler_pb2.DELIVERY_SOURCE_REDRIVE


@dataclass(eq=False, slots=True)
class PartitionState:
    """One assigned partition: its tracker and flow-control state."""

    topic: str
    partition: int
    committed: int | None
    restored: Any = None
    tracker: PartitionTracker | None = None
    backlog: deque[Any] = field(default_factory=deque)
    paused: bool = False
    revoked: bool = False
    meta_over_budget: bool = False
    last_commit: tuple[int, str] | None = None
    calls: int = 0  # pushes and DLQ writes under way
    bytes: int = 0
    timers: set[asyncio.TimerHandle] = field(default_factory=set)

    @property
    def tp(self) -> TP:
        """(topic, partition)."""
        return (self.topic, self.partition)


@dataclass(eq=False, slots=True)
class Delivery:
    """One message on its way through the proxy."""

    part: PartitionState
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    origin: Origin
    request: handler_pb2.HandleMessageRequest
    size: int
    attempt: int  # the attempt number the handler sees (carries on across redrive)
    counted_here: int = 0  # counted failures in this proxy: the max_attempts budget
    uncounted: int = 0  # service-level failures (outage): never dead-letter


class GroupRunner:
    """Runs one group from intake to commit."""

    def __init__(
        self,
        kafka: KafkaConfig,
        group: GroupConfig,
        metrics: ProxyMetrics,
        consumer_overrides: dict[str, Any] | None = None,
        shutdown_grace_s: float = 25.0,
    ) -> None:
        self.kafka = kafka
        self._grace_s = shutdown_grace_s
        self.group = group
        self.name = group.name
        self.metrics = metrics
        self._consumer_overrides = consumer_overrides or {}
        d = group.delivery
        self._max_in_flight = d.max_in_flight
        self._max_bytes = d.max_in_flight_bytes
        self._budget = d.metadata_budget_bytes
        self._classifier = Classifier(d.status_overrides)
        self._rng = random.Random()
        self._parts: dict[TP, PartitionState] = {}
        self._ready: asyncio.Queue[Delivery] = asyncio.Queue()
        self._bytes = 0
        self._stopping = asyncio.Event()
        self._draining = False
        self._commit_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dlq_tasks: set[asyncio.Task[Any]] = set()
        self._pushing: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None  # a task that crashed fails the group
        self._call_ended = asyncio.Event()  # revocation waits on it for in-flight calls
        self.started = asyncio.Event()
        self.kafka_link = KafkaLink()  # the consumer's broker connections, for health
        self.on_health_change: Callable[[], None] | None = None
        self._last_failure = ""  # the latest service-level failure, said when the breaker opens
        self.fetcher: Fetcher | None = None
        self.dispatcher: Dispatcher | None = None
        self.writer: DeadLetterWriter | None = None
        workers = d.concurrency if isinstance(d.concurrency, int) else d.adaptive.max
        self._workers = workers
        limit_gauge = metrics.concurrency_limit.labels(self.name)
        self.limiter: ConcurrencyLimiter = (
            AdaptiveLimiter(d.adaptive, on_change=limit_gauge.set)
            if d.concurrency == "adaptive"
            else StaticLimiter(workers)
        )
        self.rate = RateLimiter(d.rate_limit_per_s) if d.rate_limit_per_s else None
        self.breaker = Breaker(self.name, group.circuit_breaker, self._breaker_changed)
        limit_gauge.set(self.limiter.limit)
        metrics.endpoints_ejected.labels(self.name).set(0)
        metrics.circuit_open.labels(self.name).set(0)
        self._m_ack = metrics.messages.labels(self.name, "ack")
        self._m_retry = metrics.messages.labels(self.name, "retry")
        self._m_dead = metrics.messages.labels(self.name, "dead_letter")
        self._m_drop = metrics.messages.labels(self.name, "drop")
        self._m_push = metrics.push_duration.labels(self.name)
        self._m_in_flight = metrics.in_flight.labels(self.name)

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Run until ``stop()``; returns after the full shutdown sequence."""
        loop = asyncio.get_running_loop()
        if not await ensure_topics_unless_stopped(self.kafka, self.group, self._stopping):
            log.info("group %s: stopped during start-up", self.name)
            return
        self.dispatcher = Dispatcher(
            self.name,
            self.group.service,
            self._classifier,
            on_ejected=self.metrics.endpoints_ejected.labels(self.name).set,
        )
        self.dispatcher.start()
        self.writer = DeadLetterWriter(
            producer_config(self.kafka, self.group.dlq.write_timeout_ms),
            loop,
            group=self.name,
            metrics=self.metrics,
        )
        conf = consumer_config(self.kafka, self.name, self._consumer_overrides)
        self.kafka_link.attach(conf)
        topics = [*self.group.topics, self.group.redrive_topic]
        self.fetcher = Fetcher(conf, topics, self, loop)
        try:
            await self.fetcher.start()
            for i in range(self._workers):
                self._spawn(self._worker(), f"worker-{i}")
            intake = self._spawn(self._intake_loop(), "intake")
            committer = self._spawn(self._commit_loop(), "committer")
            stop = asyncio.ensure_future(self._stopping.wait())
            done, _ = await asyncio.wait(
                {intake, committer, stop}, return_when=asyncio.FIRST_COMPLETED
            )
            stop.cancel()
            for task in done:
                if task is not stop and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            await self._shutdown()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        """Ask the runner to shut down (idempotent)."""
        self._stopping.set()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._dlq_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not self._stopping.is_set():
            log.error(
                "group %s: task %s failed", self.name, task.get_name(), exc_info=task.exception()
            )
            self._failure = task.exception()
            self._stopping.set()

    async def _shutdown(self) -> None:
        self._stopping.set()
        self._draining = True
        grace = self._grace_s
        # Idle workers and loops go now; pushes and DLQ writes under way get the grace period.
        busy = self._pushing | self._dlq_tasks
        for task in self._tasks - busy:
            task.cancel()
        if busy:
            _, pending = await asyncio.wait(busy, timeout=grace)
            if pending:
                log.warning(
                    "group %s: %d pushes/DLQ writes still running after %.1fs; cancelled "
                    "(they will be redelivered)",
                    self.name,
                    len(pending),
                    grace,
                )
        remaining = list(self._tasks)
        for task in remaining:
            task.cancel()
        await asyncio.gather(*remaining, return_exceptions=True)
        for part in self._parts.values():
            for timer in part.timers:
                timer.cancel()
        if self.fetcher is not None:
            with contextlib.suppress(KafkaException):
                await self.commit()
            await self.fetcher.close()
        if self.writer is not None:
            await self.writer.close()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        log.info("group %s: stopped", self.name)

    # -- rebalance (called from the consumer thread through the loop) -------------------

    async def partitions_assigned(self, committed: Sequence[TopicPartition]) -> None:
        """Create trackers, restoring the ack state from the commit metadata."""
        for tp in committed:
            offset = tp.offset if tp.offset is not None and tp.offset >= 0 else None
            restored = None
            if offset is not None and tp.metadata:
                try:
                    restored = decode(tp.metadata)
                except CodecError as exc:
                    log.warning(
                        "group %s: %s[%d]: ignoring commit metadata that is not ours (%s); "
                        "messages above offset %d may be redelivered",
                        self.name,
                        tp.topic,
                        tp.partition,
                        exc,
                        offset,
                    )
            part = PartitionState(tp.topic, tp.partition, offset, restored)
            if offset is not None:
                part.tracker = PartitionTracker(offset, self._max_in_flight, restored)
                part.last_commit = (offset, tp.metadata or "")
            self._parts[part.tp] = part
            log.info(
                "group %s: assigned %s[%d] at offset %s%s",
                self.name,
                tp.topic,
                tp.partition,
                offset,
                " with ack state" if restored is not None else "",
            )

    async def partitions_revoked(
        self, partitions: Sequence[TopicPartition]
    ) -> list[TopicPartition]:
        """Wait briefly for in-flight calls, then hand back the final offsets to commit."""
        parts = [
            self._parts[(tp.topic, tp.partition)]
            for tp in partitions
            if (tp.topic, tp.partition) in self._parts
        ]
        grace = 0.0 if self._draining else self.group.delivery.revoke_grace_ms / 1000.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(p.calls for p in parts) and loop.time() < deadline:
            self._call_ended.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - loop.time()):  # not wait_for (3.11)
                    await self._call_ended.wait()
        offsets = []
        for part in parts:
            final = self._final_offset(part)
            if final is not None:
                offsets.append(final)
            self._forget(part)
        log.info("group %s: revoked %d partitions", self.name, len(parts))
        return offsets

    async def partitions_lost(self, partitions: Sequence[TopicPartition]) -> None:
        """Drop lost partitions without committing (another member owns them now)."""
        for tp in partitions:
            part = self._parts.get((tp.topic, tp.partition))
            if part is not None:
                self._forget(part)
        log.warning("group %s: lost %d partitions (no commit possible)", self.name, len(partitions))

    def _final_offset(self, part: PartitionState) -> TopicPartition | None:
        if part.tracker is None:
            return None
        offset = part.tracker.committable()
        meta, _ = part.tracker.metadata(self._budget)
        if part.last_commit == (offset, meta):
            return None
        return TopicPartition(part.topic, part.partition, offset, metadata=meta)

    def _forget(self, part: PartitionState) -> None:
        part.revoked = True
        for timer in part.timers:
            timer.cancel()
        part.timers.clear()
        self._bytes -= part.bytes
        part.bytes = 0
        part.backlog.clear()
        self._parts.pop(part.tp, None)
        self.metrics.forget_partition(self.name, part.topic, part.partition)

    # -- intake --------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        assert self.fetcher is not None
        batch = self.group.delivery.fetch_batch
        while not self._stopping.is_set():
            messages = await self.fetcher.consume(batch, 0.2)
            self.started.set()  # the consumer is up (joined, or joining, the group)
            for message in messages:
                self._intake(message)
            self._skip_unfetchable(self.fetcher.positions)
            await self._reconcile()

    def _skip_unfetchable(self, positions: dict[TP, int]) -> None:
        """Let the commit pass what the consumer skipped (transaction markers, aborted records).

        Only for partitions without a backlog: a backlog holds handed-over messages that are
        not tracked yet, and skipping past them would lose them.
        """
        for tp, position in positions.items():
            part = self._parts.get(tp)
            if part is None or part.backlog or position < 0:
                continue
            if part.tracker is None:  # no commit yet and nothing but markers so far
                part.tracker = PartitionTracker(position, self._max_in_flight)
            else:
                part.tracker.skip_to(position)

    def _intake(self, message: Any) -> None:
        error = message.error()
        if error is not None:
            if error.fatal():
                raise KafkaException(error)
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("group %s: consumer error: %s", self.name, error)
            return
        part = self._parts.get((message.topic(), message.partition()))
        if part is None:
            return  # revoked while the batch was in flight
        if part.tracker is None:
            part.tracker = PartitionTracker(message.offset(), self._max_in_flight)
        if part.backlog or part.tracker.is_full or self._bytes >= self._max_bytes:
            part.backlog.append(message)
            return
        self._accept(part, message)

    def _accept(self, part: PartitionState, message: Any) -> None:
        assert part.tracker is not None
        offset = message.offset()
        if not part.tracker.track(offset):
            return  # done before a restart or rebalance: the commit metadata says so
        key = message.key()
        value = message.value()
        user, ours = split_headers(message.headers())
        source = _PRIMARY
        origin = None
        attempt = 1
        if part.topic == self.group.redrive_topic:
            origin = origin_from_headers(ours)
            if origin is not None:
                source = _REDRIVE
                attempt = origin.attempt + 1
        if origin is None:
            _, ts = message.timestamp()
            origin = Origin(part.topic, part.partition, offset, max(ts, 0), 0)
        size = len(key or b"") + len(value or b"") + sum(len(k) + len(v) for k, v in user)
        request = handler_pb2.HandleMessageRequest(
            message=handler_pb2.Message(
                topic=origin.topic,
                partition=origin.partition,
                offset=origin.offset,
                key=key or b"",
                has_key=key is not None,
                value=value or b"",
                has_value=value is not None,
                headers=[handler_pb2.Header(key=k, value=v) for k, v in user],
                timestamp_ms=origin.timestamp_ms,
                consumer_group=self.name,
                attempt=attempt,
                source=source,
            )
        )
        part.bytes += size
        self._bytes += size
        self._ready.put_nowait(
            Delivery(part, offset, key, value, user, origin, request, size, attempt)
        )

    def _drain_backlog(self, part: PartitionState) -> None:
        tracker = part.tracker
        while (
            part.backlog
            and tracker is not None
            and not tracker.is_full
            and self._bytes < self._max_bytes
        ):
            self._accept(part, part.backlog.popleft())

    async def _reconcile(self) -> None:
        """Pause partitions that must not take more messages; resume the others."""
        assert self.fetcher is not None
        breaker_open = self.breaker.is_open
        over_bytes = self._bytes >= self._max_bytes
        pause: list[TP] = []
        resume: list[TP] = []
        paused = 0
        for part in self._parts.values():
            if part.backlog and not breaker_open:
                self._drain_backlog(part)
            tracker = part.tracker
            want = (
                breaker_open
                or over_bytes
                or bool(part.backlog)
                or part.meta_over_budget
                or (tracker is not None and tracker.is_full)
            )
            if want != part.paused:
                (pause if want else resume).append(part.tp)
                part.paused = want
            paused += want
        if pause or resume:
            await self.fetcher.set_paused(pause, resume)
        self.metrics.partitions_paused.labels(self.name).set(paused)

    # -- delivery ------------------------------------------------------------------------

    async def _worker(self) -> None:
        ready = self._ready
        me = asyncio.current_task()
        assert me is not None
        loop = asyncio.get_running_loop()
        while not self._draining:
            delivery = await ready.get()
            if delivery.part.revoked:
                continue
            if self.rate is not None:
                await self.rate.acquire()
            await self.limiter.acquire()
            # The breaker comes last, right before the push: a worker that waited for a slot
            # must not push on an admission the breaker has withdrawn since (it opened). The
            # price: workers held by an open breaker keep the rate token they took, so the
            # rate cap may be exceeded once, by at most the worker count, when it closes.
            probe = False
            result: Classification | None = None
            rtt = 0.0
            try:
                probe = await self.breaker.acquire()
                if not delivery.part.revoked:
                    self._pushing.add(me)
                    started = loop.time()
                    result = await self._deliver(delivery, probe)
                    rtt = loop.time() - started  # one timing feeds the histogram and limiter
                    self._m_push.observe(rtt)
            finally:
                self._pushing.discard(me)
                if probe and result is None:
                    self.breaker.abandon_probe()
                self.limiter.release(rtt, result)

    async def _deliver(self, delivery: Delivery, probe: bool) -> Classification:
        assert self.dispatcher is not None
        part = delivery.part
        endpoint = self.dispatcher.pick()
        delivery.request.message.attempt = delivery.attempt
        part.calls += 1
        self._m_in_flight.inc()
        try:
            result = await self.dispatcher.push(delivery.request, endpoint)
        finally:
            part.calls -= 1
            self._call_ended.set()
            self._m_in_flight.dec()
        if result.service_failure:
            self._last_failure = f"{result.status} from {endpoint.target}: {result.reason}"
        if result.service_failure and endpoint.ejected:
            # An instance out of rotation is ejection's business, not a group outage: the
            # breaker hears from the instances still in rotation (the last is never ejected).
            if probe:
                self.breaker.abandon_probe()
        else:
            self.breaker.record(result.service_failure, probe)
        if not part.revoked:  # else the new owner redelivers it; a late result touches nothing
            self._apply(delivery, result, endpoint.target)
        return result

    def _apply(self, delivery: Delivery, result: Classification, endpoint: str) -> None:
        outcome = result.outcome
        if outcome is Outcome.ACK:
            self._m_ack.inc()
            self._finish(delivery)
        elif outcome is Outcome.DROP:
            self._m_drop.inc()
            self._finish(delivery)
        elif outcome is Outcome.DEAD_LETTER:
            self._dead_letter(delivery, result.status, result.reason, endpoint)
        elif not result.counted:
            self._m_retry.inc()
            delivery.uncounted += 1
            delay = backoff_s(delivery.uncounted, self.group.delivery.backoff, self._rng)
            self._retry_later(delivery, result, delay)
        elif delivery.counted_here + 1 >= self.group.delivery.max_attempts:
            reason = f"gave up after {delivery.counted_here + 1} attempts: {result.reason}"
            self._dead_letter(delivery, result.status, reason, endpoint)
        else:
            self._m_retry.inc()
            delivery.counted_here += 1
            delay = backoff_s(delivery.counted_here, self.group.delivery.backoff, self._rng)
            self._retry_later(delivery, result, delay)
            delivery.attempt += 1

    def _retry_later(self, delivery: Delivery, result: Classification, delay_s: float) -> None:
        if result.retry_after_ms:
            # Capped by backoff.max_ms: a service asking for days would hold the partition's
            # commit (and its window) for that long.
            delay_s = min(result.retry_after_ms, self.group.delivery.backoff.max_ms) / 1000.0
        part = delivery.part
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def requeue() -> None:
            part.timers.discard(timer)
            if not part.revoked:
                self._ready.put_nowait(delivery)

        timer = loop.call_later(delay_s, requeue)
        part.timers.add(timer)

    def _dead_letter(self, delivery: Delivery, status: str, reason: str, endpoint: str) -> None:
        self._m_dead.inc()
        task = self._spawn(self._write_dead_letter(delivery, status, reason, endpoint), "dlq")
        self._dlq_tasks.add(task)

    async def _write_dead_letter(
        self, delivery: Delivery, status: str, reason: str, endpoint: str
    ) -> None:
        assert self.writer is not None
        part = delivery.part
        headers = dlq_headers(
            delivery.headers,
            delivery.origin,
            attempt=delivery.attempt,
            status=status,
            reason=reason,
            endpoint=endpoint,
            group=self.name,
        )
        errors = self.metrics.dlq_writes.labels(self.name, "error")
        part.calls += 1
        try:
            await self.writer.write(
                self.group.dlq_topic,
                delivery.key,
                delivery.value,
                headers,
                on_failure=lambda _exc: errors.inc(),
            )
        finally:
            part.calls -= 1
            self._call_ended.set()
        self.metrics.dlq_writes.labels(self.name, "ok").inc()
        log.info(
            "group %s: dead-lettered %s[%d]@%d (%s: %s)",
            self.name,
            delivery.origin.topic,
            delivery.origin.partition,
            delivery.origin.offset,
            status,
            reason[:200],
        )
        if not part.revoked:
            self._finish(delivery)

    def _finish(self, delivery: Delivery) -> None:
        part = delivery.part
        if part.revoked or part.tracker is None:
            return
        part.tracker.done(delivery.offset)
        part.bytes -= delivery.size
        self._bytes -= delivery.size
        if part.backlog:
            self._drain_backlog(part)

    def _breaker_changed(self, old: str, new: str) -> None:
        self.metrics.circuit_open.labels(self.name).set(0 if new == "closed" else 1)
        self.metrics.breaker_transitions.labels(self.name, new).inc()
        if new == "open":
            log.error(
                "group %s: circuit open, delivery paused (messages wait, none is dead-lettered)"
                "; last failure: %s",
                self.name,
                self._last_failure[:500] or "unknown",
            )
        if self.on_health_change is not None:
            self.on_health_change()

    # -- commit --------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        interval = self.group.delivery.commit_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval)
            try:
                await self.commit()
            except KafkaException as exc:
                log.warning("group %s: commit failed, will retry: %s", self.name, exc)
            await self._update_lag()

    async def commit(self) -> int:
        """Commit every partition's done prefix and ack state; returns partitions committed."""
        assert self.fetcher is not None
        async with self._commit_lock:
            plan: list[tuple[PartitionState, int, str]] = []
            for part in list(self._parts.values()):
                tracker = part.tracker
                if tracker is None:
                    continue
                offset = tracker.committable()
                meta, complete = tracker.metadata(self._budget)
                if not complete and not part.meta_over_budget:
                    self.metrics.metadata_over_budget.labels(self.name).inc()
                    log.warning(
                        "group %s: %s[%d]: ack state above offset %d exceeds the %d-byte "
                        "metadata budget; pausing the partition until it fits (done messages "
                        "beyond the encoded range would be redelivered after a crash)",
                        self.name,
                        part.topic,
                        part.partition,
                        offset,
                        self._budget,
                    )
                part.meta_over_budget = not complete
                if part.last_commit != (offset, meta):
                    plan.append((part, offset, meta))
            if not plan:
                return 0

            def still_owned() -> list[TopicPartition]:
                # Runs on the consumer thread after any queued rebalance callback.
                return [
                    TopicPartition(p.topic, p.partition, o, metadata=m)
                    for p, o, m in plan
                    if not p.revoked
                ]

            try:
                await asyncio.shield(self.fetcher.commit(still_owned))
            except KafkaException:
                self.metrics.commits.labels(self.name, "error").inc()
                raise
            self.metrics.commits.labels(self.name, "ok").inc()
            for part, offset, meta in plan:
                if not part.revoked:
                    part.last_commit = (offset, meta)
                    labels = (self.name, part.topic, str(part.partition))
                    self.metrics.committed_offset.labels(*labels).set(offset)
            return len(plan)

    async def _update_lag(self) -> None:
        assert self.fetcher is not None
        parts = list(self._parts.values())
        highs = await self.fetcher.watermarks([p.tp for p in parts])
        for part in parts:
            if part.revoked:
                continue
            labels = (self.name, part.topic, str(part.partition))
            if part.tracker is not None:
                self.metrics.uncommitted.labels(*labels).set(part.tracker.in_flight)
            high = highs.get(part.tp)
            if high is not None and part.last_commit is not None:
                self.metrics.lag.labels(*labels).set(max(0, high - part.last_commit[0]))

    # -- introspection (tests, health) ---------------------------------------------------

    def assignment(self) -> list[TP]:
        """Partitions currently owned."""
        return list(self._parts)
