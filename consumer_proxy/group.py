"""One group from intake to commit: the GroupRunner shell.

The decisions live in the pure core (``core.partitions.PartitionSet``: intake, windows,
backlog, byte budget, results, retries, pause plan, commit plan; ``core.decision``: what a
result means). This shell owns the tasks and executes the plans:

    consume -> PartitionSet.intake -> ready queue -> workers -> push -> PartitionSet.finish
    finish says: done | retry (a timer, then the ready queue) | dead letter or retry tier
    (a write by ``parking.Parking``, then PartitionSet.dead_lettered / tier_written) ;
    committer: every commit_interval_ms, soon after a partition goes idle, on revoke and on
    shutdown -> PartitionSet.commit_plan

Batch mode (``delivery.batch``): ``emit`` fills a ``ReadyDeque``; each worker is a call slot
that waits for anything ready, takes a batch (``core.batching.take``), pushes it with
``Dispatcher.push_batch`` (which reads the answer with ``core.batching``), records the call
once in the breaker, then calls ``PartitionSet.finish`` for each message.

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
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from .config import REVOKE_MARGIN_MS, GroupConfig, KafkaConfig
from .core.batching import NOT_IMPLEMENTED_REASON, BatchLimits, BatchOutcome, take
from .core.decision import HEAD_BLOCKED, Action
from .core.outcomes import Classification, Classifier
from .core.partitions import TP, Commit, Delivery, PartitionSet, PartitionState
from .dispatcher import Dispatcher
from .dlq import (
    DeadLetterWriter,
    SharedProducers,
    ensure_topics_unless_stopped,
    producer_config,
)
from .fetcher import Fetcher, consumer_config
from .flow import AdaptiveLimiter, Breaker, ConcurrencyLimiter, RateLimiter, StaticLimiter
from .health import KafkaLink
from .metrics import ProxyMetrics
from .parking import Parking
from .ports import DeadLetterSink, MessageSource, Pusher
from .readyq import ReadyDeque
from .wire import batch_request, unary_request

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_COMMIT_GAP_S = 0.1
"""At most this often an idle partition's progress is committed before the next interval."""
BATCH_FETCH_WAIT = "fetch.wait.max.ms"
BATCH_FETCH_WAIT_MS = 20
"""Batch groups' default long-poll of a fetch request (librdkafka's default: 500 ms)."""
FETCH_WAIT_S = 0.2
"""How long one consume waits for a first message."""
IDLE_FETCH_WAIT_S = 6.0
"""... while the group holds no message at all (served in 2 s chunks on the consumer thread,
which end early for a commit, a rebalance or shutdown: see ``Fetcher.consume``)."""
QUIET_TICKS = 10
"""A group that held nothing for two commit intervals ticks every this many intervals."""
STARVED_POLL_S = 0.005
"""... while a partition is paused for its window or the byte budget and little is ready."""
WAITING_POLL_S = 0.05
"""... while a partition is paused so, and the workers have enough ready for now."""


