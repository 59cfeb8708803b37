"""One group from intake to commit: the GroupRunner shell.

Every decision is the pure core's (``core.partitions.PartitionSet``: intake, windows, backlog,
byte budget, results, retries, pause and commit plans; ``core.decision``: what a result means;
``core.cadence``: when to poll and commit). The shell's jobs are objects, one module each
(``intake``, ``push``/``batch_push``/``stream``, ``parking``, ``committer``, ``handover``,
``guarding``; docs/architecture.md says what each owns); ``GroupRunner`` builds them, owns
their tasks, the rebalance callbacks and the shutdown order.

Its I/O edges (consumer, pusher, DLQ sink, clock: ``ports``) are built when it runs by the
``ports.OpenEdges`` it is given (``adapters.RealEdges`` builds the real ones).

Shutdown order (``Proxy.shutdown`` / SIGTERM): stop intake -> let in-flight calls finish
within the grace period, then cancel them -> commit what is done -> close the consumer
(leave the group) -> close the DLQ producer and the gRPC channels.

Bounds: each partition holds at most ``max_in_flight`` offsets in its tracker and a backlog of
at most ``core.partitions.backlog_bound`` records; the group holds at most
``max_in_flight_bytes`` of message bytes before intake pauses. The ready queue and the retry
timers only hold messages inside a tracker window, so they are bounded by the windows.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import TopicPartition

from .committer import Committer
from .config import GroupConfig
from .core.partitions import TP, Delivery, PartitionSet
from .flow import Breaker, RateLimiter, group_limiter
from .guarding import GuardControl
from .handover import Handover, close_edges
from .health import KafkaLink
from .intake import Intake
from .metrics import ProxyMetrics
from .parking import Parking, Tally
from .ports import Clock, DeadLetterSink, EdgeHooks, MessageSource, OpenEdges, Pusher
from .push import PushParts, UnaryPush
from .pushes import BatchPush, build_push
from .readyq import ReadyDeque
from .snapshot import group_snapshot
from .tracing import end_trace

log = logging.getLogger(__name__)


class GroupRunner:
    """Runs one group from intake to commit."""

    def __init__(
        self,
        group: GroupConfig,
        metrics: ProxyMetrics,
        open_edges: OpenEdges,
        shutdown_grace_s: float = 25.0,
        *,
        monotonic: Clock = time.monotonic,
        wall: Clock = time.time,
        rng: random.Random | None = None,
    ) -> None:
        """``open_edges`` builds the group's consumer, pusher, DLQ sink and clock when it runs
        (``adapters.RealEdges``). ``monotonic`` (the breaker's), ``wall`` (epoch seconds: the
        core's due times) and ``rng`` (backoff jitter) are seams for the simulation."""
        self._open_edges = open_edges
        self._grace_s = shutdown_grace_s
        self.group = group
        self.name = group.name
        self.metrics = metrics
        d = group.delivery
        batched = None if d.batch is None else ReadyDeque()  # batch mode: call slots take batches
        self.ready: asyncio.Queue[Delivery] | ReadyDeque = batched or asyncio.Queue()
        self._stopping, self._draining = asyncio.Event(), False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BaseException | None = None  # a task that crashed fails the group
        self._call_ended = asyncio.Event()  # revocation waits on it for in-flight calls
        self.started = asyncio.Event()
        self.kafka_link = KafkaLink()  # the consumer's broker connections, for health
        self.on_health_change: Callable[[], None] | None = None
        # The edges and the push, once the group runs.
        self.fetcher: MessageSource | None = None
        self.dispatcher: Pusher | None = None
        self.writer: DeadLetterSink | None = None
        self.push: UnaryPush | BatchPush | None = None
        self._workers = d.concurrency if isinstance(d.concurrency, int) else d.adaptive.max
        limit_gauge = metrics.concurrency_limit.labels(self.name)
        self.limiter = group_limiter(d, limit_gauge.set)
        self.rate = RateLimiter(d.rate_limit_per_s) if d.rate_limit_per_s else None
        self.breaker = Breaker(
            self.name, group.circuit_breaker, self._breaker_changed, clock=monotonic
        )
        self.partitions = PartitionSet(
            self.name,
            d,
            group.redrive_topic,
            self.breaker,
            emit=self.ready.put_nowait,
            emit_batch=None if batched is None else batched.put_batch,  # a run taken in at once
            runs=batched is not None,  # ... as ``Run`` items (batch mode's fast path)
            schedule=self._call_later,
            on_idle=lambda: self.committer.wake(),
            retry_topics=group.retry_topics,
            guard=group.dead_letter_guard,
            clock=wall,
            rng=rng,
        )
        self.committer = Committer(self.name, d, self.partitions, metrics)
        self._parking = Parking(
            group, self.partitions, metrics, self._spawn, self._call_ended, self.committer.wake
        )
        self._handover = Handover(
            self.name, self.partitions, self._parking, metrics, self._call_ended, d.revoke_grace_ms
        )
        self._tally = Tally(self.name, metrics, self._parking.start)
        self.guard = GuardControl(
            self.name, self.partitions, self._tally, metrics, self._health_changed
        )
        limit_gauge.set(self.limiter.limit)
        metrics.endpoints_ejected.labels(self.name).set(0)
        metrics.circuit_open.labels(self.name).set(0)

    @staticmethod
    def _call_later(delay_s: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay_s, fn)

    @property
    def service_problem(self) -> str:
        """Said by /readyz while set (batch mode: the service lacks the batch method)."""
        return self.push.service_problem if isinstance(self.push, BatchPush) else ""

    @property
    def push_detail(self) -> str:
        """What /readyz adds on how the group pushes ('' but for ``delivery.batch: auto``:
        which instances get batches, which unary calls)."""
        return self.dispatcher.batch_support() if self.dispatcher is not None else ""

    @property
    def run_problem(self) -> str:
        """Said by /readyz: the group stops (asked to, or failed: its error, clipped), or its
        commits have failed in a row for long (``Committer.problem``)."""
        if not self._stopping.is_set():
            return self.committer.problem()
        return "stopping" + ("" if self._failure is None else f": failed: {self._failure!r}"[:300])

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        """Run until ``stop()``; returns after the full shutdown sequence."""
        hooks = EdgeHooks(self, self.kafka_link, self._stopping, self._health_changed)
        edges = await self._open_edges(self.group, hooks)
        if edges is None:
            log.info("group %s: stopped during start-up", self.name)
            return
        self.fetcher, self.dispatcher = edges.source, edges.pusher
        self.writer = self._parking.sink = edges.sink
        self._handover.clock = edges.clock
        self.committer.attach(edges.source, edges.clock)
        if edges.tracer is not None:
            self.partitions.gone = end_trace
        parts = PushParts(
            self.name,
            self.partitions,
            edges,
            self.breaker,
            self.limiter,
            self.rate,
            self._tally,
            self.metrics,
            self._call_ended,
        )
        d = self.group.delivery
        push = build_push(parts, self.ready, self._workers, d, self._health_changed)
        self.push = self._handover.push = push
        intake = Intake(parts, d, self.committer, push.ready_low, self._consumer_started)
        try:
            await edges.source.start()
            for i in range(push.workers):
                self._spawn(push.worker(), f"worker-{i}")
            polling = self._spawn(intake.run(self._stopping), "intake")
            committing = self._spawn(self.committer.run(), "committer")
            stop = asyncio.ensure_future(self._stopping.wait())
            done, _ = await asyncio.wait(
                {polling, committing, stop}, return_when=asyncio.FIRST_COMPLETED
            )
            stop.cancel()
            for task in done:
                if task is not stop and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            await self._shutdown()
        if self._failure is not None:
            raise self._failure

    def _consumer_started(self) -> None:
        self.started.set()  # the consumer is up (joined, or joining, the group)
        self._health_changed()

    def _health_changed(self) -> None:
        if self.on_health_change is not None:
            self.on_health_change()

    @property
    def guard_problem(self) -> str:
        """What /readyz says while the dead-letter guard holds ('' when it does not)."""
        return self.guard.problem

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
        if task.cancelled() or task.exception() is None:
            return
        stopping = self._stopping.is_set()  # (then told, and the stop goes on)
        during = " while the group stopped" if stopping else ""
        log.error("group %s: task %s failed%s", self.name, task.get_name(), during,
                  exc_info=task.exception())  # fmt: skip
        if not stopping:
            self._failure = task.exception()
            self._stopping.set()
            self._health_changed()

    async def _shutdown(self) -> None:
        self._stopping.set()
        self._draining = True
        if self.push is not None:
            self.push.draining = True
        # Idle workers and loops go now; pushes and DLQ writes under way get the grace period.
        busy = (self.push.pushing if self.push else set()) | self._parking.tasks.keys()
        for task in self._tasks - busy:
            task.cancel()
        await self._handover.settle(busy, self._grace_s, lambda: self._parking.tasks.keys())
        remaining = list(self._tasks)
        for task in remaining:
            task.cancel()
        await asyncio.gather(*remaining, return_exceptions=True)
        self._handover.stopped(self.ready)
        await close_edges(self.name, self.commit, self.fetcher, self.writer, self.dispatcher)
        log.info("group %s: stopped", self.name)

    def _breaker_changed(self, old: str, new: str) -> None:
        self.metrics.circuit_open.labels(self.name).set(0 if new == "closed" else 1)
        self.metrics.breaker_transitions.labels(self.name, new).inc()
        if new == "open":
            last = (self.push.last_failure if self.push is not None else "")[:500] or "unknown"
            log.error("group %s: circuit open, delivery paused (messages wait, none is "
                      "dead-lettered); last failure: %s", self.name, last)  # fmt: skip
        self._health_changed()

    async def commit(self) -> int:
        """Commit every partition's done prefix and ack state; returns partitions committed."""
        return await self.committer.commit()

    # -- rebalance (called from the consumer thread through the loop) -------------------

    async def partitions_assigned(self, committed: Sequence[TopicPartition]) -> None:
        """New partitions, with the ack state restored from their commit metadata."""
        self._handover.assigned(committed)

    async def partitions_revoked(
        self, partitions: Sequence[TopicPartition]
    ) -> list[TopicPartition]:
        """Wait up to the revoke grace for in-flight calls, then hand back the final commits
        (``handover.Handover.revoked``)."""
        return await self._handover.revoked(partitions, self._draining)

    async def partitions_lost(self, partitions: Sequence[TopicPartition]) -> None:
        """Drop lost partitions without committing (``handover.Handover.lost``)."""
        await self._handover.lost(partitions)

    def snapshot(self) -> dict[str, Any]:
        """The group as the operator console shows it (``snapshot.group_snapshot``)."""
        return group_snapshot(
            self.name,
            started=self.started.is_set(),
            stopping=self._stopping.is_set(),
            partitions=self.partitions,
            breaker=self.breaker,
            push=self.push,
            limiter=self.limiter,
            adaptive=self.group.delivery.concurrency == "adaptive",
            pusher=self.dispatcher,
        )

    def assignment(self) -> list[TP]:
        """Partitions currently owned."""
        return list(self.partitions.parts)