async def shielded(call: Awaitable[T]) -> T:
    """``call`` shielded from the caller's cancellation (a commit under way on the consumer
    thread finishes either way). A failure after the caller went is retrieved here: shutdown
    cancels the committer mid-commit, and asyncio would otherwise log that commit's failure
    (a routine ILLEGAL_GENERATION during a rebalance) as an error with a traceback."""
    task = asyncio.ensure_future(call)
    task.add_done_callback(_retrieve)
    return await asyncio.shield(task)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class GroupRunner:
    """Runs one group from intake to commit."""

    def __init__(
        self,
        kafka: KafkaConfig,
        group: GroupConfig,
        metrics: ProxyMetrics,
        consumer_overrides: dict[str, Any] | None = None,
        shutdown_grace_s: float = 25.0,
        producers: SharedProducers | None = None,
    ) -> None:
        self.kafka = kafka
        self._producers = producers  # the process's DLQ producers; None: a private one
        self._grace_s = shutdown_grace_s
        self.group = group
        self.name = group.name
        self.metrics = metrics
        self._consumer_overrides = consumer_overrides or {}
        d = group.delivery
        self._classifier = Classifier(d.status_overrides)
        self._ready: asyncio.Queue[Delivery] = asyncio.Queue()
        # Batch mode: workers are call slots taking batches from a deque of ready messages.
        self._batch_ready = ReadyDeque()
        self._batch_limits = (
            BatchLimits(d.batch.max_messages, d.batch.max_bytes) if d.batch is not None else None
        )
        self.service_problem = ""  # said by /readyz while set (the batch method is missing)
        self._stopping = asyncio.Event()
        self._draining = False
        self._flush = asyncio.Event()  # a partition went idle: commit its progress soon
        self._commit_quiet = False  # the committer ticks slowly: intake wakes it on traffic
        self._commit_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pushing: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None  # a task that crashed fails the group
        self._call_ended = asyncio.Event()  # revocation waits on it for in-flight calls
        self.started = asyncio.Event()
        self.kafka_link = KafkaLink()  # the consumer's broker connections, for health
        self.on_health_change: Callable[[], None] | None = None
        self._last_failure = ""  # the latest service-level failure, said when the breaker opens
        self.fetcher: MessageSource | None = None
        self.dispatcher: Pusher | None = None
        self.writer: DeadLetterSink | None = None
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
        self.partitions = PartitionSet(
            self.name,
            d,
            group.redrive_topic,
            self.breaker,
            emit=self._ready.put_nowait if d.batch is None else self._batch_ready.put,
            schedule=self._call_later,
            on_idle=self._flush.set,
            retry_topics=group.retry_topics,
            guard=group.dead_letter_guard,
        )
        if self.partitions.guard is not None:
            guard = self.partitions.guard
            metrics.guard_held.labels(self.name).set_function(lambda: float(guard.held))
            metrics.guard_trips.labels(self.name).set_function(lambda: float(guard.trips))
            metrics.guard_held_messages.labels(self.name).set_function(
                lambda: float(sum(len(p.held) for p in self.partitions.parts.values()))
            )
        self._parking = Parking(
            group, self.partitions, metrics, self._spawn, self._call_ended, self._flush.set
        )
        limit_gauge.set(self.limiter.limit)
        metrics.endpoints_ejected.labels(self.name).set(0)
        metrics.circuit_open.labels(self.name).set(0)
        self._m_outcome = {
            action: metrics.messages.labels(self.name, action.value) for action in Action
        }
        self._m_push = metrics.push_duration.labels(self.name)
        self._m_in_flight = metrics.in_flight.labels(self.name)
        self._m_batch_size = metrics.batch_size.labels(self.name)
        self._m_batch_unsupported = metrics.batch_unsupported.labels(self.name)
        self._m_batch_protocol_errors = metrics.batch_protocol_errors.labels(self.name)

    @staticmethod
    def _call_later(delay_s: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay_s, fn)

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
        producer_conf = producer_config(self.kafka, self.group.dlq.write_timeout_ms)
        self.writer = self._parking.sink = DeadLetterWriter(
            producer_conf,
            loop,
            group=self.name,
            metrics=self.metrics,
            on_change=self._health_changed,
            producer=(
                self._producers.get(producer_conf, loop) if self._producers is not None else None
            ),
        )
        overrides = dict(self._consumer_overrides)
        if self._batch_limits is not None and BATCH_FETCH_WAIT not in self.kafka.client:
            # A partition paused for a full window is resumed while the consumer's fetch
            # request long-polls the group's other (often empty: the redrive topic)
            # partitions; librdkafka's 500 ms default then starves the batch path (measured:
            # 1 partition, 20 ms batches of 50, 200 window: 1,000 msg/s at 500 ms, 4,456 at
            # 10 ms). kafka.client overrides it.
            overrides.setdefault(BATCH_FETCH_WAIT, BATCH_FETCH_WAIT_MS)
        conf = consumer_config(self.kafka, self.name, overrides)
        self.kafka_link.attach(conf)

        def link_changed() -> None:  # the consumer thread
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self._health_changed)

        self.kafka_link.on_change = link_changed
        topics = [*self.group.topics, self.group.redrive_topic, *self.group.retry_topics]
        grace_s = self.group.delivery.revoke_grace_ms / 1000.0
        self.fetcher = Fetcher(
            conf, topics, self, loop, callback_timeout_s=grace_s + REVOKE_MARGIN_MS / 1000.0
        )
        self.fetcher.on_reached = self.kafka_link.confirm
        try:
            await self.fetcher.start()
            for i in range(self._workers):
                worker = self._worker() if self._batch_limits is None else self._batch_worker()
                self._spawn(worker, f"worker-{i}")
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

    def _health_changed(self) -> None:
        if self.on_health_change is not None:
            self.on_health_change()

    # -- the dead-letter guard (an operator's calls; the decisions are in the core) ----------

    @property
    def guard_problem(self) -> str:
        """What /readyz says while the dead-letter guard holds ('' when it does not)."""
        state = self.partitions.guard_state()
        if state is None or not state[0].held:
            return ""
        view, held = state
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(view.since or 0))
        who = " by an operator" if view.by_operator else ""
        return (
            f"dead-letter guard: held{who} since {since}, {held} held, ratio {view.ratio:.2f} "
            f"of the last {view.finished} finished"
        )

    def guard_release(self) -> int:
        """An operator says the dead letters are real: the held messages go to the DLQ (each
        done once its write is confirmed). Returns how many."""
        released = self.partitions.guard_release()
        for held in released:
            self._m_outcome[Action.DEAD_LETTER].inc()
            self._parking.start(held.delivery, held.decision, held.status, "")
        self._health_changed()
        return len(released)

    def guard_hold(self) -> bool:
        """An operator holds the group's dead letters by hand (an incident)."""
        changed = self.partitions.guard_hold()
        self._health_changed()
        return changed

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
        busy = self._pushing | self._parking.tasks.keys()
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
        for part in self.partitions.parts.values():
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
        """New partitions, with the ack state restored from their commit metadata."""
        for tp in committed:
            offset = tp.offset if tp.offset is not None and tp.offset >= 0 else None
            self.partitions.assign(tp.topic, tp.partition, offset, tp.metadata or "")

    async def partitions_revoked(
        self, partitions: Sequence[TopicPartition]
    ) -> list[TopicPartition]:
        """Wait up to the revoke grace for in-flight calls, then hand back the final commits.

        No new push starts on a leaving partition. After the grace, DLQ writes still under
        way are cancelled (the next owner dead-letters those messages) and late push results
        are ignored: the partition is no longer this member's.
        """
        parts = self.partitions.owned([(tp.topic, tp.partition) for tp in partitions])
        for part in parts:
            part.leaving = True
        grace = 0.0 if self._draining else self.group.delivery.revoke_grace_ms / 1000.0
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + grace
        while any(p.calls for p in parts) and loop.time() < deadline:
            self._call_ended.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - loop.time()):  # not wait_for (3.11)
                    await self._call_ended.wait()
        leaving = set(parts)
        writes = self._parking.of(leaving)
        for task in writes:
            task.cancel()
        if writes:
            await asyncio.gather(*writes, return_exceptions=True)
        offsets = []
        for part in parts:
            final = self.partitions.final_commit(part)
            if final is not None:
                offsets.append(
                    TopicPartition(
                        part.topic, part.partition, final.offset, metadata=final.metadata
                    )
                )
            self._forget(part)
        busy = sum(p.calls for p in parts)
        log.info(
            "group %s: revoked %d partitions after %.1fs%s",
            self.name,
            len(parts),
            loop.time() - started,
            f" ({busy} calls still running: their results will be ignored)" if busy else "",
        )
        return offsets

    async def partitions_lost(self, partitions: Sequence[TopicPartition]) -> None:
        """Drop lost partitions without committing (another member owns them now), and
        cancel their DLQ and retry tier writes at once: the new owner makes them again, and a
        write that went on retrying here would add a copy outside the documented bound."""
        parts = self.partitions.owned([(tp.topic, tp.partition) for tp in partitions])
        writes = self._parking.of(set(parts))
        for task in writes:
            task.cancel()
        if writes:
            await asyncio.gather(*writes, return_exceptions=True)
        for part in parts:
            self._forget(part)
        log.warning(
            "group %s: lost %d partitions (no commit possible; %d DLQ/tier writes cancelled)",
            self.name,
            len(partitions),
            len(writes),
        )

    def _forget(self, part: PartitionState) -> None:
        self.partitions.forget(part)
        self.metrics.forget_partition(self.name, part.topic, part.partition)

    # -- intake --------------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        assert self.fetcher is not None
        fetcher = self.fetcher
        partitions = self.partitions
        batch = self.group.delivery.fetch_batch
        paused = self.metrics.partitions_paused.labels(self.name)
        timeout_s = FETCH_WAIT_S
        quiet = 0  # polls in a row that found the group holding nothing
        unblocking = self.group.delivery.head_block_ms is not None
        while not self._stopping.is_set():
            messages = await fetcher.consume(batch, timeout_s)
            if not self.started.is_set():
                self.started.set()  # the consumer is up (joined, or joining, the group)
                self._health_changed()
            for message in messages:
                error = message.error()
                if error is None:
                    partitions.intake(message)
                elif error.fatal():
                    raise KafkaException(error)
                elif error.code() == KafkaError._LOG_TRUNCATION:
                    log.warning("group %s: %s", self.name, error.str())
                    tp = (message.topic() or "", message.partition() or 0)
                    partitions.truncated(tp, await fetcher.position(tp))
                elif error.code() != KafkaError._PARTITION_EOF:
                    log.warning("group %s: consumer error: %s", self.name, error)
            partitions.skip_unfetchable(fetcher.positions, fetcher.positions_read)
            if unblocking:
                self._unblock()
            plan = partitions.pause_plan()
            if plan.pause or plan.resume:
                await fetcher.set_paused(plan.pause, plan.resume)
            paused.set(plan.paused)
            # A paused partition resumes only from here, after the next consume returns: while
            # one waits for its window (not for the breaker), poll briefly, or a freed window
            # would wait out the whole fetch timeout (measured: 1 partition, batches of 50 at
            # 20 ms, a 200 window: 1,000 msg/s instead of 10,000).
            waiting = plan.paused and not self.breaker.is_open
            if messages and self._commit_quiet:
                self._flush.set()  # traffic after a quiet spell: the committer's usual cadence
            quiet = 0 if messages or plan.paused or partitions.holding() else quiet + 1
            if waiting:
                # Poll often only while the workers are about to run dry: each poll is a hop
                # to the consumer thread, and polling every 5 ms throughout cost the 1-partition
                # batch workload 15% (0.80 -> 0.94 of a bare loop at 50 ms).
                timeout_s = STARVED_POLL_S if self._ready_low() else WAITING_POLL_S
            elif self._flush.is_set() or self._commit_lock.locked():
                # A commit is due or on its way to the consumer thread: a long poll ahead of
                # it would hold it up (measured: a group's last commit 0.3-0.4 s late).
                timeout_s = STARVED_POLL_S
            elif quiet < 2 or self.partitions.commits_failing:
                timeout_s = FETCH_WAIT_S
            else:
                # Nothing held or paused for two polls, and no commit due, running or failing
                # (the committer is woken by the last ack and holds its lock until its commit
                # returned; one queued behind a long wait would wait for its 2 s chunk, as a
                # group's last commit did in half the runs of the 1-partition batch bench):
                # only a new message, which ends the wait at once, or a rebalance, served
                # inside consume, can change anything. An idle group's intake wakes every 6 s
                # instead of five times a second (the idle cost of many groups).
                timeout_s = IDLE_FETCH_WAIT_S

    def _unblock(self) -> None:
        """Move aside the messages that block their partition's commit (head_block_ms)."""
        for delivery, decision in self.partitions.unblock(asyncio.get_running_loop().time()):
            tier = str(decision.tier) if decision.action is Action.TIER else "dlq"
            self.metrics.head_unblocks.labels(self.name, tier).inc()
            self._m_outcome[decision.action].inc()
            log.warning(
                "group %s: %s[%d]@%d %s; moving it to %s",
                self.name,
                delivery.origin.topic,
                delivery.origin.partition,
                delivery.origin.offset,
                decision.reason,
                f"retry tier {tier}" if decision.action is Action.TIER else "the DLQ",
            )
            self._parking.start(delivery, decision, HEAD_BLOCKED, "")

    def _ready_low(self) -> bool:
        """Fewer messages are ready than the workers can take in one round."""
        if self._batch_limits is None:
            return self._ready.qsize() < self._workers
        return len(self._batch_ready.items) < self._batch_limits.max_messages * 2

    # -- delivery ------------------------------------------------------------------------

    async def _worker(self) -> None:
        ready = self._ready
        me = asyncio.current_task()
        assert me is not None
        loop = asyncio.get_running_loop()
        partitions = self.partitions
        while not self._draining:
            delivery = await ready.get()
            if partitions.drop_stale(delivery):
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
            began = False
            try:
                probe = await self.breaker.acquire()
                began = partitions.begin(delivery)
                if began:
                    if delivery.tier:
                        self._tier_delivered(delivery)
                    self._pushing.add(me)
                    started = loop.time()
                    result = await self._deliver(delivery, probe)
                    rtt = loop.time() - started  # one timing feeds the histogram and limiter
                    self._m_push.observe(rtt)
            finally:
                self._pushing.discard(me)
                if probe and result is None:
                    self.breaker.abandon_probe()
                if began and result is None:
                    partitions.abandon(delivery)
                self.limiter.release(rtt, result)

    def _tier_delivered(self, delivery: Delivery) -> None:
        self.metrics.retry_tier_deliveries.labels(self.name, str(delivery.tier)).inc()

    async def _deliver(self, delivery: Delivery, probe: bool) -> Classification:
        assert self.dispatcher is not None
        endpoint = self.dispatcher.pick()
        request = unary_request(delivery, self.name)
        self._m_in_flight.inc()
        try:
            result = await self.dispatcher.push(request, endpoint)
        finally:
            self._m_in_flight.dec()
            self._call_ended.set()
        if result.service_failure:
            self._last_failure = f"{result.status} from {endpoint.target}: {result.reason}"
        if result.service_failure and endpoint.ejected:
            # An instance out of rotation is ejection's business, not a group outage: the
            # breaker hears from the instances still in rotation (the last is never ejected).
            if probe:
                self.breaker.abandon_probe()
        else:
            self.breaker.record(result.service_failure, probe)
        decision = self.partitions.finish(delivery, result, probe)
        if decision is not None:
            self._m_outcome[decision.action].inc()
            if decision.action is Action.DEAD_LETTER or decision.action is Action.TIER:
                self._parking.start(delivery, decision, result.status, endpoint.target)
        return result

    # -- batch delivery ------------------------------------------------------------------

    async def _batch_worker(self) -> None:
        """One call slot of batch mode: wait for anything ready, then send what is ready."""
        ready = self._batch_ready
        limits = self._batch_limits
        assert limits is not None
        batch_config = self.group.delivery.batch
        linger_s = batch_config.linger_ms / 1000.0 if batch_config is not None else 0.0
        me = asyncio.current_task()
        assert me is not None
        loop = asyncio.get_running_loop()
        partitions = self.partitions
        while not self._draining:
            await ready.wait()
            await self.limiter.acquire()
            probe = False
            outcome: BatchOutcome | None = None
            began: list[Delivery] = []
            rtt = 0.0
            try:
                probe = await self.breaker.acquire()
                if linger_s and len(ready.items) < limits.max_messages:
                    await asyncio.sleep(linger_s)
                # From here to begin() nothing awaits: a taken message is always begun.
                batch = take(ready.items, limits, partitions.drop_stale)
                if ready.items:
                    ready.wake()  # more is ready than this call takes: another slot goes
                began = [d for d in batch if partitions.begin(d)]
                for d in began:
                    if d.tier:
                        self._tier_delivered(d)
                if began:
                    self._pushing.add(me)
                    if self.rate is not None:
                        await self.rate.acquire(len(began))
                    started = loop.time()
                    outcome = await self._deliver_batch(began, probe)
                    rtt = loop.time() - started
                    self._m_push.observe(rtt)
            finally:
                self._pushing.discard(me)
                if probe and outcome is None:
                    self.breaker.abandon_probe()
                if outcome is None:
                    for delivery in began:
                        partitions.abandon(delivery)
                self.limiter.release(rtt, outcome.call if outcome is not None else None)

    async def _deliver_batch(self, batch: list[Delivery], probe: bool) -> BatchOutcome:
        assert self.dispatcher is not None
        endpoint = self.dispatcher.pick()
        payload = batch_request(batch, self.name)
        count = len(batch)
        self._m_in_flight.inc()  # calls, as in unary mode
        try:
            outcome = await self.dispatcher.push_batch(payload, count, endpoint)
        finally:
            self._m_in_flight.dec()
            self._call_ended.set()
        self._m_batch_size.observe(count)
        self._batch_answered(outcome, endpoint.target)
        failure = outcome.breaker
        if failure is None:  # a protocol error says nothing about the service's health
            if probe:
                self.breaker.abandon_probe()
        elif failure and endpoint.ejected:
            if probe:  # ejection's business, as in unary mode
                self.breaker.abandon_probe()
        else:
            self.breaker.record(failure, probe)
        finish = self.partitions.finish
        acks = 0
        others: list[Action] = []
        for delivery, result in zip(batch, outcome.results, strict=True):
            decision = finish(delivery, result, probe)
            if decision is None:
                continue
            action = decision.action
            if action is Action.ACK:
                acks += 1
                continue
            others.append(action)
            if action is Action.DEAD_LETTER or action is Action.TIER:
                self._parking.start(delivery, decision, result.status, endpoint.target)
        if acks:
            self._m_outcome[Action.ACK].inc(acks)
        for action in others:
            self._m_outcome[action].inc()
        return outcome

    def _batch_answered(self, outcome: BatchOutcome, target: str) -> None:
        """Logs, metrics and health for what a batch call's answer says about the service."""
        call = outcome.call
        if outcome.breaker:
            self._last_failure = f"{call.status} from {target}: {call.reason}"
        if outcome.unimplemented:
            if not self.service_problem:
                self.service_problem = f"{NOT_IMPLEMENTED_REASON} ({target} answered UNIMPLEMENTED)"
                self._m_batch_unsupported.set(1)
                log.error(
                    "group %s: %s; delivery.batch is configured, so messages wait (no fallback "
                    "to HandleMessage, nothing is dead-lettered) until the service implements "
                    "it or the group's batch setting is removed",
                    self.name,
                    self.service_problem,
                )
                self._health_changed()
        elif self.service_problem and outcome.breaker is False:
            self.service_problem = ""
            self._m_batch_unsupported.set(0)
            log.warning("group %s: %s answers HandleMessageBatch again", self.name, target)
            self._health_changed()
        if outcome.protocol_error:
            self._m_batch_protocol_errors.inc()
            log.warning(
                "group %s: protocol error from %s: %s; the batch is retried (no attempt counted)",
                self.name,
                target,
                outcome.protocol_error,
            )

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
        self._health_changed()

    # -- commit --------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.group.delivery.commit_interval_ms / 1000.0
        gap = min(IDLE_COMMIT_GAP_S, interval)
        next_tick = loop.time() + interval
        quiet = 0  # ticks in a row with nothing held and nothing to commit
        while True:
            # A partition that went idle is committed soon (fewer duplicates after a crash);
            # otherwise every interval. Never more often than every ``gap``.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_tick - loop.time())):
                    await self._flush.wait()
            self._flush.clear()
            committed = 0
            try:
                committed = await self.commit()
            except KafkaException as exc:
                log.warning("group %s: commit failed, will retry: %s", self.name, exc)
            now = loop.time()
            holding = self.partitions.holding()
            if now >= next_tick:
                if quiet < 2 or committed or holding:
                    # A quiet group's lag cannot change: new records wake it (it holds them).
                    await self._update_lag()
                quiet = 0 if committed or holding else quiet + 1
                # A group that holds nothing has nothing to commit until messages come (the
                # intake then flushes): it ticks every QUIET_TICKS intervals (the idle cost).
                next_tick = now + interval * (QUIET_TICKS if quiet >= 2 else 1)
            elif holding and quiet:
                quiet = 0
                next_tick = min(next_tick, now + interval)  # busy again: the usual cadence
            self._commit_quiet = quiet >= 2
            await asyncio.sleep(gap)

    async def commit(self) -> int:
        """Commit every partition's done prefix and ack state; returns partitions committed."""
        assert self.fetcher is not None
        async with self._commit_lock:
            plan, over = self.partitions.commit_plan()
            for part in over:
                self.metrics.metadata_over_budget.labels(self.name).inc()
                log.warning(
                    "group %s: %s[%d]: ack state above offset %d exceeds the %d-byte "
                    "metadata budget; pausing the partition until it fits (done messages "
                    "beyond the encoded range would be redelivered after a crash)",
                    self.name,
                    part.topic,
                    part.partition,
                    part.tracker.committable() if part.tracker is not None else -1,
                    self.group.delivery.metadata_budget_bytes,
                )
            if not plan:
                return 0

            def still_owned() -> list[TopicPartition]:
                # Runs on the consumer thread after any queued rebalance callback.
                return [
                    TopicPartition(c.part.topic, c.part.partition, c.offset, metadata=c.metadata)
                    for c in plan
                    if not c.part.revoked
                ]

            try:
                await shielded(self.fetcher.commit(still_owned))
            except KafkaException:
                self.metrics.commits.labels(self.name, "error").inc()
                self.partitions.commits_failing = True
                raise
            self.partitions.commits_failing = False
            self.metrics.commits.labels(self.name, "ok").inc()
            kept: list[Commit] = self.partitions.committed(plan)
            for c in kept:
                labels = (self.name, c.part.topic, str(c.part.partition))
                self.metrics.committed_offset.labels(*labels).set(c.offset)
            return len(plan)

    async def _update_lag(self) -> None:
        assert self.fetcher is not None
        parts = list(self.partitions.parts.values())
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
        self.metrics.key_backlog(self.name, self.partitions.key_backlog())

    # -- introspection (tests, health) ---------------------------------------------------

    def assignment(self) -> list[TP]:
        """Partitions currently owned."""
        return list(self.partitions.parts)
